// The host emulation of the device primitives (prim_emu.h) and of NVSHMEM's device calls: threads,
// blocks, barriers with deadlines, warps, the fence model for ThreadSanitizer, the PEs' symmetric
// segments and the adversarial proxy.
#include "emu.h"

#include <pthread.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>
#include <vector>

#include "prim_emu.h"

#if defined(__SANITIZE_THREAD__)
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#endif

namespace nvrar {
namespace emu {

namespace {

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "emulated device: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

using Clock = std::chrono::steady_clock;

// A barrier of n threads whose wait has a deadline: a barrier that not every thread reaches is a
// bug of the device code (divergent __syncthreads) and ends the process with the missing threads.
class Barrier {
 public:
  void init(int n, double timeout_s, std::string where) {
    n_ = n;
    timeout_s_ = timeout_s;
    where_ = std::move(where);
    in_.assign(static_cast<size_t>(n), 0);
  }
  void wait(int me, const char* what) {
    std::unique_lock<std::mutex> lock(mu_);
    in_[static_cast<size_t>(me)] = 1;
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++gen_;
      std::fill(in_.begin(), in_.end(), 0);
      cv_.notify_all();
      return;
    }
    const uint64_t g = gen_;
    const auto until = Clock::now() + std::chrono::duration<double>(timeout_s_);
    if (!cv_.wait_until(lock, until, [&] { return gen_ != g; })) {
      std::ostringstream os;
      os << where_ << ": " << what << " not reached by every thread within " << timeout_s_ << " s (" << arrived_
         << " of " << n_ << " arrived); missing thread(s):";
      int listed = 0;
      for (int t = 0; t < n_ && listed < 16; ++t)
        if (!in_[static_cast<size_t>(t)]) {
          os << " " << t;
          ++listed;
        }
      die(os.str());
    }
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int n_ = 0;
  int arrived_ = 0;
  uint64_t gen_ = 0;
  double timeout_s_ = 60;
  std::string where_;
  std::vector<char> in_;
};

constexpr size_t kSharedBytes = 48 * 1024;  // static shared memory per block, as on the GPU

struct Warp {
  Barrier bar;
  uint32_t lanes[32];
};

struct Block {
  int pe = 0;
  int b = 0;
  Barrier bar;
  std::vector<std::unique_ptr<Warp>> warps;
  alignas(64) unsigned char smem[kSharedBytes];
};

struct ThreadCtx {
  World::Impl* world = nullptr;
  Block* block = nullptr;
  int pe = 0;
  size_t smem_cursor = 0;
  std::vector<WireOp> wire;  // this thread's wire ledger entries, appended to the world's at exit
#if defined(__SANITIZE_THREAD__)
  bool armed = false;              // a fence was passed since the last barrier (NOTE [tsan fences])
  const void* loaded[64] = {};     // relaxed atomic loads since the last fence
  unsigned nloaded = 0;
#endif
};

thread_local ThreadCtx t_ctx;

ThreadCtx& ctx() {
  if (t_ctx.world == nullptr) die("a device primitive was called outside an emulated kernel");
  return t_ctx;
}

}  // namespace

// NOTE [adversarial proxy]: every put to a PE that nvshmem_ptr cannot reach is queued and delivered
// by one proxy thread, with only the guarantees NVSHMEM documents:
//   - a put's data arrives in pieces (8 to 256 bytes, on 8-byte boundaries, each 8-byte word
//     single-copy atomic: an LL packet lands whole), the pieces in random order;
//   - a put-with-signal's signal lands after all of its data;
//   - operations from one PE to one PE are ordered only across nvshmem_fence: the proxy may deliver
//     an operation issued later before an earlier one, unless a fence separates them;
//   - random delays between deliveries.
// The proxy's choices come from one seeded generator (WorldConfig::seed), which a failing case
// prints. Thread scheduling is not reproducible; the proxy's decisions given the same queue are.
struct PutOp {
  int src = 0;
  int dst = 0;
  uint64_t gen = 0;    // the source PE's fence count when issued
  uint64_t seq = 0;    // issue order (for the reorder statistic)
  char* to = nullptr;  // destination (in the target PE's segment)
  std::vector<unsigned char> data;
  std::vector<std::pair<size_t, size_t>> pieces;  // [offset, length) still to deliver
  uint64_t* sig = nullptr;
  uint64_t sigval = 0;
};

// A write the proxy delivered that the target does not see yet (proxy-consistency mode,
// WorldConfig::consistency_delay_us): applied when due, or at the target's consistency point.
struct Hidden {
  char* to = nullptr;
  std::vector<unsigned char> data;  // a piece's bytes; empty for a signal
  bool signal = false;
  uint64_t sigval = 0;
  uint64_t due_ns = 0;
};

struct World::Impl {
  WorldConfig cfg;
  std::vector<char*> segs;
  std::unique_ptr<std::atomic<bool>[]> trapped;  // per PE: the context's sticky error (device_trap)
  std::vector<std::vector<Hidden>> hidden;  // per target PE (mu held)
  static inline std::atomic<uint64_t> consistency_points{0}, hidden_writes{0};  // every world's
  // The proxy.
  std::mutex mu;
  std::condition_variable cv;
  std::condition_variable idle_cv;
  std::deque<PutOp> ops;
  std::vector<uint64_t> fence_gen;
  std::vector<uint64_t> low_gen;  // the proxy's scratch: lowest pending fence generation per (src, dst)
  uint64_t seq = 0;
  bool stop = false;
  bool busy = false;
  ProxyStats st;
  std::mt19937_64 rng;
  std::thread proxy;
  // The wire ledger (emu.h WireOp).
  std::mutex wire_mu;
  std::vector<WireOp> wire;
  std::atomic<uint64_t> wire_seq{0};
  size_t seg_span = 0;  // bytes mapped per segment

