// Rotary position embedding kernels: y = x rotated pairwise by angle(position, i), one
// kernel for the forward pass and (rotation by -angle) the backward pass.
//
// Napkin math (H100, q of (8, 4096, 32, 128) bf16 = 256 MiB): read x once, write y once,
// 512 MiB; at the ~3.0 TB/s a device copy reaches that is ~0.18 ms, and the backward pass
// moves the same bytes. positions (128 KiB) and the angles (never stored) are noise. So
// the kernel is a streaming copy with arithmetic: 16-byte vector loads and stores, several
// in flight per thread, and cheap enough math per byte that it hides behind the loads.
//
// Angles (rope_angle.h) are formed in double precision, once per (token, frequency) a
// thread owns, and reused for every head the thread walks through: at 32 heads of 128
// features that is one angle per 64 rotated elements (8 heads per thread: per 16).
//
// Thread mapping. A token's row (heads x dim) is cut into `lanes` 16-byte columns:
//   half layout        lane l rotates the vectors at l*VEC and l*VEC + r/2 (VEC pairs);
//   interleaved layout lane l rotates the vector at l*VEC (VEC/2 adjacent pairs);
//   pass-through       lanes past those copy the vectors at r, r + VEC, ... < dim.
// A unit is (token, group of heads_per_thread heads); a block is (lanes, units), lanes
// fastest, so a warp's loads are whole 16-byte columns of consecutive heads/tokens:
// full 32-byte sectors and 128-byte lines.
#include "rope/rope_cuda.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/cuda_utils.cuh"
#include "common/dev_knobs.h"
#include "rope/rope_angle.h"

namespace jaxgpu::cuda {
namespace {

constexpr int kBlockThreads = 256;

// The most frequencies a lane owns: a 16-byte vector of 2-byte elements, half layout.
constexpr int kMaxFreqsPerLane = 8;

struct RopeGrid {
  // inv_freq_{i0 + j} = inv_freq_{i0} * freq_step[j] (= theta^(-2j/r), from the host):
  // one double exp2 per lane instead of one per frequency.
  double freq_step[kMaxFreqsPerLane];
  double log2_freq_step;     // -2 log2(theta) / r: inv_freq_i = 2^(i * log2_freq_step)
  int64_t units;             // tokens * head_groups
  int64_t rows_per_pos_row;  // rows / pos_rows
  int lanes;                 // 16-byte columns per head row: rotating, then copying
  int rot_lanes;
  int head_groups;
  int heads_per_thread;
};

// sin/cos of the NF angles of frequencies i0 .. i0 + NF - 1 at `position`.
template <int NF>
__device__ __forceinline__ void Angles(const RopeParams& p, const RopeGrid& g, int32_t position,
                                       int i0, float (&s)[NF], float (&c)[NF]) {
  const float sign = p.inverse ? -1.f : 1.f;
  // position is exact in double and inv_freq within an ulp; the product and each step
  // add one rounding: ~1e-16 relative, 1e-10 rad at position 10^6.
  const double base = double(position) * exp2(double(i0) * g.log2_freq_step);
#pragma unroll
  for (int j = 0; j < NF; ++j) {
    double reduced;
    const int q = rope::ReduceQuadrant(j == 0 ? base : base * g.freq_step[j], &reduced);
    float sr, cr;
    rope::SinCosSmall(__double2float_rn(reduced), &sr, &cr);
    rope::ApplyQuadrant(q, sr, cr, &s[j], &c[j]);
    s[j] *= sign;
  }
}

// VEC elements of T as raw bits: whole 32-bit words when they fill them. A
// Vec<__nv_bfloat16, 8> is unpacked into eight 16-bit values, each taking a full register
// until used; as words, 4 heads' worth of half-layout loads is 32 registers. Sub-word
// columns (VEC = 1 of a 2-byte type: odd shapes) stay scalar.
template <typename T, int VEC>
struct Raw {
  static constexpr int kBytes = VEC * int(sizeof(T));
  static constexpr int kWords = kBytes / 4;
  static_assert(kBytes <= 16 && (kBytes % 4 == 0 || kBytes == 2), "unsupported column width");
  uint32_t w[kWords > 0 ? kWords : 1];
};

template <typename T, int VEC>
__device__ __forceinline__ Raw<T, VEC> LoadRaw(const T* p) {
  Raw<T, VEC> r;
  if constexpr (Raw<T, VEC>::kBytes == 16) {
    const uint4 u = __ldcs(reinterpret_cast<const uint4*>(p));
    r.w[0] = u.x;
    r.w[1] = u.y;
    r.w[2] = u.z;
    r.w[3] = u.w;
  } else if constexpr (Raw<T, VEC>::kBytes == 8) {
    const uint2 u = __ldcs(reinterpret_cast<const uint2*>(p));
    r.w[0] = u.x;
    r.w[1] = u.y;
  } else if constexpr (Raw<T, VEC>::kBytes == 4) {
    r.w[0] = __ldcs(reinterpret_cast<const unsigned int*>(p));
  } else {
    r.w[0] = __ldcs(reinterpret_cast<const unsigned short*>(p));
  }
  return r;
}

template <typename T, int VEC>
__device__ __forceinline__ void StoreRaw(T* p, const Raw<T, VEC>& r) {
  if constexpr (Raw<T, VEC>::kBytes == 16) {
    __stcs(reinterpret_cast<uint4*>(p), make_uint4(r.w[0], r.w[1], r.w[2], r.w[3]));
  } else if constexpr (Raw<T, VEC>::kBytes == 8) {
    __stcs(reinterpret_cast<uint2*>(p), make_uint2(r.w[0], r.w[1]));
  } else if constexpr (Raw<T, VEC>::kBytes == 4) {
    __stcs(reinterpret_cast<unsigned int*>(p), r.w[0]);
  } else {
    __stcs(reinterpret_cast<unsigned short*>(p), static_cast<unsigned short>(r.w[0]));
  }
}

// Exact widening of one 16-bit value (the low bits of w) and of a word of two (low
// element first: little-endian).
template <typename T>
__device__ __forceinline__ float HalfBitsToFloat(uint32_t w) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __uint_as_float(w << 16);
  } else {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(w)));
  }
}

