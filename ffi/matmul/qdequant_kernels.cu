// Dequantization of a packed weight to the dense (K, N) matrix: the large-M route of
// jaxgpu.linear (from DENSE_FROM_ROWS rows the product is compute-bound, and cuBLASLt on
// the dense weight beats any fused kernel of ours). XLA's fusion of the reshapes that undo
// the packing ran at ~120 GB/s on the H100 (8192 x 28672 int4: 1 ms); this is a copy, and
// its bytes are the dense weight it writes (4x or 2x what it reads).
//
// One block of 256 threads per (group, k tile, run of kTilesPerBlock n tiles): the run's
// packed words are contiguous (layout (KT, NT, words)) and are staged in shared memory by
// coalesced 16-byte loads. Thread t then writes row t / 4 of the k tile, features
// 32 (t % 4) .. + 31 of the run: four 16-byte stores, so that a warp writes 8 rows of 256
// contiguous bytes (whole 128-byte lines): with one 16 x 64 tile per block (output rows of
// 32 bytes) the copy took 750 us for 8192 x 28672 int4 on the H100, with these runs 508 us
// (tools/qdequant_check.cu). Each value is read at its packed position (QPackedAt) with
// its row's scale and zero point: w = round_T((q - z) * s), the product exact in float.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/cuda_dispatch.cuh"
#include "common/cuda_utils.cuh"
#include "matmul/qlinear_cuda.h"

namespace jaxgpu::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kTilesPerBlock = 8;  // 128 features: 4 threads per row, 2 tiles each

template <typename T, int kBits>
__global__ void __launch_bounds__(kThreads) QDequantKernel(QDequantParams p) {
  constexpr int kWords = QWordsPerTile(kBits);
  __shared__ uint4 tiles_smem[kTilesPerBlock * kWords / 4];
  const int64_t nt_count = QTilesN(p.n), kt_count = QTilesK(p.k);
  const int64_t nt0 = int64_t(blockIdx.x) * kTilesPerBlock, kt = blockIdx.y, g = blockIdx.z;
  const int64_t tiles_left = nt_count - nt0;
  const int tiles = tiles_left < kTilesPerBlock ? int(tiles_left) : kTilesPerBlock;
  const uint4* src =
      reinterpret_cast<const uint4*>(p.packed + ((g * kt_count + kt) * nt_count + nt0) * kWords);
  for (int i = threadIdx.x; i < tiles * kWords / 4; i += kThreads) tiles_smem[i] = src[i];
  __syncthreads();
  const uint32_t* words = reinterpret_cast<const uint32_t*>(tiles_smem);

  const int r = threadIdx.x / 4;  // row of the k tile
  const int64_t k = kt * kQTileK + r;
  if (k >= p.k) return;
  const int64_t rows = p.k / p.group_size;
  int64_t srow = k / p.group_size;
  if (srow > rows - 1) srow = rows - 1;
  const T* scales = static_cast<const T*>(p.scales) + (g * rows + srow) * p.n;
  const uint8_t* zeros = p.zeros != nullptr ? p.zeros + (g * rows + srow) * p.n : nullptr;
  T* w = static_cast<T*>(p.w) + (g * p.k + k) * p.n;
  const uint32_t mask = (1u << kBits) - 1u;
  // 16-byte vectors of w and the scales need N % 8 == 0 (rows start 16-byte aligned: XLA's
  // buffers are), of the zero points N % 16 == 0.
  const bool vec = sizeof(T) == 2 && p.n % 8 == 0;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int tile = 2 * (threadIdx.x % 4) + half;
    const int64_t n0 = (nt0 + tile) * kQTileN;
    if (tile >= tiles || n0 >= p.n) break;
    const bool whole = n0 + kQTileN <= p.n;
    alignas(16) T s[kQTileN];
    alignas(16) uint8_t z[kQTileN];
    if (vec && whole) {
      reinterpret_cast<uint4*>(s)[0] = reinterpret_cast<const uint4*>(scales + n0)[0];
      reinterpret_cast<uint4*>(s)[1] = reinterpret_cast<const uint4*>(scales + n0)[1];
    } else {
#pragma unroll
      for (int j = 0; j < kQTileN; ++j) s[j] = n0 + j < p.n ? scales[n0 + j] : T(0.f);
    }
    if (zeros == nullptr) {
#pragma unroll
      for (int j = 0; j < kQTileN; ++j) z[j] = uint8_t(1 << (kBits - 1));
    } else if (whole && p.n % 16 == 0) {
      *reinterpret_cast<uint4*>(z) = *reinterpret_cast<const uint4*>(zeros + n0);
    } else {
#pragma unroll
      for (int j = 0; j < kQTileN; ++j) z[j] = n0 + j < p.n ? zeros[n0 + j] : 0;
    }
    const uint32_t* tile_words = words + tile * kWords;
    alignas(16) T out[kQTileN];
#pragma unroll
    for (int j = 0; j < kQTileN; ++j) {
      const QPackedPosition at = QPackedAt(kBits, j, r);
      const int q = int((tile_words[at.word] >> at.shift) & mask);
      out[j] = FromFloat<T>(float(q - int(z[j])) * ToFloat(s[j]));
    }
    if (vec && whole) {
      reinterpret_cast<uint4*>(w + n0)[0] = reinterpret_cast<const uint4*>(out)[0];
      reinterpret_cast<uint4*>(w + n0)[1] = reinterpret_cast<const uint4*>(out)[1];
    } else {
#pragma unroll
      for (int j = 0; j < kQTileN; ++j) {
        if (n0 + j < p.n) w[n0 + j] = out[j];
      }
    }
  }
}

}  // namespace

cudaError_t LaunchQDequant(const QDequantParams& p, cudaStream_t stream) {
  if (p.bits != 4 && p.bits != 8) return cudaErrorInvalidValue;
  if (reinterpret_cast<uintptr_t>(p.packed) % 16 != 0) return cudaErrorMisalignedAddress;
  const int64_t nt = QTilesN(p.n), kt = QTilesK(p.k);
  if (nt > 0x7fffffff || kt > 65535 || p.groups > 65535) return cudaErrorInvalidValue;
  const int64_t runs = (nt + kTilesPerBlock - 1) / kTilesPerBlock;
  const dim3 grid(static_cast<unsigned>(runs), static_cast<unsigned>(kt),
                  static_cast<unsigned>(p.groups));
  return JAXGPU_DTYPE_SWITCH(p.dtype, T, kFloatDTypes, [&] {
    if (p.bits == 4) {
      QDequantKernel<T, 4><<<grid, kThreads, 0, stream>>>(p);
    } else {
      QDequantKernel<T, 8><<<grid, kThreads, 0, stream>>>(p);
    }
    return cudaGetLastError();
  });
}

}  // namespace jaxgpu::cuda
