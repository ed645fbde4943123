#include "executor.h"
#include "segment.h"
#include "stream_copy.h"
#include "transport.h"
#include "ucx.h"

#include <pthread.h>
#include <sched.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

namespace nvrar {

namespace {

constexpr size_t kMinChunkBytes = 256;               // smallest max_bytes accepted (bytes)
constexpr auto kLivenessPeriod = std::chrono::milliseconds(50);  // how often a waiter checks its peer's process
constexpr auto kSpinPhase = std::chrono::microseconds(100);     // a waiter spins at most this long before yielding
constexpr uint64_t kSpinPollsOversubscribed = 16;  // more ranks than cores: polls before yielding
constexpr auto kYieldPhase = std::chrono::milliseconds(10);      // after this long, a waiter sleeps between polls
constexpr auto kSpreadEvery = std::chrono::milliseconds(50);    // NOTE [moving apart]: at most one move per this long
constexpr long kSleepNs = 100 * 1000;                            // sleep between polls after kYieldPhase (ns)
constexpr double kQuiesceMaxS = 1.0;  // longest a failing rank waits for a peer's cross-memory transfer window (s)
constexpr double kMaxTimeoutS = 1e6;  // longest deadline accepted (a nanosecond clock overflows past ~292 years)

// Bumped in every forked child (pthread_atfork, registered with the first executor): a call
// compares it with its executor's, which costs a load where getpid() costs a system call.
std::atomic<uint64_t> g_fork_gen{0};
void count_fork() { g_fork_gen.fetch_add(1, std::memory_order_relaxed); }
uint64_t fork_generation() {
  static const int registered = pthread_atfork(nullptr, nullptr, count_fork);
  NVRAR_CHECK(registered == 0, "nvrar: pthread_atfork failed (", registered, ")");
  return g_fork_gen.load(std::memory_order_relaxed);
}

uint64_t config_hash(const CpuConfig& c, const SegmentLayout& L) {
  uint64_t fields[] = {kVersion, static_cast<uint64_t>(c.world), static_cast<uint64_t>(c.ranks_per_node),
                       c.max_bytes, c.oneshot_max_bytes, L.total_bytes, L.pool_bytes, L.zone_bytes, c.ll_max_bytes,
                       c.oneshot_adapt_max_bytes};
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
  NVRAR_CHECK(c.secret.size() == kSecretBytes, "the session secret must be ", kSecretBytes, " bytes, got ",
              c.secret.size());
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
      heap_(cfg_.rank, cfg_.world, layout_.total_bytes, cfg_.test_kill_at),
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
  std::memcpy(h->secret, cfg_.secret.data(), kSecretBytes);
  rng_ = (cfg_.jitter_seed ^ (0x9e3779b97f4a7c15ull * static_cast<uint64_t>(cfg_.rank + 1))) | 1u;
  long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) ncpu = CPU_COUNT(&set);
  // More ranks than cores: yield almost at once so that the rank we wait for can run. Else spin
  // for kSpinPhase (decode calls arrive microseconds apart).
  spin_polls_ = cfg_.world > ncpu ? kSpinPollsOversubscribed : UINT64_MAX;
  born_fork_gen_ = fork_generation();
  const size_t G = static_cast<size_t>(cfg_.ranks_per_node);
  srcs_.resize(G);
  piece_srcs_.resize(G);
  dsts_.resize(G + 1);
  piece_dsts_.resize(G + 1);
  src_remote_.resize(G);
  peer_out_.resize(G);
  adv_in_.resize(G);
  adv_out_.resize(G);
  adv_bytes_.resize(G);
  ws_ = Workspace{srcs_.data(), piece_srcs_.data(), dsts_.data(), piece_dsts_.data(), peer_out_.data(),
                  src_remote_.data(), nullptr};
  // start_from_input: a put's source may be any memory of mine (a memcpy into shared memory, or
  // a UCX send that completes before the put returns).
  round_cfg_ = RoundConfig{where_, layout_, false, cfg_.cma_min_bytes, cfg_.cma_piece_bytes, cfg_.ll_max_bytes,
                           cfg_.hd_min_bytes, true, /*rotate_staging=*/true};  // NOTE [rotating stage-in]
  limits_ = CallLimits{cfg_.world, where_.N, cfg_.max_bytes, cfg_.oneshot_max_bytes, layout_.oneshot_chunk_bytes(),
                       1, 0, reinterpret_cast<uintptr_t>(pool_base()), layout_.pool_bytes};
  test_kill_point(cfg_.test_kill_at, "executor-built");
}

void CpuExecutor::enable_cma(bool on) {
  round_cfg_.cma = on && cfg_.cma;
  cma_on_ = round_cfg_.cma;
  // Room for one piece of every other local rank's shard (pages are taken on first touch).
  if (round_cfg_.cma) cma_scratch_.resize(static_cast<size_t>(cfg_.ranks_per_node - 1) * (cfg_.cma_piece_bytes + 64));
  ws_.scratch = cma_scratch_.data();
}

CpuExecutor::~CpuExecutor() { close(); }

// Safe against a call in flight on another thread: it is told to stop (it raises), and the
// memory goes only once it has left.
void CpuExecutor::close() {
  // A forked child: the segments, mappings and lock are the creator's; touch nothing.
  if (!heap_.in_creator()) return;
  mark_closed();
  std::lock_guard<std::mutex> lock(busy_);
  link_.reset();  // UCX lets go of the segment before it is unmapped
  heap_.release();
}

void CpuExecutor::mark_closed() {
  if (!heap_.in_creator()) return;  // a forked child must not mark its parent's segment closed
  closing_.store(true, std::memory_order_release);
  // Safe without the lock: the header page stays mapped until close() took it.
  if (char* mine = heap_.mine()) store_release(&reinterpret_cast<SegmentHeader*>(mine)->closed, 1);
}

std::string CpuExecutor::open_hosts(const std::string& libucp, const std::vector<int>& host_of,
                                    const std::string& net_device) {
  NVRAR_CHECK(static_cast<int>(host_of.size()) == cfg_.world, "open_hosts: ", host_of.size(), " host indices for ",
              cfg_.world, " ranks");
  NVRAR_CHECK(link_ == nullptr && !heap_.attached(), "open_hosts: called twice, or after attach");
  std::vector<bool> remote(static_cast<size_t>(cfg_.world));
  for (int r = 0; r < cfg_.world; ++r) {
    remote[static_cast<size_t>(r)] = host_of[static_cast<size_t>(r)] != host_of[static_cast<size_t>(cfg_.rank)];
    // A node lies within one host: its phases run through shared memory.
    NVRAR_CHECK(!(remote[static_cast<size_t>(r)] && r / where_.G == where_.node), "nvrar: rank ", r,
                " is in rank ", cfg_.rank, "'s node but on another host; ranks_per_node must divide the ranks of a host");
  }
  NVRAR_CHECK(cfg_.ll_max_bytes == 0, "nvrar: LL packets never cross hosts: ll_max_bytes must be 0 across hosts");
  std::string blob;
  link_ = open_ucx_link(libucp, cfg_.rank, remote, heap_.mine(), layout_.total_bytes, net_device,
                        RemoteWriteCheck{&CpuExecutor::accept_remote_write, this}, &blob);
  remote_ = remote;
  return std::string(heap_.mine(), sizeof(SegmentHeader)) + blob;
}

void CpuExecutor::connect_hosts(const std::vector<std::string>& blobs) {
  NVRAR_CHECK(link_ != nullptr, "connect_hosts: open_hosts first");
  NVRAR_CHECK(static_cast<int>(blobs.size()) == cfg_.world, "connect_hosts: ", blobs.size(), " blobs for ",
              cfg_.world, " ranks");
  std::vector<std::string> addresses(blobs.size());
  images_.assign(blobs.size(), {});
  for (int r = 0; r < cfg_.world; ++r) {
    if (!remote(r)) continue;
    const std::string& b = blobs[static_cast<size_t>(r)];
    NVRAR_CHECK(b.size() > sizeof(SegmentHeader), "nvrar: rank ", cfg_.rank, ": rank ", r,
                " sent no segment header across hosts");
    auto& img = images_[static_cast<size_t>(r)];
    img.assign(layout_.staging_off / sizeof(uint64_t) + 1, 0);  // its header and cells
    std::memcpy(img.data(), b.data(), sizeof(SegmentHeader));
    addresses[static_cast<size_t>(r)] = b.substr(sizeof(SegmentHeader));
  }
  link_->connect(addresses);
}

void CpuExecutor::start_wireup() {
  if (link_ != nullptr) link_->start_wireup();
}
std::string CpuExecutor::wait_wired(double timeout_s) {
  return link_ != nullptr ? link_->wait_wired(timeout_s) : std::string();
}
void CpuExecutor::stop_wireup() {
  if (link_ != nullptr) link_->stop_wireup();
}
void CpuExecutor::debug_forge(int rank, const std::string& what) {
  NVRAR_CHECK(link_ != nullptr && rank >= 0 && rank < cfg_.world && remote(rank), "debug_forge: rank ", rank,
              " is not on another host");
  const SegmentLayout& L = layout_;
  const size_t cell = L.inter_cell(0, 1), zone = L.zone(0, 1);
  const uint64_t word = flag_word(1, 1);
  bool ok = true;
  if (what == "outside") {  // data into the segment's header
    ok = link_->forge(rank, 0, 64, 0, cell, 64, word);
  } else if (what == "oversized") {  // more data than a zone holds
    ok = link_->forge(rank, zone, L.zone_slice_bytes + 64, 0, cell, 64, word);
  } else if (what == "beyond") {  // a piece past the end of its put
    ok = link_->forge(rank, zone, 128, 100, cell, 64, word);
  } else if (what == "abort-data") {  // data with the abort cell
    ok = link_->forge(rank, zone, 64, 0, L.abort_cell(), 64, word);
  } else if (what == "two-puts") {  // pieces of two puts (other flag words) into one cell: the second is refused
    const size_t c1 = L.inter_cell(1, 1), z1 = L.zone(1, 1);
    ok = link_->forge(rank, z1, 128, 0, c1, 64, flag_word(3, 1)) && link_->forge(rank, z1, 128, 64, c1, 64, flag_word(5, 1));
  } else {
    NVRAR_CHECK(false, "debug_forge: no message '", what, "'");
  }
  NVRAR_CHECK(ok, "debug_forge: the endpoint to rank ", rank, " failed");
}
void CpuExecutor::link_progress() {
  if (link_ != nullptr) link_->progress();
}
uint64_t CpuExecutor::link_refused() const { return link_ != nullptr ? link_->refused() : 0; }

std::pair<uint64_t, uint64_t> CpuExecutor::link_landings() const {
  return link_ != nullptr ? link_->landings() : std::pair<uint64_t, uint64_t>{0, 0};
}
std::string CpuExecutor::link_transports(int rank) {
  NVRAR_CHECK(rank >= 0 && rank < cfg_.world, "link_transports: no rank ", rank);
  return link_ != nullptr && remote(rank) ? link_->transports(rank) : std::string();
}

void CpuExecutor::post_remote_aborts() {
  if (link_ == nullptr) return;
  for (int r = 0; r < cfg_.world; ++r)
    if (remote(r)) link_->post_cell(r, layout_.abort_cell(), heap_.base(r) + layout_.abort_cell(), 0.1);
}

bool CpuExecutor::accept_remote_write(void* self, size_t dst_off, size_t bytes, size_t cell_off) {
  const auto* ex = static_cast<const CpuExecutor*>(self);
  const SegmentLayout& L = ex->layout_;
  if (cell_off == L.abort_cell()) return bytes == 0;
  // Within the zone of the cell's step (a halving-doubling put fills part of it, at its offset;
  // an all-gather step's, part of the last exchange's zone: NOTE [halving-doubling]).
  const auto within = [&](size_t zone) {
    return bytes == 0 || (dst_off >= zone && dst_off - zone <= L.zone_slice_bytes && bytes <= L.zone_slice_bytes - (dst_off - zone));
  };
  for (int p = 0; p < 2; ++p) {
    for (int slot = 0; slot < L.S; ++slot)
      if (cell_off == L.inter_cell(p, slot)) return within(L.zone(p, slot));
    for (int k = 0; k < L.S - 2; ++k)
      if (cell_off == L.gather_cell(p, k)) return within(L.zone(p, L.S - 2));
  }
  return false;
}

int CpuExecutor::inter_step_of(size_t cell) const {
  const InterSchedule sched = InterSchedule::make(where_.N, where_.node);
  for (int k = 0; k < sched.K; ++k)  // halving-doubling's all-gather steps follow the exchanges
    if (layout_.gather_cell(0, k) == cell || layout_.gather_cell(1, k) == cell)
      return (sched.has_fold_partner() ? 1 : 0) + sched.K + (sched.K - 1 - k);
  for (int i = 0; i < sched.num_steps(); ++i) {
    const InterStep st = sched.step(i);
    if (st.send && (layout_.inter_cell(0, st.slot) == cell || layout_.inter_cell(1, st.slot) == cell)) return i;
  }
  return -1;
}

void CpuExecutor::attach(const std::vector<std::string>& names) {
  NVRAR_CHECK(static_cast<int>(names.size()) == cfg_.world, "attach: ", names.size(), " names for ", cfg_.world,
              " ranks");
  for (int r = 0; r < cfg_.world; ++r)
    NVRAR_CHECK(names[static_cast<size_t>(r)].empty() == remote(r), "nvrar: rank ", cfg_.rank, ": rank ", r,
                remote(r) ? " is on another host but sent a segment name" : " sent no segment name");
  heap_.attach(names);
  for (int r = 0; r < cfg_.world; ++r)
    if (remote(r)) heap_.set_image(r, reinterpret_cast<char*>(images_[static_cast<size_t>(r)].data()));
  const auto* mine = reinterpret_cast<const SegmentHeader*>(heap_.mine());
  for (int r = 0; r < cfg_.world; ++r) {
    const auto* h = reinterpret_cast<const SegmentHeader*>(heap_.base(r));
    NVRAR_CHECK(h->magic == kMagic && h->version == kVersion, "rank ", cfg_.rank, ": rank ", r,
                "'s segment is not an nvrar segment of version ", kVersion);
    // Every byte compared, whatever differs first: the time taken says nothing about the secret.
    unsigned diff = 0;
    for (size_t i = 0; i < kSecretBytes; ++i) diff |= static_cast<unsigned>(h->secret[i] ^ mine->secret[i]);
    NVRAR_CHECK(diff == 0, "nvrar: rank ", cfg_.rank, ": rank ", r, "'s shared-memory segment does not carry the "
                "session's secret (a segment of another session, or forged): refusing it");
    NVRAR_CHECK(h->rank == r && h->world == cfg_.world, "rank ", cfg_.rank, ": segment ", r, " belongs to rank ",
                h->rank, " of ", h->world, " (bootstrap exchanged names out of order)");
    NVRAR_CHECK(h->config_hash == mine->config_hash, "rank ", cfg_.rank, ": rank ", r,
                " was created with a different configuration (ranks_per_node ", h->ranks_per_node, " vs ",
                cfg_.ranks_per_node, ", or max_bytes / heap size / one-shot threshold differ); every rank must "
                "use the same settings");
    if (r != cfg_.rank && !remote(r)) peer_start_times_[static_cast<size_t>(r)] = owner_start_time(h);
  }
  // NOTE [rotating stage-in] (protocol/round.h): small calls go round the first kRotateSpan bytes
  // of each staging slot, so their pages are mapped here, not by the first few hundred calls (a
  // page fault in the writer's mapping and another in each reader's: 8 KB one-shot calls took 7-8
  // us instead of 1.2 while they came). Mine written (the zeros a new segment holds), the local
  // peers' read.
  if (where_.G > 1) {
    const size_t span = std::min(layout_.staging_bytes, kRotateSpan);
    for (int h = 0; h < where_.G; ++h) {
      const int r = where_.rank_of(where_.node, h);
      for (int p = 0; p < 2; ++p)
        for (size_t off = 0; off < span; off += SegmentLayout::kPage) {
          char* at = heap_.base(r) + layout_.staging(p) + off;
          if (r == cfg_.rank)
            __atomic_store_n(at, __atomic_load_n(at, __ATOMIC_RELAXED), __ATOMIC_RELAXED);
          else
            (void)__atomic_load_n(at, __ATOMIC_RELAXED);
        }
    }
  }
}

bool CpuExecutor::probe_cma() const {
  if (!cfg_.cma) return false;
  for (int r = 0; r < cfg_.world; ++r) {
    if (r == cfg_.rank || remote(r)) continue;  // (cross-memory access never leaves a node)
    const auto* h = reinterpret_cast<const SegmentHeader*>(heap_.base(r));
    uint64_t magic = 0;
    struct iovec local = {&magic, sizeof(magic)};
    struct iovec remote = {reinterpret_cast<void*>(h->self_base), sizeof(magic)};
    if (process_vm_readv(static_cast<pid_t>(h->pid), &local, 1, &remote, 1, 0) != sizeof(magic) || magic != kMagic)
      return false;  // not permitted (ptrace policy), or the pid is not that process (other pid namespace)
  }
  return true;
}

Algorithm CpuExecutor::resolve(Algorithm a, size_t bytes) const {
  // A kAuto call that NOTE [one-shot or two-shot] decides: the algorithm of the next such call.
  int cls = -1;
  const Algorithm chosen = a == Algorithm::kAuto ? chosen_algorithm(bytes, calls_.load(std::memory_order_relaxed), &cls)
                                                 : a;
  return resolve_algorithm(chosen, bytes, cfg_.oneshot_max_bytes);
}

// NOTE [one-shot or two-shot]
// Between the one-shot limit (nvrar.settings.CPU_ONESHOT_MAX) and oneshot_adapt_max_bytes, which
// algorithm is faster depends on the host's state, as the store kind of a stage-in does (NOTE
// [streaming stage-in]). On the 2-core AMD EPYC KVM guest (2026-12-04 20:50 UTC, `mpirun -n 2
// --oversubscribe python benchmarks/stage_in.py algorithms --sizes 128K,256K,512K,1M --rounds 4
// --calls 100`, 2 ranks, cold, medians of four rounds in us, one-shot / two-shot): where a cache
// line crossed between the CPUs in 129-140 ns, 19.19 / 18.08 at 256 KB, 36.27 / 34.03 at 512 KB,
// 67.60 / 63.75 at 1 MB; with --busy, where it took 552-557 ns, 31.77 / 35.28, 58.06 / 67.82 and
// 116.32 / 133.07. A two-shot call moves the same bytes across the cores as a one-shot one (half
// the message each way in each of its two steps, against the whole message once) but waits twice
// and reads its partner's data from that core's cache both times; a one-shot stage-in may stream
// to memory, which the partner reads faster than a line from the other core in the slow state.
// So, in a job of one node (the nodes' leaders would time apart and the ranks of different nodes
// must agree), the node's leader times its kAuto calls of each message size class both ways and
// publishes the faster in its header (algo_plan, way_word: 1 one-shot, 0 two-shot) for calls
// from two calls on, as for the ways of NOTE [cross-memory or staged] (way_choice.h: the other
// algorithm tried now and then). Unlike a way, the algorithm must be the same on every rank: the
// plan word gives call j + 1 the same algorithm whether a rank reads the word the leader left
// after call j - 1 or after call j, and no rank reads it later than the leader's flags of call j +
// 1 allow (segment.h, way_word); a rank that took the other would fail the call with a mismatch
// (its call description names the algorithm), never mix the two. Both algorithms reduce in the
// same canonical order, so the result is the same bits (tests/test_determinism.py). A fused kAuto
// call of such a size (fused.cpp, through resolve) is not timed: it takes the algorithm the word
// gives the next all_reduce call, the same on every rank by the same argument.
// NVRAR_ONESHOT_ADAPT_MAX_BYTES=0, or an explicit NVRAR_ONESHOT_MAX_BYTES, turns the choice off.
Algorithm CpuExecutor::chosen_algorithm(size_t bytes, uint64_t call, int* cls) const {
  *cls = -1;
  if (cfg_.oneshot_adapt_max_bytes == 0 || cfg_.world < 2 || where_.N != 1 || !heap_.attached() ||
      bytes <= cfg_.oneshot_max_bytes || bytes > cfg_.oneshot_adapt_max_bytes)
    return Algorithm::kAuto;
  const int c = size_class(bytes, kAlgoPlanClasses);
  *cls = c;
  const auto* lh = reinterpret_cast<const SegmentHeader*>(heap_.base(where_.rank_of(where_.node, 0)));
  return way_of(__atomic_load_n(&lh->algo_plan[c], __ATOMIC_RELAXED), call) == 1 ? Algorithm::kOneShot
                                                                                 : Algorithm::kTwoShot;
}

void CpuExecutor::all_reduce(const void* in, void* out, size_t count, DType dtype, RedOp op, Algorithm algorithm,
                             const Interrupt* intr) {
  // Second line behind the Python check: a forked child would write into its parent's segment
  // and, through cross-memory access, let peers write into the parent's buffers.
  NVRAR_CHECK(g_fork_gen.load(std::memory_order_relaxed) == born_fork_gen_,
              "nvrar: this Communicator was created by process ", heap_.creator_pid(), "; a forked child (pid ",
              getpid(), ") cannot use it: create a new Communicator in the child");
  NVRAR_CHECK(!closing_.load(std::memory_order_acquire), "all_reduce: the communicator is closed");
  std::unique_lock<std::mutex> lock(busy_, std::try_to_lock);
  NVRAR_CHECK(lock.owns_lock(), "all_reduce: another thread is using this communicator; calls on one "
              "communicator must be serialized");
  NVRAR_CHECK(failure_.empty(), "all_reduce: this communicator failed earlier and cannot be used again: ", failure_);
  NVRAR_CHECK(heap_.mine() != nullptr, "all_reduce: the communicator is closed");
  NVRAR_CHECK(heap_.attached() || cfg_.world == 1, "all_reduce: the communicator is not set up");
  if (count == 0) return;
  const PhaseTimer call_timer(phase_timing_, &times_.call_ns);
  times_.calls += phase_timing_ ? 1 : 0;
  // NOTE [one-shot or two-shot]: a kAuto call in the leader's range runs the algorithm its plan word
  // gives this call (explicit from here on; kAuto where the choice does not apply).
  int algo_cls = -1;
  Algorithm run = algorithm;
  if (algorithm == Algorithm::kAuto && cfg_.oneshot_adapt_max_bytes > 0 && is_dtype(dtype) &&
      count <= SIZE_MAX / static_cast<size_t>(dtype_size(dtype)))
    run = chosen_algorithm(count * static_cast<size_t>(dtype_size(dtype)), calls_.load(std::memory_order_relaxed),
                           &algo_cls);
  const PlanKey key{in, out, count, dtype, op, run};
  if (!(key == last_key_) || last_fn_ == nullptr) {
    last_fn_ = nullptr;  // a plan_call that throws leaves no half-made entry
    last_plan_ = plan_call(limits_, reinterpret_cast<uintptr_t>(in), reinterpret_cast<uintptr_t>(out), count, dtype,
                           op, run);
    last_fn_ = cpu_reduce_fn(dtype, op);
    last_key_ = key;
  }
  const CallPlan& c = last_plan_;
  const ReduceFn fn = last_fn_;
  if (cfg_.world == 1) {
    if (in != out) std::memmove(out, in, c.bytes);
    return;
  }

  note_call(count, dtype, static_cast<int32_t>(op), c.algorithm, 0, 0.0f);
  start_call_placement();  // NOTE [moving apart]
  intr_ = intr;
  struct ClearIntr {
    const Interrupt** p;
    ~ClearIntr() { *p = nullptr; }
  } clear_intr{&intr_};

  // Zero-copy: an input that lives in my pool is read by the peers where it is; an output in my
  // pool is written by the peers directly (c.in_pool, c.out_pool).
  const char* pin = static_cast<const char*>(in);
  char* pout = static_cast<char*>(out);
  // NOTE [cross-memory or staged]
  // A two-shot shard in private memory reaches the peers either by cross-memory transfers
  // (process_vm_readv/writev: one copy, but system calls that pin pages) or staged through the
  // segment (plain copies, one more of them). Which is faster depends on the host, and on one host
  // it changes by the second: on a 2-core AMD EPYC KVM guest (2026-12-03, nvrar-bench --algorithms
  // two-shot --buffers ordinary, NVRAR_CMA_MIN_BYTES=4M for staged) staged took 0.5-0.8 of
  // cross-memory's time at 32 KB-2 MB in some runs and 1.5-2.1 times it in others, with Open MPI's
  // own time moving 2.5x between the same runs. So above cma_min_bytes the calls are timed (ns per
  // byte, per shard size class, a moving average) both ways and the faster is taken, the other
  // tried kWayTrial calls in a row now and then (from every kWayProbeEvery decisions to every
  // kWayProbeMax: way_choice.h). The ranks of a node take the
  // same way: one that stages while its peer reads across memory is slower than either way alone
  // (same host, 2026-12-03 20:00 UTC, 2 ranks, cold, medians: 1 MB mixed 159-172 us, cross-memory
  // 130-139, staged 69-91; ranks that chose apart, each on its own times, stayed apart, since every
  // probe swapped both). So the node's leader (local index 0) alone measures and decides, and
  // publishes its choice in its segment header (way_plan, way_word) for calls from two calls on;
  // every rank reads it at the start of a call. The leader's store at the end of call j precedes
  // its flags of call j + 1, which every local peer acquires before its call j + 1 ends, so by call
  // j + 2 they all see it. The choice never touches the result: a rank advertises how its input and
  // output are reached (round.h, the ready cell's refs) and its peers follow; the reduction and its
  // order are the same either way (bitwise). An explicit NVRAR_CMA_MIN_BYTES or NVRAR_CMA=0 turn it
  // off (cma_adapt). With more ranks than cores it applies from 256 KB shards (smaller ones are
  // staged, nvrar.settings.cpu_cma_min_bytes); there too the better way changes with the host's
  // regime: 4 ranks, 2 cores, 1 MB cold, same host 2026-12-03 20:20 UTC, medians of two runs each:
  // cross-memory 405-412 us, staged 183-187, chosen 193-221.
  const uint64_t call_no = calls_.fetch_add(1, std::memory_order_relaxed);
  const size_t G = static_cast<size_t>(where_.G);
  const size_t shard = std::min(c.chunk_elems, count) * c.es / G;
  const bool adapt = cfg_.cma_adapt && cma_enabled() && c.algorithm == Algorithm::kTwoShot && G > 1 &&
                     shard >= cfg_.cma_min_bytes && !(c.in_pool && c.out_pool);
  //
  // NOTE [streaming stage-in]
  // A one-shot call stages its whole input in a parity slot of my segment that only my peers
  // read; they read it two calls ago, so with plain stores each line of it is first fetched back
  // from a peer's cache (read for ownership) before it is written, and then read across the cores
  // once more. Streaming (non-temporal) stores write whole lines to memory without that fetch,
  // and the peer reads them from memory (csrc/cpu/stream_copy.h). Which costs less depends on
  // the host's state: on the 2-core AMD EPYC KVM guest (2026-12-04 14:08-14:11 UTC, `mpirun -n 2
  // --oversubscribe python benchmarks/stage_in.py stores [--busy]`, 2 ranks, 32 KB one-shot calls,
  // medians of six rounds in us) plain stores took 4.7-6.1, streaming 7.4-10.1 and the choice
  // below 4.9-6.2 in three runs where a cache line crossed between the two CPUs in about 130 ns;
  // plain 10.6-14.8, streaming 6.3-8.7 and the choice 6.3-8.7 in five where it took 460-900 ns
  // (8-64 KB alike); the state changes on a scale of minutes. So, as for the ways above, the
  // node's leader times its one-shot calls both ways (per message size class) and publishes the
  // faster in its segment header (stage_plan, next_way_word), every rank following
  // it from two calls on. The bytes staged are the same either way, and so is the result.
  // NVRAR_STREAM_STAGING=0/1 fixes the choice (cfg_.stream_staging).
  const bool stage_choice = c.algorithm == Algorithm::kOneShot && G > 1 && kHaveStreamStores;
  WayChoice* ws = nullptr;
  uint64_t* plan = nullptr;
  int way = 1;
  const int leader = where_.rank_of(where_.node, 0);
  auto* lh = reinterpret_cast<SegmentHeader*>(heap_.base(leader));
  WayChoice* wa = nullptr;  // NOTE [one-shot or two-shot], the leader's
  const int algo_way = c.algorithm == Algorithm::kOneShot ? 1 : 0;
  if (algo_cls >= 0) {
    algo_calls_[algo_way].fetch_add(1, std::memory_order_relaxed);
    if (leader == where_.rank) wa = &algo_ways_[algo_cls];
  }
  if (adapt || (stage_choice && cfg_.stream_staging < 0)) {
    const size_t sized = adapt ? shard : c.bytes;
    const int cls = size_class(sized, 64);  // ways_ and stage_ways_, way_plan and stage_plan
    uint64_t* plans = adapt ? lh->way_plan : lh->stage_plan;
    way = way_of(__atomic_load_n(&plans[cls], __ATOMIC_RELAXED), call_no);
    if (adapt) {
      round_cfg_.cma = way == 1;
      way_calls_[way].fetch_add(1, std::memory_order_relaxed);
    } else {
      stream_ = way == 1;
      stage_calls_[way].fetch_add(1, std::memory_order_relaxed);
    }
    if (leader == where_.rank) {
      ws = adapt ? &ways_[cls] : &stage_ways_[cls];
      plan = &plans[cls];
    }
  } else if (stage_choice) {
    stream_ = cfg_.stream_staging == 1;
  }
  struct RestoreCallState {  // what the choices above set for this call only
    RoundConfig* rc;
    bool on;
    bool* stream;
    ~RestoreCallState() {
      rc->cma = on;
      *stream = false;
    }
  } restore{&round_cfg_, cma_enabled(), &stream_};
  const auto t0 = ws != nullptr || wa != nullptr ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  for (size_t off = 0; off < count; off += c.chunk_elems) {
    const size_t n = std::min(c.chunk_elems, count - off);
    round(pin + off * c.es, pout + off * c.es, n, c.es, c.in_pool, c.out_pool, c.algorithm, c.sig, fn, c.sc);
  }
  if (ws == nullptr && wa == nullptr) return;
  const auto t1 = std::chrono::steady_clock::now();
  const double ns_per_byte =
      static_cast<double>(std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count()) /
      static_cast<double>(c.bytes);
  const double end_ns =
      static_cast<double>(std::chrono::duration_cast<std::chrono::nanoseconds>(t1.time_since_epoch()).count());
  const auto publish = [call_no](uint64_t* cell, int next) {
    const uint64_t old = __atomic_load_n(cell, __ATOMIC_RELAXED);
    const uint64_t word = next_way_word(old, call_no, next);  // segment.h: stored only when it changes
    if (word != old) __atomic_store_n(cell, word, __ATOMIC_RELAXED);
  };
  if (ws != nullptr) publish(plan, ws->after_call(way, ns_per_byte, end_ns));  // way_choice.h
  if (wa != nullptr) {
    const int next = wa->after_call(algo_way, ns_per_byte, end_ns);
    publish(&lh->algo_plan[algo_cls], cfg_.test_algorithm_flip ? 1 - algo_way : next);
  }
}

namespace {
// However a round ends, no put from another host may land outside the zones after it (NOTE
// [landings], protocol/round.h: an expectation names the caller's buffers).
struct ForgetLandings {
  HostLink* link;
  ~ForgetLandings() {
    if (link != nullptr) link->forget_expected();
  }
};
}  // namespace

void CpuExecutor::round(const char* in, char* out, size_t n, size_t es, bool in_pool, bool out_pool, Algorithm v,
                        uint32_t sig, ReduceFn fn, Scale sc) {
  const uint64_t e = ++epoch_;
  desc_.n = n;
  CpuTransport tp{this, fn, e};
  const ForgetLandings forget{link_.get()};
  Slice s{in, out, n, es, 0, 0, in_pool, out_pool};
  if (v == Algorithm::kOneShot)
    one_shot_round(tp, round_cfg_, ws_, s, e, sig, sc);
  else
    two_shot_round(tp, round_cfg_, ws_, s, e, sig, sc);
}

void CpuExecutor::fused_round(const FusedSlice& s, Algorithm v, uint32_t sig, ReduceFn fn, const RowEpilogue& epi,
                              char* scratch) {
  const uint64_t e = ++epoch_;
  desc_.n = s.rows * s.h;
  CpuTransport tp{this, fn, e};
  const ForgetLandings forget{link_.get()};
  if (v == Algorithm::kOneShot) {
    one_shot_round(tp, round_cfg_, ws_, Slice{s.in, scratch, s.rows * s.h, s.es, 0, 0, false, false}, e, sig,
                   make_scale(RedOp::kSum, 1));
    epi(s.x_out, s.res, scratch, s.res, s.rows);
  } else {
    fused_two_shot_round(tp, round_cfg_, ws_, s, e, sig, epi);
  }
}

// The call in flight (NOTE [call description]): its description, which every flag I send carries
// and every flag I receive must match; a fused call adds its row length and eps.
void CpuExecutor::note_call(uint64_t count, DType dtype, int32_t op, Algorithm v, uint64_t h, float eps) {
  auto* hd = reinterpret_cast<SegmentHeader*>(heap_.mine());
  hd->call_epoch = epoch_ + 1;
  hd->call_count = count;
  hd->call_dtype = static_cast<int32_t>(dtype);
  hd->call_op = op;
  hd->call_algorithm = static_cast<int32_t>(v);
  desc_.count = count;
  // A fused call's op byte is kFusedOpCode (protocol/epilogue.h) and its eps bits ride above the
  // plain call's code; its row length goes in the cells' shape word.
  desc_.code = call_code(dtype, static_cast<RedOp>(op), v) |
               (op == kFusedOpCode ? static_cast<uint64_t>(float_bits(eps)) << 32 : 0);
  desc_.shape = h;
}

void CpuExecutor::signal(int peer, size_t cell_off, uint64_t word, uint64_t aux0, uint64_t aux1) {
  auto* c = reinterpret_cast<Cell*>(heap_.base(peer) + cell_off);
  store_relaxed(&c->aux0, aux0);
  store_relaxed(&c->aux1, aux1);
  store_desc(&c->desc, desc_);
  store_release(&c->word, word);
  jitter();
}

// One cross-memory copy between my memory and a peer's private memory (process_vm_readv/writev),
// resumed after partial transfers, inside a transfer window (NOTE [transfer windows]).
void CpuExecutor::cma_transfer(bool write, int peer, void* local, uint64_t remote, size_t bytes, const Site& site,
                               uint64_t epoch) {
  const auto* ph = reinterpret_cast<const SegmentHeader*>(heap_.base(peer));
  auto* mine = reinterpret_cast<SegmentHeader*>(heap_.mine());
  const pid_t pid = static_cast<pid_t>(ph->pid);
  auto* abort_cell = reinterpret_cast<Cell*>(heap_.mine() + layout_.abort_cell());
  store_relaxed(&mine->touch, touch_word(epoch, peer));
  std::atomic_thread_fence(std::memory_order_seq_cst);
  // A peer that failed returns from its call and its caller may free the memory we are about to
  // touch: it waits for open windows that name it, and we stay out once it has failed.
  const bool target_failed = load_acquire(&ph->failed_epoch) != 0;
  size_t done = 0;
  int err = 0;
  while (!target_failed && done < bytes) {
    if (load_acquire(&abort_cell->word) != 0) break;
    struct iovec l = {static_cast<char*>(local) + done, bytes - done};
    struct iovec r = {reinterpret_cast<void*>(remote + done), bytes - done};
    const ssize_t k = write ? process_vm_writev(pid, &l, 1, &r, 1, 0) : process_vm_readv(pid, &l, 1, &r, 1, 0);
    if (k > 0) {
      done += static_cast<size_t>(k);
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    err = k < 0 ? errno : EIO;
    break;
  }
  store_release(&mine->touch, 0);  // the window closes before any failure path (which may quiesce)
  if (load_acquire(&abort_cell->word) != 0) fail_from_abort(site, epoch);
  if (target_failed)
    fail(ProtocolError::Kind::kPeerAbort, "rank " + std::to_string(peer) + " failed during the call", site, epoch, 0);
  if (done == bytes) return;
  if (err == ESRCH) fail(ProtocolError::Kind::kTimeout, "peer process exited", site, epoch, 0);
  fail(ProtocolError::Kind::kViolation,
       std::string("cross-memory ") + (write ? "write into" : "read from") + " the peer's buffer failed: " +
           std::strerror(err),
       site, epoch, 0);
}

// Every cross-memory transfer stays inside the buffer the peer advertised for this round.
void CpuExecutor::check_remote_range(bool write, int peer, uint64_t addr, size_t bytes, const Site& site,
                                     uint64_t epoch) {
  const size_t h = static_cast<size_t>(peer - where_.rank_of(where_.node, 0));
  const uint64_t base = write ? adv_out_[h] : adv_in_[h];
  if (base != 0 && addr >= base && bytes <= adv_bytes_[h] && addr - base <= adv_bytes_[h] - bytes) return;
  std::ostringstream os;
  os << "protocol violation: a cross-memory " << (write ? "write" : "read") << " of " << bytes << " bytes at offset "
     << (addr - base) << " lies outside the " << adv_bytes_[h] << "-byte buffer rank " << peer
     << " advertised for this round";
  fail(ProtocolError::Kind::kViolation, os.str(), site, epoch, 0);
}

void CpuExecutor::record_advertised(int peer, size_t cell_off, const Site& site, uint64_t epoch) {
  const auto* c = reinterpret_cast<const Cell*>(heap_.mine() + cell_off);
  const size_t h = static_cast<size_t>(peer - where_.rank_of(where_.node, 0));
  const uint64_t in_ref = load_relaxed(&c->aux0);
  const uint64_t out_ref = load_relaxed(&c->aux1);
  const uint64_t bytes = load_relaxed(&c->desc.n) * static_cast<uint64_t>(dtype_size(code_dtype(desc_.code)));
  adv_bytes_[h] = bytes;
  adv_in_[h] = ref_kind(in_ref) == kRefCma ? ref_value(in_ref) : 0;
  adv_out_[h] = ref_kind(out_ref) == kRefCma ? ref_value(out_ref) : 0;
  // Shared-memory buffers must lie within the peer's segment: an input in its staging slots or
  // pool, an output in its pool.
  const auto inside = [&](uint64_t ref, size_t lo, size_t hi) {
    const uint64_t off = ref_value(ref);
    return off >= lo && off <= hi && bytes <= hi - off;
  };
  const bool in_ok = ref_kind(in_ref) != kRefShm || inside(in_ref, layout_.staging(0), layout_.result_off) ||
                     inside(in_ref, layout_.pool_off, layout_.total_bytes);
  const bool out_ok = ref_kind(out_ref) != kRefShm || inside(out_ref, layout_.pool_off, layout_.total_bytes);
  if (!in_ok || !out_ok || ref_kind(in_ref) > kRefCma || ref_kind(out_ref) > kRefCma)
    fail(ProtocolError::Kind::kViolation,
         "protocol violation: rank " + std::to_string(peer) + " advertised a buffer outside its segment", site,
         epoch, 0);
}

// NOTE [waiting]
// Decode calls arrive microseconds apart (the peers leave the same matmul), so a waiter first
// spins: it polls its flag, its abort cell and the closing mark (all in its own memory: cache
// hits until a peer writes them), reading the clock once per 64 polls. With more ranks than
// cores the rank it waits for may need this very core, so it spins only kSpinPollsOversubscribed
// polls. Otherwise the spin lasts kSpinPhase (100 us), whatever the waits before it found. It
// used to adapt (halved down to 2 us after every wait the spin did not cover), and beside a busy
// neighbour that made things worse: on a 2-core AMD EPYC KVM guest with one spinning process
// (2026-12-03, nvrar-bench --backends nvrar,mpi --timing cold --buffers ordinary, two rounds),
// 512 KB-2 MB calls had medians of 1.9-3.9 ms with the adaptive spin and 0.11-0.72 ms with a
// fixed one (Open MPI 0.12-1.3 ms): a rank that leaves its core early finds the neighbour on it
// and waits out that process's time slice to get it back. (Sleeping on a futex once the host is
// crowded, so that a queued peer could take the idle core, was measured in the same runs and
// lost the same way.) Then the waiter gives the core away: the caller's block hook first (the
// bindings release the GIL there, not before), then sched_yield between polls (which returns at
// once where nothing else wants the core, so a late peer costs a few system calls, not a
// sleep), with the deadline, the peer's liveness and the caller's signal check about every
// 50 ms; after kYieldPhase it sleeps between polls. A wait for a message from another host
// yields for CpuTransport::kRemoteYieldNs, then blocks on the link's event (HostLink::block: the
// worker's event fd, woken by the network, at most 200 us), so that in a long wait the core goes
// to whoever needs it and the waiter wakes when its data arrives, not at the next turn of a
// yield loop; a short one (a small message) does not pay a sleeping thread's wake-up.
void CpuExecutor::Yield::operator()(uint64_t waited_ns) const {
  if (waited_ns < static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(kYieldPhase).count())) {
    sched_yield();
  } else {
    struct timespec ts = {0, kSleepNs};
    nanosleep(&ts, nullptr);
  }
}

// NOTE [sharing a core]
// Two ranks of a node can end up on one core while the process may run on more: the scheduler
// placed them together beside other work (2 ranks and a busy process on 2 cores: the balancer sees
// 2 + 1 tasks as balanced and leaves them so), or a cgroup's quota rather than its cpuset limits
// them. A waiter there that spins for kSpinPhase keeps the core from the very rank it waits for:
// every wait costs the whole spin, and calls took 240-460 us (2 ranks on one core of a 2-core AMD
// EPYC KVM guest, Linux 6.18, the executor built to count 2 cores, 2026-12-04, nvrar-bench --timing
// warm, 8 KB-1 MB, two runs; the same with the checks below: 15-262 us, the times of ranks that
// know they share a core and yield at once). In --busy runs the same placement showed as call
// medians of 0.5-4 ms in single rows. So a waiter for a local peer's flag publishes the CPU it runs
// on in its segment header (cpu, stored where it changed; sched_getcpu costs a few ns), and
// ends its spin as soon as the peer it waits for last published the same CPU: then it yields at
// once (NOTE [waiting]), which hands the core to the peer. Checked at the start of the wait and
// with every clock read of the spin (each 64 polls); not with more ranks than cores, where the spin
// is 16 polls anyway (and skipping those looked worse: 4 ranks on 2 cores, 16-128 KB, three
// alternated runs, 88-167 us against 40-135). Each rank publishes its CPU again at the start of
// every call (NOTE [moving apart]); a peer's published CPU may still be stale (it moved since):
// that costs a spin cut short, a spin in vain or a move made in vain, never a result. (Sleeping on
// a futex that the signaller rings, instead of yielding, was measured too, ranks pinned to one
// core, back-to-back runs: 18-52 us at 8-64 KB and 289 at 1 MB, against 15-27 and 209 yielding.)
int CpuExecutor::publish_cpu() {
  const int cpu = sched_getcpu();
  if (cpu < 0) return -1;
  auto* h = reinterpret_cast<SegmentHeader*>(heap_.mine());
  const auto v = static_cast<uint32_t>(cpu) + 1;
  if (__atomic_load_n(&h->cpu, __ATOMIC_RELAXED) != v) __atomic_store_n(&h->cpu, v, __ATOMIC_RELAXED);
  return cpu;
}

bool CpuExecutor::shares_my_core(int peer, int my_cpu) const {
  if (my_cpu < 0) return false;
  const auto* h = reinterpret_cast<const SegmentHeader*>(heap_.base(peer));
  return __atomic_load_n(&h->cpu, __ATOMIC_RELAXED) == static_cast<uint32_t>(my_cpu) + 1;
}

// NOTE [moving apart]
// Ranks that share a core hand it to each other at every wait (NOTE [sharing a core]), and that
// handover is what their calls cost. Beside one spinning process on a 2-core AMD EPYC KVM guest
// (Linux 6.18, 2026-12-04; 2 ranks under mpirun without binding, 400 cold 8 KB calls per run, a
// spin barrier before each, three runs), the scheduler kept both ranks on one CPU for every call
// of all three runs (2 + 1 tasks look balanced to it), and the calls' medians were 30-155 us;
// with the move below the ranks shared a CPU in 2-6% of the calls and the medians were 4.9-8.0 us
// (Intel MPI, whose mpiexec pins each rank to a core, 5.4-6.9 us in the same runs). Every rank
// publishes its CPU at the start of every call and of every flag wait that does not find its
// flag at once. Once kSpreadAfter such waits in a row found the peer waited for on my CPU, the
// higher rank of the pair moves (the lower one after twice as many, in case the higher one's
// flags are always there when it looks, so that it never counts): it sets its affinity to one CPU
// of its mask on which no rank of this host last ran (the first such after its own CPU, so that
// movers from different CPUs spread), which migrates it at once, and then restores its mask as it
// was, so nothing of the user's placement changes but the CPU it is on now. The scheduler may
// move it back later; then the count starts over, and a move happens at most every kSpreadEvery.
// A wait for a peer on another CPU resets the count: with three or more ranks it moves a rank
// whose waits keep finding one peer on its CPU. Nothing is done with more ranks in the job than
// CPUs in the mask at construction (the spin is 16 polls there and nothing is counted), with one
// CPU in the mask, where every CPU of the mask has a rank of this host on it, nor with
// NVRAR_CPU_SPREAD=0 (the caller's affinity is never touched then).
void CpuExecutor::spread_if_sharing() {
  const int peer = shared_with_;
  if (peer < 0 || !cfg_.cpu_spread || (peer > cfg_.rank && shared_waits_ < 2 * kSpreadAfter)) return;
  shared_waits_ = 0;
  const auto now = std::chrono::steady_clock::now();
  if (spreads_.load(std::memory_order_relaxed) != 0 && now - last_spread_ < kSpreadEvery) return;
  const int cpu = sched_getcpu();
  cpu_set_t mask;
  if (cpu < 0 || sched_getaffinity(0, sizeof(mask), &mask) != 0 || CPU_COUNT(&mask) < 2) return;
  cpu_set_t taken;
  CPU_ZERO(&taken);
  CPU_SET(cpu, &taken);
  for (int r = 0; r < cfg_.world; ++r) {  // every rank of this host (emulated nodes included)
    if (r == cfg_.rank || remote(r)) continue;
    const auto v = __atomic_load_n(&reinterpret_cast<const SegmentHeader*>(heap_.base(r))->cpu, __ATOMIC_RELAXED);
    if (v > 0 && v <= CPU_SETSIZE) CPU_SET(static_cast<int>(v - 1), &taken);
  }
  // The first free CPU after mine (round the mask), so that movers from different CPUs spread.
  for (int k = 1; k < CPU_SETSIZE; ++k) {
    const int c = (cpu + k) % CPU_SETSIZE;
    if (!CPU_ISSET(c, &mask) || CPU_ISSET(c, &taken)) continue;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(c, &one);
    if (sched_setaffinity(0, sizeof(one), &one) != 0) return;
    // My own mask of a moment ago. Only a cpuset changed in between can refuse it; then every CPU,
    // which the kernel cuts to the cpuset, rather than staying pinned to one.
    if (sched_setaffinity(0, sizeof(mask), &mask) != 0) {
      cpu_set_t all;
      CPU_ZERO(&all);
      for (int a = 0; a < CPU_SETSIZE; ++a) CPU_SET(a, &all);
      sched_setaffinity(0, sizeof(all), &all);
    }
    spreads_.fetch_add(1, std::memory_order_relaxed);
    last_spread_ = now;
    publish_cpu();
    return;
  }
}

template <typename Ready, typename Observed, typename Idle>
void CpuExecutor::spin_until(Ready ready, Observed observed, const Site& site, uint64_t epoch, Idle idle,
                             bool flag_wait) {
  if (ready()) return;
  auto* abort_cell = reinterpret_cast<Cell*>(heap_.mine() + layout_.abort_cell());
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  const auto spin_end = start + kSpinPhase;
  // NOTE [sharing a core]: a wait for a local peer's flag ends its spin when the peer shares my core.
  // (With more ranks than cores the spin is a few polls already: NOTE [waiting].)
  const bool local_flag = flag_wait && spin_polls_ == UINT64_MAX && site.peer != cfg_.rank && !remote(site.peer);
  const int my_cpu = local_flag ? publish_cpu() : -1;
  const bool shared = local_flag && shares_my_core(site.peer, my_cpu);
  if (local_flag && my_cpu >= 0) {  // NOTE [moving apart]
    shared_waits_ = shared ? shared_waits_ + 1 : 0;
    shared_with_ = site.peer;
  }
  for (uint64_t it = 1; !shared; ++it) {
    if (ready()) return;
    if (load_acquire(&abort_cell->word) != 0) fail_from_abort(site, epoch);
    if (closing_.load(std::memory_order_relaxed))
      fail(ProtocolError::Kind::kViolation, "the communicator was closed by another thread during the call", site,
           epoch, 0);
    if (it >= spin_polls_) break;
    if ((it & 63) == 0) {
      if (clock::now() >= spin_end) break;
      if (local_flag && shares_my_core(site.peer, my_cpu)) break;  // it cannot run while I spin
    }
    cpu_relax();
  }
  if (intr_ != nullptr && intr_->block != nullptr) intr_->block(intr_->ctx);
  const auto* peer_header = reinterpret_cast<const SegmentHeader*>(heap_.base(site.peer));
  const auto deadline =
      start + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(cfg_.timeout_s));
  auto next_liveness = start + kLivenessPeriod;
  for (;;) {
    if (ready()) return;
    if (load_acquire(&abort_cell->word) != 0) fail_from_abort(site, epoch);
    if (closing_.load(std::memory_order_relaxed))
      fail(ProtocolError::Kind::kViolation, "the communicator was closed by another thread during the call", site,
           epoch, 0);
    const auto now = clock::now();
    if (now >= deadline) {
      fail(ProtocolError::Kind::kTimeout, timeout_text(cfg_.timeout_s), site, epoch, observed());
    }
    if (now >= next_liveness) {
      // A peer that failed stored its aborts before it exited or closed: the abort it sent (read
      // after the exit or the closed mark, so not missed) names the first failure, not its end.
      if (!peer_alive(site.peer)) {
        if (load_acquire(&abort_cell->word) != 0) fail_from_abort(site, epoch);
        fail(ProtocolError::Kind::kTimeout, "peer process exited", site, epoch, observed());
      }
      // A peer that closed its communicator takes part in no round any more. Its last flags were
      // stored before its closed mark, so look once more before giving up on it.
      if (load_acquire(&peer_header->closed) != 0 && !ready()) {
        if (load_acquire(&abort_cell->word) != 0) fail_from_abort(site, epoch);
        fail(ProtocolError::Kind::kPeerAbort,
             "rank " + std::to_string(site.peer) +
                 " closed its communicator (close() or garbage collection) while this rank waited for it",
             site, epoch, observed());
      }
      std::string why;
      if (intr_ != nullptr && intr_->check != nullptr && intr_->check(intr_->ctx, &why))
        fail(ProtocolError::Kind::kInterrupted, why, site, epoch, observed());
      next_liveness = now + kLivenessPeriod;
    }
    idle(static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(now - start).count()));
  }
}

