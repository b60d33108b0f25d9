// CPU implementation of the normalization family (for CI and CPU users).
#pragma once

#include "norm/norm_params.h"

namespace jaxgpu::cpu {

void NormFwd(const NormFwdParams& p);
void NormBwd(const NormBwdParams& p);

}  // namespace jaxgpu::cpu
