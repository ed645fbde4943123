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
                       c.max_bytes, c.oneshot_max_bytes, L.total_bytes, L.pool_bytes, L.zone_bytes};
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
  NVRAR_CHECK(c.timeout_s > 0, "timeout must be positive, got ", c.timeout_s);
  c.max_bytes = c.max_bytes / 64 * 64;  // chunk starts keep 64-byte alignment
  c.cma_piece_bytes = std::max<size_t>(c.cma_piece_bytes / 64 * 64, 4096);
  return c;
}

SegmentLayout make_layout(const CpuConfig& c) {
  return SegmentLayout::make(c.ranks_per_node, c.world / c.ranks_per_node, c.max_bytes, c.oneshot_max_bytes,
                             c.pool_bytes, kCellStride);
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
  srcs_.resize(static_cast<size_t>(cfg_.ranks_per_node));
  dsts_.resize(static_cast<size_t>(cfg_.ranks_per_node) + 1);
  piece_dsts_.resize(dsts_.size());
  piece_srcs_.resize(srcs_.size());
  src_remote_.resize(srcs_.size());
  peer_out_.resize(static_cast<size_t>(cfg_.ranks_per_node));
  peer_pid_.resize(static_cast<size_t>(cfg_.world));
}

void CpuExecutor::enable_cma(bool on) {
  cma_ = on && cfg_.cma;
  // Room for the shards of all other local ranks (pages are taken on first touch).
  if (cma_) cma_scratch_.resize(static_cast<size_t>(cfg_.ranks_per_node - 1) * (cfg_.cma_piece_bytes + 64));
}

CpuExecutor::~CpuExecutor() { close(); }

void CpuExecutor::close() { heap_.release(); }

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
    peer_pid_[static_cast<size_t>(r)] = h->pid;
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
  if (v == Variant::kOneShot && where_.N > 1) chunk_bytes = std::min(chunk_bytes, layout_.zone_bytes / 64 * 64);
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

void CpuExecutor::round(const char* in, char* out, size_t n, size_t es, bool in_pool, bool out_pool, Variant v,
                        uint32_t sig, ReduceFn fn, Scale sc) {
  const uint64_t e = ++epoch_;
  if (v == Variant::kOneShot)
    round_one_shot(in, out, n, es, e, sig, fn, sc);
  else
    round_two_shot(in, out, n, es, in_pool, out_pool, e, sig, fn, sc);
}

