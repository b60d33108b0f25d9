"""Pure-JAX implementations: the 'xla' implementation of every op and the test oracle.

The functions are re-exported here (jaxgpu.reference.rms_norm, ...). Where an op shares its
family's name (rope, softmax, cross_entropy), `jaxgpu.reference.<name>` is the function;
the module is `importlib.import_module("jaxgpu.reference.<name>")`.
"""

from jaxgpu.reference.activation import geglu, gelu, relu, sigmoid, silu, swiglu
from jaxgpu.reference.attention import dot_product_attention
from jaxgpu.reference.cross_entropy import cross_entropy
from jaxgpu.reference.norm import layer_norm, rms_norm
from jaxgpu.reference.rope import rope
from jaxgpu.reference.softmax import softmax

__all__ = [
    "cross_entropy", "dot_product_attention", "geglu", "gelu", "layer_norm", "relu", "rms_norm",
    "rope", "sigmoid", "silu", "softmax", "swiglu",
]
