"""rope (jaxgpu/ops/rope.py, kernels in ffi/rope/), one test base run against every
implementation (the `implementation` fixture, conftest.py).

Oracles, independent of jaxgpu.reference: the forward pass is the complex product
(a + ib) * exp(i * angle) in float64 numpy; gradients are jax.grad of the same complex
formula in float64 (oracle.x64()); large-position angles are exact (Python decimal).
Error rule (tests/oracle.py): max error against float64 at most 2x that of the pure-JAX
reference computed in the same low precision, plus a small rounding atol; NaN never
passes. The reference itself is also held to an absolute float32 bound (it is the
'xla' implementation, and the 2x rule against itself proves nothing).
"""

from __future__ import annotations

import dataclasses
import decimal
import importlib
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxgpu
from jaxgpu import _ffi

import oracle
from conftest import HAS_CUDA

try:
  from jax import shard_map
except ImportError:  # older jax
  from jax.experimental.shard_map import shard_map  # type: ignore

from jaxgpu.reference import rope as reference
rope_ops = importlib.import_module("jaxgpu.ops.rope")

AxisType = jax.sharding.AxisType
DTYPES = oracle.DTYPES
LAYOUTS = ("half", "interleaved")
HEAD_DIMS = (2, 6, 96, 128, 256)
SEQS = (1, 17, 113)

# ---- float64 oracles ----------------------------------------------------------------------


