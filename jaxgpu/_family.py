"""Family metadata: which public ops each op family defines, and their FFI targets.

Every `jaxgpu/ops/<family>.py` declares one `FAMILY = Family(...)` that lists its public ops
and, for each op, the literal names of its FFI targets by pass (so that grep finds every
target from Python to `ffi/<family>/<family>_targets.h`). The CLI (`python -m jaxgpu info`,
`bench`), the package tests and the shared contract tests read the declarations from here;
nothing else spells a target name.

A pass is a name the family chooses: 'fwd' and 'bwd' for most ops; a GEMM has 'fwd',
'dgrad' and 'wgrad'; a forward-only op (decode attention) has 'fwd', and 'fwd_q8' for the
target its 8-bit cache calls, and declares `differentiable=False`.
"""

from __future__ import annotations

import dataclasses
import importlib
from types import MappingProxyType
from collections.abc import Mapping

from jaxgpu import _ffi

# The op families, by module name under jaxgpu/ops (and folder under ffi/, tests/test_<name>.py,
# benchmarks/bench_<name>.py). A new family adds its name here.
FAMILY_NAMES = ("activation", "attention", "cross_entropy", "decode", "linear_cross_entropy",
                "matmul", "norm", "rope", "softmax")


@dataclasses.dataclass(frozen=True)
class Op:
  """One public op: its name in `jaxgpu` and its FFI targets, {pass: target name}."""

  name: str
  targets: Mapping[str, str]
  differentiable: bool = True

  def __post_init__(self):
    if not self.targets:
      raise ValueError(f"op {self.name}: no FFI targets")
    for pass_, target in self.targets.items():
      if not target.startswith("jaxgpu_"):
        raise ValueError(f"op {self.name}: target {target!r} of pass {pass_!r} must start "
                         f"with 'jaxgpu_'")
    object.__setattr__(self, "targets", MappingProxyType(dict(self.targets)))

  def target(self, pass_: str, implementation: str | None) -> str:
    """The target to call for `pass_`: platform-generic for implementation None, else the
    one registered for that platform only (see _ffi.target_name)."""
    try:
      base = self.targets[pass_]
    except KeyError:
      raise ValueError(f"op {self.name} has no pass {pass_!r}; it has "
                       f"{tuple(self.targets)}") from None
    return _ffi.target_name(base, implementation)


@dataclasses.dataclass(frozen=True)
class Family:
  """An op family: `ffi/<name>/`, `jaxgpu/ops/<name>.py`, `tests/test_<name>.py`,
  `benchmarks/bench_<name>.py`."""

  name: str
  ops: tuple[Op, ...]

  def op(self, name: str) -> Op:
    for o in self.ops:
      if o.name == name:
        return o
    raise KeyError(f"family {self.name} has no op {name!r}")

  @property
  def targets(self) -> frozenset[str]:
    return frozenset(t for o in self.ops for t in o.targets.values())


def families() -> tuple[Family, ...]:
  """Every family's declaration, in FAMILY_NAMES order (imports jaxgpu.ops.<name>)."""
  out = []
  for name in FAMILY_NAMES:
    family = importlib.import_module(f"jaxgpu.ops.{name}").FAMILY
    if family.name != name:
      raise RuntimeError(f"jaxgpu.ops.{name}.FAMILY is named {family.name!r}")
    out.append(family)
  return tuple(out)


def all_ops() -> dict[str, tuple[Family, Op]]:
  """{public op name: (family, op)} over every family."""
  return {o.name: (f, o) for f in families() for o in f.ops}


def all_targets() -> frozenset[str]:
  """Every FFI target name any family declares (without platform suffixes)."""
  return frozenset().union(*(f.targets for f in families()))


def export_disabled_checks() -> list:
  """The `jax.export.DisabledSafetyCheck`s that let jax.export serialize jaxgpu's custom
  calls: one per target name, each platform's included (an explicit implementation='cpu'
  lowers to `<target>_cpu`)::

    exported = jax.export.export(jax.jit(f), platforms=("cpu", "cuda"),
                                 disabled_checks=jaxgpu.export_disabled_checks())(*args)

  jax.export refuses custom calls it does not know, because their behaviour is not part of
  jax's own compatibility promise; jaxgpu's is in the README ("Serialized programs"). A
  program deserialized in another process runs there once `import jaxgpu` has registered
  the targets.
  """
  import jax.export  # noqa: PLC0415 (jax.export is not imported by `import jax` on 0.10)

  names = sorted(n for base in all_targets() for n in _ffi.platform_target_names(base))
  return [jax.export.DisabledSafetyCheck.custom_call(n) for n in names]
