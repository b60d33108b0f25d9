"""RMSNorm and LayerNorm, optionally fused with the residual add, forward and backward.

Kernels: ffi/norm/ (targets jaxgpu_{rms,layer}_norm_{fwd,bwd}). Reference:
jaxgpu/reference/norm.py. Tests: tests/test_norm.py. Benchmarks: benchmarks/bench_norm.py.

Memory. The forward pass allocates its outputs (y, and h with a residual) plus one
float32 per row (rstd; and the mean for layer norm) kept for the backward pass. The
backward pass allocates dx and a float32 (G, D) weight/bias gradient; on CUDA also a
float32 workspace of partial sums of about 8 MiB per gradient (see _PARTIAL_FLOATS). No
float32 copy of a row-shaped array is made.

Parameter dtypes. weight and bias have x's dtype, or float32 beside a bfloat16/float16 x
(float32 master weights, as mixed-precision training keeps them): the kernels read them
as float32 and the weight/bias gradients, summed in float32 (float64 on the CPU), are
returned in the parameter's own dtype, so a float32 parameter's gradient is never rounded
to 16 bits.
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
from jaxgpu.reference import norm as reference

RMS_NORM = Op("rms_norm", {"fwd": "jaxgpu_rms_norm_fwd", "bwd": "jaxgpu_rms_norm_bwd"})
LAYER_NORM = Op("layer_norm", {"fwd": "jaxgpu_layer_norm_fwd", "bwd": "jaxgpu_layer_norm_bwd"})
FAMILY = Family("norm", (RMS_NORM, LAYER_NORM))

_ROWS = "g ... d"       # (G, ...rows, D)
_PARAM = "[g] d"        # (G or 1, D)
_ROW_STAT = "g ..."     # (G, ...rows) float32
_PER_GROUP = "g d"      # (G, D) float32: a sum over rows


@dataclasses.dataclass(frozen=True)
class _Config:
  kind: str                  # 'rms' or 'layer'
  eps: float
  weight_offset: float
  implementation: str | None  # 'cpu', 'cuda', or None (platform-generic)
  has_weight: bool
  has_bias: bool
  has_residual: bool
  primal_types: tuple = (None,) * 4  # of x, weight, bias, residual (see _kernel_op)
  param_dtype: object = None  # of weight and bias (the gradients' dtype): x's or float32

  def target(self, pass_: str) -> str:
    return (RMS_NORM if self.kind == "rms" else LAYER_NORM).target(pass_, self.implementation)


def _empty(dtype):
  return jnp.zeros((0,), dtype)


def _as_rows(a):
  """(G, ...rows, D) -> (G, R, D)."""
  return a.reshape(a.shape[0], -1, a.shape[-1])


# ---- inner ops: FFI calls under the shared vmap / sharding rules ---------------------------


def _fwd_call(cfg: _Config, x, residual, weight, bias):
  """Grouped arrays in; (y, h | None, mean | None, rstd) out."""
  inputs = [x] + [a for a in (residual, weight, bias) if a is not None]
  layout = Layout(
      inputs=(_ROWS,) + (_ROWS,) * cfg.has_residual + (_PARAM,) * cfg.has_weight
      + (_PARAM,) * cfg.has_bias,
      outputs=(_ROWS,) + (_ROWS,) * cfg.has_residual + (_ROW_STAT,) * (cfg.kind == "layer")
      + (_ROW_STAT,),
  )

  def local_fn(x, *rest):
    rest = list(rest)
    residual = rest.pop(0) if cfg.has_residual else None
    weight = rest.pop(0) if cfg.has_weight else None
    bias = rest.pop(0) if cfg.has_bias else None
    lead, dt = x.shape[:-1], x.dtype
    rows = _as_rows(x)
    stat = jax.ShapeDtypeStruct(rows.shape[:-1], jnp.float32)
    none = jax.ShapeDtypeStruct((0,), dt)
    none32 = jax.ShapeDtypeStruct((0,), jnp.float32)
    y, h, mean, rstd = jax.ffi.ffi_call(
        cfg.target("fwd"),
        (jax.ShapeDtypeStruct(rows.shape, dt),
         jax.ShapeDtypeStruct(rows.shape, dt) if cfg.has_residual else none,
         stat if cfg.kind == "layer" else none32,
         stat),
    )(rows,
      _as_rows(residual) if cfg.has_residual else _empty(dt),
      weight if cfg.has_weight else _empty(dt),
      bias if cfg.has_bias else _empty(dt),
      eps=np.float32(cfg.eps), weight_offset=np.float32(cfg.weight_offset),
      has_residual=cfg.has_residual, has_weight=cfg.has_weight, has_bias=cfg.has_bias)
    outs = [y.reshape(x.shape)]
    if cfg.has_residual:
      outs.append(h.reshape(x.shape))
    if cfg.kind == "layer":
      outs.append(mean.reshape(lead))
    outs.append(rstd.reshape(lead))
    return tuple(outs)

  outs = list(grouped_call(local_fn, layout, *inputs))
  y = outs.pop(0)
  h = outs.pop(0) if cfg.has_residual else None
  mean = outs.pop(0) if cfg.kind == "layer" else None
  return y, h, mean, outs.pop(0)


# The CUDA backward pass sums dweight/dbias over rows in `slots` row slots per group, each
# writing one float32 partial row to a workspace that is then reduced in a fixed order
# (deterministic, no atomics). 2^21 partial floats (8 MiB) give ~2 waves of row slots on
# an H100 for any D (D = 8192: 256 slots of 512 threads) while the partials stay ~2% of
# the backward pass's traffic at (16384, 8192). The workspace is an ffi_call output, not
# scratch from the handler: XLA plans it like any buffer, also inside CUDA graphs.
_PARTIAL_FLOATS = 1 << 21


def _workspace_slots(cfg: _Config, groups: int, rows: int, dim: int) -> int:
  # The CPU kernel sums in float64 in row order and needs none, but a platform-generic call
  # (implementation None) sizes it even on a CPU-only machine: a program traced there and
  # exported for ("cpu", "cuda") must carry the workspace its CUDA lowering needs. The CPU
  # handler leaves it untouched (at most 8 MiB of float32).
  if cfg.implementation == "cpu":
    return 0
  return max(1, min(rows, -(-_PARTIAL_FLOATS // max(1, dim * groups))))


def _bwd_call(cfg: _Config, dy, dh, xh, weight, mean, rstd):
  """Grouped arrays in; (dx, dweight (G, D) f32 | None, dbias (G, D) f32 | None) out."""
  has_dh = dh is not None
  inputs = [dy] + [a for a in (dh, xh, weight, mean, rstd) if a is not None]
  layout = Layout(
      inputs=(_ROWS,) + (_ROWS,) * has_dh + (_ROWS,) + (_PARAM,) * cfg.has_weight
      + (_ROW_STAT,) * (cfg.kind == "layer") + (_ROW_STAT,),
      outputs=(_ROWS,) + (_PER_GROUP,) * cfg.has_weight + (_PER_GROUP,) * cfg.has_bias,
  )

  def local_fn(dy, *rest):
    rest = list(rest)
    dh = rest.pop(0) if has_dh else None
    xh = rest.pop(0)
    weight = rest.pop(0) if cfg.has_weight else None
    mean = rest.pop(0) if cfg.kind == "layer" else None
    rstd = rest.pop(0)
    dt = dy.dtype
    rows = _as_rows(dy)
    groups, dim = rows.shape[0], rows.shape[-1]
    per_group = jax.ShapeDtypeStruct((groups, dim), jnp.float32)
    none32 = jax.ShapeDtypeStruct((0,), jnp.float32)
    n_grads = int(cfg.has_weight) + int(cfg.has_bias)
    slots = _workspace_slots(cfg, groups, rows.shape[1], dim) if n_grads else 0
    workspace = jax.ShapeDtypeStruct((n_grads, groups, slots, dim) if slots else (0,), jnp.float32)
    dx, dw, db, _ = jax.ffi.ffi_call(
        cfg.target("bwd"),
        (jax.ShapeDtypeStruct(rows.shape, dt),
         per_group if cfg.has_weight else none32,
         per_group if cfg.has_bias else none32,
         workspace),
    )(rows,
      _as_rows(dh) if has_dh else _empty(dt),
      _as_rows(xh),
      weight if cfg.has_weight else _empty(dt),
      mean.reshape(groups, -1) if mean is not None else _empty(jnp.float32),
      rstd.reshape(groups, -1),
      weight_offset=np.float32(cfg.weight_offset), has_dh=has_dh,
      has_weight=cfg.has_weight, want_dweight=cfg.has_weight, want_dbias=cfg.has_bias)
    outs = [dx.reshape(dy.shape)]
    if cfg.has_weight:
      outs.append(dw)
    if cfg.has_bias:
      outs.append(db)
    return tuple(outs)

  outs = list(grouped_call(local_fn, layout, *inputs))
  dx = outs.pop(0)
  dw = outs.pop(0) if cfg.has_weight else None
  db = outs.pop(0) if cfg.has_bias else None
  return dx, dw, db


# ---- the differentiable op ------------------------------------------------------------------


def _group(a):
  return None if a is None else a[None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _norm(cfg: _Config, x, weight, bias, residual):
  y, h, _, _ = _fwd_call(cfg, _group(x), _group(residual), _group(weight), _group(bias))
  return y[0] if h is None else (y[0], h[0])


def _norm_fwd(cfg: _Config, x, weight, bias, residual):
  y, h, mean, rstd = _fwd_call(cfg, _group(x), _group(residual), _group(weight), _group(bias))
  xh = _group(x) if h is None else h
  out = y[0] if h is None else (y[0], h[0])
  return out, (xh, _group(weight), mean, rstd)


def _norm_bwd(cfg: _Config, saved, cotangent):
  xh, weight, mean, rstd = saved
  dy, dh = cotangent if cfg.has_residual else (cotangent, None)
  dx, dw, db = _bwd_call(cfg, _group(dy), _group(dh), xh, weight, mean, rstd)
  dx = dx[0]
  dweight = None if dw is None else dw[0].astype(cfg.param_dtype)
  dbias = None if db is None else db[0].astype(cfg.param_dtype)
  return match_primal_types((dx, dweight, dbias, dx if cfg.has_residual else None),
                            cfg.primal_types)


_norm.defvjp(_norm_fwd, _norm_bwd)


# ---- public API ---------------------------------------------------------------------------


def _param_dtype(op, name, p, x):
  """weight / bias: x's dtype, or float32 (master weights beside a 16-bit x)."""
  if p.dtype != x.dtype and p.dtype != jnp.float32:
    allowed = f"the dtype of x ({x.dtype})" + ("" if x.dtype == jnp.float32 else " or float32")
    raise TypeError(f"{op}: {name} must have {allowed}, got {p.dtype}")


