// The call description every flag of a round carries: one format for both executors and for
// every way a flag travels (a shared-memory cell, an NVLink peer store, a put-with-signal across
// nodes, an LL packet stream). Pure code, host and device.
#pragma once

#include <cstdint>

#include "../common/hd.h"

namespace nvrar {

// NOTE [call description]
// The 16-bit signature of a flag word (plan.h) is a quick check only: two different calls can
// share it (count 100000 and 131409, float32 two-shot, do). So every flag also carries the
// sender's full call description, and every receiver compares it with its own before it uses
// any of the sender's data, or any offset or address the flag carries.
//
// The description is four 64-bit words, 32 bytes, 8-byte aligned:
//   count  the call's element count
//   code   dtype | op << 8 | algorithm << 16 (call_code, call.h); a fused call's op byte is
//          kFusedOpCode and the bits of its eps ride in bits 32..63
//   n      the elements of this round (chunk)
//   shape  the row length h of a fused call (all_reduce_add_rms_norm), else 0
// Two descriptions are equal when all four words are.
//
// How it travels, by the path the flag takes (no path adds a round trip):
//   in-memory cell (CPU shared memory, GPU peer store over NVLink): the four words are stored
//     (relaxed) into the cell's words 3..6 (after the flag word and two aux words), then the flag
//     word with a release; the receiver's acquire of the flag orders them.
//   across nodes on the GPU (csrc/cuda/device.cuh, NOTE [gpu call description]): before a step's
//     data the sender writes the four words into words 3..6 of the receiver's inter cell of that
//     step (an LL step uses the inter cell of its parity, slot and slice as well): four
//     nvshmemx_signal_op SETs (value puts, no source buffer), then nvshmem_fence, then the data
//     put-with-signal or the LL packets; with nvshmem_ptr reaching the peer (direct mode), plain
//     stores and __threadfence_system instead. The receiver compares them once the flag, or every
//     LL packet, arrived, before it touches the data. Four more small operations per step, and
//     the fence, whose cost depends on the transport (an ordering point on a proxy transport).
//     The zones and LL zones of SegmentLayout are unchanged.
//   across hosts on the CPU (csrc/cpu/ucx.cpp): one active message carries the step's data, then
//     the cell image (flag word, aux words, description); the receiver copies the data, then the
//     cell's words with the description, then stores the flag word with a release.
struct CallDesc {
  uint64_t count;
  uint64_t code;
  uint64_t n;
  uint64_t shape;
};
static_assert(sizeof(CallDesc) == 32, "the call description is four 64-bit words");

constexpr unsigned kDescWords = 4;
constexpr unsigned kDescBytes = sizeof(CallDesc);

NVRAR_HD bool desc_equal(const CallDesc& a, const CallDesc& b) {
  return a.count == b.count && a.code == b.code && a.n == b.n && a.shape == b.shape;
}

}  // namespace nvrar
