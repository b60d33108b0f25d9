// The rotation angle of a (position, frequency) pair, shared by the CPU implementation
// and the CUDA kernels (host and device code).
//
// angle = position * inv_freq_i, inv_freq_i = theta^(-2i / rotary_dim). In float32 this
// is hopeless at long context: inv_freq_0 = 1 and a position of 10^6 give an angle whose
// float32 rounding alone is up to 0.03 rad (half an ulp of 10^6, 2^-4), and the float32
// rounding of inv_freq adds up to 0.06 more. So the angle is formed in double precision
// (53 bits: with inv_freq's own double rounding, the angle is exact to ~1e-10 rad at
// |position| <= 10^6, < 2e-9 up to 2^24, and ~1e-6 at worst near 2^31),
// reduced to k * pi/2 + r with |r| <= pi/4 in double (pi/2 as two doubles, fma: r is
// exact to ~1e-16 + |k| * 1e-33), and only r goes to float32: its rounding is at most
// 2^-25 rad, and sin/cos of it in float32 are within ~1 ulp. The quadrant k mod 4 swaps
// and negates sin and cos exactly.
//
// Cost: a double exp2 per frequency (the CUDA kernels: one per 16-byte lane, then a
// product per frequency) and a handful of double operations per angle, computed once
// per (token, frequency) a thread owns and reused for every head it walks through.
#pragma once

#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#define JAXGPU_ROPE_HD __host__ __device__ __forceinline__
#else
#define JAXGPU_ROPE_HD inline
#endif

namespace jaxgpu::rope {

// pi/2 = kHalfPiHi + kHalfPiLo to ~2^-107 (kHalfPiHi is the double nearest pi/2).
constexpr double kHalfPiHi = 1.5707963267948966192;     // 0x1.921fb54442d18p+0
constexpr double kHalfPiLo = 6.123233995736766036e-17;  // 0x1.1a62633145c07p-54
constexpr double kTwoOverPi = 0.63661977236758134308;

// inv_freq_i = theta^(-2i/r), from log2(theta) (computed once on the host).
JAXGPU_ROPE_HD double InvFreq(int64_t i, int64_t rotary_dim, double log2_theta) {
  return exp2(-(2.0 * double(i) / double(rotary_dim)) * log2_theta);
}

// a = k * pi/2 + *reduced with |*reduced| <= pi/4 (+ rounding); returns k mod 4.
JAXGPU_ROPE_HD int ReduceQuadrant(double a, double* reduced) {
  const double k = rint(a * kTwoOverPi);
  *reduced = fma(-k, kHalfPiLo, fma(-k, kHalfPiHi, a));
  return static_cast<int>(static_cast<int64_t>(k) & 3);  // two's complement: -1 -> 3
}

// sin and cos of |r| <= pi/4 + tiny in float32, by their Taylor polynomials: the first
// omitted terms, r^11/11! and r^12/12!, are < 2e-9 and 2e-10 at pi/4, far under float32's
// half ulp (3e-8 near 0.7), so the error is Horner's rounding, ~1 ulp. Cheaper than
// sincosf, which also carries a slow path for huge arguments (and a stack frame).
JAXGPU_ROPE_HD void SinCosSmall(float r, float* s, float* c) {
  const float r2 = r * r;
  *s = r +
       r * r2 *
           (-1.66666672e-1f + r2 * (8.33333377e-3f + r2 * (-1.98412701e-4f + r2 * 2.75573188e-6f)));
  *c = 1.f +
       r2 * (-0.5f + r2 * (4.16666679e-2f +
                           r2 * (-1.38888892e-3f + r2 * (2.48015876e-5f + r2 * -2.75573200e-7f))));
}

// (sin, cos) of k * pi/2 + r from (sin r, cos r), q = k mod 4.
JAXGPU_ROPE_HD void ApplyQuadrant(int q, float sin_r, float cos_r, float* s, float* c) {
  const float a = (q & 1) ? cos_r : sin_r;  // sin(r + pi/2) = cos r
  const float b = (q & 1) ? sin_r : cos_r;  // cos(r + pi/2) = -sin r
  *s = (q & 2) ? -a : a;                    // a half turn negates both
  *c = ((q + 1) & 2) ? -b : b;              // cos: negative in quadrants 1 and 2
}

}  // namespace jaxgpu::rope
