// Cross-entropy kernels, forward and backward, with label smoothing, ignore_index and the
// Gemma 2 logit softcap fused.
//
// Napkin math (H100, 8192 x 262144 bf16, 4 GiB of logits): the forward pass must read the
// logits once (4 GiB) and writes 2 floats per row (64 KiB): at the ~3.0 TB/s a device copy
// reaches that is ~1.43 ms. The backward pass reads the logits and writes dlogits (8 GiB,
// ~2.9 ms). Every element costs ~6 float instructions (convert, max, subtract, scale,
// exp2, add) and one MUFU.EX2: 2^31 elements are ~0.4 ms of issue and ~0.6 ms of SFU
// time on 132 SMs, under the memory time, so both passes are memory-bound: one read,
// 16-byte accesses, enough bytes in flight.
//
// Row mapping. `tpr` threads (a power of two, 1..256) share a row; rows with few vectors
// share a block of 256 threads (blockDim.y rows). A row is streamed, never staged: 512 KiB does not fit
// in shared memory and does not need to, because the forward pass keeps an ONLINE
// (running max, rescaled sum of exponentials) pair per thread, and the backward pass is
// elementwise once lse is known. Rows need not be 16-byte aligned (V = 50257): each row
// is split into a scalar head (up to the first 16-byte boundary), whole 16-byte vectors,
// and a scalar tail. Each thread keeps kLoadsInFlight vectors in flight per step.
#include "cross_entropy/cross_entropy_cuda.h"

#include <cfloat>
#include <cstdint>

#include "common/cuda_utils.cuh"

namespace jaxgpu::cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
// 16-byte loads a thread issues before it uses them: 64 bytes per thread in flight; at
// >= 1024 resident threads an SM has >= 64 KiB in flight, ~3x what Little's law asks of
// 3 TB/s / 132 SMs at ~1 us of loaded latency (an estimate, not a measurement).
constexpr int kLoadsInFlight = 4;
// Threads per row (and per block) stop at 256, and a block asks for 5 resident blocks per
// SM (<= 51 registers; ptxas takes 48): 1280 threads, 80 KiB of loads in flight per SM.
// Without the bound ptxas took 54-64 registers (2 blocks of 512 = 1024 threads); the
// softcapped forward pass needs 4 blocks (64 registers): at 5 it spilled 8 bytes.
constexpr int kMaxTpr = 256;
constexpr int kMinBlocksPerSm = 5;
constexpr int kMinBlocksPerSmSoftcapFwd = 4;
constexpr int kMinBlockThreads = 256;
// Vectors per thread the row mapping aims for (so that a row's reduction, ~10 shuffles and
// a barrier, is amortized over >= 4 steps of kLoadsInFlight loads).
constexpr int kTargetVecsPerThread = 16;

// ---- per-element math ----------------------------------------------------------------------

// 2^x, flushing subnormal results to 0 (MUFU.EX2 alone; exp2f adds a subnormal fix-up):
// terms below 2^-126 of the row's max cannot change a float32 sum that is >= 1, nor a
// gradient beyond the rounding atol of its row.
__device__ __forceinline__ float Exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// tanh in float32, branch-free: an odd polynomial x + x^3 P(x^2) on |x| < 0.625 (P fitted
// here by weighted least squares for the relative error of tanh: 0.7 ulp max in float32
// Horner, checked in numpy) and 1 - 2 / (exp(2|x|) + 1) beyond (tanh >= 0.55 there, so no
// cancellation: 1.6 ulp in float32 with an exact exp2, plus EX2's own ~2 ulp). The exp
// form alone would lose absolute accuracy near 0 (~1e-7, i.e. 3e-6 in z at softcap 30,
// the size of the loss's whole error budget); tanh.approx.f32 (2^-11 relative) is far too
// coarse for a float32 loss.
__device__ __forceinline__ float TanhF(float x) {
  const float a = fabsf(x);
  const float u = x * x;
  float poly = -5.70684e-3f;
  poly = fmaf(poly, u, 2.064060e-2f);
  poly = fmaf(poly, u, -5.374009e-2f);
  poly = fmaf(poly, u, 1.3331445e-1f);
  poly = fmaf(poly, u, -3.3333282e-1f);
  const float small = fmaf(x * u, poly, x);
  // tanh(9) rounds to 1 in float32; the clamp keeps e finite for __fdividef.
  const float e = Exp2(fminf(a, 9.f) * (2.f * kLog2e));  // >= 1: no subnormals
  const float big = copysignf(1.f - __fdividef(2.f, e + 1.f), x);
  return a >= 0.625f ? big : small;  // NaN takes the polynomial, which keeps it NaN
}

