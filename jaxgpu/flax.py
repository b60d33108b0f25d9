"""Flax NNX drop-ins that run jaxgpu's kernels: ``pip install "jaxgpu[flax]"``.

  RMSNorm, LayerNorm       subclasses of ``flax.nnx.RMSNorm`` / ``flax.nnx.LayerNorm``: the
                           same constructor, parameters (``scale``, ``bias``), metadata and
                           state, so a model swaps the class and loads the same checkpoint
                           (``nnx.state`` / ``nnx.update`` in either direction); ``__call__``
                           runs jaxgpu.rms_norm / jaxgpu.layer_norm.
  dot_product_attention    the signature of ``flax.nnx.dot_product_attention``, for
                           ``nnx.MultiHeadAttention(..., attention_fn=jaxgpu.flax.
                           dot_product_attention)``, running jaxgpu.dot_product_attention.

``import jaxgpu`` never imports this module, nor flax: ``import jaxgpu.flax`` does.

Norm dtypes. The output dtype is flax's: ``dtype`` if given, else the promoted dtype of x
and the parameters (so a bfloat16 x with the default float32 parameters gives float32, as
flax does). x is cast to it. The parameters are handed to the kernel as they are when
they have that dtype or float32, and widened to float32 otherwise: with ``dtype=bfloat16``
and float32 parameters (master weights) the kernel reads the float32 scale and returns its
gradient in float32, where flax first rounds the scale to bfloat16 (results differ by that
one rounding; the gradient is not rounded through bfloat16). Statistics are float32, as
flax's. The kernels compute the variance in two passes (centered), which is what
``use_fast_variance=False`` asks for and at least as accurate as the one-pass formula of
``use_fast_variance=True``: both settings run the kernel.

The pure-JAX path (written here, flax's semantics) runs instead of the kernels for what they
do not cover: ``reduction_axes`` or ``feature_axes`` other than the last axis alone, a
``mask``, an ``axis_name`` (statistics averaged across devices), a result dtype other than
float32 / bfloat16 / float16, or ``epsilon <= 0``. A custom ``promote_dtype`` is applied as
flax applies it, and the kernel then gets its outputs.
"""

from __future__ import annotations

import math
import operator

import jax
import jax.numpy as jnp
from flax import nnx

import jaxgpu

__all__ = ["LayerNorm", "RMSNorm", "dot_product_attention"]

_KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


# ---- norms ------------------------------------------------------------------------------------


def _axes(ndim: int, axes) -> tuple[int, ...]:
  """reduction_axes / feature_axes as sorted non-negative ints."""
  if isinstance(axes, int) or hasattr(axes, "__index__"):
    axes = (axes,)
  return tuple(sorted({operator.index(a) % ndim for a in axes}))


def _flax_promote():
  """flax's default promote_dtype function (the default of the norms' constructors)."""
  try:
    from flax.nnx.nn import dtypes
  except ImportError:  # a flax whose norms have no promote_dtype argument
    return None
  return dtypes.promote_dtype


def _result_dtype(dtype, arrays) -> jnp.dtype:
  """flax's rule: `dtype` if given, else the arrays' promoted dtype, at least inexact."""
  if dtype is not None:
    return jnp.dtype(dtype)
  out = jnp.result_type(*[a for a in arrays if a is not None])
  if not jnp.issubdtype(out, jnp.inexact):
    out = jnp.promote_types(out, jnp.float32)
  return jnp.dtype(out)


def _kernel_param(p, out_dtype):
  """A parameter as the kernel takes it: its dtype when that is the output's or float32,
  else widened to float32 (exact from 16 bits; its gradient returns through the cast)."""
  if p is None or p.dtype in (out_dtype, jnp.float32):
    return p
  return p.astype(jnp.float32)


def _value(module, name):
  v = getattr(module, name, None)
  return None if v is None else v[...]


def _prepare(module, x, params):
  """(x, params, on the kernel path) after flax's dtype promotion."""
  promote = getattr(module, "promote_dtype", None)
  if promote is None or promote is _flax_promote():
    out = _result_dtype(module.dtype, (x, *params))
    x = jnp.asarray(x, out)
    params = tuple(_kernel_param(p, out) for p in params)
  else:
    x, *params = promote((x, *params), dtype=module.dtype)
    out = jnp.dtype(x.dtype)
  kernel = (x.ndim >= 1 and out in _KERNEL_DTYPES and module.axis_name is None
            and _axes(x.ndim, module.reduction_axes) == (x.ndim - 1,)
            and _axes(x.ndim, module.feature_axes) == (x.ndim - 1,)
            and math.isfinite(module.epsilon) and module.epsilon > 0
            and all(p is None or p.dtype in (out, jnp.float32) for p in params))
  return x, tuple(params), kernel


