// Decode attention over a paged KV cache (split-KV, "flash decoding"): the launcher, the
// CUDA-core split kernel for a float32 query, and the combine of the splits. A 16-bit
// query runs the tensor-core split kernel (decode_tc_kernels.cu); both share the merge
// and the workspace layout (decode_split.cuh).
//
// Napkin math (H100, bf16, GQA 32/8, H = 128, Tq = 1): a token's K and V for the 8 kv heads
// are 2 x 8 x 128 x 2 B = 4 KiB. B = 8 rows of L = 32k tokens is 1 GiB of cache that must be
// read once: ~358 us at the ~3.0 TB/s a device copy reaches (cuDNN on a contiguous cache:
// 377 us). Queries, the output and the split workspace are KBs to a few MB. B = 1, L = 4k:
// 16 MiB, ~5.6 us of reading, so the launch, the split count and the combine dominate.
//
// CUDA-core kernel (float32 queries: no float32 tensor-core product is exact enough). A
// block owns one (group, row, kv head), one split of the row's keys, and kRowTile query
// rows of that kv head (the Tq new tokens times the N/K query heads: with Tq x N/K <=
// kRowTile, every K/V byte is read once per kv head). A key's H values are spread over
// kLanes lanes (8 values per lane), so a warp holds 32 / kLanes independent key streams,
// each with its own online softmax (running max, sum and output in float32); the streams
// are merged through shared memory at the end. Each lane loads kUnroll keys' K and V
// vectors (read through the block table) before using any, so that enough bytes are in
// flight to cover the memory latency. Logits are in the log2 domain: the scale times
// log2(e) is folded into the query (softcap: the tanh input scale, with cap x log2(e)
// applied after), and exp2 is one MUFU op. An 8-bit cache's per-token scales multiply the
// key's logit and its probability.
//
// Splits. The host picks num_splits (jaxgpu/ops/decode.py: enough blocks for ~2 waves of an
// H100 when batch x kv heads alone cannot fill it); each split takes an equal, contiguous
// share of the row's ACTUAL visible key range at run time, so a short row in a long table
// still spreads its keys over every split. With one split the block writes the output;
// otherwise it writes its normalized partial output and log2-sum-exp to the float32
// workspace, and the combine kernel weights the partials by exp2(lse_i - lse).
//
// Out of range. A row's key range is [max(0, len - Tq - window), len) for 0 <= len <=
// M x S and empty otherwise (so the table is only read at columns < M); a key whose table
// entry is outside [0, P) is masked and its page never loaded.
#include "decode/decode_cuda.h"

#include <cuda_fp8.h>

#include <cstdint>

#include "common/cuda_dispatch.cuh"
#include "common/cuda_utils.cuh"
#include "decode/decode_split.cuh"

