// Standalone correctness and speed check of paged attention's CUDA kernels
// (ffi/decode/decode_kernels.cu, decode_tc_kernels.cu), with no JAX in the process, so that
// Nsight Compute can profile them (it crashed on JAX programs on the H100 machine):
//
//   nvcc -O3 -std=c++17 -Iffi -DJAXGPU_HAS_SM90A=1 -arch=sm_90a -o /tmp/dc \
//       tools/decode_check.cu ffi/decode/decode_kernels.cu ffi/decode/decode_tc_kernels.cu \
//       ffi/decode/decode_update_kernels.cu
//   /tmp/dc                      # correctness, then the speed table
//   /tmp/dc --case 32,8,128,8,32768,1,int8 --iters 3   # one case (e.g. under ncu)
//   /tmp/dc --case 4,1,256,1,4096,1,bf16,8,511        # at most 8 splits, window 511
//   /tmp/dc --no-time --page-size 24                   # the checks over 24-slot pages
// Built with -DJAXGPU_DEV_KNOBS=1, JAXGPU_DECODE_TMA=-1 runs a 16-bit cache through the
// cp.async ring instead of the copy engine's (on an sm_90a build and device).
//
// Correctness: random pools with each row's pages shuffled, ragged lengths (one row of
// length 0), Tq 1..16, GQA / MQA, H 64..256, bf16 / f16 / int8 / e4m3 caches with per-token
// scales, split counts from 1 to many. The reference computes each output in float64 from
// the stored (rounded) values; an output passes when |out - ref| <= 2 ulp(ref) + 4e-3
// max|v| (the rounding of the output, the 16-bit probabilities of P V). The workspace and
// the output start as 0xff bytes (XLA's workspace is uninitialized: the split counters must
// not depend on it, and every output must be written), and each case also runs from a CUDA
// graph replayed 3 times, its workspace filled with 0xff again each time: the output must be
// bitwise the direct call's (the splits' combine has a fixed order, whichever block ends
// last).
// Speed: the cases of benchmarks/bench_decode.py (bf16 query, page size 16, pages shuffled),
// cudaEvent median of --iters calls; a device-to-device copy gives the copy rate the
// bandwidth is compared with. The B = 1 cases are also timed as 64 calls replayed from
// one CUDA graph (per call: what a decode step inside a compiled loop sees, minus XLA's own
// loop overhead), and over a 16-bit cache also as a decode step's cache write + attention:
// the update kernel then the attention, against paged_attention_with_update's one kernel.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "check_common.h"
#include "decode/decode_cuda.h"
#include "decode/decode_params.h"

using jaxgpu::DType;
using jaxgpu::PagedAttentionParams;

namespace {

using namespace jaxgpu::check;  // NOLINT: the checkers' own helpers

// Slots a page (--page-size; 16 unless given): a multiple of 8.
int g_page_size = 16;
// --pages-in-order: page j of row r is pool page r x pages_per_row + j (a contiguous cache
// in pages), instead of the pool's pages shuffled over all rows; the timings then show what
// the shuffled order's scattered pages cost (DRAM and TLB locality) against the same bytes.
bool g_pages_in_order = false;
constexpr int kTargetBlocks = 4 * 132;  // jaxgpu/ops/decode.py's workspace bound
constexpr int kMinSplitPages = 4;
constexpr int kMaxSplits = 64;

// The split bound jaxgpu/ops/decode.py gives the kernel (its workspace's size).
int NumSplits(int64_t rows, int64_t max_pages) {
  const int64_t want = (kTargetBlocks + rows - 1) / rows;
  const int64_t most = std::max<int64_t>(1, max_pages / kMinSplitPages);
  return int(std::max<int64_t>(1, std::min({want, most, int64_t(kMaxSplits)})));
}

struct Case {
  int n, k, h, b;
  int64_t length;  // of every row unless ragged
  int tq;
  DType q_dtype, kv_dtype;
  bool ragged = false;
  int splits = 0;  // 0: NumSplits
  float softcap = 0.f;
  int window = -1;
};

// The device side of one case: the pools, table, lengths, query, output and workspace.
struct Problem {
  Case c;
  PagedAttentionParams p{};
  int64_t pages = 0, max_pages = 0;
  std::vector<int32_t> table, lengths;
  std::vector<uint16_t> q;
  std::vector<uint8_t> k_raw, v_raw;  // the pools' bytes
  std::vector<float> k_scale, v_scale;
  void* buffers[9] = {};
  size_t workspace_bytes = 0;

