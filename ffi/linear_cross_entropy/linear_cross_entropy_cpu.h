// CPU fused linear + cross-entropy (linear_cross_entropy_cpu.cc; no XLA types).
#pragma once

#include "linear_cross_entropy/linear_cross_entropy_params.h"

namespace jaxgpu::cpu {

void LinearCrossEntropyFwd(const LinearCrossEntropyFwdParams& p);
void LinearCrossEntropyBwd(const LinearCrossEntropyBwdParams& p);

}  // namespace jaxgpu::cpu
