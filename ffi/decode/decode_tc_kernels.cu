// The tensor-core split kernel of paged attention: a 16-bit query (bf16 or f16) over a
// 16-bit cache of the same type or an 8-bit one (int8 or e4m3 with per-token scales).
//
// Why tensor cores. Decode reads each cached byte once, so the kernel must stream K/V at
// the copy rate (~3 TB/s on an H100) while doing 2 x (Tq x N/K) multiply-adds per cached
// value for the logits and as many for P V. The CUDA-core kernel (decode_kernels.cu)
// reduced each logit across lanes with shuffles; measured on the H100 (bf16, GQA 32/8,
// H 128, B 8, L 32k) it read 0.62 TB/s at Tq = 1 and 0.20 TB/s at Tq = 8: issue-bound. Here
// a warp computes a 16-row x 16-key logit tile with H/16 mma.sync m16n8k16 pairs and its
// P V with H/8 more, so the math per byte is a few instructions at any Tq x N/K <= 32.
//
// Mapping. A block (4 warps) owns one (group, row, kv head), one split of the row's keys,
// and 16 x kMT query rows of that kv head (the Tq new tokens times the N/K query heads,
// zero-padded to 16 per m-tile). The keys stream through a kStages ring of shared-memory
// tiles of kKeys = 64 keys, and warp w takes keys [16w, 16w + 16) of each tile with its own
// online softmax (FlashAttention-2's, in registers: A/C fragment layouts as the attention
// kernels'); the 4 warps' states are merged through shared memory at the end. Tiles start
// at multiples of 64 keys, so a split's range is whole tiles (the first masked below the
// window, the last at the row's length).
//
// The ring's copies. A 16-bit cache on sm_90a: the Tensor Memory Accelerator, one box of
// 64 head dims x up to 64 slots of one page a copy (tensor maps over the pools), completing
// on an mbarrier a stage (kTma). Otherwise, and for short splits at H 256: cp.async, 16-byte
// chunks, one table lookup per key. On the H200 (bf16, 32/8, H 128, Tq 1, B 8 L 32k) the
// cp.async ring read 3.2 TB/s, the copy engine's 3.8 (89% of the measured copy rate), where
// cuDNN's decode reads ~4.2: a warp's 16-byte copies keep too few bytes in flight an SM.
// Where measured faster (kCountedFor) that ring is paced without a barrier a tile, and
// 8-bit caches at H 128 and 256 with one m-tile go through it too (int8 32/8 H 128 Tq 1 B 8
// L 32k: 239 -> 228 us; e4m3 231 -> 216).
//
// 8-bit cache. The raw tile (half the bytes) lands in the ring (16-byte chunks swizzled
// within each key row, see SwizzleK / SwizzleV), and each thread widens its own fragments
// in registers: int8 and e4m3 values are exact in half (one or two instructions a pair),
// and the products run in half whatever the query's type (a bf16 query is scaled by a
// power of two into half's range, exact but for components under 2^-14 of its largest, and
// the logits scaled back; half keeps the probabilities to 11 bits where bf16 would keep 8).
// To make each thread's fragment bytes contiguous, the mma's k index is permuted: a dot
// product is invariant to the order of its terms, so for Q K^T thread quad c takes head
// dims [c H/4, (c + 1) H/4) (the query's shared tile is stored in the same permuted order,
// QColumn8), and for P V the keys of an S column and the head dims of an output column are
// permuted (ColumnKey8, OutputColumn8) so that a thread reads one V word of 4 head dims from
// each of 4 consecutive keys and transposes the bytes with byte_perm. Measured on the H100
// (int8, 32/8, H 128, B 8, L 32k): widening into a second shared tile and reading it back
// by ldmatrix ran at 1.53 TB/s, 8 warps an SM (shared memory), 47.7% of DRAM's peak.
// The per-token scales never touch the values: a key's K scale multiplies its logit, and
// its V scale its probability before P V (the softmax sums use the unscaled probability),
// one multiply per key and row instead of one per value.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "attention/attention_copy.cuh"
#include "attention/attention_fragments.cuh"
#include "attention/sm80/mma.cuh"
#include "attention/sm90/tma.cuh"
#include "common/cuda_dispatch.cuh"
#include "common/cuda_utils.cuh"
#include "common/dev_knobs.h"
#include "decode/decode_slot.cuh"
#include "decode/decode_split.cuh"
#include "decode/decode_tc_fragments.cuh"

