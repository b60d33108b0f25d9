// CUDA launcher of the RoPE family (kernels in rope_kernels.cu; no XLA types).
#pragma once

#include <cuda_runtime_api.h>

#include "rope/rope_params.h"

namespace jaxgpu::cuda {

// One kernel for both passes (p.inverse selects the backward rotation).
cudaError_t LaunchRope(const RopeParams& p, cudaStream_t stream);

}  // namespace jaxgpu::cuda
