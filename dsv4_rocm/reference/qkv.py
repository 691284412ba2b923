"""Fused Q norm + RoPE and KV RoPE + quant + SWA insert (DSV4_SPEC §3-4), one vLLM op."""
import torch

from .cache import quantize_and_insert_k_cache
from .norm import rmsnorm
from .rope import rope_fwd


def q_norm_rope(q: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, eps: float) -> torch.Tensor:
    """bf(RoPE_fwd(RMSNorm_noweight(q_h))) per head, fp32 inside, one rounding. q: [T, H, 512]."""
    return rope_fwd(rmsnorm(q, None, eps), positions, cos_sin_cache).to(torch.bfloat16)


def kv_rope(kv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """bf(RoPE_fwd(kv)) on the last 64 dims; NoPE dims are unchanged bf16 values. kv: [T, 512]."""
    return rope_fwd(kv, positions, cos_sin_cache).to(torch.bfloat16)


def fused_qnorm_rope_kv_rope_quant_insert(q, kv, swa_kv_cache_2d, slot_mapping, positions, cos_sin_cache,
                                          padded_heads: int, eps: float, block_size: int) -> torch.Tensor:
    """Returns q_padded bf16 [T, padded_heads, 512] (heads past H are zero) and writes the SWA cache."""
    T, H, _ = q.shape
    out = torch.zeros(T, padded_heads, q.shape[2], dtype=torch.bfloat16, device=q.device)
    out[:, :H] = q_norm_rope(q, positions, cos_sin_cache, eps)
    n = slot_mapping.shape[0]
    quantize_and_insert_k_cache(kv_rope(kv[:n], positions[:n], cos_sin_cache), swa_kv_cache_2d, slot_mapping,
                                block_size)
    return out