// Logit -> z (softcapped or not); t = tanh(x / cap) for the backward chain rule.
template <bool kSoftcap>
__device__ __forceinline__ float Cap(float x, float cap, float inv_cap, float* t) {
  if constexpr (kSoftcap) {
    *t = TanhF(x * inv_cap);
    return cap * *t;
  } else {
    return x;
  }
}

// Online log-sum-exp state of one thread: sum_j exp(z_j - m) over the z it has seen, m
// the running max, and sum_j z_j (label smoothing's mean). m starts at -FLT_MAX, not
// -inf: 2^((-inf) - (-FLT_MAX)) is 0, where (-inf) - (-inf) would be NaN.
struct Lse {
  float m = -FLT_MAX;
  float s = 0.f;
  float sz = 0.f;
};

// Adds N values: one max over the group, one rescale of the running sum, N exponentials.
// The group's terms are summed in 4 interleaved partial sums, then added to the running
// sum: a thread's sum over its ~1000 elements (V = 262144) is then ~40 additions deep
// instead of ~1000 (float32 rounding grows with the depth), with 4 independent chains.
template <bool kSmooth, int N>
__device__ __forceinline__ void AddGroup(const float (&f)[N], Lse& st, float mx) {
  constexpr int kChains = N >= 4 ? 4 : 1;
  const float nm = fmaxf(st.m, mx);
  float part[kChains], zpart[kChains];
#pragma unroll
  for (int c = 0; c < kChains; ++c) part[c] = zpart[c] = 0.f;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    part[j % kChains] += Exp2((f[j] - nm) * kLog2e);
    if constexpr (kSmooth) zpart[j % kChains] += f[j];
  }
  float group = part[0], zgroup = zpart[0];
  if constexpr (kChains == 4) {
    group = (part[0] + part[1]) + (part[2] + part[3]);
    zgroup = (zpart[0] + zpart[1]) + (zpart[2] + zpart[3]);
  }
  st.s = fmaf(st.s, Exp2((st.m - nm) * kLog2e), group);
  if constexpr (kSmooth) st.sz += zgroup;
  st.m = nm;
}

template <bool kSmooth, int N>
__device__ __forceinline__ void AddGroup(const float (&f)[N], Lse& st) {
  float mx = f[0];
#pragma unroll
  for (int j = 1; j < N; ++j) mx = fmaxf(mx, f[j]);
  AddGroup<kSmooth>(f, st, mx);
}

template <typename T>
struct Pair;
template <>
struct Pair<__nv_bfloat16> {
  using type = __nv_bfloat162;
};
template <>
struct Pair<__half> {
  using type = __half2;
};

// Max of U loaded vectors. 16-bit types: on packed pairs (HMNMX2, exact), so the float
// copies of the elements need not all be live at once (61 -> 40 registers, bf16).
template <typename T, int VEC, int U>
__device__ __forceinline__ float VecMax(const Vec<T, VEC> (&v)[U]) {
  if constexpr (sizeof(T) == 2 && VEC % 2 == 0) {
    using T2 = typename Pair<T>::type;
    T2 acc = *reinterpret_cast<const T2*>(&v[0].v[0]);
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int j = (u == 0 ? 2 : 0); j < VEC; j += 2)
        acc = __hmax2(acc, *reinterpret_cast<const T2*>(&v[u].v[j]));
    return fmaxf(ToFloat(acc.x), ToFloat(acc.y));
  } else {
    float mx = ToFloat(v[0].v[0]);
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int j = 0; j < VEC; ++j) mx = fmaxf(mx, ToFloat(v[u].v[j]));
    return mx;
  }
}

// Adds U loaded vectors of logits. Without a softcap the max comes from the raw vectors
// and each element is converted once, in the exponential's loop.
template <bool kSmooth, bool kSoftcap, typename T, int VEC, int U>
__device__ __forceinline__ void AddVecs(const Vec<T, VEC> (&v)[U], Lse& st, float cap,
                                        float inv_cap) {
  float f[U * VEC];
  float t;
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int j = 0; j < VEC; ++j)
      f[u * VEC + j] = Cap<kSoftcap>(ToFloat(v[u].v[j]), cap, inv_cap, &t);
  if constexpr (kSoftcap) {
    AddGroup<kSmooth>(f, st);
  } else {
    AddGroup<kSmooth>(f, st, VecMax<T, VEC, U>(v));
  }
}

