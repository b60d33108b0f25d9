// Pieces shared by the two split kernels of paged attention (decode_kernels.cu: CUDA cores,
// float32; decode_tc_kernels.cu: tensor cores, 16-bit): the merge of a block's partial
// softmax states and the write of its result, either the output (one split) or a partial
// output and its log2-sum-exp for the combine kernel. No XLA types.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/cuda_utils.cuh"
#include "decode/decode_params.h"

namespace jaxgpu::cuda::decode {

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kMaxCombineSplits = 1024;  // the handler's bound on num_splits

// Merges `streams` partial softmax states of `tile_rows` query rows (running max m and sum
// l in the log2 domain, unnormalized output o[stream][row][h] at o + (stream * tile_rows +
// row) * o_stride + h, all in shared memory) and writes rows [row0, row0 + tile_rows) of
// (row r, kv head kvh, split) of rows_per_kv. Called by every thread of the block, after a
// __syncthreads that follows the states' writes.
//
// Only the tile's real rows are walked (a Gemma 3 1b tile holds 4 query rows of 16), and a
// thread steps its (row, h) pair by additions: a small call is issue-bound, and this loop
// with a division a step and the padding rows was ~40% of the instructions of a one-tile
// block (Nsight Compute, 4/1 H 256, 64 keys).
template <typename T>
__device__ __forceinline__ void WriteMergedRows(const PagedAttentionParams& p, int64_t rk,
                                                int split, int64_t rows_per_kv, int64_t row0,
                                                int tile_rows, int streams, const float* s_m,
                                                const float* s_l, const float* s_o, int o_stride,
                                                int64_t n_partials) {
  const int hd = int(p.head_dim);
  const int64_t N = p.heads;
  const int64_t r = rk / p.kv_heads, kvh = rk % p.kv_heads;
  const int64_t rep = N / p.kv_heads;
  const int64_t left = rows_per_kv - row0;
  const int rows = left < tile_rows ? int(left) : tile_rows;
  T* out = static_cast<T*>(p.out);
  const int64_t part = rk * p.num_splits + split;
  float* lse = p.workspace + n_partials * rows_per_kv * hd;
  const int row_step = int(blockDim.x) / hd, h_step = int(blockDim.x) % hd;
  int i = int(threadIdx.x) / hd, h = int(threadIdx.x) % hd;
  for (; i < rows; i += row_step, h += h_step) {
    if (h >= hd) h -= hd, ++i;
    if (i >= rows) break;
    float top = -INFINITY;
    for (int st = 0; st < streams; ++st) top = fmaxf(top, s_m[st * tile_rows + i]);
    float sum = 0.f, acc = 0.f;
    if (top != -INFINITY) {
      for (int st = 0; st < streams; ++st) {
        const float w = exp2f(s_m[st * tile_rows + i] - top);
        sum = fmaf(w, s_l[st * tile_rows + i], sum);
        acc = fmaf(w, s_o[(st * tile_rows + i) * o_stride + h], acc);
      }
    }
    const float value = sum > 0.f ? acc / sum : 0.f;
    const int64_t rr = row0 + i;
    if (p.num_splits == 1) {
      const int64_t t = rr / rep, n = kvh * rep + rr % rep;
      out[((r * p.q_len + t) * N + n) * hd + h] = FromFloat<T>(value);
    } else {
      p.workspace[(part * rows_per_kv + rr) * hd + h] = value;
      if (h == 0) lse[part * rows_per_kv + rr] = sum > 0.f ? top + __log2f(sum) : -INFINITY;
    }
  }
}

// The tensor-core split kernel (decode_tc_kernels.cu) for a 16-bit query over a 16-bit or
// 8-bit cache, launched alone: it may lower p->num_splits (to fill whole waves of the GPU),
// and the caller then runs the combine with the lowered count when it is above 1.
bool TensorCoreKernelTakes(const PagedAttentionParams& p);
cudaError_t LaunchTensorCoreSplit(PagedAttentionParams* p, int64_t rows_per_kv,
                                  cudaStream_t stream);

}  // namespace jaxgpu::cuda::decode
