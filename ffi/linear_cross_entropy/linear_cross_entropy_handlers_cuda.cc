// CUDA FFI handlers of the fused linear + cross-entropy: the vocabulary in chunks, each a
// cuBLASLt product into one (rows, chunk) scratch of logits and a row kernel
// (linear_cross_entropy_kernels.cu). No syncs and no allocation: the scratch (logits chunk,
// running row sums, cuBLASLt's workspace) is a result XLA plans.
//
// Forward, per chunk: logits = x w_c^T, then the rows' running (max, sum of exp, label logit,
// logit sum). Backward, per chunk: the logits again, dlogits in place, then
// dx += dlogits w_c (float32, accumulated across chunks by the GEMM's beta) and
// dw_c = dlogits^T x (written once, float32 accumulation inside the GEMM). Every product
// accumulates in float32 and each output is rounded once: the backward pass recomputes the
// logits (one extra GEMM: 4 instead of 3 per step) rather than keep them.
//
// Row-major (JAX) to column-major (cuBLASLt), a row-major (R, C) being a column-major C x R:
//   logits^T (cols x rows) = op(w_c) x^T          vd: w_c stored D x cols, op T
//                                                 dv: w_c stored cols x D (ld V), op N
//   dx^T (D x rows)       += op(w_c) dlogits^T    vd: op N;  dv: op T (ld V)
//   vd: dw_c^T (D x cols)  = x^T dlogits          B = dlogits stored cols x rows, op T
//   dv: dw_c (cols x D, ld V) = dlogits^T x       B = x stored D x rows, op T
#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>

#include "common/blas/cublaslt_plans.h"
#include "common/cuda_status.h"
#include "linear_cross_entropy/linear_cross_entropy_cuda.h"
#include "linear_cross_entropy/linear_cross_entropy_handlers.h"
#include "linear_cross_entropy/linear_cross_entropy_targets.h"

