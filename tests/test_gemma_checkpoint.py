"""Hugging Face checkpoints of Gemma 2/3 (jaxgpu/models/gemma/checkpoint.py), on the CPU.

* config.json -> Config: each version's layer pattern, both RoPE spellings (transformers < 5:
  rope_theta / rope_scaling / rope_local_base_freq; 5: rope_parameters), softcap and token-id
  rules, class defaults for omitted keys (the multimodal Gemma 3 4B hub config lists only a
  few), and the inverse hf_config_from.
* The tensor mapping, checked independently of the module: the test writes a folder with
  HF's names and layouts itself and checks the loaded arrays element by element (q[d, n, h] ==
  q_proj[n * H + h, d], ...); the multimodal prefixes; bfloat16 read from raw bytes.
* save -> load round trips, float32 and bfloat16, single file and shards.
* Errors (ValueError naming the culprit): missing, unexpected, wrong-shape tensors, a config
  that disagrees with config.json, unknown model_type, what Config cannot represent.
Parameters are random numpy arrays in the model's layout (load_hf_checkpoint's docstring),
built here, not by the model's init_params.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

safetensors_numpy = pytest.importorskip("safetensors.numpy")
from safetensors import safe_open  # noqa: E402

from jaxgpu.models.gemma import checkpoint  # noqa: E402
from jaxgpu.models.gemma.checkpoint import (config_from_hf, hf_config_from,  # noqa: E402
                                            load_hf_checkpoint, save_hf_checkpoint)

# Sizes where no two of D, N*H, K*H, F, V coincide, so that no weight matrix is square and a
# transposed one cannot pass a shape check.
D, N, K, H, F, V = 12, 4, 2, 8, 20, 64


def hf_config(version: int, **changes) -> dict:
  """A tiny config.json as transformers writes it (every model key present)."""
  hf = {
    "vocab_size": V, "hidden_size": D, "intermediate_size": F, "num_attention_heads": N,
    "num_key_value_heads": K, "head_dim": H, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 12,
    "sliding_window": 4, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
    "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": True,
  }
  if version == 2:
    hf.update(model_type="gemma2", architectures=["Gemma2ForCausalLM"], num_hidden_layers=3,
              rope_theta=10000.0, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
  else:
    hf.update(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"],
              num_hidden_layers=4, rope_theta=1e6, rope_local_base_freq=1e4,
              rope_scaling={"rope_type": "linear", "factor": 4.0}, sliding_window_pattern=2,
              attn_logit_softcapping=None, final_logit_softcapping=None)
  hf.update(changes)
  return hf


def random_params(config, rng, dtype=np.float32) -> dict:
  """Random params in the model's layout (numpy arrays of `dtype`)."""

  def r(*shape):
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)

  d, n, k, h, f = config.d_model, config.n_heads, config.n_kv_heads, config.head_dim, \
    config.ffn_dim
  layers = []
  for _ in range(config.n_layers):
    layer = {"attn_pre_norm": r(d), "attn_post_norm": r(d), "mlp_pre_norm": r(d),
             "mlp_post_norm": r(d), "q": r(d, n, h), "k": r(d, k, h), "v": r(d, k, h),
             "o": r(n, h, d), "gate": r(d, f), "up": r(d, f), "down": r(f, d)}
    if config.qk_norm:
      layer["q_norm"], layer["k_norm"] = r(h), r(h)
    layers.append(layer)
  return {"embed": r(config.vocab_size, d), "final_norm": r(d), "layers": layers}


def random_hf_tensors(config, rng, prefix="model.", dtype=np.float32) -> dict:
  """Random tensors with HF's names and (out_features, in_features) layouts."""

  def r(*shape):
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)

  d, n, k, h, f = config.d_model, config.n_heads, config.n_kv_heads, config.head_dim, \
    config.ffn_dim
  out = {f"{prefix}embed_tokens.weight": r(config.vocab_size, d), f"{prefix}norm.weight": r(d)}
  for i in range(config.n_layers):
    p = f"{prefix}layers.{i}."
    out.update({
      p + "input_layernorm.weight": r(d), p + "post_attention_layernorm.weight": r(d),
      p + "pre_feedforward_layernorm.weight": r(d),
      p + "post_feedforward_layernorm.weight": r(d),
      p + "self_attn.q_proj.weight": r(n * h, d), p + "self_attn.k_proj.weight": r(k * h, d),
      p + "self_attn.v_proj.weight": r(k * h, d), p + "self_attn.o_proj.weight": r(d, n * h),
      p + "mlp.gate_proj.weight": r(f, d), p + "mlp.up_proj.weight": r(f, d),
      p + "mlp.down_proj.weight": r(d, f),
    })
    if config.qk_norm:
      out[p + "self_attn.q_norm.weight"] = r(h)
      out[p + "self_attn.k_norm.weight"] = r(h)
  return out


