"""Benchmark the matmul family: jaxgpu.linear (cuBLASLt with epilogues) and the weight-only
quantized linear, against XLA in the same run.

    python3 benchmarks/bench_matmul.py                 # GPU: writes results/
    python3 benchmarks/bench_matmul.py --out $OUT      # also writes $OUT/<gpu>.json, RESULTS.md
    python3 benchmarks/bench_matmul.py --quick --no-write   # CPU smoke test: cpu vs xla
    python3 benchmarks/bench_matmul.py --parts dense        # only the dense cases

Dense (bf16; op 'linear'; anchor 'xla' = the same math as a JAX user writes it in bf16,
`x @ w` or `jax.nn.gelu(x @ w + b)`: XLA's GEMM and its fusions). (M, K, N) in 8192^3,
8192 x 2304 x 9216 and 8192 x 4096 x 14336, each plain (no bias, no activation) and with
bias + tanh gelu, forward ('fwd') and forward + backward ('fwdbwd': y and the vjp of all
three arguments; y is returned so that the forward GEMM is never dead code). TFLOP/s count
2MKN forward, 6MKN forward + backward. Targets: bias + gelu costs <= 1.05x XLA's plain GEMM
(forward), >= 1.2x XLA's bias + gelu forward and >= 1.4x its forward + backward at
8192 x 2304 x 9216 (out of reach: docs/perf/matmul.md); plain >= 0.98x XLA everywhere.

Quantized (op 'qlinear', anchor 'xla' = the bf16 GEMM `x @ w` of the same shape): weights
K x N = 8192 x 28672 and 28672 x 8192 at M = 1, 4, 16, 64, 128, 256, 4096 rows:
  cuda-int4   jaxgpu.linear with quantize_weight(bits=4, group_size=128) (asymmetric)
  cuda-int8   bits=8, one scale per column (symmetric)
  xla-int8    `(x @ w_int8.astype(bf16)) * scale` left to XLA (the route without jaxgpu;
              at M = 1, 16 and 4096)
GB/s = the weight's bytes (packed values, scales, zero points; bf16 for xla) + x + y over
the time: next to the copy rate measured in the same run. Targets: int4 >= 3.5x bf16 at
M = 1 and >= 3.0x at M = 16, int8 >= 1.85x at M <= 16, neither slower than bf16 at any M.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, also under `python -P`

import harness  # noqa: E402
from benchlib import inputs  # noqa: E402

FAMILY = "matmul"
ANCHOR = "xla"
DENSE_SHAPES = ((8192, 8192, 8192), (8192, 2304, 9216), (8192, 4096, 14336))
QUICK_DENSE = ((64, 96, 80),)
WEIGHTS = ((8192, 28672), (28672, 8192))
QUICK_WEIGHTS = ((256, 128),)
ROWS = (1, 4, 16, 64, 128, 256, 4096)
QUICK_ROWS = (1, 16)

TARGET_EPILOGUE_VS_GEMM = 1 / 1.05
TARGET_GELU_FWD = 1.2
TARGET_GELU_FWDBWD = 1.4
TARGET_PLAIN = 0.98
TARGET_INT4 = {1: 3.5, 16: 3.0}
TARGET_INT8 = 1.85


def _dense(bench: harness.Bench, kernel: str) -> None:
  import jax
  import jax.numpy as jnp

  import jaxgpu

  key = jax.random.PRNGKey(0)
  for m, k, n in QUICK_DENSE if bench.quick else DENSE_SHAPES:
    kx, kw, kb, kd = jax.random.split(key, 4)
    x = inputs.random_array(kx, (m, k), jnp.bfloat16)
    w = inputs.random_array(kw, (k, n), jnp.bfloat16) * (k ** -0.5)
    b = inputs.random_array(kb, (n,), jnp.bfloat16)
    dy = inputs.random_array(kd, (m, n), jnp.bfloat16)
    plain_xla = {}
    for variant, bias, act in (("plain", None, None), ("bias-gelu", b, "gelu")):
      def f(impl, bias=bias, act=act):
        if impl == ANCHOR:  # what a JAX user writes: XLA's GEMM and its fusions, in bf16
          if bias is None:
            return lambda x, w, b: x @ w
          return lambda x, w, b: jax.nn.gelu(x @ w + b, approximate=True)
        return lambda x, w, b: jaxgpu.linear(x, w, b if bias is not None else None,
                                             activation=act, implementation=impl)
      label = f"{m}x{k}x{n}-{variant}"
      for pass_ in ("fwd", "fwdbwd"):
        fns = {}
        for impl in (kernel, ANCHOR):
          fwd = f(impl)
          if pass_ == "fwd":
            fns[impl] = jax.jit(fwd)
          else:
            # y is returned with the gradients, as a training step uses it: with only the
            # gradients returned, XLA drops a plain linear's forward GEMM as dead code.
            fns[impl] = jax.jit(lambda x, w, b, dy, fwd=fwd: _with_grads(fwd, x, w, b, dy))
        args = (x, w, b) if pass_ == "fwd" else (x, w, b, dy)
        ok = bench.runnable(f"linear {label} {pass_}", fns, args)
        flops = (2 if pass_ == "fwd" else 6) * m * k * n
        recs = bench.run_case(op="linear", case=label, pass_=pass_, shape=(m, k, n),
                              dtype=jnp.bfloat16, fns=ok, arg_sets=[args], anchor=ANCHOR,
                              flops=flops)
        _mark_dense(bench, recs, kernel, variant, pass_, (m, k, n), plain_xla)
        _progress(recs)


def _with_grads(fwd, x, w, b, dy):
  import jax

  y, vjp = jax.vjp(fwd, x, w, b)
  return y, vjp(dy)


def _progress(recs) -> None:
  for r in recs:
    print(f"  {r.op} {r.case} {r.pass_} {r.implementation}: {r.time_us:.1f} us"
          + (f" {r.vs_anchor:.2f}x" if r.vs_anchor else ""), flush=True)


def _mark_dense(bench, recs, kernel, variant, pass_, shape, plain_xla) -> None:
  by = {r.implementation: r for r in recs}
  if ANCHOR in by and variant == "plain":
    plain_xla[pass_] = by[ANCHOR].time_us
  if not bench.on_gpu or kernel not in by:
    return
  r = by[kernel]
  if variant == "plain":
    r.target, r.target_met = f">= {TARGET_PLAIN}x xla", (r.vs_anchor or 0) >= TARGET_PLAIN
    return
  base = plain_xla.get(pass_)
  if base:
    r.notes = f"{r.time_us / base:.3f}x xla's plain GEMM"
  checks = []
  if pass_ == "fwd":
    checks.append(("<= 1.05x xla's plain GEMM",
                   base is not None and base / r.time_us >= TARGET_EPILOGUE_VS_GEMM))
  if shape == (8192, 2304, 9216):
    want = TARGET_GELU_FWD if pass_ == "fwd" else TARGET_GELU_FWDBWD
    checks.append((f">= {want}x xla", (r.vs_anchor or 0) >= want))
  if checks:
    r.target = ", ".join(c for c, _ in checks)
    r.target_met = all(ok for _, ok in checks)


def _quantized(bench: harness.Bench, kernel: str) -> None:
  import jax
  import jax.numpy as jnp

  import jaxgpu

  key = jax.random.PRNGKey(1)
  for k, n in QUICK_WEIGHTS if bench.quick else WEIGHTS:
    kw, kx = jax.random.split(key)
    w = inputs.random_array(kw, (k, n), jnp.bfloat16) * (k ** -0.5)
    q4 = jax.jit(lambda w: jaxgpu.quantize_weight(w, bits=4, group_size=128))(w)
    q8 = jax.jit(lambda w: jaxgpu.quantize_weight(w, bits=8, group_size=None,
                                                  symmetric=True))(w)
    w8 = jax.lax.bitcast_convert_type(
        (jaxgpu.reference.matmul.unpack(q8.packed, 8, k, n) - 128).astype(jnp.int8), jnp.int8)
    s8 = q8.scales
    weight_bytes = {f"{kernel}-int4": q4.nbytes, f"{kernel}-int8": q8.nbytes,
                    ANCHOR: k * n * 2, "xla-int8": k * n + n * 2}
    for m in bench.args.rows or (QUICK_ROWS if bench.quick else ROWS):
      x = inputs.random_array(jax.random.fold_in(kx, m), (m, k), jnp.bfloat16)
      fns = {
          f"{kernel}-int4": jax.jit(lambda x, q=q4: jaxgpu.linear(x, q, implementation=kernel)),
          f"{kernel}-int8": jax.jit(lambda x, q=q8: jaxgpu.linear(x, q, implementation=kernel)),
          ANCHOR: jax.jit(lambda x: x @ w),
      }
      if m in (1, 16, 4096):  # the route without jaxgpu, at a few sizes (compile time)
        fns["xla-int8"] = jax.jit(lambda x: (x @ w8.astype(jnp.bfloat16)) * s8)
      label = f"{k}x{n}m{m}"
      ok = bench.runnable(f"qlinear {label}", fns, (x,))
      recs = bench.run_case(op="qlinear", case=label, pass_="fwd", shape=(m, k, n),
                            dtype=jnp.bfloat16, fns=ok, arg_sets=[(x,)], anchor=ANCHOR,
                            flops=2 * m * k * n)
      io = (m * k + m * n) * 2
      for r in recs:
        r.bytes = weight_bytes[r.implementation] + io
        r.gbs = r.bytes / (r.time_us * 1e-6) / 1e9
        if bench.ceiling_gbs:
          r.pct_ceiling = 100.0 * r.gbs / bench.ceiling_gbs
        _mark_quantized(bench, r, kernel, m)
      _progress(recs)


def _mark_quantized(bench, r, kernel, m) -> None:
  if not bench.on_gpu or not r.implementation.startswith(kernel):
    return
  want = 1.0
  if r.implementation.endswith("int4") and m in TARGET_INT4:
    want = TARGET_INT4[m]
  elif r.implementation.endswith("int8") and m <= 16:
    want = TARGET_INT8
  r.target = f">= {want}x bf16"
  r.target_met = (r.vs_anchor or 0) >= want


# --parts: each part's cases and the ops its records carry.
PARTS = {"dense": (_dense, ("linear",)), "quantized": (_quantized, ("qlinear",))}


def run(bench: harness.Bench) -> None:
  kernel = "cuda" if bench.on_gpu else "cpu"
  if not bench.args.repeats and not bench.quick:
    bench.config.repeats = 5
  parts = bench.args.parts.split(",")
  for part in parts:
    if part not in PARTS:
      raise SystemExit(f"--parts: unknown part {part!r}; parts: {list(PARTS)}")
  # The parts not run keep their earlier records in results/ (tagged with their own commit).
  bench.keep_ops = tuple(op for part, (_, ops) in PARTS.items() if part not in parts for op in ops)
  for part in parts:
    PARTS[part][0](bench, kernel)


def _extend(p) -> None:
  p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {list(PARTS)}")
  p.add_argument("--rows", type=lambda s: tuple(int(v) for v in s.split(",")), default=None,
                 help=f"the quantized part's M, comma-separated (default {ROWS})")


if __name__ == "__main__":
  sys.exit(harness.main(FAMILY, run, description=__doc__.splitlines()[0], extend_parser=_extend))