namespace jaxgpu::cuda::decode {
namespace {

namespace att = ::jaxgpu::cuda::attention;
namespace sm80 = ::jaxgpu::cuda::attention::sm80;
namespace sm90 = ::jaxgpu::cuda::attention::sm90;

constexpr int kThreads = 128;          // per head-dim slice (kSplitH slices a block)
constexpr int kWarps = kThreads / 32;  // key groups: warp w % kWarps takes 16 keys a tile
// Values per copied chunk: 16 bytes (8 of 16-bit, 16 of 8-bit; an 8-bit row whose H is
// not a multiple of 16 copies each chunk as two 8-byte halves, its rows being 8-aligned).
template <typename KV>
constexpr int kChunkValues = 16 / int(sizeof(KV));

template <typename KV>
constexpr bool kIs8Bit = sizeof(KV) == 1;

// Tiles in flight: 3 (2 being copied while one is used); an 8-bit cache with 32 rows takes
// 4, so that the merge's float states fit over the ring.
template <typename KV, int kMT>
constexpr int kStagesFor = kIs8Bit<KV> && kMT == 2 ? 4 : 3;

// Blocks an SM: 2 (a 16-bit tile ring is 2 x 35 KB at H 128); an 8-bit ring at H <= 128 with
// 16 rows is 48 KB, and 4 blocks keep 16 warps an SM to hide the widening's latency.
template <typename KV, int kHD, int kMT>
constexpr int kMinBlocksFor = kIs8Bit<KV> && kHD <= 128 && kMT == 1 ? 4 : 2;

// Head-dim slices of a block: at H 256 each key group's work is split over 2 or 4 warps
// (head dims [0, 128) and [128, 256), or quarters, of the products; the slices' partial
// logits added through shared memory). Its 64-key ring is 203 KB, one block an SM: with 4
// warps the SM ran one warp a scheduler, and measured on the H100 (32/8, B 8, L 32k, Tq 1)
// read 2.42 TB/s where H 128 (8 warps an SM) read 2.67; with 2 slices, 2.80. They also halve
// the accumulators, so that 32 query rows fit one block (kMT = 2) and Tq = 8 reads the cache
// once, not twice (1.25 -> 2.25 TB/s at Tq 8). A 16-bit cache with one m-tile takes 4 slices
// (16 warps an SM, 108 registers): on the H200 (tools/decode_check, bf16, Tq 1; 2 -> 4
// slices) 32/8 B 8 L 32k 844 -> 781 us, 8/4 B 64 L 4k 426 -> 399 us, 8/4 B 8 L 4k 68 -> 66
// us, the B 1 calls within 0.2 us. An 8-bit cache at H 256 (a 96 KB ring) runs 2 blocks of 2
// slices an SM. The copy engine's ring (kTma) at one m-tile runs 2 slices on the counted
// ring (kCountedFor), which measured faster than 4 on the barrier ring (H200, decode_check,
// 32/8 B 8 L 32k Tq 1: 789 -> 729 us). -DJAXGPU_DECODE_H256_SLICES and _H256_TMA_SLICES
// (2 or 4) build the other counts for such A/B timings.
#ifndef JAXGPU_DECODE_H256_SLICES
#define JAXGPU_DECODE_H256_SLICES 4
#endif
#ifndef JAXGPU_DECODE_H256_TMA_SLICES
#define JAXGPU_DECODE_H256_TMA_SLICES 2
#endif
template <typename KV, int kHD, int kMT, bool kTma>
constexpr int kSplitHFor = kHD != 256                ? 1
                           : kIs8Bit<KV> || kMT != 1 ? 2
                           : kTma                    ? JAXGPU_DECODE_H256_TMA_SLICES
                                                     : JAXGPU_DECODE_H256_SLICES;

template <typename KV, int kHD, int kMT, int kSplitH>
constexpr int kBlocksFor =
    kSplitH == 1 ? kMinBlocksFor<KV, kHD, kMT> : (kIs8Bit<KV> && kMT == 1 ? 2 : 1);

// Which instances pace the copy engine's ring by counting (see PagedAttentionTcKernel)
// instead of a __syncthreads a tile: measured on the H200 (tools/check_ab.sh decode,
// tools/decode_check, bf16 unless said, us, barrier ring -> counted, two rounds alike):
//   one m-tile, one slice (H <= 128, Tq x N/K <= 16): 32/8 H128 Tq 1 B 8 L 32k 289 -> 283,
//     B 64 2168 -> 2121, L 128k 1096 -> 1074, 8/1 B 64 296 -> 285;
//   two m-tiles, one slice (H <= 128, 32 rows): 32/8 H128 Tq 8 B 8 354 -> 364, B 64 2601 ->
//     2659 (slower: kept on the barrier ring);
//   four slices (H 256, one m-tile; JAXGPU_DECODE_H256_TMA_SLICES=4): 32/8 H256 Tq 1 B 8
//     792 -> 824 (slower: kept on the barrier ring);
//   two slices (H 256, two m-tiles): Tq 8 B 8 922 -> 900; one m-tile, the default, see
//     kSplitHFor.
// The 8-bit caches' copy-engine ring is built on the counted one only (kTma8Takes).
// -DJAXGPU_DECODE_COUNTED_RING=0 builds every instance on the barrier ring, 1 every one on
// the counted ring, for such A/B timings; unset, the measured choice above.
#ifndef JAXGPU_DECODE_COUNTED_RING
#define JAXGPU_DECODE_COUNTED_RING -1
#endif
template <int kMT, int kSplitH>
constexpr bool kCountedFor =
    JAXGPU_DECODE_COUNTED_RING >= 0 ? JAXGPU_DECODE_COUNTED_RING != 0
                                    : (kSplitH == 1 && kMT == 1) || kSplitH == 2;

// The 8-bit caches' copy-engine ring (counted ring only): a key row of a slice is 128 bytes,
// one row of the engine's 128-byte swizzle, under which the fragment reads below (keys in
// the mma's natural order) hit distinct banks; with 16 rows (one m-tile) its flags and
// scales live in registers, and 4 blocks an SM still fit at H 128 (55 KB a block).
template <typename KV, int kHD, int kMT>
constexpr bool kTma8Takes =
    kIs8Bit<KV> && kHD >= 128 && kMT == 1 && kCountedFor<kMT, kSplitHFor<KV, kHD, kMT, true>>;

// Shared memory of one block, in bytes from the dynamic base (all offsets 16-aligned):
//   q       (16 kMT, kHD + 8) M          the query rows, padded rows (sm80::SmemTile)
//   ring    kStages x {K, V}             (kKeys, kHD + 8) T, or (kKeys, kHD) KV raw
//   ok      kStages x kKeys int32        1 where the key is in the split and its page valid
//                                        (none in the counted ring: its warps keep a mask)
//   scale   kStages x {K, V} x kKeys f32 8-bit caches by cp.async only
//   swap    parts x (kWarps, 8 kMT, 32)  f32, head-dim slices only: the logit tiles handed
//                                        over (1 part with 2 slices, 4 with 4)
// After the loop the ring (and what follows it) holds the warps' states for the merge.
template <typename T, typename KV, int kHD, int kMT, int kSplitH, bool kTma = false>
struct Layout {
  static constexpr int kStages = kStagesFor<KV, kMT>;
  static constexpr int kRows = 16 * kMT;
  static constexpr int kStride = sm80::SmemTile<kHD>::kStride;
  // Bytes of a K or V tile: 8-bit raw rows; 16-bit padded rows (cp.async), or with kTma the
  // copy engine's 128-byte-swizzled layout (kHD x sizeof(KV) / 128 column blocks of 64 rows
  // x 128 bytes, each 1024-byte aligned: the ring starts at a multiple of 1024 from an
  // aligned base).
  static constexpr int kRawTile =
      kIs8Bit<KV> ? kKeys * kHD : (kTma ? kKeys * kHD * 2 : kKeys * kStride * 2);
  static constexpr int kQ = 0;
  static constexpr int kRing =
      kTma ? (kQ + kRows * kStride * 2 + 1023) / 1024 * 1024 : kQ + kRows * kStride * 2;
  static constexpr int kStageBytes = 2 * kRawTile;
  // The counted ring (see kCountedFor) keeps its keys' flags (and an 8-bit cache's
  // scales) in registers.
  static constexpr bool kCounted = kTma && kCountedFor<kMT, kSplitH>;
  static constexpr bool kFlagsInSmem = !kCounted;
  static constexpr int kOk = kRing + kStages * kStageBytes;
  static constexpr int kScale = kOk + (kFlagsInSmem ? kStages * kKeys * 4 : 0);
  static constexpr int kSwap = kScale + (kIs8Bit<KV> && kFlagsInSmem ? kStages * 2 * kKeys * 4 : 0);
  // Two slices hand one part over (slice 1's), four hand all four.
  static constexpr int kSwapParts = kSplitH == 1 ? 0 : (kSplitH == 2 ? 1 : kSplitH);
  static constexpr int kUsed = kSwap + kSwapParts * kWarps * 8 * kMT * 32 * 4;
  // kTma: 1024 bytes more, to align the dynamic base (the kernel rounds it up).
  static constexpr int kBytes = kUsed + (kTma ? 1024 : 0);
  // The merge: o (kWarps, kRows, kHD) then m and l (kWarps, kRows) float32, from the ring on.
  static constexpr int kMergeBytes = kWarps * kRows * (kHD + 2) * 4;
  static_assert(kMergeBytes <= kUsed - kRing, "the merge fits over the tiles");
  static_assert(kBytes <= 227 * 1024, "a block's shared memory fits an SM");
};

// paged_attention_with_update: row r's Tq new tokens of kv head kvh written to their slots
// (positions len - Tq + t; a position outside [0, M x S) or on a page entry outside [0, P)
// is skipped, as paged_kv_update skips it), in 16-byte vectors by the block's threads. One
// block per (row, kv head) writes: the last split's (row tile 0), which has the fewest
// tiles, often none (the tiles divided over the splits round up). No block reads these
// slots: the readers of a new token take it from k_new / v_new.
template <typename KV>
__device__ __forceinline__ void AppendNewTokens(const PagedAttentionParams& p, int64_t r,
                                                int64_t kvh, int64_t pool_base, int64_t len,
                                                int threads) {
  const int vecs = int(p.head_dim) * int(sizeof(KV)) / 16;  // H is a multiple of 8
  const int64_t token_stride = p.kv_heads * p.head_dim;
  for (int i = threadIdx.x; i < 2 * int(p.q_len) * vecs; i += threads) {
    const int t = i / (2 * vecs), rest = i % (2 * vecs);
    const bool is_v = rest >= vecs;
    const int vec = is_v ? rest - vecs : rest;
    const int64_t slot = PoolSlot(len - p.q_len + t, p.block_table + r * p.max_pages, p.max_pages,
                                  p.page_size, p.num_pages, pool_base);
    if (slot < 0) continue;
    const int64_t src = ((r * p.q_len + t) * token_stride + kvh * p.head_dim) * int64_t(sizeof(KV));
    const int64_t dst = (slot * token_stride + kvh * p.head_dim) * int64_t(sizeof(KV));
    const char* from = static_cast<const char*>(is_v ? p.v_new : p.k_new) + src;
    char* to = static_cast<char*>(is_v ? p.v_pages_out : p.k_pages_out) + dst;
    reinterpret_cast<uint4*>(to)[vec] = reinterpret_cast<const uint4*>(from)[vec];
  }
}

// kTma (16-bit caches on sm_90a): the K and V tiles arrive by the copy engine (tensor maps
// over the pools as (pages, page_size, K, H), boxes of 64 head dims x box_rows slots of one
// page and kv head) into a ring of kStages tiles with an mbarrier a stage, issued by
// lanes of warp 0 after a __syncthreads a tile (kStages - 1 tiles in flight).
// The counted ring (kCounted, see kCountedFor) has no barrier a tile: a warp
// waits only for its own stage to land, and when done with the stage counts itself out (a
// shared counter a stage); the warp that counts last, having seen every other warp's
// release, issues the stage's next tile, so all kStages tiles are in flight. Why: the
// __syncthreads a tile (the warps waiting for the slowest, the next copy issued after it)
// is the top stall on the H200 (Nsight Compute, 32/8 H 128 Tq 1 B 8 L 32k: 2.53 cycles an
// issued instruction at a barrier, 0.34 eligible warps a scheduler, DRAM at 80.5% of its
// peak). A producer warp of its own would cost the 32-row instances registers: 10 warps an
// SM leave 3 on a scheduler, so 168 registers each (ptxas), and those spilled.
template <typename T, typename KV, int kHD, int kMT, int kSplitH, bool kTma>
__global__ void __launch_bounds__(kThreads* kSplitH, (kBlocksFor<KV, kHD, kMT, kSplitH>))
    PagedAttentionTcKernel(const PagedAttentionParams p, int64_t rows_per_kv, int row_tiles,
                           const __grid_constant__ CUtensorMap k_map,
                           const __grid_constant__ CUtensorMap v_map, int box_rows) {
  static_assert(!kTma || !kIs8Bit<KV> || kTma8Takes<KV, kHD, kMT>,
                "the copy-engine ring over an 8-bit cache: counted ring, H >= 128, one m-tile");
  using L = Layout<T, KV, kHD, kMT, kSplitH, kTma>;
  constexpr bool kCounted = L::kCounted;
  constexpr bool kTma8 = kTma && kIs8Bit<KV>;  // keys in natural order, flags in registers
  constexpr int kBlockThreads = kThreads * kSplitH;
  constexpr int kSlice = kHD / kSplitH;  // head dims of a warp's products
  // The products' type: the query's, or half over an 8-bit cache (see WidenPair; the
  // query is scaled by a power of two into half's range, exactly but for components below
  // half's normal range, 2^-14 of the largest).
  using M = std::conditional_t<kIs8Bit<KV>, __half, T>;
  constexpr int kRows = L::kRows;
  constexpr int kStride = L::kStride;
  constexpr int kStages = L::kStages;
  constexpr int kValues = kChunkValues<KV>;
  constexpr int kChunks = kHD / kValues;          // chunks per key row: 4 to 32
  constexpr int kStep = kBlockThreads / kChunks;  // keys a pass of the block copies
  const bool halves = kIs8Bit<KV> && p.head_dim % 16 != 0;
  extern __shared__ __align__(16) unsigned char smem_base[];
  // kTma: the swizzled tiles need a 1024-byte aligned base (L::kBytes has the slack).
  unsigned char* const smem =
      kTma ? smem_base + ((1024u - (att::SmemAddress(smem_base) & 1023u)) & 1023u) : smem_base;
  __shared__ __align__(8) uint64_t s_full[kTma ? kStages : 1];  // kTma: a stage's tiles landed
  // kCounted: warps done with a stage, over all its tiles so far (tile it's last warp
  // counts up to (it / kStages + 1) x the block's warps).
  __shared__ int32_t s_released[kCounted ? kStages : 1];
  M* s_q = reinterpret_cast<M*>(smem + L::kQ);
  __shared__ uint32_t s_qmax;  // the largest |q| of the block's rows, as float bits
  int32_t* s_ok = reinterpret_cast<int32_t*>(smem + L::kOk);
  float* s_scale = reinterpret_cast<float*>(smem + L::kScale);

  // 32-bit index math (the grid, splits, kv heads and batch are all below 2^31): a small
  // call is issue-bound, and each 64-bit division is a ~70-instruction routine.
  const uint32_t bid = blockIdx.x;
  const int tile = int(bid % uint32_t(row_tiles));
  const uint32_t rest = bid / uint32_t(row_tiles);
  const int split = int(rest % uint32_t(p.num_splits));
  const uint32_t rk32 = rest / uint32_t(p.num_splits);  // (group x B + row) x K + kv head
  const int64_t rk = rk32;
  const int64_t r = rk32 / uint32_t(p.kv_heads), kvh = rk32 % uint32_t(p.kv_heads);
  const int64_t g_index = uint32_t(r) / uint32_t(p.batch);
  // Key group `warp`, head-dim slice `slice` (head dims [slice kSlice, + kSlice)).
  const int warp = threadIdx.x / 32 % kWarps, slice = threadIdx.x / 32 / kWarps;
  const int lane = threadIdx.x % 32;
  const int64_t H = p.head_dim, K = p.kv_heads, N = p.heads, rep = N / K;
  const int32_t S = int32_t(p.page_size);
  const int64_t row0 = int64_t(tile) * kRows;

  // The split's keys: whole 64-key tiles from the window's start rounded down (a range is
  // empty unless 0 <= len <= M x S; then every key < len is an int32).
  const int64_t len = p.lengths[r];
  const int64_t cap = p.max_pages * p.page_size;
  const int64_t hi = (len >= 0 && len <= cap) ? len : 0;
  int64_t lo = p.window_left >= 0 ? len - p.q_len - p.window_left : 0;
  lo = lo < 0 ? 0 : (lo > hi ? hi : lo);
  const int64_t first = lo / kKeys * kKeys;
  const int32_t tiles = int32_t((hi - first + kKeys - 1) / kKeys);
  const int64_t per_split = int64_t((tiles + p.num_splits - 1) / p.num_splits) * kKeys;
  const int64_t begin64 = first + split * per_split;
  const int32_t begin = int32_t(begin64 > hi ? hi : begin64);
  const int32_t end = int32_t(begin + per_split > hi ? hi : begin + per_split);
  const int num_tiles = int(CeilDiv(end - begin, kKeys));

  // This block's kv head column of page 0, slot 0; a key adds page x page_stride + slot x
  // token_stride values.
  const int64_t page_stride = int64_t(S) * K * H;
  const int64_t token_stride = K * H;
  const int64_t pool_base = (p.page_groups == 1 ? 0 : g_index) * p.num_pages;
  const KV* k_pool = static_cast<const KV*>(p.k_pages) + pool_base * page_stride + kvh * H;
  const KV* v_pool = static_cast<const KV*>(p.v_pages) + pool_base * page_stride + kvh * H;
  const int32_t* table = p.block_table + r * p.max_pages;

  // paged_attention_with_update (16-bit caches only): keys from new_first on are this
  // row's new tokens, read from k_new / v_new (G, B, Tq, K, H) instead of their slots,
  // which a block of another split may be writing (AppendNewTokens).
  const bool fused = !kIs8Bit<KV> && p.k_new != nullptr;
  const int64_t new_first = len - p.q_len;
  const int64_t new_base = (r * p.q_len - new_first) * token_stride + kvh * H;

  auto ring_k = [&](int stage) { return smem + L::kRing + stage * L::kStageBytes; };
  auto ring_v = [&](int stage) { return smem + L::kRing + stage * L::kStageBytes + L::kRawTile; };

  // Issues the copies of tile `it` (keys begin + 64 it ..) into its ring stage: K and V
  // chunks, each key's in-split-and-valid flag and (8-bit) its scales. Keys out of the
  // split or on an invalid page are zero-filled, their pages never read.
  auto load_tile = [&](int it) {
    const int stage = it % kStages;
    unsigned char* k_dst = ring_k(stage);
    unsigned char* v_dst = ring_v(stage);
    // A thread copies chunk `chunk` of keys key_first + pass x kStep: one division for the
    // first key's page and slot, then steps (kStep <= 32 keys: at most 4 pages of >= 8).
    const int chunk = threadIdx.x % kChunks;
    const int key_first = threadIdx.x / kChunks;
    const int32_t pos_first = begin + it * kKeys + key_first;
    int32_t col = pos_first / S;
    int32_t slot = pos_first - col * S;
#pragma unroll
    for (int pass = 0; pass < kKeys / kStep; ++pass) {
      const int key = key_first + pass * kStep;
      const int32_t pos = pos_first + pass * kStep;
      if (pass > 0) {
        slot += kStep;
        while (slot >= S) slot -= S, ++col;
      }
      const int32_t page = pos < end ? table[col] : -1;
      const bool ok = page >= 0 && page < p.num_pages;
      const int64_t at = ok ? int64_t(page) * page_stride + int64_t(slot) * token_stride : 0;
      const bool copy = ok && chunk * kValues < H;
      const int64_t src = at + (copy ? chunk * kValues : 0);
      const KV* k_src = k_pool + src;
      const KV* v_src = v_pool + src;
      if (fused && copy && pos >= new_first) {
        const int64_t at_new = new_base + int64_t(pos) * token_stride + chunk * kValues;
        k_src = static_cast<const KV*>(p.k_new) + at_new;
        v_src = static_cast<const KV*>(p.v_new) + at_new;
      }
      uint32_t kd, vd;
      if constexpr (kIs8Bit<KV>) {
        kd = att::SmemAddress(k_dst + key * kHD + SwizzleK<kSlice>(key, chunk) * 16);
        vd = att::SmemAddress(v_dst + key * kHD + SwizzleV<kSlice>(key, chunk) * 16);
      } else {
        const int dst = (key * kStride + chunk * kValues) * 2;
        kd = att::SmemAddress(k_dst + dst);
        vd = att::SmemAddress(v_dst + dst);
      }
      if (!halves) {
        const int bytes = copy ? 16 : 0;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(kd), "l"(k_src),
                     "r"(bytes)
                     : "memory");
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(vd), "l"(v_src),
                     "r"(bytes)
                     : "memory");
      } else {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const bool in = copy && chunk * kValues + 8 * half < H;
          const int64_t from = in ? src + 8 * half : 0;
          const int bytes = in ? 8 : 0;
          asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(kd + 8 * half),
                       "l"(k_pool + from), "r"(bytes)
                       : "memory");
          asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(vd + 8 * half),
                       "l"(v_pool + from), "r"(bytes)
                       : "memory");
        }
      }
      if (chunk == 0) {
        s_ok[stage * kKeys + key] = ok ? 1 : 0;
        if constexpr (kIs8Bit<KV>) {
          // Scales (Gp, P, S, K): the token's index in the pool, times K, plus the kv head.
          const int64_t token = ok ? (pool_base + page) * S + slot : 0;
          const float* ks = p.k_scale + token * K + kvh;
          const float* vs = p.v_scale + token * K + kvh;
          const int sb = ok ? 4 : 0;
          asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(
                           att::SmemAddress(s_scale + (stage * 2 + 0) * kKeys + key)),
                       "l"(ks), "r"(sb)
                       : "memory");
          asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(
                           att::SmemAddress(s_scale + (stage * 2 + 1) * kKeys + key)),
                       "l"(vs), "r"(sb)
                       : "memory");
        }
      }
    }
  };

  // kTma: this lane's page segment of tile `it`, box_rows keys (64 / box_rows segments,
  // box_rows dividing the page size or a multiple of 64, so that no segment crosses a
  // page): its page entry, or -1 past the split. The counted ring reads it a tile ahead of
  // the copy's issue (by every warp: which one issues is known only at its release), so
  // that the issuing warp does not wait on the table.
  auto segment_page = [&](int it) -> int32_t {
    const int segments = kKeys / box_rows;
    const int32_t pos = begin + it * kKeys + int32_t(lane) * box_rows;
    return lane < segments && pos < end ? table[pos / S] : -1;
  };

  // kTma, one warp: tile `it`'s boxes, a segment a lane (`page` from segment_page). A
  // segment whose first key is past the split or whose page entry is out of range is not
  // copied; its rows keep stale bytes, which the warps zero or mask before use (fix_tile
  // below: a key is valid exactly when its segment was copied and it lies before the
  // split's end). Lane 0 announces the bytes of every box issued, then the lanes issue them.
  // Without kCounted, called by every thread: threads 0-63 also write the keys' flags, and
  // warp 0 reads its pages here (`page` unused).
  constexpr int kBoxValues = 128 / int(sizeof(KV));  // a box's columns: 128 bytes
  constexpr int kColumnBlocks = kHD / kBoxValues;
  auto issue_tile_tma = [&](int it, int32_t page) {
    const int stage = it % kStages;
    const int32_t tile_first = begin + it * kKeys;
    if (!kCounted && threadIdx.x < kKeys) {
      const int32_t pos = tile_first + int32_t(threadIdx.x);
      const int32_t key_page = pos < end ? table[pos / S] : -1;
      s_ok[stage * kKeys + threadIdx.x] = key_page >= 0 && key_page < p.num_pages ? 1 : 0;
    }
    if (kCounted || threadIdx.x < 32) {
      if constexpr (!kCounted) page = segment_page(it);
      const int32_t pos = tile_first + int32_t(lane) * box_rows;
      const bool copy = page >= 0 && page < p.num_pages;
      const uint32_t copies = __popc(__ballot_sync(0xffffffffu, copy));
      if (lane == 0) {
        sm90::MbarrierArriveExpectTx(&s_full[stage],
                                     copies * uint32_t(box_rows) * 128u * kColumnBlocks * 2u);
      }
      __syncwarp();
      if (copy) {
        const int slot = pos - (pos / S) * S;
        const int b = int(pool_base) + page;
#pragma unroll
        for (int cb = 0; cb < kColumnBlocks; ++cb) {
          const int at = cb * kKeys * 128 + lane * box_rows * 128;
          const int col = cb * kBoxValues;
          sm90::TmaLoadBox(ring_k(stage) + at, &k_map, &s_full[stage], col, int(kvh), slot, b);
          sm90::TmaLoadBox(ring_v(stage) + at, &v_map, &s_full[stage], col, int(kvh), slot, b);
        }
      }
    }
  };

  // kTma: this warp's 16 keys of tile `it` (key0 ..), a bit each: in the split and on a
  // valid page, the copy engine's rule. The counted ring's warps read them from the block
  // table themselves, lane l for key l & 15 (shared flags would need a barrier between
  // their writer and the warps); otherwise from the flags issue_tile_tma wrote. kTma8 also
  // sets `scale8` to lane l's key's K scale (lanes 0-15) or V scale (16-31), 0 where the key
  // is not valid (a stale scale could be NaN, and 0 x NaN is not 0); scales (Gp, P, S, K):
  // the token's index in the pool, times K, plus the kv head.
  auto tile_ok_mask = [&](int it, int stage, int key0, float* scale8) -> uint32_t {
    bool ok;
    if constexpr (kCounted) {
      const int32_t pos = begin + it * kKeys + key0 + (lane & 15);
      const int32_t page = pos < end ? table[pos / S] : -1;
      ok = page >= 0 && page < p.num_pages;
      if constexpr (kTma8) {
        *scale8 = 0.f;
        if (ok) {
          const int64_t token = (pool_base + page) * S + (pos - (pos / S) * S);
          *scale8 = (lane < 16 ? p.k_scale : p.v_scale)[token * K + kvh];
        }
      }
    } else {
      ok = lane < 16 && s_ok[stage * kKeys + key0 + lane] != 0;
    }
    return __ballot_sync(0xffffffffu, ok) & 0xffffu;
  };

  // kTma: this warp's 16 keys of tile `it`, its slice's head dims, once the stage landed.
  // Rows the copy engine did not write, or past the split, hold stale bytes: their V rows
  // are zeroed (their logits are masked, so stale K is harmless, but 0 x a stale NaN in V
  // would not be). paged_attention_with_update's new tokens are copied in from k_new /
  // v_new. Only this warp reads these rows and columns; the proxy fence orders the writes
  // before the copy engine's next ones into the stage (after this warp releases it).
  // `ok_mask`: the counted ring's flags (tile_ok_mask, read before the wait); the other
  // ring reads them here.
  auto fix_tile = [&](int it, int stage, int key0, uint32_t ok_mask) {
    const int32_t tile_key0 = begin + it * kKeys + key0;
    if constexpr (!kCounted) ok_mask = tile_ok_mask(it, stage, key0, nullptr);
    const bool any_new = fused && tile_key0 + 15 >= new_first && tile_key0 < end;
    if (ok_mask == 0xffffu && !any_new) return;
    constexpr int kSliceChunks = kSlice * int(sizeof(KV)) / 16;
    const uint32_t kt = att::SmemAddress(ring_k(stage)), vt = att::SmemAddress(ring_v(stage));
    for (int i = lane; i < 16 * kSliceChunks; i += 32) {
      const int key = i / kSliceChunks, chunk = slice * kSliceChunks + i % kSliceChunks;
      const int row = key0 + key;
      const int32_t pos = tile_key0 + key;
      if (((ok_mask >> key) & 1u) == 0u) {
        asm volatile(
            "st.shared.v4.b32 [%0], {%1, %1, %1, %1};\n" ::"r"(SwizzledChunk(vt, row, chunk)),
            "r"(0u)
            : "memory");
      } else if constexpr (!kIs8Bit<KV>) {  // the fused call's caches are 16-bit
        if (any_new && pos >= new_first && chunk * 8 < H) {
          const int64_t at_new = new_base + int64_t(pos) * token_stride + chunk * 8;
          const uint4 k = *reinterpret_cast<const uint4*>(static_cast<const KV*>(p.k_new) + at_new);
          const uint4 v = *reinterpret_cast<const uint4*>(static_cast<const KV*>(p.v_new) + at_new);
          asm volatile(
              "st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(SwizzledChunk(kt, row, chunk)),
              "r"(k.x), "r"(k.y), "r"(k.z), "r"(k.w)
              : "memory");
          asm volatile(
              "st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(SwizzledChunk(vt, row, chunk)),
              "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
              : "memory");
        }
      }
    }
#if JAXGPU_WGMMA_DEVICE
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
    __syncwarp();
  };

  // The query rows (zeros past H and for padding rows): copied in the first copy group, or
  // over an 8-bit cache read twice, for the largest |q| and then as scaled halfs.
  const T* query = static_cast<const T*>(p.query);
  auto query_chunk = [&](int i, int* row, int* chunk) -> const T* {
    *row = i / (kHD / 8), *chunk = i % (kHD / 8);
    const int64_t rr = row0 + *row;
    if (rr >= rows_per_kv || *chunk * 8 >= H) return nullptr;
    const uint32_t t = uint32_t(rr) / uint32_t(rep), n = uint32_t(rr) % uint32_t(rep);
    return query + ((r * p.q_len + t) * N + kvh * rep + n) * H + *chunk * 8;
  };
  float q_unscale = 1.f;  // the logits' factor undoing the query's scaling
  if constexpr (kIs8Bit<KV>) {
    if (threadIdx.x == 0) s_qmax = 0u;
    __syncthreads();
    float most = 0.f;
    for (int i = threadIdx.x; i < kRows * (kHD / 8); i += kBlockThreads) {
      int row, chunk;
      if (const T* src = query_chunk(i, &row, &chunk)) {
        const uint4 raw = *reinterpret_cast<const uint4*>(src);
        const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int e = 0; e < 8; ++e) most = fmaxf(most, fabsf(ToFloat(v[e])));
      }
    }
    atomicMax(&s_qmax, __float_as_uint(most));  // non-negative floats order as their bits
    __syncthreads();
    const float qmax = __uint_as_float(s_qmax);
    // Largest below 2^15 (half's max is 65504); a power of two, so scaling is exact.
    const int shift = qmax >= 16384.f ? ilogbf(qmax) - 14 : 0;
    const float q_mul = exp2f(float(-shift));
    q_unscale = exp2f(float(shift));
    for (int i = threadIdx.x; i < kRows * (kHD / 8); i += kBlockThreads) {
      int row, chunk;
      const T* src = query_chunk(i, &row, &chunk);
      uint4 raw = make_uint4(0u, 0u, 0u, 0u);
      if (src) raw = *reinterpret_cast<const uint4*>(src);
      const T* v = reinterpret_cast<const T*>(&raw);
      // Pairs of head dims stay adjacent in QColumn8's order: 4 word stores.
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        *reinterpret_cast<uint32_t*>(s_q + row * kStride + QColumn8<kSlice>(chunk * 8 + 2 * e)) =
            att::PackPair<__half>(ToFloat(v[2 * e]) * q_mul, ToFloat(v[2 * e + 1]) * q_mul);
      }
    }
  } else {
    for (int i = threadIdx.x; i < kRows * (kHD / 8); i += kBlockThreads) {
      int row, chunk;
      const T* src = query_chunk(i, &row, &chunk);
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                       att::SmemAddress(s_q + row * kStride + chunk * 8)),
                   "l"(src ? src : query), "r"(src ? 16 : 0)
                   : "memory");
    }
  }
  if constexpr (kCounted) {
    // Warp 0 fills the whole ring; the block's one barrier before the merge makes the
    // barriers' initialization and the query's rows visible to every warp.
    if (threadIdx.x < 32) {
      if (lane == 0) {
#pragma unroll
        for (int stage = 0; stage < kStages; ++stage) {
          sm90::MbarrierInit(&s_full[stage], 1);
          s_released[stage] = 0;
        }
        sm90::FenceBarrierInit();
      }
      __syncwarp();
#pragma unroll
      for (int it = 0; it < kStages; ++it) {
        if (it < num_tiles) issue_tile_tma(it, segment_page(it));
      }
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    __syncthreads();
  } else {
    if constexpr (kTma) {
      if (threadIdx.x == 0) {
#pragma unroll
        for (int stage = 0; stage < kStages; ++stage) sm90::MbarrierInit(&s_full[stage], 1);
        sm90::FenceBarrierInit();
      }
      __syncthreads();
    }
#pragma unroll
    for (int it = 0; it < kStages - 1; ++it) {
      if (it < num_tiles) {
        if constexpr (kTma) {
          issue_tile_tma(it, -1);
        } else {
          load_tile(it);
        }
      }
      asm volatile("cp.async.commit_group;\n" ::: "memory");
    }
    if constexpr (kTma) __syncthreads();  // the first tiles' key flags, read by fix_tile
  }
  if (fused && split == p.num_splits - 1 && tile == 0) {
    AppendNewTokens<KV>(p, r, kvh, pool_base, len, kBlockThreads);
  }

  // This thread's rows of the C fragments: g and g + 8 of each m-tile, at positions
  // len - Tq + t (int32: compared with keys < len only when the range is non-empty).
  const int g = lane >> 2, t4 = lane & 3;
  int32_t pos[kMT][2];
  const int32_t pos0 = end > begin ? int32_t(len - p.q_len) : 0;
#pragma unroll
  for (int mi = 0; mi < kMT; ++mi) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t rr = row0 + mi * 16 + g + 8 * h;
      pos[mi][h] = pos0 + int32_t(uint32_t(rr < rows_per_kv ? rr : 0) / uint32_t(rep));
    }
  }
  const int32_t window = p.window_left;
  const bool softcap = p.softcap > 0.f;
  const float dot_scale = (softcap ? p.scale / p.softcap : p.scale * kLog2e) * q_unscale;
  const float cap_log2 = p.softcap * kLog2e;

  float m[kMT][2], l[kMT][2], acc[kMT][kSlice / 8][4];
