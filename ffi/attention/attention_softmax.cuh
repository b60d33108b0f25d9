// The softmax of the attention kernels, shared by every main loop (sm80/: mma.sync,
// sm90/: wgmma): all hold a warp's scores as C tiles of 16 rows (attention_fragments.cuh),
// so the online softmax, the epilogue and the backward's recomputation are one piece of
// code each. No XLA types.
#pragma once

#include <cstdint>

#include "attention/attention_fragments.cuh"
#include "attention/attention_logits.cuh"

namespace jaxgpu::cuda::attention {

// exp2 on the MUFU (ex2.approx.ftz: 2 ulp), the rate-limited unit of the softmax.
__device__ __forceinline__ float FastExp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Row half h (row g, or g + 8) of a warp's 16-row score tile becomes exp2(x * fold - base),
// one FFMA and one ex2 per logit; returns the half row's sum (both softmaxes below).
template <int kN>
__device__ __forceinline__ float ExpRowHalf(float (&acc_s)[kN / 8][4], int h, float fold,
                                            float base) {
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const float pe = FastExp2(fmaf(acc_s[j][2 * h + c], fold, -base));
      acc_s[j][2 * h + c] = pe;
      sum += pe;
    }
  }
  return sum;
}

// Online softmax over one key tile, in the log2 domain, for one of a warp's row tiles of
// 16 rows (rows g and g + 8, reduced over the quad). acc_s holds ToLogits's output and
// becomes the unnormalized probabilities; correction is what the output accumulator's rows
// must be multiplied by. The scores stay unscaled (LogitScale::fold): exp2(x * fold -
// max * fold) is one FFMA and one ex2 per logit.
template <int kN>
__device__ __forceinline__ void OnlineSoftmax(float (&acc_s)[kN / 8][4], float (&row_max)[2],
                                              float (&row_sum)[2], float (&correction)[2],
                                              float fold) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = row_max[h];
#pragma unroll
    for (int j = 0; j < kN / 8; ++j) mx = fmaxf(mx, fmaxf(acc_s[j][2 * h], acc_s[j][2 * h + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    // Nothing visible yet: keep the sums at 0 (exp2(-inf - 0) = 0, never NaN).
    const float base = mx == -INFINITY ? 0.f : mx * fold;
    correction[h] = FastExp2(row_max[h] * fold - base);
    row_max[h] = mx;
    row_sum[h] = row_sum[h] * correction[h] + ExpRowHalf<kN>(acc_s, h, fold, base);
  }
}

// The forward's softmax under a softcap whose range fits P's type (LogitScale::bound): the
// same probabilities up to a per-row factor, with the fixed offset in place of the running
// max, so there is no max reduction over the row and the output accumulator needs no
// rescaling per tile. acc_s becomes the unnormalized probabilities; row_sum adds them up.
template <int kN>
__device__ __forceinline__ void BoundedSoftmax(float (&acc_s)[kN / 8][4], float (&row_sum)[2],
                                               const LogitScale& ls) {
#pragma unroll
  for (int h = 0; h < 2; ++h) row_sum[h] += ExpRowHalf<kN>(acc_s, h, ls.fold, ls.bound);
}

// acc_o's rows times the softmax's correction.
template <int kMT, int kD>
__device__ __forceinline__ void RescaleRows(float (&acc_o)[kMT][kD / 8][4],
                                            const float (&correction)[kMT][2]) {
#pragma unroll
  for (int mi = 0; mi < kMT; ++mi) {
#pragma unroll
    for (int j = 0; j < kD / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[mi][j][e] *= correction[mi][e >> 1];
    }
  }
}

// Epilogue: normalizes and stores a warp's kMT x 16 output rows, rows row0.. of the tile
// that starts at o and lse, tile_row0 rows into the sequence (row stride ld; rows at or
// past seq_len and columns at or past dim are not stored),
// and the natural-log LSE; a row that saw nothing gets o = 0 and lse = -inf.
template <typename T, int kMT, int kD>
__device__ __forceinline__ void StoreOutputRows(T* o, float* lse, int64_t ld,
                                                const float (&acc_o)[kMT][kD / 8][4],
                                                const float (&row_max)[kMT][2],
                                                const float (&row_sum)[kMT][2], float fold,
                                                int row0, int tile_row0, int seq_len, int dim,
                                                int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mi = 0; mi < kMT; ++mi) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = row_sum[mi][h];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const float inv = sum > 0.f ? 1.0f / sum : 0.f;
      const int row = row0 + mi * 16 + g + 8 * h;
      if (tile_row0 + row < seq_len) {
#pragma unroll
        for (int j = 0; j < kD / 8; ++j) {
          const int col = 8 * j + 2 * t;
          if (col < dim) {
            *reinterpret_cast<uint32_t*>(o + row * ld + col) =
                PackPair<T>(acc_o[mi][j][2 * h] * inv, acc_o[mi][j][2 * h + 1] * inv);
          }
        }
        if (t == 0) {
          lse[row] = sum > 0.f ? (row_max[mi][h] * fold + __log2f(sum)) * kLn2 : -INFINITY;
        }
      }
    }
  }
}

// ---- backward: the softmax recomputed from the saved log-sum-exp --------------------------

// Probabilities and score gradients of a score tile. x holds ToLogits's output (-inf where
// masked), dp the products dO V^T; lse2 / delta are the element's query statistics.
// p = exp2(x fold - lse2) (0 where masked, also on rows with nothing visible: RowLse2);
// ds = GradWeight * (dp - delta), where GradWeight is p times the softcap's
// derivative 1 - tanh^2 (p without a softcap); the kernels apply the scale at the end.
__device__ __forceinline__ float ProbOfLogit(float x, float lse2, const LogitScale& ls) {
  return FastExp2(fmaf(x, ls.fold, -lse2));  // lse2 = +inf or x = -inf: exp2(-inf) = 0
}

// The log2-domain LSE of a query row for ProbOfLogit: +inf for rows past the sequence
// (`valid` false) and for rows that saw nothing (lse = -inf), so that every probability of
// such a row is exp2(-inf) = 0 with no per-element test for masked (-inf) logits: x fold -
// lse2 is never -inf - (-inf). The test cost two instructions of the ~7 per score in the
// backward's elementwise phase.
__device__ __forceinline__ float RowLse2(float lse, bool valid) {
  return valid && lse != -INFINITY ? lse * kLog2e : INFINITY;
}

template <bool kSoftcap>
__device__ __forceinline__ float GradWeight(float x, float pr) {
  if (!kSoftcap) return pr;
  // x = tanh(score * scale / cap), so 1 - x^2 lies in [0, 1] and a saturating FMA (clamp
  // to [0, 1]) computes it, taking a masked x = -inf to 0 (not 0 * -inf = NaN) in the same
  // instruction: one per score instead of an FMA and a max.
  float slope;
  asm("fma.rn.sat.f32 %0, %1, %2, 0f3F800000;\n" : "=f"(slope) : "f"(-x), "f"(x));
  return pr * slope;
}

// In place: x becomes p, dp becomes ds.
template <bool kSoftcap>
__device__ __forceinline__ void ProbsAndGrads(float& x, float& dp, float lse2, float delta,
                                              const LogitScale& ls) {
  const float pr = ProbOfLogit(x, lse2, ls);
  dp = GradWeight<kSoftcap>(x, pr) * (dp - delta);
  x = pr;
}

}  // namespace jaxgpu::cuda::attention
