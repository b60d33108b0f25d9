"""Shared benchmark harness for every jaxgpu op family (docs/design.md section 6).

A family script (bench_<family>.py) builds its inputs and jitted callables and hands them to
`Bench.run_case`, which times every implementation in the same run, interleaved, against the
family's anchor (XLA's fusion of the pure-JAX reference, cuDNN, ...).  `main()` wraps the CLI,
the device-copy ceiling measurement, the printed table and the result files:

    benchmarks/results/<gpu-slug>.json   merged by family (a re-run replaces only its family)
    benchmarks/RESULTS.md                regenerated from every results/*.json, never by hand

Run this file directly to regenerate RESULTS.md, optionally merging JSON files brought back
from the GPU machine first:

    python3 benchmarks/harness.py [--add /path/to/h100.json ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
RESULTS_MD = BENCH_DIR / "RESULTS.md"

# ---------------------------------------------------------------------------------------------
# Hardware ceilings.
#
# h100: measured on the `nvidia-h100-x1` device machine (NVIDIA H100 80GB HBM3, 132 SMs,
#   driver 580.159.04, jax 0.11.2), 2026-11-22, docs/design.md section 5:
#   - device copy about 3.0 TB/s counting read + write (the 3.35 TB/s spec-sheet figure is not
#     reachable by any kernel, so the measured copy is the honest 100%);
#   - bf16 8192^3 matmul about 800 TFLOP/s;
#   - L2 is 50 MB, so inputs are rotated until the rotated set exceeds 3x that.
# A device missing here falls back to the copy bandwidth measured in the same run
# (`measure_copy_bandwidth`) and a 50 MB L2.  Add a row only with a measured figure.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Ceiling:
    hbm_gbs: float | None  # device copy, read + write, GB/s (1 GB = 1e9 bytes)
    bf16_tflops: float | None
    l2_bytes: int
    source: str


CEILINGS: dict[str, Ceiling] = {
    "h100": Ceiling(hbm_gbs=3000.0, bf16_tflops=800.0, l2_bytes=50 * 2**20,
                    source="measured on nvidia-h100-x1, 2026-11-22 (docs/design.md section 5)"),
}
DEFAULT_L2_BYTES = 50 * 2**20  # H100/H200 L2; only used to size the rotated input set
ROTATE_FACTOR = 3  # rotated inputs must exceed 3x L2 (docs/design.md section 6)


# ---------------------------------------------------------------------------------------------
# Device and run metadata.
# ---------------------------------------------------------------------------------------------


def device_slug(device_kind: str) -> str:
    """Short file name for a device kind: 'NVIDIA H100 80GB HBM3' -> 'h100', 'cpu' -> 'cpu'."""
    kind = device_kind.lower()
    if kind == "cpu" or not kind:
        return "cpu"
    words = re.sub(r"[^a-z0-9]+", " ", kind).split()
    words = [w for w in words if w not in ("nvidia", "geforce", "tesla", "amd", "radeon")]
    # The first word with letters+digits is the model ("h100", "a100", "l40s", "mi300x"); the
    # memory size that follows it ("80gb") would otherwise win only by being longer.
    for w in words:
        if re.fullmatch(r"[a-z]+\d+[a-z]*", w):
            return w
    return "-".join(words) or "unknown"


def git_commit() -> str | None:
    """HEAD of the repo; JAXGPU_GIT_COMMIT wins because the GPU machine's copy has no .git."""
    if os.environ.get("JAXGPU_GIT_COMMIT"):
        return os.environ["JAXGPU_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_DIR, capture_output=True,
                             text=True, timeout=10, check=True)
        commit = out.stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO_DIR, capture_output=True, text=True, timeout=10)
        return commit + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def run_metadata() -> dict[str, Any]:
    import jax
    import jaxlib

    dev = jax.devices()[0]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "jax": jax.__version__,
        "jaxlib": getattr(jaxlib, "__version__", None),
        "device_kind": dev.device_kind,
        "platform": dev.platform,
        "device_count": jax.device_count(),
        "python": sys.version.split()[0],
    }


def ceiling_for(slug: str) -> Ceiling | None:
    return CEILINGS.get(slug)


# ---------------------------------------------------------------------------------------------
# Inputs.
# ---------------------------------------------------------------------------------------------


