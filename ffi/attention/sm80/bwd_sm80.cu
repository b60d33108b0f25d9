// Attention backward of the mma.sync main loop (m16n8k16, sm_80+), deterministic: no
// atomics, every gradient element is summed by one thread in a fixed order. After the
// shared delta kernel (attention_delta.cu: delta = rowsum(dO * O) per query row):
//
//   DqKernel    per (query tile, query head): walks the visible key tiles, recomputes
//               P = exp(L - lse), dP = dO V^T, dS = P (dP - delta), dQ += dS K.
//               (3 products; the wgmma main loop's is sm90/dq_sm90.cu)
//   DkvKernel   per (key tile, kv head): walks every query head of its GQA group and the
//               visible query tiles, recomputes P^T and dP^T with keys as rows, dV += P^T
//               dO, dK += dS^T Q (4 products), in warp pairs: one warp of a pair computes P
//               and dV, the other dS and dK. (The wgmma main loop's: sm90/dkv_sm90.cu.)
// Splitting dQ from dK/dV costs two extra products (7 instead of FlashAttention-2's 5) and
// buys determinism without a float32 dQ accumulator in memory or atomics; the GQA sum over
// a kv head's query heads happens in registers.
// kExtra (bias, mask, sequence lengths: attention_extras.cuh): the dQ kernel also writes
// dbias, the gradient of the logit after the softcap, where it computes dS (each (b, n, i,
// j) once: a plain store, or float32 atomics where the bias broadcasts).
#include <cuda_runtime.h>

#include "attention/attention_extras.cuh"
#include "attention/attention_launch.cuh"
#include "attention/attention_mask.cuh"
#include "attention/attention_schedule.cuh"
#include "attention/attention_softmax.cuh"
#include "attention/sm80/main_loop.h"
#include "attention/sm80/mma.cuh"
#include "attention/sm80/products.cuh"

namespace jaxgpu::cuda::attention::sm80 {
namespace {

// ---- dQ ------------------------------------------------------------------------------------

template <int kHeadDim_>
struct DqTraits {
  // 4 warps x 2 row tiles of 16 queries x 32-key tiles up to H = 128: each K/V fragment
  // feeds both row tiles, and 32 keys keep the score and dP tiles within the registers
  // left beside the 2 x H / 2 dQ accumulators. H = 256: 1 row tile (128 accumulators).
  // Alternatives measured on the H100: docs/perf/attention.md section 2.2.
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kWarps = 4;
  static constexpr int kMTiles = kHeadDim <= 128 ? 2 : 1;
  static constexpr int kBlockM = 16 * kWarps * kMTiles;
  static constexpr int kBlockN = 32;
  static constexpr int kThreads = 32 * kWarps;
  // Q, dO, two buffers each of K and V, then the segment ids of Q and of 2 key tiles.
  static constexpr int kSegOffset = (2 * kBlockM + 4 * kBlockN) * SmemTile<kHeadDim>::kStride * 2;
  static constexpr int kSmemBytes = kSegOffset + (kBlockM + 2 * kBlockN) * 4;
};

template <typename T, typename Tr, bool kMaskable, bool kSoftcap, bool kExtra>
__global__ void __launch_bounds__(Tr::kThreads) DqKernel(AttentionParams p, LogitScale ls) {
  static_assert(kMaskable || !kExtra, "the extras mask");
  constexpr int kHeadDim = Tr::kHeadDim;
  constexpr int kM = Tr::kBlockM, kN = Tr::kBlockN, kMT = Tr::kMTiles;
  constexpr int kStride = SmemTile<kHeadDim>::kStride;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sq = reinterpret_cast<T*>(smem_raw);
  T* sdo = sq + kM * kStride;
  T* skv = sdo + kM * kStride;  // [buffer][K, V]
  auto sk = [&](int buf) { return PairTile<kN, kHeadDim>(skv, buf, 0); };
  auto sv = [&](int buf) { return PairTile<kN, kHeadDim>(skv, buf, 1); };
  int32_t* sq_seg = reinterpret_cast<int32_t*>(smem_raw + Tr::kSegOffset);
  int32_t* skv_seg = sq_seg + kM;  // [buffer][kN]

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2;
  const QueryTile tile = DecodeQueryTile<kMaskable>(p, kM);
  const int64_t b = tile.b;
  const HeadOffsets off = MakeHeadOffsets(p, b, tile.kh, tile.r);
  const Mask mask = MakeMask<kExtra>(p, b);
  const bool segments = kMaskable && mask.q_seg != nullptr;
  const int H = static_cast<int>(p.head_dim);
  const int m0 = tile.m_block * kM;
  const int m_last = min(m0 + kM, mask.q_len) - 1;
  const int row0 = m0 + warp * kMT * 16;  // this warp's first query
  const Extras ex = MakeExtras(p, b, tile.kh);
  using XT = ExtraTiles<kM, kN, 2>;
  const typename XT::Stage stage =
      kExtra ? XT::MakeStage(p, Tr::kSmemBytes) : typename XT::Stage{-1, -1};

  const T* k = static_cast<const T*>(p.k) + off.kv;
  const T* v = static_cast<const T*>(p.v) + off.kv;
  T* dq = static_cast<T*>(p.dq) + off.q + m0 * off.q_ld;

  float lse2[kMT][2], delta[kMT][2];
#pragma unroll
  for (int mi = 0; mi < kMT; ++mi) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + mi * 16 + g + 8 * h;
      lse2[mi][h] = RowLse2(row < mask.q_len ? p.lse[off.stats + row] : 0.f, row < mask.q_len);
      delta[mi][h] = row < mask.q_len ? p.delta[off.stats + row] : 0.f;
    }
  }

