"""decode (paged_attention, paged_kv_update): the oracles, argument makers and the ops'
contract specs.

Oracles, written here independently of jaxgpu.reference (which IS the 'xla'
implementation under test):
  * `np_paged_attention`: float64 numpy, a loop over rows that reads each row's pages
    through its block table, fed the exact values the inputs hold;
  * `jnp_paged_attention`: the same in jnp (gather, masked softmax), in float32 for
    low-precision inputs (the 2x rule's budget) and float64 under oracle.x64() (the
    contract's oracle under vmap, sharding, shard_map and pmap);
  * `np_kv_update` / `jnp_kv_update`: the scatter, exact in any precision;
  * `np_quantize_kv` / `jnp_quantize_kv`: the 8-bit cache's quantization rule
    (ffi/decode/decode_params.h), the e4m3 rounding done by hand (not by a cast), exact.

An 8-bit cache (Case.kv_dtype int8 or float8_e4m3fn) adds k_scale and v_scale to the
arrays; its specs (paged_attention[int8], ...) run every contract case the 16-bit ones do.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import contract as C
import oracle


@dataclasses.dataclass(frozen=True)
class Case:
  dtype: object
  batch: int = 3
  q_len: int = 1
  heads: int = 4
  kv_heads: int = 2
  head_dim: int = 32
  page_size: int = 8
  max_pages: int = 4
  extra_pages: int = 3        # pages in the pool beyond what the rows own
  softcap: float | None = None
  window: int | None = None
  shared_prefix: int = 1      # leading pages every row shares with row 0
  zero_row: bool = True       # one row of length 0 (when batch > 1)
  kv_dtype: object = None     # int8 / float8_e4m3fn: an 8-bit cache; None: the dtype's

  @property
  def num_pages(self) -> int:
    return self.batch * self.max_pages + self.extra_pages

  def static(self) -> dict:
    return dict(logit_softcap=self.softcap, local_window_size=self.window)

  def id(self) -> str:
    parts = [jnp.dtype(self.dtype).name, f"b{self.batch}t{self.q_len}n{self.heads}"
             f"k{self.kv_heads}h{self.head_dim}s{self.page_size}m{self.max_pages}"]
    if self.softcap is not None:
      parts.append(f"cap{self.softcap:g}")
    if self.window is not None:
      parts.append(f"w{self.window}")
    if self.kv_dtype is not None:
      parts.append(jnp.dtype(self.kv_dtype).name)
    return "-".join(parts)


# ---- inputs ---------------------------------------------------------------------------------


def make_table(rng, case: Case, shared: bool = True) -> np.ndarray:
  """(B, M) int32: pages shuffled over the pool; with `shared`, the first shared_prefix
  pages of every row are row 0's (a shared prompt). Unused pool pages stay unreferenced."""
  order = rng.permutation(case.num_pages)
  table = order[:case.batch * case.max_pages].reshape(case.batch, case.max_pages).copy()
  if shared and case.shared_prefix and case.batch:
    table[:, :case.shared_prefix] = table[0, :case.shared_prefix]
  return table.astype(np.int32)


def make_lengths(rng, case: Case) -> np.ndarray:
  """(B,) ragged lengths in [0, capacity]: one full row, one empty row (zero_row)."""
  cap = case.max_pages * case.page_size
  lengths = rng.integers(1, cap + 1, size=case.batch)
  if case.batch:
    lengths[0] = cap
  if case.zero_row and case.batch > 1:
    lengths[1] = 0
  return lengths.astype(np.int32)


def make_pages(rng, case: Case) -> dict:
  """{k_pages, v_pages}, and for an 8-bit cache {k_scale, v_scale}: random rows of the
  case's dtype quantized by the rule (np_quantize_kv), with a spread of row magnitudes."""
  shape = (case.num_pages, case.page_size, case.kv_heads, case.head_dim)
  if case.kv_dtype is None:
    return dict(k_pages=oracle.randn(rng, shape, case.dtype),
                v_pages=oracle.randn(rng, shape, case.dtype))
  out = {}
  for name in ("k", "v"):
    rows = oracle.randn(rng, shape, case.dtype) * jnp.asarray(
        np.exp(rng.uniform(-2, 2, shape[:3] + (1,))), case.dtype)
    values, scale = np_quantize_kv(np.asarray(rows), case.kv_dtype)
    out[f"{name}_pages"] = jnp.asarray(values.astype(case.kv_dtype))
    out[f"{name}_scale"] = jnp.asarray(scale.astype(np.float32))
  return {k: out[k] for k in ("k_pages", "v_pages", "k_scale", "v_scale")}


def _with_scales(arrays: dict, pages: dict) -> dict:
  """arrays with an 8-bit cache's scales after them (the op's keyword order)."""
  return {**arrays, **{k: v for k, v in pages.items() if k.endswith("_scale")}}