def random_array(key, shape: Sequence[int], dtype, *, scale: float = 1.0, offset: float = 0.0):
    """Normal(offset, scale) array in `dtype`, generated on the device.

    Never zeros: a kernel fed zeros can hit fast paths (denormal-free math, compressible
    memory) and a bug that ignores an input goes unnoticed.
    """
    import jax
    import jax.numpy as jnp

    x = jax.random.normal(key, tuple(shape), jnp.float32) * scale + offset
    return x.astype(dtype)


def tree_nbytes(tree) -> int:
    import jax

    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
               for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "shape"))


def copies_needed(bytes_per_set: int, l2_bytes: int = DEFAULT_L2_BYTES,
                  factor: int = ROTATE_FACTOR) -> int:
    """How many distinct input sets to rotate so that together they exceed factor x L2.

    E.g. a (4096, 4096) bf16 x (32 MiB) needs 5 copies to exceed 150 MiB; a (16384, 8192) one
    (256 MiB) needs 1.  Outputs are not counted: they are fresh buffers each call.
    """
    if bytes_per_set <= 0:
        return 1
    return max(1, math.floor(factor * l2_bytes / bytes_per_set) + 1)


def make_arg_sets(make_one: Callable[[Any], tuple], key, bytes_per_set: int,
                  l2_bytes: int = DEFAULT_L2_BYTES, max_copies: int | None = None) -> list[tuple]:
    """Build `copies_needed` input tuples with `make_one(key)`, each from its own key."""
    import jax

    n = copies_needed(bytes_per_set, l2_bytes)
    if max_copies is not None:
        n = min(n, max_copies)
    keys = jax.random.split(key, n)
    sets = [tuple(make_one(k)) for k in keys]
    jax.block_until_ready(sets)
    return sets


# ---------------------------------------------------------------------------------------------
# Timing.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class TimingConfig:
    warmup: int = 3  # calls after the compiling one (autotuning, allocator warm-up)
    repeats: int = 7  # median is taken over these
    target_s: float = 0.05  # wall time of one repeat; sets the calls per repeat
    min_calls: int = 10
    max_calls: int = 2000

    @classmethod
    def quick(cls) -> "TimingConfig":
        return cls(warmup=1, repeats=3, target_s=0.005, min_calls=2, max_calls=50)


@dataclasses.dataclass
class Timing:
    median_s: float  # seconds per call, median over repeats
    min_s: float
    max_s: float
    calls: int  # calls per repeat
    repeats: int

    @property
    def spread(self) -> float:
        """(max - min) / median over repeats: above ~0.1 the figure is noisy."""
        return (self.max_s - self.min_s) / self.median_s if self.median_s > 0 else float("nan")


def _dispatch(fn: Callable, arg_sets: Sequence[tuple], n: int, start: int = 0) -> float:
    """Dispatch n calls back to back (rotating inputs), block once; return wall seconds.

    Only the last output is kept and blocked on: XLA:GPU runs one device's executables in order
    on its compute stream, so the last one finishing means all have; dropping earlier outputs
    lets the allocator reuse their buffers instead of holding n large outputs.
    """
    import jax

    k = len(arg_sets)
    t0 = time.perf_counter()
    out = None
    for i in range(n):
        out = fn(*arg_sets[(start + i) % k])
    jax.block_until_ready(out)
    return time.perf_counter() - t0


