"""Sparse MLA benchmarks: the V4-Flash / V4-Pro decode cases, C128 decode, and prefill.

Counting per query token, as FlashMLA's ``count_flop_and_mem_vol_for_decode``:
    FLOP  = 2 * h * N * (512 + 512)           N = keys attended (SWA + compressed)
    bytes = N_main * R_main + N_extra * R_extra + h * 512 * 2 (q) + h * 512 * 2 (out)
(R: the record bytes of each cache's format, 584 for V4.0) floor = max(bytes / copy bandwidth, FLOP / bf16
matmul rate), both measured in the same run.

The V4.1 decode rows time three of the V4.0 shapes over V41_528 caches and over a V41_528 main cache with
a V41_FP4_288 extra cache (interleaved, as vLLM 0.33 writes them), against the targets in their peer column (ratio >= 1:
met): a V41_528 decode within 528 / 584 of the V4.0 time of the same shape (re-timed in the same case),
and the extra entries of a V41_FP4_288 cache (time with the extra set minus time without it, both on the
kernel that reads the fp4 set: the Triton kernel) within 0.6 of a V41_528 extra cache's (on the default
kernel, which on Hopper is the warp-specialized one).

Every call goes through the public API (``dsv4_rocm.flash_mla``), graph-timed for decode, eager for
prefill and for small decode batches. When FlashMLA's ``flash_mla`` package is importable it is timed in
the same run on the same tensors (peer "FlashMLA"). Two rows measure the host path: a b=2 decode call's
GPU span and Python time per call, and the first call of a fresh process with and without
``flash_mla.warmup``.
"""
import torch

from .. import layout as L
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


def v41_cases():
    """The V4.0 decode shapes the V4.1 rows repeat."""
    keep = ("flash decode b=128 s_q=1", "flash decode b=64 s_q=2", "pro decode b=64 s_q=2")
    return [(name, c) for name, c in decode_cases() if name in keep]


