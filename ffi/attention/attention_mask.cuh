// Which keys a query sees (causal, local window, segment ids, sequence tails), per element
// and per tile, shared by the forward and backward kernels of every main loop: the mask,
// the tiles a CTA walks, and each warp's per-tile decision (skip, plain, or masked per
// element). Semantics: attention_params.h.
#pragma once

#include <climits>
#include <cstdint>

#include "attention/attention_params.h"

namespace jaxgpu::cuda::attention {

// Positions fit in int: the handler rejects T, S >= 2^31, and the launcher turns a window
// side that reaches past the sequence into "unbounded" (-1), so i + right cannot overflow.
// q_len and kv_len are the batch row's valid lengths: T and S, or with sequence lengths
// (MakeMask<true>) those clamped to [0, T] / [0, S], so every range and tile walk below
// stops at them. The kernels store their outputs up to p.q_len / p.kv_len.
struct Mask {
  int q_len;
  int kv_len;
  bool causal;
  int left;              // -1: unbounded
  int right;             // -1: unbounded
  const int32_t* q_seg;  // this batch row's segment ids, or nullptr
  const int32_t* kv_seg;

  __device__ __forceinline__ bool Visible(int i, int j) const {
    bool ok = j < kv_len;
    if (causal) ok = ok && j <= i;
    if (left >= 0) ok = ok && j >= i - left;
    if (right >= 0) ok = ok && j <= i + right;
    return ok;
  }

  // Keys [lo, hi) that some query in [i0, i1] sees (segments aside): the kv tiles outside
  // are fully masked and skipped.
  __device__ __forceinline__ void KeyRange(int i0, int i1, int* lo, int* hi) const {
    int h = kv_len - 1;
    if (causal) h = min(h, i1);
    if (right >= 0) h = min(h, i1 + right);
    *lo = left >= 0 ? max(0, i0 - left) : 0;
    *hi = h + 1;
  }

  // Queries [lo, hi) that see some key in [j0, j1] (segments aside).
  __device__ __forceinline__ void QueryRange(int j0, int j1, int* lo, int* hi) const {
    int l = 0;
    if (causal) l = max(l, j0);
    if (right >= 0) l = max(l, j0 - right);
    int h = q_len - 1;
    if (left >= 0) h = min(h, j1 + left);
    *lo = l;
    *hi = h + 1;
  }

  // The kv tiles [*lo, *hi) of `tile` keys that every query in [i0, i1] sees whole,
  // segments aside: TileFullyVisible holds for each (empty when *lo >= *hi).
  __device__ __forceinline__ void FullTileRange(int i0, int i1, int tile, int* lo, int* hi) const {
    int h = kv_len;  // one past the last key every row sees
    if (causal) h = min(h, i0 + 1);
    if (right >= 0) h = min(h, i0 + right + 1);
    const int l = left >= 0 ? max(0, i1 - left) : 0;  // the first key every row sees
    *lo = (l + tile - 1) / tile;
    *hi = max(h, 0) / tile;
  }

  // True when every (i, j) in [i0, i1] x [j0, j1] is visible, segments aside (see
  // SegmentRange): the tile skips the per-element mask (the common case away from the
  // diagonal and the tails).
  __device__ __forceinline__ bool TileFullyVisible(int i0, int i1, int j0, int j1) const {
    if (j1 >= kv_len) return false;
    if (causal && j1 > i0) return false;
    if (left >= 0 && j0 < i1 - left) return false;
    if (right >= 0 && j1 > i0 + right) return false;
    return true;
  }
};

// The tiles a CTA walks and the narrower span one warp's rows see, for rows [cta0, cta1]
// of the CTA and [warp0, warp1] of the warp (last rows clamped to the sequence; a warp with
// warp0 > warp1 has no rows). kKeyTiles: rows are queries walking key tiles (forward, dQ);
// otherwise rows are keys walking query tiles (dK/dV). A warp skips the tiles fully masked
// for its own rows (the causal diagonal), segments aside.
struct TileWalk {
  int begin, end;        // tile indices the CTA loads: [begin, end)
  int warp_lo, warp_hi;  // positions [lo, hi) the warp's rows see

  __device__ __forceinline__ bool WarpSkips(int first, int count) const {
    return first >= warp_hi || first + count <= warp_lo;
  }
};

// kLengths: the CTA's rows may all lie past the row's valid length (cta1 < cta0), and then
// it walks nothing.
template <bool kKeyTiles, bool kLengths = false>
__device__ __forceinline__ TileWalk MakeTileWalk(const Mask& m, int cta0, int cta1, int warp0,
                                                 int warp1, int tile) {
  auto range = [&](int i0, int i1, int* lo, int* hi) {
    if (kKeyTiles)
      m.KeyRange(i0, i1, lo, hi);
    else
      m.QueryRange(i0, i1, lo, hi);
  };
  TileWalk w{0, 0, 0, 0};
  if (kLengths && cta1 < cta0) return w;
  int lo, hi;
  range(cta0, cta1, &lo, &hi);
  w.begin = lo / tile;
  w.end = hi > lo ? (hi + tile - 1) / tile : w.begin;
  if (warp0 <= warp1) range(warp0, warp1, &w.warp_lo, &w.warp_hi);
  return w;
}

// The smallest and largest segment id of a tile's rows or columns, staged in shared memory
// next to the tile, for the per-tile decision the kernels make before any per-element
// mask: one segment on both sides means no element is masked by segments, disjoint
// ranges mean every element is (the tile is skipped). Loading ids per element from
// global memory inside the softmax cost 2.1x the plain forward time
// (docs/perf/attention.md section 6.1).
struct SegmentRange {
  int lo, hi;

