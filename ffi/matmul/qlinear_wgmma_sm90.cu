// The Hopper kernel of the weight-only quantized linear layer (sm_90a): y = act(x w + bias)
// for M from 9 rows up (kAuto; any M when asked for), with the weight widened in registers
// and multiplied on the warpgroup tensor cores (wgmma) as the A operand, x^T as the B
// operand from shared memory.
//
// Why. The mma.sync kernels (qlinear_kernels.cu) are built for decode's M <= 16, where the
// weight's bytes are the time; from M = 64 their x fragments, loaded by every warp for every
// product, and a re-widening per 64-row chunk made them slower than XLA's bf16 GEMM (0.5-0.8x
// at M = 64, 0.2-0.3x at M = 256 on an H100), and the dense route (dequantize, then
// cuBLASLt) costs the dequantizing copy on top of the GEMM (0.8x at M = 4096). Here the
// widening of a weight tile is done once per block and feeds kBT tokens of products, and x
// is read by wgmma straight from a swizzled shared-memory tile that the copy engine wrote.
//
// Mapping. A block of 3 warpgroups owns kNWT m64 row blocks a math warpgroup (kNWT = 2:
// 256 features, 16 n-tiles of the packed layout, for chunks of up to 128 tokens; kNWT = 1:
// 128 features for 256-token chunks), kBT tokens and one K split. Warpgroup 2 is the copy
// warpgroup: one thread issues, per k tile (64 k), a TMA box of x (kBT rows x 64 k, 128-byte
// swizzle, rows past M and k past K zero-filled), one bulk copy of the block's packed tiles
// (contiguous in the (KT, NT, words) layout) and, with group scales, one of the block's
// scale row and zero row, all completing on the stage's mbarrier; a ring of kStages stages.
// Warpgroups 0 and 1 compute: warp w of warpgroup c owns n-tile 4 (kNWT c + b) + w of row
// block b, whose lane fragments are exactly the rows 16w..16w+15 of wgmma's m64 A operand
// (the packed layout's A fragment is mma.sync's, and wgmma's register A has that layout per
// warp). Per k tile and row block a lane reads its 16 (int4) or 32 (int8) bytes from shared
// memory, widens them exactly (Dequant, qlinear_dequant.cuh) into 4 k16 steps of A, and
// issues one MMA group: 4 k16 steps x kBT / 128 (at least 1) m64 n<=128 MMAs sharing each A.
// A group's widening runs while the group before it multiplies (A registers double-buffered,
// wait_group 1), and a tile's stage is handed back once its last group is done.
//
// Output. The accumulators (float32) go through shared memory (the ring, free after the
// last MMA) and leave as 16-byte rows of 8 features: y = round_T(act(acc + bias)) without a
// K split, else the partial sums go to the float32 workspace and QLinearReduceKernel sums the
// splits in order (deterministic, as the other kernels). Splits are used only where the
// blocks would not fill the GPU's SMs.
//
// H100 (docs/perf/matmul.md): int4 g128 8192 x 28672 at M = 64 82 us (1.93x XLA's bf16), at
// M = 4096 3.0 ms (0.91x; 673 TFLOP/s in tools/qlinear_check, tensor pipe 74% busy).
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "attention/sm90/tma.cuh"
#include "attention/sm90/wgmma.cuh"
#include "common/cuda_dispatch.cuh"
#include "common/cuda_utils.cuh"
#include "matmul/qlinear_dequant.cuh"
#include "matmul/qlinear_internal.h"
#include "matmul/qlinear_params.h"

