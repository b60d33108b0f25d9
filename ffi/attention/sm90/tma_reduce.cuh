// The device pieces of the warp-specialized backward (bwd_ws_sm90.cu) beyond tma.cuh and
// wgmma.cuh: a float32 tensor map and the copy engine's reduce-add from shared memory into
// it, bulk-group completion, proxy fences, acquire/release flags, and wgmma with either
// operand transposed (MN-major) from shared memory. No XLA types.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cstdint>

#include "attention/sm90/tma.cuh"
#include "attention/sm90/wgmma.cuh"

namespace jaxgpu::cuda::attention::sm90 {

// ---- host ----------------------------------------------------------------------------------

// A 4-d tensor map over a float32 (B, L, heads, dim) tensor, rows `ld` floats apart, for
// boxes of (32, 1, rows, 1) with the 128-byte swizzle: a box is rows x 128 bytes in shared
// memory, 16-byte chunk c of row r at c ^ (r % 8). 32 floats is the widest box the
// 128-byte swizzle allows, and the swizzle is what lets a warp's accumulator rows (8 rows
// 128 bytes apart) be stored without 8-way bank conflicts. False where the driver or the
// tensor's alignment does not allow it.
inline bool EncodeFloatRowsTensorMap(CUtensorMap* map, const void* base, int64_t batch, int64_t len,
                                     int64_t heads, int64_t dim, int64_t ld, int rows) {
  return EncodeRowsTensorMap(map, base, 4, batch, len, heads, dim, ld, rows);
}

// ---- device: bulk reductions ---------------------------------------------------------------

// One float32 box of shared memory (128-byte swizzled, 1024-byte aligned) added into the
// tensor at (col, head, row, b) by the copy engine, element by element in L2; elements
// outside the tensor (rows past the sequence, columns past the head dim) are dropped.
// Completes in the issuing thread's bulk group.
__device__ __forceinline__ void TmaReduceAddBox(const CUtensorMap* map, const void* src, int col,
                                                int head, int row, int b) {
#if JAXGPU_WGMMA_DEVICE
  asm volatile(
      "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group"
      " [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(reinterpret_cast<uint64_t>(map)),
      "r"(col), "r"(head), "r"(row), "r"(b), "r"(SmemAddress(src))
      : "memory");
#endif
}

__device__ __forceinline__ void BulkCommit() {
#if JAXGPU_WGMMA_DEVICE
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}

// At most kPending of the thread's bulk groups still reading their shared-memory source.
template <int kPending>
__device__ __forceinline__ void BulkWaitRead() {
#if JAXGPU_WGMMA_DEVICE
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
#endif
}

// At most kPending of the thread's bulk groups not complete (their writes performed).
template <int kPending>
__device__ __forceinline__ void BulkWait() {
#if JAXGPU_WGMMA_DEVICE
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

// Orders the thread's generic-proxy global accesses (the flag loads and stores) against
// its async-proxy ones (the bulk reductions).
__device__ __forceinline__ void FenceProxyAsyncGlobal() {
#if JAXGPU_WGMMA_DEVICE
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
#endif
}

// ---- device: flags and barriers ------------------------------------------------------------

__device__ __forceinline__ int LoadAcquireGpu(const int* flag) {
  int v = 0;
#if JAXGPU_WGMMA_DEVICE
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(flag) : "memory");
#endif
  return v;
}

__device__ __forceinline__ void StoreReleaseGpu(int* flag, int v) {
#if JAXGPU_WGMMA_DEVICE
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(flag), "r"(v) : "memory");
#endif
}

// The boxes of a (kRows, kDim) 16-bit SwizzledTile on `bar` with no arrival (the caller's
// one arrival announces the bytes of all the tiles of the phase).
template <int kRows, int kDim>
__device__ __forceinline__ void TmaLoadBoxes(unsigned char* tile, const CUtensorMap* map,
                                             uint64_t* bar, int head, int row, int b) {
#pragma unroll
  for (int c = 0; c < kDim / 64; ++c) {
    TmaLoadBox(tile + c * SwizzledTile<kRows, kDim>::kBlockBytes, map, bar, 64 * c, head, row, b);
  }
}

