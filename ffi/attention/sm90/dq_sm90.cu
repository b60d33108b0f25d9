// Attention backward's dQ in the wgmma main loop (Hopper's warpgroup MMAs, sm_90a): the
// mma.sync DqKernel's products (sm80/bwd_sm80.cu) with the same determinism, each dQ
// element summed by one thread over the key tiles in order. dK/dV run in dkv_sm90.cu,
// delta before both in attention_delta.cu.
//
// One CTA owns 128 queries of one query head, two warpgroups of 64 rows. Per 64-key tile a
// warpgroup computes S = Q K^T and dP = dO V^T (Q, dO, K, V all read by the tensor cores
// from shared memory), turns them into dS in registers (attention_softmax.cuh), and
// accumulates dQ += dS K with dS from registers and K, read a second time as an MN-major
// operand, from shared memory.
#include <cuda_runtime.h>

#include "attention/attention_launch.cuh"
#include "attention/attention_logits.cuh"
#include "attention/attention_mask.cuh"
#include "attention/attention_schedule.cuh"
#include "attention/attention_softmax.cuh"
#include "attention/sm90/dispatch.cuh"
#include "attention/sm90/main_loop.h"
#include "attention/sm90/query_rows.cuh"
#include "attention/sm90/wgmma.cuh"

