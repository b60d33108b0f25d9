"""Generation over the paged KV cache: the same logits and tokens as the contiguous cache
and the 'xla' path (ragged prompts, Gemma 2's softcap and local/global alternation, Gemma
3's query-key norm and MQA), local layers' rings of pages that wrap, the block tables
honoured, and a decode step that updates the donated pools without copying them."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpu.models import gemma
from jaxgpu.models.gemma import layers

import gemma_util as U
from gemma_util import exact_matmuls, kernels_at_every_size  # noqa: F401 (autouse fixtures)

KERNEL = U.KERNEL_IMPL
# The tiny configs' window is 8. With pages of 8 a local layer's ring is 2 pages (16
# slots), so the 21-token prompt overflows it in prefill and every row wraps it while
# decoding; the 3-token row is padded to 21 in prefill, and its pads must not land on its
# ring. With pages of 16 the ring (2 pages) covers the whole 41-position cache.
PROMPT_LENGTHS = (3, 21, 9, 16)
STEPS = 20


def prompts_for(config, seed, lengths=PROMPT_LENGTHS):
  rng = np.random.default_rng(seed)
  return [rng.integers(2, config.vocab_size, n).tolist() for n in lengths]


def padded(prompts):
  longest = max(map(len, prompts))
  tokens = np.zeros((len(prompts), longest), np.int32)
  for b, p in enumerate(prompts):
    tokens[b, :len(p)] = p
  return tokens, np.asarray([len(p) for p in prompts], np.int32)


def step_logits(params, config, prompts, *, implementation, cache, page_size=16, feed=None):
  """Prefill, then STEPS decode steps fed `feed` (B, STEPS) tokens (default: each step's
  argmax): (B, STEPS + 1, V) logits, the tokens fed."""
  tokens, lengths = padded(prompts)
  cache_len = tokens.shape[1] + STEPS
  logits, kv = gemma.prefill(params, config, tokens, lengths, cache_len=cache_len,
                             implementation=implementation, cache=cache, page_size=page_size)
  assert isinstance(kv, gemma.PagedCache) == (cache == "paged")
  out, fed, pos = [logits], [], jnp.asarray(lengths)
  for i in range(STEPS):
    token = jnp.argmax(logits, -1).astype(jnp.int32) if feed is None else feed[:, i]
    fed.append(token)
    logits, kv = gemma.decode_step(params, config, kv, token, pos,
                                   implementation=implementation)
    out.append(logits)
    pos = pos + 1
  return np.stack([np.asarray(x) for x in out], 1), jnp.stack(fed, 1)


@pytest.mark.parametrize("page_size", [8, 16])
@pytest.mark.parametrize("version", [2, 3])
def test_paged_logits_match_the_contiguous_cache_and_xla(version, page_size):
  c = gemma.Config.tiny(version)
  params = U.random_params(c, 20 + version, embed_std=0.05)
  prompts = prompts_for(c, version)
  paged, fed = step_logits(params, c, prompts, implementation=KERNEL, cache="paged",
                           page_size=page_size)
  contiguous, _ = step_logits(params, c, prompts, implementation=KERNEL, cache="contiguous",
                              feed=fed)
  xla, _ = step_logits(params, c, prompts, implementation="xla", cache="contiguous", feed=fed)
  scale = float(np.max(np.abs(xla)))
  assert scale > 1.0                                    # not degenerate
  np.testing.assert_allclose(paged, contiguous, rtol=0, atol=2e-5 * scale)
  np.testing.assert_allclose(paged, xla, rtol=0, atol=2e-5 * scale)
  # The window matters: a cache that let local layers see one key too many (or too few)
  # would move the logits by far more than the tolerance once rows pass the window.
  assert len(set(np.asarray(fed).ravel().tolist())) > 8


@pytest.mark.parametrize("version", [2, 3])
def test_paged_generate_gives_the_tokens_of_every_path(version):
  c = gemma.Config.tiny(version)
  params = U.random_params(c, 30 + version, embed_std=0.05)
  prompts = prompts_for(c, 40 + version)
  run = lambda **kw: np.asarray(gemma.generate(params, c, prompts, STEPS, end_token=-1,
                                               **kw).tokens)
  paged = run(implementation=KERNEL)                    # the default with the kernels
  np.testing.assert_array_equal(paged, run(implementation=KERNEL, cache="paged", page_size=8))
  np.testing.assert_array_equal(paged, run(implementation=KERNEL, cache="contiguous"))
  np.testing.assert_array_equal(paged, run(implementation="xla"))
  np.testing.assert_array_equal(paged, run(implementation="xla", cache="paged"))


def test_the_block_tables_are_followed():
  """The same cache with its pages renumbered (pools and tables permuted together) gives
  the same logits, and the step writes the renumbered pages."""
  c = gemma.Config.tiny(2)
  params = U.random_params(c, 50, embed_std=0.05)
  tokens, lengths = padded(prompts_for(c, 51))
  _, kv = gemma.prefill(params, c, tokens, lengths, cache_len=tokens.shape[1] + 4,
                        implementation=KERNEL, page_size=8)
  rng = np.random.default_rng(52)
  perms = {n: rng.permutation(n) for n in {layer["k"].shape[0] for layer in kv.pages}}

  def renumber(cache):
    pages = [{k: jnp.zeros_like(a).at[perms[a.shape[0]]].set(a) for k, a in layer.items()}
             for layer in cache.pages]
    # tiny(2)'s layers are local, global, local; their pools differ in size (4 and 2
    # pages a row), so each size has its own permutation.
    glob, loc = perms[cache.pages[1]["k"].shape[0]], perms[cache.pages[0]["k"].shape[0]]
    return gemma.PagedCache(pages, jnp.asarray(glob)[cache.block_table],
                            jnp.asarray(loc)[cache.window_table])

  moved = renumber(kv)
  token = jnp.full((len(lengths),), 7, jnp.int32)
  want, kv = gemma.decode_step(params, c, kv, token, jnp.asarray(lengths),
                               implementation=KERNEL)
  got, moved = gemma.decode_step(params, c, moved, token, jnp.asarray(lengths),
                                 implementation=KERNEL)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  for a, b in zip(jax.tree.leaves(renumber(kv)), jax.tree.leaves(moved)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_empty_cache_layouts():
  c = gemma.Config.tiny(3)                       # layers local, local, global; window 8
  kv = gemma.empty_cache(c, 2, 41, jnp.float32, cache="paged", page_size=8)
  m, r = 6, 2                                    # ceil(41 / 8); (8 - 1) // 8 + 2
  assert [layer["k"].shape for layer in kv.pages] == [
      (2 * (r if c.is_local(i) else m), 8, c.n_kv_heads, c.head_dim) for i in range(3)]
  np.testing.assert_array_equal(np.asarray(kv.block_table), np.arange(12).reshape(2, 6))
  np.testing.assert_array_equal(np.asarray(kv.window_table),
                                [[0, 1, 0, 1, 0, 1], [2, 3, 2, 3, 2, 3]])
  assert gemma.resolve_cache(None, c, "xla") == "contiguous"
  assert gemma.resolve_cache(None, c, KERNEL) == "paged"
  assert isinstance(gemma.empty_cache(c, 2, 41, implementation="xla"), list)
  with pytest.raises(ValueError, match="cache"):
    gemma.empty_cache(c, 2, 41, cache="ring")
  with pytest.raises(ValueError, match="page_size"):
    gemma.empty_cache(c, 2, 41, cache="paged", page_size=12)
  with pytest.raises(ValueError, match="page_size"):
    gemma.generate(U.random_params(c, 1), c, [[3, 4]], 2, cache="paged", page_size=0)


def _pool_copies(hlo: str, shapes) -> list[str]:
  """Instructions of a compiled module that copy an array of one of `shapes` (a copy, or a
  fusion XLA named after one), a unit leading dim ignored."""
  found = []
  for line in hlo.splitlines():
    m = re.match(r"\s*(?:ROOT )?%(\S+) = \w+\[([\d,]*)\]\S* (\w+)\(", line)
    if not m or not ("copy" in m.group(1) or m.group(3) == "copy"):
      continue
    dims = tuple(int(d) for d in m.group(2).split(",") if d)
    if dims in shapes or dims[1:] in shapes and dims[:1] == (1,):
      found.append(line.strip()[:160])
  return found


@pytest.mark.parametrize("version", [2, 3])
def test_decoding_updates_the_donated_pools_in_place(version):
  c = gemma.Config.tiny(version)
  params = U.random_params(c, 60)
  kv = gemma.empty_cache(c, 3, 40, jnp.float32, cache="paged", page_size=8)
  shapes = {layer["k"].shape for layer in kv.pages}
  tokens = jnp.ones((3,), jnp.int32)
  step = gemma.decode_step.lower(params, c, kv, tokens, tokens, implementation=KERNEL)
  loop = gemma.decode.lower(params, c, kv, jnp.zeros((3, c.vocab_size)), tokens,
                            jax.random.key(0), -1, max_new_tokens=4, implementation=KERNEL)
  for lowered in (step, loop):
    hlo = lowered.compile().as_text()
    assert "jaxgpu_paged_attention_with_update_fwd" in hlo and "input_output_alias" in hlo
    assert _pool_copies(hlo, shapes) == []


# ---- tensor-parallel decoding on fake CPU devices -----------------------------------------


@pytest.mark.parametrize("cache", ["paged", "contiguous"])
def test_tensor_parallel_generation_matches_one_device(cache, cpu_devices):
  """Heads, kv heads and the MLP split over a 2-device "model" axis, the cache by kv heads:
  the same tokens as one device, and a decode loop whose only collectives are the
  all-reduces of (B, 1, D) activations over "model" (no gather of the cache or weights)."""
  c = gemma.Config.tiny(2)   # 4 heads, 2 kv heads: both split over 2 devices
  mesh = jax.make_mesh((1, 2), ("data", "model"), devices=cpu_devices[:2])
  params = U.random_params(c, 61)
  prompts = prompts_for(c, 62)
  kw = dict(end_token=-1, implementation=KERNEL, cache=cache, page_size=8)
  want = gemma.generate(params, c, prompts, 6, **kw)
  placed = gemma.shard_params(params, c, mesh)
  got = gemma.generate(placed, c, prompts, 6, mesh=mesh, **kw)
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))

  b = len(prompts)
  kv = gemma.shard_cache(gemma.empty_cache(c, b, 40, jnp.float32, cache=cache, page_size=8),
                         c, mesh)
  pools = kv.pages if cache == "paged" else kv
  assert pools[0]["k"].sharding.spec[2] == "model"
  tokens = jnp.ones((b,), jnp.int32)
  loop = gemma.decode.lower(placed, c, kv, jnp.zeros((b, c.vocab_size)), tokens,
                            jax.random.key(0), -1, max_new_tokens=4, implementation=KERNEL,
                            mesh=mesh).compile()
  found = U.collectives(loop.as_text())
  model = U.mesh_groups(mesh, "model")
  assert found
  for col in found:
    assert col.kind == "all-reduce" and col.groups == model, col.line
    assert all(s in ((b, 1, c.d_model), ()) for s in col.shapes), col.line


def _targets(lowered) -> set[str]:
  return set(re.findall(r'custom_call_target="(jaxgpu_[^"]+)"', lowered.compile().as_text()))


POINTWISE = ("rms_norm", "rope", "geglu")


def test_the_default_leaves_a_small_steps_pointwise_ops_to_xla(monkeypatch):
  """implementation=None: a decode step (5 tokens) runs its norms, RoPE and gated unit as
  XLA fusions and keeps the cache and attention kernels; the kernel implementation named
  explicitly runs them all; a step over more than XLA_FUSES_UP_TO_TOKENS tokens runs the
  kernels under the default too. (Shapes no other test traces: jit caches ignore the
  threshold.)"""
  monkeypatch.setattr(layers, "XLA_FUSES_UP_TO_TOKENS", U.XLA_FUSES_UP_TO_TOKENS)
  c = gemma.Config.tiny(3)
  params = U.random_params(c, 61)
  kv = gemma.empty_cache(c, 5, 43, jnp.float32, cache="paged", page_size=8)
  tokens = jnp.ones((5,), jnp.int32)

  def step_targets(implementation):
    return _targets(gemma.decode_step.lower(params, c, kv, tokens, tokens,
                                            implementation=implementation))

  default, explicit = step_targets(None), step_targets("cuda" if U.HAS_CUDA else "cpu")
  assert any("paged_attention_with_update" in t for t in default), default
  for name in POINTWISE:
    assert not any(name in t for t in default), (name, default)
    assert any(name in t for t in explicit), (name, explicit)
  rows = U.XLA_FUSES_UP_TO_TOKENS + 1
  forward = jax.jit(gemma.forward, static_argnames=("config", "implementation")).lower(
      params, c, jnp.ones((1, rows), jnp.int32), implementation=None)
  assert all(any(name in t for t in _targets(forward)) for name in POINTWISE)
