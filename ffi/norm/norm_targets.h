// Handler symbols of the normalization family, registered by ffi/module_{cpu,cuda}.cc.
#pragma once

#include "xla/ffi/api/api.h"

// X(target name, handler symbol stem): the CPU handler is <stem>Cpu, the CUDA one <stem>Cuda.
#define JAXGPU_NORM_TARGETS(X)                     \
  X("jaxgpu_rms_norm_fwd", JaxgpuRmsNormFwd)       \
  X("jaxgpu_rms_norm_bwd", JaxgpuRmsNormBwd)       \
  X("jaxgpu_layer_norm_fwd", JaxgpuLayerNormFwd)   \
  X("jaxgpu_layer_norm_bwd", JaxgpuLayerNormBwd)

#define JAXGPU_DECLARE_CPU_AND_CUDA(name, stem) \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(stem##Cpu);    \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(stem##Cuda);
JAXGPU_NORM_TARGETS(JAXGPU_DECLARE_CPU_AND_CUDA)
#undef JAXGPU_DECLARE_CPU_AND_CUDA
