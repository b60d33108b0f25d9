"""``python -m jaxgpu demo``: train a small Gemma to sort digits, then let it sort new ones.

The task is one whose success anyone can check: a prompt is a list of digits and ``>``, and
the answer is the same digits in ascending order, then the end token::

    7 3 9 3 1 >  1 3 3 7 9 <end>

Training rows pack several such examples one after another, each its own segment
(``segment_ids``; positions restart at 0), and the loss covers only the answers. The model
is jaxgpu.models.gemma (Gemma 2 architecture: softcapped attention, which cuDNN cannot run,
alternating sliding-window and global layers, GeGLU, the 1 + w RMSNorms), trained with
AdamW. After training, ``generate`` sorts held-out prompts of different lengths (greedy,
batched, one jitted decode loop) and the demo prints the exact-match accuracy and examples.
On a GPU it then times the training step with jaxgpu's kernels and with
``implementation='xla'`` (what the same model runs without jaxgpu: jax.nn attention, XLA
fusion) and prints both step times and the compiled programs' memory.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpu.models import gemma

PAD, END, SEP = 0, 1, 2  # digit d is token DIGIT0 + d
DIGIT0 = 3
VOCAB = 16


@dataclasses.dataclass(frozen=True)
class Setup:
  """Model and training sizes for one kind of machine."""

  d_model: int
  n_layers: int
  n_heads: int
  head_dim: int
  ffn_dim: int
  row_len: int  # tokens per training row (several packed examples)
  batch: int
  seconds: float  # training time budget
  lr: float
  dtype: str


# CPU: the whole demo (compile, 45 s of training, generation) in about a minute on 2 cores;
# measured there: about 600 steps, 70% of held-out prompts sorted exactly (a model of 128
# channels gets through 130 steps and 35%). GPU: rows of 2048 tokens and a model large
# enough for the kernels to matter (H100: 98% sorted after 40 s).
CPU = Setup(d_model=64, n_layers=3, n_heads=4, head_dim=16, ffn_dim=256, row_len=64,
            batch=16, seconds=45.0, lr=4e-3, dtype="float32")
GPU = Setup(d_model=1024, n_layers=8, n_heads=8, head_dim=128, ffn_dim=4096, row_len=2048,
            batch=16, seconds=90.0, lr=1e-3, dtype="bfloat16")
MIN_DIGITS, MAX_DIGITS = 3, 12


def config_for(setup: Setup) -> gemma.Config:
  # Window 16: local layers see about one example, global layers the whole packed row.
  return gemma.Config(
      version=2, vocab_size=VOCAB, d_model=setup.d_model, n_layers=setup.n_layers,
      n_heads=setup.n_heads, n_kv_heads=max(1, setup.n_heads // 2), head_dim=setup.head_dim,
      ffn_dim=setup.ffn_dim, query_pre_attn_scalar=float(setup.head_dim), sliding_window=16,
      layer_types=tuple("local" if i % 2 == 0 else "global" for i in range(setup.n_layers)),
      attn_logit_softcap=50.0, final_logit_softcap=30.0, max_seq_len=max(setup.row_len, 64),
      eos_token_id=END, pad_token_id=PAD)


def example(rng: np.random.Generator) -> tuple[list[int], list[int]]:
  """(prompt tokens ending in SEP, answer tokens ending in END)."""
  digits = rng.integers(0, 10, rng.integers(MIN_DIGITS, MAX_DIGITS + 1))
  return [DIGIT0 + int(d) for d in digits] + [SEP], [DIGIT0 + int(d) for d in np.sort(digits)
                                                    ] + [END]


def batch(rng: np.random.Generator, rows: int, row_len: int) -> dict:
  """Rows of packed examples: tokens, next-token targets, a mask on the answers, positions
  restarting per example, and segment ids (0 = padding at a row's end)."""
  out = {k: np.zeros((rows, row_len), np.int32) for k in ("tokens", "targets", "positions",
                                                          "segment_ids")}
  mask = np.zeros((rows, row_len), bool)
  for r in range(rows):
    at, seg = 0, 1
    while True:
      prompt, answer = example(rng)
      seq = prompt + answer
      if at + len(seq) > row_len:
        break
      n = len(seq)
      out["tokens"][r, at:at + n] = seq
      out["targets"][r, at:at + n - 1] = seq[1:]
      mask[r, at + len(prompt) - 1:at + n - 1] = True  # predict each answer token
      out["positions"][r, at:at + n] = np.arange(n)
      out["segment_ids"][r, at:at + n] = seg
      at, seg = at + n, seg + 1
  return {**{k: jnp.asarray(v) for k, v in out.items()}, "mask": jnp.asarray(mask)}


def text(tokens) -> str:
  return " ".join("|" if t == END else ">" if t == SEP else str(t - DIGIT0) for t in tokens
                  if t != PAD)


def train(params, config, setup: Setup, optimizer, implementation, rng) -> tuple:
  """Trains for setup.seconds (after the first, compiling step); prints progress."""
  opt_state = gemma.init_opt_state(params)
  step_fn = lambda p, o, b: gemma.train_step(p, o, b, config=config, optimizer=optimizer,
                                             implementation=implementation)
  t0 = time.perf_counter()
  params, opt_state, metrics = step_fn(params, opt_state, batch(rng, setup.batch,
                                                                setup.row_len))
  loss = float(metrics["loss"])
  print(f"  step    1  loss {loss:7.4f}  (compiled in {time.perf_counter() - t0:.1f} s)")
  tokens_per_step = setup.batch * setup.row_len
  start, step, last_print = time.perf_counter(), 1, time.perf_counter()
  while time.perf_counter() - start < setup.seconds:
    params, opt_state, metrics = step_fn(params, opt_state, batch(rng, setup.batch,
                                                                  setup.row_len))
    step += 1
    if time.perf_counter() - last_print > setup.seconds / 8:
      loss = float(metrics["loss"])  # blocks: the rate below includes the device time
      now = time.perf_counter()
      rate = (step - 1) * tokens_per_step / (now - start)
      print(f"  step {step:4d}  loss {loss:7.4f}  {rate:10,.0f} tokens/s")
      last_print = now
  loss = float(metrics["loss"])
  elapsed = time.perf_counter() - start
  print(f"  step {step:4d}  loss {loss:7.4f}  {(step - 1) * tokens_per_step / elapsed:10,.0f}"
        f" tokens/s  ({step} steps, {elapsed:.0f} s)")
  return params, loss


def evaluate(params, config, rng, implementation, n=256) -> float:
  """Greedy generation on n held-out prompts; prints examples, returns exact-match rate."""
  pairs = [example(rng) for _ in range(n)]
  out = gemma.generate(params, config, [p for p, _ in pairs], MAX_DIGITS + 2,
                       implementation=implementation)
  tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
  right = [list(tokens[i, :lengths[i]]) == answer for i, (_, answer) in enumerate(pairs)]
  for i in range(6):
    mark = "ok" if right[i] else "WRONG"
    print(f"  {text(pairs[i][0]):<26} {text(tokens[i, :lengths[i]]):<26} {mark}")
  return float(np.mean(right))


def _median_step_time(step_fn, params, opt_state, data, repeats=5, calls=5) -> float:
  params, opt_state, m = step_fn(params, opt_state, data)  # compile
  jax.block_until_ready(m)
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(calls):
      params, opt_state, m = step_fn(params, opt_state, data)
    jax.block_until_ready(m)
    times.append((time.perf_counter() - t0) / calls)
  return statistics.median(times)


def compare(params, config, setup: Setup, optimizer, rng) -> None:
  """Training step time and compiled memory, jaxgpu kernels vs implementation='xla'."""
  data = batch(rng, setup.batch, setup.row_len)
  tokens = setup.batch * setup.row_len
  print(f"jaxgpu vs implementation='xla': one training step on {setup.batch} x "
        f"{setup.row_len} tokens, median of 5 x 5 steps")
  times = {}
  for name, impl in (("jaxgpu", None), ("xla", "xla")):
    step_fn = lambda p, o, b, impl=impl: gemma.train_step(
        p, o, b, config=config, optimizer=optimizer, implementation=impl)
    p = jax.tree.map(jnp.copy, params)  # train_step donates (consumes) its inputs
    o = gemma.init_opt_state(p)
    mem = gemma.train_step.lower(p, o, data, config=config, optimizer=optimizer,
                                 implementation=impl).compile().memory_analysis()
    times[name] = _median_step_time(step_fn, p, o, data)
    # The compiled step's device memory: its arguments (parameters, moments, batch), its
    # outputs less the donated buffers they reuse, and its temporaries (activations).
    total = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
             + mem.temp_size_in_bytes) / 2**30
    print(f"  {name:<7} {times[name] * 1e3:8.2f} ms/step  {tokens / times[name]:12,.0f} "
          f"tokens/s  memory {total:6.2f} GiB (temporaries {mem.temp_size_in_bytes / 2**30:.2f})")
  print(f"  xla / jaxgpu step time: {times['xla'] / times['jaxgpu']:.2f}x")