namespace jaxgpu::cuda {
namespace {

using decode::kLog2e;
using decode::kMaxCombineSplits;
constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kRowTile = 8;  // query rows of one kv head per block
constexpr int kUnroll = 4;   // keys per stream whose K and V loads are in flight at once
constexpr int kPerLane = 8;  // head-dim values per lane: 16 bytes of a 16-bit type
constexpr int kCombineThreads = 256;

// 8 consecutive values at `src` (16-byte aligned) as float.
template <typename T>
__device__ __forceinline__ void Load8(const T* src, float (&out)[kPerLane]);

template <>
__device__ __forceinline__ void Load8<float>(const float* src, float (&out)[kPerLane]) {
  const float4 a = reinterpret_cast<const float4*>(src)[0];
  const float4 b = reinterpret_cast<const float4*>(src)[1];
  out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
  out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
}

// The raw storage of 8 cached values (float32, or 8-bit with a scale), loaded now and
// converted later: the loads of kUnroll keys are all issued before the first conversion.
template <typename KV>
struct Raw8 {
  KV v[kPerLane];
};

template <typename KV>
__device__ __forceinline__ Raw8<KV> LoadRaw(const KV* src) {
  Raw8<KV> r;
  if constexpr (sizeof(KV) == 1) {
    *reinterpret_cast<uint2*>(r.v) = *reinterpret_cast<const uint2*>(src);
  } else {
    reinterpret_cast<float4*>(r.v)[0] = reinterpret_cast<const float4*>(src)[0];
    reinterpret_cast<float4*>(r.v)[1] = reinterpret_cast<const float4*>(src)[1];
  }
  return r;
}

template <typename KV>
__device__ __forceinline__ Raw8<KV> ZeroRaw() {
  Raw8<KV> r;
  if constexpr (sizeof(KV) == 1) {
    *reinterpret_cast<uint2*>(r.v) = make_uint2(0u, 0u);
  } else {
    reinterpret_cast<float4*>(r.v)[0] = make_float4(0.f, 0.f, 0.f, 0.f);
    reinterpret_cast<float4*>(r.v)[1] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  return r;
}

__device__ __forceinline__ float KvFloat(float x) { return x; }
__device__ __forceinline__ float KvFloat(int8_t x) { return float(x); }
__device__ __forceinline__ float KvFloat(__nv_fp8_e4m3 x) { return float(x); }

// The key range [begin, end) of row `len` that split `split` reads. Both fit int32: a range
// is empty unless 0 <= len <= M x S, and then end <= len, an int32.
struct KeyRange {
  int32_t begin, end;
};

__device__ __forceinline__ KeyRange SplitRange(const PagedAttentionParams& p, int64_t len,
                                               int split) {
  const int64_t cap = p.max_pages * p.page_size;
  const bool row_ok = len >= 0 && len <= cap;
  const int64_t hi = row_ok ? len : 0;
  int64_t lo = 0;
  if (p.window_left >= 0) lo = len - p.q_len - p.window_left;
  lo = lo < 0 ? 0 : (lo > hi ? hi : lo);
  const int64_t chunk = CeilDiv(hi - lo, p.num_splits);
  int64_t begin = lo + split * chunk;
  begin = begin > hi ? hi : begin;
  const int64_t end = begin + chunk > hi ? hi : begin + chunk;
  return {int32_t(begin), int32_t(end)};
}

template <typename KV, int kLanes, bool kSoftcap>
__global__ void __launch_bounds__(kThreads)
    PagedAttentionSplitKernel(const PagedAttentionParams p, int64_t rows_per_kv) {
  using T = float;                      // the query and output
  constexpr int kGroups = 32 / kLanes;  // key streams per warp
  constexpr int kStreams = kWarps * kGroups;
  constexpr int kWidth = kLanes * kPerLane;  // head-dim values a stream covers (>= H)
  __shared__ float s_o[kStreams][kRowTile][kWidth];
  __shared__ float s_m[kStreams][kRowTile];
  __shared__ float s_l[kStreams][kRowTile];

  const int64_t rk = blockIdx.x;  // (group x B + row) x K + kv head
  const int split = blockIdx.y;
  const int tile = blockIdx.z;
  const int64_t r = rk / p.kv_heads;
  const int64_t kvh = rk % p.kv_heads;
  const int64_t g = r / p.batch;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = lane / kLanes, sub = lane % kLanes;
  const int stream = warp * kGroups + group;
  const int64_t H = p.head_dim, K = p.kv_heads, N = p.heads;
  const int32_t S = int32_t(p.page_size);  // the launcher checks S x K x H < 2^31
  const int h0 = sub * kPerLane;
  const bool h_ok = h0 < H;  // lanes past H (H not a power of two) carry zeros
  const int64_t rep = N / K;
  const int64_t len = p.lengths[r];
  const KeyRange range = SplitRange(p, len, split);
  // Positions are int32 (lengths are): 64-bit positions and keys cost the registers that made
  // this kernel spill. A row with an empty range never compares them.
  const int32_t pos0 = range.end > range.begin ? int32_t(len - p.q_len) : 0;
  const int32_t window = p.window_left;
  const int64_t live_rows = rows_per_kv - int64_t(tile) * kRowTile;  // rows i < this are real

  const float fold = kSoftcap ? p.softcap * kLog2e : 0.f;
  const float q_scale = kSoftcap ? p.scale / p.softcap : p.scale * kLog2e;
  const T* query = static_cast<const T*>(p.query);
  float q[kRowTile][kPerLane];
  int32_t pos[kRowTile];
#pragma unroll
  for (int i = 0; i < kRowTile; ++i) {
    const bool live = i < live_rows;
    const int64_t rr = int64_t(tile) * kRowTile + i;
    const int64_t t = live ? rr / rep : 0, n = kvh * rep + (live ? rr % rep : 0);
    pos[i] = pos0 + int32_t(t);
    if (live && h_ok) {
      Load8(query + ((r * p.q_len + t) * N + n) * H + h0, q[i]);
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) q[i][e] *= q_scale;
    } else {
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) q[i][e] = 0.f;
    }
  }

  float m[kRowTile], l[kRowTile], o[kRowTile][kPerLane];
#pragma unroll
  for (int i = 0; i < kRowTile; ++i) {
    m[i] = -INFINITY;
    l[i] = 0.f;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) o[i][e] = 0.f;
  }

