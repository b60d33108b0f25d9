"""The transform contract every public op meets, and the spec each op declares for it.

An `OpSpec` says how to call one public op (`jaxgpu.<name>`, its FFI targets read from
jaxgpu._family), how to make its arguments, which of them are differentiated, how its
results are checked, and its tables: vmap in_axes, sharding layouts on the (4, 2) mesh,
shard_map and pmap layouts, bad inputs, size-0 shapes. tests/specs/<family>.py declare the
specs (SPECS: every op of every family), tests/test_contract.py runs every case of every
spec, and tests/test_<family>.py keep only their numerics and semantics.

Checking a transformed call: the same transform is applied to the spec's oracle (jnp, in
float64 under oracle.x64()) and to its low-precision reference, so vmap, pmap, shard_map
and sharded calls are all held to the 2x rule of tests/oracle.py against the plain
function's float64 values. A family's extra rounding atol is computed per example (the
spec's `atol` sees one unbatched example) and the largest is used.

A forward-only op (its family declares differentiable=False) has no diff_args: no gradient
case is generated for it, and test_grad_refused checks that jax.grad refuses it.

Arguments are dicts {parameter name: array} in the op's order; the op is called with them
as keywords. Results are tuples (an op returning one array gives a 1-tuple), named by
`OpSpec.outputs`. Every result gets a random cotangent, exactly representable in its dtype.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import pathlib
import re
import subprocess
import sys
from typing import Any
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxgpu
from jaxgpu import _family

import fresh_process
import oracle

DTYPE_IDS = {jnp.dtype(jnp.float32): "f32", jnp.dtype(jnp.bfloat16): "bf16",
             jnp.dtype(jnp.float16): "f16"}
VMAP_SIZE = 3       # each vmapped axis, unless a case says otherwise
PMAP_DEVICES = 4    # pmap runs over the first 4 of the 8 CPU devices


def dtype_id(dtype) -> str:
  return DTYPE_IDS[jnp.dtype(dtype)]


# ---- what a spec declares ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Inputs:
  """One call's arguments: arrays {parameter: array} in the op's order, and the static
  keyword arguments (options)."""

  arrays: dict
  static: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class VmapCase:
  """vmap over `in_axes`, one {argument: axis} per vmap level, outermost first (arguments
  not named are not batched at that level). `example` is the family's description of one
  unbatched example (spec.make builds it; it has a `.dtype`); every batched argument gets
  fresh values for each batch entry. modes: 'fwd' vmap(f); 'grad' vmap(grad f) (per-example
  gradients); 'grad_of' grad(vmap f) (a shared argument's gradient sums over the batch)."""

  id: str
  example: Any
  in_axes: tuple
  modes: frozenset = frozenset({"fwd", "grad"})
  sizes: tuple | None = None      # the size of each level; VMAP_SIZE by default

  def level_sizes(self) -> tuple:
    return self.sizes if self.sizes is not None else (VMAP_SIZE,) * len(self.in_axes)


@dataclasses.dataclass(frozen=True)
class ShardingCase:
  """jit with arguments placed on the (4, 2) mesh ('a', 'b') by `in_specs` (arguments not
  named are replicated). fwd / bwd: the exact set of collectives the forward program / the
  gradient program contains (None: not checked). out_specs / grad_specs: the layout each
  output / gradient keeps (also read through jax.typeof on an Explicit mesh). gathers: the
  FFI kernels need a sharded dim whole, so their forward program has some collective."""

  id: str
  example: Any
  in_specs: dict
  fwd: frozenset | None = None
  bwd: frozenset | None = None
  out_specs: dict | None = None
  grad_specs: dict | None = None
  cot_specs: dict | None = None     # the cotangents' layout where out_specs is None
  gathers: bool = False
  kernels_only: bool = False        # fwd, bwd and the layouts hold for the FFI kernels only
  grad: bool = True
  axis_types: tuple = ("auto", "explicit")
  hlo_check: Callable | None = None   # (compiled HLO text) -> bool, both programs (as fwd)
  explicit_like: tuple = ()           # (output, argument): the same jax.typeof spec (Explicit)


@dataclasses.dataclass(frozen=True)
class ShardMapCase:
  """shard_map over the (4, 2) Auto mesh: in_specs per argument (others replicated), the
  outputs split by out_specs (one per output)."""

  example: Any
  in_specs: dict
  out_specs: tuple


@dataclasses.dataclass(frozen=True)
class BadInput:
  """The op called with build()'s keyword arguments raises `error` matching `match`, both
  eagerly and at trace time under jit (the array arguments traced)."""

  id: str
  build: Callable[[], dict]
  error: type
  match: str


@dataclasses.dataclass(frozen=True)
class OpSpec:
  """One public op's contract: see the module docstring."""

  name: str                     # jaxgpu.<name>, declared by a family in jaxgpu/ops/
  make: Callable                # (rng, example) -> Inputs
  example: Any                  # a small example for the cases with no table of their own
  array_args: tuple             # every array parameter of the op, in order
  diff_args: tuple              # those differentiated (a subset of array_args)
  # (arrays, static, dtype) -> tuple of outputs in jnp at the arrays' precision: the float64
  # oracle under oracle.x64() (dtype: the op's own input dtype, for roundings the op does
  # once in it), and, unless `lowp` is given, the low-precision reference (dtype None).
  oracle: Callable
  outputs: tuple = ("y",)
  lowp: Callable | None = None          # (arrays, static) -> tuple of outputs
  # (arrays as numpy, static, cotangents or None) -> (outputs, {argument: gradient} or None)
  # in float64 numpy: the oracle of the untransformed cases where jnp under x64 would cost a
  # compilation each (attention's analytic gradients).
  np_oracle: Callable | None = None
  # (one example's arrays as numpy, static, its cotangents or None, the op's outputs for
  # it) -> ({output: extra atol}, {argument: extra atol of its gradient}).
  atol: Callable | None = None
  grad_atol_ulps: float = 8.0
  grad_runs_forward: bool = True        # grad of a loss needs the forward target's results
  vmap: tuple = ()                      # VmapCase
  pmap: VmapCase | None = None          # one level of PMAP_DEVICES
  sharding: tuple = ()                  # ShardingCase
  shard_map: ShardMapCase | None = None
  bad_inputs: tuple = ()                # BadInput
  size_zero: tuple = ()                 # (id, example)
  # A variant of the op (its 8-bit cache, say) with a spec of its own: its name in test
  # ids, and the pass its forward lowers to.
  variant: str = ""
  fwd_pass: str = "fwd"
  # (the public function, **arrays and options) -> its outputs: how to call an op whose
  # arguments are not all arrays (a QuantizedWeight built from the spec's arrays); None
  # calls the function with the keywords as they are.
  call: Callable | None = None
  # The passes the gradient program lowers to besides the forward pass (None: every pass
  # the op declares).
  grad_passes: tuple | None = None

  @property
  def id(self) -> str:
    return f"{self.name}[{self.variant}]" if self.variant else self.name

  @property
  def op(self) -> _family.Op:
    return _family.all_ops()[self.name][1]

  @property
  def family(self) -> str:
    return _family.all_ops()[self.name][0].name

  @property
  def differentiable(self) -> bool:
    return self.op.differentiable

  def fn(self):
    return getattr(jaxgpu, self.name)

  def invoke(self, **kw):
    """The op called with keyword arguments (arrays and options), through `call`."""
    return self.fn()(**kw) if self.call is None else self.call(self.fn(), **kw)


# ---- calling the op and the references alike -----------------------------------------------------


def op_fn(spec: OpSpec, implementation, static: dict):
  """arrays -> tuple of outputs: the op under test."""
  def f(arrays):
    out = spec.invoke(**arrays, **static, implementation=implementation)
    return out if isinstance(out, tuple) else (out,)

  return f


def ref_fn(spec: OpSpec, static: dict, dtype=None):
  """arrays -> tuple of outputs: the low-precision reference (dtype None) or the oracle."""
  if dtype is None and spec.lowp is not None:
    return lambda a: tuple(spec.lowp(a, static))
  return lambda a: tuple(spec.oracle(a, static, dtype))


def op_dtype(arrays: dict):
  """The op's input dtype: that of its first floating argument."""
  for a in arrays.values():
    if jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating):
      return jnp.asarray(a).dtype
  raise ValueError("no floating argument")


