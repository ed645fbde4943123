// The device primitives of prim.cuh for the GPU build: CUDA built-ins and NVSHMEM's device API as
// they are, plus the inline-PTX memory-order helpers and the named volatile accesses.
#pragma once

#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdint>

#define NVRAR_SHARED(Type, name) __shared__ Type name

namespace nvrar {
namespace gpu {

__device__ __forceinline__ uint64_t globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void st_relaxed_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t ld_relaxed_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
// Two packets in one 16-byte access (p 16-byte aligned); each 8-byte half is single-copy atomic.
__device__ __forceinline__ void st_relaxed_sys_v2(uint64_t* p, uint64_t a, uint64_t b) {
  asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(a), "l"(b) : "memory");
}
__device__ __forceinline__ void ld_relaxed_sys_v2(const uint64_t* p, uint64_t& a, uint64_t& b) {
  asm volatile("ld.relaxed.sys.global.v2.u64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(p) : "memory");
}

// The volatile accesses of the device code (a shared flag polled by a block's threads, the
// host-mapped error record, the epoch read at kernel start), named so that the emulation can
// make them what they stand for: relaxed atomic accesses.
// The grid ends with an error that every later CUDA call of the process reports (the context is
// unusable): how a failure surfaces where no host code of nvrar runs (a CUDA-graph replay).
__device__ __forceinline__ void device_trap() { __trap(); }

__device__ __forceinline__ int ld_volatile(const int* p) { return *reinterpret_cast<const volatile int*>(p); }
__device__ __forceinline__ unsigned long long ld_volatile(const unsigned long long* p) {
  return *reinterpret_cast<const volatile unsigned long long*>(p);
}
__device__ __forceinline__ void st_volatile(unsigned long long* p, unsigned long long v) {
  *reinterpret_cast<volatile unsigned long long*>(p) = v;
}

// The launch primitive: the one way the instance units (allreduce_inst.cu, fused_inst.cu) start a
// kernel, host code. `blocks` x `threads` on `stream`, cooperative where asked (every block
// resident at once, or the launch fails: NOTE [channels], device.cuh). Here cudaLaunchKernelEx; in
// the host emulation (csrc/emu/host) a launch on the emulated stream.
template <typename P>
inline cudaError_t launch_kernel(void (*kernel)(P), int blocks, int threads, bool cooperative, cudaStream_t stream,
                                 const P& params) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(blocks));
  cfg.blockDim = dim3(static_cast<unsigned>(threads));
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = cooperative ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, params);
}

}  // namespace gpu
}  // namespace nvrar
