// Launch parameters of the attention kernels: the one plain struct at the host/device (and
// host/CPU) boundary, shared by the forward and backward passes, the CPU kernels and every
// CUDA main loop (sm80/, sm90/; which one runs: attention_path.h). No XLA or CUDA types.
//
// Layouts (all contiguous, row-major; jax.nn.dot_product_attention's BTNH):
//   q, o, do, dq   (B, T, K, R, H)   query head n = kv_head * R + r (N = K * R: GQA/MQA/MHA)
//   k, v, dk, dv   (B, S, K, H)
//   lse, delta     (B, K, R, T)      float32
//   segment ids    (B, T) / (B, S)   int32
//   segment_uniform (B,)             int32, backward only (see below)
//   bias, dbias    (Bb, Kb, Rb, Tb, Sb)  each dim 1 (broadcast) or B, K, R, T, S
//   mask           (Bm, Km, Rm, Tm, Sm)  bool (one byte), the same rule
//   q_lengths, kv_lengths (B,)       int32
//
// Logits: l(i, j) = scale * q_i . k_j, then softcap * tanh(l / softcap) when softcap > 0,
// then + bias[b, n, i, j] (after the softcap: Gemma-style models cap the content logits and
// add position terms outside the cap), then masked. Key j is visible to query i when
//   j <= i                                    (causal: top-left aligned, as jnp.tril)
//   i - window_left <= j <= i + window_right  (each side only when >= 0; -1 = unbounded)
//   q_segment_ids[b, i] == kv_segment_ids[b, j]   (when given)
//   mask[b, n, i, j]                          (when given)
//   i < q_lengths[b] and j < kv_lengths[b]    (when given; clamped to [0, T] / [0, S], so a
//                                              traced out-of-range length reads nothing
//                                              out of bounds)
// A query with no visible key gets o = 0, lse = -inf, and zero gradients.
#pragma once

#include <cstdint>

#include "common/dtype.h"

namespace jaxgpu {

struct AttentionParams {
  DType dtype;       // of q, k, v, o, do, dq, dk, dv
  int64_t batch;     // B
  int64_t q_len;     // T
  int64_t kv_len;    // S
  int64_t kv_heads;  // K
  int64_t group;     // R: query heads per kv head
  int64_t head_dim;  // H
  float scale;
  float softcap;  // 0: none
  bool causal;
  int64_t window_left;           // -1: unbounded
  int64_t window_right;          // -1: unbounded
  const int32_t* q_segment_ids;  // nullptr: no segment ids
  const int32_t* kv_segment_ids;
  // Backward, with segment ids (optional): per batch row, 1 where its q and kv ids are all
  // one segment (nothing masked by them), else 0. nullptr otherwise.
  const int32_t* segment_uniform;

  // Additive bias and boolean mask (nullptr: none). Element (b, kh, r, i, j) lies at
  // sum(index * stride) with stride 0 on a broadcast dim, so a broadcast dim is never
  // materialized. bias_dtype: float32 or the dtype of q.
  const void* bias;
  DType bias_dtype;
  int64_t bias_stride[5];
  float bias_scale;  // 1 / (softcap > 0 ? softcap : scale): the bias in the kernels' units
  const uint8_t* mask;
  int64_t mask_stride[5];
  // Per batch row valid lengths (nullptr: T / S). Tiles past them are skipped, not masked.
  const int32_t* q_lengths;
  const int32_t* kv_lengths;
  // Backward with a bias: float32 dL/dbias in bias's shape (strides bias_stride), zeroed by
  // the launcher; dbias_atomic when some dim is broadcast (several (b, n, i, j) add into one
  // element), else every element is stored by the one thread that computes it.
  float* dbias;
  bool dbias_atomic;

  // Forward: reads q, k, v; writes o, lse.  Backward: reads q, k, v, o, lse, d_o; writes
  // dq, dk, dv and delta (rowsum(do * o), a float32 workspace the caller allocates).
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;
  const void* d_o;
  void* dq;
  void* dk;
  void* dv;
  float* delta;
  // Backward workspaces of the fused (warp-specialized) Hopper backward, allocated by the
  // caller, zeroed by its launcher (nullptr: the main loop's dQ and dK/dV kernels run): a
  // float32 dQ accumulator in q's shape, and dq_semaphore_count int32 semaphores (one per
  // batch row, query head and query tile; the launcher checks that there are enough).
  float* dq_accum;
  int32_t* dq_semaphores;
  int64_t dq_semaphore_count;
  // The fused backward adds dQ's partial sums in whatever order its CTAs finish (float32
  // adds: not bitwise reproducible), without the semaphores' waits. false: a fixed order.
  bool dq_unordered;
  // Forward workspace of the Hopper forward's dynamic tile schedule (nullptr: its masked
  // calls run fwd_sm90's kernel): one int32, zeroed by the launcher before each call.
  int32_t* fwd_tile_counter;
};

// Elements of a bias- or mask-shaped array with these strides (a dim of stride 0 has size 1).
inline int64_t BroadcastCount(const AttentionParams& p, const int64_t stride[5]) {
  const int64_t full[5] = {p.batch, p.kv_heads, p.group, p.q_len, p.kv_len};
  int64_t n = 1;
  for (int i = 0; i < 5; ++i) n *= stride[i] == 0 ? 1 : full[i];
  return n;
}

}  // namespace jaxgpu
