// The device primitives: the one list of what the device code (device.cuh, the kernels, and the
// device paths of the protocol headers, NVRAR_ON_DEVICE) uses from CUDA, PTX and NVSHMEM. The
// kernels are written against these names only and never ask which implementation they get:
//   prim_cuda.cuh     the GPU build (nvcc): CUDA built-ins, inline PTX, NVSHMEM's device API
//   ../emu/prim_emu.h the host emulation (g++, -DNVRAR_EMULATE): one OS thread per CUDA thread,
//                     PEs as thread groups of one process, an adversarial NVSHMEM proxy
// The GPU build never includes the emulation.
//
// The set:
//   identity      threadIdx, blockIdx, blockDim, gridDim (.x)
//   qualifiers    __device__, __global__, __forceinline__, __launch_bounds__, __grid_constant__
//   shared memory NVRAR_SHARED(Type, name): one object per block
//   barrier       __syncthreads()
//   atomics       atomicCAS (int, unsigned long long), atomicAdd (unsigned): relaxed, device scope
//   fences        __threadfence() (gpu scope), __threadfence_system() (system scope)
//   8-byte memory ld_acquire_sys, ld_relaxed_sys, st_release_sys, st_relaxed_sys (single-copy
//                 atomic), ld_relaxed_sys_v2 / st_relaxed_sys_v2 (16 bytes, each half atomic)
//   volatile      ld_volatile / st_volatile: the device code's volatile accesses, named (the
//                 emulation makes them relaxed atomics)
//   time          globaltimer() (%globaltimer, ns), __nanosleep(ns)
//   trap          device_trap(): __trap(), the grid ends and the context keeps a sticky error
//   warp          __shfl_down_sync, __shfl_sync (full mask only)
//   arithmetic    __fadd_rn, __fmul_rn, __fdiv_rn, __fsqrt_rn, __float_as_uint, __uint_as_float
//   vectors       uint4
//   NVSHMEM       nvshmem_ptr, nvshmemx_putmem_signal_nbi_block, nvshmemx_putmem_nbi_block,
//                 nvshmemx_signal_op, nvshmem_fence, nvshmem_uint64_wait_until,
//                 NVSHMEM_SIGNAL_SET, NVSHMEM_CMP_GE
//   launch (host) launch_kernel, kernel_max_threads: how the instance units start a kernel and
//                 query its limits (in the emulation, only the host half has them)
#pragma once

#if defined(NVRAR_EMULATE)
#include "../emu/prim_emu.h"
#else
#include "prim_cuda.cuh"
#endif

#if !defined(NVRAR_EMULATE) || defined(NVRAR_EMU_HOST)
namespace nvrar {
namespace gpu {
// The most threads per block `kernel` can launch with on the current device (0 if the query
// fails): the instance units' companion of the launch primitive launch_kernel (prim_cuda.cuh, or
// the host emulation's in prim_emu.h), over CUDA's function attributes (emulated there).
template <typename P>
inline int kernel_max_threads(void (*kernel)(P)) {
  cudaFuncAttributes a;
  if (cudaFuncGetAttributes(&a, kernel) != cudaSuccess) return 0;
  return a.maxThreadsPerBlock;
}
}  // namespace gpu
}  // namespace nvrar
#endif
