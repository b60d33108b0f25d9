"""dot_product_attention (jaxgpu/ops/attention.py, kernels in ffi/attention/): the numerics
and semantics, run against every implementation (the `implementation` fixture,
conftest.py). The transform contract (vmap, sharding, shard_map, pmap, bad inputs, size 0,
targets) is tests/test_contract.py's, from the spec in tests/specs/attention.py.

Oracles (tests/specs/attention.py), written independently of jaxgpu.reference:
  * `np_attention`: float64 numpy forward AND backward (the analytic gradients), fed the
    exact values the low-precision inputs hold;
  * `jnp_attention`: the same attention in jnp at the op's precision (float32 logits and
    softmax, probabilities rounded to the value dtype before P.V, float32 accumulation),
    differentiated by jax.grad. Its error against float64 sets the budget: FlashAttention's
    rule, a result may be at most 2x as far from float64 as this reference, plus a rounding
    atol (tests/oracle.py `check`).

The matrix: MHA/GQA/MQA x causal x window x softcap x segment ids x head dims {32, 59, 64,
96, 111, 128, 256}, with (T, S) pairs (odd ones, T != S) and the dtype rotated across it.
On the CPU a deterministic sample of it runs at small sizes (CI time); the whole matrix at
GPU sizes (test_matrix_gpu: the CUDA kernels on every case, the pure-JAX reference on every
8th) carries the `gpu` marker.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxgpu

import oracle
from conftest import HAS_CUDA
from specs import SPECS
from specs.attention import (GRAD_ULPS, Case, Opts, jnp_attention, make_qkv, make_segments,
                             np_attention, np_extra_keep, np_keep)

LOWP_DTYPES = (jnp.bfloat16, jnp.float16)
HEAD_DIMS = (32, 59, 64, 96, 111, 128, 256)
# (N, K): MHA, GQA with an odd group (R = 3), MQA.
HEADS = {"mha": (4, 4), "gqa": (6, 2), "mqa": (3, 1)}
WINDOWS = (None, (5, 3))


# ---- options and cases ------------------------------------------------------------------------


def matrix(pairs, b: int) -> list[Case]:
  """Every (heads, causal, window, softcap, segments, H), the (T, S) pair and the dtype
  rotated across them (coprime cycle lengths, so each pair meets every option)."""
  out = []
  combos = itertools.product(HEADS.values(), (False, True), WINDOWS, (None, 3.0), (False, True),
                             HEAD_DIMS)
  for i, ((n, k), causal, window, cap, seg, h) in enumerate(combos):
    t, s = pairs[i % len(pairs)]
    out.append(Case(b, t, s, n, k, h, LOWP_DTYPES[(i // len(HEAD_DIMS)) % 2],
                    Opts(causal, window, cap, seg)))
  return out


# GPU sizes: odd lengths (1, 17, 113, 1023) and T != S both ways; 11 pairs, coprime to 7.
GPU_PAIRS = [(1, 1), (17, 17), (113, 113), (1023, 1023), (17, 113), (113, 17), (1, 1023),
             (1023, 1), (256, 128), (128, 384), (1023, 255)]
# CPU sizes: the same kinds of pair, small (the CPU kernel is a straightforward loop).
CPU_PAIRS = [(1, 1), (17, 17), (113, 113), (17, 113), (113, 17), (1, 64), (64, 1), (40, 24),
             (24, 40), (17, 40), (64, 64)]
GPU_MATRIX = matrix(GPU_PAIRS, b=2)
# A deterministic sample for the CPU run: every 16th case (21 of 336), which meets every
# head layout, head dim and dtype, and every pair of the four options in all four on/off
# combinations (test_sample_covers_the_options).
CPU_SAMPLE = matrix(CPU_PAIRS, b=2)[2::16]
# Long sequences on the CPU too, with few heads and a small H (the loops are O(T S H)).
CPU_SAMPLE += [Case(1, 1023, 1023, 2, 1, 32, jnp.bfloat16, Opts(causal=True)),
               Case(1, 255, 1023, 2, 2, 59, jnp.float16, Opts(window=(100, 30), segments=True))]


def loss(fn, q, k, v, segs, do):
  """<fn(q, k, v), do> in float32: its gradient is one VJP with the cotangent do."""
  o = fn(q, k, v, *segs)
  acc = jnp.promote_types(o.dtype, jnp.float32)
  return jnp.sum(o.astype(acc) * do.astype(acc))


@functools.partial(jax.jit, static_argnums=0)
def ref_forward(opts: Opts, q, k, v, segs):
  return jnp_attention(opts, q, k, v, *segs)


@functools.partial(jax.jit, static_argnums=0)
def ref_grads(opts: Opts, q, k, v, segs, do):
  return jax.grad(lambda q, k, v: loss(functools.partial(jnp_attention, opts), q, k, v, segs,
                                       do), argnums=(0, 1, 2))(q, k, v)


def kernel_fn(implementation, opts: Opts):
  def fn(q, k, v, q_seg=None, kv_seg=None):
    return jaxgpu.dot_product_attention(q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
                                        implementation=implementation, **opts.kw())
  return fn


def check_all(case: Case, implementation, q, k, v, segs, do, o, grads, what=""):
  """o and (dq, dk, dv) against the float64 oracle, under the 2x-reference rule."""
  dtype = case.dtype
  o64, g64, extra = np_attention(case, q, k, v, *segs, do=do, o_residual=o)
  oracle.check(o, o64, ref_forward(case.opts, q, k, v, segs), what=f"{what}o", dtype=dtype)
  lowp = ref_grads(case.opts, q, k, v, segs, do)
  for name, got, exact, ref, a in zip(("dq", "dk", "dv"), grads, g64, lowp, extra):
    assert got.shape == exact.shape and got.dtype == dtype, (name, got.shape, got.dtype)
    oracle.check(got, exact, ref, what=f"{what}{name}", dtype=dtype, atol_ulps=GRAD_ULPS,
                 extra_atol=a)


def run_inputs(case: Case, implementation, q, k, v, segs, do, jit=True, what=""):
  """The op and its gradients on these inputs, checked by check_all: (o, (dq, dk, dv))."""
  fn = kernel_fn(implementation, case.opts)
  wrap = jax.jit if jit else (lambda f: f)
  o = wrap(fn)(q, k, v, *segs)
  assert o.shape == case.q_shape and o.dtype == case.dtype
  grads = wrap(jax.grad(lambda q, k, v, segs, do: loss(fn, q, k, v, segs, do),
                        argnums=(0, 1, 2)))(q, k, v, segs, do)
  check_all(case, implementation, q, k, v, segs, do, o, grads, what=what)
  return o, grads


def run_case(case: Case, implementation, rng, jit=True):
  q, k, v = make_qkv(rng, case)
  segs = make_segments(rng, case)
  do = oracle.randn(rng, case.q_shape, case.dtype)
  o, grads = run_inputs(case, implementation, q, k, v, segs, do, jit=jit)
  return q, k, v, segs, o, grads


# ---- the matrix -----------------------------------------------------------------------------


def _case_params(cases, prefix="", marks=()):
  return [pytest.param(c, id=prefix + c.id(), marks=marks) for c in cases]


@pytest.mark.parametrize("case", _case_params(CPU_SAMPLE))
def test_matrix(case, implementation, rng):
  """Forward and gradients (dq, dk, dv) of one case of the CPU sample."""
  run_case(case, implementation, rng)


def _gpu_matrix_params():
  """Every case of the matrix on the CUDA kernels; the pure-JAX reference ('xla') on every
  8th: a case's time goes to its oracles and compiles, not to the op, and the reference's
  code does not change with the size (the CPU sample runs it on every option)."""
  out = [pytest.param(c, "cuda", id=f"{c.id()}-cuda", marks=pytest.mark.gpu)
         for c in GPU_MATRIX]
  out += [pytest.param(c, "xla", id=f"{c.id()}-xla", marks=pytest.mark.gpu)
          for c in GPU_MATRIX[::8]]
  return out


@pytest.mark.parametrize("case,impl", _gpu_matrix_params())
def test_matrix_gpu(case, impl, rng):
  """Forward and gradients (dq, dk, dv) of one case of the matrix at GPU sizes."""
  run_case(case, impl, rng)


def _flags(opts: Opts):
  return (opts.causal, opts.window is not None, opts.softcap is not None, opts.segments)


def test_sample_covers_the_options():
  """The CPU sample meets every head layout, head dim and dtype, and each pair of options
  in all four on/off combinations."""
  seen = {(c.n, c.k) for c in CPU_SAMPLE}
  assert seen >= set(HEADS.values()), seen
  assert {c.h for c in CPU_SAMPLE} == set(HEAD_DIMS)
  assert {c.dtype for c in CPU_SAMPLE} == set(LOWP_DTYPES)
  pairs = {(a, b, _flags(c.opts)[a], _flags(c.opts)[b]) for c in CPU_SAMPLE
           for a, b in itertools.combinations(range(4), 2)}
  assert len(pairs) == 6 * 4, pairs
  assert any(c.t != c.s for c in CPU_SAMPLE)


def test_eager(implementation, rng):
  """Outside jit too, with every option at once and GQA."""
  case = Case(2, 17, 40, 6, 2, 59, jnp.float16, Opts(True, (4, 2), 5.0, True, 0.3))
  run_case(case, implementation, rng, jit=False)


@pytest.mark.parametrize("case", [
    Case(2, 17, 23, 4, 2, 64, jnp.float32, Opts(causal=True, softcap=3.0)),
    Case(1, 33, 33, 3, 1, 59, jnp.float32, Opts(window=4, segments=True)),
], ids=lambda c: c.id())
def test_float32(case, implementation, rng):
  """float32 runs on the CPU kernel and the reference; the CUDA kernels refuse it."""
  if implementation == "cuda":
    q, k, v = make_qkv(rng, case)
    with pytest.raises(ValueError, match="implementation='cuda'.*float32"):
      kernel_fn("cuda", case.opts)(q, k, v, *make_segments(rng, case))
    return
  run_case(case, implementation, rng)


@pytest.mark.skipif(not HAS_CUDA, reason="the float32 fallback is for JAX with a CUDA backend")
@pytest.mark.gpu
def test_float32_default_on_gpu_is_reference(rng):
  """implementation=None with float32 on a CUDA machine runs the pure-JAX reference."""
  case = Case(2, 17, 17, 4, 2, 64, jnp.float32, Opts(causal=True))
  q, k, v = make_qkv(rng, case)
  lowered = jax.jit(kernel_fn(None, case.opts)).lower(q, k, v)
  text = lowered.as_text()
  assert not any(t in text for t in SPECS["dot_product_attention"].op.targets.values())
  run_case(case, None, rng)


def test_scale_default_uses_original_head_dim(implementation, rng):
  """With H = 59 the kernels run on H padded to 64; the default scale stays 1/sqrt(59)."""
  case = Case(1, 9, 9, 2, 2, 59, jnp.bfloat16)
  q, k, v = make_qkv(rng, case)
  got = kernel_fn(implementation, case.opts)(q, k, v)
  explicit = kernel_fn(implementation, Opts(scale=1 / math.sqrt(59)))(q, k, v)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(explicit, np.float32))


@pytest.mark.parametrize("scale", (-0.3, 0.0), ids=("negative", "zero"))
def test_scale_sign_and_zero(scale, implementation, rng):
  """The kernels take scale > 0: a negative scale's sign moves onto q, a zero scale gives
  uniform attention with dq = dk = 0. Forward and gradients against the float64 oracle."""
  run_case(Case(1, 19, 23, 4, 2, 32, jnp.bfloat16, Opts(causal=True, scale=scale)),
           implementation, rng)


def test_matches_jax_nn(implementation, rng):
  """Where every query sees a key, the semantics are jax.nn.dot_product_attention's (GQA,
  causal and window masks, scale)."""
  case = Case(2, 24, 24, 8, 2, 32, jnp.float32)
  q, k, v = make_qkv(rng, case)
  kw = dict(scale=0.2, is_causal=True, local_window_size=(5, 2))
  if implementation == "cuda":
    q, k, v = (a.astype(jnp.bfloat16) for a in (q, k, v))
  want = jax.nn.dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                      v.astype(jnp.float32), implementation="xla", **kw)
  got = jaxgpu.dot_product_attention(q, k, v, implementation=implementation, **kw)
  tol = 2e-2 if implementation == "cuda" else 2e-5
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=tol, atol=tol)


# ---- rows with nothing visible --------------------------------------------------------------


@pytest.mark.parametrize("dtype", LOWP_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_empty_rows(dtype, implementation, rng):
  """Queries that see no key (a window past the last key, a segment id no key has):
  zeros, zero dq, no NaN anywhere, the other rows and dk/dv exact to the rule."""
  case = Case(2, 24, 16, 4, 2, 32, dtype, Opts(window=(0, 0), segments=True))
  q, k, v = make_qkv(rng, case)
  q_seg = np.zeros((2, 24), np.int32)
  kv_seg = np.zeros((2, 16), np.int32)
  q_seg[0, 3:6] = 7                  # no key has id 7
  q_seg[1] = 7                       # a whole sequence without keys
  segs = (jnp.asarray(q_seg), jnp.asarray(kv_seg))
  do = oracle.randn(rng, case.q_shape, dtype)
  o, grads = run_inputs(case, implementation, q, k, v, segs, do, what="empty rows: ")
  empty = ~np_keep(case, q_seg, kv_seg)[:, 0].any(-1)   # (B, T)
  assert empty[0, 3:6].all() and empty[1].all() and empty[0, 16:].all()
  on = np.asarray(o, np.float32)
  dq = np.asarray(grads[0], np.float32)
  assert np.isfinite(on).all() and all(np.isfinite(np.asarray(g, np.float32)).all()
                                       for g in grads)
  assert not on[empty].any() and not dq[empty].any()
  assert not np.asarray(grads[1], np.float32)[1].any()   # batch 1 sees nothing: dk = dv = 0


def test_all_masked(implementation, rng):
  """Every query masked (no key shares a segment id): zeros everywhere."""
  case = Case(1, 8, 8, 2, 1, 16, jnp.bfloat16, Opts(causal=True, segments=True))
  q, k, v = make_qkv(rng, case)
  segs = (jnp.ones((1, 8), jnp.int32), jnp.zeros((1, 8), jnp.int32))
  fn = kernel_fn(implementation, case.opts)
  o, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, *segs), q, k, v)
  assert not np.asarray(o, np.float32).any()
  for g in vjp(jnp.ones_like(o)):
    g = np.asarray(g, np.float32)
    assert np.isfinite(g).all() and not g.any()


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("h", (64, 128))
def test_segments_interleaved(h, causal, implementation, rng):
  """Segment ids that alternate along both sequences (0, 1, 0, 1 ... in blocks of 128), so
  that a query block's key tiles go seen, skipped, seen ...: the pipelined backward drains
  its pending products at each skip and restarts after it (the packed-sequence tests, with
  sorted ids, skip only before and after one run of tiles)."""
  case = Case(1, 300, 700, 4, 2, h, jnp.bfloat16, Opts(causal=causal, segments=True))
  q, k, v = make_qkv(rng, case)
  q_seg = jnp.asarray((np.arange(case.t)[None] // 128) % 2, jnp.int32)
  kv_seg = jnp.asarray((np.arange(case.s)[None] // 128) % 2, jnp.int32)
  do = oracle.randn(rng, case.q_shape, case.dtype)
  run_inputs(case, implementation, q, k, v, (q_seg, kv_seg), do, what="interleaved: ")


@pytest.mark.parametrize("softcap", (None, 30.0), ids=("plain", "cap"))
@pytest.mark.parametrize("h", (64, 128, 256))
def test_segment_rows_uniform_and_packed(h, softcap, implementation, rng):
  """With segment ids and no positional mask, the Hopper backward runs each batch row without
  the segment mask when all its ids are one segment (the part-1 kernels: SplitsBySegmentRows,
  ffi/attention/attention_launch.cuh; the fused backward, bwd_ws_sm90.cu: the row copies and
  compares no ids), else with it. One call holds both kinds:
  a row of one segment, a packed row, and a row whose q and kv ids are each uniform but
  differ (nothing visible: zeros, zero gradients). S = 256 is a multiple of every key tile,
  so nothing masks by position."""
  case = Case(3, 100, 256, 4, 2, h, jnp.bfloat16, Opts(softcap=softcap, segments=True))
  q, k, v = make_qkv(rng, case)
  packed_q, packed_kv = (np.sort(rng.integers(0, 3, n)) for n in (case.t, case.s))
  q_seg = np.stack([np.full(case.t, 7), packed_q, np.full(case.t, 1)]).astype(np.int32)
  kv_seg = np.stack([np.full(case.s, 7), packed_kv, np.full(case.s, 2)]).astype(np.int32)
  segs = (jnp.asarray(q_seg), jnp.asarray(kv_seg))
  do = oracle.randn(rng, case.q_shape, case.dtype)
  run_inputs(case, implementation, q, k, v, segs, do, what="uniform/packed rows: ")


def test_segment_uniform_flags():
  """The backward's per-row flag (jaxgpu/ops/attention.py's _segment_uniform): 1 only where
  every q and kv id of the row is the same value."""
  from jaxgpu.ops.attention import _segment_uniform
  q_seg = np.array([[3, 3, 3], [3, 3, 4], [1, 1, 1], [0, 0, 0]], np.int32)
  kv_seg = np.array([[3, 3], [3, 3], [1, 2], [5, 5]], np.int32)
  got = np.asarray(_segment_uniform(jnp.asarray(q_seg), jnp.asarray(kv_seg)))
  assert got.dtype == np.int32 and got.tolist() == [1, 0, 0, 0]


# ---- softcaps across the bounded softmax's range ------------------------------------------------

# The Hopper forward subtracts a fixed offset instead of the row max when the cap's range
# fits P's type (LogitScale::bound in ffi/attention/attention_tile.cuh): bfloat16 caps up to
# 51.2, float16 up to 10. Caps on both sides of each limit, and one where the offset is
# below fold (p reaches 2^15 and more, the smallest p 2^-100 for bf16, 2^-14 for fp16).
SOFTCAP_RANGES = [(jnp.bfloat16, 3.0), (jnp.bfloat16, 40.0), (jnp.bfloat16, 50.0),
                  (jnp.bfloat16, 60.0), (jnp.float16, 9.0), (jnp.float16, 12.0)]


@pytest.mark.parametrize("dtype,cap", SOFTCAP_RANGES,
                         ids=[f"{jnp.dtype(d).name}-cap{c:g}" for d, c in SOFTCAP_RANGES])
@pytest.mark.parametrize("h", (64, 128))
def test_softcap_ranges(dtype, cap, h, implementation, rng):
  """Logits spread over the whole capped range (noise of cap / 2), and a quarter of the
  query rows whose every logit lies near -cap (a mean of -3 cap before the cap): the
  smallest probabilities the bound allows, where an online max would have rescaled.
  Forward and gradients against the float64 oracle, over several key tiles."""
  case = Case(2, 200, 300, 4, 2, h, dtype, Opts(softcap=cap))
  u = np.ones(h) / math.sqrt(h)
  k = rng.standard_normal(case.kv_shape) + 4.0 * u            # k . u ~ 4 for every key
  low = np.where(np.arange(case.t) % 4 == 0, -3.0 * cap * math.sqrt(h) / 4.0, 0.0)
  q = rng.standard_normal(case.q_shape) * (cap / 2.0) + low[None, :, None, None] * u
  q, k = (jnp.asarray(a.astype(np.float32)).astype(dtype) for a in (q, k))
  v = oracle.randn(rng, case.kv_shape, dtype)
  do = oracle.randn(rng, case.q_shape, dtype)
  run_inputs(case, implementation, q, k, v, (), do, what=f"cap {cap:g}: ")


# ---- determinism, cotangents -----------------------------------------------------------------


def test_backward_deterministic(implementation, rng):
  """Bitwise identical gradients across runs and separate compilations (relevant on the
  GPU, where a backward kernel could accumulate dq/dk/dv with atomics)."""
  case = Case(2, 200, 256, 8, 2, 64, jnp.bfloat16, Opts(causal=True, segments=True))
  q, k, v = make_qkv(rng, case)
  segs = make_segments(rng, case)
  do = oracle.randn(rng, case.q_shape, case.dtype)
  fn = kernel_fn(implementation, case.opts)
  runs = [jax.jit(jax.grad(lambda q, k, v: loss(fn, q, k, v, segs, do), argnums=(0, 1, 2)))(
      q, k, v) for _ in range(2)]
  for a, b in zip(*runs):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_segment_ids_have_no_cotangent(implementation, rng):
  case = Case(1, 6, 6, 2, 2, 16, jnp.bfloat16, Opts(segments=True))
  q, k, v = make_qkv(rng, case)
  segs = make_segments(rng, case)
  o, vjp = jax.vjp(kernel_fn(implementation, case.opts), q, k, v, *segs)
  grads = vjp(jnp.ones_like(o))
  for g, s in zip(grads[3:], segs):
    assert g.shape == s.shape and g.dtype == jax.dtypes.float0


# ---- input forms; sharding; static options -------------------------------------------------------


def test_numpy_inputs(implementation, rng):
  """numpy q, k, v with int64 segment ids (converted to int32)."""
  case = Case(1, 7, 9, 2, 1, 16, jnp.float16 if implementation == "cuda" else jnp.float32,
              Opts(segments=True))
  q, k, v = (np.asarray(a) for a in make_qkv(rng, case))
  q_seg = np.sort(rng.integers(0, 2, (1, 7)))             # int64: converted to int32
  kv_seg = np.sort(rng.integers(0, 2, (1, 9)))
  o = jaxgpu.dot_product_attention(q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
                                   implementation=implementation)
  segs = (jnp.asarray(q_seg, jnp.int32), jnp.asarray(kv_seg, jnp.int32))
  oracle.check(o, np_attention(case, q, k, v, *segs),
               ref_forward(case.opts, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), segs),
               what="numpy inputs", dtype=case.dtype)


# (Sharded layouts: test_contract.py, from tests/specs/attention.py.)
@pytest.mark.xfail(raises=Exception, strict=True,
                   reason="Auto mesh, heads over a size-4 axis with K = 2: propagation splits "
                          "the axis into sub-axes that custom_partitioning cannot express "
                          "(documented in jaxgpu/ops/attention.py; Explicit mode works)")
def test_sharded_heads_not_dividing_k_auto(cpu_devices, rng):
  if "cpu" not in jaxgpu.available_implementations():
    raise RuntimeError("no CPU module")
  mesh = oracle.mesh_4x2(cpu_devices, "auto")
  case = Case(1, 8, 8, 8, 2, 16, jnp.bfloat16)
  q, k, v = make_qkv(rng, case)
  qs = jax.device_put(q, NamedSharding(mesh, P(None, None, "a")))
  jax.block_until_ready(jax.jit(kernel_fn("cpu", case.opts))(qs, k, v))


@pytest.mark.parametrize("name", ["scale", "logit_softcap", "local_window_size"])
def test_traced_option_rejected(name):
  value = {"scale": 0.5, "logit_softcap": 30.0, "local_window_size": 3}[name]
  with pytest.raises(TypeError, match=name):
    jax.jit(lambda o, x: jaxgpu.dot_product_attention(x, x, x, **{name: o}))(
        value, jnp.ones((1, 4, 2, 8), jnp.bfloat16))


# ---- the CPU handlers: any head dim, and their own checks ------------------------------------


def _attrs(**kw):
  a = dict(scale=np.float32(0.25), softcap=np.float32(0.0), causal=False,
           window_left=np.int64(-1), window_right=np.int64(-1), has_segments=False)
  a.update(kw)
  return a


def _target(pass_):
  return SPECS["dot_product_attention"].op.target(pass_, "cpu")


def _no_extras():
  """The bias, mask and lengths operands, all absent."""
  empty = jnp.zeros((0,), jnp.int32)
  return (jnp.zeros((0,), jnp.float32), jnp.zeros((0,), jnp.bool_), empty, empty)


def _raw_fwd(q5, k, v, segs=None, out=None, extras=None, **kw):
  """(o, lse); out: their shapes (the Hopper forward's tile_counter workspace, which the
  CPU handler ignores, is passed empty)."""
  if out is None:
    b, t, kh, r, _ = q5.shape
    out = (jax.ShapeDtypeStruct(q5.shape, q5.dtype),
           jax.ShapeDtypeStruct((b, kh, r, t), jnp.float32))
  out = tuple(out) + (jax.ShapeDtypeStruct((0,), jnp.int32),)
  empty = jnp.zeros((0,), jnp.int32)
  segs = (empty, empty) if segs is None else segs
  return jax.ffi.ffi_call(_target("fwd"), out)(
      q5, k, v, *segs, *(_no_extras() if extras is None else extras), **_attrs(**kw))[:2]


_NO_WORKSPACES = (jax.ShapeDtypeStruct((0,), jnp.float32), jax.ShapeDtypeStruct((0,), jnp.int32))


def _raw_bwd(q5, k, v, o, lse, do, segs=None, out=None, extras=None, dbias=(0,),
             workspaces=_NO_WORKSPACES, **kw):
  """segs: (q_segment_ids, kv_segment_ids, segment_uniform), or None (all three empty);
  extras: (bias, mask, q_lengths, kv_lengths) or None (all absent); dbias: its shape;
  workspaces: the fused backward's dq_accum and dq_semaphores (empty: none)."""
  if out is None:
    out = (jax.ShapeDtypeStruct(q5.shape, q5.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
           jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(lse.shape, jnp.float32),
           jax.ShapeDtypeStruct(dbias, jnp.float32)) + tuple(workspaces)
  empty = jnp.zeros((0,), jnp.int32)
  segs = (empty, empty, empty) if segs is None else segs
  return jax.ffi.ffi_call(_target("bwd"), out)(
      q5, k, v, o, lse, do, *segs, *(_no_extras() if extras is None else extras),
      **_attrs(**kw))


def _needs_cpu():
  if "cpu" not in jaxgpu.available_implementations():
    pytest.skip("no CPU module")


@pytest.mark.parametrize("h", [1, 59, 111])
def test_cpu_kernel_any_head_dim(h, rng):
  """The CPU kernels take any H unpadded (the op pads to a multiple of 8 for the CUDA
  kernels' sake), with lse = log-sum-exp of the logits and delta = rowsum(do * o)."""
  _needs_cpu()
  case = Case(2, 13, 11, 4, 2, h, jnp.float32, Opts(causal=True, softcap=3.0, scale=0.3))
  cpu = jax.devices("cpu")[0]
  q, k, v = (jax.device_put(a, cpu) for a in make_qkv(rng, case))
  do = jax.device_put(oracle.randn(rng, case.q_shape, case.dtype), cpu)
  q5 = q.reshape(2, 13, 2, 2, h)
  attrs = dict(scale=np.float32(0.3), softcap=np.float32(3.0), causal=True)
  o, lse = jax.jit(lambda *a: _raw_fwd(*a, **attrs))(q5, k, v)
  dq, dk, dv, delta, *_ = jax.jit(lambda *a: _raw_bwd(*a, **attrs))(q5, k, v, o, lse,
                                                                     do.reshape(q5.shape))
  o64, (dq64, dk64, dv64) = np_attention(case, q, k, v, do=do)
  tol = dict(rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(np.asarray(o).reshape(o64.shape), o64, **tol)
  np.testing.assert_allclose(np.asarray(dq).reshape(dq64.shape), dq64, **tol)
  np.testing.assert_allclose(np.asarray(dk), dk64, **tol)
  np.testing.assert_allclose(np.asarray(dv), dv64, **tol)
  # lse (B, K, R, T): natural log of the sum of exp(logits) over the visible keys.
  raw = 0.3 * np.einsum("btnh,bsnh->bnts", oracle.as_f64(q),
                        np.repeat(oracle.as_f64(k), 2, axis=2))
  logits = np.where(np.tril(np.ones((13, 11), bool)), 3.0 * np.tanh(raw / 3.0), -np.inf)
  lse64 = np.log(np.exp(logits).sum(-1)).reshape(2, 2, 2, 13)
  # atol: an lse near 0 (log of a sum near 1) keeps float32's absolute, not relative, error.
  np.testing.assert_allclose(np.asarray(lse), lse64, rtol=1e-6, atol=1e-6)
  delta64 = (np.asarray(do, np.float64) * np.asarray(o, np.float64).reshape(do.shape)).sum(-1)
  np.testing.assert_allclose(np.asarray(delta), delta64.transpose(0, 2, 1).reshape(2, 2, 2, 13),
                             rtol=1e-5, atol=1e-6)


_Q5 = lambda: jnp.ones((1, 4, 2, 2, 8), jnp.float32)
_KV4 = lambda: jnp.ones((1, 6, 2, 8), jnp.float32)


def _extras(bias=None, mask=None, lengths=None, bias_dtype=jnp.float32, mask_dtype=jnp.bool_,
            lengths_dtype=jnp.int32):
  """Bias, mask and lengths operands of the given shapes (None: absent)."""
  b, m, ql, kl = _no_extras()
  if bias is not None:
    b = jnp.zeros(bias, bias_dtype)
  if mask is not None:
    m = jnp.ones(mask, mask_dtype)
  if lengths is not None:
    ql, kl = jnp.ones((lengths[0],), lengths_dtype), jnp.ones((lengths[1],), lengths_dtype)
  return b, m, ql, kl


@pytest.mark.parametrize("build,match", [
    (lambda: _raw_fwd(jnp.ones((1, 4, 4, 8)), _KV4(), _KV4(),
                      out=(jax.ShapeDtypeStruct((1, 4, 4, 8), jnp.float32),
                           jax.ShapeDtypeStruct((1, 2, 2, 4), jnp.float32))),
     "q: expected rank 5"),
    (lambda: _raw_fwd(_Q5(), jnp.ones((1, 6, 3, 8)), jnp.ones((1, 6, 3, 8))), "k: expected shape"),
    (lambda: _raw_fwd(_Q5(), _KV4(), jnp.ones((1, 5, 2, 8))), "v: expected"),
    (lambda: _raw_fwd(_Q5(), _KV4(), _KV4().astype(jnp.bfloat16)), "v: unexpected element type"),
    (lambda: _raw_fwd(_Q5(), _KV4(), _KV4(),
                      out=(jax.ShapeDtypeStruct((1, 4, 2, 2, 8), jnp.float32),
                           jax.ShapeDtypeStruct((1, 2, 2, 5), jnp.float32))), "lse: expected"),
    (lambda: _raw_fwd(_Q5(), _KV4(), _KV4(),
                      out=(jax.ShapeDtypeStruct((1, 4, 2, 2, 8), jnp.float16),
                           jax.ShapeDtypeStruct((1, 2, 2, 4), jnp.float32))), "o: unexpected"),
    (lambda: _raw_fwd(_Q5(), _KV4(), _KV4(), softcap=np.float32(-1.0)), "softcap"),
    (lambda: _raw_fwd(_Q5(), _KV4(), _KV4(), scale=np.float32(np.nan)), "scale"),
    (lambda: _raw_fwd(_Q5(), _KV4(), _KV4(), scale=np.float32(-0.5)),
     "scale: must be finite and > 0"),
    (lambda: _raw_fwd(_Q5(), _KV4(), _KV4(), window_left=np.int64(-2)), "window_left"),
    (lambda: _raw_fwd(_Q5(), _KV4(), _KV4(), segs=(jnp.zeros((1, 4), jnp.float32),
                                                   jnp.zeros((1, 6), jnp.float32)),
                      has_segments=True), "int32"),
    (lambda: _raw_fwd(_Q5(), _KV4(), _KV4(), segs=(jnp.zeros((1, 4), jnp.int32),
                                                   jnp.zeros((1, 5), jnp.int32)),
                      has_segments=True), "kv_segment_ids: unexpected shape"),
    (lambda: _raw_fwd(_Q5(), _KV4(), _KV4(), segs=(jnp.zeros((1, 4), jnp.int32),
                                                   jnp.zeros((1, 6), jnp.int32))),
     "must be empty when absent"),
    (lambda: _raw_bwd(_Q5(), _KV4(), _KV4(), _Q5(), jnp.zeros((1, 2, 2, 4)), _Q5(),
                      out=(jax.ShapeDtypeStruct((1, 4, 2, 2, 8), jnp.float32),
                           jax.ShapeDtypeStruct((1, 6, 2, 4), jnp.float32),
                           jax.ShapeDtypeStruct((1, 6, 2, 8), jnp.float32),
                           jax.ShapeDtypeStruct((1, 2, 2, 4), jnp.float32),
                           jax.ShapeDtypeStruct((0,), jnp.float32)) + _NO_WORKSPACES),
     "dk: expected"),
    (lambda: _raw_bwd(_Q5(), _KV4(), _KV4(), _Q5(), jnp.zeros((1, 2, 2, 3)), _Q5()),
     "lse: expected"),
    (lambda: _raw_bwd(_Q5(), _KV4(), _KV4(), _Q5(), jnp.zeros((1, 2, 2, 4)),
                      jnp.ones((1, 4, 2, 2, 8), jnp.bfloat16)), "do: unexpected element type"),
    (lambda: _raw_fwd(jnp.ones((1, 4, 2, 2, 300)), jnp.ones((1, 6, 2, 300)),
                      jnp.ones((1, 6, 2, 300))), "head dim"),
    (lambda: _raw_bwd(_Q5(), _KV4(), _KV4(), _Q5(), jnp.zeros((1, 2, 2, 4)), _Q5(),
                      segs=(jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 6), jnp.int32),
                            jnp.zeros((2,), jnp.int32)), has_segments=True),
     "segment_uniform"),
    (lambda: _raw_bwd(_Q5(), _KV4(), _KV4(), _Q5(), jnp.zeros((1, 2, 2, 4)), _Q5(),
                      segs=(jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 6), jnp.int32),
                            jnp.zeros((1,), jnp.float32)), has_segments=True),
     "segment_uniform"),
    (lambda: _raw_bwd(_Q5(), _KV4(), _KV4(), _Q5(), jnp.zeros((1, 2, 2, 4)), _Q5(),
                      segs=(jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.int32),
                            jnp.zeros((1,), jnp.int32))),
     "segment_uniform: must be empty"),
    (lambda: _raw_fwd(_Q5(), _KV4(), _KV4(), extras=_extras(bias=(1, 2, 2, 3, 6)),
                      has_bias=True), "bias: dim 3 is 3, expected 1 or 4"),
    (lambda: _raw_fwd(_Q5(), _KV4(), _KV4(), extras=_extras(bias=(2, 4, 6)), has_bias=True),
     "bias: expected rank 5"),
    (lambda: _raw_fwd(_Q5(), _KV4(), _KV4(), extras=_extras(bias=(1, 1, 1, 4, 6),
                                                            bias_dtype=jnp.bfloat16),
                      has_bias=True), "bias: dtype must be float32 or the dtype of q"),
    (lambda: _raw_fwd(_Q5(), _KV4(), _KV4(), extras=_extras(bias=(1, 1, 1, 4, 6))),
     "bias: must be empty"),
    (lambda: _raw_fwd(_Q5(), _KV4(), _KV4(), extras=_extras(mask=(1, 2, 2, 4, 5)),
                      has_mask=True), "mask: dim 4 is 5"),
    (lambda: _raw_fwd(_Q5(), _KV4(), _KV4(), extras=_extras(mask=(1, 1, 1, 4, 6),
                                                            mask_dtype=jnp.int32),
                      has_mask=True), "mask: dtype must be bool"),
    (lambda: _raw_fwd(_Q5(), _KV4(), _KV4(), extras=_extras(lengths=(2, 1)), has_lengths=True),
     "q_lengths: expected 1 elements"),
    (lambda: _raw_fwd(_Q5(), _KV4(), _KV4(), extras=_extras(lengths=(1, 1),
                                                            lengths_dtype=jnp.float32),
                      has_lengths=True), "q_lengths: unexpected element type"),
    (lambda: _raw_fwd(_Q5(), _KV4(), _KV4(), extras=_extras(lengths=(1, 1))),
     "must be empty when has_lengths is false"),
    (lambda: _raw_fwd(_Q5(), _KV4(), _KV4(), has_dbias=True, has_bias=True,
                      extras=_extras(bias=(1, 1, 1, 4, 6))), "has_dbias: backward only"),
    (lambda: _raw_bwd(_Q5(), _KV4(), _KV4(), _Q5(), jnp.zeros((1, 2, 2, 4)), _Q5(),
                      extras=_extras(bias=(1, 1, 1, 4, 6)), dbias=(1, 1, 1, 4, 5),
                      has_bias=True, has_dbias=True), "dbias: expected 24 elements"),
    (lambda: _raw_bwd(_Q5(), _KV4(), _KV4(), _Q5(), jnp.zeros((1, 2, 2, 4)), _Q5(),
                      dbias=(1, 1, 1, 4, 6), has_dbias=True), "has_dbias: needs has_bias"),
    (lambda: _raw_bwd(_Q5(), _KV4(), _KV4(), _Q5(), jnp.zeros((1, 2, 2, 4)), _Q5(),
                      workspaces=(jax.ShapeDtypeStruct((1, 4, 2, 2, 4), jnp.float32),
                                  jax.ShapeDtypeStruct((1, 2, 2, 4), jnp.int32))),
     "dq_accum: expected"),
    (lambda: _raw_bwd(_Q5(), _KV4(), _KV4(), _Q5(), jnp.zeros((1, 2, 2, 4)), _Q5(),
                      workspaces=(jax.ShapeDtypeStruct((1, 4, 2, 2, 8), jnp.float32),
                                  jax.ShapeDtypeStruct((3,), jnp.int32))),
     "dq_semaphores: expected 16 elements"),
], ids=["q-rank", "k-shape", "v-shape", "v-dtype", "lse-shape", "o-dtype", "softcap", "scale",
        "scale-negative", "window", "seg-dtype", "seg-shape", "seg-not-empty", "dk-count",
        "bwd-lse", "do-dtype", "head-dim", "uniform-shape", "uniform-dtype",
        "uniform-not-empty", "bias-dim", "bias-rank", "bias-dtype", "bias-not-empty",
        "mask-dim", "mask-dtype", "lengths-shape", "lengths-dtype", "lengths-not-empty",
        "dbias-fwd", "dbias-count", "dbias-without-bias", "dq-accum-shape",
        "dq-semaphores-count"])
