// CPU implementation of the activation family (for CI and CPU users).
#pragma once

#include "activation/activation_params.h"

namespace jaxgpu::cpu {

void Activation(const ActParams& p);

}  // namespace jaxgpu::cpu
