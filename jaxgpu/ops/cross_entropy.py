"""Cross-entropy over a vocabulary, with ignore_index, label smoothing and the Gemma 2 logit
softcap fused; forward and backward.

Kernels: ffi/cross_entropy/ (targets jaxgpu_cross_entropy_{fwd,bwd}). Reference:
jaxgpu/reference/cross_entropy.py. Tests: tests/test_cross_entropy.py. Benchmarks:
benchmarks/bench_cross_entropy.py.

Memory. The forward kernel reads the logits once (online max and log-sum-exp, the label's
logit, and the sum of logits for label smoothing) and writes two float32 per position:
the loss and the log-sum-exp, which is all the backward pass keeps besides the logits
and labels themselves. The backward kernel reads the logits once and writes dlogits once,
in the logits' dtype. No float32 copy of the logits and no logits-sized temporary is made
in either pass; the reductions ('mean', 'sum') are jnp sums over the per-position losses
(N floats). Ignored and out-of-range positions are not read at all: the forward pass
writes their loss (0 or NaN) directly, the backward pass a row of zeros. Under vmap with
only the labels batched, the shared logits are broadcast to the batch (a copy per
example), as the per-example losses need them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpu import _autodiff, _checks, _implementation
from jaxgpu._family import Family, Op
from jaxgpu._kernel_op import Layout, grouped_call, match_primal_types, primal_types
from jaxgpu.reference import cross_entropy as reference

CROSS_ENTROPY = Op("cross_entropy",
                   {"fwd": "jaxgpu_cross_entropy_fwd", "bwd": "jaxgpu_cross_entropy_bwd"})
FAMILY = Family("cross_entropy", (CROSS_ENTROPY,))


_LOGITS = "g ... d"    # (G, ...positions, V): V is gathered if sharded
_ROW = "g ..."         # (G, ...positions): labels, loss, lse, dloss

REDUCTIONS = ("mean", "sum", "none")
# Columns are 32-bit in the kernels (labels are int32); 2^30 leaves headroom for their
# index arithmetic. Gemma's vocabulary is 2^18.
_MAX_VOCAB = 1 << 30


@dataclasses.dataclass(frozen=True)
class _Config:
  implementation: str | None  # 'cpu', 'cuda', or None (platform-generic)
  ignore_index: int | None
  label_smoothing: float
  softcap: float | None
  primal_types: tuple = (None,)  # of logits (see _kernel_op)

  def target(self, pass_: str) -> str:
    return CROSS_ENTROPY.target(pass_, self.implementation)

  def attrs(self) -> dict:
    return dict(ignore_index=np.int32(0 if self.ignore_index is None else self.ignore_index),
                has_ignore=self.ignore_index is not None,
                label_smoothing=np.float32(self.label_smoothing),
                softcap=np.float32(0.0 if self.softcap is None else self.softcap))


# ---- inner ops: FFI calls under the shared vmap / sharding rules ---------------------------


def _fwd_call(cfg: _Config, logits, labels):
  """Grouped (G, ..., V) logits and (G, ...) labels in; per-position (loss, lse) out.

  No reshapes: the handlers take any leading shape (a reshape merging sharded dims is
  refused under Explicit sharding, where this also runs for eval_shape)."""

  def local_fn(logits, labels):
    stat = jax.ShapeDtypeStruct(labels.shape, jnp.float32)
    return tuple(jax.ffi.ffi_call(cfg.target("fwd"), (stat, stat))(logits, labels, **cfg.attrs()))

  layout = Layout(inputs=(_LOGITS, _ROW), outputs=(_ROW, _ROW))
  return grouped_call(local_fn, layout, logits, labels)


def _bwd_call(cfg: _Config, logits, labels, lse, dloss):
  """Grouped arrays in; dlogits (G, ..., V) in the logits' dtype out."""

  def local_fn(logits, labels, lse, dloss):
    out = jax.ShapeDtypeStruct(logits.shape, logits.dtype)
    return tuple(jax.ffi.ffi_call(cfg.target("bwd"), (out,))(logits, labels, lse, dloss,
                                                             **cfg.attrs()))

  layout = Layout(inputs=(_LOGITS, _ROW, _ROW, _ROW), outputs=(_LOGITS,))
  (dlogits,) = grouped_call(local_fn, layout, logits, labels, lse, dloss)
  return dlogits


