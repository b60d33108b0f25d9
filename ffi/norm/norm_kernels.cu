// RMSNorm / LayerNorm kernels, forward and backward, with the optional residual add fused.
//
// Napkin math (H100, 16384 x 8192 bf16): the forward pass must read x (256 MiB) and write
// y (256 MiB); at the ~3.0 TB/s a device copy reaches that is ~0.18 ms. With a residual it
// reads x and residual and writes y and h: twice that. The backward pass reads dy and x
// and writes dx (~0.27 ms); the weight-gradient partials (blocks x D floats) are < 2% of it.
// So every kernel here is memory-bound: one read of each input, 16-byte accesses, enough
// bytes in flight per SM, and the statistics in registers.
//
// Row mapping. A row of D elements is split into 16-byte vectors (VEC elements); `tpr`
// threads (a power of two) share a row, thread t owning vectors t, t + tpr, ... Rows
// narrower than a 256-thread block share one block (blockDim.y rows). Three kernels per
// pass, chosen by the row:
//   staged  whole 16-byte vectors that fit in shared memory (the fast path): cp.async
//           into shared memory, statistics from there;
//   regs    rows that are not whole vectors (odd D): the row in registers, scalar access;
//   loop    anything wider: the row is re-read (mostly from L2).
//
// Parameters. weight and bias are stored as W: x's type T, or float (float32 master
// weights beside a 16-bit x). W = T is the same code as a kernel without the choice; a
// float W moves 2x the parameter bytes (D floats per row block, from L2) and, in the
// backward pass, holds the row's weights as floats in registers.
#include "norm/norm_cuda.h"

#include <algorithm>
#include <type_traits>

#include "common/cuda_utils.cuh"
#include "common/dev_knobs.h"

namespace jaxgpu::cuda {
namespace {

// Threads per block of the staged and register kernels when several rows share a block:
// at the staged forward kernel's 40 registers a thread, 8 such blocks (2048 threads) fit
// on an SM.
constexpr int kBlockThreads = 256;
// Shared scratch of RowSum: 32 floats per row per reduced value; a block has at most
// 4 rows when rows span more than one warp (tpr >= 64 and 256 threads), 2 values.
constexpr int kScratchFloats = 4 * 32 * 2;
constexpr int64_t kScratchBytes = sizeof(float) * kScratchFloats;
// Register-path blocks stop at 512 threads, so each thread may use 128 registers
// (65536 per SM). Measured with ptxas (-Xptxas=-warn-spills, sm_90): at the 64-register
// cap of 1024 threads the forward pass spilled 740 bytes at 8 bf16 vectors per thread,
// and the backward pass (dweight/dbias accumulators) spilled 380-680 bytes at 4 vectors
// under 512 threads. Wider rows take the loop kernels.
constexpr int kRegsMaxThreads = 512;

struct RowConfig {
  int vec;  // elements per access
  int tpr;  // threads per row
  int vpt;  // vectors per thread (register path)
  int rows_per_block;
  bool loop;  // the row does not fit in registers
};

// target_vpt trades registers for memory-level parallelism: the forward pass holds only
// the row (4 vectors = 64 B in flight per thread), the backward pass also holds
// dweight/dbias accumulators for its columns, so it takes 2 and more threads.
RowConfig ChooseRowConfig(int64_t dim, DType dtype, int target_vpt, int max_vpt, int max_tpr) {
  RowConfig c{};
  const int full = static_cast<int>(16 / DTypeBytes(dtype, 1));
  c.vec = (dim % full == 0) ? full : 1;
  const int64_t nvec = CeilDiv(dim, c.vec);
  c.tpr = std::min(max_tpr, NextPow2(CeilDiv(nvec, target_vpt)));
  c.vpt = NextPow2(CeilDiv(nvec, c.tpr));
  c.loop = c.vpt > max_vpt;
  if (c.loop) {
    c.tpr = 1024;
    c.vpt = 1;
  }
  c.rows_per_block = c.tpr >= kBlockThreads ? 1 : kBlockThreads / c.tpr;
  return c;
}

template <typename T, int VEC>
__device__ __forceinline__ Vec<T, VEC> ToVec(const float (&f)[VEC]) {
  Vec<T, VEC> v;
#pragma unroll
  for (int j = 0; j < VEC; ++j) v.v[j] = FromFloat<T>(f[j]);
  return v;
}

template <typename T, int VEC>
__device__ __forceinline__ void ToFloats(const Vec<T, VEC>& v, float (&f)[VEC]) {
#pragma unroll
  for (int j = 0; j < VEC; ++j) f[j] = ToFloat(v.v[j]);
}

// VEC parameter values (weight or bias) stored as W at `elem`. A float W beside a 16-bit T
// (VEC = 8) is two 16-byte loads: parameters are only assumed 16-byte aligned, as x is.
template <typename W, int VEC>
__device__ __forceinline__ Vec<W, VEC> LoadParam(const void* base, int64_t elem) {
  constexpr int kChunk = VEC * int(sizeof(W)) > 16 ? 16 / int(sizeof(W)) : VEC;
  if constexpr (kChunk == VEC) {
    return LoadVec<W, VEC>(base, elem);
  } else {
    Vec<W, VEC> v;
#pragma unroll
    for (int c = 0; c < VEC; c += kChunk) {
      const Vec<W, kChunk> part = LoadVec<W, kChunk>(base, elem + c);
#pragma unroll
      for (int j = 0; j < kChunk; ++j) v.v[c + j] = part.v[j];
    }
    return v;
  }
}

// Loads x (and residual) at `elem`; with a residual, stores h = round(x + residual) and
// returns h, which is what gets normalized (the reference adds in the storage dtype).
template <typename T, int VEC>
__device__ __forceinline__ void LoadInput(const NormFwdParams& p, int64_t elem, float (&f)[VEC]) {
  const Vec<T, VEC> xv = LoadVecStream<T, VEC>(p.x, elem);
  if (p.residual) {
    const Vec<T, VEC> rv = LoadVecStream<T, VEC>(p.residual, elem);
    Vec<T, VEC> hv;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      hv.v[j] = FromFloat<T>(ToFloat(xv.v[j]) + ToFloat(rv.v[j]));
      f[j] = ToFloat(hv.v[j]);
    }
    StoreVecStream<T, VEC>(p.h, elem, hv);
  } else {
    ToFloats<T, VEC>(xv, f);
  }
}

// The weight and bias vectors of column `col` (left unset where the parameter is absent).
template <typename W, int VEC>
__device__ __forceinline__ void LoadParams(const NormFwdParams& p, int64_t group, int64_t col,
                                           Vec<W, VEC>& w, Vec<W, VEC>& b) {
  if (p.weight) w = LoadParam<W, VEC>(p.weight, group * p.weight_group_stride + col);
  if (p.bias) b = LoadParam<W, VEC>(p.bias, group * p.bias_group_stride + col);
}

// y = (f - mean) * rstd * (offset + w) + b at `elem`, from parameter vectors already loaded.
template <typename T, typename W, int VEC>
__device__ __forceinline__ void StoreNormalized(const NormFwdParams& p, int64_t elem,
                                                const float (&f)[VEC], const Vec<W, VEC>& wv,
                                                const Vec<W, VEC>& bv, float mean, float rstd) {
  float w[VEC], b[VEC];
  if (p.weight) ToFloats<W, VEC>(wv, w);
  if (p.bias) ToFloats<W, VEC>(bv, b);
  Vec<T, VEC> out;
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    float y = (f[j] - mean) * rstd;
    if (p.weight) y *= p.weight_offset + w[j];
    if (p.bias) y += b[j];
    out.v[j] = FromFloat<T>(y);
  }
  StoreVecStream<T, VEC>(p.y, elem, out);
}

