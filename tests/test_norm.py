"""rms_norm and layer_norm (jaxgpu/ops/norm.py, kernels in ffi/norm/), one test base run
against every implementation (the `implementation` fixture, conftest.py).

Error rule (tests/oracle.py): max error against float64 at most 2x that of a pure-JAX
reference computed in the same low precision, plus a small rounding atol; NaN never passes.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxgpu

import oracle
from conftest import HAS_CUDA, slow_enabled

try:
  from jax import shard_map
except ImportError:  # older jax
  from jax.experimental.shard_map import shard_map  # type: ignore

AxisType = jax.sharding.AxisType

DTYPES = oracle.DTYPES
DIMS = (1, 3, 59, 111, 4097, 65536)
LEADS = ((), (1,), (17,), (3, 5), (2, 3, 4))
BIG_LEADS = ((), (1,), (3,))          # rows stay few when D is large: CPU CI stays fast

# weight / bias / weight_offset variants of each op.
VARIANTS = {
    "rms": ({"weight": False, "offset": 0.0},
            {"weight": True, "offset": 0.0},
            {"weight": True, "offset": 1.0}),
    "layer": ({"weight": False, "bias": False},
              {"weight": True, "bias": False},
              {"weight": False, "bias": True},
              {"weight": True, "bias": True}),
}


@dataclasses.dataclass(frozen=True)
class Case:
  kind: str                   # 'rms' | 'layer'
  dtype: object
  lead: tuple[int, ...]
  dim: int
  weight: bool = True
  bias: bool = False
  offset: float = 0.0
  residual: bool = False
  eps: float | None = None    # None: the op's default

  @property
  def shape(self):
    return self.lead + (self.dim,)

  def static(self) -> dict:
    """Keyword arguments beyond the arrays (for the ops and the references alike)."""
    s = {"eps": self.eps if self.eps is not None else (1e-6 if self.kind == "rms" else 1e-5)}
    if self.kind == "rms":
      s["weight_offset"] = self.offset
    return s

  def id(self) -> str:
    parts = [self.kind, jnp.dtype(self.dtype).name, "x".join(map(str, self.shape)) or "scalar"]
    parts.append(("w" if self.weight else "") + ("b" if self.bias else "") or "nowb")
    if self.kind == "rms" and self.weight:
      parts.append(f"off{self.offset:g}")
    if self.residual:
      parts.append("res")
    if self.eps is not None:
      parts.append(f"eps{self.eps:g}")
    return "-".join(parts)


def _case(kind, dtype, lead, dim, variant, residual, eps=None):
  return Case(kind, dtype, lead, dim, weight=variant.get("weight", False),
              bias=variant.get("bias", False), offset=variant.get("offset", 0.0),
              residual=residual, eps=eps)


def sampled_cases() -> list[Case]:
  """Every (op, dtype, D) once, the other options rotated so that each op sees every
  leading shape, variant, residual on/off and a non-default eps with every dtype."""
  out = []
  for k, kind in enumerate(("rms", "layer")):
    for t, dtype in enumerate(DTYPES):
      for i, dim in enumerate(DIMS):
        leads = LEADS if dim < 4096 else BIG_LEADS
        variants = VARIANTS[kind]
        out.append(_case(kind, dtype, leads[(i + 2 * t + k) % len(leads)], dim,
                         variants[(i + t) % len(variants)], residual=(i + t + k) % 2 == 1,
                         eps=1e-2 if (i + 2 * t + k) % 3 == 2 else None))
  return out


def full_cases() -> list[Case]:
  out = []
  for kind in ("rms", "layer"):
    for dtype, dim in itertools.product(DTYPES, DIMS):
      for lead, variant, residual in itertools.product(
          LEADS if dim < 4096 else BIG_LEADS, VARIANTS[kind], (False, True)):
        out.append(_case(kind, dtype, lead, dim, variant, residual))
  return out


SAMPLED = sampled_cases()
SAMPLED_IDS = [c.id() for c in SAMPLED]
FULL = [c for c in full_cases() if c not in set(SAMPLED)]

# ---- calling the ops and the references the same way ----------------------------------------


def kernel_fn(kind, implementation, **static):
  """fn(x, weight=, bias=, residual=) -> (y, h): the op under test (h = x without residual)."""

  def fn(x, weight=None, bias=None, residual=None):
    if kind == "rms":
      out = jaxgpu.rms_norm(x, weight, residual=residual, implementation=implementation,
                            **static)
    else:
      out = jaxgpu.layer_norm(x, weight, bias, residual=residual,
                              implementation=implementation, **static)
    return out if residual is not None else (out, x)

  return fn


def ref_fn(kind, h_dtype=None, **static):
  """The same signature on the tests' own jnp reference (any precision); h_dtype: the op's
  dtype, for the float64 oracle (h = x + residual is rounded to it, see oracle.py)."""
  fn = oracle.norm_fn(kind)
  if kind == "rms":
    return lambda x, weight=None, bias=None, residual=None: fn(x, weight, residual,
                                                                h_dtype=h_dtype, **static)
  return lambda x, weight=None, bias=None, residual=None: fn(x, weight, bias, residual,
                                                              h_dtype=h_dtype, **static)


def make_arrays(rng, case: Case, lead=None) -> dict:
  """Random inputs of `case` (x with a random scale and, for layer norm, a random shift)."""
  shape = (case.lead if lead is None else lead) + (case.dim,)
  scale = float(rng.uniform(0.5, 3.0))
  shift = float(rng.uniform(-3, 3)) if case.kind == "layer" else 0.0
  a = {"x": oracle.randn(rng, shape, case.dtype, scale, shift)}
  if case.weight:
    a["weight"] = oracle.randn(rng, (case.dim,), case.dtype, 0.3 if case.offset else 1.0,
                               0.0 if case.offset else 0.5)
  if case.bias:
    a["bias"] = oracle.randn(rng, (case.dim,), case.dtype)
  if case.residual:
    a["residual"] = oracle.randn(rng, shape, case.dtype, scale)
  return a


def make_cotangents(rng, arrays: dict) -> dict:
  """Random cotangents for y (and h when there is a residual), exactly representable in
  the op's dtype, as float32 (the loss is computed in float32)."""
  x = arrays["x"]
  c = {"y": oracle.randn(rng, x.shape, x.dtype).astype(jnp.float32)}
  if "residual" in arrays:
    c["h"] = oracle.randn(rng, x.shape, x.dtype).astype(jnp.float32)
  return c


