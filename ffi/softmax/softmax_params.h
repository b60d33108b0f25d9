// Launch parameters of the softmax kernels: the one plain struct at the host/device (and
// host/CPU) boundary. No XLA or CUDA types.
//
// Layout: x and y are (rows, cols) row-major, softmax over cols (S). The rows are x's
// leading dims flattened; `query_len` (T) is the innermost of them, so the query index of a
// row (for the causal mask) is row % T.
//
// The mask is NOT broadcast in memory. It arrives in its own shape (x's rank, each dim 1 or
// x's), and the handler coalesces x's row dims into `ndims` groups of adjacent dims (sizes
// `dims`, outermost first) over each of which the mask is either full or broadcast (size 1).
// Element (row, c) of the mask is
//   mask[sum_k idx_k(row) * mask_strides[k] + c * mask_col_stride]
// with idx_k the row's index in group k and stride 0 for a broadcast group (and for a
// broadcast S). Cost: a few integer divisions per row (magic-number divisions on CUDA),
// and the mask's own bytes read from memory (once per row that uses them: a mask broadcast
// over heads is re-read per head, from L2 when it fits).
#pragma once

#include <cstdint>

#include "common/dtype.h"

namespace jaxgpu {

// Row-dim groups after coalescing: x (B, H, T, S) with a mask (B, 1, T, S) has 3 (B, H, T);
// only a mask alternating between full and broadcast dims more than 8 times needs more.
constexpr int kSoftmaxMaxDims = 8;

struct SoftmaxFwdParams {
  DType dtype;  // of x and y
  int64_t rows;
  int64_t cols;       // S, < 2^31
  int64_t query_len;  // T: the query index of a row is row % T (causal only)
  bool causal;        // keep (i, j) only when j <= i (top-left aligned, as jnp.tril)
  float scale;        // the logits are x * scale
  const void* x;
  void* y;
  const uint8_t* mask;            // bool, nullptr: none
  int ndims;                      // row-dim groups of the mask's index map, 1..kSoftmaxMaxDims
  int64_t dims[kSoftmaxMaxDims];  // sizes of the groups (their product is rows)
  int64_t mask_strides[kSoftmaxMaxDims];  // mask elements per index step; 0 = broadcast
  int64_t mask_col_stride;                // 1, or 0 when the mask is broadcast along S
};

struct SoftmaxBwdParams {
  DType dtype;  // of y, dy and dx
  int64_t rows;
  int64_t cols;
  int64_t query_len;  // T (causal only)
  bool causal;        // y is 0 past key i of query i: neither read there, dx = 0
  float scale;        // dx = scale * y * (dy - sum(dy * y))
  const void* y;
  const void* dy;
  void* dx;
};

}  // namespace jaxgpu
