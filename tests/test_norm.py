"""rms_norm and layer_norm (jaxgpu/ops/norm.py, kernels in ffi/norm/): the numerics, run
against every implementation (the `implementation` fixture, conftest.py). The transform
contract (vmap, sharding, shard_map, pmap, bad inputs, size 0, targets) is
tests/test_contract.py's, from the specs in tests/specs/norm.py.

Error rule (tests/oracle.py): max error against float64 at most 2x that of a pure-JAX
reference computed in the same low precision, plus a small rounding atol; NaN never passes.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgpu

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
  inputs = make(rng, case)
  cots = _cotangents(rng, case)
  runs = [_grad_fn(case, implementation, inputs.static)(inputs.arrays, cots)  # fresh compiles
          for _ in range(3)]
  for name in ("weight", "bias") if kind == "layer" else ("weight",):
    a, b, c = (np.asarray(g[name].astype(jnp.float32)) for g in runs)
    assert np.isfinite(a).all()
    np.testing.assert_array_equal(a, b, err_msg=f"d{name} differs between runs")
    np.testing.assert_array_equal(a, c, err_msg=f"d{name} differs between runs")


def test_traced_eps_rejected():
  with pytest.raises(TypeError, match="eps"):
    jax.jit(lambda x, e: jaxgpu.rms_norm(x, eps=e))(jnp.ones((2, 3)), 1e-5)
