// Attention forward of the mma.sync main loop (m16n8k16, sm_80+): FlashAttention-2's
// schedule. One CTA owns kBlockM queries of one query head; each warp owns 16 * kMTiles
// query rows and keeps their scores, probabilities and output accumulator in registers.
// The CTA walks the key tiles the mask leaves visible (fully masked tiles are never
// loaded), with an online softmax in the log2 domain; it writes o and the log-sum-exp.
//
// Pipeline: two K/V buffers; tile j+1's copy overlaps all of tile j's math, one barrier
// per tile. (FlashAttention-2's single-buffer schedule, V_j's copy behind Q K_j^T only,
// measured ~140 TFLOP/s here with its other costs.)
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

template <int kHeadDim_>
struct FwdTraits {
  // Up to H = 128: 8 warps x 2 row tiles of 16 queries (256 per CTA) x 64-key tiles. Each
  // K/V fragment a warp loads feeds both its row tiles, halving the shared-memory reads
  // per MMA (ldmatrix, 128 B/clk/SM, bounds an mma.sync loop), and each K/V tile copied
  // into shared memory serves 256 queries, halving the L2 traffic of 128-query CTAs.
  // H = 256 keeps one row tile of 4 warps: 128 output accumulators per thread leave no
  // room. Alternatives measured at H = 128, T = 4096 on the H100: docs/perf/attention.md
  // sections 2.1-2.2.
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kMTiles = kHeadDim <= 128 ? 2 : 1;
  static constexpr int kWarps = kHeadDim <= 128 ? 8 : 4;
  static constexpr int kBlockM = 16 * kWarps * kMTiles;
  static constexpr int kBlockN = kHeadDim > 128 ? 32 : 64;
  static constexpr int kThreads = 32 * kWarps;
  // Q, 2 x (K, V), then the segment ids of the query tile and of 2 key tiles.
  static constexpr int kSegOffset = (kBlockM + 4 * kBlockN) * SmemTile<kHeadDim>::kStride * 2;
  static constexpr int kSmemBytes = kSegOffset + (kBlockM + 2 * kBlockN) * 4;
};

// The kExtra kernels' tile: one row tile of 16 queries per warp (128 queries per CTA up to
// H = 128), so that a bias and a mask block of every pipeline stage fit in shared memory
// beside K and V (ExtraTiles: 2 stages of 128 x 64 keys, bf16 bias + mask 56 KiB, float32
// bias + mask 92 KiB); the kMTiles = 2 tile's 256 x 64 blocks would not (bf16 bias + mask
// 250 KiB in all against the H100's 227).
template <int kHeadDim_>
struct FwdExtraTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kMTiles = 1;
  static constexpr int kWarps = FwdTraits<kHeadDim>::kWarps;
  static constexpr int kBlockM = 16 * kWarps;
  static constexpr int kBlockN = FwdTraits<kHeadDim>::kBlockN;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kSegOffset = (kBlockM + 4 * kBlockN) * SmemTile<kHeadDim>::kStride * 2;
  // Without the staged blocks, which follow (ExtraTiles::SmemBytes).
  static constexpr int kSmemBytes = kSegOffset + (kBlockM + 2 * kBlockN) * 4;
  static_assert(kSmemBytes % 16 == 0, "16-byte aligned staged blocks");
};

