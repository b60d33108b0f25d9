// FFI targets of the matmul family (see common/targets.h).
#pragma once

#include "common/targets.h"

// linear: the dense GEMMs (cuBLASLt on CUDA); qlinear: the weight-only quantized forward.
#define JAXGPU_MATMUL_TARGETS(X)              \
  X("jaxgpu_linear_fwd", JaxgpuLinearFwd)     \
  X("jaxgpu_linear_dgrad", JaxgpuLinearDgrad) \
  X("jaxgpu_linear_wgrad", JaxgpuLinearWgrad) \
  X("jaxgpu_qlinear_fwd", JaxgpuQlinearFwd)   \
  X("jaxgpu_qlinear_dequant", JaxgpuQlinearDequant)

JAXGPU_MATMUL_TARGETS(JAXGPU_DECLARE_HANDLERS)
