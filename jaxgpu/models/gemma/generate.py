"""Batched generation: a prefill pass that writes a KV cache, then a jitted decode loop.

The KV cache is a list with one {"k", "v"} dict per layer, each (B, S, K, H) in the
parameters' dtype (the layout jaxgpu.dot_product_attention reads, so no copy or transpose):
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
both take: padding and empty slots cost no special case.

Prefill runs the prompts right-padded to the longest, causal and without segment ids: a
real token only sees earlier positions of its row, which are real tokens too; the pads'
outputs are never read, and their cache slots are masked until the row's own decode steps
overwrite them. Each row then decodes at its own position (its prompt length + step): the
new keys are scattered into the donated cache (one row of K x H per layer and row: no
cache copy), and every step runs inside one jax.lax.while_loop with sampling, so there is
no host round trip per token and no recompilation per step.

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

from jaxgpu.models.gemma import layers
from jaxgpu.models.gemma.config import Config
from jaxgpu.models.gemma.model import (check_tokens, default_positions, output_logits,
                                       self_attend, trunk)
from jaxgpu.models.gemma.params import check_params


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


def cache_sizes(config: Config, cache_len: int) -> list[int]:
  """Slots per layer: cache_len on global layers, min(sliding_window, cache_len) on local."""
  return [min(config.sliding_window, cache_len) if config.is_local(i) else cache_len
          for i in range(config.n_layers)]


def empty_cache(config: Config, batch: int, cache_len: int, dtype=jnp.bfloat16) -> list:
  """A KV cache of zeros in prefill's layout: `batch` rows, cache_len slots on global
  layers, min(sliding_window, cache_len) on local ones. For timing decode_step at a given
  context length without a prefill (a step at position p reads the slots s <= p)."""
  shape = lambda size: (batch, size, config.n_kv_heads, config.head_dim)
  return [{"k": jnp.zeros(shape(size), dtype), "v": jnp.zeros(shape(size), dtype)}
          for size in cache_sizes(config, cache_len)]


def _to_cache(kv, lengths, size: int):
  """(B, T, K, H) keys or values of a prefill -> (B, size, K, H) cache slots: slot p for
  position p, or, when T > size (a ring buffer), slot s gets the last position p < length
  with p % size == s (the window's keys; slots no position reached stay as they are)."""
  t = kv.shape[1]
  if t <= size:
    return jnp.pad(kv, ((0, 0), (0, size - t), (0, 0), (0, 0)))
  s = jnp.arange(size, dtype=jnp.int32)[None, :]
  last = lengths[:, None] - 1
  src = jnp.where(s <= last, s + size * ((last - s) // size), s)
  return jnp.take_along_axis(kv, src[:, :, None, None], axis=1)


def _check_lengths(lengths, tokens):
  lengths = jnp.asarray(lengths)
  if lengths.shape != tokens.shape[:1] or not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(f"lengths: expected ({tokens.shape[0]},) integers, got "
                     f"{lengths.dtype}{tuple(lengths.shape)}")
  return lengths.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("config", "cache_len", "implementation"))
def prefill(params, config: Config, tokens, lengths, *, cache_len: int, implementation=None):
  """Runs the prompts and builds the KV cache.

  Args:
    tokens: (B, T) int32 prompts, right-padded (any pad value); lengths: (B,) int32, each
      row's prompt length, 1 <= lengths <= T.
    cache_len: static int >= T: the global layers' slots (the longest prompt plus the
      tokens to generate).

  Returns:
    (logits (B, V) float32 at each row's last prompt token, the cache (module docstring)).
  """
  check_params(params, config)
  tokens = check_tokens(tokens)
  lengths = _check_lengths(lengths, tokens)
  if cache_len < tokens.shape[1]:
    raise ValueError(f"cache_len: must be >= the prompt length {tokens.shape[1]}, got "
                     f"{cache_len}")
  attend_for = lambda i: self_attend(config, i, implementation, None, None)
  y, kvs = trunk(params, config, tokens, default_positions(tokens), attend_for,
                 implementation=implementation)
  last = jnp.take_along_axis(y, (lengths - 1)[:, None, None], axis=1)[:, 0]
  cache = [{"k": _to_cache(k, lengths, size), "v": _to_cache(v, lengths, size)}
           for (k, v), size in zip(kvs, cache_sizes(config, cache_len))]
  return output_logits(last, params, config), cache


def _step(params, config: Config, cache, tokens, positions, implementation):
  """One token per row at `positions`: (logits (B, V) float32, the updated cache)."""
  b = tokens.shape[0]
  rows = jnp.arange(b)
  query_ids = jnp.ones((b, 1), jnp.int32)

  def attend_for(i):
    def attend(q, k, v):
      size = cache[i]["k"].shape[1]
      slot = positions % size
      # One (K, H) row per batch row, written in place into the loop-carried (donated) cache.
      kc = cache[i]["k"].at[rows, slot].set(k[:, 0], indices_are_sorted=True,
                                            unique_indices=True)
      vc = cache[i]["v"].at[rows, slot].set(v[:, 0], indices_are_sorted=True,
                                            unique_indices=True)
      visible = (jnp.arange(size, dtype=jnp.int32)[None, :] <= positions[:, None])
      o = layers.attention(q, kc, vc, config=config, layer=i, implementation=implementation,
                           is_causal=False, windowed=False, q_segment_ids=query_ids,
                           kv_segment_ids=visible.astype(jnp.int32))
      return o, {"k": kc, "v": vc}
    return attend

  y, cache = trunk(params, config, tokens[:, None], positions[:, None], attend_for,
                   implementation=implementation)
  return output_logits(y[:, 0], params, config), cache


@functools.partial(jax.jit, static_argnames=("config", "implementation"), donate_argnums=(2,))
def decode_step(params, config: Config, cache, tokens, positions, *, implementation=None):
  """One decoding step (jitted; the cache is donated and updated in place).

  Args:
    cache: from prefill, empty_cache or an earlier step. tokens: (B,) int32, each row's
    newest token; positions: (B,) int32, its position (prompt length + tokens generated
    before it), below the cache's cache_len.

  Returns:
    (logits (B, V) float32 for the next token, the cache with this token's keys written).
  """
  return _step(params, config, cache, tokens.astype(jnp.int32), positions.astype(jnp.int32),
               implementation)


@functools.partial(jax.jit, static_argnames=("config", "max_new_tokens", "sampling",
                                             "implementation"), donate_argnums=(2,))
def decode(params, config: Config, cache, logits, positions, key, end_token, *,
           max_new_tokens: int, sampling: Sampling = Sampling(), implementation=None):
  """The decode loop (jitted, one jax.lax.while_loop; the cache is donated).

  Args:
    cache, logits: from prefill, whose cache_len must be at least the longest prompt plus
      max_new_tokens - 1 (positions index the global layers' slots directly).
    positions: (B,) int32 prompt lengths (the position of the first new token).
    key: a jax.random key (unused when greedy).
    end_token: int32 scalar; a row stops after producing it.
    max_new_tokens: static int >= 1. sampling: static Sampling.

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
    logits, cache = _step(params, config, cache, token, pos, implementation)
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
             top_k=None, top_p=None, key=None, end_token=None,
             implementation=None) -> GenerateOutput:
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
    implementation: None (jaxgpu's kernels) or 'xla'.

  Returns:
    GenerateOutput(tokens (B, max_new_tokens) int32, lengths (B,) int32).

  One prefill call on the prompts right-padded to the longest, then one decode call (see
  the module docstring); each distinct (longest prompt, max_new_tokens, batch) compiles once.
  """
  rows = _check_prompts(prompts, config)
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
  logits, cache = prefill(params, config, tokens, lengths, cache_len=cache_len,
                          implementation=implementation)
  out, _ = decode(params, config, cache, logits, lengths, key, end,
                  max_new_tokens=int(max_new_tokens), sampling=sampling,
                  implementation=implementation)
  return out
