"""Batched generation: a prefill pass that writes a KV cache, then a jitted decode loop.

Two layouts of the KV cache (`cache=` of generate, prefill and empty_cache):

"paged" (the default with jaxgpu's kernels): a PagedCache. Each layer has a page pool
{"k", "v"} of shape (P, page_size, K, H) in the parameters' dtype, and each row names its
pages in a block table (B, M) int32, M = ceil(cache_len / page_size): position p of row b
is slot p % page_size of page table[b, p // page_size]. Decode steps write the new token's
K/V and attend over lengths = position + 1 in one jaxgpu.paged_attention_with_update call
(in place: the cache is donated), which reads only the pages a row uses (no gathered copy,
no mask over the whole cache). The pools are laid out by layer kind:
  * global layers share one table, `block_table`: row b owns pages b*M .. b*M + M - 1 of
    every global layer's pool (P = B*M; one table serves all of them, as each layer's
    pool is its own array);
  * sliding-window (local) layers keep a ring of R = min(M, (sliding_window - 1) //
    page_size + 2) pages per row (P = B*R), through their own table `window_table`, whose
    row b repeats the row's R pages: entry j is page b*R + j % R. R pages hold every key
    a query may see (its window spans at most (sliding_window - 1) // page_size + 2
    pages), and the write of position p reuses the slot of position p - R*page_size, which
    no query at p or later sees. paged_attention's window starts its reads at the
    window's first key, so the older pages the table still names are never read. A local
    layer thus holds about its window (at most sliding_window + 2 * page_size - 1 slots
    per row) instead of cache_len: at a 32k context, 1/8 of the slots for gemma2_2b.
The tables are built once (empty_cache) and never change during decoding; other
allocations (shared prefix pages, a free list) need only another table.

"contiguous" (the 'xla' path's, and with kernels on request): a list with one {"k", "v"}
dict per layer, each (B, S, K, H) in the parameters' dtype (the layout
jaxgpu.dot_product_attention reads, so no copy or transpose):
  * global layers: S = cache_len (longest prompt + max_new_tokens); the key of position p
    is in slot p;
  * sliding-window (local) layers: S = min(sliding_window, cache_len), a ring buffer: the key
    of position p is in slot p % S. Keys are stored after RoPE (at their absolute
    positions), so the order of the slots does not matter to attention, and a slot is
    overwritten exactly when its position leaves the window (i - sliding_window < j <= i).
In both, after the token at position p has been written, slot s holds a key of this row
that the query at p may see exactly when s <= p (slots past p are the right padding of a
shorter prompt or not yet written). Decoding therefore masks with kv_segment_ids = (s <= p)
against a query segment id of 1, which jaxgpu.dot_product_attention and the 'xla' path
both take: padding and empty slots cost no special case. Each step attends over all S
slots of every layer, masked: its cost grows with cache_len, not with a row's length.

Prefill runs the prompts right-padded to the longest, causal and without segment ids
(jaxgpu.dot_product_attention, or 'xla' attention): a real token only sees earlier
positions of its row, which are real tokens too; the pads' outputs are never read. The
paged cache is then written with one jaxgpu.paged_kv_update per layer (Tn = the padded
prompt length) into fresh pools: the op owns the position -> slot mapping, so prefill and
decode cannot disagree on it, and it skips negative positions, which mark the pads and,
on local layers, the positions no later query sees (before length - sliding_window + 1;
writing them would make two positions of one ring slot race in one call). The contiguous
cache takes the prompt's K/V as they are (padded, or the window's last positions gathered
into the ring); its pads' slots are masked until the row's own decode steps overwrite
them. Each row then decodes at its own position (its prompt length + step), and every
step runs inside one jax.lax.while_loop with sampling, so there is no host round trip per
token and no recompilation per step. The cache is donated and written in place (one
token's K x H per layer and row: no cache copy).

Tensor parallelism (`mesh=` of generate, prefill, decode and decode_step, a Mesh with a
"model" axis): the parameters placed with shard_params (heads, kv heads and the MLP's hidden
axis split over "model", sharding.py) and the cache with shard_cache: its kv-head axis split
as the k and v projections' are, so that each device writes and reads only its kv heads'
pages and attention needs no collective. The step's collectives are the two all-reduces per
layer of the Megatron layout (after o and after down) on (B, 1, D) activations. A model whose
kv heads the model axis does not divide (gemma3_1b's one kv head) keeps the cache
replicated.

An 8-bit cache would add per-token scales beside each pool ({"k", "v", "k_scale",
"v_scale"}) and pass them to both ops; `_paged_attend` and `_paged_prefill` are the only
places that read or write the pools.

Pieces for timing: `prefill` (jitted: logits of each row's last prompt token and the
cache), `empty_cache` (a zero cache of a given length, to time decoding at a context length
without a prefill), `decode_step` (jitted, one token per row, cache donated) and `decode`
(jitted: the whole loop with sampling and per-row stopping, cache donated).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import jaxgpu
from jaxgpu import _implementation
from jaxgpu.models.gemma import layers, sharding
from jaxgpu.models.gemma.config import Config
from jaxgpu.models.gemma.model import (check_tokens, default_positions, output_logits,
                                       self_attend, trunk)
from jaxgpu.models.gemma.params import check_params
from jaxgpu.ops import decode as decode_ops


class GenerateOutput(NamedTuple):
  """tokens: (B, max_new_tokens) int32, the new tokens only, pad_token_id after a row
  stopped; lengths: (B,) int32, each row's count of new tokens (its end token included)."""

  tokens: jax.Array
  lengths: jax.Array


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How the next token is drawn from the logits (hashable: a static argument).

  temperature: 0 for greedy (argmax), else the logits are divided by it. top_k: keep the k
  largest logits (None: all). top_p: keep the smallest set of most likely tokens whose
  probability reaches top_p (nucleus; None: all). Applied in HF's order: temperature,
  top_k, top_p; then a categorical draw.
  """

  temperature: float = 0.0
  top_k: int | None = None
  top_p: float | None = None

  def __post_init__(self):
    t = self.temperature
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
      raise ValueError(f"temperature: expected a finite number >= 0, got {t!r}")
    k = self.top_k
    if k is not None and (isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1):
      raise ValueError(f"top_k: expected None or an int >= 1, got {k!r}")
    p = self.top_p
    if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float))
                          or not 0 < p <= 1):
      raise ValueError(f"top_p: expected None or a number in (0, 1], got {p!r}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


def sample(logits, key, sampling: Sampling):
  """(B, V) float32 logits -> (B,) int32 tokens (see Sampling)."""
  if sampling.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  z = logits.astype(jnp.float32) / jnp.float32(sampling.temperature)
  vocab = z.shape[-1]
  if sampling.top_k is not None and sampling.top_k < vocab:
    kth = jax.lax.top_k(z, sampling.top_k)[0][..., -1:]
    z = jnp.where(z < kth, -jnp.inf, z)
  if sampling.top_p is not None and sampling.top_p < 1:
    s = -jnp.sort(-z, axis=-1)                              # descending
    p = jax.nn.softmax(s, axis=-1)
    before = jnp.cumsum(p, axis=-1) - p                     # mass of the more likely tokens
    kept = jnp.sum(before < sampling.top_p, axis=-1, keepdims=True)   # >= 1
    threshold = jnp.take_along_axis(s, kept - 1, axis=-1)
    z = jnp.where(z < threshold, -jnp.inf, z)
  return jax.random.categorical(key, z, axis=-1).astype(jnp.int32)


# ---- the KV cache --------------------------------------------------------------------------

CACHE_KINDS = ("paged", "contiguous")
# Tokens per page: what bench_decode measures paged_attention at, and small enough that a
# row's last, partly filled page and a local layer's ring overhang (up to 2 pages) are
# little next to the cache. A positive multiple of 8 (jaxgpu.paged_attention's unit).
PAGE_SIZE = 16


class PagedCache(NamedTuple):
  """The paged KV cache (module docstring). pages: one {"k", "v"} dict per layer, each
  (P, page_size, K, H); block_table: (B, M) int32, the global layers' pages of each row;
  window_table: (B, M) int32, the local layers' ring of pages of each row."""

  pages: list
  block_table: jax.Array
  window_table: jax.Array


