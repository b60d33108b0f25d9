// Softmax kernels (optional scale, causal mask and broadcast boolean mask), forward and
// backward.
//
// Napkin math (H100, 16384 x 8192 bf16, N = 256 MiB): the forward pass must read x and write
// y (2N = 512 MiB, ~0.18 ms at the ~3.0 TB/s a device copy reaches); the backward pass reads
// y and dy and writes dx (3N, ~0.27 ms). A broadcast mask adds its own bytes only (a
// (T, S) mask under (B, H, T, S) logits: 1/(B*H) of them). Everything here is memory-bound:
// one read of each input, 16-byte accesses, enough bytes in flight per SM.
//
// Row mapping (as the norm kernels, ffi/norm/norm_kernels.cu): a row of S elements is
// split into 16-byte vectors of VEC elements; `tpr` threads (a power of two) share a row,
// thread t owning vectors t, t + tpr, ...; rows narrower than 256 threads share a block
// (blockDim.y rows). The forward pass over rows of whole 16-byte vectors, up to 4096 of
// them, takes the one-pass kernel (version 2, SoftmaxFwdRegs: one
// exp per element, one reduction per row; see there). Otherwise two kernels per pass:
//   staged  the row cp.async'ed into shared memory (scalar loads when S is not a whole
//           number of vectors), then every pass reads it from there: one read of x. The
//           norm kernels measured why: rows held in registers (66-128 registers a thread)
//           reached 2.0-2.4 TB/s, cp.async-staged rows at 40 registers 2.89 TB/s.
//   loop    rows wider than staged allows (more than 8 vectors a thread at 1024 threads,
//           or over the shared memory): one row per 1024-thread block, an online
//           (max, sum) pass and a write pass, so x is read twice (the second mostly from L2).
//
// The staged forward pass (version 1) is three passes over the staged row: max of the kept
// logits, sum of exp(logit - max), write exp(logit - max) / sum. Each reduction runs in a
// fixed order, so results are bitwise reproducible. Which elements are kept (mask & causal)
// is computed once per thread, before the copies land, into a bit mask in registers (one
// bit per element it owns: at most 8 vectors of at most 8 elements).
//
// Semantics at the edges (the same in softmax_cpu.cc and jaxgpu/reference/softmax.py): a
// row with nothing kept, or whose kept logits are all -inf, is all zeros (the max is taken
// as 0, so every exp is 0 and the sum is 0, and 1/sum is replaced by 0); a kept NaN or +inf
// logit makes its row NaN.
#include "softmax/softmax_cuda.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>

#include "common/cuda_utils.cuh"

namespace jaxgpu::cuda {
namespace {

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

// ---- index math ------------------------------------------------------------------------------

// n / d for n < 2^31 and 1 <= d < 2^31 with a multiply-high instead of a division (~20
// instructions for a 32-bit division, ~70 for a 64-bit one): q = (umulhi(n, mul) + n) >> shift
// with shift = ceil(log2 d) and mul = floor(2^32 (2^shift - d) / d) + 1 (< 2^32 for d < 2^31).
struct FastDiv {
  uint32_t d, mul, shift;
};

FastDiv MakeFastDiv(int64_t d) {
  FastDiv f{static_cast<uint32_t>(d), 0, 0};
  while ((uint64_t(1) << f.shift) < uint64_t(d)) ++f.shift;
  f.mul = static_cast<uint32_t>(((uint64_t(1) << 32) * ((uint64_t(1) << f.shift) - d)) / d + 1);
  return f;
}

__device__ __forceinline__ uint32_t Div(const FastDiv& f, uint32_t n) {
  return (__umulhi(n, f.mul) + n) >> f.shift;
}

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

struct RowInfo {
  int64_t mask_off;  // of the row's mask row
  int last;          // last kept key: the query index (causal), else S - 1
};

// kFastOnly: for kernels launched only when a.fast; without the 64-bit path's divisions
// (calls, around which ptxas saves live registers).
template <bool kCausal, bool kMask, bool kFastOnly = false>
__device__ __forceinline__ RowInfo GetRowInfo(const FwdArgs& a, int64_t row) {
  const bool fast = kFastOnly || a.fast;
  RowInfo r{0, static_cast<int>(a.p.cols) - 1};
  if constexpr (kCausal) r.last = CausalLast(fast, a.query, a.p.query_len, row, r.last + 1);
  if (!kMask) return r;
  if (fast) {
    const uint32_t n0 = static_cast<uint32_t>(row);
    if constexpr (kMask) {
      uint32_t n = n0;
#pragma unroll
      for (int k = kSoftmaxMaxDims - 1; k >= 0; --k) {
        if (k < a.p.ndims) {
          const uint32_t q = Div(a.dims[k], n);
          r.mask_off += int64_t(n - q * a.dims[k].d) * a.p.mask_strides[k];
          n = q;
        }
      }
    }
  } else {
    if constexpr (kMask) {
      int64_t n = row;
      for (int k = a.p.ndims - 1; k >= 0; --k) {
        r.mask_off += (n % a.p.dims[k]) * a.p.mask_strides[k];
        n /= a.p.dims[k];
      }
    }
  }
  return r;
}

// Bit j set when byte j of the VEC mask bytes at `m` (VEC-aligned) is nonzero (true).
template <int VEC>
__device__ __forceinline__ uint32_t MaskVecBits(const uint8_t* m) {
  uint32_t bits = 0;
  if constexpr (VEC == 8) {
    const uint2 u = *reinterpret_cast<const uint2*>(m);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      bits |= uint32_t(((u.x >> (8 * j)) & 0xffu) != 0) << j;
      bits |= uint32_t(((u.y >> (8 * j)) & 0xffu) != 0) << (4 + j);
    }
  } else if constexpr (VEC == 4) {
    const uint32_t u = *reinterpret_cast<const uint32_t*>(m);
#pragma unroll
    for (int j = 0; j < 4; ++j) bits |= uint32_t(((u >> (8 * j)) & 0xffu) != 0) << j;
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) bits |= uint32_t(m[j] != 0) << j;
  }
  return bits;
}

