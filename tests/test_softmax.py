"""softmax (jaxgpu/ops/softmax.py, kernels in ffi/softmax/), one test base run against every
implementation (the `implementation` fixture, conftest.py).

Oracles: float64 numpy (forward) and jax.grad of a jnp softmax under a local x64 context
(gradients), both written here, independently of jaxgpu.reference. Semantics: those of
jax.nn.softmax(x * scale, where=keep) with keep = mask & causal, except that a row with
nothing kept is all zeros (and has a zero gradient) where jax.nn.softmax gives NaN.
Error rule (tests/oracle.py): max error against float64 at most 2x that of a jnp softmax
computed in the same low precision (statistics in float32), plus a small rounding atol.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxgpu

import oracle
from conftest import HAS_CUDA

try:
  from jax import shard_map
except ImportError:  # older jax
  from jax.experimental.shard_map import shard_map  # type: ignore

AxisType = jax.sharding.AxisType
DTYPES = oracle.DTYPES

# ---- oracles -----------------------------------------------------------------------------


def np_keep(shape, causal=False, mask=None) -> np.ndarray:
  keep = np.ones(shape, bool)
  if mask is not None:
    keep &= np.broadcast_to(np.asarray(mask), shape)
  if causal:
    t, s = shape[-2:]
    keep &= np.tril(np.ones((t, s), bool))   # top-left aligned: key j <= query i
  return keep


def np_softmax(x, scale=None, causal=False, mask=None) -> np.ndarray:
  """float64 softmax of the exact values x holds; nothing kept -> zeros."""
  v = oracle.as_f64(x) * (1.0 if scale is None else scale)
  keep = np_keep(v.shape, causal, mask)
  v = np.where(keep, v, -np.inf)
  m = v.max(-1, keepdims=True) if v.shape[-1] else np.zeros(v.shape[:-1] + (1,))
  m = np.where(m == -np.inf, 0.0, m)
  e = np.where(keep, np.exp(v - m), 0.0)
  s = e.sum(-1, keepdims=True)
  return e / np.where(s == 0, 1.0, s)


def jnp_softmax(x, scale=None, causal=False, mask=None):
  """The same in jnp, any precision: statistics in float32 (or x's dtype if wider),
  result in x's dtype. Differentiable with zero gradients on rows with nothing kept."""
  stat = jnp.promote_types(x.dtype, jnp.float32)
  v = x.astype(stat)
  if scale is not None:
    v = v * scale
  keep = None if mask is None else jnp.asarray(mask)
  if causal:
    t, s = x.shape[-2:]
    c = jnp.tril(jnp.ones((t, s), bool))
    keep = c if keep is None else keep & c
  if keep is not None:
    v = jnp.where(keep, v, -jnp.inf)
  m = jax.lax.stop_gradient(jnp.max(v, -1, keepdims=True, initial=-jnp.inf))
  m = jnp.where(m == -jnp.inf, 0.0, m)
  e = jnp.exp(v - m)
  s = jnp.sum(e, -1, keepdims=True)
  return (e / jnp.where(s == 0, 1.0, s)).astype(x.dtype)


# ---- cases ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
  shape: tuple[int, ...]
  scale: float | None = None
  causal: bool = False
  mask: tuple[int, ...] | None = None   # the mask's own shape (broadcastable to shape)
  p_drop: float = 0.3                   # fraction of mask entries that are False

  def id(self) -> str:
    parts = ["x".join(map(str, self.shape))]
    if self.scale is not None:
      parts.append(f"scale{self.scale:g}")
    if self.causal:
      parts.append("causal")
    if self.mask is not None:
      parts.append("mask" + ("x".join(map(str, self.mask)) or "scalar"))
    return "-".join(parts)


# S = 1, 3, 59, 4097 (odd: scalar kernels), 64/128/4096 (16-byte vectors), 65536 and beyond;
# T = 1, 17, with T != S both ways under the causal mask; masks of several broadcast shapes.
CASES = [
    Case((1,)),
    Case((3,), scale=-2.0),
    Case((17, 59)),
    Case((5, 4097), mask=(4097,)),
    Case((3, 64), scale=0.3),
    Case((17, 4096)),
    Case((2, 65536)),
    Case((2, 17, 40000), causal=True, mask=(40000,)),  # wide rows, mostly past the limit
    # Rows of several warps on CUDA: warps with nothing kept; whole rows dropped (a mask
    # broadcast along S).
    Case((3, 40, 1536), causal=True, mask=(3, 1, 1536)),
    Case((4, 17, 2048), scale=0.7, mask=(4, 17, 1)),
    Case((1, 70001), scale=0.5),
    Case((1, 1), causal=True),
    Case((17, 1), causal=True),
    Case((3, 17, 3), causal=True),                      # T > S: rows i >= S see every key
    Case((2, 17, 59), causal=True, scale=0.125),        # T < S
    Case((2, 17, 128), causal=True, mask=(2, 1, 128)),
    Case((2, 3, 17, 59), mask=(2, 1, 17, 59)),
    Case((2, 3, 17, 64), causal=True, scale=0.5, mask=(17, 64)),
    Case((2, 3, 1, 59), mask=(2, 1, 1, 59)),            # T = 1, a padding-style mask
    Case((4, 17, 59), mask=(4, 17, 1)),                 # whole rows kept or dropped
    Case((2, 3, 5, 64), mask=(1, 3, 1, 64)),            # alternating broadcast / full dims
    Case((3, 5, 8), mask=(), p_drop=1.0),               # a scalar False: every row dropped
    Case((6, 59), mask=(6, 59), p_drop=0.9),            # sparse: some rows fully masked
]
CASE_IDS = [c.id() for c in CASES]


def make_x(rng, case: Case, dtype, shape=None):
  shape = case.shape if shape is None else shape
  return oracle.randn(rng, shape, dtype, float(rng.uniform(0.5, 4.0)), float(rng.uniform(-2, 2)))


def make_mask(rng, case: Case, shape=None):
  shape = case.mask if shape is None else shape
  if shape is None:
    return None
  return jnp.asarray(rng.random(shape) >= case.p_drop)


def kernel_fn(implementation, case: Case):
  return lambda x, mask=None: jaxgpu.softmax(x, scale=case.scale, is_causal=case.causal,
                                             mask=mask, implementation=implementation)


def ref_fn(case: Case):
  return lambda x, mask=None: jnp_softmax(x, case.scale, case.causal, mask)


def loss(fn, x, mask, cot):
  """<fn(x), cot> in float32 (or wider): its gradient is one VJP with random cotangents."""
  y = fn(x, mask)
  acc = jnp.promote_types(y.dtype, jnp.float32)
  return jnp.sum(y.astype(acc) * cot.astype(acc))


def to64(a):
  return None if a is None else jnp.asarray(oracle.as_f64(a))


# The references, jitted once per case (static): the tests of every implementation share
# their compilations (x64 or not is part of jax's cache key).
@functools.partial(jax.jit, static_argnums=0)
def ref_forward(case: Case, x, mask):
  return ref_fn(case)(x, mask)


@functools.partial(jax.jit, static_argnums=0)
def ref_grad(case: Case, x, mask, cot):
  return jax.grad(lambda x: loss(ref_fn(case), x, mask, cot))(x)


def grad_expected(case: Case, x, mask, cot, loss_fn=None):
  """(float64 oracle, low-precision reference) gradients wrt x."""
  if loss_fn is None:
    grad = functools.partial(ref_grad, case)
  else:
    grad = jax.jit(jax.grad(lambda x, m, c: loss_fn(ref_fn(case), x, m, c)))
  lowp = grad(x, mask, cot)
  with oracle.x64():
    exact = oracle.as_f64(grad(to64(x), mask, to64(cot)))
  return exact, lowp


def dx_atol(case: Case, y64, cot, dtype) -> float:
  """Rounding atol of dx = scale * y * (dy - sum(dy * y)), two sources:
  * the backward pass reads y ROUNDED to the op's dtype (the residual is the output, not x),
    while XLA's autodiff of the reference never rounds its float32 y. A rounding
    y_k (1 + d_k), |d_k| <= u, moves dx_j by at most
    |scale| u y_j (|dy_j| + |sum dy y| + sum |dy_k| y_k): ulps of the terms, not of dx (which
    cancels, e.g. when one key dominates its row);
  * the float32 row sum, relative to sum |dy_k| y_k <= max|dy|."""
  s = abs(1.0 if case.scale is None else case.scale)
  y = np.asarray(y64, np.float64)
  c = oracle.as_f64(cot)
  if c.size == 0:
    return 0.0
  per_row = y.max(-1) * (np.abs(c).max(-1) + 2 * np.abs(c * y).sum(-1))
  u = oracle.unit_roundoff(dtype)
  return 2 * s * u * float(per_row.max()) + 16 * oracle.unit_roundoff(jnp.float32) * s * float(
      np.abs(c).max())


GRAD_ATOL_ULPS = 8.0

# ---- forward -------------------------------------------------------------------------------


def _rotated(offset):
  """Each case once, the dtype rotated so that every dtype meets every kind of case."""
  params = [(c, DTYPES[(i + offset) % len(DTYPES)]) for i, c in enumerate(CASES)]
  return pytest.mark.parametrize("case,dtype", params,
                                 ids=[f"{c.id()}-{jnp.dtype(d).name}" for c, d in params])


@_rotated(0)
def test_forward(case, dtype, implementation, rng):
  x = make_x(rng, case, dtype)
  mask = make_mask(rng, case)
  y = jax.jit(kernel_fn(implementation, case))(x, mask)
  assert y.shape == x.shape and y.dtype == x.dtype
  y64 = np_softmax(x, case.scale, case.causal, mask)
  lowp = ref_forward(case, x, mask)
  oracle.check(y, y64, lowp, what=case.id(), dtype=dtype)
  # Rows with nothing kept are exactly zero.
  empty = ~np_keep(x.shape, case.causal, mask).any(-1)
  assert not np.asarray(y.astype(jnp.float32))[empty].any()


@_rotated(1)
def test_grad(case, dtype, implementation, rng):
  x = make_x(rng, case, dtype)
  mask = make_mask(rng, case)
  cot = oracle.randn(rng, x.shape, dtype).astype(jnp.float32)
  g = jax.jit(jax.grad(lambda x, m, c: loss(kernel_fn(implementation, case), x, m, c)))(
      x, mask, cot)
  assert g.shape == x.shape and g.dtype == x.dtype
  exact, lowp = grad_expected(case, x, mask, cot)
  y64 = np_softmax(x, case.scale, case.causal, mask)
  oracle.check(g, exact, lowp, what=f"{case.id()} dx", dtype=dtype, atol_ulps=GRAD_ATOL_ULPS,
               extra_atol=dx_atol(case, y64, cot, dtype))


def test_forward_eager(implementation, rng):
  """Outside jit too."""
  case = Case((2, 3, 17, 59), scale=0.5, causal=True, mask=(2, 1, 17, 59))
  x = make_x(rng, case, jnp.bfloat16)
  mask = make_mask(rng, case)
  y = kernel_fn(implementation, case)(x, mask)
  oracle.check(y, np_softmax(x, 0.5, True, mask), jnp_softmax(x, 0.5, True, mask),
               what="eager", dtype=jnp.bfloat16)


# ---- edge semantics ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_fully_masked_rows(dtype, implementation, rng):
  """Rows with nothing kept (by the mask, or with only -inf logits): zeros, zero gradient,
  no NaN anywhere; the other rows unaffected."""
  x = np.array(make_x(rng, Case((4, 6, 64)), jnp.float32))
  x[1, 2, :] = -np.inf               # every logit -inf, all kept
  x[3, 0, :5] = -np.inf              # some -inf logits: a normal row
  x = jnp.asarray(x).astype(dtype)
  mask = np.asarray(rng.random((4, 6, 64)) > 0.5)
  mask[0, :, :] = False               # a whole batch entry dropped
  mask[2, 4, :] = False
  mask[1, 2, :] = True
  fn = lambda x: jaxgpu.softmax(x, mask=jnp.asarray(mask), implementation=implementation)
  y = np.asarray(jax.jit(fn)(x).astype(jnp.float32))
  assert np.isfinite(y).all()
  for idx in ((0,), (2, 4), (1, 2)):
    assert not y[idx].any(), idx
  np.testing.assert_allclose(y[3].sum(-1), 1.0, rtol=4 * oracle.unit_roundoff(dtype) * 64)
  cot = oracle.randn(rng, x.shape, dtype).astype(jnp.float32)
  g = jax.jit(jax.grad(lambda x: jnp.sum(fn(x).astype(jnp.float32) * cot)))(x)
  g = np.asarray(g.astype(jnp.float32))
  assert np.isfinite(g).all()
  for idx in ((0,), (2, 4), (1, 2)):
    assert not g[idx].any(), idx
  assert not g[~mask].any()          # masked positions get no gradient


@pytest.mark.parametrize("cols", [8, 4096])  # on CUDA, rows of one thread and of 8 warps
def test_nan_and_inf_logits(cols, implementation):
  """A kept NaN or +inf logit makes its row NaN (as XLA's softmax); a masked one does not."""
  x = np.zeros((4, cols), np.float32)
  x[0, 3] = np.nan
  x[1, 5] = np.inf
  x[2, 1] = np.nan                   # masked below
  mask = np.ones((4, cols), bool)
  mask[2, 1] = False
  y = np.asarray(jaxgpu.softmax(jnp.asarray(x), mask=jnp.asarray(mask),
                                implementation=implementation))
  assert np.isnan(y[0]).all() and np.isnan(y[1]).all()
  np.testing.assert_allclose(y[2], np.where(mask[2], 1 / (cols - 1), 0), rtol=1e-6)
  np.testing.assert_allclose(y[3], 1 / cols, rtol=1e-6)


def test_matches_jax_nn_softmax(implementation, rng):
  """Where some key is kept, the semantics are jax.nn.softmax(x * scale, where=keep)."""
  x = oracle.randn(rng, (2, 4, 17, 59), jnp.float32, 2.0)
  mask = jnp.asarray(rng.random((2, 1, 17, 59)) > 0.2).at[..., 0].set(True)
  keep = mask & jnp.tril(jnp.ones((17, 59), bool))
  want = jax.nn.softmax(x * 0.7, where=keep)
  want = jnp.where(keep, want, 0.0)  # jax leaves masked entries unspecified in some versions
  got = jaxgpu.softmax(x, scale=0.7, is_causal=True, mask=mask, implementation=implementation)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=1e-7)


