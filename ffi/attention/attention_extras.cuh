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

// The bias and mask of one (batch row, kv head), and the storage bounds T, S: positions
// past them are never read. T is the kernel's element type (bias of type T or float32).
template <typename T>
struct Extras {
  const void* bias;
  const uint8_t* mask;
  float* dbias;
  int64_t bias_head, bias_r, bias_i, bias_j;  // bias offset of (b, kh, 0, 0, 0), strides
  int64_t mask_head, mask_r, mask_i, mask_j;
  bool bias_f32;
  bool dbias_atomic;
  float bias_mul;  // bias to the kernels' logit units (LogitScale::fold / log2(e))
  int q_len, kv_len;

  __device__ __forceinline__ bool Any() const { return bias != nullptr || mask != nullptr; }

  // Offset of query head r's (i, j) element in the bias (and dbias).
  __device__ __forceinline__ int64_t BiasAt(int r, int i, int j) const {
    return bias_head + r * bias_r + i * bias_i + j * bias_j;
  }

  // The logit x (ToLogits's output, -inf where masked by position or segment) of query i,
  // key j, with the bias added and the mask applied; -inf outside [0, T) x [0, S). Offsets
  // are formed per element where they are used: the forward kernels sit at 255 registers,
  // and row offsets hoisted out of the column loops (64-bit values live across them) spilled
  // more (sm_80 ptxas, H = 128: forward 120 -> 276 bytes, dQ 0 -> 208).
  __device__ __forceinline__ float Apply(float x, int r, int i, int j) const {
    if (i >= q_len || j >= kv_len) return -INFINITY;
    if (mask != nullptr && __ldg(mask + mask_head + r * mask_r + i * mask_i + j * mask_j) == 0) {
      return -INFINITY;
    }
    if (bias != nullptr) {
      const int64_t at = BiasAt(r, i, j);
      const float b =
          bias_f32 ? __ldg(static_cast<const float*>(bias) + at) : LoadScalar<T>(bias, at);
      x += b * bias_mul;
    }
    return x;
  }

  // dL/dbias of element (r, i, j): g = p (dp - delta), the gradient of the logit after the
  // softcap (the bias is added there). Stored by the one thread that computes it, or added
  // atomically where the bias broadcasts (zeros add nothing: masked elements skip it).
  __device__ __forceinline__ void AddBiasGrad(float g, int r, int i, int j) const {
    if (dbias == nullptr || i >= q_len || j >= kv_len) return;
    float* at = dbias + BiasAt(r, i, j);
    if (!dbias_atomic) {
      *at = g;
    } else if (g != 0.f) {
      atomicAdd(at, g);
    }
  }
};

template <typename T>
__device__ __forceinline__ Extras<T> MakeExtras(const AttentionParams& p, int64_t b, int64_t kh,
                                                const LogitScale& ls) {
  Extras<T> e;
  e.bias = p.bias;
  e.mask = p.mask;
  e.dbias = p.dbias;
  e.bias_head = b * p.bias_stride[0] + kh * p.bias_stride[1];
  e.bias_r = p.bias_stride[2];
  e.bias_i = p.bias_stride[3];
  e.bias_j = p.bias_stride[4];
  e.mask_head = b * p.mask_stride[0] + kh * p.mask_stride[1];
  e.mask_r = p.mask_stride[2];
  e.mask_i = p.mask_stride[3];
  e.mask_j = p.mask_stride[4];
  e.bias_f32 = p.bias_dtype == DType::kF32;
  e.dbias_atomic = p.dbias_atomic;
  e.bias_mul = kLog2e / ls.fold;
  e.q_len = static_cast<int>(p.q_len);
  e.kv_len = static_cast<int>(p.kv_len);
  return e;
}

// A warp's 16 x kN score tile (C fragments, attention_logits.cuh's element order) through
// Extras::Apply: rows row0.., columns col0.. (kTransposed: rows are keys, columns queries).
template <bool kTransposed, int kN, typename T>
__device__ __forceinline__ void ApplyExtras(float (&acc)[kN / 8][4], const Extras<T>& ex, int r,
                                            int row0, int col0, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int lr = g + 8 * (e >> 1), lc = 8 * j + 2 * t + (e & 1);
      const int i = kTransposed ? col0 + lc : row0 + lr;
      const int k = kTransposed ? row0 + lr : col0 + lc;
      acc[j][e] = ex.Apply(acc[j][e], r, i, k);
    }
  }
}

}  // namespace jaxgpu::cuda::attention
