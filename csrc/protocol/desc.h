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
// How it travels, by the path the flag takes:
//   in-memory cell (CPU shared memory, GPU peer pointer): the four words are stored (relaxed) into
//     the cell, then the flag word with a release; the receiver's acquire of the flag orders them.
//   put-with-signal to a remote node (NVSHMEM, UCX): the 32 bytes travel in front of the step's
//     data in the same put (the destination slot reserves kDescBytes before its data), and the
//     signal after it; the signal's delivery implies the description's. No extra message.
//   LL packets: the description is the first kDescLLPackets packets of the step's stream, each
//     carrying the step's flag like any data packet; the receiver checks them before it unpacks
//     the data. One network latency still, kDescLLPackets * 8 more bytes on the wire.
struct CallDesc {
  uint64_t count;
  uint64_t code;
  uint64_t n;
  uint64_t shape;
};
static_assert(sizeof(CallDesc) == 32, "the call description is four 64-bit words");

constexpr unsigned kDescWords = 4;
constexpr unsigned kDescBytes = sizeof(CallDesc);
constexpr unsigned kDescLLPackets = kDescBytes / 4;  // 4 payload bytes per LL packet (ll.h)

NVRAR_HD bool desc_equal(const CallDesc& a, const CallDesc& b) {
  return a.count == b.count && a.code == b.code && a.n == b.n && a.shape == b.shape;
}

}  // namespace nvrar
