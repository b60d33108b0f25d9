// Backward kernels: staged (SoftmaxBwdStaged) and loop (SoftmaxBwdLoop). No XLA types.
//
// dx = scale * y * (dy - sum(dy * y)). Masked and fully masked positions hold y = 0 and get
// exactly 0, so the backward pass needs neither the mask nor the causal flag.
#pragma once

#include <cstdint>

#include "softmax/softmax_device.cuh"

namespace jaxgpu::cuda::softmax {

template <typename T, int VEC, int VPT, bool kAsync, bool kCausal>
__global__ void __launch_bounds__(StagedMaxThreads<VEC>(), (VEC > 1 && VPT <= 4) ? 2 : 1)
    SoftmaxBwdStaged(const BwdArgs a, int tpr) {
  extern __shared__ __align__(16) unsigned char staged[];
  __shared__ float scratch[kScratchFloats];
  const SoftmaxBwdParams& p = a.p;
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool valid = row < p.rows;
  const int S = static_cast<int>(p.cols);
  const int first = int(threadIdx.x) * VEC;
  const int step = tpr * VEC;
  T* ys = reinterpret_cast<T*>(staged) + int64_t(threadIdx.y) * 2 * S;  // y, then dy
  const int64_t base = row * p.cols;
  // Past the causal limit y is 0: y and dy are not read there and dx is 0.
  const int lim = (kCausal && valid) ? CausalLast(a.fast, a.query, p.query_len, row, S) + 1 : S;
  const void* const src[2] = {p.y, p.dy};
  StageRow<T, VEC, VPT, kAsync, 2>(src, base, ys, S, lim, tpr, valid);
  if constexpr (kAsync) CpAsyncWait<0>();

  float dot = 0.f;
  if (valid) {
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int c = first + k * step;
      if (c < lim) {
        float y[VEC], dy[VEC];
        ToFloats<T, VEC>(*reinterpret_cast<const Vec<T, VEC>*>(ys + c), y);
        ToFloats<T, VEC>(*reinterpret_cast<const Vec<T, VEC>*>(ys + S + c), dy);
#pragma unroll
        for (int j = 0; j < VEC; ++j) dot = fmaf(y[j], dy[j], dot);
      }
    }
  }
  dot = RowReduce(dot, scratch, tpr, 0, SumOp{});
  if (!valid) return;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int c = first + k * step;
    if (c < S) {
      Vec<T, VEC> out;
      if (c < lim) {
        float y[VEC], dy[VEC];
        ToFloats<T, VEC>(*reinterpret_cast<const Vec<T, VEC>*>(ys + c), y);
        ToFloats<T, VEC>(*reinterpret_cast<const Vec<T, VEC>*>(ys + S + c), dy);
#pragma unroll
        for (int j = 0; j < VEC; ++j) out.v[j] = FromFloat<T>(p.scale * y[j] * (dy[j] - dot));
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) out.v[j] = FromFloat<T>(0.f);
      }
      StoreVecStream<T, VEC>(p.dx, base + c, out);
    }
  }
}

template <typename T, int VEC, bool kCausal>
__global__ void __launch_bounds__(kMaxThreads) SoftmaxBwdLoop(const BwdArgs a) {
  __shared__ float scratch[kScratchFloats];
  const SoftmaxBwdParams& p = a.p;
  const int64_t row = blockIdx.x;
  const int S = static_cast<int>(p.cols);
  const int64_t base = row * p.cols;
  const int step = int(blockDim.x) * VEC;
  const int lim = kCausal ? CausalLast(a.fast, a.query, p.query_len, row, S) + 1 : S;
  float dot = 0.f;
  for (int c = int(threadIdx.x) * VEC; c < lim; c += step) {
    float y[VEC], dy[VEC];
    ToFloats<T, VEC>(LoadVec<T, VEC>(p.y, base + c), y);
    ToFloats<T, VEC>(LoadVec<T, VEC>(p.dy, base + c), dy);
#pragma unroll
    for (int j = 0; j < VEC; ++j) dot = fmaf(y[j], dy[j], dot);
  }
  dot = RowReduce(dot, scratch, int(blockDim.x), 0, SumOp{});
  for (int c = int(threadIdx.x) * VEC; c < S; c += step) {
    Vec<T, VEC> out;
    if (c < lim) {
      float y[VEC], dy[VEC];
      ToFloats<T, VEC>(LoadVecStream<T, VEC>(p.y, base + c), y);
      ToFloats<T, VEC>(LoadVecStream<T, VEC>(p.dy, base + c), dy);
#pragma unroll
      for (int j = 0; j < VEC; ++j) out.v[j] = FromFloat<T>(p.scale * y[j] * (dy[j] - dot));
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) out.v[j] = FromFloat<T>(0.f);
    }
    StoreVecStream<T, VEC>(p.dx, base + c, out);
  }
}

}  // namespace jaxgpu::cuda::softmax
