"""The Gemma model on several GPUs: training (data, tensor and fully sharded data parallel)
and tensor-parallel generation, one process per GPU, against the one-GPU run.

    # each line runs on one host; `run` appends one JSON line per case to --out
    python -m jaxgpu.launch --nproc 1 -- python3 benchmarks/bench_multigpu.py run \\
        --model gemma2_2b --cases single,decode --out $OUT/multigpu.jsonl
    python -m jaxgpu.launch --nproc 2 -- python3 benchmarks/bench_multigpu.py run \\
        --model gemma2_2b --cases dp,tp,fsdp,decode --out $OUT/multigpu.jsonl
    # then: ratios against the one-GPU lines, into results/<gpu>-x<n>.json and RESULTS.md
    python3 benchmarks/bench_multigpu.py summarize $OUT/multigpu.jsonl

Training cases (train_step, sequence 4096, bf16 parameters, float32 AdamW moments, the same
global batch, data and initial parameters in every case, so the losses of each step can be
compared with the one-GPU run's):
  single  one GPU, no mesh (the baseline)
  dp      mesh (n, 1): the batch split, parameters replicated, gradients all-reduced
  tp      mesh (1, n): heads, kv heads and the MLP split (Megatron), activations
          all-reduced twice per layer
  fsdp    mesh (n, 1), fsdp=True: the batch split and the parameters, gradients and moments
          too (ZeRO-3): weights all-gathered per layer, gradients reduce-scattered
  fsdp_tp mesh (n/2, 2), fsdp=True: both (four GPUs or more)
Each reports: the loss after every step, the step time (median of the timed steps), tokens
per second per GPU and the scaling efficiency against one GPU (one GPU's step time / (n x
this step time), the same global batch: strong scaling), XLA's memory for the step per GPU
(arguments + temporaries, donated buffers counted once), and the compiled step's
collectives by kind (count and bytes per step per GPU), with a check that every all-gather
moves a parameter (never an activation around a custom call).

Generation case `decode`: the jitted decode loop (64 tokens per row after a 4096-token
context, paged cache, greedy) at batch 1 and 64, with the weights tensor parallel over every
GPU (mesh (1, n); gemma.shard_params, gemma.shard_cache: the cache split by kv heads) or on
one GPU: tokens/s and its collectives.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SEQ = 4096
TRAIN_BATCH = {"gemma2_2b": 2, "gemma3_1b": 4}   # global; fits one 80 GB H100 (no remat)
DECODE_CONTEXT = 4096
DECODE_BATCHES = (1, 64)
DECODE_TOKENS = 64
LEARNING_RATE = 3e-4  # large enough for the loss to move in a few steps
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1, "s8": 1,
               "u8": 1, "f64": 8, "s64": 8}


# ---- compiled-HLO collectives ---------------------------------------------------------------


def collectives(hlo: str) -> list[tuple[str, list[tuple[str, tuple[int, ...]]]]]:
  """(kind, [(dtype, shape) of each result]) for every collective of a compiled module."""
  found = []
  for line in hlo.splitlines():
    if " = " not in line:
      continue
    rhs = " " + line.split(" = ", 1)[1]
    for kind in KINDS:
      m = re.search(rf"\s{kind}(?:-start)?\(", rhs)
      if m:
        shapes = [(t, tuple(int(x) for x in dims.split(",") if x))
                  for t, dims in re.findall(r"(\w+)\[([\d,]*)\]", rhs[:m.start()])]
        found.append((kind, shapes))
        break
  return found


def collective_summary(hlo: str) -> dict[str, dict[str, float]]:
  out: dict[str, dict[str, float]] = {}
  for kind, shapes in collectives(hlo):
    e = out.setdefault(kind, {"count": 0, "mbytes": 0.0})
    e["count"] += 1
    e["mbytes"] += sum(DTYPE_BYTES.get(t, 4) * math.prod(s) for t, s in shapes) / 1e6
  return out


def non_weight_gathers(hlo: str, weight_shapes: set[tuple[int, ...]]) -> list:
  """All-gathers with a result that is not a parameter's per-device block (its axes in
  any order, unit axes dropped: XLA gathers some weights in a transposed layout). The
  async form's tuple holds the operand beside the result: each is checked."""
  return [s for kind, shapes in collectives(hlo) if kind == "all-gather"
          for _, s in shapes if _block(s) not in weight_shapes]


def _block(shape) -> tuple[int, ...]:
  """A shape compared up to the order of its axes and its unit axes (XLA drops them)."""
  return tuple(sorted(d for d in shape if d != 1))


# ---- running one case (inside the launched processes) ---------------------------------------


def _first(x) -> float:
  import numpy as np

  return float(np.asarray(x.addressable_data(0)))


