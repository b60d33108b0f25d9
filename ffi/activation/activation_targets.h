// FFI targets of the activation family (see common/targets.h). The gelu and geglu targets
// take a bool attribute `approximate` (tanh form when true, erf form when false).
#pragma once

#include "common/targets.h"

#define JAXGPU_ACTIVATION_TARGETS(X)        \
  X("jaxgpu_relu_fwd", JaxgpuReluFwd)       \
  X("jaxgpu_relu_bwd", JaxgpuReluBwd)       \
  X("jaxgpu_sigmoid_fwd", JaxgpuSigmoidFwd) \
  X("jaxgpu_sigmoid_bwd", JaxgpuSigmoidBwd) \
  X("jaxgpu_silu_fwd", JaxgpuSiluFwd)       \
  X("jaxgpu_silu_bwd", JaxgpuSiluBwd)       \
  X("jaxgpu_gelu_fwd", JaxgpuGeluFwd)       \
  X("jaxgpu_gelu_bwd", JaxgpuGeluBwd)       \
  X("jaxgpu_swiglu_fwd", JaxgpuSwigluFwd)   \
  X("jaxgpu_swiglu_bwd", JaxgpuSwigluBwd)   \
  X("jaxgpu_geglu_fwd", JaxgpuGegluFwd)     \
  X("jaxgpu_geglu_bwd", JaxgpuGegluBwd)

JAXGPU_ACTIVATION_TARGETS(JAXGPU_DECLARE_HANDLERS)
