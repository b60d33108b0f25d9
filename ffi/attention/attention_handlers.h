// Shared by the CPU and CUDA handlers of the attention family: the FFI bindings' argument
// lists and the checks that turn buffers into AttentionParams.
//
// FFI contract (targets jaxgpu_attention_{fwd,bwd}; Python side: jaxgpu/ops/attention.py;
// layouts and the mask in attention_params.h):
//   fwd  args  q (B, T, K, R, H), k (B, S, K, H), v (B, S, K, H),
//              q_segment_ids s32 (B, T) | (0), kv_segment_ids s32 (B, S) | (0)
//        rets  o (B, T, K, R, H) the dtype of q, lse f32 (B, K, R, T)
//   bwd  args  q, k, v, o, lse, do (the shape of o), q_segment_ids, kv_segment_ids,
//              segment_uniform s32 (B) | (0): 1 where row b's ids are all one segment
//              (optional with segment ids: empty keeps every row on the maskable kernels)
//        rets  dq (q's shape), dk, dv (k's shape), delta f32 (B, K, R, T) (workspace)
//   attrs (both) scale f32 (finite, > 0), softcap f32 (0 = none, else > 0), causal bool,
//        window_left i64, window_right i64 (-1 = unbounded, else >= 0), has_segments bool,
//        and optionally path s32 (attention_path.h: 0 = auto when absent; the CPU handlers
//        take auto only, the CUDA ones refuse a main loop that cannot run the call)
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "attention/attention_params.h"
#include "attention/attention_path.h"
#include "common/ffi_checks.h"

