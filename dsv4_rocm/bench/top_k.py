"""Top-k per row (the C4 indexer's selection) in vLLM's decode form, graph-timed, beside torch.topk on the
same tensors in the same run.

Cases: the two targets (k = 512 over 256K candidates, i.e. 1M context at C4, batch 1; batch 64 over 128K)
and batch 64 over 32K for k = 1024 and 2048. Logits are fp32 N(0, 1), every row at full length.
Bytes = the logits read once (rows x candidates x 4); no FLOP. The floor is those bytes over the copy
bandwidth measured in the run; at these sizes launch latency, not bandwidth, bounds batch 1.
"""
import torch

CASES = [  # name, rows, candidates per row, k
    ("topk k=512 n=256K b=1", 1, 262144, 512),
    ("topk k=512 n=128K b=64", 64, 131072, 512),
    ("topk k=1024 n=32K b=64", 64, 32768, 1024),
    ("topk k=2048 n=32K b=64", 64, 32768, 2048),
]

# --sweep: overrides of ``default_config`` (functions of it, since sizes scale with k)
# (None: not for this k; with 8 K2 warps k = 2048 holds 32 candidate and coarse keys a thread and spills)
def _warps8(c):
    """8 K2 warps with the same columns per thread (255 registers a thread on NVIDIA)."""
    if c["cap"] > 2048:
        return None
    return dict(warps_k2=8, load=c["load"] // 2, chunk=c["chunk"] // 2, gather=c["gather"] // 2)


SWEEP = {
    "default": lambda c: {},
    "digit6": lambda c: _warps8(c) and dict(_warps8(c), digit=6, t_digit=6, t_rounds=3),
    "digit8": lambda c: _warps8(c) and dict(_warps8(c), digit=8, t_digit=8, t_rounds=2),
    "t_exact": lambda c: dict(t_rounds=7),
    "coarse/2": lambda c: dict(coarse=c["coarse"] // 2),
    "coarse*2": lambda c: None if c["cap"] > 2048 else dict(coarse=c["coarse"] * 2),
    "ctas2": lambda c: dict(ctas=2),
    "ctas8": lambda c: dict(ctas=8),
    "k2ctas1": lambda c: dict(k2_ctas=1),
    "tile8k": lambda c: dict(tile=8192),
    "k2warps8": _warps8,
    "k1warps4": lambda c: dict(warps_k1=4),
    "group/2": lambda c: dict(group=max(1, c["group"] // 2), raw_max=c["raw_max"] // 2),
    "raw*2": lambda c: dict(raw_max=c["raw_max"] * 2),
    "raw/4": lambda c: dict(raw_max=c["raw_max"] // 4),
    "steps/2": lambda c: dict(load=c["load"] // 2, chunk=c["chunk"] // 2, gather=c["gather"] // 2),
}


def make_inputs(rows, n, k, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(rows, n, device=device, generator=g)
    seq_lens = torch.full((rows,), n, dtype=torch.int32, device=device)
    out = torch.empty(rows, k, dtype=torch.int32, device=device)
    return logits, seq_lens, out


def suite(ctx):
    from ..triton.top_k_per_row import _facts, default_config, top_k_per_row_decode
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
            if cfg is None:
                continue

            def call():
                top_k_per_row_decode(logits, 1, seq_lens, out, rows, logits.stride(0), logits.stride(1), k,
                                     config=cfg)
            ctx.add(name, cfg_name, time_graph_ms(call), 0, nbytes, peer="torch.topk", peer_ms=peer_ms)
            if cfg_name == "default" and rows == 1:      # what a caller without graphs pays
                ctx.add(name, "eager", time_ms(call), 0, nbytes)
        del logits, out, vals, idx
