// Weight-only quantized linear layer: y = act(x w + bias) with int4 or int8 weights in the
// packed mma layout of qlinear_params.h and bf16 / f16 activations.
//
// Why this shape. For the small M this kernel serves (decode, M <= 64) the layer reads
// each weight byte once and does 2 M multiply-adds per weight: memory-bound, so the whole
// design is about streaming the packed weights from HBM at the copy rate (~3 TB/s on an
// H100) while keeping the per-byte instruction count low enough to hide under it.
//
// Mapping. A block (8 warps) owns kNB = 8 x kNWT n-tiles (16 features each), one chunk of
// kMT tokens and one split of the k tiles. Warp w owns n-tiles kNWT w .. kNWT w + kNWT - 1
// for every k of the split (kNWT = 1 at kMT = 8, 2 at kMT >= 16: the B fragments are
// shared by the warp's n-tiles). The packed weights of one k tile and the block's n-tiles
// are kNB x 512 (int4) or x 1024 (int8) contiguous bytes, so a pipeline stage (kKS k
// tiles, 16 KiB of weights) is kKS contiguous runs, copied with 16-byte cp.async (4 per
// thread) into a ring of kStages stages. Each stage also holds the x slice (kMT tokens x
// 64 kKS k, zero past K and past M, read as mma B fragments with ldmatrix) and the scale
// and zero rows the stage's k range touches (at most 2 or 3 rows for group_size >= 128).
// Measured (H100, int4 8192 x 28672, M = 1): 3, 4 or 5 stages at 2 blocks per SM ran
// alike (85 us); 2 stages at 4 blocks per SM with twice the blocks (split-K) as fast or
// faster, so the small token tiles use 2 stages and 3-4 resident blocks per SM.
//
// Dequantization in registers, exact but for the one rounding of the header's math:
//   int4: (word >> 4i) & 0x000f000f | magic gives two 16-bit values magic + q (bf16
//         0x4300 = 128, f16 0x6400 = 1024: q fills the low mantissa bits), one fma
//         subtracts magic + z exactly (a small integer), one fma multiplies by the scale
//         (the single rounding to T): 2 HFMA2 + 1 or 2 integer ops per bf16x2 register.
//   int8 f16: byte permutes under the 0x64 exponent byte (1024 + q), then the same two fmas.
//   int8 bf16: bf16 has 8 significant bits, so 128 + q (q < 256) is not exact in it; each
//         byte goes under the float 0x4b000000 exponent (2^23 + q), one FADD gives q - z
//         exactly, one FMUL the product (exact in float: 9 x 8 significant bits), and one
//         cvt.rn.bf16x2 rounds the pair once.
// The A fragment is the dequantized 16 x 16 weight tile; B is x^T (16 k x 8 tokens) from
// shared memory; D float32. The packed layout gives each lane exactly its A fragments, so
// no shuffles or shared-memory transposes are needed: one LDS.128 per lane per tile (int4).
//
// Split-K. The blocks of (n-blocks x m-chunks x groups) are multiplied by a K split so
// that they fill the resident block slots of the GPU in one wave (ChooseSplits; e.g. 2
// splits for 8192 x 28672 at M = 1, 8 for 28672 x 8192): the partial sums go to a float32
// workspace and a second small kernel sums the splits in a fixed order, adds bias, applies
// the activation and rounds once: bitwise deterministic. Without a split the main kernel
// finishes the output itself.
//
// Where the time goes (H100, int4 g128 8192 x 28672, M = 1, 72 us = 1.7 TB/s; Nsight
// Compute): issue-bound, not memory-bound. 35.7 M warp instructions (~156 per 512-byte
// warp tile: ~60 dequantization, 4 MMA, 3 shared loads, the rest copies, addressing and
// loop/barrier overhead), issue active 71% of cycles with warps ready but not selected,
// ALU pipe 49% and FMA pipe 44% busy, DRAM 48%. The copy pipeline alone (no math) reads
// at 2.55 TB/s. Reaching the ~41 us copy-rate bound needs ~35% fewer instructions per
// byte (e.g. TMA bulk copies for the weights instead of per-thread cp.async, a cheaper
// int4 widening), not deeper pipelines.
//
// On a Hopper GPU, from 9 rows, the wgmma kernel of qlinear_wgmma_sm90.cu serves instead
// (LaunchQLinearPath); these kernels serve the rest and every call on other GPUs.
//
// A second kernel serves M <= 8 (int8: M <= 16), QLinearGemvKernel (the GEMV path, below;
// the default where GemvEligible): it takes the weights straight from global memory into
// registers and splits K over the warps, so that x stays in registers: 77 SASS instructions
// per int4 tile in its main loop against ~156 here. H200, int4 g128 8192 x 28672: 50.5 us
// at M = 1 against the staged kernel's 70.4 (tools/qlinear_check --gemv).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common/cuda_dispatch.cuh"
#include "common/cuda_utils.cuh"
#include "attention/sm80/mma.cuh"
#include "common/dev_knobs.h"
#include "common/fast_div.cuh"
#include "matmul/qlinear_cuda.h"
#include "matmul/qlinear_dequant.cuh"
#include "matmul/qlinear_internal.h"
#include "matmul/qlinear_params.h"

