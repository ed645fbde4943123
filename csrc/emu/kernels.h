// The kernel instances of the emulated build (kernels_inst.cpp, compiled once per element type,
// as the GPU build compiles allreduce_inst.cu): the body every emulated thread runs.
#pragma once

#include "../cuda/params.h"
#include "../protocol/types.h"

namespace nvrar {
namespace emu {

template <typename T>
void allreduce_kernel(const gpu::KernelParams& kp, RedOp op);  // nvrar_allreduce_kernel<T, Op>
template <typename T>
void fused_kernel(const gpu::FusedParams& fp);  // nvrar_fused_kernel<T>

}  // namespace emu
}  // namespace nvrar