def pair(outs: tuple, cots: tuple):
  """sum_i <outs_i, cots_i> in float32 (or wider): its gradient is one VJP."""
  total = 0.0
  for o, c in zip(outs, cots):
    acc = jnp.promote_types(o.dtype, jnp.float32)
    total = total + jnp.sum(o.astype(acc) * c.astype(acc))
  return total


def grad_fn(spec: OpSpec, f):
  """(arrays, cots) -> ({argument: gradient} over the differentiated ones, outputs)."""

  def g(arrays, cots):
    diff = {k: v for k, v in arrays.items() if k in spec.diff_args}

    def inner(d):
      outs = f({k: d.get(k, v) for k, v in arrays.items()})
      return pair(outs, cots), outs

    return jax.grad(inner, has_aux=True)(diff)

  return g


def to64(tree):
  """Floating arrays as float64 jax arrays, the rest as they are (call inside x64)."""

  def conv(a):
    a = np.asarray(a)
    if jnp.issubdtype(a.dtype, jnp.floating):
      return jnp.asarray(a.astype(np.float64))
    return jnp.asarray(a)

  return jax.tree.map(conv, tree)


def expected(spec: OpSpec, transform, static: dict, dtype, *args, cache_as=None):
  """(float64 oracle, low-precision reference) of transform(fn)(*args), fn the oracle.
  cache_as: a name for `transform` under which its jitted references are kept for the
  next test with the same op, options and dtype (x64 or not is part of jax's own cache
  key, and so are the shapes)."""
  lowp = _jitted(spec, transform, static, None, cache_as)(*args)
  with oracle.x64():
    exact = _jitted(spec, transform, static, dtype, cache_as)(*to64(args))
    exact = jax.tree.map(oracle.as_f64, exact)
  return exact, lowp


