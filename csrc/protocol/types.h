// Element types, reduction ops and their arithmetic, shared by host and device.
//
// Half types (fp16, bf16) are stored as raw 16-bit words and accumulate in fp32; every
// conversion rounds to nearest even, so the CPU and GPU executors round identically.
#pragma once

#include <cstdint>
#include <cstring>

#include "../common/hd.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace nvrar {

// The one definition of the dtype and op codes: Python reads them from nvrar._C.DTYPE_CODES,
// OP_CODES and ELEMENT_SIZES (bindings.cpp); never renumber.
enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kInt32 = 3 };
enum class RedOp : int32_t { kSum = 0, kMax = 1, kMin = 2, kAvg = 3 };

NVRAR_HD int dtype_size(DType t) { return t == DType::kFloat16 || t == DType::kBFloat16 ? 2 : 4; }

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kInt32: return "int32";
  }
  return "?";
}

inline const char* op_name(RedOp op) {
  switch (op) {
    case RedOp::kSum: return "sum";
    case RedOp::kMax: return "max";
    case RedOp::kMin: return "min";
    case RedOp::kAvg: return "avg";
  }
  return "?";
}

// Storage types. Distinct structs so that templates never confuse fp16 with bf16 bits.
struct f16 { uint16_t bits; };
struct bf16 { uint16_t bits; };

NVRAR_HD uint32_t float_bits(float f) {
#if NVRAR_ON_DEVICE
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

NVRAR_HD float bits_float(uint32_t u) {
#if NVRAR_ON_DEVICE
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// bf16 <-> fp32. Round to nearest even; NaN stays a (quiet) NaN.
NVRAR_HD float to_float(bf16 x) { return bits_float(static_cast<uint32_t>(x.bits) << 16); }

NVRAR_HD bf16 to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(u >> 16)};
}

// fp16 <-> fp32, IEEE binary16 with subnormals, round to nearest even. Written as integer
// selects without branches, so that the host compiler vectorizes a reduction loop over them (with
// -fno-trapping-math, setup.py: the branchy form, never vectorized, ran at about 1 GB/s); every
// case is computed and one is picked.
// Checked against the branchy definition for all 2^16 fp16 and all 2^32 fp32 inputs.
NVRAR_HD float to_float(f16 x) {
  const uint32_t h = x.bits;
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu;
  const uint32_t m = h & 0x3ffu;
  const uint32_t normal = ((e + 112u) << 23) | (m << 13);                   // exponent 15 -> 127
  const uint32_t special = 0x7f800000u | (m << 13);                          // inf / NaN
  const uint32_t sub = float_bits(static_cast<float>(static_cast<int32_t>(m)) * 5.9604644775390625e-08f);
  // zero / subnormal: m * 2^-24, exact in fp32 (a normal fp32, so flush-to-zero modes agree)
  uint32_t mag = e == 0 ? sub : normal;
  mag = e == 0x1fu ? special : mag;
  return bits_float(sign | mag);
}

NVRAR_HD f16 to_f16(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  // Normal result: rebias the exponent, round the 13 dropped mantissa bits to nearest even.
  uint32_t r = a - 0x38000000u;
  r += 0xfffu + ((r >> 13) & 1u);
  const uint32_t normal = r >> 13;
  // Subnormal or zero result (a < 2^-14): the significand shifted right by 126 - exponent (at
  // least 14; from 25 on the result is 0, so the shift stops at 31), rounded to nearest even
  // (add half an ulp less one, plus the kept lowest bit, then shift). Exponents that pick another
  // case below get a shift in range all the same.
  const uint32_t E = a >> 23;
  const uint32_t M = (a & 0x7fffffu) | 0x800000u;
  uint32_t s = 126u - E;
  s = s > 31u ? 31u : s;
  s = s < 14u ? 14u : s;
  const uint32_t sub = (M + ((1u << (s - 1u)) - 1u) + ((M >> s) & 1u)) >> s;
  uint32_t mag = a >= 0x38800000u ? normal : sub;
  mag = a >= 0x477ff000u ? 0x7c00u : mag;  // overflow -> inf
  mag = a > 0x7f800000u ? 0x7e00u : mag;   // NaN: the canonical quiet NaN
  return f16{static_cast<uint16_t>(sign | mag)};
}

