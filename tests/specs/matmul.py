"""linear (dense and with a QuantizedWeight): cases, argument makers, the float64 oracle
and the contract specs.

The oracle is written here independently of jaxgpu.reference.matmul (the 'xla'
implementation under test): a plain matmul at the arrays' precision (float64 under
oracle.x64(), float32 accumulation for low-precision inputs), and for a quantized weight
an unpacking that gathers each value by its position formula (ffi/matmul/qlinear_params.h
QPackedAt, re-derived in `packed_position`), not by the reference's reshapes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import contract as C
import jaxgpu
import oracle

ACTIVATIONS = (None, "relu", "gelu", "gelu_exact", "silu")


@dataclasses.dataclass(frozen=True)
class Case:
  dtype: object
  lead: tuple = (5,)
  k: int = 37
  n: int = 24
  bias: bool = True
  activation: str | None = "gelu"
  bits: int = 0               # 0: a dense weight; 4 or 8: a QuantizedWeight
  group_size: int | None = None
  symmetric: bool = False

  def id(self) -> str:
    parts = [jnp.dtype(self.dtype).name, "x".join(map(str, self.lead + (self.k, self.n))),
             str(self.activation), "b" if self.bias else "nob"]
    if self.bits:
      parts.append(f"int{self.bits}g{self.group_size}{'s' if self.symmetric else 'a'}")
    return "-".join(parts)


# ---- the packed layout, from its position formula ------------------------------------------


def packed_position(bits: int, k: int, n: int):
  """(word, shift) of every (k, n) of a packed weight, as numpy arrays (K, N)."""
  kk, nn = np.meshgrid(np.arange(k), np.arange(n), indexing="ij")
  nt_count = -(-n // 16)
  r, c = nn % 16, kk % 64
  h, gq = r // 8, r % 8
  s, kh, tq, e = c // 16, (c % 16) // 8, (c % 8) // 2, c % 2
  lane = 4 * gq + tq
  words = 128 if bits == 4 else 256
  tile = ((kk // 64) * nt_count + nn // 16) * words
  if bits == 4:
    return tile + lane * 4 + s, 4 * (4 * e + 2 * kh + h)
  return tile + lane * 8 + 2 * s + kh, 8 * (2 * h + e)


def unpack(packed, bits: int, k: int, n: int):
  word, shift = packed_position(bits, k, n)
  flat = jax.lax.bitcast_convert_type(packed, jnp.uint32).reshape(-1)
  return ((flat[word] >> jnp.asarray(shift, jnp.uint32)) & ((1 << bits) - 1)).astype(jnp.int32)


def dense_weight(arrays: dict, static: dict, dtype):
  """The weight the op multiplies by: w, or round_dtype((q - z) * s) of a quantized one."""
  if "w" in arrays:
    return arrays["w"]
  scales = arrays["scales"]
  k, n = static["in_features"], scales.shape[-1]
  bits, gs = static["bits"], static["group_size"]
  q = unpack(arrays["packed"], bits, k, n)
  zeros = arrays.get("zeros")
  z = (1 << (bits - 1)) if zeros is None else jnp.repeat(zeros.astype(jnp.int32), gs, axis=0)
  s = jnp.repeat(scales, gs, axis=0)
  round_to = dtype if dtype is not None else scales.dtype
  w = ((q - z).astype(jnp.float32) * s.astype(jnp.float32)).astype(round_to)
  return w.astype(scales.dtype)


def _activate(z, activation):
  return {None: lambda t: t, "relu": jax.nn.relu,
          "gelu": lambda t: jax.nn.gelu(t, approximate=True),
          "gelu_exact": lambda t: jax.nn.gelu(t, approximate=False),
          "silu": jax.nn.silu}[activation](z)


def jnp_linear(arrays: dict, static: dict, dtype=None):
  """act(x w + bias) at the arrays' precision, float32 at least."""
  x = arrays["x"]
  acc = jnp.promote_types(x.dtype, jnp.float32)
  w = dense_weight(arrays, static, dtype)
  z = jnp.matmul(x.astype(acc), w.astype(acc), precision=jax.lax.Precision.HIGHEST)
  if arrays.get("bias") is not None:
    z = z + arrays["bias"].astype(acc)
  return (_activate(z, static.get("activation")).astype(x.dtype),)


# The largest |f''| of the smooth activations (gelu, both forms: 2 phi(0) = 0.80; silu: 0.5).
_MAX_CURVATURE = 0.8


