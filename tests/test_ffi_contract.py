"""The FFI handlers' own checks, called directly (jax.ffi.ffi_call, CPU handlers): a buffer of
an element type the kernels do not take (int8, uint8, int4, float8_e4m3fn, int32) is an error
naming the argument and the types accepted, never a run on reinterpreted bytes.

The Python API checks dtypes before any FFI call; these tests reach past it, to the handlers,
which are the last line of defence (ffi/common/ffi_checks.h, CheckDType).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgpu
from jaxgpu import _ffi

FLOATS = "float32, bfloat16 or float16"
BAD_DTYPES = [jnp.int8, jnp.uint8, jnp.int4, jnp.float8_e4m3fn, jnp.int32]


def _call(target, out_shapes, *args, **attrs):
  target = _ffi.target_name(target, "cpu")
  fn = jax.jit(lambda *a: jax.ffi.ffi_call(target, out_shapes)(*a, **attrs))
  cpu = jax.devices("cpu")[0]
  return jax.block_until_ready(fn(*[jax.device_put(a, cpu) for a in args]))


def _sds(shape, dtype):
  return jax.ShapeDtypeStruct(shape, dtype)


def _rms_norm_fwd(dt):
  x = jnp.ones((1, 4, 8), dt)
  empty = jnp.zeros((0,), dt)
  return _call("jaxgpu_rms_norm_fwd",
               (_sds(x.shape, dt), _sds((0,), dt), _sds((0,), jnp.float32),
                _sds((1, 4), jnp.float32)),
               x, empty, empty, empty, eps=np.float32(1e-6), weight_offset=np.float32(0.0),
               has_residual=False, has_weight=False, has_bias=False)


def _softmax_fwd(dt):
  x = jnp.ones((4, 8), dt)
  return _call("jaxgpu_softmax_fwd", _sds(x.shape, dt), x, jnp.zeros((0,), bool),
               scale=np.float32(1.0), causal=False, has_mask=False, query_len=np.int64(1))


def _softmax_bwd(dt):
  y = jnp.ones((4, 8), dt)
  return _call("jaxgpu_softmax_bwd", _sds(y.shape, dt), y, y, scale=np.float32(1.0),
               causal=False, query_len=np.int64(1))


def _rope_fwd(dt):
  x = jnp.ones((1, 2, 2, 8), dt)
  return _call("jaxgpu_rope_fwd", _sds(x.shape, dt), x, jnp.zeros((1, 2), jnp.int32),
               theta=np.float64(10000.0), rotary_dim=np.int32(8), interleaved=False)


def _cross_entropy_fwd(dt):
  logits = jnp.ones((4, 16), dt)
  stat = _sds((4,), jnp.float32)
  return _call("jaxgpu_cross_entropy_fwd", (stat, stat), logits, jnp.zeros((4,), jnp.int32),
               ignore_index=np.int32(0), has_ignore=False, label_smoothing=np.float32(0.0),
               softcap=np.float32(0.0))


def _relu_fwd(dt):
  x = jnp.ones((16,), dt)
  return _call("jaxgpu_relu_fwd", _sds(x.shape, dt), x)


def _swiglu_fwd(dt):
  gate = jnp.ones((16,), dt)
  return _call("jaxgpu_swiglu_fwd", _sds(gate.shape, dt), gate, gate)


# (call, the argument whose dtype the handler checks first)
CALLS = [
    (_rms_norm_fwd, "x"),
    (_softmax_fwd, "x"),
    (_softmax_bwd, "y"),
    (_rope_fwd, "x"),
    (_cross_entropy_fwd, "logits"),
    (_relu_fwd, "x"),
    (_swiglu_fwd, "gate"),
]


@pytest.fixture(autouse=True)
def _needs_cpu_module():
  if "cpu" not in jaxgpu.available_implementations():
    pytest.skip("no CPU module")


@pytest.mark.parametrize("dtype", BAD_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("call,arg", CALLS, ids=[c[0].__name__.lstrip("_") for c in CALLS])
def test_handler_rejects_non_float_dtypes(call, arg, dtype):
  name = jnp.dtype(dtype).name
  with pytest.raises(Exception, match=f"{arg}: dtype must be {FLOATS}, got {name}"):
    call(dtype)


@pytest.mark.parametrize("call,arg", CALLS, ids=[c[0].__name__.lstrip("_") for c in CALLS])
def test_handler_accepts_float32(call, arg):
  """The same calls run with float32: the error above is the dtype's, not the call's."""
  call(jnp.float32)
