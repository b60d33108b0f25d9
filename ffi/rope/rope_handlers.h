// Shared by the CPU and CUDA handlers of the RoPE family: the FFI binding's argument list
// and the checks that turn buffers into RopeParams.
//
// FFI contract (targets jaxgpu_rope_{fwd,bwd}; Python side: jaxgpu/ops/rope.py):
//   args  x (R, T, N, H) f32|bf16|f16, positions (P, T) s32 with P >= 1 dividing R
//   rets  y (R, T, N, H), the dtype of x
//   attrs theta f64 (> 0, finite), rotary_dim s32 (even, 0 <= rotary_dim <= H),
//         interleaved (bool)
// The bwd target is the same rotation by -angle (the transpose of a rotation is its
// inverse): x is then the cotangent dy and y the gradient dx.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "common/ffi_checks.h"
#include "rope/rope_params.h"

namespace jaxgpu {

#define JAXGPU_ROPE_BINDING(BIND)                    \
  BIND.Arg<::xla::ffi::AnyBuffer>() /* x */          \
      .Arg<::xla::ffi::AnyBuffer>() /* positions */  \
      .Ret<::xla::ffi::AnyBuffer>() /* y */          \
      .Attr<double>("theta")        /* theta */      \
      .Attr<int32_t>("rotary_dim")  /* rotary_dim */ \
      .Attr<bool>("interleaved")    /* interleaved */

inline ffi::Error MakeRopeParams(ffi::AnyBuffer x, ffi::AnyBuffer positions,
                                 ffi::Result<ffi::AnyBuffer> y, double theta, int32_t rotary_dim,
                                 bool interleaved, bool inverse, RopeParams* p) {
  auto dims = x.dimensions();
  if (dims.size() != 4) return ffi::Error::InvalidArgument("x: expected rank 4 (R, T, N, H)");
  DType dtype{};
  JAXGPU_RETURN_IF_ERROR(CheckDType(x, kFloatDTypes, "x", &dtype));
  const int64_t R = dims[0], T = dims[1], N = dims[2], H = dims[3];
  if (H % 2 != 0) return ffi::Error::InvalidArgument("x: the last dim (H) must be even");
  if (N * H > INT32_MAX) {
    return ffi::Error::InvalidArgument("x: heads * dim must be < 2^31 (one token's features)");
  }
  if (!(theta > 0.0) || !std::isfinite(theta)) {
    return ffi::Error::InvalidArgument("theta: must be positive and finite");
  }
  if (rotary_dim < 0 || rotary_dim % 2 != 0 || rotary_dim > H) {
    return ffi::Error::InvalidArgument("rotary_dim: must be even and in [0, " + std::to_string(H) +
                                       "]");
  }
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(y, x.element_type(), R * T * N * H, "y"));
  JAXGPU_RETURN_IF_ERROR(CheckDims(*y, {R, T, N, H}, "y"));
  if (positions.element_type() != ffi::DataType::S32) {
    return ffi::Error::InvalidArgument("positions: dtype must be int32");
  }
  auto pdims = positions.dimensions();
  if (pdims.size() != 2 || pdims[1] != T || pdims[0] < 1 || (R > 0 && R % pdims[0] != 0)) {
    return ffi::Error::InvalidArgument("positions: expected shape (P, " + std::to_string(T) +
                                       ") with P >= 1 dividing " + std::to_string(R));
  }
  *p = RopeParams{};
  p->dtype = dtype;
  p->interleaved = interleaved;
  p->inverse = inverse;
  p->rows = R;
  p->seq = T;
  p->heads = N;
  p->dim = H;
  p->rotary_dim = rotary_dim;
  p->pos_rows = pdims[0];
  p->x = x.untyped_data();
  p->positions = static_cast<const int32_t*>(positions.untyped_data());
  p->y = y->untyped_data();
  p->log2_theta = std::log2(theta);
  return ffi::Error::Success();
}

}  // namespace jaxgpu
