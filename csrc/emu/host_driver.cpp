// The host half's driver (scripts/emulate.sh --host): the GPU executor's host code
// (csrc/cuda/runtime.cu, the launch units, unmodified) on emulated PEs, through the same
// gpu::GpuExecutor API the Python bindings use, against the emulated CUDA runtime and NVSHMEM
// host API (host_emu.h) whose kernels run on the emulated device (emu.h). Every case checks
// results bit for bit (integer-valued data: the sums are exact) and fails on any hazard the
// emulation recorded (a PE left waiting in a collective, work that never drained).
//
//   emulate_host_driver [--quick] [--seed N] [--only SUBSTRING]... [--case-timeout S] [--list]
// Last line: "emulated host: N cases passed, M failed (tsan: on|off)".
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <future>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "../common/error.h"
#include "../cuda/gpu_api.h"
#include "../protocol/epilogue.h"
#include "../protocol/types.h"
#include "host/cuda_runtime.h"
#include "host/nvshmem.h"
#include "host/nvshmemx.h"
#include "host_emu.h"

#if defined(__SANITIZE_THREAD__)
constexpr bool kTsan = true;
#else
constexpr bool kTsan = false;
#endif
static std::atomic<int> g_tsan_reports{0};
extern "C" void __tsan_on_report(void*) { g_tsan_reports.fetch_add(1, std::memory_order_relaxed); }

namespace {

using nvrar::Algorithm;
using nvrar::DType;
using nvrar::RedOp;
using nvrar::emu::host::Machine;
using nvrar::emu::host::MachineConfig;
using nvrar::gpu::GpuConfig;
using nvrar::gpu::GpuExecutor;

#define REQUIRE(cond, ...)                                                     \
  do {                                                                         \
    if (!(cond)) {                                                             \
      std::ostringstream os_;                                                  \
      os_ << __VA_ARGS__;                                                      \
      throw std::runtime_error(os_.str() + " [" #cond ", line " + std::to_string(__LINE__) + "]"); \
    }                                                                          \
  } while (0)

void cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

GpuConfig config(int rank, int world, int G) {
  GpuConfig c;
  c.rank = rank;
  c.world = world;
  c.ranks_per_node = G;
  c.device = rank % G;
  c.max_bytes = 64 * 1024;
  c.pool_bytes = 64 * 1024;
  c.oneshot_max_bytes = 4096;
  c.ll_max_bytes = 2048;
  c.block_bytes = 4096;
  c.max_blocks = 4;
  c.threads = 64;
  c.channels = 2;
  c.timeout_s = 10;
  return c;
}

// The unique id: rank 0 creates it, every PE waits for it (the store of the Python set-up).
struct UidBox {
  std::mutex mu;
  std::condition_variable cv;
  std::string uid;
  bool set = false;
  void put(const std::string& u) {
    std::lock_guard<std::mutex> lock(mu);
    uid = u;
    set = true;
    cv.notify_all();
  }
  std::string get() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return set; });
    return uid;
  }
};

std::string share_uid(UidBox& box, int rank) {
  if (rank == 0) box.put(nvrar::gpu::unique_id());
  return box.get();
}

// A barrier of the driver's PE threads (host-side synchronization between cases' steps).
struct HostBarrier {
  std::mutex mu;
  std::condition_variable cv;
  int n, count = 0;
  uint64_t gen = 0;
  explicit HostBarrier(int n_) : n(n_) {}
  void wait() {
    std::unique_lock<std::mutex> lock(mu);
    const uint64_t g = gen;
    if (++count == n) {
      count = 0;
      ++gen;
      cv.notify_all();
      return;
    }
    cv.wait(lock, [&] { return gen != g; });
  }
};

// Runs body(pe) on one bound thread per PE; returns each PE's error text ("" if none).
std::vector<std::string> run_pes(Machine& m, int pes, const std::function<void(int)>& body) {
  std::vector<std::string> err(static_cast<size_t>(pes));
  std::vector<std::thread> ts;
  for (int p = 0; p < pes; ++p)
    ts.emplace_back([&, p] {
      m.bind(p);
      try {
        body(p);
      } catch (const std::exception& e) {
        err[static_cast<size_t>(p)] = e.what();
        if (err[static_cast<size_t>(p)].empty()) err[static_cast<size_t>(p)] = "(empty error)";
      }
    });
  for (auto& t : ts) t.join();
  return err;
}

void no_errors(const std::vector<std::string>& err) {
  for (size_t p = 0; p < err.size(); ++p) REQUIRE(err[p].empty(), "PE " << p << ": " << err[p]);
}

void no_hazards(Machine& m) {
  const auto h = m.take_hazards();
  REQUIRE(h.empty(), "hazard: " << h.front() << (h.size() > 1 ? " (and " + std::to_string(h.size() - 1) + " more)" : ""));
}

// ---- data ---------------------------------------------------------------------------------------

template <typename T>
T from_int(int v);
template <>
float from_int<float>(int v) { return static_cast<float>(v); }
template <>
int32_t from_int<int32_t>(int v) { return v; }
template <>
nvrar::bf16 from_int<nvrar::bf16>(int v) { return nvrar::to_bf16(static_cast<float>(v)); }
template <>
nvrar::f16 from_int<nvrar::f16>(int v) { return nvrar::to_f16(static_cast<float>(v)); }

int value(int rank, size_t i, int salt) { return static_cast<int>((i * 7 + static_cast<size_t>(rank) * 13 + salt) % 31) - 15; }

DType dtype_of(float) { return DType::kFloat32; }
DType dtype_of(int32_t) { return DType::kInt32; }
DType dtype_of(nvrar::bf16) { return DType::kBFloat16; }
DType dtype_of(nvrar::f16) { return DType::kFloat16; }

// The expected result of op over every rank's value(r, i, salt), in T.
template <typename T>
T expected(RedOp op, int world, size_t i, int salt) {
  int acc = value(0, i, salt);
  for (int r = 1; r < world; ++r) {
    const int v = value(r, i, salt);
    acc = op == RedOp::kSum ? acc + v : op == RedOp::kMax ? std::max(acc, v) : std::min(acc, v);
  }
  return from_int<T>(acc);
}

// A device buffer of n T's.
template <typename T>
struct DevBuf {
  T* p = nullptr;
  size_t n = 0;
  explicit DevBuf(size_t n_) : n(n_) { cuda(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)), "cudaMalloc"); }
  ~DevBuf() { cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  uintptr_t addr() const { return reinterpret_cast<uintptr_t>(p); }
};

template <typename T>
void fill(T* dev, int rank, size_t n, int salt, cudaStream_t s) {
  std::vector<T> h(n);
  for (size_t i = 0; i < n; ++i) h[i] = from_int<T>(value(rank, i, salt));
  cuda(cudaMemcpyAsync(dev, h.data(), n * sizeof(T), cudaMemcpyHostToDevice, s), "fill");
  cuda(cudaStreamSynchronize(s), "fill sync");  // h goes out of scope
}