#pragma unroll
  for (int mi = 0; mi < kMT; ++mi) {
    m[mi][0] = m[mi][1] = -INFINITY;
    l[mi][0] = l[mi][1] = 0.f;
  }
  att::Zero(acc);

  for (int it = 0; it < num_tiles; ++it) {
    const int stage = it % kStages;
    const int key0 = warp * 16;  // this warp's keys of the tile
    uint32_t ok_mask = 0u;       // kTma: this warp's keys' flags
    int32_t next_page = -1;      // kCounted: this lane's segment of tile it + kStages
    float scale8 = 0.f;          // kTma8: a scale of this lane's key (tile_ok_mask)
    if constexpr (kCounted) {
      // The table (and kTma8's scale) reads overlap the wait.
      ok_mask = tile_ok_mask(it, stage, key0, &scale8);
      if (it + kStages < num_tiles) next_page = segment_page(it + kStages);
      sm90::MbarrierWait(&s_full[stage], uint32_t(it / kStages) & 1u);
      fix_tile(it, stage, key0, ok_mask);
    } else if constexpr (kTma) {
      asm volatile("cp.async.wait_group 0;\n" ::: "memory");  // the query
      sm90::MbarrierWait(&s_full[stage], uint32_t(it / kStages) & 1u);
      fix_tile(it, stage, key0, 0u);
      __syncthreads();  // tile `it` landed and fixed; tile it - 1 is consumed
      if (it + kStages - 1 < num_tiles) issue_tile_tma(it + kStages - 1, -1);
    } else {
      asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 2) : "memory");
      __syncthreads();  // tile `it` landed for every thread; tile it - 1 is consumed
      if (it + kStages - 1 < num_tiles) load_tile(it + kStages - 1);
      asm volatile("cp.async.commit_group;\n" ::: "memory");
    }

    const unsigned char* k_raw = ring_k(stage);
    const unsigned char* v_raw = ring_v(stage);

    // Logits: (16 kMT) x 16 keys.
    float s[kMT][2][4];
    att::Zero(s);
    if constexpr (kIs8Bit<KV>) {
      // Key ColumnKey8(j, g)'s (kTma8: key 8j + g's) bytes [c kSlice/4, (c + 1) kSlice/4) of
      // the warp's slice, a 16-byte chunk (4 k steps) at a time, widened in registers
      // (QColumn8 ordered the query's columns to match).
      constexpr int kParts = kSlice / 64;  // chunks of a thread's quarter of the slice
#pragma unroll
      for (int part = 0; part < kParts; ++part) {
        uint4 raw[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int chunk = slice * (kSlice / 16) + t4 * kParts + part;
          if constexpr (kTma8) {  // keys in natural order: rows 8j + g, the engine's swizzle
            const int row = key0 + 8 * j + g;
            raw[j] = *reinterpret_cast<const uint4*>(k_raw + SwizzledOffset(row, chunk));
          } else {
            const int row = key0 + ColumnKey8(j, g);
            raw[j] = *reinterpret_cast<const uint4*>(k_raw + row * kHD +
                                                     SwizzleK<kSlice>(row, chunk) * 16);
          }
        }
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          const int col = slice * kSlice + (part * 4 + w) * 16;
          uint32_t b[2][2];
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const uint32_t word = Prepare8<KV>(reinterpret_cast<const uint32_t*>(&raw[j])[w]);
            b[j][0] = WidenPair<KV>(word, 0);
            b[j][1] = WidenPair<KV>(word, 1);
          }
#pragma unroll
          for (int mi = 0; mi < kMT; ++mi) {
            uint32_t a[4];
            sm80::LoadA<kHD>(a, s_q, mi * 16, col, lane);
            sm80::MmaType<M>::Mma(s[mi][0], a, b[0][0], b[0][1]);
            sm80::MmaType<M>::Mma(s[mi][1], a, b[1][0], b[1][1]);
          }
        }
      }
    } else {
      const M* k_tile = reinterpret_cast<const M*>(k_raw);
#pragma unroll
      for (int kk = 0; kk < kSlice / 16; ++kk) {
        const int col = slice * kSlice + kk * 16;
        uint32_t b[4];
        if constexpr (kTma) {
          LoadBNkSwizzled(b, att::SmemAddress(k_raw), key0, col, lane);
        } else {
          sm80::LoadBNk<kHD>(b, k_tile, key0, col, lane);
        }
#pragma unroll
        for (int mi = 0; mi < kMT; ++mi) {
          uint32_t a[4];
          sm80::LoadA<kHD>(a, s_q, mi * 16, col, lane);
          sm80::MmaType<M>::Mma(s[mi][0], a, b[0], b[1]);
          sm80::MmaType<M>::Mma(s[mi][1], a, b[2], b[3]);
        }
      }
    }
    if constexpr (kSplitH == 4) {
      // The four slices' partial logits: each slice hands its part over, then every slice
      // adds the four parts in the same order (a named barrier per key group's 4 warps), so
      // that all run the same softmax on the same values. The next tile's hand-over waits
      // for every read of this one: the main loop's __syncthreads, or in the counted ring
      // (no such barrier) a second named barrier.
      constexpr int kPart = kWarps * 8 * kMT * 32;  // floats of one slice's hand-over
      float* swap = reinterpret_cast<float*>(smem + L::kSwap) + warp * (8 * kMT * 32) + lane;
      float* flat = &s[0][0][0];
#pragma unroll
      for (int e = 0; e < 8 * kMT; ++e) swap[slice * kPart + e * 32] = flat[e];
      asm volatile("bar.sync %0, 128;\n" ::"r"(1 + warp) : "memory");
#pragma unroll
      for (int e = 0; e < 8 * kMT; ++e) {
        flat[e] = ((swap[e * 32] + swap[kPart + e * 32]) + swap[2 * kPart + e * 32]) +
                  swap[3 * kPart + e * 32];
      }
      if constexpr (kCounted) asm volatile("bar.sync %0, 128;\n" ::"r"(1 + warp) : "memory");
    }
    if constexpr (kSplitH == 2) {
      // The two slices' partial logits: slice 1 hands its half over, slice 0 adds it and
      // hands the sum back (a named barrier per key group's warp pair), so that both warps
      // run the same softmax on the same values.
      float* swap = reinterpret_cast<float*>(smem + L::kSwap) + warp * (8 * kMT * 32) + lane;
      float* flat = &s[0][0][0];
      if (slice == 1) {
#pragma unroll
        for (int e = 0; e < 8 * kMT; ++e) swap[e * 32] = flat[e];
      }
      asm volatile("bar.sync %0, 64;\n" ::"r"(1 + warp) : "memory");
      if (slice == 0) {
#pragma unroll
        for (int e = 0; e < 8 * kMT; ++e) {
          flat[e] += swap[e * 32];
          swap[e * 32] = flat[e];
        }
      }
      asm volatile("bar.sync %0, 64;\n" ::"r"(1 + warp) : "memory");
      if (slice == 1) {
#pragma unroll
        for (int e = 0; e < 8 * kMT; ++e) flat[e] = swap[e * 32];
      }
    }

    // Scale, softcap, mask; then the online softmax per row (a row's 16 keys sit in the
    // 4 lanes of a quad).
    // This thread's 4 key columns (2t, 2t + 1 of each n-tile: the warp's keys 2t, 2t + 1,
    // 8 + 2t, 9 + 2t, or ColumnKey8's over an 8-bit cache), read from shared memory once per
    // tile, not once per row.
    const int32_t tile_key0 = begin + it * kKeys + key0;
    bool key_ok[4];
    float key_scale[4], value_scale[4];
    int32_t key_at[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int kl = kIs8Bit<KV> && !kTma8 ? ColumnKey8(c >> 1, 2 * t4 + (c & 1))
                                           : (c >> 1) * 8 + 2 * t4 + (c & 1);
      key_ok[c] = kCounted ? ((ok_mask >> kl) & 1u) != 0u : s_ok[stage * kKeys + key0 + kl] != 0;
      key_at[c] = tile_key0 + kl;
      if constexpr (kTma8) {
        key_scale[c] = __shfl_sync(0xffffffffu, scale8, kl);
        value_scale[c] = __shfl_sync(0xffffffffu, scale8, 16 + kl);
      } else if constexpr (kIs8Bit<KV>) {
        key_scale[c] = s_scale[(stage * 2 + 0) * kKeys + key0 + kl];
        value_scale[c] = s_scale[(stage * 2 + 1) * kKeys + key0 + kl];
      }
    }
    // Interior tiles (every key valid, behind every row, inside every row's window) skip
    // the mask: the rows' positions are pos0 .. pos0 + Tq - 1.
    const bool all_ok = __all_sync(0xffffffffu, key_ok[0] && key_ok[1] && key_ok[2] && key_ok[3]);
    const bool interior = all_ok && tile_key0 + 15 <= pos0 &&
                          (window < 0 || pos0 + int32_t(p.q_len) - 1 - tile_key0 <= window);
    float probs[kMT][2][4];
    bool rescale = false;
    float corr[kMT][2];
