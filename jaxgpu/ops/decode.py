"""Decode attention over a paged KV cache, and the in-place cache update; forward only.

Kernels: ffi/decode/ (targets jaxgpu_paged_attention_fwd, jaxgpu_paged_kv_update_fwd, their
8-bit cache twins jaxgpu_paged_attention_q8_fwd, jaxgpu_paged_kv_update_q8_fwd, and
jaxgpu_paged_attention_with_update_fwd: a decode step's write and attention in one call).
Reference: jaxgpu/reference/decode.py. Tests: tests/test_decode.py.

The cache is a pool of pages (P, page_size, K, H) shared by every row of the batch; a row
names its pages in its block-table row, so rows of different lengths share one pool and
rows may share prefix pages. paged_attention reads each row's pages through the table (no
gathered copy); paged_kv_update writes new tokens into their slots in place.

8-bit cache: int8 or float8_e4m3fn pages with float32 scales (P, page_size, K), one per
token and kv head (jaxgpu.quantize_kv's rule): half the bytes of a bf16 cache, plus 4 bytes
per token and kv head. The ops take the scales as k_scale and v_scale and call the _q8
targets, whose arguments are the 16-bit ones' with the scales after the pages.

Memory. paged_attention writes its output and, when it splits a row's cache over several
thread blocks (split-KV, so that a small batch fills the GPU), a float32 workspace of
partial outputs and log-sum-exps: (rows x splits) x (Tq x N/K) x (H + 1) floats, at most
a few MB (the split count targets a fixed number of blocks). paged_kv_update aliases the
caches to its outputs (input_output_aliases): under jit with the caches donated, no copy of
the cache is made; without donation XLA copies each cache once before the write, as for
any in-place update of a live buffer.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpu import _checks, _implementation
from jaxgpu._family import Family, Op
from jaxgpu._kernel_op import Layout, grouped_call
from jaxgpu.reference import decode as reference

# Pass 'fwd_q8': the forward over an 8-bit cache, a target of its own (other arguments).
PAGED_ATTENTION = Op("paged_attention", {"fwd": "jaxgpu_paged_attention_fwd",
                                         "fwd_q8": "jaxgpu_paged_attention_q8_fwd"},
                     differentiable=False)
PAGED_KV_UPDATE = Op("paged_kv_update", {"fwd": "jaxgpu_paged_kv_update_fwd",
                                         "fwd_q8": "jaxgpu_paged_kv_update_q8_fwd"},
                     differentiable=False)
PAGED_ATTENTION_WITH_UPDATE = Op("paged_attention_with_update",
                                 {"fwd": "jaxgpu_paged_attention_with_update_fwd"},
                                 differentiable=False)
FAMILY = Family("decode", (PAGED_ATTENTION, PAGED_KV_UPDATE, PAGED_ATTENTION_WITH_UPDATE))

MAX_Q_LEN = 16      # new tokens per row and call (decode, speculative decoding, small chunks)
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8   # a 16-byte vector of 16-bit values: the kernels' unit of a row
PAGE_SIZE_MULTIPLE = 8

# Split-KV: the workspace has room for enough thread blocks to fill 4 x 132 block slots of
# an H100 (2 to 4 blocks an SM, by the kernel's shared memory) when batch x kv heads alone
# does not; the tensor-core kernel then picks the count that fills whole waves of the GPU
# it runs on (decode_tc_kernels.cu, ChooseSplits), the float32 kernel takes this one. Each
# split reads at least _MIN_SPLIT_PAGES pages, so that the combine's extra traffic stays
# small against the cache bytes each split reads.
_TARGET_BLOCKS = 4 * 132
_MIN_SPLIT_PAGES = 4
_MAX_SPLITS = 64

# Layouts (docs/design.md section 3). The query's heads and the pages' kv heads are one
# blocked factor 'k': N = K * (N // K) query heads split block-wise with the K kv heads, so
# a kv-head sharding keeps every query head with its kv head and needs no collective. The
# page pool, the page slots, the table's width and H are needed whole on every shard.
_Q = "g b t k h"          # query, output: (G, B, Tq, N, H)
_POOL = "[g] p s k h"     # k_pages, v_pages: shared by every group unless vmapped
_TABLE = "g b m"          # block_table (G, B, M)
_LENGTHS = "g b"          # lengths (G, B)
_POOL_SCALES = "[g] p s k"  # an 8-bit cache's k_scale, v_scale: the pages' layout without h
_ATTENTION_LAYOUT = Layout(inputs=(_Q, _POOL, _POOL, _TABLE, _LENGTHS), outputs=(_Q,),
                           replicated=frozenset({"p", "s", "m", "h"}),
                           blocked=frozenset({"k"}))
_ATTENTION_Q8_LAYOUT = Layout(
    inputs=(_Q, _POOL, _POOL, _POOL_SCALES, _POOL_SCALES, _TABLE, _LENGTHS), outputs=(_Q,),
    replicated=frozenset({"p", "s", "m", "h"}), blocked=frozenset({"k"}))

_CACHE = "g p s k h"      # k_pages, v_pages, aliased to the outputs
_NEW = "g b t k h"        # k_new, v_new (G, B, Tn, K, H)
_POSITIONS = "g b t"
# The new tokens, the table and their positions are needed whole: any row may write into
# any page of the (replicated) pool. Only kv heads (and groups) shard.
_UPDATE_LAYOUT = Layout(inputs=(_CACHE, _CACHE, _NEW, _NEW, _TABLE, _POSITIONS),
                        outputs=(_CACHE, _CACHE),
                        replicated=frozenset({"p", "s", "m", "b", "t", "h"}),
                        aliases={0: 0, 1: 1})
_CACHE_SCALES = "g p s k"  # k_scale, v_scale, aliased to the outputs
_UPDATE_Q8_LAYOUT = Layout(
    inputs=(_CACHE, _CACHE, _CACHE_SCALES, _CACHE_SCALES, _NEW, _NEW, _TABLE, _POSITIONS),
    outputs=(_CACHE, _CACHE, _CACHE_SCALES, _CACHE_SCALES),
    replicated=frozenset({"p", "s", "m", "b", "t", "h"}), aliases={0: 0, 1: 1, 2: 2, 3: 3})

# The update and the attention in one call: the caches written as by the update (any row may
# write any page of the pool, so rows and tokens are needed whole), the query as by the
# attention; kv heads (with their query heads) shard with no collective.
_WITH_UPDATE_LAYOUT = Layout(inputs=(_Q, _CACHE, _CACHE, _NEW, _NEW, _TABLE, _LENGTHS),
                             outputs=(_Q, _CACHE, _CACHE),
                             replicated=frozenset({"p", "s", "m", "b", "t", "h"}),
                             blocked=frozenset({"k"}), aliases={1: 1, 2: 2})


def num_splits(rows: int, max_pages: int) -> int:
  """KV splits per (group, row, kv head): static, from the local shapes, so that the
  workspace has a static size. The kernel divides each row's actual length among them."""
  if rows <= 0 or max_pages <= 0:
    return 1
  want = math.ceil(_TARGET_BLOCKS / rows)
  most = max(1, max_pages // _MIN_SPLIT_PAGES)
  return int(max(1, min(want, most, _MAX_SPLITS)))


def workspace_size(groups: int, batch: int, kv_heads: int, q_len: int, heads: int,
                   head_dim: int, max_pages: int) -> tuple[int, int]:
  """(splits, float32 workspace elements): per (group, row, kv head, split), the partial
  outputs (Tq * N/K, H) and their log-sum-exps (Tq * N/K,). None with one split."""
  splits = num_splits(groups * batch * kv_heads, max_pages)
  if splits == 1 or kv_heads == 0:
    return splits, 0
  rows_per_kv = q_len * (heads // kv_heads)
  return splits, groups * batch * kv_heads * splits * rows_per_kv * (head_dim + 1)


@dataclasses.dataclass(frozen=True)
class _AttentionConfig:
  implementation: str | None
  scale: float
  softcap: float | None
  window: int | None

  def attrs(self, splits: int) -> dict:
    return dict(scale=np.float32(self.scale),
                softcap=np.float32(0.0 if self.softcap is None else self.softcap),
                window_left=np.int32(-1 if self.window is None else self.window),
                num_splits=np.int32(splits))


def _attention_call(cfg: _AttentionConfig, query, k_pages, v_pages, k_scale, v_scale,
                    block_table, lengths):
  """Grouped arrays in (see the layouts; the scales None for a 16-bit cache); the grouped
  output out."""

  def local_fn(q, kp, vp, *rest):
    g, b, tq, n, h = q.shape
    kv = kp.shape[3]
    table = rest[-2]
    splits, work = workspace_size(g, b, kv, tq, n, h, table.shape[2])
    outs = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((work,), jnp.float32))
    target = PAGED_ATTENTION.target("fwd" if len(rest) == 2 else "fwd_q8", cfg.implementation)
    out, _ = jax.ffi.ffi_call(target, outs)(q, kp, vp, *rest, **cfg.attrs(splits))
    return (out,)

  if k_scale is None:
    (out,) = grouped_call(local_fn, _ATTENTION_LAYOUT, query, k_pages, v_pages, block_table,
                          lengths)
  else:
    (out,) = grouped_call(local_fn, _ATTENTION_Q8_LAYOUT, query, k_pages, v_pages, k_scale,
                          v_scale, block_table, lengths)
  return out


def _for_in_place_call(caches):
  """Grouped caches as an in-place custom call takes them. One group: without it ((P, S, K,
  H) pages, (P, S, K) scales), so that this reshape cancels the caller's [None] and the
  custom call gets the donated buffers themselves. Between a bitcast and an in-place custom
  call XLA copies the buffer (on the way in and out): two copies of the cache per call."""
  if caches[0].shape[0] != 1:
    return tuple(caches)
  return tuple(c.reshape(c.shape[1:]) for c in caches)


def _update_call(implementation, k_pages, v_pages, k_scale, v_scale, k_new, v_new, block_table,
                 positions):
  """Grouped arrays in (the scales None for a 16-bit cache); the grouped caches out."""

  def local_fn(*args):
    caches, rest = args[:len(args) - 4], args[len(args) - 4:]  # the pages, then any scales
    shapes = [c.shape for c in caches]
    caches = _for_in_place_call(caches)
    outs = tuple(jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches)
    target = PAGED_KV_UPDATE.target("fwd" if len(caches) == 2 else "fwd_q8", implementation)
    results = jax.ffi.ffi_call(target, outs,
                               input_output_aliases={i: i for i in range(len(caches))})(
                                   *caches, *rest)
    return tuple(r.reshape(shape) for r, shape in zip(results, shapes))

  if k_scale is None:
    return grouped_call(local_fn, _UPDATE_LAYOUT, k_pages, v_pages, k_new, v_new, block_table,
                        positions)
  return grouped_call(local_fn, _UPDATE_Q8_LAYOUT, k_pages, v_pages, k_scale, v_scale, k_new,
                      v_new, block_table, positions)


def _with_update_call(cfg: _AttentionConfig, query, k_pages, v_pages, k_new, v_new,
                      block_table, lengths):
  """Grouped arrays in (a 16-bit or float32 cache); the grouped (out, k_pages, v_pages)."""

  def local_fn(q, kp, vp, kn, vn, table, lens):
    g, b, tq, n, h = q.shape
    splits, work = workspace_size(g, b, kp.shape[3], tq, n, h, table.shape[2])
    shape = kp.shape
    kp, vp = _for_in_place_call((kp, vp))
    outs = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((work,), jnp.float32),
            jax.ShapeDtypeStruct(kp.shape, kp.dtype), jax.ShapeDtypeStruct(vp.shape, vp.dtype))
    target = PAGED_ATTENTION_WITH_UPDATE.target("fwd", cfg.implementation)
    out, _, kp, vp = jax.ffi.ffi_call(target, outs, input_output_aliases={1: 2, 2: 3})(
        q, kp, vp, kn, vn, table, lens, **cfg.attrs(splits))
    return out, kp.reshape(shape), vp.reshape(shape)

  return grouped_call(local_fn, _WITH_UPDATE_LAYOUT, query, k_pages, v_pages, k_new, v_new,
                      block_table, lengths)


