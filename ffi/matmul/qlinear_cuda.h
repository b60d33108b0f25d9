// The CUDA launcher of the weight-only quantized linear layer (qlinear_kernels.cu): int4 or
// int8 weights in the packed layout of qlinear_params.h, bf16 or f16 activations. No XLA
// types.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "matmul/qlinear_params.h"

namespace jaxgpu::cuda {

// y = act(x w + bias) (qlinear_params.h's math) on `stream`: one kernel, plus a small
// reduction kernel when K is split across blocks (split-K partial sums go to p.workspace,
// float32, at most p.workspace_floats of them; any size >= 0 works, a smaller one means
// fewer splits, 0 none). p.dtype must be bf16 or f16 (cudaErrorInvalidValue otherwise),
// p.bits 4 or 8, p.packed 16-byte aligned. No allocation, no synchronization, no copies:
// safe inside CUDA graph capture. Results are bitwise reproducible run to run.
cudaError_t LaunchQLinear(const QLinearParams& p, cudaStream_t stream);

// Which kernel LaunchQLinearPath runs. kAuto: the GEMV kernel (weights straight into
// registers) where QLinearGemvEligible(p) and it measured faster (int4 with a short last K
// split takes the staged kernel); from 9 rows the Hopper kernel (wgmma, sm_90a) where it
// can serve p; else the staged kernel (cp.async ring through shared memory); in a
// JAXGPU_DEV_KNOBS build JAXGPU_QLINEAR_GEMV=-1 takes the GEMV kernel out. kStaged: the
// staged kernel; kGemv: the GEMV kernel wherever it is eligible; kWgmma: the Hopper kernel
// wherever it can serve p (any M). All follow qlinear_params.h's math exactly; their float32
// sums run in different orders.
enum class QLinearPath : int { kAuto = 0, kStaged = 1, kGemv = 2, kWgmma = 3 };
cudaError_t LaunchQLinearPath(const QLinearParams& p, cudaStream_t stream, QLinearPath path);

// Whether the GEMV kernel serves p: M <= 8 (int8: 16) and group_size a multiple of 64 or K.
bool QLinearGemvEligible(const QLinearParams& p);

// Whether the Hopper kernel serves p (on this build and the current device).
bool QLinearWgmmaEligible(const QLinearParams& p);

// The float32 workspace LaunchQLinear can use for (groups, m, n) outputs: at most 32
// splits of groups x m x n partial sums, capped at 2^22 floats (16 MiB); 0 for an empty
// output. Passing less is allowed (fewer splits).
int64_t QLinearWorkspaceFloats(int64_t groups, int64_t m, int64_t n);

// w = the dense weight of p's packed one (qdequant_kernels.cu): one block per 16 x 64 tile.
cudaError_t LaunchQDequant(const QDequantParams& p, cudaStream_t stream);

}  // namespace jaxgpu::cuda
