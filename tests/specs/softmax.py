"""softmax: the float64 oracle, the low-precision reference, cases, argument makers, the
gradient's rounding atol, and the op's contract spec.

Oracles, written here independently of jaxgpu.reference: float64 numpy (forward) and the
jnp softmax under a local x64 context (gradients). Semantics: jax.nn.softmax(x * scale,
where=keep) with keep = mask & causal, except that a row with nothing kept is all zeros
(and has a zero gradient) where jax.nn.softmax gives NaN.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import contract as C
import oracle

GRAD_ATOL_ULPS = 8.0

# ---- oracles ---------------------------------------------------------------------------------


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


def dx_atol(scale, y64, cot, dtype) -> float:
  """Rounding atol of dx = scale * y * (dy - sum(dy * y)), two sources:
  * the backward pass reads y ROUNDED to the op's dtype (the residual is the output, not x),
    while XLA's autodiff of the reference never rounds its float32 y. A rounding
    y_k (1 + d_k), |d_k| <= u, moves dx_j by at most
    |scale| u y_j (|dy_j| + |sum dy y| + sum |dy_k| y_k): ulps of the terms, not of dx (which
    cancels, e.g. when one key dominates its row);
  * the float32 row sum, relative to sum |dy_k| y_k <= max|dy|."""
  s = abs(1.0 if scale is None else scale)
  y = np.asarray(y64, np.float64)
  c = oracle.as_f64(cot)
  if c.size == 0:
    return 0.0
  per_row = y.max(-1) * (np.abs(c).max(-1) + 2 * np.abs(c * y).sum(-1))
  u = oracle.unit_roundoff(dtype)
  return 2 * s * u * float(per_row.max()) + 16 * oracle.unit_roundoff(jnp.float32) * s * float(
      np.abs(c).max())


# ---- cases -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
  shape: tuple[int, ...]
  scale: float | None = None
  causal: bool = False
  mask: tuple[int, ...] | None = None   # the mask's own shape (broadcastable to shape)
  p_drop: float = 0.3                   # fraction of mask entries that are False
  dtype: object = jnp.float32

  def id(self) -> str:
    parts = ["x".join(map(str, self.shape))]
    if self.scale is not None:
      parts.append(f"scale{self.scale:g}")
    if self.causal:
      parts.append("causal")
    if self.mask is not None:
      parts.append("mask" + ("x".join(map(str, self.mask)) or "scalar"))
    return "-".join(parts)


def make_x(rng, case: Case, dtype=None, shape=None):
  shape = case.shape if shape is None else shape
  return oracle.randn(rng, shape, case.dtype if dtype is None else dtype,
                      float(rng.uniform(0.5, 4.0)), float(rng.uniform(-2, 2)))


def make_mask(rng, case: Case, shape=None):
  shape = case.mask if shape is None else shape
  if shape is None:
    return None
  return jnp.asarray(rng.random(shape) >= case.p_drop)


def make(rng, case: Case) -> C.Inputs:
  arrays = {"x": make_x(rng, case)}
  if case.mask is not None:
    arrays["mask"] = make_mask(rng, case)
  return C.Inputs(arrays, {"scale": case.scale, "is_causal": case.causal})


def _oracle(arrays, static, dtype):
  return (jnp_softmax(arrays["x"], static["scale"], static["is_causal"], arrays.get("mask")),)


def _atol(arrays, static, cots, outs):
  if cots is None:
    return {}, {}
  x = arrays["x"]
  y64 = np_softmax(x, static["scale"], static["is_causal"], arrays.get("mask"))
  return {}, {"x": dx_atol(static["scale"], y64, cots[0], x.dtype)}


# ---- the contract tables -----------------------------------------------------------------------

VMAP_BASE = Case((4, 17, 64), scale=0.5, causal=True)
# (id, x axis, mask axis, mask shape per example): the mask batched or not, and small. The
# dtype rotates with the id; vmap(grad) runs where x is batched.
VMAP_AXES = [
    ("x0", 0, None, (17, 64)),
    ("x1", 1, None, (4, 1, 64)),
    ("x-1-nomask", -1, None, None),
    ("mask0-only", None, 0, (4, 17, 64)),
    ("mask1-only-small", None, 1, (1, 17, 1)),
    ("x0-mask0", 0, 0, (4, 1, 64)),
    ("x2-mask-1", 2, -1, (17, 64)),
]


def _vmap_table() -> tuple:
  out = []
  for name, x_axis, m_axis, m_shape in VMAP_AXES:
    axes = {k: v for k, v in (("x", x_axis), ("mask", m_axis)) if v is not None}
    for mode, offset in (("fwd", 0), ("grad", 1)):
      if mode == "grad" and x_axis is None:
        continue
      case = dataclasses.replace(VMAP_BASE, mask=m_shape,
                                 dtype=oracle.DTYPES[(len(name) + offset) % 3])
      out.append(C.VmapCase(name, case, (axes,), frozenset({mode})))
  # vmap(vmap), the mask batched by the outer vmap only, and its gradient.
  out.append(C.VmapCase("nested-mask-outer", Case((5, 17), scale=2.0, mask=(17,),
                                                  dtype=jnp.float16),
                        ({"x": 0, "mask": 0}, {"x": 1}), frozenset({"fwd", "grad_of"}),
                        sizes=(2, 3)))
  return tuple(out)


SHARD_CASE = Case((8, 4, 16, 64), scale=0.5, causal=True, mask=(8, 1, 16, 64),
                  dtype=jnp.bfloat16)


def _rows(name, x_spec, m_spec, case, axis_types=("auto",)):
  """Row sharding: no collective forward or backward, the results keep x's sharding."""
  return C.ShardingCase(name, case, {"x": x_spec, "mask": m_spec}, fwd=frozenset(),
                        bwd=frozenset(), out_specs={"y": x_spec}, grad_specs={"x": x_spec},
                        axis_types=axis_types, explicit_like=(("y", "x"),))