def loss(fn, arrays: dict, cots: dict):
  """<fn(**arrays), cotangents>: its gradient is one VJP with random cotangents."""
  y, h = fn(**arrays)
  acc = jnp.promote_types(y.dtype, jnp.float32)
  out = jnp.sum(y.astype(acc) * cots["y"].astype(acc))
  if "h" in cots:
    out = out + jnp.sum(h.astype(acc) * cots["h"].astype(acc))
  return out


def to64(tree):
  """A pytree of arrays as float64 jax arrays on the CPU (call inside oracle.x64())."""
  return jax.tree.map(lambda a: jnp.asarray(oracle.as_f64(a)), tree)


def _op_dtype(tree):
  return jax.tree.leaves(tree)[0].dtype


def expected_grads(kind, static, arrays, cots, loss_fn=loss):
  """(float64 oracle, low-precision reference) gradients of loss_fn w.r.t. every array."""
  ref = ref_fn(kind, **static)
  lowp = jax.jit(jax.grad(lambda a, c: loss_fn(ref, a, c)))(arrays, cots)
  ref64 = ref_fn(kind, h_dtype=_op_dtype(arrays), **static)
  with oracle.x64():
    exact = jax.jit(jax.grad(lambda a, c: loss_fn(ref64, a, c)))(to64(arrays), to64(cots))
    exact = jax.tree.map(oracle.as_f64, exact)
  return exact, lowp


def expected_outputs(kind, static, arrays, forward):
  """(float64 oracle, low-precision reference) of forward(fn, arrays) -> pytree."""
  ref = ref_fn(kind, **static)
  lowp = jax.jit(lambda a: forward(ref, a))(arrays)
  ref64 = ref_fn(kind, h_dtype=_op_dtype(arrays), **static)
  with oracle.x64():
    exact = jax.jit(lambda a: forward(ref64, a))(to64(arrays))
    exact = jax.tree.map(oracle.as_f64, exact)
  return exact, lowp


# Backward: the kernels' row reductions (mean(g * xhat)) and the weight-gradient sums run
# in a different order than XLA's; a few more ulps of headroom than the forward.
GRAD_ATOL_ULPS = 8.0


def y_atol(case: Case, arrays) -> float:
  """Rounding atol for layer norm's y: centering h - mean(h) in float32 loses about one
  ulp of |h| (a 3-wide row of values near 3 with a spread of 0.1 keeps ~5 bits fewer), so
  the error is relative to |h| * rstd * |weight|, not to |y|."""
  if case.kind != "layer":
    return 0.0
  h = oracle.as_f64(arrays["x"])
  if "residual" in arrays:
    h = h + oracle.as_f64(arrays["residual"])
  if h.size == 0:
    return 0.0
  c = h - h.mean(-1, keepdims=True)
  rstd = 1 / np.sqrt(np.mean(c * c, -1, keepdims=True) + case.static()["eps"])
  w = np.abs(oracle.as_f64(arrays["weight"])).max() if "weight" in arrays else 1.0
  return 4 * oracle.unit_roundoff(jnp.float32) * float(np.max(np.abs(h) * rstd)) * w


def dx_atol(case: Case, arrays, cots) -> float:
  """Rounding atol for dx/dresidual: rstd * (g - mean(g) - xhat * mean(g * xhat)) cancels
  (D = 1 rms_norm: dx = eps / (x^2 + eps)^1.5 from terms ~1/|x|), so float32 rounding is
  relative to the terms, rstd * |g|, not to the result; for layer norm times the
  centering's loss (xhat is off by about one ulp of |h| * rstd, see y_atol)."""
  x = oracle.as_f64(arrays["x"])
  h = x + oracle.as_f64(arrays["residual"]) if "residual" in arrays else x
  if h.size == 0:
    return 0.0
  eps = case.static()["eps"]
  c = h - h.mean(-1, keepdims=True) if case.kind == "layer" else h
  rstd = 1 / np.sqrt(np.mean(c * c, -1, keepdims=True) + eps)
  g = oracle.as_f64(cots["y"])
  if "weight" in arrays:
    g = g * (case.offset + oracle.as_f64(arrays["weight"]))
  centering = 1 + float(np.max(np.abs(h) * rstd)) if case.kind == "layer" else 1.0
  return 8 * oracle.unit_roundoff(jnp.float32) * float(np.max(rstd * np.abs(g))) * centering


# ---- forward ------------------------------------------------------------------------------


def _check_forward(case: Case, implementation, rng, jit=True):
  arrays = make_arrays(rng, case)
  static = case.static()
  fn = kernel_fn(case.kind, implementation, **static)
  run = jax.jit(lambda a: fn(**a)) if jit else (lambda a: fn(**a))
  y, h = run(arrays)
  assert y.shape == case.shape and y.dtype == jnp.dtype(case.dtype)
  assert h.shape == case.shape and h.dtype == jnp.dtype(case.dtype)
  # The float64 oracle: numpy, on the exact values the inputs hold.
  np_args = {k: v for k, v in arrays.items()}
  y64, h64 = oracle.np_norm_fn(case.kind)(**np_args, **static)
  y_lowp, h_lowp = jax.jit(lambda a: ref_fn(case.kind, **static)(**a))(arrays)
  if case.residual:
    oracle.check(h, h64, h_lowp, what=f"{case.id()} h", dtype=case.dtype)
  oracle.check(y, y64, y_lowp, what=f"{case.id()} y", dtype=case.dtype,
               extra_atol=y_atol(case, arrays))


