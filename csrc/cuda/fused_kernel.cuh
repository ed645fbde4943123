// The fused all-reduce + residual add + RMSNorm kernel (GpuExecutor::all_reduce_add_rms_norm),
// instantiated once per element type by fused_inst.cu. The round is protocol/epilogue.h's
// (NOTE [fused add + RMSNorm]) with the NVSHMEM transport of device.cuh: two-shot runs
// fused_two_shot_round (row-aligned shards, the epilogue on the node's finished rows before the
// all-gather), one-shot runs one_shot_round in place on x and the epilogue on every row.
//
// One CUDA block per chunk (slice b = 0): the fused round cuts its shards on row boundaries
// across the G local ranks, and its staging addresses are those of the whole chunk, so it is not
// cut further into per-block slices. Chunks run one after the other, as in nvrar_allreduce_kernel.
// The epilogue runs one warp per row: lane j keeps the partial sum of squares of elements j,
// j + 32, ..., and the lanes are folded by shuffles in the order of fold_lanes (lane j adds lane
// j + o for o = 16, 8, 4, 2, 1), so the bits are those of add_rms_norm_row on the host.
#pragma once

#include "../protocol/epilogue.h"
#include "device.cuh"
#include "params.h"

namespace nvrar {
namespace gpu {

// One row, run by the 32 lanes of a warp (NOTE above): the same IEEE operations in the same
// order as add_rms_norm_row. Each lane writes res[k] and reads it back for the same k, and reads
// sum[k] before it writes out[k] (out may alias sum).
template <typename T>
__device__ void warp_row(int lane, T* out, T* res, const T* sum, const T* res_in, const T* w, size_t h, float eps) {
  float p = 0.0f;
  for (size_t k = static_cast<size_t>(lane); k < h; k += kNormLanes) {
    const T r = store_acc<T>(__fadd_rn(load_acc(res_in[k]), load_acc(sum[k])));
    res[k] = r;
    const float rf = load_acc(r);
    p = __fadd_rn(p, __fmul_rn(rf, rf));
  }
  for (int o = kNormLanes / 2; o > 0; o /= 2) p = __fadd_rn(p, __shfl_down_sync(0xffffffffu, p, o));
  const float total = __shfl_sync(0xffffffffu, p, 0);
  const float ms = __fdiv_rn(total, static_cast<float>(h));
  const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(ms, eps)));
  for (size_t k = static_cast<size_t>(lane); k < h; k += kNormLanes)
    out[k] = store_acc<T>(__fmul_rn(__fmul_rn(load_acc(res[k]), inv), load_acc(w[k])));
}

// The epilogue as protocol/epilogue.h calls it, epi(out, res, sum, res_in, rows) with byte
// pointers, by every thread of the block: rows spread over the block's warps. Ends with a block
// barrier (its writes are read by other threads next).
template <typename T>
struct BlockEpilogue {
  const T* w;
  size_t h;
  float eps;
  __device__ void operator()(char* out, char* res, const char* sum, const char* res_in, size_t rows) const {
    const int lane = static_cast<int>(threadIdx.x) % 32;
    const size_t warp = threadIdx.x / 32;
    const size_t nwarps = blockDim.x / 32;
    for (size_t r = warp; r < rows; r += nwarps)
      warp_row(lane, reinterpret_cast<T*>(out) + r * h, reinterpret_cast<T*>(res) + r * h,
               reinterpret_cast<const T*>(sum) + r * h, reinterpret_cast<const T*>(res_in) + r * h, w, h, eps);
    __syncthreads();
  }
};

template <typename T>
__global__ void __launch_bounds__(kMaxThreads, 1) nvrar_fused_kernel(const __grid_constant__ FusedParams fp) {
  NVRAR_SHARED(SharedWs, sh);
  const KernelParams& kp = fp.kp;
  GpuTransport<T, OpSum> tp{kp, sh};
  const Workspace ws{sh.srcs, sh.piece_srcs, sh.dsts, sh.piece_dsts, sh.peer_out, sh.src_remote, nullptr};
  const BlockEpilogue<T> epi{reinterpret_cast<const T*>(fp.weight), fp.h, fp.eps};
  const uint64_t e0 = ld_volatile(&kp.state->epoch);
  const size_t nchunks = ceil_div(fp.rows, fp.chunk_rows);
  const size_t es = static_cast<size_t>(kp.es);
  const size_t row_bytes = fp.h * es;
  if (tp.failed_before(e0)) {  // NOTE [loud after failure] (device.cuh)
    if (!fp.kp.eager) device_trap();
    return;
  }
  for (size_t c = 0; c < nchunks; ++c) {
    const uint64_t e = e0 + 1 + c;
    const size_t r0 = c * fp.chunk_rows;
    const size_t n = fp.rows - r0 < fp.chunk_rows ? fp.rows - r0 : fp.chunk_rows;
    tp.desc = CallDesc{kp.count, kp.code, n * fp.h, kp.shape};
    char* x = kp.out + r0 * row_bytes;
    char* res = fp.res + r0 * row_bytes;
    bool ok;
    if (kp.algorithm == Algorithm::kOneShot) {
      // In place on x (the plain in-place all_reduce), then the epilogue reads the sum from x.
      const Slice s{x, x, n * fp.h, es, 0, 0, false, false};
      ok = one_shot_round(tp, kp.cfg, ws, s, e, kp.sig, make_scale(RedOp::kSum, 1));
      if (ok) epi(x, res, x, res, n);
    } else {
      const FusedSlice s{x, x, res, n, fp.h, es, 0};
      ok = fused_two_shot_round(tp, kp.cfg, ws, s, e, kp.sig, epi);
    }
    if (!ok) break;  // recorded in kp.err; the host raises
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    kp.state->done = 0;
    kp.state->epoch = e0 + nchunks;
    __threadfence();
  }
}

}  // namespace gpu
}  // namespace nvrar
