"""gelu, silu, relu, sigmoid, swiglu, geglu: the float64 oracles, the low-precision
reference, argument makers, the gradients' rounding atol, and the six ops' contract specs
(one builder: they share one elementwise shape convention, gated ones take gate and up).

Oracles: closed-form float64 numpy formulas for every activation AND its derivative
(written from the textbook definitions, not from the kernels' algebra: the kernels compute
the tanh form of gelu as x * sigmoid(2u)); test_activation.py's `test_oracle_derivatives`
checks them against jax.grad of jax.nn under x64, which is the contract's float64 oracle.
The low-precision reference is jax.nn computed in float32 and rounded to the op's dtype.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import contract as C
import oracle

# The gradients differ from the oracle's by float32 rounding of a few products on top of
# the final rounding to the dtype: a few more ulps of headroom than the forward.
GRAD_ATOL_ULPS = 8.0
GRAD_TERM_ULPS = 8.0


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

  @property
  def args(self) -> tuple:
    return ("gate", "up") if self.gated else ("x",)

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


def np_grads_atol(v: Variant, arrays, ct):
  """(float64 gradients, a float32 rounding atol for each): GRAD_TERM_ULPS float32 unit
  roundoffs of the magnitude of the terms each gradient is made of (see np_act_terms; as
  dx_atol in specs/norm.py). dup = ct * f has no cancellation: no extra atol."""
  f, d, m = np_act_terms(v.act, oracle.as_f64(arrays[0]))
  ct = oracle.as_f64(ct)
  u32 = oracle.unit_roundoff(jnp.float32)
  scale = ct * (oracle.as_f64(arrays[1]) if v.gated else 1.0) * m
  atol = GRAD_TERM_ULPS * u32 * float(np.max(np.abs(scale), initial=0.0))
  if not v.gated:
    return (ct * d,), (atol,)
  return (ct * oracle.as_f64(arrays[1]) * d, ct * f), (atol, 0.0)


# ---- the reference: jax.nn at float32 or wider, rounded to the op's dtype ---------------------

JAX_ACT = {
    "relu": jax.nn.relu,
    "sigmoid": jax.nn.sigmoid,
    "silu": jax.nn.silu,
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_erf": functools.partial(jax.nn.gelu, approximate=False),
}


def lowp_fn(v: Variant):
  """jax.nn in float32 (float64 under x64), rounded to the op's dtype: positional arrays."""
  act = JAX_ACT[v.act]

  def fn(*a):
    acc = jnp.promote_types(a[0].dtype, jnp.float32)
    y = act(a[0].astype(acc))
    if v.gated:
      y = y * a[1].astype(acc)
    return y.astype(a[0].dtype)

  return fn


# ---- inputs ----------------------------------------------------------------------------------


def make_arrays(rng, v: Variant, shape, dtype):
  """x (or gate) spread wide enough to reach both saturated tails; up ~ N(0, 1)."""
  scale = float(rng.uniform(1.0, 4.0))
  arrays = [oracle.randn(rng, shape, dtype, scale)]
  if v.gated:
    arrays.append(oracle.randn(rng, shape, dtype))
  return tuple(arrays)


@dataclasses.dataclass(frozen=True)
class Case:
  variant: Variant
  dtype: object
  shape: tuple[int, ...]


def make(rng, case: Case) -> C.Inputs:
  v = case.variant
  return C.Inputs(dict(zip(v.args, make_arrays(rng, v, case.shape, case.dtype))), v.kwargs())


def _variant(op, static) -> Variant:
  if op in ("gelu", "geglu"):
    form = "tanh" if static["approximate"] else "erf"
    return BY_NAME[f"{op}_{form}"]
  return BY_NAME[op]


def _atol(op):
  def atol(arrays, static, cots, outs):
    if cots is None:
      return {}, {}
    v = _variant(op, static)
    _, at = np_grads_atol(v, [arrays[k] for k in v.args], cots[0])
    return {}, dict(zip(v.args, at))
  return atol


# ---- the contract tables -------------------------------------------------------------------------

def _id(v: Variant, rest: str) -> str:
  """A case id, led by the form (tanh, erf) for the ops that have two."""
  return f"{v.name.split('_')[1]}-{rest}" if "_" in v.name else rest


def _axes_id(in_axes: dict) -> str:
  return ",".join(f"{a}{x}" for a, x in in_axes.items())


VMAP_BASE = (4, 59)
UNARY_AXES = [(0,), (1,), (-1,)]
GATED_AXES = [(0, 0), (1, -1), (0, None), (None, 1), (-1, 0)]