def write_folder(folder, hf: dict, tensors: dict) -> str:
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(hf, f)
  safetensors_numpy.save_file(tensors, os.path.join(folder, "model.safetensors"),
                              metadata={"format": "pt"})
  return str(folder)


def as_bits(x) -> np.ndarray:
  """Exact comparison of float arrays of any width (bfloat16 included)."""
  x = np.asarray(x)
  return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def check_mapping(params, tensors, config, prefix):
  """params (loaded) against the HF tensors, element by element, spelled out per tensor."""
  t = {name[len(prefix):]: np.asarray(a) for name, a in tensors.items() if name.startswith(prefix)}
  eq = np.testing.assert_array_equal
  eq(np.asarray(params["embed"]), t["embed_tokens.weight"])
  eq(np.asarray(params["final_norm"]), t["norm.weight"])
  assert len(params["layers"]) == config.n_layers
  h = config.head_dim
  for i, layer in enumerate(params["layers"]):
    p = f"layers.{i}."
    got = {key: np.asarray(value) for key, value in layer.items()}
    eq(got["attn_pre_norm"], t[p + "input_layernorm.weight"])
    eq(got["attn_post_norm"], t[p + "post_attention_layernorm.weight"])
    eq(got["mlp_pre_norm"], t[p + "pre_feedforward_layernorm.weight"])
    eq(got["mlp_post_norm"], t[p + "post_feedforward_layernorm.weight"])
    assert got["q"].shape == (config.d_model, config.n_heads, h)
    for n in range(config.n_heads):
      for j in range(h):
        # HF's q_proj output feature n * H + j is head n, feature j; its input is the row.
        eq(got["q"][:, n, j], t[p + "self_attn.q_proj.weight"][n * h + j, :])
        # o_proj takes the flattened heads as its input (columns).
        eq(got["o"][n, j, :], t[p + "self_attn.o_proj.weight"][:, n * h + j])
    for n in range(config.n_kv_heads):
      for j in range(h):
        eq(got["k"][:, n, j], t[p + "self_attn.k_proj.weight"][n * h + j, :])
        eq(got["v"][:, n, j], t[p + "self_attn.v_proj.weight"][n * h + j, :])
    eq(got["gate"], t[p + "mlp.gate_proj.weight"].T)
    eq(got["up"], t[p + "mlp.up_proj.weight"].T)
    eq(got["down"], t[p + "mlp.down_proj.weight"].T)
    if config.qk_norm:
      eq(got["q_norm"], t[p + "self_attn.q_norm.weight"])
      eq(got["k_norm"], t[p + "self_attn.k_norm.weight"])
    else:
      assert "q_norm" not in got and "k_norm" not in got


# ---- config.json -> Config ------------------------------------------------------------------


def test_config_gemma2():
  c = config_from_hf(hf_config(2))
  assert (c.version, c.vocab_size, c.d_model, c.n_layers, c.n_heads, c.n_kv_heads,
          c.head_dim, c.ffn_dim) == (2, V, D, 3, N, K, H, F)
  # Gemma 2 alternates from the first layer: even layers slide.
  assert c.layer_types == ("local", "global", "local")
  assert (c.rope_theta_global, c.rope_theta_local, c.rope_scale_global) == (1e4, 1e4, 1.0)
  assert (c.attn_logit_softcap, c.final_logit_softcap) == (50.0, 30.0)
  assert (c.query_pre_attn_scalar, c.sliding_window, c.max_seq_len) == (12.0, 4, 128)
  assert (c.qk_norm, c.rms_eps, c.eos_token_id, c.pad_token_id) == (False, 1e-6, 1, 0)


