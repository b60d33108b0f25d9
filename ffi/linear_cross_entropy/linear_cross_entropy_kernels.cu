// Row kernels of the fused linear + cross-entropy, between the cuBLASLt products of each
// vocabulary chunk (linear_cross_entropy_handlers_cuda.cc).
//
// One block of 256 threads per row of a (rows, cols) chunk: at the chunk widths the handler
// picks (rows x cols ~ 128 Mi elements, cols >= 2048), a row is >= 4 KiB and 256 threads read
// it in 16-byte vectors; the chunk is read once (stats) or read and written once (grad), which
// is ~5% of the three GEMMs' time per chunk at D = 2304 (napkin: 256 MiB at 3 TB/s = 90 us,
// against 2 x rows x cols x D = 0.6 TFLOP, ~0.9 ms at 700 TFLOP/s). Rows whose 16-byte
// alignment the width breaks (an odd last chunk) take the scalar path.
#include <cfloat>
#include <cmath>
#include <cstdint>

#include "common/cuda_utils.cuh"
#include "linear_cross_entropy/linear_cross_entropy_cuda.h"

namespace jaxgpu::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float Capped(float l, float cap, float* dz) {
  if (cap > 0.f) {
    const float t = tanhf(l / cap);
    *dz = 1.f - t * t;
    return cap * t;
  }
  *dz = 1.f;
  return l;
}

// Online (max, sum of exp(z - max)) of one value folded into (m, s).
__device__ __forceinline__ void Fold(float z, float* m, float* s) {
  if (z > *m) {
    *s = *s * __expf(*m - z) + 1.f;
    *m = z;
  } else {
    *s += __expf(z - *m);
  }
}

__device__ __forceinline__ void Merge(float m2, float s2, float* m, float* s) {
  if (m2 == -INFINITY) return;
  if (*m == -INFINITY) {
    *m = m2;
    *s = s2;
    return;
  }
  const float top = fmaxf(*m, m2);
  *s = *s * __expf(*m - top) + s2 * __expf(m2 - top);
  *m = top;
}

template <typename T, bool kVector>
__global__ void __launch_bounds__(kThreads)
    ChunkStats(LceChunk c, bool first, float* m_run, float* s_run, float* zlabel_run,
               float* zsum_run) {
  constexpr int kVec = 16 / sizeof(T);
  const int64_t row = blockIdx.x;
  const T* logits = static_cast<const T*>(c.logits) + row * c.cols;
  float m = -INFINITY, s = 0.f, zsum = 0.f, dz;
  if constexpr (kVector) {
    for (int64_t i = threadIdx.x * kVec; i < c.cols; i += kThreads * kVec) {
      const Vec<T, kVec> v = LoadVec<T, kVec>(logits, i);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float z = Capped(ToFloat(v.v[j]), c.softcap, &dz);
        Fold(z, &m, &s);
        zsum += z;
      }
    }
  } else {
    for (int64_t i = threadIdx.x; i < c.cols; i += kThreads) {
      const float z = Capped(ToFloat(logits[i]), c.softcap, &dz);
      Fold(z, &m, &s);
      zsum += z;
    }
  }
  // Block reduction: warps, then the warps' results in warp 0 (fixed order: deterministic).
  for (int off = 16; off > 0; off /= 2) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, off);
    const float s2 = __shfl_xor_sync(0xffffffffu, s, off);
    zsum += __shfl_xor_sync(0xffffffffu, zsum, off);
    Merge(m2, s2, &m, &s);
  }
  __shared__ float sm[kThreads / 32], ss[kThreads / 32], sz[kThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    sm[warp] = m;
    ss[warp] = s;
    sz[warp] = zsum;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  m = sm[0];
  s = ss[0];
  zsum = sz[0];
  for (int w = 1; w < kThreads / 32; ++w) {
    Merge(sm[w], ss[w], &m, &s);
    zsum += sz[w];
  }
  const int64_t label = int64_t(c.labels[row]) - int64_t(*c.vocab_offset) - c.v0;
  const float zl =
      (label >= 0 && label < c.cols) ? Capped(ToFloat(logits[label]), c.softcap, &dz) : 0.f;
  if (first) {
    m_run[row] = m;
    s_run[row] = s;
    zlabel_run[row] = zl;
    zsum_run[row] = zsum;
  } else {
    float mr = m_run[row], sr = s_run[row];
    Merge(m, s, &mr, &sr);
    m_run[row] = mr;
    s_run[row] = sr;
    zlabel_run[row] += zl;
    zsum_run[row] += zsum;
  }
}

