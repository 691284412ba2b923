"""Output path (DSV4_SPEC §8), FP8 linears with block scales, and merging of attention states.

    o'  = RoPE_inv(o) on dims 448..511, fp32 (no bf16 rounding)
    a8  = UE8M0 FP8 of o' per 128 values (eps 1e-10), viewed [T, G, (H/G)*512]
    z   = fp8_einsum("bhr,hdr->bhd", (a8, sa), (wo_a, s_w))  fp32 accumulate -> bf16 [T, G, o_lora]
Weights are e4m3 with one power-of-two scale per 128 x 128 block (UE8M0); activations of an FP8
linear are quantized per token per 128 columns with eps 1e-4.
"""
import torch

from .quant import e4m3_decode, quantize_blocks
from .rope import rope_inv

O_EPS = 1e-10
ACT_EPS = 1e-4


def _pow2(e):
    return torch.ldexp(torch.ones_like(e, dtype=torch.float32), e.float())


def fused_inv_rope_fp8_quant(o, positions, cos_sin_cache, n_groups: int):
    """o bf16 [T, H, 512] -> (a8 uint8 [T, G, (H/G)*512], scales fp32 [T, G, (H/G)*4])."""
    T, H, D = o.shape
    if H % n_groups:
        raise ValueError(f"n_groups {n_groups} must divide the head count {H}")
    x = rope_inv(o, positions, cos_sin_cache)
    q, e = quantize_blocks(x, 128, O_EPS)
    return q.reshape(T, n_groups, -1), _pow2(e).reshape(T, n_groups, -1)


def dequant_scaled(q8, scale, block: int):
    """bytes [..., n] with fp32 scales [..., n/block] -> fp32 (any scale, not only powers of two)."""
    v = e4m3_decode(q8).reshape(*q8.shape[:-1], q8.shape[-1] // block, block)
    return (v * scale.float().unsqueeze(-1)).reshape(q8.shape)


def fp8_einsum(a8, a_scale, w8, w_scale) -> torch.Tensor:
    """'bhr,hdr->bhd': a8 [T, G, r] (scales [T, G, r/128]) x w8 [G, d, r] (scales [G, d/128, r/128])."""
    a = dequant_scaled(a8, a_scale, 128)
    w = dequantize_weight(w8, w_scale)
    return torch.einsum("bhr,hdr->bhd", a, w).to(torch.bfloat16)


def quantize_weight(w: torch.Tensor):
    """fp32 [..., N, K] -> (e4m3 bytes [..., N, K], fp32 power-of-two scales [..., N/128, K/128])."""
    *lead, N, K = w.shape
    if N % 128 or K % 128:
        raise ValueError(f"weight dims {N}x{K} must be multiples of 128")
    blocks = w.float().reshape(*lead, N // 128, 128, K // 128, 128).transpose(-3, -2)
    q, e = quantize_blocks(blocks.reshape(*lead, N // 128, K // 128, 128 * 128), 128 * 128, ACT_EPS)
    q = q.reshape(*lead, N // 128, K // 128, 128, 128).transpose(-3, -2).reshape(*lead, N, K)
    return q, _pow2(e[..., 0])


def dequantize_weight(w8, w_scale) -> torch.Tensor:
    s = w_scale.float().repeat_interleave(128, -2).repeat_interleave(128, -1)
    return e4m3_decode(w8) * s


def quantize_activation(x: torch.Tensor):
    """Per token, per 128 columns: (bytes, fp32 power-of-two scales)."""
    q, e = quantize_blocks(x.float(), 128, ACT_EPS)
    return q, _pow2(e)


def fp8_linear(x, w8, w_scale) -> torch.Tensor:
    """bf16 [T, K] x block-FP8 weight [N, K] -> bf16 [T, N] (DeepGEMM 1x128 / 128x128 recipe)."""
    q, s = quantize_activation(x)
    return (dequant_scaled(q, s, 128) @ dequantize_weight(w8, w_scale).t()).to(torch.bfloat16)


def merge_attn_states(out_a, lse_a, out_b, lse_b):
    """Merge two partial attentions over disjoint key sets: out [T, H, D], lse [T, H] (natural log).
    An empty part has lse +inf (FlashMLA's convention) or -inf; it contributes nothing. Both empty:
    out 0, lse +inf."""
    def norm(l):
        return torch.where(torch.isposinf(l), torch.full_like(l, float("-inf")), l.float())
    la, lb = norm(lse_a), norm(lse_b)
    m = torch.maximum(la, lb)
    empty = torch.isneginf(m)
    ms = torch.where(empty, torch.zeros_like(m), m)
    wa, wb = torch.exp(la - ms), torch.exp(lb - ms)
    tot = wa + wb
    safe = torch.where(empty, torch.ones_like(tot), tot)
    out = (out_a.float() * (wa / safe).unsqueeze(-1) + out_b.float() * (wb / safe).unsqueeze(-1))
    out = torch.where(empty.unsqueeze(-1), torch.zeros_like(out), out)
    lse = torch.where(empty, torch.full_like(m, float("inf")), ms + torch.log(safe))
    return out.to(out_a.dtype), lse
