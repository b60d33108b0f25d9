// cuBLASLt for FFI handlers: one handle per device (created on first use) and a cache of
// matmul plans, so that a handler pays for cuBLASLt's descriptors and its algorithm
// heuristic once per problem, not per call. No XLA types; no allocation on the device: the
// workspace is a caller's buffer (an FFI handler gets it as an extra output, planned by XLA
// like any buffer, also inside CUDA graphs).
//
// The GEMM is cuBLASLt's, column-major: D = epilogue(alpha * op(A) op(B) + beta * C), with
// op(A) m x k, op(B) k x n, C and D m x n, each matrix packed (leading dimension = its rows
// as stored) unless GemmKey's lda / ldb / ldd say otherwise, and `batch` of them at packed
// strides. A row-major product Y = X W (what JAX
// holds) is the column-major Y^T = W^T X^T: swap the operands and m / n.
//
// Thread safety: every function may be called from any thread, for any device. Handles and
// plans live until the process exits (destroying them at exit races CUDA's own teardown).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "common/dtype.h"

namespace jaxgpu::blas {

// A failure with its cause, for the handler's ffi::Error; never an abort.
class Status {
 public:
  static Status Ok() { return Status(); }
  static Status Error(std::string message) { return Status(std::move(message)); }
  bool ok() const { return message_.empty(); }
  const std::string& message() const { return message_; }

 private:
  Status() = default;
  explicit Status(std::string message) : message_(std::move(message)) {}
  std::string message_;
};

// Everything a plan depends on: two calls with equal keys share the plan.
struct GemmKey {
  int device = 0;  // CUDA device ordinal
  int64_t m = 0, n = 0, k = 0;
  int64_t batch = 1;     // matrices per operand, at packed strides
  bool trans_a = false;  // op(A) = A^T: A is stored k x m
  bool trans_b = false;  // op(B) = B^T: B is stored n x k
  DType a_type = DType::kBF16, b_type = DType::kBF16;
  DType c_type = DType::kBF16, d_type = DType::kBF16;
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;  // alpha and beta: float (int32 for 32I)
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  bool has_bias = false;  // a bias vector (an epilogue with BIAS or BGRAD)
  DType bias_type = DType::kBF16;
  bool has_aux = false;  // an auxiliary output or input (GELU_AUX, DGELU)
  DType aux_type = DType::kBF16;
  int64_t workspace_bytes = 0;  // the workspace every call of this plan passes
  int alignment = 256;          // bytes every operand pointer is aligned to (power of 2)
  // Leading dimensions (elements between columns as stored) of A, B and of C and D; 0 for
  // packed. A column block of a wider matrix (a vocabulary chunk of a (D, V) weight) is
  // that matrix's leading dimension over the block's first column. Not with batch > 1.
  int64_t lda = 0, ldb = 0, ldd = 0;

  bool operator==(const GemmKey& o) const;
};

// Device pointers of one call. alpha and beta point to host scalars of the compute type's
// scale type (float; int32_t for CUBLAS_COMPUTE_32I). Scales (fp8): device floats, or null.
struct GemmOperands {
  const void* a = nullptr;
  const void* b = nullptr;
  const void* c = nullptr;  // may alias d; null with beta == 0 reads d's layout only
  void* d = nullptr;
  const void* bias = nullptr;  // when key.has_bias
  void* aux = nullptr;         // when key.has_aux: m x n, leading dimension m
  const float* a_scale = nullptr;
  const float* b_scale = nullptr;
  const float* d_scale = nullptr;
  const void* alpha = nullptr;
  const void* beta = nullptr;
  void* workspace = nullptr;  // key.workspace_bytes bytes (null when 0)
};

// The largest power of two up to 256 that divides every non-null pointer: GemmKey::alignment.
int PointerAlignment(std::initializer_list<const void*> pointers);

// cuBLASLt's type for a DType (false: cuBLASLt has none).
bool ToCudaDataType(DType t, cudaDataType_t* out);

// The device's cuBLASLt handle, created on first use.
Status Handle(int device, cublasLtHandle_t* out);

// Builds (once per key) and runs the plan of `key` on `stream`.
Status Matmul(const GemmKey& key, const GemmOperands& ops, cudaStream_t stream);

// Plans in the cache (a self-check reads it: equal keys must not add one).
size_t CachedPlanCount();

}  // namespace jaxgpu::blas
