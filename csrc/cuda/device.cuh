// Device side of the GPU executor: the NVSHMEM transport that runs protocol/round.h inside one
// CUDA block per slice, written against the device primitives of prim.cuh (GPU or emulation);
// the parameters, the device state and the error record are in params.h.
// NOTE [epoch protocol] (protocol/plan.h) holds for every slice; NOTE [gpu deadlines] below.
#pragma once

#include <cstdint>

#include "../common/error.h"
#include "../protocol/desc.h"
#include "../protocol/ll.h"
#include "../protocol/phase.h"
#include "../protocol/plan.h"
#include "../protocol/round.h"
#include "../protocol/slice.h"
#include "../protocol/types.h"
#include "params.h"
#include "prim.cuh"

namespace nvrar {
namespace gpu {

// Largest ranks per node the kernel's shared workspace holds (an NVL72 domain fits).
constexpr int kMaxLocal = 72;
// Most threads per block the kernel is compiled for (__launch_bounds__): it keeps the kernel at
// 128 registers, so that 512 threads fit an SM on sm_80 and sm_90.
constexpr int kMaxThreads = 512;

// Packets [0, m) of a quad at p: two 16-byte stores where p is aligned and the quad whole.
__device__ __forceinline__ void st_quad(uint64_t* p, const uint64_t (&pk)[kLLQuad], size_t m) {
  if (m == kLLQuad && (reinterpret_cast<size_t>(p) & 15) == 0) {
    st_relaxed_sys_v2(p, pk[0], pk[1]);
    st_relaxed_sys_v2(p + 2, pk[2], pk[3]);
    return;
  }
  for (size_t k = 0; k < m; ++k) st_relaxed_sys(p + k, pk[k]);
}

// NOTE [gpu call description]: every flag cell (ready, final, inter: 64 bytes) holds, like the CPU
// executor's cells (csrc/cpu/segment.h), the flag word, two aux words and then the sender's
// CallDesc (protocol/desc.h) at word kCellDesc. In node (a peer's store over NVLink) the four
// words are stored before the flag word's release, and compared after the flag's acquire.
// Across nodes the description travels inside the step's own message, so that it costs no
// operation, no fence and no round trip of its own:
//   put-with-signal: the sender writes a trailer (the four words, the step's flag word, its rank)
//     into its own source slice right behind the data (at the data's end rounded up to 8 bytes:
//     the slice has kGpuDescRoom bytes of room, SegmentLayout::desc_room) and puts data and
//     trailer in ONE nvshmemx_putmem_signal_nbi_block; NVSHMEM delivers the signal after every
//     byte of that put. The receiver, once the signal arrived (and nvshmem_uint64_wait_until's
//     consistency step), reads the trailer at its own expected place (the zone of the step, at
//     its expected shard size: set_inter_bytes) and compares all six words: another call's
//     description, another shard size (the trailer is elsewhere: what is read there is an older
//     round's, whose flag word differs, or bytes the partner received from another rank and
//     sends on, whose rank word differs) or an older round all fail with kMismatch.
//   LL: packets 0..7 of the step's stream carry the four words (low, high halves) under the
//     packets' usual flag; the data's packets follow (the LL zone has room for them). The
//     receiver waits for the eight first and compares them (a mismatch is named as such even
//     where the other call sends fewer packets), then waits for the data's packets; it zeroes
//     all of them when it unpacks (NOTE [LL zones]).
// A mismatch fails with kMismatch and aborts every rank, before any of the sender's data or
// offsets is used.
constexpr int kCellDesc = 3;

// NOTE [channels]
// Across nodes a chunk's B slices (one per block) would each send their own message per step:
// B messages per peer per step, each a proxy command on proxy transports. Instead the slices are
// gathered into C = KernelParams::channels channel messages (C < B; C >= B keeps one per block):
// channel c holds the consecutive blocks [ceil(cB/C), ceil((c+1)B/C)). The call's slots put
// the slices' parts at a stride of the call's largest message (launch_params.h, call_strides),
// so a channel's parts are contiguous: [data of b0][trailer] ... [data of b1-1][trailer].
//   send: a block writes its part (and trailer, or packs its LL stream, zero-padded to the
//     stride), fences (gpu scope), and counts itself in on the channel's counter of (parity,
//     slot) with a relaxed atomicAdd; the block that brings the count to the channel's size is
//     the last: it fences again (acquiring every part), resets the counter and puts the whole
//     channel in ONE put-with-signal (flag: the inter cell of block b0) or one LL put. No block
//     ever waits for another block of its own PE: the others go on to their receive.
//   receive: every block waits on its channel's flag (the cell of b0) or, LL, on its own
//     packets, then checks its own trailer or description packets (NOTE [gpu call description]).
//   the wire ends with the part of the channel's last block whose message is not empty
//     (ch_wire_last; b0 when all are empty: its trailer or description packets still go). A
//     call smaller than a chunk has empty slices at the chunk's end; their strides used to ride
//     in the message (2x8 2 MB bf16: 1,836,016 bytes per PE across nodes, the floor 262,144).
//     A block after ch_wire_last writes no part and checks none (it waits for the flag, LL: for
//     nothing); the description is compared by b0 and every block up to ch_wire_last, so a
//     mismatched call is still caught in every channel: a receiver that counts a part the
//     sender did not send finds a stale trailer (an older round's flag word) or no packets.
//   LL with nvshmem_ptr reaching the peer (direct stores) has no messages: no gathering.
// The counter of (parity, slot, channel) is used again in round e + 2 only after its reset: a
// block counts itself in there only after its round e + 1 passed an inter-node step, which
// needed data that the partner's channel sent after my channel's round-e message, which the
// resetting block sent after the reset.
// Residency: a channel's step-s message needs every block of the channel to have finished step
// s - 1, and every block waits for the partner's channel message, which needs the partner's
// blocks of that channel: so progress needs every block of a channel resident at once. A launch
// with gathering (C < B) is therefore cooperative (allreduce_inst.cu: every block resident or
// the launch fails; it can be captured in a CUDA graph), NOTE [epoch protocol].
// Counters: 32-bit, in the GPU segment's header page (unused by the GPU otherwise; zeroed at
// setup), at kChanCountersOff, index (parity * S + slot) * kMaxChannels + channel.
constexpr size_t kChanCountersOff = 512;

// Per-block workspace of protocol/round.h, in shared memory.
struct SharedWs {
  const char* srcs[kMaxLocal];
  const char* piece_srcs[kMaxLocal];
  char* dsts[kMaxLocal + 1];
  char* piece_dsts[kMaxLocal + 1];
  uint64_t peer_out[kMaxLocal];
  uint64_t src_remote[kMaxLocal];
  uint64_t aux0;
  uint64_t aux1;
  int ok;
  int last;  // this block sends its channel's message (NOTE [channels])
};

// The Transport concept of protocol/round.h for one CUDA block. T, Op: the element type and
// reduction of this kernel instance.
template <typename T, typename Op>
struct GpuTransport {
  const KernelParams& kp;  // the __grid_constant__ kernel parameter: no per-thread copy
  SharedWs& sh;
  // The call description of the round in flight (protocol/desc.h), set by the kernel per chunk:
  // every in-node flag cell carries it, every wait on one compares it (NOTE [gpu call description]).
  CallDesc desc{};
  // Whether the block may have touched global memory since the last signal's fence. Every thread
  // of the block makes the same sequence of transport calls, so every thread's copy holds the same
  // value, and a __syncthreads guarded by it is reached by all or none.
  bool dirty = true;

