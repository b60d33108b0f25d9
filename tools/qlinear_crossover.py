"""Where jaxgpu.linear with a QuantizedWeight should switch from the fused kernel to the
dequantize + cuBLASLt route (jaxgpu.ops.matmul.DENSE_FROM_ROWS), measured.

For each weight shape, bits and rows M it times, in one process on the GPU: the fused
kernel (forced), the dense route (forced: the dequantizing copy, then the bf16 GEMM), the
dequantizing copy alone (with its write rate), and XLA's bf16 `x @ w`. Prints one line per
case; the route is read at trace time, so each variant gets its own jit.

    python3 tools/qlinear_crossover.py                      # 8192 x 28672 and 28672 x 8192
    python3 tools/qlinear_crossover.py --rows 64,128,256 --weights 8192x28672
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxgpu  # noqa: E402
from benchlib import timing  # noqa: E402
from jaxgpu.ops import matmul as matmul_op  # noqa: E402


def _jit_with_route(fn, dense_from_rows: int):
  """A jitted fn traced with DENSE_FROM_ROWS set (the route is chosen at trace time); 0
  forces the dense route on a Hopper GPU too (whose wgmma kernel otherwise serves every M)."""
  jitted = jax.jit(fn)

  def call(*args):
    saved = matmul_op.DENSE_FROM_ROWS, matmul_op._wgmma_serves
    matmul_op.DENSE_FROM_ROWS = dense_from_rows
    if dense_from_rows == 0:
      matmul_op._wgmma_serves = lambda cfg, qw: False
    try:
      return jitted(*args)
    finally:
      matmul_op.DENSE_FROM_ROWS, matmul_op._wgmma_serves = saved
  return call


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--weights", default="8192x28672,28672x8192")
  p.add_argument("--rows", default="32,64,96,128,192,256,512,4096")
  p.add_argument("--bits", default="4,8")
  args = p.parse_args(argv)
  cfg = timing.TimingConfig(repeats=5, target_s=0.03)
  print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}; times in us")
  for shape in args.weights.split(","):
    k, n = (int(v) for v in shape.split("x"))
    key = jax.random.PRNGKey(0)
    w = (jax.random.normal(key, (k, n), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
    for bits in (int(b) for b in args.bits.split(",")):
      qw = jax.jit(lambda w, bits=bits: jaxgpu.quantize_weight(
          w, bits=bits, group_size=128 if bits == 4 else None, symmetric=bits == 8))(w)
      dq_cfg = matmul_op._Config("cuda", None, False, quantized=(bits, qw.group_size, k, n))
      dequant = jax.jit(lambda qw: matmul_op._dequantized(dq_cfg, qw, jnp.bfloat16))
      t = timing.time_fn(dequant, [(qw,)], cfg).median_s
      print(f"{k}x{n} int{bits} dequantize {t * 1e6:8.1f} us  "
            f"({(qw.nbytes + k * n * 2) / t / 1e9:6.0f} GB/s read + written)", flush=True)
      for m in (int(r) for r in args.rows.split(",")):
        x = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.bfloat16)
        fns = {
            "kernel": _jit_with_route(lambda x, q=qw: jaxgpu.linear(x, q), 1 << 30),
            "dense": _jit_with_route(lambda x, q=qw: jaxgpu.linear(x, q), 0),
            "bf16": jax.jit(lambda x: x @ w),
        }
        ts = {name: r.median_s * 1e6 for name, r in timing.time_fns(fns, [(x,)], cfg).items()}
        best = min(("kernel", "dense"), key=ts.get)
        print(f"{k}x{n} int{bits} M={m:<5} kernel {ts['kernel']:8.1f}  dense {ts['dense']:8.1f}"
              f"  bf16 {ts['bf16']:8.1f}  -> {best} ({ts['bf16'] / ts[best]:.2f}x bf16)",
              flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
