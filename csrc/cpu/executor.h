// The CPU executor: runs the NVRAR plan (protocol/plan.h) across processes on one host through
// the shared-memory symmetric heap (shm_heap.h). See NOTE [epoch protocol] in protocol/plan.h.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "../common/error.h"
#include "../protocol/plan.h"
#include "../protocol/types.h"
#include "reduce_kernels.h"
#include "shm_heap.h"

namespace nvrar {

// Algorithm variants; codes shared with Python (nvrar/selector.py). kAuto applies the
// communicator's one-shot threshold.
enum class Variant : int32_t { kAuto = 0, kTwoShot = 1, kOneShot = 2 };

inline const char* variant_name(Variant v) {
  switch (v) {
    case Variant::kAuto: return "auto";
    case Variant::kTwoShot: return "two-shot";
    case Variant::kOneShot: return "one-shot";
  }
  return "?";
}

struct CpuConfig {
  int rank = 0;
  int world = 1;
  int ranks_per_node = 1;
  size_t max_bytes = size_t{4} << 20;         // largest chunk one round reduces (bytes)
  size_t pool_bytes = size_t{16} << 20;       // zero-copy pool for Communicator.empty (bytes)
  size_t oneshot_max_bytes = size_t{64} << 10;  // kAuto picks one-shot up to this size (bytes)
  double timeout_s = 60.0;                    // deadline of every wait (seconds)
  double jitter_us = 0.0;                     // > 0: random delays up to this long (testing)
  uint64_t jitter_seed = 0;
};

class CpuExecutor {
 public:
  explicit CpuExecutor(const CpuConfig& cfg);
  ~CpuExecutor();

  // Bootstrap steps (see shm_heap.h): exchange segment_name(), attach(names), barrier, unlink().
  const std::string& segment_name() const { return heap_.name(); }
  void attach(const std::vector<std::string>& names);
  void unlink_segment() { heap_.unlink(); }

  // out = reduce(in) over all ranks. in == out is in place. `count` elements of `dtype`.
  void all_reduce(const void* in, void* out, size_t count, DType dtype, RedOp op, Variant variant);

  // The variant kAuto resolves to for a message of `bytes`.
  Variant resolve(Variant v, size_t bytes) const;

  char* pool_base() const { return heap_.mine() + layout_.pool_off; }
  size_t pool_bytes() const { return layout_.pool_bytes; }
  uint64_t epoch() const { return epoch_; }
  const CpuConfig& config() const { return cfg_; }
  const Layout& layout() const { return where_; }
  const SegmentLayout& segment_layout() const { return layout_; }
  bool failed() const { return !failure_.empty(); }
  const std::string& failure() const { return failure_; }
  void close();

 private:
  struct Site {
    Phase phase;
    int step;
    int peer;  // rank we wait for
  };

  void round(const char* in, char* out, size_t n, size_t elem_size, const char* in_pool, Variant v,
             uint32_t sig, ReduceFn fn, Scale sc);
  void round_two_shot(const char* in, char* out, size_t n, size_t es, const char* in_pool, uint64_t e,
                      uint32_t sig, ReduceFn fn, Scale sc);
  void round_one_shot(const char* in, char* out, size_t n, size_t es, uint64_t e, uint32_t sig, ReduceFn fn,
                      Scale sc);
  // Inter-node recursive doubling of `bytes` among the ranks with my local index, starting from
  // the accumulator at result(p). Returns the offset of the final result in my segment.
  size_t inter_node(size_t n, size_t es, uint64_t e, uint32_t sig, ReduceFn fn, Scale sc);

  void signal(int peer, size_t cell_off, uint64_t word, uint64_t aux);
  uint64_t wait(size_t cell_off, uint64_t epoch, uint32_t sig, const Site& site);
  [[noreturn]] void fail(ProtocolError::Kind kind, const std::string& what, const Site& site, uint64_t epoch,
                         uint64_t observed);
  [[noreturn]] void fail_from_abort(const Site& site, uint64_t epoch);
  bool peer_alive(int peer) const;
  std::string describe_call(int rank) const;
  void jitter();

  CpuConfig cfg_;
  Layout where_;
  SegmentLayout layout_;
  ShmHeap heap_;
  uint64_t epoch_ = 0;
  std::string failure_;
  std::mutex busy_;
  std::vector<uint64_t> peer_start_times_;  // 0 = liveness unknown for that peer
  std::vector<const char*> srcs_;           // reduce sources, one per local rank (no per-call allocation)
  uint64_t spin_iters_ = 0;                 // polls before a waiter starts yielding the core
  uint64_t rng_ = 0;
};

}  // namespace nvrar
