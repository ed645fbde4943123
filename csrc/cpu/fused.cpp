// CpuExecutor::all_reduce_add_rms_norm and the host epilogue kernels (protocol/epilogue.h).
#include <algorithm>
#include <cstring>

#include "../common/error.h"
#include "../protocol/epilogue.h"
#include "executor.h"
#include "fused.h"

// Multiversioned like the reduce kernels (reduce_kernels.cpp): the same IEEE operations in the
// same order on every ISA, contraction off.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define NVRAR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#define NVRAR_INLINE inline __attribute__((always_inline))
#else
#define NVRAR_CLONES
#define NVRAR_INLINE inline
#endif

namespace nvrar {

namespace {

// A tile of fp32 values rounded to T: store_acc<T>, with bf16's NaN case as a select instead of a
// branch (same bits as to_bf16), so the loop vectorizes.
template <typename T>
NVRAR_INLINE void round_tile(const float* a, T* t) {
  for (int j = 0; j < kNormLanes; ++j) t[j] = store_acc<T>(a[j]);
}
template <>
NVRAR_INLINE void round_tile<bf16>(const float* a, bf16* t) {
  for (int j = 0; j < kNormLanes; ++j) {
    uint32_t u;
    std::memcpy(&u, &a[j], sizeof u);
    const uint32_t nan = (u >> 16) | 0x40u;
    const uint32_t rn = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    t[j].bits = static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rn);
  }
}

// One row of the epilogue in tiles of kNormLanes elements: the same IEEE operations in the same
// order as add_rms_norm_row (protocol/epilogue.h), so the same bits, but each tile goes through
// local arrays, which the compiler vectorizes (no aliasing between the caller's pointers to
// rule out, no loop-carried dependence but the lanes' own sums). Tails run the generic code.
template <typename T>
NVRAR_INLINE void host_row(T* out, T* res, const T* sum, const T* res_in, const T* w, size_t h, float eps) {
  constexpr int V = kNormLanes;
  float p[V];
  for (int j = 0; j < V; ++j) p[j] = 0.0f;
  size_t i = 0;
  for (; i + V <= h; i += V) {
    float a[V];
    T t[V];
    for (int j = 0; j < V; ++j) a[j] = load_acc(res_in[i + j]) + load_acc(sum[i + j]);
    round_tile(a, t);
    for (int j = 0; j < V; ++j) {
      const float rf = load_acc(t[j]);
      p[j] = p[j] + rf * rf;
    }
    std::memcpy(res + i, t, sizeof t);
  }
  for (int j = 0; i + static_cast<size_t>(j) < h; ++j) {
    const T r = store_acc<T>(load_acc(res_in[i + j]) + load_acc(sum[i + j]));
    res[i + j] = r;
    const float rf = load_acc(r);
    p[j] = p[j] + rf * rf;
  }
  const float ms = fold_lanes(p) / static_cast<float>(h);
  const float inv = 1.0f / sqrtf(ms + eps);
  size_t k = 0;
  for (; k + V <= h; k += V) {
    float a[V];
    T t[V];
    for (int j = 0; j < V; ++j) a[j] = load_acc(res[k + j]) * inv * load_acc(w[k + j]);
    round_tile(a, t);
    std::memcpy(out + k, t, sizeof t);
  }
  for (; k < h; ++k) out[k] = store_acc<T>(load_acc(res[k]) * inv * load_acc(w[k]));
}

template <typename T>
NVRAR_INLINE void epilogue_impl(void* out, void* res, const void* sum, const void* res_in, const void* w, size_t rows, size_t h,
                   float eps) {
  for (size_t r = 0; r < rows; ++r)
    host_row(static_cast<T*>(out) + r * h, static_cast<T*>(res) + r * h, static_cast<const T*>(sum) + r * h,
             static_cast<const T*>(res_in) + r * h, static_cast<const T*>(w), h, eps);
}

NVRAR_CLONES void epilogue_f32(void* out, void* res, const void* sum, const void* res_in, const void* w, size_t rows,
                               size_t h, float eps) {
  epilogue_impl<float>(out, res, sum, res_in, w, rows, h, eps);
}
NVRAR_CLONES void epilogue_f16(void* out, void* res, const void* sum, const void* res_in, const void* w, size_t rows,
                               size_t h, float eps) {
  epilogue_impl<f16>(out, res, sum, res_in, w, rows, h, eps);
}
NVRAR_CLONES void epilogue_bf16(void* out, void* res, const void* sum, const void* res_in, const void* w, size_t rows,
                                size_t h, float eps) {
  epilogue_impl<bf16>(out, res, sum, res_in, w, rows, h, eps);
}

}  // namespace