def test_mask_is_not_differentiable(implementation, rng):
  """The mask is boolean: jax.vjp gives it a float0 cotangent (and no kernel work)."""
  x = oracle.randn(rng, (3, 5), jnp.float32)
  mask = jnp.asarray(rng.random((5,)) > 0.3)
  y, vjp = jax.vjp(lambda x, m: jaxgpu.softmax(x, mask=m, implementation=implementation),
                   x, mask)
  dx, dmask = vjp(jnp.ones_like(y))
  assert dx.shape == x.shape
  assert dmask.shape == mask.shape and dmask.dtype == jax.dtypes.float0


def test_deterministic(implementation, rng):
  """Bitwise identical across runs and separate compilations, forward and backward."""
  case = Case((8, 3, 17, 4096), scale=0.5, causal=True, mask=(8, 1, 17, 4096))
  x = make_x(rng, case, jnp.bfloat16)
  mask = make_mask(rng, case)
  cot = oracle.randn(rng, x.shape, jnp.bfloat16).astype(jnp.float32)
  fn = kernel_fn(implementation, case)
  grad = lambda: jax.jit(jax.value_and_grad(lambda x: loss(fn, x, mask, cot)))
  outs = [grad()(x) for _ in range(3)]
  for v, g in outs[1:]:
    assert np.asarray(v) == np.asarray(outs[0][0])
    np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)),
                                  np.asarray(outs[0][1].astype(jnp.float32)))


