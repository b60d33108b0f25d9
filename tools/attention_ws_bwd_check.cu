// Standalone check of the warp-specialized attention backward (ffi/attention/sm90/
// bwd_ws_sm90.cu) on an H100: float64 host reference of O, lse, delta, dQ, dK and dV for
// odd shapes and every option the kernel takes, in both of its modes, then its speed. No
// JAX needed. A watchdog thread ends the program with a message when a kernel runs past 20 s
// (a barrier phase or a semaphore rank gone wrong hangs the GPU instead of failing):
//
//   nvcc -O3 -std=c++17 -Iffi -Itools -DJAXGPU_HAS_SM90A=1 \
//       "--generate-code=arch=compute_90a,code=[sm_90a]" -o /tmp/awbc \
//       tools/attention_ws_bwd_check.cu ffi/attention/sm90/bwd_ws_sm90.cu && /tmp/awbc
//       [--no-time] [--nondeterministic] [--time-options] [--time-only]
//
// --nondeterministic: check and time only the mode without semaphores (if the deterministic
// one hangs). --time-options: no checks, only the options case against the plain one
// (TimeOptions: softcap + window + segment ids all 0, B4 T4096 N16 H128, interleaved).
// --time-only: no checks, the timed shapes alone.
// --shape B,T,S,K,R,H[,causal]: no checks, time only that shape (bf16; K kv heads of R query
// heads each), e.g. under Nsight Compute (each mode runs 13 launches, the unordered first:
// --launch-skip 15 profiles the deterministic mode's third):
//   ncu -k regex:BwdWsKernel --launch-skip 15 --launch-count 1 /tmp/awbc --shape 4,4096,4096,16,1,256
//
// The walk order (bwd_ws_sm90.cu's file comment): causal and right-window masks walk query
// tiles up and add dQ in decreasing key-tile order. To A/B it against the previous order
// (every mask walked down, adds in increasing key-tile order), build a second binary with
// the development define -DJAXGPU_BWD_WS_WALK_DOWN=1 (it must reach bwd_ws_sm90.cu; the
// banner says which order a binary has) and compare the two's timings:
//   nvcc ... -DJAXGPU_BWD_WS_WALK_DOWN=1 -o /tmp/awbc_down tools/attention_ws_bwd_check.cu \
//       ffi/attention/sm90/bwd_ws_sm90.cu && /tmp/awbc_down --time-only
// By default both modes are checked, the deterministic one run twice and its dq, dk, dv and
// float32 dq accumulator compared bitwise, and both are timed. Segment-id cases
// (MakeSegments: packed runs, one segment a row, flagged rows, queries that see no key)
// also require exact zeros in the dq of queries that see nothing and in the dk, dv of keys
// no query sees.
//
// The kernel gets lse and delta from the reference (as float32), so its outputs are compared
// against exact gradients of the 16-bit inputs. Tolerance, per element: each output is a sum
// of terms (dV_j = sum_i P_ij dO_i; dK_j = scale sum_i dS_ij q_i over the GQA group's heads;
// dQ_i = scale sum_j dS_ij k_j) whose factor P or dS the kernel rounds to 16 bits (relative
// error <= u: 2^-8 bf16, 2^-11 f16), independently per term, so the error of a sum is about
// u / sqrt(3) * sqrt(sum of squared terms), and the output's own rounding adds u |ref|:
//   |got - ref| <= 5 e sqrt(sum terms^2) + 2 u |ref| + 1e-6 M,   e = u (+ softcap term)
// with M the largest |ref| of dq, dk and dv together: dS = P (dP - delta) cancels in float32
// (exactly to 0 where a query sees one key: P = 1, dP = delta), leaving ~2^-24 |dP| where
// the reference's terms and so their tolerance are 0.
// 5 e sqrt(...) is ~9 standard deviations of the rounding noise, which still fails a missing
// or doubled key tile (an error of the size of a whole term group). Under a softcap the
// logit's tanh.approx.f16x2 (about 2^-11 absolute on tanh) moves p by up to cap * 2^-11
// relative, which e adds. The fp32 accumulation and ex2.approx errors are below 2^-20.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "attention/attention_params.h"
#include "attention_check_common.h"
#include "attention/sm90/bwd_ws_sm90.h"
#include "check_common.h"

using jaxgpu::AttentionParams;
using jaxgpu::DType;
using namespace jaxgpu::check;  // NOLINT: the checkers' own helpers
namespace ws = jaxgpu::cuda::attention::sm90;

namespace {

// ---- watchdog ------------------------------------------------------------------------------

// The main thread arms it (a label and a deadline) around every wait for the GPU; a thread
// polls it and ends the process if a deadline passes, even while the main thread sits in a
// blocking CUDA call.
std::atomic<int64_t> g_deadline_ms{0};  // 0: disarmed
char g_label[256] = "";

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void Arm(const std::string& label, double seconds) {
  std::snprintf(g_label, sizeof(g_label), "%s", label.c_str());
  g_deadline_ms.store(NowMs() + int64_t(seconds * 1000));
}
void Disarm() { g_deadline_ms.store(0); }

void StartWatchdog() {
  std::thread([] {
    while (true) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      const int64_t deadline = g_deadline_ms.load();
      if (deadline != 0 && NowMs() > deadline) {
        std::printf(
            "HANG %s: the GPU did not finish within 20 s (a barrier phase or a dQ "
            "semaphore never reached); exiting\n",
            g_label);
        std::fflush(stdout);
        std::_Exit(2);
      }
    }
  }).detach();
}

