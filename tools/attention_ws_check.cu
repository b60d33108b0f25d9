// Standalone check of the warp-specialized attention forward (ffi/attention/sm90/
// fwd_ws_sm90.cu) on an H100: float64 host reference for odd shapes and every option the
// kernel takes, then its speed at the issue's shapes. No JAX needed, and a hang (a barrier
// phase gone wrong) ends the program with a message instead of blocking the machine:
//
//   nvcc -O3 -std=c++17 -Iffi -Itools -DJAXGPU_HAS_SM90A=1 [-DJAXGPU_DEV_KNOBS=1] \
//       "--generate-code=arch=compute_90a,code=[sm_90a]" -o /tmp/awc \
//       tools/attention_ws_check.cu ffi/attention/sm90/fwd_ws_sm90.cu && /tmp/awc [--no-time]
//       [--ping-pong] [--persistent | --no-persistent | --dynamic] [--group-heads N]
//       [--time-options]
//
// Without a flag each call runs the default schedule (DefaultWsFwdSchedule); the flags force
// one, and need -DJAXGPU_DEV_KNOBS=1 (which compiles every schedule: 6x the compile time).
// --dynamic: the persistent grid drawing tiles from a counter (--group-heads: its order's
// heads a group instead of DynamicGroupHeads's).
//
// With a persistent schedule (forced or default) each case runs twice: on the full grid, and
// on 3 CTAs (WsFwdSchedule::max_ctas), which gives each CTA several tiles (the cases have
// fewer tiles than the H100 has SMs): rings and barrier phases going on across tiles, tiles
// with empty walks, and in the dynamic schedule real draws from the counter. The dynamic
// schedule's counter is zeroed once: every launch must leave it 0 again (checked), or the
// next one would skip tiles (NaN outputs). Its timings zero it before each launch
// (cudaMemsetAsync, inside the timed span), as an XLA workspace will need.
//
// A case passes when every output is within 2e-2 of the reference (outputs are convex
// combinations of V rows in [-1, 1]: the bf16 rounding of P and O) and every lse within 1e-3.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attention/attention_params.h"
#include "attention_check_common.h"
#include "attention/sm90/fwd_ws_sm90.h"
#include "check_common.h"

using jaxgpu::AttentionParams;
using jaxgpu::DType;
using namespace jaxgpu::check;  // NOLINT: the checkers' own helpers

namespace {

bool g_ping_pong = false;  // --ping-pong
int g_persistent = 0;      // --persistent: 1, --no-persistent: -1, else the default
bool g_dynamic = false;    // --dynamic
int g_group_heads = 0;     // --group-heads N
int* g_counter = nullptr;  // the dynamic schedule's workspace (kWsFwdWorkspaceBytes)

struct Case : jaxgpu::check::AttentionCase {
  int segment = 0;  // > 0: segment ids in runs of about this many positions

  std::string Name() const {
    return ShapeName() + " " + DTypeName() +
           (segment > 0 ? " segments~" + std::to_string(segment) : std::string());
  }
};

// Waits for the stream at most `seconds`; a kernel still running then is taken for a hang.
void SyncOrDie(cudaStream_t stream, double seconds, const std::string& what) {
  const auto start = std::chrono::steady_clock::now();
  while (true) {
    const cudaError_t e = cudaStreamQuery(stream);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) {
      std::printf("FAIL %s: %s\n", what.c_str(), cudaGetErrorString(e));
      std::exit(1);
    }
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (waited > seconds) {
      std::printf("HANG %s: still running after %.0f s\n", what.c_str(), seconds);
      std::fflush(stdout);
      std::_Exit(2);
    }
  }
}

struct Device {
  void *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr;
  float* lse = nullptr;
  int32_t *q_seg = nullptr, *kv_seg = nullptr;
  ~Device() {
    cudaFree(q_seg);
    cudaFree(kv_seg);
    cudaFree(q);
    cudaFree(k);
    cudaFree(v);
    cudaFree(o);
    cudaFree(lse);
  }
};

