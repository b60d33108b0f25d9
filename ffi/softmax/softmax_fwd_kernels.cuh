// Forward kernels, version 1: the row staged in shared memory and three passes over it
// (SoftmaxFwdStaged), or rows too wide for that in a loop over global memory
// (SoftmaxFwdLoop). The one-pass kernel (softmax_fwd_regs.cuh) serves rows of whole 16-byte
// vectors up to 4096 of them. No XLA types.
#pragma once

#include <cstdint>

#include "softmax/softmax_device.cuh"
#include "softmax/softmax_mask.cuh"

namespace jaxgpu::cuda::softmax {

// Register budgets (ptxas, sm_90, -warn-spills). Without a mask, the 16-byte-vector kernels
// with VPT <= 4 fit in 32 registers with no spill when asked for 2 blocks of 1024 threads, so
// 8 blocks of 256 threads (8 rows, 128 KiB at S = 8192 bf16) share an SM instead of 6 at
// their natural 38 registers; with a mask (and float32 with the causal mask) they would spill
// and keep their natural 40-46. Scalar kernels: StagedMaxThreads (softmax_device.cuh).
template <typename T, int VEC, int VPT, bool kCausal, bool kMask>
constexpr int FwdMinBlocks() {
  return (VEC > 1 && VPT <= 4 && !kMask && (!kCausal || sizeof(T) == 2)) ? 2 : 1;
}

template <typename T, int VEC, int VPT, bool kAsync, bool kCausal, bool kMask>
__global__ void __launch_bounds__(StagedMaxThreads<VEC>(),
                                  (FwdMinBlocks<T, VEC, VPT, kCausal, kMask>()))
    SoftmaxFwdStaged(const FwdArgs a, int tpr) {
  static_assert(VEC * VPT <= 64, "keep bits must fit in 64 bits");
  constexpr bool kKeep = kCausal || kMask;
  extern __shared__ __align__(16) unsigned char staged[];
  __shared__ float scratch[kScratchFloats];
  const SoftmaxFwdParams& p = a.p;
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool valid = row < p.rows;
  const int S = static_cast<int>(p.cols);
  const int first = int(threadIdx.x) * VEC;
  const int step = tpr * VEC;
  T* xs = reinterpret_cast<T*>(staged) + int64_t(threadIdx.y) * S;
  const int64_t base = row * p.cols;
  // Under the causal mask, keys past the query are neither read nor computed (their y is 0):
  // half the reads of x for T == S.
  RowInfo r{0, S - 1};
  if (kKeep && valid) r = GetRowInfo<kCausal, kMask>(a, row);
  const int lim = r.last + 1;
  const void* const src[1] = {p.x};
  StageRow<T, VEC, VPT, kAsync, 1>(src, base, xs, S, lim, tpr, valid);

  // While the copies are in flight: which of this thread's elements are kept.
  uint64_t keep = ~uint64_t(0);
  if constexpr (kKeep) {
    keep =
        RowKeepBits<VEC, VPT, kCausal, kMask>(a, r, p.mask + r.mask_off, lim, first, step, valid);
  }
  if constexpr (kAsync) CpAsyncWait<0>();

  auto kept = [&](int k, int j) { return !kKeep || ((keep >> (k * VEC + j)) & 1u); };

  // Pass 1: the max of the kept logits.
  float mx = kNegInf;
  if (valid) {
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int c = first + k * step;
      if (c < lim) {
        float f[VEC];
        ToFloats<T, VEC>(*reinterpret_cast<const Vec<T, VEC>*>(xs + c), f);
#pragma unroll
        for (int j = 0; j < VEC; ++j) mx = MaxNaN(mx, kept(k, j) ? f[j] * p.scale : kNegInf);
      }
    }
  }
  mx = RowReduce(mx, scratch, tpr, 0, MaxOp{});
  // Nothing kept, or only -inf: shift by 0, every exp is 0, the row is zeros.
  const ExpShift<T> ex(p.scale, mx == kNegInf ? 0.f : mx);

