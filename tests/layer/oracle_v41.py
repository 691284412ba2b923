"""The oracle of a DeepSeek-V4.1 layer stack: one request at positions 0..T-1, every set built by hand from
docs/math.md#v41 (no cache pages, no step metadata, no kernel), composed from the reference functions.

For each layer in order: q = bf(RoPE(wq_b(q_norm(wq_a x)))) (no per-head norm), the window keys are the
dequantized records (the stack's SWA record) of bf(RoPE(kv_norm(wkv x))); a kv source pools its groups
(ratio 1: the token's kv; ratio 2: the per-dim softmax of the pair), norms them to bf16 latents, records
them at RoPE position j * r (V40_584: the bf16 rotated dims; the V4.1 records: all 512 rotated dims
quantized from fp32) and derives the index keys k_norm(wk(latent)); an index source scores the visible entries
of its kv source with its own q and weights, takes the candidate blocks (the candidate source: the newest
block and the blocks of largest maximum score) or scores only inside them (a later index source), then
the top-k; every compressed layer attends over its window and the last index source's top-k entries of
its kv source's cache; the output path is the V4.0 one. The pooling and norms use the reference's exact
fp32 arithmetic (reference.compressor.pool, rms_normalize): a float64 norm would move some bf16 latents by
one step, and a top-k or candidate block taken among near-equal scores could then differ.
"""
import torch

from dsv4_rocm import layout as L
from dsv4_rocm.kv_cache import v41_records
from dsv4_rocm.reference import cache as rc
from dsv4_rocm.reference import indexer as I
from dsv4_rocm.reference import output as O
from dsv4_rocm.reference.compressor import pool, rms_normalize
from dsv4_rocm.reference.layer_spec import attend_and_project
from dsv4_rocm.reference.norm import fused_q_kv_rmsnorm
from dsv4_rocm.reference.qkv import kv_rope
from dsv4_rocm.reference.quant import quantize_blocks
from dsv4_rocm.reference.rope import build_cos_sin_cache, rope_fwd


def _records(k_bf16, fmt=L.V40_584):
    """K (= V) fp32 [n, 512] an attention kernel reads for bf16 keys k (RoPE applied) in ``fmt`` records."""
    return rc.decode_k_records(rc.encode_k_records(k_bf16, fmt), fmt)


def _compressed(latent, pos, cs, fmt):
    """K of a kv source's entries: V40_584 records of bf(RoPE(latent)); a V4.1 record quantizes all 512 dims
    of the fp32 RoPE(latent) (vLLM's rope_quant_insert)."""
    if fmt.name == L.V40_584.name:
        return _records(kv_rope(latent, pos, cs))
    return rc.decode_k_records(rc.encode_values(rope_fwd(latent.float(), pos, cs), fmt), fmt)


def _source(cfg, spec, W, x, cs, eps, fmt=L.V40_584):
    """(compressed K fp32 [n, 512], index keys (fp8 bytes [n, 128], scales [n])) of a kv source's groups."""
    T, r = x.shape[0], spec.ratio
    n = T // r
    ks = x.float() @ W.comp_w.float().t()
    if r == 1:
        y = ks[:, :512]
    else:
        pair = ks[:2 * n].view(n, 2, 1024)
        y = pool(pair[:, :, 512:], pair[:, :, :512])
    latent = rms_normalize(y, W.comp_norm, eps).bfloat16()
    pos = torch.arange(n) * r
    K = _compressed(latent, pos, cs, fmt)
    k_pre = (latent.float() @ W.idx_wk.float().t()).bfloat16()
    k = rms_normalize(k_pre.float(), W.idx_k_norm, eps).bfloat16()
    z = rope_fwd(k, pos, cs).bfloat16().float()
    q8, e = quantize_blocks(z, 128, 1e-4)
    return K, (q8, torch.exp2(e[:, 0].float()))


def _largest(values, k):
    """The indices of the k largest values, ties to the lower index (the selection order of the top-k and
    candidate ops: with few index heads many logits are exactly 0, so ties are common)."""
    return torch.sort(values, descending=True, stable=True).indices[:k].tolist()


def _candidate_blocks(logits, n, C, bs):
    nb = -(-n // bs)
    if nb <= C:
        return set(range(nb))
    mx = logits[:(nb - 1) * bs].view(nb - 1, bs).amax(1)
    return set(_largest(mx, C - 1)) | {nb - 1}


def naive_v41_stack(stack, x):
    """{layer: bf16 [T, hidden]} for one request's hidden states x bf16 [T, hidden] at positions 0..T-1 through
    the layers of ``stack`` (a V4.1 SyntheticServer: its config, layers and weights)."""
    cfg, T = stack.cfg, x.shape[0]
    swa_fmt, comp_fmt = v41_records(stack.record_format)
    H, Wn, eps = cfg.local_heads, cfg.sliding_window, cfg.rms_norm_eps
    pos = torch.arange(T)
    sources, topk, cands, outs = {}, None, None, {}
    for layer in stack.layers:
        spec, W = cfg.v41_layer(layer), stack.layer_weights[layer]
        cs = build_cos_sin_cache(max_positions=T + 1, **cfg.v41_rope(layer))
        qr_kv = O.fp8_linear(x, W.wqkv8, W.wqkv_s)
        qr, kv = fused_q_kv_rmsnorm(qr_kv[:, :cfg.q_lora_rank], qr_kv[:, cfg.q_lora_rank:], W.q_norm, W.kv_norm, eps)
        q = torch.zeros(T, cfg.padded_heads, 512, dtype=torch.bfloat16)
        q[:, :H] = kv_rope(O.fp8_linear(qr, W.wq_b8, W.wq_b_s).view(T, H, 512), pos, cs)
        K_raw = _records(kv_rope(kv, pos, cs), swa_fmt)
        if spec.owns_kv:
            sources[layer] = _source(cfg, spec, W, x, cs, eps, comp_fmt)
        if spec.owns_index:
            K_c, (k8, ksc) = sources[spec.kv_source]
            nh = cfg.index_n_heads
            qi = O.fp8_linear(qr, W.idx_wq_b8, W.idx_wq_b_s).view(T, nh, 128)
            wi = (x.float() @ W.idx_wproj.float().t()).bfloat16()
            q8, wq = I.fused_indexer_q_rope_quant(pos, qi, cs, wi, 128 ** -0.5, nh ** -0.5)
            topk, new_cands = [], []
            for t in range(T):
                n = (t + 1) // spec.ratio
                if n == 0:
                    topk.append([])
                    new_cands.append(set())
                    continue
                lg = I.fp8_mqa_logits(q8[t:t + 1], (k8[:n], ksc[:n]), wq[t:t + 1], torch.tensor([0]),
                                      torch.tensor([n]))[0]
                if spec.candidate_source:
                    new_cands.append(_candidate_blocks(lg, n, cfg.candidate_topk_blocks, cfg.candidate_block_size))
                elif spec.uses_candidates:
                    keep = torch.tensor([j // cfg.candidate_block_size in cands[t] for j in range(n)])
                    lg = lg.masked_fill(~keep, float("-inf"))
                topk.append(list(range(n)) if n <= cfg.index_topk else _largest(lg, cfg.index_topk))
            if spec.candidate_source:
                cands = new_cands
        keys = [[K_raw[u] for u in range(max(0, t - Wn + 1), t + 1)]
                + ([sources[spec.kv_source][0][j] for j in topk[t]] if spec.ratio else []) for t in range(T)]
        outs[layer] = attend_and_project(cfg, W, q, keys, pos, cs)
    return outs
