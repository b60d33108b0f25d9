"""Pure-JAX decode attention over a paged KV cache, and the cache update:
implementation='xla' and the low-precision twin of the tests' oracle.

Semantics (those of the kernels, ffi/decode/decode_params.h). Row b's cache is the
sequence of pages block_table[b, 0], block_table[b, 1], ...: page j holds positions
j * page_size .. (j + 1) * page_size - 1. lengths[b] counts the row's tokens including the
Tq new ones, whose queries sit at positions p_t = lengths[b] - Tq + t. Query head n reads
kv head n // (N // K). Query t sees key position j when j <= p_t (causal among the new
tokens, the whole cache before them), p_t - window <= j (with a local window), and
block_table[b, j // page_size] is a page in [0, P). Logits ``scale * q . k`` in float32,
then ``c * tanh(logits / c)`` with a softcap c; softmax and the P.V product in float32, the
output rounded once to the query's dtype. A query with no visible key (a row of length 0,
a position below 0) gets zeros, and so does every query of a row whose length is outside
[0, max_pages * page_size]: traced lengths and table entries are never read out of bounds.

8-bit cache: int8 or float8_e4m3fn pages with float32 scales (P, page_size, K), one per
token and kv head; a stored value means float(value) * scale. `quantize_kv` is the rule the
update applies to new tokens (and the CPU and CUDA kernels reproduce bit for bit); the
attention dequantizes the gathered pages in float32, then runs the same math.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxgpu import _checks, _kernel_op

# The 8-bit cache's value types and the largest magnitude each stores (Qmax).
QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}
Q8_DTYPES = tuple(QMAX)


def quantize_kv(x, dtype):
  """Quantizes keys or values for an 8-bit KV cache, one scale per row of the last axis.

  Args:
    x: (..., K, H) float (bfloat16, float16 or float32): rows of H values, one per token
      and kv head.
    dtype: jnp.int8 or jnp.float8_e4m3fn.

  Returns:
    (values, scale): values (..., K, H) of `dtype` and scale (..., K) float32 with
    float(values) * scale[..., None] ~ x.

  The rule, in float32 from the input values, per row: scale = max|x| / Qmax (Qmax 127
  for int8, 448 for float8_e4m3fn), an IEEE division; each value divided by the scale
  (again a division: a multiply by 1 / scale rounds differently); int8 rounds half to even
  and clamps to [-127, 127]; float8_e4m3fn clips to [-448, 448] and rounds to nearest
  even. A row whose scale is 0 (all zeros) stores zeros. paged_kv_update applies exactly
  this rule to an 8-bit cache's new tokens, and its CPU and CUDA kernels give the same
  bits.
  """
  op = "quantize_kv"
  x = _checks.float_array(op, "x", x)
  _checks.min_rank(op, "x", x, 2)
  try:
    qdtype = jnp.dtype(dtype)
  except TypeError:
    qdtype = None
  if qdtype not in QMAX:
    raise TypeError(f"{op}: dtype must be int8 or float8_e4m3fn, got {dtype!r}")
  xf = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(xf), axis=-1)
  # XLA turns a division by a constant or a broadcast (A / broadcast(b)) into a multiply by
  # the rounded reciprocal; a full-shape divisor behind an optimization barrier stays an
  # IEEE division. The divisors derive from x, so that under vmap they are batched with it
  # (an unbatched one would be broadcast after the barrier, and rewritten).
  scale = amax / _opaque(jnp.where(jnp.isnan(amax), 1.0, jnp.float32(QMAX[qdtype])))
  ok = scale > 0
  divisor = _opaque(jnp.broadcast_to(jnp.where(ok, scale, 1.0)[..., None], xf.shape))
  y = jnp.where(ok[..., None], xf / divisor, 0.0)
  qmax = jnp.float32(QMAX[qdtype])
  if qdtype == jnp.int8:
    values = jnp.clip(jnp.round(y), -127, 127).astype(jnp.int8)
  else:
    values = jnp.clip(y, -qmax, qmax).astype(qdtype)
  return values, scale


def _opaque(x):
  return jax.lax.optimization_barrier(x)


def dequantize(values, scale):
  """float32 values of an 8-bit cache: float(values) * scale[..., None]."""
  return values.astype(jnp.float32) * scale[..., None]


def _gather(pages, block_table):
  """(P, S, ...) pages (or scales), (B, M) table -> (B, M * S, ...), out-of-range entries
  clamped (their keys are masked by the caller)."""
  b, m = block_table.shape
  s, rest = pages.shape[1], pages.shape[2:]
  idx = jnp.clip(block_table, 0, pages.shape[0] - 1)
  if (_kernel_op.in_explicit_mode(idx)
      or _kernel_op.explicit_spec(pages) != (None,) * pages.ndim):
    # Explicit sharding: the gathered rows keep the table's batch sharding and the pool's
    # kv-head sharding (jnp cannot infer a gather's output sharding on its own).
    spec = PartitionSpec(*_kernel_op.explicit_spec(idx), *_kernel_op.explicit_spec(pages)[1:])
    return pages.at[idx].get(out_sharding=spec).reshape(b, m * s, *rest)
  return pages[idx].reshape(b, m * s, *rest)


def _gather_kv(pages, scale, block_table):
  """The rows' K or V as (B, M * S, K, H) float32, dequantized when `scale` is given."""
  if scale is None:
    return _gather(pages, block_table).astype(jnp.float32)
  return dequantize(_gather(pages, block_table), _gather(scale, block_table))