#pragma unroll
    for (int mi = 0; mi < kMT; ++mi) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float top = m[mi][h];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          float x = s[mi][c >> 1][2 * h + (c & 1)] * dot_scale;
          if constexpr (kIs8Bit<KV>) x *= key_scale[c];
          if (softcap) x = cap_log2 * tanhf(x);
          if (!interior) {
            const int32_t behind = pos[mi][h] - key_at[c];
            const bool visible = key_ok[c] && behind >= 0 && (window < 0 || behind <= window);
            x = visible ? x : -INFINITY;
          }
          s[mi][c >> 1][2 * h + (c & 1)] = x;
          top = fmaxf(top, x);
        }
        top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));
        top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 2));
        // All masked so far: subtract 0 instead (exp2(-inf) = 0, no NaN from -inf - -inf).
        const float base = top == -INFINITY ? 0.f : top;
        corr[mi][h] = exp2f(m[mi][h] - base);
        rescale |= top != m[mi][h];
        m[mi][h] = top;
        float sum = 0.f;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const float w = exp2f(s[mi][c >> 1][2 * h + (c & 1)] - base);
          sum += w;
          float pv = w;
          if constexpr (kIs8Bit<KV>) pv *= value_scale[c];
          probs[mi][c >> 1][2 * h + (c & 1)] = pv;
        }
        l[mi][h] = l[mi][h] * corr[mi][h] + sum;
      }
    }
    // Once the running maxima settle (after the first tiles, for most rows), no row of the
    // warp needs its accumulator rescaled: skip the kMT x H/2 multiplies a thread would do.
    if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
      for (int mi = 0; mi < kMT; ++mi) {
#pragma unroll
        for (int nt = 0; nt < kSlice / 8; ++nt) {
          acc[mi][nt][0] *= corr[mi][0];
          acc[mi][nt][1] *= corr[mi][0];
          acc[mi][nt][2] *= corr[mi][1];
          acc[mi][nt][3] *= corr[mi][1];
        }
      }
    }

    // P V: the probabilities as 16-bit A fragments; V's B fragments by transposed ldmatrix,
    // or over an 8-bit cache from one word (4 head dims) of each of keys 4 t .. 4 t + 3,
    // transposed by byte_perm (see ColumnKey8 and OutputColumn8).
    uint32_t pa[1][kMT][4];
    att::PackProbs<M, 16, kMT>(pa, probs);
    if constexpr (kIs8Bit<KV>) {
      // A thread's kSlice/8 bytes of a key row: 16-byte parts (8 bytes at a slice of 64).
      constexpr int kPartBytes = kSlice >= 128 ? 16 : 8;
      constexpr int kParts = kSlice / 8 / kPartBytes;
      constexpr int kWords = kPartBytes / 4;
#pragma unroll
      for (int part = 0; part < kParts; ++part) {
        uint32_t words[4][kWords];  // [key 4t + i][word]
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          // The byte in the row, unswizzled.
          const int byte = slice * kSlice + (kSlice / 8) * g + part * kPartBytes;
          // kTma8: keys in natural order (P V's k indices 2t, 2t + 1, 2t + 8, 2t + 9), the
          // engine's swizzle; otherwise ColumnKey8's keys 4t .. 4t + 3, SwizzleV.
          const int row = kTma8 ? key0 + 2 * t4 + (i & 1) + 8 * (i >> 1) : key0 + 4 * t4 + i;
          const unsigned char* at =
              kTma8 ? v_raw + SwizzledOffset(row, byte / 16) + byte % 16
                    : v_raw + row * kHD + SwizzleV<kSlice>(row, byte / 16) * 16 + byte % 16;
          if constexpr (kWords == 4) {
            const uint4 v = *reinterpret_cast<const uint4*>(at);
            words[i][0] = v.x, words[i][1] = v.y, words[i][2] = v.z, words[i][3] = v.w;
          } else {
            const uint2 v = *reinterpret_cast<const uint2*>(at);
            words[i][0] = v.x, words[i][1] = v.y;
          }
        }
#pragma unroll
        for (int w = 0; w < kWords; ++w) {
          // lo/hi: bytes 0, 1 / 2, 3 of the 4 keys' words, interleaved key by key.
          const uint32_t w0 = Prepare8<KV>(words[0][w]), w1 = Prepare8<KV>(words[1][w]);
          const uint32_t w2 = Prepare8<KV>(words[2][w]), w3 = Prepare8<KV>(words[3][w]);
          const uint32_t k01[2] = {__byte_perm(w0, w1, 0x5140), __byte_perm(w0, w1, 0x7362)};
          const uint32_t k23[2] = {__byte_perm(w2, w3, 0x5140), __byte_perm(w2, w3, 0x7362)};
#pragma unroll
          for (int byte = 0; byte < 4; ++byte) {
            const int nt = 4 * (part * kWords + w) + byte;
            const uint32_t b0 = WidenPair<KV>(k01[byte >> 1], byte & 1);
            const uint32_t b1 = WidenPair<KV>(k23[byte >> 1], byte & 1);
#pragma unroll
            for (int mi = 0; mi < kMT; ++mi) sm80::MmaType<M>::Mma(acc[mi][nt], pa[0][mi], b0, b1);
          }
        }
      }
    } else {
      const M* v_tile = reinterpret_cast<const M*>(v_raw);
#pragma unroll
      for (int nn = 0; nn < kSlice / 16; ++nn) {
        uint32_t b[4];
        if constexpr (kTma) {
          LoadBKnSwizzled(b, att::SmemAddress(v_raw), key0, slice * kSlice + nn * 16, lane);
        } else {
          sm80::LoadBKn<kHD>(b, v_tile, key0, slice * kSlice + nn * 16, lane);
        }
#pragma unroll
        for (int mi = 0; mi < kMT; ++mi) {
          sm80::MmaType<M>::Mma(acc[mi][2 * nn], pa[0][mi], b[0], b[1]);
          sm80::MmaType<M>::Mma(acc[mi][2 * nn + 1], pa[0][mi], b[2], b[3]);
        }
      }
    }
    if constexpr (kCounted) {
      // This warp's reads of the stage are done (their registers are in the products):
      // count it out; the last warp refills the stage. The fences make the other warps'
      // reads (and fix_tile's writes) of the stage happen before the copy engine's writes.
      __syncwarp();
      int last = 0;
      if (lane == 0) {
        __threadfence_block();
        const int done = atomicAdd(&s_released[stage], 1) + 1;
        last = done == (it / kStages + 1) * kWarps * kSplitH;
        if (last) __threadfence_block();
      }
      if (__shfl_sync(0xffffffffu, last, 0) && it + kStages < num_tiles) {
#if JAXGPU_WGMMA_DEVICE
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
        issue_tile_tma(it + kStages, next_page);
      }
    }
  }

  // Merge the 4 warps: states to shared memory (over the ring, once every copy landed and
  // every warp is done with the tiles), then every (row, h) from all of them.
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
  __syncthreads();
  float* s_o = reinterpret_cast<float*>(smem + L::kRing);
  float* s_m = s_o + kWarps * kRows * kHD;
  float* s_l = s_m + kWarps * kRows;
