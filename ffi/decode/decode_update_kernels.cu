// The in-place update of a paged KV cache: each new token's K and V rows copied to their
// slot (see decode_params.h for the semantics).
#include <cstdint>

#include "common/cuda_utils.cuh"
#include "decode/decode_cuda.h"

namespace jaxgpu::cuda {
namespace {

constexpr int kThreads = 128;

// One block per new token: its K and V rows (K x H values each) copied to their slot in
// 16-byte vectors, or nothing when the position or its page entry is out of range.
__global__ void __launch_bounds__(kThreads)
    PagedKvUpdateKernel(const PagedKvUpdateParams p, int64_t token_bytes) {
  const int64_t token = blockIdx.x;  // (group x B + row) x Tn + t
  const int64_t r = token / p.new_len;
  const int64_t g = r / p.batch;
  const int64_t pos = p.positions[token];
  const int64_t cap = p.max_pages * p.page_size;
  if (pos < 0 || pos >= cap) return;
  const int64_t page = p.block_table[r * p.max_pages + pos / p.page_size];
  if (page < 0 || page >= p.num_pages) return;
  const int64_t slot = (g * p.num_pages + page) * p.page_size + pos % p.page_size;
  const int64_t vecs = token_bytes / 16;
  const uint4* k_src =
      reinterpret_cast<const uint4*>(static_cast<const char*>(p.k_new) + token * token_bytes);
  const uint4* v_src =
      reinterpret_cast<const uint4*>(static_cast<const char*>(p.v_new) + token * token_bytes);
  uint4* k_dst = reinterpret_cast<uint4*>(static_cast<char*>(p.k_pages) + slot * token_bytes);
  uint4* v_dst = reinterpret_cast<uint4*>(static_cast<char*>(p.v_pages) + slot * token_bytes);
  for (int64_t i = threadIdx.x; i < vecs; i += kThreads) {
    k_dst[i] = k_src[i];
    v_dst[i] = v_src[i];
  }
}

}  // namespace

cudaError_t LaunchPagedKvUpdate(const PagedKvUpdateParams& p, cudaStream_t stream) {
  const int64_t tokens = p.groups * p.batch * p.new_len;
  if (tokens == 0 || p.num_pages == 0 || p.max_pages == 0) return cudaSuccess;
  if (tokens > INT32_MAX) return cudaErrorInvalidConfiguration;
  // K x H is a multiple of 8 values (H is): a whole number of 16-byte vectors per token.
  const int64_t token_bytes = DTypeBytes(p.dtype, p.kv_heads * p.head_dim);
  if (token_bytes % 16 != 0) return cudaErrorInvalidValue;
  PagedKvUpdateKernel<<<unsigned(tokens), kThreads, 0, stream>>>(p, token_bytes);
  return cudaGetLastError();
}

}  // namespace jaxgpu::cuda
