// Warp-specialized attention backward (sm_90a), FlashAttention-3's 5-product form: one
// kernel computes dK and dV in registers and adds each step's dQ partial into a float32
// accumulator with the copy engine's reduce-add (cp.reduce.async.bulk.tensor), where the
// part-1 backward (dkv_sm90.cu + dq_sm90.cu) recomputes S and dP in a second kernel (7
// products). The wgmma main loop's backward wherever it takes the call (LaunchFusedBwd:
// the caller gives the workspaces; attention_dispatch.cu), deterministic there;
// tools/attention_ws_bwd_check.cu checks it against float64 and times both modes.
//
// H100, bf16, B * T = 16k, N = 16 (attention_ws_bwd_check: main kernel + dQ conversion +
// workspace zeroing; TFLOP/s of 10 B N T S H, half under the causal mask), deterministic
// (non-deterministic): H 128 T 4096 491 (531), causal 396 (471); T 16384 577 (588); H 64
// T 1024 causal 190 (236); H 256 304 (395); GQA 32/8 causal 479 (479). The ordered adds
// cost most where many key tiles meet one query tile early (causal, H 256's 64-key tiles).
// Those are the down walk's (below); with the up walk for causal masks (H200, same tool):
// H 128 T 4096 causal 460 (458), H 64 T 1024 causal 225 (228), H 256 causal 289 (367).
//
// A CTA of 3 warpgroups owns one key tile of one kv head. The copy warpgroup gives up its
// registers (setmaxnreg 24): its warp 0 loads K and V once, then streams the steps (query
// head r of the GQA group, 64-query tile) into a ring of kStages slots, Q and dO by TMA and
// the tile's lse (as RowLse2) and delta by plain loads of its 32 lanes (no reads past T:
// rows past it get lse2 = +inf, p = 0), segment ids by cp.async (below); its warp 1 issues
// the dQ reductions. The two math warpgroups (setmaxnreg 240), per step:
//   S^T = K Q^T, dP^T = V dO^T   (SS; keys are the MMA rows, as in dkv_sm90)
//   P^T, dS^T                    (ToLogits / ProbsAndGrads exactly as dkv_sm90)
//   dV += P^T dO, dK += dS^T Q   (P^T, dS^T from registers, or at H = 256 from shared memory)
//   dS^T -> shared memory (16-bit), named barrier 1 (both warpgroups' keys written)
//   dQ_step = dS K               (SS: dS^T and K both MN-major operands; a warpgroup takes
//                                 half of dQ's columns over all the tile's keys)
//   named barrier 2 (every product of both warpgroups done with the slot's Q, dO and dS^T)
//   dQ_step (float32) -> the slot's own Q/dO bytes (64 x H x 4 = 2 x 64 x H x 2: exactly
//   a slot), fence.proxy.async, arrive on dq_full.
// The writer warp then (deterministic: waits for the query tile's semaphore to equal this
// key tile's rank) issues one reduce-add per 32-column box, commits the bulk group, waits
// for its source to be read and frees the slot for the copy warp; deterministic, it then
// waits for the adds' completion and publishes rank + 1 with a release store (at H = 128
// the poll follows the staging and the slot is freed only after the release: the measured
// order per head dim, kOverlapDqHandoff). Staging dQ in the slot it came from
// is what makes H = 256 fit: K, V (64 KB), 2 slots of Q, dO (128 KB), P^T and dS^T (16 KB).
//
// Tile shapes. H <= 128: 128 keys a CTA, each math warpgroup 64 keys x 64 queries of S^T,
// holding its keys' dV and dK (2 x H / 2 floats a thread at H = 128) and P^T, dS^T as
// registers for the RS products; 4 slots. H = 256: dV and dK of 64 keys x 256 would be 256
// floats a thread, so the CTA takes 64 keys and splits by columns: warpgroup g computes
// S^T and dP^T for queries 32g..32g+31 of the step (N = 32), both warpgroups write P^T and
// dS^T to shared memory, and each then accumulates dV, dK and dQ for head-dim columns
// 128g..128g+127 (3 x 64 floats a thread); 2 slots (the 227 KB above).
//
// The walk and the dQ order (BwdWalkUp, StepCursor, DqRank; both modes walk alike). Query
// tile m of query head n receives the adds of the key tiles of Mask::KeyRange's keys [lo,
// hi) (exact for causal and windows: no gaps, and a key tile walks m iff it is among them).
// A CTA walks its query tiles in the direction that makes the tiles' arrival order on m,
// were all CTAs in lockstep, the order of the adds, so that a writer does not wait for a
// predecessor that is still steps away from m:
//  - up (causal, or a window's right side: a key tile's first query tile rises with it;
//    one query head a kv head, see below):
//    query tiles first to last from the key tile's first, so key tile j reaches m at step
//    ~(m - first(j)) x group, higher key tiles first; m takes the adds in decreasing key
//    tile: j waits for semaphore == rank = (hi - 1) / kBlockN - j. Under the causal mask
//    the previous order (down, increasing) had every key tile meet on the last query tile
//    at once, key tile j then waiting j handoffs (~2 us each: poll, reduce, full
//    completion, release) on every tile: deterministic 396 vs 471 TFLOP/s unordered.
//  - down (everything else: no mask, segment ids alone, a left window alone, where a key
//    tile's last query tile is the one that rises with it): last to first, increasing key
//    tile: j waits for semaphore == j - lo / kBlockN. Without a mask all key tiles walk the
//    same tiles in lockstep either way (an order that staggered them would be cyclic; see
//    below).
// Deterministic (deterministic = true): each writer waits for the query tile's semaphore to
// equal its rank, adds, waits for full completion and publishes rank + 1. No deadlock: a
// CTA only ever waits on CTAs of the same (batch, kv head) that come before it in its query
// tile's order, and the grid puts key tiles fastest and, within a (batch, kv head), in that
// order (decreasing key tile going up, increasing going down: MakeBwdTile), so its
// predecessors have lower block indices. Blocks are dispatched in increasing index (in
// practice; the programming model does not promise it), so whenever a CTA is resident its
// predecessors are resident or done, and by induction on the block index each finishes,
// whatever else holds SMs (no order may need a head's CTAs co-resident: a cyclic one
// could hang behind another kernel). Within a CTA the writer waits only on other CTAs and
// frees slots in step order. Going up, a head's shortest key tiles (causal: the last) come
// first in the grid, so the grid's last CTAs are long ones: in a list-scheduling model
// (in-order dispatch, a step a tick, 64 heads x 32 causal key tiles on 132 SMs) 554 ticks
// against 548 long tiles first (512 the work / 132), a 1% longer tail, in both modes.
// (The same model with a handoff costing a step: up 554 with no waits, down 709.)
//
// Segment ids (the maskable kernels, a runtime switch there: no extra instances). The copy
// warp's 32 lanes cp.async the key tile's ids with K and V (counted on kv_full) and each
// step's query ids with its Q and dO (counted on the slot's full barrier), into words
// beside the slots (the slot bytes take the dQ partial). A warp reduces its 16 keys' id
// range once, and per step the range of its warpgroup's queries, under the S^T / dP^T
// products; DecideMaskingInRanges then masks per element (ids compared in ToLogits) only
// where the two ranges are not one segment. Steps whose ranges are disjoint are still
// computed (p = dS = 0), so the walk, the wgmma control flow and the deterministic dQ order
// do not depend on the ids. A batch row flagged in p.segment_uniform (all its q and kv ids
// one segment) copies and compares no ids: it runs the maskable kernel as if without
// segment ids (with no position mask, every step then takes the unmasked ToLogits).
//
// Covered: 16-bit q/k/v, head dims padded to 64, 128 or 256 (H a multiple of 8), causal and
// window masks, softcap, segment ids, GQA/MQA, any T and S. Not sequence lengths, bias or
// mask (WarpSpecializedBwdUnavailable: the part-1 backward runs those).
//
// ptxas -v (CUDA 13.0, sm_90a), each of bf16 / f16 alike: 168 registers (the launch
// bound; setmaxnreg then moves the math warpgroups to 240, the copy warpgroup to 24), 3
// barriers. Spill stores in bytes, (plain, masked, softcap, masked + softcap), masked
// kernels with the segment-id code:
//   H = 128: 0, 0, 0, 0.
//   H = 64:  0, 0, 0, 0 (56, 0, 56, 0 before StepCursor counted up; those were in the copy
//            warpgroup's 24-register code: in SASS before the segment ids the STL / LDL sat
//            after USETMAXREG.DEALLOC, a few per step, not in the math loop).
//   H = 256: 12, 0, 12, 0: the copy warpgroup's (20 before the counting-up StepCursor).
// (No cuobjdump on the build machine: where the remaining spills sit is not checked.)
// Without the two `asm volatile` launderings in the math loop (below) the unmasked H = 128
// kernels spilled 180 bytes: the compiler hoisted loop-invariant swizzled offsets and
// descriptor k-steps out of the loop and could not keep them.
#include "attention/sm90/bwd_ws_sm90.h"
#include "attention/sm90/main_loop.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "attention/attention_copy.cuh"
#include "attention/attention_launch.cuh"
#include "attention/attention_logits.cuh"
#include "attention/attention_mask.cuh"
#include "attention/attention_schedule.cuh"
#include "attention/attention_softmax.cuh"
#include "attention/sm90/tma.cuh"
#include "attention/sm90/tma_reduce.cuh"
#include "attention/sm90/wgmma.cuh"

