"""The transform contract, run over every spec in tests/specs (every public op of every
family): custom-call targets, implementation selection, vmap, vmap of grad, grad of vmap,
jit on a sharded (4, 2) mesh, shard_map, pmap, bad inputs, size 0, numpy inputs; and the
compositions a model uses, one case per op on the platform's kernel: remat policies, scan
over layers, cond, fori_loop, donation, AOT, eval_shape, forward mode and grad of grad
(which run the reference), export round trip and the persistent compilation cache (every
op in ONE fresh process per run: the `fresh_runs` fixture). What each case means is in
tests/contract.py; each op's tables in tests/specs/<family>.py. Ids read
`test_vmap[rms_norm-x1-bf16-cpu]`: op, case, dtype, implementation.
"""

from __future__ import annotations

import warnings

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


def _kernel_params(specs):
  """(spec, the platform's kernel): the compositions below run one representative case per
  op, on the kernel ('cuda', gpu-marked, on a GPU machine; else 'cpu')."""
  kernel = (pytest.param("cuda", marks=pytest.mark.gpu, id="cuda") if HAS_CUDA
            else pytest.param("cpu", id="cpu"))
  return [pytest.param(s, kernel.values[0], id=f"{s.id}-{kernel.id}", marks=kernel.marks)
          for s in specs]


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
    "test_forward_mode": ("spec,kernel", lambda: _kernel_params(_DIFF)),
    "test_grad_of_grad": ("spec,kernel", lambda: _kernel_params(_DIFF)),
    "test_remat": ("spec,kernel,policy", lambda: [
        pytest.param(*p.values, pol, id=f"{p.id}-{pol}", marks=p.marks)
        for p in _kernel_params(_DIFF) for pol in _REMAT_POLICIES]),
    "test_scan_over_layers": ("spec,kernel,remat", lambda: [
        pytest.param(*p.values, r, id=f"{p.id}-{'remat' if r else 'plain'}", marks=p.marks)
        for p in _kernel_params(_ALL) for r in (False, True)]),
    "test_cond": ("spec,kernel", lambda: _kernel_params(_ALL)),
    "test_fori_loop": ("spec,kernel", lambda: _kernel_params(_ALL)),
    "test_donated_arguments": ("spec,kernel", lambda: _kernel_params(_ALL)),
    "test_aot_compile": ("spec,kernel", lambda: _kernel_params(_ALL)),
    "test_eval_shape": ("spec,kernel", lambda: _kernel_params(_ALL)),
    "test_export_round_trip": ("spec,kernel", lambda: _kernel_params(_ALL)),
    "test_persistent_cache_hit": ("spec,kernel", lambda: _kernel_params(_ALL)),
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


# ---- compositions a model uses: one representative case per op -----------------------------------
#
# Each runs the op's program (its outputs, and for a differentiable op the gradients of
# <outputs, random cotangents>) under one composition and compares it with the same program
# run plainly under jit: the kernels are deterministic, so only XLA's fusion of the code
# around them may move a result, by a few roundings (_close).

_REMAT_POLICIES = ("nothing_saveable", "everything_saveable", "dots_saveable",
                   "dots_with_no_batch_dims_saveable")


def _setup(spec, kernel, rng):
  """(op function, arrays, static, cotangents or None)."""
  inputs = spec.make(rng, spec.example)
  arrays, static = inputs.arrays, inputs.static
  cots = (C.make_cotangents(rng, C.output_avals(spec, inputs)) if spec.differentiable
          else None)
  return C.op_fn(spec, kernel, static), arrays, static, cots


def _program(spec, f, cots):
  """arrays -> (outputs, {argument: gradient}) ({} for a forward-only op), through f."""
  if not spec.differentiable:
    return lambda a: (f(a), {})
  return lambda a: tuple(reversed(C.grad_fn(spec, f)(a, cots)))