  // This lane's (kv head, h0) column of slot 0 of page 0; a key adds page x page_stride +
  // slot x token_stride, one 64-bit multiply-add.
  const int64_t page_group = p.page_groups == 1 ? 0 : g;
  const int64_t page_stride = int64_t(S) * K * H;
  const int32_t token_stride = int32_t(K * H);
  const int64_t column = page_group * p.num_pages * page_stride + kvh * H + h0;
  const KV* k_pool = static_cast<const KV*>(p.k_pages) + column;
  const KV* v_pool = static_cast<const KV*>(p.v_pages) + column;
  constexpr bool kScaled = sizeof(KV) == 1;
  // 8-bit cache: scale index = (pool token) x K + kv head, the token's = page x S + slot.
  const int64_t scale_base = page_group * p.num_pages * S * K + kvh;
  const int32_t* table = p.block_table + r * p.max_pages;
  const int32_t num_pages = p.num_pages > INT32_MAX ? INT32_MAX : int32_t(p.num_pages);

  // The loop bound is warp-uniform (the shuffles below need every lane): a warp steps over
  // kGroups x kUnroll keys, its lane groups taking kUnroll consecutive keys each. Offsets
  // from range.begin are unsigned: count < 2^31, so offset + step cannot wrap.
  const uint32_t count = uint32_t(range.end - range.begin);
  for (uint32_t base = uint32_t(warp) * kGroups * kUnroll; base < count;
       base += uint32_t(kStreams) * kUnroll) {
    Raw8<KV> kr[kUnroll], vr[kUnroll];
    float ks[kUnroll], vs[kUnroll];  // 8-bit cache: the key's scales
    bool ok[kUnroll];
    int32_t key[kUnroll];  // meaningful where ok: then < range.end, an int32
    // kUnroll <= 8 <= S consecutive keys cross at most one page boundary: one division for
    // the first key, the others step from it.
    const uint32_t first = base + uint32_t(group) * kUnroll;
    const int32_t key0 = first < count ? range.begin + int32_t(first) : 0;
    const int32_t col0 = key0 / S;
    const int32_t slot0 = key0 - col0 * S;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      ok[u] = first + u < count;
      key[u] = ok[u] ? key0 + u : 0;
      const bool next = slot0 + u >= S;
      const int32_t col = col0 + (next ? 1 : 0);
      const int32_t slot = slot0 + u - (next ? S : 0);
      int64_t at = 0;
      int32_t page = 0;
      if (ok[u]) {
        page = table[col];
        ok[u] = page >= 0 && page < num_pages;
        at = int64_t(page) * page_stride + slot * token_stride;
      }
      kr[u] = ok[u] && h_ok ? LoadRaw(k_pool + at) : ZeroRaw<KV>();
      vr[u] = ok[u] && h_ok ? LoadRaw(v_pool + at) : ZeroRaw<KV>();
      if constexpr (kScaled) {
        const int64_t si = scale_base + (int64_t(page) * S + slot) * K;
        ks[u] = ok[u] ? p.k_scale[si] : 0.f;
        vs[u] = ok[u] ? p.v_scale[si] : 0.f;
      }
    }
    // Row by row: only this row's kUnroll logits are live (a [kUnroll][kRowTile] array of
    // them, with q, o and the raw K/V, was what spilled). The arithmetic, and its order per
    // row, is unchanged.
#pragma unroll
    for (int i = 0; i < kRowTile; ++i) {
      float s[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) dot = fmaf(q[i][e], KvFloat(kr[u].v[e]), dot);
#pragma unroll
        for (int mask = kLanes / 2; mask >= 1; mask /= 2) {
          dot += __shfl_xor_sync(0xffffffffu, dot, mask);
        }
        if constexpr (kScaled) dot *= ks[u];
        const float logit = kSoftcap ? fold * tanhf(dot) : dot;
        // pos - key cannot overflow: a valid key is in [0, len) and pos >= len - 16.
        const int32_t behind = pos[i] - key[u];
        const bool visible =
            ok[u] && i < live_rows && behind >= 0 && (window < 0 || behind <= window);
        s[u] = visible ? logit : -INFINITY;
      }
      float top = m[i];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) top = fmaxf(top, s[u]);
      if (top == -INFINITY) continue;        // nothing visible to this row yet
      const float corr = exp2f(m[i] - top);  // 0 when m[i] is -inf
      l[i] *= corr;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) o[i][e] *= corr;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const float w = exp2f(s[u] - top);  // 0 for a masked key
        l[i] += w;
        const float wv = kScaled ? w * vs[u] : w;
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) o[i][e] = fmaf(wv, KvFloat(vr[u].v[e]), o[i][e]);
      }
      m[i] = top;
    }
  }

  // Merge the streams: each stream's state to shared memory, then every (row, h) output
  // from all of them.
