// Warp-specialized attention forward (sm_90a): the wgmma forward's math (fwd_sm90.cu) fed
// by the Tensor Memory Accelerator from a copy warpgroup. The wgmma path's forward wherever
// it takes the call (LaunchFwd in fwd_sm90.cu; fwd_sm90's kernel keeps sequence lengths).
//
// A CTA of 3 warpgroups owns 128 queries of one query head at a time. Warpgroups 0 and 1
// compute (64 rows each, the fwd_sm90 pipeline: tile i's S = Q K^T issued with tile
// i-1's O += P V, the softmax under P V); warpgroup 2 gives up its registers (setmaxnreg)
// and one of its threads issues every copy: Q, then K and V tiles into two rings of kStages
// slots. Each slot has a `full` barrier (the copy engine's transaction count) and an
// `empty` barrier (one arrival per math thread once its warpgroup's MMAs have read the
// slot), so K_{i+1} is in flight while S_i runs and no CTA-wide barrier stands in the loop.
// Segment ids ride with Q and K: the copy warp's 32 lanes copy them (cp.async) into words
// beside the tiles, tracked on the same full barriers (cp.async.mbarrier.arrive).
// Options (template switches): ping-pong of the math warpgroups on the tensor cores, and a
// persistent grid (one CTA an SM walking the tiles, the rings going on across them), the
// tiles in a fixed stride or drawn from a counter (WsGrid).
//
// Covered: 16-bit q/k/v with head dims padded to 64, 128 or 256 (H a multiple of 8), the causal
// and window masks, softcap, segment ids; not sequence lengths, bias or mask (the caller
// keeps fwd_sm90 for those).
//
// H100, bf16, B * T = 16k, N = 16 (tools/attention_ws_check, TFLOP/s; plain / persistent /
// ping-pong): H 128 T 4096 677 / 702 / 673, causal 559 / 389 / 566; T 16384 737 / 742 / 733,
// causal 713 / 464 / 696; H 64 T 1024 causal 192 / 233 / 200; GQA 32/8 causal 572 / 623 /
// 585; H 256 782 / 802 / 773, causal 680 / 550 / 658. (fwd_sm90's kernel: 430 at H 128.)
// Ping-pong gains nothing measurable: off. The persistent grid walks tiles in a fixed
// stride, which balances uniform tiles (and saves the per-CTA start on short ones) but not
// causal ones, whose costs differ by up to the number of key tiles. The dynamic grid
// (WsGrid::kDynamic: tiles drawn from a counter, longest first in groups of heads whose
// K/V fit L2) balances those; same run, TFLOP/s, one CTA a tile / stride / dynamic: H 128
// T 4k causal 588 / 421 / 638, T 16k causal 756 / 503 / 774, T 1k causal 308 / 338 / 381;
// H 64 T 1k causal 193 / 230 / 238, T 4k causal 346 / 376 / 427; GQA 32/8 causal 617 / 651
// / 653; H 256 causal 671 / 552 / 718; unmasked it matches the stride (H 128 T 4k 665 /
// 696 / 696, H 256 802 / 813 / 790). So the default (DefaultWsFwdSchedule): the stride
// where no tile masks, the dynamic grid where tiles do (its counter needs a workspace:
// without one the masked calls go to fwd_sm90's kernel).
//
// ptxas (CUDA 13.0, sm_90a): product build 36 instances, developer-knob build 216 (3 grids x
// ping-pong x 36), no spills but 4 bytes in the 8 H 256 maskable ping-pong ones of the
// one-CTA-a-tile and stride grids.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "attention/attention_copy.cuh"
#include "attention/attention_launch.cuh"
#include "attention/attention_logits.cuh"
#include "attention/attention_mask.cuh"
#include "attention/attention_schedule.cuh"
#include "attention/attention_softmax.cuh"
#include "attention/sm90/dispatch.cuh"
#include "attention/sm90/fwd_ws_sm90.h"
#include "attention/sm90/query_rows.cuh"
#include "attention/sm90/tma.cuh"
#include "attention/sm90/wgmma.cuh"
#include "common/dev_knobs.h"

