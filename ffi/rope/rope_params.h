// Launch parameters of the rotary position embedding (RoPE) kernels: the one plain struct
// at the host/device (and host/CPU) boundary. No XLA or CUDA types.
//
// Layout: x and y are (rows, seq, heads, dim), row-major: a token (row, t) owns heads * dim
// contiguous elements. positions is int32 (pos_rows, seq): token (row, t) uses
// positions[row / (rows / pos_rows), t], so pos_rows == rows is one position per token,
// pos_rows == 1 one position sequence shared by every row, and anything dividing rows a
// sequence shared by each block of rows / pos_rows consecutive rows (a vmapped group).
#pragma once

#include <cstdint>

#include "common/dtype.h"

namespace jaxgpu {

struct RopeParams {
  DType dtype;       // of x and y
  bool interleaved;  // pairs (2i, 2i + 1) (GPT-J); else (i, i + rotary_dim / 2) (Llama)
  bool inverse;      // rotate by -angle: the backward pass (the rotation's transpose)
  int64_t rows;
  int64_t seq;
  int64_t heads;
  int64_t dim;
  int64_t rotary_dim;  // even, <= dim; features [rotary_dim, dim) are copied unchanged
  int64_t pos_rows;    // >= 1, divides rows (when rows > 0)
  const void* x;
  const int32_t* positions;
  void* y;
  double log2_theta;  // inv_freq_i = 2^(-(2 i / rotary_dim) * log2_theta)
};

}  // namespace jaxgpu
