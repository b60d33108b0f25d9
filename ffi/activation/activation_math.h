// The activations' math, shared by the CUDA kernels (activation_kernels.cu) and the CPU
// implementation (activation_cpu.cc): one definition per op, so the two backends cannot
// drift apart. Everything is float32 whatever the storage dtype. No XLA or CUDA types;
// compiled by nvcc as __host__ __device__ and by the host compiler as plain inline code.
//
// Each activation A provides
//   F(x)            the activation,
//   Grad(x, dy)     dx of the unary backward pass,
//   FD(x, f, d)     the activation and its derivative (the gated backward pass; the
//                   activations that have a gated form: silu, both gelus).
// and the four elementwise ops below (UnaryFwd, UnaryBwd, GatedFwd, GatedBwd) are built from
// them: each maps kIn float inputs of one element to kOut float outputs. The kernel
// templates are written once against that interface.
//
// Accuracy. Only accurate library functions: expf on the device (CUDA math, 2 ulps),
// std::exp on the CPU, and IEEE division (nvcc's default -prec-div=true, which the
// compiler turns into a correctly rounded reciprocal where it can); the normal CDF of the
// exact gelu is NormalTail below (a few ulps, relative, in both tails). Approximate
// intrinsics (__expf, __fdividef) are not used: __expf's error grows with |x|.
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define JAXGPU_HD __host__ __device__ __forceinline__
#else
#define JAXGPU_HD inline
#endif

#include "activation/activation_params.h"

namespace jaxgpu::act {

JAXGPU_HD float Exp(float x) {
#if defined(__CUDA_ARCH__)
  return expf(x);
#else
  return std::exp(x);
#endif
}

JAXGPU_HD float Abs(float x) {
#if defined(__CUDA_ARCH__)
  return fabsf(x);
#else
  return std::fabs(x);
#endif
}

// min(x, limit) for a number limit; a NaN x gives limit (as fminf, without the libm call
// std::fmin is on the host).
JAXGPU_HD float MinOr(float x, float limit) { return x < limit ? x : limit; }

// a * a - fl(a * a), exactly: the rounding error of a square (an fma on the device; on the
// host the product of two floats is exact in double, which avoids a software fmaf call).
JAXGPU_HD float SquareError(float a, float square) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, a, -square);
#else
  return static_cast<float>(static_cast<double>(a) * a - square);
#endif
}

// 1 / (1 + e^-x): saturates cleanly, e^-x overflowing to inf gives exactly 0.
JAXGPU_HD float Logistic(float x) { return 1.f / (1.f + Exp(-x)); }

// jax.nn.relu: max(x, 0), NaN propagated; its gradient at 0 is 0 (jax's custom_jvp), and
// dx is a select, not dy * 0 (an infinite dy gives 0, not NaN, as in jax).
struct Relu {
  JAXGPU_HD static float F(float x) { return x < 0.f ? 0.f : x; }
  JAXGPU_HD static float Grad(float x, float dy) { return x > 0.f ? dy : 0.f; }
};

// jax.nn.sigmoid; derivative s (1 - s), as jax's logistic JVP.
struct Sigmoid {
  JAXGPU_HD static float F(float x) { return Logistic(x); }
  JAXGPU_HD static void FD(float x, float& f, float& d) {
    f = Logistic(x);
    d = f * (1.f - f);
  }
  JAXGPU_HD static float Grad(float x, float dy) {
    float f, d;
    FD(x, f, d);
    return dy * d;
  }
};

// jax.nn.silu: x * sigmoid(x); derivative s + x s (1 - s) = s (1 + x (1 - s)).
struct Silu {
  JAXGPU_HD static float F(float x) { return x * Logistic(x); }
  JAXGPU_HD static void FD(float x, float& f, float& d) {
    const float s = Logistic(x);
    f = x * s;
    d = s * (1.f + x * (1.f - s));
  }
  JAXGPU_HD static float Grad(float x, float dy) {
    float f, d;
    FD(x, f, d);
    return dy * d;
  }
};

