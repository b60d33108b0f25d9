// Shared by the CPU and CUDA handlers of the normalization family: the FFI bindings'
// argument lists and the checks that turn buffers into NormFwdParams / NormBwdParams.
//
// FFI contract (targets jaxgpu_{rms,layer}_norm_{fwd,bwd}; Python side: jaxgpu/ops/norm.py):
//   fwd  args  x (G,R,D), residual (G,R,D)|(0), weight (Gw,D)|(0), bias (Gb,D)|(0)
//        rets  y (G,R,D), h (G,R,D)|(0), mean (G,R) f32|(0), rstd (G,R) f32
//        attrs eps f32, weight_offset f32, has_residual, has_weight, has_bias (bool)
//   bwd  args  dy (G,R,D), dh (G,R,D)|(0), xh (G,R,D), weight (Gw,D)|(0),
//              mean (G,R) f32|(0), rstd (G,R) f32
//        rets  dx (G,R,D), dweight (G,D) f32|(0), dbias (G,D) f32|(0),
//              workspace (K,G,S,D) f32|(0)  (K = wanted gradients; S row slots, CUDA only)
//        attrs weight_offset f32, has_dh, has_weight, want_dweight, want_dbias (bool)
// Gw and Gb are 1 (shared by all groups) or G. Absent operands are size-0 buffers. weight
// and bias have x's dtype or float32 (master weights), one dtype for both; the gradients
// are float32 either way.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "common/ffi_checks.h"
#include "norm/norm_params.h"

