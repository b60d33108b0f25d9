// Shared by the CPU and CUDA handlers of the softmax family: the FFI bindings' argument
// lists and the checks that turn buffers into SoftmaxFwdParams / SoftmaxBwdParams.
//
// FFI contract (targets jaxgpu_softmax_{fwd,bwd}; Python side: jaxgpu/ops/softmax.py):
//   fwd  args  x (D1..Dk, S), mask bool (M1..Mk, MS) | (0)   with Mi in {1, Di}, MS in {1, S}
//        rets  y (D1..Dk, S)
//        attrs scale f32, causal bool, has_mask bool, query_len i64 (T = Dk; rows % T == 0)
//   bwd  args  y (D1..Dk, S), dy (D1..Dk, S)
//        rets  dx (D1..Dk, S)
//        attrs scale f32, causal bool, query_len i64 (T = Dk)
// Any k >= 0. The arrays come in their own shapes, unreshaped (a reshape that merges a
// sharded dim with the dims after it is not expressible under Explicit sharding): the
// handler coalesces x's row dims into the groups over which the mask is all full or all
// broadcast (see softmax_params.h); at most kSoftmaxMaxDims such groups.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "common/ffi_checks.h"
#include "softmax/softmax_params.h"

namespace jaxgpu {

// Binding prefixes: the backend-specific handler appends its context (stream).
#define JAXGPU_SOFTMAX_FWD_BINDING(BIND)           \
  BIND.Arg<::xla::ffi::AnyBuffer>() /* x */        \
      .Arg<::xla::ffi::AnyBuffer>() /* mask */     \
      .Ret<::xla::ffi::AnyBuffer>() /* y */        \
      .Attr<float>("scale")         /* scale */    \
      .Attr<bool>("causal")         /* causal */   \
      .Attr<bool>("has_mask")       /* has_mask */ \
      .Attr<int64_t>("query_len")   /* query_len */

#define JAXGPU_SOFTMAX_BWD_BINDING(BIND)         \
  BIND.Arg<::xla::ffi::AnyBuffer>() /* y */      \
      .Arg<::xla::ffi::AnyBuffer>() /* dy */     \
      .Ret<::xla::ffi::AnyBuffer>() /* dx */     \
      .Attr<float>("scale")         /* scale */  \
      .Attr<bool>("causal")         /* causal */ \
      .Attr<int64_t>("query_len")   /* query_len */

inline ffi::Error MakeSoftmaxFwdParams(ffi::AnyBuffer x, ffi::AnyBuffer mask,
                                       ffi::Result<ffi::AnyBuffer> y, float scale, bool causal,
                                       bool has_mask, int64_t query_len, SoftmaxFwdParams* p) {
  auto dims = x.dimensions();
  const int rank = static_cast<int>(dims.size());
  if (rank < 1) return ffi::Error::InvalidArgument("x: expected rank >= 1 (..., S)");
  DType dtype{};
  JAXGPU_RETURN_IF_ERROR(CheckDType(x, kFloatDTypes, "x", &dtype));
  if (!std::isfinite(scale)) return ffi::Error::InvalidArgument("scale: must be finite");
  *p = SoftmaxFwdParams{};
  p->dtype = dtype;
  p->cols = dims[rank - 1];
  if (p->cols > INT32_MAX) return ffi::Error::InvalidArgument("x: the last dim must be < 2^31");
  p->rows = 1;
  for (int k = 0; k < rank - 1; ++k) p->rows *= dims[k];
  p->scale = scale;
  p->causal = causal;
  p->query_len = query_len;
  if (causal && (rank < 2 || query_len != dims[rank - 2])) {
    return ffi::Error::InvalidArgument("query_len: must be x's second-to-last dim");
  }
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(y, x.element_type(), p->rows * p->cols, "y"));
  p->ndims = 1;
  p->dims[0] = p->rows;
  if (has_mask) {
    if (mask.element_type() != ffi::DataType::PRED) {
      return ffi::Error::InvalidArgument("mask: expected bool");
    }
    auto md = mask.dimensions();
    if (static_cast<int>(md.size()) != rank) {
      return ffi::Error::InvalidArgument("mask: expected the rank of x");
    }
    // The mask's contiguous strides in its own shape, innermost first.
    int64_t stride[64];
    if (rank > 64) return ffi::Error::InvalidArgument("x: rank above 64");
    int64_t count = 1;
    for (int k = rank - 1; k >= 0; --k) {
      if (md[k] != 1 && md[k] != dims[k]) {
        return ffi::Error::InvalidArgument("mask: dim " + std::to_string(k) + " must be 1 or " +
                                           std::to_string(dims[k]));
      }
      stride[k] = count;
      count *= md[k];
    }
    if (static_cast<int64_t>(mask.element_count()) != count) {
      return ffi::Error::InvalidArgument("mask: element count does not match its shape");
    }
    p->mask_col_stride = md[rank - 1] == 1 ? 0 : 1;
    // Coalesce: drop x's size-1 dims, merge neighbours that are both full or both broadcast
    // (a merged full group steps like its innermost dim).
    int nd = 0;
    bool prev_full = false;
    for (int k = 0; k < rank - 1; ++k) {
      if (dims[k] == 1) continue;
      const bool full = md[k] != 1;
      const int64_t s = full ? stride[k] : 0;
      if (nd > 0 && full == prev_full) {
        p->dims[nd - 1] *= dims[k];
        p->mask_strides[nd - 1] = s;
        continue;
      }
      if (nd == kSoftmaxMaxDims) {
        return ffi::Error::InvalidArgument(
            "mask: its broadcast pattern over x alternates more "
            "than " +
            std::to_string(kSoftmaxMaxDims) + " times");
      }
      p->dims[nd] = dims[k];
      p->mask_strides[nd] = s;
      prev_full = full;
      ++nd;
    }
    if (nd == 0) {  // a single row, or every row dim of x is 1
      nd = 1;
      p->dims[0] = p->rows;
      p->mask_strides[0] = 0;
    }
    p->ndims = nd;
    p->mask = static_cast<const uint8_t*>(mask.untyped_data());
  } else if (mask.element_count() != 0) {
    return ffi::Error::InvalidArgument("mask: must be empty when absent");
  }
  p->x = x.untyped_data();
  p->y = y->untyped_data();
  return ffi::Error::Success();
}