namespace jaxgpu::cuda::attention::sm90 {
namespace {

template <int kHeadDim_>
struct WsBwdTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kSplitQueries = kHeadDim > 128;     // the H = 256 shape (file comment)
  static constexpr int kBlockN = kSplitQueries ? 64 : 128;  // keys a CTA
  static constexpr int kBlockM = 64;                        // queries a step
  static constexpr int kStages = kSplitQueries ? 2 : 4;
  static constexpr int kMathThreads = 256;
  static constexpr int kThreads = kMathThreads + 128;
  // 128 x 24 + 256 x 240 <= 65536, as the forward splits them.
  static constexpr int kCopyRegisters = 24;
  static constexpr int kMathRegisters = 240;
  // Per math warpgroup: the query columns of its S^T (its rows are always 64 keys), and the
  // columns of dK / dV and of dQ it accumulates.
  static constexpr int kQueries = kSplitQueries ? 32 : 64;
  static constexpr int kDkvCols = kSplitQueries ? 128 : kHeadDim;
  // dQ's columns a warpgroup computes: half of them, or at H = 64 with
  // JAXGPU_BWD_WS_H64_DQ_WHOLE all 64 in warpgroup 0 alone (a fallback, should the halves'
  // B operand, 32 columns starting 64 bytes into a 128-byte swizzle row, not be read as
  // assumed: the checker's H = 64 cases would then fail in dq only).
#if defined(JAXGPU_BWD_WS_H64_DQ_WHOLE) && JAXGPU_BWD_WS_H64_DQ_WHOLE
  static constexpr bool kDqByOne = kHeadDim == 64;
#else
  static constexpr bool kDqByOne = false;
#endif
  static constexpr int kDqCols = kSplitQueries ? 128 : (kDqByOne ? 64 : kHeadDim / 2);
  // Deterministic dQ hand-off (DqWriter): poll the query tile's turn before the partial is
  // staged and free the slot once its source is read, overlapping both with the chain of
  // adds. Measured per head dim (H200, B4 T4096, deterministic main kernel, ms, overlapped
  // against the serial order): H 256 N 16 7.93 vs 8.98, causal 3.79 vs 4.62; H 64 N 32 4.04
  // vs 4.08, causal T 1024 0.675 vs 0.680; H 128 N 16 2.73 vs 2.70 (slower: serial there).
  static constexpr bool kOverlapDqHandoff = kHeadDim != 128;
  using KVTile = SwizzledTile<kBlockN, kHeadDim>;
  using QTile = SwizzledTile<kBlockM, kHeadDim>;
  using STile = SwizzledTile<kBlockN, kBlockM>;  // P^T, dS^T: keys x queries
  static constexpr int kStageBytes = 2 * QTile::kBytes;
  static_assert(kStageBytes == kBlockM * kHeadDim * 4, "dQ's float32 tile fills a slot");
  static constexpr int kDqBoxBytes = kBlockM * 128;  // 32 floats x 64 rows
  static constexpr int kStageOffset = 2 * KVTile::kBytes;
  static constexpr int kDsOffset = kStageOffset + kStages * kStageBytes;
  static constexpr int kPOffset = kDsOffset + STile::kBytes;
  static constexpr int kStatsOffset = kPOffset + (kSplitQueries ? STile::kBytes : 0);
  // Segment ids: each slot's kBlockM query ids, then the key tile's kBlockN ids (kept
  // apart from the slot bytes, which the step's dQ partial overwrites).
  static constexpr int kSegOffset = kStatsOffset + kStages * 2 * kBlockM * 4;
  static constexpr int kBarrierOffset = kSegOffset + (kStages * kBlockM + kBlockN) * 4;
  // Barriers: kv_full, full[s], empty[s], dq_full[s].
  static constexpr int kBarriers = 1 + 3 * kStages;
  static constexpr int kSmemBytes = kBarrierOffset + kBarriers * 8 + 1024;
  static_assert(kSmemBytes <= kMaxSmemBytes, "shared memory");
};

struct BwdMaps {
  CUtensorMap q, d_o, k, v, dq;
};

template <typename Tr>
struct BwdSmem {
  unsigned char* base;
  __device__ __forceinline__ unsigned char* k() const { return base; }
  __device__ __forceinline__ unsigned char* v() const { return base + Tr::KVTile::kBytes; }
  // Slot s: Q then dO; after the step's products, its dQ partial (float32 boxes).
  __device__ __forceinline__ unsigned char* slot(int s) const {
    return base + Tr::kStageOffset + s * Tr::kStageBytes;
  }
  __device__ __forceinline__ unsigned char* q(int s) const { return slot(s); }
  __device__ __forceinline__ unsigned char* d_o(int s) const { return slot(s) + Tr::QTile::kBytes; }
  __device__ __forceinline__ unsigned char* ds() const { return base + Tr::kDsOffset; }
  __device__ __forceinline__ unsigned char* pt() const { return base + Tr::kPOffset; }
  __device__ __forceinline__ float* lse2(int s) const {
    return reinterpret_cast<float*>(base + Tr::kStatsOffset) + s * 2 * Tr::kBlockM;
  }
  __device__ __forceinline__ float* delta(int s) const { return lse2(s) + Tr::kBlockM; }
  __device__ __forceinline__ int32_t* q_seg(int s) const {
    return reinterpret_cast<int32_t*>(base + Tr::kSegOffset) + s * Tr::kBlockM;
  }
  __device__ __forceinline__ int32_t* kv_seg() const { return q_seg(Tr::kStages); }
  __device__ __forceinline__ uint64_t* barrier(int i) const {
    return reinterpret_cast<uint64_t*>(base + Tr::kBarrierOffset) + i;
  }
  __device__ __forceinline__ uint64_t* kv_full() const { return barrier(0); }
  __device__ __forceinline__ uint64_t* full(int s) const { return barrier(1 + s); }
  __device__ __forceinline__ uint64_t* empty(int s) const { return barrier(1 + Tr::kStages + s); }
  __device__ __forceinline__ uint64_t* dq_full(int s) const {
    return barrier(1 + 2 * Tr::kStages + s);
  }
};

// The CTA's key tile and the query tiles it walks; every role computes the same.
struct BwdTile {
  int b, kh, n_block, n0;
  Mask mask;
  int m_begin, m_end;  // 64-query tiles [m_begin, m_end)
  int steps;           // (m_end - m_begin) x the GQA group
  // The walk's direction (BwdWalkUp): query tiles first to last, the adds of a query tile
  // in decreasing key-tile order, and the key tiles of a (batch, kv head) in decreasing
  // order in the grid. Otherwise last to first, increasing, increasing.
  bool up;
  // The ids are copied and compared: the maskable kernel, segment ids given, and the batch
  // row not flagged as one segment (p.segment_uniform; then they mask nothing, whatever
  // the position masks do).
  bool segments;
};

// Whether the query tiles are walked first to last: where a key tile's first query tile
// rises with the key tile (causal, or a window's right side; QueryRange), so that higher
// key tiles reach a query tile first (file comment). The unmasked kernels have neither.
// JAXGPU_BWD_WS_WALK_DOWN (a development define, for A/B timing in
// tools/attention_ws_bwd_check.cu) keeps every mask on the last-first walk.
// Only without GQA: with a group the CTAs are longer (group x the query tiles) and fewer,
// and the up grid's long CTAs last cost more than the adds' waits save (H200, B4 T4096
// causal GQA 32/8, deterministic / unordered TFLOP/s: up 369 / 398, down 464 / 463; MHA
// N 16 H 128: up 461 / 463, down 395 / 463).
template <bool kMaskable>
__device__ __forceinline__ bool BwdWalkUp(const Mask& m, int64_t group) {
#if defined(JAXGPU_BWD_WS_WALK_DOWN) && JAXGPU_BWD_WS_WALK_DOWN
  return false;
#else
  return kMaskable && group == 1 && (m.causal || m.right >= 0);
#endif
}

// The grid puts key tiles fastest and, within a (batch, kv head), in the order of the
// ranks (DqRank): a key tile's predecessors at lower block indices (file comment).
template <typename Tr, bool kMaskable>
__device__ __forceinline__ BwdTile MakeBwdTile(const AttentionParams& p) {
  BwdTile t;
  const int n_tiles = static_cast<int>((p.kv_len + Tr::kBlockN - 1) / Tr::kBlockN);
  const int flat = static_cast<int>(blockIdx.x);
  const int kv_head = flat / n_tiles;
  t.kh = kv_head % static_cast<int>(p.kv_heads);
  t.b = kv_head / static_cast<int>(p.kv_heads);
  t.mask = MakeMask(p, t.b);
  t.up = BwdWalkUp<kMaskable>(t.mask, p.group);
  t.n_block = t.up ? n_tiles - 1 - flat % n_tiles : flat % n_tiles;
  t.n0 = t.n_block * Tr::kBlockN;
  const int n_last = min(t.n0 + Tr::kBlockN, t.mask.kv_len) - 1;
  const TileWalk walk = MakeTileWalk<false>(t.mask, t.n0, n_last, t.n0, n_last, Tr::kBlockM);
  t.m_begin = walk.begin;
  t.m_end = walk.end;
  t.steps = (walk.end - walk.begin) * static_cast<int>(p.group);
  t.segments = kMaskable && t.mask.q_seg != nullptr &&
               !(p.segment_uniform != nullptr && RowMasksNothing(p, t.b));
  return t;
}

// The walk over steps, the one definition the copy warp, the math warpgroups and the dQ
// writer all step through: the query tiles [m_begin, m_end) in the tile's direction, the
// group's query heads r inside. The query tile is kept signed, m or -m going down, and
// always counts up: the copy warp, in 24 registers, then needs no register for the
// direction (one more spilled 4 bytes in every maskable kernel).
struct StepCursor {
  int signed_m, r;
  __device__ __forceinline__ explicit StepCursor(const BwdTile& t)
      : signed_m(t.up ? t.m_begin : 1 - t.m_end), r(0) {}
  __device__ __forceinline__ int m() const { return abs(signed_m); }
  __device__ __forceinline__ void Next(int group) {
    if (++r == group) r = 0, ++signed_m;
  }
};

// The key tile's place in the deterministic order of the adds into query tile m0 / kM:
// that tile's key tiles are exactly those of KeyRange's keys [lo, hi) (the range is exact
// for causal and windows, and each key tile's walk is QueryRange's, so a key tile walks the
// query tile iff it holds one of those keys; both clamp to the sequences alike), and they
// add in the order they arrive on the walk: going up, decreasing from the tile of key
// hi - 1 (rank 0); going down, increasing from the tile of key lo.
template <typename Tr>
__device__ __forceinline__ int DqRank(const BwdTile& t, int m0) {
  int lo, hi;
  t.mask.KeyRange(m0, min(m0 + Tr::kBlockM, t.mask.q_len) - 1, &lo, &hi);
  return t.up ? (hi - 1) / Tr::kBlockN - t.n_block : t.n_block - lo / Tr::kBlockN;
}

// A warp's packed 16-bit A fragments (PackProbs: kK / 16 k-steps of its 16 rows) stored
// into a (rows, 64) SwizzledTile at rows row0.. (row0 = the warp's first row + g) and
// columns col0..: 4-byte stores, the 8 rows of a column chunk on 8 different chunks (the
// swizzle), so no bank conflicts.
template <typename Tile, int kK>
__device__ __forceinline__ void StoreFragments(unsigned char* tile,
                                               const uint32_t (&a)[kK / 16][1][4], int row0,
                                               int col0, int lane) {
  const int t = lane & 3;
  auto put = [&](int row, int col, uint32_t v) {
    *reinterpret_cast<uint32_t*>(tile + Tile::ChunkOffset(row, col >> 3) + (col & 7) * 2) = v;
  };
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    const int lo = col0 + 16 * kk + 2 * t;
    put(row0, lo, a[kk][0][0]);
    put(row0 + 8, lo, a[kk][0][1]);
    put(row0, lo + 8, a[kk][0][2]);
    put(row0 + 8, lo + 8, a[kk][0][3]);
  }
}

