// Shared by the CPU and CUDA handlers of the fused linear + cross-entropy: the FFI bindings'
// argument lists and the checks that turn buffers into the params structs.
//
// FFI contract (targets jaxgpu_linear_cross_entropy_{fwd,bwd}; Python side:
// jaxgpu/ops/linear_cross_entropy.py; semantics: linear_cross_entropy_params.h):
//   fwd  args  x (G, ...rows, D) f32|bf16|f16, w (Gw, V, D) or (Gw, D, V) of x's dtype,
//              labels (G, ...rows) s32, vocab_ids (k, V) s32 (the slice's global ids:
//              only the first is read, as the offset)
//        rets  lse, zlabel, zsum (G, ...rows) f32; scratch (bytes) u8
//   bwd  args  x, w, labels, vocab_ids as fwd, lse (G, ...rows) f32, dloss (G, ...rows) f32
//        rets  dx (G, ...rows, D) f32, dw (G, V, D) or (G, D, V) of w's dtype; scratch u8
//   attrs  softcap f32 (0: none), w_layout s32 (0: (V, D), 1: (D, V)), chunk s64 (vocabulary
//          columns per chunk, >= 1); bwd also label_smoothing f32 in [0, 1) and
//          vocab_total s64 (>= V: the whole vocabulary when this call sees a shard of it)
// Gw is 1 (a weight shared by every group) or G.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "common/ffi_checks.h"
#include "linear_cross_entropy/linear_cross_entropy_params.h"

namespace jaxgpu {

// The four arguments both passes take first.
#define JAXGPU_LCE_INPUTS(BIND)                  \
  BIND.Arg<::xla::ffi::AnyBuffer>() /* x */      \
      .Arg<::xla::ffi::AnyBuffer>() /* w */      \
      .Arg<::xla::ffi::AnyBuffer>() /* labels */ \
      .Arg<::xla::ffi::AnyBuffer>() /* vocab_ids */

#define JAXGPU_LCE_FWD_BINDING(BIND)              \
  JAXGPU_LCE_INPUTS(BIND)                         \
      .Ret<::xla::ffi::AnyBuffer>() /* lse */     \
      .Ret<::xla::ffi::AnyBuffer>() /* zlabel */  \
      .Ret<::xla::ffi::AnyBuffer>() /* zsum */    \
      .Ret<::xla::ffi::AnyBuffer>() /* scratch */ \
      .Attr<float>("softcap")                     \
      .Attr<int32_t>("w_layout")                  \
      .Attr<int64_t>("chunk")

#define JAXGPU_LCE_BWD_BINDING(BIND)              \
  JAXGPU_LCE_INPUTS(BIND)                         \
      .Arg<::xla::ffi::AnyBuffer>() /* lse */     \
      .Arg<::xla::ffi::AnyBuffer>() /* dloss */   \
      .Ret<::xla::ffi::AnyBuffer>() /* dx */      \
      .Ret<::xla::ffi::AnyBuffer>() /* dw */      \
      .Ret<::xla::ffi::AnyBuffer>() /* scratch */ \
      .Attr<float>("softcap")                     \
      .Attr<float>("label_smoothing")             \
      .Attr<int64_t>("vocab_total")               \
      .Attr<int32_t>("w_layout")                  \
      .Attr<int64_t>("chunk")

namespace lce_detail {

inline ffi::Error CheckShape(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                             const ffi::AnyBuffer& labels, const ffi::AnyBuffer& vocab_ids,
                             int32_t w_layout, int64_t chunk, float softcap,
                             LinearCrossEntropyShape* s) {
  auto xd = x.dimensions();
  if (xd.size() < 2) return ffi::Error::InvalidArgument("x: expected rank >= 2 (G, ..., D)");
  JAXGPU_RETURN_IF_ERROR(CheckDType(x, kFloatDTypes, "x", &s->dtype));
  s->groups = xd[0];
  s->dim = xd[xd.size() - 1];
  s->rows = 1;
  for (size_t i = 1; i + 1 < xd.size(); ++i) s->rows *= xd[i];
  if (w_layout != 0 && w_layout != 1) {
    return ffi::Error::InvalidArgument("w_layout: must be 0 (V, D) or 1 (D, V)");
  }
  s->layout = static_cast<WeightLayout>(w_layout);
  auto wd = w.dimensions();
  if (wd.size() != 3 || w.element_type() != x.element_type()) {
    return ffi::Error::InvalidArgument("w: expected (Gw, V, D) or (Gw, D, V) of x's dtype");
  }
  s->weight_groups = wd[0];
  const int64_t w_dim = s->layout == WeightLayout::kVD ? wd[2] : wd[1];
  s->vocab = s->layout == WeightLayout::kVD ? wd[1] : wd[2];
  if (w_dim != s->dim) return ffi::Error::InvalidArgument("w: its D must equal x's last dim");
  if (s->weight_groups != 1 && s->weight_groups != s->groups) {
    return ffi::Error::InvalidArgument("w: its group dim must be 1 or x's");
  }
  if (s->vocab >= (int64_t(1) << 30)) {
    return ffi::Error::InvalidArgument("w: the vocabulary must be < 2^30");
  }
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(labels, ffi::DataType::S32, s->groups * s->rows, "labels"));
  auto vd = vocab_ids.dimensions();
  if (vocab_ids.element_type() != ffi::DataType::S32 || vd.size() != 2 || vd[1] != s->vocab) {
    return ffi::Error::InvalidArgument("vocab_ids: expected (k, V) int32");
  }
  if (chunk < 1) return ffi::Error::InvalidArgument("chunk: must be >= 1");
  s->chunk = chunk;
  if (!(softcap >= 0.f) || !std::isfinite(softcap)) {
    return ffi::Error::InvalidArgument("softcap: must be 0 (none) or positive and finite");
  }
  return ffi::Error::Success();
}

}  // namespace lce_detail

