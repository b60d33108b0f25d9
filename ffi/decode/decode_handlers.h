// Shared by the CPU and CUDA handlers of the decode family: the FFI bindings' argument
// lists and the checks that turn buffers into the params structs.
//
// FFI contract (Python side: jaxgpu/ops/decode.py; shapes in decode_params.h):
//   jaxgpu_paged_attention_fwd
//     args  query (G, B, Tq, N, H) f32|bf16|f16, k_pages, v_pages (Gp, P, S, K, H) same
//           dtype (Gp in {1, G}), block_table (G, B, M) s32, lengths (G, B) s32
//     rets  out (G, B, Tq, N, H) in query's dtype, workspace (W,) f32
//           (W = PagedAttentionWorkspaceSize: 0 with one split)
//     attrs scale f32 > 0, softcap f32 (0: none), window_left s32 (-1: none),
//           num_splits s32 in [1, 1024]
//   jaxgpu_paged_attention_q8_fwd: the 8-bit cache
//     args  query, k_pages, v_pages (Gp, P, S, K, H) s8|f8e4m3fn (one dtype),
//           k_scale, v_scale (Gp, P, S, K) f32, block_table, lengths
//     rets, attrs as jaxgpu_paged_attention_fwd
//   jaxgpu_paged_attention_with_update_fwd: paged_kv_update of the query tokens' K/V (at
//           positions lengths - Tq + t), then paged_attention, in one call
//     args  query, k_pages, v_pages (G, P, S, K, H) in query's dtype (rank 4 when G = 1),
//           k_new, v_new (G, B, Tq, K, H) same dtype, block_table, lengths
//     rets  out, workspace as jaxgpu_paged_attention_fwd, then k_pages, v_pages aliased to
//           the second and third arguments
//     attrs as jaxgpu_paged_attention_fwd
//   jaxgpu_paged_kv_update_fwd
//     args  k_pages, v_pages (G, P, S, K, H) f32|bf16|f16, k_new, v_new (G, B, Tn, K, H)
//           same dtype, block_table (G, B, M) s32, positions (G, B, Tn) s32
//     rets  k_pages, v_pages: the caches, aliased to the first two arguments
//   jaxgpu_paged_kv_update_q8_fwd: quantizes the new tokens into an 8-bit cache
//     args  k_pages, v_pages (G, P, S, K, H) s8|f8e4m3fn (one dtype), k_scale, v_scale
//           (G, P, S, K) f32, k_new, v_new (G, B, Tn, K, H) f32|bf16|f16, block_table,
//           positions
//     rets  k_pages, v_pages, k_scale, v_scale: aliased to the first four arguments
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "common/ffi_checks.h"
#include "decode/decode_params.h"