def _vmap_cases() -> dict:
  """{op: VmapCases}: every in_axes entry with two variants (unary) or one (gated), rotated
  so that every variant and every dtype occurs, forward and vmap(grad); grad(vmap) with an
  unbatched up; vmap(vmap)."""
  out = {}
  k = 0
  for variants, axes_list, per_axes in ((UNARY, UNARY_AXES, 2), (GATED, GATED_AXES, 1)):
    for axes in axes_list:
      for _ in range(per_axes):
        v = variants[k % len(variants)]
        dtype = oracle.DTYPES[k % len(oracle.DTYPES)]
        k += 1
        in_axes = {a: x for a, x in zip(v.args, axes) if x is not None}
        out.setdefault(v.op, []).append(C.VmapCase(_id(v, _axes_id(in_axes)),
                                                   Case(v, dtype, VMAP_BASE), (in_axes,)))
  for name in ("gelu_tanh", "swiglu", "geglu_erf"):
    v = BY_NAME[name]
    out[v.op].append(C.VmapCase(_id(v, _axes_id({v.args[0]: 1})),
                                Case(v, jnp.float32, VMAP_BASE),
                                ({v.args[0]: 1},), frozenset({"grad_of"})))
  for name in ("silu", "geglu_tanh"):
    v = BY_NAME[name]
    out[v.op].append(C.VmapCase(_id(v, "nested"), Case(v, jnp.float16, (5, 59)),
                                ({a: 0 for a in v.args}, {a: 1 for a in v.args}),
                                frozenset({"fwd", "grad_of"}), sizes=(2, 3)))
  return out


# Every dim may be sharded: rows, the last dim, both, a rank-1 array over all 8 devices. No
# collective at all, forward or backward; results and gradients keep the input's sharding.
SHARD_LAYOUTS = [
    ("8x6-a,b", (8, 6), P("a", "b")),
    ("3x16-_,ab", (3, 16), P(None, ("a", "b"))),
    ("2x3x8-b,_,a", (2, 3, 8), P("b", None, "a")),
    ("24-ab", (24,), P(("a", "b"))),
]


def _sharding(v: Variant, layouts) -> tuple:
  return tuple(
      C.ShardingCase(_id(v, name),
                     Case(v, jnp.bfloat16, shape), {a: spec for a in v.args},
                     fwd=frozenset(), bwd=frozenset(), out_specs={"y": spec},
                     grad_specs={a: spec for a in v.args},
                     axis_types=("auto", "explicit") if len(layouts) > 1 else ("auto",))
      for name, shape, spec in layouts)


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


def _bad(op, gated) -> tuple:
  table = list(BAD_GATED if gated else BAD_UNARY)
  if op in ("gelu", "geglu"):
    args = (lambda: dict(gate=_X(), up=_X())) if gated else (lambda: dict(x=_X()))
    for value in ("yes", 1, None, 0.5):
      table.append((f"approximate-{value}", lambda value=value: dict(args(), approximate=value),
                    TypeError, "approximate"))
  return tuple(C.BadInput(*b) for b in table)


# Which variant of each op carries the tables that ran on one variant only: the sharding
# layouts (the rest of the ops get the first one), shard_map, pmap and size 0.
_FULL_SHARDING = ("gelu_erf", "swiglu")
_SHARD_MAP = ("silu", "swiglu")
_PMAP = ("gelu_tanh", "geglu_erf")
_SIZE_ZERO = ("gelu_tanh", "relu", "swiglu", "geglu_erf")
SIZE_ZERO_SHAPES = ((0,), (3, 0), (0, 5), (2, 0, 4))


def _spec(op, vmap_cases) -> C.OpSpec:
  variants = [v for v in VARIANTS if v.op == op]
  v0 = variants[0]
  gated = v0.gated
  rows = P(("a", "b"))
  pick = lambda names: next((v for v in variants if v.name in names), None)
  full = pick(_FULL_SHARDING)
  sm, pm, sz = pick(_SHARD_MAP), pick(_PMAP), pick(_SIZE_ZERO)
  return C.OpSpec(
      name=op,
      make=make,
      example=Case(v0, jnp.float32, (5, 3)),
      array_args=v0.args,
      diff_args=v0.args,
      oracle=lambda a, s, dtype: (lowp_fn(_variant(op, s))(*[a[k] for k in v0.args]),),
      atol=_atol(op),
      grad_atol_ulps=GRAD_ATOL_ULPS,
      vmap=tuple(vmap_cases[op]),
      pmap=None if pm is None else C.VmapCase(_id(pm, "0"), Case(pm, jnp.float32, (3, 59)),
                                              ({a: 0 for a in pm.args},),
                                              sizes=(C.PMAP_DEVICES,)),
      sharding=_sharding(full, SHARD_LAYOUTS) if full else _sharding(v0, SHARD_LAYOUTS[:1]),
      shard_map=None if sm is None else C.ShardMapCase(Case(sm, jnp.bfloat16, (16, 59)),
                                                       {a: rows for a in sm.args}, (rows,)),
      bad_inputs=_bad(op, gated),
      size_zero=() if sz is None else tuple(
          (_id(sz, "x".join(map(str, s))), Case(sz, jnp.bfloat16, s)) for s in SIZE_ZERO_SHAPES),
  )


_VMAP = _vmap_cases()
SPECS = tuple(_spec(op, _VMAP) for op in ("gelu", "silu", "relu", "sigmoid", "swiglu", "geglu"))
