"""Helpers of the Gemma model tests: random parameters that exercise every path, and a
reader of the collectives in a compiled HLO module (kind, operand shapes, device groups)."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import HAS_CUDA
from jaxgpu.models import gemma
from jaxgpu.models.gemma import layers


# The kernel implementation of this machine: the CUDA kernels (gpu marker) or the CPU ones.
KERNELS = [pytest.param(None, marks=pytest.mark.gpu, id="cuda")] if HAS_CUDA else ["cpu"]
KERNEL_IMPL = None if HAS_CUDA else "cpu"  # the same, as a plain value
# The model's own threshold, before kernels_at_every_size sets it to 0.
XLA_FUSES_UP_TO_TOKENS = layers.XLA_FUSES_UP_TO_TOKENS


@pytest.fixture(autouse=True)
def exact_matmuls():
  """float32 matmuls in float32: on an H100, XLA's default float32 dot is TF32 (about 1e-3
  relative), which would swamp the float32 tolerances these tests compare at. Test modules
  import this fixture, which makes it apply to each of their tests."""
  with jax.default_matmul_precision("highest"):
    yield


@pytest.fixture(autouse=True)
def kernels_at_every_size(monkeypatch):
  """Under the default implementation the model leaves a small step's norms, RoPE and gated
  unit to XLA (layers.XLA_FUSES_UP_TO_TOKENS); the tests' steps are all small, so they set
  the threshold to 0 and check those kernels inside the model too. Imported like
  exact_matmuls; a test of the threshold itself sets it back."""
  monkeypatch.setattr(layers, "XLA_FUSES_UP_TO_TOKENS", 0)


def random_params(config, seed: int, dtype=jnp.float32, qk_gain: float = 3.0,
                  embed_std: float = 0.4):
  """Parameters far from HF's init (whose norm weights are all 0 and whose logits are
  nearly uniform): matrices normal with std 1/sqrt(fan in) (q and k times qk_gain, so the
  attention logits are large enough for Gemma 2's softcap to matter), the embedding with
  std embed_std (0.4: logits of a few units; generation tests take 0.05, where the
  embedding, which is also the output projection, no longer makes the model repeat its
  input token), norm weights normal with std 0.3 (so (1 + w) is not 1)."""
  rng = np.random.default_rng(seed)

  def make(name, shape):
    if len(shape) == 1:
      a = 0.3 * rng.standard_normal(shape)
    elif name == "embed":
      a = embed_std * rng.standard_normal(shape)
    else:
      fan_in = shape[0] * shape[1] if name == "o" else shape[0]
      gain = qk_gain if name in ("q", "k") else 1.0
      a = gain / np.sqrt(fan_in) * rng.standard_normal(shape)
    return jnp.asarray(a, jnp.float32).astype(dtype)

  shapes = gemma.param_shapes(config)
  return {"embed": make("embed", shapes["embed"]),
          "final_norm": make("final_norm", shapes["final_norm"]),
          "layers": [{name: make(name, shape) for name, shape in layer.items()}
                     for layer in shapes["layers"]]}


def cast(tree, dtype):
  return jax.tree.map(lambda a: a.astype(dtype), tree)


def max_abs(a, b) -> float:
  return float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))


# ---- collectives of a compiled HLO module ---------------------------------------------------

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
         "collective-broadcast", "ragged-all-to-all")


@dataclasses.dataclass(frozen=True)
class Collective:
  kind: str
  shapes: tuple          # the result's array shapes (several for a combined all-reduce)
  groups: frozenset      # frozenset of frozensets of device (partition) ids, or None
  line: str


def _iota(spec: str, count: int) -> np.ndarray:
  """'[4,2]T(1,0)' (or '[8]') -> the device ids it lists, in order."""
  m = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", spec)
  if not m:
    raise ValueError(f"unknown iota device list {spec!r}")
  dims = [int(x) for x in m.group(1).split(",")]
  ids = np.arange(int(np.prod(dims))).reshape(dims)
  if m.group(2):
    ids = ids.transpose([int(x) for x in m.group(2).split(",")])
  ids = ids.reshape(-1)
  assert ids.size == count, spec
  return ids


def _groups(line: str):
  """The device groups of a collective's replica_groups, in any of HLO's three spellings."""
  m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
  if m:
    return frozenset(frozenset(int(x) for x in g.split(",") if x)
                     for g in re.findall(r"\{([\d,]*)\}", m.group(1)))
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=(\[[\d,]+\](?:T\([\d,]+\))?)", line)
  if m:
    g, s = int(m.group(1)), int(m.group(2))
    ids = _iota(m.group(3), g * s).reshape(g, s)
    return frozenset(frozenset(int(x) for x in row) for row in ids)
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]"
                r"(?:, device_ids=\((\[[\d,]+\](?:T\([\d,]+\))?)\))? \{([^}]*)\}", line)
  if m:
    axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
    names = [a for a, _ in axes]
    sizes = [int(s) for _, s in axes]
    count = int(np.prod(sizes))
    ids = _iota(m.group(2), count) if m.group(2) else np.arange(count)
    ids = ids.reshape(sizes)
    over = re.findall(r"'([^']+)'", m.group(3))
    if any(a not in names for a in over):
      raise ValueError(f"unknown mesh axes in replica_groups: {line[:300]}")
    inner = [names.index(a) for a in over]
    outer = [i for i in range(len(names)) if i not in inner]
    ids = ids.transpose(outer + inner).reshape(-1, int(np.prod([sizes[i] for i in inner])))
    return frozenset(frozenset(int(x) for x in row) for row in ids)
  if "replica_groups={}" in line or "replica_groups" not in line:
    return None
  raise ValueError(f"unknown replica_groups: {line[:300]}")


def collectives(hlo_text: str) -> list[Collective]:
  """Every collective of a compiled HLO module (the async '-start' forms once)."""
  out = []
  for line in hlo_text.splitlines():
    if " = " not in line:
      continue
    rhs = " " + line.split(" = ", 1)[1]
    for kind in KINDS:
      m = re.search(rf"\s{kind}(?:-start)?\(", rhs)
      if m:
        shapes = tuple(tuple(int(x) for x in dims.split(",") if x)
                       for dims in re.findall(r"\w+\[([\d,]*)\]", rhs[:m.start()]))
        out.append(Collective(kind, shapes, _groups(line), line.strip()))
        break
  return out


def mesh_groups(mesh, axis: str) -> frozenset:
  """The device-id groups of a collective over mesh axis `axis` (ids are positions in the
  mesh's flattened device order, as HLO numbers the partitions)."""
  names = list(mesh.axis_names)
  ids = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
  i = names.index(axis)
  ids = np.moveaxis(ids, i, -1).reshape(-1, mesh.devices.shape[i])
  return frozenset(frozenset(int(x) for x in row) for row in ids)
