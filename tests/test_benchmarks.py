"""The benchmark harness (benchmarks/harness.py, benchmarks/benchlib/): result files, the
generated RESULTS.md and README table, and a quick CPU run of one family's script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from benchlib import results  # noqa: E402
from benchlib.record import Record  # noqa: E402


def _record(impl, pass_, time_us, gbs=None, tflops=None, op="rms_norm", case="16384x8192"):
  return Record(family="norm", op=op, case=case, shape=[16384, 8192], dtype="bfloat16",
                implementation=impl, pass_=pass_, time_us=time_us, time_min_us=time_us,
                time_max_us=time_us, calls=10, repeats=3, gbs=gbs, tflops=tflops,
                anchor="xla").to_json()


def _entry(records, commit="abc1234"):
  return {"date": "2026-11-25T00:00:00+00:00", "commit": commit, "jax": "0.11.2",
          "jaxlib": "0.11.2", "device_kind": "NVIDIA H100 80GB HBM3", "records": records}


def test_merge_keeps_other_families(tmp_path):
  path = tmp_path / "h100.json"
  results.merge_family(path, "h100", "norm", _entry([_record("cuda", "fwd", 10.0)]))
  results.merge_family(path, "h100", "softmax", _entry([], commit="def5678"))
  results.merge_family(path, "h100", "norm", _entry([_record("cuda", "fwd", 9.0)], "0000001"))
  doc = json.loads(path.read_text())
  assert set(doc["families"]) == {"norm", "softmax"}
  assert doc["families"]["norm"]["commit"] == "0000001"
  assert doc["families"]["softmax"]["commit"] == "def5678"


def test_partial_run_keeps_the_ops_it_left_out_with_their_commit(tmp_path):
  path = tmp_path / "h100.json"
  first = [{**_record("cuda", "fwd", 10.0), "op": "linear"},
           {**_record("cuda", "fwd", 5.0), "op": "qlinear"}]
  results.merge_family(path, "h100", "matmul", _entry(first, commit="1111111"))
  again = [{**_record("cuda", "fwd", 9.0), "op": "linear"}]
  results.merge_family(path, "h100", "matmul", _entry(again, commit="2222222"), ("qlinear",))
  fam = json.loads(path.read_text())["families"]["matmul"]
  assert fam["commit"] == "2222222"
  by_op = {r["op"]: r for r in fam["records"]}
  assert by_op["linear"]["time_us"] == 9.0 and "measured" not in by_op["linear"]
  assert by_op["qlinear"]["time_us"] == 5.0
  assert by_op["qlinear"]["measured"]["commit"] == "1111111"
  assert "The `qlinear` rows are from another run: commit `1111111`" in (
      results.render_results_md(tmp_path))
  # A full run (nothing kept) replaces the family.
  results.merge_family(path, "h100", "matmul", _entry(again, commit="3333333"))
  assert [r["op"] for r in json.loads(path.read_text())["families"]["matmul"]["records"]] == [
      "linear"]


def test_readme_table_ratio_is_against_the_fastest_other(tmp_path):
  recs = [_record("cuda", "fwd", 10.0, gbs=2900.0), _record("xla", "fwd", 12.0, gbs=2400.0),
          _record("jaxnn", "fwd", 11.0, gbs=2600.0), _record("cuda", "fwd+bwd", 20.0, gbs=2500.0),
          _record("xla", "fwd+bwd", 19.0, gbs=2600.0)]
  results.merge_family(tmp_path / "h100.json", "h100", "norm", _entry(recs))
  table = results.render_readme_table(tmp_path, "h100")
  row = next(line for line in table.splitlines() if line.startswith("| `rms_norm` "))
  cells = [c.strip() for c in row.strip("|").split("|")]
  assert cells[1:] == ["2900 GB/s", "1.10x jaxnn", "2500 GB/s", "0.95x xla"], cells
  assert "norm at `abc1234`" in table


def test_readme_table_replaces_only_its_block(tmp_path):
  results.merge_family(tmp_path / "h100.json", "h100", "norm",
                       _entry([_record("cuda", "fwd", 10.0, gbs=1.0)]))
  readme = tmp_path / "README.md"
  readme.write_text(f"before\n{results.README_BEGIN}\nstale\n{results.README_END}\nafter\n")
  assert results.write_readme_table(readme, tmp_path)
  text = readme.read_text()
  assert text.startswith("before\n") and text.endswith(f"{results.README_END}\nafter\n")
  assert "stale" not in text and "`rms_norm`" in text
  readme.write_text("no markers\n")
  assert not results.write_readme_table(readme, tmp_path)
  assert readme.read_text() == "no markers\n"


def test_repository_readme_table_is_generated():
  """The README's table is what the harness renders from benchmarks/results/ (regenerate
  with `python3 benchmarks/harness.py`)."""
  text = (REPO / "README.md").read_text()
  begin = text.index(results.README_BEGIN) + len(results.README_BEGIN)
  end = text.index(results.README_END)
  assert text[begin:end].strip() == results.render_readme_table().strip()


def test_charts_are_drawn_from_the_results(tmp_path):
  """Every chart renders from the repository's results (the PNGs the README shows are these
  files, redrawn by `python3 benchmarks/harness.py --plot`)."""
  pytest.importorskip("matplotlib")
  from benchlib import plots

  written = plots.write_charts(results.RESULTS_DIR, tmp_path)
  assert {p.name for p in written} >= {"h100-attention.png", "h100-memory-bound.png",
                                       "h100-model.png"}
  for p in written:
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000
    assert (results.RESULTS_DIR / "charts" / p.name).exists(), f"{p.name} is not committed"


def test_quick_bench_runs_on_cpu(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  out = subprocess.run(
      [sys.executable, str(REPO / "benchmarks" / "bench_norm.py"), "--quick", "--no-write",
       "--no-anchors", "--out", str(tmp_path)],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  doc = json.loads((tmp_path / "cpu.json").read_text())
  recs = doc["families"]["norm"]["records"]
  assert {r["implementation"] for r in recs} == {"cpu", "xla"}
  assert (tmp_path / "RESULTS.md").exists()


def test_interrupted_run_writes_what_it_measured(tmp_path):
  """A run stopped at a time limit (SIGINT) still writes the cases it measured, marked as cut
  short in the JSON and in RESULTS.md, and exits 1."""
  import harness

  def run(bench):
    bench.records.append(Record(family="norm", op="rms_norm", case="8x8", shape=[8, 8],
                                dtype="bfloat16", implementation="cpu", pass_="fwd",
                                time_us=1.0, time_min_us=1.0, time_max_us=1.0, calls=1,
                                repeats=1, anchor="xla"))
    raise KeyboardInterrupt

  rc = harness.main("norm", run, ["--no-write", "--no-anchors", "--out", str(tmp_path)])
  assert rc == 1
  (name,) = [p.name for p in tmp_path.glob("*.json")]
  entry = json.loads((tmp_path / name).read_text())["families"]["norm"]
  assert entry["interrupted"] is True
  assert [r["case"] for r in entry["records"]] == ["8x8"]
  assert "cut short at a time limit" in (tmp_path / "RESULTS.md").read_text()


def test_kept_records_of_an_op_measured_again_in_part_name_their_run(tmp_path):
  """bench_model keeps the records a run did not measure again (by op, case and
  implementation) with the run that measured them: the tag survives Record's round trip,
  and RESULTS.md names the implementations whose rows are older."""
  old = Record.from_json({**_record("cuda-int8", "decode", 7.0, op="decode m"),
                          "measured": {"commit": "1111111", "date": "2026-11-27T00:00:00"}})
  assert old.to_json()["measured"]["commit"] == "1111111"
  fresh = _record("cuda", "decode", 5.0, op="decode m")
  results.merge_family(tmp_path / "h100.json", "h100", "model_decode",
                       _entry([old.to_json(), fresh], commit="2222222"))
  text = results.render_results_md(tmp_path)
  assert ("The `decode m` rows of cuda-int8 are from another run: commit `1111111`, "
          "2026-11-27.") in text


def test_records_of_some_cases_from_another_run_name_those_cases(tmp_path):
  """A family assembled from two runs (some cases measured again at a later commit): the
  header names the cases whose rows come from the other run, not the whole op."""
  again = {**_record("cuda", "fwd", 4.0, op="paged", case="b8"),
           "measured": {"commit": "3333333", "date": "2026-12-02T00:00:00"}}
  kept = _record("cuda", "fwd", 6.0, op="paged", case="b64")
  results.merge_family(tmp_path / "h200.json", "h200", "decode",
                       _entry([kept, again], commit="2222222"))
  text = results.render_results_md(tmp_path)
  assert "The `paged` rows of cuda in `b8` are from another run: commit `3333333`" in text
