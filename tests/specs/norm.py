"""rms_norm and layer_norm: cases, argument makers, the extra rounding atols, and the two
ops' contract specs (one builder for both: they share x (..., D) and (D,) parameters).

The float64 oracles and low-precision references are tests/oracle.py's np_/jnp_ norms.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import contract as C
import oracle

KINDS = {"rms": "rms_norm", "layer": "layer_norm"}

# Backward: the kernels' row reductions (mean(g * xhat)) and the weight-gradient sums run
# in a different order than XLA's; a few more ulps of headroom than the forward.
GRAD_ATOL_ULPS = 8.0


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
  param_dtype: object = None  # of weight and bias; None: x's (float32: master weights)

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
    if self.param_dtype is not None:
      parts.append(f"p{jnp.dtype(self.param_dtype).name}")
    return "-".join(parts)


def full_case(kind, dtype, lead, dim, residual=True, offset=None, param_dtype=None):
  """Every parameter the op takes: weight, bias (layer norm), rms_norm's offset 1."""
  return Case(kind, dtype, lead, dim, weight=True, bias=kind == "layer",
              offset=(1.0 if kind == "rms" else 0.0) if offset is None else offset,
              residual=residual, param_dtype=param_dtype)


def make_arrays(rng, case: Case) -> dict:
  """Random inputs of `case` (x with a random scale and, for layer norm, a random shift)."""
  scale = float(rng.uniform(0.5, 3.0))
  shift = float(rng.uniform(-3, 3)) if case.kind == "layer" else 0.0
  a = {"x": oracle.randn(rng, case.shape, case.dtype, scale, shift)}
  pdt = case.dtype if case.param_dtype is None else case.param_dtype
  if case.weight:
    a["weight"] = oracle.randn(rng, (case.dim,), pdt, 0.3 if case.offset else 1.0,
                               0.0 if case.offset else 0.5)
  if case.bias:
    a["bias"] = oracle.randn(rng, (case.dim,), pdt)
  if case.residual:
    a["residual"] = oracle.randn(rng, case.shape, case.dtype, scale)
  return a


def make(rng, case: Case) -> C.Inputs:
  return C.Inputs(make_arrays(rng, case), case.static())


def reference(kind, arrays: dict, static: dict, h_dtype=None) -> tuple:
  """tests/oracle.py's jnp norm on keyword arrays: (y,) or (y, h) as the op returns.
  h_dtype: the op's dtype, for the float64 oracle (h = x + residual is rounded to it)."""
  fn = oracle.norm_fn(kind)
  a = dict(arrays)
  if kind == "rms":
    y, h = fn(a.pop("x"), a.pop("weight", None), a.pop("residual", None), h_dtype=h_dtype,
              **static)
  else:
    y, h = fn(a.pop("x"), a.pop("weight", None), a.pop("bias", None), a.pop("residual", None),
              h_dtype=h_dtype, **static)
  return (y, h) if "residual" in arrays else (y,)


# ---- extra rounding atols ------------------------------------------------------------------------


def _h(arrays) -> np.ndarray:
  h = oracle.as_f64(arrays["x"])
  return h + oracle.as_f64(arrays["residual"]) if "residual" in arrays else h


def y_atol(kind, arrays, eps) -> float:
  """Rounding atol for layer norm's y: centering h - mean(h) in float32 loses about one
  ulp of |h| (a 3-wide row of values near 3 with a spread of 0.1 keeps ~5 bits fewer), so
  the error is relative to |h| * rstd * |weight|, not to |y|."""
  if kind != "layer":
    return 0.0
  h = _h(arrays)
  if h.size == 0:
    return 0.0
  c = h - h.mean(-1, keepdims=True)
  rstd = 1 / np.sqrt(np.mean(c * c, -1, keepdims=True) + eps)
  w = np.abs(oracle.as_f64(arrays["weight"])).max() if "weight" in arrays else 1.0
  return 4 * oracle.unit_roundoff(jnp.float32) * float(np.max(np.abs(h) * rstd)) * w


def dx_atol(kind, arrays, dy, eps, offset) -> float:
  """Rounding atol for dx/dresidual: rstd * (g - mean(g) - xhat * mean(g * xhat)) cancels
  (D = 1 rms_norm: dx = eps / (x^2 + eps)^1.5 from terms ~1/|x|), so float32 rounding is
  relative to the terms, rstd * |g|, not to the result; for layer norm times the
  centering's loss (xhat is off by about one ulp of |h| * rstd, see y_atol)."""
  h = _h(arrays)
  if h.size == 0:
    return 0.0
  c = h - h.mean(-1, keepdims=True) if kind == "layer" else h
  rstd = 1 / np.sqrt(np.mean(c * c, -1, keepdims=True) + eps)
  g = oracle.as_f64(dy)
  if "weight" in arrays:
    g = g * (offset + oracle.as_f64(arrays["weight"]))
  centering = 1 + float(np.max(np.abs(h) * rstd)) if kind == "layer" else 1.0
  return 8 * oracle.unit_roundoff(jnp.float32) * float(np.max(rstd * np.abs(g))) * centering