namespace jaxgpu::cuda::attention::sm90 {
namespace {

template <int kHeadDim_>
struct WsFwdTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 128;  // two math warpgroups of 64 rows
  // 64-key tiles at H = 256, as fwd_sm90's: the 128-float output accumulator leaves room
  // for a 32-float score tile; shared memory 64 + 4 x 32 KB. (SASS, CUDA 13.0: the math
  // path's registers peak at 198-215 for H 128 and 223 for H 256; H 256 with the mask hits
  // the 240 of setmaxnreg and spills ~10 stores.)
  static constexpr int kBlockN = kHeadDim > 128 ? 64 : 128;
  static constexpr int kStages = 2;  // per ring (K, V): 160 KB at H = 128
  static constexpr int kMathThreads = 256;
  static constexpr int kThreads = kMathThreads + 128;
  // Registers: 24 for the copy warpgroup, 240 for the math ones (128 x 24 + 256 x 240 <=
  // 65536), as FlashAttention-3 splits them.
  static constexpr int kCopyRegisters = 24;
  static constexpr int kMathRegisters = 240;
  using QTile = SwizzledTile<kBlockM, kHeadDim>;
  using KVTile = SwizzledTile<kBlockN, kHeadDim>;
  static constexpr int kKOffset = QTile::kBytes;
  static constexpr int kVOffset = kKOffset + kStages * KVTile::kBytes;
  static constexpr int kBarrierOffset = kVOffset + kStages * KVTile::kBytes;
  // Barriers: q_full, k_full[s], v_full[s], k_empty[s], v_empty[s], q_empty.
  static constexpr int kBarriers = 2 + 4 * kStages;
  // Segment ids: Q's kBlockM words, then kStages x kBlockN words of the K ring's slots.
  static constexpr int kSegOffset = kBarrierOffset + kBarriers * 8;
  // The dynamic grid's ring of tile indices (drawing warp -> copy warp and math
  // warpgroups): its barriers tile_full[j], tile_empty[j], draw_wanted, then its slots. Two
  // slots, so that tiles with an empty walk pass without a wait for the slowest reader.
  static constexpr int kTileSlots = 2;
  static_assert(kTileSlots >= 2, "DrawTiles reads the previous tile's record in its slot");
  static constexpr int kTileOffset = kSegOffset + (kBlockM + kStages * kBlockN) * 4;
  static_assert(kTileOffset % 8 == 0, "barrier alignment");
  static constexpr int kTileRecordWords = 10;  // TileRecord
  static constexpr int kSmemBytes =
      kTileOffset + (2 * kTileSlots + 1) * 8 + kTileSlots * kTileRecordWords * 4 + 1024;
  static_assert(kSmemBytes <= kMaxSmemBytes, "shared memory");
};

struct TensorMaps {
  CUtensorMap q, k, v;
};

// The CTA's shared memory (Tr's offsets from the 1024-byte aligned base): Q, the K and V
// rings, and their barriers.
template <typename Tr>
struct WsSmem {
  unsigned char* base;
  __device__ __forceinline__ unsigned char* q() const { return base; }
  __device__ __forceinline__ unsigned char* k(int s) const {
    return base + Tr::kKOffset + s * Tr::KVTile::kBytes;
  }
  __device__ __forceinline__ unsigned char* v(int s) const {
    return base + Tr::kVOffset + s * Tr::KVTile::kBytes;
  }
  __device__ __forceinline__ uint64_t* barrier(int i) const {
    return reinterpret_cast<uint64_t*>(base + Tr::kBarrierOffset) + i;
  }
  __device__ __forceinline__ uint64_t* q_full() const { return barrier(0); }
  __device__ __forceinline__ uint64_t* k_full(int s) const { return barrier(1 + s); }
  __device__ __forceinline__ uint64_t* v_full(int s) const { return barrier(1 + Tr::kStages + s); }
  __device__ __forceinline__ uint64_t* k_empty(int s) const {
    return barrier(1 + 2 * Tr::kStages + s);
  }
  __device__ __forceinline__ uint64_t* v_empty(int s) const {
    return barrier(1 + 3 * Tr::kStages + s);
  }
  __device__ __forceinline__ uint64_t* q_empty() const { return barrier(1 + 4 * Tr::kStages); }
  __device__ __forceinline__ uint64_t* tile_full(int j) const {
    return reinterpret_cast<uint64_t*>(base + Tr::kTileOffset) + j;
  }
  __device__ __forceinline__ uint64_t* tile_empty(int j) const {
    return tile_full(Tr::kTileSlots + j);
  }
  __device__ __forceinline__ uint64_t* draw_wanted() const { return tile_full(2 * Tr::kTileSlots); }
  __device__ __forceinline__ int* tile_slot(int j) const {
    return reinterpret_cast<int*>(tile_full(2 * Tr::kTileSlots + 1)) + j * Tr::kTileRecordWords;
  }
  __device__ __forceinline__ int32_t* q_seg() const {
    return reinterpret_cast<int32_t*>(base + Tr::kSegOffset);
  }
  __device__ __forceinline__ int32_t* k_seg(int s) const {
    return q_seg() + Tr::kBlockM + s * Tr::kBlockN;
  }
};

// The copy warp's part of a tile's segment ids: ids[first, first + n) (clamped to the
// sequence, as LoadRowWordsAsync's) into `dst` by the warp's 32 lanes, their completion
// tracked on `bar`. Each lane's cp.async.mbarrier.arrive adds one pending arrival that the
// copies' completion takes away, so the barrier's count (the issuer's one arrival) stays;
// the __syncwarp orders these before the issuer's arrival, which could otherwise complete
// the phase first.
__device__ __forceinline__ void CopySegmentIds(int32_t* dst, const int32_t* ids, int first, int len,
                                               int n, uint64_t* bar, int lane) {
#if JAXGPU_WGMMA_DEVICE
  for (int i = lane; i < n; i += 32) {
    const int32_t* from = ids + min(first + i, len - 1);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(SmemAddress(dst + i)), "l"(from)
                 : "memory");
  }
  asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];\n" ::"r"(SmemAddress(bar))
               : "memory");
  __syncwarp();
#endif
}

// What the copy warp needs of a tile: its batch row, kv head and query head, first query,
// the key tiles [n_begin, n_end) it loads, and the rings' use before it (RingUse below). In
// registers (CopyTile), or in the dynamic grid's shared-memory record (TileRecord: read
// where used, so that none of it is held in the copy warp's 24 registers across the walk).
struct CopyTile {
  int b_, kh_, qh_, m0_, n_begin_, n_end_, kv0_, q0_;
  __device__ __forceinline__ int kv0() const { return kv0_; }
  __device__ __forceinline__ int q0() const { return q0_; }
  __device__ __forceinline__ int b() const { return b_; }
  __device__ __forceinline__ int kh() const { return kh_; }
  __device__ __forceinline__ int qh() const { return qh_; }
  __device__ __forceinline__ int m0() const { return m0_; }
  __device__ __forceinline__ int n_begin() const { return n_begin_; }
  __device__ __forceinline__ int n_end() const { return n_end_; }
};