def _grouped(x):
  """x with a group axis of 1 (None stays None)."""
  return None if x is None else x[None]


# ---- forward only ------------------------------------------------------------------------


def _refuse_grad(name: str):
  def fwd(*args):
    raise ValueError(f"{name} cannot be differentiated: it is a forward-only inference op "
                     "(jaxgpu._family declares it differentiable=False)")

  def bwd(*args):  # never reached: fwd raises first
    raise ValueError(f"{name} cannot be differentiated")

  return fwd, bwd


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _paged_attention(cfg: _AttentionConfig, query, k_pages, v_pages, k_scale, v_scale,
                     block_table, lengths):
  if cfg.implementation == "xla":
    return reference.paged_attention(query, k_pages, v_pages, block_table, lengths,
                                     scale=cfg.scale, logit_softcap=cfg.softcap,
                                     local_window_size=cfg.window, k_scale=k_scale,
                                     v_scale=v_scale)
  return _attention_call(cfg, *map(_grouped, (query, k_pages, v_pages, k_scale, v_scale,
                                              block_table, lengths)))[0]


_paged_attention.defvjp(*_refuse_grad("paged_attention"))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _paged_kv_update(implementation, k_pages, v_pages, k_scale, v_scale, k_new, v_new,
                     block_table, positions):
  if implementation == "xla":
    return reference.paged_kv_update(k_pages, v_pages, k_new, v_new, block_table, positions,
                                     k_scale=k_scale, v_scale=v_scale)
  out = _update_call(implementation, *map(_grouped, (k_pages, v_pages, k_scale, v_scale, k_new,
                                                     v_new, block_table, positions)))
  return tuple(x[0] for x in out)