def test_handler_rejects_bad_buffers(build, match):
  _needs_cpu()
  with jax.default_device(jax.devices("cpu")[0]):
    with pytest.raises(Exception, match=match):
      jax.block_until_ready(jax.jit(build)())


# ---- bias, mask and sequence lengths (jax.nn's arguments) -----------------------------------


@dataclasses.dataclass(frozen=True)
class Extra:
  """A bias / mask / lengths case: the shapes of bias and mask as given (None: absent,
  'full': (B, N, T, S)), the lengths' kind (None, 'q', 'kv', 'both'), the bias dtype (None:
  query's), and whether the inputs are rank 3 (no batch axis)."""
  bias: tuple | str | None = None
  mask: tuple | str | None = None
  lengths: str | None = None
  bias_dtype: object = None
  rank3: bool = False

  def id(self) -> str:
    def shape(x):
      return x if isinstance(x, str) else "x".join(map(str, x))
    parts = []
    if self.bias is not None:
      parts.append("bias" + shape(self.bias))
    if self.bias_dtype is not None:
      parts.append(jnp.dtype(self.bias_dtype).name)
    if self.mask is not None:
      parts.append("mask" + shape(self.mask))
    if self.lengths:
      parts.append("len-" + self.lengths)
    if self.rank3:
      parts.append("rank3")
    return "-".join(parts)


