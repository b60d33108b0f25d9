"""The transform contract, run over every spec in tests/specs (every public op of every
family): custom-call targets, implementation selection, forward mode, vmap, vmap of grad,
grad of vmap, jit on a sharded (4, 2) mesh, shard_map, pmap, bad inputs, size 0, numpy
inputs. What each case means is in tests/contract.py; each op's tables in
tests/specs/<family>.py. Ids read `test_vmap[rms_norm-x1-bf16-cpu]`: op, case, dtype,
implementation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxgpu import _family

import contract as C
import oracle
from conftest import HAS_CUDA
from specs import SPECS

try:
  from jax import shard_map
except ImportError:  # older jax
  from jax.experimental.shard_map import shard_map  # type: ignore

_ALL = list(SPECS.values())
_DIFF = [s for s in _ALL if s.differentiable]


def _by_spec(specs):
  return [pytest.param(s, id=s.id) for s in specs]


def _vmap_params(mode):
  return [pytest.param(s, c, id=f"{s.id}-{c.id}-{C.dtype_id(c.example.dtype)}")
          for s in (_ALL if mode == "fwd" else _DIFF) for c in s.vmap if mode in c.modes]


def _sharding_params():
  return [pytest.param(s, c, t, id=f"{s.id}-{c.id}-{t}")
          for s in _ALL for c in s.sharding for t in c.axis_types]


# The parametrization of each test (the implementation fixtures come after, conftest.py).
_PARAMS = {
    "test_lowers_to_its_targets": ("spec", lambda: _by_spec(_ALL)),
    "test_default_implementation_runs_platform_kernel": ("spec,platform", lambda: [
        pytest.param(s, p, id=f"{s.id}-{p}",
                     marks=(pytest.mark.gpu,) if p == "cuda" else ())
        for s in _ALL for p in ("cuda", "cpu")]),
    "test_env_var_forces_implementation": ("spec,forced", lambda: [
        pytest.param(s, f, id=f"{s.id}-{f}") for s in _ALL for f in ("xla", "cpu")]),
    "test_env_var_bad_value": ("spec", lambda: _by_spec(_ALL)),
    "test_env_var_cuda_without_gpu": ("spec", lambda: _by_spec(_ALL)),
    "test_cuda_without_gpu": ("spec", lambda: _by_spec(_ALL)),
    "test_forward_mode_unsupported": ("spec", lambda: _by_spec(_DIFF)),
    "test_grad_refused": ("spec", lambda: _by_spec([s for s in _ALL if not s.differentiable])),
    "test_numpy_inputs": ("spec", lambda: _by_spec(_ALL)),
    "test_bad_input": ("spec,bad", lambda: [
        pytest.param(s, b, id=f"{s.id}-{b.id}") for s in _ALL for b in s.bad_inputs]),
    "test_size_zero": ("spec,example", lambda: [
        pytest.param(s, e, id=f"{s.id}-{i}") for s in _ALL for i, e in s.size_zero]),
    "test_vmap": ("spec,case", lambda: _vmap_params("fwd")),
    "test_vmap_of_grad": ("spec,case", lambda: _vmap_params("grad")),
    "test_grad_of_vmap": ("spec,case", lambda: _vmap_params("grad_of")),
    "test_sharded": ("spec,case,axis_type", _sharding_params),
    "test_shard_map": ("spec", lambda: _by_spec([s for s in _ALL if s.shard_map])),
    "test_grad_inside_shard_map": ("spec,check_vma", lambda: [
        pytest.param(s, v, id=f"{s.id}-{'vma' if v else 'novma'}")
        for s in _DIFF if s.shard_map for v in (True, False)]),
    "test_shard_map_outputs_are_varying": ("spec", lambda: _by_spec(
        [s for s in _ALL if s.shard_map])),
    "test_pmap": ("spec", lambda: _by_spec([s for s in _ALL if s.pmap])),
}


def pytest_generate_tests(metafunc):
  entry = _PARAMS.get(metafunc.function.__name__)
  if entry is not None:
    metafunc.parametrize(entry[0], entry[1]())


def test_every_op_has_a_spec():
  """SPECS holds exactly the public ops the families declare (jaxgpu._family)."""
  declared = set(_family.all_ops())
  specified = {spec.name for spec in SPECS.values()}
  assert specified == declared, specified ^ declared
  # A forward-only op's every pass (its variants' targets) is some spec's forward.
  for name, (_, op) in _family.all_ops().items():
    if not op.differentiable:
      covered = {spec.fwd_pass for spec in _ALL if spec.name == name}
      assert covered == set(op.targets), (name, covered ^ set(op.targets))
  for spec in _ALL:
    assert set(spec.diff_args) <= set(spec.array_args), spec.name
    assert spec.differentiable == bool(spec.diff_args), spec.name


# ---- implementation selection --------------------------------------------------------------------


def _example(spec, rng):
  inputs = spec.make(rng, spec.example)
  return inputs.arrays, inputs.static


def test_lowers_to_its_targets(spec, implementation, rng):
  """An explicit implementation lowers to that platform's targets: the forward pass to
  the 'fwd' target, the gradient to every other pass the family declares; 'xla' to none."""
  arrays, static = _example(spec, rng)
  f = C.op_fn(spec, implementation, static)
  fwd = C.custom_call_targets(jax.jit(f).lower(arrays))
  bwd = set()
  if spec.differentiable:
    cots = C.make_cotangents(rng, C.output_avals(spec, C.Inputs(arrays, static)))
    bwd = C.custom_call_targets(jax.jit(lambda a, c: C.grad_fn(spec, f)(a, c)[0]).lower(
        arrays, cots))
  if implementation == "xla":
    assert not any(t.startswith("jaxgpu_") for t in fwd | bwd), fwd | bwd
    return
  op = spec.op
  assert op.target(spec.fwd_pass, implementation) in fwd, fwd
  grad_passes = spec.grad_passes if spec.grad_passes is not None else op.targets
  for pass_ in grad_passes:
    if pass_ != spec.fwd_pass and spec.differentiable:
      assert op.target(pass_, implementation) in bwd, (pass_, bwd)
  if spec.differentiable and not spec.grad_runs_forward:
    assert op.target(spec.fwd_pass, implementation) not in bwd, "grad must not re-run the forward"


def test_default_implementation_runs_platform_kernel(spec, platform, rng):
  """implementation=None lowers to the platform-generic target and gives the numbers the
  explicit kernel of the platform XLA places it on gives."""
  device = jax.devices("cpu")[0] if platform == "cpu" else jax.devices()[0]
  arrays, static = _example(spec, rng)
  arrays = jax.device_put(arrays, device)
  f = jax.jit(C.op_fn(spec, None, static))
  assert spec.op.target(spec.fwd_pass, None) in C.custom_call_targets(f.lower(arrays))
  explicit = jax.jit(C.op_fn(spec, platform, static))(arrays)
  for a, b in zip(f(arrays), explicit):
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                  np.asarray(b.astype(jnp.float32)))


def _check_forward(spec, arrays, static, got, what):
  exact, lowp = C.expected_outputs(spec, static, C.op_dtype(arrays), arrays)
  out_atol, _ = C.atols(spec, static, [(arrays, None, got)])
  C.check_outputs(spec, got, exact, lowp, out_atol, what)


def test_env_var_forces_implementation(spec, forced, monkeypatch, rng):
  """JAXGPU_IMPLEMENTATION applies to implementation=None (resolved at trace time, jitted
  or not); an explicit implementation= wins over it."""
  if forced == "cpu" and HAS_CUDA:
    pytest.skip("the 'cpu' kernel cannot run on the default (GPU) device")
  arrays, static = _example(spec, rng)
  monkeypatch.setenv("JAXGPU_IMPLEMENTATION", forced)
  targets = C.custom_call_targets(jax.jit(C.op_fn(spec, None, static)).lower(arrays))
  if forced == "xla":
    assert not any(t.startswith("jaxgpu_") for t in targets), targets
  else:
    assert spec.op.target(spec.fwd_pass, forced) in targets, targets
  targets = C.custom_call_targets(jax.jit(C.op_fn(spec, "xla", static)).lower(arrays))
  assert not any(t.startswith("jaxgpu_") for t in targets), targets
  _check_forward(spec, arrays, static, C.op_fn(spec, None, static)(arrays), "under the env var")


def test_env_var_bad_value(spec, monkeypatch, rng):
  arrays, static = _example(spec, rng)
  monkeypatch.setenv("JAXGPU_IMPLEMENTATION", "bogus")
  with pytest.raises(ValueError, match="JAXGPU_IMPLEMENTATION"):
    C.op_fn(spec, None, static)(arrays)


@pytest.mark.skipif(HAS_CUDA, reason="this machine has a CUDA backend")
def test_env_var_cuda_without_gpu(spec, monkeypatch, rng):
  arrays, static = _example(spec, rng)
  monkeypatch.setenv("JAXGPU_IMPLEMENTATION", "cuda")
  with pytest.raises(ValueError, match="cuda"):
    C.op_fn(spec, None, static)(arrays)


@pytest.mark.skipif(HAS_CUDA, reason="this machine has a CUDA backend")
def test_cuda_without_gpu(spec, rng):
  arrays, static = _example(spec, rng)
  with pytest.raises(ValueError, match="implementation='cuda'"):
    C.op_fn(spec, "cuda", static)(arrays)


def test_forward_mode_unsupported(spec, implementation, rng):
  """custom_vjp has no forward mode: jax.jvp raises (documented in the docstrings); the
  'xla' reference is plain JAX."""
  arrays, static = _example(spec, rng)
  diff = {k: v for k, v in arrays.items() if k in spec.diff_args}
  f = lambda d: C.op_fn(spec, implementation, static)({k: d.get(k, v) for k, v in
                                                       arrays.items()})
  if implementation == "xla":
    jax.jvp(f, (diff,), (diff,))
    return
  with pytest.raises(TypeError):
    jax.jvp(f, (diff,), (diff,))


def test_grad_refused(spec, implementation, rng):
  """A forward-only op (the family declares differentiable=False) refuses jax.grad."""
  arrays, static = _example(spec, rng)
  name = next(k for k, v in arrays.items() if jnp.issubdtype(v.dtype, jnp.floating))
  f = lambda x: C.op_fn(spec, implementation, static)({**arrays, name: x})[0].sum()
  with pytest.raises(ValueError, match="cannot be differentiated"):
    jax.grad(f)(arrays[name])


def test_numpy_inputs(spec, implementation, rng):
  """numpy arrays are accepted like jax arrays."""
  arrays, static = _example(spec, rng)
  as_np = {k: np.asarray(v) for k, v in arrays.items()}
  _check_forward(spec, arrays, static, C.op_fn(spec, implementation, static)(as_np),
                 "numpy inputs")


# ---- bad input and size 0 ------------------------------------------------------------------------


def test_bad_input(spec, bad):
  """The error names the argument, eagerly and at trace time under jit (the array
  arguments traced, the rest closed over; float64 arrays cannot be traced without x64)."""
  kw = bad.build()
  fn = spec.invoke
  with pytest.raises(bad.error, match=bad.match):
    fn(**kw)
  arrays = {k: v for k, v in kw.items()
            if k in spec.array_args and isinstance(v, (jax.Array, np.ndarray))}
  rest = {k: v for k, v in kw.items() if k not in arrays}
  if arrays and all(np.dtype(a.dtype) != np.float64 for a in arrays.values()):
    with pytest.raises(bad.error, match=bad.match):
      jax.jit(lambda a: fn(**a, **rest))(arrays)


def test_size_zero(spec, example, implementation, rng):
  """Empty arguments: results of the right shapes and dtypes (jitted and eager), and
  gradients too; any value they hold (a sum over no rows, a mean over no positions) is the
  oracle's."""
  inputs = spec.make(rng, example)
  arrays, static = inputs.arrays, inputs.static
  f = C.op_fn(spec, implementation, static)
  avals = C.output_avals(spec, inputs)
  got = jax.jit(f)(arrays)
  eager = f(arrays)
  for g, e, a in zip(got, eager, avals):
    assert g.shape == a.shape and g.dtype == a.dtype, (g.shape, g.dtype, a)
    assert e.shape == a.shape and e.dtype == a.dtype, (e.shape, e.dtype, a)
  dtype = C.op_dtype(arrays)
  exact, lowp = C.expected_outputs(spec, static, dtype, arrays)
  C.check_outputs(spec, got, exact, lowp, {}, "size 0")
  if not spec.differentiable:
    return
  cots = C.make_cotangents(rng, avals)
  grads, _ = jax.jit(C.grad_fn(spec, f))(arrays, cots)
  for k, v in grads.items():
    assert v.shape == arrays[k].shape and v.dtype == arrays[k].dtype, k
  exact, lowp = C.expected_grads(spec, static, dtype, arrays, cots)
  C.check_grads(spec, grads, exact, lowp, {}, "size 0")


