// CPU implementation of the cross-entropy family (for CI and CPU users).
#pragma once

#include "cross_entropy/cross_entropy_params.h"

namespace jaxgpu::cpu {

void CrossEntropyFwd(const CrossEntropyFwdParams& p);
void CrossEntropyBwd(const CrossEntropyBwdParams& p);

}  // namespace jaxgpu::cpu