namespace jaxgpu::cuda::qlinear {

namespace sm90 = attention::sm90;

// Named (not anonymous) so that a build without sm_90a device code, whose kernel body is
// empty, does not warn about unused helpers.
namespace wgmma_kernel {

// Build-time knobs for tuning runs (tools/qlinear_check.cu): m64 row blocks a math
// warpgroup owns up to 128-token chunks (256-token chunks take 1), and the token chunk
// from 129 rows (128 or 256).
#ifndef JAXGPU_QLINEAR_WG_NWT
#define JAXGPU_QLINEAR_WG_NWT 2
#endif
#ifndef JAXGPU_QLINEAR_WG_BT
#define JAXGPU_QLINEAR_WG_BT 256
#endif
// A fragment buffers (MMA groups in flight a warpgroup: this minus one waited for).
#ifndef JAXGPU_QLINEAR_WG_BUFS
#define JAXGPU_QLINEAR_WG_BUFS 2
#endif

inline constexpr int kMathGroups = 2;
inline constexpr int kThreads = 128 * (kMathGroups + 1);
// setmaxnreg budgets (the copy warpgroup gives its registers to the math warpgroups):
// 128 x 24 + 256 x 240 = 64512 of the SM's 65536.
inline constexpr int kCopyRegisters = 24;
inline constexpr int kMathRegisters = 240;
// Token chunks that walk the n-blocks together (block order), so that their x rows and the
// weight columns in flight stay in L2 at large M.
inline constexpr int kRasterM = 8;
inline constexpr int kSmemBudget = 200 * 1024;
inline constexpr int kMaxStages = 16;
inline constexpr int kMinTilesPerSplit = 4;
inline constexpr int kMaxSplits = 32;

// Runs step(i0 + u, A buffer of u's first group) for u = U... below `count`: the buffers
// rotate by kNWT groups a tile, so a compile-time unrolled run of tiles keeps every index
// constant. The steps nest (&& stops at the first u past count): ptxas serializes the MMAs
// of a function where a step may be skipped between two others (C7513).
template <int kNWT, int kBufs, typename F, int... U>
__device__ __forceinline__ void RunTiles(F&& step, int i0, int count,
                                         std::integer_sequence<int, U...>) {
  (void)((U < count && (step(i0 + U, std::integral_constant<int, (U * kNWT) % kBufs>{}), true)) &&
         ...);
}

__host__ __device__ constexpr int Gcd(int a, int b) { return b == 0 ? a : Gcd(b, a % b); }

// fn(acc[b][h][j][e], b, h, j, e) over every accumulator, unrolled.
template <int kNWT, int kTH, int kJ, typename F>
__device__ __forceinline__ void ForEachAccumulator(float (&acc)[kNWT][kTH][kJ][4], F&& fn) {
#pragma unroll
  for (int b = 0; b < kNWT; ++b) {
#pragma unroll
    for (int h = 0; h < kTH; ++h) {
#pragma unroll
      for (int j = 0; j < kJ; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) fn(acc[b][h][j][e], b, h, j, e);
      }
    }
  }
}

inline bool Aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// kNWT: m64 row blocks (64 features) a math warpgroup owns, so n-tiles a math warp.
template <int kBits, int kBT, int kNWT>
struct WgConfig {
  static constexpr int kNTiles = 4 * kMathGroups * kNWT;       // n-tiles a block
  static constexpr int kFeat = kNTiles * kQTileN;              // features a block
  static constexpr int kTileBytes = QWordsPerTile(kBits) * 4;  // 512 (int4) or 1024 (int8)
  static constexpr int kWeightBytes = kNTiles * kTileBytes;
  static constexpr int kXBytes = kBT * 128;   // kBT tokens x 64 k, one 128-byte-swizzled block
  static constexpr int kWeightOff = kXBytes;  // x first: 1024-byte aligned for the swizzle
  static constexpr int kScaleOff = kWeightOff + kWeightBytes;
  static constexpr int kZeroOff = kScaleOff + kFeat * 2;
  static constexpr int kStageBytes = (kZeroOff + kFeat + 1023) / 1024 * 1024;
  static constexpr int kStages =
      kSmemBudget / kStageBytes < kMaxStages ? kSmemBudget / kStageBytes : kMaxStages;
  static constexpr int kBarrierOff = kStages * kStageBytes;
  static constexpr int kSmemBytes = kBarrierOff + 2 * kStages * 8 + 1024;  // + alignment
  static constexpr int kOutStride = kFeat + 4;  // floats: the output tile's rows (epilogue)
  static_assert(kStages >= 2, "a ring");
  static_assert(kBT * kOutStride * 4 <= kBarrierOff, "the output tile fits the ring");
  static_assert(kSmemBytes <= sm90::kMaxSmemBytes, "fits the SM");
};

struct WgArgs {
  QLinearParams p;
  int kt, nt;   // k tiles, n tiles
  int nblocks;  // n-blocks of WgConfig::kNTiles
  int mchunks;  // token chunks of kBT
  int splits;   // K splits (1: the kernel writes y)
  int tiles_per_split;
  int scale_rows;       // K / group_size
  int tiles_per_group;  // group_size / 64 where scale_rows > 1
};

// One bulk copy (the copy engine, no tensor map) of `bytes` (a multiple of 16) from global
// to shared memory, completing on `bar`.
__device__ inline void BulkCopy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
#if JAXGPU_WGMMA_DEVICE
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
      "l"(src), "r"(bytes), "r"(static_cast<uint32_t>(__cvta_generic_to_shared(bar)))
      : "memory");
