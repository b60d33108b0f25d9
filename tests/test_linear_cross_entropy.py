"""linear_cross_entropy (jaxgpu/ops/linear_cross_entropy.py, kernels in
ffi/linear_cross_entropy/): loss and gradients against the float64 oracle of
tests/specs/linear_cross_entropy.py over odd vocabularies (GPT-2's 50257), both weight
layouts, ignore_index, label smoothing and the softcap, for every implementation; the
memory it keeps; and, on the GPU, several vocabulary chunks and torch as an independent
oracle. The transform contract (vmap, sharding with its collectives, shard_map, pmap, bad
inputs, size 0) is tests/test_contract.py's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgpu
from jaxgpu.ops import linear_cross_entropy as lce_ops

import oracle
from specs import cross_entropy as ce
from specs.linear_cross_entropy import Case, _atol, _oracle, make

CASES = [
    Case(jnp.float32, (7,), 50257, dim=16),
    Case(jnp.bfloat16, (3, 5), 50257, dim=24, w_layout="dv", ignore_index=-100),
    Case(jnp.float16, (9,), 3001, dim=40, label_smoothing=0.1, softcap=30.0),
    Case(jnp.bfloat16, (2, 4), 1, dim=8, reduction="sum"),
    Case(jnp.float32, (6,), 777, dim=32, w_layout="dv", ignore_index=5, label_smoothing=0.2,
         softcap=15.0, reduction="none"),
]


def _run(case: Case, implementation, rng):
  inputs = make(rng, case)
  a, static = inputs.arrays, inputs.static
  fn = lambda x, w: jaxgpu.linear_cross_entropy(x, w, a["labels"], implementation=implementation,
                                                **static)
  loss = fn(a["x"], a["w"])
  ct = jnp.ones_like(loss)
  grads = jax.vjp(fn, a["x"], a["w"])[1](ct)
  return a, static, loss, ct, grads


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id())
def test_matches_the_float64_oracle(case, implementation, rng):
  a, static, loss, ct, (dx, dw) = _run(case, implementation, rng)
  with oracle.x64():
    a64 = {k: (oracle.as_f64(v) if k != "labels" else v) for k, v in a.items()}
    exact_fn = lambda x, w: _oracle({**a64, "x": x, "w": w}, static, case.dtype)[0]
    exact = exact_fn(a64["x"], a64["w"])
    gx, gw = jax.vjp(exact_fn, a64["x"], a64["w"])[1](jnp.asarray(oracle.as_f64(ct)))
    exact, gx, gw = (np.asarray(v) for v in (exact, gx, gw))
  lowp_fn = lambda x, w: _oracle({**a, "x": x, "w": w}, static, None)[0]
  lowp = lowp_fn(a["x"], a["w"])
  lx, lw = jax.vjp(lowp_fn, a["x"], a["w"])[1](ct.astype(lowp.dtype))
  atols, grad_atols = _atol({k: np.asarray(v) for k, v in a.items()}, static,
                            (np.asarray(ct),), None)
  oracle.check(loss, exact, lowp, what="loss", extra_atol=atols["loss"])
  oracle.check(dx, gx, lx, what="dx", extra_atol=grad_atols["x"], atol_ulps=8.0)
  oracle.check(dw, gw, lw, what="dw", extra_atol=grad_atols["w"], atol_ulps=8.0)


def test_concrete_labels_out_of_range_are_refused():
  with pytest.raises(ValueError, match=r"labels must be in \[0, 11\)"):
    jaxgpu.linear_cross_entropy(jnp.ones((2, 8)), jnp.ones((11, 8)), jnp.array([3, 11]))


def test_a_traced_label_out_of_range_gives_nan_and_no_gradient(implementation):
  x = jnp.ones((3, 8))
  w = jnp.asarray(np.random.default_rng(2).standard_normal((11, 8)), jnp.float32)
  f = jax.jit(lambda x, w, l: jaxgpu.linear_cross_entropy(
      x, w, l, reduction="none", implementation=implementation))
  loss = f(x, w, jnp.array([1, 11, 2]))
  assert np.isnan(loss[1]) and np.isfinite(loss[0]) and np.isfinite(loss[2])
  g = jax.grad(lambda x: jnp.nansum(f(x, w, jnp.array([1, 11, 2]))))(x)
  assert np.all(np.asarray(g[1]) == 0) and np.any(np.asarray(g[0]) != 0)


def test_chunks_cover_the_vocabulary():
  """The chunk width: the whole vocabulary while (rows, V) fits 256 MiB, else the widest
  multiple of 256 that does; never below 256."""
  assert lce_ops._chunk(8192, 50257, jnp.bfloat16) == 16384
  assert lce_ops._chunk(1024, 50257, jnp.bfloat16) == 50257
  assert lce_ops._chunk(8192, 262144, jnp.bfloat16) == 16384
  assert lce_ops._chunk(16384, 262144, jnp.float32) == 4096
  assert lce_ops._chunk(1 << 22, 262144, jnp.bfloat16) == 256
  assert lce_ops._chunk(0, 7, jnp.bfloat16) == 7


def test_keeps_no_logits():
  """The compiled forward + backward keeps no (rows, V) array: its temporaries are far
  below the logits' size (CPU handlers: float32 copies of x and w per group)."""
  rows, dim, vocab = 512, 32, 8192
  x = jnp.ones((rows, dim), jnp.bfloat16)
  w = jnp.ones((vocab, dim), jnp.bfloat16)
  labels = jnp.zeros((rows,), jnp.int32)
  step = jax.jit(jax.value_and_grad(
      lambda x, w: jaxgpu.linear_cross_entropy(x, w, labels, implementation="cpu"), (0, 1)))
  temp = step.lower(x, w).compile().memory_analysis().temp_size_in_bytes
  assert temp < rows * vocab * 2 / 4, temp