// ---- device: wgmma with MN-major operands from shared memory -------------------------------

// d (+)= A B, both from shared memory, with A and / or B MN-major (kTransA, kTransB: the
// instruction's imm-trans-a / imm-trans-b, which 16-bit types allow for shared-memory
// operands). wgmma.cuh's SS form has both K-major.
template <typename T, int N, bool kTransA, bool kTransB>
struct WgmmaT;

#if JAXGPU_WGMMA_DEVICE
#define JAXGPU_WGMMA_SS_T(N, TYPE, TRANS) \
  JAXGPU_WGMMA_ASM(N, TYPE, SS, TRANS, "l"(desc_a), "l"(desc_b))
#else
#define JAXGPU_WGMMA_SS_T(N, TYPE, TRANS) (void)0
#endif

#define JAXGPU_WGMMA_T_SPECIALIZE(T, TYPE, N, TA, TB, TRANS)                         \
  template <>                                                                        \
  struct WgmmaT<T, N, TA, TB> {                                                      \
    __device__ __forceinline__ static void SS(float (&d)[N / 8][4], uint64_t desc_a, \
                                              uint64_t desc_b, bool accumulate) {    \
      JAXGPU_WGMMA_SS_T(N, TYPE, TRANS);                                             \
    }                                                                                \
  };

#define JAXGPU_WGMMA_T_ALL(T, TYPE)                            \
  JAXGPU_WGMMA_T_SPECIALIZE(T, TYPE, 32, false, true, "0, 1")  \
  JAXGPU_WGMMA_T_SPECIALIZE(T, TYPE, 64, false, true, "0, 1")  \
  JAXGPU_WGMMA_T_SPECIALIZE(T, TYPE, 128, false, true, "0, 1") \
  JAXGPU_WGMMA_T_SPECIALIZE(T, TYPE, 32, true, true, "1, 1")   \
  JAXGPU_WGMMA_T_SPECIALIZE(T, TYPE, 64, true, true, "1, 1")   \
  JAXGPU_WGMMA_T_SPECIALIZE(T, TYPE, 128, true, true, "1, 1")

JAXGPU_WGMMA_T_ALL(__nv_bfloat16, "bf16")
JAXGPU_WGMMA_T_ALL(__half, "f16")

// acc (+)= A B over kK (reduction) elements, 16 a wgmma, A (64 x kK) and B (kK x kN) in
// SwizzledTiles. A K-major operand advances 32 bytes per 16 k inside a 64-column block and
// kBlockBytes between blocks; an MN-major one 16 rows of 128 bytes (2048 bytes) per 16 k,
// its descriptor's leading offset being its tile's column-block stride.
template <typename T, int kN, int kK, bool kAMnMajor, int kABlockBytes, bool kBMnMajor,
          int kBBlockBytes>
__device__ __forceinline__ void ProductSST(float (&acc)[kN / 8][4], uint64_t a_desc,
                                           uint64_t b_desc, bool accumulate) {
  auto step = [](int kk, bool mn_major, int block_bytes) -> uint64_t {
    return mn_major ? static_cast<uint64_t>(kk) * (2048 / 16)
                    : static_cast<uint64_t>(((kk >> 2) * block_bytes + (kk & 3) * 32) / 16);
  };
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    WgmmaT<T, kN, kAMnMajor, kBMnMajor>::SS(acc, a_desc + step(kk, kAMnMajor, kABlockBytes),
                                            b_desc + step(kk, kBMnMajor, kBBlockBytes),
                                            accumulate || kk > 0);
  }
}

}  // namespace jaxgpu::cuda::attention::sm90
