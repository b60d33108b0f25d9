"""jaxgpu/_kernel_op.py on its own: the shared vmap (group folding) and sharding rules,
with a tiny local_fn of plain jnp ops instead of an FFI call; then each extension point
with a toy op of its own, and the implementation context (jaxgpu/_implementation.py).

The op: y = x * scale (scale a "[g] d" parameter, shared when its group axis is 1) and
t = the per-group sum of x over rows (a "g d" reduction output, like a weight gradient).
The toys: a row log-sum-exp over a sharded vocabulary and decode attention over sharded
keys (outputs combined by log-sum-exp), a dequantize-and-multiply of packed int4 weights
(one factor K at three sizes), and a KV-cache write (an output aliasing an input).
"""

from __future__ import annotations

import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxgpu
from jaxgpu import _implementation
from jaxgpu._kernel_op import (LSE, Layout, LseWeighted, _plan, explicit_spec, grouped_call,
                               in_explicit_mode)

import oracle
from conftest import HAS_CUDA

AxisType = jax.sharding.AxisType

LAYOUT = Layout(inputs=("g ... d", "[g] d"), outputs=("g ... d", "g d"))


class Recorder:
  """local_fn that records the shapes it is traced with."""

  def __init__(self):
    self.seen: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

  def __call__(self, x, scale):
    self.seen.append((tuple(x.shape), tuple(scale.shape)))
    g, dim = x.shape[0], x.shape[-1]
    assert scale.shape[0] in (1, g) and scale.shape[-1] == dim, (x.shape, scale.shape)
    s = scale.reshape((scale.shape[0],) + (1,) * (x.ndim - 2) + (dim,))
    y = x * s
    t = x.reshape(g, -1, dim).sum(axis=1)
    return y, t


def row_scale(local_fn, x, scale):
  """The public-op pattern: add the group axis, call, drop it."""
  y, t = grouped_call(local_fn, LAYOUT, x[None], scale[None])
  return y[0], t[0]


def np_row_scale(x, scale):
  x = np.asarray(x, np.float64)
  s = np.asarray(scale, np.float64)
  return x * s, x.reshape(-1, x.shape[-1]).sum(0)


def assert_close(a, b, what=""):
  np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=1e-5, atol=1e-5, err_msg=what)


def _no_loops(jaxpr) -> bool:
  text = str(jaxpr)
  return not any(w in text for w in ("while[", "scan[", " while ", " scan "))


@pytest.fixture
def fn():
  return Recorder()


def test_plain_call(fn, rng):
  x = oracle.randn(rng, (3, 5, 7), jnp.float32)
  s = oracle.randn(rng, (7,), jnp.float32)
  y, t = jax.jit(lambda x, s: row_scale(fn, x, s))(x, s)
  y64, t64 = np_row_scale(x, s)
  assert y.shape == (3, 5, 7) and t.shape == (7,)
  assert_close(y, y64)
  assert_close(t, t64)


def test_explicit_groups(fn, rng):
  """Per-group parameters (G, D) and a shared one (1, D) broadcast over G."""
  x = oracle.randn(rng, (4, 3, 7), jnp.float32)
  s = oracle.randn(rng, (4, 7), jnp.float32)
  y, t = grouped_call(fn, LAYOUT, x, s)
  assert_close(y, np.asarray(x) * np.asarray(s)[:, None])
  assert_close(t, np.asarray(x).sum(1))
  y1, t1 = grouped_call(fn, LAYOUT, x, s[:1])
  assert_close(y1, np.asarray(x) * np.asarray(s)[:1, None])
  assert t1.shape == (4, 7)


def test_wrong_arg_count(fn):
  with pytest.raises(ValueError, match="expected 2 arrays"):
    grouped_call(fn, LAYOUT, jnp.ones((1, 2, 3)))


@pytest.mark.parametrize("x_axis", [0, 1, -1])
def test_vmap_rows_keeps_shared_parameter(fn, x_axis, rng):
  """x batched, scale not: the batch folds into the group axis (one call, no loop) and the
  shared scale stays (1, D), never copied per batch element."""
  B, R, D = 3, 5, 7
  shape = [R, D]
  shape.insert(x_axis % 3, B)
  x = oracle.randn(rng, tuple(shape), jnp.float32)
  s = oracle.randn(rng, (D,), jnp.float32)
  f = jax.vmap(lambda x, s: row_scale(fn, x, s), in_axes=(x_axis, None))
  assert _no_loops(jax.make_jaxpr(f)(x, s))
  y, t = jax.jit(f)(x, s)
  xs = np.moveaxis(np.asarray(x), x_axis, 0)
  for b in range(B):
    y64, t64 = np_row_scale(xs[b], s)
    assert_close(y[b], y64, f"y[{b}]")
    assert_close(t[b], t64, f"t[{b}] (per-group reduction under vmap)")
  assert fn.seen, "local_fn was not traced"
  assert all(sc[0] == 1 for _, sc in fn.seen), f"shared scale was broadcast: {fn.seen}"
  assert any(xs_[0] == B for xs_, _ in fn.seen), f"batch not folded into groups: {fn.seen}"


def test_vmap_parameter_only(fn, rng):
  """scale batched, x not: x is repeated per group (the output is B times larger anyway),
  the per-group sum is the same for every group."""
  B, R, D = 4, 5, 7
  x = oracle.randn(rng, (R, D), jnp.float32)
  s = oracle.randn(rng, (B, D), jnp.float32)
  f = jax.jit(jax.vmap(lambda x, s: row_scale(fn, x, s), in_axes=(None, 0)))
  y, t = f(x, s)
  assert y.shape == (B, R, D) and t.shape == (B, D)
  for b in range(B):
    y64, t64 = np_row_scale(x, s[b])
    assert_close(y[b], y64)
    assert_close(t[b], t64)
  assert _no_loops(jax.make_jaxpr(jax.vmap(lambda x, s: row_scale(fn, x, s),
                                           in_axes=(None, 0)))(x, s))


