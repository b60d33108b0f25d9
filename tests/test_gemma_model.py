"""The Gemma model (jaxgpu.models.gemma): presets, the forward pass and loss on jaxgpu's
kernels against the 'xla' path, attention semantics (window, packed segments), remat, and
bad inputs. Tiny configs on the CPU; the comparison with Hugging Face transformers is in
tests/test_gemma_transformers.py."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgpu
from jaxgpu.models import gemma
from jaxgpu.models.gemma import layers

import gemma_util as U
from gemma_util import exact_matmuls, kernels_at_every_size  # noqa: F401 (autouse fixtures)

# jaxgpu's kernels: the CPU ones here; on a GPU machine None runs the CUDA kernels (and the
# reference for float32 attention, which the CUDA kernels do not take).
KERNELS = U.KERNELS

B, T = 2, 21   # T > 2 * sliding_window (8): local layers see only part of the sequence

FORWARD = jax.jit(gemma.forward, static_argnames=("config", "implementation", "remat"))
LOSS = jax.jit(gemma.loss, static_argnames=("config", "implementation", "remat"))
LOSS_GRAD = jax.jit(jax.value_and_grad(gemma.loss),
                    static_argnames=("config", "implementation", "remat"))


def small_caps(config):
  """Gemma 2's softcaps lowered so that they bend the tiny model's logits noticeably."""
  if config.version != 2:
    return config
  return dataclasses.replace(config, attn_logit_softcap=5.0, final_logit_softcap=3.0)


def tokens_for(config, seed, shape=(B, T)):
  return jnp.asarray(np.random.default_rng(seed).integers(0, config.vocab_size, shape),
                     jnp.int32)


# ---- presets and validation -----------------------------------------------------------------


def n_params(config) -> int:
  return sum(int(np.prod(s)) for s in jax.tree.leaves(
      gemma.param_shapes(config), is_leaf=lambda s: isinstance(s, tuple)))


def test_presets_have_the_published_dimensions():
  c = gemma.Config.gemma2_2b()
  assert (c.vocab_size, c.d_model, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim,
          c.ffn_dim) == (256_000, 2304, 26, 8, 4, 256, 9216)
  assert (c.query_pre_attn_scalar, c.sliding_window, c.attn_logit_softcap,
          c.final_logit_softcap, c.qk_norm) == (256, 4096, 50.0, 30.0, False)
  assert c.layer_types[:4] == ("local", "global", "local", "global")
  assert n_params(c) == 2_614_341_888          # the published gemma-2-2b parameter count
  c = gemma.Config.gemma3_1b()
  assert (c.vocab_size, c.d_model, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim,
          c.ffn_dim, c.sliding_window) == (262_144, 1152, 26, 4, 1, 256, 6912, 512)
  assert (c.rope_theta_global, c.rope_theta_local, c.rope_scale_global) == (1e6, 1e4, 1.0)
  assert c.qk_norm and c.attn_logit_softcap is None and c.final_logit_softcap is None
  assert [i for i, t in enumerate(c.layer_types) if t == "global"] == [5, 11, 17, 23]
  assert n_params(c) == 999_885_952            # the published gemma-3-1b parameter count
  c = gemma.Config.gemma3_4b()
  assert (c.d_model, c.n_layers, c.n_heads, c.n_kv_heads, c.ffn_dim, c.sliding_window,
          c.rope_scale_global) == (2560, 34, 8, 4, 10_240, 1024, 8.0)
  assert [i for i, t in enumerate(c.layer_types) if t == "global"] == [5, 11, 17, 23, 29]
  for version in (2, 3):
    c = gemma.Config.tiny(version)
    assert set(c.layer_types) == {"local", "global"} and c.sliding_window < T


@pytest.mark.parametrize("change, needle", [
    (dict(n_kv_heads=3), "n_kv_heads"),
    (dict(layer_types=("local", "global")), "layer_types"),
    (dict(layer_types=("local", "global", "sliding")), "layer_types"),
    (dict(version=4), "version"),
    (dict(head_dim=0), "head_dim"),
    (dict(attn_logit_softcap=-1.0), "attn_logit_softcap"),
])
def test_config_rejects_inconsistent_fields(change, needle):
  with pytest.raises(ValueError, match=needle):
    dataclasses.replace(gemma.Config.tiny(2), **change)


def test_init_params_follows_the_contract_layout():
  c = gemma.Config.tiny(3)
  p = gemma.init_params(c, jax.random.key(0), jnp.bfloat16)
  gemma.check_params(p, c)
  assert p["layers"][0]["q"].shape == (c.d_model, c.n_heads, c.head_dim)
  assert p["layers"][0]["o"].shape == (c.n_heads, c.head_dim, c.d_model)
  assert "q_norm" in p["layers"][0] and "q_norm" not in gemma.param_shapes(gemma.Config.tiny(2))[
      "layers"][0]
  assert not np.any(np.asarray(p["final_norm"], np.float32))   # HF: norm weights start at 0
  assert abs(float(jnp.std(p["embed"].astype(jnp.float32))) - 0.02) < 0.002


# ---- the kernels against the 'xla' path ---------------------------------------------------


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("version", [2, 3])
def test_forward_kernels_match_xla_float32(version, kernels):
  c = small_caps(gemma.Config.tiny(version))
  p = U.random_params(c, 1)
  x = tokens_for(c, 2)
  fwd = FORWARD
  got = fwd(p, c, x, implementation=kernels)
  ref = fwd(p, c, x, implementation="xla")
  assert got.shape == (B, T, c.vocab_size) and got.dtype == jnp.float32
  scale = float(jnp.max(jnp.abs(ref)))
  assert 1.0 < scale < 100.0                          # the logits are not degenerate
  assert U.max_abs(got, ref) <= 2e-5 * scale


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("version", [2, 3])
def test_forward_bfloat16_error_at_most_twice_xla(version, kernels):
  """Against a float32 evaluation of the same bfloat16 weights, the kernels' bfloat16 logits
  err at most twice as much as the 'xla' path's bfloat16 logits (docs/design.md section 7)."""
  c = small_caps(gemma.Config.tiny(version))
  p = U.random_params(c, 3, jnp.bfloat16)
  x = tokens_for(c, 4)
  fwd = FORWARD
  exact = fwd(U.cast(p, jnp.float32), c, x, implementation="xla")
  got = fwd(p, c, x, implementation=kernels)
  ref = fwd(p, c, x, implementation="xla")
  err, ref_err = U.max_abs(got, exact), U.max_abs(ref, exact)
  scale = float(jnp.max(jnp.abs(exact)))
  assert 0 < ref_err < 0.2 * scale
  assert err <= 2 * ref_err + 8 * 2.0 ** -8 * scale, (err, ref_err)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("version", [2, 3])
