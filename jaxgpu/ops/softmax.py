"""Softmax over the last axis with an optional scale, causal mask and boolean mask,
forward and backward.

Kernels: ffi/softmax/ (targets jaxgpu_softmax_{fwd,bwd}). Reference:
jaxgpu/reference/softmax.py. Tests: tests/test_softmax.py. Benchmarks:
benchmarks/bench_softmax.py.

Memory. The forward pass allocates y only (x.shape, x.dtype), which is also the one array
kept for the backward pass (y, not x: dx = scale * y * (dy - sum(dy * y)) needs nothing
else, and masked positions hold y = 0). The backward pass allocates dx only. No float32
copy of anything x-sized is made. The only copies are the ones vmap makes when it must: an
unbatched x under a batched mask is repeated over the batch (as its output is).

The mask is never broadcast in memory. The kernels get it in its own shape (padded with
leading 1s to x's rank, a free reshape) and read element (row, j) at
sum_k idx_k(row) * stride_k + j * stride_S, with stride 0 along its size-1 dims. What that
costs: per row, one multiply-high division per group of x's row dims over which the mask is
uniformly full or broadcast (3 for x (B, H, T, S) under a (B, 1, T, S) mask); and the mask's
bytes, read where a row uses them: a (T, S) mask under (B, H, T, S) logits is read B*H
times, from L2 while it fits there (a bool is 1 byte: 1/2 of bf16 logits per use, or 1/(B*H)
of them from HBM). Keys past a query under the causal mask are not read at all, in either
pass.

Sharding (jit with sharded inputs, shard_map, pmap): every leading dim of x keeps its
sharding with no collective, forward and backward. The last axis (S) is gathered when
sharded. With is_causal the query axis (T, second to last) is gathered too, forward and
backward, since a query's position must be global (the simple correct choice: passing each
shard its offset would need the partitioned body to know its shard index); without
is_causal, T is one more row dim. The
mask's dims follow the x dims they line up with; its size-1 (broadcast) dims are never
sharded.
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
from jaxgpu.reference import softmax as reference

SOFTMAX = Op("softmax", {"fwd": "jaxgpu_softmax_fwd", "bwd": "jaxgpu_softmax_bwd"})
FAMILY = Family("softmax", (SOFTMAX,))

# Row-dim groups of the mask's index map the kernels accept (ffi/softmax/softmax_params.h:
# kSoftmaxMaxDims). The public check leaves one for the group axis vmap may add.
_MAX_DIMS = 8


@dataclasses.dataclass(frozen=True)
class _Config:
  scale: float
  is_causal: bool
  implementation: str | None  # 'cpu', 'cuda', or None (platform-generic)
  primal_types: tuple = (None, None)  # of x and mask (see _kernel_op)

  def target(self, pass_: str) -> str:
    return SOFTMAX.target(pass_, self.implementation)


# ---- layouts -----------------------------------------------------------------------------------


def _x_factors(rank: int) -> list[str]:
  """Factor names of a grouped x (G, ...rows, S): the query axis is 't' (rank >= 3)."""
  names = ["g"] + [f"r{k}" for k in range(rank - 2)] + ["s"]
  if rank >= 3:
    names[-2] = "t"
  return names


def _mask_factors(mask_shape, x_shape) -> list[str]:
  """A mask dim that matches x's shares x's factor; a size-1 (broadcast) dim gets a factor
  of its own, 'one...', which _kernel_op never shards (as a size-1 '[g]' group axis)."""
  xf = _x_factors(len(x_shape))
  names = ["[g]"]
  for k in range(1, len(x_shape)):
    names.append(xf[k] if mask_shape[k] == x_shape[k] else f"one_mask{k}")
  return names


def _coalesce(x_rows, m_rows):
  """Row-dim groups of the kernels' mask index map (as the handler forms them, see
  ffi/softmax/softmax_handlers.h): adjacent row dims over which the mask is alike (all
  full, or all broadcast) merge; size-1 dims of x drop out."""
  xs, ms, full = [], [], []
  for xd, md in zip(x_rows, m_rows):
    if xd == 1:
      continue
    f = md == xd
    if full and full[-1] == f:
      xs[-1] *= xd
      ms[-1] *= md
    else:
      xs.append(xd)
      ms.append(md)
      full.append(f)
  return (tuple(xs), tuple(ms)) if xs else ((1,), (1,))


# ---- inner ops: FFI calls under the shared vmap / sharding rules --------------------------------


def _fwd_call(cfg: _Config, x, mask):
  """Grouped x (G, ..., S) and mask (1 or G, ..., 1 or S) | None in; grouped y out."""
  has_mask = mask is not None
  xf = _x_factors(x.ndim)
  layout = Layout(
      inputs=(" ".join(xf),) + ((" ".join(_mask_factors(mask.shape, x.shape)),) if has_mask
                                else ()),
      outputs=(" ".join(xf),),
      replicated=frozenset({"s", "t"} if cfg.is_causal else {"s"}),
  )

  def local_fn(x, *rest):
    # No reshapes: the handler takes x and the mask in their own shapes (any rank) and
    # coalesces the dims itself. (Merging a sharded dim with the dims after it is not
    # expressible under Explicit sharding, where this also runs for the output shapes.)
    y = jax.ffi.ffi_call(cfg.target("fwd"), jax.ShapeDtypeStruct(x.shape, x.dtype))(
        x, rest[0] if has_mask else jnp.zeros((0,), jnp.bool_),
        scale=np.float32(cfg.scale), causal=cfg.is_causal, has_mask=has_mask,
        query_len=np.int64(x.shape[-2] if cfg.is_causal else 1))
    return (y,)

  return grouped_call(local_fn, layout, *([x, mask] if has_mask else [x]))[0]


def _bwd_call(cfg: _Config, y, dy):
  """Grouped y and dy in; grouped dx out. No mask: masked positions hold y = 0. With
  is_causal the kernels skip the keys past each query (y is 0 there), which needs the
  global query index: T is kept whole as in the forward pass."""
  xf = " ".join(_x_factors(y.ndim))
  layout = Layout(inputs=(xf, xf), outputs=(xf,),
                  replicated=frozenset({"s", "t"} if cfg.is_causal else {"s"}))

  def local_fn(y, dy):
    dx = jax.ffi.ffi_call(cfg.target("bwd"), jax.ShapeDtypeStruct(y.shape, y.dtype))(
        y, dy, scale=np.float32(cfg.scale), causal=cfg.is_causal,
        query_len=np.int64(y.shape[-2] if cfg.is_causal else 1))
    return (dx,)

  return grouped_call(local_fn, layout, y, dy)[0]


# ---- the differentiable op ------------------------------------------------------------------


def _grouped_mask(mask, x):
  """mask padded to x's rank, plus the group axis (a free reshape)."""
  if mask is None:
    return None
  return mask.reshape((1,) * (x.ndim + 1 - mask.ndim) + tuple(mask.shape))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _softmax(cfg: _Config, x, mask):
  return _fwd_call(cfg, x[None], _grouped_mask(mask, x))[0]


