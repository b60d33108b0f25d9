"""Linear layers: a dense linear with its epilogue fused into the GEMM (cuBLASLt), and a
weight-only quantized linear (int8 / int4 weights) for generation.

Kernels: ffi/matmul/ (targets jaxgpu_linear_{fwd,dgrad,wgrad}, jaxgpu_qlinear_fwd).
Reference: jaxgpu/reference/matmul.py. Tests: tests/test_matmul.py. Benchmarks:
benchmarks/bench_matmul.py.

Dense. ``linear(x, w, bias, activation=...)`` is ``act(x @ w + bias)`` with float32
accumulation. On CUDA the forward pass is one cuBLASLt call whose epilogue adds the bias
and applies relu or the tanh gelu (and writes the pre-activation the gelu's backward pass
needs, GELU_AUX); the backward pass is the activation's derivative (one elementwise XLA
fusion; relu reads its mask from y) and two cuBLASLt calls: dx = dz w^T, and dw = x^T dz
with the bias gradient fused in (BGRADA). cuBLASLt has no exact-gelu or silu epilogue:
those run the GEMM with its bias epilogue and the activation as an XLA fusion (also the
tanh gelu when N is not a multiple of 8, which GELU_AUX needs, and in float32, where
cuBLASLt's gelu is less accurate than float32 rounding). Float32 inputs are
multiplied in full float32 (cuBLASLt's 32F compute, not TF32).

Quantized. ``linear(x, qw)`` with a `QuantizedWeight` (`quantize_weight`, or
`QuantizedWeight.from_int` for weights quantized elsewhere) runs jaxgpu's weight-only
kernels: the packed weight is read from memory once, widened and scaled in registers, and
multiplied on tensor cores. On a Hopper GPU (compute capability 9.0) they serve every M:
from 9 rows a wgmma kernel whose blocks share each widened weight tile among up to 256
tokens (`_wgmma_serves`). Elsewhere (and for shapes that kernel does not take), from
`DENSE_FROM_ROWS` rows the weight is dequantized (a copy kernel, jaxgpu_qlinear_dequant)
for the dense cuBLASLt path. Gradients flow to x and bias, never to the frozen quantized
weight (QLoRA-style fine-tuning). A float32 x on CUDA takes the dense path.

Transforms. jit, grad, vmap (over x, over the weight: batched GEMMs), shard_map, pmap. Under
jit with sharded inputs: rows of x shard with no collective; a weight sharded along N
(column parallel) keeps y sharded along N with no collective; a weight sharded along K
(row parallel, x sharded along K too) gives partial products that are all-reduced once,
then the bias and activation are applied. The backward pass has the matching collectives:
dw's all-reduce over sharded rows, dx's over a sharded N. A quantized weight shards the same
way along whole tiles (N in multiples of 16, K in multiples of 64 and of the group size).

Memory. Forward: y, plus cuBLASLt's 32 MiB workspace on CUDA (temporary); under grad the
gelu's pre-activation z (the size of y). Backward: dz (the size of y; none without an
activation), dx, dw. No float32 temporary of any size. Quantized: y and a float32 split-K
workspace of at most 16 MiB.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpu import _autodiff, _checks, _implementation
from jaxgpu._family import Family, Op
from jax.sharding import PartitionSpec

from jaxgpu._kernel_op import (Layout, PartialBody, explicit_spec, grouped_call,
                               in_explicit_mode, match_primal_types, primal_types)
from jaxgpu.quantized import QuantizedWeight
from jaxgpu.reference import matmul as reference

LINEAR = Op("linear", {"fwd": "jaxgpu_linear_fwd", "dgrad": "jaxgpu_linear_dgrad",
                       "wgrad": "jaxgpu_linear_wgrad", "fwd_q": "jaxgpu_qlinear_fwd",
                       "dequant": "jaxgpu_qlinear_dequant"})
FAMILY = Family("matmul", (LINEAR,))

ACTIVATIONS = reference.ACTIVATIONS
# cuBLASLt epilogue codes (ffi/matmul/linear_params.h LinearEpilogue) and the quantized
# kernel's activation codes (qlinear_params.h QActivation).
_EPILOGUE = {None: 0, "relu": 1, "gelu": 2}
_Q_ACTIVATION = {None: 0, "relu": 1, "gelu": 2, "gelu_exact": 3, "silu": 4}
# cuBLASLt's workspace: 32 MiB is what cuBLAS itself reserves on Hopper for its fastest
# split-K and stream-K kernels.
_CUBLASLT_WORKSPACE = 32 << 20
# Split-K partial sums of the quantized kernel: at most 2^22 floats (16 MiB).
_Q_WORKSPACE_FLOATS = 1 << 22
# Rows of x from which a quantized linear dequantizes the weight and runs the dense GEMM
# where the Hopper kernel does not serve. Measured on the H100 (8192 x 28672,
# tools/qlinear_crossover.py, docs/perf/matmul.md): the mma.sync kernel takes 238 / 496 /
# 761 us at M = 64 / 128 / 192 (int4; it grows about linearly past 64: a re-dequantization
# per 64-row chunk), the dequantize + cuBLASLt route 688 / 693 / 705 us (the dequantizing
# copy is ~520 us of it); int8 alike (634 against 720 at 128, 998 against 737 at 192): they
# cross between 128 and 192. The Hopper kernel beats the dense route at every M measured
# (int4 8192 x 28672: 198 us at M = 256, 2.86 ms at M = 4096, against ~0.7 and ~3.2 ms).
DENSE_FROM_ROWS = 192

_X = "g ... k"       # (G, ...rows, K)
_W = "[g] k n"       # (G or 1, K, N)
_BIAS = "[g] n"      # (G or 1, N)
_Y = "g ... n"       # (G, ...rows, N)


@dataclasses.dataclass(frozen=True)
class _Config:
  implementation: str | None   # 'cpu', 'cuda', or None (platform-generic)
  activation: str | None
  has_bias: bool
  primal_types: tuple = (None,) * 3
  quantized: tuple | None = None  # (bits, group_size, K, N) of a QuantizedWeight

  def weight(self, packed, scales, zeros) -> QuantizedWeight:
    return QuantizedWeight(packed, scales, zeros, *self.quantized)

  def target(self, pass_: str) -> str:
    return LINEAR.target(pass_, self.implementation)

  @property
  def on_cuda(self) -> bool:
    return _implementation.runs_on_cuda(self.implementation)


def _empty(dtype):
  return jnp.zeros((0,), dtype)


def _rows(a):
  """(G, ...rows, D) -> (G, R, D)."""
  return a.reshape(a.shape[0], -1, a.shape[-1])


def _workspace(cfg: _Config):
  return jax.ShapeDtypeStruct((_CUBLASLT_WORKSPACE if cfg.on_cuda else 0,), jnp.uint8)


def _finish(z, bias, activation, dtype):
  """act(z + bias), in float32, rounded once to dtype (bias (G|1, N) broadcast over rows)."""
  zf = z.astype(jnp.float32)
  if bias is not None:
    zf = zf + bias.reshape((bias.shape[0],) + (1,) * (z.ndim - 2) + (bias.shape[-1],)).astype(
        jnp.float32)
  return reference.activate(zf, activation).astype(dtype)


# ---- inner ops: FFI calls under the shared vmap / sharding rules ---------------------------


def _fwd_call(cfg: _Config, x, w, bias, epilogue: str | None, want_aux: bool):
  """Grouped arrays in; (y,) or (y, aux = z) out: y = epilogue(x w + bias)."""
  has_bias = bias is not None
  inputs = [x, w] + ([bias] if has_bias else [])
  layout = Layout(inputs=(_X, _W) + (_BIAS,) * has_bias, outputs=(_Y,) * (1 + want_aux),
                  replicated=frozenset())

  def call(x, w, bias, code, aux):
    rows = _rows(x)
    out = jax.ShapeDtypeStruct(rows.shape[:-1] + (w.shape[-1],), x.dtype)
    y, z, _ = jax.ffi.ffi_call(
        cfg.target("fwd"),
        (out, out if aux else jax.ShapeDtypeStruct((0,), x.dtype), _workspace(cfg)),
    )(rows, w, bias if bias is not None else _empty(x.dtype),
      epilogue=np.int32(_EPILOGUE[code]), has_bias=bias is not None, want_aux=aux)
    shape = x.shape[:-1] + (w.shape[-1],)
    return (y.reshape(shape),) + ((z.reshape(shape),) if aux else ())

  def local_fn(x, w, *rest):
    return call(x, w, rest[0] if has_bias else None, epilogue, want_aux)

  def partial_fn(x, w, *rest):
    z = call(x, w, None, None, False)[0]
    return (z,) * (1 + want_aux)

  def finish_fn(outs, x, w, *rest):
    b = rest[0] if has_bias else None
    return (_finish(outs[0], b, epilogue, x.dtype),) + (
        (_finish(outs[0], b, None, x.dtype),) if want_aux else ())

  partial = PartialBody(partial_fn, finish_fn) if (has_bias or epilogue) else None
  return grouped_call(local_fn, layout, *inputs, partial=partial)


def _dgrad_call(cfg: _Config, dz, w):
  """dx = dz w^T (grouped)."""
  layout = Layout(inputs=(_Y, _W), outputs=(_X,), replicated=frozenset())

  def local_fn(dz, w):
    rows = _rows(dz)
    dx, _ = jax.ffi.ffi_call(
        cfg.target("dgrad"),
        (jax.ShapeDtypeStruct(rows.shape[:-1] + (w.shape[-2],), dz.dtype), _workspace(cfg)),
    )(rows, w)
    return (dx.reshape(dz.shape[:-1] + (w.shape[-2],)),)

  return grouped_call(local_fn, layout, dz, w)[0]


def _wgrad_call(cfg: _Config, x, dz, want_dbias: bool):
  """(dw (G, K, N), dbias (G, N) | None): x^T dz and dz's row sums, per group."""
  layout = Layout(inputs=(_X, _Y), outputs=("g k n",) + ("g n",) * want_dbias,
                  replicated=frozenset(), sources={1: (1,)} if want_dbias else {})

  def local_fn(x, dz):
    xr, dzr = _rows(x), _rows(dz)
    g, k, n = xr.shape[0], xr.shape[-1], dzr.shape[-1]
    dw, db, _ = jax.ffi.ffi_call(
        cfg.target("wgrad"),
        (jax.ShapeDtypeStruct((g, k, n), x.dtype),
         jax.ShapeDtypeStruct((g, n) if want_dbias else (0,), x.dtype), _workspace(cfg)),
    )(xr, dzr, want_dbias=want_dbias)
    return (dw,) + ((db,) if want_dbias else ())

  outs = grouped_call(local_fn, layout, x, dz)
  return outs[0], (outs[1] if want_dbias else None)


