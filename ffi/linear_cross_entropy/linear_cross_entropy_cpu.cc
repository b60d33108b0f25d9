// Straightforward CPU fused linear + cross-entropy: each logit is a float64 dot product of
// x's row and w's vocabulary row (both converted to float32 once per group) rounded to x's
// dtype, then the softcap, the online log-sum-exp and the gradient in float64, so the CPU result is a
// float64-accurate oracle of the formulas (rounded once to each output's type). No
// (rows, vocab) array exists: the backward pass recomputes each logit. The order of every
// sum is fixed (deterministic).
#include "linear_cross_entropy/linear_cross_entropy_cpu.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/cpu_float.h"

namespace jaxgpu::cpu {
namespace {

// x of group g as float32 (rows, dim), and w of group g as float32 (vocab, dim) whatever its
// layout, so that every logit is a dot product of two contiguous rows.
void LoadGroup(const LinearCrossEntropyShape& s, const void* x, const void* w, int64_t g,
               std::vector<float>* xf, std::vector<float>* wf) {
  const int64_t R = s.rows, D = s.dim, V = s.vocab;
  xf->resize(R * D);
  LoadFloats(x, s.dtype, g * R * D, R * D, xf->data());
  const int64_t wg = s.weight_groups > 1 ? g : 0;
  wf->resize(V * D);
  if (s.layout == WeightLayout::kVD) {
    LoadFloats(w, s.dtype, wg * V * D, V * D, wf->data());
  } else {
    std::vector<float> dv(D * V);
    LoadFloats(w, s.dtype, wg * D * V, D * V, dv.data());
    for (int64_t d = 0; d < D; ++d)
      for (int64_t v = 0; v < V; ++v) (*wf)[v * D + d] = dv[d * V + v];
  }
}

double Dot(const float* a, const float* b, int64_t n) {
  double acc = 0.0;
  for (int64_t i = 0; i < n; ++i) acc += double(a[i]) * double(b[i]);
  return acc;
}

// A logit as the op defines it: the product rounded once to x's dtype (as the CUDA path's
// cuBLASLt product and XLA's x @ w.T are).
double Rounded(double l, DType t) {
  float f = float(l);
  if (t == DType::kBF16) f = Bf16ToFloat(FloatToBf16(f));
  if (t == DType::kF16) f = F16ToFloat(FloatToF16(f));
  return f;
}

// z and dz/dlogit for a logit l.
void Cap(double l, double cap, double* z, double* dz) {
  if (cap > 0) {
    const double t = std::tanh(l / cap);
    *z = cap * t;
    *dz = 1.0 - t * t;
  } else {
    *z = l;
    *dz = 1.0;
  }
}

}  // namespace

void LinearCrossEntropyFwd(const LinearCrossEntropyFwdParams& p) {
  const LinearCrossEntropyShape& s = p.s;
  const int64_t R = s.rows, D = s.dim, V = s.vocab;
  const int64_t offset = V > 0 ? *p.vocab_offset : 0;
  std::vector<float> xf, wf;
  std::vector<double> z(V);
  for (int64_t g = 0; g < s.groups; ++g) {
    LoadGroup(s, p.x, p.w, g, &xf, &wf);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t i = g * R + r;
      double m = -std::numeric_limits<double>::infinity(), sum_z = 0.0, z_label = 0.0, dz;
      const int64_t label = int64_t(p.labels[i]) - offset;
      for (int64_t v = 0; v < V; ++v) {
        Cap(Rounded(Dot(&xf[r * D], &wf[v * D], D), s.dtype), p.softcap, &z[v], &dz);
        m = std::max(m, z[v]);
        sum_z += z[v];
        if (v == label) z_label = z[v];
      }
      double sum = 0.0;
      for (int64_t v = 0; v < V; ++v) sum += std::exp(z[v] - m);
      p.lse[i] = V > 0 ? float(m + std::log(sum)) : -std::numeric_limits<float>::infinity();
      p.zlabel[i] = float(z_label);
      p.zsum[i] = float(sum_z);
    }
  }
}

void LinearCrossEntropyBwd(const LinearCrossEntropyBwdParams& p) {
  const LinearCrossEntropyShape& s = p.s;
  const int64_t R = s.rows, D = s.dim, V = s.vocab;
  const int64_t offset = V > 0 ? *p.vocab_offset : 0;
  const double ls = p.label_smoothing, uniform = ls / double(p.vocab_total);
  std::vector<float> xf, wf;
  std::vector<double> dx(D), dw;
  std::vector<float> out;
  for (int64_t g = 0; g < s.groups; ++g) {
    LoadGroup(s, p.x, p.w, g, &xf, &wf);
    dw.assign(V * D, 0.0);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t i = g * R + r;
      std::fill(dx.begin(), dx.end(), 0.0);
      const double dloss = p.dloss[i];
      if (dloss != 0.0) {
        const int64_t label = int64_t(p.labels[i]) - offset;
        const float* xr = &xf[r * D];
        for (int64_t v = 0; v < V; ++v) {
          double z, dz;
          Cap(Rounded(Dot(xr, &wf[v * D], D), s.dtype), p.softcap, &z, &dz);
          const double target = (v == label ? 1.0 - ls : 0.0) + uniform;
          const double dl = dloss * (std::exp(z - double(p.lse[i])) - target) * dz;
          const float* wv = &wf[v * D];
          double* dwv = &dw[v * D];
          for (int64_t d = 0; d < D; ++d) {
            dx[d] += dl * wv[d];
            dwv[d] += dl * xr[d];
          }
        }
      }
      for (int64_t d = 0; d < D; ++d) p.dx[i * D + d] = float(dx[d]);
    }
    // dw of this group in w's layout and dtype.
    out.resize(V * D);
    for (int64_t v = 0; v < V; ++v)
      for (int64_t d = 0; d < D; ++d) {
        const int64_t at = s.layout == WeightLayout::kVD ? v * D + d : d * V + v;
        out[at] = float(dw[v * D + d]);
      }
    StoreFloats(p.dw, s.dtype, g * V * D, V * D, out.data());
  }
}

}  // namespace jaxgpu::cpu
