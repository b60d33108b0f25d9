// The additive bias and the boolean mask of the attention kernels (attention_params.h),
// shared by every main loop that takes them: per element, on the tiles a warp computes,
// addressed with per-dimension strides (stride 0 on a broadcast dim, so a (1, N, T, S) bias
// is read in place, never expanded); and the bias gradient, written by the dQ kernel (each
// (b, n, i, j) is computed there exactly once). Only the kernels compiled with kExtra read
// them: the plain kernels compile to the code they had. No XLA types.
//
// The sm80 kernels stage each (query tile x key tile) block of the bias and mask in shared
// memory (ExtraTiles), copied with cp.async in the same group as the K/V (or Q/dO) tile of
// that pipeline stage, so the copies fly under the previous tile's products; the softmax
// reads its fragment's values from there. Read per element from global memory inside the
// softmax instead (each load's latency exposed, half-used sectors), an ALiBi (1, N, T, S)
// bf16 bias took the H = 128 forward from ~1.4 ms to 4.4 ms (B = 8, T = S = 2048, H100).
// Where a block cannot be copied in 16-byte rows (a broadcast or strided key dim, rows not
// 16-byte aligned) or does not fit in shared memory, that array is read per element.
//
// Napkin math: the forward does 4 H FLOPs per logit and a 16-bit bias adds 2 bytes to read
// per logit: 256 FLOP/byte at H = 128, about the H100's ridge (800 TFLOP/s over 3 TB/s).
// So a full (B, N, T, S) bias streamed from HBM costs about as much time as the products
// themselves, while one broadcast over B (or N) is re-read from L2 by the other rows.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "attention/attention_logits.cuh"
#include "attention/attention_params.h"
#include "common/dtype.h"

namespace jaxgpu::cuda::attention {

template <typename T>
__device__ __forceinline__ float LoadScalar(const void* base, int64_t at) {
  const T v = static_cast<const T*>(base)[at];
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat162float(v);
  } else {
    return __half2float(v);
  }
}

// Where the bias and mask of one (batch row, kv head) start. Everything else (pointers,
// strides, T, S, the bias's dtype and unit) is read from the kernel's parameters where it is
// used. Copied into this struct and held across the main loop, those values cost registers
// the kernels (at 255) did not have: sm_80 ptxas spills went forward H = 128 120 -> 112
// bytes (80 with a softcap, was 96), H = 96 156 -> 44, dQ H = 128 with a softcap 64 -> 0.
// Offsets are formed per element: each row's 64-bit offsets hoisted out of the column loop
// kept more values live and spilled more (forward H = 128: 276 bytes, dQ 208).
struct Extras {
  int64_t bias_head;  // offset of (b, kh, 0, 0, 0) in the bias (and dbias)
  int64_t mask_head;  // in the mask

  __device__ __forceinline__ static bool Any(const AttentionParams& p) {
    return p.bias != nullptr || p.mask != nullptr;
  }

  // Offset of query head r's (i, j) element in the bias (and dbias).
  __device__ __forceinline__ int64_t BiasAt(const AttentionParams& p, int r, int i, int j) const {
    return bias_head + r * p.bias_stride[2] + i * p.bias_stride[3] + j * p.bias_stride[4];
  }

  // The logit x (ToLogits's output, -inf where masked by position or segment) of query i,
  // key j, with the bias added and the mask applied; -inf outside [0, T) x [0, S). T: the
  // kernel's element type (the bias is T or float32). The bias and mask come from the
  // staged block `tile` where it holds them (Tile: an ExtraTiles<...>::Tile), else from
  // global memory.
  template <typename T, typename Tile>
  __device__ __forceinline__ float Apply(const AttentionParams& p, float x, int r, int i, int j,
                                         const Tile& tile) const {
    if (i >= static_cast<int>(p.q_len) || j >= static_cast<int>(p.kv_len)) return -INFINITY;
    if (p.mask != nullptr) {
      const uint8_t m = tile.mask >= 0 ? tile.Mask(i, j)
                                       : __ldg(p.mask + mask_head + r * p.mask_stride[2] +
                                               i * p.mask_stride[3] + j * p.mask_stride[4]);
      if (m == 0) return -INFINITY;
    }
    if (p.bias != nullptr) {
      float b;
      if (tile.bias >= 0) {
        b = p.bias_dtype == DType::kF32 ? tile.template Bias<float>(i, j)
                                        : tile.template Bias<T>(i, j);
      } else {
        const int64_t at = BiasAt(p, r, i, j);
        b = p.bias_dtype == DType::kF32 ? __ldg(static_cast<const float*>(p.bias) + at)
                                        : LoadScalar<T>(p.bias, at);
      }
      x += b * p.bias_scale;
    }
    return x;
  }

