// The additive bias and the boolean mask of the attention kernels (attention_params.h),
// shared by every main loop that takes them: per element, on the tiles a warp computes,
// read straight from global memory with per-dimension strides (stride 0 on a broadcast dim,
// so a (1, N, T, S) bias is read in place, never expanded); and the bias gradient, written
// by the dQ kernel (each (b, n, i, j) is computed there exactly once). Only the kernels
// compiled with kExtra read them: the plain kernels compile to the code they had. No XLA
// types.
//
// Napkin math: the forward does 4 H FLOPs per logit and a 16-bit bias adds 2 bytes to read
// per logit: 256 FLOP/byte at H = 128, about the H100's ridge (800 TFLOP/s over 3 TB/s).
// So a full (B, N, T, S) bias streamed from HBM costs about as much time as the products
// themselves, while one broadcast over B (or N) is re-read from L2 by the other rows.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "attention/attention_logits.cuh"
#include "attention/attention_params.h"
#include "common/dtype.h"

namespace jaxgpu::cuda::attention {

template <typename T>
__device__ __forceinline__ float LoadScalar(const void* base, int64_t at) {
  const T v = static_cast<const T*>(base)[at];
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat162float(v);
  } else {
    return __half2float(v);
  }
}

// Where the bias and mask of one (batch row, kv head) start. Everything else (pointers,
// strides, T, S, the bias's dtype and unit) is read from the kernel's parameters where it is
// used. Copied into this struct and held across the main loop, those values cost registers
// the kernels (at 255) did not have: sm_80 ptxas spills went forward H = 128 120 -> 112
// bytes (80 with a softcap, was 96), H = 96 156 -> 44, dQ H = 128 with a softcap 64 -> 0.
// Offsets are formed per element: each row's 64-bit offsets hoisted out of the column loop
// kept more values live and spilled more (forward H = 128: 276 bytes, dQ 208).
struct Extras {
  int64_t bias_head;  // offset of (b, kh, 0, 0, 0) in the bias (and dbias)
  int64_t mask_head;  // in the mask

  __device__ __forceinline__ static bool Any(const AttentionParams& p) {
    return p.bias != nullptr || p.mask != nullptr;
  }

  // Offset of query head r's (i, j) element in the bias (and dbias).
  __device__ __forceinline__ int64_t BiasAt(const AttentionParams& p, int r, int i, int j) const {
    return bias_head + r * p.bias_stride[2] + i * p.bias_stride[3] + j * p.bias_stride[4];
  }

  // The logit x (ToLogits's output, -inf where masked by position or segment) of query i,
  // key j, with the bias added and the mask applied; -inf outside [0, T) x [0, S). T: the
  // kernel's element type (the bias is T or float32).
  template <typename T>
  __device__ __forceinline__ float Apply(const AttentionParams& p, float x, int r, int i,
                                         int j) const {
    if (i >= static_cast<int>(p.q_len) || j >= static_cast<int>(p.kv_len)) return -INFINITY;
    if (p.mask != nullptr && __ldg(p.mask + mask_head + r * p.mask_stride[2] +
                                   i * p.mask_stride[3] + j * p.mask_stride[4]) == 0) {
      return -INFINITY;
    }
    if (p.bias != nullptr) {
      const int64_t at = BiasAt(p, r, i, j);
      const float b = p.bias_dtype == DType::kF32 ? __ldg(static_cast<const float*>(p.bias) + at)
                                                  : LoadScalar<T>(p.bias, at);
      x += b * p.bias_scale;
    }
    return x;
  }

  // dL/dbias of element (r, i, j): g = p (dp - delta), the gradient of the logit after the
  // softcap (the bias is added there). Stored by the one thread that computes it, or added
  // atomically where the bias broadcasts (zeros add nothing: masked elements skip it).
  __device__ __forceinline__ void AddBiasGrad(const AttentionParams& p, float g, int r, int i,
                                              int j) const {
    if (p.dbias == nullptr || i >= static_cast<int>(p.q_len) || j >= static_cast<int>(p.kv_len)) {
      return;
    }
    float* at = p.dbias + BiasAt(p, r, i, j);
    if (!p.dbias_atomic) {
      *at = g;
    } else if (g != 0.f) {
      atomicAdd(at, g);
    }
  }
};

__device__ __forceinline__ Extras MakeExtras(const AttentionParams& p, int64_t b, int64_t kh) {
  return {b * p.bias_stride[0] + kh * p.bias_stride[1],
          b * p.mask_stride[0] + kh * p.mask_stride[1]};
}

// A warp's 16 x kN score tile (C fragments, attention_logits.cuh's element order) through
// Extras::Apply: rows row0.., columns col0.. (kTransposed: rows are keys, columns queries).
template <typename T, bool kTransposed, int kN>
__device__ __forceinline__ void ApplyExtras(float (&acc)[kN / 8][4], const AttentionParams& p,
                                            const Extras& ex, int r, int row0, int col0, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int lr = g + 8 * (e >> 1), lc = 8 * j + 2 * t + (e & 1);
      const int i = kTransposed ? col0 + lc : row0 + lr;
      const int k = kTransposed ? row0 + lr : col0 + lc;
      acc[j][e] = ex.Apply<T>(p, acc[j][e], r, i, k);
    }
  }
}

}  // namespace jaxgpu::cuda::attention
