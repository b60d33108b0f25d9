"""jaxgpu.models.gemma against transformers' own Gemma 2 and Gemma 3, on the GPU machine.

For each version the test builds a tiny random transformers model (Gemma2Config /
Gemma3TextConfig, a sliding window of 16, every weight random: transformers initializes the
norm weights to zero, which would hide a swapped norm), saves it with save_pretrained
(safetensors), loads the folder with load_hf_checkpoint and compares:
  * logits of a 48-token batch (3 windows long), float32, implementation=None and 'xla',
    against the torch model in float32;
  * the same in bfloat16 parameters against the same float32 torch logits;
  * greedy generation (temperature=0) from two prompts of different lengths in one batch,
    running past the window, against model.generate(do_sample=False) run per prompt without
    padding (so that transformers' padding conventions play no part);
  * save_hf_checkpoint's folder, loaded by transformers' from_pretrained, gives the original
    model's logits.
transformers runs on the CPU in float32 (true float32 products; a GPU could use TF32) and
with attn_implementation="eager", the one that applies Gemma 2's attention softcap in every
transformers release. JAX runs on the default device under default_matmul_precision
("highest") so that its float32 products are float32 too. The end-of-sequence token's
embedding row is zero: its logit is then 0 while the best of the other 511 random logits is
positive, so no generation stops early and every one crosses the window.
Skipped where torch or transformers is missing, and (the `gpu` marker) without a CUDA GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from jaxgpu.models import gemma  # noqa: E402
from jaxgpu.models.gemma.checkpoint import load_hf_checkpoint, save_hf_checkpoint  # noqa: E402

pytestmark = pytest.mark.gpu

VOCAB, WINDOW, EOS = 512, 16, 1
SEQ = 48                 # 3 windows: local layers see a strict subset of the keys
PROMPTS = (5, 23)        # the second prompt alone is longer than the window
NEW_TOKENS = 32

# Float32 logits: both sides compute in float32 and differ by rounding order only (CPU vs
# GPU sums, different tanh/exp), about 1e-6 relative per operation; after a few layers that
# stays well below 1e-4 of the logits' scale, while a mapping error (a transposed head, a
# swapped norm, a wrong RoPE theta, the softcap) changes logits by O(1) of their scale.
F32_TOL = 2e-4
# bfloat16 parameters and activations (8-bit significand: 2**-9 relative per rounding) vs
# float32: the 'xla' path must be within 10% of the logits' scale (a mapping error is O(1)),
# and the kernels' error at most twice the 'xla' path's plus 1% (the project's rule for
# low-precision kernels: no worse than the plain JAX program in the same precision).
BF16_XLA_TOL = 0.1
BF16_KERNEL_FACTOR, BF16_KERNEL_ATOL = 2.0, 0.01


def hf_config(version: int):
  """A tiny transformers config; no two of D, N*H, K*H, F, V coincide."""
  common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=160,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                max_position_embeddings=256, sliding_window=WINDOW,
                query_pre_attn_scalar=48,   # not head_dim: the scale must come from here
                rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=EOS, bos_token_id=2)
  if version == 2:
    # Small softcaps, so that both caps bend logits this model actually produces.
    return transformers.Gemma2Config(num_hidden_layers=4, attn_logit_softcapping=5.0,
                                     final_logit_softcapping=10.0, rope_theta=20000.0,
                                     **common)
  # Layers 2 (counting from 0) is global (pattern 3), the others slide; the global layers'
  # RoPE has its own theta and a linear scaling factor.
  return transformers.Gemma3TextConfig(num_hidden_layers=5, sliding_window_pattern=3,
                                       rope_theta=50000.0, rope_local_base_freq=2000.0,
                                       rope_scaling={"rope_type": "linear", "factor": 2.0},
                                       **common)


def randomize(model, seed: int) -> None:
  """Every weight random (in place): norms N(0, 0.3) (transformers starts them at 0, where
  all four norms of a layer act alike), the embedding N(0, 1) with a zero end-token row,
  linear weights N(0, 1/fan_in) (unit-scale activations)."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():   # the tied lm_head is the embedding: once
      noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
      if p.ndim == 1:
        p.copy_(0.3 * noise)
      elif "embed_tokens" in name:
        noise[EOS] = 0.0
        p.copy_(noise)
      else:
        p.copy_(noise / p.shape[1] ** 0.5)