  // The PE whose segment holds p, and p's offset there; -1 if none.
  int locate(const void* p, uint64_t* off) const {
    const char* c = static_cast<const char*>(p);
    for (int pe = 0; pe < cfg.pes; ++pe) {
      const char* b = segs[static_cast<size_t>(pe)];
      if (c >= b && c < b + cfg.segment_bytes) {
        *off = static_cast<uint64_t>(c - b);
        return pe;
      }
    }
    return -1;
  }

  int node_of(int pe) const { return pe / cfg.G; }
  bool reachable(int from, int to) const { return cfg.direct_remote || node_of(from) == node_of(to); }

  bool inside(const void* p, int me) const {
    const char* base = segs[static_cast<size_t>(me)];
    const char* c = static_cast<const char*>(p);
    return c >= base && c < base + cfg.segment_bytes;
  }

  // The same offset in PE `pe`'s segment as `p` has in mine (symmetric addresses).
  char* translate(const void* p, size_t bytes, int me, int pe, const char* what) const {
    if (pe < 0 || pe >= cfg.pes) die(std::string(what) + ": PE " + std::to_string(pe) + " does not exist");
    const char* base = segs[static_cast<size_t>(me)];
    const char* c = static_cast<const char*>(p);
    if (c < base || c + bytes > base + cfg.segment_bytes) {
      std::ostringstream os;
      os << what << " on PE " << me << ": address " << p << " (+" << bytes
         << " bytes) is outside its symmetric segment";
      die(os.str());
    }
    return segs[static_cast<size_t>(pe)] + (c - base);
  }

  // Stores len bytes at d as the NIC does: 8-byte words single-copy atomic.
  static void store_bytes(char* d, const unsigned char* s, size_t len) {
    size_t i = 0;
    while (i < len) {
      if ((reinterpret_cast<uintptr_t>(d + i) & 7) == 0 && len - i >= 8) {
        uint64_t w;
        std::memcpy(&w, s + i, 8);
        std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(d + i)).store(w, std::memory_order_relaxed);
        i += 8;
      } else {
        std::atomic_ref<unsigned char>(*reinterpret_cast<unsigned char*>(d + i)).store(s[i], std::memory_order_relaxed);
        ++i;
      }
    }
  }

  static void apply(const Hidden& h) {
    if (h.signal)
      std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(h.to)).store(h.sigval, std::memory_order_release);
    else
      store_bytes(h.to, h.data.data(), h.data.size());
  }

  // mu held. A write to PE `pe`: at once, or hidden until due (a hidden earlier write to the same
  // bytes is applied first: one place's writes become visible in their order).
  void write(int pe, Hidden h) {
    if (cfg.consistency_delay_us <= 0) {
      apply(h);
      return;
    }
    std::vector<Hidden>& v = hidden[static_cast<size_t>(pe)];
    const size_t len = h.signal ? 8 : h.data.size();
    for (size_t i = 0; i < v.size();) {
      const size_t vl = v[i].signal ? 8 : v[i].data.size();
      if (v[i].to < h.to + len && h.to < v[i].to + vl) {
        apply(v[i]);
        v.erase(v.begin() + static_cast<std::ptrdiff_t>(i));
      } else {
        ++i;
      }
    }
    h.due_ns = now_ns() + std::uniform_int_distribution<uint64_t>(0, static_cast<uint64_t>(cfg.consistency_delay_us) * 1000)(rng);
    v.push_back(std::move(h));
    ++hidden_writes;
  }

  // mu held. Applies PE pe's hidden writes that are due (all of them: `all`), in random order.
  void reveal(int pe, bool all) {
    std::vector<Hidden>& v = hidden[static_cast<size_t>(pe)];
    if (v.empty()) return;
    std::shuffle(v.begin(), v.end(), rng);
    const uint64_t t = now_ns();
    for (size_t i = 0; i < v.size();) {
      if (all || v[i].due_ns <= t) {
        apply(v[i]);
        v[i] = std::move(v.back());
        v.pop_back();
      } else {
        ++i;
      }
    }
  }

