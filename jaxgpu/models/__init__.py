"""Models built from jaxgpu's ops: plain JAX functions over pytrees of arrays.

`jaxgpu.models.gemma`: Gemma 2 and Gemma 3 (text), training and generation.
"""

from jaxgpu.models import gemma

__all__ = ["gemma"]