// jax.nn.gelu(approximate=True): 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3).
// Computed as x * sigmoid(2u), the same function (0.5 (1 + tanh(u)) = sigmoid(2u)) without
// the cancellation of 1 + tanh(u) for negative x, where tanh(u) rounds to -1 in float32.
struct GeluTanh {
  static constexpr float kK0 = 1.5957691216057308f;  // 2 sqrt(2/pi)
  static constexpr float kK1 = 1.5957691216057308f * 0.044715f;
  JAXGPU_HD static float F(float x) { return x * Logistic(x * (kK0 + kK1 * x * x)); }
  // d/dx x s(2u) = s + x s (1 - s) (k0 + 3 k1 x^2). Where s (1 - s) is exactly 0 the second
  // term is 0: for |x| > 1.8e19, x^2 is inf and 0 * inf would be NaN.
  JAXGPU_HD static void FD(float x, float& f, float& d) {
    const float x2 = x * x;
    const float s = Logistic(x * (kK0 + kK1 * x2));
    const float ds = s * (1.f - s);
    f = x * s;
    d = s + (ds > 0.f ? x * ds * (kK0 + 3.f * kK1 * x2) : 0.f);
  }
  JAXGPU_HD static float Grad(float x, float dy) {
    float f, d;
    FD(x, f, d);
    return dy * d;
  }
};

// The normal distribution's lower tail q = Phi(-|x|) and e = exp(-x^2 / 2), to a few
// float32 ulps RELATIVE everywhere (fit_normal_tail.py measures at most ~5). jax.nn.gelu's
// exact form is 0.5 x erfc(-x / sqrt 2), accurate in the lower tail where
// 0.5 (1 + erf(x / sqrt 2)) cancels (erff's result rounds to -1 below x ~ -5.4, giving 0 for
// x Phi(x) ~ -1e-7): the 2x-reference test rule catches that. CUDA's erfcf costs ~2.3x erff
// (PTX: ~74 instructions against ~32), too much for the geglu kernels' ~60 instructions of
// budget per element; this costs about erff's, and its exp(-x^2/2) is the normal density
// the backward pass needs anyway.
//   Phi(-a) = exp(-a^2 / 2) N(a), N smooth (N(0) = 1/2, N(a) ~ 1 / (a sqrt(2 pi))), and
//   N(a) = t poly(t), t = 1 / (1 + a / 4): poly fitted by fit_normal_tail.py.
// exp(-a^2 / 2) is exp of the rounded square, corrected to first order by the square's
// rounding error (without it: up to 64 ulps at a = 13). |x| is clamped at 20
// (e is then exactly 0, and a NaN x gives q = 0: x Phi(x) stays NaN).
struct NormalTail {
  JAXGPU_HD static void Eval(float x, float& q, float& e) {
    const float a = MinOr(Abs(x), 20.f);
    const float hi = a * a;
    const float e0 = Exp(-0.5f * hi);
    e = e0 - e0 * (0.5f * SquareError(a, hi));
    const float t = 1.f / (1.f + 0.25f * a);
    // poly(t), coefficients from fit_normal_tail.py (Horner, highest degree first).
    float p = 1.623566e-02f;
    p = p * t - 6.0863953e-02f;
    p = p * t + 4.6956945e-02f;
    p = p * t + 3.494439e-02f;
    p = p * t + 7.0618535e-03f;
    p = p * t + 8.98368e-02f;
    p = p * t + 7.084099e-02f;
    p = p * t + 9.577872e-02f;
    p = p * t + 9.9458836e-02f;
    p = p * t + 9.974977e-02f;
    q = e * t * p;
  }
};

