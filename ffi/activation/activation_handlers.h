// Shared by the CPU and CUDA handlers of the activation family: the FFI bindings' argument
// lists and the checks that turn buffers into ActParams.
//
// FFI contract (Python side: jaxgpu/ops/activation.py). All buffers have one shape (any
// rank) and one dtype (float32, bfloat16 or float16):
//   jaxgpu_{relu,sigmoid,silu,gelu}_fwd   args x            rets y
//   jaxgpu_{relu,sigmoid,silu,gelu}_bwd   args x, dy        rets dx
//   jaxgpu_{swiglu,geglu}_fwd             args gate, up     rets y
//   jaxgpu_{swiglu,geglu}_bwd             args gate, up, dy rets dgate, dup
//   gelu and geglu take the attribute `approximate` (bool): tanh form, else erf form.
#pragma once

#include <cstdint>
#include <string>

#include "activation/activation_math.h"
#include "activation/activation_params.h"
#include "common/ffi_checks.h"

namespace jaxgpu {

// Binding prefixes: the backend-specific handler prepends its context (the stream).
#define JAXGPU_ACT_UNARY_FWD_BINDING(BIND)  \
  BIND.Arg<::xla::ffi::AnyBuffer>() /* x */ \
      .Ret<::xla::ffi::AnyBuffer>() /* y */

#define JAXGPU_ACT_UNARY_BWD_BINDING(BIND)   \
  BIND.Arg<::xla::ffi::AnyBuffer>() /* x */  \
      .Arg<::xla::ffi::AnyBuffer>() /* dy */ \
      .Ret<::xla::ffi::AnyBuffer>() /* dx */

#define JAXGPU_ACT_GATED_FWD_BINDING(BIND)     \
  BIND.Arg<::xla::ffi::AnyBuffer>() /* gate */ \
      .Arg<::xla::ffi::AnyBuffer>() /* up */   \
      .Ret<::xla::ffi::AnyBuffer>() /* y */

#define JAXGPU_ACT_GATED_BWD_BINDING(BIND)      \
  BIND.Arg<::xla::ffi::AnyBuffer>() /* gate */  \
      .Arg<::xla::ffi::AnyBuffer>() /* up */    \
      .Arg<::xla::ffi::AnyBuffer>() /* dy */    \
      .Ret<::xla::ffi::AnyBuffer>() /* dgate */ \
      .Ret<::xla::ffi::AnyBuffer>() /* dup */

// Appended to the gelu and geglu bindings.
#define JAXGPU_ACT_APPROXIMATE_ATTR(BIND) BIND.Attr<bool>("approximate") /* approximate */

inline ActKind GeluKind(bool approximate) {
  return approximate ? ActKind::kGeluTanh : ActKind::kGeluErf;
}

namespace act_detail {

// `buf` must have the dtype and the dimensions of `ref` (named `ref_name`).
inline ffi::Error SameAs(const ffi::AnyBuffer& buf, const char* name, const ffi::AnyBuffer& ref,
                         const char* ref_name) {
  if (buf.element_type() != ref.element_type()) {
    return ffi::Error::InvalidArgument(std::string(name) + ": dtype differs from " + ref_name);
  }
  auto a = buf.dimensions();
  auto b = ref.dimensions();
  bool same = a.size() == b.size();
  for (size_t i = 0; same && i < a.size(); ++i) same = a[i] == b[i];
  if (!same) {
    return ffi::Error::InvalidArgument(std::string(name) + ": shape differs from " + ref_name);
  }
  // The element count is what the kernels read and write: checked on its own too.
  return CheckBuffer(buf, ref.element_type(), static_cast<int64_t>(ref.element_count()), name);
}

}  // namespace act_detail

// ins: the pass's inputs in the order of activation_params.h (the first sets the dtype and
// shape); outs: its outputs.
inline ffi::Error MakeActParams(
    ActKind kind, bool gated, bool backward,
    std::initializer_list<std::pair<const ffi::AnyBuffer*, const char*>> ins,
    std::initializer_list<std::pair<ffi::Result<ffi::AnyBuffer>*, const char*>> outs,
    ActParams* p) {
  *p = ActParams{};
  p->kind = kind;
  p->gated = gated;
  p->backward = backward;
  if (gated && !act::ActKindIsGated(kind)) {
    return ffi::Error::InvalidArgument("no gated form of this activation");
  }
  if (static_cast<int>(ins.size()) != ActInputs(*p) ||
      static_cast<int>(outs.size()) != ActOutputs(*p)) {
    return ffi::Error::Internal("activation handler: wrong number of buffers");
  }
  const ffi::AnyBuffer& ref = *ins.begin()->first;
  const char* ref_name = ins.begin()->second;
  JAXGPU_RETURN_IF_ERROR(CheckDType(ref, kFloatDTypes, ref_name, &p->dtype));
  p->n = static_cast<int64_t>(ref.element_count());
  int i = 0;
  for (const auto& [buf, name] : ins) {
    JAXGPU_RETURN_IF_ERROR(act_detail::SameAs(*buf, name, ref, ref_name));
    p->in[i++] = buf->untyped_data();
  }
  i = 0;
  for (const auto& [buf, name] : outs) {
    JAXGPU_RETURN_IF_ERROR(act_detail::SameAs(**buf, name, ref, ref_name));
    p->out[i++] = (*buf)->untyped_data();
  }
  return ffi::Error::Success();
}

// The four argument lists as ActParams.
inline ffi::Error UnaryFwdParams(ActKind kind, const ffi::AnyBuffer& x,
                                 ffi::Result<ffi::AnyBuffer>& y, ActParams* p) {
  return MakeActParams(kind, false, false, {{&x, "x"}}, {{&y, "y"}}, p);
}

inline ffi::Error UnaryBwdParams(ActKind kind, const ffi::AnyBuffer& x, const ffi::AnyBuffer& dy,
                                 ffi::Result<ffi::AnyBuffer>& dx, ActParams* p) {
  return MakeActParams(kind, false, true, {{&x, "x"}, {&dy, "dy"}}, {{&dx, "dx"}}, p);
}

inline ffi::Error GatedFwdParams(ActKind kind, const ffi::AnyBuffer& gate, const ffi::AnyBuffer& up,
                                 ffi::Result<ffi::AnyBuffer>& y, ActParams* p) {
  return MakeActParams(kind, true, false, {{&gate, "gate"}, {&up, "up"}}, {{&y, "y"}}, p);
}

inline ffi::Error GatedBwdParams(ActKind kind, const ffi::AnyBuffer& gate, const ffi::AnyBuffer& up,
                                 const ffi::AnyBuffer& dy, ffi::Result<ffi::AnyBuffer>& dgate,
                                 ffi::Result<ffi::AnyBuffer>& dup, ActParams* p) {
  return MakeActParams(kind, true, true, {{&gate, "gate"}, {&up, "up"}, {&dy, "dy"}},
                       {{&dgate, "dgate"}, {&dup, "dup"}}, p);
}

}  // namespace jaxgpu
