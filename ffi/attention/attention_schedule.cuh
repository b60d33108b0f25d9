// Which work each CTA of an attention kernel does, in what order, and where its data
// starts, shared by every main loop: the (head, tile) a CTA decodes from its flat grid
// index (longest tiles first, heads in groups under the causal mask), the offsets of a
// (batch, head) slice, and the dK/dV kernels' steps over a GQA group's query heads and
// tiles with the words each step stages. No XLA types.
#pragma once

#include <cstdint>

#include "attention/attention_copy.cuh"
#include "attention/attention_mask.cuh"
#include "attention/attention_params.h"

namespace jaxgpu::cuda::attention {

// Offsets of one (batch b, kv head kh, query head r) slice, in elements (layouts:
// attention_params.h).
struct HeadOffsets {
  int64_t q;      // of q[b, 0, kh, r, 0] (also o, do, dq)
  int64_t kv;     // of k[b, 0, kh, 0] (also v, dk, dv)
  int64_t stats;  // of lse[b, kh, r, 0] (also delta)
  int64_t q_ld;   // elements between consecutive queries: K * R * H
  int64_t kv_ld;  // between consecutive keys: K * H
};

__device__ __forceinline__ HeadOffsets MakeHeadOffsets(const AttentionParams& p, int64_t b,
                                                       int64_t kh, int64_t r) {
  HeadOffsets o;
  o.q_ld = p.kv_heads * p.group * p.head_dim;
  o.kv_ld = p.kv_heads * p.head_dim;
  o.q = b * p.q_len * o.q_ld + (kh * p.group + r) * p.head_dim;
  o.kv = b * p.kv_len * o.kv_ld + kh * p.head_dim;
  o.stats = ((b * p.kv_heads + kh) * p.group + r) * p.q_len;
  return o;
}

// The order in which a FlatGrid over (head, tile) hands out work. Heads go in groups of
// `group_heads`; within a group the tiles go longest first (rank 0 first), the group's
// heads taking turns. With one head a group (the order without the causal mask, where all
// tiles are alike) the CTAs of one head run together and share its K/V or Q/dO through
// L2. Under the causal mask tile lengths differ by up to T / tile: one head after another
// (each longest first), the grid ended on the last head's long tiles while most SMs sat
// idle; in groups it ends on short ones.
struct HeadAndRank {
  int64_t head;
  int rank;  // 0: the tile with the most work under the causal mask
};

// flat < heads * tiles <= INT32_MAX (FlatGrid): 32-bit division.
__device__ __forceinline__ HeadAndRank DecodeGroupedTile(int flat, int heads, int tiles,
                                                         int group_heads) {
  const int per_group = group_heads * tiles;
  const int group = flat / per_group;
  const int within = flat - group * per_group;
  const int heads_here = min(heads - group * group_heads, group_heads);
  return {static_cast<int64_t>(group) * group_heads + within % heads_here, within / heads_here};
}

// Heads a group: under the causal mask as many as keep a group's K and V (2 bytes an
// element) within 8 MB, at most 8; otherwise 1. Measured on the H100 (H = 128, N = 32, B*T =
// 16k): at T = 4096 (2 MB a head) groups of 1/4/8/16 heads gave forward 357/362/358/359
// TFLOP/s and backward 324/334/333/334; at T = 16k (8 MB a head) 1 head gave 420/379, 4
// or more 410/375 (likely L2: a group's K/V then exceeds the 50 MB it holds).
__device__ __forceinline__ int GroupHeads(const AttentionParams& p) {
  if (!p.causal) return 1;
  const int64_t kv_bytes = 4 * p.kv_len * p.head_dim;
  const int64_t fit = (int64_t{8} << 20) / (kv_bytes > 0 ? kv_bytes : 1);
  return static_cast<int>(fit < 1 ? 1 : (fit > 8 ? 8 : fit));
}

// The query head and query tile a CTA owns in a FlatGrid over (head, tile): the last tiles
// have the most keys under the causal mask, so rank 0 is the last tile. kGrouped: in
// DecodeGroupedTile's order; otherwise one head after another, which the kernels without a
// mask (kMaskable false, so never causal) use: the grouped decode, even at one head a group
// or behind a branch on p.causal, cost their forward 3-5% on the H100 (435 -> 414 TFLOP/s at
// T = 4096, H = 128; code generation: the main loop's PTX is the same), and without the causal
// mask it orders nothing differently.
struct QueryTile {
  int64_t b, kh, r;  // batch, kv head, query head within the kv head's group
  int m_block;
};

template <bool kGrouped, typename Flat>
__device__ __forceinline__ QueryTile DecodeQueryTileAt(const AttentionParams& p, int block_m,
                                                       Flat flat) {
  const int m_blocks = (static_cast<int>(p.q_len) + block_m - 1) / block_m;
  QueryTile q;
  int64_t head;
  if constexpr (kGrouped) {
    const HeadAndRank hr =
        DecodeGroupedTile(static_cast<int>(flat), static_cast<int>(p.batch * p.kv_heads * p.group),
                          m_blocks, GroupHeads(p));
    head = hr.head;
    q.m_block = m_blocks - 1 - hr.rank;
  } else {
    head = flat / m_blocks;
    q.m_block = m_blocks - 1 - static_cast<int>(flat % m_blocks);
  }
  q.r = head % p.group;
  q.kh = (head / p.group) % p.kv_heads;
  q.b = head / (p.group * p.kv_heads);
  return q;
}

// DecodeQueryTileAt's tile in 32-bit integers throughout (flat < heads x tiles <= INT32_MAX,
// FlatGrid's bound), in groups of `group_heads` > 0 heads (kGrouped; the caller's, not
// GroupHeads). Why: its 64-bit divisions (head into b, kh, r) are calls, and the registers a
// call saves do not fit a warp-specialized copy warp's 24 (fwd_ws_sm90's dynamic grid
// decodes a tile per draw there: 40 to 144 bytes of spills with DecodeQueryTileAt).
template <bool kGrouped>
__device__ __forceinline__ QueryTile DecodeQueryTile32(const AttentionParams& p, int block_m,
                                                       int flat, int group_heads) {
  const int m_blocks = (static_cast<int>(p.q_len) + block_m - 1) / block_m;
  const int group = static_cast<int>(p.group), kv_heads = static_cast<int>(p.kv_heads);
  QueryTile q;
  int head;
  if constexpr (kGrouped) {
    const HeadAndRank hr = DecodeGroupedTile(flat, static_cast<int>(p.batch) * kv_heads * group,
                                             m_blocks, group_heads);
    head = static_cast<int>(hr.head);
    q.m_block = m_blocks - 1 - hr.rank;
  } else {
    head = flat / m_blocks;
    q.m_block = m_blocks - 1 - (flat - head * m_blocks);
  }
  const int kv_head = head / group;  // b * K + kh
  q.r = head - kv_head * group;
  q.b = kv_head / kv_heads;
  q.kh = kv_head - static_cast<int>(q.b) * kv_heads;
  return q;
}

// The CTA's tile in a FlatGrid: `flat` is blockIdx.x itself (unsigned), as each kernel had it.
template <bool kGrouped>
__device__ __forceinline__ QueryTile DecodeQueryTile(const AttentionParams& p, int block_m) {
  return DecodeQueryTileAt<kGrouped>(p, block_m, blockIdx.x);
}

// The kv head and key tile a dK/dV CTA owns in a FlatGrid over (kv head, tile): the first
// key tiles have the most queries under the causal mask, so rank 0 is tile 0. kGrouped: as
// DecodeQueryTile's. `flat` keeps the caller's integer type (the mma.sync kernel's is 64-bit,
// the wgmma kernel's blockIdx.x): the ungrouped decode is then the division each kernel
// had, for the code-generation reason given at DecodeQueryTile.
struct KeyTile {
  int64_t b, kh;  // batch, kv head
  int n_block;
};

template <bool kGrouped, typename Flat>
__device__ __forceinline__ KeyTile DecodeKeyTile(const AttentionParams& p, Flat flat,
                                                 int n_blocks) {
  int64_t kv_head;  // b * K + kh
  KeyTile k;
  if constexpr (kGrouped) {
    const HeadAndRank hr = DecodeGroupedTile(
        static_cast<int>(flat), static_cast<int>(p.batch * p.kv_heads), n_blocks, GroupHeads(p));
    kv_head = hr.head;
    k.n_block = hr.rank;
  } else {
    kv_head = flat / n_blocks;
    k.n_block = static_cast<int>(flat % n_blocks);
  }
  k.kh = kv_head % p.kv_heads;
  k.b = kv_head / p.kv_heads;
  return k;
}

// The dK/dV kernels' 4-byte words in shared memory: the keys' kBlockN segment ids, then per
// Q/dO buffer the step's query segment ids, lse and delta (kBlockM each), and with
// kNextIds the next step's query segment ids too (the Hopper kernel decides a step ahead).
template <int kBlockN, int kBlockM, bool kNextIds = false>
struct StepWords {
  static constexpr int kPerBuffer = (kNextIds ? 4 : 3) * kBlockM;
  int32_t* kv_seg;

