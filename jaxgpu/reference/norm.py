"""Pure-JAX normalization: implementation='xla' and the oracle of the kernels' tests.

Statistics in float32 whatever the input dtype; output in x.dtype. With a residual,
h = x + residual is formed in x.dtype (rounded once) and normalized. weight and bias are
applied in float32, so float32 parameters beside a 16-bit x (master weights) are used
unrounded and their gradients are float32 sums, as in the kernels.
"""

from __future__ import annotations

import jax.numpy as jnp


def _pre_norm(x, residual):
  if residual is None:
    return x, None
  h = x + residual
  return h, h


def rms_norm(x, weight=None, *, residual=None, eps=1e-6, weight_offset=0.0):
  h, h_out = _pre_norm(x, residual)
  hf = h.astype(jnp.float32)
  y = hf * jnp.reciprocal(jnp.sqrt(jnp.mean(hf * hf, axis=-1, keepdims=True) + eps))
  if weight is not None:
    y = y * (weight_offset + weight.astype(jnp.float32))
  y = y.astype(x.dtype)
  return y if h_out is None else (y, h_out)


def layer_norm(x, weight=None, bias=None, *, residual=None, eps=1e-5):
  h, h_out = _pre_norm(x, residual)
  hf = h.astype(jnp.float32)
  mean = jnp.mean(hf, axis=-1, keepdims=True)
  c = hf - mean
  y = c * jnp.reciprocal(jnp.sqrt(jnp.mean(c * c, axis=-1, keepdims=True) + eps))
  if weight is not None:
    y = y * weight.astype(jnp.float32)
  if bias is not None:
    y = y + bias.astype(jnp.float32)
  y = y.astype(x.dtype)
  return y if h_out is None else (y, h_out)
