"""The main-loop switch of the CUDA attention kernels (ffi/attention/attention_path.h): the FFI
attribute `path` and its testing hook, jaxgpu.ops.attention._force_path.

On a GPU (marker `gpu`): a seeded sample of tests/test_attention.py's cases, forward and
gradients, under each forced main loop against that file's float64 oracle (its `run_case`),
so that an H100 runs both main loops in one process; a main loop forced where it cannot run
is an error that says why; 'auto' computes exactly what the main loop it picks computes.
On the CPU: the hook, the attribute each call lowers with, and the handlers' checks of it.
"""

from __future__ import annotations

import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgpu
from jaxgpu import _ffi
from jaxgpu.ops import attention as attention_op

import oracle
import test_attention as ta

# ---- the GPU sample --------------------------------------------------------------------------

OPTIONS = (ta.Opts(), ta.Opts(causal=True), ta.Opts(window=(5, 3)), ta.Opts(softcap=3.0),
           ta.Opts(segments=True), ta.Opts(causal=True, softcap=3.0, segments=True),
           ta.Opts(window=(40, 0), segments=True, scale=0.3))
# Head dims per main loop: mma.sync has kernels for every padded head dim (32, 64, 96, 128,
# 256); wgmma for 64, 128 and 256 (59 and 111 pad to 64 and 128 with zero columns).
HEAD_DIMS = {"mma_sync": (32, 59, 96, 128, 256), "wgmma": (59, 64, 111, 128, 256)}
# Odd lengths, T != S both ways, and tiles of the 64- and 128-key kernels in full.
PAIRS = ((1, 1), (17, 113), (113, 17), (1023, 1023), (1023, 255), (256, 128), (128, 384))
HEADS = ((4, 4), (6, 2), (3, 1))  # MHA, GQA (R = 3), MQA
SAMPLE_SEED = 23


def sample(path: str) -> list:
  """Every option set at every head dim of `path`, each with a (T, S) pair, a head layout
  and a dtype drawn with a fixed seed (the same cases on every run)."""
  rng = np.random.default_rng(SAMPLE_SEED)
  cases = []
  for opts in OPTIONS:
    for h in HEAD_DIMS[path]:
      t, s = PAIRS[rng.integers(len(PAIRS))]
      n, k = HEADS[rng.integers(len(HEADS))]
      cases.append(ta.Case(2, t, s, n, k, h, ta.LOWP_DTYPES[rng.integers(2)], opts))
  return cases


def _path_params():
  return [pytest.param(path, case, id=f"{path}-{case.id()}", marks=pytest.mark.gpu)
          for path in HEAD_DIMS for case in sample(path)]


@pytest.mark.parametrize("path,case", _path_params())
def test_forced_path(path, case, rng):
  """Forward and gradients of one case on one forced main loop, against the oracle."""
  with attention_op._force_path(path):
    ta.run_case(case, "cuda", rng)


def test_sample_covers_each_path():
  """Each main loop's sample meets every option set, head dim, head layout and dtype."""
  for path, dims in HEAD_DIMS.items():
    cases = sample(path)
    assert {c.h for c in cases} == set(dims)
    assert {c.opts for c in cases} == set(OPTIONS)
    assert {(c.n, c.k) for c in cases} == set(HEADS), path
    assert {c.dtype for c in cases} == set(ta.LOWP_DTYPES), path


def _wgmma_runs_here() -> bool:
  """Whether 'auto' picks wgmma for head dims padded to 64, 128 or 256 on this machine."""
  archs = _ffi.cuda_module().cuda_architectures().split(",")
  return ("90a" in archs and jax.devices("cuda")[0].compute_capability == "9.0"
          and os.environ.get("JAXGPU_ATTENTION_MMA_SYNC", "0") in ("", "0"))


def _op_and_grads(q, k, v, do):
  fn = lambda q, k, v: jaxgpu.dot_product_attention(q, k, v, is_causal=True,
                                                    implementation="cuda")
  o, vjp = jax.vjp(jax.jit(fn), q, k, v)
  return (o, *vjp(do))