def _shape(spec, case: Case):
  full = (case.b, case.n, case.t, case.s)
  if spec == "full":
    return full
  return tuple(spec)


def make_extras(rng, case: Case, ex: Extra):
  """(bias, mask, q_lengths, kv_lengths), each None where absent. Lengths include a row of
  length 0 (both sides), the mask keeps ~80% of the logits, the bias spreads over a unit."""
  bias = mask = ql = kvl = None
  if ex.bias is not None:
    bias = oracle.randn(rng, _shape(ex.bias, case), ex.bias_dtype or case.dtype)
  if ex.mask is not None:
    mask = jnp.asarray(rng.random(_shape(ex.mask, case)) < 0.8)
  if ex.lengths:
    q_len = rng.integers(1, case.t + 1, case.b)
    kv_len = rng.integers(1, case.s + 1, case.b)
    if case.b > 1:
      q_len[-1] = 0 if ex.lengths in ("q", "both") else q_len[-1]
      kv_len[0] = 0 if ex.lengths in ("kv", "both") else kv_len[0]
    ql = jnp.asarray(q_len, jnp.int32) if ex.lengths in ("q", "both") else None
    kvl = jnp.asarray(kv_len, jnp.int32) if ex.lengths in ("kv", "both") else None
  return bias, mask, ql, kvl


