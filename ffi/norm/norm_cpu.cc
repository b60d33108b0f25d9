// Straightforward CPU normalization: float32 statistics (two-pass over the row, exact
// centering for layer norm), output rounded once to the storage type. Weight/bias
// gradients are summed over rows in float64 in row order, so they are deterministic and
// their rounding error does not grow with the number of rows.
#include "norm/norm_cpu.h"

#include <cmath>
#include <vector>

#include "common/cpu_float.h"

namespace jaxgpu::cpu {

void NormFwd(const NormFwdParams& p) {
  const int64_t D = p.dim;
  std::vector<float> row(D);
  for (int64_t g = 0; g < p.groups; ++g) {
    for (int64_t r = 0; r < p.rows_per_group; ++r) {
      const int64_t row_index = g * p.rows_per_group + r;
      const int64_t base = row_index * D;
      for (int64_t i = 0; i < D; ++i) {
        float v = LoadAsFloat(p.x, p.dtype, base + i);
        if (p.residual) {
          // h is rounded to the storage type before it is normalized, exactly as the
          // reference computes (x + residual) in the input dtype.
          v = RoundTrip(v + LoadAsFloat(p.residual, p.dtype, base + i), p.dtype);
          StoreFromFloat(p.h, p.dtype, base + i, v);
        }
        row[i] = v;
      }
      float mean = 0.f;
      if (p.kind == NormKind::kLayer) {
        float s = 0.f;
        for (int64_t i = 0; i < D; ++i) s += row[i];
        mean = s / float(D);
      }
      float ss = 0.f;
      for (int64_t i = 0; i < D; ++i) {
        const float c = row[i] - mean;
        ss += c * c;
      }
      const float rstd = 1.f / std::sqrt(ss / float(D) + p.eps);
      if (p.mean) p.mean[row_index] = mean;
      p.rstd[row_index] = rstd;
      for (int64_t i = 0; i < D; ++i) {
        float v = (row[i] - mean) * rstd;
        if (p.weight) v *= p.weight_offset + LoadAsFloat(p.weight, p.dtype, g * p.weight_group_stride + i);
        if (p.bias) v += LoadAsFloat(p.bias, p.dtype, g * p.bias_group_stride + i);
        StoreFromFloat(p.y, p.dtype, base + i, v);
      }
    }
  }
}

void NormBwd(const NormBwdParams& p) {
  const int64_t D = p.dim;
  std::vector<float> xhat(D), g_xhat(D);
  std::vector<double> dw(p.dweight ? D : 0), db(p.dbias ? D : 0);
  for (int64_t g = 0; g < p.groups; ++g) {
    std::fill(dw.begin(), dw.end(), 0.0);
    std::fill(db.begin(), db.end(), 0.0);
    for (int64_t r = 0; r < p.rows_per_group; ++r) {
      const int64_t row_index = g * p.rows_per_group + r;
      const int64_t base = row_index * D;
      const float mean = p.kind == NormKind::kLayer ? p.mean[row_index] : 0.f;
      const float rstd = p.rstd[row_index];
      // dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * (offset + weight);
      // the mean(g) term is layer norm's only.
      float sum_g = 0.f, sum_g_xhat = 0.f;
      for (int64_t i = 0; i < D; ++i) {
        const float xh = (LoadAsFloat(p.xh, p.dtype, base + i) - mean) * rstd;
        const float dy = LoadAsFloat(p.dy, p.dtype, base + i);
        float gi = dy;
        if (p.weight) gi *= p.weight_offset + LoadAsFloat(p.weight, p.dtype, g * p.weight_group_stride + i);
        xhat[i] = xh;
        g_xhat[i] = gi;
        sum_g += gi;
        sum_g_xhat += gi * xh;
        if (p.dweight) dw[i] += double(dy) * double(xh);
        if (p.dbias) db[i] += double(dy);
      }
      const float mean_g = p.kind == NormKind::kLayer ? sum_g / float(D) : 0.f;
      const float mean_g_xhat = sum_g_xhat / float(D);
      for (int64_t i = 0; i < D; ++i) {
        float dx = rstd * (g_xhat[i] - mean_g - xhat[i] * mean_g_xhat);
        if (p.dh) dx += LoadAsFloat(p.dh, p.dtype, base + i);
        StoreFromFloat(p.dx, p.dtype, base + i, dx);
      }
    }
    for (int64_t i = 0; i < (p.dweight ? D : 0); ++i) p.dweight[g * D + i] = float(dw[i]);
    for (int64_t i = 0; i < (p.dbias ? D : 0); ++i) p.dbias[g * D + i] = float(db[i]);
  }
}

}  // namespace jaxgpu::cpu
