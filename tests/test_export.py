"""jax.export of a program built from jaxgpu ops, run in a process that only imports jaxgpu.

A training step of a small transformer block (rms_norm with the residual, linear, rope,
causal attention, swiglu, cross_entropy), loss and gradients, is exported for
("cpu", "cuda") with `jaxgpu.export_disabled_checks()`, serialized, and run in a fresh
process (tests/fresh_process.py): the results equal this process's. The gpu test exports
the same program in a CPU-only process and runs the artifact's CUDA lowering on the GPU.
Every op alone is exported and run in a fresh process by test_contract.py
(test_export_round_trip).
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgpu
from jaxgpu import _family

import contract as C
import fresh_process
from conftest import HAS_CUDA

B, T, N, H, V = 2, 17, 4, 16, 101
D = N * H


def model(params, x, labels):
  y, h = jaxgpu.rms_norm(x, params["norm"], residual=x)
  q, k, v = jnp.split(jaxgpu.linear(y, params["qkv"]), 3, axis=-1)
  q, k, v = (a.reshape(B, T, N, H) for a in (q, k, v))
  positions = jnp.arange(T, dtype=jnp.int32)
  q, k = jaxgpu.rope(q, positions), jaxgpu.rope(k, positions)
  o = jaxgpu.dot_product_attention(q, k, v, is_causal=True).reshape(B, T, D)
  gate, up = jnp.split(jaxgpu.linear(o + h, params["up"]), 2, axis=-1)
  logits = jaxgpu.linear(jaxgpu.swiglu(gate, up), params["out"])
  return jaxgpu.cross_entropy(logits, labels)


def step(params, x, labels):
  return jax.value_and_grad(model)(params, x, labels)


def inputs(dtype, seed=0):
  rng = np.random.default_rng(seed)
  draw = lambda *shape: jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[0]), dtype)
  params = {"norm": draw(D), "qkv": draw(D, 3 * D), "up": draw(D, 4 * D),
            "out": draw(2 * D, V)}
  x = jnp.asarray(rng.standard_normal((B, T, D)), dtype)
  labels = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
  return params, x, labels


def export_step(folder, dtype_name: str) -> None:
  """Writes step.jaxexport and step.args.npz into `folder` (also run as a CPU-only
  subprocess by the gpu test)."""
  folder = pathlib.Path(folder)
  args = inputs(jnp.dtype(dtype_name))
  (folder / "step.jaxexport").write_bytes(C.export(step, *args).serialize())
  fresh_process.save_arrays(folder / "step.args.npz", jax.tree.leaves((args, {})))


def test_disabled_checks_name_every_target():
  """One check per target name on every platform: the generic one and `_cpu`, `_cuda`."""
  names = [check.is_custom_call() for check in jaxgpu.export_disabled_checks()]
  want = {n for t in _family.all_targets() for n in (t, f"{t}_cpu", f"{t}_cuda")}
  assert len(names) == len(want) and set(names) == want


def test_export_needs_the_disabled_checks():
  """Without them jax refuses the custom calls (what export_disabled_checks is for)."""
  import jax.export  # noqa: PLC0415

  with pytest.raises(ValueError, match="jaxgpu_rms_norm_fwd"):
    jax.export.export(jax.jit(lambda x: jaxgpu.rms_norm(x)))(jnp.ones((2, 8)))


def test_import_registers_every_target(tmp_path):
  """An artifact of every platform's target names, explicit implementations included,
  runs in a process that only imported jaxgpu (nothing else was called there first)."""
  x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 5, 8)), jnp.float32)
  progs = {}
  for impl in ("cpu", None):
    f = lambda a, impl=impl: jaxgpu.gelu(jaxgpu.rms_norm(a, implementation=impl),
                                         implementation=impl)
    progs[f"rms_gelu_{impl}"] = (C.export(f, x), (x,))
  run = C.run_fresh(progs, tmp_path, cache=False)
  for name, (exported, args) in progs.items():
    want = jax.tree.leaves(exported.call(*args))
    for got, w in zip(run.result(name), want):
      np.testing.assert_array_equal(got, np.asarray(w))


def test_training_step_round_trip(tmp_path):
  """Loss and gradients of the step, exported for ("cpu", "cuda") on this machine, run in a
  fresh process: equal to this process's call of the artifact, and to jit(step) here."""
  if HAS_CUDA:
    pytest.skip("the gpu test below runs the artifact on the GPU")
  args = inputs(jnp.float32)
  exported = C.export(step, *args)
  assert exported.platforms == ("cpu", "cuda")
  targets = set(re.findall(r"custom_call @(\w+)", exported.mlir_module()))
  assert {"jaxgpu_rms_norm_fwd", "jaxgpu_rms_norm_bwd", "jaxgpu_linear_dgrad",
          "jaxgpu_attention_fwd", "jaxgpu_attention_bwd", "jaxgpu_cross_entropy_bwd",
          "jaxgpu_rope_bwd", "jaxgpu_swiglu_bwd"} <= targets, targets
  run = C.run_fresh({"step": (exported, args)}, tmp_path, cache=False)
  here = jax.tree.leaves(exported.call(*args))
  direct = jax.tree.leaves(jax.jit(step)(*args))
  for got, want, ref in zip(run.result("step"), here, direct):
    np.testing.assert_array_equal(got, np.asarray(want))
    np.testing.assert_allclose(got, np.asarray(ref), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_artifact_exported_on_cpu_runs_on_cuda(tmp_path):
  """The step in bfloat16, exported by a CPU-only process (JAX_PLATFORMS=cpu, as on a
  machine without a GPU), runs its CUDA lowering here: loss and gradients close to
  jit(step) traced here (the same kernels; only XLA's fusion around them may differ)."""
  tests = pathlib.Path(__file__).parent
  code = (f"import sys; sys.path.insert(0, {str(tests)!r}); import test_export; "
          f"test_export.export_step({str(tmp_path)!r}, 'bfloat16')")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-4000:]
  import jax.export  # noqa: PLC0415

  exported = jax.export.deserialize(bytearray((tmp_path / "step.jaxexport").read_bytes()))
  args, kwargs = jax.tree.unflatten(exported.in_tree,
                                    fresh_process.load_arrays(tmp_path / "step.args.npz"))
  got = jax.tree.leaves(exported.call(*args, **kwargs))
  assert all(d.platform == "gpu" for g in got for d in g.devices())
  want = jax.tree.leaves(jax.jit(step)(*args))
  for g, w in zip(got, want):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, w, rtol=0, atol=2e-2 * max(1.0, float(np.abs(w).max())))
