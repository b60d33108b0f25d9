// Attention forward of the wgmma main loop (Hopper's warpgroup MMAs, sm_90a): the same
// parameters as the mma.sync forward (sm80/fwd_sm80.cu), the same masking and softmax code,
// for head dims padded to 64, 128 and 256 (sm90/main_loop.h). LaunchFwd runs the
// warp-specialized forward (fwd_ws_sm90.cu, whose math is this kernel's) wherever it takes
// the call; this kernel runs the rest (sequence lengths) and is its A/B baseline.
//
// One CTA owns kBlockM = 128 queries of one query head: two warpgroups of 64 rows. Per key
// tile of kBlockN keys a warpgroup computes S = Q K^T with Q and K read by the tensor cores
// straight from shared memory (no ldmatrix), runs the online softmax on its registers
// (attention_softmax.cuh), and accumulates O += P V with P from registers and V from
// shared memory. K and V tiles are double-buffered with cp.async (the next tiles' copies
// overlap this tile's math), one CTA barrier per tile. Within a warpgroup the products are
// pipelined (tile i's S with tile i-1's P V, the softmax under P V: see the loop), and the
// two warpgroups interleave on the tensor cores besides.
#include <cuda_runtime.h>

#include <cmath>

#include "attention/attention_launch.cuh"
#include "attention/attention_logits.cuh"
#include "attention/attention_mask.cuh"
#include "attention/attention_schedule.cuh"
#include "attention/attention_softmax.cuh"
#include "attention/sm90/dispatch.cuh"
#include "attention/sm90/fwd_ws_sm90.h"
#include "attention/sm90/main_loop.h"
#include "attention/sm90/query_rows.cuh"
#include "attention/sm90/wgmma.cuh"
#include "common/dev_knobs.h"

