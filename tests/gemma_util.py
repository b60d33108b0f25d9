"""Helpers of the Gemma model tests: random parameters that exercise every path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpu.models import gemma


def random_params(config, seed: int, dtype=jnp.float32, qk_gain: float = 3.0,
                  embed_std: float = 0.4):
  """Parameters far from HF's init (whose norm weights are all 0 and whose logits are
  nearly uniform): matrices normal with std 1/sqrt(fan in) (q and k times qk_gain, so the
  attention logits are large enough for Gemma 2's softcap to matter), the embedding with
  std embed_std (0.4: logits of a few units; generation tests take 0.05, where the
  embedding, which is also the output projection, no longer makes the model repeat its
  input token), norm weights normal with std 0.3 (so (1 + w) is not 1)."""
  rng = np.random.default_rng(seed)

  def make(name, shape):
    if len(shape) == 1:
      a = 0.3 * rng.standard_normal(shape)
    elif name == "embed":
      a = embed_std * rng.standard_normal(shape)
    else:
      fan_in = shape[0] * shape[1] if name == "o" else shape[0]
      gain = qk_gain if name in ("q", "k") else 1.0
      a = gain / np.sqrt(fan_in) * rng.standard_normal(shape)
    return jnp.asarray(a, jnp.float32).astype(dtype)

  shapes = gemma.param_shapes(config)
  return {"embed": make("embed", shapes["embed"]),
          "final_norm": make("final_norm", shapes["final_norm"]),
          "layers": [{name: make(name, shape) for name, shape in layer.items()}
                     for layer in shapes["layers"]]}


def cast(tree, dtype):
  return jax.tree.map(lambda a: a.astype(dtype), tree)


def max_abs(a, b) -> float:
  return float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))
