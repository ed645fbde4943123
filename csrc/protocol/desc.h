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
// How it travels, by the path the flag takes (no path adds a round trip; on the GPU counted by
// the wire ledger: 0 fences, quiets, signal operations and remote atomics per inter-node step,
// tests/test_wire_budget.py):
//   in-memory cell (CPU shared memory, GPU peer store over NVLink): the four words are stored
//     (relaxed) into the cell's words 3..6 (after the flag word and two aux words), then the flag
//     word with a release; the receiver's acquire of the flag orders them.
//   across nodes on the GPU (csrc/cuda/device.cuh, NOTE [gpu call description]): inside the
//     step's own message. Put-with-signal: a trailer of six words (the description, the
//     step's flag word, the sender's rank) right behind the data, sent in the same put, whose signal NVSHMEM
//     delivers after all of its bytes; LL: eight leading packets of the step's packet stream
//     carry the four words, 4 bytes each under the packets' flag. The receiver compares them
//     once the signal, or the packets, arrived, before it touches the data (in a channel of
//     gathered slices each part carries its own; a part after the channel's last non-empty one
//     is not sent and its block checks none, NOTE [channels]). No extra operation,
//     no fence, no round trip; 48 (put) or 64 (LL) more bytes per message. The GPU's segment
//     reserves kGpuDescRoom bytes behind every zone and LL zone slice for it (desc_room of
//     SegmentLayout; 0 on the CPU, whose layout is unchanged).
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
// The trailer of a put-with-signal message across nodes on the GPU: the description, the step's
// flag word (so that a trailer left from an older round never passes for this one), then the
// sender's rank (so that bytes a partner echoes back never pass for its own trailer).
constexpr unsigned kTrailerWords = kDescWords + 2;
constexpr unsigned kTrailerBytes = kTrailerWords * 8;
// Packets of an LL stream that carry the description (4 payload bytes each), ahead of the data.
constexpr unsigned kDescPackets = 2 * kDescWords;
// Room behind a slice's data in the GPU's zones and LL zones: the trailer after the data's last
// byte rounded up to 8 bytes (<= 7 + 48), or the description packets' payload (32 bytes).
constexpr unsigned kGpuDescRoom = 64;

NVRAR_HD bool desc_equal(const CallDesc& a, const CallDesc& b) {
  return a.count == b.count && a.code == b.code && a.n == b.n && a.shape == b.shape;
}

}  // namespace nvrar