template <typename T, typename W, int VEC>
__device__ __forceinline__ void StoreOutput(const NormFwdParams& p, int64_t group, int64_t elem,
                                            int64_t col, const float (&f)[VEC], float mean,
                                            float rstd) {
  Vec<W, VEC> w, b;
  LoadParams<W, VEC>(p, group, col, w, b);
  StoreNormalized<T, W, VEC>(p, elem, f, w, b, mean, rstd);
}

// The VPT vectors of one row that thread (threadIdx.x) owns: columns
// (threadIdx.x + k * tpr) * VEC. Out-of-row vectors read as zero.
template <typename T, int VEC, int VPT>
__device__ __forceinline__ void LoadRow(const void* src, int64_t base, int64_t D, int tpr,
                                        bool valid, Vec<T, VEC> (&v)[VPT]) {
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int col = (int(threadIdx.x) + k * tpr) * VEC;  // < D <= INT32_MAX
    if (valid && col < D) {
      v[k] = LoadVecStream<T, VEC>(src, base + col);
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) v[k].v[j] = FromFloat<T>(0.f);
    }
  }
}

// dx (+ dh, the cotangent of the residual stream, read from memory) at `elem`.
template <typename T, int VEC>
__device__ __forceinline__ void StoreDx(const NormBwdParams& p, int64_t elem, float (&dx)[VEC]) {
  if (p.dh) {
    float dh[VEC];
    ToFloats<T, VEC>(LoadVecStream<T, VEC>(p.dh, elem), dh);
#pragma unroll
    for (int j = 0; j < VEC; ++j) dx[j] += dh[j];
  }
  StoreVecStream<T, VEC>(p.dx, elem, ToVec<T, VEC>(dx));
}

// ---- forward -------------------------------------------------------------------------------
//
// Staged kernel (rows of whole 16-byte vectors that fit in shared memory): each thread
// cp.asyncs its vectors of the row (and residual) into shared memory, then makes its
// passes from there. Rows held in registers capped residency at 2-3 rows per SM (66-128
// registers a thread) and the kernel reached 2.0-2.4 TB/s on the H100 at 16384 x 8192;
// staged, a thread keeps 40 registers, an SM holds 7-8 rows (112-128 KiB) in flight, and
// the kernel reached 2.89 TB/s (1.02x XLA).

