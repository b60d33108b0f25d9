// CPU implementation of the attention family (for CI and CPU users): straightforward loops
// with float32 accumulation.
#pragma once

#include "attention/attention_params.h"

namespace jaxgpu::cpu {

void AttentionFwd(const AttentionParams& p);
void AttentionBwd(const AttentionParams& p);

}  // namespace jaxgpu::cpu
