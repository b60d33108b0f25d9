// FFI targets of the normalization family (see common/targets.h).
#pragma once

#include "common/targets.h"

#define JAXGPU_NORM_TARGETS(X)                   \
  X("jaxgpu_rms_norm_fwd", JaxgpuRmsNormFwd)     \
  X("jaxgpu_rms_norm_bwd", JaxgpuRmsNormBwd)     \
  X("jaxgpu_layer_norm_fwd", JaxgpuLayerNormFwd) \
  X("jaxgpu_layer_norm_bwd", JaxgpuLayerNormBwd)

JAXGPU_NORM_TARGETS(JAXGPU_DECLARE_HANDLERS)