def test_vmap_both(fn, rng):
  B, R, D = 3, 4, 5
  x = oracle.randn(rng, (R, B, D), jnp.float32)
  s = oracle.randn(rng, (D, B), jnp.float32)
  y, t = jax.jit(jax.vmap(lambda x, s: row_scale(fn, x, s), in_axes=(1, 1)))(x, s)
  for b in range(B):
    y64, t64 = np_row_scale(np.asarray(x)[:, b], np.asarray(s)[:, b])
    assert_close(y[b], y64)
    assert_close(t[b], t64)
  assert all(sc[0] == xs[0] for xs, sc in fn.seen), fn.seen


def test_nested_vmap(fn, rng):
  """Two vmaps fold into one group axis: groups = B1 * B2, the scale batched by the outer
  one only."""
  B1, B2, R, D = 2, 3, 4, 5
  x = oracle.randn(rng, (B1, B2, R, D), jnp.float32)
  s = oracle.randn(rng, (B1, D), jnp.float32)
  inner = jax.vmap(lambda x, s: row_scale(fn, x, s), in_axes=(0, None))
  f = jax.vmap(inner, in_axes=(0, 0))
  assert _no_loops(jax.make_jaxpr(f)(x, s))
  y, t = jax.jit(f)(x, s)
  for i in range(B1):
    for j in range(B2):
      y64, t64 = np_row_scale(np.asarray(x)[i, j], np.asarray(s)[i])
      assert_close(y[i, j], y64)
      assert_close(t[i, j], t64)


BWD_LAYOUT = Layout(inputs=("g ... d", "g ... d", "[g] d"), outputs=("g ... d", "g d"))


def _bwd_local(dy, x, scale):
  s = scale.reshape((scale.shape[0],) + (1,) * (x.ndim - 2) + (x.shape[-1],))
  ds = (dy * x).reshape(x.shape[0], -1, x.shape[-1]).sum(axis=1)
  return dy * s, ds


def make_scaled(fn):
  """The ops' pattern: custom_vjp outside, grouped_call in the forward and backward rules
  (grouped_call alone has no differentiation rule: custom_partitioning has none)."""

  @jax.custom_vjp
  def scaled(x, s):
    return row_scale(fn, x, s)[0]

  def fwd(x, s):
    return scaled(x, s), (x, s)

  def bwd(res, dy):
    x, s = res
    dx, ds = grouped_call(_bwd_local, BWD_LAYOUT, dy[None], x[None], s[None])
    return dx[0], ds[0]

  scaled.defvjp(fwd, bwd)
  return scaled


def test_grouped_call_alone_is_not_differentiable(fn):
  """Hence custom_vjp outermost; the error says so (jaxgpu/_autodiff.py)."""
  with pytest.raises(TypeError, match="a derivative reached its FFI kernels"):
    jax.grad(lambda s: row_scale(fn, jnp.ones((2, 3)), s)[0].sum())(jnp.ones(3))


@pytest.mark.parametrize("s_axis", [None, 0])
def test_vmap_of_grad_per_example_reduction(fn, s_axis, rng):
  """vmap(grad) through a custom_vjp whose backward reduces over rows ("g d"): one
  parameter gradient per example, from one folded call."""
  B, R, D = 3, 4, 5
  scaled = make_scaled(fn)
  x = oracle.randn(rng, (B, R, D), jnp.float32)
  s = oracle.randn(rng, (D,) if s_axis is None else (B, D), jnp.float32)
  ct = oracle.randn(rng, (B, R, D), jnp.float32)
  grad = jax.grad(lambda x, s, c: jnp.sum(scaled(x, s) * c), argnums=(0, 1))
  f = jax.vmap(grad, in_axes=(0, s_axis, 0))
  assert _no_loops(jax.make_jaxpr(f)(x, s, ct))
  dx, ds = jax.jit(f)(x, s, ct)
  assert ds.shape == (B, D)
  xs, cs = np.asarray(x, np.float64), np.asarray(ct, np.float64)
  s64 = np.asarray(s, np.float64)
  assert_close(ds, (xs * cs).sum(1))
  assert_close(dx, cs * (s64 if s_axis is None else s64[:, None]))


def test_grad_of_vmap_sums_shared_parameter(fn, rng):
  B, R, D = 3, 4, 5
  scaled = make_scaled(fn)
  x = oracle.randn(rng, (B, R, D), jnp.float32)
  s = oracle.randn(rng, (D,), jnp.float32)
  ct = oracle.randn(rng, (B, R, D), jnp.float32)
  ds = jax.jit(jax.grad(lambda s: jnp.sum(jax.vmap(scaled, in_axes=(0, None))(x, s) * ct)))(s)
  assert_close(ds, (np.asarray(x, np.float64) * np.asarray(ct, np.float64)).sum((0, 1)))


# ---- sharding -------------------------------------------------------------------------------


def _mesh(cpu_devices, axis_type):
  t = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}[axis_type]
  return jax.make_mesh((4, 2), ("a", "b"), axis_types=(t, t), devices=cpu_devices)


