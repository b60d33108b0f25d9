"""gelu, silu, relu, sigmoid, swiglu, geglu (jaxgpu/ops/activation.py, kernels in
ffi/activation/): the numerics and semantics, run against every implementation (the
`implementation` fixture, conftest.py). The transform contract (vmap, sharding, shard_map,
pmap, bad inputs, size 0, targets) is tests/test_contract.py's, from the specs in
tests/specs/activation.py, which also holds the oracles: closed-form float64 numpy formulas
for every activation AND its derivative; `test_oracle_derivatives` checks the derivative
formulas against jax.grad of jax.nn under x64. Error rule (tests/oracle.py): max error
against float64 at most 2x that of jax.nn computed in float32 and rounded to the op's dtype,
plus a small rounding atol; NaN never passes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxgpu
from jaxgpu import _family, _ffi

import oracle
from specs.activation import (BY_NAME, GRAD_ATOL_ULPS, JAX_ACT, UNARY, VARIANTS, Variant,
                              lowp_fn, make_arrays, np_act, np_forward, np_grads_atol)

DTYPES = oracle.DTYPES
SHAPES = ((1,), (3,), (59,), (4097,), (3, 5, 111))


def kernel_fn(v: Variant, implementation):
  """fn(*arrays) -> y: the op under test."""
  op = getattr(jaxgpu, v.op)
  return lambda *a: op(*a, implementation=implementation, **v.kwargs())


def make_cotangent(rng, shape, dtype):
  """Exactly representable in dtype; float32 (the loss is summed in float32)."""
  return oracle.randn(rng, shape, dtype).astype(jnp.float32)


def loss(fn, arrays, ct):
  return jnp.sum(fn(*arrays).astype(jnp.float32) * ct)


def grad_fn(fn, n_in):
  return jax.grad(lambda *a: loss(fn, a[:-1], a[-1]), argnums=tuple(range(n_in)))


def check_grads(got, exact, lowp, atols, what, dtype):
  for g, e, r, atol in zip(got, exact, lowp, atols):
    oracle.check(g, e, r, what=what, dtype=dtype, atol_ulps=GRAD_ATOL_ULPS, extra_atol=atol)


# ---- forward and backward, every variant x dtype x shape -------------------------------------

def _case(v, dtype, shape):
  return pytest.param(v, dtype, shape,
                      id=f"{v.name}-{jnp.dtype(dtype).name}-{'x'.join(map(str, shape))}")


def _sampled_cases(offset):
  """Every (variant, dtype) with two of the shapes, rotated so that every variant meets
  every shape, and every dtype every shape (48 cases; the full 120 with --run-slow)."""
  out = []
  for i, v in enumerate(VARIANTS):
    for j, d in enumerate(DTYPES):
      for k in range(2):
        out.append(_case(v, d, SHAPES[(2 * j + k + i + offset) % len(SHAPES)]))
  return out


CASES = _sampled_cases(0)
GRAD_CASES = _sampled_cases(1)     # the other shapes for the same (variant, dtype)
FULL_CASES = [_case(v, d, s) for v in VARIANTS for d in DTYPES for s in SHAPES]


def _check_forward(v: Variant, dtype, shape, implementation, rng, jit=True):
  arrays = make_arrays(rng, v, shape, dtype)
  fn = kernel_fn(v, implementation)
  y = (jax.jit(fn) if jit else fn)(*arrays)
  assert y.shape == shape and y.dtype == jnp.dtype(dtype)
  y_lowp = jax.jit(lowp_fn(v))(*arrays)
  oracle.check(y, np_forward(v, arrays), y_lowp, what=f"{v.name} y", dtype=dtype)


def _check_grads(v: Variant, dtype, shape, implementation, rng):
  arrays = make_arrays(rng, v, shape, dtype)
  ct = make_cotangent(rng, shape, dtype)
  got = jax.jit(grad_fn(kernel_fn(v, implementation), v.n_in))(*arrays, ct)
  lowp = jax.jit(grad_fn(lowp_fn(v), v.n_in))(*arrays, ct)
  exact, atols = np_grads_atol(v, arrays, ct)
  names = ("dgate", "dup") if v.gated else ("dx",)
  for name, g, e, r, a, atol in zip(names, got, exact, lowp, arrays, atols):
    assert g.shape == a.shape and g.dtype == a.dtype, name
    oracle.check(g, e, r, what=f"{v.name} {name}", dtype=dtype, atol_ulps=GRAD_ATOL_ULPS,
                 extra_atol=atol)


@pytest.mark.parametrize("v,dtype,shape", CASES)
def test_forward(v, dtype, shape, implementation, rng):
  _check_forward(v, dtype, shape, implementation, rng)


@pytest.mark.parametrize("v,dtype,shape", GRAD_CASES)
def test_grad(v, dtype, shape, implementation, rng):
  _check_grads(v, dtype, shape, implementation, rng)


@pytest.mark.slow
@pytest.mark.parametrize("v,dtype,shape", FULL_CASES)
def test_full_matrix(v, dtype, shape, implementation, rng):
  """Every variant x dtype x shape, forward and backward (--run-slow)."""
  _check_forward(v, dtype, shape, implementation, rng)
  _check_grads(v, dtype, shape, implementation, rng)


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.name)
def test_eager(v, implementation, rng):
  """Outside jit too."""
  _check_forward(v, jnp.bfloat16, (3, 5, 111), implementation, rng, jit=False)


@pytest.mark.parametrize("v", [BY_NAME["swiglu"], BY_NAME["geglu_tanh"]], ids=lambda v: v.name)
def test_large(v, implementation, rng):
  """More elements than one wave of CUDA threads covers (the grid-stride loop runs 2-4
  times on an H100) and a size that is no multiple of the vector width: 5 * 2^20 + 7."""
  if implementation != "cuda":
    pytest.skip("the grid-stride structure is the CUDA kernels'")
  _check_forward(v, jnp.bfloat16, (5 * 2 ** 20 + 7,), implementation, rng)
  _check_grads(v, jnp.bfloat16, (5 * 2 ** 20 + 7,), implementation, rng)


@pytest.mark.parametrize("v", UNARY, ids=lambda v: v.name)
def test_scalar_input(v, implementation, rng):
  """A rank-0 x is an elementwise op's input too."""
  x = oracle.randn(rng, (), jnp.float32, 2.0)
  y = kernel_fn(v, implementation)(x)
  assert y.shape == ()
  oracle.check(y, np_forward(v, (x,)), lowp_fn(v)(x), what="scalar y")
  ct = jnp.float32(1.0)
  g = jax.grad(kernel_fn(v, implementation))(x)
  exact, atols = np_grads_atol(v, (x,), ct)
  check_grads((g,), exact, (jax.grad(lowp_fn(v))(x),), atols, "scalar dx", jnp.float32)


