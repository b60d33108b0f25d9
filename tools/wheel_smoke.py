"""Smoke test of an installed jaxgpu (a wheel, with no source tree in reach): every public op
once on the CPU, its 'cpu' kernel against its 'xla' reference. Run it from a folder outside
the repository:

    cd /tmp && python /path/to/tools/wheel_smoke.py

Exits 1 on a mismatch, and when an op declared by a family was not called.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxgpu  # noqa: E402
from jaxgpu import _family  # noqa: E402


def main() -> int:
  here = os.path.dirname(os.path.abspath(jaxgpu.__file__))
  if os.path.exists(os.path.join(here, "..", "pyproject.toml")):
    print(f"jaxgpu is imported from a source tree ({here}), not an installed wheel")
    return 1
  rng = np.random.default_rng(0)
  f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  x, w = f32(4, 64), f32(64)
  q, k, v = f32(2, 8, 4, 16), f32(2, 8, 2, 16), f32(2, 8, 2, 16)
  pages = f32(6, 8, 2, 16)
  table = jnp.asarray([[0, 1, 2], [3, 4, 5]], jnp.int32)
  lengths = jnp.asarray([5, 17], jnp.int32)
  calls = {
      "rms_norm": (lambda impl: jaxgpu.rms_norm(x, w, implementation=impl)),
      "layer_norm": (lambda impl: jaxgpu.layer_norm(x, w, w, implementation=impl)),
      "softmax": (lambda impl: jaxgpu.softmax(x, implementation=impl)),
      "gelu": (lambda impl: jaxgpu.gelu(x, implementation=impl)),
      "silu": (lambda impl: jaxgpu.silu(x, implementation=impl)),
      "relu": (lambda impl: jaxgpu.relu(x, implementation=impl)),
      "sigmoid": (lambda impl: jaxgpu.sigmoid(x, implementation=impl)),
      "swiglu": (lambda impl: jaxgpu.swiglu(x, x * 2, implementation=impl)),
      "geglu": (lambda impl: jaxgpu.geglu(x, x * 2, implementation=impl)),
      "rope": (lambda impl: jaxgpu.rope(q, jnp.arange(8)[None].repeat(2, 0),
                                        implementation=impl)),
      "cross_entropy": (lambda impl: jaxgpu.cross_entropy(
          x, jnp.arange(4, dtype=jnp.int32), implementation=impl)),
      "linear_cross_entropy": (lambda impl: jaxgpu.linear_cross_entropy(
          x, f32(37, 64), jnp.arange(4, dtype=jnp.int32) * 9, label_smoothing=0.1,
          implementation=impl)),
      "dot_product_attention": (lambda impl: jaxgpu.dot_product_attention(
          q, k, v, is_causal=True, implementation=impl)),
      "paged_attention": (lambda impl: jaxgpu.paged_attention(
          q[:, :2], pages, pages, table, lengths, implementation=impl)),
      "paged_kv_update": (lambda impl: jaxgpu.paged_kv_update(
          pages, pages, k[:, :2], v[:, :2], table, jnp.stack([lengths - 2, lengths - 1], 1),
          implementation=impl)[0]),
      "paged_attention_with_update": (lambda impl: jaxgpu.paged_attention_with_update(
          q[:, :2], pages, pages, k[:, :2], v[:, :2], table, lengths, implementation=impl)[0]),
      "linear": (lambda impl: jaxgpu.linear(x, f32(64, 24), f32(24), activation="gelu",
                                            implementation=impl)
                 + jaxgpu.linear(x, jaxgpu.quantize_weight(f32(64, 24), bits=4, group_size=32),
                                 implementation=impl)),
  }
  bad = []
  missing = set(_family.all_ops()) - set(calls)
  if missing:
    bad.append(f"ops declared but not smoke-tested: {sorted(missing)}")
  for name, fn in calls.items():
    outs = {}
    for impl in ("cpu", "xla"):
      rng = np.random.default_rng(1)  # f32 reads it: the same inputs for both
      outs[impl] = fn(impl)
    err = float(jnp.max(jnp.abs(outs["cpu"] - outs["xla"])))
    ok = err <= 1e-4 * max(1.0, float(jnp.max(jnp.abs(outs["xla"]))))
    print(f"{'ok  ' if ok else 'FAIL'} {name}: max |cpu - xla| {err:.2e}")
    if not ok:
      bad.append(name)
  print(f"jaxgpu {jaxgpu.__version__} from {here}, jax {jax.__version__}")
  if bad:
    print(f"FAILED: {bad}")
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
