"""Runs serialized jaxgpu programs in a process that imported nothing of jaxgpu's but the
package itself: what a user's deployment does with a jax.export artifact.

  python tests/fresh_process.py DIR [CACHE_DIR]

DIR holds `<name>.jaxexport` (Exported.serialize()) and `<name>.args.npz` (the leaves of its
(args, kwargs), written by `save_arrays`). Each program is deserialized, called, and its
output leaves written to `<name>.out.npz`. With CACHE_DIR, jax's persistent compilation
cache is read from there (every entry, whatever its compile time), and `<name>.hits` records
how many cache hits the program's compilation made: a process that compiled the same program
into CACHE_DIR before must give at least one. Errors are written to `<name>.error`, and the
others still run: one subprocess serves every op of a test module.

Run by tests/contract.py (test_contract.py's session fixture) and tests/test_export.py.
"""

from __future__ import annotations

import pathlib
import sys
import traceback

import jax
import jax.export
import numpy as np

import jaxgpu  # noqa: F401  (registers every FFI target: the one thing a deployment needs)


def save_arrays(path, leaves) -> None:
  """Arrays of any dtype (bfloat16, float8 included: numpy's npz knows them only as raw
  bytes) as an npz that `load_arrays` reads back exactly."""
  leaves = [np.asarray(a) for a in leaves]
  np.savez(path, **{f"leaf_{i}": a.view(np.uint8) if a.ndim else a.reshape(1).view(np.uint8)
                    for i, a in enumerate(leaves)},
           **{f"meta_{i}": np.array([a.dtype.name] + [str(n) for n in a.shape])
              for i, a in enumerate(leaves)})


def load_arrays(path) -> list:
  with np.load(path) as data:
    count = sum(k.startswith("leaf_") for k in data.files)
    out = []
    for i in range(count):
      dtype, *shape = data[f"meta_{i}"].tolist()
      out.append(data[f"leaf_{i}"].view(jax.numpy.dtype(dtype)).reshape(
          tuple(int(n) for n in shape)))
  return out


def _hits_counter():
  hits = [0]

  def listener(event, **_):
    if event == "/jax/compilation_cache/cache_hits":
      hits[0] += 1

  jax.monitoring.register_event_listener(listener)
  return hits


def main(argv):
  folder = pathlib.Path(argv[1])
  cache = argv[2] if len(argv) > 2 else None
  if cache:
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  hits = _hits_counter()
  for path in sorted(folder.glob("*.jaxexport")):
    name = path.name[:-len(".jaxexport")]
    try:
      exported = jax.export.deserialize(bytearray(path.read_bytes()))
      args, kwargs = jax.tree.unflatten(exported.in_tree,
                                        load_arrays(folder / f"{name}.args.npz"))
      before = hits[0]
      outs = jax.tree.leaves(exported.call(*args, **kwargs))
      save_arrays(folder / f"{name}.out.npz", outs)
      (folder / f"{name}.hits").write_text(str(hits[0] - before))
    except Exception:  # noqa: BLE001 (reported per program; the rest still run)
      (folder / f"{name}.error").write_text(traceback.format_exc())


if __name__ == "__main__":
  main(sys.argv)
