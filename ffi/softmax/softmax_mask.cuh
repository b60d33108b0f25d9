// Which elements of a forward row are kept: the row's offset into the broadcast mask (the
// index map of softmax_params.h, with FastDiv) and its causal limit, as keep bits per vector.
// No XLA types.
#pragma once

#include <cstdint>

#include "softmax/softmax_device.cuh"

namespace jaxgpu::cuda::softmax {

struct RowInfo {
  int64_t mask_off;  // of the row's mask row
  int last;          // last kept key: the query index (causal), else S - 1
};

// kFastOnly: for kernels launched only when a.fast; without the 64-bit path's divisions
// (calls, around which ptxas saves live registers).
template <bool kCausal, bool kMask, bool kFastOnly = false>
__device__ __forceinline__ RowInfo GetRowInfo(const FwdArgs& a, int64_t row) {
  const bool fast = kFastOnly || a.fast;
  RowInfo r{0, static_cast<int>(a.p.cols) - 1};
  if constexpr (kCausal) r.last = CausalLast(fast, a.query, a.p.query_len, row, r.last + 1);
  if (!kMask) return r;
  if (fast) {
    const uint32_t n0 = static_cast<uint32_t>(row);
    if constexpr (kMask) {
      uint32_t n = n0;
#pragma unroll
      for (int k = kSoftmaxMaxDims - 1; k >= 0; --k) {
        if (k < a.p.ndims) {
          const uint32_t q = Div(a.dims[k], n);
          r.mask_off += int64_t(n - q * a.dims[k].d) * a.p.mask_strides[k];
          n = q;
        }
      }
    }
  } else {
    if constexpr (kMask) {
      int64_t n = row;
      for (int k = a.p.ndims - 1; k >= 0; --k) {
        r.mask_off += (n % a.p.dims[k]) * a.p.mask_strides[k];
        n /= a.p.dims[k];
      }
    }
  }
  return r;
}

// Bit j set when byte j of the VEC mask bytes at `m` (VEC-aligned) is nonzero (true).
template <int VEC>
__device__ __forceinline__ uint32_t MaskVecBits(const uint8_t* m) {
  uint32_t bits = 0;
  if constexpr (VEC == 8) {
    const uint2 u = *reinterpret_cast<const uint2*>(m);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      bits |= uint32_t(((u.x >> (8 * j)) & 0xffu) != 0) << j;
      bits |= uint32_t(((u.y >> (8 * j)) & 0xffu) != 0) << (4 + j);
    }
  } else if constexpr (VEC == 4) {
    const uint32_t u = *reinterpret_cast<const uint32_t*>(m);
#pragma unroll
    for (int j = 0; j < 4; ++j) bits |= uint32_t(((u >> (8 * j)) & 0xffu) != 0) << j;
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) bits |= uint32_t(m[j] != 0) << j;
  }
  return bits;
}

// Keep bits of the VEC elements at column c: the mask's and the causal limit's. `mrow` is the
// row's mask (its bytes in global memory, or a copy staged in shared memory), read only for a
// mask along S.
template <int VEC, bool kCausal, bool kMask>
__device__ __forceinline__ uint32_t KeepVecBits(const FwdArgs& a, const RowInfo& r,
                                                const uint8_t* mrow, int c, bool row_on) {
  constexpr uint32_t kAll = (1u << VEC) - 1;
  uint32_t bits = kAll;
  if constexpr (kMask) {
    if (a.p.mask_col_stride != 0) {
      bits = MaskVecBits<VEC>(mrow + c);
    } else {
      bits = row_on ? kAll : 0u;
    }
  }
  if constexpr (kCausal) {
    // Elements c + j <= last are kept.
    const int n = r.last - c + 1;
    bits &= n >= VEC ? kAll : (n <= 0 ? 0u : (1u << n) - 1);
  }
  return bits;
}

// A mask broadcast along S is one byte per row.
template <bool kMask>
__device__ __forceinline__ bool RowOn(const FwdArgs& a, const RowInfo& r) {
  if constexpr (kMask) {
    if (a.p.mask_col_stride == 0) return a.p.mask[r.mask_off] != 0;
  }
  return true;
}

// Keep bits of the VPT vectors a thread owns in a row (vector k at column first + k * step; bit
// k * VEC + j for its element j): one bit per element, at most 8 vectors of at most 8 elements.
template <int VEC, int VPT, bool kCausal, bool kMask>
__device__ __forceinline__ uint64_t RowKeepBits(const FwdArgs& a, const RowInfo& r,
                                                const uint8_t* mrow, int lim, int first, int step,
                                                bool valid) {
  static_assert(VEC * VPT <= 64, "keep bits must fit in 64 bits");
  uint64_t keep = 0;
  if (valid) {
    const bool row_on = RowOn<kMask>(a, r);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int c = first + k * step;
      if (c < lim) {
        keep |= uint64_t(KeepVecBits<VEC, kCausal, kMask>(a, r, mrow, c, row_on)) << (k * VEC);
      }
    }
  }
  return keep;
}

}  // namespace jaxgpu::cuda::softmax
