// Standalone correctness and speed check of the quantized linear kernels
// (ffi/matmul/qlinear_kernels.cu) against a float64 host reference:
//
//   nvcc -O3 -std=c++17 -Iffi -DJAXGPU_HAS_SM90A=1 -arch=sm_90a -o /tmp/qc \
//       tools/qlinear_check.cu ffi/matmul/qlinear_kernels.cu ffi/matmul/qlinear_wgmma_sm90.cu \
//       && /tmp/qc [--no-time] [--gemv | --wgmma]
//   /tmp/qc --time-only --gemv --shape 2304x9216 --shape 9216x2304   # other weights, K x N
//
// --gemv: the correctness suite (plus cases for its M <= 16 shapes) through the GEMV kernel
// (LaunchQLinearPath kGemv; ineligible cases run the staged kernel and are counted apart),
// and the speed table times both kernels on the same inputs (launches interleaved) side by
// side. One case under Nsight Compute (the GEMV kernel of int4 g128 8192 x 28672, M = 1):
//   ncu --set full -k regex:QLinearGemvKernel -c 1 -o /tmp/qgemv /tmp/qc --gemv --one
// (--one: only int4 K = 8192 at M = 1 and 16, or with --bits 8 the int8 cases; the staged
// kernel: -k regex:QLinearKernel).
//
// --wgmma: the same through the Hopper kernel (kWgmma; cases it cannot serve run the staged
// kernel and are counted apart), plus cases for its shapes (M from 17 to 300 across token
// chunks, N across 128-feature blocks, split and unsplit K), and the speed table from M = 16
// to 4096 (the staged kernel beside it up to M = 256).
// Correctness: random x, q, scales, zeros and bias, packed on the host with QPackedAt, for
// bf16 / f16 x int4 / int8, odd sizes, every activation, batched groups with shared or
// per-group weights and workspaces that allow many, few or no splits. The reference
// dequantizes exactly as qlinear_params.h says (q - z exact, one rounding to T of the
// product), sums in float64, adds the bias and applies the activation in float64. An
// output passes when |y - ref| <= ulp_T(|ref|) + 3e-5 sum_k |x w| (the rounding of y to T
// plus float32 accumulation). Split-K cases are run twice and compared bitwise.
// --wgmma --one: only int4 (with --m M: only those M), for Nsight Compute.
// Speed: W = 8192 x 28672 and 28672 x 8192 (or --shape), M = 1 .. 256, cudaEvent median of
// 30 launches alternating two weight buffers, and per call from a CUDA graph of launches on
// distinct weights (at least 256 MiB in all: past the 50 MB L2).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "check_common.h"
#include "matmul/qlinear_cuda.h"
#include "matmul/qlinear_params.h"

using jaxgpu::DType;
using jaxgpu::QActivation;
using jaxgpu::QLinearParams;