// A warp's 16 rows (row0 + g, + 8) of a float32 64 x kCols accumulator, columns col0.. of
// the slot's dQ tile, into the boxes of the dq tensor map: box c holds columns 32c..32c+31,
// 64 rows of 128 bytes, chunk k of row r at k ^ (r % 8). 8-byte stores, 2 rows a bank set:
// the minimum of 2 wavefronts a warp store.
template <int kCols, int kBoxBytes>
__device__ __forceinline__ void StoreDqTile(unsigned char* slot, const float (&acc)[kCols / 8][4],
                                            int row0, int col0, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + g + 8 * h;
#pragma unroll
    for (int j = 0; j < kCols / 8; ++j) {
      const int col = col0 + 8 * j + 2 * t;
      const int chunk = (col & 31) >> 2;
      unsigned char* dst =
          slot + (col >> 5) * kBoxBytes + row * 128 + ((chunk ^ (row & 7)) << 4) + (col & 3) * 4;
      *reinterpret_cast<float2*>(dst) = make_float2(acc[j][2 * h], acc[j][2 * h + 1]);
    }
  }
}

// One math warpgroup (group 0 or 1) over the CTA's steps, then its dK and dV stores.
template <typename T, typename Tr, bool kMaskable, bool kSoftcap>
__device__ __forceinline__ void MathWarpgroup(const AttentionParams& p, const LogitScale& ls,
                                              const BwdSmem<Tr>& sm, const BwdTile& tile,
                                              int group) {
  constexpr int kD = Tr::kHeadDim, kM = Tr::kBlockM, kS = Tr::kStages;
  constexpr int kQ = Tr::kQueries, kDkv = Tr::kDkvCols, kDq = Tr::kDqCols;
  constexpr bool kSplit = Tr::kSplitQueries;
  using KVTile = typename Tr::KVTile;
  using QTile = typename Tr::QTile;
  using STile = typename Tr::STile;
  const int lane = threadIdx.x & 31;
  const int wk = (threadIdx.x >> 5) & 3;  // the warp within its warpgroup
  const int t = lane & 3;
  const Mask& mask = tile.mask;
  // The warpgroup's S^T rows (keys, tile-relative) and columns (queries, step-relative);
  // its dK / dV columns and dQ columns.
  const int key0 = kSplit ? 0 : 64 * group;
  const int qoff = kSplit ? 32 * group : 0;
  const int warp_row = key0 + 16 * wk;  // the warp's first key in the tile
  const int warp_key0 = tile.n0 + warp_row;
  const int dkv_col0 = kSplit ? 128 * group : 0;
  const int dq_col0 = kDq * group;

  float acc_dv[1][kDkv / 8][4], acc_dk[1][kDkv / 8][4];
  Zero(acc_dv);
  Zero(acc_dk);

  if (tile.steps > 0) {
    // A operands of S^T and dP^T: this warpgroup's keys of K and V (K-major).
    const uint64_t k_desc0 = SwizzledDescriptor(sm.k() + key0 * 128, 16, 1024);
    const uint64_t v_desc0 = SwizzledDescriptor(sm.v() + key0 * 128, 16, 1024);
    // dQ = dS K: A = dS read from dS^T (keys x queries, queries contiguous: MN-major, one
    // 64-column block), B = K's columns dq_col0.. (head dim contiguous: MN-major). At H =
    // 64 a warpgroup's 32 columns start 64 bytes into K's one 128-byte-swizzled block
    // (the swizzle is a function of the address, as for the 32-byte k-steps of K-major
    // operands).
    const uint64_t ds_desc_mn0 = SwizzledDescriptor(sm.ds(), STile::kBlockBytes, 1024);
    const uint64_t k_desc_mn0 =
        SwizzledDescriptor(sm.k() + (dq_col0 / 64) * KVTile::kBlockBytes + (dq_col0 % 64) * 2,
                           KVTile::kBlockBytes, 1024);
    // H = 256: P^T and dS^T as K-major A operands of dV and dK.
    const uint64_t pt_desc = SwizzledDescriptor(sm.pt(), 16, 1024);
    const uint64_t ds_desc = SwizzledDescriptor(sm.ds(), 16, 1024);

    // Segment ids: the warp's 16 keys (their range reduced once: the key tile never
    // changes) and, per step, the warpgroup's kQ queries of the slot.
    const bool segments = kMaskable && tile.segments;
    const int32_t* key_ids = sm.kv_seg() + warp_row;
    SegmentRange keys_range{0, 0};

    MbarrierWait(sm.kv_full(), 0);
    if (segments) keys_range = WarpSegmentRange(key_ids, 16, lane);
    StepCursor cur(tile);
    for (int s = 0; s < tile.steps; ++s, cur.Next(static_cast<int>(p.group))) {
      const int st = s % kS;
      const int m0 = cur.m() * kM;
      // The lane, opaque to the compiler inside the loop: otherwise it hoists the ~30
      // swizzled store offsets derived from it out of the loop and spills them (unmasked
      // H = 128 kernels: 180 bytes); recomputing them is a few integer ops a step.
      int lane_v = lane;
      asm volatile("" : "+r"(lane_v));
      // Likewise the descriptors' per-k-step values (16 64-bit words for K and V alone).
      uint64_t k_desc = k_desc0, v_desc = v_desc0, ds_desc_mn = ds_desc_mn0, k_desc_mn = k_desc_mn0;
      asm volatile("" : "+l"(k_desc), "+l"(v_desc), "+l"(ds_desc_mn), "+l"(k_desc_mn));
      unsigned char* sq = sm.q(st);
      unsigned char* sdo = sm.d_o(st);
      MbarrierWait(sm.full(st), static_cast<uint32_t>((s / kS) & 1));

      float sc[1][kQ / 8][4], dp[1][kQ / 8][4];
      Fence();
      ProductSS<T, kQ, kD, KVTile::kBlockBytes, QTile::kBlockBytes>(
          sc[0], k_desc, SwizzledDescriptor(sq + qoff * 128, 16, 1024), false);
      ProductSS<T, kQ, kD, KVTile::kBlockBytes, QTile::kBlockBytes>(
          dp[0], v_desc, SwizzledDescriptor(sdo + qoff * 128, 16, 1024), false);
      Commit();
      // The step's query ids (in the slot since its full barrier), reduced under the
      // products: the same in the warpgroup's 4 warps.
      const int32_t* query_ids = sm.q_seg(st) + qoff;
      SegmentRange queries_range{0, 0};
      if (segments) queries_range = WarpSegmentRange(query_ids, kQ, lane);
      Wait<0>();
      KeepOrder(sc[0]);
      KeepOrder(dp[0]);

      // Rows are keys, columns queries (kTransposed), as in dkv_sm90. Queries past T need
      // no mask: their lse2 is +inf (p = 0) and their Q, dO rows are zero-filled. A step
      // whose ids are disjoint from the warp's keys (tm.skip) is computed anyway, masked
      // whole (p = dS = 0): its products are warpgroup-wide (a branch around them that
      // differed between the 4 warps would serialize wgmma), and the dQ writer adds its
      // (zero) partial in turn, so the deterministic order stays that of the tile walk.
      const int q_first = m0 + qoff;
      const TileMasking tm = DecideMaskingInRanges<kMaskable>(
          mask, segments, q_first, min(q_first + kQ, mask.q_len) - 1, warp_key0, warp_key0 + 15,
          key_ids, keys_range, query_ids, queries_range);
      ToLogits<true, kQ, kSoftcap>(sc[0], ls, mask, tm.masked, warp_key0, q_first, tm.row_seg,
                                   tm.col_seg, lane);
      const float* lse2 = sm.lse2(st) + qoff;
      const float* delta = sm.delta(st) + qoff;
#pragma unroll
      for (int j = 0; j < kQ / 8; ++j) {
        const float2 l = *reinterpret_cast<const float2*>(lse2 + 8 * j + 2 * t);
        const float2 dl = *reinterpret_cast<const float2*>(delta + 8 * j + 2 * t);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          ProbsAndGrads<kSoftcap>(sc[0][j][e], dp[0][j][e], (e & 1) ? l.y : l.x,
                                  (e & 1) ? dl.y : dl.x, ls);
        }
      }
      uint32_t p_frags[kQ / 16][1][4], ds_frags[kQ / 16][1][4];
      PackProbs<T, kQ, 1>(p_frags, sc);
      PackProbs<T, kQ, 1>(ds_frags, dp);
      if constexpr (!kSplit) {
        // dV += P^T dO, dK += dS^T Q from registers; dO and Q as MN-major B operands.
        Fence();
        ProductRS<T, kD, kQ>(acc_dv[0], p_frags, SwizzledDescriptor(sdo, QTile::kBlockBytes, 1024));
        ProductRS<T, kD, kQ>(acc_dk[0], ds_frags, SwizzledDescriptor(sq, QTile::kBlockBytes, 1024));
        Commit();
        StoreFragments<STile, kQ>(sm.ds(), ds_frags, warp_row + (lane_v >> 2), qoff, lane_v);
      } else {
        StoreFragments<STile, kQ>(sm.pt(), p_frags, warp_row + (lane_v >> 2), qoff, lane_v);
        StoreFragments<STile, kQ>(sm.ds(), ds_frags, warp_row + (lane_v >> 2), qoff, lane_v);
      }
      // The tiles, written by the generic proxy, are read next by wgmma (the async proxy).
      FenceSharedForAsyncProxy();
      NamedBarrierSync(1, Tr::kMathThreads);  // both warpgroups' halves of dS^T (and P^T) written
      if constexpr (!kSplit) {
        // P^T and dS^T leave the registers before dQ's 32 accumulators arrive: with them
        // the unmasked kernels spilled ~180 bytes at 240 registers (dV and dK hold 128).
        Wait<0>();
        KeepOrder(acc_dv[0]);
        KeepOrder(acc_dk[0]);
      }
      Fence();
      if constexpr (kSplit) {
        // dV += P^T dO and dK += dS^T Q over the step's 64 queries, columns dkv_col0..
        const int cols = (dkv_col0 / 64) * QTile::kBlockBytes;
        ProductSST<T, kDkv, kM, false, STile::kBlockBytes, true, QTile::kBlockBytes>(
            acc_dv[0], pt_desc, SwizzledDescriptor(sdo + cols, QTile::kBlockBytes, 1024), true);
        ProductSST<T, kDkv, kM, false, STile::kBlockBytes, true, QTile::kBlockBytes>(
            acc_dk[0], ds_desc, SwizzledDescriptor(sq + cols, QTile::kBlockBytes, 1024), true);
      }
      float acc_dq[kDq / 8][4];
      const bool dq_here = !Tr::kDqByOne || group == 0;  // the same in the whole warpgroup
      if (dq_here) {
        ProductSST<T, kDq, Tr::kBlockN, true, STile::kBlockBytes, true, KVTile::kBlockBytes>(
            acc_dq, ds_desc_mn, k_desc_mn, false);
      }
      Commit();
      Wait<0>();
      KeepOrder(acc_dv[0]);
      KeepOrder(acc_dk[0]);
      KeepOrder(acc_dq);
      // Every product of both warpgroups is done with the slot's Q and dO and with the
      // P^T / dS^T tiles: the slot takes the dQ partial, the tiles the next step's.
      NamedBarrierSync(2, Tr::kMathThreads);
      if (dq_here) StoreDqTile<kDq, Tr::kDqBoxBytes>(sm.slot(st), acc_dq, 16 * wk, dq_col0, lane_v);
      FenceSharedForAsyncProxy();  // read next by the copy engine
      MbarrierArrive(sm.dq_full(st));
    }
  }

  // dK times the softmax scale: dS was taken with respect to the scaled logits.
  const HeadOffsets off = MakeHeadOffsets(p, tile.b, tile.kh, 0);
  const int64_t out = off.kv + static_cast<int64_t>(tile.n0) * off.kv_ld;
  const int keys = mask.kv_len - tile.n0;
  const int dim = static_cast<int>(p.head_dim);
  StoreAccumulator<T, kDkv>(static_cast<T*>(p.dv) + out, off.kv_ld, acc_dv[0], 1.f, warp_row, keys,
                            dkv_col0, dim, lane);
  StoreAccumulator<T, kDkv>(static_cast<T*>(p.dk) + out, off.kv_ld, acc_dk[0], ls.scale, warp_row,
                            keys, dkv_col0, dim, lane);
}