def test_forward_mode_unsupported(implementation, rng):
  x = oracle.randn(rng, (3, 59), jnp.float32)
  fn = lambda x: jaxgpu.softmax(x, implementation=implementation)
  if implementation == "xla":
    jax.jvp(fn, (x,), (x,))  # the reference is plain JAX
    return
  with pytest.raises(TypeError):
    jax.jvp(fn, (x,), (x,))


# ---- the mask is read in place ------------------------------------------------------------------


def _hlo_shapes(hlo: str) -> set[str]:
  return set(re.findall(r"pred\[[0-9,]*\]", hlo))


@pytest.mark.parametrize("mask_shape", [(17, 64), (8, 1, 1, 64), (1, 4, 17, 1)], ids=str)
def test_mask_not_broadcast_in_memory(mask_shape, host_implementation, rng):
  """The compiled program never forms a bool array of x's full shape from a small mask."""
  if host_implementation == "xla":
    pytest.skip("the reference broadcasts the mask (XLA fuses it)")
  x = oracle.randn(rng, (8, 4, 17, 64), jnp.bfloat16)
  mask = jnp.asarray(rng.random(mask_shape) > 0.3)
  f = jax.jit(lambda x, m: jaxgpu.softmax(x, mask=m, is_causal=True,
                                          implementation=host_implementation))
  hlo = f.lower(x, mask).compile().as_text()
  assert "pred[8,4,17,64]" not in _hlo_shapes(hlo), _hlo_shapes(hlo)
  np.testing.assert_allclose(np.asarray(f(x, mask).astype(jnp.float32)),
                             np_softmax(x, None, True, mask), atol=8e-3)


