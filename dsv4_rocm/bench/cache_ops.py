"""Benchmarks of the memory-bound cache-writing ops (HIP kernels): achieved bytes/s against the copy
bandwidth measured in the same run. Bytes counted once each: inputs read + outputs written."""
import torch

from .. import layout as L
from ..reference.rope import build_cos_sin_cache


def cases(device, T=16384):
    g = torch.Generator(device=device).manual_seed(0)
    k = torch.randn(T, 512, device=device, generator=g).bfloat16()
    nb = T // 64 + 1
    cache = torch.zeros(nb, L.page_bytes(64), dtype=torch.uint8, device=device)
    slots = torch.randperm(nb * 64, device=device, generator=g)[:T]
    H = 64
    q = torch.randn(T, H, 512, device=device, generator=g).bfloat16()
    cs = build_cos_sin_cache(10000.0, 65536, device=device)
    pos = torch.randint(0, 65536, (T,), device=device, generator=g)
    qr = torch.randn(T, 1024 + 512, device=device, generator=g).bfloat16()
    qw = torch.ones(1024, device=device).bfloat16()
    kw = torch.ones(512, device=device).bfloat16()
    from .. import hip_ops as h
    return [
        (f"quantize_and_insert_k_cache T={T}", lambda: h.quantize_and_insert_k_cache(k, cache, slots, 64),
         T * (1024 + 8 + 584)),
        (f"fused_qnorm_rope_kv_insert T={T} h=64", lambda: h.fused_qnorm_rope_kv_rope_quant_insert(
            q, k, cache, slots, pos, cs, 64, 1e-6, 64),
         T * (H * 1024 * 2 + 1024 + 8 + 8 + 584 + 256)),
        (f"fused_q_kv_rmsnorm T={T}", lambda: h.fused_q_kv_rmsnorm(qr[:, :1024], qr[:, 1024:], qw, kw, 1e-6),
         T * 1536 * 2 * 2),
        (f"dequantize_and_gather T={T}", lambda: h.dequantize_and_gather_k_cache(cache, slots, 64),
         T * (584 + 8 + 1024)),
    ]


def suite(ctx):
    from .timing import time_graph_ms
    for T in (16384, 65536):
        for name, fn, nbytes in cases(ctx.device, T):
            if ctx.wants(name) or ctx.wants("cache"):
                ctx.add(name, "hip", time_graph_ms(fn), 0, nbytes)
