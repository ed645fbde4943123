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

// NOTE [channels] (device.cuh): a launch that gathers slices into channels (fewer channels than
// blocks) progresses only with every block of a channel resident at once, so it is cooperative:
// the launch fails (cudaErrorCooperativeLaunchTooLarge, raised on the host) rather than running
// part of the grid, and a cooperative kernel node can be captured in a CUDA graph
// (cudaLaunchAttributeCooperative is valid for launches and graph nodes). A launch with one block
// per channel is an ordinary one: its blocks never wait for each other. The launch itself: the
// launch primitive launch_kernel (prim_cuda.cuh; the host emulation's in csrc/emu/prim_emu.h).
template <typename T, typename Op>
cudaError_t launch_instance(const KernelParams& kp, int blocks, int threads, cudaStream_t stream) {
  return launch_kernel(nvrar_allreduce_kernel<T, Op>, blocks, threads, cooperative_launch(kp.channels, blocks), stream,
                       kp);
}

template <typename T, typename Op>
int max_threads_instance() {
  return kernel_max_threads(nvrar_allreduce_kernel<T, Op>);
}

template cudaError_t launch_instance<NVRAR_INST_T, NVRAR_INST_OP>(const KernelParams&, int, int, cudaStream_t);
template int max_threads_instance<NVRAR_INST_T, NVRAR_INST_OP>();

}  // namespace gpu
}  // namespace nvrar