  float acc_dq[kMT][kHeadDim / 8][4];
  Zero(acc_dq);

  const int row1 = min(row0 + kMT * 16, mask.q_len) - 1;
  const TileWalk walk = MakeTileWalk<true, kExtra>(mask, m0, m_last, row0, row1, kN);
  const int n_begin = walk.begin, n_end = walk.end;
  auto load_kv = [&](int nb, int buf) {
    LoadPairAsync<kN, kHeadDim, Tr::kThreads>(skv, buf, k, v, off.kv_ld, nb * kN, mask.kv_len, H);
    if (segments) LoadRowWordsAsync(skv_seg + buf * kN, mask.kv_seg, nb * kN, mask.kv_len, kN);
    if constexpr (kExtra) {
      XT::template LoadAsync<Tr::kThreads>(smem_raw, stage, p, ex, static_cast<int>(tile.r), buf,
                                           m0, nb * kN);
    }
  };
  if (n_begin < n_end) {
    LoadTileAsync<kM, kHeadDim, Tr::kThreads>(
        sq, static_cast<const T*>(p.q) + off.q + m0 * off.q_ld, off.q_ld, mask.q_len - m0, H);
    LoadTileAsync<kM, kHeadDim, Tr::kThreads>(
        sdo, static_cast<const T*>(p.d_o) + off.q + m0 * off.q_ld, off.q_ld, mask.q_len - m0, H);
    if (segments) LoadRowWordsAsync(sq_seg, mask.q_seg, m0, mask.q_len, kM);
    load_kv(n_begin, 0);
    CpAsyncCommit();
  }
  for (int nb = n_begin; nb < n_end; ++nb) {
    const int buf = (nb - n_begin) & 1;
    const int n0 = nb * kN;
    CpAsyncWait<0>();
    __syncthreads();  // tile nb in smem; every warp is done with tile nb - 1's buffer
    if (nb + 1 < n_end) {
      load_kv(nb + 1, buf ^ 1);
      CpAsyncCommit();
    }
    if (walk.WarpSkips(n0, kN)) continue;
    const TileMasking tm =
        DecideMasking<kMaskable>(mask, segments, row0, row1, n0, n0 + kN - 1,
                                 sq_seg + warp * kMT * 16, kMT * 16, skv_seg + buf * kN, kN, lane);
    if (tm.skip) continue;
    float s[kMT][kN / 8][4], dp[kMT][kN / 8][4];
    Zero(s);
    Zero(dp);
    ScoresFromSmem<T, kHeadDim, kN, kMT>(s, sq, warp * kMT * 16, sk(buf), H, lane);
    ScoresFromSmem<T, kHeadDim, kN, kMT>(dp, sdo, warp * kMT * 16, sv(buf), H, lane);
#pragma unroll
    for (int mi = 0; mi < kMT; ++mi) {
      ToLogits<false, kN, kSoftcap>(s[mi], ls, mask, tm.masked, row0 + mi * 16, n0,
                                    tm.RowSeg(16 * mi), tm.col_seg, lane);
      if constexpr (kExtra) {
        if (Extras::Any(p)) {
          // p from the biased, masked logit; the softcap's slope from ToLogits's output.
          const int r = static_cast<int>(tile.r);
          const typename XT::Tile staged = stage.At(smem_raw, p, buf, m0, n0);
#pragma unroll
          for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int i = row0 + mi * 16 + g + 8 * (e >> 1);
              const int k = n0 + 8 * j + 2 * (lane & 3) + (e & 1);
              const float x = s[mi][j][e];
              const float pr =
                  ProbOfLogit(ex.Apply<T>(p, x, r, i, k, staged), lse2[mi][e >> 1], ls);
              const float grad = pr * (dp[mi][j][e] - delta[mi][e >> 1]);
              ex.AddBiasGrad(p, grad, r, i, k);
              dp[mi][j][e] = GradWeight<kSoftcap>(x, grad);
              s[mi][j][e] = pr;
            }
          }
          continue;
        }
      }
#pragma unroll
      for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          ProbsAndGrads<kSoftcap>(s[mi][j][e], dp[mi][j][e], lse2[mi][e >> 1], delta[mi][e >> 1],
                                  ls);
        }
      }
    }
    AccumulateFromRegs<T, kN, kHeadDim, kHeadDim, kMT>(acc_dq, dp, sk(buf), 0, H, lane);
  }
