"""Pure-JAX softmax: implementation='xla' and the low-precision twin of the tests' oracle.

Logits ``x * scale`` and statistics in float32 whatever the input dtype; output in x.dtype.
Kept positions are those where ``mask`` (broadcast to x) is True and, with ``is_causal``,
key j <= query i (top-left aligned, as ``jnp.tril``). Unlike ``jax.nn.softmax(where=...)``,
a row with nothing kept (or whose kept logits are all -inf) is all zeros, and so is its
gradient; never NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_keep(t: int, s: int) -> jax.Array:
  """(T, S) bool: query i keeps keys j <= i (the first min(i + 1, S) keys)."""
  return jnp.arange(s)[None, :] <= jnp.arange(t)[:, None]


def keep_mask(shape, is_causal: bool = False, mask=None):
  """The kept positions as a bool array broadcastable to `shape`, or None (all kept)."""
  keep = mask
  if is_causal:
    c = causal_keep(shape[-2], shape[-1])
    keep = c if keep is None else jnp.logical_and(keep, c)
  return keep


def softmax(x, *, scale=None, is_causal=False, mask=None):
  xf = x.astype(jnp.float32)
  if scale is not None:
    xf = xf * jnp.float32(scale)
  keep = keep_mask(x.shape, is_causal, mask)
  if keep is not None:
    xf = jnp.where(keep, xf, -jnp.inf)
  m = jnp.max(xf, axis=-1, keepdims=True, initial=-jnp.inf)  # (S = 0: -inf, not an error)
  # Nothing kept (max -inf): shift by 0 instead, so every exp is 0 rather than NaN.
  m = jax.lax.stop_gradient(jnp.where(m == -jnp.inf, 0.0, m))
  e = jnp.exp(xf - m)
  s = jnp.sum(e, axis=-1, keepdims=True)
  # s == 0 only when nothing is kept: e is 0 there, and dividing by 1 keeps the gradient 0.
  y = e / jnp.where(s == 0, 1.0, s)
  return y.astype(x.dtype)
