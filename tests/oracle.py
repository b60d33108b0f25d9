"""Test oracles and the error rule shared by the test modules.

Written independently of jaxgpu.reference on purpose: the 'xla' implementation IS
jaxgpu.reference, and it is tested against these like every kernel.

  * float64 numpy forward oracles (`np_rms_norm`, `np_layer_norm`), fed the exact values
    the low-precision inputs hold;
  * float64 gradient oracles: jax.grad of the jnp references below under a local x64
    context (`x64()`), never a global jax_enable_x64;
  * low-precision jnp references (`lowp_*`: statistics in float32, results in the input
    dtype) whose error against float64 sets the budget (docs/design.md section 7): a result's
    max error against float64 may be at most 2x the low-precision reference's, plus a
    small rounding atol. NaN never passes.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)

# ---- x64, locally ---------------------------------------------------------------------------


@contextlib.contextmanager
def x64():
  """float64 jax inside the block only, computed on the CPU (the oracle never needs a GPU)."""
  if hasattr(jax, "enable_x64"):           # jax >= 0.9: a config context manager
    ctx = jax.enable_x64(True)
  else:                                    # older jax
    from jax.experimental import enable_x64  # type: ignore
    ctx = enable_x64()
  with ctx, jax.default_device(jax.devices("cpu")[0]):
    yield


# ---- inputs -----------------------------------------------------------------------------------


def as_f64(a) -> np.ndarray:
  """The exact values of a (any float dtype, numpy or jax) as float64 numpy."""
  return np.asarray(a).astype(np.float64)


def randn(rng: np.random.Generator, shape, dtype, scale=1.0, shift=0.0) -> jax.Array:
  """Random normal values rounded to dtype, on the default device."""
  a = rng.standard_normal(shape) * scale + shift
  return jnp.asarray(a.astype(np.float32)).astype(dtype)


# ---- float64 forward oracles (numpy) -------------------------------------------------------
#
# With a residual the op normalizes h = x + residual ROUNDED ONCE to x's dtype (documented:
# h is also returned in that dtype). The oracles do the same: the exact sum, rounded once,
# normalized in float64; the h they return is the exact sum. (The rounding matters: at
# D = 3 with a small spread, one bfloat16 rounding of h moves the normalized values by
# tens of percent, and XLA, allowed excess precision, may skip it in the reference.)


def _round_h(h64, dtype):
  return h64 if dtype is None else np.asarray(h64.astype(dtype), np.float64)


def np_rms_norm(x, weight=None, residual=None, eps=1e-6, weight_offset=0.0):
  dtype = np.asarray(x).dtype
  x = as_f64(x)
  h = x if residual is None else x + as_f64(residual)
  hn = h if residual is None else _round_h(h, dtype)
  y = hn / np.sqrt(np.mean(hn * hn, axis=-1, keepdims=True) + eps)
  if weight is not None:
    y = y * (weight_offset + as_f64(weight))
  return y, h


def np_layer_norm(x, weight=None, bias=None, residual=None, eps=1e-5):
  dtype = np.asarray(x).dtype
  x = as_f64(x)
  h = x if residual is None else x + as_f64(residual)
  hn = h if residual is None else _round_h(h, dtype)
  c = hn - np.mean(hn, axis=-1, keepdims=True)
  y = c / np.sqrt(np.mean(c * c, axis=-1, keepdims=True) + eps)
  if weight is not None:
    y = y * as_f64(weight)
  if bias is not None:
    y = y + as_f64(bias)
  return y, h


# ---- jnp references (any precision; used in float64 under x64 and in low precision) ----------


def _pre_norm(x, residual, h_dtype):
  """(h to normalize, h to return). h_dtype: round the normalized h to it (float64 oracle
  of a low-precision op), differentiating through the rounding as the identity."""
  if residual is None:
    return x, x
  h = x + residual
  if h_dtype is None:
    return h, h
  return h + jax.lax.stop_gradient(h.astype(h_dtype).astype(h.dtype) - h), h


def jnp_rms_norm(x, weight=None, residual=None, eps=1e-6, weight_offset=0.0, h_dtype=None):
  """Statistics in float32 (or x's dtype if wider); output in x.dtype."""
  hn, h = _pre_norm(x, residual, h_dtype)
  stat = jnp.promote_types(x.dtype, jnp.float32)
  hs = hn.astype(stat)
  y = hs * jax.lax.rsqrt(jnp.mean(jnp.square(hs), axis=-1, keepdims=True) + eps)
  if weight is not None:
    y = y * (weight_offset + weight.astype(stat))
  return y.astype(x.dtype), h


def jnp_layer_norm(x, weight=None, bias=None, residual=None, eps=1e-5, h_dtype=None):
  hn, h = _pre_norm(x, residual, h_dtype)
  stat = jnp.promote_types(x.dtype, jnp.float32)
  hs = hn.astype(stat)
  c = hs - jnp.mean(hs, axis=-1, keepdims=True)
  y = c * jax.lax.rsqrt(jnp.mean(jnp.square(c), axis=-1, keepdims=True) + eps)
  if weight is not None:
    y = y * weight.astype(stat)
  if bias is not None:
    y = y + bias.astype(stat)
  return y.astype(x.dtype), h


def norm_fn(kind: str):
  return {"rms": jnp_rms_norm, "layer": jnp_layer_norm}[kind]


def np_norm_fn(kind: str):
  return {"rms": np_rms_norm, "layer": np_layer_norm}[kind]


# ---- the error rule -----------------------------------------------------------------------


def unit_roundoff(dtype) -> float:
  return float(jnp.finfo(dtype).eps) / 2


def check(actual, oracle, lowp, *, what: str, dtype=None, atol_ulps: float = 4.0,
          extra_atol: float = 0.0) -> None:
  """max|actual - oracle| <= 2 * max|lowp - oracle| + atol, and nothing NaN.

  atol = atol_ulps unit roundoffs of the result's dtype times the oracle's magnitude:
  the rounding noise one extra rounding (or a different summation order) may add; none for
  integer and 8-bit float results (quantized values, exact by definition).
  """
  a64 = as_f64(actual)
  o64 = np.asarray(oracle, np.float64)
  r64 = as_f64(lowp)
  assert a64.shape == o64.shape, f"{what}: shape {a64.shape}, expected {o64.shape}"
  if dtype is None:
    dtype = jnp.asarray(actual).dtype
  if o64.size == 0:
    return
  assert np.isfinite(o64).all(), f"{what}: the oracle is not finite (test bug)"
  bad = ~np.isfinite(a64)
  assert not bad.any(), (f"{what}: {int(bad.sum())} non-finite values, first at "
                         f"{np.unravel_index(np.argmax(bad), bad.shape)}")
  err = float(np.max(np.abs(a64 - o64)))
  ref_err = float(np.max(np.abs(r64 - o64)))
  scale = float(np.max(np.abs(o64)))
  # An integer or 8-bit float result is a quantized value, defined bit for bit: no slack.
  quantized = jnp.dtype(dtype).itemsize == 1 or not jnp.issubdtype(dtype, jnp.floating)
  ulp = 0.0 if quantized else unit_roundoff(dtype)
  atol = atol_ulps * ulp * max(scale, 1e-30) + extra_atol
  budget = 2 * ref_err + atol
  if not err <= budget:
    i = np.unravel_index(np.argmax(np.abs(a64 - o64)), o64.shape)
    raise AssertionError(
        f"{what} ({jnp.dtype(dtype).name}, shape {o64.shape}): max error {err:.3e} > budget "
        f"{budget:.3e} (= 2 x reference error {ref_err:.3e} + atol {atol:.3e}); worst at {i}: "
        f"got {a64[i]!r}, float64 {o64[i]!r}, low-precision reference {r64[i]!r}")


def varying_axes(aval) -> frozenset:
  """The mesh axes a value inside shard_map varies over (its vma), across jax versions."""
  mat = getattr(aval, "manual_axis_type", None)       # jax 0.10
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()) or ())


