// bfloat16 / float16 <-> float32 conversions for the CPU handlers (no CUDA headers here).
// Round-to-nearest-even, NaN preserved: bit-identical to ml_dtypes and to the CUDA
// intrinsics, so CPU and GPU results agree in the last bit of the storage type.
#pragma once

#include <cstdint>
#include <cstring>

#include "common/dtype.h"

namespace jaxgpu::cpu {

inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t FloatToBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float Bf16ToFloat(uint16_t h) { return BitsToFloat(uint32_t(h) << 16); }

inline uint16_t FloatToBf16(float f) {
  uint32_t u = FloatToBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline float F16ToFloat(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return BitsToFloat(sign | 0x7f800000u | (man << 13));  // inf / nan
  if (exp == 0) {
    if (man == 0) return BitsToFloat(sign);
    // Subnormal: value = man * 2^-24.
    float v = float(man) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  return BitsToFloat(sign | ((exp + 112u) << 23) | (man << 13));
}

inline uint16_t FloatToF16(float f) {
  const uint32_t u = FloatToBits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t au = u & 0x7fffffffu;
  if (au > 0x7f800000u) return uint16_t(sign | 0x7e00u);   // NaN
  if (au >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // overflow -> inf
  if (au < 0x38800000u) {                                  // subnormal or zero
    // Scale so that the half subnormal quantum (2^-24) becomes 1, round to nearest even.
    const float scaled = BitsToFloat(au) * 16777216.0f;  // exact (power of two)
    uint32_t m = uint32_t(scaled);
    const float rem = scaled - float(m);
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
    return uint16_t(sign | m);
  }
  uint32_t r = au + 0xfffu + ((au >> 13) & 1u);  // round mantissa
  r -= 0x38000000u;                              // rebias 127 -> 15
  return uint16_t(sign | (r >> 13));
}

// float8_e4m3fn (bias 7, 3 mantissa bits, no infinities, 0x7f / 0xff NaN, max 448).
inline float F8E4M3ToFloat(uint8_t c) {
  const uint32_t exp = (c >> 3) & 0xfu, man = c & 0x7u;
  float v;
  if ((c & 0x7fu) == 0x7fu) {
    v = BitsToFloat(0x7fc00000u);
  } else if (exp == 0) {
    v = float(man) * 0.001953125f;  // subnormal: man * 2^-9
  } else {
    v = BitsToFloat(((exp + 120u) << 23) | (man << 20));
  }
  return (c & 0x80u) ? -v : v;
}

// Round to nearest even, saturating: a finite value past 448 gives +-448 (CUDA's
// __NV_SATFINITE), NaN gives NaN.
inline uint8_t FloatToF8E4M3Sat(float f) {
  const uint32_t u = FloatToBits(f);
  const uint8_t sign = uint8_t((u >> 24) & 0x80u);
  const uint32_t au = u & 0x7fffffffu;
  if (au > 0x7f800000u) return uint8_t(sign | 0x7fu);
  if (au < 0x3c800000u) {  // below 2^-6: subnormal or zero
    // Scale so that the subnormal quantum (2^-9) becomes 1, round to nearest even; 8 is
    // the smallest normal's code, so rounding up into it needs no special case.
    const float scaled = BitsToFloat(au) * 512.0f;  // exact (power of two)
    uint32_t m = uint32_t(scaled);
    const float rem = scaled - float(m);
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
    return uint8_t(sign | m);
  }
  if (au >= 0x43e00000u) return uint8_t(sign | 0x7eu);  // >= 448
  uint32_t r = au + 0x7ffffu + ((au >> 20) & 1u);       // round the mantissa to 3 bits
  r -= 0x3c000000u;                                     // rebias 127 -> 7
  const uint32_t code = r >> 20;
  return uint8_t(sign | (code > 0x7eu ? 0x7eu : code));
}

// n elements from offset `at` of a buffer holding `t`, to / from float. One dtype switch
// per row keeps the per-element loops branch-free (and vectorizable). `t` is one of
// kFloatDTypes (the handlers admit no other, CheckDType); LoadFloats also reads the 8-bit
// KV cache's int8 and float8_e4m3fn values (exact in float). Any other type loads as NaN,
// stores nothing and round-trips to NaN, so a misuse shows in the output instead of
// passing.
inline void LoadFloats(const void* p, DType t, int64_t at, int64_t n, float* out) {
  switch (t) {
    case DType::kF32: {
      const float* src = static_cast<const float*>(p) + at;
      for (int64_t i = 0; i < n; ++i) out[i] = src[i];
      break;
    }
    case DType::kBF16: {
      const uint16_t* src = static_cast<const uint16_t*>(p) + at;
      for (int64_t i = 0; i < n; ++i) out[i] = Bf16ToFloat(src[i]);
      break;
    }
    case DType::kF16: {
      const uint16_t* src = static_cast<const uint16_t*>(p) + at;
      for (int64_t i = 0; i < n; ++i) out[i] = F16ToFloat(src[i]);
      break;
    }
    case DType::kS8: {
      const int8_t* src = static_cast<const int8_t*>(p) + at;
      for (int64_t i = 0; i < n; ++i) out[i] = float(src[i]);
      break;
    }
    case DType::kF8E4M3: {
      const uint8_t* src = static_cast<const uint8_t*>(p) + at;
      for (int64_t i = 0; i < n; ++i) out[i] = F8E4M3ToFloat(src[i]);
      break;
    }
    default:
      for (int64_t i = 0; i < n; ++i) out[i] = BitsToFloat(0x7fc00000u);
      break;
  }
}

inline void StoreFloats(void* p, DType t, int64_t at, int64_t n, const float* in) {
  switch (t) {
    case DType::kF32: {
      float* dst = static_cast<float*>(p) + at;
      for (int64_t i = 0; i < n; ++i) dst[i] = in[i];
      break;
    }
    case DType::kBF16: {
      uint16_t* dst = static_cast<uint16_t*>(p) + at;
      for (int64_t i = 0; i < n; ++i) dst[i] = FloatToBf16(in[i]);
      break;
    }
    case DType::kF16: {
      uint16_t* dst = static_cast<uint16_t*>(p) + at;
      for (int64_t i = 0; i < n; ++i) dst[i] = FloatToF16(in[i]);
      break;
    }
    default: break;
  }
}

// Round a float to the storage type and back (what a store followed by a load gives).
inline float RoundTrip(float v, DType t) {
  switch (t) {
    case DType::kF32: return v;
    case DType::kBF16: return Bf16ToFloat(FloatToBf16(v));
    case DType::kF16: return F16ToFloat(FloatToF16(v));
    default: return BitsToFloat(0x7fc00000u);
  }
}

}  // namespace jaxgpu::cpu
