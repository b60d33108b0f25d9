// Integer division by a divisor fixed at launch, as a multiply-high: for index math in
// kernels that divide every row or element index by the same few sizes. No XLA types.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jaxgpu::cuda {

// n / d for n < 2^31 and 1 <= d < 2^31 with a multiply-high instead of a division (~20
// instructions for a 32-bit division, ~70 for a 64-bit one): q = (umulhi(n, mul) + n) >> shift
// with shift = ceil(log2 d) and mul = floor(2^32 (2^shift - d) / d) + 1 (< 2^32 for d < 2^31).
struct FastDiv {
  uint32_t d, mul, shift;
};

inline FastDiv MakeFastDiv(int64_t d) {
  FastDiv f{static_cast<uint32_t>(d), 0, 0};
  while ((uint64_t(1) << f.shift) < uint64_t(d)) ++f.shift;
  f.mul = static_cast<uint32_t>(((uint64_t(1) << 32) * ((uint64_t(1) << f.shift) - d)) / d + 1);
  return f;
}

__device__ __forceinline__ uint32_t Div(const FastDiv& f, uint32_t n) {
  return (__umulhi(n, f.mul) + n) >> f.shift;
}

}  // namespace jaxgpu::cuda