// kExtra (with kMaskable): the bias, the mask and the sequence lengths (attention_extras.cuh,
// MakeMask<true>), read only by these instantiations.
template <typename T, typename Tr, bool kMaskable, bool kSoftcap, bool kExtra>
__global__ void __launch_bounds__(Tr::kThreads)
    AttentionFwdKernel(AttentionParams p, LogitScale ls) {
  static_assert(kMaskable || !kExtra, "the extras mask");
  constexpr int kHeadDim = Tr::kHeadDim;
  constexpr int kM = Tr::kBlockM, kN = Tr::kBlockN, kMT = Tr::kMTiles;
  constexpr int kStride = SmemTile<kHeadDim>::kStride;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sq = reinterpret_cast<T*>(smem_raw);
  T* sk = sq + kM * kStride;  // [buffer][K, V]
  int32_t* sq_seg = reinterpret_cast<int32_t*>(smem_raw + Tr::kSegOffset);
  int32_t* skv_seg = sq_seg + kM;  // [buffer][kN]

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const QueryTile tile = DecodeQueryTile<kMaskable>(p, kM);
  const int64_t b = tile.b;
  const HeadOffsets off = MakeHeadOffsets(p, b, tile.kh, tile.r);
  const Mask mask = MakeMask<kExtra>(p, b);
  const bool segments = kMaskable && mask.q_seg != nullptr;
  const int H = static_cast<int>(p.head_dim);
  const int m0 = tile.m_block * kM;
  const int m_last = min(m0 + kM, mask.q_len) - 1;
  const Extras ex = MakeExtras(p, b, tile.kh);
  using XT = ExtraTiles<kM, kN, 2>;
  const typename XT::Stage stage =
      kExtra ? XT::MakeStage(p, Tr::kSmemBytes) : typename XT::Stage{-1, -1};

  const T* q = static_cast<const T*>(p.q) + off.q + m0 * off.q_ld;
  const T* k = static_cast<const T*>(p.k) + off.kv;
  const T* v = static_cast<const T*>(p.v) + off.kv;
  T* o = static_cast<T*>(p.o) + off.q + m0 * off.q_ld;
  float* lse = p.lse + off.stats + m0;

  const int warp_row0 = m0 + warp * kMT * 16;
  const int warp_row1 = min(warp_row0 + kMT * 16, mask.q_len) - 1;
  const TileWalk walk = MakeTileWalk<true, kExtra>(mask, m0, m_last, warp_row0, warp_row1, kN);
  const int n_begin = walk.begin, n_end = walk.end;

  float acc_o[kMT][kHeadDim / 8][4];
  float row_max[kMT][2], row_sum[kMT][2];
  Zero(acc_o);
#pragma unroll
  for (int mi = 0; mi < kMT; ++mi) {
    row_max[mi][0] = row_max[mi][1] = -INFINITY;
    row_sum[mi][0] = row_sum[mi][1] = 0.f;
  }

  auto load_kv = [&](int nb, int buf) {
    LoadPairAsync<kN, kHeadDim, Tr::kThreads>(sk, buf, k, v, off.kv_ld, nb * kN, mask.kv_len, H);
    if (segments) LoadRowWordsAsync(skv_seg + buf * kN, mask.kv_seg, nb * kN, mask.kv_len, kN);
    if constexpr (kExtra) {
      XT::template LoadAsync<Tr::kThreads>(smem_raw, stage, p, ex, static_cast<int>(tile.r), buf,
                                           m0, nb * kN);
    }
  };
  if (n_begin < n_end) {
    LoadTileAsync<kM, kHeadDim, Tr::kThreads>(sq, q, off.q_ld, mask.q_len - m0, H);
    if (segments) LoadRowWordsAsync(sq_seg, mask.q_seg, m0, mask.q_len, kM);
    load_kv(n_begin, 0);
    CpAsyncCommit();
  }
  for (int nb = n_begin; nb < n_end; ++nb) {
    const int n0 = nb * kN;
    const int buf = (nb - n_begin) & 1;
    const T* sk_nb = PairTile<kN, kHeadDim>(sk, buf, 0);
    const T* sv_nb = PairTile<kN, kHeadDim>(sk, buf, 1);
    CpAsyncWait<0>();
    __syncthreads();  // tile nb in smem; every warp is done with tile nb - 1's buffer
    if (nb + 1 < n_end) {
      load_kv(nb + 1, buf ^ 1);  // overlaps all of tile nb's math
      CpAsyncCommit();
    }
    if (walk.WarpSkips(n0, kN)) continue;
    const TileMasking tm =
        DecideMasking<kMaskable>(mask, segments, warp_row0, warp_row1, n0, n0 + kN - 1,
                                 sq_seg + warp * kMT * 16, kMT * 16, skv_seg + buf * kN, kN, lane);
    if (tm.skip) continue;

    float acc_s[kMT][kN / 8][4];
    Zero(acc_s);
    ScoresFromSmem<T, kHeadDim, kN, kMT>(acc_s, sq, warp * kMT * 16, sk_nb, H, lane);

    float correction[kMT][2];
#pragma unroll
    for (int mi = 0; mi < kMT; ++mi) {
      ToLogits<false, kN, kSoftcap>(acc_s[mi], ls, mask, tm.masked, warp_row0 + mi * 16, n0,
                                    tm.RowSeg(16 * mi), tm.col_seg, lane);
      if constexpr (kExtra) {
        if (Extras::Any(p)) {
          ApplyExtras<T, false, kN>(acc_s[mi], p, ex, static_cast<int>(tile.r), warp_row0 + mi * 16,
                                    n0, lane, stage.At(smem_raw, p, buf, m0, n0));
        }
      }
      OnlineSoftmax<kN>(acc_s[mi], row_max[mi], row_sum[mi], correction[mi], ls.fold);
    }
    uint32_t p_frags[kN / 16][kMT][4];
    PackProbs<T, kN, kMT>(p_frags, acc_s);
    // Rescaled unconditionally: skipping it when no row of the warp moved its max (a warp
    // vote and a branch) measured 343 vs 339 TFLOP/s non-causal but 271 vs 288 causal at
    // H = 128, T = 4096 on the H100.
    RescaleRows<kMT, kHeadDim>(acc_o, correction);
    AccumulatePacked<T, kN, kHeadDim, kHeadDim, kMT>(acc_o, p_frags, sv_nb, 0, H, lane);
  }

  if constexpr (kExtra) {
    // Rows past the batch row's query length output zeros (lse = -inf), stored below up
    // to T like every other row.
#pragma unroll
    for (int mi = 0; mi < kMT; ++mi) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (warp_row0 + mi * 16 + (lane >> 2) + 8 * h >= mask.q_len) row_sum[mi][h] = 0.f;
      }
    }
  }
  StoreOutputRows<T, kMT, kHeadDim>(o, lse, off.q_ld, acc_o, row_max, row_sum, ls.fold,
                                    warp * kMT * 16, m0,
                                    kExtra ? static_cast<int>(p.q_len) : mask.q_len, H, lane);
}

}  // namespace