// Accumulator type and conversions: fp32 for floating types, int32 for int32.
template <typename T> struct Acc { using type = T; };
template <> struct Acc<f16> { using type = float; };
template <> struct Acc<bf16> { using type = float; };
template <typename T> using acc_t = typename Acc<T>::type;

NVRAR_HD float load_acc(float x) { return x; }
NVRAR_HD int32_t load_acc(int32_t x) { return x; }
NVRAR_HD float load_acc(f16 x) { return to_float(x); }
NVRAR_HD float load_acc(bf16 x) { return to_float(x); }

template <typename T> NVRAR_HD T store_acc(acc_t<T> v);
template <> NVRAR_HD float store_acc<float>(float v) { return v; }
template <> NVRAR_HD int32_t store_acc<int32_t>(int32_t v) { return v; }
template <> NVRAR_HD f16 store_acc<f16>(float v) { return to_f16(v); }
template <> NVRAR_HD bf16 store_acc<bf16>(float v) { return to_bf16(v); }

// Binary ops on accumulators. Floating max/min propagate NaN, like torch (torch.amax, maximum,
// gloo): if either operand is a NaN the result is the canonical quiet NaN (fp32 0x7fc00000, which
// stores as fp16 0x7e00 and bf16 0x7fc0), whatever the payloads, so every rank stores the same
// bits. Signed zeros follow IEEE 754-2019 maximum/minimum: max(-0, +0) = +0 and min(-0, +0) = -0
// in either order (torch.maximum returns its first operand there; nvrar does not depend on the
// order). Equal operands combine their bits with AND (max) / OR (min), which only matters for
// zeros. Operand order is canonical (lower rank first) at every call site anyway. Written as
// selects, so that the host compiler vectorizes them.
NVRAR_HD float canonical_nan() { return bits_float(0x7fc00000u); }

struct OpSum {
  NVRAR_HD float operator()(float a, float b) const { return a + b; }
  // Wrapping int32 addition: defined behaviour, identical on every rank.
  NVRAR_HD int32_t operator()(int32_t a, int32_t b) const {
    return static_cast<int32_t>(static_cast<uint32_t>(a) + static_cast<uint32_t>(b));
  }
};
struct OpMax {
  NVRAR_HD float operator()(float a, float b) const {
    const float m = a > b ? a : b;
    const float z = a == b ? bits_float(float_bits(a) & float_bits(b)) : m;  // +0 wins over -0
    return (a != a || b != b) ? canonical_nan() : z;
  }
  NVRAR_HD int32_t operator()(int32_t a, int32_t b) const { return b > a ? b : a; }
};
struct OpMin {
  NVRAR_HD float operator()(float a, float b) const {
    const float m = a < b ? a : b;
    const float z = a == b ? bits_float(float_bits(a) | float_bits(b)) : m;  // -0 wins over +0
    return (a != a || b != b) ? canonical_nan() : z;
  }
  NVRAR_HD int32_t operator()(int32_t a, int32_t b) const { return b < a ? b : a; }
};

// The post-reduction scale of avg: multiply by 1/W in fp32; integer avg divides, truncating
// toward zero (like C).
struct Scale {
  float inv;     // 1/W, used by floating types
  int32_t div;   // W, used by int32; 1 or 0 disables scaling
  NVRAR_HD bool active() const { return div > 1; }
  NVRAR_HD float apply(float v) const { return v * inv; }
  NVRAR_HD int32_t apply(int32_t v) const { return v / div; }
};

NVRAR_HD Scale make_scale(RedOp op, int world) {
  Scale s;
  if (op == RedOp::kAvg && world > 1) {
    s.inv = 1.0f / static_cast<float>(world);
    s.div = world;
  } else {
    s.inv = 1.0f;
    s.div = 1;
  }
  return s;
}

}  // namespace nvrar
