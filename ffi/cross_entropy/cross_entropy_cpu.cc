// Straightforward CPU cross-entropy: each row converted to float32 once (one dtype switch
// per row), then the softcap, the log-sum-exp and the gradient computed in float64, so
// the CPU result is a float64-accurate oracle of the float32 formulas (rounded once to
// the output's type). Rows are independent; their order is fixed (deterministic).
#include "cross_entropy/cross_entropy_cpu.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/cpu_float.h"

namespace jaxgpu::cpu {
namespace {

// The row's label, or -1 when the row is ignored or its label is out of range (its loss is
// then 0 or NaN, and its gradient 0; its logits are never read).
int64_t ActiveLabel(int32_t label, int64_t vocab, bool has_ignore, int32_t ignore_index,
                    bool* ignored) {
  *ignored = has_ignore && label == ignore_index;
  if (*ignored || label < 0 || label >= vocab) return -1;
  return label;
}

// z = c * tanh(x / c) (Gemma 2's logit softcap) or x, in float64; t = tanh(x / c).
void CapRow(const float* x, int64_t n, double cap, double* z, double* t) {
  if (cap > 0) {
    for (int64_t i = 0; i < n; ++i) {
      t[i] = std::tanh(double(x[i]) / cap);
      z[i] = cap * t[i];
    }
  } else {
    for (int64_t i = 0; i < n; ++i) z[i] = x[i];
  }
}

}  // namespace

void CrossEntropyFwd(const CrossEntropyFwdParams& p) {
  const int64_t V = p.vocab;
  std::vector<float> x(V);
  std::vector<double> z(V), t(p.softcap > 0 ? V : 0);
  const double ls = p.label_smoothing;
  for (int64_t row = 0; row < p.rows; ++row) {
    bool ignored;
    const int64_t label = ActiveLabel(p.labels[row], V, p.has_ignore, p.ignore_index, &ignored);
    if (label < 0) {
      p.loss[row] = ignored ? 0.f : std::numeric_limits<float>::quiet_NaN();
      p.lse[row] = 0.f;
      continue;
    }
    LoadFloats(p.logits, p.dtype, row * V, V, x.data());
    CapRow(x.data(), V, p.softcap, z.data(), t.data());
    double m = -std::numeric_limits<double>::infinity(), sum_z = 0.0;
    for (int64_t i = 0; i < V; ++i) {
      m = std::max(m, z[i]);
      sum_z += z[i];
    }
    double s = 0.0;
    for (int64_t i = 0; i < V; ++i) s += std::exp(z[i] - m);
    // m = -inf (a row of -inf logits) or +inf: lse is -inf, +inf or NaN, as in the
    // reference; NaN logits make everything NaN.
    const double lse =
        std::isinf(m) ? (m > 0 ? m : -std::numeric_limits<double>::infinity()) : m + std::log(s);
    const double loss = lse - (1.0 - ls) * z[label] - (ls > 0 ? ls * sum_z / double(V) : 0.0);
    p.loss[row] = float(loss);
    p.lse[row] = float(lse);
  }
}

void CrossEntropyBwd(const CrossEntropyBwdParams& p) {
  const int64_t V = p.vocab;
  std::vector<float> x(V), d(V);
  std::vector<double> z(V), t(p.softcap > 0 ? V : 0);
  const double ls = p.label_smoothing;
  for (int64_t row = 0; row < p.rows; ++row) {
    bool ignored;
    const int64_t label = ActiveLabel(p.labels[row], V, p.has_ignore, p.ignore_index, &ignored);
    if (label < 0) {
      std::fill(d.begin(), d.end(), 0.f);
      StoreFloats(p.dlogits, p.dtype, row * V, V, d.data());
      continue;
    }
    LoadFloats(p.logits, p.dtype, row * V, V, x.data());
    CapRow(x.data(), V, p.softcap, z.data(), t.data());
    const double g = p.dloss[row], lse = p.lse[row];
    const double smooth = g * ls / double(V);
    for (int64_t i = 0; i < V; ++i) {
      double di = g * std::exp(z[i] - lse) - smooth;
      if (i == label) di -= g * (1.0 - ls);
      if (p.softcap > 0) di *= 1.0 - t[i] * t[i];
      d[i] = float(di);
    }
    StoreFloats(p.dlogits, p.dtype, row * V, V, d.data());
  }
}

}  // namespace jaxgpu::cpu
