// Launch parameters of the cross-entropy kernels: the one plain struct at the host/device
// (and host/CPU) boundary. No XLA or CUDA types.
//
// Layout: logits (rows, vocab) row-major in `dtype`; labels, loss, lse, dloss are (rows,).
// Row statistics and losses are float32 whatever the logits dtype.
//
// Per-row semantics (shared by the CPU and CUDA kernels and by jaxgpu/reference):
//   z        = logits, or softcap * tanh(logits / softcap) when softcap > 0
//   lse      = log(sum_j exp(z_j))
//   loss     = lse - (1 - ls) * z[label] - ls * mean(z)     (ls = label_smoothing)
//   dlogits  = dloss * (softmax(z) - (1 - ls) * onehot(label) - ls / vocab)
//              * (1 - tanh(logits / softcap)^2 with a softcap)
// A row whose label equals ignore_index (when has_ignore) has loss 0 and gradient 0. A row
// whose label is outside [0, vocab) (and not ignored) has loss NaN and gradient 0; its
// logits are never read. lse of such rows is 0 (the backward pass does not use it).
#pragma once

#include <cstdint>

#include "common/dtype.h"

namespace jaxgpu {

struct CrossEntropyFwdParams {
  DType dtype;  // of logits
  int64_t rows;
  int64_t vocab;
  const void* logits;     // (rows, vocab)
  const int32_t* labels;  // (rows,)
  float* loss;            // (rows,) float32
  float* lse;             // (rows,) float32, saved for the backward pass
  int32_t ignore_index;
  bool has_ignore;
  float label_smoothing;  // in [0, 1)
  float softcap;          // 0: none
};

struct CrossEntropyBwdParams {
  DType dtype;  // of logits and dlogits
  int64_t rows;
  int64_t vocab;
  const void* logits;
  const int32_t* labels;
  const float* lse;    // from the forward pass
  const float* dloss;  // (rows,) float32: the cotangent of each row's loss
  void* dlogits;       // (rows, vocab)
  int32_t ignore_index;
  bool has_ignore;
  float label_smoothing;
  float softcap;
};

}  // namespace jaxgpu