  static constexpr int Bytes(int buffers) { return (kBlockN + buffers * kPerBuffer) * 4; }
  __device__ __forceinline__ int32_t* QSeg(int buf) const {
    return kv_seg + kBlockN + buf * kPerBuffer;
  }
  __device__ __forceinline__ float* Lse(int buf) const {
    return reinterpret_cast<float*>(QSeg(buf) + kBlockM);
  }
  __device__ __forceinline__ float* Delta(int buf) const {
    return reinterpret_cast<float*>(QSeg(buf) + 2 * kBlockM);
  }
  __device__ __forceinline__ int32_t* NextQSeg(int buf) const {
    static_assert(kNextIds, "no next-step ids");
    return QSeg(buf) + 3 * kBlockM;
  }
  // Copies the words of the step over queries m0.. of the query head whose statistics start
  // at `stats` into buffer `buf` (joining the caller's cp.async group); with kNextIds, also
  // the segment ids of the next step's queries m0_next...
  __device__ __forceinline__ void LoadStep(int buf, const AttentionParams& p, const Mask& mask,
                                           bool segments, int64_t stats, int m0,
                                           int m0_next = 0) const {
    if (segments) {
      LoadRowWordsAsync(QSeg(buf), mask.q_seg, m0, mask.q_len, kBlockM);
      if constexpr (kNextIds) {
        LoadRowWordsAsync(NextQSeg(buf), mask.q_seg, m0_next, mask.q_len, kBlockM);
      }
    }
    LoadRowWordsAsync(Lse(buf), p.lse + stats, m0, mask.q_len, kBlockM);
    LoadRowWordsAsync(Delta(buf), p.delta + stats, m0, mask.q_len, kBlockM);
  }
};

// The dK/dV kernels' walk over (query head r of the GQA group, query tile) steps, tiles
// fastest, and the Q/dO buffer of each step (round robin over kBuffers): counters, not a
// division per step (integer division was ~5% of the mma.sync kernel's stall samples).
template <int kBuffers>
struct GroupStepCursor {
  int r = 0, tile = 0, buf = 0;
  // The query tile of the step after this one (the next head's first after the last).
  __device__ __forceinline__ int NextTile(int tiles) const {
    return tile + 1 == tiles ? 0 : tile + 1;
  }
  __device__ __forceinline__ void Next(int tiles) {
    if (++tile == tiles) tile = 0, ++r;
    if (++buf == kBuffers) buf = 0;
  }
};

}  // namespace jaxgpu::cuda::attention