template <typename T>
__device__ __forceinline__ float2 WordToFloat2(uint32_t w) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  } else {
    __half2 h;
    memcpy(&h, &w, 4);
    return __half22float2(h);
  }
}

// Round-to-nearest-even of two floats into one word (low element first).
template <typename T>
__device__ __forceinline__ uint32_t Float2ToWord(float lo, float hi) {
  uint32_t w;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    memcpy(&w, &v, 4);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    memcpy(&w, &v, 4);
  }
  return w;
}

template <typename T, int VEC>
__device__ __forceinline__ void RawToFloats(const Raw<T, VEC>& r, float (&f)[VEC]) {
  if constexpr (std::is_same_v<T, float>) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) f[j] = __uint_as_float(r.w[j]);
  } else if constexpr (VEC == 1) {
    f[0] = HalfBitsToFloat<T>(r.w[0]);
  } else {
#pragma unroll
    for (int k = 0; k < VEC / 2; ++k) {
      const float2 v = WordToFloat2<T>(r.w[k]);
      f[2 * k] = v.x;
      f[2 * k + 1] = v.y;
    }
  }
}

template <typename T, int VEC>
__device__ __forceinline__ Raw<T, VEC> FloatsToRaw(const float (&f)[VEC]) {
  Raw<T, VEC> r;
  if constexpr (std::is_same_v<T, float>) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) r.w[j] = __float_as_uint(f[j]);
  } else if constexpr (VEC == 1) {
    r.w[0] = Float2ToWord<T>(f[0], 0.f) & 0xffffu;
  } else {
#pragma unroll
    for (int k = 0; k < VEC / 2; ++k) r.w[k] = Float2ToWord<T>(f[2 * k], f[2 * k + 1]);
  }
  return r;
}