template <typename T>
void verify(const T* dev, RedOp op, int world, size_t n, int salt, const std::string& what) {
  std::vector<T> h(n);
  cuda(cudaMemcpy(h.data(), dev, n * sizeof(T), cudaMemcpyDeviceToHost), "read back");
  for (size_t i = 0; i < n; ++i) {
    const T want = expected<T>(op, world, i, salt);
    REQUIRE(std::memcmp(&h[i], &want, sizeof(T)) == 0, what << ": element " << i << " of " << n << " differs");
  }
}

// One all_reduce of n T's on stream s, checked.
template <typename T>
void call_checked(GpuExecutor& ex, int rank, int world, size_t n, RedOp op, Algorithm alg, cudaStream_t s, int salt,
                  bool in_place = false) {
  DevBuf<T> in(n), out(n);
  fill(in.p, rank, n, salt, s);
  T* dst = in_place ? in.p : out.p;
  ex.all_reduce(in.addr(), reinterpret_cast<uintptr_t>(dst), n, dtype_of(T{}), op, alg, reinterpret_cast<uintptr_t>(s));
  ex.check(reinterpret_cast<uintptr_t>(s));
  std::ostringstream what;
  what << "rank " << rank << " all_reduce n=" << n << " " << nvrar::algorithm_name(alg) << (in_place ? " in place" : "");
  verify(dst, op, world, n, salt, what.str());
}

// ---- cases --------------------------------------------------------------------------------------

struct Case {
  std::string name;
  bool quick;
  std::function<void(uint64_t seed)> run;
};

MachineConfig machine(int pes, int G, uint64_t seed) {
  MachineConfig mc;
  mc.pes = pes;
  mc.G = G;
  mc.seed = seed;
  mc.collective_timeout_s = kTsan ? 8 : 3;
  return mc;
}

// The frame of a case: a machine of W PEs (G per node), prepare(m) before they start (failure
// injection), body(m, box, r) on each PE's bound thread (box: the unique id, share_uid); fails on
// any PE's error, then on any hazard the emulation recorded.
void on_machine(int W, int G, uint64_t seed, const std::function<void(Machine&, UidBox&, int)>& body,
                const std::function<void(Machine&)>& prepare = {}) {
  Machine m(machine(W, G, seed));
  if (prepare) prepare(m);
  UidBox box;
  no_errors(run_pes(m, W, [&](int r) { body(m, box, r); }));
  no_hazards(m);
}

// The whole life of an executor: nvrar's own init, eager calls of every algorithm on two streams
// (one blocking, one not) with no host synchronization between them, in place, in the pool,
// the queries, close (NVSHMEM finalized), and the refusals after close.
template <typename T>
void run_lifecycle(int N, int G, RedOp op, uint64_t seed) {
  const int W = N * G;
  on_machine(W, G, seed, [&](Machine& m, UidBox& box, int r) {
    REQUIRE(nvrar::gpu::nvshmem_init_status() == NVSHMEM_STATUS_NOT_INITIALIZED, "NVSHMEM initialized too early");
    REQUIRE(nvrar::gpu::nvshmem_pes() == std::vector<int>({-1, -1}), "nvshmem_pes before init");
    std::string why;
    REQUIRE(nvrar::gpu::device_count(&why) == G && why.empty(), "device_count " << why);
    REQUIRE(nvrar::gpu::cuda_archs() == std::vector<int>({90}), "cuda_archs");
    REQUIRE(nvrar::gpu::nvshmem_header_version() == nvrar::gpu::nvshmem_library_version(), "versions");
    REQUIRE(!nvrar::gpu::nvshmem_library_path().empty(), "library path");
    const std::string uid = share_uid(box, r);
    GpuExecutor ex(config(r, W, G), uid);
    REQUIRE(nvrar::gpu::nvshmem_init_status() >= NVSHMEM_STATUS_IS_INITIALIZED, "not initialized");
    REQUIRE(nvrar::gpu::nvshmem_pes() == std::vector<int>({r, W}), "nvshmem_pes after init");
    bool sym_size = false;
    for (const auto& kv : nvrar::gpu::env_set_by_nvrar()) sym_size = sym_size || kv.rfind("NVSHMEM_SYMMETRIC_SIZE=", 0) == 0;
    REQUIRE(sym_size, "NVSHMEM_SYMMETRIC_SIZE default not recorded");
    cudaStream_t s1 = nullptr, s2 = nullptr;
    cuda(cudaStreamCreate(&s1), "stream");
    cuda(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking), "stream");
    int salt = 0;
    for (const size_t n : {size_t{1}, size_t{1000}, size_t{3001}, size_t{40000}})
      for (const Algorithm alg : {Algorithm::kAuto, Algorithm::kOneShot, Algorithm::kTwoShot}) {
        ++salt;
        call_checked<T>(ex, r, W, n, op, alg, salt % 2 ? s1 : s2, salt);
      }
    call_checked<T>(ex, r, W, 2500, op, Algorithm::kTwoShot, s1, ++salt, /*in_place=*/true);
    // Back to back on two streams without a host synchronization: ordered by the executor.
    {
      const size_t n = 5000;
      DevBuf<T> a(n), b(n), oa(n), ob(n);
      fill(a.p, r, n, 101, s1);
      fill(b.p, r, n, 102, s2);
      ex.all_reduce(a.addr(), oa.addr(), n, dtype_of(T{}), op, Algorithm::kTwoShot, reinterpret_cast<uintptr_t>(s1));
      ex.all_reduce(b.addr(), ob.addr(), n, dtype_of(T{}), op, Algorithm::kOneShot, reinterpret_cast<uintptr_t>(s2));
      ex.all_reduce(oa.addr(), oa.addr(), 0, dtype_of(T{}), op, Algorithm::kAuto, reinterpret_cast<uintptr_t>(s1));
      ex.check(reinterpret_cast<uintptr_t>(s2));
      ex.check(reinterpret_cast<uintptr_t>(s1));
      verify(oa.p, op, W, n, 101, "two streams (1)");
      verify(ob.p, op, W, n, 102, "two streams (2)");
    }
    // The pool (zero-copy) and the symmetric test.
    const size_t n = 4000;
    T* pin = reinterpret_cast<T*>(ex.pool_address());
    T* pout = pin + 8192;
    REQUIRE(ex.pool_bytes() >= 2 * 8192 * sizeof(T), "pool too small");
    REQUIRE(ex.symmetric(ex.pool_address(), 256), "the pool is not symmetric");
    {
      DevBuf<T> priv(16);
      REQUIRE(!ex.symmetric(priv.addr(), 16 * sizeof(T)), "a cudaMalloc buffer is symmetric");
    }
    fill(pin, r, n, 55, s1);
    ex.all_reduce(reinterpret_cast<uintptr_t>(pin), reinterpret_cast<uintptr_t>(pout), n, dtype_of(T{}), op,
                  Algorithm::kAuto, reinterpret_cast<uintptr_t>(s1));
    ex.check(reinterpret_cast<uintptr_t>(s1));
    verify(pout, op, W, n, 55, "pool");
    ex.check(0);
    REQUIRE(ex.epoch() > 0, "epoch did not advance");
    REQUIRE(ex.resolve(Algorithm::kAuto, 100) == Algorithm::kOneShot, "resolve small");
    REQUIRE(ex.resolve(Algorithm::kAuto, 1 << 20) == Algorithm::kTwoShot, "resolve large");
    REQUIRE(ex.config().rank == r, "config");
    ex.close();
    ex.close();  // twice: nothing
    REQUIRE(!ex.symmetric(ex.pool_address(), 16), "symmetric after close");
    bool refused = false;
    try {
      ex.all_reduce(0, 0, 1, dtype_of(T{}), op, Algorithm::kAuto, 0);
    } catch (const std::exception& e) {
      refused = std::string(e.what()).find("closed") != std::string::npos;
    }
    REQUIRE(refused, "all_reduce after close was not refused");
    refused = false;
    try {
      ex.check(0);
    } catch (const std::exception& e) {
      refused = std::string(e.what()).find("closed") != std::string::npos;
    }
    REQUIRE(refused, "check after close was not refused");
    REQUIRE(nvrar::gpu::nvshmem_init_status() == NVSHMEM_STATUS_NOT_INITIALIZED, "NVSHMEM not finalized by close");
    cudaStreamDestroy(s1);
    cudaStreamDestroy(s2);
  });
}

