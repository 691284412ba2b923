"""Lightning indexer of C4 layers (docs/math.md#indexer), in vLLM's and DeepGEMM's call forms.

Query (``fused_indexer_q_rope_quant``), per token t and head h of qi (bf16 [T, H, 128]):
    x      = [qi[:64], bf16(RoPE(qi)[64:])]            GPT-J pairs on the last 64 dims, fp32, one bf16 rounding
    FP8:   e = ceil(log2(max(max|x|, 1e-4) / 448)),  q = e4m3(x * 2^-e),  w' = ((w * 2^e) * softmax_scale) * head_scale
    MXFP4: four blocks of 32 (reference.quant.mxfp4_quantize),            w' = (w * softmax_scale) * head_scale
A head holding NaN or +-inf is poisoned (docs/conventions.md): FP8 bytes 0x7F and w' NaN; an MXFP4 block
gets scale 0xFF and nibbles 0x7. ``use_fnuz`` gives vLLM's gfx942 FP8 query (docs/numerics.md#fnuz-query):
the same rule with e4m3fnuz bytes and maximum 224 (e = ceil(log2(max(max|x|, 1e-4) / 224)), poisoned bytes
0x80), returned as float8_e4m3fnuz; its bytes are the OCP query's and its w' is exactly twice the OCP one.

Logits (DeepGEMM's ``fp8_mqa_logits`` / ``fp8_paged_mqa_logits``), for a query row m and key n:
    logit[m, n] = sum_h w'[m, h] * ReLU((q[m, h] . k[n]) * s_k[n])           (fp32)
with q's bytes read as its dtype says: e4m3fn (or uint8 bytes) as OCP, float8_e4m3fnuz as fnuz (vLLM's gfx942
query, whose w' carries the doubled scale); likewise the contiguous k of ``fp8_mqa_logits``. The paged
indexer-K cache holds OCP bytes.
and -inf outside the keys the row sees: [ks, ke) in prefill; in decode, draft row i of request b sees
keys [0, L - next_n + i + 1) for DeepGEMM's 1-D context_lens L = context_lens[b], or [0, context_lens[b, i])
for 2-D ones. A key whose block-table entry is negative or past the cache is -inf too (it is never read).
The oracle writes every entry; with DeepGEMM's clean_logits=False the entries outside a row's keys are
unspecified (the kernels may leave them unwritten).

Indexer-K cache (``indexer_k_quant_and_cache`` / ``cp_gather_indexer_k_quant_cache``): 132-byte records,
128 e4m3 bytes at ``page + off * 128`` and the fp32 scale 2^e at ``page + bs * 128 + off * 4``.
"""
import torch

from .. import cache_views as V
from .. import layout as L
from .cache import _read_records, _write_records
from .quant import e4m3_decode, e4m3fnuz_decode, mxfp4_quantize, quantize_blocks
from .rope import rope_fwd

INDEX_EPS = 1e-4
ROPE_DIM = 64
SCALE_NAN_BITS = 0x7FC00000        # the fp32 scale of a poisoned entry


def _f32(v: float) -> torch.Tensor:
    """A Python float as the fp32 value a kernel argument holds."""
    return torch.tensor(v, dtype=torch.float32)


def pow2_or_nan(e: torch.Tensor) -> torch.Tensor:
    """fp32 2^e of UE8M0 exponents; the poisoned exponent 128 gives NaN."""
    bits = torch.where(e >= 128, torch.full_like(e, SCALE_NAN_BITS), (e + 127) << 23)
    return bits.to(torch.int32).view(torch.float32)


def fused_indexer_q_rope_quant(positions, index_q, index_q_cos_sin_cache, index_weights,
                               index_weights_softmax_scale: float, index_weights_head_scale: float,
                               use_fp4: bool = False, use_fnuz: bool = False):
    """vLLM's op: -> (q float8_e4m3fn [T, H, 128], w' fp32 [T, H]) or, with use_fp4, ((packed uint8
    [T, H, 64], ue8m0 scales as int32 [T, H]), w'); with use_fnuz q is float8_e4m3fnuz (maximum 224)."""
    D = index_q.shape[-1]
    roped = rope_fwd(index_q, positions, index_q_cos_sin_cache)[..., D - ROPE_DIM:]
    x = torch.cat([index_q[..., :D - ROPE_DIM].float(), roped.to(torch.bfloat16).float()], dim=-1)
    w = index_weights.float()
    if use_fp4:
        packed, scales = mxfp4_quantize(x)
        w = (w * _f32(index_weights_softmax_scale)) * _f32(index_weights_head_scale)
        return (packed, scales.contiguous().view(torch.int32).squeeze(-1)), w
    q, e = quantize_blocks(x, D, INDEX_EPS, fnuz=use_fnuz)
    w = ((w * pow2_or_nan(e[..., 0])) * _f32(index_weights_softmax_scale)) * _f32(index_weights_head_scale)
    return q.view(torch.float8_e4m3fnuz if use_fnuz else torch.float8_e4m3fn), w


