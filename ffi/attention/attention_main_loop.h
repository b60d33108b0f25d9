// What a main loop of the attention kernels provides to the one dispatcher
// (attention_dispatch.cu): a main loop is an architecture's way of computing the products,
// with its own kernels for the forward, dQ and dK/dV. No XLA types.
//
// The family's files:
//   attention_targets.h, attention_handlers*.{h,cc}  FFI targets, contract and handlers
//   attention_params.h, attention_path.h             launch parameters; the main-loop choice
//   attention_cpu.{h,cc}                             the CPU kernels
//   attention_cuda.h, attention_dispatch.cu          CUDA host API; the one dispatcher
//   attention_{mask,logits,softmax,schedule}.cuh     device code every main loop shares,
//   attention_{fragments,copy,launch}.cuh            and the launch helpers
//   attention_delta.cu                               the backward's shared first kernel
//   sm80/, sm90/                                     a main loop each: mma.sync, wgmma
//                                                    (main_loop.h: its kMainLoop)
#pragma once

#include <cuda_runtime_api.h>

#include "attention/attention_params.h"

namespace jaxgpu::cuda::attention {

struct MainLoop {
  // Why the main loop cannot run `p` in this build on the current device (a static
  // message), or nullptr.
  const char* (*unavailable)(const AttentionParams& p);
  // Launchers, for parameters that passed `unavailable` and CheckLaunchable
  // (attention_launch.cuh): the forward and dQ need at least one query row, dK/dV at least
  // one key. dQ and dK/dV read delta (LaunchDelta, launched before them).
  cudaError_t (*fwd)(const AttentionParams& p, cudaStream_t stream);
  cudaError_t (*dq)(const AttentionParams& p, cudaStream_t stream);
  cudaError_t (*dkv)(const AttentionParams& p, cudaStream_t stream);
  // The whole backward after delta in one pass where the main loop has one and it takes
  // `p` (nullptr, or cudaErrorNotSupported: dq then dkv run instead).
  cudaError_t (*fused_bwd)(const AttentionParams& p, cudaStream_t stream) = nullptr;
};

// The backward's first kernel, shared by every main loop (attention_delta.cu): delta =
// rowsum(dO * O) per query row, into the float32 workspace p.delta. At least one query row.
cudaError_t LaunchDelta(const AttentionParams& p, cudaStream_t stream);

}  // namespace jaxgpu::cuda::attention