#pragma unroll
  for (int mi = 0; mi < kMT; ++mi) {
    StoreAccumulator<T, kHeadDim>(dq, off.q_ld, acc_dq[mi], ls.scale, (warp * kMT + mi) * 16,
                                  (kExtra ? static_cast<int>(p.q_len) : mask.q_len) - m0, 0, H,
                                  lane);
  }
}

// ---- dK, dV --------------------------------------------------------------------------------

template <int kHeadDim_>
struct DkvTraits {
  // Warps work in pairs on 32 keys (2 row tiles of 16) per 32-query step: the first warp
  // of a pair computes P^T = exp(K Q^T - lse) and dV += P^T dO; the second, one step
  // behind, dP^T = V dO^T, takes that step's P (times the softcap's slope) from the first
  // through shared memory, and computes dK += dS^T Q. Each warp holds one 32 x kAccDim
  // accumulator, so every Q / dO fragment it loads feeds both row tiles: 40% fewer
  // ldmatrix bytes per MMA than one warp per 16 keys holding both dK and dV (which ran at
  // 41% tensor-pipe use on the H100, shared-memory bound). The lag lets both warps of a pair
  // run a step with no wait for each other: a barrier per step between them stalled ~12%
  // of the time. Measurements: docs/perf/attention.md section 2.3.
  static constexpr int kHeadDim = kHeadDim_;
  // 4 pairs (128 keys, 8 warps) measured 232 vs 240 TFLOP/s bwd at H = 128, 178 vs 208 at
  // H = 64 (H100, T = 4096).
  static constexpr int kPairs = 2;
  static constexpr int kWarps = 2 * kPairs;
  static constexpr int kPairKeys = 32;
  static constexpr int kBlockN = kPairs * kPairKeys;  // keys per CTA
  static constexpr int kBlockM = 32;                  // queries per step
  // The accumulator is 32 x kAccDim per warp; at H = 256 it would take 256 registers, so
  // the feature dim is split over two CTAs (each recomputes P and dS).
  static constexpr int kAccDim = kHeadDim > 128 ? 128 : kHeadDim;
  static constexpr int kSlices = kHeadDim / kAccDim;
  static constexpr int kThreads = 32 * kWarps;
  // Q/dO buffers: step s + 1 loads while the probs warps work on step s and the dS warps
  // on step s - 1.
  static constexpr int kBuffers = 3;
  // K, V, kBuffers buffers each of Q and dO; then the StepWords; then two step parities of
  // each pair's exchange tile of P (2 row tiles x kBlockM / 8 n-tiles x 32 lanes x 4 floats).
  static constexpr int kWordOffset =
      (2 * kBlockN + 2 * kBuffers * kBlockM) * SmemTile<kHeadDim>::kStride * 2;
  static constexpr int kExchangeFloats = 2 * (kBlockM / 8) * 32 * 4;  // per pair and parity
  using Words = StepWords<kBlockN, kBlockM>;
  static constexpr int kExchangeOffset = kWordOffset + Words::Bytes(kBuffers);
  static constexpr int kSmemBytes = kExchangeOffset + 2 * kPairs * kExchangeFloats * 4;
  static_assert(kExchangeOffset % 16 == 0, "float4 exchange");
};