# ---- the differentiable op ------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _losses(cfg: _Config, logits, labels):
  loss, _ = _fwd_call(cfg, logits[None], labels[None])
  return loss[0]


def _losses_fwd(cfg: _Config, logits, labels):
  loss, lse = _fwd_call(cfg, logits[None], labels[None])
  return loss[0], (logits, labels, lse)


def _losses_bwd(cfg: _Config, saved, dloss):
  logits, labels, lse = saved
  dlogits = _bwd_call(cfg, logits[None], labels[None], lse, dloss.astype(jnp.float32)[None])[0]
  (dlogits,) = match_primal_types((dlogits,), cfg.primal_types)
  return dlogits, None


_losses.defvjp(_losses_fwd, _losses_bwd)


# ---- public API ---------------------------------------------------------------------------


def _check_labels_in_range(op: str, labels, vocab: int, ignore_index) -> None:
  """Concrete labels (numpy, or a jax array outside a trace) are checked here, once; traced
  labels cannot be, and the kernels treat an out-of-range label as documented instead."""
  if isinstance(labels, jax.core.Tracer):
    return
  lab = np.asarray(labels)
  bad = (lab < 0) | (lab >= vocab)
  if ignore_index is not None:
    bad &= lab != ignore_index
  if bad.any():
    where = np.unravel_index(int(np.argmax(bad)), lab.shape) if lab.ndim else ()
    allowed = f"[0, {vocab})"
    if ignore_index is not None:
      allowed += f" or {ignore_index} (ignore_index)"
    raise ValueError(f"{op}: labels must be in {allowed}; got {lab[where]!r} at index "
                     f"{tuple(int(i) for i in where)} ({int(bad.sum())} out of range)")


def _check(op, logits, labels, ignore_index, label_smoothing, logit_softcap, reduction):
  logits = _checks.float_array(op, "logits", logits)
  _checks.min_rank(op, "logits", logits, 1)
  vocab = logits.shape[-1]
  if not 1 <= vocab < _MAX_VOCAB:
    raise ValueError(f"{op}: logits' last dim (the vocabulary) must be in [1, 2^30), got {vocab}")
  labels, ignore_index, ls, softcap = check_loss_options(
      op, labels, logits.shape[:-1], "the leading dims of logits", vocab, ignore_index,
      label_smoothing, logit_softcap, reduction)
  return logits, labels, ignore_index, ls, softcap