EpilogueFn cpu_epilogue_fn(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return epilogue_f32;
    case DType::kFloat16: return epilogue_f16;
    case DType::kBFloat16: return epilogue_bf16;
    default: break;
  }
  NVRAR_CHECK(false, "all_reduce_add_rms_norm: dtype ", dtype_name(dtype), " is not supported (float32, float16, "
              "bfloat16)");
  return nullptr;
}

void CpuExecutor::all_reduce_add_rms_norm(void* x, void* residual, const void* weight, size_t rows, size_t h,
                                          DType dtype, float eps, Algorithm requested) {
  const char* what = "all_reduce_add_rms_norm";
  NVRAR_CHECK(!closing_.load(std::memory_order_acquire), what, ": the communicator is closed");
  std::unique_lock<std::mutex> lock(busy_, std::try_to_lock);
  NVRAR_CHECK(lock.owns_lock(), what, ": another thread is using this communicator; calls on one communicator "
              "must be serialized");
  NVRAR_CHECK(failure_.empty(), what, ": this communicator failed earlier and cannot be used again: ", failure_);
  NVRAR_CHECK(heap_.mine() != nullptr, what, ": the communicator is closed");
  NVRAR_CHECK(heap_.attached() || cfg_.world == 1, what, ": the communicator is not set up");
  NVRAR_CHECK(h >= 1, what, ": the hidden size h must be >= 1");
  const EpilogueFn efn = cpu_epilogue_fn(dtype);
  const RowEpilogue epi{efn, weight, h, eps};
  if (rows == 0) return;
  const size_t es = static_cast<size_t>(dtype_size(dtype));
  NVRAR_CHECK(rows <= SIZE_MAX / h / es, what, ": ", rows, " rows of ", h, " elements overflow");
  const size_t row_bytes = h * es;
  char* px = static_cast<char*>(x);
  char* pr = static_cast<char*>(residual);
  if (cfg_.world == 1) {
    epi(px, pr, px, pr, rows);
    return;
  }
  Algorithm v = resolve(requested, rows * row_bytes);
  NVRAR_CHECK(v == Algorithm::kTwoShot || v == Algorithm::kOneShot, what, ": unknown algorithm code ", static_cast<int>(v));
  size_t chunk = fused_chunk_rows(layout_, cfg_.max_bytes, where_.G, where_.N, row_bytes, v == Algorithm::kOneShot);
  if (chunk == 0 && v == Algorithm::kOneShot && requested == Algorithm::kAuto) {
    v = Algorithm::kTwoShot;  // a row too long for a one-shot zone (every rank decides alike)
    chunk = fused_chunk_rows(layout_, cfg_.max_bytes, where_.G, where_.N, row_bytes, false);
  }
  NVRAR_CHECK(chunk > 0, what, ": a row of h=", h, " ", dtype_name(dtype), " elements (", row_bytes,
              " bytes) does not fit this communicator's ", algorithm_name(v), " round (max_bytes=", cfg_.max_bytes,
              "); raise max_bytes");
  const uint32_t sig = fused_signature(rows * h, static_cast<int>(dtype), static_cast<int>(v), h, eps);
  note_call(rows * h, dtype, kFusedOpCode, v, h, eps);
  start_call_placement();  // NOTE [moving apart]
  const ReduceFn fn = cpu_reduce_fn(dtype, RedOp::kSum);
  if (v == Algorithm::kOneShot && fused_scratch_.size() < std::min(chunk, rows) * row_bytes)
    fused_scratch_.resize(std::min(chunk, rows) * row_bytes);
  for (size_t r0 = 0; r0 < rows; r0 += chunk) {
    const size_t n = std::min(chunk, rows - r0);
    const FusedSlice s{px + r0 * row_bytes, px + r0 * row_bytes, pr + r0 * row_bytes, n, h, es, 0};
    fused_round(s, v, sig, fn, epi, fused_scratch_.data());
  }
}

}  // namespace nvrar
