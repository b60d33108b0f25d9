// The query rows of a wgmma attention CTA, which the forward (fwd_sm90.cu) and the dQ
// kernel (dq_sm90.cu) start from: kBlockM queries of one query head in warpgroups of 64
// rows, 16 rows a warp. Key tiles are skipped per warpgroup (wgmma runs on all 4 warps
// together) and masked per warp. No XLA types.
#pragma once

#include "attention/attention_mask.cuh"
#include "attention/attention_params.h"
#include "attention/attention_schedule.cuh"
#include "attention/sm90/wgmma.cuh"

namespace jaxgpu::cuda::attention::sm90 {

// Tile shapes and shared-memory layout of a Hopper kernel over query tiles: 2 warpgroups x
// 64 query rows, kBlockN-key tiles; kQueryTiles 128-row tiles (Q, or Q and dO), then
// kKVBuffers buffers of (K, V), then the segment ids of the query tile and of kKVBuffers
// key tiles (with kNextKeyIds, then of the key tile after each: the dQ kernel decides a
// tile ahead), and 1024 bytes to round the dynamic allocation up to the swizzle period
// (SwizzleAligned).
template <int kHeadDim_, int kBlockN_, int kQueryTiles, int kKVBuffers_ = 2,
          bool kNextKeyIds = false>
struct QueryTileTraits {
  static constexpr int kHeadDim = kHeadDim_;  // 64, 128 or 256 (64-column blocks)
  static constexpr int kWarpGroups = 2;
  static constexpr int kBlockM = 64 * kWarpGroups;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kKVBuffers = kKVBuffers_;
  static constexpr int kThreads = 128 * kWarpGroups;
  using QTile = SwizzledTile<kBlockM, kHeadDim>;
  using KVTile = SwizzledTile<kBlockN, kHeadDim>;
  static constexpr int kKVOffset = kQueryTiles * QTile::kBytes;
  static constexpr int kSegOffset = kKVOffset + 2 * kKVBuffers * KVTile::kBytes;
  static constexpr int kKeyIdSlots = kNextKeyIds ? 2 : 1;
  static constexpr int kSmemBytes =
      kSegOffset + (kBlockM + kKeyIdSlots * kKVBuffers * kBlockN) * 4 + 1024;
  static_assert(kSmemBytes <= kMaxSmemBytes, "shared memory");
};

struct QueryRows {
  int group;       // the warpgroup: rows 64 * group.. of the CTA's tile
  int local_row0;  // the warp's first row in the CTA's tile
  QueryTile tile;
  HeadOffsets off;
  Mask mask;
  bool segments;             // segment ids to compare (kMaskable kernels only)
  int dim;                   // H
  int m0, m_last;            // the tile's first and last query (clamped to T)
  int warp_row0, warp_row1;  // the warp's first and last query (clamped to T)
  TileWalk walk;             // kBlockN-key tiles: the CTA's, and the warpgroup's span
};

// kLengths: with the batch row's sequence lengths (MakeMask<true>: the walk stops at them,
// and a CTA whose rows all lie past the query length walks nothing). The CTA's tile: its
// own (FlatGrid) or `tile` (a persistent CTA's current one).
template <int kBlockM, int kBlockN, bool kMaskable, bool kLengths = false>
__device__ __forceinline__ QueryRows MakeQueryRowsOf(const AttentionParams& p,
                                                     const QueryTile& tile) {
  QueryRows r;
  const int warp = threadIdx.x >> 5;
  // Read through a shuffle so that ptxas knows the warpgroup is warp-uniform: wgmma under a
  // branch it thinks divergent is serialized (C7518).
  r.group = __shfl_sync(0xffffffffu, warp >> 2, 0);
  r.local_row0 = 64 * r.group + 16 * (warp & 3);
  r.tile = tile;
  r.off = MakeHeadOffsets(p, r.tile.b, r.tile.kh, r.tile.r);
  r.mask = MakeMask<kLengths>(p, r.tile.b);
  r.segments = kMaskable && r.mask.q_seg != nullptr;
  r.dim = static_cast<int>(p.head_dim);
  r.m0 = r.tile.m_block * kBlockM;
  r.m_last = min(r.m0 + kBlockM, r.mask.q_len) - 1;
  const int group_row0 = r.m0 + 64 * r.group;
  r.walk = MakeTileWalk<true, kLengths>(r.mask, r.m0, r.m_last, group_row0,
                                        min(group_row0 + 64, r.mask.q_len) - 1, kBlockN);
  r.warp_row0 = r.m0 + r.local_row0;
  r.warp_row1 = min(r.warp_row0 + 16, r.mask.q_len) - 1;
  return r;
}

template <int kBlockM, int kBlockN, bool kMaskable, bool kLengths = false>
__device__ __forceinline__ QueryRows MakeQueryRows(const AttentionParams& p) {
  return MakeQueryRowsOf<kBlockM, kBlockN, kMaskable, kLengths>(
      p, DecodeQueryTile<kMaskable>(p, kBlockM));
}

}  // namespace jaxgpu::cuda::attention::sm90