  __device__ __forceinline__ bool OneSegmentWith(const SegmentRange& o) const {
    return lo == hi && o.lo == o.hi && lo == o.lo;
  }
  __device__ __forceinline__ bool DisjointFrom(const SegmentRange& o) const {
    return hi < o.lo || o.hi < lo;
  }
};

// Over ids[0, n) (n <= 64, shared memory), computed by the whole warp (all lanes agree).
__device__ __forceinline__ SegmentRange WarpSegmentRange(const int32_t* ids, int n, int lane) {
  int lo = INT_MAX, hi = INT_MIN;
  for (int i = lane; i < n; i += 32) {
    lo = min(lo, ids[i]);
    hi = max(hi, ids[i]);
  }
  return {__reduce_min_sync(0xffffffffu, lo), __reduce_max_sync(0xffffffffu, hi)};
}

// A batch row's valid length: lengths[b] clamped to [0, full] (a traced length may hold
// anything; clamping keeps every read in bounds).
__host__ __device__ inline int ValidLength(const int32_t* lengths, int64_t b, int64_t full) {
  const int n = static_cast<int>(full);
  if (lengths == nullptr) return n;
  const int v = lengths[b];
  return v < 0 ? 0 : (v > n ? n : v);
}

// The mask of batch row b, with window sides normalized (see Mask). kLengths: with the
// row's sequence lengths (when given); the kernels without them compile to the code they
// had.
template <bool kLengths = false>
__host__ __device__ inline Mask MakeMask(const AttentionParams& p, int64_t b) {
  Mask m;
  if constexpr (kLengths) {
    m.q_len = ValidLength(p.q_lengths, b, p.q_len);
    m.kv_len = ValidLength(p.kv_lengths, b, p.kv_len);
  } else {
    m.q_len = static_cast<int>(p.q_len);
    m.kv_len = static_cast<int>(p.kv_len);
  }
  m.causal = p.causal;
  m.left = (p.window_left < 0 || p.window_left >= p.q_len) ? -1 : static_cast<int>(p.window_left);
  m.right =
      (p.window_right < 0 || p.window_right >= p.kv_len) ? -1 : static_cast<int>(p.window_right);
  m.q_seg = p.q_segment_ids ? p.q_segment_ids + b * p.q_len : nullptr;
  m.kv_seg = p.kv_segment_ids ? p.kv_segment_ids + b * p.kv_len : nullptr;
  return m;
}

// How a warp treats one tile of queries [q0, q1] x keys [k0, k1] (rows and columns of the
// warp's score tile are queries and keys, or keys and queries in the dK/dV kernel; row_ids
// and col_ids are their segment ids in shared memory). Decided once per tile, so only
// tiles on a mask's edge pay for the per-element mask.
struct TileMasking {
  bool skip;               // every element is masked: the warp skips the tile
  bool masked;             // some element may be: ToLogits masks per element
  const int32_t* row_seg;  // segment ids ToLogits compares, or nullptr (segments all equal)
  const int32_t* col_seg;

  // The row ids of the row tile starting `offset` rows into the warp's rows (or nullptr).
  __device__ __forceinline__ const int32_t* RowSeg(int offset) const {
    return row_seg ? row_seg + offset : nullptr;
  }
};

// The segment part of a decision, from the segment ranges of the tile's two sides.
__device__ __forceinline__ void ApplySegmentRanges(TileMasking& tm, const int32_t* row_ids,
                                                   const SegmentRange& rows, const int32_t* col_ids,
                                                   const SegmentRange& cols) {
  tm.skip = rows.DisjointFrom(cols);
  if (!rows.OneSegmentWith(cols)) {
    tm.masked = true;
    tm.row_seg = row_ids;
    tm.col_seg = col_ids;
  }
}

// The warp's own decision, its `rows` row ids and `cols` column ids reduced here. (Written
// out rather than through DecideMaskingInRanges: that form changed the code of the
// forward's maskable kernels, at 255 registers, and cost its options case 379 -> 343
// TFLOP/s on the H100.)
template <bool kMaskable>
__device__ __forceinline__ TileMasking DecideMasking(const Mask& mask, bool segments, int q0,
                                                     int q1, int k0, int k1, const int32_t* row_ids,
                                                     int rows, const int32_t* col_ids, int cols,
                                                     int lane) {
  TileMasking tm{false, false, nullptr, nullptr};
  if (!kMaskable) return tm;
  tm.masked = !mask.TileFullyVisible(q0, q1, k0, k1);
  if (segments) {
    ApplySegmentRanges(tm, row_ids, WarpSegmentRange(row_ids, rows, lane), col_ids,
                       WarpSegmentRange(col_ids, cols, lane));
  }
  return tm;
}

// The same with the ranges given: the wgmma backward loops reduce them a step ahead, under
// the previous step's products (the reductions on the critical path cost the options
// case's backward 2-3%: docs/perf/attention.md section 6.3). A range
// may cover more rows or columns than the warp's (a warpgroup's, the same in its 4 warps,
// so that `skip` is too): the decision is then coarser, never wrong.
template <bool kMaskable>
__device__ __forceinline__ TileMasking DecideMaskingInRanges(
    const Mask& mask, bool segments, int q0, int q1, int k0, int k1, const int32_t* row_ids,
    const SegmentRange& rows, const int32_t* col_ids, const SegmentRange& cols) {
  TileMasking tm{false, false, nullptr, nullptr};
  if (!kMaskable) return tm;
  tm.masked = !mask.TileFullyVisible(q0, q1, k0, k1);
  if (segments) ApplySegmentRanges(tm, row_ids, rows, col_ids, cols);
  return tm;
}

}  // namespace jaxgpu::cuda::attention