def inv_freq64(theta, r):
  return float(theta) ** (-2.0 * np.arange(r // 2) / r)


def np_rope(x, positions, theta=10000.0, layout="half", rotary_dim=None, angles=None):
  """float64: pairs as complex numbers times exp(i * angle). angles: (..., T, r/2) radians
  (default position * inv_freq in float64)."""
  x = oracle.as_f64(x)
  dim = x.shape[-1]
  r = dim if rotary_dim is None else rotary_dim
  if angles is None:
    pos = np.broadcast_to(np.asarray(positions, np.float64), x.shape[:-2])
    angles = pos[..., None] * inv_freq64(theta, r)
  rot = np.exp(1j * angles)[..., None, :]                  # every head
  first, second = (slice(0, r // 2), slice(r // 2, r)) if layout == "half" else (
      slice(0, r, 2), slice(1, r, 2))
  z = (x[..., first] + 1j * x[..., second]) * rot
  out = x.copy()
  out[..., first] = z.real
  out[..., second] = z.imag
  return out


def jnp_rope64(x, positions, theta=10000.0, layout="half", rotary_dim=None):
  """The same complex formula in jnp (call inside oracle.x64()), for jax.grad."""
  dim = x.shape[-1]
  r = dim if rotary_dim is None else rotary_dim
  pos = jnp.broadcast_to(positions.astype(jnp.float64), x.shape[:-2])
  rot = jnp.exp(1j * pos[..., None] * jnp.asarray(inv_freq64(theta, r)))[..., None, :]
  if layout == "half":
    z = (x[..., : r // 2] + 1j * x[..., r // 2:r]) * rot
    y = jnp.concatenate([z.real, z.imag], axis=-1)
  else:
    z = (x[..., 0:r:2] + 1j * x[..., 1:r:2]) * rot
    y = jnp.stack([z.real, z.imag], axis=-1).reshape(x.shape[:-1] + (r,))
  return jnp.concatenate([y, x[..., r:]], axis=-1)


def exact_angles(positions, theta, r) -> np.ndarray:
  """position * theta^(-2i/r) reduced mod 2 pi exactly (50 digits), as float64 radians."""
  pos = np.asarray(positions).astype(np.int64)
  out = np.empty(pos.shape + (r // 2,), np.float64)
  with decimal.localcontext() as ctx:
    ctx.prec = 50
    two_pi = 2 * reference._PI
    ln_theta = decimal.Decimal(theta).ln()
    freqs = [(-(decimal.Decimal(2 * i) / r) * ln_theta).exp() for i in range(r // 2)]
    for idx, p in np.ndenumerate(pos):
      for i, f in enumerate(freqs):
        a = int(p) * f
        out[idx + (i,)] = float(a - two_pi * (a / two_pi).to_integral_value())
  return out


# ---- cases ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
  dtype: object
  shape: tuple[int, ...]            # x: (..., T, N, H)
  layout: str = "half"
  rotary_dim: int | None = None
  shared: bool = False              # positions (T,) rather than x.shape[:-2]
  max_pos: int = 4096
  theta: float = 10000.0

  @property
  def pos_shape(self):
    return (self.shape[-3],) if self.shared else self.shape[:-2]

  def kw(self) -> dict:
    return dict(theta=self.theta, layout=self.layout, rotary_dim=self.rotary_dim)

  def id(self) -> str:
    parts = [jnp.dtype(self.dtype).name, "x".join(map(str, self.shape)), self.layout]
    if self.rotary_dim is not None:
      parts.append(f"r{self.rotary_dim}")
    parts.append("posT" if self.shared else "posBT")
    if self.max_pos != 4096:
      parts.append(f"max{self.max_pos:g}")
    if self.theta != 10000.0:
      parts.append(f"theta{self.theta:g}")
    return "-".join(parts)


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


def make_x(rng, case: Case, shape=None):
  return oracle.randn(rng, case.shape if shape is None else shape, case.dtype,
                      float(rng.uniform(0.5, 3.0)))


def make_positions(rng, case: Case, shape=None, signed=False):
  lo = -case.max_pos if signed else 0
  return jnp.asarray(rng.integers(lo, case.max_pos, case.pos_shape if shape is None else shape,
                                  endpoint=True), jnp.int32)


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
y = jax.jit(lambda x, p: jaxgpu.rope(x, p, layout="half", rotary_dim=96,
                                     implementation="cuda"))(jnp.asarray(d["x"], jnp.bfloat16), d["p"])
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


def test_forward_mode_unsupported(implementation, rng):
  """custom_vjp has no forward mode: jax.jvp raises (documented in the docstring)."""
  x = oracle.randn(rng, (3, 2, 8), jnp.float32)
  p = jnp.arange(3, dtype=jnp.int32)
  fn = lambda x: jaxgpu.rope(x, p, implementation=implementation)
  if implementation == "xla":
    jax.jvp(fn, (x,), (x,))
    return
  with pytest.raises(TypeError):
    jax.jvp(fn, (x,), (x,))


# ---- implementation selection ---------------------------------------------------------------


def _custom_call_targets(lowered) -> set[str]:
  return set(re.findall(r'custom_call_target="([^"]+)"', lowered.compile().as_text()))


def test_lowers_to_its_targets(implementation, rng):
  x = oracle.randn(rng, (5, 3, 8), jnp.float32)
  p = jnp.arange(5, dtype=jnp.int32)
  fn = op(implementation)
  fwd = _custom_call_targets(jax.jit(fn).lower(x, p))
  bwd = _custom_call_targets(jax.jit(jax.grad(lambda x: fn(x, p).sum())).lower(x))
  if implementation == "xla":
    assert not any(t.startswith("jaxgpu_") for t in fwd | bwd), fwd | bwd
  else:
    assert f"jaxgpu_rope_fwd_{implementation}" in fwd, fwd
    assert f"jaxgpu_rope_bwd_{implementation}" in bwd, bwd
    assert f"jaxgpu_rope_fwd_{implementation}" not in bwd, "grad must not re-run the forward"


def test_default_implementation_runs_platform_kernel(rng):
  x = oracle.randn(rng, (5, 3, 8), jnp.bfloat16)
  p = jnp.arange(5, dtype=jnp.int32)
  f = jax.jit(lambda x, p: jaxgpu.rope(x, p))
  assert "jaxgpu_rope_fwd" in _custom_call_targets(f.lower(x, p))
  platform = "cuda" if HAS_CUDA else "cpu"
  explicit = jax.jit(lambda x, p: jaxgpu.rope(x, p, implementation=platform))(x, p)
  np.testing.assert_array_equal(np.asarray(f(x, p).astype(jnp.float32)),
                                np.asarray(explicit.astype(jnp.float32)))


# ---- vmap ----------------------------------------------------------------------------------

B = 3  # vmapped batch size


def _insert(a, axis, rng, positions=False, max_pos=4096):
  shape = list(a.shape)
  shape.insert(axis % (a.ndim + 1), B)
  if positions:
    return jnp.asarray(rng.integers(0, max_pos, shape), jnp.int32)
  return oracle.randn(rng, tuple(shape), a.dtype)


# (id, per-example case, x axis, positions axis)
VMAP_CASES = [
    ("x0-pos0", Case(jnp.float32, (2, 5, 3, 8)), 0, 0),
    ("x1-posNone", Case(jnp.bfloat16, (2, 5, 3, 8), "interleaved"), 1, None),
    ("x-1-pos1", Case(jnp.float16, (2, 5, 3, 8), rotary_dim=4), -1, 1),
    ("xNone-pos0", Case(jnp.float32, (2, 5, 3, 8)), None, 0),
    ("x2-sharedNone", Case(jnp.bfloat16, (2, 5, 3, 8), shared=True), 2, None),
    ("x0-shared0", Case(jnp.float32, (2, 5, 3, 8), "interleaved", shared=True), 0, 0),
    ("x3-shared-1", Case(jnp.float16, (2, 5, 3, 8), shared=True), 3, -1),
    ("xNone-shared0", Case(jnp.float32, (2, 5, 3, 8), shared=True), None, 0),
]


def _vmap_arrays(rng, case, x_axis, p_axis):
  x = make_x(rng, case)
  p = make_positions(rng, case)
  if x_axis is not None:
    x = _insert(x, x_axis, rng)
  if p_axis is not None:
    p = _insert(p, p_axis, rng, positions=True)
  return x, p


def _np_vmapped(case, x, p, x_axis, p_axis):
  outs = []
  for b in range(B):
    xb = x if x_axis is None else np.take(np.asarray(x), b, axis=x_axis)
    pb = p if p_axis is None else np.take(np.asarray(p), b, axis=p_axis)
    outs.append(np_rope(xb, pb, case.theta, case.layout, case.rotary_dim))
  return np.stack(outs)


@pytest.mark.parametrize("name,case,x_axis,p_axis", VMAP_CASES, ids=[v[0] for v in VMAP_CASES])
def test_vmap(name, case, x_axis, p_axis, implementation, rng):
  x, p = _vmap_arrays(rng, case, x_axis, p_axis)
  vm = lambda fn: jax.vmap(fn, in_axes=(x_axis, p_axis))
  got = jax.jit(vm(op(implementation, **case.kw())))(x, p)
  lowp = jax.jit(vm(ref(**case.kw())))(x, p)
  oracle.check(got, _np_vmapped(case, x, p, x_axis, p_axis), lowp, what=f"vmap {name}",
               dtype=case.dtype)


@pytest.mark.parametrize("name,case,x_axis,p_axis", VMAP_CASES[::2], ids=[v[0] for v in VMAP_CASES[::2]])
def test_vmap_of_grad(name, case, x_axis, p_axis, implementation, rng):
  """Per-example gradients (vmap of grad), with cotangents batched along the output."""
  x, p = _vmap_arrays(rng, case, x_axis, p_axis)
  dy = oracle.randn(rng, (B,) + case.shape, case.dtype).astype(jnp.float32)

  def per_example(fn):
    return jax.vmap(lambda x, p, dy: jax.grad(lambda x: loss(fn, x, p, dy))(x),
                    in_axes=(x_axis, p_axis, 0))

  got = jax.jit(per_example(op(implementation, **case.kw())))(x, p, dy)
  lowp = jax.jit(per_example(ref(**case.kw())))(x, p, dy)
  # d/dx <rope(x, p), dy> = rope(dy, p)^T: the inverse rotation of each example's dy.
  xs = x if x_axis is None else np.moveaxis(np.asarray(x), x_axis, 0)
  want = []
  for b in range(B):
    pb = p if p_axis is None else np.take(np.asarray(p), b, axis=p_axis)
    ang = -np.asarray(pb, np.float64)[..., None] * inv_freq64(
        case.theta, case.rotary_dim or case.shape[-1])
    want.append(np_rope(dy[b], None, case.theta, case.layout, case.rotary_dim,
                        angles=np.broadcast_to(ang, case.shape[:-2] + ang.shape[-1:])))
  want = np.stack(want)
  if x_axis is None:  # x unbatched: the gradient per example still has the batch axis
    assert got.shape == (B,) + case.shape
  else:
    assert got.shape == (B,) + xs.shape[1:]
  oracle.check(got, want, lowp, what=f"vmap(grad) {name}", dtype=case.dtype)


def test_grad_of_vmap_and_nested_vmap(implementation, rng):
  """grad(vmap(vmap(rope))): x batched twice, positions by the outer vmap only."""
  case = Case(jnp.bfloat16, (5, 3, 8), "interleaved")
  x = oracle.randn(rng, (2, 5, 4, 3, 8), case.dtype)        # outer axis 0, inner axis 2
  p = jnp.asarray(rng.integers(0, 10**5, (2, 5)), jnp.int32)
  dy = oracle.randn(rng, (2, 4, 5, 3, 8), case.dtype).astype(jnp.float32)

  def nested(fn):
    inner = jax.vmap(fn, in_axes=(1, None))
    return jax.vmap(inner, in_axes=(0, 0))

  fn = op(implementation, layout="interleaved")
  got = jax.jit(nested(fn))(x, p)
  lowp = jax.jit(nested(ref(layout="interleaved")))(x, p)
  want = np.stack([np.stack([np_rope(np.asarray(x)[o, :, i], np.asarray(p)[o], layout="interleaved")
                             for i in range(4)]) for o in range(2)])
  oracle.check(got, want, lowp, what="vmap(vmap)", dtype=case.dtype)

  g = jax.jit(jax.grad(lambda x: loss(nested(fn), x, p, dy)))(x)
  g_lowp = jax.jit(jax.grad(lambda x: loss(nested(ref(layout="interleaved")), x, p, dy)))(x)
  with oracle.x64():
    f64 = lambda x, p: jnp_rope64(x, p, layout="interleaved")
    g64 = jax.grad(lambda x: loss(nested(f64), x, jnp.asarray(np.asarray(p)),
                                  jnp.asarray(oracle.as_f64(dy))))(jnp.asarray(oracle.as_f64(x)))
    g64 = oracle.as_f64(g64)
  oracle.check(g, g64, g_lowp, what="grad(vmap(vmap))", dtype=case.dtype)


# ---- sharding on 8 fake CPU devices ---------------------------------------------------------


SHARDINGS = [
    ("batch-seq", P("a", "b", None, None), "BT", P("a", "b")),
    ("batch-heads", P("a", None, "b", None), "BT", P("a", None)),
    ("seq-shared", P(None, "a", "b", None), "T", P("a")),
    ("seq-shared-replicated", P("b", "a", None, None), "T", P()),
    ("positions-replicated", P("a", "b", None, None), "BT", P()),
]


def _sharding_params():
  out = []
  for name, xs, kind, ps in SHARDINGS:
    for axis_type in ("auto", "explicit"):
      if axis_type == "explicit" and name not in ("batch-seq", "seq-shared"):
        continue  # Explicit meshes once per positions form: CPU CI time
      out.append(pytest.param(xs, kind, ps, axis_type, id=f"{name}-{axis_type}"))
  return out


@pytest.mark.parametrize("x_spec,kind,p_spec,axis_type", _sharding_params())
def test_sharded(x_spec, kind, p_spec, axis_type, host_implementation, cpu_devices, rng):
  """Batch, sequence and head sharding: forward and backward with no collective, outputs
  and gradients keeping x's sharding, results matching the float64 oracle."""
  mesh = oracle.mesh_4x2(cpu_devices, axis_type)
  case = Case(jnp.bfloat16, (8, 8, 4, 16), "half", rotary_dim=12, shared=kind == "T")
  x, positions = make_x(rng, case), make_positions(rng, case)
  dy = oracle.randn(rng, case.shape, case.dtype)
  fn = op(host_implementation, **case.kw())

  def run():
    xs = jax.device_put(x, NamedSharding(mesh, x_spec))
    ps = jax.device_put(positions, NamedSharding(mesh, p_spec))
    dys = jax.device_put(dy, NamedSharding(mesh, x_spec))
    fwd = jax.jit(fn)
    bwd = jax.jit(lambda x, p, dy: jax.vjp(lambda x: fn(x, p), x)[1](dy)[0])
    return (fwd(xs, ps), bwd(xs, ps, dys), fwd.lower(xs, ps).compile().as_text(),
            bwd.lower(xs, ps, dys).compile().as_text())

  y, dx, fwd_hlo, bwd_hlo = oracle.run_on_mesh(mesh, axis_type, run)
  assert oracle.collectives(fwd_hlo) == set(), oracle.collectives(fwd_hlo)
  assert oracle.collectives(bwd_hlo) == set(), oracle.collectives(bwd_hlo)
  want = tuple(x_spec) + (None,) * (4 - len(x_spec))
  assert oracle.spec_of(y) == want, y.sharding
  assert oracle.spec_of(dx) == want, dx.sharding
  if axis_type == "explicit":
    assert jax.typeof(y).sharding.spec == x_spec
  y64, lowp = expected(case, x, positions)
  oracle.check(y, y64, lowp, what="sharded forward", dtype=case.dtype)
  dx64 = np_rope(dy, None, layout="half", rotary_dim=12,
                 angles=-np.broadcast_to(oracle_angles(case, positions), (8, 8, 6)))
  dx_lowp = jax.vjp(lambda x: ref(**case.kw())(x, positions), x)[1](dy)[0]
  oracle.check(dx, dx64, dx_lowp, what="sharded vjp", dtype=case.dtype)


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_sharded_head_dim(axis_type, host_implementation, cpu_devices, rng):
  """H sharded: still correct (the kernel needs whole head rows: a gather, never a
  silently wrong answer)."""
  mesh = oracle.mesh_4x2(cpu_devices, axis_type)
  case = Case(jnp.float32, (4, 6, 2, 16), "interleaved")
  x, positions = make_x(rng, case), make_positions(rng, case)

  def run():
    xs = jax.device_put(x, NamedSharding(mesh, P("a", None, None, "b")))
    ps = jax.device_put(positions, NamedSharding(mesh, P("a", None)))
    f = jax.jit(op(host_implementation, **case.kw()))
    return f(xs, ps), f.lower(xs, ps).compile().as_text()

  y, hlo = oracle.run_on_mesh(mesh, axis_type, run)
  if host_implementation != "xla":
    assert oracle.collectives(hlo), "expected a gather of the sharded head dim"
  y64, lowp = expected(case, x, positions)
  oracle.check(y, y64, lowp, what="H-sharded forward", dtype=case.dtype)


def test_shard_map(host_implementation, cpu_devices, rng):
  """Inside shard_map (batch over 'a', sequence over 'b'): forward, grad inside, and grad
  of the shard_map, against the oracle; per-shard outputs are varying."""
  mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(AxisType.Auto,) * 2,
                       devices=cpu_devices)
  case = Case(jnp.bfloat16, (8, 6, 3, 8), "half")
  x, positions = make_x(rng, case), make_positions(rng, case)
  dy = oracle.randn(rng, case.shape, case.dtype).astype(jnp.float32)
  fn = op(host_implementation, **case.kw())
  xs, ps = P("a", "b"), P("a", "b")

  def body(x, p):
    y = fn(x, p)
    assert oracle.varying_axes(jax.typeof(y)) == {"a", "b"}, jax.typeof(y)
    return y

  sm = shard_map(body, mesh=mesh, in_specs=(xs, ps), out_specs=xs)
  y = jax.jit(sm)(x, positions)
  y64, lowp = expected(case, x, positions)
  oracle.check(y, y64, lowp, what="shard_map forward", dtype=case.dtype)

  exact, g_lowp = expected_grads(case, loss, x, positions, dy)
  g_out = jax.jit(jax.grad(lambda x: loss(lambda x, p: sm(x, p), x, positions, dy)))(x)
  oracle.check(g_out, exact, g_lowp, what="grad of shard_map", dtype=case.dtype)
  inner = shard_map(lambda x, p, dy: jax.grad(lambda x: loss(fn, x, p, dy))(x), mesh=mesh,
                    in_specs=(xs, ps, xs), out_specs=xs)
  g_in = jax.jit(inner)(x, positions, dy)
  oracle.check(g_in, exact, g_lowp, what="grad inside shard_map", dtype=case.dtype)


def test_pmap(host_implementation, cpu_devices, rng):
  """pmap over 4 CPU devices with shared positions: forward and per-device gradients."""
  case = Case(jnp.float32, (3, 5, 2, 8), "interleaved", shared=True)
  x = oracle.randn(rng, (4,) + case.shape, jnp.float32)
  p = make_positions(rng, case)
  dy = oracle.randn(rng, (4,) + case.shape, jnp.float32)
  fn = op(host_implementation, **case.kw())
  y = jax.pmap(fn, in_axes=(0, None), devices=cpu_devices[:4])(x, p)
  want = np.stack([np_rope(x[d], p, layout="interleaved") for d in range(4)])
  lowp = jax.vmap(ref(**case.kw()), in_axes=(0, None))(x, p)
  oracle.check(y, want, lowp, what="pmap forward", dtype=jnp.float32)
  g = jax.pmap(lambda x, dy: jax.grad(lambda x: loss(fn, x, p, dy))(x),
               devices=cpu_devices[:4])(x, dy)
  ang = -np.asarray(p, np.float64)[:, None] * inv_freq64(10000.0, 8)
  want = np.stack([np_rope(dy[d], None, layout="interleaved",
                           angles=np.broadcast_to(ang, (3, 5, 4))) for d in range(4)])
  g_lowp = jax.vmap(lambda x, dy: jax.grad(lambda x: loss(ref(**case.kw()), x, p, dy))(x))(x, dy)
  oracle.check(g, want, g_lowp, what="pmap grad", dtype=jnp.float32)


# ---- bad input ------------------------------------------------------------------------------

_X = lambda shape=(2, 3, 4, 8), dtype=jnp.float32: jnp.ones(shape, dtype)
_P = lambda shape=(2, 3), dtype=jnp.int32: jnp.zeros(shape, dtype)

BAD_INPUTS = [
    # (id, kwargs-builder, error type, message pattern)
    ("H-odd", lambda: dict(x=_X((2, 3, 4, 7)), positions=_P()), ValueError, r"H = 7.*even"),
    ("H-odd-with-rotary", lambda: dict(x=_X((2, 3, 4, 7)), positions=_P(), rotary_dim=4),
     ValueError, r"H = 7.*even"),
    ("rotary-odd", lambda: dict(x=_X(), positions=_P(), rotary_dim=5), ValueError,
     r"rotary_dim.*even"),
    ("rotary-too-big", lambda: dict(x=_X(), positions=_P(), rotary_dim=10), ValueError,
     r"rotary_dim"),
    ("rotary-zero", lambda: dict(x=_X(), positions=_P(), rotary_dim=0), ValueError,
     r"rotary_dim"),
    ("rotary-negative", lambda: dict(x=_X(), positions=_P(), rotary_dim=-2), ValueError,
     r"rotary_dim"),
    ("rotary-float", lambda: dict(x=_X(), positions=_P(), rotary_dim=4.0), TypeError,
     r"rotary_dim"),
    ("rotary-bool", lambda: dict(x=_X(), positions=_P(), rotary_dim=True), TypeError,
     r"rotary_dim"),
    ("positions-shape", lambda: dict(x=_X(), positions=_P((3, 2))), ValueError,
     r"positions.*shape"),
    ("positions-batch-only", lambda: dict(x=_X(), positions=_P((2,))), ValueError,
     r"positions.*shape"),
    ("positions-heads", lambda: dict(x=_X(), positions=_P((2, 3, 4))), ValueError,
     r"positions.*shape"),
    ("positions-float", lambda: dict(x=_X(), positions=_P(dtype=jnp.float32)), TypeError,
     r"positions.*integer"),
    ("positions-bool", lambda: dict(x=_X(), positions=_P(dtype=jnp.bool_)), TypeError,
     r"positions.*integer"),
    ("theta-zero", lambda: dict(x=_X(), positions=_P(), theta=0.0), ValueError, r"theta"),
    ("theta-negative", lambda: dict(x=_X(), positions=_P(), theta=-1.0), ValueError, r"theta"),
    ("theta-nan", lambda: dict(x=_X(), positions=_P(), theta=float("nan")), ValueError,
     r"theta"),
    ("theta-inf", lambda: dict(x=_X(), positions=_P(), theta=float("inf")), ValueError,
     r"theta"),
    ("theta-string", lambda: dict(x=_X(), positions=_P(), theta="big"), TypeError, r"theta"),
    ("layout-unknown", lambda: dict(x=_X(), positions=_P(), layout="neox"), ValueError,
     r"layout"),
    ("layout-not-str", lambda: dict(x=_X(), positions=_P(), layout=1), ValueError, r"layout"),
    ("x-int", lambda: dict(x=_X(dtype=jnp.int32), positions=_P()), TypeError, r"\bx\b.*dtype"),
    ("x-float64", lambda: dict(x=np.ones((2, 3, 4, 8)), positions=_P()), TypeError,
     r"\bx\b.*dtype"),
    ("x-rank2", lambda: dict(x=_X((3, 8)), positions=_P((3,))), ValueError, r"\bx\b.*rank"),
    ("implementation-bogus", lambda: dict(x=_X(), positions=_P(), implementation="bogus"),
     ValueError, r"implementation"),
]


@pytest.mark.parametrize("build,error,match", [b[1:] for b in BAD_INPUTS],
                         ids=[b[0] for b in BAD_INPUTS])
def test_bad_input(build, error, match):
  kw = build()
  with pytest.raises(error, match=match):
    jaxgpu.rope(**kw)
  arrays = {k: v for k, v in kw.items() if isinstance(v, jax.Array)}
  rest = {k: v for k, v in kw.items() if k not in arrays}
  if len(arrays) == 2:  # the same at trace time, under jit
    with pytest.raises(error, match=match):
      jax.jit(lambda a: jaxgpu.rope(**a, **rest))(arrays)


def test_traced_static_arguments_rejected():
  x, p = _X(), _P()
  with pytest.raises(TypeError, match="theta"):
    jax.jit(lambda x, p, t: jaxgpu.rope(x, p, theta=t))(x, p, 100.0)
  with pytest.raises(TypeError, match="rotary_dim"):
    jax.jit(lambda x, p, r: jaxgpu.rope(x, p, rotary_dim=r))(x, p, 4)


@pytest.mark.skipif(HAS_CUDA, reason="this machine has a CUDA backend")
def test_cuda_without_gpu():
  with pytest.raises(ValueError, match="implementation='cuda'"):
    jaxgpu.rope(_X(), _P(), implementation="cuda")


# ---- size 0, accepted input forms -----------------------------------------------------------


@pytest.mark.parametrize("shape", [(0, 5, 2, 8), (2, 0, 2, 8), (2, 3, 0, 8), (2, 3, 2, 0)],
                         ids=str)
def test_size_zero(shape, implementation):
  x = jnp.zeros(shape, jnp.bfloat16)
  p = jnp.zeros(shape[:-2], jnp.int32)
  fn = op(implementation)
  y = jax.jit(fn)(x, p)
  assert y.shape == shape and y.dtype == x.dtype
  g = jax.jit(jax.grad(lambda x: fn(x, p).astype(jnp.float32).sum()))(x)
  assert g.shape == shape and g.dtype == x.dtype


@pytest.mark.parametrize("pos_dtype", [np.int16, np.uint8, np.int64], ids=lambda d: d.__name__)
def test_numpy_inputs_and_position_dtypes(pos_dtype, implementation, rng):
  """numpy arrays are accepted; other integer position dtypes are converted to int32."""
  x = np.asarray(rng.standard_normal((3, 7, 2, 8)), np.float32)
  p = rng.integers(0, 200, (3, 7)).astype(pos_dtype)
  y = jaxgpu.rope(x, p, layout="interleaved", implementation=implementation)
  lowp = reference.rope(jnp.asarray(x), jnp.asarray(p, jnp.int32), layout="interleaved")
  oracle.check(y, np_rope(x, p, layout="interleaved"), lowp, what="numpy inputs")