namespace {

using namespace jaxgpu::check;  // NOLINT: the checkers' own helpers

double ActRef(QActivation a, double v) {
  switch (a) {
    case QActivation::kRelu: return v > 0 ? v : 0;
    case QActivation::kGeluTanh:
      return 0.5 * v * (1 + std::tanh(std::sqrt(2.0 / M_PI) * (v + 0.044715 * v * v * v)));
    case QActivation::kGeluErf: return 0.5 * v * (1 + std::erf(v / std::sqrt(2.0)));
    case QActivation::kSilu: return v / (1 + std::exp(-v));
    default: return v;
  }
}

struct Case {
  DType dtype;
  int bits;
  int64_t groups, weight_groups, bias_groups;
  int64_t m, k, n, group_size;
  bool zeros;
  QActivation act;
  int ws_mode;  // 0: QLinearWorkspaceFloats, 1: none, 2: small (2 splits' worth)
};

// The kernel the correctness cases ask for (--gemv: kGemv).
jaxgpu::cuda::QLinearPath g_path = jaxgpu::cuda::QLinearPath::kAuto;

struct Totals {
  int cases = 0, failed = 0, gemv = 0, wgmma = 0;
  double worst_ratio = 0, worst_rel = 0;
};

void RunCase(const Case& c, std::mt19937& rng, Totals& tot, bool verbose) {
  const int64_t G = c.groups, Gw = c.weight_groups, M = c.m, K = c.k, N = c.n;
  const int64_t R = K / c.group_size, KT = jaxgpu::QTilesK(K), NT = jaxgpu::QTilesN(N);
  const int wpt = jaxgpu::QWordsPerTile(c.bits);
  const int qmax = (1 << c.bits) - 1;
  std::uniform_real_distribution<float> ux(-1.f, 1.f), us(0.5f, 1.5f);
  std::uniform_int_distribution<int> uq(0, qmax);

  std::vector<uint16_t> x(G * M * K), scales(Gw * R * N), bias(c.bias_groups * N);
  std::vector<uint8_t> q(Gw * K * N), zeros(c.zeros ? Gw * R * N : 0);
  for (auto& v : x) v = HalfBits(c.dtype, ux(rng));
  const float sbase = c.bits == 4 ? 0.1f : 0.008f;
  for (auto& v : scales) v = HalfBits(c.dtype, sbase * us(rng));
  for (auto& v : q) v = uint8_t(uq(rng));
  for (auto& v : zeros) v = uint8_t(uq(rng));
  for (auto& v : bias) v = HalfBits(c.dtype, ux(rng));

  std::vector<int32_t> packed(Gw * KT * NT * wpt, 0);
  for (int64_t gw = 0; gw < Gw; ++gw)
    for (int64_t k = 0; k < K; ++k)
      for (int64_t n = 0; n < N; ++n) {
        const auto pos = jaxgpu::QPackedAt(c.bits, int(n % 16), int(k % 64));
        const int64_t tile = (gw * KT + k / 64) * NT + n / 16;
        uint32_t& word = reinterpret_cast<uint32_t&>(packed[tile * wpt + pos.word]);
        word |= uint32_t(q[(gw * K + k) * N + n]) << pos.shift;
      }

  void *dx, *ds, *db = nullptr, *dy;
  int32_t* dp;
  uint8_t* dz = nullptr;
  float* dws = nullptr;
  CK(cudaMalloc(&dx, x.size() * 2));
  CK(cudaMalloc(&ds, scales.size() * 2));
  CK(cudaMalloc(&dp, packed.size() * 4));
  CK(cudaMalloc(&dy, G * M * N * 2));
  CK(cudaMemcpy(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(ds, scales.data(), scales.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dp, packed.data(), packed.size() * 4, cudaMemcpyHostToDevice));
  if (c.zeros) {
    CK(cudaMalloc(&dz, zeros.size()));
    CK(cudaMemcpy(dz, zeros.data(), zeros.size(), cudaMemcpyHostToDevice));
  }
  if (c.bias_groups > 0) {
    CK(cudaMalloc(&db, bias.size() * 2));
    CK(cudaMemcpy(db, bias.data(), bias.size() * 2, cudaMemcpyHostToDevice));
  }
  int64_t ws = jaxgpu::cuda::QLinearWorkspaceFloats(G, M, N);
  if (c.ws_mode == 1) ws = 0;
  if (c.ws_mode == 2) ws = std::min<int64_t>(ws, 2 * G * M * N + 5);
  if (ws > 0) CK(cudaMalloc(&dws, ws * 4));
  CK(cudaMemset(dy, 0xff, G * M * N * 2));  // NaN-ish garbage: every output must be written

  QLinearParams p{};
  p.dtype = c.dtype;
  p.bits = c.bits;
  p.groups = G;
  p.weight_groups = Gw;
  p.bias_groups = c.bias_groups;
  p.m = M;
  p.k = K;
  p.n = N;
  p.group_size = c.group_size;
  p.activation = c.act;
  p.x = dx;
  p.packed = dp;
  p.scales = ds;
  p.zeros = dz;
  p.bias = db;
  p.y = dy;
  p.workspace = dws;
  p.workspace_floats = ws;
  if (g_path == jaxgpu::cuda::QLinearPath::kGemv && jaxgpu::cuda::QLinearGemvEligible(p))
    tot.gemv++;
  if (g_path == jaxgpu::cuda::QLinearPath::kWgmma && jaxgpu::cuda::QLinearWgmmaEligible(p))
    tot.wgmma++;
  CK(jaxgpu::cuda::LaunchQLinearPath(p, 0, g_path));
  CK(cudaDeviceSynchronize());
  std::vector<uint16_t> y(G * M * N), y2(G * M * N);
  CK(cudaMemcpy(y.data(), dy, y.size() * 2, cudaMemcpyDeviceToHost));
  // Determinism: a second run must match bitwise.
  CK(cudaMemset(dy, 0, G * M * N * 2));
  CK(jaxgpu::cuda::LaunchQLinearPath(p, 0, g_path));
  CK(cudaDeviceSynchronize());
  CK(cudaMemcpy(y2.data(), dy, y2.size() * 2, cudaMemcpyDeviceToHost));
  const bool deterministic = std::memcmp(y.data(), y2.data(), y.size() * 2) == 0;

  // Reference on sampled columns (all of them for N <= 256).
  std::vector<int64_t> cols;
  if (N <= 256) {
    for (int64_t n = 0; n < N; ++n) cols.push_back(n);
  } else {
    for (int64_t n = 0; n < 16; ++n) cols.push_back(n);
    for (int64_t n = N - 16; n < N; ++n) cols.push_back(n);
    std::uniform_int_distribution<int64_t> un(0, N - 1);
    for (int i = 0; i < 96; ++i) cols.push_back(un(rng));
  }
  const int mid = 1 << (c.bits - 1);
  double worst_ratio = 0, max_err = 0, max_abs = 0;
  std::vector<double> w(K);
  for (int64_t gw = 0; gw < Gw; ++gw) {
    for (int64_t n : cols) {
      for (int64_t k = 0; k < K; ++k) {
        const int64_t r = k / c.group_size;
        const int z = c.zeros ? zeros[(gw * R + r) * N + n] : mid;
        const double s = HalfValue(c.dtype, scales[(gw * R + r) * N + n]);
        const double prod = double(int(q[(gw * K + k) * N + n]) - z) * s;  // exact
        w[k] = HalfValue(c.dtype, HalfBits(c.dtype, float(prod)));         // exact to float
      }
      for (int64_t g = 0; g < G; ++g) {
        if (Gw > 1 && g != gw) continue;
        for (int64_t m = 0; m < M; ++m) {
          double sum = 0, mag = 0;
          const uint16_t* xr = &x[(g * M + m) * K];
          for (int64_t k = 0; k < K; ++k) {
            const double xv = HalfValue(c.dtype, xr[k]);
            sum += xv * w[k];
            mag += std::fabs(xv * w[k]);
          }
          if (c.bias_groups > 0) {
            const int64_t bg = c.bias_groups == 1 ? 0 : g;
            sum += HalfValue(c.dtype, bias[bg * N + n]);
            mag += std::fabs(HalfValue(c.dtype, bias[bg * N + n]));
          }
          const double ref = ActRef(c.act, sum);
          const double got = HalfValue(c.dtype, y[(g * M + m) * N + n]);
          const double err = std::fabs(got - ref);
          const double tol = Ulp(c.dtype, ref) + 3e-5 * mag;
          const double ratio = std::isfinite(got) ? err / tol : 1e30;
          worst_ratio = std::max(worst_ratio, ratio);
          max_err = std::max(max_err, std::isfinite(got) ? err : 1e30);
          max_abs = std::max(max_abs, std::fabs(ref));
        }
      }
    }
  }
  const double rel = max_err / (max_abs > 0 ? max_abs : 1);
  const bool ok = worst_ratio <= 1.0 && deterministic;
  tot.cases++;
  if (!ok) tot.failed++;
  tot.worst_ratio = std::max(tot.worst_ratio, worst_ratio);
  tot.worst_rel = std::max(tot.worst_rel, rel);
  if (!ok || verbose) {
    std::printf(
        "%s %s int%d G=%lld Gw=%lld bg=%lld M=%lld K=%lld N=%lld gs=%lld zeros=%d act=%d ws=%lld: "
        "err/tol %.3g, max err / max|y| %.3g%s\n",
        ok ? "ok  " : "FAIL", c.dtype == DType::kBF16 ? "bf16" : "f16 ", c.bits, (long long)G,
        (long long)Gw, (long long)c.bias_groups, (long long)M, (long long)K, (long long)N,
        (long long)c.group_size, int(c.zeros), int(c.act), (long long)ws, worst_ratio, rel,
        deterministic ? "" : " NOT DETERMINISTIC");
  }
  cudaFree(dx);
  cudaFree(ds);
  cudaFree(dp);
  cudaFree(dy);
  if (dz) cudaFree(dz);
  if (db) cudaFree(db);
  if (dws) cudaFree(dws);
}

std::vector<int64_t> GroupSizes(int64_t k) {
  std::vector<int64_t> out;
  for (int64_t gs : {16, 32, 48, 64, 128}) {
    if (k % gs == 0) out.push_back(gs);
  }
  out.push_back(k);
  return out;
}

// ---- timing ----

__global__ void FillWords(uint32_t* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    p[i] = h;
  }
}

template <typename T>
__global__ void FillHalf(T* p, int64_t n, float lo, float hi, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    const float u = float(h >> 8) * (1.f / 16777216.f);
    p[i] = T(lo + (hi - lo) * u);
  }
}

