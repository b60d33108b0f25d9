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
// persistent grid (one CTA an SM walking the tiles, the rings going on across them).
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
// causal ones, whose costs differ by up to the number of key tiles: on for the unmasked
// calls only (LaunchFwdWarpSpecialized's callers decide).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

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
  static constexpr int kSmemBytes = kSegOffset + (kBlockM + kStages * kBlockN) * 4 + 1024;
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

// `used` counts the CTA's earlier tiles: K/V tiles through the rings and Q tiles, whose
// barrier phases go on from there (a persistent CTA's tiles share the rings).
struct RingUse {
  int kv = 0;  // K/V tiles
  int q = 0;   // Q tiles (tiles that walked at least one key tile)
};

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

// kPersistent: one CTA an SM walks the flat tiles blockIdx.x, + gridDim.x, ... (the
// FlatGrid order: longest causal tiles first), its rings and barriers going on from tile to
// tile; otherwise one CTA a tile.
template <typename T, typename Tr, bool kMaskable, bool kSoftcap, bool kBounded, bool kPingPong,
          bool kPersistent>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    AttentionFwdWsKernel(const AttentionParams p, const LogitScale ls,
                         const __grid_constant__ TensorMaps maps, int tiles) {
#if JAXGPU_WGMMA_DEVICE
  constexpr int kD = Tr::kHeadDim, kM = Tr::kBlockM, kN = Tr::kBlockN, kS = Tr::kStages;
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
    FenceBarrierInit();
  }
  __syncthreads();  // the last CTA-wide barrier: the roles split below

  const int stride = kPersistent ? static_cast<int>(gridDim.x) : tiles;
  const int group = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x >> 7), 0);
  RingUse used;
  if (group == 2) {
    // The copy warpgroup: its first warp walks the tiles, its lane 0 issues every copy.
    ReleaseRegisters<Tr::kCopyRegisters>();
    if (threadIdx.x / 32 != Tr::kMathThreads / 32) return;
    const bool issuer = threadIdx.x == Tr::kMathThreads;
    const int lane = threadIdx.x & 31;
    for (int flat = blockIdx.x; flat < tiles; flat += stride) {
      const sm90::QueryRows rows =
          sm90::MakeQueryRowsOf<kM, kN, kMaskable>(p, DecodeQueryTileAt<kMaskable>(p, kM, flat));
      const int n_begin = rows.walk.begin, n_end = rows.walk.end;
      if (n_begin >= n_end) continue;
      const int b = static_cast<int>(rows.tile.b);
      const int kh = static_cast<int>(rows.tile.kh);
      const int qh = static_cast<int>(rows.tile.kh * p.group + rows.tile.r);
      // K_i, then V_i, each once its slot is free. V's slot frees a tile after K's (P V
      // runs a tile behind S), so K_{i+1} goes out once V_i has, about a tile ahead of use.
      // Q goes out after the tile's first K (its slot frees only when every product of the
      // previous tile is done; the first K may be on its way before that).
      for (int nb = n_begin; nb < n_end; ++nb) {
        const int g = used.kv + nb - n_begin;
        const int s = g % kS;
        const uint32_t reuse = (g / kS) & 1;
        if (g >= kS) MbarrierWait(sm.k_empty(s), reuse ^ 1);
        if (rows.segments) {
          CopySegmentIds(sm.k_seg(s), rows.mask.kv_seg, nb * kN, rows.mask.kv_len, kN, sm.k_full(s),
                         lane);
        }
        if (issuer) TmaLoadTile<kN, kD>(sm.k(s), &maps.k, sm.k_full(s), kh, nb * kN, b);
        if (nb == n_begin) {
          if (used.q > 0) MbarrierWait(sm.q_empty(), (used.q - 1) & 1);
          if (rows.segments) {
            CopySegmentIds(sm.q_seg(), rows.mask.q_seg, rows.m0, rows.mask.q_len, kM, sm.q_full(),
                           lane);
          }
          if (issuer) TmaLoadTile<kM, kD>(sm.q(), &maps.q, sm.q_full(), qh, rows.m0, b);
        }
        if (g >= kS) MbarrierWait(sm.v_empty(s), reuse ^ 1);
        if (issuer) TmaLoadTile<kN, kD>(sm.v(s), &maps.v, sm.v_full(s), kh, nb * kN, b);
      }
      used.kv += n_end - n_begin;
      used.q += 1;
    }
  } else {
    ClaimRegisters<Tr::kMathRegisters>();
    for (int flat = blockIdx.x; flat < tiles; flat += stride) {
      const sm90::QueryRows rows =
          sm90::MakeQueryRowsOf<kM, kN, kMaskable>(p, DecodeQueryTileAt<kMaskable>(p, kM, flat));
      MathWarpgroups<T, Tr, kMaskable, kSoftcap, kBounded, kPingPong>(p, ls, rows, sm, used);
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
  WsFwdSchedule s;
  s.persistent = !NeedsMask(p, WsBlockN(p));
  return s;
}

cudaError_t LaunchFwdWarpSpecialized(const AttentionParams& p, const WsFwdSchedule& schedule,
                                     cudaStream_t stream) {
  if (WarpSpecializedFwdUnavailable(p) != nullptr) return cudaErrorNotSupported;
  const bool masks = NeedsMask(p, WsBlockN(p));
  // A product build compiles the default schedule only (each extra one doubles the file's
  // instances and CI's compile of it); a developer-knob build every one, for A/B runs.
  if (!kDevKnobs && (schedule.ping_pong || schedule.persistent == masks)) {
    return cudaErrorNotSupported;
  }
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
      // One schedule's kernel: its launch.
      auto launch = [&](auto kernel, bool persistent) -> cudaError_t {
        JAXGPU_RETURN_IF_CUDA_ERROR(AllowSmem(kernel, Tr::kSmemBytes));
        dim3 grid;
        JAXGPU_RETURN_IF_CUDA_ERROR(FlatGrid(tiles, 1, &grid));
        if (persistent) {
          int device = 0, sms = 0;
          JAXGPU_RETURN_IF_CUDA_ERROR(cudaGetDevice(&device));
          JAXGPU_RETURN_IF_CUDA_ERROR(
              cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
          grid.x = static_cast<unsigned>(std::min<int64_t>(tiles, sms));
        }
        kernel<<<grid, Tr::kThreads, Tr::kSmemBytes, stream>>>(p, ls, maps,
                                                               static_cast<int>(tiles));
        return cudaGetLastError();
      };
      return JAXGPU_BOOL_SWITCH(p.softcap > 0.f, kSoftcap, [&] {
        return JAXGPU_BOOL_SWITCH(kSoftcap && bounded, kBounded, [&] {
          return JAXGPU_BOOL_SWITCH(masks, kMaskable, [&]() -> cudaError_t {
            constexpr bool kB = kSoftcap && kBounded;
            if constexpr (kDevKnobs) {
              return JAXGPU_BOOL_SWITCH(schedule.ping_pong, kPingPong, [&] {
                return JAXGPU_BOOL_SWITCH(schedule.persistent, kPersistent, [&] {
                  return launch(
                      AttentionFwdWsKernel<T, Tr, kMaskable, kSoftcap, kB, kPingPong, kPersistent>,
                      kPersistent);
                });
              });
            } else {
              return launch(AttentionFwdWsKernel<T, Tr, kMaskable, kSoftcap, kB, false, !kMaskable>,
                            !kMaskable);
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