def run_extras(case: Case, ex: Extra, implementation, rng):
  """Forward and gradients (dq, dk, dv, and dbias when there is a bias) with a bias, mask
  and lengths, against np_attention in float64 under the 2x rule."""
  q, k, v = make_qkv(rng, case)
  segs = make_segments(rng, case)
  bias, mask, ql, kvl = make_extras(rng, case, ex)
  do = oracle.randn(rng, case.q_shape, case.dtype)
  opts = case.opts
  keep = np_extra_keep(case.t, case.s, None if mask is None else np.asarray(mask),
                       None if ql is None else np.asarray(ql),
                       None if kvl is None else np.asarray(kvl))

  def op(q, k, v, bias, segs):
    args = (q, k, v)
    seg_kw = dict(zip(("q_segment_ids", "kv_segment_ids"), segs))
    if ex.rank3:  # B = 1 without the axis; bias and mask already broadcast to (N, T, S)
      args = tuple(a[0] for a in args)
      seg_kw = {name: ids[0] for name, ids in seg_kw.items()}
    o = jaxgpu.dot_product_attention(
        *args, bias, mask, query_seq_lengths=ql, key_value_seq_lengths=kvl,
        implementation=implementation, **seg_kw, **opts.kw())
    return o[None] if ex.rank3 else o

  def lowp(q, k, v, bias, segs):
    return jnp_attention(opts, q, k, v, *segs, bias=bias,
                         extra_keep=None if keep is None else jnp.asarray(keep))

  def grads_of(fn):
    argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)
    return jax.jit(jax.grad(
        lambda q, k, v, bias: jnp.sum(fn(q, k, v, bias, segs).astype(jnp.float32)
                                      * do.astype(jnp.float32)), argnums=argnums))(q, k, v, bias)

  o = jax.jit(op)(q, k, v, bias, segs)
  assert o.shape == case.q_shape and o.dtype == case.dtype
  o64, g64, extra = np_attention(case, q, k, v, *segs, do=do, o_residual=o, bias=bias,
                                 keep=keep)
  oracle.check(o, o64, jax.jit(lowp)(q, k, v, bias, segs), what="o", dtype=case.dtype)
  got, ref = grads_of(op), grads_of(lowp)
  for name, g, exact, r, a, primal in zip(("dq", "dk", "dv", "dbias"), got, g64, ref, extra,
                                          (q, k, v, bias)):
    assert g.shape == primal.shape and g.dtype == primal.dtype, (name, g.shape, g.dtype)
    oracle.check(g, exact, r, what=name, dtype=case.dtype, atol_ulps=GRAD_ULPS, extra_atol=a)
  if ql is not None:  # rows past a query length: zeros, and zero dq
    for b, n in enumerate(np.asarray(ql)):
      assert not np.asarray(o[b, n:], np.float32).any()
      assert not np.asarray(got[0][b, n:], np.float32).any()
  if kvl is not None:  # keys past a key length: zero dk, dv
    for b, n in enumerate(np.asarray(kvl)):
      assert not np.asarray(got[1][b, n:], np.float32).any()
      assert not np.asarray(got[2][b, n:], np.float32).any()
  return o, got


