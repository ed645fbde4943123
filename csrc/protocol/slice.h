// Per-slice work of the NVRAR phases, written once for host and device.
//
// Every function takes a thread-group view (my index in the group, the group size) and works on
// the part of a slice that belongs to this member. The CUDA kernels call them with a block or
// warp view; the CPU executor calls them with a group of one. How the work is split is the only
// difference: on the host each member takes one contiguous piece (cache- and prefetch-friendly),
// on the device members interleave vector by vector (coalesced). The arithmetic of an element
// does not depend on the split, so results are the same bits either way.
#pragma once

#include <cstddef>
#include <cstring>

#include "../common/hd.h"
#include "types.h"

namespace nvrar {

// A group of one: the CPU executor's view.
struct SoloGroup {
  NVRAR_HD int index() const { return 0; }
  NVRAR_HD int size() const { return 1; }
};

// A generic group (a CUDA block: index = threadIdx.x, size = blockDim.x; or all threads of a grid).
struct GroupView {
  int idx;
  int n;
  NVRAR_HD int index() const { return idx; }
  NVRAR_HD int size() const { return n; }
};

namespace detail {

#if NVRAR_ON_DEVICE
// 16-byte vector load/store where the address allows (slices and shards start 16-byte aligned
// in aligned buffers), element by element otherwise. The bits are the same either way.
template <int V, typename T>
__device__ __forceinline__ void load_tile(T (&dst)[V], const T* p) {
  if constexpr (sizeof(T) * V == 16) {
    if ((reinterpret_cast<size_t>(p) & 15) == 0) {
      const uint4 u = *reinterpret_cast<const uint4*>(p);
      memcpy(dst, &u, 16);
      return;
    }
  }
  for (int w = 0; w < V; ++w) dst[w] = p[w];
}
template <int V, typename T>
__device__ __forceinline__ void store_tile(T* p, const T (&src)[V]) {
  if constexpr (sizeof(T) * V == 16) {
    if ((reinterpret_cast<size_t>(p) & 15) == 0) {
      uint4 u;
      memcpy(&u, src, 16);
      *reinterpret_cast<uint4*>(p) = u;
      return;
    }
  }
  for (int w = 0; w < V; ++w) p[w] = src[w];
}
#endif

// Reduce V consecutive elements at `off` (or `len` < V of them, for a tail): canonical source
// order 0..nsrc-1, accumulation in acc_t<T>, optional avg scale, one rounding, then the same bits
// stored to every destination.
template <int V, bool kFull, typename T, typename Op>
NVRAR_KERNEL void reduce_vec(T* const* dst, int ndst, const T* const* src, int nsrc, size_t off, size_t len, Op op,
                         Scale sc) {
  acc_t<T> acc[V];
  const size_t m = kFull ? static_cast<size_t>(V) : len;
#if NVRAR_ON_DEVICE
  if (kFull) {
    // All loads of a batch of up to kBatch sources are issued before any is combined (one memory
    // latency per batch instead of one per source); the combine stays in canonical order
    // 0..nsrc-1, so the bits are those of the host path below.
    constexpr int kBatch = 8;
    T tile[kBatch][V];
    for (int s0 = 0; s0 < nsrc; s0 += kBatch) {
      const int nb = nsrc - s0 < kBatch ? nsrc - s0 : kBatch;
#pragma unroll
      for (int k = 0; k < kBatch; ++k)
        if (k < nb) load_tile<V>(tile[k], src[s0 + k] + off);
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        if (k >= nb) break;
        if (s0 + k == 0) {
          for (int w = 0; w < V; ++w) acc[w] = load_acc(tile[k][w]);
        } else {
          for (int w = 0; w < V; ++w) acc[w] = op(acc[w], load_acc(tile[k][w]));
        }
      }
    }
    if (sc.active()) {
      for (int w = 0; w < V; ++w) acc[w] = sc.apply(acc[w]);
    }
    T out[V];
    for (int w = 0; w < V; ++w) out[w] = store_acc<T>(acc[w]);
    for (int d = 0; d < ndst; ++d) store_tile<V>(dst[d] + off, out);
    return;
  }
#endif
  {
    const T* p = src[0] + off;
    for (size_t w = 0; w < m; ++w) acc[w] = load_acc(p[w]);
  }
  for (int s = 1; s < nsrc; ++s) {
    const T* p = src[s] + off;
    for (size_t w = 0; w < m; ++w) acc[w] = op(acc[w], load_acc(p[w]));
  }
  if (sc.active()) {
    for (size_t w = 0; w < m; ++w) acc[w] = sc.apply(acc[w]);
  }
  T out[V];
  for (size_t w = 0; w < m; ++w) out[w] = store_acc<T>(acc[w]);
  for (int d = 0; d < ndst; ++d) {
    T* q = dst[d] + off;
    for (size_t w = 0; w < m; ++w) q[w] = out[w];
  }
}

}  // namespace detail

