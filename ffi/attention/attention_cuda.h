// The host API of the CUDA attention kernels (no XLA types): which main loop runs a call,
// and the launchers of the two passes (attention_dispatch.cu).
#pragma once

#include <cuda_runtime_api.h>

#include "attention/attention_params.h"
#include "attention/attention_path.h"

namespace jaxgpu::cuda {

// The main loop a call runs on. kAuto: wgmma wherever it runs (a build with sm_90a code, a
// compute capability 9.0 device, the head dim padded to 64, 128 or 256), unless a
// developer-knob build sets JAXGPU_ATTENTION_MMA_SYNC; mma.sync otherwise. A forced path runs as
// asked or not at all. Returns nullptr and sets *resolved (never kAuto), or why `requested`
// cannot run `p` here (a static message).
const char* ResolveAttentionPath(const AttentionParams& p, AttentionPath requested,
                                 AttentionPath* resolved);

// bfloat16 / float16, head_dim a multiple of 8 and <= 256, on a path ResolveAttentionPath
// returned.
cudaError_t LaunchAttentionFwd(const AttentionParams& p, AttentionPath path, cudaStream_t stream);
cudaError_t LaunchAttentionBwd(const AttentionParams& p, AttentionPath path, cudaStream_t stream);

}  // namespace jaxgpu::cuda
