// Pieces shared by the two split kernels of paged attention (decode_kernels.cu: CUDA cores,
// float32; decode_tc_kernels.cu: tensor cores, 16-bit): the merge of a block's partial
// softmax states and the write of its result, either the output (one split) or a partial
// output and its log2-sum-exp, and the combine of the splits' partials by the last block
// of each (row, kv head, row tile) to finish. No XLA types.
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
template <typename T>
__device__ __forceinline__ void WriteMergedRows(const PagedAttentionParams& p, int64_t rk,
                                                int split, int64_t rows_per_kv, int64_t row0,
                                                int tile_rows, int streams, const float* s_m,
                                                const float* s_l, const float* s_o, int o_stride,
                                                int64_t n_partials) {
  const int64_t H = p.head_dim, N = p.heads;
  const int64_t r = rk / p.kv_heads, kvh = rk % p.kv_heads;
  const int64_t rep = N / p.kv_heads;
  T* out = static_cast<T*>(p.out);
  for (int idx = threadIdx.x; idx < tile_rows * H; idx += blockDim.x) {
    const int i = idx / int(H);
    const int h = idx - i * int(H);
    const int64_t rr = row0 + i;
    if (rr >= rows_per_kv) continue;
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
    if (p.num_splits == 1) {
      const int64_t t = rr / rep, n = kvh * rep + rr % rep;
      out[((r * p.q_len + t) * N + n) * H + h] = FromFloat<T>(value);
    } else {
      const int64_t part = rk * p.num_splits + split;
      p.workspace[(part * rows_per_kv + rr) * H + h] = value;
      if (h == 0) {
        float* lse = p.workspace + n_partials * rows_per_kv * H;
        lse[part * rows_per_kv + rr] = sum > 0.f ? top + __log2f(sum) : -INFINITY;
      }
    }
  }
}

// The counters of the split blocks (uint32, one per (group, row, kv head, row tile) of the
// launch), right after the partials and log2-sum-exps of p.num_splits splits in the
// workspace. A launch runs at most the workspace's split count minus one, whose room (H + 1
// floats per query row) holds them (PagedAttentionWorkspaceSize).
__host__ __device__ inline uint32_t* SplitCounters(const PagedAttentionParams& p,
                                                   int64_t rows_per_kv) {
  const int64_t partials = p.groups * p.batch * p.kv_heads * p.num_splits;
  return reinterpret_cast<uint32_t*>(p.workspace + partials * rows_per_kv * (p.head_dim + 1));
}

// Zeroes the counters of a launch with `row_tiles` row tiles, before its split kernel, on
// every call: XLA's workspace is uninitialized (its bytes may be another buffer's between
// calls), so a count left at 0 by the previous call cannot be relied on.
inline cudaError_t ZeroSplitCounters(const PagedAttentionParams& p, int64_t rows_per_kv,
                                     int64_t row_tiles, cudaStream_t stream) {
  if (p.num_splits <= 1) return cudaSuccess;
  const int64_t count = p.groups * p.batch * p.kv_heads * row_tiles;
  return cudaMemsetAsync(SplitCounters(p, rows_per_kv), 0, size_t(count) * sizeof(uint32_t),
                         stream);
}

// blockIdx.{x, y, z} read again after a kernel's main loop: the compiler cannot reuse the
// block coordinates it derived at the start (an asm volatile read), so they are not kept in
// registers across the loop. ptxas on the tensor-core kernel with the combine below
// (sm_90a): bf16 H 128 146 registers with the coordinates read again, 152 with them kept
// (147 before the combine); the 8-bit kernels held at 128 by their launch bounds spill
// nothing, against 8-20 bytes with them kept.
__device__ __forceinline__ uint3 BlockIndexAgain() {
  uint3 b;
  asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(b.x));
  asm volatile("mov.u32 %0, %%ctaid.y;\n" : "=r"(b.y));
  asm volatile("mov.u32 %0, %%ctaid.z;\n" : "=r"(b.z));
  return b;
}