// Two-shot round; see NOTE [epoch protocol] in protocol/plan.h.
void CpuExecutor::round_two_shot(const char* in, char* out, size_t n, size_t es, bool in_pool, bool out_pool,
                                 uint64_t e, uint32_t sig, ReduceFn fn, Scale sc) {
  const int p = static_cast<int>(e & 1);
  const uint64_t word = flag_word(e, sig);
  const int G = where_.G;
  const int me = where_.local;
  char* my = heap_.mine();
  const Range mine = shard_range(n, static_cast<int>(es), G, me);
  const size_t mine_off = mine.begin * es;
  const size_t mine_bytes = mine.size() * es;
  const Scale none = make_scale(RedOp::kSum, 1);

  // Stage-in. Local peer h reads only shard h of my input; shard `me` is read by me alone, so it
  // stays where it is. A zero-copy input is read in place; with cross-memory access enabled and a
  // shard worth a system call, the peers read my private input directly (one copy instead of two).
  const bool use_cma = cma_ && n * es / static_cast<size_t>(G) >= cfg_.cma_min_bytes;
  uint64_t in_ref;
  if (in_pool) {
    in_ref = make_ref(kRefShm, static_cast<uint64_t>(in - my));
  } else if (use_cma) {
    in_ref = make_ref(kRefCma, reinterpret_cast<uint64_t>(in));
  } else {
    const size_t staging = layout_.staging(p);
    in_ref = make_ref(kRefShm, staging);
    if (G > 1) {
      std::memcpy(my + staging, in, mine_off);
      std::memcpy(my + staging + mine.end * es, in + mine.end * es, (n - mine.end) * es);
    }
  }
  // How my peers deliver their result shards to me: straight into my output when they can reach
  // it (it is in my pool, or cross-memory writes are enabled and worth their system call).
  uint64_t out_ref = make_ref(kRefPull, 0);
  if (out_pool)
    out_ref = make_ref(kRefShm, static_cast<uint64_t>(out - my));
  else if (use_cma)
    out_ref = make_ref(kRefCma, reinterpret_cast<uint64_t>(out));
  if (ref_kind(in_ref) == kRefCma || ref_kind(out_ref) == kRefCma) exposed_epoch_ = e;
  if (G > 1) jitter();
  for (int h = 0; h < G; ++h)
    if (h != me) signal(where_.rank_of(where_.node, h), layout_.ready_cell(p, me), word, in_ref, out_ref);

  // Intra-node reduce-scatter of shard `me`, sources in local-rank order.
  bool any_pull = false;
  bool any_remote = false;
  for (int h = 0; h < G; ++h) {
    const size_t hs = static_cast<size_t>(h);
    src_remote_[hs] = 0;
    if (h == me) {
      srcs_[hs] = in + mine_off;
      continue;
    }
    const int peer = where_.rank_of(where_.node, h);
    const auto aux = wait(layout_.ready_cell(p, h), e, sig, Site{Phase::kReduceScatter, 0, peer});
    if (ref_kind(aux.first) == kRefCma) {
      src_remote_[hs] = ref_value(aux.first) + mine_off;  // read from h's private memory, below
      any_remote = true;
    } else {
      srcs_[hs] = heap_.base(peer) + ref_value(aux.first) + mine_off;
    }
    peer_out_[hs] = aux.second;
    any_pull = any_pull || ref_kind(aux.second) == kRefPull;
  }
  const size_t res = layout_.result(p);
  // Destinations of the reduced shard. One node: my output, the outputs of the peers that take
  // pushes into their pool, and my result slot for the peers that pull. Several nodes: the result
  // slot, where the inter-node phase starts.
  int nd = 0;
  bool any_cma_push = false;
  if (where_.N == 1) {
    dsts_[nd++] = out + mine_off;
    for (int h = 0; h < G; ++h) {
      const uint64_t ref = peer_out_[static_cast<size_t>(h)];
      if (h == me) continue;
      if (ref_kind(ref) == kRefShm) dsts_[nd++] = heap_.base(where_.rank_of(where_.node, h)) + ref_value(ref) + mine_off;
      any_cma_push = any_cma_push || ref_kind(ref) == kRefCma;
    }
    if (any_pull) dsts_[nd++] = my + res;
  } else {
    dsts_[nd++] = my + res;
  }
  // Piece by piece when cross-memory transfers are involved, so that each piece is fetched,
  // reduced and pushed while it is in cache; else in one go.
  const size_t piece = (any_remote || any_cma_push) ? cfg_.cma_piece_bytes : mine_bytes;
  if (nd > 1 || any_cma_push) jitter();
  for (size_t off = 0; off < mine_bytes; off += piece) {
    const size_t len = std::min(piece, mine_bytes - off);
    char* scratch = cma_scratch_.data();
    for (int h = 0; h < G; ++h) {
      const size_t hs = static_cast<size_t>(h);
      if (src_remote_[hs] != 0) {
        const int peer = where_.rank_of(where_.node, h);
        cma_read(peer, scratch, src_remote_[hs] + off, len, Site{Phase::kReduceScatter, 0, peer}, e);
        piece_srcs_[hs] = scratch;
        scratch += align_up(len, 64);
      } else {
        piece_srcs_[hs] = srcs_[hs] + off;
      }
    }
    for (int d = 0; d < nd; ++d) piece_dsts_[static_cast<size_t>(d)] = dsts_[static_cast<size_t>(d)] + off;
    fn(reinterpret_cast<void* const*>(piece_dsts_.data()), nd, reinterpret_cast<const void* const*>(piece_srcs_.data()),
       G, len / es, where_.N == 1 ? sc : none);
    if (!any_cma_push) continue;
    for (int h = 0; h < G; ++h) {
      const uint64_t ref = peer_out_[static_cast<size_t>(h)];
      if (h == me || ref_kind(ref) != kRefCma) continue;
      const int peer = where_.rank_of(where_.node, h);
      cma_write(peer, out + mine_off + off, ref_value(ref) + mine_off + off, len, Site{Phase::kAllGather, 0, peer}, e);
    }
  }
  size_t final_off = res;
  if (where_.N > 1) {
    // Inter-node recursive doubling of shard `me`, then deliver the final shard.
    final_off = inter_node(mine.size(), es, e, sig, fn, sc);
    const char* fin = my + final_off;
    std::memcpy(out + mine_off, fin, mine_bytes);
    for (int h = 0; h < G; ++h) {
      const uint64_t ref = peer_out_[static_cast<size_t>(h)];
      if (h == me || ref_kind(ref) == kRefPull) continue;
      const int peer = where_.rank_of(where_.node, h);
      jitter();
      if (ref_kind(ref) == kRefShm)
        std::memcpy(heap_.base(peer) + ref_value(ref) + mine_off, fin, mine_bytes);
      else
        cma_write(peer, fin, ref_value(ref) + mine_off, mine_bytes, Site{Phase::kAllGather, 0, peer}, e);
    }
  }

  // All-gather: my shard is delivered (or ready to pull); collect what was not pushed to me.
  for (int h = 0; h < G; ++h)
    if (h != me) signal(where_.rank_of(where_.node, h), layout_.final_cell(p, me), word, final_off);
  for (int h = 0; h < G; ++h) {
    if (h == me) continue;
    const int peer = where_.rank_of(where_.node, h);
    const auto aux = wait(layout_.final_cell(p, h), e, sig, Site{Phase::kAllGather, 0, peer});
    if (ref_kind(out_ref) == kRefPull) {
      const Range rh = shard_range(n, static_cast<int>(es), G, h);
      std::memcpy(out + rh.begin * es, heap_.base(peer) + aux.first, rh.size() * es);
    }
  }
}

