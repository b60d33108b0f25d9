"""Device facts for the benchmarks: measured hardware ceilings, device names, run metadata."""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO_DIR = Path(__file__).resolve().parents[2]

# ---------------------------------------------------------------------------------------------
# Hardware ceilings.
#
# h100: measured on the `nvidia-h100-x1` device machine (NVIDIA H100 80GB HBM3, 132 SMs,
#   driver 580.159.04, jax 0.11.2), 2026-11-22, docs/design.md section 5:
#   - device copy about 3.0 TB/s counting read + write (the 3.35 TB/s spec-sheet figure is not
#     reachable by any kernel, so the measured copy is the honest 100%);
#   - bf16 8192^3 matmul about 800 TFLOP/s;
#   - L2 is 50 MB, so inputs are rotated until the rotated set exceeds 3x that.
# A device missing here falls back to the copy bandwidth measured in the same run
# (`measure_copy_bandwidth`) and a 50 MB L2.  Add a row only with a measured figure.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Ceiling:
  hbm_gbs: float | None  # device copy, read + write, GB/s (1 GB = 1e9 bytes)
  bf16_tflops: float | None
  l2_bytes: int
  source: str


CEILINGS: dict[str, Ceiling] = {
    "h100": Ceiling(hbm_gbs=3000.0, bf16_tflops=800.0, l2_bytes=50 * 2**20,
                    source="measured on nvidia-h100-x1, 2026-11-22 (docs/design.md section 5)"),
}
DEFAULT_L2_BYTES = 50 * 2**20  # H100/H200 L2; only used to size the rotated input set
ROTATE_FACTOR = 3  # rotated inputs must exceed 3x L2 (docs/design.md section 6)




def device_slug(device_kind: str) -> str:
  """Short file name for a device kind: 'NVIDIA H100 80GB HBM3' -> 'h100', 'cpu' -> 'cpu'."""
  kind = device_kind.lower()
  if kind == "cpu" or not kind:
    return "cpu"
  words = re.sub(r"[^a-z0-9]+", " ", kind).split()
  words = [w for w in words if w not in ("nvidia", "geforce", "tesla", "amd", "radeon")]
  # The first word with letters+digits is the model ("h100", "a100", "l40s", "mi300x"); the
  # memory size that follows it ("80gb") would otherwise win only by being longer.
  for w in words:
    if re.fullmatch(r"[a-z]+\d+[a-z]*", w):
      return w
  return "-".join(words) or "unknown"


def git_commit() -> str | None:
  """HEAD of the repo; JAXGPU_GIT_COMMIT wins because the GPU machine's copy has no .git."""
  if os.environ.get("JAXGPU_GIT_COMMIT"):
    return os.environ["JAXGPU_GIT_COMMIT"]
  try:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_DIR, capture_output=True,
                         text=True, timeout=10, check=True)
    commit = out.stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           cwd=REPO_DIR, capture_output=True, text=True, timeout=10)
    return commit + ("-dirty" if dirty.stdout.strip() else "")
  except (OSError, subprocess.SubprocessError):
    return None


def run_metadata() -> dict[str, Any]:
  import jax
  import jaxlib

  dev = jax.devices()[0]
  return {
      "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
      "commit": git_commit(),
      "jax": jax.__version__,
      "jaxlib": getattr(jaxlib, "__version__", None),
      "device_kind": dev.device_kind,
      "platform": dev.platform,
      "device_count": jax.device_count(),
      "python": sys.version.split()[0],
  }


def ceiling_for(slug: str) -> Ceiling | None:
  return CEILINGS.get(slug)
