// The CPU side of the fused all-reduce + residual add + RMSNorm (protocol/epilogue.h): the
// typed epilogue kernels and their type-erased handle.
#pragma once

#include <cstddef>

#include "../protocol/types.h"

namespace nvrar {

// out/res/sum/res_in: rows x h elements; w: h elements (NOTE [fused add + RMSNorm]).
using EpilogueFn = void (*)(void* out, void* res, const void* sum, const void* res_in, const void* w, size_t rows,
                            size_t h, float eps);

EpilogueFn cpu_epilogue_fn(DType dtype);

// The epilogue of one call, as protocol/epilogue.h calls it: epi(out, res, sum, res_in, rows).
struct RowEpilogue {
  EpilogueFn fn;
  const void* w;
  size_t h;
  float eps;
  void operator()(char* out, char* res, const char* sum, const char* res_in, size_t rows) const {
    if (rows != 0) fn(out, res, sum, res_in, w, rows, h, eps);
  }
};

}  // namespace nvrar
