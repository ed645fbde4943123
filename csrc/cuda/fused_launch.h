// The fused all-reduce + residual add + RMSNorm kernel's parameters and launcher, between
// runtime.cu and the instances (fused_kernel.cuh, compiled per element type by fused_inst.cu;
// dispatched by fused.cu).
#pragma once

#include <cuda_runtime.h>

#include "device.cuh"

namespace nvrar {
namespace gpu {

// The plain kernel's parameters (transport, flags, epoch, error record) plus the fused call's.
struct FusedParams {
  KernelParams kp;     // kp.in / kp.out: x; kp.count: rows * h; kp.algorithm, kp.sig: the fused call's
  char* res;           // residual, read and written in place
  const char* weight;  // h elements
  size_t rows;
  size_t h;
  size_t chunk_rows;   // rows per round (fused_chunk_rows)
  float eps;
};

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