  // Whether the proxy may deliver op (a stalled PE's operations stay queued: WorldConfig::stalled_pe).
  bool live(const PutOp& op) const { return op.src != cfg.stalled_pe && op.dst != cfg.stalled_pe; }
  size_t live_ops() const {
    size_t n = 0;
    for (const PutOp& o : ops) n += live(o) ? 1 : 0;
    return n;
  }
  // Operations of PE pe still queued (what its fence waits for).
  bool pending_from(int pe) const {
    for (const PutOp& o : ops)
      if (o.src == pe) return true;
    return false;
  }

  bool any_hidden() const {
    for (const auto& v : hidden)
      if (!v.empty()) return true;
    return false;
  }

  void deliver_piece(PutOp& op, size_t k) {
    const size_t off = op.pieces[k].first, len = op.pieces[k].second;
    Hidden h;
    h.to = op.to + off;
    h.data.assign(op.data.begin() + static_cast<std::ptrdiff_t>(off), op.data.begin() + static_cast<std::ptrdiff_t>(off + len));
    write(op.dst, std::move(h));
    op.pieces[k] = op.pieces.back();
    op.pieces.pop_back();
    ++st.pieces;
  }

  void run_proxy() {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      // Hidden writes become visible when due, also while nothing else is queued.
      while (!stop && live_ops() == 0 && any_hidden()) {
        for (int pe = 0; pe < cfg.pes; ++pe) reveal(pe, false);
        if (!any_hidden()) {
          idle_cv.notify_all();
          break;
        }
        cv.wait_for(lock, std::chrono::microseconds(20));
      }
      cv.wait(lock, [&] { return stop || live_ops() > 0; });
      if (stop && live_ops() == 0) return;
      busy = true;
      for (int pe = 0; pe < cfg.pes; ++pe) reveal(pe, false);
      // Eligible: no earlier-fenced operation from the same source to the same target pending
      // (the operation's fence generation is its pair's lowest pending one).
      std::vector<uint64_t>& low = low_gen;
      low.assign(static_cast<size_t>(cfg.pes) * static_cast<size_t>(cfg.pes), UINT64_MAX);
      for (const PutOp& o : ops) {
        uint64_t& l = low[static_cast<size_t>(o.src) * static_cast<size_t>(cfg.pes) + static_cast<size_t>(o.dst)];
        l = std::min(l, o.gen);
      }
      std::vector<size_t> eligible;
      for (size_t i = 0; i < ops.size(); ++i)
        if (live(ops[i]) &&
            ops[i].gen == low[static_cast<size_t>(ops[i].src) * static_cast<size_t>(cfg.pes) + static_cast<size_t>(ops[i].dst)])
          eligible.push_back(i);
      // Adversarial: mostly the latest-issued eligible operation (overtaking what NVSHMEM does
      // not order), else any.
      size_t i = eligible.back();
      if ((rng() & 3) == 0) i = eligible[std::uniform_int_distribution<size_t>(0, eligible.size() - 1)(rng)];
      PutOp& op = ops[i];
      if (op.seq != ops.front().seq) ++st.reordered;
      bool op_done_signal = false;
      if (!op.pieces.empty()) {
        deliver_piece(op, std::uniform_int_distribution<size_t>(0, op.pieces.size() - 1)(rng));
      } else {
        if (op.sig != nullptr) {
          Hidden h;
          h.to = reinterpret_cast<char*>(op.sig);
          h.signal = true;
          h.sigval = op.sigval;
          write(op.dst, std::move(h));
          ++st.signals;
          op_done_signal = true;
        }
        ops.erase(ops.begin() + static_cast<std::ptrdiff_t>(i));
      }
      // Random delays: short ones between pieces, longer ones after a signal (so that a poller
      // sees one signal well before the next).
      const bool signalled = op_done_signal;
      const int cap = signalled ? 20 * cfg.max_delay_us : cfg.max_delay_us;
      const bool pause = cap > 0 && (signalled ? (rng() & 1) == 0 : (rng() & 3) == 0);
      const int delay = pause ? std::uniform_int_distribution<int>(1, cap)(rng) : 0;
      if (live_ops() == 0) {
        busy = false;
        if (!any_hidden()) idle_cv.notify_all();
      }
      cv.notify_all();  // (a fence waiting for this PE's operations)
      if (delay > 0) {
        lock.unlock();
        std::this_thread::sleep_for(std::chrono::microseconds(delay));
        lock.lock();
      }
    }
  }

  void enqueue(int src, int dst, char* to, const void* data, size_t bytes, uint64_t* sig, uint64_t sigval) {
    std::lock_guard<std::mutex> lock(mu);
    PutOp op;
    op.src = src;
    op.dst = dst;
    op.gen = fence_gen[static_cast<size_t>(src)];
    op.seq = seq++;
    op.to = to;
    // The snapshot reads the source as the NIC does, in words: relaxed atomic loads. A source
    // written with relaxed atomics (an LL stream, a put's trailer) is reused two rounds later,
    // ordered by causality through LL packets that carry no acquire (the partner's next message
    // needed this one's data); ThreadSanitizer cannot follow that chain, so with a plain copy a
    // gathered channel's stream (read here by its channel's last block, rewritten in round e + 2
    // by another block) was reported. A source written with plain stores still races with this
    // read where nothing orders them.
    op.data.resize(bytes);
    {
      const char* from = static_cast<const char*>(data);
      size_t i = 0;
      for (; i < bytes && (reinterpret_cast<uintptr_t>(from + i) & 7) != 0; ++i)
        op.data[i] = static_cast<unsigned char>(std::atomic_ref<char>(const_cast<char&>(from[i])).load(std::memory_order_relaxed));
      for (; i + 8 <= bytes; i += 8) {
        const uint64_t w =
            std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(const_cast<char*>(from + i))).load(std::memory_order_relaxed);
        std::memcpy(op.data.data() + i, &w, 8);
      }
      for (; i < bytes; ++i)
        op.data[i] = static_cast<unsigned char>(std::atomic_ref<char>(const_cast<char&>(from[i])).load(std::memory_order_relaxed));
    }
    for (size_t off = 0; off < bytes;) {
      size_t len = 8 * std::uniform_int_distribution<size_t>(1, std::max<size_t>(1, cfg.max_piece_bytes / 8))(rng);
      const size_t misalign = reinterpret_cast<uintptr_t>(to + off) & 7;
      if (misalign != 0) len = 8 - misalign;
      len = std::min(len, bytes - off);
      op.pieces.emplace_back(off, len);
      off += len;
    }
    op.sig = sig;
    op.sigval = sigval;
    if (bytes > 0) ++st.puts;
    ops.push_back(std::move(op));
    cv.notify_one();
  }
};

