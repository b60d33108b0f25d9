"""gelu, silu, relu, sigmoid, swiglu, geglu (jaxgpu/ops/activation.py, kernels in
ffi/activation/), one test base run against every implementation (the `implementation`
fixture, conftest.py).

Oracles: closed-form float64 numpy formulas for every activation AND its derivative
(written from the textbook definitions, not from the kernels' algebra: the kernels compute
the tanh form of gelu as x * sigmoid(2u)); `test_oracle_derivatives` checks the derivative
formulas against jax.grad of jax.nn under x64. Error rule (tests/oracle.py): max error
against float64 at most 2x that of jax.nn computed in float32 and rounded to the op's dtype,
plus a small rounding atol; NaN never passes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
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
SHAPES = ((1,), (3,), (59,), (4097,), (3, 5, 111))


@dataclasses.dataclass(frozen=True)
class Variant:
  name: str                 # test id
  op: str                   # jaxgpu function
  act: str                  # relu | sigmoid | silu | gelu_tanh | gelu_erf
  gated: bool
  approximate: bool | None = None

  @property
  def n_in(self) -> int:
    return 2 if self.gated else 1

  def kwargs(self) -> dict:
    return {} if self.approximate is None else {"approximate": self.approximate}


VARIANTS = (
    Variant("relu", "relu", "relu", False),
    Variant("sigmoid", "sigmoid", "sigmoid", False),
    Variant("silu", "silu", "silu", False),
    Variant("gelu_tanh", "gelu", "gelu_tanh", False, True),
    Variant("gelu_erf", "gelu", "gelu_erf", False, False),
    Variant("swiglu", "swiglu", "silu", True),
    Variant("geglu_tanh", "geglu", "gelu_tanh", True, True),
    Variant("geglu_erf", "geglu", "gelu_erf", True, False),
)
BY_NAME = {v.name: v for v in VARIANTS}
UNARY = [v for v in VARIANTS if not v.gated]
GATED = [v for v in VARIANTS if v.gated]


def kernel_fn(v: Variant, implementation):
  """fn(*arrays) -> y: the op under test."""
  op = getattr(jaxgpu, v.op)
  return lambda *a: op(*a, implementation=implementation, **v.kwargs())


# ---- float64 oracles (numpy) ------------------------------------------------------------------

_erfc = np.vectorize(math.erfc, otypes=[np.float64])
_GELU_C = math.sqrt(2 / math.pi)
_GELU_A = 0.044715


def np_act(act: str, x):
  """(f(x), f'(x)) in float64, from the definitions."""
  f, d, _ = np_act_terms(act, x)
  return f, d


def np_act_terms(act: str, x):
  """(f, f', m): m is the sum of the magnitudes of the terms f' is made of (or the factor
  its cancellation is relative to): a float32 evaluation of f' is accurate relative to m,
  not to f', which crosses zero (silu' at x ~ -1.28) or cancels (sigmoid' as s (1 - s))."""
  x = np.asarray(x, np.float64)
  with np.errstate(over="ignore", invalid="ignore"):
    if act == "relu":
      return np.where(x > 0, x, 0.0), np.where(x > 0, 1.0, 0.0), np.ones_like(x)
    if act == "sigmoid":
      s = 1 / (1 + np.exp(-x))
      return s, s * (1 - s), s
    if act == "silu":
      s = 1 / (1 + np.exp(-x))
      return x * s, s + x * s * (1 - s), s + np.abs(x) * s
    if act == "gelu_tanh":
      # 0.5 (1 + tanh(u)) and 1 - tanh(u)^2 without cancellation in float64 (it rounds
      # 1 + tanh(u) to 0 below x ~ -7.5): 1 + tanh(u) = 2 / (1 + e^{-2u}),
      # 1 - tanh(u)^2 = 4 e^{-2|u|} / (1 + e^{-2|u|})^2.
      u = _GELU_C * (x + _GELU_A * x ** 3)
      half = 1 / (1 + np.exp(-2 * u))
      m = np.exp(-2 * np.abs(u))
      sech2 = 4 * m / (1 + m) ** 2
      term = 0.5 * x * sech2 * _GELU_C * (1 + 3 * _GELU_A * x * x)
      return x * half, half + term, half + np.abs(term)
    if act == "gelu_erf":
      cdf = 0.5 * _erfc(-x / math.sqrt(2))   # erfc: no cancellation for negative x
      pdf = np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
      return x * cdf, cdf + x * pdf, cdf + np.abs(x) * pdf
  raise ValueError(act)


def np_forward(v: Variant, arrays):
  f, _ = np_act(v.act, oracle.as_f64(arrays[0]))
  return f * oracle.as_f64(arrays[1]) if v.gated else f


def np_grads(v: Variant, arrays, ct):
  """Gradients of sum(op(*arrays) * ct) in float64."""
  return np_grads_atol(v, arrays, ct)[0]


def np_grads_atol(v: Variant, arrays, ct):
  """(float64 gradients, a float32 rounding atol for each): GRAD_TERM_ULPS float32 unit
  roundoffs of the magnitude of the terms each gradient is made of (see np_act_terms; as
  dx_atol in test_norm.py). dup = ct * f has no cancellation: no extra atol."""
  f, d, m = np_act_terms(v.act, oracle.as_f64(arrays[0]))
  ct = oracle.as_f64(ct)
  u32 = oracle.unit_roundoff(jnp.float32)
  scale = ct * (oracle.as_f64(arrays[1]) if v.gated else 1.0) * m
  atol = GRAD_TERM_ULPS * u32 * float(np.max(np.abs(scale), initial=0.0))
  if not v.gated:
    return (ct * d,), (atol,)
  return (ct * oracle.as_f64(arrays[1]) * d, ct * f), (atol, 0.0)


# ---- the low-precision reference: jax.nn in float32, rounded to the op's dtype ----------------

_JAX_ACT = {
    "relu": jax.nn.relu,
    "sigmoid": jax.nn.sigmoid,
    "silu": jax.nn.silu,
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_erf": functools.partial(jax.nn.gelu, approximate=False),
}


def lowp_fn(v: Variant):
  act = _JAX_ACT[v.act]
  if v.gated:
    return lambda g, u: (act(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(g.dtype)
  return lambda x: act(x.astype(jnp.float32)).astype(x.dtype)


# ---- inputs ----------------------------------------------------------------------------------


def make_arrays(rng, v: Variant, shape, dtype):
  """x (or gate) spread wide enough to reach both saturated tails; up ~ N(0, 1)."""
  scale = float(rng.uniform(1.0, 4.0))
  arrays = [oracle.randn(rng, shape, dtype, scale)]
  if v.gated:
    arrays.append(oracle.randn(rng, shape, dtype))
  return tuple(arrays)


def make_cotangent(rng, shape, dtype):
  """Exactly representable in dtype; float32 (the loss is summed in float32)."""
  return oracle.randn(rng, shape, dtype).astype(jnp.float32)


def loss(fn, arrays, ct):
  return jnp.sum(fn(*arrays).astype(jnp.float32) * ct)


def grad_fn(fn, n_in):
  return jax.grad(lambda *a: loss(fn, a[:-1], a[-1]), argnums=tuple(range(n_in)))


def check_grads(got, exact, lowp, atols, what, dtype):
  for g, e, r, atol in zip(got, exact, lowp, atols):
    oracle.check(g, e, r, what=what, dtype=dtype, atol_ulps=GRAD_ATOL_ULPS, extra_atol=atol)


# The gradients differ from the oracle's by float32 rounding of a few products on top of
# the final rounding to the dtype: a few more ulps of headroom than the forward.
GRAD_ATOL_ULPS = 8.0
GRAD_TERM_ULPS = 8.0

# ---- forward and backward, every variant x dtype x shape -------------------------------------

def _case(v, dtype, shape):
  return pytest.param(v, dtype, shape,
                      id=f"{v.name}-{jnp.dtype(dtype).name}-{'x'.join(map(str, shape))}")


def _sampled_cases(offset):
  """Every (variant, dtype) with two of the shapes, rotated so that every variant meets
  every shape, and every dtype every shape (48 cases; the full 120 with --run-slow)."""
  out = []
  for i, v in enumerate(VARIANTS):
    for j, d in enumerate(DTYPES):
      for k in range(2):
        out.append(_case(v, d, SHAPES[(2 * j + k + i + offset) % len(SHAPES)]))
  return out


CASES = _sampled_cases(0)
GRAD_CASES = _sampled_cases(1)     # the other shapes for the same (variant, dtype)
FULL_CASES = [_case(v, d, s) for v in VARIANTS for d in DTYPES for s in SHAPES]


def _check_forward(v: Variant, dtype, shape, implementation, rng, jit=True):
  arrays = make_arrays(rng, v, shape, dtype)
  fn = kernel_fn(v, implementation)
  y = (jax.jit(fn) if jit else fn)(*arrays)
  assert y.shape == shape and y.dtype == jnp.dtype(dtype)
  y_lowp = jax.jit(lowp_fn(v))(*arrays)
  oracle.check(y, np_forward(v, arrays), y_lowp, what=f"{v.name} y", dtype=dtype)


def _check_grads(v: Variant, dtype, shape, implementation, rng):
  arrays = make_arrays(rng, v, shape, dtype)
  ct = make_cotangent(rng, shape, dtype)
  got = jax.jit(grad_fn(kernel_fn(v, implementation), v.n_in))(*arrays, ct)
  lowp = jax.jit(grad_fn(lowp_fn(v), v.n_in))(*arrays, ct)
  exact, atols = np_grads_atol(v, arrays, ct)
  names = ("dgate", "dup") if v.gated else ("dx",)
  for name, g, e, r, a, atol in zip(names, got, exact, lowp, arrays, atols):
    assert g.shape == a.shape and g.dtype == a.dtype, name
    oracle.check(g, e, r, what=f"{v.name} {name}", dtype=dtype, atol_ulps=GRAD_ATOL_ULPS,
                 extra_atol=atol)


@pytest.mark.parametrize("v,dtype,shape", CASES)
def test_forward(v, dtype, shape, implementation, rng):
  _check_forward(v, dtype, shape, implementation, rng)


@pytest.mark.parametrize("v,dtype,shape", GRAD_CASES)
def test_grad(v, dtype, shape, implementation, rng):
  _check_grads(v, dtype, shape, implementation, rng)


@pytest.mark.slow
@pytest.mark.parametrize("v,dtype,shape", FULL_CASES)
def test_full_matrix(v, dtype, shape, implementation, rng):
  """Every variant x dtype x shape, forward and backward (--run-slow)."""
  _check_forward(v, dtype, shape, implementation, rng)
  _check_grads(v, dtype, shape, implementation, rng)


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.name)
def test_eager(v, implementation, rng):
  """Outside jit too."""
  _check_forward(v, jnp.bfloat16, (3, 5, 111), implementation, rng, jit=False)


@pytest.mark.parametrize("v", [BY_NAME["swiglu"], BY_NAME["geglu_tanh"]], ids=lambda v: v.name)
def test_large(v, implementation, rng):
  """More elements than one wave of CUDA threads covers (the grid-stride loop runs 2-4
  times on an H100) and a size that is no multiple of the vector width: 5 * 2^20 + 7."""
  if implementation != "cuda":
    pytest.skip("the grid-stride structure is the CUDA kernels'")
  _check_forward(v, jnp.bfloat16, (5 * 2 ** 20 + 7,), implementation, rng)
  _check_grads(v, jnp.bfloat16, (5 * 2 ** 20 + 7,), implementation, rng)


@pytest.mark.parametrize("v", UNARY, ids=lambda v: v.name)
def test_scalar_input(v, implementation, rng):
  """A rank-0 x is an elementwise op's input too."""
  x = oracle.randn(rng, (), jnp.float32, 2.0)
  y = kernel_fn(v, implementation)(x)
  assert y.shape == ()
  oracle.check(y, np_forward(v, (x,)), lowp_fn(v)(x), what="scalar y")
  ct = jnp.float32(1.0)
  g = jax.grad(kernel_fn(v, implementation))(x)
  exact, atols = np_grads_atol(v, (x,), ct)
  check_grads((g,), exact, (jax.grad(lowp_fn(v))(x),), atols, "scalar dx", jnp.float32)


def test_oracle_derivatives():
  """The closed-form float64 derivatives above agree with jax.grad of jax.nn under x64."""
  x = np.concatenate([np.linspace(-12, 12, 601), [0.0, -0.0, 1e-3, -1e-3, 30.0, -30.0]])
  with oracle.x64():
    xs = jnp.asarray(x)
    for act, fn in _JAX_ACT.items():
      f, d = np_act(act, x)
      # atol: jax's tanh form cancels in 1 + tanh(u) (float64 rounding, ~1e-16 * |x|).
      np.testing.assert_allclose(np.asarray(fn(xs)), f, rtol=1e-12, atol=1e-14, err_msg=act)
      g = np.asarray(jax.vmap(jax.grad(fn))(xs))
      np.testing.assert_allclose(g, d, rtol=1e-10, atol=1e-13, err_msg=act)


# ---- semantics at special values -----------------------------------------------------------

SPECIAL = np.array([0.0, -0.0, 1e-30, -1e-30, 1e-3, -1e-3, 1.0, -1.0, 5.0, -5.0, 10.0, -10.0,
                    20.0, -20.0, 30.0, -30.0, 88.0, -88.0, 100.0, -100.0, 1e4, -1e4, 1e19,
                    -1e19, 1e30, -1e30], np.float32)


@pytest.mark.parametrize("v", UNARY, ids=lambda v: v.name)
def test_special_values(v, implementation):
  """Saturated tails stay finite and right (no 0 * inf, no overflow of x^3), forward and
  backward, against float64; NaN and +-inf inputs as jax.nn gives them."""
  fn = kernel_fn(v, implementation)
  if implementation != "xla":
    # (The 'xla' implementation is jax.nn itself, whose float32 tanh form of gelu is off by
    # up to ~1.5e-6 near x = -5 (1 + tanh(u) rounds to 0) and whose gradient is NaN past
    # |x| ~ 1e19 (0 * inf); the kernels avoid both, see GeluTanh in activation_math.h.)
    x = jnp.asarray(SPECIAL)
    y = np.asarray(jax.jit(fn)(x), np.float64)
    dx = np.asarray(jax.jit(jax.vmap(jax.grad(fn)))(x), np.float64)
    f, d = np_act(v.act, SPECIAL)
    assert np.isfinite(y).all() and np.isfinite(dx).all(), (y, dx)
    np.testing.assert_allclose(y, f, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dx, d, rtol=1e-5, atol=1e-6)
  # Non-finite inputs: the output jax.nn gives (NaN propagated, tails at +-inf).
  nonfinite = jnp.asarray([np.nan, np.inf, -np.inf], jnp.float32)
  got = np.asarray(jax.jit(fn)(nonfinite))
  want = np.asarray(_JAX_ACT[v.act](nonfinite))
  np.testing.assert_array_equal(got, want)


def test_relu_grad_at_zero(implementation):
  """jax.nn.relu's gradient at 0 is 0 (and at NaN, 0: a select, as jax's)."""
  x = jnp.asarray([0.0, -0.0, 1.0, -1.0, np.nan], jnp.float32)
  g = jax.jit(jax.vmap(jax.grad(lambda x: jaxgpu.relu(x, implementation=implementation))))(x)
  np.testing.assert_array_equal(np.asarray(g), [0.0, 0.0, 1.0, 0.0, 0.0])
  np.testing.assert_array_equal(np.asarray(g), np.asarray(jax.vmap(jax.grad(jax.nn.relu))(x)))


def test_gelu_forms_differ(implementation):
  """approximate reaches the kernel: the two forms differ by ~1e-4 at x = 1."""
  x = jnp.ones((4,), jnp.float32)
  t = jaxgpu.gelu(x, approximate=True, implementation=implementation)
  e = jaxgpu.gelu(x, approximate=False, implementation=implementation)
  np.testing.assert_allclose(np.asarray(t), 0.8411920, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(e), 0.8413447, rtol=1e-6)
  g = jaxgpu.geglu(x, x, approximate=False, implementation=implementation)
  np.testing.assert_allclose(np.asarray(g), 0.8413447, rtol=1e-6)


def test_forward_mode_unsupported(implementation, rng):
  """custom_vjp has no forward mode: jax.jvp raises (documented)."""
  x = oracle.randn(rng, (3, 59), jnp.float32)
  fn = lambda x: jaxgpu.swiglu(x, x, implementation=implementation)
  if implementation == "xla":
    jax.jvp(fn, (x,), (x,))  # the reference is plain JAX
    return
  with pytest.raises(TypeError):
    jax.jvp(fn, (x,), (x,))


# ---- implementation selection ---------------------------------------------------------------


def _custom_call_targets(lowered) -> set[str]:
  return set(re.findall(r'custom_call_target="([^"]+)"', lowered.compile().as_text()))


@pytest.mark.parametrize("v", [BY_NAME[n] for n in ("relu", "sigmoid", "silu", "gelu_erf",
                                                    "swiglu", "geglu_tanh")],
                         ids=lambda v: v.name)
def test_explicit_implementation_lowers_to_its_target(v, implementation, rng):
  arrays = make_arrays(rng, v, (5, 3), jnp.float32)
  fn = kernel_fn(v, implementation)
  fwd = _custom_call_targets(jax.jit(fn).lower(*arrays))
  bwd = _custom_call_targets(jax.jit(jax.grad(lambda *a: fn(*a).sum(),
                                              argnums=tuple(range(v.n_in)))).lower(*arrays))
  if implementation == "xla":
    assert not any(t.startswith("jaxgpu_") for t in fwd | bwd), fwd | bwd
  else:
    assert f"jaxgpu_{v.op}_fwd_{implementation}" in fwd, fwd
    assert f"jaxgpu_{v.op}_bwd_{implementation}" in bwd, bwd


def test_default_implementation_runs_platform_kernel(rng):
  """implementation=None runs the platform-generic target, the same numbers as explicit."""
  platform = "cuda" if HAS_CUDA else "cpu"
  g = oracle.randn(rng, (17, 59), jnp.bfloat16)
  u = oracle.randn(rng, (17, 59), jnp.bfloat16)
  f = jax.jit(lambda g, u: jaxgpu.geglu(g, u))
  assert "jaxgpu_geglu_fwd" in _custom_call_targets(f.lower(g, u))
  explicit = jax.jit(lambda g, u: jaxgpu.geglu(g, u, implementation=platform))(g, u)
  np.testing.assert_array_equal(np.asarray(f(g, u).astype(jnp.float32)),
                                np.asarray(explicit.astype(jnp.float32)))


# ---- vmap ---------------------------------------------------------------------------------

B = 3
BASE = (4, 59)


def _batched(rng, v: Variant, axes, dtype):
  """Arrays of shape BASE with a batch axis of size B inserted where `axes` says (None:
  unbatched), and the in_axes tuple."""
  arrays = []
  for i, ax in enumerate(axes):
    shape = list(BASE)
    if ax is not None:
      shape.insert(ax % (len(BASE) + 1), B)
    arrays.append(oracle.randn(rng, tuple(shape), dtype, 2.0 if i == 0 else 1.0))
  return tuple(arrays)


def _per_example(arrays, axes):
  """The arrays as (B,) + BASE float64, broadcast where unbatched (the vmap oracle)."""
  out = []
  for a, ax in zip(arrays, axes):
    a = oracle.as_f64(a)
    out.append(np.broadcast_to(a, (B,) + a.shape) if ax is None else np.moveaxis(a, ax, 0))
  return out


UNARY_AXES = [(0,), (1,), (-1,)]
GATED_AXES = [(0, 0), (1, -1), (0, None), (None, 1), (-1, 0)]


def _vmap_params():
  """Every in_axes entry with two variants (unary) or one (gated), rotated so that every
  variant and every dtype occurs: 11 cases."""
  out = []
  k = 0
  for variants, axes_list, per_axes in ((UNARY, UNARY_AXES, 2), (GATED, GATED_AXES, 1)):
    for axes in axes_list:
      for _ in range(per_axes):
        v = variants[k % len(variants)]
        dtype = DTYPES[k % len(DTYPES)]
        k += 1
        out.append(pytest.param(v, axes, dtype,
                                id=f"{v.name}-{','.join(map(str, axes))}-{jnp.dtype(dtype).name}"))
  return out


VMAP_PARAMS = _vmap_params()


@pytest.mark.parametrize("v,axes,dtype", VMAP_PARAMS)
def test_vmap(v, axes, dtype, implementation, rng):
  arrays = _batched(rng, v, axes, dtype)
  fn = jax.vmap(kernel_fn(v, implementation), in_axes=axes)
  y = jax.jit(fn)(*arrays)
  assert y.shape == (B,) + BASE and y.dtype == jnp.dtype(dtype)
  lowp = jax.jit(jax.vmap(lowp_fn(v), in_axes=axes))(*arrays)
  exact = np_forward(v, _per_example(arrays, axes))
  oracle.check(y, exact, lowp, what=f"vmap {axes}", dtype=dtype)


@pytest.mark.parametrize("v,axes,dtype", VMAP_PARAMS)
def test_vmap_of_grad(v, axes, dtype, implementation, rng):
  """Per-example gradients: vmap(grad), the cotangent batched on axis 0."""
  arrays = _batched(rng, v, axes, dtype)
  ct = make_cotangent(rng, (B,) + BASE, dtype)
  per_ex = lambda fn: jax.vmap(grad_fn(fn, v.n_in), in_axes=axes + (0,))
  got = jax.jit(per_ex(kernel_fn(v, implementation)))(*arrays, ct)
  lowp = jax.jit(per_ex(lowp_fn(v)))(*arrays, ct)
  exact, atols = np_grads_atol(v, _per_example(arrays, axes), ct)
  assert all(g.shape == (B,) + BASE for g in got)
  check_grads(got, exact, lowp, atols, f"vmap(grad) {axes}", dtype)


@pytest.mark.parametrize("v", [BY_NAME["gelu_tanh"], BY_NAME["swiglu"], BY_NAME["geglu_erf"]],
                         ids=lambda v: v.name)
def test_grad_of_vmap(v, implementation, rng):
  """grad(vmap): an unbatched input's gradient sums over the vmapped axis."""
  axes = (1, None) if v.gated else (1,)
  arrays = _batched(rng, v, axes, jnp.float32)
  ct = make_cotangent(rng, (B,) + BASE, jnp.float32)
  vm = lambda fn: jax.vmap(fn, in_axes=axes)
  got = jax.jit(grad_fn(vm(kernel_fn(v, implementation)), v.n_in))(*arrays, ct)
  lowp = jax.jit(grad_fn(vm(lowp_fn(v)), v.n_in))(*arrays, ct)
  per, atols = np_grads_atol(v, _per_example(arrays, axes), ct)
  # Back to each input's layout: batched ones move the batch axis back, the rest sum over it.
  exact = [np.moveaxis(e, 0, ax) if ax is not None else e.sum(0) for e, ax in zip(per, axes)]
  atols = [a if ax is not None else B * a for a, ax in zip(atols, axes)]
  check_grads(got, exact, lowp, atols, "grad(vmap)", jnp.float32)


@pytest.mark.parametrize("v", [BY_NAME["silu"], BY_NAME["geglu_tanh"]], ids=lambda v: v.name)
def test_nested_vmap(v, implementation, rng):
  """vmap(vmap), and its gradient."""
  shape = (2, 5, 3, 59)
  arrays = tuple(oracle.randn(rng, shape, jnp.float16, 2.0) for _ in range(v.n_in))
  axes = (1,) * v.n_in
  nest = lambda fn: jax.vmap(jax.vmap(fn, in_axes=axes), in_axes=(0,) * v.n_in)
  y = jax.jit(nest(kernel_fn(v, implementation)))(*arrays)
  out_shape = (2, 3, 5, 59)
  assert y.shape == out_shape
  moved = [np.moveaxis(oracle.as_f64(a), 2, 1) for a in arrays]
  lowp = jax.jit(nest(lowp_fn(v)))(*arrays)
  oracle.check(y, np_forward(v, moved), lowp, what="vmap(vmap)", dtype=jnp.float16)
  ct = make_cotangent(rng, out_shape, jnp.float16)
  got = jax.jit(grad_fn(nest(kernel_fn(v, implementation)), v.n_in))(*arrays, ct)
  lowp = jax.jit(grad_fn(nest(lowp_fn(v)), v.n_in))(*arrays, ct)
  exact, atols = np_grads_atol(v, moved, ct)
  exact = [np.moveaxis(e, 1, 2) for e in exact]
  check_grads(got, exact, lowp, atols, "grad(vmap(vmap))", jnp.float16)


# ---- sharding on 8 fake CPU devices -----------------------------------------------------------


# Every dim may be sharded: rows, the last dim, both, a rank-1 array over all 8 devices.
SHARD_CASES = [
    pytest.param((8, 6), P("a", "b"), id="8x6-a,b"),
    pytest.param((3, 16), P(None, ("a", "b")), id="3x16-_,ab"),
    pytest.param((2, 3, 8), P("b", None, "a"), id="2x3x8-b,_,a"),
    pytest.param((24,), P(("a", "b")), id="24-ab"),
]


def _vjp_fn(fn, n_in):
  """(arrays..., ct) -> gradients, through jax.vjp: only the backward pass's own work (no
  loss reduction) is in the compiled program."""
  def f(*a):
    _, pull = jax.vjp(fn, *a[:n_in])
    return pull(a[n_in])
  return f


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
@pytest.mark.parametrize("shape,spec", SHARD_CASES)
@pytest.mark.parametrize("name", ["gelu_erf", "swiglu"])
def test_sharded_no_collectives(name, shape, spec, axis_type, host_implementation, cpu_devices,
                                rng):
  """Any dims sharded, gate and up alike: forward and backward with no collective at all,
  outputs and gradients keeping the input's sharding, values right."""
  v = BY_NAME[name]
  mesh = oracle.mesh_4x2(cpu_devices, axis_type)
  dtype = jnp.bfloat16
  arrays = make_arrays(rng, v, shape, dtype)
  ct = oracle.randn(rng, shape, dtype)
  fn = kernel_fn(v, host_implementation)
  sharding = NamedSharding(mesh, spec)

  def run():
    a = [jax.device_put(x, sharding) for x in arrays]
    c = jax.device_put(ct, sharding)
    fwd = jax.jit(fn)
    bwd = jax.jit(_vjp_fn(fn, v.n_in))
    fwd_hlo = fwd.lower(*a).compile().as_text()
    bwd_hlo = bwd.lower(*a, c).compile().as_text()
    return fwd(*a), bwd(*a, c), fwd_hlo, bwd_hlo

  y, grads, fwd_hlo, bwd_hlo = oracle.run_on_mesh(mesh, axis_type, run)
  assert oracle.collectives(fwd_hlo) == set(), oracle.collectives(fwd_hlo)
  assert oracle.collectives(bwd_hlo) == set(), oracle.collectives(bwd_hlo)
  want = tuple(spec) + (None,) * (len(shape) - len(spec))
  for out in (y,) + tuple(grads):
    assert oracle.spec_of(out) == want, out.sharding
    if axis_type == "explicit":
      assert tuple(jax.typeof(out).sharding.spec) + (None,) * (len(shape) - len(
          jax.typeof(out).sharding.spec)) == want
  oracle.check(y, np_forward(v, arrays), jax.jit(lowp_fn(v))(*arrays), what="sharded y",
               dtype=dtype)
  exact, atols = np_grads_atol(v, arrays, ct)
  lowp = jax.jit(_vjp_fn(lowp_fn(v), v.n_in))(*arrays, ct)
  check_grads(grads, exact, lowp, atols, "sharded grad", dtype)


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_sharded_gate_up_differ(axis_type, host_implementation, cpu_devices, rng):
  """gate and up sharded differently: still right (up is resharded like gate). With
  Explicit axes jax's own elementwise product refuses that, so the 'xla' implementation
  raises jax's ShardingTypeError; the kernels reshard."""
  v = BY_NAME["geglu_tanh"]
  mesh = oracle.mesh_4x2(cpu_devices, axis_type)
  arrays = make_arrays(rng, v, (8, 6), jnp.float32)
  ct = oracle.randn(rng, (8, 6), jnp.float32)
  specs = (P("a", "b"), P("b", None))
  fn = kernel_fn(v, host_implementation)

  def run():
    a = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(arrays, specs)]
    c = jax.device_put(ct, NamedSharding(mesh, specs[0]))
    return jax.jit(fn)(*a), jax.jit(_vjp_fn(fn, 2))(*a, c)

  if axis_type == "explicit" and host_implementation == "xla":
    with pytest.raises(Exception, match="sharding"):
      oracle.run_on_mesh(mesh, axis_type, run)
    return
  y, grads = oracle.run_on_mesh(mesh, axis_type, run)
  oracle.check(y, np_forward(v, arrays), jax.jit(lowp_fn(v))(*arrays), what="y",
               dtype=jnp.float32)
  lowp = jax.jit(_vjp_fn(lowp_fn(v), 2))(*arrays, ct)
  exact, atols = np_grads_atol(v, arrays, ct)
  check_grads(grads, exact, lowp, atols, "grad", jnp.float32)


@pytest.mark.parametrize("name", ["silu", "swiglu"])
def test_shard_map(name, host_implementation, cpu_devices, rng):
  """Inside shard_map (8 shards): forward, grad inside and grad of the shard_map."""
  v = BY_NAME[name]
  mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(AxisType.Auto,) * 2, devices=cpu_devices)
  shape = (16, 59)
  arrays = make_arrays(rng, v, shape, jnp.bfloat16)
  ct = make_cotangent(rng, shape, jnp.bfloat16)
  fn = kernel_fn(v, host_implementation)
  rows = P(("a", "b"))
  specs = (rows,) * v.n_in

  y = jax.jit(shard_map(fn, mesh=mesh, in_specs=specs, out_specs=rows))(*arrays)
  oracle.check(y, np_forward(v, arrays), jax.jit(lowp_fn(v))(*arrays), what="shard_map y",
               dtype=jnp.bfloat16)
  exact, atols = np_grads_atol(v, arrays, ct)
  lowp = jax.jit(grad_fn(lowp_fn(v), v.n_in))(*arrays, ct)

  outer = jax.jit(grad_fn(shard_map(fn, mesh=mesh, in_specs=specs, out_specs=rows), v.n_in))
  inner = jax.jit(shard_map(grad_fn(fn, v.n_in), mesh=mesh, in_specs=specs + (rows,),
                            out_specs=specs))
  for what, got in (("grad of shard_map", outer(*arrays, ct)),
                    ("grad inside shard_map", inner(*arrays, ct))):
    check_grads(got, exact, lowp, atols, what, jnp.bfloat16)