template <typename T, typename W, int VEC, bool kLayer, bool kResidual>
__global__ void __launch_bounds__(kBlockThreads) NormFwdStaged(const NormFwdParams p, int tpr) {
  extern __shared__ __align__(16) unsigned char staged[];
  __shared__ float scratch[kScratchFloats];
  const int64_t rows = p.groups * p.rows_per_group;
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool valid = row < rows;
  const int D = static_cast<int>(p.dim);
  const int step = tpr * VEC;
  const int first = int(threadIdx.x) * VEC;
  T* xs = reinterpret_cast<T*>(staged) + int64_t(threadIdx.y) * D * (kResidual ? 2 : 1);
  T* rs = xs + D;
  const int64_t base = row * p.dim;
  if (valid) {
    for (int c = first; c < D; c += step) {
      CpAsync16(xs + c, static_cast<const T*>(p.x) + base + c);
      if constexpr (kResidual) CpAsync16(rs + c, static_cast<const T*>(p.residual) + base + c);
    }
  }
  CpAsyncCommit();
  CpAsyncWait<0>();  // each thread reads back only the vectors it copied

  // Pass 1: h = round(x + residual) (stored, and kept in xs), sum or sum of squares.
  float s[1] = {0.f};
  if (valid) {
    for (int c = first; c < D; c += step) {
      Vec<T, VEC> h = *reinterpret_cast<const Vec<T, VEC>*>(xs + c);
      if constexpr (kResidual) {
        const Vec<T, VEC> r = *reinterpret_cast<const Vec<T, VEC>*>(rs + c);
#pragma unroll
        for (int j = 0; j < VEC; ++j) h.v[j] = FromFloat<T>(ToFloat(h.v[j]) + ToFloat(r.v[j]));
        *reinterpret_cast<Vec<T, VEC>*>(xs + c) = h;
        StoreVecStream<T, VEC>(p.h, base + c, h);
      }
#pragma unroll
      for (int j = 0; j < VEC; ++j)
        s[0] += kLayer ? ToFloat(h.v[j]) : ToFloat(h.v[j]) * ToFloat(h.v[j]);
    }
  }
  RowSum(s, scratch, tpr);
  float mean = 0.f, ss = s[0];
  if constexpr (kLayer) {
    // Centered second pass (from shared memory): exact even when |mean| >> std.
    mean = s[0] / float(D);
    float c2[1] = {0.f};
    if (valid) {
      for (int c = first; c < D; c += step) {
        const Vec<T, VEC> h = *reinterpret_cast<const Vec<T, VEC>*>(xs + c);
#pragma unroll
        for (int j = 0; j < VEC; ++j) c2[0] += (ToFloat(h.v[j]) - mean) * (ToFloat(h.v[j]) - mean);
      }
    }
    RowSum(c2, scratch, tpr);
    ss = c2[0];
  }
  const float rstd = rsqrtf(ss / float(D) + p.eps);
  if (!valid) return;
  if (threadIdx.x == 0) {
    p.rstd[row] = rstd;
    if constexpr (kLayer) p.mean[row] = mean;
  }
  const int64_t group = row / p.rows_per_group;
  for (int c = first; c < D; c += step) {
    float f[VEC];
    ToFloats<T, VEC>(*reinterpret_cast<const Vec<T, VEC>*>(xs + c), f);
    StoreOutput<T, W, VEC>(p, group, base + c, c, f, mean, rstd);
  }
}

// Register kernel for rows that are not whole 16-byte vectors (VEC = 1): each of `tpr`
// threads holds VPT elements of the row.
template <typename T, typename W, int VEC, int VPT, bool kLayer>
__global__ void __launch_bounds__(kRegsMaxThreads) NormFwdRegs(const NormFwdParams p, int tpr) {
  __shared__ float scratch[kScratchFloats];
  const int64_t rows = p.groups * p.rows_per_group;
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool valid = row < rows;
  const int64_t D = p.dim;
  const int64_t base = row * D;

  Vec<T, VEC> h[VPT];
  LoadRow<T, VEC, VPT>(p.x, base, D, tpr, valid, h);
  // The parameters are loaded with the row, before its reduction (for the few-row grids
  // this kernel serves: measured the same as loading them after, 2.03 against 2.05 us a
  // one-row call on the H100).
  const int64_t group = row / p.rows_per_group;
  Vec<W, VEC> wv[VPT], bv[VPT];
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int col = (int(threadIdx.x) + k * tpr) * VEC;
    if (valid && col < D) LoadParams<W, VEC>(p, group, col, wv[k], bv[k]);
  }
  if (p.residual) {
    Vec<T, VEC> r[VPT];
    LoadRow<T, VEC, VPT>(p.residual, base, D, tpr, valid, r);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
#pragma unroll
      for (int j = 0; j < VEC; ++j)
        h[k].v[j] = FromFloat<T>(ToFloat(h[k].v[j]) + ToFloat(r[k].v[j]));
      const int col = (int(threadIdx.x) + k * tpr) * VEC;
      if (valid && col < D) StoreVecStream<T, VEC>(p.h, base + col, h[k]);
    }
  }

  float mean = 0.f;
  if constexpr (kLayer) {
    float s[1] = {0.f};
#pragma unroll
    for (int k = 0; k < VPT; ++k)
#pragma unroll
      for (int j = 0; j < VEC; ++j) s[0] += ToFloat(h[k].v[j]);
    RowSum(s, scratch, tpr);
    mean = s[0] / float(D);
  }
  float ss[1] = {0.f};
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int col = (int(threadIdx.x) + k * tpr) * VEC;
    if (col < D) {
#pragma unroll
      for (int j = 0; j < VEC; ++j)
        ss[0] += (ToFloat(h[k].v[j]) - mean) * (ToFloat(h[k].v[j]) - mean);
    }
  }
  RowSum(ss, scratch, tpr);
  const float rstd = rsqrtf(ss[0] / float(D) + p.eps);
  if (!valid) return;  // after the last barrier
  if (threadIdx.x == 0) {
    p.rstd[row] = rstd;
    if constexpr (kLayer) p.mean[row] = mean;
  }
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int col = (int(threadIdx.x) + k * tpr) * VEC;
    if (col < D) {
      float f[VEC];
      ToFloats<T, VEC>(h[k], f);
      StoreNormalized<T, W, VEC>(p, base + col, f, wv[k], bv[k], mean, rstd);
    }
  }
}

