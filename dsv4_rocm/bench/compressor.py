"""Compressor benchmarks: vLLM's two calls of one layer step (``save_partial_states`` then
``compress_norm_rope_store``) for a decode step of b = 128 requests (graph-timed) and a prefill chunk of
8192 tokens (4 requests x 2048, eager, as a prefill runs), C4 / C128 main KV and the C4 indexer K (FP8
and MXFP4).

Bytes, each counted once: the state save reads kv and score (2 x H fp32 a token, H = coff * D) and writes
them (2 x H) for every token, as vLLM's step does (the windows of later steps read them); the compress
step reads, for each entry it produces, the halves of its window rows it uses (coff * r rows x 2 x D
fp32, which is each saved byte once) and writes the record (584 / 132 / 68 B); the metadata (positions,
slots, request ids, block-table rows) adds 28 B a token. The peer is the float reference on the same
tensors (eager: it is not graph-capturable).

``--sweep`` times every launch configuration of ``SWEEP`` through the Triton launchers (``config=``),
each first checked byte for byte against the oracle (run on the CPU once per case); a wrong variant is
reported as such. Rows: ``<variant>`` (eager for prefill, graph replay for decode), ``<variant>/graph``
(prefill: device time without the host), ``save <variant>`` (the state save alone, graph replay, its
own bytes). ``host_us`` in the JSON: host time of one eager call.
"""
import time
from types import SimpleNamespace

import torch

from .. import layout as L
from ..reference import compressor as rc
from ..reference.rope import build_cos_sin_cache

RECORD = {"main": (576, 8, 64), "fp8": (128, 4, 128), "mxfp4": (64, 4, 32)}   # token stride, scale dim, block

# variant -> (save_partial_states config, compress_norm_rope_store config, steps it applies to)
_BOTH, _PREFILL = ("decode", "prefill"), ("prefill",)
SWEEP = {
    (4, "main"): {
        "default": (None, None, _BOTH),
        "w8": (None, dict(num_warps=8), _BOTH),                       # rows across warps, more warps an SM
        "chunk8": (None, dict(chunk=8), _PREFILL),
        "list": (None, dict(grid="list"), _PREFILL),                  # boundary tokens listed first
        "save-t1w4": (dict(tokens=1, num_warps=4), None, _BOTH),
        "save-t4w8": (dict(tokens=4, num_warps=8), None, _BOTH),
    },
    (128, "main"): {
        "default": (None, None, _BOTH),
        "g1w4": (None, dict(groups=1, num_warps=4), _BOTH),           # one warp group: 4 warps an entry
        "g4w16": (None, dict(groups=4, num_warps=16, prefetch=False), _BOTH),
        "s-split2": (None, dict(nsplit=2, groups=2, num_warps=4), _BOTH),   # streamed halves, then a finish
        "split16": (None, dict(pool="tile", nsplit=16, cols=32, prefetch=False, num_warps=4, finish_warps=4),
                    _BOTH),                                           # [128, 32] tiles, then a finish
        "chunk16": (None, dict(chunk=16), _PREFILL),
        "list": (None, dict(grid="list"), _PREFILL),
        "save-t4w4": (dict(tokens=4, num_warps=4), None, _BOTH),
    },
    (4, "fp8"): {
        "default": (None, None, _BOTH),
        "w2": (None, dict(num_warps=2), _BOTH),
        "chunk8": (None, dict(chunk=8), _PREFILL),
        "list": (None, dict(grid="list"), _PREFILL),
        "save-t8w2": (dict(tokens=8, num_warps=2), None, _BOTH),
    },
    (4, "mxfp4"): {
        "default": (None, None, _BOTH),
        "chunk8": (None, dict(chunk=8), _PREFILL),
    },
}


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
    save_bytes = T * 2 * c * D * 4 * 2
    nbytes = save_bytes + n_entries * (W * 2 * D * 4 + ts + sd) + T * 28
    return save, comp, nbytes, n_entries, save_bytes, pages


