// Straightforward CPU attention (CI and CPU users; the test oracle's twin, not a fast path).
//
// Per (batch, kv head): that head's K and V converted to float32 once (S x H each), then
// one query row at a time, two passes over its visible keys: the logits into one row
// buffer (S values) and their max; then exp, the row sum and the output row. No T x S
// buffer exists. Dot products, sums and the output row are accumulated in float64 (scalar
// loops cost the same in either type here, and the result is then a float64-accurate
// oracle of the float32 formulas), rounded once to the storage type.
//
// Backward: per (batch, kv head), float64 accumulators for dK and dV (S x H) collect the
// contributions of all T x R query rows of the head (GQA: a kv head's gradient is summed
// over its R query heads) in a fixed order, so results are deterministic. Per row:
//   delta = rowsum(do * o)                         (written to the delta workspace)
//   p_j   = exp(l_j - lse)      for visible keys, else 0 (never read)
//   dp_j  = do . v_j
//   ds_j  = p_j (dp_j - delta)  times (1 - (l_j / c)^2) with a softcap c (tanh')
//   dq   += ds_j k_j,  dk_j += ds_j q,  dv_j += p_j do;  dq, dk scaled by `scale` at the end.
// A row with no visible key has o = 0, lse = -inf and zero gradients.
// Bias, mask and lengths (attention_params.h): the bias is added after the softcap, so
// dbias = p_j (dp_j - delta) (before the softcap's slope), added into the float32 dbias
// in the same fixed order (deterministic, also where the bias is broadcast). Rows past
// the query length are skipped (zeros), and keys past the key length end the key range.
#include "attention/attention_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common/cpu_float.h"

namespace jaxgpu::cpu {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

struct Dims {
  int64_t B, T, S, K, R, H;
  explicit Dims(const AttentionParams& p)
      : B(p.batch), T(p.q_len), S(p.kv_len), K(p.kv_heads), R(p.group), H(p.head_dim) {}
  // Element offsets of a row of H features in each layout (attention_params.h).
  int64_t QRow(int64_t b, int64_t i, int64_t kh, int64_t r) const {
    return (((b * T + i) * K + kh) * R + r) * H;
  }
  int64_t KvRow(int64_t b, int64_t j, int64_t kh) const { return ((b * S + j) * K + kh) * H; }
  int64_t Stat(int64_t b, int64_t kh, int64_t r, int64_t i) const {
    return ((b * K + kh) * R + r) * T + i;
  }
};

// Keys [lo, hi] that the causal and window masks leave to query i (empty when lo > hi);
// segment ids are checked per key.
void VisibleRange(const AttentionParams& p, int64_t i, int64_t* lo, int64_t* hi) {
  *lo = 0;
  *hi = p.kv_len - 1;
  if (p.causal) *hi = std::min(*hi, i);
  if (p.window_left >= 0) *lo = std::max(*lo, i - p.window_left);
  if (p.window_right >= 0) *hi = std::min(*hi, i + p.window_right);
}

bool SameSegment(const AttentionParams& p, int64_t b, int64_t i, int64_t j) {
  return p.q_segment_ids == nullptr ||
         p.q_segment_ids[b * p.q_len + i] == p.kv_segment_ids[b * p.kv_len + j];
}

// A row's valid length: lengths[b] clamped to [0, full] (a traced length may be anything).
int64_t ValidLength(const int32_t* lengths, int64_t b, int64_t full) {
  if (lengths == nullptr) return full;
  return std::min<int64_t>(std::max<int64_t>(lengths[b], 0), full);
}

// Offsets of (b, kh, r, i, 0) in a bias- or mask-shaped array; element j adds j * stride[4].
int64_t BroadcastRow(const int64_t stride[5], int64_t b, int64_t kh, int64_t r, int64_t i) {
  return b * stride[0] + kh * stride[1] + r * stride[2] + i * stride[3];
}

double BiasAt(const AttentionParams& p, int64_t at) {
  switch (p.bias_dtype) {
    case DType::kF32: return static_cast<const float*>(p.bias)[at];
    case DType::kBF16: return Bf16ToFloat(static_cast<const uint16_t*>(p.bias)[at]);
    case DType::kF16: return F16ToFloat(static_cast<const uint16_t*>(p.bias)[at]);
    default: return 0.0;  // the handler admits float32 and q's 16-bit dtypes only
  }
}

// Where one query row's bias and mask start (or -1 without them).
struct RowExtras {
  int64_t bias = -1, mask = -1;
  RowExtras(const AttentionParams& p, int64_t b, int64_t kh, int64_t r, int64_t i) {
    if (p.bias != nullptr) bias = BroadcastRow(p.bias_stride, b, kh, r, i);
    if (p.mask != nullptr) mask = BroadcastRow(p.mask_stride, b, kh, r, i);
  }
  bool Keeps(const AttentionParams& p, int64_t j) const {
    return mask < 0 || p.mask[mask + j * p.mask_stride[4]] != 0;
  }
  double Bias(const AttentionParams& p, int64_t j) const {
    return bias < 0 ? 0.0 : BiasAt(p, bias + j * p.bias_stride[4]);
  }
};

double Dot(const float* a, const float* b, int64_t n) {
  double s = 0.0;
  for (int64_t h = 0; h < n; ++h) s += double(a[h]) * double(b[h]);
  return s;
}

// The logit after scale and softcap; *tanh_out gets tanh(l / c) (for the backward pass).
double Logit(const AttentionParams& p, const float* q, const float* k, int64_t n,
             double* tanh_out) {
  const double raw = double(p.scale) * Dot(q, k, n);
  if (p.softcap > 0.f) {
    const double t = std::tanh(raw / double(p.softcap));
    *tanh_out = t;
    return double(p.softcap) * t;
  }
  *tanh_out = 0.0;
  return raw;
}

// The kv head's K and V rows as float32, S x H each.
void LoadKv(const AttentionParams& p, const Dims& d, int64_t b, int64_t kh, float* kf, float* vf) {
  for (int64_t j = 0; j < d.S; ++j) {
    LoadFloats(p.k, p.dtype, d.KvRow(b, j, kh), d.H, kf + j * d.H);
    LoadFloats(p.v, p.dtype, d.KvRow(b, j, kh), d.H, vf + j * d.H);
  }
}

}  // namespace

