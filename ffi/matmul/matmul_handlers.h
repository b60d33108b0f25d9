// Shared by the CPU and CUDA handlers of the matmul family: the FFI bindings' argument
// lists and the checks that turn buffers into the params structs.
//
// FFI contract (Python side: jaxgpu/ops/matmul.py; math in linear_params.h and
// qlinear_params.h):
//   jaxgpu_linear_fwd
//     args  x (G, M, K) f32|bf16|f16, w (Gw, K, N) same dtype (Gw in {1, G}),
//           bias (Gb, N) same dtype (Gb in {1, G}; (0,) without)
//     rets  y (G, M, N), aux (G, M, N) (or (0,) when not wanted), workspace (W,) u8
//     attrs epilogue s32 (LinearEpilogue), has_bias, want_aux
//   jaxgpu_linear_dgrad
//     args  dz (G, M, N), w (Gw, K, N)
//     rets  dx (G, M, K), workspace (W,) u8
//   jaxgpu_linear_wgrad
//     args  x (G, M, K), dz (G, M, N)
//     rets  dw (G, K, N), dbias (G, N) (or (0,) when not wanted), workspace (W,) u8
//     attrs want_dbias
//   jaxgpu_qlinear_fwd
//     args  x (G, M, K) f32|bf16|f16 (bf16|f16 on CUDA), packed (Gw, KT, NT, 32 * words)
//           s32, scales (Gw, K / group_size, N) in x's dtype, zeros (Gw, K / group_size, N)
//           u8 (or (0,)), bias (Gb, N) in x's dtype (or (0,))
//     rets  y (G, M, N), workspace (F,) f32 (split-K partial sums; (0,) on the CPU)
//     attrs bits s32 (4 | 8), group_size s32, activation s32 (QActivation), has_zeros,
//           has_bias
//   jaxgpu_qlinear_dequant
//     args  packed (G, KT, NT, 32 * words) s32, scales (G, K / group_size, N) f32|bf16|f16,
//           zeros (G, K / group_size, N) u8 (or (0,))
//     rets  w (G, K, N) in the scales' dtype
//     attrs bits, group_size, has_zeros
// M, N may be 0 (nothing to do); K must be positive.
#pragma once

#include <cstdint>
#include <string>

#include "common/ffi_checks.h"
#include "matmul/linear_params.h"
#include "matmul/qlinear_params.h"