def _sq(a):
  return (a * jnp.conj(a)).real if jnp.iscomplexobj(a) else a * a


def _pure_jax_norm(module, x, scale, bias, mask, centered: bool):
  """The normalization in plain JAX with flax's semantics: promote_dtype, statistics in at
  least float32 over reduction_axes (where mask, averaged over axis_name), parameters
  shaped by feature_axes."""
  promote = getattr(module, "promote_dtype", None) or _flax_promote()
  if promote is None:
    out = _result_dtype(module.dtype, (x, scale, bias))
    x, scale, bias = (None if a is None else jnp.asarray(a, out) for a in (x, scale, bias))
  else:
    x, scale, bias = promote((x, scale, bias), dtype=module.dtype)
  stat = jnp.promote_types(module.dtype if module.dtype is not None else x.dtype, jnp.float32)
  xs = jnp.asarray(x, stat)
  axes = _axes(x.ndim, module.reduction_axes)

  def mean(a):
    m = jnp.mean(a, axis=axes, keepdims=True, where=mask)
    if module.axis_name is not None:
      m = jax.lax.pmean(m, module.axis_name, axis_index_groups=module.axis_index_groups)
    return m

  if centered:
    mu = mean(xs)
    if module.use_fast_variance:
      var = jnp.maximum(0.0, mean(_sq(xs)) - _sq(mu))
    else:
      var = mean(_sq(xs - mu))
  else:
    mu, var = 0.0, mean(_sq(xs))
  shape = [1] * x.ndim
  for a in _axes(x.ndim, module.feature_axes):
    shape[a] = x.shape[a]
  mul = jax.lax.rsqrt(var + module.epsilon)
  if scale is not None:
    mul = mul * scale.reshape(shape)
  y = (xs - mu) * mul
  if bias is not None:
    y = y + bias.reshape(shape)
  return jnp.asarray(y, x.dtype)


class RMSNorm(nnx.RMSNorm):
  """``flax.nnx.RMSNorm`` computed by jaxgpu.rms_norm (see the module docstring for the
  dtypes and the arguments that take the pure-JAX path).

  The constructor, the ``scale`` parameter and the state are flax's: swap the class in a
  model and load the same checkpoint. ``y = x / sqrt(mean(x^2, last axis) + epsilon) *
  scale`` with float32 statistics, forward and backward kernels (the scale's gradient
  summed in float32 and returned in the scale's dtype).
  """

  def __call__(self, x, mask=None):
    scale = _value(self, "scale")
    xk, (sk,), kernel = _prepare(self, x, (scale,))
    if not kernel or mask is not None:
      return _pure_jax_norm(self, x, scale, None, mask, centered=False)
    return jaxgpu.rms_norm(xk, sk, eps=self.epsilon)


class LayerNorm(nnx.LayerNorm):
  """``flax.nnx.LayerNorm`` computed by jaxgpu.layer_norm (see the module docstring for the
  dtypes and the arguments that take the pure-JAX path).

  The constructor, the ``scale`` and ``bias`` parameters and the state are flax's. ``y =
  (x - mean) / sqrt(var + epsilon) * scale + bias`` over the last axis, float32 statistics
  with a centered variance, forward and backward kernels.
  """

  def __call__(self, x, *, mask=None):
    scale, bias = _value(self, "scale"), _value(self, "bias")
    xk, (sk, bk), kernel = _prepare(self, x, (scale, bias))
    if not kernel or mask is not None:
      return _pure_jax_norm(self, x, scale, bias, mask, centered=True)
    return jaxgpu.layer_norm(xk, sk, bk, eps=self.epsilon)


# ---- attention --------------------------------------------------------------------------------


def _to_batch_of_4(a, batch: tuple[int, ...], rank: int):
  """A mask or bias broadcastable to (*batch, heads, T, S) as a rank-4 array over the
  flattened batch: its batch dims kept as a 1 when they are all 1 (never materialized),
  else broadcast to `batch`."""
  if a is None:
    return None
  a = jnp.asarray(a)
  if a.ndim > rank:
    raise ValueError(f"dot_product_attention: a mask or bias of rank {a.ndim} does not "
                     f"broadcast to the logits' rank {rank}")
  a = a.reshape((1,) * (rank - a.ndim) + a.shape)
  lead, tail = a.shape[:-3], a.shape[-3:]
  if all(d == 1 for d in lead):
    return a.reshape((1,) + tail)
  return jnp.broadcast_to(a, batch + tail).reshape((math.prod(batch),) + tail)


