// One instance of the fused kernel (allreduce_kernel.cuh) per translation unit: setup.py compiles
// this file once per element type and reduction, with NVRAR_INST_T and NVRAR_INST_OP set, and
// runs those nvcc processes in parallel (a single unit with every instance took over two minutes).
#include "allreduce_kernel.cuh"
#include "launch.h"

#if !defined(NVRAR_INST_T) || !defined(NVRAR_INST_OP)
#error "compile with -DNVRAR_INST_T=<float|f16|bf16|int32_t> -DNVRAR_INST_OP=<OpSum|OpMax|OpMin>"
#endif

namespace nvrar {
namespace gpu {

template <typename T, typename Op>
cudaError_t launch_instance(const KernelParams& kp, int blocks, int threads, cudaStream_t stream) {
  nvrar_allreduce_kernel<T, Op><<<blocks, threads, 0, stream>>>(kp);
  return cudaGetLastError();
}

template <typename T, typename Op>
int max_threads_instance() {
  cudaFuncAttributes a;
  if (cudaFuncGetAttributes(&a, nvrar_allreduce_kernel<T, Op>) != cudaSuccess) return 0;
  return a.maxThreadsPerBlock;
}

template cudaError_t launch_instance<NVRAR_INST_T, NVRAR_INST_OP>(const KernelParams&, int, int, cudaStream_t);
template int max_threads_instance<NVRAR_INST_T, NVRAR_INST_OP>();

}  // namespace gpu
}  // namespace nvrar
