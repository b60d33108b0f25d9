"""Fits the coefficients of NormalTail in activation_math.h (run: python3 fit_normal_tail.py).

The normal tail Phi(-a), a >= 0, is written as exp(-a^2 / 2) * N(a): N(a) = Phi(-a) e^{a^2/2}
is smooth and slowly varying (N(0) = 0.5, N(a) ~ 1 / (a sqrt(2 pi)) for large a), so with
t = 1 / (1 + P a) it is t * poly(t) to float32 accuracy. The poly is a relative-error
least-squares fit (iteratively reweighted toward minimax) on Chebyshev nodes in t covering
a in [0, A_MAX]; past A_MAX, Phi(-a) is below float32's smallest normal number anyway.
Then the whole float32 evaluation (as the kernels do it) is emulated and its error printed.
Float64 values of Phi come from math.erfc.
"""

import math

import numpy as np

P = 0.25
DEGREE = 9
A_MAX = 13.5
F32 = np.float32


def n_exact(a):
  return np.array([0.5 * math.erfc(x / math.sqrt(2)) * math.exp(x * x / 2) for x in a])


def fit(n_nodes=6000, iterations=60):
  t_min = 1 / (1 + P * A_MAX)
  k = np.arange(n_nodes)
  t = t_min + (1 - t_min) * (0.5 - 0.5 * np.cos(np.pi * (k + 0.5) / n_nodes))
  target = n_exact((1 / t - 1) / P)
  basis = np.vander(t, DEGREE + 1, increasing=True) * t[:, None]
  w = np.ones(n_nodes)
  for _ in range(iterations):
    scale = w / target
    c, *_ = np.linalg.lstsq(basis * scale[:, None], target * scale, rcond=None)
    r = np.abs(basis @ c / target - 1)
    w = w * np.sqrt(r / r.max()) + 1e-12
    w /= w.max()
  return c.astype(F32)


def fma32(a, b, c):
  return F32(np.float64(a) * np.float64(b) + np.float64(c))


def tail32(a, c):
  """Phi(-a) as NormalTail computes it in float32 (expf emulated correctly rounded)."""
  a = np.minimum(a.astype(F32), F32(20))
  hi = F32(a * a)
  lo = fma32(a, a, -hi)
  e0 = F32(np.exp(np.float64(F32(-0.5) * hi)))
  e = F32(e0 - F32(e0 * F32(F32(0.5) * lo)))
  t = F32(F32(1) / fma32(F32(P), a, F32(1)))
  p = np.full_like(t, c[-1])
  for v in c[-2::-1]:
    p = fma32(p, t, v)
  return F32(F32(e * t) * p)


def main():
  c = fit()
  a = np.linspace(0, 13, 100001).astype(F32)
  exact = np.array([0.5 * math.erfc(float(x) / math.sqrt(2)) for x in a])
  got = tail32(a, c).astype(np.float64)
  normal = exact > np.finfo(F32).tiny
  ulps = np.abs(got - exact)[normal] / np.spacing(exact[normal].astype(F32))
  print(f"max error {ulps.max():.2f} float32 ulps, mean {ulps.mean():.2f}")
  print("    // poly(t), coefficients from fit_normal_tail.py (Horner, highest degree first).")
  print(f"    float p = {np.format_float_scientific(c[-1], unique=True)}f;")
  for v in c[-2::-1]:
    sign = "-" if v < 0 else "+"
    print(f"    p = p * t {sign} {np.format_float_scientific(abs(v), unique=True)}f;")

if __name__ == "__main__":
  main()
