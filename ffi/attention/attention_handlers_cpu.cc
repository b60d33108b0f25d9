// CPU FFI handlers of the attention family: validate (attention_handlers.h), then run
// attention_cpu.cc.
#include "attention/attention_cpu.h"
#include "attention/attention_handlers.h"
#include "attention/attention_targets.h"

namespace jaxgpu {
namespace {

ffi::Error AttentionFwdCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::AnyBuffer q_seg, ffi::AnyBuffer kv_seg,
                           ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse,
                           float scale, float softcap, bool causal, int64_t window_left,
                           int64_t window_right, bool has_segments) {
  const AttentionAttrs attrs{scale, softcap, causal, window_left, window_right, has_segments};
  AttentionParams p;
  JAXGPU_RETURN_IF_ERROR(MakeAttentionFwdParams(q, k, v, q_seg, kv_seg, o, lse, attrs, &p));
  cpu::AttentionFwd(p);
  return ffi::Error::Success();
}

ffi::Error AttentionBwdCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::AnyBuffer o, ffi::AnyBuffer lse, ffi::AnyBuffer d_o,
                           ffi::AnyBuffer q_seg, ffi::AnyBuffer kv_seg,
                           ffi::AnyBuffer seg_uniform,
                           ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                           ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> delta,
                           float scale, float softcap, bool causal, int64_t window_left,
                           int64_t window_right, bool has_segments) {
  const AttentionAttrs attrs{scale, softcap, causal, window_left, window_right, has_segments};
  AttentionParams p;
  JAXGPU_RETURN_IF_ERROR(MakeAttentionBwdParams(q, k, v, o, lse, d_o, q_seg, kv_seg, seg_uniform,
                                                dq, dk, dv, delta, attrs, &p));
  cpu::AttentionBwd(p);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxgpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuAttentionFwdCpu, jaxgpu::AttentionFwdCpu,
                              JAXGPU_ATTENTION_FWD_BINDING(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuAttentionBwdCpu, jaxgpu::AttentionBwdCpu,
                              JAXGPU_ATTENTION_BWD_BINDING(xla::ffi::Ffi::Bind()));