bool CpuExecutor::same_call(size_t cell_off) const {
  const auto* c = reinterpret_cast<const Cell*>(heap_.mine() + cell_off);
  return desc_equal(load_desc(&c->desc), desc_);
}

std::pair<uint64_t, uint64_t> CpuExecutor::wait(size_t cell_off, uint64_t epoch, uint32_t sig, const Site& site) {
  auto* c = reinterpret_cast<Cell*>(heap_.mine() + cell_off);
  const uint64_t target = flag_word(epoch, 0);
  uint64_t w = 0;
  spin_until([&] { return (w = load_acquire(&c->word)) >= target; }, [&] { return flag_epoch(w); }, site, epoch,
             Yield{}, true);
  if (flag_epoch(w) != epoch)
    fail(ProtocolError::Kind::kViolation, "protocol violation: a flag arrived from a later round", site, epoch,
         flag_epoch(w));
  if (flag_sig(w) != sig || !same_call(cell_off))
    fail(ProtocolError::Kind::kMismatch, "call mismatch: " + mismatch(site.peer, cell_off), site, epoch,
         flag_epoch(w));
  if (site.peer / where_.G == where_.node) {
    const int p = static_cast<int>(epoch & 1);
    const int h = site.peer % where_.G;
    if (cell_off == layout_.ready_cell(p, h)) {
      record_advertised(site.peer, cell_off, site, epoch);
    } else if (cell_off == layout_.final_cell(p, h) && desc_.shape == 0) {
      // (A fused call's final flag carries no offset: its rows were pushed into my staging.)
      // Where the peer's final shard lives: within its slots (result slot or a landing zone).
      const uint64_t off = load_relaxed(&c->aux0);
      const size_t es = static_cast<size_t>(dtype_size(code_dtype(desc_.code)));
      const size_t bytes = shard_range(desc_.n, static_cast<int>(es), where_.G, h).size() * es;
      if (off < layout_.result_off || off > layout_.llzones_off || bytes > layout_.llzones_off - off)
        fail(ProtocolError::Kind::kViolation,
             "protocol violation: rank " + std::to_string(site.peer) + " announced its final shard outside its slots",
             site, epoch, flag_epoch(w));
    }
  }
  return {load_relaxed(&c->aux0), load_relaxed(&c->aux1)};
}

