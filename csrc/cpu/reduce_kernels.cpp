#include "reduce_kernels.h"

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../common/error.h"
#include "../protocol/slice.h"

// Multiversioned: the loader picks the widest vector ISA this CPU has. Results do not depend on
// the pick: the element arithmetic is the same IEEE operations in the same order, and the build
// turns floating-point contraction off.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define NVRAR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define NVRAR_CLONES
#endif

namespace nvrar {

namespace {

// Host vector tile: 64 elements per step, a length the compiler vectorizes for every ISA.
constexpr int kHostVec = 64;
// sum_vec's vector of T: unaligned, and allowed to alias T (it reads and writes through it). Named
// as a member, not passed as a template argument (which would drop the attributes).
template <typename T> struct SumVec;
template <> struct SumVec<float> {
  typedef float type __attribute__((vector_size(32), aligned(4), may_alias));
};
template <> struct SumVec<int32_t> {  // unsigned: int32 sums wrap, as OpSum's do
  typedef uint32_t type __attribute__((vector_size(32), aligned(4), may_alias));
};

// NSRC sources known at compile time: the element loop holds one accumulator per element and
// the source loop is unrolled, so the compiler keeps a tile in vector registers. The generic tile
// loop of reduce_slice (a runtime source count) keeps its accumulators on the stack and, for some
// source counts, falls back to scalar adds: 3.6x slower on a 128 KB 4-source reduction in L2
// (7.8 vs 28 us, x86-64-v4). The arithmetic is the same: per element, src[0] op src[1] op ...
// left to right in acc_t<T>, then the scale, one rounding, the same bits to every destination; and
// as there, a tile is read completely before any of it is stored (a destination may be a source).
template <int NSRC, typename T, typename Op>
NVRAR_KERNEL T fold_element(const T* const (&s)[NSRC], size_t i, Op op, bool scale, Scale sc) {
  acc_t<T> a = load_acc(s[0][i]);
  for (int k = 1; k < NSRC; ++k) a = op(a, load_acc(s[k][i]));
  if (scale) a = sc.apply(a);
  return store_acc<T>(a);
}

template <int NSRC, typename T, typename Op>
NVRAR_KERNEL void reduce_fixed(T* const* dst, int ndst, const T* const* src, size_t n, Scale sc, size_t start = 0) {
  const T* s[NSRC];
  for (int k = 0; k < NSRC; ++k) s[k] = src[k];
  const Op op{};
  const bool scale = sc.active();
  T out[kHostVec];
  size_t off = start;
  for (; off + kHostVec <= n; off += kHostVec) {  // whole tiles: a constant trip count
    for (int w = 0; w < kHostVec; ++w) out[w] = fold_element<NSRC>(s, off + w, op, scale, sc);
    for (int d = 0; d < ndst; ++d) std::memcpy(dst[d] + off, out, sizeof(out));
  }
  if (off < n) {  // the tail
    for (size_t w = 0; w < n - off; ++w) out[w] = fold_element<NSRC>(s, off + w, op, scale, sc);
    for (int d = 0; d < ndst; ++d) std::memcpy(dst[d] + off, out, (n - off) * sizeof(T));
  }
}

// Sum of fp32 or int32 (wrapping) with GCC vector types, four 32-byte vectors (32 elements) per
// step, held in registers. Per element the same operations in the same order as reduce_fixed
// (src[0] + src[1] + ... left to right), so the same bits; a destination may be a source (the same
// memory): every element of a step is read before any is stored. About 25% faster than
// reduce_fixed's loop through a stack tile (2 sources into 2 destinations in L2, medians of 2000
// calls, two runs, AMD EPYC family 25 model 1, 2026-12-03: 32 KB 1.37-1.63 us against 1.98-2.00,
// 64 KB 2.94-3.04 against 3.93-3.94).
template <int NSRC, typename T>
NVRAR_KERNEL void sum_vec(T* const* dst, int ndst, const T* const* src, size_t n) {
  using V = typename SumVec<T>::type;
  constexpr size_t kLanes = sizeof(V) / sizeof(T);
  size_t i = 0;
  for (; i + 4 * kLanes <= n; i += 4 * kLanes) {
    const V* s0 = reinterpret_cast<const V*>(src[0] + i);
    V a0 = s0[0], a1 = s0[1], a2 = s0[2], a3 = s0[3];
    for (int k = 1; k < NSRC; ++k) {
      const V* sk = reinterpret_cast<const V*>(src[k] + i);
      a0 += sk[0];
      a1 += sk[1];
      a2 += sk[2];
      a3 += sk[3];
    }
    for (int d = 0; d < ndst; ++d) {
      V* o = reinterpret_cast<V*>(dst[d] + i);
      o[0] = a0;
      o[1] = a1;
      o[2] = a2;
      o[3] = a3;
    }
  }
  if (i < n) reduce_fixed<NSRC, T, OpSum>(dst, ndst, src, n, make_scale(RedOp::kSum, 1), i);  // the tail
}

template <typename T, typename Op>
NVRAR_KERNEL void reduce_impl(void* const* dst, int ndst, const void* const* src, int nsrc, size_t n, Scale sc) {
  // One source, no scale, a type stored as it is accumulated (fp32, int32): the element
  // arithmetic is the identity, so the bits are a copy's (libc's memcpy is 2-3x faster than the
  // tile loop on cached data). fp16/bf16 go through the loop: its conversion quiets NaNs.
  if (std::is_same<acc_t<T>, T>::value && nsrc == 1 && !sc.active()) {
    for (int d = 0; d < ndst; ++d)
      if (dst[d] != src[0]) std::memcpy(dst[d], src[0], n * sizeof(T));
    return;
  }
  T* const* d = reinterpret_cast<T* const*>(dst);
  const T* const* s = reinterpret_cast<const T* const*>(src);
  if constexpr (std::is_same<Op, OpSum>::value && (std::is_same<T, float>::value || std::is_same<T, int32_t>::value)) {
    if (!sc.active()) {
      switch (nsrc) {
        case 2: return sum_vec<2, T>(d, ndst, s, n);
        case 3: return sum_vec<3, T>(d, ndst, s, n);
        case 4: return sum_vec<4, T>(d, ndst, s, n);
        case 5: return sum_vec<5, T>(d, ndst, s, n);
        case 6: return sum_vec<6, T>(d, ndst, s, n);
        case 7: return sum_vec<7, T>(d, ndst, s, n);
        case 8: return sum_vec<8, T>(d, ndst, s, n);
        default: break;
      }
    }
  }
  switch (nsrc) {
    case 1: return reduce_fixed<1, T, Op>(d, ndst, s, n, sc);
    case 2: return reduce_fixed<2, T, Op>(d, ndst, s, n, sc);
    case 3: return reduce_fixed<3, T, Op>(d, ndst, s, n, sc);
    case 4: return reduce_fixed<4, T, Op>(d, ndst, s, n, sc);
    case 5: return reduce_fixed<5, T, Op>(d, ndst, s, n, sc);
    case 6: return reduce_fixed<6, T, Op>(d, ndst, s, n, sc);
    case 7: return reduce_fixed<7, T, Op>(d, ndst, s, n, sc);
    case 8: return reduce_fixed<8, T, Op>(d, ndst, s, n, sc);
    default: reduce_slice<kHostVec>(SoloGroup{}, d, ndst, s, nsrc, n, Op{}, sc);
  }
}

#define NVRAR_DEFINE_REDUCE(NAME, T, OP)                                                                   \
  NVRAR_CLONES void NAME(void* const* dst, int ndst, const void* const* src, int nsrc, size_t n, Scale sc) { \
    reduce_impl<T, OP>(dst, ndst, src, nsrc, n, sc);                                                       \
  }

NVRAR_DEFINE_REDUCE(reduce_f32_sum, float, OpSum)
NVRAR_DEFINE_REDUCE(reduce_f32_max, float, OpMax)
NVRAR_DEFINE_REDUCE(reduce_f32_min, float, OpMin)
NVRAR_DEFINE_REDUCE(reduce_f16_sum, f16, OpSum)
NVRAR_DEFINE_REDUCE(reduce_f16_max, f16, OpMax)
NVRAR_DEFINE_REDUCE(reduce_f16_min, f16, OpMin)
NVRAR_DEFINE_REDUCE(reduce_bf16_sum, bf16, OpSum)
NVRAR_DEFINE_REDUCE(reduce_bf16_max, bf16, OpMax)
NVRAR_DEFINE_REDUCE(reduce_bf16_min, bf16, OpMin)
NVRAR_DEFINE_REDUCE(reduce_i32_sum, int32_t, OpSum)
NVRAR_DEFINE_REDUCE(reduce_i32_max, int32_t, OpMax)
NVRAR_DEFINE_REDUCE(reduce_i32_min, int32_t, OpMin)

#undef NVRAR_DEFINE_REDUCE

}  // namespace

ReduceFn cpu_reduce_fn(DType dtype, RedOp op) {
  static const ReduceFn table[4][3] = {
      {reduce_f32_sum, reduce_f32_max, reduce_f32_min},
      {reduce_f16_sum, reduce_f16_max, reduce_f16_min},
      {reduce_bf16_sum, reduce_bf16_max, reduce_bf16_min},
      {reduce_i32_sum, reduce_i32_max, reduce_i32_min},
  };
  int d = static_cast<int>(dtype);
  int o = op == RedOp::kAvg ? 0 : static_cast<int>(op);
  NVRAR_CHECK(d >= 0 && d < 4 && o >= 0 && o < 3, "unsupported dtype/op code ", d, "/", static_cast<int>(op));
  return table[d][o];
}

}  // namespace nvrar
