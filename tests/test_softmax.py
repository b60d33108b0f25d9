"""softmax (jaxgpu/ops/softmax.py, kernels in ffi/softmax/): the numerics and semantics, run
against every implementation (the `implementation` fixture, conftest.py). The transform
contract (vmap, sharding, shard_map, pmap, bad inputs, size 0, targets) is
tests/test_contract.py's, from the spec in tests/specs/softmax.py, which also holds the
oracles: float64 numpy (forward) and jax.grad of a jnp softmax under a local x64 context
(gradients), written independently of jaxgpu.reference.
Error rule (tests/oracle.py): max error against float64 at most 2x that of a jnp softmax
computed in the same low precision (statistics in float32), plus a small rounding atol.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgpu

import oracle
from specs import SPECS
from specs.softmax import GRAD_ATOL_ULPS, Case, dx_atol, jnp_softmax, make_mask, make_x, np_keep
from specs.softmax import np_softmax

DTYPES = oracle.DTYPES

# ---- cases ---------------------------------------------------------------------------------

# S = 1, 3, 59, 4097 (odd: scalar kernels), 64/128/4096 (16-byte vectors), 65536 and beyond;
# T = 1, 17, with T != S both ways under the causal mask; masks of several broadcast shapes.
CASES = [
    Case((1,)),
    Case((3,), scale=-2.0),
    Case((17, 59)),
    Case((5, 4097), mask=(4097,)),
    Case((3, 64), scale=0.3),
    Case((17, 4096)),
    Case((2, 65536)),
    Case((2, 17, 40000), causal=True, mask=(40000,)),  # wide rows, mostly past the limit
    # Rows of several warps on CUDA: warps with nothing kept; whole rows dropped (a mask
    # broadcast along S).
    Case((3, 40, 1536), causal=True, mask=(3, 1, 1536)),
    Case((4, 17, 2048), scale=0.7, mask=(4, 17, 1)),
    Case((1, 70001), scale=0.5),
    Case((1, 1), causal=True),
    Case((17, 1), causal=True),
    Case((3, 17, 3), causal=True),                      # T > S: rows i >= S see every key
    Case((2, 17, 59), causal=True, scale=0.125),        # T < S
    Case((2, 17, 128), causal=True, mask=(2, 1, 128)),
    Case((2, 3, 17, 59), mask=(2, 1, 17, 59)),
    Case((2, 3, 17, 64), causal=True, scale=0.5, mask=(17, 64)),
    Case((2, 3, 1, 59), mask=(2, 1, 1, 59)),            # T = 1, a padding-style mask
    Case((4, 17, 59), mask=(4, 17, 1)),                 # whole rows kept or dropped
    Case((2, 3, 5, 64), mask=(1, 3, 1, 64)),            # alternating broadcast / full dims
    Case((3, 5, 8), mask=(), p_drop=1.0),               # a scalar False: every row dropped
    Case((6, 59), mask=(6, 59), p_drop=0.9),            # sparse: some rows fully masked
]
CASE_IDS = [c.id() for c in CASES]


def kernel_fn(implementation, case: Case):
  return lambda x, mask=None: jaxgpu.softmax(x, scale=case.scale, is_causal=case.causal,
                                             mask=mask, implementation=implementation)


def ref_fn(case: Case):
  return lambda x, mask=None: jnp_softmax(x, case.scale, case.causal, mask)


def loss(fn, x, mask, cot):
  """<fn(x), cot> in float32 (or wider): its gradient is one VJP with random cotangents."""
  y = fn(x, mask)
  acc = jnp.promote_types(y.dtype, jnp.float32)
  return jnp.sum(y.astype(acc) * cot.astype(acc))


def to64(a):
  return None if a is None else jnp.asarray(oracle.as_f64(a))


# The references, jitted once per case (static): the tests of every implementation share
# their compilations (x64 or not is part of jax's cache key).
@functools.partial(jax.jit, static_argnums=0)
def ref_forward(case: Case, x, mask):
  return ref_fn(case)(x, mask)


@functools.partial(jax.jit, static_argnums=0)
def ref_grad(case: Case, x, mask, cot):
  return jax.grad(lambda x: loss(ref_fn(case), x, mask, cot))(x)


def grad_expected(case: Case, x, mask, cot):
  """(float64 oracle, low-precision reference) gradients wrt x."""
  grad = functools.partial(ref_grad, case)
  lowp = grad(x, mask, cot)
  with oracle.x64():
    exact = oracle.as_f64(grad(to64(x), mask, to64(cot)))
  return exact, lowp


# ---- forward -------------------------------------------------------------------------------


def _rotated(offset):
  """Each case once, the dtype rotated so that every dtype meets every kind of case."""
  params = [(c, DTYPES[(i + offset) % len(DTYPES)]) for i, c in enumerate(CASES)]
  return pytest.mark.parametrize("case,dtype", params,
                                 ids=[f"{c.id()}-{jnp.dtype(d).name}" for c, d in params])


@_rotated(0)
def test_forward(case, dtype, implementation, rng):
  x = make_x(rng, case, dtype)
  mask = make_mask(rng, case)
  y = jax.jit(kernel_fn(implementation, case))(x, mask)
  assert y.shape == x.shape and y.dtype == x.dtype
  y64 = np_softmax(x, case.scale, case.causal, mask)
  lowp = ref_forward(case, x, mask)
  oracle.check(y, y64, lowp, what=case.id(), dtype=dtype)
  # Rows with nothing kept are exactly zero.
  empty = ~np_keep(x.shape, case.causal, mask).any(-1)
  assert not np.asarray(y.astype(jnp.float32))[empty].any()


@_rotated(1)
def test_grad(case, dtype, implementation, rng):
  x = make_x(rng, case, dtype)
  mask = make_mask(rng, case)
  cot = oracle.randn(rng, x.shape, dtype).astype(jnp.float32)
  g = jax.jit(jax.grad(lambda x, m, c: loss(kernel_fn(implementation, case), x, m, c)))(
      x, mask, cot)
  assert g.shape == x.shape and g.dtype == x.dtype
  exact, lowp = grad_expected(case, x, mask, cot)
  y64 = np_softmax(x, case.scale, case.causal, mask)
  oracle.check(g, exact, lowp, what=f"{case.id()} dx", dtype=dtype, atol_ulps=GRAD_ATOL_ULPS,
               extra_atol=dx_atol(case.scale, y64, cot, dtype))


def test_forward_eager(implementation, rng):
  """Outside jit too."""
  case = Case((2, 3, 17, 59), scale=0.5, causal=True, mask=(2, 1, 17, 59))
  x = make_x(rng, case, jnp.bfloat16)
  mask = make_mask(rng, case)
  y = kernel_fn(implementation, case)(x, mask)
  oracle.check(y, np_softmax(x, 0.5, True, mask), jnp_softmax(x, 0.5, True, mask),
               what="eager", dtype=jnp.bfloat16)


# ---- edge semantics ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_fully_masked_rows(dtype, implementation, rng):
  """Rows with nothing kept (by the mask, or with only -inf logits): zeros, zero gradient,
  no NaN anywhere; the other rows unaffected."""
  x = np.array(make_x(rng, Case((4, 6, 64)), jnp.float32))
  x[1, 2, :] = -np.inf               # every logit -inf, all kept
  x[3, 0, :5] = -np.inf              # some -inf logits: a normal row
  x = jnp.asarray(x).astype(dtype)
  mask = np.asarray(rng.random((4, 6, 64)) > 0.5)
  mask[0, :, :] = False               # a whole batch entry dropped
  mask[2, 4, :] = False
  mask[1, 2, :] = True
  fn = lambda x: jaxgpu.softmax(x, mask=jnp.asarray(mask), implementation=implementation)
  y = np.asarray(jax.jit(fn)(x).astype(jnp.float32))
  assert np.isfinite(y).all()
  for idx in ((0,), (2, 4), (1, 2)):
    assert not y[idx].any(), idx
  np.testing.assert_allclose(y[3].sum(-1), 1.0, rtol=4 * oracle.unit_roundoff(dtype) * 64)
  cot = oracle.randn(rng, x.shape, dtype).astype(jnp.float32)
  g = jax.jit(jax.grad(lambda x: jnp.sum(fn(x).astype(jnp.float32) * cot)))(x)
  g = np.asarray(g.astype(jnp.float32))
  assert np.isfinite(g).all()
  for idx in ((0,), (2, 4), (1, 2)):
    assert not g[idx].any(), idx
  assert not g[~mask].any()          # masked positions get no gradient


@pytest.mark.parametrize("cols", [8, 4096])  # on CUDA, rows of one thread and of 8 warps
def test_nan_and_inf_logits(cols, implementation):
  """A kept NaN or +inf logit makes its row NaN (as XLA's softmax); a masked one does not."""
  x = np.zeros((4, cols), np.float32)
  x[0, 3] = np.nan
  x[1, 5] = np.inf
  x[2, 1] = np.nan                   # masked below
  mask = np.ones((4, cols), bool)
  mask[2, 1] = False
  y = np.asarray(jaxgpu.softmax(jnp.asarray(x), mask=jnp.asarray(mask),
                                implementation=implementation))
  assert np.isnan(y[0]).all() and np.isnan(y[1]).all()
  np.testing.assert_allclose(y[2], np.where(mask[2], 1 / (cols - 1), 0), rtol=1e-6)
  np.testing.assert_allclose(y[3], 1 / cols, rtol=1e-6)


def test_matches_jax_nn_softmax(implementation, rng):
  """Where some key is kept, the semantics are jax.nn.softmax(x * scale, where=keep)."""
  x = oracle.randn(rng, (2, 4, 17, 59), jnp.float32, 2.0)
  mask = jnp.asarray(rng.random((2, 1, 17, 59)) > 0.2).at[..., 0].set(True)
  keep = mask & jnp.tril(jnp.ones((17, 59), bool))
  want = jax.nn.softmax(x * 0.7, where=keep)
  want = jnp.where(keep, want, 0.0)  # jax leaves masked entries unspecified in some versions
  got = jaxgpu.softmax(x, scale=0.7, is_causal=True, mask=mask, implementation=implementation)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=1e-7)


