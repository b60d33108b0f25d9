// CPU implementation of the matmul family (for CI and CPU users): plain loops, float64
// accumulation.
#pragma once

#include "matmul/linear_params.h"
#include "matmul/qlinear_params.h"

namespace jaxgpu::cpu {

void LinearFwd(const LinearFwdParams& p);
void LinearDgrad(const LinearDgradParams& p);
void LinearWgrad(const LinearWgradParams& p);
void QLinearFwd(const QLinearParams& p);
void QDequant(const QDequantParams& p);

}  // namespace jaxgpu::cpu