def _close(got, want, what):
  got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
  assert len(got_leaves) == len(want_leaves), what
  for g, w in zip(got_leaves, want_leaves):
    g, w = np.asarray(g), np.asarray(w)
    assert g.shape == w.shape and g.dtype == w.dtype, (what, g.shape, g.dtype, w.shape, w.dtype)
    if not jnp.issubdtype(w.dtype, jnp.inexact):
      np.testing.assert_array_equal(g, w, err_msg=what)
      continue
    g64, w64 = g.astype(np.float64), w.astype(np.float64)
    eps = float(jnp.finfo(w.dtype).eps)
    scale = float(np.max(np.abs(w64[np.isfinite(w64)]), initial=0.0))
    np.testing.assert_allclose(g64, w64, rtol=4 * eps, atol=4 * eps * scale, equal_nan=True,
                               err_msg=what)


def _plain(spec, f, arrays, cots):
  return jax.jit(_program(spec, f, cots))(arrays)


# ---- forward mode and second order: the reference (jaxgpu/_autodiff.py) -------------------------


def _diff_and_rest(spec, arrays):
  diff = {k: v for k, v in arrays.items() if k in spec.diff_args}
  return diff, {k: v for k, v in arrays.items() if k not in diff}


def test_forward_mode(spec, kernel, rng):
  """jax.jvp runs the op's reference (the kernels' custom_vjp has no forward mode): the
  same values as jvp of implementation='xla', and no kernel in the program. jvp of a
  function jit traced first cannot be rerouted: it raises (documented)."""
  f, arrays, static, _ = _setup(spec, kernel, rng)
  diff, rest = _diff_and_rest(spec, arrays)
  tangents = {k: oracle.randn(rng, v.shape, v.dtype) for k, v in diff.items()}
  jvp = lambda fn: jax.jit(lambda d, t: jax.jvp(lambda d: fn({**rest, **d}), (d,), (t,)))
  program = jvp(f)
  targets = C.custom_call_targets(program.lower(diff, tangents))
  assert not any(t.startswith("jaxgpu_") for t in targets), targets
  _close(program(diff, tangents), jvp(C.op_fn(spec, "xla", static))(diff, tangents),
         f"{spec.id} jvp")
  with pytest.raises(TypeError, match="forward-mode autodiff"):
    jax.jvp(jax.jit(lambda d: f({**rest, **d})), (diff,), (tangents,))


def test_grad_of_grad(spec, kernel, rng):
  """The gradient of <gradients, random directions>: second order runs the reference,
  as implementation='xla' does."""
  f, arrays, static, cots = _setup(spec, kernel, rng)
  diff, rest = _diff_and_rest(spec, arrays)
  directions = {k: oracle.randn(rng, v.shape, v.dtype) for k, v in diff.items()}

  def second(fn):
    def inner(d):
      grads, _ = C.grad_fn(spec, fn)({**rest, **d}, cots)
      return sum(jnp.sum(grads[k].astype(jnp.float32) * directions[k].astype(jnp.float32))
                 for k in grads)
    return jax.jit(jax.grad(inner))

  _close(second(f)(diff), second(C.op_fn(spec, "xla", static))(diff), f"{spec.id} grad of grad")


# ---- remat, control flow, donation, AOT, eval_shape ---------------------------------------------


def test_remat(spec, kernel, policy, rng):
  """jax.checkpoint with a policy from jax.checkpoint_policies around the op, under grad:
  the forward kernel runs again in the backward pass where nothing was saved."""
  f, arrays, _, cots = _setup(spec, kernel, rng)
  rematted = jax.checkpoint(f, policy=getattr(jax.checkpoint_policies, policy))
  got = jax.jit(_program(spec, rematted, cots))(arrays)
  _close(got, _plain(spec, f, arrays, cots), f"{spec.id} remat {policy}")


def _stack_layers(spec, rng, arrays):
  """Two layers' arguments stacked on a new leading axis: a second example where spec.make
  gives one of the same shapes and options, else the same arguments twice."""
  other = spec.make(rng, spec.example)
  if jax.tree.map(lambda a: (a.shape, a.dtype), other.arrays) != jax.tree.map(
      lambda a: (a.shape, a.dtype), arrays):
    other = C.Inputs(arrays)
  return [arrays, other.arrays]