// One row per block of 1024 threads; the row is read up to three times (the later reads
// mostly hit L2). With a residual the later passes read h, which this thread wrote.
template <typename T, typename W, int VEC, bool kLayer>
__global__ void __launch_bounds__(1024) NormFwdLoop(const NormFwdParams p) {
  __shared__ float scratch[kScratchFloats];
  const int64_t row = blockIdx.x;
  const int64_t D = p.dim;
  const int64_t base = row * D;
  const int64_t step = int64_t(blockDim.x) * VEC;
  const void* src = p.residual ? p.h : p.x;

  float s[1] = {0.f};
  for (int64_t col = int64_t(threadIdx.x) * VEC; col < D; col += step) {
    float f[VEC];
    LoadInput<T, VEC>(p, base + col, f);
#pragma unroll
    for (int j = 0; j < VEC; ++j) s[0] += kLayer ? f[j] : f[j] * f[j];
  }
  RowSum(s, scratch, blockDim.x);
  float mean = 0.f, ss = s[0];
  if constexpr (kLayer) {
    mean = s[0] / float(D);
    float c2[1] = {0.f};
    for (int64_t col = int64_t(threadIdx.x) * VEC; col < D; col += step) {
      float f[VEC];
      ToFloats<T, VEC>(LoadVec<T, VEC>(src, base + col), f);
#pragma unroll
      for (int j = 0; j < VEC; ++j) c2[0] += (f[j] - mean) * (f[j] - mean);
    }
    RowSum(c2, scratch, blockDim.x);
    ss = c2[0];
  }
  const float rstd = rsqrtf(ss / float(D) + p.eps);
  if (threadIdx.x == 0) {
    p.rstd[row] = rstd;
    if constexpr (kLayer) p.mean[row] = mean;
  }
  const int64_t group = row / p.rows_per_group;
  for (int64_t col = int64_t(threadIdx.x) * VEC; col < D; col += step) {
    float f[VEC];
    ToFloats<T, VEC>(LoadVec<T, VEC>(src, base + col), f);
    StoreOutput<T, W, VEC>(p, group, base + col, col, f, mean, rstd);
  }
}

// ---- backward ------------------------------------------------------------------------------
//
// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) + dh, with g = dy * (offset + w) and
// xhat = (xh - mean) * rstd (mean = 0 and no mean(g) term for RMSNorm).
// dweight = sum over rows of dy * xhat, dbias = sum of dy: each "slot" (a row position of
// a block) accumulates its rows' contributions in registers and writes one partial row;
// ReducePartials sums the slots in a fixed order.

template <typename W, int VEC>
__device__ __forceinline__ void WeightFloats(const NormBwdParams& p, int64_t group, int64_t col,
                                             float (&w)[VEC]) {
  if (p.weight) {
    ToFloats<W, VEC>(LoadParam<W, VEC>(p.weight, group * p.weight_group_stride + col), w);
#pragma unroll
    for (int j = 0; j < VEC; ++j) w[j] += p.weight_offset;
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) w[j] = 1.f;
  }
}

// Per-thread state of a backward row slot: the weights of its columns (stored as W), and
// the dweight/dbias sums of its rows (dbias for layer norm only).
template <typename T, typename W, int VEC, int VPT, bool kLayer>
struct BwdColumns {
  static constexpr int kDb = kLayer ? VPT : 1;
  Vec<W, VEC> w[VPT];
  float dw[VPT][VEC], db[kDb][VEC];
  float w_add;  // weight_offset, or 1 without a weight (a scale of 1)

  __device__ __forceinline__ void Init(const NormBwdParams& p, int64_t group, int tpr, int D) {
    w_add = p.weight ? p.weight_offset : 1.f;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int col = (int(threadIdx.x) + k * tpr) * VEC;  // < D <= INT32_MAX
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        w[k].v[j] = FromFloat<W>(0.f);
        dw[k][j] = 0.f;
        if (kLayer) db[k < kDb ? k : 0][j] = 0.f;
      }
      if (p.weight && col < D)
        w[k] = LoadParam<W, VEC>(p.weight, group * p.weight_group_stride + col);
    }
  }

  // One vector of a row: accumulates dweight/dbias and the row sums of g and g * xhat.
  __device__ __forceinline__ void Add(int k, const Vec<T, VEC>& dy, const Vec<T, VEC>& x,
                                      float mean, float rstd, float (&sums)[2]) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float d = ToFloat(dy.v[j]);
      const float xhat = (ToFloat(x.v[j]) - mean) * rstd;
      const float g = d * (ToFloat(w[k].v[j]) + w_add);
      sums[0] += g;
      sums[1] += g * xhat;
      dw[k][j] += d * xhat;
      if constexpr (kLayer) db[k][j] += d;
    }
  }

  // dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) for one vector.
  __device__ __forceinline__ void Dx(int k, const Vec<T, VEC>& dy, const Vec<T, VEC>& x, float mean,
                                     float rstd, float mean_g, float mean_gx,
                                     float (&dx)[VEC]) const {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float xhat = (ToFloat(x.v[j]) - mean) * rstd;
      const float g = ToFloat(dy.v[j]) * (ToFloat(w[k].v[j]) + w_add);
      dx[j] = rstd * (g - mean_g - xhat * mean_gx);
    }
  }

  // This slot's partial row of dweight (and dbias).
  __device__ __forceinline__ void Write(int64_t partial, int tpr, int D, float* ws_dw,
                                        float* ws_db) const {
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int col = (int(threadIdx.x) + k * tpr) * VEC;
      if (col >= D) continue;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        if (ws_dw) ws_dw[partial + col + j] = dw[k][j];
        if constexpr (kLayer) {
          if (ws_db) ws_db[partial + col + j] = db[k][j];
        }
      }
    }
  }
};