_paged_kv_update.defvjp(*_refuse_grad("paged_kv_update"))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _paged_attention_with_update(cfg: _AttentionConfig, query, k_pages, v_pages, k_scale,
                                 v_scale, k_new, v_new, block_table, lengths):
  if cfg.implementation == "xla":
    return reference.paged_attention_with_update(
        query, k_pages, v_pages, k_new, v_new, block_table, lengths, scale=cfg.scale,
        logit_softcap=cfg.softcap, local_window_size=cfg.window, k_scale=k_scale,
        v_scale=v_scale)
  if k_scale is not None:
    # An 8-bit cache: the update quantizes each new row (a max over H first), which the
    # attention's copies cannot do on the fly; the two kernels, one after the other.
    positions = reference.query_positions(lengths, query.shape[1])
    caches = _paged_kv_update(cfg.implementation, k_pages, v_pages, k_scale, v_scale, k_new,
                              v_new, block_table, positions)
    out = _paged_attention(cfg, query, *caches, block_table, lengths)
    return (out,) + tuple(caches)
  out = _with_update_call(cfg, *map(_grouped, (query, k_pages, v_pages, k_new, v_new,
                                               block_table, lengths)))
  return tuple(x[0] for x in out)


_paged_attention_with_update.defvjp(*_refuse_grad("paged_attention_with_update"))


