// The fused NVRAR kernel: one launch per all_reduce call (instantiated once per element type and
// reduction by allreduce_inst.cu, one translation unit each, compiled in parallel). Block b runs slice b of every chunk
// through protocol/round.h with the NVSHMEM transport (device.cuh): stage-in, intra-node
// reduce-scatter over NVLink peer pointers (pushing finished shards into peers' symmetric
// outputs), inter-node recursive doubling with put-with-signal or LL packets (any node count:
// fold-in/fold-out), all-gather. Blocks never wait for each other: each slice has its own flags.
// The epoch lives in device memory; the last block to finish advances it, so CUDA-graph replays
// stay in step (NOTE [epoch protocol], plan.h; NOTE [gpu deadlines], device.cuh).
#pragma once

#include <algorithm>

#include "device.cuh"

namespace nvrar {
namespace gpu {

template <typename T, typename Op>
__global__ void __launch_bounds__(kMaxThreads, 1) nvrar_allreduce_kernel(const __grid_constant__ KernelParams kp) {
  NVRAR_SHARED(SharedWs, sh);
  GpuTransport<T, Op> tp{kp, sh};
  const Workspace ws{sh.srcs, sh.piece_srcs, sh.dsts, sh.piece_dsts, sh.peer_out, sh.src_remote, nullptr};
  const uint64_t e0 = ld_volatile(&kp.state->epoch);
  const size_t nchunks = ceil_div(kp.count, kp.chunk_elems);
  const int B = static_cast<int>(gridDim.x);
  const int b = static_cast<int>(blockIdx.x);
  tp.set_channel(kp.channels, B, b);
  if (tp.failed_before(e0)) {  // NOTE [loud after failure] (device.cuh)
    if (!kp.eager) device_trap();
    return;
  }
  for (size_t c = 0; c < nchunks; ++c) {
    const uint64_t e = e0 + 1 + c;
    const size_t first = c * kp.chunk_elems;
    const size_t n = kp.count - first < kp.chunk_elems ? kp.count - first : kp.chunk_elems;
    tp.desc = CallDesc{kp.count, kp.code, n, kp.shape};
    const Range sl = SegmentLayout::chunk_slice(n, kp.chunk_elems, kp.es, B, b);
    // My channel's wire (NOTE [channels], device.cuh): up to its last block whose inter-node
    // message is not empty (the channel's first block when all are), and that block's bytes.
    // A chunk's empty slices are its last ones, so the parts before it are all in the wire.
    auto inter_msg = [&](int j) {
      const Range r = SegmentLayout::chunk_slice(n, kp.chunk_elems, kp.es, B, j);
      return (kp.algorithm == Algorithm::kOneShot ? r.size()
                                                  : shard_range(r.size(), kp.es, kp.cfg.where.G, kp.cfg.where.local).size()) *
             static_cast<size_t>(kp.es);
    };
    tp.ch_wire_last = tp.ch_end - 1;
    while (tp.ch_wire_last > tp.ch_first && inter_msg(tp.ch_wire_last) == 0) --tp.ch_wire_last;
    tp.ch_last_bytes = inter_msg(tp.ch_wire_last);
    const size_t at = (first + sl.begin) * static_cast<size_t>(kp.es);
    const Slice s{kp.in + at, kp.out + at, sl.size(), static_cast<size_t>(kp.es), sl.begin * static_cast<size_t>(kp.es),
                  b, kp.in_pool, kp.out_pool};
    const bool ok = kp.algorithm == Algorithm::kOneShot
                        ? one_shot_round(tp, kp.cfg, ws, s, e, kp.sig, kp.sc)
                        : two_shot_round(tp, kp.cfg, ws, s, e, kp.sig, kp.sc);
    if (!ok) break;  // recorded in kp.err; the host raises
  }
  // The last block to finish resets the count and advances the epoch. The count is a relaxed
  // atomic: the fence before it releases this block's epoch read and writes, the fence after the
  // last one acquires every block's (C++ [atomics.fences]); the reset is an atomic store, since
  // other blocks' atomicAdd touch the same word.
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned prev = atomicAdd(&kp.state->done, 1u);
    if (prev == static_cast<unsigned>(B) - 1) {  // the last block of this launch
      __threadfence();
      atomicExch(&kp.state->done, 0u);
      kp.state->epoch = e0 + nchunks;
      __threadfence();
    }
  }
}

}  // namespace gpu
}  // namespace nvrar