namespace jaxgpu {

#define JAXGPU_LINEAR_FWD_BINDING(BIND)             \
  BIND.Arg<::xla::ffi::AnyBuffer>() /* x */         \
      .Arg<::xla::ffi::AnyBuffer>() /* w */         \
      .Arg<::xla::ffi::AnyBuffer>() /* bias */      \
      .Ret<::xla::ffi::AnyBuffer>() /* y */         \
      .Ret<::xla::ffi::AnyBuffer>() /* aux */       \
      .Ret<::xla::ffi::AnyBuffer>() /* workspace */ \
      .Attr<int32_t>("epilogue")    /* epilogue */  \
      .Attr<bool>("has_bias")       /* has_bias */  \
      .Attr<bool>("want_aux")       /* want_aux */

#define JAXGPU_LINEAR_DGRAD_BINDING(BIND)    \
  BIND.Arg<::xla::ffi::AnyBuffer>() /* dz */ \
      .Arg<::xla::ffi::AnyBuffer>() /* w */  \
      .Ret<::xla::ffi::AnyBuffer>() /* dx */ \
      .Ret<::xla::ffi::AnyBuffer>() /* workspace */

#define JAXGPU_LINEAR_WGRAD_BINDING(BIND)           \
  BIND.Arg<::xla::ffi::AnyBuffer>() /* x */         \
      .Arg<::xla::ffi::AnyBuffer>() /* dz */        \
      .Ret<::xla::ffi::AnyBuffer>() /* dw */        \
      .Ret<::xla::ffi::AnyBuffer>() /* dbias */     \
      .Ret<::xla::ffi::AnyBuffer>() /* workspace */ \
      .Attr<bool>("want_dbias")     /* want_dbias */

#define JAXGPU_QLINEAR_FWD_BINDING(BIND)             \
  BIND.Arg<::xla::ffi::AnyBuffer>() /* x */          \
      .Arg<::xla::ffi::AnyBuffer>() /* packed */     \
      .Arg<::xla::ffi::AnyBuffer>() /* scales */     \
      .Arg<::xla::ffi::AnyBuffer>() /* zeros */      \
      .Arg<::xla::ffi::AnyBuffer>() /* bias */       \
      .Ret<::xla::ffi::AnyBuffer>() /* y */          \
      .Ret<::xla::ffi::AnyBuffer>() /* workspace */  \
      .Attr<int32_t>("bits")        /* bits */       \
      .Attr<int32_t>("group_size")  /* group_size */ \
      .Attr<int32_t>("activation")  /* activation */ \
      .Attr<bool>("has_zeros")      /* has_zeros */  \
      .Attr<bool>("has_bias")       /* has_bias */

#define JAXGPU_QLINEAR_DEQUANT_BINDING(BIND)         \
  BIND.Arg<::xla::ffi::AnyBuffer>() /* packed */     \
      .Arg<::xla::ffi::AnyBuffer>() /* scales */     \
      .Arg<::xla::ffi::AnyBuffer>() /* zeros */      \
      .Ret<::xla::ffi::AnyBuffer>() /* w */          \
      .Attr<int32_t>("bits")        /* bits */       \
      .Attr<int32_t>("group_size")  /* group_size */ \
      .Attr<bool>("has_zeros")      /* has_zeros */

namespace matmul_detail {

// `buf` of rank 3 (d0, d1, d2), its dims returned.
template <typename Buf>
ffi::Error Dims3(const Buf& buf, const char* name, int64_t* d0, int64_t* d1, int64_t* d2) {
  const auto dims = buf.dimensions();
  if (dims.size() != 3) {
    return ffi::Error::InvalidArgument(std::string(name) + ": expected rank 3");
  }
  *d0 = dims[0];
  *d1 = dims[1];
  *d2 = dims[2];
  if (*d0 < 0 || *d1 < 0 || *d2 < 0) {
    return ffi::Error::InvalidArgument(std::string(name) + ": negative dimension");
  }
  return ffi::Error::Success();
}

inline ffi::Error SameDType(const ffi::AnyBuffer& buf, DType dtype, const char* name) {
  DType got;
  JAXGPU_RETURN_IF_ERROR(CheckDType(buf, DTypeBit(dtype), name, &got));
  return ffi::Error::Success();
}

// A parameter's group count: 1 or `groups` (a weight or bias shared by every group).
inline ffi::Error ParamGroups(int64_t got, int64_t groups, const char* name) {
  if (got != 1 && got != groups) {
    return ffi::Error::InvalidArgument(std::string(name) + ": group dim must be 1 or " +
                                       std::to_string(groups) + ", got " + std::to_string(got));
  }
  return ffi::Error::Success();
}

template <typename Buf>
ffi::Error Bias(const Buf& bias, bool has_bias, DType dtype, int64_t groups, int64_t n,
                int64_t* bias_groups) {
  if (!has_bias) {
    *bias_groups = 0;
    if (bias.element_count() != 0) {
      return ffi::Error::InvalidArgument("bias: must be empty when has_bias is false");
    }
    return ffi::Error::Success();
  }
  JAXGPU_RETURN_IF_ERROR(SameDType(bias, dtype, "bias"));
  const auto dims = bias.dimensions();
  if (dims.size() != 2 || dims[1] != n) {
    return ffi::Error::InvalidArgument("bias: expected shape (1 or G, N)");
  }
  *bias_groups = dims[0];
  return ParamGroups(dims[0], groups, "bias");
}

// The quantized weight's group size: it divides K and is a multiple of 16 or K itself.
inline ffi::Error GroupSize(int32_t group_size, int64_t k) {
  if (group_size <= 0 || k % group_size != 0 || (group_size % 16 != 0 && group_size != k)) {
    return ffi::Error::InvalidArgument(
        "group_size: must divide K and be a multiple of 16 or K itself");
  }
  return ffi::Error::Success();
}

// A packed weight of `groups` (K, N) matrices (qlinear_params.h's layout) and its zero
// points (scale_rows x N uint8 each), or an empty zeros without them.
inline ffi::Error PackedAndZeros(const ffi::AnyBuffer& packed, const ffi::AnyBuffer& zeros,
                                 bool has_zeros, int bits, int64_t groups, int64_t k, int64_t n,
                                 int64_t scale_rows) {
  const auto pd = packed.dimensions();
  if (packed.element_type() != ffi::DataType::S32 || pd.size() != 4 || pd[0] != groups ||
      pd[1] != QTilesK(k) || pd[2] != QTilesN(n) || pd[3] != QWordsPerTile(bits)) {
    return ffi::Error::InvalidArgument(
        "packed: expected int32 (G, ceil(K / 64), ceil(N / 16), 32 * words per lane)");
  }
  if (has_zeros) {
    return CheckBuffer(zeros, ffi::DataType::U8, groups * scale_rows * n, "zeros");
  }
  if (zeros.element_count() != 0) {
    return ffi::Error::InvalidArgument("zeros: must be empty when has_zeros is false");
  }
  return ffi::Error::Success();
}

inline ffi::Error PositiveK(int64_t k) {
  if (k <= 0) return ffi::Error::InvalidArgument("x: K (the contracted dim) must be positive");
  return ffi::Error::Success();
}

}  // namespace matmul_detail

inline ffi::Error MakeLinearFwdParams(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer bias,
                                      ffi::Result<ffi::AnyBuffer>& y,
                                      ffi::Result<ffi::AnyBuffer>& aux,
                                      ffi::Result<ffi::AnyBuffer>& workspace, int32_t epilogue,
                                      bool has_bias, bool want_aux, LinearFwdParams* p) {
  using namespace matmul_detail;
  JAXGPU_RETURN_IF_ERROR(CheckDType(x, kFloatDTypes, "x", &p->dtype));
  JAXGPU_RETURN_IF_ERROR(Dims3(x, "x", &p->groups, &p->m, &p->k));
  JAXGPU_RETURN_IF_ERROR(PositiveK(p->k));
  JAXGPU_RETURN_IF_ERROR(SameDType(w, p->dtype, "w"));
  int64_t wk;
  JAXGPU_RETURN_IF_ERROR(Dims3(w, "w", &p->weight_groups, &wk, &p->n));
  if (wk != p->k) return ffi::Error::InvalidArgument("w: expected shape (Gw, K, N), K of x");
  JAXGPU_RETURN_IF_ERROR(ParamGroups(p->weight_groups, p->groups, "w"));
  JAXGPU_RETURN_IF_ERROR(Bias(bias, has_bias, p->dtype, p->groups, p->n, &p->bias_groups));
  if (epilogue < 0 || epilogue > static_cast<int32_t>(LinearEpilogue::kGeluTanh)) {
    return ffi::Error::InvalidArgument("epilogue: expected 0 (none), 1 (relu) or 2 (gelu)");
  }
  p->epilogue = static_cast<LinearEpilogue>(epilogue);
  const ffi::DataType t = x.element_type();
  const int64_t out = p->groups * p->m * p->n;
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(y, t, out, "y"));
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(aux, t, want_aux ? out : 0, "aux"));
  if (workspace->element_type() != ffi::DataType::U8) {
    return ffi::Error::InvalidArgument("workspace: expected uint8");
  }
  p->x = x.untyped_data();
  p->w = w.untyped_data();
  p->bias = has_bias ? bias.untyped_data() : nullptr;
  p->y = y->untyped_data();
  p->aux = want_aux ? aux->untyped_data() : nullptr;
  p->workspace_bytes = static_cast<int64_t>(workspace->element_count());
  p->workspace = p->workspace_bytes > 0 ? workspace->untyped_data() : nullptr;
  return ffi::Error::Success();
}