def test_oracle_derivatives():
  """The closed-form float64 derivatives above agree with jax.grad of jax.nn under x64."""
  x = np.concatenate([np.linspace(-12, 12, 601), [0.0, -0.0, 1e-3, -1e-3, 30.0, -30.0]])
  with oracle.x64():
    xs = jnp.asarray(x)
    for act, fn in JAX_ACT.items():
      f, d = np_act(act, x)
      # atol: jax's tanh form cancels in 1 + tanh(u) (float64 rounding, ~1e-16 * |x|).
      np.testing.assert_allclose(np.asarray(fn(xs)), f, rtol=1e-12, atol=1e-14, err_msg=act)
      g = np.asarray(jax.vmap(jax.grad(fn))(xs))
      np.testing.assert_allclose(g, d, rtol=1e-10, atol=1e-13, err_msg=act)


# ---- semantics at special values -----------------------------------------------------------

SPECIAL = np.array([0.0, -0.0, 1e-30, -1e-30, 1e-3, -1e-3, 1.0, -1.0, 5.0, -5.0, 10.0, -10.0,
                    20.0, -20.0, 30.0, -30.0, 88.0, -88.0, 100.0, -100.0, 1e4, -1e4, 1e19,
                    -1e19, 1e30, -1e30], np.float32)