// Segment ids ids[first, first + n) into dst by the copy warp's 32 lanes (cp.async, reads
// clamped to the sequence as LoadRowWordsAsync's: a repeated last id cannot widen a
// range, and positions past the sequence are masked or carry p = 0 anyway), their
// completion tracked on `bar`. Without .noinc each lane's cp.async.mbarrier.arrive raises
// the barrier's pending count by one and the copies' completion takes it back, so the
// count the barrier was initialized with stays (kv_full: 1, full(s): 32). The __syncwarp
// puts every lane's raise before any arrival of the warp that could complete the phase
// (lane 0's arrive.expect_tx on kv_full; on full(s) each lane's own arrival comes after
// its raise anyway).
__device__ __forceinline__ void CopyIdsAsync(int32_t* dst, const int32_t* ids, int first, int len,
                                             int n, uint64_t* bar, int lane) {
#if JAXGPU_WGMMA_DEVICE
  for (int i = lane; i < n; i += 32) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(SmemAddress(dst + i)),
                 "l"(ids + min(first + i, len - 1))
                 : "memory");
  }
  asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];\n" ::"r"(SmemAddress(bar))
               : "memory");
  __syncwarp();
#endif
}

// The copy warp (all 32 lanes): K and V (with the key tile's segment ids), then each step's
// Q, dO, lse2 and delta (and query segment ids) into its slot once the writer has freed
// it. full(s) takes 32 arrivals: lane 0's carries the TMA bytes, each lane's publishes its
// own lse2 / delta stores.
template <typename Tr>
__device__ __forceinline__ void CopyWarp(const AttentionParams& p, const BwdMaps& maps,
                                         const BwdSmem<Tr>& sm, const BwdTile& tile) {
  constexpr int kM = Tr::kBlockM, kS = Tr::kStages, kD = Tr::kHeadDim;
  const int lane = threadIdx.x & 31;
  if (tile.steps == 0) return;
  if (tile.segments) {
    CopyIdsAsync(sm.kv_seg(), tile.mask.kv_seg, tile.n0, tile.mask.kv_len, Tr::kBlockN,
                 sm.kv_full(), lane);
  }
  if (lane == 0) {
    MbarrierArriveExpectTx(sm.kv_full(), 2 * Tr::KVTile::kBytes);
    TmaLoadBoxes<Tr::kBlockN, kD>(sm.k(), &maps.k, sm.kv_full(), tile.kh, tile.n0, tile.b);
    TmaLoadBoxes<Tr::kBlockN, kD>(sm.v(), &maps.v, sm.kv_full(), tile.kh, tile.n0, tile.b);
  }
  const int group = static_cast<int>(p.group);
  StepCursor cur(tile);
  for (int s = 0; s < tile.steps; ++s, cur.Next(group)) {
    const int st = s % kS;
    if (s >= kS) MbarrierWait(sm.empty(st), static_cast<uint32_t>((s / kS - 1) & 1));
    const int m0 = cur.m() * kM;
    const int qh = tile.kh * group + cur.r;
    const int64_t stats = (static_cast<int64_t>(tile.b) * p.kv_heads * p.group + qh) * p.q_len;
    if (tile.segments) {
      CopyIdsAsync(sm.q_seg(st), tile.mask.q_seg, m0, tile.mask.q_len, kM, sm.full(st), lane);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = lane + 32 * h;
      const bool valid = m0 + i < tile.mask.q_len;
      sm.lse2(st)[i] = RowLse2(valid ? p.lse[stats + m0 + i] : 0.f, valid);
      sm.delta(st)[i] = valid ? p.delta[stats + m0 + i] : 0.f;
    }
    if (lane == 0) {
      MbarrierArriveExpectTx(sm.full(st), Tr::kStageBytes);
      TmaLoadBoxes<kM, kD>(sm.q(st), &maps.q, sm.full(st), qh, m0, tile.b);
      TmaLoadBoxes<kM, kD>(sm.d_o(st), &maps.d_o, sm.full(st), qh, m0, tile.b);
    } else {
      MbarrierArrive(sm.full(st));
    }
  }
}