#pragma unroll
  for (int mi = 0; mi < kMT; ++mi) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = l[mi][h];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const int row = mi * 16 + g + 8 * h;
      if (t4 == 0 && slice == 0) {
        s_m[warp * kRows + row] = m[mi][h];
        s_l[warp * kRows + row] = sum;
      }
      if (row0 + row >= rows_per_kv) continue;  // padding: WriteMergedRows never reads it
      float* o_row = s_o + (warp * kRows + row) * kHD + slice * kSlice;
#pragma unroll
      for (int nt = 0; nt < kSlice / 8; ++nt) {
        if constexpr (kIs8Bit<KV>) {
          o_row[OutputColumn8<kSlice>(nt, 2 * t4)] = acc[mi][nt][2 * h];
          o_row[OutputColumn8<kSlice>(nt, 2 * t4 + 1)] = acc[mi][nt][2 * h + 1];
        } else {
          *reinterpret_cast<float2*>(o_row + nt * 8 + 2 * t4) =
              make_float2(acc[mi][nt][2 * h], acc[mi][nt][2 * h + 1]);
        }
      }
    }
  }
  __syncthreads();
  const int64_t rk_count = gridDim.x / (int64_t(row_tiles) * p.num_splits);
  WriteMergedRows<T>(p, rk, split, rows_per_kv, row0, kRows, kWarps, s_m, s_l, s_o, kHD,
                     rk_count * p.num_splits);
}

