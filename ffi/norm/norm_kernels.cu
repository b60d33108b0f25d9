// RMSNorm / LayerNorm kernels, forward and backward, with the optional residual add fused.
//
// Napkin math (H100, 16384 x 8192 bf16): the forward pass must read x (256 MiB) and write
// y (256 MiB); at the ~3.0 TB/s a device copy reaches that is ~0.18 ms. With a residual it
// reads x and residual and writes y and h: twice that. The backward pass reads dy and x
// and writes dx (~0.27 ms); the weight-gradient partials (blocks x D floats) are < 2% of it.
// So every kernel here is memory-bound: one read of each input, 16-byte accesses, enough
// bytes in flight per SM, and the statistics in registers.
//
// Row mapping. A row of D elements is split into 16-byte vectors (VEC elements; VEC = 1
// when D is not a multiple of it, so rows stay aligned). `tpr` threads (a power of two)
// share a row, each holding VPT vectors in registers, so x is read from memory once and
// normalized from registers. Rows narrower than a 256-thread block share one block
// (blockDim.y rows). Rows too wide for registers (more than VPT_max * 512 vectors) use a
// loop kernel that re-reads the row (from L2, mostly).
#include "norm/norm_cuda.h"

#include <algorithm>

#include "common/cuda_utils.cuh"

namespace jaxgpu::cuda {
namespace {

// Threads per block when several rows share a block: 256 measured best-or-equal to 128
// and 512 for memory-bound row kernels on A100/H100-class parts in earlier projects; rows
// wider than 256 threads get a block of their own.
constexpr int kBlockThreads = 256;
// Shared scratch of RowSum: 32 floats per row per reduced value; a block has at most
// 4 rows when rows span more than one warp (tpr >= 64 and 256 threads), 2 values.
constexpr int kScratchFloats = 4 * 32 * 2;
// Register-path blocks stop at 512 threads, so each thread may use 128 registers
// (65536 per SM). Measured with ptxas (-Xptxas=-warn-spills, sm_90): at the 64-register
// cap of 1024 threads the forward pass spilled 740 bytes at 8 bf16 vectors per thread,
// and the backward pass (dweight/dbias accumulators) spilled 380-680 bytes at 4 vectors
// under 512 threads. Wider rows take the loop kernels.
constexpr int kRegsMaxThreads = 512;

struct RowConfig {
  int vec;             // elements per access
  int tpr;             // threads per row
  int vpt;             // vectors per thread (register path)
  int rows_per_block;
  bool loop;           // the row does not fit in registers
};

// target_vpt trades registers for memory-level parallelism: the forward pass holds only
// the row (4 vectors = 64 B in flight per thread), the backward pass also holds
// dweight/dbias accumulators for its columns, so it takes 2 and more threads.
RowConfig ChooseRowConfig(int64_t dim, DType dtype, int target_vpt, int max_vpt, int max_tpr) {
  RowConfig c{};
  const int full = static_cast<int>(16 / DTypeBytes(dtype));
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
__device__ __forceinline__ void ToFloats(const Vec<T, VEC>& v, float (&f)[VEC]) {
#pragma unroll
  for (int j = 0; j < VEC; ++j) f[j] = ToFloat(v.v[j]);
}

// Loads x (and residual) at `elem`; with a residual, stores h = round(x + residual) and
// returns h, which is what gets normalized (the reference adds in the storage dtype).
template <typename T, int VEC>
__device__ __forceinline__ void LoadInput(const NormFwdParams& p, int64_t elem, float (&f)[VEC]) {
  const Vec<T, VEC> xv = LoadVec<T, VEC>(p.x, elem);
  if (p.residual) {
    const Vec<T, VEC> rv = LoadVec<T, VEC>(p.residual, elem);
    Vec<T, VEC> hv;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      hv.v[j] = FromFloat<T>(ToFloat(xv.v[j]) + ToFloat(rv.v[j]));
      f[j] = ToFloat(hv.v[j]);
    }
    StoreVec<T, VEC>(p.h, elem, hv);
  } else {
    ToFloats<T, VEC>(xv, f);
  }
}

template <typename T, int VEC>
__device__ __forceinline__ void StoreOutput(const NormFwdParams& p, int64_t group, int64_t elem,
                                            int64_t col, const float (&f)[VEC], float mean,
                                            float rstd) {
  float w[VEC], b[VEC];
  if (p.weight) ToFloats<T, VEC>(LoadVec<T, VEC>(p.weight, group * p.weight_group_stride + col), w);
  if (p.bias) ToFloats<T, VEC>(LoadVec<T, VEC>(p.bias, group * p.bias_group_stride + col), b);
  Vec<T, VEC> out;
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    float y = (f[j] - mean) * rstd;
    if (p.weight) y *= p.weight_offset + w[j];
    if (p.bias) y += b[j];
    out.v[j] = FromFloat<T>(y);
  }
  StoreVec<T, VEC>(p.y, elem, out);
}

// ---- forward -------------------------------------------------------------------------------

template <typename T, int VEC, int VPT, bool kLayer>
__global__ void __launch_bounds__(kRegsMaxThreads) NormFwdRegs(const NormFwdParams p, int tpr) {
  __shared__ float scratch[kScratchFloats];
  const int64_t rows = p.groups * p.rows_per_group;
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool valid = row < rows;
  const int64_t D = p.dim;
  const int64_t base = row * D;

  // The row stays packed in its storage type (4 registers per 16-byte vector): holding
  // floats doubled the registers and spilled under the 64-register cap of 1024 threads.
  Vec<T, VEC> v[VPT];
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int64_t col = (int64_t(threadIdx.x) + int64_t(k) * tpr) * VEC;
#pragma unroll
    for (int j = 0; j < VEC; ++j) v[k].v[j] = FromFloat<T>(0.f);
    if (valid && col < D) {
      const Vec<T, VEC> xv = LoadVec<T, VEC>(p.x, base + col);
      if (p.residual) {
        const Vec<T, VEC> rv = LoadVec<T, VEC>(p.residual, base + col);
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[k].v[j] = FromFloat<T>(ToFloat(xv.v[j]) + ToFloat(rv.v[j]));
        StoreVec<T, VEC>(p.h, base + col, v[k]);
      } else {
        v[k] = xv;
      }
    }
  }

