// Global -> shared memory staging of the attention kernels, shared by every main loop:
// cp.async copies of tile rows (each main loop gives the shared-memory layout: padded
// tiles for ldmatrix in sm80/, swizzled ones for wgmma in sm90/) and of 4-byte words per
// row (segment ids, the backward's per-query statistics). No XLA types.
#pragma once

#include <cstdint>

namespace jaxgpu::cuda::attention {

__device__ __forceinline__ uint32_t SmemAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
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
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(src), "r"(bytes)
                 : "memory");
  }
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

}  // namespace jaxgpu::cuda::attention
