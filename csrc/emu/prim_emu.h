// The device primitives of csrc/cuda/prim.cuh, emulated on the host (g++ -DNVRAR_EMULATE): the
// device code compiles unchanged against these names and runs as plain threads.
//
//   one OS thread per CUDA thread; a kernel launch starts every block of every PE at once (or, in
//                     block waves, at most k of a PE's blocks at a time: World::launch_pe)
//   __syncthreads     a barrier of the block WITH a deadline: a barrier that some thread never
//                     reaches aborts the process with a message naming PE, block and threads
//   shared memory     NVRAR_SHARED: one object per block (filled with garbage at launch)
//   atomics/fences    std::atomic_ref with the orders of the PTX they stand for; CUDA atomics are
//                     relaxed; fences are seq_cst fences (plus a fence model for ThreadSanitizer,
//                     which ignores fences: emu.cpp, NOTE [tsan fences])
//   %globaltimer      std::chrono::steady_clock
//   warp shuffles     the 32 lanes of a warp exchange through a warp barrier (full mask only)
//   NVSHMEM           PEs are thread groups of one process; their segments are symmetric by
//                     offset. nvshmem_ptr is non-null inside an emulated node, and across nodes
//                     only in the direct mode; puts across nodes go through an adversarial proxy
//                     thread (emu.cpp, NOTE [adversarial proxy])
// Nothing here knows the protocol.
#pragma once

#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if !defined(NVRAR_EMULATE)
#error "prim_emu.h is the host emulation of the device primitives: build with -DNVRAR_EMULATE"
#endif

// Qualifiers: plain host functions.
#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__

struct uint3 {
  unsigned x, y, z;
};
using dim3 = uint3;
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};

// Thread identity, set by the emulated launch for every thread it starts.
inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local uint3 blockDim;
inline thread_local uint3 gridDim;

#define NVSHMEM_SIGNAL_SET 0
#define NVSHMEM_CMP_GE 5

namespace nvrar {
namespace emu {

// The runtime side (emu.cpp).
void* block_shared(size_t bytes, size_t align);  // this block's next shared object
void syncthreads();
[[noreturn]] void trap();
void warp_exchange(uint32_t v, uint32_t* lanes);  // lanes[32] of my warp after everyone wrote
void fence(bool system);
void nanosleep(unsigned ns);
uint64_t now_ns();
// The wire ledger (emu.h WireOp): on only while World::set_recording(true), set between launches,
// so the check costs the suite one load and branch per primitive.
extern bool g_wire_record;
void wire_store(const void* p, bool release);  // a system-scope store at p (any segment)
// The fence model for ThreadSanitizer (emu.cpp, NOTE [tsan fences]): called before a relaxed
// atomic store or read-modify-write, and after a relaxed atomic load or read-modify-write.
#if defined(__SANITIZE_THREAD__)
void tsan_store(const void* p);
void tsan_load(const void* p);
#else
inline void tsan_store(const void*) {}
inline void tsan_load(const void*) {}
#endif

}  // namespace emu
}  // namespace nvrar

#define NVRAR_SHARED(Type, name) \
  Type& name = *static_cast<Type*>(::nvrar::emu::block_shared(sizeof(Type), alignof(Type)))

inline void __syncthreads() { ::nvrar::emu::syncthreads(); }
inline void __threadfence() { ::nvrar::emu::fence(false); }
inline void __threadfence_system() { ::nvrar::emu::fence(true); }
inline void __nanosleep(unsigned ns) { ::nvrar::emu::nanosleep(ns); }
// __trap(): the emulated PE's context gets a sticky error (World::trapped) and the calling
// thread ends (the emulation ends only the threads that trap; on a GPU the whole grid ends).
[[noreturn]] inline void device_trap() { ::nvrar::emu::trap(); }

inline int atomicCAS(int* p, int expected, int desired) {
  ::nvrar::emu::tsan_store(p);
  std::atomic_ref<int>(*p).compare_exchange_strong(expected, desired, std::memory_order_relaxed);
  ::nvrar::emu::tsan_load(p);
  return expected;
}
inline unsigned long long atomicCAS(unsigned long long* p, unsigned long long expected, unsigned long long desired) {
  ::nvrar::emu::tsan_store(p);
  std::atomic_ref<unsigned long long>(*p).compare_exchange_strong(expected, desired, std::memory_order_relaxed);
  ::nvrar::emu::tsan_load(p);
  return expected;
}
inline unsigned atomicAdd(unsigned* p, unsigned v) {
  ::nvrar::emu::tsan_store(p);
  const unsigned old = std::atomic_ref<unsigned>(*p).fetch_add(v, std::memory_order_relaxed);
  ::nvrar::emu::tsan_load(p);
  return old;
}
inline unsigned atomicExch(unsigned* p, unsigned v) {
  ::nvrar::emu::tsan_store(p);
  const unsigned old = std::atomic_ref<unsigned>(*p).exchange(v, std::memory_order_relaxed);
  ::nvrar::emu::tsan_load(p);
  return old;
}

