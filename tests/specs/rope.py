"""rope: the float64 oracles, cases, argument makers, and the op's contract spec.

Oracles, independent of jaxgpu.reference: the forward pass is the complex product
(a + ib) * exp(i * angle) in float64 numpy (`np_rope`); gradients are jax.grad of the same
complex formula in float64 (`jnp_rope64`, under oracle.x64()); large-position angles are
exact (Python decimal, `exact_angles`). The low-precision reference is jaxgpu.reference's
rope (float32 math; test_rope.py also holds it to an absolute bound, since it is the 'xla'
implementation and the 2x rule against itself proves nothing).
"""

from __future__ import annotations

import dataclasses
import decimal

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxgpu.reference import rope as reference

import contract as C
import oracle

# ---- float64 oracles ----------------------------------------------------------------------------


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


# ---- cases --------------------------------------------------------------------------------------


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


def make_x(rng, case: Case, shape=None):
  return oracle.randn(rng, case.shape if shape is None else shape, case.dtype,
                      float(rng.uniform(0.5, 3.0)))


def make_positions(rng, case: Case, shape=None, signed=False):
  lo = -case.max_pos if signed else 0
  return jnp.asarray(rng.integers(lo, case.max_pos, case.pos_shape if shape is None else shape,
                                  endpoint=True), jnp.int32)


def make(rng, case: Case) -> C.Inputs:
  return C.Inputs({"x": make_x(rng, case), "positions": make_positions(rng, case)}, case.kw())


# ---- the contract tables ---------------------------------------------------------------------

# (id, per-example case, x axis, positions axis): vmap of every entry, vmap(grad) of every
# other one.
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


def _vmap_table() -> tuple:
  out = []
  for i, (name, case, x_axis, p_axis) in enumerate(VMAP_CASES):
    axes = {k: v for k, v in (("x", x_axis), ("positions", p_axis)) if v is not None}
    out.append(C.VmapCase(name, case, (axes,), frozenset({"fwd", "grad"} if i % 2 == 0
                                                         else {"fwd"})))
  # grad(vmap(vmap(rope))): x batched twice, positions by the outer vmap only.
  out.append(C.VmapCase("nested-pos-outer", Case(jnp.bfloat16, (5, 3, 8), "interleaved",
                                                 max_pos=10**5),
                        ({"x": 0, "positions": 0}, {"x": 1}), frozenset({"fwd", "grad_of"}),
                        sizes=(2, 4)))
  return tuple(out)


# Batch, sequence and head sharding: no collective forward or backward, the results and
# gradients keeping x's sharding. (x spec, positions (BT) or (T), positions spec, axis types)
SHARDINGS = [
    ("batch-seq", P("a", "b", None, None), "BT", P("a", "b"), ("auto", "explicit")),
    ("batch-heads", P("a", None, "b", None), "BT", P("a", None), ("auto",)),
    ("seq-shared", P(None, "a", "b", None), "T", P("a"), ("auto", "explicit")),
    ("seq-shared-replicated", P("b", "a", None, None), "T", P(), ("auto",)),
    ("positions-replicated", P("a", "b", None, None), "BT", P(), ("auto",)),
]


def _sharding_table() -> tuple:
  out = [C.ShardingCase(name, Case(jnp.bfloat16, (8, 8, 4, 16), "half", rotary_dim=12,
                                   shared=kind == "T"),
                        {"x": xs, "positions": ps}, fwd=frozenset(), bwd=frozenset(),
                        out_specs={"y": xs}, grad_specs={"x": xs}, axis_types=axis_types)
         for name, xs, kind, ps, axis_types in SHARDINGS]
  # H sharded: still right (the kernel needs whole head rows: a gather, never a silently
  # wrong answer).
  out.append(C.ShardingCase("H-sharded", Case(jnp.float32, (4, 6, 2, 16), "interleaved"),
                            {"x": P("a", None, None, "b"), "positions": P("a", None)},
                            gathers=True, grad=False))
  return tuple(out)


_X = lambda shape=(2, 3, 4, 8), dtype=jnp.float32: jnp.ones(shape, dtype)
_P = lambda shape=(2, 3), dtype=jnp.int32: jnp.zeros(shape, dtype)

BAD_INPUTS = tuple(C.BadInput(*b) for b in [
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
])

SPECS = (C.OpSpec(
    name="rope",
    make=make,
    example=Case(jnp.float32, (5, 3, 8)),
    array_args=("x", "positions"),
    diff_args=("x",),
    oracle=lambda a, s, dtype: (jnp_rope64(a["x"], a["positions"], **s),),
    lowp=lambda a, s: (reference.rope(a["x"], a["positions"], **s),),
    grad_atol_ulps=4.0,
    # The backward pass is the inverse rotation of the cotangent: no forward result needed.
    grad_runs_forward=False,
    vmap=_vmap_table(),
    # pmap over 4 devices with shared positions.
    pmap=C.VmapCase("x0", Case(jnp.float32, (3, 5, 2, 8), "interleaved", shared=True),
                    ({"x": 0},), sizes=(C.PMAP_DEVICES,)),
    sharding=_sharding_table(),
    # Batch over 'a', sequence over 'b'.
    shard_map=C.ShardMapCase(Case(jnp.bfloat16, (8, 6, 3, 8), "half"),
                             {"x": P("a", "b"), "positions": P("a", "b")}, (P("a", "b"),)),
    bad_inputs=BAD_INPUTS,
    size_zero=tuple(("x".join(map(str, s)), Case(jnp.bfloat16, s)) for s in
                    ((0, 5, 2, 8), (2, 0, 2, 8), (2, 3, 0, 8), (2, 3, 2, 0))),
),)
