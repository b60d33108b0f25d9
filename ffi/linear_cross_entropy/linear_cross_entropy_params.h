// Launch parameters of the fused linear + cross-entropy (the language-model head without
// its logits): the plain structs at the host/device (and host/CPU) boundary. No XLA or CUDA
// types.
//
// Layout: x (groups, rows, dim) row-major; w (weight_groups, vocab, dim) for w_layout kVD
// (the tied embedding as stored) or (weight_groups, dim, vocab) for kDV, weight_groups 1
// (shared by every group) or groups; labels (groups, rows) int32, global vocabulary ids.
// The call sees one slice of the vocabulary (all of it, or one shard's under a
// vocabulary-parallel sharding): its columns are the global ids offset .. offset + vocab - 1,
// offset read from the device at *vocab_offset.
//
// Per row, over the slice (z = x w_v, or softcap * tanh(x w_v / softcap)):
//   forward   lse = log(sum_v exp(z_v)) (-inf for an empty slice), zlabel = z[label] when
//             the label is in the slice (else 0), zsum = sum_v z_v
//   backward  dlogit_v = dloss * (exp(z_v - lse) - (1 - ls) [v == label] - ls / vocab_total)
//             * (1 - tanh^2 with a softcap), lse the whole vocabulary's; then
//             dx = sum_v dlogit_v w_v (float32) and dw_v = sum_rows dlogit_v x (w's dtype,
//             one (vocab, dim) or (dim, vocab) gradient per group)
// The loss itself, lse - (1 - ls) zlabel - ls zsum / vocab_total over the whole vocabulary,
// is formed by the caller (jaxgpu/ops/linear_cross_entropy.py) after combining slices.
#pragma once

#include <cstdint>

#include "common/dtype.h"

namespace jaxgpu {

enum class WeightLayout : int32_t { kVD = 0, kDV = 1 };

struct LinearCrossEntropyShape {
  DType dtype;  // of x and w
  int64_t groups, rows, dim, vocab;
  int64_t weight_groups;  // 1 or groups
  WeightLayout layout;
  int64_t chunk;  // vocabulary columns per chunk (CUDA: the logits scratch is rows x chunk)
};

struct LinearCrossEntropyFwdParams {
  LinearCrossEntropyShape s;
  const void* x;
  const void* w;
  const int32_t* labels;
  const int32_t* vocab_offset;  // device (CUDA) or host (CPU) pointer to one int32
  float* lse;                   // (groups, rows)
  float* zlabel;                // (groups, rows)
  float* zsum;                  // (groups, rows)
  float softcap;                // 0: none
  void* scratch;                // CUDA: the logits chunk, row sums, cuBLASLt's workspace
  int64_t scratch_bytes;
};

struct LinearCrossEntropyBwdParams {
  LinearCrossEntropyShape s;
  const void* x;
  const void* w;
  const int32_t* labels;
  const int32_t* vocab_offset;
  const float* lse;    // (groups, rows): the whole vocabulary's
  const float* dloss;  // (groups, rows): 0 for rows that get no gradient
  float* dx;           // (groups, rows, dim) float32
  void* dw;            // (groups, vocab, dim) or (groups, dim, vocab), w's dtype
  float softcap;
  float label_smoothing;
  int64_t vocab_total;  // the whole vocabulary (ls / vocab_total)
  void* scratch;
  int64_t scratch_bytes;
};

}  // namespace jaxgpu