  static constexpr int kVec = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte vector

  __device__ char* my() const { return kp.my; }
  __device__ char* base(int rank) const { return kp.peers[rank - kp.cfg.where.node * kp.cfg.where.G]; }
  __device__ bool leader() const { return threadIdx.x == 0; }
  __device__ void sync() const { __syncthreads(); }

  // My channel (NOTE [channels]): blocks [ch_first, ch_end); gathered: it has other blocks than
  // mine. In the chunk in flight its message ends with the part of block ch_wire_last (the last
  // with a non-empty inter-node message, else ch_first), of ch_last_bytes data bytes.
  int ch = 0, ch_first = 0, ch_end = 1, ch_wire_last = 0;
  bool gathered = false;
  size_t ch_last_bytes = 0;
  // Whether my part is in my channel's message (a block after ch_wire_last has an empty one,
  // neither sent nor checked: NOTE [channels]).
  __device__ bool in_wire() const { return !gathered || static_cast<int>(blockIdx.x) <= ch_wire_last; }
  __device__ void set_channel(int channels, int B, int b) {
    const int C = clamp_channels(channels);
    gathered = C < B;  // (the launch is then cooperative: params.h cooperative_launch)
    if (!gathered) {
      ch = b;
      ch_first = b;
      ch_end = b + 1;
      return;
    }
    ch = b * C / B;
    ch_first = (ch * B + C - 1) / C;
    ch_end = ((ch + 1) * B + C - 1) / C;
  }

  // My channel's counter of the slot with index `slot` (parity * S + slot, plan.h).
  __device__ unsigned* chan_counter(size_t slot) const {
    return reinterpret_cast<unsigned*>(kp.my + kChanCountersOff) + slot * kMaxChannels + ch;
  }