// Median us of each path in `paths` on the same inputs (launches interleaved); *gbps of the
// first.
std::vector<double> TimeCase(DType dtype, int bits, int64_t K, int64_t N, int64_t M, int64_t gs,
                             bool zeros, const std::vector<jaxgpu::cuda::QLinearPath>& paths,
                             double* gbps) {
  const int64_t KT = jaxgpu::QTilesK(K), NT = jaxgpu::QTilesN(N), R = K / gs;
  const int64_t words = KT * NT * jaxgpu::QWordsPerTile(bits);
  constexpr int kBuffers = 2;
  int32_t* packed[kBuffers];
  void* scales[kBuffers];
  uint8_t* zp[kBuffers] = {nullptr, nullptr};
  for (int b = 0; b < kBuffers; ++b) {
    CK(cudaMalloc(&packed[b], words * 4));
    FillWords<<<1024, 256>>>(reinterpret_cast<uint32_t*>(packed[b]), words, 17u + b);
    CK(cudaMalloc(&scales[b], R * N * 2));
    if (dtype == DType::kBF16) {
      FillHalf<<<1024, 256>>>(static_cast<__nv_bfloat16*>(scales[b]), R * N, 0.001f, 0.01f, 5u + b);
    } else {
      FillHalf<<<1024, 256>>>(static_cast<__half*>(scales[b]), R * N, 0.001f, 0.01f, 5u + b);
    }
    if (zeros) {
      CK(cudaMalloc(&zp[b], R * N));
      FillWords<<<256, 256>>>(reinterpret_cast<uint32_t*>(zp[b]), R * N / 4, 99u + b);
    }
  }
  void *x, *y;
  CK(cudaMalloc(&x, M * K * 2));
  CK(cudaMalloc(&y, M * N * 2));
  if (dtype == DType::kBF16) {
    FillHalf<<<1024, 256>>>(static_cast<__nv_bfloat16*>(x), M * K, -1.f, 1.f, 3u);
  } else {
    FillHalf<<<1024, 256>>>(static_cast<__half*>(x), M * K, -1.f, 1.f, 3u);
  }
  if (zeros && bits == 4) {  // int4 zero points must be < 16
    std::vector<uint8_t> z(R * N);
    std::mt19937 rng(1);
    for (auto& v : z) v = uint8_t(rng() % 16);
    for (int b = 0; b < kBuffers; ++b)
      CK(cudaMemcpy(zp[b], z.data(), z.size(), cudaMemcpyHostToDevice));
  }
  const int64_t ws = jaxgpu::cuda::QLinearWorkspaceFloats(1, M, N);
  float* dws = nullptr;
  if (ws > 0) CK(cudaMalloc(&dws, ws * 4));
  CK(cudaDeviceSynchronize());

  QLinearParams p{};
  p.dtype = dtype;
  p.bits = bits;
  p.groups = 1;
  p.weight_groups = 1;
  p.bias_groups = 0;
  p.m = M;
  p.k = K;
  p.n = N;
  p.group_size = gs;
  p.activation = QActivation::kNone;
  p.x = x;
  p.y = y;
  p.workspace = dws;
  p.workspace_floats = ws;
  for (auto path : paths) {
    if (path == jaxgpu::cuda::QLinearPath::kGemv && !jaxgpu::cuda::QLinearGemvEligible(p))
      std::printf("  (not GEMV-eligible: the gemv column times the staged kernel)\n");
    if (path == jaxgpu::cuda::QLinearPath::kWgmma && !jaxgpu::cuda::QLinearWgmmaEligible(p))
      std::printf("  (not wgmma-eligible: the wgmma column times the staged kernel)\n");
  }
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<std::vector<float>> times(paths.size());
  for (int it = 0; it < 36; ++it) {
    for (size_t pi = 0; pi < paths.size(); ++pi) {
      const int b = (it + int(pi)) % kBuffers;
      p.packed = packed[b];
      p.scales = scales[b];
      p.zeros = zp[b];
      CK(cudaEventRecord(e0));
      CK(jaxgpu::cuda::LaunchQLinearPath(p, 0, paths[pi]));
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      if (it >= 6) times[pi].push_back(ms * 1000.f);
    }
  }
  std::vector<double> us(paths.size());
  for (size_t pi = 0; pi < paths.size(); ++pi) {
    std::sort(times[pi].begin(), times[pi].end());
    us[pi] = times[pi][times[pi].size() / 2];
  }
  const double bytes = double(words) * 4 + double(R * N) * 2 + (zeros ? double(R * N) : 0.0);
  *gbps = bytes / (us[0] * 1e-6) / 1e9;

  // Per call inside a compiled step: one CUDA graph of `calls` launches, each on weights of
  // its own (a pool of at least 256 MiB, past the 50 MB L2, as a model's layers are), so that
  // neither the host's launch latency nor L2 hits are in the figure.
  {
    // Three pools (weights, scales, zeros), call c's at c times each stride (256-aligned).
    const int64_t w_bytes = (words * 4 + 255) / 256 * 256;
    const int64_t s_elems = (R * N + 127) / 128 * 128, z_bytes = (R * N + 255) / 256 * 256;
    const int64_t calls = std::min<int64_t>(
        512, std::max<int64_t>(
                 8, (int64_t(256) << 20) / (w_bytes + s_elems * 2 + (zeros ? z_bytes : 0))));
    unsigned char *w_pool = nullptr, *s_pool = nullptr, *z_pool = nullptr;
    CK(cudaMalloc(&w_pool, calls * w_bytes));
    CK(cudaMalloc(&s_pool, calls * s_elems * 2));
    FillWords<<<1024, 256>>>(reinterpret_cast<uint32_t*>(w_pool), calls * w_bytes / 4, 23u);
    if (dtype == DType::kBF16) {  // scales in range
      FillHalf<<<1024, 256>>>(reinterpret_cast<__nv_bfloat16*>(s_pool), calls * s_elems, 0.001f,
                              0.01f, 7u);
    } else {
      FillHalf<<<1024, 256>>>(reinterpret_cast<__half*>(s_pool), calls * s_elems, 0.001f, 0.01f,
                              7u);
    }
    if (zeros) {  // int4 zero points < 16
      CK(cudaMalloc(&z_pool, calls * z_bytes));
      CK(cudaMemset(z_pool, 3, calls * z_bytes));
    }
    cudaStream_t stream;
    CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    for (auto path : paths) {
      cudaGraph_t graph;
      CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      for (int64_t c = 0; c < calls; ++c) {
        p.packed = reinterpret_cast<const int32_t*>(w_pool + c * w_bytes);
        p.scales = s_pool + c * s_elems * 2;
        p.zeros = zeros ? z_pool + c * z_bytes : nullptr;
        CK(jaxgpu::cuda::LaunchQLinearPath(p, stream, path));
      }
      CK(cudaStreamEndCapture(stream, &graph));
      cudaGraphExec_t exec;
      CK(cudaGraphInstantiate(&exec, graph, 0));
      us.push_back(GraphUsPerCall(exec, stream, int(calls), 5));
      CK(cudaGraphExecDestroy(exec));
      CK(cudaGraphDestroy(graph));
    }
    CK(cudaStreamDestroy(stream));
    cudaFree(w_pool);
    cudaFree(s_pool);
    if (z_pool) cudaFree(z_pool);
  }
  for (int b = 0; b < kBuffers; ++b) {
    cudaFree(packed[b]);
    cudaFree(scales[b]);
    if (zp[b]) cudaFree(zp[b]);
  }
  cudaFree(x);
  cudaFree(y);
  if (dws) cudaFree(dws);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return us;
}

}  // namespace