// kHeads consecutive heads of one column: Load issues all their loads, Rotate converts,
// rotates and stores. Half layout: the pairs are (element j of the vector at col, element
// j of the vector at col + partner); interleaved: (elements 2j, 2j + 1 of the vector).
template <typename T, int VEC, bool kInterleaved, int kHeads>
struct HeadBatch {
  static constexpr int kLoads = kInterleaved ? 1 : 2;
  Raw<T, VEC> v[kHeads][kLoads];

  __device__ __forceinline__ void Load(const T* __restrict__ x, int at, int partner, int H) {
#pragma unroll
    for (int u = 0; u < kHeads; ++u) {
      v[u][0] = LoadRaw<T, VEC>(x + at + u * H);
      if constexpr (!kInterleaved) v[u][1] = LoadRaw<T, VEC>(x + at + u * H + partner);
    }
  }

  __device__ __forceinline__ void Rotate(T* __restrict__ y, int at, int partner, int H,
                                         const float* s, const float* c) const {
#pragma unroll
    for (int u = 0; u < kHeads; ++u) {
      float a[VEC], o[VEC];
      RawToFloats<T, VEC>(v[u][0], a);
      if constexpr (kInterleaved) {
#pragma unroll
        for (int j = 0; j < VEC / 2; ++j) {
          o[2 * j] = a[2 * j] * c[j] - a[2 * j + 1] * s[j];
          o[2 * j + 1] = a[2 * j + 1] * c[j] + a[2 * j] * s[j];
        }
        StoreRaw<T, VEC>(y + at + u * H, FloatsToRaw<T, VEC>(o));
      } else {
        float b[VEC], ob[VEC];
        RawToFloats<T, VEC>(v[u][1], b);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          o[j] = a[j] * c[j] - b[j] * s[j];
          ob[j] = b[j] * c[j] + a[j] * s[j];
        }
        StoreRaw<T, VEC>(y + at + u * H, FloatsToRaw<T, VEC>(o));
        StoreRaw<T, VEC>(y + at + u * H + partner, FloatsToRaw<T, VEC>(ob));
      }
    }
  }
};

template <typename T, int VEC, int kHeads>
__device__ __forceinline__ void CopyHeads(const T* __restrict__ x, T* __restrict__ y, int at,
                                          int H) {
  Raw<T, VEC> v[kHeads];
#pragma unroll
  for (int u = 0; u < kHeads; ++u) v[u] = LoadRaw<T, VEC>(x + at + u * H);
#pragma unroll
  for (int u = 0; u < kHeads; ++u) StoreRaw<T, VEC>(y + at + u * H, v[u]);
}

template <typename T, int VEC, bool kInterleaved, int kUnroll>
__global__ void __launch_bounds__(kBlockThreads) RopeKernel(const RopeParams p, const RopeGrid g) {
  const int64_t unit = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  if (unit >= g.units) return;
  int64_t token = unit;
  int group = 0;
  if (g.head_groups > 1) {
    token = unit / g.head_groups;
    group = static_cast<int>(unit - token * g.head_groups);
  }
  const int N = static_cast<int>(p.heads), H = static_cast<int>(p.dim);
  const int r = static_cast<int>(p.rotary_dim);
  const int h_begin = group * g.heads_per_thread;
  const int h_end = min(N, h_begin + g.heads_per_thread);
  const int64_t row = token / p.seq;
  const int64_t t = token - row * p.seq;
  const int32_t position = __ldg(p.positions + (row / g.rows_per_pos_row) * p.seq + t);
  const int64_t base = token * N * H;  // N * H < 2^31 (checked), token * N * H may not be
  const T* __restrict__ x = static_cast<const T*>(p.x) + base;
  T* __restrict__ y = static_cast<T*>(p.y) + base;

  constexpr int NF = kInterleaved ? VEC / 2 : VEC;  // frequencies per lane
#pragma unroll 1
  for (int lane = threadIdx.x; lane < g.lanes; lane += blockDim.x) {
    // Whole groups of kUnroll heads without predicates, then the rest one at a time, no
    // further unrolling: guarded loads, and nvcc unrolling these loops again, had the
    // 4-head bf16 kernel at 117-128 registers (100 now).
    int h = h_begin;
    if (lane >= g.rot_lanes) {
      const int col = r + (lane - g.rot_lanes) * VEC;
#pragma unroll 1
      for (; h + kUnroll <= h_end; h += kUnroll) CopyHeads<T, VEC, kUnroll>(x, y, h * H + col, H);
#pragma unroll 1
      for (; h < h_end; ++h) CopyHeads<T, VEC, 1>(x, y, h * H + col, H);
      continue;
    }
    // The first batch's loads go out before the angles are computed (they do not need
    // them), so a thread has bytes in flight from its start, not after ~250 instructions.
    const int col = lane * VEC, partner = r / 2;
    float s[NF], c[NF];
    if (h + kUnroll <= h_end) {
      HeadBatch<T, VEC, kInterleaved, kUnroll> first;
      first.Load(x, h * H + col, partner, H);
      Angles<NF>(p, g, position, lane * NF, s, c);
      first.Rotate(y, h * H + col, partner, H, s, c);
      h += kUnroll;
    } else {
      Angles<NF>(p, g, position, lane * NF, s, c);
    }
#pragma unroll 1
    for (; h + kUnroll <= h_end; h += kUnroll) {
      HeadBatch<T, VEC, kInterleaved, kUnroll> batch;
      batch.Load(x, h * H + col, partner, H);
      batch.Rotate(y, h * H + col, partner, H, s, c);
    }
#pragma unroll 1
    for (; h < h_end; ++h) {
      HeadBatch<T, VEC, kInterleaved, 1> one;
      one.Load(x, h * H + col, partner, H);
      one.Rotate(y, h * H + col, partner, H, s, c);
    }
  }
}