  // Every thread: count my slice in on the channel counter at `counter` (my part is written);
  // true for the block that sends the channel's message.
  __device__ bool chan_arrive(unsigned* counter) {
    __syncthreads();  // the block's part is written
    if (threadIdx.x == 0) {
      __threadfence();  // releases my part (with the relaxed count below)
      const unsigned prev = atomicAdd(counter, 1u);
      const bool last = prev == static_cast<unsigned>(ch_end - ch_first) - 1;
      if (last) {
        __threadfence();  // acquires every block's part
        atomicExch(counter, 0u);
      }
      sh.last = last ? 1 : 0;
    }
    __syncthreads();
    const bool last = sh.last != 0;
    __syncthreads();  // nobody overwrites sh.last before everyone read it
    return last;
  }

  // The bytes of this slice's inter-node messages in the round in flight (the shard, or the whole
  // slice for one-shot): where a put-with-signal's trailer lies (NOTE [gpu call description]).
  // protocol/round.h sets it before the inter-node steps.
  size_t inter_bytes = 0;
  __device__ void set_inter_bytes(size_t bytes) { inter_bytes = bytes; }

  // Where the trailer of a put of `bytes` data bytes starting at `data` lies.
  __device__ static uint64_t* trailer_of(char* data, size_t bytes) {
    return reinterpret_cast<uint64_t*>(data + align_up(bytes, 8));
  }

  // The zone that the inter cell at `cell` flags (same parity, slot and slice: plan.h).
  __device__ size_t inter_zone(size_t cell) const {
    const SegmentLayout& L = kp.cfg.L;
    const size_t idx = (cell - L.inter_cell(0, 0, 0)) / L.cell_stride;
    const size_t per_parity = static_cast<size_t>(L.S) * static_cast<size_t>(L.B);
    const int parity = static_cast<int>(idx / per_parity);
    const int slot = static_cast<int>(idx % per_parity / static_cast<size_t>(L.B));
    const int b = static_cast<int>(idx % static_cast<size_t>(L.B));
    return L.zone(parity, slot, b);
  }

  // Leader only: whether the description words of my cell at `cell` are this block's description.
  __device__ bool desc_matches(size_t cell) const {
    const uint64_t* c = reinterpret_cast<const uint64_t*>(kp.my + cell);
    const CallDesc theirs{ld_relaxed_sys(c + kCellDesc + 0), ld_relaxed_sys(c + kCellDesc + 1),
                          ld_relaxed_sys(c + kCellDesc + 2), ld_relaxed_sys(c + kCellDesc + 3)};
    return desc_equal(theirs, desc);
  }

  // What a call mismatch records beside its kind (ErrorRecord::detail, got, want).
  struct Mismatch {
    uint32_t detail = 0;
    uint64_t got = 0, want = 0;
  };
  // Leader only, after a mismatch: the first of `n` words at `w` (each masked with `mask`) that
  // differs from `mine`.
  __device__ static Mismatch mismatch_at(uint32_t detail, const uint64_t* w, const uint64_t* mine, int n,
                                         uint64_t mask = ~uint64_t{0}) {
    Mismatch m;
    m.detail = detail | (0xffu << 8);  // (no word differs on a second reading)
    for (int k = 0; k < n; ++k) {
      const uint64_t got = ld_relaxed_sys(w + k) & mask;
      if (got != mine[k]) {
        m.detail = detail | (static_cast<uint32_t>(k) << 8);
        m.got = got;
        m.want = mine[k];
        break;
      }
    }
    return m;
  }

  // Leader only: whether the trailer of the put flagged in the inter cell `cell` holds this
  // block's description, the round's flag word `word` and the rank `peer`.
  __device__ bool trailer_matches(size_t cell, uint64_t word, int peer) const {
    const uint64_t* t = trailer_of(kp.my + inter_zone(cell), inter_bytes);
    const CallDesc theirs{ld_relaxed_sys(t + 0), ld_relaxed_sys(t + 1), ld_relaxed_sys(t + 2), ld_relaxed_sys(t + 3)};
    return desc_equal(theirs, desc) && ld_relaxed_sys(t + kDescWords) == word &&
           ld_relaxed_sys(t + kDescWords + 1) == static_cast<uint64_t>(peer);
  }

