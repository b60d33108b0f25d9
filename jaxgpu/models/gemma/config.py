"""Gemma 2 / Gemma 3 (text) hyperparameters: one frozen Config, with the published presets.

Field names are shared with the checkpoint loader (jaxgpu/models/gemma/checkpoint.py), which
maps a Hugging Face config.json onto them; the HF name is given where it differs.
"""

from __future__ import annotations

import dataclasses
import math

LAYER_TYPES = ("local", "global")


def gemma2_layer_types(n_layers: int) -> tuple[str, ...]:
  """Gemma 2's pattern: even layers slide (local), odd layers are global (HF: layer i is
  "sliding_attention" when (i + 1) % 2 != 0)."""
  return tuple("local" if i % 2 == 0 else "global" for i in range(n_layers))


def gemma3_layer_types(n_layers: int, period: int = 6) -> tuple[str, ...]:
  """Gemma 3's pattern: every `period`-th layer is global, the others slide (HF
  sliding_window_pattern = 6: layers 5, 11, 17, ... are global, 5 local : 1 global)."""
  return tuple("global" if (i + 1) % period == 0 else "local" for i in range(n_layers))


@dataclasses.dataclass(frozen=True)
class Config:
  """A Gemma 2 or Gemma 3 text model. Hashable (a static argument of the jitted functions).

  Fields (HF config.json names in brackets where they differ):
    version: 2 or 3.
    vocab_size, d_model [hidden_size], n_layers [num_hidden_layers], n_heads
      [num_attention_heads], n_kv_heads [num_key_value_heads], head_dim, ffn_dim
      [intermediate_size].
    query_pre_attn_scalar: attention logits are scaled by query_pre_attn_scalar ** -0.5.
    sliding_window: a local layer's query at position i sees keys i - sliding_window < j <= i.
    layer_types: "local" or "global" for each layer (len n_layers).
    rope_theta_global [rope_theta], rope_theta_local [Gemma 3: rope_local_base_freq; Gemma 2:
      rope_theta]: RoPE bases of global and local layers.
    rope_scale_global: linear RoPE scaling factor of the global layers (positions are divided
      by it; HF rope_scaling {"rope_type": "linear", "factor": ...}); 1.0 for none.
    attn_logit_softcap [attn_logit_softcapping], final_logit_softcap
      [final_logit_softcapping]: c * tanh(x / c) on the attention logits / the output logits,
      or None (Gemma 2: 50 and 30; Gemma 3: None).
    qk_norm: RMSNorm of each query and key head before RoPE (Gemma 3).
    rms_eps [rms_norm_eps], max_seq_len [max_position_embeddings], eos_token_id (the end
      token `generate` stops at by default), pad_token_id.
  """

  version: int
  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  ffn_dim: int
  query_pre_attn_scalar: float
  sliding_window: int
  layer_types: tuple[str, ...]
  rope_theta_global: float = 10_000.0
  rope_theta_local: float = 10_000.0
  rope_scale_global: float = 1.0
  attn_logit_softcap: float | None = None
  final_logit_softcap: float | None = None
  qk_norm: bool = False
  rms_eps: float = 1e-6
  max_seq_len: int = 8192
  eos_token_id: int = 1
  pad_token_id: int = 0

  def __post_init__(self):
    object.__setattr__(self, "layer_types", tuple(self.layer_types))
    if self.version not in (2, 3):
      raise ValueError(f"Config: version must be 2 or 3, got {self.version!r}")
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                 "ffn_dim", "sliding_window", "max_seq_len"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Config: {name} must be a positive int, got {value!r}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"Config: n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
                       f"({self.n_kv_heads})")
    if self.head_dim % 2:
      raise ValueError(f"Config: head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
    if len(self.layer_types) != self.n_layers:
      raise ValueError(f"Config: layer_types has {len(self.layer_types)} entries, expected "
                       f"n_layers = {self.n_layers}")
    bad = [t for t in self.layer_types if t not in LAYER_TYPES]
    if bad:
      raise ValueError(f"Config: layer_types entries must be in {LAYER_TYPES}, got {bad[0]!r}")
    for name in ("query_pre_attn_scalar", "rope_theta_global", "rope_theta_local",
                 "rope_scale_global", "rms_eps"):
      value = getattr(self, name)
      if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"Config: {name} must be a positive finite number, got {value!r}")
    for name in ("attn_logit_softcap", "final_logit_softcap"):
      value = getattr(self, name)
      if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value)
                                    and value > 0):
        raise ValueError(f"Config: {name} must be None or a positive finite number, "
                         f"got {value!r}")
    for name in ("eos_token_id", "pad_token_id"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"Config: {name} must be an int, got {value!r}")

  # ---- per-layer facts --------------------------------------------------------------------

  def is_local(self, layer: int) -> bool:
    return self.layer_types[layer] == "local"

  def rope_theta(self, layer: int) -> float:
    return self.rope_theta_local if self.is_local(layer) else self.rope_theta_global

  def rope_scale(self, layer: int) -> float:
    return 1.0 if self.is_local(layer) else self.rope_scale_global

  # ---- presets ----------------------------------------------------------------------------

  @classmethod
  def gemma2_2b(cls) -> Config:
    """google/gemma-2-2b (config.json of the HF checkpoint)."""
    return cls(version=2, vocab_size=256_000, d_model=2304, n_layers=26, n_heads=8,
               n_kv_heads=4, head_dim=256, ffn_dim=9216, query_pre_attn_scalar=256.0,
               sliding_window=4096, layer_types=gemma2_layer_types(26),
               rope_theta_global=10_000.0, rope_theta_local=10_000.0,
               attn_logit_softcap=50.0, final_logit_softcap=30.0, qk_norm=False,
               max_seq_len=8192)

  @classmethod
  def gemma3_1b(cls) -> Config:
    """google/gemma-3-1b-pt / -it (text only; no RoPE scaling)."""
    return cls(version=3, vocab_size=262_144, d_model=1152, n_layers=26, n_heads=4,
               n_kv_heads=1, head_dim=256, ffn_dim=6912, query_pre_attn_scalar=256.0,
               sliding_window=512, layer_types=gemma3_layer_types(26),
               rope_theta_global=1_000_000.0, rope_theta_local=10_000.0, qk_norm=True,
               max_seq_len=32_768)

  @classmethod
  def gemma3_4b(cls) -> Config:
    """google/gemma-3-4b-pt / -it, the text model (HF text_config). Its vocabulary is
    262208 (HF Gemma3TextConfig's default, which the checkpoint keeps: the 262144 text
    tokens plus the image tokens' rows); global layers use linear RoPE scaling by 8."""
    return cls(version=3, vocab_size=262_208, d_model=2560, n_layers=34, n_heads=8,
               n_kv_heads=4, head_dim=256, ffn_dim=10_240, query_pre_attn_scalar=256.0,
               sliding_window=1024, layer_types=gemma3_layer_types(34),
               rope_theta_global=1_000_000.0, rope_theta_local=10_000.0,
               rope_scale_global=8.0, qk_norm=True, max_seq_len=131_072)

  @classmethod
  def tiny(cls, version: int = 2) -> Config:
    """A few-layer model for CPU tests: both layer types, a window of 8 (so short test
    sequences already exceed it), GQA (Gemma 2) or MQA (Gemma 3, like gemma3_1b), the
    version's softcaps / query-key norm, vocabulary 512."""
    if version == 2:
      return cls(version=2, vocab_size=512, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2,
                 head_dim=16, ffn_dim=128, query_pre_attn_scalar=16.0, sliding_window=8,
                 layer_types=gemma2_layer_types(3), attn_logit_softcap=50.0,
                 final_logit_softcap=30.0, max_seq_len=1024)
    if version == 3:
      return cls(version=3, vocab_size=512, d_model=64, n_layers=3, n_heads=4, n_kv_heads=1,
                 head_dim=16, ffn_dim=128, query_pre_attn_scalar=16.0, sliding_window=8,
                 layer_types=gemma3_layer_types(3, period=3), rope_theta_global=1_000_000.0,
                 rope_theta_local=10_000.0, qk_norm=True, max_seq_len=1024)
    raise ValueError(f"Config.tiny: version must be 2 or 3, got {version!r}")