@pytest.mark.gpu
@pytest.mark.parametrize("h", (96, 128))
def test_auto_is_the_path_it_picks(h, rng):
  """'auto' computes bit for bit what the main loop it resolves to computes: wgmma at a head
  dim it takes on an H100 of an sm_90a build, mma.sync elsewhere (the kernels are
  deterministic, so the same main loop gives the same bits)."""
  case = ta.Case(2, 300, 300, 4, 2, h)
  q, k, v = ta.make_qkv(rng, case)
  do = oracle.randn(rng, case.q_shape, case.dtype)
  auto = _op_and_grads(q, k, v, do)
  picked = "wgmma" if h != 96 and _wgmma_runs_here() else "mma_sync"
  other = "mma_sync" if picked == "wgmma" else None
  with attention_op._force_path(picked):
    forced = _op_and_grads(q, k, v, do)
  for name, a, b in zip(("o", "dq", "dk", "dv"), auto, forced):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{name} ({picked})")
  if other is not None:  # and the two main loops are told apart (they round differently)
    with attention_op._force_path(other):
      other_out = _op_and_grads(q, k, v, do)
    assert any(not np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(auto, other_out))


@pytest.mark.gpu
@pytest.mark.parametrize("h", (32, 96, 128))
def test_wgmma_refused_where_it_cannot_run(h, rng):
  """Forcing wgmma where it cannot run (head dims padded to 32 or 96; any head dim off an
  sm_90a build on compute capability 9.0) fails the call with the reason, never crashes nor
  falls back to mma.sync."""
  archs = _ffi.cuda_module().cuda_architectures().split(",")
  hopper = "90a" in archs and jax.devices("cuda")[0].compute_capability == "9.0"
  if hopper and h == 128:
    pytest.skip("wgmma runs H = 128 here (test_forced_path)")
  case = ta.Case(1, 40, 40, 2, 2, h)
  q, k, v = ta.make_qkv(rng, case)
  with attention_op._force_path("wgmma"):
    fn = jax.jit(lambda q, k, v: jaxgpu.dot_product_attention(q, k, v, implementation="cuda"))
    with pytest.raises(Exception, match="path: wgmma cannot run this call here") as err:
      jax.block_until_ready(fn(q, k, v))
  if "90a" not in archs:
    why = "no sm_90a code"
  elif h != 128:
    why = "head dims padded to 64, 128 or 256"
  else:
    why = "compute capability 9.0"
  assert why in str(err.value), str(err.value)


@pytest.mark.gpu
@pytest.mark.parametrize("extra", ["bias", "mask"])
def test_bias_and_mask_run_on_mma_sync(extra, rng):
  """A bias or a mask runs on the mma_sync kernels: 'auto' takes them there (bitwise the
  forced mma_sync result, forward and gradients), and a forced wgmma fails the call with
  the reason on a Hopper build."""
  archs = _ffi.cuda_module().cuda_architectures().split(",")
  hopper = "90a" in archs and jax.devices("cuda")[0].compute_capability == "9.0"
  case = ta.Case(2, 200, 130, 4, 2, 128)
  q, k, v = ta.make_qkv(rng, case)
  kw = {"bias": dict(bias=oracle.randn(rng, (1, 4, 200, 130), jnp.bfloat16)),
        "mask": dict(mask=jnp.asarray(rng.random((2, 1, 200, 130)) < 0.8))}[extra]

  def run(path):
    with attention_op._force_path(path):
      f = lambda q, k, v: jaxgpu.dot_product_attention(q, k, v, implementation="cuda", **kw)
      loss = lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) ** 2)
      return jax.jit(f)(q, k, v), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

  for a, b in zip(jax.tree.leaves(run("auto")), jax.tree.leaves(run("mma_sync"))):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  if hopper:
    with pytest.raises(Exception, match="no bias or mask"):
      jax.block_until_ready(run("wgmma"))