@pytest.mark.parametrize("case", SAMPLED, ids=SAMPLED_IDS)
def test_forward(case, implementation, rng):
  _check_forward(case, implementation, rng)


def pytest_generate_tests(metafunc):
  """The full matrix (thousands of cases) is only generated with --run-slow."""
  if "full_case" in metafunc.fixturenames:
    cases = FULL if slow_enabled(metafunc.config) else []
    metafunc.parametrize("full_case", cases, ids=[c.id() for c in cases])


@pytest.mark.slow
def test_forward_full_matrix(full_case, implementation, rng):
  _check_forward(full_case, implementation, rng)


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_forward_eager(kind, implementation, rng):
  """Outside jit too (each op runs op by op)."""
  case = Case(kind, jnp.bfloat16, (3, 5), 111, weight=True, bias=kind == "layer",
              offset=1.0 if kind == "rms" else 0.0, residual=True)
  _check_forward(case, implementation, rng, jit=False)


# ---- backward ------------------------------------------------------------------------------


def _check_grads(case: Case, implementation, rng):
  arrays = make_arrays(rng, case)
  cots = make_cotangents(rng, arrays)
  static = case.static()
  fn = kernel_fn(case.kind, implementation, **static)
  got = jax.jit(jax.grad(lambda a, c: loss(fn, a, c)))(arrays, cots)
  assert set(got) == set(arrays)
  for k, v in got.items():
    assert v.shape == arrays[k].shape and v.dtype == arrays[k].dtype, k
  exact, lowp = expected_grads(case.kind, static, arrays, cots)
  row_atol = dx_atol(case, arrays, cots)
  for k in arrays:
    oracle.check(got[k], exact[k], lowp[k], what=f"{case.id()} d{k}", dtype=case.dtype,
                 atol_ulps=GRAD_ATOL_ULPS, extra_atol=row_atol if k in ("x", "residual") else 0.0)


@pytest.mark.parametrize("case", SAMPLED, ids=SAMPLED_IDS)
def test_grad(case, implementation, rng):
  _check_grads(case, implementation, rng)


@pytest.mark.slow
def test_grad_full_matrix(full_case, implementation, rng):
  _check_grads(full_case, implementation, rng)


@pytest.mark.parametrize("case", [
    Case("rms", jnp.bfloat16, (2,), 70001, weight=True, residual=True),
    Case("layer", jnp.float32, (), 70001, weight=True, bias=True),
], ids=lambda c: c.id())
def test_dim_beyond_65536(case, implementation, rng):
  """D must work "from 1 up to at least 65536": once past it, odd, forward and backward."""
  _check_forward(case, implementation, rng)
  _check_grads(case, implementation, rng)


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_weight_grad_deterministic(kind, implementation, rng):
  """dweight/dbias bitwise identical across runs (and across separate compilations)."""
  case = Case(kind, jnp.bfloat16, (64, 33), 111, weight=True, bias=kind == "layer",
              residual=True)
  arrays = make_arrays(rng, case)
  cots = make_cotangents(rng, arrays)
  fn = kernel_fn(kind, implementation, **case.static())
  grad = lambda: jax.jit(jax.grad(lambda a, c: loss(fn, a, c)))  # a fresh compilation
  g1 = grad()(arrays, cots)
  g2 = grad()(arrays, cots)
  g3 = grad()(arrays, cots)
  for name in ("weight", "bias") if kind == "layer" else ("weight",):
    a, b, c = (np.asarray(g[name].astype(jnp.float32)) for g in (g1, g2, g3))
    assert np.isfinite(a).all()
    np.testing.assert_array_equal(a, b, err_msg=f"d{name} differs between runs")
    np.testing.assert_array_equal(a, c, err_msg=f"d{name} differs between runs")


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_forward_mode_unsupported(kind, implementation, rng):
  """custom_vjp has no forward mode: jax.jvp raises (documented in the docstrings)."""
  x = oracle.randn(rng, (3, 59), jnp.float32)
  fn = kernel_fn(kind, implementation)
  if implementation == "xla":
    jax.jvp(lambda x: fn(x)[0], (x,), (x,))  # the reference is plain JAX
    return
  with pytest.raises(TypeError):
    jax.jvp(lambda x: fn(x)[0], (x,), (x,))


# ---- implementation selection ---------------------------------------------------------------


def _custom_call_targets(lowered) -> set[str]:
  """Custom-call targets of a jit(...).lower(...) after compilation (custom_partitioning
  only names its inner calls once partitioned)."""
  return set(re.findall(r'custom_call_target="([^"]+)"', lowered.compile().as_text()))


def _platform_impl():
  return "cuda" if HAS_CUDA else "cpu"


@pytest.mark.parametrize("platform", [
    pytest.param("cuda", marks=pytest.mark.gpu), pytest.param("cpu")])
def test_default_implementation_runs_platform_kernel(platform, rng):
  """implementation=None runs the FFI kernel of the platform XLA places the op on."""
  if platform == "cpu" and HAS_CUDA:
    device = jax.devices("cpu")[0]
  else:
    device = jax.devices()[0]
  x = jax.device_put(oracle.randn(rng, (17, 59), jnp.bfloat16), device)
  w = jax.device_put(oracle.randn(rng, (59,), jnp.bfloat16), device)
  f = jax.jit(lambda x, w: jaxgpu.rms_norm(x, w))
  targets = _custom_call_targets(f.lower(x, w))
  assert "jaxgpu_rms_norm_fwd" in targets, targets
  explicit = jax.jit(lambda x, w: jaxgpu.rms_norm(x, w, implementation=platform))(x, w)
  np.testing.assert_array_equal(np.asarray(f(x, w).astype(jnp.float32)),
                                np.asarray(explicit.astype(jnp.float32)))


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_explicit_implementation_lowers_to_its_target(kind, implementation, rng):
  x = oracle.randn(rng, (5, 3), jnp.float32)
  fn = kernel_fn(kind, implementation)
  targets = _custom_call_targets(jax.jit(lambda x: fn(x)[0]).lower(x))
  if implementation == "xla":
    assert not any(t.startswith("jaxgpu_") for t in targets), targets
  else:
    assert f"jaxgpu_{kind}_norm_fwd_{implementation}" in targets, targets
  grad_targets = _custom_call_targets(
      jax.jit(jax.grad(lambda x: fn(x)[0].sum())).lower(x))
  if implementation != "xla":
    assert f"jaxgpu_{kind}_norm_bwd_{implementation}" in grad_targets, grad_targets