def dot_product_attention(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                          dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                          precision=None, module=None, promote_dtype=None, is_causal=False):
  """``flax.nnx.dot_product_attention`` computed by jaxgpu.dot_product_attention.

  For ``nnx.MultiHeadAttention(..., attention_fn=jaxgpu.flax.dot_product_attention)``.

  Args:
    query: (batch..., T, N, H); key: (batch..., S, K, H); value: (batch..., S, K, H), any
      number of batch dims (none included), flattened into one for the kernel. N a multiple
      of K (grouped-query attention, as flax).
    bias: None or broadcastable to (batch..., N, T, S), added to the logits.
    mask: None or broadcastable to (batch..., N, T, S); False masks a logit out.
    broadcast_dropout, dropout_rng: accepted for the signature; unused (no dropout).
    dropout_rate, deterministic: the kernels have no dropout: ``dropout_rate > 0`` outside
      deterministic mode raises NotImplementedError (flax's own function applies dropout to
      the attention weights there); with ``deterministic=True`` the rate is ignored, as
      flax ignores it.
    dtype: the computation's dtype (query, key and value are cast to it); None: their
      promoted dtype. The CUDA kernels take bfloat16 and float16; float32 runs jaxgpu's
      'xla' reference on a GPU (see jaxgpu.dot_product_attention).
    precision: accepted and ignored: the kernels multiply in the inputs' dtype and
      accumulate in float32, whatever the precision.
    module: a module to sow the attention weights into (``MultiHeadAttention(...,
      sow_weights=True)``): the kernels never form the weights, so a module raises
      NotImplementedError.
    promote_dtype: flax's promote function (query, key, value) -> same, dtype=...; None:
      flax's default.
    is_causal: query i sees keys j <= i (top-left aligned, flax's ``tril`` mask).

  Returns:
    (batch..., T, N, H) in the computation dtype.

  Scale 1 / sqrt(H) as flax. One difference from flax: a query row whose logits are all
  masked outputs zeros here (jaxgpu's convention), where flax's large negative fill gives
  the mean of the values.
  """
  del broadcast_dropout, dropout_rng, precision
  if module is not None:
    raise NotImplementedError(
        "jaxgpu.flax.dot_product_attention: module is given (sow_weights=True): the fused "
        "kernels never form the attention weights, so they cannot be sown; use "
        "flax.nnx.dot_product_attention for that call")
  if dropout_rate and not deterministic:
    raise NotImplementedError(
        f"jaxgpu.flax.dot_product_attention: dropout_rate={dropout_rate} outside "
        "deterministic mode: the fused kernels have no attention dropout; pass "
        "deterministic=True (or dropout_rate=0.0), or use flax.nnx.dot_product_attention")
  promote = promote_dtype if promote_dtype is not None else _flax_promote()
  if promote is None:
    out = _result_dtype(dtype, (query, key, value))
    query, key, value = (jnp.asarray(a, out) for a in (query, key, value))
  else:
    query, key, value = promote((query, key, value), dtype=dtype)
  if query.ndim < 3 or key.ndim != query.ndim or value.ndim != query.ndim:
    raise ValueError("dot_product_attention: query, key and value must have one rank >= 3 "
                     f"(batch..., length, heads, features), got {query.shape}, {key.shape}, "
                     f"{value.shape}")
  batch = query.shape[:-3]
  if key.shape[:-3] != batch or value.shape[:-3] != batch:
    raise ValueError(f"dot_product_attention: query, key and value batch dims differ: "
                     f"{query.shape}, {key.shape}, {value.shape}")
  rank = query.ndim
  flat = lambda a: a.reshape((math.prod(batch),) + a.shape[-3:])
  kw = {}
  if bias is not None:
    kw["bias"] = _to_batch_of_4(bias, batch, rank)
  if mask is not None:
    kw["mask"] = _to_batch_of_4(jnp.asarray(mask).astype(bool), batch, rank)
  out = jaxgpu.dot_product_attention(flat(query), flat(key), flat(value), is_causal=is_causal,
                                     **kw)
  return out.reshape(query.shape[:-1] + value.shape[-1:])