template <typename T, typename Tr, bool kMaskable, bool kSoftcap, bool kExtra>
__global__ void __launch_bounds__(Tr::kThreads) DkvKernel(AttentionParams p, LogitScale ls) {
  static_assert(kMaskable || !kExtra, "the extras mask");
  constexpr int kHeadDim = Tr::kHeadDim;
  constexpr int kN = Tr::kBlockN, kM = Tr::kBlockM, kAcc = Tr::kAccDim;
  constexpr int kStride = SmemTile<kHeadDim>::kStride;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sk = reinterpret_cast<T*>(smem_raw);
  T* sv = PairTile<kN, kHeadDim>(sk, 0, 1);
  T* sqdo = sv + kN * kStride;  // [buffer][Q, dO]
  auto sq = [&](int buf) { return PairTile<kM, kHeadDim>(sqdo, buf, 0); };
  auto sdo = [&](int buf) { return PairTile<kM, kHeadDim>(sqdo, buf, 1); };
  const typename Tr::Words words{reinterpret_cast<int32_t*>(smem_raw + Tr::kWordOffset)};
  int32_t* skv_seg = words.kv_seg;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int t = lane & 3;
  const int pair = warp >> 1;
  const bool probs_warp = (warp & 1) == 0;  // P and dV; the other warp dP, dS and dK
  // Exchange tile of step parity `par`, at this lane's float4.
  auto exchange = [&](int par) {
    return reinterpret_cast<float4*>(smem_raw + Tr::kExchangeOffset) +
           (par * Tr::kPairs + pair) * (Tr::kExchangeFloats / 4) + lane;
  };
  const int n_blocks = (static_cast<int>(p.kv_len) + kN - 1) / kN;
  const int slice = blockIdx.x % Tr::kSlices;
  const KeyTile tile =
      DecodeKeyTile<kMaskable>(p, static_cast<int64_t>(blockIdx.x / Tr::kSlices), n_blocks);
  const Mask mask = MakeMask<kExtra>(p, tile.b);
  const bool segments = kMaskable && mask.q_seg != nullptr;
  const int H = static_cast<int>(p.head_dim);
  const int n0 = tile.n_block * kN;
  const Extras ex = MakeExtras(p, tile.b, tile.kh);
  // The bias and mask blocks of each step (queries x this CTA's keys), buffered as Q/dO.
  // Their offsets are formed where used: held across the loop, sm_80 ptxas spilled 180
  // bytes at H = 128 (12 before the staging), 132 at H = 96 (0).
  using XT = ExtraTiles<kM, kN, Tr::kBuffers>;
  const int n_last = min(n0 + kN, mask.kv_len) - 1;
  const int col0 = slice * kAcc;  // this CTA's feature columns of dK and dV
  const int pair_row0 = pair * Tr::kPairKeys;
  const int key0 = n0 + pair_row0;

  const HeadOffsets off0 = MakeHeadOffsets(p, tile.b, tile.kh, 0);
  const T* q = static_cast<const T*>(p.q);
  const T* d_o = static_cast<const T*>(p.d_o);

  float acc[2][kAcc / 8][4];  // dV (probs warp) or dK rows key0.. of this pair
  Zero(acc);

  const int key1 = min(key0 + Tr::kPairKeys, mask.kv_len) - 1;
  const TileWalk walk = MakeTileWalk<false, kExtra>(mask, n0, n_last, key0, key1, kM);
  const int m_begin = walk.begin, m_count = walk.end - walk.begin;
  const int steps = m_count * static_cast<int>(p.group);  // (query head r, query tile) pairs
  using StepCursor = GroupStepCursor<Tr::kBuffers>;
  auto load_qdo = [&](const StepCursor& c) {
    const int64_t head = off0.q + c.r * p.head_dim;
    const int64_t stats = off0.stats + c.r * p.q_len;
    const int m0 = (m_begin + c.tile) * kM;
    LoadPairAsync<kM, kHeadDim, Tr::kThreads>(sqdo, c.buf, q + head, d_o + head, off0.q_ld, m0,
                                              mask.q_len, H);
    words.LoadStep(c.buf, p, mask, segments, stats, m0);
    if constexpr (kExtra) {
      XT::template LoadAsync<Tr::kThreads>(smem_raw, XT::MakeStage(p, Tr::kSmemBytes), p, ex, c.r,
                                           c.buf, m0, n0);
    }
  };
  StepCursor next_load;
  if (steps > 0) {
    // sk, sv are buffer 0 of a pair
    LoadPairAsync<kN, kHeadDim, Tr::kThreads>(sk, 0, static_cast<const T*>(p.k) + off0.kv,
                                              static_cast<const T*>(p.v) + off0.kv, off0.kv_ld, n0,
                                              mask.kv_len, H);
    if (segments) LoadRowWordsAsync(skv_seg, mask.kv_seg, n0, mask.kv_len, kN);
    load_qdo(next_load);
    next_load.Next(m_count);
    CpAsyncCommit();
  }
  // Interval i: the probs warps work on step i, the dS warps on step i - 1.
  StepCursor mine;  // the step this warp works on next
  const int lag = probs_warp ? 0 : 1;
  for (int i = 0; i <= steps; ++i) {
    CpAsyncWait<0>();
    // Step i's Q/dO in smem; the buffer of step i - 2 and the exchange tiles of step i - 2's
    // parity are free (every warp is past both).
    __syncthreads();
    if (i + 1 < steps) {
      load_qdo(next_load);
      next_load.Next(m_count);
      CpAsyncCommit();
    }
    const int step = i - lag;
    if (step < 0 || step >= steps) continue;
    const int m0 = (m_begin + mine.tile) * kM;
    const int buf = mine.buf;
    const int step_r = mine.r;  // the step's query head
    mine.Next(m_count);
    // Both warps of a pair make the same skip decisions (same keys, same queries): a step
    // the probs warp skips leaves no P for the dS warp, which skips it too.
    if (walk.WarpSkips(m0, kM)) continue;
    const TileMasking tm = DecideMasking<kMaskable>(
        mask, segments, m0, min(m0 + kM, mask.q_len) - 1, key0, key0 + Tr::kPairKeys - 1,
        skv_seg + pair_row0, Tr::kPairKeys, words.QSeg(buf), kM, lane);
    if (tm.skip) continue;
    float x[2][kM / 8][4];
    Zero(x);
    float4* xchg = exchange(step & 1);
    // Per-column (query) statistics of columns 8 j + 2 t + c; queries past T get lse = +inf
    // (p = 0; their Q and dO rows are zeros anyway).
    auto column_ok = [&](int j, int c) { return m0 + 8 * j + 2 * t + c < mask.q_len; };
    if (probs_warp) {
      typename XT::Tile staged{smem_raw, -1, -1, 0, 0};
      if constexpr (kExtra) staged = XT::MakeStage(p, Tr::kSmemBytes).At(smem_raw, p, buf, m0, n0);
      ScoresFromSmem<T, kHeadDim, kM, 2>(x, sk, pair_row0, sq(buf), H, lane);
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) {
        ToLogits<true, kM, kSoftcap>(x[mi], ls, mask, tm.masked, key0 + 16 * mi, m0,
                                     tm.RowSeg(16 * mi), tm.col_seg, lane);
      }
#pragma unroll
      for (int j = 0; j < kM / 8; ++j) {
        float lse2[2];
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          lse2[c] = RowLse2(words.Lse(buf)[8 * j + 2 * t + c], column_ok(j, c));
        }
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
          float w[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float biased = x[mi][j][e];
            if constexpr (kExtra) {
              // p from the biased, masked logit; the softcap's slope from ToLogits's output.
              if (Extras::Any(p)) {
                biased = ex.Apply<T>(p, biased, step_r, m0 + 8 * j + 2 * t + (e & 1),
                                     key0 + 16 * mi + (lane >> 2) + 8 * (e >> 1), staged);
              }
            }
            const float pr = ProbOfLogit(biased, lse2[e & 1], ls);
            w[e] = GradWeight<kSoftcap>(x[mi][j][e], pr);
            x[mi][j][e] = pr;
          }
          xchg[(mi * (kM / 8) + j) * 32] = make_float4(w[0], w[1], w[2], w[3]);
        }
      }
      AccumulateFromRegs<T, kM, kAcc, kHeadDim, 2>(acc, x, sdo(buf), col0, H, lane);
    } else {
      ScoresFromSmem<T, kHeadDim, kM, 2>(x, sv, pair_row0, sdo(buf), H, lane);
#pragma unroll
      for (int j = 0; j < kM / 8; ++j) {
        float delta[2];
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          delta[c] = column_ok(j, c) ? words.Delta(buf)[8 * j + 2 * t + c] : 0.f;
        }
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
          const float4 w4 = xchg[(mi * (kM / 8) + j) * 32];
          const float w[4] = {w4.x, w4.y, w4.z, w4.w};
#pragma unroll
          for (int e = 0; e < 4; ++e) x[mi][j][e] = w[e] * (x[mi][j][e] - delta[e & 1]);
        }
      }
      AccumulateFromRegs<T, kM, kAcc, kHeadDim, 2>(acc, x, sq(buf), col0, H, lane);
    }
  }
  // The probs warp stores dV, the other dK (times the softmax scale: dS was taken with
  // respect to the scaled logits).
  const int64_t out = off0.kv + n0 * off0.kv_ld;
  T* dst = static_cast<T*>(probs_warp ? p.dv : p.dk) + out;
  const float mul = probs_warp ? 1.f : ls.scale;
