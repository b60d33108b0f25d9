// CUDA launcher of the activation family (kernels in activation_kernels.cu; no XLA types).
#pragma once

#include <cuda_runtime_api.h>

#include "activation/activation_params.h"

namespace jaxgpu::cuda {

cudaError_t LaunchActivation(const ActParams& p, cudaStream_t stream);

}  // namespace jaxgpu::cuda
