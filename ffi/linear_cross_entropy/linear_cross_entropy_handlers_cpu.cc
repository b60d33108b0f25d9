// CPU FFI handlers of the fused linear + cross-entropy: validate, then run
// linear_cross_entropy_cpu.cc. The scratch result is not used on CPU.
#include "linear_cross_entropy/linear_cross_entropy_cpu.h"
#include "linear_cross_entropy/linear_cross_entropy_handlers.h"
#include "linear_cross_entropy/linear_cross_entropy_targets.h"

namespace jaxgpu {
namespace {

ffi::Error LinearCrossEntropyFwdCpu(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer labels,
                                    ffi::AnyBuffer vocab_ids, ffi::Result<ffi::AnyBuffer> lse,
                                    ffi::Result<ffi::AnyBuffer> zlabel,
                                    ffi::Result<ffi::AnyBuffer> zsum,
                                    ffi::Result<ffi::AnyBuffer> scratch, float softcap,
                                    int32_t w_layout, int64_t chunk) {
  LinearCrossEntropyFwdParams p;
  JAXGPU_RETURN_IF_ERROR(MakeLinearCrossEntropyFwdParams(x, w, labels, vocab_ids, lse, zlabel, zsum,
                                                         scratch, softcap, w_layout, chunk, &p));
  cpu::LinearCrossEntropyFwd(p);
  return ffi::Error::Success();
}

ffi::Error LinearCrossEntropyBwdCpu(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer labels,
                                    ffi::AnyBuffer vocab_ids, ffi::AnyBuffer lse,
                                    ffi::AnyBuffer dloss, ffi::Result<ffi::AnyBuffer> dx,
                                    ffi::Result<ffi::AnyBuffer> dw,
                                    ffi::Result<ffi::AnyBuffer> scratch, float softcap,
                                    float label_smoothing, int64_t vocab_total, int32_t w_layout,
                                    int64_t chunk) {
  LinearCrossEntropyBwdParams p;
  JAXGPU_RETURN_IF_ERROR(MakeLinearCrossEntropyBwdParams(x, w, labels, vocab_ids, lse, dloss, dx,
                                                         dw, scratch, softcap, label_smoothing,
                                                         vocab_total, w_layout, chunk, &p));
  cpu::LinearCrossEntropyBwd(p);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxgpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuLinearCrossEntropyFwdCpu, jaxgpu::LinearCrossEntropyFwdCpu,
                              JAXGPU_LCE_FWD_BINDING(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuLinearCrossEntropyBwdCpu, jaxgpu::LinearCrossEntropyBwdCpu,
                              JAXGPU_LCE_BWD_BINDING(xla::ffi::Ffi::Bind()));
