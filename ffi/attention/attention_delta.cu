// The attention backward's first kernel, shared by every main loop: delta = rowsum(dO * O)
// per query row, the float32 workspace the dQ and dK/dV kernels read (their dS = P (dP -
// delta)).
#include <cuda_runtime.h>

#include "attention/attention_launch.cuh"
#include "attention/attention_main_loop.h"
#include "common/cuda_utils.cuh"

namespace jaxgpu::cuda::attention {
namespace {

// One warp per query row (b, t, kh, r): H <= 256 is at most 32 chunks of 8 elements.
template <typename T>
__global__ void __launch_bounds__(256) DeltaKernel(AttentionParams p) {
  const int64_t rows = p.batch * p.q_len * p.kv_heads * p.group;
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const int H = static_cast<int>(p.head_dim);
  float acc = 0.f;
  if (lane * 8 < H) {
    const auto o = LoadVec<T, 8>(p.o, row * H + lane * 8);
    const auto d = LoadVec<T, 8>(p.d_o, row * H + lane * 8);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc += ToFloat(o.v[e]) * ToFloat(d.v[e]);
  }
#pragma unroll
  for (int s = 16; s > 0; s >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, s);
  if (lane == 0) {
    // row = ((b * T + t) * K + kh) * R + r  ->  delta[b, kh, r, t]
    const int64_t heads = p.kv_heads * p.group;
    const int64_t head = row % heads;
    const int64_t bt = row / heads;
    const int64_t t = bt % p.q_len, b = bt / p.q_len;
    p.delta[(b * heads + head) * p.q_len + t] = acc;
  }
}

}  // namespace

cudaError_t LaunchDelta(const AttentionParams& p, cudaStream_t stream) {
  const int64_t q_rows = p.batch * p.q_len * p.kv_heads * p.group;
  const int64_t blocks = CeilDiv(q_rows * 32, 256);
  if (blocks > INT32_MAX) return cudaErrorInvalidConfiguration;
  return JAXGPU_ATTENTION_DTYPE_SWITCH(p.dtype, T, [&] {
    DeltaKernel<T><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(p);
    return cudaGetLastError();
  });
}

}  // namespace jaxgpu::cuda::attention