World::World(const WorldConfig& cfg) : impl_(new Impl) {
  Impl& I = *impl_;
  I.cfg = cfg;
  if (cfg.pes < 1 || cfg.G < 1 || cfg.pes % cfg.G != 0) die("bad world: pes must be a multiple of G");
  // Anonymous mappings start zeroed and take memory only where touched (a production-sized
  // segment, 16 MB chunks, is mostly untouched by one call).
  I.seg_span = std::max<size_t>((cfg.segment_bytes + 4095) / 4096 * 4096, 4096);
  for (int p = 0; p < cfg.pes; ++p) {
    void* s = mmap(nullptr, I.seg_span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (s == MAP_FAILED) die("cannot allocate a segment");
    I.segs.push_back(static_cast<char*>(s));
  }
  I.fence_gen.assign(static_cast<size_t>(cfg.pes), 0);
  I.hidden.assign(static_cast<size_t>(cfg.pes), {});
  I.trapped = std::make_unique<std::atomic<bool>[]>(static_cast<size_t>(cfg.pes));
  for (int p = 0; p < cfg.pes; ++p) I.trapped[static_cast<size_t>(p)].store(false);
  I.rng.seed(cfg.seed);
  I.proxy = std::thread([&I] { I.run_proxy(); });
}

World::~World() {
  Impl& I = *impl_;
  {
    std::lock_guard<std::mutex> lock(I.mu);
    I.stop = true;
    I.cv.notify_all();
  }
  I.proxy.join();
  for (char* s : I.segs) munmap(s, I.seg_span);
  g_wire_record = false;
}

void bind_host_thread(World* w, int pe) {
  t_ctx = ThreadCtx{};
  if (w == nullptr) return;
  t_ctx.world = w->impl();
  t_ctx.pe = pe;
}

bool World::trapped(int pe) const { return impl_->trapped[static_cast<size_t>(pe)].load(); }
void World::reset_trapped(int pe) { impl_->trapped[static_cast<size_t>(pe)].store(false); }

void consistency_totals(uint64_t* hidden, uint64_t* points) {
  *hidden = World::Impl::hidden_writes.load();
  *points = World::Impl::consistency_points.load();
}

const WorldConfig& World::config() const { return impl_->cfg; }
char* World::segment(int pe) const { return impl_->segs[static_cast<size_t>(pe)]; }

ProxyStats World::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->st;
}

bool g_wire_record = false;

const char* wire_kind_name(WireKind k) {
  switch (k) {
    case WireKind::kPut: return "put";
    case WireKind::kPutSignal: return "put_signal";
    case WireKind::kSignalOp: return "signal_op";
    case WireKind::kAtomic: return "atomic";
    case WireKind::kFence: return "fence";
    case WireKind::kQuiet: return "quiet";
    case WireKind::kWaitUntil: return "wait_until";
    case WireKind::kStoreRelaxed: return "store_relaxed";
    case WireKind::kStoreRelease: return "store_release";
    case WireKind::kSysFence: return "sys_fence";
    case WireKind::kDevFence: return "device_fence";
  }
  return "?";
}

