"""Weight-only quantized weights: the `QuantizedWeight` pytree that `jaxgpu.linear` takes,
and `quantize_weight`.

The layout is the one jaxgpu's kernels stream (ffi/matmul/qlinear_params.h); the packing,
quantization and dequantization rules are jaxgpu.reference.matmul's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxgpu import _checks
from jaxgpu.reference import matmul as reference


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
  """A weight-only quantized (K, N) matrix in the layout jaxgpu's kernels stream (a pytree:
  the arrays are leaves, the rest static).

  packed   int32 (ceil(K/64), ceil(N/16), 32 * words): tiles of 16 output features x 64 k,
           each lane's mma.sync fragments contiguous (ffi/matmul/qlinear_params.h; words =
           4 for int4, 8 for int8). Unsigned values q in [0, 2^bits).
  scales   (K / group_size, N) float: one per group of `group_size` rows of each column.
  zeros    (K / group_size, N) uint8 zero points, or None (symmetric: 2^(bits-1)).
  The weight is w[k, n] = (q[k, n] - z[k // group_size, n]) * s[k // group_size, n],
  rounded once to the compute dtype (`dequantize`).
  """

  packed: jax.Array
  scales: jax.Array
  zeros: jax.Array | None
  bits: int
  group_size: int
  in_features: int
  out_features: int

  @property
  def shape(self) -> tuple[int, int]:
    return (self.in_features, self.out_features)

  @classmethod
  def from_int(cls, q, scales, zeros=None, *, bits: int, group_size: int | None = None):
    """A weight quantized elsewhere: q (K, N) integers in [0, 2^bits) (GPTQ / AWQ int4
    unpacked from their int32 words: value i of a word is (word >> 4 i) & 15), scales
    (K / group_size, N), zeros (K / group_size, N) integers (or None: 2^(bits-1))."""
    op = "QuantizedWeight.from_int"
    q = _checks.as_array(op, "q", q)
    if q.ndim != 2 or not jnp.issubdtype(q.dtype, jnp.integer):
      raise TypeError(f"{op}: q must be a 2-D integer array (K, N), got {q.dtype}"
                      f"{list(q.shape)}")
    k, n = q.shape
    bits = _check_bits(op, bits)
    group_size = _check_group_size(op, group_size, k)
    scales = _checks.float_array(op, "scales", scales)
    _checks.shape_is(op, "scales", scales, (k // group_size, n), "K / group_size, N")
    if zeros is not None:
      zeros = _checks.as_array(op, "zeros", zeros)
      if not jnp.issubdtype(zeros.dtype, jnp.integer):
        raise TypeError(f"{op}: zeros must be integers, got {zeros.dtype}")
      _checks.shape_is(op, "zeros", zeros, (k // group_size, n), "K / group_size, N")
      zeros = zeros.astype(jnp.uint8)
    return cls(reference.pack(q, bits), scales, zeros, bits, group_size, k, n)

  def dequantize(self, dtype=None) -> jax.Array:
    """The dense (K, N) weight in `dtype` (default: the scales' dtype)."""
    dtype = self.scales.dtype if dtype is None else dtype
    q = reference.unpack(self.packed, self.bits, self.in_features, self.out_features)
    return reference.dequantize(q, self.scales, self.zeros, bits=self.bits,
                                group_size=self.group_size, dtype=dtype)

  @property
  def nbytes(self) -> int:
    """Bytes of the packed weight, scales and zeros (what a product reads)."""
    return sum(int(a.size) * a.dtype.itemsize for a in (self.packed, self.scales, self.zeros)
               if a is not None)


jax.tree_util.register_dataclass(
    QuantizedWeight, data_fields=["packed", "scales", "zeros"],
    meta_fields=["bits", "group_size", "in_features", "out_features"])


def _check_bits(op, bits) -> int:
  bits = _checks.static_int(op, "bits", bits)
  if bits not in (4, 8):
    raise ValueError(f"{op}: bits must be 4 or 8, got {bits}")
  return bits


def _check_group_size(op, group_size, k: int) -> int:
  if group_size is None:
    return k
  group_size = _checks.static_int(op, "group_size", group_size)
  if group_size <= 0 or k % group_size != 0 or (group_size % 16 != 0 and group_size != k):
    raise ValueError(f"{op}: group_size must divide K ({k}) and be a multiple of 16 (or K "
                     f"itself, or None for one group per column), got {group_size}")
  return group_size


def quantize_weight(w, *, bits: int = 8, group_size: int | None = 128,
                    symmetric: bool = False, scale_dtype=None) -> QuantizedWeight:
  """Quantizes a float weight w (K, N) to int8 or int4 with one scale per `group_size`
  rows of each column (None: one per column), asymmetric (uint8 zero points) unless
  `symmetric`. scale_dtype: the scales' dtype (default w's; use the activations' dtype,
  which the kernels compute in). See jaxgpu.reference.matmul.quantize for the rule."""
  op = "quantize_weight"
  w = _checks.float_array(op, "w", w)
  if w.ndim != 2:
    raise ValueError(f"{op}: w must have rank 2 (K, N), got shape {tuple(w.shape)}")
  bits = _check_bits(op, bits)
  group_size = _check_group_size(op, group_size, w.shape[0])
  symmetric = _checks.static_bool(op, "symmetric", symmetric)
  scale_dtype = jnp.dtype(w.dtype if scale_dtype is None else scale_dtype)
  if scale_dtype not in _checks.FLOAT_DTYPES:
    raise TypeError(f"{op}: scale_dtype must be float32, bfloat16 or float16, got {scale_dtype}")
  q, scales, zeros = reference.quantize(w, bits=bits, group_size=group_size,
                                        symmetric=symmetric, scale_dtype=scale_dtype)
  return QuantizedWeight(reference.pack(q, bits), scales, zeros, bits, group_size, *w.shape)
