"""rms_norm and layer_norm (jaxgpu/ops/norm.py, kernels in ffi/norm/): the numerics, run
against every implementation (the `implementation` fixture, conftest.py). The transform
contract (vmap, sharding, shard_map, pmap, bad inputs, size 0, targets) is
tests/test_contract.py's, from the specs in tests/specs/norm.py.

Error rule (tests/oracle.py): max error against float64 at most 2x that of a pure-JAX
reference computed in the same low precision, plus a small rounding atol; NaN never passes.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgpu
from jaxgpu import _ffi

import contract as C
import oracle
from conftest import slow_enabled
from specs import SPECS
from specs.norm import GRAD_ATOL_ULPS, KINDS, Case, dx_atol, make, y_atol

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


def pytest_generate_tests(metafunc):
  """The full matrix (thousands of cases) is only generated with --run-slow."""
  if "full_case" in metafunc.fixturenames:
    cases = FULL if slow_enabled(metafunc.config) else []
    metafunc.parametrize("full_case", cases, ids=[c.id() for c in cases])


# ---- forward ------------------------------------------------------------------------------


def _check_forward(case: Case, implementation, rng, jit=True):
  inputs = make(rng, case)
  arrays, static = inputs.arrays, inputs.static
  fn = C.op_fn(SPECS[KINDS[case.kind]], implementation, static)
  outs = (jax.jit(fn) if jit else fn)(arrays)
  y, h = outs[0], outs[1] if case.residual else arrays["x"]
  assert y.shape == case.shape and y.dtype == jnp.dtype(case.dtype)
  assert h.shape == case.shape and h.dtype == jnp.dtype(case.dtype)
  # The float64 oracle: numpy, on the exact values the inputs hold.
  y64, h64 = oracle.np_norm_fn(case.kind)(**arrays, **static)
  lowp = jax.jit(C.ref_fn(SPECS[KINDS[case.kind]], static))(arrays)
  if case.residual:
    oracle.check(h, h64, lowp[1], what=f"{case.id()} h", dtype=case.dtype)
  oracle.check(y, y64, lowp[0], what=f"{case.id()} y", dtype=case.dtype,
               extra_atol=y_atol(case.kind, arrays, static["eps"]))


@pytest.mark.parametrize("case", SAMPLED, ids=SAMPLED_IDS)
def test_forward(case, implementation, rng):
  _check_forward(case, implementation, rng)


@pytest.mark.slow
def test_forward_full_matrix(full_case, implementation, rng):
  _check_forward(full_case, implementation, rng)


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_forward_eager(kind, implementation, rng):
  """Outside jit too (each op runs op by op)."""
  case = Case(kind, jnp.bfloat16, (3, 5), 111, weight=True, bias=kind == "layer",
              offset=1.0 if kind == "rms" else 0.0, residual=True)
  _check_forward(case, implementation, rng, jit=False)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("lead", [(1,), (2, 150)], ids=["one-row", "past-one-wave"])
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_forward_both_grid_paths(kind, lead, dtype, implementation, rng):
  """Rows of whole 16-byte vectors (D = 1152, Gemma 3 1b's width) at one row, which the
  CUDA launcher gives its few-row register kernel, and at 300 rows, past one wave of
  blocks on any current GPU, which take the staged kernel."""
  case = Case(kind, dtype, lead, 1152, weight=True, bias=kind == "layer",
              offset=1.0 if kind == "rms" else 0.0, residual=True)
  _check_forward(case, implementation, rng)


# ---- backward ------------------------------------------------------------------------------


def _grad_fn(case: Case, implementation, static):
  return jax.jit(lambda a, c: C.grad_fn(SPECS[KINDS[case.kind]],
                                        C.op_fn(SPECS[KINDS[case.kind]], implementation,
                                                static))(a, c)[0])


def _cotangents(rng, case: Case) -> tuple:
  """Random cotangents for y (and h when there is a residual), exactly representable in
  the op's dtype, as float32."""
  n = 2 if case.residual else 1
  return tuple(oracle.randn(rng, case.shape, case.dtype).astype(jnp.float32) for _ in range(n))


def _check_grads(case: Case, implementation, rng):
  inputs = make(rng, case)
  arrays, static = inputs.arrays, inputs.static
  cots = _cotangents(rng, case)
  got = _grad_fn(case, implementation, static)(arrays, cots)
  assert set(got) == set(arrays)
  for k, v in got.items():
    assert v.shape == arrays[k].shape and v.dtype == arrays[k].dtype, k
  spec = SPECS[KINDS[case.kind]]
  exact, lowp = C.expected(spec, lambda f: lambda a, c: C.grad_fn(spec, f)(a, c)[0], static,
                           case.dtype, arrays, cots)
  row_atol = dx_atol(case.kind, arrays, cots[0], static["eps"], case.offset)
  for k in arrays:
    # The rounding atol in the gradient's own dtype (float32 for float32 parameters).
    oracle.check(got[k], exact[k], lowp[k], what=f"{case.id()} d{k}", dtype=arrays[k].dtype,
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
  inputs = make(rng, case)
  cots = _cotangents(rng, case)
  runs = [_grad_fn(case, implementation, inputs.static)(inputs.arrays, cots)  # fresh compiles
          for _ in range(3)]
  for name in ("weight", "bias") if kind == "layer" else ("weight",):
    a, b, c = (np.asarray(g[name].astype(jnp.float32)) for g in runs)
    assert np.isfinite(a).all()
    np.testing.assert_array_equal(a, b, err_msg=f"d{name} differs between runs")
    np.testing.assert_array_equal(a, c, err_msg=f"d{name} differs between runs")


# ---- float32 parameters beside 16-bit rows (master weights) ---------------------------------


def mixed_cases() -> list[Case]:
  """bfloat16 / float16 rows with float32 weight and/or bias, through every kernel path
  of the parameters' float32 loads: D = 3, 111 (register kernels), 64, 1024 (staged, 1 and
  4 vectors a thread), 4097 (loop), 65536 (wide staged forward, loop backward); residual
  on and off; every variant with a parameter."""
  out = []
  for k, kind in enumerate(("rms", "layer")):
    variants = [v for v in VARIANTS[kind] if v.get("weight") or v.get("bias")]
    for i, dim in enumerate((3, 64, 111, 1024, 4097, 65536)):
      case = _case(kind, (jnp.bfloat16, jnp.float16)[(i + k) % 2],
                   ((17,), (3, 5), (2,))[i % 3] if dim < 4096 else (3,), dim,
                   variants[(i + k) % len(variants)], residual=(i + k) % 2 == 1)
      out.append(dataclasses.replace(case, param_dtype=jnp.float32))
  return out


MIXED = mixed_cases()


@pytest.mark.parametrize("case", MIXED, ids=[c.id() for c in MIXED])
def test_forward_f32_params(case, implementation, rng):
  _check_forward(case, implementation, rng)


@pytest.mark.parametrize("case", MIXED, ids=[c.id() for c in MIXED])
def test_grad_f32_params(case, implementation, rng):
  """dweight / dbias come back float32, held to float32's rounding atol."""
  _check_grads(case, implementation, rng)


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_f32_param_grads_are_not_rounded_to_16_bits(kind, implementation, rng):
  """A float32 weight's (and bias') gradient is summed in float32 and returned in float32:
  within ~1e-6 of float64 relative to its largest entry (about 1e-7 on the CPU, which sums
  in float64), where the same model with bfloat16 parameters gets gradients rounded to
  bfloat16, ~1e-3 off."""
  spec = SPECS[KINDS[kind]]
  case = Case(kind, jnp.bfloat16, (256,), 1024, bias=kind == "layer", param_dtype=jnp.float32)
  inputs = make(rng, case)
  cots = _cotangents(rng, case)
  names = ("weight", "bias") if kind == "layer" else ("weight",)
  grads = lambda f: lambda a, c: C.grad_fn(spec, f)(a, c)[0]

  def rel_errors(arrays):
    got = _grad_fn(case, implementation, inputs.static)(arrays, cots)
    exact, _ = C.expected(spec, grads, inputs.static, case.dtype, arrays, cots)
    out = {}
    for n in names:
      assert got[n].dtype == arrays[n].dtype, n
      e = np.asarray(exact[n], np.float64)
      out[n] = float(np.max(np.abs(oracle.as_f64(got[n]) - e)) / np.max(np.abs(e)))
    return out

  rel32 = rel_errors(inputs.arrays)
  rel16 = rel_errors({**inputs.arrays, **{n: inputs.arrays[n].astype(jnp.bfloat16)
                                          for n in names}})
  print(f"relative gradient errors: float32 parameters {rel32}, bfloat16 {rel16}")
  for n in names:
    assert rel32[n] < 1e-5, (n, rel32[n])
    assert rel16[n] > 1e-4, (n, rel16[n])   # the bfloat16 rounding the float32 path avoids


FWD_TARGETS = {"rms": "jaxgpu_rms_norm_fwd", "layer": "jaxgpu_layer_norm_fwd"}


def _handler_fwd(kind, x, weight, bias):
  """The CPU forward handler called directly (past the Python checks)."""
  g, r, _ = x.shape
  f32 = jnp.float32
  outs = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((0,), x.dtype),
          jax.ShapeDtypeStruct((g, r) if kind == "layer" else (0,), f32),
          jax.ShapeDtypeStruct((g, r), f32))
  target = _ffi.target_name(FWD_TARGETS[kind], "cpu")
  empty = jnp.zeros((0,), x.dtype)
  call = jax.jit(lambda x, w, b: jax.ffi.ffi_call(target, outs)(
      x, empty, w, b, eps=np.float32(1e-5), weight_offset=np.float32(0.0), has_residual=False,
      has_weight=w.size > 0, has_bias=b.size > 0))
  return jax.block_until_ready(call(x, empty if weight is None else weight[None],
                                    empty if bias is None else bias[None]))


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_handler_parameter_dtypes(kind):
  """The handler takes x's dtype or float32 for the parameters, one dtype for both, and
  returns an error naming the parameter otherwise."""
  if "cpu" not in jaxgpu.available_implementations():
    pytest.skip("no CPU module")
  x = jnp.ones((1, 4, 8), jnp.bfloat16)
  ones = lambda dt: jnp.ones((8,), dt)
  y = _handler_fwd(kind, x, ones(jnp.float32), None)[0]
  np.testing.assert_array_equal(np.asarray(y, np.float32), 0.0 if kind == "layer" else 1.0)
  with pytest.raises(Exception, match=r"weight: dtype must be that of x \(bfloat16\) or "
                                      r"float32, got float16"):
    _handler_fwd(kind, x, ones(jnp.float16), None)
  if kind == "layer":
    with pytest.raises(Exception, match=r"bias: dtype bfloat16 differs from the other "
                                        r"parameter's \(float32\)"):
      _handler_fwd(kind, x, ones(jnp.float32), ones(jnp.bfloat16))
    with pytest.raises(Exception, match=r"bias: dtype must be that of x \(bfloat16\) or "
                                        r"float32, got float16"):
      _handler_fwd(kind, x, None, ones(jnp.float16))


def test_mixed_weight_and_bias_dtypes(implementation):
  """A float32 weight with a bias of x's dtype (or the reverse): both are read as float32,
  and each gradient comes back in its own parameter's dtype."""
  x = jnp.asarray(np.random.default_rng(0).standard_normal((6, 16)), jnp.bfloat16)
  w, b = jnp.linspace(0.5, 1.5, 16, dtype=jnp.float32), jnp.linspace(-1, 1, 16)
  for weight, bias in ((w, b.astype(jnp.bfloat16)), (w.astype(jnp.bfloat16), b)):
    loss = lambda w, b, impl: jnp.sum(jaxgpu.layer_norm(x, w, b, implementation=impl)
                                      .astype(jnp.float32) ** 2)
    dw, db = jax.grad(loss, argnums=(0, 1))(weight, bias, implementation)
    rw, rb = jax.grad(loss, argnums=(0, 1))(weight, bias, "xla")
    assert (dw.dtype, db.dtype) == (weight.dtype, bias.dtype)
    np.testing.assert_allclose(np.asarray(dw, np.float32), np.asarray(rw, np.float32),
                               rtol=2e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(db, np.float32), np.asarray(rb, np.float32),
                               rtol=2e-2, atol=1e-2)


def test_traced_eps_rejected():
  with pytest.raises(TypeError, match="eps"):
    jax.jit(lambda x, e: jaxgpu.rms_norm(x, eps=e))(jnp.ones((2, 3)), 1e-5)
