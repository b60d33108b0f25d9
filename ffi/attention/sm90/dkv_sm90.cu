// Attention backward's dK and dV in the wgmma main loop (Hopper's warpgroup MMAs, sm_90a):
// the mma.sync DkvKernel's products (sm80/bwd_sm80.cu) with the same determinism, each dK /
// dV element summed by one thread over the GQA group's query heads and the query tiles in
// order.
//
// One CTA owns 128 keys of one kv head: two warpgroups of 64 keys. K and V are loaded once;
// the CTA then walks (query head of the group, 64-query tile; 32 at H = 256) steps, whose
// Q, dO, lse and delta are copied kBuffers - 1 steps ahead. Per step a warpgroup computes,
// with keys as the MMA's rows,
//   S^T = K Q^T and dP^T = V dO^T   (both operands read from shared memory, K-major),
//   P^T and dS^T in registers       (attention_softmax.cuh's ProbsAndGrads, per column),
//   dV += P^T dO and dK += dS^T Q   (P^T, dS^T from registers; dO, Q as MN-major operands),
// so each thread holds its 16 keys' rows of both dV and dK (H floats; at H = 256 the CTA's
// 128-column slice of them) across the loop.
#include <cuda_runtime.h>

#include "attention/attention_launch.cuh"
#include "attention/attention_logits.cuh"
#include "attention/attention_mask.cuh"
#include "attention/attention_schedule.cuh"
#include "attention/attention_softmax.cuh"
#include "attention/sm90/dispatch.cuh"
#include "attention/sm90/main_loop.h"
#include "attention/sm90/wgmma.cuh"

