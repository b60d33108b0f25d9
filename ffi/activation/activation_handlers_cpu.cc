// CPU FFI handlers of the activation family: validate, then run activation_cpu.cc.
#include "activation/activation_cpu.h"
#include "activation/activation_handlers.h"
#include "activation/activation_targets.h"

namespace jaxgpu {
namespace {

ffi::Error RunCpu(ffi::Error made, const ActParams& p) {
  if (made.failure()) return made;
  cpu::Activation(p);
  return ffi::Error::Success();
}

template <ActKind kKind>
ffi::Error UnaryFwdCpu(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  ActParams p;
  return RunCpu(UnaryFwdParams(kKind, x, y, &p), p);
}

template <ActKind kKind>
ffi::Error UnaryBwdCpu(ffi::AnyBuffer x, ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dx) {
  ActParams p;
  return RunCpu(UnaryBwdParams(kKind, x, dy, dx, &p), p);
}

ffi::Error GeluFwdCpu(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y, bool approximate) {
  ActParams p;
  return RunCpu(UnaryFwdParams(GeluKind(approximate), x, y, &p), p);
}

ffi::Error GeluBwdCpu(ffi::AnyBuffer x, ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dx,
                      bool approximate) {
  ActParams p;
  return RunCpu(UnaryBwdParams(GeluKind(approximate), x, dy, dx, &p), p);
}

ffi::Error SwigluFwdCpu(ffi::AnyBuffer gate, ffi::AnyBuffer up, ffi::Result<ffi::AnyBuffer> y) {
  ActParams p;
  return RunCpu(GatedFwdParams(ActKind::kSilu, gate, up, y, &p), p);
}

ffi::Error SwigluBwdCpu(ffi::AnyBuffer gate, ffi::AnyBuffer up, ffi::AnyBuffer dy,
                        ffi::Result<ffi::AnyBuffer> dgate, ffi::Result<ffi::AnyBuffer> dup) {
  ActParams p;
  return RunCpu(GatedBwdParams(ActKind::kSilu, gate, up, dy, dgate, dup, &p), p);
}

ffi::Error GegluFwdCpu(ffi::AnyBuffer gate, ffi::AnyBuffer up, ffi::Result<ffi::AnyBuffer> y,
                       bool approximate) {
  ActParams p;
  return RunCpu(GatedFwdParams(GeluKind(approximate), gate, up, y, &p), p);
}

ffi::Error GegluBwdCpu(ffi::AnyBuffer gate, ffi::AnyBuffer up, ffi::AnyBuffer dy,
                       ffi::Result<ffi::AnyBuffer> dgate, ffi::Result<ffi::AnyBuffer> dup,
                       bool approximate) {
  ActParams p;
  return RunCpu(GatedBwdParams(GeluKind(approximate), gate, up, dy, dgate, dup, &p), p);
}

}  // namespace
}  // namespace jaxgpu

using jaxgpu::ActKind;
namespace xffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuReluFwdCpu, jaxgpu::UnaryFwdCpu<ActKind::kRelu>,
                              JAXGPU_ACT_UNARY_FWD_BINDING(xffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuReluBwdCpu, jaxgpu::UnaryBwdCpu<ActKind::kRelu>,
                              JAXGPU_ACT_UNARY_BWD_BINDING(xffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuSigmoidFwdCpu, jaxgpu::UnaryFwdCpu<ActKind::kSigmoid>,
                              JAXGPU_ACT_UNARY_FWD_BINDING(xffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuSigmoidBwdCpu, jaxgpu::UnaryBwdCpu<ActKind::kSigmoid>,
                              JAXGPU_ACT_UNARY_BWD_BINDING(xffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuSiluFwdCpu, jaxgpu::UnaryFwdCpu<ActKind::kSilu>,
                              JAXGPU_ACT_UNARY_FWD_BINDING(xffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuSiluBwdCpu, jaxgpu::UnaryBwdCpu<ActKind::kSilu>,
                              JAXGPU_ACT_UNARY_BWD_BINDING(xffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxgpuGeluFwdCpu, jaxgpu::GeluFwdCpu,
    JAXGPU_ACT_APPROXIMATE_ATTR(JAXGPU_ACT_UNARY_FWD_BINDING(xffi::Ffi::Bind())));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxgpuGeluBwdCpu, jaxgpu::GeluBwdCpu,
    JAXGPU_ACT_APPROXIMATE_ATTR(JAXGPU_ACT_UNARY_BWD_BINDING(xffi::Ffi::Bind())));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuSwigluFwdCpu, jaxgpu::SwigluFwdCpu,
                              JAXGPU_ACT_GATED_FWD_BINDING(xffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuSwigluBwdCpu, jaxgpu::SwigluBwdCpu,
                              JAXGPU_ACT_GATED_BWD_BINDING(xffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxgpuGegluFwdCpu, jaxgpu::GegluFwdCpu,
    JAXGPU_ACT_APPROXIMATE_ATTR(JAXGPU_ACT_GATED_FWD_BINDING(xffi::Ffi::Bind())));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxgpuGegluBwdCpu, jaxgpu::GegluBwdCpu,
    JAXGPU_ACT_APPROXIMATE_ATTR(JAXGPU_ACT_GATED_BWD_BINDING(xffi::Ffi::Bind())));
