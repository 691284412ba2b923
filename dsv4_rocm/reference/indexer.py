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


def top_k_per_row(logits: torch.Tensor, row_starts: torch.Tensor, row_ends: torch.Tensor, k: int) -> torch.Tensor:
    """int32 [T, k] column indices relative to row_starts of the k largest logits in [start, end)."""
    T, N = logits.shape
    out = torch.full((T, k), -1, dtype=torch.int32, device=logits.device)
    for t in range(T):
        a, b = int(row_starts[t]), int(row_ends[t])
        n = max(b - a, 0)
        if n <= k:
            out[t, :n] = torch.arange(n, dtype=torch.int32, device=logits.device)
        else:
            out[t] = torch.topk(logits[t, a:b], k).indices.to(torch.int32)
    return out