def test_config_gemma3():
  c = config_from_hf(hf_config(3))
  assert c.version == 3 and c.qk_norm
  # sliding_window_pattern 2: every second layer (counting from 1) is global.
  assert c.layer_types == ("local", "global", "local", "global")
  assert (c.rope_theta_global, c.rope_theta_local, c.rope_scale_global) == (1e6, 1e4, 4.0)
  assert c.attn_logit_softcap is None and c.final_logit_softcap is None


def test_config_layer_types_key_wins():
  names = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
  c = config_from_hf(hf_config(3, layer_types=names))
  assert c.layer_types == ("global", "local", "local", "global")
  c = config_from_hf(hf_config(2, layer_types=["full_attention"] * 3))
  assert c.layer_types == ("global",) * 3


def test_config_gemma3_default_pattern():
  hf = hf_config(3, num_hidden_layers=13)
  del hf["sliding_window_pattern"]
  c = config_from_hf(hf)
  assert [i for i, kind in enumerate(c.layer_types) if kind == "global"] == [5, 11]
  hf["_sliding_window_pattern"] = 3   # the spelling transformers 4.5x kept
  assert [i for i, k in enumerate(config_from_hf(hf).layer_types) if k == "global"] == [2, 5, 8,
                                                                                       11]


def test_config_rope_parameters_spelling():
  """transformers 5 writes rope_parameters; it must give the same Config as the old keys."""
  legacy = hf_config(3)
  new = {k: v for k, v in legacy.items()
         if k not in ("rope_theta", "rope_local_base_freq", "rope_scaling")}
  new["rope_parameters"] = {
    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
  }
  assert config_from_hf(new) == config_from_hf(legacy)
  gemma2 = {k: v for k, v in hf_config(2).items() if k != "rope_theta"}
  gemma2["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
  assert config_from_hf(gemma2) == config_from_hf(hf_config(2))


def test_config_softcaps_and_tokens():
  hf = hf_config(2)
  del hf["attn_logit_softcapping"], hf["final_logit_softcapping"]
  c = config_from_hf(hf)   # omitted: Gemma2Config's defaults
  assert (c.attn_logit_softcap, c.final_logit_softcap) == (50.0, 30.0)
  c = config_from_hf(hf_config(2, attn_logit_softcapping=None, final_logit_softcapping=None))
  assert (c.attn_logit_softcap, c.final_logit_softcap) == (None, None)
  c = config_from_hf(hf_config(3, eos_token_id=[106, 1], pad_token_id=5))
  assert (c.eos_token_id, c.pad_token_id) == (106, 5)


def test_config_multimodal_gemma3_4b():
  """The shape of google/gemma-3-4b-it's config.json: a partial text_config relies on
  Gemma3TextConfig's defaults; eos is a list at the top level."""
  hf = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
    "eos_token_id": [1, 106], "mm_tokens_per_image": 256,
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                    "model_type": "gemma3_text", "num_hidden_layers": 34,
                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152},
  }
  c = config_from_hf(hf)
  assert (c.version, c.vocab_size, c.d_model, c.n_layers, c.n_heads, c.n_kv_heads,
          c.head_dim, c.ffn_dim) == (3, 262208, 2560, 34, 8, 4, 256, 10240)
  assert (c.sliding_window, c.max_seq_len, c.query_pre_attn_scalar) == (1024, 131072, 256.0)
  assert (c.rope_theta_global, c.rope_theta_local, c.rope_scale_global) == (1e6, 1e4, 8.0)
  assert [i for i, kind in enumerate(c.layer_types) if kind == "global"] == [5, 11, 17, 23, 29]
  assert (c.eos_token_id, c.pad_token_id) == (1, 0)