// The writer (one thread): each step's dQ partial, once the math warpgroups have staged it,
// reduce-added into dq_accum box by box; deterministic: in key-tile order per query tile.
template <typename Tr>
__device__ __forceinline__ void DqWriter(const AttentionParams& p, const BwdMaps& maps,
                                         const BwdSmem<Tr>& sm, const BwdTile& tile,
                                         int* semaphores, bool deterministic) {
  constexpr int kM = Tr::kBlockM, kS = Tr::kStages;
  const int group = static_cast<int>(p.group);
  const int m_tiles = static_cast<int>((p.q_len + kM - 1) / kM);
  const int dim = static_cast<int>(p.head_dim);
  constexpr bool kOverlap = Tr::kOverlapDqHandoff;
  const bool free_on_read = kOverlap || !deterministic;
  StepCursor cur(tile);
  for (int s = 0; s < tile.steps; ++s, cur.Next(group)) {
    const int st = s % kS;
    const int m0 = cur.m() * kM;
    const int qh = tile.kh * group + cur.r;
    const uint32_t parity = static_cast<uint32_t>((s / kS) & 1);
    int* sem = nullptr;
    int rank = 0;
    if (!kOverlap) MbarrierWait(sm.dq_full(st), parity);
    if (deterministic) {
      rank = DqRank<Tr>(tile, m0);
      sem = semaphores + (static_cast<int64_t>(tile.b) * p.kv_heads * p.group + qh) * m_tiles +
            cur.m();
      // Spin with a short back-off: dozens of writers poll L2 while a chain is long.
      while (LoadAcquireGpu(sem) != rank) __nanosleep(64);
      FenceProxyAsyncGlobal();  // the reductions below come after the predecessor's
    }
    if (kOverlap) MbarrierWait(sm.dq_full(st), parity);
#pragma unroll
    for (int c = 0; c < Tr::kHeadDim / 32; ++c) {
      // Boxes wholly past H (padded head dims) carry zeros and nothing to add.
      if (32 * c < dim) {
        TmaReduceAddBox(&maps.dq, sm.slot(st) + c * Tr::kDqBoxBytes, 32 * c, qh, m0, tile.b);
      }
    }
    BulkCommit();
    if (free_on_read) {
      BulkWaitRead<0>();  // the slot's partial read: the copy warp may refill it
      MbarrierArrive(sm.empty(st));
    }
    if (deterministic) {
      BulkWait<0>();  // the adds performed, not only their source read
      FenceProxyAsyncGlobal();
      StoreReleaseGpu(sem, rank + 1);
    }
    if (!free_on_read) MbarrierArrive(sm.empty(st));
  }
  BulkWait<0>();
}