  // dL/dbias of element (r, i, j): g = p (dp - delta), the gradient of the logit after the
  // softcap (the bias is added there). Stored by the one thread that computes it, or added
  // atomically where the bias broadcasts (zeros add nothing: masked elements skip it).
  __device__ __forceinline__ void AddBiasGrad(const AttentionParams& p, float g, int r, int i,
                                              int j) const {
    if (p.dbias == nullptr || i >= static_cast<int>(p.q_len) || j >= static_cast<int>(p.kv_len)) {
      return;
    }
    float* at = p.dbias + BiasAt(p, r, i, j);
    if (!p.dbias_atomic) {
      *at = g;
    } else if (g != 0.f) {
      atomicAdd(at, g);
    }
  }
};

__device__ __forceinline__ Extras MakeExtras(const AttentionParams& p, int64_t b, int64_t kh) {
  return {b * p.bias_stride[0] + kh * p.bias_stride[1],
          b * p.mask_stride[0] + kh * p.mask_stride[1]};
}

// A warp's 16 x kN score tile (C fragments, attention_logits.cuh's element order) through
// Extras::Apply: rows row0.., columns col0.. (kTransposed: rows are keys, columns queries).
template <typename T, bool kTransposed, int kN, typename Tile>
__device__ __forceinline__ void ApplyExtras(float (&acc)[kN / 8][4], const AttentionParams& p,
                                            const Extras& ex, int r, int row0, int col0, int lane,
                                            const Tile& tile) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int lr = g + 8 * (e >> 1), lc = 8 * j + 2 * t + (e & 1);
      const int i = kTransposed ? col0 + lc : row0 + lr;
      const int k = kTransposed ? row0 + lr : col0 + lc;
      acc[j][e] = ex.Apply<T>(p, acc[j][e], r, i, k, tile);
    }
  }
}

// ---- Bias and mask blocks staged in shared memory --------------------------------------

__host__ __device__ inline int BiasElementBytes(const AttentionParams& p) {
  return p.bias_dtype == DType::kF32 ? 4 : 2;
}

// Whether an array's (query, key) blocks can be copied as 16-byte chunks of its key rows:
// keys contiguous, and every row start (any b, kh, r, i) 16-byte aligned.
__host__ __device__ inline bool RowsCopyable(const void* base, const int64_t (&stride)[5],
                                             int element_bytes) {
  if (base == nullptr || stride[4] != 1 || reinterpret_cast<uintptr_t>(base) % 16 != 0) {
    return false;
  }
  for (int d = 0; d < 4; ++d) {
    if (stride[d] * element_bytes % 16 != 0) return false;
  }
  return true;
}

// kBuffers blocks of kRows queries x kCols keys of the bias and of the mask, at byte `base`
// of the kernel's dynamic shared memory: [buffer][query][key], the bias in its own dtype.
// The launcher asks for as much shared memory as fits (SmemBytes: both, the bias alone, the
// mask alone, or neither), and the kernel reads what it got from %dynamic_smem_size
// (Stage), so the two always agree. Row pitches: kCols + 8 bias elements, kCols + 16 mask
// bytes: 16-byte multiples for cp.async, and the C-fragment reads (8 rows x 4 column pairs
// a warp) fall in distinct banks.
template <int kRows, int kCols, int kBuffers>
struct ExtraTiles {
  static constexpr int kBiasPitch = kCols + 8;   // elements
  static constexpr int kMaskPitch = kCols + 16;  // bytes
  static constexpr int kMaskBytes = kBuffers * kRows * kMaskPitch;
  static_assert(kCols % 32 == 0, "16-byte chunks of mask rows");

  __host__ __device__ static int BiasBufferBytes(const AttentionParams& p) {
    return kRows * kBiasPitch * BiasElementBytes(p);
  }
  __host__ __device__ static bool BiasCopyable(const AttentionParams& p) {
    return RowsCopyable(p.bias, p.bias_stride, BiasElementBytes(p));
  }
  __host__ __device__ static bool MaskCopyable(const AttentionParams& p) {
    return RowsCopyable(p.mask, p.mask_stride, 1);
  }

  // Host: the dynamic shared memory to launch with, `base` bytes without the staging, at
  // most `limit` (the device's opt-in maximum).
  static int64_t SmemBytes(const AttentionParams& p, int64_t base, int64_t limit) {
    const int64_t b = BiasCopyable(p) ? int64_t{kBuffers} * BiasBufferBytes(p) : 0;
    const int64_t m = MaskCopyable(p) ? kMaskBytes : 0;
    if (base + b + m <= limit) return base + b + m;
    if (base + b <= limit) return base + b;  // the bias block is the larger
    if (base + m <= limit) return base + m;
    return base;
  }

  // One stage's block as the softmax reads it: element (i, j) of the query head's bias and
  // mask, i and j absolute (i0, j0: the block's first query and key). bias / mask: byte
  // offsets of the block in shared memory, -1 where that array is read from global memory.
  struct Tile {
    const unsigned char* smem;
    int bias, mask;
    int i0, j0;