def _run(mesh, axis_type, f):
  if axis_type == "explicit":
    with jax.set_mesh(mesh):
      return f()
  return f()


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_sharded_rows(fn, axis_type, cpu_devices, rng):
  """Row-sharded x: y keeps the sharding with no collective; the per-group reduction t is
  psum'ed inside the partitioned body (the only collective) and comes out replicated."""
  mesh = _mesh(cpu_devices, axis_type)
  x = oracle.randn(rng, (8, 6, 7), jnp.float32)
  s = oracle.randn(rng, (7,), jnp.float32)
  y64, t64 = np_row_scale(x, s)

  def run():
    xs = jax.device_put(x, NamedSharding(mesh, P("a", "b", None)))
    ss = jax.device_put(s, NamedSharding(mesh, P()))
    both = jax.jit(lambda x, s: row_scale(fn, x, s))
    y_only = jax.jit(lambda x, s: row_scale(fn, x, s)[0])
    y, t = both(xs, ss)
    types = (jax.typeof(y), jax.typeof(t))
    return (y, t, types, oracle.collectives(both.lower(xs, ss).compile().as_text()),
            oracle.collectives(y_only.lower(xs, ss).compile().as_text()))

  y, t, (ty, tt), both_coll, y_coll = _run(mesh, axis_type, run)
  assert_close(y, y64)
  assert_close(t, t64)
  assert y_coll == set(), y_coll
  assert both_coll == {"all-reduce"}, both_coll
  assert tuple(y.sharding.spec)[:2] == ("a", "b"), y.sharding
  assert all(a is None for a in tuple(t.sharding.spec)), t.sharding
  if axis_type == "explicit":
    assert ty.sharding.spec == P("a", "b", None), ty
    assert all(a is None for a in tt.sharding.spec), tt


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_sharded_replicated_factor(fn, axis_type, cpu_devices, rng):
  """A sharded 'd' (a factor listed in Layout.replicated) is gathered: still correct."""
  mesh = _mesh(cpu_devices, axis_type)
  x = oracle.randn(rng, (8, 6, 8), jnp.float32)
  s = oracle.randn(rng, (8,), jnp.float32)
  y64, t64 = np_row_scale(x, s)

  def run():
    xs = jax.device_put(x, NamedSharding(mesh, P("a", None, "b")))
    ss = jax.device_put(s, NamedSharding(mesh, P("b")))
    return jax.jit(lambda x, s: row_scale(fn, x, s))(xs, ss)

  y, t = _run(mesh, axis_type, run)
  assert_close(y, y64)
  assert_close(t, t64)


def test_sharded_groups_under_vmap(fn, cpu_devices, rng):
  """vmap inside jit with the vmapped axis sharded: groups shard like rows, no collective
  for y, and each example's reduction stays its own."""
  mesh = _mesh(cpu_devices, "auto")
  x = oracle.randn(rng, (4, 6, 7), jnp.float32)    # 4 examples over 'a'
  s = oracle.randn(rng, (4, 7), jnp.float32)
  xs = jax.device_put(x, NamedSharding(mesh, P("a", None, None)))
  ss = jax.device_put(s, NamedSharding(mesh, P("a", None)))
  f = jax.jit(jax.vmap(lambda x, s: row_scale(fn, x, s)))
  y, t = f(xs, ss)
  for b in range(4):
    y64, t64 = np_row_scale(x[b], s[b])
    assert_close(y[b], y64)
    assert_close(t[b], t64)
  assert oracle.collectives(f.lower(xs, ss).compile().as_text()) == set()


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_sharded_rows_grad(fn, axis_type, cpu_devices, rng):
  """The backward's row reduction ("g d") under row sharding: psum'ed, the only
  collective; dx keeps the row sharding."""
  mesh = _mesh(cpu_devices, axis_type)
  scaled = make_scaled(fn)
  x = oracle.randn(rng, (8, 6, 7), jnp.float32)
  s = oracle.randn(rng, (7,), jnp.float32)
  ct = oracle.randn(rng, (8, 6, 7), jnp.float32)

  def run():
    row = NamedSharding(mesh, P("a", "b", None))
    xs, cs = jax.device_put(x, row), jax.device_put(ct, row)
    ss = jax.device_put(s, NamedSharding(mesh, P()))
    g = jax.jit(jax.grad(lambda x, s, c: jnp.sum(scaled(x, s) * c), argnums=(0, 1)))
    return g(xs, ss, cs), oracle.collectives(g.lower(xs, ss, cs).compile().as_text())

  (dx, ds), coll = _run(mesh, axis_type, run)
  assert coll == {"all-reduce"}, coll
  assert tuple(dx.sharding.spec)[:2] == ("a", "b"), dx.sharding
  x64, c64 = np.asarray(x, np.float64), np.asarray(ct, np.float64)
  assert_close(ds, (x64 * c64).sum((0, 1)))
  assert_close(dx, c64 * np.asarray(s, np.float64))


def test_shard_map_keeps_varying_type(fn, cpu_devices, rng):
  """Inside shard_map the outputs of a grouped_call are varying over the axes their
  inputs vary over (what check_vma relies on)."""
  mesh = jax.make_mesh((8,), ("a",), axis_types=(AxisType.Auto,), devices=cpu_devices[:8])
  x = oracle.randn(rng, (8, 3, 5), jnp.float32)
  s = oracle.randn(rng, (5,), jnp.float32)
  seen = {}

  def body(x, s):
    y, t = row_scale(fn, x, s)
    seen["y"], seen["t"], seen["x"] = jax.typeof(y), jax.typeof(t), jax.typeof(x)
    return y, t[None]

  try:
    from jax import shard_map
  except ImportError:  # older jax
    from jax.experimental.shard_map import shard_map  # type: ignore
  y, t = jax.jit(shard_map(body, mesh=mesh, in_specs=(P("a"), P()),
                           out_specs=(P("a"), P("a"))))(x, s)
  assert oracle.varying_axes(seen["x"]) == {"a"}, seen
  assert oracle.varying_axes(seen["y"]) == {"a"}, seen
  assert oracle.varying_axes(seen["t"]) == {"a"}, seen
  assert_close(y, np_row_scale(x, s)[0])
  assert_close(t, np.asarray(x, np.float64).sum(1))


# ---- public helpers -------------------------------------------------------------------------


def test_explicit_spec_and_mode(cpu_devices):
  """explicit_spec reads the sharding in an array's type, which only Explicit mesh axes put
  there; in_explicit_mode says whether the type's mesh has one."""
  x = jnp.ones((8, 4), jnp.float32)
  assert explicit_spec(x) == (None, None) and not in_explicit_mode(x)
  auto = _mesh(cpu_devices, "auto")
  xa = jax.device_put(x, NamedSharding(auto, P("a", "b")))
  assert explicit_spec(xa) == (None, None) and not in_explicit_mode(xa)
  explicit = _mesh(cpu_devices, "explicit")
  xe = jax.device_put(x, NamedSharding(explicit, P("a")))
  assert explicit_spec(xe) == ("a", None) and in_explicit_mode(xe)
  with jax.set_mesh(explicit):
    seen = {}

    def f(x):
      seen["spec"], seen["mode"] = explicit_spec(x), in_explicit_mode(x)
      return x

    jax.jit(f)(xe)
  assert seen == {"spec": ("a", None), "mode": True}, seen