namespace jaxgpu::cuda::attention::sm90 {
namespace {

// Q and dO before the K/V buffers. Keys per tile: 128 at H = 64 (bwd 216 -> 226 TFLOP/s on
// the H100 against 64-key tiles); 64 at H = 128, where 128 measured no faster (265 both)
// and the S and dP tiles (2 x 64 floats a thread) beside the 64 dQ accumulators make ptxas
// spill. 32 at H = 256: the dQ accumulator is 128 floats a thread, and Q, dO (64 KB each)
// with three K/V buffers of 32 KB fill the 227 KB of shared memory (bwd 115 -> 145
// TFLOP/s against the mma.sync dQ, T = 4096, the dK/dV still mma.sync then; dQ += dS K is
// two 128-column products).
template <int kHeadDim>
struct Sm90DqTraits
    : sm90::QueryTileTraits<kHeadDim, kHeadDim <= 64 ? 128 : (kHeadDim <= 128 ? 64 : 32), 2, 3,
                            true> {};

// One CTA's work (kMaskable: with the per-tile mask decisions and the per-element mask).
// kLengths: with the sequence lengths (rows past the query length: p = 0, dq = 0).
template <typename T, typename Tr, bool kMaskable, bool kSoftcap, bool kLengths = false>
__device__ __forceinline__ void DqSm90Cta(const AttentionParams& p, const LogitScale& ls) {
#if JAXGPU_WGMMA_DEVICE
  constexpr int kD = Tr::kHeadDim, kM = Tr::kBlockM, kN = Tr::kBlockN, kBuf = Tr::kKVBuffers;
  using QTile = typename Tr::QTile;
  using KVTile = typename Tr::KVTile;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = sm90::SwizzleAligned(smem_raw);
  unsigned char* sq = smem;
  unsigned char* sdo = smem + QTile::kBytes;
  unsigned char* skv = smem + Tr::kKVOffset;  // [buffer][K, V]
  int32_t* sq_seg = reinterpret_cast<int32_t*>(smem + Tr::kSegOffset);
  int32_t* skv_seg = sq_seg + kM;               // [buffer][kN]: the buffer's key tile
  int32_t* skv_seg_next = skv_seg + kBuf * kN;  // [buffer][kN]: the tile after it

  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const sm90::QueryRows rows = sm90::MakeQueryRows<kM, kN, kMaskable, kLengths>(p);
  const HeadOffsets& off = rows.off;
  const Mask& mask = rows.mask;
  const int m0 = rows.m0, n_begin = rows.walk.begin, n_end = rows.walk.end;
  const T* k = static_cast<const T*>(p.k) + off.kv;
  const T* v = static_cast<const T*>(p.v) + off.kv;

  float lse2[2], delta[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = rows.warp_row0 + g + 8 * h;
    lse2[h] = RowLse2(row < mask.q_len ? p.lse[off.stats + row] : 0.f, row < mask.q_len);
    delta[h] = row < mask.q_len ? p.delta[off.stats + row] : 0.f;
  }
  float acc_dq[1][kD / 8][4];
  Zero(acc_dq);

  const uint64_t q_desc = sm90::SwizzledDescriptor(sq + 64 * rows.group * 128, 16, 1024);
  const uint64_t do_desc = sm90::SwizzledDescriptor(sdo + 64 * rows.group * 128, 16, 1024);
  const uint64_t k_desc = sm90::SwizzledDescriptor(skv, 16, 1024);
  const uint64_t v_desc = sm90::SwizzledDescriptor(skv + KVTile::kBytes, 16, 1024);
  // K once more as the B operand of dS K: MN-major (head dim contiguous).
  const uint64_t k_desc_mn = sm90::SwizzledDescriptor(skv, KVTile::kBlockBytes, 1024);
  constexpr uint64_t kBufferStep = 2 * KVTile::kBytes / 16;

  auto load_kv = [&](int nb, int buf) {
    unsigned char* dst = skv + 2 * buf * KVTile::kBytes;
    const int row0 = nb * kN;
    sm90::LoadSwizzledAsync<kN, kD, Tr::kThreads>(dst, k + row0 * off.kv_ld, off.kv_ld,
                                                  mask.kv_len - row0, rows.dim);
    sm90::LoadSwizzledAsync<kN, kD, Tr::kThreads>(dst + KVTile::kBytes, v + row0 * off.kv_ld,
                                                  off.kv_ld, mask.kv_len - row0, rows.dim);
    if (rows.segments) {
      LoadRowWordsAsync(skv_seg + buf * kN, mask.kv_seg, row0, mask.kv_len, kN);
      LoadRowWordsAsync(skv_seg_next + buf * kN, mask.kv_seg, row0 + kN, mask.kv_len, kN);
    }
  };
  if (n_begin < n_end) {
    const int64_t first = off.q + m0 * off.q_ld;
    sm90::LoadSwizzledAsync<kM, kD, Tr::kThreads>(sq, static_cast<const T*>(p.q) + first, off.q_ld,
                                                  mask.q_len - m0, rows.dim);
    sm90::LoadSwizzledAsync<kM, kD, Tr::kThreads>(sdo, static_cast<const T*>(p.d_o) + first,
                                                  off.q_ld, mask.q_len - m0, rows.dim);
    if (rows.segments) LoadRowWordsAsync(sq_seg, mask.q_seg, m0, mask.q_len, kM);
    load_kv(n_begin, 0);
    CpAsyncCommit();
  }
  // Pipelined within a warpgroup: tile nb's S and dP are issued together with dQ += dS K of
  // the previous tile, whose product then runs under tile nb's elementwise work. So K_nb
  // is read in iterations nb and nb + 1 while tile nb + 1's copies land: three buffers.
  // A tile the warpgroup skips drains the pending product; after a skip (and on the first
  // tile) the pending product is one of zeros, so that no branch sits between an MMA's
  // issue and its wait (ptxas serializes wgmma there).
  uint32_t ds_frags[kN / 16][1][4];  // dS of the last computed tile, pending its product
  bool pending = false;
  int pending_buf = 0;
  auto finish_pending = [&](uint64_t k_mn) {  // dQ += dS K on its own, waited for
    sm90::Fence();
    sm90::ProductRSWide<T, kD, kN, KVTile::kBlockBytes>(acc_dq[0], ds_frags, k_mn);
    sm90::Commit();
    sm90::Wait<0>();
    sm90::KeepOrder(acc_dq[0]);
  };
  // Segment ranges: of this warpgroup's 64 queries, and of the key tile the loop is at,
  // which each tile reduces for the next one (from skv_seg_next) under its own products.
  // Both are the same in the warpgroup's 4 warps, so its skips need no vote.
  SegmentRange queries_range{0, 0}, tile_range{0, 0};
  if (rows.segments && n_begin < n_end) {
    CpAsyncWait<0>();
    __syncthreads();  // the first group: the query ids and tile n_begin's key ids
    queries_range = WarpSegmentRange(sq_seg + 64 * rows.group, 64, lane);
    tile_range = WarpSegmentRange(skv_seg, kN, lane);
  }
  for (int nb = n_begin; nb < n_end; ++nb) {
    const int n0 = nb * kN;
    const int buf = (nb - n_begin) % kBuf;
    CpAsyncWait<0>();
    sm90::FenceSharedForAsyncProxy();
    __syncthreads();  // tile nb in smem; both warpgroups are done with tile nb - 2's buffer
    if (nb + 1 < n_end) {
      load_kv(nb + 1, (buf + 1) % kBuf);
      CpAsyncCommit();
    }
    const SegmentRange keys_range = tile_range;
    auto reduce_next_range = [&] {
      if (rows.segments) tile_range = WarpSegmentRange(skv_seg_next + buf * kN, kN, lane);
    };
    const TileMasking tm = DecideMaskingInRanges<kMaskable>(
        mask, rows.segments, rows.warp_row0, rows.warp_row1, n0, n0 + kN - 1,
        sq_seg + rows.local_row0, queries_range, skv_seg + buf * kN, keys_range);
    // Both the same for the whole warpgroup.
    const bool compute = !rows.walk.WarpSkips(n0, kN) && !tm.skip;
    const uint64_t pending_k = k_desc_mn + (pending ? pending_buf : buf) * kBufferStep;
    if (compute) {
      // No product pending: a product of zeros instead of a branch. (Zeroing ds_frags
      // where the skip drains them instead makes ptxas serialize every wgmma, C7513.)
      if (!pending) Zero(ds_frags);
      float s[1][kN / 8][4], dp[1][kN / 8][4];
      sm90::Fence();
      sm90::ProductSS<T, kN, kD, QTile::kBlockBytes, KVTile::kBlockBytes>(
          s[0], q_desc, k_desc + buf * kBufferStep, false);
      sm90::ProductSS<T, kN, kD, QTile::kBlockBytes, KVTile::kBlockBytes>(
          dp[0], do_desc, v_desc + buf * kBufferStep, false);
      sm90::Commit();
      sm90::Fence();
      sm90::ProductRSWide<T, kD, kN, KVTile::kBlockBytes>(acc_dq[0], ds_frags, pending_k);
      sm90::Commit();
      reduce_next_range();
      sm90::Wait<1>();  // S and dP ready; the previous tile's dQ product may still run
      sm90::KeepOrder(s[0]);
      sm90::KeepOrder(dp[0]);

      ToLogits<false, kN, kSoftcap>(s[0], ls, mask, tm.masked, rows.warp_row0, n0, tm.RowSeg(0),
                                    tm.col_seg, lane);
#pragma unroll
      for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          ProbsAndGrads<kSoftcap>(s[0][j][e], dp[0][j][e], lse2[e >> 1], delta[e >> 1], ls);
        }
      }
      sm90::Wait<0>();  // the pending product is done with ds_frags
      sm90::KeepOrder(acc_dq[0]);
      PackProbs<T, kN, 1>(ds_frags, dp);
      pending = true;
      pending_buf = buf;
    } else {
      reduce_next_range();
      if (pending) {
        finish_pending(pending_k);
        pending = false;
      }
    }
  }
  // Tile n_end - 1's buffer: no copy overwrites it any more.
  if (pending) finish_pending(k_desc_mn + pending_buf * kBufferStep);
  // Times the softmax scale: dS was taken with respect to the scaled logits.
  T* dq = static_cast<T*>(p.dq) + off.q + m0 * off.q_ld;
  StoreAccumulator<T, kD>(dq, off.q_ld, acc_dq[0], ls.scale, rows.local_row0,
                          (kLengths ? static_cast<int>(p.q_len) : mask.q_len) - m0, 0, rows.dim,
                          lane);
#endif
}

