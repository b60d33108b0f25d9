"""Pure-JAX rotary position embedding: implementation='xla' and the kernels' low-precision
twin in the tests.

Math in float32 whatever the input dtype; output in x.dtype. Pairs: (i, i + r/2) for
layout='half' (Llama, Gemma, Hugging Face), (2i, 2i + 1) for 'interleaved' (GPT-J); pair i
is rotated by angle = position * theta^(-2i/r), i < r/2; features past r pass through.

Angles, exactly in 32-bit integer arithmetic. The usual float32 ``position * inv_freq``
is off by up to ~0.03 rad at position 10^6 from the product's rounding and ~0.06 more
from inv_freq's (on top of what float32 sin/cos do with arguments near 10^6). Only the
angle modulo a full turn matters, so this reference works in turns: ``u_i = inv_freq_i /
(2 pi)`` is computed once per (theta, r) at trace time, to 60 digits with Python's
decimal module, and its fractional part stored as a 64-bit binary fraction in two uint32
words (hi, lo). Then, for an int32 position p (two's complement p' = p mod 2^32), the
angle in turns modulo 1, as a 32-bit fraction, is

    W = (p' * hi + mulhi(p', lo) - (lo if p < 0 else 0)) mod 2^32

which uint32 multiplication (it wraps mod 2^32) and a 16-bit-limb mulhi compute exactly:
the only error is dropping the bits past 2^-32 turn (< 1.5e-9 rad) and u's own 2^-64
rounding times |p| < 2^31 (< 2^-33 turn). No float64, no x64 mode. W's top bits give the
nearest quarter turn q; the rest, in [-1/8, 1/8) turn, becomes a float32 angle in
[-pi/4, pi/4] (rounding ~3e-8 rad), whose sin and cos are swapped and negated by q.
So every position an int32 holds keeps float32 accuracy: ~1e-7 rad, not 10^-1.

Memory: sin and cos are computed on (..., T, r/2) float32 (one per token and frequency,
shared by every head; 16 MiB for 8 x 4096 tokens at r = 128, if XLA materializes them);
the rotation itself is one elementwise pass over x.
"""

from __future__ import annotations

import decimal
import functools

import jax
import jax.numpy as jnp
import numpy as np

LAYOUTS = ("half", "interleaved")

# pi to 100 digits (checked against Machin's formula in tests/test_rope.py).
_PI = decimal.Decimal(
    "3.1415926535897932384626433832795028841971693993751058209749445923078164062862089986280348253421170679")


@functools.lru_cache(maxsize=128)
def turn_words(theta: float, rotary_dim: int) -> tuple[np.ndarray, np.ndarray]:
  """frac(theta^(-2i/r) / (2 pi)) for i < r/2 as 64-bit fractions: (hi, lo) uint32 words."""
  hi, lo = [], []
  with decimal.localcontext() as ctx:
    ctx.prec = 60
    ln_theta = decimal.Decimal(theta).ln()
    two_pi = 2 * _PI
    for i in range(rotary_dim // 2):
      u = (-(decimal.Decimal(2 * i) / rotary_dim) * ln_theta).exp() / two_pi
      frac = u - int(u)                                   # u > 0: int() is floor
      w = int((frac * (1 << 64)).to_integral_value()) % (1 << 64)
      hi.append(w >> 32)
      lo.append(w & 0xFFFFFFFF)
  return np.asarray(hi, np.uint32), np.asarray(lo, np.uint32)


def _mulhi_u32(a, b):
  """The high 32 bits of the 64-bit product of uint32 a and b, exactly, in uint32
  arithmetic: 16-bit limbs, each partial sum below 2^32."""
  m = jnp.uint32(0xFFFF)
  a0, a1 = a & m, a >> 16
  b0, b1 = b & m, b >> 16
  mid1 = a1 * b0 + ((a0 * b0) >> 16)      # <= (2^16-1)^2 + 2^16-1 < 2^32
  mid2 = a0 * b1 + (mid1 & m)             # likewise
  return a1 * b1 + (mid1 >> 16) + (mid2 >> 16)


def angle_turns(positions, theta: float, rotary_dim: int):
  """(angle / 2 pi) mod 1 as a 32-bit fraction: uint32 (..., r/2) for int32 positions (...)."""
  hi, lo = (jnp.asarray(w) for w in turn_words(float(theta), int(rotary_dim)))
  p = positions.astype(jnp.int32)[..., None]
  pu = jax.lax.bitcast_convert_type(p, jnp.uint32)
  w = pu * hi + _mulhi_u32(pu, lo)
  return w - jnp.where(p < 0, lo, jnp.uint32(0))


def sin_cos(positions, theta: float, rotary_dim: int):
  """float32 (sin, cos) of position * theta^(-2i/r), each (..., r/2) for positions (...)."""
  w = angle_turns(positions, theta, rotary_dim)
  q = (w + jnp.uint32(1 << 29)) >> 30                    # nearest quarter turn, 0..3
  rem = jax.lax.bitcast_convert_type(w - (q << 30), jnp.int32)   # [-2^29, 2^29)
  r = rem.astype(jnp.float32) * np.float32(2 * np.pi / 2.0**32)  # [-pi/4, pi/4]
  s, c = jnp.sin(r), jnp.cos(r)
  odd = (q & 1) == 1                                     # a quarter turn swaps them
  a = jnp.where(odd, c, s)
  b = jnp.where(odd, s, c)
  sin = jnp.where((q & 2) != 0, -a, a)                   # a half turn negates both
  cos = jnp.where(((q + 1) & 2) != 0, -b, b)
  return sin, cos


def rope(x, positions, *, theta=10000.0, layout="half", rotary_dim=None):
  """RoPE of x (..., T, N, H) at int positions x.shape[:-2] or (T,). See jaxgpu.rope."""
  if layout not in LAYOUTS:
    raise ValueError(f"rope: layout must be one of {LAYOUTS}, got {layout!r}")
  dim = x.shape[-1]
  r = dim if rotary_dim is None else int(rotary_dim)
  half = r // 2
  positions = jnp.asarray(positions)
  sin, cos = sin_cos(positions, theta, r)
  sin, cos = sin[..., None, :], cos[..., None, :]        # (..., T, 1, r/2): every head
  xr = x[..., :r].astype(jnp.float32)
  if layout == "half":
    a, b = xr[..., :half], xr[..., half:]
    out = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
  else:
    a, b = xr[..., 0::2], xr[..., 1::2]
    out = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(xr.shape)
  out = out.astype(x.dtype)
  if r < dim:
    out = jnp.concatenate([out, x[..., r:]], axis=-1)
  return out
