"""linear_cross_entropy: the float64 oracle, cases, argument makers, the rounding atols, and
the op's contract spec.

The oracle is the cross-entropy family's (specs/cross_entropy.py, written independently of
jaxgpu.reference) applied to logits formed in float64 and rounded once to x's dtype, which
is what the op's semantics say the logits are (the product x w^T in x's dtype, as XLA's
x @ w.T): the loss and the gradients then differ from the oracle only by the op's own
float32 arithmetic.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import contract as C
import oracle
from specs import cross_entropy as ce

REDUCTIONS = ce.REDUCTIONS


@dataclasses.dataclass(frozen=True)
class Case:
  dtype: object
  lead: tuple[int, ...]
  vocab: int
  dim: int = 24
  w_layout: str = "vd"
  ignore_index: int | None = None
  label_smoothing: float = 0.0
  softcap: float | None = None
  reduction: str = "mean"

  @property
  def w_shape(self):
    return (self.vocab, self.dim) if self.w_layout == "vd" else (self.dim, self.vocab)

  def static(self) -> dict:
    return dict(w_layout=self.w_layout, ignore_index=self.ignore_index,
                label_smoothing=self.label_smoothing, logit_softcap=self.softcap)

  def id(self) -> str:
    parts = [jnp.dtype(self.dtype).name, "x".join(map(str, self.lead + (self.dim,))),
             f"V{self.vocab}", self.w_layout]
    if self.ignore_index is not None:
      parts.append(f"ign{self.ignore_index}")
    if self.label_smoothing:
      parts.append(f"ls{self.label_smoothing:g}")
    if self.softcap is not None:
      parts.append(f"cap{self.softcap:g}")
    parts.append(self.reduction)
    return "-".join(parts)


# ---- oracle ----------------------------------------------------------------------------------


def logits_of(x, w, w_layout, dtype):
  """x w^T (or x w) at the arrays' precision, rounded once to `dtype` (the op's logits)."""
  eq = "...d,vd->...v" if w_layout == "vd" else "...d,dv->...v"
  z = jnp.einsum(eq, x, w, precision=jax.lax.Precision.HIGHEST)
  return z.astype(dtype).astype(z.dtype)


def np_logits(x, w, w_layout, dtype):
  z = oracle.as_f64(x) @ (oracle.as_f64(w).T if w_layout == "vd" else oracle.as_f64(w))
  return np.asarray(jnp.asarray(z).astype(dtype).astype(jnp.float32), np.float64)


def _options(static: dict) -> dict:
  return {k: v for k, v in static.items() if k not in ("reduction", "w_layout")}


def _oracle(arrays, static, dtype):
  z = logits_of(arrays["x"], arrays["w"], static["w_layout"], dtype or arrays["x"].dtype)
  return (ce.jnp_ce(z, arrays["labels"], reduction=static["reduction"], **_options(static)),)


def _atol(arrays, static, cots, outs):
  """The cross-entropy's rounding atols on the op's logits; the gradients: those of dlogits
  (rounded to x's dtype in the kernels, as the reference's are), carried through the
  products: |dlogits| summed over the vocabulary times max |w| (dx), over the rows times
  max |x| (dw)."""
  x, w, labels = arrays["x"], arrays["w"], arrays["labels"]
  options, reduction = _options(static), static["reduction"]
  z = np_logits(x, w, static["w_layout"], x.dtype)
  out = {"loss": ce.loss_atol(z, labels, reduction, options)}
  if cots is None:
    return out, {}
  g = ce.np_row_cotangent(cots[0], labels, reduction, options["ignore_index"])
  d = np.abs(ce.np_dlogits(z, labels, g, **options))
  unit = oracle.unit_roundoff(x.dtype)
  scale = lambda a: float(np.max(np.abs(oracle.as_f64(a)), initial=0.0))
  rows_d = d.reshape(-1, d.shape[-1])
  dx = 4 * unit * float(np.max(rows_d.sum(-1), initial=0.0)) * scale(w)
  dw = 4 * unit * float(np.max(rows_d.sum(0), initial=0.0)) * scale(x)
  return out, {"x": dx, "w": dw}


# ---- inputs ----------------------------------------------------------------------------------


def make(rng, case: Case) -> C.Inputs:
  x = oracle.randn(rng, case.lead + (case.dim,), case.dtype, 1.0)
  # Logits of a few units (and past the softcap with one): w scaled by 1 / sqrt(D).
  scale = (3.0 if case.softcap is None else 1.5 * case.softcap) / np.sqrt(case.dim)
  w = oracle.randn(rng, case.w_shape, case.dtype, scale)
  labels = ce.make_labels(rng, case.lead, case.vocab, case.ignore_index)
  return C.Inputs({"x": x, "w": w, "labels": labels},
                  dict(case.static(), reduction=case.reduction))


# ---- the contract tables ---------------------------------------------------------------------

OPTIONS = dict(ignore_index=-100, label_smoothing=0.1, softcap=20.0)


def _vmap_table() -> tuple:
  out = []
  for name, axes, dtype, layout in [
      ("all0", {"x": 0, "labels": 0}, jnp.float32, "vd"),
      ("x-2-labels-1", {"x": -2, "labels": -1}, jnp.bfloat16, "dv"),
      ("w-only", {"w": 0}, jnp.float32, "dv"),
      ("all-with-w", {"x": 1, "w": 0, "labels": 1}, jnp.float16, "vd")]:
    for reduction in REDUCTIONS:
      modes = {"fwd", "grad"} if reduction == "mean" else {"fwd"}
      out.append(C.VmapCase(f"{name}-{reduction}",
                            Case(dtype, (4, 5), 59, w_layout=layout, reduction=reduction,
                                 **OPTIONS),
                            (axes,), frozenset(modes)))
  return tuple(out)


def _small_gathers(hlo: str, limit: int = 64) -> bool:
  """Every all-gather moves at most `limit` elements: per-row statistics, never a weight
  or logits (and the program has at least one collective)."""
  found = False
  for line in hlo.splitlines():
    if "=" not in line:
      continue
    rhs = line.split("=", 1)[1]
    m = re.search(r"\s(all-gather|all-gather-start|all-reduce|all-reduce-start)\(", " " + rhs)
    if not m:
      continue
    found = True
    if m.group(1).startswith("all-gather"):
      for dims in re.findall(r"\w+\[([\d,]*)\]", rhs[:m.start()]):
        if int(np.prod([int(d) for d in dims.split(",") if d] or [1])) > limit:
          return False
  return found


ROWS = P("a", "b", None)
SHARDINGS = (
    # Rows split: the losses keep the sharding; 'mean' all-reduces its scalars, and the
    # gradient program the weight gradient.
    C.ShardingCase("rows-none", Case(jnp.bfloat16, (8, 6), 59, reduction="none", **OPTIONS),
                   {"x": ROWS, "labels": P("a", "b")}, fwd=frozenset(),
                   out_specs={"loss": P("a", "b")}, grad_specs={"x": ROWS, "w": P()}),
    C.ShardingCase("rows-mean", Case(jnp.float32, (8, 6), 59, w_layout="dv", **OPTIONS),
                   {"x": ROWS, "labels": P("a", "b")}, fwd=frozenset({"all-reduce"}),
                   bwd=frozenset({"all-reduce"}), grad_specs={"x": ROWS, "w": P()}),
    # The vocabulary split (a vocabulary-parallel head): per-row statistics combined, the
    # weight and its gradient stay split, no logits or weight gathered.
    C.ShardingCase("vocab-vd", Case(jnp.float32, (8,), 120, label_smoothing=0.1, softcap=20.0),
                   {"w": P("a", None), "x": P("b", None), "labels": P("b")},
                   grad_specs={"w": P("a", None)}, hlo_check=_small_gathers, kernels_only=True),
    C.ShardingCase("vocab-dv", Case(jnp.bfloat16, (8,), 120, w_layout="dv", ignore_index=-100),
                   {"w": P(None, "a")}, grad_specs={"w": P(None, "a")},
                   hlo_check=_small_gathers, kernels_only=True),
)

X = lambda: jnp.ones((2, 3, 8), jnp.float32)
W = lambda: jnp.ones((11, 8), jnp.float32)
L = lambda: jnp.zeros((2, 3), jnp.int32)

BAD_INPUTS = tuple(C.BadInput(*b) for b in [
    ("x-int", lambda: dict(x=jnp.ones((2, 8), jnp.int32), w=W(), labels=jnp.zeros(2, jnp.int32)),
     TypeError, r"x.*dtype"),
    ("x-float64", lambda: dict(x=np.ones((2, 8)), w=W(), labels=np.zeros(2, np.int32)),
     TypeError, r"x.*dtype"),
    ("x-scalar", lambda: dict(x=jnp.float32(1.0), w=W(), labels=jnp.int32(0)),
     ValueError, r"x.*rank"),
    ("w-dtype", lambda: dict(x=X(), w=W().astype(jnp.bfloat16), labels=L()),
     TypeError, r"w.*dtype"),
    ("w-3d", lambda: dict(x=X(), w=jnp.ones((2, 11, 8)), labels=L()), ValueError, r"w must be 2-D"),
    ("w-dim", lambda: dict(x=X(), w=jnp.ones((11, 7)), labels=L()), ValueError, r"w's D"),
    ("w-layout-bogus", lambda: dict(x=X(), w=W(), labels=L(), w_layout="vt"),
     ValueError, r"w_layout"),
    ("w-layout-transposed", lambda: dict(x=X(), w=W(), labels=L(), w_layout="dv"),
     ValueError, r"w's D"),
    ("w-empty-vocab", lambda: dict(x=X(), w=jnp.ones((0, 8)), labels=L()),
     ValueError, r"vocabulary"),
    ("labels-float", lambda: dict(x=X(), w=W(), labels=jnp.zeros((2, 3), jnp.float32)),
     TypeError, r"labels.*integer"),
    ("labels-shape", lambda: dict(x=X(), w=W(), labels=jnp.zeros((3, 2), jnp.int32)),
     ValueError, r"labels.*shape"),
    ("ls-one", lambda: dict(x=X(), w=W(), labels=L(), label_smoothing=1.0),
     ValueError, r"label_smoothing"),
    ("softcap-negative", lambda: dict(x=X(), w=W(), labels=L(), logit_softcap=-30.0),
     ValueError, r"logit_softcap"),
    ("reduction-bogus", lambda: dict(x=X(), w=W(), labels=L(), reduction="avg"),
     ValueError, r"reduction"),
    ("ignore-float", lambda: dict(x=X(), w=W(), labels=L(), ignore_index=-100.0),
     TypeError, r"ignore_index"),
    ("implementation-bogus", lambda: dict(x=X(), w=W(), labels=L(), implementation="bogus"),
     ValueError, r"implementation"),
])

ROWS8 = P(("a", "b"))

SPECS = (C.OpSpec(
    name="linear_cross_entropy",
    make=make,
    example=Case(jnp.float32, (5,), 59, ignore_index=-100),
    array_args=("x", "w", "labels"),
    diff_args=("x", "w"),
    oracle=_oracle,
    outputs=("loss",),
    atol=_atol,
    vmap=_vmap_table(),
    pmap=C.VmapCase("all0", Case(jnp.float32, (3,), 59, ignore_index=-100, label_smoothing=0.1),
                    ({"x": 0, "labels": 0},), sizes=(C.PMAP_DEVICES,)),
    sharding=SHARDINGS,
    shard_map=C.ShardMapCase(Case(jnp.bfloat16, (16,), 111, reduction="none", **OPTIONS),
                             {"x": P(("a", "b"), None), "labels": ROWS8}, (ROWS8,)),
    bad_inputs=BAD_INPUTS,
    size_zero=tuple((f"{'x'.join(map(str, lead))}-{r}",
                     Case(jnp.bfloat16, lead, 7, ignore_index=-100, reduction=r))
                    for lead in ((0,), (2, 0)) for r in REDUCTIONS),
),)
