"""Hugging Face Gemma 2 / Gemma 3 checkpoints <-> jaxgpu.models.gemma parameters.

A Hugging Face checkpoint folder holds config.json and the weights in safetensors files: one
`model.safetensors`, or shards listed by `model.safetensors.index.json` (its "weight_map"
names the file of every tensor). This module reads such a folder into the parameter pytree of
jaxgpu.models.gemma (the layout init_params builds; load_hf_checkpoint's docstring lists it)
and writes one back.

  config_from_hf(hf_dict) -> Config         config.json (Gemma 2, Gemma 3 text or multimodal)
  hf_config_from(config) -> dict            the inverse: a config.json for *ForCausalLM
  load_hf_checkpoint(path, config=None, dtype=None) -> (params, config)
  save_hf_checkpoint(params, config, path, max_shard_bytes=None)

Tensor names. Gemma2ForCausalLM / Gemma3ForCausalLM store the decoder under "model."
(model.embed_tokens.weight, model.layers.{i}.self_attn.q_proj.weight, ..., model.norm.weight);
the multimodal Gemma3ForConditionalGeneration under "language_model.model." (the hub
checkpoints' layout, which transformers 5.17's save_pretrained writes too) or
"model.language_model." (its module names since transformers 4.52, which a plain state-dict
dump has), next to a vision tower and a projector that a text model does not use. A bare
Gemma3TextModel has no prefix. The output projection is tied to the embedding
(tie_word_embeddings, true for every Gemma 2/3), so `lm_head.weight` is usually absent, and
ignored where present.

Layouts. torch.nn.Linear stores its weight as (out_features, in_features); the model keeps
the input dim first and splits the head dims out: q_proj (N*H, D) -> q (D, N, H), o_proj
(D, N*H) -> o (N, H, D), gate_proj / up_proj (F, D) -> (D, F), down_proj (D, F) -> (F, D).
Every Linear weight follows one rule, ours = W.T.reshape(our_shape) and back
W = x.reshape(reversed(hf_shape)).T, because HF flattens heads as n * H + h (the row-major
order of (N, H)). The embedding (nn.Embedding, (V, D)) and the norm weights are copied as
stored (the model applies 1 + w to the norms).

bfloat16. numpy has no bfloat16 of its own, and older safetensors releases cannot return one
through their numpy API; ml_dtypes (a jax dependency) provides the type. BF16 tensors are
therefore always read from their raw little-endian bytes (the file header gives the offsets)
and viewed as ml_dtypes.bfloat16, whatever the safetensors version; the other dtypes go
through safetensors' own numpy reader. Writing uses safetensors.numpy.save_file, which takes
ml_dtypes.bfloat16 arrays (it serializes the dtype by name, "bfloat16").

safetensors is an optional dependency (the `models` extra); it is imported when a checkpoint
is read or written, so `import jaxgpu.models.gemma` works without it.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Mapping

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxgpu.models.gemma.config import Config
from jaxgpu.models.gemma.params import layer_shapes

__all__ = ["config_from_hf", "hf_config_from", "load_hf_checkpoint", "save_hf_checkpoint"]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Shard names as transformers writes them (the same pattern lets a save remove stale shards).
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

_MODEL_TYPES = {"gemma2": 2, "gemma3_text": 3}
_ARCHITECTURES = {2: "Gemma2ForCausalLM", 3: "Gemma3ForCausalLM"}
_ACTIVATION = "gelu_pytorch_tanh"
_TO_KIND = {"sliding_attention": "local", "full_attention": "global"}
_TO_HF_KIND = {v: k for k, v in _TO_KIND.items()}

# Defaults of transformers' Gemma2Config and Gemma3TextConfig for keys a config.json may omit
# (transformers writes every model key, but the text_config of the multimodal Gemma 3 hub
# checkpoints lists only the keys that differ from Gemma3TextConfig's defaults). Gemma 2's
# model-size defaults changed once (early 4.4x releases defaulted to a 7B-like shape); these
# are the current ones, and Gemma 2 hub configs spell every size out anyway.
_DEFAULTS = {
  2: dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
          num_attention_heads=8, num_key_value_heads=4, head_dim=256,
          max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0,
          query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
          final_logit_softcapping=30.0, pad_token_id=0, eos_token_id=1),
  3: dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
          num_attention_heads=8, num_key_value_heads=4, head_dim=256,
          max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=1000000.0,
          rope_local_base_freq=10000.0, query_pre_attn_scalar=256, sliding_window=4096,
          attn_logit_softcapping=None, final_logit_softcapping=None, pad_token_id=0,
          eos_token_id=1, sliding_window_pattern=6),
}

# The Config fields this module sets; a comparison looks at these only.
_CONFIG_FIELDS = ("version", "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                  "head_dim", "ffn_dim", "query_pre_attn_scalar", "sliding_window",
                  "layer_types", "rope_theta_global", "rope_theta_local", "rope_scale_global",
                  "attn_logit_softcap", "final_logit_softcap", "qk_norm", "rms_eps",
                  "max_seq_len", "eos_token_id", "pad_token_id")

# (our key, HF name inside a decoder layer), in the order transformers writes them.
_LAYER_TENSORS = (
  ("attn_pre_norm", "input_layernorm.weight"),
  ("q", "self_attn.q_proj.weight"),
  ("k", "self_attn.k_proj.weight"),
  ("v", "self_attn.v_proj.weight"),
  ("o", "self_attn.o_proj.weight"),
  ("q_norm", "self_attn.q_norm.weight"),
  ("k_norm", "self_attn.k_norm.weight"),
  ("attn_post_norm", "post_attention_layernorm.weight"),
  ("mlp_pre_norm", "pre_feedforward_layernorm.weight"),
  ("gate", "mlp.gate_proj.weight"),
  ("up", "mlp.up_proj.weight"),
  ("down", "mlp.down_proj.weight"),
  ("mlp_post_norm", "post_feedforward_layernorm.weight"),
)

# Where the decoder sits, most specific first: multimodal Gemma 3 (module names, hub layout),
# *ForCausalLM, a bare text model.
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.", "")
# Tensors of a multimodal Gemma 3 checkpoint that the text model does not use.
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                    "model.multi_modal_projector.")
_LM_HEADS = ("lm_head.weight", "language_model.lm_head.weight")

# safetensors dtype names this module reads; BF16 is read from raw bytes (module docstring).
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}


# ---- config.json <-> Config ---------------------------------------------------------------


def _text_config(hf: Mapping) -> tuple[dict, dict, str, int]:
  """(text part, top level, key prefix for messages, version) of a config.json dict."""
  model_type = hf.get("model_type")
  if model_type == "gemma3":
    # Multimodal Gemma 3: the decoder's keys are under text_config; the rest is the vision side.
    text = hf.get("text_config")
    if not isinstance(text, Mapping):
      raise ValueError("config.json: model_type 'gemma3' (multimodal) needs a 'text_config' "
                       f"object, got {text!r}")
    inner = text.get("model_type", "gemma3_text")
    if inner != "gemma3_text":
      raise ValueError(f"config.json: text_config.model_type is {inner!r}; expected "
                       "'gemma3_text'")
    return dict(text), dict(hf), "text_config.", 3
  if model_type not in _MODEL_TYPES:
    raise ValueError(f"config.json: model_type {model_type!r} is not supported; expected one "
                     f"of {sorted(_MODEL_TYPES) + ['gemma3']}")
  return dict(hf), dict(hf), "", _MODEL_TYPES[model_type]


def _rope_factor(params: Mapping, key: str) -> float:
  """The linear RoPE scaling factor of one rope settings dict (1.0 for 'default')."""
  kind = params.get("rope_type", params.get("type", "default"))
  if kind == "default":
    factor = 1.0
  elif kind == "linear":
    if params.get("factor") is None:
      raise ValueError(f"config.json: {key} is 'linear' RoPE scaling without a 'factor'")
    factor = float(params["factor"])
  else:
    raise ValueError(f"config.json: {key} has RoPE type {kind!r}; only 'default' and "
                     "'linear' are supported")
  partial = params.get("partial_rotary_factor", 1.0)
  if partial is not None and float(partial) != 1.0:
    raise ValueError(f"config.json: {key}.partial_rotary_factor is {partial}; only full "
                     "rotary embeddings (1.0) are supported")
  return factor


def _rope(text: Mapping, version: int, where: str) -> tuple[float, float, float]:
  """(rope_theta_global, rope_theta_local, rope_scale_global) from either spelling.

  transformers < 5 writes rope_theta, rope_scaling (Gemma 3: applied to global layers only)
  and Gemma 3's rope_local_base_freq; transformers 5 writes rope_parameters, for Gemma 3 a
  dict per layer type ({"full_attention": {...}, "sliding_attention": {...}}), for Gemma 2
  one dict for every layer. Keys missing from the new spelling fall back to the old ones and
  then to the class defaults, as transformers 5 fills them.
  """
  defaults = _DEFAULTS[version]
  theta_default = text.get("rope_theta", defaults["rope_theta"])
  local_default = text.get("rope_local_base_freq", defaults.get("rope_local_base_freq"))
  params = text.get("rope_parameters")
  if params is None:
    scaling = text.get("rope_scaling")
    glob = dict(scaling or {}, rope_theta=theta_default)
    glob_key = f"{where}rope_scaling"
    local = {"rope_theta": local_default} if version == 3 else glob
    local_key = f"{where}rope_local_base_freq" if version == 3 else glob_key
  elif "full_attention" in params or "sliding_attention" in params:
    glob = dict(params.get("full_attention") or {})
    glob.update(text.get("rope_scaling") or {})
    glob.setdefault("rope_theta", theta_default)
    local = dict(params.get("sliding_attention") or {})
    local.setdefault("rope_theta", local_default if version == 3 else glob["rope_theta"])
    glob_key = f"{where}rope_parameters.full_attention"
    local_key = f"{where}rope_parameters.sliding_attention"
  else:
    glob = dict(params)
    glob.setdefault("rope_theta", theta_default)
    glob_key = f"{where}rope_parameters"
    local = {"rope_theta": local_default} if version == 3 else glob
    local_key = f"{where}rope_local_base_freq" if version == 3 else glob_key
  scale = _rope_factor(glob, glob_key)
  if _rope_factor(local, local_key) != 1.0:
    # Gemma 2 scales every layer's RoPE; Config has a scale for the global layers only.
    raise ValueError(f"config.json: {local_key} scales the RoPE of sliding-window layers; "
                     "jaxgpu's Config scales only the global layers (rope_scale_global)")
  return float(glob["rope_theta"]), float(local["rope_theta"]), scale


def _layer_types(text: Mapping, version: int, n_layers: int, where: str) -> tuple[str, ...]:
  """'local' / 'global' per layer: HF's layer_types, else the version's pattern."""
  names = text.get("layer_types")
  if names is not None:
    if len(names) != n_layers:
      raise ValueError(f"config.json: {where}layer_types has {len(names)} entries for "
                       f"num_hidden_layers={n_layers}")
    out = []
    for i, name in enumerate(names):
      if name not in _TO_KIND:
        raise ValueError(f"config.json: {where}layer_types[{i}] is {name!r}; expected one of "
                         f"{sorted(_TO_KIND)}")
      out.append(_TO_KIND[name])
    return tuple(out)
  if version == 2:
    # Gemma 2 alternates from the first layer: even layers slide, odd layers are global.
    return tuple("local" if i % 2 == 0 else "global" for i in range(n_layers))
  # Gemma 3: every pattern-th layer (counting from 1) is global. Older configs spell the
  # pattern sliding_window_pattern; transformers 4.5x kept it as _sliding_window_pattern.
  pattern = text.get("sliding_window_pattern", text.get("_sliding_window_pattern"))
  pattern = int(pattern if pattern is not None else _DEFAULTS[3]["sliding_window_pattern"])
  if pattern < 1:
    raise ValueError(f"config.json: {where}sliding_window_pattern is {pattern}; expected >= 1")
  return tuple("global" if (i + 1) % pattern == 0 else "local" for i in range(n_layers))


def _token_id(text: Mapping, top: Mapping, key: str, default: int) -> int:
  """A special token id: the text config's, else the top level's, else the class default.
  A list (Gemma 3's eos_token_id is [1, 106]) gives its first entry; null the default."""
  value = text[key] if key in text else top.get(key, default)
  if isinstance(value, list | tuple):
    value = value[0] if value else None
  return int(default if value is None else value)


def config_from_hf(hf: Mapping) -> Config:
  """The Config of a Hugging Face config.json (already parsed into a dict).

  Accepts model_type "gemma2", "gemma3_text" and "gemma3" (multimodal: the decoder's keys
  are read from "text_config"). Keys that are missing take the defaults of transformers'
  Gemma2Config / Gemma3TextConfig (a missing softcap is Gemma 2's 50.0 / 30.0 and Gemma 3's
  None; an explicit null is None). Raises ValueError, naming the key, for what Config cannot
  represent: another model type or activation, RoPE scaling other than linear on the global
  layers, attention biases, untied output embeddings, bidirectional attention.
  """
  text, top, where, version = _text_config(hf)
  defaults = _DEFAULTS[version]

  def get(key):
    return text.get(key, defaults[key])

  activation = text.get("hidden_activation", _ACTIVATION)
  if activation != _ACTIVATION:
    raise ValueError(f"config.json: {where}hidden_activation is {activation!r}; Gemma 2/3 "
                     f"use {_ACTIVATION!r} (GeGLU with tanh GELU), the only one supported")
  if text.get("attention_bias", False):
    raise ValueError(f"config.json: {where}attention_bias is true; the parameters have no "
                     "attention biases")
  if text.get("use_bidirectional_attention", False):
    raise ValueError(f"config.json: {where}use_bidirectional_attention is true; the model is "
                     "causal")
  tied = text.get("tie_word_embeddings", top.get("tie_word_embeddings", True))
  if not tied:
    raise ValueError(f"config.json: {where}tie_word_embeddings is false; the model's output "
                     "projection is the embedding")

  n_layers = int(get("num_hidden_layers"))
  layer_types = _layer_types(text, version, n_layers, where)
  max_seq_len = int(get("max_position_embeddings"))
  window = get("sliding_window")
  if window is None:
    if "local" in layer_types:
      raise ValueError(f"config.json: {where}sliding_window is null but layer_types has "
                       "sliding-window layers")
    window = max_seq_len   # no layer slides: any window is the same model
  theta_global, theta_local, scale_global = _rope(text, version, where)

  def softcap(key):
    value = get(key)
    return None if value is None else float(value)

  return Config(
    version=version,
    vocab_size=int(get("vocab_size")),
    d_model=int(get("hidden_size")),
    n_layers=n_layers,
    n_heads=int(get("num_attention_heads")),
    n_kv_heads=int(get("num_key_value_heads")),
    head_dim=int(get("head_dim")),
    ffn_dim=int(get("intermediate_size")),
    query_pre_attn_scalar=float(get("query_pre_attn_scalar")),
    sliding_window=int(window),
    layer_types=layer_types,
    rope_theta_global=theta_global,
    rope_theta_local=theta_local,
    rope_scale_global=scale_global,
    attn_logit_softcap=softcap("attn_logit_softcapping"),
    final_logit_softcap=softcap("final_logit_softcapping"),
    qk_norm=version == 3,   # HF's Gemma 3 always normalizes q and k; Gemma 2 never does
    rms_eps=float(get("rms_norm_eps")),
    max_seq_len=max_seq_len,
    eos_token_id=_token_id(text, top, "eos_token_id", defaults["eos_token_id"]),
    pad_token_id=_token_id(text, top, "pad_token_id", defaults["pad_token_id"]),
  )


def _window_pattern(layer_types) -> int | None:
  """The Gemma 3 sliding_window_pattern that reproduces layer_types (6 when it does), or None.
  transformers 4.50-4.52 derive the layer types from this number and ignore layer_types."""
  n = len(layer_types)
  for pattern in (6, *range(1, n + 2)):
    if all((kind == "global") == ((i + 1) % pattern == 0) for i, kind in enumerate(layer_types)):
      return pattern
  return None


def _int_if_integral(x: float) -> int | float:
  """transformers 5's strictly typed Gemma configs declare query_pre_attn_scalar an int
  (256, 144, 168 in the published models) and refuse 256.0."""
  return int(x) if float(x).is_integer() else float(x)


def hf_config_from(config: Config) -> dict:
  """A config.json dict (Gemma2ForCausalLM or Gemma3ForCausalLM) describing `config`.

  Written in the spelling every transformers release reads: rope_theta, rope_scaling and
  rope_local_base_freq (transformers 5 converts them to rope_parameters), layer_types (read
  from 4.53 on; Gemma 3's sliding_window_pattern as well where one reproduces the layer
  types, for older releases). Nothing depends on the attention implementation. Raises
  ValueError for a Config that HF's Gemma classes cannot express: Gemma 2 with different
  local / global RoPE or RoPE scaling, or qk_norm not matching the version.
  """
  version = config.version
  if version not in _ARCHITECTURES:
    raise ValueError(f"hf_config_from: version is {version!r}; expected 2 or 3")
  if bool(config.qk_norm) != (version == 3):
    raise ValueError(f"hf_config_from: qk_norm={config.qk_norm} with version={version}; HF's "
                     "Gemma 3 always has q/k norms and Gemma 2 never")
  hf = {
    "architectures": [_ARCHITECTURES[version]],
    "model_type": "gemma2" if version == 2 else "gemma3_text",
    "vocab_size": int(config.vocab_size),
    "hidden_size": int(config.d_model),
    "intermediate_size": int(config.ffn_dim),
    "num_hidden_layers": int(config.n_layers),
    "num_attention_heads": int(config.n_heads),
    "num_key_value_heads": int(config.n_kv_heads),
    "head_dim": int(config.head_dim),
    "hidden_activation": _ACTIVATION,
    "max_position_embeddings": int(config.max_seq_len),
    "rms_norm_eps": float(config.rms_eps),
    "query_pre_attn_scalar": _int_if_integral(config.query_pre_attn_scalar),
    "sliding_window": int(config.sliding_window),
    "layer_types": [_TO_HF_KIND[kind] for kind in config.layer_types],
    "attn_logit_softcapping": config.attn_logit_softcap,
    "final_logit_softcapping": config.final_logit_softcap,
    "rope_theta": float(config.rope_theta_global),
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": True,
    "pad_token_id": int(config.pad_token_id),
    "eos_token_id": int(config.eos_token_id),
  }
  for key in ("attn_logit_softcapping", "final_logit_softcapping"):
    if hf[key] is not None:
      hf[key] = float(hf[key])
  if version == 2:
    if float(config.rope_theta_local) != float(config.rope_theta_global):
      raise ValueError("hf_config_from: rope_theta_local differs from rope_theta_global; HF's "
                       "Gemma 2 has one rope_theta for every layer")
    if float(config.rope_scale_global) != 1.0:
      raise ValueError("hf_config_from: rope_scale_global is not 1; HF's Gemma 2 would scale "
                       "every layer's RoPE, not only the global layers'")
  else:
    hf["rope_local_base_freq"] = float(config.rope_theta_local)
    scale = float(config.rope_scale_global)
    hf["rope_scaling"] = None if scale == 1.0 else {"rope_type": "linear", "factor": scale}
    pattern = _window_pattern(config.layer_types)
    if pattern is not None:
      hf["sliding_window_pattern"] = pattern
  return hf


def _check_same(given: Config, found: Config) -> None:
  """ValueError naming the first Config field where `given` differs from config.json's."""
  for name in _CONFIG_FIELDS:
    a, b = getattr(given, name), getattr(found, name)
    if name == "layer_types":
      same = tuple(a) == tuple(b)
    elif isinstance(a, float) or isinstance(b, float):
      same = a is not None and b is not None and math.isclose(a, b, rel_tol=1e-9)
    else:
      same = a == b
    if not same:
      raise ValueError(f"load_hf_checkpoint: config.{name} is {a!r} but the checkpoint's "
                       f"config.json gives {b!r}")


# ---- the tensors ----------------------------------------------------------------------------


def _shapes(config: Config) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
  """our key -> (our shape, HF shape) of one decoder layer's tensors. Ours come from
  params.layer_shapes; an HF Linear weight is (out, in) with the head dims flattened: our
  matrices are (in..., out...), where only o's input spans two axes (heads, head_dim)."""
  def hf(key, shape):
    if len(shape) == 1:
      return shape
    split = 2 if key == "o" else 1
    return (math.prod(shape[split:]), math.prod(shape[:split]))

  return {key: (shape, hf(key, shape)) for key, shape in layer_shapes(config).items()}


def _layout(config: Config, prefix: str) -> list[tuple[str, tuple, tuple[int, ...],
                                                      tuple[int, ...]]]:
  """Every tensor of the decoder: (HF name, where in params, our shape, HF shape).

  `where` is ("embed",), ("final_norm",) or ("layers", i, key)."""
  v, d = config.vocab_size, config.d_model
  shapes = _shapes(config)
  out = [(f"{prefix}embed_tokens.weight", ("embed",), (v, d), (v, d))]
  for i in range(config.n_layers):
    for key, hf_name in _LAYER_TENSORS:
      if key in shapes:
        ours, theirs = shapes[key]
        out.append((f"{prefix}layers.{i}.{hf_name}", ("layers", i, key), ours, theirs))
  out.append((f"{prefix}norm.weight", ("final_norm",), (d,), (d,)))
  return out


def _from_hf(w: np.ndarray, where: tuple, shape: tuple[int, ...]) -> np.ndarray:
  """An HF tensor -> our layout. nn.Embedding's (V, D) and the 1-D norms are kept;
  a Linear's (out, in) weight is transposed and its head dims split out."""
  if where == ("embed",) or w.ndim == 1:
    return w
  return np.ascontiguousarray(w.T.reshape(shape))


def _to_hf(x: np.ndarray, where: tuple, hf_shape: tuple[int, ...]) -> np.ndarray:
  """Our layout -> the HF tensor (the inverse of _from_hf)."""
  if where == ("embed",) or x.ndim == 1:
    return x
  return np.ascontiguousarray(x.reshape(hf_shape[::-1]).T)


def _listing(names) -> str:
  names = list(names)
  shown = ", ".join(names[:8])
  return shown + (f", ... ({len(names) - 8} more)" if len(names) > 8 else "")


# ---- safetensors files ----------------------------------------------------------------------


def _safetensors():
  try:
    import safetensors  # noqa: F401
    import safetensors.numpy
  except ImportError as e:
    raise ImportError("reading or writing Hugging Face checkpoints needs the `safetensors` "
                      "package: pip install 'jaxgpu[models]' (or safetensors)") from e
  return safetensors


def _read_header(file: str) -> tuple[dict, int]:
  """(header, offset of the data) of a safetensors file: an 8-byte little-endian length,
  then that many bytes of JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}}
  with offsets relative to the end of the header."""
  with open(file, "rb") as f:
    raw = f.read(8)
    if len(raw) != 8:
      raise ValueError(f"{file}: not a safetensors file (shorter than its 8-byte header size)")
    (size,) = struct.unpack("<Q", raw)
    header = json.loads(f.read(size))
  header.pop("__metadata__", None)
  return header, 8 + size


class _Tensors:
  """The tensors of a checkpoint folder, read one at a time (peak host memory: one tensor).

  names: tensor name -> (file, header entry). Used as a context manager: it holds the files'
  safetensors handles open."""

  def __init__(self, folder: str):
    index = os.path.join(folder, INDEX_FILE)
    if os.path.exists(index):
      with open(index) as f:
        weight_map = json.load(f).get("weight_map")
      if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: no 'weight_map' object")
      files = sorted(set(weight_map.values()))
    else:
      weight_map = None
      files = sorted(name for name in os.listdir(folder) if name.endswith(".safetensors"))
      if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors file (nor {INDEX_FILE})")
    self.names: dict[str, tuple[str, dict, int]] = {}
    for name in files:
      file = os.path.join(folder, name)
      if not os.path.exists(file):
        raise FileNotFoundError(f"{index} lists {name}, which is not in {folder}")
      header, data_start = _read_header(file)
      for tensor, entry in header.items():
        if tensor in self.names:
          raise ValueError(f"{folder}: tensor {tensor} is in both {self.names[tensor][0]} "
                           f"and {file}")
        self.names[tensor] = (file, entry, data_start)
    if weight_map is not None:
      absent = [t for t in weight_map if t not in self.names]
      if absent:
        raise ValueError(f"{index} lists tensors that its files lack: {_listing(absent)}")
    self._handles = {}

  def __enter__(self):
    st = _safetensors()
    for file in sorted({file for file, _, _ in self.names.values()}):
      self._handles[file] = st.safe_open(file, framework="np").__enter__()
    return self

  def __exit__(self, *exc):
    for handle in self._handles.values():
      handle.__exit__(*exc)
    self._handles = {}

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self.names[name][1]["shape"])

  def dtype(self, name: str) -> str:
    return self.names[name][1]["dtype"]

  def read(self, name: str) -> np.ndarray:
    """The tensor as a numpy array of its stored dtype (BF16: ml_dtypes.bfloat16)."""
    file, entry, data_start = self.names[name]
    if entry["dtype"] != "BF16":
      return self._handles[file].get_tensor(name)
    begin, end = entry["data_offsets"]
    with open(file, "rb") as f:
      f.seek(data_start + begin)
      raw = f.read(end - begin)
    if len(raw) != end - begin:
      raise ValueError(f"{file}: tensor {name} is cut short ({len(raw)} of {end - begin} bytes)")
    # Stored little-endian: decode as such, then reinterpret the native uint16 bits.
    bits = np.frombuffer(raw, dtype="<u2").astype(np.uint16, copy=False)
    return bits.view(ml_dtypes.bfloat16).reshape(entry["shape"])