@pytest.mark.parametrize("version", [2, 3])
def test_hf_config_round_trip(version):
  c = config_from_hf(hf_config(version))
  hf = hf_config_from(c)
  assert hf["model_type"] == ("gemma2" if version == 2 else "gemma3_text")
  assert config_from_hf(json.loads(json.dumps(hf))) == c
  # transformers 5's strictly typed configs refuse a float query_pre_attn_scalar (12.0).
  assert type(hf["query_pre_attn_scalar"]) is int and hf["query_pre_attn_scalar"] == 12
  if version == 3:
    assert hf["sliding_window_pattern"] == 2   # for transformers 4.50-4.52
    assert hf["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}


def test_hf_config_from_refuses():
  c2 = config_from_hf(hf_config(2))
  with pytest.raises(ValueError, match="rope_theta_local"):
    hf_config_from(dataclasses.replace(c2, rope_theta_local=1.0))
  with pytest.raises(ValueError, match="rope_scale_global"):
    hf_config_from(dataclasses.replace(c2, rope_scale_global=2.0))
  with pytest.raises(ValueError, match="qk_norm"):
    hf_config_from(dataclasses.replace(c2, qk_norm=True))


@pytest.mark.parametrize("changes, culprit", [
  ({"model_type": "gemma"}, "model_type"),
  ({"model_type": None}, "model_type"),
  ({"hidden_activation": "gelu"}, "hidden_activation"),
  ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_scaling"),
  ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling"),
  ({"attention_bias": True}, "attention_bias"),
  ({"tie_word_embeddings": False}, "tie_word_embeddings"),
  ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
  ({"layer_types": ["sliding_attention"] * 3}, "layer_types"),
  ({"layer_types": ["chunked_attention"] * 4}, r"layer_types\[0\]"),
  ({"sliding_window": None}, "sliding_window"),
])
def test_config_refuses(changes, culprit):
  with pytest.raises(ValueError, match=culprit):
    config_from_hf(hf_config(3, **changes))


def test_config_gemma2_refuses_rope_scaling():
  # Gemma 2 scales every layer's RoPE; Config scales only global layers.
  with pytest.raises(ValueError, match="rope_scaling"):
    config_from_hf(hf_config(2, rope_scaling={"rope_type": "linear", "factor": 2.0}))


# ---- tensors --------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [2, 3])
def test_load_hf_names(tmp_path, rng, version):
  """A folder written with HF's names by this test; lm_head (tied) is ignored."""
  hf = hf_config(version)
  config = config_from_hf(hf)
  tensors = random_hf_tensors(config, rng)
  tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
  params, loaded = load_hf_checkpoint(write_folder(tmp_path, hf, tensors))
  assert loaded == config
  check_mapping(params, tensors, config, "model.")
  assert all(a.dtype == jnp.float32 for a in _leaves(params))


@pytest.mark.parametrize("prefix, vision", [
  ("model.language_model.", "model.vision_tower.vision_model."),   # module names (>= 4.52)
  ("language_model.model.", "vision_tower.vision_model."),         # hub layout (5.17 too)
])
def test_load_multimodal(tmp_path, rng, prefix, vision):
  text = hf_config(3)
  hf = {"model_type": "gemma3", "text_config": text, "eos_token_id": [1, 106],
        "vision_config": {"model_type": "siglip_vision_model"}}
  config = config_from_hf(text)
  tensors = random_hf_tensors(config, rng, prefix=prefix)
  projector = vision.split("vision_tower")[0] + "multi_modal_projector."
  tensors[vision + "embeddings.patch_embedding.weight"] = rng.standard_normal((4, 3, 2, 2))
  tensors[projector + "mm_input_projection_weight"] = rng.standard_normal((5, D))
  params, loaded = load_hf_checkpoint(write_folder(tmp_path, hf, tensors))
  assert loaded == config
  check_mapping(params, tensors, config, prefix)


def test_load_bfloat16_and_cast(tmp_path, rng):
  hf = hf_config(3)
  config = config_from_hf(hf)
  tensors = random_hf_tensors(config, rng, dtype=ml_dtypes.bfloat16)
  folder = write_folder(tmp_path, hf, tensors)
  params, _ = load_hf_checkpoint(folder)
  assert all(a.dtype == jnp.bfloat16 for a in _leaves(params))
  check_mapping(params, tensors, config, "model.")
  params32, _ = load_hf_checkpoint(folder, dtype=jnp.float32)
  assert all(a.dtype == jnp.float32 for a in _leaves(params32))
  np.testing.assert_array_equal(np.asarray(params32["layers"][1]["o"]),
                                np.asarray(params["layers"][1]["o"]).astype(np.float32))


def test_bfloat16_raw_read_matches_bits(tmp_path, rng):
  """The raw-bytes reader returns the stored bits: against the array written, and against
  safetensors' own numpy reader where this safetensors release has one for bfloat16."""
  x = rng.standard_normal((3, 5, 7)).astype(np.float32).astype(ml_dtypes.bfloat16)
  y = rng.standard_normal((4,)).astype(np.float32)
  file = str(tmp_path / "t.safetensors")
  safetensors_numpy.save_file({"x": x, "y": y}, file)
  with checkpoint._Tensors(str(tmp_path)) as tensors:
    got = tensors.read("x")
    assert got.dtype == ml_dtypes.bfloat16 and got.shape == x.shape
    np.testing.assert_array_equal(as_bits(got), as_bits(x))
    np.testing.assert_array_equal(tensors.read("y"), y)
  with safe_open(file, framework="np") as f:
    try:
      theirs = f.get_tensor("x")
    except (TypeError, ValueError):   # an older safetensors without numpy bfloat16
      theirs = None
  if theirs is not None:
    np.testing.assert_array_equal(as_bits(theirs), as_bits(got))


def _leaves(params):
  """The arrays of params in a fixed order (a layer's keys sorted)."""
  yield params["embed"]
  yield params["final_norm"]
  for layer in params["layers"]:
    yield from (layer[key] for key in sorted(layer))


@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shard", [None, 3000], ids=["single", "sharded"])
def test_round_trip(tmp_path, rng, version, dtype, shard):
  config = config_from_hf(hf_config(version))
  params = random_params(config, rng, dtype)
  save_hf_checkpoint(params, config, tmp_path, max_shard_bytes=shard)
  files = sorted(os.listdir(tmp_path))
  if shard is None:
    assert files == ["config.json", "model.safetensors"]
  else:
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) > 2 and "model.safetensors.index.json" in files
    with open(tmp_path / "model.safetensors.index.json") as f:
      index = json.load(f)
    assert sorted(set(index["weight_map"].values())) == shards
    for file in shards:
      with safe_open(str(tmp_path / file), framework="np") as f:
        sizes = [f.get_slice(name).get_shape() for name in f.keys()]
      nbytes = sum(int(np.prod(s)) * np.dtype(dtype).itemsize for s in sizes)
      assert nbytes <= shard or len(sizes) == 1
  with open(tmp_path / "config.json") as f:
    assert json.load(f)["torch_dtype"] == np.dtype(dtype).name
  loaded, loaded_config = load_hf_checkpoint(tmp_path)
  assert loaded_config == config
  assert loaded.keys() == params.keys() and len(loaded["layers"]) == config.n_layers
  assert all(a.keys() == b.keys() for a, b in zip(loaded["layers"], params["layers"]))
  for got, want in zip(_leaves(loaded), _leaves(params)):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(as_bits(got), as_bits(want))
  # The HF file holds the HF layout: q_proj is (N * H, D).
  tensors = checkpoint._Tensors(str(tmp_path))
  assert tensors.shape("model.layers.0.self_attn.q_proj.weight") == (N * H, D)
  assert tensors.shape("model.layers.0.self_attn.o_proj.weight") == (D, N * H)