  int64_t ValueBytes() const { return jaxgpu::DTypeBytes(c.kv_dtype, 1); }
  double Stored(const std::vector<uint8_t>& raw, const std::vector<float>& scale, int64_t page,
                int64_t slot, int64_t kvh, int64_t i) const {
    const int64_t at = ((page * g_page_size + slot) * c.k + kvh) * c.h + i;
    const int64_t token = (page * g_page_size + slot) * c.k + kvh;
    if (c.kv_dtype == DType::kS8) return double(int8_t(raw[at])) * scale[token];
    if (c.kv_dtype == DType::kF8E4M3) {
      __nv_fp8_e4m3 f;
      std::memcpy(&f, &raw[at], 1);
      return double(float(f)) * scale[token];
    }
    uint16_t u;
    std::memcpy(&u, &raw[2 * at], 2);
    return HalfValue(c.kv_dtype, u);
  }
};

Problem Build(const Case& c, std::mt19937& rng, bool fill_random) {
  Problem pr;
  pr.c = c;
  const int64_t pages_per_row = (c.length + g_page_size - 1) / g_page_size + 1;  // a spare column
  pr.max_pages = pages_per_row;
  pr.pages = c.b * pages_per_row;
  // Each row owns pages_per_row pages of the pool, in a shuffled order; a table entry past
  // the row's length is left valid (the kernel must not read it).
  std::vector<int32_t> ids(pr.pages);
  std::iota(ids.begin(), ids.end(), 0);
  if (!g_pages_in_order) std::shuffle(ids.begin(), ids.end(), rng);
  pr.table = ids;
  pr.lengths.resize(c.b);
  std::uniform_int_distribution<int64_t> ulen(int64_t(c.tq), c.length);
  for (int r = 0; r < c.b; ++r) {
    pr.lengths[r] = int32_t(c.ragged ? (r == 0 ? 0 : ulen(rng)) : c.length);
  }
  const int64_t values = pr.pages * g_page_size * c.k * c.h;
  const int64_t tokens = pr.pages * g_page_size * c.k;
  const bool q8 = c.kv_dtype == DType::kS8 || c.kv_dtype == DType::kF8E4M3;
  pr.k_raw.resize(values * pr.ValueBytes());
  pr.v_raw.resize(values * pr.ValueBytes());
  pr.q.resize(int64_t(c.b) * c.tq * c.n * c.h);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_int_distribution<int> ubyte(0, 255);
  std::uniform_real_distribution<float> uscale(0.005f, 0.02f);
  for (auto& v : pr.q) v = HalfBits(c.q_dtype, normal(rng));
  if (fill_random) {
    for (auto* raw : {&pr.k_raw, &pr.v_raw}) {
      if (q8) {
        for (auto& v : *raw) {
          int b = ubyte(rng);
          if (c.kv_dtype == DType::kS8 && b == 0x80) b = 0;  // int8 stays in [-127, 127]
          if (c.kv_dtype == DType::kF8E4M3 && (b & 0x7f) == 0x7f) b = 0;  // no NaN
          v = uint8_t(b);
        }
      } else {
        for (int64_t i = 0; i < values; ++i) {
          const uint16_t u = HalfBits(c.kv_dtype, normal(rng));
          std::memcpy(&(*raw)[2 * i], &u, 2);
        }
      }
    }
  }
  if (q8) {
    pr.k_scale.resize(tokens);
    pr.v_scale.resize(tokens);
    for (auto& s : pr.k_scale) s = uscale(rng);
    for (auto& s : pr.v_scale) s = uscale(rng);
    if (c.kv_dtype == DType::kF8E4M3) {  // e4m3 values reach 448: scale them like int8's
      for (auto& s : pr.k_scale) s *= 127.f / 448.f;
      for (auto& s : pr.v_scale) s *= 127.f / 448.f;
    }
  }

  PagedAttentionParams& p = pr.p;
  p.dtype = c.q_dtype;
  p.kv_dtype = c.kv_dtype;
  p.groups = 1;
  p.page_groups = 1;
  p.batch = c.b;
  p.q_len = c.tq;
  p.heads = c.n;
  p.kv_heads = c.k;
  p.head_dim = c.h;
  p.num_pages = pr.pages;
  p.page_size = g_page_size;
  p.max_pages = pr.max_pages;
  p.num_splits = c.splits > 0 ? c.splits : NumSplits(int64_t(c.b) * c.k, pr.max_pages);
  p.scale = float(1.0 / std::sqrt(double(c.h)));
  p.softcap = c.softcap;
  p.window_left = c.window;
  const int64_t work = jaxgpu::PagedAttentionWorkspaceSize(p);
  const size_t sizes[9] = {
      pr.q.size() * 2,       pr.k_raw.size(),       pr.v_raw.size(),
      pr.k_scale.size() * 4, pr.v_scale.size() * 4, pr.table.size() * 4,
      pr.lengths.size() * 4, pr.q.size() * 2,       size_t(std::max<int64_t>(work, 1)) * 4};
  for (int i = 0; i < 9; ++i) CK(cudaMalloc(&pr.buffers[i], std::max<size_t>(sizes[i], 4)));
  CK(cudaMemcpy(pr.buffers[0], pr.q.data(), sizes[0], cudaMemcpyHostToDevice));
  if (fill_random) {
    CK(cudaMemcpy(pr.buffers[1], pr.k_raw.data(), sizes[1], cudaMemcpyHostToDevice));
    CK(cudaMemcpy(pr.buffers[2], pr.v_raw.data(), sizes[2], cudaMemcpyHostToDevice));
  } else {  // speed cases: any bytes that decode as modest values
    CK(cudaMemset(pr.buffers[1], 0x11, sizes[1]));
    CK(cudaMemset(pr.buffers[2], 0x22, sizes[2]));
  }
  if (q8) {
    CK(cudaMemcpy(pr.buffers[3], pr.k_scale.data(), sizes[3], cudaMemcpyHostToDevice));
    CK(cudaMemcpy(pr.buffers[4], pr.v_scale.data(), sizes[4], cudaMemcpyHostToDevice));
  }
  CK(cudaMemcpy(pr.buffers[5], pr.table.data(), sizes[5], cudaMemcpyHostToDevice));
  CK(cudaMemcpy(pr.buffers[6], pr.lengths.data(), sizes[6], cudaMemcpyHostToDevice));
  p.query = pr.buffers[0];
  p.k_pages = pr.buffers[1];
  p.v_pages = pr.buffers[2];
  p.k_scale = q8 ? static_cast<const float*>(pr.buffers[3]) : nullptr;
  p.v_scale = q8 ? static_cast<const float*>(pr.buffers[4]) : nullptr;
  p.block_table = static_cast<const int32_t*>(pr.buffers[5]);
  p.lengths = static_cast<const int32_t*>(pr.buffers[6]);
  p.out = pr.buffers[7];
  p.workspace = work > 0 ? static_cast<float*>(pr.buffers[8]) : nullptr;
  pr.workspace_bytes = size_t(work) * 4;
  return pr;
}

void Free(Problem& pr) {
  for (void* b : pr.buffers) CK(cudaFree(b));
}

// One call on `stream` after filling the workspace with 0xff bytes, as XLA may leave it.
void PoisonedCall(const Problem& pr, cudaStream_t stream) {
  if (pr.workspace_bytes > 0) {
    CK(cudaMemsetAsync(pr.p.workspace, 0xff, pr.workspace_bytes, stream));
  }
  CK(jaxgpu::cuda::LaunchPagedAttention(pr.p, stream));
}

// The output of 3 replays of a CUDA graph of one call equals `want` bit for bit.
bool GraphReplaysMatch(const Problem& pr, const std::vector<uint16_t>& want) {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  PoisonedCall(pr, s);
  CK(cudaStreamEndCapture(s, &graph));
  CK(cudaGraphInstantiate(&exec, graph, 0));
  CK(cudaMemset(pr.p.out, 0xff, want.size() * 2));
  for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(exec, s));
  CK(cudaStreamSynchronize(s));
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  CK(cudaStreamDestroy(s));
  std::vector<uint16_t> got(want.size());
  CK(cudaMemcpy(got.data(), pr.p.out, got.size() * 2, cudaMemcpyDeviceToHost));
  return got == want;
}

