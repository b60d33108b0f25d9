// FFI targets of the decode family (see common/targets.h): forward-only ops.
#pragma once

#include "common/targets.h"

#define JAXGPU_DECODE_TARGETS(X)                           \
  X("jaxgpu_paged_attention_fwd", JaxgpuPagedAttentionFwd) \
  X("jaxgpu_paged_kv_update_fwd", JaxgpuPagedKvUpdateFwd)

JAXGPU_DECODE_TARGETS(JAXGPU_DECLARE_HANDLERS)