#endif
}

}  // namespace wgmma_kernel

namespace {

using namespace wgmma_kernel;  // NOLINT: this file's own helpers

template <typename T, int kBits, int kBT, int kNWT>
__global__ void __launch_bounds__(kThreads, 1)
    QLinearWgmmaKernel(const WgArgs a, const __grid_constant__ CUtensorMap x_map) {
#if JAXGPU_WGMMA_DEVICE
  using C = WgConfig<kBits, kBT, kNWT>;
  constexpr int kNTiles = C::kNTiles;
  using D = Dequant<T, kBits>;
  constexpr int kS = C::kStages;
  constexpr int kWPL = QWordsPerLane(kBits);
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = sm90::SwizzleAligned(smem_raw);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + C::kBarrierOff);
  uint64_t* empty = full + kS;
  const QLinearParams& p = a.p;

  // Block -> (group, split) outermost, then bands of kRasterM token chunks walking the
  // n-blocks, token chunk fastest.
  int64_t bid = blockIdx.x;
  const int per_split = a.nblocks * a.mchunks;
  const int t = int(bid % per_split);
  bid /= per_split;
  const int split = int(bid % a.splits);
  const int64_t g = bid / a.splits;
  const int band = t / (kRasterM * a.nblocks);
  const int first_mc = band * kRasterM;
  const int band_m = a.mchunks - first_mc < kRasterM ? a.mchunks - first_mc : kRasterM;
  const int within = t - band * kRasterM * a.nblocks;
  const int mc = first_mc + within % band_m;
  const int nb = within / band_m;

  const int64_t gw = p.weight_groups == 1 ? 0 : g;
  const int kt0 = split * a.tiles_per_split;
  const int tiles = (kt0 + a.tiles_per_split < a.kt ? kt0 + a.tiles_per_split : a.kt) - kt0;
  const int nt0 = nb * kNTiles;
  const int valid_tiles = a.nt - nt0 < kNTiles ? a.nt - nt0 : kNTiles;
  const int64_t n0 = int64_t(nt0) * kQTileN;
  const int m0 = mc * kBT;
  const bool group_rows = a.scale_rows > 1;
  const bool has_zeros = p.zeros != nullptr;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kS; ++s) {
      sm90::MbarrierInit(&full[s], 1);
      sm90::MbarrierInit(&empty[s], 4 * kMathGroups);  // one arrival a math warp
    }
    sm90::FenceBarrierInit();
  }
  __syncthreads();  // the last CTA-wide barrier: the roles split below

  const int role = __shfl_sync(0xffffffffu, int(threadIdx.x >> 7), 0);
  if (role == kMathGroups) {
    sm90::ReleaseRegisters<kCopyRegisters>();
    if (threadIdx.x != kMathGroups * 128) return;
    const unsigned char* w_src = reinterpret_cast<const unsigned char*>(p.packed) +
                                 ((gw * a.kt + kt0) * a.nt + nt0) * int64_t(C::kTileBytes);
    const int64_t w_step = int64_t(a.nt) * C::kTileBytes;  // one k tile of all n-tiles
    const uint32_t w_bytes = uint32_t(valid_tiles * C::kTileBytes);
    const uint32_t s_bytes = group_rows ? uint32_t(valid_tiles * kQTileN * 2) : 0u;
    const uint32_t z_bytes = group_rows && has_zeros ? uint32_t(valid_tiles * kQTileN) : 0u;
    const uint16_t* s_src = static_cast<const uint16_t*>(p.scales) + gw * a.scale_rows * p.n + n0;
    const uint8_t* z_src = has_zeros ? p.zeros + gw * a.scale_rows * p.n + n0 : nullptr;
    for (int i = 0; i < tiles; ++i) {
      const int s = i % kS;
      if (i >= kS) sm90::MbarrierWait(&empty[s], ((i / kS) & 1) ^ 1);
      unsigned char* stage = smem + s * C::kStageBytes;
      sm90::MbarrierArriveExpectTx(&full[s], C::kXBytes + w_bytes + s_bytes + z_bytes);
      sm90::TmaLoadBox(stage, &x_map, &full[s], (kt0 + i) * kQTileK, 0, m0, int(g));
      BulkCopy(stage + C::kWeightOff, w_src + i * w_step, w_bytes, &full[s]);
      if (group_rows) {
        const int64_t row = (kt0 + i) / a.tiles_per_group;
        BulkCopy(stage + C::kScaleOff, s_src + row * p.n, s_bytes, &full[s]);
        if (has_zeros) BulkCopy(stage + C::kZeroOff, z_src + row * p.n, z_bytes, &full[s]);
      }
    }
    return;
  }
  sm90::ClaimRegisters<kMathRegisters>();

  const int warp = int(threadIdx.x >> 5) & 3, lane = int(threadIdx.x & 31);
  // Row block b of this warpgroup: n-tiles 4 (kNWT role + b) .. + 3, warp w's the w-th.
  int local_tile[kNWT], f[kNWT];
  bool tile_valid[kNWT];
  D dq[kNWT];