def _atol(arrays, static, cots, outs):
  """Extra rounding atols from the pre-activation z rounded to the dtype.

  y: cuBLASLt has no exact-gelu or silu epilogue, so those (and the tanh gelu where N is
  not a multiple of 8) apply the activation to the rounded z: half an ulp of |z| times the
  activation's slope (at most 1.13 for these).
  Gradients: the backward pass takes f'(z) at the z the forward pass kept in the dtype (as
  cuBLASLt's GELU_AUX keeps it), so dz = dy f'(z) is off by |dy| max|f''| u |z|, which is
  not relative to dz (f' crosses 0: gelu's at z = -0.75); dx, dw and dbias sum it through
  the products."""
  x = oracle.as_f64(arrays["x"])
  if static.get("activation") is None or static.get("activation") == "relu" or x.size == 0:
    return {}, {}
  w = (oracle.as_f64(arrays["w"]) if "w" in arrays else
       np.asarray(dense_weight({k: jnp.asarray(v) for k, v in arrays.items()}, static, None),
                  np.float64))
  z = x @ w
  if arrays.get("bias") is not None:
    z = z + oracle.as_f64(arrays["bias"])
  dtype = jnp.asarray(arrays["x"]).dtype
  unit = oracle.unit_roundoff(dtype)
  out = {"y": 1.13 * unit * float(np.max(np.abs(z), initial=0.0))}
  if cots is None:
    return out, {}
  dz = np.abs(np.asarray(cots[0], np.float64)) * _MAX_CURVATURE * unit * np.abs(z)
  rows_x, rows_dz = np.abs(x).reshape(-1, x.shape[-1]), dz.reshape(-1, dz.shape[-1])
  grads = {"x": 2 * float(np.max(rows_dz @ np.abs(w).T, initial=0.0)),
           "w": 2 * float(np.max(rows_x.T @ rows_dz, initial=0.0)),
           "bias": 2 * float(np.max(rows_dz.sum(0), initial=0.0))}
  return out, grads


# ---- inputs ------------------------------------------------------------------------------------


def make(rng, case: Case) -> C.Inputs:
  x = oracle.randn(rng, case.lead + (case.k,), case.dtype)
  w = oracle.randn(rng, (case.k, case.n), jnp.float32, float(case.k) ** -0.5)
  arrays = {"x": x}
  static = {"activation": case.activation}
  if case.bits:
    qw = jaxgpu.quantize_weight(w, bits=case.bits, group_size=case.group_size,
                                symmetric=case.symmetric, scale_dtype=case.dtype)
    arrays.update(packed=qw.packed, scales=qw.scales)
    if qw.zeros is not None:
      arrays["zeros"] = qw.zeros
    static.update(bits=case.bits, group_size=qw.group_size, in_features=case.k)
  else:
    arrays["w"] = w.astype(case.dtype)
  if case.bias:
    arrays["bias"] = oracle.randn(rng, (case.n,), case.dtype)
  if case.activation == "relu":
    _keep_relu_off_zero(arrays, qw.dequantize() if case.bits else arrays["w"])
  return C.Inputs(arrays, static)


# A pre-activation within float32 accumulation's error of 0 may take either side of relu's
# kink in the kernel and in the float64 oracle: its whole cotangent then moves to or from
# dbias, dx and dw (a gradient off by ~1, seen at 231 x 1000 outputs in one run out of
# several). The relu cases keep every pre-activation at least this far (relative to their
# RMS) from 0: ~100x float32 summation's error over these K (the kernels and the oracle
# round the weights alike, so only the order of the sums differs).
_RELU_MARGIN = 1e-4
_NUDGES = sorted(np.linspace(-0.5, 0.5, 129), key=abs)