@pytest.fixture(params=[2, 3], ids=["gemma2", "gemma3"], scope="module")
def hf_model(request, tmp_path_factory):
  """(the eager float32 transformers model read back from its folder, the folder)."""
  version = request.param
  folder = tmp_path_factory.mktemp(f"gemma{version}")
  cls = transformers.Gemma2ForCausalLM if version == 2 else transformers.Gemma3ForCausalLM
  model = cls(hf_config(version))
  randomize(model, seed=1000 + version)
  model.save_pretrained(folder)   # safetensors: the default since transformers 4.35
  # The reference is what transformers itself reads from the folder, in eager attention.
  ref = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
  return ref.float().eval(), folder


def torch_logits(model, tokens) -> np.ndarray:
  """(B, T) int tokens -> (B, T, V) float32 logits of the transformers model."""
  with torch.no_grad():
    return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def our_logits(params, config, tokens, implementation) -> np.ndarray:
  with jax.default_matmul_precision("highest"):
    out = gemma.forward(params, config, jnp.asarray(tokens, jnp.int32),
                        implementation=implementation)
  return np.asarray(out, np.float32)


def test_config_matches(hf_model):
  model, folder = hf_model
  _, config = load_hf_checkpoint(folder)
  hf = model.config
  kinds = {"sliding_attention": "local", "full_attention": "global"}
  assert config.layer_types == tuple(kinds[t] for t in hf.layer_types)
  assert "local" in config.layer_types and "global" in config.layer_types
  assert (config.sliding_window, config.d_model, config.n_heads, config.n_kv_heads,
          config.head_dim) == (WINDOW, 64, 4, 2, 64)
  assert config.query_pre_attn_scalar == 48.0
  if config.version == 2:
    assert (config.attn_logit_softcap, config.final_logit_softcap) == (5.0, 10.0)
    assert config.rope_theta_global == config.rope_theta_local == 20000.0
  else:
    assert (config.rope_theta_global, config.rope_theta_local, config.rope_scale_global) == \
      (50000.0, 2000.0, 2.0)
    assert config.qk_norm and config.attn_logit_softcap is None


@pytest.mark.parametrize("impl", [None, "xla"])
def test_logits_float32(hf_model, rng, impl):
  model, folder = hf_model
  params, config = load_hf_checkpoint(folder)
  tokens = rng.integers(3, VOCAB, size=(2, SEQ))
  ref = torch_logits(model, tokens)
  got = our_logits(params, config, tokens, impl)
  scale = float(np.max(np.abs(ref)))
  err = float(np.max(np.abs(got - ref)))
  assert err <= F32_TOL * scale, (f"max |ours - transformers| = {err:.3g} > {F32_TOL} * "
                                  f"{scale:.3g} (implementation={impl})")


def test_logits_bfloat16(hf_model, rng):
  model, folder = hf_model
  params, config = load_hf_checkpoint(folder, dtype=jnp.bfloat16)
  assert params["layers"][0]["q"].dtype == jnp.bfloat16
  tokens = rng.integers(3, VOCAB, size=(2, SEQ))
  ref = torch_logits(model, tokens)
  scale = float(np.max(np.abs(ref)))
  err = {impl: float(np.max(np.abs(our_logits(params, config, tokens, impl) - ref)))
         for impl in ("xla", None)}
  assert err["xla"] <= BF16_XLA_TOL * scale, f"'xla' bf16 error {err['xla']:.3g}, scale {scale}"
  bound = BF16_KERNEL_FACTOR * err["xla"] + BF16_KERNEL_ATOL * scale
  assert err[None] <= bound, f"kernel bf16 error {err[None]:.3g} > {bound:.3g} ('xla': {err})"


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
  """transformers' greedy continuation of one unpadded prompt: n new tokens."""
  ids = torch.tensor([prompt], dtype=torch.long)
  with torch.no_grad():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         do_sample=False)
  new = out[0, len(prompt):].tolist()
  assert len(new) == n, f"transformers stopped after {len(new)} of {n} tokens: {new}"
  return new