@pytest.mark.parametrize("forced", ["xla", "cpu"])
def test_env_var_forces_implementation(forced, monkeypatch, rng):
  """JAXGPU_IMPLEMENTATION applies to implementation=None, resolved at trace time."""
  if forced == "cpu" and HAS_CUDA:
    pytest.skip("the 'cpu' kernel cannot run on the default (GPU) device")
  x = oracle.randn(rng, (4, 59), jnp.float32)
  monkeypatch.setenv("JAXGPU_IMPLEMENTATION", forced)
  targets = _custom_call_targets(jax.jit(lambda x: jaxgpu.rms_norm(x)).lower(x))
  if forced == "xla":
    assert not any(t.startswith("jaxgpu_") for t in targets), targets
  else:
    assert "jaxgpu_rms_norm_fwd_cpu" in targets, targets
  # An explicit implementation= wins over the variable.
  targets = _custom_call_targets(
      jax.jit(lambda x: jaxgpu.layer_norm(x, implementation="xla")).lower(x))
  assert not any(t.startswith("jaxgpu_") for t in targets), targets
  # And un-jitted calls follow it too.
  y = jaxgpu.rms_norm(x)
  y64, _ = oracle.np_rms_norm(x)
  oracle.check(y, y64, oracle.jnp_rms_norm(x)[0], what="rms_norm under the env var")


def test_env_var_bad_value(monkeypatch):
  monkeypatch.setenv("JAXGPU_IMPLEMENTATION", "bogus")
  with pytest.raises(ValueError, match="JAXGPU_IMPLEMENTATION"):
    jaxgpu.rms_norm(jnp.ones((2, 3)))


@pytest.mark.skipif(HAS_CUDA, reason="this machine has a CUDA backend")
def test_env_var_cuda_without_gpu(monkeypatch):
  monkeypatch.setenv("JAXGPU_IMPLEMENTATION", "cuda")
  with pytest.raises(ValueError, match="cuda"):
    jaxgpu.layer_norm(jnp.ones((2, 3)))


# ---- vmap ----------------------------------------------------------------------------------

B = 3  # vmapped batch size


def _insert_batch(rng, case, name, a, axis):
  """a with a batch axis of size B at `axis`, filled with fresh random values."""
  shape = list(a.shape)
  ax = axis % (a.ndim + 1)
  shape.insert(ax, B)
  if name == "weight":
    return oracle.randn(rng, tuple(shape), a.dtype, 1.0, 0.5)
  scale = 1.0 if name != "x" else float(rng.uniform(0.5, 2.0))
  return oracle.randn(rng, tuple(shape), a.dtype, scale)


def _vmap_case(rng, case: Case, in_axes: dict):
  """Arrays of case with batch axes inserted where in_axes says."""
  arrays = make_arrays(rng, case)
  for name, ax in in_axes.items():
    if ax is not None:
      arrays[name] = _insert_batch(rng, case, name, arrays[name], ax)
  return arrays, {k: in_axes.get(k) for k in arrays}


VMAP_AXES = [
    ("x0", {"x": 0}),
    ("x1", {"x": 1}),
    ("x-1", {"x": -1}),
    ("x0-res0", {"x": 0, "residual": 0}),
    ("x1-res-2", {"x": 1, "residual": -2}),
    ("weight", {"weight": 0}),
    ("bias", {"bias": 0}),
    ("x0-weight0", {"x": 0, "weight": 0}),
    ("x1-weight0-bias0", {"x": 1, "weight": 0, "bias": 0}),
    ("residual", {"residual": 0}),
    ("residual-weight", {"residual": 2, "weight": 0}),
]


def _vmap_params(offset):
  """Each in_axes entry once, the op and dtype rotated (bias exists for layer norm only)."""
  out = []
  for i, (name, axes) in enumerate(VMAP_AXES):
    kind = "layer" if "bias" in axes else ("rms", "layer")[(i + offset) % 2]
    dtype = DTYPES[(i + offset) % len(DTYPES)]
    out.append(pytest.param(kind, axes, dtype,
                            id=f"{kind}-{name}-{jnp.dtype(dtype).name}"))
  return out


VMAP_PARAMS = _vmap_params(0)
VMAP_GRAD_PARAMS = _vmap_params(1)   # the other op for each in_axes


def _vmap_case_for(kind, axes, dtype=jnp.float32):
  return Case(kind, dtype, (4, 5), 59, weight=True, bias=kind == "layer",
              offset=1.0 if kind == "rms" else 0.0,
              residual="residual" in axes)


def _forward_vmapped(in_axes, fn, arrays):
  names = list(arrays)
  f = lambda *xs: fn(**dict(zip(names, xs)))
  return jax.vmap(f, in_axes=tuple(in_axes[n] for n in names))(*[arrays[n] for n in names])


@pytest.mark.parametrize("kind,axes,dtype", VMAP_PARAMS)
def test_vmap(kind, axes, dtype, implementation, rng):
  case = _vmap_case_for(kind, axes, dtype)
  arrays, in_axes = _vmap_case(rng, case, axes)
  static = case.static()
  forward = functools.partial(_forward_vmapped, in_axes)
  got = jax.jit(lambda a: forward(kernel_fn(kind, implementation, **static), a))(arrays)
  exact, lowp = expected_outputs(kind, static, arrays, forward)
  oracle.check_tree(got, exact, lowp, f"vmap {axes}", dtype)
  # And against the numpy oracle, one example at a time.
  y = np.asarray(got[0].astype(jnp.float32))
  for i in range(B):
    ex = {k: (v if in_axes[k] is None else np.take(np.asarray(v), i, axis=in_axes[k]))
          for k, v in arrays.items()}
    y64, _ = oracle.np_norm_fn(kind)(**ex, **static)
    tol = 8 * oracle.unit_roundoff(dtype) * (1 + np.abs(y64).max())
    np.testing.assert_allclose(y[i], y64, atol=tol, rtol=0)


