"""Generation with the Gemma model: greedy decoding over the KV cache (ring buffers on the
sliding-window layers) against the full forward pass, per-row end tokens, sampling, and the
prefill / decode_step pieces the benchmark times."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpu.models import gemma

import gemma_util as U
from gemma_util import exact_matmuls, kernels_at_every_size  # noqa: F401 (autouse fixtures)

KERNELS = U.KERNELS

# Lengths around the tiny window (8): one prompt longer than it (the prefill fills the ring
# buffers from its last 8 positions), and generations that run past it.
PROMPT_LENGTHS = (3, 13, 6)
NEW = 12

FORWARD = jax.jit(gemma.forward, static_argnames=("config", "implementation"))


def prompts_for(config, seed, lengths=PROMPT_LENGTHS):
  rng = np.random.default_rng(seed)
  # Token ids from 2 up: the end token (1) and the pad (0) never appear in a prompt.
  return [rng.integers(2, config.vocab_size, n).tolist() for n in lengths]


def check_greedy(params, config, prompts, out, implementation):
  """Every generated token is the argmax of the full forward pass over the prompt and the
  tokens generated before it. One forward over prompt + generation per row checks all
  steps at once: with causal attention, position i's logits depend on tokens 0..i only, so
  they are those of recomputing the forward at step i."""
  tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
  total = max(len(p) for p in prompts) + tokens.shape[1]
  rows = np.zeros((len(prompts), total), np.int32)
  for b, p in enumerate(prompts):
    rows[b, :len(p)] = p
    rows[b, len(p):len(p) + lengths[b]] = tokens[b, :lengths[b]]
  logits = np.asarray(FORWARD(params, config, jnp.asarray(rows), implementation=implementation))
  for b, p in enumerate(prompts):
    for i in range(lengths[b]):
      step = logits[b, len(p) - 1 + i]
      top = np.sort(step)[-2:]
      assert tokens[b, i] == np.argmax(step) or top[1] - top[0] < 1e-5, (b, i)


@pytest.mark.parametrize("impl", [KERNELS[0], "xla"])
@pytest.mark.parametrize("version", [2, 3])
def test_greedy_generation_matches_the_forward_pass(version, impl):
  c = gemma.Config.tiny(version)
  params = U.random_params(c, 1, embed_std=0.05)
  prompts = prompts_for(c, 2)
  out = gemma.generate(params, c, prompts, NEW, end_token=-1, implementation=impl)
  assert out.tokens.shape == (len(prompts), NEW) and out.tokens.dtype == jnp.int32
  assert out.lengths.tolist() == [NEW] * len(prompts)
  assert len({tuple(r) for r in np.asarray(out.tokens).tolist()}) == len(prompts)
  assert all(len(set(r)) > 2 for r in np.asarray(out.tokens).tolist())   # not degenerate
  check_greedy(params, c, prompts, out, impl)


def test_rows_stop_at_their_end_token():
  c = gemma.Config.tiny(2)
  params = U.random_params(c, 3, embed_std=0.05)
  prompts = prompts_for(c, 4)
  free = gemma.generate(params, c, prompts, NEW, end_token=-1)
  row0 = np.asarray(free.tokens[0])
  end = int(row0[4])                                 # row 0's 5th token becomes the end token
  first = int(np.argmax(row0 == end))
  out = gemma.generate(params, c, prompts, NEW, end_token=end)
  tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
  for b in range(len(prompts)):
    ref = np.asarray(free.tokens[b])
    hits = np.flatnonzero(ref == end)
    n = hits[0] + 1 if hits.size else NEW
    assert lengths[b] == n
    np.testing.assert_array_equal(tokens[b, :n], ref[:n])
    assert np.all(tokens[b, n:] == c.pad_token_id)
  assert lengths[0] == first + 1 <= 5


def test_sampling_is_reproducible_and_top_k_1_is_greedy():
  c = gemma.Config.tiny(3)
  params = U.random_params(c, 5, embed_std=0.05)
  prompts = prompts_for(c, 6)
  key = jax.random.key(7)
  kw = dict(end_token=-1, temperature=1.3, key=key)
  a = gemma.generate(params, c, prompts, NEW, top_p=0.9, **kw)
  b = gemma.generate(params, c, prompts, NEW, top_p=0.9, **kw)
  np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
  other = gemma.generate(params, c, prompts, NEW, top_p=0.9, end_token=-1, temperature=1.3,
                         key=jax.random.key(8))
  assert np.any(np.asarray(other.tokens) != np.asarray(a.tokens))
  greedy = gemma.generate(params, c, prompts, NEW, end_token=-1)
  assert np.any(np.asarray(a.tokens) != np.asarray(greedy.tokens))
  top1 = gemma.generate(params, c, prompts, NEW, top_k=1, **kw)
  np.testing.assert_array_equal(np.asarray(top1.tokens), np.asarray(greedy.tokens))


def test_sample_top_k_and_top_p_keep_the_right_tokens():
  logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 2000, jnp.float32))
  keys = jax.random.key(0)
  draws = np.asarray(gemma.sample(
      logits, keys, gemma.Sampling(temperature=1.0, top_k=2)))
  assert set(draws.tolist()) == {0, 1}
  draws = np.asarray(gemma.sample(
      logits, keys, gemma.Sampling(temperature=1.0, top_p=0.85)))
  assert set(draws.tolist()) == {0, 1, 2}              # 0.5 + 0.3 < 0.85 <= 0.95
  assert abs(np.mean(draws == 0) - 0.5 / 0.95) < 0.05


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_prefill_and_decode_steps_are_the_generation(cache):
  """The benchmark's pieces: prefill, then decode_step by hand, give generate's tokens."""
  c = gemma.Config.tiny(2)
  params = U.random_params(c, 9, embed_std=0.05)
  prompts = prompts_for(c, 10)
  out = gemma.generate(params, c, prompts, NEW, end_token=-1)
  longest = max(map(len, prompts))
  tokens = np.zeros((len(prompts), longest), np.int32)
  for b, p in enumerate(prompts):
    tokens[b, :len(p)] = p
  lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
  logits, kv = gemma.prefill(params, c, tokens, lengths, cache_len=longest + NEW, cache=cache)
  if cache == "contiguous":
    assert [layer["k"].shape[1] for layer in kv] == [
        c.sliding_window if t == "local" else longest + NEW for t in c.layer_types]
  empty = gemma.empty_cache(c, len(prompts), longest + NEW, jnp.float32, cache=cache)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), empty) == jax.tree.map(
      lambda a: (a.shape, a.dtype), kv)
  got, pos = [], lengths
  for _ in range(NEW):
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    got.append(token)
    logits, kv = gemma.decode_step(params, c, kv, token, pos)
    pos = pos + 1
  np.testing.assert_array_equal(np.stack(got, axis=1), np.asarray(out.tokens))


def test_generate_rejects_bad_arguments():
  c = gemma.Config.tiny(2)
  params = U.random_params(c, 11, embed_std=0.05)
  with pytest.raises(ValueError, match=r"prompts\[1\]"):
    gemma.generate(params, c, [[3, 4], []], 4)
  with pytest.raises(ValueError, match=r"prompts\[0\]"):
    gemma.generate(params, c, [[3, c.vocab_size]], 4)
  with pytest.raises(ValueError, match="max_new_tokens"):
    gemma.generate(params, c, [[3, 4]], 0)
  with pytest.raises(ValueError, match="key"):
    gemma.generate(params, c, [[3, 4]], 4, temperature=0.7)
  with pytest.raises(ValueError, match="top_p"):
    gemma.generate(params, c, [[3, 4]], 4, temperature=0.7, top_p=1.5, key=jax.random.key(0))
  with pytest.raises(ValueError, match="top_k"):
    gemma.generate(params, c, [[3, 4]], 4, top_k=0)
