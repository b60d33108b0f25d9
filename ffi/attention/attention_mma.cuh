// Warp-level tensor-core building blocks of the attention kernels (sm_80+): mma.sync
// m16n8k16 with float32 accumulation, ldmatrix fragment loads, and the padded shared-memory
// tiles they read. No XLA types.
//
// Fragment layouts (PTX ISA, "mma.m16n8k16"), with g = lane / 4 and t = lane % 4:
//   A (16 x 16, row-major)  4 regs: (g, 2t..2t+1) (g+8, 2t..) (g, 2t+8..) (g+8, 2t+8..)
//   B (16 x 8, "col")       2 regs: (k 2t..2t+1, n g) (k 2t+8.., n g)
//   C (16 x 8, float32)     4 floats: (g, 2t) (g, 2t+1) (g+8, 2t) (g+8, 2t+1)
// A C tile pair (n-tiles 2k, 2k+1) converted to 16-bit is exactly the A fragment of k-step
// k: the softmax probabilities feed the next product from registers (FlashAttention-2).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/cuda_utils.cuh"

namespace jaxgpu::cuda::attention {

// Shared-memory tiles are (rows, kDim) 16-bit elements with rows padded by one 16-byte
// chunk: a row stride of an odd number of chunks puts the 8 rows an ldmatrix reads at
// the same column in 8 different bank groups, for every head dim (a XOR swizzle would
// need the chunk count to be a multiple of 8; 96 has 12).
template <int kDim>
struct SmemTile {
  static constexpr int kStride = kDim + 8;  // elements
  static constexpr int kChunks = kDim / 8;  // 16-byte chunks per row
};

template <typename T>
struct MmaType;

template <>
struct MmaType<__nv_bfloat16> {
  __device__ __forceinline__ static uint32_t Pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  __device__ __forceinline__ static void Mma(float (&c)[4], const uint32_t (&a)[4],
                                             uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <>
struct MmaType<__half> {
  __device__ __forceinline__ static uint32_t Pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  __device__ __forceinline__ static void Mma(float (&c)[4], const uint32_t (&a)[4],
                                             uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

__device__ __forceinline__ uint32_t SmemAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

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
__device__ __forceinline__ void LoadBNk(uint32_t (&b)[4], const T* tile, int n0, int k0,
                                        int lane) {
  const int row = n0 + (lane & 7) + ((lane >> 4) << 3);
  const int col = k0 + (((lane >> 3) & 1) << 3);
  Ldmatrix4(b, SmemAddress(tile + row * SmemTile<kDim>::kStride + col));
}

// B fragments of two n-tiles when the tile is stored (k, n) row-major (n contiguous: V for
// P V): k rows [k0, k0 + 16) x columns [n0, n0 + 16). Same register order as LoadBNk.
template <int kDim, typename T>
__device__ __forceinline__ void LoadBKn(uint32_t (&b)[4], const T* tile, int k0, int n0,
                                        int lane) {
  const int row = k0 + (lane & 7) + (((lane >> 3) & 1) << 3);
  const int col = n0 + ((lane >> 4) << 3);
  Ldmatrix4Trans(b, SmemAddress(tile + row * SmemTile<kDim>::kStride + col));
}

// The copy loop of every tile load: rows [0, kRows) of a global (rows, dim) matrix (row
// stride `ld` elements), 16-byte chunk `chunk` of row `row` to the shared-memory address
// smem_address(row, chunk), one cp.async each. Rows at or past `valid_rows`, and chunks at
// or past `dim` (dim a multiple of 8), are zero-filled: tails cost no branches in the math,
// and zeros contribute nothing to a product.
template <int kRows, int kChunks, int kThreads, typename T, typename SmemAddressOf>
__device__ __forceinline__ void CopyRowsAsync(const T* gmem, int64_t ld, int valid_rows, int dim,
                                              SmemAddressOf smem_address) {
  constexpr int kTotal = kRows * kChunks;
  static_assert(kTotal % kThreads == 0, "every thread copies the same number of chunks");
  const int dim_chunks = dim >> 3;
#pragma unroll
  for (int it = 0; it < kTotal / kThreads; ++it) {
    const int i = it * kThreads + threadIdx.x;
    const int row = i / kChunks;
    const int chunk = i - row * kChunks;
    const unsigned addr = smem_address(row, chunk);
    const bool ok = row < valid_rows && chunk < dim_chunks;
    const T* src = ok ? gmem + row * ld + chunk * 8 : gmem;
    const int bytes = ok ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(src),
                 "r"(bytes)
                 : "memory");
  }
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

// Copies src[first + i] for i in [0, n) (4-byte words: segment ids, per-query statistics)
// into shared memory, one cp.async per thread below n; it joins the caller's group.
// Positions at or past len repeat the last one: callers mask them by position, and a
// repeated segment id cannot widen a tile's segment range.
template <typename Word>
__device__ __forceinline__ void LoadRowWordsAsync(Word* dst, const Word* src, int first, int len,
                                                  int n) {
  static_assert(sizeof(Word) == 4, "4-byte words");
  const int i = threadIdx.x;
  if (i < n) {
    const Word* from = src + min(first + i, len - 1);
    const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(dst + i));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(addr), "l"(from) : "memory");
  }
}

// exp2 on the MUFU (ex2.approx.ftz: 2 ulp), the rate-limited unit of the softmax.
__device__ __forceinline__ float FastExp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// tanh of one value, tanh.approx.f32 (sm_75+): a MUFU op per logit, but none of the pair's
// three conversions (to f16x2 and back), and 2^-10.99 relative precision.
__device__ __forceinline__ float TanhF32(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// tanh of two values with one MUFU op: tanh.approx.f16x2 (sm_75+). The softmax's ex2 per
// logit already runs on the MUFU (16 ops/clk/SM); a softcap's tanh.approx.f32 per logit
// doubled that unit's load, the packed form adds half (H100, H = 128, T = 4096, softcap +
// segment ids: backward 190 -> 200 TFLOP/s, forward unchanged at ~275). Precision: the
// inputs round to fp16 (2^-12 relative) and the result is fp16 (2^-12 relative, plus the
// approximation's ~2^-11): about 2^-10 relative on the capped logit, below a bf16 logit's
// own rounding (2^-9) and close to tanh.approx.f32's 2^-10.99.
__device__ __forceinline__ void TanhPair(float& a, float& b) {
  const __half2 in = __floats2half2_rn(a, b);
  uint32_t out;
  asm("tanh.approx.f16x2 %0, %1;\n" : "=r"(out) : "r"(*reinterpret_cast<const uint32_t*>(&in)));
  const float2 r = __half22float2(*reinterpret_cast<const __half2*>(&out));
  a = r.x;
  b = r.y;
}

}  // namespace jaxgpu::cuda::attention