def fp8_values(t: torch.Tensor) -> torch.Tensor:
    """fp32 values of e4m3 tensor t: float8_e4m3fnuz read as fnuz, float8_e4m3fn and uint8 bytes as OCP."""
    return (e4m3fnuz_decode if t.dtype == torch.float8_e4m3fnuz else e4m3_decode)(t.view(torch.uint8))


def _logits(q8, k8, k_scale, weights):
    """fp32 [M, N] = sum_h w[m, h] * relu((q[m, h] . k[n]) * s[n]) (q8 [M, H, D], k8 [N, D] e4m3)."""
    kf = fp8_values(k8)
    rows = []
    for m0 in range(0, q8.shape[0], 64):        # row chunks keep the [m, h, n] scores small
        s = torch.einsum("mhd,nd->mhn", fp8_values(q8[m0:m0 + 64]), kf) * k_scale.float()
        rows.append(torch.einsum("mhn,mh->mn", torch.relu(s), weights[m0:m0 + 64].float()))
    return torch.cat(rows) if rows else torch.zeros(0, k8.shape[0], device=k8.device)


def fp8_mqa_logits(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits: bool = True) -> torch.Tensor:
    """DeepGEMM's prefill logits over a contiguous K: q fp8 [M, H, D], kv = (k fp8 [N, D], scale fp32 [N]),
    weights fp32 [M, H], ks / ke int32 [M] -> fp32 [M, N], -inf outside [ks[m], ke[m])."""
    k8, k_scale = kv
    lg = _logits(q, k8, k_scale, weights)
    j = torch.arange(k8.shape[0], device=lg.device).unsqueeze(0)
    ok = (j >= cu_seqlen_ks.long().unsqueeze(1)) & (j < cu_seqlen_ke.long().unsqueeze(1))
    return lg.masked_fill(~ok, float("-inf"))


def visible_keys(context_lens: torch.Tensor, next_n: int) -> torch.Tensor:
    """int64 [B, next_n]: keys each draft row sees (module docstring), not clamped."""
    cl = context_lens.long()
    if cl.dim() == 2:
        return cl
    return cl.unsqueeze(1) - next_n + 1 + torch.arange(next_n, device=cl.device)


def entry_slots(block_row: torch.Tensor, j: torch.Tensor, block_size: int, num_blocks: int) -> torch.Tensor:
    """Cache slots of entries j of one request through its block-table row; -1 where the row has no such
    column or its entry is negative or past the cache's num_blocks pages."""
    col = j // block_size
    page = torch.full_like(j, -1)
    if block_row.shape[0]:
        page = torch.where(col < block_row.shape[0], block_row[col.clamp(max=block_row.shape[0] - 1)].long(), page)
    ok = (page >= 0) & (page < num_blocks)
    return torch.where(ok, page * block_size + j % block_size, torch.full_like(j, -1))


def fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_tables, schedule_metadata, max_model_len: int,
                         clean_logits: bool = True) -> torch.Tensor:
    """DeepGEMM's decode logits over the paged indexer-K cache: q fp8 [B, next_n, H, D], kv_cache
    [nb, bs, 132] or [nb, bs, 1, 132], weights fp32 [B * next_n, H] -> fp32 [B * next_n, max_model_len]."""
    B, nn = q.shape[:2]
    bs = kv_cache.shape[1]
    pages = V.pages(kv_cache, bs, "kv_cache", V.INDEXER_K)
    vis = visible_keys(context_lens, nn).clamp(0, max_model_len)
    out = torch.full((B * nn, max_model_len), float("-inf"), device=q.device)
    for b in range(B):
        n = int(vis[b].max()) if nn else 0
        if n <= 0:
            continue
        j = torch.arange(n, device=q.device)
        slots = entry_slots(block_tables[b], j, bs, pages.shape[0])
        ok = slots >= 0
        rec = _read_records(kv_cache, slots, bs, V.INDEXER_K)
        k_scale = rec[:, L.INDEXER_DIM:].contiguous().view(torch.float32).reshape(-1)
        lg = _logits(q[b], rec[:, :L.INDEXER_DIM], k_scale, weights[b * nn:(b + 1) * nn])
        seen = (j.unsqueeze(0) < vis[b].unsqueeze(1)) & ok.unsqueeze(0)
        out[b * nn:(b + 1) * nn, :n] = lg.masked_fill(~seen, float("-inf"))
    return out


