"""Output path of the layer (vLLM's and DeepGEMM's call forms), FP8 linears with block scales, and merging
of attention states (vLLM's in-place form).

Output path (T tokens, H heads of 512 = 448 nope + 64 rope dims, G groups of H/G heads):
    o'  = RoPE_inv(o, pos) on dims 448..511, in fp32 (never re-rounded to bf16)
    a8  = UE8M0 fp8 of o' per 128 values of a head (eps 1e-10; docs/conventions.md "Numerics"), grouped
          [T, G, (H/G) * 512]; ``quant_group_size`` QG in QUANT_GROUPS makes the blocks QG values
    z   = fp8_einsum("bhr,hdr->bhd", (a8, sa), (wo_a, s_w), z): sum over r of dequantized a8 x wo_a, in
          exact arithmetic here (float64), rounded once to fp32 and then to z's dtype

Layouts (vLLM's ``fused_inv_rope_fp8_quant``): the fp8 output is a [T, G, D] view of [G, T, D] storage,
strides (D, T * D, 1). Scales are MN-major: a [T, G, K] view of [G, K, T4] storage (T4 = T rounded up to
a multiple of 4, the TMA alignment; the rows past T hold 0), strides (1, K * T4, T4). With
``tma_aligned_scales=False`` (vLLM's SM90 form) K = (H/G) * CH fp32 scales 2^e (CH = 512 / QG blocks a
head, 4 by default); with ``True`` (the SM100 form) K = (H/G) * CH / 4 int32 words, byte j of word w the
UE8M0 byte e + 127 of block 4w + j of the group's row (one word a head by default). A poisoned
block has scale NaN (fp32) or byte 0xFF.

DeepGEMM's scale forms for ``fp8_einsum`` (recipe = (1, gran_n, 128)): activation scales [T, G, r/128]
fp32 or [T, G, ceil(r/512)] int32 (4 UE8M0 bytes a word, block 4i + j in byte j); weight scales
[G, ceil(d/128), r/128] fp32 with gran_n = 128, or per row (gran_n = 1) as [G, d, r/128] fp32 or
[G, d, ceil(r/512)] int32. Any strides. UE8M0 byte b is 2^(b - 127), 0xFF NaN.

Weights of the FP8 linears are e4m3 with one power-of-two scale per 128 x 128 block; their activations
are quantized per token per 128 columns with eps 1e-4.
"""
import torch

from ..layout import tma_aligned_tokens  # noqa: F401
from .quant import UE8M0_NAN, e4m3_decode, e4m3_encode, e4m3fnuz_encode, exponent_to_ue8m0, quantize_blocks
from .rope import rope_inv

O_EPS = 1e-10
ACT_EPS = 1e-4
# block sizes of the output quantization: 128 is DeepSeek-V4's; vLLM's op also runs 32 (its tests) and any
# power of two dividing 512 (the packed UE8M0 form needs 4 blocks a head: 32, 64, 128)
QUANT_GROUPS = (32, 64, 128, 256, 512)


def _pow2(e):
    return torch.ldexp(torch.ones_like(e, dtype=torch.float32), e.float())


def _mn_major(values: torch.Tensor) -> torch.Tensor:
    """[T, G, K] values -> the same values as a [T, G, K] view of zero-padded [G, K, T4] storage."""
    T, G, K = values.shape
    T4 = tma_aligned_tokens(T)
    store = torch.zeros(G, K, T4, dtype=values.dtype, device=values.device)
    store[:, :, :T] = values.permute(1, 2, 0)
    return store.as_strided((G, T, K), (K * T4, 1, T4)).transpose(0, 1)


