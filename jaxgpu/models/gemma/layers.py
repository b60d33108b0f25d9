"""The pieces of a Gemma decoder layer, written once for both implementations.

Every jaxgpu op is called with the caller's `implementation` (None: jaxgpu's kernels;
'xla': jaxgpu's pure-JAX references, which XLA fuses), but for a small step's pointwise ops
under the default (pointwise_implementation). Attention is the one place where the
'xla' path is not jaxgpu's reference: there it is what a careful JAX user writes without
jaxgpu (`xla_attention`).

Semantics follow Hugging Face transformers' Gemma2/Gemma3 (eager attention):
  * embedding * sqrt(d_model), the factor rounded to the activation dtype first (HF casts
    its embed_scale to the weights' dtype: sqrt(1152) is 34.0 in bfloat16);
  * RMSNorm in float32 with the scale (1 + w), rounded to the input dtype after the scale;
  * x -> pre-norm -> attention -> post-norm -> + residual -> pre-norm -> MLP -> post-norm
    -> + residual, the residual adds in the activation dtype;
  * q, k, v projections; Gemma 3: RMSNorm of every query and key head; RoPE with the
    'half' (rotate_half) pairing at the layer's theta; logits * query_pre_attn_scalar^-0.5,
    then Gemma 2's softcap c * tanh(logits / c), then the causal / sliding-window mask
    (key j visible to query i when i - sliding_window < j <= i on local layers), GQA;
  * MLP: down(gelu_tanh(gate(x)) * up(x)).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

import jaxgpu
from jaxgpu import _implementation
from jaxgpu.models.gemma import quantize, sharding
from jaxgpu.models.gemma.config import Config
from jaxgpu.reference import attention as reference_attention

_CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

# A jaxgpu custom call is always a kernel of its own. At a handful of rows its floor is
# above what XLA spends on the same reference, which it fuses (and often merges into a
# neighbouring fusion): in a fori_loop chain of one-row calls on an H200, rms_norm 2.50 us
# against XLA's 0.99, RoPE 1.95 against 0.86, gelu 1.54 against 0.86. So with the default
# implementation a step of at most this many tokens (a decode step's batch) runs the norms,
# RoPE and the gated unit as XLA fusions of jaxgpu's references; attention, the KV cache
# and quantized projections keep jaxgpu's kernels. An explicit implementation ('cuda',
# 'cpu') is obeyed everywhere.
XLA_FUSES_UP_TO_TOKENS = 64


def pointwise_implementation(implementation, tokens: int):
  """The implementation for a step's norms, RoPE and gated unit over `tokens` rows (batch x
  sequence): 'xla' for a small step under the default, else `implementation`."""
  if tokens <= XLA_FUSES_UP_TO_TOKENS and _implementation.resolve(implementation) is None:
    return "xla"
  return implementation


def rms_norm(x, weight, config: Config, implementation, residual=None):
  """Gemma's RMSNorm (scale 1 + weight, statistics in float32) over the last axis; with a
  residual, (y, h) where h = x + residual is the new residual stream (jaxgpu.rms_norm)."""
  return jaxgpu.rms_norm(x, weight, residual=residual, eps=config.rms_eps, weight_offset=1.0,
                         implementation=implementation)


def embed(table, tokens):
  """(B, T) int tokens -> (B, T, D) embeddings * sqrt(D), in the table's dtype."""
  scale = jnp.asarray(math.sqrt(table.shape[1]), table.dtype)
  return jnp.take(table, tokens, axis=0) * scale


def rope(x, positions, config: Config, layer: int, implementation):
  """x (B, T, heads, H) rotated at int32 positions (B, T) with the layer's theta ('half'
  layout, HF's rotate_half).

  With linear scaling (Gemma 3 4b's global layers) the angle is position / factor *
  inv_freq: jaxgpu.rope takes integer positions only, so those layers compute the rotation
  here in float32 as HF does (float32 angles, which lose accuracy at large positions the
  way HF's do); every other layer uses jaxgpu.rope."""
  theta, scale = config.rope_theta(layer), config.rope_scale(layer)
  if scale == 1.0:
    return jaxgpu.rope(x, positions, theta=theta, layout="half", implementation=implementation)
  h = x.shape[-1]
  inv_freq = (1.0 / theta ** (np.arange(0, h, 2, dtype=np.float64) / h) / scale)
  angle = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
  cos, sin = jnp.cos(angle)[..., None, :], jnp.sin(angle)[..., None, :]
  xf = x.astype(jnp.float32)
  a, b = xf[..., :h // 2], xf[..., h // 2:]
  return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1).astype(x.dtype)