// Words: the flat index (the sentinel `tiles` after the last), then CopyTile's eight, then
// the record's place in the ring (the copy warp reads it back rather than hold it).
struct TileRecord {
  const volatile int* w;
  __device__ __forceinline__ int flat() const { return w[0]; }
  __device__ __forceinline__ int b() const { return w[1]; }
  __device__ __forceinline__ int kh() const { return w[2]; }
  __device__ __forceinline__ int qh() const { return w[3]; }
  __device__ __forceinline__ int m0() const { return w[4]; }
  __device__ __forceinline__ int n_begin() const { return w[5]; }
  __device__ __forceinline__ int n_end() const { return w[6]; }
  __device__ __forceinline__ int kv0() const { return w[7]; }
  __device__ __forceinline__ int q0() const { return w[8]; }
  __device__ __forceinline__ int k() const { return w[9]; }  // the record's place in the ring
};

// `used` counts the CTA's earlier tiles: K/V tiles through the rings and Q tiles, whose
// barrier phases go on from there (a persistent CTA's tiles share the rings).
struct RingUse {
  int kv = 0;  // K/V tiles
  int q = 0;   // Q tiles (tiles that walked at least one key tile)
};

__device__ __forceinline__ CopyTile CopyTileOf(const AttentionParams& p, const QueryRows& rows,
                                               const RingUse& used) {
  return {static_cast<int>(rows.tile.b),
          static_cast<int>(rows.tile.kh),
          static_cast<int>(rows.tile.kh * p.group + rows.tile.r),
          rows.m0,
          rows.walk.begin,
          rows.walk.end,
          used.kv,
          used.q};
}

