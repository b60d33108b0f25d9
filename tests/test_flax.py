"""jaxgpu.flax (jaxgpu/flax.py): the Flax NNX drop-ins against flax's own modules.

Skipped, stating why, where flax is not installed (it is an optional extra: jaxgpu[flax]).
Each test runs under every implementation of this machine (the `implementation` fixture,
entered as `jaxgpu.implementation(...)`: the modules take no implementation argument), so
`pytest -m gpu` runs the CUDA kernels through them.

  * RMSNorm / LayerNorm: flax's constructor, parameters and state; the outputs and the
    gradients (of x and of the parameters) of flax's modules for every dtype rule; the
    kernels run where they apply (the FFI target is in the compiled program) and the pure-JAX
    path (flax's semantics) where they do not: other axes, a mask, axis_name.
  * dot_product_attention: flax's signature; any number of batch dims, GQA, causal, masks and
    biases broadcast over batch and heads, the dtype argument; the refusals (dropout,
    module).
  * A small NNX transformer built from the stock modules and the same one built from
    jaxgpu's (RMSNorm, LayerNorm, MultiHeadAttention(attention_fn=...)): the same outputs
    and gradients under nnx.jit, and each loads the other's state.
"""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax", reason="flax is not installed (pip install jaxgpu[flax])")
from flax import nnx  # noqa: E402

import jaxgpu  # noqa: E402
import jaxgpu.flax as jf  # noqa: E402

import oracle  # noqa: E402

NORMS = {"rms": (nnx.RMSNorm, jf.RMSNorm), "layer": (nnx.LayerNorm, jf.LayerNorm)}
TARGETS = {"rms": "jaxgpu_rms_norm_fwd", "layer": "jaxgpu_layer_norm_fwd"}
F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16


def eps_of(dtype) -> float:
  return float(jnp.finfo(dtype).eps)


def close(got, want, dtype, what: str, ulps: float = 4.0):
  """|got - want| <= ulps unit roundoffs of `dtype` times max|want| (both finite)."""
  g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert g.shape == w.shape, (what, g.shape, w.shape)
  assert np.isfinite(g).all(), what
  err, scale = float(np.max(np.abs(g - w))), float(np.max(np.abs(w)))
  assert err <= ulps * eps_of(dtype) / 2 * max(scale, 1e-30), (
      f"{what}: max error {err:.3e} against {ulps} ulps of {jnp.dtype(dtype).name} x {scale:.3e}")


def coarser(*dtypes):
  """The dtype with the largest unit roundoff: a gradient computed at one precision and
  stored in another is as close as the coarser of the two allows."""
  return max((jnp.dtype(d) for d in dtypes), key=eps_of)


def compiled_text(f, *args) -> str:
  return jax.jit(f).lower(*args).compile().as_text()


def scope(implementation):
  """The `implementation` fixture as a scope for modules that take no argument. 'cuda' is
  the platform default there (None): it runs the CUDA kernels, and jaxgpu's reference for
  what they do not take (float32 attention) where a forced 'cuda' would raise."""
  return jaxgpu.implementation(None if implementation == "cuda" else implementation)


@pytest.fixture(autouse=True)
def exact_matmuls():
  """float32 matmuls in float32 (XLA's default on an H100 is TF32, ~1e-3 relative), for
  flax's modules and jaxgpu's alike: the float32 comparisons here are at float32 rounding."""
  with jax.default_matmul_precision("highest"):
    yield