namespace jaxgpu::cuda::attention::sm90 {
namespace {

// The softcap's tanh, one tanh.approx.f32 per logit rather than attention_logits.cuh's
// TanhPair (one f16x2 MUFU op per two logits, plus three conversions): after the bounded
// softmax took the row max out of the forward, the MUFU had room and the conversions did
// not. H100, H = 128, T = 4096, same run, builds A / B / A: softcap + segment ids forward
// 383 / 361 / 379 TFLOP/s, softcap alone 377 / 371 / 378. (The backward keeps the pair.)
[[maybe_unused]] constexpr bool kFwdTanhF32 = true;

// Q alone before the K/V buffers; 128-key tiles, 64 at H = 256, where the output
// accumulator is 128 floats a thread: 64-key tiles keep the score tile (32) and P (16)
// beside it within the registers, and K/V buffers at 32 KB each.
template <int kHeadDim>
struct Sm90FwdTraits : sm90::QueryTileTraits<kHeadDim, (kHeadDim > 128 ? 64 : 128), 1> {};

// kBounded (with kSoftcap): the softmax subtracts LogitScale::bound instead of the running
// row max (BoundedSoftmax), so the output accumulator is never rescaled.
// kLengths (with kMaskable): the batch rows' sequence lengths (MakeMask<true>); rows past
// the query length output zeros.
template <typename T, typename Tr, bool kMaskable, bool kSoftcap, bool kBounded,
          bool kLengths = false>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    AttentionFwdSm90Kernel(AttentionParams p, LogitScale ls) {
  static_assert(kSoftcap || !kBounded, "only a softcap bounds the logits");
  static_assert(kMaskable || !kLengths, "lengths mask");
#if JAXGPU_WGMMA_DEVICE
  constexpr int kD = Tr::kHeadDim, kM = Tr::kBlockM, kN = Tr::kBlockN;
  using KVTile = typename Tr::KVTile;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = sm90::SwizzleAligned(smem_raw);
  unsigned char* sq = smem;
  unsigned char* skv = smem + Tr::kKVOffset;  // [buffer][K, V]
  int32_t* sq_seg = reinterpret_cast<int32_t*>(smem + Tr::kSegOffset);
  int32_t* skv_seg = sq_seg + kM;  // [buffer][kN]

  const int lane = threadIdx.x & 31;
  const sm90::QueryRows rows = sm90::MakeQueryRows<kM, kN, kMaskable, kLengths>(p);
  const HeadOffsets& off = rows.off;
  const Mask& mask = rows.mask;
  const int m0 = rows.m0, n_begin = rows.walk.begin, n_end = rows.walk.end;

  const T* q = static_cast<const T*>(p.q) + off.q + m0 * off.q_ld;
  const T* k = static_cast<const T*>(p.k) + off.kv;
  const T* v = static_cast<const T*>(p.v) + off.kv;

  float acc_o[1][kD / 8][4];
  // kBounded: the rows' offset is the bound itself, in the log2 domain (fold 1 below).
  const float max0 = kBounded ? ls.bound : -INFINITY;
  float row_max[1][2] = {{max0, max0}}, row_sum[1][2] = {{0.f, 0.f}};
  Zero(acc_o);

  // Descriptors: Q rows of this warpgroup; K and V of buffer 0 (buffer 1 is KVTile::kBytes
  // * 2 further, in 16-byte units).
  const uint64_t q_desc = sm90::SwizzledDescriptor(sq + 64 * rows.group * 128, 16, 1024);
  const uint64_t k_desc = sm90::SwizzledDescriptor(skv, 16, 1024);
  const uint64_t v_desc = sm90::SwizzledDescriptor(skv + KVTile::kBytes, KVTile::kBlockBytes, 1024);
  constexpr uint64_t kBufferStep = 2 * KVTile::kBytes / 16;

  // Software pipeline within a warpgroup: tile i's S = Q K_i^T and tile i-1's O += P V_{i-1}
  // are issued together, and tile i's softmax runs while the tensor cores finish P V. So V
  // lags K by one tile: the copy group issued in iteration i holds K_{i+1} and V_i, both
  // in the buffers of parity (i+1) & 1 and i & 1 whose previous tiles' products were waited
  // for in iteration i - 1.
  auto load_k = [&](int nb, int buf) {
    const int row0 = nb * kN;
    sm90::LoadSwizzledAsync<kN, kD, Tr::kThreads>(skv + 2 * buf * KVTile::kBytes,
                                                  k + row0 * off.kv_ld, off.kv_ld,
                                                  mask.kv_len - row0, rows.dim);
    if (rows.segments) LoadRowWordsAsync(skv_seg + buf * kN, mask.kv_seg, row0, mask.kv_len, kN);
  };
  auto load_v = [&](int nb, int buf) {
    const int row0 = nb * kN;
    sm90::LoadSwizzledAsync<kN, kD, Tr::kThreads>(skv + (2 * buf + 1) * KVTile::kBytes,
                                                  v + row0 * off.kv_ld, off.kv_ld,
                                                  mask.kv_len - row0, rows.dim);
  };
  // Waits for the copy group of iteration nb (K_nb, V_{nb-1}) and issues the next one.
  auto next_tiles = [&](int nb) {
    const int buf = (nb - n_begin) & 1;
    CpAsyncWait<0>();
    sm90::FenceSharedForAsyncProxy();
    __syncthreads();  // both warpgroups are done with the buffers the copies overwrite
    if (nb + 1 < n_end) load_k(nb + 1, buf ^ 1);
    load_v(nb, buf);
    CpAsyncCommit();
  };
  // S = Q K^T of tile nb (issued and committed, not waited for).
  auto issue_scores = [&](float (&acc_s)[1][kN / 8][4], int nb) {
    sm90::Fence();
    sm90::ProductSS<T, kN, kD, Tr::QTile::kBlockBytes, KVTile::kBlockBytes>(
        acc_s[0], q_desc, k_desc + ((nb - n_begin) & 1) * kBufferStep, false);
    sm90::Commit();
  };
  // Tile nb's softmax. Tiles a warpgroup's rows see nothing of are not skipped but masked
  // whole (DecideMasking finds them not fully visible, or of disjoint segments): a skip
  // would put a branch around the pipelined MMAs, and ptxas serializes wgmma in divergent
  // paths. (Whole CTAs still skip them: TileWalk's begin and end.)
  // `masks`: the tile may hold masked elements. A constant where the loops below call it
  // (false in a maskable kernel for the tiles every row sees whole), so that each inlined
  // copy keeps one side: those tiles run the plain kernel's softmax.
  float correction[1][2];
  auto softmax = [&](float (&acc_s)[1][kN / 8][4], int nb, bool masks) {
    const int n0 = nb * kN;
    TileMasking tm{false, false, nullptr, nullptr};
    if (masks) {
      tm = DecideMasking<kMaskable>(mask, rows.segments, rows.warp_row0, rows.warp_row1, n0,
                                    n0 + kN - 1, sq_seg + rows.local_row0, 16,
                                    skv_seg + ((nb - n_begin) & 1) * kN, kN, lane);
    }
    ToLogits<false, kN, kSoftcap, kFwdTanhF32>(acc_s[0], ls, mask, tm.masked, rows.warp_row0, n0,
                                               tm.RowSeg(0), tm.col_seg, lane);
    if constexpr (kBounded) {
      BoundedSoftmax<kN>(acc_s[0], row_sum[0], ls);
    } else {
      OnlineSoftmax<kN>(acc_s[0], row_max[0], row_sum[0], correction[0], ls.fold);
    }
  };
  uint32_t p_frags[kN / 16][1][4];  // P of the previous tile, pending its product with V

  if (n_begin < n_end) {
    sm90::LoadSwizzledAsync<kM, kD, Tr::kThreads>(sq, q, off.q_ld, mask.q_len - m0, rows.dim);
    if (rows.segments) LoadRowWordsAsync(sq_seg, mask.q_seg, m0, mask.q_len, kM);
    load_k(n_begin, 0);
    CpAsyncCommit();
    {
      float acc_s[1][kN / 8][4];
      next_tiles(n_begin);
      issue_scores(acc_s, n_begin);
      sm90::Wait<0>();
      sm90::KeepOrder(acc_s[0]);
      softmax(acc_s, n_begin, kMaskable);
      PackProbs<T, kN, 1>(p_frags, acc_s);
    }
    auto step = [&](int nb, bool masks) {
      float acc_s[1][kN / 8][4];
      next_tiles(nb);
      issue_scores(acc_s, nb);
      sm90::Fence();  // O += P V of tile nb - 1, overlapping tile nb's softmax
      sm90::ProductRSWide<T, kD, kN, KVTile::kBlockBytes>(
          acc_o[0], p_frags, v_desc + ((nb - 1 - n_begin) & 1) * kBufferStep);
      sm90::Commit();
      sm90::Wait<1>();  // S ready; P V may still run
      sm90::KeepOrder(acc_s[0]);
      softmax(acc_s, nb, masks);
      sm90::Wait<0>();
      sm90::KeepOrder(acc_o[0]);
      if constexpr (!kBounded) RescaleRows<1, kD>(acc_o, correction);
      PackProbs<T, kN, 1>(p_frags, acc_s);
    };
    // A maskable kernel walks its tiles in up to three runs: those a window's left edge
    // cuts, those every row of the CTA sees whole, and those the causal diagonal, a
    // window's right edge or the sequence's end cut. Without segment ids the middle run
    // takes the plain kernel's softmax, in a loop of its own: the maskable loop body costs
    // even where it masks nothing (H100, T = 4096: segment ids that mask nothing ran the
    // forward at 401 TFLOP/s against the plain 430, with the decisions themselves free), and
    // it needs 255 registers where the plain one needs 216. Not at H = 256, whose maskable
    // kernel spilled 552 bytes with the extra loop.
    if constexpr (kMaskable && kD <= 128) {
      int nb = n_begin + 1, full_lo, full_hi;
      mask.FullTileRange(m0, rows.m_last, kN, &full_lo, &full_hi);
      const int clean_lo = min(max(nb, full_lo), n_end);
      const int clean_hi = rows.segments ? clean_lo : max(clean_lo, min(full_hi, n_end));
      for (; nb < clean_lo; ++nb) step(nb, true);
      for (; nb < clean_hi; ++nb) step(nb, false);
      for (; nb < n_end; ++nb) step(nb, true);
    } else {
      for (int nb = n_begin + 1; nb < n_end; ++nb) step(nb, kMaskable);
    }
    CpAsyncWait<0>();
    sm90::FenceSharedForAsyncProxy();
    __syncthreads();  // the last V in smem
    sm90::Fence();
    sm90::ProductRSWide<T, kD, kN, KVTile::kBlockBytes>(
        acc_o[0], p_frags, v_desc + ((n_end - 1 - n_begin) & 1) * kBufferStep);
    sm90::Commit();
    sm90::Wait<0>();
    sm90::KeepOrder(acc_o[0]);
  }

  T* o = static_cast<T*>(p.o) + off.q + m0 * off.q_ld;
  if constexpr (kLengths) {
    // Rows past the batch row's query length: zeros and lse = -inf, stored up to T.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (rows.warp_row0 + (lane >> 2) + 8 * h >= mask.q_len) row_sum[0][h] = 0.f;
    }
  }
  StoreOutputRows<T, 1, kD>(o, p.lse + off.stats + m0, off.q_ld, acc_o, row_max, row_sum,
                            kBounded ? 1.f : ls.fold, rows.local_row0, m0,
                            kLengths ? static_cast<int>(p.q_len) : mask.q_len, rows.dim, lane);
#endif
}

}  // namespace

