// Hopper's Tensor Memory Accelerator for the warp-specialized kernels: tensor maps of the
// (batch, sequence, head, dim) attention tensors (host), and on the device the bulk tensor
// copies into 128-byte-swizzled SwizzledTiles, completing on shared-memory mbarriers. No XLA
// types.
//
// Why: a copy engine transfer is one instruction from one thread for a whole 64-column
// block of a tile, where cp.async takes a 16-byte chunk per thread and the compute warps'
// issue slots; its completion is tracked by an mbarrier's transaction count, so consumers
// wait on exactly the tile they need instead of on a CTA-wide barrier.
//
// Layout contract: a box of (64 columns, 1 head, rows, 1 batch) lands as rows x 128 bytes
// with the 128-byte swizzle (16-byte chunk c of row r at c ^ (r % 8)), which is exactly one
// column block of SwizzledTile<rows, dim> when the destination is 1024-byte aligned.
// Columns past the head dim and rows past the sequence are zero-filled by the engine.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cstdint>

#include "attention/sm90/wgmma.cuh"

namespace jaxgpu::cuda::attention::sm90 {

// ---- host ----------------------------------------------------------------------------------

// The driver's cuTensorMapEncodeTiled, looked up once through the runtime (no libcuda link);
// nullptr where the driver lacks it.
inline PFN_cuTensorMapEncodeTiled_v12000 TensorMapEncoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// A 4-d tensor map over a (B, L, heads, dim) tensor of `elem_bytes`-byte elements (1 and 2:
// 8- and 16-bit, whose bits are only moved; 4: float32, which the copy engine's reductions
// add) with row stride `ld` elements (heads * dim when packed), for boxes of (128 bytes of
// columns, 1, rows, 1) with the 128-byte swizzle. False when the driver has no
// cuTensorMapEncodeTiled or the tensor breaks the engine's rules (base 16-byte aligned,
// strides multiples of 16 bytes, dims within 2^32): the caller keeps another path.
inline bool EncodeRowsTensorMap(CUtensorMap* map, const void* base, int elem_bytes, int64_t batch,
                                int64_t len, int64_t heads, int64_t dim, int64_t ld, int rows) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = TensorMapEncoder();
  if (encode == nullptr || reinterpret_cast<uintptr_t>(base) % 16 != 0 ||
      (dim * elem_bytes) % 16 != 0 || (ld * elem_bytes) % 16 != 0) {
    return false;
  }
  const cuuint64_t dims[4] = {cuuint64_t(dim), cuuint64_t(heads), cuuint64_t(len),
                              cuuint64_t(batch)};
  // Strides of dims 1..3 in bytes: a head, a row, a batch entry.
  const cuuint64_t strides[3] = {cuuint64_t(dim * elem_bytes), cuuint64_t(ld * elem_bytes),
                                 cuuint64_t(len * ld * elem_bytes)};
  const cuuint32_t box[4] = {cuuint32_t(128 / elem_bytes), 1, cuuint32_t(rows), 1};
  const cuuint32_t unit[4] = {1, 1, 1, 1};
  const CUtensorMapDataType type = elem_bytes == 4   ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                   : elem_bytes == 1 ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                                     : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  return encode(map, type, 4, const_cast<void*>(base), dims, strides, box, unit,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The 16-bit q, k, v of the attention kernels: boxes of (64, 1, rows, 1).
inline bool EncodeHeadTensorMap(CUtensorMap* map, const void* base, int64_t batch, int64_t len,
                                int64_t heads, int64_t dim, int64_t ld, int rows) {
  return EncodeRowsTensorMap(map, base, 2, batch, len, heads, dim, ld, rows);
}

// ---- device --------------------------------------------------------------------------------

__device__ __forceinline__ void MbarrierInit(uint64_t* bar, uint32_t count) {
#if JAXGPU_WGMMA_DEVICE
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(SmemAddress(bar)), "r"(count)
               : "memory");
#endif
}

// Makes the initialized barriers visible to the copy engine (and to the other threads,
// with the __syncthreads that follows).
__device__ __forceinline__ void FenceBarrierInit() {
#if JAXGPU_WGMMA_DEVICE
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

// One arrival that also announces `bytes` of copies to complete on the barrier's phase.
__device__ __forceinline__ void MbarrierArriveExpectTx(uint64_t* bar, uint32_t bytes) {
#if JAXGPU_WGMMA_DEVICE
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(SmemAddress(bar)),
               "r"(bytes)
               : "memory");
#endif
}

__device__ __forceinline__ void MbarrierArrive(uint64_t* bar) {
#if JAXGPU_WGMMA_DEVICE
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(SmemAddress(bar)) : "memory");
#endif
}

// Returns once the barrier's phase of parity `phase` has completed (a fresh barrier is in
// phase 0).
__device__ __forceinline__ void MbarrierWait(uint64_t* bar, uint32_t phase) {
#if JAXGPU_WGMMA_DEVICE
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n"
      "}\n" ::"r"(SmemAddress(bar)),
      "r"(phase)
      : "memory");
#endif
}

// A box (64 columns from `col`, head `head`, rows from `row`, batch `b`) of the tensor map's
// tensor into shared memory at `dst` (1024-byte aligned), completing on `bar`.
__device__ __forceinline__ void TmaLoadBox(void* dst, const CUtensorMap* map, uint64_t* bar,
                                           int col, int head, int row, int b) {
#if JAXGPU_WGMMA_DEVICE
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(SmemAddress(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(head), "r"(row), "r"(b),
      "r"(SmemAddress(bar))
      : "memory");
#endif
}

// All column blocks of a (kRows, kDim) SwizzledTile: kDim / 64 boxes, kRows * kDim * 2
// bytes announced on `bar` by the calling thread (its one arrival).
template <int kRows, int kDim>
__device__ __forceinline__ void TmaLoadTile(unsigned char* tile, const CUtensorMap* map,
                                            uint64_t* bar, int head, int row, int b) {
  using Tile = SwizzledTile<kRows, kDim>;
  MbarrierArriveExpectTx(bar, Tile::kBytes);
#pragma unroll
  for (int c = 0; c < kDim / 64; ++c) {
    TmaLoadBox(tile + c * Tile::kBlockBytes, map, bar, 64 * c, head, row, b);
  }
}

// Named barrier `id` (1..15; 0 is __syncthreads) over `threads` threads (a multiple of 32):
// the warpgroups of a warp-specialized CTA meet without stopping the copy warp.
__device__ __forceinline__ void NamedBarrierSync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void NamedBarrierArrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Register budgets of a warp-specialized CTA: the copy warpgroup gives its registers back
// and the math warpgroups take them (takes effect with __launch_bounds__(threads, 1)).
template <int kRegisters>
__device__ __forceinline__ void ReleaseRegisters() {
#if JAXGPU_WGMMA_DEVICE
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
#endif
}
template <int kRegisters>
__device__ __forceinline__ void ClaimRegisters() {
#if JAXGPU_WGMMA_DEVICE
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
#endif
}

}  // namespace jaxgpu::cuda::attention::sm90