namespace jaxgpu {

// The attributes of the three attention targets.
#define JAXGPU_PAGED_ATTENTION_ATTRS(B)               \
  B.Attr<float>("scale")            /* scale */       \
      .Attr<float>("softcap")       /* softcap */     \
      .Attr<int32_t>("window_left") /* window_left */ \
      .Attr<int32_t>("num_splits")  /* num_splits */

// The arguments after the caches, the results and the attributes of both attention targets.
#define JAXGPU_PAGED_ATTENTION_TAIL(B)                                             \
  JAXGPU_PAGED_ATTENTION_ATTRS(B.Arg<::xla::ffi::AnyBuffer>()    /* block_table */ \
                                   .Arg<::xla::ffi::AnyBuffer>() /* lengths */     \
                                   .Ret<::xla::ffi::AnyBuffer>() /* out */         \
                                   .Ret<::xla::ffi::AnyBuffer>() /* workspace */)

#define JAXGPU_PAGED_ATTENTION_FWD_BINDING(BIND)                              \
  JAXGPU_PAGED_ATTENTION_TAIL(BIND.Arg<::xla::ffi::AnyBuffer>() /* q */       \
                                  .Arg<::xla::ffi::AnyBuffer>() /* k_pages */ \
                                  .Arg<::xla::ffi::AnyBuffer>() /* v_pages */)

#define JAXGPU_PAGED_ATTENTION_Q8_FWD_BINDING(BIND)                           \
  JAXGPU_PAGED_ATTENTION_TAIL(BIND.Arg<::xla::ffi::AnyBuffer>() /* q */       \
                                  .Arg<::xla::ffi::AnyBuffer>() /* k_pages */ \
                                  .Arg<::xla::ffi::AnyBuffer>() /* v_pages */ \
                                  .Arg<::xla::ffi::AnyBuffer>() /* k_scale */ \
                                  .Arg<::xla::ffi::AnyBuffer>() /* v_scale */)

#define JAXGPU_PAGED_ATTENTION_WITH_UPDATE_FWD_BINDING(BIND)                       \
  JAXGPU_PAGED_ATTENTION_ATTRS(BIND.Arg<::xla::ffi::AnyBuffer>() /* q */           \
                                   .Arg<::xla::ffi::AnyBuffer>() /* k_pages */     \
                                   .Arg<::xla::ffi::AnyBuffer>() /* v_pages */     \
                                   .Arg<::xla::ffi::AnyBuffer>() /* k_new */       \
                                   .Arg<::xla::ffi::AnyBuffer>() /* v_new */       \
                                   .Arg<::xla::ffi::AnyBuffer>() /* block_table */ \
                                   .Arg<::xla::ffi::AnyBuffer>() /* lengths */     \
                                   .Ret<::xla::ffi::AnyBuffer>() /* out */         \
                                   .Ret<::xla::ffi::AnyBuffer>() /* workspace */   \
                                   .Ret<::xla::ffi::AnyBuffer>() /* k_pages */     \
                                   .Ret<::xla::ffi::AnyBuffer>() /* v_pages */)

#define JAXGPU_PAGED_KV_UPDATE_FWD_BINDING(BIND)      \
  BIND.Arg<::xla::ffi::AnyBuffer>() /* k_pages */     \
      .Arg<::xla::ffi::AnyBuffer>() /* v_pages */     \
      .Arg<::xla::ffi::AnyBuffer>() /* k_new */       \
      .Arg<::xla::ffi::AnyBuffer>() /* v_new */       \
      .Arg<::xla::ffi::AnyBuffer>() /* block_table */ \
      .Arg<::xla::ffi::AnyBuffer>() /* positions */   \
      .Ret<::xla::ffi::AnyBuffer>() /* k_pages */     \
      .Ret<::xla::ffi::AnyBuffer>() /* v_pages */

#define JAXGPU_PAGED_KV_UPDATE_Q8_FWD_BINDING(BIND)   \
  BIND.Arg<::xla::ffi::AnyBuffer>() /* k_pages */     \
      .Arg<::xla::ffi::AnyBuffer>() /* v_pages */     \
      .Arg<::xla::ffi::AnyBuffer>() /* k_scale */     \
      .Arg<::xla::ffi::AnyBuffer>() /* v_scale */     \
      .Arg<::xla::ffi::AnyBuffer>() /* k_new */       \
      .Arg<::xla::ffi::AnyBuffer>() /* v_new */       \
      .Arg<::xla::ffi::AnyBuffer>() /* block_table */ \
      .Arg<::xla::ffi::AnyBuffer>() /* positions */   \
      .Ret<::xla::ffi::AnyBuffer>() /* k_pages */     \
      .Ret<::xla::ffi::AnyBuffer>() /* v_pages */     \
      .Ret<::xla::ffi::AnyBuffer>() /* k_scale */     \
      .Ret<::xla::ffi::AnyBuffer>() /* v_scale */

namespace decode_detail {

constexpr int64_t kMaxQLen = 16;
constexpr int64_t kMaxHeadDim = 256;
constexpr int32_t kMaxSplits = 1024;

template <typename Buf>
ffi::Error Rank(const Buf& buf, size_t rank, const char* name, const char* shape) {
  if (buf.dimensions().size() != rank) {
    return ffi::Error::InvalidArgument(std::string(name) + ": expected rank " +
                                       std::to_string(rank) + " " + shape);
  }
  return ffi::Error::Success();
}

// The element types of an 8-bit cache's pages.
constexpr DTypeSet kQ8DTypes = DTypeBit(DType::kS8) | DTypeBit(DType::kF8E4M3);

// Pages (groups, P, S, K, H) of `dtype` (one of `accepted`), S a positive multiple of 8, H
// a multiple of 8 in [8, 256]. Rank 4 (P, S, K, H) is one group: an unbatched pool reaches
// the update's FFI call without the reshape that adds a unit group dim, which would keep
// XLA from aliasing a donated pool to the result (it copies a buffer around a bitcast that
// feeds an in-place custom call).
inline ffi::Error CheckPages(const ffi::AnyBuffer& pages, DTypeSet accepted, DType dtype,
                             const char* name, int64_t* groups, int64_t* num_pages,
                             int64_t* page_size, int64_t* kv_heads, int64_t* head_dim) {
  const size_t rank = pages.dimensions().size();
  if (rank != 4 && rank != 5) {
    return ffi::Error::InvalidArgument(std::string(name) +
                                       ": expected rank 4 (P, S, K, H) or 5 (G, P, S, K, H)");
  }
  DType got;
  JAXGPU_RETURN_IF_ERROR(CheckDType(pages, accepted, name, &got));
  if (got != dtype) {
    return ffi::Error::InvalidArgument(std::string(name) + ": dtype must be " + DTypeName(dtype) +
                                       ", got " + DTypeName(got));
  }
  auto d = pages.dimensions();
  const size_t o = rank - 4;
  *groups = o ? d[0] : 1;
  *num_pages = d[o];
  *page_size = d[o + 1];
  *kv_heads = d[o + 2];
  *head_dim = d[o + 3];
  if (*page_size < 8 || *page_size % 8 != 0) {
    return ffi::Error::InvalidArgument(std::string(name) +
                                       ": the page size must be a positive multiple of 8");
  }
  if (*kv_heads < 1) return ffi::Error::InvalidArgument(std::string(name) + ": no kv heads");
  if (*head_dim < 8 || *head_dim > kMaxHeadDim || *head_dim % 8 != 0) {
    return ffi::Error::InvalidArgument(std::string(name) +
                                       ": the head dim must be a multiple of 8 in [8, 256]");
  }
  return ffi::Error::Success();
}

// An 8-bit cache's scales: float32 (groups, P, S, K), the pages' shape without H (rank 3
// for rank-4 pages).
template <typename Buf>
ffi::Error CheckScales(const Buf& scales, const ffi::AnyBuffer& pages, const char* name) {
  const auto d = pages.dimensions();
  const auto s = scales.dimensions();
  bool same = s.size() + 1 == d.size();
  int64_t count = 1;
  for (size_t i = 0; same && i < s.size(); ++i) {
    same = s[i] == d[i];
    count *= s[i];
  }
  if (!same) {
    return ffi::Error::InvalidArgument(std::string(name) +
                                       ": must have the pages' shape (G, P, S, K) without H");
  }
  return CheckBuffer(scales, ffi::DataType::F32, count, name);
}

// `buf` has exactly the shape of `like` (any rank).
inline ffi::Error SameShape(const ffi::AnyBuffer& buf, const ffi::AnyBuffer& like,
                            const char* name) {
  auto a = buf.dimensions();
  auto b = like.dimensions();
  if (a.size() != b.size() || !std::equal(a.begin(), a.end(), b.begin())) {
    return ffi::Error::InvalidArgument(std::string(name) + ": must have the shape of k_pages");
  }
  return ffi::Error::Success();
}

// The updated caches' result buffers: k_pages' shape and dtype.
inline ffi::Error CheckCacheResults(ffi::Result<ffi::AnyBuffer>& k_out,
                                    ffi::Result<ffi::AnyBuffer>& v_out,
                                    const ffi::AnyBuffer& k_pages) {
  JAXGPU_RETURN_IF_ERROR(SameShape(*k_out, k_pages, "k_pages (result)"));
  JAXGPU_RETURN_IF_ERROR(
      CheckBuffer(k_out, k_pages.element_type(), k_pages.element_count(), "k_pages (result)"));
  JAXGPU_RETURN_IF_ERROR(SameShape(*v_out, k_pages, "v_pages (result)"));
  return CheckBuffer(v_out, k_pages.element_type(), k_pages.element_count(), "v_pages (result)");
}

}  // namespace decode_detail

// k_scale and v_scale are null for a 16-bit or float32 cache (pages in query's dtype) and
// set for an 8-bit one (pages of one kQ8DTypes type).
inline ffi::Error MakePagedAttentionParams(
    ffi::AnyBuffer query, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
    const ffi::AnyBuffer* k_scale, const ffi::AnyBuffer* v_scale, ffi::AnyBuffer block_table,
    ffi::AnyBuffer lengths, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace,
    float scale, float softcap, int32_t window_left, int32_t num_splits, PagedAttentionParams* p) {
  using namespace decode_detail;
  *p = PagedAttentionParams{};
  const bool q8 = k_scale != nullptr;
  if (q8 != (v_scale != nullptr)) {
    return ffi::Error::InvalidArgument("k_scale, v_scale: both or neither");
  }
  JAXGPU_RETURN_IF_ERROR(Rank(query, 5, "query", "(G, B, Tq, N, H)"));
  JAXGPU_RETURN_IF_ERROR(CheckDType(query, kFloatDTypes, "query", &p->dtype));
  auto q = query.dimensions();
  p->groups = q[0];
  p->batch = q[1];
  p->q_len = q[2];
  p->heads = q[3];
  int64_t kv_groups, v_groups, v_pages_n, v_page_size, v_kv, v_h;
  const DTypeSet accepted = q8 ? kQ8DTypes : DTypeBit(p->dtype);
  const std::optional<DType> kv_dtype = DTypeOf(k_pages.element_type());
  p->kv_dtype = q8 && kv_dtype ? *kv_dtype : p->dtype;
  JAXGPU_RETURN_IF_ERROR(CheckPages(k_pages, accepted, p->kv_dtype, "k_pages", &p->page_groups,
                                    &p->num_pages, &p->page_size, &p->kv_heads, &p->head_dim));
  JAXGPU_RETURN_IF_ERROR(CheckPages(v_pages, accepted, p->kv_dtype, "v_pages", &v_groups,
                                    &v_pages_n, &v_page_size, &v_kv, &v_h));
  kv_groups = p->page_groups;
  if (v_groups != kv_groups || v_pages_n != p->num_pages || v_page_size != p->page_size ||
      v_kv != p->kv_heads || v_h != p->head_dim) {
    return ffi::Error::InvalidArgument("v_pages: must have the shape of k_pages");
  }
  if (kv_groups != 1 && kv_groups != p->groups) {
    return ffi::Error::InvalidArgument("k_pages: the group dim must be 1 or the query's");
  }
  if (q8) {
    JAXGPU_RETURN_IF_ERROR(CheckScales(*k_scale, k_pages, "k_scale"));
    JAXGPU_RETURN_IF_ERROR(CheckScales(*v_scale, k_pages, "v_scale"));
    p->k_scale = static_cast<const float*>(k_scale->untyped_data());
    p->v_scale = static_cast<const float*>(v_scale->untyped_data());
  }
  if (q[4] != p->head_dim) {
    return ffi::Error::InvalidArgument("query: the head dim must be the pages'");
  }
  if (p->q_len < 1 || p->q_len > kMaxQLen) {
    return ffi::Error::InvalidArgument("query: Tq must be in [1, 16]");
  }
  if (p->heads % p->kv_heads != 0) {
    return ffi::Error::InvalidArgument("query: the heads must be a multiple of the kv heads");
  }
  JAXGPU_RETURN_IF_ERROR(Rank(block_table, 3, "block_table", "(G, B, M)"));
  p->max_pages = block_table.dimensions()[2];
  JAXGPU_RETURN_IF_ERROR(
      CheckDims(block_table, {p->groups, p->batch, p->max_pages}, "block_table"));
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(block_table, ffi::DataType::S32,
                                     p->groups * p->batch * p->max_pages, "block_table"));
  JAXGPU_RETURN_IF_ERROR(CheckDims(lengths, {p->groups, p->batch}, "lengths"));
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(lengths, ffi::DataType::S32, p->groups * p->batch, "lengths"));
  JAXGPU_RETURN_IF_ERROR(
      CheckDims(*out, {p->groups, p->batch, p->q_len, p->heads, p->head_dim}, "out"));
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(out, query.element_type(), query.element_count(), "out"));
  if (!(scale > 0.f) || !std::isfinite(scale)) {
    return ffi::Error::InvalidArgument("scale: must be positive and finite");
  }
  if (!(softcap >= 0.f) || !std::isfinite(softcap)) {
    return ffi::Error::InvalidArgument("softcap: must be 0 (none) or positive and finite");
  }
  if (window_left < -1) {
    return ffi::Error::InvalidArgument("window_left: must be -1 (none) or >= 0");
  }
  if (num_splits < 1 || num_splits > kMaxSplits) {
    return ffi::Error::InvalidArgument("num_splits: must be in [1, 1024]");
  }
  p->num_splits = num_splits;
  JAXGPU_RETURN_IF_ERROR(
      CheckBuffer(workspace, ffi::DataType::F32, PagedAttentionWorkspaceSize(*p), "workspace"));
  p->query = query.untyped_data();
  p->k_pages = k_pages.untyped_data();
  p->v_pages = v_pages.untyped_data();
  p->block_table = static_cast<const int32_t*>(block_table.untyped_data());
  p->lengths = static_cast<const int32_t*>(lengths.untyped_data());
  p->out = out->untyped_data();
  p->workspace = static_cast<float*>(workspace->untyped_data());
  p->scale = scale;
  p->softcap = softcap;
  p->window_left = window_left;
  return ffi::Error::Success();
}