  float mean = 0.f;
  if constexpr (kLayer) {
    float s[1] = {0.f};
#pragma unroll
    for (int k = 0; k < VPT; ++k)
#pragma unroll
      for (int j = 0; j < VEC; ++j) s[0] += ToFloat(v[k].v[j]);
    RowSum(s, scratch, tpr);
    mean = s[0] / float(D);
  }
  // Centered second pass over registers: exact for layer norm even when |mean| >> std.
  float ss[1] = {0.f};
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int64_t col = (int64_t(threadIdx.x) + int64_t(k) * tpr) * VEC;
    if (col < D) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float c = ToFloat(v[k].v[j]) - mean;
        ss[0] += c * c;
      }
    }
  }
  RowSum(ss, scratch, tpr);
  const float rstd = rsqrtf(ss[0] / float(D) + p.eps);
  if (!valid) return;  // after the last barrier

  if (threadIdx.x == 0) {
    p.rstd[row] = rstd;
    if constexpr (kLayer) p.mean[row] = mean;
  }
  const int64_t group = row / p.rows_per_group;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int64_t col = (int64_t(threadIdx.x) + int64_t(k) * tpr) * VEC;
    if (col < D) {
      float f[VEC];
      ToFloats<T, VEC>(v[k], f);
      StoreOutput<T, VEC>(p, group, base + col, col, f, mean, rstd);
    }
  }
}

// One row per block of 1024 threads; the row is read up to three times (the later reads
// mostly hit L2). With a residual the later passes read h, which this thread wrote.
template <typename T, int VEC, bool kLayer>
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
    StoreOutput<T, VEC>(p, group, base + col, col, f, mean, rstd);
  }
}

// ---- backward ------------------------------------------------------------------------------
//
// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) + dh, with g = dy * (offset + w) and
// xhat = (xh - mean) * rstd (mean = 0 and no mean(g) term for RMSNorm).
// dweight = sum over rows of dy * xhat, dbias = sum of dy: each "slot" (a row position of
// a block) accumulates its rows' contributions in registers and writes one partial row;
// ReducePartials sums the slots in a fixed order.