def _paged_supported(config: Config) -> bool:
  return (config.head_dim % decode_ops.HEAD_DIM_MULTIPLE == 0
          and config.head_dim <= decode_ops.MAX_HEAD_DIM)


def resolve_cache(cache: str | None, config: Config, implementation=None) -> str:
  """The cache kind a call uses: `cache` as given ('paged' or 'contiguous'), or for None
  the default of the implementation: 'paged' with jaxgpu's kernels, 'contiguous' on the
  'xla' path (what JAX offers without jaxgpu) and for head dims jaxgpu.paged_attention
  does not take (not a multiple of 8, or above 256)."""
  if cache is None:
    xla = _implementation.resolve(implementation) == "xla"
    return "contiguous" if xla or not _paged_supported(config) else "paged"
  if cache not in CACHE_KINDS:
    raise ValueError(f"cache: expected None or one of {CACHE_KINDS}, got {cache!r}")
  if cache == "paged" and not _paged_supported(config):
    raise ValueError(f"cache='paged': jaxgpu.paged_attention needs a head dim that is a "
                     f"multiple of {decode_ops.HEAD_DIM_MULTIPLE} and at most "
                     f"{decode_ops.MAX_HEAD_DIM}, got {config.head_dim}")
  return cache


def _check_page_size(page_size) -> int:
  m = decode_ops.PAGE_SIZE_MULTIPLE
  if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) \
      or page_size < m or page_size % m:
    raise ValueError(f"page_size: expected a positive multiple of {m}, got {page_size!r}")
  return int(page_size)


