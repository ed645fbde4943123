// The kernel launcher, between runtime.cu and allreduce.cu.
#pragma once

#include <cuda_runtime.h>

#include "device.cuh"

namespace nvrar {
namespace gpu {

cudaError_t launch_allreduce(const KernelParams& kp, DType dtype, RedOp op, int blocks, int threads,
                             cudaStream_t stream);
// The most threads per block every instance of the kernel can launch with on this device.
int max_threads_per_block();

}  // namespace gpu
}  // namespace nvrar