void World::set_recording(bool on) { g_wire_record = on; }

std::vector<WireOp> World::take_wire_ops() {
  std::lock_guard<std::mutex> lock(impl_->wire_mu);
  std::vector<WireOp> v;
  v.swap(impl_->wire);
  std::sort(v.begin(), v.end(), [](const WireOp& a, const WireOp& b) { return a.seq < b.seq; });
  return v;
}

void World::quiet() {
  Impl& I = *impl_;
  std::unique_lock<std::mutex> lock(I.mu);
  const auto until = Clock::now() + std::chrono::duration<double>(I.cfg.barrier_timeout_s);
  I.cv.notify_all();  // (hidden writes: the proxy reveals them when due)
  if (!I.idle_cv.wait_until(lock, until, [&] { return I.live_ops() == 0 && !I.busy && !I.any_hidden(); }))
    die("the proxy did not drain its queue in time");
}

namespace {

// What device_trap throws through the kernel to its thread's start.
struct TrapExit {};

// A launch's end of block b (the last of its threads returned): PeLaunchImpl starts the next
// block of a launch in waves.
struct BlockDone {
  virtual ~BlockDone() = default;
  virtual void block_done(int b) = 0;
};

struct ThreadArg {
  World::Impl* world;
  Block* block;
  int pe, b, t, blocks, threads;
  const std::function<void(int)>* kernel;
  BlockDone* done;
  std::atomic<int>* left;  // threads of the block still running
};

void* thread_main(void* p) {
  const ThreadArg& a = *static_cast<ThreadArg*>(p);
  t_ctx = ThreadCtx{};
  t_ctx.world = a.world;
  t_ctx.block = a.block;
  t_ctx.pe = a.pe;
  threadIdx = uint3{static_cast<unsigned>(a.t), 0, 0};
  blockIdx = uint3{static_cast<unsigned>(a.b), 0, 0};
  blockDim = uint3{static_cast<unsigned>(a.threads), 1, 1};
  gridDim = uint3{static_cast<unsigned>(a.blocks), 1, 1};
  try {
    (*a.kernel)(a.pe);
  } catch (const TrapExit&) {
    // device_trap(): this thread ends here (the PE's sticky error is set)
  }
  if (!t_ctx.wire.empty()) {
    std::lock_guard<std::mutex> lock(a.world->wire_mu);
    a.world->wire.insert(a.world->wire.end(), t_ctx.wire.begin(), t_ctx.wire.end());
  }
  t_ctx = ThreadCtx{};
  if (a.left->fetch_sub(1) == 1) a.done->block_done(a.b);
  return nullptr;
}

}  // namespace

namespace {

// One PE's launch: its blocks, its threads, the kernel they run. In waves (0 < resident <
// blocks) at most `resident` blocks run at once: blocks start in blockIdx order, the next one when
// a running one has ended, as a GPU's block scheduler dispatches a grid larger than what fits
// (NOTE [epoch protocol], "Residency").
class PeLaunchImpl final : public PeLaunch, public BlockDone {
 public:
  PeLaunchImpl(World::Impl* world, int pe, int blocks, int threads, std::function<void(int)> kernel, int resident)
      : kernel_(std::move(kernel)), pe_(pe), threads_(threads) {
    const double timeout_s = world->cfg.barrier_timeout_s;
    for (int b = 0; b < blocks; ++b) {
      auto k = std::make_unique<Block>();
      k->pe = pe;
      k->b = b;
      const std::string where = "PE " + std::to_string(pe) + " block " + std::to_string(b);
      k->bar.init(threads, timeout_s, where);
      for (int w = 0; w < threads / 32; ++w) {
        k->warps.push_back(std::make_unique<Warp>());
        k->warps.back()->bar.init(32, timeout_s, where + " warp " + std::to_string(w));
      }
      std::memset(k->smem, 0xa5, sizeof(k->smem));  // shared memory starts as garbage
      blk_.push_back(std::move(k));
    }
    const size_t n = static_cast<size_t>(blocks) * static_cast<size_t>(threads);
    args_.resize(n);
    tids_.resize(n);
    left_ = std::make_unique<std::atomic<int>[]>(static_cast<size_t>(blocks));
    started_.assign(static_cast<size_t>(blocks), false);
    size_t k = 0;
    for (int b = 0; b < blocks; ++b) {
      left_[static_cast<size_t>(b)].store(threads);
      for (int t = 0; t < threads; ++t, ++k)
        args_[k] = ThreadArg{world, blk_[static_cast<size_t>(b)].get(), pe, b, t, blocks, threads, &kernel_, this,
                             &left_[static_cast<size_t>(b)]};
    }
    const int first = resident <= 0 || resident >= blocks ? blocks : resident;
    std::lock_guard<std::mutex> lock(start_mu_);
    next_ = first;
    for (int b = 0; b < first; ++b) start_block(b);
  }
  ~PeLaunchImpl() override { wait(); }
  void wait() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (joined_.load()) return;
    for (size_t b = 0; b < blk_.size(); ++b) {
      {
        std::unique_lock<std::mutex> s(start_mu_);
        start_cv_.wait(s, [&] { return started_[b]; });
      }
      for (size_t k = b * static_cast<size_t>(threads_); k < (b + 1) * static_cast<size_t>(threads_); ++k)
        pthread_join(tids_[k], nullptr);
    }
    joined_.store(true);
  }
  bool done() const override { return joined_.load(); }
  void block_done(int) override {
    std::lock_guard<std::mutex> lock(start_mu_);
    if (next_ < static_cast<int>(blk_.size())) start_block(next_++);
  }

