"""A/B timing of the attention kernels: one build's TFLOP/s per option set, for comparing
builds that differ in one kernel change (tools/ab_on_gpu.sh runs it once per build,
interleaved). bench_attention.py is the published benchmark; this is the tuning tool behind
the figures in docs/perf/attention.md.

    python3 benchmarks/attention_variants.py --label base --json ab.jsonl   # time, append
    python3 benchmarks/attention_variants.py --summarize ab.jsonl           # the table
    python3 benchmarks/attention_variants.py --profile --variants opts      # for ncu

Passes: fwd (the op under jit), bwd (the jitted vjp closure on residuals computed before the
timing: dQ, dK/dV and delta only) and fwd+bwd (bench_attention.py's training step). TFLOP/s
use bench_attention.py's convention: 4 B T S N H forward, halved when causal; the backward
2.5x that. Inputs are rotated past 3x L2 and timed with timing.time_fns (docs/design.md
section 6), so the figures are comparable with RESULTS.md's.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, bench_attention.py

import bench_attention  # noqa: E402
from benchlib import device  # noqa: E402
from benchlib import inputs  # noqa: E402
from benchlib import timing  # noqa: E402

TOKENS = bench_attention.TOKENS
PASSES = tuple(bench_attention.PASS_FLOPS)


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    n: int = 16
    k: int = 16
    h: int = 128
    t: int = 4096
    causal: bool = False
    softcap: float | None = None
    window: tuple | None = None
    segments: bool = False  # one segment per sequence: masks nothing, selects the masked kernels
    packed: int = 0  # > 0: segment ids of runs of this many tokens (packed sequences: masks)
    tokens: int = TOKENS

    @property
    def b(self) -> int:
        return max(1, self.tokens // self.t)

    def flops(self, pass_: str) -> float:
        return bench_attention.attention_flops(self.b, self.t, self.n, self.h, self.causal,
                                               pass_)


# The cases the options target is judged on (bench_attention.py's `attn+options` and its
# plain case), their parts (softcap alone, segment ids alone) and the other kernel families.
VARIANTS = {v.name: v for v in [
    Variant("plain"),
    Variant("causal", causal=True),
    Variant("cap", softcap=30.0),
    Variant("seg", segments=True),
    Variant("opts", softcap=30.0, window=(4096, 4096), segments=True),
    Variant("packed", segments=True, packed=1024),
    Variant("opts-packed", softcap=30.0, window=(4096, 4096), segments=True, packed=1024),
    Variant("gqa-causal", n=32, k=8, causal=True),
    Variant("h64", n=32, k=32, h=64),
    Variant("h64-causal", n=32, k=32, h=64, causal=True),
    Variant("h256-causal", n=8, k=8, h=256, causal=True),
]}
DEFAULT_VARIANTS = ("plain", "causal", "cap", "seg", "opts", "h64-causal", "h256-causal")


def make_inputs(key, v: Variant, with_do: bool):
    import jax.numpy as jnp

    args = bench_attention.random_inputs(key, v.b, v.t, v.n, v.k, v.h, jnp.bfloat16,
                                         v.segments, with_do)
    if v.packed:  # ids 0, 0, ... 1, 1, ...: packed sequences of v.packed tokens each
        ids = jnp.broadcast_to(jnp.arange(v.t, dtype=jnp.int32) // v.packed, (v.b, v.t))
        args = args[:3] + (ids, ids) + args[5:]
    return args


def op(v: Variant, implementation: str):
    import jaxgpu

    def fn(q, k, val, q_seg, kv_seg):
        return jaxgpu.dot_product_attention(q, k, val, is_causal=v.causal,
                                            logit_softcap=v.softcap, local_window_size=v.window,
                                            q_segment_ids=q_seg, kv_segment_ids=kv_seg,
                                            implementation=implementation)
    return fn


def pass_fn_and_args(v: Variant, pass_: str, key, l2_bytes: int, implementation: str,
                     rotate: bool = True):
    """(jitted fn, argument sets) of one pass."""
    import functools

    import jax

    fn = op(v, implementation)
    if pass_ == "fwd":
        one = functools.partial(make_inputs, v=v, with_do=False)
        timed = jax.jit(fn)
    else:
        one = functools.partial(make_inputs, v=v, with_do=True)
        if pass_ == "fwd+bwd":
            timed = jax.jit(bench_attention.vjp_step(fn))
    nbytes = inputs.tree_nbytes(jax.eval_shape(one, key))
    sets = inputs.make_arg_sets(one, key, nbytes, l2_bytes,
                                 max_copies=None if rotate else 1)
    if pass_ == "bwd":  # the residuals (o, lse) come from a forward outside the timing
        def residuals(q, k, val, q_seg, kv_seg, do):
            _, vjp = jax.vjp(lambda q, k, val: fn(q, k, val, q_seg, kv_seg), q, k, val)
            return vjp, do
        sets = [residuals(*s) for s in sets]
        timed = jax.jit(lambda vjp, do: vjp(do))
    return timed, sets


def time_build(args) -> int:
    import jax

    import jaxgpu

    if args.implementation not in jaxgpu.available_implementations():
        print(f"jaxgpu here has no {args.implementation!r} implementation", file=sys.stderr)
        return 1
    l2 = device.DEFAULT_L2_BYTES
    config = timing.TimingConfig(repeats=args.repeats)
    key = jax.random.PRNGKey(args.seed)
    rows = []
    for name in args.variants:
        v = VARIANTS[name]
        if args.t:  # a smoke run's size (the window stays wider than the sequence)
            v = dataclasses.replace(v, t=args.t, tokens=args.tokens or args.t)
        for pass_ in args.passes:
            key, sub = jax.random.split(key)
            fn, sets = pass_fn_and_args(v, pass_, sub, l2, args.implementation,
                                        rotate=not args.profile)
            if args.profile:  # a few calls for a profiler (ncu) to attribute, untimed
                for s in sets[:1] * 3:
                    jax.block_until_ready(fn(*s))
                continue
            t = timing.time_fn(fn, sets, config)
            row = dict(label=args.label, variant=name, pass_=pass_, us=t.median_s * 1e6,
                       tflops=v.flops(pass_) / t.median_s / 1e12, spread=t.spread)
            rows.append(row)
            print(f"{args.label:<12} {name:<12} {pass_:<8} {row['us']:9.1f} us "
                  f"{row['tflops']:6.1f} TFLOP/s (spread {t.spread:.2f})", flush=True)
            del fn, sets
    if args.json and rows:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


def summarize(path: str) -> int:
    """Median over the rounds of each (label, variant, pass): TFLOP/s fwd / bwd / fwd+bwd."""
    runs = collections.defaultdict(list)
    labels, variants = [], []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            runs[(r["label"], r["variant"], r["pass_"])].append(r["tflops"])
            if r["label"] not in labels:
                labels.append(r["label"])
            if r["variant"] not in variants:
                variants.append(r["variant"])
    print("TFLOP/s fwd / bwd / fwd+bwd, median over rounds (rounds in brackets)")
    print(f"{'variant':<12} " + " ".join(f"{lab:>24}" for lab in labels))
    for var in variants:
        cells = []
        for lab in labels:
            parts, n = [], 0
            for p in PASSES:
                xs = runs.get((lab, var, p), [])
                n = max(n, len(xs))
                parts.append(f"{statistics.median(xs):.0f}" if xs else "-")
            cells.append(f"{'/'.join(parts)} [{n}]")
        print(f"{var:<12} " + " ".join(f"{c:>24}" for c in cells))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--label", default="build", help="the build's name in the table")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated, of: {', '.join(VARIANTS)}")
    p.add_argument("--passes", default=",".join(PASSES))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="append one JSON line per figure here")
    p.add_argument("--profile", action="store_true",
                   help="run each pass 3 times on one input set, untimed (under ncu)")
    p.add_argument("--summarize", metavar="JSONL", default=None)
    p.add_argument("--implementation", default="cuda", help="'cpu' for a smoke run")
    p.add_argument("--t", type=int, default=None, help="sequence length (smoke runs)")
    p.add_argument("--tokens", type=int, default=None, help="B * T with --t")
    args = p.parse_args(argv)
    if args.summarize:
        return summarize(args.summarize)
    args.variants = [s for s in args.variants.split(",") if s]
    args.passes = [s for s in args.passes.split(",") if s]
    bad = [s for s in args.variants if s not in VARIANTS] + [s for s in args.passes
                                                             if s not in PASSES]
    if bad:
        p.error(f"unknown variant or pass: {', '.join(bad)}")
    return time_build(args)


if __name__ == "__main__":
    sys.exit(main())
