// The register tiles every attention main loop shares: a warp's accumulators and 16-bit A
// fragments in mma.sync m16n8k16's layouts, which Hopper's wgmma m64nNk16 gives each warp
// of a warpgroup too (sm90/wgmma.cuh). So the softmax, the masking and the epilogues are one
// piece of code for every main loop. No XLA types.
//
// Fragment layouts (PTX ISA, "mma.m16n8k16"), with g = lane / 4 and t = lane % 4:
//   A (16 x 16, row-major)  4 regs: (g, 2t..2t+1) (g+8, 2t..) (g, 2t+8..) (g+8, 2t+8..)
//   C (16 x 8, float32)     4 floats: (g, 2t) (g, 2t+1) (g+8, 2t) (g+8, 2t+1)
// A C tile pair (n-tiles 2k, 2k+1) converted to 16-bit is exactly the A fragment of k-step
// k: the softmax probabilities feed the next product from registers (FlashAttention-2).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace jaxgpu::cuda::attention {

// Two floats rounded to T (__nv_bfloat16 or __half), packed in one register as an A
// fragment or a stored pair of columns holds them: `lo` in the low half.
template <typename T>
__device__ __forceinline__ uint32_t PackPair(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t PackPair<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

template <>
__device__ __forceinline__ uint32_t PackPair<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

template <typename E, int A, int B, int C>
__device__ __forceinline__ void Zero(E (&x)[A][B][C]) {
#pragma unroll
  for (int i = 0; i < A; ++i) {
#pragma unroll
    for (int j = 0; j < B; ++j) {
#pragma unroll
      for (int k = 0; k < C; ++k) x[i][j][k] = E(0);
    }
  }
}

// P (kMT x 16 x kK per warp, C tiles in registers) as 16-bit A fragments: k-step kk, row
// tile mi. Converting right after the softmax halves the registers P holds during P V
// (the forward's 255-register loop spilled otherwise).
template <typename T, int kK, int kMT>
__device__ __forceinline__ void PackProbs(uint32_t (&a)[kK / 16][kMT][4],
                                          const float (&p)[kMT][kK / 8][4]) {
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
#pragma unroll
    for (int mi = 0; mi < kMT; ++mi) {
      a[kk][mi][0] = PackPair<T>(p[mi][2 * kk][0], p[mi][2 * kk][1]);
      a[kk][mi][1] = PackPair<T>(p[mi][2 * kk][2], p[mi][2 * kk][3]);
      a[kk][mi][2] = PackPair<T>(p[mi][2 * kk + 1][0], p[mi][2 * kk + 1][1]);
      a[kk][mi][3] = PackPair<T>(p[mi][2 * kk + 1][2], p[mi][2 * kk + 1][3]);
    }
  }
}

// Stores a warp's 16 x kAcc accumulator (times `mul`) as 16-bit rows [row0, row0 + 16) of a
// global matrix with row stride ld, columns [col0, ...); rows at or past valid_rows and
// columns at or past dim are skipped.
template <typename T, int kAcc>
__device__ __forceinline__ void StoreAccumulator(T* out, int64_t ld,
                                                 const float (&acc)[kAcc / 8][4], float mul,
                                                 int row0, int valid_rows, int col0, int dim,
                                                 int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + g + 8 * h;
    if (row < valid_rows) {
#pragma unroll
      for (int j = 0; j < kAcc / 8; ++j) {
        const int col = col0 + 8 * j + 2 * t;
        if (col < dim) {
          *reinterpret_cast<uint32_t*>(out + row * ld + col) =
              PackPair<T>(acc[j][2 * h] * mul, acc[j][2 * h + 1] * mul);
        }
      }
    }
  }
}

}  // namespace jaxgpu::cuda::attention