template <typename T, typename W, int VEC, int VPT, bool kLayer>
__global__ void __launch_bounds__(kRegsMaxThreads)
    NormBwdRegs(const NormBwdParams p, int tpr, int blocks_per_group, float* ws_dw, float* ws_db) {
  __shared__ float scratch[kScratchFloats];
  const int64_t group = blockIdx.x / blocks_per_group;
  const int64_t slots = p.slots;
  const int64_t slot = int64_t(blockIdx.x % blocks_per_group) * blockDim.y + threadIdx.y;
  const bool has_slot = slot < slots;  // the last block of a group may have spare rows
  const int64_t R = p.rows_per_group;
  const int D = static_cast<int>(p.dim);
  BwdColumns<T, W, VEC, VPT, kLayer> cols;
  cols.Init(p, group, tpr, D);

  const int64_t iters = CeilDiv(R, slots);  // the same for every thread of the block
  for (int64_t it = 0; it < iters; ++it) {
    const int64_t r = it * slots + slot;
    const bool valid = has_slot && r < R;
    const int64_t row = group * R + r;
    const int64_t base = row * p.dim;
    const float rstd = valid ? p.rstd[row] : 0.f;
    const float mean = (kLayer && valid) ? p.mean[row] : 0.f;

    Vec<T, VEC> dyv[VPT], xv[VPT];
    LoadRow<T, VEC, VPT>(p.dy, base, D, tpr, valid, dyv);
    LoadRow<T, VEC, VPT>(p.xh, base, D, tpr, valid, xv);
    float sums[2] = {0.f, 0.f};
#pragma unroll
    for (int k = 0; k < VPT; ++k) cols.Add(k, dyv[k], xv[k], mean, rstd, sums);  // zeros outside
    RowSum(sums, scratch, tpr);
    if (!valid) continue;
    const float mean_g = kLayer ? sums[0] / float(D) : 0.f;
    const float mean_gx = sums[1] / float(D);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int col = (int(threadIdx.x) + k * tpr) * VEC;
      if (col >= D) continue;
      float dx[VEC];
      cols.Dx(k, dyv[k], xv[k], mean, rstd, mean_g, mean_gx, dx);
      StoreDx<T, VEC>(p, base + col, dx);
    }
  }
  if (has_slot) cols.Write((group * slots + slot) * p.dim, tpr, D, ws_dw, ws_db);
}

// Staged backward pass (rows of whole 16-byte vectors): dy and xh (and dh) of the next
// kStages - 1 rows of a slot are cp.async'ed into shared-memory stages while the current
// row is processed, so loads stay in flight across the row's reduction and stores.
// Registers hold only the dweight/dbias accumulators and the weights.
template <typename T, typename W, int VEC, int VPT, bool kLayer, int kStages>
__global__ void __launch_bounds__(kRegsMaxThreads)
    NormBwdStaged(const NormBwdParams p, int tpr, int blocks_per_group, float* ws_dw,
                  float* ws_db) {
  extern __shared__ __align__(16) unsigned char staged[];
  __shared__ float scratch[kScratchFloats];
  const int64_t group = blockIdx.x / blocks_per_group;
  const int64_t slots = p.slots;
  const int64_t slot = int64_t(blockIdx.x % blocks_per_group) * blockDim.y + threadIdx.y;
  const bool has_slot = slot < slots;
  const int64_t R = p.rows_per_group;
  const int D = static_cast<int>(p.dim);
  const int arrays = p.dh ? 3 : 2;  // dy, xh (, dh)
  // Stage layout: [stage][row slot of the block][array][D].
  T* mine = reinterpret_cast<T*>(staged) + int64_t(threadIdx.y) * arrays * D;
  const int64_t stage_elems = int64_t(blockDim.y) * arrays * D;

  BwdColumns<T, W, VEC, VPT, kLayer> cols;
  cols.Init(p, group, tpr, D);

  const int64_t iters = CeilDiv(R, slots);  // the same for every thread of the block
  auto issue = [&](int64_t it) {            // stage the row of iteration `it` (if any), one group
    const int64_t r = it * slots + slot;
    if (has_slot && it < iters && r < R) {
      const int64_t base = (group * R + r) * p.dim;
      T* dst = mine + (it % kStages) * stage_elems;
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int col = (int(threadIdx.x) + k * tpr) * VEC;
        if (col < D) {
          CpAsync16(dst + col, static_cast<const T*>(p.dy) + base + col);
          CpAsync16(dst + D + col, static_cast<const T*>(p.xh) + base + col);
          if (p.dh) CpAsync16(dst + 2 * D + col, static_cast<const T*>(p.dh) + base + col);
        }
      }
    }
    CpAsyncCommit();
  };

  for (int s = 0; s < kStages - 1; ++s) issue(s);
  for (int64_t it = 0; it < iters; ++it) {
    issue(it + kStages - 1);
    CpAsyncWait<kStages - 1>();  // this thread's copies of row `it` have landed
    const int64_t r = it * slots + slot;
    const bool valid = has_slot && r < R;
    const int64_t row = group * R + r;
    const float rstd = valid ? p.rstd[row] : 0.f;
    const float mean = (kLayer && valid) ? p.mean[row] : 0.f;
    const T* cur = mine + (it % kStages) * stage_elems;

    float sums[2] = {0.f, 0.f};
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int col = (int(threadIdx.x) + k * tpr) * VEC;
      if (!valid || col >= D) continue;
      cols.Add(k, *reinterpret_cast<const Vec<T, VEC>*>(cur + col),
               *reinterpret_cast<const Vec<T, VEC>*>(cur + D + col), mean, rstd, sums);
    }
    RowSum(sums, scratch, tpr);
    if (!valid) continue;
    const float mean_g = kLayer ? sums[0] / float(D) : 0.f;
    const float mean_gx = sums[1] / float(D);
    const int64_t base = row * p.dim;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int col = (int(threadIdx.x) + k * tpr) * VEC;
      if (col >= D) continue;
      float dx[VEC];
      cols.Dx(k, *reinterpret_cast<const Vec<T, VEC>*>(cur + col),
              *reinterpret_cast<const Vec<T, VEC>*>(cur + D + col), mean, rstd, mean_g, mean_gx,
              dx);
      if (p.dh) {
        const Vec<T, VEC> dhv = *reinterpret_cast<const Vec<T, VEC>*>(cur + 2 * D + col);
#pragma unroll
        for (int j = 0; j < VEC; ++j) dx[j] += ToFloat(dhv.v[j]);
      }
      StoreVecStream<T, VEC>(p.dx, base + col, ToVec<T, VEC>(dx));
    }
  }
  CpAsyncWait<0>();
  if (has_slot) cols.Write((group * slots + slot) * p.dim, tpr, D, ws_dw, ws_db);
}

