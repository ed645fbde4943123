#include "executor.h"

#include <sched.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

namespace nvrar {

namespace {

constexpr uint64_t kMagic = 0x314741455352564eull;  // "NVRSEAG1", little-endian
constexpr uint32_t kVersion = 1;
constexpr size_t kCellStride = 64;                   // one cache line per flag cell
constexpr size_t kMinChunkBytes = 256;               // smallest max_bytes accepted (bytes)
constexpr auto kLivenessPeriod = std::chrono::milliseconds(50);  // how often a waiter checks its peer's process
constexpr auto kYieldPhase = std::chrono::milliseconds(10);      // after this long, a waiter sleeps between polls
constexpr long kSleepNs = 100 * 1000;                            // sleep between polls after kYieldPhase (ns)
constexpr double kQuiesceMaxS = 5.0;  // longest a failing rank waits for peers to stop touching its buffers (s)
constexpr double kMaxTimeoutS = 1e6;  // longest deadline accepted (a nanosecond clock overflows past ~292 years)

// Host-side header at the start of every segment (page 0). Written by its owner at creation;
// the call fields are rewritten (relaxed) at the start of every call, before its first flag.
struct SegmentHeader {
  uint64_t magic;
  uint32_t version;
  int32_t rank;
  int32_t world;
  int32_t ranks_per_node;
  uint64_t config_hash;
  int64_t pid;
  uint64_t start_time;  // /proc/<pid>/stat field 22: tells a live peer from a reused pid
  uint64_t self_base;   // where the owner maps this segment (target of the cross-memory probe)
  uint64_t failed_epoch;  // != 0: the owner failed in this round and no longer touches any peer's memory
  uint64_t call_epoch;
  uint64_t call_count;
  int32_t call_dtype;
  int32_t call_op;
  int32_t call_variant;
  int32_t pad;
  char error_text[2048];  // the message of this rank's failure, for the ranks it aborts
  uint64_t call_h;        // fused call (call_op == kFusedOpCode): row length and eps bits
  uint32_t call_eps_bits;
};
static_assert(sizeof(SegmentHeader) <= SegmentLayout::kPage, "segment header must fit in the header page");

struct Cell {
  uint64_t word;
  uint64_t aux0;  // ready: byte offset of the sender's input; final: offset of its final shard
  uint64_t aux1;  // ready: OutRef of the sender's output (protocol/plan.h)
};

inline uint64_t load_acquire(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline uint64_t load_relaxed(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
inline void store_release(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
inline void store_relaxed(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Field 22 (start time) and field 3 (state) of /proc/<pid>/stat; {0, 0} if unreadable.
std::pair<uint64_t, char> proc_stat(int64_t pid) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  std::ifstream f(path);
  std::string s;
  if (!f || !std::getline(f, s)) return {0, 0};
  size_t rp = s.rfind(')');
  if (rp == std::string::npos) return {0, 0};
  std::istringstream is(s.substr(rp + 2));
  std::string tok;
  char state = 0;
  uint64_t start = 0;
  for (int field = 3; field <= 22 && (is >> tok); ++field) {
    if (field == 3) state = tok.empty() ? 0 : tok[0];
    if (field == 22) start = std::strtoull(tok.c_str(), nullptr, 10);
  }
  return {start, state};
}

uint64_t config_hash(const CpuConfig& c, const SegmentLayout& L) {
  uint64_t fields[] = {kVersion, static_cast<uint64_t>(c.world), static_cast<uint64_t>(c.ranks_per_node),
                       c.max_bytes, c.oneshot_max_bytes, L.total_bytes, L.pool_bytes, L.zone_bytes, c.ll_max_bytes};
  uint64_t h = 1469598103934665603ull;
  for (uint64_t v : fields) {
    h ^= v;
    h *= 1099511628211ull;
  }
  return h;
}

CpuConfig checked(CpuConfig c) {
  NVRAR_CHECK(c.world >= 1, "world size must be >= 1, got ", c.world);
  NVRAR_CHECK(c.rank >= 0 && c.rank < c.world, "rank ", c.rank, " out of range for world size ", c.world);
  NVRAR_CHECK(c.ranks_per_node >= 1 && c.world % c.ranks_per_node == 0, "ranks_per_node=", c.ranks_per_node,
              " must divide the world size ", c.world);
  NVRAR_CHECK(c.max_bytes >= kMinChunkBytes, "max_bytes must be at least ", kMinChunkBytes, ", got ", c.max_bytes);
  NVRAR_CHECK(c.timeout_s > 0 && c.timeout_s <= kMaxTimeoutS, "timeout must be in (0, ", kMaxTimeoutS, "] s, got ",
              c.timeout_s);
  c.max_bytes = c.max_bytes / 64 * 64;  // chunk starts keep 64-byte alignment
  c.cma_piece_bytes = std::max<size_t>(c.cma_piece_bytes / 64 * 64, 4096);
  return c;
}

SegmentLayout make_layout(const CpuConfig& c) {
  return SegmentLayout::make(c.ranks_per_node, c.world / c.ranks_per_node, c.max_bytes, c.oneshot_max_bytes,
                             c.pool_bytes, kCellStride, 1, c.world > c.ranks_per_node ? c.ll_max_bytes : 0);
}

}  // namespace

CpuExecutor::CpuExecutor(const CpuConfig& cfg)
    : cfg_(checked(cfg)),
      where_(Layout::make(cfg_.world, cfg_.ranks_per_node, cfg_.rank)),
      layout_(make_layout(cfg_)),
      heap_(cfg_.rank, cfg_.world, layout_.total_bytes),
      peer_start_times_(static_cast<size_t>(cfg_.world), 0) {
  auto* h = reinterpret_cast<SegmentHeader*>(heap_.mine());
  h->magic = kMagic;
  h->version = kVersion;
  h->rank = cfg_.rank;
  h->world = cfg_.world;
  h->ranks_per_node = cfg_.ranks_per_node;
  h->config_hash = config_hash(cfg_, layout_);
  h->pid = static_cast<int64_t>(getpid());
  h->start_time = proc_stat(h->pid).first;
  h->self_base = reinterpret_cast<uint64_t>(heap_.mine());
  rng_ = (cfg_.jitter_seed ^ (0x9e3779b97f4a7c15ull * static_cast<uint64_t>(cfg_.rank + 1))) | 1u;
  long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) ncpu = CPU_COUNT(&set);
  // More ranks than cores: yield almost at once so that the rank we wait for can run.
  spin_iters_ = cfg_.world > ncpu ? 16 : 4096;
  const size_t G = static_cast<size_t>(cfg_.ranks_per_node);
  srcs_.resize(G);
  piece_srcs_.resize(G);
  dsts_.resize(G + 1);
  piece_dsts_.resize(G + 1);
  src_remote_.resize(G);
  peer_out_.resize(G);
  ws_ = Workspace{srcs_.data(), piece_srcs_.data(), dsts_.data(), piece_dsts_.data(), peer_out_.data(),
                  src_remote_.data(), nullptr};
  round_cfg_ = RoundConfig{where_, layout_, false, cfg_.cma_min_bytes, cfg_.cma_piece_bytes, cfg_.ll_max_bytes};
}

void CpuExecutor::enable_cma(bool on) {
  round_cfg_.cma = on && cfg_.cma;
  // Room for one piece of every other local rank's shard (pages are taken on first touch).
  if (round_cfg_.cma) cma_scratch_.resize(static_cast<size_t>(cfg_.ranks_per_node - 1) * (cfg_.cma_piece_bytes + 64));
  ws_.scratch = cma_scratch_.data();
}

CpuExecutor::~CpuExecutor() { close(); }

// Safe against a call in flight on another thread: it is told to stop (it raises), and the
// memory goes only once it has left.
void CpuExecutor::close() {
  closing_.store(true, std::memory_order_release);
  std::lock_guard<std::mutex> lock(busy_);
  heap_.release();
}

void CpuExecutor::attach(const std::vector<std::string>& names) {
  heap_.attach(names);
  const auto* mine = reinterpret_cast<const SegmentHeader*>(heap_.mine());
  for (int r = 0; r < cfg_.world; ++r) {
    const auto* h = reinterpret_cast<const SegmentHeader*>(heap_.base(r));
    NVRAR_CHECK(h->magic == kMagic && h->version == kVersion, "rank ", cfg_.rank, ": rank ", r,
                "'s segment is not an nvrar segment of version ", kVersion);
    NVRAR_CHECK(h->rank == r && h->world == cfg_.world, "rank ", cfg_.rank, ": segment ", r, " belongs to rank ",
                h->rank, " of ", h->world, " (bootstrap exchanged names out of order)");
    NVRAR_CHECK(h->config_hash == mine->config_hash, "rank ", cfg_.rank, ": rank ", r,
                " was created with a different configuration (ranks_per_node ", h->ranks_per_node, " vs ",
                cfg_.ranks_per_node, ", or max_bytes / heap size / one-shot threshold differ); every rank must "
                "use the same settings");
    if (r != cfg_.rank && h->start_time != 0 && proc_stat(h->pid).first == h->start_time)
      peer_start_times_[static_cast<size_t>(r)] = h->start_time;
  }
}

bool CpuExecutor::probe_cma() const {
  if (!cfg_.cma) return false;
  for (int r = 0; r < cfg_.world; ++r) {
    if (r == cfg_.rank) continue;
    const auto* h = reinterpret_cast<const SegmentHeader*>(heap_.base(r));
    uint64_t magic = 0;
    struct iovec local = {&magic, sizeof(magic)};
    struct iovec remote = {reinterpret_cast<void*>(h->self_base), sizeof(magic)};
    if (process_vm_readv(static_cast<pid_t>(h->pid), &local, 1, &remote, 1, 0) != sizeof(magic) || magic != kMagic)
      return false;  // not permitted (ptrace policy), or the pid is not that process (other pid namespace)
  }
  return true;
}

Variant CpuExecutor::resolve(Variant v, size_t bytes) const {
  if (v != Variant::kAuto) return v;
  return bytes <= cfg_.oneshot_max_bytes ? Variant::kOneShot : Variant::kTwoShot;
}

void CpuExecutor::all_reduce(const void* in, void* out, size_t count, DType dtype, RedOp op, Variant variant) {
  NVRAR_CHECK(!closing_.load(std::memory_order_acquire), "all_reduce: the communicator is closed");
  std::unique_lock<std::mutex> lock(busy_, std::try_to_lock);
  NVRAR_CHECK(lock.owns_lock(), "all_reduce: another thread is using this communicator; calls on one "
              "communicator must be serialized");
  NVRAR_CHECK(failure_.empty(), "all_reduce: this communicator failed earlier and cannot be used again: ", failure_);
  NVRAR_CHECK(heap_.mine() != nullptr, "all_reduce: the communicator is closed");
  NVRAR_CHECK(heap_.attached() || cfg_.world == 1, "all_reduce: the communicator is not set up");
  if (count == 0) return;
  const size_t es = static_cast<size_t>(dtype_size(dtype));
  NVRAR_CHECK(count <= SIZE_MAX / es, "all_reduce: count ", count, " overflows");
  const ReduceFn fn = cpu_reduce_fn(dtype, op);
  const Scale sc = make_scale(op, cfg_.world);
  if (cfg_.world == 1) {
    if (in != out) std::memmove(out, in, count * es);
    return;
  }
  const Variant v = resolve(variant, count * es);
  NVRAR_CHECK(v == Variant::kTwoShot || v == Variant::kOneShot, "all_reduce: unknown variant code ",
              static_cast<int>(v));
  const uint32_t sig = call_signature(count, static_cast<int>(dtype), static_cast<int>(op), static_cast<int>(v));

  auto* h = reinterpret_cast<SegmentHeader*>(heap_.mine());
  h->call_epoch = epoch_ + 1;
  h->call_count = count;
  h->call_dtype = static_cast<int32_t>(dtype);
  h->call_op = static_cast<int32_t>(op);
  h->call_variant = static_cast<int32_t>(v);

  size_t chunk_bytes = cfg_.max_bytes;
  if (v == Variant::kOneShot && where_.N > 1) chunk_bytes = std::min(chunk_bytes, layout_.oneshot_chunk_bytes());
  const size_t chunk = chunk_bytes / es;

  // Zero-copy: an input that lives in my pool is read by the peers where it is; an output in my
  // pool is written by the peers directly.
  const char* pin = static_cast<const char*>(in);
  char* pout = static_cast<char*>(out);
  const char* pool = pool_base();
  const bool in_pool = pin >= pool && pin + count * es <= pool + layout_.pool_bytes;
  const bool out_pool = pout >= pool && pout + count * es <= pool + layout_.pool_bytes;

  for (size_t off = 0; off < count; off += chunk) {
    const size_t n = std::min(chunk, count - off);
    round(pin + off * es, pout + off * es, n, es, in_pool, out_pool, v, sig, fn, sc);
  }
}


// The CPU side of the Transport concept of protocol/round.h: a group of one, shared-memory
// loads and stores, process_vm_readv/writev for private buffers. Failures throw.
struct CpuTransport {
  CpuExecutor* ex;
  ReduceFn fn;
  uint64_t epoch;

  char* my() const { return ex->heap_.mine(); }
  char* base(int rank) const { return ex->heap_.base(rank); }
  bool leader() const { return true; }
  void sync() const {}
  void signal(int rank, size_t cell, uint64_t word, uint64_t aux0, uint64_t aux1) {
    ex->signal(rank, cell, word, aux0, aux1);
  }
  bool wait(size_t cell, uint64_t e, uint32_t sig, Phase phase, int step, int peer, uint64_t* aux0, uint64_t* aux1) {
    const auto aux = ex->wait(cell, e, sig, CpuExecutor::Site{phase, step, peer});
    *aux0 = aux.first;
    *aux1 = aux.second;
    return true;
  }
  bool put_signal(int rank, size_t dst_off, const char* src, size_t bytes, size_t cell, uint64_t word) {
    std::memcpy(base(rank) + dst_off, src, bytes);
    ex->signal(rank, cell, word, 0, 0);
    return true;
  }
  // LL packets go straight into the peer's LL zone, one 8-byte atomic store each.
  bool put_ll(int rank, size_t dst_off, size_t /*out_off*/, const char* src, size_t bytes, uint32_t flag) {
    auto* pk = reinterpret_cast<uint64_t*>(base(rank) + dst_off);
    const size_t n = ll_packets(bytes);
    for (size_t i = 0; i < n; ++i) {
      store_relaxed(&pk[i], ll_make_packet(src, bytes, i, flag));
      if ((i & 255) == 255) ex->jitter();
    }
    return true;
  }
  bool wait_ll(size_t off, size_t bytes, uint64_t e, uint32_t sig, int step, int peer) {
    ex->wait_ll(off, bytes, e, sig, CpuExecutor::Site{Phase::kInterNode, step, peer});
    return true;
  }
  void ll_unpack(char* dst, size_t off, size_t bytes) {
    auto* pk = reinterpret_cast<uint64_t*>(my() + off);
    const size_t n = ll_packets(bytes);
    for (size_t i = 0; i < n; ++i) {
      ll_store_payload(dst, bytes, i, load_relaxed(&pk[i]));
      store_relaxed(&pk[i], 0);  // NOTE [LL zones]
    }
  }
  void reduce(char* const* dst, int nd, const char* const* src, int ns, size_t n, Scale sc) const {
    fn(reinterpret_cast<void* const*>(dst), nd, reinterpret_cast<const void* const*>(src), ns, n, sc);
  }
  void copy(char* dst, const char* src, size_t bytes) const {
    if (bytes != 0 && dst != src) std::memcpy(dst, src, bytes);
  }
  bool remote_read(int rank, char* dst, uint64_t addr, size_t bytes, Phase phase) {
    ex->cma_transfer(false, rank, dst, addr, bytes, CpuExecutor::Site{phase, 0, rank}, epoch);
    return true;
  }
  bool remote_write(int rank, const char* src, uint64_t addr, size_t bytes, Phase phase) {
    ex->jitter();
    ex->cma_transfer(true, rank, const_cast<char*>(src), addr, bytes, CpuExecutor::Site{phase, 0, rank}, epoch);
    return true;
  }
  void expose(uint64_t e) { ex->exposed_epoch_ = e; }
  void jitter() { ex->jitter(); }
};

void CpuExecutor::round(const char* in, char* out, size_t n, size_t es, bool in_pool, bool out_pool, Variant v,
                        uint32_t sig, ReduceFn fn, Scale sc) {
  const uint64_t e = ++epoch_;
  CpuTransport tp{this, fn, e};
  Slice s{in, out, n, es, 0, 0, in_pool, out_pool};
  if (v == Variant::kOneShot)
    one_shot_round(tp, round_cfg_, ws_, s, e, sig, sc);
  else
    two_shot_round(tp, round_cfg_, ws_, s, e, sig, sc);
}

void CpuExecutor::fused_round(const FusedSlice& s, Variant v, uint32_t sig, ReduceFn fn, const RowEpilogue& epi,
                              char* scratch) {
  const uint64_t e = ++epoch_;
  CpuTransport tp{this, fn, e};
  if (v == Variant::kOneShot) {
    one_shot_round(tp, round_cfg_, ws_, Slice{s.in, scratch, s.rows * s.h, s.es, 0, 0, false, false}, e, sig,
                   make_scale(RedOp::kSum, 1));
    epi(s.x_out, s.res, scratch, s.res, s.rows);
  } else {
    fused_two_shot_round(tp, round_cfg_, ws_, s, e, sig, epi);
  }
}

void CpuExecutor::note_call(uint64_t count, DType dtype, int32_t op, Variant v, uint64_t h, float eps) {
  auto* hd = reinterpret_cast<SegmentHeader*>(heap_.mine());
  hd->call_epoch = epoch_ + 1;
  hd->call_count = count;
  hd->call_dtype = static_cast<int32_t>(dtype);
  hd->call_op = op;
  hd->call_variant = static_cast<int32_t>(v);
  hd->call_h = h;
  hd->call_eps_bits = float_bits(eps);
}

void CpuExecutor::signal(int peer, size_t cell_off, uint64_t word, uint64_t aux0, uint64_t aux1) {
  auto* c = reinterpret_cast<Cell*>(heap_.base(peer) + cell_off);
  store_relaxed(&c->aux0, aux0);
  store_relaxed(&c->aux1, aux1);
  store_release(&c->word, word);
  jitter();
}

// One cross-memory copy between my memory and a peer's private memory (process_vm_readv/writev),
// resumed after partial transfers.
void CpuExecutor::cma_transfer(bool write, int peer, void* local, uint64_t remote, size_t bytes, const Site& site,
                               uint64_t epoch) {
  const pid_t pid = static_cast<pid_t>(reinterpret_cast<const SegmentHeader*>(heap_.base(peer))->pid);
  auto* abort_cell = reinterpret_cast<Cell*>(heap_.mine() + layout_.abort_cell());
  size_t done = 0;
  while (done < bytes) {
    // A peer that failed may return from its call and free the memory we are about to touch:
    // stop at once (it waits for us to stop before it returns, see quiesce()).
    if (load_acquire(&abort_cell->word) != 0) fail_from_abort(site, epoch);
    struct iovec l = {static_cast<char*>(local) + done, bytes - done};
    struct iovec r = {reinterpret_cast<void*>(remote + done), bytes - done};
    const ssize_t k = write ? process_vm_writev(pid, &l, 1, &r, 1, 0) : process_vm_readv(pid, &l, 1, &r, 1, 0);
    if (k > 0) {
      done += static_cast<size_t>(k);
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    const int err = k < 0 ? errno : EIO;
    if (load_acquire(&abort_cell->word) != 0) fail_from_abort(site, epoch);
    if (err == ESRCH) fail(ProtocolError::Kind::kTimeout, "peer process exited", site, epoch, 0);
    fail(ProtocolError::Kind::kViolation,
         std::string("cross-memory ") + (write ? "write into" : "read from") + " the peer's buffer failed: " +
             std::strerror(err),
         site, epoch, 0);
  }
}

template <typename Ready, typename Observed>
void CpuExecutor::spin_until(Ready ready, Observed observed, const Site& site, uint64_t epoch) {
  if (ready()) return;
  auto* abort_cell = reinterpret_cast<Cell*>(heap_.mine() + layout_.abort_cell());
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  const auto deadline =
      start + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(cfg_.timeout_s));
  auto next_liveness = start + kLivenessPeriod;
  for (uint64_t it = 0;; ++it) {
    if (ready()) return;
    if (load_acquire(&abort_cell->word) != 0) fail_from_abort(site, epoch);
    if (closing_.load(std::memory_order_relaxed))
      fail(ProtocolError::Kind::kViolation, "the communicator was closed by another thread during the call", site,
           epoch, 0);
    if (it < spin_iters_) {
      cpu_relax();
      continue;
    }
    const auto now = clock::now();
    if (now >= deadline) {
      std::ostringstream os;
      os << "timed out after " << cfg_.timeout_s << " s";
      fail(ProtocolError::Kind::kTimeout, os.str(), site, epoch, observed());
    }
    if (now >= next_liveness) {
      if (!peer_alive(site.peer)) fail(ProtocolError::Kind::kTimeout, "peer process exited", site, epoch, observed());
      next_liveness = now + kLivenessPeriod;
    }
    if (now - start < kYieldPhase) {
      sched_yield();
    } else {
      struct timespec ts = {0, kSleepNs};
      nanosleep(&ts, nullptr);
    }
  }
}

std::pair<uint64_t, uint64_t> CpuExecutor::wait(size_t cell_off, uint64_t epoch, uint32_t sig, const Site& site) {
  auto* c = reinterpret_cast<Cell*>(heap_.mine() + cell_off);
  const uint64_t target = flag_word(epoch, 0);
  uint64_t w = 0;
  spin_until([&] { return (w = load_acquire(&c->word)) >= target; }, [&] { return flag_epoch(w); }, site, epoch);
  if (flag_epoch(w) != epoch)
    fail(ProtocolError::Kind::kViolation, "protocol violation: a flag arrived from a later round", site, epoch,
         flag_epoch(w));
  if (flag_sig(w) != sig) fail(ProtocolError::Kind::kMismatch, "call mismatch: " + mismatch(site.peer), site, epoch,
                               flag_epoch(w));
  return {load_relaxed(&c->aux0), load_relaxed(&c->aux1)};
}

void CpuExecutor::wait_ll(size_t off, size_t bytes, uint64_t epoch, uint32_t sig, const Site& site) {
  const uint32_t flag = ll_flag(epoch, sig);
  const auto* pk = reinterpret_cast<const uint64_t*>(heap_.mine() + off);
  const size_t n = ll_packets(bytes);
  // One deadline for the whole step: each poll moves on over the packets that have arrived.
  size_t i = 0;
  int state = 1;
  spin_until(
      [&] {
        while (i < n && (state = ll_packet_state(load_acquire(&pk[i]), flag)) > 0) ++i;
        return i == n || state < 0;
      },
      [&] { return static_cast<uint64_t>(ll_packet_flag(load_relaxed(&pk[i])) >> kSigBits); }, site, epoch);
  if (state < 0)
    fail(ProtocolError::Kind::kMismatch, "call mismatch (LL packet signature): " + mismatch(site.peer), site, epoch,
         epoch);
}

std::string CpuExecutor::mismatch(int peer) const {
  return "rank " + std::to_string(cfg_.rank) + " called " + describe_call(cfg_.rank) + " but rank " +
         std::to_string(peer) + " called " + describe_call(peer);
}

std::string CpuExecutor::describe_call(int rank) const {
  const auto* h = reinterpret_cast<const SegmentHeader*>(heap_.base(rank));
  std::ostringstream os;
  if (h->call_op == kFusedOpCode) {
    os << "all_reduce_add_rms_norm(count=" << h->call_count << ", h=" << h->call_h
       << ", dtype=" << dtype_name(static_cast<DType>(h->call_dtype)) << ", eps=" << bits_float(h->call_eps_bits)
       << ", variant=" << variant_name(static_cast<Variant>(h->call_variant)) << ")";
    return os.str();
  }
  os << "all_reduce(count=" << h->call_count << ", dtype=" << dtype_name(static_cast<DType>(h->call_dtype))
     << ", op=" << op_name(static_cast<RedOp>(h->call_op))
     << ", variant=" << variant_name(static_cast<Variant>(h->call_variant)) << ")";
  return os.str();
}

bool CpuExecutor::peer_alive(int peer) const {
  const uint64_t known = peer_start_times_[static_cast<size_t>(peer)];
  if (known == 0) return true;  // cannot tell (another pid namespace): the deadline decides
  const auto* h = reinterpret_cast<const SegmentHeader*>(heap_.base(peer));
  const auto st = proc_stat(h->pid);
  return st.first == known && st.second != 'Z' && st.second != 'X';
}

void CpuExecutor::fail(ProtocolError::Kind kind, const std::string& what, const Site& site, uint64_t epoch,
                       uint64_t observed) {
  std::ostringstream os;
  os << "nvrar: rank " << cfg_.rank << ": " << what << " (phase " << phase_name(site.phase) << ", step " << site.step
     << ", waiting for rank " << site.peer << ", expected epoch " << epoch << ", observed epoch " << observed
     << ")";
  const std::string msg = os.str();
  failure_ = msg;
  // Abort every peer: they raise at once instead of waiting for their own deadlines.
  auto* h = reinterpret_cast<SegmentHeader*>(heap_.mine());
  const size_t len = std::min(msg.size(), sizeof(h->error_text) - 1);
  std::memcpy(h->error_text, msg.data(), len);
  h->error_text[len] = '\0';
  for (int r = 0; r < cfg_.world; ++r) {
    if (r == cfg_.rank) continue;
    auto* c = reinterpret_cast<Cell*>(heap_.base(r) + layout_.abort_cell());
    store_relaxed(&c->aux0, static_cast<uint64_t>(cfg_.rank) | (static_cast<uint64_t>(kind) << 32));
    store_release(&c->word, flag_word(epoch, 1));
  }
  quiesce(epoch);
  throw ProtocolError(kind, msg, cfg_.rank, site.peer, site.phase, site.step, epoch, observed);
}

void CpuExecutor::fail_from_abort(const Site& site, uint64_t epoch) {
  auto* c = reinterpret_cast<Cell*>(heap_.mine() + layout_.abort_cell());
  const uint64_t aux = load_relaxed(&c->aux0);
  const int origin = static_cast<int>(aux & 0xffffffffu);
  auto kind = static_cast<ProtocolError::Kind>(aux >> 32);
  std::string text = "(no message)";
  if (origin >= 0 && origin < cfg_.world) {
    const auto* h = reinterpret_cast<const SegmentHeader*>(heap_.base(origin));
    text.assign(h->error_text, strnlen(h->error_text, sizeof(h->error_text)));
  }
  if (kind != ProtocolError::Kind::kTimeout && kind != ProtocolError::Kind::kMismatch) kind = ProtocolError::Kind::kPeerAbort;
  std::ostringstream os;
  os << "nvrar: rank " << cfg_.rank << ": aborted by rank " << origin << " (phase " << phase_name(site.phase)
     << ", step " << site.step << ", waiting for rank " << site.peer << ", epoch " << epoch << "); rank " << origin
     << " reported: " << text;
  failure_ = os.str();
  quiesce(epoch);
  throw ProtocolError(kind, failure_, cfg_.rank, site.peer, site.phase, site.step, epoch, 0);
}

// On failure, before the exception reaches the user: say that I touch no peer's memory any more,
// then, if this round exposed my private buffers to cross-memory access, wait (bounded) until
// every local peer is done with them -- it stored final(e) to me, failed itself, or exited. Else a
// peer could still write into an output the user frees or reuses after catching the error.
void CpuExecutor::quiesce(uint64_t epoch) {
  auto* mine = reinterpret_cast<SegmentHeader*>(heap_.mine());
  store_release(&mine->failed_epoch, epoch);
  if (exposed_epoch_ != epoch) return;
  const int p = static_cast<int>(epoch & 1);
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(
                                           std::chrono::duration<double>(std::min(cfg_.timeout_s, kQuiesceMaxS)));
  for (int h = 0; h < where_.G; ++h) {
    if (h == where_.local) continue;
    const int peer = where_.rank_of(where_.node, h);
    const auto* c = reinterpret_cast<const Cell*>(heap_.mine() + layout_.final_cell(p, h));
    const auto* ph = reinterpret_cast<const SegmentHeader*>(heap_.base(peer));
    const auto start = clock::now();
    auto next_liveness = start;
    while (flag_epoch(load_acquire(&c->word)) < epoch && load_acquire(&ph->failed_epoch) < epoch) {
      const auto now = clock::now();
      if (now >= deadline) break;
      if (now >= next_liveness) {
        if (!peer_alive(peer)) break;
        next_liveness = now + kLivenessPeriod;
      }
      if (now - start < kYieldPhase) {
        sched_yield();
      } else {
        struct timespec ts = {0, kSleepNs};
        nanosleep(&ts, nullptr);
      }
    }
  }
}

void CpuExecutor::jitter() {
  if (cfg_.jitter_us <= 0) return;
  rng_ ^= rng_ << 13;
  rng_ ^= rng_ >> 7;
  rng_ ^= rng_ << 17;
  if (rng_ & 1) return;  // delay half of the time
  const double us = static_cast<double>((rng_ >> 11) & 0xfffff) / static_cast<double>(0x100000) * cfg_.jitter_us;
  if (us < 20) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double, std::micro>(us);
    while (std::chrono::steady_clock::now() < until) cpu_relax();
  } else {
    const long long ns = static_cast<long long>(us * 1000);
    struct timespec ts = {static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
    nanosleep(&ts, nullptr);
  }
}

}  // namespace nvrar
