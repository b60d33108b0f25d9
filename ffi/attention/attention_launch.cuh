// Host-side pieces every attention launcher shares, whichever its main loop: what the
// kernels accept, the dtype and head-dim switches, the mask decisions taken at launch, and
// the flattened grid (the shared-memory opt-in is common/cuda_utils.cuh's AllowSmem).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "attention/attention_logits.cuh"
#include "attention/attention_mask.cuh"
#include "attention/attention_params.h"
#include "common/cuda_utils.cuh"

#define JAXGPU_RETURN_IF_CUDA_ERROR(expr) \
  do {                                    \
    cudaError_t _err = (expr);            \
    if (_err != cudaSuccess) return _err; \
  } while (0)

// The tensor-core kernels take 16-bit inputs only (float32 runs the XLA path; see
// jaxgpu/ops/attention.py).
#define JAXGPU_ATTENTION_DTYPE_SWITCH(dtype, T, ...) \
  JAXGPU_DTYPE_SWITCH(dtype, T, ::jaxgpu::kHalfDTypes, __VA_ARGS__)

namespace jaxgpu::cuda::attention {

// The head dims the kernels are compiled for; H <= kHeadDim runs in the smallest that fits
// with zero-filled feature columns (H is a multiple of 8: the Python layer pads odd ones).
// 160..224 run in the 256 kernels: each extra head dim costs ~1 min of CI compile time.
inline int PaddedHeadDim(int64_t h) {
  if (h <= 32) return 32;
  if (h <= 64) return 64;
  if (h <= 96) return 96;
  if (h <= 128) return 128;
  return 256;
}

#define JAXGPU_HEAD_DIM_SWITCH(h, D, ...)                                                   \
  JAXGPU_INT_SWITCH(::jaxgpu::cuda::attention::PaddedHeadDim(h), D, (32, 64, 96, 128, 256), \
                    __VA_ARGS__)

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

// A bias, a mask or sequence lengths: the kernels compiled with kExtra run the call.
inline bool HasExtras(const AttentionParams& p) {
  return p.bias != nullptr || p.mask != nullptr || p.q_lengths != nullptr;
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
// ids mask nothing (H100: docs/perf/attention.md section 6.4); two
// launches, each CTA returning at once where the other kernel owned its row, cost as much
// again in empty CTAs.
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

// The current device's opt-in limit of dynamic shared memory per block (0 if unknown).
inline int64_t SmemOptInLimit() {
  int device = 0, bytes = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
          cudaSuccess) {
    return 0;
  }
  return bytes;
}

// Launches a kernel taking (p, LogitScale) with Tr's threads and shared memory (or
// smem_bytes: the kExtra kernels' staged bias and mask blocks) over a FlatGrid of (head,
// tile).
template <typename Tr, typename Kernel>
cudaError_t LaunchOverTiles(Kernel kernel, int64_t heads, int64_t tiles, const AttentionParams& p,
                            cudaStream_t stream, int64_t smem_bytes = Tr::kSmemBytes) {
  JAXGPU_RETURN_IF_CUDA_ERROR(AllowSmem(kernel, smem_bytes));
  dim3 grid;
  JAXGPU_RETURN_IF_CUDA_ERROR(FlatGrid(heads, tiles, &grid));
  kernel<<<grid, Tr::kThreads, smem_bytes, stream>>>(p,
                                                     MakeLogitScale(p.scale, p.softcap, p.dtype));
  return cudaGetLastError();
}

// The forward and dQ kernels: (query head, query tile of Tr::kBlockM) (DecodeQueryTile).
template <typename Tr, typename Kernel>
cudaError_t LaunchOverQueryTiles(Kernel kernel, const AttentionParams& p, cudaStream_t stream,
                                 int64_t smem_bytes = Tr::kSmemBytes) {
  return LaunchOverTiles<Tr>(kernel, p.batch * p.kv_heads * p.group, CeilDiv(p.q_len, Tr::kBlockM),
                             p, stream, smem_bytes);
}

// The dK/dV kernels: (kv head, key tile of Tr::kBlockN x Tr::kSlices feature slices).
template <typename Tr, typename Kernel>
cudaError_t LaunchOverKeyTiles(Kernel kernel, const AttentionParams& p, cudaStream_t stream,
                               int64_t smem_bytes = Tr::kSmemBytes) {
  return LaunchOverTiles<Tr>(kernel, p.batch * p.kv_heads,
                             CeilDiv(p.kv_len, Tr::kBlockN) * Tr::kSlices, p, stream, smem_bytes);
}

}  // namespace jaxgpu::cuda::attention
