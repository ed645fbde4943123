// The emulated device suite: the GPU executor's kernels (csrc/cuda, unmodified) run on emulated PEs
// (csrc/emu), launched with the parameters runtime.cu computes (launch_params.h), and checked
// bit for bit against a reference that follows the canonical combine order of NOTE [epoch
// protocol] (local ranks in order, then recursive doubling with the lower node first), written
// here independently of the round.
//
//   emulate_driver [--quick] [--seed N] [--only SUBSTRING]... [--repeat K] [--list] [--barrier-selftest]
// Prints one line per case and, last, "emulated device: N cases passed, M failed (tsan: on|off)".
// Exit status 0 only if every case passed.
//   emulate_driver --ledger NxG SIZE [--algorithm A] [--dtype D] [--threads T] [--max-blocks B]
//                  [--block-bytes n] [--max-bytes n] [--pool-bytes n] [--ll-max-bytes n]
//                  [--oneshot-max n] [--channels n] [--kernel TEXT] [--device-code TEXT] [--seed N]
// Runs one call with the wire ledger on and prints its ledger (ledger.h) as one JSON document;
// scripts/emulate.sh --ledger passes nvrar.settings' GPU defaults (no default lives here).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <atomic>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "../cuda/launch_params.h"
#include "../protocol/call.h"
#include "../protocol/epilogue.h"
#include "emu.h"
#include "kernels.h"
#include "ledger.h"

// ThreadSanitizer calls __tsan_on_report inside its report, holding its thread registry: the
// count is atomic, since a plain counter raced by two reports would itself be reported from
// inside a report and deadlock the run instead of failing the case.
static std::atomic<int> g_tsan_reports{0};
#if defined(__SANITIZE_THREAD__)
extern "C" void __tsan_on_report(void*) { g_tsan_reports.fetch_add(1, std::memory_order_relaxed); }
constexpr bool kTsan = true;
#else
constexpr bool kTsan = false;
#endif