def _atol(kind):
  def atol(arrays, static, cots, outs):
    out = {"y": y_atol(kind, arrays, static["eps"])}
    if cots is None:
      return out, {}
    d = dx_atol(kind, arrays, cots[0], static["eps"], static.get("weight_offset", 0.0))
    return out, {"x": d, "residual": d}
  return atol


# ---- the contract tables -------------------------------------------------------------------------

# vmap in_axes: each entry runs once forward and once vmap(grad), on the two ops in turn
# (bias exists for layer norm only), with the dtype rotated.
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


def _vmap_table(kind) -> tuple:
  out = []
  for i, (name, axes) in enumerate(VMAP_AXES):
    for mode, offset in (("fwd", 0), ("grad", 1)):
      k = "layer" if "bias" in axes else ("rms", "layer")[(i + offset) % 2]
      if k == kind:
        dtype = oracle.DTYPES[(i + offset) % len(oracle.DTYPES)]
        out.append(C.VmapCase(name, full_case(kind, dtype, (4, 5), 59,
                                              residual="residual" in axes),
                              (axes,), frozenset({mode})))
  # grad(vmap): a shared weight's gradient sums over the vmapped axis too.
  weight_axes = (None, 0) if kind == "rms" else (None,)
  for w in weight_axes:
    out.append(C.VmapCase(f"x1-res1-weight{w}", full_case(kind, jnp.bfloat16, (7,), 111,
                                                            offset=0.0),
                          ({"x": 1, "residual": 1, "weight": w},), frozenset({"grad_of"})))
  # float32 parameters beside bfloat16 rows: batched with x (one launch, per-example float32
  # weight gradients), and shared (grad(vmap): the float32 gradient sums over the batch).
  f32 = jnp.float32
  out.append(C.VmapCase("x0-weight0-f32params",
                        full_case(kind, jnp.bfloat16, (4, 5), 59, param_dtype=f32),
                        ({"x": 0, "residual": 0, "weight": 0},), frozenset({"fwd", "grad"})))
  out.append(C.VmapCase("x1-res1-f32params", full_case(kind, jnp.float16, (7,), 111,
                                                       param_dtype=f32),
                        ({"x": 1, "residual": 1},), frozenset({"fwd", "grad_of"})))
  # vmap(vmap): x batched twice, the weight by the outer vmap only, the bias shared.
  out.append(C.VmapCase("nested", full_case(kind, jnp.float16, (5,), 59, offset=0.0),
                        ({"x": 0, "residual": 0, "weight": 0}, {"x": 1, "residual": 1}),
                        frozenset({"fwd", "grad_of"}), sizes=(2, 3)))
  return tuple(out)


ROWS = P("a", "b", None)


def _sharding_table(kind) -> tuple:
  params = ("weight", "bias") if kind == "layer" else ("weight",)
  d_sharded = P("a", None, "b")
  return (
      # Leading dims sharded: no collective forward, only the dweight/dbias all-reduce
      # backward, results keeping the rows' sharding.
      C.ShardingCase("rows", full_case(kind, jnp.bfloat16, (8, 6), 59),
                     {"x": ROWS, "residual": ROWS},
                     fwd=frozenset(), bwd=frozenset({"all-reduce"}),
                     out_specs={"y": ROWS, "h": ROWS},
                     grad_specs={"x": ROWS, "residual": ROWS, **{p: P(None) for p in params}}),
      # The same with float32 parameters beside bfloat16 rows (master weights).
      C.ShardingCase("rows-f32params",
                     full_case(kind, jnp.bfloat16, (8, 6), 59, param_dtype=jnp.float32),
                     {"x": ROWS, "residual": ROWS},
                     fwd=frozenset(), bwd=frozenset({"all-reduce"}),
                     out_specs={"y": ROWS, "h": ROWS},
                     grad_specs={"x": ROWS, "residual": ROWS, **{p: P(None) for p in params}},
                     axis_types=("auto",)),
      # D sharded (x over 'b', weight over 'b' too): still right, by a gather.
      C.ShardingCase("D-sharded", full_case(kind, jnp.float32, (8, 6), 118),
                     {"x": d_sharded, "residual": d_sharded, "weight": P("b"), "bias": P(None)},
                     cot_specs={"y": d_sharded, "h": d_sharded}, gathers=True),
      # Replicated arguments on the mesh, and a rank-1 x sharded over D.
      C.ShardingCase("replicated", Case(kind, jnp.float32, (), 64, bias=kind == "layer"), {},
                     grad=False, axis_types=("auto",)),
      C.ShardingCase("rank1-D", Case(kind, jnp.float32, (), 64, bias=kind == "layer"),
                     {"x": P(("a", "b")), "bias": P("a")}, grad=False, axis_types=("auto",)),
  )


