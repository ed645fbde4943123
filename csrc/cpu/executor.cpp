#include "executor.h"

#include <sched.h>
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
  uint64_t aux;
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
  rng_ = (cfg_.jitter_seed ^ (0x9e3779b97f4a7c15ull * static_cast<uint64_t>(cfg_.rank + 1))) | 1u;
  long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) ncpu = CPU_COUNT(&set);
  // More ranks than cores: yield almost at once so that the rank we wait for can run.
  spin_iters_ = cfg_.world > ncpu ? 16 : 4096;
  srcs_.resize(static_cast<size_t>(cfg_.ranks_per_node));
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
  }
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

  // Zero-copy: an input that lives in my pool is read by the peers where it is.
  const char* pin = static_cast<const char*>(in);
  const char* pool = pool_base();
  const bool in_pool = pin >= pool && pin + count * es <= pool + layout_.pool_bytes;

  char* pout = static_cast<char*>(out);
  for (size_t off = 0; off < count; off += chunk) {
    const size_t n = std::min(chunk, count - off);
    round(pin + off * es, pout + off * es, n, es, in_pool ? pin + off * es : nullptr, v, sig, fn, sc);
  }
}

void CpuExecutor::round(const char* in, char* out, size_t n, size_t es, const char* in_pool, Variant v,
                        uint32_t sig, ReduceFn fn, Scale sc) {
  const uint64_t e = ++epoch_;
  if (v == Variant::kOneShot)
    round_one_shot(in, out, n, es, e, sig, fn, sc);
  else
    round_two_shot(in, out, n, es, in_pool, e, sig, fn, sc);
}

// Two-shot round; see NOTE [epoch protocol] in protocol/plan.h.
void CpuExecutor::round_two_shot(const char* in, char* out, size_t n, size_t es, const char* in_pool, uint64_t e,
                                 uint32_t sig, ReduceFn fn, Scale sc) {
  const int p = static_cast<int>(e & 1);
  const uint64_t word = flag_word(e, sig);
  const int G = where_.G;
  const int me = where_.local;
  char* my = heap_.mine();
  const Range mine = shard_range(n, static_cast<int>(es), G, me);

  // Stage-in. Local peer h reads only shard h of my input; shard `me` is read by me alone, so it
  // stays where it is. A zero-copy input is read in place.
  size_t data_off;
  if (in_pool != nullptr) {
    data_off = static_cast<size_t>(in_pool - my);
  } else {
    data_off = layout_.staging(p);
    if (G > 1) {
      std::memcpy(my + data_off, in, mine.begin * es);
      std::memcpy(my + data_off + mine.end * es, in + mine.end * es, (n - mine.end) * es);
    }
  }
  if (G > 1) jitter();
  for (int h = 0; h < G; ++h)
    if (h != me) signal(where_.rank_of(where_.node, h), layout_.ready_cell(p, me), word, data_off);

  // Intra-node reduce-scatter of shard `me`, sources in local-rank order.
  for (int h = 0; h < G; ++h) {
    if (h == me) {
      srcs_[static_cast<size_t>(h)] = in + mine.begin * es;
    } else {
      const int peer = where_.rank_of(where_.node, h);
      const uint64_t off = wait(layout_.ready_cell(p, h), e, sig, Site{Phase::kReduceScatter, 0, peer});
      srcs_[static_cast<size_t>(h)] = heap_.base(peer) + off + mine.begin * es;
    }
  }
  const Scale none = make_scale(RedOp::kSum, 1);
  fn(my + layout_.result(p), reinterpret_cast<const void* const*>(srcs_.data()), G, mine.size(),
     where_.N == 1 ? sc : none);

  // Inter-node recursive doubling of shard `me`.
  const size_t final_off = where_.N > 1 ? inter_node(mine.size(), es, e, sig, fn, sc) : layout_.result(p);

  // All-gather: publish my final shard, then collect every shard into the output.
  for (int h = 0; h < G; ++h)
    if (h != me) signal(where_.rank_of(where_.node, h), layout_.final_cell(p, me), word, final_off);
  std::memcpy(out + mine.begin * es, my + final_off, mine.size() * es);
  for (int h = 0; h < G; ++h) {
    if (h == me) continue;
    const int peer = where_.rank_of(where_.node, h);
    const uint64_t off = wait(layout_.final_cell(p, h), e, sig, Site{Phase::kAllGather, 0, peer});
    const Range rh = shard_range(n, static_cast<int>(es), G, h);
    std::memcpy(out + rh.begin * es, heap_.base(peer) + off, rh.size() * es);
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
      const uint64_t off = wait(layout_.ready_cell(p, h), e, sig, Site{Phase::kOneShot, 0, peer});
      srcs_[static_cast<size_t>(h)] = heap_.base(peer) + off;
    }
  }
  if (where_.N == 1) {
    fn(out, reinterpret_cast<const void* const*>(srcs_.data()), G, n, sc);
    return;
  }
  fn(my + layout_.result(p), reinterpret_cast<const void* const*>(srcs_.data()), G, n, make_scale(RedOp::kSum, 1));
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
        fn(dst, ops, 2, n, st.slot == last_exchange ? sc : none);
      }
      loc = st.slot;
    }
  }
  return layout_.acc_location(p, loc);
}

void CpuExecutor::signal(int peer, size_t cell_off, uint64_t word, uint64_t aux) {
  auto* c = reinterpret_cast<Cell*>(heap_.base(peer) + cell_off);
  store_relaxed(&c->aux, aux);
  store_release(&c->word, word);
  jitter();
}

uint64_t CpuExecutor::wait(size_t cell_off, uint64_t epoch, uint32_t sig, const Site& site) {
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
  return load_relaxed(&c->aux);
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
    store_relaxed(&c->aux, static_cast<uint64_t>(cfg_.rank) | (static_cast<uint64_t>(kind) << 32));
    store_release(&c->word, flag_word(epoch, 1));
  }
  throw ProtocolError(kind, msg, cfg_.rank, site.peer, site.phase, site.step, epoch, observed);
}

void CpuExecutor::fail_from_abort(const Site& site, uint64_t epoch) {
  auto* c = reinterpret_cast<Cell*>(heap_.mine() + layout_.abort_cell());
  const uint64_t aux = load_relaxed(&c->aux);
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
  throw ProtocolError(kind, failure_, cfg_.rank, site.peer, site.phase, site.step, epoch, 0);
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