namespace jaxgpu {
namespace {

constexpr int64_t kAlign = 256;
int64_t AlignUp(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

ffi::Error BlasError(const blas::Status& s, const char* what) {
  if (s.ok()) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(what) + ": " + s.message());
}

const char* At(const void* p, int64_t elements, DType t) {
  return static_cast<const char*>(p) + DTypeBytes(t, elements);
}
char* At(void* p, int64_t elements, DType t) {
  return static_cast<char*>(p) + DTypeBytes(t, elements);
}

// The scratch, carved: the logits chunk (rows x chunk), the running sums (forward), and the
// rest as cuBLASLt's workspace.
struct Scratch {
  void* logits;
  float* sums;
  void* workspace;
  int64_t workspace_bytes;
};

ffi::Error Carve(const LinearCrossEntropyShape& s, void* base, int64_t bytes, bool with_sums,
                 Scratch* out) {
  const int64_t logits = AlignUp(DTypeBytes(s.dtype, s.rows * std::min(s.chunk, s.vocab)));
  const int64_t sums = with_sums ? AlignUp(s.groups * s.rows * 4) : 0;
  if (logits + sums > bytes) {
    return ffi::Error::InvalidArgument("scratch: " + std::to_string(bytes) +
                                       " bytes, need >= " + std::to_string(logits + sums));
  }
  char* p = static_cast<char*>(base);
  out->logits = p;
  out->sums = with_sums ? reinterpret_cast<float*>(p + logits) : nullptr;
  out->workspace = p + logits + sums;
  out->workspace_bytes = bytes - logits - sums;
  return ffi::Error::Success();
}

blas::GemmKey Key(int device, const LinearCrossEntropyShape& s, int64_t m, int64_t n, int64_t k,
                  const Scratch& scratch) {
  blas::GemmKey key;
  key.device = device;
  key.m = m;
  key.n = n;
  key.k = k;
  key.a_type = key.b_type = key.c_type = key.d_type = s.dtype;
  key.compute = CUBLAS_COMPUTE_32F;
  key.workspace_bytes = scratch.workspace_bytes;
  return key;
}

blas::GemmOperands Operands(const Scratch& scratch, const float* beta) {
  static const float kOne = 1.f;
  blas::GemmOperands ops;
  ops.alpha = &kOne;
  ops.beta = beta;
  ops.workspace = scratch.workspace;
  return ops;
}

const float kZero = 0.f, kOne = 1.f;

// logits (rows, cols) of group g's chunk at column v0, into the scratch.
ffi::Error ChunkLogits(int device, const LinearCrossEntropyShape& s, const void* x, const void* w,
                       int64_t g, int64_t v0, int64_t cols, const Scratch& scratch,
                       cudaStream_t stream) {
  const bool vd = s.layout == WeightLayout::kVD;
  const int64_t wg = s.weight_groups > 1 ? g : 0;
  blas::GemmOperands ops = Operands(scratch, &kZero);
  ops.a = At(w, wg * s.vocab * s.dim + (vd ? v0 * s.dim : v0), s.dtype);
  ops.b = At(x, g * s.rows * s.dim, s.dtype);
  ops.d = scratch.logits;
  blas::GemmKey key = Key(device, s, cols, s.rows, s.dim, scratch);
  key.trans_a = vd;
  key.lda = vd ? 0 : s.vocab;
  key.alignment = blas::PointerAlignment({ops.a, ops.b, ops.d});
  return BlasError(blas::Matmul(key, ops, stream), "linear_cross_entropy logits");
}

cuda::LceChunk Chunk(const LinearCrossEntropyShape& s, const void* logits, int64_t g, int64_t v0,
                     int64_t cols, const int32_t* labels, const int32_t* offset, float softcap) {
  return cuda::LceChunk{s.dtype, logits, s.rows, cols, v0, labels + g * s.rows, offset, softcap};
}

ffi::Error FwdCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer labels,
                   ffi::AnyBuffer vocab_ids, ffi::Result<ffi::AnyBuffer> lse,
                   ffi::Result<ffi::AnyBuffer> zlabel, ffi::Result<ffi::AnyBuffer> zsum,
                   ffi::Result<ffi::AnyBuffer> scratch_buf, float softcap, int32_t w_layout,
                   int64_t chunk) {
  LinearCrossEntropyFwdParams p;
  JAXGPU_RETURN_IF_ERROR(MakeLinearCrossEntropyFwdParams(
      x, w, labels, vocab_ids, lse, zlabel, zsum, scratch_buf, softcap, w_layout, chunk, &p));
  const LinearCrossEntropyShape& s = p.s;
  const int64_t n = s.groups * s.rows;
  if (n == 0) return ffi::Error::Success();
  Scratch scratch;
  JAXGPU_RETURN_IF_ERROR(Carve(s, p.scratch, p.scratch_bytes, true, &scratch));
  int device;
  JAXGPU_RETURN_IF_ERROR(CudaStatus(cudaGetDevice(&device), "cudaGetDevice"));
  for (int64_t g = 0; g < s.groups && s.vocab > 0; ++g) {
    for (int64_t v0 = 0; v0 < s.vocab; v0 += s.chunk) {
      const int64_t cols = std::min(s.chunk, s.vocab - v0);
      JAXGPU_RETURN_IF_ERROR(ChunkLogits(device, s, p.x, p.w, g, v0, cols, scratch, stream));
      const int64_t at = g * s.rows;
      JAXGPU_RETURN_IF_ERROR(CudaStatus(
          cuda::LaunchLceChunkStats(
              Chunk(s, scratch.logits, g, v0, cols, p.labels, p.vocab_offset, p.softcap), v0 == 0,
              p.lse + at, scratch.sums + at, p.zlabel + at, p.zsum + at, stream),
          "linear_cross_entropy chunk statistics"));
    }
  }
  return CudaStatus(
      cuda::LaunchLceFinish(n, s.vocab == 0, p.lse, scratch.sums, p.lse, p.zlabel, p.zsum, stream),
      "linear_cross_entropy finish");
}

ffi::Error BwdCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer labels,
                   ffi::AnyBuffer vocab_ids, ffi::AnyBuffer lse, ffi::AnyBuffer dloss,
                   ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dw,
                   ffi::Result<ffi::AnyBuffer> scratch_buf, float softcap, float label_smoothing,
                   int64_t vocab_total, int32_t w_layout, int64_t chunk) {
  LinearCrossEntropyBwdParams p;
  JAXGPU_RETURN_IF_ERROR(MakeLinearCrossEntropyBwdParams(x, w, labels, vocab_ids, lse, dloss, dx,
                                                         dw, scratch_buf, softcap, label_smoothing,
                                                         vocab_total, w_layout, chunk, &p));
  const LinearCrossEntropyShape& s = p.s;
  if (s.groups == 0) return ffi::Error::Success();
  if (s.rows == 0 || s.vocab == 0 || s.dim == 0) {
    // Nothing flows: the gradients are zeros.
    JAXGPU_RETURN_IF_ERROR(CudaStatus(
        cudaMemsetAsync(p.dx, 0, DTypeBytes(DType::kF32, s.groups * s.rows * s.dim), stream),
        "cudaMemsetAsync"));
    return CudaStatus(
        cudaMemsetAsync(p.dw, 0, DTypeBytes(s.dtype, s.groups * s.vocab * s.dim), stream),
        "cudaMemsetAsync");
  }
  Scratch scratch;
  JAXGPU_RETURN_IF_ERROR(Carve(s, p.scratch, p.scratch_bytes, false, &scratch));
  int device;
  JAXGPU_RETURN_IF_ERROR(CudaStatus(cudaGetDevice(&device), "cudaGetDevice"));
  const bool vd = s.layout == WeightLayout::kVD;
  for (int64_t g = 0; g < s.groups; ++g) {
    const int64_t wg = s.weight_groups > 1 ? g : 0;
    float* dx_g = p.dx + g * s.rows * s.dim;
    const void* x_g = At(p.x, g * s.rows * s.dim, s.dtype);
    for (int64_t v0 = 0; v0 < s.vocab; v0 += s.chunk) {
      const int64_t cols = std::min(s.chunk, s.vocab - v0);
      JAXGPU_RETURN_IF_ERROR(ChunkLogits(device, s, p.x, p.w, g, v0, cols, scratch, stream));
      JAXGPU_RETURN_IF_ERROR(CudaStatus(
          cuda::LaunchLceChunkGrad(
              Chunk(s, scratch.logits, g, v0, cols, p.labels, p.vocab_offset, p.softcap),
              p.lse + g * s.rows, p.dloss + g * s.rows, p.label_smoothing, p.vocab_total, stream),
          "linear_cross_entropy chunk gradient"));
      const void* w_c = At(p.w, wg * s.vocab * s.dim + (vd ? v0 * s.dim : v0), s.dtype);
      {  // dx (+)= dlogits w_c
        blas::GemmOperands ops = Operands(scratch, v0 == 0 ? &kZero : &kOne);
        ops.a = w_c;
        ops.b = scratch.logits;
        ops.c = dx_g;
        ops.d = dx_g;
        blas::GemmKey key = Key(device, s, s.dim, s.rows, cols, scratch);
        key.c_type = key.d_type = DType::kF32;
        key.trans_a = !vd;
        key.lda = vd ? 0 : s.vocab;
        key.alignment = blas::PointerAlignment({ops.a, ops.b, ops.d});
        JAXGPU_RETURN_IF_ERROR(
            BlasError(blas::Matmul(key, ops, stream), "linear_cross_entropy dx"));
      }
      {  // dw_c = dlogits^T x
        blas::GemmOperands ops = Operands(scratch, &kZero);
        void* dw_c = At(p.dw, g * s.vocab * s.dim + (vd ? v0 * s.dim : v0), s.dtype);
        ops.d = dw_c;
        blas::GemmKey key;
        if (vd) {
          ops.a = x_g;
          ops.b = scratch.logits;
          key = Key(device, s, s.dim, cols, s.rows, scratch);
          key.trans_b = true;
        } else {
          ops.a = scratch.logits;
          ops.b = x_g;
          key = Key(device, s, cols, s.dim, s.rows, scratch);
          key.trans_b = true;
          key.ldd = s.vocab;
        }
        key.alignment = blas::PointerAlignment({ops.a, ops.b, ops.d});
        JAXGPU_RETURN_IF_ERROR(
            BlasError(blas::Matmul(key, ops, stream), "linear_cross_entropy dw"));
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxgpu

namespace xffi = xla::ffi;

#define JAXGPU_LCE_CUDA_BIND() xffi::Ffi::Bind().Ctx<xffi::PlatformStream<cudaStream_t>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuLinearCrossEntropyFwdCuda, jaxgpu::FwdCuda,
                              JAXGPU_LCE_FWD_BINDING(JAXGPU_LCE_CUDA_BIND()),
                              {xffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuLinearCrossEntropyBwdCuda, jaxgpu::BwdCuda,
                              JAXGPU_LCE_BWD_BINDING(JAXGPU_LCE_CUDA_BIND()),
                              {xffi::Traits::kCmdBufferCompatible});
