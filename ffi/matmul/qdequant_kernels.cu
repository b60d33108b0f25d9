// Dequantization of a packed weight to the dense (K, N) matrix: the large-M route of
// jaxgpu.linear (from DENSE_FROM_ROWS rows the product is compute-bound, and cuBLASLt on
// the dense weight beats any fused kernel of ours). XLA's fusion of the reshapes that undo
// the packing ran at ~120 GB/s on the H100 (8192 x 28672 int4: 1 ms); this is a copy.
//
// One block of 128 threads per (group, k tile, n tile): the tile's 512 or 1024 packed bytes
// are staged in shared memory (coalesced 16-byte loads), then each thread writes 8
// consecutive features of one of the tile's 64 rows (a 16-byte store when N % 8 == 0 and
// the row is aligned), reading each value at its packed position (QPackedAt) and the row's
// scale and zero point. w = round_T((q - z) * s), the product exact in float.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/cuda_dispatch.cuh"
#include "common/cuda_utils.cuh"
#include "matmul/qlinear_cuda.h"

namespace jaxgpu::cuda {
namespace {

constexpr int kThreads = 128;

template <typename T, int kBits>
__global__ void __launch_bounds__(kThreads) QDequantKernel(QDequantParams p) {
  constexpr int kWords = QWordsPerTile(kBits);
  __shared__ uint4 tile_smem[kWords / 4];
  const int64_t nt_count = QTilesN(p.n), kt_count = QTilesK(p.k);
  const int64_t nt = blockIdx.x, kt = blockIdx.y, g = blockIdx.z;
  const int32_t* packed = p.packed + ((g * kt_count + kt) * nt_count + nt) * kWords;
  const uint4* src = reinterpret_cast<const uint4*>(packed);
  for (int i = threadIdx.x; i < kWords / 4; i += kThreads) tile_smem[i] = src[i];
  __syncthreads();
  const uint32_t* words = reinterpret_cast<const uint32_t*>(tile_smem);

  const int r = threadIdx.x / 2;         // row of the tile: k offset
  const int c0 = (threadIdx.x % 2) * 8;  // first of 8 features
  const int64_t k = kt * kQTileK + r;
  if (k >= p.k) return;
  const int64_t n0 = nt * kQTileN + c0;
  const int64_t rows = p.k / p.group_size;
  int64_t srow = k / p.group_size;
  if (srow > rows - 1) srow = rows - 1;
  const T* scales = static_cast<const T*>(p.scales) + (g * rows + srow) * p.n;
  const uint8_t* zeros = p.zeros != nullptr ? p.zeros + (g * rows + srow) * p.n : nullptr;
  const uint32_t mask = (1u << kBits) - 1u;
  alignas(16) T out[8];  // read back as one 16-byte vector below
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int64_t n = n0 + j;
    float v = 0.f;
    if (n < p.n) {
      const QPackedPosition at = QPackedAt(kBits, c0 + j, r);
      const int q = int((words[at.word] >> at.shift) & mask);
      const int z = zeros != nullptr ? int(zeros[n]) : (1 << (kBits - 1));
      v = float(q - z) * ToFloat(scales[n]);
    }
    out[j] = FromFloat<T>(v);
  }
  T* w = static_cast<T*>(p.w) + (g * p.k + k) * p.n + n0;
  if (sizeof(T) == 2 && p.n % 8 == 0 && n0 + 8 <= p.n) {
    *reinterpret_cast<uint4*>(w) = *reinterpret_cast<const uint4*>(out);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (n0 + j < p.n) w[j] = out[j];
    }
  }
}

}  // namespace

cudaError_t LaunchQDequant(const QDequantParams& p, cudaStream_t stream) {
  if (p.bits != 4 && p.bits != 8) return cudaErrorInvalidValue;
  if (reinterpret_cast<uintptr_t>(p.packed) % 16 != 0) return cudaErrorMisalignedAddress;
  const int64_t nt = QTilesN(p.n), kt = QTilesK(p.k);
  if (nt > 0x7fffffff || kt > 65535 || p.groups > 65535) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(nt), static_cast<unsigned>(kt),
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