# ---- vmap ----------------------------------------------------------------------------------------


def _vmap_key(case, names) -> tuple:
  """What a vmap transform of the references depends on (their cache key, with the op,
  its options and dtype)."""
  return (repr(case.in_axes), case.level_sizes(), tuple(names))


def test_vmap(spec, case, implementation, rng):
  """vmap (nested where the case has several levels) against the same vmap of the oracle."""
  inputs = C.batched_inputs(spec, rng, case)
  arrays, static = inputs.arrays, inputs.static
  names = list(arrays)
  transform = lambda f: lambda a: C.vmapped(f, names, case)(*[a[n] for n in names])
  got = jax.jit(transform(C.op_fn(spec, implementation, static)))(arrays)
  one = C.output_avals(spec, spec.make(rng, case.example))
  for g, a in zip(got, one):
    assert g.shape == case.level_sizes() + a.shape and g.dtype == a.dtype, (g.shape, a)
  exact, lowp = C.expected(spec, transform, static, case.example.dtype, arrays,
                           cache_as=("vmap",) + _vmap_key(case, names))
  out_atol, _ = C.atols(spec, static, [
      (C.take_example(arrays, case, i), None, tuple(np.asarray(g)[i] for g in got))
      for i in C.example_indices(case)])
  C.check_outputs(spec, got, exact, lowp, out_atol, f"vmap {case.id}")


