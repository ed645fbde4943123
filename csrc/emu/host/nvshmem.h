// The host half of the emulation layer: NVSHMEM's host API as the GPU executor's host code uses
// it (csrc/cuda/runtime.cu), emulated (csrc/emu/host_emu.cpp; the device calls are prim_emu.h's).
// Found only through the host build's include path (-Icsrc/emu/host); the GPU build never sees it.
//
//   init           a unique id names a bootstrap; the PEs that pass it rendezvous (with a deadline:
//                  the emulation's stand-in for the bootstrap's own) and get one emulated World;
//                  an init when NVSHMEM is initialized already takes a reference (a join)
//   symmetric heap each PE's segment (NVSHMEM_SYMMETRIC_SIZE from the PE's environment); the
//                  allocations are collective and must come in the same sizes in the same order
//   collectives    nvshmem_malloc, nvshmem_free, nvshmem_barrier_all, the reductions and
//                  nvshmem_finalize wait for every PE with a deadline; a PE left waiting (another
//                  PE never came) or a PE that came to another collective is recorded as a
//                  hazard (host_emu.h) that fails the case, instead of the hang it is on a GPU
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda_runtime.h"

#define NVSHMEM_VENDOR_MAJOR_VERSION 3
#define NVSHMEM_VENDOR_MINOR_VERSION 4
#define NVSHMEM_VENDOR_PATCH_VERSION 5

enum nvshmem_status_t {
  NVSHMEM_STATUS_NOT_INITIALIZED = 0,
  NVSHMEM_STATUS_IS_BOOTSTRAPPED,
  NVSHMEM_STATUS_IS_INITIALIZED,
  NVSHMEM_STATUS_LIMITED_MPG,
  NVSHMEM_STATUS_FULL_MPG,
};

using nvshmem_team_t = int;
constexpr nvshmem_team_t NVSHMEM_TEAM_WORLD = 0;
constexpr int NVSHMEM_THREAD_SERIALIZED = 2;

int nvshmem_my_pe();
int nvshmem_n_pes();
void* nvshmem_malloc(size_t bytes);
void nvshmem_free(void* p);
void nvshmem_barrier_all();
void nvshmem_finalize();
int nvshmem_int_max_reduce(nvshmem_team_t team, int* dest, const int* source, size_t nreduce);
// nvshmem_ptr: prim_emu.h (the same function for host and device code).
