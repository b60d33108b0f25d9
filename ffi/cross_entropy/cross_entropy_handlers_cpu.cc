// CPU FFI handlers of the cross-entropy family: validate, then run cross_entropy_cpu.cc.
#include "cross_entropy/cross_entropy_handlers.h"

#include "cross_entropy/cross_entropy_cpu.h"
#include "cross_entropy/cross_entropy_targets.h"

namespace jaxgpu {
namespace {

ffi::Error CrossEntropyFwdCpu(ffi::AnyBuffer logits, ffi::AnyBuffer labels,
                              ffi::Result<ffi::AnyBuffer> loss, ffi::Result<ffi::AnyBuffer> lse,
                              int32_t ignore_index, bool has_ignore, float label_smoothing,
                              float softcap) {
  CrossEntropyFwdParams p;
  JAXGPU_RETURN_IF_ERROR(MakeCrossEntropyFwdParams(logits, labels, loss, lse, ignore_index,
                                                   has_ignore, label_smoothing, softcap, &p));
  cpu::CrossEntropyFwd(p);
  return ffi::Error::Success();
}

ffi::Error CrossEntropyBwdCpu(ffi::AnyBuffer logits, ffi::AnyBuffer labels, ffi::AnyBuffer lse,
                              ffi::AnyBuffer dloss, ffi::Result<ffi::AnyBuffer> dlogits,
                              int32_t ignore_index, bool has_ignore, float label_smoothing,
                              float softcap) {
  CrossEntropyBwdParams p;
  JAXGPU_RETURN_IF_ERROR(MakeCrossEntropyBwdParams(
      logits, labels, lse, dloss, dlogits, ignore_index, has_ignore, label_smoothing, softcap, &p));
  cpu::CrossEntropyBwd(p);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxgpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuCrossEntropyFwdCpu, jaxgpu::CrossEntropyFwdCpu,
                              JAXGPU_CROSS_ENTROPY_FWD_BINDING(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuCrossEntropyBwdCpu, jaxgpu::CrossEntropyBwdCpu,
                              JAXGPU_CROSS_ENTROPY_BWD_BINDING(xla::ffi::Ffi::Bind()));