def demo(seconds: float | None = None) -> int:
  on_gpu = jax.default_backend() in ("gpu", "cuda")
  setup = GPU if on_gpu else CPU
  if seconds is not None:
    setup = dataclasses.replace(setup, seconds=seconds)
  config = config_for(setup)
  device = jax.devices()[0]
  rng = np.random.default_rng(0)
  params = gemma.init_params(config, jax.random.key(0), jnp.dtype(setup.dtype))
  n_params = sum(x.size for x in jax.tree.leaves(params))
  print(f"jaxgpu demo: a Gemma 2 model ({setup.n_layers} layers, d_model {setup.d_model}, "
        f"{n_params / 1e6:.1f}M parameters, {setup.dtype}) learns to sort digits")
  print(f"  on {device.platform} ({device.device_kind}); rows of {setup.row_len} tokens "
        f"packing several examples (segment ids), batch {setup.batch}")
  optimizer = gemma.AdamW(learning_rate=setup.lr, b2=0.98, weight_decay=0.01, clip_norm=1.0)
  print(f"training for {setup.seconds:.0f} s with jaxgpu's kernels:")
  params, loss = train(params, config, setup, optimizer, None, rng)
  print("generating (greedy, held-out prompts of 3 to 12 digits):")
  accuracy = evaluate(params, config, np.random.default_rng(1), None)
  print(f"  sorted correctly: {accuracy:.1%} of 256")
  if on_gpu:
    compare(params, config, setup, optimizer, rng)
  # Chance is about 0%: a quarter sorted exactly means the model learned the task (a slow
  # or busy machine gets fewer steps in the same time).
  if not np.isfinite(loss) or accuracy < 0.25:
    print("demo FAILED: the model did not learn to sort", file=sys.stderr)
    return 1
  return 0
