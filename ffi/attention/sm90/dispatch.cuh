// The compile-time switches of the wgmma kernels (host side): the element type, the traits
// of the padded head dim, and the kernel switches each launcher instantiates. No XLA types.
#pragma once

#include <cuda_runtime.h>

#include "attention/attention_launch.cuh"
#include "attention/attention_params.h"

namespace jaxgpu::cuda::attention::sm90 {

// One configuration of a wgmma kernel: element type, traits, and the kernel switches.
template <typename T_, typename Tr, bool kMaskable_, bool kSoftcap_, bool kRowSplit_ = false,
          bool kLengths_ = false>
struct Config {
  using T = T_;
  using Traits = Tr;
  static constexpr bool kMaskable = kMaskable_;
  static constexpr bool kSoftcap = kSoftcap_;
  static constexpr bool kRowSplit = kRowSplit_;  // kMaskable too (SplitsBySegmentRows)
  static constexpr bool kLengths = kLengths_;    // kMaskable too: sequence lengths
};

// The wgmma kernels' compile-time switches: launch(Config<...>{}) with the element
// type, Traits<64>, Traits<128> or Traits<256> by the padded head dim, and the kernel
// switches (the mask decided on Tr's key tile; kRowSplits: the backward kernels, which
// split by segment rows where SplitsBySegmentRows).
template <template <int> class Traits, bool kRowSplits = false, typename Launch>
cudaError_t Dispatch(const AttentionParams& p, Launch&& launch) {
  return JAXGPU_ATTENTION_DTYPE_SWITCH(p.dtype, T, [&] {
    auto run = [&](auto traits) {
      using Tr = decltype(traits);
      return JAXGPU_BOOL_SWITCH(p.softcap > 0.f, kSoftcap, [&]() -> cudaError_t {
        // Sequence lengths (the wgmma main loop takes no bias or mask: Unavailable).
        if (p.q_lengths != nullptr) return launch(Config<T, Tr, true, kSoftcap, false, true>{});
        // Not at H = 256: there the kernel with both bodies spills (dQ: 340 bytes).
        if constexpr (kRowSplits && Tr::kHeadDim <= 128) {
          if (SplitsBySegmentRows(p, Tr::kBlockN)) {
            return launch(Config<T, Tr, true, kSoftcap, true>{});
          }
        }
        return JAXGPU_BOOL_SWITCH(NeedsMask(p, Tr::kBlockN), kMaskable,
                                  [&] { return launch(Config<T, Tr, kMaskable, kSoftcap>{}); });
      });
    };
    // The wgmma main loop's unavailable() admits only these; anything else is an error.
    const int padded = PaddedHeadDim(p.head_dim);
    if (padded == 64) return run(Traits<64>{});
    if (padded == 128) return run(Traits<128>{});
    if (padded == 256) return run(Traits<256>{});
    return cudaErrorInvalidValue;
  });
}

}  // namespace jaxgpu::cuda::attention::sm90
