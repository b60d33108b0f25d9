// The warp-specialized forward (fwd_ws_sm90.cu): TMA copies from a copy warpgroup, the
// wgmma math in two. No XLA types.
#pragma once

#include <cuda_runtime_api.h>

#include "attention/attention_params.h"

namespace jaxgpu::cuda::attention::sm90 {

// Why the kernel cannot run a call (nullptr: it can).
const char* WarpSpecializedFwdUnavailable(const AttentionParams& p);

// cudaErrorNotSupported where it cannot (the caller runs the wgmma forward instead).
// ping_pong: the math warpgroups take turns on the tensor cores; persistent: one CTA an SM
// walks the tiles (fwd_ws_sm90.cu).
cudaError_t LaunchFwdWarpSpecialized(const AttentionParams& p, cudaStream_t stream,
                                     bool ping_pong, bool persistent);

}  // namespace jaxgpu::cuda::attention::sm90
