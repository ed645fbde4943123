// The CPU executor: runs the NVRAR plan (protocol/plan.h) across processes on one host through
// the shared-memory symmetric heap (shm_heap.h). See NOTE [epoch protocol] in protocol/plan.h.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../common/error.h"
#include "../protocol/epilogue.h"
#include "../protocol/call.h"
#include "../protocol/desc.h"
#include "../protocol/plan.h"
#include "../protocol/round.h"
#include "../protocol/types.h"
#include "fused.h"
#include "reduce_kernels.h"
#include "shm_heap.h"
#include "way_choice.h"

namespace nvrar {

class HostLink;  // csrc/cpu/host_link.h

// Every field is set by the caller: the defaults live in one place, Python's settings object
// (nvrar/settings.py), which passes each of them to the binding. Zero here means "not set" and
// fails the checks of the constructor where zero is not a valid value.
struct CpuConfig {
  int rank = 0;
  int world = 0;
  int ranks_per_node = 0;
  size_t max_bytes = 0;          // largest chunk one round reduces (bytes)
  size_t pool_bytes = 0;         // zero-copy pool for Communicator.empty (bytes)
  size_t oneshot_max_bytes = 0;  // kAuto picks one-shot up to this size (bytes)
  size_t oneshot_adapt_max_bytes = 0;  // NOTE [one-shot or two-shot]: kAuto calls above oneshot_max_bytes and
                                       // up to this size, in a job of one node, take the algorithm the node
                                       // leader finds faster by measured call times (0: never)
  double timeout_s = 0;          // deadline of every wait (seconds)
  double jitter_us = 0;          // > 0: random delays up to this long (testing)
  uint64_t jitter_seed = 0;
  bool cma = false;              // allow cross-memory reads/writes of peers' private buffers
  size_t cma_min_bytes = 0;      // smallest shard (bytes) moved by cross-memory reads/writes
  bool cma_adapt = false;        // above cma_min_bytes, choose cross-memory or staging by measured call times
  int stream_staging = -1;       // NOTE [streaming stage-in]: 1 one-shot stage-ins always stream, 0 never,
                                 // -1 the node leader chooses by measured call times
  bool cpu_spread = true;        // NOTE [moving apart]: a rank that shares its CPU with its peer may move
  size_t cma_piece_bytes = 0;    // cross-memory transfers go piece by piece, this large (bytes)
  size_t ll_max_bytes = 0;       // inter-node shards up to this size go as LL packets (bytes)
  size_t hd_min_bytes = 0;       // inter-node shards from this size use halving-doubling (0: never)
  std::string secret;            // kSecretBytes drawn by rank 0, the same on every rank
  std::string test_kill_at;      // testing: the NVRAR_TEST_KILL_AT point (test_kill_point), or ""
  bool test_algorithm_flip = false;  // testing: NOTE [one-shot or two-shot]'s leader decides the other
                                     // algorithm after every call (NVRAR_TEST_ALGORITHM_FLIP)
};

// The caller's hooks into a call's waits. `check` (may be null) is polled about every 50 ms so
// that the caller can handle signals: returns true when the call must stop, with the reason in
// *why (the Python bindings run the interpreter's signal handlers there; a handler that raised
// stops the call). `block` (may be null) is called when a wait stops spinning and starts giving
// the core away, before its first `check` (the bindings release the GIL there, so that a call
// whose peer is microseconds away never pays for it); it may be called more than once.
struct Interrupt {
  bool (*check)(void* ctx, std::string* why);
  void* ctx;
  void (*block)(void* ctx) = nullptr;
};

// Where a call's time goes (benchmarks/call_phases.py), summed over the calls since the last
// read; kept only while phase timing is on (off by default: one branch per phase when off).
struct PhaseTimes {
  uint64_t calls = 0;
  uint64_t call_ns = 0;    // CpuExecutor::all_reduce, entry to return
  uint64_t wait_ns = 0;    // waits for peers' flags (spin, yield, block)
  uint64_t reduce_ns = 0;  // reductions
  uint64_t copy_ns = 0;    // copies: stage-in, all-gather, puts through shared memory
  uint64_t cma_ns = 0;     // cross-memory reads and writes of local peers' private buffers
  uint64_t signal_ns = 0;  // flag stores into peers' cells
  uint64_t remote_ns = 0;  // puts to other hosts (issue and local completion)
};

class CpuExecutor {
 public:
  explicit CpuExecutor(const CpuConfig& cfg);
  ~CpuExecutor();

