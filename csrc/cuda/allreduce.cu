// Dispatch of an all_reduce call to the kernel instance of its element type and reduction. The
// instances live in their own translation units (allreduce_inst.cu, see setup.py); this file
// holds host code only.
#include <cuda_runtime.h>

#include <algorithm>

#include "launch.h"

namespace nvrar {
namespace gpu {

namespace {

template <typename T>
cudaError_t launch_op(const KernelParams& kp, RedOp op, int blocks, int threads, cudaStream_t stream) {
  switch (op) {
    case RedOp::kSum:
    case RedOp::kAvg: return launch_instance<T, OpSum>(kp, blocks, threads, stream);
    case RedOp::kMax: return launch_instance<T, OpMax>(kp, blocks, threads, stream);
    case RedOp::kMin: return launch_instance<T, OpMin>(kp, blocks, threads, stream);
  }
  return cudaErrorInvalidValue;
}

template <typename T>
int max_threads_op() {
  return std::min({max_threads_instance<T, OpSum>(), max_threads_instance<T, OpMax>(),
                   max_threads_instance<T, OpMin>()});
}

}  // namespace

int max_threads_per_block() {
  return std::min({max_threads_op<float>(), max_threads_op<f16>(), max_threads_op<bf16>(), max_threads_op<int32_t>()});
}

cudaError_t launch_allreduce(const KernelParams& kp, DType dtype, RedOp op, int blocks, int threads,
                             cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat32: return launch_op<float>(kp, op, blocks, threads, stream);
    case DType::kFloat16: return launch_op<f16>(kp, op, blocks, threads, stream);
    case DType::kBFloat16: return launch_op<bf16>(kp, op, blocks, threads, stream);
    case DType::kInt32: return launch_op<int32_t>(kp, op, blocks, threads, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace gpu
}  // namespace nvrar