  // Pass 2: the sum of exp(logit - max).
  float sum = 0.f;
  if (valid) {
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int c = first + k * step;
      if (c < lim) {
        float f[VEC];
        ToFloats<T, VEC>(*reinterpret_cast<const Vec<T, VEC>*>(xs + c), f);
#pragma unroll
        for (int j = 0; j < VEC; ++j) sum += kept(k, j) ? ex(f[j]) : 0.f;
      }
    }
  }
  sum = RowReduce(sum, scratch, tpr, 1, SumOp{});
  if (!valid) return;  // after the last barrier
  // sum == 0: nothing kept; NaN (a NaN or +inf logit) stays NaN for the whole row.
  const float inv = sum == 0.f ? 0.f : 1.f / sum;

  // Pass 3: y (zeros past the causal limit).
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int c = first + k * step;
    if (c < S) {
      Vec<T, VEC> out;
      if (c < lim) {
        float f[VEC];
        ToFloats<T, VEC>(*reinterpret_cast<const Vec<T, VEC>*>(xs + c), f);
#pragma unroll
        for (int j = 0; j < VEC; ++j) out.v[j] = FromFloat<T>((kept(k, j) ? ex(f[j]) : 0.f) * inv);
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) out.v[j] = FromFloat<T>(0.f);
      }
      StoreVecStream<T, VEC>(p.y, base + c, out);
    }
  }
}

// One row per block of 1024 threads; x is read twice (the second read mostly from L2).
template <typename T, int VEC, bool kCausal, bool kMask>
__global__ void __launch_bounds__(kMaxThreads) SoftmaxFwdLoop(const FwdArgs a) {
  __shared__ float scratch[2 * 32];
  const SoftmaxFwdParams& p = a.p;
  const int64_t row = blockIdx.x;
  const int S = static_cast<int>(p.cols);
  const int64_t base = row * p.cols;
  const int step = int(blockDim.x) * VEC;
  const RowInfo r = GetRowInfo<kCausal, kMask>(a, row);
  const bool row_on = RowOn<kMask>(a, r);
  const uint8_t* mrow = p.mask + r.mask_off;
  const int lim = r.last + 1;  // keys past the causal limit are not read

  // Pass 1: online max and sum of exp(logit - max) per thread.
  float m = kNegInf, s = 0.f;
  for (int c = int(threadIdx.x) * VEC; c < lim; c += step) {
    float f[VEC];
    ToFloats<T, VEC>(LoadVec<T, VEC>(p.x, base + c), f);
    const uint32_t bits = KeepVecBits<VEC, kCausal, kMask>(a, r, mrow, c, row_on);
    float vmax = kNegInf;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      f[j] *= p.scale;
      vmax = MaxNaN(vmax, ((bits >> j) & 1u) ? f[j] : kNegInf);
    }
    CombineMaxSum(m, s, vmax, 0.f);  // rescales s to the new max
    const float ms = m == kNegInf ? 0.f : m;
#pragma unroll
    for (int j = 0; j < VEC; ++j) s += ((bits >> j) & 1u) ? Exp2((f[j] - ms) * kLog2e) : 0.f;
  }
  // Combine across the block, in a fixed order.
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
    const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
    CombineMaxSum(m, s, m2, s2);
  }
  if ((threadIdx.x & 31) == 0) {
    scratch[threadIdx.x / 32] = m;
    scratch[32 + threadIdx.x / 32] = s;
  }
  __syncthreads();
  m = scratch[0];
  s = scratch[32];
  for (int w = 1; w < int(blockDim.x) / 32; ++w) CombineMaxSum(m, s, scratch[w], scratch[32 + w]);
  const float ms = m == kNegInf ? 0.f : m;
  const float inv = s == 0.f ? 0.f : 1.f / s;

  // Pass 2: y.
  for (int c = int(threadIdx.x) * VEC; c < S; c += step) {
    Vec<T, VEC> out;
    if (c < lim) {
      float f[VEC];
      ToFloats<T, VEC>(LoadVecStream<T, VEC>(p.x, base + c), f);
      const uint32_t bits = KeepVecBits<VEC, kCausal, kMask>(a, r, mrow, c, row_on);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float e = ((bits >> j) & 1u) ? Exp2((f[j] * p.scale - ms) * kLog2e) : 0.f;
        out.v[j] = FromFloat<T>(e * inv);
      }
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) out.v[j] = FromFloat<T>(0.f);
    }
    StoreVecStream<T, VEC>(p.y, base + c, out);
  }
}

}  // namespace jaxgpu::cuda::softmax
