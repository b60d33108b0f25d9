"""Activations (gelu, silu, relu, sigmoid) and gated units (swiglu, geglu), forward and
backward.

Kernels: ffi/activation/ (targets jaxgpu_<op>_{fwd,bwd}). Reference:
jaxgpu/reference/activation.py. Tests: tests/test_activation.py. Benchmarks:
benchmarks/bench_activation.py.

Which to use. The gated units are the ones for models: ``swiglu(gate, up)`` computes
``silu(gate) * up`` (Llama, Mistral, Qwen) and ``geglu(gate, up)`` computes
``gelu(gate) * up`` (Gemma) in one pass, and their backward pass computes dgate and dup in
one pass too. The standalone activations exist for completeness: XLA fuses a plain
elementwise op into its neighbours (the bias add before it, the product after it, the
matmul epilogue), so in a model a standalone ``jaxgpu.relu`` is at best as fast as XLA's
``jax.nn.relu`` and usually slower, since the custom call stops XLA fusing across it. Use
the fused forms (gated units, attention, norms) in models.

Semantics are jax.nn's: ``gelu(approximate=True)`` is the tanh form
0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), ``approximate=False`` the exact erf form
x Phi(x); relu's gradient at 0 is 0, as jax.nn.relu's. Math in float32 for every dtype,
results rounded once to the input dtype.

Transforms. Every op works under jit, grad, vmap, shard_map and pmap. Under jit with
sharded inputs every dimension may be sharded (the ops are elementwise): the forward and
backward passes run on each shard with no collective, outputs and gradients keeping the
input's sharding. gate and up are expected to be sharded alike; if not, up is resharded
like gate. Forward mode (jax.jvp) and second derivatives run the reference.

Memory. Forward: allocates its output only; the backward pass re-reads the inputs, which
the forward pass keeps alive instead of saving anything new (no residual is written).
Backward: allocates dx (unary) or dgate and dup (gated), computed together in one kernel
that reads gate, up and dy once. No float32 temporary of any size. (A gated backward
pass always computes both gradients, also when only one is wanted.)
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from jaxgpu import _autodiff, _checks, _implementation
from jaxgpu._family import Family, Op
from jaxgpu._kernel_op import Layout, grouped_call, match_primal_types, primal_types
from jaxgpu.reference import activation as reference

_OPS = {
    "relu": Op("relu", {"fwd": "jaxgpu_relu_fwd", "bwd": "jaxgpu_relu_bwd"}),
    "sigmoid": Op("sigmoid", {"fwd": "jaxgpu_sigmoid_fwd", "bwd": "jaxgpu_sigmoid_bwd"}),
    "silu": Op("silu", {"fwd": "jaxgpu_silu_fwd", "bwd": "jaxgpu_silu_bwd"}),
    "gelu": Op("gelu", {"fwd": "jaxgpu_gelu_fwd", "bwd": "jaxgpu_gelu_bwd"}),
    "swiglu": Op("swiglu", {"fwd": "jaxgpu_swiglu_fwd", "bwd": "jaxgpu_swiglu_bwd"}),
    "geglu": Op("geglu", {"fwd": "jaxgpu_geglu_fwd", "bwd": "jaxgpu_geglu_bwd"}),
}
FAMILY = Family("activation", tuple(_OPS.values()))

# Elementwise: a group axis and any number of other dims, none of them needing to be whole
# on one device (nothing replicated), so every dim keeps its sharding.
_ELEM = "g ..."


def _layout(n_in: int, n_out: int) -> Layout:
  return Layout(inputs=(_ELEM,) * n_in, outputs=(_ELEM,) * n_out, replicated=frozenset())


@dataclasses.dataclass(frozen=True)
class _Config:
  op: str                      # relu, sigmoid, silu, gelu, swiglu, geglu
  approximate: bool | None     # gelu and geglu only
  implementation: str | None   # 'cpu', 'cuda', or None (platform-generic)
  primal_types: tuple = ()     # of the differentiable inputs (see _kernel_op)

  def target(self, pass_: str) -> str:
    return _OPS[self.op].target(pass_, self.implementation)

  def attrs(self) -> dict:
    return {} if self.approximate is None else {"approximate": bool(self.approximate)}


def _call(cfg: _Config, pass_: str, n_out: int, *arrays):
  """The FFI kernel of one pass on grouped arrays (G, ...), all of one shape and dtype,
  under the shared vmap and sharding rules."""

  def local_fn(*xs):
    out = jax.ShapeDtypeStruct(xs[0].shape, xs[0].dtype)
    return tuple(jax.ffi.ffi_call(cfg.target(pass_), (out,) * n_out)(*xs, **cfg.attrs()))

  return grouped_call(local_fn, _layout(len(arrays), n_out), *arrays)


# ---- the differentiable ops -----------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _unary(cfg: _Config, x):
  return _call(cfg, "fwd", 1, x[None])[0][0]


def _unary_fwd(cfg: _Config, x):
  return _call(cfg, "fwd", 1, x[None])[0][0], x


def _unary_bwd(cfg: _Config, x, dy):
  (dx,) = _call(cfg, "bwd", 1, x[None], dy[None])
  return match_primal_types((dx[0],), cfg.primal_types)


_unary.defvjp(_unary_fwd, _unary_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gated(cfg: _Config, gate, up):
  return _call(cfg, "fwd", 1, gate[None], up[None])[0][0]


def _gated_fwd(cfg: _Config, gate, up):
  return _call(cfg, "fwd", 1, gate[None], up[None])[0][0], (gate, up)


def _gated_bwd(cfg: _Config, saved, dy):
  gate, up = saved
  dgate, dup = _call(cfg, "bwd", 2, gate[None], up[None], dy[None])
  return match_primal_types((dgate[0], dup[0]), cfg.primal_types)


_gated.defvjp(_gated_fwd, _gated_bwd)


# ---- public API ---------------------------------------------------------------------------


# The approximate= of the ops that have none (relu, sigmoid, silu, swiglu): no attribute.
_NO_ATTR = object()


def _unary_op(op: str, x, implementation, approximate=_NO_ATTR):
  x = _checks.float_array(op, "x", x)
  approximate = (None if approximate is _NO_ATTR
                 else _checks.static_bool(op, "approximate", approximate))
  impl = _autodiff.route(_implementation.resolve(implementation), x)
  if impl == "xla" or x.size == 0:
    fn = getattr(reference, op)
    return fn(x) if approximate is None else fn(x, approximate=approximate)
  return _unary(_Config(op, approximate, impl, primal_types(x)), x)


def _gated_op(op: str, gate, up, implementation, approximate=_NO_ATTR):
  gate = _checks.float_array(op, "gate", gate)
  up = _checks.float_array(op, "up", up)
  _checks.same_dtype(op, "up", up, "gate", gate)
  _checks.shape_is(op, "up", up, gate.shape, "the shape of gate")
  approximate = (None if approximate is _NO_ATTR
                 else _checks.static_bool(op, "approximate", approximate))
  impl = _autodiff.route(_implementation.resolve(implementation), gate, up)
  if impl == "xla" or gate.size == 0:
    fn = getattr(reference, op)
    return fn(gate, up) if approximate is None else fn(gate, up, approximate=approximate)
  return _gated(_Config(op, approximate, impl, primal_types(gate, up)), gate, up)


def gelu(x, *, approximate=True, implementation=None):
  """GELU, as jax.nn.gelu.

  Args:
    x: any shape (rank 0 too), float32, bfloat16 or float16.
    approximate: True (default, as jax.nn.gelu): the tanh form; False: the exact erf form.
    implementation: None (the FFI kernel of the platform the computation runs on),
      'cuda', 'cpu', or 'xla' (the pure-JAX reference).

  Returns:
    The shape and dtype of x.

  Equivalent pure JAX (math in float32)::

    jax.nn.gelu(x.astype(jnp.float32), approximate=approximate).astype(x.dtype)

  For models prefer geglu (gated) or an XLA-fused jax.nn.gelu: see the module docstring.
  """
  return _unary_op("gelu", x, implementation, approximate)


def silu(x, *, implementation=None):
  """SiLU (swish), as jax.nn.silu: ``x * sigmoid(x)``.

  Args:
    x: any shape, float32, bfloat16 or float16.
    implementation: None, 'cuda', 'cpu' or 'xla' (see gelu).

  Returns:
    The shape and dtype of x.

  Equivalent pure JAX: ``jax.nn.silu(x.astype(jnp.float32)).astype(x.dtype)``.
  For models prefer swiglu: see the module docstring.
  """
  return _unary_op("silu", x, implementation)


def relu(x, *, implementation=None):
  """ReLU, as jax.nn.relu: ``max(x, 0)``, NaN propagated, gradient 0 at 0.

  Args:
    x: any shape, float32, bfloat16 or float16.
    implementation: None, 'cuda', 'cpu' or 'xla' (see gelu).

  Returns:
    The shape and dtype of x.

  Equivalent pure JAX: ``jax.nn.relu(x)``. Exists for completeness: XLA fuses jax.nn.relu
  into its neighbours, which a custom call cannot match (see the module docstring).
  """
  return _unary_op("relu", x, implementation)


def sigmoid(x, *, implementation=None):
  """Logistic sigmoid, as jax.nn.sigmoid: ``1 / (1 + exp(-x))``.

  Args:
    x: any shape, float32, bfloat16 or float16.
    implementation: None, 'cuda', 'cpu' or 'xla' (see gelu).

  Returns:
    The shape and dtype of x.

  Equivalent pure JAX: ``jax.nn.sigmoid(x.astype(jnp.float32)).astype(x.dtype)``.
  """
  return _unary_op("sigmoid", x, implementation)


def swiglu(gate, up, *, implementation=None):
  """SwiGLU's gating: ``silu(gate) * up`` in one pass (Llama-style MLPs).

  Args:
    gate: any shape, float32, bfloat16 or float16 (the activation's input, x @ W_gate).
    up: the shape and dtype of gate (x @ W_up).
    implementation: None, 'cuda', 'cpu' or 'xla' (see gelu).

  Returns:
    The shape and dtype of gate.

  Equivalent pure JAX (math in float32)::

    (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(gate.dtype)

  The backward pass computes dgate and dup in one kernel (reads gate, up and the
  cotangent once, writes both gradients).
  """
  return _gated_op("swiglu", gate, up, implementation)


def geglu(gate, up, *, approximate=True, implementation=None):
  """GeGLU's gating: ``gelu(gate) * up`` in one pass (Gemma-style MLPs).

  Args:
    gate: any shape, float32, bfloat16 or float16.
    up: the shape and dtype of gate.
    approximate: True (default; Gemma's "gelu_pytorch_tanh"): the tanh form of gelu;
      False: the exact erf form.
    implementation: None, 'cuda', 'cpu' or 'xla' (see gelu).

  Returns:
    The shape and dtype of gate.

  Equivalent pure JAX (math in float32)::

    g = jax.nn.gelu(gate.astype(jnp.float32), approximate=approximate)
    (g * up.astype(jnp.float32)).astype(gate.dtype)

  The backward pass computes dgate and dup in one kernel.
  """
  return _gated_op("geglu", gate, up, implementation, approximate)
