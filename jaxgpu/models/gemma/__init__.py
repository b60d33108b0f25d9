"""Gemma 2 and Gemma 3 (text) built from jaxgpu's ops.

The same code runs jaxgpu's kernels (implementation=None; a step of at most
layers.XLA_FUSES_UP_TO_TOKENS tokens leaves its norms, RoPE and gated unit to XLA's
fusions) and the pure-JAX path a careful JAX user would write ('xla'). Parameters are a
plain dict pytree (params.py).

  config.py    Config: hyperparameters; presets gemma2_2b, gemma3_1b, gemma3_4b, tiny
  params.py    init_params, param_shapes, check_params
  model.py     forward, hidden_states, loss
  train.py     AdamW, init_opt_state, opt_state_specs, train_step, compute_params
  generate.py  generate, prefill, decode_step, decode, sample, Sampling, empty_cache,
               PagedCache (the paged KV cache), resolve_cache, shard_cache,
               cache_shardings
  quantize.py  quantize_params: int8 / int4 projection weights for generation
               (q, k, v and gate, up fused by default); dequantize_params
  sharding.py  param_specs, param_shardings, shard_params, batch_sharding, shard_batch
  checkpoint.py  load_hf_checkpoint, save_hf_checkpoint, config_from_hf, hf_config_from
"""

from jaxgpu.models.gemma.checkpoint import (config_from_hf, hf_config_from,
                                            load_hf_checkpoint, save_hf_checkpoint)
from jaxgpu.models.gemma.config import Config
from jaxgpu.models.gemma.generate import (GenerateOutput, PagedCache, Sampling,
                                          cache_shardings, decode, decode_step, empty_cache,
                                          generate, prefill, resolve_cache, sample,
                                          shard_cache)
from jaxgpu.models.gemma.model import forward, hidden_states, loss
from jaxgpu.models.gemma.params import check_params, init_params, param_shapes
from jaxgpu.models.gemma.quantize import dequantize_params, quantize_params
from jaxgpu.models.gemma.sharding import (batch_sharding, param_shardings, param_specs,
                                          shard_batch, shard_params)
from jaxgpu.models.gemma.train import (AdamW, compute_params, init_opt_state, opt_state_specs,
                                       train_step)

__all__ = [
    "AdamW",
    "Config",
    "GenerateOutput",
    "PagedCache",
    "Sampling",
    "batch_sharding",
    "cache_shardings",
    "check_params",
    "compute_params",
    "config_from_hf",
    "decode",
    "decode_step",
    "dequantize_params",
    "empty_cache",
    "forward",
    "generate",
    "hf_config_from",
    "hidden_states",
    "init_opt_state",
    "init_params",
    "load_hf_checkpoint",
    "loss",
    "opt_state_specs",
    "param_shapes",
    "param_shardings",
    "param_specs",
    "quantize_params",
    "prefill",
    "resolve_cache",
    "sample",
    "save_hf_checkpoint",
    "shard_batch",
    "shard_cache",
    "shard_params",
    "train_step",
]