#pragma unroll
  for (int i = 0; i < kRowTile; ++i) {
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) s_o[stream][i][h0 + e] = o[i][e];
    if (sub == 0) {
      s_m[stream][i] = m[i];
      s_l[stream][i] = l[i];
    }
  }
  __syncthreads();
  decode::WriteMergedRows<T>(p, rk, split, rows_per_kv, int64_t(tile) * kRowTile, kRowTile,
                             kStreams, &s_m[0][0], &s_l[0][0], &s_o[0][0][0], kWidth,
                             int64_t(gridDim.x) * p.num_splits);
}

// One block per (group, row, kv head, query row of the kv head): the splits' partial
// outputs weighted by exp2(lse_i - max lse) / sum of the weights. At B 1 there are only
// Tq x N/K blocks (4 for Gemma 3 1b), so the block spreads the splits over its threads:
// the log-sum-exps one split a thread, the partials' float4 columns over H/4 threads and
// the splits over the thread groups, summed across groups through shared memory in a
// fixed order (deterministic). A single thread walking 64 splits measured 11.5 us on the
// H100, as long as the split kernel itself; spread over the block, 3.8 us.
template <typename T>
__global__ void __launch_bounds__(kCombineThreads)
    PagedAttentionCombineKernel(const PagedAttentionParams p, int64_t rows_per_kv) {
  __shared__ float s_w[kMaxCombineSplits];
  __shared__ float s_red[kCombineThreads / 32];  // a value per warp
  __shared__ __align__(16) float s_acc[kCombineThreads * 4];
  // 32-bit index math (grid, rows, heads below 2^31): a 64-bit division is a routine of
  // ~70 instructions, and this kernel's time is its dependent chain.
  const uint32_t bid = blockIdx.x, rows = uint32_t(rows_per_kv);
  const int64_t rk = bid / rows, rr = bid % rows;
  const int64_t r = uint32_t(rk) / uint32_t(p.kv_heads), kvh = uint32_t(rk) % uint32_t(p.kv_heads);
  const int H = int(p.head_dim);
  const int64_t rep = uint32_t(p.heads) / uint32_t(p.kv_heads);
  const int splits = p.num_splits;
  const int64_t n_partials = int64_t(gridDim.x / rows) * splits;
  const float* lse = p.workspace + n_partials * rows_per_kv * H;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  constexpr int kCombineWarps = kCombineThreads / 32;

  // Block-wide max, then sum, of one value a thread (fixed shuffle and warp order).
  auto block_reduce = [&](float v, bool is_max) {
    for (int o = 16; o > 0; o >>= 1) {
      const float other = __shfl_xor_sync(0xffffffffu, v, o);
      v = is_max ? fmaxf(v, other) : v + other;
    }
    if (lane == 0) s_red[warp] = v;
    __syncthreads();
    float out = s_red[0];
    for (int w = 1; w < kCombineWarps; ++w) out = is_max ? fmaxf(out, s_red[w]) : out + s_red[w];
    __syncthreads();  // s_red is reused by the next reduction
    return out;
  };
  float top = -INFINITY;
  for (int sp = tid; sp < splits; sp += kCombineThreads)
    top = fmaxf(top, lse[(rk * splits + sp) * rows_per_kv + rr]);
  top = block_reduce(top, true);
  float part = 0.f;
  for (int sp = tid; sp < splits; sp += kCombineThreads) {
    const float w =
        top == -INFINITY ? 0.f : exp2f(lse[(rk * splits + sp) * rows_per_kv + rr] - top);
    s_w[sp] = w;
    part += w;
  }
  const float total = block_reduce(part, false);  // its barrier also publishes s_w
  const float inv = total > 0.f ? 1.f / total : 0.f;

  // H is a multiple of 8, so a row is H / 4 float4 columns (16-byte aligned).
  const int cols = H / 4, groups = kCombineThreads / cols;
  const int group = tid / cols, col = tid % cols;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (group < groups) {
    const float4* base = reinterpret_cast<const float4*>(p.workspace) + col;
#pragma unroll 4
    for (int sp = group; sp < splits; sp += groups) {
      const float w = s_w[sp];
      // A split that saw nothing has weight 0 and a zero partial: skipping it adds exactly 0.
      if (w == 0.f) continue;
      const float4 v = base[((rk * splits + sp) * rows_per_kv + rr) * cols];
      acc.x = fmaf(w, v.x, acc.x);
      acc.y = fmaf(w, v.y, acc.y);
      acc.z = fmaf(w, v.z, acc.z);
      acc.w = fmaf(w, v.w, acc.w);
    }
  }
  reinterpret_cast<float4*>(s_acc)[tid] = acc;
  __syncthreads();
  const int64_t t = uint32_t(rr) / uint32_t(rep), n = kvh * rep + uint32_t(rr) % uint32_t(rep);
  T* out = static_cast<T*>(p.out) + ((r * p.q_len + t) * p.heads + n) * H;
  for (int h = tid; h < H; h += kCombineThreads) {
    float sum = 0.f;
    for (int g = 0; g < groups; ++g) sum += s_acc[g * H + h];
    out[h] = FromFloat<T>(sum * inv);
  }
}

}  // namespace