template <typename T, int VEC>
__device__ __forceinline__ void WeightFloats(const NormBwdParams& p, int64_t group, int64_t col,
                                             float (&w)[VEC]) {
  if (p.weight) {
    ToFloats<T, VEC>(LoadVec<T, VEC>(p.weight, group * p.weight_group_stride + col), w);
#pragma unroll
    for (int j = 0; j < VEC; ++j) w[j] += p.weight_offset;
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) w[j] = 1.f;
  }
}

template <typename T, int VEC, int VPT, bool kLayer>
__global__ void __launch_bounds__(kRegsMaxThreads)
    NormBwdRegs(const NormBwdParams p, int tpr, int blocks_per_group, float* ws_dw, float* ws_db) {
  __shared__ float scratch[kScratchFloats];
  const int64_t group = blockIdx.x / blocks_per_group;
  const int64_t slots = int64_t(blocks_per_group) * blockDim.y;
  const int64_t slot = int64_t(blockIdx.x % blocks_per_group) * blockDim.y + threadIdx.y;
  const int64_t R = p.rows_per_group, D = p.dim;

  // Registers per thread at VPT=2, bf16: weights and dy/xh packed (3 x 8), dweight
  // accumulators 16, dbias 16 (layer norm only).
  constexpr int kDb = kLayer ? VPT : 1;
  Vec<T, VEC> wv[VPT];
  float dw[VPT][VEC], db[kDb][VEC];
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int64_t col = (int64_t(threadIdx.x) + int64_t(k) * tpr) * VEC;
#pragma unroll
    for (int j = 0; j < VEC; ++j) wv[k].v[j] = FromFloat<T>(0.f);
    if (p.weight && col < D) wv[k] = LoadVec<T, VEC>(p.weight, group * p.weight_group_stride + col);
#pragma unroll
    for (int j = 0; j < VEC; ++j) dw[k][j] = 0.f;
  }
#pragma unroll
  for (int k = 0; k < kDb; ++k)
#pragma unroll
    for (int j = 0; j < VEC; ++j) db[k][j] = 0.f;
  const float w_add = p.weight ? p.weight_offset : 1.f;  // no weight: a scale of 1

  const int64_t iters = CeilDiv(R, slots);  // the same for every thread of the block
  for (int64_t it = 0; it < iters; ++it) {
    const int64_t r = it * slots + slot;
    const bool valid = r < R;
    const int64_t row = group * R + r;
    const int64_t base = row * D;
    const float rstd = valid ? p.rstd[row] : 0.f;
    const float mean = (kLayer && valid) ? p.mean[row] : 0.f;

    Vec<T, VEC> dyv[VPT], xv[VPT];
    float sums[2] = {0.f, 0.f};
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int64_t col = (int64_t(threadIdx.x) + int64_t(k) * tpr) * VEC;
      if (valid && col < D) {
        dyv[k] = LoadVec<T, VEC>(p.dy, base + col);
        xv[k] = LoadVec<T, VEC>(p.xh, base + col);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float dy = ToFloat(dyv[k].v[j]);
          const float xhat = (ToFloat(xv[k].v[j]) - mean) * rstd;
          const float gi = dy * (ToFloat(wv[k].v[j]) + w_add);
          sums[0] += gi;
          sums[1] += gi * xhat;
          dw[k][j] += dy * xhat;
          if constexpr (kLayer) db[k][j] += dy;
        }
      }
    }
    RowSum(sums, scratch, tpr);
    if (!valid) continue;
    const float mean_g = kLayer ? sums[0] / float(D) : 0.f;
    const float mean_gx = sums[1] / float(D);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int64_t col = (int64_t(threadIdx.x) + int64_t(k) * tpr) * VEC;
      if (col >= D) continue;
      float dh[VEC];
      if (p.dh) ToFloats<T, VEC>(LoadVec<T, VEC>(p.dh, base + col), dh);
      Vec<T, VEC> out;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float xhat = (ToFloat(xv[k].v[j]) - mean) * rstd;
        const float gi = ToFloat(dyv[k].v[j]) * (ToFloat(wv[k].v[j]) + w_add);
        float dx = rstd * (gi - mean_g - xhat * mean_gx);
        if (p.dh) dx += dh[j];
        out.v[j] = FromFloat<T>(dx);
      }
      StoreVec<T, VEC>(p.dx, base + col, out);
    }
  }

  const int64_t partial = (group * slots + slot) * D;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int64_t col = (int64_t(threadIdx.x) + int64_t(k) * tpr) * VEC;
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

