"""Sparse MLA benchmarks: the V4-Flash / V4-Pro decode cases, C128 decode, and prefill.

Counting per query token, as FlashMLA's ``count_flop_and_mem_vol_for_decode``:
    FLOP  = 2 * h * N * (512 + 512)           N = keys attended (SWA + compressed)
    bytes = N * 584 + h * 512 * 2 (q) + h * 512 * 2 (out)
floor = max(bytes / copy bandwidth, FLOP / bf16 matmul rate), both measured in the same run.
"""
import torch

from ..reference import cache as rc


def decode_cases():
    cases = []
    for b in (1, 32, 128, 256):
        cases.append((f"flash decode b={b} s_q=1", dict(b=b, s_q=1, h=64, topk=128, bs=256, etopk=512, ebs=64)))
    cases.append(("flash decode b=64 s_q=2", dict(b=64, s_q=2, h=64, topk=128, bs=256, etopk=512, ebs=64)))
    for b in (8, 64, 148):
        cases.append((f"pro decode b={b} s_q=2", dict(b=b, s_q=2, h=128, topk=128, bs=256, etopk=1024, ebs=64)))
    for b in (64, 256):
        cases.append((f"c128 decode b={b} s_q=1", dict(b=b, s_q=1, h=64, topk=128, bs=256, etopk=512, ebs=2)))
    cases.append(("paged prefill h=64 T=4096", dict(b=4096, s_q=1, h=64, topk=128, bs=256, etopk=512, ebs=64)))
    cases.append(("paged prefill h=128 T=4096", dict(b=4096, s_q=1, h=128, topk=128, bs=256, etopk=1024, ebs=64)))
    return cases


def _pool(num_tokens, bs, device, seed):
    """A cache of ``num_tokens`` slots with valid random records (made in chunks to bound memory)."""
    nb = -(-num_tokens // bs)
    pages = torch.empty(nb, rc.L.page_bytes(bs), dtype=torch.uint8, device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    step = max(1, (1 << 16) // bs)
    for a in range(0, nb, step):
        e = min(nb, a + step)
        k = (torch.randn((e - a) * bs, 512, device=device, generator=g)).bfloat16()
        rec = rc.encode_k_records(k)
        view = pages[a:e]
        view[:, :bs * 576] = rec[:, :576].reshape(e - a, bs * 576)
        view[:, bs * 576:bs * 584] = rec[:, 576:].reshape(e - a, bs * 8)
    return pages


def make_decode_inputs(c, device, pool_tokens=1 << 18, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    T = c["b"] * c["s_q"]
    main = _pool(pool_tokens, c["bs"], device, seed)
    extra = _pool(pool_tokens, c["ebs"], device, seed + 1)
    q = torch.randn(c["b"], c["s_q"], c["h"], 512, device=device, generator=g).bfloat16()
    idx = torch.randint(0, pool_tokens, (c["b"], c["s_q"], c["topk"]), device=device, generator=g).int()
    eidx = torch.randint(0, pool_tokens, (c["b"], c["s_q"], c["etopk"]), device=device, generator=g).int()
    lens = torch.full((c["b"],), c["topk"], dtype=torch.int32, device=device)
    elens = torch.full((c["b"],), c["etopk"], dtype=torch.int32, device=device)
    sink = torch.randn(c["h"], device=device, generator=g)
    return (q, rc.flash_mla_view(main, c["bs"]), idx, lens, sink, rc.flash_mla_view(extra, c["ebs"]), eidx, elens,
            512 ** -0.5), T


def count_decode(c):
    T = c["b"] * c["s_q"]
    n = c["topk"] + c["etopk"]
    flop = 2 * c["h"] * n * 1024 * T
    nbytes = (n * 584 + c["h"] * 512 * 4) * T
    return flop, nbytes


def prefill_cases():
    return [("prefill h=64 topk=640", dict(s_q=4096, s_kv=65536, h=64, topk=640)),
            ("prefill h=128 topk=1152", dict(s_q=4096, s_kv=65536, h=128, topk=1152))]


def make_prefill_inputs(c, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(c["s_q"], c["h"], 512, device=device, generator=g).bfloat16()
    kv = torch.randn(c["s_kv"], 1, 512, device=device, generator=g).bfloat16()
    idx = torch.randint(0, c["s_kv"], (c["s_q"], 1, c["topk"]), device=device, generator=g).int()
    return q, kv, idx


def count_prefill(c):
    flop = 2 * c["h"] * c["topk"] * 1024 * c["s_q"]
    nbytes = c["s_q"] * (c["topk"] * 1024 + c["h"] * 512 * 4)
    return flop, nbytes


SWEEP_DECODE = {          # tile sweeps of 2026-11-22 are in BENCHMARKS.md; this one tunes the split count
    "default": None,
    "waves2": dict(split_waves=2),
    "waves4": dict(split_waves=4),
}
SWEEP_PREFILL = {
    "default": None,
    "n32s2": dict(BLOCK_N=32, num_stages=2),
    "n64s3": dict(BLOCK_N=64, num_stages=3),
    "n64w16": dict(BLOCK_N=64, num_warps=16, num_stages=2),
}


def suite(ctx):
    from ..triton.sparse_mla_decode import sparse_mla_decode
    from ..triton.sparse_mla_prefill import sparse_mla_prefill
    from .timing import time_graph_ms, time_ms
    for name, c in decode_cases():
        if not ctx.wants(name):
            continue
        args, T = make_decode_inputs(c, ctx.device)
        flop, nbytes = count_decode(c)
        for cfg_name, cfg in (SWEEP_DECODE if ctx.sweep else {"default": None}).items():
            ms = time_graph_ms(lambda: sparse_mla_decode(*args, config=cfg))
            ctx.add(name, cfg_name, ms, flop, nbytes)
            if cfg_name == "default" and c["b"] <= 64:   # what a caller without graphs pays
                ctx.add(name, "eager", time_ms(lambda: sparse_mla_decode(*args)), flop, nbytes)
        del args
    for name, c in prefill_cases():
        if not ctx.wants(name):
            continue
        q, kv, idx = make_prefill_inputs(c, ctx.device)
        flop, nbytes = count_prefill(c)
        for cfg_name, cfg in (SWEEP_PREFILL if ctx.sweep else {"default": None}).items():
            ms = time_ms(lambda: sparse_mla_prefill(q, kv, idx, 512 ** -0.5, config=cfg))
            ctx.add(name, cfg_name, ms, flop, nbytes)