 private:
  // start_mu_ held.
  void start_block(int b) {
    pthread_attr_t attr;
    pthread_attr_init(&attr);
#if defined(__SANITIZE_THREAD__)
    pthread_attr_setstacksize(&attr, 512 * 1024);
#else
    pthread_attr_setstacksize(&attr, 256 * 1024);
#endif
    for (size_t k = static_cast<size_t>(b) * static_cast<size_t>(threads_);
         k < static_cast<size_t>(b + 1) * static_cast<size_t>(threads_); ++k) {
      const int rc = pthread_create(&tids_[k], &attr, thread_main, &args_[k]);
      if (rc != 0) die("cannot start emulated thread " + std::to_string(k) + " of block " + std::to_string(b) +
                       " on PE " + std::to_string(pe_) + ": " + std::strerror(rc));
    }
    pthread_attr_destroy(&attr);
    started_[static_cast<size_t>(b)] = true;
    start_cv_.notify_all();
  }

  std::function<void(int)> kernel_;
  int pe_, threads_;
  std::vector<std::unique_ptr<Block>> blk_;
  std::vector<ThreadArg> args_;
  std::vector<pthread_t> tids_;
  std::unique_ptr<std::atomic<int>[]> left_;
  std::mutex start_mu_;
  std::condition_variable start_cv_;
  std::vector<bool> started_;
  int next_ = 0;
  std::mutex mu_;
  std::atomic<bool> joined_{false};
};

}  // namespace

std::shared_ptr<PeLaunch> World::launch_pe(int pe, int blocks, int threads, std::function<void(int pe)> kernel,
                                           int resident) {
  Impl& I = *impl_;
  if (pe < 0 || pe >= I.cfg.pes || blocks < 0 || threads < 32 || threads % 32 != 0)
    die("launch_pe: a PE of the world, blocks >= 0 and a multiple of 32 threads");
  return std::make_shared<PeLaunchImpl>(&I, pe, blocks, threads, std::move(kernel), resident);
}

void World::launch(const std::vector<int>& blocks, int threads, const std::function<void(int pe)>& kernel,
                   const std::vector<int>& resident) {
  Impl& I = *impl_;
  const int pes = I.cfg.pes;
  if (static_cast<int>(blocks.size()) != pes || threads < 32 || threads % 32 != 0)
    die("launch: one block count per PE and a multiple of 32 threads");
  std::vector<std::shared_ptr<PeLaunch>> all;
  for (int pe = 0; pe < pes; ++pe)
    if (blocks[static_cast<size_t>(pe)] > 0)
      all.push_back(launch_pe(pe, blocks[static_cast<size_t>(pe)], threads, kernel,
                              resident.empty() ? 0 : resident[static_cast<size_t>(pe)]));
  for (auto& l : all) l->wait();
}

// The primitives.

void* block_shared(size_t bytes, size_t align) {
  ThreadCtx& c = ctx();
  c.smem_cursor = (c.smem_cursor + align - 1) / align * align;
  if (c.smem_cursor + bytes > kSharedBytes) die("more than 48 KiB of static shared memory");
  void* p = c.block->smem + c.smem_cursor;
  c.smem_cursor += bytes;
  return p;
}

void syncthreads() {
  ThreadCtx& c = ctx();
  c.block->bar.wait(static_cast<int>(threadIdx.x), "__syncthreads");
#if defined(__SANITIZE_THREAD__)
  c.armed = false;
#endif
}

void trap() {
  ThreadCtx& c = ctx();
  c.world->trapped[static_cast<size_t>(c.pe)].store(true);
  throw TrapExit{};
}

void warp_exchange(uint32_t v, uint32_t* lanes) {
  ThreadCtx& c = ctx();
  Warp& w = *c.block->warps[threadIdx.x / 32];
  const int lane = static_cast<int>(threadIdx.x % 32);
  w.lanes[lane] = v;
  w.bar.wait(lane, "a warp shuffle (full mask)");
  std::memcpy(lanes, w.lanes, sizeof(w.lanes));
  w.bar.wait(lane, "a warp shuffle (full mask)");
}

