"""rope (jaxgpu/ops/rope.py, kernels in ffi/rope/): the numerics and semantics, run against
every implementation (the `implementation` fixture, conftest.py). The transform contract
(vmap, sharding, shard_map, pmap, bad inputs, size 0, targets) is tests/test_contract.py's,
from the spec in tests/specs/rope.py, which also holds the oracles, independent of
jaxgpu.reference: the complex product (a + ib) * exp(i * angle) in float64 numpy, jax.grad
of the same complex formula in float64 (oracle.x64()), and exact large-position angles
(Python decimal). Error rule (tests/oracle.py): max error against float64 at most 2x that
of the pure-JAX reference computed in the same low precision, plus a small rounding atol;
NaN never passes. The reference itself is also held to an absolute float32 bound (it is the
'xla' implementation, and the 2x rule against itself proves nothing).
"""

from __future__ import annotations

import dataclasses
import decimal
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgpu
from jaxgpu import _ffi
from jaxgpu.reference import rope as reference

import oracle
from specs.rope import (Case, exact_angles, inv_freq64, jnp_rope64, make_positions, make_x,
                        np_rope)

DTYPES = oracle.DTYPES
LAYOUTS = ("half", "interleaved")
HEAD_DIMS = (2, 6, 96, 128, 256)
SEQS = (1, 17, 113)


# ---- cases ------------------------------------------------------------------------------------