// A world of one: a copy on the stream, no kernel.
void run_world_one(uint64_t seed) {
  on_machine(1, 1, seed, [&](Machine& m, UidBox& box, int r) {
    GpuExecutor ex(config(0, 1, 1), share_uid(box, r));
    const uint64_t before = nvrar::emu::host::launches();
    call_checked<float>(ex, 0, 1, 777, RedOp::kSum, Algorithm::kAuto, nullptr, 3);
    call_checked<float>(ex, 0, 1, 777, RedOp::kSum, Algorithm::kAuto, nullptr, 4, true);
    REQUIRE(nvrar::emu::host::launches() == before, "a world of one launched a kernel");
    ex.close();
  });
}

// Fused all-reduce + add + RMSNorm against the host reference (protocol/epilogue.h).
template <typename T>
void fused_checked(GpuExecutor& ex, int r, int W, size_t rows, size_t h, Algorithm alg, cudaStream_t s, int salt,
                   bool sync = true) {
  const size_t n = rows * h;
  DevBuf<T> x(n), res(n), w(h);
  fill(x.p, r, n, salt, s);
  std::vector<T> res_h(n), w_h(h);
  for (size_t i = 0; i < n; ++i) res_h[i] = from_int<T>(static_cast<int>(i % 5) - 2);
  for (size_t i = 0; i < h; ++i) w_h[i] = from_int<T>(static_cast<int>(i % 3) + 1);
  cuda(cudaMemcpy(res.p, res_h.data(), n * sizeof(T), cudaMemcpyHostToDevice), "res");
  cuda(cudaMemcpy(w.p, w_h.data(), h * sizeof(T), cudaMemcpyHostToDevice), "w");
  ex.all_reduce_add_rms_norm(x.addr(), res.addr(), w.addr(), rows, h, dtype_of(T{}), 1e-5f, alg,
                             reinterpret_cast<uintptr_t>(s));
  if (!sync) return;
  ex.check(reinterpret_cast<uintptr_t>(s));
  std::vector<T> x_got(n), res_got(n), sum(n), want_x(n), want_res(n);
  cuda(cudaMemcpy(x_got.data(), x.p, n * sizeof(T), cudaMemcpyDeviceToHost), "x");
  cuda(cudaMemcpy(res_got.data(), res.p, n * sizeof(T), cudaMemcpyDeviceToHost), "res");
  for (size_t i = 0; i < n; ++i) sum[i] = expected<T>(RedOp::kSum, W, i, salt);
  for (size_t row = 0; row < rows; ++row)
    nvrar::add_rms_norm_row(&want_x[row * h], &want_res[row * h], &sum[row * h], &res_h[row * h], w_h.data(), h, 1e-5f);
  REQUIRE(std::memcmp(x_got.data(), want_x.data(), n * sizeof(T)) == 0, "rank " << r << ": fused x differs");
  REQUIRE(std::memcmp(res_got.data(), want_res.data(), n * sizeof(T)) == 0, "rank " << r << ": fused residual differs");
}

void run_fused(int N, int G, uint64_t seed) {
  const int W = N * G;
  on_machine(W, G, seed, [&](Machine& m, UidBox& box, int r) {
    GpuExecutor ex(config(r, W, G), share_uid(box, r));
    cudaStream_t s = nullptr;
    cuda(cudaStreamCreate(&s), "stream");
    fused_checked<float>(ex, r, W, 3, 256, Algorithm::kAuto, s, 1);
    fused_checked<nvrar::bf16>(ex, r, W, 5, 128, Algorithm::kTwoShot, s, 2);
    fused_checked<nvrar::f16>(ex, r, W, 2, 64, Algorithm::kOneShot, s, 3);
    ex.close();
  });
}

