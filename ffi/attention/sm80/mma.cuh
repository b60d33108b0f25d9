// The mma.sync main loop's instructions and shared-memory tiles (sm_80+): m16n8k16 MMAs with
// float32 accumulation, ldmatrix fragment loads, and the padded tiles they read. No XLA
// types.
//
// Operand fragments (PTX ISA, "mma.m16n8k16"; the A and C layouts, which every main loop
// shares, are in attention_fragments.cuh), with g = lane / 4 and t = lane % 4:
//   B (16 x 8, "col")       2 regs: (k 2t..2t+1, n g) (k 2t+8.., n g)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "attention/attention_copy.cuh"

namespace jaxgpu::cuda::attention::sm80 {

// Shared-memory tiles are (rows, kDim) 16-bit elements with rows padded by one 16-byte
// chunk: a row stride of an odd number of chunks puts the 8 rows an ldmatrix reads at
// the same column in 8 different bank groups, for every head dim (a XOR swizzle would
// need the chunk count to be a multiple of 8; 96 has 12).
template <int kDim>
struct SmemTile {
  static constexpr int kStride = kDim + 8;  // elements
  static constexpr int kChunks = kDim / 8;  // 16-byte chunks per row
};

// D += A B for one m16n8k16 tile: A as 4 registers of 16-bit pairs, B as 2, D float32.
template <typename T>
struct MmaType;

template <>
struct MmaType<__nv_bfloat16> {
  __device__ __forceinline__ static void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <>
struct MmaType<__half> {
  __device__ __forceinline__ static void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

__device__ __forceinline__ void Ldmatrix4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void Ldmatrix4Trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// A fragment of rows [row0, row0 + 16) x columns [col0, col0 + 16) of a row-major tile.
template <int kDim, typename T>
__device__ __forceinline__ void LoadA(uint32_t (&a)[4], const T* tile, int row0, int col0,
                                      int lane) {
  const int row = row0 + (lane & 15);
  const int col = col0 + ((lane >> 4) << 3);
  Ldmatrix4(a, SmemAddress(tile + row * SmemTile<kDim>::kStride + col));
}

// B fragments of two n-tiles when the tile is stored (n, k) row-major (k contiguous: K for
// Q K^T): rows [n0, n0 + 16) x k columns [k0, k0 + 16). b[0], b[1]: n-tile n0; b[2], b[3]:
// n-tile n0 + 8.
template <int kDim, typename T>
__device__ __forceinline__ void LoadBNk(uint32_t (&b)[4], const T* tile, int n0, int k0, int lane) {
  const int row = n0 + (lane & 7) + ((lane >> 4) << 3);
  const int col = k0 + (((lane >> 3) & 1) << 3);
  Ldmatrix4(b, SmemAddress(tile + row * SmemTile<kDim>::kStride + col));
}

// B fragments of two n-tiles when the tile is stored (k, n) row-major (n contiguous: V for
// P V): k rows [k0, k0 + 16) x columns [n0, n0 + 16). Same register order as LoadBNk.
template <int kDim, typename T>
__device__ __forceinline__ void LoadBKn(uint32_t (&b)[4], const T* tile, int k0, int n0, int lane) {
  const int row = k0 + (lane & 7) + (((lane >> 3) & 1) << 3);
  const int col = n0 + ((lane >> 4) << 3);
  Ldmatrix4Trans(b, SmemAddress(tile + row * SmemTile<kDim>::kStride + col));
}

// Asynchronous copy of a global (rows, dim) matrix into a padded smem tile of kRows x kDim
// (CopyRowsAsync's tails).
template <int kRows, int kDim, int kThreads, typename T>
__device__ __forceinline__ void LoadTileAsync(T* tile, const T* gmem, int64_t ld, int valid_rows,
                                              int dim) {
  CopyRowsAsync<kRows, SmemTile<kDim>::kChunks, kThreads>(
      gmem, ld, valid_rows, dim, [&](int row, int chunk) {
        return SmemAddress(tile + row * SmemTile<kDim>::kStride + chunk * 8);
      });
}

// Double-buffered pairs of (kRows, kDim) smem tiles laid out [buffer][pair member]: K and V
// (forward, dQ) or Q and dO (dK/dV). Tile `which` (0 or 1) of buffer `buf`:
template <int kRows, int kDim, typename T>
__device__ __forceinline__ T* PairTile(T* base, int buf, int which) {
  return base + (2 * buf + which) * kRows * SmemTile<kDim>::kStride;
}

// Copies rows [row0, row0 + kRows) of two global matrices a and b (same row stride ld,
// `valid` rows in all) into buffer `buf` of a pair (see LoadTileAsync for the tails).
template <int kRows, int kDim, int kThreads, typename T>
__device__ __forceinline__ void LoadPairAsync(T* base, int buf, const T* a, const T* b, int64_t ld,
                                              int row0, int valid, int dim) {
  LoadTileAsync<kRows, kDim, kThreads>(PairTile<kRows, kDim>(base, buf, 0), a + row0 * ld, ld,
                                       valid - row0, dim);
  LoadTileAsync<kRows, kDim, kThreads>(PairTile<kRows, kDim>(base, buf, 1), b + row0 * ld, ld,
                                       valid - row0, dim);
}

}  // namespace jaxgpu::cuda::attention::sm80