// Merges (m2, s2, sz2) into st. Symmetric in its two operands bit for bit (IEEE + and *
// commute), so both lanes of a butterfly step end with the same value.
__device__ __forceinline__ void Merge(Lse& st, float m2, float s2, float sz2) {
  const float nm = fmaxf(st.m, m2);
  st.s = st.s * Exp2((st.m - nm) * kLog2e) + s2 * Exp2((m2 - nm) * kLog2e);
  st.m = nm;
  st.sz += sz2;
}

// Combines the states of the `tpr` threads of a row: xor shuffles within the warp, then
// the row's warps in a fixed order through shared memory. Deterministic. Every thread of
// the block must call it (it may __syncthreads); every thread of a row gets the result.
__device__ __forceinline__ void RowReduce(Lse& st, float (*scratch)[3], int tpr) {
  const int width = tpr < 32 ? tpr : 32;
  for (int o = width / 2; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, st.m, o);
    const float s2 = __shfl_xor_sync(0xffffffffu, st.s, o);
    const float sz2 = __shfl_xor_sync(0xffffffffu, st.sz, o);
    Merge(st, m2, s2, sz2);
  }
  if (tpr <= 32) return;
  const int warp = (threadIdx.y * tpr + threadIdx.x) / 32;
  if ((threadIdx.x & 31) == 0) {
    scratch[warp][0] = st.m;
    scratch[warp][1] = st.s;
    scratch[warp][2] = st.sz;
  }
  __syncthreads();
  const int first = threadIdx.y * (tpr / 32);
  st = Lse{scratch[first][0], scratch[first][1], scratch[first][2]};
  for (int w = 1; w < tpr / 32; ++w)
    Merge(st, scratch[first + w][0], scratch[first + w][1], scratch[first + w][2]);
}

// A row of V elements of T at `row`: `head` scalars up to the first 16-byte boundary, then
// `nvec` whole VEC-element vectors, then the tail. Needs `row` aligned to sizeof(T) (XLA's
// buffers are), not to 16 bytes.
template <typename T, int VEC>
struct RowSplit {
  int head;
  int nvec;
  __device__ __forceinline__ RowSplit(const void* row, int V) {
    if constexpr (VEC == 1) {
      head = 0;
      nvec = V;
    } else {
      const int mis = int((reinterpret_cast<uintptr_t>(row) & 15u) / sizeof(T));
      head = mis ? VEC - mis : 0;
      if (head > V) head = V;
      nvec = (V - head) / VEC;
    }
  }
  __device__ __forceinline__ int tail() const { return head + nvec * VEC; }
};

struct RowLabel {
  int32_t label;
  bool ignored;
  bool active;  // in the grid, not ignored, label in [0, V): the logits are read
};

__device__ __forceinline__ RowLabel ReadLabel(const int32_t* labels, int64_t row, bool in_grid,
                                              int V, bool has_ignore, int32_t ignore_index) {
  RowLabel r;
  r.label = in_grid ? labels[row] : 0;
  r.ignored = has_ignore && r.label == ignore_index;
  r.active = in_grid && !r.ignored && r.label >= 0 && r.label < V;
  return r;
}

// ---- forward -------------------------------------------------------------------------------

template <typename T, int VEC, bool kSmooth, bool kSoftcap>
__global__ void __launch_bounds__(kMaxTpr, kSoftcap ? kMinBlocksPerSmSoftcapFwd : kMinBlocksPerSm)
    CrossEntropyFwdKernel(const CrossEntropyFwdParams p, int tpr) {
  __shared__ float scratch[kMaxTpr / 32][3];
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool in_grid = row < p.rows;
  const int V = static_cast<int>(p.vocab);  // < 2^30 (checked by the handler): columns are int
  const RowLabel lab = ReadLabel(p.labels, row, in_grid, V, p.has_ignore, p.ignore_index);
  const T* x = static_cast<const T*>(p.logits) + (in_grid ? row * V : 0);
  const float cap = p.softcap, inv_cap = kSoftcap ? 1.f / p.softcap : 0.f;
  const int t0 = threadIdx.x;
  float unused;

  // The label's logit: one element, loaded before the stream so its latency overlaps it.
  float z_label = 0.f;
  if (lab.active && t0 == 0) z_label = Cap<kSoftcap>(ToFloat(x[lab.label]), cap, inv_cap, &unused);

  Lse st;
  if (lab.active) {
    const RowSplit<T, VEC> sp(x, V);
    for (int e = t0; e < sp.head; e += tpr) {
      const float f[1] = {Cap<kSoftcap>(ToFloat(x[e]), cap, inv_cap, &unused)};
      AddGroup<kSmooth>(f, st);
    }
    for (int e = sp.tail() + t0; e < V; e += tpr) {
      const float f[1] = {Cap<kSoftcap>(ToFloat(x[e]), cap, inv_cap, &unused)};
      AddGroup<kSmooth>(f, st);
    }
    const T* body = x + sp.head;
    int i = t0;
    // Whole steps: kLoadsInFlight unguarded vector loads, then the math.
    for (; i + (kLoadsInFlight - 1) * tpr < sp.nvec; i += kLoadsInFlight * tpr) {
      Vec<T, VEC> v[kLoadsInFlight];
#pragma unroll
      for (int u = 0; u < kLoadsInFlight; ++u)
        v[u] = LoadVecStream<T, VEC>(body, (i + u * tpr) * VEC);
      AddVecs<kSmooth, kSoftcap>(v, st, cap, inv_cap);
    }
    for (; i < sp.nvec; i += tpr) {  // the remainder, one vector at a time
      const Vec<T, VEC> v[1] = {LoadVecStream<T, VEC>(body, i * VEC)};
      AddVecs<kSmooth, kSoftcap>(v, st, cap, inv_cap);
    }
  }
  RowReduce(st, scratch, tpr);
  if (!in_grid || t0 != 0) return;
  if (!lab.active) {
    p.loss[row] = lab.ignored ? 0.f : __int_as_float(0x7fc00000);  // quiet NaN
    p.lse[row] = 0.f;
    return;
  }
  // st.m is finite unless a logit is +inf (then lse is +inf or NaN, as in the reference).
  const float lse = st.m + logf(st.s);
  const float ls = p.label_smoothing;
  float loss = lse - (1.f - ls) * z_label;
  if constexpr (kSmooth) loss -= ls * (st.sz / float(V));
  p.loss[row] = loss;
  p.lse[row] = lse;
}

