"""Benchmarks of the index-metadata ops in vLLM's call forms. They move a few KB to a few MB and are
launch-bound: the number to read is the time in microseconds (the fraction of the copy floor is small
by nature). Decode-step ops are graph-timed (they run inside the captured decode step), alone and as the
whole step (b = 128, V4 sizes: window 128, C4 top-k 512, C128A width 1024); the prefill-size ops of a
mixed batch are timed eagerly. Peer: the torch oracle (dsv4_rocm/reference/metadata.py) timed the same
way on the same tensors.

Bytes are counted once each: the index entries a kernel needs (block-table entries it looks up, per-token
and per-request inputs) plus every output entry written."""
import torch

from .. import ops
from ..reference import metadata as R

W, K, CAP = 128, 512, 1024        # window, C4 top-k, C128A width (max_model_len 128K)


def _decode_inputs(device, B, g):
    seq = torch.randint(1, 100_000, (B,), generator=g)
    valid = torch.rand(B, generator=g) < 0.95
    n = (seq // 4).clamp(min=1)
    loc = torch.where(torch.arange(K) < n[:, None], (torch.rand(B, K, generator=g) * n[:, None]).long(),
                      torch.full((B, K), -1)).to(torch.int32)
    d = dict(qsl=torch.arange(B + 1, dtype=torch.int32), seq=seq.to(torch.int32),
             t2r=torch.arange(B, dtype=torch.int32),
             valid=valid, slot=torch.where(valid, torch.arange(B), torch.full((B,), -1)), pos=seq - 1,
             bt=torch.randperm(B * 1600, generator=g).view(B, 1600).to(torch.int32), loc=loc)
    return {k: v.to(device) for k, v in d.items()}, seq, n


def decode_cases(device, B=128):
    """[(name, fn(impl), nbytes)]: the decode-step ops of a b=B step on fixed buffers; impl is
    dsv4_rocm.ops (Triton on a GPU) or the oracle module."""
    g = torch.Generator().manual_seed(0)
    d, seq, n = _decode_inputs(device, B, g)
    i32 = dict(dtype=torch.int32, device=device)
    comp = torch.empty(B, dtype=torch.int64, device=device)
    swa = (torch.empty(B, 1, W, **i32), torch.empty(B, **i32))
    glob = (torch.empty(B, K, **i32), torch.empty(B, **i32))
    c128 = (torch.empty(B, CAP, **i32), torch.empty(B, **i32), torch.empty(0, CAP, **i32))
    per_req = B * (4 + 4)                                   # query_start_loc + seq_lens entry per request
    bnd = int(((seq % 4) == 0).sum())                      # tokens closing a C4 window look up one page
    nvis = int((seq // 128).clamp(max=CAP).sum())
    p = seq - 1
    win_pages = int((p // 64 - (p - W + 1).clamp(min=0) // 64 + 1)[d["valid"].cpu()].sum())
    cases = [
        ("get_compressed_slot_mapping", lambda m: m.get_compressed_slot_mapping(B, d["qsl"], d["seq"], d["bt"], 64, 4,
                                                                                 out=comp),
         per_req + bnd * 4 + B * 8),
        ("compute_swa_indices_and_lens", lambda m: m.compute_swa_indices_and_lens(
            *swa, W, d["qsl"], d["seq"], d["t2r"], d["valid"], d["bt"], 64),
         per_req + B * (4 + 1) + win_pages * 4 + B * (W + 1) * 4),
        ("compute_global_topk_indices_and_lens", lambda m: m.compute_global_topk_indices_and_lens(
            d["loc"], d["t2r"], d["bt"], 64, d["valid"], glob),
         B * (K * 4 + 4 + 1) + int(n.clamp(max=K).sum()) * 4 + B * (K + 1) * 4),
        ("build_c128a_topk_metadata", lambda m: m.build_c128a_topk_metadata(
            d["pos"], 128, B, d["t2r"], d["bt"], 2, d["slot"], *c128, CAP),
         B * (8 + 4 + 8) + (nvis + 1) // 2 * 4 + B * (CAP + 1) * 4),
    ]
    whole = sum(c[2] for c in cases)
    cases.append(("decode-step metadata (4 ops)", lambda m: [c[1](m) for c in cases[:4]], whole))
    return cases


def prefill_cases(device, decodes=32, prefills=4, query=2048, prefix=6000):
    """A mixed batch: ``decodes`` decode tokens first, then ``prefills`` requests of ``query`` tokens after
    ``prefix`` cached ones; the ops that scale with the prefill tokens, in their vLLM forms."""
    g = torch.Generator().manual_seed(1)
    i32 = dict(dtype=torch.int32, device=device)
    qlens = torch.tensor([1] * decodes + [query] * prefills)
    seq = torch.cat([torch.randint(1, 100_000, (decodes,), generator=g), torch.full((prefills,), prefix + query)])
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), qlens.cumsum(0)])
    T = int(qsl[-1])
    Rn = decodes + prefills
    r = torch.repeat_interleave(torch.arange(Rn), qlens)
    pos = (seq[r] - qlens[r] + torch.arange(T) - qsl[r])
    bt = torch.randperm(Rn * 1600, generator=g).view(Rn, 1600).to(torch.int32).to(device)
    qsl_d, seq_d, pos_d = qsl.to(**i32), seq.to(**i32), pos.to(device)
    t2r, slot = r.to(**i32), torch.arange(T, device=device)
    comp = torch.empty(T, dtype=torch.int64, device=device)
    c128 = (torch.empty(decodes, CAP, **i32), torch.empty(decodes, **i32), torch.empty(T - decodes, CAP, **i32))
    gl = torch.empty(prefills, **i32)
    R.compute_prefill_gather_lens(gl, seq_d, qsl_d, prefills, decodes, W)
    Tp = T - decodes
    tl = ((pos[decodes:] + 1) // 4).clamp(max=K)
    loc = torch.where(torch.arange(K) < tl[:, None], torch.arange(K).expand(Tp, K), torch.full((Tp, K), -1))
    loc = loc.to(**i32)
    N = (prefix + query) // 4
    Mrows = N + int(gl.max()) if prefills else N + 1
    width = R.combined_width(K, W)
    ci, cl = torch.empty(Tp, width, **i32), torch.empty(Tp, **i32)
    qsl_p, seq_p = qsl_d[decodes:], seq_d[decodes:]
    nvis = int(((pos[:decodes] + 1) // 128).clamp(min=0, max=CAP).sum())
    bnd = int(((pos + 1) % 4 == 0).sum())
    return T, [
        ("get_compressed_slot_mapping", lambda m: m.get_compressed_slot_mapping(T, qsl_d, seq_d, bt, 64, 4, out=comp),
         Rn * 8 + bnd * 4 + T * 8),
        ("compute_prefill_gather_lens", lambda m: m.compute_prefill_gather_lens(gl, seq_d, qsl_d, prefills, decodes, W),
         prefills * 12 + prefills * 4),
        ("build_c128a_topk_metadata", lambda m: m.build_c128a_topk_metadata(pos_d, 128, decodes, t2r, bt, 2, slot,
                                                                            *c128, CAP),
         T * 8 + decodes * 12 + nvis // 2 * 4 + T * CAP * 4 + decodes * 4),
        ("combine_topk_swa_indices", lambda m: m.combine_topk_swa_indices(
            loc, qsl_p, seq_p, gl, W, 4, K, Mrows, N, combined_indices=ci, combined_lens=cl),
         Tp * K * 4 + prefills * 16 + Tp * (width + 1) * 4),
    ]


def _graph_or_eager_ms(fn):
    """(ms, how): graph-timed, or eager where ``fn`` cannot be captured (said in the peer's name)."""
    from .timing import time_graph_ms, time_ms
    try:
        return time_graph_ms(fn), ""
    except RuntimeError:
        torch.cuda.synchronize()
        return time_ms(fn), " (eager)"


def suite(ctx):
    from .timing import time_graph_ms, time_ms
    B = 128
    for name, fn, nbytes in decode_cases(ctx.device, B):
        case = f"{name} b={B}"
        if ctx.wants(case, "metadata"):
            peer_ms, how = _graph_or_eager_ms(lambda: fn(R))
            ctx.add(case, "triton", time_graph_ms(lambda: fn(ops)), 0, nbytes, peer="torch oracle" + how,
                    peer_ms=peer_ms)
    T, cases = prefill_cases(ctx.device)
    for name, fn, nbytes in cases:
        case = f"{name} mixed T={T}"
        if ctx.wants(case, "metadata"):
            ctx.add(case, "triton", time_ms(lambda: fn(ops)), 0, nbytes, peer="torch oracle",
                    peer_ms=time_ms(lambda: fn(R)))
