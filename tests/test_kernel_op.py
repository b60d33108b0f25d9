"""jaxgpu/_kernel_op.py on its own: the shared vmap (group folding) and sharding rules,
with a tiny local_fn of plain jnp ops instead of an FFI call.

The op: y = x * scale (scale a "[g] d" parameter, shared when its group axis is 1) and
t = the per-group sum of x over rows (a "g d" reduction output, like a weight gradient).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxgpu._kernel_op import Layout, grouped_call

import oracle

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
  with pytest.raises(NotImplementedError):
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