// Keep bits of the VEC elements at column c: the mask's and the causal limit's. `mrow` is the
// row's mask (its bytes in global memory, or a copy staged in shared memory), read only for a
// mask along S.
template <int VEC, bool kCausal, bool kMask>
__device__ __forceinline__ uint32_t KeepVecBits(const FwdArgs& a, const RowInfo& r,
                                                const uint8_t* mrow, int c, bool row_on) {
  constexpr uint32_t kAll = (1u << VEC) - 1;
  uint32_t bits = kAll;
  if constexpr (kMask) {
    if (a.p.mask_col_stride != 0) {
      bits = MaskVecBits<VEC>(mrow + c);
    } else {
      bits = row_on ? kAll : 0u;
    }
  }
  if constexpr (kCausal) {
    // Elements c + j <= last are kept.
    const int n = r.last - c + 1;
    bits &= n >= VEC ? kAll : (n <= 0 ? 0u : (1u << n) - 1);
  }
  return bits;
}

// A mask broadcast along S is one byte per row.
template <bool kMask>
__device__ __forceinline__ bool RowOn(const FwdArgs& a, const RowInfo& r) {
  if constexpr (kMask) {
    if (a.p.mask_col_stride == 0) return a.p.mask[r.mask_off] != 0;
  }
  return true;
}

// Keep bits of the VPT vectors a thread owns in a row (vector k at column first + k * step; bit
// k * VEC + j for its element j): one bit per element, at most 8 vectors of at most 8 elements.
template <int VEC, int VPT, bool kCausal, bool kMask>
__device__ __forceinline__ uint64_t RowKeepBits(const FwdArgs& a, const RowInfo& r,
                                                const uint8_t* mrow, int lim, int first,
                                                int step, bool valid) {
  static_assert(VEC * VPT <= 64, "keep bits must fit in 64 bits");
  uint64_t keep = 0;
  if (valid) {
    const bool row_on = RowOn<kMask>(a, r);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int c = first + k * step;
      if (c < lim) {
        keep |= uint64_t(KeepVecBits<VEC, kCausal, kMask>(a, r, mrow, c, row_on)) << (k * VEC);
      }
    }
  }
  return keep;
}

