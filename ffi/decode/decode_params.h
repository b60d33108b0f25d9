// Launch parameters of the decode kernels (attention over a paged KV cache, and the cache
// update): the plain structs at the host/device (and host/CPU) boundary. No XLA or CUDA
// types.
//
// Layout. Every array has a leading group axis G (jaxgpu/_kernel_op.py folds vmap into it):
//   query, out   (G, B, Tq, N, H)          in `dtype`
//   pages        (Gp, P, S, K, H)          Gp = 1 (one pool shared by every group) or G
//   block_table  (G, B, M) int32           page j of row (g, b) is block_table[g, b, j]
//   lengths      (G, B) int32              tokens of the row, the Tq new ones included
//   k_new, v_new (G, B, Tn, K, H), positions (G, B, Tn) int32 (the update)
//
// Attention semantics (shared by the CPU and CUDA kernels and by jaxgpu/reference/decode.py):
// query t of row r sits at position p = lengths[r] - Tq + t; query head n reads kv head
// n / (N / K). Key position j (its K/V at slot j % S of page block_table[r, j / S]) is
// visible when j <= p, j >= p - window_left (window_left >= 0), and the page entry is in
// [0, P); a key whose entry is outside [0, P) is masked out and its page never read.
// Logits: scale * q.k, then softcap * tanh(. / softcap) when softcap > 0; softmax and P.V
// in float32 (float64 on the CPU), the output rounded once to `dtype`. A query with no
// visible key outputs zeros; so does every query of a row whose length is outside
// [0, M * S] (traced lengths are never trusted to bound a read).
//
// Update semantics: token t of row r goes to slot positions[r, t] % S of page
// block_table[r, positions[r, t] / S]. A token whose position is outside [0, M * S) or
// whose page entry is outside [0, P) is skipped (negative positions are padding). Two
// tokens on one slot leave either one's values.
#pragma once

#include <cstdint>

#include "common/dtype.h"

