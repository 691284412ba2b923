"""Lightning indexer benchmarks, V4-Flash shapes (64 index heads of 128 dims, indexer-K pages of 64 entries):

* paged logits (decode, graph-timed): b = 64 and 128 requests whose contexts hold 8K, 32K and 128K tokens on
  average (C4 entries = tokens / 4; each request 0.7x to 1.3x the average, as DeepGEMM's test draws them),
  next_n 1, and next_n 2 at 32K; vLLM's call (clean_logits=False);
* prefill logits (eager): a 4096-token chunk ending at position 65536 of one request, against its 16384
  C4 entries, causal ranges (vLLM's call: clean_logits=False);
* q quant (FP8 and MXFP4): decode b = 128 (graph-timed) and an 8192-token prefill chunk (eager);
* the indexer-K cache writer (decode, graph-timed) and the prefill gather of one 64K-token request.

Bytes, each counted once: paged logits read each request's cache entries it sees (132 B each: e4m3 row and
fp32 scale), its block-table entries, q, the weights and the context lengths, and write one fp32 logit per
visible key and row; prefill logits read q, the weights, the keys with their scales and the ranges, and
write the logits inside the ranges; the quantizers read their input rows and cos/sin rows and write their
outputs. FLOP: 2 * 64 * 128 per (row, visible key). The floor uses the copy bandwidth and the fp8 matmul
rate measured in this run; ``cache_floor`` is the time to read the cache bytes alone at that bandwidth over
the measured time (the paged target: >= 70%). With ``--sweep`` the b = 64, 32K case is also timed at
the tile configurations of SWEEP (config column: BN/num_warps/num_stages/programs per SM).
"""
import torch

from . import timing

from .. import layout as L
from ..reference.compressor import kv_cache_view
from ..reference.rope import build_cos_sin_cache

H, D, BS = 64, 128, 64
# --sweep: paged-logits tiles (BN, num_warps, num_stages, programs per SM) tried on the b=64, 32K case
SWEEP = [dict(BN=bn, num_warps=nw, num_stages=st, waves=wv) for bn, nw, st, wv in
         ((128, 8, 3, 8), (128, 8, 4, 8), (128, 8, 2, 8), (128, 8, 3, 4), (128, 8, 3, 16), (64, 4, 3, 8),
          (64, 4, 2, 16), (64, 8, 3, 8))]


def _paged_case(b, avg_tokens, next_n, device, g, gc):
    """g: a generator on device; gc: one on the CPU (context lengths and the page permutation)."""
    avg = avg_tokens // 4
    cl = torch.randint(int(0.7 * avg), int(1.3 * avg), (b,), generator=gc).to(torch.int32)
    need = (cl + BS - 1) // BS
    nb = int(need.sum()) + 1
    pages = torch.randint(0, 256, (nb, L.indexer_page_bytes(BS)), dtype=torch.uint8, device=device, generator=g)
    sc = pages[:, BS * D:BS * (D + 4)].view(torch.float32)
    sc.copy_(torch.exp2(torch.randint(-10, 0, sc.shape, device=device, generator=g).float()))
    pages[:, :BS * D] &= 0x77                                   # finite e4m3 bytes
    bt = torch.zeros(b, int(need.max()), dtype=torch.int32)
    perm = torch.randperm(nb, generator=gc).to(torch.int32)
    o = 0
    for i, k in enumerate(need.tolist()):
        bt[i, :k] = perm[o:o + k]
        o += k
    q = (torch.randint(0, 256, (b, next_n, H, D), dtype=torch.uint8, device=device, generator=g) & 0x77)
    w = torch.randn(b * next_n, H, device=device, generator=g)
    lens = cl.to(device)
    vis = (cl.unsqueeze(1) - next_n + 1 + torch.arange(next_n)).clamp(min=0)
    max_len = int(cl.max())
    args = (q.view(torch.float8_e4m3fn), kv_cache_view(pages, BS, L.INDEXER_TOKEN_BYTES), w, lens, bt.to(device))
    cache_bytes = int(cl.sum()) * L.INDEXER_TOKEN_BYTES
    nbytes = cache_bytes + int(need.sum()) * 4 + q.numel() + w.numel() * 4 + b * 4 + int(vis.sum()) * 4
    flop = 2 * H * D * int(vis.sum())
    return args, max_len, nbytes, flop, cache_bytes