def _check(op, x, weight, bias, residual, eps):
  x = _checks.float_array(op, "x", x)
  _checks.min_rank(op, "x", x, 1)
  dim = x.shape[-1]
  params = {}
  for name, p in (("weight", weight), ("bias", bias)):
    if p is None:
      continue
    p = _checks.as_array(op, name, p)
    _param_dtype(op, name, p, x)
    _checks.shape_is(op, name, p, (dim,), "the last dim of x")
    params[name] = p
  if residual is not None:
    residual = _checks.as_array(op, "residual", residual)
    _checks.same_dtype(op, "residual", residual, "x", x)
    _checks.shape_is(op, "residual", residual, x.shape, "the shape of x")
  eps = _checks.positive_finite(op, "eps", eps)
  weight, bias = params.get("weight"), params.get("bias")
  if weight is not None and bias is not None and weight.dtype != bias.dtype:
    # One of them is float32: the kernels take one parameter dtype, and widening the other
    # is exact (its gradient comes back in its own dtype through the cast).
    weight, bias = weight.astype(jnp.float32), bias.astype(jnp.float32)
  return x, weight, bias, residual, eps


def _params_dtype(x, weight, bias):
  return jnp.dtype((weight if weight is not None else bias if bias is not None else x).dtype)


def rms_norm(x, weight=None, *, residual=None, eps=1e-6, weight_offset=0.0,
             implementation=None):
  """RMSNorm over the last axis, optionally fused with the residual add.

  Args:
    x: (..., D) float32, bfloat16 or float16; any number of leading dims.
    weight: optional (D,), the dtype of x, or float32 beside a bfloat16/float16 x (master
      weights: read as float32, the gradient returned in float32, never rounded through
      16 bits). The scale is ``weight_offset + weight``.
    residual: optional, the shape and dtype of x. Then ``h = x + residual`` is formed in
      the kernel, normalized, and returned too (the residual stream a transformer needs).
    eps: added to the mean square; positive and finite.
    weight_offset: 0.0, or 1.0 for Gemma's ``(1 + weight)`` convention.
    implementation: None (the FFI kernel of the platform the computation runs on),
      'cuda', 'cpu', or 'xla' (the pure-JAX reference).

  Returns:
    y (..., D) in x.dtype; ``(y, h)`` when a residual is given.

  Equivalent pure JAX (statistics in float32)::

    h = x + residual if residual is not None else x
    hf = h.astype(jnp.float32)
    y = hf * jax.lax.rsqrt(jnp.mean(hf * hf, -1, keepdims=True) + eps)
    y = (y * (weight_offset + weight.astype(jnp.float32))).astype(x.dtype)

  Gradients for x, weight and residual come from backward kernels (weight gradients are
  deterministic). Works under jit, grad, vmap, shard_map and pmap. Under jit with sharded
  inputs the leading dims keep their sharding with no collective in the forward pass and
  only the weight-gradient all-reduce in the backward pass; a sharded D is gathered.
  Forward mode (jax.jvp) and second derivatives run the reference.
  """
  op = "rms_norm"
  x, weight, _, residual, eps = _check(op, x, weight, None, residual, eps)
  weight_offset = _checks.finite(op, "weight_offset", weight_offset)
  impl = _autodiff.route(_implementation.resolve(implementation), x, weight, residual)
  if impl == "xla" or x.size == 0:
    return reference.rms_norm(x, weight, residual=residual, eps=eps, weight_offset=weight_offset)
  cfg = _Config("rms", eps, weight_offset, impl, weight is not None, False, residual is not None,
                primal_types(x, weight, None, residual), _params_dtype(x, weight, None))
  return _norm(cfg, x, weight, None, residual)