  // round.h signals the G-1 local peers one after the other; each flag is stored by its own lane
  // (lane i: the i-th peer after me), so the G-1 stores go out in parallel, each thread issuing
  // one system-scope release store per phase, not one thread G-1 back to back (each waiting for
  // the previous one's acknowledgement over NVLink). The first signal of a phase waits for the
  // block (its writes are done: the barrier orders them before every lane's release, which is
  // cumulative); no barrier between the signals (nothing is written in between).
  __device__ int signal_lane(int rank) const {
    const Layout& w = kp.cfg.where;
    return ((rank - w.rank + w.G) % w.G - 1) % static_cast<int>(blockDim.x);
  }
  __device__ void signal(int rank, size_t cell, uint64_t word, uint64_t aux0, uint64_t aux1) {
    if (dirty) {
      __syncthreads();  // the block's writes of this phase are done
      dirty = false;
    }
    if (static_cast<int>(threadIdx.x) == signal_lane(rank)) {
      uint64_t* c = reinterpret_cast<uint64_t*>(base(rank) + cell);
      st_relaxed_sys(c + 1, aux0);
      st_relaxed_sys(c + 2, aux1);
      st_relaxed_sys(c + kCellDesc + 0, desc.count);
      st_relaxed_sys(c + kCellDesc + 1, desc.code);
      st_relaxed_sys(c + kCellDesc + 2, desc.n);
      st_relaxed_sys(c + kCellDesc + 3, desc.shape);
      st_release_sys(c, word);
    }
  }

  // Leader only: the first failure of this rank wins the record. The claim is an atomicCAS in
  // device memory (atomic among this GPU's blocks); the winner alone writes the host-mapped
  // record: `code` first, the fields, then `published`.
  __device__ void record(ProtocolErrorKindCode kind, Phase phase, int step, int peer, uint64_t epoch, uint64_t observed,
                         int origin, const Mismatch& mm = Mismatch{}) {
    if (atomicCAS(&kp.state->err_claim, 0ull, static_cast<unsigned long long>(kind)) == 0ull) {
      st_volatile(&kp.err->code, static_cast<unsigned long long>(kind));
      kp.err->phase = static_cast<uint32_t>(phase);
      kp.err->peer = peer;
      kp.err->step = step;
      kp.err->origin = origin;
      kp.err->epoch = epoch;
      kp.err->observed = observed;
      kp.err->detail = mm.detail;
      kp.err->got = mm.got;
      kp.err->want = mm.want;
      __threadfence_system();
      st_volatile(&kp.err->published, 1ull);
    }
  }

  // The abort word: one 64-bit word that says all an abort says (NOTE [gpu deadlines]): bit 63
  // set, the kind of the failure in bits 32..62, the origin (the rank that failed first) in bits
  // 0..31. One store or one signal carries it whole: nothing has to be ordered before it.
  static constexpr uint64_t kAbortBit = uint64_t{1} << 63;
  __device__ static uint64_t abort_word(ProtocolErrorKindCode kind, int origin) {
    return kAbortBit | (static_cast<uint64_t>(kind & 0x7fffffffu) << 32) | static_cast<uint32_t>(origin);
  }

  // Leader only: record the first failure of this rank and abort every rank (NOTE [gpu deadlines]):
  // one release store per local rank, one signal per remote PE; no fence, no quiet, no wait on
  // any completion (a dead peer NIC cannot hold the way out).
  __device__ void fail(ProtocolErrorKindCode kind, Phase phase, int step, int peer, uint64_t epoch, uint64_t observed,
                       int origin, const Mismatch& mm = Mismatch{}) {
    record(kind, phase, step, peer, epoch, observed, origin, mm);
    const Layout& w = kp.cfg.where;
    const size_t abort_off = kp.cfg.L.abort_cell();
    const uint64_t word = abort_word(kind, origin);
    for (int r = 0; r < w.world; ++r) {
      if (r / w.G == w.node)
        st_release_sys(reinterpret_cast<uint64_t*>(base(r) + abort_off), word);
      else
        nvshmemx_signal_op(reinterpret_cast<uint64_t*>(kp.my + abort_off), word, NVSHMEM_SIGNAL_SET, r);
    }
  }

  // NOTE [loud after failure]: a kernel of a communicator that failed (this rank recorded a
  // failure, or another rank's abort arrived) runs no round: the slots' state after the failed
  // round is unknown (a put of that round may still land), NOTE [epoch protocol]. It records the
  // abort if it was not recorded yet. A CUDA-graph replay, with no nvrar host code around it, then
  // traps (device_trap), so that the replay ends with an error that every later CUDA call of the
  // process reports instead of decoding on stale data. An eager launch returns instead
  // (KernelParams::eager): its host raises the recorded failure at the next call or check(). The
  // host raises a failure it already sees before it launches, but an abort that lands between that
  // check and the kernel's start reaches the kernel: a trap there would leave the context unusable
  // for the rest of the process and, under MPS, end the work of every process sharing the GPU (on
  // the H200, 2026-12-04, one such trap turned the other PEs' pending calls into 'unspecified
  // launch failure'). Every thread of the block: true (after the block agreed) where the kernel
  // must stop.
  __device__ bool failed_before(uint64_t e0) {
    if (threadIdx.x == 0) {
      const bool mine = ld_volatile(&kp.state->err_claim) != 0;
      sh.ok = mine || aborted(Phase::kSetup, 0, -1, e0) ? 0 : 1;
    }
    __syncthreads();
    const bool failed = sh.ok == 0;
    __syncthreads();  // nobody overwrites sh.ok before everyone read it
    return failed;
  }