AttentionParams Params(const Case& c, const Device& d) {
  AttentionParams p = c.ShapeParams();
  p.q = d.q;
  p.k = d.k;
  p.v = d.v;
  p.o = d.o;
  p.lse = d.lse;
  p.q_segment_ids = d.q_seg;
  p.kv_segment_ids = d.kv_seg;
  return p;
}

// Segment ids of `batch` rows of `len` positions: non-decreasing runs whose lengths are
// uniform in [1, 2 * segment) (the packed-sequence layout), the same for q and kv of a
// self-attention case from the same seed.
std::vector<int32_t> SegmentIds(int64_t batch, int64_t len, int segment, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> run(1, 2 * segment - 1);
  std::vector<int32_t> ids(batch * len);
  for (int64_t b = 0; b < batch; ++b) {
    int id = 0, left = run(rng);
    for (int64_t i = 0; i < len; ++i) {
      if (left-- == 0) {
        ++id;
        left = run(rng) - 1;
      }
      ids[b * len + i] = id;
    }
  }
  return ids;
}

jaxgpu::cuda::attention::sm90::WsFwdSchedule Schedule(const AttentionParams& p) {
  auto s = jaxgpu::cuda::attention::sm90::DefaultWsFwdSchedule(p);
  s.ping_pong = g_ping_pong;
  if (g_persistent != 0) s.persistent = g_persistent == 1;
  if (g_dynamic) s.persistent = s.dynamic = true;
  s.group_heads = g_group_heads;
  return s;
}

// q, k, v, o and lse of the case's shapes (uninitialized).
void Allocate(const Case& c, Device* d) {
  const int64_t nq = c.b * c.t * c.k * c.r * c.h, nkv = c.b * c.s * c.k * c.h;
  CK(cudaMalloc(&d->q, nq * 2));
  CK(cudaMalloc(&d->k, nkv * 2));
  CK(cudaMalloc(&d->v, nkv * 2));
  CK(cudaMalloc(&d->o, nq * 2));
  CK(cudaMalloc(&d->lse, c.b * c.k * c.r * c.t * sizeof(float)));
}

cudaError_t Launch(const AttentionParams& p,
                   const jaxgpu::cuda::attention::sm90::WsFwdSchedule& s) {
  return jaxgpu::cuda::attention::sm90::LaunchFwdWarpSpecialized(p, s, nullptr, g_counter);
}