// The two math warpgroups (threads 0..255): the fwd_sm90 pipeline on the rings' slots.
// kPingPong: the warpgroups take turns issuing their MMAs (FlashAttention-3's schedule), so
// that one's softmax runs while the other's products occupy the tensor cores: a turn is
// barrier 1 + g completing, which takes this warpgroup's bar.sync and the other's
// bar.arrive at the end of its own turn. Warpgroup 0 goes first (warpgroup 1 arrives once
// at the start), and warpgroup 1 leaves out its last arrival, so that every barrier phase
// is complete when a tile ends. Both walk the same tiles: the same number of turns.
// kBounded (with kSoftcap): the softmax subtracts LogitScale::bound instead of the running
// row max (BoundedSoftmax, as fwd_sm90's), so the output accumulator is never rescaled.
template <typename T, typename Tr, bool kMaskable, bool kSoftcap, bool kBounded, bool kPingPong>
__device__ __forceinline__ void MathWarpgroups(const AttentionParams& p, const LogitScale& ls,
                                               const sm90::QueryRows& rows, const WsSmem<Tr>& sm,
                                               RingUse& used) {
  constexpr int kD = Tr::kHeadDim, kN = Tr::kBlockN, kS = Tr::kStages;
  using KVTile = typename Tr::KVTile;
  const int n_begin = rows.walk.begin, n_end = rows.walk.end;
  const int lane = threadIdx.x & 31;
  const HeadOffsets& off = rows.off;
  const Mask& mask = rows.mask;
  const int m0 = rows.m0;

  float acc_o[1][kD / 8][4];
  const float max0 = kBounded ? ls.bound : -INFINITY;
  float row_max[1][2] = {{max0, max0}}, row_sum[1][2] = {{0.f, 0.f}};
  Zero(acc_o);

  const uint64_t q_desc = sm90::SwizzledDescriptor(sm.q() + 64 * rows.group * 128, 16, 1024);
  auto k_desc = [&](int s) { return sm90::SwizzledDescriptor(sm.k(s), 16, 1024); };
  auto v_desc = [&](int s) { return sm90::SwizzledDescriptor(sm.v(s), KVTile::kBlockBytes, 1024); };
  auto slot = [&](int nb) { return (used.kv + nb - n_begin) % kS; };
  auto phase = [&](int nb) { return static_cast<uint32_t>(((used.kv + nb - n_begin) / kS) & 1); };

  auto begin_turn = [&] {
    if constexpr (kPingPong) NamedBarrierSync(1 + rows.group, Tr::kMathThreads);
  };
  auto end_turn = [&](bool last) {
    if constexpr (kPingPong) {
      if (!last || rows.group == 0) NamedBarrierArrive(2 - rows.group, Tr::kMathThreads);
    }
  };
  // S = Q K^T of tile nb, issued (K_nb waited for by the caller, before its turn).
  auto issue_scores = [&](float (&acc_s)[1][kN / 8][4], int nb) {
    sm90::Fence();
    sm90::ProductSS<T, kN, kD, Tr::QTile::kBlockBytes, KVTile::kBlockBytes>(
        acc_s[0], q_desc, k_desc(slot(nb)), false);
    sm90::Commit();
  };
  float correction[1][2];
  auto softmax = [&](float (&acc_s)[1][kN / 8][4], int nb, bool masks) {
    const int n0 = nb * kN;
    TileMasking tm{false, false, nullptr, nullptr};
    if (masks) {
      tm = DecideMasking<kMaskable>(mask, rows.segments, rows.warp_row0, rows.warp_row1, n0,
                                    n0 + kN - 1, sm.q_seg() + rows.local_row0, 16,
                                    sm.k_seg(slot(nb)), kN, lane);
    }
    ToLogits<false, kN, kSoftcap, true>(acc_s[0], ls, mask, tm.masked, rows.warp_row0, n0,
                                        tm.RowSeg(0), tm.col_seg, lane);
    if constexpr (kBounded) {
      BoundedSoftmax<kN>(acc_s[0], row_sum[0], ls);
    } else {
      OnlineSoftmax<kN>(acc_s[0], row_max[0], row_sum[0], correction[0], ls.fold);
    }
  };
  // K's slot is free once S is read, but its segment ids only after the softmax.
  auto release_k = [&](int nb, bool after_softmax) {
    if (after_softmax == rows.segments) MbarrierArrive(sm.k_empty(slot(nb)));
  };
  uint32_t p_frags[kN / 16][1][4];

  if (n_begin < n_end) {
    if (kPingPong && rows.group == 1) NamedBarrierArrive(1, Tr::kMathThreads);
    MbarrierWait(sm.q_full(), used.q & 1);
    {
      float acc_s[1][kN / 8][4];
      MbarrierWait(sm.k_full(slot(n_begin)), phase(n_begin));
      begin_turn();
      issue_scores(acc_s, n_begin);
      end_turn(false);
      sm90::Wait<0>();
      sm90::KeepOrder(acc_s[0]);
      release_k(n_begin, false);
      softmax(acc_s, n_begin, kMaskable);
      release_k(n_begin, true);
      PackProbs<T, kN, 1>(p_frags, acc_s);
    }
    auto step = [&](int nb, bool masks) {
      float acc_s[1][kN / 8][4];
      MbarrierWait(sm.k_full(slot(nb)), phase(nb));
      MbarrierWait(sm.v_full(slot(nb - 1)), phase(nb - 1));
      begin_turn();
      issue_scores(acc_s, nb);
      sm90::Fence();  // O += P V of tile nb - 1, overlapping tile nb's softmax
      sm90::ProductRSWide<T, kD, kN, KVTile::kBlockBytes>(acc_o[0], p_frags, v_desc(slot(nb - 1)));
      sm90::Commit();
      end_turn(false);
      sm90::Wait<1>();  // S ready; P V may still run
      sm90::KeepOrder(acc_s[0]);
      release_k(nb, false);
      softmax(acc_s, nb, masks);
      release_k(nb, true);
      sm90::Wait<0>();
      sm90::KeepOrder(acc_o[0]);
      MbarrierArrive(sm.v_empty(slot(nb - 1)));
      if constexpr (!kBounded) RescaleRows<1, kD>(acc_o, correction);
      PackProbs<T, kN, 1>(p_frags, acc_s);
    };
    if constexpr (kMaskable) {
      int nb = n_begin + 1, full_lo, full_hi;
      mask.FullTileRange(m0, rows.m_last, kN, &full_lo, &full_hi);
      const int clean_lo = min(max(nb, full_lo), n_end);
      // With segment ids every tile may mask (no clean run), as in fwd_sm90.
      const int clean_hi = rows.segments ? clean_lo : max(clean_lo, min(full_hi, n_end));
      for (; nb < clean_lo; ++nb) step(nb, true);
      for (; nb < clean_hi; ++nb) step(nb, false);
      for (; nb < n_end; ++nb) step(nb, true);
    } else {
      for (int nb = n_begin + 1; nb < n_end; ++nb) step(nb, false);
    }
    MbarrierWait(sm.v_full(slot(n_end - 1)), phase(n_end - 1));
    begin_turn();
    sm90::Fence();
    sm90::ProductRSWide<T, kD, kN, KVTile::kBlockBytes>(acc_o[0], p_frags, v_desc(slot(n_end - 1)));
    sm90::Commit();
    end_turn(true);
    sm90::Wait<0>();
    sm90::KeepOrder(acc_o[0]);
    MbarrierArrive(sm.v_empty(slot(n_end - 1)));  // a persistent CTA's next tile reuses it
    MbarrierArrive(sm.q_empty());                 // every product with this Q is done
    used.kv += n_end - n_begin;
    used.q += 1;
  }

  T* o = static_cast<T*>(p.o) + off.q + m0 * off.q_ld;
  StoreOutputRows<T, 1, kD>(o, p.lse + off.stats + m0, off.q_ld, acc_o, row_max, row_sum,
                            kBounded ? 1.f : ls.fold, rows.local_row0, m0, mask.q_len, rows.dim,
                            lane);
}

// How a kernel's CTAs walk the flat tiles (the FlatGrid order of DecodeQueryTileAt: the
// longest causal tiles first within a group of heads).
// kPerTile: one CTA a tile; the hardware hands out CTAs in index order as SMs free up.
// kStride: one CTA an SM walks tiles blockIdx.x, + gridDim.x, ... Its rings go on from tile
//   to tile (no CTA start, the next tile's loads under this one's epilogue), but each CTA's
//   share is fixed in advance: causal tiles, unequal, leave the shares unequal (T 4k: 389
//   against 559 TFLOP/s one CTA a tile).
// kDynamic: one CTA an SM takes tile blockIdx.x, then draws each next one from a counter in
//   global memory: greedy list scheduling, which starts a tile wherever an SM runs out of
//   work, so the only imbalance left is the tail, the tiles drawn last; the order makes
//   those the shortest (DynamicGroupHeads).
enum class WsGrid { kPerTile, kStride, kDynamic };

// The grid a product build compiles (and the default schedule runs) for calls whose tiles
// mask or not (the file comment's measurements).
constexpr WsGrid DefaultWsGrid(bool masks) { return masks ? WsGrid::kDynamic : WsGrid::kStride; }

