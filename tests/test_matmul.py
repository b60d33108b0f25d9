"""linear and quantized weights (jaxgpu/ops/matmul.py, jaxgpu/quantized.py, kernels in
ffi/matmul/): the numerics, run against every implementation (the `implementation`
fixture: 'cuda' on the GPU machine, 'cpu' here, and 'xla'). The transform contract (vmap,
sharding, shard_map, pmap, bad inputs, size 0, targets) is tests/test_contract.py's, from
tests/specs/matmul.py.

Error rule (tests/oracle.py): max error against float64 at most 2x that of a pure-JAX
reference computed in the same low precision, plus a small rounding atol.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgpu
from jaxgpu import _implementation
from jaxgpu.ops import matmul as matmul_op
from jaxgpu.reference import matmul as reference

import contract as C
import oracle
from specs.matmul import ACTIVATIONS, Case, make, unpack

DTYPES = oracle.DTYPES
# Odd sizes: K and N off every tile (16, 64) and vector width, a single row and column.
SHAPES = (((1,), 1, 1), ((3,), 3, 17), ((2, 5), 59, 113), ((17,), 111, 24), ((4,), 256, 40))


def _check(spec_case: Case, implementation, rng, grad=True):
  inputs = make(rng, spec_case)
  spec = _spec_for(spec_case)
  f = C.op_fn(spec, implementation, inputs.static)
  got = jax.jit(f)(inputs.arrays)
  exact, lowp = C.expected_outputs(spec, inputs.static, spec_case.dtype, inputs.arrays)
  out_atol, _ = C.atols(spec, inputs.static, [(inputs.arrays, None, got)])
  C.check_outputs(spec, got, exact, lowp, out_atol, spec_case.id())
  if not grad:
    return
  cots = C.make_cotangents(rng, C.output_avals(spec, inputs))
  grads, _ = jax.jit(C.grad_fn(spec, f))(inputs.arrays, cots)
  exact, lowp = C.expected_grads(spec, inputs.static, spec_case.dtype, inputs.arrays, cots)
  _, grad_atol = C.atols(spec, inputs.static, [(inputs.arrays, cots, got)])
  C.check_grads(spec, grads, exact, lowp, grad_atol, spec_case.id())


def _spec_for(case: Case):
  from specs import SPECS
  return SPECS["linear" if not case.bits else f"linear[int{case.bits}]"]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
def test_dense_matches_float64(dtype, activation, implementation, rng):
  """Every activation and dtype, with and without bias, on odd sizes: y and the gradients
  of x, w and bias."""
  for i, (lead, k, n) in enumerate(SHAPES):
    _check(Case(dtype, lead, k, n, bias=i % 2 == 0, activation=activation), implementation,
           rng)


@pytest.mark.parametrize("bits", (4, 8))
@pytest.mark.parametrize("symmetric", (False, True), ids=("asym", "sym"))
def test_quantized_matches_float64(bits, symmetric, implementation, rng):
  """The quantized product against the float64 product with the dequantized weight: every
  group size kind (16, 32, 64, 128, one per column), odd K and N, rows from 1 to past the
  dense crossover, every activation; gradients of x and bias."""
  cases = [((1,), 64, 24, 16), ((3,), 96, 17, 32), ((2, 7), 111, 40, None),
           ((17,), 256, 33, 64), ((64,), 128, 16, 128),
           ((matmul_op.DENSE_FROM_ROWS + 3,), 128, 24, 64)]
  for i, (lead, k, n, gs) in enumerate(cases):
    dtype = DTYPES[(i + bits) % 3]
    _check(Case(dtype, lead, k, n, bias=i % 2 == 1, activation=ACTIVATIONS[i % 5], bits=bits,
                group_size=gs, symmetric=symmetric), implementation, rng)


@pytest.mark.parametrize("bits", (4, 8))
def test_quantize_round_trip(bits, rng):
  """quantize_weight: every value within half a step of the weight (plus the scale's
  rounding), the packing a bijection, zeros in range; from_int rebuilds the same weight."""
  k, n = 192, 37
  w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
  for symmetric, gs in itertools.product((False, True), (32, 64, None)):
    qw = jaxgpu.quantize_weight(w, bits=bits, group_size=gs, symmetric=symmetric)
    g = gs or k
    wd = np.asarray(qw.dequantize())
    s = np.repeat(np.asarray(qw.scales), g, axis=0)
    # w / s is rounded in float32 (XLA may divide through a reciprocal), so a weight a hair
    # past a half step can land on the other side: past s / 2 by a few ulp of w (seed
    # 3075220875: w / s = 142.50002 gave q - z = 142, 0.5000155 s off).
    tol = 0.5 * s + 4 * np.finfo(np.float32).eps * np.abs(np.asarray(w)) + 1e-7
    assert np.all(np.abs(wd - np.asarray(w)) <= tol), (symmetric, gs)
    q = unpack(qw.packed, bits, k, n)
    assert int(q.min()) >= 0 and int(q.max()) < (1 << bits)
    assert np.array_equal(np.asarray(reference.unpack(qw.packed, bits, k, n)), np.asarray(q))
    assert np.array_equal(np.asarray(reference.pack(q, bits)), np.asarray(qw.packed))
    if not symmetric:
      assert qw.zeros.dtype == jnp.uint8 and int(qw.zeros.max()) < (1 << bits)
    again = jaxgpu.QuantizedWeight.from_int(q, qw.scales, qw.zeros, bits=bits, group_size=gs)
    assert np.array_equal(np.asarray(again.dequantize()), wd)
  # A GPTQ-style int4 checkpoint: asymmetric, group 128, values and zero points given.
  if bits == 4:
    q = jnp.asarray(rng.integers(0, 16, (256, 24)), jnp.int32)
    scales = jnp.asarray(rng.uniform(0.01, 0.1, (2, 24)), jnp.bfloat16)
    zeros = jnp.asarray(rng.integers(0, 16, (2, 24)), jnp.int32)
    qw = jaxgpu.QuantizedWeight.from_int(q, scales, zeros, bits=4, group_size=128)
    want = ((np.asarray(q) - np.repeat(np.asarray(zeros), 128, 0))
            * np.repeat(np.asarray(scales, np.float32), 128, 0)).astype(jnp.bfloat16)
    assert np.array_equal(np.asarray(qw.dequantize()), np.asarray(want))


@pytest.mark.parametrize("bits", (4, 8))
def test_dequantize_kernel_equals_the_reference(bits, implementation, rng):
  """The large-M route's dequantizing kernel, bitwise against QuantizedWeight.dequantize:
  N past one run of 8 tiles and not a multiple of 8 or 16 (the scalar edges), K not a
  multiple of 64, one group per column, symmetric and asymmetric."""
  cases = [(111, 40, None, False), (256, 200, 64, False), (64, 17, 32, True),
           (320, 136, 16, False), (128, 256, 128, True)]
  for i, (k, n, gs, symmetric) in enumerate(cases):
    dtype = DTYPES[(i + bits) % 3]
    w = jnp.asarray(rng.standard_normal((k, n)), dtype)  # scales in dtype, as the route has them
    qw = jaxgpu.quantize_weight(w, bits=bits, group_size=gs, symmetric=symmetric)
    cfg = matmul_op._Config(implementation, None, False,
                            quantized=(bits, qw.group_size, k, n))
    got = jax.jit(lambda qw: matmul_op._dequantized(cfg, qw, dtype))(qw)
    want = qw.dequantize(dtype)
    assert got.dtype == want.dtype and got.shape == (k, n), (k, n)
    assert np.array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32)), (k, n, gs)


def test_quantized_gradients_skip_the_weight(rng):
  """QLoRA-style: grad flows to x and bias; the quantized weight's leaves get zero
  cotangents (float0 for its integers)."""
  qw = jaxgpu.quantize_weight(jnp.asarray(rng.standard_normal((64, 24)), jnp.bfloat16), bits=4,
                              group_size=32)
  x = jnp.asarray(rng.standard_normal((3, 64)), jnp.bfloat16)
  f = lambda x, qw: jnp.sum(jaxgpu.linear(x, qw, activation="silu").astype(jnp.float32))
  gx, gq = jax.grad(f, argnums=(0, 1), allow_int=True)(x, qw)
  assert gx.shape == x.shape and float(jnp.max(jnp.abs(gx))) > 0
  assert gq.packed.dtype == jax.dtypes.float0
  assert float(jnp.max(jnp.abs(gq.scales))) == 0


def test_quantized_lowers_to_its_kernel_below_the_crossover(rng):
  """Few rows: one qlinear call and no dequantized weight; many rows: the dequantizing copy
