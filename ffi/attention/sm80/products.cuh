// The mma.sync main loop's warp-level products (sm_80+): a warp's score tiles Q K^T from
// shared memory, and P B accumulations with P from registers, each B fragment loaded once
// for all of the warp's row tiles. No XLA types.
#pragma once

#include <cstdint>

#include "attention/attention_fragments.cuh"
#include "attention/sm80/mma.cuh"

namespace jaxgpu::cuda::attention::sm80 {

// Scores of a warp's kMT x 16 rows of A (rows a_row0.. of tile A, consecutive) against the
// kN rows of tile B, both (rows, kDim) in smem: acc[m-tile][n-tile][4] += A B^T over
// feature columns [0, dim). Each B fragment is loaded once and feeds all kMT row tiles:
// ldmatrix bandwidth (128 B/clk/SM) is what bounds an mma.sync loop.
//
// Zero feature columns past `dim` are skipped only in 64-column groups, and only for the
// 256 tiles (H 136..248): a branch per 16-column step splits the loop into blocks the
// compiler cannot schedule across, exposing each step's ldmatrix latency to its MMAs.
template <int kDim>
__device__ __forceinline__ bool FeatureStepLive(int kk, int dim) {
  return kDim <= 128 || (kk & 3) != 0 || kk * 16 < dim;
}

template <typename T, int kDim, int kN, int kMT>
__device__ __forceinline__ void ScoresFromSmem(float (&acc)[kMT][kN / 8][4], const T* a_tile,
                                               int a_row0, const T* b_tile, int dim, int lane) {
#pragma unroll
  for (int kk = 0; kk < kDim / 16; ++kk) {
    if (FeatureStepLive<kDim>(kk, dim)) {
      uint32_t a[kMT][4];
#pragma unroll
      for (int mi = 0; mi < kMT; ++mi) LoadA<kDim>(a[mi], a_tile, a_row0 + 16 * mi, kk * 16, lane);
#pragma unroll
      for (int nn = 0; nn < kN / 16; ++nn) {
        uint32_t b[4];
        LoadBNk<kDim>(b, b_tile, nn * 16, kk * 16, lane);
#pragma unroll
        for (int mi = 0; mi < kMT; ++mi) {
          MmaType<T>::Mma(acc[mi][2 * nn], a[mi], b[0], b[1]);
          MmaType<T>::Mma(acc[mi][2 * nn + 1], a[mi], b[2], b[3]);
        }
      }
    }
  }
}

// acc += P B over the kK rows of a smem tile B, for output columns [col0, col0 + kAcc):
// P is packed A fragments (PackProbs); B is (kK, kTileDim) with n contiguous (V, dO, Q or
// K). Columns past `dim` are zeros, skipped as in ScoresFromSmem. Each B fragment feeds all
// kMT row tiles.
template <typename T, int kK, int kAcc, int kTileDim, int kMT>
__device__ __forceinline__ void AccumulatePacked(float (&acc)[kMT][kAcc / 8][4],
                                                 const uint32_t (&a)[kK / 16][kMT][4],
                                                 const T* b_tile, int col0, int dim, int lane) {
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
#pragma unroll
    for (int nn = 0; nn < kAcc / 16; ++nn) {
      if (FeatureStepLive<kTileDim>(nn, dim - col0)) {
        uint32_t b[4];
        LoadBKn<kTileDim>(b, b_tile, kk * 16, col0 + nn * 16, lane);
#pragma unroll
        for (int mi = 0; mi < kMT; ++mi) {
          MmaType<T>::Mma(acc[mi][2 * nn], a[kk][mi], b[0], b[1]);
          MmaType<T>::Mma(acc[mi][2 * nn + 1], a[kk][mi], b[2], b[3]);
        }
      }
    }
  }
}

// The same with P as float C tiles, packed here.
template <typename T, int kK, int kAcc, int kTileDim, int kMT>
__device__ __forceinline__ void AccumulateFromRegs(float (&acc)[kMT][kAcc / 8][4],
                                                   const float (&p)[kMT][kK / 8][4],
                                                   const T* b_tile, int col0, int dim, int lane) {
  uint32_t a[kK / 16][kMT][4];
  PackProbs<T, kK, kMT>(a, p);
  AccumulatePacked<T, kK, kAcc, kTileDim, kMT>(acc, a, b_tile, col0, dim, lane);
}

}  // namespace jaxgpu::cuda::attention::sm80