# ---- the dense differentiable op -------------------------------------------------------------


def _fused(cfg: _Config, n: int, dtype) -> bool:
  """Whether cuBLASLt's epilogue applies the activation (else an XLA fusion after it).
  cuBLASLt's gelu is a fast approximation of the tanh form, good to the last bit of a
  16-bit result but measured 4e-6 off in float32 (5x the rounding of float32): float32
  takes the XLA fusion."""
  return cfg.activation in (None, "relu") or (
      cfg.activation == "gelu" and n % 8 == 0 and jnp.dtype(dtype) != jnp.float32)


def _forward(cfg: _Config, x, w, bias, for_grad: bool):
  """(y, saved): saved is what the activation's derivative reads (None, y or z)."""
  xg, wg, bg = x[None], w[None], None if bias is None else bias[None]
  act = cfg.activation
  if _fused(cfg, w.shape[-1], x.dtype):
    want_aux = for_grad and act == "gelu"
    outs = _fwd_call(cfg, xg, wg, bg, act, want_aux)
    y = outs[0][0]
    saved = None if act is None else (y if act == "relu" else (outs[1][0] if want_aux else None))
    return y, saved
  z = _fwd_call(cfg, xg, wg, bg, None, False)[0][0]
  return _finish(z[None], None, act, x.dtype)[0], z