def _grad_case(spec, case, implementation, rng, per_example: bool):
  inputs = C.batched_inputs(spec, rng, case)
  arrays, static = inputs.arrays, inputs.static
  names = list(arrays)
  sizes = case.level_sizes()
  one = C.output_avals(spec, spec.make(rng, case.example))
  cots = C.make_cotangents(rng, one, lead=sizes)

  if per_example:   # vmap(grad): per-example gradients, the cotangents batched on axis 0
    def transform(f):
      g = lambda a, c: C.grad_fn(spec, f)(a, c)
      return lambda a, c: C.vmapped(g, names, case, extra=1)(*[a[n] for n in names], c)
  else:             # grad(vmap): the vmapped op's gradient
    def transform(f):
      vf = lambda a: C.vmapped(f, names, case)(*[a[n] for n in names])
      return lambda a, c: C.grad_fn(spec, vf)(a, c)

  grads, outs = jax.jit(transform(C.op_fn(spec, implementation, static)))(arrays, cots)
  for k, v in grads.items():
    want = (sizes + spec.make(rng, case.example).arrays[k].shape if per_example
            else arrays[k].shape)
    assert v.shape == want and v.dtype == arrays[k].dtype, (k, v.shape, want)
  exact, lowp = C.expected(spec, lambda f: lambda a, c: transform(f)(a, c)[0], static,
                           case.example.dtype, arrays, cots,
                           cache_as=(per_example,) + _vmap_key(case, names))
  scale = None if per_example else {k: C.shared_factor(case, k) for k in grads}
  _, grad_atol = C.atols(spec, static, [
      (C.take_example(arrays, case, i), tuple(np.asarray(c)[i] for c in cots),
       tuple(np.asarray(o)[i] for o in outs)) for i in C.example_indices(case)], scale)
  C.check_grads(spec, grads, exact, lowp, grad_atol,
                f"{'vmap(grad)' if per_example else 'grad(vmap)'} {case.id}")


