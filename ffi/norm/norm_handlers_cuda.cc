// CUDA FFI handlers of the normalization family: validate, then launch norm_kernels.cu on
// XLA's stream. No syncs and no allocation (the backward pass's partial sums live in a
// workspace output that XLA plans like any buffer; ffi::ScratchAllocator failed to
// allocate inside XLA's command buffers on the H100, jax 0.11.2), so the handlers are safe
// to capture in CUDA graphs (kCmdBufferCompatible).
#include <string>

#include "common/cuda_status.h"
#include "norm/norm_cuda.h"
#include "norm/norm_handlers.h"
#include "norm/norm_targets.h"

namespace jaxgpu {
namespace {

template <NormKind kKind>
ffi::Error NormFwdCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer residual,
                       ffi::AnyBuffer weight, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y,
                       ffi::Result<ffi::AnyBuffer> h, ffi::Result<ffi::AnyBuffer> mean,
                       ffi::Result<ffi::AnyBuffer> rstd, float eps, float weight_offset,
                       bool has_residual, bool has_weight, bool has_bias) {
  NormFwdParams p;
  JAXGPU_RETURN_IF_ERROR(MakeNormFwdParams(kKind, x, residual, weight, bias, y, h, mean, rstd, eps,
                                           weight_offset, has_residual, has_weight, has_bias, &p));
  return CudaStatus(cuda::LaunchNormFwd(p, stream), "norm forward launch");
}

template <NormKind kKind>
ffi::Error NormBwdCuda(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer dh, ffi::AnyBuffer xh,
                       ffi::AnyBuffer weight, ffi::AnyBuffer mean, ffi::AnyBuffer rstd,
                       ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dweight,
                       ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> workspace,
                       float weight_offset, bool has_dh, bool has_weight, bool want_dweight,
                       bool want_dbias) {
  NormBwdParams p;
  JAXGPU_RETURN_IF_ERROR(MakeNormBwdParams(kKind, dy, dh, xh, weight, mean, rstd, dx, dweight,
                                           dbias, workspace, weight_offset, has_dh, has_weight,
                                           want_dweight, want_dbias, &p));
  if ((p.dweight || p.dbias) && p.workspace == nullptr && p.rows_per_group > 0) {
    return ffi::Error::InvalidArgument("workspace: the CUDA backward pass needs one");
  }
  return CudaStatus(cuda::LaunchNormBwd(p, stream), "norm backward launch");
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
                              JAXGPU_NORM_BWD_BINDING(JAXGPU_CUDA_BIND()),
                              {xffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuLayerNormBwdCuda, jaxgpu::NormBwdCuda<NormKind::kLayer>,
                              JAXGPU_NORM_BWD_BINDING(JAXGPU_CUDA_BIND()),
                              {xffi::Traits::kCmdBufferCompatible});
