// Forward kernel, version 2 (one pass, the row in registers): SoftmaxFwdRegs. No XLA types.
//
// Version 1 (SoftmaxFwdStaged) reached 2250 GB/s at 16384 x 8192 bf16 on the H100 (0.79x
// jax.nn.softmax): three passes over the staged row and two block reductions per row, and two
// exps per element (the sum's and the output's): 268M ex2 at ~16 a clock per SM are ~70 us of
// the ~180 us a copy of x and y takes, in phases that the loads of other rows must cover.
// Version 2 computes each exp once and keeps it in registers for the output:
//   1. the max of the kept logits over the thread's warp (its row in registers in its storage
//      type, or in shared memory: 0.5 registers an element for 16-bit types), by shuffles;
//   2. e = exp(logit - warp max) into registers (floats), their sum over the warp;
//   3. rows wider than a warp: ONE block step combining the warps' (max, sum) pairs: each warp
//      reads every pair, lane w rescales warp w's sum to the row max, a shuffle sum adds them
//      (2 extra exps a thread per row; rows of at most 32 threads need none);
//   4. y = e * exp(warp max - row max) / sum, streaming stores.
// One ex2 per element (half of version 1's MUFU time), one barrier per row (none for rows of
// <= 32 threads). Registers (ptxas, sm_90, bf16, no mask): 39 / 60 / 98 at 2 / 4 / 8
// vectors a thread, no spills: mostly the exps' VPT * VEC floats. The row is loaded straight
// into registers, one block per 256 threads' rows. H100 (docs/perf/softmax.md section 3): 2944
// GB/s at (16384, 8192) bf16, where persistent blocks cp.async'ing the next 1-2 rows into
// shared memory while computing the current one reached only 2265-2599 (removed).
#pragma once

#include <cstdint>
#include <type_traits>

#include "softmax/softmax_device.cuh"
#include "softmax/softmax_mask.cuh"

namespace jaxgpu::cuda::softmax {

// Shared scratch of step 3: a (max, sum) pair per warp of a row, for at most 4 rows a block
// (rows wider than a warp: tpr >= 64, so at most 256 / 64 rows share a block).
constexpr int kOnePassScratchFloats = 4 * 2 * 32;

// 8 vectors a thread (64 floats of exps) need more than the 64 registers a thread of a
// 1024-thread block may have: those blocks stop at 512 threads (128 registers).
template <int VPT>
constexpr int OnePassMaxThreads() {
  return VPT > 4 ? 512 : kMaxThreads;
}

// 1/s for a row's sum of exps s: in [1, 2^31) (its largest term is exp(0)), or NaN. MUFU.RCP
// and one Newton step (< 1 ulp): `1.f / s` would add a call to the IEEE division's slow path,
// around which ptxas saves the live registers (the exps) to local memory.
__device__ __forceinline__ float RecipSum(float s) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(s));
  return r * fmaf(-s, r, 2.f);
}

// Vector k's 16-bit (or float) elements as floats. bf16 is the upper half of a float: one
// shift or one AND per element (the generic conversion spends two on an upper half).
template <typename T, int VEC>
__device__ __forceinline__ void Unpack(const Vec<T, VEC> v, float (&f)[VEC]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16> && VEC % 2 == 0) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(&v);
#pragma unroll
    for (int i = 0; i < VEC / 2; ++i) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  } else {
    ToFloats<T, VEC>(v, f);
  }
}