def test_scan_over_layers(spec, kernel, remat, rng):
  """lax.scan over a stack of layers (the body jax.checkpoint-ed or not), as a model's
  layer loop: the loss summed over layers and its gradient with respect to every layer's
  arguments, against a Python loop over the layers."""
  f, arrays, _, cots = _setup(spec, kernel, rng)
  layers = _stack_layers(spec, rng, arrays)
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *layers)
  if not spec.differentiable:
    body = lambda carry, a: (carry, f(a))
    body = jax.checkpoint(body) if remat else body
    got = jax.jit(lambda s: jax.lax.scan(body, 0, s)[1])(stacked)
    want = jax.tree.map(lambda *o: jnp.stack(o), *[jax.jit(f)(a) for a in layers])
    _close(got, want, f"{spec.id} scan")
    return
  diff_names = [k for k in arrays if k in spec.diff_args]

  def loss(d, rest):
    def body(total, layer):
      return total + C.pair(f({**layer[1], **layer[0]}), cots), None
    body = jax.checkpoint(body) if remat else body
    return jax.lax.scan(body, jnp.float32(0), (d, rest))[0]

  d = {k: stacked[k] for k in diff_names}
  rest = {k: v for k, v in stacked.items() if k not in d}
  got = jax.jit(jax.value_and_grad(loss))(d, rest)
  per_layer = [_plain(spec, f, a, cots) for a in layers]
  total = sum(C.pair(outs, cots) for outs, _ in per_layer)
  # The sum of products with random cotangents cancels: bound its rounding by the sum of
  # the products' magnitudes.
  magnitude = sum(C.pair(tuple(jnp.abs(o) for o in outs), tuple(jnp.abs(c) for c in cots))
                  for outs, _ in per_layer)
  np.testing.assert_allclose(float(got[0]), float(total), rtol=0,
                             atol=1e-5 * float(magnitude) + 1e-30)
  grads = {k: jnp.stack([g[k] for _, g in per_layer]) for k in diff_names}
  _close(got[1], grads, f"{spec.id} scan grads")


def test_cond(spec, kernel, rng):
  """lax.cond with the op in one branch (zeros in the other), the predicate traced: both
  branches compiled, the gradient flows through the one taken."""
  f, arrays, _, cots = _setup(spec, kernel, rng)
  zeros = lambda a: jax.tree.map(jnp.zeros_like, f(a))
  program = jax.jit(lambda p, a: _program(spec, lambda a: jax.lax.cond(p, f, zeros, a),
                                          cots)(a))
  _close(program(True, arrays), _plain(spec, f, arrays, cots), f"{spec.id} cond taken")
  outs, grads = program(False, arrays)
  assert all(not np.any(np.asarray(o)) for o in jax.tree.leaves((outs, grads))), spec.id


def test_fori_loop(spec, kernel, rng):
  """lax.fori_loop with two iterations of the op (a fixed trip count, so reverse-mode
  differentiable): a differentiable op's outputs are summed, so results and gradients are
  exactly twice the plain ones; a forward-only op's are carried."""
  f, arrays, _, cots = _setup(spec, kernel, rng)
  if spec.differentiable:
    looped = lambda a: jax.lax.fori_loop(
        0, 2, lambda i, acc: jax.tree.map(jnp.add, acc, f(a)),
        jax.tree.map(jnp.zeros_like, jax.eval_shape(f, a)))
    outs, grads = jax.jit(_program(spec, looped, cots))(arrays)
    want_outs, want_grads = _plain(spec, f, arrays, cots)
    _close((outs, grads), jax.tree.map(lambda w: w + w, (want_outs, want_grads)),
           f"{spec.id} fori_loop")
    return
  looped = lambda a: jax.lax.fori_loop(0, 2, lambda i, acc: f(a), f(a))
  _close(jax.jit(looped)(arrays), jax.jit(f)(arrays), f"{spec.id} fori_loop")


