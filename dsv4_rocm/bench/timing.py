"""Device timing and the two ceilings every result is measured against (METHOD: measure them in the run)."""
import functools
import time

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


@functools.lru_cache(maxsize=None)
def fp8_matmul_rate(device, n: int = 8192) -> float:
    """FLOP/s of an n^3 e4m3 x e4m3 -> bf16 ``torch._scaled_mm`` on random data (fnuz e4m3 on gfx942),
    measured once per device and process: the ceiling of the fp8 matrix ops."""
    from ..platform import detect
    dt = torch.float8_e4m3fnuz if detect(device).arch == "gfx942" else torch.float8_e4m3fn
    a = torch.randn(n, n, device=device).to(dt)
    b = torch.randn(n, n, device=device).to(dt).t()
    one = torch.ones((), device=device)
    ms = time_ms(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    return 2 * n ** 3 / (ms * 1e-3)


def bf16_matmul_rate(device, n: int = 8192) -> float:
    """FLOP/s of an n^3 bf16 matmul on random data."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b)
    return 2 * n ** 3 / (ms * 1e-3)


@functools.lru_cache(maxsize=None)
def _call_marker():
    import triton

    @triton.jit
    def _bench_call_marker(x):
        pass
    return _bench_call_marker


def gpu_span_us(fn, reps: int = 20) -> float:
    """Median GPU span of one eager call of fn(), in us: from the start of its first kernel to the end of
    its last, the GPU idle before the call. Host time before the first launch is not in it; host time
    between two launches of one call is (the GPU waits for the second)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    marker = _call_marker()
    x = torch.empty(1, device="cuda")
    fn()
    marker[(1,)](x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            marker[(1,)](x)
            torch.cuda.synchronize()
            fn()
            torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    spans, group = [], None
    for e in kernels:
        if e.name == "_bench_call_marker":
            if group:
                spans.append(max(g.time_range.end for g in group) - min(g.time_range.start for g in group))
            group = []
        elif group is not None:
            group.append(e)
    if group:
        spans.append(max(g.time_range.end for g in group) - min(g.time_range.start for g in group))
    spans.sort()
    return float(spans[len(spans) // 2]) if spans else float("nan")


def host_us_per_call(fn, reps: int = 200) -> float:
    """Host (Python) time of one call of fn(), in us: calls issued back to back without waiting for the GPU
    (the GPU must keep up: use it on small calls), the wall time divided by the count."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / reps * 1e6