def _grad_vmapped(in_axes, fn, arrays, cots):
  """Per-example gradients: vmap(grad) with every array's batch axis from in_axes and the
  cotangents batched along x's leading dims."""
  names = list(arrays)

  def per_example(*xs_and_cots):
    xs, cy, ch = xs_and_cots[:len(names)], xs_and_cots[-2], xs_and_cots[-1]
    c = {"y": cy} if ch is None else {"y": cy, "h": ch}
    return jax.grad(lambda a: loss(fn, a, c))(dict(zip(names, xs)))

  axes = tuple(in_axes[n] for n in names) + (0, 0 if "h" in cots else None)
  return jax.vmap(per_example, in_axes=axes)(*[arrays[n] for n in names], cots["y"],
                                             cots.get("h"))


@pytest.mark.parametrize("kind,axes,dtype", VMAP_GRAD_PARAMS)
def test_vmap_of_grad(kind, axes, dtype, implementation, rng):
  """vmap(grad): per-example gradients of every argument (per-example weight gradients)."""
  case = _vmap_case_for(kind, axes, dtype)
  arrays, in_axes = _vmap_case(rng, case, axes)
  out_shape = (B,) + case.shape
  cots = {"y": oracle.randn(rng, out_shape, dtype).astype(jnp.float32)}
  if case.residual:
    cots["h"] = oracle.randn(rng, out_shape, dtype).astype(jnp.float32)
  static = case.static()
  grad_fn = lambda fn, a, c: _grad_vmapped(in_axes, fn, a, c)
  got = jax.jit(lambda a, c: grad_fn(kernel_fn(kind, implementation, **static), a, c))(
      arrays, cots)
  for k, v in got.items():
    assert v.shape == (B,) + (case.shape if k in ("x", "residual") else (case.dim,)), k
  exact, lowp = expected_outputs(kind, static, (arrays, cots),
                                 lambda fn, ac: grad_fn(fn, *ac))
  oracle.check_tree(got, exact, lowp, f"vmap(grad) {axes}", dtype, atol_ulps=GRAD_ATOL_ULPS)


@pytest.mark.parametrize("kind,weight_axis", [("rms", None), ("layer", None), ("rms", 0)])
def test_grad_of_vmap(kind, weight_axis, implementation, rng):
  """grad(vmap): a shared weight's gradient sums over the vmapped axis too."""
  case = Case(kind, jnp.bfloat16, (7,), 111, weight=True, bias=kind == "layer",
              residual=True)
  axes = {"x": 1, "residual": 1, "weight": weight_axis}
  arrays, in_axes = _vmap_case(rng, case, axes)
  y_shape = (B,) + case.shape
  cots = {"y": oracle.randn(rng, y_shape, case.dtype).astype(jnp.float32),
          "h": oracle.randn(rng, y_shape, case.dtype).astype(jnp.float32)}
  loss_fn = lambda fn, a, c: loss(lambda **kw: _forward_vmapped(in_axes, fn, kw), a, c)
  static = case.static()
  got = jax.jit(jax.grad(lambda a, c: loss_fn(kernel_fn(kind, implementation, **static),
                                              a, c)))(arrays, cots)
  exact, lowp = expected_grads(kind, static, arrays, cots, loss_fn=loss_fn)
  oracle.check_tree(got, exact, lowp, "grad(vmap)", case.dtype, atol_ulps=GRAD_ATOL_ULPS)


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_nested_vmap(kind, implementation, rng):
  """vmap(vmap): x batched twice, the weight batched by the outer vmap only; and the grad."""
  case = Case(kind, jnp.float16, (5,), 59, weight=True, bias=kind == "layer", residual=True)
  static = case.static()
  x = oracle.randn(rng, (2, 5, 3, 59), case.dtype)        # outer axis 0, inner axis 1
  r = oracle.randn(rng, (2, 5, 3, 59), case.dtype)
  w = oracle.randn(rng, (2, 59), case.dtype, 1.0, 0.5)    # outer only
  b = oracle.randn(rng, (59,), case.dtype)                # shared
  arrays = {"x": x, "residual": r, "weight": w, "bias": b} if kind == "layer" else {
      "x": x, "residual": r, "weight": w}

  def forward(fn, a):
    inner = jax.vmap(lambda x, r, w, b: fn(x=x, residual=r, weight=w,
                                           **({"bias": b} if b is not None else {})),
                     in_axes=(1, 1, None, None))
    outer = jax.vmap(inner, in_axes=(0, 0, 0, None))
    return outer(a["x"], a["residual"], a["weight"], a.get("bias"))

  got = jax.jit(lambda a: forward(kernel_fn(kind, implementation, **static), a))(arrays)
  assert got[0].shape == (2, 3, 5, 59)
  exact, lowp = expected_outputs(kind, static, arrays, forward)
  oracle.check_tree(got, exact, lowp, "vmap(vmap)", case.dtype)

  cots = {"y": oracle.randn(rng, (2, 3, 5, 59), case.dtype).astype(jnp.float32),
          "h": oracle.randn(rng, (2, 3, 5, 59), case.dtype).astype(jnp.float32)}
  loss_fn = lambda fn, a, c: loss(lambda **kw: forward(fn, kw), a, c)
  g = jax.jit(jax.grad(lambda a, c: loss_fn(kernel_fn(kind, implementation, **static), a, c)))(
      arrays, cots)
  exact, lowp = expected_grads(kind, static, arrays, cots, loss_fn=loss_fn)
  oracle.check_tree(g, exact, lowp, "grad(vmap(vmap))", case.dtype, atol_ulps=GRAD_ATOL_ULPS)


# ---- sharding on 8 fake CPU devices -----------------------------------------------------------


