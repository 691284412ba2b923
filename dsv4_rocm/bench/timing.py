"""Device timing and the two ceilings every result is measured against (METHOD: measure them in the run)."""
import torch


def time_ms(fn, warmup_ms: float = 25, rep_ms: float = 200) -> float:
    """Median device time of fn() in ms (CUDA/HIP events via triton.testing.do_bench)."""
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def time_graph_ms(fn, rep_ms: float = 200) -> float:
    """Median time of fn() replayed from a captured CUDA/HIP graph: launch gaps and Python overhead
    stay out, as in a serving engine that captures its decode steps."""
    import triton.testing
    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))


def copy_bandwidth(device, nbytes: int = 2 << 30) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written."""
    a = torch.empty(nbytes // 2, dtype=torch.uint8, device=device).random_()
    b = torch.empty_like(a)
    ms = time_ms(lambda: b.copy_(a))
    return 2 * a.numel() / (ms * 1e-3)


def bf16_matmul_rate(device, n: int = 8192) -> float:
    """FLOP/s of an n^3 bf16 matmul on random data."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b)
    return 2 * n ** 3 / (ms * 1e-3)