// Waits for the stream under the watchdog, failing on an asynchronous error.
void Sync(cudaStream_t stream, const std::string& what) {
  Arm(what, 20.0);
  while (true) {
    const cudaError_t e = cudaStreamQuery(stream);
    if (e == cudaSuccess) break;
    if (e != cudaErrorNotReady) {
      std::printf("FAIL %s: %s\n", what.c_str(), cudaGetErrorString(e));
      std::exit(1);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  Disarm();
}

// ---- cases ---------------------------------------------------------------------------------

// Segment ids of a case (MakeSegments):
//   kPacked    runs of random lengths (1..~T/5) with increasing ids; the same ids for q and
//              kv where T == S (self-attention), separate runs otherwise (ids overlapping
//              in part: some queries then see no key).
//   kOnePerRow every id of batch row b is 7 + b, q and kv (nothing masked by them).
//   kMixed     even batch rows one segment, odd rows packed.
//   kUnseen    packed, then in each row one query run gets an id no key has (those queries
//              see nothing: dq = 0) and one key run an id no query has (dk = dv = 0).
//   kZeros     every id 0 (the bench's options case: the ids mask nothing).
enum class Seg { kNone, kPacked, kOnePerRow, kMixed, kUnseen, kZeros };

struct Case : jaxgpu::check::AttentionCase {
  Seg seg = Seg::kNone;
  bool uniform = false;  // pass p.segment_uniform (1 where a row's ids are all one segment)

  std::string Name() const {
    static const char* const kSegNames[] = {"",           " seg:packed", " seg:one-per-row",
                                            " seg:mixed", " seg:unseen", " seg:zeros"};
    return ShapeName() + kSegNames[static_cast<int>(seg)] + (uniform ? "+uniform " : " ") +
           DTypeName();
  }
};

// Segment ids (B, T) and (B, S), empty without them, and the rows' uniformity flags.
struct Segments {
  std::vector<int32_t> q, kv, uniform;
  bool Present() const { return !q.empty(); }
};

// Increasing ids first_id, first_id + 1, ... over runs of 1..max_run positions.
void PackedRuns(int64_t len, int32_t first_id, std::mt19937& rng, int32_t* out) {
  const int64_t max_run = std::max<int64_t>(1, len / 5);
  std::uniform_int_distribution<int64_t> run(1, max_run);
  int32_t id = first_id;
  for (int64_t i = 0; i < len;) {
    const int64_t n = std::min(run(rng), len - i);
    for (int64_t x = 0; x < n; ++x) out[i + x] = id;
    i += n;
    ++id;
  }
}

Segments MakeSegments(const Case& c, std::mt19937& rng) {
  Segments sg;
  if (c.seg == Seg::kNone) return sg;
  sg.q.assign(c.b * c.t, 0);
  sg.kv.assign(c.b * c.s, 0);
  for (int64_t b = 0; b < c.b; ++b) {
    int32_t* q = sg.q.data() + b * c.t;
    int32_t* kv = sg.kv.data() + b * c.s;
    const bool one = c.seg == Seg::kOnePerRow || (c.seg == Seg::kMixed && b % 2 == 0);
    if (c.seg == Seg::kZeros) continue;
    if (one) {
      std::fill(q, q + c.t, int32_t(7 + b));
      std::fill(kv, kv + c.s, int32_t(7 + b));
      continue;
    }
    PackedRuns(c.t, 0, rng, q);
    if (c.t == c.s) {
      std::copy(q, q + c.t, kv);
    } else {
      PackedRuns(c.s, 0, rng, kv);
    }
    if (c.seg == Seg::kUnseen) {
      // The run holding the middle query, and the run holding the first key.
      const int32_t qid = q[c.t / 2], kid = kv[0];
      for (int64_t i = 0; i < c.t; ++i) {
        if (q[i] == qid) q[i] = 1000 + int32_t(b);
      }
      for (int64_t j = 0; j < c.s; ++j) {
        if (kv[j] == kid) kv[j] = 2000 + int32_t(b);
      }
    }
  }
  sg.uniform.assign(c.b, 0);
  for (int64_t b = 0; b < c.b; ++b) {
    const int32_t* q = sg.q.data() + b * c.t;
    const int32_t* kv = sg.kv.data() + b * c.s;
    bool same = true;
    for (int64_t i = 0; i < c.t; ++i) same = same && q[i] == q[0];
    for (int64_t j = 0; j < c.s; ++j) same = same && kv[j] == q[0];
    sg.uniform[b] = same ? 1 : 0;
  }
  return sg;
}

// Whether query i of batch row b sees key j (attention_params.h).
bool Sees(const Case& c, const Segments& sg, int64_t b, int64_t i, int64_t j) {
  if (c.causal && j > i) return false;
  if (c.left >= 0 && j < i - c.left) return false;
  if (c.right >= 0 && j > i + c.right) return false;
  if (sg.Present() && sg.q[b * c.t + i] != sg.kv[b * c.s + j]) return false;
  return true;
}

struct Device {
  void *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr, *d_o = nullptr;
  void *dq = nullptr, *dk = nullptr, *dv = nullptr;
  float *lse = nullptr, *delta = nullptr, *dq_accum = nullptr;
  int* sems = nullptr;
  int32_t *q_seg = nullptr, *kv_seg = nullptr, *uniform = nullptr;  // with segment ids
  ~Device() {
    for (void* ptr :
         {q, k, v, o, d_o, dq, dk, dv, static_cast<void*>(lse), static_cast<void*>(delta),
          static_cast<void*>(dq_accum), static_cast<void*>(sems), static_cast<void*>(q_seg),
          static_cast<void*>(kv_seg), static_cast<void*>(uniform)}) {
      cudaFree(ptr);
    }
  }
};

AttentionParams Params(const Case& c, const Device& d) {
  AttentionParams p = c.ShapeParams();
  p.q = d.q;
  p.k = d.k;
  p.v = d.v;
  p.o = d.o;
  p.lse = d.lse;
  p.d_o = d.d_o;
  p.dq = d.dq;
  p.dk = d.dk;
  p.dv = d.dv;
  p.delta = d.delta;
  if (c.seg != Seg::kNone) {
    p.q_segment_ids = d.q_seg;
    p.kv_segment_ids = d.kv_seg;
    if (c.uniform) p.segment_uniform = d.uniform;
  }
  return p;
}

void Alloc(const Case& c, Device* d) {
  const int64_t nq = c.b * c.t * c.N() * c.h, nkv = c.b * c.s * c.k * c.h;
  const int64_t rows = c.b * c.N() * c.t;
  CK(cudaMalloc(&d->q, nq * 2));
  CK(cudaMalloc(&d->k, nkv * 2));
  CK(cudaMalloc(&d->v, nkv * 2));
  CK(cudaMalloc(&d->o, nq * 2));
  CK(cudaMalloc(&d->d_o, nq * 2));
  CK(cudaMalloc(&d->dq, nq * 2));
  CK(cudaMalloc(&d->dk, nkv * 2));
  CK(cudaMalloc(&d->dv, nkv * 2));
  CK(cudaMalloc(&d->lse, rows * 4));
  CK(cudaMalloc(&d->delta, rows * 4));
  if (c.seg != Seg::kNone) {
    CK(cudaMalloc(&d->q_seg, c.b * c.t * 4));
    CK(cudaMalloc(&d->kv_seg, c.b * c.s * 4));
    CK(cudaMalloc(&d->uniform, c.b * 4));
  }
  const AttentionParams p = Params(c, *d);
  CK(cudaMalloc(&d->dq_accum, ws::BwdDqAccumBytes(p)));
  CK(cudaMalloc(&d->sems, std::max<size_t>(ws::BwdSemaphoreBytes(p), 4)));
}

// The workspace zeroed and the outputs set to NaN (0xffff) where the kernel writes nothing.
void Launch(const Case& c, const Device& d, bool deterministic, const std::string& what) {
  const AttentionParams p = Params(c, d);
  const int64_t nq = c.b * c.t * c.N() * c.h, nkv = c.b * c.s * c.k * c.h;
  CK(cudaMemset(d.dq, 0xff, nq * 2));
  CK(cudaMemset(d.dk, 0xff, nkv * 2));
  CK(cudaMemset(d.dv, 0xff, nkv * 2));
  CK(cudaMemset(d.dq_accum, 0, ws::BwdDqAccumBytes(p)));
  CK(cudaMemset(d.sems, 0, ws::BwdSemaphoreBytes(p)));
  const cudaError_t e = ws::LaunchBwdWarpSpecialized(
      p, d.dq_accum, deterministic ? d.sems : nullptr, nullptr, deterministic);
  if (e != cudaSuccess) {
    std::printf("FAIL %s: launch: %s\n", what.c_str(), cudaGetErrorString(e));
    std::exit(1);
  }
  Sync(nullptr, what);
}

// ---- reference -----------------------------------------------------------------------------

struct Reference {
  std::vector<double> dq, dk, dv;           // exact gradients
  std::vector<double> dq_sq, dk_sq, dv_sq;  // sums of the squared terms (the tolerance)
  std::vector<float> lse, delta;            // what the kernel is given
};

// q, do (B, T, N, H); k, v (B, S, K, H); lse, delta (B, N, T) with n = kh * R + r.
Reference ComputeWide(const Case& c, const Segments& sg, const std::vector<double>& qd,
                      const std::vector<double>& kd, const std::vector<double>& vd,
                      const std::vector<double>& dod, std::vector<double>* out = nullptr) {
  const int64_t n_heads = c.N(), H = c.h;
  const double scale = 1.0 / std::sqrt(double(H));
  Reference ref;
  ref.dq.assign(qd.size(), 0.0);
  ref.dq_sq.assign(qd.size(), 0.0);
  ref.dk.assign(kd.size(), 0.0);
  ref.dk_sq.assign(kd.size(), 0.0);
  ref.dv.assign(vd.size(), 0.0);
  ref.dv_sq.assign(vd.size(), 0.0);
  ref.lse.assign(c.b * n_heads * c.t, 0.f);
  ref.delta.assign(c.b * n_heads * c.t, 0.f);
  if (out != nullptr) out->assign(qd.size(), 0.0);
  std::vector<double> logit(c.s), slope(c.s), prob(c.s), o(H);
  std::vector<char> seen(c.s);
  for (int64_t b = 0; b < c.b; ++b) {
    for (int64_t kh = 0; kh < c.k; ++kh) {
      for (int64_t r = 0; r < c.r; ++r) {
        const int64_t n = kh * c.r + r;
        for (int64_t i = 0; i < c.t; ++i) {
          // The keys [lo, hi] that query i may see, seen[j] the exact set (Sees).
          int64_t lo = c.s, hi = -1;
          for (int64_t j = 0; j < c.s; ++j) {
            seen[j] = Sees(c, sg, b, i, j);
            if (seen[j]) lo = std::min(lo, j), hi = j;
          }
          const int64_t qrow = ((b * c.t + i) * n_heads + n) * H;
          const int64_t stat = (b * n_heads + n) * c.t + i;
          if (hi < lo) {  // sees nothing: lse = -inf, zero gradients
            ref.lse[stat] = -INFINITY;
            continue;
          }
          double mx = -INFINITY;
          for (int64_t j = lo; j <= hi; ++j) {
            if (!seen[j]) continue;
            const int64_t krow = ((b * c.s + j) * c.k + kh) * H;
            double dot = 0;
            for (int64_t x = 0; x < H; ++x) dot += qd[qrow + x] * kd[krow + x];
            double l = dot * scale;
            slope[j] = 1.0;
            if (c.softcap > 0) {
              const double th = std::tanh(l / c.softcap);
              l = c.softcap * th;
              slope[j] = 1.0 - th * th;
            }
            logit[j] = l;
            mx = std::max(mx, l);
          }
          double sum = 0;
          for (int64_t j = lo; j <= hi; ++j) sum += seen[j] ? std::exp(logit[j] - mx) : 0.0;
          const double lse = mx + std::log(sum);
          std::fill(o.begin(), o.end(), 0.0);
          for (int64_t j = lo; j <= hi; ++j) {
            if (!seen[j]) continue;
            prob[j] = std::exp(logit[j] - lse);
            const int64_t krow = ((b * c.s + j) * c.k + kh) * H;
            for (int64_t x = 0; x < H; ++x) o[x] += prob[j] * vd[krow + x];
          }
          double delta = 0;
          for (int64_t x = 0; x < H; ++x) delta += o[x] * dod[qrow + x];
          if (out != nullptr) std::copy(o.begin(), o.end(), out->begin() + qrow);
          ref.lse[stat] = float(lse);
          ref.delta[stat] = float(delta);
          for (int64_t j = lo; j <= hi; ++j) {
            if (!seen[j]) continue;
            const int64_t krow = ((b * c.s + j) * c.k + kh) * H;
            double dp = 0;
            for (int64_t x = 0; x < H; ++x) dp += dod[qrow + x] * vd[krow + x];
            const double ds = prob[j] * (dp - delta) * slope[j] * scale;
            for (int64_t x = 0; x < H; ++x) {
              const double tq = ds * kd[krow + x], tk = ds * qd[qrow + x];
              const double tv = prob[j] * dod[qrow + x];
              ref.dq[qrow + x] += tq;
              ref.dq_sq[qrow + x] += tq * tq;
              ref.dk[krow + x] += tk;
              ref.dk_sq[krow + x] += tk * tk;
              ref.dv[krow + x] += tv;
              ref.dv_sq[krow + x] += tv * tv;
            }
          }
        }
      }
    }
  }
  return ref;
}

Reference Compute(const Case& c, const Segments& sg, const std::vector<uint16_t>& q,
                  const std::vector<uint16_t>& k, const std::vector<uint16_t>& v,
                  const std::vector<uint16_t>& d_o) {
  // Inputs as doubles once (the loops read each many times).
  auto widen = [&](const std::vector<uint16_t>& x) {
    std::vector<double> w(x.size());
    for (size_t i = 0; i < x.size(); ++i) w[i] = HalfValue(c.dtype, x[i]);
    return w;
  };
  return ComputeWide(c, sg, widen(q), widen(k), widen(v), widen(d_o));
}

// --self-test: the reference's gradients against central differences of sum(dO * O) on
// tiny shapes (host only, no GPU), so that a FAIL above is the kernel's and not the
// reference's.
bool SelfTestReference() {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> uni(-1.0, 1.0);
  const std::vector<Case> cases = {
      {1, 5, 7, 1, 2, 8},
      {1, 7, 5, 2, 1, 8, true},
      {1, 6, 6, 1, 2, 8, false, 2, 1, 0.7f},
      {1, 6, 9, 1, 1, 16, true, 3, -1, 0.f},
      {2, 9, 9, 1, 2, 8, false, -1, -1, 0.7f, DType::kBF16, Seg::kUnseen},
  };
  bool ok = true;
  for (const Case& c : cases) {
    const Segments sg = MakeSegments(c, rng);
    const int64_t nq = c.b * c.t * c.N() * c.h, nkv = c.b * c.s * c.k * c.h;
    std::vector<double> q(nq), k(nkv), v(nkv), d_o(nq);
    for (auto* x : {&q, &k, &v, &d_o}) {
      for (auto& e : *x) e = uni(rng);
    }
    const Reference ref = ComputeWide(c, sg, q, k, v, d_o);
    auto loss = [&] {
      std::vector<double> o;
      ComputeWide(c, sg, q, k, v, d_o, &o);
      double l = 0;
      for (int64_t i = 0; i < nq; ++i) l += o[i] * d_o[i];
      return l;
    };
    double worst = 0;
    auto probe = [&](std::vector<double>& x, const std::vector<double>& grad) {
      for (size_t i = 0; i < x.size(); ++i) {
        const double keep = x[i], h = 1e-6;
        x[i] = keep + h;
        const double up = loss();
        x[i] = keep - h;
        const double down = loss();
        x[i] = keep;
        worst = std::max(worst, std::fabs((up - down) / (2 * h) - grad[i]));
      }
    };
    probe(q, ref.dq);
    probe(k, ref.dk);
    probe(v, ref.dv);
    const bool pass = worst < 1e-6;
    std::printf("%s reference self-test %s: max |grad - finite difference| %.1e\n",
                pass ? "ok  " : "FAIL", c.Name().c_str(), worst);
    ok = ok && pass;
  }
  return ok;
}

// Worst ratio of |got - ref| to the tolerance (file comment) over one output; > 1 fails.
struct Compared {
  double worst_ratio = 0, worst_abs = 0, max_ref = 0;
  int64_t at = -1;
};

Compared Compare(const Case& c, const std::vector<uint16_t>& got, const std::vector<double>& want,
                 const std::vector<double>& sq, double floor) {
  const double u = c.dtype == DType::kBF16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  const double e = u + (c.softcap > 0 ? c.softcap * std::ldexp(1.0, -11) : 0.0);
  Compared r;
  for (double w : want) r.max_ref = std::max(r.max_ref, std::fabs(w));
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = HalfValue(c.dtype, got[i]);
    const double err = std::isnan(g) ? INFINITY : std::fabs(g - want[i]);
    const double tol = 5 * e * std::sqrt(sq[i]) + 2 * u * std::fabs(want[i]) + floor;
    const double ratio = err / std::max(tol, 1e-30);
    if (ratio > r.worst_ratio) r.worst_ratio = ratio, r.at = int64_t(i);
    r.worst_abs = std::max(r.worst_abs, err);
  }
  return r;
}

template <typename X>
std::vector<X> Fetch(const void* ptr, size_t n) {
  std::vector<X> out(n);
  CK(cudaMemcpy(out.data(), ptr, n * sizeof(X), cudaMemcpyDeviceToHost));
  return out;
}

bool g_nondeterministic_only = false;

bool Check(const Case& c, std::mt19937& rng) {
  const int64_t nq = c.b * c.t * c.N() * c.h, nkv = c.b * c.s * c.k * c.h;
  std::uniform_real_distribution<float> uni(-1.f, 1.f);
  std::vector<uint16_t> q(nq), k(nkv), v(nkv), d_o(nq);
  for (auto* x : {&q, &d_o}) {
    for (auto& e : *x) e = HalfBits(c.dtype, uni(rng));
  }
  for (auto* x : {&k, &v}) {
    for (auto& e : *x) e = HalfBits(c.dtype, uni(rng));
  }
  Device d;
  Alloc(c, &d);
  const AttentionParams p = Params(c, d);
  if (const char* why = ws::WarpSpecializedBwdUnavailable(p)) {
    std::printf("SKIP %s: %s\n", c.Name().c_str(), why);
    return true;
  }
  const Segments sg = MakeSegments(c, rng);
  const Reference ref = Compute(c, sg, q, k, v, d_o);
  if (sg.Present()) {
    CK(cudaMemcpy(d.q_seg, sg.q.data(), sg.q.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d.kv_seg, sg.kv.data(), sg.kv.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d.uniform, sg.uniform.data(), sg.uniform.size() * 4, cudaMemcpyHostToDevice));
  }
  // Queries that see no key and keys no query sees: their dq (dk and dv) must be exactly 0,
  // not merely within the tolerance floor.
  std::vector<char> q_blind(c.b * c.t, 1), kv_blind(c.b * c.s, 1);
  int64_t n_q_blind = 0, n_kv_blind = 0;
  for (int64_t b = 0; b < c.b; ++b) {
    for (int64_t i = 0; i < c.t; ++i) {
      for (int64_t j = 0; j < c.s; ++j) {
        if (Sees(c, sg, b, i, j)) q_blind[b * c.t + i] = 0, kv_blind[b * c.s + j] = 0;
      }
    }
  }
  for (char x : q_blind) n_q_blind += x;
  for (char x : kv_blind) n_kv_blind += x;
  // The number of elements of rows flagged in `blind` (rows of `len` positions, `heads`
  // heads of H) whose bits are not +-0.
  auto nonzero = [&](const std::vector<uint16_t>& got, const std::vector<char>& blind,
                     int64_t heads) {
    int64_t bad = 0;
    for (size_t e = 0; e < got.size(); ++e) {
      const int64_t row = int64_t(e) / (heads * c.h);  // b * len + position
      if (blind[row] && (got[e] & 0x7fff) != 0) ++bad;
    }
    return bad;
  };
  CK(cudaMemcpy(d.q, q.data(), nq * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d.k, k.data(), nkv * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d.v, v.data(), nkv * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d.d_o, d_o.data(), nq * 2, cudaMemcpyHostToDevice));
  CK(cudaMemset(d.o, 0, nq * 2));  // not read by this backward
  CK(cudaMemcpy(d.lse, ref.lse.data(), ref.lse.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d.delta, ref.delta.data(), ref.delta.size() * 4, cudaMemcpyHostToDevice));

  bool ok = true;
  for (int mode = 0; mode < 2; ++mode) {
    const bool det = mode == 1;
    if (det && g_nondeterministic_only) continue;
    const std::string name = c.Name() + (det ? " det" : " nondet");
    Launch(c, d, det, name);
    const auto dq = Fetch<uint16_t>(d.dq, nq), dk = Fetch<uint16_t>(d.dk, nkv),
               dv = Fetch<uint16_t>(d.dv, nkv);
    double largest = 0;
    for (const auto* w : {&ref.dq, &ref.dk, &ref.dv}) {
      for (double x : *w) largest = std::max(largest, std::fabs(x));
    }
    const double floor = 1e-6 * largest;
    const Compared cq = Compare(c, dq, ref.dq, ref.dq_sq, floor),
                   ck = Compare(c, dk, ref.dk, ref.dk_sq, floor),
                   cv = Compare(c, dv, ref.dv, ref.dv_sq, floor);
    bool pass = cq.worst_ratio <= 1 && ck.worst_ratio <= 1 && cv.worst_ratio <= 1;
    std::string blind;
    if (n_q_blind > 0 || n_kv_blind > 0) {
      const int64_t bad_q = nonzero(dq, q_blind, c.N());
      const int64_t bad_kv = nonzero(dk, kv_blind, c.k) + nonzero(dv, kv_blind, c.k);
      char buf[160];
      std::snprintf(buf, sizeof(buf),
                    "; %lld blind queries (%lld nonzero dq), %lld unseen keys (%lld nonzero dk/dv)",
                    (long long)n_q_blind, (long long)bad_q, (long long)n_kv_blind,
                    (long long)bad_kv);
      blind = buf;
      pass = pass && bad_q == 0 && bad_kv == 0;
    }
    std::string repeat;
    if (det) {
      // Rerun: every byte of dq, dk, dv and of the float32 accumulator the same.
      const auto acc = Fetch<float>(d.dq_accum, nq);
      Launch(c, d, true, name + " (rerun)");
      const auto acc2 = Fetch<float>(d.dq_accum, nq);
      const bool same = Fetch<uint16_t>(d.dq, nq) == dq && Fetch<uint16_t>(d.dk, nkv) == dk &&
                        Fetch<uint16_t>(d.dv, nkv) == dv &&
                        std::memcmp(acc.data(), acc2.data(), nq * 4) == 0;
      repeat = same ? ", rerun bitwise equal" : ", RERUN DIFFERS";
      pass = pass && same;
    }
    std::printf(
        "%s %s: err/tol dq %.2f dk %.2f dv %.2f; max |err| dq %.1e dk %.1e dv %.1e (max |ref| "
        "%.1e %.1e %.1e)%s%s\n",
        pass ? "ok  " : "FAIL", name.c_str(), cq.worst_ratio, ck.worst_ratio, cv.worst_ratio,
        cq.worst_abs, ck.worst_abs, cv.worst_abs, cq.max_ref, ck.max_ref, cv.max_ref, blind.c_str(),
        repeat.c_str());
    if (!pass) {
      // Where the worst element is: (b, row, head, col) of the worst output.
      auto where = [&](const char* what, const Compared& cmp, int64_t len, int64_t heads) {
        if (cmp.worst_ratio <= 1 || cmp.at < 0) return;
        const int64_t col = cmp.at % c.h, head = (cmp.at / c.h) % heads;
        const int64_t row = (cmp.at / c.h / heads) % len, b = cmp.at / c.h / heads / len;
        std::printf("     worst %s at b %lld row %lld head %lld col %lld\n", what, (long long)b,
                    (long long)row, (long long)head, (long long)col);
      };
      where("dq", cq, c.t, c.N());
      where("dk", ck, c.s, c.k);
      where("dv", cv, c.s, c.k);
    }
    ok = ok && pass;
  }
  return ok;
}

// ---- timing --------------------------------------------------------------------------------

double Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The (query, key) pairs a batch row's head computes, segments aside, for the TFLOP/s: T S,
// half of it under the causal mask alone (the convention of the numbers in bwd_ws_sm90.cu),
// counted where a window is set.
double VisiblePairs(const Case& c) {
  if (c.left < 0 && c.right < 0) return double(c.t) * c.s * (c.causal ? 0.5 : 1.0);
  double n = 0;
  for (int64_t i = 0; i < c.t; ++i) {
    int64_t hi = c.s - 1;
    if (c.causal) hi = std::min(hi, i);
    if (c.right >= 0) hi = std::min(hi, i + c.right);
    const int64_t lo = c.left >= 0 ? std::max<int64_t>(0, i - c.left) : 0;
    n += double(std::max<int64_t>(0, hi - lo + 1));
  }
  return n;
}

// Median times (ms) of the workspace memsets, the main kernel and the conversion, and the
// backward's TFLOP/s (10 B N H flops a visible pair: VisiblePairs) over main + convert.
// Returns the median of main + convert in ms (0 where the kernel does not take the case).
double Time(const Case& c, bool deterministic) {
  Device d;
  Alloc(c, &d);
  const int64_t nq = c.b * c.t * c.N() * c.h, nkv = c.b * c.s * c.k * c.h;
  CK(cudaMemset(d.q, 0x3c, nq * 2));
  CK(cudaMemset(d.d_o, 0x3c, nq * 2));
  CK(cudaMemset(d.k, 0x3c, nkv * 2));
  CK(cudaMemset(d.v, 0x3c, nkv * 2));
  CK(cudaMemset(d.lse, 0, c.b * c.N() * c.t * 4));
  CK(cudaMemset(d.delta, 0, c.b * c.N() * c.t * 4));
  if (c.seg != Seg::kNone) {
    std::mt19937 rng(5);
    const Segments sg = MakeSegments(c, rng);
    CK(cudaMemcpy(d.q_seg, sg.q.data(), sg.q.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d.kv_seg, sg.kv.data(), sg.kv.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d.uniform, sg.uniform.data(), sg.uniform.size() * 4, cudaMemcpyHostToDevice));
  }
  const AttentionParams p = Params(c, d);
  const std::string name = c.Name() + (deterministic ? " det" : " nondet");
  if (const char* why = ws::WarpSpecializedBwdUnavailable(p)) {
    std::printf("SKIP time %s: %s\n", name.c_str(), why);
    return 0;
  }
  cudaEvent_t ev[4];
  for (auto& e : ev) CK(cudaEventCreate(&e));
  std::vector<float> t_zero, t_main, t_conv;
  for (int rep = 0; rep < 13; ++rep) {
    CK(cudaEventRecord(ev[0]));
    CK(cudaMemsetAsync(d.dq_accum, 0, ws::BwdDqAccumBytes(p)));
    if (deterministic) CK(cudaMemsetAsync(d.sems, 0, ws::BwdSemaphoreBytes(p)));
    CK(cudaEventRecord(ev[1]));
    const cudaError_t e = ws::LaunchBwdWarpSpecializedMain(
        p, d.dq_accum, deterministic ? d.sems : nullptr, nullptr, deterministic);
    if (e != cudaSuccess) {
      std::printf("FAIL time %s: launch: %s\n", name.c_str(), cudaGetErrorString(e));
      std::exit(1);
    }
    CK(cudaEventRecord(ev[2]));
    CK(ws::LaunchDqAccumConvert(p, d.dq_accum, nullptr));
    CK(cudaEventRecord(ev[3]));
    Sync(nullptr, "time " + name);
    float a = 0, b = 0, cc = 0;
    CK(cudaEventElapsedTime(&a, ev[0], ev[1]));
    CK(cudaEventElapsedTime(&b, ev[1], ev[2]));
    CK(cudaEventElapsedTime(&cc, ev[2], ev[3]));
    if (rep >= 3) t_zero.push_back(a), t_main.push_back(b), t_conv.push_back(cc);
  }
  const double zero = Median(t_zero), main_ms = Median(t_main), conv = Median(t_conv);
  const double flops = 10.0 * c.b * c.N() * c.h * VisiblePairs(c);
  std::printf(
      "time %s: main %.1f us + convert %.1f us (+ workspace zeroing %.1f us): %.0f TFLOP/s "
      "(main alone %.0f)\n",
      name.c_str(), main_ms * 1e3, conv * 1e3, zero * 1e3,
      flops / ((main_ms + conv) * 1e-3) * 1e-12, flops / (main_ms * 1e-3) * 1e-12);
  for (auto& e : ev) cudaEventDestroy(e);
  return main_ms + conv;
}

// The bench's options case (softcap 30, window (T, T), segment ids all 0: nothing masked)
// next to the plain case, deterministic (the library's mode), in interleaved rounds. Four
// variants: plain; softcap alone (the unmasked kernel with the cap); options as the bench
// runs it (a window is set, so the op passes no uniformity flags: the maskable kernel
// copies the ids and decides per step); options with the flags (the rows skip the id work).
void TimeOptions() {
  const Case plain{4, 4096, 4096, 16, 1, 128};
  const Case cap{4, 4096, 4096, 16, 1, 128, false, -1, -1, 30.f};
  const Case opts{4, 4096, 4096, 16, 1, 128, false, 4096, 4096, 30.f, DType::kBF16, Seg::kZeros};
  Case opts_flags = opts;
  opts_flags.uniform = true;
  for (int round = 0; round < 3; ++round) {
    const double t_plain = Time(plain, true), t_cap = Time(cap, true), t_opts = Time(opts, true),
                 t_flags = Time(opts_flags, true);
    if (t_plain > 0) {
      std::printf(
          "options round %d (backward main + convert, deterministic): softcap / plain %.3f, "
          "options / plain %.3f, options+uniform / plain %.3f\n",
          round, t_cap / t_plain, t_opts / t_plain, t_flags / t_plain);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool time = true, options_only = false, check = true;
  std::vector<Case> only;  // --shape
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--no-time") == 0) {
      time = false;
    } else if (std::strcmp(argv[i], "--time-options") == 0) {
      options_only = true;
    } else if (std::strcmp(argv[i], "--time-only") == 0) {
      check = false;
    } else if (std::strcmp(argv[i], "--nondeterministic") == 0) {
      g_nondeterministic_only = true;
    } else if (std::strcmp(argv[i], "--self-test") == 0) {
      return SelfTestReference() ? 0 : 1;
    } else if (std::strcmp(argv[i], "--shape") == 0 && i + 1 < argc) {
      long long b, t, s_, k, r, h;
      int causal = 0;
      if (std::sscanf(argv[++i], "%lld,%lld,%lld,%lld,%lld,%lld,%d", &b, &t, &s_, &k, &r, &h,
                      &causal) < 6) {
        std::printf("--shape: B,T,S,K,R,H[,causal]\n");
        return 2;
      }
      Case c{b, t, s_, k, r, h, causal != 0};
      only.push_back(c);
      check = false;
    } else {
      std::printf(
          "usage: %s [--no-time] [--nondeterministic] [--self-test] [--time-options] "
          "[--time-only] [--shape B,T,S,K,R,H[,causal]]\n",
          argv[0]);
      return 2;
    }
  }
  StartWatchdog();
  int device = 0, major = 0, minor = 0;
  CK(cudaGetDevice(&device));
  CK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  CK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  if (major != 9 || minor != 0) {
    std::printf("needs a compute capability 9.0 GPU (sm_90a code); this one is %d.%d\n", major,
                minor);
    return 2;
  }
#if defined(JAXGPU_BWD_WS_WALK_DOWN) && JAXGPU_BWD_WS_WALK_DOWN
  const char* walk = "every mask walked down (JAXGPU_BWD_WS_WALK_DOWN)";
#else
  const char* walk = "causal / right windows walked up";
#endif
  std::printf("warp-specialized backward, %s%s\n", walk,
              g_nondeterministic_only ? ", non-deterministic mode only" : "");
  std::mt19937 rng(20261127);
  int failed = 0, total = 0;
  // b, t, s, k, r, h, causal, left, right, softcap, dtype
  const std::vector<Case> cases = {
      {1, 128, 128, 1, 1, 128},                                   // one tile each way
      {1, 333, 777, 1, 1, 128},                                   // odd T != S
      {1, 777, 333, 1, 2, 64},                                    // odd, GQA 2, H 64
      {2, 333, 333, 2, 2, 128, true},                             // causal, GQA
      {1, 777, 777, 1, 4, 64, true},                              // causal, GQA 4
      {1, 500, 500, 2, 1, 96},                                    // H 96 (padded to 128)
      {1, 600, 600, 1, 2, 128, false, 200, 0, 30.f},              // window (200, 0), softcap
      {1, 600, 600, 1, 2, 128, true, 130, -1, 0.f, DType::kF16},  // causal + left window, f16
      {1, 400, 500, 1, 1, 64, false, 70, 90},                     // two-sided window
      {1, 300, 700, 2, 2, 64},                                    // S > T
      {1, 1, 300, 1, 8, 128},                                     // T = 1, GQA 8
      {1, 1, 300, 1, 2, 128, true},                               // T = 1 causal: one key visible
      {1, 300, 300, 2, 2, 256, true},                             // H 256 causal
      {1, 333, 200, 1, 2, 256},                                   // H 256, odd
      {1, 200, 200, 1, 2, 160, false, -1, -1, 30.f},              // H 160 (padded to 256), softcap
      // The walk order's cases (up: causal, right windows): T != S both ways with GQA, key
      // tiles past T (no steps), windows without causal, longer chains.
      {2, 333, 700, 2, 4, 128, true},                   // causal GQA 4, T < S
      {1, 700, 333, 1, 3, 64, true},                    // causal GQA 3, T > S, H 64
      {1, 400, 300, 1, 3, 256, true},                   // causal GQA 3, T > S, H 256
      {1, 500, 400, 2, 2, 128, false, -1, 100},         // right window alone, T > S
      {1, 300, 450, 1, 2, 256, false, 150, 60},         // two-sided window, T < S, H 256
      {1, 450, 300, 1, 2, 64, false, 100, -1},          // left window alone (down), H 64
      {1, 1500, 1300, 1, 2, 128, true},                 // causal: 11 key tiles, 24 query tiles
      {1, 1100, 1100, 1, 2, 256, false, 300, 0, 30.f},  // window (300, 0), H 256, softcap
  };
  // Segment ids (MakeSegments), then whether p.segment_uniform is passed.
  constexpr DType kBf = DType::kBF16, kF16 = DType::kF16;
  const std::vector<Case> seg_cases = {
      {1, 333, 333, 2, 2, 128, false, -1, -1, 0.f, kBf, Seg::kPacked},      // self-attention, GQA
      {2, 300, 300, 1, 2, 128, true, -1, -1, 0.f, kBf, Seg::kPacked},       // causal
      {1, 400, 500, 1, 1, 64, false, 70, 90, 0.f, kBf, Seg::kPacked},       // T != S, window, H 64
      {1, 600, 600, 1, 2, 128, false, 200, 0, 30.f, kBf, Seg::kPacked},     // window + softcap
      {1, 1, 300, 1, 2, 128, false, -1, -1, 0.f, kBf, Seg::kPacked},        // T = 1
      {3, 200, 200, 1, 2, 128, false, -1, -1, 30.f, kBf, Seg::kOnePerRow},  // ranges equal
      {3, 200, 200, 1, 2, 128, false, -1, -1, 30.f, kBf, Seg::kOnePerRow, true},  // flagged
      {4, 256, 256, 1, 2, 128, false, -1, -1, 0.f, kBf, Seg::kMixed, true},  // flagged + packed
      {2, 300, 300, 1, 1, 128, true, -1, -1, 0.f, kBf, Seg::kMixed, true},   // the same, causal
      {2, 333, 777, 1, 2, 128, false, -1, -1, 0.f, kBf, Seg::kUnseen},       // blind rows, T != S
      {1, 777, 777, 1, 4, 64, true, -1, -1, 0.f, kF16, Seg::kUnseen},        // causal, f16, GQA 4
      {1, 500, 500, 2, 1, 96, true, 100, -1, 0.f, kF16, Seg::kPacked},   // H 96, causal + window
      {1, 300, 300, 2, 2, 256, true, -1, -1, 0.f, kBf, Seg::kPacked},    // H 256 causal
      {2, 333, 200, 1, 2, 256, false, -1, -1, 30.f, kBf, Seg::kUnseen},  // H 256 softcap, blind
      {2, 256, 256, 1, 2, 256, false, -1, -1, 0.f, kBf, Seg::kMixed, true},  // H 256 flagged
  };
  if (!options_only && check) {
    for (const Case& c : cases) {
      ++total;
      if (!Check(c, rng)) ++failed;
    }
    for (const Case& c : seg_cases) {
      ++total;
      if (!Check(c, rng)) ++failed;
    }
    std::printf("checks: %d cases, %d failed\n", total, failed);
  }
  if (options_only) {
    TimeOptions();
  } else if (time || !only.empty()) {
    const std::vector<Case> defaults = {
        {4, 4096, 4096, 16, 1, 128},
        {4, 4096, 4096, 16, 1, 128, true},
        {1, 16384, 16384, 16, 1, 128},
        {16, 1024, 1024, 16, 1, 64, true},
        {4, 4096, 4096, 16, 1, 256},
        {4, 4096, 4096, 8, 4, 128, true},             // GQA 32 / 8
        {4, 4096, 4096, 16, 1, 256, true},            // H 256 causal
        {4, 4096, 4096, 16, 1, 128, false, 1024, 0},  // sliding window
    };
    for (const Case& c : only.empty() ? defaults : only) {
      Time(c, false);
      if (!g_nondeterministic_only) Time(c, true);
    }
    if (only.empty()) TimeOptions();
  }
  return failed == 0 ? 0 : 1;
}