def _softmax_fwd(cfg: _Config, x, mask):
  y = _fwd_call(cfg, x[None], _grouped_mask(mask, x))[0]
  return y, y


def _softmax_bwd(cfg: _Config, y, dy):
  dx = _bwd_call(cfg, y[None], dy[None])[0]
  # The mask is boolean: no cotangent (None is jax's symbolic zero).
  return match_primal_types((dx, None), cfg.primal_types)


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


# ---- public API ---------------------------------------------------------------------------


def _check_mask(op, mask, x):
  mask = _checks.as_array(op, "mask", mask)
  if jnp.dtype(mask.dtype) != jnp.dtype(jnp.bool_):
    raise TypeError(f"{op}: mask must be a bool array (True = keep), got dtype {mask.dtype}")
  shape, xs = tuple(mask.shape), tuple(x.shape)
  if len(shape) > len(xs) or any(m not in (1, d) for m, d in zip(shape[::-1], xs[::-1])):
    raise ValueError(f"{op}: mask of shape {shape} is not broadcastable to x's shape {xs}")
  padded = (1,) * (len(xs) - len(shape)) + shape
  groups = len(_coalesce(xs[:-1], padded[:-1])[0])
  if groups > _MAX_DIMS - 1:
    raise ValueError(f"{op}: mask of shape {shape} alternates between broadcast and full dims "
                     f"of x {groups} times; at most {_MAX_DIMS - 1} are supported")
  return mask


