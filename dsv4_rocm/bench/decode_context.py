"""Decode time against context length: one request's decode step of each V4-Flash layer kind (64 local
heads, TP 1) at contexts of 4K to 128K tokens, replayed from a captured graph, so that the cost curve of
the indexer (linear in the context: its logits over every visible entry) beside the constant window and
top-k attention is visible.

The context is written through the layer's own cache kernels (``fill_caches``, dsv4_rocm/long_context.py),
so the records, the compressor state and the index keys are the ones a prefill leaves. Bytes per step (the
floor): the window's and the selected entries' records read once (584 B each), and for C4 the index keys of
every visible entry (132 B each); C128 reads all its visible entries.
"""
import torch

from .. import layout as L

LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072)
KINDS = ("swa", "c4a", "c128a")


def step_bytes(kind: str, ctx: int, window: int = 128, topk: int = 512) -> int:
    rec = L.TOKEN_BYTES
    if kind == "swa":
        return window * rec
    if kind == "c4a":
        return (window + min(topk, ctx // 4)) * rec + (ctx // 4) * L.INDEXER_TOKEN_BYTES
    return (window + ctx // 128) * rec


def decode_ms(srv, x, device, reps: int = 20) -> float:
    """Median ms of request 0's next decode step: a graph replay on a GPU, an eager step elsewhere."""
    if torch.device(device).type == "cuda":
        from ..trace_check import _graph_decode_ms
        return _graph_decode_ms(srv, [x], device, reps=reps)
    import time
    from ..long_context import _forward
    p = srv.done[0]
    t0 = time.perf_counter()
    _forward(srv, x[p:p + 1])
    return 1e3 * (time.perf_counter() - t0)


def filled_server(cfg, kind: str, ctx: int, device, chunk: int = 8192):
    """A one-request server of ``kind`` with ``ctx`` tokens in its caches, and its hidden states."""
    from ..long_context import _modules, _server, _step_fill, hidden_states
    srv = _server(cfg, kind, ctx + 2, device, None)
    x = hidden_states(ctx + 2, cfg.hidden_size, device)
    for a in range(0, ctx, chunk):
        _step_fill(srv, x[a:min(ctx, a + chunk)], _modules(srv))
    return srv, x


def suite(ctx):
    from ..config import get_config
    cfg = get_config("v4-flash")
    for kind in KINDS:
        for n in LENGTHS:
            name = f"decode vs context {kind} ctx={n // 1024}K b=1"
            if not ctx.wants(name, "decode_context"):
                continue
            srv, x = filled_server(cfg, kind, n, ctx.device)
            ctx.add(name, "graph", decode_ms(srv, x, ctx.device), 0, step_bytes(kind, n), context=n, kind=kind)
            del srv, x
            torch.cuda.empty_cache()
