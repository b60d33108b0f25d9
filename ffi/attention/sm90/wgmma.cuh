// Hopper warpgroup tensor-core building blocks (wgmma.mma_async, sm_90a) of the wgmma main
// loop (sm90/: the forward, dQ and dK/dV kernels): 128-byte-swizzled shared-memory tiles,
// their matrix descriptors, and m64nNk16 MMAs with float32 accumulation. No XLA types.
//
// Why wgmma: mma.sync needs every operand fragment loaded into registers by ldmatrix (the
// shared-memory pipe bounded the mma.sync forward) and holds the warp until the MMA's
// registers are ready; wgmma reads B (and here Q) straight from shared memory and runs
// asynchronously, so a warpgroup's softmax overlaps the other warpgroup's products.
//
// Register layouts (PTX ISA, "wgmma .m64nNk16 register fragments"): warp w of the
// warpgroup holds rows 16w..16w+15 of the 64-row tile, and within them the accumulator D
// (n-tile j = 4 floats d[j][0..3]) and the register A fragment have exactly the layouts of
// mma.sync m16n8k16's C and A (attention_fragments.cuh). So a warp's score tile is the C
// tiles the shared softmax code (attention_softmax.cuh) works on, and P packs into A
// fragments with PackProbs.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "attention/attention_copy.cuh"

// Device code for sm_90a only: wgmma does not exist on sm_80 or in a plain sm_90 pass.
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define JAXGPU_WGMMA_DEVICE 1
#else
#define JAXGPU_WGMMA_DEVICE 0
#endif

namespace jaxgpu::cuda::attention::sm90 {

// A (kRows, kDim) 16-bit tile in wgmma's 128-byte-swizzle canonical layout: kDim / 64
// column blocks of kRows x 128 bytes; within a block the 16-byte chunk c of row r sits at
// chunk position c ^ (r % 8) of its 128-byte row. The XOR spreads the 8 rows of a core
// matrix over all 32 banks, and the pattern repeats every 1024 bytes (8 rows), so tiles
// start on 1024-byte boundaries (descriptor base offset 0).
template <int kRows, int kDim>
struct SwizzledTile {
  static_assert(kDim % 64 == 0, "128-byte swizzle: 64 16-bit columns per block");
  static constexpr int kBlockBytes = kRows * 128;
  static constexpr int kBytes = kBlockBytes * (kDim / 64);