using Kernel = void (*)(RopeParams, RopeGrid);

// The widest vector (up to 16 bytes) that every rotated pair and copied column fits in
// whole: it must divide dim (aligned head rows) and r/2 (half layout: the partner vector
// starts r/2 later) or r (interleaved: pairs never straddle vectors; at least 2), and x
// and y must be aligned to it (XLA's buffers are; a misaligned one gets narrower
// vectors rather than a fault). 0: none fits.
template <typename T>
int ChooseVec(const RopeParams& p) {
  const int64_t need = p.interleaved ? p.rotary_dim : p.rotary_dim / 2;
  const int min_vec = p.interleaved ? 2 : 1;
  const uintptr_t addr = reinterpret_cast<uintptr_t>(p.x) | reinterpret_cast<uintptr_t>(p.y);
  int v = static_cast<int>(16 / sizeof(T));
  while (v > min_vec && (p.dim % v != 0 || need % v != 0 || addr % (v * sizeof(T)) != 0)) v /= 2;
  return addr % (v * sizeof(T)) == 0 ? v : 0;
}

// Heads each thread walks through (reusing its angles). Few heads per thread recompute
// angles more often (a double exp2 per lane, then a double product, reduction and float32
// polynomial per frequency: ~150 double and ~100 float/int instructions per bf16 lane of 8
// frequencies); many make threads long-lived, so the last wave of blocks drains slowly.
// 8 heads: one angle per 16 rotated elements.
constexpr int kDefaultHeadsPerThread = 8;
// Heads whose loads a thread issues at once: 4 heads of a half-layout bf16 lane are
// 8 x 16 B = 128 B in flight per thread (the norm kernels needed ~64-128 B a thread).
// ptxas (sm_90, no spills): half-layout bf16 100 registers at 4 (2 blocks of 256 per SM,
// ~64 KiB of loads in flight per SM), 64 at 2, 137 at 8; interleaved 52 at 4. Capping
// the 4-head kernel at 64 or 80 registers (__launch_bounds__ min blocks) spilled.
constexpr int kDefaultUnroll = 4;

// Developer knob (common/dev_knobs.h): JAXGPU_ROPE_TUNE="h,u" overrides the heads per
// thread (h, any positive count) and the heads whose loads a thread issues at once (u: 1,
// 2, 4 or 8, the unrolls the full-width kernels are compiled for).
struct Tune {
  int heads_per_thread;
  int unroll;
};