def _activation_grad(activation, dy, saved):
  """dz = dy * act'(z) in float32, rounded to dy's dtype (relu: y > 0 selects)."""
  if activation is None:
    return dy
  if activation == "relu":
    return jnp.where(saved > 0, dy, jnp.zeros_like(dy))
  zf = saved.astype(jnp.float32)
  _, vjp = jax.vjp(lambda t: reference.activate(t, activation), zf)
  return vjp(dy.astype(jnp.float32))[0].astype(dy.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _linear(cfg: _Config, x, w, bias):
  return _forward(cfg, x, w, bias, for_grad=False)[0]


def _linear_fwd(cfg: _Config, x, w, bias):
  y, saved = _forward(cfg, x, w, bias, for_grad=True)
  return y, (x, w, saved)


def _linear_bwd(cfg: _Config, res, dy):
  x, w, saved = res
  dz = _activation_grad(cfg.activation, dy, saved)
  dx = _dgrad_call(cfg, dz[None], w[None])[0]
  dw, db = _wgrad_call(cfg, x[None], dz[None], cfg.has_bias)
  dw = dw[0]
  db = None if db is None else db[0]
  return match_primal_types((dx, dw, db), cfg.primal_types)


_linear.defvjp(_linear_fwd, _linear_bwd)


# ---- quantized weights ------------------------------------------------------------------------


def _q_blocked(qw: QuantizedWeight) -> tuple[frozenset, frozenset]:
  """(blocked, replicated) factors of the quantized layout: K and N shard along whole
  tiles; a dim with padding in its tiles cannot be split consistently and is gathered."""
  blocked, replicated = {"k", "n"}, {"w"}
  if qw.in_features % reference.TILE_K:
    blocked.discard("k")
    replicated.add("k")
  if qw.out_features % reference.TILE_N:
    blocked.discard("n")
    replicated.add("n")
  return frozenset(blocked), frozenset(replicated)


def _q_workspace(cfg: _Config, groups: int, rows: int, n: int):
  floats = min(_Q_WORKSPACE_FLOATS, 32 * groups * rows * n) if cfg.on_cuda else 0
  return jax.ShapeDtypeStruct((floats,), jnp.float32)


def _qfwd_call(cfg: _Config, x, packed, scales, zeros, bias, activation):
  """Grouped arrays in; y = act(x dequantize(w) + bias) out."""
  qw = cfg.weight(None, None, None)
  has_zeros, has_bias = zeros is not None, bias is not None
  inputs = [x, packed, scales] + [a for a in (zeros, bias) if a is not None]
  blocked, replicated = _q_blocked(qw)
  layout = Layout(inputs=(_X, "[g] k n w", "[g] k n") + ("[g] k n",) * has_zeros
                  + (_BIAS,) * has_bias, outputs=(_Y,), replicated=replicated, blocked=blocked)

  def call(x, packed, scales, zeros, bias, act):
    rows = _rows(x)
    y, _ = jax.ffi.ffi_call(
        cfg.target("fwd_q"),
        (jax.ShapeDtypeStruct(rows.shape[:-1] + (scales.shape[-1],), x.dtype),
         _q_workspace(cfg, rows.shape[0], rows.shape[1], scales.shape[-1])),
    )(rows, packed, scales, zeros if zeros is not None else _empty(jnp.uint8),
      bias if bias is not None else _empty(x.dtype),
      bits=np.int32(qw.bits), group_size=np.int32(x.shape[-1] // scales.shape[-2]),
      activation=np.int32(_Q_ACTIVATION[act]), has_zeros=zeros is not None,
      has_bias=bias is not None)
    return (y.reshape(x.shape[:-1] + (scales.shape[-1],)),)

  def split(rest):
    rest = list(rest)
    z = rest.pop(0) if has_zeros else None
    b = rest.pop(0) if has_bias else None
    return z, b

  def local_fn(x, packed, scales, *rest):
    z, b = split(rest)
    return call(x, packed, scales, z, b, activation)

  def partial_fn(x, packed, scales, *rest):
    z, _ = split(rest)
    return call(x, packed, scales, z, None, None)

  def finish_fn(outs, x, packed, scales, *rest):
    _, b = split(rest)
    return (_finish(outs[0], b, activation, x.dtype),)

  partial = PartialBody(partial_fn, finish_fn) if (has_bias or activation) else None
  return grouped_call(local_fn, layout, *inputs, partial=partial)[0]


def _dequant_call(cfg: _Config, packed, scales, zeros):
  """The dense weight (G, K, N) of grouped packed arrays, in the scales' dtype."""
  qw = cfg.weight(None, None, None)
  has_zeros = zeros is not None
  blocked, replicated = _q_blocked(qw)
  layout = Layout(inputs=("g k n w", "g k n") + ("g k n",) * has_zeros, outputs=("g k n",),
                  replicated=replicated, blocked=blocked)

  def local_fn(packed, scales, *rest):
    k = packed.shape[-3] * reference.TILE_K if "k" in blocked else qw.in_features
    w = jax.ffi.ffi_call(
        cfg.target("dequant"),
        jax.ShapeDtypeStruct((scales.shape[0], k, scales.shape[-1]), scales.dtype),
    )(packed, scales, rest[0] if has_zeros else _empty(jnp.uint8), bits=np.int32(qw.bits),
      group_size=np.int32(k // scales.shape[-2]), has_zeros=has_zeros)
    return (w,)

  inputs = [packed, scales] + ([zeros] if has_zeros else [])
  return grouped_call(local_fn, layout, *inputs)[0]


def _dequantized(cfg: _Config, qw: QuantizedWeight, dtype):
  """qw.dequantize(dtype) by jaxgpu's kernel (the 'xla' implementation: the reference)."""
  if cfg.implementation == "xla":
    return qw.dequantize(dtype)
  g = lambda a: None if a is None else a[None]
  return _dequant_call(cfg, g(qw.packed), g(qw.scales.astype(dtype)), g(qw.zeros))[0]


def _q_forward(cfg: _Config, x, packed, scales, zeros, bias, activation):
  g = lambda a: None if a is None else a[None]
  return _qfwd_call(cfg, x[None], g(packed), g(scales), g(zeros), g(bias), activation)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _qlinear(cfg: _Config, x, packed, scales, zeros, bias):
  return _q_forward(cfg, x, packed, scales, zeros, bias, cfg.activation)


def _qlinear_fwd(cfg: _Config, x, packed, scales, zeros, bias):
  if cfg.activation is None:
    y = _q_forward(cfg, x, packed, scales, zeros, bias, None)
    return y, (packed, scales, zeros, None)
  z = _q_forward(cfg, x, packed, scales, zeros, bias, None)
  return _finish(z[None], None, cfg.activation, x.dtype)[0], (packed, scales, zeros, z)


def _zero_cotangent(a):
  if a is None:
    return None
  if jnp.issubdtype(a.dtype, jnp.integer):
    return np.zeros(a.shape, jax.dtypes.float0)
  return jnp.zeros_like(a)


def _qlinear_bwd(cfg: _Config, res, dy):
  packed, scales, zeros, z = res
  dz = _activation_grad(cfg.activation, dy, z)
  w = _dequantized(cfg, cfg.weight(packed, scales, zeros), dy.dtype)
  dx = _dgrad_call(cfg, dz[None], w[None])[0]
  db = None
  if cfg.has_bias:
    db = jnp.sum(dz.reshape(-1, dz.shape[-1]), axis=0, dtype=jnp.float32).astype(dz.dtype)
  dx, db = match_primal_types((dx, db), (cfg.primal_types[0], cfg.primal_types[2]))
  return (dx, _zero_cotangent(packed), _zero_cotangent(scales), _zero_cotangent(zeros), db)


_qlinear.defvjp(_qlinear_fwd, _qlinear_bwd)


# ---- the public op ------------------------------------------------------------------------------


def _check_activation(activation):
  if activation not in ACTIVATIONS:
    raise ValueError(f"linear: activation must be one of {ACTIVATIONS}, got {activation!r}")
  return activation


def linear(x, w, bias=None, *, activation=None, implementation=None):
  """act(x @ w + bias), the GEMM and its epilogue in one kernel.

  x: (..., K) float32, bfloat16 or float16. w: (K, N) in x's dtype, or a
  `QuantizedWeight` of shape (K, N) (`quantize_weight`). bias: (N,) in x's dtype, or None.
  activation: None, 'relu', 'gelu' (tanh form, jax.nn.gelu's default), 'gelu_exact' (erf)
  or 'silu'. Returns (..., N) in x's dtype: float32 accumulation, the bias and activation
  in float32, one rounding. Pure-JAX equivalent::

    act(jnp.matmul(x, w, preferred_element_type=jnp.float32) + bias).astype(x.dtype)

  (with ``w = qw.dequantize(x.dtype)`` for a quantized weight). implementation: None,
  'cuda', 'cpu' or 'xla'. Forward mode (jax.jvp) and second derivatives run the reference.
  """
  op = "linear"
  x = _checks.float_array(op, "x", x)
  _checks.min_rank(op, "x", x, 1)
  activation = _check_activation(activation)
  quantized = isinstance(w, QuantizedWeight)
  k = x.shape[-1]
  if quantized:
    if w.in_features != k:
      raise ValueError(f"{op}: w must have K = {k} input features (x's last dim), got a "
                       f"QuantizedWeight of shape {w.shape}")
    n = w.out_features
  else:
    w = _checks.float_array(op, "w", w)
    if w.ndim != 2 or w.shape[0] != k:
      raise ValueError(f"{op}: w must have shape ({k}, N) (K = x's last dim), got "
                       f"{tuple(w.shape)}")
    _checks.same_dtype(op, "w", w, "x", x)
    n = w.shape[1]
  if bias is not None:
    bias = _checks.float_array(op, "bias", bias)
    _checks.shape_is(op, "bias", bias, (n,), "N")
    _checks.same_dtype(op, "bias", bias, "x", x)
  impl = _autodiff.route(_implementation.resolve(implementation), x, w, bias)
  rows = math.prod(x.shape[:-1])
  if quantized:
    return _quantized(x, w, bias, activation, impl, rows, n)
  if impl == "xla" or 0 in (rows, k, n):
    return reference.linear(x, w, bias, activation=activation,
                            out_sharding=_explicit_out_spec(x, w))
  cfg = _Config(impl, activation, bias is not None, primal_types(x, w, bias))
  return _linear(cfg, x, w, bias)


def _explicit_out_spec(x, w):
  """The PartitionSpec of x @ w on an Explicit mesh (rows as x's, N as w's; a sharded K is
  summed), or None off one (or where x and w use one mesh axis twice)."""
  if not (in_explicit_mode(x) or in_explicit_mode(w)):
    return None
  entries = list(explicit_spec(x)[:-1]) + [explicit_spec(w)[-1]]
  used = [ax for e in entries if e is not None for ax in (e if isinstance(e, tuple) else (e,))]
  return PartitionSpec(*entries) if len(used) == len(set(used)) else None


def _wgmma_serves(cfg: _Config, qw: QuantizedWeight) -> bool:
  """Whether the quantized kernel's Hopper path (ffi/matmul/qlinear_wgmma_sm90.cu) takes
  this weight on this machine: CUDA on a compute capability 9.0 GPU, N a multiple of 16, K
  of 8, one scale row per 64-k tile (group_size a multiple of 64, or K). Its handler falls
  back to the mma.sync kernel where a buffer is misaligned or the build lacks sm_90a."""
  k, n, gs = qw.in_features, qw.out_features, qw.group_size
  return (cfg.on_cuda and _implementation.hopper_present() and n % 16 == 0 and k % 8 == 0
          and (gs == k or gs % 64 == 0))


def _quantized(x, qw: QuantizedWeight, bias, activation, impl, rows: int, n: int):
  cfg = _Config(impl, activation, bias is not None, primal_types(x, None, bias),
                (qw.bits, qw.group_size, qw.in_features, qw.out_features))
  dense = (impl == "xla" or 0 in (rows, n) or (x.dtype == jnp.float32 and cfg.on_cuda)
           or (rows >= DENSE_FROM_ROWS and not _wgmma_serves(cfg, qw)))
  if dense:
    if any(in_explicit_mode(a) for a in (qw.packed, qw.scales)):
      # The unpacking reshapes need the packed tiles whole on an Explicit mesh.
      qw = jax.tree.map(lambda a: jax.sharding.reshard(a, PartitionSpec()), qw)
    w = jax.lax.stop_gradient(_dequantized(cfg, qw, x.dtype))
    return linear(x, w, bias, activation=activation, implementation=impl)
  scales = qw.scales.astype(x.dtype)
  return _qlinear(cfg, x, qw.packed, scales, qw.zeros, bias)