namespace jaxgpu::cuda {
namespace qlinear {
namespace {

// The mma.sync and ldmatrix wrappers of the attention kernels.
using attention::sm80::Ldmatrix4;
using attention::sm80::MmaType;

// Build-time knobs for tuning runs (tools/qlinear_check.cu); the defaults are the measured
// best on the H100 (int4 g128, 8192 x 28672: M = 16 88 us with kNWT = 2 at 3 blocks/SM
// against 100 us with kNWT = 1 at 4 blocks/SM; M = 1 72 us either way).
#ifndef JAXGPU_QLINEAR_STAGE_BYTES
#define JAXGPU_QLINEAR_STAGE_BYTES 16384
#endif
#ifndef JAXGPU_QLINEAR_STAGES
#define JAXGPU_QLINEAR_STAGES 2
#endif
#ifndef JAXGPU_QLINEAR_NWT8
#define JAXGPU_QLINEAR_NWT8 1
#endif
#ifndef JAXGPU_QLINEAR_NWT16
#define JAXGPU_QLINEAR_NWT16 2
#endif
#ifndef JAXGPU_QLINEAR_MIN_BLOCKS8
#define JAXGPU_QLINEAR_MIN_BLOCKS8 4
#endif
#ifndef JAXGPU_QLINEAR_MIN_BLOCKS16
#define JAXGPU_QLINEAR_MIN_BLOCKS16 3
#endif
// The GEMV kernel's int8 with one token tile: k tiles per warp, the register ring's depth
// in n-tiles, and the L2 prefetch distance past it. 4 k tiles a warp (half the K splits,
// so half the reduction's traffic) with a ring of 1 n-tile, the L2 prefetch hiding HBM's
// latency, against 2 k tiles and a 2-deep ring: H200, tools/check_ab.sh qlinear, GEMV us,
// two rounds each, 8192 x 28672 / 28672 x 8192: M = 4 85 -> 82 / 89 -> 84 (per column),
// 96 -> 88 / 96 -> 88 (g128); M = 1 80 -> 78 / 82 -> 81; the int4 rows, which the change
// does not touch, moved 1-3% the same way (the order of the builds).
#ifndef JAXGPU_QLINEAR_GEMV_KS8
#define JAXGPU_QLINEAR_GEMV_KS8 4
#endif
#ifndef JAXGPU_QLINEAR_GEMV_DEPTH8
#define JAXGPU_QLINEAR_GEMV_DEPTH8 1
#endif
#ifndef JAXGPU_QLINEAR_GEMV_PREFETCH8
#define JAXGPU_QLINEAR_GEMV_PREFETCH8 2
#endif

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kStageWeightBytes = JAXGPU_QLINEAR_STAGE_BYTES;  // packed weight bytes per stage
constexpr int kMaxSplits = 32;
constexpr int64_t kMaxWorkspaceFloats = int64_t(1) << 22;

template <int kBits, int kMT>
struct Config {
  static constexpr int kNWT = kMT >= 32   ? 2
                              : kMT == 16 ? JAXGPU_QLINEAR_NWT16
                                          : JAXGPU_QLINEAR_NWT8;
  static constexpr int kNB = kWarps * kNWT;                   // n-tiles per block
  static constexpr int kFeat = kNB * kQTileN;                 // features per block
  static constexpr int kWordsPerTile = QWordsPerTile(kBits);  // host constexpr: a constant here
  static constexpr int kTileBytes = kWordsPerTile * 4;
  static constexpr int kChunksPerTile = kTileBytes / 16;
  static constexpr int kKS = kStageWeightBytes / (kNB * kTileBytes);  // k tiles per stage
  static constexpr int kStages = kMT >= 32 ? 3 : JAXGPU_QLINEAR_STAGES;
  // Resident blocks per SM asked of the register allocator (__launch_bounds__): 4 (<= 64
  // registers) at kMT = 8, 3 (<= 80) at kMT = 16; the 64+ accumulators of kMT >= 32 need
  // more than 128 registers, so 1. (sm_80 builds ask for at most 2: no spills there.)
  static constexpr int kMinBlocks = kMT >= 32   ? 1
                                    : kMT == 16 ? JAXGPU_QLINEAR_MIN_BLOCKS16
                                                : JAXGPU_QLINEAR_MIN_BLOCKS8;
  static constexpr int kXStride = kKS * kQTileK + 8;  // elements: odd 16-byte chunks per row
  static constexpr int kXBytes = kMT * kXStride * 2;
  static constexpr int kOutStride = kFeat + 4;  // floats: conflict-free fragment stores
  static constexpr int kOutBytes = kMT * kOutStride * 4;
  static constexpr int kMaxRows = kKS * 4;  // scale rows a stage can touch (one per k16 step)
  static_assert(kKS >= 1 && kKS * kNB * kTileBytes == kStageWeightBytes, "whole tiles");
  static_assert(kStageWeightBytes / 16 % kThreads == 0, "equal copy work per thread");
};

__host__ __device__ constexpr int Align16(int bytes) { return (bytes + 15) / 16 * 16; }

// Shared-memory bytes of one stage for `rows` scale rows per stage.
template <int kBits, int kMT>
__host__ __device__ constexpr int StageBytes(int rows) {
  using C = Config<kBits, kMT>;
  return kStageWeightBytes + C::kXBytes + Align16(rows * C::kFeat * 2) + Align16(rows * C::kFeat);
}

struct Args {
  QLinearParams p;
  int64_t kt, nt;  // k tiles, n tiles
  int nblocks;     // n-blocks of kNB tiles
  int mchunks;     // token chunks of kMT
  int splits;      // k splits (1: the main kernel writes y)
  int tiles_per_split;
  int scale_rows;           // K / group_size
  int stage_rows;           // scale rows reserved per stage
  int stage_bytes;          // bytes per stage (16-aligned)
  FastDiv steps_per_group;  // group_size / 16 (unused when scale_rows == 1)
  bool fast_x;              // x rows 16-byte aligned (K % 8 == 0, aligned base): cp.async
  bool fast_s;              // scale / zero rows 16 / 8-byte aligned (N % 8 == 0): cp.async
};

// The scale row of the k16 step j (k = 16 j ..): j / (group_size / 16), clamped so that
// the padding past K belongs to the last group; one row when group_size == K.
__device__ __forceinline__ int GroupOf(const Args& a, int j) {
  if (a.scale_rows == 1) return 0;
  const int r = int(Div(a.steps_per_group, uint32_t(j)));
  return r < a.scale_rows - 1 ? r : a.scale_rows - 1;
}

__device__ __forceinline__ void CpAsync(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void CpAsync8(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 8 : 0)
               : "memory");
}
__device__ __forceinline__ uint32_t Smem(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The blocks per SM __launch_bounds__ asks for: Config::kMinBlocks on sm_90, at most 2 on
// older GPUs (their 64-register budget at 4 blocks spilled).
template <int kBits, int kMT>
__host__ __device__ constexpr int LaunchMinBlocks() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  return Config<kBits, kMT>::kMinBlocks < 2 ? Config<kBits, kMT>::kMinBlocks : 2;
#else
  return Config<kBits, kMT>::kMinBlocks;
#endif
}

template <typename T, int kBits, int kMT, bool kTileGroups>
__global__ void __launch_bounds__(kThreads, (LaunchMinBlocks<kBits, kMT>()))
    QLinearKernel(const Args a) {
  using C = Config<kBits, kMT>;
  using D = Dequant<T, kBits>;
  constexpr int kNWT = C::kNWT, kNB = C::kNB, kKS = C::kKS, kStages = C::kStages;
  constexpr int kTG = kMT / 8;  // token groups of 8 (mma n)
  extern __shared__ __align__(16) unsigned char smem[];
  const QLinearParams& p = a.p;

  int64_t bid = blockIdx.x;
  const int mc = int(bid % a.mchunks);
  bid /= a.mchunks;
  const int nb = int(bid % a.nblocks);
  bid /= a.nblocks;
  const int split = int(bid % a.splits);
  const int64_t g = bid / a.splits;
  const int64_t gw = p.weight_groups == 1 ? 0 : g;
  const int64_t M = p.m, K = p.k, N = p.n;
  const int64_t KT = a.kt, NT = a.nt;
  const int m0 = mc * kMT;
  const int mvalid = int(M - m0 < kMT ? M - m0 : kMT);
  const int64_t nt0 = int64_t(nb) * kNB;
  const int64_t n0 = nt0 * kQTileN;
  const int kt0 = split * a.tiles_per_split;
  const int kt_end = int(kt0 + a.tiles_per_split < KT ? kt0 + a.tiles_per_split : KT);
  const int num_stages = (kt_end - kt0 + kKS - 1) / kKS;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int scale_off = kStageWeightBytes + C::kXBytes;
  const int zero_off = scale_off + Align16(a.stage_rows * C::kFeat * 2);
  const bool has_zeros = p.zeros != nullptr;

  const int32_t* wg = p.packed + gw * KT * NT * C::kWordsPerTile;
  const T* xg = static_cast<const T*>(p.x) + (g * M + m0) * K;
  const int64_t R = a.scale_rows;
  const uint16_t* sg = static_cast<const uint16_t*>(p.scales) + gw * R * N + n0;
  const uint8_t* zg = has_zeros ? p.zeros + gw * R * N + n0 : nullptr;

  // Issues the copies of stage `st` (k tiles kt0 + kKS st ..) into its ring slot.
  // Per-thread weight copy slots: pass i copies chunk tid + 256 i of the stage (run kk_i,
  // tile tile_i); its shared-memory offset and whether the tile exists are fixed per block.
  constexpr int kRunChunks = kNB * C::kChunksPerTile;  // chunks per k tile: a multiple of 256
  constexpr int kPasses = kStageWeightBytes / 16 / kThreads;
  static_assert(kRunChunks % kThreads == 0, "a pass copies within one run");
  const int64_t row_words = NT * C::kWordsPerTile;  // words per k tile (all n-tiles)
  const int32_t* w_thread = wg + nt0 * C::kWordsPerTile + threadIdx.x * 4;
  int dst_off[kPasses];
  uint32_t tile_ok = 0;
#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
    const int kk = i * kThreads / kRunChunks;
    const int r = threadIdx.x + (i * kThreads) % kRunChunks;
    const int tile = r / C::kChunksPerTile;
    int dst_chunk = threadIdx.x + i * kThreads;
    if constexpr (kBits == 8) {
      // An int8 lane's 32 bytes land as two 16-byte halves 512 bytes apart, so that the
      // lanes' LDS.128 of one half read 512 contiguous bytes (no bank conflicts).
      const int within = r % C::kChunksPerTile;  // 2 lane + half
      dst_chunk = (kk * kNB + tile) * 64 + (within & 1) * 32 + (within >> 1);
    }
    dst_off[i] = dst_chunk * 16;
    if (nt0 + tile < NT) tile_ok |= 1u << i;
  }

