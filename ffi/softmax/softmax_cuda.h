// CUDA launchers of the softmax family (kernels in softmax_kernels.cu; no XLA types).
#pragma once

#include <cuda_runtime_api.h>

#include "softmax/softmax_params.h"

namespace jaxgpu::cuda {

cudaError_t LaunchSoftmaxFwd(const SoftmaxFwdParams& p, cudaStream_t stream);
cudaError_t LaunchSoftmaxBwd(const SoftmaxBwdParams& p, cudaStream_t stream);

}  // namespace jaxgpu::cuda
