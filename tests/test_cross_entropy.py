"""cross_entropy (jaxgpu/ops/cross_entropy.py, kernels in ffi/cross_entropy/), one test base
run against every implementation (the `implementation` fixture, conftest.py).

Oracles, written here independently of jaxgpu.reference (which IS the 'xla'
implementation under test):
  * `np_losses` / `np_dlogits`: float64 numpy, fed the exact values the inputs hold;
  * `jnp_ce`: the same formulas in jnp, computed in float32 for low-precision inputs (the
    error budget, tests/oracle.py's 2x rule) and in float64 under oracle.x64() (the
    oracle of the transform tests: vmap, sharding, shard_map, pmap).
The loss is float32 whatever the logits dtype, so its atol is in float32 ulps; dlogits is
in the logits' dtype.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxgpu

import oracle
from conftest import HAS_CUDA

try:
  from jax import shard_map
except ImportError:  # older jax
  from jax.experimental.shard_map import shard_map  # type: ignore

AxisType = jax.sharding.AxisType

DTYPES = oracle.DTYPES
REDUCTIONS = ("mean", "sum", "none")
GEMMA_VOCAB = 262144
# Odd and real-world vocabularies: 50257 is GPT-2's (rows are not 16-byte aligned), 262144
# Gemma's (a row of bf16 is 512 KiB: streamed, never held whole).
VOCABS = (1, 3, 59, 128, 4097, 50257, GEMMA_VOCAB)


def _leads(vocab):
  """Few rows when rows are wide: the CPU run stays fast."""
  if vocab >= 50000:
    return ((2,), (), (3,))
  if vocab >= 4096:
    return ((), (5,), (2, 3))
  return ((), (1,), (17,), (3, 5), (2, 3, 4))


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


IGNORES = (None, -100, 0)
SMOOTHINGS = (0.0, 0.1, 0.3)
SOFTCAPS = (None, 30.0, 2.0)


def sampled_cases() -> list[Case]:
  """Every (dtype, V) once; leading shape, ignore_index, label smoothing, softcap and the
  reduction rotated so that each appears with every dtype and many vocabularies."""
  out = []
  for t, dtype in enumerate(DTYPES):
    for i, vocab in enumerate(VOCABS):
      leads = _leads(vocab)
      out.append(Case(dtype, leads[(i + t) % len(leads)], vocab,
                      ignore_index=IGNORES[(i + 2 * t) % 3],
                      label_smoothing=SMOOTHINGS[(i + t) % 3],
                      softcap=SOFTCAPS[(2 * i + t) % 3],
                      reduction=REDUCTIONS[(i + 2 * t + 1) % 3]))
  return out


SAMPLED = sampled_cases()

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


def to64(tree):
  """Float arrays as float64 jax arrays on the CPU (call inside oracle.x64()); integer
  arrays (labels) unchanged."""
  def conv(a):
    a = np.asarray(a)
    return jnp.asarray(oracle.as_f64(a) if np.issubdtype(a.dtype, np.floating) or
                       a.dtype == jnp.bfloat16 else a)
  return jax.tree.map(conv, tree)


def expected(forward, *args):
  """(float64 oracle, float32-math reference) of forward(jnp_ce, *args) -> pytree."""
  lowp = jax.jit(lambda *a: forward(jnp_ce, *a))(*args)
  with oracle.x64():
    exact = jax.jit(lambda *a: forward(jnp_ce, *a))(*to64(args))
    exact = jax.tree.map(oracle.as_f64, exact)
  return exact, lowp


# dlogits: the kernels' exp and the reference's differ in the last float32 bits before the
# rounding to the logits' dtype; a few ulps of that dtype of headroom, as for norm.
GRAD_ATOL_ULPS = 8.0

# ---- inputs ---------------------------------------------------------------------------------


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


def ce_fn(implementation, **static):
  return lambda logits, labels, reduction="mean": jaxgpu.cross_entropy(
      logits, labels, reduction=reduction, implementation=implementation, **static)


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


@functools.partial(jax.jit, static_argnames=("reduction", "ignore_index", "label_smoothing",
                                             "logit_softcap"))
def lowp_ref(logits, labels, ct, reduction, ignore_index=None, label_smoothing=0.0,
             logit_softcap=None):
  """The float32-math reference: every reduction, and dlogits of sum(reduction * ct)."""
  static = dict(ignore_index=ignore_index, label_smoothing=label_smoothing,
                logit_softcap=logit_softcap)
  losses = {r: jnp_ce(logits, labels, reduction=r, **static) for r in REDUCTIONS}
  dlogits = jax.grad(lambda x: jnp.sum(jnp_ce(x, labels, reduction=reduction, **static) * ct))(
      logits)
  return losses, dlogits


def kernel_step(implementation, reduction, **static):
  """jit(x, labels, ct) -> ({reduction: loss}, dlogits of sum(loss[reduction] * ct)): every
  reduction and the gradient from one compilation."""
  fn = ce_fn(implementation, **static)
  return jax.jit(lambda x, l, c: ({r: fn(x, l, r) for r in REDUCTIONS},
                                  jax.grad(lambda x: jnp.sum(fn(x, l, reduction) * c))(x)))


def check_case(got, case: Case, logits, labels, ct, reductions=REDUCTIONS, what=""):
  """got = (losses by reduction, dlogits for case.reduction with cotangent ct) against the
  numpy float64 oracles and the float32-math reference."""
  losses, dlogits = got
  lowp_losses, lowp_dlogits = lowp_ref(logits, labels, jnp.asarray(ct), case.reduction,
                                       **case.static())
  loss64, *_ = np_losses(logits, labels, **case.static())
  for r in reductions:
    assert losses[r].dtype == jnp.float32, losses[r].dtype
    assert losses[r].shape == (labels.shape if r == "none" else ()), losses[r].shape
    oracle.check(losses[r], np_reduce(loss64, labels, r, case.ignore_index), lowp_losses[r],
                 what=f"{case.id()} {what}{r}", dtype=jnp.float32,
                 extra_atol=loss_atol(logits, labels, r, case.static()))
  if dlogits is None:
    return
  assert dlogits.shape == logits.shape and dlogits.dtype == logits.dtype
  g = np_row_cotangent(ct, labels, case.reduction, case.ignore_index)
  oracle.check(dlogits, np_dlogits(logits, labels, g, **case.static()), lowp_dlogits,
               what=f"{case.id()} {what}dlogits", dtype=case.dtype, atol_ulps=GRAD_ATOL_ULPS,
               extra_atol=dlogits_atol(logits, labels, g, case.static()))


def make_cotangent(rng, labels, reduction):
  shape = labels.shape if reduction == "none" else ()
  return oracle.randn(rng, shape, jnp.float32, 1.0, 0.5)


def run_case(case: Case, implementation, rng, logits=None, labels=None, what=""):
  if logits is None:
    logits, labels = make_case(rng, case)
  ct = make_cotangent(rng, labels, case.reduction)
  got = kernel_step(implementation, case.reduction, **case.static())(logits, labels, ct)
  check_case(got, case, logits, labels, ct, what=what)
  return got


# ---- forward and backward -------------------------------------------------------------------


@pytest.mark.parametrize("case", SAMPLED, ids=[c.id() for c in SAMPLED])
def test_loss_and_grad(case, implementation, rng):
  """Every reduction, and the gradient of case.reduction with a random cotangent."""
  run_case(case, implementation, rng)


@pytest.mark.parametrize("ignore_index,label_smoothing,softcap", [
    (None, 0.0, 30.0), (2, 0.2, None), (None, 0.2, 0.5), (2, 0.2, 30.0)], ids=str)
def test_option_combinations(ignore_index, label_smoothing, softcap, implementation, rng):
  """The options pairwise and all together (the sampled cases rotate them too)."""
  run_case(Case(jnp.bfloat16, (5, 7), 113, ignore_index, label_smoothing, softcap), implementation,
           rng)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_softcap_both_tanh_branches(dtype, implementation, rng):
  """Logits spanning |x / c| from 0 to 40: tanh's small-argument and saturated regimes
  (the CUDA kernel switches formulas at |x / c| = 0.625)."""
  cap = 3.0
  x = np.concatenate([np.linspace(-0.01, 0.01, 41), np.linspace(-120, 120, 400),
                      rng.uniform(-2.5, 2.5, 200)]).astype(np.float32)
  logits = jnp.asarray(np.stack([x, x[::-1], rng.permutation(x)])).astype(dtype)
  labels = jnp.asarray([5, 300, 620], jnp.int32)
  case = Case(dtype, (3,), x.size, softcap=cap, label_smoothing=0.1, reduction="none")
  run_case(case, implementation, rng, logits, labels)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_gemma_vocab_all_options(dtype, implementation, rng):
  """V = 262144 (a 512 KiB bf16 row) with every option at once, forward and backward."""
  case = Case(dtype, (3,), GEMMA_VOCAB, ignore_index=-100, label_smoothing=0.1, softcap=30.0)
  logits = make_logits(rng, case.shape, dtype, 30.0)
  labels = jnp.asarray([7, -100, GEMMA_VOCAB - 1], jnp.int32)
  _, dlogits = run_case(case, implementation, rng, logits, labels)
  assert not np.asarray(dlogits[1].astype(jnp.float32)).any()  # the ignored row


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_large_logits_are_stable(dtype, implementation, rng):
  """Logits far from 0 (the max is subtracted before exp): a shift of 1e4 changes nothing
  but the float rounding of the inputs."""
  big = 30000.0 if dtype == jnp.float16 else 1e4
  case = Case(dtype, (4,), 4097, reduction="sum")
  logits = make_logits(rng, case.shape, dtype) + jnp.asarray(big, dtype)
  run_case(case, implementation, rng, logits, make_labels(rng, case.lead, case.vocab))


# ---- ignore_index and out-of-range labels ---------------------------------------------------


@pytest.mark.parametrize("ignore_index", [-100, 0, 58])
def test_ignore_index(ignore_index, implementation, rng):
  """Ignored positions: loss 0, gradient 0, not counted by the mean. ignore_index may be a
  class id in [0, V) too (that class is then never learned)."""
  case = Case(jnp.float32, (6, 5), 59, ignore_index=ignore_index, label_smoothing=0.1)
  logits, labels = make_case(rng, case)
  labels = labels.at[0, 0].set(ignore_index)
  losses, dlogits = run_case(case, implementation, rng, logits, labels)
  ignored = np.asarray(labels) == ignore_index
  assert (np.asarray(losses["none"])[ignored] == 0).all()
  assert not np.asarray(dlogits)[ignored].any()


def test_all_ignored(implementation, rng):
  """Every position ignored: 'mean' is 0 (a count of 0 is taken as 1), never NaN; the
  gradients are all zeros."""
  logits = make_logits(rng, (4, 3, 50), jnp.bfloat16)
  labels = jnp.full((4, 3), -1, jnp.int32)
  fn = ce_fn(implementation, ignore_index=-1)
  out = jax.jit(lambda x, l: ({r: fn(x, l, r) for r in REDUCTIONS},
                              [jax.grad(lambda x: jnp.sum(fn(x, l, r)))(x) for r in REDUCTIONS]))
  losses, grads = out(logits, labels)
  for r in REDUCTIONS:
    np.testing.assert_array_equal(np.asarray(losses[r]), np.zeros(losses[r].shape, np.float32))
  for g in grads:
    assert g.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), 0.0)


@pytest.mark.parametrize("ignore_index", [None, -100])
def test_traced_out_of_range_labels(ignore_index, implementation, rng):
  """Labels that cannot be checked at trace time: an out-of-range position has a NaN loss
  (so 'mean' and 'sum' are NaN) and a zero gradient; the others are unaffected."""
  vocab = 50
  case = Case(jnp.float32, (8,), vocab, ignore_index=ignore_index, reduction="none")
  logits, labels = make_case(rng, case)
  labels = labels.at[1].set(-1).at[4].set(vocab).at[6].set(2**31 - 1).at[7].set(-2**31)
  bad = np.zeros(8, bool)
  bad[[1, 4, 6, 7]] = True
  ct = np.ones(8, np.float32)
  losses, dlogits = kernel_step(implementation, "none", **case.static())(logits, labels, ct)
  none = np.asarray(losses["none"])
  assert np.isnan(none[bad]).all() and np.isnan(losses["mean"]) and np.isnan(losses["sum"])
  good = ~bad
  lowp_losses, lowp_dlogits = lowp_ref(logits, labels, jnp.asarray(ct), "none", **case.static())
  loss64, *_ = np_losses(logits, labels, **case.static())
  oracle.check(none[good], loss64[good], np.asarray(lowp_losses["none"])[good],
               what="good rows", dtype=jnp.float32)
  d = np.asarray(dlogits)
  assert not d[bad].any()
  exact = np_dlogits(logits, labels, ct, **case.static())
  oracle.check(d[good], exact[good], np.asarray(lowp_dlogits)[good], what="good rows dlogits",
               dtype=jnp.float32, atol_ulps=GRAD_ATOL_ULPS)


@pytest.mark.parametrize("make", [
    pytest.param(lambda l: np.asarray(l), id="numpy"),
    pytest.param(lambda l: jnp.asarray(l), id="jax"),
])
@pytest.mark.parametrize("value", [-1, 7], ids=str)
def test_concrete_out_of_range_labels_raise(make, value, implementation):
  labels = np.array([[0, 3], [value, 6]], np.int32)
  with pytest.raises(ValueError, match=r"labels must be in \[0, 7\).*index \(1, 0\)"):
    jaxgpu.cross_entropy(jnp.ones((2, 2, 7)), make(labels), implementation=implementation)
  # ignore_index admits its own value, and only it.
  if value == -1:
    jaxgpu.cross_entropy(jnp.ones((2, 2, 7)), make(labels), ignore_index=-1,
                         implementation=implementation)
  else:
    with pytest.raises(ValueError, match="ignore_index"):
      jaxgpu.cross_entropy(jnp.ones((2, 2, 7)), make(labels), ignore_index=-1,
                           implementation=implementation)


# ---- properties -----------------------------------------------------------------------------


def test_deterministic(implementation, rng):
  """Bitwise identical losses and gradients across runs and separate compilations."""
  case = Case(jnp.bfloat16, (9,), 50257, ignore_index=-100, label_smoothing=0.1)
  logits, labels = make_case(rng, case)
  fn = ce_fn(implementation, **case.static())
  make = lambda: jax.jit(lambda x, l: (fn(x, l, "none"), fn(x, l), jax.grad(fn)(x, l)))
  first = make()
  runs = [first(logits, labels), first(logits, labels), make()(logits, labels)]
  for r in runs[1:]:
    for a, b in zip(runs[0], r):
      np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                    np.asarray(b.astype(jnp.float32)))


def test_no_logits_sized_temporaries(implementation, rng):
  """Forward+backward allocates no logits-sized temporary (XLA's memory analysis of the
  compiled step): the kernels keep one float32 per position; the reference (XLA's
  fusion) materializes float32 logits-sized buffers, shown for contrast."""
  logits = make_logits(rng, (64, 4097), jnp.bfloat16)
  labels = make_labels(rng, (64,), 4097, -100)
  step = jax.jit(jax.value_and_grad(lambda x, l: jaxgpu.cross_entropy(
      x, l, ignore_index=-100, label_smoothing=0.1, logit_softcap=30.0,
      implementation=implementation)))
  mem = step.lower(logits, labels).compile().memory_analysis()
  if mem is None:
    pytest.skip("no memory analysis on this backend")
  if implementation != "xla":
    assert mem.temp_size_in_bytes < logits.nbytes // 8, mem.temp_size_in_bytes


def test_forward_mode_unsupported(implementation, rng):
  """custom_vjp has no forward mode: jax.jvp raises (documented in the docstring)."""
  x = make_logits(rng, (3, 59), jnp.float32)
  labels = make_labels(rng, (3,), 59)
  f = lambda x: jaxgpu.cross_entropy(x, labels, implementation=implementation)
  if implementation == "xla":
    jax.jvp(f, (x,), (x,))  # the reference is plain JAX
    return
  with pytest.raises(TypeError):
    jax.jvp(f, (x,), (x,))


def test_eager(implementation, rng):
  """Outside jit (numpy labels of another integer dtype are converted)."""
  case = Case(jnp.float16, (3, 5), 111, ignore_index=-100, label_smoothing=0.1, softcap=5.0)
  logits = make_logits(rng, case.shape, case.dtype, 5.0)
  labels = np.asarray(make_labels(rng, case.lead, case.vocab, -100)).astype(np.int64)
  fn = ce_fn(implementation, **case.static())
  got = ({"mean": fn(logits, labels)}, jax.grad(fn)(logits, labels))
  check_case(got, case, logits, labels, np.float32(1.0), reductions=("mean",), what="eager ")


def test_numpy_inputs(implementation, rng):
  x = np.asarray(rng.standard_normal((4, 59)), np.float32)
  labels = rng.integers(0, 59, 4).astype(np.int32)
  got = jaxgpu.cross_entropy(x, labels, reduction="none", implementation=implementation)
  check_case(({"none": got}, None), Case(jnp.float32, (4,), 59, reduction="none"), x, labels,
             np.ones(4, np.float32), reductions=("none",))


def test_rank1_logits(implementation, rng):
  """logits (V,) with a scalar label: one position."""
  case = Case(jnp.float32, (), 59, label_smoothing=0.1, reduction="none")
  run_case(case, implementation, rng, make_logits(rng, (59,), jnp.float32),
           jnp.asarray(17, jnp.int32))


# ---- implementation selection ---------------------------------------------------------------


def _custom_call_targets(lowered) -> set[str]:
  return set(re.findall(r'custom_call_target="([^"]+)"', lowered.compile().as_text()))


def test_explicit_implementation_lowers_to_its_target(implementation, rng):
  x = make_logits(rng, (5, 3), jnp.float32)
  labels = make_labels(rng, (5,), 3)
  f = lambda x: jaxgpu.cross_entropy(x, labels, implementation=implementation)
  targets = _custom_call_targets(jax.jit(f).lower(x))
  grad_targets = _custom_call_targets(jax.jit(jax.grad(f)).lower(x))
  if implementation == "xla":
    assert not any(t.startswith("jaxgpu_") for t in targets | grad_targets), targets
  else:
    assert f"jaxgpu_cross_entropy_fwd_{implementation}" in targets, targets
    assert f"jaxgpu_cross_entropy_bwd_{implementation}" in grad_targets, grad_targets


@pytest.mark.parametrize("platform", [pytest.param("cuda", marks=pytest.mark.gpu), "cpu"])
def test_default_implementation_runs_platform_kernel(platform, rng):
  device = jax.devices("cpu")[0] if platform == "cpu" else jax.devices()[0]
  x = jax.device_put(make_logits(rng, (17, 59), jnp.bfloat16), device)
  labels = jax.device_put(make_labels(rng, (17,), 59), device)
  f = jax.jit(lambda x, l: jaxgpu.cross_entropy(x, l, reduction="none"))
  assert "jaxgpu_cross_entropy_fwd" in _custom_call_targets(f.lower(x, labels))
  explicit = jax.jit(lambda x, l: jaxgpu.cross_entropy(x, l, reduction="none",
                                                       implementation=platform))(x, labels)
  np.testing.assert_array_equal(np.asarray(f(x, labels)), np.asarray(explicit))


def test_env_var_forces_implementation(monkeypatch, rng):
  x = make_logits(rng, (4, 59), jnp.float32)
  labels = make_labels(rng, (4,), 59)
  monkeypatch.setenv("JAXGPU_IMPLEMENTATION", "xla")
  targets = _custom_call_targets(jax.jit(lambda x: jaxgpu.cross_entropy(x, labels)).lower(x))
  assert not any(t.startswith("jaxgpu_") for t in targets), targets


# ---- vmap ----------------------------------------------------------------------------------

B = 3


def _vmap_inputs(rng, logits_axis, labels_axis, dtype=jnp.float32, lead=(4, 5), vocab=59,
                 ignore_index=-100):
  """logits (lead..., V) and labels (lead...) with a batch axis of size B inserted where
  the in_axes say (None: shared by the batch)."""
  lshape = list(lead + (vocab,))
  if logits_axis is not None:
    lshape.insert(logits_axis % (len(lshape) + 1), B)
  tshape = list(lead)
  if labels_axis is not None:
    tshape.insert(labels_axis % (len(tshape) + 1), B)
  logits = make_logits(rng, tuple(lshape), dtype)
  labels = make_labels(rng, tuple(tshape), vocab, ignore_index)
  return logits, labels


VMAP_AXES = [
    ("both0", 0, 0, jnp.float32),
    ("logits-2-labels-1", -2, -1, jnp.bfloat16),
    ("logits-only", 1, None, jnp.float16),
    ("labels-only", None, 0, jnp.bfloat16),
]
VMAP_STATIC = dict(ignore_index=-100, label_smoothing=0.1, logit_softcap=20.0)


def _kernel_ce(implementation):
  return lambda x, l, reduction="mean", **kw: jaxgpu.cross_entropy(
      x, l, reduction=reduction, implementation=implementation, **kw)


@pytest.mark.parametrize("name,lax,tax,dtype", VMAP_AXES, ids=[v[0] for v in VMAP_AXES])
def test_vmap(name, lax, tax, dtype, implementation, rng):
  """vmap of every reduction (a per-example mean), and vmap of grad (per-example
  gradients), with logits, labels or both batched."""
  logits, labels = _vmap_inputs(rng, lax, tax, dtype)

  def forward(ce, x, l):
    per = lambda x, l: tuple(ce(x, l, reduction=r, **VMAP_STATIC) for r in REDUCTIONS)
    grad = jax.grad(lambda x, l: ce(x, l, **VMAP_STATIC))
    return jax.vmap(per, in_axes=(lax, tax))(x, l), jax.vmap(grad, in_axes=(lax, tax))(x, l)

  got = jax.jit(lambda x, l: forward(_kernel_ce(implementation), x, l))(logits, labels)
  exact, lowp = expected(forward, logits, labels)
  oracle.check_tree(got[0], exact[0], lowp[0], f"vmap {name}", jnp.float32)
  oracle.check_tree(got[1], exact[1], lowp[1], f"vmap(grad) {name}", dtype, atol_ulps=GRAD_ATOL_ULPS)


def test_grad_of_vmap_and_nested_vmap(implementation, rng):
  logits, labels = _vmap_inputs(rng, 0, 0, jnp.bfloat16, lead=(2, 5))  # (B, 2, 5, V)

  def loss(ce, x, l):
    inner = jax.vmap(lambda x, l: ce(x, l, **VMAP_STATIC), in_axes=(1, 1))  # over the 5
    return jnp.sum(jax.vmap(inner)(x, l) * jnp.arange(1.0, B + 1)[:, None])

  both = lambda ce, x, l: (loss(ce, x, l), jax.grad(lambda x: loss(ce, x, l))(x))
  got = jax.jit(lambda x, l: both(_kernel_ce(implementation), x, l))(logits, labels)
  exact, lowp = expected(both, logits, labels)
  oracle.check_tree(got[0], exact[0], lowp[0], "vmap(vmap) loss", jnp.float32)
  oracle.check_tree(got[1], exact[1], lowp[1], "grad(vmap(vmap))", jnp.bfloat16,
             atol_ulps=GRAD_ATOL_ULPS)


# ---- sharding on 8 fake CPU devices -----------------------------------------------------------


def scalar_all_reduces_only(hlo: str) -> bool:
  """Every all-reduce in the HLO reduces scalars (f32[] / s32[], or a tuple of them)."""
  found = False
  for line in hlo.splitlines():
    if "=" not in line:
      continue
    lhs_type = line.split("=", 1)[1].strip()
    m = re.match(r"(.*?)\s(all-reduce|all-reduce-start)\(", lhs_type)
    if not m:
      continue
    found = True
    dims = re.findall(r"\[([^\]]*)\]", m.group(1))
    if any(d.strip() for d in dims):
      return False
  return found


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_sharded_rows(reduction, axis_type, host_implementation, cpu_devices, rng):
  """Leading dims sharded over a (4, 2) mesh, forward and gradient in one program.
  'none': no collective at all, the losses keep the sharding. 'mean': only all-reduces
  of scalars (the sum and the count). dlogits keeps the logits' sharding. ('sum' is
  'mean' without the count: test_shard_map runs it.)"""
  mesh = oracle.mesh_4x2(cpu_devices, axis_type)
  static = dict(ignore_index=-100, label_smoothing=0.1, logit_softcap=30.0)
  logits = make_logits(rng, (8, 6, 59), jnp.bfloat16)
  labels = make_labels(rng, (8, 6), 59, -100)
  step = lambda ce, x, l: (ce(x, l, reduction=reduction, **static),
                           jax.grad(lambda x: jnp.sum(ce(x, l, reduction=reduction, **static)))(x))

  def run():
    x = jax.device_put(logits, NamedSharding(mesh, P("a", "b", None)))
    l = jax.device_put(labels, NamedSharding(mesh, P("a", "b")))
    compiled = jax.jit(lambda x, l: step(_kernel_ce(host_implementation), x, l)).lower(
        x, l).compile()
    return compiled(x, l), compiled.as_text()

  (loss, dlogits), hlo = oracle.run_on_mesh(mesh, axis_type, run)
  if reduction == "none":
    assert oracle.collectives(hlo) == set(), oracle.collectives(hlo)
    assert oracle.spec_of(loss) == ("a", "b"), loss.sharding
  else:
    assert oracle.collectives(hlo) == {"all-reduce"}, oracle.collectives(hlo)
    assert scalar_all_reduces_only(hlo), "a non-scalar all-reduce"
  assert oracle.spec_of(dlogits) == ("a", "b", None), dlogits.sharding
  if axis_type == "explicit":
    assert jax.typeof(dlogits).sharding.spec == P("a", "b", None)
  exact, lowp = expected(step, logits, labels)
  oracle.check_tree(loss, exact[0], lowp[0], "sharded loss", jnp.float32)
  oracle.check_tree(dlogits, exact[1], lowp[1], "sharded dlogits", jnp.bfloat16,
             atol_ulps=GRAD_ATOL_ULPS)


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_sharded_vocab(axis_type, host_implementation, cpu_devices, rng):
  """The vocabulary axis sharded: correct (the kernels gather whole rows first)."""
  mesh = oracle.mesh_4x2(cpu_devices, axis_type)
  static = dict(label_smoothing=0.1)
  logits = make_logits(rng, (8, 118), jnp.float32)
  labels = make_labels(rng, (8,), 118)
  kernel = lambda x, l: jaxgpu.cross_entropy(x, l, implementation=host_implementation, **static)

  def run():
    x = jax.device_put(logits, NamedSharding(mesh, P("a", "b")))
    l = jax.device_put(labels, NamedSharding(mesh, P("a")))
    f = jax.jit(lambda x, l: (kernel(x, l), jax.grad(kernel)(x, l)))
    return f(x, l), f.lower(x, l).compile().as_text()

  (loss, dlogits), hlo = oracle.run_on_mesh(mesh, axis_type, run)
  if host_implementation != "xla":
    assert oracle.collectives(hlo) - {"all-reduce"}, "expected a gather of the vocabulary"
  exact, lowp = expected(lambda ce, x, l: (ce(x, l, **static), jax.grad(
      lambda x: ce(x, l, **static))(x)), logits, labels)
  oracle.check_tree(loss, exact[0], lowp[0], "V-sharded loss", jnp.float32)
  oracle.check_tree(dlogits, exact[1], lowp[1], "V-sharded dlogits", jnp.float32,
             atol_ulps=GRAD_ATOL_ULPS)


def test_shard_map(host_implementation, cpu_devices, rng):
  """Inside shard_map (positions split 8 ways): per-shard losses, a psum'd global sum,
  the grad inside and the grad of the shard_map."""
  mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(AxisType.Auto,) * 2, devices=cpu_devices)
  static = dict(ignore_index=-100, label_smoothing=0.1, logit_softcap=30.0)
  logits = make_logits(rng, (16, 111), jnp.bfloat16)
  labels = make_labels(rng, (16,), 111, -100)
  rows = P(("a", "b"))
  kernel = lambda x, l, r: jaxgpu.cross_entropy(x, l, reduction=r,
                                                implementation=host_implementation, **static)

  def body(x, l):
    per = kernel(x, l, "none")
    total = jax.lax.psum(kernel(x, l, "sum"), ("a", "b"))
    dx = jax.grad(lambda x: kernel(x, l, "sum"))(x)
    return per, total, dx

  per, total, dx = jax.jit(shard_map(body, mesh=mesh, in_specs=(rows, rows),
                                     out_specs=(rows, P(), rows)))(logits, labels)
  ref = lambda ce, x, l: (ce(x, l, reduction="none", **static), ce(x, l, reduction="sum", **static),
                          jax.grad(lambda x: ce(x, l, reduction="sum", **static))(x))
  exact, lowp = expected(ref, logits, labels)
  oracle.check_tree((per, total), exact[:2], lowp[:2], "shard_map losses", jnp.float32)
  oracle.check_tree(dx, exact[2], lowp[2], "grad inside shard_map", jnp.bfloat16,
             atol_ulps=GRAD_ATOL_ULPS)

  sm_sum = lambda x, l: shard_map(lambda x, l: jax.lax.psum(kernel(x, l, "sum"), ("a", "b")),
                                  mesh=mesh, in_specs=(rows, rows), out_specs=P())(x, l)
  g = jax.jit(jax.grad(sm_sum))(logits, labels)
  oracle.check_tree(g, exact[2], lowp[2], "grad of shard_map", jnp.bfloat16, atol_ulps=GRAD_ATOL_ULPS)


def test_pmap(host_implementation, cpu_devices, rng):
  """pmap over 4 CPU devices: per-device means and gradients."""
  static = dict(ignore_index=-100, label_smoothing=0.1)
  logits = make_logits(rng, (4, 3, 59), jnp.float32)
  labels = make_labels(rng, (4, 3), 59, -100)
  f = lambda ce: (lambda x, l: (ce(x, l, **static), jax.grad(lambda x: ce(x, l, **static))(x)))
  kernel = lambda x, l, **kw: jaxgpu.cross_entropy(x, l, implementation=host_implementation, **kw)
  got = jax.pmap(f(kernel), devices=cpu_devices[:4])(logits, labels)
  exact, lowp = expected(lambda ce, x, l: jax.vmap(f(ce))(x, l), logits, labels)
  oracle.check_tree(got[0], exact[0], lowp[0], "pmap loss", jnp.float32)
  oracle.check_tree(got[1], exact[1], lowp[1], "pmap dlogits", jnp.float32, atol_ulps=GRAD_ATOL_ULPS)


# ---- bad input ------------------------------------------------------------------------------

X = lambda: jnp.ones((2, 3, 7), jnp.float32)
L = lambda: jnp.zeros((2, 3), jnp.int32)

BAD_INPUTS = [
    ("logits-int", lambda: dict(logits=jnp.ones((2, 7), jnp.int32), labels=jnp.zeros(2, jnp.int32)),
     TypeError, r"logits.*dtype"),
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
]


@pytest.mark.parametrize("build,error,match", [b[1:] for b in BAD_INPUTS],
                         ids=[b[0] for b in BAD_INPUTS])
def test_bad_input(build, error, match):
  kw = build()
  with pytest.raises(error, match=match):
    jaxgpu.cross_entropy(**kw)
  # The same at trace time, under jit (arrays traced; the rest closed over).
  arrays = {k: v for k, v in kw.items() if isinstance(v, (jax.Array, np.ndarray))}
  rest = {k: v for k, v in kw.items() if k not in arrays}
  if arrays and all(np.dtype(a.dtype) != np.float64 for a in arrays.values()):
    with pytest.raises(error, match=match):
      jax.jit(lambda a: jaxgpu.cross_entropy(**a, **rest))(arrays)


def test_traced_options_rejected():
  with pytest.raises(TypeError, match="label_smoothing"):
    jax.jit(lambda x, l, s: jaxgpu.cross_entropy(x, l, label_smoothing=s))(X(), L(), 0.1)
  with pytest.raises(TypeError, match="logit_softcap"):
    jax.jit(lambda x, l, s: jaxgpu.cross_entropy(x, l, logit_softcap=s))(X(), L(), 30.0)


@pytest.mark.skipif(HAS_CUDA, reason="this machine has a CUDA backend")
def test_cuda_without_gpu():
  with pytest.raises(ValueError, match="implementation='cuda'"):
    jaxgpu.cross_entropy(X(), L(), implementation="cuda")


def _raw_call(implementation, pass_, results, *args, **attrs):
  from jaxgpu import _ffi
  base = dict(ignore_index=np.int32(0), has_ignore=False, label_smoothing=np.float32(0),
              softcap=np.float32(0))
  base.update(attrs)
  target = _ffi.target_name(f"jaxgpu_cross_entropy_{pass_}", implementation)
  return jax.jit(lambda *a: jax.ffi.ffi_call(target, results)(*a, **base))(*args)


F32 = jnp.float32
BAD_BUFFERS = [
    # (id, pass, results, args, attrs): each must fail with an error, never crash.
    ("labels-count", "fwd", (jax.ShapeDtypeStruct((4,), F32),) * 2,
     lambda: (jnp.ones((4, 7)), jnp.zeros((5,), jnp.int32)), {}),
    ("labels-dtype", "fwd", (jax.ShapeDtypeStruct((4,), F32),) * 2,
     lambda: (jnp.ones((4, 7)), jnp.zeros((4,), jnp.float32)), {}),
    ("loss-dtype", "fwd", (jax.ShapeDtypeStruct((4,), jnp.float16), jax.ShapeDtypeStruct((4,), F32)),
     lambda: (jnp.ones((4, 7)), jnp.zeros((4,), jnp.int32)), {}),
    ("lse-count", "fwd", (jax.ShapeDtypeStruct((4,), F32), jax.ShapeDtypeStruct((3,), F32)),
     lambda: (jnp.ones((4, 7)), jnp.zeros((4,), jnp.int32)), {}),
    ("logits-int", "fwd", (jax.ShapeDtypeStruct((4,), F32),) * 2,
     lambda: (jnp.ones((4, 7), jnp.int32), jnp.zeros((4,), jnp.int32)), {}),
    ("smoothing-attr", "fwd", (jax.ShapeDtypeStruct((4,), F32),) * 2,
     lambda: (jnp.ones((4, 7)), jnp.zeros((4,), jnp.int32)), {"label_smoothing": np.float32(1.5)}),
    ("softcap-attr", "fwd", (jax.ShapeDtypeStruct((4,), F32),) * 2,
     lambda: (jnp.ones((4, 7)), jnp.zeros((4,), jnp.int32)), {"softcap": np.float32(-1)}),
    ("dlogits-count", "bwd", (jax.ShapeDtypeStruct((4, 6), F32),),
     lambda: (jnp.ones((4, 7)), jnp.zeros((4,), jnp.int32), jnp.zeros(4), jnp.ones(4)), {}),
    ("dlogits-dtype", "bwd", (jax.ShapeDtypeStruct((4, 7), jnp.bfloat16),),
     lambda: (jnp.ones((4, 7)), jnp.zeros((4,), jnp.int32), jnp.zeros(4), jnp.ones(4)), {}),
    ("dloss-count", "bwd", (jax.ShapeDtypeStruct((4, 7), F32),),
     lambda: (jnp.ones((4, 7)), jnp.zeros((4,), jnp.int32), jnp.zeros(4), jnp.ones(3)), {}),
]


@pytest.mark.parametrize("name,pass_,results,args,attrs", BAD_BUFFERS,
                         ids=[b[0] for b in BAD_BUFFERS])
def test_handler_rejects_bad_buffers(name, pass_, results, args, attrs, implementation):
  """The FFI handlers check every buffer and attribute (the Python layer never sends
  these): an error comes back, the process survives."""
  if implementation == "xla":
    pytest.skip("no handler")
  with pytest.raises(Exception, match=r"INVALID_ARGUMENT|[Ii]nvalid argument"):
    jax.block_until_ready(_raw_call(implementation, pass_, results, *args(), **attrs))


# ---- size 0 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("lead", [(0,), (2, 0), (0, 3)], ids=str)
def test_size_zero(lead, implementation):
  logits = jnp.ones(lead + (7,), jnp.bfloat16)
  labels = jnp.zeros(lead, jnp.int32)
  fn = ce_fn(implementation, ignore_index=-100)
  out = jax.jit(lambda x, l: {r: fn(x, l, r) for r in REDUCTIONS})(logits, labels)
  assert out["none"].shape == lead and out["none"].dtype == jnp.float32
  assert float(out["mean"]) == 0.0 and float(out["sum"]) == 0.0
  g = jax.jit(jax.grad(fn))(logits, labels)
  assert g.shape == logits.shape and g.dtype == logits.dtype
