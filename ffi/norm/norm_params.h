// Launch parameters of the normalization kernels: the one plain struct at the host/device
// (and host/CPU) boundary. No XLA or CUDA types.
//
// Layout: every row-shaped array is (groups, rows_per_group, dim), row-major. A group is
// the unit of parameter sharing: rows of group g use weight/bias row g (or row 0 when the
// parameter is shared by all groups, stride 0) and their weight gradient lands in row g of
// dweight. Groups are how vmap over a batched weight, and vmap of grad (one dweight per
// batch element), run as ONE launch instead of a loop.
#pragma once

#include <cstdint>

#include "common/dtype.h"

namespace jaxgpu {

enum class NormKind : int32_t { kRms = 0, kLayer = 1 };

struct NormFwdParams {
  NormKind kind;
  DType dtype;        // of x, residual, y, h
  DType param_dtype;  // of weight and bias: dtype, or float32 (master weights)
  int64_t groups;
  int64_t rows_per_group;
  int64_t dim;
  const void* x;
  const void* residual;         // nullptr: no residual
  const void* weight;           // nullptr: no weight
  const void* bias;             // nullptr: no bias (layer norm only)
  int64_t weight_group_stride;  // 0 (shared) or dim
  int64_t bias_group_stride;
  void* y;
  void* h;      // x + residual, written when residual != nullptr
  float* mean;  // (groups, rows) float32, layer norm only
  float* rstd;  // (groups, rows) float32
  float eps;
  float weight_offset;  // y uses (weight_offset + weight); Gemma's RMSNorm uses 1
};

struct NormBwdParams {
  NormKind kind;
  DType dtype;        // of dy, dh, xh, dx
  DType param_dtype;  // of weight: dtype, or float32
  int64_t groups;
  int64_t rows_per_group;
  int64_t dim;
  const void* dy;
  const void* dh;      // cotangent of the h output; nullptr: none
  const void* xh;      // the normalized input: h when there was a residual, else x
  const void* weight;  // nullptr: no weight
  int64_t weight_group_stride;
  const float* mean;  // layer norm only
  const float* rstd;
  float weight_offset;
  void* dx;        // also the residual's gradient
  float* dweight;  // (groups, dim) float32; nullptr: not wanted
  float* dbias;    // (groups, dim) float32; nullptr: not wanted
  // Deterministic weight/bias gradients (CUDA): `slots` row slots per group each sum a
  // fixed subset of rows into one partial row; then the partials are summed in order.
  // (k, groups, slots, dim) float32, k = number of wanted gradients. The CPU ignores it.
  float* workspace;
  int64_t slots;
};

inline int64_t NormRows(int64_t groups, int64_t rows_per_group) { return groups * rows_per_group; }

}  // namespace jaxgpu
