"""KV compressor of C4 / C128 layers on vLLM's paged fp32 state cache (vLLM's two calls, same forms).

Per token, the projection ``kv_score = x @ fused_wkv_wgate^T`` (fp32, [T, 2 * coff * D], coff = 2 for
C4, 1 for C128) splits into kv and score halves. Two steps follow, as in vLLM:

``save_partial_states``: every token with a state slot >= 0 stores ``[kv | score + ape[pos % r]]`` (fp32,
``2 * state_width`` floats, state_width = coff * D) at its slot of the state cache
``[num_blocks, block_size, 2 * state_width]`` (block_size 4 for C4, 8 for C128; page stride = stride(0)).

``compress_norm_rope_store``: a token at position p with (p + 1) % r == 0 produces compressed entry
j = p // r from the window of the W = coff * r positions p - W + 1 .. p, read back from the state cache
through its block table (so a window that began in an earlier chunk or decode step is complete):
    C4:   window row u < 4 uses the first D floats of kv / score, u >= 4 the second D; positions < 0 absent
    C128: 128 rows, all D floats
    y    = sum_u softmax_u(score)[u, c] * kv[u, c]
    yh   = RMSNorm(y; w, eps)                       fp32, no bf16 rounding first
    main (D = 512):   a record of the format the cache's last dimension names (584 / 528 / 288):
                      V40_584: NoPE = UE8M0 fp8 of bf(yh)[:448] in blocks of 64 (eps 1e-4),
                               RoPE = bf(RoPE(yh, j * r))[448:]
                      V41_528 / V41_FP4_288: all 512 dims of x = RoPE(bf(yh), j * r) (the bf16 latent rotated
                               in fp32, no second rounding), UE8M0 fp8 per 32 or e2m1 + e4m3 per 16
                               (reference.cache.encode_values)
    indexer (D = 128): z = bf(RoPE(yh, j * r)); one 128-block UE8M0 fp8 + fp32 scale 2^e, or (use_fp4)
                      MXFP4: 4 blocks of 32 E2M1 nibbles (low nibble = even index) + 4 UE8M0 bytes
The record goes to ``k_cache_metadata.slot_mapping[t]`` of ``kv_cache`` ([nb, bs, record bytes]; data
region ``[bs x token_stride]`` then scale region ``[bs x scale_dim]`` per page, or interleaved records for
an interleaved V4.1 format; page stride = stride(0)).

Exact fp32 arithmetic, shared with the Triton kernels so that cache bytes match on every device:
    softmax   m = max_u s_u;  e_u = exp_neg(s_u - m);  num = sum_u e_u * kv_u and den = sum_u e_u, each a
              pairwise tree over the W rows ((u0 + u1) + (u2 + u3)) + ...;  y = num / den (IEEE division)
    exp_neg   Cody-Waite reduction by ln 2 and a degree-7 Taylor polynomial in plain IEEE mul / add
              (no fused multiply-add), 2^k from the exponent bits; 0 below -80
    RMSNorm   sum of squares by a pairwise tree over the D values; rrms = 1 / sqrt(sum / D + eps)
              (IEEE sqrt and division); yh = (y * rrms) * w; a non-finite sum makes every yh NaN
Non-finite values poison their quantization blocks (docs/conventions.md); bf16 NaN is written 0x7FC0.
Padding: a negative (or out-of-range) state slot, request id, position or cache slot skips the token;
a window row whose block-table entry is negative or out of range is absent (score -inf, kv 0).
"""
import torch

from .. import layout as L
from ..layout import state_block_size  # noqa: F401
from .cache import encode_values
from .quant import exponent_to_ue8m0, mxfp4_quantize, quantize_blocks
from .rope import rope_fwd

