"""Pure-JAX implementations: the 'xla' implementation of every op and the test oracle."""

from jaxgpu.reference.norm import layer_norm, rms_norm
from jaxgpu.reference.rope import rope

__all__ = ["layer_norm", "rms_norm", "rope"]
