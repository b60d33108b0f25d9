"""The Gemma forward pass, its logits and its training loss."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import jaxgpu
from jaxgpu.models.gemma import layers, sharding
from jaxgpu.models.gemma.config import Config
from jaxgpu.models.gemma.params import check_params

# The label cross_entropy skips: targets where `mask` is False are replaced by it.
IGNORE_INDEX = -1


def check_tokens(tokens, name: str = "tokens"):
  """tokens as a (B, T) int32 array; ValueError naming `name` otherwise."""
  if not hasattr(tokens, "shape") or not hasattr(tokens, "dtype"):
    tokens = jnp.asarray(tokens)
  if not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"{name}: expected an integer dtype (int32), got {tokens.dtype}")
  if tokens.ndim != 2:
    raise ValueError(f"{name}: expected shape (B, T), got {tuple(tokens.shape)}")
  return tokens.astype(jnp.int32)


def check_like(value, name: str, tokens, *, integer: bool = True):
  """`value` (positions, segment ids, targets, mask) of the shape of tokens, or None."""
  if value is None:
    return None
  if not hasattr(value, "shape") or not hasattr(value, "dtype"):
    value = jnp.asarray(value)
  if tuple(value.shape) != tuple(tokens.shape):
    raise ValueError(f"{name}: expected the shape of tokens {tuple(tokens.shape)}, got "
                     f"{tuple(value.shape)}")
  if integer and not jnp.issubdtype(value.dtype, jnp.integer):
    raise ValueError(f"{name}: expected an integer dtype (int32), got {value.dtype}")
  return value.astype(jnp.int32) if integer else value


def default_positions(tokens):
  """0, 1, ..., T - 1 for every row of (B, T) tokens."""
  b, t = tokens.shape
  return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


def self_attend(config: Config, layer: int, implementation, mesh, segment_ids):
  """The attention of training and prefill: causal, the layer's window, packed segments.
  Returns (o, (k, v)) with k, v as given (before any repeat), for a KV cache."""
  def attend(q, k, v):
    kk, vv = k, v
    repeat = sharding.kv_repeat(config, mesh)
    if repeat > 1:
      # A model axis that does not divide the kv heads: repeat them so that each model
      # shard holds whole kv groups (sharding.py); the math is unchanged.
      kk, vv = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
    heads = sharding.MODEL if sharding.heads_sharded(config, mesh) else None
    kk = sharding.constrain(kk, mesh, sharding.batch_axis(mesh), None, heads, None)
    vv = sharding.constrain(vv, mesh, sharding.batch_axis(mesh), None, heads, None)
    o = layers.attention(q, kk, vv, config=config, layer=layer, implementation=implementation,
                         is_causal=True, windowed=config.is_local(layer),
                         q_segment_ids=segment_ids, kv_segment_ids=segment_ids)
    return o, (k, v)
  return attend


def trunk(params, config: Config, tokens, positions, attend_for, *, implementation=None,
          mesh=None, remat: bool = False):
  """Embedding, the decoder layers and the final norm.

  attend_for(layer) gives the layer's attention function (see layers.block). With remat,
  each layer is a jax.checkpoint: its activations are recomputed in the backward pass
  instead of kept (the layer's inputs h, d are what stays), so long sequences fit.

  Returns:
    ((B, T, D) final-normed hidden states in the parameters' dtype, [extra per layer]).
  """
  h = layers.embed(sharding.gather_embed(params["embed"], config, mesh), tokens)
  h = sharding.constrain(h, mesh, sharding.batch_axis(mesh), None, None)
  d = None
  extras = []

  def layer(p, h, d, positions, *, i):
    # Under remat, the fsdp all-gather of the layer's weights is recomputed too: only one
    # layer's gathered weights are live at a time.
    return layers.block(sharding.gather_layer(p, config, mesh), h, d, positions,
                        attend=attend_for(i), config=config, layer=i,
                        implementation=implementation, mesh=mesh)

  for i, p in enumerate(params["layers"]):
    fn = functools.partial(layer, i=i)
    if remat:
      fn = jax.checkpoint(fn)
    h, d, extra = fn(p, h, d, positions)
    extras.append(extra)
  pointwise = layers.pointwise_implementation(implementation, tokens.shape[0] * tokens.shape[1])
  y, _ = layers.rms_norm(d, params["final_norm"], config, pointwise, residual=h)
  return y, extras


def _prepare(params, config, tokens, positions, segment_ids):
  check_params(params, config)
  tokens = check_tokens(tokens)
  positions = check_like(positions, "positions", tokens)
  segment_ids = check_like(segment_ids, "segment_ids", tokens)
  if positions is None:
    positions = default_positions(tokens)
  return tokens, positions, segment_ids


def hidden_states(params, config: Config, tokens, *, positions=None, segment_ids=None,
                  implementation=None, mesh=None, remat: bool = False):
  """(B, T, D) final-normed hidden states (before the output projection), params' dtype.
  Arguments as `forward`."""
  tokens, positions, segment_ids = _prepare(params, config, tokens, positions, segment_ids)
  attend_for = lambda i: self_attend(config, i, implementation, mesh, segment_ids)
  y, _ = trunk(params, config, tokens, positions, attend_for, implementation=implementation,
               mesh=mesh, remat=remat)
  return y


def softcap(x, cap):
  return x if cap is None else cap * jnp.tanh(x / cap)


def output_logits(y, params, config: Config, mesh=None):
  """Float32 logits of hidden states y (..., D): the tied embedding as output projection
  (float32 accumulation and result), then the final softcap."""
  table = sharding.gather_embed(params["embed"], config, mesh)
  z = jnp.einsum("...d,vd->...v", y, table, preferred_element_type=jnp.float32)
  return softcap(z, config.final_logit_softcap)


def forward(params, config: Config, tokens, *, positions=None, segment_ids=None,
            implementation=None, mesh=None, remat: bool = False):
  """The Gemma language model: logits for every position.

  Args:
    params: the parameter pytree (jaxgpu/models/gemma/params.py); its dtype (bfloat16 or
      float32) is the activations' dtype.
    config: the model's Config.
    tokens: (B, T) int32 token ids.
    positions: (B, T) int32 positions for RoPE; default 0..T-1 in every row. Packed
      sequences pass each segment's own positions (restarting at 0).
    segment_ids: (B, T) int32 or None: a token attends only to earlier tokens of its own
      segment (packed sequences); by convention 0 marks padding.
    implementation: None (jaxgpu's kernels; at most layers.XLA_FUSES_UP_TO_TOKENS tokens,
      the pointwise ops are left to XLA) or 'xla' (jaxgpu's pure-JAX references, and
      `layers.xla_attention` for attention); 'cpu' / 'cuda' force every kernel of one
      platform.
    mesh: a Mesh with axes ("data", "model") to constrain activations for data / tensor
      parallelism (sharding.py); None for none.
    remat: recompute each layer's activations in the backward pass (jax.checkpoint).

  Returns:
    (B, T, V) float32 logits, after Gemma 2's final softcap.

  Raises ValueError naming the argument for tokens that are not a (B, T) integer array,
  positions / segment ids of another shape, or parameters of the wrong shape.
  """
  y = hidden_states(params, config, tokens, positions=positions, segment_ids=segment_ids,
                    implementation=implementation, mesh=mesh, remat=remat)
  z = output_logits(y, params, config, mesh)
  return sharding.constrain(z, mesh, sharding.batch_axis(mesh), None, None)


def loss(params, config: Config, tokens, targets, *, mask=None, positions=None,
         segment_ids=None, implementation=None, mesh=None, remat: bool = False):
  """Mean next-token cross-entropy, through jaxgpu.linear_cross_entropy.

  The output projection (the tied embedding) and the cross-entropy are one op: the
  (B, T, V) logits are never held (they are formed chunk by chunk of the vocabulary, in
  the parameters' dtype with float32 accumulation, and recomputed in the backward pass),
  and the final softcap (Gemma 2) is applied inside it (logit_softcap=).

  Args:
    tokens: (B, T) int32 inputs; targets: (B, T) int32 labels (usually tokens shifted by
      one), in [0, vocab_size) where counted.
    mask: (B, T) bool (or 0/1) or None: which positions count; the mean is over them.
      Positions whose segment id is 0 (padding) never count.
    positions, segment_ids, implementation, mesh, remat: as `forward`.

  Returns:
    A float32 scalar.
  """
  tokens, positions, segment_ids = _prepare(params, config, tokens, positions, segment_ids)
  targets = check_like(targets, "targets", tokens)
  mask = check_like(mask, "mask", tokens, integer=False)
  attend_for = lambda i: self_attend(config, i, implementation, mesh, segment_ids)
  y, _ = trunk(params, config, tokens, positions, attend_for, implementation=implementation,
               mesh=mesh, remat=remat)
  if segment_ids is not None:
    real = segment_ids != 0
    mask = real if mask is None else mask.astype(bool) & real
  ignore = None
  if mask is not None:
    targets = jnp.where(mask.astype(bool), targets, IGNORE_INDEX)
    ignore = IGNORE_INDEX
  # The tied embedding (V, D) as stored is the output projection: w_layout="vd".
  table = sharding.gather_embed(params["embed"], config, mesh)
  return jaxgpu.linear_cross_entropy(y, table, targets, w_layout="vd", ignore_index=ignore,
                                     logit_softcap=config.final_logit_softcap, reduction="mean",
                                     implementation=implementation)