namespace {

// The CUDA-core split kernel: a float32 query over a float32 or 8-bit cache.
cudaError_t LaunchCudaCoreSplit(const PagedAttentionParams& p, int64_t rows_per_kv,
                                cudaStream_t stream) {
  if (p.dtype != DType::kF32) return cudaErrorInvalidValue;
  const int64_t tiles = CeilDiv(rows_per_kv, kRowTile);
  if (tiles > 65535) return cudaErrorInvalidConfiguration;
  const dim3 grid(unsigned(p.groups * p.batch * p.kv_heads), unsigned(p.num_splits),
                  unsigned(tiles));
  const int lanes = NextPow2(CeilDiv(p.head_dim, kPerLane));
  constexpr DTypeSet kCaches =
      DTypeBit(DType::kF32) | DTypeBit(DType::kS8) | DTypeBit(DType::kF8E4M3);
  return JAXGPU_DTYPE_SWITCH(p.kv_dtype, KV, kCaches, [&] {
    return JAXGPU_INT_SWITCH(lanes, kLanes, (1, 2, 4, 8, 16, 32), [&] {
      return JAXGPU_BOOL_SWITCH(p.softcap > 0.f, kSoftcap, [&] {
        PagedAttentionSplitKernel<KV, kLanes, kSoftcap>
            <<<grid, kThreads, 0, stream>>>(p, rows_per_kv);
        return cudaGetLastError();
      });
    });
  });
}

}  // namespace

cudaError_t LaunchPagedAttention(const PagedAttentionParams& p, cudaStream_t stream) {
  const int64_t blocks = p.groups * p.batch * p.kv_heads;
  if (blocks == 0 || p.heads == 0) return cudaSuccess;
  const int64_t rows_per_kv = PagedAttentionRowsPerKvHead(p);
  // The split kernels index within a page and a token in int32 (decode_kernels.cu's top).
  if (blocks > INT32_MAX || p.num_splits > kMaxCombineSplits || blocks * rows_per_kv > INT32_MAX ||
      p.page_size * p.kv_heads * p.head_dim > INT32_MAX) {
    return cudaErrorInvalidConfiguration;
  }
  PagedAttentionParams run = p;  // the tensor-core launcher may lower num_splits
  const cudaError_t err = decode::TensorCoreKernelTakes(run)
                              ? decode::LaunchTensorCoreSplit(&run, rows_per_kv, stream)
                              : LaunchCudaCoreSplit(run, rows_per_kv, stream);
  if (err != cudaSuccess || run.num_splits == 1) return err;
  return JAXGPU_DTYPE_SWITCH(run.dtype, T, kFloatDTypes, [&] {
    PagedAttentionCombineKernel<T>
        <<<unsigned(blocks * rows_per_kv), kCombineThreads, 0, stream>>>(run, rows_per_kv);
    return cudaGetLastError();
  });
}

cudaError_t LaunchPagedAttentionWithUpdate(PagedAttentionParams att, const PagedKvUpdateParams& upd,
                                           cudaStream_t stream) {
  if (att.heads > 0 && att.kv_dtype == att.dtype && decode::TensorCoreKernelTakes(att)) {
    att.k_new = upd.k_new;
    att.v_new = upd.v_new;
    att.k_pages_out = upd.k_pages;
    att.v_pages_out = upd.v_pages;
    return LaunchPagedAttention(att, stream);
  }
  const cudaError_t err = LaunchPagedKvUpdate(upd, stream);
  if (err != cudaSuccess) return err;
  return LaunchPagedAttention(att, stream);
}

}  // namespace jaxgpu::cuda