// One wire ledger entry of the calling thread (target -1: no target; p: a symmetric address, whose
// offset in my segment is the offset in the target's).
void wire_log(WireKind kind, int target, const void* p, uint64_t bytes, const void* sig = nullptr) {
  ThreadCtx& c = t_ctx;
  if (c.world == nullptr) return;
  WireOp op;
  op.seq = c.world->wire_seq.fetch_add(1, std::memory_order_relaxed);
  op.kind = kind;
  op.pe = c.pe;
  op.block = static_cast<int>(blockIdx.x);
  op.thread = static_cast<int>(threadIdx.x);
  op.target = target;
  op.bytes = bytes;
  uint64_t off = 0;
  if (p != nullptr && c.world->locate(p, &off) >= 0) op.offset = off;
  if (sig != nullptr && c.world->locate(sig, &off) >= 0) op.sig_offset = static_cast<int64_t>(off);
  c.wire.push_back(op);
}

void wire_store(const void* p, bool release) {
  ThreadCtx& c = t_ctx;
  if (c.world == nullptr) return;
  uint64_t off = 0;
  const int pe = c.world->locate(p, &off);
  if (pe < 0 || (!release && pe == c.pe)) return;  // (relaxed stores: to another PE only)
  WireOp op;
  op.seq = c.world->wire_seq.fetch_add(1, std::memory_order_relaxed);
  op.kind = release ? WireKind::kStoreRelease : WireKind::kStoreRelaxed;
  op.pe = c.pe;
  op.block = static_cast<int>(blockIdx.x);
  op.thread = static_cast<int>(threadIdx.x);
  op.target = pe;
  op.offset = off;
  op.bytes = 8;
  c.wire.push_back(op);
}

// NOTE [tsan fences]: ThreadSanitizer ignores std::atomic_thread_fence, so the synchronization
// that a fence gives a relaxed atomic is modelled by hand (C++ [atomics.fences]): a release fence
// followed by a relaxed store (or read-modify-write) to X releases at X; a relaxed load (or RMW)
// of X followed by an acquire fence acquires from X. __threadfence is both. A fence covers what
// the thread had seen when it passed it: a block barrier after it brings in other threads' writes
// that the fence does not order, so a barrier disarms it (the store after it is then plain relaxed
// again, and a missing fence or release shows as a race).
void fence(bool system) {
  if (g_wire_record) wire_log(system ? WireKind::kSysFence : WireKind::kDevFence, -1, nullptr, 0);
#if defined(__SANITIZE_THREAD__)
  ThreadCtx& c = t_ctx;
  const unsigned n = std::min<unsigned>(c.nloaded, 64);
  for (unsigned i = 0; i < n; ++i) __tsan_acquire(const_cast<void*>(c.loaded[i]));
  c.nloaded = 0;
  c.armed = true;
#endif
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

#if defined(__SANITIZE_THREAD__)
void tsan_store(const void* p) {
  if (t_ctx.armed) __tsan_release(const_cast<void*>(p));
}
void tsan_load(const void* p) {
  ThreadCtx& c = t_ctx;
  c.loaded[c.nloaded % 64] = p;
  ++c.nloaded;
}
#endif

// A real sleep, much longer than asked: thousands of emulated threads poll on a few cores, and
// the threads they wait for (and the proxy) must get the CPU.
void nanosleep(unsigned) { std::this_thread::sleep_for(std::chrono::microseconds(200)); }

uint64_t now_ns() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count());
}

}  // namespace emu
}  // namespace nvrar

using nvrar::emu::ctx;
using nvrar::emu::die;
using nvrar::emu::g_wire_record;
using nvrar::emu::wire_log;
using nvrar::emu::WireKind;

void* nvshmem_ptr(const void* dest, int pe) {
  auto& c = ctx();
  // From host code (a thread bound by bind_host_thread): NULL for an address outside the symmetric
  // heap, as NVSHMEM's host nvshmem_ptr answers; device code's addresses must lie inside it.
  if (c.block == nullptr && !c.world->inside(dest, c.pe)) return nullptr;
  char* p = c.world->translate(dest, 0, c.pe, pe, "nvshmem_ptr");
  return c.world->reachable(c.pe, pe) ? p : nullptr;
}

namespace {

// The block's threads copy bytes to a load/store reachable PE: 8-byte words single-copy atomic.
void block_copy(char* to, const char* from, size_t bytes) {
  const size_t words = (reinterpret_cast<uintptr_t>(to) | reinterpret_cast<uintptr_t>(from)) % 8 == 0 ? bytes / 8 : 0;
  for (size_t i = threadIdx.x; i < words; i += blockDim.x) {
    uint64_t w;
    std::memcpy(&w, from + 8 * i, 8);
    std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(to + 8 * i)).store(w, std::memory_order_relaxed);
  }
  for (size_t i = words * 8 + threadIdx.x; i < bytes; i += blockDim.x)
    std::atomic_ref<char>(to[i]).store(from[i], std::memory_order_relaxed);
}