// ---- backward ------------------------------------------------------------------------------
//
// dlogits_j = g * exp(z_j - lse) - g * ls / V - [j == label] * g * (1 - ls), times
// 1 - tanh^2 with a softcap. Elementwise once the row's lse is known: no reduction, each
// element read once and written once. Ignored and out-of-range rows write zeros without
// reading their logits.

struct BwdRow {
  float g, lse, smooth, at_label, cap, inv_cap;
};

template <bool kSoftcap>
__device__ __forceinline__ float Grad(const BwdRow& r, float xv, bool is_label) {
  float t = 0.f;
  const float z = Cap<kSoftcap>(xv, r.cap, r.inv_cap, &t);
  float d = fmaf(r.g, Exp2((z - r.lse) * kLog2e), -r.smooth);
  if (is_label) d -= r.at_label;
  if constexpr (kSoftcap) d *= fmaf(-t, t, 1.f);
  return d;
}

template <typename T, int VEC, bool kSoftcap>
__global__ void __launch_bounds__(kMaxTpr, kMinBlocksPerSm)
    CrossEntropyBwdKernel(const CrossEntropyBwdParams p, int tpr) {
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  if (row >= p.rows) return;  // no barriers below
  const int V = static_cast<int>(p.vocab);
  const RowLabel lab = ReadLabel(p.labels, row, true, V, p.has_ignore, p.ignore_index);
  const T* x = static_cast<const T*>(p.logits) + row * V;
  T* dx = static_cast<T*>(p.dlogits) + row * V;
  const int t0 = threadIdx.x;
  // The launcher picks VEC > 1 only when logits and dlogits have the same offset from a
  // 16-byte boundary, so one split serves both.
  const RowSplit<T, VEC> sp(x, V);
  T* dbody = dx + sp.head;

  if (!lab.active) {
    const T zero = FromFloat<T>(0.f);
    Vec<T, VEC> zv;
#pragma unroll
    for (int j = 0; j < VEC; ++j) zv.v[j] = zero;
    for (int e = t0; e < sp.head; e += tpr) dx[e] = zero;
    for (int e = sp.tail() + t0; e < V; e += tpr) dx[e] = zero;
    for (int i = t0; i < sp.nvec; i += tpr) StoreVecStream<T, VEC>(dbody, i * VEC, zv);
    return;
  }

  BwdRow r;
  r.g = p.dloss[row];
  r.lse = p.lse[row];
  r.smooth = r.g * p.label_smoothing / float(V);
  r.at_label = r.g * (1.f - p.label_smoothing);
  r.cap = p.softcap;
  r.inv_cap = kSoftcap ? 1.f / p.softcap : 0.f;
  const int label = lab.label;

  for (int e = t0; e < sp.head; e += tpr)
    dx[e] = FromFloat<T>(Grad<kSoftcap>(r, ToFloat(x[e]), e == label));
  for (int e = sp.tail() + t0; e < V; e += tpr) {
    dx[e] = FromFloat<T>(Grad<kSoftcap>(r, ToFloat(x[e]), e == label));
  }
  const T* body = x + sp.head;
  // The label's position relative to the body, in elements (may be negative or past it).
  const int label_in_body = label - sp.head;
  int i = t0;
  for (; i + (kLoadsInFlight - 1) * tpr < sp.nvec; i += kLoadsInFlight * tpr) {
    Vec<T, VEC> v[kLoadsInFlight];
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u)
      v[u] = LoadVecStream<T, VEC>(body, (i + u * tpr) * VEC);
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      const int col = (i + u * tpr) * VEC;
      const int rel = label_in_body - col;  // the label's lane in this vector, if in [0, VEC)
      Vec<T, VEC> out;
#pragma unroll
      for (int j = 0; j < VEC; ++j)
        out.v[j] = FromFloat<T>(Grad<kSoftcap>(r, ToFloat(v[u].v[j]), rel == j));
      StoreVecStream<T, VEC>(dbody, col, out);
    }
  }
  for (; i < sp.nvec; i += tpr) {
    const int col = i * VEC;
    const Vec<T, VEC> v = LoadVecStream<T, VEC>(body, col);
    const int rel = label_in_body - col;
    Vec<T, VEC> out;
#pragma unroll
    for (int j = 0; j < VEC; ++j)
      out.v[j] = FromFloat<T>(Grad<kSoftcap>(r, ToFloat(v.v[j]), rel == j));
    StoreVecStream<T, VEC>(dbody, col, out);
  }
}