// A graph captured once (all-reduce, one-shot and two-shot, and a fused call whose first call is
// inside the capture) and replayed many times with new inputs; eager calls on another stream
// between the replays, never synchronized by the host in between.
void run_graph(int N, int G, int replays, uint64_t seed) {
  const int W = N * G;
  on_machine(W, G, seed, [&](Machine& m, UidBox& box, int r) {
    GpuExecutor ex(config(r, W, G), share_uid(box, r));
    cudaStream_t s = nullptr, e = nullptr;
    cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
    cuda(cudaStreamCreateWithFlags(&e, cudaStreamNonBlocking), "stream");
    const size_t n1 = 3000, n2 = 20000, rows = 2, h = 128;
    DevBuf<float> in1(n1), out1(n1), in2(n2), out2(n2), x(rows * h), res(rows * h), w(h);
    std::vector<float> ones(h, 1.0f);
    cuda(cudaMemcpy(w.p, ones.data(), h * sizeof(float), cudaMemcpyHostToDevice), "w");
    // An eager call first: the capture then waits for it through an external event node.
    ex.all_reduce(in1.addr(), out1.addr(), n1, DType::kFloat32, RedOp::kSum, Algorithm::kOneShot, reinterpret_cast<uintptr_t>(e));
    cudaGraph_t g = nullptr;
    cuda(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), "begin capture");
    ex.all_reduce(in1.addr(), out1.addr(), n1, DType::kFloat32, RedOp::kSum, Algorithm::kOneShot, reinterpret_cast<uintptr_t>(s));
    ex.all_reduce(in2.addr(), out2.addr(), n2, DType::kFloat32, RedOp::kMax, Algorithm::kTwoShot, reinterpret_cast<uintptr_t>(s));
    ex.all_reduce_add_rms_norm(x.addr(), res.addr(), w.addr(), rows, h, DType::kFloat32, 1e-5f, Algorithm::kAuto,
                               reinterpret_cast<uintptr_t>(s));
    cuda(cudaStreamEndCapture(s, &g), "end capture");
    cudaGraphExec_t exec = nullptr;
    cuda(cudaGraphInstantiate(&exec, g, 0), "instantiate");
    const uint64_t e0 = ex.epoch();
    for (int k = 0; k < replays; ++k) {
      fill(in1.p, r, n1, 10 + k, s);
      fill(in2.p, r, n2, 20 + k, s);
      std::vector<float> xs(rows * h), rs(rows * h, 0.0f);
      for (size_t i = 0; i < xs.size(); ++i) xs[i] = static_cast<float>(value(r, i, 30 + k));
      cuda(cudaMemcpyAsync(x.p, xs.data(), xs.size() * sizeof(float), cudaMemcpyHostToDevice, s), "x");
      cuda(cudaMemcpyAsync(res.p, rs.data(), rs.size() * sizeof(float), cudaMemcpyHostToDevice, s), "res");
      cuda(cudaGraphLaunch(exec, s), "replay");
      // An eager call on another stream right behind the replay: it must run after it.
      if (k % 2 == 1) call_checked<float>(ex, r, W, 1500, RedOp::kMin, Algorithm::kAuto, e, 40 + k);
      ex.check(reinterpret_cast<uintptr_t>(s));
      verify(out1.p, RedOp::kSum, W, n1, 10 + k, "replay " + std::to_string(k) + " one-shot");
      verify(out2.p, RedOp::kMax, W, n2, 20 + k, "replay " + std::to_string(k) + " two-shot");
      std::vector<float> rgot(rows * h);
      cuda(cudaMemcpy(rgot.data(), res.p, rgot.size() * sizeof(float), cudaMemcpyDeviceToHost), "res");
      for (size_t i = 0; i < rgot.size(); ++i)
        REQUIRE(rgot[i] == expected<float>(RedOp::kSum, W, i, 30 + k), "replay " << k << ": fused residual " << i);
    }
    REQUIRE(ex.epoch() > e0, "replays did not advance the epoch");
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(g);
    ex.close();
  });
}

// NVSHMEM initialized by another library first (nvshmem4py): the executor joins it, takes and
// drops one reference, and leaves it initialized.
void run_join(int N, int G, uint64_t seed) {
  const int W = N * G;
  on_machine(W, G, seed, [&](Machine& m, UidBox& box, int r) {
    const std::string uid = share_uid(box, r);
    REQUIRE(nvrar::emu::host::init_external(uid, r, W) == 0, "external init");
    GpuExecutor ex(config(r, W, G), "");  // no unique id: a join needs none
    REQUIRE(nvrar::emu::host::nvshmem_refs() == 2, "the join took no reference");
    call_checked<float>(ex, r, W, 2000, RedOp::kSum, Algorithm::kTwoShot, nullptr, 5);
    ex.close();
    REQUIRE(nvrar::gpu::nvshmem_init_status() >= NVSHMEM_STATUS_IS_INITIALIZED, "close finalized another library's NVSHMEM");
    REQUIRE(nvrar::emu::host::nvshmem_refs() == 1, "close did not drop its reference");
    nvrar::emu::host::finalize_external();
    REQUIRE(nvrar::gpu::nvshmem_init_status() == NVSHMEM_STATUS_NOT_INITIALIZED, "still initialized");
  });
}

// NVSHMEM's own reduction (the benchmark's peer) on symmetric buffers.
void run_nvshmem_reduce(uint64_t seed) {
  const int W = 4, G = 2;
  on_machine(W, G, seed, [&](Machine& m, UidBox& box, int r) {
    GpuExecutor ex(config(r, W, G), share_uid(box, r));
    const size_t n = 1000;
    float* src = reinterpret_cast<float*>(ex.pool_address());
    float* dst = src + 4096;
    fill(src, r, n, 7, nullptr);
    nvrar::gpu::nvshmem_reduce(reinterpret_cast<uintptr_t>(dst), reinterpret_cast<uintptr_t>(src), n, DType::kFloat32,
                               RedOp::kSum, 0);
    cuda(cudaStreamSynchronize(nullptr), "sync");
    verify(dst, RedOp::kSum, W, n, 7, "nvshmem_reduce float sum");
    int32_t* isrc = reinterpret_cast<int32_t*>(ex.pool_address());
    fill(isrc, r, n, 8, nullptr);
    nvrar::gpu::nvshmem_reduce(reinterpret_cast<uintptr_t>(isrc + 4096), reinterpret_cast<uintptr_t>(isrc), n,
                               DType::kInt32, RedOp::kMax, 0);
    cuda(cudaStreamSynchronize(nullptr), "sync");
    verify(isrc + 4096, RedOp::kMax, W, n, 8, "nvshmem_reduce int max");
    bool refused = false;
    try {
      nvrar::gpu::nvshmem_reduce(0, 0, 1, DType::kFloat32, RedOp::kAvg, 0);
    } catch (const std::exception& e) {
      refused = std::string(e.what()).find("no avg reduction") != std::string::npos;
    }
    REQUIRE(refused, "NVSHMEM avg reduction not refused");
    ex.close();
  });
}

// A set-up step that fails on ONE PE: every PE raises (the failing one with its step, the others
// naming it), none is left in a collective, and a second set-up afterwards succeeds, and its
// close finalizes NVSHMEM (the failed executor was never counted).
void run_setup_failure(const std::string& point, int nth, const std::string& needle, uint64_t seed) {
  const int W = 4, G = 2, victim = 1;
  HostBarrier bar(W);
  on_machine(W, G, seed, [&](Machine& m, UidBox& box, int r) {
    const std::string uid = share_uid(box, r);
    std::string bad;  // checked after the barrier, so that a failed check ends no PE early
    try {
      GpuExecutor ex(config(r, W, G), uid);
      bad = "the set-up did not fail";
    } catch (const nvrar::Error& e) {
      const std::string t = e.what();
      if (r == victim && (t.find("failed on rank 1 (") == std::string::npos || t.find(needle) == std::string::npos))
        bad = "rank 1's error does not name its step (" + needle + "): " + t;
      if (r != victim && t.find("failed on rank 1 ") == std::string::npos)
        bad = "rank " + std::to_string(r) + " does not name rank 1: " + t;
    }
    bar.wait();
    REQUIRE(bad.empty(), bad);
    if (point == "pe_numbering") return;  // that PE stays misnumbered
    GpuExecutor again(config(r, W, G), uid);
    call_checked<float>(again, r, W, 1200, RedOp::kSum, Algorithm::kAuto, nullptr, 9);
    again.close();
    REQUIRE(nvrar::gpu::nvshmem_init_status() == NVSHMEM_STATUS_NOT_INITIALIZED,
            "NVSHMEM not finalized after the failed set-up and a good one (the executor count is off)");
  }, [&](Machine& m) { m.inject(victim, point, nth); });
}