  // Issues the copies of stage `st` (k tiles kt0 + kKS st ..) into its ring slot.
  auto load_stage = [&](int st) {
    unsigned char* base = smem + (st % kStages) * a.stage_bytes;
    const int ktb = kt0 + st * kKS;
    // Weights: kKS runs of kNB contiguous tiles. Tiles past the split or past N are not
    // copied: no warp reads them for an output it writes.
    {
      const uint32_t sbase = Smem(base);
      const int32_t* wrow = w_thread + int64_t(ktb) * row_words;
#pragma unroll
      for (int i = 0; i < kPasses; ++i) {
        const int kk = i * kThreads / kRunChunks;
        if (ktb + kk < kt_end && (tile_ok >> i & 1u)) {
          const int32_t* src = wrow + kk * row_words + ((i * kThreads) % kRunChunks) * 4;
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sbase + dst_off[i]),
                       "l"(src)
                       : "memory");
        }
      }
    }
    // x: mvalid rows of kKS * 64 k (rows past M were zeroed once; k past K zero-filled).
    T* xs = reinterpret_cast<T*>(base + kStageWeightBytes);
    const int64_t kb = int64_t(ktb) * kQTileK;
    constexpr int kRowChunks = kKS * kQTileK / 8;
    if (a.fast_x) {
#pragma unroll 1
      for (int c = threadIdx.x; c < mvalid * kRowChunks; c += kThreads) {
        const int row = c / kRowChunks, ck = c % kRowChunks;
        const int64_t k = kb + ck * 8;
        const bool ok = k < K;
        CpAsync(Smem(xs + row * C::kXStride + ck * 8), ok ? xg + row * K + k : xg, ok);
      }
    } else {
#pragma unroll 1
      for (int c = threadIdx.x; c < mvalid * kKS * kQTileK; c += kThreads) {
        const int row = c / (kKS * kQTileK), kc = c % (kKS * kQTileK);
        const int64_t k = kb + kc;
        xs[row * C::kXStride + kc] = k < K ? xg[row * K + k] : FromFloat<T>(0.f);
      }
    }
    // Scale and zero rows r0 .. r1 of the stage's k16 steps.
    const int last = (ktb + kKS < kt_end ? ktb + kKS : kt_end) * 4 - 1;
    const int r0 = GroupOf(a, ktb * 4);
    const int nrows = GroupOf(a, last) - r0 + 1;
    uint16_t* ss = reinterpret_cast<uint16_t*>(base + scale_off);
    uint8_t* zs = base + zero_off;
    const uint16_t* srow = sg + int64_t(r0) * N;
    const uint8_t* zrow = has_zeros ? zg + int64_t(r0) * N : nullptr;
    if (a.fast_s) {
      constexpr int kRowChunks8 = C::kFeat / 8;
#pragma unroll 1
      for (int c = threadIdx.x; c < nrows * kRowChunks8; c += kThreads) {
        const int row = c / kRowChunks8, ck = c % kRowChunks8;
        const bool ok = n0 + ck * 8 < N;
        const int64_t at = ok ? row * N + ck * 8 : 0;
        CpAsync(Smem(ss + row * C::kFeat + ck * 8), srow + at, ok);
        if (has_zeros) CpAsync8(Smem(zs + row * C::kFeat + ck * 8), zrow + at, ok);
      }
    } else {
#pragma unroll 1
      for (int c = threadIdx.x; c < nrows * C::kFeat; c += kThreads) {
        const int row = c / C::kFeat, f = c % C::kFeat;
        const bool ok = n0 + f < N;
        ss[row * C::kFeat + f] = ok ? srow[row * N + f] : uint16_t(0);
        if (has_zeros) zs[row * C::kFeat + f] = ok ? zrow[row * N + f] : uint8_t(0);
      }
    }
  };

  // Token rows past M stay zero in every stage's x tile.
  if (mvalid < kMT) {
    for (int st = 0; st < kStages; ++st) {
      T* xs = reinterpret_cast<T*>(smem + st * a.stage_bytes + kStageWeightBytes);
      uint32_t* rows = reinterpret_cast<uint32_t*>(xs + mvalid * C::kXStride);
      const int words = (kMT - mvalid) * C::kXStride / 2;
#pragma unroll 1
      for (int i = threadIdx.x; i < words; i += kThreads) rows[i] = 0u;
    }
  }

#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (st < num_stages) load_stage(st);
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  }

  // Accumulator chains: with one n-tile and one token group a warp's MMAs would all chain
  // on one accumulator (~30 cycles each); two chains (odd and even k16 steps, summed at the
  // end in a fixed order) halve that dependency.
  constexpr int kChains = kNWT * kTG <= 2 ? 2 : 1;
  float acc[kChains][kNWT][kTG][4];
#pragma unroll
  for (int ch = 0; ch < kChains; ++ch)
#pragma unroll
    for (int t = 0; t < kNWT; ++t)
#pragma unroll
      for (int tg = 0; tg < kTG; ++tg)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[ch][t][tg][e] = 0.f;

  const bool warp_active = nt0 + warp * kNWT < NT;
  const int ntg = (mvalid + 7) / 8;
  const int gq = lane >> 2;
  // ldmatrix row address of this lane within a token group and a step pair: token
  // (lane & 7), k offset 8 (lane >> 3): matrices (k 0-7, 8-15) of step 2sp, then 2sp + 1.
  const int x_lane_off = ((lane & 7) * C::kXStride + (lane >> 3) * 8) * 2;

  D dq[kNWT];
  int cur_group = -1;
  for (int st = 0; st < num_stages; ++st) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 2) : "memory");
    __syncthreads();  // stage st landed for every thread; stage st - 1 is consumed
    if (st + kStages - 1 < num_stages) load_stage(st + kStages - 1);
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    if (!warp_active) continue;

    const unsigned char* base = smem + (st % kStages) * a.stage_bytes;
    const uint32_t x_base = Smem(base + kStageWeightBytes) + x_lane_off;
    const uint16_t* ss = reinterpret_cast<const uint16_t*>(base + scale_off);
    const uint8_t* zs = base + zero_off;
    const int ktb = kt0 + st * kKS;
    const int r0 = GroupOf(a, ktb * 4);
#pragma unroll
    for (int kk = 0; kk < kKS; ++kk) {
      if (ktb + kk >= kt_end) break;
      uint32_t w[kNWT][C::kTileBytes / 128];
#pragma unroll
      for (int t = 0; t < kNWT; ++t) {
        const unsigned char* tile = base + (kk * kNB + warp * kNWT + t) * C::kTileBytes;
#pragma unroll
        for (int half = 0; half < C::kTileBytes / 512; ++half) {
          const uint4 v = *reinterpret_cast<const uint4*>(tile + half * 512 + lane * 16);
          w[t][4 * half + 0] = v.x;
          w[t][4 * half + 1] = v.y;
          w[t][4 * half + 2] = v.z;
          w[t][4 * half + 3] = v.w;
        }
      }
      if constexpr (kTileGroups) {
        // A group spans whole tiles: reload the lane's constants only when it changes (every
        // group_size / 64 tiles; the registers stay valid across stages).
        const int grp = GroupOf(a, (ktb + kk) * 4);
        if (grp != cur_group) {
          cur_group = grp;
          const int row = grp - r0;
#pragma unroll
          for (int t = 0; t < kNWT; ++t) {
            dq[t].Load(ss + row * C::kFeat, zs + row * C::kFeat, (warp * kNWT + t) * 16 + gq,
                       has_zeros);
          }
        }
      }
#pragma unroll
      for (int sp = 0; sp < 2; ++sp) {
        uint32_t af[kNWT][2][4];
#pragma unroll
        for (int t = 0; t < kNWT; ++t) {
#pragma unroll
          for (int s2 = 0; s2 < 2; ++s2) {
            if constexpr (!kTileGroups) {
              const int row = GroupOf(a, (ktb + kk) * 4 + 2 * sp + s2) - r0;
              dq[t].Load(ss + row * C::kFeat, zs + row * C::kFeat, (warp * kNWT + t) * 16 + gq,
                         has_zeros);
            }
            dq[t].Step(af[t][s2], w[t], 2 * sp + s2);
          }
        }
#pragma unroll
        for (int tg = 0; tg < kTG; ++tg) {
          if (kTG == 1 || tg < ntg) {
            uint32_t b[4];
            Ldmatrix4(b, x_base + (tg * 8 * C::kXStride + kk * kQTileK + sp * 32) * 2);
#pragma unroll
            for (int t = 0; t < kNWT; ++t) {
              MmaType<T>::Mma(acc[0][t][tg], af[t][0], b[0], b[1]);
              MmaType<T>::Mma(acc[kChains - 1][t][tg], af[t][1], b[2], b[3]);
            }
          }
        }
      }
    }
  }

  // Epilogue: the accumulators through shared memory (token-major, feature contiguous), then
  // coalesced stores of y (or of this split's partial sums).
  if constexpr (kChains == 2) {
#pragma unroll
    for (int t = 0; t < kNWT; ++t)
#pragma unroll
      for (int tg = 0; tg < kTG; ++tg)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[0][t][tg][e] += acc[1][t][tg][e];
  }
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
  __syncthreads();
  float* out = reinterpret_cast<float*>(smem);
  {
    const int t4 = lane & 3;
#pragma unroll
    for (int t = 0; t < kNWT; ++t) {
      const int f = (warp * kNWT + t) * 16 + gq;
#pragma unroll
      for (int tg = 0; tg < kTG; ++tg) {
        const int tok = tg * 8 + 2 * t4;
        out[tok * C::kOutStride + f] = acc[0][t][tg][0];
        out[(tok + 1) * C::kOutStride + f] = acc[0][t][tg][1];
        out[tok * C::kOutStride + f + 8] = acc[0][t][tg][2];
        out[(tok + 1) * C::kOutStride + f + 8] = acc[0][t][tg][3];
      }
    }
  }
  __syncthreads();
  const int64_t row0 = g * M + m0;
  if (a.splits == 1) {
    T* y = static_cast<T*>(p.y);
#pragma unroll 1
    for (int i = threadIdx.x; i < mvalid * C::kFeat; i += kThreads) {
      const int tok = i / C::kFeat, f = i % C::kFeat;
      const int64_t n = n0 + f;
      if (n < N) {
        const float v = Finish<T>(p, out[tok * C::kOutStride + f], g, n);
        y[(row0 + tok) * N + n] = FromFloat<T>(v);
      }
    }
  } else {
    float* ws = p.workspace + int64_t(split) * p.groups * M * N;
#pragma unroll 1
    for (int i = threadIdx.x; i < mvalid * C::kFeat; i += kThreads) {
      const int tok = i / C::kFeat, f = i % C::kFeat;
      const int64_t n = n0 + f;
      if (n < N) ws[(row0 + tok) * N + n] = out[tok * C::kOutStride + f];
    }
  }
}