#pragma unroll
  for (int mi = 0; mi < 2; ++mi) {
    StoreAccumulator<T, kAcc>(dst, off0.kv_ld, acc[mi], mul, pair_row0 + 16 * mi,
                              (kExtra ? static_cast<int>(p.kv_len) : mask.kv_len) - n0, col0, H,
                              lane);
  }
}

}  // namespace

cudaError_t LaunchDq(const AttentionParams& p, cudaStream_t stream) {
  return JAXGPU_ATTENTION_DTYPE_SWITCH(p.dtype, T, [&] {
    return JAXGPU_HEAD_DIM_SWITCH(p.head_dim, D, [&] {
      return JAXGPU_BOOL_SWITCH(p.softcap > 0.f, kSoftcap, [&]() -> cudaError_t {
        if (HasExtras(p)) {
          using Tr = DqTraits<D>;
          return LaunchOverQueryTiles<Tr>(DqKernel<T, Tr, true, kSoftcap, true>, p, stream,
                                          ExtraTiles<Tr::kBlockM, Tr::kBlockN, 2>::SmemBytes(
                                              p, Tr::kSmemBytes, SmemOptInLimit()));
        }
        // Keys past S in the dQ kernel's last tile must be masked (DqTraits's tile).
        return JAXGPU_BOOL_SWITCH(NeedsMask(p, DqTraits<D>::kBlockN), kMaskable, [&] {
          return LaunchOverQueryTiles<DqTraits<D>>(
              DqKernel<T, DqTraits<D>, kMaskable, kSoftcap, false>, p, stream);
        });
      });
    });
  });
}

