// One instance of the fused all-reduce + add + RMSNorm kernel (fused_kernel.cuh) per translation
// unit: setup.py compiles this file once per element type (float, f16, bf16) with NVRAR_INST_T
// set, in parallel with the all-reduce instances (allreduce_inst.cu).
#include "fused_kernel.cuh"
#include "fused_launch.h"

#if !defined(NVRAR_INST_T)
#error "compile with -DNVRAR_INST_T=<float|f16|bf16>"
#endif

namespace nvrar {
namespace gpu {

template <typename T>
cudaError_t launch_fused_instance(const FusedParams& fp, int threads, cudaStream_t stream) {
  return launch_kernel(nvrar_fused_kernel<T>, 1, threads, false, stream, fp);  // prim_cuda.cuh
}

template <typename T>
int max_threads_fused_instance() {
  return kernel_max_threads(nvrar_fused_kernel<T>);
}

template cudaError_t launch_fused_instance<NVRAR_INST_T>(const FusedParams&, int, cudaStream_t);
template int max_threads_fused_instance<NVRAR_INST_T>();

}  // namespace gpu
}  // namespace nvrar