inline ffi::Error MakeLinearDgradParams(ffi::AnyBuffer dz, ffi::AnyBuffer w,
                                        ffi::Result<ffi::AnyBuffer>& dx,
                                        ffi::Result<ffi::AnyBuffer>& workspace,
                                        LinearDgradParams* p) {
  using namespace matmul_detail;
  JAXGPU_RETURN_IF_ERROR(CheckDType(dz, kFloatDTypes, "dz", &p->dtype));
  JAXGPU_RETURN_IF_ERROR(Dims3(dz, "dz", &p->groups, &p->m, &p->n));
  JAXGPU_RETURN_IF_ERROR(SameDType(w, p->dtype, "w"));
  int64_t wn;
  JAXGPU_RETURN_IF_ERROR(Dims3(w, "w", &p->weight_groups, &p->k, &wn));
  if (wn != p->n) return ffi::Error::InvalidArgument("w: expected shape (Gw, K, N), N of dz");
  JAXGPU_RETURN_IF_ERROR(ParamGroups(p->weight_groups, p->groups, "w"));
  JAXGPU_RETURN_IF_ERROR(PositiveK(p->n));
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(dx, dz.element_type(), p->groups * p->m * p->k, "dx"));
  if (workspace->element_type() != ffi::DataType::U8) {
    return ffi::Error::InvalidArgument("workspace: expected uint8");
  }
  p->dz = dz.untyped_data();
  p->w = w.untyped_data();
  p->dx = dx->untyped_data();
  p->workspace_bytes = static_cast<int64_t>(workspace->element_count());
  p->workspace = p->workspace_bytes > 0 ? workspace->untyped_data() : nullptr;
  return ffi::Error::Success();
}