// ---- launch --------------------------------------------------------------------------------

struct RowMap {
  int tpr;
  int rows_per_block;
};

// ~kTargetVecsPerThread vectors a thread, at most kMaxTpr threads a row: V = 262144 bf16
// gets 256 threads (128 vectors each), V = 50257 256 (~25), V = 4096 32, tiny rows 1.
RowMap ChooseRowMap(int64_t vocab, int vec) {
  const int64_t need = CeilDiv(CeilDiv(vocab, vec), kTargetVecsPerThread);
  const int tpr = need >= kMaxTpr ? kMaxTpr : NextPow2(need);
  const int block = tpr > kMinBlockThreads ? tpr : kMinBlockThreads;
  return {tpr, block / tpr};
}

}  // namespace

cudaError_t LaunchCrossEntropyFwd(const CrossEntropyFwdParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  const cudaError_t status = JAXGPU_DTYPE_SWITCH(p.dtype, T, kFloatDTypes, [&] {
    constexpr int kVec = 16 / sizeof(T);
    const RowMap m = ChooseRowMap(p.vocab, kVec);
    const dim3 block(m.tpr, m.rows_per_block);
    const int64_t grid = CeilDiv(p.rows, m.rows_per_block);
    return JAXGPU_BOOL_SWITCH(p.label_smoothing > 0.f, kSmooth, [&] {
      return JAXGPU_BOOL_SWITCH(p.softcap > 0.f, kSoftcap, [&] {
        CrossEntropyFwdKernel<T, kVec, kSmooth, kSoftcap><<<grid, block, 0, stream>>>(p, m.tpr);
        return cudaSuccess;
      });
    });
  });
  if (status != cudaSuccess) return status;
  return cudaGetLastError();
}

cudaError_t LaunchCrossEntropyBwd(const CrossEntropyBwdParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  // One head/body/tail split serves logits and dlogits when their offsets from a 16-byte
  // boundary agree (always, for XLA's allocations); otherwise scalar accesses.
  const bool same_phase =
      ((reinterpret_cast<uintptr_t>(p.logits) ^ reinterpret_cast<uintptr_t>(p.dlogits)) & 15u) == 0;
  const cudaError_t status = JAXGPU_DTYPE_SWITCH(p.dtype, T, kFloatDTypes, [&] {
    constexpr int kVec = 16 / sizeof(T);
    const RowMap m = ChooseRowMap(p.vocab, same_phase ? kVec : 1);
    const dim3 block(m.tpr, m.rows_per_block);
    const int64_t grid = CeilDiv(p.rows, m.rows_per_block);
    return JAXGPU_BOOL_SWITCH(p.softcap > 0.f, kSoftcap, [&] {
      if (same_phase) {
        CrossEntropyBwdKernel<T, kVec, kSoftcap><<<grid, block, 0, stream>>>(p, m.tpr);
      } else {
        CrossEntropyBwdKernel<T, 1, kSoftcap><<<grid, block, 0, stream>>>(p, m.tpr);
      }
      return cudaSuccess;
    });
  });
  if (status != cudaSuccess) return status;
  return cudaGetLastError();
}

}  // namespace jaxgpu::cuda
