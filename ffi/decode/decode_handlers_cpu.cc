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
  JAXGPU_RETURN_IF_ERROR(MakePagedAttentionParams(query, k_pages, v_pages, block_table, lengths,
                                                  out, workspace, scale, softcap, window_left,
                                                  num_splits, &p));
  cpu::PagedAttention(p);
  return ffi::Error::Success();
}

ffi::Error PagedKvUpdateFwdCpu(ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, ffi::AnyBuffer k_new,
                               ffi::AnyBuffer v_new, ffi::AnyBuffer block_table,
                               ffi::AnyBuffer positions, ffi::Result<ffi::AnyBuffer> k_out,
                               ffi::Result<ffi::AnyBuffer> v_out) {
  PagedKvUpdateParams p;
  JAXGPU_RETURN_IF_ERROR(MakePagedKvUpdateParams(k_pages, v_pages, k_new, v_new, block_table,
                                                 positions, k_out, v_out, &p));
  // XLA aliases the results to the caches (input_output_aliases), so this copy never runs
  // from jaxgpu; it keeps a direct call with separate buffers correct.
  const size_t bytes = static_cast<size_t>(PagedKvPoolBytes(p));
  if (p.k_pages != p.k_pages_in) std::memcpy(p.k_pages, p.k_pages_in, bytes);
  if (p.v_pages != p.v_pages_in) std::memcpy(p.v_pages, p.v_pages_in, bytes);
  cpu::PagedKvUpdate(p);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxgpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuPagedAttentionFwdCpu, jaxgpu::PagedAttentionFwdCpu,
                              JAXGPU_PAGED_ATTENTION_FWD_BINDING(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuPagedKvUpdateFwdCpu, jaxgpu::PagedKvUpdateFwdCpu,
                              JAXGPU_PAGED_KV_UPDATE_FWD_BINDING(xla::ffi::Ffi::Bind()));