  // Leader only: true while no abort arrived; else records it (kind and origin from the word).
  __device__ bool aborted(Phase phase, int step, int peer, uint64_t epoch) {
    const uint64_t* c = reinterpret_cast<const uint64_t*>(kp.my + kp.cfg.L.abort_cell());
    const uint64_t v = ld_relaxed_sys(c);
    if (v == 0) return false;
    const uint32_t kind = static_cast<uint32_t>(v >> 32) & 0x7fffffffu;
    const int origin = static_cast<int>(static_cast<uint32_t>(v));
    record(kind == 0 ? kPeerAbortCode : kind, phase, step, peer, epoch, 0, origin);
    return true;
  }

  // Spins first (a flag that is about to arrive costs one poll), checking the deadline and the
  // abort cell every 16 polls; after kSpins polls it sleeps between polls, 32 ns doubling to a cap
  // of 128 ns (a sleeping waiter sees a flag at most ~128 ns late).
  __device__ bool wait(size_t cell, uint64_t e, uint32_t sig, Phase phase, int step, int peer, uint64_t* aux0,
                       uint64_t* aux1) {
    constexpr unsigned kSpins = 256, kMaxBackoffNs = 128;
    dirty = true;
    const bool inter = cell >= kp.cfg.L.inter_cell(0, 0, 0);
    if (threadIdx.x == 0) {
      // Across nodes the flag is my channel's: the cell of its first block (NOTE [channels]).
      const size_t flag_cell =
          inter ? cell - static_cast<size_t>(static_cast<int>(blockIdx.x) - ch_first) * kp.cfg.L.cell_stride : cell;
      uint64_t* c = reinterpret_cast<uint64_t*>(kp.my + flag_cell);
      const uint64_t target = flag_word(e, 0);
      const uint64_t start = globaltimer();
      // Relaxed polls; one acquire once the flag is there (it orders the sender's writes).
      uint64_t v = ld_relaxed_sys(c);
      int ok = 1;
      unsigned backoff = 32, polls = 0;
      while (v < target) {
        ++polls;
        if (polls >= kSpins || (polls & 15) == 0) {
          if (aborted(phase, step, peer, e)) {
            ok = 0;
            break;
          }
          if (globaltimer() - start > kp.timeout_ns) {
            fail(kTimeoutCode, phase, step, peer, e, flag_epoch(v), kp.cfg.where.rank);
            ok = 0;
            break;
          }
        }
        if (polls >= kSpins) {
          __nanosleep(backoff);
          if (backoff < kMaxBackoffNs) backoff *= 2;
        }
        v = ld_relaxed_sys(c);
      }
      if (ok) v = ld_acquire_sys(c);
      if (ok && flag_epoch(v) != e) {
        fail(kViolationCode, phase, step, peer, e, flag_epoch(v), kp.cfg.where.rank);
        ok = 0;
      }
      if (ok && flag_sig(v) != sig) {
        Mismatch mm;
        mm.detail = kMismatchSignature;
        mm.got = flag_sig(v);
        mm.want = sig;
        fail(kMismatchCode, phase, step, peer, e, flag_epoch(v), kp.cfg.where.rank, mm);
        ok = 0;
      }
      if (ok && inter) {
        // Written by an NVSHMEM signal: returns at once, and adds the consistency step that
        // makes the signal's data visible (proxy transports included), the trailer's too.
        nvshmem_uint64_wait_until(c, NVSHMEM_CMP_GE, target);
      }
      // The sender's description (in node: stored before the flag's release; across nodes: the
      // trailer of the put, NOTE [gpu call description]) must be mine.
      if (ok && (inter ? in_wire() && !trailer_matches(cell, v, peer) : !desc_matches(cell))) {
        const uint64_t mine[kDescWords + 2] = {desc.count, desc.code, desc.n, desc.shape, v, static_cast<uint64_t>(peer)};
        const Mismatch mm =
            inter ? mismatch_at(kMismatchTrailer, trailer_of(kp.my + inter_zone(cell), inter_bytes), mine, kDescWords + 2)
                  : mismatch_at(kMismatchCellDesc, reinterpret_cast<const uint64_t*>(kp.my + cell) + kCellDesc, mine,
                                kDescWords);
        fail(kMismatchCode, phase, step, peer, e, flag_epoch(v), kp.cfg.where.rank, mm);
        ok = 0;
      }
      sh.aux0 = ok ? ld_relaxed_sys(c + 1) : 0;
      sh.aux1 = ok ? ld_relaxed_sys(c + 2) : 0;
      sh.ok = ok;
    }
    __syncthreads();
    *aux0 = sh.aux0;
    *aux1 = sh.aux1;
    const bool ok = sh.ok != 0;
    __syncthreads();  // nobody overwrites sh before everyone read it
    return ok;
  }