// k_scale .. v_scale_out are null for a 16-bit or float32 cache (pages in the new tokens'
// dtype) and set for an 8-bit one (pages of one kQ8DTypes type, the new tokens float).
inline ffi::Error MakePagedKvUpdateParams(
    ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, const ffi::AnyBuffer* k_scale,
    const ffi::AnyBuffer* v_scale, ffi::AnyBuffer k_new, ffi::AnyBuffer v_new,
    ffi::AnyBuffer block_table, ffi::AnyBuffer positions, ffi::Result<ffi::AnyBuffer> k_out,
    ffi::Result<ffi::AnyBuffer> v_out, ffi::Result<ffi::AnyBuffer>* k_scale_out,
    ffi::Result<ffi::AnyBuffer>* v_scale_out, PagedKvUpdateParams* p) {
  using namespace decode_detail;
  *p = PagedKvUpdateParams{};
  const bool q8 = k_scale != nullptr;
  if (q8 != (v_scale != nullptr) || q8 != (k_scale_out != nullptr) ||
      q8 != (v_scale_out != nullptr)) {
    return ffi::Error::InvalidArgument("k_scale, v_scale: both or neither, as their results");
  }
  JAXGPU_RETURN_IF_ERROR(Rank(k_new, 5, "k_new", "(G, B, Tn, K, H)"));
  JAXGPU_RETURN_IF_ERROR(CheckDType(k_new, kFloatDTypes, "k_new", &p->dtype));
  JAXGPU_RETURN_IF_ERROR(
      CheckDType(k_pages, q8 ? kQ8DTypes : DTypeBit(p->dtype), "k_pages", &p->kv_dtype));
  JAXGPU_RETURN_IF_ERROR(CheckPages(k_pages, DTypeBit(p->kv_dtype), p->kv_dtype, "k_pages",
                                    &p->groups, &p->num_pages, &p->page_size, &p->kv_heads,
                                    &p->head_dim));
  JAXGPU_RETURN_IF_ERROR(SameShape(v_pages, k_pages, "v_pages"));
  JAXGPU_RETURN_IF_ERROR(
      CheckBuffer(v_pages, k_pages.element_type(), k_pages.element_count(), "v_pages"));
  p->batch = k_new.dimensions()[1];
  p->new_len = k_new.dimensions()[2];
  JAXGPU_RETURN_IF_ERROR(
      CheckDims(k_new, {p->groups, p->batch, p->new_len, p->kv_heads, p->head_dim}, "k_new"));
  JAXGPU_RETURN_IF_ERROR(
      CheckDims(v_new, {p->groups, p->batch, p->new_len, p->kv_heads, p->head_dim}, "v_new"));
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(v_new, k_new.element_type(), k_new.element_count(), "v_new"));
  JAXGPU_RETURN_IF_ERROR(Rank(block_table, 3, "block_table", "(G, B, M)"));
  p->max_pages = block_table.dimensions()[2];
  JAXGPU_RETURN_IF_ERROR(
      CheckDims(block_table, {p->groups, p->batch, p->max_pages}, "block_table"));
  JAXGPU_RETURN_IF_ERROR(CheckBuffer(block_table, ffi::DataType::S32,
                                     p->groups * p->batch * p->max_pages, "block_table"));
  JAXGPU_RETURN_IF_ERROR(CheckDims(positions, {p->groups, p->batch, p->new_len}, "positions"));
  JAXGPU_RETURN_IF_ERROR(
      CheckBuffer(positions, ffi::DataType::S32, p->groups * p->batch * p->new_len, "positions"));
  JAXGPU_RETURN_IF_ERROR(CheckCacheResults(k_out, v_out, k_pages));
  if (q8) {
    JAXGPU_RETURN_IF_ERROR(CheckScales(*k_scale, k_pages, "k_scale"));
    JAXGPU_RETURN_IF_ERROR(CheckScales(*v_scale, k_pages, "v_scale"));
    JAXGPU_RETURN_IF_ERROR(CheckScales(**k_scale_out, k_pages, "k_scale (result)"));
    JAXGPU_RETURN_IF_ERROR(CheckScales(**v_scale_out, k_pages, "v_scale (result)"));
    p->k_scale_in = static_cast<const float*>(k_scale->untyped_data());
    p->v_scale_in = static_cast<const float*>(v_scale->untyped_data());
    p->k_scale = static_cast<float*>((*k_scale_out)->untyped_data());
    p->v_scale = static_cast<float*>((*v_scale_out)->untyped_data());
  }
  p->k_pages_in = k_pages.untyped_data();
  p->v_pages_in = v_pages.untyped_data();
  p->k_pages = k_out->untyped_data();
  p->v_pages = v_out->untyped_data();
  p->k_new = k_new.untyped_data();
  p->v_new = v_new.untyped_data();
  p->block_table = static_cast<const int32_t*>(block_table.untyped_data());
  p->positions = static_cast<const int32_t*>(positions.untyped_data());
  return ffi::Error::Success();
}