def collectives(hlo_text: str) -> set[str]:
  """The collective ops a compiled HLO module contains."""
  names = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter",
           "collective-broadcast", "ragged-all-to-all")
  found = set()
  for line in hlo_text.splitlines():
    line = line.strip()
    if "=" not in line:
      continue
    rhs = line.split("=", 1)[1]
    for n in names:
      # 'all-reduce(' and the async forms 'all-reduce-start(' both count.
      if f" {n}(" in rhs or f" {n}-start(" in rhs:
        found.add(n)
  return found


def check_tree(got, exact, lowp, what: str, dtype, atol_ulps: float = 4.0) -> None:
  """`check` on every leaf of matching pytrees (kernel output, float64 oracle, low-precision
  reference), each named by its path."""
  paths = jax.tree_util.tree_flatten_with_path(exact)[0]
  g = jax.tree.leaves(got)
  r = jax.tree.leaves(lowp)
  assert len(g) == len(paths) == len(r), what
  for (path, e), gi, ri in zip(paths, g, r):
    check(gi, e, ri, what=f"{what}{jax.tree_util.keystr(path)}", dtype=dtype,
          atol_ulps=atol_ulps)


# ---- sharding on the 8 fake CPU devices (shared by every test_<family>.py) ------------------

AXIS_TYPES = {"auto": jax.sharding.AxisType.Auto, "explicit": jax.sharding.AxisType.Explicit}


def mesh_4x2(cpu_devices, axis_type: str):
  """A (4, 2) mesh ('a', 'b') over the 8 CPU devices, both axes Auto or both Explicit."""
  t = AXIS_TYPES[axis_type]
  return jax.make_mesh((4, 2), ("a", "b"), axis_types=(t, t), devices=cpu_devices)


def run_on_mesh(mesh, axis_type: str, fn):
  """Runs fn() with the mesh set when its axes are Explicit."""
  if axis_type == "explicit":
    with jax.set_mesh(mesh):
      return fn()
  return fn()


def spec_of(a) -> tuple:
  """The PartitionSpec a result carries (padded), whatever the mesh's axis types."""
  spec = tuple(a.sharding.spec)
  return spec + (None,) * (a.ndim - len(spec))
