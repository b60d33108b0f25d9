"""Weight-only quantized Gemma: the layers' projection matrices as int8 / int4
`jaxgpu.QuantizedWeight`s, for generation (the embedding, which is also the output head,
and the norms stay in the activation dtype).

A projection weight is quantized as the matrix the product contracts: q, k, v (D, N, H) as
(D, N H), o (N, H, D) as (N H, D), gate and up (D, F), down (F, D). layers.project runs
each through jaxgpu.linear, which streams the packed weight once per decode step.
"""

from __future__ import annotations

import math

import jaxgpu
from jaxgpu.models.gemma.config import Config

# Leading dims each projection contracts (the rest are its output dims).
CONTRACTED = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1}


def matrix_shape(name: str, shape: tuple[int, ...]) -> tuple[int, int]:
  c = CONTRACTED[name]
  return (math.prod(shape[:c]), math.prod(shape[c:]))


def quantize_params(params: dict, config: Config, *, bits: int = 8,
                    group_size: int | None = 128, symmetric: bool | None = None) -> dict:
  """params with every layer's projections quantized (jaxgpu.quantize_weight).

  bits: 8 or 4. group_size: rows per scale (None, or a size that does not divide a
  matrix's K: one scale per column). symmetric: default True for int8 (per-group absmax),
  False for int4 (zero points, GPTQ-style)."""
  del config  # the shapes come from the weights
  symmetric = (bits == 8) if symmetric is None else symmetric
  layers = []
  for layer in params["layers"]:
    out = dict(layer)
    for name in CONTRACTED:
      w = layer[name]
      matrix = w.reshape(matrix_shape(name, w.shape))
      gs = group_size if group_size is not None and matrix.shape[0] % group_size == 0 else None
      out[name] = jaxgpu.quantize_weight(matrix, bits=bits, group_size=gs,
                                         symmetric=symmetric, scale_dtype=w.dtype)
    layers.append(out)
  return {**params, "layers": layers}