  __device__ __forceinline__ static int ChunkOffset(int row, int chunk) {
    return (chunk >> 3) * kBlockBytes + row * 128 + (((chunk & 7) ^ (row & 7)) << 4);
  }
};

// The most dynamic shared memory an sm_90 block may opt in to (227 KB): the kernels'
// traits assert against it, since a layout past it fails only at launch.
constexpr int kMaxSmemBytes = 232448;

// The dynamic shared memory rounded up to the swizzle's 1024-byte period (kernels allocate
// 1024 bytes more).
__device__ __forceinline__ unsigned char* SwizzleAligned(unsigned char* raw) {
  return raw + ((1024 - (SmemAddress(raw) & 1023)) & 1023);
}

// Asynchronous copy of a global (rows, dim) matrix into a SwizzledTile (CopyRowsAsync's
// tails).
template <int kRows, int kDim, int kThreads, typename T>
__device__ __forceinline__ void LoadSwizzledAsync(unsigned char* tile, const T* gmem, int64_t ld,
                                                  int valid_rows, int dim) {
  CopyRowsAsync<kRows, kDim / 8, kThreads>(gmem, ld, valid_rows, dim, [&](int row, int chunk) {
    return SmemAddress(tile + SwizzledTile<kRows, kDim>::ChunkOffset(row, chunk));
  });
}

// Matrix descriptor of a 128-byte-swizzled operand (PTX ISA, "matrix descriptor format"):
// start address, leading and stride byte offsets, all in 16-byte units, swizzle mode 1.
//   K-major (Q, K: the reduction dim contiguous): the leading offset is unused (1), the
//     stride offset is 1024 bytes between 8-row groups; a 16-column k-step inside a
//     64-column block is a 32-byte advance of the start address.
//   MN-major (V in P V: the output dim contiguous): leading offset = bytes between 64-column
//     blocks, stride offset = 1024 bytes between groups of 8 k-rows.
__device__ __forceinline__ uint64_t SwizzledDescriptor(const void* smem, uint32_t leading_bytes,
                                                       uint32_t stride_bytes) {
  const uint32_t addr = SmemAddress(smem);
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>(leading_bytes >> 4) << 16) |
         (static_cast<uint64_t>(stride_bytes >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

// Fences and groups of the asynchronous MMAs. Fence() orders the warpgroup's register
// writes (accumulators, A fragments) before the MMAs that read them; Wait<n>() returns
// once at most n committed groups are pending. KeepOrder ties an array's registers to that
// point so the compiler cannot move their reads above the wait (or writes below the MMA).
__device__ __forceinline__ void Fence() {
#if JAXGPU_WGMMA_DEVICE
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void Commit() {
#if JAXGPU_WGMMA_DEVICE
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int kPending>
__device__ __forceinline__ void Wait() {
#if JAXGPU_WGMMA_DEVICE
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
#endif
}
template <int A, int B>
__device__ __forceinline__ void KeepOrder(float (&x)[A][B]) {
#pragma unroll
  for (int i = 0; i < A; ++i) {
#pragma unroll
    for (int j = 0; j < B; ++j) asm volatile("" : "+f"(x[i][j])::"memory");
  }
}

// Shared memory written through the generic proxy (cp.async here) and read next by wgmma
// (the async proxy) needs this fence in each writing thread before the barrier.
__device__ __forceinline__ void FenceSharedForAsyncProxy() {
#if JAXGPU_WGMMA_DEVICE
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// The operands of an m64nNk16 MMA with float32 accumulators, per N: the N / 2 accumulator
// registers of a thread (operands from %0; n-tile j is d[j][0..3]) and their constraints,
// then the operand numbers after them (SS: a_desc, b_desc; RS: a[0..3], b_desc), then the
// `accumulate` flag's.
#define JAXGPU_WGMMA_D4(d, j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])

#define JAXGPU_WGMMA_REGS_N32 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define JAXGPU_WGMMA_OUT_N32(d) \
  JAXGPU_WGMMA_D4(d, 0), JAXGPU_WGMMA_D4(d, 1), JAXGPU_WGMMA_D4(d, 2), JAXGPU_WGMMA_D4(d, 3)
#define JAXGPU_WGMMA_SS_IN_N32 "%16, %17"
#define JAXGPU_WGMMA_SS_FLAG_N32 "%18"
#define JAXGPU_WGMMA_RS_IN_N32 "{%16, %17, %18, %19}, %20"
#define JAXGPU_WGMMA_RS_FLAG_N32 "%21"

#define JAXGPU_WGMMA_REGS_N64                                               \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define JAXGPU_WGMMA_OUT_N64(d)                                                               \
  JAXGPU_WGMMA_D4(d, 0), JAXGPU_WGMMA_D4(d, 1), JAXGPU_WGMMA_D4(d, 2), JAXGPU_WGMMA_D4(d, 3), \
      JAXGPU_WGMMA_D4(d, 4), JAXGPU_WGMMA_D4(d, 5), JAXGPU_WGMMA_D4(d, 6), JAXGPU_WGMMA_D4(d, 7)
#define JAXGPU_WGMMA_SS_IN_N64 "%32, %33"
#define JAXGPU_WGMMA_SS_FLAG_N64 "%34"
#define JAXGPU_WGMMA_RS_IN_N64 "{%32, %33, %34, %35}, %36"
#define JAXGPU_WGMMA_RS_FLAG_N64 "%37"

#define JAXGPU_WGMMA_REGS_N128                                                        \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "           \
  " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  " %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  " %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define JAXGPU_WGMMA_OUT_N128(d)                                                                 \
  JAXGPU_WGMMA_OUT_N64(d), JAXGPU_WGMMA_D4(d, 8), JAXGPU_WGMMA_D4(d, 9), JAXGPU_WGMMA_D4(d, 10), \
      JAXGPU_WGMMA_D4(d, 11), JAXGPU_WGMMA_D4(d, 12), JAXGPU_WGMMA_D4(d, 13),                    \
      JAXGPU_WGMMA_D4(d, 14), JAXGPU_WGMMA_D4(d, 15)
#define JAXGPU_WGMMA_SS_IN_N128 "%64, %65"
#define JAXGPU_WGMMA_SS_FLAG_N128 "%66"
#define JAXGPU_WGMMA_RS_IN_N128 "{%64, %65, %66, %67}, %68"
#define JAXGPU_WGMMA_RS_FLAG_N128 "%69"

// d (+)= A B with `accumulate` as the scale-d predicate. FORM SS: A and B by descriptor,
// both K-major (imm-trans-a, -b = "0, 0"); RS: A from registers, B by descriptor,
// MN-major (imm-trans-b = "1"). __VA_ARGS__: the inputs before `accumulate`.
#define JAXGPU_WGMMA_ASM(N, TYPE, FORM, TRANS, ...)                                              \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " JAXGPU_WGMMA_##FORM##_FLAG_N##N               \
               ", 0;\n"                                                                          \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE                   \
               " " JAXGPU_WGMMA_REGS_N##N ", " JAXGPU_WGMMA_##FORM##_IN_N##N ", p, 1, 1, " TRANS \
                                                                             ";\n}\n"            \
               : JAXGPU_WGMMA_OUT_N##N(d)                                                        \
               : __VA_ARGS__, "r"(static_cast<int>(accumulate)))

// d (+)= A B for a warpgroup's 64 x N tile (N = 32, 64 or 128), k = 16. accumulate = false
// overwrites d. SS: A and B K-major in shared memory (descriptors). RS: A in registers (the
// warp's m16n8k16 A fragment), B MN-major in shared memory; RSKMajor: the same with B
// K-major (the quantized linear's x tile, ffi/matmul/qlinear_wgmma_sm90.cu).
template <typename T, int N>
struct Wgmma;

#if JAXGPU_WGMMA_DEVICE
#define JAXGPU_WGMMA_SS(N, TYPE) JAXGPU_WGMMA_ASM(N, TYPE, SS, "0, 0", "l"(desc_a), "l"(desc_b))
#define JAXGPU_WGMMA_RS_TRANS(N, TYPE, TRANS) \
  JAXGPU_WGMMA_ASM(N, TYPE, RS, TRANS, "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b))
#else
#define JAXGPU_WGMMA_SS(N, TYPE) (void)0
#define JAXGPU_WGMMA_RS_TRANS(N, TYPE, TRANS) (void)0
#endif

#define JAXGPU_WGMMA_SPECIALIZE(T, TYPE, N)                                                       \
  template <>                                                                                     \
  struct Wgmma<T, N> {                                                                            \
    __device__ __forceinline__ static void SS(float (&d)[N / 8][4], uint64_t desc_a,              \
                                              uint64_t desc_b, bool accumulate) {                 \
      JAXGPU_WGMMA_SS(N, TYPE);                                                                   \
    }                                                                                             \
    __device__ __forceinline__ static void RS(float (&d)[N / 8][4], const uint32_t (&a)[4],       \
                                              uint64_t desc_b, bool accumulate) {                 \
      JAXGPU_WGMMA_RS_TRANS(N, TYPE, "1");                                                        \
    }                                                                                             \
    __device__ __forceinline__ static void RSKMajor(float (&d)[N / 8][4], const uint32_t (&a)[4], \
                                                    uint64_t desc_b, bool accumulate) {           \
      JAXGPU_WGMMA_RS_TRANS(N, TYPE, "0");                                                        \
    }                                                                                             \
  };

JAXGPU_WGMMA_SPECIALIZE(__nv_bfloat16, "bf16", 32)
JAXGPU_WGMMA_SPECIALIZE(__nv_bfloat16, "bf16", 64)
JAXGPU_WGMMA_SPECIALIZE(__nv_bfloat16, "bf16", 128)
JAXGPU_WGMMA_SPECIALIZE(__half, "f16", 32)
JAXGPU_WGMMA_SPECIALIZE(__half, "f16", 64)
JAXGPU_WGMMA_SPECIALIZE(__half, "f16", 128)

// acc (+)= A B^T over kDim features for a warpgroup's 64 rows of A against the kN rows of B,
// both K-major SwizzledTiles (a_desc / b_desc: their first rows; column blocks
// kABlockBytes / kBBlockBytes apart). accumulate = false overwrites acc.
template <typename T, int kN, int kDim, int kABlockBytes, int kBBlockBytes>
__device__ __forceinline__ void ProductSS(float (&acc)[kN / 8][4], uint64_t a_desc, uint64_t b_desc,
                                          bool accumulate) {
#pragma unroll
  for (int kk = 0; kk < kDim / 16; ++kk) {
    // 16 columns are 32 bytes inside a 64-column block (descriptors count 16-byte units).
    const uint64_t a = a_desc + ((kk >> 2) * kABlockBytes + (kk & 3) * 32) / 16;
    const uint64_t b = b_desc + ((kk >> 2) * kBBlockBytes + (kk & 3) * 32) / 16;
    Wgmma<T, kN>::SS(acc, a, b, accumulate || kk > 0);
  }
}

// acc += P B over kK rows of B: P as packed A fragments (PackProbs, one row tile), B an
// MN-major SwizzledTile (b_desc: leading offset = its column-block stride).
template <typename T, int kAcc, int kK>
__device__ __forceinline__ void ProductRS(float (&acc)[kAcc / 8][4],
                                          const uint32_t (&a)[kK / 16][1][4], uint64_t b_desc) {
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    Wgmma<T, kAcc>::RS(acc, a[kk][0], b_desc + kk * (16 * 128 / 16), true);  // 16 rows of 128 B
  }
}

// ProductRS for B tiles of any width kAcc <= 256: 128-column pieces (the widest MMA here),
// each piece two 64-column blocks (kBBlockBytes each) further into the MN-major B tile.
template <typename T, int kAcc, int kK, int kBBlockBytes>
__device__ __forceinline__ void ProductRSWide(float (&acc)[kAcc / 8][4],
                                              const uint32_t (&a)[kK / 16][1][4], uint64_t b_desc) {
  if constexpr (kAcc <= 128) {
    ProductRS<T, kAcc, kK>(acc, a, b_desc);
  } else {
    static_assert(kAcc % 128 == 0, "128-column pieces");
#pragma unroll
    for (int piece = 0; piece < kAcc / 128; ++piece) {
      ProductRS<T, 128, kK>(*reinterpret_cast<float (*)[16][4]>(&acc[16 * piece]), a,
                            b_desc + piece * 2 * kBBlockBytes / 16);
    }
  }
}

}  // namespace jaxgpu::cuda::attention::sm90
