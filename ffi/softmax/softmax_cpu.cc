// Straightforward CPU softmax: each row converted to float32 once, the logits x * scale
// rounded to float32 as the reference forms them, exp in float32, the row sum and the
// backward pass's sum(dy * y) accumulated in float64 (order-independent to far below the
// storage rounding), results rounded once to the storage type.
#include "softmax/softmax_cpu.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/cpu_float.h"

namespace jaxgpu::cpu {
namespace {

// Offset of row `row`'s mask row (see softmax_params.h).
int64_t MaskRowOffset(const SoftmaxFwdParams& p, int64_t row) {
  int64_t off = 0;
  for (int k = p.ndims - 1; k >= 0; --k) {
    const int64_t d = p.dims[k];
    off += (row % d) * p.mask_strides[k];
    row /= d;
  }
  return off;
}

}  // namespace

void SoftmaxFwd(const SoftmaxFwdParams& p) {
  const int64_t S = p.cols;
  if (p.rows == 0 || S == 0) return;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  std::vector<float> v(S), y(S);
  std::vector<unsigned char> keep(S, 1);
  for (int64_t row = 0; row < p.rows; ++row) {
    const int64_t base = row * S;
    LoadFloats(p.x, p.dtype, base, S, v.data());
    for (int64_t j = 0; j < S; ++j) v[j] *= p.scale;
    if (p.mask) {
      const uint8_t* m = p.mask + MaskRowOffset(p, row);
      for (int64_t j = 0; j < S; ++j) keep[j] = m[j * p.mask_col_stride] != 0;
    }
    // Causal, top-left aligned: query i keeps keys j <= i (every key once i >= S - 1).
    const int64_t last = p.causal ? row % p.query_len : S - 1;
    float mx = kNegInf;
    for (int64_t j = 0; j < S; ++j) {
      if (keep[j] && j <= last && v[j] > mx) mx = v[j];
    }
    // Nothing kept (or every kept logit -inf): exp(-inf - 0) = 0, so the row is zeros.
    const float m = mx == kNegInf ? 0.f : mx;
    double sum = 0.0;
    for (int64_t j = 0; j < S; ++j) {
      y[j] = (keep[j] && j <= last) ? std::exp(v[j] - m) : 0.f;
      sum += y[j];
    }
    // A kept NaN or +inf logit makes the sum NaN and with it the whole row, as in XLA.
    const double inv = sum == 0 ? 0.0 : 1.0 / sum;
    for (int64_t j = 0; j < S; ++j) y[j] = static_cast<float>(double(y[j]) * inv);
    StoreFloats(p.y, p.dtype, base, S, y.data());
  }
}

void SoftmaxBwd(const SoftmaxBwdParams& p) {
  const int64_t S = p.cols;
  if (p.rows == 0 || S == 0) return;
  std::vector<float> y(S), dy(S), dx(S);
  for (int64_t row = 0; row < p.rows; ++row) {
    const int64_t base = row * S;
    LoadFloats(p.y, p.dtype, base, S, y.data());
    LoadFloats(p.dy, p.dtype, base, S, dy.data());
    // Masked and fully masked positions hold y = 0, so their gradient is 0; past the causal
    // limit y and dy are not even read (as on CUDA).
    const int64_t n = p.causal ? std::min(S, row % p.query_len + 1) : S;
    double dot = 0.0;
    for (int64_t j = 0; j < n; ++j) dot += double(dy[j]) * double(y[j]);
    for (int64_t j = 0; j < S; ++j) {
      dx[j] =
          j < n ? static_cast<float>(double(p.scale) * double(y[j]) * (double(dy[j]) - dot)) : 0.f;
    }
    StoreFloats(p.dx, p.dtype, base, S, dx.data());
  }
}

}  // namespace jaxgpu::cpu