kernel, then the dense GEMM, except on a Hopper GPU, whose wgmma kernel serves every M."""
  qw = jaxgpu.quantize_weight(jnp.asarray(rng.standard_normal((128, 32)), jnp.bfloat16))
  hopper = _implementation.runs_on_cuda(None) and _implementation.hopper_present()
  many = {"jaxgpu_qlinear_fwd"} if hopper else {"jaxgpu_qlinear_dequant", "jaxgpu_linear_fwd"}
  for rows, want in ((matmul_op.DENSE_FROM_ROWS - 1, {"jaxgpu_qlinear_fwd"}),
                     (matmul_op.DENSE_FROM_ROWS, many)):
    x = jnp.ones((rows, 128), jnp.bfloat16)
    targets = C.custom_call_targets(jax.jit(lambda x: jaxgpu.linear(x, qw)).lower(x))
    assert {t for t in targets if t.startswith("jaxgpu_")} == want, (rows, targets)


@pytest.mark.parametrize("build, error, match", [
    (lambda w: dict(w=w, bits=3), ValueError, "bits"),
    (lambda w: dict(w=w, bits="8"), TypeError, "bits"),
    (lambda w: dict(w=w, group_size=96), ValueError, "group_size"),
    (lambda w: dict(w=w, group_size=24), ValueError, "group_size"),
    (lambda w: dict(w=w[0]), ValueError, r"\bw\b.*rank"),
    (lambda w: dict(w=w.astype(jnp.int32)), TypeError, r"\bw\b.*dtype"),
    (lambda w: dict(w=w, symmetric=1), TypeError, "symmetric"),
    (lambda w: dict(w=w, scale_dtype=jnp.int8), TypeError, "scale_dtype"),
], ids=("bits-3", "bits-str", "group-not-dividing", "group-not-16", "w-rank", "w-int",
        "symmetric-int", "scale-int8"))
def test_quantize_bad_input(build, error, match):
  w = jnp.ones((256, 8), jnp.float32)
  with pytest.raises(error, match=match):
    jaxgpu.quantize_weight(**build(w))


def test_from_int_bad_input():
  with pytest.raises(ValueError, match="scales.*shape"):
    jaxgpu.QuantizedWeight.from_int(jnp.zeros((128, 8), jnp.int32), jnp.ones((2, 9)), bits=4,
                                    group_size=64)
  with pytest.raises(TypeError, match="q must be"):
    jaxgpu.QuantizedWeight.from_int(jnp.zeros((128, 8)), jnp.ones((2, 8)), bits=4,
                                    group_size=64)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (jnp.bfloat16, jnp.float16), ids=("bf16", "f16"))
def test_cuda_sizes(dtype, rng):
  """Transformer-like sizes on the GPU: the cuBLASLt epilogues (N a multiple of 8, the
  fused path) and the quantized kernel's split-K and M tiling, against float64."""
  for lead, k, n, act in (((256,), 1024, 512, "gelu"), ((3, 77), 512, 1000, "relu"),
                          ((64,), 2048, 768, None)):
    _check(Case(dtype, lead, k, n, activation=act), "cuda", rng)
  for bits, lead, k, n, gs in ((4, (1,), 4096, 1024, 128), (8, (16,), 4096, 512, None),
                               (4, (64,), 1024, 4096, 64), (8, (100,), 512, 333, 128)):
    _check(Case(dtype, lead, k, n, activation="silu", bits=bits, group_size=gs), "cuda", rng)


@pytest.mark.gpu
def test_cuda_matches_torch(rng):
  """An independent implementation: torch's linear + gelu(tanh) on the same GPU."""
  torch = pytest.importorskip("torch")
  x = rng.standard_normal((512, 768)).astype(np.float32)
  w = (rng.standard_normal((768, 1024)) / 28).astype(np.float32)
  b = rng.standard_normal((1024,)).astype(np.float32)
  got = jaxgpu.linear(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16),
                      jnp.asarray(b, jnp.bfloat16), activation="gelu", implementation="cuda")
  t = lambda a: torch.tensor(a, device="cuda").to(torch.bfloat16)
  want = torch.nn.functional.gelu(torch.nn.functional.linear(t(x), t(w).T, t(b)),
                                  approximate="tanh").float().cpu().numpy()
  err = np.abs(np.asarray(got, np.float32) - want)
  assert float(err.max()) <= 0.02 * float(np.abs(want).max()), float(err.max())