@pytest.mark.parametrize("v", UNARY, ids=lambda v: v.name)
def test_special_values(v, implementation):
  """Saturated tails stay finite and right (no 0 * inf, no overflow of x^3), forward and
  backward, against float64; NaN and +-inf inputs as jax.nn gives them."""
  fn = kernel_fn(v, implementation)
  if implementation != "xla":
    # (The 'xla' implementation is jax.nn itself, whose float32 tanh form of gelu is off by
    # up to ~1.5e-6 near x = -5 (1 + tanh(u) rounds to 0) and whose gradient is NaN past
    # |x| ~ 1e19 (0 * inf); the kernels avoid both, see GeluTanh in activation_math.h.)
    x = jnp.asarray(SPECIAL)
    y = np.asarray(jax.jit(fn)(x), np.float64)
    dx = np.asarray(jax.jit(jax.vmap(jax.grad(fn)))(x), np.float64)
    f, d = np_act(v.act, SPECIAL)
    assert np.isfinite(y).all() and np.isfinite(dx).all(), (y, dx)
    np.testing.assert_allclose(y, f, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dx, d, rtol=1e-5, atol=1e-6)
  # Non-finite inputs: the output jax.nn gives (NaN propagated, tails at +-inf).
  nonfinite = jnp.asarray([np.nan, np.inf, -np.inf], jnp.float32)
  got = np.asarray(jax.jit(fn)(nonfinite))
  want = np.asarray(JAX_ACT[v.act](nonfinite))
  np.testing.assert_array_equal(got, want)


def test_relu_grad_at_zero(implementation):
  """jax.nn.relu's gradient at 0 is 0 (and at NaN, 0: a select, as jax's)."""
  x = jnp.asarray([0.0, -0.0, 1.0, -1.0, np.nan], jnp.float32)
  g = jax.jit(jax.vmap(jax.grad(lambda x: jaxgpu.relu(x, implementation=implementation))))(x)
  np.testing.assert_array_equal(np.asarray(g), [0.0, 0.0, 1.0, 0.0, 0.0])
  np.testing.assert_array_equal(np.asarray(g), np.asarray(jax.vmap(jax.grad(jax.nn.relu))(x)))


def test_gelu_forms_differ(implementation):
  """approximate reaches the kernel: the two forms differ by ~1e-4 at x = 1."""
  x = jnp.ones((4,), jnp.float32)
  t = jaxgpu.gelu(x, approximate=True, implementation=implementation)
  e = jaxgpu.gelu(x, approximate=False, implementation=implementation)
  np.testing.assert_allclose(np.asarray(t), 0.8411920, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(e), 0.8413447, rtol=1e-6)
  g = jaxgpu.geglu(x, x, approximate=False, implementation=implementation)
  np.testing.assert_allclose(np.asarray(g), 0.8413447, rtol=1e-6)


# ---- sharding on 8 fake CPU devices (the layouts every op keeps: test_contract.py) --------


def _vjp_fn(fn, n_in):
  """(arrays..., ct) -> gradients, through jax.vjp."""
  def f(*a):
    _, pull = jax.vjp(fn, *a[:n_in])
    return pull(a[n_in])
  return f


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_sharded_gate_up_differ(axis_type, host_implementation, cpu_devices, rng):
  """gate and up sharded differently: still right (up is resharded like gate). With
  Explicit axes jax's own elementwise product refuses that, so the 'xla' implementation
  raises jax's ShardingTypeError; the kernels reshard."""
  v = BY_NAME["geglu_tanh"]
  mesh = oracle.mesh_4x2(cpu_devices, axis_type)
  arrays = make_arrays(rng, v, (8, 6), jnp.float32)
  ct = oracle.randn(rng, (8, 6), jnp.float32)
  specs = (P("a", "b"), P("b", None))
  fn = kernel_fn(v, host_implementation)

  def run():
    a = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(arrays, specs)]
    c = jax.device_put(ct, NamedSharding(mesh, specs[0]))
    return jax.jit(fn)(*a), jax.jit(_vjp_fn(fn, 2))(*a, c)

  if axis_type == "explicit" and host_implementation == "xla":
    with pytest.raises(Exception, match="sharding"):
      oracle.run_on_mesh(mesh, axis_type, run)
    return
  y, grads = oracle.run_on_mesh(mesh, axis_type, run)
  oracle.check(y, np_forward(v, arrays), jax.jit(lowp_fn(v))(*arrays), what="y",
               dtype=jnp.float32)
  lowp = jax.jit(_vjp_fn(lowp_fn(v), 2))(*arrays, ct)
  exact, atols = np_grads_atol(v, arrays, ct)
  check_grads(grads, exact, lowp, atols, "grad", jnp.float32)


