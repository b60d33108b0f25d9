// FFI targets of the decode family (see common/targets.h): forward-only ops.
#pragma once

#include "common/targets.h"

// The _q8 targets take an 8-bit cache (int8 or float8_e4m3fn pages) and its float32 scales.
#define JAXGPU_DECODE_TARGETS(X)                                                 \
  X("jaxgpu_paged_attention_fwd", JaxgpuPagedAttentionFwd)                       \
  X("jaxgpu_paged_attention_q8_fwd", JaxgpuPagedAttentionQ8Fwd)                  \
  X("jaxgpu_paged_attention_with_update_fwd", JaxgpuPagedAttentionWithUpdateFwd) \
  X("jaxgpu_paged_kv_update_fwd", JaxgpuPagedKvUpdateFwd)                        \
  X("jaxgpu_paged_kv_update_q8_fwd", JaxgpuPagedKvUpdateQ8Fwd)

JAXGPU_DECODE_TARGETS(JAXGPU_DECLARE_HANDLERS)