Tune GetTune() {
  const Tune defaults{kDefaultHeadsPerThread, kDefaultUnroll};
  if (!kDevKnobs) return defaults;
  static const Tune tune = [&] {
    const DevKnob knob = ReadDevKnob("JAXGPU_ROPE_TUNE");
    Tune t = defaults;
    if (knob.ints[0] > 0) t.heads_per_thread = knob.ints[0];
    const int u = knob.ints[1];
    if (u == 1 || u == 2 || u == 4 || u == 8) {
      t.unroll = u;
    } else if (u != 0) {
      DevKnobIgnored("JAXGPU_ROPE_TUNE", "the unroll must be 1, 2, 4 or 8");
    }
    return t;
  }();
  return tune;
}

template <typename T, bool kInterleaved>
cudaError_t SelectKernel(int vec, int unroll, Kernel* kernel) {
  constexpr int kFull = 16 / sizeof(T);
  if (vec == kFull) {
    return JAXGPU_INT_SWITCH(unroll, U, (1, 2, 4, 8), [&] {
      *kernel = RopeKernel<T, kFull, kInterleaved, U>;
      return cudaSuccess;
    });
  }
  // Narrow vectors (odd shapes): one unroll.
  if constexpr (kFull >= 8) {
    if (vec == 4) *kernel = RopeKernel<T, 4, kInterleaved, kDefaultUnroll>;
  }
  if constexpr (kFull >= 4) {
    if (vec == 2) *kernel = RopeKernel<T, 2, kInterleaved, kDefaultUnroll>;
  }
  if constexpr (!kInterleaved) {
    if (vec == 1) *kernel = RopeKernel<T, 1, false, kDefaultUnroll>;
  }
  return *kernel == nullptr ? cudaErrorInvalidValue : cudaSuccess;
}

}  // namespace

cudaError_t LaunchRope(const RopeParams& p, cudaStream_t stream) {
  const int64_t tokens = p.rows * p.seq;
  if (tokens == 0 || p.heads == 0 || p.dim == 0) return cudaSuccess;
  const Tune tune = GetTune();
  Kernel kernel = nullptr;
  int vec = 1;
  const cudaError_t status = JAXGPU_DTYPE_SWITCH(p.dtype, T, kFloatDTypes, [&] {
    vec = ChooseVec<T>(p);
    if (vec == 0) return cudaErrorMisalignedAddress;
    return p.interleaved ? SelectKernel<T, true>(vec, tune.unroll, &kernel)
                         : SelectKernel<T, false>(vec, tune.unroll, &kernel);
  });
  if (status != cudaSuccess) return status;

  RopeGrid g{};
  g.rot_lanes = static_cast<int>((p.interleaved ? p.rotary_dim : p.rotary_dim / 2) / vec);
  g.lanes = g.rot_lanes + static_cast<int>((p.dim - p.rotary_dim) / vec);
  const int64_t hpt = std::min<int64_t>(p.heads, tune.heads_per_thread);
  g.heads_per_thread = static_cast<int>(hpt);
  g.head_groups = static_cast<int>(CeilDiv(p.heads, hpt));
  g.units = tokens * g.head_groups;
  g.rows_per_pos_row = p.rows / p.pos_rows;
  for (int j = 0; j < kMaxFreqsPerLane; ++j) {
    g.freq_step[j] = p.rotary_dim > 0 ? rope::InvFreq(j, p.rotary_dim, p.log2_theta) : 1.0;
  }
  g.log2_freq_step = p.rotary_dim > 0 ? -2.0 * p.log2_theta / double(p.rotary_dim) : 0.0;

  const int lanes_per_block = std::min(g.lanes, kBlockThreads);
  const int units_per_block = kBlockThreads / lanes_per_block;
  const int64_t blocks = CeilDiv(g.units, units_per_block);
  if (blocks > INT32_MAX) return cudaErrorInvalidConfiguration;
  kernel<<<static_cast<unsigned>(blocks), dim3(lanes_per_block, units_per_block), 0, stream>>>(p,
                                                                                               g);
  return cudaGetLastError();
}

}  // namespace jaxgpu::cuda
