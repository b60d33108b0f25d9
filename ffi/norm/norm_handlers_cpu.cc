// CPU FFI handlers of the normalization family: validate, then run norm_cpu.cc.
#include "norm/norm_handlers.h"

#include "norm/norm_cpu.h"
#include "norm/norm_targets.h"

namespace jaxgpu {
namespace {

template <NormKind kKind>
ffi::Error NormFwdCpu(ffi::AnyBuffer x, ffi::AnyBuffer residual, ffi::AnyBuffer weight,
                      ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y,
                      ffi::Result<ffi::AnyBuffer> h, ffi::Result<ffi::AnyBuffer> mean,
                      ffi::Result<ffi::AnyBuffer> rstd, float eps, float weight_offset,
                      bool has_residual, bool has_weight, bool has_bias) {
  NormFwdParams p;
  JAXGPU_RETURN_IF_ERROR(MakeNormFwdParams(kKind, x, residual, weight, bias, y, h, mean, rstd, eps,
                                           weight_offset, has_residual, has_weight, has_bias, &p));
  cpu::NormFwd(p);
  return ffi::Error::Success();
}

template <NormKind kKind>
ffi::Error NormBwdCpu(ffi::AnyBuffer dy, ffi::AnyBuffer dh, ffi::AnyBuffer xh,
                      ffi::AnyBuffer weight, ffi::AnyBuffer mean, ffi::AnyBuffer rstd,
                      ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dweight,
                      ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> workspace,
                      float weight_offset, bool has_dh, bool has_weight, bool want_dweight,
                      bool want_dbias) {
  NormBwdParams p;
  JAXGPU_RETURN_IF_ERROR(MakeNormBwdParams(kKind, dy, dh, xh, weight, mean, rstd, dx, dweight,
                                           dbias, workspace, weight_offset, has_dh, has_weight,
                                           want_dweight, want_dbias, &p));
  cpu::NormBwd(p);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxgpu

using jaxgpu::NormKind;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuRmsNormFwdCpu, jaxgpu::NormFwdCpu<NormKind::kRms>,
                              JAXGPU_NORM_FWD_BINDING(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuLayerNormFwdCpu, jaxgpu::NormFwdCpu<NormKind::kLayer>,
                              JAXGPU_NORM_FWD_BINDING(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuRmsNormBwdCpu, jaxgpu::NormBwdCpu<NormKind::kRms>,
                              JAXGPU_NORM_BWD_BINDING(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuLayerNormBwdCpu, jaxgpu::NormBwdCpu<NormKind::kLayer>,
                              JAXGPU_NORM_BWD_BINDING(xla::ffi::Ffi::Bind()));