// Sums the splits' partial sums in split order, adds the bias, applies the activation and
// rounds once to T. splits == 0 (K == 0): y = act(bias).
template <typename T>
__global__ void __launch_bounds__(256) QLinearReduceKernel(const QLinearParams p, int splits) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Launched as the products' programmatic dependent (LaunchReduce): wait until their grid
  // has completed and its partial sums are visible.
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
  const int64_t total = p.groups * p.m * p.n;
  const int64_t mn = p.m * p.n;
  T* y = static_cast<T*>(p.y);
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    float v = 0.f;
    for (int s = 0; s < splits; ++s) v += p.workspace[s * total + e];
    y[e] = FromFloat<T>(Finish<T>(p, v, e / mn, e % p.n));
  }
}

// Developer knob (common/dev_knobs.h): JAXGPU_QLINEAR_PDL=-1 launches the split-K reduction
// after the products' kernel without programmatic dependent launch.
const DevKnob& ReduceKnob() {
  static const DevKnob knob = ReadDevKnob("JAXGPU_QLINEAR_PDL");
  return knob;
}

// The split-K reduction after the products' kernel. On sm_90+ it is that kernel's
// programmatic dependent: its launch overlaps the products' last blocks instead of following
// their completion (QLinearReduceKernel waits for it in griddepcontrol.wait).
// Blocks of QLinearReduceKernel: one 256-thread block per 256 outputs, at most 8 per SM
// (each block strides over the rest).
inline unsigned ReduceBlocks(const QLinearParams& p, int sms) {
  const int64_t blocks = CeilDiv(p.groups * p.m * p.n, 256);
  const int64_t cap = int64_t(sms) * 8;
  return unsigned(blocks < cap ? blocks : cap);
}

template <typename T>
cudaError_t LaunchReduce(const QLinearParams& p, int splits, int sms, int device,
                         cudaStream_t stream) {
  static std::atomic<int> major_cache[kMaxDevices];
  const bool pdl = DeviceAttribute(cudaDevAttrComputeCapabilityMajor, major_cache, device) >= 9 &&
                   !(kDevKnobs && ReduceKnob().ints[0] == -1);
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(ReduceBlocks(p, sms));
  cfg.blockDim = dim3(256);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, QLinearReduceKernel<T>, p, splits);
}

// Splits of K for `base` blocks over kt k tiles: as many as fill the resident slots in one
// wave, at most what the workspace holds and at least one stage (ks tiles) per split.
int ChooseSplits(int64_t base, int64_t kt, int ks, int slots, int64_t out_elems,
                 int64_t workspace_floats) {
  int max_splits = int(kt < kMaxSplits ? kt : kMaxSplits);
  const int64_t by_ws = out_elems > 0 ? workspace_floats / out_elems : 0;
  if (by_ws < max_splits) max_splits = int(by_ws);
  const int64_t by_stage = kt / ks;  // at least one full stage per split
  if (by_stage < max_splits) max_splits = int(by_stage);
  // A throughput model of the split count (per-block and total bandwidth, wave fill,
  // the reduction's cost) measured no better on the H100.
  int64_t splits = base < slots ? slots / base : 1;
  if (splits > max_splits) splits = max_splits;
  return int(splits < 1 ? 1 : splits);
}

template <typename T, int kBits, int kMT, bool kTileGroups>
cudaError_t Launch(const QLinearParams& p, cudaStream_t stream, int device, int sms,
                   int smem_per_sm) {
  using C = Config<kBits, kMT>;
  auto kernel = QLinearKernel<T, kBits, kMT, kTileGroups>;
  // Opt into the largest stage size once per device (the rows per stage vary).
  constexpr int kMaxSmem = C::kStages * StageBytes<kBits, kMT>(C::kMaxRows) > C::kOutBytes
                               ? C::kStages * StageBytes<kBits, kMT>(C::kMaxRows)
                               : C::kOutBytes;
  static std::atomic<bool> opted[kMaxDevices];
  const cudaError_t opt_err = OncePerDevice(opted, device, [&] {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSmem);
    // All of L1 as shared memory: the weights bypass L1 (cp.async.cg), and 2 blocks per SM
    // need ~2 x 100 KiB.
    return err != cudaSuccess
               ? err
               : cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100);
  });
  if (opt_err != cudaSuccess) return opt_err;

  Args a{};
  a.p = p;
  a.kt = QTilesK(p.k);
  a.nt = QTilesN(p.n);
  a.nblocks = int(CeilDiv(a.nt, C::kNB));
  a.mchunks = int(CeilDiv(p.m, kMT));
  a.scale_rows = int(QScaleRows(p));
  // Distinct groups among a stage's k16 steps (starting at a multiple of 64 k).
  int rows = C::kMaxRows;
  if (a.scale_rows == 1) {
    rows = 1;
  } else {
    const int64_t span = (C::kKS * kQTileK - 16) / p.group_size + 2;
    if (span < rows) rows = int(span);
  }
  a.stage_rows = rows;
  a.stage_bytes = StageBytes<kBits, kMT>(rows);
  a.steps_per_group = MakeFastDiv(a.scale_rows == 1 ? 1 : p.group_size / 16);
  const int smem_pipe = C::kStages * a.stage_bytes;
  const int smem = smem_pipe > C::kOutBytes ? smem_pipe : C::kOutBytes;
  const int per_sm = smem_per_sm / (smem + 1024);
  const int slots = sms * (per_sm < C::kMinBlocks ? (per_sm < 1 ? 1 : per_sm) : C::kMinBlocks);

  const int64_t base = p.groups * a.nblocks * a.mchunks;
  const int64_t out_elems = p.groups * p.m * p.n;
  const int64_t ws = p.workspace != nullptr ? p.workspace_floats : 0;
  a.splits = ChooseSplits(base, a.kt, C::kKS, slots, out_elems,
                          ws < kMaxWorkspaceFloats ? ws : kMaxWorkspaceFloats);
  a.tiles_per_split = int(CeilDiv(a.kt, a.splits));
  a.splits = int(CeilDiv(a.kt, a.tiles_per_split));
  a.fast_x = p.k % 8 == 0 && reinterpret_cast<uintptr_t>(p.x) % 16 == 0;
  a.fast_s = p.n % 8 == 0 && reinterpret_cast<uintptr_t>(p.scales) % 16 == 0 &&
             (p.zeros == nullptr || reinterpret_cast<uintptr_t>(p.zeros) % 8 == 0);

  const int64_t grid = base * a.splits;
  if (grid > 0x7fffffff) return cudaErrorInvalidConfiguration;
  kernel<<<unsigned(grid), kThreads, smem, stream>>>(a);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || a.splits == 1) return err;
  return LaunchReduce<T>(p, a.splits, sms, device, stream);
}

template <typename T, int kBits>
cudaError_t LaunchBits(const QLinearParams& p, cudaStream_t stream, int device, int sms,
                       int smem_per_sm) {
  const bool tile_groups = QScaleRows(p) == 1 || p.group_size % kQTileK == 0;
  const int mt = p.m <= 8 ? 8 : p.m <= 16 ? 16 : p.m <= 32 ? 32 : 64;
  return JAXGPU_INT_SWITCH(mt, kMT, (8, 16, 32, 64), [&] {
    return JAXGPU_BOOL_SWITCH(tile_groups, kTileGroups, [&] {
      return Launch<T, kBits, kMT, kTileGroups>(p, stream, device, sms, smem_per_sm);
    });
  });
}