// One-shot round: every rank reduces the whole chunk from all local peers (no all-gather).
void CpuExecutor::round_one_shot(const char* in, char* out, size_t n, size_t es, uint64_t e, uint32_t sig,
                                 ReduceFn fn, Scale sc) {
  const int p = static_cast<int>(e & 1);
  const uint64_t word = flag_word(e, sig);
  const int G = where_.G;
  const int me = where_.local;
  char* my = heap_.mine();

  // Always staged (even a zero-copy input): without an all-gather, nothing tells me when my peers
  // are done reading, so the buffer they read must be a parity slot (NOTE [epoch protocol]).
  if (G > 1) {
    std::memcpy(my + layout_.staging(p), in, n * es);
    jitter();
    for (int h = 0; h < G; ++h)
      if (h != me) signal(where_.rank_of(where_.node, h), layout_.ready_cell(p, me), word, layout_.staging(p));
  }
  for (int h = 0; h < G; ++h) {
    if (h == me) {
      srcs_[static_cast<size_t>(h)] = in;
    } else {
      const int peer = where_.rank_of(where_.node, h);
      const auto aux = wait(layout_.ready_cell(p, h), e, sig, Site{Phase::kOneShot, 0, peer});
      srcs_[static_cast<size_t>(h)] = heap_.base(peer) + aux.first;
    }
  }
  const void* const* srcs = reinterpret_cast<const void* const*>(srcs_.data());
  if (where_.N == 1) {
    void* const dst[1] = {out};
    fn(dst, 1, srcs, G, n, sc);
    return;
  }
  void* const dst[1] = {my + layout_.result(p)};
  fn(dst, 1, srcs, G, n, make_scale(RedOp::kSum, 1));
  const size_t final_off = inter_node(n, es, e, sig, fn, sc);
  std::memcpy(out, my + final_off, n * es);
}

size_t CpuExecutor::inter_node(size_t n, size_t es, uint64_t e, uint32_t sig, ReduceFn fn, Scale sc) {
  const int p = static_cast<int>(e & 1);
  const uint64_t word = flag_word(e, sig);
  const InterSchedule sched = InterSchedule::make(where_.N, where_.node);
  const Scale none = make_scale(RedOp::kSum, 1);
  const int last_exchange = sched.exchange_slot(sched.K - 1);
  char* my = heap_.mine();
  int loc = -1;  // accumulator: result slot
  for (int i = 0; i < sched.num_steps(); ++i) {
    const InterStep st = sched.step(i);
    const int peer = where_.rank_of(st.partner, where_.local);
    if (st.send) {
      jitter();
      std::memcpy(heap_.base(peer) + layout_.zone(p, st.slot), my + layout_.acc_location(p, loc), n * es);
      signal(peer, layout_.inter_cell(p, st.slot), word, 0);
    }
    if (st.recv) {
      wait(layout_.inter_cell(p, st.slot), e, sig, Site{Phase::kInterNode, i, peer});
      char* dst = my + layout_.zone(p, st.slot);
      if (st.combine) {
        const void* ops[2];
        const char* acc = my + layout_.acc_location(p, loc);
        ops[0] = st.mine_first ? acc : dst;
        ops[1] = st.mine_first ? dst : acc;
        void* const dsts[1] = {dst};
        fn(dsts, 1, ops, 2, n, st.slot == last_exchange ? sc : none);
      }
      loc = st.slot;
    }
  }
  return layout_.acc_location(p, loc);
}