    template <typename B>
    __device__ __forceinline__ float Bias(int i, int j) const {
      const B v = reinterpret_cast<const B*>(smem + bias)[(i - i0) * kBiasPitch + (j - j0)];
      if constexpr (std::is_same_v<B, float>) {
        return v;
      } else if constexpr (std::is_same_v<B, __nv_bfloat16>) {
        return __bfloat162float(v);
      } else {
        return __half2float(v);
      }
    }
    __device__ __forceinline__ uint8_t Mask(int i, int j) const {
      return smem[mask + (i - i0) * kMaskPitch + (j - j0)];
    }
  };

  // Where the kernel's staged blocks start (-1: not staged), from the shared memory the
  // launch gave it (`base`: the kernel's own layout's size, a multiple of 16).
  struct Stage {
    int bias, mask;

    __device__ __forceinline__ Tile At(const unsigned char* smem, const AttentionParams& p, int buf,
                                       int i0, int j0) const {
      return {smem, bias < 0 ? -1 : bias + buf * BiasBufferBytes(p),
              mask < 0 ? -1 : mask + buf * kRows * kMaskPitch, i0, j0};
    }
  };

  __device__ __forceinline__ static Stage MakeStage(const AttentionParams& p, int base) {
    unsigned have;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
    Stage s{-1, -1};
    int at = base;
    if (BiasCopyable(p) && at + kBuffers * BiasBufferBytes(p) <= static_cast<int>(have)) {
      s.bias = at;
      at += kBuffers * BiasBufferBytes(p);
    }
    if (MaskCopyable(p) && at + kMaskBytes <= static_cast<int>(have)) s.mask = at;
    return s;
  }

  // Copies query head r's block of queries [i0, i0 + kRows) x keys [j0, j0 + kCols) into
  // buffer `buf` (the staged arrays of `s`), kThreads threads, joining the caller's cp.async
  // group. Queries past T and keys past S are zero-filled (Apply masks them by position).
  template <int kThreads>
  __device__ __forceinline__ static void LoadAsync(unsigned char* smem, const Stage& s,
                                                   const AttentionParams& p, const Extras& ex,
                                                   int r, int buf, int i0, int j0) {
    const Tile t = s.At(smem, p, buf, i0, j0);
    if (t.bias >= 0) {
      const int bytes = BiasElementBytes(p);
      CopyBlockAsync<kThreads>(
          smem + t.bias, kBiasPitch * bytes,
          static_cast<const unsigned char*>(p.bias) + (ex.bias_head + r * p.bias_stride[2]) * bytes,
          p.bias_stride[3] * bytes, bytes, i0, static_cast<int>(p.q_len), j0,
          static_cast<int>(p.kv_len));
    }
    if (t.mask >= 0) {
      CopyBlockAsync<kThreads>(smem + t.mask, kMaskPitch,
                               p.mask + ex.mask_head + r * p.mask_stride[2], p.mask_stride[3], 1,
                               i0, static_cast<int>(p.q_len), j0, static_cast<int>(p.kv_len));
    }
  }

  // Rows [i0, i0 + kRows) x columns [j0, j0 + kCols) of a (rows, cols) array of `bytes`-byte
  // elements starting at `head` (row stride `ld` bytes; rows and row starts 16-byte aligned)
  // to `dst` (row pitch `pitch` bytes), one 16-byte cp.async per chunk; the bytes past
  // `cols` are zero-filled (cp.async's source size), and so are the rows past `rows`.
  template <int kThreads>
  __device__ __forceinline__ static void CopyBlockAsync(unsigned char* dst, int pitch,
                                                        const unsigned char* head, int64_t ld,
                                                        int bytes, int i0, int rows, int j0,
                                                        int cols) {
    // Chunks per row: kCols * bytes / 16, a power of two (2 .. 16).
    constexpr int kColsLog2 = kCols == 32 ? 5 : 6;
    static_assert(kCols == 1 << kColsLog2, "32 or 64 keys");
    const int row_chunks_log2 = kColsLog2 + (bytes == 4 ? 2 : (bytes == 2 ? 1 : 0)) - 4;
    const int total = kRows << row_chunks_log2;
    const int row_bytes_left = (cols - j0) * bytes;  // past j0, in the source row
    for (int c = threadIdx.x; c < total; c += kThreads) {
      const int row = c >> row_chunks_log2;
      const int col = (c - (row << row_chunks_log2)) * 16;  // byte within the block's row
      const int n = i0 + row < rows ? max(0, min(16, row_bytes_left - col)) : 0;
      const unsigned char* src = n > 0 ? head + (i0 + row) * ld + j0 * bytes + col : head;
      const unsigned addr =
          static_cast<unsigned>(__cvta_generic_to_shared(dst + row * pitch + col));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(src), "r"(n)
                   : "memory");
    }
  }
};

}  // namespace jaxgpu::cuda::attention
