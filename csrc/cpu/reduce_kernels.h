// Host instantiations of the shared slice functions (protocol/slice.h), one per dtype x op,
// compiled for several x86 instruction sets and picked at load time.
#pragma once

#include <cstddef>

#include "../protocol/types.h"

namespace nvrar {

// dst[d] = src[0] op ... op src[nsrc-1] element-wise over n elements, then the avg scale, for
// every destination d < ndst (same bits everywhere).
using ReduceFn = void (*)(void* const* dst, int ndst, const void* const* src, int nsrc, size_t n, Scale sc);

// The kernel for (dtype, op); avg uses the sum kernel (the scale does the rest).
ReduceFn cpu_reduce_fn(DType dtype, RedOp op);

}  // namespace nvrar