inline ffi::Error MakeLinearWgradParams(ffi::AnyBuffer x, ffi::AnyBuffer dz,
                                        ffi::Result<ffi::AnyBuffer>& dw,
                                        ffi::Result<ffi::AnyBuffer>& dbias,
                                        ffi::Result<ffi::AnyBuffer>& workspace, bool want_dbias,
                                        LinearWgradParams* p) {
  using namespace matmul_detail;
  JAXGPU_RETURN_IF_ERROR(CheckDType(x, kFloatDTypes, "x", &p->dtype));
  JAXGPU_RETURN_IF_ERROR(Dims3(x, "x", &p->groups, &p->m, &p->k));
  JAXGPU_RETURN_IF_ERROR(SameDType(dz, p->dtype, "dz"));
  int64_t dg, dm;
  JAXGPU_RETURN_IF_ERROR(Dims3(dz, "dz", &dg, &dm, &p->n));
  if (dg != p->groups || dm != p->m) {
    return ffi::Error::InvalidArgument("dz: expected shape (G, M, N), G and M of x");
  }
  const ffi::DataType t = x.element_type();
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(dw, t, p->groups * p->k * p->n, "dw"));
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(dbias, t, want_dbias ? p->groups * p->n : 0, "dbias"));
  if (workspace->element_type() != ffi::DataType::U8) {
    return ffi::Error::InvalidArgument("workspace: expected uint8");
  }
  p->x = x.untyped_data();
  p->dz = dz.untyped_data();
  p->dw = dw->untyped_data();
  p->dbias = want_dbias ? dbias->untyped_data() : nullptr;
  p->workspace_bytes = static_cast<int64_t>(workspace->element_count());
  p->workspace = p->workspace_bytes > 0 ? workspace->untyped_data() : nullptr;
  return ffi::Error::Success();
}