# ---- implementation selection ---------------------------------------------------------------


def _custom_call_targets(lowered) -> set[str]:
  return set(re.findall(r'custom_call_target="([^"]+)"', lowered.compile().as_text()))


def test_explicit_implementation_lowers_to_its_target(implementation, rng):
  x = oracle.randn(rng, (5, 3), jnp.float32)
  mask = jnp.asarray(rng.random((3,)) > 0.5)
  fn = lambda x: jaxgpu.softmax(x, mask=mask, implementation=implementation)
  targets = _custom_call_targets(jax.jit(fn).lower(x))
  grad_targets = _custom_call_targets(jax.jit(jax.grad(lambda x: fn(x).sum())).lower(x))
  if implementation == "xla":
    assert not any(t.startswith("jaxgpu_") for t in targets | grad_targets), targets
  else:
    assert f"jaxgpu_softmax_fwd_{implementation}" in targets, targets
    assert f"jaxgpu_softmax_bwd_{implementation}" in grad_targets, grad_targets


def test_default_implementation_is_the_platform_kernel(rng):
  x = oracle.randn(rng, (17, 59), jnp.bfloat16)
  targets = _custom_call_targets(jax.jit(lambda x: jaxgpu.softmax(x, is_causal=True)).lower(x))
  assert "jaxgpu_softmax_fwd" in targets, targets
  platform = "cuda" if HAS_CUDA else "cpu"
  a = jax.jit(lambda x: jaxgpu.softmax(x, is_causal=True))(x)
  b = jax.jit(lambda x: jaxgpu.softmax(x, is_causal=True, implementation=platform))(x)
  np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                np.asarray(b.astype(jnp.float32)))


# ---- vmap ----------------------------------------------------------------------------------

B = 3

VMAP_CASE = Case((4, 17, 64), scale=0.5, causal=True, mask=(4, 17, 64))
# (id, x axis, mask axis, mask shape per example): the mask batched or not, and small.
VMAP_AXES = [
    ("x0", 0, None, (17, 64)),
    ("x1", 1, None, (4, 1, 64)),
    ("x-1-nomask", -1, None, None),
    ("mask0-only", None, 0, (4, 17, 64)),
    ("mask1-only-small", None, 1, (1, 17, 1)),
    ("x0-mask0", 0, 0, (4, 1, 64)),
    ("x2-mask-1", 2, -1, (17, 64)),
]


def _vmap_inputs(rng, x_axis, m_axis, m_shape, dtype):
  def insert(shape, axis):
    if axis is None:
      return shape
    shape = list(shape)
    shape.insert(axis % (len(shape) + 1), B)
    return tuple(shape)
  x = make_x(rng, VMAP_CASE, dtype, insert(VMAP_CASE.shape, x_axis))
  mask = None if m_shape is None else make_mask(rng, VMAP_CASE, insert(m_shape, m_axis))
  return x, mask


