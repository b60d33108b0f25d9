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
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxgpu import _kernel_op


def _gather(pages, block_table):
  """(P, S, K, H) pages, (B, M) table -> (B, M * S, K, H), out-of-range entries clamped
  (their keys are masked by the caller)."""
  b, m = block_table.shape
  _, s, k, h = pages.shape
  idx = jnp.clip(block_table, 0, pages.shape[0] - 1)
  if _kernel_op.in_explicit_mode(idx) or _kernel_op.explicit_spec(pages) != (None,) * 4:
    # Explicit sharding: the gathered rows keep the table's batch sharding and the pool's
    # kv-head sharding (jnp cannot infer a gather's output sharding on its own).
    spec = PartitionSpec(*_kernel_op.explicit_spec(idx), *_kernel_op.explicit_spec(pages)[1:])
    return pages.at[idx].get(out_sharding=spec).reshape(b, m * s, k, h)
  return pages[idx].reshape(b, m * s, k, h)


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
                    logit_softcap: float | None = None, local_window_size: int | None = None):
  """query (B, Tq, N, H); pages (P, S, K, H); block_table (B, M) int32; lengths (B,) int32
  -> (B, Tq, N, H) in query's dtype. Gathers each row's pages into a contiguous (B, M * S,
  K, H) copy first: a reference, not a kernel."""
  query, k_pages, v_pages = jnp.asarray(query), jnp.asarray(k_pages), jnp.asarray(v_pages)
  block_table, lengths = jnp.asarray(block_table), jnp.asarray(lengths)
  b, tq, n, h = query.shape
  num_pages, page_size, kv, _ = k_pages.shape
  if query.size == 0 or num_pages == 0 or block_table.shape[1] == 0:
    return jnp.zeros(query.shape, query.dtype)
  rep = n // kv
  k = _gather(k_pages, block_table).astype(jnp.float32)
  v = _gather(v_pages, block_table).astype(jnp.float32)
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


def paged_kv_update(k_pages, v_pages, k_new, v_new, block_table, positions):
  """Writes k_new / v_new (B, Tn, K, H) at positions (B, Tn) of each row's pages; a token
  whose position is outside [0, M * S) or whose page entry is outside [0, P) is dropped."""
  k_pages, v_pages = jnp.asarray(k_pages), jnp.asarray(v_pages)
  k_new, v_new = jnp.asarray(k_new), jnp.asarray(v_new)
  block_table, positions = jnp.asarray(block_table), jnp.asarray(positions)
  num_pages, page_size, kv, h = k_pages.shape
  b, tn = positions.shape
  m = block_table.shape[1]
  if k_new.size == 0 or num_pages == 0 or m == 0:
    return k_pages, v_pages
  in_range = (positions >= 0) & (positions < m * page_size)
  slot = jnp.clip(positions, 0, m * page_size - 1)
  page = jnp.take_along_axis(block_table, slot // page_size, axis=1)
  ok = in_range & (page >= 0) & (page < num_pages)
  # Dropped tokens get an index past the end, which mode='drop' discards.
  flat = jnp.where(ok, page * page_size + slot % page_size, num_pages * page_size)

  def write(pages, new):
    flat_pages = pages.reshape(num_pages * page_size, kv, h)
    out = flat_pages.at[flat.reshape(-1)].set(new.reshape(b * tn, kv, h).astype(pages.dtype),
                                             mode="drop")
    return out.reshape(pages.shape)

  return write(k_pages, k_new), write(v_pages, v_new)