inline float __shfl_down_sync(unsigned mask, float v, unsigned delta) {
  uint32_t lanes[32];
  uint32_t u;
  std::memcpy(&u, &v, 4);
  (void)mask;
  ::nvrar::emu::warp_exchange(u, lanes);
  const unsigned lane = threadIdx.x % 32;
  if (lane + delta < 32) u = lanes[lane + delta];
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}
inline float __shfl_sync(unsigned mask, float v, int src) {
  uint32_t lanes[32];
  uint32_t u;
  std::memcpy(&u, &v, 4);
  (void)mask;
  ::nvrar::emu::warp_exchange(u, lanes);
  u = lanes[static_cast<unsigned>(src) % 32];
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}

// IEEE round-to-nearest single-precision operations (the build has -ffp-contract=off: no FMA).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

namespace nvrar {
namespace gpu {

inline uint64_t globaltimer() { return ::nvrar::emu::now_ns(); }
inline void st_release_sys(uint64_t* p, uint64_t v) {
  if (::nvrar::emu::g_wire_record) ::nvrar::emu::wire_store(p, true);
  std::atomic_ref<uint64_t>(*p).store(v, std::memory_order_release);
}
inline void st_relaxed_sys(uint64_t* p, uint64_t v) {
  if (::nvrar::emu::g_wire_record) ::nvrar::emu::wire_store(p, false);
  ::nvrar::emu::tsan_store(p);
  std::atomic_ref<uint64_t>(*p).store(v, std::memory_order_relaxed);
}
inline uint64_t ld_acquire_sys(const uint64_t* p) {
  return std::atomic_ref<uint64_t>(*const_cast<uint64_t*>(p)).load(std::memory_order_acquire);
}
inline uint64_t ld_relaxed_sys(const uint64_t* p) {
  const uint64_t v = std::atomic_ref<uint64_t>(*const_cast<uint64_t*>(p)).load(std::memory_order_relaxed);
  ::nvrar::emu::tsan_load(p);
  return v;
}
inline void st_relaxed_sys_v2(uint64_t* p, uint64_t a, uint64_t b) {
  st_relaxed_sys(p, a);
  st_relaxed_sys(p + 1, b);
}
inline void ld_relaxed_sys_v2(const uint64_t* p, uint64_t& a, uint64_t& b) {
  a = ld_relaxed_sys(p);
  b = ld_relaxed_sys(p + 1);
}
inline int ld_volatile(const int* p) {
  const int v = std::atomic_ref<int>(*const_cast<int*>(p)).load(std::memory_order_relaxed);
  ::nvrar::emu::tsan_load(p);
  return v;
}
inline unsigned long long ld_volatile(const unsigned long long* p) {
  const unsigned long long v =
      std::atomic_ref<unsigned long long>(*const_cast<unsigned long long*>(p)).load(std::memory_order_relaxed);
  ::nvrar::emu::tsan_load(p);
  return v;
}
inline void st_volatile(unsigned long long* p, unsigned long long v) {
  ::nvrar::emu::tsan_store(p);
  std::atomic_ref<unsigned long long>(*p).store(v, std::memory_order_relaxed);
}

}  // namespace gpu
}  // namespace nvrar

// NVSHMEM's device calls, with their block-collective semantics (the _block calls are made by
// every thread of the block; emu.cpp).
void* nvshmem_ptr(const void* dest, int pe);
void nvshmemx_putmem_signal_nbi_block(void* dest, const void* source, size_t bytes, uint64_t* sig_addr,
                                      uint64_t signal, int sig_op, int pe);
void nvshmemx_putmem_nbi_block(void* dest, const void* source, size_t bytes, int pe);
void nvshmemx_signal_op(uint64_t* sig_addr, uint64_t signal, int sig_op, int pe);
void nvshmem_fence();
void nvshmem_uint64_wait_until(uint64_t* ivar, int cmp, uint64_t cmp_value);

// The launch primitive (prim_cuda.cuh's launch_kernel) in the host half of
// the emulation (-DNVRAR_EMU_HOST, scripts/emulate.sh --host): a launch on the emulated stream,
// which starts the kernel on the emulated device when the stream reaches it (host_emu.cpp).
#if defined(NVRAR_EMU_HOST)
#include <functional>

#include "host/cuda_runtime.h"

namespace nvrar {
namespace emu {
namespace host {
int launch(void* stream, int blocks, int threads, bool cooperative, std::function<void()> fn);
}  // namespace host
}  // namespace emu
namespace gpu {
template <typename P>
inline cudaError_t launch_kernel(void (*kernel)(P), int blocks, int threads, bool cooperative, cudaStream_t stream,
                                 const P& params) {
  return static_cast<cudaError_t>(
      ::nvrar::emu::host::launch(stream, blocks, threads, cooperative, [kernel, params]() { kernel(params); }));
}
// kernel_max_threads: prim.cuh (both builds: the emulated cudaFuncGetAttributes answers here).
}  // namespace gpu
}  // namespace nvrar
#endif