def _vmapped(fn, x_axis, m_axis, has_mask):
  if has_mask:
    return jax.vmap(lambda x, m: fn(x, m), in_axes=(x_axis, m_axis))
  return jax.vmap(lambda x, m: fn(x), in_axes=(x_axis, None))


def _per_example_oracle(x, mask, x_axis, m_axis):
  out = []
  for b in range(B):
    xb = x if x_axis is None else np.take(np.asarray(x), b, axis=x_axis)
    mb = mask if (mask is None or m_axis is None) else np.take(np.asarray(mask), b, axis=m_axis)
    out.append(np_softmax(xb, VMAP_CASE.scale, VMAP_CASE.causal, mb))
  return np.stack(out)


@pytest.mark.parametrize("name,x_axis,m_axis,m_shape", VMAP_AXES, ids=[v[0] for v in VMAP_AXES])
def test_vmap(name, x_axis, m_axis, m_shape, implementation, rng):
  dtype = DTYPES[len(name) % 3]
  x, mask = _vmap_inputs(rng, x_axis, m_axis, m_shape, dtype)
  f = _vmapped(kernel_fn(implementation, VMAP_CASE), x_axis, m_axis, mask is not None)
  y = jax.jit(f)(x, mask)
  assert y.shape == (B,) + VMAP_CASE.shape
  lowp = jax.jit(_vmapped(ref_fn(VMAP_CASE), x_axis, m_axis, mask is not None))(x, mask)
  oracle.check(y, _per_example_oracle(x, mask, x_axis, m_axis), lowp, what=f"vmap {name}",
               dtype=dtype)


@pytest.mark.parametrize("name,x_axis,m_axis,m_shape",
                         [v for v in VMAP_AXES if v[1] is not None],
                         ids=[v[0] for v in VMAP_AXES if v[1] is not None])
def test_vmap_of_grad(name, x_axis, m_axis, m_shape, implementation, rng):
  """Per-example gradients, the mask batched or not."""
  dtype = DTYPES[(len(name) + 1) % 3]
  x, mask = _vmap_inputs(rng, x_axis, m_axis, m_shape, dtype)
  cot = oracle.randn(rng, (B,) + VMAP_CASE.shape, dtype).astype(jnp.float32)

  def per_example(fn):
    g = jax.grad(lambda x, m, c: loss(fn, x, m, c))
    return jax.vmap(g, in_axes=(x_axis, m_axis if mask is not None else None, 0))

  got = jax.jit(per_example(kernel_fn(implementation, VMAP_CASE)))(x, mask, cot)
  assert got.shape == x.shape[:0] + ((B,) + VMAP_CASE.shape)
  lowp = jax.jit(per_example(ref_fn(VMAP_CASE)))(x, mask, cot)
  with oracle.x64():
    exact = oracle.as_f64(jax.jit(per_example(ref_fn(VMAP_CASE)))(to64(x), mask, to64(cot)))
  oracle.check(got, exact, lowp, what=f"vmap(grad) {name}", dtype=dtype,
               atol_ulps=GRAD_ATOL_ULPS,
               extra_atol=dx_atol(VMAP_CASE, _per_example_oracle(x, mask, x_axis, m_axis), cot,
                                  dtype))


def test_grad_of_nested_vmap(implementation, rng):
  """vmap(vmap) with the mask batched by the outer vmap only, and its gradient."""
  case = Case((5, 17), causal=False, scale=2.0)
  x = oracle.randn(rng, (2, 5, 3, 17), jnp.float16)    # outer axis 0, inner axis 1
  mask = jnp.asarray(rng.random((2, 17)) > 0.3)         # outer only
  cot = oracle.randn(rng, (2, 3, 5, 17), jnp.float16).astype(jnp.float32)

  def forward(fn, x, m):
    inner = jax.vmap(lambda x, m: fn(x, m), in_axes=(1, None))
    return jax.vmap(inner, in_axes=(0, 0))(x, m)

  got = jax.jit(lambda x, m: forward(kernel_fn(implementation, case), x, m))(x, mask)
  want = np.stack([np.stack([np_softmax(np.asarray(x)[o, :, i], 2.0, False, np.asarray(mask)[o])
                             for i in range(3)]) for o in range(2)])
  lowp = forward(ref_fn(case), x, mask)
  oracle.check(got, want, lowp, what="vmap(vmap)", dtype=jnp.float16)

  loss_fn = lambda fn, x, m, c: jnp.sum(forward(fn, x, m).astype(jnp.float32) * c)
  g = jax.jit(jax.grad(lambda x, m, c: loss_fn(kernel_fn(implementation, case), x, m, c)))(
      x, mask, cot)
  exact, lowp = grad_expected(case, x, mask, cot, loss_fn=loss_fn)
  oracle.check(g, exact, lowp, what="grad(vmap(vmap))", dtype=jnp.float16,
               atol_ulps=GRAD_ATOL_ULPS, extra_atol=dx_atol(case, want, cot, jnp.float16))


# ---- sharding on 8 fake CPU devices -----------------------------------------------------------


