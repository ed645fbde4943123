// The host side of a GPU executor's launch, written once: the segment geometry a configuration
// gives, the call limits, and the kernel parameters of an all_reduce or fused call. runtime.cu
// (the GPU executor) and the emulated device driver (csrc/emu/driver.cpp) both call these, so that
// what the emulation runs is what the GPU executor launches. Host only; no CUDA headers.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "../common/error.h"
#include "../protocol/call.h"
#include "../protocol/desc.h"
#include "../protocol/ll.h"
#include "../protocol/round.h"
#include "../protocol/epilogue.h"
#include "gpu_api.h"
#include "params.h"

namespace nvrar {
namespace gpu {

constexpr size_t kCellStride = 64;  // one cache line per flag cell, as on the CPU

// What a configuration fixes: the layout of this rank, the segment, the round's configuration.
// cfg.max_bytes is normalized (a multiple of 64, at least 4096).
struct ExecutorGeometry {
  GpuConfig cfg;
  Layout where;
  SegmentLayout layout;
  RoundConfig round;
};

inline ExecutorGeometry executor_geometry(const GpuConfig& in) {
  ExecutorGeometry g;
  g.cfg = in;
  g.cfg.max_bytes = std::max<size_t>(in.max_bytes / 64 * 64, 4096);
  g.where = Layout::make(in.world, in.ranks_per_node, in.rank);
  const size_t ll = g.where.N > 1 ? in.ll_max_bytes : 0;
  g.layout = SegmentLayout::make(in.ranks_per_node, g.where.N, g.cfg.max_bytes, in.oneshot_max_bytes, in.pool_bytes,
                                 kCellStride, in.max_blocks, ll, kGpuDescRoom);
  g.round = RoundConfig{g.where, g.layout, false, 0, 0, ll};
  return g;
}

// The call limits of protocol/call.h, with the zero-copy pool at `segment + layout.pool_off`.
inline CallLimits call_limits(const ExecutorGeometry& g, const char* segment) {
  return CallLimits{g.cfg.world,
                    g.where.N,
                    g.cfg.max_bytes,
                    g.cfg.oneshot_max_bytes,
                    g.layout.oneshot_chunk_bytes(),
                    g.cfg.max_blocks,
                    g.cfg.block_bytes,
                    reinterpret_cast<uintptr_t>(segment + g.layout.pool_off),
                    g.layout.pool_bytes};
}

// Where the executor's device objects are (device addresses).
struct DeviceHandles {
  char* segment;        // symmetric
  char* const* peers;   // [G] load/store views of the local ranks' segments
  DeviceState* state;
  ErrorRecord* err;     // host-mapped
};

// The fields of KernelParams that come from the executor, not from the call.
inline void fill_executor_params(KernelParams& kp, const ExecutorGeometry& g, const DeviceHandles& d) {
  kp.cfg = g.round;
  kp.my = d.segment;
  kp.peers = d.peers;
  kp.state = d.state;
  kp.err = d.err;
  kp.timeout_ns = static_cast<unsigned long long>(g.cfg.timeout_s * 1e9);
}

// The slot strides of one all_reduce call across nodes (NOTE [channels], device.cuh): the
// slices' result and zone parts, and their LL streams, follow each other at the stride of this
// call's largest inter-node message (plus the description's room), not of the segment's largest,
// so that a channel's slices form one contiguous message. Every block decides LL or
// put-with-signal alike: by the call's largest message. The same on every rank (the call plan
// and G); the slots stay inside the segment's regions (the stride never exceeds the layout's).
// The largest message is slice 0's (shard 0's, two-shot) of the first chunk, by the call's count:
// a call smaller than a chunk has empty slices after its first, and strides cut for the chunk
// pad every channel message with their full strides (wire ledger, 2x8 512 KB bf16 two-shot:
// 1,836,016 bytes per PE across nodes with the chunk's strides, 918,512 with these; the floor is
// 65,536, and the rest is the empty slices' strides, docs/gpu/emulation.md "Known gaps"). Counts that differ between ranks give different strides:
// where they fall in different powers of two the ranks use different slots, and a mismatch may
// end at the deadline instead of being named (docs/gpu/emulation.md, "Known gaps").
// Only the slices move with the stride: every slot keeps the layout's bytes (NOTE [slot strides],
// plan.h), so that calls of different strides never share a byte between the two parities.
inline void call_strides(KernelParams& kp, const CallPlan& c, size_t count, const ExecutorGeometry& g) {
  if (g.where.N <= 1) return;
  const size_t es = c.es;
  const size_t n0 = count < c.chunk_elems ? count : c.chunk_elems;
  const size_t slice0 = SegmentLayout::chunk_slice(n0, c.chunk_elems, static_cast<int>(es), c.slices, 0).size();
  const size_t exact = c.algorithm == Algorithm::kOneShot
                           ? slice0 * es
                           : shard_range(slice0, static_cast<int>(es), g.where.G, 0).size() * es;
  // Rounded up to a power of two (at most the chunk's): counts that differ a little keep one
  // stride, so that a mismatch meets in the same slots and is named as such.
  const size_t chunk_slice0 = shard_elems(c.chunk_elems, static_cast<int>(es), c.slices);
  const size_t chunk_msg = c.algorithm == Algorithm::kOneShot
                               ? chunk_slice0 * es
                               : shard_elems(chunk_slice0, static_cast<int>(es), g.where.G) * es;
  size_t msg = 64;
  while (msg < exact) msg *= 2;
  if (msg > chunk_msg) msg = chunk_msg;
  // LL or put-with-signal by the step's payload to one peer (every slice's message of the first
  // chunk: what crosses to the partner per step), rounded up to a power of two like the stride;
  // NVRAR_LL_MAX_BYTES on the GPU is that payload's limit (settings.LL_MAX_BYTES, chosen by the
  // wire model). Every block then decides alike (a slice's message is at most the payload).
  size_t payload = 0;
  for (int b = 0; b < c.slices; ++b) {
    const size_t sl = SegmentLayout::chunk_slice(n0, c.chunk_elems, static_cast<int>(es), c.slices, b).size();
    payload += (c.algorithm == Algorithm::kOneShot ? sl : shard_range(sl, static_cast<int>(es), g.where.G, 0).size()) * es;
  }
  size_t payload2 = 64;
  while (payload2 < payload) payload2 *= 2;
  SegmentLayout& L = kp.cfg.L;
  const bool ll = use_ll(kp.cfg, payload2) && use_ll(kp.cfg, msg);
  L.zone_slice_bytes = std::min(L.zone_slice_bytes, align_up(align_up(msg, 8) + kTrailerBytes, 64));
  if (ll) {
    L.ll_slice_bytes = std::min(L.ll_slice_bytes, align_up((kDescPackets + ll_packets(msg)) * 8, 32));
  } else {
    kp.cfg.ll_max_bytes = 0;  // no block of this call uses LL
  }
}

// The parameters of an all_reduce call planned by plan_call (protocol/call.h); launched with
// c.slices blocks of cfg.threads threads.
inline KernelParams allreduce_params(const CallPlan& c, uintptr_t in, uintptr_t out, size_t count, DType dtype,
                                     RedOp op, const ExecutorGeometry& g, const DeviceHandles& d) {
  KernelParams kp{};
  kp.in = reinterpret_cast<const char*>(in);
  kp.out = reinterpret_cast<char*>(out);
  kp.count = count;
  kp.code = call_code(dtype, op, c.algorithm);
  kp.shape = 0;
  kp.chunk_elems = c.chunk_elems;
  kp.es = static_cast<int>(c.es);
  kp.algorithm = c.algorithm;
  kp.sig = c.sig;
  kp.sc = c.sc;
  kp.in_pool = c.in_pool;
  kp.out_pool = c.out_pool;
  fill_executor_params(kp, g, d);
  kp.channels = std::max(1, std::min(g.cfg.channels, c.slices));
  call_strides(kp, c, count, g);
  return kp;
}

// The fused all-reduce + residual add + RMSNorm (protocol/epilogue.h, NOTE [fused add +
// RMSNorm]): the CPU executor's algorithm and chunking (fused_chunk_rows), one kernel launch of ONE
// block that runs the chunks one after the other (fused_kernel.cuh: the fused round's shards are
// cut on row boundaries across the local ranks, not further into per-block slices). Checks the
// call (the messages name `what`); rows >= 1.
inline FusedParams fused_params(const ExecutorGeometry& g, const DeviceHandles& d, uintptr_t x, uintptr_t residual,
                                uintptr_t weight, size_t rows, size_t h, DType dtype, float eps, Algorithm requested) {
  const char* what = "all_reduce_add_rms_norm";
  NVRAR_CHECK(h >= 1, what, ": the hidden size h must be >= 1");
  NVRAR_CHECK(dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16, what, ": dtype ",
              dtype_name(dtype), " is not supported (float32, float16, bfloat16)");
  const size_t es = static_cast<size_t>(dtype_size(dtype));
  NVRAR_CHECK(rows <= SIZE_MAX / h / es, what, ": ", rows, " rows of ", h, " elements overflow");
  const size_t row_bytes = h * es;
  Algorithm v = resolve_algorithm(requested, rows * row_bytes, g.cfg.oneshot_max_bytes);
  NVRAR_CHECK(v == Algorithm::kTwoShot || v == Algorithm::kOneShot, what, ": unknown algorithm code ", static_cast<int>(v));
  const Layout& w = g.where;
  // One block is one slice: a one-shot chunk across nodes must fit one slice's zone (the layout's
  // oneshot_chunk_bytes counts max_blocks slices).
  auto chunk_rows = [&](Algorithm u) {
    size_t c = fused_chunk_rows(g.layout, g.cfg.max_bytes, w.G, w.N, row_bytes, u == Algorithm::kOneShot);
    if (u == Algorithm::kOneShot && w.N > 1)
      c = std::min(c, g.layout.oneshot_chunk_bytes() / static_cast<size_t>(g.layout.B) / row_bytes);
    return c;
  };
  size_t chunk = g.cfg.world == 1 ? rows : chunk_rows(v);
  if (chunk == 0 && v == Algorithm::kOneShot && requested == Algorithm::kAuto) {
    v = Algorithm::kTwoShot;  // a row too long for a one-shot zone (every rank decides alike)
    chunk = chunk_rows(v);
  }
  NVRAR_CHECK(chunk > 0, what, ": a row of h=", h, " ", dtype_name(dtype), " elements (", row_bytes,
              " bytes) does not fit this communicator's ", algorithm_name(v), " round (max_bytes=", g.cfg.max_bytes,
              "); raise max_bytes");
  FusedParams fp{};
  KernelParams& kp = fp.kp;
  kp.in = reinterpret_cast<const char*>(x);
  kp.out = reinterpret_cast<char*>(x);
  kp.count = rows * h;
  // A fused call's description: op byte kFusedOpCode, the bits of eps above the code, h as its shape.
  kp.code = call_code(dtype, static_cast<RedOp>(kFusedOpCode), v) | (static_cast<uint64_t>(float_bits(eps)) << 32);
  kp.shape = h;
  kp.chunk_elems = chunk * h;
  kp.es = static_cast<int>(es);
  kp.algorithm = v;
  kp.sig = fused_signature(rows * h, static_cast<int>(dtype), static_cast<int>(v), h, eps);
  kp.sc = make_scale(RedOp::kSum, 1);
  kp.in_pool = false;
  kp.out_pool = false;
  fill_executor_params(kp, g, d);
  fp.res = reinterpret_cast<char*>(residual);
  fp.weight = reinterpret_cast<const char*>(weight);
  fp.rows = rows;
  fp.h = h;
  fp.chunk_rows = chunk;
  fp.eps = eps;
  // A world of one: the one-shot round with G = N = 1 signals nobody (x is its own sum), then the
  // epilogue.
  if (g.cfg.world == 1) kp.algorithm = Algorithm::kOneShot;
  return fp;
}

}  // namespace gpu
}  // namespace nvrar