def _put(mesh, tree, specs):
  return {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in tree.items()}


def _sharding_case(kind, dim, dtype=jnp.float32):
  return Case(kind, dtype, (8, 6), dim, weight=True, bias=kind == "layer",
              offset=1.0 if kind == "rms" else 0.0, residual=True)


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_sharded_rows(kind, axis_type, host_implementation, cpu_devices, rng):
  """Leading dims sharded over a (4, 2) mesh: forward with no collective, backward with
  only the dweight/dbias all-reduce, outputs keeping the input's row sharding."""
  mesh = oracle.mesh_4x2(cpu_devices, axis_type)
  case = _sharding_case(kind, 59, jnp.bfloat16)
  static = case.static()
  arrays = make_arrays(rng, case)
  cots = make_cotangents(rng, arrays)
  row = P("a", "b", None)
  specs = {"x": row, "residual": row, "weight": P(), "bias": P()}
  fn = kernel_fn(kind, host_implementation, **static)

  def run():
    a = _put(mesh, arrays, specs)
    c = _put(mesh, cots, {"y": row, "h": row})
    fwd = jax.jit(lambda a: fn(**a))
    bwd = jax.jit(jax.grad(lambda a, c: loss(fn, a, c)))
    fwd_hlo = fwd.lower(a).compile().as_text()
    bwd_hlo = bwd.lower(a, c).compile().as_text()
    return fwd(a), bwd(a, c), fwd_hlo, bwd_hlo

  (y, h), grads, fwd_hlo, bwd_hlo = oracle.run_on_mesh(mesh, axis_type, run)
  assert oracle.collectives(fwd_hlo) == set(), oracle.collectives(fwd_hlo)
  assert oracle.collectives(bwd_hlo) == {"all-reduce"}, oracle.collectives(bwd_hlo)
  for out in (y, h, grads["x"], grads["residual"]):
    assert oracle.spec_of(out) == ("a", "b", None), out.sharding
  for name in ("weight", "bias") if kind == "layer" else ("weight",):
    assert oracle.spec_of(grads[name]) == (None,), grads[name].sharding
  if axis_type == "explicit":
    assert jax.typeof(y).sharding.spec == P("a", "b", None)
    assert jax.typeof(grads["weight"]).sharding.spec in (P(), P(None))

  exact, lowp = expected_outputs(kind, static, arrays, lambda fn, a: fn(**a))
  oracle.check_tree((y, h), exact, lowp, "sharded forward", case.dtype)
  exact, lowp = expected_grads(kind, static, arrays, cots)
  oracle.check_tree(grads, exact, lowp, "sharded grad", case.dtype, atol_ulps=GRAD_ATOL_ULPS)


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_sharded_feature_dim(kind, axis_type, host_implementation, cpu_devices, rng):
  """D sharded (x over 'b', weight over 'b' too): still correct, by a gather."""
  mesh = oracle.mesh_4x2(cpu_devices, axis_type)
  case = _sharding_case(kind, 118)   # 2 x 59
  static = case.static()
  arrays = make_arrays(rng, case)
  cots = make_cotangents(rng, arrays)
  specs = {"x": P("a", None, "b"), "residual": P("a", None, "b"), "weight": P("b"),
           "bias": P(None)}
  fn = kernel_fn(kind, host_implementation, **static)

  def run():
    a = _put(mesh, arrays, specs)
    c = _put(mesh, cots, {"y": P("a", None, "b"), "h": P("a", None, "b")})
    fwd = jax.jit(lambda a: fn(**a))
    bwd = jax.jit(jax.grad(lambda a, c: loss(fn, a, c)))
    return fwd(a), bwd(a, c), fwd.lower(a).compile().as_text()

  (y, h), grads, fwd_hlo = oracle.run_on_mesh(mesh, axis_type, run)
  if host_implementation != "xla":
    # The kernel needs whole rows: a collective is expected, never a silent wrong answer.
    assert oracle.collectives(fwd_hlo), "expected a gather of the sharded feature dim"
  exact, lowp = expected_outputs(kind, static, arrays, lambda fn, a: fn(**a))
  oracle.check_tree((y, h), exact, lowp, "D-sharded forward", case.dtype)
  exact, lowp = expected_grads(kind, static, arrays, cots)
  oracle.check_tree(grads, exact, lowp, "D-sharded grad", case.dtype, atol_ulps=GRAD_ATOL_ULPS)


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_sharded_rank1_and_replicated(kind, host_implementation, cpu_devices, rng):
  """Replicated inputs on the mesh, and a rank-1 x sharded over D, stay correct."""
  mesh = oracle.mesh_4x2(cpu_devices, "auto")
  case = Case(kind, jnp.float32, (), 64, weight=True, bias=kind == "layer")
  static = case.static()
  arrays = make_arrays(rng, case)
  fn = kernel_fn(kind, host_implementation, **static)
  exact, lowp = expected_outputs(kind, static, arrays, lambda fn, a: fn(**a)[0])
  for specs in ({"x": P(), "weight": P(), "bias": P()},
                {"x": P(("a", "b")), "weight": P(), "bias": P("a")}):
    y = jax.jit(lambda a: fn(**a)[0])(_put(mesh, arrays, specs))
    oracle.check_tree(y, exact, lowp, f"rank-1 {specs['x']}", case.dtype)