def _keep_relu_off_zero(arrays: dict, w) -> None:
  """Shifts the bias per column (or, without one, the whole of x's row per row) to the
  first candidate, rounded to its dtype, that keeps every pre-activation of that column
  (row) off 0 by _RELU_MARGIN x RMS. (A single feature of x would not do: a quantized
  weight row holds exact zeros.)"""
  x = np.asarray(arrays["x"], np.float64)
  w64 = np.asarray(w, np.float64)
  rows = x.reshape(-1, x.shape[-1])
  z = rows @ w64
  has_bias = "bias" in arrays
  if has_bias:
    z = z + np.asarray(arrays["bias"], np.float64)
  if z.size == 0:
    return
  margin = _RELU_MARGIN * max(float(np.sqrt(np.mean(z * z))), 1e-30)
  dtype = arrays["bias" if has_bias else "x"].dtype

  def rounded(a):
    return np.asarray(jnp.asarray(a.astype(np.float32)).astype(dtype), np.float64)

  if has_bias:
    b = np.asarray(arrays["bias"], np.float64)
    fixed, best, done = z - b, b.copy(), np.zeros(b.shape, bool)
    for t in _NUDGES:
      cand = rounded(b + t)
      ok = (np.abs(fixed + cand) >= margin).all(axis=0) & ~done
      best[ok], done = cand[ok], done | ok
      if done.all():
        break
    arrays["bias"] = jnp.asarray(best.astype(np.float32)).astype(dtype)
    return
  best, done = rows.copy(), np.zeros(rows.shape[0], bool)
  for t in _NUDGES:
    todo = np.flatnonzero(~done)
    cand = rounded(rows[todo] + t)
    ok = (np.abs(cand @ w64) >= margin).all(axis=1)
    best[todo[ok]] = cand[ok]
    done[todo[ok]] = True
    if done.all():
      break
  arrays["x"] = jnp.asarray(best.reshape(x.shape).astype(np.float32)).astype(dtype)


def call_quantized(fn, x, packed, scales, zeros=None, bias=None, *, bits, group_size,
                   in_features, **options):
  """jaxgpu.linear with the QuantizedWeight the spec's arrays hold."""
  qw = jaxgpu.QuantizedWeight(packed, scales, zeros, bits, group_size, in_features,
                              scales.shape[-1])
  return fn(x, qw, bias, **options)


# ---- tables ------------------------------------------------------------------------------------

ROWS = P("a", "b", None)


def _vmap_table(q: dict) -> tuple:
  weights = ("packed", "scales", "zeros") if q else ("w",)
  out = []
  for i, (name, axes) in enumerate((
      ("x0", {"x": 0}),
      ("x1", {"x": 1}),
      ("weight0", dict.fromkeys(weights, 0)),
      ("x0-weight1", {"x": 0, **dict.fromkeys(weights, -1 if not q else 0)}),
      ("bias", {"bias": 0}),
      ("all0", {"x": 0, "bias": 0, **dict.fromkeys(weights, 0)}),
  )):
    dtype = oracle.DTYPES[i % len(oracle.DTYPES)]
    case = Case(dtype, lead=(4,), k=64 if q else 37, n=24, activation=ACTIVATIONS[i % 5], **q)
    out.append(C.VmapCase(name, case, (axes,)))
  out.append(C.VmapCase("shared-weight", Case(jnp.bfloat16, lead=(3,), k=64, **q),
                        ({"x": 0},), frozenset({"grad_of"})))
  return tuple(out)


def _dense_sharding() -> tuple:
  k_sharded = P(None, None, "a")
  return (
      C.ShardingCase("rows", Case(jnp.bfloat16, lead=(8, 6), k=32, n=24), {"x": ROWS},
                     fwd=frozenset(), bwd=frozenset({"all-reduce"}),
                     out_specs={"y": ROWS}, grad_specs={"x": ROWS, "w": P(), "bias": P()}),
      C.ShardingCase("column", Case(jnp.float32, lead=(6, 5), k=32, n=24),
                     {"w": P(None, "a"), "bias": P("a")}, fwd=frozenset(),
                     bwd=frozenset({"all-reduce"}), out_specs={"y": P(None, None, "a")},
                     grad_specs={"w": P(None, "a"), "bias": P("a")}, kernels_only=True),
      C.ShardingCase("row-parallel", Case(jnp.float32, lead=(6, 5), k=32, n=24,
                                          activation="silu"),
                     {"x": k_sharded, "w": P("a", None)}, fwd=frozenset({"all-reduce"}),
                     grad_specs={"x": k_sharded, "w": P("a", None)}, kernels_only=True),
  )


def _quantized_sharding(q: dict) -> tuple:
  n_sharded = {"packed": P(None, "a", None), "scales": P(None, "a"), "zeros": P(None, "a"),
               "bias": P("a")}
  k_sharded = {"x": P(None, None, "a"), "packed": P("a", None, None), "scales": P("a", None),
               "zeros": P("a", None)}
  return (
      C.ShardingCase("rows", Case(jnp.bfloat16, lead=(8, 6), k=64, n=24, **q), {"x": ROWS},
                     fwd=frozenset(), out_specs={"y": ROWS}, grad_specs={"x": ROWS}),
      C.ShardingCase("column", Case(jnp.float32, lead=(6, 5), k=64, n=64, **q), n_sharded,
                     fwd=frozenset(), out_specs={"y": P(None, None, "a")}, kernels_only=True,
                     grad=False),
      C.ShardingCase("row-parallel", Case(jnp.float32, lead=(6, 5), k=256, n=24,
                                          **{**q, "group_size": 64}),
                     k_sharded, fwd=frozenset({"all-reduce"}), kernels_only=True, grad=False),
  )