// Returns the worst |out - ref| / allowed over the case (<= 1 passes); *reproducible: the
// graph replays gave the same bits.
double Check(Problem& pr, bool* reproducible) {
  const Case& c = pr.c;
  CK(cudaMemset(pr.p.out, 0xff, pr.q.size() * 2));
  PoisonedCall(pr, nullptr);
  CK(cudaDeviceSynchronize());
  std::vector<uint16_t> out(pr.q.size());
  CK(cudaMemcpy(out.data(), pr.p.out, out.size() * 2, cudaMemcpyDeviceToHost));
  *reproducible = GraphReplaysMatch(pr, out);
  const int rep = c.n / c.k;
  double worst = 0;
  std::vector<double> logits, acc(c.h);
  for (int r = 0; r < c.b; ++r) {
    const int64_t len = pr.lengths[r];
    for (int t = 0; t < c.tq; ++t) {
      const int64_t pos = len - c.tq + t;
      for (int n = 0; n < c.n; ++n) {
        const int kvh = n / rep;
        const uint16_t* qv = &pr.q[((int64_t(r) * c.tq + t) * c.n + n) * c.h];
        const int64_t lo = c.window >= 0 ? std::max<int64_t>(0, pos - c.window) : 0;
        logits.clear();
        double top = -INFINITY, vmax = 0;
        for (int64_t j = lo; j <= pos && len > 0; ++j) {
          const int64_t page = pr.table[r * pr.max_pages + j / g_page_size], slot = j % g_page_size;
          double dot = 0;
          for (int i = 0; i < c.h; ++i) {
            dot +=
                HalfValue(c.q_dtype, qv[i]) * pr.Stored(pr.k_raw, pr.k_scale, page, slot, kvh, i);
          }
          double x = dot * pr.p.scale;
          if (c.softcap > 0) x = c.softcap * std::tanh(x / c.softcap);
          logits.push_back(x);
          top = std::max(top, x);
        }
        std::fill(acc.begin(), acc.end(), 0.0);
        double sum = 0;
        for (size_t idx = 0; idx < logits.size(); ++idx) {
          const int64_t j = lo + int64_t(idx);
          const int64_t page = pr.table[r * pr.max_pages + j / g_page_size], slot = j % g_page_size;
          const double w = std::exp(logits[idx] - top);
          sum += w;
          for (int i = 0; i < c.h; ++i) {
            const double v = pr.Stored(pr.v_raw, pr.v_scale, page, slot, kvh, i);
            acc[i] += w * v;
            vmax = std::max(vmax, std::fabs(v));
          }
        }
        const uint16_t* ov = &out[((int64_t(r) * c.tq + t) * c.n + n) * c.h];
        for (int i = 0; i < c.h; ++i) {
          const double ref = sum > 0 ? acc[i] / sum : 0.0;
          const double allowed = 2 * Ulp(c.q_dtype, ref) + 4e-3 * vmax + 1e-30;
          const double ratio = std::fabs(HalfValue(c.q_dtype, ov[i]) - ref) / allowed;
          worst = std::isnan(ratio) ? INFINITY : std::max(worst, ratio);  // NaN: not written
        }
      }
    }
  }
  return worst;
}

