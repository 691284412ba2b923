"""Q norm + RoPE and KV RoPE + quant + cache insert (docs/math.md#q-kv-insert), as vLLM's fused ops do them.

Both ops work per token t: every q head gets a weightless RMSNorm over its 512 dims and GPT-J RoPE on
dims 448..511 (fp32 inside); kv gets the same RoPE. What they store differs:

    fp8_ds_mla op   q -> bf16 [T, padded_heads, 512] (heads past H zero); kv -> bf16 -> a V40_584 record, or
                    with ``kv_mxfp8`` a V41_528 one (UE8M0 block quant, ``reference.cache``) at slot_mapping[t].
                    vLLM's grown schema: ``apply_q_norm`` / ``apply_q_rope`` switch the q norm / RoPE off
                    (q is then copied, rounded once); ``is_q_interleaved``: q and q_out hold each token's
                    heads in 16-dim chunks, value (h, d) at (d // 16) * H * 16 + h * 16 + d % 16 of the
                    token's row (H the tensor's head count); ``padded_heads`` 0 writes no q at all
    full-cache op   q -> e4m3 (q * q_fp8_scale_inv) [T, H, 512] (no RMSNorm without ``apply_q_norm``);
                    kv -> e4m3 (kv * (1 / fp8_scale)) row of 512 bytes at k_cache[slot // bs, slot % bs]
                    (per-tensor scales, no bf16 step)
    bf16 full cache q -> bf16, in place [T, H, 512]; kv -> bf16 row of 512 values at k_cache[slot // bs,
                    slot % bs] (vLLM's plain-row bf16 cache: no quantization, no record)

Only the first len(slot_mapping) tokens are inserted; slots < 0 or past the cache are skipped. A
position outside the cos/sin table makes the token invalid: its q rows are zero and its kv is not
inserted (the public ops reject such positions where value checks run).
"""
import torch

from .. import layout as L
from .cache import quantize_and_insert_k_cache
from .norm import rmsnorm
from .quant import FP8_NAN, e4m3_encode
from .rope import rope_fwd, rope_fwd_fma


def _valid_positions(positions: torch.Tensor, cos_sin_cache: torch.Tensor):
    ok = (positions >= 0) & (positions < cos_sin_cache.shape[0])
    return ok, torch.where(ok, positions, torch.zeros_like(positions))


def q_norm_rope(q: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, eps: float) -> torch.Tensor:
    """bf(RoPE_fwd(RMSNorm_noweight(q_h))) per head, fp32 inside, one rounding. q: [T, H, 512]."""
    return rope_fwd(rmsnorm(q, None, eps), positions, cos_sin_cache).to(torch.bfloat16)