void CpuExecutor::signal(int peer, size_t cell_off, uint64_t word, uint64_t aux0, uint64_t aux1) {
  auto* c = reinterpret_cast<Cell*>(heap_.base(peer) + cell_off);
  store_relaxed(&c->aux0, aux0);
  store_relaxed(&c->aux1, aux1);
  store_release(&c->word, word);
  jitter();
}

void CpuExecutor::cma_write(int peer, const void* local, uint64_t remote, size_t bytes, const Site& site,
                            uint64_t epoch) {
  cma_transfer(true, peer, const_cast<void*>(local), remote, bytes, site, epoch);
}

void CpuExecutor::cma_read(int peer, void* local, uint64_t remote, size_t bytes, const Site& site, uint64_t epoch) {
  cma_transfer(false, peer, local, remote, bytes, site, epoch);
}

// One cross-memory copy between my memory and a peer's private memory (process_vm_readv/writev),
// resumed after partial transfers.
void CpuExecutor::cma_transfer(bool write, int peer, void* local, uint64_t remote, size_t bytes, const Site& site,
                               uint64_t epoch) {
  const pid_t pid = static_cast<pid_t>(peer_pid_[static_cast<size_t>(peer)]);
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

std::pair<uint64_t, uint64_t> CpuExecutor::wait(size_t cell_off, uint64_t epoch, uint32_t sig, const Site& site) {
  auto* c = reinterpret_cast<Cell*>(heap_.mine() + cell_off);
  const uint64_t target = flag_word(epoch, 0);
  uint64_t w = load_acquire(&c->word);
  if (w < target) {
    auto* abort_cell = reinterpret_cast<Cell*>(heap_.mine() + layout_.abort_cell());
    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    const auto deadline = start + std::chrono::duration_cast<clock::duration>(
                                      std::chrono::duration<double>(cfg_.timeout_s));
    auto next_liveness = start + kLivenessPeriod;
    for (uint64_t it = 0;; ++it) {
      w = load_acquire(&c->word);
      if (w >= target) break;
      if (load_acquire(&abort_cell->word) != 0) fail_from_abort(site, epoch);
      if (it < spin_iters_) {
        cpu_relax();
        continue;
      }
      const auto now = clock::now();
      if (now >= deadline) {
        std::ostringstream os;
        os << "timed out after " << cfg_.timeout_s << " s";
        fail(ProtocolError::Kind::kTimeout, os.str(), site, epoch, flag_epoch(w));
      }
      if (now >= next_liveness) {
        if (!peer_alive(site.peer)) fail(ProtocolError::Kind::kTimeout, "peer process exited", site, epoch, flag_epoch(w));
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
  if (flag_epoch(w) != epoch)
    fail(ProtocolError::Kind::kViolation, "protocol violation: a flag arrived from a later round", site, epoch,
         flag_epoch(w));
  if (flag_sig(w) != sig) {
    std::ostringstream os;
    os << "call mismatch: rank " << cfg_.rank << " called " << describe_call(cfg_.rank) << " but rank " << site.peer
       << " called " << describe_call(site.peer);
    fail(ProtocolError::Kind::kMismatch, os.str(), site, epoch, flag_epoch(w));
  }
  return {load_relaxed(&c->aux0), load_relaxed(&c->aux1)};
}

std::string CpuExecutor::describe_call(int rank) const {
  const auto* h = reinterpret_cast<const SegmentHeader*>(heap_.base(rank));
  std::ostringstream os;
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
    auto next_liveness = clock::now();
    while (flag_epoch(load_acquire(&c->word)) < epoch && load_acquire(&ph->failed_epoch) < epoch) {
      const auto now = clock::now();
      if (now >= deadline) break;
      if (now >= next_liveness) {
        if (!peer_alive(peer)) break;
        next_liveness = now + kLivenessPeriod;
      }
      sched_yield();
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
    struct timespec ts = {0, static_cast<long>(us * 1000)};
    nanosleep(&ts, nullptr);
  }
}

}  // namespace nvrar