def _dense_kw(**over):
  case = Case(jnp.float32, lead=(3,), k=8, n=5)
  return {**make(np.random.default_rng(0), case).arrays, **over}


def _bad_dense() -> tuple:
  table = [
      ("x-scalar", lambda: _dense_kw(x=jnp.float32(1.0)), ValueError, r"\bx\b.*rank"),
      ("x-int", lambda: _dense_kw(x=jnp.ones((3, 8), jnp.int32)), TypeError, r"\bx\b.*dtype"),
      ("w-shape", lambda: _dense_kw(w=jnp.ones((7, 5))), ValueError, r"\bw\b.*shape"),
      ("w-rank", lambda: _dense_kw(w=jnp.ones((8,))), ValueError, r"\bw\b.*shape"),
      ("w-dtype", lambda: _dense_kw(w=jnp.ones((8, 5), jnp.bfloat16)), TypeError, r"\bw\b.*dtype"),
      ("bias-shape", lambda: _dense_kw(bias=jnp.ones((4,))), ValueError, r"bias.*shape"),
      ("bias-dtype", lambda: _dense_kw(bias=jnp.ones((5,), jnp.float16)), TypeError,
       r"bias.*dtype"),
      ("activation", lambda: _dense_kw(activation="tanh"), ValueError, r"activation"),
      ("implementation", lambda: _dense_kw(implementation="bogus"), ValueError,
       r"implementation"),
  ]
  return tuple(C.BadInput(*b) for b in table)


def _q_kw(q, **over):
  case = Case(jnp.float32, lead=(3,), k=64, n=5, **q)
  inputs = make(np.random.default_rng(0), case)
  return {**inputs.arrays, **inputs.static, **over}


def _bad_quantized(q) -> tuple:
  table = [
      ("x-features", lambda: _q_kw(q, x=jnp.ones((3, 32))), ValueError, r"\bw\b.*K = 32"),
      ("x-int", lambda: _q_kw(q, x=jnp.ones((3, 64), jnp.int32)), TypeError, r"\bx\b.*dtype"),
      ("bias-shape", lambda: _q_kw(q, bias=jnp.ones((6,))), ValueError, r"bias.*shape"),
      ("activation", lambda: _q_kw(q, activation="elu"), ValueError, r"activation"),
  ]
  return tuple(C.BadInput(*b) for b in table)


def _spec(q: dict) -> C.OpSpec:
  weights = ("packed", "scales", "zeros") if q else ("w",)
  variant = f"int{q['bits']}" if q else ""
  k = 64 if q else 37
  return C.OpSpec(
      name="linear",
      variant=variant,
      fwd_pass="fwd_q" if q else "fwd",
      call=call_quantized if q else None,
      grad_passes=("dgrad",) if q else ("dgrad", "wgrad"),
      make=make,
      example=Case(jnp.float32, lead=(5,), k=k, n=24, **q),
      array_args=("x",) + weights + ("bias",),
      diff_args=("x", "bias") if q else ("x", "w", "bias"),
      oracle=jnp_linear,
      atol=_atol,
      vmap=_vmap_table(q),
      pmap=C.VmapCase("x0", Case(jnp.float32, lead=(3,), k=k, n=24, **q), ({"x": 0},),
                      sizes=(C.PMAP_DEVICES,)),
      sharding=_quantized_sharding(q) if q else _dense_sharding(),
      shard_map=C.ShardMapCase(Case(jnp.bfloat16, lead=(8, 3), k=k, n=24, **q),
                               {"x": P(("a", "b"))}, (P(("a", "b")),)),
      bad_inputs=_bad_quantized(q) if q else _bad_dense(),
      size_zero=tuple((f"{lead}x{k}x{n}", Case(jnp.bfloat16, lead=lead, k=k, n=n, **q))
                      for lead, k, n in (((0,), k, 24), ((3,), k, 0), ((2, 0), k, 8))),
  )


INT4 = dict(bits=4, group_size=32, symmetric=False)
INT8 = dict(bits=8, group_size=None, symmetric=True)
SPECS = (_spec({}), _spec(INT4), _spec(INT8))
