// The warp-specialized forward (fwd_ws_sm90.cu): TMA copies from a copy warpgroup, the
// wgmma math in two. No XLA types.
#pragma once

#include <cuda_runtime_api.h>

#include "attention/attention_params.h"

namespace jaxgpu::cuda::attention::sm90 {

// Why the kernel cannot run a call (nullptr: it can).
const char* WarpSpecializedFwdUnavailable(const AttentionParams& p);

// How the CTAs walk the tiles: ping_pong, the math warpgroups take turns on the tensor
// cores; persistent, one CTA an SM walks the tiles (fwd_ws_sm90.cu).
struct WsFwdSchedule {
  bool ping_pong = false;
  bool persistent = false;
};

// The schedule measured fastest for `p` (fwd_ws_sm90.cu's header): persistent where no tile
// masks, no ping-pong.
WsFwdSchedule DefaultWsFwdSchedule(const AttentionParams& p);

// cudaErrorNotSupported where it cannot run `p` (the caller runs fwd_sm90's kernel instead),
// or where a product build (no JAXGPU_DEV_KNOBS) was asked for another schedule than the
// default.
cudaError_t LaunchFwdWarpSpecialized(const AttentionParams& p, const WsFwdSchedule& schedule,
                                     cudaStream_t stream);

}  // namespace jaxgpu::cuda::attention::sm90
