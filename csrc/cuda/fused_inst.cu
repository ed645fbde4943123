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
  nvrar_fused_kernel<T><<<1, threads, 0, stream>>>(fp);
  return cudaGetLastError();
}

template <typename T>
int max_threads_fused_instance() {
  cudaFuncAttributes a;
  if (cudaFuncGetAttributes(&a, nvrar_fused_kernel<T>) != cudaSuccess) return 0;
  return a.maxThreadsPerBlock;
}

template cudaError_t launch_fused_instance<NVRAR_INST_T>(const FusedParams&, int, cudaStream_t);
template int max_threads_fused_instance<NVRAR_INST_T>();

}  // namespace gpu
}  // namespace nvrar