SHARD_CASE = Case((8, 4, 16, 64), scale=0.5, causal=True, mask=(8, 1, 16, 64))

# (id, x spec, mask spec, case, collectives allowed in fwd/bwd)
SHARDINGS = [
    ("rows", P("a", "b", None, None), P("a", None, None, None), SHARD_CASE, False),
    ("rows-T-nocausal", P("a", None, "b", None), P("a", None, "b", None),
     dataclasses.replace(SHARD_CASE, causal=False), False),
    ("rows-small-mask", P(("a", "b"), None, None, None), P(),
     dataclasses.replace(SHARD_CASE, mask=(16, 64)), False),
    ("S-sharded", P("a", None, None, "b"), P(None, None, None, "b"), SHARD_CASE, True),
    ("T-sharded-causal", P("a", None, "b", None), P(None, None, "b", None), SHARD_CASE, True),
]


# Every layout on an Auto mesh; the row and the causal-T layouts on an Explicit one too.
SHARDING_PARAMS = [pytest.param(*s, "auto", id=f"{s[0]}-auto") for s in SHARDINGS] + [
    pytest.param(*s, "explicit", id=f"{s[0]}-explicit") for s in SHARDINGS
    if s[0] in ("rows", "T-sharded-causal")]


@pytest.mark.parametrize("name,x_spec,m_spec,case,gathers,axis_type", SHARDING_PARAMS)
def test_sharded(name, x_spec, m_spec, case, gathers, axis_type, host_implementation,
                 cpu_devices, rng):
  """Row sharding: no collective forward or backward, outputs keep x's sharding. A sharded
  S (and T under the causal mask) is gathered: correct, with a collective."""
  mesh = oracle.mesh_4x2(cpu_devices, axis_type)
  x = make_x(rng, case, jnp.bfloat16)
  mask = make_mask(rng, case)
  cot = oracle.randn(rng, x.shape, jnp.bfloat16).astype(jnp.float32)
  fn = kernel_fn(host_implementation, case)

  def run():
    xs = jax.device_put(x, NamedSharding(mesh, x_spec))
    ms = jax.device_put(mask, NamedSharding(mesh, m_spec))
    cs = jax.device_put(cot, NamedSharding(mesh, x_spec))
    fwd = jax.jit(fn)
    bwd = jax.jit(jax.grad(lambda x, m, c: loss(fn, x, m, c)))
    return (fwd(xs, ms), bwd(xs, ms, cs), fwd.lower(xs, ms).compile().as_text(),
            bwd.lower(xs, ms, cs).compile().as_text())

  y, g, fwd_hlo, bwd_hlo = oracle.run_on_mesh(mesh, axis_type, run)
  if not gathers:
    assert oracle.collectives(fwd_hlo) == set(), oracle.collectives(fwd_hlo)
    assert oracle.collectives(bwd_hlo) == set(), oracle.collectives(bwd_hlo)
    assert oracle.spec_of(y) == tuple(x_spec) + (None,) * (4 - len(tuple(x_spec))), y.sharding
    assert oracle.spec_of(g) == oracle.spec_of(y), g.sharding
  elif host_implementation != "xla":
    assert oracle.collectives(fwd_hlo), "expected a gather of the sharded axis"
  if axis_type == "explicit":
    assert jax.typeof(g).sharding.spec == jax.typeof(y).sharding.spec
  oracle.check(y, np_softmax(x, case.scale, case.causal, mask),
               jax.jit(ref_fn(case))(x, mask), what=f"sharded {name}", dtype=jnp.bfloat16)
  exact, lowp = grad_expected(case, x, mask, cot)
  y64 = np_softmax(x, case.scale, case.causal, mask)
  oracle.check(g, exact, lowp, what=f"sharded grad {name}", dtype=jnp.bfloat16,
               atol_ulps=GRAD_ATOL_ULPS, extra_atol=dx_atol(case, y64, cot, jnp.bfloat16))


def test_sharded_rank1_and_replicated(host_implementation, cpu_devices, rng):
  mesh = oracle.mesh_4x2(cpu_devices, "auto")
  x = oracle.randn(rng, (64,), jnp.float32)
  mask = jnp.asarray(rng.random((64,)) > 0.3)
  want = np_softmax(x, None, False, mask)
  for spec in (P(), P(("a", "b"))):
    xs = jax.device_put(x, NamedSharding(mesh, spec))
    y = jax.jit(lambda x, m: jaxgpu.softmax(x, mask=m, implementation=host_implementation))(
        xs, mask)
    oracle.check(y, want, jnp_softmax(x, None, False, mask), what=f"rank-1 {spec}",
                 dtype=jnp.float32)


