// Dispatch of an all_reduce call to the kernel instance of its element type and reduction. The
// instances live in their own translation units (allreduce_inst.cu, see setup.py); this file
// holds host code only.
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "launch.h"

namespace nvrar {
namespace gpu {

namespace {

// Whether this module holds the instance <T, Op>. Every one, except in a module built with
// NVRAR_CUDA_UNITS=smoke (setup.py; NVRAR_SMOKE_INSTANCES): scripts/gpu_check.sh's smoke step runs
// on the float32 and bfloat16 sum instances while the others compile; any other launch there
// fails with cudaErrorNotSupported.
template <typename T, typename Op>
constexpr bool built() {
#ifdef NVRAR_SMOKE_INSTANCES
  return std::is_same<Op, OpSum>::value && (std::is_same<T, float>::value || std::is_same<T, bf16>::value);
#else
  return true;
#endif
}

template <typename T, typename Op>
cudaError_t launch_built(const KernelParams& kp, int blocks, int threads, cudaStream_t stream) {
  if constexpr (built<T, Op>()) {
    return launch_instance<T, Op>(kp, blocks, threads, stream);
  } else {
    return cudaErrorNotSupported;
  }
}

template <typename T, typename Op>
int max_threads_built() {
  if constexpr (built<T, Op>()) {
    return max_threads_instance<T, Op>();
  } else {
    return 1 << 20;  // no limit of its own: the minimum is over the built instances
  }
}

template <typename T>
cudaError_t launch_op(const KernelParams& kp, RedOp op, int blocks, int threads, cudaStream_t stream) {
  switch (op) {
    case RedOp::kSum:
    case RedOp::kAvg: return launch_built<T, OpSum>(kp, blocks, threads, stream);
    case RedOp::kMax: return launch_built<T, OpMax>(kp, blocks, threads, stream);
    case RedOp::kMin: return launch_built<T, OpMin>(kp, blocks, threads, stream);
  }
  return cudaErrorInvalidValue;
}

template <typename T>
int max_threads_op() {
  return std::min({max_threads_built<T, OpSum>(), max_threads_built<T, OpMax>(), max_threads_built<T, OpMin>()});
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