namespace nvrar {
namespace emu {
namespace {

using gpu::DeviceHandles;
using gpu::DeviceState;
using gpu::ErrorRecord;
using gpu::ExecutorGeometry;
using gpu::KernelParams;

constexpr size_t kCanary = 256;
constexpr unsigned char kCanaryByte = 0xc3;

struct Failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

#define EXPECT(cond, ...)                                             \
  do {                                                                \
    if (!(cond)) {                                                    \
      std::ostringstream os_;                                         \
      os_ << __VA_ARGS__;                                             \
      throw Failure(os_.str() + " [" #cond ", line " + std::to_string(__LINE__) + "]"); \
    }                                                                 \
  } while (0)

// ---------------------------------------------------------------------------------------------
// The reference: elementwise, in the canonical order.

template <typename T>
struct Ref {
  // Intra-node: sources in local-rank order, accumulated in acc_t<T>, one rounding.
  template <typename Op>
  static T local(const std::vector<T>& xs, Op op, const Scale* sc) {
    acc_t<T> a = load_acc(xs[0]);
    for (size_t k = 1; k < xs.size(); ++k) a = op(a, load_acc(xs[k]));
    if (sc != nullptr && sc->active()) a = sc->apply(a);
    return store_acc<T>(a);
  }
  template <typename Op>
  static T pair(T lo, T hi, Op op, const Scale* sc) {
    acc_t<T> a = op(load_acc(lo), load_acc(hi));
    if (sc != nullptr && sc->active()) a = sc->apply(a);
    return store_acc<T>(a);
  }
  // All ranks' values of one element (rank order) -> the result.
  template <typename Op>
  static T all(const std::vector<T>& v, int N, int G, Op op, Scale sc) {
    std::vector<T> node(static_cast<size_t>(N));
    for (int n = 0; n < N; ++n) {
      std::vector<T> xs(v.begin() + n * G, v.begin() + (n + 1) * G);
      node[static_cast<size_t>(n)] = local(xs, op, N == 1 ? &sc : nullptr);
    }
    if (N == 1) return node[0];
    int Np = 1;
    while (Np * 2 <= N) Np *= 2;
    for (int n = Np; n < N; ++n) node[static_cast<size_t>(n - Np)] = pair(node[static_cast<size_t>(n - Np)], node[static_cast<size_t>(n)], op, nullptr);
    int K = 0;
    while ((1 << K) < Np) ++K;
    for (int k = 0; k < K; ++k) {
      std::vector<T> next(node);
      for (int n = 0; n < Np; ++n) {
        const int p = n ^ (1 << k);
        const int lo = std::min(n, p), hi = std::max(n, p);
        next[static_cast<size_t>(n)] = pair(node[static_cast<size_t>(lo)], node[static_cast<size_t>(hi)], op, k == K - 1 ? &sc : nullptr);
      }
      node = next;
    }
    return node[0];
  }
};

template <typename T>
T random_value(std::mt19937_64& rng, RedOp op);
template <>
float random_value<float>(std::mt19937_64& rng, RedOp) {
  // Random mantissas over a few binades, both signs: the combine order changes the bits.
  const float m = std::uniform_real_distribution<float>(-1.0f, 1.0f)(rng);
  return std::ldexp(m, static_cast<int>(rng() % 7) - 3);
}
template <>
int32_t random_value<int32_t>(std::mt19937_64& rng, RedOp) {
  return static_cast<int32_t>(rng());
}
template <>
f16 random_value<f16>(std::mt19937_64& rng, RedOp op) {
  return to_f16(random_value<float>(rng, op));
}
template <>
bf16 random_value<bf16>(std::mt19937_64& rng, RedOp op) {
  return to_bf16(random_value<float>(rng, op));
}

// ---------------------------------------------------------------------------------------------
// An emulated GPU executor: every PE's configuration, segment, device state and error record.

struct Setup {
  int N = 2, G = 1;
  int max_blocks = 2;
  int channels = 2;  // GpuConfig::channels (the ledger: --channels or GPU_LAUNCH["channels"])
  int threads = 32;
  size_t max_bytes = 4096;
  size_t block_bytes = 1024;
  size_t ll_max_bytes = 0;
  size_t oneshot_max_bytes = 1024;
  size_t pool_bytes = 64 << 10;
  bool direct = false;
  double timeout_s = kTsan ? 120 : 30;  // every wait's deadline (ThreadSanitizer is 5-10x slower)
  uint64_t seed = 1;
  uint64_t epoch0 = 0;
  int max_delay_us = 30;  // the proxy's random delays (WorldConfig)
  size_t max_piece_bytes = 256;  // the proxy's largest piece of a put (WorldConfig)
  int stalled_pe = -1;           // the proxy stalls every operation from or to this PE (WorldConfig)
};

// --waves: every launch that is not cooperative (one block per channel: NOTE [epoch protocol],
// "Residency") runs in block waves on every PE, at most k blocks at once, 1 <= k < blocks drawn
// per PE and call from the case's seed (emu.h, launch_pe).
bool g_waves = false;
// --consistency: proxy-consistency mode (emu.h WorldConfig::consistency_delay_us): every write the
// proxy delivers stays invisible up to this long, or until the target's nvshmem_uint64_wait_until.
int g_consistency_us = 0;
std::atomic<uint64_t> g_wave_launches{0}, g_launches{0};  // PE launches in waves, all PE launches

struct Exec {
  Setup su;
  int W;
  uint64_t calls = 0;  // launches so far (the waves' draws)
  std::vector<ExecutorGeometry> geo;
  std::unique_ptr<World> world;
  std::vector<DeviceState> state;
  std::vector<ErrorRecord> err;
  std::vector<std::vector<char*>> peers;
  std::vector<double> timeout_s;  // per PE (a failure case shortens one)

  explicit Exec(const Setup& s) : su(s), W(s.N * s.G) {
    for (int r = 0; r < W; ++r) {
      gpu::GpuConfig c;
      c.rank = r;
      c.world = W;
      c.ranks_per_node = s.G;
      c.max_bytes = s.max_bytes;
      c.pool_bytes = s.pool_bytes;
      c.oneshot_max_bytes = s.oneshot_max_bytes;
      c.ll_max_bytes = s.ll_max_bytes;
      c.block_bytes = s.block_bytes;
      c.max_blocks = s.max_blocks;
      // In waves the channel count is the largest (4): more launches keep one block per channel
      // and are not cooperative, so they run in waves.
      c.channels = g_waves ? 4 : s.channels;
      c.threads = s.threads;
      c.timeout_s = s.timeout_s;
      geo.push_back(gpu::executor_geometry(c));
    }
    WorldConfig wc;
    wc.pes = W;
    wc.G = s.G;
    wc.direct_remote = s.direct;
    wc.seed = s.seed;
    wc.max_delay_us = s.max_delay_us;
    wc.max_piece_bytes = s.max_piece_bytes;
    wc.consistency_delay_us = g_consistency_us;
    wc.stalled_pe = s.stalled_pe;
    wc.segment_bytes = geo[0].layout.total_bytes;
    wc.barrier_timeout_s = s.timeout_s + 60;
    world.reset(new World(wc));
    state.assign(static_cast<size_t>(W), DeviceState{});
    err.assign(static_cast<size_t>(W), ErrorRecord{});
    for (auto& st : state) st.epoch = s.epoch0;
    peers.resize(static_cast<size_t>(W));
    for (int r = 0; r < W; ++r) {
      const int node = r / s.G;
      for (int h = 0; h < s.G; ++h) peers[static_cast<size_t>(r)].push_back(world->segment(node * s.G + h));
    }
    timeout_s.assign(static_cast<size_t>(W), s.timeout_s);
  }
  ~Exec() { world->quiet(); }

  char* seg(int r) const { return world->segment(r); }
  char* pool(int r) const { return seg(r) + geo[static_cast<size_t>(r)].layout.pool_off; }
  DeviceHandles handles(int r) {
    return DeviceHandles{seg(r), peers[static_cast<size_t>(r)].data(), &state[static_cast<size_t>(r)],
                         &err[static_cast<size_t>(r)]};
  }
  ExecutorGeometry geometry(int r) const {
    ExecutorGeometry g = geo[static_cast<size_t>(r)];
    g.cfg.timeout_s = timeout_s[static_cast<size_t>(r)];
    return g;
  }
};

// One rank's side of an all_reduce call.
struct CallArgs {
  size_t count = 0;
  DType dtype = DType::kFloat32;
  RedOp op = RedOp::kSum;
  Algorithm alg = Algorithm::kAuto;
  char* in = nullptr;
  char* out = nullptr;
  bool absent = false;  // this rank never launches
};

void dispatch_allreduce(const KernelParams& kp, DType dt, RedOp op) {
  switch (dt) {
    case DType::kFloat32: allreduce_kernel<float>(kp, op); return;
#if !defined(NVRAR_EMU_MINIMAL)
    case DType::kFloat16: allreduce_kernel<f16>(kp, op); return;
    case DType::kBFloat16: allreduce_kernel<bf16>(kp, op); return;
    case DType::kInt32: allreduce_kernel<int32_t>(kp, op); return;
#endif
    default: break;
  }
  std::fprintf(stderr, "this build has no %s kernel\n", dtype_name(dt));
  std::abort();
}

void dispatch_fused(const gpu::FusedParams& fp, DType dt) {
  switch (dt) {
    case DType::kFloat32: fused_kernel<float>(fp); return;
#if !defined(NVRAR_EMU_MINIMAL)
    case DType::kFloat16: fused_kernel<f16>(fp); return;
    case DType::kBFloat16: fused_kernel<bf16>(fp); return;
#endif
    default: break;
  }
  std::fprintf(stderr, "this build has no fused %s kernel\n", dtype_name(dt));
  std::abort();
}

// Launches one call on every PE (runtime.cu's host side: plan_call, then allreduce_params).
// chunk_override: a smaller chunk than the plan's (the epoch-advance cases), else 0.
void run_call_chunks(Exec& ex, const std::vector<CallArgs>& a, const std::vector<size_t>& chunks) {
  std::vector<KernelParams> kps(static_cast<size_t>(ex.W));
  std::vector<int> blocks(static_cast<size_t>(ex.W), 0);
  for (int r = 0; r < ex.W; ++r) {
    const CallArgs& c = a[static_cast<size_t>(r)];
    const ExecutorGeometry g = ex.geometry(r);
    const CallPlan p = plan_call(gpu::call_limits(g, ex.seg(r)), reinterpret_cast<uintptr_t>(c.in),
                                 reinterpret_cast<uintptr_t>(c.out), c.count, c.dtype, c.op, c.alg);
    kps[static_cast<size_t>(r)] = gpu::allreduce_params(p, reinterpret_cast<uintptr_t>(c.in),
                                                        reinterpret_cast<uintptr_t>(c.out), c.count, c.dtype, c.op, g,
                                                        ex.handles(r));
    if (chunks[static_cast<size_t>(r)] != 0) kps[static_cast<size_t>(r)].chunk_elems = chunks[static_cast<size_t>(r)];
    blocks[static_cast<size_t>(r)] = c.absent ? 0 : p.slices;
  }
  // A launch that gathers slices into channels is cooperative (allreduce_inst.cu): all at once.
  std::vector<int> resident(static_cast<size_t>(ex.W), 0);
  if (g_waves) {
    std::mt19937_64 rng(ex.su.seed * 0x9E3779B97F4A7C15ull + ++ex.calls);
    // One PE per call (in turn) runs one block at a time, the strongest case; the others draw k.
    const int one_at_a_time = static_cast<int>(ex.calls % static_cast<uint64_t>(ex.W));
    for (int r = 0; r < ex.W; ++r) {
      const int B = blocks[static_cast<size_t>(r)];
      if (B > 1 && !gpu::cooperative_launch(kps[static_cast<size_t>(r)].channels, B))
        resident[static_cast<size_t>(r)] = r == one_at_a_time ? 1 : 1 + static_cast<int>(rng() % static_cast<uint64_t>(B - 1));
      if (B > 0) ++g_launches;
      if (resident[static_cast<size_t>(r)] > 0) ++g_wave_launches;
    }
  }
  ex.world->launch(blocks, ex.su.threads, [&](int pe) {
    dispatch_allreduce(kps[static_cast<size_t>(pe)], a[static_cast<size_t>(pe)].dtype, a[static_cast<size_t>(pe)].op);
  }, resident);
}

void run_call(Exec& ex, const std::vector<CallArgs>& a, size_t chunk_override = 0) {
  std::vector<size_t> chunks(static_cast<size_t>(ex.W), chunk_override);
  run_call_chunks(ex, a, chunks);
}

std::string record_text(const ErrorRecord& e) {
  std::ostringstream os;
  os << "code " << e.code << " phase " << phase_name(static_cast<Phase>(e.phase)) << " step " << e.step << " peer "
     << e.peer << " origin " << e.origin << " epoch " << e.epoch << " observed " << e.observed << " detail 0x" << std::hex
     << e.detail << " got 0x" << e.got << " want 0x" << e.want << std::dec;
  return os.str();
}

void expect_no_errors(const Exec& ex) {
  for (int r = 0; r < ex.W; ++r)
    EXPECT(ex.err[static_cast<size_t>(r)].code == 0, "rank " << r << " recorded a failure: " << record_text(ex.err[static_cast<size_t>(r)]));
}

void fill_canary(char* p) { std::memset(p, kCanaryByte, kCanary); }
void expect_canary(const char* p, int r, const char* what) {
  for (size_t i = 0; i < kCanary; ++i)
    EXPECT(static_cast<unsigned char>(p[i]) == kCanaryByte,
           "rank " << r << ": the canary past its " << what << " was overwritten at byte " << i);
}

// NOTE [LL zones] (protocol/round.h): an LL zone only ever holds zeros or the packets of the round
// in flight, since every receiver zeroes the packets it unpacked. So once a call has ended on every
// PE, every LL zone of every PE is zeros: checked after each call of an LL case, which catches a
// receiver that does not zero whatever the proxy's timing (the epoch-wrap case's stale packet is
// taken only where the receiver polls before the new one lands).
void expect_ll_zones_zero(const Exec& ex) {
  for (int r = 0; r < ex.W; ++r) {
    const SegmentLayout& L = ex.geo[static_cast<size_t>(r)].layout;
    const size_t words = 2 * static_cast<size_t>(L.S) * L.ll_bytes / sizeof(uint64_t);
    const auto* z = reinterpret_cast<const uint64_t*>(ex.seg(r) + L.llzones_off);
    for (size_t i = 0; i < words; ++i)
      EXPECT(__atomic_load_n(&z[i], __ATOMIC_RELAXED) == 0,
             "rank " << r << ": LL zone word " << i << " holds a packet after the call (0x" << std::hex << z[i]
                     << std::dec << "; NOTE [LL zones])");
  }
}

// ---------------------------------------------------------------------------------------------
// Cases.

struct Case {
  std::string name;
  std::function<void(uint64_t seed)> run;
};

struct ReduceSpec {
  int N, G;
  DType dt;
  RedOp op;
  Algorithm alg;
  size_t count;
  int max_blocks = 2;
  int threads = 32;
  size_t ll = 0;         // ll_max_bytes
  bool in_pool = false;  // the input lies in the pool (zero-copy)
  bool out_pool = false;
  bool in_place = false;
  bool direct = false;   // nvshmem_ptr non-null across nodes
  int calls = 2;
  uint64_t epoch0 = 0;
  size_t block_bytes = 1024;
  size_t max_bytes = 4096;
  uint64_t jump = 0;      // after the first half of the calls, advance every device epoch by this
};

template <typename T, typename Op>
void check_results(const ReduceSpec& s, const std::vector<std::vector<T>>& ins, const std::vector<const char*>& outs,
                   Op op) {
  const int W = s.N * s.G;
  const Scale sc = make_scale(s.op, W);
  std::vector<T> col(static_cast<size_t>(W));
  for (size_t i = 0; i < s.count; ++i) {
    for (int r = 0; r < W; ++r) col[static_cast<size_t>(r)] = ins[static_cast<size_t>(r)][i];
    const T want = Ref<T>::all(col, s.N, s.G, op, sc);
    for (int r = 0; r < W; ++r) {
      T got;
      std::memcpy(&got, outs[static_cast<size_t>(r)] + i * sizeof(T), sizeof(T));
      EXPECT(std::memcmp(&got, &want, sizeof(T)) == 0, "rank " << r << " element " << i << " of " << s.count
                                                             << ": bits differ from the canonical reference");
    }
  }
}

template <typename T>
void run_reduce_t(const ReduceSpec& s, uint64_t seed) {
  Setup su;
  su.N = s.N;
  su.G = s.G;
  su.max_blocks = s.max_blocks;
  su.threads = s.threads;
  su.ll_max_bytes = s.ll;
  su.direct = s.direct;
  su.seed = seed;
  su.epoch0 = s.epoch0;
  su.block_bytes = s.block_bytes;
  su.max_bytes = s.max_bytes;
  su.pool_bytes = std::max<size_t>(64 << 10, 2 * (s.count * sizeof(T) + 2 * kCanary) + 4096);
  Exec ex(su);
  const int W = ex.W;
  const size_t bytes = s.count * sizeof(T);
  std::mt19937_64 rng(seed * 7919 + 17);
  std::vector<std::vector<char>> priv_in(static_cast<size_t>(W)), priv_out(static_cast<size_t>(W));
  for (int call = 0; call < s.calls; ++call) {
    if (s.jump != 0 && call == s.calls / 2)
      for (auto& st : ex.state) st.epoch += s.jump;  // as if `jump` calls had not touched these zones
    std::vector<std::vector<T>> ins(static_cast<size_t>(W));
    std::vector<CallArgs> args(static_cast<size_t>(W));
    std::vector<const char*> outs(static_cast<size_t>(W));
    for (int r = 0; r < W; ++r) {
      auto& v = ins[static_cast<size_t>(r)];
      v.resize(s.count);
      for (auto& x : v) x = random_value<T>(rng, s.op);
      CallArgs& c = args[static_cast<size_t>(r)];
      c.count = s.count;
      c.dtype = s.dt;
      c.op = s.op;
      c.alg = s.alg;
      char* in;
      char* out;
      if (s.in_pool) {
        in = ex.pool(r);
      } else {
        priv_in[static_cast<size_t>(r)].assign(bytes + kCanary, 0);
        in = priv_in[static_cast<size_t>(r)].data();
      }
      if (s.in_place) {
        out = in;
      } else if (s.out_pool) {
        out = ex.pool(r) + align_up(bytes + kCanary, 256);
      } else {
        priv_out[static_cast<size_t>(r)].assign(bytes + kCanary, 0);
        out = priv_out[static_cast<size_t>(r)].data();
      }
      std::memcpy(in, v.data(), bytes);
      fill_canary(in + bytes);
      if (out != in) {
        std::memset(out, 0x5a, bytes);
        fill_canary(out + bytes);
      }
      c.in = in;
      c.out = out;
      outs[static_cast<size_t>(r)] = out;
    }
    run_call(ex, args);
    expect_no_errors(ex);
    if (s.ll != 0) expect_ll_zones_zero(ex);
    for (int r = 0; r < W; ++r) {
      expect_canary(args[static_cast<size_t>(r)].out + bytes, r, "output");
      if (args[static_cast<size_t>(r)].in != args[static_cast<size_t>(r)].out) expect_canary(args[static_cast<size_t>(r)].in + bytes, r, "input");
    }
    switch (s.op) {
      case RedOp::kSum:
      case RedOp::kAvg: check_results(s, ins, outs, OpSum{}); break;
      case RedOp::kMax: check_results(s, ins, outs, OpMax{}); break;
      case RedOp::kMin: check_results(s, ins, outs, OpMin{}); break;
    }
  }
  const uint64_t nchunks_per_call = 0;  // (epochs are checked through the flags of the next call)
  (void)nchunks_per_call;
}

void run_reduce(const ReduceSpec& s, uint64_t seed) {
  switch (s.dt) {
    case DType::kFloat32: run_reduce_t<float>(s, seed); return;
    case DType::kFloat16: run_reduce_t<f16>(s, seed); return;
    case DType::kBFloat16: run_reduce_t<bf16>(s, seed); return;
    case DType::kInt32: run_reduce_t<int32_t>(s, seed); return;
  }
}

std::string spec_name(const ReduceSpec& s) {
  std::ostringstream os;
  os << s.N << "x" << s.G << " " << dtype_name(s.dt) << " " << op_name(s.op) << " " << algorithm_name(s.alg) << " n="
     << s.count << (s.ll ? " ll" : " put-signal") << (s.direct ? " direct" : "") << " blocks<=" << s.max_blocks << " t="
     << s.threads << (s.in_pool ? " in-pool" : "") << (s.out_pool ? " out-pool" : "") << (s.in_place ? " in-place" : "")
     << (s.epoch0 ? " epoch0=" + std::to_string(s.epoch0) : "") << (s.jump ? " jump=" + std::to_string(s.jump) : "");
  return os.str();
}

// The fused all-reduce + add + RMSNorm against the host reference: the canonical sum, then
// add_rms_norm_row (protocol/epilogue.h), the CPU executor's row function.
template <typename T>
void run_fused_t(int N, int G, Algorithm alg, size_t rows, size_t h, int threads, size_t ll, uint64_t seed, DType dt) {
  Setup su;
  su.N = N;
  su.G = G;
  su.threads = threads;
  su.max_blocks = 1;
  su.ll_max_bytes = ll;
  su.seed = seed;
  Exec ex(su);
  const int W = ex.W;
  const size_t n = rows * h;
  const float eps = 1e-5f;
  std::mt19937_64 rng(seed * 31 + 5);
  std::vector<T> w(h);
  for (auto& x : w) x = random_value<T>(rng, RedOp::kSum);
  for (int call = 0; call < 2; ++call) {
    std::vector<std::vector<T>> x(static_cast<size_t>(W)), res(static_cast<size_t>(W));
    std::vector<std::vector<char>> xb(static_cast<size_t>(W)), rb(static_cast<size_t>(W));
    std::vector<T> res_in(n);
    for (auto& v : res_in) v = random_value<T>(rng, RedOp::kSum);
    std::vector<gpu::FusedParams> fps(static_cast<size_t>(W));
    for (int r = 0; r < W; ++r) {
      x[static_cast<size_t>(r)].resize(n);
      for (auto& v : x[static_cast<size_t>(r)]) v = random_value<T>(rng, RedOp::kSum);
      xb[static_cast<size_t>(r)].assign(n * sizeof(T) + kCanary, 0);
      rb[static_cast<size_t>(r)].assign(n * sizeof(T) + kCanary, 0);
      std::memcpy(xb[static_cast<size_t>(r)].data(), x[static_cast<size_t>(r)].data(), n * sizeof(T));
      std::memcpy(rb[static_cast<size_t>(r)].data(), res_in.data(), n * sizeof(T));
      fill_canary(xb[static_cast<size_t>(r)].data() + n * sizeof(T));
      fill_canary(rb[static_cast<size_t>(r)].data() + n * sizeof(T));
      fps[static_cast<size_t>(r)] = gpu::fused_params(ex.geometry(r), ex.handles(r), reinterpret_cast<uintptr_t>(xb[static_cast<size_t>(r)].data()),
                                                      reinterpret_cast<uintptr_t>(rb[static_cast<size_t>(r)].data()),
                                                      reinterpret_cast<uintptr_t>(w.data()), rows, h, dt, eps, alg);
    }
    ex.world->launch(std::vector<int>(static_cast<size_t>(W), 1), threads,
                     [&](int pe) { dispatch_fused(fps[static_cast<size_t>(pe)], dt); });
    expect_no_errors(ex);
    // Reference.
    std::vector<T> sum(n), want_x(n), want_res(n), col(static_cast<size_t>(W));
    for (size_t i = 0; i < n; ++i) {
      for (int r = 0; r < W; ++r) col[static_cast<size_t>(r)] = x[static_cast<size_t>(r)][i];
      sum[i] = Ref<T>::all(col, N, G, OpSum{}, make_scale(RedOp::kSum, 1));
    }
    for (size_t row = 0; row < rows; ++row)
      add_rms_norm_row(want_x.data() + row * h, want_res.data() + row * h, sum.data() + row * h,
                       res_in.data() + row * h, w.data(), h, eps);
    for (int r = 0; r < W; ++r) {
      EXPECT(std::memcmp(xb[static_cast<size_t>(r)].data(), want_x.data(), n * sizeof(T)) == 0,
             "rank " << r << ": the normalized output differs from the host reference");
      EXPECT(std::memcmp(rb[static_cast<size_t>(r)].data(), want_res.data(), n * sizeof(T)) == 0,
             "rank " << r << ": the residual differs from the host reference");
      expect_canary(xb[static_cast<size_t>(r)].data() + n * sizeof(T), r, "x");
      expect_canary(rb[static_cast<size_t>(r)].data() + n * sizeof(T), r, "residual");
    }
  }
}

// Failure paths.

// PE `victim` never launches. `waiter` (a rank that waits for it directly) has a short deadline,
// the others a long one: the waiter records the timeout naming the victim, and every other rank
// ends with the waiter's abort (across nodes through the proxy).
// The failure cases' call: 512 float32 ones in place, two-shot, on every rank but `absent` (-1:
// none), with at most 2 blocks; the buffers (canary room included) in `buf`.
std::vector<CallArgs> ones_call(int W, int absent, std::vector<std::vector<float>>* buf) {
  const size_t count = 512;
  buf->assign(static_cast<size_t>(W), std::vector<float>(count + kCanary / 4, 1.0f));
  std::vector<CallArgs> args(static_cast<size_t>(W));
  for (int r = 0; r < W; ++r) {
    CallArgs& c = args[static_cast<size_t>(r)];
    c.count = count;
    c.alg = Algorithm::kTwoShot;
    c.in = c.out = reinterpret_cast<char*>((*buf)[static_cast<size_t>(r)].data());
    c.absent = r == absent;
  }
  return args;
}

void run_absent(int N, int G, int victim, int waiter, Phase phase, int step, size_t ll, uint64_t seed) {
  Setup su;
  su.N = N;
  su.G = G;
  su.ll_max_bytes = ll;
  su.seed = seed;
  su.max_blocks = 2;
  su.timeout_s = 60;
  Exec ex(su);
  ex.timeout_s[static_cast<size_t>(waiter)] = 1.0;
  const int W = ex.W;
  std::vector<std::vector<float>> buf;
  std::vector<CallArgs> args = ones_call(W, victim, &buf);
  const auto t0 = std::chrono::steady_clock::now();
  run_call(ex, args);
  ex.world->quiet();
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const ErrorRecord& we = ex.err[static_cast<size_t>(waiter)];
  EXPECT(we.code == gpu::kTimeoutCode && we.published == 1, "rank " << waiter << " should record a timeout: " << record_text(we));
  EXPECT(we.peer == victim && we.phase == static_cast<uint32_t>(phase) && we.step == step && we.origin == waiter,
         "rank " << waiter << "'s timeout names the wrong peer/phase/step: " << record_text(we) << " (want peer " << victim
                 << " phase " << phase_name(phase) << " step " << step << ")");
  for (int r = 0; r < W; ++r) {
    const ErrorRecord& e = ex.err[static_cast<size_t>(r)];
    if (r == victim) continue;
    EXPECT(e.code != 0 && e.published == 1, "rank " << r << " was not aborted: " << record_text(e));
    EXPECT(ex.state[static_cast<size_t>(r)].err_claim == e.code, "rank " << r << ": the claim " << ex.state[static_cast<size_t>(r)].err_claim
                                                                          << " is not the recorded kind " << e.code);
    if (r != waiter) {
      EXPECT(e.code == gpu::kTimeoutCode && e.origin == waiter,
             "rank " << r << " should end with rank " << waiter << "'s abort (origin " << waiter << "): " << record_text(e));
    }
  }
  EXPECT(took < 30, "the abort took " << took << " s to reach every rank");
}

// NOTE [loud after failure] (device.cuh): after a failed call, the same call launched again on
// every PE without any host check (a CUDA-graph replay) runs no round -- every PE's segment is
// bitwise unchanged -- and every PE traps (the emulated context's sticky error), the absent rank
// of the failed call too (it records the abort it finds at entry).
void run_replay_after_failure(int N, int G, int victim, int waiter, size_t ll, bool fused, uint64_t seed) {
  Setup su;
  su.N = N;
  su.G = G;
  su.ll_max_bytes = ll;
  su.seed = seed;
  su.max_blocks = 2;
  Exec ex(su);
  ex.timeout_s[static_cast<size_t>(waiter)] = 1.0;
  const int W = ex.W;
  std::vector<std::vector<float>> buf;
  std::vector<CallArgs> args = ones_call(W, victim, &buf);
  run_call(ex, args);
  ex.world->quiet();
  for (int r = 0; r < W; ++r) {
    EXPECT(r == victim || ex.err[static_cast<size_t>(r)].code != 0,
           "rank " << r << " recorded no failure in the failed call: " << record_text(ex.err[static_cast<size_t>(r)]));
    // (In block waves a block that starts after an earlier block of the same launch failed
    // traps at entry: the failed call itself ends in the trap there.)
    EXPECT(g_waves || !ex.world->trapped(r), "rank " << r << " trapped in the failed call itself");
    ex.world->reset_trapped(r);
  }
  // The replay: every rank, the absent one too, launches the same kernel again; no host check.
  std::vector<std::vector<char>> before(static_cast<size_t>(W));
  for (int r = 0; r < W; ++r) before[static_cast<size_t>(r)].assign(ex.seg(r), ex.seg(r) + ex.geo[0].layout.total_bytes);
  const std::vector<std::vector<float>> out_before = buf;
  for (auto& c : args) c.absent = false;
  if (fused) {
    std::vector<gpu::FusedParams> fps;
    const size_t count = args[0].count, h = 64, rows = count / h;
    std::vector<std::vector<float>> res(static_cast<size_t>(W), std::vector<float>(count, 0.5f)), w(static_cast<size_t>(W), std::vector<float>(h, 1.0f));
    for (int r = 0; r < W; ++r)
      fps.push_back(gpu::fused_params(ex.geometry(r), ex.handles(r), reinterpret_cast<uintptr_t>(buf[static_cast<size_t>(r)].data()),
                                      reinterpret_cast<uintptr_t>(res[static_cast<size_t>(r)].data()),
                                      reinterpret_cast<uintptr_t>(w[static_cast<size_t>(r)].data()), rows, h, DType::kFloat32, 1e-5f,
                                      Algorithm::kTwoShot));
    ex.world->launch(std::vector<int>(static_cast<size_t>(W), 1), 64, [&](int pe) {
      dispatch_fused(fps[static_cast<size_t>(pe)], DType::kFloat32);
    });
  } else {
    run_call(ex, args);
  }
  ex.world->quiet();
  for (int r = 0; r < W; ++r) {
    EXPECT(ex.world->trapped(r), "rank " << r << " ran the replay after the failure without trapping");
    EXPECT(std::memcmp(before[static_cast<size_t>(r)].data(), ex.seg(r), before[static_cast<size_t>(r)].size()) == 0,
           "rank " << r << "'s segment changed: the replay touched slots after the failure");
    EXPECT(buf[static_cast<size_t>(r)] == out_before[static_cast<size_t>(r)], "rank " << r << "'s buffer changed in the replay");
    const ErrorRecord& e = ex.err[static_cast<size_t>(r)];
    EXPECT(e.code != 0 && e.published == 1, "rank " << r << " has no record after the replay: " << record_text(e));
  }
  const ErrorRecord& v = ex.err[static_cast<size_t>(victim)];
  EXPECT(v.origin == waiter, "the absent rank " << victim << " should name rank " << waiter << " as the origin: " << record_text(v));
}

// A stalled proxy (emu.h WorldConfig::stalled_pe): nothing from or to PE `stalled` is delivered or
// acknowledged. Every PE, the stalled one included, must record a failure and every block of every
// PE return within the deadline (1 s) plus 1 s: no wait without a deadline, fail() included (its
// remote aborts to the stalled PE stay queued: fail() must not wait for them).
void run_stalled(int N, int G, int stalled, size_t ll, uint64_t seed) {
  Setup su;
  su.N = N;
  su.G = G;
  su.ll_max_bytes = ll;
  su.seed = seed;
  su.max_blocks = 2;
  su.timeout_s = 1.0;
  su.stalled_pe = stalled;
  Exec ex(su);
  const int W = ex.W;
  std::vector<std::vector<float>> buf;
  std::vector<CallArgs> args = ones_call(W, -1, &buf);
  const auto t0 = std::chrono::steady_clock::now();
  run_call(ex, args);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (int r = 0; r < W; ++r) {
    const ErrorRecord& e = ex.err[static_cast<size_t>(r)];
    EXPECT(e.code != 0 && e.published == 1, "rank " << r << " recorded no failure: " << record_text(e));
  }
  // The stalled PE's inter-node partner in the first exchange waits for it across nodes.
  const int partner = (stalled / G ^ 1) * G + stalled % G;
  if (partner < W) {
    const ErrorRecord& pe = ex.err[static_cast<size_t>(partner)];
    EXPECT(pe.origin == partner ? pe.code == gpu::kTimeoutCode && pe.phase == static_cast<uint32_t>(Phase::kInterNode)
                                : pe.code != 0,
           "rank " << partner << " (the stalled PE's partner): " << record_text(pe));
  }
  // (ThreadSanitizer runs the emulated threads 5-10x slower: 4 s there.)
  const double slack = kTsan ? 4.0 : 1.0;
  EXPECT(took < su.timeout_s + slack, "every block returned only after " << took << " s (deadline " << su.timeout_s
                                                                         << " s + " << slack << " s)");
}

// Rank `odd` makes another call than the others (one field of the call description differs):
// every rank records a failure (a mismatch where it meets the odd one, an abort elsewhere), no
// timeout, no write past any buffer.
struct Mismatch {
  std::string field;
  std::function<void(CallArgs&)> change;
  bool half_chunk = false;  // the odd rank's rounds have half the elements (the description's n)
};

void run_mismatch(int N, int G, int odd, const Mismatch& m, size_t ll, size_t count, uint64_t seed,
                  bool direct = false) {
  Setup su;
  su.N = N;
  su.G = G;
  su.direct = direct;
  su.ll_max_bytes = ll;
  su.seed = seed;
  su.timeout_s = 20;
  Exec ex(su);
  const int W = ex.W;
  std::vector<std::vector<char>> in(static_cast<size_t>(W)), out(static_cast<size_t>(W));
  std::vector<CallArgs> args(static_cast<size_t>(W));
  std::vector<size_t> bytes(static_cast<size_t>(W));
  for (int r = 0; r < W; ++r) {
    CallArgs& c = args[static_cast<size_t>(r)];
    c.count = count;
    c.dtype = DType::kFloat32;
    c.op = RedOp::kSum;
    c.alg = Algorithm::kTwoShot;
    if (r == odd) m.change(c);
    bytes[static_cast<size_t>(r)] = c.count * static_cast<size_t>(dtype_size(c.dtype));
    in[static_cast<size_t>(r)].assign(bytes[static_cast<size_t>(r)] + kCanary, 1);
    out[static_cast<size_t>(r)].assign(bytes[static_cast<size_t>(r)] + kCanary, 0);
    fill_canary(in[static_cast<size_t>(r)].data() + bytes[static_cast<size_t>(r)]);
    fill_canary(out[static_cast<size_t>(r)].data() + bytes[static_cast<size_t>(r)]);
    c.in = in[static_cast<size_t>(r)].data();
    c.out = out[static_cast<size_t>(r)].data();
  }
  std::vector<size_t> chunks(static_cast<size_t>(W), 0);
  if (m.half_chunk) chunks[static_cast<size_t>(odd)] = ex.geo[0].cfg.max_bytes / 4 / 2;
  run_call_chunks(ex, args, chunks);
  ex.world->quiet();
  int mismatches = 0;
  for (int r = 0; r < W; ++r) {
    const ErrorRecord& e = ex.err[static_cast<size_t>(r)];
    EXPECT(e.code != 0 && e.published == 1, "rank " << r << " did not raise on a " << m.field << " mismatch: " << record_text(e));
    EXPECT(e.code == gpu::kMismatchCode, "rank " << r << " raised another failure than the mismatch: " << record_text(e));
    if (e.origin == r) ++mismatches;
    expect_canary(in[static_cast<size_t>(r)].data() + bytes[static_cast<size_t>(r)], r, "input");
    expect_canary(out[static_cast<size_t>(r)].data() + bytes[static_cast<size_t>(r)], r, "output");
  }
  EXPECT(mismatches >= 1, "no rank detected the " << m.field << " mismatch itself");
}

// The signature collision of NOTE [call description]: counts 100000 and 131409 (float32, two-shot)
// share the 16-bit signature. The outputs lie in the pool, where local peers push their finished
// shards: unless the full description is compared first, the rank with the larger count pushes
// past the other's buffer. Every rank must raise a mismatch, and the canary past every pool
// buffer must be intact.
// Across nodes (G = 1: no in-node flag at all) the inter cells and LL streams carry the
// description (ll: every inter-node step on LL packets; direct: nvshmem_ptr reaches every PE).
void run_collision(int N, int G, int odd, uint64_t seed, bool ll = false, bool direct = false) {
  EXPECT(call_signature(100000, 0, 0, 1) == call_signature(131409, 0, 0, 1), "the collision is gone: pick another pair");
  Setup su;
  su.N = N;
  su.G = G;
  su.seed = seed;
  su.direct = direct;
  if (ll) su.ll_max_bytes = 64 << 10;
  su.timeout_s = 20;
  su.max_blocks = 4;
  su.max_bytes = 64 << 10;
  su.block_bytes = 16 << 10;
  su.pool_bytes = 131409 * 4 + 2 * kCanary + 4096;
  Exec ex(su);
  const int W = ex.W;
  std::vector<std::vector<char>> in(static_cast<size_t>(W));
  std::vector<CallArgs> args(static_cast<size_t>(W));
  std::vector<size_t> bytes(static_cast<size_t>(W));
  for (int r = 0; r < W; ++r) {
    CallArgs& c = args[static_cast<size_t>(r)];
    c.count = r == odd ? 131409 : 100000;
    c.alg = Algorithm::kTwoShot;
    bytes[static_cast<size_t>(r)] = c.count * 4;
    in[static_cast<size_t>(r)].assign(bytes[static_cast<size_t>(r)], 1);
    c.in = in[static_cast<size_t>(r)].data();
    c.out = ex.pool(r);
    std::memset(c.out, 0, bytes[static_cast<size_t>(r)]);
    fill_canary(c.out + bytes[static_cast<size_t>(r)]);
  }
  run_call(ex, args);
  ex.world->quiet();
  for (int r = 0; r < W; ++r) {
    const ErrorRecord& e = ex.err[static_cast<size_t>(r)];
    EXPECT(e.code == gpu::kMismatchCode && e.published == 1,
           "rank " << r << " did not raise the 100000 vs 131409 mismatch: " << record_text(e));
    expect_canary(args[static_cast<size_t>(r)].out + bytes[static_cast<size_t>(r)], r, "pool output");
  }
  // The ranks that caught it themselves say what differed: the count, word 0 of the description
  // (the signatures are equal), the peer's count against theirs.
  int caught = 0;
  for (int r = 0; r < W; ++r) {
    const ErrorRecord& e = ex.err[static_cast<size_t>(r)];
    if (e.origin != r) continue;
    ++caught;
    const unsigned what = e.detail & 0xffu, k = (e.detail >> 8) & 0xffu;
    EXPECT((what == gpu::kMismatchCellDesc || what == gpu::kMismatchTrailer || what == gpu::kMismatchLLDesc) && k == 0,
           "rank " << r << ": the mismatch does not name the count: " << record_text(e));
    const unsigned long long mine = r == odd ? 131409 : 100000, theirs = r == odd ? 100000 : 131409;
    EXPECT(e.want == mine && e.got == theirs, "rank " << r << ": the recorded counts are wrong: " << record_text(e));
  }
  EXPECT(caught > 0, "no rank recorded the mismatch as its own");
}

// A fused call on which one rank differs in h (same element count) or eps.
void run_fused_mismatch(int G, bool h_differs, uint64_t seed) {
  Setup su;
  su.N = 1;
  su.G = G;
  su.threads = 64;
  su.max_blocks = 1;
  su.seed = seed;
  su.timeout_s = 20;
  Exec ex(su);
  const int W = ex.W;
  std::vector<std::vector<float>> x(static_cast<size_t>(W), std::vector<float>(256 + kCanary, 1.0f));
  std::vector<std::vector<float>> res(static_cast<size_t>(W), std::vector<float>(256 + kCanary, 0.5f));
  std::vector<float> w(64, 1.0f);
  std::vector<gpu::FusedParams> fps(static_cast<size_t>(W));
  for (int r = 0; r < W; ++r) {
    const bool odd = r == W - 1;
    const size_t h = odd && h_differs ? 32 : 64;
    const float eps = odd && !h_differs ? 1e-6f : 1e-5f;
    fps[static_cast<size_t>(r)] = gpu::fused_params(ex.geometry(r), ex.handles(r), reinterpret_cast<uintptr_t>(x[static_cast<size_t>(r)].data()),
                                                    reinterpret_cast<uintptr_t>(res[static_cast<size_t>(r)].data()),
                                                    reinterpret_cast<uintptr_t>(w.data()), 256 / h, h, DType::kFloat32, eps,
                                                    Algorithm::kTwoShot);
  }
  ex.world->launch(std::vector<int>(static_cast<size_t>(W), 1), 64,
                   [&](int pe) { dispatch_fused(fps[static_cast<size_t>(pe)], DType::kFloat32); });
  ex.world->quiet();
  for (int r = 0; r < W; ++r) {
    const ErrorRecord& e = ex.err[static_cast<size_t>(r)];
    EXPECT(e.code == gpu::kMismatchCode && e.published == 1,
           "rank " << r << " did not raise the fused " << (h_differs ? "h" : "eps") << " mismatch: " << record_text(e));
  }
}

void barrier_selftest() {
  WorldConfig wc;
  wc.pes = 1;
  wc.segment_bytes = 4096;
  wc.barrier_timeout_s = 1.0;
  World w(wc);
  std::fprintf(stderr, "barrier self-test: thread 5 of block 0 skips a __syncthreads\n");
  w.launch({1}, 32, [](int) {
    if (threadIdx.x != 5) __syncthreads();
  });
  std::fprintf(stderr, "barrier self-test: the barrier did not abort\n");
}

// ---------------------------------------------------------------------------------------------
// The wire ledger (ledger.h, docs/gpu/emulation.md "Wire ledger"): one call with the raw
// operations recorded, checked bit for bit, then attributed.

struct LedgerSpec {
  int N = 2, G = 4;
  DType dt = DType::kFloat32;
  Algorithm alg = Algorithm::kAuto;
  size_t size = 128 << 10;  // bytes
  int threads = 32;
  int max_blocks = 0;  // 0: not given (every value below comes from the caller: emulate.sh reads nvrar.settings)
  size_t block_bytes = 0, max_bytes = 0, pool_bytes = 0, ll_max_bytes = 0, oneshot_max = 0;
  bool have_ll = false, have_oneshot = false;
  int channels = -1;  // -1: not configured (one message per block)
  std::string kernel = "unknown";
  std::string device_code = "unknown";  // the last commit that changed the device code
  bool direct = false;
  int absent = -1;     // a PE that never launches (the fail() budget: every other PE ends aborted)
  int waiter = -1;     // the PE with a short deadline that records the timeout
};

struct LedgerRun {
  ledger::Ledger led;
  ledger::PlanInfo plan;
  std::string json;
};

template <typename T>
LedgerRun run_ledger_t(const LedgerSpec& ls, uint64_t seed) {
  EXPECT(ls.max_blocks > 0 && ls.block_bytes > 0 && ls.max_bytes > 0 && ls.have_ll && ls.have_oneshot,
         "--ledger needs --max-blocks, --block-bytes, --max-bytes, --ll-max-bytes and --oneshot-max (emulate.sh reads "
         "them from nvrar.settings)");
  EXPECT(ls.size % sizeof(T) == 0 && ls.size > 0, "size " << ls.size << " is not a whole number of elements");
  Setup su;
  su.N = ls.N;
  su.G = ls.G;
  su.max_blocks = ls.max_blocks;
  if (ls.channels > 0) su.channels = ls.channels;
  su.threads = ls.threads;
  su.max_bytes = ls.max_bytes;
  su.block_bytes = ls.block_bytes;
  su.ll_max_bytes = ls.ll_max_bytes;
  su.oneshot_max_bytes = ls.oneshot_max;
  su.pool_bytes = ls.pool_bytes;
  su.direct = ls.direct;
  su.seed = seed;
  // Counts do not depend on the proxy's timing or pieces: no delays, pieces up to 64 KiB (tens of
  // thousands of emulated threads share a few cores), and long deadlines.
  su.max_delay_us = 0;
  su.max_piece_bytes = 64 << 10;
  su.timeout_s = 600;
  Exec ex(su);
  if (ls.waiter >= 0) ex.timeout_s[static_cast<size_t>(ls.waiter)] = 1.0;
  const int W = ex.W;
  const size_t count = ls.size / sizeof(T);
  std::mt19937_64 rng(seed * 7919 + 17);
  std::vector<std::vector<T>> ins(static_cast<size_t>(W));
  std::vector<std::vector<char>> outb(static_cast<size_t>(W));
  std::vector<CallArgs> args(static_cast<size_t>(W));
  std::vector<const char*> outs(static_cast<size_t>(W));
  for (int r = 0; r < W; ++r) {
    auto& v = ins[static_cast<size_t>(r)];
    v.resize(count);
    for (auto& x : v) x = random_value<T>(rng, RedOp::kSum);
    outb[static_cast<size_t>(r)].assign(ls.size, 0);
    CallArgs& c = args[static_cast<size_t>(r)];
    c.count = count;
    c.dtype = ls.dt;
    c.op = RedOp::kSum;
    c.alg = ls.alg;
    c.in = reinterpret_cast<char*>(v.data());
    c.out = outb[static_cast<size_t>(r)].data();
    c.absent = r == ls.absent;
    outs[static_cast<size_t>(r)] = c.out;
  }
  // The plan, as every rank computes it (run_call does the same per rank).
  const ExecutorGeometry g = ex.geometry(0);
  const CallPlan plan = plan_call(gpu::call_limits(g, ex.seg(0)), reinterpret_cast<uintptr_t>(args[0].in),
                                  reinterpret_cast<uintptr_t>(args[0].out), count, ls.dt, RedOp::kSum, ls.alg);
  ex.world->set_recording(true);
  run_call(ex, args);
  ex.world->set_recording(false);
  ex.world->quiet();
  if (ls.absent < 0) {
    expect_no_errors(ex);
    ReduceSpec rs{ls.N, ls.G, ls.dt, RedOp::kSum, plan.algorithm, count};
    check_results(rs, ins, outs, OpSum{});
  } else {
    for (int r = 0; r < W; ++r)
      EXPECT(r == ls.absent || ex.err[static_cast<size_t>(r)].code != 0, "rank " << r << " was not aborted: "
                                                                               << record_text(ex.err[static_cast<size_t>(r)]));
  }
  LedgerRun out;
  const bool one_shot = plan.algorithm == Algorithm::kOneShot;
  // The call's own slot strides (launch_params.h call_strides), by which its puts land.
  const RoundConfig call_cfg =
      gpu::allreduce_params(plan, reinterpret_cast<uintptr_t>(args[0].in), reinterpret_cast<uintptr_t>(args[0].out),
                            count, ls.dt, RedOp::kSum, g, ex.handles(0))
          .cfg;
  const SegmentLayout& call_layout = call_cfg.L;
  out.led = ledger::attribute(ex.world->take_wire_ops(), call_layout, ls.N, ls.G, one_shot);
  ledger::PlanInfo& pi = out.plan;
  pi.algorithm = algorithm_name(plan.algorithm);
  pi.chunks = ceil_div(count, plan.chunk_elems);
  pi.blocks = static_cast<uint64_t>(plan.slices);
  pi.chunk_bytes = plan.chunk_elems * sizeof(T);
  pi.max_bytes = g.cfg.max_bytes;
  pi.pool_bytes = g.layout.pool_bytes;
  pi.ll_max_bytes = g.round.ll_max_bytes;
  pi.oneshot_max = g.cfg.oneshot_max_bytes;
  pi.channels = ls.channels;
  // Per slice of the first chunk: its bytes, and its inter-node payload (a shard, or the slice).
  const size_t n0 = std::min(count, plan.chunk_elems);
  std::vector<size_t> payload;
  for (int b = 0; b < plan.slices; ++b) {
    const Range sl = SegmentLayout::chunk_slice(n0, plan.chunk_elems, static_cast<int>(sizeof(T)), plan.slices, b);
    pi.slice_bytes.push_back(sl.size() * sizeof(T));
    payload.push_back(one_shot ? sl.size() * sizeof(T)
                               : shard_range(sl.size(), static_cast<int>(sizeof(T)), ls.G, 0).size() * sizeof(T));
  }
  if (ls.N > 1) {
    const InterSchedule sch = InterSchedule::make(ls.N, 0);
    for (int i = 0; i < sch.num_steps(); ++i) {
      const InterStep st = sch.step(i);
      ledger::InterStepPlan sp{};
      sp.step = i;
      sp.kind = st.slot == sch.fold_in_slot() ? "fold_in" : st.slot == sch.fold_out_slot() ? "fold_out" : "exchange";
      size_t most = 0, total = 0;
      for (size_t b = 0; b < payload.size(); ++b) {
        total += payload[b];
        if (use_ll(call_cfg, payload[b])) ++sp.ll_slices;
        most = std::max(most, payload[b]);
      }
      sp.protocol = use_ll(call_cfg, most) ? "ll" : "put_signal";
      sp.payload_bytes = total;
      pi.inter_steps.push_back(sp);
    }
  }
  std::ostringstream extra;
  extra << ", \"device_code\": \"" << ls.device_code << "\", \"seed\": " << seed << ", \"direct\": " << (ls.direct ? "true" : "false");
  out.json = ledger::to_json(out.led, ls.kernel, ls.N, ls.G, ls.size, dtype_name(ls.dt), ls.threads, pi, extra.str());
  return out;
}

LedgerRun run_ledger(const LedgerSpec& ls, uint64_t seed) {
  switch (ls.dt) {
    case DType::kFloat32: return run_ledger_t<float>(ls, seed);
#if !defined(NVRAR_EMU_MINIMAL)
    case DType::kFloat16: return run_ledger_t<f16>(ls, seed);
    case DType::kBFloat16: return run_ledger_t<bf16>(ls, seed);
    case DType::kInt32: return run_ledger_t<int32_t>(ls, seed);
#endif
    default: break;
  }
  throw Failure(std::string("this build has no ") + dtype_name(ls.dt) + " kernel");
}

// ---------------------------------------------------------------------------------------------
// nvrar.settings' GPU defaults, as scripts/emulate.sh passes them (--gpu-defaults
// "max_blocks=16,block_bytes=32768,max_bytes=...,ll_max_bytes=...,oneshot_max.NxG=...,...[,channels=C]"):
// read by Python from the one place they are defined, never copied here.
struct GpuDefaults {
  bool have = false;
  int max_blocks = 0;
  size_t block_bytes = 0, max_bytes = 0, ll_max_bytes = 0;
  std::map<std::pair<int, int>, size_t> oneshot_max;  // by (nodes, ranks per node)
  int channels = -1;                  // -1: not configured
};
GpuDefaults g_gpu_defaults;

bool parse_gpu_defaults(const std::string& text, GpuDefaults* d) {
  std::istringstream is(text);
  std::string kv;
  bool any = false;
  while (std::getline(is, kv, ',')) {
    const size_t eq = kv.find('=');
    if (eq == std::string::npos) return false;
    const std::string k = kv.substr(0, eq);
    const unsigned long long v = std::strtoull(kv.c_str() + eq + 1, nullptr, 10);
    if (k == "max_blocks") d->max_blocks = static_cast<int>(v);
    else if (k == "block_bytes") d->block_bytes = v;
    else if (k == "max_bytes") d->max_bytes = v;
    else if (k == "ll_max_bytes") d->ll_max_bytes = v;
    else if (k == "channels") d->channels = static_cast<int>(v);
    else if (k.rfind("oneshot_max.", 0) == 0) {
      int n = 0, g = 0;
      if (std::sscanf(k.c_str() + 12, "%dx%d", &n, &g) != 2 || n < 1 || g < 1) return false;
      d->oneshot_max[{n, g}] = v;
    }
    else return false;
    any = true;
  }
  d->have = any && d->max_blocks > 0 && d->block_bytes > 0 && d->max_bytes > 0 && !d->oneshot_max.empty();
  return d->have;
}

// A LedgerSpec of the defaults for NxG (pool: one page; it holds no buffer of the call).
LedgerSpec default_ledger_spec(int N, int G, size_t size) {
  const GpuDefaults& d = g_gpu_defaults;
  EXPECT(d.have, "no GPU defaults: run through scripts/emulate.sh, which reads them from nvrar.settings");
  EXPECT(d.oneshot_max.count({N, G}), "the GPU defaults name no one-shot threshold for " << N << "x" << G);
  LedgerSpec ls;
  ls.N = N;
  ls.G = G;
  ls.size = size;
  ls.dt = DType::kBFloat16;  // as the committed ledgers and candidates (docs/gpu/ledgers)
  ls.max_blocks = d.max_blocks;
  ls.block_bytes = d.block_bytes;
  ls.max_bytes = d.max_bytes;
  ls.pool_bytes = 4096;
  ls.ll_max_bytes = d.ll_max_bytes;
  ls.have_ll = true;
  ls.oneshot_max = d.oneshot_max.at({N, G});
  ls.have_oneshot = true;
  ls.channels = d.channels;
  return ls;
}

// The wire budget (docs/gpu/emulation.md, "Wire budget") of one call with the defaults: each rule
// printed with its verdict; the case fails naming every rule broken.
void run_wire_budget(int N, int G, size_t size, bool with_abort, uint64_t seed) {
  using namespace ledger;
  LedgerSpec ls = default_ledger_spec(N, G, size);
  const LedgerRun r = run_ledger(ls, seed);
  const Ledger& led = r.led;
  std::ostringstream cell;
  cell << "wire_budget " << N << "x" << G << " " << (size >> 10) << "K";
  // NVRAR_WIRE_BUDGET_OUT=DIR: the ledger also goes to DIR/NxG-SIZE.json (tests/test_wire_budget.py
  // prices it against the candidate plans).
  if (const char* dir = std::getenv("NVRAR_WIRE_BUDGET_OUT"); dir != nullptr && *dir != 0) {
    std::ostringstream path;
    path << dir << "/" << N << "x" << G << "-" << (size >> 10) << "K.json";
    std::FILE* f = std::fopen(path.str().c_str(), "w");
    EXPECT(f != nullptr, "cannot write " << path.str());
    std::fputs(r.json.c_str(), f);
    std::fputc('\n', f);
    std::fclose(f);
  }
  std::vector<std::string> broken;
  auto verdict = [&](const std::string& rule, bool ok, const std::string& detail) {
    std::printf("  %s: %-24s %s%s%s\n", cell.str().c_str(), rule.c_str(), ok ? "ok" : "FAIL",
                detail.empty() ? "" : ": ", detail.c_str());
    if (!ok) broken.push_back(rule);
  };
  auto step_name = [](const StepLedger& s) {
    std::ostringstream os;
    os << "chunk " << s.key.chunk << " " << kPhaseName[s.key.phase] << " step " << s.key.step;
    return os.str();
  };
  std::printf("  %s: plan %s, %llu block(s), %llu chunk(s), inter-node steps:", cell.str().c_str(), r.plan.algorithm,
              static_cast<unsigned long long>(r.plan.blocks), static_cast<unsigned long long>(r.plan.chunks));
  for (const auto& s : r.plan.inter_steps) std::printf(" %s/%s", s.kind, s.protocol);
  std::printf("\n");
  // Per step: fences, quiets, transport-inserted fences; signal ops and atomics; messages per peer;
  // release chains. Transport-inserted fences: those of the transports that the defaults serve
  // (IBGDA, and IBRC whose proxy keeps a PE's operations in order); libfabric's proxy fence inside
  // every put-with-signal (transfer_device.cuh: its operations are unordered) is printed, not
  // budgeted: the only message without one is LL's, at twice the bytes (docs/gpu/wire-model.md,
  // "Slingshot").
  std::ostringstream f, so, msg, rc;
  uint64_t msg_max = 0, libfabric = 0;
  for (const StepLedger& s : led.steps) {
    const Counters m = max_over(s.pe);
    const uint64_t fq = m.v[kFences] + m.v[kQuiets];
    const uint64_t pf = std::max(m.v[kProxyFencesIbgda], m.v[kProxyFencesIbrc]);
    libfabric += m.v[kProxyFencesLibfabric];
    if ((fq || pf) && f.str().empty())
      f << step_name(s) << ": fences " << m.v[kFences] << ", quiets " << m.v[kQuiets] << ", proxy fences ibgda/ibrc/libfabric "
        << m.v[kProxyFencesIbgda] << "/" << m.v[kProxyFencesIbrc] << "/" << m.v[kProxyFencesLibfabric];
    if ((m.v[kSignalOps] || m.v[kRemoteAtomics]) && so.str().empty())
      so << step_name(s) << ": signal ops " << m.v[kSignalOps] << ", remote atomics " << m.v[kRemoteAtomics];
    if (m.v[kMessagesMaxPerPeer] > msg_max) {
      msg_max = m.v[kMessagesMaxPerPeer];
      msg.str("");
      msg << step_name(s) << ": " << msg_max << " message(s) to one peer";
    }
    if (m.v[kReleaseChainMax] > 1 && rc.str().empty())
      rc << step_name(s) << ": " << m.v[kReleaseChainMax] << " release stores in a row from one thread";
  }
  verdict("fences_and_quiets", f.str().empty(),
          f.str().empty() ? "(libfabric would insert " + std::to_string(libfabric) +
                                " proxy fence(s) in the call's puts-with-signal; not budgeted)"
                          : f.str());
  verdict("signal_ops_and_atomics", so.str().empty(), so.str());
  const bool have_channels = r.plan.channels >= 0;
  const uint64_t allowed_msgs = have_channels ? static_cast<uint64_t>(r.plan.channels) : r.plan.blocks;
  verdict("messages_per_peer", msg_max <= allowed_msgs,
          msg.str() + (have_channels ? ", channels " + std::to_string(r.plan.channels)
                                     : ", at most " + std::to_string(allowed_msgs) +
                                           " (channels are not configured: one message per block is the current design)"));
  // Inter-node bytes per PE per call against the chosen algorithm's minimum, step by step:
  // two-shot bytes/G per recursive-doubling step, one-shot the whole message; 1.05x on
  // put-with-signal steps, 2.1x on LL steps.
  const bool one_shot = std::string(r.plan.algorithm) == "one-shot";
  const double per_step = one_shot ? static_cast<double>(size) : static_cast<double>(size) / G;
  double allowed = 0, minimum = 0;
  for (const StepLedger& s : led.steps)
    if (s.key.phase == kInterNode) {
      const bool ll = s.protocol() != nullptr && std::string(s.protocol()) == "ll";
      minimum += per_step;
      allowed += per_step * (ll ? 2.1 : 1.05);
    }
  uint64_t most = 0;
  int most_pe = 0;
  for (size_t p = 0; p < led.call.size(); ++p)
    if (led.call[p].v[kInterNodeBytes] > most) {
      most = led.call[p].v[kInterNodeBytes];
      most_pe = static_cast<int>(p);
    }
  {
    std::ostringstream os;
    os << "PE " << most_pe << " sends " << most << " bytes across nodes; the " << r.plan.algorithm << " minimum is "
       << static_cast<uint64_t>(minimum) << ", allowed " << static_cast<uint64_t>(allowed);
    verdict("inter_node_bytes", static_cast<double>(most) <= allowed, os.str());
  }
  verdict("release_chain", rc.str().empty(), rc.str());
  if (with_abort) {
    // fail(): PE W-1 never launches; its inter-node partner PE G-1 (node 0) waits for it with a
    // 1 s deadline, fails, and aborts every rank.
    LedgerSpec fs = default_ledger_spec(N, G, size);
    fs.absent = N * G - 1;
    fs.waiter = G - 1;
    const LedgerRun fr = run_ledger(fs, seed + 1);
    const Counters a = max_over(fr.led.abort);
    std::ostringstream os;
    os << "fences " << a.v[kFences] << ", quiets " << a.v[kQuiets] << ", proxy fences ibgda/ibrc/libfabric "
       << a.v[kProxyFencesIbgda] << "/" << a.v[kProxyFencesIbrc] << "/" << a.v[kProxyFencesLibfabric]
       << ", waits on completion " << a.v[kConsistencyWaits] << ", signal ops " << a.v[kSignalOps];
    verdict("fail", fr.led.any_abort && a.v[kFences] + a.v[kQuiets] + a.v[kConsistencyWaits] + a.v[kProxyFencesIbgda] +
                                              a.v[kProxyFencesIbrc] + a.v[kProxyFencesLibfabric] == 0,
            fr.led.any_abort ? os.str() : "no abort was recorded");
  }
  std::fflush(stdout);
  if (!broken.empty()) {
    std::ostringstream os;
    os << "over budget:";
    for (const auto& b : broken) os << " " << b;
    throw Failure(os.str());
  }
}

// The wire_budget cases join the list only when asked for by name (--only wire_budget): they
// measure cost, not correctness, and hold the device protocol to the budget of
// docs/gpu/emulation.md.
bool g_budget_cases = false;

std::vector<Case> make_cases(bool quick) {
  std::vector<Case> cs;
  auto add = [&](ReduceSpec s) {
    if (kTsan && s.threads > 64 && s.threads < 512) s.threads = 64;  // 32-64 threads per block under TSan
    cs.push_back(Case{"allreduce " + spec_name(s), [s](uint64_t seed) { run_reduce(s, seed); }});
  };
  const DType dts[4] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kInt32};
  const RedOp ops[4] = {RedOp::kSum, RedOp::kMax, RedOp::kMin, RedOp::kAvg};
  // Layouts (the CPU matrix plus 4x1 and 2x3), both algorithms; LL where there are nodes.
  const int layouts[10][2] = {{2, 1}, {1, 2}, {3, 1}, {2, 2}, {3, 2}, {2, 4}, {5, 1}, {1, 3}, {4, 1}, {2, 3}};
  int k = 0;
  for (const auto& l : layouts) {
    for (Algorithm alg : {Algorithm::kTwoShot, Algorithm::kOneShot}) {
      ReduceSpec s{l[0], l[1], dts[k % 4], ops[(k / 4 + k) % 4], alg, 0};
      s.count = alg == Algorithm::kOneShot ? 700 + 13 * static_cast<size_t>(k % 5) : 3000 + 37 * static_cast<size_t>(k);
      s.max_blocks = 1 + k % 3;
      s.threads = 32 * (1 + k % 2);
      s.in_pool = k % 3 == 1;
      s.in_place = k % 4 == 2;
      s.out_pool = !s.in_place && k % 3 == 2;
      add(s);
      if (l[0] > 1) {
        ReduceSpec t = s;
        t.ll = 1024;
        t.dt = dts[(k + 1) % 4];
        t.count = alg == Algorithm::kOneShot ? 300 : 1500;
        add(t);
      }
      ++k;
    }
    if (quick && k >= 8) break;
  }
  // Every dtype x op once (2x2, two-shot, put-with-signal; LL for a few).
  for (int d = 0; d < 4; ++d)
    for (int o = 0; o < 4; ++o) {
      if (quick && (d + o) % 3 != 0) continue;
      ReduceSpec s{2, 2, dts[d], ops[o], Algorithm::kTwoShot, 1000 + 7 * static_cast<size_t>(d * 4 + o)};
      s.ll = (d + o) % 2 ? 1024 : 0;
      add(s);
    }
  // Several chunks (max_bytes 4096: a chunk of 4 KiB), up to 8 blocks of up to 128 threads.
  {
    ReduceSpec s{2, 2, DType::kFloat32, RedOp::kSum, Algorithm::kTwoShot, 5000};
    s.max_blocks = 8;
    s.block_bytes = 512;
    s.threads = 64;
    if (!quick) add(s);  // (--quick: the 4-block bfloat16 case below has several chunks too)
    ReduceSpec t{2, 1, DType::kBFloat16, RedOp::kSum, Algorithm::kTwoShot, 9000};
    t.max_blocks = 4;
    t.threads = 128;
    t.ll = 2048;
    add(t);
    ReduceSpec u{3, 1, DType::kFloat32, RedOp::kMax, Algorithm::kOneShot, 2500};
    u.max_blocks = 3;
    u.ll = 1024;
    add(u);
  }
  // The production launch shape (nvrar/settings.py GPU_LAUNCH: 16 blocks of 512 threads, a block
  // per 32 KiB) on 2 PEs: 16,384 threads. Not under ThreadSanitizer (it cannot start 8,192).
  if (!quick && !kTsan) {
    ReduceSpec s{2, 1, DType::kBFloat16, RedOp::kSum, Algorithm::kTwoShot, 300000};
    s.max_blocks = 16;
    s.threads = 512;
    s.block_bytes = 32 << 10;
    s.max_bytes = 1 << 20;
    s.calls = 1;
    add(s);
  }
  // The direct-store path across nodes (nvshmem_ptr non-null everywhere).
  for (size_t ll : {size_t{0}, size_t{1024}}) {
    ReduceSpec s{2, 2, DType::kFloat16, RedOp::kSum, Algorithm::kTwoShot, 2222};
    s.direct = true;
    s.ll = ll;
    add(s);
    ReduceSpec t{3, 1, DType::kFloat32, RedOp::kMin, Algorithm::kOneShot, 600};
    t.direct = true;
    t.ll = ll;
    add(t);
  }
  // The LL epoch wrap: calls cross 2^16 (the flag's 16-bit epoch), then every device epoch jumps
  // so that the next calls reuse the first calls' LL zones at the same 16-bit epoch: a stale
  // packet from 65,536 calls earlier would be taken for a new one unless ll_unpack zeroed it.
  {
    ReduceSpec s{2, 1, DType::kFloat32, RedOp::kSum, Algorithm::kTwoShot, 900};
    s.ll = 4096;
    s.calls = 6;
    s.epoch0 = 65533;  // calls at 65534, 65535, 65536 (16-bit epoch 0), then 65536 later
    s.jump = 65536 - 3;
    add(s);
    ReduceSpec t{2, 2, DType::kInt32, RedOp::kSum, Algorithm::kOneShot, 400};
    t.ll = 4096;
    t.calls = 6;
    t.epoch0 = 65534;
    t.jump = 65536 - 3;
    if (!quick) add(t);
  }
  // The fused kernel, all three dtypes.
  struct FusedSpec { int N, G; DType dt; Algorithm alg; size_t rows, h; size_t ll; };
  const FusedSpec fs[] = {{2, 2, DType::kFloat32, Algorithm::kTwoShot, 7, 100, 0},
                          {2, 1, DType::kFloat16, Algorithm::kTwoShot, 5, 64, 1024},
                          {1, 3, DType::kBFloat16, Algorithm::kTwoShot, 9, 48, 0},
                          {2, 2, DType::kBFloat16, Algorithm::kOneShot, 3, 70, 1024},
                          {3, 1, DType::kFloat32, Algorithm::kOneShot, 2, 33, 0},
                          {1, 2, DType::kFloat16, Algorithm::kOneShot, 4, 129, 0}};
  for (const auto& f : fs) {
    std::ostringstream os;
    os << "fused " << f.N << "x" << f.G << " " << dtype_name(f.dt) << " " << algorithm_name(f.alg) << " rows=" << f.rows
       << " h=" << f.h << (f.ll ? " ll" : "");
    cs.push_back(Case{os.str(), [f](uint64_t seed) {
                        switch (f.dt) {
                          case DType::kFloat32: run_fused_t<float>(f.N, f.G, f.alg, f.rows, f.h, 64, f.ll, seed, f.dt); break;
                          case DType::kFloat16: run_fused_t<f16>(f.N, f.G, f.alg, f.rows, f.h, 64, f.ll, seed, f.dt); break;
                          default: run_fused_t<bf16>(f.N, f.G, f.alg, f.rows, f.h, 64, f.ll, seed, f.dt); break;
                        }
                      }});
  }
  // Failure paths: a PE that never arrives (in-node, across nodes with LL and with puts).
  cs.push_back(Case{"timeout 1x2: rank 1 never arrives", [](uint64_t seed) {
                      run_absent(1, 2, 1, 0, Phase::kReduceScatter, 0, 0, seed);
                    }});
  cs.push_back(Case{"timeout+remote abort 4x1: rank 3 never arrives (put-signal)", [](uint64_t seed) {
                      run_absent(4, 1, 3, 2, Phase::kInterNode, 0, 0, seed);
                    }});
  cs.push_back(Case{"timeout+remote abort 5x1: rank 4 never arrives (LL)", [](uint64_t seed) {
                      run_absent(5, 1, 4, 0, Phase::kInterNode, 0, 1024, seed);
                    }});
  cs.push_back(Case{"timeout+abort 2x2: rank 3 never arrives", [](uint64_t seed) {
                      run_absent(2, 2, 3, 2, Phase::kReduceScatter, 0, 0, seed);
                    }});
  // A CUDA-graph replay after a failure: no round, every PE traps (NOTE [loud after failure]).
  cs.push_back(Case{"replay after failure 2x2: rank 3 never arrived, then all relaunch", [](uint64_t seed) {
                      run_replay_after_failure(2, 2, 3, 1, 0, false, seed);
                    }});
  cs.push_back(Case{"replay after failure 3x1 (LL, fused): rank 2 never arrived, then all relaunch", [](uint64_t seed) {
                      run_replay_after_failure(3, 1, 2, 0, 1024, true, seed);
                    }});
  // A stalled proxy: PE 3's operations are never delivered nor acknowledged.
  cs.push_back(Case{"stalled proxy 2x2: PE 3 (put-signal)", [](uint64_t seed) { run_stalled(2, 2, 3, 0, seed); }});
  cs.push_back(Case{"stalled proxy 4x1: PE 1 (LL)", [](uint64_t seed) { run_stalled(4, 1, 1, 1024, seed); }});
  // Call mismatches, one field at a time.
  const Mismatch ms[] = {
      {"count", [](CallArgs& c) { c.count += 16; }},
      {"dtype", [](CallArgs& c) { c.dtype = DType::kInt32; }},
      {"op", [](CallArgs& c) { c.op = RedOp::kMax; }},
      {"algorithm", [](CallArgs& c) { c.alg = Algorithm::kOneShot; }},
      {"round elements (n)", [](CallArgs&) {}, true},
  };
  for (const auto& m : ms) {
    cs.push_back(Case{"mismatch 2x2 " + m.field, [m](uint64_t seed) { run_mismatch(2, 2, 1, m, 0, 1000, seed); }});
    if (!m.half_chunk)  // (200 elements are one round on every rank: n cannot differ there)
      cs.push_back(Case{"mismatch 2x1 ll " + m.field, [m](uint64_t seed) { run_mismatch(2, 1, 1, m, 1024, 200, seed); }});
  }
  cs.push_back(Case{"mismatch 2x1 put-signal round elements (n)",
                    [m = ms[4]](uint64_t seed) { run_mismatch(2, 1, 1, m, 0, 1000, seed); }});
  // A count mismatch across nodes on each path (G = 1: the inter cells and LL streams alone).
  cs.push_back(Case{"mismatch 2x1 put-signal count", [m = ms[0]](uint64_t seed) { run_mismatch(2, 1, 1, m, 0, 1000, seed); }});
  cs.push_back(Case{"mismatch 3x1 put-signal count", [m = ms[0]](uint64_t seed) { run_mismatch(3, 1, 2, m, 0, 1000, seed); }});
  cs.push_back(Case{"mismatch 3x1 ll count", [m = ms[0]](uint64_t seed) { run_mismatch(3, 1, 2, m, 1024, 200, seed); }});
  cs.push_back(Case{"mismatch 2x1 put-signal direct count",
                    [m = ms[0]](uint64_t seed) { run_mismatch(2, 1, 1, m, 0, 1000, seed, true); }});
  cs.push_back(Case{"mismatch 2x1 ll direct count",
                    [m = ms[0]](uint64_t seed) { run_mismatch(2, 1, 1, m, 1024, 200, seed, true); }});
  // The collision across nodes: every path (put-signal, LL) in proxy and direct mode.
  for (int N : {2, 3})
    for (bool ll : {false, true})
      for (bool direct : {false, true}) {
        std::string name = "mismatch " + std::to_string(N) + "x1 collision 100000 vs 131409 " +
                           (ll ? "ll" : "put-signal") + (direct ? " direct" : "") + " (pool outputs, canary)";
        cs.push_back(Case{name, [N, ll, direct](uint64_t seed) { run_collision(N, 1, N - 1, seed, ll, direct); }});
      }
  cs.push_back(Case{"mismatch 1x2 collision 100000 vs 131409 (pool outputs, canary)",
                    [](uint64_t seed) { run_collision(1, 2, 1, seed); }});
  cs.push_back(Case{"mismatch 2x2 collision 100000 vs 131409 (pool outputs, canary)",
                    [](uint64_t seed) { run_collision(2, 2, 1, seed); }});
  cs.push_back(Case{"mismatch 1x2 fused h (same element count)", [](uint64_t seed) { run_fused_mismatch(2, true, seed); }});
  cs.push_back(Case{"mismatch 1x3 fused eps", [](uint64_t seed) { run_fused_mismatch(3, false, seed); }});
  if (g_budget_cases && !kTsan) {
    const int budget_layouts[3][2] = {{2, 4}, {2, 8}, {4, 2}};
    for (const auto& l : budget_layouts)
      for (size_t size : {size_t{128} << 10, size_t{512} << 10, size_t{2} << 20}) {
        const int N = l[0], G = l[1];
        const bool with_abort = size == (size_t{128} << 10);  // fail() once per layout
        cs.push_back(Case{"wire_budget " + std::to_string(N) + "x" + std::to_string(G) + " " +
                              std::to_string(size >> 10) + "K" + (with_abort ? " (+fail)" : ""),
                          [N, G, size, with_abort](uint64_t seed) { run_wire_budget(N, G, size, with_abort, seed); }});
      }
  }
  return cs;
}

}  // namespace
}  // namespace emu
}  // namespace nvrar