// For i in [0, n): r = src[0][i] op src[1][i] op ... op src[nsrc-1][i] (left to right), then the
// avg scale; r is stored to dst[0][i] .. dst[ndst-1][i] (the push of a reduce-scatter result to
// several ranks costs no extra reads). A destination may be one of the sources: each tile is
// loaded completely before any of it is stored.
// V: elements per vector (host: a cache-friendly tile the compiler vectorizes; device: 16 bytes).
template <int V, typename T, typename Op, typename Group>
NVRAR_KERNEL void reduce_slice(const Group& grp, T* const* dst, int ndst, const T* const* src, int nsrc, size_t n, Op op,
                           Scale sc) {
#if NVRAR_ON_DEVICE
  const size_t step = static_cast<size_t>(grp.size()) * V;
  size_t off = static_cast<size_t>(grp.index()) * V;
  for (; off + V <= n; off += step) detail::reduce_vec<V, true>(dst, ndst, src, nsrc, off, V, op, sc);
  if (off < n) detail::reduce_vec<V, false>(dst, ndst, src, nsrc, off, n - off, op, sc);
#else
  // Contiguous piece of whole vectors per member; the last member also takes the tail.
  const size_t nvec = n / V;
  const size_t per = ceil_div(nvec, static_cast<size_t>(grp.size()));
  size_t lo = per * static_cast<size_t>(grp.index());
  size_t hi = lo + per;
  if (lo > nvec) lo = nvec;
  if (hi > nvec) hi = nvec;
  for (size_t v = lo; v < hi; ++v) detail::reduce_vec<V, true>(dst, ndst, src, nsrc, v * V, V, op, sc);
  if (grp.index() == grp.size() - 1 && nvec * V < n)
    detail::reduce_vec<V, false>(dst, ndst, src, nsrc, nvec * V, n - nvec * V, op, sc);
#endif
}

// Two-operand combine of the inter-node steps: dst = op(a, b) with a the lower node's operand.
template <int V, typename T, typename Op, typename Group>
NVRAR_HD void combine_slice(const Group& grp, T* dst, const T* a, const T* b, size_t n, Op op, Scale sc) {
  const T* src[2] = {a, b};
  T* const dsts[1] = {dst};
  reduce_slice<V>(grp, dsts, 1, src, 2, n, op, sc);
}

// dst[i] = src[i] for i in [0, nbytes): stage-in, all-gather, fold-out delivery.
template <typename Group>
NVRAR_HD void copy_slice(const Group& grp, void* dst, const void* src, size_t nbytes) {
#if NVRAR_ON_DEVICE
  // 16-byte words where both ends allow it, bytes otherwise.
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  const bool vec = ((reinterpret_cast<size_t>(d) | reinterpret_cast<size_t>(s)) & 15) == 0;
  size_t done = 0;
  if (vec) {
    const size_t nw = nbytes / 16;
    const uint4* sw = reinterpret_cast<const uint4*>(s);
    uint4* dw = reinterpret_cast<uint4*>(d);
    for (size_t i = grp.index(); i < nw; i += grp.size()) dw[i] = sw[i];
    done = nw * 16;
  }
  for (size_t i = done + grp.index(); i < nbytes; i += grp.size()) d[i] = s[i];
#else
  const size_t per = ceil_div(nbytes, static_cast<size_t>(grp.size()));
  size_t lo = per * static_cast<size_t>(grp.index());
  size_t hi = lo + per;
  if (lo > nbytes) lo = nbytes;
  if (hi > nbytes) hi = nbytes;
  if (hi > lo && dst != src) std::memcpy(static_cast<char*>(dst) + lo, static_cast<const char*>(src) + lo, hi - lo);
#endif
}

// In-place avg scale of a finished slice (used where the last combine could not fuse it).
template <int V, typename T, typename Group>
NVRAR_HD void scale_slice(const Group& grp, T* dst, size_t n, Scale sc) {
  if (!sc.active()) return;
  const T* src[1] = {dst};
  T* const dsts[1] = {dst};
  reduce_slice<V>(grp, dsts, 1, src, 1, n, OpSum{}, sc);
}

}  // namespace nvrar