def test_save_replaces_stale_shards(tmp_path, rng):
  config = config_from_hf(hf_config(2))
  save_hf_checkpoint(random_params(config, rng), config, tmp_path, max_shard_bytes=2000)
  params = random_params(config, rng)
  save_hf_checkpoint(params, config, tmp_path)
  assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
  loaded, _ = load_hf_checkpoint(tmp_path)
  np.testing.assert_array_equal(np.asarray(loaded["embed"]), params["embed"])


def test_sharded_without_index(tmp_path, rng):
  """No index: every *.safetensors file of the folder is read."""
  hf = hf_config(2)
  config = config_from_hf(hf)
  tensors = random_hf_tensors(config, rng)
  names = sorted(tensors)
  write_folder(tmp_path, hf, {n: tensors[n] for n in names[:10]})
  safetensors_numpy.save_file({n: tensors[n] for n in names[10:]}, str(tmp_path / "b.safetensors"))
  params, _ = load_hf_checkpoint(tmp_path)
  check_mapping(params, tensors, config, "model.")


# ---- errors ---------------------------------------------------------------------------------


def test_missing_tensor(tmp_path, rng):
  hf = hf_config(3)
  tensors = random_hf_tensors(config_from_hf(hf), rng)
  del tensors["model.layers.2.self_attn.k_norm.weight"]
  with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.2\.self_attn\.k_norm"):
    load_hf_checkpoint(write_folder(tmp_path, hf, tensors))