# (case, extras): the bias and mask broadcast patterns, lengths with rows of length 0, each
# with another option (causal, window, softcap, segments) and head layout.
EXTRA_CASES = [
    (Case(2, 17, 23, 4, 4, 32, jnp.bfloat16, Opts(causal=True)), Extra(bias=(1, 1, 17, 23))),
    (Case(3, 19, 40, 6, 2, 59, jnp.float16, Opts(window=(5, 3))),
     Extra(bias=(3, 1, 1, 40), mask=(3, 1, 19, 40))),
    (Case(2, 24, 17, 3, 1, 111, jnp.bfloat16, Opts(softcap=3.0, segments=True)),
     Extra(bias="full", mask="full")),
    (Case(1, 33, 21, 4, 2, 64, jnp.float16, Opts(causal=True, softcap=5.0)),
     Extra(bias=(4, 33, 21), mask=(33, 21), rank3=True)),
    (Case(3, 40, 33, 6, 2, 32, jnp.bfloat16, Opts(causal=True)),
     Extra(bias=(1, 6, 40, 33), lengths="both")),
    (Case(3, 17, 29, 4, 4, 40, jnp.float16, Opts(window=(8, 0), segments=True)),
     Extra(mask=(1, 4, 17, 29), lengths="q")),
    (Case(2, 23, 41, 3, 1, 16, jnp.bfloat16), Extra(lengths="kv")),
    (Case(2, 30, 30, 4, 2, 24, jnp.bfloat16, Opts(softcap=3.0, scale=0.4)),
     Extra(bias=(2, 4, 1, 30), bias_dtype=jnp.float32, lengths="both")),
    (Case(2, 17, 17, 4, 2, 8, jnp.float32, Opts(causal=True)),
     Extra(bias=(1, 17), mask=(2, 1, 1, 17), lengths="both")),
]


