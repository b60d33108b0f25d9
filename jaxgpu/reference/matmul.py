"""Pure-JAX linear layers: implementation='xla' and the twin of the matmul kernels.

`linear` is ``act(x @ w + bias)`` with float32 accumulation (float32 inputs at full float32
precision, not TF32) and one rounding to x's dtype at the end; activations are jax.nn's.

The quantized weight's packed layout (ffi/matmul/qlinear_params.h) is built and read here:
`pack` / `unpack` move between unsigned integers q (K, N) and the int32 tiles the kernels
stream, `quantize` makes (q, scales, zeros) from a float weight, `dequantize` is the
weight the kernels multiply by: ``round_T((q - z) * s)`` per group of `group_size` rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ACTIVATIONS = (None, "relu", "gelu", "gelu_exact", "silu")

# Tile of the packed layout: 16 output features x 64 k (see qlinear_params.h).
TILE_N = 16
TILE_K = 64
# The packed words' order within a tile, as axes of the unpacked q reshaped to
# (KT, S=4, KH=2, T=4, E=2, NT, H=2, G=8) (k = 64 kt + 16 s + 8 kh + 2 t + e, feature
# n = 16 nt + 8 h + g): lane 4 g + t, then int4 word s and nibble 4 e + 2 kh + h, or int8
# word 2 s + kh and byte 2 h + e.
_ORDER = {4: (0, 5, 7, 3, 1, 4, 2, 6), 8: (0, 5, 7, 3, 1, 2, 6, 4)}


def words_per_lane(bits: int) -> int:
  return 4 if bits == 4 else 8


def activate(z, activation):
  """The activation of a float32 array."""
  if activation is None:
    return z
  if activation == "relu":
    return jax.nn.relu(z)
  if activation == "gelu":
    return jax.nn.gelu(z, approximate=True)
  if activation == "gelu_exact":
    return jax.nn.gelu(z, approximate=False)
  if activation == "silu":
    return jax.nn.silu(z)
  raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")


def matmul_f32(x, w, out_sharding=None):
  """x @ w accumulated in float32 (full float32 precision for float32 inputs).
  out_sharding: the result's PartitionSpec on an Explicit mesh (jax asks for it when the
  contracted dim is sharded)."""
  precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
  kw = {} if out_sharding is None else {"out_sharding": out_sharding}
  return jnp.matmul(x, w, preferred_element_type=jnp.float32, precision=precision, **kw)


def linear(x, w, bias=None, *, activation=None, out_sharding=None):
  """act(x @ w + bias): x (..., K), w (K, N), bias (N,); in x's dtype."""
  z = matmul_f32(x, w, out_sharding)
  if bias is not None:
    z = z + bias.astype(jnp.float32)
  return activate(z, activation).astype(x.dtype)


def _tiles(size: int, tile: int) -> int:
  return -(-size // tile)


def pack(q, bits: int):
  """Unsigned integers q (K, N) in [0, 2^bits) -> int32 (ceil(K/64), ceil(N/16), 32 * words)."""
  k, n = q.shape
  kt, nt = _tiles(k, TILE_K), _tiles(n, TILE_N)
  q = jnp.pad(q.astype(jnp.uint32), ((0, kt * TILE_K - k), (0, nt * TILE_N - n)))
  q = q.reshape(kt, 4, 2, 4, 2, nt, 2, 8).transpose(_ORDER[bits])
  per_word = 8 if bits == 4 else 4
  q = q.reshape(kt, nt, 32 * words_per_lane(bits), per_word)
  shifts = jnp.arange(per_word, dtype=jnp.uint32) * bits
  words = jnp.sum(q << shifts, axis=-1, dtype=jnp.uint32)
  return jax.lax.bitcast_convert_type(words, jnp.int32)


def unpack(packed, bits: int, k: int, n: int):
  """The inverse of `pack`: int32 q (K, N)."""
  kt, nt = packed.shape[-3], packed.shape[-2]
  per_word = 8 if bits == 4 else 4
  words = jax.lax.bitcast_convert_type(packed, jnp.uint32)
  shifts = jnp.arange(per_word, dtype=jnp.uint32) * bits
  q = (words[..., None] >> shifts) & jnp.uint32((1 << bits) - 1)
  q = q.reshape(kt, nt, 8, 4, 4, 2, 2, 2)
  inverse = [0] * 8
  for i, axis in enumerate(_ORDER[bits]):
    inverse[axis] = i
  q = q.transpose(inverse).reshape(kt * TILE_K, nt * TILE_N)
  return q[:k, :n].astype(jnp.int32)


def dequantize(q, scales, zeros, *, bits: int, group_size: int, dtype):
  """round_dtype((q - z) * s): q (K, N) int, scales / zeros (K / group_size, N)."""
  k = q.shape[0]
  z = (jnp.int32(1 << (bits - 1)) if zeros is None
       else jnp.repeat(zeros.astype(jnp.int32), group_size, axis=0, total_repeat_length=k))
  s = jnp.repeat(scales, group_size, axis=0, total_repeat_length=k)
  # q - z is an integer of at most 9 bits and s a 16-bit float: the product is exact in
  # float32, so one rounding to dtype, as the kernels' half-precision multiply.
  return ((q - z).astype(jnp.float32) * s.astype(jnp.float32)).astype(dtype)


def quantize(w, *, bits: int, group_size: int, symmetric: bool, scale_dtype):
  """(q (K, N) int32 unsigned, scales (K / group_size, N) scale_dtype, zeros uint8 | None).

  Symmetric: s = max|w| / (2^(bits-1) - 1) per group, q = round(w / s) + 2^(bits-1) (the
  zero point implied). Asymmetric: the group's range [min(w, 0), max(w, 0)] over 2^bits - 1
  steps, zero point z = round(-min / s), q = clip(round(w / s) + z). q is computed from the
  scale as stored, so dequantize(q) is the weight the kernels use.
  """
  k, n = w.shape
  wf = w.astype(jnp.float32).reshape(k // group_size, group_size, n)
  levels = (1 << bits) - 1
  if symmetric:
    qmax = (1 << (bits - 1)) - 1
    amax = jnp.max(jnp.abs(wf), axis=1)
    s = jnp.where(amax > 0, amax / qmax, 1.0).astype(scale_dtype)
    sf = s.astype(jnp.float32)[:, None, :]
    q = jnp.clip(jnp.round(wf / sf), -qmax, qmax) + (1 << (bits - 1))
    zeros = None
  else:
    lo = jnp.minimum(jnp.min(wf, axis=1), 0.0)
    hi = jnp.maximum(jnp.max(wf, axis=1), 0.0)
    s = jnp.where(hi > lo, (hi - lo) / levels, 1.0).astype(scale_dtype)
    sf = s.astype(jnp.float32)
    z = jnp.clip(jnp.round(-lo / sf), 0, levels)
    q = jnp.clip(jnp.round(wf / sf[:, None, :]) + z[:, None, :], 0, levels)
    zeros = z.astype(jnp.uint8)
  return q.reshape(k, n).astype(jnp.int32), s, zeros
