// The GPU executor as the bindings see it: plain C++ (no CUDA or NVSHMEM headers), so that the
// binding file compiles with the host compiler in seconds. Implementation: runtime.cu (NVSHMEM,
// memory, launch) and allreduce.cu (the fused kernel).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "../protocol/plan.h"
#include "../protocol/types.h"

namespace nvrar {
namespace gpu {

// Every field is set by the caller: the defaults live in one place, Python's settings object
// (nvrar/settings.py) and the selector's launch table. Zero means "not set" and fails the checks
// of the constructor where zero is not a valid value.
struct GpuConfig {
  int rank = 0;
  int world = 0;
  int ranks_per_node = 0;
  int device = 0;                // CUDA device of this rank
  size_t max_bytes = 0;          // largest chunk one round reduces (bytes)
  size_t pool_bytes = 0;         // zero-copy pool (Communicator.empty), bytes
  size_t oneshot_max_bytes = 0;  // kAuto picks one-shot up to this size (bytes)
  size_t ll_max_bytes = 0;       // inter-node shards up to this size go as LL packets
  size_t block_bytes = 0;        // bytes per CUDA block before another block is added
  int max_blocks = 0;            // slices (CUDA blocks) per chunk, at most
  int threads = 0;               // threads per block
  // Messages per peer per inter-node step (NOTE [channels], device.cuh), 1..4. nvrar passes
  // settings.GPU_LAUNCH["channels"] (NVRAR_GPU_CHANNELS, default 1); the emulated driver's cases
  // keep 2, so that its multi-block cases gather slices into more than one channel.
  int channels = 2;
  double timeout_s = 0;          // deadline of every wait (seconds)
};

// Number of CUDA devices (0 where there is no usable driver); `why` says what failed.
int device_count(std::string* why);
// NVSHMEM version the module was compiled against, and the one loaded at run time.
std::string nvshmem_header_version();
std::string nvshmem_library_version();
std::vector<int> cuda_archs();
// The NVSHMEM host library file this module's calls resolve to ("" if unknown).
std::string nvshmem_library_path();
// {my PE, number of PEs} of the NVSHMEM initialized in this process, {-1, -1} before.
std::vector<int> nvshmem_pes();
// The unique id that rank 0 creates and every rank passes to GpuExecutor (128 bytes).
std::string unique_id();
// Sets NVSHMEM_SYMMETRIC_SIZE for a segment of this configuration, unless the user set it.
void set_symmetric_size_default(const GpuConfig& cfg);
// NVSHMEM_* variables this process set for NVSHMEM (never overriding the user's), for logging.
std::vector<std::string> env_set_by_nvrar();
// nvshmemx_init_status() (0 none .. 2 initialized, 3 several PEs per GPU without MPS, 4 with MPS).
int nvshmem_init_status();
// NVSHMEM's own all-reduce on the world team (symmetric buffers): the benchmark's peer.
void nvshmem_reduce(uintptr_t dst, uintptr_t src, size_t count, DType dtype, RedOp op, uintptr_t stream);

class GpuExecutor {
 public:
  // Collective: joins (or initializes) NVSHMEM with the unique id, allocates the symmetric
  // segment, maps the local peers.
  GpuExecutor(const GpuConfig& cfg, const std::string& uid);
  ~GpuExecutor();
  GpuExecutor(const GpuExecutor&) = delete;
  GpuExecutor& operator=(const GpuExecutor&) = delete;

  // Enqueues one fused all-reduce kernel on `stream` (a cudaStream_t as an integer). Raises the
  // failure of an earlier call first, if the device recorded one.
  void all_reduce(uintptr_t in, uintptr_t out, size_t count, DType dtype, RedOp op, Algorithm algorithm,
                  uintptr_t stream);
  // Enqueues the fused all-reduce + residual add + RMSNorm (protocol/epilogue.h) on `stream`:
  // x and residual: rows x h elements, weight: h elements, one dtype (float32, float16, bfloat16),
  // in place (NOTE [fused add + RMSNorm]). One kernel of one block per call (fused_kernel.cuh).
  void all_reduce_add_rms_norm(uintptr_t x, uintptr_t residual, uintptr_t weight, size_t rows, size_t h, DType dtype,
                               float eps, Algorithm algorithm, uintptr_t stream);
  // Synchronize `stream` (0: the legacy default stream), then raise if a kernel recorded a failure.
  void check(uintptr_t stream);
  Algorithm resolve(Algorithm v, size_t bytes) const;
  uint64_t epoch();  // synchronizes the device
  uintptr_t pool_address() const;
  // Whether [p, p + bytes) is reduced without a stage-in copy: in NVSHMEM's symmetric heap
  // (this pool, or nvshmem4py's tensors), 16-byte aligned (runtime.cu, NOTE [symmetric buffers]).
  bool symmetric(uintptr_t p, size_t bytes) const;
  size_t pool_bytes() const;
  const GpuConfig& config() const;
  void close();    // collective (nvshmem_free)
  void abandon();  // not collective: stop using it, leave its memory to the end of the process

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace gpu
}  // namespace nvrar
