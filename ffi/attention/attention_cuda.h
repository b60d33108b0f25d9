// CUDA launchers of the attention family (kernels in attention_kernels.cu; no XLA types).
#pragma once

#include <cuda_runtime_api.h>

#include "attention/attention_params.h"

namespace jaxgpu::cuda {

// bfloat16 / float16, head_dim a multiple of 8 and <= 256.
cudaError_t LaunchAttentionFwd(const AttentionParams& p, cudaStream_t stream);
cudaError_t LaunchAttentionBwd(const AttentionParams& p, cudaStream_t stream);

}  // namespace jaxgpu::cuda
