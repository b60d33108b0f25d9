// Shared by every ffi/<family>/<family>_targets.h. A family lists its handlers once:
//
//   #define JAXGPU_NORM_TARGETS(X) X("jaxgpu_rms_norm_fwd", JaxgpuRmsNormFwd) ...
//   JAXGPU_NORM_TARGETS(JAXGPU_DECLARE_HANDLERS)
//
// The CPU handler of stem S is the symbol SCpu, the CUDA one SCuda. The build generates
// JAXGPU_ALL_TARGETS(X) over every family for ffi/module_{cpu,cuda}.cc.
#pragma once

#include "xla/ffi/api/api.h"

#define JAXGPU_DECLARE_HANDLERS(name, stem)  \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(stem##Cpu); \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(stem##Cuda);
