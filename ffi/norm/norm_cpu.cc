// Straightforward CPU normalization: statistics accumulated in float64 (a sequential
// float32 sum over a 65536-wide row was ~100 ulps off, past the reference's error) and
// two-pass (exact centering for layer norm), output rounded once to the storage type. Weight/bias
// gradients are summed over rows in float64 in row order, so they are deterministic and
// their rounding error does not grow with the number of rows. Rows are converted to
// float32 once (one dtype switch per row), then processed by plain float loops. Weight and
// bias are read in their own dtype (x's, or float32 master weights) and the gradients are
// written in float32 in both cases.
#include "norm/norm_cpu.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/cpu_float.h"

namespace jaxgpu::cpu {
namespace {

// (offset + weight) as float32, or ones without a weight.
void ScaleRow(const void* weight, DType t, int64_t at, int64_t D, float offset, float* out) {
  if (weight == nullptr) {
    std::fill(out, out + D, 1.f);
    return;
  }
  LoadFloats(weight, t, at, D, out);
  for (int64_t i = 0; i < D; ++i) out[i] += offset;
}

}  // namespace

void NormFwd(const NormFwdParams& p) {
  const int64_t D = p.dim;
  std::vector<float> h(D), r(D), w(D), b(D), y(D);
  for (int64_t g = 0; g < p.groups; ++g) {
    ScaleRow(p.weight, p.param_dtype, g * p.weight_group_stride, D, p.weight_offset, w.data());
    if (p.bias) LoadFloats(p.bias, p.param_dtype, g * p.bias_group_stride, D, b.data());
    for (int64_t row = g * p.rows_per_group; row < (g + 1) * p.rows_per_group; ++row) {
      const int64_t base = row * D;
      LoadFloats(p.x, p.dtype, base, D, h.data());
      if (p.residual) {
        // h is rounded to the storage type before it is normalized, exactly as the
        // reference computes (x + residual) in the input dtype.
        LoadFloats(p.residual, p.dtype, base, D, r.data());
        for (int64_t i = 0; i < D; ++i) h[i] = RoundTrip(h[i] + r[i], p.dtype);
        StoreFloats(p.h, p.dtype, base, D, h.data());
      }
      float mean = 0.f;
      if (p.kind == NormKind::kLayer) {
        double s = 0.0;
        for (int64_t i = 0; i < D; ++i) s += h[i];
        mean = float(s / double(D));
      }
      double ss = 0.0;
      for (int64_t i = 0; i < D; ++i) ss += double(h[i] - mean) * double(h[i] - mean);
      const float rstd = float(1.0 / std::sqrt(ss / double(D) + double(p.eps)));
      if (p.mean) p.mean[row] = mean;
      p.rstd[row] = rstd;
      for (int64_t i = 0; i < D; ++i) y[i] = (h[i] - mean) * rstd * w[i] + (p.bias ? b[i] : 0.f);
      StoreFloats(p.y, p.dtype, base, D, y.data());
    }
  }
}

void NormBwd(const NormBwdParams& p) {
  const int64_t D = p.dim;
  std::vector<float> dy(D), xhat(D), w(D), dx(D), dh(D);
  std::vector<double> dw(p.dweight ? D : 0), db(p.dbias ? D : 0);
  for (int64_t g = 0; g < p.groups; ++g) {
    ScaleRow(p.weight, p.param_dtype, g * p.weight_group_stride, D, p.weight_offset, w.data());
    std::fill(dw.begin(), dw.end(), 0.0);
    std::fill(db.begin(), db.end(), 0.0);
    for (int64_t row = g * p.rows_per_group; row < (g + 1) * p.rows_per_group; ++row) {
      const int64_t base = row * D;
      const float mean = p.kind == NormKind::kLayer ? p.mean[row] : 0.f;
      const float rstd = p.rstd[row];
      LoadFloats(p.dy, p.dtype, base, D, dy.data());
      LoadFloats(p.xh, p.dtype, base, D, xhat.data());
      // dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * (offset + weight);
      // the mean(g) term is layer norm's only.
      double sum_g = 0.0, sum_g_xhat = 0.0;
      for (int64_t i = 0; i < D; ++i) {
        xhat[i] = (xhat[i] - mean) * rstd;
        sum_g += dy[i] * w[i];
        sum_g_xhat += double(dy[i] * w[i]) * double(xhat[i]);
      }
      for (int64_t i = 0; i < (p.dweight ? D : 0); ++i) dw[i] += double(dy[i]) * double(xhat[i]);
      for (int64_t i = 0; i < (p.dbias ? D : 0); ++i) db[i] += double(dy[i]);
      const float mean_g = p.kind == NormKind::kLayer ? float(sum_g / double(D)) : 0.f;
      const float mean_g_xhat = float(sum_g_xhat / double(D));
      for (int64_t i = 0; i < D; ++i)
        dx[i] = rstd * (dy[i] * w[i] - mean_g - xhat[i] * mean_g_xhat);
      if (p.dh) {
        LoadFloats(p.dh, p.dtype, base, D, dh.data());
        for (int64_t i = 0; i < D; ++i) dx[i] += dh[i];
      }
      StoreFloats(p.dx, p.dtype, base, D, dx.data());
    }
    for (int64_t i = 0; i < (p.dweight ? D : 0); ++i) p.dweight[g * D + i] = float(dw[i]);
    for (int64_t i = 0; i < (p.dbias ? D : 0); ++i) p.dbias[g * D + i] = float(db[i]);
  }
}

}  // namespace jaxgpu::cpu
