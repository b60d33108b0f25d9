"""Forward mode and second derivatives of kernel-backed ops (jaxgpu/_autodiff.py): they run
the pure-JAX reference; reverse mode keeps the kernels; the cases jaxgpu cannot see coming
raise. Every op is checked for jvp and grad of grad by test_contract.py
(test_forward_mode, test_grad_of_grad); this file checks the mechanism on rms_norm and a
small two-op function.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgpu
from jaxgpu import _autodiff
from jaxgpu.reference import norm as norm_ref

import contract as C


def _f(x, w, implementation=None):
  y = jaxgpu.rms_norm(x, w, implementation=implementation)
  return jnp.sum(jaxgpu.gelu(y, implementation=implementation) ** 2)


def _ref(x, w):
  return _f(x, w, implementation="xla")


@pytest.fixture
def xw(rng):
  x = jnp.asarray(rng.standard_normal((3, 5, 7)), jnp.float32)
  w = jnp.asarray(1 + 0.1 * rng.standard_normal(7), jnp.float32)
  return x, w


def _close(a, b):
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=2e-5, atol=2e-5)


def test_grad_keeps_the_kernels(xw):
  """jax.grad (one linearization) lowers to the backward kernels: routing never takes
  reverse mode to the reference, on any jax this suite runs."""
  grad = jax.jit(jax.grad(_f, argnums=(0, 1)))
  targets = C.custom_call_targets(grad.lower(*xw))
  assert {"jaxgpu_rms_norm_bwd", "jaxgpu_gelu_bwd"} <= targets, targets
  targets = C.custom_call_targets(jax.jit(jax.vmap(jax.grad(_f))).lower(xw[0][None], xw[1][None]))
  assert "jaxgpu_rms_norm_bwd" in targets, targets


@pytest.mark.parametrize("how", ["jvp", "jit_of_jvp", "jacfwd", "linearize_of_jvp"])
def test_forward_mode_runs_the_reference(xw, how):
  x, w = xw
  tx, tw = jnp.ones_like(x), jnp.full_like(w, 0.5)
  if how == "jvp":
    got = jax.jvp(_f, (x, w), (tx, tw))
    want = jax.jvp(_ref, (x, w), (tx, tw))
  elif how == "jit_of_jvp":
    jvp = jax.jit(lambda *a: jax.jvp(_f, a[:2], a[2:]))
    assert not any(t.startswith("jaxgpu_") for t in C.custom_call_targets(jvp.lower(x, w, tx, tw)))
    got = jvp(x, w, tx, tw)
    want = jax.jvp(_ref, (x, w), (tx, tw))
  elif how == "jacfwd":
    got = jax.jacfwd(_f, argnums=1)(x, w)
    want = jax.jacfwd(_ref, argnums=1)(x, w)
  else:
    got = jax.linearize(lambda x: jax.jvp(_f, (x, w), (tx, tw))[1], x)[1](tx)
    want = jax.linearize(lambda x: jax.jvp(_ref, (x, w), (tx, tw))[1], x)[1](tx)
  _close(got, want)


@pytest.mark.parametrize("how", ["grad_of_grad", "hessian", "jit_of_grad_of_grad",
                                 "jacrev_of_grad"])
def test_second_order_runs_the_reference(xw, how):
  x, w = xw
  if how == "grad_of_grad":
    second = lambda f: jax.grad(lambda w: jnp.sum(jax.grad(f)(x, w) ** 2))(w)
  elif how == "hessian":
    second = lambda f: jax.hessian(f, argnums=1)(x, w)
  elif how == "jit_of_grad_of_grad":
    second = lambda f: jax.jit(jax.grad(lambda w: jnp.sum(jax.grad(f)(x, w) ** 2)))(w)
  else:
    second = lambda f: jax.jacrev(jax.grad(f, argnums=1), argnums=1)(x, w)
  _close(second(_f), second(_ref))


def test_reference_matches_the_norm_reference(xw):
  """The routed forward is the reference itself (the same values as calling it)."""
  x, w = xw
  y, ty = jax.jvp(lambda x: jaxgpu.rms_norm(x, w, implementation="cpu"), (x,), (x,))
  ry, rty = jax.jvp(lambda x: norm_ref.rms_norm(x, w), (x,), (x,))
  np.testing.assert_array_equal(np.asarray(y), np.asarray(ry))
  np.testing.assert_array_equal(np.asarray(ty), np.asarray(rty))


def test_jvp_of_a_jitted_function_is_refused(xw):
  """jax.jvp(jax.jit(f)): the op was traced by jit before the jvp, so it ran the kernels'
  custom_vjp, which has no forward mode (documented; jax's own message)."""
  with pytest.raises(TypeError, match="forward-mode autodiff"):
    jax.jvp(jax.jit(_f), xw, xw)


def test_derivative_of_a_jitted_gradient_names_the_op(xw):
  """grad(jit(grad(f))): the inner gradient's kernels were traced before the outer
  derivative; the error names the op and the ways out."""
  x, w = xw
  inner = jax.jit(jax.grad(lambda x: jnp.sum(jaxgpu.rms_norm(x, w) ** 2)))
  with pytest.raises(TypeError, match=r"jaxgpu\.rms_norm.*implementation='xla'"):
    jax.grad(lambda x: jnp.sum(inner(x)))(x)
  # The way out it names works.
  with jaxgpu.implementation("xla"):
    inner = jax.jit(jax.grad(lambda x: jnp.sum(jaxgpu.rms_norm(x, w) ** 2)))
    jax.grad(lambda x: jnp.sum(inner(x)))(x)


def test_route(xw):
  x, _ = xw
  assert _autodiff.route("cpu", x, None) == "cpu"
  assert _autodiff.route(None, x) is None
  jax.jvp(lambda x: _assert_routed(x, "xla"), (x,), (x,))
  jax.grad(lambda x: _assert_routed(x, "cpu"))(x)
  jax.grad(lambda x: jax.grad(lambda x: _assert_routed(x, "xla"))(x).sum())(x)
  jax.vmap(jax.grad(lambda x: _assert_routed(x, "cpu")))(x)


def _assert_routed(x, want):
  assert _autodiff.route("cpu", {"a": x}) == want
  return jnp.sum(jnp.sin(x))


def test_second_derivative_through_remat_names_the_op(xw):
  """jax.checkpoint traces its function before any derivative reaches the op: a second
  derivative through it cannot be rerouted and names the op; under
  jaxgpu.implementation('xla') it works (the README's way out)."""
  x, w = xw
  f = jax.checkpoint(lambda w: _f(x, w))
  with pytest.raises(TypeError, match=r"jaxgpu\.(rms_norm|gelu)"):
    jax.hessian(f)(w)
  with jaxgpu.implementation("xla"):
    got = jax.hessian(jax.checkpoint(lambda w: _f(x, w)))(w)
  _close(got, jax.hessian(lambda w: _ref(x, w))(w))
