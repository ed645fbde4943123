// One element type's kernel instances for the emulated build (-DNVRAR_INST_T=...): the unmodified
// kernels of csrc/cuda, compiled by the host compiler against prim_emu.h.
#include "../cuda/allreduce_kernel.cuh"
#include "../cuda/fused_kernel.cuh"
#include "kernels.h"

#if !defined(NVRAR_INST_T)
#error "compile with -DNVRAR_INST_T=<float|f16|bf16|int32_t>"
#endif

namespace nvrar {
namespace emu {

template <>
void allreduce_kernel<NVRAR_INST_T>(const gpu::KernelParams& kp, RedOp op) {
  switch (op) {
    case RedOp::kSum:
    case RedOp::kAvg: gpu::nvrar_allreduce_kernel<NVRAR_INST_T, OpSum>(kp); return;
    case RedOp::kMax: gpu::nvrar_allreduce_kernel<NVRAR_INST_T, OpMax>(kp); return;
    case RedOp::kMin: gpu::nvrar_allreduce_kernel<NVRAR_INST_T, OpMin>(kp); return;
  }
}

template <>
void fused_kernel<NVRAR_INST_T>(const gpu::FusedParams& fp) {
#if NVRAR_INST_INT
  (void)fp;
#else
  gpu::nvrar_fused_kernel<NVRAR_INST_T>(fp);
#endif
}

}  // namespace emu
}  // namespace nvrar
