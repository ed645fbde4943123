// The kernels' parameters, the device-resident state and the error record: plain structs that
// runtime.cu (host), the kernels (device) and the emulated device driver (csrc/emu) share. No CUDA
// headers.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../common/error.h"
#include "../protocol/round.h"
#include "../protocol/types.h"

namespace nvrar {
namespace gpu {

// ProtocolError::Kind values (common/error.h, their one definition), as the device records them.
using ProtocolErrorKindCode = unsigned;
constexpr ProtocolErrorKindCode kind_code(ProtocolError::Kind k) { return static_cast<ProtocolErrorKindCode>(k); }
constexpr ProtocolErrorKindCode kTimeoutCode = kind_code(ProtocolError::Kind::kTimeout);
constexpr ProtocolErrorKindCode kMismatchCode = kind_code(ProtocolError::Kind::kMismatch);
constexpr ProtocolErrorKindCode kPeerAbortCode = kind_code(ProtocolError::Kind::kPeerAbort);
constexpr ProtocolErrorKindCode kViolationCode = kind_code(ProtocolError::Kind::kViolation);

// NOTE [gpu deadlines]: every wait polls with %globaltimer (nanoseconds, not clock cycles) against
// the communicator's timeout, and checks this rank's abort cell. On expiry, mismatch or abort the
// block claims the rank's failure in device memory (DeviceState::err_claim, atomicCAS: atomic
// among the blocks of this GPU, which host-mapped memory is not), writes the record to
// host-mapped memory (first failure wins), stores an abort record
// into every rank's abort cell (local peers by load/store, remote ones by an NVSHMEM signal), and
// returns: the kernel ends, nothing continues with wrong data, and the host raises at its next
// call or check(). Release builds keep all of this.
struct ErrorRecord {
  unsigned long long code;  // 0: no failure; else the ProtocolError::Kind (claimed first)
  unsigned long long published;  // 1 once every field below is written (set last)
  uint32_t phase;
  int32_t peer;
  int32_t step;
  int32_t origin;           // for an abort: the rank that failed first
  unsigned long long epoch;
  unsigned long long observed;
  // For a call mismatch: what differed (kMismatch*, with the word's index in bits 8..15) and the
  // peer's word against mine, so that a log says which field of which message disagreed.
  uint32_t detail;
  uint32_t pad;
  unsigned long long got;
  unsigned long long want;
};

// ErrorRecord::detail of a call mismatch (low 8 bits; bits 8..15: the word's index).
constexpr uint32_t kMismatchSignature = 1;  // the flag's 16-bit call signature (got, want: the signatures)
constexpr uint32_t kMismatchCellDesc = 2;   // the in-node flag cell's call description, word k
constexpr uint32_t kMismatchTrailer = 3;    // the put's trailer, word k (4: flag word, 5: sender's rank)
constexpr uint32_t kMismatchLLFlag = 4;     // an LL packet's flag: same epoch bits, another signature
constexpr uint32_t kMismatchLLDesc = 5;     // the LL stream's description packets, word k

// Device-resident state of a communicator: the epoch only increases and is advanced by the
// kernel itself, so a CUDA graph that replays the kernel stays in step with its peers.
struct DeviceState {
  unsigned long long epoch;
  unsigned int done;  // blocks of the current kernel that finished
  unsigned int pad;
  unsigned long long err_claim;  // 0, or the kind of this rank's first failure (never reset)
};

struct KernelParams {
  const char* in;
  char* out;
  size_t count;
  uint64_t code;        // the call description's code and shape (protocol/desc.h); its count is
  uint64_t shape;       // `count`, its n the elements of each round
  size_t chunk_elems;
  int es;
  Algorithm algorithm;  // resolved (never kAuto)
  uint32_t sig;
  Scale sc;
  bool in_pool;
  bool out_pool;
  RoundConfig cfg;
  char* my;             // my segment (symmetric address)
  char* const* peers;   // [G]: load/store view of every local rank's segment (nvshmem_ptr)
  DeviceState* state;
  ErrorRecord* err;     // host-mapped
  unsigned long long timeout_ns;
  // Messages per peer per inter-node step (NOTE [channels], device.cuh): the blocks' slices are
  // gathered into this many channel messages; >= the number of blocks: one message per block.
  int channels;
  // Launched eagerly (not captured in a CUDA graph): a kernel that finds its communicator failed
  // at entry returns instead of trapping (NOTE [loud after failure], device.cuh).
  bool eager;
};

// The most channels (NOTE [channels], device.cuh).
constexpr int kMaxChannels = 4;

// The channel count a kernel of `blocks` blocks gathers its slices into (device.cuh set_channel).
NVRAR_HD constexpr int clamp_channels(int channels) {
  return channels < 1 ? 1 : (channels > kMaxChannels ? kMaxChannels : channels);
}

// Whether a launch of `blocks` blocks with these parameters must be cooperative: it gathers slices
// into fewer channels than blocks, so every block must be resident at once (NOTE [epoch
// protocol], "Residency"). allreduce_inst.cu launches by it; the emulated driver runs every other
// launch in block waves (scripts/emulate.sh --waves) by it.
NVRAR_HD constexpr bool cooperative_launch(int channels, int blocks) { return clamp_channels(channels) < blocks; }

// The plain kernel's parameters (transport, flags, epoch, error record) plus the fused call's.
struct FusedParams {
  KernelParams kp;     // kp.in / kp.out: x; kp.count: rows * h; kp.algorithm, kp.sig: the fused call's
  char* res;           // residual, read and written in place
  const char* weight;  // h elements
  size_t rows;
  size_t h;
  size_t chunk_rows;   // rows per round (fused_chunk_rows)
  float eps;
};

}  // namespace gpu
}  // namespace nvrar