def test_loss_gradients_kernels_match_xla(version, kernels):
  c = small_caps(gemma.Config.tiny(version))
  p = U.random_params(c, 5)
  x = tokens_for(c, 6, (B, T + 1))
  mask = jnp.asarray(np.random.default_rng(7).random((B, T)) < 0.8)
  grad = LOSS_GRAD
  lk, gk = grad(p, c, x[:, :-1], x[:, 1:], mask=mask, implementation=kernels)
  lx, gx = grad(p, c, x[:, :-1], x[:, 1:], mask=mask, implementation="xla")
  assert abs(float(lk) - float(lx)) <= 1e-5 * abs(float(lx))
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(gk)[0], jax.tree.leaves(gx)):
    scale = float(jnp.max(jnp.abs(b)))
    assert scale > 0, jax.tree_util.keystr(path)
    assert U.max_abs(a, b) <= 1e-4 * scale, jax.tree_util.keystr(path)


def test_loss_is_the_masked_mean_cross_entropy_of_forward():
  """The loss (final softcap fused into jaxgpu.cross_entropy) equals the mean cross-entropy
  of forward's softcapped float32 logits over the unmasked positions."""
  c = small_caps(gemma.Config.tiny(2))
  p = U.random_params(c, 8)
  x = tokens_for(c, 9, (B, T + 1))
  mask = np.random.default_rng(10).random((B, T)) < 0.7
  logits = FORWARD(p, c, x[:, :-1])
  logp = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(logp, x[:, 1:, None], axis=-1)[..., 0]
  expected = float(jnp.sum(jnp.where(mask, nll, 0.0)) / mask.sum())
  got = float(LOSS(p, c, x[:, :-1], x[:, 1:], mask=jnp.asarray(mask)))
  assert abs(got - expected) <= 1e-5 * expected
  # Padding (segment id 0) never counts.
  real = np.arange(T) < T - 5
  seg = jnp.asarray(np.where(real, 1, 0)[None].repeat(B, 0), jnp.int32)
  logp = jax.nn.log_softmax(FORWARD(p, c, x[:, :-1], segment_ids=seg), axis=-1)
  nll = -jnp.take_along_axis(logp, x[:, 1:, None], axis=-1)[..., 0]
  expected = float(jnp.mean(nll[:, real]))
  got = float(LOSS(p, c, x[:, :-1], x[:, 1:], segment_ids=seg))
  assert abs(got - expected) <= 1e-5 * expected