// Rows too wide for registers: one row at a time per block of 1024 threads, two passes,
// partial sums accumulated in the (zeroed) workspace row this block owns.
template <typename T, typename W, int VEC, bool kLayer>
__global__ void __launch_bounds__(1024)
    NormBwdLoop(const NormBwdParams p, int tpr, int blocks_per_group, float* ws_dw, float* ws_db) {
  __shared__ float scratch[kScratchFloats];
  const int64_t group = blockIdx.x / blocks_per_group;
  const int64_t slot = blockIdx.x % blocks_per_group;  // one row slot per block here
  const int64_t slots = p.slots;
  const int64_t R = p.rows_per_group, D = p.dim;
  const int64_t step = int64_t(blockDim.x) * VEC;
  const int64_t partial = (group * slots + slot) * D;

  for (int64_t r = slot; r < R; r += slots) {  // uniform across the block
    const int64_t row = group * R + r;
    const int64_t base = row * D;
    const float rstd = p.rstd[row];
    const float mean = kLayer ? p.mean[row] : 0.f;
    float sums[2] = {0.f, 0.f};
    for (int64_t col = int64_t(threadIdx.x) * VEC; col < D; col += step) {
      float dy[VEC], x[VEC], w[VEC];
      ToFloats<T, VEC>(LoadVec<T, VEC>(p.dy, base + col), dy);
      ToFloats<T, VEC>(LoadVec<T, VEC>(p.xh, base + col), x);
      WeightFloats<W, VEC>(p, group, col, w);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float xhat = (x[j] - mean) * rstd;
        sums[0] += dy[j] * w[j];
        sums[1] += dy[j] * w[j] * xhat;
      }
    }
    RowSum(sums, scratch, tpr);
    const float mean_g = kLayer ? sums[0] / float(D) : 0.f;
    const float mean_gx = sums[1] / float(D);
    for (int64_t col = int64_t(threadIdx.x) * VEC; col < D; col += step) {
      float dy[VEC], x[VEC], w[VEC], dh[VEC];
      ToFloats<T, VEC>(LoadVec<T, VEC>(p.dy, base + col), dy);
      ToFloats<T, VEC>(LoadVec<T, VEC>(p.xh, base + col), x);
      WeightFloats<W, VEC>(p, group, col, w);
      if (p.dh) ToFloats<T, VEC>(LoadVec<T, VEC>(p.dh, base + col), dh);
      Vec<T, VEC> out;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float xhat = (x[j] - mean) * rstd;
        float dx = rstd * (dy[j] * w[j] - mean_g - xhat * mean_gx);
        if (p.dh) dx += dh[j];
        out.v[j] = FromFloat<T>(dx);
        if (ws_dw) ws_dw[partial + col + j] += dy[j] * xhat;
        if (ws_db) ws_db[partial + col + j] += dy[j];
      }
      StoreVec<T, VEC>(p.dx, base + col, out);
    }
  }
}

