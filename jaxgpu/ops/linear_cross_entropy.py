"""The language-model head without its logits: the output projection fused with the
cross-entropy, forward and backward.

Kernels: ffi/linear_cross_entropy/ (targets jaxgpu_linear_cross_entropy_{fwd,bwd}).
Reference: jaxgpu/reference/linear_cross_entropy.py. Tests:
tests/test_linear_cross_entropy.py. Benchmarks: benchmarks/bench_linear_cross_entropy.py.

Algorithm. The vocabulary is walked in chunks of columns. Forward: each chunk's logits
(rows, chunk) = x w_chunk^T on tensor cores (cuBLASLt, float32 accumulation, rounded to x's
dtype as XLA's x @ w.T would be), then one row kernel folds the chunk into each row's running
(max, sum of exp), label logit and logit sum; only those per-row floats leave the op (and the
log-sum-exp is kept for the backward pass). Backward: each chunk's logits again, the
gradient dlogits in place, then dx += dlogits w_chunk (float32, across chunks) and
dw_chunk = dlogits^T x (written once). Every product accumulates in float32 and each output
is rounded once; the price of never holding the logits is recomputing them once in the
backward pass (four GEMMs per training step instead of three).

Memory (CUDA). One scratch per call: a (rows, chunk) logits chunk of at most 256 MiB in x's
dtype (chunk = the vocabulary, or the widest multiple of 256 columns that fits), cuBLASLt's
32 MiB workspace, and in the forward pass 4 bytes per row; the backward pass's dx is
float32 (rows, D) before its cast. At 8192 tokens x D 2304 x V 262144 (bf16) that is ~360 MiB
of temporaries, where XLA's x @ w.T + cross-entropy keeps 12 GiB. On CPU the op allocates
float32 copies of x and w per group.

Sharding (the Layout below, through jaxgpu._kernel_op): rows split with no collective
(a 'mean' then sums its per-row losses over the devices: one scalar, and the count of
non-ignored rows); w split along the vocabulary (a vocabulary-parallel head) gives each
device its slice's log-sum-exp, label logit and logit sum, combined across the slice's
devices by an all-gather of one float per row (log-sum-exp) and two all-reduces of one
float per row; the backward pass all-reduces the float32 (rows, D) dx over the vocabulary
shards and the weight gradient over the row shards. No logits and no weight are gathered.
D is gathered if split.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpu import _autodiff, _checks, _implementation
from jaxgpu._family import Family, Op
from jaxgpu._kernel_op import (LSE, SUM, Layout, grouped_call, match_primal_types,
                               primal_types)
from jaxgpu.ops.cross_entropy import check_loss_options
from jaxgpu.reference import cross_entropy as ce_reference
from jaxgpu.reference import linear_cross_entropy as reference

LINEAR_CROSS_ENTROPY = Op("linear_cross_entropy",
                          {"fwd": "jaxgpu_linear_cross_entropy_fwd",
                           "bwd": "jaxgpu_linear_cross_entropy_bwd"})
FAMILY = Family("linear_cross_entropy", (LINEAR_CROSS_ENTROPY,))

W_LAYOUTS = ("vd", "dv")
_W = {"vd": "[g] v d", "dv": "[g] d v"}
_DW = {"vd": "g v d", "dv": "g d v"}
_X = "g ... d"
_ROW = "g ..."
_IDS = "[g] v"
# The logits chunk's budget: 256 MiB keeps a chunk's GEMM large (>= 2048 columns at 64k rows
# of bf16) while the scratch stays under 1/16 of what XLA keeps at 8192 x 262144.
_CHUNK_BYTES = 256 << 20
_CHUNK_MULTIPLE = 256
_CUBLASLT_WORKSPACE = 32 << 20
_MAX_VOCAB = 1 << 30


@dataclasses.dataclass(frozen=True)
class _Config:
  implementation: str | None
  w_layout: str
  vocab: int  # the whole vocabulary (ls / vocab, the range of labels)
  ignore_index: int | None
  label_smoothing: float
  softcap: float | None
  primal_types: tuple = (None, None)  # of x and w (see _kernel_op)

  def target(self, pass_: str) -> str:
    return LINEAR_CROSS_ENTROPY.target(pass_, self.implementation)

  @property
  def on_cuda(self) -> bool:
    return _implementation.runs_on_cuda(self.implementation)

  def attrs(self, chunk: int) -> dict:
    return dict(softcap=np.float32(0.0 if self.softcap is None else self.softcap),
                w_layout=np.int32(W_LAYOUTS.index(self.w_layout)), chunk=np.int64(chunk))


def _chunk(rows: int, vocab: int, dtype) -> int:
  """Vocabulary columns per chunk: all of them when the (rows, vocab) logits fit the budget,
  else the widest multiple of 256 that does (at least 256)."""
  itemsize = jnp.dtype(dtype).itemsize
  if rows * vocab * itemsize <= _CHUNK_BYTES or vocab <= _CHUNK_MULTIPLE:
    return max(vocab, 1)
  cols = _CHUNK_BYTES // (max(rows, 1) * itemsize) // _CHUNK_MULTIPLE * _CHUNK_MULTIPLE
  return max(_CHUNK_MULTIPLE, min(cols, vocab))


def _scratch(cfg: _Config, groups: int, rows: int, chunk: int, dtype, fwd: bool):
  """The CUDA handlers' scratch (their Carve): the logits chunk, the forward pass's row
  sums, cuBLASLt's workspace; nothing on CPU."""
  if not cfg.on_cuda:
    return jax.ShapeDtypeStruct((0,), jnp.uint8)
  align = lambda n: -(-n // 256) * 256
  logits = align(rows * chunk * jnp.dtype(dtype).itemsize)
  sums = align(groups * rows * 4) if fwd else 0
  return jax.ShapeDtypeStruct((logits + sums + _CUBLASLT_WORKSPACE,), jnp.uint8)


def _sizes(cfg: _Config, x, w):
  """(rows per group, vocabulary columns per chunk) of a call on these local arrays."""
  rows = math.prod(x.shape[1:-1])
  vocab = w.shape[-2] if cfg.w_layout == "vd" else w.shape[-1]
  return rows, _chunk(rows, vocab, x.dtype)


# ---- inner ops: FFI calls under the shared vmap / sharding rules ---------------------------


def _fwd_call(cfg: _Config, x, w, labels, vocab_ids):
  """(G, ..., D) x, (1|G, V, D) or (1|G, D, V) w, (G, ...) labels, (1, V) global ids in; per
  row (lse, zlabel, zsum) over the vocabulary out (combined across vocabulary shards)."""

  def local_fn(x, w, labels, vocab_ids):
    rows, chunk = _sizes(cfg, x, w)
    stat = jax.ShapeDtypeStruct(labels.shape, jnp.float32)
    scratch = _scratch(cfg, x.shape[0], rows, chunk, x.dtype, fwd=True)
    outs = jax.ffi.ffi_call(cfg.target("fwd"), (stat, stat, stat, scratch))(
        x, w, labels, vocab_ids, **cfg.attrs(chunk))
    return tuple(outs[:3])

  layout = Layout(inputs=(_X, _W[cfg.w_layout], _ROW, _IDS), outputs=(_ROW, _ROW, _ROW),
                  combine={0: LSE, 1: SUM, 2: SUM})
  return grouped_call(local_fn, layout, x, w, labels, vocab_ids)


def _bwd_call(cfg: _Config, x, w, labels, vocab_ids, lse, dloss):
  """dx (G, ..., D) float32 and dw (G, V, D) or (G, D, V) in w's dtype."""

  def local_fn(x, w, labels, vocab_ids, lse, dloss):
    rows, chunk = _sizes(cfg, x, w)
    dx = jax.ShapeDtypeStruct(x.shape, jnp.float32)
    dw = jax.ShapeDtypeStruct(x.shape[:1] + w.shape[1:], w.dtype)
    scratch = _scratch(cfg, x.shape[0], rows, chunk, x.dtype, fwd=False)
    outs = jax.ffi.ffi_call(cfg.target("bwd"), (dx, dw, scratch))(
        x, w, labels, vocab_ids, lse, dloss, label_smoothing=np.float32(cfg.label_smoothing),
        vocab_total=np.int64(cfg.vocab), **cfg.attrs(chunk))
    return tuple(outs[:2])

  layout = Layout(inputs=(_X, _W[cfg.w_layout], _ROW, _IDS, _ROW, _ROW),
                  outputs=(_X, _DW[cfg.w_layout]))
  return grouped_call(local_fn, layout, x, w, labels, vocab_ids, lse, dloss)


# ---- the differentiable op ------------------------------------------------------------------


def _counted(cfg: _Config, labels):
  """Rows whose loss is a number with a gradient: label in range and not ignored."""
  ok = (labels >= 0) & (labels < cfg.vocab)
  if cfg.ignore_index is not None:
    ok &= labels != cfg.ignore_index
  return ok


def _forward(cfg: _Config, x, w, labels):
  ids = jnp.arange(cfg.vocab, dtype=jnp.int32)[None]
  lse, zlabel, zsum = (a[0] for a in _fwd_call(cfg, x[None], w[None], labels[None], ids))
  ls = cfg.label_smoothing
  loss = lse - (1.0 - ls) * zlabel
  if ls:
    loss = loss - ls * zsum / cfg.vocab
  loss = jnp.where((labels >= 0) & (labels < cfg.vocab), loss, jnp.nan)
  if cfg.ignore_index is not None:
    loss = jnp.where(labels == cfg.ignore_index, 0.0, loss)
  return loss, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _losses(cfg: _Config, x, w, labels):
  return _forward(cfg, x, w, labels)[0]


def _losses_fwd(cfg: _Config, x, w, labels):
  loss, lse = _forward(cfg, x, w, labels)
  return loss, (x, w, labels, lse)


def _losses_bwd(cfg: _Config, saved, dloss):
  x, w, labels, lse = saved
  dloss = jnp.where(_counted(cfg, labels), dloss.astype(jnp.float32), 0.0)
  ids = jnp.arange(cfg.vocab, dtype=jnp.int32)[None]
  dx, dw = _bwd_call(cfg, x[None], w[None], labels[None], ids, lse[None], dloss[None])
  dx, dw = match_primal_types((dx[0].astype(x.dtype), dw[0].astype(w.dtype)),
                              cfg.primal_types)
  return dx, dw, None


_losses.defvjp(_losses_fwd, _losses_bwd)


# ---- public API ---------------------------------------------------------------------------


def _check(op, x, w, labels, w_layout, ignore_index, label_smoothing, logit_softcap, reduction):
  x = _checks.float_array(op, "x", x)
  _checks.min_rank(op, "x", x, 1)
  w = _checks.float_array(op, "w", w)
  if w.ndim != 2:
    raise ValueError(f"{op}: w must be 2-D ((V, D) or (D, V)), got shape {w.shape}")
  _checks.same_dtype(op, "w", w, "x", x)
  if w_layout not in W_LAYOUTS:
    raise ValueError(f"{op}: w_layout must be 'vd' ((V, D), the tied embedding) or 'dv' "
                     f"((D, V)), got {w_layout!r}")
  vocab, dim = w.shape if w_layout == "vd" else w.shape[::-1]
  if dim != x.shape[-1]:
    raise ValueError(f"{op}: w's D ({dim}, w_layout={w_layout!r}, w {w.shape}) must equal x's "
                     f"last dim ({x.shape[-1]})")
  if not 1 <= vocab < _MAX_VOCAB:
    raise ValueError(f"{op}: the vocabulary (w's {'first' if w_layout == 'vd' else 'last'} "
                     f"dim) must be in [1, 2^30), got {vocab}")
  labels, ignore_index, ls, softcap = check_loss_options(
      op, labels, x.shape[:-1], "the leading dims of x", vocab, ignore_index, label_smoothing,
      logit_softcap, reduction)
  return x, w, labels, vocab, ignore_index, ls, softcap


def linear_cross_entropy(x, w, labels, *, w_layout="vd", ignore_index=None, label_smoothing=0.0,
                         logit_softcap=None, reduction="mean", implementation=None):
  """Cross-entropy of the logits x @ w.T (w_layout 'vd') or x @ w ('dv'), without the logits.

  Args:
    x: (..., D) hidden states, float32, bfloat16 or float16.
    w: the output projection in x's dtype: (V, D) with w_layout='vd' (a tied embedding as it
      is stored: no transposed copy is made) or (D, V) with 'dv'.
    labels: (...) int32 (other integer dtypes are converted), x's leading shape; checked
      like jaxgpu.cross_entropy's (concrete out-of-range labels raise ValueError; a traced
      one gives a NaN loss and no gradient).
    w_layout: 'vd' or 'dv'.
    ignore_index, label_smoothing, logit_softcap, reduction: as jaxgpu.cross_entropy (loss
      in float32; 'mean' over the rows not ignored).
    implementation: None (the platform's FFI kernels), 'cuda', 'cpu', or 'xla' (the
      pure-JAX reference, which materializes the logits).

  Returns:
    A float32 scalar ('mean', 'sum') or per-row losses of labels' shape ('none').

  Equivalent pure JAX::

    logits = x @ w.T                      # (..., V) in x's dtype; x @ w for 'dv'
    jaxgpu.cross_entropy(logits, labels, ignore_index=..., label_smoothing=...,
                         logit_softcap=..., reduction=..., implementation='xla')

  The logits are rounded to x's dtype before the softmax, as that code's are. Gradients
  flow to x and w (the labels get none); works under jit, grad, vmap, shard_map and pmap,
  and under jit with rows or the vocabulary sharded (module docstring: which collectives).
  Forward mode (jax.jvp) and second derivatives run the reference.
  """
  op = "linear_cross_entropy"
  x, w, labels, vocab, ignore_index, ls, softcap = _check(
      op, x, w, labels, w_layout, ignore_index, label_smoothing, logit_softcap, reduction)
  impl = _autodiff.route(_implementation.resolve(implementation), x, w)
  if impl == "xla" or x.size == 0 or labels.size == 0:
    return reference.linear_cross_entropy(x, w, labels, w_layout=w_layout,
                                          ignore_index=ignore_index, label_smoothing=ls,
                                          logit_softcap=softcap, reduction=reduction)
  cfg = _Config(impl, w_layout, vocab, ignore_index, ls, softcap, primal_types(x, w))
  losses = _losses(cfg, x, w, labels)
  return ce_reference.reduce_losses(losses, labels, reduction, ignore_index)

