"""Gemma with weight-only quantized projections (jaxgpu.models.gemma.quantize_params):
the forward pass equals the float model run on the dequantized weights, the quantization
error against the float model is what int8 / int4 rounding gives, and generation runs the
quantized kernel (jaxgpu_qlinear_fwd in the decode step's HLO)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgpu
from jaxgpu.models import gemma

import gemma_util as U
from gemma_util import exact_matmuls, kernels_at_every_size  # noqa: F401 (autouse fixtures)

KERNEL = U.KERNEL_IMPL


@pytest.mark.parametrize("fuse", (True, False), ids=("fused", "separate"))
@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("version", (2, 3))
def test_quantized_forward_is_the_dequantized_model(bits, version, fuse):
  config = gemma.Config.tiny(version)
  params = U.random_params(config, seed=bits + version)
  qparams = gemma.quantize_params(params, config, bits=bits, group_size=32, fuse=fuse)
  assert ("qkv" in qparams["layers"][0]) == fuse and ("gate_up" in qparams["layers"][0]) == fuse
  gemma.check_params(qparams, config)
  tokens = jnp.asarray(np.random.default_rng(0).integers(2, config.vocab_size, (2, 11)),
                       jnp.int32)
  got = gemma.forward(qparams, config, tokens, implementation=KERNEL)
  want = gemma.forward(gemma.dequantize_params(qparams, config, params["embed"].dtype),
                       config, tokens, implementation="xla")
  full = gemma.forward(params, config, tokens, implementation="xla")
  scale = float(jnp.max(jnp.abs(want)))
  assert U.max_abs(got, want) <= 1e-4 * scale, U.max_abs(got, want)
  # The quantization's own cost, RMS relative to the logits' RMS: what rounding 7 layers of
  # random weights to 255 levels (int8) or 16 (int4, group 32) gives, about 1% and 10%.
  rms = lambda a: float(jnp.sqrt(jnp.mean(jnp.square(a))))
  rel = rms(want - full) / rms(full)
  assert 0 < rel <= (0.03 if bits == 8 else 0.25), rel


def test_quantized_generation_runs_the_quantized_kernel():
  config = gemma.Config.tiny(2)
  params = U.random_params(config, seed=5)
  qparams = gemma.quantize_params(params, config, bits=4, group_size=32)
  out = gemma.generate(qparams, config, [[3, 4, 5], [6, 7]], 4, implementation=KERNEL)
  want = gemma.generate(gemma.dequantize_params(qparams, config), config,
                        [[3, 4, 5], [6, 7]], 4, implementation="xla")
  assert np.array_equal(np.asarray(out.tokens), np.asarray(want.tokens))
  # bf16 activations: the quantized kernel's dtype (a float32 x takes the dense route on a
  # GPU).
  qparams16 = gemma.quantize_params(U.cast(params, jnp.bfloat16), config, bits=4,
                                    group_size=32)
  cache = gemma.empty_cache(config, 2, 16, jnp.bfloat16)
  step = lambda p, c, t, pos: gemma.decode_step(p, config, c, t, pos, implementation=KERNEL)
  hlo = jax.jit(step).lower(qparams16, cache, jnp.zeros((2,), jnp.int32),
                            jnp.zeros((2,), jnp.int32)).compile()
  assert "jaxgpu_qlinear_fwd" in hlo.as_text()


def test_check_params_rejects_a_misshapen_quantized_weight():
  config = gemma.Config.tiny(2)
  params = U.random_params(config, seed=1)
  qparams = gemma.quantize_params(params, config, bits=8)
  bad = dict(qparams["layers"][0])
  bad["o"] = jaxgpu.quantize_weight(jnp.ones((16, 8), jnp.float32), bits=8, group_size=None)
  with pytest.raises(ValueError, match="'o'"):
    gemma.check_params({**qparams, "layers": [bad] + qparams["layers"][1:]}, config)
  # A fused q, k, v matrix one head short.
  bad = dict(qparams["layers"][0])
  k, n = bad["qkv"].shape
  bad["qkv"] = jaxgpu.quantize_weight(jnp.ones((k, n - config.head_dim), jnp.float32), bits=8,
                                      group_size=None)
  with pytest.raises(ValueError, match="'qkv'"):
    gemma.check_params({**qparams, "layers": [bad] + qparams["layers"][1:]}, config)
  # Fused and separate parts of one group together.
  bad = dict(qparams["layers"][0], q=params["layers"][0]["q"])
  with pytest.raises(ValueError, match="unexpected entries"):
    gemma.check_params({**qparams, "layers": [bad] + qparams["layers"][1:]}, config)