template <typename T, typename Tr, bool kMaskable, bool kSoftcap>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    BwdWsKernel(const AttentionParams p, const LogitScale ls, const __grid_constant__ BwdMaps maps,
                int* semaphores, bool deterministic) {
#if JAXGPU_WGMMA_DEVICE
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const BwdSmem<Tr> sm{SwizzleAligned(smem_raw)};
  if (threadIdx.x == 0) {
    MbarrierInit(sm.kv_full(), 1);
    for (int s = 0; s < Tr::kStages; ++s) {
      MbarrierInit(sm.full(s), 32);
      MbarrierInit(sm.empty(s), 1);
      MbarrierInit(sm.dq_full(s), Tr::kMathThreads);
    }
    FenceBarrierInit();
  }
  __syncthreads();  // the last CTA-wide barrier: the roles split below

  const BwdTile tile = MakeBwdTile<Tr, kMaskable>(p);
  const int group = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x >> 7), 0);
  if (group == 2) {
    ReleaseRegisters<Tr::kCopyRegisters>();
    const int warp = (threadIdx.x >> 5) & 3;
    if (warp == 0) {
      CopyWarp<Tr>(p, maps, sm, tile);
    } else if (warp == 1 && (threadIdx.x & 31) == 0) {
      DqWriter<Tr>(p, maps, sm, tile, semaphores, deterministic);
    }
  } else {
    ClaimRegisters<Tr::kMathRegisters>();
    MathWarpgroup<T, Tr, kMaskable, kSoftcap>(p, ls, sm, tile, group);
  }
