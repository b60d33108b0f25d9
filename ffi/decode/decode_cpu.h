// CPU implementation of the decode family (for CI and CPU users).
#pragma once

#include "decode/decode_params.h"

namespace jaxgpu::cpu {

void PagedAttention(const PagedAttentionParams& p);
// Writes into p.k_pages / p.v_pages, which must already hold the caches (the handler copies
// them there when XLA did not alias the buffers).
void PagedKvUpdate(const PagedKvUpdateParams& p);

}  // namespace jaxgpu::cpu
