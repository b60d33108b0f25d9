"""The package: public API, target registration, implementation selection, the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

import jaxgpu
from jaxgpu import _family, _ffi, _implementation

from conftest import HAS_CUDA

REPO = Path(__file__).resolve().parents[1]
FAMILIES = _family.families()
# Every public op, as the families declare them.
OPS = [op.name for f in FAMILIES for op in f.ops]


def test_public_api():
  for name in jaxgpu.__all__:
    assert hasattr(jaxgpu, name), name
  assert {"rms_norm", "layer_norm", "available_implementations"} <= set(jaxgpu.__all__)
  assert set(jaxgpu.IMPLEMENTATIONS) == {"cuda", "cpu", "xla"}
  assert isinstance(jaxgpu.__version__, str)


def test_family_declarations():
  """Each family names its module, declares ops that jaxgpu exports, and no target twice."""
  assert [f.name for f in FAMILIES] == list(_family.FAMILY_NAMES)
  exported = {name for name in jaxgpu.__all__ if callable(getattr(jaxgpu, name))
              and getattr(jaxgpu, name).__module__.startswith("jaxgpu.ops")}
  assert sorted(OPS) == sorted(exported), set(OPS) ^ exported
  assert len(OPS) == len(set(OPS))
  for f in FAMILIES:
    for op in f.ops:
      assert getattr(jaxgpu, op.name).__module__ == f"jaxgpu.ops.{f.name}", op.name
      if op.differentiable:
        assert len(op.targets) >= 2, f"{op.name}: a differentiable op needs a backward target"
  targets = [t for f in FAMILIES for op in f.ops for t in op.targets.values()]
  assert len(targets) == len(set(targets)), "a target declared twice"


def test_declared_targets_are_the_compiled_ones():
  """The compiled modules register exactly the targets the families declare: a handler
  nobody calls, or a declared target with no handler, fails here."""
  targets = _ffi.registered_targets()
  declared = _family.all_targets()
  assert set(targets["cpu"]) == declared, set(targets["cpu"]) ^ declared
  if HAS_CUDA and _ffi.cuda_module() is not None:
    assert set(targets["cuda"]) == declared, set(targets["cuda"]) ^ declared
  assert _ffi.registered_targets() is targets  # registered once


def test_declared_targets_are_in_the_ffi_sources():
  """grep finds every target from Python to C++: each declared name appears literally in
  its family's ffi/<family>/<family>_targets.h."""
  for f in FAMILIES:
    header = (REPO / "ffi" / f.name / f"{f.name}_targets.h").read_text()
    for t in f.targets:
      assert f'"{t}"' in header, (f.name, t)


def test_wheel_smoke_runs_every_op():
  """tools/wheel_smoke.py (CI's check of an installed wheel) calls every declared op: a new
  op fails here, in the suite, rather than only in CI's wheel step."""
  text = (Path(__file__).resolve().parents[1] / "tools" / "wheel_smoke.py").read_text()
  missing = [op for op in _family.all_ops() if f'"{op}":' not in text]
  assert not missing, f"tools/wheel_smoke.py does not call {missing}"


def test_op_target_lookup():
  op = _family.all_ops()["rms_norm"][1]
  assert op.target("fwd", None) == "jaxgpu_rms_norm_fwd"
  assert op.target("bwd", "cpu") == "jaxgpu_rms_norm_bwd_cpu"
  with pytest.raises(ValueError, match="no pass"):
    op.target("dgrad", None)
  with pytest.raises(ValueError, match="jaxgpu_"):
    _family.Op("bad", {"fwd": "bad_fwd"})


def test_target_names():
  assert _ffi.target_name("jaxgpu_rms_norm_fwd", None) == "jaxgpu_rms_norm_fwd"
  assert _ffi.target_name("jaxgpu_rms_norm_fwd", "cpu") == "jaxgpu_rms_norm_fwd_cpu"


def test_available_implementations():
  impls = jaxgpu.available_implementations()
  assert impls[-1] == "xla"
  assert set(impls) <= set(jaxgpu.IMPLEMENTATIONS)
  assert "cpu" in impls, "the CPU handlers are always built"
  assert ("cuda" in impls) == (HAS_CUDA and _ffi.cuda_module() is not None)
  assert list(impls) == [i for i in ("cuda", "cpu", "xla") if i in impls]  # fastest first


def test_resolve():
  assert _implementation.resolve("xla") == "xla"
  assert _implementation.resolve("cpu") == "cpu"
  with pytest.raises(ValueError, match="implementation"):
    _implementation.resolve("bogus")
  if not HAS_CUDA:
    with pytest.raises(ValueError, match="implementation='cuda'"):
      _implementation.resolve("cuda")
    assert _implementation.resolve(None) is None  # the platform-generic kernel


def test_eight_cpu_devices(cpu_devices):
  assert len(cpu_devices) == 8
  assert all(d.platform == "cpu" for d in cpu_devices)


def test_jax_newer_than_tested():
  from jaxgpu import __main__ as cli
  major, minor = cli.NEWEST_TESTED_JAX
  assert not cli.jax_newer_than_tested(f"{major}.{minor}.9")
  assert not cli.jax_newer_than_tested("0.10.2")
  assert cli.jax_newer_than_tested(f"{major}.{minor + 1}.0")
  assert cli.jax_newer_than_tested(f"{major + 1}.0.0.dev20270101")
  assert not cli.jax_newer_than_tested("unknown")


def test_cli_info():
  if not (REPO / "jaxgpu" / "__main__.py").exists():
    pytest.skip("jaxgpu/__main__.py does not exist yet")
  env = dict(os.environ)
  env.pop("JAXGPU_IMPLEMENTATION", None)
  out = subprocess.run([sys.executable, "-m", "jaxgpu", "info"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  text = out.stdout
  assert jaxgpu.__version__ in text
  assert jax.__version__ in text
  for op in ("rms_norm", "layer_norm"):
    assert op in text, text