bool Check(const Case& c, std::mt19937& rng) {
  const int64_t n = c.k * c.r;
  const int64_t nq = c.b * c.t * n * c.h, nkv = c.b * c.s * c.k * c.h;
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<uint16_t> q(nq), k(nkv), v(nkv);
  for (auto& x : q) x = HalfBits(c.dtype, u(rng));
  for (auto& x : k) x = HalfBits(c.dtype, u(rng));
  for (auto& x : v) x = HalfBits(c.dtype, u(rng));
  Device d;
  Allocate(c, &d);
  CK(cudaMemcpy(d.q, q.data(), nq * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d.k, k.data(), nkv * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d.v, v.data(), nkv * 2, cudaMemcpyHostToDevice));
  std::vector<int32_t> q_seg, kv_seg;
  if (c.segment > 0) {
    q_seg = SegmentIds(c.b, c.t, c.segment, 7);
    kv_seg = SegmentIds(c.b, c.s, c.segment, c.t == c.s ? 7 : 8);
    CK(cudaMalloc(&d.q_seg, q_seg.size() * 4));
    CK(cudaMalloc(&d.kv_seg, kv_seg.size() * 4));
    CK(cudaMemcpy(d.q_seg, q_seg.data(), q_seg.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d.kv_seg, kv_seg.data(), kv_seg.size() * 4, cudaMemcpyHostToDevice));
  }
  const AttentionParams p = Params(c, d);
  if (const char* why = jaxgpu::cuda::attention::sm90::WarpSpecializedFwdUnavailable(p)) {
    std::printf("SKIP %s: %s\n", c.Name().c_str(), why);
    return true;
  }

  // The float64 reference: q (B, T, K, R, H), k / v (B, S, K, H), lse (B, K, R, T); NaN lse
  // where a row sees no key (its output is 0, its lse not compared).
  std::vector<double> ref_o(nq), ref_lse(c.b * n * c.t);
  std::vector<double> logit(c.s);
  for (int64_t b = 0; b < c.b; ++b) {
    for (int64_t kh = 0; kh < c.k; ++kh) {
      for (int64_t r = 0; r < c.r; ++r) {
        for (int64_t i = 0; i < c.t; ++i) {
          int64_t lo = 0, hi = c.s - 1;
          if (c.causal) hi = std::min(hi, i);
          if (c.left >= 0) lo = std::max(lo, i - c.left);
          if (c.right >= 0) hi = std::min(hi, i + c.right);
          const int64_t qrow = ((b * c.t + i) * n + kh * c.r + r) * c.h;
          auto visible = [&](int64_t j) {
            return c.segment == 0 || q_seg[b * c.t + i] == kv_seg[b * c.s + j];
          };
          double mx = -INFINITY;
          bool any = false;
          for (int64_t j = lo; j <= hi; ++j) {
            if (!visible(j)) continue;
            any = true;
            const int64_t krow = ((b * c.s + j) * c.k + kh) * c.h;
            double dot = 0;
            for (int64_t x = 0; x < c.h; ++x) {
              dot += HalfValue(c.dtype, q[qrow + x]) * HalfValue(c.dtype, k[krow + x]);
            }
            double l = dot * p.scale;
            if (c.softcap > 0) l = c.softcap * std::tanh(l / c.softcap);
            logit[j] = l;
            mx = std::max(mx, l);
          }
          double sum = 0;
          for (int64_t j = lo; j <= hi; ++j) {
            if (visible(j)) sum += std::exp(logit[j] - mx);
          }
          ref_lse[((b * c.k + kh) * c.r + r) * c.t + i] = any ? mx + std::log(sum) : NAN;
          for (int64_t x = 0; x < c.h; ++x) {
            double acc = 0;
            for (int64_t j = lo; j <= hi; ++j) {
              if (!visible(j)) continue;
              acc += std::exp(logit[j] - mx) *
                     HalfValue(c.dtype, v[((b * c.s + j) * c.k + kh) * c.h + x]);
            }
            ref_o[qrow + x] = any ? acc / sum : 0.0;
          }
        }
      }
    }
  }

  // One run of the kernel on `s`'s grid, compared with the reference.
  auto run = [&](const jaxgpu::cuda::attention::sm90::WsFwdSchedule& s, const char* grid) {
    const std::string name = c.Name() + grid;
    CK(cudaMemset(d.o, 0xff, nq * 2));  // NaN where the kernel writes nothing
    CK(Launch(p, s));
    SyncOrDie(nullptr, 20.0, name);
    std::vector<uint16_t> o(nq);
    std::vector<float> lse(c.b * n * c.t);
    CK(cudaMemcpy(o.data(), d.o, nq * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(lse.data(), d.lse, lse.size() * sizeof(float), cudaMemcpyDeviceToHost));
    double worst_o = 0, worst_lse = 0;
    for (int64_t i = 0; i < nq; ++i) {
      const double got = HalfValue(c.dtype, o[i]);
      worst_o = std::max(worst_o, std::isnan(got) ? INFINITY : std::fabs(got - ref_o[i]));
    }
    for (size_t i = 0; i < lse.size(); ++i) {
      if (!std::isnan(ref_lse[i])) worst_lse = std::max(worst_lse, std::fabs(lse[i] - ref_lse[i]));
    }
    int counter = 0;
    if (s.dynamic) CK(cudaMemcpy(&counter, g_counter, sizeof(int), cudaMemcpyDeviceToHost));
    const bool ok = worst_o <= 2e-2 && worst_lse <= 1e-3 && counter == 0;
    std::printf("%s %s: max |o - ref| %.2e, max |lse - ref| %.2e", ok ? "ok  " : "FAIL",
                name.c_str(), worst_o, worst_lse);
    if (counter != 0) std::printf(", tile counter left at %d", counter);
    std::printf("\n");
    return ok;
  };
  const auto s = Schedule(p);
  bool ok = run(s, "");
  if (s.persistent || s.dynamic) {
    auto few = s;
    few.max_ctas = 3;
    ok = run(few, " [3 CTAs]") && ok;
  }
  return ok;
}

// Median time of `reps` launches and the TFLOP/s of 4 B N T S H (half under the causal mask).
void Time(const Case& c) {
  const int64_t n = c.k * c.r;
  const int64_t nq = c.b * c.t * n * c.h, nkv = c.b * c.s * c.k * c.h;
  Device d;
  Allocate(c, &d);
  CK(cudaMemset(d.q, 0x3c, nq * 2));
  CK(cudaMemset(d.k, 0x3c, nkv * 2));
  CK(cudaMemset(d.v, 0x3c, nkv * 2));
  if (c.segment > 0) {  // one segment: ids all 0
    CK(cudaMalloc(&d.q_seg, c.b * c.t * 4));
    CK(cudaMalloc(&d.kv_seg, c.b * c.s * 4));
    CK(cudaMemset(d.q_seg, 0, c.b * c.t * 4));
    CK(cudaMemset(d.kv_seg, 0, c.b * c.s * 4));
  }
  const AttentionParams p = Params(c, d);
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> ms;
  const auto schedule = Schedule(p);
  for (int rep = 0; rep < 23; ++rep) {
    CK(cudaEventRecord(e0));
    if (schedule.dynamic) CK(cudaMemsetAsync(g_counter, 0, sizeof(int), nullptr));
    CK(Launch(p, schedule));
    CK(cudaEventRecord(e1));
    SyncOrDie(nullptr, 20.0, c.Name());
    float t = 0;
    CK(cudaEventElapsedTime(&t, e0, e1));
    if (rep >= 3) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  const double t = ms[ms.size() / 2] * 1e-3;
  const double flops = 4.0 * c.b * n * c.t * c.s * c.h * (c.causal ? 0.5 : 1.0);
  std::printf("time %s: %.1f us, %.0f TFLOP/s", c.Name().c_str(), t * 1e6, flops / t * 1e-12);
  if (schedule.dynamic) {  // the order's heads a group (a causal call's; otherwise 1)
    std::printf(", %d heads a group", g_group_heads > 0
                                          ? g_group_heads
                                          : jaxgpu::cuda::attention::sm90::DynamicGroupHeads(p));
  }
  std::printf("\n");
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
}

}  // namespace

// The options case of benchmarks/bench_attention.py (B4 T4096 N16 H128, not causal) taken
// apart: each option alone and all three, none of them masking anything (the window spans
// the sequence, the segment ids are one segment), so each costs only its own work; three
// interleaved rounds.
void TimeOptions() {
  const Case plain{4, 4096, 4096, 16, 1, 128};
  Case softcap = plain, window = plain, segments = plain, all = plain;
  softcap.softcap = 30.f;
  window.left = window.right = 4096;
  segments.segment = 100000;
  all.softcap = 30.f;
  all.left = all.right = 4096;
  all.segment = 100000;
  for (int round = 0; round < 3; ++round) {
    for (const Case& c : {plain, softcap, window, segments, all}) Time(c);
  }
}

int main(int argc, char** argv) {
  bool time = true, time_options = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--no-time") == 0) time = false;
    if (std::strcmp(argv[i], "--time-options") == 0) time_options = true;
    if (std::strcmp(argv[i], "--ping-pong") == 0) g_ping_pong = true;
    if (std::strcmp(argv[i], "--persistent") == 0) g_persistent = 1;
    if (std::strcmp(argv[i], "--no-persistent") == 0) g_persistent = -1;
    if (std::strcmp(argv[i], "--dynamic") == 0) g_dynamic = true;
    if (std::strcmp(argv[i], "--group-heads") == 0 && i + 1 < argc) {
      g_group_heads = std::atoi(argv[++i]);
    }
  }
  std::printf("warp-specialized forward%s%s\n", g_ping_pong ? ", ping-pong" : "",
              g_dynamic            ? ", dynamic persistent"
              : g_persistent == 1  ? ", persistent"
              : g_persistent == -1 ? ", not persistent"
                                   : ", default schedule");
  if (g_group_heads > 0) std::printf("heads a group: %d\n", g_group_heads);
  CK(cudaMalloc(&g_counter, jaxgpu::cuda::attention::sm90::kWsFwdWorkspaceBytes));
  CK(cudaMemset(g_counter, 0, jaxgpu::cuda::attention::sm90::kWsFwdWorkspaceBytes));
  if (time_options) {  // timings only
    TimeOptions();
    return 0;
  }
  std::mt19937 rng(20261127);
  int failed = 0, total = 0;
  std::vector<Case> cases = {
      {1, 128, 128, 1, 1, 128},
      {2, 333, 333, 2, 2, 128},
      {2, 333, 333, 2, 2, 128, true},
      {1, 777, 777, 1, 4, 64, true},
      {1, 500, 500, 2, 1, 96},
      {1, 600, 600, 1, 2, 128, false, 200, 0, 30.f},
      {1, 600, 600, 1, 2, 128, true, 130, -1, 0.f, DType::kF16},
      {1, 300, 700, 2, 2, 64},
      {1, 1, 300, 1, 8, 128},
      {1, 300, 300, 2, 2, 256, true},
      {1, 200, 200, 1, 2, 160, false, -1, -1, 30.f},
      {1, 200, 200, 1, 2, 128, false, -1, -1, 30.f, DType::kF16},  // softcap, not bounded
      {2, 555, 555, 2, 2, 128, false, -1, -1, 0.f, DType::kBF16, 40},
      {2, 555, 555, 1, 2, 128, true, -1, -1, 0.f, DType::kBF16, 150},
      {1, 700, 700, 2, 1, 64, true, 200, -1, 30.f, DType::kBF16, 90},
      {1, 300, 500, 1, 2, 256, false, -1, -1, 0.f, DType::kBF16, 60},
      {1, 640, 640, 1, 2, 128, false, -1, -1, 0.f, DType::kBF16, 1000},  // one segment
  };
  for (const Case& c : cases) {
    ++total;
    if (!Check(c, rng)) ++failed;
  }
  std::printf("checks: %d cases, %d failed\n", total, failed);
  if (time) {
    // B * T = 16k, N = 16 (docs/perf/attention.md's shapes), H 128 and 64.
    Time({4, 4096, 4096, 16, 1, 128});
    Time({4, 4096, 4096, 16, 1, 128, true});
    Time({1, 16384, 16384, 16, 1, 128});
    Time({1, 16384, 16384, 16, 1, 128, true});
    Time({16, 1024, 1024, 16, 1, 64, true});
    Time({4, 4096, 4096, 8, 4, 128, true});  // GQA 32/8
    Time({4, 4096, 4096, 16, 1, 256});
    Time({4, 4096, 4096, 16, 1, 256, true});
    // Where cuDNN still leads (docs/perf/attention.md section 12.1): H 64 at N 32, causal
    // T 1k at H 128.
    Time({4, 4096, 4096, 32, 1, 64});
    Time({4, 4096, 4096, 32, 1, 64, true});
    Time({16, 1024, 1024, 16, 1, 128, true});
    // The options case: softcap + window + segment ids (one segment per row: nothing masked
    // by them, the cost of deciding so).
    Time({4, 4096, 4096, 16, 1, 128, true, 1024, -1, 30.f, DType::kBF16, 100000});
  }
  return failed == 0 ? 0 : 1;
}
