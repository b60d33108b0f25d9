// CUDA launchers of the normalization family (kernels in norm_kernels.cu; no XLA types).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "norm/norm_params.h"

namespace jaxgpu::cuda {

cudaError_t LaunchNormFwd(const NormFwdParams& p, cudaStream_t stream);

// The backward pass writes per-slot float32 partial sums of dweight/dbias to
// p.workspace and reduces them in a fixed order (deterministic).
cudaError_t LaunchNormBwd(const NormBwdParams& p, cudaStream_t stream);

}  // namespace jaxgpu::cuda