namespace jaxgpu {

// 8-bit cache. The pages may hold int8 or float8_e4m3fn values (kv_dtype) with float32
// scales k_scale, v_scale (Gp, P, S, K): one per token and kv head, so that the value of
// k_pages[g, p, s, k, h] is float(k_pages[g, p, s, k, h]) * k_scale[g, p, s, k]. A 16-bit
// or float32 cache has kv_dtype == dtype and null scales. The update quantizes each new
// token's K (and V) row of one kv head with scale = max|row| / Qmax (Qmax 127 for int8,
// 448 for e4m3; scale 0 for an all-zero row) and values row / scale, both IEEE float32
// divisions (a multiply by a reciprocal rounds differently), zeros where the scale is 0:
// int8 rounds half to even and clamps to [-127, 127], e4m3 rounds to nearest even and
// saturates at 448. The CPU and CUDA updates and jaxgpu.quantize_kv agree bit for bit.
struct PagedAttentionParams {
  DType dtype;     // of query and out
  DType kv_dtype;  // of the pages: dtype, or kS8 / kF8E4M3 with scales
  int64_t groups;
  int64_t page_groups;  // 1 or groups
  int64_t batch;
  int64_t q_len;      // Tq, in [1, 16]
  int64_t heads;      // N, a multiple of kv_heads
  int64_t kv_heads;   // K
  int64_t head_dim;   // H, a multiple of 8 in [8, 256]
  int64_t num_pages;  // P
  int64_t page_size;  // S, a positive multiple of 8
  int64_t max_pages;  // M
  const void* query;
  const void* k_pages;
  const void* v_pages;
  const float* k_scale;  // (Gp, P, S, K) when kv_dtype is 8-bit, else null
  const float* v_scale;
  const int32_t* block_table;
  const int32_t* lengths;
  void* out;
  // Split-KV: each (group, row, kv head) is split over num_splits thread blocks, which
  // write their normalized partial outputs and log2-sum-exps here (see
  // PagedAttentionWorkspaceSize); a combine kernel reduces them. Unused with one split
  // (then empty) and by the CPU implementation.
  float* workspace;
  int32_t num_splits;
  // paged_attention_with_update over a 16-bit cache, on the tensor-core kernel: the new
  // tokens' K and V (G, B, Tq, K, H) in the cache's dtype. The split kernel writes them to
  // their slots through k_pages_out / v_pages_out (the same buffers as k_pages / v_pages,
  // at positions lengths - Tq + t by the update's rules), and the blocks whose keys include
  // them read them from here rather than from the pages, so no block waits for another's
  // write. Null otherwise.
  const void* k_new;
  const void* v_new;
  void* k_pages_out;
  void* v_pages_out;
  float scale;          // > 0
  float softcap;        // 0: none
  int32_t window_left;  // -1: none
};

// Query rows that share one kv head: the Tq new tokens times the N / K heads of the group.
inline int64_t PagedAttentionRowsPerKvHead(const PagedAttentionParams& p) {
  return p.q_len * (p.heads / p.kv_heads);
}

// float32 elements of the workspace: per (group, row, kv head, split), the partial output
// (rows per kv head, H) and then, after all of those, one log2-sum-exp per partial row.
inline int64_t PagedAttentionWorkspaceSize(const PagedAttentionParams& p) {
  if (p.num_splits <= 1) return 0;
  return p.groups * p.batch * p.kv_heads * p.num_splits * PagedAttentionRowsPerKvHead(p) *
         (p.head_dim + 1);
}

struct PagedKvUpdateParams {
  DType dtype;     // of the new tokens
  DType kv_dtype;  // of the pages: dtype, or kS8 / kF8E4M3 (then the scales are set)
  int64_t groups;
  int64_t num_pages;
  int64_t page_size;
  int64_t kv_heads;
  int64_t head_dim;
  int64_t batch;
  int64_t new_len;  // Tn
  int64_t max_pages;
  const void* k_pages_in;  // the caches before the write: the same buffers as the outputs
  const void* v_pages_in;  // when XLA aliased them (always, with input_output_aliases)
  void* k_pages;           // outputs (G, P, S, K, H)
  void* v_pages;
  const void* k_new;
  const void* v_new;
  const int32_t* block_table;
  // Null for paged_attention_with_update: token t of row r is then at position
  // lengths[r] - Tn + t (the query tokens of the attention that follows).
  const int32_t* positions;
  const int32_t* lengths;  // (G, B), read only when positions is null
  // 8-bit cache: the scales (G, P, S, K) before the write and the outputs (aliased, as the
  // pages are); null otherwise.
  const float* k_scale_in;
  const float* v_scale_in;
  float* k_scale;
  float* v_scale;
};

// The update of paged_attention_with_update: attention `a`'s query tokens' K/V (k_new,
// v_new in a's dtype, (G, B, Tq, K, H)) written into the pools at k_pages / v_pages (the
// same buffers as the inputs: copied there first when XLA did not alias them), at positions
// lengths - Tq + t.
inline PagedKvUpdateParams QueryTokensUpdate(const PagedAttentionParams& a, void* k_pages,
                                             void* v_pages, const void* k_new, const void* v_new) {
  PagedKvUpdateParams u{};
  u.dtype = a.dtype;
  u.kv_dtype = a.kv_dtype;
  u.groups = a.groups;
  u.num_pages = a.num_pages;
  u.page_size = a.page_size;
  u.kv_heads = a.kv_heads;
  u.head_dim = a.head_dim;
  u.batch = a.batch;
  u.new_len = a.q_len;
  u.max_pages = a.max_pages;
  u.k_pages_in = u.k_pages = k_pages;
  u.v_pages_in = u.v_pages = v_pages;
  u.k_new = k_new;
  u.v_new = v_new;
  u.block_table = a.block_table;
  u.lengths = a.lengths;
  return u;
}

// Bytes of one page pool (both caches have this size).
inline int64_t PagedKvPoolBytes(const PagedKvUpdateParams& p) {
  return DTypeBytes(p.kv_dtype, p.groups * p.num_pages * p.page_size * p.kv_heads * p.head_dim);
}

// Bytes of one 8-bit cache's scales (0 without scales).
inline int64_t PagedKvScaleBytes(const PagedKvUpdateParams& p) {
  if (p.k_scale == nullptr) return 0;
  return int64_t(sizeof(float)) * p.groups * p.num_pages * p.page_size * p.kv_heads;
}

}  // namespace jaxgpu