def _global(array, sharding):
  """A host numpy array (the same on every process) as a global jax.Array."""
  import jax

  return jax.make_array_from_callback(array.shape, sharding, lambda idx: array[idx])


def _init_params(config, shardings):
  """The same random parameters in every process, placed with `shardings` (None: this
  process's device). Initialized eagerly: XLA takes minutes to compile the whole
  initializer of a 2B model as one jitted program."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxgpu.models import gemma

  params = gemma.init_params(config, jax.random.key(0), jnp.bfloat16)
  if shardings is None:
    return params
  return jax.tree.map(lambda x, s: _global(np.asarray(x), s), params, shardings)


def _mesh(case: str, n: int):
  import jax

  shapes = {"single": None, "dp": (n, 1), "tp": (1, n), "fsdp": (n, 1),
            "fsdp_tp": (n // 2, 2), "decode": (1, n)}
  shape = shapes[case]
  if case == "single" or (case == "decode" and n == 1):
    return None
  if case == "fsdp_tp" and n < 4:
    raise ValueError("fsdp_tp: needs 4 GPUs or more")
  if case != "decode" and n == 1:
    raise ValueError(f"{case}: needs 2 GPUs or more")
  return jax.make_mesh(shape, ("data", "model"))


def _memory_gib(compiled) -> float:
  m = compiled.memory_analysis()
  return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
          + m.temp_size_in_bytes) / 2**30


def weight_blocks(config, mesh_shape) -> set:
  """Every parameter's per-device block (axes sorted) on a (data, model) mesh of that
  shape, with and without fsdp, and gathered over either axis: the all-gathers that move
  weights, not activations."""
  import types

  import jax
  from jax.sharding import PartitionSpec as P

  from jaxgpu.models import gemma

  sizes = dict(zip(("data", "model"), mesh_shape))
  mesh = types.SimpleNamespace(axis_names=("data", "model"), shape=sizes)
  shapes = jax.tree.leaves(gemma.param_shapes(config), is_leaf=lambda s: isinstance(s, tuple))
  out = set()
  for fsdp in (False, True):
    specs = jax.tree.leaves(gemma.param_specs(config, mesh, fsdp),
                            is_leaf=lambda s: isinstance(s, P))
    for shape, spec in zip(shapes, specs):
      spec = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
      for keep in (None, "data", "model"):
        out.add(_block([d // (sizes[a] if a and a != keep else 1)
                        for d, a in zip(shape, spec)]))
  return out


def train_case(config, name: str, case: str, args) -> dict:
  import jax
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P

  from jaxgpu.models import gemma
  from jaxgpu.models.gemma import sharding

  n = jax.device_count()
  mesh = _mesh(case, n)
  fsdp = case.startswith("fsdp")
  b, t = args.batch or TRAIN_BATCH[name], args.seq
  if b % sharding.axis_size(mesh, "data"):
    raise ValueError(f"batch {b}: not divisible by the data axis")
  optimizer = gemma.AdamW(learning_rate=LEARNING_RATE, weight_decay=0.01, clip_norm=1.0)
  if mesh is None:
    pshard = oshard = bshard = None
  else:
    auto = sharding.auto_mesh(mesh)
    pshard = gemma.param_shardings(config, mesh, fsdp)
    oshard = jax.tree.map(lambda s: NamedSharding(auto, s),
                          gemma.opt_state_specs(config, mesh, fsdp),
                          is_leaf=lambda s: isinstance(s, P))
    bshard = gemma.batch_sharding(mesh)
  params = _init_params(config, pshard)
  state = jax.jit(gemma.init_opt_state, out_shardings=oshard)(params)
  tokens = np.random.default_rng(0).integers(0, config.vocab_size, (b, t + 1)).astype(np.int32)
  batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
  if bshard is not None:
    batch = {k: _global(np.ascontiguousarray(v), bshard) for k, v in batch.items()}
  t0 = time.perf_counter()
  step = gemma.train_step.lower(params, state, batch, config=config, optimizer=optimizer,
                                mesh=mesh, fsdp=fsdp).compile()
  compile_s = time.perf_counter() - t0
  hlo = step.as_text()
  losses, times = [], []
  for _ in range(args.steps):
    t0 = time.perf_counter()
    params, state, m = step(params, state, batch)
    losses.append(_first(m["loss"]))   # waits for the step
    times.append(time.perf_counter() - t0)
  timed = times[2:] if len(times) > 3 else times
  step_s = statistics.median(timed)
  weights = weight_blocks(config, mesh.devices.shape) if mesh is not None else set()
  return {"kind": "train", "model": name, "case": case, "gpus": n,
          "mesh": list(mesh.devices.shape) if mesh is not None else [1, 1], "fsdp": fsdp,
          "batch": b, "seq": t, "steps": args.steps, "losses": losses,
          "step_s": step_s, "step_min_s": min(timed), "step_max_s": max(timed),
          "tokens_per_s": b * t / step_s, "memory_gib": _memory_gib(step),
          "compile_s": compile_s, "collectives": collective_summary(hlo),
          "non_weight_gathers": [list(s) for s in non_weight_gathers(hlo, weights)]}


def decode_case(config, name: str, args) -> list[dict]:
  import jax
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P

  from jaxgpu.models import gemma
  from jaxgpu.models.gemma import sharding

  n = jax.device_count()
  mesh = _mesh("decode", n)
  whole = None if mesh is None else NamedSharding(sharding.auto_mesh(mesh), P())
  pshard = None if mesh is None else gemma.param_shardings(config, mesh)
  params = _init_params(config, pshard)
  steps = DECODE_TOKENS
  cache_len = args.context + steps
  out = []
  for b in args.decode_batches:
    make = lambda: gemma.empty_cache(config, b, cache_len, cache="paged")
    cshard = None if mesh is None else gemma.cache_shardings(jax.eval_shape(make), config, mesh)
    logits = np.zeros((b, config.vocab_size), np.float32)
    positions = np.full((b,), args.context, np.int32)
    if whole is not None:
      logits, positions = _global(logits, whole), _global(positions, whole)
    key = jax.jit(lambda: jax.random.key(0), out_shardings=whole)()
    new_cache = jax.jit(make, out_shardings=cshard)
    cache = new_cache()
    loop = gemma.decode.lower(params, config, cache, logits, positions, key, -1,
                              max_new_tokens=steps, mesh=mesh).compile()
    times = []
    for _ in range(args.repeats + 1):
      cache = new_cache()
      jax.block_until_ready(cache)
      t0 = time.perf_counter()
      result, _ = loop(params, cache, logits, positions, key, -1)
      jax.block_until_ready(result)
      times.append(time.perf_counter() - t0)
    per_step = statistics.median(times[1:]) / (steps - 1)
    out.append({"kind": "decode", "model": name, "case": "decode", "gpus": n,
                "mesh": [1, n], "batch": b, "context": args.context, "tokens": steps,
                "step_s": per_step, "tokens_per_s": b / per_step,
                "memory_gib": _memory_gib(loop),
                "collectives": collective_summary(loop.as_text()),
                "cache_spec": str(cshard.pages[0]["k"].spec) if cshard is not None else "",
                "non_weight_gathers": [list(s) for s in non_weight_gathers(
                    loop.as_text(), weight_blocks(config, (1, n)))]})
  return out


def run(args) -> int:
  import jaxgpu.launch

  jaxgpu.launch.initialize()
  import jax

  from jaxgpu.models import gemma

  config = (gemma.Config.tiny(2 if "2" in args.model else 3) if args.tiny
            else getattr(gemma.Config, args.model)())
  status = 0
  for case in args.cases.split(","):
    t0 = time.perf_counter()
    try:
      recs = (decode_case(config, args.model, args) if case == "decode"
              else [train_case(config, args.model, case, args)])
    except Exception as e:  # one case failing must not cost the others their figures
      print(f"FAILED {args.model} {case}: {type(e).__name__}: {e}", flush=True)
      status = 1
      continue
    for r in recs:
      r["commit"] = os.environ.get("JAXGPU_GIT_COMMIT", "")
      r["device_kind"] = jax.devices()[0].device_kind
      r["jax"] = jax.__version__
      short = {k: r[k] for k in ("model", "case", "gpus", "batch", "step_s", "tokens_per_s",
                                  "memory_gib")}
      print(f"{json.dumps(short)} losses={r.get('losses')} collectives={r['collectives']}"
            f" ({time.perf_counter() - t0:.0f} s)", flush=True)
      if jax.process_index() == 0:
        with open(args.out, "a") as f:
          f.write(json.dumps(r) + "\n")
  return status


# ---- summary: ratios against one GPU, into the results files ---------------------------------


def summarize(args) -> int:
  import harness  # noqa: F401  (benchlib on sys.path)
  from benchlib import record, results
  from benchlib.device import device_slug

  from jaxgpu.models import gemma

  args.results_dir = args.results_dir or results.RESULTS_DIR
  lines = [json.loads(x) for x in Path(args.file).read_text().splitlines() if x.strip()]
  by = collections.defaultdict(list)
  for r in lines:   # the latest line of each case wins
    key = (r["kind"], r["model"], r["case"], r["gpus"], r.get("batch"))
    by[key] = r
  base = {(k[0], k[1], k[4]): r for k, r in by.items() if r["gpus"] == 1}
  recs, gpus = [], max(r["gpus"] for r in lines)
  for (kind, model, case, n, b), r in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0],
                                                                            kv[0][3], kv[0][2])):
    one = base.get((kind, model, b))
    speedup = one["step_s"] / r["step_s"] if one else None
    notes = [f"{r['tokens_per_s'] / n:,.0f} tokens/s per GPU",
             f"memory {r['memory_gib']:.1f} GiB per GPU"]
    if speedup and n > 1:
      notes.append(f"scaling efficiency {speedup / n:.0%}")
    target, met = None, None
    if kind == "train" and one and n > 1:
      diff = max(abs(a - c) / abs(c) for a, c in zip(r["losses"], one["losses"]))
      notes.append(f"losses {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}, max rel. diff "
                   f"from 1 GPU {diff:.1e}")
      target, met = "loss within 1e-2 (relative) of 1 GPU at every step", diff <= 1e-2
    coll = ", ".join(f"{k} {v['count']}x {v['mbytes']:.0f} MB" for k, v in
                     sorted(r["collectives"].items()))
    notes.append("collectives: " + (coll or "none"))
    config = getattr(gemma.Config, model)() if not args.tiny else None
    blocks = weight_blocks(config, r["mesh"]) if config else set()
    others = [s for s in r["non_weight_gathers"] if _block(s) not in blocks]
    if others:
      notes.append(f"all-gathers of non-weights {others}")
    shape = [r["batch"], r.get("seq") or r.get("context")]
    mesh = "x".join(map(str, r["mesh"]))
    label = case if kind == "train" else f"decode ctx{r['context']}"
    recs.append(record.Record(
        family=f"multigpu_{kind}", op=f"{kind} {model}",
        case=f"{label} mesh {mesh} B{r['batch']}", shape=shape, dtype="bfloat16",
        implementation=f"{n}gpu", pass_=kind, time_us=r["step_s"] * 1e6,
        time_min_us=r.get("step_min_s", r["step_s"]) * 1e6,
        time_max_us=r.get("step_max_s", r["step_s"]) * 1e6,
        calls=r.get("steps") or r.get("tokens"), repeats=1, anchor="1gpu",
        vs_anchor=speedup, target=target, target_met=met, notes="; ".join(notes)))
  kind = lines[0]["device_kind"]
  slug = f"{device_slug(kind)}-x{gpus}"
  for fam in sorted({r.family for r in recs}):
    entry = {"date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
             "commit": lines[-1].get("commit") or args.commit, "jax": lines[0]["jax"],
             "jaxlib": lines[0]["jax"], "device_kind": kind, "device_count": gpus,
             "records": [x.to_json() for x in recs if x.family == fam],
             "command": "`bash tools/run_multigpu.sh`, then `python3 benchmarks/"
                        "bench_multigpu.py summarize multigpu.jsonl`"}
    results.merge_family(args.results_dir / f"{slug}.json", slug, fam, entry)
  md = results.write_results_md(args.results_dir, args.results_dir.parent / "RESULTS.md"
                                if args.results_dir == results.RESULTS_DIR
                                else args.results_dir / "RESULTS.md")
  print(f"wrote {args.results_dir / (slug + '.json')} and {md}")
  print(record.format_text_table(recs))
  return 0


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  sub = p.add_subparsers(dest="command", required=True)
  r = sub.add_parser("run", help="run cases (under python -m jaxgpu.launch)")
  r.add_argument("--model", default="gemma2_2b", choices=("gemma2_2b", "gemma3_1b"))
  r.add_argument("--cases", default="single,decode")
  r.add_argument("--batch", type=int, default=None, help="global training batch")
  r.add_argument("--seq", type=int, default=SEQ)
  r.add_argument("--steps", type=int, default=8)
  r.add_argument("--context", type=int, default=DECODE_CONTEXT)
  r.add_argument("--decode-batches", type=lambda s: [int(x) for x in s.split(",")],
                 default=list(DECODE_BATCHES))
  r.add_argument("--repeats", type=int, default=3)
  r.add_argument("--tiny", action="store_true", help="the tiny config (CPU smoke test)")
  r.add_argument("--out", required=True)
  s = sub.add_parser("summarize", help="results files from run's JSON lines")
  s.add_argument("file")
  s.add_argument("--commit", default="")
  s.add_argument("--tiny", action="store_true", help="run's lines came from --tiny")
  s.add_argument("--results-dir", type=Path, default=None,
                 help="where <gpu>-x<n>.json goes (default benchmarks/results; RESULTS.md "
                      "beside it, or in it for another folder)")
  args = p.parse_args(argv)
  return run(args) if args.command == "run" else summarize(args)


if __name__ == "__main__":
  sys.exit(main())