def _find_prefix(names, multimodal: bool) -> str:
  candidates = _TEXT_PREFIXES if multimodal else _TEXT_PREFIXES[2:]
  for prefix in candidates:
    if f"{prefix}embed_tokens.weight" in names:
      return prefix
  looked = ", ".join(f"{p}embed_tokens.weight" for p in candidates)
  raise ValueError(f"load_hf_checkpoint: no embedding tensor found (looked for {looked})")


def load_hf_checkpoint(path, config: Config | None = None, dtype=None) -> tuple[dict, Config]:
  """Read a Hugging Face Gemma 2 / Gemma 3 checkpoint folder into (params, config).

  path: a folder with config.json and model.safetensors, or shards listed in
    model.safetensors.index.json (without an index, every *.safetensors file in the folder).
  config: when given, it must agree with config.json on every field this module reads (ValueError
    naming the first that differs); it is then the config returned.
  dtype: the dtype of every returned array (e.g. jnp.bfloat16, "float32"); None keeps each
    tensor's stored dtype (bfloat16 as jnp.bfloat16).
  Returns params in the model's layout (jax arrays on the default device): embed (V, D),
  final_norm (D,), layers[i] with the norms (D,), q (D, N, H), k and v (D, K, H),
  o (N, H, D), gate and up (D, F), down (F, D), and for Gemma 3 q_norm and k_norm (H,).
  Raises ValueError naming the tensors that are missing, unexpected (a vision tower and a
  tied lm_head are ignored) or of the wrong shape or a non-float dtype.
  """
  folder = os.fspath(path)
  with open(os.path.join(folder, CONFIG_FILE)) as f:
    hf = json.load(f)
  found = config_from_hf(hf)
  if config is None:
    config = found
  else:
    _check_same(config, found)
  cast = None if dtype is None else np.dtype(dtype)

  with _Tensors(folder) as tensors:
    multimodal = hf.get("model_type") == "gemma3"
    prefix = _find_prefix(tensors.names, multimodal)
    layout = _layout(config, prefix)
    expected = {name for name, _, _, _ in layout}
    missing = [name for name, _, _, _ in layout if name not in tensors.names]

    def ignored(name):
      # A tied lm_head duplicates the embedding (config_from_hf rejected untied ones).
      return name in _LM_HEADS or (multimodal and name.startswith(_VISION_PREFIXES))

    unexpected = [n for n in sorted(tensors.names) if n not in expected and not ignored(n)]
    if missing or unexpected:
      parts = []
      if missing:
        parts.append(f"missing tensors: {_listing(missing)}")
      if unexpected:
        parts.append(f"unexpected tensors: {_listing(unexpected)}")
      raise ValueError(f"load_hf_checkpoint({folder}): " + "; ".join(parts))
    wrong = [f"{name} has shape {tensors.shape(name)}, expected {hf_shape}"
             for name, _, _, hf_shape in layout if tensors.shape(name) != hf_shape]
    wrong += [f"{name} has dtype {tensors.dtype(name)}, expected a float type"
              for name, _, _, _ in layout if tensors.dtype(name) not in _FLOAT_DTYPES]
    if wrong:
      raise ValueError(f"load_hf_checkpoint({folder}): " + "; ".join(wrong[:8])
                       + (f"; ... ({len(wrong) - 8} more)" if len(wrong) > 8 else ""))

    params = {"layers": [{} for _ in range(config.n_layers)]}
    for name, where, shape, _ in layout:
      array = _from_hf(tensors.read(name), where, shape)
      if cast is not None:
        array = array.astype(cast)
      value = jnp.asarray(array)
      if where[0] == "layers":
        params["layers"][where[1]][where[2]] = value
      else:
        params[where[0]] = value
  return params, config