#pragma unroll
  for (int b = 0; b < kNWT; ++b) {
    local_tile[b] = 4 * (kNWT * role + b) + warp;
    tile_valid[b] = local_tile[b] < valid_tiles;
    f[b] = local_tile[b] * kQTileN + (lane >> 2);  // block-local feature of h = 0
    if (!group_rows) {  // a tile past N reads feature 0's constants (never written out)
      dq[b].Load(static_cast<const uint16_t*>(p.scales) + gw * p.n + n0,
                 has_zeros ? p.zeros + gw * p.n + n0 : nullptr, tile_valid[b] ? f[b] : 0,
                 has_zeros);
    }
  }

  // kBT tokens as kTH MMA widths of kN (at most 128, the widest here) sharing each A.
  constexpr int kN = kBT < 128 ? kBT : 128, kTH = kBT / kN;
  float acc[kNWT][kTH][kN / 8][4];
  ForEachAccumulator(acc, [](float& v, int, int, int, int) { v = 0.f; });
  // The MMA groups run in order (tile i, row block b); each is committed, then all but the
  // last kBufs - 1 waited for, so that the widening of the next groups runs under the MMAs
  // of these. Consecutive groups rotate through kBufs A buffers, and with kNWT = 2 also
  // alternate accumulators (no dependence between neighbours).
  constexpr int kBufs = JAXGPU_QLINEAR_WG_BUFS;
  uint32_t frag[kBufs][4][4];
  // Tile i, its first group using A buffer kBuf0 (a compile-time constant).
  auto tile_step = [&](int i, auto buf0) {
    constexpr int kBuf0 = decltype(buf0)::value;
    const int s = i % kS;
    sm90::MbarrierWait(&full[s], (i / kS) & 1);
    const unsigned char* stage = smem + s * C::kStageBytes;
    // x's tile: K-major, 128-byte swizzle; a k16 step is 32 bytes into the 128-byte rows.
    const uint64_t desc = sm90::SwizzledDescriptor(stage, 16, 1024);
#pragma unroll
    for (int b = 0; b < kNWT; ++b) {
      uint32_t (&af)[4][4] = frag[(kBuf0 + b) % kBufs];
      uint32_t w[kWPL];
      if (tile_valid[b]) {
        const uint4* src =
            reinterpret_cast<const uint4*>(stage + C::kWeightOff + local_tile[b] * C::kTileBytes) +
            lane * (kWPL / 4);
#pragma unroll
        for (int v = 0; v < kWPL / 4; ++v) {
          const uint4 q = src[v];
          w[4 * v] = q.x;
          w[4 * v + 1] = q.y;
          w[4 * v + 2] = q.z;
          w[4 * v + 3] = q.w;
        }
      } else {
#pragma unroll
        for (int v = 0; v < kWPL; ++v) w[v] = 0u;
      }
      if (group_rows) {
        dq[b].Load(reinterpret_cast<const uint16_t*>(stage + C::kScaleOff), stage + C::kZeroOff,
                   f[b], has_zeros);
      }
#pragma unroll
      for (int k16 = 0; k16 < 4; ++k16) dq[b].Step(af[k16], w, k16);
      sm90::Fence();
#pragma unroll
      for (int k16 = 0; k16 < 4; ++k16) {
#pragma unroll
        for (int h = 0; h < kTH; ++h) {  // rows kN h.. of x's tile: kN x 128 bytes further
          sm90::Wgmma<T, kN>::RSKMajor(acc[b][h], af[k16], desc + 2 * k16 + h * kN * 128 / 16,
                                       true);
        }
      }
      sm90::Commit();
      sm90::Wait<kBufs - 1>();  // groups up to this one - kBufs + 1 are done
      // Groups 0 .. done - 1 are complete; where they end a tile, its stage is free.
      const int done = i * kNWT + b - kBufs + 2;
      if (done > 0 && done % kNWT == 0 && lane == 0) {
        sm90::MbarrierArrive(&empty[(done / kNWT - 1) % kS]);
      }
    }
  };
  constexpr int kUnroll = kBufs / Gcd(kBufs, kNWT);  // tiles a buffer rotation takes
  int i = 0;
  for (; i + kUnroll <= tiles; i += kUnroll) {
    RunTiles<kNWT, kBufs>(tile_step, i, kUnroll, std::make_integer_sequence<int, kUnroll>{});
  }
  RunTiles<kNWT, kBufs>(tile_step, i, tiles - i, std::make_integer_sequence<int, kUnroll - 1>{});
  sm90::Wait<0>();