def our_greedy(params, config, prompts: list[list[int]], n: int, implementation):
  """Our greedy continuations of a batch of prompts: (B, n) int tokens."""
  with jax.default_matmul_precision("highest"):
    out = gemma.generate(params, config, prompts, n, temperature=0.0,
                         implementation=implementation)
  tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
  assert tokens.shape == (len(prompts), n)
  assert (lengths == n).all(), f"a row stopped early: lengths {lengths}, tokens {tokens}"
  return tokens.tolist()


def first_difference(ours, theirs) -> int | None:
  return next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)


def check_near_tie(model, prefix, a, b, tol, what) -> None:
  """Tokens a (ours) and b (transformers') differ after `prefix`: acceptable only where
  transformers' own float32 logits of a and b are within tol (a near tie, which rounding
  may break either way)."""
  logits = torch_logits(model, [prefix])[0, -1]
  gap = abs(float(logits[a]) - float(logits[b]))
  assert gap <= tol, (f"{what}: after {len(prefix)} tokens ours is {a}, transformers' is {b}, "
                      f"and transformers' logits of the two differ by {gap:.3g} > {tol:.3g}: "
                      "not a near tie")


@pytest.mark.parametrize("impl", [None, "xla"])
def test_greedy_float32(hf_model, rng, impl):
  """Token for token, past the window. Where the two differ at a near tie, our generation
  restarts from the prefix plus transformers' token, so the comparison still covers every
  step (at most 3 restarts a prompt: more would mean the tolerance hides real errors)."""
  assert min(PROMPTS) + NEW_TOKENS > 2 * WINDOW
  model, folder = hf_model
  params, config = load_hf_checkpoint(folder)
  prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in PROMPTS]
  theirs = [hf_greedy(model, p, NEW_TOKENS) for p in prompts]
  ours = our_greedy(params, config, prompts, NEW_TOKENS, impl)
  scale = float(np.max(np.abs(torch_logits(model, [prompts[1] + theirs[1]]))))
  for i, prompt in enumerate(prompts):
    done, row, restarts = 0, ours[i], 0
    while (j := first_difference(row, theirs[i][done:])) is not None:
      step = done + j
      check_near_tie(model, prompt + theirs[i][:step], row[j], theirs[i][step],
                     F32_TOL * scale, f"prompt {i}, step {step}")
      restarts += 1
      assert restarts <= 3, f"prompt {i}: more than 3 near ties"
      done = step + 1
      if done == NEW_TOKENS:
        break
      row = our_greedy(params, config, [prompt + theirs[i][:done]], NEW_TOKENS - done,
                       impl)[0]


def test_greedy_bfloat16(hf_model, rng):
  """bfloat16 parameters, jaxgpu's kernels: equal to transformers' float32 greedy tokens up
  to the first difference. There, transformers' logits of the two tokens must differ by at
  most twice our bfloat16 forward's largest logit error at that position: only then can
  rounding flip their order (a generation that disagrees with our own forward cannot pass)."""
  model, folder = hf_model
  params, config = load_hf_checkpoint(folder, dtype=jnp.bfloat16)
  prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in PROMPTS]
  theirs = [hf_greedy(model, p, NEW_TOKENS) for p in prompts]
  ours = our_greedy(params, config, prompts, NEW_TOKENS, None)
  for i, prompt in enumerate(prompts):
    j = first_difference(ours[i], theirs[i])
    if j is not None:
      prefix = prompt + theirs[i][:j]
      err = np.abs(our_logits(params, config, [prefix], None)[0, -1]
                   - torch_logits(model, [prefix])[0, -1])
      check_near_tie(model, prefix, ours[i][j], theirs[i][j], 2 * float(err.max()),
                     f"bf16 prompt {i}, step {j}")


def test_save_loads_in_transformers(hf_model, tmp_path, rng):
  """save_hf_checkpoint's folder (config.json from hf_config_from) is the same model to
  transformers: equal logits from the same float32 weights."""
  model, folder = hf_model
  params, config = load_hf_checkpoint(folder)
  save_hf_checkpoint(params, config, tmp_path)
  again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
  again = again.float().eval()
  assert type(again) is type(model)
  assert list(again.config.layer_types) == list(model.config.layer_types)
  tokens = rng.integers(3, VOCAB, size=(2, SEQ))
  ref = torch_logits(model, tokens)
  got = torch_logits(again, tokens)
  np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * float(np.max(np.abs(ref))))
