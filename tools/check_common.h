// Host helpers shared by the standalone kernel checkers (tools/*_check.cu): CUDA error
// checks and 16-bit float storage on the host.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "common/dtype.h"

#define CK(expr)                                                                           \
  do {                                                                                     \
    cudaError_t e_ = (expr);                                                               \
    if (e_ != cudaSuccess) {                                                               \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

namespace jaxgpu::check {

// The bits of f rounded to bf16 or f16 (round to nearest even).
inline uint16_t HalfBits(DType t, float f) {
  uint16_t u;
  if (t == DType::kBF16) {
    const __nv_bfloat16 b = __float2bfloat16_rn(f);
    std::memcpy(&u, &b, 2);
  } else {
    const __half h = __float2half_rn(f);
    std::memcpy(&u, &h, 2);
  }
  return u;
}

// The value of bf16 or f16 bits.
inline double HalfValue(DType t, uint16_t u) {
  if (t == DType::kBF16) {
    __nv_bfloat16 b;
    std::memcpy(&b, &u, 2);
    return double(__bfloat162float(b));
  }
  __half h;
  std::memcpy(&h, &u, 2);
  return double(__half2float(h));
}

// The spacing of bf16 or f16 at |v| (subnormal spacing below the normal range).
inline double Ulp(DType t, double v) {
  const int mant = t == DType::kBF16 ? 7 : 10;
  const int emin = t == DType::kBF16 ? -126 : -14;
  v = std::fabs(v);
  const int e = v > 0 ? int(std::floor(std::log2(v))) : emin;
  return std::ldexp(1.0, (e < emin ? emin : e) - mant);
}

}  // namespace jaxgpu::check
