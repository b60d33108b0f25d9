// CUDA FFI handlers of the attention family: validate, then launch the kernels of
// attention_fwd.cu / attention_bwd.cu on XLA's stream. No syncs and no allocation (the
// backward pass's delta workspace is an output), so XLA may capture them in CUDA graphs.
#include <string>

#include "common/cuda_status.h"
#include "attention/attention_cuda.h"
#include "attention/attention_handlers.h"
#include "attention/attention_targets.h"

namespace jaxgpu {
namespace {

ffi::Error CheckCudaSupported(const AttentionParams& p) {
  if (p.dtype == DType::kF32) {
    return ffi::Error::InvalidArgument(
        "q: the CUDA attention kernels take bfloat16 or float16 (float32 runs the XLA path)");
  }
  if (p.head_dim % 8 != 0) {
    return ffi::Error::InvalidArgument("q: the CUDA kernels need a head dim that is a multiple "
                                       "of 8 (jaxgpu.dot_product_attention pads others)");
  }
  return ffi::Error::Success();
}

ffi::Error AttentionFwdCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                            ffi::AnyBuffer v, ffi::AnyBuffer q_seg, ffi::AnyBuffer kv_seg,
                            ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse,
                            float scale, float softcap, bool causal, int64_t window_left,
                            int64_t window_right, bool has_segments) {
  AttentionParams p;
  const AttentionAttrs a{scale, softcap, causal, window_left, window_right, has_segments};
  JAXGPU_RETURN_IF_ERROR(MakeAttentionFwdParams(q, k, v, q_seg, kv_seg, o, lse, a, &p));
  JAXGPU_RETURN_IF_ERROR(CheckCudaSupported(p));
  return CudaStatus(cuda::LaunchAttentionFwd(p, stream), "attention forward launch");
}

ffi::Error AttentionBwdCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                            ffi::AnyBuffer v, ffi::AnyBuffer o, ffi::AnyBuffer lse,
                            ffi::AnyBuffer d_o, ffi::AnyBuffer q_seg, ffi::AnyBuffer kv_seg,
                            ffi::AnyBuffer seg_uniform,
                            ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                            ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> delta,
                            float scale, float softcap, bool causal, int64_t window_left,
                            int64_t window_right, bool has_segments) {
  AttentionParams p;
  const AttentionAttrs a{scale, softcap, causal, window_left, window_right, has_segments};
  JAXGPU_RETURN_IF_ERROR(MakeAttentionBwdParams(q, k, v, o, lse, d_o, q_seg, kv_seg, seg_uniform,
                                                dq, dk, dv, delta, a, &p));
  JAXGPU_RETURN_IF_ERROR(CheckCudaSupported(p));
  return CudaStatus(cuda::LaunchAttentionBwd(p, stream), "attention backward launch");
}

}  // namespace
}  // namespace jaxgpu

namespace xffi = xla::ffi;

#define JAXGPU_ATTENTION_CUDA_BIND() xffi::Ffi::Bind().Ctx<xffi::PlatformStream<cudaStream_t>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuAttentionFwdCuda, jaxgpu::AttentionFwdCuda,
                              JAXGPU_ATTENTION_FWD_BINDING(JAXGPU_ATTENTION_CUDA_BIND()),
                              {xffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuAttentionBwdCuda, jaxgpu::AttentionBwdCuda,
                              JAXGPU_ATTENTION_BWD_BINDING(JAXGPU_ATTENTION_CUDA_BIND()),
                              {xffi::Traits::kCmdBufferCompatible});
