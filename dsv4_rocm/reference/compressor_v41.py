"""DeepSeek-V4.1 compressor (docs/math.md#v41-compressor): vLLM's ``fused_save_compress_norm`` and
``rope_quant_insert`` (vllm/models/deepseek_v41/common/ops/fused_compress_quant_cache.py), the oracle of
the Triton kernels.

A V4.1 compressor groups r = 1 or 2 consecutive tokens (no overlap, no positional bias ``ape``). Its
projection ``kv_score = x @ fused_wkv_wgate^T`` is fp32 [T, 512 * r]: the kv half, and for r = 2 the
score half. A token at position p closes group j = p // r when (p + 1) % r == 0:

    r = 1:  y = kv_p
    r = 2:  y[c] = sum_{u in (p-1, p)} softmax_u(score[u, c]) * kv[u, c]       (per dim c)
    latent  = bf16(RMSNorm(y; norm weight, eps))                                 bf16 [512]

``fused_save_compress_norm`` writes ``latent_out[t]`` for those tokens (other rows are left as they are)
and, for r = 2, keeps a ring of the last ``capacity`` rows of each request (``state_cache`` fp32
[blocks, capacity, 1024]; slot = ring block * capacity + p % capacity): the first token of a request's
chunk (t == query_start_loc[token_to_req[t]]) pairs with the ring row of p - 1 saved by an earlier
step, every later token with the row before it in ``kv_score``. Ring rows are read before the step's
rows are saved; request b saves the rows of the last min(len, capacity) tokens of its chunk
[query_start_loc[b], query_start_loc[b + 1]) (tokens below len(slot_mapping)) that have a slot >= 0.
``token_to_req_indices`` may be shorter than slot_mapping (vLLM's padded steps: the actual tokens only); a
token past its end has no request and makes no latent (its slot is negative, padding).

Rows from elsewhere (vLLM's prefill context parallelism, r = 2): with ``prev_rows`` fp32 [rows, 1024]
(the [kv, score] rows of other chunks' last tokens) and ``prev_row_indices`` int [>= num_reqs], the first
token of request b's chunk pairs with ``prev_rows[prev_row_indices[b]]`` where that index is >= 0 (an
index >= rows skips the token) and with the ring row where it is negative; the step then saves no ring
row at all (the caller stores the rows it chose to the ring itself).

``rope_quant_insert`` turns the latent of each group-closing token into a compressed-cache record: RoPE
at position j * r = (p // r) * r on the fp32 value of the bf16 latent, then the record of the cache's
format (vLLM picks the kernel by the cache's last dimension; docs/cache_format.md):

    V40_584      UE8M0 fp8 of latent[:448] in blocks of 64, bf16 of the rotated dims 448..511
    V41_528      UE8M0 fp8 of all 512 rotated dims (fp32, no bf16 rounding) in blocks of 32
    V41_FP4_288  e2m1 of all 512 rotated dims, one e4m3 scale per 16 (reference.quant, NVFP4-style blocks)

in the format's page layout (``layout.data_offset`` / ``record_scale_offset``). A cache of plain
[448 NoPE | 64 RoPE] rows (vLLM's FlashInfer caches: bfloat16, or float8_e4m3fn 512 wide; ``is_plain_row_cache``)
gets row = bf(RoPE(latent)) (NoPE dims the latent's own values), or its e4m3 bytes of
fp32(row) * fp32(1 / fp8_scale), saturating at +-448 (-0 as 0x00, a non-finite value 0x7F).

Exact fp32 arithmetic, shared with the kernels: the softmax and sums of ``reference.compressor.pool`` (a
pair: m = max, e_u = exp_neg(s_u - m), (e0 kv0 + e1 kv1) / (e0 + e1)), its RMSNorm (pairwise sum of
squares, IEEE sqrt and division) and ``bf16_bits`` (NaN written 0x7FC0). Padding: a negative or
out-of-range slot, request id or position skips the token.
"""
import torch

from .. import layout as L
from ..cache_views import is_plain_row_cache  # noqa: F401
from .cache import insert_k_records
from .compressor import _as_pages, _records, bf16_bits, pool, rms_normalize
from .qkv import _encode_scaled, kv_rope

RING_CAPACITY = 8            # vLLM's CompressorStateCache: max(8, next power of two >= num_spec + 2) rows
RECORD_BYTES = 584           # fp8_ds_mla: 576 data + 8 scale bytes
LATENT_DIM = 512


def _latents(y, weight, eps) -> torch.Tensor:
    """bf16 bits (int16 [n, 512]) of RMSNorm(y)."""
    return bf16_bits(rms_normalize(y, weight, eps))