  // NOTE [landings] (protocol/round.h): NVSHMEM puts land in the zone; the Landing is applied
  // from there once the flag arrived.
  __device__ void expect(size_t, uint64_t, int, const Landing&) {}
  __device__ bool wait_land(size_t cell, uint64_t e, uint32_t sig, Phase phase, int step, int peer,
                            const Landing& lg) {
    uint64_t a0, a1;
    if (!wait(cell, e, sig, phase, step, peer, &a0, &a1)) return false;
    apply_landing(*this, lg, kp.my + lg.zone_off, 0, lg.bytes);
    return true;
  }

  // The data and its trailer (NOTE [gpu call description]) in one put, then the signal. `src` is a
  // slot of my segment (a result or zone slice) with kGpuDescRoom bytes of room behind the data.
  __device__ bool put_signal(int rank, size_t dst_off, const char* src, size_t bytes, size_t cell, uint64_t word) {
    dirty = true;
    __syncthreads();
    uint64_t* t = trailer_of(const_cast<char*>(src), bytes);
    if (threadIdx.x == 0 && in_wire()) {
      st_relaxed_sys(t + 0, desc.count);
      st_relaxed_sys(t + 1, desc.code);
      st_relaxed_sys(t + 2, desc.n);
      st_relaxed_sys(t + 3, desc.shape);
      st_relaxed_sys(t + kDescWords, word);
      st_relaxed_sys(t + kDescWords + 1, static_cast<uint64_t>(kp.cfg.where.rank));
      if (!gathered) __threadfence();
    }
    if (!gathered) {
      __syncthreads();
      const size_t wire = static_cast<size_t>(reinterpret_cast<char*>(t + kTrailerWords) - src);
      nvshmemx_putmem_signal_nbi_block(kp.my + dst_off, src, wire, reinterpret_cast<uint64_t*>(kp.my + cell), word,
                                       NVSHMEM_SIGNAL_SET, rank);
      return true;
    }
    // NOTE [channels]: the last block of my channel puts every part of it, b0's flag.
    const SegmentLayout& L = kp.cfg.L;
    if (!chan_arrive(chan_counter((cell - L.inter_cell(0, 0, 0)) / L.cell_stride / static_cast<size_t>(L.B)))) return true;
    const size_t back = static_cast<size_t>(static_cast<int>(blockIdx.x) - ch_first);
    const size_t wire = static_cast<size_t>(ch_wire_last - ch_first) * L.zone_slice_bytes + align_up(ch_last_bytes, 8) +
                        kTrailerBytes;
    nvshmemx_putmem_signal_nbi_block(kp.my + dst_off - back * L.zone_slice_bytes, src - back * L.zone_slice_bytes, wire,
                                     reinterpret_cast<uint64_t*>(kp.my + cell - back * L.cell_stride), word,
                                     NVSHMEM_SIGNAL_SET, rank);
    return true;
  }

