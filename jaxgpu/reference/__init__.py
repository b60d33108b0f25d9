"""Pure-JAX implementations: the 'xla' implementation of every op and the test oracle.

One module per op family, named as in jaxgpu/ops: `jaxgpu.reference.norm.rms_norm`,
`jaxgpu.reference.rope.rope`, `jaxgpu.reference.attention.dot_product_attention`, ...
The package re-exports no functions, so that `jaxgpu.reference.<family>` is always the
module (an op named like its family, such as rope or softmax, would otherwise shadow it).
"""

from jaxgpu.reference import activation, attention, cross_entropy, decode, norm, rope, softmax

__all__ = ["activation", "attention", "cross_entropy", "decode", "norm", "rope", "softmax"]
