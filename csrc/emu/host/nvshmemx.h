// The host half of the emulation layer: NVSHMEM's extended host API (unique-id initialization,
// status, version, the on-stream reductions) as csrc/cuda/runtime.cu uses it; see nvshmem.h.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../../protocol/types.h"
#include "cuda_runtime.h"
#include "nvshmem.h"

struct nvshmemx_uniqueid_t {
  char bytes[128];
};
#define NVSHMEMX_UNIQUEID_INITIALIZER \
  {}

struct nvshmemx_init_attr_t {
  int rank = -1;
  int nranks = 0;
  nvshmemx_uniqueid_t id{};
};
#define NVSHMEMX_INIT_ATTR_INITIALIZER \
  {}
constexpr unsigned NVSHMEMX_INIT_WITH_UNIQUEID = 0x4;

struct nvshmemi_version_t {
  int major, minor, patch;
};

int nvshmemx_get_uniqueid(nvshmemx_uniqueid_t* id);
int nvshmemx_set_attr_uniqueid_args(int rank, int nranks, const nvshmemx_uniqueid_t* id, nvshmemx_init_attr_t* attr);
int nvshmemi_init_thread(int requested, int* provided, unsigned flags, nvshmemx_init_attr_t* attr,
                         nvshmemi_version_t version);
int nvshmemx_init_status();
void nvshmemx_vendor_get_version_info(int* major, int* minor, int* patch);

// NVSHMEM's 16-bit types as nvrar stores them (protocol/types.h).
using half = ::nvrar::f16;
using __nv_bfloat16 = ::nvrar::bf16;

#define NVRAR_EMU_DECL_REDUCE(NAME, T)                                                                      \
  int nvshmemx_##NAME##_sum_reduce_on_stream(nvshmem_team_t, T* dest, const T* src, size_t n, cudaStream_t); \
  int nvshmemx_##NAME##_max_reduce_on_stream(nvshmem_team_t, T* dest, const T* src, size_t n, cudaStream_t); \
  int nvshmemx_##NAME##_min_reduce_on_stream(nvshmem_team_t, T* dest, const T* src, size_t n, cudaStream_t);
NVRAR_EMU_DECL_REDUCE(float, float)
NVRAR_EMU_DECL_REDUCE(half, half)
NVRAR_EMU_DECL_REDUCE(bfloat16, __nv_bfloat16)
NVRAR_EMU_DECL_REDUCE(int, int)
#undef NVRAR_EMU_DECL_REDUCE
