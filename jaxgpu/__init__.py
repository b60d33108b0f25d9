"""jaxgpu: hand-written fused CUDA kernels for JAX, as XLA FFI custom calls.

Every op is a plain function that works under jax.jit, jax.grad, jax.vmap, shard_map,
pmap and jit with sharded inputs; ``implementation=`` picks 'cuda', 'cpu' (FFI kernels)
or 'xla' (the pure-JAX reference in jaxgpu.reference), and ``with jaxgpu.implementation(...)``
picks it for every op traced in the block.
"""

import pkgutil

# Run from a source checkout (`python -m ...` puts the cwd first on sys.path), this package
# is the source tree, which holds no compiled modules: look for them in the installed copy.
__path__ = pkgutil.extend_path(__path__, __name__)

from jaxgpu import _ffi  # noqa: E402
from jaxgpu._family import export_disabled_checks  # noqa: E402
from jaxgpu._implementation import (  # noqa: E402
    IMPLEMENTATIONS, available_implementations, implementation)
from jaxgpu.ops.activation import geglu, gelu, relu, sigmoid, silu, swiglu  # noqa: E402
from jaxgpu.ops.attention import dot_product_attention  # noqa: E402
from jaxgpu.ops.cross_entropy import cross_entropy  # noqa: E402
from jaxgpu.ops.decode import (  # noqa: E402
    paged_attention, paged_attention_with_update, paged_kv_update)
from jaxgpu.ops.linear_cross_entropy import linear_cross_entropy  # noqa: E402
from jaxgpu.ops.matmul import linear  # noqa: E402
from jaxgpu.ops.norm import layer_norm, rms_norm  # noqa: E402
from jaxgpu.ops.rope import rope  # noqa: E402
from jaxgpu.ops.softmax import softmax  # noqa: E402
from jaxgpu.quantized import QuantizedWeight, quantize_weight  # noqa: E402
from jaxgpu.reference.decode import quantize_kv  # noqa: E402

__version__ = "0.1.0"

# Every target of every module that loads, on every platform it was built for, now: a
# program serialized with jax.export runs in a process that only imported jaxgpu.
_ffi.register_all()

__all__ = [
    "IMPLEMENTATIONS",
    "QuantizedWeight",
    "available_implementations",
    "cross_entropy",
    "dot_product_attention",
    "export_disabled_checks",
    "geglu",
    "gelu",
    "implementation",
    "layer_norm",
    "linear",
    "linear_cross_entropy",
    "paged_attention",
    "paged_attention_with_update",
    "paged_kv_update",
    "quantize_kv",
    "quantize_weight",
    "relu",
    "rms_norm",
    "rope",
    "sigmoid",
    "silu",
    "softmax",
    "swiglu",
]
