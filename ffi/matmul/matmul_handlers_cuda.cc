// CUDA FFI handlers of the matmul family: validate, then cuBLASLt (dense linear, through the
// shared plan cache in common/blas/) or the quantized kernels (qlinear_kernels.cu) on XLA's
// stream. No syncs and no allocation: cuBLASLt's workspace and the split-K partial sums are
// results that XLA plans, so the handlers are safe to capture in CUDA graphs.
//
// Row-major (JAX) to column-major (cuBLASLt): a row-major (R, C) matrix is a column-major
// C x R one, so
//   forward  y (M, N) = x w:     y^T (N x M) = w^T (N x K, w as stored) x^T (K x M)
//   dgrad    dx (M, K) = dz w^T: dx^T (K x M) = op(w as stored N x K = T) dz^T (N x M)
//   wgrad    dw (K, N) = x^T dz: dw^T (N x K) = dz^T (N x M) op(x as stored K x M = T)
// The bias runs along cuBLASLt's m (N in the forward pass); wgrad's bias gradient is the
// BGRADA epilogue: A's sum over its k (the rows M), fused into the GEMM.
#include <cuda_runtime_api.h>

#include <string>

#include "common/blas/cublaslt_plans.h"
#include "common/cuda_status.h"
#include "matmul/matmul_handlers.h"
#include "matmul/matmul_targets.h"
#include "matmul/qlinear_cuda.h"

namespace jaxgpu {
namespace {

ffi::Error BlasError(const blas::Status& s, const char* what) {
  if (s.ok()) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(what) + ": " + s.message());
}

ffi::Error Device(int* device) { return CudaStatus(cudaGetDevice(device), "cudaGetDevice"); }

const char* Offset(const void* p, int64_t elements, DType t) {
  return static_cast<const char*>(p) + DTypeBytes(t, elements);
}
char* Offset(void* p, int64_t elements, DType t) {
  return static_cast<char*>(p) + DTypeBytes(t, elements);
}

blas::GemmKey BaseKey(int device, DType t, int64_t m, int64_t n, int64_t k,
                      int64_t workspace_bytes) {
  blas::GemmKey key;
  key.device = device;
  key.m = m;
  key.n = n;
  key.k = k;
  key.a_type = key.b_type = key.c_type = key.d_type = t;
  key.compute = CUBLAS_COMPUTE_32F;  // float32 accumulation; float32 inputs stay float32
  key.workspace_bytes = workspace_bytes;
  return key;
}

// The GEMMs of a grouped call: one per group, or one for all when the weight (and bias) are
// shared, the groups' rows then being one (G M, K) matrix.
struct Grouping {
  int64_t calls, rows;
};
Grouping GroupGemms(bool shared, int64_t groups, int64_t m) {
  return shared ? Grouping{1, groups * m} : Grouping{groups, m};
}

// Operands with what every call sets: alpha 1, beta 0 (host floats that outlive the call),
// and the workspace.
blas::GemmOperands BaseOperands(void* workspace) {
  static const float kOne = 1.f, kZero = 0.f;
  blas::GemmOperands ops;
  ops.alpha = &kOne;
  ops.beta = &kZero;
  ops.workspace = workspace;
  return ops;
}

cublasLtEpilogue_t ForwardEpilogue(LinearEpilogue e, bool bias, bool aux) {
  switch (e) {
    case LinearEpilogue::kRelu: return bias ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_RELU;
    case LinearEpilogue::kGeluTanh:
      if (aux) return bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
      return bias ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU;
    default: return bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
  }
}

// One GEMM per group, or one for all when the weight and bias are shared (the groups'
// rows are then one (G M, K) matrix).
ffi::Error LinearFwdCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w,
                         ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y,
                         ffi::Result<ffi::AnyBuffer> aux, ffi::Result<ffi::AnyBuffer> workspace,
                         int32_t epilogue, bool has_bias, bool want_aux) {
  LinearFwdParams p;
  JAXGPU_RETURN_IF_ERROR(
      MakeLinearFwdParams(x, w, bias, y, aux, workspace, epilogue, has_bias, want_aux, &p));
  if (p.m == 0 || p.n == 0 || p.groups == 0) return ffi::Error::Success();
  if (want_aux && p.epilogue == LinearEpilogue::kGeluTanh && p.n % 8 != 0) {
    return ffi::Error::InvalidArgument("aux: cuBLASLt's GELU_AUX needs N to be a multiple of 8");
  }
  int device;
  JAXGPU_RETURN_IF_ERROR(Device(&device));
  const Grouping grouping = GroupGemms(p.weight_groups == 1 && p.bias_groups <= 1, p.groups, p.m);
  for (int64_t g = 0; g < grouping.calls; ++g) {
    blas::GemmOperands ops = BaseOperands(p.workspace);
    ops.a = Offset(p.w, (p.weight_groups > 1 ? g : 0) * p.k * p.n, p.dtype);
    ops.b = Offset(p.x, g * p.m * p.k, p.dtype);
    ops.d = Offset(p.y, g * p.m * p.n, p.dtype);
    ops.bias = p.bias ? Offset(p.bias, (p.bias_groups > 1 ? g : 0) * p.n, p.dtype) : nullptr;
    ops.aux = p.aux ? Offset(p.aux, g * p.m * p.n, p.dtype) : nullptr;
    blas::GemmKey key = BaseKey(device, p.dtype, p.n, grouping.rows, p.k, p.workspace_bytes);
    key.epilogue = ForwardEpilogue(p.epilogue, p.bias != nullptr, p.aux != nullptr);
    key.has_bias = p.bias != nullptr;
    key.bias_type = p.dtype;
    key.has_aux = p.aux != nullptr;
    key.aux_type = p.dtype;
    key.alignment = blas::PointerAlignment({ops.a, ops.b, ops.d, ops.bias, ops.aux});
    JAXGPU_RETURN_IF_ERROR(BlasError(blas::Matmul(key, ops, stream), "linear forward"));
  }
  return ffi::Error::Success();
}

