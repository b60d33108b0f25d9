// Straightforward CPU matmuls: each output a float64 sum over k in k order, the epilogue in
// float64, then one rounding to the output's type (a float64-accurate oracle of the float32
// formulas, as the other families' CPU kernels). The weight is converted to float once per
// weight group; a quantized weight is dequantized once per group exactly as
// qlinear_params.h says (q - z and its product with a 16-bit scale are exact in float, so
// rounding the product to T is the one rounding the GPU's half-precision multiply makes).
#include "matmul/matmul_cpu.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "activation/activation_math.h"
#include "common/cpu_float.h"

namespace jaxgpu::cpu {
namespace {

// Loads rows x rows_len elements starting at `at` into floats.
std::vector<float> LoadMatrix(const void* p, DType t, int64_t at, int64_t count) {
  std::vector<float> out(static_cast<size_t>(count));
  if (count > 0) LoadFloats(p, t, at, count, out.data());
  return out;
}

float ApplyActivation(QActivation act, double z) {
  const float f = static_cast<float>(z);
  switch (act) {
    case QActivation::kNone: return f;
    case QActivation::kRelu: return act::Relu::F(f);
    case QActivation::kGeluTanh: return act::GeluTanh::F(f);
    case QActivation::kGeluErf: return act::GeluErf::F(f);
    case QActivation::kSilu: return act::Silu::F(f);
  }
  return f;
}

QActivation FromEpilogue(LinearEpilogue e) {
  switch (e) {
    case LinearEpilogue::kRelu: return QActivation::kRelu;
    case LinearEpilogue::kGeluTanh: return QActivation::kGeluTanh;
    default: return QActivation::kNone;
  }
}

// y[g] = act(x[g] w + bias) for one group, w (K, N) as floats; z rounded to T into aux.
void GemmRows(DType t, const void* x, int64_t x_at, const std::vector<float>& w,
              const std::vector<float>& bias, int64_t m, int64_t k, int64_t n, QActivation act,
              void* y, void* aux, int64_t y_at) {
  std::vector<float> xrow(static_cast<size_t>(k)), out(static_cast<size_t>(n));
  std::vector<double> acc(static_cast<size_t>(n));
  for (int64_t r = 0; r < m; ++r) {
    if (k > 0) LoadFloats(x, t, x_at + r * k, k, xrow.data());
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int64_t kk = 0; kk < k; ++kk) {
      const double xv = xrow[kk];
      const float* wrow = w.data() + kk * n;
      for (int64_t c = 0; c < n; ++c) acc[c] += xv * double(wrow[c]);
    }
    if (!bias.empty()) {
      for (int64_t c = 0; c < n; ++c) acc[c] += double(bias[c]);
    }
    if (aux != nullptr) {
      for (int64_t c = 0; c < n; ++c) out[c] = static_cast<float>(acc[c]);
      StoreFloats(aux, t, y_at + r * n, n, out.data());
    }
    for (int64_t c = 0; c < n; ++c) out[c] = ApplyActivation(act, acc[c]);
    StoreFloats(y, t, y_at + r * n, n, out.data());
  }
}

}  // namespace

void LinearFwd(const LinearFwdParams& p) {
  const int64_t M = p.m, K = p.k, N = p.n;
  std::vector<float> w, bias;
  for (int64_t g = 0; g < p.groups; ++g) {
    if (g == 0 || p.weight_groups > 1) w = LoadMatrix(p.w, p.dtype, g * K * N, K * N);
    if (p.bias_groups > 0 && (g == 0 || p.bias_groups > 1)) {
      bias = LoadMatrix(p.bias, p.dtype, (p.bias_groups > 1 ? g : 0) * N, N);
    }
    GemmRows(p.dtype, p.x, g * M * K, w, bias, M, K, N, FromEpilogue(p.epilogue), p.y, p.aux,
             g * M * N);
  }
}

void LinearDgrad(const LinearDgradParams& p) {
  const int64_t M = p.m, K = p.k, N = p.n;
  std::vector<float> w, dzrow(static_cast<size_t>(N)), out(static_cast<size_t>(K));
  for (int64_t g = 0; g < p.groups; ++g) {
    if (g == 0 || p.weight_groups > 1) w = LoadMatrix(p.w, p.dtype, g * K * N, K * N);
    for (int64_t r = 0; r < M; ++r) {
      if (N > 0) LoadFloats(p.dz, p.dtype, (g * M + r) * N, N, dzrow.data());
      for (int64_t kk = 0; kk < K; ++kk) {
        const float* wrow = w.data() + kk * N;
        double acc = 0;
        for (int64_t c = 0; c < N; ++c) acc += double(dzrow[c]) * double(wrow[c]);
        out[kk] = static_cast<float>(acc);
      }
      StoreFloats(p.dx, p.dtype, (g * M + r) * K, K, out.data());
    }
  }
}

