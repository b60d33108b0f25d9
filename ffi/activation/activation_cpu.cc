// Straightforward CPU activations: blocks of elements converted to float32 once (one dtype
// switch per block), the shared functors of activation_math.h applied, results rounded
// once to the storage dtype. The same math as the CUDA kernels, std::exp/std::erf in place
// of expf/erff.
#include "activation/activation_cpu.h"

#include <algorithm>

#include "activation/activation_math.h"
#include "common/cpu_float.h"

namespace jaxgpu::cpu {
namespace {

// 1024 floats per array: up to 5 arrays (20 KiB) on the stack, inside L1.
constexpr int64_t kBlock = 1024;

template <class Op>
void Run(const ActParams& p) {
  float in[Op::kIn][kBlock];
  float out[Op::kOut][kBlock];
  for (int64_t at = 0; at < p.n; at += kBlock) {
    const int64_t m = std::min(kBlock, p.n - at);
    for (int i = 0; i < Op::kIn; ++i) LoadFloats(p.in[i], p.dtype, at, m, in[i]);
    for (int64_t e = 0; e < m; ++e) {
      float a[Op::kIn], r[Op::kOut];
      for (int i = 0; i < Op::kIn; ++i) a[i] = in[i][e];
      Op::Apply(a, r);
      for (int i = 0; i < Op::kOut; ++i) out[i][e] = r[i];
    }
    for (int i = 0; i < Op::kOut; ++i) StoreFloats(p.out[i], p.dtype, at, m, out[i]);
  }
}

}  // namespace

void Activation(const ActParams& p) {
  act::DispatchOp(p, [&](auto tag) { Run<typename decltype(tag)::type>(p); });
}

}  // namespace jaxgpu::cpu
