// Fragment helpers of the tensor-core split kernel of paged attention (decode_tc_kernels.cu):
// where a tile's bytes sit in shared memory and which key or head dim each mma fragment
// element holds. The 8-bit cache's cp.async ring permutes keys and head dims and swizzles
// 16-byte chunks within a key row so that a thread's fragment bytes are contiguous and
// conflict-free; the copy engine's tiles (kTma) carry its 128-byte swizzle. No XLA types.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "attention/sm80/mma.cuh"

namespace jaxgpu::cuda::decode {

constexpr int kKeys = 64;  // keys per tile: 16 per key group (warp)

// The 8-bit tiles' swizzles: the 16-byte chunk a row's chunk `chunk` is stored at, so that
// the fragment reads below hit distinct banks (kS: the head dims of a warp's slice, whose
// chunks the swizzle keeps within the slice). K: a quarter-warp's lanes read rows
// ColumnKey8's 2j + {0, 1} at chunk c (kS/64) + part of the slice for quads c = 0..3 (one
// chunk a lane, 128-bit loads); V: rows 4c + i at chunk (kS/128) g + part for g in a lane
// pair (kS 64: 8 bytes of chunk g/2, a half-warp a wavefront: 2 ways remain).
template <int kS>
__device__ __forceinline__ int SwizzleK(int row, int chunk) {
  if constexpr (kS == 64) return chunk;
  if constexpr (kS == 128) return chunk ^ (row & 1);
  return chunk ^ ((row & 1) | (((chunk >> 3) & 1) << 1));
}

template <int kS>
__device__ __forceinline__ int SwizzleV(int row, int chunk) {
  const int c = (row >> 2) & 3;
  if constexpr (kS == 64) return chunk ^ c;
  if constexpr (kS == 128) return chunk ^ (2 * c);
  return chunk ^ ((c & 1) | ((c & 2) << 1));
}

// The query tile's column of head dim `hd` over an 8-bit cache, within its slice of kS head
// dims: mma k step kk, index 2c + e (e < 2) holds the slice's head dim c kS/4 + 4 kk + e and
// 2c + 8 + e holds c kS/4 + 4 kk + 2 + e, so that a thread's K fragments are the contiguous
// bytes [c kS/4, (c + 1) kS/4) of the slice of a key.
template <int kS>
__device__ __forceinline__ int QColumn8(int hd) {
  const int base = hd / kS * kS, local = hd % kS;
  const int c = local / (kS / 4), rest = local % (kS / 4);
  const int kk = rest / 4, j = rest % 4;
  return base + 16 * kk + 8 * (j >> 1) + 2 * c + (j & 1);
}

// The warp-local key (0..15) of S column `col` (0..7) of n-tile j over an 8-bit cache: keys
// 4c .. 4c + 3 are then P V's k indices 2c, 2c + 1, 2c + 8, 2c + 9, the ones thread quad c
// multiplies, so that its V fragment bytes come from 4 consecutive keys.
__device__ __forceinline__ int ColumnKey8(int j, int col) {
  return 4 * (col >> 1) + 2 * j + (col & 1);
}

// The head dim (within the warp's slice of kS) of output column `col` (0..7) of P V's n-tile
// nt over an 8-bit cache: lane group g supplies [g kS/8, (g + 1) kS/8), nt = 4 x (word of
// those) + byte.
template <int kS>
__device__ __forceinline__ int OutputColumn8(int nt, int col) {
  return (kS / 8) * col + nt;
}

// Two consecutive 8-bit values of a word (bytes 2i, 2i + 1) as a half2, exactly (int8 and
// e4m3 values all are halfs): e4m3 pairs by one cvt; int8 (flipped by ^ 0x80 beforehand, so
// that byte b reads b + 128) by the magic-number trick, the byte placed under half's 0x64
// exponent byte being 1024 + b + 128, then one subtraction of 1152.
template <typename KV>
__device__ __forceinline__ uint32_t WidenPair(uint32_t word, int i) {
  if constexpr (std::is_same_v<KV, int8_t>) {
    const uint32_t magic = __byte_perm(word, 0x64u, i == 0 ? 0x4140 : 0x4342);
    const __half2 v = __hsub2(*reinterpret_cast<const __half2*>(&magic),
                              __halves2half2(__ushort_as_half(0x6480), __ushort_as_half(0x6480)));
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2_raw h =
        __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(word >> (16 * i)), __NV_E4M3);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}

// What WidenPair expects of a raw word: int8 bytes flipped to b + 128.
template <typename KV>
__device__ __forceinline__ uint32_t Prepare8(uint32_t word) {
  if constexpr (std::is_same_v<KV, int8_t>) return word ^ 0x80808080u;
  return word;
}

// Byte offset (SwizzledOffset) and shared-memory address (SwizzledChunk) of 16-byte chunk
// `chunk` (bytes 16 chunk .. of the key's row) of key row `row` in a kTma tile: column block
// chunk / 8 (128 bytes: 64 head dims of a 16-bit cache, 128 of an 8-bit one), 128 bytes a
// row, the chunk's index XOR the row's index mod 8 (the copy engine's 128-byte swizzle).
__device__ __forceinline__ int SwizzledOffset(int row, int chunk) {
  return (chunk >> 3) * (kKeys * 128) + row * 128 + (((chunk & 7) ^ (row & 7)) << 4);
}
__device__ __forceinline__ uint32_t SwizzledChunk(uint32_t tile, int row, int chunk) {
  return tile + SwizzledOffset(row, chunk);
}

// sm80::LoadBNk / LoadBKn over a kTma tile: the same lanes' rows and chunks, swizzled.
__device__ __forceinline__ void LoadBNkSwizzled(uint32_t (&b)[4], uint32_t tile, int n0, int k0,
                                                int lane) {
  const int row = n0 + (lane & 7) + ((lane >> 4) << 3);
  const int chunk = (k0 >> 3) + ((lane >> 3) & 1);
  ::jaxgpu::cuda::attention::sm80::Ldmatrix4(b, SwizzledChunk(tile, row, chunk));
}
__device__ __forceinline__ void LoadBKnSwizzled(uint32_t (&b)[4], uint32_t tile, int k0, int n0,
                                                int lane) {
  const int row = k0 + (lane & 7) + (((lane >> 3) & 1) << 3);
  const int chunk = (n0 >> 3) + (lane >> 4);
  ::jaxgpu::cuda::attention::sm80::Ldmatrix4Trans(b, SwizzledChunk(tile, row, chunk));
}

}  // namespace jaxgpu::cuda::decode
