// Shared by the CPU and CUDA handlers of the attention family: the FFI bindings' argument
// lists and the checks that turn buffers into AttentionParams.
//
// FFI contract (targets jaxgpu_attention_{fwd,bwd}; Python side: jaxgpu/ops/attention.py;
// layouts and the mask in attention_params.h):
//   fwd  args  q (B, T, K, R, H), k (B, S, K, H), v (B, S, K, H),
//              q_segment_ids s32 (B, T) | (0), kv_segment_ids s32 (B, S) | (0),
//              bias (Bb, Kb, Rb, Tb, Sb) f32 or q's dtype | (0),
//              mask pred (Bm, Km, Rm, Tm, Sm) | (0)   (each dim 1 or B, K, R, T, S),
//              q_lengths s32 (B) | (0), kv_lengths s32 (B) | (0)
//        rets  o (B, T, K, R, H) the dtype of q, lse f32 (B, K, R, T),
//              tile_counter s32 (1) | (0): the Hopper forward's tile counter (workspace;
//              empty: that forward's masked calls run fwd_sm90's kernel; the CPU handler
//              ignores it)
//   bwd  args  q, k, v, o, lse, do (the shape of o), q_segment_ids, kv_segment_ids,
//              segment_uniform s32 (B) | (0): 1 where row b's ids are all one segment
//              (optional with segment ids: empty keeps every row on the maskable kernels),
//              bias, mask, q_lengths, kv_lengths (as the forward's)
//        rets  dq (q's shape), dk, dv (k's shape), delta f32 (B, K, R, T) (workspace),
//              dbias f32 (bias's shape) | (0): empty without a bias or with has_dbias false,
//              dq_accum f32 (q's shape) | (0), dq_semaphores s32 (B, K, R, T) | (0): the
//              fused Hopper backward's workspaces (the semaphores with dq_accum, and
//              optional when deterministic is false; empty: the dQ and dK/dV kernels run;
//              the CPU handler ignores them)
//   attrs (both) scale f32 (finite, > 0), softcap f32 (0 = none, else > 0), causal bool,
//        window_left i64, window_right i64 (-1 = unbounded, else >= 0), has_segments bool,
//        and optionally path s32 (attention_path.h: 0 = auto when absent; the CPU handlers
//        take auto only, the CUDA ones refuse a main loop that cannot run the call),
//        has_bias, has_mask, has_lengths, has_dbias bool (false when absent), deterministic
//        bool (true when absent; false lets the fused Hopper backward add dQ's partial sums
//        in any order)
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>

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
                             .Arg<::xla::ffi::AnyBuffer>()  /* bias */           \
                             .Arg<::xla::ffi::AnyBuffer>()  /* mask */           \
                             .Arg<::xla::ffi::AnyBuffer>()  /* q_lengths */      \
                             .Arg<::xla::ffi::AnyBuffer>()  /* kv_lengths */     \
                             .Ret<::xla::ffi::AnyBuffer>()  /* o */              \
                             .Ret<::xla::ffi::AnyBuffer>()  /* lse */            \
                             .Ret<::xla::ffi::AnyBuffer>()) /* tile_counter */

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
                             .Arg<::xla::ffi::AnyBuffer>()  /* bias */            \
                             .Arg<::xla::ffi::AnyBuffer>()  /* mask */            \
                             .Arg<::xla::ffi::AnyBuffer>()  /* q_lengths */       \
                             .Arg<::xla::ffi::AnyBuffer>()  /* kv_lengths */      \
                             .Ret<::xla::ffi::AnyBuffer>()  /* dq */              \
                             .Ret<::xla::ffi::AnyBuffer>()  /* dk */              \
                             .Ret<::xla::ffi::AnyBuffer>()  /* dv */              \
                             .Ret<::xla::ffi::AnyBuffer>()  /* delta */           \
                             .Ret<::xla::ffi::AnyBuffer>()  /* dbias */           \
                             .Ret<::xla::ffi::AnyBuffer>()  /* dq_accum */        \
                             .Ret<::xla::ffi::AnyBuffer>()) /* dq_semaphores */