def test_shard_map_outputs_are_varying(host_implementation, cpu_devices, rng):
  """A per-shard result varies over the mesh axes (out_specs=P() must be refused)."""
  mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(AxisType.Auto,) * 2, devices=cpu_devices)
  x = oracle.randn(rng, (8, 59), jnp.float32)
  f = shard_map(lambda g: jaxgpu.swiglu(g, g, implementation=host_implementation), mesh=mesh,
                in_specs=P(("a", "b")), out_specs=P())
  with pytest.raises(ValueError, match="out_specs|vary"):
    jax.jit(f)(x)


@pytest.mark.parametrize("name", ["gelu_tanh", "geglu_erf"])
def test_pmap(name, host_implementation, cpu_devices, rng):
  """pmap over 4 CPU devices: forward and per-device gradients."""
  v = BY_NAME[name]
  shape = (4, 3, 59)
  arrays = make_arrays(rng, v, shape, jnp.float32)
  ct = make_cotangent(rng, shape, jnp.float32)
  fn = kernel_fn(v, host_implementation)
  devices = cpu_devices[:4]
  y = jax.pmap(fn, devices=devices)(*arrays)
  oracle.check(y, np_forward(v, arrays), jax.jit(lowp_fn(v))(*arrays), what="pmap y",
               dtype=jnp.float32)
  got = jax.pmap(grad_fn(fn, v.n_in), devices=devices)(*arrays, ct)
  lowp = jax.jit(grad_fn(lowp_fn(v), v.n_in))(*arrays, ct)
  exact, atols = np_grads_atol(v, arrays, ct)
  check_grads(got, exact, lowp, atols, "pmap grad", jnp.float32)


