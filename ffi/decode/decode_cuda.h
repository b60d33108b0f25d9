// CUDA launchers of the decode family (kernels in decode_kernels.cu; no XLA types).
#pragma once

#include <cuda_runtime_api.h>

#include "decode/decode_params.h"

namespace jaxgpu::cuda {

// The split kernel, then (num_splits > 1) the combine kernel, on `stream`.
cudaError_t LaunchPagedAttention(const PagedAttentionParams& p, cudaStream_t stream);
// Scatters the new tokens into p.k_pages / p.v_pages, which must already hold the caches.
cudaError_t LaunchPagedKvUpdate(const PagedKvUpdateParams& p, cudaStream_t stream);

}  // namespace jaxgpu::cuda