def test_unexpected_tensor(tmp_path, rng):
  hf = hf_config(2)
  tensors = random_hf_tensors(config_from_hf(hf), rng)
  tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(N * H, np.float32)
  with pytest.raises(ValueError, match=r"unexpected tensors: model\.layers\.0\.self_attn\.q_proj"
                                       r"\.bias"):
    load_hf_checkpoint(write_folder(tmp_path, hf, tensors))


def test_gemma2_with_qk_norm_is_unexpected(tmp_path, rng):
  hf = hf_config(2)   # 3 layers; the tensors of a 3-layer Gemma 3 add q_norm and k_norm
  tensors = random_hf_tensors(config_from_hf(hf_config(3, num_hidden_layers=3)), rng)
  with pytest.raises(ValueError, match="unexpected tensors: .*q_norm"):
    load_hf_checkpoint(write_folder(tmp_path, hf, tensors))


def test_wrong_shape(tmp_path, rng):
  hf = hf_config(2)
  tensors = random_hf_tensors(config_from_hf(hf), rng)
  # (D, N * H) where (N * H, D) is expected: a transposed q_proj must not load.
  tensors["model.layers.1.self_attn.q_proj.weight"] = np.zeros((D, N * H), np.float32)
  with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.q_proj\.weight has shape "
                                       r"\(12, 32\), expected \(32, 12\)"):
    load_hf_checkpoint(write_folder(tmp_path, hf, tensors))


def test_integer_tensor(tmp_path, rng):
  hf = hf_config(2)
  tensors = random_hf_tensors(config_from_hf(hf), rng)
  tensors["model.norm.weight"] = np.zeros(D, np.int8)
  with pytest.raises(ValueError, match=r"model\.norm\.weight has dtype I8"):
    load_hf_checkpoint(write_folder(tmp_path, hf, tensors))


def test_config_disagrees(tmp_path, rng):
  hf = hf_config(3)
  config = config_from_hf(hf)
  folder = write_folder(tmp_path, hf, random_hf_tensors(config, rng))
  params, same = load_hf_checkpoint(folder, config=config)
  assert same is config
  with pytest.raises(ValueError, match=r"config\.sliding_window is 8 .* gives 4"):
    load_hf_checkpoint(folder, config=dataclasses.replace(config, sliding_window=8))
  with pytest.raises(ValueError, match=r"config\.layer_types"):
    load_hf_checkpoint(folder, config=dataclasses.replace(config, layer_types=("global",) * 4))


def test_unknown_model_type(tmp_path, rng):
  hf = hf_config(2)
  tensors = random_hf_tensors(config_from_hf(hf), rng)
  hf["model_type"] = "llama"
  with pytest.raises(ValueError, match="model_type 'llama'"):
    load_hf_checkpoint(write_folder(tmp_path, hf, tensors))


def test_no_embedding(tmp_path, rng):
  hf = hf_config(2)
  tensors = random_hf_tensors(config_from_hf(hf), rng, prefix="decoder.")
  with pytest.raises(ValueError, match="embed_tokens"):
    load_hf_checkpoint(write_folder(tmp_path, hf, tensors))


def test_save_checks_params(tmp_path, rng):
  config = config_from_hf(hf_config(3))
  params = random_params(config, rng)
  params["layers"][1]["up"] = params["layers"][1]["up"].T
  with pytest.raises(ValueError, match=r"params\['layers'\]\[1\]\['up'\] has shape"):
    save_hf_checkpoint(params, config, tmp_path)
  params = random_params(config, rng)
  del params["layers"][0]["q_norm"]
  with pytest.raises(ValueError, match=r"params\['layers'\]\[0\] is missing \['q_norm'\]"):
    save_hf_checkpoint(params, config, tmp_path)
