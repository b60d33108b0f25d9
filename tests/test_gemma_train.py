"""Training the Gemma model: the AdamW update, a few steps that lower the loss, and the
training step sharded over a ("data", "model") mesh of 8 fake CPU devices (the loss equals
the 1-device loss; the compiled step has only the collectives data and tensor parallelism
need)."""

from __future__ import annotations

import collections
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxgpu.models import gemma
from jaxgpu.models.gemma import sharding

import gemma_util as U
from gemma_util import exact_matmuls, kernels_at_every_size  # noqa: F401 (autouse fixtures)

KERNELS = U.KERNELS


def test_adamw_update_matches_the_formula():
  """Two steps of adamw_update against numpy: bias-corrected moments, decoupled weight decay
  on matrices only, global-norm clipping, a schedule."""
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.standard_normal((3, 4)), jnp.float32),
            "n": jnp.asarray(rng.standard_normal((4,)), jnp.float32)}
  grads = [{"w": jnp.asarray(rng.standard_normal((3, 4)), jnp.float32),
            "n": jnp.asarray(rng.standard_normal((4,)), jnp.float32)} for _ in range(2)]
  opt = gemma.AdamW(learning_rate=lambda step: 0.1 / (1.0 + step), b1=0.8, b2=0.9, eps=1e-6,
                    weight_decay=0.5, clip_norm=0.3)
  state = gemma.init_opt_state(params)
  p_np = {k: np.asarray(v, np.float64) for k, v in params.items()}
  mu = {k: np.zeros_like(v) for k, v in p_np.items()}
  nu = {k: np.zeros_like(v) for k, v in p_np.items()}
  for step, g in enumerate(grads):
    params, state, metrics = gemma.train.adamw_update(params, g, state, opt)
    g_np = {k: np.asarray(v, np.float64) for k, v in g.items()}
    norm = math.sqrt(sum(float(np.sum(v * v)) for v in g_np.values()))
    lr = 0.1 / (1.0 + step)
    for k in p_np:
      gk = g_np[k] * min(1.0, 0.3 / norm)
      mu[k] = 0.8 * mu[k] + 0.2 * gk
      nu[k] = 0.9 * nu[k] + 0.1 * gk * gk
      upd = mu[k] / (1 - 0.8 ** (step + 1)) / (np.sqrt(nu[k] / (1 - 0.9 ** (step + 1))) + 1e-6)
      if p_np[k].ndim >= 2:
        upd = upd + 0.5 * p_np[k]
      p_np[k] = p_np[k] - lr * upd
    assert abs(float(metrics["grad_norm"]) - norm) <= 1e-6 * norm
    assert abs(float(metrics["lr"]) - lr) <= 1e-7
  assert int(state["step"]) == 2
  for k in p_np:
    np.testing.assert_allclose(np.asarray(params[k]), p_np[k], rtol=2e-5, atol=2e-6)


def counting_batch(config, b, t, seed):
  """Rows of consecutive token ids (x, x + 1, ...): a rule a model can learn in a few steps."""
  start = np.random.default_rng(seed).integers(0, config.vocab_size, (b, 1))
  seq = (start + np.arange(t + 1)) % config.vocab_size
  return {"tokens": jnp.asarray(seq[:, :-1], jnp.int32),
          "targets": jnp.asarray(seq[:, 1:], jnp.int32)}


@pytest.mark.parametrize("kernels", KERNELS)
def test_a_few_train_steps_lower_the_loss(kernels):
  c = gemma.Config.tiny(3)
  params = U.random_params(c, 1, qk_gain=1.0)
  state = gemma.init_opt_state(params)
  opt = gemma.AdamW(learning_rate=1e-2, weight_decay=0.01, clip_norm=1.0)
  batch = counting_batch(c, 8, 16, 2)
  losses = []
  for _ in range(12):
    params, state, metrics = gemma.train_step(params, state, batch, config=c, optimizer=opt,
                                              implementation=kernels, remat=True)
    losses.append(float(metrics["loss"]))
  assert all(np.isfinite(losses))
  assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("version", [2, 3])