// ---- arithmetic ------------------------------------------------------------------------------

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
__device__ __forceinline__ void StageRow(const void* const (&src)[kArrays], int64_t base,
                                         T* dst, int S, int lim, int tpr, bool valid) {
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

// ---- forward ---------------------------------------------------------------------------------

// Register budgets (ptxas, sm_90, -warn-spills). Without a mask, the 16-byte-vector kernels
// with VPT <= 4 fit in 32 registers with no spill when asked for 2 blocks of 1024 threads, so
// 8 blocks of 256 threads (8 rows, 128 KiB at S = 8192 bf16) share an SM instead of 6 at
// their natural 38 registers; with a mask (and float32 with the causal mask) they would spill
// and keep their natural 40-46. Scalar kernels (S not a whole number of vectors) hold more
// per thread and stop at 512 threads (128 registers: at 1024 threads the backward one
// spilled).
template <int VEC>
constexpr int StagedMaxThreads() { return VEC == 1 ? 512 : kMaxThreads; }

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
    keep = RowKeepBits<VEC, VPT, kCausal, kMask>(a, r, p.mask + r.mask_off, lim, first, step,
                                                 valid);
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

// ---- forward, one pass (version 2) ----------------------------------------------------------
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

// Shared scratch of step 3: a (max, sum) pair per warp of a row, for at most 4 rows a block
// (rows wider than a warp: tpr >= 64, so at most 256 / 64 rows share a block).
constexpr int kOnePassScratchFloats = 4 * 2 * 32;

// 8 vectors a thread (64 floats of exps) need more than the 64 registers a thread of a
// 1024-thread block may have: those blocks stop at 512 threads (128 registers).
template <int VPT>
constexpr int OnePassMaxThreads() { return VPT > 4 ? 512 : kMaxThreads; }

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
    keep = RowKeepBits<VEC, VPT, kCausal, kMask>(a, r, p.mask + r.mask_off, lim, first, step,
                                                 valid);
  }
  auto load = [&](int k, float (&f)[VEC]) { Unpack<T, VEC>(v[k], f); };
  OnePassRow<T, VEC, VPT, kKeep>(load, keep, lim, S, p.scale, p.y, base, valid, scratch, tpr);
}

// ---- backward --------------------------------------------------------------------------------
//
// dx = scale * y * (dy - sum(dy * y)). Masked and fully masked positions hold y = 0 and get
// exactly 0, so the backward pass needs neither the mask nor the causal flag.

template <typename T, int VEC, int VPT, bool kAsync, bool kCausal>
__global__ void __launch_bounds__(StagedMaxThreads<VEC>(), (VEC > 1 && VPT <= 4) ? 2 : 1)
    SoftmaxBwdStaged(const BwdArgs a, int tpr) {
  extern __shared__ __align__(16) unsigned char staged[];
  __shared__ float scratch[kScratchFloats];
  const SoftmaxBwdParams& p = a.p;
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool valid = row < p.rows;
  const int S = static_cast<int>(p.cols);
  const int first = int(threadIdx.x) * VEC;
  const int step = tpr * VEC;
  T* ys = reinterpret_cast<T*>(staged) + int64_t(threadIdx.y) * 2 * S;  // y, then dy
  const int64_t base = row * p.cols;
  // Past the causal limit y is 0: y and dy are not read there and dx is 0.
  const int lim = (kCausal && valid) ? CausalLast(a.fast, a.query, p.query_len, row, S) + 1 : S;
  const void* const src[2] = {p.y, p.dy};
  StageRow<T, VEC, VPT, kAsync, 2>(src, base, ys, S, lim, tpr, valid);
  if constexpr (kAsync) CpAsyncWait<0>();

  float dot = 0.f;
  if (valid) {
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int c = first + k * step;
      if (c < lim) {
        float y[VEC], dy[VEC];
        ToFloats<T, VEC>(*reinterpret_cast<const Vec<T, VEC>*>(ys + c), y);
        ToFloats<T, VEC>(*reinterpret_cast<const Vec<T, VEC>*>(ys + S + c), dy);
#pragma unroll
        for (int j = 0; j < VEC; ++j) dot = fmaf(y[j], dy[j], dot);
      }
    }
  }
  dot = RowReduce(dot, scratch, tpr, 0, SumOp{});
  if (!valid) return;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int c = first + k * step;
    if (c < S) {
      Vec<T, VEC> out;
      if (c < lim) {
        float y[VEC], dy[VEC];
        ToFloats<T, VEC>(*reinterpret_cast<const Vec<T, VEC>*>(ys + c), y);
        ToFloats<T, VEC>(*reinterpret_cast<const Vec<T, VEC>*>(ys + S + c), dy);
#pragma unroll
        for (int j = 0; j < VEC; ++j) out.v[j] = FromFloat<T>(p.scale * y[j] * (dy[j] - dot));
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) out.v[j] = FromFloat<T>(0.f);
      }
      StoreVecStream<T, VEC>(p.dx, base + c, out);
    }
  }
}