void AttentionFwd(const AttentionParams& p) {
  const Dims d(p);
  if (d.B == 0 || d.T == 0 || d.K == 0 || d.R == 0) return;
  const int64_t H = d.H;
  std::vector<float> kf(d.S * H), vf(d.S * H), q(H), out(H);
  std::vector<double> logit(std::max<int64_t>(d.S, 1)), acc(H);
  for (int64_t b = 0; b < d.B; ++b) {
    const int64_t q_valid = ValidLength(p.q_lengths, b, d.T);
    const int64_t kv_valid = ValidLength(p.kv_lengths, b, d.S);
    for (int64_t kh = 0; kh < d.K; ++kh) {
      LoadKv(p, d, b, kh, kf.data(), vf.data());
      for (int64_t r = 0; r < d.R; ++r) {
        for (int64_t i = 0; i < d.T; ++i) {
          const int64_t row = d.QRow(b, i, kh, r);
          int64_t lo, hi;
          VisibleRange(p, i, &lo, &hi);
          hi = std::min(hi, kv_valid - 1);
          if (i >= q_valid) hi = lo - 1;  // past the row's query length: zeros
          LoadFloats(p.q, p.dtype, row, H, q.data());
          const RowExtras ex(p, b, kh, r, i);
          double mx = kNegInf;
          for (int64_t j = lo; j <= hi; ++j) {
            double unused;
            logit[j] = SameSegment(p, b, i, j) && ex.Keeps(p, j)
                           ? Logit(p, q.data(), &kf[j * H], H, &unused) + ex.Bias(p, j)
                           : kNegInf;
            mx = std::max(mx, logit[j]);
          }
          std::fill(acc.begin(), acc.end(), 0.0);
          if (mx == kNegInf) {  // nothing visible: zeros, lse = -inf
            std::fill(out.begin(), out.end(), 0.f);
            StoreFloats(p.o, p.dtype, row, H, out.data());
            p.lse[d.Stat(b, kh, r, i)] = -std::numeric_limits<float>::infinity();
            continue;
          }
          double sum = 0.0;
          for (int64_t j = lo; j <= hi; ++j) {
            if (logit[j] == kNegInf) continue;  // masked by segment (exp would give 0)
            const double e = std::exp(logit[j] - mx);
            sum += e;
            const float* vj = &vf[j * H];
            for (int64_t h = 0; h < H; ++h) acc[h] += e * double(vj[h]);
          }
          for (int64_t h = 0; h < H; ++h) out[h] = static_cast<float>(acc[h] / sum);
          StoreFloats(p.o, p.dtype, row, H, out.data());
          p.lse[d.Stat(b, kh, r, i)] = static_cast<float>(mx + std::log(sum));
        }
      }
    }
  }
}

