"""The parameter pytree of a Gemma model: its shapes, a random initialization, a check.

Layout (shared with the checkpoint loader; D = d_model, N = n_heads, K = n_kv_heads,
H = head_dim, F = ffn_dim, V = vocab_size):

  {"embed": (V, D),                 # HF model.embed_tokens.weight, tied to the output
   "final_norm": (D,),              # HF model.norm.weight
   "layers": [{                     # one dict per layer, in order
       "attn_pre_norm", "attn_post_norm", "mlp_pre_norm", "mlp_post_norm": (D,),
       "q": (D, N, H), "k": (D, K, H), "v": (D, K, H), "o": (N, H, D),
       "q_norm", "k_norm": (H,),    # Gemma 3 only (config.qk_norm)
       "gate", "up": (D, F), "down": (F, D)}, ...]}

Norm weights are stored as HF stores them: the model scales by (1 + w).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import jaxgpu
from jaxgpu.models.gemma import quantize
from jaxgpu.models.gemma.config import Config

NORMS = ("attn_pre_norm", "attn_post_norm", "mlp_pre_norm", "mlp_post_norm")


def layer_shapes(config: Config) -> dict[str, tuple[int, ...]]:
  """{name: shape} of one layer's parameters."""
  d, n, k, h, f = (config.d_model, config.n_heads, config.n_kv_heads, config.head_dim,
                   config.ffn_dim)
  shapes = {name: (d,) for name in NORMS}
  shapes.update(q=(d, n, h), k=(d, k, h), v=(d, k, h), o=(n, h, d),
                gate=(d, f), up=(d, f), down=(f, d))
  if config.qk_norm:
    shapes.update(q_norm=(h,), k_norm=(h,))
  return shapes


def param_shapes(config: Config) -> dict:
  """The parameter pytree with each leaf replaced by its shape tuple."""
  return {"embed": (config.vocab_size, config.d_model), "final_norm": (config.d_model,),
          "layers": [layer_shapes(config) for _ in range(config.n_layers)]}


def init_params(config: Config, key, dtype=jnp.bfloat16) -> dict:
  """Random parameters as Hugging Face initializes Gemma: every matrix (and the embedding)
  normal with std 0.02 (HF initializer_range), every norm weight 0 (a scale of 1 + 0).

  Args:
    config: the model.
    key: a jax.random key.
    dtype: the parameters' dtype (bfloat16 by default; float32 for exact CPU tests). The
      activations take this dtype too.

  Returns:
    The parameter pytree (see the module docstring), every leaf of `dtype`.
  """
  return _init(config, key, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _normal(key, shape, dtype):
  return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def _init(config: Config, key, dtype):
  # One small jitted draw per matrix, compiled once per distinct shape (a handful: layers
  # repeat). A single jit over the whole pytree compiled for minutes at gemma2_2b's size on
  # an H100 (XLA's "very slow compile" alarm), and one random generator per matrix inside
  # one program compiled for seconds even at the tiny size.
  shapes = param_shapes(config)
  leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda s: isinstance(s, tuple))
  keys = jax.random.split(key, len(leaves))
  out = [_normal(k, s, dtype) if len(s) > 1 else jnp.zeros(s, dtype)
         for k, s in zip(keys, leaves)]
  return jax.tree.unflatten(treedef, out)


def check_params(params, config: Config) -> None:
  """Raises ValueError naming the first parameter whose presence, shape or dtype is wrong
  (every leaf must have the dtype of params["embed"]; norm weights may also be float32,
  which the norms take beside 16-bit activations: float32 master weights cast for compute
  by train.compute_params)."""
  if not isinstance(params, dict) or "embed" not in params:
    raise ValueError("params: expected a dict with 'embed', 'final_norm' and 'layers'")
  dtype = params["embed"].dtype
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"params['embed']: expected a float dtype, got {dtype}")
  expected = param_shapes(config)
  layers = params.get("layers")
  if not isinstance(layers, (list, tuple)) or len(layers) != config.n_layers:
    got = len(layers) if isinstance(layers, (list, tuple)) else type(layers).__name__
    raise ValueError(f"params['layers']: expected a list of {config.n_layers} layers, got {got}")

  def check(path, a, shape, name=None):
    if a is None:
      raise ValueError(f"params{path}: missing")
    if isinstance(a, jaxgpu.QuantizedWeight) and (name in quantize.CONTRACTED or
                                                  name in quantize.FUSED):
      # A quantized projection (quantize.py): its matrix form (a fused one's shape is
      # already that), scales in the params' dtype.
      if name in quantize.CONTRACTED:
        shape = quantize.matrix_shape(name, shape)
      if tuple(a.shape) != tuple(shape):
        raise ValueError(f"params{path}: expected a quantized {shape} matrix, got "
                         f"{tuple(a.shape)}")
      if a.scales.dtype != dtype:
        raise ValueError(f"params{path}: expected scales of dtype {dtype}, got "
                         f"{a.scales.dtype}")
      return
    if tuple(a.shape) != shape:
      raise ValueError(f"params{path}: expected shape {shape}, got {tuple(a.shape)}")
    if a.dtype != dtype and not (len(shape) == 1 and a.dtype == jnp.float32):
      raise ValueError(f"params{path}: expected dtype {dtype} (that of params['embed']), "
                       f"got {a.dtype}")

  for name in ("embed", "final_norm"):
    check(f"[{name!r}]", params.get(name), expected[name])
  for i, (layer, shapes) in enumerate(zip(layers, expected["layers"])):
    shapes = quantize.fused_shapes(shapes, layer)
    extra = set(layer) - set(shapes)
    if extra:
      raise ValueError(f"params['layers'][{i}]: unexpected entries {sorted(extra)}")
    for name, shape in shapes.items():
      check(f"['layers'][{i}][{name!r}]", layer.get(name), shape, name)
