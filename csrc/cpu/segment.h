// The CPU executor's shared-memory segment as its peers see it: the header at its start, the
// flag cells and their call description, the transfer windows, the memory-order helpers, and the
// liveness check of a segment's owner. Shared by the executor (csrc/cpu/executor.cpp) and every
// rank that maps the segment; the byte layout of the rest is SegmentLayout (protocol/plan.h).
#pragma once

#include <cstddef>
#include <cstdint>

#include "../protocol/desc.h"
#include "../protocol/plan.h"
#include "shm_heap.h"

namespace nvrar {

constexpr size_t kSecretBytes = 16;  // the session secret every segment header carries
constexpr uint64_t kMagic = 0x314741455352564eull;  // "NVRSEAG1", little-endian
constexpr uint32_t kVersion = 2;
constexpr size_t kCellStride = 64;                   // one cache line per flag cell
constexpr int kAlgoPlanClasses = 32;                 // message size classes (log2 bytes) of SegmentHeader::algo_plan

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
  int32_t call_algorithm;
  int32_t pad;
  char error_text[2048];  // the message of this rank's failure, for the ranks it aborts
  // Appended fields (after error_text, so that the offsets above never move).
  uint64_t closed;        // != 0: the owner closed its communicator; it takes part in no round any more
  uint64_t touch;         // touch_word(epoch, target) while the owner transfers to or from a peer's
                          // private memory (NOTE [transfer windows]); 0 otherwise
  uint8_t secret[kSecretBytes];  // the session's secret (CpuConfig::secret): every attaching rank checks it
  uint64_t way_plan[64];  // a node leader's choice of way per shard size class, read by the node's
                          // other ranks (NOTE [cross-memory or staged], executor.cpp; way_word)
  uint64_t stage_plan[64];  // the same for one-shot stage-ins per message size class: 1 streaming
                            // stores, 0 plain (NOTE [streaming stage-in], executor.cpp)
  uint64_t algo_plan[kAlgoPlanClasses];  // the same for kAuto calls per message size class: 1 one-shot,
                                         // 0 two-shot (NOTE [one-shot or two-shot], executor.cpp)
  // NOTE [sharing a core] (executor.cpp): a line of their own, written rarely.
  alignas(64) uint32_t cpu;  // 1 + the CPU the owner last ran on while waiting (0: not known yet)
};
static_assert(sizeof(SegmentHeader) <= SegmentLayout::kPage, "segment header must fit in the header page");

// A way plan word (SegmentHeader::way_plan): calls numbered below `from` take way `before`, the
// others way `after` (1 cross-memory, 0 staged); 0 means no plan yet (cross-memory). The leader
// rewrites it at the end of its call j with from = j + 2 and `before` the way the old word gave
// call j + 1, so a rank reading the old or the new word during call j + 1 gets the same way.
inline uint64_t way_word(uint64_t from, int before, int after) {
  return (from << 3) | 4u | (static_cast<uint64_t>(before) << 1) | static_cast<uint64_t>(after);
}
inline int way_of(uint64_t word, uint64_t call) {
  if (word == 0) return 1;
  return static_cast<int>(call < (word >> 3) ? (word >> 1) & 1 : word & 1);
}
// The word the leader leaves after its call j decided `next` for the calls from j + 2 on: the old
// word itself where it already gives `next` from there (its `from` is at most j + 1), else a new
// one. Most calls decide what the word already says, so the leader stores it only when the
// decision changes: the word's line stays shared in every rank's cache instead of crossing between
// the cores on every call (a miss of each peer's call where a line takes ~500 ns to cross).
inline uint64_t next_way_word(uint64_t old, uint64_t j, int next) {
  if (old != 0 && way_of(old, j + 2) == next) return old;
  return way_word(j + 2, way_of(old, j + 1), next);
}

// NOTE [call description]
// The 16-bit signature of a flag word is a quick check only: two different calls can share it
// (count 100000 and 131409, float32 two-shot, do). So every flag cell also carries the sender's
// full call description (protocol/desc.h: count, dtype/op/algorithm code, elements of this
// round, row length), stored before the flag word with the same release, and every wait
// compares it with its own before it uses the peer's data or any offset or address the flag
// carries. LL packets (protocol/ll.h) carry only the 16-bit flag: their sender stores the
// description into the step's inter cell before the packets (and the flag word after them). The
// buffers a ready flag advertises are bounded by the round's bytes, and every cross-memory
// transfer is checked against them. The cell is one cache line: the receiver's miss on the flag
// word brings the description along, so the comparison costs four loads that hit.
struct Cell {
  uint64_t word;
  uint64_t aux0;   // ready: byte offset of the sender's input; final: offset of its final shard
  uint64_t aux1;   // ready: OutRef of the sender's output (protocol/plan.h)
  CallDesc desc;   // the sender's call and round (protocol/desc.h)
};
static_assert(sizeof(Cell) <= kCellStride, "a flag cell must fit its stride");

// NOTE [transfer windows]
// A rank that failed returns to its caller, who may free or reuse the buffers its ready flag
// exposed to cross-memory access. So every process_vm_readv/writev of a peer's private memory
// runs inside a window: the transferring rank stores touch_word(e, target) into its own header,
// fences, and only then checks that the target has not failed (its failed_epoch); the failing
// rank stores its failed_epoch, fences, and then waits until no local peer's window names it.
// Of two such sequences at least one sees the other's store (Dekker): either the transfer is
// refused, or the failing rank waits for its window to close. The wait is bounded (kQuiesceMaxS):
// only a peer stopped inside a window (a few microseconds per piece) can outlast it.
inline uint64_t touch_word(uint64_t epoch, int target) { return (epoch << 24) | static_cast<uint64_t>(target + 1); }

inline uint64_t load_acquire(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline uint64_t load_relaxed(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
inline void store_release(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
inline void store_relaxed(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }

// The description of a cell, word by word (relaxed: the flag word's release/acquire orders them).
inline void store_desc(CallDesc* d, const CallDesc& v) {
  store_relaxed(&d->count, v.count);
  store_relaxed(&d->code, v.code);
  store_relaxed(&d->n, v.n);
  store_relaxed(&d->shape, v.shape);
}
inline CallDesc load_desc(const CallDesc* d) {
  return CallDesc{load_relaxed(&d->count), load_relaxed(&d->code), load_relaxed(&d->n), load_relaxed(&d->shape)};
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// The start time of the process that owns the segment of `h`, where this process can verify it
// (/proc/<pid>/stat field 22 matches the header); 0 where it cannot (another pid namespace).
inline uint64_t owner_start_time(const SegmentHeader* h) {
  return h->start_time != 0 && proc_stat(h->pid).first == h->start_time ? h->start_time : 0;
}

// Whether the owner of the segment of `h` still runs: same start time as when we attached (not a
// reused pid) and not a zombie. `known` 0 (owner_start_time could not tell): the deadline decides.
inline bool owner_alive(const SegmentHeader* h, uint64_t known) {
  if (known == 0) return true;
  const auto st = proc_stat(h->pid);
  return st.first == known && st.second != 'Z' && st.second != 'X';
}

}  // namespace nvrar
