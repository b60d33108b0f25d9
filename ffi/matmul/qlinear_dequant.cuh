// The register-level math every quantized-linear kernel shares (qlinear_kernels.cu: the
// staged and GEMV kernels; qlinear_wgmma_sm90.cu: the Hopper kernel): the exact widening of
// a lane's packed A fragments to T (Dequant), the activation and the output's finish (bias,
// activation in float32). The layout and the math are qlinear_params.h's. No XLA types.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "common/cuda_utils.cuh"
#include "matmul/qlinear_params.h"

namespace jaxgpu::cuda::qlinear {

template <typename T>
constexpr bool kIsBf16 = std::is_same_v<T, __nv_bfloat16>;

// d = a b + c on 16-bit pairs, rounded once (round to nearest even, subnormals kept).
template <typename T>
__device__ __forceinline__ uint32_t Fma2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  if constexpr (kIsBf16<T>) {
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  } else {
    asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  }
  return d;
}

__device__ __forceinline__ uint32_t Prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// (a & mask) | magic in one LOP3 (with two immediates the compiler emits two).
__device__ __forceinline__ uint32_t AndOr(uint32_t a, uint32_t mask, uint32_t magic) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(d) : "r"(a), "r"(mask), "r"(magic));
  return d;
}

// Dequantization of one lane's A fragments. The per-(feature, group) constants of a lane's
// two features (g and g + 8 of its n-tile, h = 0 and 1):
//   16-bit paths: neg[h] = -(magic + z) and scale[h] = s, each as a 16-bit pair;
//   int8 bf16:    negf[h] = -(2^23 + z) and scalef[h] = s, float.
template <typename T, int kBits>
struct Dequant {
  static constexpr bool kFloatPath = kBits == 8 && kIsBf16<T>;
  static constexpr int kMid = 1 << (kBits - 1);
  __host__ __device__ static constexpr uint32_t Magic() {
    return kIsBf16<T> ? 0x4300u : 0x6400u;
  }  // 128 / 1024
  __host__ __device__ static constexpr uint32_t One2() {
    return kIsBf16<T> ? 0x3f803f80u : 0x3c003c00u;
  }

  uint32_t neg[2], scale[2];
  float negf[2], scalef[2];

  // s_row / z_row: the stage's scale / zero row of the block; f: feature of h = 0.
  __device__ __forceinline__ void Load(const uint16_t* s_row, const uint8_t* z_row, int f,
                                       bool has_zeros) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t s = s_row[f + 8 * h];
      const uint32_t z = has_zeros ? uint32_t(z_row[f + 8 * h]) : uint32_t(kMid);
      if constexpr (kFloatPath) {
        scalef[h] = __uint_as_float(s << 16);
        negf[h] = -(8388608.f + float(z));
      } else {
        scale[h] = s * 0x10001u;
        neg[h] = ((Magic() + z) * 0x10001u) ^ 0x80008000u;
      }
    }
  }

  // The four A registers of k16 step s from the lane's raw words (int4: w[0..3] = the
  // tile's 16 bytes; int8: w[0..7], re-ordered by the copy so that w[0..3] is bytes 0..15).
  __device__ __forceinline__ void Step(uint32_t (&a)[4], const uint32_t* w, int s) const {
    if constexpr (kBits == 4) {
      const uint32_t word = w[s];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t v = AndOr(word >> (4 * i), 0x000f000fu, Magic() * 0x10001u);
        a[i] = Fma2<T>(Fma2<T>(v, One2(), neg[i & 1]), scale[i & 1], 0x80008000u);
      }
    } else {
#pragma unroll
      for (int kh = 0; kh < 2; ++kh) {
        const uint32_t word = w[2 * s + kh];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if constexpr (kFloatPath) {
            const float lo = __uint_as_float(Prmt(word, 0x4b000000u, 0x7440u + 2 * h));
            const float hi = __uint_as_float(Prmt(word, 0x4b000000u, 0x7441u + 2 * h));
            const float plo = __fmul_rn(__fadd_rn(lo, negf[h]), scalef[h]);
            const float phi = __fmul_rn(__fadd_rn(hi, negf[h]), scalef[h]);
            uint32_t d;
            asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(phi), "f"(plo));
            a[2 * kh + h] = d;
          } else {
            const uint32_t v = Prmt(word, 0x64646464u, h == 0 ? 0x4140u : 0x4342u);
            a[2 * kh + h] = Fma2<T>(Fma2<T>(v, One2(), neg[h]), scale[h], 0x80008000u);
          }
        }
      }
    }
  }
};

__device__ __forceinline__ float Activate(float v, QActivation act) {
  switch (act) {
    case QActivation::kRelu: return v > 0.f ? v : 0.f;
    case QActivation::kGeluTanh: {
      const float u = 0.7978845608028654f * (v + 0.044715f * v * v * v);
      return 0.5f * v * (1.f + tanhf(u));
    }
    case QActivation::kGeluErf: return 0.5f * v * (1.f + erff(v * 0.7071067811865476f));
    case QActivation::kSilu: return v / (1.f + expf(-v));
    default: return v;
  }
}

template <typename T>
__device__ __forceinline__ float Finish(const QLinearParams& p, float v, int64_t g, int64_t n) {
  if (p.bias != nullptr) {
    const int64_t bg = p.bias_groups == 1 ? 0 : g;
    v += ToFloat(static_cast<const T*>(p.bias)[bg * p.n + n]);
  }
  return Activate(v, p.activation);
}

}  // namespace jaxgpu::cuda::qlinear