  // Bootstrap steps (see shm_heap.h): exchange segment_name(), attach(names), barrier, unlink().
  // Across hosts (NOTE [put-with-signal across hosts], transport.h), before attach: open_hosts
  // (host_of[r]: rank r's host index; returns my blob: header and UCX address), exchange the
  // blobs, connect_hosts(blobs), start_wireup(), wait_wired(), a barrier, stop_wireup(); the
  // names of ranks on other hosts are "" in attach.
  const std::string& segment_name() const { return heap_.name(); }
  std::string open_hosts(const std::string& libucp, const std::vector<int>& host_of, const std::string& net_device);
  void connect_hosts(const std::vector<std::string>& blobs);
  void start_wireup();
  std::string wait_wired(double timeout_s);
  void stop_wireup();
  std::string link_transports(int rank);
  // Testing the receiver's checks across hosts (tests/test_hosts.py): sends remote rank `rank`
  // the malformed message `what` names ("outside", "oversized", "beyond", "abort-data",
  // "two-puts": see executor.cpp); link_progress() progresses my link once; link_refused() is
  // how many messages my link refused; link_landings() how many data pieces it applied as they
  // arrived and how many landed in a zone (NOTE [landings], protocol/round.h).
  void debug_forge(int rank, const std::string& what);
  void link_progress();
  uint64_t link_refused() const;
  std::pair<uint64_t, uint64_t> link_landings() const;
  // Phase timing (PhaseTimes): on or off; take_phase_times() returns the sums and clears them.
  void set_phase_timing(bool on) { phase_timing_ = on; times_ = PhaseTimes{}; }
  PhaseTimes take_phase_times() {
    const PhaseTimes t = times_;
    times_ = PhaseTimes{};
    return t;
  }
  bool remote(int rank) const { return !remote_.empty() && remote_[static_cast<size_t>(rank)]; }
  void attach(const std::vector<std::string>& names);
  void unlink_segment() { heap_.unlink(); }
  // After the barrier that follows attach (every rank has mapped every segment): unlink my
  // segment and every peer's I mapped, so that a peer killed before its own unlink leaves nothing.
  void unlink_segments() {
    heap_.unlink();
    heap_.unlink_attached();
  }
  // Whether this rank can write into every peer's private memory (process_vm_writev). Every rank
  // must then call enable_cma with the AND over all ranks, so that all agree.
  bool probe_cma() const;
  void enable_cma(bool on);
  bool cma_enabled() const { return cma_on_; }

  // out = reduce(in) over all ranks. in == out is in place. `count` elements of `dtype`.
  // `intr` (may be null) is polled while the call waits; it must outlive the call.
  void all_reduce(const void* in, void* out, size_t count, DType dtype, RedOp op, Algorithm algorithm,
                  const Interrupt* intr = nullptr);

  // Fused all-reduce + residual add + RMSNorm, in place (csrc/cpu/fused.cpp, NOTE [fused add +
  // RMSNorm] in protocol/epilogue.h): x and residual are rows x h elements, weight h elements.
  void all_reduce_add_rms_norm(void* x, void* residual, const void* weight, size_t rows, size_t h, DType dtype,
                               float eps, Algorithm variant);

  // The variant kAuto resolves to for a message of `bytes` (where NOTE [one-shot or two-shot] decides,
  // the one the next such call takes).
  Algorithm resolve(Algorithm v, size_t bytes) const;