def _sm_mesh(cpu_devices):
  return jax.make_mesh((4, 2), ("a", "b"), axis_types=(AxisType.Auto,) * 2,
                       devices=cpu_devices)


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_shard_map(kind, host_implementation, cpu_devices, rng):
  """Inside shard_map (rows split 8 ways): forward, grad inside (with and without
  check_vma) and grad of the shard_map, against the oracle."""
  mesh = _sm_mesh(cpu_devices)
  case = _sharding_case(kind, 111, jnp.bfloat16)
  static = case.static()
  arrays = make_arrays(rng, case)
  cots = make_cotangents(rng, arrays)
  fn = kernel_fn(kind, host_implementation, **static)
  rows = P(("a", "b"))
  a_specs = {k: (rows if k in ("x", "residual") else P()) for k in arrays}
  c_specs = {k: rows for k in cots}

  def sharded_forward(fn, a):
    return shard_map(lambda a: fn(**a), mesh=mesh, in_specs=(a_specs,),
                     out_specs=(rows, rows))(a)

  y, h = jax.jit(lambda a: sharded_forward(fn, a))(arrays)
  exact, lowp = expected_outputs(kind, static, arrays, lambda fn, a: fn(**a))
  oracle.check_tree((y, h), exact, lowp, "shard_map forward", case.dtype)
  exact, lowp = expected_grads(kind, static, arrays, cots)

  # grad of the shard_map.
  g_out = jax.jit(jax.grad(lambda a, c: loss(lambda **kw: sharded_forward(fn, kw), a, c)))(
      arrays, cots)
  oracle.check_tree(g_out, exact, lowp, "grad of shard_map", case.dtype, atol_ulps=GRAD_ATOL_ULPS)

  # grad inside, check_vma=False: per-shard parameter gradients, summed by the caller.
  def inner_grad_psum(a, c):
    g = jax.grad(lambda a: loss(fn, a, c))(a)
    return {k: (v if k in ("x", "residual") else jax.lax.psum(v, ("a", "b")))
            for k, v in g.items()}

  g_in = jax.jit(shard_map(inner_grad_psum, mesh=mesh, in_specs=(a_specs, c_specs),
                           out_specs=a_specs, check_vma=False))(arrays, cots)
  oracle.check_tree(g_in, exact, lowp, "grad inside shard_map (check_vma=False)", case.dtype,
             atol_ulps=GRAD_ATOL_ULPS)

  # grad inside, check_vma=True (the default): the gradient of a replicated (invariant)
  # parameter is already summed over the shards, as for any JAX function.
  def inner_grad(a, c):
    return jax.grad(lambda a: loss(fn, a, c))(a)

  g_in = jax.jit(shard_map(inner_grad, mesh=mesh, in_specs=(a_specs, c_specs),
                           out_specs=a_specs))(arrays, cots)
  oracle.check_tree(g_in, exact, lowp, "grad inside shard_map", case.dtype, atol_ulps=GRAD_ATOL_ULPS)


def test_shard_map_outputs_are_varying(host_implementation, cpu_devices, rng):
  """A per-shard result is varying over the mesh axes: returning it as replicated
  (out_specs=P()) must be refused, as for plain JAX, not silently return one shard."""
  mesh = _sm_mesh(cpu_devices)
  x = oracle.randn(rng, (8, 59), jnp.float32)
  f = shard_map(lambda x: jaxgpu.rms_norm(x, implementation=host_implementation), mesh=mesh,
                in_specs=P(("a", "b")), out_specs=P())
  with pytest.raises(ValueError, match="out_specs|vary"):
    jax.jit(f)(x)

  def body(x):
    y = jaxgpu.rms_norm(x, implementation=host_implementation)
    assert oracle.varying_axes(jax.typeof(y)) == {"a", "b"}, jax.typeof(y)
    return y

  jax.jit(shard_map(body, mesh=mesh, in_specs=P(("a", "b")), out_specs=P(("a", "b"))))(x)


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_pmap(kind, host_implementation, cpu_devices, rng):
  """pmap over 4 CPU devices, the weight broadcast: forward and per-device gradients."""
  case = Case(kind, jnp.float32, (4, 3), 59, weight=True, bias=kind == "layer",
              residual=True)
  static = case.static()
  arrays = make_arrays(rng, case)        # x (4, 3, 59): the pmapped axis is 0
  cots = make_cotangents(rng, arrays)
  in_axes = {k: (0 if k in ("x", "residual") else None) for k in arrays}
  fn = kernel_fn(kind, host_implementation, **static)
  names = list(arrays)
  devices = cpu_devices[:4]

  def forward(fn, a):
    f = lambda *xs: fn(**dict(zip(names, xs)))
    return jax.pmap(f, in_axes=tuple(in_axes[n] for n in names), devices=devices)(
        *[a[n] for n in names])

  got = forward(fn, arrays)
  # pmap over devices means vmap over examples: the oracle is the vmapped reference.
  exact, lowp = expected_outputs(kind, static, arrays,
                                 functools.partial(_forward_vmapped, in_axes))
  oracle.check_tree(got, exact, lowp, "pmap forward", case.dtype)

  def per_device(fn):
    def g(*xs_and_cots):
      xs, cy, ch = xs_and_cots[:-2], xs_and_cots[-2], xs_and_cots[-1]
      return jax.grad(lambda a: loss(fn, a, {"y": cy, "h": ch}))(dict(zip(names, xs)))
    return g

  axes = tuple(in_axes[n] for n in names) + (0, 0)
  flat = lambda a, c: [a[n] for n in names] + [c["y"], c["h"]]
  got = jax.pmap(per_device(fn), in_axes=axes, devices=devices)(*flat(arrays, cots))
  exact, lowp = expected_outputs(
      kind, static, (arrays, cots),
      lambda fn, ac: jax.vmap(per_device(fn), in_axes=axes)(*flat(*ac)))
  oracle.check_tree(got, exact, lowp, "pmap grad", case.dtype, atol_ulps=GRAD_ATOL_ULPS)


# ---- bad input ------------------------------------------------------------------------------


def _call(kind, x, weight=None, residual=None, **kw):
  if kind == "rms":
    return jaxgpu.rms_norm(x, weight, residual=residual, **kw)
  return jaxgpu.layer_norm(x, weight, residual=residual, **kw)