// The attributes every attention handler takes.
struct AttentionAttrs {
  float scale;
  float softcap;
  bool causal;
  int64_t window_left;
  int64_t window_right;
  bool has_segments;
  AttentionPath path;
  bool has_bias = false;
  bool has_mask = false;
  bool has_lengths = false;
  bool has_dbias = false;
  bool deterministic = true;
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
  size_t expected = has_path ? 7u : 6u;
  for (auto [name, flag] : {std::pair<const char*, bool*>{"has_bias", &a->has_bias},
                            {"has_mask", &a->has_mask},
                            {"has_lengths", &a->has_lengths},
                            {"has_dbias", &a->has_dbias}}) {
    *flag = false;
    if (attrs.contains(name)) {
      JAXGPU_RETURN_IF_ERROR(GetAttr(attrs, name, flag));
      ++expected;
    }
  }
  a->deterministic = true;
  if (attrs.contains("deterministic")) {
    JAXGPU_RETURN_IF_ERROR(GetAttr(attrs, "deterministic", &a->deterministic));
    ++expected;
  }
  if (attrs.size() != expected) {
    return ffi::Error::InvalidArgument(
        "attributes: expected scale, softcap, causal, window_left, window_right, has_segments "
        "and optionally path, has_bias, has_mask, has_lengths, has_dbias, deterministic, got " +
        std::to_string(attrs.size()) + " attributes");
  }
  if (a->has_dbias && !a->has_bias) {
    return ffi::Error::InvalidArgument("has_dbias: needs has_bias");
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

// The optional bias, mask and lengths operands (absent: empty buffers, the flags false).
// Each dim of bias and mask is 1 (broadcast: stride 0) or the full size.
inline ffi::Error BroadcastStrides(const ffi::AnyBuffer& buf, const AttentionParams& p,
                                   const char* name, int64_t stride[5]) {
  auto d = buf.dimensions();
  const int64_t full[5] = {p.batch, p.kv_heads, p.group, p.q_len, p.kv_len};
  if (d.size() != 5) {
    return ffi::Error::InvalidArgument(std::string(name) +
                                       ": expected rank 5 (B, K, R, T, S), each dim 1 or full");
  }
  int64_t step = 1;
  for (int i = 4; i >= 0; --i) {
    if (d[i] != 1 && d[i] != full[i]) {
      return ffi::Error::InvalidArgument(std::string(name) + ": dim " + std::to_string(i) + " is " +
                                         std::to_string(d[i]) + ", expected 1 or " +
                                         std::to_string(full[i]));
    }
    stride[i] = d[i] == 1 ? 0 : step;
    step *= d[i];
  }
  return ffi::Error::Success();
}

inline ffi::Error MakeAttentionExtras(const ffi::AnyBuffer& bias, const ffi::AnyBuffer& mask,
                                      const ffi::AnyBuffer& q_lengths,
                                      const ffi::AnyBuffer& kv_lengths, const AttentionAttrs& a,
                                      AttentionParams* p) {
  if (a.has_bias) {
    DType bt;
    JAXGPU_RETURN_IF_ERROR(CheckDType(bias, kFloatDTypes, "bias", &bt));
    if (bt != DType::kF32 && bt != p->dtype) {
      return ffi::Error::InvalidArgument("bias: dtype must be float32 or the dtype of q");
    }
    JAXGPU_RETURN_IF_ERROR(BroadcastStrides(bias, *p, "bias", p->bias_stride));
    p->bias = bias.untyped_data();
    p->bias_dtype = bt;
    // The CUDA kernels' logits are in units of the scale, or of the softcap (LogitScale).
    p->bias_scale = 1.f / (a.softcap > 0.f ? a.softcap : a.scale);
  } else if (bias.element_count() != 0) {
    return ffi::Error::InvalidArgument("bias: must be empty when has_bias is false");
  }
  if (a.has_mask) {
    if (mask.element_type() != ffi::DataType::PRED) {
      return ffi::Error::InvalidArgument("mask: dtype must be bool, got " +
                                         DataTypeName(mask.element_type()));
    }
    JAXGPU_RETURN_IF_ERROR(BroadcastStrides(mask, *p, "mask", p->mask_stride));
    p->mask = static_cast<const uint8_t*>(mask.untyped_data());
  } else if (mask.element_count() != 0) {
    return ffi::Error::InvalidArgument("mask: must be empty when has_mask is false");
  }
  if (a.has_lengths) {
    JAXGPU_RETURN_IF_ERROR(CheckBuffer(q_lengths, ffi::DataType::S32, p->batch, "q_lengths"));
    JAXGPU_RETURN_IF_ERROR(CheckDims(q_lengths, {p->batch}, "q_lengths"));
    JAXGPU_RETURN_IF_ERROR(CheckBuffer(kv_lengths, ffi::DataType::S32, p->batch, "kv_lengths"));
    JAXGPU_RETURN_IF_ERROR(CheckDims(kv_lengths, {p->batch}, "kv_lengths"));
    p->q_lengths = static_cast<const int32_t*>(q_lengths.untyped_data());
    p->kv_lengths = static_cast<const int32_t*>(kv_lengths.untyped_data());
  } else if (q_lengths.element_count() != 0 || kv_lengths.element_count() != 0) {
    return ffi::Error::InvalidArgument(
        "q_lengths, kv_lengths: must be empty when has_lengths is false");
  }
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

inline ffi::Error MakeAttentionFwdParams(
    ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer q_seg,
    ffi::AnyBuffer kv_seg, ffi::AnyBuffer bias, ffi::AnyBuffer mask, ffi::AnyBuffer q_lengths,
    ffi::AnyBuffer kv_lengths, ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse,
    ffi::Result<ffi::AnyBuffer> tile_counter, const AttentionAttrs& a, AttentionParams* p) {
  JAXGPU_RETURN_IF_ERROR(MakeAttentionShape(q, k, v, q_seg, kv_seg, a, p));
  if (a.has_dbias) return ffi::Error::InvalidArgument("has_dbias: backward only");
  JAXGPU_RETURN_IF_ERROR(MakeAttentionExtras(bias, mask, q_lengths, kv_lengths, a, p));
  JAXGPU_RETURN_IF_ERROR(CheckQueryShaped(*o, *p, q.element_type(), "o"));
  JAXGPU_RETURN_IF_ERROR(CheckRowStats(*lse, *p, "lse"));
  p->o = o->untyped_data();
  p->lse = static_cast<float*>(lse->untyped_data());
  if (tile_counter->element_count() != 0) {
    JAXGPU_RETURN_IF_ERROR(CheckBuffer(tile_counter, ffi::DataType::S32, 1, "tile_counter"));
    p->fwd_tile_counter = static_cast<int32_t*>(tile_counter->untyped_data());
  }
  return ffi::Error::Success();
}

inline ffi::Error MakeAttentionBwdParams(
    ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer o, ffi::AnyBuffer lse,
    ffi::AnyBuffer d_o, ffi::AnyBuffer q_seg, ffi::AnyBuffer kv_seg, ffi::AnyBuffer seg_uniform,
    ffi::AnyBuffer bias, ffi::AnyBuffer mask, ffi::AnyBuffer q_lengths, ffi::AnyBuffer kv_lengths,
    ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
    ffi::Result<ffi::AnyBuffer> delta, ffi::Result<ffi::AnyBuffer> dbias,
    ffi::Result<ffi::AnyBuffer> dq_accum, ffi::Result<ffi::AnyBuffer> dq_semaphores,
    const AttentionAttrs& a, AttentionParams* p) {
  JAXGPU_RETURN_IF_ERROR(MakeAttentionShape(q, k, v, q_seg, kv_seg, a, p));
  JAXGPU_RETURN_IF_ERROR(MakeAttentionExtras(bias, mask, q_lengths, kv_lengths, a, p));
  if (a.has_dbias) {
    JAXGPU_RETURN_IF_ERROR(CheckBuffer(dbias, ffi::DataType::F32,
                                       static_cast<int64_t>(bias.element_count()), "dbias"));
    auto bd = bias.dimensions();
    auto dd = dbias->dimensions();
    bool same = bd.size() == dd.size();
    for (size_t i = 0; same && i < bd.size(); ++i) same = bd[i] == dd[i];
    if (!same) return ffi::Error::InvalidArgument("dbias: expected bias's shape");
    p->dbias = static_cast<float*>(dbias->untyped_data());
    const int64_t full[5] = {p->batch, p->kv_heads, p->group, p->q_len, p->kv_len};
    p->dbias_atomic = false;
    for (int i = 0; i < 5; ++i) p->dbias_atomic |= bd[i] == 1 && full[i] > 1;
  } else if (dbias->element_count() != 0) {
    return ffi::Error::InvalidArgument("dbias: must be empty when has_dbias is false");
  }
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
  p->dq_unordered = !a.deterministic;
  if (dq_accum->element_count() != 0) {
    JAXGPU_RETURN_IF_ERROR(CheckQueryShaped(*dq_accum, *p, ffi::DataType::F32, "dq_accum"));
    p->dq_accum = static_cast<float*>(dq_accum->untyped_data());
    // The semaphores order the adds: optional without that order.
    if (a.deterministic || dq_semaphores->element_count() != 0) {
      JAXGPU_RETURN_IF_ERROR(CheckBuffer(dq_semaphores, ffi::DataType::S32,
                                         AttentionRowStatCount(*p), "dq_semaphores"));
      p->dq_semaphores = static_cast<int32_t*>(dq_semaphores->untyped_data());
      p->dq_semaphore_count = static_cast<int64_t>(dq_semaphores->element_count());
    }
  } else if (dq_semaphores->element_count() != 0) {
    return ffi::Error::InvalidArgument("dq_semaphores: must be empty without dq_accum");
  }
  return ffi::Error::Success();
}

}  // namespace jaxgpu
