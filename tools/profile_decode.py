"""Where a Gemma decode step's time goes, by differences (the H100 machine's ncu crashed on
JAX programs in this image, so the split comes from timing variants, not counters).

    python3 tools/profile_decode.py                     # gemma2_2b, batch 1, both paths
    python3 tools/profile_decode.py --contexts 64,4096,32768 --batch 8
    python3 tools/profile_decode.py --model gemma3_1b --trace   # kernel by kernel

For each implementation and context length it times decode_step (jitted; the cache donated
and carried from step to step) at a context of 64 tokens, where attention and the cache
cost almost nothing, and at the longer ones. The step at 64 is the cost of everything but
attention (the weights' matmuls, norms, the output projection, sampling excluded); the
difference to a longer context is what attention over that cache (and its write) costs.
Each is printed beside its floor at the measured copy rate: the parameter bytes, and the
KV bytes a step must read.

--trace instead runs the decode loop itself (gemma.decode, as bench_model times it) under
jax.profiler and lists, per implementation, the GPU kernels of one step: how many, their
summed time, the time the GPU is busy, and the largest kernels by name.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def count_launches(hlo_text: str) -> int:
  """Top-level kernels of the ENTRY computation: fusions, custom calls (jaxgpu's FFI
  kernels, cuBLAS), and other ops XLA runs as their own kernel (copies, scatters, sorts);
  bitcasts, tuples, parameters and constants launch nothing."""
  entry = hlo_text[hlo_text.index("ENTRY"):]
  entry = entry[:entry.index("\n}")]
  silent = ("parameter(", "constant(", "bitcast(", "tuple(", "get-tuple-element(",
            "after-all(", "partition-id(", "replica-id(")
  n = 0
  for line in entry.splitlines()[1:]:
    if "=" in line and not any(op in line for op in silent):
      n += 1
  return n


def gpu_kernels(trace_dir: str):
  """(name, start_ns, duration_ns) of every kernel on the GPU planes of a jax.profiler trace
  (the per-stream lines; 'XLA Modules' / 'XLA Ops' are summaries of the same time)."""
  import glob

  from jax.profiler import ProfileData
  out = []
  for path in glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True):
    for plane in ProfileData.from_file(path).planes:
      if not plane.name.startswith("/device:GPU"):
        continue
      for line in plane.lines:
        if line.name.startswith("XLA") or "Source" in line.name:
          continue
        out += [(e.name, e.start_ns, e.duration_ns) for e in line.events]
  return out


def busy_ns(kernels) -> float:
  """The time at least one kernel runs (the union of their intervals)."""
  total, end = 0.0, float("-inf")
  for _, start, dur in sorted(kernels, key=lambda k: k[1]):
    if start >= end:
      total += dur
    elif start + dur > end:
      total += start + dur - end
    end = max(end, start + dur)
  return total


def trace_decode(config, params, args, jax, jnp, gemma) -> None:
  """Kernel-by-kernel view of the decode loop (one trace per implementation)."""
  import collections
  import tempfile
  n = args.steps + 1
  context = int(args.contexts.split(",")[-1])
  positions = jnp.full((args.batch,), context, jnp.int32)
  logits = jnp.zeros((args.batch, config.vocab_size), jnp.float32)
  for impl_name, impl in (("cuda", None), ("xla", "xla")):
    def run():
      cache = gemma.empty_cache(config, args.batch, context + n, implementation=impl)
      out, _ = gemma.decode(params, config, cache, logits, positions, jax.random.key(0), -1,
                            max_new_tokens=n, implementation=impl)
      jax.block_until_ready(out)
    run()
    with tempfile.TemporaryDirectory() as d:
      with jax.profiler.trace(d):
        t0 = time.perf_counter()
        run()
        wall = time.perf_counter() - t0
      kernels = gpu_kernels(d)
    if not kernels:
      print(f"  {impl_name}: the trace holds no GPU kernels", flush=True)
      continue
    steps = n - 1
    span = max(s + d for _, s, d in kernels) - min(s for _, s, _ in kernels)
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for name, _, dur in kernels:
      by_name[name][0] += 1
      by_name[name][1] += dur
    total, busy = sum(d for _, _, d in kernels), busy_ns(kernels)
    print(f"  {impl_name:<5} ctx {context} B{args.batch}: {len(kernels) / steps:.0f} kernels/step;"
          f" kernel time {total / steps / 1e3:.1f} us/step, GPU busy {busy / steps / 1e3:.1f}"
          f" us/step, first-to-last {span / steps / 1e3:.1f} us/step (wall {wall / steps * 1e6:.0f}"
          f" us/step with the profiler on)", flush=True)
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:args.top]
    for name, (count, dur) in top:
      print(f"      {dur / steps / 1e3:8.1f} us/step  {count / steps:6.1f}/step  "
            f"{dur / count / 1e3:7.2f} us each  {name[:110]}", flush=True)


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", default="gemma2_2b")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--contexts", default="64,4096,32768")
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--launches", action="store_true",
                 help="also count the kernels a step launches (the compiled HLO's top-level "
                      "fusions, custom calls and library calls)")
  p.add_argument("--trace", action="store_true",
                 help="profile the decode loop at the last context: the kernels of a step")
  p.add_argument("--top", type=int, default=25, help="kernels listed per implementation")
  args = p.parse_args()

  import jax
  import jax.numpy as jnp

  from jaxgpu.models import gemma
  sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/benchmarks")
  import bench_model
  from benchlib.timing import measure_copy_bandwidth

  config = getattr(gemma.Config, args.model)()
  params = gemma.init_params(config, jax.random.key(0), jnp.bfloat16)
  gbs = measure_copy_bandwidth()
  weights = bench_model.param_bytes(config)
  print(f"{args.model} batch {args.batch}: copy {gbs:.0f} GB/s; parameters "
        f"{weights / 1e9:.2f} GB -> floor {weights / gbs / 1e6:.3f} ms")
  if args.trace:
    trace_decode(config, params, args, jax, jnp, gemma)
    return 0
  tokens = jnp.ones((args.batch,), jnp.int32)
  if args.launches:
    for impl_name, impl in (("cuda", None), ("xla", "xla")):
      cache = gemma.empty_cache(config, args.batch, 4097, implementation=impl)
      text = gemma.decode_step.lower(params, config, cache, tokens, tokens,
                                     implementation=impl).compile().as_text()
      print(f"  {impl_name:<5} one step launches {count_launches(text)} kernels "
            f"(command buffers: {'yes' if 'command_buffer' in text else 'no'})", flush=True)
      del cache
  for impl_name, impl in (("cuda", None), ("xla", "xla")):
    base = None
    for context in [int(c) for c in args.contexts.split(",")]:
      cache = gemma.empty_cache(config, args.batch, context + 1, implementation=impl)
      positions = jnp.full((args.batch,), context, jnp.int32)
      for _ in range(2):
        logits, cache = gemma.decode_step(params, config, cache, tokens, positions,
                                          implementation=impl)
      logits.block_until_ready()
      times = []
      for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(args.steps):
          logits, cache = gemma.decode_step(params, config, cache, tokens, positions,
                                            implementation=impl)
        logits.block_until_ready()
        times.append((time.perf_counter() - t0) / args.steps)
      ms = statistics.median(times) * 1e3
      kv = bench_model.decode_bytes(config, args.batch, context) - weights
      line = (f"  {impl_name:<5} context {context:6d}: {ms:7.3f} ms/step; KV {kv / 1e9:6.3f} GB"
              f" -> floor {kv / gbs / 1e6:6.3f} ms")
      if base is None:
        base = ms
      else:
        line += f"; attention + cache over the 64-token step: {ms - base:7.3f} ms"
      print(line, flush=True)
      del cache
  return 0


if __name__ == "__main__":
  sys.exit(main())