// ---- The GEMV path (M <= 8, int8 16): weights from global memory into registers ----
//
// Mapping. A block of 8 warps owns nb n-tiles (a run of the n-tiles) and one K span of
// kw * kKS k tiles (kKS = 4 with one token tile, 2 with two); its warps are kw k-slices x
// nw n-groups (kw * nw = 8, kw the smallest power of two whose slices cover K, at most 8). Warp
// (ks, ng) loads the B fragments of x for its kKS k tiles into registers once, then walks
// the block's n-tiles ng, ng + nw, ... over its k-slice. No shared memory, cp.async or
// barrier stands in the weight path: every lane loads its own 16 (int4) or 32 (int8)
// contiguous bytes of a tile with 128-bit ld.global.nc (L1 no-allocate) into a register
// ring kDepth n-tiles ahead of its use (2, int8 with one token tile 1: 4 KiB a warp); a
// tile's registers are refilled with the tile kDepth n-tiles later as soon as they are
// dequantized (int8 with one token tile also prefetches the tiles 2 n-tiles past the ring
// into L2). x is one mma n8 token tile up to M = 8 and two up to 16 (kNT; each A
// fragment then feeds two mma): the second tile's 8 kKS x registers would take int4 past
// the 128 of 2 blocks per SM, so int4 walks 2 k tiles a warp there instead of 4.
// Scales and zeros. At the start the block copies the scale / zero rows its k span touches
// (cp.async, while the first weight loads are in flight), then turns them into the Dequant
// constants of each (row, n-tile, gq) (Dequant::Load; a 16-byte entry for h = 0 and 1) in
// shared memory; a lane reads one entry (LDS.128) per tile.
// Reduction. After each n-tile a warp stores its 16 x M partial sums into its own slot of
// a shared float buffer [ks][n-tile][token][feature]; at the end the block sums the kw
// slots in ks order and either finishes y (one K span) or writes its split's partial sums
// to the workspace for QLinearReduceKernel: bitwise deterministic. Every K span is its own
// split, so the path needs a workspace of one partial sum per span (GemvEligible; the
// staged kernel serves the rest).
// kNT: mma n8 token tiles (M <= 8 kNT). Two tiles double x's registers, so int4 takes 2 k
// tiles a warp there (x: 2 x 16 x kKS registers).
__host__ __device__ constexpr int GemvKTilesPerWarp(int bits, int nt) {
  return nt != 1 ? 2 : bits == 4 ? 4 : JAXGPU_QLINEAR_GEMV_KS8;
}
// Rows of x the GEMV kernel serves: 8 (one token tile), int8 16 (two). At M = 16 (H200,
// 8192 x 28672 and 28672 x 8192) the int8 GEMV kernel took 118-135 us against the staged
// kernel's 143-154, but int4, down to 2 k tiles a warp, 98-100 against 75-85.
constexpr int GemvMaxM(int bits) { return bits == 8 ? 16 : 8; }
// Token tiles of the GEMV kernel for m rows.
constexpr int GemvTokenTiles(int64_t m) { return m <= 8 ? 1 : 2; }

template <int kBits, int kNT = 1>
struct GemvConfig {
  static constexpr int kKS = GemvKTilesPerWarp(kBits, kNT);  // k tiles per warp slice
  // n-tiles of loads in flight per warp
  static constexpr int kDepth = kBits == 8 && kNT == 1 ? JAXGPU_QLINEAR_GEMV_DEPTH8 : 2;
  // n-tiles past the register ring whose weights are prefetched into L2 (0: none). H100,
  // 8192 x 28672 and 28672 x 8192, M = 1 (tools/qlinear_check, two runs each): int8 94-96 us
  // with 2 against 102-103 without (1 or 3: 96-99); int4 57-59 either way (its loop is
  // bound by the widening, not by load latency) and int8 at M = 16 1% slower, so only int8
  // with one token tile prefetches.
  static constexpr int kPrefetch = kBits == 8 && kNT == 1 ? JAXGPU_QLINEAR_GEMV_PREFETCH8 : 0;
  static constexpr int kWPL = QWordsPerLane(kBits);  // 32-bit words per lane per tile
  static constexpr int kWPT = QWordsPerTile(kBits);  // words per tile
};
constexpr int kGemvMinBlocks = 2;            // resident blocks per SM: <= 128 registers
constexpr int kGemvSmemBudget = 100 * 1024;  // shared bytes per block (2 per SM on an H100)
constexpr int kGemvEntryBytes = 16;          // Dequant constants of (row, n-tile, gq)

struct GemvArgs {
  QLinearParams p;
  int64_t kt, nt;       // k tiles, n tiles
  int kw, nw;           // warps per block: kw k-slices x nw n-groups
  int nb;               // n-tiles per block
  int nblocks;          // blocks along N
  int splits;           // K splits over the grid (one per block's k span)
  int round_tiles;      // k tiles per block: kw * kKS
  int scale_rows;       // K / group_size
  int tiles_per_group;  // group_size / 64 (unused when scale_rows == 1)
  int slab_rows;        // scale rows a block's k span can touch
  int out_off;          // byte offset of the partial-sum buffer in shared memory
  int raw_off;          // byte offsets of the raw scale rows (slab_rows x nb * 16 T) and
  int raw_z_off;        //   zero rows (uint8) of a round
  bool fast_s;          // scale / zero rows 16 / 8-byte aligned (N % 8 == 0): cp.async
  bool x_pairs;         // K even and x 4-byte aligned: x pairs as one 32-bit load
};

// The scale row of k tile kt (tile groups: whole tiles per group).
__device__ __forceinline__ int GemvRowOf(const GemvArgs& a, int kt) {
  return a.scale_rows == 1 ? 0 : kt / a.tiles_per_group;
}

// One lane's words of a tile (kWPL / 4 128-bit loads), only where `pred`: non-coherent,
// no L1 allocation (each byte is read once). volatile keeps the loads where the ring puts
// them (ahead of the math that would otherwise pull them next to their use).
template <int kWPL>
__device__ __forceinline__ void GemvLoadTile(uint32_t (&w)[kWPL], const int32_t* src, bool pred) {
#pragma unroll
  for (int h = 0; h < kWPL / 4; ++h) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %5, 0;\n"
        "@p ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n}\n"
        : "+r"(w[4 * h]), "+r"(w[4 * h + 1]), "+r"(w[4 * h + 2]), "+r"(w[4 * h + 3])
        : "l"(src + 4 * h), "r"(int(pred)));
  }
}

// A hint that moves a lane's line of a later tile from HBM into L2 (no registers held), so
// that the ring's load of it waits on L2's latency instead of HBM's.
__device__ __forceinline__ void GemvPrefetchL2(const int32_t* src, bool pred) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %1, 0;\n"
      "@p prefetch.global.L2 [%0];\n}\n" ::"l"(src),
      "r"(int(pred)));
}

__device__ __forceinline__ uint4 LdShared128(uint32_t at) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(at));
  return v;
}
__device__ __forceinline__ void StShared(uint32_t at, float v) {
  asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(at), "f"(v) : "memory");
}