def get_paged_mqa_logits_metadata(context_lens, block_size: int, num_sms: int) -> torch.Tensor:
    """DeepGEMM's schedule tensor, int32 [num_sms + 1, 2]. dsv4_rocm's paged logits kernel balances its work
    from context_lens itself and does not read it: it is returned zeroed, in DeepGEMM's shape and dtype."""
    return torch.zeros(num_sms + 1, 2, dtype=torch.int32, device=context_lens.device)


def index_k_scale_bytes(e: torch.Tensor, scale_fmt: str) -> torch.Tensor:
    """The 4 scale bytes of indexer-K entries with UE8M0 exponents e [n, 1] (128 = poisoned): "ue8m0", the
    fp32 2^e (NaN when poisoned); "mxfp8", the UE8M0 byte e + 127 four times (0xFF when poisoned), the form
    MX-scaled logits readers take (one byte per 32 values, all equal)."""
    if scale_fmt == "mxfp8":
        return torch.where(e >= 128, torch.full_like(e, 0xFF), e + 127).to(torch.uint8).expand(-1, 4)
    return pow2_or_nan(e).contiguous().view(torch.uint8)


def indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size: int, scale_fmt: str) -> None:
    """vLLM's op: UE8M0 FP8 of k [T, 128] (one 128-value block a row, eps 1e-4; a non-finite row gives bytes
    0x7F and a poisoned scale) written at slot_mapping[:n] of the indexer-K cache, its scale in the bytes of
    ``scale_fmt`` (``index_k_scale_bytes``); negative slots are skipped."""
    n = slot_mapping.shape[0]
    q, e = quantize_blocks(k[:n].float(), L.INDEXER_DIM, INDEX_EPS)
    _write_records(torch.cat([q, index_k_scale_bytes(e, scale_fmt)], dim=1), kv_cache, slot_mapping,
                   kv_cache.shape[1], V.INDEXER_K)


def cp_gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens) -> None:
    """vLLM's op: row t of dst_k / dst_scale, for cu_seq_lens[b] <= t < cu_seq_lens[b + 1], gets entry
    t - cu_seq_lens[b] of request b (its 128 fp8 bytes and its 4 scale bytes, as written), through
    block_table[b]. Rows no request covers are not written; an entry whose block-table entry is negative
    or past the cache gives zero bytes."""
    bs = kv_cache.shape[1]
    cu = cu_seq_lens.long().tolist()
    kb, sb = dst_k.view(torch.uint8), dst_scale.view(torch.uint8).view(dst_scale.shape[0], 4)
    nb = V.pages(kv_cache, bs, "kv_cache", V.INDEXER_K).shape[0]
    for b in range(block_table.shape[0]):
        lo, hi = max(cu[b], 0), min(cu[b + 1], dst_k.shape[0])
        if hi <= lo:
            continue
        j = torch.arange(lo - cu[b], hi - cu[b], device=dst_k.device)
        slots = entry_slots(block_table[b], j, bs, nb)
        rec = _read_records(kv_cache, slots, bs, V.INDEXER_K)
        kb[lo:hi] = rec[:, :L.INDEXER_DIM]
        sb[lo:hi] = rec[:, L.INDEXER_DIM:]


def order_key(x: torch.Tensor) -> torch.Tensor:
    """int64 keys in the selection order of docs/conventions.md (the float order, -0 = +0, every NaN above
    +inf and tied): the kernels' uint32 keys. Tests compare selections through them."""
    bits = x.float().contiguous().view(torch.int32).long() & 0xFFFFFFFF
    key = torch.where(bits >= 0x80000000, 0xFFFFFFFF - bits, bits | 0x80000000)
    key = torch.where(key == 0x7FFFFFFF, 0x80000000, key)                      # -0 ties with +0
    return torch.where(torch.isnan(x), 0xFFFFFFFF, key)