def _hf_tensors(params: Mapping, config: Config) -> dict[str, np.ndarray]:
  """params (our layout, checked against config) -> {HF name: numpy array}."""
  if not isinstance(params, Mapping):
    raise ValueError(f"save_hf_checkpoint: params must be a dict, got {type(params).__name__}")
  top = {"embed", "final_norm", "layers"}
  if set(params) != top:
    raise ValueError(f"save_hf_checkpoint: params has keys {sorted(params)}; expected "
                     f"{sorted(top)}")
  layers = params["layers"]
  if len(layers) != config.n_layers:
    raise ValueError(f"save_hf_checkpoint: params['layers'] has {len(layers)} layers; the "
                     f"config has n_layers={config.n_layers}")
  keys = set(_shapes(config))
  for i, layer in enumerate(layers):
    if set(layer) != keys:
      missing, extra = sorted(keys - set(layer)), sorted(set(layer) - keys)
      raise ValueError(f"save_hf_checkpoint: params['layers'][{i}] is missing {missing} and "
                       f"has unexpected {extra} (qk_norm={config.qk_norm})")
  out = {}
  for name, where, shape, hf_shape in _layout(config, "model."):
    if where[0] == "layers":
      array, label = layers[where[1]][where[2]], f"params['layers'][{where[1]}]['{where[2]}']"
    else:
      array, label = params[where[0]], f"params['{where[0]}']"
    array = np.asarray(array)
    if array.shape != shape:
      raise ValueError(f"save_hf_checkpoint: {label} has shape {array.shape}, expected {shape}")
    out[name] = _to_hf(array, where, hf_shape)
  return out