# ---- bad input ------------------------------------------------------------------------------

_X = lambda: jnp.ones((2, 3))

BAD_UNARY = [
    ("x-int32", lambda: dict(x=jnp.ones((2, 3), jnp.int32)), TypeError, r"\bx\b.*dtype"),
    ("x-float64", lambda: dict(x=np.ones((2, 3), np.float64)), TypeError, r"\bx\b.*dtype"),
    ("x-complex", lambda: dict(x=jnp.ones((2, 3), jnp.complex64)), TypeError, r"\bx\b.*dtype"),
    ("x-string", lambda: dict(x="abc"), TypeError, r"\bx\b"),
    ("x-none", lambda: dict(x=None), TypeError, r"\bx\b"),
    ("implementation-bogus", lambda: dict(x=_X(), implementation="bogus"), ValueError,
     r"implementation"),
]

BAD_GATED = [
    ("gate-int32", lambda: dict(gate=jnp.ones((2, 3), jnp.int32), up=_X()), TypeError,
     r"\bgate\b.*dtype"),
    ("up-float64", lambda: dict(gate=_X(), up=np.ones((2, 3), np.float64)), TypeError,
     r"\bup\b.*dtype"),
    ("up-dtype", lambda: dict(gate=_X(), up=jnp.ones((2, 3), jnp.bfloat16)), TypeError,
     r"\bup\b.*dtype"),
    ("up-shape", lambda: dict(gate=_X(), up=jnp.ones((3, 2))), ValueError, r"\bup\b.*shape"),
    ("up-broadcastable", lambda: dict(gate=_X(), up=jnp.ones((3,))), ValueError,
     r"\bup\b.*shape"),
    ("up-rank", lambda: dict(gate=_X(), up=jnp.ones((1, 2, 3))), ValueError, r"\bup\b.*shape"),
    ("up-string", lambda: dict(gate=_X(), up="abc"), TypeError, r"\bup\b"),
    ("implementation-bogus", lambda: dict(gate=_X(), up=_X(), implementation="bogus"),
     ValueError, r"implementation"),
]


