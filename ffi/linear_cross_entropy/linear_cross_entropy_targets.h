// FFI targets of the fused linear + cross-entropy family (see common/targets.h).
#pragma once

#include "common/targets.h"

#define JAXGPU_LINEAR_CROSS_ENTROPY_TARGETS(X)                      \
  X("jaxgpu_linear_cross_entropy_fwd", JaxgpuLinearCrossEntropyFwd) \
  X("jaxgpu_linear_cross_entropy_bwd", JaxgpuLinearCrossEntropyBwd)

JAXGPU_LINEAR_CROSS_ENTROPY_TARGETS(JAXGPU_DECLARE_HANDLERS)