// A failure before NVSHMEM's bootstrap on one PE: it raises at once; the others' bootstrap ends
// at its deadline, and they raise too.
void run_preinit_failure(const std::string& point, const std::string& needle, uint64_t seed) {
  const int W = 2, G = 1;
  on_machine(W, G, seed, [&](Machine& m, UidBox& box, int r) {
    const std::string uid = share_uid(box, r);
    try {
      GpuExecutor ex(config(r, W, G), uid);
      REQUIRE(false, "rank " << r << ": the set-up did not fail");
    } catch (const nvrar::Error& e) {
      const std::string t = e.what();
      if (r == 1) REQUIRE(t.find(needle) != std::string::npos, "rank 1: " << t);
      else REQUIRE(t.find("NVSHMEM initialization failed") != std::string::npos, "rank " << r << ": " << t);
    }
  }, [&](Machine& m) { m.inject(1, point); });
}

// Several PEs on one GPU without MPS (NVSHMEM's limited multi-process-per-GPU mode, where NVSHMEM
// ends the process at the set-up verdict's reduction): every PE raises with what to do instead.
void run_limited_mpg(uint64_t seed) {
  const int W = 2, G = 2;
  MachineConfig mc = machine(W, G, seed);
  mc.limited_mpg = true;
  Machine m(mc);
  UidBox box;
  no_errors(run_pes(m, W, [&](int r) {
    const std::string uid = share_uid(box, r);
    try {
      GpuExecutor ex(config(r, W, G), uid);
      REQUIRE(false, "rank " << r << ": the set-up did not fail in NVSHMEM's limited multi-process-per-GPU mode");
    } catch (const nvrar::Error& e) {
      const std::string t = e.what();
      REQUIRE(t.find("without MPS") != std::string::npos && t.find("nvidia-cuda-mps-control") != std::string::npos,
              "rank " << r << ": " << t);
    }
  }));
}

// Refusals before any collective, identical on every PE.
void run_refusals(uint64_t seed) {
  const int W = 2;
  on_machine(W, 1, seed, [&](Machine& m, UidBox& box, int r) {
    const std::string uid = share_uid(box, r);
    // A bad field of the configuration and the words its refusal must contain.
    const std::vector<std::pair<std::function<void(GpuConfig&)>, std::string>> bad = {
        {[](GpuConfig& c) { c.channels = 5; }, "NVRAR_GPU_CHANNELS"},
        {[](GpuConfig& c) { c.timeout_s = 0; }, "timeout must be > 0"},
        {[](GpuConfig& c) { c.ranks_per_node = 3; }, "must divide the world size"},
        {[](GpuConfig& c) { c.threads = 16; }, "bad launch configuration"},
        {[](GpuConfig& c) { c.rank = 7; }, "rank 7 of 2"}};
    for (const auto& [spoil, needle] : bad) {
      GpuConfig c = config(r, W, 1);
      spoil(c);
      std::string why = "not refused";
      try {
        GpuExecutor ex(c, uid);
      } catch (const nvrar::Error& e) {
        why = e.what();
      }
      REQUIRE(why.find(needle) != std::string::npos, "expected '" << needle << "': " << why);
    }
  });
  // A fault on every PE that the constructor refuses before any collective: no device, an NVSHMEM
  // bootstrapped but not initialized.
  for (const auto& [fault, needle] : {std::pair<std::string, std::string>{"cudaGetDeviceCount", "needs a CUDA device"},
                                      {"bootstrapped", "bootstrapped but not initialized"}}) {
    on_machine(W, 1, seed, [&](Machine&, UidBox& box, int r) {
      const std::string uid = share_uid(box, r);
      std::string why;
      try {
        GpuExecutor ex(config(r, W, 1), uid);
      } catch (const nvrar::Error& e) {
        why = e.what();
      }
      REQUIRE(why.find(needle) != std::string::npos, fault << ": " << why);
    }, [&](Machine& m) {
      for (int p = 0; p < W; ++p) m.inject(p, fault);
    });
  }
}

// A user-set NVSHMEM_SYMMETRIC_SIZE is left alone; two executors in one process share NVSHMEM:
// closing the first keeps it, closing the second finalizes it; abandon() is not collective.
void run_two_executors(uint64_t seed) {
  const int W = 2;
  on_machine(W, 1, seed, [&](Machine& m, UidBox& box, int r) {
    nvrar::emu::host::env_set("NVSHMEM_SYMMETRIC_SIZE", "512M");
    const std::string uid = share_uid(box, r);
    GpuExecutor a(config(r, W, 1), uid);
    for (const auto& kv : nvrar::gpu::env_set_by_nvrar())
      REQUIRE(kv.rfind("NVSHMEM_SYMMETRIC_SIZE=", 0) != 0, "the user's NVSHMEM_SYMMETRIC_SIZE was overridden");
    GpuExecutor b(config(r, W, 1), "");
    call_checked<float>(a, r, W, 900, RedOp::kSum, Algorithm::kAuto, nullptr, 1);
    call_checked<float>(b, r, W, 900, RedOp::kMax, Algorithm::kTwoShot, nullptr, 2);
    a.close();
    REQUIRE(nvrar::gpu::nvshmem_init_status() >= NVSHMEM_STATUS_IS_INITIALIZED, "closing one executor finalized NVSHMEM");
    call_checked<float>(b, r, W, 900, RedOp::kSum, Algorithm::kOneShot, nullptr, 3);
    {
      GpuExecutor c(config(r, W, 1), "");
      c.abandon();  // not collective; the destructor neither
    }
    b.close();
    REQUIRE(nvrar::gpu::nvshmem_init_status() == NVSHMEM_STATUS_NOT_INITIALIZED, "not finalized after the last close");
  });
}

