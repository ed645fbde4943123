// Dispatch of an all_reduce_add_rms_norm call to the fused kernel instance of its element type.
// The instances live in their own translation units (fused_inst.cu, see setup.py); this file
// holds host code only.
#include <cuda_runtime.h>

#include <algorithm>

#include "fused_launch.h"

namespace nvrar {
namespace gpu {

// A module built with NVRAR_CUDA_UNITS=smoke (setup.py; NVRAR_SMOKE_INSTANCES) holds no fused
// instance: scripts/gpu_check.sh's smoke step makes no fused call.
#ifdef NVRAR_SMOKE_INSTANCES
cudaError_t launch_fused(const FusedParams&, DType, int, cudaStream_t) { return cudaErrorNotSupported; }

int max_threads_fused() { return 0; }
#else
cudaError_t launch_fused(const FusedParams& fp, DType dtype, int threads, cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat32: return launch_fused_instance<float>(fp, threads, stream);
    case DType::kFloat16: return launch_fused_instance<f16>(fp, threads, stream);
    case DType::kBFloat16: return launch_fused_instance<bf16>(fp, threads, stream);
    default: break;
  }
  return cudaErrorInvalidValue;
}

int max_threads_fused() {
  return std::min({max_threads_fused_instance<float>(), max_threads_fused_instance<f16>(),
                   max_threads_fused_instance<bf16>()});
}
#endif

}  // namespace gpu
}  // namespace nvrar