def cases():
    out = []
    for ratio, target in ((4, "main"), (128, "main"), (4, "fp8"), (4, "mxfp4")):
        name = f"C{ratio} {'main' if target == 'main' else 'indexer ' + target}"
        ends = [65536 - ratio * i for i in range(128)]     # every decode token closes a window (the costly step)
        out.append((f"compressor decode {name} b=128", ratio, target, [(e - 1, e) for e in ends], True))
        out.append((f"compressor prefill {name} T=8192", ratio, target, [(0, 2048)] * 4, False))
    return out


def _oracle(save, comp, pages):
    """(state, pages) after the step, computed by the reference on CPU copies."""
    state = rc.new_state_cache(save["state_cache"].shape[0], save["compress_ratio"], comp["head_dim"])
    state.copy_(save["state_cache"])
    pages = pages.cpu()
    cpu = lambda d: {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in d.items()}    # noqa: E731
    rc.save_partial_states(**dict(cpu(save), state_cache=state))
    kv = comp["kv_cache"]
    rc.compress_norm_rope_store(**dict(cpu(comp), state_cache=state, kv_cache=rc.kv_cache_view(pages, kv.shape[1],
                                                                                                  kv.shape[2]),
                                       k_cache_metadata=SimpleNamespace(
                                           slot_mapping=comp["k_cache_metadata"].slot_mapping.cpu())))
    return state, pages


def _host_us(fn, n=20):
    """Host time of one eager call (launches queue without waiting for the device)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host


def _sweep(ctx, name, ratio, target, decode, save, comp, nbytes, save_bytes, pages):
    from ..triton.compressor.compress_norm_rope_store import compress_norm_rope_store as compress
    from ..triton.compressor.save_partial_states import save_partial_states as save_states
    from .timing import time_graph_ms, time_ms
    state = save["state_cache"]
    init_state, init_pages = state.clone(), pages.clone()
    ref_state, ref_pages = (t.to(state.device) for t in _oracle(save, comp, pages))
    step = "decode" if decode else "prefill"
    for vname, (scfg, ccfg, steps) in SWEEP[(ratio, target)].items():
        if step not in steps:
            continue

        def run(scfg=scfg, ccfg=ccfg):
            save_states(**save, config=scfg)
            compress(**comp, config=ccfg)
        state.copy_(init_state)
        pages.copy_(init_pages)
        run()
        ok = torch.equal(state.view(torch.int32), ref_state.view(torch.int32)) and torch.equal(pages, ref_pages)
        label = vname if ok else f"{vname} WRONG"
        graph_ms = time_graph_ms(run, rep_ms=50)
        if decode:
            ctx.add(name, label, graph_ms, 0, nbytes, ok=ok)
        else:
            ms = time_ms(run, warmup_ms=10, rep_ms=50)
            ctx.add(name, label, ms, 0, nbytes, ok=ok, host_us=_host_us(run), graph_us=graph_ms * 1e3)
            ctx.add(name, f"{label}/graph", graph_ms, 0, nbytes, ok=ok)
        if scfg is not None or vname == "default":
            ms = time_graph_ms(lambda scfg=scfg: save_states(**save, config=scfg), rep_ms=50)
            ctx.add(name, f"save {label}", ms, 0, save_bytes, ok=ok)


def suite(ctx):
    from .. import ops
    from .timing import time_graph_ms, time_ms
    for name, ratio, target, ranges, decode in cases():
        if not ctx.wants(name, "compressor"):
            continue
        save, comp, nbytes, n_entries, save_bytes, pages = _step(ratio, target, ranges, ctx.device)

        def run(backend):
            with ops.use_backend(backend):
                ops.save_partial_states(**save)
                ops.compress_norm_rope_store(**comp)
        with ops.use_backend("triton"):
            ms = (time_graph_ms if decode else time_ms)(lambda: run("triton"))
            save_ms = (time_graph_ms if decode else time_ms)(lambda: ops.save_partial_states(**save))
            host_us = _host_us(lambda: run("triton"))
        peer_ms = time_ms(lambda: run("reference"))
        ctx.add(name, "triton", ms, 0, nbytes, peer="torch reference", peer_ms=peer_ms, entries=n_entries,
                save_us=save_ms * 1e3, host_us=host_us)
        if ctx.sweep:
            _sweep(ctx, name, ratio, target, decode, save, comp, nbytes, save_bytes, pages)
        del save, comp, pages