def _extra_params(cases, marks=()):
  return [pytest.param(c, e, id=f"{c.id()}-{e.id()}", marks=marks) for c, e in cases]


@pytest.mark.parametrize("case,ex", _extra_params(EXTRA_CASES))
def test_bias_mask_lengths(case, ex, implementation, rng):
  """Forward and gradients (dbias included) with a bias, a mask and sequence lengths, in
  the broadcast patterns models use, against the float64 oracle."""
  if implementation == "cuda" and case.dtype == jnp.float32:
    pytest.skip("float32 runs the reference on a CUDA machine (test_float32)")
  run_extras(case, ex, implementation, rng)


# GPU sizes: tiles of every sm80 kernel in full and in part, lengths ending mid-tile.
GPU_EXTRA_CASES = [
    (Case(2, 1023, 1023, 4, 2, 128, jnp.bfloat16, Opts(causal=True)),
     Extra(bias=(1, 4, 1023, 1023), lengths="both")),
    (Case(2, 255, 1023, 6, 2, 64, jnp.float16, Opts(softcap=5.0, segments=True)),
     Extra(bias=(2, 1, 1, 1023), mask=(2, 1, 255, 1023))),
    (Case(3, 384, 128, 3, 1, 256, jnp.bfloat16, Opts(window=(100, 20))),
     Extra(bias="full", mask=(1, 3, 384, 128), lengths="q")),
    (Case(2, 113, 113, 4, 4, 96, jnp.bfloat16, Opts(causal=True, softcap=3.0)),
     Extra(bias=(4, 113, 113), bias_dtype=jnp.float32, rank3=False, lengths="kv")),
    (Case(1, 1023, 255, 8, 2, 32, jnp.float16), Extra(mask=(1023, 255), rank3=True)),
    # S a multiple of 16 with contiguous key rows: the bias and mask blocks are staged in
    # shared memory by cp.async (the cases above read per element from global memory).
    (Case(2, 500, 1024, 4, 2, 128, jnp.bfloat16),
     Extra(bias=(1, 4, 500, 1024), mask=(2, 1, 500, 1024), lengths="kv")),
    (Case(2, 200, 256, 4, 4, 64, jnp.float16, Opts(causal=True, softcap=5.0)),
     Extra(bias="full", bias_dtype=jnp.float32, mask=(1, 1, 200, 256), lengths="both")),
    (Case(2, 320, 512, 4, 2, 128, jnp.bfloat16, Opts(segments=True)),
     Extra(bias=(2, 4, 1, 512))),
]


