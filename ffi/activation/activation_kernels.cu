// Activation kernels: ONE elementwise kernel template for every op and pass, specialized
// by the functor of activation_math.h (UnaryFwd/UnaryBwd/GatedFwd/GatedBwd of an
// activation). Each input is read once and each output written once.
//
// Napkin math (H100, bf16 (8192, 28672), N = 470 MB per tensor): swiglu forward moves 3N
// (read gate, up; write y), ~0.47 ms at the ~3.0 TB/s a device copy reaches; the backward
// pass moves 5N (read gate, up, dy; write dgate, dup), ~0.78 ms. So the kernels are
// memory-bound if the arithmetic hides under the loads: at 3 TB/s the H100's 132 SMs can
// issue ~60 instructions per element of a 6-byte-per-element pass (bf16 gated forward)
// and ~100 of a 10-byte one (bf16 gated backward). Counted in PTX per element (sm_90, bf16):
// swiglu forward 26, backward 35; geglu (tanh) 29 and 44; geglu (erf, the heaviest)
// 51 and 58.
//
// Mapping. The buffers are split into 16-byte vectors (VEC elements). Each thread of a
// 256-thread block loads U vectors of every input (kIn * U independent 16-byte loads in
// flight: 4 to 6), then computes and stores them; the vectors of one load instruction are
// contiguous across the warp (512 bytes). The grid covers the buffers once (see Launch;
// the grid-stride loop only matters past 2^31 - 1 blocks). The last n % VEC elements of an
// odd-sized buffer are done by the first threads of the grid, one each. XLA's buffers are
// aligned (to 16 bytes at least); a buffer that is not takes the same kernel with
// one-element "vectors".
#include "activation/activation_cuda.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "activation/activation_math.h"
#include "common/cuda_utils.cuh"

namespace jaxgpu::cuda {
namespace {

constexpr int kThreads = 256;

struct ElemArgs {
  const void* in[3];
  void* out[2];
  int64_t n;
};

// Vectors per thread per loop iteration: at least 4 independent 16-byte loads in flight per
// thread (one input: 4 vectors; two or three inputs: 2 vectors of each), so that an SM with
// 1280-1536 resident threads (32-48 registers each, -Xptxas=-v) keeps 80-100 KB of loads in
// flight, well past the ~30 KB per SM that Little's law asks of 3 TB/s at an (estimated)
// ~1.3 us of HBM latency under load.
template <class Op>
constexpr int Unroll() {
  return Op::kIn == 1 ? 4 : 2;
}

// Element j of a loaded vector as float32. bfloat16 is the high half of a float32: a shift
// or a mask of the packed 32-bit word, which keeps the vector in 4 registers until its use
// (cuda_bf16's conversion is inline asm on 16-bit operands, which split every vector into
// one register per element as soon as it is loaded: +17-20 registers a thread in the
// bfloat16 gated kernels, measured with -Xptxas=-v).
template <typename T, int VEC>
__device__ __forceinline__ float Elem(const Vec<T, VEC>& v, int j) {
  if constexpr (std::is_same_v<T, __nv_bfloat16> && VEC % 2 == 0) {
    const uint32_t w = reinterpret_cast<const uint32_t*>(&v)[j / 2];
    return __uint_as_float((j % 2) ? (w & 0xffff0000u) : (w << 16));
  } else {
    return ToFloat(v.v[j]);
  }
}

// Two results rounded to T at once (one cvt.rn.{bf16,f16}x2.f32 for 16-bit types).
template <typename T>
__device__ __forceinline__ void StorePair(T* dst, float a, float b) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(a, b);
  } else if constexpr (std::is_same_v<T, __half>) {
    *reinterpret_cast<__half2*>(dst) = __floats2half2_rn(a, b);
  } else {
    dst[0] = a;
    dst[1] = b;
  }
}

