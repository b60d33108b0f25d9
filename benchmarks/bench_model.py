"""End-to-end benchmark: jaxgpu.models.gemma with jaxgpu's kernels vs implementation='xla'.

    python3 benchmarks/bench_model.py --out $OUT                      # GPU: everything
    python3 benchmarks/bench_model.py --parts train --models gemma2_2b --out $OUT
    python3 benchmarks/bench_model.py --quick --no-write              # CPU smoke test (tiny)

Both implementations run the same model code in the same process ('cuda' = implementation
None, jaxgpu's kernels; 'xla' = what a careful JAX user writes without jaxgpu:
jax.nn.dot_product_attention, which takes cuDNN where it can, the einsum reference where
cuDNN cannot (Gemma 2's softcap), XLA fusion for the rest). bf16 parameters and
activations, float32 AdamW moments.

Parts:
  train_max  each implementation at the largest batch (powers of two) its training step
           fits at sequence 4096: the batch, tokens/s (vs anchor: tokens/s over 'xla''s at
           its own largest batch) and memory.
  train    one training step (forward + backward + AdamW, jitted, parameters and moments
           donated) at sequence 4096, the batch given per model (the largest that fits
           both implementations on an 80 GB H100): step time, tokens/s, MFU, peak memory.
  prefill  one 2048-token prompt (batch 1): time to the first token's logits.
  decode   the jitted decode loop (`decode`: one while_loop, greedy sampling included, no
           host round trip), 64 tokens per row after a context of 4k or 32k tokens, batch 1,
           8 and 64: tokens/s, and the roofline beside it. 'cuda' runs the paged KV cache
           (jaxgpu.paged_attention_with_update, generate's default with jaxgpu's
           kernels), 'contig' the same kernels on the contiguous cache
           (jaxgpu.dot_product_attention over every slot, masked), 'xla' the contiguous
           cache.

FLOPs (MFU and TFLOP/s): 2 per multiply-add of every matmul the model needs, counted from
the config: the q/k/v/o projections, the MLP and the tied output projection (2 * D * V per
token), plus attention's two products over the keys each query may see (causal: (t+1)/2 on
average; a sliding-window layer at most its window). Training = 3x forward (the backward
pass computes two products per forward one); no recomputation is counted. MFU divides by
the H100 SXM's dense bf16 peak, 989.4 TFLOP/s.

Decode roofline: a step must read every parameter once (the output projection reads the
whole embedding) and each row's keys and values for the slots it attends to; at the copy
rate measured in this run that takes bytes / copy_rate. The GB/s and % ceil columns of a
decode record are those bytes over the measured time, so % ceil is the share of the
roofline reached. A case whose KV cache does not fit is reported as skipped, not run.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time

# The batch search compares a step's memory with the device's limit: without this, JAX's
# default 75% preallocation sets the limit (59 of 80 GB) and both the search and XLA's own
# step (its allocator retries under pressure) come out wrong.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, also under `python -P`

import harness  # noqa: E402
from benchlib import record  # noqa: E402

FAMILY = "model"
ANCHOR = "xla"
H100_BF16_PEAK_TFLOPS = 989.4  # dense, SXM5 (NVIDIA's datasheet): the MFU denominator
TRAIN_SEQ = 4096
# The first batch tried at sequence 4096; halved until both implementations' compiled steps
# fit the device (XLA's memory analysis), so that both run the same batch.
TRAIN_BATCH = {"gemma2_2b": 4, "gemma3_1b": 8}
PREFILL_LEN = 2048
DECODE_CONTEXTS = (4096, 32768)
DECODE_BATCHES = (1, 8, 64)
DECODE_TOKENS = 64
# The target: batch-1 bf16 decode of gemma2_2b at a 4k context within 1.5x of its
# roofline (the record's time <= 1.5 x the roofline time, i.e. >= 66.7% of it).
DECODE_TARGET = ("gemma2_2b", 1, 4096, 1.5)


@dataclasses.dataclass
class Impl:
  name: str  # record name: 'cuda' (jaxgpu's kernels) or 'xla'; decode adds 'contig' and
             # 'cuda-int8' / 'cuda-int4' (quantized projection weights)
  arg: str | None  # the model's implementation= argument
  cache: str | None = None  # decode: the KV cache's layout (None: the implementation's)
  bits: int = 16  # decode: the projection weights' bits (gemma.quantize_params below 16)


def _impls(bench) -> list[Impl]:
  names = harness.default_implementations(bench.args)
  return [Impl(n, "xla" if n == "xla" else None) for n in names]


def _decode_impls(bench) -> list[Impl]:
  """jaxgpu's kernels on the paged cache (generate's default with them), the same kernels
  on the contiguous cache ('contig': what the paged cache replaced), and 'xla' on the
  contiguous cache."""
  out = []
  for impl in _impls(bench):
    if impl.arg == "xla":
      out.append(Impl(impl.name, impl.arg, "contiguous"))
    else:
      out += [Impl(impl.name, impl.arg, "paged"), Impl("contig", impl.arg, "contiguous")]
      out += [Impl(f"{impl.name}-int{bits}", impl.arg, "paged", bits)
              for bits in _weight_bits(bench)]
  return out


def _weight_bits(bench) -> list[int]:
  """The quantized weights --weights asks for (int8 / int4; bf16 is always run)."""
  names = [w.strip() for w in bench.args.weights.split(",") if w.strip()]
  return [int(w[3:]) for w in names if w in ("int8", "int4")]


# Quantized decode: int8 with one scale per column (symmetric), int4 with a scale and zero
# point per 128 rows (GPTQ-style).
QUANT_GROUP = {8: None, 4: 128}


def _quality(config, params, qparams) -> str:
  """Logit error of the quantized model against the bf16 one on held-out random sequences
  (2 x 512 tokens): RMS relative to the logits' RMS, and the share of positions whose
  argmax agrees."""
  import jax
  import jax.numpy as jnp

  from jaxgpu.models import gemma

  tokens = jax.random.randint(jax.random.key(7), (2, 512), 2, config.vocab_size)
  ref = gemma.forward(params, config, tokens)
  got = gemma.forward(qparams, config, tokens)
  rms = lambda a: float(jnp.sqrt(jnp.mean(jnp.square(a.astype(jnp.float32)))))
  agree = float(jnp.mean(jnp.argmax(ref, -1) == jnp.argmax(got, -1)))
  return f"logits {rms(got - ref) / rms(ref):.2%} RMS off bf16, argmax agrees {agree:.1%}"


def _config(name: str, quick: bool):
  from jaxgpu.models import gemma

  if quick:
    return gemma.Config.tiny(3 if "gemma3" in name else 2)
  return getattr(gemma.Config, name)()


# ---- FLOPs and bytes ---------------------------------------------------------------------------


def _param_sizes(config) -> list[tuple[int, ...]]:
  import jax

  from jaxgpu.models import gemma

  return jax.tree.leaves(gemma.param_shapes(config), is_leaf=lambda s: isinstance(s, tuple))


def matmul_params(config) -> int:
  """Weights every token multiplies by: the matrices (the embedding counted once, as the
  output matmul), not the norm vectors."""
  return sum(math.prod(s) for s in _param_sizes(config) if len(s) > 1)


def param_bytes(config, itemsize=2) -> int:
  return itemsize * sum(math.prod(s) for s in _param_sizes(config))


def visible_keys(config, layer: int, t: int) -> float:
  """Keys a query sees on average in a causal sequence of t tokens."""
  if config.is_local(layer) and config.sliding_window < t:
    w = config.sliding_window
    return (w * (w + 1) / 2 + (t - w) * w) / t
  return (t + 1) / 2


def forward_flops(config, batch: int, t: int) -> float:
  attn = sum(4 * config.n_heads * config.head_dim * visible_keys(config, i, t)
             for i in range(config.n_layers))
  return batch * t * (2 * matmul_params(config) + attn)


def decode_bytes(config, batch: int, context: int, itemsize=2, params=None) -> int:
  """Bytes a decode step must read: the parameters (those of `params` as stored, e.g.
  quantized; else the config's at itemsize), and each row's cached keys and values for the
  slots it attends to (a local layer: its window)."""
  kv = 0
  for i in range(config.n_layers):
    slots = min(config.sliding_window, context) if config.is_local(i) else context
    kv += 2 * slots * config.n_kv_heads * config.head_dim * itemsize
  if params is None:
    weights = param_bytes(config, itemsize)
  else:
    import jax
    weights = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params))
  return weights + batch * kv


# ---- timing --------------------------------------------------------------------------------------


def _median(run, repeats: int) -> tuple[float, float, float]:
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    run()
    times.append(time.perf_counter() - t0)
  return statistics.median(times), min(times), max(times)


def _memory_gib(compiled) -> float:
  """Device memory of one compiled program: arguments, outputs that do not reuse a donated
  buffer, and temporaries (XLA's buffer assignment; the peak while it runs)."""
  m = compiled.memory_analysis()
  total = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
           + m.temp_size_in_bytes)
  return total / 2**30


def _device_limit_gib() -> float | None:
  import jax

  stats = jax.devices()[0].memory_stats() or {}
  limit = stats.get("bytes_limit")
  return limit / 2**30 if limit else None


def _record(bench, *, op, case, pass_, shape, impl, times, calls, flops=None, bytes_=None,
            notes=None) -> record.Record:
  median, lo, hi = times
  rec = record.Record(family=FAMILY, op=op, case=case, shape=list(shape), dtype="bfloat16",
                      implementation=impl, pass_=pass_, time_us=median * 1e6,
                      time_min_us=lo * 1e6, time_max_us=hi * 1e6, calls=calls,
                      repeats=bench.config.repeats, anchor=ANCHOR, notes=notes)
  if flops:
    rec.flops = float(flops)
    rec.tflops = flops / median / 1e12
  if bytes_:
    rec.bytes = int(bytes_)
    rec.gbs = bytes_ / median / 1e9
    ceiling = bench.copy_gbs or bench.ceiling_gbs
    if ceiling:
      rec.pct_ceiling = 100.0 * rec.gbs / ceiling
  bench.records.append(rec)
  return rec


def _anchor_ratios(records) -> None:
  anchor = [r for r in records if r.implementation == ANCHOR]
  for r in records:
    if anchor:
      r.vs_anchor = anchor[0].time_us / r.time_us


# ---- parts ------------------------------------------------------------------------------------


def _train_inputs(config, b, t, *, abstract: bool):
  """(params, opt_state, batch): arrays, or their shapes only (to compile without memory)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxgpu.models import gemma

  def make():
    params = gemma.init_params(config, jax.random.key(0), jnp.bfloat16)
    return params, gemma.init_opt_state(params)

  if abstract:
    params, opt_state = jax.eval_shape(make)
    spec = jax.ShapeDtypeStruct((b, t), jnp.int32)
    return params, opt_state, {"tokens": spec, "targets": spec}
  params, opt_state = make()
  tokens = np.random.default_rng(0).integers(0, config.vocab_size, (b, t + 1))
  tokens = jnp.asarray(tokens, jnp.int32)
  return params, opt_state, {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}


def _compile_train(config, b, t, impl_arg):
  """(compiled train_step, its memory in GiB, compile seconds), from shapes alone."""
  from jaxgpu.models import gemma

  params, opt_state, batch = _train_inputs(config, b, t, abstract=True)
  optimizer = gemma.AdamW(learning_rate=1e-5, weight_decay=0.01, clip_norm=1.0)
  t0 = time.perf_counter()
  compiled = gemma.train_step.lower(params, opt_state, batch, config=config,
                                    optimizer=optimizer, implementation=impl_arg).compile()
  return compiled, _memory_gib(compiled), time.perf_counter() - t0


def _time_train_steps(bench, config, b: int, t: int, step_fn):
  """(per-step median, min, max, calls) of a compiled train step on fresh parameters and
  moments (one implementation's on the device at a time; donated from step to step)."""
  import jax

  state = list(_train_inputs(config, b, t, abstract=False))
  try:
    def step():
      state[0], state[1], m = step_fn(*state)
      return m

    jax.block_until_ready(step())  # warm up
    calls = 1 if bench.quick else 3

    def run():
      for _ in range(calls):
        m = step()
      jax.block_until_ready(m)

    median, lo, hi = _median(run, bench.config.repeats)
    return (median / calls, lo / calls, hi / calls), calls
  finally:
    state.clear()


def train(bench, name: str) -> None:

  config = _config(name, bench.quick)
  t = 64 if bench.quick else TRAIN_SEQ
  b = 2 if bench.quick else (bench.args.train_batch or TRAIN_BATCH[name])
  limit = _device_limit_gib()
  impls = _impls(bench)
  while True:  # the largest batch (halving) at which every implementation fits
    compiled = {}
    for impl in impls:
      try:
        compiled[impl.name] = _compile_train(config, b, t, impl.arg)
      except Exception as e:
        bench._fail(f"train {name} B{b} {impl.name} (compile)", e)
    too_big = [n for n, c in compiled.items() if limit and c[1] > 0.95 * limit]
    if not too_big or b == 1:
      break
    print(f"  train {name} B{b}: {', '.join(too_big)} needs more than 95% of the device's "
          f"{limit:.0f} GiB; halving the batch", flush=True)
    b //= 2
  flops = 3 * forward_flops(config, b, t)
  recs = []
  for impl in impls:
    if impl.name not in compiled:
      continue
    step_fn, mem, compile_s = compiled.pop(impl.name)
    if limit and mem > 0.95 * limit:
      bench.skip(f"train {name} B{b} {impl.name}", f"needs {mem:.1f} GiB of {limit:.1f}")
      continue
    try:
      times, calls = _time_train_steps(bench, config, b, t, step_fn)
    except Exception as e:  # one implementation failing must not cost the other its figure
      bench._fail(f"train {name} {impl.name}", e)
      continue
    tok_s = b * t / times[0]
    mfu = flops / times[0] / (H100_BF16_PEAK_TFLOPS * 1e12)
    notes = (f"{tok_s:,.0f} tokens/s, MFU {mfu:.1%}, memory {mem:.1f} GiB, "
             f"compile {compile_s:.0f} s")
    print(f"  train {name:<10} B{b} T{t} {impl.name:<5} {times[0] * 1e3:9.1f} ms  {notes}",
          flush=True)
    recs.append(_record(bench, op=f"train {name}", case=f"B{b} T{t}", pass_="train",
                        shape=(b, t), impl=impl.name, times=times, calls=calls, flops=flops,
                        notes=notes))
  _anchor_ratios(recs)


def _largest_fitting_batch(bench, name, config, t, impl, start: int, doublings: int):
  """The largest batch (start halved or doubled, at most `doublings` times up) whose
  compiled step fits 95% of the device: (batch, (compiled, GiB, compile s)) or None."""
  limit = _device_limit_gib()
  fits = lambda c: not limit or c[1] <= 0.95 * limit
  b, best = start, None
  while True:
    try:
      compiled = _compile_train(config, b, t, impl.arg)
    except Exception as e:
      bench._fail(f"train_max {name} B{b} {impl.name} (compile)", e)
      return None
    if fits(compiled):
      best = (b, compiled)
      if doublings == 0:
        return best
      doublings -= 1
      b *= 2
    elif best is not None or b == 1:
      return best
    else:
      b //= 2


def train_max(bench, name: str) -> None:
  """Each implementation at the largest batch its training step fits (sequence 4096): the
  memory a model's parts keep sets the batch, and the batch the throughput. vs anchor is
  tokens/s over 'xla''s at its own largest batch."""

  config = _config(name, bench.quick)
  t = 64 if bench.quick else TRAIN_SEQ
  start = 1 if bench.quick else (bench.args.train_batch or TRAIN_BATCH[name])
  recs, tok = [], {}
  for impl in _impls(bench):
    found = _largest_fitting_batch(bench, name, config, t, impl, start,
                                   1 if bench.quick else 3)
    if found is None:
      continue
    b, (step_fn, mem, compile_s) = found
    try:
      times, calls = _time_train_steps(bench, config, b, t, step_fn)
    except Exception as e:
      bench._fail(f"train_max {name} {impl.name}", e)
      continue
    tok[impl.name] = b * t / times[0]
    notes = (f"largest batch that fits: B{b}; {tok[impl.name]:,.0f} tokens/s, memory "
             f"{mem:.1f} GiB")
    print(f"  train_max {name:<10} {impl.name:<5} B{b} {times[0] * 1e3:9.1f} ms  {notes}",
          flush=True)
    recs.append(_record(bench, op=f"train {name}", case=f"largest batch T{t}",
                        pass_="train", shape=(b, t), impl=impl.name, times=times, calls=calls,
                        flops=3 * forward_flops(config, b, t), notes=notes))
  for r in recs:
    if ANCHOR in tok:
      r.vs_anchor = tok[r.implementation] / tok[ANCHOR]


def prefill(bench, name: str) -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxgpu.models import gemma

  config = _config(name, bench.quick)
  t = 32 if bench.quick else PREFILL_LEN
  params = gemma.init_params(config, jax.random.key(0), jnp.bfloat16)
  tokens = jnp.asarray(np.random.default_rng(0).integers(2, config.vocab_size, (1, t)),
                       jnp.int32)
  lengths = jnp.full((1,), t, jnp.int32)
  recs = []
  for impl in _impls(bench):
    fn = lambda: gemma.prefill(params, config, tokens, lengths, cache_len=t + DECODE_TOKENS,
                               implementation=impl.arg)
    try:
      jax.block_until_ready(fn())
      times = _median(lambda: jax.block_until_ready(fn()), bench.config.repeats)
    except Exception as e:
      bench._fail(f"prefill {name} {impl.name}", e)
      continue
    print(f"  prefill {name:<10} T{t} {impl.name:<5} {times[0] * 1e3:9.2f} ms", flush=True)
    recs.append(_record(bench, op=f"prefill {name}", case=f"B1 T{t}", pass_="prefill",
                        shape=(1, t), impl=impl.name, times=times, calls=1,
                        flops=forward_flops(config, 1, t)))
  _anchor_ratios(recs)


def decode(bench, name: str) -> None:
  import jax
  import jax.numpy as jnp

  from jaxgpu.models import gemma

  config = _config(name, bench.quick)
  params = gemma.init_params(config, jax.random.key(0), jnp.bfloat16)
  n = 8 if bench.quick else DECODE_TOKENS
  contexts = (40,) if bench.quick else tuple(int(c) for c in bench.args.contexts.split(","))
  quantized, quality = {}, {}
  for bits in _weight_bits(bench):
    quantized[bits] = gemma.quantize_params(params, config, bits=bits,
                                            group_size=QUANT_GROUP[bits])
    quality[bits] = _quality(config, params, quantized[bits])
    print(f"  decode {name} int{bits}: {quality[bits]}", flush=True)
  batches = (1, 2) if bench.quick else tuple(int(b) for b in bench.args.batches.split(","))
  limit = _device_limit_gib()
  copy_gbs = bench.copy_gbs or bench.ceiling_gbs
  for context in contexts:
    for b in batches:
      cache_len = context + n
      need = decode_bytes(config, b, cache_len) / 2**30 + 2  # + logits, activations
      if limit and need > 0.9 * limit:
        bench.skip(f"decode {name} B{b} ctx{context}",
              f"parameters + KV cache {need:.0f} GiB > 90% of the device's {limit:.0f} GiB")
        continue
      positions = jnp.full((b,), context, jnp.int32)
      logits = jnp.zeros((b, config.vocab_size), jnp.float32)
      recs = []
      for impl in _decode_impls(bench):
        weights = params if impl.bits == 16 else quantized[impl.bits]
        bytes_ = decode_bytes(config, b, context, params=weights)
        roofline_s = bytes_ / (copy_gbs * 1e9) if copy_gbs else None
        # The cache is donated to the loop: a fresh one per call, made outside the timing.
        def once():
          cache = gemma.empty_cache(config, b, cache_len, cache=impl.cache)
          jax.block_until_ready(cache)
          t0 = time.perf_counter()
          out, _ = gemma.decode(weights, config, cache, logits, positions, jax.random.key(0),
                                -1, max_new_tokens=n, implementation=impl.arg)
          jax.block_until_ready(out)
          return time.perf_counter() - t0

        try:
          once()  # compile
          times = sorted(once() for _ in range(bench.config.repeats))
        except Exception as e:
          bench._fail(f"decode {name} B{b} ctx{context} {impl.name}", e)
          continue
        # The loop samples n tokens per row from n - 1 steps (the first comes from the
        # prefill's logits): per-step time = loop time / (n - 1).
        per = [s / (n - 1) for s in times]
        median = statistics.median(per)
        tok_s = b / median
        notes = f"{tok_s:,.0f} tokens/s"
        if roofline_s:
          notes += (f"; roofline {roofline_s * 1e3:.2f} ms/step = {b / roofline_s:,.0f} "
                    f"tokens/s; {median / roofline_s:.2f}x roofline")
        if impl.bits < 16:
          notes += f"; {quality[impl.bits]}"
        print(f"  decode {name:<10} B{b:<3} ctx{context:<6} {impl.name:<6} "
              f"{median * 1e3:8.3f} ms/step  {notes}", flush=True)
        rec = _record(bench, op=f"decode {name}", case=f"B{b} ctx{context}", pass_="decode",
                      shape=(b, context), impl=impl.name, times=(median, per[0], per[-1]),
                      calls=n - 1, bytes_=bytes_, notes=notes)
        if (name, b, context) == DECODE_TARGET[:3] and roofline_s and impl.cache == "paged":
          rec.target = f"<= {DECODE_TARGET[3]}x roofline"
          rec.target_met = median <= DECODE_TARGET[3] * roofline_s
        recs.append(rec)
      _anchor_ratios(recs)


PARTS = {"train": train, "train_max": train_max, "prefill": prefill, "decode": decode}


def _stored_records_not_rerun(bench, family: str) -> list:
  """The stored records of this family that the run did not measure again (a family is
  replaced whole when written): a run of one model, context or weight kind keeps the other
  figures."""
  import json

  path = harness.RESULTS_DIR / f"{bench.slug}.json"
  if not path.exists():
    return []
  entry = json.loads(path.read_text()).get("families", {}).get(family, {})
  fresh = {(r.op, r.case, r.pass_, r.implementation) for r in bench.records}
  keep = [record.Record.from_json(r) for r in entry.get("records", [])
          if (r["op"], r["case"], r["pass"], r["implementation"]) not in fresh]
  # The family is written with this run's commit: a kept record names the run that
  # measured it, as harness.merge_family tags the ops a partial run leaves out.
  for r in keep:
    r.measured = r.measured or {"commit": entry.get("commit"), "date": entry.get("date")}
  if keep:
    print(f"# {family}: keeping {len(keep)} stored records not measured again "
          f"(measured at {entry.get('commit')})", flush=True)
  return keep


def _extend(p: argparse.ArgumentParser) -> None:
  p.add_argument("--models", default="gemma2_2b,gemma3_1b",
                 help="comma-separated Config presets (default: gemma2_2b,gemma3_1b)")
  p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {list(PARTS)}")
  p.add_argument("--weights", default="bf16,int8,int4",
                 help="decode: the projection weights, of bf16,int8,int4 (bf16 always runs)")
  p.add_argument("--contexts", default=",".join(map(str, DECODE_CONTEXTS)),
                 help="decode: comma-separated context lengths")
  p.add_argument("--batches", default=",".join(map(str, DECODE_BATCHES)),
                 help="decode: comma-separated batch sizes")
  p.add_argument("--train-batch", type=int, default=None,
                 help="the first training batch tried (default: per model)")


def main(argv=None) -> int:
  """One results family per part (model_train, model_prefill, model_decode), so that a
  part re-run on its own replaces only its own figures."""
  pre = argparse.ArgumentParser(add_help=False)
  _extend(pre)
  known, _ = pre.parse_known_args(argv)
  parts = [p.strip() for p in known.parts.split(",") if p.strip()]
  for part in parts:
    if part not in PARTS:
      raise SystemExit(f"--parts: unknown part {part!r}; parts: {list(PARTS)}")
  status = 0
  for part in parts:
    def run(bench, part=part):
      models = [m.strip() for m in bench.args.models.split(",") if m.strip()]
      for name in models:
        print(f"# {part} {name}", flush=True)
        PARTS[part](bench, name)
      if not bench.quick:
        bench.records[:0] = _stored_records_not_rerun(bench, f"{FAMILY}_{part}")

    status |= harness.main(f"{FAMILY}_{part}", run, argv=argv,
                           description=__doc__.splitlines()[0], extend_parser=_extend)
  return status


if __name__ == "__main__":
  sys.exit(main())
