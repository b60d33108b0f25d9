// CUDA FFI handlers of the decode family: validate, then launch decode_kernels.cu on XLA's
// stream. No syncs and no allocation (the split-KV scratch is the `workspace` result, which
// XLA plans), so the handlers are safe to capture in CUDA graphs (kCmdBufferCompatible).
#include "common/cuda_status.h"
#include "decode/decode_cuda.h"
#include "decode/decode_handlers.h"
#include "decode/decode_targets.h"

namespace jaxgpu {
namespace {

ffi::Error PagedAttentionFwdCuda(cudaStream_t stream, ffi::AnyBuffer query, ffi::AnyBuffer k_pages,
                                 ffi::AnyBuffer v_pages, ffi::AnyBuffer block_table,
                                 ffi::AnyBuffer lengths, ffi::Result<ffi::AnyBuffer> out,
                                 ffi::Result<ffi::AnyBuffer> workspace, float scale, float softcap,
                                 int32_t window_left, int32_t num_splits) {
  PagedAttentionParams p;
  JAXGPU_RETURN_IF_ERROR(MakePagedAttentionParams(query, k_pages, v_pages, nullptr, nullptr,
                                                  block_table, lengths, out, workspace, scale,
                                                  softcap, window_left, num_splits, &p));
  return CudaStatus(cuda::LaunchPagedAttention(p, stream), "paged_attention launch");
}

ffi::Error PagedAttentionQ8FwdCuda(cudaStream_t stream, ffi::AnyBuffer query,
                                   ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                                   ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale,
                                   ffi::AnyBuffer block_table, ffi::AnyBuffer lengths,
                                   ffi::Result<ffi::AnyBuffer> out,
                                   ffi::Result<ffi::AnyBuffer> workspace, float scale,
                                   float softcap, int32_t window_left, int32_t num_splits) {
  PagedAttentionParams p;
  JAXGPU_RETURN_IF_ERROR(MakePagedAttentionParams(query, k_pages, v_pages, &k_scale, &v_scale,
                                                  block_table, lengths, out, workspace, scale,
                                                  softcap, window_left, num_splits, &p));
  return CudaStatus(cuda::LaunchPagedAttention(p, stream), "paged_attention (8-bit) launch");
}

ffi::Error CopyIfUnaliased(void* dst, const void* src, int64_t bytes, cudaStream_t stream,
                           const char* what) {
  if (dst == src || bytes == 0) return ffi::Error::Success();
  return CudaStatus(
      cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice, stream),
      what);
}

// XLA aliases the results to the caches (input_output_aliases), so these copies never run
// from jaxgpu; they keep a direct call with separate buffers correct.
ffi::Error CopyUnaliased(const PagedKvUpdateParams& p, cudaStream_t stream) {
  const int64_t bytes = PagedKvPoolBytes(p), scale_bytes = PagedKvScaleBytes(p);
  JAXGPU_RETURN_IF_ERROR(
      CopyIfUnaliased(p.k_pages, p.k_pages_in, bytes, stream, "paged_kv_update copy of k_pages"));
  JAXGPU_RETURN_IF_ERROR(
      CopyIfUnaliased(p.v_pages, p.v_pages_in, bytes, stream, "paged_kv_update copy of v_pages"));
  JAXGPU_RETURN_IF_ERROR(CopyIfUnaliased(p.k_scale, p.k_scale_in, scale_bytes, stream,
                                         "paged_kv_update copy of k_scale"));
  return CopyIfUnaliased(p.v_scale, p.v_scale_in, scale_bytes, stream,
                         "paged_kv_update copy of v_scale");
}

ffi::Error PagedKvUpdateFwdCuda(cudaStream_t stream, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                                ffi::AnyBuffer k_new, ffi::AnyBuffer v_new,
                                ffi::AnyBuffer block_table, ffi::AnyBuffer positions,
                                ffi::Result<ffi::AnyBuffer> k_out,
                                ffi::Result<ffi::AnyBuffer> v_out) {
  PagedKvUpdateParams p;
  JAXGPU_RETURN_IF_ERROR(MakePagedKvUpdateParams(k_pages, v_pages, nullptr, nullptr, k_new, v_new,
                                                 block_table, positions, k_out, v_out, nullptr,
                                                 nullptr, &p));
  JAXGPU_RETURN_IF_ERROR(CopyUnaliased(p, stream));
  return CudaStatus(cuda::LaunchPagedKvUpdate(p, stream), "paged_kv_update launch");
}

ffi::Error PagedKvUpdateQ8FwdCuda(
    cudaStream_t stream, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, ffi::AnyBuffer k_scale,
    ffi::AnyBuffer v_scale, ffi::AnyBuffer k_new, ffi::AnyBuffer v_new, ffi::AnyBuffer block_table,
    ffi::AnyBuffer positions, ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out,
    ffi::Result<ffi::AnyBuffer> k_scale_out, ffi::Result<ffi::AnyBuffer> v_scale_out) {
  PagedKvUpdateParams p;
  JAXGPU_RETURN_IF_ERROR(MakePagedKvUpdateParams(k_pages, v_pages, &k_scale, &v_scale, k_new, v_new,
                                                 block_table, positions, k_out, v_out, &k_scale_out,
                                                 &v_scale_out, &p));
  JAXGPU_RETURN_IF_ERROR(CopyUnaliased(p, stream));
  return CudaStatus(cuda::LaunchPagedKvUpdate(p, stream), "paged_kv_update (8-bit) launch");
}

ffi::Error PagedAttentionWithUpdateFwdCuda(
    cudaStream_t stream, ffi::AnyBuffer query, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
    ffi::AnyBuffer k_new, ffi::AnyBuffer v_new, ffi::AnyBuffer block_table, ffi::AnyBuffer lengths,
    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace,
    ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out, float scale,
    float softcap, int32_t window_left, int32_t num_splits) {
  PagedAttentionParams att;
  PagedKvUpdateParams upd;
  JAXGPU_RETURN_IF_ERROR(MakePagedAttentionWithUpdateParams(
      query, k_pages, v_pages, k_new, v_new, block_table, lengths, out, workspace, k_out, v_out,
      scale, softcap, window_left, num_splits, &att, &upd));
  JAXGPU_RETURN_IF_ERROR(CopyUnaliased(upd, stream));
  return CudaStatus(cuda::LaunchPagedAttentionWithUpdate(att, upd, stream),
                    "paged_attention_with_update launch");
}

}  // namespace
}  // namespace jaxgpu