# ---- argument checks -----------------------------------------------------------------------


def _int32_array(op: str, name: str, value, shape: tuple, what: str):
  x = _checks.as_array(op, name, value)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{op}: {name} must have an integer dtype (int32), got {x.dtype}")
  _checks.shape_is(op, name, x, shape, what)
  if x.dtype != jnp.int32:
    x = jnp.asarray(x)
    info = jnp.iinfo(x.dtype)
    if info.max > 2**31 - 1 or info.min < -2**31:
      # Clipped, not wrapped: a traced int64 entry of 2^32 + 1 must stay out of range.
      x = jnp.clip(x, -2**31, 2**31 - 1)
    x = x.astype(jnp.int32)
  return x


def _check_pages(op: str, k_pages, v_pages, k_scale, v_scale, head_dim: int | None, dtype):
  """The pages, and an 8-bit cache's scales (None for a 16-bit or float32 cache). `dtype`:
  what a 16-bit or float32 cache's pages must be (None: any)."""
  k_pages = _checks.float_array(op, "k_pages", k_pages,
                                _checks.FLOAT_DTYPES + reference.Q8_DTYPES)
  if k_pages.ndim != 4:
    raise ValueError(f"{op}: k_pages must have rank 4 (P, page_size, K, H), got shape "
                     f"{tuple(k_pages.shape)}")
  v_pages = _checks.as_array(op, "v_pages", v_pages)
  _checks.shape_is(op, "v_pages", v_pages, k_pages.shape, "the shape of k_pages")
  _checks.same_dtype(op, "v_pages", v_pages, "k_pages", k_pages)
  q8 = k_pages.dtype in reference.Q8_DTYPES
  if not q8 and dtype is not None and k_pages.dtype != dtype:
    raise TypeError(f"{op}: k_pages must have the dtype of the query ({dtype}) or be an 8-bit "
                    f"cache (int8 or float8_e4m3fn), got {k_pages.dtype}")
  _, page_size, kv, h = k_pages.shape
  if page_size < PAGE_SIZE_MULTIPLE or page_size % PAGE_SIZE_MULTIPLE:
    raise ValueError(f"{op}: k_pages' page size (dim 1) must be a positive multiple of "
                     f"{PAGE_SIZE_MULTIPLE}, got {page_size}")
  if kv < 1:
    raise ValueError(f"{op}: k_pages must have at least one kv head (dim 2), got {kv}")
  if head_dim is not None and h != head_dim:
    raise ValueError(f"{op}: k_pages' head dim (dim 3) must be the query's ({head_dim}), "
                     f"got {h}")
  if not (1 <= h <= MAX_HEAD_DIM and h % HEAD_DIM_MULTIPLE == 0):
    raise ValueError(f"{op}: the head dim must be a multiple of {HEAD_DIM_MULTIPLE} in "
                     f"[8, {MAX_HEAD_DIM}], got {h}")
  scales = {"k_scale": k_scale, "v_scale": v_scale}
  if not q8:
    for name, sc in scales.items():
      if sc is not None:
        raise TypeError(f"{op}: {name} is only for an 8-bit cache (int8 or float8_e4m3fn "
                        f"pages); these pages are {k_pages.dtype}")
    return k_pages, v_pages, None, None
  for name, sc in scales.items():
    if sc is None:
      raise TypeError(f"{op}: {name} is required with an 8-bit cache ({k_pages.dtype} "
                      "pages): float32 (P, page_size, K), one scale per token and kv head")
    sc = _checks.as_array(op, name, sc)
    if sc.dtype != jnp.float32:
      raise TypeError(f"{op}: {name} must have dtype float32, got {sc.dtype}")
    _checks.shape_is(op, name, sc, k_pages.shape[:3], "(P, page_size, K), the pages' shape "
                     "without H")
    scales[name] = sc
  return k_pages, v_pages, scales["k_scale"], scales["v_scale"]