#endif
}

// dq = acc * scale, 4 elements a thread-iteration (B T N H is a multiple of 8).
template <typename T>
__global__ void __launch_bounds__(256)
    DqConvertKernel(const float* acc, T* dq, int64_t n4, float scale) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n4;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float4 a = reinterpret_cast<const float4*>(acc)[i];
    uint2 out;
    out.x = PackPair<T>(a.x * scale, a.y * scale);
    out.y = PackPair<T>(a.z * scale, a.w * scale);
    reinterpret_cast<uint2*>(dq)[i] = out;
  }
}

}  // namespace

const char* WarpSpecializedBwdUnavailable(const AttentionParams& p) {
  if (p.dtype != DType::kBF16 && p.dtype != DType::kF16) return "16-bit q, k, v only";
  if (HasExtras(p)) return "sequence lengths, bias and mask stay on the part-1 backward";
  if ((p.q_segment_ids == nullptr) != (p.kv_segment_ids == nullptr)) {
    return "segment ids on both sides or neither";
  }
  const int padded = PaddedHeadDim(p.head_dim);
  if (padded != 64 && padded != 128 && padded != 256) {
    return "head dims padded to 64, 128 or 256 only";
  }
  if (p.head_dim % 8 != 0) return "the copy engine needs rows of whole 16-byte chunks";
  if (!(p.scale > 0.f)) return "scale > 0 (folded into exp2)";
  if (p.q_len >= (int64_t{1} << 31) || p.kv_len >= (int64_t{1} << 31)) return "T, S < 2^31";
  return nullptr;
}

