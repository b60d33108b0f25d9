"""Where a Gemma decode step's time goes, by differences (the H100 machine's ncu crashed on
JAX programs in this image, so the split comes from timing variants, not counters).

    python3 tools/profile_decode.py                     # gemma2_2b, batch 1, both paths
    python3 tools/profile_decode.py --contexts 64,4096,32768 --batch 8

For each implementation and context length it times decode_step (jitted; the cache donated
and carried from step to step) at a context of 64 tokens, where attention and the cache
cost almost nothing, and at the longer ones. The step at 64 is the cost of everything but
attention (the weights' matmuls, norms, the output projection, sampling excluded); the
difference to a longer context is what attention over that cache (and its write) costs.
Each is printed beside its floor at the measured copy rate: the parameter bytes, and the
KV bytes a step must read.
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


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", default="gemma2_2b")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--contexts", default="64,4096,32768")
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--launches", action="store_true",
                 help="also count the kernels a step launches (the compiled HLO's top-level "
                      "fusions, custom calls and library calls)")
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
