// CUDA launchers of the cross-entropy family (kernels in cross_entropy_kernels.cu; no XLA
// types).
#pragma once

#include <cuda_runtime_api.h>

#include "cross_entropy/cross_entropy_params.h"

namespace jaxgpu::cuda {

cudaError_t LaunchCrossEntropyFwd(const CrossEntropyFwdParams& p, cudaStream_t stream);
cudaError_t LaunchCrossEntropyBwd(const CrossEntropyBwdParams& p, cudaStream_t stream);

}  // namespace jaxgpu::cuda