BAD_INPUTS = [
    # (id, kwargs-builder, error type, message pattern)
    ("x-scalar", lambda: dict(x=jnp.float32(1.0)), ValueError, r"\bx\b.*rank"),
    ("x-int32", lambda: dict(x=jnp.ones((2, 3), jnp.int32)), TypeError, r"\bx\b.*dtype"),
    ("x-float64", lambda: dict(x=np.ones((2, 3), np.float64)), TypeError, r"\bx\b.*dtype"),
    ("x-string", lambda: dict(x="abc"), TypeError, r"\bx\b"),
    ("weight-shape", lambda: dict(x=jnp.ones((2, 3)), weight=jnp.ones((4,))), ValueError,
     r"weight.*shape"),
    ("weight-rank", lambda: dict(x=jnp.ones((2, 3)), weight=jnp.ones((2, 3))), ValueError,
     r"weight.*shape"),
    ("weight-dtype", lambda: dict(x=jnp.ones((2, 3), jnp.bfloat16), weight=jnp.ones((3,))),
     TypeError, r"weight.*dtype"),
    ("residual-shape", lambda: dict(x=jnp.ones((2, 3)), residual=jnp.ones((3, 3))),
     ValueError, r"residual.*shape"),
    ("residual-broadcastable", lambda: dict(x=jnp.ones((2, 3)), residual=jnp.ones((3,))),
     ValueError, r"residual.*shape"),
    ("residual-dtype", lambda: dict(x=jnp.ones((2, 3)), residual=jnp.ones((2, 3), jnp.float16)),
     TypeError, r"residual.*dtype"),
    ("eps-zero", lambda: dict(x=jnp.ones((2, 3)), eps=0.0), ValueError, r"\beps\b"),
    ("eps-negative", lambda: dict(x=jnp.ones((2, 3)), eps=-1e-5), ValueError, r"\beps\b"),
    ("eps-nan", lambda: dict(x=jnp.ones((2, 3)), eps=float("nan")), ValueError, r"\beps\b"),
    ("eps-inf", lambda: dict(x=jnp.ones((2, 3)), eps=float("inf")), ValueError, r"\beps\b"),
    ("eps-string", lambda: dict(x=jnp.ones((2, 3)), eps="big"), TypeError, r"\beps\b"),
    ("implementation-bogus", lambda: dict(x=jnp.ones((2, 3)), implementation="bogus"),
     ValueError, r"implementation"),
]


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("build,error,match", [b[1:] for b in BAD_INPUTS],
                         ids=[b[0] for b in BAD_INPUTS])
def test_bad_input(kind, build, error, match):
  kw = build()
  with pytest.raises(error, match=match):
    _call(kind, **kw)
  # The same at trace time, under jit (arrays only; the rest closed over).
  arrays = {k: v for k, v in kw.items() if isinstance(v, (jax.Array, np.ndarray))}
  rest = {k: v for k, v in kw.items() if k not in arrays}
  if arrays and all(jnp.dtype(a.dtype) != jnp.float64 for a in arrays.values()):
    with pytest.raises(error, match=match):
      jax.jit(lambda a: _call(kind, **a, **rest))(arrays)


@pytest.mark.parametrize("build,error,match", [
    (lambda: dict(bias=jnp.ones((4,))), ValueError, r"bias.*shape"),
    (lambda: dict(bias=jnp.ones((3,), jnp.float16)), TypeError, r"bias.*dtype"),
], ids=["bias-shape", "bias-dtype"])
def test_bad_bias(build, error, match):
  with pytest.raises(error, match=match):
    jaxgpu.layer_norm(jnp.ones((2, 3)), **build())


@pytest.mark.parametrize("value,error", [(float("nan"), ValueError), (float("inf"), ValueError),
                                         (-float("inf"), ValueError), ("one", TypeError)])
def test_bad_weight_offset(value, error):
  with pytest.raises(error, match="weight_offset"):
    jaxgpu.rms_norm(jnp.ones((2, 3)), jnp.ones((3,)), weight_offset=value)


def test_traced_eps_rejected():
  with pytest.raises(TypeError, match="eps"):
    jax.jit(lambda x, e: jaxgpu.rms_norm(x, eps=e))(jnp.ones((2, 3)), 1e-5)


@pytest.mark.skipif(HAS_CUDA, reason="this machine has a CUDA backend")
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_cuda_without_gpu(kind):
  with pytest.raises(ValueError, match="implementation='cuda'"):
    _call(kind, jnp.ones((2, 3)), implementation="cuda")


# ---- size 0 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(0, 8), (3, 0), (0,), (2, 0, 5)], ids=str)
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_size_zero(kind, shape, implementation):
  dim = shape[-1]
  case = Case(kind, jnp.bfloat16, shape[:-1], dim, weight=True, bias=kind == "layer",
              residual=True)
  arrays = {"x": jnp.zeros(shape, case.dtype), "residual": jnp.zeros(shape, case.dtype),
            "weight": jnp.ones((dim,), case.dtype)}
  if kind == "layer":
    arrays["bias"] = jnp.ones((dim,), case.dtype)
  fn = kernel_fn(kind, implementation)
  y, h = jax.jit(lambda a: fn(**a))(arrays)
  assert y.shape == shape and h.shape == shape and y.dtype == case.dtype
  y2 = fn(arrays["x"])[0]  # eager, no weight, no residual
  assert y2.shape == shape
  cots = {"y": jnp.zeros(shape, jnp.float32), "h": jnp.zeros(shape, jnp.float32)}
  g = jax.jit(jax.grad(lambda a, c: loss(fn, a, c)))(arrays, cots)
  for k, v in g.items():
    assert v.shape == arrays[k].shape and v.dtype == arrays[k].dtype, k
    # Sums over no rows are zero.
    assert not np.asarray(v.astype(jnp.float32)).any(), k


# ---- accepted input forms -------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_numpy_inputs(kind, implementation, rng):
  """numpy arrays are accepted like jax arrays."""
  x = np.asarray(rng.standard_normal((3, 59)), np.float32)
  w = np.asarray(rng.standard_normal(59), np.float32)
  y = _call(kind, x, w, implementation=implementation)
  y64 = oracle.np_norm_fn(kind)(x, w)[0]
  low = oracle.norm_fn(kind)(jnp.asarray(x), jnp.asarray(w))[0]
  oracle.check(y, y64, low, what="numpy inputs")