def _pool(num_tokens, bs, device, seed, fmt=L.V40_584):
    """A cache of ``num_tokens`` slots of ``fmt`` records of random keys (made in chunks to bound memory)."""
    nb = -(-num_tokens // bs)
    pages = rc.new_cache(nb, bs, device, fmt=fmt)
    g = torch.Generator(device=device).manual_seed(seed)
    step = max(1, (1 << 16) // bs) * bs
    for a in range(0, nb * bs, step):
        slots = torch.arange(a, min(nb * bs, a + step), device=device)
        k = torch.randn(slots.shape[0], 512, device=device, generator=g).bfloat16()
        rc.insert_k_records(rc.encode_k_records(k, fmt), pages, slots, bs, fmt)
    return pages


def make_decode_inputs(c, device, pool_tokens=1 << 18, seed=0, formats=(L.V40_584, L.V40_584)):
    """FlashMLA decode arguments for case ``c`` over caches of ``formats`` (main, extra; extra None: no extra
    set), and the query token count."""
    g = torch.Generator(device=device).manual_seed(seed)
    T = c["b"] * c["s_q"]
    main = _pool(pool_tokens, c["bs"], device, seed, formats[0])
    extra = _pool(pool_tokens, c["ebs"], device, seed + 1, formats[1]) if formats[1] is not None else None
    q = torch.randn(c["b"], c["s_q"], c["h"], 512, device=device, generator=g).bfloat16()
    idx = torch.randint(0, pool_tokens, (c["b"], c["s_q"], c["topk"]), device=device, generator=g).int()
    eidx = torch.randint(0, pool_tokens, (c["b"], c["s_q"], c["etopk"]), device=device, generator=g).int()
    lens = torch.full((c["b"],), c["topk"], dtype=torch.int32, device=device)
    elens = torch.full((c["b"],), c["etopk"], dtype=torch.int32, device=device)
    sink = torch.randn(c["h"], device=device, generator=g)
    if extra is None:
        return (q, rc.flash_mla_view(main, c["bs"], formats[0]), idx, lens, sink, None, None, None, 512 ** -0.5), T
    return (q, rc.flash_mla_view(main, c["bs"], formats[0]), idx, lens, sink,
            rc.flash_mla_view(extra, c["ebs"], formats[1]), eidx, elens, 512 ** -0.5), T


def count_decode(c, formats=(L.V40_584, L.V40_584)):
    T = c["b"] * c["s_q"]
    etopk = c["etopk"] if formats[1] is not None else 0
    flop = 2 * c["h"] * (c["topk"] + etopk) * 1024 * T
    rec = c["topk"] * formats[0].token_bytes + (etopk * formats[1].token_bytes if etopk else 0)
    nbytes = (rec + c["h"] * 512 * 4) * T
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
    "triton": dict(kernel="triton"),       # on Hopper, the Triton kernel instead of the warp-specialized one
}
SWEEP_PREFILL = {
    "default": None,
    "n32s2": dict(BLOCK_N=32, num_stages=2),
    "n64s3": dict(BLOCK_N=64, num_stages=3),
    "n64w16": dict(BLOCK_N=64, num_warps=16, num_stages=2),
}


def flashmla_peer():
    """deepseek-ai/FlashMLA's ``flash_mla`` package when it is built on this machine, else None."""
    try:
        import flash_mla
        from flash_mla import flash_mla_sparse_fwd, flash_mla_with_kvcache, get_mla_metadata  # noqa: F401
    except Exception:  # noqa: BLE001  (absent, or a source tree without its CUDA extension)
        return None
    return None if flash_mla.__name__ != "flash_mla" else flash_mla


def decode_call(mod, args, kernel: str = None, formats=None):
    """fn() calling ``mod.flash_mla_with_kvcache`` (ours or FlashMLA's) on the bench tensors as vLLM's
    backend does, with a scheduling object initialized by a first call (outside any graph capture); with
    ``kernel`` ("triton" or "ws"), our decode of the caches of ``formats`` on that kernel instead."""
    q, kc, idx, lens, sink, ekc, eidx, elens, sm = args
    if kernel is not None:
        from ..triton.attention.sparse_mla_decode import sparse_mla_decode

        def fn():
            return sparse_mla_decode(q, kc, idx, lens, sink, ekc, eidx, elens, sm, formats=formats,
                                     config=dict(kernel=kernel))
        fn()
        return fn
    meta, _ = mod.get_mla_metadata()

    def fn():
        return mod.flash_mla_with_kvcache(q, kc, None, None, 512, meta, None, sm, False, True, idx, sink, ekc, eidx,
                                          lens, elens)
    fn()
    return fn


_FIRST_CALL = """
import json, time, torch
from dsv4_rocm import flash_mla as F
from dsv4_rocm.bench.sparse_mla import decode_call, make_decode_inputs
c = dict(b=4, s_q=1, h=64, topk=128, bs=64, etopk=512, ebs=64)
args, _ = make_decode_inputs(c, "cuda", pool_tokens=1 << 12)
torch.cuda.synchronize()
rep = dict(kernels=0, compiled=0, seconds=0.0)
if WARM:
    rep = F.warmup("cuda", model="v4-flash", verbose=False)
t0 = time.perf_counter()
decode_call(F, args)
torch.cuda.synchronize()
print(json.dumps(dict(first_call_s=time.perf_counter() - t0, **rep)))
"""


def first_call(warm: bool, kernel_cache: str) -> dict:
    """The first call of a V4-Flash C4 decode in a fresh process whose Triton cache directory is new and
    empty (as where Triton's cache does not outlive a process), with dsv4_rocm's kernel cache in
    ``kernel_cache``: without or after ``flash_mla.warmup(model="v4-flash")`` (whose own time and count of
    kernels compiled are reported too)."""
    import json
    import os
    import subprocess
    import sys
    import tempfile
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache, DSV4_KERNEL_CACHE=kernel_cache,
                   PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        r = subprocess.run([sys.executable, "-c", _FIRST_CALL.replace("WARM", str(warm))], capture_output=True,
                           text=True, env=env, cwd=root, timeout=900)
    if r.returncode:
        raise RuntimeError(f"first-call measurement failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _v41_rows(ctx, ours, time_graph_ms, pool_tokens=1 << 18):
    """The V4.1 decode rows of each ``v41_cases`` shape (module docstring): V41_528 against 528 / 584 of the
    V4.0 time, V41_528 + V41_FP4_288, and the fp4 extra entries' cost against 0.6 of V41_528's."""
    v41, fp4 = L.with_layout(L.V41_528), L.with_layout(L.V41_FP4_288)     # the layout vLLM 0.33 writes
    for name, c in v41_cases():
        rows = (f"{name} V41_528", f"{name} V41_528+FP4", f"{name} FP4 extra")
        if not ctx.wants(f"{name} V41", group=" | ".join(rows)):   # the three rows fall to one rank
            continue
        ms = {}
        # "main_triton": the main set alone on the kernel that reads a V41_FP4_288 extra cache (the Triton
        # kernel on every target), so the fp4 extra cost is a difference of two times of one kernel
        for key, fmts, kernel in (("v40", (L.V40_584, L.V40_584), None), ("v41", (v41, v41), None),
                                  ("main", (v41, None), None), ("main_triton", (v41, None), "triton"),
                                  ("fp4", (v41, fp4), None)):
            args, _ = make_decode_inputs(c, ctx.device, pool_tokens, formats=fmts)
            ms[key] = time_graph_ms(decode_call(ours, args) if kernel is None else
                                    decode_call(ours, args, kernel, fmts))
            del args
        ctx.add(rows[0], "default", ms["v41"], *count_decode(c, (v41, v41)), peer="V40 x 528/584",
                peer_ms=ms["v40"] * 528 / 584)
        ctx.add(rows[1], "default", ms["fp4"], *count_decode(c, (v41, fp4)))
        f_all, b_all = count_decode(c, (v41, fp4))
        f_main, b_main = count_decode(c, (v41, None))
        ctx.add(rows[2], "extra set", ms["fp4"] - ms["main_triton"], f_all - f_main, b_all - b_main,
                peer="0.6 x V41_528 extra", peer_ms=0.6 * (ms["v41"] - ms["main"]))


def startup() -> dict:
    """Start-up of fresh processes (``first_call``): with an empty kernel cache, no warm-up; with an empty
    one, warm-up (cold); then two more processes on that kernel cache, one warming up (warm) and one not."""
    import tempfile
    with tempfile.TemporaryDirectory() as empty, tempfile.TemporaryDirectory() as shared:
        return {"cold, no warmup": first_call(False, empty), "warmup, cold": first_call(True, shared),
                "warmup, second process": first_call(True, shared),
                "no warmup, second process": first_call(False, shared)}


def suite(ctx):
    from .. import flash_mla as ours
    from ..triton.attention.sparse_mla_decode import sparse_mla_decode
    from ..triton.attention.sparse_mla_prefill import sparse_mla_prefill
    from .timing import gpu_span_us, host_us_per_call, time_graph_ms, time_ms
    peer = flashmla_peer()
    for name, c in decode_cases():
        if not ctx.wants(name):
            continue
        args, T = make_decode_inputs(c, ctx.device)
        flop, nbytes = count_decode(c)
        peer_kw = {}
        if peer is not None:
            peer_kw = dict(peer="FlashMLA", peer_ms=time_graph_ms(decode_call(peer, args)))
        ms = time_graph_ms(decode_call(ours, args))
        ctx.add(name, "default", ms, flop, nbytes, **peer_kw)
        for cfg_name, cfg in (SWEEP_DECODE.items() if ctx.sweep else ()):
            if cfg is not None:
                ctx.add(name, cfg_name, time_graph_ms(lambda: sparse_mla_decode(*args, config=cfg)), flop, nbytes)
        if c["b"] <= 64:   # what a caller without graphs pays
            peer_kw = dict(peer="FlashMLA", peer_ms=time_ms(decode_call(peer, args))) if peer is not None else {}
            ctx.add(name, "eager", time_ms(decode_call(ours, args)), flop, nbytes, **peer_kw)
        del args
    _v41_rows(ctx, ours, time_graph_ms)
    name = "flash decode b=2 s_q=2 host path"
    if ctx.wants(name):
        # the host path of one eager call: Python time per call, and the GPU span of a call (first kernel
        # start to last kernel end), against FlashMLA's on the same tensors
        c = dict(b=2, s_q=2, h=64, topk=128, bs=256, etopk=512, ebs=64)
        args, _ = make_decode_inputs(c, ctx.device)
        flop, nbytes = count_decode(c)
        fns = {"dsv4_rocm": decode_call(ours, args)}
        if peer is not None:
            fns["FlashMLA"] = decode_call(peer, args)
        span = {k: gpu_span_us(f) for k, f in fns.items()}
        host = {k: host_us_per_call(f) for k, f in fns.items()}
        for what, us in (("gpu span", span), ("host/call", host)):
            peer_kw = dict(peer="FlashMLA", peer_ms=us["FlashMLA"] / 1e3) if peer is not None else {}
            ctx.add(name, what, us["dsv4_rocm"] / 1e3, flop, nbytes, **peer_kw)
        del args
    for name, c in prefill_cases():
        if not ctx.wants(name):
            continue
        q, kv, idx = make_prefill_inputs(c, ctx.device)
        flop, nbytes = count_prefill(c)
        peer_kw = {}
        if peer is not None:
            peer_kw = dict(peer="FlashMLA", peer_ms=time_ms(lambda: peer.flash_mla_sparse_fwd(q, kv, idx, 512 ** -0.5)))
        ctx.add(name, "default", time_ms(lambda: ours.flash_mla_sparse_fwd(q, kv, idx, 512 ** -0.5)), flop, nbytes,
                **peer_kw)
        for cfg_name, cfg in (SWEEP_PREFILL.items() if ctx.sweep else ()):
            if cfg is not None:
                ms = time_ms(lambda: sparse_mla_prefill(q, kv, idx, 512 ** -0.5, config=cfg))
                ctx.add(name, cfg_name, ms, flop, nbytes)
    name = "start-up (fresh processes, empty Triton cache each)"
    if ctx.wants(name):
        for what, r in startup().items():
            ctx.add(name, f"first call, {what}", r["first_call_s"] * 1e3, warmup_s=r["seconds"],
                    warmup_kernels=r["kernels"], compiled=r["compiled"])