// The split count that keeps the GPU's block slots busiest: p.num_splits (the workspace's
// size, from jaxgpu/ops/decode.py) is an upper bound. A count costs waves x (its split's
// tiles + a block's fixed cost), waves = ceil(blocks / slots), tiles = ceil(the row's
// capacity in 64-key tiles / splits). Whole waves matter: measured on the H100 (bf16, 32/8,
// H 128, B 8, L 32k, 2 blocks an SM) the 5 splits of an older block-count rule made 320
// blocks for 264 slots and read 1.79 TB/s. The fixed cost (the query, the first tiles'
// latency, the merge and the partial's write) is about two tiles' streaming time: on the
// H200 (tools/decode_check, CUDA graph) a one-tile block takes ~9.4 us where a block
// streams a tile in ~2.8; without it, 4/1 H 256 B 8 L 4k took 33 splits of 2 tiles (two
// waves at one block an SM) where 16 of 4 tiles measured 22% faster on the H100. Among
// counts within 3% of the best, the smallest wins (fewer partials to combine). Splits past
// the row's capacity in tiles would only be empty.
constexpr int kFixedTiles = 2;

int ChooseSplits(int64_t base_blocks, int64_t slots, int max_splits, int64_t max_tiles) {
  const int most = int(max_tiles < max_splits ? (max_tiles < 1 ? 1 : max_tiles) : max_splits);
  auto cost = [&](int s) {
    return double(CeilDiv(base_blocks * s, slots)) * double(CeilDiv(max_tiles, s) + kFixedTiles);
  };
  double best = cost(1);
  for (int s = 2; s <= most; ++s) best = cost(s) < best ? cost(s) : best;
  for (int s = 1; s <= most; ++s) {
    if (cost(s) <= best * 1.03) return s;
  }
  return 1;
}