def test_float32_master_params_with_bf16_compute(version, kernels):
  """compute_dtype=bfloat16 with float32 parameters: the loss is the bfloat16 model's (the
  same values, computed in bfloat16), the parameters and moments stay float32 and keep
  updates smaller than a bfloat16 ulp, the norm weights' gradients reach AdamW unrounded."""
  c = gemma.Config.tiny(version)
  # Parameters exactly representable in bfloat16: every run starts from the same model
  # (fresh arrays each time: train_step donates its arguments).
  start = lambda dtype: U.cast(U.random_params(c, 5, dtype=jnp.bfloat16), dtype)
  p16 = jax.tree.map(np.asarray, start(jnp.bfloat16))
  opt = gemma.AdamW(learning_rate=1e-3, weight_decay=0.01, clip_norm=1.0)
  batch = counting_batch(c, 4, 12, 7)
  kw = dict(config=c, optimizer=opt, implementation=kernels)
  n16, s16, m16 = gemma.train_step(start(jnp.bfloat16), gemma.init_opt_state(p16), batch, **kw)
  p32 = start(jnp.float32)
  n32, s32, m32 = gemma.train_step(p32, gemma.init_opt_state(p32), batch,
                                   compute_dtype=jnp.bfloat16, **kw)
  p32 = start(jnp.float32)
  _, _, full32 = gemma.train_step(p32, gemma.init_opt_state(p32), batch, **kw)
  l16, l32 = float(m16["loss"]), float(m32["loss"])
  assert abs(l32 - l16) <= 1e-6 * abs(l16), (l32, l16)
  # ... and it was computed in bfloat16, not float32.
  assert abs(l32 - float(full32["loss"])) > 1e-6 * abs(l16), (l32, float(full32["loss"]))
  for tree in (n32, s32["mu"], s32["nu"]):
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(tree))
  # The norm weights' gradients were float32: their first moments are (1 - b1) g, and
  # bfloat16 gradients (the bfloat16 run's) would be rounded to 8 bits of mantissa.
  mu = np.asarray(s32["mu"]["final_norm"])
  assert np.any(mu.astype(jnp.bfloat16).astype(np.float32) != mu)
  # Updates of ~1e-3 are kept in float32 (the bfloat16 run rounds most of them away).
  moved = [np.mean(np.asarray(a) != np.asarray(b, np.float32))
           for a, b in zip(jax.tree.leaves(n32), jax.tree.leaves(p16))]
  assert min(moved) > 0.9, moved
  _, _, m16b = gemma.train_step(n16, s16, batch, **kw)
  _, _, m32b = gemma.train_step(n32, s32, batch, compute_dtype=jnp.bfloat16, **kw)
  assert float(m32b["loss"]) < l32
  assert abs(float(m32b["loss"]) - float(m16b["loss"])) <= 0.02 * l16


def test_check_params_takes_float32_norm_weights_only():
  """Beside bfloat16 matrices (compute_params' output), norm weights may be float32; a
  float32 matrix, or norm weights of another 16-bit dtype, are still errors."""
  c = gemma.Config.tiny(3)
  params = gemma.compute_params(U.random_params(c, 1), jnp.bfloat16)
  assert params["final_norm"].dtype == jnp.float32 and params["embed"].dtype == jnp.bfloat16
  gemma.check_params(params, c)
  layer = params["layers"][0]
  for name, dtype in (("q", jnp.float32), ("q_norm", jnp.float16)):
    bad = {**params, "layers": [{**layer, name: layer[name].astype(dtype)}]
           + params["layers"][1:]}
    with pytest.raises(ValueError, match=rf"\['layers'\]\[0\]\['{name}'\].*dtype"):
      gemma.check_params(bad, c)


def test_compute_dtype_rejects_integers():
  c = gemma.Config.tiny(2)
  params = U.random_params(c, 1)
  with pytest.raises(ValueError, match="compute_dtype"):
    gemma.compute_params(params, jnp.int32)


# ---- data + tensor parallelism on 8 CPU devices -------------------------------------------

B, T = 8, 12      # T differs from head_dim (16) so no activation has a parameter's shape
ALLOWED_KINDS = {"all-reduce", "reduce-scatter", "all-gather"}


