// Launch parameters of the activation family: the one plain struct at the host/device (and
// host/CPU) boundary. No XLA or CUDA types.
//
// Every op is elementwise over n elements of one storage dtype, so the kernels see flat
// buffers: the shape only matters to the handlers' checks.
//   unary  forward   in {x}            out {y}
//          backward  in {x, dy}        out {dx}
//   gated  forward   in {gate, up}     out {y}            y = act(gate) * up
//          backward  in {gate, up, dy} out {dgate, dup}   both in one pass
#pragma once

#include <cstdint>

#include "common/dtype.h"

namespace jaxgpu {

enum class ActKind : int32_t {
  kRelu = 0,
  kSigmoid = 1,
  kSilu = 2,
  kGeluTanh = 3,  // jax.nn.gelu(approximate=True)
  kGeluErf = 4,   // jax.nn.gelu(approximate=False)
};

struct ActParams {
  ActKind kind;
  bool gated;
  bool backward;
  DType dtype;        // of every input and output
  int64_t n;          // elements of each buffer
  const void* in[3];  // see the table above; unused entries nullptr
  void* out[2];
};

inline int ActInputs(const ActParams& p) { return (p.gated ? 2 : 1) + (p.backward ? 1 : 0); }
inline int ActOutputs(const ActParams& p) { return (p.gated && p.backward) ? 2 : 1; }

}  // namespace jaxgpu