// The legacy stream while another thread of the PE captures in global mode: CUDA refuses it
// (cudaErrorStreamCaptureImplicit); the call raises a clear error and launches nothing, and the
// executor keeps working afterwards.
void run_legacy_during_capture(uint64_t seed) {
  const int W = 2;
  on_machine(W, 1, seed, [&](Machine& m, UidBox& box, int r) {
    GpuExecutor ex(config(r, W, 1), share_uid(box, r));
    cudaStream_t cap = nullptr;
    cuda(cudaStreamCreateWithFlags(&cap, cudaStreamNonBlocking), "stream");
    DevBuf<float> buf(64);
    std::promise<void> begun, done;
    std::thread other([&] {
      m.bind(r);
      cudaStreamBeginCapture(cap, cudaStreamCaptureModeGlobal);
      begun.set_value();
      done.get_future().wait();
      cudaGraph_t g = nullptr;
      cudaStreamEndCapture(cap, &g);  // invalidated by the legacy stream's use
      if (g != nullptr) cudaGraphDestroy(g);
    });
    begun.get_future().wait();
    std::string why;
    const uint64_t before = nvrar::emu::host::launches();
    try {
      ex.all_reduce(buf.addr(), buf.addr(), 64, DType::kFloat32, RedOp::kSum, Algorithm::kAuto, 0);
    } catch (const nvrar::Error& e) {
      why = e.what();
    }
    done.set_value();
    other.join();
    REQUIRE(why.find("legacy default stream") != std::string::npos, "no clear error: '" << why << "'");
    REQUIRE(nvrar::emu::host::launches() == before, "a kernel was launched");
    call_checked<float>(ex, r, W, 700, RedOp::kSum, Algorithm::kAuto, cap, 4);
    ex.close();
  });
}

// A capture invalidated before the call (a synchronization of the capturing stream): the call
// raises and says so.
void run_invalidated_capture(uint64_t seed) {
  const int W = 2;
  on_machine(W, 1, seed, [&](Machine& m, UidBox& box, int r) {
    GpuExecutor ex(config(r, W, 1), share_uid(box, r));
    cudaStream_t s = nullptr;
    cuda(cudaStreamCreate(&s), "stream");
    cuda(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "begin");
    REQUIRE(cudaStreamSynchronize(s) == cudaErrorStreamCaptureUnsupported, "sync of a capturing stream allowed");
    std::string why;
    try {
      DevBuf<float> buf(64);
      ex.all_reduce(buf.addr(), buf.addr(), 64, DType::kFloat32, RedOp::kSum, Algorithm::kAuto,
                    reinterpret_cast<uintptr_t>(s));
    } catch (const nvrar::Error& e) {
      why = e.what();
    }
    cudaGraph_t g = nullptr;
    REQUIRE(cudaStreamEndCapture(s, &g) == cudaErrorStreamCaptureInvalidated, "capture not invalidated");
    REQUIRE(why.find("capture was invalidated") != std::string::npos, "no clear error: '" << why << "'");
    call_checked<float>(ex, r, W, 300, RedOp::kSum, Algorithm::kAuto, s, 5);
    ex.close();
  });
}

// A rank's configuration in the failure cases: one rank per node, a 0.5 s deadline.
GpuConfig short_deadline(int r, int W) {
  GpuConfig c = config(r, W, 1);
  c.timeout_s = 0.5;
  return c;
}

cudaStream_t new_stream() {
  cudaStream_t s = nullptr;
  cuda(cudaStreamCreate(&s), "stream");
  return s;
}

// One rank never calls: the caller's check() raises the recorded timeout (phase, peer), a later
// eager call is refused with that failure, and a replay of a graph captured before the failure
// traps at entry: check() raises the recorded failure before the CUDA error.
void run_timeout_and_replay(uint64_t seed) {
  const int W = 2;
  HostBarrier bar(W);
  on_machine(W, 1, seed, [&](Machine& m, UidBox& box, int r) {
    GpuExecutor ex(short_deadline(r, W), share_uid(box, r));
    cudaStream_t s = new_stream();
    const size_t n = 2000;
    DevBuf<float> in(n), out(n);
    cudaGraph_t g = nullptr;
    cuda(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), "begin");
    ex.all_reduce(in.addr(), out.addr(), n, DType::kFloat32, RedOp::kSum, Algorithm::kTwoShot, reinterpret_cast<uintptr_t>(s));
    cuda(cudaStreamEndCapture(s, &g), "end");
    cudaGraphExec_t exec = nullptr;
    cuda(cudaGraphInstantiate(&exec, g, 0), "instantiate");
    fill(in.p, r, n, 3, s);
    cuda(cudaGraphLaunch(exec, s), "replay");
    ex.check(reinterpret_cast<uintptr_t>(s));
    verify(out.p, RedOp::kSum, W, n, 3, "replay before the failure");
    bar.wait();
    if (r == 0) {
      DevBuf<float> a(n);
      fill(a.p, r, n, 1, s);
      ex.all_reduce(a.addr(), a.addr(), n, DType::kFloat32, RedOp::kSum, Algorithm::kTwoShot, reinterpret_cast<uintptr_t>(s));
      try {
        ex.check(reinterpret_cast<uintptr_t>(s));
        REQUIRE(false, "rank 0: no timeout raised");
      } catch (const nvrar::ProtocolError& e) {
        REQUIRE(e.is_timeout() && e.peer == 1, "rank 0: " << e.what());
      }
      try {
        ex.all_reduce(a.addr(), a.addr(), n, DType::kFloat32, RedOp::kSum, Algorithm::kTwoShot, reinterpret_cast<uintptr_t>(s));
        REQUIRE(false, "rank 0: a call after the failure was not refused");
      } catch (const nvrar::Error& e) {
        REQUIRE(std::string(e.what()).find("failed earlier") != std::string::npos, "rank 0: " << e.what());
      }
      cuda(cudaGraphLaunch(exec, s), "replay after the failure");
      try {
        ex.check(reinterpret_cast<uintptr_t>(s));
        REQUIRE(false, "rank 0: the replay after the failure raised nothing");
      } catch (const nvrar::ProtocolError& e) {
        REQUIRE(e.is_timeout(), "rank 0: the replay raised another failure: " << e.what());
      }
      REQUIRE(nvrar::emu::host::sticky_error(), "rank 0: the replay after the failure did not trap");
    }
    bar.wait();
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(g);
    if (r == 0) ex.abandon();  // its context is lost: no collective on it
  });
}

// What check() raised after one call, for the cases below: they check it after their last barrier,
// so that a failed expectation leaves no PE waiting at one.
struct Raised {
  bool any = false;
  nvrar::ProtocolError::Kind kind{};
  int peer = -1;
  std::string text;
};

// One in-place float32 two-shot all_reduce of n elements at `a` on `s` (0: the legacy default
// stream), then check(s).
Raised reduce_and_check(GpuExecutor& ex, DevBuf<float>& a, size_t n, cudaStream_t s) {
  Raised out;
  ex.all_reduce(a.addr(), a.addr(), n, DType::kFloat32, RedOp::kSum, Algorithm::kTwoShot, reinterpret_cast<uintptr_t>(s));
  try {
    ex.check(reinterpret_cast<uintptr_t>(s));
  } catch (const nvrar::ProtocolError& e) {
    out.any = true;
    out.kind = e.kind;
    out.peer = e.peer;
    out.text = e.what();
  }
  return out;
}