def fused_inv_rope_fp8_quant(o, positions, cos_sin_cache, n_groups: int, heads_per_group: int, nope_dim: int = 448,
                             rope_dim: int = 64, quant_group_size: int = 128, tma_aligned_scales: bool = False,
                             quantize: bool = True):
    """o bf16 [T, H, 512] -> (fp8 [T, G, (H/G) * 512] over [G, T, D] storage, MN-major scales); see above.
    ``quantize=False`` (vLLM 0.33): (bf16 o' rounded to nearest even [T, G, D] over [G, T, D] storage, an
    empty scale tensor: int32 with ``tma_aligned_scales``, else fp32)."""
    T, H, D = o.shape
    if H != n_groups * heads_per_group or (nope_dim, rope_dim) != (448, 64) or quant_group_size not in QUANT_GROUPS:
        raise ValueError(f"expected H = n_groups * heads_per_group heads of 448 + 64 dims in blocks of one of "
                         f"{QUANT_GROUPS}")
    x = rope_inv(o, positions, cos_sin_cache)
    d = heads_per_group * D
    if not quantize:
        rows = torch.empty(n_groups, T, d, dtype=torch.bfloat16, device=o.device)
        rows.copy_(x.to(torch.bfloat16).reshape(T, n_groups, d).transpose(0, 1))
        empty = torch.empty(0, dtype=torch.int32 if tma_aligned_scales else torch.float32, device=o.device)
        return rows.transpose(0, 1), empty
    q, e = quantize_blocks(x, quant_group_size, O_EPS)
    data = torch.empty(n_groups, T, d, dtype=torch.uint8, device=o.device)
    data.copy_(q.reshape(T, n_groups, d).transpose(0, 1))
    data = data.view(torch.float8_e4m3fn).transpose(0, 1)
    e = e.reshape(T, n_groups, heads_per_group, D // quant_group_size)
    K = heads_per_group * (D // quant_group_size)          # scales a group's row
    if tma_aligned_scales:     # block 4w + j of a head in byte j (little-endian) of its word w
        words = exponent_to_ue8m0(e).contiguous().view(torch.int32).reshape(T, n_groups, K // 4)
    else:
        words = torch.where(e >= UE8M0_NAN - 127, float("nan"), _pow2(e)).reshape(T, n_groups, K)
    return data, _mn_major(words)


def ue8m0_words_to_scales(words: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """int32 words [..., W] of 4 UE8M0 bytes (block 4i + j in byte j) -> fp32 scales [..., n_blocks]."""
    b = torch.stack([(words >> (8 * j)) & 0xFF for j in range(4)], -1).flatten(-2)[..., :n_blocks]
    return torch.where(b == UE8M0_NAN, float("nan"), _pow2(b - 127))


def scale_values(s: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """DeepGEMM scales (fp32 values or packed UE8M0 int32 words) -> fp32 [..., n_blocks]."""
    return ue8m0_words_to_scales(s, n_blocks) if s.dtype == torch.int32 else s.float()


def fp8_einsum(expr, a, b, d, c=None, recipe=(1, 128, 128)) -> None:
    """DeepGEMM's ``fp8_einsum("bhr,hdr->bhd", (a8, sa), (w8, sw), d, recipe=(1, gran_n, 128))``: writes d
    [T, G, d_out] = sum_r a[t, g, r] * w[g, n, r] over the dequantized operands (scale forms above)."""
    if expr != "bhr,hdr->bhd" or c is not None:
        raise ValueError("only 'bhr,hdr->bhd' without c is implemented")
    (a8, sa), (w8, sw) = a, b
    T, G, r = a8.shape
    N, nb = w8.shape[1], r // 128
    av = e4m3_decode(a8.view(torch.uint8)) * scale_values(sa, nb).repeat_interleave(128, -1)
    ws = scale_values(sw, nb).repeat_interleave(recipe[1], -2)[:, :N]
    wv = e4m3_decode(w8.view(torch.uint8)) * ws.repeat_interleave(128, -1)
    d.copy_(torch.einsum("bhr,hdr->bhd", av.double(), wv.double()).float().to(d.dtype))


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
    xq = e4m3_decode(q) * s.repeat_interleave(128, -1)
    return (xq @ dequantize_weight(w8.view(torch.uint8), w_scale).t()).to(torch.bfloat16)


def merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse=None,
                      prefill_tokens_with_context=None, output_scale=None) -> None:
    """vLLM's in-place merge of two partial attentions over disjoint key sets (docs/math.md#merge-attn-states).

    output / prefix_output / suffix_output [T, H, D], prefix_lse / suffix_lse / output_lse [H, T] fp32
    (natural log). For token t < n = prefill_tokens_with_context (all tokens when None), per head:
        p, s = the two lse with +inf read as -inf (an empty part: FlashMLA's and FA2's +inf, or -inf)
        m = max(p, s);  a = exp(p - m);  b = exp(s - m)
        output = prefix_output * (a / (a + b)) + suffix_output * (b / (a + b)),  output_lse = m + ln(a + b)
    both parts empty: output 0, output_lse -inf. Tokens t >= n take suffix_output and suffix_lse (+inf
    written -inf). fp32 math, one rounding to output's dtype; with ``output_scale`` (fp32, one element) the
    output is the e4m3 byte of value * (1 / scale), RNE: float8_e4m3fn saturating at +-448, -0 written 0x00
    (``quant.e4m3_encode``); float8_e4m3fnuz (vLLM's fp8 on gfx942) saturating at vLLM's +-224, NaN 0x80
    (``quant.e4m3fnuz_encode``)."""
    T = output.shape[0]
    n = T if prefill_tokens_with_context is None else prefill_tokens_with_context

    def norm(lse):
        lse = lse.float()
        return torch.where(torch.isposinf(lse), torch.full_like(lse, float("-inf")), lse)
    p, s = norm(prefix_lse).t(), norm(suffix_lse).t()                 # [T, H]
    m = torch.maximum(p, s)
    empty = torch.isneginf(m)
    ms = torch.where(empty, torch.zeros_like(m), m)
    a, b = torch.exp(p - ms), torch.exp(s - ms)
    tot = a + b
    merged = prefix_output.float() * (a / tot).unsqueeze(-1) + suffix_output.float() * (b / tot).unsqueeze(-1)
    merged = torch.where(empty.unsqueeze(-1), torch.zeros_like(merged), merged)
    lse = torch.where(empty, torch.full_like(m, float("-inf")), torch.log(tot) + ms)
    ctx = (torch.arange(T, device=output.device) < n).unsqueeze(-1)
    merged = torch.where(ctx.unsqueeze(-1), merged, suffix_output.float())
    lse = torch.where(ctx, lse, s)
    if output_scale is not None:
        inv = torch.reciprocal(output_scale.float().reshape(()))
        encode = e4m3fnuz_encode if output.dtype == torch.float8_e4m3fnuz else e4m3_encode
        output.view(torch.uint8).copy_(encode(merged * inv))
    else:
        output.copy_(merged.to(output.dtype))
    if output_lse is not None:
        output_lse.copy_(lse.t())