# ---- attention semantics ------------------------------------------------------------------


@pytest.mark.parametrize("impl", [KERNELS[0], "xla"])
@pytest.mark.parametrize("version", [2, 3])
def test_sliding_window_sees_exactly_the_last_window_tokens(version, impl):
  """One local layer: the logits at position i depend on tokens i - W + 1 .. i (HF's
  i - sliding_window < j <= i) and not on token i - W (on the 'xla' path: the softcapped
  einsum reference for Gemma 2, jax.nn.dot_product_attention for Gemma 3)."""
  base = gemma.Config.tiny(version)
  c = dataclasses.replace(base, n_layers=1, layer_types=("local",))
  p = U.random_params(c, 11)
  w, i = c.sliding_window, 15
  x = tokens_for(c, 12, (1, 16))
  fwd = FORWARD
  base_logits = fwd(p, c, x, implementation=impl)[0, i]
  outside = fwd(p, c, x.at[0, i - w].set((x[0, i - w] + 1) % c.vocab_size),
                implementation=impl)[0, i]
  inside = fwd(p, c, x.at[0, i - w + 1].set((x[0, i - w + 1] + 1) % c.vocab_size),
               implementation=impl)[0, i]
  assert U.max_abs(outside, base_logits) == 0.0
  assert U.max_abs(inside, base_logits) > 1e-3


@pytest.mark.parametrize("version", [2, 3])
def test_packed_segments_match_separate_sequences(version):
  """Two sequences packed in one row (segment ids 1 and 2, positions restarting at 0, then
  padding with segment id 0) give the logits of each sequence run alone (rows 1 and 2 of
  the same batch, right-padded)."""
  c = small_caps(gemma.Config.tiny(version))
  p = U.random_params(c, 13)
  la, lb, total = 11, 7, 20
  a, b = tokens_for(c, 14, (la,)), tokens_for(c, 15, (lb,))
  zeros = lambda n: jnp.zeros((n,), jnp.int32)
  x = jnp.stack([jnp.concatenate([a, b, zeros(total - la - lb)]),
                 jnp.concatenate([a, zeros(total - la)]), jnp.concatenate([b, zeros(total - lb)])])
  seg = np.zeros((3, total), np.int32)
  seg[0, :la], seg[0, la:la + lb], seg[1, :la], seg[2, :lb] = 1, 2, 1, 1
  pos = np.zeros((3, total), np.int32)
  pos[0, :la], pos[0, la:la + lb] = np.arange(la), np.arange(lb)
  pos[1], pos[2] = np.arange(total), np.arange(total)
  for implementation in (U.KERNEL_IMPL, "xla"):
    got = FORWARD(p, c, x, positions=jnp.asarray(pos), segment_ids=jnp.asarray(seg),
                  implementation=implementation)
    scale = float(jnp.max(jnp.abs(got[1:])))
    assert U.max_abs(got[0, :la], got[1, :la]) <= 2e-5 * scale
    assert U.max_abs(got[0, la:la + lb], got[2, :lb]) <= 2e-5 * scale


