// CPU FFI handlers of the attention family: validate (attention_handlers.h), then run
// attention_cpu.cc.
#include <string>

#include "attention/attention_cpu.h"
#include "attention/attention_handlers.h"
#include "attention/attention_targets.h"

namespace jaxgpu {
namespace {

// The CPU kernel has one loop: a forced CUDA main loop is an error here, not ignored (a
// test forcing one must not pass on code it never ran).
ffi::Error AttentionAttrsCpu(const ffi::Dictionary& attrs, AttentionAttrs* a) {
  JAXGPU_RETURN_IF_ERROR(AttentionAttrsFrom(attrs, a));
  if (a->path != AttentionPath::kAuto) {
    return ffi::Error::InvalidArgument(std::string("path: ") + AttentionPathName(a->path) +
                                       " is a CUDA main loop; the CPU kernels take 0 (auto)");
  }
  return ffi::Error::Success();
}

ffi::Error AttentionFwdCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::AnyBuffer q_seg, ffi::AnyBuffer kv_seg, ffi::AnyBuffer bias,
                           ffi::AnyBuffer mask, ffi::AnyBuffer q_lengths, ffi::AnyBuffer kv_lengths,
                           ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse,
                           ffi::Result<ffi::AnyBuffer> tile_counter, ffi::Dictionary attrs) {
  AttentionAttrs a;
  JAXGPU_RETURN_IF_ERROR(AttentionAttrsCpu(attrs, &a));
  AttentionParams p;
  JAXGPU_RETURN_IF_ERROR(MakeAttentionFwdParams(q, k, v, q_seg, kv_seg, bias, mask, q_lengths,
                                                kv_lengths, o, lse, tile_counter, a, &p));
  cpu::AttentionFwd(p);
  return ffi::Error::Success();
}

ffi::Error AttentionBwdCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer o,
                           ffi::AnyBuffer lse, ffi::AnyBuffer d_o, ffi::AnyBuffer q_seg,
                           ffi::AnyBuffer kv_seg, ffi::AnyBuffer seg_uniform, ffi::AnyBuffer bias,
                           ffi::AnyBuffer mask, ffi::AnyBuffer q_lengths, ffi::AnyBuffer kv_lengths,
                           ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                           ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> delta,
                           ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> dq_accum,
                           ffi::Result<ffi::AnyBuffer> dq_semaphores, ffi::Dictionary attrs) {
  AttentionAttrs a;
  JAXGPU_RETURN_IF_ERROR(AttentionAttrsCpu(attrs, &a));
  AttentionParams p;
  JAXGPU_RETURN_IF_ERROR(MakeAttentionBwdParams(q, k, v, o, lse, d_o, q_seg, kv_seg, seg_uniform,
                                                bias, mask, q_lengths, kv_lengths, dq, dk, dv,
                                                delta, dbias, dq_accum, dq_semaphores, a, &p));
  cpu::AttentionBwd(p);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxgpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuAttentionFwdCpu, jaxgpu::AttentionFwdCpu,
                              JAXGPU_ATTENTION_FWD_BINDING(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuAttentionBwdCpu, jaxgpu::AttentionBwdCpu,
                              JAXGPU_ATTENTION_BWD_BINDING(xla::ffi::Ffi::Bind()));