// jax.nn.gelu(approximate=False): x Phi(x); derivative Phi(x) + x phi(x),
// phi(x) = exp(-x^2 / 2) / sqrt(2 pi).
struct GeluErf {
  static constexpr float kInvSqrt2Pi = 0.39894228040143268f;
  JAXGPU_HD static float Cdf(float x, float& e) {
    float q;
    NormalTail::Eval(x, q, e);
    return x > 0.f ? 1.f - q : q;
  }
  JAXGPU_HD static float F(float x) {
    float e;
    return x * Cdf(x, e);
  }
  JAXGPU_HD static void FD(float x, float& f, float& d) {
    float e;
    const float cdf = Cdf(x, e);
    f = x * cdf;
    d = cdf + x * (kInvSqrt2Pi * e);
  }
  JAXGPU_HD static float Grad(float x, float dy) {
    float f, d;
    FD(x, f, d);
    return dy * d;
  }
};

// ---- the four elementwise ops: kIn float inputs of one element -> kOut outputs ---------

template <class A>
struct UnaryFwd {  // {x} -> {y}
  static constexpr int kIn = 1, kOut = 1;
  JAXGPU_HD static void Apply(const float (&in)[kIn], float (&out)[kOut]) { out[0] = A::F(in[0]); }
};

template <class A>
struct UnaryBwd {  // {x, dy} -> {dx}
  static constexpr int kIn = 2, kOut = 1;
  JAXGPU_HD static void Apply(const float (&in)[kIn], float (&out)[kOut]) {
    out[0] = A::Grad(in[0], in[1]);
  }
};

template <class A>
struct GatedFwd {  // {gate, up} -> {act(gate) * up}
  static constexpr int kIn = 2, kOut = 1;
  JAXGPU_HD static void Apply(const float (&in)[kIn], float (&out)[kOut]) {
    out[0] = A::F(in[0]) * in[1];
  }
};

template <class A>
struct GatedBwd {  // {gate, up, dy} -> {dgate, dup}: the activation evaluated once for both
  static constexpr int kIn = 3, kOut = 2;
  JAXGPU_HD static void Apply(const float (&in)[kIn], float (&out)[kOut]) {
    float f, d;
    A::FD(in[0], f, d);
    out[0] = in[2] * in[1] * d;
    out[1] = in[2] * f;
  }
};

template <class T>
struct Tag {
  using type = T;
};

// Calls fn(Tag<Op>{}) with the elementwise op `p` describes: one instantiation per case.
// Gated forms exist for the activations that have one (swiglu: silu; geglu: both gelus);
// the handlers reject any other gated kind (ActKindIsGated) before getting here.
inline bool ActKindIsGated(ActKind k) {
  return k == ActKind::kSilu || k == ActKind::kGeluTanh || k == ActKind::kGeluErf;
}

template <class A, class Fn>
auto DispatchPass(const ActParams& p, Fn&& fn) {
  if (p.gated) return p.backward ? fn(Tag<GatedBwd<A>>{}) : fn(Tag<GatedFwd<A>>{});
  return p.backward ? fn(Tag<UnaryBwd<A>>{}) : fn(Tag<UnaryFwd<A>>{});
}

template <class A, class Fn>
auto DispatchUnary(const ActParams& p, Fn&& fn) {
  return p.backward ? fn(Tag<UnaryBwd<A>>{}) : fn(Tag<UnaryFwd<A>>{});
}

template <class Fn>
auto DispatchOp(const ActParams& p, Fn&& fn) {
  switch (p.kind) {
    case ActKind::kRelu: return DispatchUnary<Relu>(p, fn);
    case ActKind::kSigmoid: return DispatchUnary<Sigmoid>(p, fn);
    case ActKind::kSilu: return DispatchPass<Silu>(p, fn);
    case ActKind::kGeluTanh: return DispatchPass<GeluTanh>(p, fn);
    default: return DispatchPass<GeluErf>(p, fn);
  }
}

}  // namespace jaxgpu::act