@pytest.mark.parametrize("case,ex", _extra_params(GPU_EXTRA_CASES, marks=pytest.mark.gpu))
def test_bias_mask_lengths_gpu(case, ex, rng):
  """The same at GPU sizes, on the CUDA kernels (the mma_sync main loop)."""
  if not HAS_CUDA:
    pytest.skip("needs a CUDA backend")
  run_extras(case, ex, "cuda", rng)


def test_extras_match_jax_nn(implementation, rng):
  """Where every query row sees a key, the semantics are jax.nn.dot_product_attention's:
  bias, mask, lengths, GQA, causal, rank 3 and 4."""
  case = Case(3, 24, 24, 8, 2, 32, jnp.float32)
  q, k, v = make_qkv(rng, case)
  bias = oracle.randn(rng, (1, 8, 24, 24), jnp.float32)
  mask = jnp.asarray(rng.random((3, 1, 24, 24)) < 0.7) | jnp.eye(24, dtype=bool)
  kw = dict(scale=0.2, is_causal=True, query_seq_lengths=jnp.array([24, 7, 13], jnp.int32),
            key_value_seq_lengths=jnp.array([24, 24, 20], jnp.int32))
  lowp = implementation == "cuda"
  if lowp:
    q, k, v, bias = (a.astype(jnp.bfloat16) for a in (q, k, v, bias))
  f32 = [a.astype(jnp.float32) for a in (q, k, v, bias)]
  tol = 2e-2 if lowp else 2e-5
  want = jax.nn.dot_product_attention(*f32[:3], f32[3], mask, implementation="xla", **kw)
  got = jaxgpu.dot_product_attention(q, k, v, bias, mask, implementation=implementation, **kw)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=tol, atol=tol)
  # Rank 3 (no batch axis): batch row 1.
  kw3 = dict(kw, query_seq_lengths=kw["query_seq_lengths"][1:2],
             key_value_seq_lengths=kw["key_value_seq_lengths"][1:2])
  want = jax.nn.dot_product_attention(*(a[1] for a in f32[:3]), f32[3][0], mask[1], **kw3)
  got = jaxgpu.dot_product_attention(q[1], k[1], v[1], bias[0], mask[1],
                                     implementation=implementation, **kw3)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=tol, atol=tol)
  # The gradients too, bias included.
  def loss(fn, *args):
    return jnp.sum(fn(*args).astype(jnp.float32) ** 2)
  gw = jax.grad(functools.partial(loss, lambda *a: jax.nn.dot_product_attention(
      *a, mask, implementation="xla", **kw)), argnums=(0, 1, 2, 3))(*f32)
  gg = jax.grad(functools.partial(loss, lambda *a: jaxgpu.dot_product_attention(
      *a, mask, implementation=implementation, **kw)), argnums=(0, 1, 2, 3))(q, k, v, bias)
  for a, b in zip(gg, gw):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b), rtol=tol * 5,
                               atol=tol * 5)


def test_fully_masked_rows_differ_from_jax_nn(implementation, rng):
  """A row that sees nothing (mask all False, a key length of 0): zeros and zero gradients
  here; jax.nn outputs the mean of the values (its masks are a large negative logit)."""
  case = Case(2, 9, 11, 2, 2, 16, jnp.float32 if implementation != "cuda" else jnp.bfloat16)
  q, k, v = make_qkv(rng, case)
  mask = np.ones((2, 1, 9, 11), bool)
  mask[0, :, 3] = False
  kvl = jnp.array([11, 0], jnp.int32)
  f = lambda q: jaxgpu.dot_product_attention(q, k, v, mask=jnp.asarray(mask),
                                             key_value_seq_lengths=kvl,
                                             implementation=implementation)
  o = np.asarray(f(q), np.float32)
  assert not o[0, 3].any() and not o[1].any()
  dq = np.asarray(jax.grad(lambda q: jnp.sum(f(q).astype(jnp.float32) ** 2 + f(q).astype(
      jnp.float32)))(q), np.float32)
  assert not dq[0, 3].any() and not dq[1].any()
  nn = np.asarray(jax.nn.dot_product_attention(*(a.astype(jnp.float32) for a in (q, k, v)),
                                               mask=jnp.asarray(mask)))
  np.testing.assert_allclose(nn[0, 3], np.asarray(v[0], np.float32).mean(0), rtol=1e-2,
                             atol=1e-2)


def test_traced_lengths_are_clamped(implementation, rng):
  """Lengths traced under jit are not checked at trace time: values past T / S read
  nothing out of bounds (as T / S), negative ones as 0."""
  case = Case(2, 17, 19, 2, 2, 16, jnp.bfloat16)
  q, k, v = make_qkv(rng, case)
  f = jax.jit(lambda ql, kvl: jaxgpu.dot_product_attention(
      q, k, v, query_seq_lengths=ql, key_value_seq_lengths=kvl, implementation=implementation))
  got = f(jnp.array([1000, -5], jnp.int32), jnp.array([10 ** 6, 19], jnp.int32))
  want = f(jnp.array([17, 0], jnp.int32), jnp.array([19, 19], jnp.int32))
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  assert not np.asarray(got[1], np.float32).any()


def test_bias_not_differentiated_skips_dbias(implementation, rng):
  """The backward computes dbias only when the bias is differentiated: a constant bias
  lowers no dbias output, a differentiated one does (its accumulator is float32)."""
  if implementation == "xla":
    pytest.skip("no kernel")
  case = Case(2, 9, 9, 2, 2, 16, jnp.bfloat16)
  q, k, v = make_qkv(rng, case)
  bias = oracle.randn(rng, (1, 2, 9, 9), jnp.bfloat16)

  def grad_text(argnums):
    f = lambda q, bias: jnp.sum(jaxgpu.dot_product_attention(
        q, k, v, bias, implementation=implementation).astype(jnp.float32))
    return jax.jit(jax.grad(f, argnums=argnums)).lower(q, bias).as_text()

  assert "has_dbias = false" in grad_text(0)
  assert "has_dbias = true" in grad_text((0, 1))


