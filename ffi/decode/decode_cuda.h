// CUDA launchers of the decode family (kernels in decode_kernels.cu; no XLA types).
#pragma once

#include <cuda_runtime_api.h>

#include "decode/decode_params.h"

namespace jaxgpu::cuda {

// The split kernel, then (num_splits > 1) the combine kernel, on `stream`.
cudaError_t LaunchPagedAttention(const PagedAttentionParams& p, cudaStream_t stream);
// paged_attention_with_update: the update's writes, then the attention over the updated
// caches (att reads upd's result buffers). Over a 16-bit cache the tensor-core split kernel
// writes the new tokens itself (one launch less a call: a decode layer's cache write took
// ~2.5 us of its own); a float32 query runs the update kernel first.
cudaError_t LaunchPagedAttentionWithUpdate(PagedAttentionParams att, const PagedKvUpdateParams& upd,
                                           cudaStream_t stream);
// Scatters the new tokens into p.k_pages / p.v_pages, which must already hold the caches.
cudaError_t LaunchPagedKvUpdate(const PagedKvUpdateParams& p, cudaStream_t stream);

}  // namespace jaxgpu::cuda