// The combine of the splits, fused into the split kernel (no second launch: at B 1 the
// launches' fixed costs dominate). Called by every thread of each split block after
// WriteMergedRows wrote its partial: the block counts itself in on `counter` (its (row,
// kv head, row tile)'s), and the one that arrives last merges every split's rows
// [row0, row0 + kRows) into the output. Whichever block that is, the arithmetic and its
// order are fixed, so the result is bitwise reproducible: weights w_s = exp2(lse_s - max
// lse) / sum of the w_s (summed in split order 0..S-1), output = sum of w_s x partial_s as
// one fma chain in split order. `stats` (2 kRows floats) and `weights` (num_splits x kRows
// floats) are shared memory free once WriteMergedRows' reads are done (the first barrier
// here waits for them).
template <typename T, int kRows>
__device__ __forceinline__ void CombineIfLast(const PagedAttentionParams& p, int64_t rk,
                                              int64_t rows_per_kv, int64_t row0, uint32_t* counter,
                                              float* stats, float* weights) {
  const int splits = p.num_splits;
  if (splits == 1) return;
  // Publishing the partials: every thread's stores, a barrier, then one thread's fence and
  // count (CUTLASS's split-k semaphore); the fence after the count orders the other
  // blocks' partials before this block's reads, which go to L2 (ld.cg: L1 is not coherent
  // across SMs, and a line of another (row, kv head)'s partials may sit in it).
  __syncthreads();
  bool last = false;
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(counter, 1u) == uint32_t(splits - 1);
    __threadfence();
  }
  if (!__syncthreads_or(last)) return;

  const int64_t H = p.head_dim;
  const int64_t live64 = rows_per_kv - row0;
  const int live = live64 < kRows ? int(live64) : kRows;
  const int64_t n_partials = p.groups * p.batch * p.kv_heads * splits;
  // Split 0's row row0; split s is s x rows_per_kv rows further on.
  const float* part = p.workspace + (rk * splits * rows_per_kv + row0) * H;
  const float* lse = p.workspace + n_partials * rows_per_kv * H + rk * splits * rows_per_kv + row0;
  float* top = stats;
  float* inv = stats + kRows;
  // weights[s kRows + i]: split s's log2-sum-exp of row i, then its weight before the
  // normalization. The loads in parallel (one L2 round trip), the max and the sum per row by
  // one thread each, in split order.
  for (int j = threadIdx.x; j < splits * kRows; j += blockDim.x) {
    const int s = j / kRows, i = j % kRows;
    if (i < live) weights[j] = __ldcg(lse + s * rows_per_kv + i);
  }
  __syncthreads();
  if (threadIdx.x < live) {
    float m = -INFINITY;
    for (int s = 0; s < splits; ++s) m = fmaxf(m, weights[s * kRows + threadIdx.x]);
    top[threadIdx.x] = m;
  }
  __syncthreads();
  for (int j = threadIdx.x; j < splits * kRows; j += blockDim.x) {
    const int i = j % kRows;
    if (i < live) weights[j] = top[i] == -INFINITY ? 0.f : exp2f(weights[j] - top[i]);
  }
  __syncthreads();
  if (threadIdx.x < live) {
    float total = 0.f;
    for (int s = 0; s < splits; ++s) total += weights[s * kRows + threadIdx.x];
    inv[threadIdx.x] = total > 0.f ? 1.f / total : 0.f;
  }
  __syncthreads();

  // 4 head dims a thread (H is a multiple of 8, so a partial row's float4s are aligned),
  // kBatch splits' loads issued before their fmas: the chain over the splits is serial, the
  // loads are not.
  constexpr int kBatch = 8;
  const int quads = int(H / 4);
  const int64_t rep = p.heads / p.kv_heads, r = rk / p.kv_heads, kvh = rk % p.kv_heads;
  const int64_t split_stride = rows_per_kv * H;
  for (int idx = threadIdx.x; idx < live * quads; idx += blockDim.x) {
    const int i = idx / quads;
    const int h = (idx - i * quads) * 4;
    const float norm = inv[i];
    const float* src = part + i * H + h;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int s0 = 0; s0 < splits; s0 += kBatch) {
      float4 v[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        v[b] = s0 + b < splits
                   ? __ldcg(reinterpret_cast<const float4*>(src + (s0 + b) * split_stride))
                   : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        if (s0 + b < splits) {
          // A split that saw nothing has weight 0 and a zero partial: it adds exactly 0.
          const float w = weights[(s0 + b) * kRows + i] * norm;
          acc[0] = fmaf(w, v[b].x, acc[0]);
          acc[1] = fmaf(w, v[b].y, acc[1]);
          acc[2] = fmaf(w, v[b].z, acc[2]);
          acc[3] = fmaf(w, v[b].w, acc[3]);
        }
      }
    }
    const int64_t rr = row0 + i, t = rr / rep, n = kvh * rep + rr % rep;
    T* dst = static_cast<T*>(p.out) + ((r * p.q_len + t) * p.heads + n) * H + h;
#pragma unroll
    for (int e = 0; e < 4; ++e) dst[e] = FromFloat<T>(acc[e]);
  }
}

// The tensor-core split kernel (decode_tc_kernels.cu) for a 16-bit query over a 16-bit or
// 8-bit cache, with its counters' zeroing: it may lower p->num_splits (to fill whole waves of
// the GPU, and to what its shared memory can combine).
bool TensorCoreKernelTakes(const PagedAttentionParams& p);
cudaError_t LaunchTensorCoreSplit(PagedAttentionParams* p, int64_t rows_per_kv,
                                  cudaStream_t stream);

}  // namespace jaxgpu::cuda::decode