template <typename T, int kBits, int kNT>
__global__ void __launch_bounds__(kThreads, kGemvMinBlocks) QLinearGemvKernel(const GemvArgs a) {
  using GC = GemvConfig<kBits, kNT>;
  using D = Dequant<T, kBits>;
  constexpr int kKS = GC::kKS, kDepth = GC::kDepth, kWPL = GC::kWPL, kWPT = GC::kWPT;
  extern __shared__ __align__(16) unsigned char smem[];
  const QLinearParams& p = a.p;

  const uint32_t bid = blockIdx.x;  // the grid is below 2^31 blocks
  const int nblk = int(bid % uint32_t(a.nblocks));
  const int split = int(bid / uint32_t(a.nblocks) % uint32_t(a.splits));
  const int64_t g = bid / uint32_t(a.nblocks) / uint32_t(a.splits);
  const int64_t gw = p.weight_groups == 1 ? 0 : g;
  const int M = int(p.m);
  const int64_t K = p.k, N = p.n, KT = a.kt, NT = a.nt;
  const int64_t nt0 = int64_t(nblk) * a.nb;
  const int nbl = int(NT - nt0 < a.nb ? NT - nt0 : a.nb);  // n-tiles of this block
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gq = lane >> 2, tq = lane & 3;
  const int ks = warp % a.kw, ng = warp / a.kw;
  const int cnt = ng < nbl ? (nbl - ng + a.nw - 1) / a.nw : 0;  // n-tiles this warp walks
  const int kt_s0 = split * a.round_tiles;
  const int kt_s1 = int(kt_s0 + a.round_tiles < KT ? kt_s0 + a.round_tiles : KT);
  const bool has_zeros = p.zeros != nullptr;

  uint4* slab = reinterpret_cast<uint4*>(smem);
  const float* out = reinterpret_cast<const float*>(smem + a.out_off);
  const uint32_t slab_s = Smem(smem), out_s = Smem(smem + a.out_off);
  const uint32_t raw_s = Smem(smem + a.raw_off), raw_z = Smem(smem + a.raw_z_off);
  const int kF = a.nb * kQTileN;  // features per raw row
  const int64_t n0 = nt0 * kQTileN;
  const int32_t* w_lane = p.packed + gw * KT * NT * kWPT + lane * kWPL;
  // Words between k tiles and between this warp's n-tiles (32-bit: GemvEligible bounds
  // kKS * NT * kWPT).
  const int kstride = int(NT * kWPT);
  const int nstride = a.nw * kWPT;
  const T* xg = static_cast<const T*>(p.x) + g * M * K;
  const uint16_t* sg = static_cast<const uint16_t*>(p.scales) + gw * a.scale_rows * N;
  const uint8_t* zg = has_zeros ? p.zeros + gw * a.scale_rows * N : nullptr;

  {
    const int kr0 = kt_s0, kr1 = kt_s1;
    const int kw0 = kr0 + ks * kKS;  // the warp's first k tile
    uint32_t kvalid = 0;
#pragma unroll
    for (int kk = 0; kk < kKS; ++kk) kvalid |= (kw0 + kk < kr1 ? 1u : 0u) << kk;

    // 1. The first kDepth n-tiles of weights: in flight while the scales and x load.
    const int32_t* w_warp = w_lane + (int64_t(kw0) * NT + nt0 + ng) * kWPT;
    uint32_t w[kDepth][kKS][kWPL];
#pragma unroll
    for (int d = 0; d < kDepth; ++d)
#pragma unroll
      for (int kk = 0; kk < kKS; ++kk) {
#pragma unroll
        for (int i = 0; i < kWPL; ++i) w[d][kk][i] = 0u;
        GemvLoadTile<kWPL>(w[d][kk], w_warp + kk * kstride + d * nstride,
                           (kvalid >> kk & 1u) && d < cnt);
      }

    // 2. The raw scale / zero rows row0 .. row0 + nrows - 1 of the block's features into
    // shared memory (cp.async: no registers held; zero past N).
    const int row0 = GemvRowOf(a, kr0);
    const int nrows = GemvRowOf(a, kr1 - 1) - row0 + 1;
    {
      const int chunks = nrows * nbl * 2;  // 8 features each
#pragma unroll 1
      for (int c = threadIdx.x; c < chunks; c += kThreads) {
        const int row = c / (nbl * 2), f = c % (nbl * 2) * 8;
        const bool ok = n0 + f < N;
        const int64_t at = ok ? (row0 + row) * N + n0 + f : 0;
        if (a.fast_s) {
          CpAsync(raw_s + uint32_t((row * kF + f) * 2), sg + at, ok);
          if (has_zeros) CpAsync8(raw_z + uint32_t(row * kF + f), zg + at, ok);
        } else {
          uint16_t* rs = reinterpret_cast<uint16_t*>(smem + a.raw_off) + row * kF + f;
          uint8_t* rz = smem + a.raw_z_off + row * kF + f;
#pragma unroll 1
          for (int e = 0; e < 8; ++e) {
            const bool oke = n0 + f + e < N;
            rs[e] = oke ? sg[at + e] : uint16_t(0);
            if (has_zeros) rz[e] = oke ? zg[at + e] : uint8_t(0);
          }
        }
      }
      asm volatile("cp.async.commit_group;\n" ::: "memory");
    }

    // 3. x's B fragments of the warp's k-slice: token 8 nt + gq of token tile nt, k pairs
    // 2 tq (+ 8) of each k16 step; zero past M and past K.
    uint32_t xb[kNT][kKS][4][2];
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
      const int tok = 8 * nt + gq;
      const int64_t kl0 = int64_t(kw0) * kQTileK + 2 * tq;
      const T* xr = xg + int64_t(tok < M ? tok : 0) * K + kl0;
      const int64_t left = tok < M ? K - kl0 : 0;  // x elements of the row from xr on
      const int lim = left < kKS * kQTileK ? int(left) : kKS * kQTileK;
      const unsigned short* xh = reinterpret_cast<const unsigned short*>(xr);
      if (a.x_pairs) {
        const unsigned int* xw = reinterpret_cast<const unsigned int*>(xr);
#pragma unroll
        for (int kk = 0; kk < kKS; ++kk)
#pragma unroll
          for (int s = 0; s < 4; ++s)
#pragma unroll
            for (int hb = 0; hb < 2; ++hb) {
              const int o = kk * kQTileK + 16 * s + 8 * hb;
              xb[nt][kk][s][hb] = o < lim ? __ldg(xw + o / 2) : 0u;
            }
      } else {
#pragma unroll
        for (int kk = 0; kk < kKS; ++kk)
#pragma unroll
          for (int s = 0; s < 4; ++s)
#pragma unroll
            for (int hb = 0; hb < 2; ++hb) {
              const int o = kk * kQTileK + 16 * s + 8 * hb;
              const uint32_t lo = o < lim ? __ldg(xh + o) : 0u;
              const uint32_t hi = o + 1 < lim ? __ldg(xh + o + 1) : 0u;
              xb[nt][kk][s][hb] = lo | hi << 16;
            }
      }
    }

    // 4. The raw rows turned into the Dequant constants of each (row, n-tile, gq): one
    // 16-byte entry (h = 0 and 1) per lane and tile in the loop.
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    __syncthreads();
    {
      const uint16_t* rs = reinterpret_cast<const uint16_t*>(smem + a.raw_off);
      const uint8_t* rz = smem + a.raw_z_off;
#pragma unroll 1
      for (int e = threadIdx.x; e < nrows * nbl * 8; e += kThreads) {
        const int row = e / (nbl * 8), rem = e % (nbl * 8);
        D dq;
        dq.Load(rs + row * kF, rz + row * kF, rem / 8 * kQTileN + rem % 8, has_zeros);
        uint4 v;
        if constexpr (D::kFloatPath) {
          v = make_uint4(__float_as_uint(dq.scalef[0]), __float_as_uint(dq.negf[0]),
                         __float_as_uint(dq.scalef[1]), __float_as_uint(dq.negf[1]));
        } else {
          v = make_uint4(dq.scale[0], dq.neg[0], dq.scale[1], dq.neg[1]);
        }
        slab[((rem / 8) * a.slab_rows + row) * 8 + rem % 8] = v;
      }
    }
    __syncthreads();

    // The slab is n-tile major ([j][row][gq]): the entry of the warp's k tile kk in n-tile j
    // is slab_w + j * slab_rows * 128 + (byte kk of rows4) * 128 (tiles past the split read
    // the last row; their x is zero, so they add exact zeros).
    uint32_t rows4 = 0;  // byte kk: the row of k tile kk less the row of tile 0
#pragma unroll
    for (int kk = 1; kk < kKS; ++kk) {
      const int kt = kw0 + kk < kr1 ? kw0 + kk : kr1 - 1;
      rows4 |= uint32_t(GemvRowOf(a, kt) - GemvRowOf(a, kw0 < kr1 ? kw0 : kr1 - 1)) << (8 * kk);
    }
    const uint32_t slab_w =
        slab_s +
        uint32_t(((GemvRowOf(a, kw0 < kr1 ? kw0 : kr1 - 1) - row0) * 8 + gq) * kGemvEntryBytes);

    // 4. The n-tiles: dequantize, refill the ring, mma. No branch per tile: a tile past the
    // split (only past K, where x is zero) is not loaded (its registers stay zero) but
    // multiplied like the others; the Dequant constants are read for every tile (one
    // LDS.128), cheaper than testing whether its group changed.
#pragma unroll 1
    for (int i0 = 0; i0 < cnt; i0 += kDepth) {
#pragma unroll
      for (int d = 0; d < kDepth; ++d) {
        const int i = i0 + d;
        // i == cnt (odd cnt, last pass): a phantom n-tile on the ring's stale words,
        // computed but not stored (no branch in the middle of the pass).
        const int j = ng + (i < cnt ? i : cnt - 1) * a.nw;  // block-local n-tile
        const uint32_t slab_j = slab_w + uint32_t(j * a.slab_rows * 8 * kGemvEntryBytes);
        const bool refill = i + kDepth < cnt;
        const int32_t* w_next = w_warp + (i + kDepth) * nstride;
        if constexpr (GC::kPrefetch > 0) {
          const bool pf = i + kDepth + GC::kPrefetch < cnt;
          const int32_t* w_pf = w_warp + (i + kDepth + GC::kPrefetch) * nstride;
#pragma unroll
          for (int kk = 0; kk < kKS; ++kk) {
            GemvPrefetchL2(w_pf + kk * kstride, pf && (kvalid >> kk & 1u));
          }
        }
        float acc[kNT][4] = {};
#pragma unroll
        for (int kk = 0; kk < kKS; ++kk) {
          const uint32_t row_off =
              kk == 0 ? 0u : (rows4 >> (8 * kk) & 0xffu) * uint32_t(8 * kGemvEntryBytes);
          const uint4 v = LdShared128(slab_j + row_off);
          D dq;
          if constexpr (D::kFloatPath) {
            dq.scalef[0] = __uint_as_float(v.x);
            dq.negf[0] = __uint_as_float(v.y);
            dq.scalef[1] = __uint_as_float(v.z);
            dq.negf[1] = __uint_as_float(v.w);
          } else {
            dq.scale[0] = v.x;
            dq.neg[0] = v.y;
            dq.scale[1] = v.z;
            dq.neg[1] = v.w;
          }
          // One mma per k16 step as soon as its A registers are ready (few live registers);
          // the refill right after the last step's dequantization read the tile's words.
#pragma unroll
          for (int s = 0; s < 4; ++s) {
            uint32_t af[4];
            dq.Step(af, w[d][kk], s);
            if (s == 3) {
              GemvLoadTile<kWPL>(w[d][kk], w_next + kk * kstride, refill && (kvalid >> kk & 1u));
            }
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt) {
              MmaType<T>::Mma(acc[nt], af, xb[nt][kk][s][0], xb[nt][kk][s][1]);
            }
          }
        }
        // acc[nt]: rows (features) gq and gq + 8, columns (tokens) 8 nt + 2 tq (+ 1).
        const uint32_t o = out_s + uint32_t(((ks * a.nb + j) * M * kQTileN) * 4);
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int tok = 8 * nt + 2 * tq + (e & 1);
            const int f = gq + 8 * (e >> 1);
            const uint32_t at = o + uint32_t((tok * kQTileN + f) * 4);
            if (tok < M && i < cnt) StShared(at, acc[nt][e]);
          }
      }
    }
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // The weights are read: the split-K reduction (a programmatic dependent) may start
  // launching; it waits for this grid's completion before reading the partial sums.
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
  __syncthreads();

  // The kw slices of each output summed in ks order; then y or this split's partial sums.
  // The block's coordinates are decoded again (not kept live across the loop above).
  uint32_t cta;
  asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(cta));
  const int e_nblk = int(cta % uint32_t(a.nblocks));
  const int e_split = int(cta / uint32_t(a.nblocks) % uint32_t(a.splits));
  const int64_t e_g = cta / uint32_t(a.nblocks) / uint32_t(a.splits);
  const int64_t e_nt0 = int64_t(e_nblk) * a.nb;
  const int e_nbl = int(NT - e_nt0 < a.nb ? NT - e_nt0 : a.nb);
  const int64_t row0 = e_g * M;