namespace {

// "128K", "2M", "4096": a size as nvrar writes it (bytes).
bool parse_size(const std::string& t, size_t* out) {
  if (t.empty()) return false;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(t.c_str(), &end, 10);
  if (end == t.c_str()) return false;
  const std::string suf(end);
  size_t shift = 0;
  if (suf == "K" || suf == "k") shift = 10;
  else if (suf == "M" || suf == "m") shift = 20;
  else if (suf == "G" || suf == "g") shift = 30;
  else if (!suf.empty()) return false;
  *out = static_cast<size_t>(v) << shift;
  return true;
}

// The --ledger mode: exit 0 with the JSON on stdout, else 1 with the reason on stderr.
int ledger_main(int argc, char** argv, int first) {
  using namespace nvrar;
  using namespace nvrar::emu;
  LedgerSpec ls;
  uint64_t seed = 1;
  auto bad = [](const std::string& why) {
    std::fprintf(stderr, "emulate_driver --ledger: %s\n", why.c_str());
    return 2;
  };
  if (first + 2 > argc) return bad("needs LAYOUT (NxG) and SIZE");
  if (std::sscanf(argv[first], "%dx%d", &ls.N, &ls.G) != 2 || ls.N < 1 || ls.G < 1)
    return bad(std::string("bad layout ") + argv[first] + " (NxG, e.g. 2x4)");
  if (!parse_size(argv[first + 1], &ls.size)) return bad(std::string("bad size ") + argv[first + 1]);
  for (int i = first + 2; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has = i + 1 < argc;
    size_t v = 0;
    if (a == "--algorithm" && has) {
      const std::string x = argv[++i];
      if (x == "auto") ls.alg = Algorithm::kAuto;
      else if (x == "one-shot") ls.alg = Algorithm::kOneShot;
      else if (x == "two-shot") ls.alg = Algorithm::kTwoShot;
      else return bad("bad algorithm " + x);
    } else if (a == "--dtype" && has) {
      const std::string x = argv[++i];
      if (x == "float32") ls.dt = DType::kFloat32;
      else if (x == "bfloat16") ls.dt = DType::kBFloat16;
      else if (x == "float16") ls.dt = DType::kFloat16;
      else return bad("bad dtype " + x);
    } else if (a == "--threads" && has) {
      ls.threads = std::atoi(argv[++i]);
    } else if (a == "--max-blocks" && has) {
      ls.max_blocks = std::atoi(argv[++i]);
    } else if (a == "--channels" && has) {
      ls.channels = std::atoi(argv[++i]);
    } else if (a == "--kernel" && has) {
      ls.kernel = argv[++i];
    } else if (a == "--gpu-defaults" && has) {
      if (!parse_gpu_defaults(argv[++i], &g_gpu_defaults)) return bad(std::string("bad --gpu-defaults ") + argv[i]);
      const GpuDefaults& d = g_gpu_defaults;
      ls.max_blocks = d.max_blocks;
      ls.block_bytes = d.block_bytes;
      ls.max_bytes = d.max_bytes;
      ls.ll_max_bytes = d.ll_max_bytes;
      ls.have_ll = true;
      if (d.oneshot_max.count({ls.N, ls.G})) {
        ls.oneshot_max = d.oneshot_max.at({ls.N, ls.G});
        ls.have_oneshot = true;
      }
      ls.channels = d.channels;
      if (ls.pool_bytes == 0) ls.pool_bytes = 4096;
    } else if (a == "--device-code" && has) {
      ls.device_code = argv[++i];
    } else if (a == "--seed" && has) {
      seed = std::strtoull(argv[++i], nullptr, 10);
    } else if (a == "--direct") {
      ls.direct = true;
    } else if ((a == "--block-bytes" || a == "--max-bytes" || a == "--pool-bytes" || a == "--ll-max-bytes" ||
                a == "--oneshot-max") && has) {
      if (!parse_size(argv[++i], &v)) return bad("bad size for " + a);
      if (a == "--block-bytes") ls.block_bytes = v;
      if (a == "--max-bytes") ls.max_bytes = v;
      if (a == "--pool-bytes") ls.pool_bytes = v;
      if (a == "--ll-max-bytes") { ls.ll_max_bytes = v; ls.have_ll = true; }
      if (a == "--oneshot-max") { ls.oneshot_max = v; ls.have_oneshot = true; }
    } else {
      return bad("unknown argument " + a);
    }
  }
  if (ls.threads < 32 || ls.threads % 32 != 0) return bad("--threads must be a multiple of 32");
  const long long emulated = static_cast<long long>(ls.N) * ls.G * std::max(1, ls.max_blocks) * ls.threads;
  if (emulated > 16384) std::fprintf(stderr, "emulate_driver --ledger: up to %lld emulated threads\n", emulated);
  try {
    const LedgerRun r = run_ledger(ls, seed);
    std::fputs(r.json.c_str(), stdout);
    std::fflush(stdout);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "emulate_driver --ledger: %s\n", e.what());
    return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  using namespace nvrar::emu;
  if (argc > 1 && std::string(argv[1]) == "--ledger") return ledger_main(argc, argv, 2);
  bool quick = false, list = false;
  int repeat = 1;
  double case_timeout_s = kTsan ? 600 : 300;
  uint64_t seed = 0;
  bool seed_set = false;
  std::vector<std::string> only;
  std::vector<std::string> production;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--waves") {
      g_waves = true;
    } else if (a == "--consistency") {
      g_consistency_us = 300;
    } else if (a == "--quick") {
      quick = true;
    } else if (a == "--list") {
      list = true;
    } else if (a == "--seed" && i + 1 < argc) {
      seed = std::strtoull(argv[++i], nullptr, 10);
      seed_set = true;
    } else if (a == "--only" && i + 1 < argc) {
      only.push_back(argv[++i]);
      if (only.back().find("wire_budget") != std::string::npos) g_budget_cases = true;
    } else if (a == "--gpu-defaults" && i + 1 < argc) {
      if (!parse_gpu_defaults(argv[++i], &g_gpu_defaults)) {
        std::fprintf(stderr, "bad --gpu-defaults %s\n", argv[i]);
        return 2;
      }
    } else if (a == "--case-timeout" && i + 1 < argc) {
      case_timeout_s = std::atof(argv[++i]);
    } else if (a == "--repeat" && i + 1 < argc) {
      repeat = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--barrier-selftest") {
      barrier_selftest();
      return 1;
    } else {
      std::fprintf(stderr, "usage: %s [--quick] [--waves] [--consistency] [--seed N] [--only SUBSTRING]... [--repeat K] [--case-timeout S] [--list] [--barrier-selftest] [--gpu-defaults K=V,...]\n       %s --ledger NxG SIZE [options]\n", argv[0], argv[0]);
      return 2;
    }
  }
  if (!seed_set) seed = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) % 1000000;
  std::vector<Case> cases = make_cases(quick);
  int passed = 0, failed = 0;
  // A watchdog: a case that does not finish in time (a hang the emulation's deadlines did not
  // catch, or ThreadSanitizer's runtime stuck in a report) ends the run with its name.
  std::mutex wd_mu;
  std::condition_variable wd_cv;
  std::string wd_case;
  uint64_t wd_gen = 0;
  bool wd_stop = false;
  std::thread watchdog([&] {
    std::unique_lock<std::mutex> lock(wd_mu);
    while (!wd_stop) {
      const uint64_t g = wd_gen;
      if (!wd_cv.wait_for(lock, std::chrono::duration<double>(case_timeout_s), [&] { return wd_stop || wd_gen != g; }) &&
          !wd_case.empty()) {
        std::printf("FAIL %s: no result after %.0f s (a hang)\n", wd_case.c_str(), case_timeout_s);
        std::printf("emulated device: %d cases passed, %d failed (tsan: %s)\n", passed, failed + 1, kTsan ? "on" : "off");
        std::fflush(stdout);
        std::_Exit(1);
      }
    }
  });
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    if (!only.empty() && std::none_of(only.begin(), only.end(), [&](const std::string& o) { return c.name.find(o) != std::string::npos; }))
      continue;
    if (list) {
      std::printf("%s\n", c.name.c_str());
      continue;
    }
    for (int rep = 0; rep < repeat; ++rep) {
    const uint64_t s = seed + i + 1000003ull * static_cast<uint64_t>(rep);
    {
      std::lock_guard<std::mutex> lock(wd_mu);
      wd_case = c.name;
      ++wd_gen;
      wd_cv.notify_all();
    }
    const int reports0 = g_tsan_reports.load();
    const auto t0 = std::chrono::steady_clock::now();
    std::string why;
    try {
      c.run(s);
    } catch (const std::exception& e) {
      why = e.what();
    }
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (why.empty() && g_tsan_reports.load() != reports0) why = std::to_string(g_tsan_reports.load() - reports0) + " ThreadSanitizer report(s)";
    if (why.empty()) {
      ++passed;
      std::printf("PASS %s (%.2f s)\n", c.name.c_str(), dt);
    } else {
      ++failed;
      std::printf("FAIL %s (%.2f s, seed %llu): %s\n", c.name.c_str(), dt, static_cast<unsigned long long>(s), why.c_str());
    }
    std::fflush(stdout);
    }
  }
  {
    std::lock_guard<std::mutex> lock(wd_mu);
    wd_stop = true;
    wd_cv.notify_all();
  }
  watchdog.join();
  if (list) return 0;
  if (g_consistency_us > 0) {
    uint64_t hidden = 0, points = 0;
    consistency_totals(&hidden, &points);
    std::printf("proxy consistency: %llu delivered writes hidden, %llu consistency points\n",
                static_cast<unsigned long long>(hidden), static_cast<unsigned long long>(points));
  }
  if (g_waves)
    std::printf("block waves: %llu of %llu PE launches ran in waves\n",
                static_cast<unsigned long long>(g_wave_launches.load()), static_cast<unsigned long long>(g_launches.load()));
  std::printf("emulated device: %d cases passed, %d failed (tsan: %s)\n", passed, failed, kTsan ? "on" : "off");
  return failed == 0 && passed > 0 ? 0 : 1;
}