def test_mask_is_not_differentiable(implementation, rng):
  """The mask is boolean: jax.vjp gives it a float0 cotangent (and no kernel work)."""
  x = oracle.randn(rng, (3, 5), jnp.float32)
  mask = jnp.asarray(rng.random((5,)) > 0.3)
  y, vjp = jax.vjp(lambda x, m: jaxgpu.softmax(x, mask=m, implementation=implementation),
                   x, mask)
  dx, dmask = vjp(jnp.ones_like(y))
  assert dx.shape == x.shape
  assert dmask.shape == mask.shape and dmask.dtype == jax.dtypes.float0


def test_deterministic(implementation, rng):
  """Bitwise identical across runs and separate compilations, forward and backward."""
  case = Case((8, 3, 17, 4096), scale=0.5, causal=True, mask=(8, 1, 17, 4096))
  x = make_x(rng, case, jnp.bfloat16)
  mask = make_mask(rng, case)
  cot = oracle.randn(rng, x.shape, jnp.bfloat16).astype(jnp.float32)
  fn = kernel_fn(implementation, case)
  grad = lambda: jax.jit(jax.value_and_grad(lambda x: loss(fn, x, mask, cot)))
  outs = [grad()(x) for _ in range(3)]
  for v, g in outs[1:]:
    assert np.asarray(v) == np.asarray(outs[0][0])
    np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)),
                                  np.asarray(outs[0][1].astype(jnp.float32)))


