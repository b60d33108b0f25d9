"""jaxgpu: hand-written fused CUDA kernels for JAX, as XLA FFI custom calls.

Every op is a plain function that works under jax.jit, jax.grad, jax.vmap, shard_map,
pmap and jit with sharded inputs; ``implementation=`` picks 'cuda', 'cpu' (FFI kernels)
or 'xla' (the pure-JAX reference in jaxgpu.reference).
"""

from jaxgpu._implementation import IMPLEMENTATIONS, available_implementations
from jaxgpu.ops.norm import layer_norm, rms_norm

__version__ = "0.1.0"

__all__ = [
    "IMPLEMENTATIONS",
    "available_implementations",
    "layer_norm",
    "rms_norm",
]
