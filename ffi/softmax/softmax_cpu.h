// CPU implementation of the softmax family (for CI and CPU users).
#pragma once

#include "softmax/softmax_params.h"

namespace jaxgpu::cpu {

void SoftmaxFwd(const SoftmaxFwdParams& p);
void SoftmaxBwd(const SoftmaxBwdParams& p);

}  // namespace jaxgpu::cpu