namespace jaxgpu {

// Binding prefixes: the backend-specific handler appends its context (stream, scratch).
#define JAXGPU_NORM_FWD_BINDING(BIND)                   \
  BIND.Arg<::xla::ffi::AnyBuffer>() /* x */             \
      .Arg<::xla::ffi::AnyBuffer>() /* residual */      \
      .Arg<::xla::ffi::AnyBuffer>() /* weight */        \
      .Arg<::xla::ffi::AnyBuffer>() /* bias */          \
      .Ret<::xla::ffi::AnyBuffer>() /* y */             \
      .Ret<::xla::ffi::AnyBuffer>() /* h */             \
      .Ret<::xla::ffi::AnyBuffer>() /* mean */          \
      .Ret<::xla::ffi::AnyBuffer>() /* rstd */          \
      .Attr<float>("eps")           /* eps */           \
      .Attr<float>("weight_offset") /* weight_offset */ \
      .Attr<bool>("has_residual")   /* has_residual */  \
      .Attr<bool>("has_weight")     /* has_weight */    \
      .Attr<bool>("has_bias")       /* has_bias */

#define JAXGPU_NORM_BWD_BINDING(BIND)                   \
  BIND.Arg<::xla::ffi::AnyBuffer>() /* dy */            \
      .Arg<::xla::ffi::AnyBuffer>() /* dh */            \
      .Arg<::xla::ffi::AnyBuffer>() /* xh */            \
      .Arg<::xla::ffi::AnyBuffer>() /* weight */        \
      .Arg<::xla::ffi::AnyBuffer>() /* mean */          \
      .Arg<::xla::ffi::AnyBuffer>() /* rstd */          \
      .Ret<::xla::ffi::AnyBuffer>() /* dx */            \
      .Ret<::xla::ffi::AnyBuffer>() /* dweight */       \
      .Ret<::xla::ffi::AnyBuffer>() /* dbias */         \
      .Ret<::xla::ffi::AnyBuffer>() /* workspace */     \
      .Attr<float>("weight_offset") /* weight_offset */ \
      .Attr<bool>("has_dh")         /* has_dh */        \
      .Attr<bool>("has_weight")     /* has_weight */    \
      .Attr<bool>("want_dweight")   /* want_dweight */  \
      .Attr<bool>("want_dbias")     /* want_dbias */

namespace norm_detail {

// A (Gp, D) parameter shared by all G groups (Gp == 1) or one per group (Gp == G), of
// the parameters' element type `ptype` (see ParamType).
inline ffi::Error GroupParamStride(const ffi::AnyBuffer& buf, ffi::DataType ptype, int64_t G,
                                   int64_t D, const char* name, int64_t* stride) {
  auto dims = buf.dimensions();
  if (dims.size() != 2 || dims[1] != D || (dims[0] != 1 && dims[0] != G)) {
    return ffi::Error::InvalidArgument(std::string(name) + ": expected shape (1, " +
                                       std::to_string(D) + ") or (" + std::to_string(G) + ", " +
                                       std::to_string(D) + ")");
  }
  if (buf.element_type() != ptype) {
    return ffi::Error::InvalidArgument(
        std::string(name) + ": dtype " + DataTypeName(buf.element_type()) +
        " differs from the other parameter's (" + DataTypeName(ptype) + ")");
  }
  *stride = (dims[0] == 1) ? 0 : D;
  return ffi::Error::Success();
}

// The element type of the present parameters (weight, then bias): x's (`et`), or float32
// beside a 16-bit x (float32 master weights: the kernels load them as float32); one type
// for both. Without parameters, x's.
inline ffi::Error ParamType(ffi::DataType et, DType x_dtype, const ffi::AnyBuffer* first,
                            const char* name, ffi::DataType* ptype, DType* pdtype) {
  *ptype = et;
  if (first != nullptr) {
    *ptype = first->element_type();
    if (*ptype != et && *ptype != ffi::DataType::F32) {
      return ffi::Error::InvalidArgument(std::string(name) + ": dtype must be that of x (" +
                                         DataTypeName(et) + ") or float32, got " +
                                         DataTypeName(*ptype));
    }
  }
  *pdtype = *ptype == ffi::DataType::F32 ? DType::kF32 : x_dtype;
  return ffi::Error::Success();
}

inline ffi::Error Absent(const ffi::AnyBuffer& buf, const char* name) {
  if (buf.element_count() != 0) {
    return ffi::Error::InvalidArgument(std::string(name) + ": must be empty when absent");
  }
  return ffi::Error::Success();
}

}  // namespace norm_detail

inline ffi::Error MakeNormFwdParams(NormKind kind, ffi::AnyBuffer x, ffi::AnyBuffer residual,
                                    ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                                    ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> h,
                                    ffi::Result<ffi::AnyBuffer> mean,
                                    ffi::Result<ffi::AnyBuffer> rstd, float eps,
                                    float weight_offset, bool has_residual, bool has_weight,
                                    bool has_bias, NormFwdParams* p) {
  using namespace norm_detail;
  auto dims = x.dimensions();
  if (dims.size() != 3) return ffi::Error::InvalidArgument("x: expected rank 3 (G, R, D)");
  DType dtype{};
  JAXGPU_RETURN_IF_ERROR(CheckDType(x, kFloatDTypes, "x", &dtype));
  if (!(eps > 0.f) || !std::isfinite(eps)) {
    return ffi::Error::InvalidArgument("eps: must be positive and finite");
  }
  if (kind == NormKind::kRms && has_bias) {
    return ffi::Error::InvalidArgument("bias: rms_norm has no bias");
  }
  const int64_t G = dims[0], R = dims[1], D = dims[2];
  if (D > INT32_MAX) return ffi::Error::InvalidArgument("x: the last dim must be < 2^31");
  const int64_t n = G * R * D;
  const auto et = x.element_type();
  const auto f32 = ffi::DataType::F32;
  *p = NormFwdParams{};
  p->kind = kind;
  p->dtype = dtype;
  p->groups = G;
  p->rows_per_group = R;
  p->dim = D;
  p->eps = eps;
  p->weight_offset = weight_offset;
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(y, et, n, "y"));
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(rstd, f32, G * R, "rstd"));
  if (has_residual) {
    JAXGPU_RETURN_IF_ERROR(CheckBuffer(residual, et, n, "residual"));
    JAXGPU_RETURN_IF_ERROR(CheckBuffer(h, et, n, "h"));
    p->residual = residual.untyped_data();
    p->h = h->untyped_data();
  } else {
    JAXGPU_RETURN_IF_ERROR(Absent(residual, "residual"));
    JAXGPU_RETURN_IF_ERROR(Absent(*h, "h"));
  }
  ffi::DataType pt{};
  JAXGPU_RETURN_IF_ERROR(ParamType(et, dtype, has_weight ? &weight : (has_bias ? &bias : nullptr),
                                   has_weight ? "weight" : "bias", &pt, &p->param_dtype));
  if (has_weight) {
    JAXGPU_RETURN_IF_ERROR(GroupParamStride(weight, pt, G, D, "weight", &p->weight_group_stride));
    p->weight = weight.untyped_data();
  } else {
    JAXGPU_RETURN_IF_ERROR(Absent(weight, "weight"));
  }
  if (has_bias) {
    JAXGPU_RETURN_IF_ERROR(GroupParamStride(bias, pt, G, D, "bias", &p->bias_group_stride));
    p->bias = bias.untyped_data();
  } else {
    JAXGPU_RETURN_IF_ERROR(Absent(bias, "bias"));
  }
  if (kind == NormKind::kLayer) {
    JAXGPU_RETURN_IF_ERROR(CheckBuffer(mean, f32, G * R, "mean"));
    p->mean = static_cast<float*>(mean->untyped_data());
  } else {
    JAXGPU_RETURN_IF_ERROR(Absent(*mean, "mean"));
  }
  p->x = x.untyped_data();
  p->y = y->untyped_data();
  p->rstd = static_cast<float*>(rstd->untyped_data());
  return ffi::Error::Success();
}