size_t CpuExecutor::ll_desc_cell(size_t ll_off) const {
  // B = 1 on the CPU: LL zone index (p * S + slot) names the inter cell of the same step.
  const size_t idx = layout_.llzone_slot(ll_off);
  return layout_.cell(1 + 4 * static_cast<size_t>(where_.G) + idx);
}

void CpuExecutor::wait_ll(size_t off, size_t bytes, uint64_t epoch, uint32_t sig, const Site& site) {
  const uint32_t flag = ll_flag(epoch, sig);
  const auto* pk = reinterpret_cast<const uint64_t*>(heap_.mine() + off);
  const size_t n = ll_packets(bytes);
  const size_t desc = ll_desc_cell(off);
  const auto* dc = reinterpret_cast<const Cell*>(heap_.mine() + desc);
  // One deadline for the whole step: each poll moves on over the packets that have arrived. A
  // flag word of this round in the inter cell means the partner sent: if it is another call
  // (put-with-signal instead of LL, say), stop waiting for packets that will never come.
  size_t i = 0;
  int state = 1;
  bool other_call = false;
  spin_until(
      [&] {
        while (i < n && (state = ll_packet_state(load_acquire(&pk[i]), flag)) > 0) ++i;
        if (i == n || state < 0) return true;
        other_call = flag_epoch(load_acquire(&dc->word)) >= epoch && !same_call(desc);
        return other_call;
      },
      [&] { return static_cast<uint64_t>(ll_packet_flag(load_relaxed(&pk[i])) >> kSigBits); }, site, epoch);
  if (state < 0 || other_call || !same_call(desc))
    fail(ProtocolError::Kind::kMismatch, "call mismatch: " + mismatch(site.peer, desc), site, epoch, epoch);
}

