"""Compressor benchmarks: vLLM's two calls of one layer step (``save_partial_states`` then
``compress_norm_rope_store``) for a decode step of b = 128 requests (graph-timed) and a prefill chunk of
8192 tokens (4 requests x 2048), C4 / C128 main KV and the C4 indexer K (FP8 and MXFP4).

Bytes, each counted once: the state save reads kv and score (2 x H fp32 a token, H = coff * D) and writes
them (2 x H); the compress step reads, for each entry it produces, the halves of its window rows it uses
(coff * r rows x 2 x D fp32, which is each saved byte once) and writes the record (584 / 132 / 68 B); the
metadata (positions, slots, request ids, block-table rows) adds 28 B a token. The peer is the float
reference on the same tensors (eager: it is not graph-capturable)."""
from types import SimpleNamespace

import torch

from .. import layout as L
from ..reference import compressor as rc
from ..reference.rope import build_cos_sin_cache

RECORD = {"main": (576, 8, 64), "fp8": (128, 4, 128), "mxfp4": (64, 4, 32)}   # token stride, scale dim, block


def _step(ratio, target, ranges, device, seed=0):
    """Inputs of one step: ``ranges`` = (start, end) positions per request. Only the blocks a step touches
    (its tokens and the windows they close) are distinct; the rest of a block table names block 0, as
    vLLM's sliding-window state cache does once old blocks are freed."""
    g = torch.Generator(device=device).manual_seed(seed)
    D = 512 if target == "main" else 128
    c, sbs, W = rc.coff(ratio), rc.state_block_size(ratio), rc.window(ratio)
    B = len(ranges)
    cols = -(-max(e for _, e in ranges) // sbs)
    first = [max(0, a - W) // sbs for a, _ in ranges]
    live = [-(-e // sbs) - f for (_, e), f in zip(ranges, first)]
    ns = sum(live) + 1
    state = rc.new_state_cache(ns, ratio, D, device)
    state.normal_(generator=g)
    bt = torch.zeros(B, cols, dtype=torch.int32, device=device)
    perm = torch.randperm(ns - 1, generator=g, device=device).to(torch.int32) + 1
    o = 0
    for b in range(B):
        bt[b, first[b]:first[b] + live[b]] = perm[o:o + live[b]]
        o += live[b]
    pos = torch.cat([torch.arange(a, e, device=device) for a, e in ranges])
    req = torch.cat([torch.full((e - a,), b, dtype=torch.int32, device=device) for b, (a, e) in enumerate(ranges)])
    sslots = bt[req.long(), pos // sbs].long() * sbs + pos % sbs
    bs = 256 // ratio if target == "main" else 64
    n_entries = int(((pos + 1) % ratio == 0).sum())
    nb = -(-n_entries // bs) * 2 + 1
    ts, sd, qb = RECORD[target]
    pages = torch.zeros(nb, L.round_up(bs * (ts + sd), L.PAGE_ALIGN), dtype=torch.uint8, device=device)
    boundary = (pos + 1) % ratio == 0
    kslots = torch.where(boundary, torch.cumsum(boundary, 0) - 1, -1)   # entries packed into the first pages
    kv_score = torch.randn(pos.shape[0], 2 * c * D, device=device, generator=g)
    kv, score = kv_score.split([c * D, c * D], dim=-1)
    save = dict(kv=kv, score=score, ape=torch.randn(ratio, c * D, device=device, generator=g), positions=pos,
                state_cache=state, slot_mapping=sslots, block_size=sbs, state_width=c * D, compress_ratio=ratio)
    comp = dict(state_cache=state, num_actual=pos.shape[0], token_to_req_indices=req, positions=pos,
                slot_mapping=sslots, block_table=bt, block_size=sbs, state_width=c * D,
                cos_sin_cache=build_cos_sin_cache(160000.0, int(pos.max()) + 1, device=device),
                kv_cache=rc.kv_cache_view(pages, bs, ts + sd), k_cache_metadata=SimpleNamespace(slot_mapping=kslots),
                pdl_kwargs={}, head_dim=D, rope_head_dim=64, compress_ratio=ratio, overlap=ratio == 4,
                use_fp4_cache=target == "mxfp4", rms_norm_weight=torch.ones(D, dtype=torch.bfloat16, device=device),
                rms_norm_eps=1e-6, quant_block=qb, token_stride=ts, scale_dim=sd)
    T = pos.shape[0]
    nbytes = T * 2 * c * D * 4 * 2 + n_entries * (W * 2 * D * 4 + ts + sd) + T * 28
    return save, comp, nbytes, n_entries


def cases():
    out = []
    for ratio, target in ((4, "main"), (128, "main"), (4, "fp8"), (4, "mxfp4")):
        name = f"C{ratio} {'main' if target == 'main' else 'indexer ' + target}"
        ends = [65536 - ratio * i for i in range(128)]     # every decode token closes a window (the costly step)
        out.append((f"compressor decode {name} b=128", ratio, target, [(e - 1, e) for e in ends], True))
        out.append((f"compressor prefill {name} T=8192", ratio, target, [(0, 2048)] * 4, False))
    return out


def suite(ctx):
    from .. import ops
    from .timing import time_graph_ms, time_ms
    for name, ratio, target, ranges, decode in cases():
        if not (ctx.wants(name) or ctx.wants("compressor")):
            continue
        save, comp, nbytes, n_entries = _step(ratio, target, ranges, ctx.device)

        def run(backend):
            with ops.use_backend(backend):
                ops.save_partial_states(**save)
                ops.compress_norm_rope_store(**comp)
        with ops.use_backend("triton"):
            ms = (time_graph_ms if decode else time_ms)(lambda: run("triton"))
            save_ms = (time_graph_ms if decode else time_ms)(lambda: ops.save_partial_states(**save))
        peer_ms = time_ms(lambda: run("reference"))
        ctx.add(name, "triton", ms, 0, nbytes, peer="torch reference", peer_ms=peer_ms, entries=n_entries,
                save_us=save_ms * 1e3)
