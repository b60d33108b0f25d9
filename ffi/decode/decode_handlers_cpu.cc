// CPU FFI handlers of the decode family: validate, then run decode_cpu.cc.
#include <cstring>

#include "decode/decode_cpu.h"
#include "decode/decode_handlers.h"
#include "decode/decode_targets.h"

namespace jaxgpu {
namespace {

ffi::Error PagedAttentionFwdCpu(ffi::AnyBuffer query, ffi::AnyBuffer k_pages,
                                ffi::AnyBuffer v_pages, ffi::AnyBuffer block_table,
                                ffi::AnyBuffer lengths, ffi::Result<ffi::AnyBuffer> out,
                                ffi::Result<ffi::AnyBuffer> workspace, float scale, float softcap,
                                int32_t window_left, int32_t num_splits) {
  PagedAttentionParams p;
  JAXGPU_RETURN_IF_ERROR(MakePagedAttentionParams(query, k_pages, v_pages, nullptr, nullptr,
                                                  block_table, lengths, out, workspace, scale,
                                                  softcap, window_left, num_splits, &p));
  cpu::PagedAttention(p);
  return ffi::Error::Success();
}

ffi::Error PagedAttentionQ8FwdCpu(ffi::AnyBuffer query, ffi::AnyBuffer k_pages,
                                  ffi::AnyBuffer v_pages, ffi::AnyBuffer k_scale,
                                  ffi::AnyBuffer v_scale, ffi::AnyBuffer block_table,
                                  ffi::AnyBuffer lengths, ffi::Result<ffi::AnyBuffer> out,
                                  ffi::Result<ffi::AnyBuffer> workspace, float scale, float softcap,
                                  int32_t window_left, int32_t num_splits) {
  PagedAttentionParams p;
  JAXGPU_RETURN_IF_ERROR(MakePagedAttentionParams(query, k_pages, v_pages, &k_scale, &v_scale,
                                                  block_table, lengths, out, workspace, scale,
                                                  softcap, window_left, num_splits, &p));
  cpu::PagedAttention(p);
  return ffi::Error::Success();
}

// XLA aliases the results to the caches (input_output_aliases), so these copies never run
// from jaxgpu; they keep a direct call with separate buffers correct.
void CopyUnaliased(const PagedKvUpdateParams& p) {
  const size_t bytes = static_cast<size_t>(PagedKvPoolBytes(p));
  if (p.k_pages != p.k_pages_in) std::memcpy(p.k_pages, p.k_pages_in, bytes);
  if (p.v_pages != p.v_pages_in) std::memcpy(p.v_pages, p.v_pages_in, bytes);
  const size_t scale_bytes = static_cast<size_t>(PagedKvScaleBytes(p));
  if (p.k_scale != p.k_scale_in) std::memcpy(p.k_scale, p.k_scale_in, scale_bytes);
  if (p.v_scale != p.v_scale_in) std::memcpy(p.v_scale, p.v_scale_in, scale_bytes);
}

ffi::Error PagedKvUpdateFwdCpu(ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, ffi::AnyBuffer k_new,
                               ffi::AnyBuffer v_new, ffi::AnyBuffer block_table,
                               ffi::AnyBuffer positions, ffi::Result<ffi::AnyBuffer> k_out,
                               ffi::Result<ffi::AnyBuffer> v_out) {
  PagedKvUpdateParams p;
  JAXGPU_RETURN_IF_ERROR(MakePagedKvUpdateParams(k_pages, v_pages, nullptr, nullptr, k_new, v_new,
                                                 block_table, positions, k_out, v_out, nullptr,
                                                 nullptr, &p));
  CopyUnaliased(p);
  cpu::PagedKvUpdate(p);
  return ffi::Error::Success();
}

ffi::Error PagedKvUpdateQ8FwdCpu(
    ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale,
    ffi::AnyBuffer k_new, ffi::AnyBuffer v_new, ffi::AnyBuffer block_table,
    ffi::AnyBuffer positions, ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out,
    ffi::Result<ffi::AnyBuffer> k_scale_out, ffi::Result<ffi::AnyBuffer> v_scale_out) {
  PagedKvUpdateParams p;
  JAXGPU_RETURN_IF_ERROR(MakePagedKvUpdateParams(k_pages, v_pages, &k_scale, &v_scale, k_new, v_new,
                                                 block_table, positions, k_out, v_out, &k_scale_out,
                                                 &v_scale_out, &p));
  CopyUnaliased(p);
  cpu::PagedKvUpdate(p);
  return ffi::Error::Success();
}

ffi::Error PagedAttentionWithUpdateFwdCpu(ffi::AnyBuffer query, ffi::AnyBuffer k_pages,
                                          ffi::AnyBuffer v_pages, ffi::AnyBuffer k_new,
                                          ffi::AnyBuffer v_new, ffi::AnyBuffer block_table,
                                          ffi::AnyBuffer lengths, ffi::Result<ffi::AnyBuffer> out,
                                          ffi::Result<ffi::AnyBuffer> workspace,
                                          ffi::Result<ffi::AnyBuffer> k_out,
                                          ffi::Result<ffi::AnyBuffer> v_out, float scale,
                                          float softcap, int32_t window_left, int32_t num_splits) {
  PagedAttentionParams att;
  PagedKvUpdateParams upd;
  JAXGPU_RETURN_IF_ERROR(MakePagedAttentionWithUpdateParams(
      query, k_pages, v_pages, k_new, v_new, block_table, lengths, out, workspace, k_out, v_out,
      scale, softcap, window_left, num_splits, &att, &upd));
  CopyUnaliased(upd);
  cpu::PagedKvUpdate(upd);
  cpu::PagedAttention(att);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxgpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuPagedAttentionFwdCpu, jaxgpu::PagedAttentionFwdCpu,
                              JAXGPU_PAGED_ATTENTION_FWD_BINDING(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuPagedAttentionQ8FwdCpu, jaxgpu::PagedAttentionQ8FwdCpu,
                              JAXGPU_PAGED_ATTENTION_Q8_FWD_BINDING(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuPagedKvUpdateFwdCpu, jaxgpu::PagedKvUpdateFwdCpu,
                              JAXGPU_PAGED_KV_UPDATE_FWD_BINDING(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuPagedKvUpdateQ8FwdCpu, jaxgpu::PagedKvUpdateQ8FwdCpu,
                              JAXGPU_PAGED_KV_UPDATE_Q8_FWD_BINDING(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxgpuPagedAttentionWithUpdateFwdCpu, jaxgpu::PagedAttentionWithUpdateFwdCpu,
    JAXGPU_PAGED_ATTENTION_WITH_UPDATE_FWD_BINDING(xla::ffi::Ffi::Bind()));