  char* pool_base() const { return heap_.mine() + layout_.pool_off; }
  size_t pool_bytes() const { return layout_.pool_bytes; }
  uint64_t epoch() const { return epoch_; }
  // Moves made by NOTE [moving apart] since construction.
  uint64_t cpu_moves() const { return spreads_.load(std::memory_order_relaxed); }
  // Calls whose two-shot shards went staged ([0]) or by cross-memory transfer ([1]) under NOTE
  // [cross-memory or staged]'s choice, since construction (calls it did not decide are not counted).
  std::pair<uint64_t, uint64_t> way_calls() const {
    return {way_calls_[0].load(std::memory_order_relaxed), way_calls_[1].load(std::memory_order_relaxed)};
  }
  // One-shot calls whose stage-in went with plain ([0]) or streaming ([1]) stores under NOTE
  // [streaming stage-in]'s choice, since construction (calls it did not decide are not counted).
  std::pair<uint64_t, uint64_t> stage_calls() const {
    return {stage_calls_[0].load(std::memory_order_relaxed), stage_calls_[1].load(std::memory_order_relaxed)};
  }
  // kAuto calls that NOTE [one-shot or two-shot]'s choice sent two-shot ([0]) or one-shot ([1]),
  // since construction (calls it did not decide are not counted).
  std::pair<uint64_t, uint64_t> algorithm_calls() const {
    return {algo_calls_[0].load(std::memory_order_relaxed), algo_calls_[1].load(std::memory_order_relaxed)};
  }
  // Bytes staged with streaming stores since construction.
  uint64_t streamed_bytes() const { return streamed_bytes_.load(std::memory_order_relaxed); }
  const CpuConfig& config() const { return cfg_; }
  const SegmentLayout& segment_layout() const { return layout_; }
  bool failed() const { return !failure_.empty(); }
  const std::string& failure() const { return failure_; }
  // Marks this rank closed in its segment, where peers see it (a call of theirs that waits for
  // this rank raises at once, naming it), and makes a call in flight on another thread raise.
  // The memory stays mapped until close(). Idempotent.
  void mark_closed();
  void close();

 private:
  friend struct CpuTransport;
  struct Site {
    Phase phase;
    int step;
    int peer;  // rank we wait for
  };

  // One protocol round (protocol/round.h) on n elements, epoch advanced.
  void round(const char* in, char* out, size_t n, size_t elem_size, bool in_pool, bool out_pool, Algorithm v,
             uint32_t sig, ReduceFn fn, Scale sc);

  // One round of the fused call (protocol/epilogue.h); scratch: a private rows x h buffer (one-shot).
  void fused_round(const FusedSlice& s, Algorithm v, uint32_t sig, ReduceFn fn, const RowEpilogue& epi, char* scratch);
  // Records this call in my segment header, for the other ranks' mismatch messages.
  void note_call(uint64_t count, DType dtype, int32_t op, Algorithm v, uint64_t h, float eps);