@pytest.mark.parametrize("bias_shape", [(2, 8, 40, 56), (1, 8, 40, 56)], ids=["full", "bcast"])
def test_bias_grad_deterministic(bias_shape, implementation, rng):
  """dq, dk, dv and dbias bitwise identical across two compilations: a full bias's gradient
  is stored once per element; a broadcast one is summed in a fixed order on the CPU (the
  CUDA kernels add it with float32 atomics, as XLA's GPU reductions may: documented, not
  asserted)."""
  case = Case(2, 40, 56, 8, 2, 32, jnp.bfloat16, Opts(causal=True))
  q, k, v = make_qkv(rng, case)
  bias = oracle.randn(rng, bias_shape, jnp.bfloat16)
  mask = jnp.asarray(rng.random((2, 1, 40, 56)) < 0.9)
  do = oracle.randn(rng, case.q_shape, case.dtype)

  def loss(q, k, v, bias):
    o = jaxgpu.dot_product_attention(q, k, v, bias, mask, is_causal=True,
                                     implementation=implementation)
    return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

  runs = [jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias) for _ in range(2)]
  atomics = bias_shape[0] == 1 and (implementation == "cuda" or HAS_CUDA)
  for i, (a, b) in enumerate(zip(*runs)):
    if atomics and i == 3:
      np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                 rtol=1e-2, atol=1e-2)
    else:
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_extras_vmap(implementation, rng):
  """vmap with a bias and a mask shared by every example or batched, lengths batched;
  vmap of grad with the bias's gradient per example."""
  case = Case(2, 17, 13, 4, 2, 16, jnp.bfloat16, Opts(causal=True))
  q, k, v = (jnp.stack([a, a * 0.5]) for a in make_qkv(rng, case))
  bias = oracle.randn(rng, (2, 1, 4, 17, 13), jnp.bfloat16)
  mask = jnp.asarray(rng.random((1, 17, 13)) < 0.8)
  ql = jnp.array([[17, 5], [3, 17]], jnp.int32)

  def f(q, k, v, bias, ql):
    return jaxgpu.dot_product_attention(q, k, v, bias, mask, is_causal=True,
                                        query_seq_lengths=ql, implementation=implementation)

  for in_axes in ((0, 0, 0, 0, 0), (0, None, None, None, 0), (None, 0, 0, 0, None)):
    args = [a if ax is None else a for a, ax in zip((q, k, v, bias, ql), in_axes)]
    args = [a[0] if ax is None else a for a, ax in zip(args, in_axes)]
    got = jax.vmap(f, in_axes=in_axes)(*args)
    want = jnp.stack([f(*(a if ax is None else a[i] for a, ax in zip(args, in_axes)))
                      for i in range(2)])
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    # vmap of grad: per-example gradients of q and of the bias (shared or batched).
    loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2)
    got = jax.vmap(jax.grad(loss, argnums=(0, 3)), in_axes=in_axes)(*args)
    want = [jax.grad(loss, argnums=(0, 3))(*(a if ax is None else a[i]
                                             for a, ax in zip(args, in_axes)))
            for i in range(2)]
    for j in range(2):
      np.testing.assert_allclose(np.asarray(got[j], np.float32),
                                 np.stack([np.asarray(w[j], np.float32) for w in want]),
                                 rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
@pytest.mark.parametrize("layout", ["batch", "heads"])
def test_extras_sharded(layout, axis_type, cpu_devices, rng):
  """jit with q, k, v and the bias and mask sharded with the batch (a (B, 1, T, S) bias) or
  the heads (a (1, N, T, S) bias, q also over the batch), lengths with the batch: the
  results of an unsharded run, no collective in the forward, and in the backward only the
  all-reduce of the gradient of a bias broadcast over the sharded batch (each batch shard
  holds a partial sum)."""
  if "cpu" not in jaxgpu.available_implementations():
    pytest.skip("no CPU module")
  mesh = oracle.mesh_4x2(cpu_devices, axis_type)
  case = Case(8, 16, 16, 4, 2, 16, jnp.bfloat16, Opts(causal=True))
  q, k, v = make_qkv(rng, case)
  if layout == "batch":
    bias = oracle.randn(rng, (8, 1, 16, 16), jnp.bfloat16)
    mask = jnp.asarray(rng.random((8, 1, 16, 16)) < 0.8)
    qs = kvs = bs = P(("a", "b"))
    ls = P(("a", "b"))
  else:
    bias = oracle.randn(rng, (1, 4, 16, 16), jnp.bfloat16)
    mask = jnp.asarray(rng.random((1, 4, 16, 16)) < 0.8)
    qs, kvs, bs, ls = P("a", None, "b"), P("a", None, "b"), P(None, "b"), P("a")
  ql = jnp.asarray(rng.integers(0, 17, 8), jnp.int32)

  def f(q, k, v, bias, mask, ql):
    return jaxgpu.dot_product_attention(q, k, v, bias, mask, is_causal=True,
                                        query_seq_lengths=ql, implementation="cpu")

  def loss(*a):
    return jnp.sum(f(*a).astype(jnp.float32) ** 2)

  put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
  args = (put(q, qs), put(k, kvs), put(v, kvs), put(bias, bs), put(mask, bs), put(ql, ls))
  cpu = jax.devices("cpu")[0]
  local = [jax.device_put(a, cpu) for a in (q, k, v, bias, mask, ql)]
  bwd = set() if layout == "batch" else {"all-reduce"}
  for fn, expected in ((f, set()), (jax.grad(loss, argnums=(0, 1, 2, 3)), bwd)):
    compiled = oracle.run_on_mesh(mesh, axis_type, lambda: jax.jit(fn).lower(*args).compile())
    assert oracle.collectives(compiled.as_text()) == expected
    got = jax.tree.leaves(oracle.run_on_mesh(mesh, axis_type, lambda: compiled(*args)))
    want = jax.tree.leaves(jax.jit(fn)(*local))
    for g, w in zip(got, want):
      np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    # Results and gradients keep their inputs' sharding (o that of q).
    for g, a in zip(got, args):
      assert oracle.spec_of(g) == oracle.spec_of(a)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(bias=jnp.zeros((2, 3, 5, 7))), ValueError, r"bias of shape \(2, 3, 5, 7\) is not "
     r"broadcastable to \(B, N, T, S\) = \(2, 4, 5, 7\)"),
    (dict(bias=jnp.zeros((1, 2, 4, 5, 7))), ValueError, r"bias.*rank <= 4"),
    (dict(bias=jnp.zeros((5, 7), jnp.int32)), TypeError, r"bias must have a floating dtype"),
    (dict(mask=jnp.ones((5, 7), jnp.float32)), TypeError, r"mask must have bool dtype"),
    (dict(mask=jnp.ones((5, 6), bool)), ValueError, r"mask of shape \(5, 6\)"),
    (dict(query_seq_lengths=jnp.ones((3,), jnp.int32)), ValueError,
     r"query_seq_lengths must have shape \(2,\)"),
    (dict(key_value_seq_lengths=jnp.ones((2,), jnp.float32)), TypeError,
     r"key_value_seq_lengths must have an integer dtype"),
    (dict(query_seq_lengths=jnp.array([6, 1], jnp.int32)), ValueError,
     r"query_seq_lengths must lie in \[0, 5\]"),
    (dict(key_value_seq_lengths=np.array([-1, 1], np.int32)), ValueError,
     r"key_value_seq_lengths must lie in \[0, 7\]"),
    (dict(implementation="cudnn"), ValueError, r"implementation='cudnn'"),
    (dict(return_residual=True), ValueError, r"return_residual"),
], ids=["bias-shape", "bias-rank", "bias-dtype", "mask-dtype", "mask-shape", "q-len-shape",
        "kv-len-dtype", "q-len-range", "kv-len-negative", "cudnn", "return-residual"])
def test_extras_bad_inputs(kw, exc, match):
  q = jnp.ones((2, 5, 4, 16), jnp.bfloat16)
  kv = jnp.ones((2, 7, 2, 16), jnp.bfloat16)
  with pytest.raises(exc, match=match):
    jaxgpu.dot_product_attention(q, kv, kv, **kw)


def test_rank3_mismatch_rejected():
  with pytest.raises(ValueError, match="query, key and value must have rank 4"):
    jaxgpu.dot_product_attention(jnp.ones((5, 4, 16)), jnp.ones((1, 7, 2, 16)),
                                 jnp.ones((1, 7, 2, 16)))
