"""Rotary embedding of DeepSeek-V4 (docs/math.md#rope): YaRN cos/sin table, GPT-J interleaved pairs on
the last 64 dims, forward and inverse.

cos_sin_cache: fp32 [max_pos, 64], row p = [cos(p*f_0..f_31) | sin(p*f_0..f_31)].
Pair i of a vector x with D dims is (x[D-64+2i], x[D-64+2i+1]).
"""
import math

import torch

ROPE_DIM = 64


def yarn_inv_freq(base: float, dim: int = ROPE_DIM, factor: float = 16.0, original_max: int = 65536,
                  beta_fast: float = 32.0, beta_slow: float = 1.0) -> torch.Tensor:
    """YaRN inverse frequencies (fp32 [dim/2]) as vLLM's DeepseekV4ScalingRotaryEmbedding builds them."""
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extra = 1.0 / pos_freqs
    inter = 1.0 / (factor * pos_freqs)

    def corr_dim(rot):
        return dim * math.log(original_max / (rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr_dim(beta_fast)), 0)
    high = min(math.ceil(corr_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    mask = 1.0 - ramp
    return inter * (1 - mask) + extra * mask


def build_cos_sin_cache(base: float, max_positions: int = 65536 * 16, device=None, **yarn) -> torch.Tensor:
    """fp32 [max_positions, 64] table; the real model uses max_positions = 65536*16."""
    if max_positions <= 0:
        raise ValueError(f"max_positions must be positive, got {max_positions}")
    inv = yarn_inv_freq(base, **yarn).to(device)
    t = torch.arange(max_positions, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _cos_sin(positions: torch.Tensor, cos_sin_cache: torch.Tensor):
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= cos_sin_cache.shape[0]):
        raise ValueError(f"positions must lie in [0, {cos_sin_cache.shape[0]}) (cos_sin_cache rows)")
    cs = cos_sin_cache[positions.long()].float()
    half = cs.shape[-1] // 2
    return cs[..., :half], cs[..., half:]


def _pairs(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor):
    """An fp32 copy of x and the rotary pairs of its last 64 dims (even e, odd o) with their cos and sin,
    broadcast over the dims between positions' and the pairs'."""
    x = x.float().clone()
    c, s = _cos_sin(positions, cos_sin_cache)
    while c.dim() < x.dim():
        c, s = c.unsqueeze(-2), s.unsqueeze(-2)
    return x, x[..., -ROPE_DIM::2].clone(), x[..., -ROPE_DIM + 1::2].clone(), c, s


def _rotate(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, inverse: bool):
    """x: [..., D] (any float dtype); positions broadcast against x.shape[:len(positions.shape)].
    Returns fp32 with the last 64 dims rotated."""
    x, e, o, c, s = _pairs(x, positions, cos_sin_cache)
    if inverse:
        x[..., -ROPE_DIM::2] = e * c + o * s
        x[..., -ROPE_DIM + 1::2] = o * c - e * s
    else:
        x[..., -ROPE_DIM::2] = e * c - o * s
        x[..., -ROPE_DIM + 1::2] = e * s + o * c
    return x


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 a * b + c with one rounding (a fused multiply-add), exactly, on any device: the product is exact
    in float64, the sum's float64 rounding error is recovered (two-sum) and folded in as round-to-odd, after
    which rounding to fp32 (24 bits, 29 fewer than float64's) is the single correct rounding."""
    p = a.double() * b.double()
    cd = c.double()
    t = p + cd
    back = t - p
    err = (p - (t - back)) + (cd - back)
    even = (t.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.full_like(t, float("inf")), torch.full_like(t, float("-inf")))
    t = torch.where(torch.isfinite(t) & (err != 0) & even, torch.nextafter(t, toward), t)
    return t.float()


def rope_fwd_fma(x, positions, cos_sin_cache):
    """Forward rotation with vLLM's q rounding (its RoPE reference: ``e c - o s`` and ``e s + o c`` as one
    fused multiply-add each over the other product rounded, fma(e, c, -(o s)), fma(e, s, o c)); fp32
    result. The q path of ``fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert`` rotates so (docs/numerics.md)."""
    x, e, o, c, s = _pairs(x, positions, cos_sin_cache)
    c, s = c.expand_as(e), s.expand_as(e)
    x[..., -ROPE_DIM::2] = fma32(e, c, -(o * s))
    x[..., -ROPE_DIM + 1::2] = fma32(e, s, o * c)
    return x


def rope_fwd(x, positions, cos_sin_cache):
    """Forward rotation of the last 64 dims, fp32 result (positions: [T] for x [T, ...])."""
    return _rotate(x, positions, cos_sin_cache, inverse=False)


def rope_inv(x, positions, cos_sin_cache):
    """Inverse rotation (the output path, docs/math.md#rope-inverse), fp32 result."""
    return _rotate(x, positions, cos_sin_cache, inverse=True)


def rocm_inverse_rope_rows_(o: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                            rope_head_dim: int) -> None:
    """vLLM's in-place inverse GPT-J RoPE of attention output rows: o [T, H, D] bf16, the last
    ``rope_head_dim`` dims of each (token, head) rotate back by the angles of ``cos_sin_cache[positions[t]]``
    ([P, rope_head_dim], cos | sin): e' = e c + o s, o' = o c - e s in fp32, one rounding to bf16. The
    other dims are not touched; a row whose position is outside the table is left as it is."""
    T, H, D = o.shape
    if T == 0:
        return
    half = rope_head_dim // 2
    pos = positions.long()
    ok = (pos >= 0) & (pos < cos_sin_cache.shape[0])
    cs = cos_sin_cache[torch.where(ok, pos, torch.zeros_like(pos))].float()
    c, s = cs[:, None, :half], cs[:, None, half:rope_head_dim]
    x = o[..., D - rope_head_dim:].float()
    e, od = x[..., 0::2], x[..., 1::2]
    rot = torch.stack([e * c + od * s, od * c - e * s], dim=-1).reshape(T, H, rope_head_dim)
    o[..., D - rope_head_dim:] = torch.where(ok[:, None, None], rot, x).to(o.dtype)
