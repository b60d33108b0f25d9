"""Pure-JAX fused linear + cross-entropy: implementation='xla' and the low-precision twin of
the tests' float64 oracle. What a JAX user writes without jaxgpu: the logits x @ w.T (or
x @ w) in the inputs' dtype with float32 accumulation, then the cross-entropy
(jaxgpu/reference/cross_entropy.py); XLA keeps the (..., V) logits."""

from __future__ import annotations

import jax.numpy as jnp

from jaxgpu.reference import cross_entropy as ce

EQUATIONS = {"vd": "...d,vd->...v", "dv": "...d,dv->...v"}


def logits(x, w, w_layout="vd"):
  """(..., V) logits in x's dtype (float32 accumulation, one rounding)."""
  z = jnp.einsum(EQUATIONS[w_layout], x, w, preferred_element_type=jnp.float32)
  return z.astype(x.dtype)


def linear_cross_entropy(x, w, labels, *, w_layout="vd", ignore_index=None,
                         label_smoothing=0.0, logit_softcap=None, reduction="mean"):
  return ce.cross_entropy(logits(x, w, w_layout), labels, ignore_index=ignore_index,
                          label_smoothing=label_smoothing, logit_softcap=logit_softcap,
                          reduction=reduction)
