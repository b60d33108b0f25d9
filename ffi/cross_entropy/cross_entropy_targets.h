// FFI targets of the cross-entropy family (see common/targets.h).
#pragma once

#include "common/targets.h"

#define JAXGPU_CROSS_ENTROPY_TARGETS(X)                \
  X("jaxgpu_cross_entropy_fwd", JaxgpuCrossEntropyFwd) \
  X("jaxgpu_cross_entropy_bwd", JaxgpuCrossEntropyBwd)

JAXGPU_CROSS_ENTROPY_TARGETS(JAXGPU_DECLARE_HANDLERS)