namespace xffi = xla::ffi;

#define JAXGPU_DECODE_CUDA_BIND() xffi::Ffi::Bind().Ctx<xffi::PlatformStream<cudaStream_t>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuPagedAttentionFwdCuda, jaxgpu::PagedAttentionFwdCuda,
                              JAXGPU_PAGED_ATTENTION_FWD_BINDING(JAXGPU_DECODE_CUDA_BIND()),
                              {xffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuPagedAttentionQ8FwdCuda, jaxgpu::PagedAttentionQ8FwdCuda,
                              JAXGPU_PAGED_ATTENTION_Q8_FWD_BINDING(JAXGPU_DECODE_CUDA_BIND()),
                              {xffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuPagedKvUpdateFwdCuda, jaxgpu::PagedKvUpdateFwdCuda,
                              JAXGPU_PAGED_KV_UPDATE_FWD_BINDING(JAXGPU_DECODE_CUDA_BIND()),
                              {xffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuPagedKvUpdateQ8FwdCuda, jaxgpu::PagedKvUpdateQ8FwdCuda,
                              JAXGPU_PAGED_KV_UPDATE_Q8_FWD_BINDING(JAXGPU_DECODE_CUDA_BIND()),
                              {xffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxgpuPagedAttentionWithUpdateFwdCuda, jaxgpu::PagedAttentionWithUpdateFwdCuda,
    JAXGPU_PAGED_ATTENTION_WITH_UPDATE_FWD_BINDING(JAXGPU_DECODE_CUDA_BIND()),
    {xffi::Traits::kCmdBufferCompatible});