def time_fns(fns: dict[str, Callable], arg_sets: Sequence[tuple],
             config: TimingConfig | None = None) -> dict[str, Timing]:
    """Time several implementations of one computation on the same inputs.

    Warm-up compiles every callable and touches every input set; the calls per repeat are then
    sized so a repeat lasts ~config.target_s (JAX dispatch costs tens of microseconds, so a
    single blocked call measures dispatch, not the kernel).  Repeats are interleaved across
    implementations so clock and thermal drift hits all of them alike.
    """
    import jax

    config = config or TimingConfig()
    arg_sets = list(arg_sets)
    k = len(arg_sets)
    calls: dict[str, int] = {}
    for name, fn in fns.items():
        for args in arg_sets:  # first call compiles; one per set puts every copy in HBM
            jax.block_until_ready(fn(*args))
        _dispatch(fn, arg_sets, max(config.warmup, 1))
        probe_n = max(config.min_calls // 2, k, 2)
        est = _dispatch(fn, arg_sets, probe_n) / probe_n
        n = int(min(max(config.target_s / max(est, 1e-9), config.min_calls), config.max_calls))
        calls[name] = max(k, -(-n // k) * k)  # whole rotations: every copy used equally
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(config.repeats):
        for name, fn in fns.items():
            samples[name].append(_dispatch(fn, arg_sets, calls[name]) / calls[name])
    return {name: Timing(median_s=statistics.median(s), min_s=min(s), max_s=max(s),
                         calls=calls[name], repeats=len(s))
            for name, s in samples.items()}


def time_fn(fn: Callable, arg_sets: Sequence[tuple], config: TimingConfig | None = None) -> Timing:
    return time_fns({"fn": fn}, arg_sets, config)["fn"]


def measure_copy_bandwidth(config: TimingConfig | None = None, nbytes: int = 2**30) -> float:
    """Device copy bandwidth in GB/s (read + write) of a large elementwise op, in this run.

    `x * 3` rather than `x + 0` or `x.copy()`: XLA simplifies those to no kernel at all.  One
    GiB in and one out is 40x the 50 MB L2, so no rotation is needed.
    """
    import jax
    import jax.numpy as jnp

    n = nbytes // 4
    x = random_array(jax.random.PRNGKey(1), (n,), jnp.float32)
    fn = jax.jit(lambda a: a * 3.0)
    t = time_fn(fn, [(x,)], config)
    return 2 * nbytes / t.median_s / 1e9


def measure_dispatch_floor(config: TimingConfig | None = None) -> float:
    """Seconds per call of a trivial jitted op dispatched back to back.

    A measured time within ~1.5x of this is dispatch-bound: the kernel is faster than JAX can
    launch it, and the figure says little about the kernel.
    """
    import jax
    import jax.numpy as jnp

    x = jnp.ones((8,), jnp.float32) * 1.5
    return time_fn(jax.jit(lambda a: a + 1.0), [(x,)], config).median_s


# ---------------------------------------------------------------------------------------------
# Records.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Record:
    """One measurement.  `vs_anchor` = anchor time / this time (> 1: faster than the anchor)."""

    family: str
    op: str
    case: str
    shape: list[int]
    dtype: str
    implementation: str
    pass_: str  # 'fwd' or 'fwd+bwd'; serialized as "pass"
    time_us: float
    time_min_us: float
    time_max_us: float
    calls: int
    repeats: int
    bytes: int | None = None
    gbs: float | None = None
    pct_ceiling: float | None = None  # of the HBM copy ceiling, in percent
    flops: float | None = None
    tflops: float | None = None
    anchor: str | None = None
    vs_anchor: float | None = None
    dispatch_bound: bool = False
    target: str | None = None  # the issue's target for this figure, when it has one
    target_met: bool | None = None

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["pass"] = d.pop("pass_")
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Record":
        d = dict(d)
        d["pass_"] = d.pop("pass")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


# ---------------------------------------------------------------------------------------------
# One benchmark run of one family.
# ---------------------------------------------------------------------------------------------


class Bench:
    """State of one family's run: device, ceilings, timing config, collected records."""

    def __init__(self, family: str, args: argparse.Namespace):
        import jax

        self.family = family
        self.args = args
        self.quick: bool = args.quick
        self.config = TimingConfig.quick() if args.quick else TimingConfig()
        if args.repeats:
            self.config.repeats = args.repeats
        self.meta = run_metadata()
        self.device_kind: str = self.meta["device_kind"]
        self.slug = device_slug(self.device_kind)
        self.on_gpu = jax.default_backend() == "gpu"
        self.ceiling = ceiling_for(self.slug)
        self.l2_bytes = self.ceiling.l2_bytes if self.ceiling else DEFAULT_L2_BYTES
        self.copy_gbs: float | None = None
        self.dispatch_floor_s: float | None = None
        self.records: list[Record] = []
        self.failures: list[str] = []

    @property
    def ceiling_gbs(self) -> float | None:
        if self.ceiling and self.ceiling.hbm_gbs:
            return self.ceiling.hbm_gbs
        return self.copy_gbs

    def measure_anchors(self) -> None:
        # On CPU a GiB copy is slow and meaningless; a small one still exercises the code path.
        nbytes = 2**30 if self.on_gpu and not self.quick else 2**24
        self.copy_gbs = measure_copy_bandwidth(self.config, nbytes)
        self.dispatch_floor_s = measure_dispatch_floor(self.config)
        ceil = self.ceiling_gbs
        print(f"# {self.device_kind} ({self.slug}): copy {self.copy_gbs:.0f} GB/s measured"
              + (f", ceiling {ceil:.0f} GB/s" if ceil else "")
              + f"; dispatch floor {self.dispatch_floor_s * 1e6:.1f} us/call", flush=True)

    def run_case(self, *, op: str, case: str, pass_: str, shape: Sequence[int], dtype,
                 fns: dict[str, Callable], arg_sets: Sequence[tuple], anchor: str | None,
                 bytes_moved: int | None = None, flops: float | None = None) -> list[Record]:
        """Time every implementation in `fns` on `arg_sets` and record them.

        bytes_moved: bytes that must cross HBM per call (each input read once, each output
        written once); flops: useful floating-point operations per call.
        """
        import jax

        # One implementation failing (not built, unsupported dtype) must not cost the others
        # their figures: try each once, keep measuring the rest, report failures at the end.
        ok = {}
        for impl, fn in fns.items():
            try:
                jax.block_until_ready(fn(*arg_sets[0]))
                ok[impl] = fn
            except Exception as e:
                self._fail(f"{op} {case} {pass_} {impl}", e)
        if not ok:
            return []
        try:
            timings = time_fns(ok, arg_sets, self.config)
        except Exception as e:
            self._fail(f"{op} {case} {pass_}", e)
            return []
        dtype_name = np.dtype(dtype).name
        anchor_t = timings[anchor].median_s if anchor in timings else None
        out = []
        for impl, t in timings.items():
            s = t.median_s
            rec = Record(family=self.family, op=op, case=case, shape=[int(d) for d in shape],
                         dtype=dtype_name, implementation=impl, pass_=pass_,
                         time_us=s * 1e6, time_min_us=t.min_s * 1e6, time_max_us=t.max_s * 1e6,
                         calls=t.calls, repeats=t.repeats, anchor=anchor)
            if bytes_moved:
                rec.bytes = int(bytes_moved)
                rec.gbs = bytes_moved / s / 1e9
                if self.ceiling_gbs:
                    rec.pct_ceiling = 100.0 * rec.gbs / self.ceiling_gbs
            if flops:
                rec.flops = float(flops)
                rec.tflops = flops / s / 1e12
            if anchor_t is not None:
                rec.vs_anchor = anchor_t / s
            if self.dispatch_floor_s is not None:
                rec.dispatch_bound = s < 1.5 * self.dispatch_floor_s
            out.append(rec)
        self.records.extend(out)
        return out

    def _fail(self, what: str, e: Exception) -> None:
        msg = f"{what}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        print(f"!! FAILED {msg}", file=sys.stderr, flush=True)
        self.failures.append(msg)

    # -- output ---------------------------------------------------------------------------

    def print_table(self, records: Sequence[Record] | None = None) -> None:
        records = self.records if records is None else records
        print()
        print(f"{self.family} on {self.device_kind}"
              + (f" (ceiling {self.ceiling_gbs:.0f} GB/s)" if self.ceiling_gbs else ""))
        print(format_text_table(records))
        if any(r.target for r in records):
            print("targets (from the issue; absolute figures are for the H100):")
            for r in records:
                if r.target:
                    mark = "MET " if r.target_met else "MISS"
                    print(f"  [{mark}] {r.op:<18} {r.case:<22} {r.pass_:<8} {r.implementation:<5}"
                          f" {fmt(r.gbs, '.0f')} GB/s {fmt(r.vs_anchor, '.2f')}x  target: {r.target}")
        if self.failures:
            print(f"{len(self.failures)} case(s) failed:")
            for f in self.failures:
                print("  " + f)

    def family_entry(self) -> dict[str, Any]:
        meta = dict(self.meta)
        meta.update({
            "quick": self.quick,
            "copy_gbs": self.copy_gbs,
            "ceiling_gbs": self.ceiling_gbs,
            "ceiling_source": (self.ceiling.source if self.ceiling and self.ceiling.hbm_gbs
                               else "copy measured in this run"),
            "bf16_tflops_ceiling": self.ceiling.bf16_tflops if self.ceiling else None,
            "dispatch_floor_us": (self.dispatch_floor_s * 1e6
                                  if self.dispatch_floor_s is not None else None),
            "timing": dataclasses.asdict(self.config),
            "failures": self.failures,
            "records": [r.to_json() for r in self.records],
        })
        return meta


def fmt(v, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def format_text_table(records: Sequence[Record]) -> str:
    head = f"{'op':<18} {'case':<22} {'pass':<8} {'impl':<5} {'us':>9} {'GB/s':>7} {'%ceil':>6} {'vs anchor':>10}"
    lines = [head, "-" * len(head)]
    for r in records:
        vs = f"{r.vs_anchor:.2f}x" if r.vs_anchor is not None else "-"
        lines.append(f"{r.op:<18} {r.case:<22} {r.pass_:<8} {r.implementation:<5} "
                     f"{r.time_us:>9.1f} {fmt(r.gbs, '.0f'):>7} {fmt(r.pct_ceiling, '.0f'):>6} "
                     f"{vs:>10}" + (" (dispatch-bound)" if r.dispatch_bound else ""))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Result files.
# ---------------------------------------------------------------------------------------------


def merge_family(path: Path, slug: str, family: str, entry: dict[str, Any]) -> dict[str, Any]:
    """Load results/<slug>.json (if any), replace `family`, write it back, return it."""
    doc: dict[str, Any] = {}
    if path.exists():
        try:
            doc = json.loads(path.read_text())
        except json.JSONDecodeError:
            print(f"warning: {path} is not valid JSON; starting it afresh", file=sys.stderr)
    doc.setdefault("families", {})
    doc["slug"] = slug
    doc["device_kind"] = entry["device_kind"]
    doc["updated"] = entry["date"]
    doc["families"][family] = entry
    doc["families"] = dict(sorted(doc["families"].items()))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def merge_file(src: Path, results_dir: Path = RESULTS_DIR) -> Path:
    """Merge a results JSON brought back from a device machine into results/, by family."""
    doc = json.loads(Path(src).read_text())
    slug = doc.get("slug") or device_slug(doc["device_kind"])
    dst = results_dir / f"{slug}.json"
    for family, entry in doc.get("families", {}).items():
        merge_family(dst, slug, family, entry)
    return dst


def _md_num(v, spec: str) -> str:
    return "" if v is None else format(v, spec)


def render_results_md(results_dir: Path = RESULTS_DIR) -> str:
    lines = [
        "# Benchmark results",
        "",
        "Generated by `benchmarks/harness.py` from `benchmarks/results/*.json`; do not edit by hand.",
        "Method (docs/design.md section 6): median over repeats of N back-to-back calls blocked once,",
        "inputs random and rotated past 3x L2.  GB/s = bytes that must move / time;",
        "% ceil = GB/s over the device-copy ceiling; vs anchor = anchor time / time (>1 is faster),",
        "the anchor measured in the same run.  Times marked * are within 1.5x of the dispatch floor.",
        "What limits each kernel, with the profiles and rejected experiments behind the figures:",
        "`docs/perf/<family>.md` (the design, its measurements, rejected designs, open ideas).",
        "",
    ]
    files = sorted(results_dir.glob("*.json")) if results_dir.exists() else []
    if not files:
        lines.append("No results yet.")
    for path in files:
        try:
            doc = json.loads(path.read_text())
        except json.JSONDecodeError:
            continue
        lines += [f"## {doc.get('device_kind', path.stem)} (`{path.name}`)", ""]
        for family, e in sorted(doc.get("families", {}).items()):
            lines.append(f"### {family}")
            lines.append("")
            ceil = e.get("ceiling_gbs")
            lines.append(
                f"{e.get('date', '?')}, commit `{e.get('commit') or 'unknown'}`, "
                f"jax {e.get('jax')} / jaxlib {e.get('jaxlib')}"
                + (" -- **quick shapes, not representative**" if e.get("quick") else "") + ".  "
                + f"Ceiling {_md_num(ceil, '.0f') or '?'} GB/s ({e.get('ceiling_source', '?')}); "
                + f"copy measured in this run {_md_num(e.get('copy_gbs'), '.0f') or '?'} GB/s; "
                + f"dispatch floor {_md_num(e.get('dispatch_floor_us'), '.1f') or '?'} us.")
            lines.append("")
            recs = [Record.from_json(r) for r in e.get("records", [])]
            has_flops = any(r.tflops for r in recs)
            has_target = any(r.target for r in recs)
            cols = ["op", "case", "pass", "impl", "time (us)", "GB/s", "% ceil"]
            cols += ["TFLOP/s"] if has_flops else []
            cols += ["vs anchor"]
            cols += ["target"] if has_target else []
            lines.append("| " + " | ".join(cols) + " |")
            # text columns left-aligned, figures right-aligned, the target text left-aligned
            align = ["---" if i < 4 or c == "target" else "---:" for i, c in enumerate(cols)]
            lines.append("|" + "|".join(align) + "|")
            for r in recs:
                anchor_tag = " (anchor)" if r.implementation == r.anchor else ""
                row = [r.op, r.case, r.pass_, r.implementation + anchor_tag,
                       f"{r.time_us:.1f}" + ("*" if r.dispatch_bound else ""),
                       _md_num(r.gbs, ".0f"), _md_num(r.pct_ceiling, ".0f")]
                row += [_md_num(r.tflops, ".1f")] if has_flops else []
                row += [f"{r.vs_anchor:.2f}x" if r.vs_anchor is not None else ""]
                if has_target:
                    row += ["" if not r.target else
                            f"{'met' if r.target_met else '**missed**'}: {r.target}"]
                lines.append("| " + " | ".join(row) + " |")
            if e.get("failures"):
                lines += ["", "Failed cases:", ""] + [f"- {f}" for f in e["failures"]]
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def write_results_md(results_dir: Path = RESULTS_DIR, path: Path = RESULTS_MD) -> Path:
    path.write_text(render_results_md(results_dir))
    return path


# ---------------------------------------------------------------------------------------------
# CLI.
# ---------------------------------------------------------------------------------------------


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
    p.add_argument("--no-anchors", action="store_true",
                   help="skip the device-copy and dispatch-floor measurements")
    return p


# The issues' forward bandwidth target: 2.8 TB/s on the H100 (93% of its 3.0 TB/s device
# copy); on another GPU the same fraction of that GPU's ceiling stands in for it.
TARGET_FWD_GBS_H100 = 2800.0


def _fwd_gbs_target(bench: "Bench") -> tuple[float | None, str | None]:
  if bench.slug == "h100":
    return TARGET_FWD_GBS_H100, "2.8 TB/s"
  if bench.ceiling_gbs:
    frac = TARGET_FWD_GBS_H100 / CEILINGS["h100"].hbm_gbs
    target = frac * bench.ceiling_gbs
    return target, f"{target / 1000:.2f} TB/s ({frac:.0%} of ceiling)"
  return None, None


def mark_targets(bench: "Bench", records: Sequence["Record"], pass_: str, *, fwd_vs: float,
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


def case_shapes(bench: "Bench", shapes: Sequence[tuple], quick_shapes: Sequence[tuple]) -> list:
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
    run_family(bench)
    bench.print_table()

    if not bench.records:
        # An empty run (import error, every case failed) must not replace good results.
        print("no records: nothing written", file=sys.stderr)
        return 1
    entry = bench.family_entry()
    name = f"{bench.slug}.json"
    if not args.no_write and not args.quick:
        merge_family(RESULTS_DIR / name, bench.slug, family, entry)
        write_results_md()
        print(f"wrote {RESULTS_DIR / name} and {RESULTS_MD}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        # Start from the repo's file so the copy brought back holds every family of this device.
        base = RESULTS_DIR / name
        if base.exists() and not (out / name).exists():
            (out / name).write_text(base.read_text())
        merge_family(out / name, bench.slug, family, entry)
        write_results_md(out, out / "RESULTS.md")
        print(f"wrote {out / name} and {out / 'RESULTS.md'}")
    return 1 if bench.failures else 0


def _cli(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="regenerate benchmarks/RESULTS.md from results/*.json")
    p.add_argument("--add", type=Path, nargs="*", default=[],
                   help="results JSON files (e.g. from the GPU machine's $OUT) to merge first")
    args = p.parse_args(argv)
    for src in args.add:
        print(f"merged {src} into {merge_file(src)}")
    print(f"wrote {write_results_md()}")
    return 0


if __name__ == "__main__":
    sys.exit(_cli())