cudaError_t LaunchBwdWarpSpecializedMain(const AttentionParams& p, float* dq_accum,
                                         int* dq_semaphores, cudaStream_t stream,
                                         bool deterministic) {
  if (WarpSpecializedBwdUnavailable(p) != nullptr) return cudaErrorNotSupported;
  if (dq_accum == nullptr || (deterministic && dq_semaphores == nullptr)) {
    return cudaErrorInvalidValue;
  }
  // Nothing to compute (S = 0 leaves dq_accum at its zeros and dK, dV empty).
  if (p.batch == 0 || p.q_len == 0 || p.kv_len == 0 || p.kv_heads == 0) return cudaSuccess;
  const int64_t n_heads = p.kv_heads * p.group;
  return JAXGPU_ATTENTION_DTYPE_SWITCH(p.dtype, T, [&] {
    auto run = [&](auto traits) -> cudaError_t {
      using Tr = decltype(traits);
      BwdMaps maps;
      const bool encoded = EncodeHeadTensorMap(&maps.q, p.q, p.batch, p.q_len, n_heads, p.head_dim,
                                               n_heads * p.head_dim, Tr::kBlockM) &&
                           EncodeHeadTensorMap(&maps.d_o, p.d_o, p.batch, p.q_len, n_heads,
                                               p.head_dim, n_heads * p.head_dim, Tr::kBlockM) &&
                           EncodeHeadTensorMap(&maps.k, p.k, p.batch, p.kv_len, p.kv_heads,
                                               p.head_dim, p.kv_heads * p.head_dim, Tr::kBlockN) &&
                           EncodeHeadTensorMap(&maps.v, p.v, p.batch, p.kv_len, p.kv_heads,
                                               p.head_dim, p.kv_heads * p.head_dim, Tr::kBlockN) &&
                           EncodeFloatRowsTensorMap(&maps.dq, dq_accum, p.batch, p.q_len, n_heads,
                                                    p.head_dim, n_heads * p.head_dim, Tr::kBlockM);
      if (!encoded) return cudaErrorNotSupported;
      return JAXGPU_BOOL_SWITCH(p.softcap > 0.f, kSoftcap, [&] {
        return JAXGPU_BOOL_SWITCH(NeedsMask(p, Tr::kBlockN), kMaskable, [&] {
          auto kernel = BwdWsKernel<T, Tr, kMaskable, kSoftcap>;
          JAXGPU_RETURN_IF_CUDA_ERROR(AllowSmem(kernel, Tr::kSmemBytes));
          dim3 grid;
          JAXGPU_RETURN_IF_CUDA_ERROR(
              FlatGrid(p.batch * p.kv_heads, CeilDiv(p.kv_len, Tr::kBlockN), &grid));
          kernel<<<grid, Tr::kThreads, Tr::kSmemBytes, stream>>>(
              p, MakeLogitScale(p.scale, p.softcap, p.dtype), maps, dq_semaphores, deterministic);
          return cudaGetLastError();
        });
      });
    };
    const int padded = PaddedHeadDim(p.head_dim);
#ifdef JAXGPU_BWD_WS_ONLY_H128  // development builds: one head dim compiles 3x faster
    if (padded != 128) return cudaErrorNotSupported;
    return run(WsBwdTraits<128>{});
#else
    if (padded == 64) return run(WsBwdTraits<64>{});
    if (padded == 128) return run(WsBwdTraits<128>{});
    return run(WsBwdTraits<256>{});
#endif
  });
}

cudaError_t LaunchDqAccumConvert(const AttentionParams& p, const float* dq_accum,
                                 cudaStream_t stream) {
  const int64_t n4 = p.batch * p.q_len * p.kv_heads * p.group * p.head_dim / 4;
  if (n4 == 0) return cudaSuccess;
  const int64_t blocks = std::min<int64_t>(CeilDiv(n4, 256), 132 * 16);
  return JAXGPU_ATTENTION_DTYPE_SWITCH(p.dtype, T, [&] {
    DqConvertKernel<T><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
        dq_accum, static_cast<T*>(p.dq), n4, p.scale);
    return cudaGetLastError();
  });
}

cudaError_t LaunchBwdWarpSpecialized(const AttentionParams& p, float* dq_accum, int* dq_semaphores,
                                     cudaStream_t stream, bool deterministic) {
  JAXGPU_RETURN_IF_CUDA_ERROR(
      LaunchBwdWarpSpecializedMain(p, dq_accum, dq_semaphores, stream, deterministic));
  return LaunchDqAccumConvert(p, dq_accum, stream);
}

cudaError_t LaunchFusedBwd(const AttentionParams& p, cudaStream_t stream) {
  const bool ordered = !p.dq_unordered;
  if (p.dq_accum == nullptr || WarpSpecializedBwdUnavailable(p) != nullptr ||
      (ordered && (p.dq_semaphores == nullptr ||
                   static_cast<size_t>(p.dq_semaphore_count) * 4 < BwdSemaphoreBytes(p)))) {
    return cudaErrorNotSupported;
  }
  JAXGPU_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(p.dq_accum, 0, BwdDqAccumBytes(p), stream));
  if (ordered) {
    JAXGPU_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(p.dq_semaphores, 0, BwdSemaphoreBytes(p), stream));
  }
  return LaunchBwdWarpSpecialized(p, p.dq_accum, p.dq_semaphores, stream, ordered);
}

}  // namespace jaxgpu::cuda::attention::sm90