inline ffi::Error MakeQLinearParams(ffi::AnyBuffer x, ffi::AnyBuffer packed, ffi::AnyBuffer scales,
                                    ffi::AnyBuffer zeros, ffi::AnyBuffer bias,
                                    ffi::Result<ffi::AnyBuffer>& y,
                                    ffi::Result<ffi::AnyBuffer>& workspace, int32_t bits,
                                    int32_t group_size, int32_t activation, bool has_zeros,
                                    bool has_bias, DTypeSet x_dtypes, QLinearParams* p) {
  using namespace matmul_detail;
  JAXGPU_RETURN_IF_ERROR(CheckDType(x, x_dtypes, "x", &p->dtype));
  JAXGPU_RETURN_IF_ERROR(Dims3(x, "x", &p->groups, &p->m, &p->k));
  JAXGPU_RETURN_IF_ERROR(PositiveK(p->k));
  if (bits != 4 && bits != 8) return ffi::Error::InvalidArgument("bits: expected 4 or 8");
  p->bits = bits;
  JAXGPU_RETURN_IF_ERROR(GroupSize(group_size, p->k));
  p->group_size = group_size;
  if (activation < 0 || activation > static_cast<int32_t>(QActivation::kSilu)) {
    return ffi::Error::InvalidArgument("activation: expected a QActivation code in [0, 4]");
  }
  p->activation = static_cast<QActivation>(activation);
  JAXGPU_RETURN_IF_ERROR(SameDType(scales, p->dtype, "scales"));
  int64_t scale_rows;
  JAXGPU_RETURN_IF_ERROR(Dims3(scales, "scales", &p->weight_groups, &scale_rows, &p->n));
  if (scale_rows != p->k / group_size) {
    return ffi::Error::InvalidArgument("scales: expected shape (Gw, K / group_size, N)");
  }
  JAXGPU_RETURN_IF_ERROR(ParamGroups(p->weight_groups, p->groups, "scales"));
  JAXGPU_RETURN_IF_ERROR(
      PackedAndZeros(packed, zeros, has_zeros, bits, p->weight_groups, p->k, p->n, scale_rows));
  JAXGPU_RETURN_IF_ERROR(Bias(bias, has_bias, p->dtype, p->groups, p->n, &p->bias_groups));
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(y, x.element_type(), p->groups * p->m * p->n, "y"));
  if (workspace->element_type() != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument("workspace: expected float32");
  }
  p->x = x.untyped_data();
  p->packed = static_cast<const int32_t*>(packed.untyped_data());
  p->scales = scales.untyped_data();
  p->zeros = has_zeros ? static_cast<const uint8_t*>(zeros.untyped_data()) : nullptr;
  p->bias = has_bias ? bias.untyped_data() : nullptr;
  p->y = y->untyped_data();
  p->workspace_floats = static_cast<int64_t>(workspace->element_count());
  p->workspace = p->workspace_floats > 0 ? static_cast<float*>(workspace->untyped_data()) : nullptr;
  return ffi::Error::Success();
}

inline ffi::Error MakeQDequantParams(ffi::AnyBuffer packed, ffi::AnyBuffer scales,
                                     ffi::AnyBuffer zeros, ffi::Result<ffi::AnyBuffer>& w,
                                     int32_t bits, int32_t group_size, bool has_zeros,
                                     QDequantParams* p) {
  using namespace matmul_detail;
  JAXGPU_RETURN_IF_ERROR(CheckDType(scales, kFloatDTypes, "scales", &p->dtype));
  if (bits != 4 && bits != 8) return ffi::Error::InvalidArgument("bits: expected 4 or 8");
  p->bits = bits;
  JAXGPU_RETURN_IF_ERROR(Dims3(*w, "w", &p->groups, &p->k, &p->n));
  JAXGPU_RETURN_IF_ERROR(PositiveK(p->k));
  if (w->element_type() != scales.element_type()) {
    return ffi::Error::InvalidArgument("w: must have the scales' dtype");
  }
  JAXGPU_RETURN_IF_ERROR(GroupSize(group_size, p->k));
  p->group_size = group_size;
  const int64_t rows = p->k / group_size;
  JAXGPU_RETURN_IF_ERROR(CheckDims(scales, {p->groups, rows, p->n}, "scales"));
  JAXGPU_RETURN_IF_ERROR(
      PackedAndZeros(packed, zeros, has_zeros, bits, p->groups, p->k, p->n, rows));
  p->packed = static_cast<const int32_t*>(packed.untyped_data());
  p->scales = scales.untyped_data();
  p->zeros = has_zeros ? static_cast<const uint8_t*>(zeros.untyped_data()) : nullptr;
  p->w = w->untyped_data();
  return ffi::Error::Success();
}

}  // namespace jaxgpu