// out[g, c] = sum over s of partials[g, s, c], s in a fixed order: 8 strided lanes per
// column, then the 8 lane sums in order. Deterministic for a given grid.
__global__ void ReducePartials(const float* __restrict__ partials, int64_t slots, int64_t D,
                               float* __restrict__ out) {
  __shared__ float lane_sums[8][33];
  const int64_t col_blocks = CeilDiv(D, 32);
  const int64_t group = blockIdx.x / col_blocks;
  const int64_t col = (blockIdx.x % col_blocks) * 32 + threadIdx.x;
  float s = 0.f;
  if (col < D) {
    const float* src = partials + group * slots * D + col;
    for (int64_t i = threadIdx.y; i < slots; i += 8) s += src[i * D];
  }
  lane_sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < D) {
    float t = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) t += lane_sums[i][threadIdx.x];
    out[group * D + col] = t;
  }
}

using BwdKernel = void (*)(NormBwdParams, int, int, float*, float*);

// Register kernels (rows that are not whole 16-byte vectors) hold up to 4 (forward) or 2
// (backward: it also holds accumulators) elements per thread at <= 512 threads; the
// staged backward kernel holds up to 4 vectors of accumulators per thread. Wider rows
// take the loop kernels.
constexpr int kFwdRegsMaxVpt = 4;
constexpr int kBwdRegsMaxVpt = 2;
constexpr int kBwdStagedMaxVpt = 4;

// Developer knob (common/dev_knobs.h): JAXGPU_NORM_TUNE="a,b" overrides the target vectors
// per thread of the forward (a) and backward (b) passes.
int TunedVpt(int which, int fallback) {
  if (!kDevKnobs) return fallback;
  static const DevKnob knob = ReadDevKnob("JAXGPU_NORM_TUNE");
  return knob.ints[which] > 0 ? knob.ints[which] : fallback;
}

template <typename W>
struct ParamTag {
  using type = W;
};

// Calls f(ParamTag<W>{}) with W, the parameters' storage type: T, or float for float32
// master weights. Any other type is an error (the handlers admit no other). For a float
// T both cases name the same kernels.
template <typename T, typename F>
cudaError_t WithParamType(DType dtype, DType param_dtype, F&& f) {
  if (param_dtype == dtype) return f(ParamTag<T>{});
  if (param_dtype == DType::kF32) return f(ParamTag<float>{});
  return cudaErrorInvalidValue;
}

struct BwdLaunch {
  BwdKernel kernel;
  RowConfig cfg;
  int64_t smem;
};

cudaError_t SelectBwd(const NormBwdParams& p, BwdLaunch* l) {
  return JAXGPU_DTYPE_SWITCH(p.dtype, T, kFloatDTypes, [&] {
    constexpr int kFull = 16 / sizeof(T);
    return WithParamType<T>(p.dtype, p.param_dtype, [&](auto tag) {
      using W = typename decltype(tag)::type;
      return JAXGPU_BOOL_SWITCH(p.kind == NormKind::kLayer, kLayer, [&] {
        const int arrays = p.dh ? 3 : 2;
        if (p.dim % kFull == 0) {
          // 4 vectors a thread (256 threads for 8192 bf16) measured 0.50 ms for rms_norm
          // forward+backward at 16384 x 8192 on the H100, against 0.55 ms at 2 (512 threads).
          const RowConfig c =
              ChooseRowConfig(p.dim, p.dtype, TunedVpt(1, 4), kBwdStagedMaxVpt, kRegsMaxThreads);
          // Two stages: three measured 1-17% slower (rms_norm+res 0.89 ms against 0.77 at
          // 16384 x 8192, H100): the extra 32 KiB a block cost residency.
          constexpr int kStages = 2;
          const int64_t smem = kStages * int64_t(c.rows_per_block) * arrays * p.dim * sizeof(T);
          if (!c.loop && smem <= MaxStagedBytes(kScratchBytes)) {
            return JAXGPU_INT_SWITCH(c.vpt, VPT, (1, 2, 4), [&] {
              *l = {NormBwdStaged<T, W, kFull, VPT, kLayer, kStages>, c, smem};
              return cudaSuccess;
            });
          }
        }
        const RowConfig c = ChooseRowConfig(p.dim, p.dtype, 2, kBwdRegsMaxVpt, kRegsMaxThreads);
        const bool vec = p.dim % kFull == 0;
        if (c.loop) {
          *l = {vec ? NormBwdLoop<T, W, kFull, kLayer> : NormBwdLoop<T, W, 1, kLayer>, c, 0};
          return cudaSuccess;
        }
        return JAXGPU_INT_SWITCH(c.vpt, VPT, (1, 2), [&] {
          *l = {NormBwdRegs<T, W, 1, VPT, kLayer>, c, 0};
          return cudaSuccess;
        });
      });
    });
  });
}

}  // namespace

