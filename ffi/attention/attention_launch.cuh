// Host-side pieces every attention launcher shares: what the kernels accept, the dtype
// switch and the flattened grid (the shared-memory opt-in is common/cuda_utils.cuh's
// AllowSmem).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "attention/attention_mask.cuh"
#include "attention/attention_params.h"
#include "attention/attention_tile.cuh"
#include "common/cuda_utils.cuh"

#define JAXGPU_RETURN_IF_CUDA_ERROR(expr)      \
  do {                                         \
    cudaError_t _err = (expr);                 \
    if (_err != cudaSuccess) return _err;      \
  } while (0)

// The tensor-core kernels take 16-bit inputs only (float32 runs the XLA path; see
// jaxgpu/ops/attention.py).
#define JAXGPU_ATTENTION_DTYPE_SWITCH(dtype, T, ...)                              \
  [&] {                                                                           \
    if ((dtype) == ::jaxgpu::DType::kBF16) { using T = __nv_bfloat16; return __VA_ARGS__(); } \
    using T = __half;                                                             \
    return __VA_ARGS__();                                                         \
  }()

namespace jaxgpu::cuda::attention {

// The handler has validated shapes; these are the limits of the CUDA kernels themselves.
inline cudaError_t CheckLaunchable(const AttentionParams& p) {
  if (p.dtype != DType::kBF16 && p.dtype != DType::kF16) return cudaErrorInvalidValue;
  if (p.head_dim % 8 != 0 || p.head_dim > 256 || p.head_dim < 8) return cudaErrorInvalidValue;
  if (!(p.scale > 0.f)) return cudaErrorInvalidValue;  // folded into exp2 (LogitScale)
  return cudaSuccess;
}

// Whether any tile can hold an element masked by position (causal, window, the last key
// tile's keys past S).
inline bool NeedsPositionMask(const AttentionParams& p, int block_n) {
  const Mask m = MakeMask(p, 0);
  return m.causal || m.left >= 0 || m.right >= 0 || p.kv_len % block_n != 0;
}

// Whether any tile can hold a masked element: otherwise the kernels compile the mask out.
inline bool NeedsMask(const AttentionParams& p, int block_n) {
  return NeedsPositionMask(p, block_n) || p.q_segment_ids != nullptr;
}

// Segment ids with nothing masked by position, and the per-row uniformity flags given (the
// backward): a batch row whose q and kv ids are all one segment masks nothing at all. The
// backward kernels are then compiled with both bodies (kRowSplit), and each CTA runs the
// one without the mask where its row is uniform (RowMasksNothing), the maskable one
// otherwise. The maskable body costs the backward 7% over the unmasked one even where the
// ids mask nothing (H100, TUNING.md stop 20); two launches, each CTA returning at once
// where the other kernel owned its row, cost as much again in empty CTAs.
inline bool SplitsBySegmentRows(const AttentionParams& p, int block_n) {
  return p.segment_uniform != nullptr && !NeedsPositionMask(p, block_n);
}

__device__ __forceinline__ bool RowMasksNothing(const AttentionParams& p, int64_t b) {
  return __ldg(p.segment_uniform + b) != 0;
}

// A one-dimensional grid of heads x tiles blocks; the kernels decode their (head, tile) in
// DecodeGroupedTile's order (groups of heads, longest tiles first, for L2 reuse and a short
// tail).
inline cudaError_t FlatGrid(int64_t heads, int64_t tiles, dim3* grid) {
  const int64_t n = heads * tiles;
  if (n > INT32_MAX) return cudaErrorInvalidConfiguration;
  *grid = dim3(static_cast<unsigned>(n));
  return cudaSuccess;
}

// Launches a kernel taking (p, LogitScale) with Tr's threads and shared memory over a
// FlatGrid of (head, tile).
template <typename Tr, typename Kernel>
cudaError_t LaunchOverTiles(Kernel kernel, int64_t heads, int64_t tiles,
                            const AttentionParams& p, cudaStream_t stream) {
  JAXGPU_RETURN_IF_CUDA_ERROR(AllowSmem(kernel, Tr::kSmemBytes));
  dim3 grid;
  JAXGPU_RETURN_IF_CUDA_ERROR(FlatGrid(heads, tiles, &grid));
  kernel<<<grid, Tr::kThreads, Tr::kSmemBytes, stream>>>(
      p, MakeLogitScale(p.scale, p.softcap, p.dtype));
  return cudaGetLastError();
}

// The forward and dQ kernels: (query head, query tile of Tr::kBlockM) (DecodeQueryTile).
template <typename Tr, typename Kernel>
cudaError_t LaunchOverQueryTiles(Kernel kernel, const AttentionParams& p, cudaStream_t stream) {
  return LaunchOverTiles<Tr>(kernel, p.batch * p.kv_heads * p.group,
                             CeilDiv(p.q_len, Tr::kBlockM), p, stream);
}

// The dK/dV kernels: (kv head, key tile of Tr::kBlockN x Tr::kSlices feature slices).
template <typename Tr, typename Kernel>
cudaError_t LaunchOverKeyTiles(Kernel kernel, const AttentionParams& p, cudaStream_t stream) {
  return LaunchOverTiles<Tr>(kernel, p.batch * p.kv_heads,
                             CeilDiv(p.kv_len, Tr::kBlockN) * Tr::kSlices, p, stream);
}

// One configuration of a Hopper kernel: element type, traits, and the kernel switches.
template <typename T_, typename Tr, bool kMaskable_, bool kSoftcap_, bool kRowSplit_ = false>
struct Sm90Config {
  using T = T_;
  using Traits = Tr;
  static constexpr bool kMaskable = kMaskable_;
  static constexpr bool kSoftcap = kSoftcap_;
  static constexpr bool kRowSplit = kRowSplit_;  // kMaskable too (SplitsBySegmentRows)
};

// The Hopper kernels' compile-time switches: launch(Sm90Config<...>{}) with the element
// type, Traits<64>, Traits<128> or Traits<256> by the padded head dim, and the kernel
// switches (the mask decided on Tr's key tile; kRowSplits: the backward kernels, which
// split by segment rows where SplitsBySegmentRows).
template <template <int> class Traits, bool kRowSplits = false, typename Launch>
cudaError_t DispatchSm90(const AttentionParams& p, Launch&& launch) {
  return JAXGPU_ATTENTION_DTYPE_SWITCH(p.dtype, T, [&] {
    auto run = [&](auto traits) {
      using Tr = decltype(traits);
      return JAXGPU_BOOL_SWITCH(p.softcap > 0.f, kSoftcap, [&]() -> cudaError_t {
        // Not at H = 256: there the kernel with both bodies spills (dQ: 340 bytes).
        if constexpr (kRowSplits && Tr::kHeadDim <= 128) {
          if (SplitsBySegmentRows(p, Tr::kBlockN)) {
            return launch(Sm90Config<T, Tr, true, kSoftcap, true>{});
          }
        }
        return JAXGPU_BOOL_SWITCH(NeedsMask(p, Tr::kBlockN), kMaskable, [&] {
          return launch(Sm90Config<T, Tr, kMaskable, kSoftcap>{});
        });
      });
    };
    const int padded = PaddedHeadDim(p.head_dim);
    if (padded == 256) return run(Traits<256>{});
    return padded == 64 ? run(Traits<64>{}) : run(Traits<128>{});
  });
}

}  // namespace jaxgpu::cuda::attention