ffi::Error LinearDgradCuda(cudaStream_t stream, ffi::AnyBuffer dz, ffi::AnyBuffer w,
                           ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> workspace) {
  LinearDgradParams p;
  JAXGPU_RETURN_IF_ERROR(MakeLinearDgradParams(dz, w, dx, workspace, &p));
  if (p.m == 0 || p.k == 0 || p.groups == 0) return ffi::Error::Success();
  int device;
  JAXGPU_RETURN_IF_ERROR(Device(&device));
  const Grouping grouping = GroupGemms(p.weight_groups == 1, p.groups, p.m);
  for (int64_t g = 0; g < grouping.calls; ++g) {
    blas::GemmOperands ops = BaseOperands(p.workspace);
    ops.a = Offset(p.w, (p.weight_groups > 1 ? g : 0) * p.k * p.n, p.dtype);
    ops.b = Offset(p.dz, g * p.m * p.n, p.dtype);
    ops.d = Offset(p.dx, g * p.m * p.k, p.dtype);
    blas::GemmKey key = BaseKey(device, p.dtype, p.k, grouping.rows, p.n, p.workspace_bytes);
    key.trans_a = true;
    key.alignment = blas::PointerAlignment({ops.a, ops.b, ops.d});
    JAXGPU_RETURN_IF_ERROR(BlasError(blas::Matmul(key, ops, stream), "linear dgrad"));
  }
  return ffi::Error::Success();
}