def _check_bad(fn, kw, error, match):
  with pytest.raises(error, match=match):
    fn(**kw)
  arrays = {k: v for k, v in kw.items() if isinstance(v, (jax.Array, np.ndarray))}
  rest = {k: v for k, v in kw.items() if k not in arrays}
  if arrays and all(jnp.dtype(a.dtype) != jnp.float64 for a in arrays.values()):
    with pytest.raises(error, match=match):   # the same at trace time, under jit
      jax.jit(lambda a: fn(**a, **rest))(arrays)


@pytest.mark.parametrize("op", ["gelu", "silu", "relu", "sigmoid"])
@pytest.mark.parametrize("build,error,match", [b[1:] for b in BAD_UNARY],
                         ids=[b[0] for b in BAD_UNARY])
def test_bad_input_unary(op, build, error, match):
  _check_bad(getattr(jaxgpu, op), build(), error, match)


@pytest.mark.parametrize("op", ["swiglu", "geglu"])
@pytest.mark.parametrize("build,error,match", [b[1:] for b in BAD_GATED],
                         ids=[b[0] for b in BAD_GATED])
def test_bad_input_gated(op, build, error, match):
  _check_bad(getattr(jaxgpu, op), build(), error, match)


@pytest.mark.parametrize("value", ["yes", 1, None, 0.5])
@pytest.mark.parametrize("op", ["gelu", "geglu"])
def test_bad_approximate(op, value):
  args = (_X(),) if op == "gelu" else (_X(), _X())
  with pytest.raises(TypeError, match="approximate"):
    getattr(jaxgpu, op)(*args, approximate=value)


