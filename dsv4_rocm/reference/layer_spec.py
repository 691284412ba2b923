"""The DeepSeek-V4 attention layer evaluated from scratch for one request: a composition of the reference
functions written straight from docs/math.md, apart from ``dsv4_rocm.attention`` and its serving path.

Every token's key set is built by hand (its sliding window, its compressed entries pooled from the raw
scores, the indexer's top-k of them), each record goes through the cache's encode/decode once, and the
heads attend densely over that set; there are no paged caches, no step metadata, no chunking and no ops
dispatch. So it checks the layer's cache layout, slot mapping, metadata, masks and chunked serving, which a
comparison of the layer with itself on the reference backend cannot (tests/layer/test_layer.py, and the check of
``python -m dsv4_rocm run`` on a CPU). Slow (a Python loop per token and entry): for short traces only.
"""
import torch

from ..config import LayerType
from . import attention as ra
from . import cache as rc
from . import indexer as I
from . import output as O
from .norm import fused_q_kv_rmsnorm, rmsnorm
from .qkv import kv_rope, q_norm_rope
from .quant import quantize_blocks
from .rope import rope_fwd


def _entries(x, w, ape, norm_w, ratio, D, n, cs):
    """Compressed entries 0..n-1 of one request, straight from docs/math.md#compressor (fp32 y-hat per entry)."""
    c = 2 if ratio == 4 else 1
    ks = x.float() @ w.float().t()
    kv, sc = ks[:, :c * D], ks[:, c * D:] + ape[torch.arange(x.shape[0]) % ratio]
    out = []
    for j in range(n):
        us = [u for u in (range(4 * j - 4, 4 * j + 4) if ratio == 4 else range(128 * j, 128 * j + 128)) if u >= 0]
        half = [1 if (ratio == 4 and u >= 4 * j) else 0 for u in us]
        kvs = torch.stack([kv[u, h * D:(h + 1) * D] for u, h in zip(us, half)])
        scs = torch.stack([sc[u, h * D:(h + 1) * D] for u, h in zip(us, half)])
        yh = rmsnorm((torch.softmax(scs, 0) * kvs).sum(0), norm_w, 1e-6)
        out.append((yh, rope_fwd(yh.unsqueeze(0), torch.tensor([j * ratio]), cs)[0]))
    return out


def from_scratch_layer(server, x):
    """The output of ``server``'s layer (weights, config, layer type) for one request x, positions 0..T-1,
    every set built by hand from the spec (no cache, no metadata ops, no chunking)."""
    cfg, lt, W, cs = server.cfg, server.layer_type, server.weights, server.cos_sin
    T, H, Wn = x.shape[0], cfg.local_heads, cfg.sliding_window
    r = {LayerType.SWA: 1, LayerType.C4: 4, LayerType.C128: 128}[lt]
    qr_kv = O.fp8_linear(x, W.wqkv8, W.wqkv_s)
    qr, kv = fused_q_kv_rmsnorm(qr_kv[:, :cfg.q_lora_rank], qr_kv[:, cfg.q_lora_rank:], W.q_norm, W.kv_norm, 1e-6)
    pos = torch.arange(T)
    q = torch.zeros(T, cfg.padded_heads, 512, dtype=torch.bfloat16)
    q[:, :H] = q_norm_rope(O.fp8_linear(qr, W.wq_b8, W.wq_b_s).view(T, H, 512), pos, cs, 1e-6)
    K_raw = rc.decode_k_records(rc.encode_k_records(kv_rope(kv, pos, cs)))
    K_c = None
    if r > 1:
        ents = _entries(x, W.comp_w, W.comp_ape, W.comp_norm, r, 512, T // r, cs)
        K_c = torch.stack([rc.decode_k_records(rc.encode_k_records(
            torch.cat([yh[:448], ro[448:]]).bfloat16().unsqueeze(0)))[0] for yh, ro in ents]) if ents else None
    if lt == LayerType.C4:
        ients = _entries(x, W.idx_comp_w, W.idx_comp_ape, W.idx_comp_norm, 4, 128, T // 4, cs)
        k8, ksc = [], []
        for _, ro in ients:
            qb, e = quantize_blocks(ro.bfloat16().float().unsqueeze(0), 128, 1e-4)
            k8.append(qb[0]), ksc.append(2.0 ** int(e))
        qi = O.fp8_linear(qr, W.idx_wq_b8, W.idx_wq_b_s).view(T, cfg.index_n_heads, 128)
        wi = (x.float() @ W.idx_wproj.float().t()).bfloat16()
        q8, wq = I.fused_indexer_q_rope_quant(pos, qi, cs, wi, 128 ** -0.5, cfg.index_n_heads ** -0.5)
    all_keys = []
    for t in range(T):
        keys = [K_raw[u] for u in range(max(0, t - Wn + 1), t + 1)]
        n = (t + 1) // r if r > 1 else 0
        if lt == LayerType.C128:
            keys += [K_c[j] for j in range(n)]
        elif lt == LayerType.C4 and n:
            lg = I.fp8_mqa_logits(q8[t:t + 1], (torch.stack(k8[:n]), torch.tensor(ksc[:n])), wq[t:t + 1],
                                  torch.tensor([0]), torch.tensor([n]))[0]
            chosen = range(n) if n <= cfg.index_topk else torch.topk(lg, cfg.index_topk).indices.tolist()
            keys += [K_c[j] for j in chosen]
        all_keys.append(keys)
    return attend_and_project(cfg, W, q, all_keys, pos, cs)


def attend_and_project(cfg, W, q, keys, positions, cos_sin):
    """The end of a from-scratch layer oracle: token t's heads attend over keys[t] (a list of fp32 [512] K = V
    rows) with the sink, then the output path (inverse RoPE, fp8 quant, the wo_a einsum, wo_b)."""
    T, H = q.shape[0], cfg.local_heads
    attn = torch.zeros(T, cfg.padded_heads, 512)
    for t in range(T):
        Ks = torch.stack(keys[t]).unsqueeze(0)
        o, _, _ = ra.attend(q[t:t + 1].float(), Ks, torch.ones(1, Ks.shape[1], dtype=torch.bool), cfg.softmax_scale,
                            W.attn_sink)
        attn[t] = o[0]
    attn = attn.bfloat16()
    a8, sa = O.fused_inv_rope_fp8_quant(attn[:, :H], positions, cos_sin, cfg.local_groups, cfg.heads_per_group)
    z = torch.empty(T, cfg.local_groups, cfg.o_lora_rank, dtype=torch.bfloat16)
    O.fp8_einsum("bhr,hdr->bhd", (a8, sa), (W.wo_a8, W.wo_a_s), z)
    return O.fp8_linear(z.reshape(T, -1), W.wo_b8, W.wo_b_s)