def test_linear_rope_scaling_divides_positions():
  """Gemma 3 4b's global layers: RoPE with linear scaling by f at position f * p is RoPE at
  position p (the angle is position / f * inv_freq)."""
  c = dataclasses.replace(gemma.Config.tiny(3), rope_scale_global=8.0)
  g = c.layer_types.index("global")
  x = jax.random.normal(jax.random.key(0), (2, 5, 3, c.head_dim), jnp.float32)
  pos = jnp.asarray(np.random.default_rng(16).integers(0, 4000, (2, 5)), jnp.int32)
  rope = jax.jit(layers.rope, static_argnums=(2, 3, 4))
  got = rope(x, 8 * pos, c, g, None)
  ref = jax.jit(lambda x, pos: jaxgpu.rope(x, pos, theta=c.rope_theta_global))(x, pos)
  assert U.max_abs(got, ref) <= 2e-4
  local = c.layer_types.index("local")
  ref = jax.jit(lambda x, pos: jaxgpu.rope(x, pos, theta=c.rope_theta_local))(x, pos)
  assert U.max_abs(rope(x, pos, c, local, None), ref) <= 1e-5


def test_remat_changes_nothing_but_memory():
  c = gemma.Config.tiny(3)
  p = U.random_params(c, 17)
  x = tokens_for(c, 18, (B, T + 1))
  grad = LOSS_GRAD
  l0, g0 = grad(p, c, x[:, :-1], x[:, 1:], remat=False)
  l1, g1 = grad(p, c, x[:, :-1], x[:, 1:], remat=True)
  assert abs(float(l0) - float(l1)) <= 1e-6 * abs(float(l0))
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
    assert U.max_abs(a, b) <= 1e-5 * max(float(jnp.max(jnp.abs(b))), 1e-30)


# ---- bad inputs ---------------------------------------------------------------------------


def test_bad_inputs_raise_value_errors_naming_the_argument():
  c = gemma.Config.tiny(2)
  p = U.random_params(c, 0)
  x = tokens_for(c, 19, (2, 5))
  with pytest.raises(ValueError, match="tokens"):
    gemma.forward(p, c, x.astype(jnp.float32))
  with pytest.raises(ValueError, match="tokens"):
    gemma.forward(p, c, x[0])
  with pytest.raises(ValueError, match="positions"):
    gemma.forward(p, c, x, positions=jnp.zeros((2, 4), jnp.int32))
  with pytest.raises(ValueError, match="segment_ids"):
    gemma.forward(p, c, x, segment_ids=jnp.zeros((5,), jnp.int32))
  with pytest.raises(ValueError, match="targets"):
    gemma.loss(p, c, x, x[:, :4])
  with pytest.raises(ValueError, match="mask"):
    gemma.loss(p, c, x, x, mask=jnp.ones((2, 4), bool))
  with pytest.raises(ValueError, match=r"params\['layers'\]\[1\]\['q'\]"):
    bad = jax.tree.map(lambda a: a, p)
    bad["layers"][1]["q"] = jnp.zeros((c.d_model, c.n_heads, c.head_dim + 2), jnp.float32)
    gemma.forward(bad, c, x)
  with pytest.raises(ValueError, match="layers"):
    gemma.forward({**p, "layers": p["layers"][:2]}, c, x)