// The dynamic grid's drawing warp (the copy warpgroup's second warp, whose 24 registers
// hold only this loop: drawing and decoding in the copy warp itself spilled 32-144 bytes).
// Tile k goes to the copy warp and the math warpgroups through record slot k % kJ: written
// here, published by tile_full's one arrival (mbarrier.arrive releases the thread's earlier
// shared-memory writes, the readers' try_wait acquires them), handed back by tile_empty's
// kMathThreads + 1 arrivals (each math thread's after its read, the copy warp's lane 0 after
// the tile's last copy). The first tile is blockIdx.x; each next one is drawn once the copy
// warp says it has reached the current tile's last K/V step (draw_wanted): late enough that
// a CTA does not hold a tile it cannot start soon (the draw order is the balance: a tile
// drawn a whole tile ahead costs the list-scheduling model of DynamicGroupHeads 4% at T 4k,
// against 0.1%), early enough that the atomic's round trip passes under that step (the copy
// warp runs a ring ahead of the math). The math warpgroups learn tile k + 1 when they finish
// tile k, before its Q can come (which waits for q_empty). The last index is the sentinel
// `tiles`.
template <typename Tr, typename RowsOf>
__device__ __forceinline__ void DrawTiles(const AttentionParams& p, const WsSmem<Tr>& sm, int tiles,
                                          int* tile_counter, RowsOf&& rows_of) {
#if JAXGPU_WGMMA_DEVICE
  constexpr int kJ = Tr::kTileSlots;
  // The whole warp walks (the decode's shuffles name all 32 lanes); lane 0 writes, arrives
  // and draws.
  const bool leader = threadIdx.x % 32 == 0;
  const int grid = static_cast<int>(gridDim.x);
  int flat = static_cast<int>(blockIdx.x);
  for (int k = 0;; ++k) {
    const int j = k % kJ;
    if (k >= kJ) MbarrierWait(sm.tile_empty(j), ((k / kJ) & 1) ^ 1);
    // Volatile: the stores and the loads of the previous record stay in this order, after
    // the decode, which then has the 24 registers to itself.
    volatile int* const record = sm.tile_slot(j);
    if (leader) {
      record[0] = flat;
      record[9] = k;
    }
    if (flat < tiles) {
      const CopyTile t = CopyTileOf(p, rows_of(flat), RingUse{});
      if (leader) {
        record[1] = t.b();
        record[2] = t.kh();
        record[3] = t.qh();
        record[4] = t.m0();
        record[5] = t.n_begin();
        record[6] = t.n_end();
        // The copy warp's RingUse before this tile, from the previous tile's record (still
        // in its slot: its reuse waits for this one's readers), not held across the decode.
        int kv0 = 0, q0 = 0;
        if (k > 0) {
          const TileRecord prev{sm.tile_slot((k - 1) % kJ)};
          if (prev.n_begin() < prev.n_end()) {
            kv0 = prev.kv0() + prev.n_end() - prev.n_begin();
            q0 = prev.q0() + 1;
          } else {
            kv0 = prev.kv0();
            q0 = prev.q0();
          }
        }
        record[7] = kv0;
        record[8] = q0;
      }
    }
    if (leader) MbarrierArrive(sm.tile_full(j));
    if (flat >= tiles) return;
    MbarrierWait(sm.draw_wanted(), k & 1);
    // Draw d is tile gridDim.x + d; each CTA draws until it gets none, so the draws number
    // (tiles - gridDim.x) + gridDim.x = tiles (gridDim.x <= tiles, the host's grid) and the
    // one that drew tiles - 1 drew last: no CTA touches the counter after it, and it leaves
    // the counter 0 for the next call on the stream.
    int drawn = 0;
    if (leader) {
      drawn = atomicAdd(tile_counter, 1);
      if (drawn == tiles - 1) atomicExch(tile_counter, 0);
    }
    drawn = __shfl_sync(0xffffffffu, drawn, 0);
    flat = drawn >= tiles - grid ? tiles : grid + drawn;
  }
#endif
}