def _concrete(x):
  """x as numpy when it is concrete (numpy, or a jax array outside a trace), else None."""
  if isinstance(x, jax.core.Tracer):
    return None
  return np.asarray(x)


def _check_table(op: str, block_table, used_pages, num_pages: int) -> None:
  """Concrete tables: the entries a row uses (`used_pages`, (B,) numpy) are in [0, P).
  Entries past a row's used pages are never read and may hold anything (-1 padding)."""
  table = _concrete(block_table)
  if table is None or used_pages is None or table.size == 0:
    return
  cols = np.arange(table.shape[1])[None, :]
  bad = (cols < used_pages[:, None]) & ((table < 0) | (table >= num_pages))
  if bad.any():
    b, j = np.unravel_index(int(np.argmax(bad)), bad.shape)
    raise ValueError(f"{op}: block_table entries of the pages in use must be in [0, "
                     f"{num_pages}) (the number of pages); got {int(table[b, j])} at "
                     f"[{b}, {j}] ({int(bad.sum())} out of range)")


def _check_window(op: str, local_window_size):
  if local_window_size is None:
    return None
  w = local_window_size
  if isinstance(w, tuple):
    if len(w) != 2:
      raise ValueError(f"{op}: local_window_size must be an int or a (left, 0) pair, got {w!r}")
    right = _checks.static_int(op, "local_window_size", w[1])
    if right != 0:
      raise ValueError(f"{op}: local_window_size's right extent must be 0 (decoding is "
                       f"causal), got {w!r}")
    w = w[0]
  left = _checks.static_int(op, "local_window_size", w)
  if left < 0:
    raise ValueError(f"{op}: local_window_size must be >= 0, got {local_window_size!r}")
  return left


def _check_block_table(op, block_table, b: int):
  """block_table as a (b, max_pages) int32 array; ValueError naming it otherwise."""
  block_table = _checks.as_array(op, "block_table", block_table)
  if block_table.ndim != 2:
    raise ValueError(f"{op}: block_table must have rank 2 (B, max_pages), got shape "
                     f"{tuple(block_table.shape)}")
  return _int32_array(op, "block_table", block_table, (b, block_table.shape[1]),
                      "(B, max_pages)")


