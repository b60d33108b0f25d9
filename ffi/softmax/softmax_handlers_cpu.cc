// CPU FFI handlers of the softmax family: validate, then run softmax_cpu.cc.
#include "softmax/softmax_cpu.h"
#include "softmax/softmax_handlers.h"
#include "softmax/softmax_targets.h"

namespace jaxgpu {
namespace {

ffi::Error SoftmaxFwdCpu(ffi::AnyBuffer x, ffi::AnyBuffer mask, ffi::Result<ffi::AnyBuffer> y,
                         float scale, bool causal, bool has_mask, int64_t query_len) {
  SoftmaxFwdParams p;
  JAXGPU_RETURN_IF_ERROR(MakeSoftmaxFwdParams(x, mask, y, scale, causal, has_mask, query_len, &p));
  cpu::SoftmaxFwd(p);
  return ffi::Error::Success();
}

ffi::Error SoftmaxBwdCpu(ffi::AnyBuffer y, ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dx,
                         float scale, bool causal, int64_t query_len) {
  SoftmaxBwdParams p;
  JAXGPU_RETURN_IF_ERROR(MakeSoftmaxBwdParams(y, dy, dx, scale, causal, query_len, &p));
  cpu::SoftmaxBwd(p);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxgpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuSoftmaxFwdCpu, jaxgpu::SoftmaxFwdCpu,
                              JAXGPU_SOFTMAX_FWD_BINDING(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuSoftmaxBwdCpu, jaxgpu::SoftmaxBwdCpu,
                              JAXGPU_SOFTMAX_BWD_BINDING(xla::ffi::Ffi::Bind()));
