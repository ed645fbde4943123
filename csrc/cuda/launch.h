// The kernel launcher, between runtime.cu and allreduce.cu.
#pragma once

#include <cuda_runtime.h>

#include "params.h"

namespace nvrar {
namespace gpu {

cudaError_t launch_allreduce(const KernelParams& kp, DType dtype, RedOp op, int blocks, int threads,
                             cudaStream_t stream);
// The most threads per block every instance of the kernel can launch with on this device.
int max_threads_per_block();

// One instance of the fused kernel (allreduce_kernel.cuh), defined and instantiated for each
// (T, Op) in its own translation unit (allreduce_inst.cu).
template <typename T, typename Op>
cudaError_t launch_instance(const KernelParams& kp, int blocks, int threads, cudaStream_t stream);
template <typename T, typename Op>
int max_threads_instance();

}  // namespace gpu
}  // namespace nvrar
