"""Top-k per row (the C4 indexer's selection) in vLLM's decode form, graph-timed, beside torch.topk on the
same tensors in the same run.

Cases: the two targets (k = 512 over 256K candidates, i.e. 1M context at C4, batch 1; batch 64 over 128K),
a raw 1M row, batch 64 over 32K for k = 1024 and 2048, and the C4 decode step's selection (batch 128 over
2048 candidates). Logits are fp32 N(0, 1), every row at full length. Bytes = the logits read once
(rows x candidates x 4); no FLOP. The floor is those bytes over the copy bandwidth measured in the run;
at these sizes launch latency, not bandwidth, bounds the small cases.
"""
import torch

CASES = [  # name, rows, candidates per row, k
    ("topk k=512 n=256K b=1", 1, 262144, 512),
    ("topk k=512 n=1M b=1", 1, 1048576, 512),
    ("topk k=512 n=128K b=64", 64, 131072, 512),
    ("topk k=1024 n=32K b=64", 64, 32768, 1024),
    ("topk k=2048 n=32K b=64", 64, 32768, 2048),
    ("topk k=512 n=2048 b=128", 128, 2048, 512),
]

# --sweep (and gpu/topk.py): overrides of ``default_config``, functions of it since sizes scale with k
SWEEP = {
    "default": lambda c: {},
    "ctas/4": lambda c: dict(ctas=c["ctas"] / 4),                  # fewer pass-1 CTAs: fewer atomic maxima
    "ctas2/4": lambda c: dict(ctas2=c["ctas2"] / 4),
    "fused": lambda c: dict(mode="fused"),                        # one launch, one CTA a row
    "coarse/2": lambda c: dict(coarse=c["coarse"] // 2),          # cheaper t, more candidates
    "load*2": lambda c: dict(load=2 * c["load"], coarse_warps=8),
    "scan/2": lambda c: dict(scan=c["scan"] // 2),               # more pass-2 CTAs a row, one step less each
    "group8": lambda c: dict(group=8),
    "group32": lambda c: dict(group=32),
    "digit6": lambda c: dict(digit=6),
    "warps8": lambda c: dict(warps=8, coarse_warps=8),
    # the split layout's launches: the default runs it in two ("2launch" names it), "1launch" in one at any
    # width (20.2 against 35.9 us at b = 1 x 256K on the H200, 2026-11-29), "1l-rows8" in one up to 8 rows
    "2launch": lambda c: dict(one_launch=0),
    "1launch": lambda c: dict(one_launch=1 << 30),
    "behind": lambda c: dict(ahead=False),                        # one launch, tiles loaded after the length
    "load/2": lambda c: dict(load=max(c["coarse"], c["load"] // 2)),   # twice the pass-1 CTAs (S)
    "load/4": lambda c: dict(load=max(c["coarse"], c["load"] // 4)),
    "scan1/2": lambda c: dict(scan1=c["scan1"] // 2),             # the last CTA's scan in two steps at 256K
    "chunk1*2": lambda c: dict(chunk1=2 * c["chunk1"]),           # its listed groups loaded in one step
    "chunk1/2": lambda c: dict(chunk1=c["chunk1"] // 2),
    "tdigit8": lambda c: dict(coarse_digit=8),                    # the threshold select's rounds
    "tdigit4": lambda c: dict(coarse_digit=4),
    "1l-load/2": lambda c: dict(one_launch=1 << 30, load=max(c["coarse"], c["load"] // 2)),
    "1l-rows8": lambda c: dict(one_launch=1 << 30, one_launch_rows=8),    # one launch for small batches only
}


def make_inputs(rows, n, k, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(rows, n, device=device, generator=g)
    seq_lens = torch.full((rows,), n, dtype=torch.int32, device=device)
    out = torch.empty(rows, k, dtype=torch.int32, device=device)
    return logits, seq_lens, out


def suite(ctx):
    from ..triton.indexer.top_k_per_row import _facts, default_config, top_k_per_row_decode
    from .timing import time_graph_ms, time_ms
    for name, rows, n, k in CASES:
        if not ctx.wants(name):
            continue
        logits, seq_lens, out = make_inputs(rows, n, k, ctx.device)
        nbytes = rows * n * 4
        vals = torch.empty(rows, k, device=ctx.device)
        idx = torch.empty(rows, k, dtype=torch.int64, device=ctx.device)
        peer_ms = time_graph_ms(lambda: torch.topk(logits, k, dim=1, out=(vals, idx)))
        base = default_config(_facts(logits.device)[0], k)
        for cfg_name, fn in (SWEEP.items() if ctx.sweep else [("default", SWEEP["default"])]):
            cfg = fn(base)

            def call():
                top_k_per_row_decode(logits, 1, seq_lens, out, rows, logits.stride(0), logits.stride(1), k,
                                     config=cfg)
            ctx.add(name, cfg_name, time_graph_ms(call), 0, nbytes, peer="torch.topk", peer_ms=peer_ms)
            if cfg_name == "default" and rows == 1:      # what a caller without graphs pays
                ctx.add(name, "eager", time_ms(call), 0, nbytes)
        del logits, out, vals, idx
