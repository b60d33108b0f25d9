// Device pieces every softmax kernel shares: the launch arguments, the NaN-propagating max
// and the exp, the fixed-order row reductions, and the staging of a row into shared memory.
// No XLA types.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/cuda_utils.cuh"
#include "common/fast_div.cuh"
#include "softmax/softmax_params.h"

namespace jaxgpu::cuda::softmax {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -__builtin_huge_valf();
// Vectors a thread owns in the staged kernels: the keep bits of 8 vectors of 8 elements fill
// one 64-bit register pair, and 8 x 1024 threads cover S = 65536 bf16 (128 KiB staged).
constexpr int kMaxVpt = 8;
constexpr int kMaxThreads = 1024;
// Rows narrower than this many threads share a block: 256-thread blocks let 8 blocks
// (2048 threads) share an SM at <= 32 registers, and keep the reductions' barriers cheap.
constexpr int kBlockThreads = 256;
// Shared scratch of the block reductions: 32 floats per row, at most 4 rows per block when
// a row spans more than one warp (tpr >= 64 and 256-thread blocks), 2 values (max, sum).
constexpr int kScratchFloats = 4 * 32 * 2;
constexpr int64_t kScratchBytes = sizeof(float) * kScratchFloats;

// What the kernels get: the params plus the precomputed divisions of the row index.
struct FwdArgs {
  SoftmaxFwdParams p;
  FastDiv dims[kSoftmaxMaxDims];
  FastDiv query;
  bool fast;  // rows < 2^31: the row index math runs in 32 bits with FastDiv
};

struct BwdArgs {
  SoftmaxBwdParams p;
  FastDiv query;
  bool fast;
};

// The last key query `row` keeps under the causal mask: its query index, at most S - 1.
__device__ __forceinline__ int CausalLast(bool fast, const FastDiv& query, int64_t query_len,
                                          int64_t row, int S) {
  int64_t i;
  if (fast) {
    const uint32_t n = static_cast<uint32_t>(row);
    i = n - Div(query, n) * query.d;
  } else {
    i = row % query_len;
  }
  return static_cast<int>(min(i, int64_t(S - 1)));
}

// 2^x in one MUFU instruction (max relative error ~2^-22; results below 2^-126 flush to 0,
// which changes no output by more than 1e-38).
__device__ __forceinline__ float Exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// max that propagates NaN (fmaxf drops it), so that a NaN logit poisons its row's max as it
// does in XLA's reduction, also through the online (max, sum) combination.
__device__ __forceinline__ float MaxNaN(float a, float b) {
  float y;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
  return y;
}

// exp(x * scale - m) for one element. For 16-bit storage one FFMA forms the exponent
// (x * (scale*log2e) - m*log2e): its extra rounding (~2^-24 of |x * scale|, relative) is far
// below the output's (2^-9 or 2^-12). For float32 the exponent x * scale - m is formed with one
// rounding first (as exact as the reference's), then scaled by log2e.
template <typename T>
struct ExpShift {
  float scale, m, sl2, ml2;

  __device__ __forceinline__ ExpShift(float scale_, float m_)
      : scale(scale_), m(m_), sl2(scale_ * kLog2e), ml2(m_ * kLog2e) {}

  __device__ __forceinline__ float operator()(float x) const {
    if constexpr (sizeof(T) == 2) {
      return Exp2(fmaf(x, sl2, -ml2));
    } else {
      return Exp2(fmaf(x, scale, -m) * kLog2e);
    }
  }
};

struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return MaxNaN(a, b); }
};
struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};

// Reduction of v over the `tpr` threads (a power of two) of a row, every thread getting the
// result: shuffles within the warp, then one shared-memory step across the row's warps, in a
// fixed order (bitwise reproducible). `slot` (0 or 1) picks the scratch half, so that two
// reductions in a row need no barrier between them. Every thread of the block must call it.
template <typename Op>
__device__ __forceinline__ float RowReduce(float v, float* scratch, int tpr, int slot, Op op) {
  const int width = tpr < 32 ? tpr : 32;
  for (int o = width / 2; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (tpr <= 32) return v;
  float* row = scratch + (slot * 4 + threadIdx.y) * 32;
  if ((threadIdx.x & 31) == 0) row[threadIdx.x / 32] = v;
  __syncthreads();
  v = row[0];
  for (int w = 1; w < tpr / 32; ++w) v = op(v, row[w]);
  return v;
}

// Online (max, sum of exp(. - max)) pairs: combine (m, s) with (m2, s2).
__device__ __forceinline__ void CombineMaxSum(float& m, float& s, float m2, float s2) {
  const float mn = MaxNaN(m, m2);
  const float a = m == kNegInf ? 0.f : s * Exp2((m - mn) * kLog2e);
  const float b = m2 == kNegInf ? 0.f : s2 * Exp2((m2 - mn) * kLog2e);
  m = mn;
  s = a + b;
}

template <typename T, int VEC>
__device__ __forceinline__ void ToFloats(const Vec<T, VEC>& v, float (&f)[VEC]) {
#pragma unroll
  for (int j = 0; j < VEC; ++j) f[j] = ToFloat(v.v[j]);
}

// Copies this thread's vectors of a row (columns c = (threadIdx.x + k * tpr) * VEC < lim) from
// global to shared memory (kArrays arrays of S elements each): cp.async for 16-byte vectors,
// registers then shared for scalars. The thread later reads only what it copied, so no
// barrier is needed, only CpAsyncWait.
template <typename T, int VEC, int VPT, bool kAsync, int kArrays>
__device__ __forceinline__ void StageRow(const void* const (&src)[kArrays], int64_t base, T* dst,
                                         int S, int lim, int tpr, bool valid) {
  if constexpr (kAsync) {
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int c = (int(threadIdx.x) + k * tpr) * VEC;
      if (valid && c < lim) {
#pragma unroll
        for (int a = 0; a < kArrays; ++a) {
          CpAsync16(dst + a * S + c, static_cast<const T*>(src[a]) + base + c);
        }
      }
    }
    CpAsyncCommit();
  } else {
    T tmp[kArrays][VPT];
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int c = (int(threadIdx.x) + k * tpr) * VEC;
#pragma unroll
      for (int a = 0; a < kArrays; ++a) {
        if (valid && c < lim) tmp[a][k] = static_cast<const T*>(src[a])[base + c];
      }
    }
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int c = (int(threadIdx.x) + k * tpr) * VEC;
#pragma unroll
      for (int a = 0; a < kArrays; ++a) {
        if (valid && c < lim) dst[a * S + c] = tmp[a][k];
      }
    }
  }
}

// Register budgets of the staged kernels (ptxas, sm_90, -warn-spills): scalar kernels (S not
// a whole number of vectors) hold more per thread and stop at 512 threads (128 registers: at
// 1024 threads the backward one spilled). Budgets of the forward kernels:
// softmax_fwd_kernels.cuh.
template <int VEC>
constexpr int StagedMaxThreads() {
  return VEC == 1 ? 512 : kMaxThreads;
}

}  // namespace jaxgpu::cuda::softmax
