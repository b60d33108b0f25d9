// The warp-specialized forward (fwd_ws_sm90.cu): TMA copies from a copy warpgroup, the
// wgmma math in two. No XLA types.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "attention/attention_params.h"

namespace jaxgpu::cuda::attention::sm90 {

// Why the kernel cannot run a call (nullptr: it can).
const char* WarpSpecializedFwdUnavailable(const AttentionParams& p);

// How the CTAs walk the tiles: ping_pong, the math warpgroups take turns on the tensor
// cores; persistent, one CTA an SM walks the tiles (fwd_ws_sm90.cu), in a fixed stride, or
// with dynamic, each CTA taking its next tile from a counter in the caller's workspace (the
// tiles longest first, in groups of group_heads heads; 0: DynamicGroupHeads's choice).
// dynamic implies the persistent grid. A product build compiles the default schedule only.
struct WsFwdSchedule {
  bool ping_pong = false;
  bool persistent = false;
  bool dynamic = false;
  int group_heads = 0;  // dynamic only: heads a group of the tile order (0: the rule)
  // Persistent grids: at most this many CTAs (0: one an SM). A test knob: the checker's small
  // cases give each CTA several tiles with it.
  int max_ctas = 0;
};

// The schedule measured fastest for `p` (fwd_ws_sm90.cu's header): the persistent stride
// where no tile masks, the dynamic grid where tiles do; no ping-pong.
WsFwdSchedule DefaultWsFwdSchedule(const AttentionParams& p);

// Bytes of device memory the dynamic schedule's tile counter takes (one int32). It must
// hold 0 when the kernel starts (cudaMemsetAsync on the stream, graph-capturable); the
// kernel leaves it 0 again (the CTA that draws the last value resets it), so a buffer
// owned across calls on one stream needs zeroing once, an XLA workspace (undefined content)
// every call.
inline constexpr size_t kWsFwdWorkspaceBytes = 4;

// The dynamic schedule's heads a group for `p` (group_heads 0), fwd_ws_sm90.cu says why.
int DynamicGroupHeads(const AttentionParams& p);

// cudaErrorNotSupported where it cannot run `p` (the caller runs fwd_sm90's kernel instead),
// where a product build (no JAXGPU_DEV_KNOBS) was asked for another schedule than the
// default, or for the dynamic one without a workspace. `workspace`: kWsFwdWorkspaceBytes,
// 4-byte aligned, the dynamic schedule's tile counter (the other schedules ignore it).
cudaError_t LaunchFwdWarpSpecialized(const AttentionParams& p, const WsFwdSchedule& schedule,
                                     cudaStream_t stream, void* workspace = nullptr);

}  // namespace jaxgpu::cuda::attention::sm90
