// The kernel launcher, between runtime.cu and allreduce.cu.
#pragma once

#include <cuda_runtime.h>

#include "device.cuh"

namespace nvrar {
namespace gpu {

cudaError_t launch_allreduce(const KernelParams& kp, DType dtype, RedOp op, int blocks, int threads,
                             cudaStream_t stream);

}  // namespace gpu
}  // namespace nvrar