  // The description's packets (NOTE [gpu call description]), then the data's: one stream.
  __device__ bool put_ll(int rank, size_t dst_off, size_t out_off, const char* src, size_t bytes, uint32_t flag) {
    dirty = true;
    __syncthreads();
    if (threadIdx.x == 0) __threadfence_system();  // my earlier zeroing of LL zones is ordered before
    __syncthreads();
    const size_t n = kDescPackets + ll_packets(bytes);
    const size_t nq = ll_quads(bytes);
    constexpr size_t kDescQuads = kDescPackets / kLLQuad;
    uint64_t* direct = static_cast<uint64_t*>(nvshmem_ptr(kp.my + dst_off, rank));
    // One quad (4 packets: a 16-byte payload load, two 16-byte stores) per thread and turn.
    uint64_t* to = direct != nullptr ? direct : reinterpret_cast<uint64_t*>(kp.my + out_off);
    const uint64_t hi = static_cast<uint64_t>(flag) << 32;
    // A part after my channel's wire is not sent (NOTE [channels]): nothing to pack.
    const bool pack = direct != nullptr || in_wire();
    for (size_t q = threadIdx.x; pack && q < kDescQuads + nq; q += blockDim.x) {
      uint64_t pk[kLLQuad];
      if (q < kDescQuads) {
        const uint64_t a = q == 0 ? desc.count : desc.n, b = q == 0 ? desc.code : desc.shape;
        pk[0] = hi | (a & 0xffffffffu);
        pk[1] = hi | (a >> 32);
        pk[2] = hi | (b & 0xffffffffu);
        pk[3] = hi | (b >> 32);
        st_quad(to + q * kLLQuad, pk, kLLQuad);
        continue;
      }
      ll_make_quad(src, bytes, q - kDescQuads, flag, pk);
      // Load/store reachable (NVLink, or a PE on this GPU): each 8-byte packet arrives whole.
      st_quad(to + q * kLLQuad, pk, ll_quad_size(bytes, q - kDescQuads));
    }
    const SegmentLayout& L = kp.cfg.L;
    if (direct == nullptr && gathered && pack) {
      // The rest of my stride in llout: zeros, so that the channel's message leaves only zeros
      // or packets of this round in the partner's LL zone (NOTE [LL zones]).
      const size_t stride = L.ll_slice_bytes / 8;
      for (size_t k = n + threadIdx.x; k < stride; k += blockDim.x) st_relaxed_sys(to + k, 0);
    }
    __syncthreads();
    if (direct != nullptr) return true;
    if (!gathered) {
      nvshmemx_putmem_nbi_block(kp.my + dst_off, to, n * 8, rank);
      return true;
    }
    // NOTE [channels]: the last block of my channel puts every stream of it.
    if (!chan_arrive(chan_counter(L.llzone_slot(dst_off)))) return true;
    const size_t back = static_cast<size_t>(static_cast<int>(blockIdx.x) - ch_first) * L.ll_slice_bytes;
    const size_t wire = static_cast<size_t>(ch_wire_last - ch_first) * L.ll_slice_bytes +
                        (kDescPackets + ll_packets(ch_last_bytes)) * 8;
    nvshmemx_putmem_nbi_block(kp.my + dst_off - back, reinterpret_cast<char*>(to) - back, wire, rank);
    return true;
  }

  // Threads poll packets [lo, hi) of the stream at pk, each its own. The first failure a thread
  // sees claims sh.ok (1 -> code, compare-and-swap, so it is never overwritten); the others stop
  // as soon as sh.ok is not 1.
  static constexpr int kLLTimedOut = 0, kLLMismatched = -1, kLLAborted = -2,  // sh.ok once a thread failed
      kLLDescMismatched = -3;
  __device__ void ll_poll(const uint64_t* pk, size_t lo, size_t hi, uint32_t flag, uint64_t start) {
    const uint64_t* abort_word = reinterpret_cast<const uint64_t*>(kp.my + kp.cfg.L.abort_cell());
    for (size_t i = lo + threadIdx.x; i < hi && ld_volatile(&sh.ok) == 1; i += blockDim.x) {
      int st = ll_packet_state(ld_relaxed_sys(pk + i), flag);
      unsigned spins = 0;
      while (st == 0) {
        if ((++spins & 63) == 0) {
          if (ld_volatile(&sh.ok) != 1) break;  // another thread failed: its code stands
          if (globaltimer() - start > kp.timeout_ns) {
            atomicCAS(&sh.ok, 1, kLLTimedOut);
            break;
          }
          if (ld_relaxed_sys(abort_word) != 0) {
            atomicCAS(&sh.ok, 1, kLLAborted);
            break;
          }
          __nanosleep(64);
        }
        st = ll_packet_state(ld_relaxed_sys(pk + i), flag);
      }
      if (st < 0) atomicCAS(&sh.ok, 1, kLLMismatched);
    }
  }

  // Leader only: whether the description packets of the stream at pk (arrived) are this block's.
  __device__ bool ll_desc_matches(const uint64_t* pk) const {
    uint64_t w[kDescPackets];
    for (unsigned k = 0; k < kDescPackets; ++k) w[k] = ld_relaxed_sys(pk + k) & 0xffffffffu;
    const CallDesc theirs{w[0] | (w[1] << 32), w[2] | (w[3] << 32), w[4] | (w[5] << 32), w[6] | (w[7] << 32)};
    return desc_equal(theirs, desc);
  }