// paged_attention_with_update: the attention's params (reading the caches' result buffers,
// which the update writes first) and the update's (positions null: the query tokens, at
// lengths - Tq + t). A 16-bit or float32 cache: the 8-bit one takes the two separate calls.
inline ffi::Error MakePagedAttentionWithUpdateParams(
    ffi::AnyBuffer query, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, ffi::AnyBuffer k_new,
    ffi::AnyBuffer v_new, ffi::AnyBuffer block_table, ffi::AnyBuffer lengths,
    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace,
    ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out, float scale,
    float softcap, int32_t window_left, int32_t num_splits, PagedAttentionParams* att,
    PagedKvUpdateParams* upd) {
  using namespace decode_detail;
  JAXGPU_RETURN_IF_ERROR(MakePagedAttentionParams(query, k_pages, v_pages, nullptr, nullptr,
                                                  block_table, lengths, out, workspace, scale,
                                                  softcap, window_left, num_splits, att));
  if (att->page_groups != att->groups) {
    return ffi::Error::InvalidArgument(
        "k_pages: the group dim must be the query's (each group writes its own pool)");
  }
  const PagedAttentionParams& a = *att;
  for (auto [buf, name] : {std::pair{&k_new, "k_new"}, std::pair{&v_new, "v_new"}}) {
    JAXGPU_RETURN_IF_ERROR(Rank(*buf, 5, name, "(G, B, Tq, K, H)"));
    JAXGPU_RETURN_IF_ERROR(
        CheckDims(*buf, {a.groups, a.batch, a.q_len, a.kv_heads, a.head_dim}, name));
    JAXGPU_RETURN_IF_ERROR(CheckBuffer(*buf, query.element_type(), buf->element_count(), name));
  }
  JAXGPU_RETURN_IF_ERROR(CheckCacheResults(k_out, v_out, k_pages));
  *upd = QueryTokensUpdate(a, k_out->untyped_data(), v_out->untyped_data(), k_new.untyped_data(),
                           v_new.untyped_data());
  upd->k_pages_in = k_pages.untyped_data();
  upd->v_pages_in = v_pages.untyped_data();
  att->k_pages = upd->k_pages;
  att->v_pages = upd->v_pages;
  return ffi::Error::Success();
}

}  // namespace jaxgpu