# Sequence lengths on both main loops: every wgmma head dim, odd lengths, the options.
LENGTH_CASES = [
    ta.Case(3, 1023, 1023, 4, 2, 128, jnp.bfloat16, ta.Opts(causal=True)),
    ta.Case(3, 255, 700, 6, 2, 64, jnp.float16, ta.Opts(softcap=5.0, segments=True)),
    ta.Case(2, 384, 128, 3, 1, 256, jnp.bfloat16, ta.Opts(window=(100, 20))),
    ta.Case(3, 113, 385, 4, 4, 111, jnp.bfloat16, ta.Opts(causal=True, softcap=3.0)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["mma_sync", "wgmma"])
@pytest.mark.parametrize("case", LENGTH_CASES, ids=lambda c: c.id())
def test_lengths_on_each_path(path, case, rng):
  """query_seq_lengths / key_value_seq_lengths (rows of length 0 included) under each forced
  main loop, forward and gradients against the float64 oracle."""
  archs = _ffi.cuda_module().cuda_architectures().split(",")
  hopper = "90a" in archs and jax.devices("cuda")[0].compute_capability == "9.0"
  if path == "wgmma" and not hopper:
    pytest.skip("wgmma needs an sm_90a build on a compute capability 9.0 device")
  with attention_op._force_path(path):
    ta.run_extras(case, ta.Extra(lengths="both"), "cuda", rng)


# ---- the hook and the attribute (CPU) ---------------------------------------------------------


def test_force_path_rejects_unknown_names():
  with pytest.raises(ValueError, match="expected one of"):
    with attention_op._force_path("mma.sync"):
      pass


def test_force_path_is_scoped():
  """The block sets the path; leaving it, by an exception too, restores the outer one."""
  assert attention_op._forced_path.get() == "auto"
  with attention_op._force_path("wgmma"):
    with pytest.raises(RuntimeError):
      with attention_op._force_path("mma_sync"):
        assert attention_op._forced_path.get() == "mma_sync"
        raise RuntimeError
    assert attention_op._forced_path.get() == "wgmma"
  assert attention_op._forced_path.get() == "auto"


def _small_inputs(dtype=jnp.bfloat16):
  """q (1, 5, 4, 16), k and v (1, 7, 2, 16) on the CPU."""
  with jax.default_device(jax.devices("cpu")[0]):
    return ta.make_qkv(np.random.default_rng(0), ta.Case(1, 5, 7, 4, 2, 16, dtype))


@pytest.mark.parametrize("path", ("auto", "mma_sync", "wgmma"))
def test_calls_lower_with_the_path(path):
  """Both passes' custom calls carry the path the call was traced under (lowering only: no
  kernel runs), as the int32 the handlers read."""
  q, k, v = _small_inputs()

  def loss(q, k, v):
    return jaxgpu.dot_product_attention(q, k, v, implementation="cpu").astype(jnp.float32).sum()

  with jax.default_device(jax.devices("cpu")[0]), attention_op._force_path(path):
    text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, k, v).as_text()
  calls = [line for line in text.splitlines() if "jaxgpu_attention_" in line]
  assert {re.search(r"jaxgpu_attention_(fwd|bwd)", c).group(1) for c in calls} == {"fwd", "bwd"}
  for call in calls:
    assert re.search(rf"path = {attention_op._PATHS[path]} : i32", call), call


@pytest.mark.parametrize("path", ("mma_sync", "wgmma"))
def test_cpu_kernel_refuses_a_forced_path(path):
  """The CPU kernel has no CUDA main loop: forcing one is an error, not ignored."""
  q, k, v = _small_inputs()
  with jax.default_device(jax.devices("cpu")[0]), attention_op._force_path(path):
    fn = jax.jit(lambda q, k, v: jaxgpu.dot_product_attention(q, k, v, implementation="cpu"))
    with pytest.raises(Exception, match=f"path: {path} is a CUDA main loop"):
      jax.block_until_ready(fn(q, k, v))


def test_xla_implementation_ignores_the_hook():
  q, k, v = _small_inputs()
  plain = jaxgpu.dot_product_attention(q, k, v, implementation="xla")
  with attention_op._force_path("wgmma"):
    forced = jaxgpu.dot_product_attention(q, k, v, implementation="xla")
  np.testing.assert_array_equal(np.asarray(plain), np.asarray(forced))


_NO_TILE_COUNTER = jax.ShapeDtypeStruct((0,), jnp.int32)