// Rows too wide for registers: one row at a time per block of 1024 threads, two passes,
// partial sums accumulated in the (zeroed) workspace row this block owns.
template <typename T, int VEC, bool kLayer>
__global__ void __launch_bounds__(1024)
    NormBwdLoop(const NormBwdParams p, int tpr, int blocks_per_group, float* ws_dw, float* ws_db) {
  __shared__ float scratch[kScratchFloats];
  const int64_t group = blockIdx.x / blocks_per_group;
  const int64_t slot = blockIdx.x % blocks_per_group;
  const int64_t slots = blocks_per_group;
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
      WeightFloats<T, VEC>(p, group, col, w);
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
      WeightFloats<T, VEC>(p, group, col, w);
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

#define JAXGPU_VPT_SWITCH(vpt, VPT, ...)                          \
  [&] {                                                           \
    switch (vpt) {                                                \
      case 1: { constexpr int VPT = 1; return __VA_ARGS__(); }    \
      case 2: { constexpr int VPT = 2; return __VA_ARGS__(); }    \
      case 4: { constexpr int VPT = 4; return __VA_ARGS__(); }    \
      default: { constexpr int VPT = 8; return __VA_ARGS__(); }   \
    }                                                             \
  }()

#define JAXGPU_VPT_SWITCH_UPTO2(vpt, VPT, ...)                    \
  [&] {                                                           \
    if (vpt == 1) { constexpr int VPT = 1; return __VA_ARGS__(); } \
    constexpr int VPT = 2;                                        \
    return __VA_ARGS__();                                         \
  }()

// Register path: backward up to 2 vectors per thread (8192 bf16, 4096 float32 per row),
// forward up to 8 (32768 bf16, 16384 float32), each at <= 512 threads.
constexpr int kBwdMaxVpt = 2;  // JAXGPU_VPT_SWITCH_UPTO2 instantiates 1 and 2
constexpr int kFwdMaxVpt = 8;

RowConfig BwdConfig(const NormBwdParams& p) {
  return ChooseRowConfig(p.dim, p.dtype, 2, kBwdMaxVpt, kRegsMaxThreads);
}

BwdKernel SelectBwdKernel(const NormBwdParams& p, const RowConfig& c) {
  return JAXGPU_DTYPE_SWITCH(p.dtype, T, [&]() -> BwdKernel {
    constexpr int kFull = 16 / sizeof(T);
    return JAXGPU_BOOL_SWITCH(p.kind == NormKind::kLayer, kLayer, [&]() -> BwdKernel {
      if (c.loop) {
        return c.vec == 1 ? NormBwdLoop<T, 1, kLayer> : NormBwdLoop<T, kFull, kLayer>;
      }
      return JAXGPU_VPT_SWITCH_UPTO2(c.vpt, VPT, [&]() -> BwdKernel {
        return c.vec == 1 ? NormBwdRegs<T, 1, VPT, kLayer> : NormBwdRegs<T, kFull, VPT, kLayer>;
      });
    });
  });
}

struct BwdGrid {
  RowConfig cfg;
  BwdKernel kernel;
  int blocks_per_group;
  int64_t slots;
};

// As many blocks as fit on the GPU at once (one wave), split among the groups: enough
// rows per slot that the partial rows stay a small fraction of the traffic.
BwdGrid PlanBwd(const NormBwdParams& p) {
  BwdGrid g{};
  g.cfg = BwdConfig(p);
  g.kernel = SelectBwdKernel(p, g.cfg);
  const int threads = g.cfg.tpr * g.cfg.rows_per_block;
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, g.kernel, threads, 0) != cudaSuccess ||
      per_sm < 1) {
    per_sm = 1;
  }
  const int64_t wave = int64_t(SmCount()) * per_sm;
  const int64_t want = std::max<int64_t>(1, CeilDiv(wave, p.groups));
  g.blocks_per_group = static_cast<int>(
      std::max<int64_t>(1, std::min(CeilDiv(p.rows_per_group, g.cfg.rows_per_block), want)));
  g.slots = int64_t(g.blocks_per_group) * g.cfg.rows_per_block;
  return g;
}

}  // namespace

