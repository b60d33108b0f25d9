"""Pure-JAX cross-entropy: implementation='xla' and the low-precision twin of the tests'
float64 oracle.

Loss in float32 whatever the logits dtype; optax-style: log-sum-exp over the last axis and
a gather of the label's logit, which XLA fuses into reductions over the logits.
Semantics (the kernels' too, see jaxgpu/ops/cross_entropy.py):
  z    = logits, or softcap * tanh(logits / softcap)
  loss = (1 - ls) * (lse(z) - z[label]) + ls * (lse(z) - mean(z))
A label equal to ignore_index gives loss 0 (and no gradient) and is left out of the
mean's count; a label outside [0, V) otherwise gives a NaN loss and a zero gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _vocab_sharded_explicitly(z) -> bool:
  sharding = getattr(jax.typeof(z), "sharding", None)
  spec = tuple(getattr(sharding, "spec", ()) or ())
  types = getattr(getattr(sharding, "mesh", None), "axis_types", ()) or ()
  explicit = any(t == jax.sharding.AxisType.Explicit for t in types)
  return explicit and len(spec) == z.ndim and spec[-1] is not None


def _label_logit(z, labels):
  """z[..., label]: a gather (optax's take_along_axis), or, when the vocabulary axis is
  sharded on an Explicit mesh (where the gather's output sharding cannot be resolved),
  a masked sum over it, which XLA fuses into a reduction."""
  if _vocab_sharded_explicitly(z):
    hit = jnp.arange(z.shape[-1]) == labels[..., None]
    return jnp.sum(jnp.where(hit, z, 0.0), axis=-1)
  return jnp.take_along_axis(z, labels[..., None], axis=-1)[..., 0]


def cross_entropy_rows(logits, labels, *, ignore_index=None, label_smoothing=0.0,
                       logit_softcap=None):
  """Per-position losses, float32, shape labels.shape."""
  vocab = logits.shape[-1]
  z = logits.astype(jnp.float32)
  if logit_softcap is not None:
    z = logit_softcap * jnp.tanh(z / logit_softcap)
  lse = jax.nn.logsumexp(z, axis=-1)
  labels = labels.astype(jnp.int32)
  in_range = (labels >= 0) & (labels < vocab)
  z_label = _label_logit(z, jnp.clip(labels, 0, vocab - 1))
  loss = lse - (1.0 - label_smoothing) * z_label
  if label_smoothing:
    loss = loss - label_smoothing * jnp.mean(z, axis=-1)
  loss = jnp.where(in_range, loss, jnp.nan)
  if ignore_index is not None:
    loss = jnp.where(labels == ignore_index, 0.0, loss)
  return loss


def valid_count(labels, ignore_index=None):
  """Positions the mean divides by: those whose label is not ignore_index (float32)."""
  if ignore_index is None:
    return jnp.float32(labels.size)
  return jnp.sum(labels != ignore_index, dtype=jnp.int32).astype(jnp.float32)


def reduce_losses(losses, labels, reduction, ignore_index=None):
  """'none': the per-position losses; 'sum': their sum; 'mean': the sum over the count of
  non-ignored positions, 0 when every position is ignored (never NaN)."""
  if reduction == "none":
    return losses
  total = jnp.sum(losses)
  if reduction == "sum":
    return total
  return total / jnp.maximum(valid_count(labels, ignore_index), 1.0)


def cross_entropy(logits, labels, *, ignore_index=None, label_smoothing=0.0, logit_softcap=None,
                  reduction="mean"):
  losses = cross_entropy_rows(logits, labels, ignore_index=ignore_index,
                              label_smoothing=label_smoothing, logit_softcap=logit_softcap)
  return reduce_losses(losses, labels, reduction, ignore_index)