def save_hf_checkpoint(params: Mapping, config: Config, path, max_shard_bytes: int | None = None
                       ) -> None:
  """Write params as a Hugging Face checkpoint folder that Gemma2ForCausalLM /
  Gemma3ForCausalLM.from_pretrained loads (and load_hf_checkpoint reads back unchanged).

  params: the model's layout (see load_hf_checkpoint); arrays keep their dtypes (float32,
    bfloat16 and float16 are what transformers loads). config: the model's Config.
  path: the folder (created if needed). Writes config.json (hf_config_from plus torch_dtype,
    the embedding's dtype) and model.safetensors, or with max_shard_bytes set, shards
    model-0000i-of-0000n.safetensors of at most that many bytes each (a larger single tensor
    gets a shard of its own) and model.safetensors.index.json. Checkpoint files a previous
    save left in the folder under these names are removed first, so no stale shard remains.
  """
  st = _safetensors()
  hf = hf_config_from(config)
  tensors = _hf_tensors(params, config)
  embed_dtype = np.dtype(tensors["model.embed_tokens.weight"].dtype).name
  if embed_dtype in ("float32", "bfloat16", "float16"):
    hf["torch_dtype"] = embed_dtype

  folder = os.fspath(path)
  os.makedirs(folder, exist_ok=True)
  for name in os.listdir(folder):
    if name in (WEIGHTS_FILE, INDEX_FILE) or _SHARD_RE.fullmatch(name):
      os.remove(os.path.join(folder, name))

  # transformers refuses safetensors files whose metadata lacks a known "format".
  metadata = {"format": "pt"}
  if max_shard_bytes is None:
    st.numpy.save_file(tensors, os.path.join(folder, WEIGHTS_FILE), metadata=metadata)
  else:
    if max_shard_bytes <= 0:
      raise ValueError(f"save_hf_checkpoint: max_shard_bytes must be > 0, got {max_shard_bytes}")
    shards, size = [{}], 0
    for name, array in tensors.items():
      if shards[-1] and size + array.nbytes > max_shard_bytes:
        shards.append({})
        size = 0
      shards[-1][name] = array
      size += array.nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
      file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      st.numpy.save_file(shard, os.path.join(folder, file), metadata=metadata)
      weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
             "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(folder, INDEX_FILE), "w") as f:
      json.dump(index, f, indent=2)
      f.write("\n")
  with open(os.path.join(folder, CONFIG_FILE), "w") as f:
    json.dump(hf, f, indent=2, sort_keys=True)
    f.write("\n")