def xla_attention(q, k, v, *, scale, is_causal=False, window=None, softcap=None,
                  q_segment_ids=None, kv_segment_ids=None):
  """The 'xla' path's attention: what a careful JAX user writes without jaxgpu.

  * With a logit softcap (Gemma 2), which neither jax.nn.dot_product_attention nor cuDNN
    can apply: the plain einsum / float32 softmax formulation
    (jaxgpu.reference.attention.dot_product_attention, which XLA fuses).
  * Otherwise jax.nn.dot_product_attention (causal, window, segment ids as its boolean
    mask; GQA without repeating k and v). On a GPU with 16-bit inputs and more than one
    query per row it asks for cuDNN's fused kernel (implementation='cudnn'), the fastest
    choice where cuDNN supports the options, and uses jax.nn's XLA implementation where
    cuDNN refuses them at trace time. A single query per row (decoding) is a
    matrix-vector product, which XLA's implementation runs at memory speed.

  q (B, T, N, H); k, v (B, S, K, H); segment ids (B, T) / (B, S) int32 or None. Returns
  (B, T, N, H) in q's dtype.
  """
  if softcap is not None:
    return reference_attention.dot_product_attention(
        q, k, v, scale=scale, is_causal=is_causal, local_window_size=window,
        logit_softcap=softcap, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
  mask = None
  if q_segment_ids is not None:
    mask = q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :]
  kw = dict(mask=mask, scale=scale, is_causal=is_causal, local_window_size=window)
  if (jax.default_backend() == "gpu" and jnp.dtype(q.dtype) in _CUDNN_DTYPES
      and q.shape[1] > 1):
    try:
      return jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **kw)
    except (ValueError, NotImplementedError, RuntimeError, TypeError):
      pass  # options or shapes cuDNN does not take: jax.nn's XLA implementation below
  return jax.nn.dot_product_attention(q, k, v, implementation="xla", **kw)


