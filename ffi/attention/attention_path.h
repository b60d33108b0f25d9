// Which main loop of the CUDA attention kernels runs a call: the FFI attribute `path`
// (attention_handlers.h), an int32 on the wire. kAuto is the product's choice
// (ResolveAttentionPath, attention_cuda.h); forcing a main loop is for tests and A/B
// comparisons (jaxgpu/ops/attention.py, _force_path). No XLA or CUDA types.
#pragma once

#include <cstdint>

namespace jaxgpu {

// kAuto takes wgmma where it can run a call, else mma_sync. A bias or a mask
// (attention_params.h) runs on mma_sync only: kAuto falls back to it on Hopper too, and a
// forced kWgmma fails such a call with an error that says so. Sequence lengths run on both.
enum class AttentionPath : int32_t {
  kAuto = 0,
  kMmaSync = 1,  // sm80/: mma.sync m16n8k16, on any device the CUDA kernels run on
  kWgmma = 2,    // sm90/: wgmma, sm_90a code on a compute capability 9.0 device
};

// The path's name (as jaxgpu/ops/attention.py spells it), or nullptr for an int32 that
// names no path.
inline const char* AttentionPathName(AttentionPath path) {
  switch (path) {
    case AttentionPath::kAuto: return "auto";
    case AttentionPath::kMmaSync: return "mma_sync";
    case AttentionPath::kWgmma: return "wgmma";
  }
  return nullptr;
}

}  // namespace jaxgpu
