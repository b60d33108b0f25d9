// The mma.sync main loop (m16n8k16 with ldmatrix, sm_80+): kernels for every head dim the
// CUDA kernels take, on every device they run on (one older than compute capability 8.0
// has no kernel image for them: the launch says so). No XLA types.
#pragma once

#include <cuda_runtime_api.h>

#include "attention/attention_main_loop.h"
#include "attention/attention_params.h"

namespace jaxgpu::cuda::attention::sm80 {

cudaError_t LaunchFwd(const AttentionParams& p, cudaStream_t stream);  // fwd_sm80.cu
cudaError_t LaunchDq(const AttentionParams& p, cudaStream_t stream);   // bwd_sm80.cu
cudaError_t LaunchDkv(const AttentionParams& p, cudaStream_t stream);  // bwd_sm80.cu

inline const char* Unavailable(const AttentionParams&) { return nullptr; }

inline constexpr MainLoop kMainLoop{Unavailable, LaunchFwd, LaunchDq, LaunchDkv};

}  // namespace jaxgpu::cuda::attention::sm80