def attention(q, k, v, *, config: Config, layer: int, implementation, is_causal: bool,
              windowed: bool, q_segment_ids=None, kv_segment_ids=None):
  """Gemma attention of q (B, T, N, H) over k, v (B, S, K, H): scale
  query_pre_attn_scalar^-0.5, the config's softcap, causal (top-left aligned) and, when
  `windowed`, the sliding window (keys i - sliding_window < j <= i). jaxgpu's fused kernel,
  or `xla_attention` on the 'xla' path."""
  kw = dict(scale=config.query_pre_attn_scalar ** -0.5, is_causal=is_causal,
            softcap=config.attn_logit_softcap,
            window=(config.sliding_window - 1, 0) if windowed else None,
            q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
  if _implementation.resolve(implementation) == "xla":
    return xla_attention(q, k, v, **kw)
  return jaxgpu.dot_product_attention(
      q, k, v, scale=kw["scale"], is_causal=is_causal, local_window_size=kw["window"],
      logit_softcap=kw["softcap"], q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
      implementation=implementation)


def paged_attention_with_update(q, k, v, k_pages, v_pages, block_table, lengths, *,
                                config: Config, layer: int, implementation):
  """Gemma attention of one decoding step over a paged KV cache, the step's own keys and
  values k, v (B, 1, K, H) written at lengths - 1 in the same call
  (jaxgpu.paged_attention_with_update): (o, k_pages, v_pages). The options of `attention`
  for a query at position lengths - 1; the op's window keeps keys p - w .. p, so the
  model's i - sliding_window < j <= i is w = sliding_window - 1, the same pair `attention`
  gives jaxgpu.dot_product_attention."""
  return jaxgpu.paged_attention_with_update(
      q, k_pages, v_pages, k, v, block_table, lengths, scale=config.query_pre_attn_scalar ** -0.5,
      logit_softcap=config.attn_logit_softcap,
      local_window_size=config.sliding_window - 1 if config.is_local(layer) else None,
      implementation=implementation)


def project(x, w, equation: str, out_dims: tuple[int, ...], contracted: int, implementation):
  """x contracted with a projection weight: jnp.einsum(equation, x, w) for a dense w; for
  a jaxgpu.QuantizedWeight (quantize.py), jaxgpu.linear over x's last `contracted` dims
  flattened, the result reshaped to (..., *out_dims)."""
  if isinstance(w, jaxgpu.QuantizedWeight):
    lead = x.shape[:x.ndim - contracted]
    y = jaxgpu.linear(x.reshape(lead + (-1,)), w, implementation=implementation)
    return y.reshape(lead + tuple(out_dims))
  return jnp.einsum(equation, x, w)


def project_fused(x, w, out_dims: tuple[tuple[int, ...], ...], implementation):
  """x (..., D) through a fused QuantizedWeight (quantize.FUSED: the parts' matrices
  concatenated along N): one jaxgpu.linear, its columns split into each part's
  (..., *out_dims[i])."""
  y = jaxgpu.linear(x, w, implementation=implementation)
  parts = quantize.split_columns(y, [math.prod(dims) for dims in out_dims])
  return [part.reshape(x.shape[:-1] + tuple(dims)) for part, dims in zip(parts, out_dims)]


def mlp(p, y, config: Config, implementation, mesh=None, pointwise=None):
  """down(gelu_tanh(y @ gate) * (y @ up)) for y (B, T, D); the gated unit runs
  `pointwise` (pointwise_implementation's choice), the projections `implementation`."""
  ffn = sharding.MODEL if sharding.ffn_sharded(config, mesh) else None
  batch = sharding.batch_axis(mesh)
  f, d = config.ffn_dim, config.d_model
  if "gate_up" in p:
    gate, up = project_fused(y, p["gate_up"], ((f,), (f,)), implementation)
  else:
    gate = project(y, p["gate"], "btd,df->btf", (f,), 1, implementation)
    up = project(y, p["up"], "btd,df->btf", (f,), 1, implementation)
  gate = sharding.constrain(gate, mesh, batch, None, ffn)
  up = sharding.constrain(up, mesh, batch, None, ffn)
  a = jaxgpu.geglu(gate, up, approximate=True,
                   implementation=implementation if pointwise is None else pointwise)
  return project(a, p["down"], "btf,fd->btd", (d,), 1, implementation)


def block(p, h, d, positions, *, attend, config: Config, layer: int, implementation,
          mesh=None):
  """One decoder layer on the residual stream h + d.

  The stream is carried as two terms so that each add is fused into the norm that follows
  it (jaxgpu.rms_norm(x, w, residual=r) returns rms_norm(x + r) and x + r in one pass): the
  previous layer's post-MLP-norm output d is added to h by this layer's pre-attention norm,
  and the post-attention-norm output by the pre-MLP norm. The sums are rounded once to the
  activation dtype, as HF's `residual + hidden_states`. The post-norms themselves take no
  residual (HF normalizes the sublayer output alone, then adds).

  Args:
    p: the layer's parameters. h: (B, T, D) the residual stream so far. d: (B, T, D) the
      previous layer's output still to be added, or None (the first layer).
    positions: (B, T) int32, the tokens' positions (RoPE).
    attend: a function (q (B,T,N,H), k, v (B,T,K,H), post-RoPE) -> (o (B,T,N,H), extra):
      the attention itself (self-attention in training, the KV cache in decoding).

  Returns:
    (h, d, extra): the new stream h + d and whatever `attend` returned beside o.
  """
  impl = implementation
  pw = pointwise_implementation(implementation, h.shape[0] * h.shape[1])
  if d is None:
    y = rms_norm(h, p["attn_pre_norm"], config, pw)
  else:
    y, h = rms_norm(d, p["attn_pre_norm"], config, pw, residual=h)
  n, kv, hd = config.n_heads, config.n_kv_heads, config.head_dim
  if "qkv" in p:
    q, k, v = project_fused(y, p["qkv"], ((n, hd), (kv, hd), (kv, hd)), impl)
  else:
    q = project(y, p["q"], "btd,dnh->btnh", (n, hd), 1, impl)
    k = project(y, p["k"], "btd,dkh->btkh", (kv, hd), 1, impl)
    v = project(y, p["v"], "btd,dkh->btkh", (kv, hd), 1, impl)
  if config.qk_norm:
    q = rms_norm(q, p["q_norm"], config, pw)
    k = rms_norm(k, p["k_norm"], config, pw)
  q = rope(q, positions, config, layer, pw)
  k = rope(k, positions, config, layer, pw)
  heads = sharding.MODEL if sharding.heads_sharded(config, mesh) else None
  q = sharding.constrain(q, mesh, sharding.batch_axis(mesh), None, heads, None)
  o, extra = attend(q, k, v)
  attn = project(o, p["o"], "btnh,nhd->btd", (config.d_model,), 2, impl)
  a = rms_norm(attn, p["attn_post_norm"], config, pw)
  y, h = rms_norm(a, p["mlp_pre_norm"], config, pw, residual=h)
  d = rms_norm(mlp(p, y, config, impl, mesh, pointwise=pw), p["mlp_post_norm"], config, pw)
  return h, d, extra