// Developer knob (a JAXGPU_DEV_KNOBS build): JAXGPU_ATTENTION_FWD_WS=<mode>[,<grid>]:
// mode -1 runs this file's kernel where the warp-specialized one would (the A/B baseline),
// 2 the warp-specialized one with ping-pong; grid 1 forces the persistent stride, 2 the
// dynamic grid, -1 one CTA a tile. 0 or absent: the default schedule.
DevKnob WarpSpecializedByDevKnob() {
  static const DevKnob knob = ReadDevKnob("JAXGPU_ATTENTION_FWD_WS");
  return knob;
}

// The warp-specialized forward (fwd_ws_sm90.cu) wherever it takes the call; this file's
// kernel for the rest (sequence lengths).
cudaError_t LaunchFwd(const AttentionParams& p, cudaStream_t stream) {
  const DevKnob knob = WarpSpecializedByDevKnob();
  if (knob.ints[0] != -1) {  // cudaErrorNotSupported where it cannot take the call
    WsFwdSchedule schedule = DefaultWsFwdSchedule(p);
    if (knob.ints[0] == 2) schedule.ping_pong = true;
    if (knob.ints[1] != 0) {
      schedule.persistent = knob.ints[1] > 0;
      schedule.dynamic = knob.ints[1] == 2;
    }
    // The dynamic grid's counter must hold 0 when the kernel starts; an XLA workspace holds
    // anything.
    if (schedule.dynamic && p.fwd_tile_counter != nullptr) {
      JAXGPU_RETURN_IF_CUDA_ERROR(
          cudaMemsetAsync(p.fwd_tile_counter, 0, kWsFwdWorkspaceBytes, stream));
    }
    const cudaError_t e = LaunchFwdWarpSpecialized(p, schedule, stream, p.fwd_tile_counter);
    if (e != cudaErrorNotSupported) return e;
  }
  const bool bounded = !std::isnan(MakeLogitScale(p.scale, p.softcap, p.dtype).bound);
  return Dispatch<Sm90FwdTraits>(p, [&](auto config) {
    using C = decltype(config);
    return JAXGPU_BOOL_SWITCH(bounded, kBounded, [&] {
      return LaunchOverQueryTiles<typename C::Traits>(
          AttentionFwdSm90Kernel < typename C::T, typename C::Traits, C::kMaskable, C::kSoftcap,
          C::kSoftcap && kBounded, C::kLengths >, p, stream);
    });
  });
}

}  // namespace jaxgpu::cuda::attention::sm90
