"""cross_entropy: the float64 oracles, the float32-math reference, cases, argument makers,
the rounding atols, and the op's contract spec.

Oracles, written here independently of jaxgpu.reference (which IS the 'xla'
implementation under test):
  * `np_losses` / `np_dlogits`: float64 numpy, fed the exact values the inputs hold;
  * `jnp_ce`: the same formulas in jnp, computed in float32 for low-precision inputs (the
    error budget, tests/oracle.py's 2x rule) and in float64 under oracle.x64() (the
    contract's oracle: vmap, sharding, shard_map, pmap).
The loss is float32 whatever the logits dtype, so its atol is in float32 ulps; dlogits is
in the logits' dtype.
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

REDUCTIONS = ("mean", "sum", "none")

# dlogits: the kernels' exp and the reference's differ in the last float32 bits before the
# rounding to the logits' dtype; a few ulps of that dtype of headroom, as for norm.
GRAD_ATOL_ULPS = 8.0


@dataclasses.dataclass(frozen=True)
class Case:
  dtype: object
  lead: tuple[int, ...]
  vocab: int
  ignore_index: int | None = None
  label_smoothing: float = 0.0
  softcap: float | None = None
  reduction: str = "mean"

  @property
  def shape(self):
    return self.lead + (self.vocab,)

  def static(self) -> dict:
    return dict(ignore_index=self.ignore_index, label_smoothing=self.label_smoothing,
                logit_softcap=self.softcap)

  def id(self) -> str:
    parts = [jnp.dtype(self.dtype).name, "x".join(map(str, self.shape))]
    if self.ignore_index is not None:
      parts.append(f"ign{self.ignore_index}")
    if self.label_smoothing:
      parts.append(f"ls{self.label_smoothing:g}")
    if self.softcap is not None:
      parts.append(f"cap{self.softcap:g}")
    parts.append(self.reduction)
    return "-".join(parts)



# ---- oracles --------------------------------------------------------------------------------


def np_losses(logits, labels, ignore_index=None, label_smoothing=0.0, logit_softcap=None):
  """float64 per-position losses (NaN for an out-of-range label, 0 for an ignored one) and
  the row statistics the gradient needs."""
  x = oracle.as_f64(logits)
  vocab = x.shape[-1]
  z = logit_softcap * np.tanh(x / logit_softcap) if logit_softcap else x
  m = z.max(-1, keepdims=True)
  lse = (m + np.log(np.exp(z - m).sum(-1, keepdims=True)))[..., 0]
  lab = np.asarray(labels).astype(np.int64)
  in_range = (lab >= 0) & (lab < vocab)
  z_label = np.take_along_axis(z, np.clip(lab, 0, vocab - 1)[..., None], -1)[..., 0]
  loss = lse - (1 - label_smoothing) * z_label - label_smoothing * z.mean(-1)
  loss = np.where(in_range, loss, np.nan)
  ignored = (lab == ignore_index) if ignore_index is not None else np.zeros(lab.shape, bool)
  return np.where(ignored, 0.0, loss), lse, z, ignored | ~in_range


def np_count(labels, ignore_index):
  lab = np.asarray(labels)
  return float(lab.size if ignore_index is None else (lab != ignore_index).sum())


def np_reduce(loss, labels, reduction, ignore_index=None):
  if reduction == "none":
    return loss
  if reduction == "sum":
    return loss.sum()
  return loss.sum() / max(np_count(labels, ignore_index), 1.0)


def np_row_cotangent(ct, labels, reduction, ignore_index=None):
  """d(reduced loss)/d(per-position loss), times the cotangent ct."""
  shape = np.asarray(labels).shape
  ct = np.asarray(ct, np.float64)
  if reduction == "none":
    return ct
  if reduction == "sum":
    return np.broadcast_to(ct, shape)
  return np.broadcast_to(ct / max(np_count(labels, ignore_index), 1.0), shape)


def np_dlogits(logits, labels, g, ignore_index=None, label_smoothing=0.0, logit_softcap=None):
  """float64 gradient of sum(g * per-position loss) with respect to logits."""
  _, lse, z, dead = np_losses(logits, labels, ignore_index, label_smoothing, logit_softcap)
  vocab = z.shape[-1]
  lab = np.clip(np.asarray(labels).astype(np.int64), 0, vocab - 1)
  onehot = np.arange(vocab) == lab[..., None]
  d = np.exp(z - lse[..., None]) - (1 - label_smoothing) * onehot - label_smoothing / vocab
  if logit_softcap:
    d = d * (1 - np.tanh(oracle.as_f64(logits) / logit_softcap) ** 2)
  d = d * np.asarray(g, np.float64)[..., None]
  return np.where(dead[..., None], 0.0, d)


def jnp_ce(logits, labels, ignore_index=None, label_smoothing=0.0, logit_softcap=None,
           reduction="mean"):
  """The formulas in jnp: float32 math for low-precision logits, float64 under x64."""
  stat = jnp.promote_types(logits.dtype, jnp.float32)
  z = logits.astype(stat)
  vocab = z.shape[-1]
  if logit_softcap is not None:
    z = logit_softcap * jnp.tanh(z / logit_softcap)
  m = jax.lax.stop_gradient(jnp.max(z, -1, keepdims=True))
  lse = (m + jnp.log(jnp.sum(jnp.exp(z - m), -1, keepdims=True)))[..., 0]
  onehot = jax.nn.one_hot(labels, vocab, dtype=stat)
  loss = lse - (1 - label_smoothing) * jnp.sum(z * onehot, -1) - label_smoothing * jnp.mean(z, -1)
  loss = jnp.where((labels >= 0) & (labels < vocab), loss, jnp.nan)
  if ignore_index is not None:
    valid = labels != ignore_index
    loss = jnp.where(valid, loss, 0.0)
    count = jnp.sum(valid).astype(stat)
  else:
    count = jnp.asarray(labels.size, stat)
  if reduction == "none":
    return loss
  if reduction == "sum":
    return jnp.sum(loss)
  return jnp.sum(loss) / jnp.maximum(count, 1)


# ---- inputs and rounding atols -------------------------------------------------------------


def make_logits(rng, shape, dtype, softcap=None):
  # With a softcap, logits reach well past it (both tanh branches, and saturation).
  scale = float(rng.uniform(1.0, 4.0)) if softcap is None else 1.5 * softcap
  return oracle.randn(rng, shape, dtype, scale, float(rng.uniform(-2, 2)))


def make_labels(rng, lead, vocab, ignore_index=None, frac_ignored=0.25):
  labels = rng.integers(0, vocab, size=lead).astype(np.int32)
  if ignore_index is not None:
    labels = np.where(rng.random(lead) < frac_ignored, ignore_index, labels).astype(np.int32)
  return jnp.asarray(labels)


def make_case(rng, case: Case):
  return (make_logits(rng, case.shape, case.dtype, case.softcap),
          make_labels(rng, case.lead, case.vocab, case.ignore_index))


def make(rng, case: Case) -> C.Inputs:
  logits, labels = make_case(rng, case)
  return C.Inputs({"logits": logits, "labels": labels},
                  dict(case.static(), reduction=case.reduction))


def dlogits_atol(logits, labels, g, static) -> float:
  """Rounding atol of dlogits = g * (softmax - target): the float32 lse kept for the
  backward pass is rounded by |lse| float32 ulps, which moves every probability by that
  relative amount; the gradient cancels (V = 1: exactly 0 = 1 - 1) to below it."""
  _, lse, _, dead = np_losses(logits, labels, **static)
  terms = np.where(dead, 0.0, np.abs(np.asarray(g, np.float64)) * (1 + np.abs(np.nan_to_num(lse))))
  return 8 * oracle.unit_roundoff(jnp.float32) * float(np.max(terms, initial=0.0))


def loss_atol(logits, labels, reduction, static):
  """Rounding atol of a loss = lse - (smoothed) target logit: float32 math cancels the two
  to a few |lse| ulps, while the oracle may be ~0 (V = 1: exactly 0 = lse - x), so the
  oracle-relative atol alone is no budget. Per row, summed by the "sum" reduction."""
  _, lse, _, dead = np_losses(logits, labels, **static)
  terms = np.where(dead, 0.0, 1 + np.abs(np.nan_to_num(lse)))
  total = np.sum(terms) if reduction == "sum" else np.max(terms, initial=0.0)
  return 8 * oracle.unit_roundoff(jnp.float32) * float(total)



def _options(static: dict) -> dict:
  return {k: v for k, v in static.items() if k != "reduction"}


def _oracle(arrays, static, dtype):
  return (jnp_ce(arrays["logits"], arrays["labels"], **static),)


def _atol(arrays, static, cots, outs):
  logits, labels = arrays["logits"], arrays["labels"]
  options, reduction = _options(static), static["reduction"]
  out = {"loss": loss_atol(logits, labels, reduction, options)}
  if cots is None:
    return out, {}
  g = np_row_cotangent(cots[0], labels, reduction, options["ignore_index"])
  return out, {"logits": dlogits_atol(logits, labels, g, options)}


# ---- the contract tables ---------------------------------------------------------------------

OPTIONS = dict(ignore_index=-100, label_smoothing=0.1, softcap=20.0)

# (id, logits axis, labels axis, dtype): every reduction vmapped, and vmap(grad) of the mean.
VMAP_AXES = [
    ("both0", 0, 0, jnp.float32),
    ("logits-2-labels-1", -2, -1, jnp.bfloat16),
    ("logits-only", 1, None, jnp.float16),
    ("labels-only", None, 0, jnp.bfloat16),
]


def _vmap_table() -> tuple:
  out = []
  for name, lax, tax, dtype in VMAP_AXES:
    axes = {k: v for k, v in (("logits", lax), ("labels", tax)) if v is not None}
    for reduction in REDUCTIONS:
      modes = {"fwd", "grad"} if reduction == "mean" else {"fwd"}
      out.append(C.VmapCase(f"{name}-{reduction}",
                            Case(dtype, (4, 5), 59, reduction=reduction, **OPTIONS),
                            (axes,), frozenset(modes)))
  # grad(vmap(vmap)): per (batch, position) means, and their gradient.
  out.append(C.VmapCase("nested", Case(jnp.bfloat16, (2,), 59, **OPTIONS),
                        ({"logits": 0, "labels": 0}, {"logits": 1, "labels": 1}),
                        frozenset({"fwd", "grad_of"}), sizes=(3, 5)))
  return tuple(out)


def _scalar_all_reduces(hlo: str) -> bool:
  """Every all-reduce in the HLO reduces scalars (f32[] / s32[], or a tuple of them)."""
  for line in hlo.splitlines():
    if "=" not in line:
      continue
    m = re.match(r"(.*?)\s(all-reduce|all-reduce-start)\(", line.split("=", 1)[1].strip())
    if m and any(d.strip() for d in re.findall(r"\[([^\]]*)\]", m.group(1))):
      return False
  return True


ROWS = P("a", "b", None)
SHARD_OPTIONS = dict(ignore_index=-100, label_smoothing=0.1, softcap=30.0)

SHARDINGS = (
    # Leading dims sharded. 'none': no collective at all, the losses keep the sharding.
    C.ShardingCase("rows-none", Case(jnp.bfloat16, (8, 6), 59, reduction="none",
                                     **SHARD_OPTIONS),
                   {"logits": ROWS, "labels": P("a", "b")}, fwd=frozenset(), bwd=frozenset(),
                   out_specs={"loss": P("a", "b")}, grad_specs={"logits": ROWS}),
    # 'mean': only all-reduces of scalars (the sum and the count). ('sum' is 'mean' without
    # the count: test_shard_map_global_sum runs it.)
    C.ShardingCase("rows-mean", Case(jnp.bfloat16, (8, 6), 59, reduction="mean",
                                     **SHARD_OPTIONS),
                   {"logits": ROWS, "labels": P("a", "b")}, fwd=frozenset({"all-reduce"}),
                   bwd=frozenset({"all-reduce"}), grad_specs={"logits": ROWS},
                   hlo_check=_scalar_all_reduces),
    # The vocabulary sharded: right (the kernels gather whole rows first, not only sums).
    C.ShardingCase("vocab", Case(jnp.float32, (8,), 118, label_smoothing=0.1),
                   {"logits": P("a", "b"), "labels": P("a")},
                   hlo_check=lambda hlo: bool(oracle.collectives(hlo) - {"all-reduce"}),
                   kernels_only=True),
)

X = lambda: jnp.ones((2, 3, 7), jnp.float32)
L = lambda: jnp.zeros((2, 3), jnp.int32)

BAD_INPUTS = tuple(C.BadInput(*b) for b in [
    ("logits-int", lambda: dict(logits=jnp.ones((2, 7), jnp.int32),
                                labels=jnp.zeros(2, jnp.int32)), TypeError, r"logits.*dtype"),
    ("logits-float64", lambda: dict(logits=np.ones((2, 7)), labels=np.zeros(2, np.int32)),
     TypeError, r"logits.*dtype"),
    ("logits-scalar", lambda: dict(logits=jnp.float32(1.0), labels=jnp.int32(0)),
     ValueError, r"logits.*rank"),
    ("logits-empty-vocab", lambda: dict(logits=jnp.ones((2, 0)), labels=jnp.zeros(2, jnp.int32)),
     ValueError, r"vocabulary"),
    ("labels-float", lambda: dict(logits=X(), labels=jnp.zeros((2, 3), jnp.float32)),
     TypeError, r"labels.*integer"),
    ("labels-bool", lambda: dict(logits=X(), labels=jnp.zeros((2, 3), bool)),
     TypeError, r"labels.*integer"),
    ("labels-shape", lambda: dict(logits=X(), labels=jnp.zeros((3, 2), jnp.int32)),
     ValueError, r"labels.*shape"),
    ("labels-with-vocab-dim", lambda: dict(logits=X(), labels=jnp.zeros((2, 3, 7), jnp.int32)),
     ValueError, r"labels.*shape"),
    ("labels-string", lambda: dict(logits=X(), labels="cat"), TypeError, r"labels"),
    ("ls-negative", lambda: dict(logits=X(), labels=L(), label_smoothing=-0.1),
     ValueError, r"label_smoothing"),
    ("ls-one", lambda: dict(logits=X(), labels=L(), label_smoothing=1.0),
     ValueError, r"label_smoothing"),
    ("ls-nan", lambda: dict(logits=X(), labels=L(), label_smoothing=float("nan")),
     ValueError, r"label_smoothing"),
    ("ls-string", lambda: dict(logits=X(), labels=L(), label_smoothing="0.1"),
     TypeError, r"label_smoothing"),
    ("softcap-zero", lambda: dict(logits=X(), labels=L(), logit_softcap=0.0),
     ValueError, r"logit_softcap"),
    ("softcap-negative", lambda: dict(logits=X(), labels=L(), logit_softcap=-30.0),
     ValueError, r"logit_softcap"),
    ("softcap-inf", lambda: dict(logits=X(), labels=L(), logit_softcap=float("inf")),
     ValueError, r"logit_softcap"),
    ("reduction-bogus", lambda: dict(logits=X(), labels=L(), reduction="avg"),
     ValueError, r"reduction"),
    ("reduction-none-object", lambda: dict(logits=X(), labels=L(), reduction=None),
     ValueError, r"reduction"),
    ("ignore-float", lambda: dict(logits=X(), labels=L(), ignore_index=-100.0),
     TypeError, r"ignore_index"),
    ("ignore-too-big", lambda: dict(logits=X(), labels=L(), ignore_index=2**40),
     ValueError, r"ignore_index"),
    ("implementation-bogus", lambda: dict(logits=X(), labels=L(), implementation="bogus"),
     ValueError, r"implementation"),
])

ROWS8 = P(("a", "b"))

SPECS = (C.OpSpec(
    name="cross_entropy",
    make=make,
    example=Case(jnp.float32, (5,), 59, ignore_index=-100),
    array_args=("logits", "labels"),
    diff_args=("logits",),
    oracle=_oracle,
    outputs=("loss",),
    atol=_atol,
    grad_atol_ulps=GRAD_ATOL_ULPS,
    vmap=_vmap_table(),
    # pmap over 4 devices: per-device means and gradients.
    pmap=C.VmapCase("both0", Case(jnp.float32, (3,), 59, ignore_index=-100, label_smoothing=0.1),
                    ({"logits": 0, "labels": 0},), sizes=(C.PMAP_DEVICES,)),
    sharding=SHARDINGS,
    # Positions split 8 ways: per-shard losses (a global sum: test_cross_entropy.py).
    shard_map=C.ShardMapCase(Case(jnp.bfloat16, (16,), 111, reduction="none", **SHARD_OPTIONS),
                             {"logits": ROWS8, "labels": ROWS8}, (ROWS8,)),
    bad_inputs=BAD_INPUTS,
    size_zero=tuple((f"{'x'.join(map(str, lead))}-{r}",
                     Case(jnp.bfloat16, lead, 7, ignore_index=-100, reduction=r))
                    for lead in ((0,), (2, 0), (0, 3)) for r in REDUCTIONS),
),)