template <typename T, int VEC, bool kCausal>
__global__ void __launch_bounds__(kMaxThreads) SoftmaxBwdLoop(const BwdArgs a) {
  __shared__ float scratch[kScratchFloats];
  const SoftmaxBwdParams& p = a.p;
  const int64_t row = blockIdx.x;
  const int S = static_cast<int>(p.cols);
  const int64_t base = row * p.cols;
  const int step = int(blockDim.x) * VEC;
  const int lim = kCausal ? CausalLast(a.fast, a.query, p.query_len, row, S) + 1 : S;
  float dot = 0.f;
  for (int c = int(threadIdx.x) * VEC; c < lim; c += step) {
    float y[VEC], dy[VEC];
    ToFloats<T, VEC>(LoadVec<T, VEC>(p.y, base + c), y);
    ToFloats<T, VEC>(LoadVec<T, VEC>(p.dy, base + c), dy);
#pragma unroll
    for (int j = 0; j < VEC; ++j) dot = fmaf(y[j], dy[j], dot);
  }
  dot = RowReduce(dot, scratch, int(blockDim.x), 0, SumOp{});
  for (int c = int(threadIdx.x) * VEC; c < S; c += step) {
    Vec<T, VEC> out;
    if (c < lim) {
      float y[VEC], dy[VEC];
      ToFloats<T, VEC>(LoadVecStream<T, VEC>(p.y, base + c), y);
      ToFloats<T, VEC>(LoadVecStream<T, VEC>(p.dy, base + c), dy);
#pragma unroll
      for (int j = 0; j < VEC; ++j) out.v[j] = FromFloat<T>(p.scale * y[j] * (dy[j] - dot));
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) out.v[j] = FromFloat<T>(0.f);
    }
    StoreVecStream<T, VEC>(p.dx, base + c, out);
  }
}

// ---- launch ----------------------------------------------------------------------------------

// Forward kernels of rows of whole 16-byte vectors (rows too wide for the one-pass kernels,
// more than 4096 vectors, and 2^31 rows or more take version 1 whatever is asked).
enum class FwdKernel {
  kRegs,    // SoftmaxFwdRegs
  kStaged,  // version 1: SoftmaxFwdStaged
};

struct Tune {
  int vpt[2];  // target vectors per thread, forward and backward; 0: the default
  FwdKernel fwd;
};

// Developer knob for tuning runs (benchmarks/, not for users), read once per process:
// JAXGPU_SOFTMAX_TUNE="a,b[,kernel]" overrides the target vectors per thread of the forward
// (a) and backward (b) kernels (0 keeps the default) and picks the forward kernel: regs (the
// default) or staged (version 1, for A/B runs; 2259 GB/s against regs' 2944 on the H100).
const Tune& GetTune() {
  static const Tune tune = [] {
    Tune t{{0, 0}, FwdKernel::kRegs};
    const char* env = std::getenv("JAXGPU_SOFTMAX_TUNE");
    if (env == nullptr) return t;
    char name[16] = "";
    std::sscanf(env, "%d,%d,%15s", &t.vpt[0], &t.vpt[1], name);
    const std::pair<const char*, FwdKernel> kinds[] = {{"regs", FwdKernel::kRegs},
                                                       {"staged", FwdKernel::kStaged}};
    bool known = name[0] == '\0';
    for (const auto& [n, k] : kinds) {
      if (std::strcmp(name, n) == 0) {
        t.fwd = k;
        known = true;
      }
    }
    if (!known) std::fprintf(stderr, "JAXGPU_SOFTMAX_TUNE: unknown kernel '%s' ignored\n", name);
    return t;
  }();
  return tune;
}

int TunedVpt(int which, int fallback) {
  const int v = GetTune().vpt[which];
  return v > 0 && v <= kMaxVpt ? v : fallback;
}

struct StagedConfig {
  bool staged;
  int tpr;
  int vpt;             // vectors a thread owns, rounded up to 2, 4 or 8 (a template parameter)
  int rows_per_block;
  int64_t smem;
};

