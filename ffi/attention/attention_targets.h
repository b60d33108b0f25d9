// FFI targets of the attention family (see common/targets.h).
#pragma once

#include "common/targets.h"

#define JAXGPU_ATTENTION_TARGETS(X)             \
  X("jaxgpu_attention_fwd", JaxgpuAttentionFwd) \
  X("jaxgpu_attention_bwd", JaxgpuAttentionBwd)

JAXGPU_ATTENTION_TARGETS(JAXGPU_DECLARE_HANDLERS)