def test_shard_map(host_implementation, cpu_devices, rng):
  """Inside shard_map (rows split 8 ways, the mask split with them): forward, grad of the
  shard_map and grad inside it."""
  mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(AxisType.Auto,) * 2,
                       devices=cpu_devices)
  case = Case((8, 3, 17, 59), scale=0.5, causal=True, mask=(8, 1, 17, 59))
  x = make_x(rng, case, jnp.bfloat16)
  mask = make_mask(rng, case)
  cot = oracle.randn(rng, x.shape, jnp.bfloat16).astype(jnp.float32)
  rows = P(("a", "b"))

  def sharded(fn):
    return shard_map(fn, mesh=mesh, in_specs=(rows, rows), out_specs=rows)

  fn = kernel_fn(host_implementation, case)
  y = jax.jit(sharded(fn))(x, mask)
  oracle.check(y, np_softmax(x, 0.5, True, mask), jnp_softmax(x, 0.5, True, mask),
               what="shard_map forward", dtype=jnp.bfloat16)
  exact, lowp = grad_expected(case, x, mask, cot)
  atol = dx_atol(case, np_softmax(x, 0.5, True, mask), cot, jnp.bfloat16)
  g = jax.jit(jax.grad(lambda x, m, c: loss(sharded(fn), x, m, c)))(x, mask, cot)
  oracle.check(g, exact, lowp, what="grad of shard_map", dtype=jnp.bfloat16,
               atol_ulps=GRAD_ATOL_ULPS, extra_atol=atol)
  inner = shard_map(jax.grad(lambda x, m, c: loss(fn, x, m, c)), mesh=mesh,
                    in_specs=(rows, rows, rows), out_specs=rows)
  g = jax.jit(inner)(x, mask, cot)
  oracle.check(g, exact, lowp, what="grad inside shard_map", dtype=jnp.bfloat16,
               atol_ulps=GRAD_ATOL_ULPS, extra_atol=atol)


def test_pmap(host_implementation, cpu_devices, rng):
  """pmap over 4 CPU devices with a shared (broadcast) mask: forward and gradients."""
  case = Case((4, 3, 17, 59), causal=True, mask=(17, 59))
  x = make_x(rng, case, jnp.float32)
  mask = make_mask(rng, case)
  cot = oracle.randn(rng, x.shape, jnp.float32)
  fn = kernel_fn(host_implementation, case)
  y = jax.pmap(fn, in_axes=(0, None), devices=cpu_devices[:4])(x, mask)
  oracle.check(y, np_softmax(x, None, True, mask), jnp_softmax(x, None, True, mask),
               what="pmap forward", dtype=jnp.float32)
  g = jax.pmap(jax.grad(lambda x, m, c: loss(fn, x, m, c)), in_axes=(0, None, 0),
               devices=cpu_devices[:4])(x, mask, cot)
  exact, lowp = grad_expected(case, x, mask, cot)
  oracle.check(g, exact, lowp, what="pmap grad", dtype=jnp.float32, atol_ulps=GRAD_ATOL_ULPS,
               extra_atol=dx_atol(case, np_softmax(x, None, True, mask), cot, jnp.float32))


# ---- bad input ------------------------------------------------------------------------------

BAD_INPUTS = [
    ("x-scalar", lambda: dict(x=jnp.float32(1.0)), ValueError, r"\bx\b.*rank"),
    ("x-int32", lambda: dict(x=jnp.ones((2, 3), jnp.int32)), TypeError, r"\bx\b.*dtype"),
    ("x-float64", lambda: dict(x=np.ones((2, 3), np.float64)), TypeError, r"\bx\b.*dtype"),
    ("x-string", lambda: dict(x="abc"), TypeError, r"\bx\b"),
    ("mask-not-broadcastable", lambda: dict(x=jnp.ones((2, 3)), mask=jnp.ones((2,), bool)),
     ValueError, r"mask.*broadcastable"),
    ("mask-rank-too-high", lambda: dict(x=jnp.ones((2, 3)), mask=jnp.ones((1, 2, 3), bool)),
     ValueError, r"mask.*broadcastable"),
    ("mask-grows-x", lambda: dict(x=jnp.ones((1, 3)), mask=jnp.ones((2, 3), bool)),
     ValueError, r"mask.*broadcastable"),
    ("mask-int", lambda: dict(x=jnp.ones((2, 3)), mask=jnp.ones((2, 3), jnp.int32)),
     TypeError, r"mask.*bool"),
    ("mask-float", lambda: dict(x=jnp.ones((2, 3)), mask=jnp.ones((3,), jnp.float32)),
     TypeError, r"mask.*bool"),
    ("mask-string", lambda: dict(x=jnp.ones((2, 3)), mask="yes"), TypeError, r"mask"),
    ("causal-rank1", lambda: dict(x=jnp.ones((3,)), is_causal=True), ValueError,
     r"is_causal.*rank"),
    ("causal-not-bool", lambda: dict(x=jnp.ones((2, 3)), is_causal="yes"), TypeError,
     r"is_causal"),
    ("causal-array", lambda: dict(x=jnp.ones((2, 3)), is_causal=jnp.array(True)), TypeError,
     r"is_causal"),
    ("scale-nan", lambda: dict(x=jnp.ones((2, 3)), scale=float("nan")), ValueError, r"\bscale\b"),
    ("scale-inf", lambda: dict(x=jnp.ones((2, 3)), scale=float("inf")), ValueError, r"\bscale\b"),
    ("scale-string", lambda: dict(x=jnp.ones((2, 3)), scale="big"), TypeError, r"\bscale\b"),
    ("implementation-bogus", lambda: dict(x=jnp.ones((2, 3)), implementation="bogus"),
     ValueError, r"implementation"),
]