#ifdef JAXGPU_HAS_SM90A
// The copy-engine ring (kTma) takes a 16-bit cache on a compute capability 9.0 device when
// the pools' tensor maps encode (16-byte aligned, H a multiple of 8). Its boxes are
// box_rows slots of one page: 64 when the page size is a multiple of 64, the page size when
// it divides 64, else 8 (page sizes are multiples of 8). JAXGPU_DECODE_TMA=-1 (a dev-knob
// build) keeps the cp.async ring, for A/B timings.
bool EncodePoolMaps(const PagedAttentionParams& p, int elem_bytes, CUtensorMap* k_map,
                    CUtensorMap* v_map, int* box_rows) {
  static const bool off = ReadDevKnob("JAXGPU_DECODE_TMA").ints[0] < 0;
  if (off) return false;
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  if (major != 9 || minor != 0) return false;
  const int64_t S = p.page_size;
  *box_rows = S % kKeys == 0 ? kKeys : (kKeys % S == 0 ? int(S) : 8);
  const int64_t pages = p.page_groups * p.num_pages, K = p.kv_heads, H = p.head_dim;
  return sm90::EncodeRowsTensorMap(k_map, p.k_pages, elem_bytes, pages, S, K, H, K * H,
                                   *box_rows) &&
         sm90::EncodeRowsTensorMap(v_map, p.v_pages, elem_bytes, pages, S, K, H, K * H, *box_rows);
}
#endif

