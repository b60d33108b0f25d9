"""jaxgpu.launch: one process per device joined by jax.distributed, here on CPU devices
(gloo): the Gemma training step data, tensor and fully sharded data parallel over two
processes gives the one-process losses (benchmarks/bench_multigpu.py, tiny config), and a
failing process stops the launch."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxgpu import launch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_multigpu.py"


def _run_cases(nproc: int, cases: str, out: Path) -> None:
  args = ["run", "--tiny", "--model", "gemma2_2b", "--cases", cases, "--batch", "4", "--seq",
          "16", "--steps", "3", "--context", "16", "--decode-batches", "2", "--repeats", "1",
          "--out", str(out)]
  status = launch.launch([sys.executable, "-P", str(BENCH), *args], nproc=nproc,
                         platform="cpu")
  assert status == 0


def test_two_processes_train_like_one(tmp_path):
  out = tmp_path / "runs.jsonl"
  _run_cases(1, "single,decode", out)
  _run_cases(2, "dp,tp,fsdp,decode", out)
  runs = [json.loads(x) for x in out.read_text().splitlines()]
  by = {(r["case"], r["gpus"], r["batch"]): r for r in runs}
  one = by[("single", 1, 4)]
  for case in ("dp", "tp", "fsdp"):
    r = by[(case, 2, 4)]
    for got, want in zip(r["losses"], one["losses"], strict=True):
      assert abs(got - want) <= 1e-4 * abs(want), (case, r["losses"], one["losses"])
    assert r["non_weight_gathers"] == [], case
  assert set(by[("dp", 2, 4)]["collectives"]) == {"all-reduce"}
  assert "all-gather" in by[("fsdp", 2, 4)]["collectives"]
  assert set(by[("decode", 2, 2)]["collectives"]) == {"all-reduce"}
  assert by[("decode", 2, 2)]["cache_spec"].count("model") == 1
  results = tmp_path / "results"
  subprocess.run([sys.executable, "-P", str(BENCH), "summarize", str(out), "--tiny",
                  "--results-dir", str(results)], check=True, capture_output=True)
  doc = json.loads((results / "cpu-x2.json").read_text())
  train = doc["families"]["multigpu_train"]["records"]
  assert {r["case"].split()[0] for r in train} == {"single", "dp", "tp", "fsdp"}
  assert all(r["target_met"] for r in train if r["implementation"] == "2gpu")


def test_a_failing_process_stops_the_launch():
  code = ("import os, sys, time\n"
          "sys.exit(3) if os.environ['JAX_PROCESS_ID'] == '1' else time.sleep(120)")
  t0 = time.perf_counter()
  assert launch.launch([sys.executable, "-c", code], nproc=2, platform="cpu") == 3
  assert time.perf_counter() - t0 < 60


def test_children_get_the_process_grid_and_nvlink_multicast_off():
  env = launch.child_env({"NCCL_NVLS_ENABLE": "1"}, coordinator="h:1", num_processes=8,
                         process_id=5, local_rank=1, platform="gpu", cpu_devices=1)
  assert env["NCCL_NVLS_ENABLE"] == "0"
  assert (env["JAX_COORDINATOR_ADDRESS"], env["JAX_NUM_PROCESSES"], env["JAX_PROCESS_ID"],
          env["JAX_LOCAL_DEVICE_IDS"]) == ("h:1", "8", "5", "1")


@pytest.mark.parametrize("kw", [dict(nproc=0), dict(nproc=1, nnodes=2),
                                dict(nproc=1, nnodes=2, node_rank=2, coordinator="h:1")])
def test_bad_grids_are_rejected(kw):
  with pytest.raises(ValueError):
    launch.launch(["true"], **kw)