# ---- the mask is read in place ------------------------------------------------------------------


def _hlo_shapes(hlo: str) -> set[str]:
  return set(re.findall(r"pred\[[0-9,]*\]", hlo))


@pytest.mark.parametrize("mask_shape", [(17, 64), (8, 1, 1, 64), (1, 4, 17, 1)], ids=str)
def test_mask_not_broadcast_in_memory(mask_shape, host_implementation, rng):
  """The compiled program never forms a bool array of x's full shape from a small mask."""
  if host_implementation == "xla":
    pytest.skip("the reference broadcasts the mask (XLA fuses it)")
  x = oracle.randn(rng, (8, 4, 17, 64), jnp.bfloat16)
  mask = jnp.asarray(rng.random(mask_shape) > 0.3)
  f = jax.jit(lambda x, m: jaxgpu.softmax(x, mask=m, is_causal=True,
                                          implementation=host_implementation))
  hlo = f.lower(x, mask).compile().as_text()
  assert "pred[8,4,17,64]" not in _hlo_shapes(hlo), _hlo_shapes(hlo)
  np.testing.assert_allclose(np.asarray(f(x, mask).astype(jnp.float32)),
                             np_softmax(x, None, True, mask), atol=8e-3)


# ---- the handlers' own checks (a last line of defence: an error, never a crash) -------------


