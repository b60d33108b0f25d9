// CUDA kernels of the fused linear + cross-entropy (linear_cross_entropy_kernels.cu; no XLA
// types): the per-chunk row statistics and gradients around the cuBLASLt products that
// linear_cross_entropy_handlers_cuda.cc runs.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/dtype.h"

namespace jaxgpu::cuda {

// One chunk of logits (rows, cols) row-major in `dtype`, columns v0 .. v0 + cols - 1 of the
// slice: folds each row's softcapped max, rescaled sum of exponentials, label logit and
// logit sum into the running (m, s, zlabel, zsum) (initialized when first).
struct LceChunk {
  DType dtype;
  const void* logits;  // stats: read; grad: read, then overwritten with dlogits
  int64_t rows, cols, v0;
  const int32_t* labels;        // (rows,) global ids
  const int32_t* vocab_offset;  // device int32: the slice's first global id
  float softcap;
};

cudaError_t LaunchLceChunkStats(const LceChunk& c, bool first, float* m, float* s, float* zlabel,
                                float* zsum, cudaStream_t stream);
// lse = m + log(s) per row (-inf for an empty slice, and zlabel = zsum = 0 then).
cudaError_t LaunchLceFinish(int64_t rows, bool empty, const float* m, const float* s, float* lse,
                            float* zlabel, float* zsum, cudaStream_t stream);
// dlogits = dloss (exp(z - lse) - (1 - ls) [v == label] - ls / vocab_total) dz/dlogit, in
// place of the chunk's logits.
cudaError_t LaunchLceChunkGrad(const LceChunk& c, const float* lse, const float* dloss,
                               float label_smoothing, int64_t vocab_total, cudaStream_t stream);

}  // namespace jaxgpu::cuda