cudaError_t LaunchDkv(const AttentionParams& p, cudaStream_t stream) {
  return JAXGPU_ATTENTION_DTYPE_SWITCH(p.dtype, T, [&] {
    return JAXGPU_HEAD_DIM_SWITCH(p.head_dim, D, [&] {
      return JAXGPU_BOOL_SWITCH(p.softcap > 0.f, kSoftcap, [&]() -> cudaError_t {
        if (HasExtras(p)) {
          using Tr = DkvTraits<D>;
          return LaunchOverKeyTiles<Tr>(
              DkvKernel<T, Tr, true, kSoftcap, true>, p, stream,
              ExtraTiles<Tr::kBlockM, Tr::kBlockN, Tr::kBuffers>::SmemBytes(p, Tr::kSmemBytes,
                                                                            SmemOptInLimit()));
        }
        // The mask decided on DqTraits's key tile, as for dQ: the dK/dV kernel's own tails
        // need none (its keys past S are rows it never stores, its queries past T get p = 0).
        return JAXGPU_BOOL_SWITCH(NeedsMask(p, DqTraits<D>::kBlockN), kMaskable, [&] {
          return LaunchOverKeyTiles<DkvTraits<D>>(
              DkvKernel<T, DkvTraits<D>, kMaskable, kSoftcap, false>, p, stream);
        });
      });
    });
  });
}

}  // namespace jaxgpu::cuda::attention::sm80