// The kernel over `tiles` flat tiles. kDynamic: tile_counter holds 0 at the start (the
// caller's kWsFwdWorkspaceBytes) and group_heads is the order's heads a group.
template <typename T, typename Tr, bool kMaskable, bool kSoftcap, bool kBounded, bool kPingPong,
          WsGrid kGrid>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    AttentionFwdWsKernel(const AttentionParams p, const LogitScale ls,
                         const __grid_constant__ TensorMaps maps, int tiles, int* tile_counter,
                         int group_heads) {
#if JAXGPU_WGMMA_DEVICE
  constexpr int kD = Tr::kHeadDim, kM = Tr::kBlockM, kN = Tr::kBlockN, kS = Tr::kStages;
  constexpr int kJ = Tr::kTileSlots;
  constexpr bool kDynamic = kGrid == WsGrid::kDynamic;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const WsSmem<Tr> sm{sm90::SwizzleAligned(smem_raw)};

  if (threadIdx.x == 0) {
    MbarrierInit(sm.q_full(), 1);
    MbarrierInit(sm.q_empty(), Tr::kMathThreads);
    for (int s = 0; s < kS; ++s) {
      MbarrierInit(sm.k_full(s), 1);
      MbarrierInit(sm.v_full(s), 1);
      MbarrierInit(sm.k_empty(s), Tr::kMathThreads);
      MbarrierInit(sm.v_empty(s), Tr::kMathThreads);
    }
    if constexpr (kDynamic) {
      for (int j = 0; j < kJ; ++j) {
        MbarrierInit(sm.tile_full(j), 1);
        MbarrierInit(sm.tile_empty(j), Tr::kMathThreads + 1);  // + the copy warp's issuer
      }
      MbarrierInit(sm.draw_wanted(), 1);
    }
    FenceBarrierInit();
  }
  __syncthreads();  // the last CTA-wide barrier: the roles split below

  const int stride = kGrid == WsGrid::kPerTile ? tiles : static_cast<int>(gridDim.x);
  // The dynamic grid's order groups group_heads heads, decoded in 32-bit integers (the copy
  // warp decodes each tile it draws, within its 24 registers); the others keep every
  // FlatGrid kernel's (GroupHeads(p) heads a group).
  auto rows_of = [&](int flat) {
    if constexpr (kDynamic) {
      return sm90::MakeQueryRowsOf<kM, kN, kMaskable>(
          p, DecodeQueryTile32<kMaskable>(p, kM, flat, group_heads));
    } else {
      return sm90::MakeQueryRowsOf<kM, kN, kMaskable>(p, DecodeQueryTileAt<kMaskable>(p, kM, flat));
    }
  };
  const int group = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x >> 7), 0);
  RingUse used;
  if (group == 2) {
    // The copy warpgroup: its first warp walks the tiles, its lane 0 issues every copy; in
    // the dynamic grid the second warp draws them.
    ReleaseRegisters<Tr::kCopyRegisters>();
    const int warp = static_cast<int>(threadIdx.x / 32) - Tr::kMathThreads / 32;
    if constexpr (kDynamic) {
      if (warp == 1) {
        DrawTiles<Tr>(p, sm, tiles, tile_counter, rows_of);
        return;
      }
    }
    if (warp != 0) return;
    const bool issuer = threadIdx.x == Tr::kMathThreads;
    const int lane = threadIdx.x & 31;
    // Every copy of tile `t` (a CopyTile or TileRecord; none where its walk is empty), `mask`
    // giving its Mask where segment ids are copied. `ahead` runs once, at the start of the
    // tile's last K/V step (at once where it has none): the dynamic grid asks for its next
    // draw there (DrawTiles says why there).
    auto copy_tile = [&](const auto& t, auto&& mask, auto&& ahead) {
      if (t.n_begin() >= t.n_end()) {
        ahead();
        return;
      }
      const bool segments = kMaskable && p.q_segment_ids != nullptr;
      // K_i, then V_i, each once its slot is free. V's slot frees a tile after K's (P V
      // runs a tile behind S), so K_{i+1} goes out once V_i has, about a tile ahead of use.
      // Q goes out after the tile's first K (its slot frees only when every product of the
      // previous tile is done; the first K may be on its way before that).
      // g = the K/V tile's place in the rings, from kv0 on (nb - g: one register).
      const int g_to_nb = t.n_begin() - t.kv0();
      for (int g = t.kv0();; ++g) {
        const int nb = g + g_to_nb;
        if (nb >= t.n_end()) break;
        if (nb == t.n_end() - 1) ahead();
        const int s = g % kS;
        const uint32_t reuse = (g / kS) & 1;
        if (g >= kS) MbarrierWait(sm.k_empty(s), reuse ^ 1);
        if (segments) {
          const Mask m = mask();
          CopySegmentIds(sm.k_seg(s), m.kv_seg, nb * kN, m.kv_len, kN, sm.k_full(s), lane);
        }
        if (issuer) TmaLoadTile<kN, kD>(sm.k(s), &maps.k, sm.k_full(s), t.kh(), nb * kN, t.b());
        if (nb == t.n_begin()) {
          if (t.q0() > 0) MbarrierWait(sm.q_empty(), (t.q0() - 1) & 1);
          if (segments) {
            const Mask m = mask();
            CopySegmentIds(sm.q_seg(), m.q_seg, t.m0(), m.q_len, kM, sm.q_full(), lane);
          }
          if (issuer) TmaLoadTile<kM, kD>(sm.q(), &maps.q, sm.q_full(), t.qh(), t.m0(), t.b());
        }
        if (g >= kS) MbarrierWait(sm.v_empty(s), reuse ^ 1);
        if (issuer) TmaLoadTile<kN, kD>(sm.v(s), &maps.v, sm.v_full(s), t.kh(), nb * kN, t.b());
      }
    };
    if constexpr (kDynamic) {
      // Tile k from slot k % kJ of the drawing warp's ring, decoded there. The warp's
      // lanes all wait on tile_full (so that each read follows the publication) and read
      // the record where they use it; lane 0 hands the slot back (tile_empty) after the
      // tile's last copy, which the drawing warp's next use of the slot (tile k + 2) waits
      // for anyway (it draws k + 2 at tile k + 1's last step). At the tile's last K/V step
      // the issuer asks for the next draw (draw_wanted).
      for (int k = 0;; ++k) {
        const int j = k % kJ;
        MbarrierWait(sm.tile_full(j), (k / kJ) & 1);
        const TileRecord t{sm.tile_slot(j)};
        if (t.flat() >= tiles) break;
        // k, read back from the record after the walk: one register fewer across it (the
        // maskable ping-pong kernels at H 64 spilled it).
        copy_tile(
            t, [&] { return MakeMask<false>(p, t.b()); },
            [&] {
              if (issuer) MbarrierArrive(sm.draw_wanted());
            });
        k = t.k();
        __syncwarp();  // every lane's reads of the record before lane 0 hands it back
        if (issuer) MbarrierArrive(sm.tile_empty(k % kJ));
      }
    } else {
      for (int flat = blockIdx.x; flat < tiles; flat += stride) {
        const sm90::QueryRows rows = rows_of(flat);
        copy_tile(CopyTileOf(p, rows, used), [&] { return rows.mask; }, [] {});
        if (rows.walk.begin < rows.walk.end) {
          used.kv += rows.walk.end - rows.walk.begin;
          used.q += 1;
        }
      }
    }
  } else {
    ClaimRegisters<Tr::kMathRegisters>();
    if constexpr (kDynamic) {
      for (int k = 0;; ++k) {
        const int j = k % kJ;
        MbarrierWait(sm.tile_full(j), (k / kJ) & 1);
        // Through a shuffle, as MakeQueryRowsOf's warpgroup: ptxas then knows the tile
        // warp-uniform (wgmma under a branch it takes for divergent is serialized, C7518).
        const int flat = __shfl_sync(0xffffffffu, *sm.tile_slot(j), 0);
        MbarrierArrive(sm.tile_empty(j));
        if (flat >= tiles) break;
        MathWarpgroups<T, Tr, kMaskable, kSoftcap, kBounded, kPingPong>(p, ls, rows_of(flat), sm,
                                                                        used);
      }
    } else {
      for (int flat = blockIdx.x; flat < tiles; flat += stride) {
        MathWarpgroups<T, Tr, kMaskable, kSoftcap, kBounded, kPingPong>(p, ls, rows_of(flat), sm,
                                                                        used);
      }
    }
  }