inline ffi::Error MakeSoftmaxBwdParams(ffi::AnyBuffer y, ffi::AnyBuffer dy,
                                       ffi::Result<ffi::AnyBuffer> dx, float scale, bool causal,
                                       int64_t query_len, SoftmaxBwdParams* p) {
  auto dims = y.dimensions();
  if (dims.size() < 1) return ffi::Error::InvalidArgument("y: expected rank >= 1 (..., S)");
  DType dtype{};
  JAXGPU_RETURN_IF_ERROR(CheckDType(y, kFloatDTypes, "y", &dtype));
  if (!std::isfinite(scale)) return ffi::Error::InvalidArgument("scale: must be finite");
  *p = SoftmaxBwdParams{};
  p->dtype = dtype;
  p->cols = dims[dims.size() - 1];
  if (p->cols > INT32_MAX) return ffi::Error::InvalidArgument("y: the last dim must be < 2^31");
  p->rows = 1;
  for (size_t k = 0; k + 1 < dims.size(); ++k) p->rows *= dims[k];
  p->scale = scale;
  p->causal = causal;
  p->query_len = query_len;
  if (causal && (dims.size() < 2 || query_len != dims[dims.size() - 2])) {
    return ffi::Error::InvalidArgument("query_len: must be y's second-to-last dim");
  }
  const int64_t n = p->rows * p->cols;
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(dy, y.element_type(), n, "dy"));
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(dx, y.element_type(), n, "dx"));
  p->y = y.untyped_data();
  p->dy = dy.untyped_data();
  p->dx = dx->untyped_data();
  return ffi::Error::Success();
}

}  // namespace jaxgpu