void AttentionBwd(const AttentionParams& p) {
  const Dims d(p);
  if (p.dbias != nullptr) std::fill_n(p.dbias, BroadcastCount(p, p.bias_stride), 0.f);
  if (d.B == 0 || d.K == 0) return;
  const int64_t H = d.H;
  const double scale = p.scale;
  const double cap = p.softcap;
  std::vector<float> kf(d.S * H), vf(d.S * H), q(H), o(H), dout(H), row_out(H);
  std::vector<double> dk(d.S * H), dv(d.S * H), dq(H);
  for (int64_t b = 0; b < d.B; ++b) {
    const int64_t q_valid = ValidLength(p.q_lengths, b, d.T);
    const int64_t kv_valid = ValidLength(p.kv_lengths, b, d.S);
    for (int64_t kh = 0; kh < d.K; ++kh) {
      LoadKv(p, d, b, kh, kf.data(), vf.data());
      std::fill(dk.begin(), dk.end(), 0.0);
      std::fill(dv.begin(), dv.end(), 0.0);
      for (int64_t r = 0; r < d.R; ++r) {
        for (int64_t i = 0; i < d.T; ++i) {
          const int64_t row = d.QRow(b, i, kh, r);
          const int64_t stat = d.Stat(b, kh, r, i);
          LoadFloats(p.q, p.dtype, row, H, q.data());
          LoadFloats(p.o, p.dtype, row, H, o.data());
          LoadFloats(p.d_o, p.dtype, row, H, dout.data());
          const double delta = Dot(dout.data(), o.data(), H);
          p.delta[stat] = static_cast<float>(delta);
          std::fill(dq.begin(), dq.end(), 0.0);
          const double lse = p.lse[stat];
          int64_t lo, hi;
          VisibleRange(p, i, &lo, &hi);
          hi = std::min(hi, kv_valid - 1);
          // A row with no visible key, or past the row's query length: zero gradients.
          if (lse == kNegInf || i >= q_valid) hi = lo - 1;
          const RowExtras ex(p, b, kh, r, i);
          for (int64_t j = lo; j <= hi; ++j) {
            if (!SameSegment(p, b, i, j) || !ex.Keeps(p, j)) continue;
            const float* kj = &kf[j * H];
            const float* vj = &vf[j * H];
            double t;
            const double l = Logit(p, q.data(), kj, H, &t) + ex.Bias(p, j);
            const double pj = std::exp(l - lse);
            double ds = pj * (Dot(dout.data(), vj, H) - delta);
            if (p.dbias != nullptr) p.dbias[ex.bias + j * p.bias_stride[4]] += float(ds);
            if (cap > 0) ds *= 1.0 - t * t;  // d(c tanh(x / c))/dx, t = l / c
            double* dkj = &dk[j * H];
            double* dvj = &dv[j * H];
            for (int64_t h = 0; h < H; ++h) {
              dq[h] += ds * double(kj[h]);
              dkj[h] += ds * double(q[h]);
              dvj[h] += pj * double(dout[h]);
            }
          }
          for (int64_t h = 0; h < H; ++h) row_out[h] = static_cast<float>(scale * dq[h]);
          StoreFloats(p.dq, p.dtype, row, H, row_out.data());
        }
      }
      for (int64_t j = 0; j < d.S; ++j) {
        for (int64_t h = 0; h < H; ++h) row_out[h] = static_cast<float>(scale * dk[j * H + h]);
        StoreFloats(p.dk, p.dtype, d.KvRow(b, j, kh), H, row_out.data());
        for (int64_t h = 0; h < H; ++h) row_out[h] = static_cast<float>(dv[j * H + h]);
        StoreFloats(p.dv, p.dtype, d.KvRow(b, j, kh), H, row_out.data());
      }
    }
  }
}

}  // namespace jaxgpu::cpu