def test_import_jaxgpu_imports_no_flax():
  """`import jaxgpu` stays light: flax (and jaxgpu.flax) only on demand."""
  code = ("import sys, jaxgpu; print('flax' in sys.modules, 'jaxgpu.flax' in sys.modules)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.split() == ["False", "False"], out.stdout + out.stderr


# ---- norms -------------------------------------------------------------------------------------


def randomized(module, rng):
  """The module with random parameters (flax initializes scale 1 and bias 0, which would
  hide a swapped or ignored parameter)."""
  state = nnx.state(module, nnx.Param)
  noisy = jax.tree.map(lambda p: (p + 0.5 * rng.standard_normal(p.shape)).astype(p.dtype), state)
  nnx.update(module, noisy)
  return module


def twins(kind, d, rng, **kw):
  """(flax's module, jaxgpu's) with the same constructor arguments and parameters."""
  stock_cls, ours_cls = NORMS[kind]
  stock = randomized(stock_cls(d, rngs=nnx.Rngs(0), **kw), rng)
  ours = ours_cls(d, rngs=nnx.Rngs(1), **kw)
  nnx.update(ours, nnx.state(stock))
  return stock, ours


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_norm_is_flax_module_with_flax_state(kind):
  stock_cls, ours_cls = NORMS[kind]
  kw = dict(epsilon=1e-5, param_dtype=BF16, use_scale=True)
  if kind == "layer":
    kw["use_bias"] = False
  stock, ours = stock_cls(24, rngs=nnx.Rngs(0), **kw), ours_cls(24, rngs=nnx.Rngs(0), **kw)
  assert isinstance(ours, stock_cls)
  s, o = nnx.state(stock), nnx.state(ours)
  assert jax.tree.structure(s) == jax.tree.structure(o)
  for a, b in zip(jax.tree.leaves(s), jax.tree.leaves(o)):
    assert a.shape == b.shape == (24,) and a.dtype == b.dtype == BF16
  assert (ours.epsilon, ours.num_features) == (1e-5, 24)


# (x dtype, module dtype, param_dtype): flax's rules for the result dtype, each checked.
DTYPE_RULES = [
    (F32, None, F32),      # float32 throughout
    (BF16, None, F32),     # promoted: a float32 result from bfloat16 x
    (BF16, BF16, F32),     # float32 master parameters, bfloat16 compute
    (BF16, None, BF16),    # bfloat16 throughout
    (F16, F16, F32),
    (F32, BF16, F32),      # x rounded to the compute dtype
    (F16, None, BF16),     # promoted to float32 (f16 with bf16)
]


def rule_id(rule):
  return "-".join("none" if d is None else jnp.dtype(d).name for d in rule)


@pytest.mark.parametrize("rule", DTYPE_RULES, ids=rule_id)
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_norm_matches_flax(kind, rule, implementation, rng):
  """Outputs and gradients (x, scale, bias) of flax's module, in flax's result dtype; the
  kernel runs (its FFI target is in the program) unless implementation='xla'."""
  x_dtype, dtype, param_dtype = rule
  stock, ours = twins(kind, 59, rng, dtype=dtype, param_dtype=param_dtype)
  x = jnp.asarray(rng.standard_normal((3, 5, 59)) * 2 + (1.0 if kind == "layer" else 0.0),
                  x_dtype)
  cot = jnp.asarray(rng.standard_normal(x.shape), F32)

  def loss(model, x):
    return jnp.sum(model(x).astype(F32) * cot)

  with scope(implementation):
    got = ours(x)
    grads = nnx.jit(nnx.grad(loss, argnums=(0, 1)))(ours, x)
    text = compiled_text(lambda x: ours(x), x)
  want = stock(x)
  want_grads = nnx.grad(loss, argnums=(0, 1))(stock, x)
  assert got.dtype == want.dtype, (got.dtype, want.dtype)
  out = jnp.dtype(got.dtype)
  # flax rounds float32 parameters to a 16-bit compute dtype first (jaxgpu.flax does not):
  # one more rounding of the result's dtype.
  close(got, want, out, "y", ulps=8)
  (gm, gx), (wm, wx) = grads, want_grads
  assert gx.dtype == wx.dtype == x.dtype
  close(gx, wx, coarser(out, x.dtype), "dx", ulps=32)
  for name in ("scale", "bias"):
    if hasattr(wm, name) and getattr(wm, name, None) is not None:
      g, w = getattr(gm, name)[...], getattr(wm, name)[...]
      assert g.dtype == w.dtype == jnp.dtype(param_dtype)
      close(g, w, coarser(out, g.dtype), f"d{name}", ulps=32)
  assert (TARGETS[kind] in text) == (implementation != "xla"), "the kernel did not run"


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_norm_f32_params_gradient_not_rounded(kind, implementation, rng):
  """dtype=bfloat16 with float32 parameters: the scale's gradient is float32 and within
  float32 rounding of its float64 value (flax's, taken through a bfloat16 copy of the
  scale, is rounded to bfloat16)."""
  _, ours = twins(kind, 256, rng, dtype=BF16, param_dtype=F32)
  x = jnp.asarray(rng.standard_normal((64, 256)), BF16)
  cot = jnp.asarray(rng.standard_normal(x.shape), BF16)
  loss = lambda m: jnp.sum(m(x).astype(F32) * cot.astype(F32))
  with scope(implementation):
    g = nnx.grad(loss)(ours).scale[...]
  assert g.dtype == F32
  # float64: y = xhat * scale (+ bias), so dscale = sum over rows of cot * xhat.
  x64 = np.asarray(x, np.float64)
  if kind == "layer":
    x64 = x64 - x64.mean(-1, keepdims=True)
  xhat = x64 / np.sqrt(np.mean(x64 * x64, -1, keepdims=True) + ours.epsilon)
  exact = np.sum(np.asarray(cot, np.float64) * xhat, axis=0)
  rel = float(np.max(np.abs(np.asarray(g, np.float64) - exact)) / np.max(np.abs(exact)))
  assert rel < 1e-5, rel


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("case", ["axes", "features", "mask", "axis_name", "slow_variance",
                                  "float64"])
def test_norm_pure_jax_path(kind, case, rng):
  """What the kernels do not cover runs in plain JAX, with flax's results."""
  x = jnp.asarray(rng.standard_normal((4, 6, 10)) + 0.5, F32)
  kw, call = {}, {}
  d = 10
  if case == "axes":
    kw = dict(reduction_axes=(-2, -1), feature_axes=-1)
  elif case == "features":
    # One parameter per (6, 10) feature: flax reshapes the (60,) parameters to them.
    kw, d = dict(reduction_axes=(1, 2), feature_axes=(1, 2)), 60
  elif case == "mask":
    call = dict(mask=jnp.asarray(rng.random(x.shape) > 0.3))
  elif case == "axis_name":
    kw = dict(axis_name="batch")
  elif case == "slow_variance":
    kw = dict(use_fast_variance=False)
  elif case == "float64":
    kw = dict(dtype=jnp.float64, param_dtype=jnp.float64)
  if case == "axis_name":
    run = lambda m, x: jax.vmap(lambda r: m(r), axis_name="batch")(x)
  else:
    run = lambda m, x: m(x, **call)
  if case == "float64":
    with oracle.x64():
      stock, ours = twins(kind, d, rng, **kw)
      got, want = run(ours, x.astype(jnp.float64)), run(stock, x.astype(jnp.float64))
    assert got.dtype == want.dtype == jnp.float64
  else:
    stock, ours = twins(kind, d, rng, **kw)
    got, want = run(ours, x), run(stock, x)
    text = compiled_text(lambda: run(ours, x))
    # The kernel where it applies (use_fast_variance=False), plain JAX elsewhere.
    assert (TARGETS[kind] in text) == (case == "slow_variance"), case
  close(got, want, F32, case, ulps=16)


# ---- attention ---------------------------------------------------------------------------------


def qkv(rng, batch, t, s, n, k, h, dtype):
  mk = lambda *shape: jnp.asarray(rng.standard_normal(batch + shape), dtype)
  return mk(t, n, h), mk(s, k, h), mk(s, k, h)


def visible_mask(rng, shape):
  """A random boolean mask with every query row seeing key 0 (a fully masked row is where
  flax and jaxgpu differ, by design: zeros here, the mean of the values there)."""
  m = rng.random(shape) > 0.4
  m[..., 0] = True
  return jnp.asarray(m)


ATTENTION_CASES = {
    # id: (batch dims, T, S, N, K, H, options)
    "rank3": ((), 9, 9, 2, 2, 16, {}),
    "rank4-causal": ((2,), 13, 13, 4, 4, 32, {"is_causal": True}),
    "rank5-gqa-mask": ((2, 3), 7, 11, 4, 2, 16, {"mask": (2, 3, 1, 7, 11)}),
    "rank5-bias-heads": ((2, 2), 8, 8, 3, 1, 16, {"bias": (3, 8, 8)}),
    "rank4-mask-bias-causal": ((3,), 12, 12, 2, 2, 59, {"mask": (1, 2, 12, 12),
                                                         "bias": (3, 1, 12, 12),
                                                         "is_causal": True}),
}


@pytest.mark.parametrize("name", list(ATTENTION_CASES))
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_attention_matches_flax(name, dtype, implementation, rng):
  batch, t, s, n, k, h, opts = ATTENTION_CASES[name]
  q, kk, v = qkv(rng, batch, t, s, n, k, h, dtype)
  kw = {"is_causal": opts.get("is_causal", False)}
  if "mask" in opts:
    kw["mask"] = visible_mask(rng, opts["mask"])
  if "bias" in opts:
    kw["bias"] = jnp.asarray(rng.standard_normal(opts["bias"]), F32)
  cot = jnp.asarray(rng.standard_normal(q.shape[:-1] + (h,)), F32)
  loss = lambda fn: lambda q, k, v: jnp.sum(fn(q, k, v, **kw).astype(F32) * cot)
  with scope(implementation):
    got = jax.jit(lambda q, k, v: jf.dot_product_attention(q, k, v, **kw))(q, kk, v)
    grads = jax.jit(jax.grad(loss(jf.dot_product_attention), argnums=(0, 1, 2)))(q, kk, v)
  # flax's fast path (jax.nn) flattens a mask's or bias' batch dims by reshaping: give it
  # full batch dims, which it can flatten.
  ref_kw = dict(kw)
  for key in ("mask", "bias"):
    if key in kw:
      a = kw[key].reshape((1,) * (len(batch) + 3 - kw[key].ndim) + kw[key].shape)
      ref_kw[key] = jnp.broadcast_to(a, batch + a.shape[-3:])
  want = nnx.dot_product_attention(q, kk, v, **ref_kw)
  want_grads = jax.grad(lambda q, k, v: jnp.sum(
      nnx.dot_product_attention(q, k, v, **ref_kw).astype(F32) * cot), argnums=(0, 1, 2))(
          q, kk, v)
  assert got.shape == want.shape and got.dtype == want.dtype == dtype
  ulps = 16 if dtype == F32 else 8
  close(got, want, dtype, f"{name} out", ulps=ulps)
  for g, w, what in zip(grads, want_grads, "qkv"):
    assert g.dtype == w.dtype == dtype
    close(g, w, dtype, f"{name} d{what}", ulps=4 * ulps)


def test_attention_dtype_argument(rng):
  """dtype= casts query, key and value (flax's promote_dtype), the result in that dtype."""
  q, k, v = qkv(rng, (2,), 8, 8, 2, 2, 16, F32)
  got = jf.dot_product_attention(q, k, v, dtype=BF16)
  want = nnx.dot_product_attention(q, k, v, dtype=BF16)
  assert got.dtype == want.dtype == BF16
  close(got, want, BF16, "dtype=bf16", ulps=8)


def test_attention_refuses_dropout_and_sowing(rng):
  q, k, v = qkv(rng, (1,), 4, 4, 2, 2, 8, F32)
  with pytest.raises(NotImplementedError, match="dropout"):
    jf.dot_product_attention(q, k, v, dropout_rate=0.1, dropout_rng=jax.random.key(0))
  # Deterministic: no dropout is applied, so the kernels run.
  out = jf.dot_product_attention(q, k, v, dropout_rate=0.1, deterministic=True)
  close(out, nnx.dot_product_attention(q, k, v), F32, "deterministic", ulps=16)
  mha = nnx.MultiHeadAttention(2, 16, attention_fn=jf.dot_product_attention, decode=False,
                               rngs=nnx.Rngs(0))
  x = jnp.asarray(rng.standard_normal((1, 4, 16)), F32)
  with pytest.raises(NotImplementedError, match="sow"):
    mha(x, sow_weights=True, deterministic=True)


# ---- a small transformer -------------------------------------------------------------------------


class Block(nnx.Module):
  def __init__(self, d, heads, kv_heads, *, rms, ln, attention_fn, dtype, rngs):
    self.pre = rms(d, dtype=dtype, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(heads, d, num_kv_heads=kv_heads, dtype=dtype,
                                       attention_fn=attention_fn, decode=False, rngs=rngs)
    self.mid = ln(d, dtype=dtype, rngs=rngs)
    self.up = nnx.Linear(d, 2 * d, dtype=dtype, rngs=rngs)
    self.down = nnx.Linear(2 * d, d, dtype=dtype, rngs=rngs)

  def __call__(self, x, mask):
    x = x + self.attn(self.pre(x), mask=mask, deterministic=True)
    return x + self.down(jax.nn.gelu(self.up(self.mid(x))))


class Tiny(nnx.Module):
  def __init__(self, *, rms, ln, attention_fn, dtype=None, vocab=37, d=32, layers=2, rngs):
    self.embed = nnx.Embed(vocab, d, dtype=dtype, rngs=rngs)
    self.blocks = nnx.List([Block(d, 4, 2, rms=rms, ln=ln, attention_fn=attention_fn,
                                  dtype=dtype, rngs=rngs) for _ in range(layers)])
    self.final = rms(d, dtype=dtype, rngs=rngs)

  def __call__(self, tokens, lengths):
    t = tokens.shape[1]
    causal = jnp.tril(jnp.ones((t, t), bool))
    keep = jnp.arange(t)[None, :] < lengths[:, None]              # padded keys
    mask = causal[None, None] & keep[:, None, None, :]
    mask = mask | jnp.eye(t, dtype=bool)[None, None]               # no fully masked row
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x, mask)
    return self.embed.attend(self.final(x))


def tiny_pair(dtype):
  kinds = [dict(rms=nnx.RMSNorm, ln=nnx.LayerNorm, attention_fn=nnx.dot_product_attention),
           dict(rms=jf.RMSNorm, ln=jf.LayerNorm, attention_fn=jf.dot_product_attention)]
  stock, ours = (Tiny(dtype=dtype, rngs=nnx.Rngs(0), **k) for k in kinds)
  return stock, ours


@pytest.mark.parametrize("dtype", [None, BF16], ids=["f32", "bf16-compute"])
def test_tiny_transformer_matches_flax(dtype, implementation, rng):
  """The same model from stock and from jaxgpu modules: the same state layout (each loads
  the other's), outputs and gradients under nnx.jit."""
  stock, ours = tiny_pair(dtype)
  randomize = lambda p: (p + 0.2 * rng.standard_normal(p.shape)).astype(p.dtype)
  nnx.update(stock, jax.tree.map(randomize, nnx.state(stock, nnx.Param)))
  assert jax.tree.structure(nnx.state(stock)) == jax.tree.structure(nnx.state(ours))
  nnx.update(ours, nnx.state(stock))
  tokens = jnp.asarray(rng.integers(0, 37, (3, 11)), jnp.int32)
  lengths = jnp.asarray([11, 7, 1], jnp.int32)
  targets = jnp.roll(tokens, -1, axis=1)

  def loss(model):
    logits = model(tokens, lengths).astype(F32)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))

  step = nnx.jit(nnx.value_and_grad(loss))
  with scope(implementation):
    got_loss, got = step(ours)
    text = compiled_text(lambda: ours(tokens, lengths))
  want_loss, want = step(stock)
  # The float32 model of the same parameters: the budget of a bfloat16-compute model is
  # twice flax's own distance from it (the 2x rule, tests/oracle.py).
  exact_loss, exact = want_loss, want
  if dtype is not None:
    f32_model = Tiny(rms=nnx.RMSNorm, ln=nnx.LayerNorm, attention_fn=nnx.dot_product_attention,
                     rngs=nnx.Rngs(0))
    nnx.update(f32_model, nnx.state(stock))
    exact_loss, exact = step(f32_model)
  if implementation != "xla":
    kernels = ["jaxgpu_rms_norm", "jaxgpu_layer_norm"]
    if not (implementation == "cuda" and dtype is None):  # no float32 CUDA attention
      kernels.append("jaxgpu_attention")
    for target in kernels:
      assert target in text, target
  gl, wl, el = jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(exact)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  assert all(g.dtype == w.dtype == F32 for g, w in zip(gl, wl))
  # Relative to the whole gradient: some leaves are ~0 in exact arithmetic (the key
  # projection's bias, to which softmax is invariant) and hold only rounding noise.
  norm = lambda leaves: float(np.sqrt(sum(float(jnp.sum(jnp.square(a))) for a in leaves)))
  rel = lambda a: norm([x - e for x, e in zip(a, el)]) / norm(el)
  loss_err = lambda v: abs(float(v) - float(exact_loss)) / abs(float(exact_loss))
  print(f"loss {float(got_loss)!r} (flax {float(want_loss)!r}, float32 {float(exact_loss)!r}); "
        f"gradient relative error {rel(gl):.2e} (flax {rel(wl):.2e})")
  # Plus a rounding atol: 4 unit roundoffs of the compute dtype, and 32 of float32 for the
  # kernels' other summation orders.
  atol = 4 * oracle.unit_roundoff(dtype or F32) + 32 * oracle.unit_roundoff(F32)
  assert loss_err(got_loss) <= 2 * loss_err(want_loss) + atol
  assert rel(gl) <= 2 * rel(wl) + atol
  # ... and the stock model loads the jaxgpu model's state back.
  nnx.update(stock, nnx.state(ours))
  again = stock(tokens, lengths)
  with scope(implementation):
    close(ours(tokens, lengths).astype(F32), again.astype(F32), dtype or F32, "reloaded",
          ulps=64 if dtype is None else 16)