  // The description's packets first, compared (NOTE [gpu call description]), then the data's.
  // Each packet carries its own flag: no fence, no acquire.
  __device__ bool wait_ll(size_t off, size_t bytes, uint64_t e, uint32_t sig, int step, int peer) {
    dirty = true;
    // A part after my channel's wire is neither sent nor awaited (NOTE [channels]); its empty
    // stream is checked by nobody: the channel's first block checks the description.
    if (!in_wire() && nvshmem_ptr(kp.my + off, peer) == nullptr) return true;
    const uint32_t flag = ll_flag(e, sig);
    const uint64_t* pk = reinterpret_cast<const uint64_t*>(kp.my + off);
    const uint64_t start = globaltimer();
    if (threadIdx.x == 0) sh.ok = 1;
    __syncthreads();
    ll_poll(pk, 0, kDescPackets, flag, start);
    __syncthreads();
    if (threadIdx.x == 0 && sh.ok == 1 && !ll_desc_matches(pk)) sh.ok = kLLDescMismatched;
    __syncthreads();
    ll_poll(pk, kDescPackets, kDescPackets + ll_packets(bytes), flag, start);
    __syncthreads();
    const int result = sh.ok;
    if (threadIdx.x == 0 && result != 1) {
      if (result == kLLTimedOut)
        fail(kTimeoutCode, Phase::kInterNode, step, peer, e, 0, kp.cfg.where.rank);
      else if (result == kLLMismatched || result == kLLDescMismatched) {
        Mismatch mm;
        mm.detail = kMismatchLLFlag;
        if (result == kLLDescMismatched) {
          // The description's 32-bit halves, in packet order (NOTE [gpu call description]).
          const uint64_t d[4] = {desc.count, desc.code, desc.n, desc.shape};
          uint64_t mine[kDescPackets];
          for (unsigned k = 0; k < kDescPackets; ++k) mine[k] = (k & 1) ? d[k / 2] >> 32 : d[k / 2] & 0xffffffffu;
          mm = mismatch_at(kMismatchLLDesc, pk, mine, kDescPackets, 0xffffffffu);
        }
        fail(kMismatchCode, Phase::kInterNode, step, peer, e, e, kp.cfg.where.rank, mm);
      }
      else if (!aborted(Phase::kInterNode, step, peer, e))
        fail(kViolationCode, Phase::kInterNode, step, peer, e, 0, kp.cfg.where.rank);  // cannot happen
    }
    __syncthreads();
    return result == 1;
  }

  // The data's packets to dst, then every packet of the stream zeroed, the description's too.
  __device__ void ll_unpack(char* dst, size_t off, size_t bytes) {
    dirty = true;
    uint64_t* stream = reinterpret_cast<uint64_t*>(kp.my + off);
    uint64_t* zone = stream + kDescPackets;
    const size_t nq = ll_quads(bytes);
    const uint64_t zero[kLLQuad] = {0, 0, 0, 0};
    for (size_t q = threadIdx.x; q < kDescPackets / kLLQuad; q += blockDim.x) st_quad(stream + q * kLLQuad, zero, kLLQuad);
    for (size_t q = threadIdx.x; q < nq; q += blockDim.x) {
      uint64_t* p = zone + q * kLLQuad;
      const size_t m = ll_quad_size(bytes, q);
      uint64_t pk[kLLQuad] = {0, 0, 0, 0};
      if (m == kLLQuad && (reinterpret_cast<size_t>(p) & 15) == 0) {
        ld_relaxed_sys_v2(p, pk[0], pk[1]);
        ld_relaxed_sys_v2(p + 2, pk[2], pk[3]);
      } else {
        for (size_t k = 0; k < m; ++k) pk[k] = ld_relaxed_sys(p + k);
      }
      ll_store_quad(dst, bytes, q, pk);
      st_quad(p, zero, m);  // NOTE [LL zones]
    }
    __syncthreads();
  }

  __device__ void reduce(char* const* dst, int nd, const char* const* src, int ns, size_t n, Scale sc) {
    dirty = true;
    reduce_slice<kVec>(GroupView{static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x)},
                       reinterpret_cast<T* const*>(dst), nd, reinterpret_cast<const T* const*>(src), ns, n, Op{}, sc);
    __syncthreads();
  }

  __device__ void copy(char* dst, const char* src, size_t bytes) {
    dirty = true;
    copy_slice(GroupView{static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x)}, dst, src, bytes);
    __syncthreads();
  }

  // Cross-memory access to private host memory is a CPU-executor feature; RoundConfig::cma is
  // false on the GPU, so the round never asks for it.
  __device__ bool remote_read(int, char*, uint64_t, size_t, Phase) { return false; }
  __device__ bool remote_write(int, const char*, uint64_t, size_t, Phase) { return false; }
  __device__ void expose(uint64_t) {}
  __device__ void jitter() {}
};

}  // namespace gpu
}  // namespace nvrar
