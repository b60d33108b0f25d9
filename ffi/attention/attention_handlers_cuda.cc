// CUDA FFI handlers of the attention family: validate, decide the main loop once per call
// (ResolveAttentionPath), then launch the kernels on XLA's stream (attention_dispatch.cu).
// No syncs and no allocation (the backward pass's delta workspace is an output), so XLA
// may capture them in CUDA graphs.
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
    return ffi::Error::InvalidArgument(
        "q: the CUDA kernels need a head dim that is a multiple "
        "of 8 (jaxgpu.dot_product_attention pads others)");
  }
  return ffi::Error::Success();
}

// The main loop this call runs on; a forced one that cannot run it is the caller's error.
ffi::Error ResolvePath(const AttentionParams& p, AttentionPath requested, AttentionPath* resolved) {
  if (const char* why = cuda::ResolveAttentionPath(p, requested, resolved)) {
    return ffi::Error::InvalidArgument(std::string("path: ") + AttentionPathName(requested) +
                                       " cannot run this call here: " + why);
  }
  return ffi::Error::Success();
}

ffi::Error AttentionFwdCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                            ffi::AnyBuffer v, ffi::AnyBuffer q_seg, ffi::AnyBuffer kv_seg,
                            ffi::AnyBuffer bias, ffi::AnyBuffer mask, ffi::AnyBuffer q_lengths,
                            ffi::AnyBuffer kv_lengths, ffi::Result<ffi::AnyBuffer> o,
                            ffi::Result<ffi::AnyBuffer> lse,
                            ffi::Result<ffi::AnyBuffer> tile_counter, ffi::Dictionary attrs) {
  AttentionAttrs a;
  JAXGPU_RETURN_IF_ERROR(AttentionAttrsFrom(attrs, &a));
  AttentionParams p;
  JAXGPU_RETURN_IF_ERROR(MakeAttentionFwdParams(q, k, v, q_seg, kv_seg, bias, mask, q_lengths,
                                                kv_lengths, o, lse, tile_counter, a, &p));
  JAXGPU_RETURN_IF_ERROR(CheckCudaSupported(p));
  AttentionPath path;
  JAXGPU_RETURN_IF_ERROR(ResolvePath(p, a.path, &path));
  return CudaStatus(cuda::LaunchAttentionFwd(p, path, stream), "attention forward launch");
}

ffi::Error AttentionBwdCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                            ffi::AnyBuffer v, ffi::AnyBuffer o, ffi::AnyBuffer lse,
                            ffi::AnyBuffer d_o, ffi::AnyBuffer q_seg, ffi::AnyBuffer kv_seg,
                            ffi::AnyBuffer seg_uniform, ffi::AnyBuffer bias, ffi::AnyBuffer mask,
                            ffi::AnyBuffer q_lengths, ffi::AnyBuffer kv_lengths,
                            ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                            ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> delta,
                            ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> dq_accum,
                            ffi::Result<ffi::AnyBuffer> dq_semaphores, ffi::Dictionary attrs) {
  AttentionAttrs a;
  JAXGPU_RETURN_IF_ERROR(AttentionAttrsFrom(attrs, &a));
  AttentionParams p;
  JAXGPU_RETURN_IF_ERROR(MakeAttentionBwdParams(q, k, v, o, lse, d_o, q_seg, kv_seg, seg_uniform,
                                                bias, mask, q_lengths, kv_lengths, dq, dk, dv,
                                                delta, dbias, dq_accum, dq_semaphores, a, &p));
  JAXGPU_RETURN_IF_ERROR(CheckCudaSupported(p));
  AttentionPath path;
  JAXGPU_RETURN_IF_ERROR(ResolvePath(p, a.path, &path));
  return CudaStatus(cuda::LaunchAttentionBwd(p, path, stream), "attention backward launch");
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
