"""The package: public API, target registration, implementation selection, the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

import jaxgpu
from jaxgpu import _ffi, _implementation

from conftest import HAS_CUDA

REPO = Path(__file__).resolve().parents[1]
# Every public op is traceable by name: its FFI targets are jaxgpu_<op>_fwd and _bwd.
OPS = [name for name in jaxgpu.__all__
       if callable(getattr(jaxgpu, name)) and getattr(jaxgpu, name).__module__.startswith("jaxgpu.ops")]
# The target stem is the op's name, except where the op keeps jax.nn's longer name.
TARGET_STEMS = {"dot_product_attention": "attention"}
OP_TARGETS = {f"jaxgpu_{TARGET_STEMS.get(op, op)}_{p}" for op in OPS for p in ("fwd", "bwd")}


def test_public_api():
  for name in jaxgpu.__all__:
    assert hasattr(jaxgpu, name), name
  assert {"rms_norm", "layer_norm", "available_implementations"} <= set(jaxgpu.__all__)
  assert set(jaxgpu.IMPLEMENTATIONS) == {"cuda", "cpu", "xla"}
  assert isinstance(jaxgpu.__version__, str)


def test_registered_targets():
  targets = _ffi.registered_targets()
  assert len(OPS) >= 11, OPS
  assert OP_TARGETS <= set(targets["cpu"]), OP_TARGETS - set(targets["cpu"])
  if HAS_CUDA and _ffi.cuda_module() is not None:
    assert OP_TARGETS <= set(targets["cuda"]), OP_TARGETS - set(targets["cuda"])
  assert _ffi.registered_targets() is targets  # registered once


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