#endif
}

}  // namespace

const char* WarpSpecializedFwdUnavailable(const AttentionParams& p) {
  if (HasExtras(p)) return "sequence lengths, bias and mask stay on fwd_sm90's kernel";
  const int padded = PaddedHeadDim(p.head_dim);
  if (padded != 64 && padded != 128 && padded != 256) {
    return "head dims padded to 64, 128 or 256 only";
  }
  if (p.head_dim % 8 != 0) return "the copy engine needs rows of whole 16-byte chunks";
  return nullptr;
}

// The key tile of a head dim's traits (the mask decisions are made on it).
int WsBlockN(const AttentionParams& p) { return PaddedHeadDim(p.head_dim) > 128 ? 64 : 128; }

WsFwdSchedule DefaultWsFwdSchedule(const AttentionParams& p) {
  const WsGrid grid = DefaultWsGrid(NeedsMask(p, WsBlockN(p)));
  WsFwdSchedule s;
  s.persistent = grid != WsGrid::kPerTile;
  s.dynamic = grid == WsGrid::kDynamic;
  return s;
}

// The dynamic grid's tile order: heads in groups, within a group the longest tiles first,
// the group's heads taking turns (DecodeGroupedTile), the groups one after another. Why
// this order, for balance and for L2:
// - Balance. A CTA draws a tile when it runs short of work, so every SM stays busy until
//   the counter runs out; what is left is the tail, the remainder of the last tiles drawn.
//   Those are the last group's shortest (one or two key tiles). The last group's longest
//   tiles are drawn when the counter enters it, while the SMs are still busy with the
//   previous group's short ones; they end in time when the group's work spread over the
//   SMs is at least about one long tile. A list-scheduling model (132 SMs, a tile costing its
//   key tiles + 0.3, the draw 1.5 key tiles ahead) gives the makespan over the ideal, by
//   heads a group: T 4k (H 128, B 4, N 16, 32 tiles a head) 1.068 / 1.054 / 1.001 / 1.001 /
//   1.008 for 1 / 2 / 4 / 8 / 16; T 16k (N 16) 1.008 / 1.002 at 1 / 2; T 1k (B 16, N 16,
//   8 tiles a head) 1.068 / 1.049 / 1.018 / 1.004 at 1 / 8 / 32 / 64. (The fixed stride:
//   1.52 at T 4k with 4 heads a group, the 389 TFLOP/s measured.) Global longest-first, all
//   heads one group, would balance best.
// - L2. A tile reads its head's K/V from key 0 up to its diagonal, the same blocks as every
//   other tile of that head, so the heads in flight share through L2 if their K/V fit: at
//   132 SMs the tiles in flight are the current group's and the short tail of the previous
//   one (short: a small prefix of its K/V), about one group's K/V. All heads in one group
//   would read every head's K/V at once (T 4k, H 128: 64 heads x 2 MB) from HBM: a key
//   tile is ~128 flop a byte of K/V, so 700 TFLOP/s would need 5.5 TB/s; the H100 has 3.35.
// So as many kv heads a group as keep its K and V within 16 MB (a third of the 50 MB L2,
// leaving room for the previous group's prefix, Q and O streaming through, and for the two
// L2 halves), whole GQA groups of query heads. That gives T 4k, H 128: 8 heads (16 MB);
// T 16k: 2; T 1k, H 64: 64 (the 8 MB cap of GroupHeads, which the one-CTA-a-tile grid keeps,
// gives 4 at T 4k and 8 at T 1k: 1.049 above); GQA 32/8 at T 4k: 8 kv heads, 32 query heads.
// Without the causal mask (tiles alike, or windows alike but at the sequence's ends) one head
// a group: each head's tiles run together. WsFwdSchedule::group_heads overrides it (A/B).
int DynamicGroupHeads(const AttentionParams& p) {
  if (!p.causal) return 1;
  const int64_t heads = p.batch * p.kv_heads * p.group;
  const int64_t kv_bytes = std::max<int64_t>(4 * p.kv_len * p.head_dim, 1);  // K + V, 16-bit
  const int64_t kv_heads = std::max<int64_t>((int64_t{16} << 20) / kv_bytes, 1);
  return static_cast<int>(std::max<int64_t>(std::min(kv_heads * p.group, heads), 1));
}

