// CPU implementation of the RoPE family (for CI and CPU users).
#pragma once

#include "rope/rope_params.h"

namespace jaxgpu::cpu {

void Rope(const RopeParams& p);

}  // namespace jaxgpu::cpu
