// CUDA launchers of the softmax family (no XLA types), and the design of its kernels:
// softmax (optional scale, causal mask and broadcast boolean mask), forward and backward.
//
// Napkin math (H100, 16384 x 8192 bf16, N = 256 MiB): the forward pass must read x and write
// y (2N = 512 MiB, ~0.18 ms at the ~3.0 TB/s a device copy reaches); the backward pass reads
// y and dy and writes dx (3N, ~0.27 ms). A broadcast mask adds its own bytes only (a
// (T, S) mask under (B, H, T, S) logits: 1/(B*H) of them). Everything here is memory-bound:
// one read of each input, 16-byte accesses, enough bytes in flight per SM.
//
// Row mapping (as the norm kernels, ffi/norm/norm_kernels.cu): a row of S elements is
// split into 16-byte vectors of VEC elements; `tpr` threads (a power of two) share a row,
// thread t owning vectors t, t + tpr, ...; rows narrower than 256 threads share a block
// (blockDim.y rows). The forward pass over rows of whole 16-byte vectors, up to 4096 of
// them, takes the one-pass kernel (version 2, SoftmaxFwdRegs: one
// exp per element, one reduction per row; softmax_fwd_regs.cuh). Otherwise two kernels per
// pass (softmax_fwd_kernels.cuh, softmax_bwd_kernels.cuh):
//   staged  the row cp.async'ed into shared memory (scalar loads when S is not a whole
//           number of vectors), then every pass reads it from there: one read of x. The
//           norm kernels measured why: rows held in registers (66-128 registers a thread)
//           reached 2.0-2.4 TB/s, cp.async-staged rows at 40 registers 2.89 TB/s.
//   loop    rows wider than staged allows (more than 8 vectors a thread at 1024 threads,
//           or over the shared memory): one row per 1024-thread block, an online
//           (max, sum) pass and a write pass, so x is read twice (the second mostly from L2).
//
// The staged forward pass (version 1) is three passes over the staged row: max of the kept
// logits, sum of exp(logit - max), write exp(logit - max) / sum. Each reduction runs in a
// fixed order, so results are bitwise reproducible. Which elements are kept (mask & causal)
// is computed once per thread, before the copies land, into a bit mask in registers (one
// bit per element it owns: at most 8 vectors of at most 8 elements).
//
// Semantics at the edges (the same in softmax_cpu.cc and jaxgpu/reference/softmax.py): a
// row with nothing kept, or whose kept logits are all -inf, is all zeros (the max is taken
// as 0, so every exp is 0 and the sum is 0, and 1/sum is replaced by 0); a kept NaN or +inf
// logit makes its row NaN.
//
// Files: softmax_fwd.cu, softmax_bwd.cu (the launchers: which kernel, what configuration),
// softmax_launch.cuh (what both launchers share: the developer knob, the staged
// configuration), softmax_device.cuh (device pieces every kernel shares), softmax_mask.cuh
// (which elements a forward row keeps), and the kernels in softmax_fwd_regs.cuh,
// softmax_fwd_kernels.cuh and softmax_bwd_kernels.cuh.
#pragma once

#include <cuda_runtime_api.h>

#include "softmax/softmax_params.h"

namespace jaxgpu::cuda {

cudaError_t LaunchSoftmaxFwd(const SoftmaxFwdParams& p, cudaStream_t stream);
cudaError_t LaunchSoftmaxBwd(const SoftmaxBwdParams& p, cudaStream_t stream);

}  // namespace jaxgpu::cuda