@pytest.mark.parametrize("build,error,match", [b[1:] for b in BAD_INPUTS],
                         ids=[b[0] for b in BAD_INPUTS])
def test_bad_input(build, error, match):
  kw = build()
  with pytest.raises(error, match=match):
    jaxgpu.softmax(**kw)
  arrays = {k: v for k, v in kw.items()
            if k in ("x", "mask") and isinstance(v, (jax.Array, np.ndarray))}
  rest = {k: v for k, v in kw.items() if k not in arrays}
  if arrays and all(jnp.dtype(a.dtype) != jnp.float64 for a in arrays.values()):
    with pytest.raises(error, match=match):
      jax.jit(lambda a: jaxgpu.softmax(**a, **rest))(arrays)


def test_traced_scale_rejected():
  with pytest.raises(TypeError, match="scale"):
    jax.jit(lambda x, s: jaxgpu.softmax(x, scale=s))(jnp.ones((2, 3)), 0.5)


@pytest.mark.skipif(HAS_CUDA, reason="this machine has a CUDA backend")
def test_cuda_without_gpu():
  with pytest.raises(ValueError, match="implementation='cuda'"):
    jaxgpu.softmax(jnp.ones((2, 3)), implementation="cuda")


# ---- the handlers' own checks (a last line of defence: an error, never a crash) -------------


def _raw_fwd(x, mask, out_shape, **attrs):
  from jaxgpu import _ffi
  a = dict(scale=np.float32(1.0), causal=False, has_mask=mask is not None,
           query_len=np.int64(1))
  a.update(attrs)
  return jax.ffi.ffi_call(_ffi.target_name("jaxgpu_softmax_fwd", "cpu"), out_shape)(
      x, jnp.zeros((0,), bool) if mask is None else mask, **a)


@pytest.mark.parametrize("build,match", [
    (lambda x: _raw_fwd(x, jnp.ones((2, 5), bool), jax.ShapeDtypeStruct(x.shape, x.dtype)),
     "mask: dim 0 must be 1 or 4"),
    (lambda x: _raw_fwd(x, jnp.ones((4, 5), jnp.int32), jax.ShapeDtypeStruct(x.shape, x.dtype)),
     "mask: expected bool"),
    (lambda x: _raw_fwd(x, jnp.ones((5,), bool), jax.ShapeDtypeStruct(x.shape, x.dtype)),
     "mask: expected the rank of x"),
    (lambda x: _raw_fwd(x, None, jax.ShapeDtypeStruct((4, 4), x.dtype)), "y: expected 20"),
    (lambda x: _raw_fwd(x, None, jax.ShapeDtypeStruct(x.shape, jnp.float16)),
     "y: unexpected element type"),
    (lambda x: _raw_fwd(x, None, jax.ShapeDtypeStruct(x.shape, x.dtype), causal=True,
                        query_len=np.int64(3)), "query_len"),
    (lambda x: _raw_fwd(x, None, jax.ShapeDtypeStruct(x.shape, x.dtype),
                        scale=np.float32(np.inf)), "scale: must be finite"),
    (lambda x: _raw_fwd(x.astype(jnp.int32), None, jax.ShapeDtypeStruct(x.shape, jnp.int32)),
     "x: dtype must be"),
], ids=["mask-dim", "mask-dtype", "mask-rank", "y-count", "y-dtype", "query_len", "scale",
        "x-dtype"])
def test_handler_rejects_bad_buffers(build, match):
  if "cpu" not in jaxgpu.available_implementations():
    pytest.skip("no CPU module")
  x = jax.device_put(jnp.ones((4, 5), jnp.float32), jax.devices("cpu")[0])
  with pytest.raises(Exception, match=match):
    jax.block_until_ready(jax.jit(build)(x))


# ---- size 0 and input forms -------------------------------------------------------------------


@pytest.mark.parametrize("shape,mask_shape,causal", [
    ((0, 8), (8,), False), ((3, 0), None, False), ((0,), None, False),
    ((2, 0, 5), (1, 0, 5), True), ((4, 0), (4, 1), True)], ids=str)
def test_size_zero(shape, mask_shape, causal, implementation):
  x = jnp.zeros(shape, jnp.bfloat16)
  mask = None if mask_shape is None else jnp.ones(mask_shape, bool)
  fn = lambda x: jaxgpu.softmax(x, is_causal=causal, mask=mask, implementation=implementation)
  y = jax.jit(fn)(x)
  assert y.shape == shape and y.dtype == x.dtype
  g = jax.grad(lambda x: fn(x).astype(jnp.float32).sum())(x)
  assert g.shape == shape


def test_numpy_and_list_inputs(implementation, rng):
  x = np.asarray(rng.standard_normal((3, 59)), np.float32)
  mask = (rng.random(59) > 0.5).tolist()
  y = jaxgpu.softmax(x, mask=mask, implementation=implementation)
  oracle.check(y, np_softmax(x, None, False, np.asarray(mask)),
               jnp_softmax(jnp.asarray(x), None, False, jnp.asarray(mask)),
               what="numpy inputs", dtype=jnp.float32)
