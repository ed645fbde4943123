// Host/device portability macros shared by every header that the CPU executor and the CUDA
// kernels both compile.
#pragma once

#if defined(__CUDACC__)
#define NVRAR_HD __host__ __device__ __forceinline__
#define NVRAR_DEVICE_CODE 1
#else
#define NVRAR_HD inline
#define NVRAR_DEVICE_CODE 0
#endif

// The element kernels (protocol/slice.h): always inlined, on the host too, so that they compile
// for the instruction set of their multiversioned caller (cpu/reduce_kernels.cpp); a call left
// out of line would run the baseline x86-64 code whatever the CPU offers (it did: 2-3x slower
// than numpy's add on cached data).
#if defined(__CUDACC__)
#define NVRAR_KERNEL NVRAR_HD
#elif defined(__GNUC__)
#define NVRAR_KERNEL inline __attribute__((always_inline))
#else
#define NVRAR_KERNEL inline
#endif

// The device paths also compile for the host emulation of the device (csrc/emu, -DNVRAR_EMULATE).
#if defined(__CUDA_ARCH__) || defined(NVRAR_EMULATE)
#define NVRAR_ON_DEVICE 1
#else
#define NVRAR_ON_DEVICE 0
#endif

#include <cstddef>

#if defined(NVRAR_EMULATE)
#include "../emu/prim_emu.h"  // what nvcc provides built in: uint4, the intrinsics (csrc/cuda/prim.cuh)
#endif

namespace nvrar {
NVRAR_HD size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }
NVRAR_HD size_t ceil_div(size_t x, size_t y) { return (x + y - 1) / y; }
}  // namespace nvrar