def test_vmap_of_grad(spec, case, implementation, rng):
  """Per-example gradients of every differentiated argument (batched or not)."""
  _grad_case(spec, case, implementation, rng, per_example=True)


def test_grad_of_vmap(spec, case, implementation, rng):
  """grad through vmap: an unbatched argument's gradient sums over the vmapped axes."""
  _grad_case(spec, case, implementation, rng, per_example=False)


# ---- sharding on 8 fake CPU devices --------------------------------------------------------------


def test_sharded(spec, case, axis_type, host_implementation, cpu_devices, rng):
  """jit with the arguments sharded on a (4, 2) mesh: the collectives each program may
  contain, the layouts the results keep (jax.typeof too on an Explicit mesh), the values."""
  mesh = oracle.mesh_4x2(cpu_devices, axis_type)
  inputs = spec.make(rng, case.example)
  arrays, static = inputs.arrays, inputs.static
  f = C.op_fn(spec, host_implementation, static)
  grad = case.grad and spec.differentiable
  cots = C.make_cotangents(rng, C.output_avals(spec, inputs))
  cot_specs = case.out_specs if case.out_specs is not None else (case.cot_specs or {})
  cot_specs = [cot_specs.get(n, P()) for n in spec.outputs[:len(cots)]]

  def run():
    a = C.put(mesh, arrays, case.in_specs)
    c = tuple(C.put(mesh, {"c": x}, {"c": s})["c"] for x, s in zip(cots, cot_specs))
    outs, fwd_hlo = C.compiled(f, a)
    if not grad:
      return outs, None, fwd_hlo, None
    grads, bwd_hlo = C.compiled(lambda a, c: C.grad_fn(spec, f)(a, c)[0], a, c)
    return outs, grads, fwd_hlo, bwd_hlo

  outs, grads, fwd_hlo, bwd_hlo = oracle.run_on_mesh(mesh, axis_type, run)
  named = dict(zip(spec.outputs, outs))
  if not (case.kernels_only and host_implementation == "xla"):
    if case.fwd is not None:
      assert oracle.collectives(fwd_hlo) == case.fwd, oracle.collectives(fwd_hlo)
    if grad and case.bwd is not None:
      assert oracle.collectives(bwd_hlo) == case.bwd, oracle.collectives(bwd_hlo)
    layouts = [(named[n], s) for n, s in (case.out_specs or {}).items()]
    if grad:
      layouts += [(grads[n], s) for n, s in (case.grad_specs or {}).items()]
    for value, want in layouts:
      want = C.padded(want, value.ndim)
      assert oracle.spec_of(value) == want, (value.sharding, want)
      if axis_type == "explicit":
        assert C.padded(jax.typeof(value).sharding.spec, value.ndim) == want, jax.typeof(value)
    if case.hlo_check is not None:
      assert case.hlo_check(fwd_hlo), "forward HLO"
      if grad:
        assert case.hlo_check(bwd_hlo), "gradient HLO"
  if case.gathers and host_implementation != "xla":
    assert oracle.collectives(fwd_hlo), "expected a gather of the sharded dim"
  if axis_type == "explicit" and grad:
    for out, arg in case.explicit_like:
      assert jax.typeof(named[out]).sharding.spec == jax.typeof(grads[arg]).sharding.spec
  dtype = C.op_dtype(arrays)
  exact, lowp = C.expected_outputs(spec, static, dtype, arrays)
  out_atol, grad_atol = C.atols(spec, static, [(arrays, cots, outs)])
  C.check_outputs(spec, outs, exact, lowp, out_atol, f"sharded {case.id}")
  if grad:
    exact, lowp = C.expected_grads(spec, static, dtype, arrays, cots)
    C.check_grads(spec, grads, exact, lowp, grad_atol, f"sharded {case.id}")