_JITTED = {}


def _jitted(spec: OpSpec, transform, static: dict, dtype, cache_as):
  make = lambda: jax.jit(transform(ref_fn(spec, static, dtype)))
  if cache_as is None:
    return make()
  key = (spec.id, cache_as, tuple(sorted(static.items())),
         None if dtype is None else jnp.dtype(dtype).name)
  try:
    hash(key)
  except TypeError:
    return make()
  if key not in _JITTED:
    _JITTED[key] = make()
  return _JITTED[key]


def _numpy(tree):
  return jax.tree.map(np.asarray, tree)


def expected_outputs(spec: OpSpec, static: dict, dtype, arrays: dict):
  """expected() of the plain call."""
  if spec.np_oracle is None:
    return expected(spec, lambda f: f, static, dtype, arrays, cache_as="outputs")
  lowp = _jitted(spec, lambda f: f, static, None, "outputs")(arrays)
  return spec.np_oracle(_numpy(arrays), static, None)[0], lowp


def expected_grads(spec: OpSpec, static: dict, dtype, arrays: dict, cots: tuple):
  """expected() of the gradients {argument: gradient} of <outputs, cots>."""
  transform = lambda f: lambda a, c: grad_fn(spec, f)(a, c)[0]
  if spec.np_oracle is None:
    return expected(spec, transform, static, dtype, arrays, cots, cache_as="grads")
  lowp = _jitted(spec, transform, static, None, "grads")(arrays, cots)
  return spec.np_oracle(_numpy(arrays), static, _numpy(cots))[1], lowp


def compiled(f, *args):
  """(f(*args), the compiled HLO text) from one compilation."""
  exe = jax.jit(f).lower(*args).compile()
  return exe(*args), exe.as_text()


def output_avals(spec: OpSpec, inputs: Inputs):
  return jax.eval_shape(op_fn(spec, "xla", inputs.static), inputs.arrays)


def make_cotangents(rng, avals, lead=()) -> tuple:
  """Random cotangents exactly representable in each output's dtype, as float32."""
  return tuple(oracle.randn(rng, tuple(lead) + a.shape, a.dtype).astype(jnp.float32)
               for a in avals)