// ~target_vpt vectors a thread: 4 keeps 64 bytes in flight per thread at ~32-40 registers
// (the norm kernels' measured optimum). Staged when a thread needs at most kMaxVpt vectors and
// the block's rows fit in shared memory.
StagedConfig ChooseStaged(int64_t S, int vec, int64_t elem_bytes, int arrays, int target_vpt) {
  StagedConfig c{};
  const int64_t nvec = CeilDiv(S, vec);
  const int max_threads = vec == 1 ? StagedMaxThreads<1>() : kMaxThreads;
  c.tpr = static_cast<int>(std::min<int64_t>(max_threads, NextPow2(CeilDiv(nvec, target_vpt))));
  const int64_t per_thread = CeilDiv(nvec, c.tpr);
  c.vpt = per_thread <= 2 ? 2 : (per_thread <= 4 ? 4 : kMaxVpt);
  c.rows_per_block = c.tpr >= kBlockThreads ? 1 : kBlockThreads / c.tpr;
  c.smem = int64_t(c.rows_per_block) * arrays * S * elem_bytes;
  c.staged = per_thread <= kMaxVpt && c.smem <= MaxStagedBytes(kScratchBytes);
  return c;
}

#define JAXGPU_SOFTMAX_VPT_SWITCH(vpt, VPT, ...)                  \
  [&] {                                                           \
    switch (vpt) {                                                \
      case 2: { constexpr int VPT = 2; return __VA_ARGS__(); }    \
      case 4: { constexpr int VPT = 4; return __VA_ARGS__(); }    \
      default: { constexpr int VPT = 8; return __VA_ARGS__(); }   \
    }                                                             \
  }()

FwdArgs MakeFwdArgs(const SoftmaxFwdParams& p) {
  FwdArgs a{};
  a.p = p;
  a.fast = p.rows < (int64_t(1) << 31);
  if (a.fast) {
    for (int k = 0; k < p.ndims; ++k) a.dims[k] = MakeFastDiv(std::max<int64_t>(p.dims[k], 1));
    a.query = MakeFastDiv(std::max<int64_t>(p.query_len, 1));
  }
  return a;
}

template <typename Kernel, typename Args>
cudaError_t LaunchStaged(Kernel kernel, const StagedConfig& c, int64_t rows, const Args& args,
                         cudaStream_t stream) {
  const int64_t blocks = CeilDiv(rows, c.rows_per_block);
  if (blocks > INT32_MAX) return cudaErrorInvalidConfiguration;  // one grid dimension
  if (cudaError_t err = AllowSmem(kernel, c.smem); err != cudaSuccess) return err;
  kernel<<<blocks, dim3(c.tpr, c.rows_per_block), c.smem, stream>>>(args, c.tpr);
  return cudaGetLastError();
}