# ---- shard_map -----------------------------------------------------------------------------------


def _shard_map_setup(spec, cpu_devices, rng):
  case = spec.shard_map
  mesh = oracle.mesh_4x2(cpu_devices, "auto")
  inputs = spec.make(rng, case.example)
  arrays, static = inputs.arrays, inputs.static
  in_specs = {k: case.in_specs.get(k, P()) for k in arrays}
  return case, mesh, arrays, static, in_specs


def test_shard_map(spec, host_implementation, cpu_devices, rng):
  """Inside shard_map: the forward pass (its per-shard results vary over the mesh axes the
  arguments are split over) and the gradient of the shard_map, against the oracle."""
  case, mesh, arrays, static, in_specs = _shard_map_setup(spec, cpu_devices, rng)
  names = list(arrays)
  f = C.op_fn(spec, host_implementation, static)
  axes = C.mesh_axes(in_specs.values())

  def body(*xs):
    outs = f(dict(zip(names, xs)))
    for o in outs:
      assert oracle.varying_axes(jax.typeof(o)) == axes, jax.typeof(o)
    return outs

  sm = shard_map(body, mesh=mesh, in_specs=tuple(in_specs.values()), out_specs=case.out_specs)
  smf = lambda a: sm(*[a[n] for n in names])
  outs = jax.jit(smf)(arrays)
  dtype = C.op_dtype(arrays)
  exact, lowp = C.expected_outputs(spec, static, dtype, arrays)
  cots = C.make_cotangents(rng, C.output_avals(spec, C.Inputs(arrays, static)))
  out_atol, grad_atol = C.atols(spec, static, [(arrays, cots, outs)])
  C.check_outputs(spec, outs, exact, lowp, out_atol, "shard_map")
  if not spec.differentiable:
    return
  grads, _ = jax.jit(C.grad_fn(spec, smf))(arrays, cots)
  exact, lowp = C.expected_grads(spec, static, dtype, arrays, cots)
  C.check_grads(spec, grads, exact, lowp, grad_atol, "grad of shard_map")