def _prefill_case(device, g, M=4096, end=65536):
    N = end // 4
    q = (torch.randint(0, 256, (M, H, D), dtype=torch.uint8, device=device, generator=g) & 0x77)
    k = (torch.randint(0, 256, (N, D), dtype=torch.uint8, device=device, generator=g) & 0x77)
    ks = torch.exp2(torch.randint(-10, 0, (N,), device=device, generator=g).float())
    w = torch.randn(M, H, device=device, generator=g)
    pos = torch.arange(end - M, end, device=device)
    start = torch.zeros(M, dtype=torch.int32, device=device)
    stop = ((pos + 1) // 4).to(torch.int32)
    seen = int(stop.sum())
    nbytes = q.numel() + M * H * 4 + N * (D + 4) + M * 8 + seen * 4
    return (q.view(torch.float8_e4m3fn), (k.view(torch.float8_e4m3fn), ks), w, start, stop), nbytes, 2 * H * D * seen


def _q_case(T, device, g):
    qi = torch.randn(T, H, D, device=device, generator=g).bfloat16()
    w = torch.randn(T, H, device=device, generator=g).bfloat16()
    pos = torch.randint(0, 65536, (T,), device=device, generator=g)
    cs = build_cos_sin_cache(160000.0, 65536, device=device)
    read = T * H * D * 2 + T * H * 2 + T * 8 + T * 64 * 4
    return (pos, qi, cs, w, D ** -0.5, H ** -0.5), read


def suite(ctx):
    from .. import ops
    from ..triton.indexer import fp8_paged_mqa_logits as K
    from .timing import time_graph_ms, time_ms
    dev = ctx.device
    g = torch.Generator(device=dev).manual_seed(0)
    gc = torch.Generator().manual_seed(0)
    rate = timing.fp8_matmul_rate(str(dev)) if ctx.selects("indexer") or ctx.selects("logits") else 0.0
    with ops.use_backend("triton"):
        paged = [(b, t, 1) for b in (64, 128) for t in (8192, 32768, 131072)] + [(64, 32768, 2)]
        for b, tokens, nn in paged:
            name = f"indexer paged logits b={b} ctx={tokens // 1024}K next_n={nn}"
            if not ctx.wants(name, "indexer"):
                continue
            (q, kv, w, lens, bt), max_len, nbytes, flop, cache_bytes = _paged_case(b, tokens, nn, dev, g, gc)
            sms = torch.cuda.get_device_properties(dev).multi_processor_count
            meta = ops.get_paged_mqa_logits_metadata(lens, BS, sms)
            ms = time_graph_ms(lambda: ops.fp8_paged_mqa_logits(q, kv, w, lens, bt, meta, max_len, clean_logits=False))
            ctx.add(name, "triton", ms, flop, nbytes, rate=rate, cache_floor=cache_bytes / ctx.bw / (ms * 1e-3))
            if ctx.sweep and (b, tokens, nn) == (64, 32768, 1):
                for cfg in SWEEP:
                    ms = time_graph_ms(lambda: K.fp8_paged_mqa_logits(q, kv, w, lens, bt, meta, max_len, False,
                                                                      config=cfg))
                    label = "/".join(str(cfg[k]) for k in ("BN", "num_warps", "num_stages", "waves"))
                    ctx.add(name, label, ms, flop, nbytes, rate=rate,
                            cache_floor=cache_bytes / ctx.bw / (ms * 1e-3))
            del q, kv, w, lens, bt
        name = "indexer prefill logits 4096 x 16384"
        if ctx.wants(name, "indexer"):
            args, nbytes, flop = _prefill_case(dev, g)
            ms = time_ms(lambda: ops.fp8_mqa_logits(*args, clean_logits=False))
            ctx.add(name, "triton", ms, flop, nbytes, rate=rate)
        for T, decode in ((128, True), (8192, False)):
            for fp4 in (False, True):
                name = f"indexer q quant {'mxfp4' if fp4 else 'fp8'} T={T}"
                if not ctx.wants(name, "indexer"):
                    continue
                args, read = _q_case(T, dev, g)
                written = T * H * (D // 2 + 4 + 4) if fp4 else T * H * (D + 4)
                ms = (time_graph_ms if decode else time_ms)(lambda: ops.fused_indexer_q_rope_quant(*args, use_fp4=fp4))
                ctx.add(name, "triton", ms, 0, read + written)
        name = "indexer K insert b=128"
        if ctx.wants(name, "indexer"):
            k = torch.randn(128, D, device=dev, generator=g).bfloat16()
            pages = torch.zeros(64, L.indexer_page_bytes(BS), dtype=torch.uint8, device=dev)
            kv = kv_cache_view(pages, BS, L.INDEXER_TOKEN_BYTES)
            slots = torch.randperm(64 * BS, device=dev, generator=g)[:128]
            ms = time_graph_ms(lambda: ops.indexer_k_quant_and_cache(k, kv, slots, 128, "ue8m0"))
            ctx.add(name, "triton", ms, 0, 128 * (D * 2 + 8 + L.INDEXER_TOKEN_BYTES))
        name = "indexer K gather 16384 entries"
        if ctx.wants(name, "indexer"):
            n = 16384
            pages = torch.randint(0, 256, (n // BS + 1, L.indexer_page_bytes(BS)), dtype=torch.uint8, device=dev,
                                  generator=g)
            kv = kv_cache_view(pages, BS, L.INDEXER_TOKEN_BYTES)
            bt = torch.randperm(n // BS + 1, device=dev, generator=g).to(torch.int32)[None, :n // BS]
            cu = torch.tensor([0, n], dtype=torch.int32, device=dev)
            dk = torch.empty(n, D, dtype=torch.float8_e4m3fn, device=dev)
            ds = torch.empty(n, 4, dtype=torch.uint8, device=dev)
            ms = time_ms(lambda: ops.cp_gather_indexer_k_quant_cache(kv, dk, ds, bt, cu))
            ctx.add(name, "triton", ms, 0, 2 * n * L.INDEXER_TOKEN_BYTES + (n // BS) * 4)