int main(int argc, char** argv) {
  bool do_time = true, verbose = false, do_check = true, quick = false, one = false;
  int one_bits = 4;  // --one's weights: int4, or int8 with --bits 8
  bool gemv = false, wgmma = false;
  std::vector<std::pair<int64_t, int64_t>> shapes;  // the timed weights, K x N
  std::vector<int64_t> rows;                        // --m: the timed M (--wgmma)
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--no-time") do_time = false;
    if (std::string(argv[i]) == "-v") verbose = true;
    if (std::string(argv[i]) == "--time-only") do_check = false;
    if (std::string(argv[i]) == "--quick") quick = true;
    if (std::string(argv[i]) == "--one") one = true, do_check = false;
    if (std::string(argv[i]) == "--gemv") gemv = true;
    if (std::string(argv[i]) == "--bits" && i + 1 < argc) one_bits = std::atoi(argv[++i]);
    if (std::string(argv[i]) == "--wgmma") wgmma = true;
    long long k = 0, n = 0, m = 0;
    if (std::string(argv[i]) == "--m" && i + 1 < argc && std::sscanf(argv[++i], "%lld", &m) == 1 &&
        m > 0) {
      rows.push_back(m);
    }
    if (std::string(argv[i]) == "--shape" && i + 1 < argc &&
        std::sscanf(argv[++i], "%lldx%lld", &k, &n) == 2 && k > 0 && n > 0) {
      shapes.push_back({k, n});
    }
  }
  if (shapes.empty()) shapes = {{8192, 28672}, {28672, 8192}};
  if (gemv) g_path = jaxgpu::cuda::QLinearPath::kGemv;
  if (wgmma) g_path = jaxgpu::cuda::QLinearPath::kWgmma;
  std::mt19937 rng(12345);
  Totals tot;
  const QActivation acts[] = {QActivation::kNone, QActivation::kRelu, QActivation::kGeluTanh,
                              QActivation::kGeluErf, QActivation::kSilu};
  int idx = 0;
  for (DType dt : {DType::kBF16, DType::kF16}) {
    for (int bits : {4, 8}) {
      if (!do_check) break;
      for (int64_t M : {1, 3, 17, 64, 100}) {
        for (int64_t K : {64, 96, 200, 4096}) {
          for (int64_t N : {1, 15, 33, 4096}) {
            if (M * K * N > 100 * 4096 * 33 && M > 17 && (idx % 2)) {
              ++idx;
              continue;  // keep the host reference quick: half the largest cases
            }
            const auto gss = GroupSizes(K);
            Case c{dt,
                   bits,
                   1,
                   1,
                   int64_t(idx % 3 == 0 ? 0 : 1),
                   M,
                   K,
                   N,
                   gss[idx % gss.size()],
                   (idx / 2) % 2 == 0,
                   acts[idx % 5],
                   0};
            RunCase(c, rng, tot, verbose);
            ++idx;
          }
        }
      }
      // Odd K (unaligned x rows: the synchronous copy path), batched groups, workspaces.
      for (int64_t K : {50, 100, 136}) {
        Case c{dt, bits, 1, 1, 1, 5, K, 40, K, true, acts[idx % 5], 0};
        RunCase(c, rng, tot, verbose);
        ++idx;
      }
      for (int64_t Gw : {1, 3}) {
        for (int64_t bg : {0, 1, 3}) {
          for (int64_t M : {1, 9, 40}) {
            Case c{dt, bits, 3, Gw, bg, M, 384, 72, 128, (idx % 2) == 0, acts[idx % 5], idx % 3};
            RunCase(c, rng, tot, verbose);
            ++idx;
          }
        }
      }
      // A grid of single-group cases, the group size gs_of(K) of each.
      auto grid = [&](std::initializer_list<int64_t> ms, std::initializer_list<int64_t> ks,
                      std::initializer_list<int64_t> ns, auto gs_of) {
        for (int64_t M : ms) {
          for (int64_t K : ks) {
            for (int64_t N : ns) {
              Case c{dt,
                     bits,
                     1,
                     1,
                     int64_t(idx % 3 == 1 ? 0 : 1),
                     M,
                     K,
                     N,
                     gs_of(K),
                     (idx / 2) % 2 == 0,
                     acts[idx % 5],
                     idx % 3};
              RunCase(c, rng, tot, verbose);
              ++idx;
            }
          }
        }
      };
      // Three groups (shared or per-group weights) under each workspace mode.
      auto batched = [&](int64_t M, int64_t K, int64_t N) {
        for (int64_t Gw : {1, 3}) {
          for (int ws_mode : {0, 1, 2}) {
            Case c{dt, bits, 3, Gw, 3, M, K, N, 64, (idx % 2) == 0, acts[idx % 5], ws_mode};
            RunCase(c, rng, tot, verbose);
            ++idx;
          }
        }
      };
      // The GEMV kernel's shapes: M <= 16 (one or two token tiles; int4 runs the staged
      // kernel past 8), group_size a multiple of 64 or K; K from one tile to several rounds
      // per block (ws_mode 1: no workspace, so no split), N across block edges, shared or
      // per-group weights.
      if (gemv) {
        grid({1, 2, 5, 8, 9, 13, 16}, {64, 192, 640, 4096}, {1, 17, 200, 3000}, [&](int64_t K) {
          return (idx % 3 == 0 || K % 128 != 0) ? (K % 64 == 0 && idx % 2 ? 64 : K) : 128;
        });
        batched(7, 8192 + 64, 530);
      }
      // The Hopper kernel's shapes: token chunks of 32, 64, 128 and 256 and their edges, N
      // across 128- and 256-feature blocks (16 and 144: a partial block), K from one tile to
      // many (ws_mode 1: no split), group sizes 64, 128 and K, shared and per-group weights.
      if (wgmma) {
        grid({17, 32, 33, 64, 65, 128, 129, 300}, {64, 200, 640, 4096}, {16, 144, 1024},
             [&](int64_t K) {
               return K % 128 == 0 && idx % 3 != 0 ? 128 : K % 64 == 0 && idx % 2 ? 64 : K;
             });
        batched(40, 2048 + 64, 272);
      }
      for (int ws_mode : {0, 1, 2}) {
        Case c{dt, bits, 2, 2, 2, 4, 8192, 48, 64, true, QActivation::kSilu, ws_mode};
        RunCase(c, rng, tot, verbose);
        Case c2{dt, bits, 1, 1, 1, 70, 2048, 200, 32, false, QActivation::kGeluTanh, ws_mode};
        RunCase(c2, rng, tot, verbose);
      }
    }
  }
  if (do_check)
    std::printf(
        "correctness: %d cases (%d on the GEMV kernel, %d on the Hopper kernel), %d failed; worst "
        "err/tol %.3g, worst max err / max|y| %.3g\n",
        tot.cases, tot.gemv, tot.wgmma, tot.failed, tot.worst_ratio, tot.worst_rel);
  if (!do_time) return tot.failed ? 1 : 0;

  std::printf("\ntiming (median of 30, us; weight GB/s = (packed + scales + zeros) / time)\n");
  std::printf("(graph: per call in a CUDA graph of launches on distinct weights, no L2 reuse)\n");
  if (gemv) {
    std::printf("%-44s %6s %10s %10s %10s %8s %12s %12s\n", "case", "M", "staged us", "GB/s",
                "gemv us", "speedup", "graph staged", "graph gemv");
  } else {
    std::printf("%-44s %6s %10s %10s %10s\n", "case", "M", "us", "GB/s", "graph us");
  }
  struct TC {
    const char* name;
    DType dt;
    int bits;
    int64_t gs;  // 0: per channel (K)
    bool zeros;
  };
  const TC tcs[] = {{"bf16 int4 g128 zeros", DType::kBF16, 4, 128, true},
                    {"bf16 int8 per-channel sym", DType::kBF16, 8, 0, false},
                    {"bf16 int8 g128 sym", DType::kBF16, 8, 128, false},
                    {"f16 int8 per-channel sym", DType::kF16, 8, 0, false}};
  if (wgmma) {
    // The Hopper kernel from M = 16 to 4096, the staged kernel beside it up to M = 256.
    std::printf("%-44s %6s %10s %10s %10s %8s %9s %12s %12s\n", "case", "M", "staged us",
                "wgmma us", "GB/s", "speedup", "TFLOP/s", "graph staged", "graph wgmma");
    for (auto [K, N] : shapes) {
      for (const TC& tc : tcs) {
        if (tc.dt == DType::kF16 || (quick && tc.gs == 128 && tc.bits == 8)) continue;
        if (one && tc.bits != one_bits) continue;
        if (rows.empty()) rows = {16, 64, 128, 256, 1024, 4096};
        for (int64_t M : rows) {
          if (quick && (M == 128 || M == 1024)) continue;
          const bool staged = M <= 256;
          std::vector<jaxgpu::cuda::QLinearPath> paths = {jaxgpu::cuda::QLinearPath::kWgmma};
          if (staged) paths.insert(paths.begin(), jaxgpu::cuda::QLinearPath::kStaged);
          double gbps = 0;
          const std::vector<double> us =
              TimeCase(tc.dt, tc.bits, K, N, M, tc.gs ? tc.gs : K, tc.zeros, paths, &gbps);
          const size_t w = staged ? 1 : 0, np = paths.size();
          if (staged) gbps *= us[0] / us[1];  // TimeCase's rate is the first path's
          char name[96];
          std::snprintf(name, sizeof(name), "%s K=%lld N=%lld", tc.name, (long long)K,
                        (long long)N);
          std::printf("%-44s %6lld %10.1f %10.1f %10.0f %7.2fx %9.1f %12.1f %12.1f\n", name,
                      (long long)M, staged ? us[0] : 0.0, us[w], gbps, staged ? us[0] / us[w] : 0.0,
                      2.0 * M * K * N / (us[w] * 1e-6) / 1e12, staged ? us[np] : 0.0, us[np + w]);
          std::fflush(stdout);
        }
      }
    }
    return tot.failed ? 1 : 0;
  }
  for (auto [K, N] : shapes) {
    for (const TC& tc : tcs) {
      for (int64_t M : {1, 4, 16, 64, 256}) {
        if (tc.dt == DType::kF16 && M > 16) continue;
        if (one && (K != 8192 || tc.bits != one_bits || (M != 1 && M != 16))) continue;
        if (quick && (M == 4 || M == 256 || tc.dt == DType::kF16 || tc.gs == 128 && tc.bits == 8))
          continue;
        double gbps = 0;
        const bool both = gemv && M <= 16;
        std::vector<jaxgpu::cuda::QLinearPath> paths = {jaxgpu::cuda::QLinearPath::kStaged};
        if (both) paths.push_back(jaxgpu::cuda::QLinearPath::kGemv);
        const std::vector<double> us =
            TimeCase(tc.dt, tc.bits, K, N, M, tc.gs ? tc.gs : K, tc.zeros, paths, &gbps);
        char name[96];
        std::snprintf(name, sizeof(name), "%s K=%lld N=%lld", tc.name, (long long)K, (long long)N);
        if (both) {
          std::printf("%-44s %6lld %10.1f %10.0f %10.1f %7.2fx %12.1f %12.1f\n", name, (long long)M,
                      us[0], gbps, us[1], us[0] / us[1], us[2], us[3]);
        } else {
          std::printf("%-44s %6lld %10.1f %10.0f %10.1f\n", name, (long long)M, us[0], gbps, us[1]);
        }
        std::fflush(stdout);
      }
    }
  }
  return tot.failed ? 1 : 0;
}