def softmax(x, *, scale=None, is_causal=False, mask=None, implementation=None):
  """Softmax over the last axis, with an optional scale, causal mask and boolean mask.

  Args:
    x: (..., S) float32, bfloat16 or float16; any number of leading dims. With is_causal,
      rank >= 2: (..., T, S), T queries over S keys.
    scale: optional static Python float, finite (default 1): the logits are ``x * scale``.
    is_causal: static bool. Query i (the position along the second-to-last axis) keeps keys
      j <= i. For T != S the mask is aligned top-left, as ``jnp.tril(ones((T, S)))``: query
      i sees the first min(i + 1, S) keys (for T == S this is jax.nn.dot_product_attention's
      causal mask).
    mask: optional bool array broadcastable to x.shape (True = keep), e.g. (T, S),
      (B, 1, T, S) or (B, 1, 1, S) for x (B, H, T, S). It is never broadcast in memory (see
      the module docstring) and gets no gradient.
    implementation: None (the FFI kernel of the platform the computation runs on),
      'cuda', 'cpu', or 'xla' (the pure-JAX reference).

  Returns:
    y, the shape and dtype of x; logits and statistics in float32. A row with nothing kept
    (or whose kept logits are all -inf) is all zeros, never NaN, and its gradient is zero; a
    kept NaN or +inf logit makes its row NaN.

  Equivalent pure JAX (jaxgpu.reference.softmax.softmax)::

    xf = x.astype(jnp.float32) * scale
    keep = mask & jnp.tril(jnp.ones((T, S), bool))        # the parts that apply
    xf = jnp.where(keep, xf, -jnp.inf)
    m = jnp.max(xf, -1, keepdims=True)
    e = jnp.exp(xf - jnp.where(m == -jnp.inf, 0.0, m))
    s = jnp.sum(e, -1, keepdims=True)
    y = (e / jnp.where(s == 0, 1.0, s)).astype(x.dtype)

  That is jax.nn.softmax(xf, where=keep) except on rows with nothing kept. The gradient
  comes from a backward kernel, dx = scale * y * (dy - sum(dy * y)), from the saved y.
  Works under jit, grad, vmap, shard_map and pmap; under jit with sharded inputs the
  leading dims keep their sharding with no collective (see the module docstring for S, and
  T with is_causal). Forward mode (jax.jvp) and second derivatives run the reference.
  """
  op = "softmax"
  x = _checks.float_array(op, "x", x)
  _checks.min_rank(op, "x", x, 1)
  if isinstance(is_causal, jax.core.Tracer) or not isinstance(is_causal, (bool, np.bool_)):
    raise TypeError(f"{op}: is_causal must be a static Python bool, got "
                    f"{type(is_causal).__name__}")
  is_causal = bool(is_causal)
  if is_causal and x.ndim < 2:
    raise ValueError(f"{op}: is_causal needs x of rank >= 2 (..., T, S), got shape "
                     f"{tuple(x.shape)}")
  scale_value = 1.0 if scale is None else _checks.finite(op, "scale", scale)
  if mask is not None:
    mask = _check_mask(op, mask, x)
  impl = _autodiff.route(_implementation.resolve(implementation), x)
  if impl == "xla" or x.size == 0:
    return reference.softmax(x, scale=None if scale is None else scale_value,
                             is_causal=is_causal, mask=mask)
  cfg = _Config(scale_value, is_causal, impl, primal_types(x, mask))
  return _softmax(cfg, x, mask)