def test_grad_inside_shard_map(spec, check_vma, host_implementation, cpu_devices, rng):
  """jax.grad inside shard_map. check_vma=True (the default): the gradient of a replicated
  (invariant) argument is already summed over the shards, as for any JAX function;
  check_vma=False: per-shard partial gradients, which the caller sums over the mesh axes
  the argument is not split over."""
  case, mesh, arrays, static, in_specs = _shard_map_setup(spec, cpu_devices, rng)
  names = list(arrays)
  f = C.op_fn(spec, host_implementation, static)
  cots = C.make_cotangents(rng, C.output_avals(spec, C.Inputs(arrays, static)))
  diff = [k for k in names if k in spec.diff_args]
  every = C.mesh_axes(in_specs.values())

  def body(*xs):
    a = dict(zip(names, xs[:len(names)]))
    grads, _ = C.grad_fn(spec, f)(a, xs[len(names):])
    out = []
    for k in diff:
      g = grads[k]
      missing = tuple(sorted(every - C.mesh_axes([in_specs[k]])))
      if not check_vma and missing:
        g = jax.lax.psum(g, missing)
      out.append(g)
    return tuple(out)

  sm = shard_map(body, mesh=mesh, in_specs=tuple(in_specs.values()) + tuple(case.out_specs),
                 out_specs=tuple(in_specs[k] for k in diff), check_vma=check_vma)
  got = dict(zip(diff, jax.jit(sm)(*arrays.values(), *cots)))
  outs = C.op_fn(spec, host_implementation, static)(arrays)
  exact, lowp = C.expected_grads(spec, static, C.op_dtype(arrays), arrays, cots)
  _, grad_atol = C.atols(spec, static, [(arrays, cots, outs)])
  C.check_grads(spec, got, exact, lowp, grad_atol,
                f"grad inside shard_map (check_vma={check_vma})")