#pragma unroll 1
  for (int e = threadIdx.x; e < e_nbl * M * kQTileN; e += kThreads) {
    const int j = e / (M * kQTileN), rem = e % (M * kQTileN);
    const int tok = rem / kQTileN, f = rem % kQTileN;
    const int64_t n = (e_nt0 + j) * kQTileN + f;
    if (n >= N) continue;
    float v = 0.f;
    for (int s = 0; s < a.kw; ++s) v += out[((s * a.nb + j) * M + tok) * kQTileN + f];
    if (a.splits == 1) {
      static_cast<T*>(p.y)[(row0 + tok) * N + n] = FromFloat<T>(Finish<T>(p, v, e_g, n));
    } else {
      p.workspace[int64_t(e_split) * p.groups * p.m * N + (row0 + tok) * N + n] = v;
    }
  }
}

// The K side of the GEMV grid: kw k-slices per block (the smallest power of two covering
// K, at most 8) and the K splits (one per block span of kw * kKS k tiles).
struct GemvKPlan {
  int kw;
  int span;  // k tiles per block: kw * kKS
  int64_t splits;
};
GemvKPlan GemvPlanK(const QLinearParams& p) {
  const int ks = GemvKTilesPerWarp(p.bits, GemvTokenTiles(p.m));
  const int64_t need = CeilDiv(QTilesK(p.k), ks);
  GemvKPlan plan{1, 0, 0};
  while (plan.kw < kWarps && plan.kw < need) plan.kw *= 2;
  plan.span = plan.kw * ks;
  plan.splits = CeilDiv(QTilesK(p.k), int64_t(plan.span));
  return plan;
}

// The K splits the workspace holds for p (at least 1: no workspace needed).
int64_t GemvWorkspaceSplits(const QLinearParams& p) {
  const int64_t out_elems = p.groups * p.m * p.n;
  const int64_t ws =
      p.workspace != nullptr
          ? (p.workspace_floats < kMaxWorkspaceFloats ? p.workspace_floats : kMaxWorkspaceFloats)
          : 0;
  const int64_t by_ws = out_elems > 0 ? ws / out_elems : 0;
  return by_ws < 1 ? 1 : by_ws > kMaxSplits ? kMaxSplits : by_ws;
}

// Whether the GEMV path serves p: M <= GemvMaxM, whole tiles per scale group, and the
// workspace holding one partial sum per K split (QLinearWorkspaceFloats does up to K = 32 x 2048
// (int4) or 32 x 1024 (int8) while G M N <= 2^17).
bool GemvEligible(const QLinearParams& p) {
  if (p.m > GemvMaxM(p.bits) || p.k <= 0) return false;
  if (QScaleRows(p) != 1 && p.group_size % kQTileK != 0) return false;
  // 32-bit word offsets within a block's k span of the packed weight.
  const int64_t ks = GemvKTilesPerWarp(p.bits, GemvTokenTiles(p.m));
  if (QTilesN(p.n) * ks * QWordsPerTile(p.bits) >= (int64_t(1) << 31)) return false;
  return GemvPlanK(p).splits <= GemvWorkspaceSplits(p);
}

// Whether kAuto sends an eligible p to the GEMV kernel. Not int4 when K's last split is
// under half a block's span: that split's blocks keep one or two warps busy while the
// others' span costs a full one, and the staged kernel was faster there. H100, M = 1, per
// call from a CUDA graph on distinct weights (tools/qlinear_check --shape), staged / GEMV
// us: K 2304 (last split 4 of 32 k tiles) x N 1024, 2048, 4096, 9216, 18432: 5.7 / 6.4,
// 6.7 / 8.3, 7.9 / 9.0, 12.0 / 13.6, 16.7 / 18.6; K 2560 x 10240 12.6 / 13.9; K 4608 x 4608
// 11.6 / 12.0; K 6912 x 1152 7.9 / 8.9. Half a span or more (K 3072, 9216) ran alike; even
// splits mostly favour the GEMV kernel (8192 x 28672 63.8 / 52.3, 10240 x 2560 13.3 / 12.4,
// 1152 x 1024 6.0 / 4.9; but 2048 x 2304, one span, 6.4 / 6.9). int8 took the GEMV
// kernel's side at every shape.
bool GemvPreferred(const QLinearParams& p) {
  if (!GemvEligible(p)) return false;
  if (p.bits != 4) return true;
  const GemvKPlan plan = GemvPlanK(p);
  const int64_t last = QTilesK(p.k) - (plan.splits - 1) * plan.span;
  return plan.splits == 1 || 2 * last >= plan.span;
}

// Developer knob (common/dev_knobs.h, a JAXGPU_DEV_KNOBS build):
// JAXGPU_QLINEAR_GEMV=<path>[,<nb>]: path = -1 sends every call of LaunchQLinear to the
// staged kernel (default: the GEMV kernel where GemvPreferred); nb (> 0) forces the GEMV
// kernel's n-tiles per block (within the shared-memory budget).
const DevKnob& GemvKnob() {
  static const DevKnob knob = ReadDevKnob("JAXGPU_QLINEAR_GEMV");
  return knob;
}