namespace jaxgpu {

// The attributes, bound as one dictionary (AttentionAttrsFrom): XLA's FFI has no optional
// attribute otherwise, and `path` is optional so that programs lowered without it (by
// callers that never force a main loop, or before it existed) keep running.
#define JAXGPU_ATTENTION_ATTRS(BIND) BIND.Attrs()

// Binding prefixes: the backend-specific handler passes its context (stream) first.
#define JAXGPU_ATTENTION_FWD_BINDING(BIND)                                       \
  JAXGPU_ATTENTION_ATTRS(BIND.Arg<::xla::ffi::AnyBuffer>()  /* q */              \
                             .Arg<::xla::ffi::AnyBuffer>()  /* k */              \
                             .Arg<::xla::ffi::AnyBuffer>()  /* v */              \
                             .Arg<::xla::ffi::AnyBuffer>()  /* q_segment_ids */  \
                             .Arg<::xla::ffi::AnyBuffer>()  /* kv_segment_ids */ \
                             .Ret<::xla::ffi::AnyBuffer>()  /* o */              \
                             .Ret<::xla::ffi::AnyBuffer>()) /* lse */

#define JAXGPU_ATTENTION_BWD_BINDING(BIND)                                        \
  JAXGPU_ATTENTION_ATTRS(BIND.Arg<::xla::ffi::AnyBuffer>()  /* q */               \
                             .Arg<::xla::ffi::AnyBuffer>()  /* k */               \
                             .Arg<::xla::ffi::AnyBuffer>()  /* v */               \
                             .Arg<::xla::ffi::AnyBuffer>()  /* o */               \
                             .Arg<::xla::ffi::AnyBuffer>()  /* lse */             \
                             .Arg<::xla::ffi::AnyBuffer>()  /* do */              \
                             .Arg<::xla::ffi::AnyBuffer>()  /* q_segment_ids */   \
                             .Arg<::xla::ffi::AnyBuffer>()  /* kv_segment_ids */  \
                             .Arg<::xla::ffi::AnyBuffer>()  /* segment_uniform */ \
                             .Ret<::xla::ffi::AnyBuffer>()  /* dq */              \
                             .Ret<::xla::ffi::AnyBuffer>()  /* dk */              \
                             .Ret<::xla::ffi::AnyBuffer>()  /* dv */              \
                             .Ret<::xla::ffi::AnyBuffer>()) /* delta */

// The attributes every attention handler takes.
struct AttentionAttrs {
  float scale;
  float softcap;
  bool causal;
  int64_t window_left;
  int64_t window_right;
  bool has_segments;
  AttentionPath path;
};

template <typename T>
ffi::Error GetAttr(const ffi::Dictionary& attrs, const char* name, T* out) {
  ffi::ErrorOr<T> value = attrs.get<T>(name);
  if (!value.has_value()) {
    return ffi::Error::InvalidArgument(std::string("attribute ") + name + ": " +
                                       value.error().message());
  }
  *out = *value;
  return ffi::Error::Success();
}

// The attributes of a call (types and defaults: the contract above). Names are checked
// exactly: a misspelt or unknown attribute is an error, as with typed bindings.
inline ffi::Error AttentionAttrsFrom(const ffi::Dictionary& attrs, AttentionAttrs* a) {
  JAXGPU_RETURN_IF_ERROR(GetAttr(attrs, "scale", &a->scale));
  JAXGPU_RETURN_IF_ERROR(GetAttr(attrs, "softcap", &a->softcap));
  JAXGPU_RETURN_IF_ERROR(GetAttr(attrs, "causal", &a->causal));
  JAXGPU_RETURN_IF_ERROR(GetAttr(attrs, "window_left", &a->window_left));
  JAXGPU_RETURN_IF_ERROR(GetAttr(attrs, "window_right", &a->window_right));
  JAXGPU_RETURN_IF_ERROR(GetAttr(attrs, "has_segments", &a->has_segments));
  a->path = AttentionPath::kAuto;
  const bool has_path = attrs.contains("path");
  if (has_path) {
    int32_t path = 0;
    JAXGPU_RETURN_IF_ERROR(GetAttr(attrs, "path", &path));
    a->path = static_cast<AttentionPath>(path);
    if (AttentionPathName(a->path) == nullptr) {
      return ffi::Error::InvalidArgument("path: must be 0 (auto), 1 (mma_sync) or 2 (wgmma), got " +
                                         std::to_string(path));
    }
  }
  if (attrs.size() != (has_path ? 7u : 6u)) {
    return ffi::Error::InvalidArgument(
        "attributes: expected scale, softcap, causal, window_left, window_right, has_segments "
        "and optionally path, got " +
        std::to_string(attrs.size()) + " attributes");
  }
  return ffi::Error::Success();
}

// Shapes, dtypes, segment ids and attributes shared by both passes; fills everything in `p`
// but the data pointers of q/k/v and the outputs.
inline ffi::Error MakeAttentionShape(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                     const ffi::AnyBuffer& v, const ffi::AnyBuffer& q_seg,
                                     const ffi::AnyBuffer& kv_seg, const AttentionAttrs& a,
                                     AttentionParams* p) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  if (qd.size() != 5) return ffi::Error::InvalidArgument("q: expected rank 5 (B, T, K, R, H)");
  if (kd.size() != 4) return ffi::Error::InvalidArgument("k: expected rank 4 (B, S, K, H)");
  DType dtype;
  JAXGPU_RETURN_IF_ERROR(CheckDType(q, kFloatDTypes, "q", &dtype));
  *p = AttentionParams{};
  p->dtype = dtype;
  p->batch = qd[0];
  p->q_len = qd[1];
  p->kv_heads = qd[2];
  p->group = qd[3];
  p->head_dim = qd[4];
  p->kv_len = kd[1];
  if (kd[0] != p->batch || kd[2] != p->kv_heads || kd[3] != p->head_dim) {
    return ffi::Error::InvalidArgument("k: expected shape (B, S, K, H) matching q's B, K, H");
  }
  if (p->head_dim < 1 || p->head_dim > 256) {
    return ffi::Error::InvalidArgument("q: head dim must be in [1, 256]");
  }
  if (p->q_len > INT32_MAX || p->kv_len > INT32_MAX) {
    return ffi::Error::InvalidArgument("q, k: sequence lengths must be < 2^31");
  }
  const int64_t kv_count = p->batch * p->kv_len * p->kv_heads * p->head_dim;
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(k, q.element_type(), kv_count, "k"));
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(v, q.element_type(), kv_count, "v"));
  JAXGPU_RETURN_IF_ERROR(CheckDims(v, {p->batch, p->kv_len, p->kv_heads, p->head_dim}, "v"));
  // > 0: the CUDA kernels fold the scale into exp2 (the Python layer moves a negative
  // scale's sign onto q and turns a zero scale into q = 0).
  if (!std::isfinite(a.scale) || !(a.scale > 0.f)) {
    return ffi::Error::InvalidArgument("scale: must be finite and > 0");
  }
  if (!(a.softcap >= 0.0f) || !std::isfinite(a.softcap)) {
    return ffi::Error::InvalidArgument("softcap: must be 0 (none) or positive and finite");
  }
  if (a.window_left < -1 || a.window_right < -1) {
    return ffi::Error::InvalidArgument("window_left, window_right: must be >= 0, or -1 (none)");
  }
  p->scale = a.scale;
  p->softcap = a.softcap;
  p->causal = a.causal;
  p->window_left = a.window_left;
  p->window_right = a.window_right;
  if (a.has_segments) {
    if (q_seg.element_type() != ffi::DataType::S32 || kv_seg.element_type() != ffi::DataType::S32) {
      return ffi::Error::InvalidArgument("q_segment_ids, kv_segment_ids: dtype must be int32");
    }
    JAXGPU_RETURN_IF_ERROR(CheckDims(q_seg, {p->batch, p->q_len}, "q_segment_ids"));
    JAXGPU_RETURN_IF_ERROR(CheckDims(kv_seg, {p->batch, p->kv_len}, "kv_segment_ids"));
    p->q_segment_ids = static_cast<const int32_t*>(q_seg.untyped_data());
    p->kv_segment_ids = static_cast<const int32_t*>(kv_seg.untyped_data());
  } else if (q_seg.element_count() != 0 || kv_seg.element_count() != 0) {
    return ffi::Error::InvalidArgument("q_segment_ids, kv_segment_ids: must be empty when absent");
  }
  p->q = q.untyped_data();
  p->k = k.untyped_data();
  p->v = v.untyped_data();
  return ffi::Error::Success();
}

