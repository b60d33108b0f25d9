// Shared by the CPU and CUDA handlers of the cross-entropy family: the FFI bindings'
// argument lists and the checks that turn buffers into the params structs.
//
// FFI contract (targets jaxgpu_cross_entropy_{fwd,bwd}; Python side:
// jaxgpu/ops/cross_entropy.py):
//   fwd  args  logits (..., V) f32|bf16|f16, labels (...) s32
//        rets  loss (...) f32, lse (...) f32
//   bwd  args  logits (..., V), labels (...) s32, lse (...) f32, dloss (...) f32
//        rets  dlogits (..., V) in the dtype of logits
// Shapes are checked by element count: N = the product of logits' leading dims.
//   attrs (both)  ignore_index s32, has_ignore bool, label_smoothing f32 in [0, 1),
//                 softcap f32 (0: none; else positive and finite)
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "common/ffi_checks.h"
#include "cross_entropy/cross_entropy_params.h"

namespace jaxgpu {

// Binding prefixes: the backend-specific handler appends its context (stream).
#define JAXGPU_CROSS_ENTROPY_FWD_BINDING(BIND)              \
  BIND.Arg<::xla::ffi::AnyBuffer>()   /* logits */          \
      .Arg<::xla::ffi::AnyBuffer>()   /* labels */          \
      .Ret<::xla::ffi::AnyBuffer>()   /* loss */            \
      .Ret<::xla::ffi::AnyBuffer>()   /* lse */             \
      .Attr<int32_t>("ignore_index")  /* ignore_index */    \
      .Attr<bool>("has_ignore")       /* has_ignore */      \
      .Attr<float>("label_smoothing") /* label_smoothing */ \
      .Attr<float>("softcap")         /* softcap */

#define JAXGPU_CROSS_ENTROPY_BWD_BINDING(BIND)              \
  BIND.Arg<::xla::ffi::AnyBuffer>()   /* logits */          \
      .Arg<::xla::ffi::AnyBuffer>()   /* labels */          \
      .Arg<::xla::ffi::AnyBuffer>()   /* lse */             \
      .Arg<::xla::ffi::AnyBuffer>()   /* dloss */           \
      .Ret<::xla::ffi::AnyBuffer>()   /* dlogits */         \
      .Attr<int32_t>("ignore_index")  /* ignore_index */    \
      .Attr<bool>("has_ignore")       /* has_ignore */      \
      .Attr<float>("label_smoothing") /* label_smoothing */ \
      .Attr<float>("softcap")         /* softcap */

namespace cross_entropy_detail {

// logits must be (..., V) of a float dtype, with V < 2^30 (the kernels' columns are 32-bit
// ints); N is the product of the leading dims. Any shape is accepted, not only (N, V), so
// the Python side never reshapes (a reshape that merges sharded dims is refused under
// Explicit sharding).
inline ffi::Error CheckLogits(const ffi::AnyBuffer& logits, DType* dtype, int64_t* rows,
                              int64_t* vocab) {
  auto dims = logits.dimensions();
  if (dims.size() < 1) return ffi::Error::InvalidArgument("logits: expected rank >= 1 (..., V)");
  JAXGPU_RETURN_IF_ERROR(CheckDType(logits, kFloatDTypes, "logits", dtype));
  *vocab = dims[dims.size() - 1];
  *rows = 1;
  for (size_t i = 0; i + 1 < dims.size(); ++i) *rows *= dims[i];
  if (*vocab >= (int64_t(1) << 30)) {
    return ffi::Error::InvalidArgument("logits: the vocabulary must be < 2^30");
  }
  if (*rows > 0 && *vocab < 1) return ffi::Error::InvalidArgument("logits: empty vocabulary");
  return ffi::Error::Success();
}

inline ffi::Error CheckAttrs(float label_smoothing, float softcap) {
  if (!(label_smoothing >= 0.f && label_smoothing < 1.f)) {
    return ffi::Error::InvalidArgument("label_smoothing: must be in [0, 1)");
  }
  if (!(softcap >= 0.f) || !std::isfinite(softcap)) {
    return ffi::Error::InvalidArgument("softcap: must be 0 (none) or positive and finite");
  }
  return ffi::Error::Success();
}

}  // namespace cross_entropy_detail

inline ffi::Error MakeCrossEntropyFwdParams(ffi::AnyBuffer logits, ffi::AnyBuffer labels,
                                            ffi::Result<ffi::AnyBuffer> loss,
                                            ffi::Result<ffi::AnyBuffer> lse, int32_t ignore_index,
                                            bool has_ignore, float label_smoothing, float softcap,
                                            CrossEntropyFwdParams* p) {
  using namespace cross_entropy_detail;
  *p = CrossEntropyFwdParams{};
  JAXGPU_RETURN_IF_ERROR(CheckLogits(logits, &p->dtype, &p->rows, &p->vocab));
  JAXGPU_RETURN_IF_ERROR(CheckAttrs(label_smoothing, softcap));
  const int64_t n = p->rows;
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(labels, ffi::DataType::S32, n, "labels"));
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(loss, ffi::DataType::F32, n, "loss"));
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(lse, ffi::DataType::F32, n, "lse"));
  p->logits = logits.untyped_data();
  p->labels = static_cast<const int32_t*>(labels.untyped_data());
  p->loss = static_cast<float*>(loss->untyped_data());
  p->lse = static_cast<float*>(lse->untyped_data());
  p->ignore_index = ignore_index;
  p->has_ignore = has_ignore;
  p->label_smoothing = label_smoothing;
  p->softcap = softcap;
  return ffi::Error::Success();
}

inline ffi::Error MakeCrossEntropyBwdParams(ffi::AnyBuffer logits, ffi::AnyBuffer labels,
                                            ffi::AnyBuffer lse, ffi::AnyBuffer dloss,
                                            ffi::Result<ffi::AnyBuffer> dlogits,
                                            int32_t ignore_index, bool has_ignore,
                                            float label_smoothing, float softcap,
                                            CrossEntropyBwdParams* p) {
  using namespace cross_entropy_detail;
  *p = CrossEntropyBwdParams{};
  JAXGPU_RETURN_IF_ERROR(CheckLogits(logits, &p->dtype, &p->rows, &p->vocab));
  JAXGPU_RETURN_IF_ERROR(CheckAttrs(label_smoothing, softcap));
  const int64_t n = p->rows;
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(labels, ffi::DataType::S32, n, "labels"));
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(lse, ffi::DataType::F32, n, "lse"));
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(dloss, ffi::DataType::F32, n, "dloss"));
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(dlogits, logits.element_type(), n * p->vocab, "dlogits"));
  p->logits = logits.untyped_data();
  p->labels = static_cast<const int32_t*>(labels.untyped_data());
  p->lse = static_cast<const float*>(lse.untyped_data());
  p->dloss = static_cast<const float*>(dloss.untyped_data());
  p->dlogits = dlogits->untyped_data();
  p->ignore_index = ignore_index;
  p->has_ignore = has_ignore;
  p->label_smoothing = label_smoothing;
  p->softcap = softcap;
  return ffi::Error::Success();
}

}  // namespace jaxgpu