template <typename Kernel, typename Args>
cudaError_t LaunchLoop(Kernel kernel, int64_t rows, const Args& args, cudaStream_t stream) {
  if (rows > INT32_MAX) return cudaErrorInvalidConfiguration;
  kernel<<<rows, kMaxThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

bool Aligned(const void* ptr, int bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

struct OnePassConfig {
  bool fits;  // at most 8 vectors a thread, and at most 4 above 512 threads
  int tpr;
  int vpt;    // vectors a thread owns, rounded up to 2, 4 or 8 (a template parameter)
  int rows_per_block;
};

OnePassConfig ChooseOnePass(int64_t nvec, int target_vpt) {
  OnePassConfig c{};
  c.tpr = static_cast<int>(std::min<int64_t>(kMaxThreads, NextPow2(CeilDiv(nvec, target_vpt))));
  const int64_t per_thread = CeilDiv(nvec, c.tpr);
  c.vpt = per_thread <= 2 ? 2 : (per_thread <= 4 ? 4 : 8);
  c.fits = per_thread <= 8 && c.tpr <= (c.vpt > 4 ? OnePassMaxThreads<8>() : kMaxThreads);
  c.rows_per_block = c.tpr >= kBlockThreads ? 1 : kBlockThreads / c.tpr;
  return c;
}

template <typename T, int VEC, int VPT, bool kCausal, bool kMask>
cudaError_t LaunchOnePass(const FwdArgs& a, const OnePassConfig& c, cudaStream_t stream) {
  const int64_t blocks = CeilDiv(a.p.rows, c.rows_per_block);
  if (blocks > INT32_MAX) return cudaErrorInvalidConfiguration;  // one grid dimension
  SoftmaxFwdRegs<T, VEC, VPT, kCausal, kMask>
      <<<blocks, dim3(c.tpr, c.rows_per_block), 0, stream>>>(a, c.tpr);
  return cudaGetLastError();
}

template <typename T, bool kCausal, bool kMask>
cudaError_t LaunchFwd(const FwdArgs& a, cudaStream_t stream) {
  constexpr int kFull = 16 / sizeof(T);
  const int64_t S = a.p.cols;
  // XLA's buffers are aligned far beyond 16 bytes; the check costs nothing and keeps the
  // vector path from ever faulting on a misaligned one (the mask's vector is kFull bytes).
  if (S % kFull == 0 && Aligned(a.p.x, 16) && Aligned(a.p.y, 16) &&
      (!kMask || Aligned(a.p.mask, kFull))) {
    const Tune& tune = GetTune();
    if (tune.fwd != FwdKernel::kStaged && a.fast) {  // the one-pass kernels' row math: 32 bits
      const OnePassConfig c = ChooseOnePass(S / kFull, TunedVpt(0, 4));
      if (c.fits) {
        return JAXGPU_SOFTMAX_VPT_SWITCH(c.vpt, VPT, [&] {
          return LaunchOnePass<T, kFull, VPT, kCausal, kMask>(a, c, stream);
        });
      }
    }
    const StagedConfig c = ChooseStaged(S, kFull, sizeof(T), 1, TunedVpt(0, 4));
    if (c.staged) {
      return JAXGPU_SOFTMAX_VPT_SWITCH(c.vpt, VPT, [&] {
        return LaunchStaged(SoftmaxFwdStaged<T, kFull, VPT, true, kCausal, kMask>, c, a.p.rows,
                            a, stream);
      });
    }
    return LaunchLoop(SoftmaxFwdLoop<T, kFull, kCausal, kMask>, a.p.rows, a, stream);
  }
  // S not a whole number of 16-byte vectors: scalar accesses.
  const StagedConfig c = ChooseStaged(S, 1, sizeof(T), 1, kMaxVpt);
  if (c.staged) {
    return LaunchStaged(SoftmaxFwdStaged<T, 1, kMaxVpt, false, kCausal, kMask>, c, a.p.rows, a,
                        stream);
  }
  return LaunchLoop(SoftmaxFwdLoop<T, 1, kCausal, kMask>, a.p.rows, a, stream);
}

template <typename T, bool kCausal>
cudaError_t LaunchBwd(const BwdArgs& a, cudaStream_t stream) {
  constexpr int kFull = 16 / sizeof(T);
  const SoftmaxBwdParams& p = a.p;
  if (p.cols % kFull == 0 && Aligned(p.y, 16) && Aligned(p.dy, 16) && Aligned(p.dx, 16)) {
    const StagedConfig c = ChooseStaged(p.cols, kFull, sizeof(T), 2, TunedVpt(1, 4));
    if (c.staged) {
      return JAXGPU_SOFTMAX_VPT_SWITCH(c.vpt, VPT, [&] {
        return LaunchStaged(SoftmaxBwdStaged<T, kFull, VPT, true, kCausal>, c, p.rows, a, stream);
      });
    }
    return LaunchLoop(SoftmaxBwdLoop<T, kFull, kCausal>, p.rows, a, stream);
  }
  const StagedConfig c = ChooseStaged(p.cols, 1, sizeof(T), 2, kMaxVpt);
  if (c.staged) {
    return LaunchStaged(SoftmaxBwdStaged<T, 1, kMaxVpt, false, kCausal>, c, p.rows, a, stream);
  }
  return LaunchLoop(SoftmaxBwdLoop<T, 1, kCausal>, p.rows, a, stream);
}

}  // namespace

cudaError_t LaunchSoftmaxFwd(const SoftmaxFwdParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return cudaSuccess;
  const FwdArgs a = MakeFwdArgs(p);
  return JAXGPU_DTYPE_SWITCH(p.dtype, T, [&] {
    return JAXGPU_BOOL_SWITCH(p.causal, kCausal, [&] {
      return JAXGPU_BOOL_SWITCH(p.mask != nullptr, kMask, [&] {
        return LaunchFwd<T, kCausal, kMask>(a, stream);
      });
    });
  });
}

cudaError_t LaunchSoftmaxBwd(const SoftmaxBwdParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return cudaSuccess;
  BwdArgs a{};
  a.p = p;
  a.fast = p.rows < (int64_t(1) << 31);
  if (a.fast) a.query = MakeFastDiv(std::max<int64_t>(p.query_len, 1));
  return JAXGPU_DTYPE_SWITCH(p.dtype, T, [&] {
    return JAXGPU_BOOL_SWITCH(p.causal, kCausal, [&] { return LaunchBwd<T, kCausal>(a, stream); });
  });
}

}  // namespace jaxgpu::cuda