def layer_norm(x, weight=None, bias=None, *, residual=None, eps=1e-5, implementation=None):
  """LayerNorm over the last axis, optionally fused with the residual add.

  Args:
    x: (..., D) float32, bfloat16 or float16; any number of leading dims.
    weight, bias: optional (D,), the dtype of x or float32 (see rms_norm's weight); their
      gradients have their dtypes.
    residual: optional, the shape and dtype of x; then ``(y, h)`` with h = x + residual.
    eps: added to the variance; positive and finite.
    implementation: None, 'cuda', 'cpu' or 'xla' (see rms_norm).

  Returns:
    y (..., D) in x.dtype; ``(y, h)`` when a residual is given.

  Equivalent pure JAX (statistics in float32)::

    hf = (x + residual if residual is not None else x).astype(jnp.float32)
    c = hf - jnp.mean(hf, -1, keepdims=True)
    y = c * jax.lax.rsqrt(jnp.mean(c * c, -1, keepdims=True) + eps)
    y = (y * weight.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)

  Transforms and sharding as rms_norm.
  """
  op = "layer_norm"
  x, weight, bias, residual, eps = _check(op, x, weight, bias, residual, eps)
  impl = _autodiff.route(_implementation.resolve(implementation), x, weight, bias, residual)
  if impl == "xla" or x.size == 0:
    return reference.layer_norm(x, weight, bias, residual=residual, eps=eps)
  cfg = _Config("layer", eps, 0.0, impl, weight is not None, bias is not None,
                residual is not None, primal_types(x, weight, bias, residual),
                _params_dtype(x, weight, bias))
  return _norm(cfg, x, weight, bias, residual)