def check_loss_options(op, labels, rows_shape, rows_what, vocab, ignore_index, label_smoothing,
                       logit_softcap, reduction):
  """The labels (as int32, of shape rows_shape) and the loss options of a cross-entropy over
  `vocab` classes, checked (errors name the argument); shared with linear_cross_entropy."""
  labels = _checks.as_array(op, "labels", labels)
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise TypeError(f"{op}: labels must have an integer dtype (int32), got {labels.dtype}")
  _checks.shape_is(op, "labels", labels, tuple(rows_shape), rows_what)
  if ignore_index is not None:
    if isinstance(ignore_index, jax.core.Tracer):
      raise TypeError(f"{op}: ignore_index must be a static Python int, not a traced value")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, (int, np.integer)):
      raise TypeError(f"{op}: ignore_index must be None or an int, got "
                      f"{type(ignore_index).__name__}")
    ignore_index = int(ignore_index)
    if not -2**31 <= ignore_index < 2**31:
      raise ValueError(f"{op}: ignore_index must fit in int32, got {ignore_index}")
  ls = _checks.static_number(op, "label_smoothing", label_smoothing)
  if not (0.0 <= ls < 1.0):
    raise ValueError(f"{op}: label_smoothing must be in [0, 1), got {label_smoothing!r}")
  softcap = None
  if logit_softcap is not None:
    softcap = _checks.positive_finite(op, "logit_softcap", logit_softcap)
  if not isinstance(reduction, str) or reduction not in REDUCTIONS:
    raise ValueError(f"{op}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
  _check_labels_in_range(op, labels, vocab, ignore_index)
  if labels.dtype != jnp.int32:
    labels = jnp.asarray(labels)
    info = jnp.iinfo(labels.dtype)
    if info.max > 2**31 - 1 or info.min < -2**31:
      # Clipped, not wrapped: a traced int64 label of 2^32 + 5 must stay out of range.
      labels = jnp.clip(labels, -2**31, 2**31 - 1)
    labels = labels.astype(jnp.int32)
  return labels, ignore_index, ls, softcap


def cross_entropy(logits, labels, *, ignore_index=None, label_smoothing=0.0, logit_softcap=None,
                  reduction="mean", implementation=None):
  """Softmax cross-entropy of integer labels over the last axis, loss in float32.

  Args:
    logits: (..., V) float32, bfloat16 or float16; any number of leading dims; V >= 1
      (up to 262144 and beyond: rows are streamed, never held whole).
    labels: (...) int32, the leading shape of logits (other integer dtypes are converted).
      Concrete labels (numpy, or jax arrays outside jit) outside [0, V) that are not
      ignore_index raise ValueError. Traced labels cannot be checked: such a position's
      loss is NaN (so a 'mean' or 'sum' is NaN) and its gradient 0; the kernels never read
      outside the row.
    ignore_index: None, or an int: positions with this label have loss 0 and gradient 0
      and are left out of the mean's count (PyTorch's ignore_index, which defaults to -100
      there; here there is no default).
    label_smoothing: in [0, 1). The target is (1 - ls) * onehot(label) + ls / V, as in
      PyTorch's CrossEntropyLoss(label_smoothing=) and optax's smoothed labels.
    logit_softcap: None, or c > 0: z = c * tanh(logits / c) (Gemma 2) before the softmax.
    reduction: 'mean' (over positions not ignored; 0 when every position is ignored, never
      NaN), 'sum', or 'none' (per-position losses, shape labels.shape).
    implementation: None (the FFI kernel of the platform the computation runs on),
      'cuda', 'cpu', or 'xla' (the pure-JAX reference).

  Returns:
    A float32 scalar ('mean', 'sum') or a float32 array of shape labels.shape ('none').

  Equivalent pure JAX::

    z = logits.astype(jnp.float32)
    if logit_softcap is not None:
      z = logit_softcap * jnp.tanh(z / logit_softcap)
    lse = jax.nn.logsumexp(z, axis=-1)
    z_label = jnp.take_along_axis(z, labels[..., None], axis=-1)[..., 0]
    loss = lse - (1 - label_smoothing) * z_label - label_smoothing * jnp.mean(z, axis=-1)
    valid = labels != ignore_index                    # all True without ignore_index
    loss = jnp.where(valid, loss, 0.0)
    mean = loss.sum() / jnp.maximum(valid.sum(), 1)

  The gradient with respect to logits is written by one backward kernel in the logits'
  dtype: dloss * (softmax(z) - (1 - ls) * onehot(label) - ls / V), times 1 - tanh^2 with a
  softcap. labels get no gradient. Works under jit, grad, vmap, shard_map and pmap. Under
  jit with the leading dims sharded, the per-position losses keep the sharding with no
  collective; 'sum' then all-reduces one float32 scalar and 'mean' also the int32 count
  of non-ignored positions (none without ignore_index), which XLA inserts for the jnp
  sums; the backward pass adds no collective. A sharded vocabulary axis is gathered
  first (correct, but every device then holds whole rows). Forward mode (jax.jvp) and
  second derivatives run the reference.
  """
  op = "cross_entropy"
  logits, labels, ignore_index, ls, softcap = _check(op, logits, labels, ignore_index,
                                                     label_smoothing, logit_softcap, reduction)
  impl = _autodiff.route(_implementation.resolve(implementation), logits)
  if impl == "xla" or logits.size == 0:
    return reference.cross_entropy(logits, labels, ignore_index=ignore_index,
                                   label_smoothing=ls, logit_softcap=softcap, reduction=reduction)
  cfg = _Config(impl, ignore_index, ls, softcap, primal_types(logits))
  losses = _losses(cfg, logits, labels)
  return reference.reduce_losses(losses, labels, reduction, ignore_index)
