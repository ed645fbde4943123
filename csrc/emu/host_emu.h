// The host half of the emulation layer as a driver sees it (csrc/emu/host_driver.cpp): a machine of
// emulated PEs, each a host thread of this process that the driver binds to its PE, with its own
// CUDA device (host/cuda_runtime.h), its own NVSHMEM state (host/nvshmem.h, host/nvshmemx.h) and
// its own environment. The device half (emu.h) runs the kernels those PEs launch.
//
// Per-PE state of csrc/cuda/runtime.cu (its mutex, registration, executor count, the variables it
// set): thread-local in the emulated build (NVRAR_PER_PROCESS there), so every call of an
// emulated PE comes from the thread bound to it, as every call of a real one comes from its
// process. Streams' worker threads run that PE's device work and call none of it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "emu.h"

namespace nvrar {
namespace emu {
namespace host {

struct MachineConfig {
  int pes = 2;                         // PEs of the machine (their NVSHMEM world may be smaller)
  int G = 1;                           // PEs per emulated node (nvshmem_ptr reaches inside a node)
  uint64_t seed = 1;                   // the device half's proxy
  double collective_timeout_s = 5;     // a collective (or the bootstrap) that not every PE reaches
  int resident = 0;                    // an ordinary launch's block waves (0: every block at once)
  int consistency_delay_us = 0;        // WorldConfig::consistency_delay_us
  size_t max_piece_bytes = 256;
  bool limited_mpg = false;            // init reports NVSHMEM_STATUS_LIMITED_MPG (PEs share a GPU without MPS)
};

// One emulated machine: create it, start one thread per PE, bind each (bind()), and let them
// create executors. Destroyed after every PE thread has ended.
class Machine {
 public:
  explicit Machine(const MachineConfig& cfg);
  ~Machine();
  Machine(const Machine&) = delete;
  Machine& operator=(const Machine&) = delete;
  const MachineConfig& config() const;

  // Binds the calling thread to PE `pe` (and unbinds it at the thread's end).
  void bind(int pe);
  // Failure injection: the `nth` call (1 = the next) of API `what` on PE `pe` fails. `what`: a
  // CUDA function name (cudaMalloc, cudaMemset, cudaMemcpy, cudaHostAlloc, cudaHostGetDevicePointer,
  // cudaEventCreateWithFlags, cudaDeviceSynchronize, cudaSetDevice, cudaFuncGetAttributes,
  // cudaGetDeviceCount), "nvshmem_malloc" (returns NULL after taking part), "nvshmem_init"
  // (the PE's bootstrap fails at once), "version" (another NVSHMEM minor version is loaded),
  // "pe_numbering" (NVSHMEM numbers this PE differently), "bootstrapped" (NVSHMEM's status is
  // bootstrapped, not initialized).
  void inject(int pe, const std::string& what, int nth = 1);
  // The hazards recorded so far (a PE left waiting in a collective, collectives out of step,
  // work that never drained) and clears them.
  std::vector<std::string> take_hazards();
  // The World of the NVSHMEM initialized by the bound PE (nullptr before).
  World* world();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// The bound PE's view (from the thread bound to it).
int bound_pe();
// Initializes NVSHMEM as another library would (nvshmem4py): takes a reference that nvrar's
// executor only joins; finalize_external() drops it.
int init_external(const std::string& uid, int rank, int nranks);
void finalize_external();
// NVSHMEM's init status and reference count of the bound PE.
int nvshmem_refs();
// The bound PE's environment (seeded from the process's at bind time).
const char* env_get(const char* name);
void env_set(const char* name, const char* value);
// Whether the bound PE's context has a sticky error (a kernel trapped).
bool sticky_error();
// Launches fn on stream s of the bound PE (the instance units' launch primitive, prim_emu.h).
int launch(void* stream, int blocks, int threads, bool cooperative, std::function<void()> fn);
// Kernel launches that reached the emulated device on the bound PE (ran or skipped).
uint64_t launches();
// Work enqueued on the bound PE's streams and not finished yet.
uint64_t pending();

}  // namespace host
}  // namespace emu
}  // namespace nvrar
