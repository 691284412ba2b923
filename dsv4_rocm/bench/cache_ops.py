"""Benchmarks of the memory-bound cache and Q/KV ops in vLLM's call forms (graph-timed: they run inside
the decode step), against the copy bandwidth measured in the same run. Bytes are counted once each:
every input read (rows, index entries, cos/sin rows used) plus every output written (rows, records)."""
import torch

from .. import ops
from ..reference.rope import build_cos_sin_cache

H, HP = 64, 64          # V4-Flash local heads, padded for FlashMLA
CS_ROW = 64 * 4         # bytes of one fp32 cos/sin row


def _tokens(device, T, g):
    q = torch.randn(T, H, 512, device=device, generator=g).bfloat16()
    kv = torch.randn(T, 512, device=device, generator=g).bfloat16()
    pos = torch.randint(0, 65536, (T,), device=device, generator=g)
    return q, kv, pos


def cases(device, T):
    """(name, fn, bytes) for T tokens (decode: T = batch; prefill: T = batched tokens)."""
    g = torch.Generator(device=device).manual_seed(0)
    q, kv, pos = _tokens(device, T, g)
    nb = T // 64 + 2
    cache = torch.zeros(nb, 64, 584, dtype=torch.uint8, device=device)       # vLLM's SWA cache
    cache2d = cache.view(nb, -1)
    slots = torch.randperm(nb * 64, device=device, generator=g)[:T]
    cs = build_cos_sin_cache(10000.0, 65536, device=device)
    q_out = torch.empty(T, HP, 512, dtype=torch.bfloat16, device=device)
    qr_kv = torch.randn(T, 1024 + 512, device=device, generator=g).bfloat16()
    qw, kw = torch.ones(1024, device=device).bfloat16(), torch.ones(512, device=device).bfloat16()
    # prefill gather: T rows from requests of 2048 tokens, the window of each (gather 2048 = whole request)
    R = max(T // 2048, 1)
    seq = torch.full((R,), min(T, 2048), dtype=torch.int32, device=device)
    bt = torch.randint(0, nb, (R, (int(seq[0]) + 63) // 64), dtype=torch.int32, device=device, generator=g)
    gathered = torch.empty(R, int(seq[0]), 512, dtype=torch.bfloat16, device=device)
    # decode SWA rows: 128 window slots per decode token (int32 ids), at most 1024 tokens
    K, Td = 128, min(T, 1024)
    ids = torch.randint(0, nb * 64, (Td, K), dtype=torch.int32, device=device, generator=g)
    rows = torch.empty(Td, K, 512, dtype=torch.bfloat16, device=device)
    full = torch.zeros(nb, 64, 512, dtype=torch.float8_e4m3fn, device=device)
    q8 = torch.empty(T, H, 512, dtype=torch.float8_e4m3fn, device=device)
    one = torch.ones(1, device=device)
    n_rows = R * int(seq[0])
    return [
        (f"quantize_and_insert_k_cache T={T}", lambda: ops.quantize_and_insert_k_cache(kv, cache2d, slots, 64),
         T * (1024 + 8 + 584)),
        (f"fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert_out T={T} h={H}",
         lambda: ops.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert_out(q, kv, q_out, cache2d, slots, pos, cs, HP,
                                                                           1e-6, 64),
         T * (H * 1024 + 1024 + 8 + 8 + CS_ROW + HP * 1024 + 584)),
        (f"fused_q_kv_rmsnorm T={T}", lambda: ops.fused_q_kv_rmsnorm(qr_kv[:, :1024], qr_kv[:, 1024:], qw, kw, 1e-6),
         T * 1536 * 2 * 2),
        (f"dequantize_and_gather_k_cache rows={n_rows}",
         lambda: ops.dequantize_and_gather_k_cache(gathered, cache, seq, seq, bt, 64, 0),
         n_rows * (584 + 1024) + bt.numel() * 4),
        (f"dequantize_global_slots_k_cache T={Td} K={K}",
         lambda: ops.dequantize_global_slots_k_cache(rows, cache, ids, 64), Td * K * (4 + 584 + 1024)),
        (f"qnorm_rope_and_insert_full_k_cache T={T} h={H}",
         lambda: ops.qnorm_rope_and_insert_full_k_cache(q, kv, full, slots, pos, cs, 1e-6, 64, one, q8, one),
         T * (H * 1024 + 1024 + 8 + 8 + CS_ROW + H * 512 + 512)),
    ]


def suite(ctx):
    from .timing import time_graph_ms
    for T in (128, 16384):
        for name, fn, nbytes in cases(ctx.device, T):
            if ctx.wants(name, "cache"):
                ctx.add(name, "hip", time_graph_ms(fn), 0, nbytes)