def visible(block_table, lengths, *, num_pages: int, page_size: int, q_len: int,
            window: int | None = None):
  """(B, Tq, M * page_size) bool: key position j visible to new token t of row b."""
  b, m = block_table.shape
  cap = m * page_size
  j = jnp.arange(cap)[None, None, :]
  pos = (lengths[:, None] - q_len + jnp.arange(q_len)[None, :])[:, :, None]
  page_ok = (block_table >= 0) & (block_table < num_pages)
  page_ok = jnp.repeat(page_ok, page_size, axis=1)[:, None, :]
  row_ok = ((lengths >= 0) & (lengths <= cap))[:, None, None]
  keep = (j <= pos) & page_ok & row_ok
  if window is not None:
    keep &= j >= pos - window
  return keep


def paged_attention(query, k_pages, v_pages, block_table, lengths, *, scale: float,
                    logit_softcap: float | None = None, local_window_size: int | None = None,
                    k_scale=None, v_scale=None):
  """query (B, Tq, N, H); pages (P, S, K, H); block_table (B, M) int32; lengths (B,) int32
  -> (B, Tq, N, H) in query's dtype. Gathers each row's pages into a contiguous (B, M * S,
  K, H) copy first: a reference, not a kernel. An 8-bit cache comes with its scales
  k_scale, v_scale (P, S, K) float32."""
  query, k_pages, v_pages = jnp.asarray(query), jnp.asarray(k_pages), jnp.asarray(v_pages)
  block_table, lengths = jnp.asarray(block_table), jnp.asarray(lengths)
  b, tq, n, h = query.shape
  num_pages, page_size, kv, _ = k_pages.shape
  if query.size == 0 or num_pages == 0 or block_table.shape[1] == 0:
    return jnp.zeros(query.shape, query.dtype)
  rep = n // kv
  k = _gather_kv(k_pages, k_scale, block_table)
  v = _gather_kv(v_pages, v_scale, block_table)
  q = query.reshape(b, tq, kv, rep, h).astype(jnp.float32)
  s = jnp.einsum("btkrh,blkh->bkrtl", q, k) * jnp.float32(scale)
  if logit_softcap is not None:
    c = jnp.float32(logit_softcap)
    s = c * jnp.tanh(s / c)
  keep = visible(block_table, lengths, num_pages=num_pages, page_size=page_size, q_len=tq,
                 window=local_window_size)[:, None, None]
  s = jnp.where(keep, s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(keep, jnp.exp(s - m), 0.0)
  denom = jnp.sum(p, axis=-1)
  o = jnp.einsum("bkrtl,blkh->btkrh", p, v)
  denom = jnp.transpose(denom, (0, 3, 1, 2))[..., None]
  o = jnp.where(denom > 0, o / jnp.where(denom > 0, denom, 1.0), 0.0)
  return o.reshape(b, tq, n, h).astype(query.dtype)


def paged_kv_update(k_pages, v_pages, k_new, v_new, block_table, positions, *, k_scale=None,
                    v_scale=None):
  """Writes k_new / v_new (B, Tn, K, H) at positions (B, Tn) of each row's pages; a token
  whose position is outside [0, M * S) or whose page entry is outside [0, P) is dropped.
  An 8-bit cache (k_scale, v_scale given) gets the new tokens quantized by quantize_kv and
  their scales: (k_pages, v_pages, k_scale, v_scale); else (k_pages, v_pages)."""
  k_pages, v_pages = jnp.asarray(k_pages), jnp.asarray(v_pages)
  k_new, v_new = jnp.asarray(k_new), jnp.asarray(v_new)
  block_table, positions = jnp.asarray(block_table), jnp.asarray(positions)
  q8 = k_scale is not None
  caches = (k_pages, v_pages) + ((jnp.asarray(k_scale), jnp.asarray(v_scale)) if q8 else ())
  num_pages, page_size, kv, h = k_pages.shape
  b, tn = positions.shape
  m = block_table.shape[1]
  if k_new.size == 0 or num_pages == 0 or m == 0:
    return caches
  in_range = (positions >= 0) & (positions < m * page_size)
  slot = jnp.clip(positions, 0, m * page_size - 1)
  page = jnp.take_along_axis(block_table, slot // page_size, axis=1)
  ok = in_range & (page >= 0) & (page < num_pages)
  # Dropped tokens get an index past the end, which mode='drop' discards.
  flat = jnp.where(ok, page * page_size + slot % page_size, num_pages * page_size)

  def write(cache, new):
    rows = cache.reshape(num_pages * page_size, *cache.shape[2:])
    out = rows.at[flat.reshape(-1)].set(new.reshape(b * tn, *cache.shape[2:]).astype(cache.dtype),
                                        mode="drop")
    return out.reshape(cache.shape)

  if not q8:
    return write(k_pages, k_new), write(v_pages, v_new)
  kq, ks = quantize_kv(k_new, k_pages.dtype)
  vq, vs = quantize_kv(v_new, v_pages.dtype)
  return write(k_pages, kq), write(v_pages, vq), write(caches[2], ks), write(caches[3], vs)


def query_positions(lengths, q_len: int):
  """(B, Tq) int32: the positions lengths - Tq + t of the query tokens (negative ones, of a
  row shorter than Tq, are skipped by the update and see nothing)."""
  return (jnp.asarray(lengths, jnp.int32)[:, None] - q_len
          + jnp.arange(q_len, dtype=jnp.int32)[None, :])


def paged_attention_with_update(query, k_pages, v_pages, k_new, v_new, block_table, lengths,
                                *, scale: float, logit_softcap: float | None = None,
                                local_window_size: int | None = None, k_scale=None,
                                v_scale=None):
  """paged_kv_update of the query tokens' k_new / v_new (B, Tq, K, H) at their positions
  lengths - Tq + t, then paged_attention over the updated caches: (out, k_pages, v_pages),
  plus (k_scale, v_scale) for an 8-bit cache."""
  positions = query_positions(lengths, jnp.shape(query)[1])
  caches = paged_kv_update(k_pages, v_pages, k_new, v_new, block_table, positions,
                           k_scale=k_scale, v_scale=v_scale)
  scales = dict(k_scale=caches[2], v_scale=caches[3]) if k_scale is not None else {}
  out = paged_attention(query, caches[0], caches[1], block_table, lengths, scale=scale,
                        logit_softcap=logit_softcap, local_window_size=local_window_size,
                        **scales)
  return (out,) + tuple(caches)