def _bad(kind) -> tuple:
  x = lambda: jnp.ones((2, 3))
  table = [
      ("x-scalar", lambda: dict(x=jnp.float32(1.0)), ValueError, r"\bx\b.*rank"),
      ("x-int32", lambda: dict(x=jnp.ones((2, 3), jnp.int32)), TypeError, r"\bx\b.*dtype"),
      ("x-float64", lambda: dict(x=np.ones((2, 3), np.float64)), TypeError, r"\bx\b.*dtype"),
      ("x-string", lambda: dict(x="abc"), TypeError, r"\bx\b"),
      ("weight-shape", lambda: dict(x=x(), weight=jnp.ones((4,))), ValueError,
       r"weight.*shape"),
      ("weight-rank", lambda: dict(x=x(), weight=jnp.ones((2, 3))), ValueError,
       r"weight.*shape"),
      # weight: x's dtype or float32 (master weights), nothing else.
      ("weight-dtype", lambda: dict(x=jnp.ones((2, 3), jnp.bfloat16),
                                    weight=jnp.ones((3,), jnp.float16)),
       TypeError, r"weight.*dtype of x \(bfloat16\) or float32"),
      ("weight-dtype-f32x", lambda: dict(x=x(), weight=jnp.ones((3,), jnp.bfloat16)),
       TypeError, r"weight.*dtype of x \(float32\), got bfloat16"),
      ("residual-shape", lambda: dict(x=x(), residual=jnp.ones((3, 3))), ValueError,
       r"residual.*shape"),
      ("residual-broadcastable", lambda: dict(x=x(), residual=jnp.ones((3,))), ValueError,
       r"residual.*shape"),
      ("residual-dtype", lambda: dict(x=x(), residual=jnp.ones((2, 3), jnp.float16)),
       TypeError, r"residual.*dtype"),
      ("eps-zero", lambda: dict(x=x(), eps=0.0), ValueError, r"\beps\b"),
      ("eps-negative", lambda: dict(x=x(), eps=-1e-5), ValueError, r"\beps\b"),
      ("eps-nan", lambda: dict(x=x(), eps=float("nan")), ValueError, r"\beps\b"),
      ("eps-inf", lambda: dict(x=x(), eps=float("inf")), ValueError, r"\beps\b"),
      ("eps-string", lambda: dict(x=x(), eps="big"), TypeError, r"\beps\b"),
      ("implementation-bogus", lambda: dict(x=x(), implementation="bogus"), ValueError,
       r"implementation"),
  ]
  if kind == "layer":
    table += [
        ("bias-shape", lambda: dict(x=x(), bias=jnp.ones((4,))), ValueError, r"bias.*shape"),
        ("bias-dtype", lambda: dict(x=x(), bias=jnp.ones((3,), jnp.float16)), TypeError,
         r"bias.*dtype"),
        ("bias-dtype-16bit", lambda: dict(x=jnp.ones((2, 3), jnp.float16),
                                          weight=jnp.ones((3,)),
                                          bias=jnp.ones((3,), jnp.bfloat16)),
         TypeError, r"bias.*dtype of x \(float16\) or float32"),
    ]
  else:
    for vid, value, error in (("nan", float("nan"), ValueError), ("inf", float("inf"), ValueError),
                              ("-inf", -float("inf"), ValueError), ("string", "one", TypeError)):
      table.append((f"weight_offset-{vid}",
                    lambda value=value: dict(x=x(), weight=jnp.ones((3,)), weight_offset=value),
                    error, "weight_offset"))
  return tuple(C.BadInput(*b) for b in table)


def _spec(kind) -> C.OpSpec:
  rows = P(("a", "b"))
  return C.OpSpec(
      name=KINDS[kind],
      make=make,
      example=full_case(kind, jnp.float32, (5,), 59, residual=False, offset=0.0),
      array_args=("x", "weight", "bias", "residual") if kind == "layer" else
      ("x", "weight", "residual"),
      diff_args=("x", "weight", "bias", "residual") if kind == "layer" else
      ("x", "weight", "residual"),
      oracle=lambda a, s, dtype: reference(kind, a, s, h_dtype=dtype),
      outputs=("y", "h"),
      atol=_atol(kind),
      grad_atol_ulps=GRAD_ATOL_ULPS,
      vmap=_vmap_table(kind),
      # pmap over 4 devices, the weight broadcast.
      pmap=C.VmapCase("x0-res0", full_case(kind, jnp.float32, (3,), 59, offset=0.0),
                      ({"x": 0, "residual": 0},), sizes=(C.PMAP_DEVICES,)),
      sharding=_sharding_table(kind),
      # Rows split 8 ways, the parameters replicated.
      shard_map=C.ShardMapCase(full_case(kind, jnp.bfloat16, (8, 6), 111),
                               {"x": rows, "residual": rows}, (rows, rows)),
      bad_inputs=_bad(kind),
      size_zero=tuple((str(shape), full_case(kind, jnp.bfloat16, shape[:-1], shape[-1],
                                             offset=0.0))
                      for shape in ((0, 8), (3, 0), (0,), (2, 0, 5))),
  )


SPECS = (_spec("rms"), _spec("layer"))
