// The host side of one all_reduce call, written once for both executors: the algorithm kAuto
// resolves to, the chunking (chunk size, slices), the call signature, the pool membership of the
// buffers, the avg scale, the call description of error messages and the failure text. The CPU
// executor (csrc/cpu/executor.cpp) and the GPU runtime (csrc/cuda/runtime.cu) both call it, so
// both cut a call the same way and word their failures alike. Host only; no CUDA headers.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>

#include "../common/error.h"
#include "phase.h"
#include "plan.h"
#include "types.h"

namespace nvrar {

// What an executor's configuration fixes for every call.
struct CallLimits {
  int world;
  int nodes;                   // N (a one-shot chunk across nodes must fit a zone slice whole)
  size_t max_bytes;            // largest chunk one round reduces (bytes; a multiple of 64)
  size_t oneshot_max_bytes;    // kAuto picks one-shot up to this many bytes
  size_t oneshot_chunk_bytes;  // SegmentLayout::oneshot_chunk_bytes() of the executor's segment
  int max_blocks;              // slices per chunk at most (1 on the CPU)
  size_t block_bytes;          // bytes per slice before another slice is added (GPU; unused when max_blocks == 1)
  uintptr_t pool;              // the executor's zero-copy pool (Communicator.empty)
  size_t pool_bytes;
};

// How one call runs, identical on every rank that makes the same call.
struct CallPlan {
  Algorithm algorithm;  // resolved: kTwoShot or kOneShot
  size_t es;            // element size (bytes)
  size_t bytes;         // count * es
  size_t chunk_elems;   // elements per round (the last round may be short)
  int slices;           // slices per chunk (CUDA blocks; 1 on the CPU)
  uint32_t sig;         // call signature carried by every flag (plan.h)
  Scale sc;             // the avg scale
  bool in_pool;         // the input lies in the pool: peers read it in place
  bool out_pool;        // the output lies in the pool: peers write into it directly
};

inline bool is_dtype(DType t) {
  switch (t) {
    case DType::kFloat32:
    case DType::kFloat16:
    case DType::kBFloat16:
    case DType::kInt32: return true;
  }
  return false;
}

inline bool is_op(RedOp op) {
  switch (op) {
    case RedOp::kSum:
    case RedOp::kMax:
    case RedOp::kMin:
    case RedOp::kAvg: return true;
  }
  return false;
}

// The algorithm `requested` runs as for a message of `bytes`: kAuto is one-shot up to the
// one-shot threshold, two-shot above it.
inline Algorithm resolve_algorithm(Algorithm requested, size_t bytes, size_t oneshot_max_bytes) {
  if (requested != Algorithm::kAuto) return requested;
  return bytes <= oneshot_max_bytes ? Algorithm::kOneShot : Algorithm::kTwoShot;
}

// "all_reduce(count=..., dtype=..., op=..., algorithm=...)", as error messages name a call.
inline std::string describe_call(uint64_t count, DType dtype, RedOp op, Algorithm algorithm) {
  std::ostringstream os;
  os << "all_reduce(count=" << count << ", dtype=" << dtype_name(dtype) << ", op=" << op_name(op)
     << ", algorithm=" << algorithm_name(algorithm) << ")";
  return os.str();
}

// The call description packed into one word (dtype | op << 8 | algorithm << 16), as the CPU
// flag cells carry it (NOTE [call description], csrc/cpu/segment.h), and unpacked.
inline uint64_t call_code(DType dtype, RedOp op, Algorithm algorithm) {
  return static_cast<uint64_t>(static_cast<uint32_t>(dtype) & 0xffu) |
         (static_cast<uint64_t>(static_cast<uint32_t>(op) & 0xffu) << 8) |
         (static_cast<uint64_t>(static_cast<uint32_t>(algorithm) & 0xffu) << 16);
}
inline DType code_dtype(uint64_t code) { return static_cast<DType>(code & 0xff); }
inline RedOp code_op(uint64_t code) { return static_cast<RedOp>((code >> 8) & 0xff); }
inline Algorithm code_algorithm(uint64_t code) { return static_cast<Algorithm>((code >> 16) & 0xff); }
inline std::string describe_call(uint64_t count, uint64_t code) {
  return describe_call(count, code_dtype(code), code_op(code), code_algorithm(code));
}

// The plan of one call of `count` elements from `in` to `out` (addresses). Checks the codes
// (they come from Python as integers) and the size.
inline CallPlan plan_call(const CallLimits& lim, uintptr_t in, uintptr_t out, size_t count, DType dtype, RedOp op,
                          Algorithm requested) {
  NVRAR_CHECK(is_dtype(dtype), "all_reduce: unknown dtype code ", static_cast<int>(dtype));
  NVRAR_CHECK(is_op(op), "all_reduce: unknown op code ", static_cast<int>(op));
  CallPlan c{};
  c.es = static_cast<size_t>(dtype_size(dtype));
  NVRAR_CHECK(count <= SIZE_MAX / c.es, "all_reduce: count ", count, " overflows");
  c.bytes = count * c.es;
  c.algorithm = resolve_algorithm(requested, c.bytes, lim.oneshot_max_bytes);
  NVRAR_CHECK(c.algorithm == Algorithm::kTwoShot || c.algorithm == Algorithm::kOneShot,
              "all_reduce: unknown algorithm code ", static_cast<int>(c.algorithm));
  // Slices: one per block_bytes, at most max_blocks; every rank computes the same. A chunk keeps
  // the per-slice share of max_bytes (and of the one-shot limit across nodes), 64-byte aligned.
  const size_t mb = static_cast<size_t>(lim.max_blocks > 1 ? lim.max_blocks : 1);
  size_t B = 1;
  if (mb > 1 && lim.block_bytes > 0) B = std::min(mb, std::max<size_t>(1, ceil_div(c.bytes, lim.block_bytes)));
  c.slices = static_cast<int>(B);
  size_t chunk_bytes = lim.max_bytes / mb * B;
  if (c.algorithm == Algorithm::kOneShot && lim.nodes > 1)
    chunk_bytes = std::min(chunk_bytes, lim.oneshot_chunk_bytes / mb * B);
  chunk_bytes = std::max<size_t>(chunk_bytes / 64 * 64, 64);
  c.chunk_elems = chunk_bytes / c.es;
  c.sig = call_signature(count, static_cast<int>(dtype), static_cast<int>(op), static_cast<int>(c.algorithm));
  c.sc = make_scale(op, lim.world);
  c.in_pool = in >= lim.pool && in + c.bytes <= lim.pool + lim.pool_bytes;
  c.out_pool = out >= lim.pool && out + c.bytes <= lim.pool + lim.pool_bytes;
  return c;
}

// "timed out after T s": what a rank whose own wait expired reports.
inline std::string timeout_text(double timeout_s) {
  std::ostringstream os;
  os << "timed out after " << timeout_s << " s";
  return os.str();
}

// The message of a failed wait, on both executors: "nvrar: rank R: WHAT (phase P, step S, waiting
// for rank Q, expected epoch E, observed epoch O)".
inline std::string failure_text(int rank, const std::string& what, Phase phase, int step, int peer, uint64_t epoch,
                                uint64_t observed) {
  std::ostringstream os;
  os << "nvrar: rank " << rank << ": " << what << " (phase " << phase_name(phase) << ", step " << step
     << ", waiting for rank " << peer << ", expected epoch " << epoch << ", observed epoch " << observed << ")";
  return os.str();
}

}  // namespace nvrar
