"""PNG charts of a device's results (results/<slug>.json), drawn from the records only:
`python3 benchmarks/harness.py --plot` (or a bench run with --plot) rewrites them under
results/charts/. matplotlib is an optional dependency (`pip install "jaxgpu[plot]"`).

  <slug>-attention.png      TFLOP/s against sequence length (B * T = 16k tokens), a panel
                            per pass and mask, a line per implementation and head dim
  <slug>-memory-bound.png   GB/s of the memory-bound ops' forward passes beside XLA's, with
                            the copy rate measured in the same run
  <slug>-model.png          the Gemma model: training tokens/s and memory, decode tokens/s
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from benchlib.record import Record

MEMORY_BOUND = ("norm", "softmax", "activation", "rope", "cross_entropy")
COLORS = {"cuda": "#1f77b4", "cuda-unordered": "#ff7f0e", "cudnn": "#d62728",
          "pallas": "#2ca02c", "xla": "#7f7f7f", "jaxnn": "#9467bd", "contig": "#8c564b",
          "cuda-int8": "#17becf", "cuda-int4": "#bcbd22", "xla-f32": "#e377c2"}


def _records(doc: dict, family: str) -> list[Record]:
  entry = doc.get("families", {}).get(family)
  return [Record.from_json(r) for r in entry["records"]] if entry else []


def _save(fig, path: Path, plt, title: str | None = None) -> bool:
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def _attention_case(case: str):
  """'b4t4096n32h64-causal' -> (T, H, causal); None for another label."""
  m = re.fullmatch(r"b\d+t(\d+)n\d+(?:k\d+)?h(\d+)(-causal)?", case)
  return (int(m.group(1)), int(m.group(2)), bool(m.group(3))) if m else None


def attention_chart(doc: dict, path: Path, plt) -> bool:
  recs = [r for r in _records(doc, "attention") if r.op == "attention" and r.tflops]
  if not recs:
    return False
  fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharey="row")
  for row, pass_ in enumerate(("fwd", "fwd+bwd")):
    for col, causal in enumerate((False, True)):
      ax = axes[row][col]
      series: dict[tuple[str, int], list[tuple[int, float]]] = {}
      for r in recs:
        parsed = _attention_case(r.case)
        if parsed is None or r.pass_ != pass_ or parsed[2] != causal:
          continue
        series.setdefault((r.implementation, parsed[1]), []).append((parsed[0], r.tflops))
      for (impl, h), points in sorted(series.items()):
        points.sort()
        ax.plot([t for t, _ in points], [v for _, v in points], marker="os^"[h // 100 % 3],
                color=COLORS.get(impl), linestyle="-" if h == 128 else ":",
                label=f"{impl} H{h}")
      ax.set_xscale("log", base=2)
      ax.set_title(f"{pass_}{', causal' if causal else ''}")
      ax.set_xlabel("sequence length T (B x T = 16k)")
      ax.grid(alpha=0.3)
      if col == 0:
        ax.set_ylabel("TFLOP/s")
      ax.legend(fontsize=7)
  return _save(fig, path, plt, f"attention, bf16, {doc.get('device_kind', '')}")


def memory_bound_chart(doc: dict, path: Path, plt) -> bool:
  bars = []  # (label, {impl: GB/s}), copy GB/s
  copy = None
  for family in MEMORY_BOUND:
    entry = doc.get("families", {}).get(family)
    if not entry:
      continue
    copy = copy or entry.get("copy_gbs")
    by_case: dict[str, dict[str, float]] = {}
    for r in _records(doc, family):
      if r.pass_ == "fwd" and r.gbs:
        by_case.setdefault(f"{r.op} {r.case}", {})[r.implementation] = r.gbs
    bars += sorted(by_case.items())
  if not bars:
    return False
  impls = [i for i in ("cuda", "xla", "jaxnn") if any(i in b for _, b in bars)]
  width = 0.8 / len(impls)
  fig, ax = plt.subplots(figsize=(max(10, 0.35 * len(bars)), 5))
  for k, impl in enumerate(impls):
    xs = [i + k * width for i in range(len(bars))]
    ax.bar(xs, [b.get(impl, 0) for _, b in bars], width, label=impl, color=COLORS.get(impl))
  if copy:
    ax.axhline(copy, color="black", linestyle="--", linewidth=1,
               label=f"device copy {copy:.0f} GB/s")
  ax.set_xticks([i + 0.4 - width / 2 for i in range(len(bars))])
  ax.set_xticklabels([label for label, _ in bars], rotation=75, ha="right", fontsize=7)
  ax.set_ylabel("GB/s (bytes that must move / time)")
  ax.set_title(f"memory-bound ops, forward, {doc.get('device_kind', '')}")
  ax.legend(fontsize=8, loc="lower left")
  return _save(fig, path, plt)


def _note_number(notes: str | None, pattern: str) -> float | None:
  m = re.search(pattern, notes or "")
  return float(m.group(1).replace(",", "")) if m else None


def model_chart(doc: dict, path: Path, plt) -> bool:
  train = _records(doc, "model_train")
  decode = _records(doc, "model_decode")
  if not train and not decode:
    return False
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
  panels = (
      (axes[0], train, r"([\d,]+) tokens/s", "training tokens/s"),
      (axes[1], train, r"memory ([\d.]+) GiB", "training step memory (GiB)"),
      (axes[2], decode, r"([\d,]+) tokens/s", "decode tokens/s"),
  )
  for ax, recs, pattern, title in panels:
    labels, impls = [], []
    for r in recs:
      label = f"{r.op.split(' ', 1)[-1]} {r.case}"
      if label not in labels:
        labels.append(label)
      if r.implementation not in impls:
        impls.append(r.implementation)
    width = 0.8 / max(1, len(impls))
    for k, impl in enumerate(impls):
      values = []
      for label in labels:
        match = [r for r in recs if f"{r.op.split(' ', 1)[-1]} {r.case}" == label
                 and r.implementation == impl]
        values.append(_note_number(match[0].notes, pattern) or 0 if match else 0)
      ax.bar([i + k * width for i in range(len(labels))], values, width, label=impl,
             color=COLORS.get(impl))
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))])
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax.set_yscale("log" if "decode" in title else "linear")
    ax.set_title(title)
    ax.legend(fontsize=7)
  return _save(fig, path, plt, f"jaxgpu.models.gemma, bf16, {doc.get('device_kind', '')}")


CHARTS = {"attention": attention_chart, "memory-bound": memory_bound_chart,
          "model": model_chart}


def write_charts(results_dir: Path, out_dir: Path | None = None) -> list[Path]:
  """Every chart of every results/<slug>.json that has the records for it."""
  try:
    import matplotlib
  except ImportError as e:
    raise SystemExit('--plot needs matplotlib: pip install "jaxgpu[plot]"') from e
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  out_dir = out_dir or results_dir / "charts"
  out_dir.mkdir(parents=True, exist_ok=True)
  written = []
  for src in sorted(results_dir.glob("*.json")):
    doc = json.loads(src.read_text())
    for name, chart in CHARTS.items():
      path = out_dir / f"{src.stem}-{name}.png"
      if chart(doc, path, plt):
        written.append(path)
  return written
