// Straightforward CPU decode attention: for each query row, the visible keys' logits, the
// softmax and the P.V product in float64 (so the CPU result is a float64-accurate oracle
// of the float32 formulas, rounded once to the output's type). An 8-bit cache's values
// are exact in float and its scales are applied in float64. The split-KV workspace is a
// GPU concern and is not used here. Rows are independent; their order is fixed.
//
// The update's quantization (decode_params.h) is the rule of jaxgpu.reference.decode.
// quantize_kv, step by step in float32, so that its values and scales are bit-identical to
// the reference's and to the CUDA kernel's.
#include "decode/decode_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "common/cpu_float.h"

namespace jaxgpu::cpu {

void PagedAttention(const PagedAttentionParams& p) {
  const int64_t H = p.head_dim, K = p.kv_heads, N = p.heads, S = p.page_size;
  const int64_t rep = N / K, cap = p.max_pages * S;
  const int64_t pool = p.num_pages * S * K * H;  // elements of one group's pages
  std::vector<float> q(H), kv(H), o_row(H);
  std::vector<double> logits, acc(H);
  std::vector<int64_t> keys;  // element offsets of the visible keys' (K or V) rows
  const bool q8 = p.k_scale != nullptr;
  for (int64_t g = 0; g < p.groups; ++g) {
    const int64_t pool_at = (p.page_groups == 1 ? 0 : g) * pool;
    for (int64_t b = 0; b < p.batch; ++b) {
      const int64_t r = g * p.batch + b;
      const int32_t* table = p.block_table + r * p.max_pages;
      const int64_t len = p.lengths[r];
      const bool row_ok = len >= 0 && len <= cap;
      for (int64_t t = 0; t < p.q_len; ++t) {
        const int64_t pos = len - p.q_len + t;
        // Visible keys: [lo, pos], pages in range only. An invalid row sees none.
        keys.clear();
        if (row_ok && pos >= 0) {
          const int64_t lo = p.window_left >= 0 ? std::max<int64_t>(0, pos - p.window_left) : 0;
          for (int64_t j = lo; j <= pos; ++j) {
            const int64_t page = table[j / S];
            if (page < 0 || page >= p.num_pages) continue;
            keys.push_back(pool_at + ((page * S + j % S) * K) * H);
          }
        }
        for (int64_t n = 0; n < N; ++n) {
          const int64_t kvh = n / rep;
          const int64_t q_at = (((r * p.q_len) + t) * N + n) * H;
          LoadFloats(p.query, p.dtype, q_at, H, q.data());
          logits.assign(keys.size(), 0.0);
          double top = -std::numeric_limits<double>::infinity();
          for (size_t i = 0; i < keys.size(); ++i) {
            LoadFloats(p.k_pages, p.kv_dtype, keys[i] + kvh * H, H, kv.data());
            double dot = 0;
            for (int64_t h = 0; h < H; ++h) dot += double(q[h]) * double(kv[h]);
            if (q8) dot *= double(p.k_scale[(keys[i] / H) + kvh]);
            double z = dot * double(p.scale);
            if (p.softcap > 0) z = double(p.softcap) * std::tanh(z / double(p.softcap));
            logits[i] = z;
            top = std::max(top, z);
          }
          std::fill(acc.begin(), acc.end(), 0.0);
          double denom = 0;
          for (size_t i = 0; i < keys.size(); ++i) {
            const double w = std::exp(logits[i] - top);
            denom += w;
            LoadFloats(p.v_pages, p.kv_dtype, keys[i] + kvh * H, H, kv.data());
            const double wv = q8 ? w * double(p.v_scale[(keys[i] / H) + kvh]) : w;
            for (int64_t h = 0; h < H; ++h) acc[h] += wv * double(kv[h]);
          }
          for (int64_t h = 0; h < H; ++h) o_row[h] = denom > 0 ? float(acc[h] / denom) : 0.f;
          StoreFloats(p.out, p.dtype, q_at, H, o_row.data());
        }
      }
    }
  }
}

namespace {

// One row of H new values quantized to `kv` at dst, its scale returned.
float QuantizeRow(const float* x, int64_t n, DType kv, void* dst) {
  const float qmax = kv == DType::kS8 ? 127.f : 448.f;
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float scale = amax / qmax;
  for (int64_t i = 0; i < n; ++i) {
    // An IEEE division (not a multiply by 1 / scale): the rule the reference and the CUDA
    // kernel share, so that all three round identically.
    const float y = scale > 0.f ? x[i] / scale : 0.f;
    if (kv == DType::kS8) {
      const float r = std::min(std::max(std::nearbyint(y), -127.f), 127.f);  // half to even
      static_cast<int8_t*>(dst)[i] = int8_t(r);
    } else {
      static_cast<uint8_t*>(dst)[i] = FloatToF8E4M3Sat(std::min(std::max(y, -448.f), 448.f));
    }
  }
  return scale;
}

}  // namespace

void PagedKvUpdate(const PagedKvUpdateParams& p) {
  const int64_t S = p.page_size, K = p.kv_heads, H = p.head_dim, KH = K * H;
  const int64_t cap = p.max_pages * S;
  const bool q8 = p.k_scale != nullptr;
  const int64_t src_token_bytes = DTypeBytes(p.dtype, KH);
  const int64_t dst_token_bytes = DTypeBytes(p.kv_dtype, KH);
  const int64_t pool_tokens = p.num_pages * S;
  auto* k_out = static_cast<char*>(p.k_pages);
  auto* v_out = static_cast<char*>(p.v_pages);
  const auto* k_new = static_cast<const char*>(p.k_new);
  const auto* v_new = static_cast<const char*>(p.v_new);
  std::vector<float> row(H);
  for (int64_t g = 0; g < p.groups; ++g) {
    for (int64_t b = 0; b < p.batch; ++b) {
      const int64_t r = g * p.batch + b;
      for (int64_t t = 0; t < p.new_len; ++t) {
        const int64_t pos = p.positions != nullptr ? int64_t(p.positions[r * p.new_len + t])
                                                   : int64_t(p.lengths[r]) - p.new_len + t;
        if (pos < 0 || pos >= cap) continue;
        const int64_t page = p.block_table[r * p.max_pages + pos / S];
        if (page < 0 || page >= p.num_pages) continue;
        const int64_t slot = g * pool_tokens + page * S + pos % S;  // token index in the pool
        const int64_t src = r * p.new_len + t;                      // token index in the new
        if (!q8) {
          std::memcpy(k_out + slot * dst_token_bytes, k_new + src * src_token_bytes,
                      dst_token_bytes);
          std::memcpy(v_out + slot * dst_token_bytes, v_new + src * src_token_bytes,
                      dst_token_bytes);
          continue;
        }
        for (int64_t k = 0; k < K; ++k) {
          LoadFloats(p.k_new, p.dtype, src * KH + k * H, H, row.data());
          p.k_scale[slot * K + k] =
              QuantizeRow(row.data(), H, p.kv_dtype, k_out + slot * dst_token_bytes + k * H);
          LoadFloats(p.v_new, p.dtype, src * KH + k * H, H, row.data());
          p.v_scale[slot * K + k] =
              QuantizeRow(row.data(), H, p.kv_dtype, v_out + slot * dst_token_bytes + k * H);
        }
      }
    }
  }
}

}  // namespace jaxgpu::cpu