// kRowSplit (with kMaskable; SplitsBySegmentRows): a CTA whose batch row's segment ids are
// all one segment runs the body compiled without the mask.
template <typename T, typename Tr, bool kMaskable, bool kSoftcap, bool kRowSplit,
          bool kLengths = false>
__global__ void __launch_bounds__(Tr::kThreads, 1) DqSm90Kernel(AttentionParams p, LogitScale ls) {
  if constexpr (kRowSplit) {
    if (RowMasksNothing(p, DecodeQueryTile<false>(p, Tr::kBlockM).b)) {
      DqSm90Cta<T, Tr, false, kSoftcap>(p, ls);
      return;
    }
  }
  DqSm90Cta<T, Tr, kMaskable, kSoftcap, kLengths>(p, ls);
}

}  // namespace

// Reads q, k, v, lse, d_o and delta (LaunchDelta, launched before); writes dq.
cudaError_t LaunchDq(const AttentionParams& p, cudaStream_t stream) {
  return Dispatch<Sm90DqTraits, true>(p, [&](auto config) {
    using C = decltype(config);
    return LaunchOverQueryTiles<typename C::Traits>(
        DqSm90Kernel<typename C::T, typename C::Traits, C::kMaskable, C::kSoftcap, C::kRowSplit,
                     C::kLengths>,
        p, stream);
  });
}

}  // namespace jaxgpu::cuda::attention::sm90
