// CUDA launchers of the attention family (kernels in attention_fwd.cu, attention_fwd_sm90.cu and
// attention_bwd.cu; no XLA types).
#pragma once

#include <cuda_runtime_api.h>

#include "attention/attention_params.h"

namespace jaxgpu::cuda {

// bfloat16 / float16, head_dim a multiple of 8 and <= 256.
cudaError_t LaunchAttentionFwd(const AttentionParams& p, cudaStream_t stream);
cudaError_t LaunchAttentionBwd(const AttentionParams& p, cudaStream_t stream);

// The Hopper (wgmma) kernels: whether they run these parameters (an sm_90 device, a build
// with sm_90a code, JAXGPU_ATTENTION_MMA_SYNC unset, and the head dim padded to 64, 128 or
// 256), and the forward (attention_fwd_sm90.cu), dQ (attention_bwd_sm90.cu) and dK/dV
// (attention_dkv_sm90.cu) launchers, for parameters that passed that check and the
// kernels' CheckLaunchable and hold at least one query row (forward, dQ) or key (dK/dV).
// LaunchAttentionFwd / LaunchAttentionBwd pick them by themselves.
bool AttentionSm90Applies(const AttentionParams& p);
cudaError_t LaunchAttentionFwdSm90(const AttentionParams& p, cudaStream_t stream);
cudaError_t LaunchAttentionDqSm90(const AttentionParams& p, cudaStream_t stream);
cudaError_t LaunchAttentionDkvSm90(const AttentionParams& p, cudaStream_t stream);

}  // namespace jaxgpu::cuda