void LinearWgrad(const LinearWgradParams& p) {
  const int64_t M = p.m, K = p.k, N = p.n;
  std::vector<float> xrow(static_cast<size_t>(K)), dzrow(static_cast<size_t>(N)),
      out(static_cast<size_t>(N));
  std::vector<double> acc(static_cast<size_t>(K * N)), dbias(static_cast<size_t>(N));
  for (int64_t g = 0; g < p.groups; ++g) {
    std::fill(acc.begin(), acc.end(), 0.0);
    std::fill(dbias.begin(), dbias.end(), 0.0);
    for (int64_t r = 0; r < M; ++r) {
      if (K > 0) LoadFloats(p.x, p.dtype, (g * M + r) * K, K, xrow.data());
      if (N > 0) LoadFloats(p.dz, p.dtype, (g * M + r) * N, N, dzrow.data());
      for (int64_t kk = 0; kk < K; ++kk) {
        const double xv = xrow[kk];
        double* arow = acc.data() + kk * N;
        for (int64_t c = 0; c < N; ++c) arow[c] += xv * double(dzrow[c]);
      }
      for (int64_t c = 0; c < N; ++c) dbias[c] += double(dzrow[c]);
    }
    for (int64_t kk = 0; kk < K; ++kk) {
      for (int64_t c = 0; c < N; ++c) out[c] = static_cast<float>(acc[kk * N + c]);
      StoreFloats(p.dw, p.dtype, (g * K + kk) * N, N, out.data());
    }
    if (p.dbias != nullptr) {
      for (int64_t c = 0; c < N; ++c) out[c] = static_cast<float>(dbias[c]);
      StoreFloats(p.dbias, p.dtype, g * N, N, out.data());
    }
  }
}

// The dense (K, N) weight of weight group `wg` as floats, each rounded to `t` once.
static void DequantizeGroup(DType t, int bits, int64_t K, int64_t N, int64_t group_size,
                            const int32_t* packed_all, const void* scales_all,
                            const uint8_t* zeros_all, int64_t wg, std::vector<float>& w) {
  const int64_t KT = QTilesK(K), NT = QTilesN(N), words = QWordsPerTile(bits);
  const int64_t scale_rows = K / group_size;
  const uint32_t mask = (1u << bits) - 1u;
  const int64_t midpoint = int64_t(1) << (bits - 1);
  const std::vector<float> scales = LoadMatrix(scales_all, t, wg * scale_rows * N, scale_rows * N);
  const int32_t* packed = packed_all + wg * KT * NT * words;
  const uint8_t* zeros = zeros_all != nullptr ? zeros_all + wg * scale_rows * N : nullptr;
  w.assign(static_cast<size_t>(K * N), 0.f);
  for (int64_t kk = 0; kk < K; ++kk) {
    const int64_t srow = std::min(kk / group_size, scale_rows - 1);
    for (int64_t c = 0; c < N; ++c) {
      const QPackedPosition at = QPackedAt(bits, int(c % kQTileN), int(kk % kQTileK));
      const int32_t* tile = packed + ((kk / kQTileK) * NT + c / kQTileN) * words;
      const int64_t q = (static_cast<uint32_t>(tile[at.word]) >> at.shift) & mask;
      const int64_t z = zeros != nullptr ? zeros[srow * N + c] : midpoint;
      w[kk * N + c] = RoundTrip(float(q - z) * scales[srow * N + c], t);
    }
  }
}

void QLinearFwd(const QLinearParams& p) {
  const int64_t M = p.m, K = p.k, N = p.n;
  std::vector<float> w, bias;
  for (int64_t g = 0; g < p.groups; ++g) {
    if (g == 0 || p.weight_groups > 1) {
      DequantizeGroup(p.dtype, p.bits, K, N, p.group_size, p.packed, p.scales, p.zeros,
                      p.weight_groups > 1 ? g : 0, w);
    }
    if (p.bias_groups > 0 && (g == 0 || p.bias_groups > 1)) {
      bias = LoadMatrix(p.bias, p.dtype, (p.bias_groups > 1 ? g : 0) * N, N);
    }
    GemmRows(p.dtype, p.x, g * M * K, w, bias, M, K, N, p.activation, p.y, nullptr, g * M * N);
  }
}

void QDequant(const QDequantParams& p) {
  std::vector<float> w;
  for (int64_t g = 0; g < p.groups; ++g) {
    DequantizeGroup(p.dtype, p.bits, p.k, p.n, p.group_size, p.packed, p.scales, p.zeros, g, w);
    if (!w.empty()) StoreFloats(p.w, p.dtype, g * p.k * p.n, p.k * p.n, w.data());
  }
}

}  // namespace jaxgpu::cpu
