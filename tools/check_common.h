// Host helpers shared by the standalone kernel checkers (tools/*_check.cu): CUDA error
// checks and 16-bit float storage on the host.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common/dtype.h"

#define CK(expr)                                                                           \
  do {                                                                                     \
    cudaError_t e_ = (expr);                                                               \
    if (e_ != cudaSuccess) {                                                               \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

namespace jaxgpu::check {

// Microseconds per call of a CUDA graph of `calls` launches: the median of `reps` timed
// replays on `stream`, after one untimed replay.
inline double GraphUsPerCall(cudaGraphExec_t exec, cudaStream_t stream, int calls, int reps) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaGraphLaunch(exec, stream));
  std::vector<float> us;
  for (int r = 0; r < reps; ++r) {
    CK(cudaEventRecord(e0, stream));
    CK(cudaGraphLaunch(exec, stream));
    CK(cudaEventRecord(e1, stream));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    us.push_back(ms * 1000.f / float(calls));
  }
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

// The bits of f rounded to bf16 or f16 (round to nearest even).
inline uint16_t HalfBits(DType t, float f) {
  uint16_t u;
  if (t == DType::kBF16) {
    const __nv_bfloat16 b = __float2bfloat16_rn(f);
    std::memcpy(&u, &b, 2);
  } else {
    const __half h = __float2half_rn(f);
    std::memcpy(&u, &h, 2);
  }
  return u;
}

// The value of bf16 or f16 bits.
inline double HalfValue(DType t, uint16_t u) {
  if (t == DType::kBF16) {
    __nv_bfloat16 b;
    std::memcpy(&b, &u, 2);
    return double(__bfloat162float(b));
  }
  __half h;
  std::memcpy(&h, &u, 2);
  return double(__half2float(h));
}

// The spacing of bf16 or f16 at |v| (subnormal spacing below the normal range).
inline double Ulp(DType t, double v) {
  const int mant = t == DType::kBF16 ? 7 : 10;
  const int emin = t == DType::kBF16 ? -126 : -14;
  v = std::fabs(v);
  const int e = v > 0 ? int(std::floor(std::log2(v))) : emin;
  return std::ldexp(1.0, (e < emin ? emin : e) - mant);
}

}  // namespace jaxgpu::check
