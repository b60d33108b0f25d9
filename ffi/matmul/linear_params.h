// Dense linear (jaxgpu.linear with a float weight): launch parameters of the forward GEMM
// with its epilogue and of the two backward GEMMs, shared by the CPU loops (matmul_cpu.cc)
// and the cuBLASLt handlers (matmul_handlers_cuda.cc). No XLA or CUDA types.
//
// Layout. Every array has a leading group axis G (jaxgpu/_kernel_op.py folds vmap into it);
// rows are row-major as JAX holds them:
//   x (G, M, K), w (Gw, K, N) with Gw in {1, G}, bias (Gb, N) with Gb in {1, G},
//   y and aux (G, M, N), dz (G, M, N), dx (G, M, K), dw (G, K, N), dbias (G, N).
//
// Math, in float32 accumulation (float64 on the CPU), one rounding to the dtype T at the end:
//   forward  z = x w + bias, y = act(z) (act none, relu or the tanh gelu: what cuBLASLt's
//            epilogues compute), aux = z rounded to T (the tanh gelu's backward input);
//   dgrad    dx = dz w^T;
//   wgrad    dw = x^T dz, dbias = sum over rows of dz (per group).
#pragma once

#include <cstdint>

#include "common/dtype.h"

namespace jaxgpu {

enum class LinearEpilogue : int32_t {
  kNone = 0,
  kRelu = 1,
  kGeluTanh = 2,
};

struct LinearFwdParams {
  DType dtype;
  int64_t groups, weight_groups, bias_groups;  // bias_groups 0: no bias
  int64_t m, k, n;
  LinearEpilogue epilogue;
  const void* x;
  const void* w;
  const void* bias;  // or null
  void* y;
  void* aux;  // or null: z, for the backward pass of the gelu
  void* workspace;
  int64_t workspace_bytes;
};

struct LinearDgradParams {
  DType dtype;
  int64_t groups, weight_groups;
  int64_t m, k, n;
  const void* dz;
  const void* w;
  void* dx;
  void* workspace;
  int64_t workspace_bytes;
};

struct LinearWgradParams {
  DType dtype;
  int64_t groups;
  int64_t m, k, n;
  const void* x;
  const void* dz;
  void* dw;
  void* dbias;  // or null
  void* workspace;
  int64_t workspace_bytes;
};

}  // namespace jaxgpu