def _raw_cpu_fwd(q5, k, v, counter=_NO_TILE_COUNTER, **attrs):
  """The CPU forward target called directly with exactly `attrs` (and the tile counter
  workspace `counter`, which only the CUDA forward uses)."""
  b, t, kh, r, _ = q5.shape
  out = (jax.ShapeDtypeStruct(q5.shape, q5.dtype),
         jax.ShapeDtypeStruct((b, kh, r, t), jnp.float32), counter)
  empty = jnp.zeros((0,), jnp.int32)
  # segment ids, bias, mask, lengths: all absent
  absent = (empty, empty, jnp.zeros((0,), jnp.float32), jnp.zeros((0,), jnp.bool_), empty, empty)
  call = jax.ffi.ffi_call(_ffi.target_name("jaxgpu_attention_fwd", "cpu"), out)
  return jax.jit(lambda q5, k, v: call(q5, k, v, *absent, **attrs))(q5, k, v)


_ATTRS = dict(scale=np.float32(0.25), softcap=np.float32(0.0), causal=True,
              window_left=np.int64(-1), window_right=np.int64(-1), has_segments=False)


def _needs_cpu():
  if "cpu" not in jaxgpu.available_implementations():
    pytest.skip("no CPU module")


def test_handler_path_is_optional():
  """path = 0 is the same call as no path at all (programs lowered without the attribute)."""
  _needs_cpu()
  q, k, v = _small_inputs(dtype=jnp.float32)
  q5 = q.reshape(1, 5, 2, 2, 16)
  with jax.default_device(jax.devices("cpu")[0]):
    without = _raw_cpu_fwd(q5, k, v, **_ATTRS)
    auto = _raw_cpu_fwd(q5, k, v, **_ATTRS, path=np.int32(0))
  for a, b in zip(without, auto):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("attrs,match", [
    (dict(_ATTRS, path=np.int32(3)), r"path: must be 0 \(auto\), 1 \(mma_sync\) or 2"),
    (dict(_ATTRS, path=np.int32(-1)), "path: must be 0"),
    (dict(_ATTRS, path=np.int64(0)), "attribute path"),
    (dict(_ATTRS, path=np.int32(1)), "path: mma_sync is a CUDA main loop"),
    (dict(_ATTRS, paths=np.int32(0)), "attributes: expected scale"),
    ({a: v for a, v in _ATTRS.items() if a != "scale"}, "attribute scale"),
    (dict(_ATTRS, causal=np.int32(1)), "attribute causal"),
    (dict(_ATTRS, has_bias=np.int32(1)), "attribute has_bias"),
    (dict(_ATTRS, deterministic=np.int32(0)), "attribute deterministic"),
], ids=["path-3", "path-negative", "path-int64", "path-forced", "unknown-name", "missing-scale",
        "causal-type", "has-bias-type", "deterministic-type"])
def test_handler_checks_the_attributes(attrs, match):
  _needs_cpu()
  q, k, v = _small_inputs(dtype=jnp.float32)
  with jax.default_device(jax.devices("cpu")[0]):
    with pytest.raises(Exception, match=match):
      jax.block_until_ready(_raw_cpu_fwd(q.reshape(1, 5, 2, 2, 16), k, v, **attrs))



# ---- the fused Hopper backward's workspaces -------------------------------------------------