cudaError_t LaunchNormFwd(const NormFwdParams& p, cudaStream_t stream) {
  const int64_t rows = p.groups * p.rows_per_group;
  if (rows == 0 || p.dim == 0) return cudaSuccess;
  const RowConfig c = ChooseRowConfig(p.dim, p.dtype, 4, kFwdMaxVpt, kRegsMaxThreads);
  JAXGPU_DTYPE_SWITCH(p.dtype, T, [&] {
    constexpr int kFull = 16 / sizeof(T);
    JAXGPU_BOOL_SWITCH(p.kind == NormKind::kLayer, kLayer, [&] {
      if (c.loop) {
        auto kernel = c.vec == 1 ? NormFwdLoop<T, 1, kLayer> : NormFwdLoop<T, kFull, kLayer>;
        kernel<<<rows, 1024, 0, stream>>>(p);
        return;
      }
      JAXGPU_VPT_SWITCH(c.vpt, VPT, [&] {
        auto kernel = c.vec == 1 ? NormFwdRegs<T, 1, VPT, kLayer> : NormFwdRegs<T, kFull, VPT, kLayer>;
        const dim3 block(c.tpr, c.rows_per_block);
        kernel<<<CeilDiv(rows, c.rows_per_block), block, 0, stream>>>(p, c.tpr);
      });
    });
  });
  return cudaGetLastError();
}

size_t NormBwdWorkspaceBytes(const NormBwdParams& p) {
  if (p.groups * p.rows_per_group == 0 || p.dim == 0) return 0;
  const BwdGrid g = PlanBwd(p);
  const int64_t one = p.groups * g.slots * p.dim;
  return sizeof(float) * size_t(one) * ((p.dweight ? 1 : 0) + (p.dbias ? 1 : 0));
}

cudaError_t LaunchNormBwd(const NormBwdParams& p, void* workspace, cudaStream_t stream) {
  const int64_t D = p.dim;
  if (p.groups == 0 || D == 0) return cudaSuccess;
  if (p.rows_per_group == 0) {  // no rows: the gradients of the parameters are zero
    if (p.dweight) cudaMemsetAsync(p.dweight, 0, sizeof(float) * p.groups * D, stream);
    if (p.dbias) cudaMemsetAsync(p.dbias, 0, sizeof(float) * p.groups * D, stream);
    return cudaGetLastError();
  }
  const BwdGrid g = PlanBwd(p);
  const int64_t one = p.groups * g.slots * D;
  float* ws = static_cast<float*>(workspace);
  float* ws_dw = p.dweight ? ws : nullptr;
  float* ws_db = p.dbias ? ws + (p.dweight ? one : 0) : nullptr;
  if (g.cfg.loop && ws) {
    const int64_t n = one * ((ws_dw ? 1 : 0) + (ws_db ? 1 : 0));
    cudaMemsetAsync(ws, 0, sizeof(float) * n, stream);
  }
  const dim3 block(g.cfg.tpr, g.cfg.rows_per_block);
  g.kernel<<<p.groups * g.blocks_per_group, block, 0, stream>>>(p, g.cfg.tpr, g.blocks_per_group,
                                                                ws_dw, ws_db);
  const dim3 rblock(32, 8);
  const int64_t rgrid = p.groups * CeilDiv(D, 32);
  if (ws_dw) ReducePartials<<<rgrid, rblock, 0, stream>>>(ws_dw, g.slots, D, p.dweight);
  if (ws_db) ReducePartials<<<rgrid, rblock, 0, stream>>>(ws_db, g.slots, D, p.dbias);
  return cudaGetLastError();
}

}  // namespace jaxgpu::cuda