template <typename T, int kBits, int kNT>
cudaError_t LaunchGemv(const QLinearParams& p, cudaStream_t stream, int device, int sms,
                       int smem_per_sm) {
  using GC = GemvConfig<kBits, kNT>;
  auto kernel = QLinearGemvKernel<T, kBits, kNT>;
  static std::atomic<bool> opted[kMaxDevices];
  const cudaError_t opt_err = OncePerDevice(opted, device, [&] {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kGemvSmemBudget);
    // All of L1 as shared memory (the weights are not cached in L1): 2 blocks of up to
    // 100 KiB per SM.
    return err != cudaSuccess
               ? err
               : cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100);
  });
  if (opt_err != cudaSuccess) return opt_err;
  const DevKnob& knob = GemvKnob();

  GemvArgs a{};
  a.p = p;
  a.kt = QTilesK(p.k);
  a.nt = QTilesN(p.n);
  const GemvKPlan plan = GemvPlanK(p);
  a.kw = plan.kw;
  a.nw = kWarps / a.kw;
  a.round_tiles = plan.span;
  a.splits = int(plan.splits);
  if (a.splits > GemvWorkspaceSplits(p)) return cudaErrorInvalidValue;  // not GemvEligible
  a.scale_rows = int(QScaleRows(p));
  a.tiles_per_group = a.scale_rows == 1 ? 1 : int(p.group_size / kQTileK);
  a.slab_rows = 1;
  if (a.scale_rows > 1) {
    const int span = (a.round_tiles - 1) / a.tiles_per_group + 2;
    a.slab_rows = span < a.scale_rows ? span : a.scale_rows;
  }

  // n-tiles per block, within the shared budget (the Dequant slab, the raw scale rows and
  // the partial sums grow with nb); 2 resident blocks per SM.
  const int per_nt = a.slab_rows * 8 * kGemvEntryBytes + a.kw * int(p.m) * kQTileN * 4 +
                     a.slab_rows * kQTileN * 3 + 32;
  int nb_max = kGemvSmemBudget / per_nt;
  if (nb_max < 1) nb_max = 1;
  const int per_sm = smem_per_sm / (kGemvSmemBudget + 1024);
  const int64_t slots = int64_t(sms) * (per_sm < 1                ? 1
                                        : per_sm < kGemvMinBlocks ? per_sm
                                                                  : kGemvMinBlocks);
  // The n-tiles per block minimizing waves x (nb + 2) (a block's time: its n-tiles plus
  // about two n-tiles' worth of prologue), the larger nb on ties: e.g. 28672 x 8192 int4
  // (14 splits) takes nb = 14 (518 blocks, 2 full waves), not 28 (266 blocks, 2 waves).
  const int64_t per_nblock = int64_t(a.splits) * p.groups;
  int64_t nb = 1, best = -1;
  for (int64_t c = 1; c <= nb_max && c <= a.nt; ++c) {
    const int64_t waves = CeilDiv(CeilDiv(a.nt, c) * per_nblock, slots);
    const int64_t cost = waves * (c + 2);
    if (best < 0 || cost <= best) {
      best = cost;
      nb = c;
    }
  }
  if (knob.ints[1] > 0) nb = knob.ints[1];
  if (nb > nb_max) nb = nb_max;
  a.nb = int(nb);
  a.nblocks = int(CeilDiv(a.nt, a.nb));
  a.out_off = a.slab_rows * a.nb * 8 * kGemvEntryBytes;
  a.raw_off = a.out_off + a.kw * a.nb * int(p.m) * kQTileN * 4;
  a.raw_z_off = a.raw_off + Align16(a.slab_rows * a.nb * kQTileN * 2);
  const int smem = a.raw_z_off + Align16(a.slab_rows * a.nb * kQTileN);
  a.fast_s = p.n % 8 == 0 && reinterpret_cast<uintptr_t>(p.scales) % 16 == 0 &&
             (p.zeros == nullptr || reinterpret_cast<uintptr_t>(p.zeros) % 8 == 0);
  a.x_pairs = p.k % 2 == 0 && reinterpret_cast<uintptr_t>(p.x) % 4 == 0;

  const int64_t grid = int64_t(a.nblocks) * a.splits * p.groups;
  if (grid > 0x7fffffff) return cudaErrorInvalidConfiguration;
  kernel<<<unsigned(grid), kThreads, smem, stream>>>(a);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || a.splits == 1) return err;
  return LaunchReduce<T>(p, a.splits, sms, device, stream);
}

}  // namespace

int DeviceAttribute(cudaDeviceAttr attr, std::atomic<int>* cache, int device) {
  if (device < 0 || device >= kMaxDevices) {
    int v = 0;
    return cudaDeviceGetAttribute(&v, attr, device) == cudaSuccess ? v : 0;
  }
  int v = cache[device].load(std::memory_order_relaxed);
  if (v == 0) {
    if (cudaDeviceGetAttribute(&v, attr, device) != cudaSuccess) return 0;
    cache[device].store(v, std::memory_order_relaxed);
  }
  return v;
}

cudaError_t LaunchSplitReduce(const QLinearParams& p, int splits, cudaStream_t stream, int device,
                              int sms) {
  return JAXGPU_DTYPE_SWITCH(p.dtype, T, kHalfDTypes,
                             [&] { return LaunchReduce<T>(p, splits, sms, device, stream); });
}

}  // namespace qlinear

int64_t QLinearWorkspaceFloats(int64_t groups, int64_t m, int64_t n) {
  const int64_t out = groups * m * n;
  if (out <= 0) return 0;
  if (out > qlinear::kMaxWorkspaceFloats / qlinear::kMaxSplits) {
    return out * 2 <= qlinear::kMaxWorkspaceFloats ? qlinear::kMaxWorkspaceFloats : 0;
  }
  return out * qlinear::kMaxSplits;
}

bool QLinearGemvEligible(const QLinearParams& p) { return qlinear::GemvEligible(p); }

bool QLinearWgmmaEligible(const QLinearParams& p) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return qlinear::WgmmaEligible(p, device);
}

cudaError_t LaunchQLinear(const QLinearParams& p, cudaStream_t stream) {
  return LaunchQLinearPath(p, stream, QLinearPath::kAuto);
}

cudaError_t LaunchQLinearPath(const QLinearParams& p, cudaStream_t stream, QLinearPath path) {
  if (p.bits != 4 && p.bits != 8) return cudaErrorInvalidValue;
  if (p.dtype != DType::kBF16 && p.dtype != DType::kF16) return cudaErrorInvalidValue;
  if (p.groups <= 0 || p.m <= 0 || p.n <= 0) return cudaSuccess;
  if (reinterpret_cast<uintptr_t>(p.packed) % 16 != 0) return cudaErrorMisalignedAddress;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  static std::atomic<int> sm_cache[qlinear::kMaxDevices];
  static std::atomic<int> smem_cache[qlinear::kMaxDevices];
  const int sms = qlinear::DeviceAttribute(cudaDevAttrMultiProcessorCount, sm_cache, device);
  const int smem_per_sm =
      qlinear::DeviceAttribute(cudaDevAttrMaxSharedMemoryPerMultiprocessor, smem_cache, device);
  if (sms <= 0 || smem_per_sm <= 0) return cudaErrorInvalidDevice;
  // The Hopper kernel first: from kWgmmaFromRows rows it beats the GEMV kernel (int8 up to
  // 16 rows) and the staged one.
  if (p.k > 0 &&
      (path == QLinearPath::kWgmma ||
       (path == QLinearPath::kAuto && p.m >= qlinear::kWgmmaFromRows)) &&
      qlinear::WgmmaEligible(p, device)) {
    return qlinear::LaunchWgmma(p, stream, device, sms);
  }
  const bool gemv = p.k > 0 && (path == QLinearPath::kGemv
                                    ? qlinear::GemvEligible(p)
                                    : path == QLinearPath::kAuto &&
                                          !(kDevKnobs && qlinear::GemvKnob().ints[0] == -1) &&
                                          qlinear::GemvPreferred(p));
  return JAXGPU_DTYPE_SWITCH(p.dtype, T, kHalfDTypes, [&] {
    if (p.k <= 0) {  // y = act(bias): no products
      qlinear::QLinearReduceKernel<T><<<qlinear::ReduceBlocks(p, sms), 256, 0, stream>>>(p, 0);
      return cudaGetLastError();
    }
    if (gemv) {
      return JAXGPU_INT_SWITCH(qlinear::GemvTokenTiles(p.m), kNT, (1, 2), [&] {
        if (p.bits == 4) {
          return qlinear::LaunchGemv<T, 4, kNT>(p, stream, device, sms, smem_per_sm);
        }
        return qlinear::LaunchGemv<T, 8, kNT>(p, stream, device, sms, smem_per_sm);
      });
    }
    if (p.bits == 4) return qlinear::LaunchBits<T, 4>(p, stream, device, sms, smem_per_sm);
    return qlinear::LaunchBits<T, 8>(p, stream, device, sms, smem_per_sm);
  });
}

}  // namespace jaxgpu::cuda