def atols(spec: OpSpec, static: dict, examples, grad_scale=None) -> tuple[dict, dict]:
  """The spec's extra atols, the largest over examples [(arrays, cots, outputs)];
  grad_scale {argument: factor} for gradients that sum over several examples."""
  out_at, grad_at = {}, {}
  if spec.atol is None:
    return out_at, grad_at
  for arrays, cots, outs in examples:
    o, g = spec.atol({k: np.asarray(v) for k, v in arrays.items()}, static,
                     None if cots is None else tuple(np.asarray(c) for c in cots),
                     tuple(np.asarray(x) for x in outs))
    for k, v in o.items():
      out_at[k] = max(out_at.get(k, 0.0), v)
    for k, v in g.items():
      grad_at[k] = max(grad_at.get(k, 0.0), v)
  for k, s in (grad_scale or {}).items():
    if k in grad_at:
      grad_at[k] *= s
  return out_at, grad_at


def check_outputs(spec: OpSpec, got, exact, lowp, out_atol: dict, what: str):
  assert len(got) == len(exact), (what, len(got), len(exact))
  for name, g, e, r in zip(spec.outputs, got, exact, lowp):
    oracle.check(g, e, r, what=f"{spec.id} {what} {name}", extra_atol=out_atol.get(name, 0.0))


def check_grads(spec: OpSpec, got: dict, exact: dict, lowp: dict, grad_atol: dict, what: str):
  assert set(got) == set(exact), (what, set(got), set(exact))
  for k in got:
    oracle.check(got[k], exact[k], lowp[k], what=f"{spec.id} {what} d{k}",
                 atol_ulps=spec.grad_atol_ulps, extra_atol=grad_atol.get(k, 0.0))


def custom_call_targets(lowered) -> set[str]:
  """Custom-call targets of a jit(...).lower(...) after compilation (custom_partitioning
  only names its inner calls once partitioned)."""
  return set(re.findall(r'custom_call_target="([^"]+)"', lowered.compile().as_text()))


# ---- vmap: batched arguments and the examples they hold ------------------------------------------


def batched_inputs(spec: OpSpec, rng, case: VmapCase) -> Inputs:
  """The case's arguments with every vmap level's axes inserted, fresh values for every
  batch entry (spec.make called once per entry, so masks, labels or ids stay valid)."""
  base = spec.make(rng, case.example)
  sizes = case.level_sizes()

  def build(name, level):
    if level == len(case.in_axes):
      return spec.make(rng, case.example).arrays[name]
    axis = case.in_axes[level].get(name)
    if axis is None:
      return build(name, level + 1)
    parts = [build(name, level + 1) for _ in range(sizes[level])]
    return jnp.stack(parts, axis=axis % (parts[0].ndim + 1))

  arrays = {}
  for name, a in base.arrays.items():
    batched = any(name in lv for lv in case.in_axes)
    arrays[name] = build(name, 0) if batched else a
  return Inputs(arrays, base.static)


def example_indices(case: VmapCase):
  return itertools.product(*(range(s) for s in case.level_sizes()))


def take_example(arrays: dict, case: VmapCase, index) -> dict:
  """One example's arguments out of the batched ones."""
  out = {}
  for name, a in arrays.items():
    a = np.asarray(a)
    for level, i in enumerate(index):
      axis = case.in_axes[level].get(name)
      if axis is not None:
        a = np.take(a, i, axis=axis)
    out[name] = a
  return out


def vmapped(f, names, case: VmapCase, extra: int = 0, mapper=jax.vmap, **kw):
  """f(arrays dict, *extra) vmapped over case.in_axes, the extra arguments over axis 0:
  a function of (*arrays in `names` order, *extra). (Pass the arrays by name: a dict that
  went through jit comes back with its keys sorted.)"""
  h = lambda *xs: f(dict(zip(names, xs[:len(names)])), *xs[len(names):])
  for level in reversed(case.in_axes):
    h = mapper(h, in_axes=tuple(level.get(n) for n in names) + (0,) * extra, **kw)
  return h


def shared_factor(case: VmapCase, name) -> int:
  """How many examples a gradient of `name` sums over under grad(vmap): the sizes of the
  levels that do not batch it."""
  factor = 1
  for level, size in zip(case.in_axes, case.level_sizes()):
    if level.get(name) is None:
      factor *= size
  return factor


# ---- sharding helpers ----------------------------------------------------------------------------


def padded(spec, rank: int) -> tuple:
  spec = tuple(spec)
  return spec + (None,) * (rank - len(spec))


