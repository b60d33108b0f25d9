"""Derivatives the kernels do not give: forward mode and derivatives of derivatives.

A kernel-backed op is a `jax.custom_vjp` function (docs/design.md section 3): reverse mode
runs its backward kernel, but custom_vjp has no forward mode ("can't apply forward-mode
autodiff (jvp) to a custom_vjp function"), and its rules call inner ops that have no
differentiation rule of their own (custom_vmap over custom_partitioning), so a second
derivative fails inside jax. Where jaxgpu can see it coming, the op runs its pure-JAX
reference instead, which jax differentiates in any mode and to any order:

* forward mode: jax.jvp, jax.jacfwd, jax.hessian (jacfwd of jacrev), jax.jvp inside jit.
  The op is called with a forward-mode tracer (ad.JVPTracer) among its inputs.
* second order: grad of grad, jacrev of grad. The op is called with inputs that two
  reverse-mode linearizations trace (ad.LinearizeTracer of two traces, nested in one
  argument or one in each).

Reverse mode alone (jax.grad, jax.vjp, jax.linearize, value_and_grad, also under vmap and
jit) traces with one LinearizeTracer (jax >= 0.10 linearizes directly, never through a
JVPTracer), so it keeps the kernels: tests/test_autodiff.py checks that grad still lowers
to the backward targets. (Under jax.checkpoint the op is traced into a jaxpr first, and its
custom_vjp is differentiated as usual: the kernels too.)

What cannot be seen at the op: a function traced into a jaxpr before it is differentiated,
jax.jvp(jax.jit(f)), jax.grad(jax.jit(jax.grad(f))), and anything jax.checkpoint wraps
(jax.hessian(jax.checkpoint(f))), where the op only saw jaxpr tracers.
The first fails in jax's custom_vjp ("can't apply forward-mode autodiff (jvp) to a
custom_vjp function", a message jaxgpu cannot change); the second reaches the inner ops,
whose rule here (`refuse_differentiation`) names the op and the ways out. Both work with
the transforms the other way round (jax.jit(jax.jvp(f)), jax.jit(jax.grad(jax.grad(f)))) or
with implementation='xla'.

Each public op applies this with one line: ``impl = _autodiff.route(impl, *arrays)``.
"""

from __future__ import annotations

import jax
from jax._src import core
from jax._src.interpreters import ad


def _traces(a, jvp: set, lin: set) -> None:
  """Adds the forward-mode and reverse-mode traces that trace `a` to `jvp` and `lin`,
  down its chain of tracers (a vmap or shard_map tracer holds the value the transforms
  below it trace)."""
  while isinstance(a, core.Tracer):
    if isinstance(a, ad.JVPTracer):
      jvp.add(id(a._trace))
    elif isinstance(a, ad.LinearizeTracer):
      lin.add(id(a._trace))
    inner = getattr(a, "primal", None)
    if inner is None:
      inner = getattr(a, "val", None)
    a = inner


def needs_reference(*arrays) -> bool:
  """True when a differentiation the kernels cannot do traces `arrays` (pytrees; None
  entries are skipped): forward mode, or two nested reverse-mode linearizations, which
  may trace different arguments (grad over w of a grad over x)."""
  jvp: set = set()
  lin: set = set()
  for leaf in jax.tree.leaves(arrays):
    _traces(leaf, jvp, lin)
  return bool(jvp) or len(lin) > 1


def route(implementation: str | None, *arrays) -> str | None:
  """The implementation to run: 'xla' (the reference) where `needs_reference`, else the
  resolved `implementation` unchanged (an explicit 'cuda' or 'cpu' included: forward mode
  and second derivatives exist only through the reference)."""
  return "xla" if needs_reference(*arrays) else implementation


def op_names(local_fn, *args) -> tuple[str, ...]:
  """The public ops whose FFI targets `local_fn` calls on arrays like `args` (read from a
  trace of it), for error messages."""
  from jaxgpu import _family, _ffi  # noqa: PLC0415 (_family imports the op modules)

  try:
    jaxpr = jax.make_jaxpr(local_fn)(*(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args))
  except Exception:  # noqa: BLE001 (only a message is at stake)
    return ()
  targets = {str(eqn.params.get("target_name", "")) for eqn in jaxpr.jaxpr.eqns}
  names = []
  for name, (_, op) in _family.all_ops().items():
    declared = {t for base in op.targets.values() for t in _ffi.platform_target_names(base)}
    if declared & targets:
      names.append(name)
  return tuple(names)


def refuse_differentiation(local_fn, args):
  """Raises the error of a kernel call that is being differentiated (see the module
  docstring: only a function traced before it was differentiated gets here)."""
  names = op_names(local_fn, *args)
  what = " / ".join(f"jaxgpu.{n}" for n in names) if names else (
      f"a jaxgpu op ({getattr(local_fn, '__module__', 'jaxgpu')})")
  raise TypeError(
      f"{what}: a derivative reached its FFI kernels, which have none of their own (only "
      "the op's custom_vjp has one). This happens when a function was traced into a jaxpr "
      "(jax.jit, jax.checkpoint, ...) before being differentiated a second time or in "
      "forward mode, e.g. jax.grad(jax.jit(jax.grad(f))). Apply the derivatives before "
      "jit (jax.jit(jax.grad(jax.grad(f))), jax.jit(jax.jvp(...))), where jaxgpu runs the "
      "differentiable reference itself, or pass implementation='xla' (or wrap the code in "
      "`with jaxgpu.implementation('xla'):`).")