namespace jaxgpu::cuda::attention::sm90 {
namespace {

template <int kHeadDim_>
struct Sm90DkvTraits {
  static constexpr int kHeadDim = kHeadDim_;  // 64, 128 or 256
  static constexpr int kWarpGroups = 2;
  static constexpr int kBlockN = 64 * kWarpGroups;  // keys per CTA
  // At H = 256, dK and dV of 64 keys x 256 columns would be 256 floats a thread: a CTA
  // takes one 128-column slice of them (kSlices CTAs per key tile, each recomputing S and
  // dP over the whole head dim), and 32-query steps, so that K, V (64 KB each) and three
  // Q/dO buffers (32 KB each) fit the 227 KB of shared memory. Against the mma.sync dK/dV
  // (which slices too), even with S and dP computed twice: H100, T = 4096, the dQ on wgmma
  // in both, bwd 145 -> 255 TFLOP/s.
  static constexpr int kBlockM = kHeadDim <= 128 ? 64 : 32;  // queries per step
  static constexpr int kSlices = kHeadDim <= 128 ? 1 : 2;
  static constexpr int kThreads = 128 * kWarpGroups;
  // Q/dO buffers: the copies of the next kBuffers - 1 steps run under this step's products.
  static constexpr int kBuffers = 3;
  using KVTile = sm90::SwizzledTile<kBlockN, kHeadDim>;
  using QTile = sm90::SwizzledTile<kBlockM, kHeadDim>;
  // K, V, then kBuffers x (Q, dO), then the StepWords; plus the 1024-byte swizzle alignment.
  using Words = StepWords<kBlockN, kBlockM, true>;
  static constexpr int kQOffset = 2 * KVTile::kBytes;
  static constexpr int kWordOffset = kQOffset + 2 * kBuffers * QTile::kBytes;
  static constexpr int kSmemBytes = kWordOffset + Words::Bytes(kBuffers) + 1024;
  static_assert(kSmemBytes <= sm90::kMaxSmemBytes, "shared memory");
};

// One CTA's work (kMaskable: with the per-tile mask decisions and the per-element mask).
// kLengths: with the sequence lengths (MakeMask<true>: keys past the key length get
// dK = dV = 0, queries past the query length add nothing).
template <typename T, typename Tr, bool kMaskable, bool kSoftcap, bool kLengths = false>
__device__ __forceinline__ void DkvSm90Cta(const AttentionParams& p, const LogitScale& ls) {
#if JAXGPU_WGMMA_DEVICE
  constexpr int kD = Tr::kHeadDim, kM = Tr::kBlockM, kN = Tr::kBlockN, kBuf = Tr::kBuffers;
  constexpr int kAcc = kD / Tr::kSlices;  // the dK / dV columns of this CTA
  using KVTile = typename Tr::KVTile;
  using QTile = typename Tr::QTile;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = sm90::SwizzleAligned(smem_raw);
  unsigned char* sk = smem;
  unsigned char* sv = smem + KVTile::kBytes;
  unsigned char* sqdo = smem + Tr::kQOffset;  // [buffer][Q, dO]
  const typename Tr::Words words{reinterpret_cast<int32_t*>(smem + Tr::kWordOffset)};
  int32_t* skv_seg = words.kv_seg;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int t = lane & 3;
  // Read through a shuffle so that ptxas knows the warpgroup is warp-uniform (C7518).
  const int group = __shfl_sync(0xffffffffu, warp >> 2, 0);
  const int local_key0 = 64 * group + 16 * (warp & 3);  // the warp's first key in the tile

  const int n_blocks = (static_cast<int>(p.kv_len) + kN - 1) / kN;
  const int slice = blockIdx.x % Tr::kSlices;
  const KeyTile tile = DecodeKeyTile<kMaskable>(p, blockIdx.x / Tr::kSlices, n_blocks);
  const Mask mask = MakeMask<kLengths>(p, tile.b);
  const bool segments = kMaskable && mask.q_seg != nullptr;
  const int H = static_cast<int>(p.head_dim);
  const int n0 = tile.n_block * kN;
  const int n_last = min(n0 + kN, mask.kv_len) - 1;
  const int group_key0 = n0 + 64 * group;
  const int warp_key0 = n0 + local_key0;
  const HeadOffsets off0 = MakeHeadOffsets(p, tile.b, tile.kh, 0);
  const T* q = static_cast<const T*>(p.q);
  const T* d_o = static_cast<const T*>(p.d_o);

  float acc_dv[1][kAcc / 8][4], acc_dk[1][kAcc / 8][4];
  Zero(acc_dv);
  Zero(acc_dk);

  // The query tiles the CTA walks, and the span this warpgroup's keys see (its skips are
  // whole-warpgroup decisions: wgmma runs on all 4 warps together).
  const TileWalk walk = MakeTileWalk<false, kLengths>(mask, n0, n_last, group_key0,
                                                      min(group_key0 + 64, mask.kv_len) - 1, kM);
  const int m_begin = walk.begin, m_count = walk.end - walk.begin;
  const int steps = m_count * static_cast<int>(p.group);  // (query head r, query tile) pairs

  // Descriptors: this warpgroup's rows of K and V (K-major A operands); Q and dO of buffer
  // 0 as K-major B operands of S^T and dP^T, and as MN-major B operands of dK and dV.
  const uint64_t k_desc = sm90::SwizzledDescriptor(sk + 64 * group * 128, 16, 1024);
  const uint64_t v_desc = sm90::SwizzledDescriptor(sv + 64 * group * 128, 16, 1024);
  const uint64_t q_desc = sm90::SwizzledDescriptor(sqdo, 16, 1024);
  const uint64_t do_desc = sm90::SwizzledDescriptor(sqdo + QTile::kBytes, 16, 1024);
  // The MN-major ones start at this CTA's slice: kAcc / 64 column blocks in.
  const int slice_bytes = slice * (kAcc / 64) * QTile::kBlockBytes;
  const uint64_t q_desc_mn = sm90::SwizzledDescriptor(sqdo + slice_bytes, QTile::kBlockBytes, 1024);
  const uint64_t do_desc_mn =
      sm90::SwizzledDescriptor(sqdo + QTile::kBytes + slice_bytes, QTile::kBlockBytes, 1024);
  constexpr uint64_t kBufferStep = 2 * QTile::kBytes / 16;

  using StepCursor = GroupStepCursor<kBuf>;
  auto load_step = [&](const StepCursor& c) {
    const int64_t head = off0.q + c.r * p.head_dim;
    const int64_t stats = off0.stats + c.r * p.q_len;
    const int m0 = (m_begin + c.tile) * kM;
    const int m0_next = (m_begin + c.NextTile(m_count)) * kM;
    unsigned char* dst = sqdo + 2 * c.buf * QTile::kBytes;
    sm90::LoadSwizzledAsync<kM, kD, Tr::kThreads>(dst, q + head + m0 * off0.q_ld, off0.q_ld,
                                                  mask.q_len - m0, H);
    sm90::LoadSwizzledAsync<kM, kD, Tr::kThreads>(dst + QTile::kBytes, d_o + head + m0 * off0.q_ld,
                                                  off0.q_ld, mask.q_len - m0, H);
    words.LoadStep(c.buf, p, mask, segments, stats, m0, m0_next);
  };
  // One copy group per step (empty past the last step), so that "step i's copies are done"
  // is always CpAsyncWait<kBuf - 2>.
  StepCursor next_load;
  int loaded = 0;
  auto load_next = [&] {
    if (loaded < steps) {
      load_step(next_load);
      next_load.Next(m_count);
      ++loaded;
    }
    CpAsyncCommit();
  };
  if (steps > 0) {
    const T* k = static_cast<const T*>(p.k) + off0.kv + n0 * off0.kv_ld;
    const T* v = static_cast<const T*>(p.v) + off0.kv + n0 * off0.kv_ld;
    sm90::LoadSwizzledAsync<kN, kD, Tr::kThreads>(sk, k, off0.kv_ld, mask.kv_len - n0, H);
    sm90::LoadSwizzledAsync<kN, kD, Tr::kThreads>(sv, v, off0.kv_ld, mask.kv_len - n0, H);
    if (segments) LoadRowWordsAsync(skv_seg, mask.kv_seg, n0, mask.kv_len, kN);
    for (int i = 0; i < kBuf - 1; ++i) load_next();  // K, V go with step 0's group
  }
  // Segment ranges: of this warpgroup's 64 keys, and of the queries of the step the loop is
  // at, which each step reduces for the next one (from NextQSeg) under its own products.
  // Both are the same in the warpgroup's 4 warps, so its skips need no vote.
  SegmentRange keys_range{0, 0}, step_range{0, 0};
  if (segments && steps > 0) {
    CpAsyncWait<kBuf - 2>();
    __syncthreads();  // step 0's group, with the keys' ids
    keys_range = WarpSegmentRange(skv_seg + 64 * group, 64, lane);
    step_range = WarpSegmentRange(words.QSeg(0), kM, lane);
  }
  StepCursor cur;
  for (int i = 0; i < steps; ++i) {
    CpAsyncWait<kBuf - 2>();
    sm90::FenceSharedForAsyncProxy();
    // Step i's tiles in smem; every warpgroup is done with step i - 1's buffer, which the
    // copies of step i + kBuf - 1 now overwrite.
    __syncthreads();
    load_next();
    const int m0 = (m_begin + cur.tile) * kM;
    const int buf = cur.buf;
    cur.Next(m_count);
    const SegmentRange queries_range = step_range;
    auto reduce_next_range = [&] {
      if (segments) step_range = WarpSegmentRange(words.NextQSeg(buf), kM, lane);
    };
    const TileMasking tm = DecideMaskingInRanges<kMaskable>(
        mask, segments, m0, min(m0 + kM, mask.q_len) - 1, warp_key0, warp_key0 + 15,
        skv_seg + local_key0, keys_range, words.QSeg(buf), queries_range);
    if (walk.WarpSkips(m0, kM) || tm.skip) {  // both the same for the whole warpgroup
      reduce_next_range();
      continue;
    }

    float s[1][kM / 8][4], dp[1][kM / 8][4];
    sm90::Fence();
    sm90::ProductSS<T, kM, kD, KVTile::kBlockBytes, QTile::kBlockBytes>(
        s[0], k_desc, q_desc + buf * kBufferStep, false);
    sm90::ProductSS<T, kM, kD, KVTile::kBlockBytes, QTile::kBlockBytes>(
        dp[0], v_desc, do_desc + buf * kBufferStep, false);
    sm90::Commit();
    reduce_next_range();
    sm90::Wait<0>();
    sm90::KeepOrder(s[0]);
    sm90::KeepOrder(dp[0]);

    // The step in parts of kPart = 16 queries: each part's elementwise work runs while the
    // tensor cores take the previous parts' dV and dK products (the same accumulators:
    // same-shape MMAs on them are ordered without a wait), where the whole step's products
    // used to wait for all of its elementwise work. H100, T = 4096, backward TFLOP/s, one
    // part -> two: H128 plain 377 -> 381, softcap 331 -> 343, H64 291 -> 301, H256 causal
    // 225 -> 234. Four parts of 16 queries (two at H = 256, whose steps are 32 queries)
    // against two, same H100, bwd TFLOP/s, 3 interleaved rounds: plain 377 -> 386, softcap
    // 342 -> 347, segment ids 355 -> 360, options 321 -> 327; H128 kernels 230-244
    // registers, no spill.
    constexpr int kParts = kM / 16 < 4 ? kM / 16 : 4;
    constexpr int kPart = kM / kParts;
    uint32_t p_frags[kParts][kPart / 16][1][4], ds_frags[kParts][kPart / 16][1][4];
    auto part = [&](int h) {  // h is a constant where inlined
      const int c0 = h * kPart;
      auto& sh = *reinterpret_cast<float (*)[1][kPart / 8][4]>(&s[0][h * (kPart / 8)]);
      auto& dph = *reinterpret_cast<float (*)[1][kPart / 8][4]>(&dp[0][h * (kPart / 8)]);
      ToLogits<true, kPart, kSoftcap>(sh[0], ls, mask, tm.masked, warp_key0, m0 + c0, tm.RowSeg(0),
                                      tm.col_seg ? tm.col_seg + c0 : nullptr, lane);
      // Column (query) statistics of columns c0 + 8 j + 2 t + c; queries past T get lse =
      // +inf (p = 0; their Q and dO rows are zeros anyway).
#pragma unroll
      for (int j = 0; j < kPart / 8; ++j) {
        const int col = c0 + 8 * j + 2 * t;
        const float2 lse = *reinterpret_cast<const float2*>(words.Lse(buf) + col);
        const float2 delta = *reinterpret_cast<const float2*>(words.Delta(buf) + col);
        const float lse2[2] = {RowLse2(lse.x, m0 + col < mask.q_len),
                               RowLse2(lse.y, m0 + col + 1 < mask.q_len)};
        const float dl[2] = {delta.x, delta.y};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          ProbsAndGrads<kSoftcap>(sh[0][j][e], dph[0][j][e], lse2[e & 1], dl[e & 1], ls);
        }
      }
      PackProbs<T, kPart, 1>(p_frags[h], sh);
      PackProbs<T, kPart, 1>(ds_frags[h], dph);
      // dO and Q rows c0.. of the MN-major operands: 128-byte rows, 8 descriptor units each.
      const uint64_t rows = static_cast<uint64_t>(c0) * 8;
      sm90::Fence();
      sm90::ProductRS<T, kAcc, kPart>(acc_dv[0], p_frags[h], do_desc_mn + buf * kBufferStep + rows);
      sm90::ProductRS<T, kAcc, kPart>(acc_dk[0], ds_frags[h], q_desc_mn + buf * kBufferStep + rows);
      sm90::Commit();
    };
#pragma unroll
    for (int h = 0; h < kParts; ++h) part(h);
    sm90::Wait<0>();
    sm90::KeepOrder(acc_dv[0]);
    sm90::KeepOrder(acc_dk[0]);
  }
  CpAsyncWait<0>();  // no copy outlives the CTA
  // dK times the softmax scale: dS was taken with respect to the scaled logits.
  const int64_t out = off0.kv + n0 * off0.kv_ld;
  const int col0 = slice * kAcc;
  const int keys = (kLengths ? static_cast<int>(p.kv_len) : mask.kv_len) - n0;
  StoreAccumulator<T, kAcc>(static_cast<T*>(p.dv) + out, off0.kv_ld, acc_dv[0], 1.f, local_key0,
                            keys, col0, H, lane);
  StoreAccumulator<T, kAcc>(static_cast<T*>(p.dk) + out, off0.kv_ld, acc_dk[0], ls.scale,
                            local_key0, keys, col0, H, lane);
#endif
}

// kRowSplit (with kMaskable; SplitsBySegmentRows): a CTA whose batch row's segment ids are
// all one segment runs the body compiled without the mask.
template <typename T, typename Tr, bool kMaskable, bool kSoftcap, bool kRowSplit,
          bool kLengths = false>
__global__ void __launch_bounds__(Tr::kThreads, 1) DkvSm90Kernel(AttentionParams p, LogitScale ls) {
  if constexpr (kRowSplit) {
    const int n_blocks = static_cast<int>(CeilDiv(p.kv_len, Tr::kBlockN));
    if (RowMasksNothing(p, DecodeKeyTile<false>(p, blockIdx.x / Tr::kSlices, n_blocks).b)) {
      DkvSm90Cta<T, Tr, false, kSoftcap>(p, ls);
      return;
    }
  }
  DkvSm90Cta<T, Tr, kMaskable, kSoftcap, kLengths>(p, ls);
}

}  // namespace

// Reads q, k, v, lse, d_o and delta (LaunchDelta, launched before); writes dk, dv.
cudaError_t LaunchDkv(const AttentionParams& p, cudaStream_t stream) {
  return Dispatch<Sm90DkvTraits, true>(p, [&](auto config) {
    using C = decltype(config);
    return LaunchOverKeyTiles<typename C::Traits>(
        DkvSm90Kernel<typename C::T, typename C::Traits, C::kMaskable, C::kSoftcap, C::kRowSplit,
                      C::kLengths>,
        p, stream);
  });
}

}  // namespace jaxgpu::cuda::attention::sm90
