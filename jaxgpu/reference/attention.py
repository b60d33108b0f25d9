"""Pure-JAX dot-product attention: implementation='xla' and the low-precision twin of the
tests' oracle.

Semantics (those of the kernels, ffi/attention/attention_params.h): query (B, T, N, H),
key and value (B, S, K, H) with N a multiple of K; query head n reads kv head n // (N // K)
(MHA, GQA, MQA, as jax.nn.dot_product_attention). Logits ``scale * q . k`` in float32,
then ``c * tanh(logits / c)`` with a softcap c, then ``+ bias`` (broadcast to (B, N, T, S)),
then masked: key j is visible to query i when j <= i (is_causal, top-left aligned as
jnp.tril), i - left <= j <= i + right (a local window), the segment ids match, mask[b, n,
i, j] is True, and i < query_seq_lengths[b], j < key_value_seq_lengths[b] (each when
given; lengths clamped to [0, T] / [0, S]). Softmax in float32; the probabilities are
rounded to the value dtype before the P.V product (float32 accumulation), as in
jax.nn.dot_product_attention and FlashAttention. A query with no visible key gets zeros
and a zero gradient (jax.nn gives a uniform average there), never NaN.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def visible_mask(t: int, s: int, *, is_causal: bool = False, window=None):
  """(T, S) bool: key j visible to query i under the causal and window masks, or None."""
  if not is_causal and window is None:
    return None
  i = jnp.arange(t)[:, None]
  j = jnp.arange(s)[None, :]
  keep = jnp.ones((t, s), bool)
  if is_causal:
    keep &= j <= i
  if window is not None:
    left, right = window
    if left >= 0:
      keep &= j >= i - left
    if right >= 0:
      keep &= j <= i + right
  return keep


def _explicit_mesh_spec(a):
  """`a`'s PartitionSpec when its mesh has Explicit axes (jax.set_mesh), else None."""
  sharding = getattr(jax.typeof(a), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  types = getattr(mesh, "axis_types", ()) or ()
  if not any(t == jax.sharding.AxisType.Explicit for t in types):
    return None
  spec = tuple(sharding.spec)
  return jax.sharding.PartitionSpec(*(spec + (None,) * (a.ndim - len(spec))))


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None,
                          is_causal=False, local_window_size=None, logit_softcap=None,
                          q_segment_ids=None, kv_segment_ids=None, query_seq_lengths=None,
                          key_value_seq_lengths=None):
  """See jaxgpu.dot_product_attention (arguments already checked there: rank-4 q, k, v;
  bias and mask of rank 4, broadcastable to (B, N, T, S); lengths int32 (B,))."""
  kw = dict(scale=scale, is_causal=is_causal, local_window_size=local_window_size,
            logit_softcap=logit_softcap)
  arrays = (query, key, value, q_segment_ids, kv_segment_ids, bias, mask, query_seq_lengths,
            key_value_seq_lengths)
  spec = _explicit_mesh_spec(query)
  if spec is None:
    return _attention(*arrays, **kw)
  # Under an Explicit mesh, jnp.repeat of a sharded kv-head axis and products of operands
  # sharded differently need their output shardings spelled out; the reference leaves
  # that to the partitioner instead (Auto axes inside), and returns query's sharding.
  return jax.sharding.auto_axes(lambda *a: _attention(*a, **kw), out_sharding=spec)(*arrays)


def _attention(query, key, value, q_segment_ids, kv_segment_ids, bias, mask, q_lengths,
               kv_lengths, *, scale, is_causal, local_window_size, logit_softcap):
  b, t, n, h = query.shape
  s, k = key.shape[1], key.shape[2]
  scale = 1.0 / math.sqrt(h) if scale is None else float(scale)
  window = local_window_size
  if isinstance(window, int):
    window = (window, window)
  # GQA by repeating the kv heads (as jax.nn does; XLA fuses it into the products).
  if n != k:
    key = jnp.repeat(key, n // k, axis=2)
    value = jnp.repeat(value, n // k, axis=2)
  logits = jnp.einsum("btnh,bsnh->bnts", query, key, preferred_element_type=jnp.float32)
  logits = logits.astype(jnp.float32) * jnp.float32(scale)
  if logit_softcap is not None:
    c = jnp.float32(logit_softcap)
    logits = c * jnp.tanh(logits / c)
  if bias is not None:
    logits = logits + bias.astype(jnp.float32)
  keep = visible_mask(t, s, is_causal=is_causal, window=window)

  def both(a, b):
    return b if a is None else jnp.logical_and(a, b)

  if q_segment_ids is not None:
    same = q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :]   # (B, 1, T, S)
    keep = both(keep, same)
  if mask is not None:
    keep = both(keep, mask)
  if q_lengths is not None:
    keep = both(keep, jnp.arange(t)[None, None, :, None] < q_lengths[:, None, None, None])
  if kv_lengths is not None:
    keep = both(keep, jnp.arange(s)[None, None, None, :] < kv_lengths[:, None, None, None])
  if keep is not None:
    logits = jnp.where(keep, logits, -jnp.inf)
  m = jnp.max(logits, axis=-1, keepdims=True, initial=-jnp.inf)
  # A row with nothing visible: shift by 0, so every exp is 0 (not NaN) and the row is 0.
  m = jax.lax.stop_gradient(jnp.where(m == -jnp.inf, 0.0, m))
  e = jnp.exp(logits - m)
  denom = jnp.sum(e, axis=-1, keepdims=True)
  p = e / jnp.where(denom == 0, 1.0, denom)
  out = jnp.einsum("bnts,bsnh->btnh", p.astype(value.dtype), value,
                   preferred_element_type=jnp.float32)
  return out.astype(query.dtype)