inline int64_t AttentionQueryCount(const AttentionParams& p) {
  return p.batch * p.q_len * p.kv_heads * p.group * p.head_dim;
}

inline int64_t AttentionRowStatCount(const AttentionParams& p) {
  return p.batch * p.kv_heads * p.group * p.q_len;
}

template <typename Q>
ffi::Error CheckQueryShaped(const Q& buf, const AttentionParams& p, ffi::DataType dtype,
                            const char* name) {
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(buf, dtype, AttentionQueryCount(p), name));
  return CheckDims(buf, {p.batch, p.q_len, p.kv_heads, p.group, p.head_dim}, name);
}

template <typename S>
ffi::Error CheckRowStats(const S& buf, const AttentionParams& p, const char* name) {
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(buf, ffi::DataType::F32, AttentionRowStatCount(p), name));
  return CheckDims(buf, {p.batch, p.kv_heads, p.group, p.q_len}, name);
}

inline ffi::Error MakeAttentionFwdParams(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                         ffi::AnyBuffer q_seg, ffi::AnyBuffer kv_seg,
                                         ffi::Result<ffi::AnyBuffer> o,
                                         ffi::Result<ffi::AnyBuffer> lse, const AttentionAttrs& a,
                                         AttentionParams* p) {
  JAXGPU_RETURN_IF_ERROR(MakeAttentionShape(q, k, v, q_seg, kv_seg, a, p));
  JAXGPU_RETURN_IF_ERROR(CheckQueryShaped(*o, *p, q.element_type(), "o"));
  JAXGPU_RETURN_IF_ERROR(CheckRowStats(*lse, *p, "lse"));
  p->o = o->untyped_data();
  p->lse = static_cast<float*>(lse->untyped_data());
  return ffi::Error::Success();
}

inline ffi::Error MakeAttentionBwdParams(
    ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer o, ffi::AnyBuffer lse,
    ffi::AnyBuffer d_o, ffi::AnyBuffer q_seg, ffi::AnyBuffer kv_seg, ffi::AnyBuffer seg_uniform,
    ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
    ffi::Result<ffi::AnyBuffer> delta, const AttentionAttrs& a, AttentionParams* p) {
  JAXGPU_RETURN_IF_ERROR(MakeAttentionShape(q, k, v, q_seg, kv_seg, a, p));
  const ffi::DataType t = q.element_type();
  JAXGPU_RETURN_IF_ERROR(CheckQueryShaped(q, *p, t, "q"));
  JAXGPU_RETURN_IF_ERROR(CheckQueryShaped(o, *p, t, "o"));
  JAXGPU_RETURN_IF_ERROR(CheckQueryShaped(d_o, *p, t, "do"));
  JAXGPU_RETURN_IF_ERROR(CheckQueryShaped(*dq, *p, t, "dq"));
  JAXGPU_RETURN_IF_ERROR(CheckRowStats(lse, *p, "lse"));
  JAXGPU_RETURN_IF_ERROR(CheckRowStats(*delta, *p, "delta"));
  const int64_t kv_count = p->batch * p->kv_len * p->kv_heads * p->head_dim;
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(dk, t, kv_count, "dk"));
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(dv, t, kv_count, "dv"));
  if (p->q_segment_ids != nullptr && seg_uniform.element_count() != 0) {
    JAXGPU_RETURN_IF_ERROR(
        CheckBuffer(seg_uniform, ffi::DataType::S32, p->batch, "segment_uniform"));
    JAXGPU_RETURN_IF_ERROR(CheckDims(seg_uniform, {p->batch}, "segment_uniform"));
    p->segment_uniform = static_cast<const int32_t*>(seg_uniform.untyped_data());
  } else if (p->q_segment_ids == nullptr && seg_uniform.element_count() != 0) {
    return ffi::Error::InvalidArgument("segment_uniform: must be empty without segment ids");
  }
  p->o = const_cast<void*>(o.untyped_data());  // read-only in the backward pass
  p->lse = static_cast<float*>(const_cast<void*>(lse.untyped_data()));
  p->d_o = d_o.untyped_data();
  p->dq = dq->untyped_data();
  p->dk = dk->untyped_data();
  p->dv = dv->untyped_data();
  p->delta = static_cast<float*>(delta->untyped_data());
  return ffi::Error::Success();
}

}  // namespace jaxgpu
