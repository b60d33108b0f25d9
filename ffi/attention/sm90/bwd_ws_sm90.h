// The warp-specialized attention backward (bwd_ws_sm90.cu): one kernel computing dK, dV
// and dQ with 5 products per step, TMA-fed, dQ added into a float32 accumulator by the copy
// engine; then a conversion of that accumulator into dq. No XLA types.
//
// Workspace the caller provides, both ZEROED before every call (cudaMemsetAsync on the
// stream is enough; the kernel leaves them dirty):
//   dq_accum       BwdDqAccumBytes(p) bytes: float32 in q's shape (B, T, N, H), N = K * R.
//   dq_semaphores  BwdSemaphoreBytes(p) bytes: one int per (batch, query head, 64-query
//                  tile); read only when deterministic (may be nullptr otherwise).
// p.delta must hold rowsum(dO * O) (attention_delta.cu's LaunchDelta) and p.lse the
// forward's natural-log LSE, as for the existing backward kernels.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "attention/attention_params.h"

namespace jaxgpu::cuda::attention::sm90 {

// Why the kernel cannot run a call (nullptr: it can).
const char* WarpSpecializedBwdUnavailable(const AttentionParams& p);

inline size_t BwdDqAccumBytes(const AttentionParams& p) {
  return static_cast<size_t>(p.batch * p.q_len * p.kv_heads * p.group * p.head_dim) * 4;
}
inline size_t BwdSemaphoreBytes(const AttentionParams& p) {
  return static_cast<size_t>(p.batch * p.kv_heads * p.group * ((p.q_len + 63) / 64)) * 4;
}

// The main kernel then the conversion: writes p.dk, p.dv and p.dq. deterministic: the adds
// into each element of dq_accum happen in a fixed order (bitwise reproducible dq), through
// dq_semaphores. cudaErrorNotSupported where WarpSpecializedBwdUnavailable says so.
cudaError_t LaunchBwdWarpSpecialized(const AttentionParams& p, float* dq_accum, int* dq_semaphores,
                                     cudaStream_t stream, bool deterministic);

// The two launches of LaunchBwdWarpSpecialized on their own (to time them apart).
cudaError_t LaunchBwdWarpSpecializedMain(const AttentionParams& p, float* dq_accum,
                                         int* dq_semaphores, cudaStream_t stream,
                                         bool deterministic);
// p.dq = dq_accum * p.scale, rounded to p.dtype (the kernel adds dS K in the units of the
// scaled logits and leaves the scale to this pass).
cudaError_t LaunchDqAccumConvert(const AttentionParams& p, const float* dq_accum,
                                 cudaStream_t stream);

}  // namespace jaxgpu::cuda::attention::sm90