// Two ranks, one per node, a 0.5 s deadline: `body(ex, r)` after one checked call on `s` (so that
// the communicator has run), then every PE abandons it (a failed communicator: no collective).
void two_ranks_short_deadline(uint64_t seed, bool legacy_stream,
                              const std::function<std::string(GpuExecutor&, cudaStream_t, HostBarrier&, int)>& body) {
  const int W = 2;
  HostBarrier bar(W);
  on_machine(W, 1, seed, [&](Machine& m, UidBox& box, int r) {
    GpuExecutor ex(short_deadline(r, W), share_uid(box, r));
    cudaStream_t s = legacy_stream ? nullptr : new_stream();
    DevBuf<float> a(2000);
    fill(a.p, r, 2000, 1, s);
    const Raised first = reduce_and_check(ex, a, 2000, s);
    REQUIRE(!first.any, "rank " << r << ": " << first.text);
    verify(a.p, RedOp::kSum, W, 2000, 1, "before the failure");
    bar.wait();
    const std::string bad = body(ex, s, bar, r);
    bar.wait();
    ex.abandon();
    REQUIRE(bad.empty(), bad);
  });
}

// check() on the legacy default stream (handle 0: torch's default stream, the stream of a caller
// that names none) waits for the calls on it like on any other: a timeout there is raised by
// check(), not left to the next call (check(0) once returned at once).
void run_timeout_on_legacy_stream(uint64_t seed) {
  two_ranks_short_deadline(seed, true, [](GpuExecutor& ex, cudaStream_t s, HostBarrier&, int r) -> std::string {
    if (r != 0) return "";  // rank 1 never makes the second call
    DevBuf<float> a(2000);
    const Raised e = reduce_and_check(ex, a, 2000, s);
    if (!e.any) return "rank 0: check(0) returned while its call on the legacy stream waited for rank 1";
    if (e.kind != nvrar::ProtocolError::Kind::kTimeout || e.peer != 1) return "rank 0: " + e.text;
    return "";
  });
}

// An eager call launched after a peer's abort arrived (the host cannot see the abort cell, so it
// launches): the kernel records the abort and returns, check() raises it, and the context keeps no
// sticky error (a trap there would, and under MPS it ends every process sharing the GPU).
void run_eager_after_abort(uint64_t seed) {
  two_ranks_short_deadline(seed, false, [](GpuExecutor& ex, cudaStream_t s, HostBarrier& bar, int r) -> std::string {
    DevBuf<float> a(2000);
    std::string bad;
    if (r == 1) {  // alone: times out and aborts rank 0
      const Raised e = reduce_and_check(ex, a, 2000, s);
      if (!e.any || e.kind != nvrar::ProtocolError::Kind::kTimeout) bad = "rank 1: no timeout raised: " + e.text;
    }
    bar.wait();
    if (r == 0) {  // rank 1's abort is in rank 0's abort cell; nothing is recorded on rank 0's host yet
      const Raised e = reduce_and_check(ex, a, 2000, s);
      if (!e.any || e.text.find("aborted by rank 1") == std::string::npos)
        bad = "rank 0: the call after rank 1's abort raised " + (e.any ? e.text : std::string("nothing"));
      else if (nvrar::emu::host::sticky_error())
        bad = "rank 0: the eager call after the abort trapped";
    }
    return bad;
  });
}

// A call mismatch the 16-bit signature cannot see (counts 100000 and 131409, float32 two-shot,
// NOTE [call description]) raised with what differed: the rank that caught it names the count,
// the peer's against its own; the other was aborted by it.
void run_mismatch_text(uint64_t seed) {
  std::string texts[2];
  two_ranks_short_deadline(seed, false, [&](GpuExecutor& ex, cudaStream_t s, HostBarrier& bar, int r) -> std::string {
    DevBuf<float> a(131409);
    fill(a.p, r, 131409, 1, s);
    const Raised e = reduce_and_check(ex, a, r == 0 ? 100000 : 131409, s);
    texts[r] = !e.any ? "(nothing raised)" : e.kind == nvrar::ProtocolError::Kind::kMismatch ? e.text : "(not a mismatch) " + e.text;
    bar.wait();
    if (r != 0) return "";
    int named = 0;
    for (int q = 0; q < 2; ++q) {
      if (texts[q].find("call mismatch") == std::string::npos && texts[q].find("aborted by rank") == std::string::npos)
        return "rank " + std::to_string(q) + ": " + texts[q];
      named += texts[q].find(q == 0 ? "count is 0x20151, mine 0x186a0" : "count is 0x186a0, mine 0x20151") !=
               std::string::npos;
    }
    return named >= 1 ? "" : "no rank's error names the counts: [" + texts[0] + "] [" + texts[1] + "]";
  });
}

// abandon() (interpreter exit, a failed set-up elsewhere) with a call in flight whose peer never
// comes: it returns once the kernel has ended by its deadline, leaving no work on the streams for
// CUDA's and NVSHMEM's teardown.
void run_abandon_in_flight(uint64_t seed) {
  const int W = 2;
  HostBarrier bar(W);
  on_machine(W, 1, seed, [&](Machine& m, UidBox& box, int r) {
    GpuExecutor ex(short_deadline(r, W), share_uid(box, r));
    bar.wait();
    uint64_t left = 0;
    if (r == 0) {
      cudaStream_t s = nullptr;
      cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
      float* a = nullptr;
      cuda(cudaMalloc(&a, 3000 * sizeof(float)), "cudaMalloc");
      ex.all_reduce(reinterpret_cast<uintptr_t>(a), reinterpret_cast<uintptr_t>(a), 3000, DType::kFloat32,
                    RedOp::kSum, Algorithm::kTwoShot, reinterpret_cast<uintptr_t>(s));
      ex.abandon();
      left = nvrar::emu::host::pending();
    }
    bar.wait();
    if (r == 1) ex.abandon();
    REQUIRE(left == 0, "abandon() returned with " << left << " operation(s) in flight");
  });
}

