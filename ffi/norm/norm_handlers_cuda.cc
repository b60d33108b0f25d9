// CUDA FFI handlers of the normalization family: validate, then launch norm_kernels.cu on
// XLA's stream. No syncs and no cudaMalloc (the backward scratch comes from XLA's
// allocator), so the handlers are safe to capture in CUDA graphs (kCmdBufferCompatible).
#include <string>

#include "norm/norm_cuda.h"
#include "norm/norm_handlers.h"
#include "norm/norm_targets.h"

namespace jaxgpu {
namespace {

ffi::Error CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(what) + ": " + cudaGetErrorString(err));
}

template <NormKind kKind>
ffi::Error NormFwdCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer residual,
                       ffi::AnyBuffer weight, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y,
                       ffi::Result<ffi::AnyBuffer> h, ffi::Result<ffi::AnyBuffer> mean,
                       ffi::Result<ffi::AnyBuffer> rstd, float eps, float weight_offset,
                       bool has_residual, bool has_weight, bool has_bias) {
  NormFwdParams p;
  JAXGPU_RETURN_IF_ERROR(MakeNormFwdParams(kKind, x, residual, weight, bias, y, h, mean, rstd,
                                           eps, weight_offset, has_residual, has_weight,
                                           has_bias, &p));
  return CudaStatus(cuda::LaunchNormFwd(p, stream), "norm forward launch");
}

template <NormKind kKind>
ffi::Error NormBwdCuda(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer dy,
                       ffi::AnyBuffer dh, ffi::AnyBuffer xh, ffi::AnyBuffer weight,
                       ffi::AnyBuffer mean, ffi::AnyBuffer rstd, ffi::Result<ffi::AnyBuffer> dx,
                       ffi::Result<ffi::AnyBuffer> dweight, ffi::Result<ffi::AnyBuffer> dbias,
                       float weight_offset, bool has_dh, bool has_weight, bool want_dweight,
                       bool want_dbias) {
  NormBwdParams p;
  JAXGPU_RETURN_IF_ERROR(MakeNormBwdParams(kKind, dy, dh, xh, weight, mean, rstd, dx, dweight,
                                           dbias, weight_offset, has_dh, has_weight,
                                           want_dweight, want_dbias, &p));
  void* workspace = nullptr;
  if (const size_t bytes = cuda::NormBwdWorkspaceBytes(p); bytes > 0) {
    auto buffer = scratch.Allocate(bytes, 256);
    if (!buffer.has_value()) {
      return ffi::Error::Internal("norm backward: could not allocate " + std::to_string(bytes) +
                                  " bytes of scratch");
    }
    workspace = *buffer;
  }
  return CudaStatus(cuda::LaunchNormBwd(p, workspace, stream), "norm backward launch");
}

}  // namespace
}  // namespace jaxgpu

using jaxgpu::NormKind;
namespace xffi = xla::ffi;

#define JAXGPU_CUDA_BIND() xffi::Ffi::Bind().Ctx<xffi::PlatformStream<cudaStream_t>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuRmsNormFwdCuda, jaxgpu::NormFwdCuda<NormKind::kRms>,
                              JAXGPU_NORM_FWD_BINDING(JAXGPU_CUDA_BIND()),
                              {xffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuLayerNormFwdCuda, jaxgpu::NormFwdCuda<NormKind::kLayer>,
                              JAXGPU_NORM_FWD_BINDING(JAXGPU_CUDA_BIND()),
                              {xffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuRmsNormBwdCuda, jaxgpu::NormBwdCuda<NormKind::kRms>,
                              JAXGPU_NORM_BWD_BINDING(JAXGPU_CUDA_BIND().Ctx<xffi::ScratchAllocator>()),
                              {xffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuLayerNormBwdCuda, jaxgpu::NormBwdCuda<NormKind::kLayer>,
                              JAXGPU_NORM_BWD_BINDING(JAXGPU_CUDA_BIND().Ctx<xffi::ScratchAllocator>()),
                              {xffi::Traits::kCmdBufferCompatible});
