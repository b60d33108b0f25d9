// CUDA launchers of the normalization family (kernels in norm_kernels.cu; no XLA types).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "norm/norm_params.h"

namespace jaxgpu::cuda {

cudaError_t LaunchNormFwd(const NormFwdParams& p, cudaStream_t stream);

// The backward pass writes per-block float32 partial sums of dweight/dbias to a scratch
// buffer and reduces them in a fixed order (deterministic). Its size depends on the grid,
// so the handler asks first, allocates, then launches with the same params.
size_t NormBwdWorkspaceBytes(const NormBwdParams& p);
cudaError_t LaunchNormBwd(const NormBwdParams& p, void* workspace, cudaStream_t stream);

}  // namespace jaxgpu::cuda