cudaError_t LaunchFwdWarpSpecialized(const AttentionParams& p, const WsFwdSchedule& schedule,
                                     cudaStream_t stream, void* workspace) {
  if (WarpSpecializedFwdUnavailable(p) != nullptr) return cudaErrorNotSupported;
  const bool masks = NeedsMask(p, WsBlockN(p));
  const WsGrid mode = schedule.dynamic      ? WsGrid::kDynamic
                      : schedule.persistent ? WsGrid::kStride
                                            : WsGrid::kPerTile;
  // A product build compiles the default schedule only (each extra one doubles the file's
  // instances and CI's compile of it); a developer-knob build every one, for A/B runs.
  if (!kDevKnobs && (schedule.ping_pong || mode != DefaultWsGrid(masks))) {
    return cudaErrorNotSupported;
  }
  int* const tile_counter = static_cast<int*>(workspace);
  if (mode == WsGrid::kDynamic &&
      (tile_counter == nullptr || reinterpret_cast<uintptr_t>(workspace) % alignof(int) != 0)) {
    return cudaErrorNotSupported;
  }
  const int group_heads = schedule.group_heads > 0 ? schedule.group_heads : DynamicGroupHeads(p);
  const int64_t n_heads = p.kv_heads * p.group;
  // The tensor maps of a traits' tile shapes.
  auto encode = [&](int rows_q, int rows_kv, TensorMaps* maps) {
    return EncodeHeadTensorMap(&maps->q, p.q, p.batch, p.q_len, n_heads, p.head_dim,
                               n_heads * p.head_dim, rows_q) &&
           EncodeHeadTensorMap(&maps->k, p.k, p.batch, p.kv_len, p.kv_heads, p.head_dim,
                               p.kv_heads * p.head_dim, rows_kv) &&
           EncodeHeadTensorMap(&maps->v, p.v, p.batch, p.kv_len, p.kv_heads, p.head_dim,
                               p.kv_heads * p.head_dim, rows_kv);
  };
  const LogitScale ls = MakeLogitScale(p.scale, p.softcap, p.dtype);
  const bool bounded = !std::isnan(ls.bound);
  return JAXGPU_ATTENTION_DTYPE_SWITCH(p.dtype, T, [&] {
    auto run = [&](auto traits) -> cudaError_t {
      using Tr = decltype(traits);
      TensorMaps maps;
      if (!encode(Tr::kBlockM, Tr::kBlockN, &maps)) return cudaErrorNotSupported;
      const int64_t tiles = p.batch * n_heads * CeilDiv(p.q_len, Tr::kBlockM);
      // One schedule's kernel: its launch. The persistent grids take one CTA an SM (the
      // kernel's shared memory allows no second), at most `tiles`: the dynamic grid's
      // counter relies on gridDim.x <= tiles.
      auto launch = [&](auto kernel, WsGrid grid_mode) -> cudaError_t {
        JAXGPU_RETURN_IF_CUDA_ERROR(AllowSmem(kernel, Tr::kSmemBytes));
        dim3 grid;
        JAXGPU_RETURN_IF_CUDA_ERROR(FlatGrid(tiles, 1, &grid));
        if (grid_mode != WsGrid::kPerTile) {
          int device = 0, sms = 0;
          JAXGPU_RETURN_IF_CUDA_ERROR(cudaGetDevice(&device));
          JAXGPU_RETURN_IF_CUDA_ERROR(
              cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
          if (schedule.max_ctas > 0) sms = std::min(sms, schedule.max_ctas);
          grid.x = static_cast<unsigned>(std::min<int64_t>(tiles, sms));
        }
        if (grid.x == 0) return cudaSuccess;  // no tiles (and the counter left as it was)
        kernel<<<grid, Tr::kThreads, Tr::kSmemBytes, stream>>>(p, ls, maps, static_cast<int>(tiles),
                                                               tile_counter, group_heads);
        return cudaGetLastError();
      };
      return JAXGPU_BOOL_SWITCH(p.softcap > 0.f, kSoftcap, [&] {
        return JAXGPU_BOOL_SWITCH(kSoftcap && bounded, kBounded, [&] {
          return JAXGPU_BOOL_SWITCH(masks, kMaskable, [&]() -> cudaError_t {
            constexpr bool kB = kSoftcap && kBounded;
            if constexpr (kDevKnobs) {
              return JAXGPU_BOOL_SWITCH(schedule.ping_pong, kPingPong, [&] {
                auto with = [&](auto grid_mode) {
                  constexpr WsGrid kGrid = decltype(grid_mode)::value;
                  return launch(
                      AttentionFwdWsKernel<T, Tr, kMaskable, kSoftcap, kB, kPingPong, kGrid>,
                      kGrid);
                };
                switch (mode) {
                  case WsGrid::kDynamic:
                    return with(std::integral_constant<WsGrid, WsGrid::kDynamic>{});
                  case WsGrid::kStride:
                    return with(std::integral_constant<WsGrid, WsGrid::kStride>{});
                  default: return with(std::integral_constant<WsGrid, WsGrid::kPerTile>{});
                }
              });
            } else {
              constexpr WsGrid kGrid = DefaultWsGrid(kMaskable);
              return launch(AttentionFwdWsKernel<T, Tr, kMaskable, kSoftcap, kB, false, kGrid>,
                            kGrid);
            }
          });
        });
      });
    };
    const int padded = PaddedHeadDim(p.head_dim);
    if (padded == 64) return run(WsFwdTraits<64>{});
    if (padded == 128) return run(WsFwdTraits<128>{});
    return run(WsFwdTraits<256>{});
  });
}

}  // namespace jaxgpu::cuda::attention::sm90
