// Tile shapes of the mma.sync attention kernels, and the per-tile pieces the forward and
// the backward kernels share: Q K^T into registers, masking of a score tile, and where a
// (batch, head) slice starts in memory. No XLA types.
#pragma once

#include <cmath>
#include <cstdint>

#include "attention/attention_mask.cuh"
#include "attention/attention_mma.cuh"
#include "attention/attention_params.h"

namespace jaxgpu::cuda::attention {

// The head dims the kernels are compiled for; H <= kHeadDim runs in the smallest that fits
// with zero-filled feature columns (H is a multiple of 8: the Python layer pads odd ones).
// 160..224 run in the 256 kernels: each extra head dim costs ~1 min of CI compile time.
inline int PaddedHeadDim(int64_t h) {
  if (h <= 32) return 32;
  if (h <= 64) return 64;
  if (h <= 96) return 96;
  if (h <= 128) return 128;
  return 256;
}

#define JAXGPU_HEAD_DIM_SWITCH(h, D, ...)                                  \
  [&] {                                                                    \
    switch (::jaxgpu::cuda::attention::PaddedHeadDim(h)) {                 \
      case 32: { constexpr int D = 32; return __VA_ARGS__(); }             \
      case 64: { constexpr int D = 64; return __VA_ARGS__(); }             \
      case 96: { constexpr int D = 96; return __VA_ARGS__(); }             \
      case 128: { constexpr int D = 128; return __VA_ARGS__(); }           \
      default: { constexpr int D = 256; return __VA_ARGS__(); }            \
    }                                                                      \
  }()

// Offsets of one (batch b, kv head kh, query head r) slice, in elements (layouts:
// attention_params.h).
struct HeadOffsets {
  int64_t q;         // of q[b, 0, kh, r, 0] (also o, do, dq)
  int64_t kv;        // of k[b, 0, kh, 0] (also v, dk, dv)
  int64_t stats;     // of lse[b, kh, r, 0] (also delta)
  int64_t q_ld;      // elements between consecutive queries: K * R * H
  int64_t kv_ld;     // between consecutive keys: K * H
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
  return {static_cast<int64_t>(group) * group_heads + within % heads_here,
          within / heads_here};
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

template <bool kGrouped>
__device__ __forceinline__ QueryTile DecodeQueryTile(const AttentionParams& p, int block_m) {
  const int m_blocks = (static_cast<int>(p.q_len) + block_m - 1) / block_m;
  QueryTile q;
  int64_t head;
  if constexpr (kGrouped) {
    const HeadAndRank hr =
        DecodeGroupedTile(blockIdx.x, static_cast<int>(p.batch * p.kv_heads * p.group),
                          m_blocks, GroupHeads(p));
    head = hr.head;
    q.m_block = m_blocks - 1 - hr.rank;
  } else {
    head = blockIdx.x / m_blocks;
    q.m_block = m_blocks - 1 - static_cast<int>(blockIdx.x % m_blocks);
  }
  q.r = head % p.group;
  q.kh = (head / p.group) % p.kv_heads;
  q.b = head / (p.group * p.kv_heads);
  return q;
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

template <typename E, int A, int B, int C>
__device__ __forceinline__ void Zero(E (&x)[A][B][C]) {
#pragma unroll
  for (int i = 0; i < A; ++i) {
#pragma unroll
    for (int j = 0; j < B; ++j) {
#pragma unroll
      for (int k = 0; k < C; ++k) x[i][j][k] = E(0);
    }
  }
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

// Double-buffered pairs of (kRows, kDim) smem tiles laid out [buffer][pair member]: K and V
// (forward, dQ) or Q and dO (dK/dV). Tile `which` (0 or 1) of buffer `buf`:
template <int kRows, int kDim, typename T>
__device__ __forceinline__ T* PairTile(T* base, int buf, int which) {
  return base + (2 * buf + which) * kRows * SmemTile<kDim>::kStride;
}

// Copies rows [row0, row0 + kRows) of two global matrices a and b (same row stride ld,
// `valid` rows in all) into buffer `buf` of a pair (see LoadTileAsync for the tails).
template <int kRows, int kDim, int kThreads, typename T>
__device__ __forceinline__ void LoadPairAsync(T* base, int buf, const T* a, const T* b,
                                              int64_t ld, int row0, int valid, int dim) {
  LoadTileAsync<kRows, kDim, kThreads>(PairTile<kRows, kDim>(base, buf, 0), a + row0 * ld, ld,
                                       valid - row0, dim);
  LoadTileAsync<kRows, kDim, kThreads>(PairTile<kRows, kDim>(base, buf, 1), b + row0 * ld, ld,
                                       valid - row0, dim);
}

// Scores of a warp's kMT x 16 rows of A (rows a_row0.. of tile A, consecutive) against the
// kN rows of tile B, both (rows, kDim) in smem: acc[m-tile][n-tile][4] += A B^T over
// feature columns [0, dim). Each B fragment is loaded once and feeds all kMT row tiles:
// ldmatrix bandwidth (128 B/clk/SM) is what bounds an mma.sync loop.
//
// Zero feature columns past `dim` are skipped only in 64-column groups, and only for the
// 256 tiles (H 136..248): a branch per 16-column step splits the loop into blocks the
// compiler cannot schedule across, exposing each step's ldmatrix latency to its MMAs.
template <int kDim>
__device__ __forceinline__ bool FeatureStepLive(int kk, int dim) {
  return kDim <= 128 || (kk & 3) != 0 || kk * 16 < dim;
}

template <typename T, int kDim, int kN, int kMT>
__device__ __forceinline__ void ScoresFromSmem(float (&acc)[kMT][kN / 8][4], const T* a_tile,
                                               int a_row0, const T* b_tile, int dim, int lane) {
#pragma unroll
  for (int kk = 0; kk < kDim / 16; ++kk) {
    if (FeatureStepLive<kDim>(kk, dim)) {
      uint32_t a[kMT][4];
#pragma unroll
      for (int mi = 0; mi < kMT; ++mi) LoadA<kDim>(a[mi], a_tile, a_row0 + 16 * mi, kk * 16, lane);
#pragma unroll
      for (int nn = 0; nn < kN / 16; ++nn) {
        uint32_t b[4];
        LoadBNk<kDim>(b, b_tile, nn * 16, kk * 16, lane);
#pragma unroll
        for (int mi = 0; mi < kMT; ++mi) {
          MmaType<T>::Mma(acc[mi][2 * nn], a[mi], b[0], b[1]);
          MmaType<T>::Mma(acc[mi][2 * nn + 1], a[mi], b[2], b[3]);
        }
      }
    }
  }
}

// P (kMT x 16 x kK per warp, C tiles in registers) as 16-bit A fragments: k-step kk, row
// tile mi. Converting right after the softmax halves the registers P holds during P V
// (the forward's 255-register loop spilled otherwise).
template <typename T, int kK, int kMT>
__device__ __forceinline__ void PackProbs(uint32_t (&a)[kK / 16][kMT][4],
                                          const float (&p)[kMT][kK / 8][4]) {
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
#pragma unroll
    for (int mi = 0; mi < kMT; ++mi) {
      a[kk][mi][0] = MmaType<T>::Pack(p[mi][2 * kk][0], p[mi][2 * kk][1]);
      a[kk][mi][1] = MmaType<T>::Pack(p[mi][2 * kk][2], p[mi][2 * kk][3]);
      a[kk][mi][2] = MmaType<T>::Pack(p[mi][2 * kk + 1][0], p[mi][2 * kk + 1][1]);
      a[kk][mi][3] = MmaType<T>::Pack(p[mi][2 * kk + 1][2], p[mi][2 * kk + 1][3]);
    }
  }
}

// acc += P B over the kK rows of a smem tile B, for output columns [col0, col0 + kAcc):
// P is packed A fragments (PackProbs); B is (kK, kTileDim) with n contiguous (V, dO, Q or
// K). Columns past `dim` are zeros, skipped as in ScoresFromSmem. Each B fragment feeds all
// kMT row tiles.
template <typename T, int kK, int kAcc, int kTileDim, int kMT>
__device__ __forceinline__ void AccumulatePacked(float (&acc)[kMT][kAcc / 8][4],
                                                 const uint32_t (&a)[kK / 16][kMT][4],
                                                 const T* b_tile, int col0, int dim, int lane) {
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
#pragma unroll
    for (int nn = 0; nn < kAcc / 16; ++nn) {
      if (FeatureStepLive<kTileDim>(nn, dim - col0)) {
        uint32_t b[4];
        LoadBKn<kTileDim>(b, b_tile, kk * 16, col0 + nn * 16, lane);
#pragma unroll
        for (int mi = 0; mi < kMT; ++mi) {
          MmaType<T>::Mma(acc[mi][2 * nn], a[kk][mi], b[0], b[1]);
          MmaType<T>::Mma(acc[mi][2 * nn + 1], a[kk][mi], b[2], b[3]);
        }
      }
    }
  }
}

// The same with P as float C tiles, packed here.
template <typename T, int kK, int kAcc, int kTileDim, int kMT>
__device__ __forceinline__ void AccumulateFromRegs(float (&acc)[kMT][kAcc / 8][4],
                                                   const float (&p)[kMT][kK / 8][4],
                                                   const T* b_tile, int col0, int dim, int lane) {
  uint32_t a[kK / 16][kMT][4];
  PackProbs<T, kK, kMT>(a, p);
  AccumulatePacked<T, kK, kAcc, kTileDim, kMT>(acc, a, b_tile, col0, dim, lane);
}

// Stores a warp's 16 x kAcc accumulator (times `mul`) as 16-bit rows [row0, row0 + 16) of a
// global matrix with row stride ld, columns [col0, ...); rows at or past valid_rows and
// columns at or past dim are skipped.
template <typename T, int kAcc>
__device__ __forceinline__ void StoreAccumulator(T* out, int64_t ld, const float (&acc)[kAcc / 8][4],
                                                 float mul, int row0, int valid_rows, int col0,
                                                 int dim, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + g + 8 * h;
    if (row < valid_rows) {
#pragma unroll
      for (int j = 0; j < kAcc / 8; ++j) {
        const int col = col0 + 8 * j + 2 * t;
        if (col < dim) {
          *reinterpret_cast<uint32_t*>(out + row * ld + col) =
              MmaType<T>::Pack(acc[j][2 * h] * mul, acc[j][2 * h + 1] * mul);
        }
      }
    }
  }
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
                                                   const SegmentRange& rows,
                                                   const int32_t* col_ids,
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
                                                     int q1, int k0, int k1,
                                                     const int32_t* row_ids, int rows,
                                                     const int32_t* col_ids, int cols, int lane) {
  TileMasking tm{false, false, nullptr, nullptr};
  if (!kMaskable) return tm;
  tm.masked = !mask.TileFullyVisible(q0, q1, k0, k1);
  if (segments) {
    ApplySegmentRanges(tm, row_ids, WarpSegmentRange(row_ids, rows, lane), col_ids,
                       WarpSegmentRange(col_ids, cols, lane));
  }
  return tm;
}

// The same with the ranges given: the Hopper backward loops reduce them a step ahead, under
// the previous step's products (the reductions on the critical path cost the options
// case's backward 2-3%, TUNING.md stop 16). A range may cover more rows or columns than
// the warp's (a warpgroup's, the same in its 4 warps, so that `skip` is too): the decision
// is then coarser, never wrong.
template <bool kMaskable>
__device__ __forceinline__ TileMasking DecideMaskingInRanges(const Mask& mask, bool segments,
                                                             int q0, int q1, int k0, int k1,
                                                             const int32_t* row_ids,
                                                             const SegmentRange& rows,
                                                             const int32_t* col_ids,
                                                             const SegmentRange& cols) {
  TileMasking tm{false, false, nullptr, nullptr};
  if (!kMaskable) return tm;
  tm.masked = !mask.TileFullyVisible(q0, q1, k0, k1);
  if (segments) ApplySegmentRanges(tm, row_ids, rows, col_ids, cols);
  return tm;
}

// Scores to logits up to a positive factor, in place, and -inf where masked: the softmax
// multiplies ToLogits's output by LogitScale::fold inside its exp2 argument (one FFMA per
// logit, exp2(x * fold - max * fold)); masking and the max commute with a positive factor
// (the handler requires scale > 0). Without a softcap the output is the raw score and
// fold = scale * log2(e); with a softcap it is tanh(score * scale / cap) and
// fold = cap * log2(e), the backward's softcap slope 1 - tanh^2 then reads off the output
// directly. Element e of n-tile j of a warp's 16 x kN tile is at row row0 + g + 8 * (e / 2),
// column col0 + 8 j + 2 t + (e % 2). Query/key swap roles in the dK/dV kernel
// (kTransposed: rows are keys, columns queries).
struct LogitScale {
  float scale;
  float tanh_in;  // softcap: scale / cap; 0 without one
  float fold;     // multiplier of ToLogits's output in the exp2 argument
  float bound;    // softcap: the forward's fixed softmax offset (BoundedSoftmax); NaN: none
};

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// A softcap bounds every logit to [-cap, cap], so the forward's softmax may subtract one
// fixed offset (log2 domain) instead of the running row max: exp2(x * fold - bound) with
// x = tanh(..) in [-1, 1] has exponents [-fold - bound, fold - bound], which must lie in
// [min_exp, max_exp] for P's type:
// - bfloat16: min_exp -100 keeps P normal (2^-126) with 26 binades to spare, so that P V
//   products with |v| >= 2^-26 stay normal float32 numbers; max_exp 48 leaves float32 sums
//   over up to 2^31 keys room for |v| < 2^48. Caps up to 51.2 fit (Gemma 2's 50).
// - float16: P within its normal range [2^-14, 2^15]. Caps up to 10 fit.
// The offset is the largest that keeps the smallest probability above min_exp, at most
// fold (then p <= 1, as with the row max). Other caps keep the online softmax.
inline float BoundedSoftmaxOffset(float fold, DType dtype) {
  const bool bf16 = dtype == DType::kBF16;
  const float min_exp = bf16 ? -100.f : -14.f, max_exp = bf16 ? 48.f : 15.f;
  if (2.f * fold > max_exp - min_exp) return NAN;
  return fold < -min_exp - fold ? fold : -min_exp - fold;
}

inline LogitScale MakeLogitScale(float scale, float cap, DType dtype) {
  LogitScale s;
  s.scale = scale;
  s.tanh_in = cap > 0.f ? scale / cap : 0.f;
  s.fold = (cap > 0.f ? cap : scale) * kLog2e;
  s.bound = cap > 0.f ? BoundedSoftmaxOffset(s.fold, dtype) : NAN;
  return s;
}

// row_seg / col_seg: the segment ids of rows row0.. and columns col0.. staged in shared
// memory, or nullptr without segment ids. kSoftcap is a template switch: the cap costs
// half a MUFU op per logit (a whole one with kTanhF32, the Hopper forward's choice), which
// the plain kernels must not carry. The mask is one branch per
// tile around its own loop: a per-element `if (masked)` compiled to a branch per logit
// that broke up the softmax's schedule (the maskable forward ran at 2/3 the plain one).
template <bool kTransposed, int kN, bool kSoftcap, bool kTanhF32 = false>
__device__ __forceinline__ void ToLogits(float (&acc)[kN / 8][4], const LogitScale& ls,
                                         const Mask& mask, bool masked, int row0, int col0,
                                         const int32_t* row_seg, const int32_t* col_seg,
                                         int lane) {
  if (kSoftcap) {
#pragma unroll
    for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        float a = acc[j][e] * ls.tanh_in, b = acc[j][e + 1] * ls.tanh_in;
        if (kTanhF32) {
          a = TanhF32(a);
          b = TanhF32(b);
        } else {
          TanhPair(a, b);
        }
        acc[j][e] = a;
        acc[j][e + 1] = b;
      }
    }
  }
  if (!masked) return;
  const int g = lane >> 2, t = lane & 3;
  int32_t rs[2] = {0, 0};
  if (row_seg != nullptr) rs[0] = row_seg[g], rs[1] = row_seg[g + 8];
#pragma unroll
  for (int j = 0; j < kN / 8; ++j) {
    int32_t cs[2] = {0, 0};
    if (row_seg != nullptr) cs[0] = col_seg[8 * j + 2 * t], cs[1] = col_seg[8 * j + 2 * t + 1];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int lr = g + 8 * (e >> 1), lc = 8 * j + 2 * t + (e & 1);
      const int i = kTransposed ? col0 + lc : row0 + lr;
      const int k = kTransposed ? row0 + lr : col0 + lc;
      const bool ok = mask.Visible(i, k) && rs[e >> 1] == cs[e & 1];
      if (!ok) acc[j][e] = -INFINITY;
    }
  }
}

}  // namespace jaxgpu::cuda::attention