#pragma unroll
  for (int b = 0; b < kNWT; ++b) {
#pragma unroll
    for (int h = 0; h < kTH; ++h) sm90::KeepOrder(acc[b][h]);
  }

  // The output tile goes through shared memory (the ring is free once both warpgroups'
  // MMAs are done), so that it leaves as 16-byte rows of 8 features: a fully unrolled store
  // of each accumulator (2-byte stores, the activation inlined for every one of them) made
  // the kernel's code ~280 KB and its instruction fetch the largest stall.
  float* out = reinterpret_cast<float*>(smem);  // [kBT][C::kOutStride]
  sm90::NamedBarrierSync(1, kMathGroups * 128);
  // acc[b][h][j][2 hh + e]: feature f[b] + 8 hh, token kN h + 8 j + 2 (lane % 4) + e of the
  // chunk (mma's C fragment layout, which wgmma's D has per warp). Row stride kFeat + 4:
  // the lanes' stores fall in 32 distinct banks.
  ForEachAccumulator(acc, [&](float v, int b, int h, int j, int e) {
    const int token = kN * h + 8 * j + 2 * (lane & 3) + (e & 1);
    out[token * C::kOutStride + f[b] + 8 * (e >> 1)] = v;
  });
  sm90::NamedBarrierSync(1, kMathGroups * 128);
  const int64_t total = p.groups * p.m * p.n;
  constexpr int kChunks = C::kFeat / 8;  // 8-feature chunks a token row
  const int mvalid = p.m - m0 < kBT ? int(p.m - m0) : kBT;
  const int fvalid = valid_tiles * kQTileN / 8;
#pragma unroll 1
  for (int c = int(threadIdx.x); c < mvalid * kChunks; c += kMathGroups * 128) {
    const int token = c / kChunks, chunk = c % kChunks;
    if (chunk >= fvalid) continue;
    const float4* src = reinterpret_cast<const float4*>(out + token * C::kOutStride + 8 * chunk);
    const float4 lo = src[0], hi = src[1];
    float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    const int64_t n = n0 + 8 * chunk;
    const int64_t idx = (g * p.m + m0 + token) * p.n + n;
    if (a.splits == 1) {
      uint32_t packed[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const T lo16 = FromFloat<T>(Finish<T>(p, v[2 * e], g, n + 2 * e));
        const T hi16 = FromFloat<T>(Finish<T>(p, v[2 * e + 1], g, n + 2 * e + 1));
        packed[e] = uint32_t(reinterpret_cast<const uint16_t&>(lo16)) |
                    uint32_t(reinterpret_cast<const uint16_t&>(hi16)) << 16;
      }
      *reinterpret_cast<uint4*>(static_cast<T*>(p.y) + idx) =
          make_uint4(packed[0], packed[1], packed[2], packed[3]);
    } else {
      float4* dst = reinterpret_cast<float4*>(p.workspace + split * total + idx);
      dst[0] = lo;
      dst[1] = hi;
    }
  }
#endif
}

