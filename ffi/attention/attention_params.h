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
//
// Logits: l(i, j) = scale * q_i . k_j, then softcap * tanh(l / softcap) when softcap > 0,
// then masked. Key j is visible to query i when
//   j <= i                                    (causal: top-left aligned, as jnp.tril)
//   i - window_left <= j <= i + window_right  (each side only when >= 0; -1 = unbounded)
//   q_segment_ids[b, i] == kv_segment_ids[b, j]   (when given)
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
};

}  // namespace jaxgpu