void put_block(void* dest, const void* source, size_t bytes, uint64_t* sig_addr, uint64_t signal, int pe,
               const char* what) {
  auto& c = ctx();
  char* to = c.world->translate(dest, bytes, c.pe, pe, what);
  uint64_t* sig = sig_addr != nullptr
                      ? reinterpret_cast<uint64_t*>(c.world->translate(sig_addr, 8, c.pe, pe, what))
                      : nullptr;
  if (g_wire_record && threadIdx.x == 0)
    wire_log(sig != nullptr ? WireKind::kPutSignal : WireKind::kPut, pe, dest, bytes, sig_addr);
  __syncthreads();  // the source is complete
  if (c.world->reachable(c.pe, pe)) {
    block_copy(to, static_cast<const char*>(source), bytes);
    __syncthreads();
    if (threadIdx.x == 0 && sig != nullptr) {
      std::atomic_thread_fence(std::memory_order_seq_cst);
      std::atomic_ref<uint64_t>(*sig).store(signal, std::memory_order_release);
    }
  } else if (threadIdx.x == 0) {
    c.world->enqueue(c.pe, pe, to, source, bytes, sig, signal);
  }
  __syncthreads();
}

}  // namespace

void nvshmemx_putmem_signal_nbi_block(void* dest, const void* source, size_t bytes, uint64_t* sig_addr,
                                      uint64_t signal, int sig_op, int pe) {
  if (sig_op != NVSHMEM_SIGNAL_SET) die("only NVSHMEM_SIGNAL_SET is emulated");
  put_block(dest, source, bytes, sig_addr, signal, pe, "nvshmemx_putmem_signal_nbi_block");
}

void nvshmemx_putmem_nbi_block(void* dest, const void* source, size_t bytes, int pe) {
  put_block(dest, source, bytes, nullptr, 0, pe, "nvshmemx_putmem_nbi_block");
}

void nvshmemx_signal_op(uint64_t* sig_addr, uint64_t signal, int sig_op, int pe) {
  if (sig_op != NVSHMEM_SIGNAL_SET) die("only NVSHMEM_SIGNAL_SET is emulated");
  auto& c = ctx();
  uint64_t* sig = reinterpret_cast<uint64_t*>(c.world->translate(sig_addr, 8, c.pe, pe, "nvshmemx_signal_op"));
  if (g_wire_record) wire_log(WireKind::kSignalOp, pe, sig_addr, 8);
  if (c.world->reachable(c.pe, pe))
    std::atomic_ref<uint64_t>(*sig).store(signal, std::memory_order_release);
  else
    c.world->enqueue(c.pe, pe, nullptr, nullptr, 0, sig, signal);
}

// IBGDA's fence is a quiet (ibgda_device.cuh): it returns once the issuing PE's earlier operations
// were delivered, with no deadline. (The proxy's ordering across a fence, its generation, stays.)
void nvshmem_fence() {
  auto& c = ctx();
  if (g_wire_record) wire_log(WireKind::kFence, -1, nullptr, 0);
  std::unique_lock<std::mutex> lock(c.world->mu);
  ++c.world->fence_gen[static_cast<size_t>(c.pe)];
  c.world->cv.notify_all();
  while (c.world->pending_from(c.pe)) c.world->cv.wait_for(lock, std::chrono::microseconds(100));
}

void nvshmem_uint64_wait_until(uint64_t* ivar, int cmp, uint64_t cmp_value) {
  if (cmp != NVSHMEM_CMP_GE) die("only NVSHMEM_CMP_GE is emulated");
  auto& c = ctx();
  if (g_wire_record) wire_log(WireKind::kWaitUntil, c.pe, ivar, 8);
  const uint64_t start = nvrar::emu::now_ns();
  const uint64_t limit = static_cast<uint64_t>(c.world->cfg.barrier_timeout_s * 1e9);
  // The consistency point (proxy-consistency mode): every write delivered to this PE so far
  // becomes visible, the wait's own word included.
  auto point = [&] {
    if (c.world->cfg.consistency_delay_us <= 0) return;
    std::lock_guard<std::mutex> lock(c.world->mu);
    c.world->reveal(c.pe, true);
    ++c.world->consistency_points;
  };
  point();
  while (std::atomic_ref<uint64_t>(*ivar).load(std::memory_order_acquire) < cmp_value) {
    if (nvrar::emu::now_ns() - start > limit) die("nvshmem_uint64_wait_until: the value never came");
    std::this_thread::sleep_for(std::chrono::microseconds(50));
    point();
  }
}