def fused_save_compress_norm(kv_score, positions, state_cache, slot_mapping, query_start_loc, token_to_req_indices,
                             rms_norm_weight, rms_norm_eps, compress_ratio, latent_out, prev_rows=None,
                             prev_row_indices=None) -> None:
    """vLLM's op (module docstring). ``slot_mapping`` is the ring's slots for r = 2, any slots for r = 1
    (only their sign is read: a negative slot is padding); its length is the number of tokens.
    ``prev_rows`` / ``prev_row_indices`` (r = 2; unused for r = 1): the first token's partner rows from
    other chunks, and no ring save."""
    n = slot_mapping.shape[0]
    if n == 0:
        return
    D = LATENT_DIM
    s = slot_mapping.long()
    out = latent_out.view(torch.int16)
    if compress_ratio == 1:
        ok = s >= 0
        out[:n][ok] = _latents(kv_score[:n, :D][ok].float(), rms_norm_weight, rms_norm_eps)
        return
    nb, cap = state_cache.shape[0], state_cache.shape[1]
    p = positions[:n].long()
    R = query_start_loc.shape[0] - 1
    req = torch.full((n,), -1, dtype=torch.long, device=s.device)          # past token_to_req_indices: padding
    m = min(n, token_to_req_indices.shape[0])
    req[:m] = token_to_req_indices[:m].long()
    live = (s >= 0) & (s < nb * cap)
    ok = live & (p >= 1) & ((p + 1) % 2 == 0) & (req >= 0) & (req < R)
    t = torch.nonzero(ok).flatten()
    if prev_rows is not None and t.numel():                              # an index past prev_rows skips
        first = t == query_start_loc.long()[req[t]]                       # the chunk's first token
        t = t[~(first & (prev_row_indices.long()[req[t]] >= prev_rows.shape[0]))]
    if t.numel():
        first = t == query_start_loc.long()[req[t]]
        cur = kv_score[t, :2 * D].float()
        ring = state_cache[s[t] // cap, (p[t] - 1) % cap]                 # the row of p - 1 an earlier step saved
        if prev_rows is not None:                                         # or another chunk's row
            idx = prev_row_indices.long()[req[t]]
            other = first & (idx >= 0)
            ring[other] = prev_rows[idx[other]].float()
        prev = torch.where(first.unsqueeze(1), ring, kv_score[(t - 1).clamp(min=0), :2 * D].float())
        kv = torch.stack([prev[:, :D], cur[:, :D]], 1)
        sc = torch.stack([prev[:, D:], cur[:, D:]], 1)
        out[t] = _latents(pool(sc, kv), rms_norm_weight, rms_norm_eps)
    if prev_rows is not None:                                             # the caller saves the ring
        return
    qsl = query_start_loc.long().tolist()                                # then the ring save: each request
    for b in range(R):                                                    # its chunk's last `cap` rows
        a, e = max(qsl[b], 0), min(qsl[b + 1], n)
        for t in range(max(a, e - cap), e):
            if bool(live[t]):
                state_cache[int(s[t]) // cap, int(s[t]) % cap] = kv_score[t, :2 * D].float()


def record_slots_ok(slot_mapping, positions, n, capacity, cs_rows, ratio):
    """(positions int64 [n], bool [n]): the tokens that write a record (a valid slot and position, and
    (p + 1) % ratio == 0)."""
    s = slot_mapping[:n].long()
    p = positions[:n].long()
    ok = (s >= 0) & (s < capacity) & (p >= 0) & (p < cs_rows) & ((p + 1) % ratio == 0)
    return p, ok


def store_records(cache, slots, data, scales, record_bytes: int, token_stride: int) -> None:
    """Write [n, token_stride] data and [n, record_bytes - token_stride] scale bytes at valid slots of a
    paged cache ([nb, bs, record] or [nb, bs, 1, record]; data region then scale region per page)."""
    if slots.numel() == 0:
        return
    pages = _as_pages(cache, record_bytes)
    bs = cache.shape[1]
    sd = record_bytes - token_stride
    blk, off = (slots // bs).unsqueeze(1), (slots % bs).unsqueeze(1)
    pages[blk, off * token_stride + torch.arange(token_stride, device=slots.device)] = data
    pages[blk, bs * token_stride + off * sd + torch.arange(sd, device=slots.device)] = scales


def rope_quant_insert(latent, positions, cos_sin_cache, kv_cache, slot_mapping, compress_ratio, fp8_scale=None,
                      fmt: L.RecordFormat = L.V40_584) -> None:
    """vLLM's op (module docstring), for records of ``fmt``, or for plain rows where the cache holds them
    (``is_plain_row_cache``; ``fmt`` unused): bf16 [nb, bs, 512] rows bf(RoPE(latent)), or e4m3 rows of
    fp32(bf(RoPE(latent))) * fp32(1 / fp8_scale), saturating at +-448 (a non-finite value 0x7F)."""
    n = slot_mapping.shape[0]
    if n == 0:
        return
    cap = kv_cache.shape[0] * kv_cache.shape[1]
    p, ok = record_slots_ok(slot_mapping, positions, n, cap, cos_sin_cache.shape[0], compress_ratio)
    t = torch.nonzero(ok).flatten()
    if t.numel() == 0:
        return
    pos = (p[t] // compress_ratio) * compress_ratio
    if is_plain_row_cache(kv_cache):
        rows = kv_cache[:, :, 0] if kv_cache.dim() == 4 else kv_cache
        s, bs = slot_mapping[t].long(), rows.shape[1]
        y = kv_rope(latent[t], pos, cos_sin_cache.float())          # NoPE dims: the latent's own bf16 values
        if rows.dtype == torch.bfloat16:
            rows[s // bs, s % bs] = y
        else:
            rows.view(torch.uint8)[s // bs, s % bs] = _encode_scaled(y.float(), 1.0 / fp8_scale.reshape(()).float())
        return
    y = latent[t].float()
    data, scales = _records(y, pos, cos_sin_cache.float(), LATENT_DIM, False, fmt)
    if fmt.name == L.V40_584.name:
        store_records(kv_cache, slot_mapping[t].long(), data, scales, RECORD_BYTES, 576)
    else:
        insert_k_records(torch.cat([data, scales], 1), kv_cache, slot_mapping[t].long(), kv_cache.shape[1], fmt)