def make_attention(rng, case: Case) -> C.Inputs:
  query = oracle.randn(rng, (case.batch, case.q_len, case.heads, case.head_dim), case.dtype,
                       float(rng.uniform(0.5, 2.0)))
  pages = make_pages(rng, case)
  arrays = dict(query=query, k_pages=pages["k_pages"], v_pages=pages["v_pages"],
                block_table=jnp.asarray(make_table(rng, case)),
                lengths=jnp.asarray(make_lengths(rng, case)))
  return C.Inputs(_with_scales(arrays, pages), case.static())


def make_update(rng, case: Case) -> C.Inputs:
  """Each row owns its pages (no shared prefix: a shared page written by two rows would
  make the result depend on the order); the q_len new tokens go at the row's length, the
  last one skipped (position -1) when q_len > 1."""
  pages = make_pages(rng, case)
  table = make_table(rng, case, shared=False)
  cap = case.max_pages * case.page_size
  start = rng.integers(0, cap - case.q_len + 1, size=case.batch)
  positions = start[:, None] + np.arange(case.q_len)[None, :]
  if case.q_len > 1:
    positions[:, -1] = -1
  new = (case.batch, case.q_len, case.kv_heads, case.head_dim)
  arrays = dict(k_pages=pages["k_pages"], v_pages=pages["v_pages"],
                k_new=oracle.randn(rng, new, case.dtype),
                v_new=oracle.randn(rng, new, case.dtype),
                block_table=jnp.asarray(table),
                positions=jnp.asarray(positions.astype(np.int32)))
  return C.Inputs(_with_scales(arrays, pages), {})


def make_with_update(rng, case: Case) -> C.Inputs:
  """make_attention's arrays plus the query tokens' k_new, v_new. Rows keep their shared
  prefix pages (read by every row), and each non-empty row's length puts its new tokens
  past them, so that no row writes a slot another row reads."""
  inputs = make_attention(rng, case)
  arrays = dict(inputs.arrays)
  floor = min(case.shared_prefix * case.page_size + case.q_len,
              case.max_pages * case.page_size)
  lengths = np.asarray(arrays["lengths"])
  arrays["lengths"] = jnp.asarray(np.where(lengths > 0, np.maximum(lengths, floor),
                                           0).astype(np.int32))
  new = (case.batch, case.q_len, case.kv_heads, case.head_dim)
  tokens = dict(k_new=oracle.randn(rng, new, case.dtype), v_new=oracle.randn(rng, new, case.dtype))
  order = ("query", "k_pages", "v_pages", "k_new", "v_new", "block_table", "lengths",
           "k_scale", "v_scale")
  merged = {**arrays, **tokens}
  return C.Inputs({k: merged[k] for k in order if k in merged}, inputs.static)


# ---- the 8-bit cache's quantization rule ------------------------------------------------------

QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}


def _round_e4m3(y, xp):
  """y (|y| <= 448, float) rounded to nearest even on the float8_e4m3fn grid: 3 mantissa
  bits, subnormal quantum 2^-9. Scaling by the quantum (a power of two) is exact."""
  _, e = xp.frexp(y)                          # |y| = m 2^e, m in [0.5, 1)
  exp = xp.maximum(e - 1, -6)                 # floor(log2 |y|); subnormals share 2^-6's
  quantum = xp.ldexp(xp.ones_like(y), exp - 3)
  return xp.round(y / quantum) * quantum      # half to even


def np_quantize_kv(x, kv_dtype):
  """The rule in float64 numpy: (values as float64, scales as float64), each scale and
  x / scale rounded to float32 as the rule's float32 divisions round (a float64 quotient
  of float32 values rounded to float32 is the correctly rounded float32 quotient)."""
  x = oracle.as_f64(x)
  qmax = QMAX[jnp.dtype(kv_dtype)]
  scale = (np.max(np.abs(x), axis=-1) / qmax).astype(np.float32).astype(np.float64)
  ok = scale > 0
  y = np.where(ok[..., None], x / np.where(ok, scale, 1.0)[..., None], 0.0)
  y = y.astype(np.float32).astype(np.float64)
  if jnp.dtype(kv_dtype) == jnp.int8:
    values = np.clip(np.round(y), -127, 127)
  else:
    values = _round_e4m3(np.clip(y, -448.0, 448.0), np)
  return values, scale