def test_traced_approximate_rejected():
  with pytest.raises(TypeError, match="approximate"):
    jax.jit(lambda x, a: jaxgpu.gelu(x, approximate=a))(_X(), True)


@pytest.mark.skipif(HAS_CUDA, reason="this machine has a CUDA backend")
def test_cuda_without_gpu():
  with pytest.raises(ValueError, match="implementation='cuda'"):
    jaxgpu.swiglu(_X(), _X(), implementation="cuda")


def _raw_call(target, outs, *args, **attrs):
  """The FFI target called directly, bypassing the Python checks."""
  from jaxgpu import _ffi
  _ffi.registered_targets()
  return jax.jit(lambda *a: jax.ffi.ffi_call(target, outs)(*a, **attrs))(*args)


RAW_BAD = [
    # (id, target stem, outputs, inputs, attrs, message pattern)
    ("up-count", "swiglu_fwd", [((4, 5), jnp.float32)], [((4, 5), jnp.float32),
                                                         ((4, 6), jnp.float32)], {}, "up"),
    ("up-shape", "swiglu_fwd", [((4, 5), jnp.float32)], [((4, 5), jnp.float32),
                                                         ((5, 4), jnp.float32)], {}, "up"),
    ("up-dtype", "geglu_fwd", [((4, 5), jnp.float32)], [((4, 5), jnp.float32),
                                                        ((4, 5), jnp.float16)],
     {"approximate": True}, "up"),
    ("y-dtype", "relu_fwd", [((4, 5), jnp.bfloat16)], [((4, 5), jnp.float32)], {}, r"\by\b"),
    ("y-count", "sigmoid_fwd", [((4, 6), jnp.float32)], [((4, 5), jnp.float32)], {}, r"\by\b"),
    ("x-int32", "silu_fwd", [((4, 5), jnp.int32)], [((4, 5), jnp.int32)], {}, "dtype"),
    ("dy-count", "gelu_bwd", [((4, 5), jnp.float32)], [((4, 5), jnp.float32),
                                                       ((4, 4), jnp.float32)],
     {"approximate": False}, "dy"),
    ("dup-count", "swiglu_bwd", [((4, 5), jnp.float32), ((4, 4), jnp.float32)],
     [((4, 5), jnp.float32)] * 3, {}, "dup"),
]


