"""One measurement (Record) and one family's benchmark run (Bench): times every
implementation of a case in the same run and relates it to the anchor and the ceilings."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any
from collections.abc import Callable, Sequence

import numpy as np

from benchlib.device import DEFAULT_L2_BYTES, ceiling_for, device_slug, run_metadata
from benchlib.timing import (TimingConfig, measure_copy_bandwidth, measure_dispatch_floor,
                             time_fns)



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
  notes: str | None = None  # figures a family adds (tokens/s, MFU, peak memory, a roofline)
  # A record kept from an earlier run of its family: that run's {"commit", "date"}.
  measured: dict[str, Any] | None = None

  def to_json(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["pass"] = d.pop("pass_")
    if d["measured"] is None:  # a figure of this run
      del d["measured"]
    return d

  @classmethod
  def from_json(cls, d: dict[str, Any]) -> Record:
    d = dict(d)
    d["pass_"] = d.pop("pass")
    known = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in known})




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
    # Ops of this family that a partial run left out: their earlier records stay in results/.
    self.keep_ops: tuple[str, ...] = ()
    self.failures: list[str] = []
    self.skipped: list[str] = []  # cases left out by design (e.g. they do not fit the device)

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

  def skip(self, what: str, why: str) -> None:
    """A case not run, by design (not a failure: the exit status stays 0)."""
    print(f"  skipped {what}: {why}", flush=True)
    self.skipped.append(f"{what}: {why}")

  def runnable(self, what: str, fns: dict, args: tuple) -> dict:
    """The implementations of case `what` whose first call on args succeeds; each other one
    is skipped with the first line of its error (out of memory, a shape a library refuses,
    not built)."""
    import jax

    ok = {}
    for impl, fn in fns.items():
      try:
        jax.block_until_ready(fn(*args))
        ok[impl] = fn
      except Exception as e:  # noqa: BLE001 (any failure of an implementation is a skip)
        text = str(e).strip()
        first = text.splitlines()[0] if text else ""
        oom = "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()
        self.skip(f"{what} {impl}",
                  ("out of memory: " if oom else f"{type(e).__name__}: ") + first[:160])
    return ok

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
    if self.skipped:
      print(f"{len(self.skipped)} case(s) skipped:")
      for s in self.skipped:
        print("  " + s)
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
        "skipped": self.skipped,
        "records": [r.to_json() for r in self.records],
    })
    return meta


def fmt(v, spec: str, none: str = "-") -> str:
  return none if v is None else format(v, spec)


def format_text_table(records: Sequence[Record]) -> str:
  head = (f"{'op':<18} {'case':<22} {'pass':<8} {'impl':<5} {'us':>9} {'GB/s':>7} {'%ceil':>6} "
          f"{'vs anchor':>10}")
  lines = [head, "-" * len(head)]
  for r in records:
    vs = f"{r.vs_anchor:.2f}x" if r.vs_anchor is not None else "-"
    lines.append(f"{r.op:<18} {r.case:<22} {r.pass_:<8} {r.implementation:<5} "
                 f"{r.time_us:>9.1f} {fmt(r.gbs, '.0f'):>7} {fmt(r.pct_ceiling, '.0f'):>6} "
                 f"{vs:>10}" + (" (dispatch-bound)" if r.dispatch_bound else ""))
  return "\n".join(lines)