def put(mesh, arrays: dict, specs: dict) -> dict:
  return {k: jax.device_put(v, NamedSharding(mesh, specs.get(k, P()))) for k, v in
          arrays.items()}


def mesh_axes(specs) -> set:
  """The mesh axes a collection of PartitionSpecs names."""
  out = set()
  for s in specs:
    for entry in tuple(s):
      if entry is None:
        continue
      out.update(entry if isinstance(entry, tuple) else (entry,))
  return out


# ---- serialized programs in a fresh process ------------------------------------------------------


def export(f, *args, platforms=("cpu", "cuda")):
  """jax.export of jit(f) for `platforms`, with jaxgpu's custom calls allowed."""
  import jax.export  # noqa: PLC0415 (not imported by `import jax` on jax 0.10)

  return jax.export.export(jax.jit(f), platforms=platforms,
                           disabled_checks=jaxgpu.export_disabled_checks())(*args)


@contextlib.contextmanager
def persistent_cache(path):
  """jax's persistent compilation cache in `path` for the block, every entry written
  (whatever its compile time); the process's own settings (none, in the suite) after.
  jax sets its cache up once per process: reset_cache makes it read the settings again."""
  from jax._src import compilation_cache  # noqa: PLC0415

  names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
           "jax_persistent_cache_min_entry_size_bytes")
  old = {n: getattr(jax.config, n) for n in names}
  compilation_cache.reset_cache()
  jax.config.update(names[0], str(path))
  jax.config.update(names[1], 0)
  jax.config.update(names[2], 0)
  try:
    yield
  finally:
    for n, v in old.items():
      jax.config.update(n, v)
    compilation_cache.reset_cache()


@dataclasses.dataclass(frozen=True)
class FreshRun:
  """What tests/fresh_process.py gave for each program: its output leaves, its error (a
  traceback), and the persistent-cache hits its compilation made; and `here`, each
  program's output leaves from Exported.call in this process (with `cache`: the very
  executable the fresh process should have read from the cache)."""

  outputs: dict
  errors: dict
  hits: dict
  here: dict

  def result(self, name):
    """The program's output leaves; fails the test with the subprocess's traceback."""
    if name in self.errors:
      raise AssertionError(f"{name} in a fresh process:\n{self.errors[name]}")
    assert name in self.outputs, f"{name}: no output from the fresh process"
    return self.outputs[name]


def run_fresh(programs: dict, folder, cache: bool = True, timeout: float = 600) -> FreshRun:
  """Runs every program {name: (Exported, args tuple)} in ONE new process that imports
  only jaxgpu (tests/fresh_process.py). With `cache`, each program is first compiled here
  into a persistent compilation cache in `folder`, which the new process reads."""
  folder = pathlib.Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  cache_dir = folder / "compilation_cache"
  for name, (exported, args) in programs.items():
    (folder / f"{name}.jaxexport").write_bytes(exported.serialize())
    fresh_process.save_arrays(folder / f"{name}.args.npz", jax.tree.leaves((args, {})))
  here = {}
  with persistent_cache(cache_dir) if cache else contextlib.nullcontext():
    for name, (exported, args) in programs.items():
      here[name] = [np.asarray(o) for o in jax.tree.leaves(exported.call(*args))]
  script = pathlib.Path(__file__).with_name("fresh_process.py")
  cmd = [sys.executable, str(script), str(folder)] + ([str(cache_dir)] if cache else [])
  # From the test folder, not the source tree's root: `import jaxgpu` finds the installed
  # package, as a deployment would.
  # This process may hold most of a GPU's memory (jax preallocates 75% by default).
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  done = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True,
                        timeout=timeout)
  if done.returncode != 0:
    raise AssertionError(f"{cmd} failed ({done.returncode}):\n{done.stderr[-4000:]}")
  outputs, errors, hits = {}, {}, {}
  for name in programs:
    error = folder / f"{name}.error"
    if error.exists():
      errors[name] = error.read_text()
      continue
    outputs[name] = fresh_process.load_arrays(folder / f"{name}.out.npz")
    hits[name] = int((folder / f"{name}.hits").read_text())
  return FreshRun(outputs, errors, hits, here)
