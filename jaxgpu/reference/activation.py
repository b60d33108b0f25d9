"""Pure-JAX activations and gated units: implementation='xla' and the twin of the kernels.

Math in float32 whatever the input dtype (as the kernels), then rounded once to the input
dtype; the activations themselves are jax.nn's, so the semantics are jax.nn's (relu's
gradient at 0 is 0; gelu's tanh and erf forms).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _f32(x):
  return x.astype(jnp.float32)


def relu(x):
  return jax.nn.relu(_f32(x)).astype(x.dtype)


def sigmoid(x):
  return jax.nn.sigmoid(_f32(x)).astype(x.dtype)


def silu(x):
  return jax.nn.silu(_f32(x)).astype(x.dtype)


def gelu(x, *, approximate=True):
  return jax.nn.gelu(_f32(x), approximate=approximate).astype(x.dtype)


def swiglu(gate, up):
  return (jax.nn.silu(_f32(gate)) * _f32(up)).astype(gate.dtype)


def geglu(gate, up, *, approximate=True):
  return (jax.nn.gelu(_f32(gate), approximate=approximate) * _f32(up)).astype(gate.dtype)