__global__ void Finish(int64_t rows, bool empty, const float* m, const float* s, float* lse,
                       float* zlabel, float* zsum) {
  const int64_t row = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= rows) return;
  if (empty) {
    lse[row] = -INFINITY;
    zlabel[row] = 0.f;
    zsum[row] = 0.f;
  } else {
    lse[row] = m[row] + logf(s[row]);
  }
}

template <typename T, bool kVector>
__global__ void __launch_bounds__(kThreads)
    ChunkGrad(LceChunk c, const float* lse, const float* dloss, float ls, float uniform) {
  constexpr int kVec = 16 / sizeof(T);
  const int64_t row = blockIdx.x;
  T* logits = static_cast<T*>(const_cast<void*>(c.logits)) + row * c.cols;
  const float g = dloss[row];
  const float top = lse[row];
  const int64_t label = int64_t(c.labels[row]) - int64_t(*c.vocab_offset) - c.v0;
  auto grad = [&](float l, int64_t col) {
    if (g == 0.f) return 0.f;
    float dz;
    const float z = Capped(l, c.softcap, &dz);
    const float target = (col == label ? 1.f - ls : 0.f) + uniform;
    return g * (__expf(z - top) - target) * dz;
  };
  if constexpr (kVector) {
    for (int64_t i = threadIdx.x * kVec; i < c.cols; i += kThreads * kVec) {
      Vec<T, kVec> v = LoadVec<T, kVec>(logits, i);
#pragma unroll
      for (int j = 0; j < kVec; ++j) v.v[j] = FromFloat<T>(grad(ToFloat(v.v[j]), i + j));
      StoreVec<T, kVec>(logits, i, v);
    }
  } else {
    for (int64_t i = threadIdx.x; i < c.cols; i += kThreads) {
      logits[i] = FromFloat<T>(grad(ToFloat(logits[i]), i));
    }
  }
}

bool Vectorizable(const LceChunk& c, int elem_bytes) {
  return (c.cols * elem_bytes) % 16 == 0 && reinterpret_cast<uintptr_t>(c.logits) % 16 == 0;
}

}  // namespace

cudaError_t LaunchLceChunkStats(const LceChunk& c, bool first, float* m, float* s, float* zlabel,
                                float* zsum, cudaStream_t stream) {
  if (c.rows == 0 || c.cols == 0) return cudaSuccess;
  const cudaError_t status = JAXGPU_DTYPE_SWITCH(c.dtype, T, kFloatDTypes, [&] {
    return JAXGPU_BOOL_SWITCH(Vectorizable(c, sizeof(T)), kVector, [&] {
      ChunkStats<T, kVector>
          <<<static_cast<unsigned>(c.rows), kThreads, 0, stream>>>(c, first, m, s, zlabel, zsum);
      return cudaGetLastError();
    });
  });
  return status;
}

cudaError_t LaunchLceFinish(int64_t rows, bool empty, const float* m, const float* s, float* lse,
                            float* zlabel, float* zsum, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>((rows + kThreads - 1) / kThreads);
  Finish<<<blocks, kThreads, 0, stream>>>(rows, empty, m, s, lse, zlabel, zsum);
  return cudaGetLastError();
}

cudaError_t LaunchLceChunkGrad(const LceChunk& c, const float* lse, const float* dloss,
                               float label_smoothing, int64_t vocab_total, cudaStream_t stream) {
  if (c.rows == 0 || c.cols == 0) return cudaSuccess;
  const float uniform = label_smoothing / float(vocab_total);
  const cudaError_t status = JAXGPU_DTYPE_SWITCH(c.dtype, T, kFloatDTypes, [&] {
    return JAXGPU_BOOL_SWITCH(Vectorizable(c, sizeof(T)), kVector, [&] {
      ChunkGrad<T, kVector><<<static_cast<unsigned>(c.rows), kThreads, 0, stream>>>(
          c, lse, dloss, label_smoothing, uniform);
      return cudaGetLastError();
    });
  });
  return status;
}

}  // namespace jaxgpu::cuda