inline ffi::Error MakeNormBwdParams(NormKind kind, ffi::AnyBuffer dy, ffi::AnyBuffer dh,
                                    ffi::AnyBuffer xh, ffi::AnyBuffer weight, ffi::AnyBuffer mean,
                                    ffi::AnyBuffer rstd, ffi::Result<ffi::AnyBuffer> dx,
                                    ffi::Result<ffi::AnyBuffer> dweight,
                                    ffi::Result<ffi::AnyBuffer> dbias,
                                    ffi::Result<ffi::AnyBuffer> workspace, float weight_offset,
                                    bool has_dh, bool has_weight, bool want_dweight,
                                    bool want_dbias, NormBwdParams* p) {
  using namespace norm_detail;
  auto dims = xh.dimensions();
  if (dims.size() != 3) return ffi::Error::InvalidArgument("xh: expected rank 3 (G, R, D)");
  DType dtype{};
  JAXGPU_RETURN_IF_ERROR(CheckDType(xh, kFloatDTypes, "xh", &dtype));
  if (kind == NormKind::kRms && want_dbias) {
    return ffi::Error::InvalidArgument("dbias: rms_norm has no bias");
  }
  const int64_t G = dims[0], R = dims[1], D = dims[2];
  if (D > INT32_MAX) return ffi::Error::InvalidArgument("xh: the last dim must be < 2^31");
  const int64_t n = G * R * D;
  const auto et = xh.element_type();
  const auto f32 = ffi::DataType::F32;
  *p = NormBwdParams{};
  p->kind = kind;
  p->dtype = dtype;
  p->groups = G;
  p->rows_per_group = R;
  p->dim = D;
  p->weight_offset = weight_offset;
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(dy, et, n, "dy"));
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(dx, et, n, "dx"));
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(rstd, f32, G * R, "rstd"));
  if (has_dh) {
    JAXGPU_RETURN_IF_ERROR(CheckBuffer(dh, et, n, "dh"));
    p->dh = dh.untyped_data();
  } else {
    JAXGPU_RETURN_IF_ERROR(Absent(dh, "dh"));
  }
  ffi::DataType pt{};
  JAXGPU_RETURN_IF_ERROR(
      ParamType(et, dtype, has_weight ? &weight : nullptr, "weight", &pt, &p->param_dtype));
  if (has_weight) {
    JAXGPU_RETURN_IF_ERROR(GroupParamStride(weight, pt, G, D, "weight", &p->weight_group_stride));
    p->weight = weight.untyped_data();
  } else {
    JAXGPU_RETURN_IF_ERROR(Absent(weight, "weight"));
  }
  if (kind == NormKind::kLayer) {
    JAXGPU_RETURN_IF_ERROR(CheckBuffer(mean, f32, G * R, "mean"));
    p->mean = static_cast<const float*>(mean.untyped_data());
  } else {
    JAXGPU_RETURN_IF_ERROR(Absent(mean, "mean"));
  }
  if (want_dweight) {
    JAXGPU_RETURN_IF_ERROR(CheckBuffer(dweight, f32, G * D, "dweight"));
    p->dweight = static_cast<float*>(dweight->untyped_data());
  } else {
    JAXGPU_RETURN_IF_ERROR(Absent(*dweight, "dweight"));
  }
  if (want_dbias) {
    JAXGPU_RETURN_IF_ERROR(CheckBuffer(dbias, f32, G * D, "dbias"));
    p->dbias = static_cast<float*>(dbias->untyped_data());
  } else {
    JAXGPU_RETURN_IF_ERROR(Absent(*dbias, "dbias"));
  }
  if (workspace->element_count() != 0) {
    auto wd = workspace->dimensions();
    const int64_t k = int64_t(want_dweight) + int64_t(want_dbias);
    if (workspace->element_type() != f32 || wd.size() != 4 || wd[0] != k || wd[1] != G ||
        wd[2] < 1 || wd[3] != D) {
      return ffi::Error::InvalidArgument("workspace: expected float32 (" + std::to_string(k) +
                                         ", " + std::to_string(G) + ", slots, " +
                                         std::to_string(D) + ")");
    }
    p->workspace = static_cast<float*>(workspace->untyped_data());
    p->slots = wd[2];
  }
  p->dy = dy.untyped_data();
  p->xh = xh.untyped_data();
  p->rstd = static_cast<const float*>(rstd.untyped_data());
  p->dx = dx->untyped_data();
  return ffi::Error::Success();
}

}  // namespace jaxgpu