# ---- outputs combined by log-sum-exp --------------------------------------------------------
#
# A vocabulary-parallel LM head's normalizer: each shard's log-sum-exp over its vocabulary
# slice, combined across shards. Rows 0 and 1 hold -inf over part of the vocabulary (some
# shards see nothing) and over all of it (the result is -inf, not NaN).

LSE_LAYOUT = Layout(inputs=("g ... v",), outputs=("g ...",), replicated=frozenset(),
                    combine={0: LSE})


def _row_lse(x):
  return (jax.nn.logsumexp(x, axis=-1),)


def _masked_logits(rng, shape):
  x = np.asarray(oracle.randn(rng, shape, jnp.float32)) * 4
  x[..., 0, : shape[-1] * 5 // 8] = -np.inf
  x[..., 1, :] = -np.inf
  return jnp.asarray(x)


def np_row_lse(x):
  x = np.asarray(x, np.float64)
  top = np.max(x, axis=-1, keepdims=True)
  top = np.where(np.isfinite(top), top, 0)
  with np.errstate(divide="ignore"):
    return (top + np.log(np.sum(np.exp(x - top), axis=-1, keepdims=True)))[..., 0]


def assert_close_inf(a, b, what=""):
  """assert_close where -inf must match exactly (and NaN never passes)."""
  a = np.asarray(a, np.float64)
  assert not np.isnan(a).any(), what
  np.testing.assert_array_equal(np.isneginf(a), np.isneginf(b), err_msg=what)
  finite = np.isfinite(b)
  assert_close(a[finite], b[finite], what)


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
@pytest.mark.parametrize("vocab_axes", ["b", ("a", "b")])
def test_lse_combine_sharded_vocab(axis_type, vocab_axes, cpu_devices, rng):
  """The vocabulary sharded over 2 or 8 devices: each shard's lse is all-gathered and
  combined locally, the only collective; rows keep their sharding."""
  mesh = _mesh(cpu_devices, axis_type)
  x = _masked_logits(rng, (8, 16))
  rows = "a" if vocab_axes == "b" else None
  seen = []

  def row_lse(x):
    seen.append(x.shape)
    return _row_lse(x)

  f = jax.jit(lambda x: grouped_call(row_lse, LSE_LAYOUT, x[None])[0][0])

  def run():
    xs = jax.device_put(x, NamedSharding(mesh, P(rows, vocab_axes)))
    return f(xs), oracle.collectives(f.lower(xs).compile().as_text())

  lse, coll = _run(mesh, axis_type, run)
  assert_close_inf(lse, np_row_lse(x))
  assert coll == {"all-gather"}, coll
  assert (1, 2, 8) in seen if vocab_axes == "b" else (1, 8, 2) in seen, seen   # shards
  assert (tuple(lse.sharding.spec) + (None,))[0] == rows, lse.sharding   # rows keep theirs


def test_lse_combine_under_vmap(cpu_devices, rng):
  """vmap over a batch of logits inside jit, the vocabulary sharded: the batch folds into
  the group axis and the lse combine still needs one all-gather."""
  mesh = _mesh(cpu_devices, "auto")
  x = _masked_logits(rng, (3, 4, 16))
  xs = jax.device_put(x, NamedSharding(mesh, P(None, None, ("a", "b"))))
  f = jax.jit(jax.vmap(lambda x: grouped_call(_row_lse, LSE_LAYOUT, x[None])[0][0]))
  assert _no_loops(jax.make_jaxpr(f)(xs))
  assert_close_inf(f(xs), np_row_lse(x))
  assert oracle.collectives(f.lower(xs).compile().as_text()) == {"all-gather"}


# Decode attention with the keys sharded: each shard attends over its own keys and returns
# its normalized output o_i with its lse_i; o = sum_i exp(lse_i - lse) o_i. The bias masks
# (-inf) keys: row 0 sees keys in the first shard only, row 1 sees none.

# On a GPU float32 products default to TF32 (~1e-4 relative): the toys ask for float32.
_HIGHEST = jax.lax.Precision.HIGHEST

PAIR_LAYOUT = Layout(inputs=("g t h", "g s h", "g s h", "g t s"), outputs=("g t h", "g t"),
                     replicated=frozenset({"h"}), combine={0: LseWeighted(lse=1), 1: LSE})


def _local_attention(q, k, v, bias):
  s = jnp.einsum("gth,gsh->gts", q, k, precision=_HIGHEST) + bias
  lse = jax.nn.logsumexp(s, axis=-1)
  # A row that sees no key here: weights 0, output 0 (what the attention kernels return).
  p = jnp.where(jnp.isfinite(lse)[..., None], jnp.exp(s - lse[..., None]), 0)
  return jnp.einsum("gts,gsh->gth", p, v, precision=_HIGHEST), lse


def np_attention(q, k, v, bias):
  q, k, v, bias = (np.asarray(a, np.float64) for a in (q, k, v, bias))
  s = q @ k.T + bias
  lse = np_row_lse(s)
  with np.errstate(invalid="ignore"):
    p = np.where(np.isfinite(lse)[:, None], np.exp(s - lse[:, None]), 0)
  return p @ v, lse


def _attention_inputs(rng, t=6, s=16, h=4):
  q, k, v = (oracle.randn(rng, shape, jnp.float32) for shape in ((t, h), (s, h), (s, h)))
  bias = np.zeros((t, s), np.float32)
  bias[0, s // 8:] = -np.inf
  bias[1, :] = -np.inf
  return q, k, v, jnp.asarray(bias)


def _decode(q, k, v, bias):
  o, lse = grouped_call(_local_attention, PAIR_LAYOUT, q[None], k[None], v[None], bias[None])
  return o[0], lse[0]


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_lse_weighted_pair_sharded_keys(axis_type, cpu_devices, rng):
  """Keys sharded over all 8 devices: one all-gather (the lse) and one all-reduce (the
  weighted outputs), nothing else; rows where some or all shards see nothing are exact."""
  mesh = _mesh(cpu_devices, axis_type)
  q, k, v, bias = _attention_inputs(rng)
  o64, lse64 = np_attention(q, k, v, bias)
  f = jax.jit(_decode)

  def run():
    keys = NamedSharding(mesh, P(("a", "b"), None))
    args = (jax.device_put(q, NamedSharding(mesh, P())), jax.device_put(k, keys),
            jax.device_put(v, keys), jax.device_put(bias, NamedSharding(mesh, P(None, ("a", "b")))))
    return f(*args), oracle.collectives(f.lower(*args).compile().as_text())

  (o, lse), coll = _run(mesh, axis_type, run)
  assert_close_inf(lse, lse64, "lse")
  assert_close(o, o64, "o")
  assert coll == {"all-gather", "all-reduce"}, coll


def test_lse_weighted_pair_rows_and_keys(cpu_devices, rng):
  """Rows over 'a', keys over 'b': the combine runs over 'b' only."""
  mesh = _mesh(cpu_devices, "auto")
  q, k, v, bias = _attention_inputs(rng, t=8)
  o64, lse64 = np_attention(q, k, v, bias)
  args = (jax.device_put(q, NamedSharding(mesh, P("a", None))),
          jax.device_put(k, NamedSharding(mesh, P("b", None))),
          jax.device_put(v, NamedSharding(mesh, P("b", None))),
          jax.device_put(bias, NamedSharding(mesh, P("a", "b"))))
  f = jax.jit(_decode)
  o, lse = f(*args)
  assert_close_inf(lse, lse64, "lse")
  assert_close(o, o64, "o")
  assert tuple(o.sharding.spec)[:1] == ("a",), o.sharding
  assert oracle.collectives(f.lower(*args).compile().as_text()) == {"all-gather", "all-reduce"}


def test_lse_weighted_pair_under_vmap(cpu_devices, rng):
  """vmap over decode steps (q and bias batched, the sharded keys shared)."""
  mesh = _mesh(cpu_devices, "auto")
  steps = [_attention_inputs(rng) for _ in range(3)]
  q = jnp.stack([s[0] for s in steps])
  bias = jnp.stack([s[3] for s in steps])
  _, k, v, _ = steps[0]
  keys = NamedSharding(mesh, P(("a", "b"), None))
  ks, vs = jax.device_put(k, keys), jax.device_put(v, keys)
  bs = jax.device_put(bias, NamedSharding(mesh, P(None, None, ("a", "b"))))
  f = jax.jit(jax.vmap(_decode, in_axes=(0, None, None, 0)))
  assert _no_loops(jax.make_jaxpr(f)(q, ks, vs, bs))
  o, lse = f(q, ks, vs, bs)
  for i in range(3):
    o64, lse64 = np_attention(q[i], k, v, bias[i])
    assert_close_inf(lse[i], lse64, f"lse[{i}]")
    assert_close(o[i], o64, f"o[{i}]")
  assert oracle.collectives(f.lower(q, ks, vs, bs).compile().as_text()) == {"all-gather",
                                                                          "all-reduce"}


def test_combine_layout_errors():
  with pytest.raises(ValueError, match="whose kind must be 'lse'"):
    Layout(inputs=("g t",), outputs=("g t", "g t"), combine={0: LseWeighted(lse=1)})
  with pytest.raises(ValueError, match="no output 2"):
    Layout(inputs=("g t",), outputs=("g t",), combine={2: LSE})
  with pytest.raises(ValueError, match="expected 'sum'"):
    Layout(inputs=("g t",), outputs=("g t",), combine={0: "max"})


# ---- blocked factors: one logical K at several sizes -------------------------------------------
#
# A dequantize-and-multiply toy: y = x @ (unpack(w) * scale), with the weight's K rows packed
# two int4 values a byte ((K/2, N) uint8) and one scale per group of GROUP rows ((K/GROUP, N)).
# x has K columns: three sizes of one factor, all split block-wise by a sharding of K.

GROUP = 8
QUANT_LAYOUT = Layout(inputs=("g m k", "g k n", "g k n"), outputs=("g m n",),
                      replicated=frozenset(), blocked=frozenset({"k"}))


def _unpack_int4(packed):
  """(G, K/2, N) uint8 -> (G, K, N) int32 in [-8, 7]: row 2j the low nibble of byte j."""
  lo = (packed & 0xF).astype(jnp.int32) - 8
  hi = (packed >> 4).astype(jnp.int32) - 8
  g, half, n = packed.shape
  return jnp.stack([lo, hi], axis=2).reshape(g, 2 * half, n)


class QuantRecorder:
  """local_fn of the toy; asserts that every call sees the same rows of x, w and scales."""

  def __init__(self):
    self.seen: list[tuple[int, int, int]] = []

  def __call__(self, x, packed, scales):
    k = x.shape[-1]
    self.seen.append((k, packed.shape[1], scales.shape[1]))
    assert k == 2 * packed.shape[1] == GROUP * scales.shape[1], self.seen[-1]
    w = _unpack_int4(packed).astype(jnp.float32) * jnp.repeat(scales, GROUP, axis=1)
    return (jnp.einsum("gmk,gkn->gmn", x, w, precision=_HIGHEST),)


def _quant_matmul(fn, x, packed, scales):
  return grouped_call(fn, QUANT_LAYOUT, x[None], packed[None], scales[None])[0][0]


def _quant_inputs(rng, m=4, k=64, n=16):
  x = oracle.randn(rng, (m, k), jnp.float32)
  packed = jnp.asarray(rng.integers(0, 256, (k // 2, n), dtype=np.uint8))
  scales = jnp.asarray(rng.uniform(0.5, 2.0, (k // GROUP, n)).astype(np.float32))
  return x, packed, scales


def np_dequantize(packed, scales):
  p = np.asarray(packed).astype(np.int64)
  w = np.empty((2 * p.shape[0], p.shape[1]))
  w[0::2], w[1::2] = (p & 0xF) - 8, (p >> 4) - 8
  return w * np.repeat(np.asarray(scales, np.float64), GROUP, axis=0)


def assert_quant_close(y, x, packed, scales, what=""):
  """Against float64, within float32 accumulation error: a sum of K products is off by
  about K * 2^-24 of the sum of their magnitudes, whatever the cancellation."""
  x64, w64 = np.asarray(x, np.float64), np_dequantize(packed, scales)
  bound = np.abs(x64) @ np.abs(w64)
  err = np.abs(np.asarray(y, np.float64) - x64 @ w64)
  assert (err <= 1e-5 * bound).all(), (what, float((err / bound).max()))


def test_blocked_rule():
  """Shardy sees K as compound factors: k (the block count, K/GROUP) is the major part of
  x's K and of the packed rows, so a sharding of either splits the scales alike."""
  x, packed, scales = (jnp.zeros(s, d) for s, d in (((1, 4, 64), jnp.float32),
                                                    ((1, 32, 16), jnp.uint8),
                                                    ((1, 8, 16), jnp.float32)))
  rule, sizes = _plan(QuantRecorder(), QUANT_LAYOUT, (x, packed, scales)).rule()
  assert rule == "g m (k k_x8), g (k k_x4) n, g k n -> g m n", rule
  assert sizes == {"k_x8": 8, "k_x4": 4}, sizes


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
@pytest.mark.parametrize("sharded", ["x", "weights", "all", "all8"])
def test_blocked_sharded_k(sharded, axis_type, cpu_devices, rng):
  """K sharded in x, in the weight and scales, or in all three (over 4 or 8 devices): each
  shard gets the same logical rows of all three (checked in local_fn), and the partial
  products are all-reduced, the only collective."""
  mesh = _mesh(cpu_devices, axis_type)
  fn = QuantRecorder()
  x, packed, scales = _quant_inputs(rng)
  k_axes = ("a", "b") if sharded == "all8" else "a"
  x_spec = P() if sharded == "weights" else P(None, k_axes)
  w_spec = P() if sharded == "x" else P(k_axes, None)
  f = jax.jit(lambda x, p, s: _quant_matmul(fn, x, p, s))

  def run():
    args = (jax.device_put(x, NamedSharding(mesh, x_spec)),
            jax.device_put(packed, NamedSharding(mesh, w_spec)),
            jax.device_put(scales, NamedSharding(mesh, w_spec)))
    return f(*args), oracle.collectives(f.lower(*args).compile().as_text())

  y, coll = _run(mesh, axis_type, run)
  assert_quant_close(y, x, packed, scales)
  assert coll == {"all-reduce"}, coll
  shards = 8 if sharded == "all8" else 4
  assert (64 // shards, 32 // shards, 8 // shards) in fn.seen, fn.seen


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_blocked_sharded_n(axis_type, cpu_devices, rng):
  """N sharded in the weight and scales: no collective, y keeps the sharding of N."""
  mesh = _mesh(cpu_devices, axis_type)
  fn = QuantRecorder()
  x, packed, scales = _quant_inputs(rng)
  f = jax.jit(lambda x, p, s: _quant_matmul(fn, x, p, s))

  def run():
    w = NamedSharding(mesh, P(None, "b"))
    args = (jax.device_put(x, NamedSharding(mesh, P())), jax.device_put(packed, w),
            jax.device_put(scales, w))
    return f(*args), oracle.collectives(f.lower(*args).compile().as_text())

  y, coll = _run(mesh, axis_type, run)
  assert_quant_close(y, x, packed, scales)
  assert coll == set(), coll
  assert tuple(y.sharding.spec) == (None, "b"), y.sharding


def test_blocked_never_splits_a_block(cpu_devices, rng):
  """K = 32 is 4 blocks of GROUP rows, asked to be split over 8 devices: the factor keeps
  only mesh axes whose size divides the block count (local_fn asserts that x, w and scales
  hold the same logical rows), and the result is right."""
  mesh = _mesh(cpu_devices, "auto")
  fn = QuantRecorder()
  x, packed, scales = _quant_inputs(rng, k=32)
  args = (jax.device_put(x, NamedSharding(mesh, P(None, ("a", "b")))),
          jax.device_put(packed, NamedSharding(mesh, P(("a", "b"), None))),
          jax.device_put(scales, NamedSharding(mesh, P())))
  y = jax.jit(lambda x, p, s: _quant_matmul(fn, x, p, s))(*args)
  assert_quant_close(y, x, packed, scales)
  assert all(scale_rows >= 1 for _, _, scale_rows in fn.seen), fn.seen


def test_blocked_under_vmap(rng):
  """vmap over activations (one weight shared) and over weights: folded, no loop."""
  fn = QuantRecorder()
  xs = [_quant_inputs(rng) for _ in range(3)]
  x = jnp.stack([a[0] for a in xs])
  packed = jnp.stack([a[1] for a in xs])
  scales = jnp.stack([a[2] for a in xs])
  f = jax.vmap(lambda x, p, s: _quant_matmul(fn, x, p, s), in_axes=(0, None, None))
  assert _no_loops(jax.make_jaxpr(f)(x, packed[0], scales[0]))
  y = jax.jit(f)(x, packed[0], scales[0])
  g = jax.jit(jax.vmap(lambda x, p, s: _quant_matmul(fn, x, p, s)))(x, packed, scales)
  for i in range(3):
    assert_quant_close(y[i], x[i], packed[0], scales[0], f"y[{i}]")
    assert_quant_close(g[i], x[i], packed[i], scales[i], f"g[{i}]")


# ---- aliased outputs: in-place cache writes ---------------------------------------------------
#
# A KV-cache update: rows (G, T, H) written into cache (G, S, H) at a per-group position,
# the new cache returned in place of the old (aliases {0: 0}). S and T are replicated: the
# local_fn indexes whole sequences.

CACHE_LAYOUT = Layout(inputs=("g s h", "g t h", "g"), outputs=("g s h",),
                      replicated=frozenset({"s", "t"}), aliases={0: 0})


def _write_rows(cache, rows, pos):
  def write(c, r, p):
    return jax.lax.dynamic_update_slice(c, r, (p, 0))

  return (jax.vmap(write)(cache, rows, pos),)


def write_cache(cache, rows, pos):
  """cache (B, S, H), rows (B, T, H), pos (B,) int32 -> the updated cache."""
  return grouped_call(_write_rows, CACHE_LAYOUT, cache, rows, pos)[0]


def np_write_cache(cache, rows, pos):
  out = np.array(cache)
  for b, p in enumerate(np.asarray(pos)):
    out[b, p:p + rows.shape[1]] = rows[b]
  return out


def _cache_inputs(rng, b=8, s=12, t=3, h=4):
  cache = oracle.randn(rng, (b, s, h), jnp.float32)
  rows = oracle.randn(rng, (b, t, h), jnp.float32)
  pos = jnp.asarray(rng.integers(0, s - t + 1, (b,)), jnp.int32)
  return cache, rows, pos


def test_alias_plain_and_donated(rng):
  """Under jit the result is right, and with the cache donated the compiled module aliases
  its buffer to the result."""
  cache, rows, pos = _cache_inputs(rng)
  want = np_write_cache(cache, rows, pos)
  assert_close(jax.jit(write_cache)(cache, rows, pos), want)
  donated = jax.jit(write_cache, donate_argnums=0)
  hlo = donated.lower(cache, rows, pos).compile().as_text()
  assert "input_output_alias" in hlo, hlo[:2000]
  assert_close(donated(jnp.array(cache), rows, pos), want)


@pytest.mark.parametrize("in_axes", [(0, 0, 0), (0, 0, None), (None, 0, 0), (1, None, None)])
def test_alias_under_vmap(in_axes, rng):
  """vmap folds the batch into the group axis: the aliased output keeps the folded input's
  shape (an unbatched cache is copied per batch element: each gets its own writes)."""
  n = 3
  draws = [_cache_inputs(rng, b=2) for _ in range(n)]
  args = tuple(draws[0][k] if ax is None else jnp.stack([d[k] for d in draws], axis=ax)
               for k, ax in enumerate(in_axes))
  f = jax.vmap(write_cache, in_axes=in_axes)
  assert _no_loops(jax.make_jaxpr(f)(*args))
  out = jax.jit(f)(*args)
  assert out.shape == (n,) + draws[0][0].shape
  for i in range(n):
    c, r, p = (a if ax is None else np.take(np.asarray(a), i, axis=ax)
               for a, ax in zip(args, in_axes))
    assert_close(out[i], np_write_cache(c, r, p), f"[{i}]")


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
@pytest.mark.parametrize("cache_spec,rows_spec", [(P("a", None, "b"), P("b", None, "a")),
                                                  (P(), P("a", None, "b"))])
def test_alias_sharded_keeps_input_sharding(cache_spec, rows_spec, axis_type, cpu_devices, rng):
  """Rows sharded unlike the cache (or the cache not sharded at all): the aliased cache's
  sharding wins, the output has exactly the input's, donation still aliases the buffer,
  and the rows are moved to the cache's sharding (no reduction collective)."""
  mesh = _mesh(cpu_devices, axis_type)
  cache, rows, pos = _cache_inputs(rng)
  want = np_write_cache(cache, rows, pos)
  donated = jax.jit(write_cache, donate_argnums=0)

  def run():
    cs = jax.device_put(cache, NamedSharding(mesh, cache_spec))
    rs = jax.device_put(rows, NamedSharding(mesh, rows_spec))
    ps = jax.device_put(pos, NamedSharding(mesh, P()))
    hlo = donated.lower(cs, rs, ps).compile().as_text()
    return donated(cs, rs, ps), hlo

  out, hlo = _run(mesh, axis_type, run)
  assert_close(out, want)
  padded = tuple(cache_spec) + (None,) * (3 - len(cache_spec))
  assert tuple(out.sharding.spec) + (None,) * (3 - len(out.sharding.spec)) == padded, out.sharding
  assert "input_output_alias" in hlo
  assert "all-reduce" not in oracle.collectives(hlo)


def test_alias_sharded_cache_only(cpu_devices, rng):
  """Cache and rows sharded alike: no collective at all."""
  mesh = _mesh(cpu_devices, "auto")
  cache, rows, pos = _cache_inputs(rng)
  spec = NamedSharding(mesh, P("a", None, "b"))
  args = (jax.device_put(cache, spec), jax.device_put(rows, spec),
          jax.device_put(pos, NamedSharding(mesh, P("a"))))
  f = jax.jit(write_cache, donate_argnums=0)
  hlo = f.lower(*args).compile().as_text()
  out = f(*args)
  assert_close(out, np_write_cache(cache, rows, pos))
  assert oracle.collectives(hlo) == set(), oracle.collectives(hlo)
  assert out.sharding.spec == P("a", None, "b") and "input_output_alias" in hlo


def test_alias_reaches_the_ffi_call(cpu_devices, rng):
  """An FFI kernel run in place (the CPU relu, elementwise) through grouped_call: after
  partitioning, its custom call still aliases its output to its operand."""
  from jaxgpu import _ffi
  _ffi.registered_targets()
  target = _ffi.target_name("jaxgpu_relu_fwd", "cpu")
  layout = Layout(inputs=("g ...",), outputs=("g ...",), replicated=frozenset(),
                  aliases={0: 0})

  def relu_in_place(x):
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return (jax.ffi.ffi_call(target, out, input_output_aliases={0: 0})(x),)

  mesh = _mesh(cpu_devices, "auto")
  x = jax.device_put(oracle.randn(rng, (8, 6), jnp.float32), NamedSharding(mesh, P("a", "b")))
  want = np.maximum(np.asarray(x), 0)
  f = jax.jit(lambda x: grouped_call(relu_in_place, layout, x[None])[0][0], donate_argnums=0)
  hlo = f.lower(x).compile().as_text()
  line = next(ln for ln in hlo.splitlines() if target in ln)
  assert "output_to_operand_aliasing" in line, line
  assert "input_output_alias" in hlo
  y = f(x)
  assert_close(y, want)
  assert y.sharding.spec == P("a", "b")


def test_alias_errors():
  with pytest.raises(ValueError, match="one factor string"):
    Layout(inputs=("g s h", "g t h"), outputs=("g t h",), aliases={0: 0})
  with pytest.raises(ValueError, match="without '\\[g\\]'"):
    Layout(inputs=("[g] d",), outputs=("[g] d",), aliases={0: 0})
  with pytest.raises(ValueError, match=r"lacks the input factors \['t'\]"):
    Layout(inputs=("g s h", "g t h"), outputs=("g s h",), replicated=frozenset({"s"}),
           aliases={0: 0})
  with pytest.raises(ValueError, match="aliases two inputs"):
    Layout(inputs=("g d", "g d"), outputs=("g d",), aliases={0: 0, 1: 0})
  wrong_dtype = Layout(inputs=("g d",), outputs=("g d",), aliases={0: 0})
  with pytest.raises(ValueError, match="aliases input 0"):
    grouped_call(lambda x: (x.astype(jnp.int32),), wrong_dtype, jnp.ones((2, 3)))


# ---- the implementation context -----------------------------------------------------------


@pytest.fixture
def no_env_choice(monkeypatch):
  monkeypatch.delenv(_implementation.ENV_VAR, raising=False)


def _kernel_targets(f, *args) -> set[str]:
  hlo = jax.jit(f).lower(*args).compile().as_text()
  return {t for t in re.findall(r'custom_call_target="([^"]+)"', hlo) if t.startswith("jaxgpu_")}


def test_context_chooses_the_traced_targets(implementation, no_env_choice, rng):
  """Ops traced in the block lower to the chosen implementation's targets (forward and
  backward); outside it, to the default (the platform-generic target)."""
  x = oracle.randn(rng, (4, 59), jnp.float32)
  def fwd(x):
    return jaxgpu.rms_norm(x)

  bwd = jax.grad(lambda x: jaxgpu.rms_norm(x).sum())
  with jaxgpu.implementation(implementation):
    inside, grad_inside = _kernel_targets(fwd, x), _kernel_targets(bwd, x)
    y = jaxgpu.rms_norm(x)   # un-jitted calls too
  if implementation == "xla":
    assert inside == set() and grad_inside == set(), (inside, grad_inside)
  else:
    assert f"jaxgpu_rms_norm_fwd_{implementation}" in inside, inside
    assert f"jaxgpu_rms_norm_bwd_{implementation}" in grad_inside, grad_inside
  outside = _kernel_targets(lambda x: jaxgpu.rms_norm(x), x)
  assert "jaxgpu_rms_norm_fwd" in outside, outside
  oracle.check(y, oracle.np_rms_norm(x)[0], oracle.jnp_rms_norm(x)[0], what="in the block")


def test_context_is_read_at_trace_time(no_env_choice, rng):
  """As documented: a function traced in a block keeps that choice outside it (jax.jit
  caches the trace per function), and a new function object is traced afresh."""
  x = oracle.randn(rng, (4, 59), jnp.float32)

  def fwd(x):
    return jaxgpu.rms_norm(x)

  with jaxgpu.implementation("xla"):
    jax.jit(fwd)(x)
  assert _kernel_targets(fwd, x) == set()
  assert "jaxgpu_rms_norm_fwd" in _kernel_targets(lambda x: fwd(x), x)


def test_context_nesting_and_precedence(no_env_choice, monkeypatch):
  """The explicit argument > the innermost block > the environment variable > the default;
  None undoes the enclosing blocks; leaving a block (even by an exception) restores."""
  resolve = _implementation.resolve
  kernel = "cuda" if HAS_CUDA else "cpu"
  default = resolve(None)
  with jaxgpu.implementation("xla"):
    assert resolve(None) == "xla"
    assert resolve(kernel) == kernel
    with jaxgpu.implementation(kernel):
      assert resolve(None) == kernel
      assert resolve("xla") == "xla"
      with jaxgpu.implementation(None):
        assert resolve(None) == default
      assert resolve(None) == kernel
    with pytest.raises(RuntimeError, match="inside"), jaxgpu.implementation(kernel):
      raise RuntimeError("inside")
    assert resolve(None) == "xla"
  assert resolve(None) == default

  monkeypatch.setenv(_implementation.ENV_VAR, "xla")
  assert resolve(None) == "xla"
  with jaxgpu.implementation(kernel):
    assert resolve(None) == kernel
    with jaxgpu.implementation(None):
      assert resolve(None) == "xla"

  @jaxgpu.implementation(kernel)
  def decorated():
    return resolve(None)

  assert decorated() == kernel and decorated() == kernel
  assert resolve(None) == "xla"


def test_context_bad_value(no_env_choice):
  for bad in ("bogus", "CUDA", "", 0):
    with pytest.raises(ValueError, match="implementation"), jaxgpu.implementation(bad):
      pass
  assert _implementation._scoped.get() is None   # a refused block leaves no choice behind


@pytest.mark.skipif(HAS_CUDA, reason="this machine has a CUDA backend")
def test_context_cuda_without_gpu(no_env_choice):
  """'cuda' is a valid name, so entering the block works; an op traced in it cannot run."""
  with (jaxgpu.implementation("cuda"),
        pytest.raises(ValueError, match="implementation='cuda' cannot run")):
    jaxgpu.rms_norm(jnp.ones((2, 3)))


def test_context_is_per_thread(no_env_choice):
  """Another thread does not see this thread's block (contextvars: a new thread starts
  with no choice)."""
  default = _implementation.resolve(None)
  seen = {}
  with jaxgpu.implementation("xla"):
    worker = threading.Thread(target=lambda: seen.setdefault("other",
                                                              _implementation.resolve(None)))
    worker.start()
    worker.join()
    seen["this"] = _implementation.resolve(None)
  assert seen == {"other": default, "this": "xla"}, seen