def _check_attention(op, query, k_pages, v_pages, k_scale, v_scale, block_table, lengths, scale,
                     logit_softcap, local_window_size):
  query = _checks.float_array(op, "query", query)
  if query.ndim != 4:
    raise ValueError(f"{op}: query must have rank 4 (B, Tq, N, H), got shape "
                     f"{tuple(query.shape)}")
  b, tq, n, h = query.shape
  if not 1 <= tq <= MAX_Q_LEN:
    raise ValueError(f"{op}: query's Tq (dim 1, the new tokens) must be in [1, {MAX_Q_LEN}], "
                     f"got {tq}")
  k_pages, v_pages, k_scale, v_scale = _check_pages(op, k_pages, v_pages, k_scale, v_scale, h,
                                                    query.dtype)
  num_pages, page_size, kv, _ = k_pages.shape
  if n % kv:
    raise ValueError(f"{op}: query's heads ({n}) must be a multiple of the kv heads ({kv})")
  block_table = _check_block_table(op, block_table, b)
  max_pages = block_table.shape[1]
  lengths = _int32_array(op, "lengths", lengths, (b,), "(B,), the query's batch")
  capacity = max_pages * page_size
  lens = _concrete(lengths)
  used = None
  if lens is not None:
    bad = (lens < 0) | (lens > capacity)
    if bad.any():
      i = int(np.argmax(bad))
      raise ValueError(f"{op}: lengths must be in [0, {capacity}] (max_pages * page_size); "
                       f"got {int(lens[i])} at [{i}]")
    used = -(-lens.astype(np.int64) // page_size)
  _check_table(op, block_table, used, num_pages)
  scale = 1.0 / math.sqrt(h) if scale is None else _checks.positive_finite(op, "scale", scale)
  softcap = None
  if logit_softcap is not None:
    softcap = _checks.positive_finite(op, "logit_softcap", logit_softcap)
  window = _check_window(op, local_window_size)
  return query, k_pages, v_pages, k_scale, v_scale, block_table, lengths, scale, softcap, window


def _check_new_tokens(op, k_new, v_new, query, k_pages):
  """k_new, v_new: the query tokens' keys and values (B, Tq, K, H) in the query's dtype."""
  b, tq = query.shape[:2]
  kv, h = k_pages.shape[2:]
  checked = []
  for name, x in (("k_new", k_new), ("v_new", v_new)):
    x = _checks.float_array(op, name, x)
    _checks.shape_is(op, name, x, (b, tq, kv, h), "(B, Tq) of the query and the pages' (K, H)")
    _checks.same_dtype(op, name, x, "query", query)
    checked.append(x)
  return tuple(checked)


def _check_update(op, k_pages, v_pages, k_new, v_new, block_table, positions, k_scale, v_scale):
  k_pages, v_pages, k_scale, v_scale = _check_pages(op, k_pages, v_pages, k_scale, v_scale,
                                                    None, None)
  num_pages, page_size, kv, h = k_pages.shape
  k_new = _checks.float_array(op, "k_new", k_new)
  if k_new.ndim != 4:
    raise ValueError(f"{op}: k_new must have rank 4 (B, Tn, K, H), got shape "
                     f"{tuple(k_new.shape)}")
  b, tn = k_new.shape[:2]
  _checks.shape_is(op, "k_new", k_new, (b, tn, kv, h), "(B, Tn) and the pages' (K, H)")
  if k_scale is None:
    _checks.same_dtype(op, "k_new", k_new, "k_pages", k_pages)
  v_new = _checks.float_array(op, "v_new", v_new)
  _checks.shape_is(op, "v_new", v_new, k_new.shape, "the shape of k_new")
  _checks.same_dtype(op, "v_new", v_new, "k_new", k_new)
  block_table = _check_block_table(op, block_table, b)
  max_pages = block_table.shape[1]
  positions = _int32_array(op, "positions", positions, (b, tn), "(B, Tn), as k_new")
  pos, table = _concrete(positions), _concrete(block_table)
  if pos is not None and pos.size:
    capacity = max_pages * page_size
    bad = pos >= capacity
    if bad.any():
      i = np.unravel_index(int(np.argmax(bad)), bad.shape)
      raise ValueError(f"{op}: positions must be < {capacity} (max_pages * page_size), or "
                       f"negative to skip a token; got {int(pos[i])} at {tuple(map(int, i))}")
    if table is not None:
      page = np.take_along_axis(table, np.clip(pos, 0, capacity - 1) // page_size, axis=1)
      bad = (pos >= 0) & ((page < 0) | (page >= num_pages))
      if bad.any():
        i = np.unravel_index(int(np.argmax(bad)), bad.shape)
        raise ValueError(f"{op}: block_table entries of the pages written must be in [0, "
                         f"{num_pages}); position {int(pos[i])} at {tuple(map(int, i))} "
                         f"maps to page {int(page[i])}")
  return k_pages, v_pages, k_scale, v_scale, k_new, v_new, block_table, positions


# ---- public API ---------------------------------------------------------------------------


def paged_attention(query, k_pages, v_pages, block_table, lengths, *, scale=None,
                    logit_softcap=None, local_window_size=None, k_scale=None, v_scale=None,
                    implementation=None):
  """Attention of a few new tokens per row over a paged KV cache (decoding).

  Args:
    query: (B, Tq, N, H) bfloat16, float16 or float32: the new tokens' queries, 1 <= Tq
      <= 16 (one token, speculative decoding, small prefill chunks). H a multiple of 8, at
      most 256.
    k_pages, v_pages: (P, page_size, K, H) in the query's dtype, or an 8-bit cache (int8
      or float8_e4m3fn, both alike) with k_scale and v_scale: the page pool, page_size a
      multiple of 8, N a multiple of K (MHA, GQA, MQA: query head n reads kv head
      n // (N // K)).
    block_table: (B, max_pages) int32: page j of row b is block_table[b, j], holding
      positions j * page_size .. (j + 1) * page_size - 1. Entries past a row's length are
      never read (pad with anything, e.g. -1).
    lengths: (B,) int32: tokens in each row's cache, the Tq new ones included (their K/V
      already written, e.g. by paged_kv_update). The new tokens sit at positions
      lengths - Tq .. lengths - 1: causal among themselves, and they see the whole cache
      before them.
    scale: the logits' scale, default 1 / sqrt(H).
    logit_softcap: None, or c > 0: logits c * tanh(logits / c) (Gemma 2).
    local_window_size: None, or w >= 0 (or the pair (w, 0)): a query at position p sees
      keys p - w .. p (jax.nn.dot_product_attention's (w, 0)).
    k_scale, v_scale: (P, page_size, K) float32, required with an 8-bit cache and refused
      otherwise: the key at slot s of page p, kv head k, is float(k_pages[p, s, k]) *
      k_scale[p, s, k] (likewise V). paged_kv_update and jaxgpu.quantize_kv write them.
    implementation: None (the FFI kernel of the platform), 'cuda', 'cpu', or 'xla'.

  Returns:
    (B, Tq, N, H) in the query's dtype (also with an 8-bit cache). A query that sees no
    key (a row of length 0, or length < Tq for the first new tokens) gets zeros.

  Bad input: concrete lengths outside [0, max_pages * page_size] and concrete table
  entries of pages in use outside [0, P) raise ValueError. Traced ones cannot be checked,
  and the kernels never read out of bounds instead: a key in a page whose entry is
  outside [0, P) is masked out, and every query of a row whose length is outside
  [0, max_pages * page_size] gets zeros.

  Equivalent pure JAX: jaxgpu.reference.decode.paged_attention (gathers each row's pages,
  then a masked float32 softmax). The kernels read each K/V byte once per kv head, with
  all query heads of the kv group and all Tq tokens in one thread block, and split each
  row's cache over several blocks when batch x kv heads alone cannot fill the GPU.
  Works under jit and vmap (a batched page pool gives each vmapped example its own);
  batch and kv heads shard with no collective (the page pool, the table's width and H are
  gathered if sharded). Not differentiable: jax.grad raises ValueError.
  """
  op = "paged_attention"
  (query, k_pages, v_pages, k_scale, v_scale, block_table, lengths, scale, softcap,
   window) = _check_attention(op, query, k_pages, v_pages, k_scale, v_scale, block_table,
                              lengths, scale, logit_softcap, local_window_size)
  impl = _implementation.resolve(implementation)
  if (impl != "xla" and (query.size == 0 or k_pages.shape[0] == 0
                         or block_table.shape[1] == 0)):
    # No key can be seen: zeros, with the same refusal of jax.grad as any other call.
    impl = "xla"
  cfg = _AttentionConfig(impl, scale, softcap, window)
  return _paged_attention(cfg, query, k_pages, v_pages, k_scale, v_scale, block_table, lengths)


def paged_kv_update(k_pages, v_pages, k_new, v_new, block_table, positions, *, k_scale=None,
                    v_scale=None, implementation=None):
  """Writes new tokens' keys and values into their slots of the page pool, in place.

  Args:
    k_pages, v_pages: (P, page_size, K, H) bfloat16, float16 or float32: the page pool; or
      an 8-bit cache (int8 or float8_e4m3fn, both alike) with k_scale and v_scale.
    k_new, v_new: (B, Tn, K, H) in the pages' dtype (an 8-bit cache: bfloat16, float16 or
      float32, both alike): the new tokens' keys and values.
    block_table: (B, max_pages) int32, as for paged_attention.
    positions: (B, Tn) int32: each new token's absolute position in its row; a negative
      position skips the token (padding).
    k_scale, v_scale: (P, page_size, K) float32, required with an 8-bit cache and refused
      otherwise: its scales, one per token and kv head.
    implementation: None (the FFI kernel of the platform), 'cuda', 'cpu', or 'xla'.

  Returns:
    (k_pages, v_pages), or (k_pages, v_pages, k_scale, v_scale) for an 8-bit cache, with
    token t of row b written at slot positions[b, t] % page_size of page
    block_table[b, positions[b, t] // page_size]; every other slot unchanged. An 8-bit
    cache gets each new (token, kv head) row quantized by jaxgpu.quantize_kv's rule (the
    CPU and CUDA kernels give its values and scales bit for bit).

  In place: the caches (and scales) are aliased to the outputs; under jax.jit with them
  donated (donate_argnums) the kernel writes into the donated buffers and no copy of the
  cache is made. Two tokens written to one slot (a page shared by two rows, repeated
  positions) leave either one's values there. Concrete positions >= max_pages * page_size,
  or mapping to a table entry outside [0, P), raise ValueError; traced ones are skipped
  (never written out of bounds). Works under jit and vmap (an unbatched pool under vmap is
  copied once per example, each getting its own writes); kv heads shard with no
  collective. Not differentiable: jax.grad raises ValueError.
  """
  op = "paged_kv_update"
  k_pages, v_pages, k_scale, v_scale, k_new, v_new, block_table, positions = _check_update(
      op, k_pages, v_pages, k_new, v_new, block_table, positions, k_scale, v_scale)
  impl = _implementation.resolve(implementation)
  if impl != "xla" and (k_new.size == 0 or k_pages.size == 0 or block_table.shape[1] == 0):
    impl = "xla"  # nothing to write
  return _paged_kv_update(impl, k_pages, v_pages, k_scale, v_scale, k_new, v_new, block_table,
                          positions)


def paged_attention_with_update(query, k_pages, v_pages, k_new, v_new, block_table, lengths, *,
                                scale=None, logit_softcap=None, local_window_size=None,
                                k_scale=None, v_scale=None, implementation=None):
  """paged_kv_update of the new tokens' keys and values, then paged_attention of their
  queries over the updated cache, in one call (a decode step's attention).

  Args:
    query, k_pages, v_pages, block_table, lengths, scale, logit_softcap, local_window_size,
      k_scale, v_scale, implementation: as for paged_attention. lengths counts the new
      tokens, which sit at positions lengths - Tq .. lengths - 1.
    k_new, v_new: (B, Tq, K, H) in the query's dtype: the new tokens' keys and values,
      written at those positions (paged_kv_update's rules: a position outside
      [0, max_pages * page_size) or on a table entry outside [0, P) is skipped).

  Returns:
    (out, k_pages, v_pages), or (out, k_pages, v_pages, k_scale, v_scale) for an 8-bit
    cache: paged_attention's output and paged_kv_update's caches, equal to the two calls
    one after the other, except that a slot written by one row and read as an older key by
    another in the same call (two rows sharing the page being written) may read either
    value.

  Why one call: on a GPU with a 16-bit cache, the attention kernel writes the new tokens
  itself and reads them from k_new / v_new rather than from their slots, so a decode step
  launches one kernel a layer instead of two (the cache write took ~2.5 us of its own).
  A float32 query runs the update kernel, then the attention, in the same call; an 8-bit
  cache runs the two ops (the quantization needs a whole row's maximum first). The caches
  are aliased to the outputs as in paged_kv_update: donated under jit, no copy is made.
  Works under jit and vmap; kv heads shard with no collective (rows and the pool are
  needed whole, as for the update). Not differentiable: jax.grad raises ValueError.

  Equivalent pure JAX: jaxgpu.reference.decode.paged_attention_with_update.
  """
  op = "paged_attention_with_update"
  (query, k_pages, v_pages, k_scale, v_scale, block_table, lengths, scale, softcap,
   window) = _check_attention(op, query, k_pages, v_pages, k_scale, v_scale, block_table,
                              lengths, scale, logit_softcap, local_window_size)
  k_new, v_new = _check_new_tokens(op, k_new, v_new, query, k_pages)
  impl = _implementation.resolve(implementation)
  if (impl != "xla" and (query.size == 0 or k_pages.size == 0
                         or block_table.shape[1] == 0)):
    impl = "xla"  # nothing to write or read
  cfg = _AttentionConfig(impl, scale, softcap, window)
  return _paged_attention_with_update(cfg, query, k_pages, v_pages, k_scale, v_scale, k_new,
                                      v_new, block_table, lengths)