def local_shape(shape, spec, mesh) -> tuple:
  spec = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
  return tuple(n // (sharding.axis_size(mesh, a) if a else 1) for n, a in zip(shape, spec))


def check_collectives(text, mesh, config, fsdp=False):
  """Only the collectives data, tensor and fully sharded data parallelism need, and each
  the right one:
    * kinds: all-reduce (and reduce-scatter / all-gather, which XLA may use in its place);
      no all-to-all or collective-permute;
    * groups: the "data" axis, the "model" axis, or all 8 devices (a replicated parameter's
      gradient summed over batch rows and heads), nothing else;
    * every parameter's gradient is reduced over "data" (its local size appears among the
      results of the all-reduces / reduce-scatters over "data" or all devices);
    * no all-gather of a parameter that is sharded over "model", and no all-reduce over
      "model" of a gradient that is sharded there (it would mean the partitioner replicated
      a parameter that should stay split);
    * with fsdp: every all-gather over "data" gathers one parameter's shard to its
      tensor-parallel shape (weights, never activations), and every fsdp-split parameter is
      gathered;
    * with a model axis: the tensor-parallel all-reduce of the (B/data, T, D) activations.
  """
  found = U.collectives(text)
  data, model = U.mesh_groups(mesh, "data"), U.mesh_groups(mesh, "model")
  everything = frozenset([frozenset(range(mesh.devices.size))])
  is_spec = lambda s: isinstance(s, P)
  tp_specs = jax.tree.leaves(gemma.param_specs(config, mesh), is_leaf=is_spec)
  specs = jax.tree.leaves(gemma.param_specs(config, mesh, fsdp), is_leaf=is_spec)
  shapes = jax.tree.leaves(gemma.param_shapes(config), is_leaf=lambda s: isinstance(s, tuple))
  split = [(s, sp) for s, sp in zip(shapes, tp_specs) if sharding.MODEL in tuple(sp)]
  split_full = {s for s, _ in split}
  split_local = {local_shape(s, sp, mesh) for s, sp in split}
  gathered = {local_shape(s, tp, mesh) for s, tp, sp in zip(shapes, tp_specs, specs)
              if sharding.DATA in tuple(sp)}
  model_size = sharding.axis_size(mesh, "model")
  reduced = {"all-reduce": collections.Counter(), "reduce-scatter": collections.Counter()}
  weight_gathers = set()
  tp_activation = False
  for c in found:
    assert c.kind in ALLOWED_KINDS, c.line
    assert c.groups in (data, model, everything), c.line
    if c.kind == "all-gather" and c.groups == data:
      assert fsdp and set(c.shapes) <= gathered, c.line
      weight_gathers |= set(c.shapes)
    elif c.kind == "all-gather":
      assert not set(c.shapes) & split_full, c.line
    if c.kind in ("all-reduce", "reduce-scatter") and c.groups in (data, everything):
      reduced[c.kind].update(math.prod(s) for s in c.shapes)
    if c.kind == "all-reduce" and c.groups == model and model_size > 1:
      assert not set(c.shapes) & split_local, c.line
      b_local = B // sharding.axis_size(mesh, "data")
      tp_activation |= (b_local, T, config.d_model) in c.shapes
  missing = []
  for s, tp, sp in zip(shapes, tp_specs, specs):
    # An fsdp-split gradient: a reduce-scatter to its shard, or (backends without XLA's
    # reduce-scatter rewrite, e.g. CPU) an all-reduce of its tensor-parallel shard, then a
    # slice. Any other gradient: an all-reduce of its shard.
    ways = [("all-reduce", math.prod(local_shape(s, tp, mesh)))]
    if sp != tp:
      ways.insert(0, ("reduce-scatter", math.prod(local_shape(s, sp, mesh))))
    way = next(((k, n) for k, n in ways if reduced[k][n] > 0), None)
    if way is None:
      missing.append(s)
    else:
      reduced[way[0]][way[1]] -= 1
  assert not missing, f"gradients of these parameters are not reduced over data: {missing}"
  assert weight_gathers == gathered, f"fsdp weights never gathered: {gathered - weight_gathers}"
  assert tp_activation or model_size == 1


def bare(spec) -> tuple:
  """A PartitionSpec without its trailing Nones (P() == P(None))."""
  spec = tuple(spec)
  while spec and spec[-1] is None:
    spec = spec[:-1]
  return spec


@pytest.mark.parametrize("version, shape, fsdp",
                         [(2, (4, 2), False), (3, (2, 4), False), (2, (8, 1), False),
                          (2, (4, 2), True), (3, (8, 1), True)],
                         ids=["gemma2-4x2", "gemma3-2x4", "gemma2-8x1", "gemma2-4x2-fsdp",
                              "gemma3-8x1-fsdp"])
def test_sharded_train_step_matches_one_device(version, shape, fsdp, cpu_devices):
  c = gemma.Config.tiny(version)
  mesh = jax.make_mesh(shape, ("data", "model"), devices=cpu_devices)
  opt = gemma.AdamW(learning_rate=1e-3, weight_decay=0.1, clip_norm=1.0)
  batch = counting_batch(c, B, T, 3)
  kw = dict(config=c, optimizer=opt, implementation="cpu")

  params = jax.device_put(U.random_params(c, 4), cpu_devices[0])
  state = gemma.init_opt_state(params)
  one = jax.device_put(batch, cpu_devices[0])
  params, state, m1 = gemma.train_step(params, state, one, **kw)
  _, _, m1b = gemma.train_step(params, state, one, **kw)

  params = gemma.shard_params(U.random_params(c, 4), c, mesh, fsdp=fsdp)
  state = gemma.init_opt_state(params)
  many = gemma.shard_batch(batch, mesh)
  step = gemma.train_step.lower(params, state, many, mesh=mesh, fsdp=fsdp, **kw).compile()
  check_collectives(step.as_text(), mesh, c, fsdp)
  params, state, m2 = step(params, state, many)
  specs = jax.tree.leaves(gemma.param_specs(c, mesh, fsdp), is_leaf=lambda s: isinstance(s, P))
  for got, mu, spec in zip(jax.tree.leaves(params), jax.tree.leaves(state["mu"]), specs):
    # The parameters and their moments stay where they were.
    assert bare(got.sharding.spec) == bare(mu.sharding.spec) == bare(spec), (got.shape, spec)
  _, _, m2b = step(params, state, many)
  for k in ("loss", "grad_norm"):
    assert abs(float(m2[k]) - float(m1[k])) <= 1e-5 * abs(float(m1[k])), k
  assert abs(float(m2b["loss"]) - float(m1b["loss"])) <= 1e-4 * abs(float(m1b["loss"]))


def test_sharded_master_params_with_bf16_compute(cpu_devices):
  """compute_dtype with fsdp x tensor parallelism on 8 devices: the collectives of the
  float32 step, float32 parameters that keep their sharding, and the 1-device loss (bfloat16
  compute: within bfloat16 rounding of it, the reduction orders differ)."""
  c = gemma.Config.tiny(2)
  mesh = jax.make_mesh((4, 2), ("data", "model"), devices=cpu_devices)
  opt = gemma.AdamW(learning_rate=1e-3, weight_decay=0.1, clip_norm=1.0)
  batch = counting_batch(c, B, T, 3)
  kw = dict(config=c, optimizer=opt, implementation="cpu", compute_dtype=jnp.bfloat16)
  params = jax.device_put(U.random_params(c, 4), cpu_devices[0])
  _, _, m1 = gemma.train_step(params, gemma.init_opt_state(params),
                              jax.device_put(batch, cpu_devices[0]), **kw)
  params = gemma.shard_params(U.random_params(c, 4), c, mesh, fsdp=True)
  state = gemma.init_opt_state(params)
  many = gemma.shard_batch(batch, mesh)
  step = gemma.train_step.lower(params, state, many, mesh=mesh, fsdp=True, **kw).compile()
  check_collectives(step.as_text(), mesh, c, fsdp=True)
  params, state, m2 = step(params, state, many)
  specs = jax.tree.leaves(gemma.param_specs(c, mesh, True), is_leaf=lambda s: isinstance(s, P))
  for got, spec in zip(jax.tree.leaves(params), specs):
    assert got.dtype == jnp.float32 and bare(got.sharding.spec) == bare(spec), (got.shape, spec)
  assert abs(float(m2["loss"]) - float(m1["loss"])) <= 2 ** -8 * abs(float(m1["loss"]))