def _raw_fwd(x, mask, out_shape, **attrs):
  a = dict(scale=np.float32(1.0), causal=False, has_mask=mask is not None,
           query_len=np.int64(1))
  a.update(attrs)
  return jax.ffi.ffi_call(SPECS["softmax"].op.target("fwd", "cpu"), out_shape)(
      x, jnp.zeros((0,), bool) if mask is None else mask, **a)


@pytest.mark.parametrize("build,match", [
    (lambda x: _raw_fwd(x, jnp.ones((2, 5), bool), jax.ShapeDtypeStruct(x.shape, x.dtype)),
     "mask: dim 0 must be 1 or 4"),
    (lambda x: _raw_fwd(x, jnp.ones((4, 5), jnp.int32), jax.ShapeDtypeStruct(x.shape, x.dtype)),
     "mask: expected bool"),
    (lambda x: _raw_fwd(x, jnp.ones((5,), bool), jax.ShapeDtypeStruct(x.shape, x.dtype)),
     "mask: expected the rank of x"),
    (lambda x: _raw_fwd(x, None, jax.ShapeDtypeStruct((4, 4), x.dtype)), "y: expected 20"),
    (lambda x: _raw_fwd(x, None, jax.ShapeDtypeStruct(x.shape, jnp.float16)),
     "y: unexpected element type"),
    (lambda x: _raw_fwd(x, None, jax.ShapeDtypeStruct(x.shape, x.dtype), causal=True,
                        query_len=np.int64(3)), "query_len"),
    (lambda x: _raw_fwd(x, None, jax.ShapeDtypeStruct(x.shape, x.dtype),
                        scale=np.float32(np.inf)), "scale: must be finite"),
    (lambda x: _raw_fwd(x.astype(jnp.int32), None, jax.ShapeDtypeStruct(x.shape, jnp.int32)),
     "x: dtype must be"),
], ids=["mask-dim", "mask-dtype", "mask-rank", "y-count", "y-dtype", "query_len", "scale",
        "x-dtype"])
def test_handler_rejects_bad_buffers(build, match):
  if "cpu" not in jaxgpu.available_implementations():
    pytest.skip("no CPU module")
  x = jax.device_put(jnp.ones((4, 5), jnp.float32), jax.devices("cpu")[0])
  with pytest.raises(Exception, match=match):
    jax.block_until_ready(jax.jit(build)(x))


# ---- static options and input forms --------------------------------------------------------


def test_traced_scale_rejected():
  with pytest.raises(TypeError, match="scale"):
    jax.jit(lambda x, s: jaxgpu.softmax(x, scale=s))(jnp.ones((2, 3)), 0.5)


def test_numpy_and_list_inputs(implementation, rng):
  """A Python list mask is accepted like an array (numpy arrays: test_contract.py)."""
  x = np.asarray(rng.standard_normal((3, 59)), np.float32)
  mask = (rng.random(59) > 0.5).tolist()
  y = jaxgpu.softmax(x, mask=mask, implementation=implementation)
  oracle.check(y, np_softmax(x, None, False, np.asarray(mask)),
               jnp_softmax(jnp.asarray(x), None, False, jnp.asarray(mask)),
               what="numpy inputs", dtype=jnp.float32)
