// The one dispatcher of the CUDA attention kernels: which main loop runs a call, decided
// once per call from the path the caller asked for (attention_path.h), and the launches of
// each pass in order. A main loop is a folder (sm80/, sm90/) with its MainLoop
// (attention_main_loop.h); another one is its folder, an AttentionPath value and one case
// in MainLoopOf.
#include <cuda_runtime.h>

#include "attention/attention_cuda.h"
#include "attention/attention_launch.cuh"
#include "attention/attention_main_loop.h"
#include "attention/sm80/main_loop.h"
#include "attention/sm90/main_loop.h"
#include "common/dev_knobs.h"

namespace jaxgpu::cuda {
namespace attention {
namespace {

// The main loop of a path other than kAuto (nullptr for kAuto and for values that name no
// path).
const MainLoop* MainLoopOf(AttentionPath path) {
  switch (path) {
    case AttentionPath::kMmaSync: return &sm80::kMainLoop;
    case AttentionPath::kWgmma: return &sm90::kMainLoop;
    case AttentionPath::kAuto: break;
  }
  return nullptr;
}

// Developer knob (common/dev_knobs.h, a JAXGPU_DEV_KNOBS build): JAXGPU_ATTENTION_MMA_SYNC=1
// makes kAuto take mma.sync everywhere (A/B comparisons of one build); read once per process.
// Tests force a path per call instead (the `path` attribute).
bool MmaSyncByDevKnob() {
  static const bool forced = ReadDevKnob("JAXGPU_ATTENTION_MMA_SYNC").ints[0] != 0;
  return forced;
}

}  // namespace
}  // namespace attention

const char* ResolveAttentionPath(const AttentionParams& p, AttentionPath requested,
                                 AttentionPath* resolved) {
  using namespace attention;
  if (requested == AttentionPath::kAuto) {
    const bool wgmma = !MmaSyncByDevKnob() && sm90::kMainLoop.unavailable(p) == nullptr;
    *resolved = wgmma ? AttentionPath::kWgmma : AttentionPath::kMmaSync;
    return nullptr;
  }
  const MainLoop* loop = MainLoopOf(requested);
  if (loop == nullptr) return "no such main loop";
  if (const char* why = loop->unavailable(p)) return why;
  *resolved = requested;
  return nullptr;
}

cudaError_t LaunchAttentionFwd(const AttentionParams& p, AttentionPath path, cudaStream_t stream) {
  using namespace attention;
  JAXGPU_RETURN_IF_CUDA_ERROR(CheckLaunchable(p));
  const MainLoop* loop = MainLoopOf(path);
  if (loop == nullptr) return cudaErrorInvalidValue;  // not resolved
  if (p.batch * p.kv_heads * p.group * p.q_len == 0) return cudaSuccess;
  return loop->fwd(p, stream);
}

// Deterministic: every gradient element is summed in a fixed order (but dbias where the bias
// broadcasts: float32 atomics, attention_extras.cuh). delta first, then the main loop's
// fused backward where it takes the call (Hopper: dQ added into a float32 accumulator in
// key-tile order, sm90/bwd_ws_sm90.h), else dQ per (query tile, query head) and dK/dV per
// (key tile, kv head), each recomputing the probabilities from the forward's lse.
cudaError_t LaunchAttentionBwd(const AttentionParams& p, AttentionPath path, cudaStream_t stream) {
  using namespace attention;
  JAXGPU_RETURN_IF_CUDA_ERROR(CheckLaunchable(p));
  const MainLoop* loop = MainLoopOf(path);
  if (loop == nullptr) return cudaErrorInvalidValue;  // not resolved
  if (p.dbias != nullptr) {
    // The dQ kernel skips fully masked tiles, whose gradient is 0, and adds into the
    // broadcast elements: both need zeros first.
    JAXGPU_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(
        p.dbias, 0, static_cast<size_t>(BroadcastCount(p, p.bias_stride)) * sizeof(float), stream));
  }
  if (p.batch * p.q_len * p.kv_heads * p.group > 0) {
    JAXGPU_RETURN_IF_CUDA_ERROR(LaunchDelta(p, stream));
    if (loop->fused_bwd != nullptr && p.kv_len > 0) {
      const cudaError_t e = loop->fused_bwd(p, stream);
      if (e != cudaErrorNotSupported) return e;
    }
    JAXGPU_RETURN_IF_CUDA_ERROR(loop->dq(p, stream));
  }
  // With no query (T = 0) too: dK and dV are zeros then.
  if (p.batch * p.kv_len * p.kv_heads > 0) return loop->dkv(p, stream);
  return cudaSuccess;
}

}  // namespace jaxgpu::cuda
