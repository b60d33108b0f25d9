"""cross_entropy (jaxgpu/ops/cross_entropy.py, kernels in ffi/cross_entropy/): the numerics
and semantics, run against every implementation (the `implementation` fixture,
conftest.py). The transform contract (vmap, sharding, shard_map, pmap, bad inputs, size 0,
targets) is tests/test_contract.py's, from the spec in tests/specs/cross_entropy.py, which
also holds the oracles (float64 numpy, and the same formulas in jnp: float32 math for the
error budget, float64 under oracle.x64()). The loss is float32 whatever the logits dtype,
so its atol is in float32 ulps; dlogits is in the logits' dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxgpu

import oracle
from specs import SPECS
from specs.cross_entropy import (GRAD_ATOL_ULPS, REDUCTIONS, Case, dlogits_atol, jnp_ce,
                                 loss_atol, make_case, make_labels, make_logits, np_dlogits,
                                 np_losses, np_reduce, np_row_cotangent)

try:
  from jax import shard_map
except ImportError:  # older jax
  from jax.experimental.shard_map import shard_map  # type: ignore

DTYPES = oracle.DTYPES
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

def ce_fn(implementation, **static):
  return lambda logits, labels, reduction="mean": jaxgpu.cross_entropy(
      logits, labels, reduction=reduction, implementation=implementation, **static)


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


def test_eager(implementation, rng):
  """Outside jit (numpy labels of another integer dtype are converted)."""
  case = Case(jnp.float16, (3, 5), 111, ignore_index=-100, label_smoothing=0.1, softcap=5.0)
  logits = make_logits(rng, case.shape, case.dtype, 5.0)
  labels = np.asarray(make_labels(rng, case.lead, case.vocab, -100)).astype(np.int64)
  fn = ce_fn(implementation, **case.static())
  got = ({"mean": fn(logits, labels)}, jax.grad(fn)(logits, labels))
  check_case(got, case, logits, labels, np.float32(1.0), reductions=("mean",), what="eager ")


def test_rank1_logits(implementation, rng):
  """logits (V,) with a scalar label: one position."""
  case = Case(jnp.float32, (), 59, label_smoothing=0.1, reduction="none")
  run_case(case, implementation, rng, make_logits(rng, (59,), jnp.float32),
           jnp.asarray(17, jnp.int32))


# ---- static options; the handlers' own checks; shard_map sums ------------------------------------

def test_traced_options_rejected():
  x, labels = jnp.ones((2, 3, 7), jnp.float32), jnp.zeros((2, 3), jnp.int32)
  with pytest.raises(TypeError, match="label_smoothing"):
    jax.jit(lambda x, l, s: jaxgpu.cross_entropy(x, l, label_smoothing=s))(x, labels, 0.1)
  with pytest.raises(TypeError, match="logit_softcap"):
    jax.jit(lambda x, l, s: jaxgpu.cross_entropy(x, l, logit_softcap=s))(x, labels, 30.0)


def _raw_call(implementation, pass_, results, *args, **attrs):
  base = dict(ignore_index=np.int32(0), has_ignore=False, label_smoothing=np.float32(0),
              softcap=np.float32(0))
  base.update(attrs)
  target = SPECS["cross_entropy"].op.target(pass_, implementation)
  return jax.jit(lambda *a: jax.ffi.ffi_call(target, results)(*a, **base))(*args)


F32 = jnp.float32
BAD_BUFFERS = [
    # (id, pass, results, args, attrs): each must fail with an error, never crash.
    ("labels-count", "fwd", (jax.ShapeDtypeStruct((4,), F32),) * 2,
     lambda: (jnp.ones((4, 7)), jnp.zeros((5,), jnp.int32)), {}),
    ("labels-dtype", "fwd", (jax.ShapeDtypeStruct((4,), F32),) * 2,
     lambda: (jnp.ones((4, 7)), jnp.zeros((4,), jnp.float32)), {}),
    ("loss-dtype", "fwd",
     (jax.ShapeDtypeStruct((4,), jnp.float16), jax.ShapeDtypeStruct((4,), F32)),
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


def test_shard_map_global_sum(host_implementation, cpu_devices, rng):
  """Inside shard_map (positions split 8 ways): the per-shard 'sum' losses psum'd to the
  global sum, its gradient inside, and the gradient of that shard_map, against the oracle
  (per-shard losses and the contract's cases: test_contract.py)."""
  mesh = oracle.mesh_4x2(cpu_devices, "auto")
  static = dict(ignore_index=-100, label_smoothing=0.1, logit_softcap=30.0)
  logits = make_logits(rng, (16, 111), jnp.bfloat16)
  labels = make_labels(rng, (16,), 111, -100)
  rows = P(("a", "b"))
  kernel = lambda x, t: jaxgpu.cross_entropy(x, t, reduction="sum",
                                             implementation=host_implementation, **static)
  total = lambda x, t: jax.lax.psum(kernel(x, t), ("a", "b"))
  body = lambda x, t: (total(x, t), jax.grad(kernel)(x, t))
  got_total, dx = jax.jit(shard_map(body, mesh=mesh, in_specs=(rows, rows),
                                    out_specs=(P(), rows)))(logits, labels)
  g = jax.jit(jax.grad(shard_map(total, mesh=mesh, in_specs=(rows, rows), out_specs=P())))(
      logits, labels)
  ref = lambda x, t: jnp_ce(x, t, reduction="sum", **static)
  lowp = jax.jit(lambda x, t: (ref(x, t), jax.grad(ref)(x, t)))(logits, labels)
  with oracle.x64():
    x64 = jnp.asarray(oracle.as_f64(logits))
    exact = jax.jit(lambda x, t: (ref(x, t), jax.grad(ref)(x, t)))(x64, labels)
    exact = jax.tree.map(oracle.as_f64, exact)
  oracle.check(got_total, exact[0], lowp[0], what="psum of shard sums", dtype=jnp.float32,
               extra_atol=loss_atol(logits, labels, "sum", static))
  g_atol = dlogits_atol(logits, labels, np.ones(16), static)
  for what, got in (("grad inside shard_map", dx), ("grad of shard_map", g)):
    oracle.check(got, exact[1], lowp[1], what=what, dtype=jnp.bfloat16,
                 atol_ulps=GRAD_ATOL_ULPS, extra_atol=g_atol)