const char* CacheName(DType t) {
  switch (t) {
    case DType::kS8: return "int8";
    case DType::kF8E4M3: return "e4m3";
    case DType::kF16: return "f16";
    default: return "bf16";
  }
}

int RunChecks() {
  std::mt19937 rng(20261126);
  struct Shape {
    int n, k, h, b;
    int64_t length;
    int tq;
  };
  // The last two: H 256 over splits of 32 tiles or more (one split: 65 and 35 tiles), the
  // copy engine's ring at H 256 (4 head-dim slices; 2 with Tq 8's two m-tiles).
  const Shape shapes[] = {
      {32, 8, 128, 3, 700, 1}, {32, 8, 128, 3, 700, 8},  {8, 1, 128, 2, 513, 8},
      {8, 1, 64, 3, 300, 16},  {16, 8, 256, 2, 900, 1},  {32, 8, 256, 2, 400, 8},
      {4, 4, 96, 3, 257, 3},   {16, 2, 128, 1, 4100, 1}, {16, 2, 128, 1, 4100, 5},
      {8, 8, 40, 2, 130, 2},   {8, 1, 256, 2, 300, 8},   {4, 1, 256, 2, 333, 5},
      {4, 1, 256, 1, 4100, 1}, {16, 2, 256, 1, 2200, 8}};
  const DType caches[] = {DType::kBF16, DType::kS8, DType::kF8E4M3};
  int failed = 0, cases = 0;
  for (const Shape& s : shapes) {
    for (DType kv : caches) {
      for (int splits : {1, 0, 7}) {
        Case c{s.n, s.k, s.h, s.b, s.length, s.tq, DType::kBF16, kv, true, splits};
        if (kv == DType::kBF16 && splits == 7) c.q_dtype = c.kv_dtype = DType::kF16;
        if (splits == 7 && s.h >= 128) c.softcap = 20.f, c.window = 200;
        Problem pr = Build(c, rng, true);
        bool reproducible = false;
        const double worst = Check(pr, &reproducible);
        Free(pr);
        ++cases;
        const bool ok = worst <= 1.0 && reproducible;
        failed += ok ? 0 : 1;
        if (!ok) {
          std::printf("FAIL %d/%d h%d b%d l%lld q%d %s splits %d: worst %.3g of the allowance%s\n",
                      c.n, c.k, c.h, c.b, (long long)c.length, c.tq, CacheName(kv), splits, worst,
                      reproducible ? "" : ", graph replays differ from the direct call");
        }
      }
    }
  }
  std::printf("checks: %d cases, %d failed\n", cases, failed);
  return failed;
}