  void signal(int peer, size_t cell_off, uint64_t word, uint64_t aux0, uint64_t aux1);
  // Waits for the flag of round `epoch`; returns its aux words.
  std::pair<uint64_t, uint64_t> wait(size_t cell_off, uint64_t epoch, uint32_t sig, const Site& site);
  // Waits until every LL packet of `bytes` payload at my `off` carries this round's flag.
  void wait_ll(size_t off, size_t bytes, uint64_t epoch, uint32_t sig, const Site& site);
  // Polls `ready` (true: done) under the deadline, the abort cell and the peer's liveness;
  // `observed` names what was seen, for the timeout message. flag_wait: `ready` waits for a flag
  // of site.peer (the spin ends early where that peer shares my core: NOTE [sharing a core]).
  // How a waiter gives its core away after the spin, given how long it has waited (NOTE
  // [waiting]): sched_yield, then sleeps. A wait for another host blocks on the link's event
  // instead once it has yielded a while (transport.h).
  struct Yield {
    void operator()(uint64_t waited_ns) const;
  };
  template <typename Ready, typename Observed, typename Idle = Yield>
  void spin_until(Ready ready, Observed observed, const Site& site, uint64_t epoch, Idle idle = Idle{},
                  bool flag_wait = false);
  void cma_transfer(bool write, int peer, void* local, uint64_t remote, size_t bytes, const Site& site, uint64_t epoch);
  [[noreturn]] void fail(ProtocolError::Kind kind, const std::string& what, const Site& site, uint64_t epoch,
                         uint64_t observed);
  [[noreturn]] void fail_from_abort(const Site& site, uint64_t epoch);
  void quiesce(uint64_t epoch);
  // NOTE [sharing a core] (executor.cpp): my CPU, published in my header where it changed; and
  // whether local peer `peer` last published the same.
  int publish_cpu();
  bool shares_my_core(int peer, int my_cpu) const;
  // NOTE [moving apart] (executor.cpp): at the start of a call, publishes my CPU; after
  // kSpreadAfter flag waits in a row found their peer on my CPU, the higher rank of the pair
  // moves itself to a CPU of its mask that no rank of this host published, and restores its mask.
  void start_call_placement() {
    if (spin_polls_ != UINT64_MAX) return;
    publish_cpu();
    if (shared_waits_ >= kSpreadAfter) spread_if_sharing();
  }
  void spread_if_sharing();
  // NOTE [one-shot or two-shot] (executor.cpp): the algorithm of kAuto call number `call` on `bytes`
  // bytes, and its size class in *cls; kAuto (and -1) where the leader's choice does not apply.
  Algorithm chosen_algorithm(size_t bytes, uint64_t call, int* cls) const;
  static constexpr uint32_t kSpreadAfter = 16;  // waits in a row that found the peer on my CPU
  bool peer_alive(int peer) const;
  // Across hosts: the abort records just stored into the images of remote ranks' cells, sent.
  void post_remote_aborts();
  // The inter-node step whose put carries the flag of `cell` (for error messages).
  int inter_step_of(size_t cell) const;
  // Whether a message from another host may write [dst_off, dst_off + bytes) and the cell at
  // cell_off of my segment: an inter-node zone and its step's cell, or the abort cell alone.
  static bool accept_remote_write(void* self, size_t dst_off, size_t bytes, size_t cell_off);
  // "all_reduce(count=..., dtype=..., op=..., algorithm=...)" (or the fused call's, with h and eps) from a
  // call description (count, code, shape).
  static std::string describe_call(uint64_t count, uint64_t code, uint64_t shape);
  // "rank R called all_reduce(...) but rank P called all_reduce(...)", from the description in
  // the flag cell at cell_off (written by the peer with its flag).
  std::string mismatch(int peer, size_t cell_off) const;
  // Whether the description in the flag cell at cell_off is this rank's current call and round.
  bool same_call(size_t cell_off) const;
  // The flag cell that carries the call description of the LL packets landing at `ll_off`.
  size_t ll_desc_cell(size_t ll_off) const;
  // After a ready flag from local peer `peer`: checks that the buffers it advertises lie within
  // its segment (shm) and records them (cross-memory), to bound every remote read and write.
  void record_advertised(int peer, size_t cell_off, const Site& site, uint64_t epoch);
  void check_remote_range(bool write, int peer, uint64_t addr, size_t bytes, const Site& site, uint64_t epoch);
  void jitter();