def paged_sizes(config: Config, cache_len: int, page_size: int = PAGE_SIZE) -> tuple[int, int]:
  """(M, R): the pages a row's cache_len positions span (the tables' width, and a row's
  pages of a global layer), and a row's ring of pages on a local layer."""
  m = -(-cache_len // page_size)
  return m, min(m, (config.sliding_window - 1) // page_size + 2)


def cache_sizes(config: Config, cache_len: int) -> list[int]:
  """Contiguous cache slots per layer: cache_len on global layers, min(sliding_window,
  cache_len) on local."""
  return [min(config.sliding_window, cache_len) if config.is_local(i) else cache_len
          for i in range(config.n_layers)]


def empty_cache(config: Config, batch: int, cache_len: int, dtype=jnp.bfloat16, *,
                cache: str | None = None, page_size: int = PAGE_SIZE, implementation=None):
  """A KV cache of zeros, in prefill's layout, for `batch` rows of up to cache_len
  positions: a PagedCache, or the contiguous list (cache_len slots on global layers,
  min(sliding_window, cache_len) on local ones). For timing decode_step at a given context
  length without a prefill (a step at position p reads the positions <= p).

  cache: 'paged', 'contiguous', or None for the default of `implementation`
  (resolve_cache). page_size: tokens per page (paged), a positive multiple of 8."""
  kind = resolve_cache(cache, config, implementation)
  k, h = config.n_kv_heads, config.head_dim
  if kind == "contiguous":
    return [{"k": jnp.zeros((batch, size, k, h), dtype), "v": jnp.zeros((batch, size, k, h), dtype)}
            for size in cache_sizes(config, cache_len)]
  page_size = _check_page_size(page_size)
  m, r = paged_sizes(config, cache_len, page_size)
  rows = np.arange(batch, dtype=np.int32)[:, None]
  cols = np.arange(m, dtype=np.int32)[None, :]
  pages = []
  for i in range(config.n_layers):
    shape = (batch * (r if config.is_local(i) else m), page_size, k, h)
    pages.append({"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)})
  return PagedCache(pages, jnp.asarray(rows * m + cols), jnp.asarray(rows * r + cols % r))


def _to_cache(kv, lengths, size: int):
  """(B, T, K, H) keys or values of a prefill -> (B, size, K, H) contiguous cache slots:
  slot p for position p, or, when T > size (a ring buffer), slot s gets the last position
  p < length with p % size == s (the window's keys; slots no position reached stay as
  they are)."""
  t = kv.shape[1]
  if t <= size:
    return jnp.pad(kv, ((0, 0), (0, size - t), (0, 0), (0, 0)))
  s = jnp.arange(size, dtype=jnp.int32)[None, :]
  last = lengths[:, None] - 1
  src = jnp.where(s <= last, s + size * ((last - s) // size), s)
  return jnp.take_along_axis(kv, src[:, :, None, None], axis=1)


def cache_shardings(cache, config: Config, mesh):
  """NamedShardings for a cache (PagedCache or contiguous list, arrays or shapes): the
  pools' kv-head axis on "model" (sharding.cache_spec), the block tables replicated."""
  mesh = sharding.auto_mesh(mesh)
  pool = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
      *sharding.cache_spec(config, mesh)))
  whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  if isinstance(cache, PagedCache):
    return PagedCache(jax.tree.map(lambda _: pool, cache.pages), whole, whole)
  return jax.tree.map(lambda _: pool, cache)


def shard_cache(cache, config: Config, mesh):
  """cache placed on `mesh` for tensor-parallel decoding (cache_shardings)."""
  return jax.device_put(cache, cache_shardings(cache, config, mesh))


def _paged_prefill(config: Config, kvs, lengths, cache_len: int, page_size: int,
                   implementation, mesh=None) -> PagedCache:
  """The prompts' (B, T, K, H) keys and values of every layer written into fresh pools."""
  k0 = kvs[0][0]
  cache = empty_cache(config, k0.shape[0], cache_len, k0.dtype, cache="paged",
                      page_size=page_size)
  p = jnp.arange(k0.shape[1], dtype=jnp.int32)[None, :]
  real = p < lengths[:, None]
  # Negative positions are skipped: the pads, and on local layers the keys before the
  # next query's window (length - sliding_window < p), so that the positions written in
  # one call span less than the ring and no two of them share a slot.
  write = {False: jnp.where(real, p, -1),
           True: jnp.where(real & (p > lengths[:, None] - config.sliding_window), p, -1)}
  pages = []
  for i, ((k, v), pool) in enumerate(zip(kvs, cache.pages)):
    local = config.is_local(i)
    table = cache.window_table if local else cache.block_table
    kp, vp = jaxgpu.paged_kv_update(pool["k"], pool["v"], k, v, table, write[local],
                                    implementation=implementation)
    spec = sharding.cache_spec(config, mesh)
    kp, vp = (sharding.constrain(x, mesh, *spec) for x in (kp, vp))
    pages.append({"k": kp, "v": vp})
  return cache._replace(pages=pages)


def _check_lengths(lengths, tokens):
  lengths = jnp.asarray(lengths)
  if lengths.shape != tokens.shape[:1] or not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(f"lengths: expected ({tokens.shape[0]},) integers, got "
                     f"{lengths.dtype}{tuple(lengths.shape)}")
  return lengths.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("config", "cache_len", "implementation", "cache",
                                             "page_size", "mesh"))
def prefill(params, config: Config, tokens, lengths, *, cache_len: int, implementation=None,
            cache: str | None = None, page_size: int = PAGE_SIZE, mesh=None):
  """Runs the prompts and builds the KV cache.

  Args:
    tokens: (B, T) int32 prompts, right-padded (any pad value); lengths: (B,) int32, each
      row's prompt length, 1 <= lengths <= T.
    cache_len: static int >= T: the positions the cache holds per row (the longest prompt
      plus the tokens to generate).
    cache: 'paged', 'contiguous', or None for the default of `implementation`
      (resolve_cache); page_size: tokens per page of a paged cache.
    mesh: None, or a Mesh with a "model" axis: tensor parallelism (module docstring).

  Returns:
    (logits (B, V) float32 at each row's last prompt token, the cache (module docstring)).
  """
  check_params(params, config)
  tokens = check_tokens(tokens)
  lengths = _check_lengths(lengths, tokens)
  if cache_len < tokens.shape[1]:
    raise ValueError(f"cache_len: must be >= the prompt length {tokens.shape[1]}, got "
                     f"{cache_len}")
  kind = resolve_cache(cache, config, implementation)
  if kind == "paged":
    page_size = _check_page_size(page_size)
  attend_for = lambda i: self_attend(config, i, implementation, mesh, None)
  y, kvs = trunk(params, config, tokens, default_positions(tokens), attend_for,
                 implementation=implementation, mesh=mesh)
  last = jnp.take_along_axis(y, (lengths - 1)[:, None, None], axis=1)[:, 0]
  if kind == "paged":
    kv_cache = _paged_prefill(config, kvs, lengths, cache_len, page_size, implementation,
                              mesh)
  else:
    spec = sharding.cache_spec(config, mesh)
    kv_cache = [{"k": sharding.constrain(_to_cache(k, lengths, size), mesh, *spec),
                 "v": sharding.constrain(_to_cache(v, lengths, size), mesh, *spec)}
                for (k, v), size in zip(kvs, cache_sizes(config, cache_len))]
  return output_logits(last, params, config, mesh), kv_cache


def _contiguous_attend(config: Config, cache: list, i: int, positions, implementation,
                       mesh=None):
  b = positions.shape[0]
  spec = sharding.cache_spec(config, mesh)
  rows = jnp.arange(b)
  query_ids = jnp.ones((b, 1), jnp.int32)

  def attend(q, k, v):
    size = cache[i]["k"].shape[1]
    slot = positions % size
    # One (K, H) row per batch row, written in place into the loop-carried (donated) cache.
    kc = cache[i]["k"].at[rows, slot].set(k[:, 0], indices_are_sorted=True,
                                          unique_indices=True)
    vc = cache[i]["v"].at[rows, slot].set(v[:, 0], indices_are_sorted=True,
                                          unique_indices=True)
    kc, vc = (sharding.constrain(x, mesh, *spec) for x in (kc, vc))
    visible = (jnp.arange(size, dtype=jnp.int32)[None, :] <= positions[:, None])
    o = layers.attention(q, kc, vc, config=config, layer=i, implementation=implementation,
                         is_causal=False, windowed=False, q_segment_ids=query_ids,
                         kv_segment_ids=visible.astype(jnp.int32))
    return o, {"k": kc, "v": vc}
  return attend


def _paged_attend(config: Config, cache: PagedCache, i: int, positions, implementation,
                  mesh=None):
  table = cache.window_table if config.is_local(i) else cache.block_table
  spec = sharding.cache_spec(config, mesh)

  def attend(q, k, v):
    pool = cache.pages[i]
    o, kp, vp = layers.paged_attention_with_update(q, k, v, pool["k"], pool["v"], table,
                                                   positions + 1, config=config, layer=i,
                                                   implementation=implementation)
    kp, vp = (sharding.constrain(x, mesh, *spec) for x in (kp, vp))
    return o, {"k": kp, "v": vp}
  return attend


def _step(params, config: Config, cache, tokens, positions, implementation, mesh=None):
  """One token per row at `positions`: (logits (B, V) float32, the updated cache)."""
  paged = isinstance(cache, PagedCache)
  attend = _paged_attend if paged else _contiguous_attend
  attend_for = lambda i: attend(config, cache, i, positions, implementation, mesh)
  y, layer_caches = trunk(params, config, tokens[:, None], positions[:, None], attend_for,
                          implementation=implementation, mesh=mesh)
  if paged:
    layer_caches = cache._replace(pages=layer_caches)
  return output_logits(y[:, 0], params, config, mesh), layer_caches


@functools.partial(jax.jit, static_argnames=("config", "implementation", "mesh"),
                   donate_argnums=(2,))
def decode_step(params, config: Config, cache, tokens, positions, *, implementation=None,
                mesh=None):
  """One decoding step (jitted; the cache is donated and updated in place).

  Args:
    cache: from prefill, empty_cache or an earlier step, paged or contiguous (the step
    follows the cache's layout). tokens: (B,) int32, each row's newest token; positions:
    (B,) int32, its position (prompt length + tokens generated before it), below the
    cache's cache_len.
    mesh: None, or a Mesh with a "model" axis for tensor-parallel decoding (static): the
    parameters placed with shard_params, the cache with shard_cache (sharded by kv heads).

  Returns:
    (logits (B, V) float32 for the next token, the cache with this token's keys written).
  """
  return _step(params, config, cache, tokens.astype(jnp.int32), positions.astype(jnp.int32),
               implementation, mesh)


@functools.partial(jax.jit, static_argnames=("config", "max_new_tokens", "sampling",
                                             "implementation", "mesh"), donate_argnums=(2,))
def decode(params, config: Config, cache, logits, positions, key, end_token, *,
           max_new_tokens: int, sampling: Sampling = Sampling(), implementation=None,
           mesh=None):
  """The decode loop (jitted, one jax.lax.while_loop; the cache is donated).

  Args:
    cache, logits: from prefill (paged or contiguous), whose cache_len must be at least
      the longest prompt plus max_new_tokens - 1 (positions index the global layers' slots
      directly).
    positions: (B,) int32 prompt lengths (the position of the first new token).
    key: a jax.random key (unused when greedy).
    end_token: int32 scalar; a row stops after producing it.
    max_new_tokens: static int >= 1. sampling: static Sampling.
    mesh: as decode_step (tensor-parallel decoding).

  Returns:
    (GenerateOutput, the final cache). The loop ends when every row has stopped or
    max_new_tokens tokens were drawn.
  """
  b = logits.shape[0]
  pad = jnp.int32(config.pad_token_id)
  end_token = jnp.asarray(end_token, jnp.int32)
  first = sample(logits, jax.random.fold_in(key, 0), sampling)
  out = jnp.full((b, max_new_tokens), pad, jnp.int32).at[:, 0].set(first)
  state = (jnp.int32(1), cache, first, positions.astype(jnp.int32), first == end_token, out,
           jnp.ones((b,), jnp.int32))

  def cond(state):
    i, _, _, _, done, _, _ = state
    return (i < max_new_tokens) & ~jnp.all(done)

  def body(state):
    i, cache, token, pos, done, out, lengths = state
    logits, cache = _step(params, config, cache, token, pos, implementation, mesh)
    token = jnp.where(done, pad, sample(logits, jax.random.fold_in(key, i), sampling))
    out = jax.lax.dynamic_update_slice(out, token[:, None], (jnp.int32(0), i))
    lengths = lengths + (~done).astype(jnp.int32)
    done = done | (token == end_token)
    return i + 1, cache, token, pos + 1, done, out, lengths

  _, cache, _, _, _, out, lengths = jax.lax.while_loop(cond, body, state)
  return GenerateOutput(out, lengths), cache


def _check_prompts(prompts, config: Config):
  if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (Sequence, np.ndarray,
                                                                   jax.Array)):
    raise ValueError("prompts: expected a sequence of 1-D integer token sequences")
  rows = []
  for i, p in enumerate(prompts):
    a = np.asarray(p)
    if a.ndim != 1 or a.size == 0 or not np.issubdtype(a.dtype, np.integer):
      raise ValueError(f"prompts[{i}]: expected a non-empty 1-D integer sequence, got "
                       f"{a.dtype}{a.shape}")
    if a.min() < 0 or a.max() >= config.vocab_size:
      raise ValueError(f"prompts[{i}]: token ids must be in [0, {config.vocab_size})")
    rows.append(a.astype(np.int32))
  if not rows:
    raise ValueError("prompts: expected at least one prompt")
  return rows


def generate(params, config: Config, prompts, max_new_tokens: int, *, temperature=0.0,
             top_k=None, top_p=None, key=None, end_token=None, implementation=None,
             cache: str | None = None, page_size: int = PAGE_SIZE,
             mesh=None) -> GenerateOutput:
  """Generates up to max_new_tokens tokens after each prompt (batched).

  Args:
    params, config: the model.
    prompts: a sequence of B 1-D integer token sequences, of any lengths >= 1.
    max_new_tokens: int >= 1.
    temperature, top_k, top_p: see Sampling (temperature 0: greedy).
    key: a jax.random key; required when temperature > 0. The same key gives the same
      tokens.
    end_token: the token that ends a row (included in its output); default
      config.eos_token_id. A value outside the vocabulary (e.g. -1) never stops a row.
    implementation: None (jaxgpu's kernels; a decode step's norms, RoPE and gated unit
      are XLA fusions: layers.pointwise_implementation) or 'xla'.
    cache: the KV cache's layout, 'paged' or 'contiguous' (module docstring); None: paged
      with jaxgpu's kernels, contiguous on the 'xla' path (resolve_cache). Both give the
      same tokens.
    page_size: tokens per page of the paged cache, a positive multiple of 8.
    mesh: None, or a Mesh with a "model" axis for tensor-parallel generation (the params
      placed with shard_params on it; module docstring).

  Returns:
    GenerateOutput(tokens (B, max_new_tokens) int32, lengths (B,) int32).

  One prefill call on the prompts right-padded to the longest, then one decode call (see
  the module docstring); each distinct (longest prompt, max_new_tokens, batch) compiles once.
  """
  rows = _check_prompts(prompts, config)
  kind = resolve_cache(cache, config, implementation)
  if kind == "paged":
    page_size = _check_page_size(page_size)
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
      or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
  sampling = Sampling(temperature, top_k, top_p)
  if not sampling.greedy and key is None:
    raise ValueError("key: a jax.random key is required when temperature > 0")
  if key is None:
    key = jax.random.key(0)
  longest = max(len(r) for r in rows)
  cache_len = longest + int(max_new_tokens)
  if cache_len > config.max_seq_len:
    raise ValueError(f"max_new_tokens: the longest prompt ({longest}) plus max_new_tokens "
                     f"({max_new_tokens}) exceeds config.max_seq_len ({config.max_seq_len})")
  tokens = np.full((len(rows), longest), config.pad_token_id, np.int32)
  for i, r in enumerate(rows):
    tokens[i, :len(r)] = r
  lengths = np.asarray([len(r) for r in rows], np.int32)
  end = config.eos_token_id if end_token is None else int(end_token)
  logits, kv_cache = prefill(params, config, tokens, lengths, cache_len=cache_len,
                             implementation=implementation, cache=kind, page_size=page_size,
                             mesh=mesh)
  out, _ = decode(params, config, kv_cache, logits, lengths, key, end,
                  max_new_tokens=int(max_new_tokens), sampling=sampling,
                  implementation=implementation, mesh=mesh)
  return out