# ---- GPU: several chunks, and torch as an independent oracle --------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("w_layout", ["vd", "dv"])
def test_many_chunks_match_torch(w_layout, monkeypatch):
  """Rows x V past the 256 MiB chunk budget (shrunk here to 1 MiB: 9 chunks of 2304
  columns and a ragged last one), bf16 with softcap and smoothing: loss, dx and dw against
  torch's float32 cross_entropy on the same bf16-rounded logits."""
  torch = pytest.importorskip("torch")
  monkeypatch.setattr(lce_ops, "_CHUNK_BYTES", 1 << 20)
  rng = np.random.default_rng(0)
  rows, dim, vocab, cap, ls = 227, 96, 20000, 30.0, 0.1
  x = jnp.asarray(rng.standard_normal((rows, dim)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((vocab, dim)) * 2 / np.sqrt(dim), jnp.bfloat16)
  labels = rng.integers(0, vocab, rows).astype(np.int32)
  labels[::7] = -100
  wl = w if w_layout == "vd" else w.T
  fn = lambda x, w: jaxgpu.linear_cross_entropy(x, w, jnp.asarray(labels), w_layout=w_layout,
                                                ignore_index=-100, label_smoothing=ls,
                                                logit_softcap=cap, implementation="cuda")
  loss, (dx, dw) = jax.value_and_grad(fn, (0, 1))(x, wl)

  tx = torch.tensor(np.asarray(x.astype(jnp.float32)), device="cuda", requires_grad=True)
  tw = torch.tensor(np.asarray(w.astype(jnp.float32)), device="cuda", requires_grad=True)
  z = (tx.to(torch.bfloat16) @ tw.to(torch.bfloat16).T).float()
  z = cap * torch.tanh(z / cap)
  tl = torch.nn.functional.cross_entropy(z, torch.tensor(labels, device="cuda").long(),
                                         ignore_index=-100, label_smoothing=ls)
  tl.backward()
  np.testing.assert_allclose(float(loss), tl.item(), rtol=2e-3)
  tdw = tw.grad.cpu().numpy()
  got_dw = np.asarray(dw.astype(jnp.float32))
  got_dw = got_dw if w_layout == "vd" else got_dw.T
  for got, want, name in ((np.asarray(dx.astype(jnp.float32)), tx.grad.cpu().numpy(), "dx"),
                          (got_dw, tdw, "dw")):
    err = np.max(np.abs(got - want)) / np.max(np.abs(want))
    assert err < 2e-2, (name, err)


@pytest.mark.gpu
def test_gpu_memory_is_the_chunk_not_the_logits():
  """8192 x 2304 x 262144 bf16 (Gemma 2 2B's head): the compiled forward + backward's
  temporaries stay under 1/16 of XLA's (0.75 GiB)."""
  rows, dim, vocab = 8192, 2304, 262144
  x = jax.ShapeDtypeStruct((rows, dim), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((vocab, dim), jnp.bfloat16)
  labels = jax.ShapeDtypeStruct((rows,), jnp.int32)
  step = jax.jit(jax.value_and_grad(
      lambda x, w, l: jaxgpu.linear_cross_entropy(x, w, l, implementation="cuda"), (0, 1)))
  temp = step.lower(x, w, labels).compile().memory_analysis().temp_size_in_bytes
  assert temp <= 0.75 * 2**30, temp / 2**30


def test_logits_oracle_rounds_once():
  """The spec's oracle rounds the float64 product to x's dtype once (the op's logits)."""
  rng = np.random.default_rng(1)
  case = Case(jnp.bfloat16, (4,), 13, dim=8)
  a = make(rng, case).arrays
  z = np.asarray(oracle.as_f64(a["x"])) @ np.asarray(oracle.as_f64(a["w"])).T
  rounded = np.asarray(jnp.asarray(z).astype(jnp.bfloat16).astype(jnp.float32))
  loss, *_ = ce.np_losses(rounded, np.asarray(a["labels"]))
  with oracle.x64():
    got = _oracle({k: (oracle.as_f64(v) if k != "labels" else v) for k, v in a.items()},
                  dict(case.static(), reduction="none"), case.dtype)[0]
  np.testing.assert_allclose(np.asarray(got), loss, rtol=1e-12)
