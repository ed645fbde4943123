// The fused all-reduce + residual add + RMSNorm kernel's parameters and launcher, between
// runtime.cu and the instances (fused_kernel.cuh, compiled per element type by fused_inst.cu;
// dispatched by fused.cu).
#pragma once

#include <cuda_runtime.h>

#include "params.h"

namespace nvrar {
namespace gpu {

// FusedParams: params.h.
template <typename T>
cudaError_t launch_fused_instance(const FusedParams& fp, int threads, cudaStream_t stream);
template <typename T>
int max_threads_fused_instance();

// Dispatch to the instance of the element type (fused.cu): float32, float16, bfloat16.
cudaError_t launch_fused(const FusedParams& fp, DType dtype, int threads, cudaStream_t stream);
// The most threads per block every instance of the fused kernel can launch with on this device.
int max_threads_fused();

}  // namespace gpu
}  // namespace nvrar