def _gathered(name, x_spec, m_spec, axis_types=("auto",)):
  """A sharded S (and T under the causal mask) is gathered: right, with a collective."""
  return C.ShardingCase(name, SHARD_CASE, {"x": x_spec, "mask": m_spec},
                        cot_specs={"y": x_spec}, gathers=True, axis_types=axis_types,
                        explicit_like=(("y", "x"),))


SHARDINGS = (
    _rows("rows", P("a", "b", None, None), P("a", None, None, None), SHARD_CASE,
          ("auto", "explicit")),
    _rows("rows-T-nocausal", P("a", None, "b", None), P("a", None, "b", None),
          dataclasses.replace(SHARD_CASE, causal=False)),
    _rows("rows-small-mask", P(("a", "b"), None, None, None), P(),
          dataclasses.replace(SHARD_CASE, mask=(16, 64))),
    _gathered("S-sharded", P("a", None, None, "b"), P(None, None, None, "b")),
    _gathered("T-sharded-causal", P("a", None, "b", None), P(None, None, "b", None),
              ("auto", "explicit")),
    # Rank 1, replicated and split 8 ways.
    C.ShardingCase("rank1-replicated", Case((64,), mask=(64,)), {}, grad=False,
                   axis_types=("auto",)),
    C.ShardingCase("rank1-split", Case((64,), mask=(64,)), {"x": P(("a", "b"))}, grad=False,
                   axis_types=("auto",)),
)

_X = lambda: jnp.ones((2, 3))

BAD_INPUTS = tuple(C.BadInput(*b) for b in [
    ("x-scalar", lambda: dict(x=jnp.float32(1.0)), ValueError, r"\bx\b.*rank"),
    ("x-int32", lambda: dict(x=jnp.ones((2, 3), jnp.int32)), TypeError, r"\bx\b.*dtype"),
    ("x-float64", lambda: dict(x=np.ones((2, 3), np.float64)), TypeError, r"\bx\b.*dtype"),
    ("x-string", lambda: dict(x="abc"), TypeError, r"\bx\b"),
    ("mask-not-broadcastable", lambda: dict(x=_X(), mask=jnp.ones((2,), bool)),
     ValueError, r"mask.*broadcastable"),
    ("mask-rank-too-high", lambda: dict(x=_X(), mask=jnp.ones((1, 2, 3), bool)),
     ValueError, r"mask.*broadcastable"),
    ("mask-grows-x", lambda: dict(x=jnp.ones((1, 3)), mask=jnp.ones((2, 3), bool)),
     ValueError, r"mask.*broadcastable"),
    ("mask-int", lambda: dict(x=_X(), mask=jnp.ones((2, 3), jnp.int32)),
     TypeError, r"mask.*bool"),
    ("mask-float", lambda: dict(x=_X(), mask=jnp.ones((3,), jnp.float32)),
     TypeError, r"mask.*bool"),
    ("mask-string", lambda: dict(x=_X(), mask="yes"), TypeError, r"mask"),
    ("causal-rank1", lambda: dict(x=jnp.ones((3,)), is_causal=True), ValueError,
     r"is_causal.*rank"),
    ("causal-not-bool", lambda: dict(x=_X(), is_causal="yes"), TypeError, r"is_causal"),
    ("causal-array", lambda: dict(x=_X(), is_causal=jnp.array(True)), TypeError,
     r"is_causal"),
    ("scale-nan", lambda: dict(x=_X(), scale=float("nan")), ValueError, r"\bscale\b"),
    ("scale-inf", lambda: dict(x=_X(), scale=float("inf")), ValueError, r"\bscale\b"),
    ("scale-string", lambda: dict(x=_X(), scale="big"), TypeError, r"\bscale\b"),
    ("implementation-bogus", lambda: dict(x=_X(), implementation="bogus"),
     ValueError, r"implementation"),
])

SIZE_ZERO = tuple(Case(shape, causal=causal, mask=mask, dtype=jnp.bfloat16) for shape, mask, causal
                  in (((0, 8), (8,), False), ((3, 0), None, False), ((0,), None, False),
                      ((2, 0, 5), (1, 0, 5), True), ((4, 0), (4, 1), True)))

ROWS8 = P(("a", "b"))

SPECS = (C.OpSpec(
    name="softmax",
    make=make,
    example=Case((5, 17, 59), causal=True, mask=(59,)),
    array_args=("x", "mask"),
    diff_args=("x",),
    oracle=_oracle,
    atol=_atol,
    grad_atol_ulps=GRAD_ATOL_ULPS,
    vmap=_vmap_table(),
    # pmap over 4 devices with a shared (broadcast) mask.
    pmap=C.VmapCase("x0", Case((3, 17, 59), causal=True, mask=(17, 59)), ({"x": 0},),
                    sizes=(C.PMAP_DEVICES,)),
    sharding=SHARDINGS,
    # Rows split 8 ways, the mask split with them.
    shard_map=C.ShardMapCase(Case((8, 3, 17, 59), scale=0.5, causal=True, mask=(8, 1, 17, 59),
                                  dtype=jnp.bfloat16), {"x": ROWS8, "mask": ROWS8}, (ROWS8,)),
    bad_inputs=BAD_INPUTS,
    size_zero=tuple((c.id(), c) for c in SIZE_ZERO),
),)
