// CPU FFI handlers of the matmul family: validate, then run matmul_cpu.cc.
#include "matmul/matmul_cpu.h"
#include "matmul/matmul_handlers.h"
#include "matmul/matmul_targets.h"

namespace jaxgpu {
namespace {

ffi::Error LinearFwdCpu(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer bias,
                        ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> aux,
                        ffi::Result<ffi::AnyBuffer> workspace, int32_t epilogue, bool has_bias,
                        bool want_aux) {
  LinearFwdParams p;
  JAXGPU_RETURN_IF_ERROR(
      MakeLinearFwdParams(x, w, bias, y, aux, workspace, epilogue, has_bias, want_aux, &p));
  cpu::LinearFwd(p);
  return ffi::Error::Success();
}

ffi::Error LinearDgradCpu(ffi::AnyBuffer dz, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> dx,
                          ffi::Result<ffi::AnyBuffer> workspace) {
  LinearDgradParams p;
  JAXGPU_RETURN_IF_ERROR(MakeLinearDgradParams(dz, w, dx, workspace, &p));
  cpu::LinearDgrad(p);
  return ffi::Error::Success();
}

ffi::Error LinearWgradCpu(ffi::AnyBuffer x, ffi::AnyBuffer dz, ffi::Result<ffi::AnyBuffer> dw,
                          ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> workspace,
                          bool want_dbias) {
  LinearWgradParams p;
  JAXGPU_RETURN_IF_ERROR(MakeLinearWgradParams(x, dz, dw, dbias, workspace, want_dbias, &p));
  cpu::LinearWgrad(p);
  return ffi::Error::Success();
}

ffi::Error QlinearFwdCpu(ffi::AnyBuffer x, ffi::AnyBuffer packed, ffi::AnyBuffer scales,
                         ffi::AnyBuffer zeros, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y,
                         ffi::Result<ffi::AnyBuffer> workspace, int32_t bits, int32_t group_size,
                         int32_t activation, bool has_zeros, bool has_bias) {
  QLinearParams p;
  JAXGPU_RETURN_IF_ERROR(MakeQLinearParams(x, packed, scales, zeros, bias, y, workspace, bits,
                                           group_size, activation, has_zeros, has_bias,
                                           kFloatDTypes, &p));
  cpu::QLinearFwd(p);
  return ffi::Error::Success();
}

ffi::Error QlinearDequantCpu(ffi::AnyBuffer packed, ffi::AnyBuffer scales, ffi::AnyBuffer zeros,
                             ffi::Result<ffi::AnyBuffer> w, int32_t bits, int32_t group_size,
                             bool has_zeros) {
  QDequantParams p;
  JAXGPU_RETURN_IF_ERROR(
      MakeQDequantParams(packed, scales, zeros, w, bits, group_size, has_zeros, &p));
  cpu::QDequant(p);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxgpu

namespace xffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuLinearFwdCpu, jaxgpu::LinearFwdCpu,
                              JAXGPU_LINEAR_FWD_BINDING(xffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuLinearDgradCpu, jaxgpu::LinearDgradCpu,
                              JAXGPU_LINEAR_DGRAD_BINDING(xffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuLinearWgradCpu, jaxgpu::LinearWgradCpu,
                              JAXGPU_LINEAR_WGRAD_BINDING(xffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuQlinearFwdCpu, jaxgpu::QlinearFwdCpu,
                              JAXGPU_QLINEAR_FWD_BINDING(xffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuQlinearDequantCpu, jaxgpu::QlinearDequantCpu,
                              JAXGPU_QLINEAR_DEQUANT_BINDING(xffi::Ffi::Bind()));