cudaError_t LaunchNormFwd(const NormFwdParams& p, cudaStream_t stream) {
  const int64_t rows = p.groups * p.rows_per_group;
  if (rows == 0 || p.dim == 0) return cudaSuccess;
  const cudaError_t status = JAXGPU_DTYPE_SWITCH(p.dtype, T, kFloatDTypes, [&] {
    constexpr int kFull = 16 / sizeof(T);
    return WithParamType<T>(p.dtype, p.param_dtype, [&](auto tag) {
      using W = typename decltype(tag)::type;
      return JAXGPU_BOOL_SWITCH(p.kind == NormKind::kLayer, kLayer, [&] {
        if (p.dim % kFull == 0) {
          // At most one wave of blocks (a decode step's few rows): latency, not residency,
          // decides. The register kernel, one or two 16-byte vectors a thread (rows up to
          // 8192 bf16; four spill), issues the row's and the parameters' loads at once.
          // Measured on the H100, 200 calls chained in a CUDA graph (tools/norm_latency_check):
          // bf16 1152 x 1 row 2.66 -> 2.03 us a call, x 8 rows 2.95 -> 2.21, x 64 rows
          // 3.03 -> 2.24, 256 x 4 rows 2.77 -> 1.72, 2304 + residual 2.88 -> 2.36 us; a
          // one-vector-a-thread norm with no options takes 1.51, a 2 KB copy 0.99.
          const RowConfig few = ChooseRowConfig(p.dim, p.dtype, 1, 2, kRegsMaxThreads);
          if (!few.loop && CeilDiv(rows, few.rows_per_block) <= SmCount()) {
            return JAXGPU_INT_SWITCH(few.vpt, VPT, (1, 2), [&] {
              NormFwdRegs<T, W, kFull, VPT, kLayer>
                  <<<CeilDiv(rows, few.rows_per_block), dim3(few.tpr, few.rows_per_block), 0,
                     stream>>>(p, few.tpr);
              return cudaSuccess;
            });
          }
          // Staged: 256-thread blocks, a row per `tpr` threads (~4 vectors each).
          const int64_t nvec = p.dim / kFull;
          const int tpr = std::min(kBlockThreads, NextPow2(CeilDiv(nvec, TunedVpt(0, 4))));
          const int rpb = kBlockThreads / tpr;
          const int64_t smem = int64_t(rpb) * p.dim * sizeof(T) * (p.residual ? 2 : 1);
          if (smem <= MaxStagedBytes(kScratchBytes)) {
            auto kernel = p.residual ? NormFwdStaged<T, W, kFull, kLayer, true>
                                     : NormFwdStaged<T, W, kFull, kLayer, false>;
            if (cudaError_t err = AllowSmem(kernel, smem); err != cudaSuccess) return err;
            kernel<<<CeilDiv(rows, rpb), dim3(tpr, rpb), smem, stream>>>(p, tpr);
            return cudaSuccess;
          }
        }
        const RowConfig c = ChooseRowConfig(p.dim, p.dtype, 4, kFwdRegsMaxVpt, kRegsMaxThreads);
        if (c.loop || c.vec != 1) {  // too wide for registers (or for shared memory)
          auto kernel =
              c.vec == 1 ? NormFwdLoop<T, W, 1, kLayer> : NormFwdLoop<T, W, kFull, kLayer>;
          kernel<<<rows, 1024, 0, stream>>>(p);
          return cudaSuccess;
        }
        return JAXGPU_INT_SWITCH(c.vpt, VPT, (1, 2, 4), [&] {
          NormFwdRegs<T, W, 1, VPT, kLayer>
              <<<CeilDiv(rows, c.rows_per_block), dim3(c.tpr, c.rows_per_block), 0, stream>>>(
                  p, c.tpr);
          return cudaSuccess;
        });
      });
    });
  });
  if (status != cudaSuccess) return status;
  return cudaGetLastError();
}

cudaError_t LaunchNormBwd(const NormBwdParams& p, cudaStream_t stream) {
  const int64_t D = p.dim;
  if (p.groups == 0 || D == 0) return cudaSuccess;
  if (p.rows_per_group == 0) {  // no rows: the gradients of the parameters are zero
    if (p.dweight) cudaMemsetAsync(p.dweight, 0, sizeof(float) * p.groups * D, stream);
    if (p.dbias) cudaMemsetAsync(p.dbias, 0, sizeof(float) * p.groups * D, stream);
    return cudaGetLastError();
  }
  BwdLaunch l{};
  if (cudaError_t err = SelectBwd(p, &l); err != cudaSuccess) return err;
  if (cudaError_t err = AllowSmem(l.kernel, l.smem); err != cudaSuccess) return err;
  const int64_t one = p.groups * p.slots * D;
  float* ws_dw = p.dweight ? p.workspace : nullptr;
  float* ws_db = p.dbias ? p.workspace + (p.dweight ? one : 0) : nullptr;
  if (l.cfg.loop && p.workspace) {  // the loop kernel accumulates into its partial rows
    cudaMemsetAsync(p.workspace, 0, sizeof(float) * one * ((ws_dw ? 1 : 0) + (ws_db ? 1 : 0)),
                    stream);
  }
  // Without wanted gradients there is no workspace: one slot per row.
  const int64_t slots = p.workspace ? p.slots : p.rows_per_group;
  NormBwdParams q = p;
  q.slots = slots;
  const int blocks_per_group = static_cast<int>(CeilDiv(slots, l.cfg.rows_per_block));
  const dim3 block(l.cfg.tpr, l.cfg.rows_per_block);
  l.kernel<<<p.groups * blocks_per_group, block, l.smem, stream>>>(q, l.cfg.tpr, blocks_per_group,
                                                                   ws_dw, ws_db);
  const dim3 rblock(32, 8);
  const int64_t rgrid = p.groups * CeilDiv(D, 32);
  if (ws_dw) ReducePartials<<<rgrid, rblock, 0, stream>>>(ws_dw, slots, D, p.dweight);
  if (ws_db) ReducePartials<<<rgrid, rblock, 0, stream>>>(ws_db, slots, D, p.dbias);
  return cudaGetLastError();
}

}  // namespace jaxgpu::cuda