def _top_k_rows(logits, starts, n, out_idx, k):
    """Rows r < len(n): the k columns of [starts[r], starts[r] + n[r]) with the largest logits (torch.topk:
    NaN above +inf), relative to starts[r], in any order; with n[r] <= k, [0, 1, ..., n[r] - 1, -1, ...]."""
    for r, (s, nr) in enumerate(zip(starts.tolist(), n.tolist())):
        row = torch.full((k,), -1, dtype=torch.int64, device=logits.device)
        if nr <= k:
            row[:nr] = torch.arange(nr, device=logits.device)
        else:
            row[:] = torch.topk(logits[r, s:s + nr].float(), k).indices
        out_idx[r] = row.to(out_idx.dtype)


def prefill_rows(row_starts, row_ends, num_rows: int, ncols: int):
    """(start, valid columns) per row: [row_starts, row_ends) clamped into [0, ncols]; end < start is empty."""
    s = row_starts[:num_rows].long().clamp(0, ncols)
    e = torch.maximum(row_ends[:num_rows].long(), s).clamp(max=ncols)
    return s, e - s


def decode_rows(seq_lens, next_n: int, num_rows: int, ncols: int):
    """Valid columns per row (from column 0): row r is draft r % next_n of request r // next_n. 1-D
    seq_lens (or [B, 1]) hold request lengths L, and row r sees L - next_n + r % next_n + 1 columns;
    2-D [B, next_n] (next_n > 1) hold each row's own count. Clamped into [0, ncols]."""
    r = torch.arange(num_rows, device=seq_lens.device)
    if seq_lens.dim() == 2 and seq_lens.shape[1] == next_n and next_n > 1:
        v = seq_lens.reshape(-1)[r].long()
    else:
        v = seq_lens.reshape(-1)[r // next_n].long() - next_n + r % next_n + 1
    return v.clamp(0, ncols)


def top_k_per_row_prefill(logits, row_starts, row_ends, out_idx, num_rows: int, stride0: int, stride1: int,
                          k: int) -> None:
    """vLLM's form: out_idx[r, :k] = top-k columns of logits[r, row_starts[r]:row_ends[r]], relative to the
    row start (module docstring), for r < num_rows. stride0 / stride1 are logits' strides."""
    s, n = prefill_rows(row_starts, row_ends, num_rows, logits.shape[1])
    _top_k_rows(logits, s, n, out_idx, k)


def top_k_per_row_decode(logits, next_n: int, seq_lens, out_idx, num_rows: int, stride0: int, stride1: int,
                         k: int) -> None:
    """vLLM's form: out_idx[r, :k] = top-k columns of logits[r, :n_r] with n_r from ``decode_rows``."""
    n = decode_rows(seq_lens, next_n, num_rows, logits.shape[1])
    _top_k_rows(logits, torch.zeros_like(n), n, out_idx, k)


def top_k_global_decode(logits, next_n: int, seq_lens, out_idx, num_rows: int, stride0: int, stride1: int, k: int,
                        token_to_req_indices, block_table, block_size: int, is_valid_token, output_buffers=None, *,
                        needs_constant_topk: bool = False):
    """``top_k_per_row_decode``, then ``reference.metadata.compute_global_topk_indices_and_lens`` on
    out_idx[:num_rows]: (global indices, lens)."""
    from .metadata import compute_global_topk_indices_and_lens
    top_k_per_row_decode(logits, next_n, seq_lens, out_idx, num_rows, stride0, stride1, k)
    return compute_global_topk_indices_and_lens(out_idx[:num_rows], token_to_req_indices, block_table, block_size,
                                                is_valid_token, output_buffers,
                                                needs_constant_topk=needs_constant_topk)


def persistent_topk(logits, lengths, output, workspace, k: int, max_seq_len: int) -> None:
    """vLLM's form: output[r, :k] = top-k columns of logits[r, :lengths[r]] for every row of logits; lengths
    holds one count per row in any 1-D or 2-D shape, clamped into [0, logits.shape[1]]. workspace and
    max_seq_len are vLLM's launch resources and hint; they do not change the result."""
    n = lengths.reshape(-1).long().clamp(0, logits.shape[1])
    _top_k_rows(logits, torch.zeros_like(n), n, output, k)