# ---- static options; the handlers' own checks ------------------------------------------------

def test_traced_approximate_rejected():
  with pytest.raises(TypeError, match="approximate"):
    jax.jit(lambda x, a: jaxgpu.gelu(x, approximate=a))(jnp.ones((2, 3)), True)


def _raw_call(target, outs, *args, **attrs):
  """The FFI target called directly, bypassing the Python checks."""
  _ffi.registered_targets()
  return jax.jit(lambda *a: jax.ffi.ffi_call(target, outs)(*a, **attrs))(*args)


RAW_BAD = [
    # (id, (op, pass), outputs, inputs, attrs, message pattern)
    ("up-count", ("swiglu", "fwd"), [((4, 5), jnp.float32)], [((4, 5), jnp.float32),
                                                         ((4, 6), jnp.float32)], {}, "up"),
    ("up-shape", ("swiglu", "fwd"), [((4, 5), jnp.float32)], [((4, 5), jnp.float32),
                                                         ((5, 4), jnp.float32)], {}, "up"),
    ("up-dtype", ("geglu", "fwd"), [((4, 5), jnp.float32)], [((4, 5), jnp.float32),
                                                        ((4, 5), jnp.float16)],
     {"approximate": True}, "up"),
    ("y-dtype", ("relu", "fwd"), [((4, 5), jnp.bfloat16)], [((4, 5), jnp.float32)], {}, r"\by\b"),
    ("y-count", ("sigmoid", "fwd"), [((4, 6), jnp.float32)], [((4, 5), jnp.float32)], {}, r"\by\b"),
    ("x-int32", ("silu", "fwd"), [((4, 5), jnp.int32)], [((4, 5), jnp.int32)], {}, "dtype"),
    ("dy-count", ("gelu", "bwd"), [((4, 5), jnp.float32)], [((4, 5), jnp.float32),
                                                       ((4, 4), jnp.float32)],
     {"approximate": False}, "dy"),
    ("dup-count", ("swiglu", "bwd"), [((4, 5), jnp.float32), ((4, 4), jnp.float32)],
     [((4, 5), jnp.float32)] * 3, {}, "dup"),
]


@pytest.mark.parametrize("op_pass,outs,ins,attrs,match", [b[1:] for b in RAW_BAD],
                         ids=[b[0] for b in RAW_BAD])
def test_handler_rejects_bad_buffers(op_pass, outs, ins, attrs, match, implementation):
  """The handlers check every buffer (dtype, shape, element count) and return an error
  naming it: the last line of defence behind the Python checks, never a crash."""
  if implementation == "xla":
    pytest.skip("no handler")
  out_types = tuple(jax.ShapeDtypeStruct(s, d) for s, d in outs)
  args = [jnp.ones(s, d) for s, d in ins]
  with pytest.raises(Exception, match=match) as info:
    target = _family.all_ops()[op_pass[0]][1].target(op_pass[1], implementation)
    jax.block_until_ready(_raw_call(target, out_types, *args, **attrs))
  assert "INVALID_ARGUMENT" in str(info.value) or "InvalidArgument" in str(info.value)


# ---- accepted input forms -------------------------------------------------------------------


def test_python_list_inputs(implementation):
  """A Python list is an array of the default float dtype (float32); numpy arrays are
  test_contract.py's test_numpy_inputs."""
  np.testing.assert_allclose(np.asarray(jaxgpu.relu([1.0, -2.0, 3.0],
                                                    implementation=implementation)),
                             [1.0, 0.0, 3.0])