@pytest.mark.parametrize("stem,outs,ins,attrs,match", [b[1:] for b in RAW_BAD],
                         ids=[b[0] for b in RAW_BAD])
def test_handler_rejects_bad_buffers(stem, outs, ins, attrs, match, implementation):
  """The handlers check every buffer (dtype, shape, element count) and return an error
  naming it: the last line of defence behind the Python checks, never a crash."""
  if implementation == "xla":
    pytest.skip("no handler")
  out_types = tuple(jax.ShapeDtypeStruct(s, d) for s, d in outs)
  args = [jnp.ones(s, d) for s, d in ins]
  with pytest.raises(Exception, match=match) as info:
    jax.block_until_ready(_raw_call(f"jaxgpu_{stem}_{implementation}", out_types, *args,
                                    **attrs))
  assert "INVALID_ARGUMENT" in str(info.value) or "InvalidArgument" in str(info.value)


# ---- size 0 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 5), (2, 0, 4)], ids=str)
@pytest.mark.parametrize("name", ["gelu_tanh", "relu", "swiglu", "geglu_erf"])
def test_size_zero(name, shape, implementation):
  v = BY_NAME[name]
  arrays = tuple(jnp.zeros(shape, jnp.bfloat16) for _ in range(v.n_in))
  fn = kernel_fn(v, implementation)
  y = jax.jit(fn)(*arrays)
  assert y.shape == shape and y.dtype == jnp.bfloat16
  grads = jax.jit(grad_fn(fn, v.n_in))(*arrays, jnp.zeros(shape, jnp.float32))
  for g in grads:
    assert g.shape == shape and g.dtype == jnp.bfloat16


# ---- accepted input forms -------------------------------------------------------------------


def test_numpy_and_python_inputs(implementation, rng):
  x = np.asarray(rng.standard_normal((3, 59)), np.float32)
  y = jaxgpu.swiglu(x, x, implementation=implementation)
  f, _ = np_act("silu", x)
  oracle.check(y, f * x.astype(np.float64),
               lowp_fn(BY_NAME["swiglu"])(jnp.asarray(x), jnp.asarray(x)), what="numpy")
  # A Python list is an array of the default float dtype (float32).
  np.testing.assert_allclose(np.asarray(jaxgpu.relu([1.0, -2.0, 3.0],
                                                    implementation=implementation)),
                             [1.0, 0.0, 3.0])