cudaError_t LaunchFwd(const AttentionParams& p, cudaStream_t stream) {
  return JAXGPU_ATTENTION_DTYPE_SWITCH(p.dtype, T, [&] {
    return JAXGPU_HEAD_DIM_SWITCH(p.head_dim, D, [&] {
      return JAXGPU_BOOL_SWITCH(p.softcap > 0.f, kSoftcap, [&]() -> cudaError_t {
        if (HasExtras(p)) {
          using Tr = FwdExtraTraits<D>;
          return LaunchOverQueryTiles<Tr>(AttentionFwdKernel<T, Tr, true, kSoftcap, true>, p,
                                          stream,
                                          ExtraTiles<Tr::kBlockM, Tr::kBlockN, 2>::SmemBytes(
                                              p, Tr::kSmemBytes, SmemOptInLimit()));
        }
        // Keys past S in the last tile must be masked in the softmax sums (FwdTraits's tile).
        return JAXGPU_BOOL_SWITCH(NeedsMask(p, FwdTraits<D>::kBlockN), kMaskable, [&] {
          return LaunchOverQueryTiles<FwdTraits<D>>(
              AttentionFwdKernel<T, FwdTraits<D>, kMaskable, kSoftcap, false>, p, stream);
        });
      });
    });
  });
}

}  // namespace jaxgpu::cuda::attention::sm80
