// FFI targets of the softmax family (see common/targets.h).
#pragma once

#include "common/targets.h"

#define JAXGPU_SOFTMAX_TARGETS(X)           \
  X("jaxgpu_softmax_fwd", JaxgpuSoftmaxFwd) \
  X("jaxgpu_softmax_bwd", JaxgpuSoftmaxBwd)

JAXGPU_SOFTMAX_TARGETS(JAXGPU_DECLARE_HANDLERS)
