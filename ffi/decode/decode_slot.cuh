// Where a token at absolute position `pos` of one batch row lives in the paged pool: the
// one rule the cache writers share (the update kernels, and the split kernel that appends a
// step's new tokens in paged_attention_with_update). No XLA types.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace jaxgpu::cuda::decode {

// The token's slot (in tokens, counted from the pool's start), or -1 when the position is
// outside the row's table or its page entry is outside the pool: traced positions, lengths
// and table entries are never trusted, and a skipped token is written nowhere. `pool_base`
// is the first page of the row's group of pools (g * num_pages, a vmapped call's pools lie
// one after another). int64 positions, so that a traced length near INT32_MIN cannot wrap
// into range.
__device__ __forceinline__ int64_t PoolSlot(int64_t pos, const int32_t* table_row,
                                            int64_t max_pages, int64_t page_size, int64_t num_pages,
                                            int64_t pool_base) {
  if (pos < 0 || pos >= max_pages * page_size) return -1;
  const uint32_t column = uint32_t(pos) / uint32_t(page_size);
  const int32_t page = table_row[column];
  if (page < 0 || page >= num_pages) return -1;
  return (pool_base + page) * page_size + (uint32_t(pos) - column * uint32_t(page_size));
}

}  // namespace jaxgpu::cuda::decode