// At H 256 a block of fewer than 32 tiles runs the cp.async ring: with the copy engine's
// ring the short calls measured 0.5-1 us slower (H200, tools/decode_check, a call from a
// CUDA graph: 4/1 B 1 L 4k 14.0 -> 15.0 us, window 511 9.8 -> 10.3; 4/1 B 8 L 4k, 5 tiles a
// block, 29.5 -> 30.8 us direct), while splits of 33 tiles or more ran Tq 1 within 1% and
// Tq 8 10-14% faster (bench_decode's H 256 cases, 22d23f8 -> fea2f9d). In between nothing
// was measured, and the Gemma decode steps' calls (Gemma 2 2b at B 8: 17 tiles a split)
// keep the ring that bench_model measured. At H <= 128 short calls ran the same either way.
// -DJAXGPU_DECODE_TMA_MIN_TILES_H256=1 sends every H 256 call to the copy engine's ring
// (with the counted ring, whose short calls no longer wait at a barrier a tile: to measure).
#ifndef JAXGPU_DECODE_TMA_MIN_TILES_H256
#define JAXGPU_DECODE_TMA_MIN_TILES_H256 32
#endif
constexpr int kTmaMinTilesH256 = JAXGPU_DECODE_TMA_MIN_TILES_H256;

template <typename T, typename KV, int kHD, int kMT, bool kTma>
cudaError_t LaunchInstance(const PagedAttentionParams& p, int64_t rows_per_kv, int64_t blocks,
                           int row_tiles, const CUtensorMap& k_map, const CUtensorMap& v_map,
                           int box_rows, cudaStream_t stream) {
  constexpr int kSplitH = kSplitHFor<KV, kHD, kMT, kTma>;
  using L = Layout<T, KV, kHD, kMT, kSplitH, kTma>;
  auto kernel = PagedAttentionTcKernel<T, KV, kHD, kMT, kSplitH, kTma>;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kBytes);
  if (err != cudaSuccess) return err;
  kernel<<<unsigned(blocks), kThreads * kSplitH, L::kBytes, stream>>>(p, rows_per_kv, row_tiles,
                                                                      k_map, v_map, box_rows);
  return cudaGetLastError();
}

template <typename T, typename KV, int kHD, int kMT>
cudaError_t Launch(PagedAttentionParams* p, int64_t rows_per_kv, cudaStream_t stream) {
  constexpr int kSplitH = kSplitHFor<KV, kHD, kMT, false>;
  constexpr int kBlockThreads = kThreads * kSplitH;
  using L = Layout<T, KV, kHD, kMT, kSplitH>;
  // Per process and instance: the device's SM count and this kernel's blocks an SM (one
  // GPU model per process is the common case; a wrong guess costs speed, not results). The
  // copy-engine instance fits as many blocks (its tiles are unpadded; 1 KB of alignment; at
  // H 256 one block an SM whatever its slices).
  static const int64_t slots = [&] {
    auto kernel = PagedAttentionTcKernel<T, KV, kHD, kMT, kSplitH, false>;
    int device = 0, sms = 0, per_sm = 0;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kBytes) !=
            cudaSuccess ||
        cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kBlockThreads, L::kBytes) !=
            cudaSuccess) {
      return int64_t(0);
    }
    return int64_t(sms) * per_sm;
  }();
  const int64_t rk_count = p->groups * p->batch * p->kv_heads;
  const int64_t row_tiles = CeilDiv(rows_per_kv, L::kRows);
  // A windowed row reads at most window + Tq keys from a 64-key boundary: more splits than
  // its tiles would be empty blocks and empty partials for the combine (Gemma 3's local
  // layers: 9 tiles of a 4k table's 65).
  int64_t max_tiles = CeilDiv(p->max_pages * p->page_size, kKeys);
  if (p->window_left >= 0) {
    max_tiles = std::min(max_tiles, CeilDiv(p->window_left + p->q_len, kKeys) + 1);
  }
  if (slots > 0) {
    p->num_splits = ChooseSplits(rk_count * row_tiles, slots, p->num_splits, max_tiles);
  }
  const int64_t blocks = rk_count * p->num_splits * row_tiles;
  if (blocks > INT32_MAX) return cudaErrorInvalidConfiguration;
  CUtensorMap k_map{}, v_map{};
  int box_rows = 0;
#ifdef JAXGPU_HAS_SM90A
  if constexpr (!kIs8Bit<KV> || kTma8Takes<KV, kHD, kMT>) {
    const bool long_splits = kHD < 256 || CeilDiv(max_tiles, p->num_splits) >= kTmaMinTilesH256;
    if (long_splits && EncodePoolMaps(*p, int(sizeof(KV)), &k_map, &v_map, &box_rows)) {
      return LaunchInstance<T, KV, kHD, kMT, true>(*p, rows_per_kv, blocks, int(row_tiles), k_map,
                                                   v_map, box_rows, stream);
    }
  }
#endif
  return LaunchInstance<T, KV, kHD, kMT, false>(*p, rows_per_kv, blocks, int(row_tiles), k_map,
                                                v_map, box_rows, stream);
}

template <typename T, typename KV>
cudaError_t LaunchHeadDim(PagedAttentionParams* p, int64_t rows_per_kv, cudaStream_t stream) {
  const bool two = rows_per_kv > 16;
  if (p->head_dim <= 64) {
    return two ? Launch<T, KV, 64, 2>(p, rows_per_kv, stream)
               : Launch<T, KV, 64, 1>(p, rows_per_kv, stream);
  }
  if (p->head_dim <= 128) {
    return two ? Launch<T, KV, 128, 2>(p, rows_per_kv, stream)
               : Launch<T, KV, 128, 1>(p, rows_per_kv, stream);
  }
  return two ? Launch<T, KV, 256, 2>(p, rows_per_kv, stream)
             : Launch<T, KV, 256, 1>(p, rows_per_kv, stream);
}

}  // namespace

bool TensorCoreKernelTakes(const PagedAttentionParams& p) {
  const bool q16 = p.dtype == DType::kBF16 || p.dtype == DType::kF16;
  const bool kv_ok =
      p.kv_dtype == p.dtype || p.kv_dtype == DType::kS8 || p.kv_dtype == DType::kF8E4M3;
  return q16 && kv_ok && p.head_dim <= 256;
}

cudaError_t LaunchTensorCoreSplit(PagedAttentionParams* p, int64_t rows_per_kv,
                                  cudaStream_t stream) {
  return JAXGPU_DTYPE_SWITCH(p->dtype, T, kHalfDTypes, [&] {
    if (p->kv_dtype == DType::kS8) return LaunchHeadDim<T, int8_t>(p, rows_per_kv, stream);
    if (p->kv_dtype == DType::kF8E4M3) {
      return LaunchHeadDim<T, __nv_fp8_e4m3>(p, rows_per_kv, stream);
    }
    return LaunchHeadDim<T, T>(p, rows_per_kv, stream);
  });
}

}  // namespace jaxgpu::cuda::decode