def test_warp_specialized_workspaces_only_where_the_kernels_can_run(monkeypatch):
  """The calls get the Hopper kernels' workspaces (the forward's tile counter, the
  backward's dq_accum and dq_semaphores) only where those kernels can take them; elsewhere
  the backward's would be 2x q's bytes for nothing. The Hopper check is patched: this
  decides shapes, it runs nothing."""
  monkeypatch.setattr(attention_op, "_hopper_present", lambda: True)
  base = attention_op._Config(scale=1.0, softcap=0.0, causal=False, window=(-1, -1),
                              has_segments=False, implementation="cuda")
  bf16, replace = jnp.bfloat16, dataclasses.replace
  ws = attention_op._warp_specialized
  assert ws(base, 128, bf16) and ws(base, 64, jnp.float16) and ws(base, 256, bf16)
  assert ws(replace(base, causal=True, window=(7, 0)), 40, bf16)
  assert not ws(base, 96, bf16)        # the mma.sync kernels' head dim
  assert not ws(base, 32, bf16)
  assert not ws(base, 128, jnp.float32)
  assert ws(replace(base, has_segments=True), 128, bf16)
  assert not ws(replace(base, has_lengths=True), 128, bf16)
  assert not ws(replace(base, bias="[g] k r t s"), 128, bf16)
  assert not ws(replace(base, mask="[g] k r t s"), 128, bf16)
  assert not ws(replace(base, implementation="cpu"), 128, bf16)
  assert not ws(replace(base, path=attention_op._PATHS["mma_sync"]), 128, bf16)
  monkeypatch.setattr(attention_op, "_hopper_present", lambda: False)
  assert not ws(base, 128, bf16)


@pytest.mark.parametrize("counter", [jax.ShapeDtypeStruct((2,), jnp.int32),
                                     jax.ShapeDtypeStruct((1,), jnp.float32)],
                         ids=["two-words", "float32"])
def test_handler_checks_the_tile_counter(counter):
  """The forward's tile_counter workspace: one int32 or none."""
  _needs_cpu()
  q, k, v = _small_inputs(dtype=jnp.float32)
  with jax.default_device(jax.devices("cpu")[0]):
    with pytest.raises(Exception, match="tile_counter"):
      jax.block_until_ready(_raw_cpu_fwd(q.reshape(1, 5, 2, 2, 16), k, v, counter, **_ATTRS))
    one = _raw_cpu_fwd(q.reshape(1, 5, 2, 2, 16), k, v,
                       jax.ShapeDtypeStruct((1,), jnp.int32), **_ATTRS)
    none = _raw_cpu_fwd(q.reshape(1, 5, 2, 2, 16), k, v, **_ATTRS)
  for a, b in zip(one[:2], none[:2]):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_handler_deterministic_is_optional():
  """deterministic = True is the same call as no attribute at all, and False changes nothing
  on the CPU kernels (their sums have one order)."""
  _needs_cpu()
  q, k, v = _small_inputs(dtype=jnp.float32)
  q5 = q.reshape(1, 5, 2, 2, 16)
  with jax.default_device(jax.devices("cpu")[0]):
    without = _raw_cpu_fwd(q5, k, v, **_ATTRS)
    for flag in (True, False):
      got = _raw_cpu_fwd(q5, k, v, **_ATTRS, deterministic=flag)
      for a, b in zip(without, got):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_deterministic_must_be_static_bool():
  q, k, v = _small_inputs(dtype=jnp.float32)
  with pytest.raises(TypeError, match="deterministic must be a static bool"):
    jaxgpu.dot_product_attention(q, k, v, deterministic=1)


@pytest.mark.gpu
def test_nondeterministic_backward_matches_float64(rng):
  """deterministic=False on the fused Hopper backward: o and the gradients against the
  float64 oracle under the same rule as the default's (only dQ's float32 add order
  differs), and dk, dv bitwise equal to the default's."""
  for opts in (ta.Opts(), ta.Opts(causal=True), ta.Opts(window=(70, 9), softcap=3.0)):
    case = ta.Case(2, 333, 333, 4, 2, 128, jnp.bfloat16, opts)
    q, k, v = ta.make_qkv(rng, case)
    do = oracle.randn(rng, case.q_shape, case.dtype)
    grads = {}
    for flag in (True, False):
      def fn(q, k, v, flag=flag):
        return jaxgpu.dot_product_attention(q, k, v, implementation="cuda",
                                            deterministic=flag, **case.opts.kw())
      grads[flag] = jax.jit(jax.grad(lambda q, k, v, fn=fn: ta.loss(fn, q, k, v, (), do),
                                     argnums=(0, 1, 2)))(q, k, v)
    o = jax.jit(fn)(q, k, v)
    ta.check_all(case, "cuda", q, k, v, (), do, o, grads[False], what="deterministic=False ")
    for a, b in zip(grads[True][1:], grads[False][1:]):
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