// Steps 1-4 for one row. load(k, v) gives vector k of the thread's logits as stored (before
// the scale) in v, at column first + k * step; it is called (twice: the max, then the exps)
// only below `lim`, so the thread's row stays in its storage type until the exps replace it.
// keep: RowKeepBits. Every thread of the block must call it (step 3 has a barrier when
// tpr > 32).
template <typename T, int VEC, int VPT, bool kKeep, typename Load>
__device__ __forceinline__ void OnePassRow(const Load& load, uint64_t keep, int lim, int S,
                                           float scale, void* y, int64_t base, bool valid,
                                           float* scratch, int tpr) {
  const int first = int(threadIdx.x) * VEC;
  const int step = tpr * VEC;
  auto kept = [&](int k, int j) { return !kKeep || ((keep >> (k * VEC + j)) & 1u); };
  const int width = tpr < 32 ? tpr : 32;

  // 1. The max of the warp's kept logits (NaN-propagating).
  float m = kNegInf;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    if (first + k * step < lim) {
      float v[VEC];
      load(k, v);
#pragma unroll
      for (int j = 0; j < VEC; ++j) m = MaxNaN(m, kept(k, j) ? v[j] * scale : kNegInf);
    }
  }
  for (int o = width / 2; o > 0; o >>= 1) m = MaxNaN(m, __shfl_xor_sync(0xffffffffu, m, o));

  // 2. e = exp(logit - m) in place (0 where not kept; shift by 0 where nothing is kept or
  // only -inf, so that every exp is 0), and the warp's sum of them.
  const ExpShift<T> ex(scale, m == kNegInf ? 0.f : m);
  float s = 0.f;
  float f[VPT][VEC];
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    if (first + k * step < lim) {
      float v[VEC];
      load(k, v);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        f[k][j] = kept(k, j) ? ex(v[j]) : 0.f;
        s += f[k][j];
      }
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) f[k][j] = 0.f;
    }
  }
  for (int o = width / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);

  // 3. y = e * g. A sum of 0 (nothing kept) gives zeros; a NaN one (a kept NaN or +inf
  // logit) NaN everywhere in the row, as 0 * NaN.
  float g;
  if (tpr > 32) {
    const int lane = int(threadIdx.x) & 31;
    const int warps = tpr / 32;
    float* pairs = scratch + threadIdx.y * 64;
    if (lane == 0) {
      pairs[threadIdx.x / 32] = m;
      pairs[32 + threadIdx.x / 32] = s;
    }
    __syncthreads();
    // Lane w takes warp w's pair; the row's max and the rescaled sums over lanes 0..warps-1
    // in the same fixed order in every warp, so every thread of the row gets the same values.
    float ml = kNegInf, t = 0.f;
    if (lane < warps) {
      ml = pairs[lane];
      t = pairs[32 + lane];
    }
    float mr = ml;
    for (int o = warps / 2; o > 0; o >>= 1) mr = MaxNaN(mr, __shfl_xor_sync(0xffffffffu, mr, o));
    mr = __shfl_sync(0xffffffffu, mr, 0);
    t = ml == kNegInf ? 0.f : t * Exp2((ml - mr) * kLog2e);
    for (int o = warps / 2; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
    t = __shfl_sync(0xffffffffu, t, 0);
    const float inv = t == 0.f ? 0.f : RecipSum(t);
    g = (m == kNegInf ? 0.f : Exp2((m - mr) * kLog2e)) * inv;
  } else {
    g = s == 0.f ? 0.f : RecipSum(s);
  }
  if (!valid) return;

  // 4. y, every column (zeros past the causal limit).
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int c = first + k * step;
    if (c < S) {
      Vec<T, VEC> out;
#pragma unroll
      for (int j = 0; j < VEC; ++j) out.v[j] = FromFloat<T>(f[k][j] * g);
      StoreVecStream<T, VEC>(y, base + c, out);
    }
  }
}

// regs: blockDim = (tpr, rows per block); every load of the row issued before any is used.
template <typename T, int VEC, int VPT, bool kCausal, bool kMask>
__global__ void __launch_bounds__(OnePassMaxThreads<VPT>())
    SoftmaxFwdRegs(const FwdArgs a, int tpr) {
  constexpr bool kKeep = kCausal || kMask;
  __shared__ float scratch[kOnePassScratchFloats];
  const SoftmaxFwdParams& p = a.p;
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool valid = row < p.rows;
  const int S = static_cast<int>(p.cols);
  const int first = int(threadIdx.x) * VEC;
  const int step = tpr * VEC;
  const int64_t base = row * p.cols;
  RowInfo r{0, S - 1};
  if (kKeep && valid) r = GetRowInfo<kCausal, kMask, true>(a, row);
  const int lim = valid ? r.last + 1 : 0;  // keys past the causal limit are not read
  Vec<T, VEC> v[VPT];
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int c = first + k * step;
    if (c < lim) v[k] = LoadVecStream<T, VEC>(p.x, base + c);
  }
  uint64_t keep = ~uint64_t(0);
  if constexpr (kKeep) {
    keep =
        RowKeepBits<VEC, VPT, kCausal, kMask>(a, r, p.mask + r.mask_off, lim, first, step, valid);
  }
  auto load = [&](int k, float (&f)[VEC]) { Unpack<T, VEC>(v[k], f); };
  OnePassRow<T, VEC, VPT, kKeep>(load, keep, lim, S, p.scale, p.y, base, valid, scratch, tpr);
}

}  // namespace jaxgpu::cuda::softmax