def jnp_quantize_kv(x, kv_dtype):
  """The rule in jnp float32 (under x64 too): (values of kv_dtype, float32 scales). The
  divisors are full-shape, derived from x (batched with it under vmap) and behind a
  barrier: XLA would turn a division by a constant or a broadcast into a multiply by the
  reciprocal, which rounds differently."""
  x = x.astype(jnp.float32)
  qmax = QMAX[jnp.dtype(kv_dtype)]
  amax = jnp.max(jnp.abs(x), axis=-1)
  scale = amax / jax.lax.optimization_barrier(jnp.where(jnp.isnan(amax), 1.0,
                                                        jnp.float32(qmax)))
  ok = scale > 0
  div = jax.lax.optimization_barrier(
      jnp.broadcast_to(jnp.where(ok, scale, 1.0)[..., None], x.shape))
  y = jnp.where(ok[..., None], x / div, 0.0)
  if jnp.dtype(kv_dtype) == jnp.int8:
    values = jnp.clip(jnp.round(y), -127, 127)
  else:
    values = _round_e4m3(jnp.clip(y, -448.0, 448.0), jnp)
  return values.astype(kv_dtype), scale


# ---- oracles --------------------------------------------------------------------------------


def np_paged_attention(query, k_pages, v_pages, block_table, lengths, scale=None,
                       logit_softcap=None, local_window_size=None, k_scale=None, v_scale=None):
  """float64, one query row at a time: keys read page by page through the table (an 8-bit
  cache's dequantized exactly)."""
  q = oracle.as_f64(query)
  kp, vp = oracle.as_f64(k_pages), oracle.as_f64(v_pages)
  if k_scale is not None:
    kp = kp * oracle.as_f64(k_scale)[..., None]
    vp = vp * oracle.as_f64(v_scale)[..., None]
  table, lens = np.asarray(block_table), np.asarray(lengths)
  b, tq, n, h = q.shape
  num_pages, s, k, _ = kp.shape
  rep = n // k
  cap = table.shape[1] * s
  scale = 1 / math.sqrt(h) if scale is None else scale
  out = np.zeros(q.shape)
  for r in range(b):
    length = int(lens[r])
    if not 0 <= length <= cap:
      continue
    for t in range(tq):
      pos = length - tq + t
      lo = 0 if local_window_size is None else max(0, pos - local_window_size)
      js = [j for j in range(lo, pos + 1) if 0 <= table[r, j // s] < num_pages]
      if not js:
        continue
      pages = np.array([table[r, j // s] for j in js])
      slots = np.array([j % s for j in js])
      for head in range(n):
        keys = kp[pages, slots, head // rep]
        vals = vp[pages, slots, head // rep]
        z = keys @ q[r, t, head] * scale
        if logit_softcap is not None:
          z = logit_softcap * np.tanh(z / logit_softcap)
        w = np.exp(z - z.max())
        out[r, t, head] = w @ vals / w.sum()
  return out


def jnp_paged_attention(query, k_pages, v_pages, block_table, lengths, scale=None,
                        logit_softcap=None, local_window_size=None, out_dtype=None,
                        k_scale=None, v_scale=None):
  """jnp, at the inputs' precision promoted to float32 (float64 under x64); an 8-bit
  cache dequantized at that precision."""
  acc = jnp.promote_types(query.dtype, jnp.float32)
  if k_scale is not None:
    k_pages = k_pages.astype(acc) * k_scale.astype(acc)[..., None]
    v_pages = v_pages.astype(acc) * v_scale.astype(acc)[..., None]
  b, tq, n, h = query.shape
  num_pages, s, k, _ = k_pages.shape
  m = block_table.shape[1]
  scale = 1 / math.sqrt(h) if scale is None else scale
  if query.size == 0 or num_pages == 0 or m == 0:
    return jnp.zeros(query.shape, out_dtype or query.dtype)
  idx = jnp.clip(block_table, 0, num_pages - 1)
  keys = k_pages[idx].reshape(b, m * s, k, h).astype(acc)
  vals = v_pages[idx].reshape(b, m * s, k, h).astype(acc)
  keys = jnp.repeat(keys, n // k, axis=2)
  vals = jnp.repeat(vals, n // k, axis=2)
  z = jnp.einsum("btnh,bjnh->bntj", query.astype(acc), keys) * scale
  if logit_softcap is not None:
    z = logit_softcap * jnp.tanh(z / logit_softcap)
  j = jnp.arange(m * s)
  pos = lengths[:, None] - tq + jnp.arange(tq)[None, :]
  keep = j[None, None, :] <= pos[:, :, None]
  if local_window_size is not None:
    keep &= j[None, None, :] >= pos[:, :, None] - local_window_size
  page_ok = jnp.repeat((block_table >= 0) & (block_table < num_pages), s, axis=1)
  keep &= page_ok[:, None, :] & ((lengths >= 0) & (lengths <= m * s))[:, None, None]
  keep = keep[:, None]
  z = jnp.where(keep, z, -jnp.inf)
  top = jnp.max(z, -1, keepdims=True)
  w = jnp.where(keep, jnp.exp(z - jnp.where(jnp.isfinite(top), top, 0)), 0)
  total = jnp.sum(w, -1, keepdims=True)
  o = jnp.einsum("bntj,bjnh->btnh", w / jnp.where(total > 0, total, 1), vals)
  return o.astype(out_dtype or query.dtype)


def np_kv_update(k_pages, v_pages, k_new, v_new, block_table, positions, k_scale=None,
                 v_scale=None):
  """The caches after the update, as numpy: (k_pages, v_pages) in their dtype, or for an
  8-bit cache (values as float64, values as float64, k_scale, v_scale as float64)."""
  if k_scale is not None:
    kq, ks = np_quantize_kv(k_new, k_pages.dtype)
    vq, vs = np_quantize_kv(v_new, k_pages.dtype)
    return np_kv_update(oracle.as_f64(k_pages), oracle.as_f64(v_pages), kq, vq, block_table,
                        positions) + np_kv_update(
        oracle.as_f64(k_scale), oracle.as_f64(v_scale), ks, vs, block_table, positions)
  kp, vp = np.array(k_pages), np.array(v_pages)
  table, pos = np.asarray(block_table), np.asarray(positions)
  num_pages, s = kp.shape[:2]
  for r in range(pos.shape[0]):
    for t in range(pos.shape[1]):
      p = int(pos[r, t])
      if not 0 <= p < table.shape[1] * s:
        continue
      page = table[r, p // s]
      if 0 <= page < num_pages:
        kp[page, p % s] = np.asarray(k_new)[r, t]
        vp[page, p % s] = np.asarray(v_new)[r, t]
  return kp, vp


def jnp_kv_update(k_pages, v_pages, k_new, v_new, block_table, positions, k_scale=None,
                  v_scale=None, kv_dtype=None):
  """kv_dtype: an 8-bit cache's value type (its pages may come here as float64)."""
  if k_scale is not None:
    kq, ks = jnp_quantize_kv(k_new, kv_dtype)
    vq, vs = jnp_quantize_kv(v_new, kv_dtype)
    return (jnp_kv_update(k_pages, v_pages, kq, vq, block_table, positions)
            + jnp_kv_update(k_scale, v_scale, ks, vs, block_table, positions))
  num_pages, s = k_pages.shape[:2]
  rest = k_pages.shape[2:]
  m = block_table.shape[1]
  if k_new.size == 0 or num_pages == 0 or m == 0:
    return k_pages, v_pages
  ok = (positions >= 0) & (positions < m * s)
  slot = jnp.clip(positions, 0, m * s - 1)
  page = jnp.take_along_axis(block_table, slot // s, axis=1)
  ok &= (page >= 0) & (page < num_pages)
  flat = jnp.where(ok, page * s + slot % s, num_pages * s).reshape(-1)
  out = []
  for pages, new in ((k_pages, k_new), (v_pages, v_new)):
    rows = pages.reshape(num_pages * s, *rest).at[flat].set(
        new.reshape(-1, *rest).astype(pages.dtype), mode="drop")
    out.append(rows.reshape(pages.shape))
  return tuple(out)


def _attention_oracle(arrays, static, dtype):
  # The float64 oracle keeps float64; the low-precision reference rounds to the query's dtype.
  out_dtype = None if dtype is None else arrays["query"].dtype
  return (jnp_paged_attention(**arrays, **static, out_dtype=out_dtype),)


def _update_oracle(kv_dtype):
  return lambda arrays, static, dtype: jnp_kv_update(**arrays, kv_dtype=kv_dtype)


def query_positions(lengths, q_len: int):
  """(B, Tq): the query tokens' positions lengths - Tq + t."""
  return lengths[:, None] - q_len + jnp.arange(q_len, dtype=lengths.dtype)[None, :]


def jnp_with_update(arrays, static, out_dtype=None, kv_dtype=None):
  """The update of the query tokens' K/V at their positions, then the attention over the
  updated caches: (y, k_pages, v_pages[, k_scale, v_scale])."""
  a = dict(arrays)
  positions = query_positions(a["lengths"], a["query"].shape[1])
  scales = {k: a[k] for k in ("k_scale", "v_scale") if k in a}
  caches = jnp_kv_update(a["k_pages"], a["v_pages"], a["k_new"], a["v_new"], a["block_table"],
                         positions, **scales, kv_dtype=kv_dtype)
  updated = dict(k_pages=caches[0], v_pages=caches[1])
  if scales:
    updated.update(k_scale=caches[2], v_scale=caches[3])
  y = jnp_paged_attention(a["query"], block_table=a["block_table"], lengths=a["lengths"],
                          **updated, **static, out_dtype=out_dtype)
  return (y,) + tuple(caches)


def _with_update_oracle(arrays, static, dtype):
  out_dtype = None if dtype is None else arrays["query"].dtype
  return jnp_with_update(arrays, static, out_dtype=out_dtype)


# ---- the contract tables ---------------------------------------------------------------------

OPTIONS = dict(softcap=30.0, window=9)
ATT_ARGS = ("query", "k_pages", "v_pages", "block_table", "lengths")
UPD_ARGS = ("k_pages", "v_pages", "k_new", "v_new", "block_table", "positions")


def _att_vmap_table() -> tuple:
  every = dict.fromkeys(ATT_ARGS, 0)
  rows = {"query": 1, "block_table": 0, "lengths": 0}
  return (
      C.VmapCase("all0", Case(jnp.float32, q_len=2, **OPTIONS), (every,), frozenset({"fwd"})),
      # One shared pool: the pages are not batched (the kernel broadcasts them, no copy).
      C.VmapCase("rows-shared-pool", Case(jnp.bfloat16, q_len=3), (rows,), frozenset({"fwd"})),
      C.VmapCase("nested", Case(jnp.float16, batch=2, q_len=1),
                 (every, {"query": 0, "block_table": 0, "lengths": 0}), frozenset({"fwd"}),
                 sizes=(2, 3)),
  )


def _upd_vmap_table() -> tuple:
  every = dict.fromkeys(UPD_ARGS, 0)
  new_only = {"k_new": 0, "v_new": 0, "positions": 0}
  return (
      C.VmapCase("all0", Case(jnp.float32, q_len=3), (every,), frozenset({"fwd"})),
      # An unbatched pool under vmap: copied once per example, each with its own writes.
      C.VmapCase("new-only", Case(jnp.bfloat16, q_len=2), (new_only,), frozenset({"fwd"})),
  )


SHARD_CASE = Case(jnp.bfloat16, batch=8, q_len=2, heads=8, kv_heads=2, **OPTIONS)
ATT_SHARDINGS = (
    C.ShardingCase("batch", SHARD_CASE,
                   {"query": P("a"), "block_table": P("a"), "lengths": P("a")},
                   fwd=frozenset(), out_specs={"y": P("a")}),
    # kv heads (and the query heads of each kv group with them): no collective.
    C.ShardingCase("kv-heads", SHARD_CASE,
                   {"query": P(None, None, "b"), "k_pages": P(None, None, "b"),
                    "v_pages": P(None, None, "b")},
                   fwd=frozenset(), out_specs={"y": P(None, None, "b")}, kernels_only=True),
)
UPD_SHARDINGS = (
    C.ShardingCase("kv-heads", Case(jnp.bfloat16, batch=4, q_len=2, kv_heads=2),
                   {"k_pages": P(None, None, "b"), "v_pages": P(None, None, "b"),
                    "k_new": P(None, None, "b"), "v_new": P(None, None, "b")},
                   fwd=frozenset(), kernels_only=True,
                   out_specs={"k_pages": P(None, None, "b"), "v_pages": P(None, None, "b")}),
)


def _bad(kw_fn, error, match, id_):
  return C.BadInput(id_, kw_fn, error, match)


def _att_kw(**over):
  case = Case(jnp.float32, batch=2, q_len=2)
  inputs = make_attention(np.random.default_rng(0), case)
  return {**inputs.arrays, **over}


def _upd_kw(**over):
  case = Case(jnp.float32, batch=2, q_len=2)
  inputs = make_update(np.random.default_rng(0), case)
  return {**inputs.arrays, **over}


# Concrete-only checks (lengths and table entries in range) are tested eagerly in
# tests/test_decode.py: under jit they are traced, and the kernels mask instead.
ATT_BAD = (
    _bad(lambda: _att_kw(query=jnp.ones((2, 2, 4, 32), jnp.int32)), TypeError, r"query.*dtype",
         "query-int"),
    _bad(lambda: _att_kw(query=jnp.ones((2, 4, 32))), ValueError, r"query.*rank", "query-rank"),
    _bad(lambda: _att_kw(query=jnp.ones((2, 17, 4, 32))), ValueError, r"query.*Tq",
         "query-tq17"),
    _bad(lambda: _att_kw(query=jnp.ones((2, 2, 3, 32))), ValueError, r"multiple of the kv",
         "heads-not-multiple"),
    _bad(lambda: _att_kw(query=jnp.ones((2, 2, 4, 16))), ValueError, r"k_pages.*head dim",
         "head-dim-mismatch"),
    _bad(lambda: _att_kw(k_pages=jnp.ones((11, 8, 2, 32), jnp.bfloat16),
                         v_pages=jnp.ones((11, 8, 2, 32), jnp.bfloat16)), TypeError,
         r"k_pages.*dtype", "pages-dtype"),
    _bad(lambda: _att_kw(k_pages=jnp.ones((11, 6, 2, 32)), v_pages=jnp.ones((11, 6, 2, 32))),
         ValueError, r"page size", "page-size-6"),
    _bad(lambda: _att_kw(v_pages=jnp.ones((11, 8, 1, 32))), ValueError, r"v_pages.*shape",
         "v-shape"),
    _bad(lambda: _att_kw(block_table=jnp.zeros((2, 4), jnp.float32)), TypeError,
         r"block_table.*integer", "table-float"),
    _bad(lambda: _att_kw(block_table=jnp.zeros((3, 4), jnp.int32)), ValueError,
         r"block_table.*shape", "table-batch"),
    _bad(lambda: _att_kw(lengths=jnp.zeros((2, 1), jnp.int32)), ValueError, r"lengths.*shape",
         "lengths-shape"),
    _bad(lambda: _att_kw(scale=0.0), ValueError, r"scale", "scale-zero"),
    _bad(lambda: _att_kw(logit_softcap=-1.0), ValueError, r"logit_softcap", "softcap-negative"),
    _bad(lambda: _att_kw(local_window_size=-2), ValueError, r"local_window_size", "window-neg"),
    _bad(lambda: _att_kw(local_window_size=(4, 2)), ValueError, r"local_window_size",
         "window-right"),
    _bad(lambda: _att_kw(implementation="bogus"), ValueError, r"implementation", "impl-bogus"),
)

UPD_BAD = (
    _bad(lambda: _upd_kw(k_new=jnp.ones((2, 2, 2, 32), jnp.bfloat16)), TypeError,
         r"k_new.*dtype", "new-dtype"),
    _bad(lambda: _upd_kw(k_new=jnp.ones((2, 2, 1, 32))), ValueError, r"k_new.*shape",
         "new-kv-heads"),
    _bad(lambda: _upd_kw(v_new=jnp.ones((2, 3, 2, 32))), ValueError, r"v_new.*shape",
         "v-new-shape"),
    _bad(lambda: _upd_kw(positions=jnp.zeros((2, 3), jnp.int32)), ValueError,
         r"positions.*shape", "positions-shape"),
    _bad(lambda: _upd_kw(k_pages=jnp.ones((11, 8, 2, 30)), v_pages=jnp.ones((11, 8, 2, 30))),
         ValueError, r"head dim", "head-dim-30"),
    _bad(lambda: _upd_kw(positions=jnp.zeros((2, 2), jnp.float32)), TypeError,
         r"positions.*integer", "positions-float"),
)

WITH_ARGS = ("query", "k_pages", "v_pages", "k_new", "v_new", "block_table", "lengths")


def _with_kw(**over):
  case = Case(jnp.float32, batch=2, q_len=2)
  inputs = make_with_update(np.random.default_rng(0), case)
  return {**inputs.arrays, **over}


WITH_BAD = (
    _bad(lambda: _with_kw(k_new=jnp.ones((2, 2, 2, 32), jnp.bfloat16)), TypeError,
         r"k_new.*dtype", "new-dtype"),
    _bad(lambda: _with_kw(k_new=jnp.ones((2, 1, 2, 32))), ValueError, r"k_new.*shape",
         "new-tokens-not-tq"),
    _bad(lambda: _with_kw(v_new=jnp.ones((2, 2, 1, 32))), ValueError, r"v_new.*shape",
         "v-new-kv-heads"),
    _bad(lambda: _with_kw(query=jnp.ones((2, 2, 3, 32))), ValueError, r"multiple of the kv",
         "heads-not-multiple"),
    _bad(lambda: _with_kw(lengths=jnp.zeros((3,), jnp.int32)), ValueError, r"lengths.*shape",
         "lengths-shape"),
)
KV_HEADS = P(None, None, "b")
WITH_KV_HEADS = {k: KV_HEADS for k in ("query", "k_pages", "v_pages", "k_new", "v_new")}

ROWS8 = P(("a", "b"))

SPECS = (
    C.OpSpec(
        name="paged_attention",
        make=make_attention,
        example=Case(jnp.float32, q_len=2, **OPTIONS),
        array_args=ATT_ARGS,
        diff_args=(),
        oracle=_attention_oracle,
        vmap=_att_vmap_table(),
        pmap=C.VmapCase("all0", Case(jnp.float32), (dict.fromkeys(ATT_ARGS, 0),),
                        frozenset({"fwd"}), sizes=(C.PMAP_DEVICES,)),
        sharding=ATT_SHARDINGS,
        shard_map=C.ShardMapCase(Case(jnp.bfloat16, batch=8, q_len=2, **OPTIONS),
                                 {"query": ROWS8, "block_table": ROWS8, "lengths": ROWS8},
                                 (ROWS8,)),
        bad_inputs=ATT_BAD,
        size_zero=(("batch0", Case(jnp.bfloat16, batch=0, extra_pages=2)),
                   ("no-pages", Case(jnp.bfloat16, batch=0, extra_pages=0))),
    ),
    C.OpSpec(
        name="paged_kv_update",
        make=make_update,
        example=Case(jnp.float32, q_len=3),
        array_args=UPD_ARGS,
        diff_args=(),
        oracle=_update_oracle(None),
        outputs=("k_pages", "v_pages"),
        vmap=_upd_vmap_table(),
        pmap=C.VmapCase("all0", Case(jnp.float32, q_len=2), (dict.fromkeys(UPD_ARGS, 0),),
                        frozenset({"fwd"}), sizes=(C.PMAP_DEVICES,)),
        sharding=UPD_SHARDINGS,
        shard_map=C.ShardMapCase(Case(jnp.bfloat16, batch=2, q_len=2, kv_heads=2),
                                 {"k_pages": P(None, None, "b"), "v_pages": P(None, None, "b"),
                                  "k_new": P(None, None, "b"), "v_new": P(None, None, "b")},
                                 (P(None, None, "b"), P(None, None, "b"))),
        bad_inputs=UPD_BAD,
        size_zero=(("batch0", Case(jnp.bfloat16, batch=0, extra_pages=2)),),
    ),
    C.OpSpec(
        name="paged_attention_with_update",
        make=make_with_update,
        example=Case(jnp.float32, q_len=2, **OPTIONS),
        array_args=WITH_ARGS,
        diff_args=(),
        oracle=_with_update_oracle,
        outputs=("y", "k_pages", "v_pages"),
        vmap=(
            C.VmapCase("all0", Case(jnp.float32, q_len=2, **OPTIONS),
                       (dict.fromkeys(WITH_ARGS, 0),), frozenset({"fwd"})),
            # An unbatched pool: copied once per example, each with its own writes.
            C.VmapCase("shared-pool", Case(jnp.bfloat16, q_len=1),
                       ({"query": 1, "k_new": 1, "v_new": 1, "block_table": 0,
                         "lengths": 0},), frozenset({"fwd"})),
        ),
        pmap=C.VmapCase("all0", Case(jnp.float32), (dict.fromkeys(WITH_ARGS, 0),),
                        frozenset({"fwd"}), sizes=(C.PMAP_DEVICES,)),
        sharding=(
            C.ShardingCase("kv-heads", SHARD_CASE, WITH_KV_HEADS, fwd=frozenset(),
                           kernels_only=True,
                           out_specs={"y": KV_HEADS, "k_pages": KV_HEADS,
                                      "v_pages": KV_HEADS}),
        ),
        shard_map=C.ShardMapCase(Case(jnp.bfloat16, batch=2, q_len=2, kv_heads=2, **OPTIONS),
                                 WITH_KV_HEADS, (KV_HEADS,) * 3),
        bad_inputs=WITH_BAD,
        size_zero=(("batch0", Case(jnp.bfloat16, batch=0, extra_pages=2)),),
    ),
)


# ---- the 8-bit cache: the same contract, with the scales ----------------------------------------

SCALES = ("k_scale", "v_scale")


def _q8_att_kw(kv_dtype, **over):
  case = Case(jnp.float32, batch=2, q_len=2, kv_dtype=kv_dtype)
  inputs = make_attention(np.random.default_rng(0), case)
  return {k: v for k, v in {**inputs.arrays, **over}.items() if v is not None}


def _q8_upd_kw(kv_dtype, **over):
  case = Case(jnp.float32, batch=2, q_len=2, kv_dtype=kv_dtype)
  inputs = make_update(np.random.default_rng(0), case)
  return {k: v for k, v in {**inputs.arrays, **over}.items() if v is not None}


def _q8_bad(kw, name):
  """Bad scales: missing, misshapen, mistyped, or given with a 16-bit cache."""
  other = jnp.float8_e4m3fn if name == "int8" else jnp.int8
  f32_kw = _att_kw if kw is _q8_att_kw else _upd_kw
  ones = jnp.ones((11, 8, 2), jnp.float32)
  return (
      _bad(lambda: kw(name, k_scale=None), TypeError, r"k_scale is required", "no-k-scale"),
      _bad(lambda: kw(name, v_scale=None), TypeError, r"v_scale is required", "no-v-scale"),
      _bad(lambda: kw(name, k_scale=jnp.ones((11, 8, 1), jnp.float32)), ValueError,
           r"k_scale.*shape", "k-scale-shape"),
      _bad(lambda: kw(name, v_scale=jnp.ones((11, 8, 2, 1), jnp.float32)), ValueError,
           r"v_scale.*shape", "v-scale-rank"),
      _bad(lambda: kw(name, k_scale=jnp.ones((11, 8, 2), jnp.bfloat16)), TypeError,
           r"k_scale.*float32", "k-scale-bf16"),
      _bad(lambda: kw(name, v_pages=kw(name)["v_pages"].astype(other)), TypeError,
           r"v_pages.*dtype", "v-pages-other-8bit"),
      _bad(lambda: f32_kw(k_scale=ones, v_scale=ones), TypeError,
           r"k_scale is only for an 8-bit cache", "scales-with-f32-cache"),
  )


def _q8_specs(kv_dtype) -> tuple:
  name = jnp.dtype(kv_dtype).name
  q8 = functools.partial(dataclasses.replace, kv_dtype=kv_dtype)
  att_args = ATT_ARGS + SCALES
  upd_args = UPD_ARGS + SCALES
  kv_heads = {k: KV_HEADS for k in ("k_pages", "v_pages") + SCALES}
  return (
      C.OpSpec(
          name="paged_attention",
          variant=name,
          fwd_pass="fwd_q8",
          make=make_attention,
          example=Case(jnp.float32, q_len=2, kv_dtype=kv_dtype, **OPTIONS),
          array_args=att_args,
          diff_args=(),
          oracle=_attention_oracle,
          vmap=(
              C.VmapCase("all0", Case(jnp.float32, q_len=2, kv_dtype=kv_dtype, **OPTIONS),
                         (dict.fromkeys(att_args, 0),), frozenset({"fwd"})),
              C.VmapCase("rows-shared-pool", Case(jnp.bfloat16, q_len=3, kv_dtype=kv_dtype),
                         ({"query": 1, "block_table": 0, "lengths": 0},), frozenset({"fwd"})),
          ),
          pmap=C.VmapCase("all0", Case(jnp.float32, kv_dtype=kv_dtype),
                          (dict.fromkeys(att_args, 0),), frozenset({"fwd"}),
                          sizes=(C.PMAP_DEVICES,)),
          sharding=(
              C.ShardingCase("batch", q8(SHARD_CASE),
                             {"query": P("a"), "block_table": P("a"), "lengths": P("a")},
                             fwd=frozenset(), out_specs={"y": P("a")}),
              C.ShardingCase("kv-heads", q8(SHARD_CASE), {"query": KV_HEADS, **kv_heads},
                             fwd=frozenset(), out_specs={"y": KV_HEADS}, kernels_only=True),
          ),
          shard_map=C.ShardMapCase(
              Case(jnp.bfloat16, batch=8, q_len=2, kv_dtype=kv_dtype, **OPTIONS),
              {"query": ROWS8, "block_table": ROWS8, "lengths": ROWS8}, (ROWS8,)),
          bad_inputs=_q8_bad(_q8_att_kw, name),
          size_zero=(("batch0", Case(jnp.bfloat16, batch=0, extra_pages=2, kv_dtype=kv_dtype)),),
      ),
      C.OpSpec(
          name="paged_kv_update",
          variant=name,
          fwd_pass="fwd_q8",
          make=make_update,
          example=Case(jnp.float32, q_len=3, kv_dtype=kv_dtype),
          array_args=upd_args,
          diff_args=(),
          oracle=_update_oracle(kv_dtype),
          outputs=("k_pages", "v_pages") + SCALES,
          vmap=(
              C.VmapCase("all0", Case(jnp.float32, q_len=3, kv_dtype=kv_dtype),
                         (dict.fromkeys(upd_args, 0),), frozenset({"fwd"})),
              C.VmapCase("new-only", Case(jnp.bfloat16, q_len=2, kv_dtype=kv_dtype),
                         ({"k_new": 0, "v_new": 0, "positions": 0},), frozenset({"fwd"})),
          ),
          pmap=C.VmapCase("all0", Case(jnp.float32, q_len=2, kv_dtype=kv_dtype),
                          (dict.fromkeys(upd_args, 0),), frozenset({"fwd"}),
                          sizes=(C.PMAP_DEVICES,)),
          sharding=(
              C.ShardingCase("kv-heads", Case(jnp.bfloat16, batch=4, q_len=2, kv_dtype=kv_dtype),
                             {"k_new": KV_HEADS, "v_new": KV_HEADS, **kv_heads},
                             fwd=frozenset(), kernels_only=True, out_specs=kv_heads),
          ),
          shard_map=C.ShardMapCase(
              Case(jnp.bfloat16, batch=2, q_len=2, kv_dtype=kv_dtype),
              {"k_new": KV_HEADS, "v_new": KV_HEADS, **kv_heads}, (KV_HEADS,) * 4),
          bad_inputs=_q8_bad(_q8_upd_kw, name),
          size_zero=(("batch0", Case(jnp.bfloat16, batch=0, extra_pages=2, kv_dtype=kv_dtype)),),
      ),
  )


SPECS += _q8_specs(jnp.int8) + _q8_specs(jnp.float8_e4m3fn)
