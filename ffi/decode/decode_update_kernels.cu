// The in-place update of a paged KV cache: each new token's K and V rows copied to their
// slot, or, for an 8-bit cache, quantized there with their scales (see decode_params.h for
// the semantics and the quantization rule).
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "common/cuda_dispatch.cuh"
#include "common/cuda_utils.cuh"
#include "decode/decode_cuda.h"
#include "decode/decode_slot.cuh"

namespace jaxgpu::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxHeadDim = 256;
constexpr int kPerLane = kMaxHeadDim / 32;

// The pool slot (group x P + page) x S + slot of new token `token` ((group x B + row) x Tn
// + t, below 2^31: the grid), or -1 when its position or its page entry is out of range
// (the token is skipped). 32-bit divisions: positions are int32 and the table's dimensions
// below 2^31, and a 64-bit division is a ~70-instruction routine on the path of a kernel
// that copies a few KB.
template <typename Params>
__device__ __forceinline__ int64_t TokenSlot(const Params& p, int64_t token) {
  const uint32_t r = uint32_t(token) / uint32_t(p.new_len);
  const int64_t g = r / uint32_t(p.batch);
  // Without positions (paged_attention_with_update) the token is the query token t of its
  // row, at lengths[r] - Tn + t; int64, so that a traced length near INT32_MIN cannot wrap.
  const int64_t pos = p.positions != nullptr ? int64_t(p.positions[token])
                                             : int64_t(p.lengths[r]) - p.new_len +
                                                   (uint32_t(token) - r * uint32_t(p.new_len));
  return decode::PoolSlot(pos, p.block_table + int64_t(r) * p.max_pages, p.max_pages, p.page_size,
                          p.num_pages, g * p.num_pages);
}

// One block per new token: its K and V rows (K x H values each) copied to their slot in
// 16-byte vectors.
__global__ void __launch_bounds__(kThreads)
    PagedKvUpdateKernel(const PagedKvUpdateParams p, int64_t token_bytes) {
  const int64_t token = blockIdx.x;
  const int64_t slot = TokenSlot(p, token);
  if (slot < 0) return;
  const int64_t vecs = token_bytes / 16;
  const uint4* k_src =
      reinterpret_cast<const uint4*>(static_cast<const char*>(p.k_new) + token * token_bytes);
  const uint4* v_src =
      reinterpret_cast<const uint4*>(static_cast<const char*>(p.v_new) + token * token_bytes);
  uint4* k_dst = reinterpret_cast<uint4*>(static_cast<char*>(p.k_pages) + slot * token_bytes);
  uint4* v_dst = reinterpret_cast<uint4*>(static_cast<char*>(p.v_pages) + slot * token_bytes);
  for (int64_t i = threadIdx.x; i < vecs; i += kThreads) {
    k_dst[i] = k_src[i];
    v_dst[i] = v_src[i];
  }
}

template <typename Q>
__device__ __forceinline__ Q Quantize(float y);

// Round half to even (as jnp.round and std::nearbyint), then clamp to the symmetric range.
template <>
__device__ __forceinline__ int8_t Quantize<int8_t>(float y) {
  return static_cast<int8_t>(min(max(__float2int_rn(y), -127), 127));
}

// Round to nearest even; the clip makes the saturation explicit (as the reference's).
template <>
__device__ __forceinline__ __nv_fp8_e4m3 Quantize<__nv_fp8_e4m3>(float y) {
  __nv_fp8_e4m3 out;
  out.__x = __nv_cvt_float_to_fp8(fminf(fmaxf(y, -448.f), 448.f), __NV_SATFINITE, __NV_E4M3);
  return out;
}

// 8-bit cache: one block per new token, one warp per (K or V, kv head) row of H <= 256
// values: max|x| over the row (a warp reduction; max is exact, so the order does not
// matter), scale = max / Qmax, then each value divided by the scale (an IEEE division,
// __fdiv_rn even under fast math: the CPU handler and the reference divide too, and all
// three must round identically) and converted.
template <typename T, typename Q>
__global__ void __launch_bounds__(kThreads) PagedKvUpdateQ8Kernel(const PagedKvUpdateParams p) {
  constexpr float kQmax = std::is_same_v<Q, int8_t> ? 127.f : 448.f;
  const int64_t token = blockIdx.x;
  const int64_t slot = TokenSlot(p, token);
  if (slot < 0) return;
  const int64_t K = p.kv_heads, H = p.head_dim;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t row = warp; row < 2 * K; row += kWarps) {
    const bool is_v = row >= K;
    const int64_t k = is_v ? row - K : row;
    const T* src = static_cast<const T*>(is_v ? p.v_new : p.k_new) + (token * K + k) * H;
    Q* dst = static_cast<Q*>(is_v ? p.v_pages : p.k_pages) + (slot * K + k) * H;
    float x[kPerLane];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int64_t h = lane + 32 * i;
      x[i] = h < H ? ToFloat(src[h]) : 0.f;
      amax = fmaxf(amax, fabsf(x[i]));
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    }
    const float scale = __fdiv_rn(amax, kQmax);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int64_t h = lane + 32 * i;
      if (h < H) dst[h] = Quantize<Q>(scale > 0.f ? __fdiv_rn(x[i], scale) : 0.f);
    }
    if (lane == 0) (is_v ? p.v_scale : p.k_scale)[slot * K + k] = scale;
  }
}

}  // namespace

cudaError_t LaunchPagedKvUpdate(const PagedKvUpdateParams& p, cudaStream_t stream) {
  const int64_t tokens = p.groups * p.batch * p.new_len;
  if (tokens == 0 || p.num_pages == 0 || p.max_pages == 0) return cudaSuccess;
  if (tokens > INT32_MAX) return cudaErrorInvalidConfiguration;
  if (p.kv_dtype == DType::kS8 || p.kv_dtype == DType::kF8E4M3) {
    if (p.k_scale == nullptr || p.v_scale == nullptr || p.head_dim > kMaxHeadDim) {
      return cudaErrorInvalidValue;
    }
    const cudaError_t status = JAXGPU_DTYPE_SWITCH(p.dtype, T, kFloatDTypes, [&] {
      constexpr DTypeSet kQ8 = DTypeBit(DType::kS8) | DTypeBit(DType::kF8E4M3);
      return JAXGPU_DTYPE_SWITCH(p.kv_dtype, Q, kQ8, [&] {
        PagedKvUpdateQ8Kernel<T, Q><<<unsigned(tokens), kThreads, 0, stream>>>(p);
        return cudaSuccess;
      });
    });
    if (status != cudaSuccess) return status;
    return cudaGetLastError();
  }
  if (p.kv_dtype != p.dtype) return cudaErrorInvalidValue;
  // K x H is a multiple of 8 values (H is): a whole number of 16-byte vectors per token.
  const int64_t token_bytes = DTypeBytes(p.dtype, p.kv_heads * p.head_dim);
  if (token_bytes % 16 != 0) return cudaErrorInvalidValue;
  PagedKvUpdateKernel<<<unsigned(tokens), kThreads, 0, stream>>>(p, token_bytes);
  return cudaGetLastError();
}

}  // namespace jaxgpu::cuda