std::vector<Case> make_cases() {
  std::vector<Case> cs;
  cs.push_back({"lifecycle 2x2 float32 sum (nvrar init, eager, two streams, pool, close)", true,
                [](uint64_t s) { run_lifecycle<float>(2, 2, RedOp::kSum, s); }});
  cs.push_back({"lifecycle 2x1 bfloat16 max", false, [](uint64_t s) { run_lifecycle<nvrar::bf16>(2, 1, RedOp::kMax, s); }});
  // In the quick set: under ThreadSanitizer it found the cross-parity overlap (NOTE [slot strides]).
  cs.push_back({"lifecycle 3x1 int32 min", true, [](uint64_t s) { run_lifecycle<int32_t>(3, 1, RedOp::kMin, s); }});
  cs.push_back({"lifecycle 1x2 float16 sum", false, [](uint64_t s) { run_lifecycle<nvrar::f16>(1, 2, RedOp::kSum, s); }});
  cs.push_back({"world of one", true, [](uint64_t s) { run_world_one(s); }});
  cs.push_back({"fused 2x2 (float32, bfloat16, float16)", true, [](uint64_t s) { run_fused(2, 2, s); }});
  cs.push_back({"fused 3x1", false, [](uint64_t s) { run_fused(3, 1, s); }});
  cs.push_back({"graph 2x2: capture, 6 replays, eager calls between", true, [](uint64_t s) { run_graph(2, 2, 6, s); }});
  cs.push_back({"graph 2x1: capture, 20 replays", false, [](uint64_t s) { run_graph(2, 1, 20, s); }});
  cs.push_back({"join an NVSHMEM initialized by another library 2x2", true, [](uint64_t s) { run_join(2, 2, s); }});
  cs.push_back({"nvshmem_reduce 2x2", false, [](uint64_t s) { run_nvshmem_reduce(s); }});
  cs.push_back({"refusals before any collective", true, [](uint64_t s) { run_refusals(s); }});
  cs.push_back({"two executors, a user heap size, abandon", true, [](uint64_t s) { run_two_executors(s); }});
  cs.push_back({"legacy stream during another thread's global capture", true,
                [](uint64_t s) { run_legacy_during_capture(s); }});
  cs.push_back({"invalidated capture", false, [](uint64_t s) { run_invalidated_capture(s); }});
  cs.push_back({"timeout, refusal, replay after the failure traps", true, [](uint64_t s) { run_timeout_and_replay(s); }});
  cs.push_back({"abandon with a call in flight", true, [](uint64_t s) { run_abandon_in_flight(s); }});
  cs.push_back({"check on the legacy stream waits for its calls", true, [](uint64_t s) { run_timeout_on_legacy_stream(s); }});
  cs.push_back({"limited multi-process-per-GPU mode refused", true, [](uint64_t s) { run_limited_mpg(s); }});
  cs.push_back({"an eager call after an abort returns without trapping", true, [](uint64_t s) { run_eager_after_abort(s); }});
  cs.push_back({"a call mismatch names what differed", true, [](uint64_t s) { run_mismatch_text(s); }});
  struct Point {
    const char* what;
    int nth;
    const char* needle;
    bool quick;
  };
  for (const Point& p : {Point{"pe_numbering", 1, "PE numbering", true}, Point{"nvshmem_malloc", 2, "nvshmem_malloc", true},
                         Point{"cudaMemset", 1, "zeroing the segment", false}, Point{"cudaMalloc", 1, "the peer table", true},
                         Point{"cudaMemcpy", 1, "the peer table", false}, Point{"cudaMalloc", 2, "the device state", false},
                         Point{"cudaHostAlloc", 1, "the error record", false},
                         Point{"cudaHostGetDevicePointer", 1, "the error record", false},
                         Point{"cudaFuncGetAttributes", 1, "launch limits", true},
                         Point{"cudaEventCreateWithFlags", 2, "the ordering events", false},
                         Point{"cudaDeviceSynchronize", 1, "cudaDeviceSynchronize", true}}) {
    const std::string what = p.what, needle = p.needle;
    const int nth = p.nth;
    cs.push_back({"set-up failure on one PE: " + what + " #" + std::to_string(nth), p.quick,
                  [what, nth, needle](uint64_t s) { run_setup_failure(what, nth, needle, s); }});
  }
  cs.push_back({"pre-bootstrap failure on one PE: NVSHMEM version", false,
                [](uint64_t s) { run_preinit_failure("version", "but NVSHMEM 3.5.5 is loaded", s); }});
  cs.push_back({"pre-bootstrap failure on one PE: its bootstrap", true,
                [](uint64_t s) { run_preinit_failure("nvshmem_init", "NVSHMEM initialization failed (code 7)", s); }});
  return cs;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, list = false;
  double case_timeout_s = kTsan ? 300 : 120;
  uint64_t seed = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) % 1000000;
  std::vector<std::string> only;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      quick = true;
    } else if (a == "--list") {
      list = true;
    } else if (a == "--seed" && i + 1 < argc) {
      seed = std::strtoull(argv[++i], nullptr, 10);
    } else if (a == "--only" && i + 1 < argc) {
      only.push_back(argv[++i]);
    } else if (a == "--case-timeout" && i + 1 < argc) {
      case_timeout_s = std::atof(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--quick] [--seed N] [--only SUBSTRING]... [--case-timeout S] [--list]\n", argv[0]);
      return 2;
    }
  }
  int passed = 0, failed = 0;
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
        std::printf("emulated host: %d cases passed, %d failed (tsan: %s)\n", passed, failed + 1, kTsan ? "on" : "off");
        std::fflush(stdout);
        std::_Exit(1);
      }
    }
  });
  const auto cases = make_cases();
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    if (quick && !c.quick) continue;
    if (!only.empty() && std::none_of(only.begin(), only.end(), [&](const std::string& o) { return c.name.find(o) != std::string::npos; }))
      continue;
    if (list) {
      std::printf("%s\n", c.name.c_str());
      continue;
    }
    {
      std::lock_guard<std::mutex> lock(wd_mu);
      wd_case = c.name;
      ++wd_gen;
      wd_cv.notify_all();
    }
    const uint64_t s = seed + i;
    const int reports0 = g_tsan_reports.load();
    const auto t0 = std::chrono::steady_clock::now();
    std::string why;
    try {
      c.run(s);
    } catch (const std::exception& e) {
      why = e.what();
    }
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (why.empty() && g_tsan_reports.load() != reports0)
      why = std::to_string(g_tsan_reports.load() - reports0) + " ThreadSanitizer report(s)";
    if (why.empty()) {
      ++passed;
      std::printf("PASS %s (%.2f s)\n", c.name.c_str(), dt);
    } else {
      ++failed;
      std::printf("FAIL %s (%.2f s, seed %llu): %s\n", c.name.c_str(), dt, static_cast<unsigned long long>(s), why.c_str());
    }
    std::fflush(stdout);
  }
  {
    std::lock_guard<std::mutex> lock(wd_mu);
    wd_stop = true;
    wd_cv.notify_all();
  }
  watchdog.join();
  if (list) return 0;
  std::printf("emulated host: %d cases passed, %d failed (tsan: %s)\n", passed, failed, kTsan ? "on" : "off");
  return failed == 0 && passed > 0 ? 0 : 1;
}
