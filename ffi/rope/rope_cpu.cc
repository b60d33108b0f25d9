// Straightforward CPU RoPE: per token, the r/2 angles in double precision (rope_angle.h),
// their sin/cos in double rounded once to float32, then every head's row rotated in
// float32 and rounded once to the storage type. Features past rotary_dim are copied.
#include "rope/rope_cpu.h"

#include <cmath>
#include <vector>

#include "common/cpu_float.h"
#include "rope/rope_angle.h"

namespace jaxgpu::cpu {

void Rope(const RopeParams& p) {
  const int64_t H = p.dim, N = p.heads, T = p.seq, r = p.rotary_dim, half = r / 2;
  if (p.rows * T * N * H == 0) return;
  const int64_t rows_per_pos_row = p.rows / p.pos_rows;
  std::vector<double> inv_freq(half);
  for (int64_t i = 0; i < half; ++i) inv_freq[i] = rope::InvFreq(i, r, p.log2_theta);
  std::vector<float> cos_a(half), sin_a(half), in(H), out(H);
  const float sign = p.inverse ? -1.f : 1.f;
  for (int64_t row = 0; row < p.rows; ++row) {
    const int32_t* pos = p.positions + (row / rows_per_pos_row) * T;
    for (int64_t t = 0; t < T; ++t) {
      const double position = double(pos[t]);
      for (int64_t i = 0; i < half; ++i) {
        double reduced;
        const int q = rope::ReduceQuadrant(position * inv_freq[i], &reduced);
        float s, c;
        rope::ApplyQuadrant(q, float(std::sin(reduced)), float(std::cos(reduced)), &s, &c);
        sin_a[i] = sign * s;
        cos_a[i] = c;
      }
      for (int64_t n = 0; n < N; ++n) {
        const int64_t base = ((row * T + t) * N + n) * H;
        LoadFloats(p.x, p.dtype, base, H, in.data());
        for (int64_t i = 0; i < half; ++i) {
          // (a, b) -> (a cos - b sin, b cos + a sin): the complex product (a + ib) e^(i angle).
          const int64_t ia = p.interleaved ? 2 * i : i;
          const int64_t ib = p.interleaved ? 2 * i + 1 : i + half;
          const float a = in[ia], b = in[ib];
          out[ia] = a * cos_a[i] - b * sin_a[i];
          out[ib] = b * cos_a[i] + a * sin_a[i];
        }
        for (int64_t k = r; k < H; ++k) out[k] = in[k];
        StoreFloats(p.y, p.dtype, base, H, out.data());
      }
    }
  }
}

}  // namespace jaxgpu::cpu