def test_donated_arguments(spec, kernel, rng):
  """Every argument donated to jit: the same results. XLA may give a donated buffer to any
  output or temporary of the program (an in-place op's output aliases its cache), so a
  kernel that read an input after writing an output would show here."""
  f, arrays, _, cots = _setup(spec, kernel, rng)
  want = _plain(spec, f, arrays, cots)
  copies = jax.tree.map(lambda a: jnp.array(a, copy=True), arrays)
  with warnings.catch_warnings():
    # Buffers no output can take (an int table, say) are reported and left alone.
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    got = jax.jit(_program(spec, f, cots), donate_argnums=0)(copies)
  _close(got, want, f"{spec.id} donated")


def test_aot_compile(spec, kernel, rng):
  """jit(f).lower(shapes).compile() ahead of time from ShapeDtypeStructs (no arrays), then
  called: the program runs the op's kernels and gives the jit results."""
  f, arrays, _, cots = _setup(spec, kernel, rng)
  shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), arrays)
  compiled = jax.jit(_program(spec, f, cots)).lower(shapes).compile()
  assert spec.op.target(spec.fwd_pass, kernel) in compiled.as_text()
  _close(compiled(arrays), _plain(spec, f, arrays, cots), f"{spec.id} AOT")


def test_eval_shape(spec, kernel, rng):
  """jax.eval_shape of the program: the shapes and dtypes it returns when run."""
  f, arrays, _, cots = _setup(spec, kernel, rng)
  shapes = jax.eval_shape(_program(spec, f, cots), arrays)
  got = _plain(spec, f, arrays, cots)
  assert jax.tree.structure(shapes) == jax.tree.structure(got), spec.id
  for s, g in zip(jax.tree.leaves(shapes), jax.tree.leaves(got)):
    assert (s.shape, s.dtype) == (g.shape, g.dtype), (spec.id, s, g.shape, g.dtype)


# ---- serialized programs: ONE fresh process for every op -----------------------------------------


@pytest.fixture(scope="module")
def fresh_runs(tmp_path_factory):
  """Every op's program (implementation=None: the kernel of the platform), exported with
  jax.export for ("cpu", "cuda"), compiled here into a persistent compilation cache, and
  run in one fresh process that imports only jaxgpu and reads that cache
  (contract.run_fresh): {spec id: (arrays, this process's jit results)}, and the run."""
  seed = int(np.random.default_rng().integers(2**31))
  print(f"fresh_runs seed={seed}")
  rng = np.random.default_rng(seed)
  programs, here = {}, {}
  for i, spec in enumerate(_ALL):
    f, arrays, _, cots = _setup(spec, None, rng)
    program = _program(spec, f, cots)
    programs[f"op{i}"] = (C.export(program, arrays), (arrays,))
    here[spec.id] = (f"op{i}", jax.jit(program)(arrays))
  return here, C.run_fresh(programs, tmp_path_factory.mktemp("fresh_runs"))


def test_export_round_trip(spec, kernel, fresh_runs):
  """The op's program, deserialized and run in a process that only imported jaxgpu: the
  results of the same artifact called here, which are jit's (to a few roundings: XLA may
  fuse the code around the kernels differently in the exported module)."""
  here, run = fresh_runs
  name, want = here[spec.id]
  got = run.result(name)
  assert len(got) == len(jax.tree.leaves(want)), spec.id
  _close(got, run.here[name], f"{spec.id} export round trip")
  for g, w in zip(run.here[name], jax.tree.leaves(want)):
    w = np.asarray(w)
    if jnp.issubdtype(w.dtype, jnp.inexact):
      scale = float(np.max(np.abs(w.astype(np.float64)), initial=1.0))
      np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=2e-2,
                                 atol=2e-2 * scale, equal_nan=True, err_msg=spec.id)
    else:
      np.testing.assert_array_equal(g, w, err_msg=spec.id)


def test_persistent_cache_hit(spec, kernel, fresh_runs):
  """The fresh process found the program compiled by this one in the persistent
  compilation cache (its FFI custom calls serialize with the executable)."""
  here, run = fresh_runs
  name, _ = here[spec.id]
  run.result(name)
  assert run.hits[name] >= 1, (spec.id, run.hits[name])