  CpuConfig cfg_;
  Layout where_;
  SegmentLayout layout_;
  ShmHeap heap_;
  uint64_t epoch_ = 0;
  std::string failure_;
  std::mutex busy_;
  std::vector<uint64_t> peer_start_times_;  // 0 = liveness unknown for that peer
  uint32_t shared_waits_ = 0;               // NOTE [moving apart]: flag waits in a row that found their peer on my CPU
  int shared_with_ = -1;                    // the peer the last of them waited for
  std::chrono::steady_clock::time_point last_spread_{};
  std::atomic<uint64_t> spreads_{0};        // moves made (stats; read by other threads)
  std::atomic<uint64_t> way_calls_[2] = {};  // calls per way (stats; read by other threads)
  std::atomic<uint64_t> stage_calls_[2] = {};  // one-shot calls per store kind (stats; read by other threads)
  std::atomic<uint64_t> algo_calls_[2] = {};   // kAuto calls per chosen algorithm (stats; read by other threads)
  std::atomic<uint64_t> streamed_bytes_{0};  // bytes staged with streaming stores (stats)
  bool stream_ = false;                     // this call's stage-in uses streaming stores (NOTE [streaming stage-in])
  std::vector<const char*> srcs_;           // reduce sources, one per local rank (no per-call allocation)
  std::vector<char*> dsts_;                 // reduce destinations (my output, pushed peers' outputs, my slot)
  std::vector<char*> piece_dsts_;           // the same, advanced to the current piece
  std::vector<const char*> piece_srcs_;     // sources of the current piece (scratch for remote ones)
  std::vector<uint64_t> src_remote_;        // per local rank: address of its shard in its private memory, or 0
  std::vector<uint64_t> peer_out_;          // per local rank: how it wants its result delivered (OutRef)
  std::vector<char> cma_scratch_;           // private landing space of cross-memory reads (G-1 shards)
  uint64_t exposed_epoch_ = 0;              // last round whose ready flags exposed my private buffers
  Workspace ws_{};                          // views of the vectors above, for protocol/round.h
  RoundConfig round_cfg_{};
  CallLimits limits_{};                     // what the configuration fixes for every call (protocol/call.h)
  uint64_t spin_polls_ = 0;                 // polls at most before a waiter starts yielding the core
  // NOTE [cross-memory or staged] (executor.cpp): the choice per size class (log2 of the shard;
  // way_choice.h), a node leader's.
  WayChoice ways_[64];
  // NOTE [streaming stage-in] (executor.cpp): the choice per size class (log2 of the message).
  WayChoice stage_ways_[64];
  // NOTE [one-shot or two-shot] (executor.cpp): the choice per message size class, a node leader's.
  WayChoice algo_ways_[kAlgoPlanClasses];
  // all_reduce calls made (with data, world > 1): the same count on every rank. Atomic for resolve(),
  // which another thread may call during a call.
  std::atomic<uint64_t> calls_{0};
  bool cma_on_ = false;                     // cross-memory access enabled (enable_cma)
  uint64_t born_fork_gen_ = 0;              // fork generation of the creating process (executor.cpp)
  // The plan of the last call, reused while the next call has the same arguments (it depends on
  // nothing else: limits_ are fixed at construction).
  struct PlanKey {
    const void* in;
    const void* out;
    size_t count;
    DType dtype;
    RedOp op;
    Algorithm algorithm;
    bool operator==(const PlanKey& o) const {
      return in == o.in && out == o.out && count == o.count && dtype == o.dtype && op == o.op &&
             algorithm == o.algorithm;
    }
  };
  PlanKey last_key_{nullptr, nullptr, 0, DType::kFloat32, RedOp::kSum, Algorithm::kAuto};
  CallPlan last_plan_{};
  ReduceFn last_fn_ = nullptr;
  uint64_t rng_ = 0;
  bool phase_timing_ = false;
  PhaseTimes times_{};
  std::atomic<bool> closing_{false};        // close() asks a call in flight on another thread to stop
  // The call and round in flight (protocol/desc.h: count, code, elements of the round, row
  // length of a fused call), carried by every flag I send and compared with every flag I
  // receive (NOTE [call description], segment.h).
  CallDesc desc_{};
  std::vector<std::pair<size_t, size_t>> in_zone_;  // CpuTransport::wait_land's scratch (NOTE [landings])
  const Interrupt* intr_ = nullptr;         // the caller's interrupt hook, during a call
  std::vector<uint64_t> adv_in_;            // per local rank: private input address it advertised (cma), or 0
  std::vector<uint64_t> adv_out_;           // per local rank: private output address it advertised (cma), or 0
  std::vector<uint64_t> adv_bytes_;         // per local rank: bytes of the round it advertised
  std::vector<char> fused_scratch_;         // one-shot sums of the fused call
  // Across hosts: the link (null on one host), which ranks it reaches, and per remote rank the
  // local image of its header and cells (base(r) of a remote rank points there).
  std::unique_ptr<HostLink> link_;
  std::vector<bool> remote_;
  std::vector<std::vector<uint64_t>> images_;
};

}  // namespace nvrar