KV_EPS = 1e-4
EXP_FLUSH = -80.0                  # exp_neg(x) = 0 below this: it never returns a subnormal
LOG2E = 1.4426950408889634
LN2_HI = 0.693145751953125         # 16 significant bits: k * LN2_HI is exact for |k| < 256
LN2_LO = 1.4286067653302226e-06
EXP_POLY = (1 / 5040, 1 / 720, 1 / 120, 1 / 24, 1 / 6, 1 / 2, 1.0, 1.0)   # Horner, highest power first
BF16_NAN = 0x7FC0
F32_NAN = 0x7FC00000


def coff(ratio: int) -> int:
    return 2 if ratio == 4 else 1


def window(ratio: int) -> int:
    return coff(ratio) * ratio


def new_state_cache(num_blocks: int, ratio: int, head_dim: int, device=None, page_align: int = 576,
                    block_size: int = None):
    """A zeroed fp32 state cache [num_blocks, block_size, 2 * coff * head_dim] whose page stride is
    padded to a multiple of ``page_align`` bytes, as vLLM pads pages shared with fp8_ds_mla caches
    (block_size: vLLM's, ``state_block_size(ratio)``, unless given)."""
    bs, width = block_size or state_block_size(ratio), 2 * coff(ratio) * head_dim
    page = -(-bs * width * 4 // page_align) * page_align // 4
    buf = torch.zeros(num_blocks, page, dtype=torch.float32, device=device)
    return buf[:, :bs * width].view(num_blocks, bs, width) if page == bs * width else \
        torch.as_strided(buf, (num_blocks, bs, width), (page, width, 1))


def kv_cache_view(pages: torch.Tensor, block_size: int, record_bytes: int) -> torch.Tensor:
    """vLLM's [nb, block_size, record_bytes] view of [nb, page_bytes] pages (page stride kept)."""
    return torch.as_strided(pages, (pages.shape[0], block_size, record_bytes), (pages.stride(0), record_bytes, 1),
                            pages.storage_offset())


def compressor_kv_score(x, fused_wkv_wgate):
    """x bf16 [T, hidden] @ fused_wkv_wgate bf16 [2 * coff * D, hidden]^T -> fp32 [T, 2 * coff * D]."""
    return x.float() @ fused_wkv_wgate.float().t()


# ---- the state save -------------------------------------------------------------------------------
def save_partial_states(kv, score, ape, positions, state_cache, slot_mapping, block_size: int, state_width: int,
                        compress_ratio: int, pdl_kwargs=None) -> None:
    """state_cache[slot] = [kv | score + ape[pos % r]] for the first len(slot_mapping) tokens."""
    n = slot_mapping.shape[0]
    nb = state_cache.shape[0]
    s = slot_mapping.long()
    p = positions[:n].long()
    ok = (s >= 0) & (s < nb * block_size) & (p >= 0)
    blk, off = s[ok] // block_size, s[ok] % block_size
    h = kv.shape[-1]
    state_cache[blk, off, :h] = kv[:n][ok].float()
    state_cache[blk, off, state_width:state_width + h] = score[:n][ok].float() + ape.float()[p[ok] % compress_ratio]


# ---- exact fp32 arithmetic shared with the kernels ------------------------------------------------
def _f32(v, like):
    return torch.tensor(v, dtype=torch.float32, device=like.device)


def exp_neg(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for x <= 0 (fp32) in plain IEEE operations; within 2 ulp of exp, 0 below -80, NaN stays NaN."""
    t = x * _f32(LOG2E, x)
    k = torch.floor(t + _f32(0.5, x))
    k = torch.where((k == k) & (x >= EXP_FLUSH), k, torch.zeros_like(k))
    r = (x - k * _f32(LN2_HI, x)) - k * _f32(LN2_LO, x)
    p = torch.full_like(r, EXP_POLY[0])
    for c in EXP_POLY[1:]:
        p = p * r + _f32(c, x)
    scale = ((k.to(torch.int32) + 127) << 23).view(torch.float32)
    return torch.where(x < EXP_FLUSH, torch.zeros_like(x), p * scale)


def pairwise_sum(v: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (a power of two) as a tree of adjacent pairs: ((v0+v1)+(v2+v3))+..."""
    while v.shape[-1] > 1:
        v = v[..., 0::2] + v[..., 1::2]
    return v[..., 0]


def pool(score: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """Softmax over the window rows (dim -2) of score, applied to kv: [..., W, D] -> [..., D]."""
    e = exp_neg(score - score.amax(-2, keepdim=True))
    return pairwise_sum((e * kv).transpose(-1, -2)) / pairwise_sum(e.transpose(-1, -2))


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 sqrt (IEEE, as the GPUs' sqrt.rn), on any torch build: some CPU builds of
    torch compute fp32 (and fp64) sqrt with a last-bit error. r = the fp32 rounding of the fp64 root is
    then moved to a neighbour when x lies outside the squares of the midpoints around r; a midpoint of
    two fp32 values has 25 significant bits, so its square is exact in fp64 (ties cannot occur)."""
    xd = x.double()
    r = torch.sqrt(xd).float()
    inf = torch.full_like(r, float("inf"))
    lo, hi = torch.nextafter(r, -inf).double(), torch.nextafter(r, inf).double()
    rd = r.double()
    below = xd < ((lo + rd) * 0.5) ** 2
    above = xd > ((hi + rd) * 0.5) ** 2
    fix = torch.isfinite(r) & (r > 0)
    r = torch.where(fix & below, lo.float(), r)
    return torch.where(fix & above & ~below, hi.float(), r)


def rms_normalize(y: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    var = pairwise_sum(y * y) / _f32(y.shape[-1], y)
    rrms = torch.ones_like(var) / sqrt_rn(var + _f32(eps, y))
    rrms = torch.where(var < float("inf"), rrms, torch.full_like(rrms, float("nan")))
    return (y * rrms.unsqueeze(-1)) * weight.float()


def bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """RNE bf16 bits (int16) of fp32 x, NaN written as 0x7FC0 on every device."""
    b = x.to(torch.bfloat16).view(torch.int16)
    return torch.where(torch.isnan(x), torch.full_like(b, BF16_NAN), b)


# ---- the fused compress + norm + RoPE + quant + store ---------------------------------------------
def _as_pages(cache: torch.Tensor, record_bytes: int) -> torch.Tensor:
    """uint8 [nb, bs * record_bytes] view of a [nb, bs, record_bytes] (or [nb, bs, 1, rec]) cache."""
    c = cache.view(torch.uint8)
    return torch.as_strided(c, (c.shape[0], c.shape[1] * record_bytes), (c.stride(0), 1), c.storage_offset())


def _window_rows(state_cache, block_table, req, pos, ratio, block_size, state_width, head_dim):
    """(score, kv) fp32 [n, W, head_dim] of the windows ending at pos; absent rows -inf / 0."""
    W = window(ratio)
    u = torch.arange(W, device=pos.device)
    wp = pos.unsqueeze(1) - W + 1 + u                                  # [n, W] positions
    col = torch.where(wp >= 0, wp // block_size, torch.zeros_like(wp))
    ok = (wp >= 0) & (col < block_table.shape[1])
    bn = block_table[req.unsqueeze(1), col.clamp(max=block_table.shape[1] - 1)].long()
    ok &= (bn >= 0) & (bn < state_cache.shape[0])
    rows = state_cache[torch.where(ok, bn, 0), torch.where(ok, wp % block_size, 0)]   # [n, W, 2 * width]
    half = (u >= ratio).long() * head_dim if ratio == 4 else torch.zeros_like(u)
    cols = half.unsqueeze(1) + torch.arange(head_dim, device=pos.device)          # [W, D]
    kv = torch.gather(rows, 2, cols.expand(rows.shape[0], W, head_dim))
    sc = torch.gather(rows, 2, (cols + state_width).expand(rows.shape[0], W, head_dim))
    okx = ok.unsqueeze(-1)
    return torch.where(okx, sc, torch.full_like(sc, float("-inf"))), torch.where(okx, kv, torch.zeros_like(kv))


def _records(yh, pos_c, cos_sin_cache, head_dim, use_fp4, fmt=L.V40_584):
    """(data bytes [n, token_stride], scale bytes [n, scale_dim]) of the entries."""
    if head_dim == 512 and fmt.quant_dims == 512:
        rec = encode_values(rope_fwd(yh.to(torch.bfloat16).float(), pos_c, cos_sin_cache), fmt)
        return rec[:, :fmt.data_bytes], rec[:, fmt.data_bytes:]
    roped = rope_fwd(yh, pos_c, cos_sin_cache)
    if head_dim == 512:
        q, e = quantize_blocks(yh.to(torch.bfloat16).float()[:, :448], 64, KV_EPS)
        rope = bf16_bits(roped[:, 448:]).view(torch.uint8)
        scales = torch.cat([exponent_to_ue8m0(e), torch.zeros_like(e[:, :1], dtype=torch.uint8)], 1)
        return torch.cat([q, rope], 1), scales
    z = roped.to(torch.bfloat16).float()
    if use_fp4:
        return mxfp4_quantize(z)
    q, e = quantize_blocks(z, 128, KV_EPS)
    bits = torch.where(e >= 128, torch.full_like(e, F32_NAN), (e + 127) << 23)
    return q, bits.to(torch.int32).view(torch.uint8)


def compress_norm_rope_store(state_cache, num_actual, token_to_req_indices, positions, slot_mapping, block_table,
                             block_size, state_width, cos_sin_cache, kv_cache, k_cache_metadata, pdl_kwargs, head_dim,
                             rope_head_dim, compress_ratio, overlap, use_fp4_cache, rms_norm_weight, rms_norm_eps,
                             quant_block, token_stride, scale_dim, fmt: L.RecordFormat = L.V40_584) -> None:
    """Write the compressed entries of the boundary tokens among the first num_actual tokens (``fmt``: the
    record format of a head-512 cache)."""
    n = num_actual
    dev = state_cache.device
    kslots = k_cache_metadata.slot_mapping[:n].long()
    pages = _as_pages(kv_cache, token_stride + scale_dim)
    kbs = kv_cache.shape[1]
    p = positions[:n].long()
    req = token_to_req_indices[:n].long()
    ok = (slot_mapping[:n] >= 0) & (p >= 0) & (p < cos_sin_cache.shape[0]) & ((p + 1) % compress_ratio == 0)
    ok &= (req >= 0) & (req < block_table.shape[0]) & (kslots >= 0) & (kslots < pages.shape[0] * kbs)
    t = torch.nonzero(ok).flatten()
    if t.numel() == 0:
        return
    sc, kv = _window_rows(state_cache, block_table, req[t], p[t], compress_ratio, block_size, state_width, head_dim)
    yh = rms_normalize(pool(sc, kv), rms_norm_weight, rms_norm_eps)
    data, scales = _records(yh, (p[t] // compress_ratio) * compress_ratio, cos_sin_cache, head_dim, use_fp4_cache,
                            fmt)
    blk, off = (kslots[t] // kbs).unsqueeze(1), (kslots[t] % kbs).unsqueeze(1)
    ar_d = torch.arange(token_stride, device=dev)
    ar_s = torch.arange(scale_dim, device=dev)
    if head_dim == 512:                       # where the record format puts its data and scale bytes
        d0, s0 = L.data_offset(fmt, off), L.record_scale_offset(fmt, kbs, off)
    else:
        d0, s0 = off * token_stride, kbs * token_stride + off * scale_dim
    pages[blk, d0 + ar_d] = data
    pages[blk, s0 + ar_s] = scales
