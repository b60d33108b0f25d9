// Device helpers shared by the CUDA kernels: vector load/store, float conversion of the
// storage types, and deterministic row reductions. No XLA types. Includes the dispatch
// vocabulary (JAXGPU_DTYPE_SWITCH, JAXGPU_INT_SWITCH, JAXGPU_BOOL_SWITCH).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/cuda_dispatch.cuh"
#include "common/dtype.h"

namespace jaxgpu::cuda {

// N elements of T moved as one access: 16 bytes for N * sizeof(T) == 16, the widest
// load a thread can issue (LDG.128), which memory-bound kernels need to reach HBM rate.
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__half x) { return __half2float(x); }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T FromFloat(float x);
template <>
__device__ __forceinline__ float FromFloat<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

template <typename T, int N>
__device__ __forceinline__ Vec<T, N> LoadVec(const void* base, int64_t elem) {
  return *reinterpret_cast<const Vec<T, N>*>(static_cast<const T*>(base) + elem);
}

template <typename T, int N>
__device__ __forceinline__ void StoreVec(void* base, int64_t elem, const Vec<T, N>& v) {
  *reinterpret_cast<Vec<T, N>*>(static_cast<T*>(base) + elem) = v;
}

// Streaming variants for data touched once (activations): evict-first (.cs), so a pass
// over a tensor larger than L2 does not push out what is reused (weights, partials).
template <typename T, int N>
__device__ __forceinline__ Vec<T, N> LoadVecStream(const void* base, int64_t elem) {
  const Vec<T, N>* ptr = reinterpret_cast<const Vec<T, N>*>(static_cast<const T*>(base) + elem);
  if constexpr (sizeof(Vec<T, N>) == 16) {
    const uint4 u = __ldcs(reinterpret_cast<const uint4*>(ptr));
    return *reinterpret_cast<const Vec<T, N>*>(&u);
  } else {
    return *ptr;
  }
}

template <typename T, int N>
__device__ __forceinline__ void StoreVecStream(void* base, int64_t elem, const Vec<T, N>& v) {
  Vec<T, N>* ptr = reinterpret_cast<Vec<T, N>*>(static_cast<T*>(base) + elem);
  if constexpr (sizeof(Vec<T, N>) == 16) {
    __stcs(reinterpret_cast<uint4*>(ptr), *reinterpret_cast<const uint4*>(&v));
  } else {
    *ptr = v;
  }
}

// Sum of `v` over the `tpr` threads (a power of two) that share threadIdx.y: shuffles
// within the warp, then one shared-memory step across the row's warps. The order of the
// additions is fixed, so the result is bitwise reproducible. `scratch` holds 32 floats
// per threadIdx.y. Every thread of the block must call it (it may __syncthreads).
template <int N>
__device__ __forceinline__ void RowSum(float (&v)[N], float* scratch, int tpr) {
  const int width = tpr < 32 ? tpr : 32;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    for (int o = width / 2; o > 0; o >>= 1) v[i] += __shfl_xor_sync(0xffffffffu, v[i], o);
  }
  if (tpr <= 32) return;
  const int warps = tpr / 32;
  float* row = scratch + threadIdx.y * 32 * N;
  if ((threadIdx.x & 31) == 0) {
#pragma unroll
    for (int i = 0; i < N; ++i) row[i * 32 + threadIdx.x / 32] = v[i];
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < N; ++i) {
    float s = 0.f;
    for (int w = 0; w < warps; ++w) s += row[i * 32 + w];
    v[i] = s;
  }
  __syncthreads();  // the scratch may be reused by the next reduction
}

// Asynchronous 16-byte global -> shared copies (sm_80+), bypassing L1 (.cg): a thread
// stages data without holding it in registers, so many rows can be in flight per SM.
// A thread may read what it copied itself after CpAsyncWait; other threads need a barrier.
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem) : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

inline int NextPow2(int64_t n) {
  int p = 1;
  while (p < n) p <<= 1;
  return p;
}

__host__ __device__ inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Dynamic shared memory a block of a kernel may opt into (227 KiB on H100), less the
// kernel's `static_bytes` of static shared memory (both count against the same limit).
inline int64_t MaxStagedBytes(int64_t static_bytes) {
  int device = 0, bytes = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
          cudaSuccess) {
    return 48 * 1024 - static_bytes;
  }
  return bytes - static_bytes;
}

// The current device's multiprocessor count; 0 if the query fails.
inline int SmCount() {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return 0;
  }
  return sms;
}

// Opts `kernel` into `bytes` of dynamic shared memory: needed above the default 48 KiB.
template <typename Kernel>
cudaError_t AllowSmem(Kernel kernel, int64_t bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
}

}  // namespace jaxgpu::cuda