inline ffi::Error MakeLinearCrossEntropyFwdParams(
    ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer labels, ffi::AnyBuffer vocab_ids,
    ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> zlabel,
    ffi::Result<ffi::AnyBuffer> zsum, ffi::Result<ffi::AnyBuffer> scratch, float softcap,
    int32_t w_layout, int64_t chunk, LinearCrossEntropyFwdParams* p) {
  *p = LinearCrossEntropyFwdParams{};
  JAXGPU_RETURN_IF_ERROR(
      lce_detail::CheckShape(x, w, labels, vocab_ids, w_layout, chunk, softcap, &p->s));
  const int64_t n = p->s.groups * p->s.rows;
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(lse, ffi::DataType::F32, n, "lse"));
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(zlabel, ffi::DataType::F32, n, "zlabel"));
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(zsum, ffi::DataType::F32, n, "zsum"));
  if (scratch->element_type() != ffi::DataType::U8) {
    return ffi::Error::InvalidArgument("scratch: expected uint8");
  }
  p->x = x.untyped_data();
  p->w = w.untyped_data();
  p->labels = static_cast<const int32_t*>(labels.untyped_data());
  p->vocab_offset = static_cast<const int32_t*>(vocab_ids.untyped_data());
  p->lse = static_cast<float*>(lse->untyped_data());
  p->zlabel = static_cast<float*>(zlabel->untyped_data());
  p->zsum = static_cast<float*>(zsum->untyped_data());
  p->softcap = softcap;
  p->scratch = scratch->untyped_data();
  p->scratch_bytes = static_cast<int64_t>(scratch->element_count());
  return ffi::Error::Success();
}

inline ffi::Error MakeLinearCrossEntropyBwdParams(
    ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer labels, ffi::AnyBuffer vocab_ids,
    ffi::AnyBuffer lse, ffi::AnyBuffer dloss, ffi::Result<ffi::AnyBuffer> dx,
    ffi::Result<ffi::AnyBuffer> dw, ffi::Result<ffi::AnyBuffer> scratch, float softcap,
    float label_smoothing, int64_t vocab_total, int32_t w_layout, int64_t chunk,
    LinearCrossEntropyBwdParams* p) {
  *p = LinearCrossEntropyBwdParams{};
  JAXGPU_RETURN_IF_ERROR(
      lce_detail::CheckShape(x, w, labels, vocab_ids, w_layout, chunk, softcap, &p->s));
  const int64_t n = p->s.groups * p->s.rows;
  if (!(label_smoothing >= 0.f && label_smoothing < 1.f)) {
    return ffi::Error::InvalidArgument("label_smoothing: must be in [0, 1)");
  }
  if (vocab_total < p->s.vocab || vocab_total < 1) {
    return ffi::Error::InvalidArgument("vocab_total: must be >= 1 and >= w's vocabulary");
  }
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(lse, ffi::DataType::F32, n, "lse"));
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(dloss, ffi::DataType::F32, n, "dloss"));
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(dx, ffi::DataType::F32, n * p->s.dim, "dx"));
  JAXGPU_RETURN_IF_ERROR(
      CheckBuffer(dw, w.element_type(), p->s.groups * p->s.vocab * p->s.dim, "dw"));
  if (scratch->element_type() != ffi::DataType::U8) {
    return ffi::Error::InvalidArgument("scratch: expected uint8");
  }
  p->x = x.untyped_data();
  p->w = w.untyped_data();
  p->labels = static_cast<const int32_t*>(labels.untyped_data());
  p->vocab_offset = static_cast<const int32_t*>(vocab_ids.untyped_data());
  p->lse = static_cast<const float*>(lse.untyped_data());
  p->dloss = static_cast<const float*>(dloss.untyped_data());
  p->dx = static_cast<float*>(dx->untyped_data());
  p->dw = dw->untyped_data();
  p->softcap = softcap;
  p->label_smoothing = label_smoothing;
  p->vocab_total = vocab_total;
  p->scratch = scratch->untyped_data();
  p->scratch_bytes = static_cast<int64_t>(scratch->element_count());
  return ffi::Error::Success();
}

}  // namespace jaxgpu
