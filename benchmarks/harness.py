"""The entry point of every bench_<family>.py: command line, targets, result files.

A family script (bench_<family>.py) builds its inputs and jitted callables and hands them to
`Bench.run_case` (benchlib/record.py), which times every implementation in the same run,
interleaved, against the family's anchor (XLA's fusion of the pure-JAX reference, cuDNN, ...).
`main()` wraps the CLI, the device-copy ceiling measurement, the printed table and the result
files. The jobs live in benchlib/: device.py (ceilings, metadata), inputs.py, timing.py,
record.py (Record, Bench), results.py (results/<gpu>.json, RESULTS.md, the README table).

    benchmarks/results/<gpu-slug>.json   merged by family (a re-run replaces only its family)
    benchmarks/RESULTS.md                regenerated from every results/*.json, never by hand
    README.md's headline table           regenerated from the same files

Run this file directly to regenerate RESULTS.md and the README table, optionally merging JSON
files brought back from the GPU machine first:

    python3 benchmarks/harness.py [--add /path/to/h100.json ...]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from collections.abc import Callable, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchlib, also under `python -P`

from benchlib import plots  # noqa: E402
from benchlib.device import CEILINGS  # noqa: E402
from benchlib.record import Bench, Record  # noqa: E402
from benchlib.results import (README, RESULTS_DIR, RESULTS_MD, merge_family,  # noqa: E402
                              merge_file, write_readme_table, write_results_md)


def add_common_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
  p.add_argument("--quick", action="store_true",
                 help="tiny shapes, few repeats (smoke test, runs on CPU in seconds); "
                      "results go to --out only, never into benchmarks/results/")
  p.add_argument("--out", type=Path, default=None,
                 help="also write <slug>.json and RESULTS.md here (e.g. $OUT on the GPU machine)")
  p.add_argument("--no-write", action="store_true",
                 help="write nothing under benchmarks/ (--out is still honoured)")
  p.add_argument("--impl", default=None,
                 help="comma-separated implementations (default: cuda,xla on GPU, cpu,xla on CPU)")
  p.add_argument("--repeats", type=int, default=None, help="override the number of repeats")
  p.add_argument("--plot", action="store_true",
                 help="after writing results/, redraw the PNG charts (needs matplotlib)")
  p.add_argument("--no-anchors", action="store_true",
                 help="skip the device-copy and dispatch-floor measurements")
  return p


# The issues' forward bandwidth target: 2.8 TB/s on the H100 (93% of its 3.0 TB/s device
# copy); on another GPU the same fraction of that GPU's ceiling stands in for it.
TARGET_FWD_GBS_H100 = 2800.0


def _fwd_gbs_target(bench: Bench) -> tuple[float | None, str | None]:
  if bench.slug == "h100":
    return TARGET_FWD_GBS_H100, "2.8 TB/s"
  if bench.ceiling_gbs:
    frac = TARGET_FWD_GBS_H100 / CEILINGS["h100"].hbm_gbs
    target = frac * bench.ceiling_gbs
    return target, f"{target / 1000:.2f} TB/s ({frac:.0%} of ceiling)"
  return None, None


def mark_targets(bench: Bench, records: Sequence[Record], pass_: str, *, fwd_vs: float,
                 fwd_bwd_vs: float, baselines: Sequence[str] = ("xla",),
                 skip: Sequence[str] = ()) -> None:
  """Marks an issue's targets on the kernel records of a target case (on a GPU only):
  forward >= the bandwidth target and >= fwd_vs times the fastest baseline, forward +
  backward >= fwd_bwd_vs times it. Baseline and `skip` records get no target."""
  if not bench.on_gpu:
    return
  times = [r.time_us for r in records if r.implementation in baselines]
  if not times:
    return
  best = min(times)
  gbs_target, gbs_label = _fwd_gbs_target(bench)
  for rec in records:
    if rec.implementation in baselines or rec.implementation in skip or not rec.time_us:
      continue
    ratio = best / rec.time_us
    versus = baselines[0] if len(baselines) == 1 else "the faster XLA"
    shown = "" if len(baselines) == 1 else f" ({ratio:.2f}x)"
    checks = []  # (label, met)
    if pass_ == "fwd":
      if gbs_target is not None:
        checks.append((f">= {gbs_label}", rec.gbs is not None and rec.gbs >= gbs_target))
      checks.append((f">= {fwd_vs:.1f}x {versus}{shown}", ratio >= fwd_vs))
    else:
      checks.append((f">= {fwd_bwd_vs:.1f}x {versus} jax.grad{shown}", ratio >= fwd_bwd_vs))
    rec.target = ", ".join(label for label, _ in checks)
    rec.target_met = all(met for _, met in checks)


def case_shapes(bench: Bench, shapes: Sequence[tuple], quick_shapes: Sequence[tuple]) -> list:
  """The shapes a family benchmarks: its quick ones under --quick, or those named in
  JAXGPU_BENCH_SHAPES ("16384x8192,4096x4096") for a tuning run, else its own."""
  if os.environ.get("JAXGPU_BENCH_SHAPES"):
    return [tuple(int(n) for n in s.split("x"))
            for s in os.environ["JAXGPU_BENCH_SHAPES"].split(",")]
  return list(quick_shapes if bench.quick else shapes)


def default_implementations(args: argparse.Namespace) -> tuple[str, ...]:
  import jax

  if args.impl:
    return tuple(s.strip() for s in args.impl.split(",") if s.strip())
  return ("cuda", "xla") if jax.default_backend() == "gpu" else ("cpu", "xla")


def main(family: str, run_family: Callable[[Bench], None], argv: Sequence[str] | None = None,
         description: str | None = None,
         extend_parser: Callable[[argparse.ArgumentParser], None] | None = None) -> int:
  """Entry point of a bench_<family>.py: parse the CLI, run, print, write.

  run_family(bench) calls bench.run_case(...) for each case; bench.args holds the CLI
  (bench.quick, implementations via default_implementations(bench.args)).
  Returns a process exit status: 1 when any case failed.
  """
  parser = argparse.ArgumentParser(description=description or f"benchmark the {family} family")
  add_common_args(parser)
  if extend_parser:
    extend_parser(parser)
  args = parser.parse_args(argv)
  bench = Bench(family, args)
  print(f"# {family}: jax {bench.meta['jax']}, {bench.device_kind}, commit "
        f"{bench.meta['commit']}, implementations {default_implementations(args)}"
        + (" [quick]" if args.quick else ""), flush=True)
  if not args.no_anchors:
    bench.measure_anchors()
  interrupted = False
  try:
    run_family(bench)
  except KeyboardInterrupt:
    # A run stopped at a time limit (`timeout -s INT`): the cases it measured are kept and
    # written, the family marked as cut short.
    interrupted = True
    print("interrupted: writing the cases measured so far", file=sys.stderr, flush=True)
  bench.print_table()

  if not bench.records:
    # An empty run (import error, every case failed) must not replace good results.
    print("no records: nothing written", file=sys.stderr)
    return 1
  entry = bench.family_entry()
  entry["interrupted"] = interrupted
  name = f"{bench.slug}.json"
  if not args.no_write and not args.quick:
    merge_family(RESULTS_DIR / name, bench.slug, family, entry, bench.keep_ops)
    write_results_md()
    write_readme_table(README)
    print(f"wrote {RESULTS_DIR / name}, {RESULTS_MD} and README.md's headline table")
    if args.plot:
      for path in plots.write_charts(RESULTS_DIR):
        print(f"wrote {path}")
  if args.out:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # Start from the repo's file so the copy brought back holds every family of this device.
    base = RESULTS_DIR / name
    if base.exists() and not (out / name).exists():
      (out / name).write_text(base.read_text())
    merge_family(out / name, bench.slug, family, entry, bench.keep_ops)
    write_results_md(out, out / "RESULTS.md")
    print(f"wrote {out / name} and {out / 'RESULTS.md'}")
  return 1 if bench.failures or interrupted else 0


def _cli(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(description="regenerate benchmarks/RESULTS.md and README.md's "
                              "headline table from results/*.json")
  p.add_argument("--add", type=Path, nargs="*", default=[],
                 help="results JSON files (e.g. from the GPU machine's $OUT) to merge first")
  p.add_argument("--plot", action="store_true",
                 help="also redraw the PNG charts under results/charts/ (needs matplotlib)")
  args = p.parse_args(argv)
  for src in args.add:
    print(f"merged {src} into {merge_file(src)}")
  print(f"wrote {write_results_md()}")
  if write_readme_table(README):
    print(f"wrote the headline table of {README}")
  if args.plot:
    for path in plots.write_charts(RESULTS_DIR):
      print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(_cli())
