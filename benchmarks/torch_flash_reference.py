"""torch's FlashAttention-2 (SDPA's FLASH_ATTENTION backend) on the same GPU, for the
comparison in docs/perf/attention.md: forward, backward and forward+backward TFLOP/s at the
shapes of bench_attention.py (bf16, B*T = 16k tokens), and the backward again under
torch.use_deterministic_algorithms(True), checking that its gradients are then bitwise
equal across two runs (they are not without it: dQ is summed with atomics).

    python3 benchmarks/torch_flash_reference.py      # on the GPU machine (its python3 has torch)

FLOPs as in bench_attention.py: 4*B*T*S*N*H forward (halved under the causal mask), the
backward 2.5x that. Times are CUDA-event means over 20 calls after 3 warm-ups.
"""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = [(128, 4096, False), (128, 4096, True), (64, 4096, False), (256, 4096, False)]


def mean_ms(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def bitwise_equal_grads(fwd_bwd):
    return all(torch.equal(a, b) for a, b in zip(fwd_bwd(), fwd_bwd()))


def main():
    print("torch", torch.__version__, torch.cuda.get_device_name())
    for h, t, causal in SHAPES:
        b, n = 16384 // t, (32 if h <= 128 else 16)
        q, k, v, do = (torch.randn(b, n, t, h, device="cuda", dtype=torch.bfloat16)
                       for _ in range(4))
        for x in (q, k, v):
            x.requires_grad_(True)
        flops = 4 * b * t * t * n * h / (2 if causal else 1)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            fwd_bwd = lambda: torch.autograd.grad(fwd(), (q, k, v), do)
            t_f, t_fb = mean_ms(fwd), mean_ms(fwd_bwd)
            row = dict(fwd=flops / t_f / 1e9, bwd=2.5 * flops / (t_fb - t_f) / 1e9,
                       fwd_bwd=3.5 * flops / t_fb / 1e9, bitwise=bitwise_equal_grads(fwd_bwd))
            torch.use_deterministic_algorithms(True)
            try:
                t_det = mean_ms(fwd_bwd)
                row.update(det_bwd=2.5 * flops / (t_det - t_f) / 1e9,
                           det_fwd_bwd=3.5 * flops / t_det / 1e9,
                           det_bitwise=bitwise_equal_grads(fwd_bwd))
            finally:
                torch.use_deterministic_algorithms(False)
        print(f"H={h} T={t} B={b} N={n} causal={causal}: " +
              " ".join(f"{key}={val:.0f}" if isinstance(val, float) else f"{key}={val}"
                       for key, val in row.items()), flush=True)


if __name__ == "__main__":
    main()