def test_shard_map_outputs_are_varying(spec, host_implementation, cpu_devices, rng):
  """A per-shard result varies over the mesh axes: returning it as replicated
  (out_specs=P()) is refused, as for plain JAX, never one shard returned silently."""
  case, mesh, arrays, static, in_specs = _shard_map_setup(spec, cpu_devices, rng)
  names = list(arrays)
  f = C.op_fn(spec, host_implementation, static)
  sm = shard_map(lambda *xs: f(dict(zip(names, xs))), mesh=mesh,
                 in_specs=tuple(in_specs.values()), out_specs=(P(),) * len(case.out_specs))
  with pytest.raises(ValueError, match="out_specs|vary"):
    jax.jit(sm)(*arrays.values())


# ---- pmap ----------------------------------------------------------------------------------------


def test_pmap(spec, host_implementation, cpu_devices, rng):
  """pmap over 4 CPU devices: the forward pass and per-device gradients, against the vmap
  of the oracle (pmap over devices is vmap over examples)."""
  case = spec.pmap
  inputs = C.batched_inputs(spec, rng, case)
  arrays, static = inputs.arrays, inputs.static
  names = list(arrays)
  devices = cpu_devices[:C.PMAP_DEVICES]
  f = C.op_fn(spec, host_implementation, static)
  outs = C.vmapped(f, names, case, mapper=jax.pmap, devices=devices)(*arrays.values())
  vm = lambda f: lambda a: C.vmapped(f, names, case)(*[a[n] for n in names])
  exact, lowp = C.expected(spec, vm, static, case.example.dtype, arrays,
                           cache_as=("vmap",) + _vmap_key(case, names))
  indices = list(C.example_indices(case))
  out_atol, _ = C.atols(spec, static, [
      (C.take_example(arrays, case, i), None, tuple(np.asarray(o)[i] for o in outs))
      for i in indices])
  C.check_outputs(spec, outs, exact, lowp, out_atol, "pmap")
  if not spec.differentiable:
    return
  one = C.output_avals(spec, spec.make(rng, case.example))
  cots = C.make_cotangents(rng, one, lead=case.level_sizes())
  g = lambda a, c: C.grad_fn(spec, f)(a, c)
  grads, outs = C.vmapped(g, names, case, extra=1, mapper=jax.pmap, devices=devices)(
      *arrays.values(), cots)
  per_ex = lambda f: lambda a, c: C.vmapped(lambda a, c: C.grad_fn(spec, f)(a, c)[0], names,
                                            case, extra=1)(*[a[n] for n in names], c)
  exact, lowp = C.expected(spec, per_ex, static, case.example.dtype, arrays, cots,
                           cache_as=(True,) + _vmap_key(case, names))
  _, grad_atol = C.atols(spec, static, [
      (C.take_example(arrays, case, i), tuple(np.asarray(c)[i] for c in cots),
       tuple(np.asarray(o)[i] for o in outs)) for i in indices])
  C.check_grads(spec, grads, exact, lowp, grad_atol, "pmap grad")