std::string CpuExecutor::mismatch(int peer, size_t cell_off) const {
  const CallDesc theirs = load_desc(&reinterpret_cast<const Cell*>(heap_.mine() + cell_off)->desc);
  return "rank " + std::to_string(cfg_.rank) + " called " + describe_call(desc_.count, desc_.code, desc_.shape) +
         " but rank " + std::to_string(peer) + " called " + describe_call(theirs.count, theirs.code, theirs.shape);
}

std::string CpuExecutor::describe_call(uint64_t count, uint64_t code, uint64_t shape) {
  if (static_cast<int32_t>(code_op(code)) != kFusedOpCode) return nvrar::describe_call(count, code);
  std::ostringstream os;
  os << "all_reduce_add_rms_norm(count=" << count << ", h=" << shape << ", dtype=" << dtype_name(code_dtype(code))
     << ", eps=" << bits_float(static_cast<uint32_t>(code >> 32)) << ", algorithm=" << algorithm_name(code_algorithm(code))
     << ")";
  return os.str();
}

bool CpuExecutor::peer_alive(int peer) const {
  if (remote(peer)) return !link_->peer_failed(peer);  // UCX's peer error handling (NOTE [put-with-signal across hosts])
  return owner_alive(reinterpret_cast<const SegmentHeader*>(heap_.base(peer)),
                     peer_start_times_[static_cast<size_t>(peer)]);
}

