"""Lightning indexer of C4 layers (DSV4_SPEC §6): q RoPE + FP8 quant with weight fold, logits, top-k.

    logit[t, j] = sum_h w'[t, h] * ReLU((q8[t, h] . k8[j]) * s_k[j])     j in [ks[t], ke[t])
    w'[t, h]    = w[t, h] * s_q[t, h] * 128^-0.5 * H^-0.5
Outside the row's range the logit is -inf. Top-k returns indices relative to the row start, the valid
ones first, -1 after them; with n <= k valid columns it returns [0, 1, ..., n-1, -1, ...].
"""
import torch

from .cache import indexer_k_gather
from .quant import e4m3_decode, e4m3_encode, ue8m0_exponent
from .rope import rope_fwd

INDEX_EPS = 1e-4


def indexer_q_rope_quant(qi: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                         weights: torch.Tensor, softmax_scale: float = 128 ** -0.5):
    """qi bf16 [T, H, 128], weights [T, H] -> (q8 uint8 [T, H, 128], w' fp32 [T, H])."""
    T, H, D = qi.shape
    rope = rope_fwd(qi, positions, cos_sin_cache)[..., D - 64:].to(torch.bfloat16).float()
    x = torch.cat([qi[..., :D - 64].float(), rope], dim=-1)
    e = ue8m0_exponent(x.abs().amax(-1), INDEX_EPS)
    q8 = e4m3_encode(torch.ldexp(x, -e.unsqueeze(-1).float()))
    w = weights.float() * torch.ldexp(torch.ones_like(e, dtype=torch.float32), e.float()) \
        * softmax_scale * H ** -0.5
    return q8, w


def _logits(q8, k8, k_scale, weights):
    s = torch.einsum("thd,nd->thn", e4m3_decode(q8), e4m3_decode(k8)) * k_scale.float().view(1, 1, -1)
    return torch.einsum("thn,th->tn", torch.relu(s), weights.float())


def fp8_mqa_logits(q8, k8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke) -> torch.Tensor:
    """Prefill logits over a contiguous K: q8 [T, H, 128], k8 [N, 128], k_scale [N] -> fp32 [T, N]."""
    lg = _logits(q8, k8, k_scale, weights)
    j = torch.arange(k8.shape[0], device=lg.device).unsqueeze(0)
    ok = (j >= cu_seqlen_ks.long().unsqueeze(1)) & (j < cu_seqlen_ke.long().unsqueeze(1))
    return lg.masked_fill(~ok, float("-inf"))


def fp8_paged_mqa_logits(q8, kv_cache, weights, context_lens, block_table, block_size: int,
                         max_context_len: int) -> torch.Tensor:
    """Decode logits over the paged indexer cache: q8 [B, next_n, H, 128], weights [B*next_n, H],
    context_lens [B] or [B, next_n] -> fp32 [B*next_n, max_context_len], -inf past the context."""
    B, nn, H, D = q8.shape
    cl = context_lens.long()
    cl = cl.unsqueeze(1).expand(B, nn) if cl.dim() == 1 else cl
    out = torch.full((B * nn, max_context_len), float("-inf"), device=q8.device)
    j = torch.arange(max_context_len, device=q8.device)
    for b in range(B):
        n = int(cl[b].max()) if nn else 0
        if n <= 0:
            continue
        jj = j[:n]
        slots = block_table[b, jj // block_size].long() * block_size + jj % block_size
        k8, ks = indexer_k_gather(kv_cache, slots, block_size)
        lg = _logits(q8[b], k8, ks, weights[b * nn:(b + 1) * nn])
        ok = jj.unsqueeze(0) < cl[b].unsqueeze(1)
        out[b * nn:(b + 1) * nn, :n] = lg.masked_fill(~ok, float("-inf"))
    return out


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


def persistent_topk(logits, lengths, output, workspace, k: int, max_seq_len: int) -> None:
    """vLLM's form: output[r, :k] = top-k columns of logits[r, :lengths[r]] for every row of logits; lengths
    holds one count per row in any 1-D or 2-D shape, clamped into [0, logits.shape[1]]. workspace and
    max_seq_len are vLLM's launch resources and hint; they do not change the result."""
    n = lengths.reshape(-1).long().clamp(0, logits.shape[1])
    _top_k_rows(logits, torch.zeros_like(n), n, output, k)
