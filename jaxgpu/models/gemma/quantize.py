"""Weight-only quantized Gemma: the layers' projection matrices as int8 / int4
`jaxgpu.QuantizedWeight`s, for generation (the embedding, which is also the output head,
and the norms stay in the activation dtype).

A projection weight is quantized as the matrix the product contracts: q, k, v (D, N, H) as
(D, N H), o (N, H, D) as (N H, D), gate and up (D, F), down (F, D). layers.project runs
each through jaxgpu.linear, which streams the packed weight once per decode step.

Projections that read the same input are quantized as one matrix (FUSED: q, k and v as
"qkv", gate and up as "gate_up"), their columns concatenated: each column keeps its own
scales, so this is the same quantization as one matrix each, and a decode step makes one
kernel call where it would make two or three. At decode sizes a call's fixed cost (launch,
first loads, split-K reduction: 5-6 us on an H100) outweighs its bytes: Gemma 2 2B's q, k
and v in int4 are 6.7 + 5.7 + 5.7 us as three calls and 7.9 us as one (docs/perf/matmul.md).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

import jaxgpu
from jaxgpu.models.gemma.config import Config

# Leading dims each projection contracts (the rest are its output dims).
CONTRACTED = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1}
# Fused projections: the parts whose matrices are concatenated along N, in this order.
FUSED = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}


def matrix_shape(name: str, shape: tuple[int, ...]) -> tuple[int, int]:
  c = CONTRACTED[name]
  return (math.prod(shape[:c]), math.prod(shape[c:]))


def split_columns(a, widths) -> list:
  """a's last axis split into consecutive parts of the given widths (a fused matrix's or
  its product's columns back into each part's)."""
  return jnp.split(a, np.cumsum(widths)[:-1].tolist(), axis=-1)


def fused_shapes(layer_shapes: dict, names) -> dict:
  """A layer's shapes (params.layer_shapes) with the parts of each FUSED group named in
  `names` replaced by the fused matrix shape (K, sum of the parts' N)."""
  out = dict(layer_shapes)
  for fused, parts in FUSED.items():
    if fused not in names:
      continue
    mats = [matrix_shape(part, out.pop(part)) for part in parts]
    out[fused] = (mats[0][0], sum(n for _, n in mats))
  return out


def quantize_params(params: dict, config: Config, *, bits: int = 8,
                    group_size: int | None = 128, symmetric: bool | None = None,
                    fuse: bool = True) -> dict:
  """params with every layer's projections quantized (jaxgpu.quantize_weight).

  bits: 8 or 4. group_size: rows per scale (None, or a size that does not divide a
  matrix's K: one scale per column). symmetric: default True for int8 (per-group absmax),
  False for int4 (zero points, GPTQ-style). fuse: quantize q, k, v as one "qkv" matrix and
  gate, up as one "gate_up" (FUSED); False keeps one QuantizedWeight per projection."""
  del config  # the shapes come from the weights
  symmetric = (bits == 8) if symmetric is None else symmetric

  def quantize(matrix):  # scales in the weights' dtype
    gs = group_size if group_size is not None and matrix.shape[0] % group_size == 0 else None
    return jaxgpu.quantize_weight(matrix, bits=bits, group_size=gs, symmetric=symmetric,
                                  scale_dtype=matrix.dtype)

  layers = []
  for layer in params["layers"]:
    out = dict(layer)
    for name in CONTRACTED:
      out[name] = layer[name].reshape(matrix_shape(name, layer[name].shape))
    if fuse:
      for fused, parts in FUSED.items():
        out[fused] = jnp.concatenate([out.pop(part) for part in parts], axis=1)
    for name in list(out):
      if name in CONTRACTED or name in FUSED:
        out[name] = quantize(out[name])
    layers.append(out)
  return {**params, "layers": layers}


def dequantize_params(qparams: dict, config: Config, dtype=None) -> dict:
  """The float params that quantize_params' output stands for: each projection dequantized
  (fused ones split back into their parts) in its original shape. dtype: the dense
  weights' dtype (default: the embedding's)."""
  from jaxgpu.models.gemma.params import layer_shapes  # params imports this module
  dtype = qparams["embed"].dtype if dtype is None else dtype
  shapes = layer_shapes(config)
  layers = []
  for layer in qparams["layers"]:
    out = {}
    for name, w in layer.items():
      if name in FUSED:
        widths = [matrix_shape(part, shapes[part])[1] for part in FUSED[name]]
        for part, dense in zip(FUSED[name], split_columns(w.dequantize(dtype), widths)):
          out[part] = dense.reshape(shapes[part])
      elif name in CONTRACTED and isinstance(w, jaxgpu.QuantizedWeight):
        out[name] = w.dequantize(dtype).reshape(shapes[name])
      else:
        out[name] = w
    layers.append(out)
  return {**qparams, "layers": layers}
