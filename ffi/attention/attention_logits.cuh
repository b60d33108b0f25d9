// Scores to logits, shared by every main loop: the scale and the softcap, folded so that the
// softmax's exp2 takes them in one FFMA per logit, and the mask applied per element. No XLA
// types.
#pragma once

#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "attention/attention_mask.cuh"
#include "attention/attention_params.h"
#include "common/dtype.h"

namespace jaxgpu::cuda::attention {

// Scores to logits up to a positive factor, in place, and -inf where masked: the softmax
// multiplies ToLogits's output by LogitScale::fold inside its exp2 argument (one FFMA per
// logit, exp2(x * fold - max * fold)); masking and the max commute with a positive factor
// (the handler requires scale > 0). Without a softcap the output is the raw score and
// fold = scale * log2(e); with a softcap it is tanh(score * scale / cap) and
// fold = cap * log2(e), the backward's softcap slope 1 - tanh^2 then reads off the output
// directly. Element e of n-tile j of a warp's 16 x kN tile is at row row0 + g + 8 * (e / 2),
// column col0 + 8 j + 2 t + (e % 2). Query/key swap roles in the dK/dV kernel
// (kTransposed: rows are keys, columns queries).
struct LogitScale {
  float scale;
  float tanh_in;  // softcap: scale / cap; 0 without one
  float fold;     // multiplier of ToLogits's output in the exp2 argument
  float bound;    // softcap: the forward's fixed softmax offset (BoundedSoftmax); NaN: none
};

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// A softcap bounds every logit to [-cap, cap], so the forward's softmax may subtract one
// fixed offset (log2 domain) instead of the running row max: exp2(x * fold - bound) with
// x = tanh(..) in [-1, 1] has exponents [-fold - bound, fold - bound], which must lie in
// [min_exp, max_exp] for P's type:
// - bfloat16: min_exp -100 keeps P normal (2^-126) with 26 binades to spare, so that P V
//   products with |v| >= 2^-26 stay normal float32 numbers; max_exp 48 leaves float32 sums
//   over up to 2^31 keys room for |v| < 2^48. Caps up to 51.2 fit (Gemma 2's 50).
// - float16: P within its normal range [2^-14, 2^15]. Caps up to 10 fit.
// The offset is the largest that keeps the smallest probability above min_exp, at most
// fold (then p <= 1, as with the row max). Other caps keep the online softmax.
inline float BoundedSoftmaxOffset(float fold, DType dtype) {
  const bool bf16 = dtype == DType::kBF16;
  const float min_exp = bf16 ? -100.f : -14.f, max_exp = bf16 ? 48.f : 15.f;
  if (2.f * fold > max_exp - min_exp) return NAN;
  return fold < -min_exp - fold ? fold : -min_exp - fold;
}

inline LogitScale MakeLogitScale(float scale, float cap, DType dtype) {
  LogitScale s;
  s.scale = scale;
  s.tanh_in = cap > 0.f ? scale / cap : 0.f;
  s.fold = (cap > 0.f ? cap : scale) * kLog2e;
  s.bound = cap > 0.f ? BoundedSoftmaxOffset(s.fold, dtype) : NAN;
  return s;
}

// tanh of one value, tanh.approx.f32 (sm_75+): a MUFU op per logit, but none of the pair's
// three conversions (to f16x2 and back), and 2^-10.99 relative precision.
__device__ __forceinline__ float TanhF32(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// tanh of two values with one MUFU op: tanh.approx.f16x2 (sm_75+). The softmax's ex2 per
// logit already runs on the MUFU (16 ops/clk/SM); a softcap's tanh.approx.f32 per logit
// doubled that unit's load, the packed form adds half (H100, H = 128, T = 4096, softcap +
// segment ids: backward 190 -> 200 TFLOP/s, forward unchanged at ~275). Precision: the
// inputs round to fp16 (2^-12 relative) and the result is fp16 (2^-12 relative, plus the
// approximation's ~2^-11): about 2^-10 relative on the capped logit, below a bf16 logit's
// own rounding (2^-9) and close to tanh.approx.f32's 2^-10.99.
__device__ __forceinline__ void TanhPair(float& a, float& b) {
  const __half2 in = __floats2half2_rn(a, b);
  uint32_t out;
  asm("tanh.approx.f16x2 %0, %1;\n" : "=r"(out) : "r"(*reinterpret_cast<const uint32_t*>(&in)));
  const float2 r = __half22float2(*reinterpret_cast<const __half2*>(&out));
  a = r.x;
  b = r.y;
}

// row_seg / col_seg: the segment ids of rows row0.. and columns col0.. staged in shared
// memory, or nullptr without segment ids. kSoftcap is a template switch: the cap costs
// half a MUFU op per logit (a whole one with kTanhF32, the Hopper forward's choice), which
// the plain kernels must not carry. The mask is one branch per
// tile around its own loop: a per-element `if (masked)` compiled to a branch per logit
// that broke up the softmax's schedule (the maskable forward ran at 2/3 the plain one).
template <bool kTransposed, int kN, bool kSoftcap, bool kTanhF32 = false>
__device__ __forceinline__ void ToLogits(float (&acc)[kN / 8][4], const LogitScale& ls,
                                         const Mask& mask, bool masked, int row0, int col0,
                                         const int32_t* row_seg, const int32_t* col_seg, int lane) {
  if (kSoftcap) {
#pragma unroll
    for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        float a = acc[j][e] * ls.tanh_in, b = acc[j][e + 1] * ls.tanh_in;
        if (kTanhF32) {
          a = TanhF32(a);
          b = TanhF32(b);
        } else {
          TanhPair(a, b);
        }
        acc[j][e] = a;
        acc[j][e + 1] = b;
      }
    }
  }
  if (!masked) return;
  const int g = lane >> 2, t = lane & 3;
  int32_t rs[2] = {0, 0};
  if (row_seg != nullptr) rs[0] = row_seg[g], rs[1] = row_seg[g + 8];
#pragma unroll
  for (int j = 0; j < kN / 8; ++j) {
    int32_t cs[2] = {0, 0};
    if (row_seg != nullptr) cs[0] = col_seg[8 * j + 2 * t], cs[1] = col_seg[8 * j + 2 * t + 1];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int lr = g + 8 * (e >> 1), lc = 8 * j + 2 * t + (e & 1);
      const int i = kTransposed ? col0 + lc : row0 + lr;
      const int k = kTransposed ? row0 + lr : col0 + lc;
      const bool ok = mask.Visible(i, k) && rs[e >> 1] == cs[e & 1];
      if (!ok) acc[j][e] = -INFINITY;
    }
  }
}

}  // namespace jaxgpu::cuda::attention
