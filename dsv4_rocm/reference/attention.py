"""Sparse MLA attention with an attention sink, FlashMLA semantics.

For query head h with valid gathered keys K_i (K = V, 512-d):
    l_i = sm * <q_h, K_i>,  lse = log sum_i exp(l_i)   (natural log, sink excluded)
    out = (sum_i exp(l_i - lse) K_i) * sigmoid(lse - sink_h)    ( = exp(lse) / (exp(lse) + exp(sink)) )
A query with no valid key returns out = 0, lse = +inf, max_logit = -inf. sink = -inf has no effect and
sink = +inf gives out = 0.
"""
import torch

from .. import cache_views as V
from .cache import decode_k_records, gather_k_records

_QUERY_CHUNK = 64


def attend(q: torch.Tensor, K: torch.Tensor, valid: torch.Tensor, sm_scale: float, sink=None):
    """q [N, H, D], K [N, S, D], valid [N, S] bool -> (out fp32 [N, H, D], lse [N, H], max_logits [N, H])."""
    l = torch.einsum("nhd,nsd->nhs", q.float(), K.float()) * sm_scale
    l = l.masked_fill(~valid.unsqueeze(1), float("-inf"))
    mx = l.amax(-1) if l.shape[-1] else l.new_full(l.shape[:-1], float("-inf"))
    any_valid = valid.any(-1).unsqueeze(1).expand_as(mx)
    safe_mx = torch.where(any_valid, mx, torch.zeros_like(mx))
    p = torch.exp(l - safe_mx.unsqueeze(-1))
    denom = p.sum(-1)
    out = torch.einsum("nhs,nsd->nhd", p, K.float().masked_fill(~valid.unsqueeze(-1), 0)) \
        / torch.where(any_valid, denom, torch.ones_like(denom)).unsqueeze(-1)
    lse = torch.where(any_valid, safe_mx + torch.log(denom), torch.full_like(mx, float("inf")))
    if sink is not None:
        out = out * torch.sigmoid(lse - sink.float().to(q.device)).unsqueeze(-1)
    out = torch.where(any_valid.unsqueeze(-1), out, torch.zeros_like(out))
    return out, lse, mx


def flash_mla_sparse_fwd(q, kv, indices, sm_scale: float, d_v: int = 512, attn_sink=None, topk_length=None,
                         out=None):
    """FlashMLA prefill semantics. q [s_q, h, 512] bf16, kv [s_kv, 1, 512] bf16, indices [s_q, 1, topk]
    int32 (negative or >= s_kv = invalid), topk_length [s_q] -> (out bf16 [s_q, h, 512], max_logits,
    lse [s_q, h]); ``out``, when given, receives the output and is returned."""
    s_q, h, d = q.shape
    s_kv = kv.shape[0]
    idx = indices[:, 0].long()
    valid = (idx >= 0) & (idx < s_kv)
    if topk_length is not None:
        valid &= torch.arange(idx.shape[1], device=idx.device).unsqueeze(0) < topk_length.long().unsqueeze(1)
    res = torch.empty(s_q, h, d_v, dtype=torch.float32, device=q.device)
    lse = torch.empty(s_q, h, dtype=torch.float32, device=q.device)
    mx = torch.empty_like(lse)
    kvf = kv[:, 0].float() if s_kv else kv.new_zeros(1, d, dtype=torch.float32)   # an empty kv: every key absent
    for a in range(0, s_q, _QUERY_CHUNK):
        b = min(a + _QUERY_CHUNK, s_q)
        K = kvf[torch.where(valid[a:b], idx[a:b], torch.zeros_like(idx[a:b]))]
        o, l, m = attend(q[a:b], K, valid[a:b], sm_scale, attn_sink)
        res[a:b], lse[a:b], mx[a:b] = o[..., :d_v], l, m
    return _into(out, res), mx, lse


def _into(out, res):
    """res as bf16, written into ``out`` when one is given."""
    if out is None:
        return res.to(torch.bfloat16)
    out.copy_(res)
    return out


def _paged_set(cache, indices, lengths, b, s_q, fmt=None):
    """Gather the dequantized K rows of one index set: returns (K [b*s_q, topk, 512], valid). ``fmt``: the
    cache's record format (default: named by its last dimension, in its ``layout.default_layout``)."""
    bs = cache.shape[1]
    fmt = fmt or V.detect_format(cache, bs)
    pages = V.pages(cache, bs, "k_cache", fmt)
    idx = indices.reshape(b * s_q, indices.shape[-1]).long()
    valid = (idx >= 0) & (idx < pages.shape[0] * bs)
    if lengths is not None:
        ln = lengths.long()
        ln = ln.unsqueeze(1).expand(b, s_q) if ln.dim() == 1 else ln
        valid &= torch.arange(idx.shape[1], device=idx.device).unsqueeze(0) < ln.reshape(-1, 1)
    safe = torch.where(valid, idx, torch.full_like(idx, -1)).reshape(-1)
    K = decode_k_records(gather_k_records(pages, safe, bs, fmt), fmt).reshape(b * s_q, idx.shape[1], 512)
    return K, valid


def flash_mla_with_kvcache_sparse(q, k_cache, indices, topk_length, attn_sink, extra_k_cache,
                                  extra_indices_in_kvcache, extra_topk_length, softmax_scale: float, out=None,
                                  formats=None, num_splits=None):
    """FlashMLA sparse decode semantics over paged KV records: one softmax over the main set (indices into
    k_cache) and the optional extra set; -> (out bf16 [b, s_q, h, 512], lse [b, h, s_q]); ``out``, when
    given, receives the output and is returned. Lengths are [b] or [b, s_q]. ``formats``: the record
    formats (main, extra) of the caches (default: named by their last dimension, default layout); ``num_splits``
    is accepted for the kernels' call form (the reference never splits)."""
    b, s_q, h, d = q.shape
    fmt, efmt = formats or (None, None)
    K, valid = _paged_set(k_cache, indices, topk_length, b, s_q, fmt)
    if extra_k_cache is not None:
        K2, v2 = _paged_set(extra_k_cache, extra_indices_in_kvcache, extra_topk_length, b, s_q, efmt)
        K, valid = torch.cat([K, K2], 1), torch.cat([valid, v2], 1)
    qf = q.reshape(b * s_q, h, d)
    res, lse, _ = attend(qf, K, valid, softmax_scale, attn_sink)
    return _into(out, res.reshape(b, s_q, h, d)), lse.reshape(b, s_q, h).transpose(1, 2)
