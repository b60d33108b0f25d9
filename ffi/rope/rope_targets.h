// FFI targets of the rotary position embedding family (see common/targets.h).
#pragma once

#include "common/targets.h"

#define JAXGPU_ROPE_TARGETS(X)        \
  X("jaxgpu_rope_fwd", JaxgpuRopeFwd) \
  X("jaxgpu_rope_bwd", JaxgpuRopeBwd)

JAXGPU_ROPE_TARGETS(JAXGPU_DECLARE_HANDLERS)