double CopyRate() {
  const size_t bytes = size_t(1) << 30;
  void *a, *b;
  CK(cudaMalloc(&a, bytes));
  CK(cudaMalloc(&b, bytes));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int i = 0; i < 10; ++i) {
    CK(cudaEventRecord(e0));
    CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float t;
    CK(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  CK(cudaFree(a));
  CK(cudaFree(b));
  return 2.0 * bytes / (ms[ms.size() / 2] * 1e-3);  // read + written
}

double MedianUs(std::vector<float>& ms) {
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2] * 1e3;
}

// Microseconds a call of `launch` (on a stream) replayed 64 times from one CUDA graph.
template <typename Launch>
double GraphUs(Launch launch) {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < 64; ++i) CK(launch(s));
  CK(cudaStreamEndCapture(s, &graph));
  CK(cudaGraphInstantiate(&exec, graph, 0));
  const double us = GraphUsPerCall(exec, s, 64, 10);
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  CK(cudaStreamDestroy(s));
  return us;
}

// The fused call against the update then the attention, bit for bit: the output and both
// pools, each run from the same starting pools. The new tokens' bytes (0x33 / 0x44) differ
// from the pools' (0x11 / 0x22), so a skipped or misplaced write shows.
bool FusedMatchesTwoCalls(const Problem& pr, const jaxgpu::PagedKvUpdateParams& u) {
  const PagedAttentionParams& a = pr.p;
  const size_t pool_bytes = pr.k_raw.size(), out_bytes = pr.q.size() * 2;
  auto run = [&](bool fused, std::vector<uint8_t>* out, std::vector<uint8_t>* k,
                 std::vector<uint8_t>* v) {
    CK(cudaMemset(pr.buffers[1], 0x11, pool_bytes));
    CK(cudaMemset(pr.buffers[2], 0x22, pool_bytes));
    CK(cudaMemset(a.out, 0xff, out_bytes));
    if (fused) {
      CK(jaxgpu::cuda::LaunchPagedAttentionWithUpdate(a, u, nullptr));
    } else {
      CK(jaxgpu::cuda::LaunchPagedKvUpdate(u, nullptr));
      CK(jaxgpu::cuda::LaunchPagedAttention(a, nullptr));
    }
    out->resize(out_bytes), k->resize(pool_bytes), v->resize(pool_bytes);
    CK(cudaMemcpy(out->data(), a.out, out_bytes, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(k->data(), pr.buffers[1], pool_bytes, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(v->data(), pr.buffers[2], pool_bytes, cudaMemcpyDeviceToHost));
  };
  std::vector<uint8_t> out2, k2, v2, out1, k1, v1;
  run(false, &out2, &k2, &v2);
  run(true, &out1, &k1, &v1);
  const bool written = std::count(k2.begin(), k2.end(), uint8_t(0x33)) > 0;
  const bool same = out1 == out2 && k1 == k2 && v1 == v2;
  if (!written || !same) {
    std::printf("FAIL with update: %s\n",
                !written ? "no new token written" : "differs from update + attention");
  }
  return written && same;
}

// A decode step's cache write and attention (16-bit cache), us a call from a graph: the
// update kernel then the attention (two launches), and paged_attention_with_update's split
// kernel writing the Tq new tokens itself. Returns false when the two differ (above).
bool TimeWithUpdate(const Problem& pr, double* two_us, double* fused_us) {
  const Case& c = pr.c;
  const size_t bytes = size_t(c.b) * c.tq * c.k * c.h * 2;
  void* k_new;
  void* v_new;
  CK(cudaMalloc(&k_new, bytes));
  CK(cudaMalloc(&v_new, bytes));
  CK(cudaMemset(k_new, 0x33, bytes));
  CK(cudaMemset(v_new, 0x44, bytes));
  const PagedAttentionParams& a = pr.p;
  const jaxgpu::PagedKvUpdateParams u =
      jaxgpu::QueryTokensUpdate(a, pr.buffers[1], pr.buffers[2], k_new, v_new);
  const bool same = FusedMatchesTwoCalls(pr, u);
  *two_us = GraphUs([&](cudaStream_t s) {
    const cudaError_t err = jaxgpu::cuda::LaunchPagedKvUpdate(u, s);
    return err != cudaSuccess ? err : jaxgpu::cuda::LaunchPagedAttention(a, s);
  });
  *fused_us = GraphUs(
      [&](cudaStream_t s) { return jaxgpu::cuda::LaunchPagedAttentionWithUpdate(a, u, s); });
  CK(cudaFree(k_new));
  CK(cudaFree(v_new));
  return same;
}

// Returns 1 when the fused call's bitwise check fails, else 0.
int TimeCase(const Case& c, int iters, double copy) {
  std::mt19937 rng(1);
  Problem pr = Build(c, rng, false);
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(jaxgpu::cuda::LaunchPagedAttention(pr.p, nullptr));  // warm-up
  std::vector<float> ms;
  for (int i = 0; i < iters; ++i) {
    CK(cudaEventRecord(e0));
    CK(jaxgpu::cuda::LaunchPagedAttention(pr.p, nullptr));
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float t;
    CK(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t);
  }
  const double us = MedianUs(ms);
  const bool q8 = c.kv_dtype == DType::kS8 || c.kv_dtype == DType::kF8E4M3;
  const int64_t keys = c.window >= 0 ? std::min<int64_t>(c.length, c.window + c.tq) : c.length;
  const double kv = double(c.b) * keys * c.k * (q8 ? c.h + 4 : 2 * c.h) * 2;
  const double bytes = kv + 2.0 * c.b * c.tq * c.n * c.h * 2;
  double graph_us = 0, two_us = 0, fused_us = 0;
  bool fused_ok = true;
  if (c.b == 1) {  // 64 calls replayed from a graph: the per-call cost without dispatch
    graph_us = GraphUs([&](cudaStream_t s) { return jaxgpu::cuda::LaunchPagedAttention(pr.p, s); });
    if (c.kv_dtype == c.q_dtype) fused_ok = TimeWithUpdate(pr, &two_us, &fused_us);
  }
  std::printf("%2d/%d h%3d b%2d l%4lldk q%2d %-4s | %9.1f us  %5.2f TB/s  %5.1f%% copy", c.n, c.k,
              c.h, c.b, (long long)(c.length / 1024), c.tq, CacheName(c.kv_dtype), us,
              bytes / us * 1e-6, 100.0 * bytes / (us * 1e-6) / copy);
  if (graph_us > 0) std::printf(" | graph %.1f us/call", graph_us);
  if (fused_us > 0) std::printf(", + update %.1f, with update %.1f", two_us, fused_us);
  if (c.window >= 0) std::printf(" (window %d)", c.window);
  std::printf("\n");
  Free(pr);
  return fused_ok ? 0 : 1;
}

Case ParseCase(const std::string& s) {
  Case c{};
  char cache[16] = "bf16";
  long long length = 0;
  if (std::sscanf(s.c_str(), "%d,%d,%d,%d,%lld,%d,%15[^,],%d,%d", &c.n, &c.k, &c.h, &c.b, &length,
                  &c.tq, cache, &c.splits, &c.window) < 6) {
    std::printf("--case N,K,H,B,L,Tq[,bf16|int8|e4m3[,max splits (0: default)[,window]]]\n");
    std::exit(2);
  }
  c.length = length;
  c.q_dtype = DType::kBF16;
  const std::string name(cache);
  c.kv_dtype = name == "int8" ? DType::kS8 : name == "e4m3" ? DType::kF8E4M3 : DType::kBF16;
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  bool check = true, time = true;
  int iters = 20;
  std::vector<Case> cases;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--no-check")
      check = false;
    else if (a == "--no-time")
      time = false;
    else if (a == "--page-size" && i + 1 < argc)
      g_page_size = std::atoi(argv[++i]);
    else if (a == "--pages-in-order")
      g_pages_in_order = true;
    else if (a == "--iters" && i + 1 < argc)
      iters = std::atoi(argv[++i]);
    else if (a == "--case" && i + 1 < argc)
      cases.push_back(ParseCase(argv[++i])), check = false;
    else {
      std::printf(
          "usage: %s [--no-check] [--no-time] [--page-size S] [--pages-in-order] [--iters N] [--case N,K,H,B,L,Tq,cache,splits,window]\n",
          argv[0]);
      return 2;
    }
  }
  int failed = check ? RunChecks() : 0;
  if (time) {
    const double copy = CopyRate();
    std::printf("device copy: %.2f TB/s (read + written)\n", copy * 1e-12);
    if (cases.empty()) {
      const DType bf = DType::kBF16, s8 = DType::kS8, e4 = DType::kF8E4M3;
      const int64_t k4 = 4096, k32 = 32768, k128 = 131072;
      cases = {{32, 8, 128, 8, k32, 1, bf, bf},
               {32, 8, 128, 64, k32, 1, bf, bf},
               {32, 8, 128, 8, k128, 1, bf, bf},
               {32, 8, 128, 8, k32, 8, bf, bf},
               {32, 8, 128, 64, k32, 8, bf, bf},
               {32, 8, 128, 8, k32, 1, bf, s8},
               {32, 8, 128, 8, k32, 1, bf, e4},
               {32, 8, 128, 64, k32, 1, bf, s8},
               {32, 8, 128, 8, k32, 8, bf, s8},
               {32, 8, 256, 8, k32, 1, bf, bf},
               {32, 8, 256, 8, k32, 8, bf, bf},
               {32, 8, 256, 8, k32, 1, bf, s8},
               {32, 8, 256, 8, k32, 8, bf, s8},
               {8, 1, 128, 64, k32, 1, bf, bf},
               {8, 1, 128, 64, k32, 8, bf, bf},
               {32, 8, 128, 1, k4, 1, bf, bf},
               {32, 8, 128, 1, k4, 8, bf, bf},
               {8, 1, 128, 1, k4, 1, bf, bf},
               {32, 8, 128, 1, k32, 1, bf, bf},
               // Gemma 3 1b's decode step: 4/1 H 256, a global and a local (window 512) layer
               {4, 1, 256, 1, k4, 1, bf, bf},
               {4, 1, 256, 1, k4, 1, bf, bf, false, 0, 0.f, 511}};
    }
    for (const Case& c : cases) failed += TimeCase(c, iters, copy);
  }
  return failed == 0 ? 0 : 1;
}