void CpuExecutor::fail(ProtocolError::Kind kind, const std::string& what, const Site& site, uint64_t epoch,
                       uint64_t observed) {
  const std::string msg = failure_text(cfg_.rank, what, site.phase, site.step, site.peer, epoch, observed);
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
  post_remote_aborts();
  quiesce(epoch);
  throw ProtocolError(kind, msg, cfg_.rank, site.peer, site.phase, site.step, epoch, observed);
}

void CpuExecutor::fail_from_abort(const Site& site, uint64_t epoch) {
  auto* c = reinterpret_cast<Cell*>(heap_.mine() + layout_.abort_cell());
  const uint64_t word = load_acquire(&c->word);
  const uint64_t aux = load_relaxed(&c->aux0);
  const int origin = static_cast<int>(aux & 0xffffffffu);
  auto kind = static_cast<ProtocolError::Kind>(aux >> 32);
  std::string text = "(no message)";
  if (origin >= 0 && origin < cfg_.world) {
    const auto* h = reinterpret_cast<const SegmentHeader*>(heap_.base(origin));
    text.assign(h->error_text, strnlen(h->error_text, sizeof(h->error_text)));
    if (remote(origin)) text = "(on another host: see rank " + std::to_string(origin) + "'s own error)";
  }
  if (kind != ProtocolError::Kind::kTimeout && kind != ProtocolError::Kind::kMismatch) kind = ProtocolError::Kind::kPeerAbort;
  std::ostringstream os;
  os << "nvrar: rank " << cfg_.rank << ": aborted by rank " << origin << " (phase " << phase_name(site.phase)
     << ", step " << site.step << ", waiting for rank " << site.peer << ", epoch " << epoch << "); rank " << origin
     << " reported: " << text;
  failure_ = os.str();
  // Pass the same abort record on to the peers the origin may not have reached yet, before my
  // failed mark: a peer that sees the mark finds its abort cell set (NOTE [transfer windows]).
  for (int r = 0; r < cfg_.world; ++r) {
    if (r == cfg_.rank) continue;
    auto* pc = reinterpret_cast<Cell*>(heap_.base(r) + layout_.abort_cell());
    if (load_acquire(&pc->word) != 0) continue;
    store_relaxed(&pc->aux0, aux);
    store_release(&pc->word, word);
  }
  post_remote_aborts();
  quiesce(epoch);
  throw ProtocolError(kind, failure_, cfg_.rank, site.peer, site.phase, site.step, epoch, 0);
}

// On failure, before the exception reaches the user: mark that I take part in no round any
// more, then, if this round exposed my private buffers to cross-memory access, wait (bounded by
// kQuiesceMaxS) until no local peer's transfer window names me (NOTE [transfer windows]). Else a
// peer could still write into an output the user frees or reuses after catching the error. A peer
// that is merely late or stopped outside a window costs nothing here: it will see my mark.
void CpuExecutor::quiesce(uint64_t epoch) {
  auto* mine = reinterpret_cast<SegmentHeader*>(heap_.mine());
  store_release(&mine->failed_epoch, epoch);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (exposed_epoch_ != epoch) return;
  const uint64_t window = touch_word(epoch, cfg_.rank);
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(
                                           std::chrono::duration<double>(std::min(cfg_.timeout_s, kQuiesceMaxS)));
  for (int h = 0; h < where_.G; ++h) {
    if (h == where_.local) continue;
    const int peer = where_.rank_of(where_.node, h);
    const auto* ph = reinterpret_cast<const SegmentHeader*>(heap_.base(peer));
    const auto start = clock::now();
    auto next_liveness = start;
    while (load_acquire(&ph->touch) == window) {
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