def sampled_cases() -> list[Case]:
  """Every (dtype, H, layout) once; T, heads, leading dims, partial rotary, shared
  positions, position range and theta rotated across them."""
  leads = ((2,), (1,), (), (2, 2))
  heads = (3, 1, 4, 2)
  out = []
  for t, dtype in enumerate(DTYPES):
    for h, dim in enumerate(HEAD_DIMS):
      for k, layout in enumerate(LAYOUTS):
        i = 2 * h + k + t
        seq = SEQS[i % len(SEQS)]
        lead = leads[i % len(leads)]
        rotary = None
        if i % 3 == 1 and dim > 2:
          rotary = dim // 2 if (dim // 2) % 2 == 0 else dim - 2   # partial rotary
        out.append(Case(dtype, lead + (seq, heads[i % len(heads)], dim), layout, rotary,
                        shared=(i % 2 == 1 and lead != ()),
                        max_pos=(4096, 10**6, 2**31 - 1)[i % 3],
                        theta=(10000.0, 500000.0)[(i // 3) % 2]))
  return out


SAMPLED = sampled_cases()
SAMPLED_IDS = [c.id() for c in SAMPLED]


def op(implementation, **kw):
  return lambda x, p: jaxgpu.rope(x, p, implementation=implementation, **kw)


def ref(**kw):
  return lambda x, p: reference.rope(x, p, **kw)


def oracle_angles(case: Case, positions):
  """float64 angles; exact (decimal) beyond 10^6, where float64's own product drifts."""
  r = case.shape[-1] if case.rotary_dim is None else case.rotary_dim
  if case.max_pos > 10**6:
    return exact_angles(positions, case.theta, r)
  pos = np.asarray(positions, np.float64)
  return pos[..., None] * inv_freq64(case.theta, r)


def expected(case: Case, x, positions):
  """(float64 oracle, low-precision reference) of the forward pass."""
  ang = oracle_angles(case, positions)
  ang = np.broadcast_to(ang, x.shape[:-2] + ang.shape[-1:])
  y64 = np_rope(x, positions, case.theta, case.layout, case.rotary_dim, angles=ang)
  lowp = jax.jit(ref(**case.kw()))(x, positions)
  return y64, lowp


# ---- forward --------------------------------------------------------------------------------


def angle_atol(max_pos: int, implementation) -> float:
  """The kernels' documented angle error (radians) at |positions| <= max_pos: the double
  product position * inv_freq and the double inv_freq carry ~4 roundings of 2^-53
  relative, negligible below 2^24 (< 2e-9 rad), up to ~1e-6 rad at 2^31. The reference
  (exact integer turns) has none."""
  if implementation == "xla" or max_pos <= 2**24:
    return 0.0
  return 4 * 2.0**-53 * max_pos


def _check_forward(case: Case, implementation, rng, jit=True):
  x = make_x(rng, case)
  positions = make_positions(rng, case)
  fn = op(implementation, **case.kw())
  y = (jax.jit(fn) if jit else fn)(x, positions)
  assert y.shape == x.shape and y.dtype == x.dtype
  y64, lowp = expected(case, x, positions)
  extra = angle_atol(case.max_pos, implementation) * float(np.abs(y64).max(initial=0.0))
  oracle.check(y, y64, lowp, what=case.id(), dtype=case.dtype, extra_atol=extra)
  r = case.rotary_dim or case.shape[-1]
  np.testing.assert_array_equal(np.asarray(y[..., r:]), np.asarray(x[..., r:]),
                                err_msg="features past rotary_dim must pass through unchanged")


@pytest.mark.parametrize("case", SAMPLED, ids=SAMPLED_IDS)
def test_forward(case, implementation, rng):
  _check_forward(case, implementation, rng)


def test_forward_eager(implementation, rng):
  _check_forward(Case(jnp.bfloat16, (2, 5, 3, 8), "interleaved", shared=True), implementation,
                 rng, jit=False)


@pytest.mark.parametrize("case", [
    # Shapes that pick each CUDA path: narrow vectors (H = 2, 6; r/2 odd), copy lanes,
    # head counts around the unroll (4) and heads-per-thread (8) defaults, more lanes
    # than a block has threads (H = 4096 float32: 512 lanes), rank-3 and rank-5 x.
    Case(jnp.bfloat16, (2, 3, 13, 64), "half", rotary_dim=24),
    Case(jnp.float16, (3, 2, 9, 12), "interleaved", rotary_dim=6),
    Case(jnp.float32, (1, 2, 5, 4096), "half"),
    Case(jnp.bfloat16, (1, 2, 2, 4096), "interleaved", rotary_dim=2048),
    Case(jnp.float32, (7, 16, 2), "interleaved"),
    Case(jnp.bfloat16, (2, 2, 3, 4, 8), "half", shared=True),
    Case(jnp.float16, (2, 5, 17, 10), "half", rotary_dim=2),
], ids=lambda c: c.id())
def test_forward_kernel_paths(case, implementation, rng):
  _check_forward(case, implementation, rng)


_TUNED_ROPE = """
import sys
import jax, jax.numpy as jnp, numpy as np
import jaxgpu
d = np.load(sys.argv[1])
rope = jax.jit(lambda x, p: jaxgpu.rope(x, p, layout="half", rotary_dim=96,
                                        implementation="cuda"))
y = rope(jnp.asarray(d["x"], jnp.bfloat16), d["p"])
np.save(sys.argv[2], np.asarray(y.astype(jnp.float32)))
"""


@pytest.mark.parametrize("tuning", [(1, 1), (3, 2), (8, 8), (32, 4), (5, 1)], ids=str)
def test_tuning_knob(tuning, implementation, rng, tmp_path):
  """The CUDA kernel's developer knob JAXGPU_ROPE_TUNE="heads_per_thread,unroll" changes
  nothing but speed. It exists only in a build with JAXGPU_DEV_KNOBS=ON, and is read once
  per process: each setting runs in its own."""
  if implementation != "cuda" or not _ffi.cuda_module().dev_knobs():
    pytest.skip("the knob is the CUDA kernel's, in a JAXGPU_DEV_KNOBS build")
  case = Case(jnp.bfloat16, (2, 7, 13, 128), "half", rotary_dim=96)
  x, positions = make_x(rng, case), make_positions(rng, case)
  np.savez(tmp_path / "in.npz", x=np.asarray(x.astype(jnp.float32)), p=np.asarray(positions))
  env = dict(os.environ, JAXGPU_ROPE_TUNE=",".join(map(str, tuning)))
  subprocess.run([sys.executable, "-c", _TUNED_ROPE, str(tmp_path / "in.npz"),
                  str(tmp_path / "y.npy")], env=env, check=True)
  y = jnp.asarray(np.load(tmp_path / "y.npy"), case.dtype)
  y64, lowp = expected(case, x, positions)
  oracle.check(y, y64, lowp, what=f"tuning {tuning}", dtype=case.dtype)


# ---- accuracy at long context ---------------------------------------------------------------


@pytest.mark.parametrize("max_pos", [10**6, 2**31 - 1], ids=["1e6", "int32"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_large_positions_absolute(layout, max_pos, implementation, rng):
  """float32 accuracy at positions up to 10^6 and over the whole int32 range, held to an
  absolute bound (this also tests the reference, whose 2x rule is against itself), where
  a float32 position * inv_freq product is off by far more."""
  case = Case(jnp.float32, (2, 64, 2, 128), layout, max_pos=max_pos)
  x = make_x(rng, case)
  positions = make_positions(rng, case, signed=True)
  positions = positions.at[0, :4].set(jnp.asarray([max_pos, -max_pos, 0, 1], jnp.int32))
  y = jax.jit(op(implementation, **case.kw()))(x, positions)
  ang = exact_angles(positions, case.theta, 128)
  y64 = np_rope(x, positions, angles=ang, layout=layout)
  scale = float(np.abs(y64).max())
  err = float(np.abs(oracle.as_f64(y) - y64).max())
  # ~1e-7 rad of angle plus float32 rounding of the products: a few ulps of the scale
  # (plus, for the kernels past 2^24, their double inv_freq's rounding: angle_atol).
  budget = (6 * oracle.unit_roundoff(jnp.float32) + angle_atol(max_pos, implementation)) * scale
  assert err <= budget, (err, budget, scale)

  # What this guards against: the float32 product drifts by ~0.1 rad at 10^6.
  naive_angle = (positions.astype(jnp.float32)[..., None]
                 * jnp.asarray(inv_freq64(case.theta, 128), jnp.float32))
  naive = np_rope(x, positions, layout=layout,
                  angles=np.asarray(naive_angle, np.float64))
  assert np.abs(naive - y64).max() > 1e-3 * scale


def test_reference_angles_exact(rng):
  """The reference's integer turns W match the exact angle to ~2^-32 turn, for theta < 1
  and > 1, every int32 extreme; and its sin/cos to float32 accuracy."""
  for theta, r in ((10000.0, 128), (500000.0, 64), (0.5, 8), (1e6, 2)):
    pos = np.concatenate([rng.integers(-2**31, 2**31 - 1, 40, endpoint=True),
                          [2**31 - 1, -2**31, 0, 1, -1]]).astype(np.int32)
    ang = exact_angles(pos, theta, r)
    turns = np.asarray(jax.jit(lambda p: reference.angle_turns(p, theta, r))(pos), np.float64)
    got = turns / 2**32 * 2 * np.pi
    diff = np.angle(np.exp(1j * (got - ang)))               # mod 2 pi
    assert np.abs(diff).max() < 4e-9, (theta, r, np.abs(diff).max())
    s, c = jax.jit(lambda p: reference.sin_cos(p, theta, r))(pos)
    assert np.abs(oracle.as_f64(s) - np.sin(ang)).max() < 2e-7
    assert np.abs(oracle.as_f64(c) - np.cos(ang)).max() < 2e-7


def test_reference_pi_digits():
  """The reference's 100-digit pi against Machin's formula, 16 atan(1/5) - 4 atan(1/239)."""
  def atan_inv(n, prec):
    x = decimal.Decimal(1) / n
    total, term, k = x, x, 1
    while True:
      term *= -x * x
      k += 2
      if abs(term / k) < decimal.Decimal(10) ** -prec:
        return total
      total += term / k

  with decimal.localcontext() as ctx:
    ctx.prec = 110
    pi = 16 * atan_inv(5, 110) - 4 * atan_inv(239, 110)
    assert abs(pi - reference._PI) < decimal.Decimal(10) ** -99


def test_round_trip(implementation, rng):
  """rope(rope(x, p), -p) == x up to float32 rounding, at positions up to 10^6."""
  case = Case(jnp.float32, (2, 33, 3, 96), "half", max_pos=10**6)
  x = make_x(rng, case)
  positions = make_positions(rng, case, signed=True)
  fn = op(implementation, **case.kw())
  back = jax.jit(lambda x, p: fn(fn(x, p), -p))(x, positions)
  scale = float(np.abs(oracle.as_f64(x)).max())
  assert np.abs(oracle.as_f64(back) - oracle.as_f64(x)).max() <= 8 * 2**-24 * scale


# ---- backward ------------------------------------------------------------------------------


def expected_grads(case: Case, loss_fn, x, positions, dy):
  """(float64 oracle, low-precision reference) of d loss_fn(rope, x, positions, dy) / dx."""
  lowp = jax.jit(jax.grad(lambda x: loss_fn(ref(**case.kw()), x, positions, dy)))(x)
  with oracle.x64():
    x64 = jnp.asarray(oracle.as_f64(x))
    dy64 = jnp.asarray(oracle.as_f64(dy))
    p = jnp.asarray(np.asarray(positions))
    f64 = lambda x, p: jnp_rope64(x, p, **case.kw())
    exact = oracle.as_f64(jax.jit(jax.grad(lambda x: loss_fn(f64, x, p, dy64)))(x64))
  return exact, lowp


def loss(fn, x, positions, dy):
  y = fn(x, positions)
  acc = jnp.promote_types(y.dtype, jnp.float32)
  return jnp.sum(y.astype(acc) * dy.astype(acc))


GRAD_CASES = SAMPLED[::3] + [Case(jnp.float32, (2, 17, 3, 128), "interleaved", max_pos=10**6)]


@pytest.mark.parametrize("case", GRAD_CASES, ids=[c.id() for c in GRAD_CASES])
def test_grad(case, implementation, rng):
  if case.max_pos > 10**6:
    case = dataclasses.replace(case, max_pos=10**6)   # the x64 jnp oracle's angle range
  x = make_x(rng, case)
  positions = make_positions(rng, case)
  dy = oracle.randn(rng, case.shape, case.dtype).astype(jnp.float32)
  fn = op(implementation, **case.kw())
  got = jax.jit(jax.grad(lambda x: loss(fn, x, positions, dy)))(x)
  assert got.shape == x.shape and got.dtype == x.dtype
  exact, lowp = expected_grads(case, loss, x, positions, dy)
  oracle.check(got, exact, lowp, what=f"{case.id()} dx", dtype=case.dtype)


def test_vjp_is_inverse_rotation(implementation, rng):
  """The VJP is exactly the rotation by -angle of the cotangent (float64 complex oracle),
  and positions get a float0 (zero) cotangent."""
  case = Case(jnp.float32, (2, 17, 2, 96), "half", rotary_dim=64, max_pos=10**6)
  x = make_x(rng, case)
  positions = make_positions(rng, case, signed=True)
  dy = make_x(rng, case)
  y, vjp = jax.vjp(op(implementation, **case.kw()), x, positions)
  dx, dpos = vjp(dy)
  assert dpos.dtype == jax.dtypes.float0 and dpos.shape == positions.shape
  ang = -oracle_angles(case, positions)
  want = np_rope(dy, None, layout="half", rotary_dim=64, angles=ang)
  oracle.check(dx, want, jax.vjp(ref(**case.kw()), x, positions)[1](dy)[0],
               what="vjp", dtype=jnp.float32)


# ---- static options ------------------------------------------------------------------------------

def test_traced_static_arguments_rejected():
  x, p = jnp.ones((2, 3, 4, 8)), jnp.zeros((2, 3), jnp.int32)
  with pytest.raises(TypeError, match="theta"):
    jax.jit(lambda x, p, t: jaxgpu.rope(x, p, theta=t))(x, p, 100.0)
  with pytest.raises(TypeError, match="rotary_dim"):
    jax.jit(lambda x, p, r: jaxgpu.rope(x, p, rotary_dim=r))(x, p, 4)


# ---- accepted input forms ---------------------------------------------------------------------


@pytest.mark.parametrize("pos_dtype", [np.int16, np.uint8, np.int64], ids=lambda d: d.__name__)
def test_numpy_inputs_and_position_dtypes(pos_dtype, implementation, rng):
  """numpy arrays are accepted; other integer position dtypes are converted to int32."""
  x = np.asarray(rng.standard_normal((3, 7, 2, 8)), np.float32)
  p = rng.integers(0, 200, (3, 7)).astype(pos_dtype)
  y = jaxgpu.rope(x, p, layout="interleaved", implementation=implementation)
  lowp = reference.rope(jnp.asarray(x), jnp.asarray(p, jnp.int32), layout="interleaved")
  oracle.check(y, np_rope(x, p, layout="interleaved"), lowp, what="numpy inputs")
