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
// words are stored before the flag word's release. Across nodes (send_desc) the sender writes
// them into the receiver's inter cell of the step first: stores where nvshmem_ptr reaches the
// cell (direct mode), then __threadfence_system; else four nvshmemx_signal_op (a value put with
// no source buffer, so no symmetric staging and no layout change), then nvshmem_fence, which
// orders them before the step's data put-with-signal or LL packets to the same PE. An LL step
// uses the inter cell of its (parity, slot, slice) too (ll_cell: the LL path has no flag word
// there). The receiver compares the words with this block's description once the flag (wait)
// or every LL packet (wait_ll) arrived, before the caller sees the aux words or touches the
// sender's data; a mismatch fails with kMismatch and aborts every rank.
constexpr int kCellDesc = 3;

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

  // The inter cell of the LL zone at `off` (same parity, slot and slice: plan.h orders both the
  // same way), which carries the LL step's description (NOTE [gpu call description]).
  __device__ size_t ll_cell(size_t off) const {
    const SegmentLayout& L = kp.cfg.L;
    return L.inter_cell(0, 0, 0) + (off - L.llzones_off) / L.ll_slice_bytes * L.cell_stride;
  }

  // Leader only: my description into the description words of `rank`'s cell at `cell`, ordered
  // before whatever I put to `rank` next (NOTE [gpu call description]).
  __device__ void send_desc(int rank, size_t cell) {
    uint64_t* c = reinterpret_cast<uint64_t*>(kp.my + cell);
    uint64_t* direct = static_cast<uint64_t*>(nvshmem_ptr(c, rank));
    const uint64_t words[kDescWords] = {desc.count, desc.code, desc.n, desc.shape};
    if (direct != nullptr) {
      for (unsigned k = 0; k < kDescWords; ++k) st_relaxed_sys(direct + kCellDesc + k, words[k]);
      __threadfence_system();
    } else {
      for (unsigned k = 0; k < kDescWords; ++k) nvshmemx_signal_op(c + kCellDesc + k, words[k], NVSHMEM_SIGNAL_SET, rank);
      nvshmem_fence();
    }
  }

  // Leader only: whether the description words of my cell at `cell` are this block's description.
  __device__ bool desc_matches(size_t cell) const {
    const uint64_t* c = reinterpret_cast<const uint64_t*>(kp.my + cell);
    const CallDesc theirs{ld_relaxed_sys(c + kCellDesc + 0), ld_relaxed_sys(c + kCellDesc + 1),
                          ld_relaxed_sys(c + kCellDesc + 2), ld_relaxed_sys(c + kCellDesc + 3)};
    return desc_equal(theirs, desc);
  }

  // round.h signals the G-1 local peers back to back: the first signal waits for the block and
  // fences once, the others are release stores alone (nothing was written in between).
  __device__ void signal(int rank, size_t cell, uint64_t word, uint64_t aux0, uint64_t aux1) {
    if (dirty) {
      __syncthreads();  // the block's writes of this phase are done
      if (threadIdx.x == 0) __threadfence_system();
      dirty = false;
    }
    if (threadIdx.x == 0) {
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
                         int origin) {
    if (atomicCAS(&kp.state->err_claim, 0ull, static_cast<unsigned long long>(kind)) == 0ull) {
      st_volatile(&kp.err->code, static_cast<unsigned long long>(kind));
      kp.err->phase = static_cast<uint32_t>(phase);
      kp.err->peer = peer;
      kp.err->step = step;
      kp.err->origin = origin;
      kp.err->epoch = epoch;
      kp.err->observed = observed;
      __threadfence_system();
      st_volatile(&kp.err->published, 1ull);
    }
  }

  // Leader only: record the first failure of this rank and abort every rank (NOTE [gpu deadlines]).
  __device__ void fail(ProtocolErrorKindCode kind, Phase phase, int step, int peer, uint64_t epoch, uint64_t observed,
                       int origin) {
    record(kind, phase, step, peer, epoch, observed, origin);
    const Layout& w = kp.cfg.where;
    const size_t abort_off = kp.cfg.L.abort_cell();
    const uint64_t aux = static_cast<uint64_t>(origin) | (static_cast<uint64_t>(kind) << 32);
    const uint64_t word = flag_word(epoch, 1);
    for (int r = 0; r < w.world; ++r) {
      if (r / w.G == w.node) {
        uint64_t* c = reinterpret_cast<uint64_t*>(base(r) + abort_off);
        st_relaxed_sys(c + 1, aux);
        st_release_sys(c, word);
      } else {
        // Remote: aux first, fenced, then the word (signals to one PE may land out of order).
        nvshmemx_signal_op(reinterpret_cast<uint64_t*>(kp.my + abort_off) + 1, aux, NVSHMEM_SIGNAL_SET, r);
        nvshmem_fence();
        nvshmemx_signal_op(reinterpret_cast<uint64_t*>(kp.my + abort_off), word, NVSHMEM_SIGNAL_SET, r);
      }
    }
  }

  // Leader only: true while no abort arrived; else records it.
  __device__ bool aborted(Phase phase, int step, int peer, uint64_t epoch) {
    const uint64_t* c = reinterpret_cast<const uint64_t*>(kp.my + kp.cfg.L.abort_cell());
    if (ld_acquire_sys(c) == 0) return false;
    const uint64_t aux = ld_relaxed_sys(c + 1);
    const uint32_t kind = static_cast<uint32_t>(aux >> 32);
    const int origin = aux == 0 ? -1 : static_cast<int>(aux & 0xffffffffu);
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
    if (threadIdx.x == 0) {
      uint64_t* c = reinterpret_cast<uint64_t*>(kp.my + cell);
      const uint64_t target = flag_word(e, 0);
      const uint64_t start = globaltimer();
      uint64_t v = ld_acquire_sys(c);
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
        v = ld_acquire_sys(c);
      }
      if (ok && flag_epoch(v) != e) {
        fail(kViolationCode, phase, step, peer, e, flag_epoch(v), kp.cfg.where.rank);
        ok = 0;
      }
      if (ok && flag_sig(v) != sig) {
        fail(kMismatchCode, phase, step, peer, e, flag_epoch(v), kp.cfg.where.rank);
        ok = 0;
      }
      if (ok && cell >= kp.cfg.L.inter_cell(0, 0, 0)) {
        // Written by an NVSHMEM signal: returns at once, and adds the consistency step that
        // makes the signal's data visible (proxy transports included), the description's too.
        nvshmem_uint64_wait_until(c, NVSHMEM_CMP_GE, target);
      }
      // The sender's description (stored before the flag's release in node, put and fenced
      // before the data and signal across nodes) must be mine.
      if (ok && !desc_matches(cell)) {
        fail(kMismatchCode, phase, step, peer, e, flag_epoch(v), kp.cfg.where.rank);
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

  __device__ bool put_signal(int rank, size_t dst_off, const char* src, size_t bytes, size_t cell, uint64_t word) {
    dirty = true;
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      send_desc(rank, cell);
    }
    __syncthreads();
    nvshmemx_putmem_signal_nbi_block(kp.my + dst_off, src, bytes, reinterpret_cast<uint64_t*>(kp.my + cell), word,
                                     NVSHMEM_SIGNAL_SET, rank);
    return true;
  }

  __device__ bool put_ll(int rank, size_t dst_off, size_t out_off, const char* src, size_t bytes, uint32_t flag) {
    dirty = true;
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence_system();  // my earlier zeroing of LL zones is ordered before
      send_desc(rank, ll_cell(dst_off));
    }
    __syncthreads();
    const size_t n = ll_packets(bytes);
    const size_t nq = ll_quads(bytes);
    uint64_t* direct = static_cast<uint64_t*>(nvshmem_ptr(kp.my + dst_off, rank));
    // One quad (4 packets: a 16-byte payload load, two 16-byte stores) per thread and turn.
    uint64_t* to = direct != nullptr ? direct : reinterpret_cast<uint64_t*>(kp.my + out_off);
    for (size_t q = threadIdx.x; q < nq; q += blockDim.x) {
      uint64_t pk[kLLQuad];
      ll_make_quad(src, bytes, q, flag, pk);
      // Load/store reachable (NVLink, or a PE on this GPU): each 8-byte packet arrives whole.
      st_quad(to + q * kLLQuad, pk, ll_quad_size(bytes, q));
    }
    __syncthreads();
    if (direct != nullptr) return true;
    uint64_t* out = to;
    nvshmemx_putmem_nbi_block(kp.my + dst_off, out, n * 8, rank);
    return true;
  }

  // Every thread polls its own packets. The first failure a thread sees claims sh.ok (1 -> code,
  // compare-and-swap, so it is never overwritten); the others stop as soon as sh.ok is not 1.
  __device__ bool wait_ll(size_t off, size_t bytes, uint64_t e, uint32_t sig, int step, int peer) {
    dirty = true;
    constexpr int kLLTimedOut = 0, kLLMismatched = -1, kLLAborted = -2;  // sh.ok once a thread failed
    const uint32_t flag = ll_flag(e, sig);
    const uint64_t* pk = reinterpret_cast<const uint64_t*>(kp.my + off);
    const uint64_t* abort_word = reinterpret_cast<const uint64_t*>(kp.my + kp.cfg.L.abort_cell());
    const size_t n = ll_packets(bytes);
    const uint64_t start = globaltimer();
    if (threadIdx.x == 0) sh.ok = 1;
    __syncthreads();
    for (size_t i = threadIdx.x; i < n && ld_volatile(&sh.ok) == 1; i += blockDim.x) {
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
    __syncthreads();
    if (threadIdx.x == 0 && sh.ok == 1) {
      // Every packet arrived: the description, fenced before them, did too (NOTE [gpu call
      // description]); it must be mine before the caller unpacks anything.
      __threadfence_system();
      if (!desc_matches(ll_cell(off))) sh.ok = kLLMismatched;
    }
    __syncthreads();
    const int result = sh.ok;
    if (threadIdx.x == 0 && result != 1) {
      if (result == kLLTimedOut)
        fail(kTimeoutCode, Phase::kInterNode, step, peer, e, 0, kp.cfg.where.rank);
      else if (result == kLLMismatched)
        fail(kMismatchCode, Phase::kInterNode, step, peer, e, e, kp.cfg.where.rank);
      else if (!aborted(Phase::kInterNode, step, peer, e))
        fail(kViolationCode, Phase::kInterNode, step, peer, e, 0, kp.cfg.where.rank);  // cannot happen
    }
    __syncthreads();
    return result == 1;
  }

  __device__ void ll_unpack(char* dst, size_t off, size_t bytes) {
    dirty = true;
    uint64_t* zone = reinterpret_cast<uint64_t*>(kp.my + off);
    const size_t nq = ll_quads(bytes);
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
      const uint64_t zero[kLLQuad] = {0, 0, 0, 0};
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
