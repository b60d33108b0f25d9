"""Pure-JAX implementations: the 'xla' implementation of every op and the test oracle."""

from jaxgpu.reference.activation import geglu, gelu, relu, sigmoid, silu, swiglu
from jaxgpu.reference.cross_entropy import cross_entropy
from jaxgpu.reference.norm import layer_norm, rms_norm
from jaxgpu.reference.rope import rope

__all__ = [
    "cross_entropy", "geglu", "gelu", "layer_norm", "relu", "rms_norm", "rope", "sigmoid",
    "silu", "swiglu",
]