def kv_rope(kv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """bf(RoPE_fwd(kv)) on the last 64 dims; NoPE dims are unchanged bf16 values. kv: [T, 512]."""
    return rope_fwd(kv, positions, cos_sin_cache).to(torch.bfloat16)


def _insert_slots(slot_mapping: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    n = slot_mapping.shape[0]
    return torch.where(ok[:n], slot_mapping, torch.full_like(slot_mapping, -1))


def interleave_heads(q: torch.Tensor) -> torch.Tensor:
    """Head-major [T, H, 512] -> the chunk-interleaved layout (same shape): (h, d) goes to flat position
    (d // 16) * H * 16 + h * 16 + d % 16 of the token's H * 512 values."""
    T, H, D = q.shape
    return q.reshape(T, H, D // 16, 16).transpose(1, 2).reshape(T, H, D)


def deinterleave_heads(q: torch.Tensor) -> torch.Tensor:
    """Inverse of interleave_heads."""
    T, H, D = q.shape
    return q.reshape(T, D // 16, H, 16).transpose(1, 2).reshape(T, H, D)


def q_transform(q, positions, cos_sin_cache, eps, apply_q_norm=True, apply_q_rope=True):
    """bf(RoPE?(RMSNorm?(q_h))) per head, fp32 inside, one rounding (an identity when both are off). The q
    RoPE rounds as vLLM's reference for this op does: each rotated value one fused multiply-add over the
    other product (``rope_fwd_fma``); kv keeps three roundings (``kv_rope``)."""
    x = rmsnorm(q, None, eps) if apply_q_norm else q.float()
    return (rope_fwd_fma(x, positions, cos_sin_cache) if apply_q_rope else x).to(torch.bfloat16)


def fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(q, kv, k_cache, slot_mapping, positions, cos_sin_cache,
                                                      padded_heads: int, eps: float, block_size: int, q_out=None,
                                                      apply_q_norm=True, apply_q_rope=True, is_q_interleaved=False,
                                                      fmt: L.RecordFormat = L.V40_584):
    """Writes q_out bf16 [T, padded_heads, 512] (allocated when None; nothing when padded_heads is 0) and the
    ``fmt`` cache; returns q_out."""
    T, H, D = q.shape
    if q_out is None:
        q_out = torch.empty(T, padded_heads, D, dtype=torch.bfloat16, device=q.device)
    ok, pos = _valid_positions(positions, cos_sin_cache)
    if padded_heads:
        qs = deinterleave_heads(q) if is_q_interleaved else q
        qn = q_transform(qs, pos, cos_sin_cache, eps, apply_q_norm, apply_q_rope)
        res = torch.zeros(T, padded_heads, D, dtype=torch.bfloat16, device=q.device)
        res[:, :H] = torch.where(ok.view(T, 1, 1), qn, torch.zeros_like(qn))
        q_out.copy_(interleave_heads(res) if is_q_interleaved else res)
    n = slot_mapping.shape[0]
    quantize_and_insert_k_cache(kv_rope(kv[:n], pos[:n], cos_sin_cache), k_cache, _insert_slots(slot_mapping, ok),
                                block_size, fmt)
    return q_out


def _encode_scaled(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes of fp32(x * scale), saturating at +-448; a non-finite x gives 0x7F (NaN), never a
    clipped finite value (docs/conventions.md, numerics)."""
    b = e4m3_encode(x * scale)
    return torch.where(torch.isfinite(x), b, torch.full_like(b, FP8_NAN))


def qnorm_rope_and_insert_full_k_cache(q, kv, k_cache, slot_mapping, positions, cos_sin_cache, eps: float,
                                       cache_block_size: int, fp8_scale, q_fp8, q_fp8_scale_inv,
                                       apply_q_norm: bool = True) -> None:
    """The FlashInfer full-cache form: q_fp8 [T, H, 512] e4m3 (RMSNorm skipped without ``apply_q_norm``) and
    k_cache [nb, bs, 512] e4m3 rows."""
    T = q.shape[0]
    ok, pos = _valid_positions(positions, cos_sin_cache)
    qf = rope_fwd(rmsnorm(q, None, eps) if apply_q_norm else q.float(), pos, cos_sin_cache)
    qb = _encode_scaled(qf, q_fp8_scale_inv.reshape(()).float())
    q_fp8.view(torch.uint8).copy_(torch.where(ok.view(T, 1, 1), qb, torch.zeros_like(qb)))
    n = slot_mapping.shape[0]
    slots = _insert_slots(slot_mapping, ok).long()
    nb, bs = k_cache.shape[0], cache_block_size
    valid = (slots >= 0) & (slots < nb * bs)
    inv = 1.0 / fp8_scale.reshape(()).float()
    rows = _encode_scaled(rope_fwd(kv[:n][valid], pos[:n][valid], cos_sin_cache), inv)
    s = slots[valid]
    k_cache.view(torch.uint8)[s // bs, s % bs] = rows


def qnorm_rope_and_insert_full_bf16_k_cache(q, kv, k_cache, slot_mapping, positions, cos_sin_cache, eps: float,
                                            cache_block_size: int, apply_q_norm: bool = True) -> None:
    """The bf16 full-cache form: q [T, H, 512] bf16 rewritten in place as bf(RoPE(RMSNorm(q))) per head
    (bf(RoPE(q)) without ``apply_q_norm``), zero rows at invalid positions; k_cache bf16 [nb, bs, 512] row at
    slot_mapping[t] = bf(RoPE(kv_t)) for the first len(slot_mapping) tokens."""
    T = q.shape[0]
    ok, pos = _valid_positions(positions, cos_sin_cache)
    qn = q_norm_rope(q, pos, cos_sin_cache, eps) if apply_q_norm else kv_rope(q, pos, cos_sin_cache)
    n = slot_mapping.shape[0]
    slots = _insert_slots(slot_mapping, ok).long()
    nb, bs = k_cache.shape[0], cache_block_size
    valid = (slots >= 0) & (slots < nb * bs)
    rows = kv_rope(kv[:n][valid], pos[:n][valid], cos_sin_cache)
    s = slots[valid]
    q.copy_(torch.where(ok.view(T, 1, 1), qn, torch.zeros_like(qn)))
    k_cache[s // bs, s % bs] = rows


def fused_deepseek_v4_kv_rope_insert(kv, k_cache, slot_mapping, positions, cos_sin_cache, cache_block_size: int,
                                     fp8_scale=None, kv_mxfp8: bool = False, fmt: L.RecordFormat = None) -> None:
    """The kv half of the three fused inserts, alone (vLLM 0.33's ``fused_deepseek_v4_kv_rope_insert``: V4.1's
    DSpark context KV and the PCP SWA writer), chosen by the cache's dtype as vLLM chooses:

        uint8            the record cache: bf(RoPE(kv)) as a V40_584 record, or V41_528 with ``kv_mxfp8``
                         (``fmt`` gives the layout), as fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert
        float8_e4m3fn    [nb, bs, 512] rows e4m3(RoPE(kv) * fp32(1 / fp8_scale)), as
                         qnorm_rope_and_insert_full_k_cache (no bf16 step; non-finite values 0x7F)
        bfloat16         [nb, bs, 512] rows bf(RoPE(kv)), as qnorm_rope_and_insert_full_bf16_k_cache

    for the first len(slot_mapping) tokens; a slot < 0 or past the cache, or a position outside the cos/sin
    table, writes nothing. The bytes are those the fused inserts write for the same kv."""
    n = slot_mapping.shape[0]
    ok, pos = _valid_positions(positions[:n], cos_sin_cache)
    slots = _insert_slots(slot_mapping, ok)
    if k_cache.dtype == torch.uint8:
        if fmt is None:
            fmt = L.V41_528 if kv_mxfp8 else L.V40_584
        quantize_and_insert_k_cache(kv_rope(kv[:n], pos, cos_sin_cache), k_cache, slots, cache_block_size, fmt)
        return
    slots = slots.long()
    bs = cache_block_size
    valid = (slots >= 0) & (slots < k_cache.shape[0] * bs)
    s = slots[valid]
    if k_cache.dtype == torch.bfloat16:
        k_cache[s // bs, s % bs] = kv_rope(kv[:n][valid], pos[valid], cos_sin_cache)
        return
    inv = 1.0 / fp8_scale.reshape(()).float()
    k_cache.view(torch.uint8)[s // bs, s % bs] = _encode_scaled(rope_fwd(kv[:n][valid], pos[valid], cos_sin_cache),
                                                               inv)


def decode_front(q, kv, kv_weight, q_out, k_cache, slot_mapping, positions, cos_sin_cache, eps: float,
                 block_size: int, apply_q_norm: bool, fmt: L.RecordFormat, index=None) -> None:
    """The front of a decode step as the unfused ops run it: kv = bf(RMSNorm(kv; kv_weight)) (the kv half of
    ``norm.fused_q_kv_rmsnorm``), then ``fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert`` into q_out and the
    ``fmt`` cache, then, with ``index`` = (index_q, index_cos_sin_cache, index_weights, softmax_scale, head_scale,
    use_fp4, use_fnuz, out, scales, w_out), ``indexer.fused_indexer_q_rope_quant`` into out / scales / w_out
    (scales: the MXFP4 scale bytes uint8 [T, nh, 4]; unused for the FP8 query)."""
    from .indexer import fused_indexer_q_rope_quant
    kv_n = rmsnorm(kv, kv_weight, eps).to(torch.bfloat16)
    fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(q, kv_n, k_cache, slot_mapping, positions, cos_sin_cache,
                                                      q_out.shape[1], eps, block_size, q_out, apply_q_norm, True,
                                                      False, fmt)
    if index is not None:
        iq, ics, iw, sm_scale, h_scale, fp4, q_fnuz, out, scales, w_out = index
        qi, w = fused_indexer_q_rope_quant(positions, iq, ics, iw, sm_scale, h_scale, fp4, q_fnuz)
        if fp4:
            out.copy_(qi[0])
            scales.view(torch.uint8).copy_(qi[1].contiguous().view(torch.uint8).view(scales.shape))
        else:
            out.view(torch.uint8).copy_(qi.view(torch.uint8))
        w_out.copy_(w)