// Every element of vector u of each input through the functor, in float32.
template <typename T, int VEC, int U, class Op>
__device__ __forceinline__ void ApplyVec(const Vec<T, VEC> (&in)[Op::kIn][U], int u,
                                         Vec<T, VEC> (&out)[Op::kOut]) {
  if constexpr (VEC % 2 == 0) {
#pragma unroll
    for (int j = 0; j < VEC; j += 2) {
      float a0[Op::kIn], a1[Op::kIn], r0[Op::kOut], r1[Op::kOut];
#pragma unroll
      for (int i = 0; i < Op::kIn; ++i) {
        a0[i] = Elem(in[i][u], j);
        a1[i] = Elem(in[i][u], j + 1);
      }
      Op::Apply(a0, r0);
      Op::Apply(a1, r1);
#pragma unroll
      for (int i = 0; i < Op::kOut; ++i) StorePair<T>(&out[i].v[j], r0[i], r1[i]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      float a[Op::kIn], r[Op::kOut];
#pragma unroll
      for (int i = 0; i < Op::kIn; ++i) a[i] = ToFloat(in[i][u].v[j]);
      Op::Apply(a, r);
#pragma unroll
      for (int i = 0; i < Op::kOut; ++i) out[i].v[j] = FromFloat<T>(r[i]);
    }
  }
}

template <typename T, int VEC, int U, class Op>
__global__ void __launch_bounds__(kThreads) Elementwise(const ElemArgs a) {
  using V = Vec<T, VEC>;
  const int64_t nvec = a.n / VEC;
  const int64_t step = int64_t(gridDim.x) * kThreads * U;
  for (int64_t v0 = int64_t(blockIdx.x) * kThreads * U + threadIdx.x; v0 < nvec; v0 += step) {
    V in[Op::kIn][U];
    // All loads first (independent, in flight together), then the math and the stores.
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t v = v0 + int64_t(u) * kThreads;
      if (v < nvec) {
#pragma unroll
        for (int i = 0; i < Op::kIn; ++i) in[i][u] = LoadVecStream<T, VEC>(a.in[i], v * VEC);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t v = v0 + int64_t(u) * kThreads;
      if (v < nvec) {
        V out[Op::kOut];
        ApplyVec<T, VEC, U, Op>(in, u, out);
#pragma unroll
        for (int i = 0; i < Op::kOut; ++i) StoreVecStream<T, VEC>(a.out[i], v * VEC, out[i]);
      }
    }
  }
  if constexpr (VEC > 1) {
    // Scalar tail: the n % VEC (< VEC) elements after the last whole vector.
    const int64_t e = nvec * VEC + int64_t(blockIdx.x) * kThreads + threadIdx.x;
    if (e < a.n) {
      float x[Op::kIn], r[Op::kOut];
#pragma unroll
      for (int i = 0; i < Op::kIn; ++i) x[i] = ToFloat(static_cast<const T*>(a.in[i])[e]);
      Op::Apply(x, r);
#pragma unroll
      for (int i = 0; i < Op::kOut; ++i) static_cast<T*>(a.out[i])[e] = FromFloat<T>(r[i]);
    }
  }
}

// One loop iteration per thread (a grid of ceil(n / (threads x unroll x VEC)) blocks): on
// the H100 (bf16 (8192, 28672), jaxgpu commit 3378fc5) swiglu forward ran at 3.01 TB/s,
// against 2.74 TB/s with the grid capped at one wave of resident blocks and 2.72 at two
// (grid-stride loop). The loop stays for grids past 2^31 - 1 blocks.
template <typename T, int VEC, class Op>
cudaError_t Launch(const ElemArgs& a, cudaStream_t stream) {
  constexpr int U = Unroll<Op>();
  auto kernel = Elementwise<T, VEC, U, Op>;
  const int64_t nvec = a.n / VEC;
  const int64_t blocks =
      std::min<int64_t>(std::max<int64_t>(1, CeilDiv(nvec, int64_t(kThreads) * U)), INT32_MAX);
  kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

bool Aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

}  // namespace

cudaError_t LaunchActivation(const ActParams& p, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  ElemArgs a{};
  bool aligned = true;
  for (int i = 0; i < ActInputs(p); ++i) {
    a.in[i] = p.in[i];
    aligned = aligned && Aligned16(p.in[i]);
  }
  for (int i = 0; i < ActOutputs(p); ++i) {
    a.out[i] = p.out[i];
    aligned = aligned && Aligned16(p.out[i]);
  }
  a.n = p.n;
  return act::DispatchOp(p, [&](auto tag) {
    using Op = typename decltype(tag)::type;
    return JAXGPU_DTYPE_SWITCH(p.dtype, T, kFloatDTypes, [&] {
      constexpr int kVec = 16 / sizeof(T);
      return aligned ? Launch<T, kVec, Op>(a, stream) : Launch<T, 1, Op>(a, stream);
    });
  });
}

}  // namespace jaxgpu::cuda
