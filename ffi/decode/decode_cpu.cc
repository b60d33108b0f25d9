// Straightforward CPU decode attention: for each query row, the visible keys' logits, the
// softmax and the P.V product in float64 (so the CPU result is a float64-accurate oracle
// of the float32 formulas, rounded once to the output's type). The split-KV workspace is a
// GPU concern and is not used here. Rows are independent; their order is fixed.
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
            LoadFloats(p.k_pages, p.dtype, keys[i] + kvh * H, H, kv.data());
            double dot = 0;
            for (int64_t h = 0; h < H; ++h) dot += double(q[h]) * double(kv[h]);
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
            LoadFloats(p.v_pages, p.dtype, keys[i] + kvh * H, H, kv.data());
            for (int64_t h = 0; h < H; ++h) acc[h] += w * double(kv[h]);
          }
          for (int64_t h = 0; h < H; ++h) o_row[h] = denom > 0 ? float(acc[h] / denom) : 0.f;
          StoreFloats(p.out, p.dtype, q_at, H, o_row.data());
        }
      }
    }
  }
}

void PagedKvUpdate(const PagedKvUpdateParams& p) {
  const int64_t S = p.page_size, KH = p.kv_heads * p.head_dim, cap = p.max_pages * S;
  const int64_t bytes_per_token = DTypeBytes(p.dtype, KH);
  const int64_t pool_bytes = DTypeBytes(p.dtype, p.num_pages * S * KH);
  auto* k_out = static_cast<char*>(p.k_pages);
  auto* v_out = static_cast<char*>(p.v_pages);
  const auto* k_new = static_cast<const char*>(p.k_new);
  const auto* v_new = static_cast<const char*>(p.v_new);
  for (int64_t g = 0; g < p.groups; ++g) {
    for (int64_t b = 0; b < p.batch; ++b) {
      const int64_t r = g * p.batch + b;
      for (int64_t t = 0; t < p.new_len; ++t) {
        const int64_t pos = p.positions[r * p.new_len + t];
        if (pos < 0 || pos >= cap) continue;
        const int64_t page = p.block_table[r * p.max_pages + pos / S];
        if (page < 0 || page >= p.num_pages) continue;
        const int64_t dst = g * pool_bytes + (page * S + pos % S) * bytes_per_token;
        const int64_t src = (r * p.new_len + t) * bytes_per_token;
        std::memcpy(k_out + dst, k_new + src, bytes_per_token);
        std::memcpy(v_out + dst, v_new + src, bytes_per_token);
      }
    }
  }
}

}  // namespace jaxgpu::cpu
