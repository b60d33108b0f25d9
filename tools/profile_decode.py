"""Per-kernel GPU time of one Gemma decode step, for docs/perf/model.md.

    ncu --clock-control none --nvtx --nvtx-include "decode_step/" --csv --print-units base \
        --metrics gpu__time_duration.sum python3 tools/profile_decode.py --impl xla > xla.csv
    python3 tools/profile_decode.py --summarize xla.csv

The step runs twice first (compile, warm-up); only the third, inside the NVTX range
"decode_step" (pushed through torch, which the GPU machine has), is profiled. --summarize
groups a CSV's kernels by name: launches, total and share of the step's GPU time.
"""

from __future__ import annotations

import argparse
import collections
import csv
import re
import sys


def summarize(path: str, top: int = 15) -> None:
  rows = [r for r in csv.reader(open(path)) if len(r) > 10]
  head, body = rows[0], rows[1:]
  name_col, value_col = head.index("Kernel Name"), head.index("Metric Value")
  total = collections.defaultdict(float)
  count = collections.Counter()
  for r in body:
    name = re.sub(r"\(.*", "", r[name_col])[:60]
    total[name] += float(r[value_col].replace(",", "")) / 1e3  # ns -> us
    count[name] += 1
  step = sum(total.values())
  print(f"{path}: {sum(count.values())} kernels, {step:.0f} us of GPU time in the step")
  for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
    print(f"  {us:9.1f} us {100 * us / step:5.1f}%  x{count[name]:<4} {name}")


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--impl", choices=("cuda", "xla"), default="cuda")
  p.add_argument("--model", default="gemma2_2b")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--context", type=int, default=4096)
  p.add_argument("--summarize", default=None, help="a CSV written by ncu (see above)")
  args = p.parse_args()
  if args.summarize:
    summarize(args.summarize)
    return 0
  import jax
  import jax.numpy as jnp
  import torch

  from jaxgpu.models import gemma

  config = getattr(gemma.Config, args.model)()
  impl = None if args.impl == "cuda" else "xla"
  params = gemma.init_params(config, jax.random.key(0), jnp.bfloat16)
  cache = gemma.empty_cache(config, args.batch, args.context + 8)
  tokens = jnp.ones((args.batch,), jnp.int32)
  positions = jnp.full((args.batch,), args.context, jnp.int32)
  for _ in range(2):
    logits, cache = gemma.decode_step(params, config, cache, tokens, positions,
                                      implementation=impl)
  jax.block_until_ready(logits)
  torch.cuda.nvtx.range_push("decode_step")
  logits, cache = gemma.decode_step(params, config, cache, tokens, positions,
                                    implementation=impl)
  jax.block_until_ready(logits)
  torch.cuda.nvtx.range_pop()
  return 0


if __name__ == "__main__":
  sys.exit(main())
