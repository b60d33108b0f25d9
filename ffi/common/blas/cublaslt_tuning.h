// Timing of cuBLASLt's candidate algorithms for one plan, so that a plan runs the fastest of
// the heuristic's top answers rather than its first. On an H100 (bf16, docs/perf/matmul.md)
// the first answer ran 8192^3 in 1597 us against 1529 for the fastest of the top 8, and left
// plain GEMMs at 0.93-0.98x XLA's autotuned ones, where the tuned plans run at 0.99-1.02x.
//
// The timing runs on scratch operands (random values, never the caller's buffers, which may
// alias with beta != 0) on a private stream, from a helper thread: XLA may be capturing the
// calling thread's stream into a CUDA graph (thread-local capture mode), where a
// synchronization or an allocation on that thread would invalidate the capture.
#pragma once

#include <cublasLt.h>

#include <vector>

#include "common/blas/cublaslt_plans.h"

namespace jaxgpu::blas {

struct PlanDescriptors {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
};

// How many of the heuristic's answers a plan asks for and times: 8 (cuBLASLt orders them by
// its own estimate). The developer knob
// JAXGPU_CUBLASLT_TUNE=<count> overrides it (1: the heuristic's first answer, untimed).
int CandidateCount();

// The index of the fastest of `candidates` for `key`, timed as described above; -1 when the
// timing could not run (no scratch memory, or every candidate failed): the caller keeps the
// heuristic's first answer. Sets the descriptor's per-call pointers (bias, aux, scales) to
// scratch: the caller sets its own before its next call, under the plan's lock.
int FastestCandidate(const GemmKey& key, cublasLtHandle_t handle, const PlanDescriptors& plan,
                     const std::vector<cublasLtMatmulAlgo_t>& candidates);

}  // namespace jaxgpu::blas