template <typename T, int kBits, int kBT, int kNWT>
cudaError_t LaunchTyped(const QLinearParams& p, cudaStream_t stream, int device, int sms) {
  using C = WgConfig<kBits, kBT, kNWT>;
  auto kernel = QLinearWgmmaKernel<T, kBits, kBT, kNWT>;
  static std::atomic<bool> opted[kMaxDevices];
  const cudaError_t opt_err = OncePerDevice(opted, device, [&] {
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes);
  });
  if (opt_err != cudaSuccess) return opt_err;
  CUtensorMap x_map;
  if (!sm90::EncodeRowsTensorMap(&x_map, p.x, 2, p.groups, p.m, 1, p.k, p.k, kBT)) {
    return cudaErrorNotSupported;
  }
  WgArgs a{};
  a.p = p;
  a.kt = int(QTilesK(p.k));
  a.nt = int(QTilesN(p.n));
  a.nblocks = int(CeilDiv(a.nt, C::kNTiles));
  a.mchunks = int(CeilDiv(p.m, kBT));
  a.scale_rows = int(QScaleRows(p));
  a.tiles_per_group = a.scale_rows > 1 ? int(p.group_size / kQTileK) : 1;

  // K splits only where the blocks leave SMs idle: as many as fill one wave, at least
  // kMinTilesPerSplit k tiles each, within the workspace.
  const int64_t base = p.groups * a.nblocks * a.mchunks;
  const int64_t out_elems = p.groups * p.m * p.n;
  int64_t max_splits = a.kt / kMinTilesPerSplit;
  const int64_t by_ws = p.workspace != nullptr ? p.workspace_floats / out_elems : 0;
  if (max_splits > by_ws) max_splits = by_ws;
  if (max_splits > kMaxSplits) max_splits = kMaxSplits;
  int64_t splits = base < sms ? sms / base : 1;
  if (splits > max_splits) splits = max_splits;
  if (splits < 1) splits = 1;
  a.tiles_per_split = int(CeilDiv(a.kt, splits));
  a.splits = int(CeilDiv(a.kt, a.tiles_per_split));

  const int64_t grid = base * a.splits;
  if (grid > 0x7fffffff) return cudaErrorInvalidConfiguration;
  kernel<<<unsigned(grid), kThreads, C::kSmemBytes, stream>>>(a, x_map);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || a.splits == 1) return err;
  return LaunchSplitReduce(p, a.splits, stream, device, sms);
}

}  // namespace

bool WgmmaEligible(const QLinearParams& p, int device) {
#ifdef JAXGPU_HAS_SM90A
  if (p.n % kQTileN != 0 || p.k % 8 != 0) return false;
  if (QScaleRows(p) > 1 && p.group_size % kQTileK != 0) return false;
  if (!Aligned16(p.x) || !Aligned16(p.scales) || (p.zeros != nullptr && !Aligned16(p.zeros)) ||
      !Aligned16(p.y) || (p.workspace != nullptr && !Aligned16(p.workspace))) {
    return false;
  }
  if (sm90::TensorMapEncoder() == nullptr) return false;
  // sm_90a code runs on compute capability 9.0 only.
  static std::atomic<int> major_cache[kMaxDevices], minor_cache[kMaxDevices];
  return DeviceAttribute(cudaDevAttrComputeCapabilityMajor, major_cache, device) == 9 &&
         DeviceAttribute(cudaDevAttrComputeCapabilityMinor, minor_cache, device) == 0;
#else
  (void)p;
  (void)device;
  return false;
#endif
}

cudaError_t LaunchWgmma(const QLinearParams& p, cudaStream_t stream, int device, int sms) {
  const int bt = p.m <= 32 ? 32 : p.m <= 64 ? 64 : p.m <= 128 ? 128 : JAXGPU_QLINEAR_WG_BT;
  return JAXGPU_DTYPE_SWITCH(p.dtype, T, kHalfDTypes, [&] {
    return JAXGPU_INT_SWITCH(bt, kBT, (32, 64, 128, 256), [&] {
      constexpr int kNWT = kBT == 256 ? 1 : JAXGPU_QLINEAR_WG_NWT;
      if (p.bits == 4) return LaunchTyped<T, 4, kBT, kNWT>(p, stream, device, sms);
      return LaunchTyped<T, 8, kBT, kNWT>(p, stream, device, sms);
    });
  });
}

}  // namespace jaxgpu::cuda::qlinear