ffi::Error LinearWgradCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer dz,
                           ffi::Result<ffi::AnyBuffer> dw, ffi::Result<ffi::AnyBuffer> dbias,
                           ffi::Result<ffi::AnyBuffer> workspace, bool want_dbias) {
  LinearWgradParams p;
  JAXGPU_RETURN_IF_ERROR(MakeLinearWgradParams(x, dz, dw, dbias, workspace, want_dbias, &p));
  if (p.k == 0 || p.n == 0 || p.groups == 0) return ffi::Error::Success();
  if (p.m == 0) {
    // No rows: the gradients are zeros (a GEMM with k = 0 is not cuBLASLt's to run).
    JAXGPU_RETURN_IF_ERROR(CudaStatus(
        cudaMemsetAsync(p.dw, 0, DTypeBytes(p.dtype, p.groups * p.k * p.n), stream), "memset"));
    if (p.dbias) {
      JAXGPU_RETURN_IF_ERROR(CudaStatus(
          cudaMemsetAsync(p.dbias, 0, DTypeBytes(p.dtype, p.groups * p.n), stream), "memset"));
    }
    return ffi::Error::Success();
  }
  int device;
  JAXGPU_RETURN_IF_ERROR(Device(&device));
  for (int64_t g = 0; g < p.groups; ++g) {
    blas::GemmOperands ops = BaseOperands(p.workspace);
    ops.a = Offset(p.dz, g * p.m * p.n, p.dtype);
    ops.b = Offset(p.x, g * p.m * p.k, p.dtype);
    ops.d = Offset(p.dw, g * p.k * p.n, p.dtype);
    ops.bias = p.dbias ? Offset(p.dbias, g * p.n, p.dtype) : nullptr;
    blas::GemmKey key = BaseKey(device, p.dtype, p.n, p.k, p.m, p.workspace_bytes);
    key.trans_b = true;
    key.epilogue = p.dbias ? CUBLASLT_EPILOGUE_BGRADA : CUBLASLT_EPILOGUE_DEFAULT;
    key.has_bias = p.dbias != nullptr;
    key.bias_type = p.dtype;
    key.alignment = blas::PointerAlignment({ops.a, ops.b, ops.d, ops.bias});
    JAXGPU_RETURN_IF_ERROR(BlasError(blas::Matmul(key, ops, stream), "linear wgrad"));
  }
  return ffi::Error::Success();
}

ffi::Error QlinearFwdCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer packed,
                          ffi::AnyBuffer scales, ffi::AnyBuffer zeros, ffi::AnyBuffer bias,
                          ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> workspace,
                          int32_t bits, int32_t group_size, int32_t activation, bool has_zeros,
                          bool has_bias) {
  QLinearParams p;
  JAXGPU_RETURN_IF_ERROR(MakeQLinearParams(x, packed, scales, zeros, bias, y, workspace, bits,
                                           group_size, activation, has_zeros, has_bias, kHalfDTypes,
                                           &p));
  if (p.m == 0 || p.n == 0 || p.groups == 0) return ffi::Error::Success();
  return CudaStatus(cuda::LaunchQLinear(p, stream), "qlinear launch");
}

ffi::Error QlinearDequantCuda(cudaStream_t stream, ffi::AnyBuffer packed, ffi::AnyBuffer scales,
                              ffi::AnyBuffer zeros, ffi::Result<ffi::AnyBuffer> w, int32_t bits,
                              int32_t group_size, bool has_zeros) {
  QDequantParams p;
  JAXGPU_RETURN_IF_ERROR(
      MakeQDequantParams(packed, scales, zeros, w, bits, group_size, has_zeros, &p));
  if (p.n == 0 || p.groups == 0) return ffi::Error::Success();
  return CudaStatus(cuda::LaunchQDequant(p, stream), "qlinear dequantize launch");
}

}  // namespace
}  // namespace jaxgpu

namespace xffi = xla::ffi;

#define JAXGPU_MATMUL_CUDA_BIND() xffi::Ffi::Bind().Ctx<xffi::PlatformStream<cudaStream_t>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuLinearFwdCuda, jaxgpu::LinearFwdCuda,
                              JAXGPU_LINEAR_FWD_BINDING(JAXGPU_MATMUL_CUDA_BIND()),
                              {xffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuLinearDgradCuda, jaxgpu::LinearDgradCuda,
                              JAXGPU_LINEAR_DGRAD_BINDING(JAXGPU_MATMUL_CUDA_BIND()),
                              {xffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuLinearWgradCuda, jaxgpu::LinearWgradCuda,
                              JAXGPU_LINEAR_WGRAD_BINDING(JAXGPU_MATMUL_CUDA_BIND()),
                              {xffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuQlinearFwdCuda, jaxgpu::QlinearFwdCuda,
                              JAXGPU_QLINEAR_FWD_BINDING(JAXGPU_MATMUL_CUDA_BIND()),
                              {xffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuQlinearDequantCuda, jaxgpu::QlinearDequantCuda,
                              JAXGPU_QLINEAR_DEQUANT_BINDING(JAXGPU_MATMUL_CUDA_BIND()),
                              {xffi::Traits::kCmdBufferCompatible});
