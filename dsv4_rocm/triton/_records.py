"""What the kernels of several stages share: the exact scalar math of the oracles (tree sums, powers of two,
RMSNorm, the RoPE of the last 64 dims), the e4m3 / UE8M0 / E2M1 encoders and the record stores of the paged
caches (dsv4_rocm/layout.py: V40_584, V41_528, V41_FP4_288 and the indexer-K records), and the test of
whether a token writes a record. Each function does, operation for operation, what its oracle in
dsv4_rocm/reference does, so that the bytes a kernel writes are the oracle's on every device.

fp8 bytes are OCP e4m3fn on every vendor (-0 written 0x00); gfx942 (``FNUZ``) encodes x / 2 with its fnuz
convert, which gives the same byte for every value the caches hold (``_fp8.py``).
"""
import triton
import triton.language as tl

from ._fp8 import decode, encode
from ._launch import device_cache, device_facts


@triton.jit
def _pairwise_sum(v):
    """Sum of a [N] vector (N a power of two) as the tree of adjacent pairs ((v0+v1)+(v2+v3))+...
    (reference.pairwise_sum). Each level is a sum over pairs: one addition of two values, whatever lanes
    hold them, so the result does not depend on the layout Triton picks."""
    N: tl.constexpr = v.shape[0]
    for i in tl.static_range(16):
        if (N >> i) > 1:
            v = tl.sum(tl.reshape(v, (N >> (i + 1), 2)), axis=1)
    return tl.sum(v, axis=0)


@triton.jit
def _ceil_log2(x):
    """Exact ceil(log2(x)) of positive normal fp32 x from its bits (reference.quant.ceil_log2)."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def _pow2(e):
    """2^e as fp32 for integer e in the normal range."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3(v, FNUZ: tl.constexpr):
    """OCP e4m3fn bytes of fp32 v (|v| <= 448 after the clamp), RNE, -0 written 0x00."""
    v = tl.where(v > 448.0, 448.0, tl.where(v < -448.0, -448.0, v))
    if FNUZ:
        b = encode(v * 0.5, True)
    else:
        b = encode(v, False)
    return tl.where(b == 0x80, 0, b)


@triton.jit
def _ue8m0_fp8(x2, FNUZ: tl.constexpr):
    """UE8M0 fp8 quantization of the rows of x2 [NB, QB] (eps 1e-4): (bytes [NB, QB], exponent [NB],
    poisoned [NB]); a row holding NaN or +-inf is poisoned (bytes 0x7F; the caller writes its scale)."""
    bad = tl.max(((x2 != x2) | (tl.abs(x2) == float("inf"))).to(tl.int32), axis=1) > 0
    amax = tl.where(bad, 0.0, tl.max(tl.abs(x2), axis=1))
    e = _ceil_log2(tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0))
    q = _e4m3(x2 * _pow2(-e)[:, None], FNUZ)
    return tl.where(bad[:, None], 0x7F, q), e, bad


@triton.jit
def _e2m1_codes(v):
    """E2M1 codes (int32, sign in bit 3) of fp32 v: magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6; the code is the
    count of midpoints below |v| (a tie counts toward the even code, hence > or >= by the parity of the code
    above the midpoint), saturating at 6; -0 keeps its sign."""
    a = tl.abs(v)
    code = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
            + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
            + (a > 5.0).to(tl.int32))
    return code | (((v.to(tl.int32, bitcast=True) >> 31) & 1) << 3)


@triton.jit
def _rms_normalize(y, w_ptr, eps, D: tl.constexpr):
    """RMSNorm of y fp32 [D] with weight w (reference.compressor.rms_normalize, operation for operation): a
    non-finite sum of squares poisons every value."""
    var = tl.math.div_rn(_pairwise_sum(y * y), D * 1.0)
    rrms = tl.math.div_rn(1.0, tl.math.sqrt_rn(var + eps))
    rrms = tl.where(var < float("inf"), rrms, float("nan"))
    return (y * rrms) * tl.load(w_ptr + tl.arange(0, D)).to(tl.float32)


@triton.jit
def _rope_last64(x, cs_row_ptr, D: tl.constexpr):
    """GPT-J RoPE of the last 64 dims of x fp32 [D] (cs_row_ptr: the cos/sin row of the position)."""
    even, odd = tl.split(tl.reshape(x, (D // 2, 2)))
    ri = tl.arange(0, D // 2) - (D // 2 - 32)
    is_rope = ri >= 0
    cos = tl.load(cs_row_ptr + tl.where(is_rope, ri, 0), mask=is_rope, other=1.0).to(tl.float32)
    sin = tl.load(cs_row_ptr + 32 + tl.where(is_rope, ri, 0), mask=is_rope, other=0.0).to(tl.float32)
    return tl.interleave(tl.where(is_rope, even * cos - odd * sin, even),
                         tl.where(is_rope, even * sin + odd * cos, odd))


@triton.jit
def record_token(slot_ptr, pos_ptr, t, capacity, cs_rows, RATIO: tl.constexpr):
    """(slot, position, writes): token t writes a record when its slot is inside the cache, its position
    inside the cos/sin table, and it closes a group ((p + 1) % RATIO == 0)."""
    s = tl.load(slot_ptr + t).to(tl.int64)
    p = tl.load(pos_ptr + t).to(tl.int64)
    return s, p, (s >= 0) & (s < capacity) & (p >= 0) & (p < cs_rows) & ((p + 1) % RATIO == 0)


@triton.jit
def _record_ptrs(page, off, cache_bs, FMT: tl.constexpr):
    """(data, scales) pointers of record ``off`` of a page (layout.data_offset / record_scale_offset)."""
    if FMT.interleaved:
        data = page + off * FMT.token_bytes
        return data, data + FMT.data_bytes
    return page + off * FMT.data_bytes, page + cache_bs * FMT.data_bytes + off * FMT.scale_bytes


@triton.jit
def _store_main(page, off, cache_bs, yh, roped, FNUZ: tl.constexpr):
    """fp8_ds_mla record: UE8M0 fp8 of bf(yh)[:448] (blocks of 64), bf16 RoPE dims, 7 scales + pad."""
    cols = tl.arange(0, 512)
    q, e, bad = _ue8m0_fp8(tl.reshape(yh.to(tl.bfloat16).to(tl.float32), (8, 64)), FNUZ)
    data = page + off * 576
    tl.store(data + cols, tl.reshape(q, (512,)), mask=cols < 448)
    rb = roped.to(tl.bfloat16).to(tl.int16, bitcast=True)
    rb = tl.where(roped != roped, 0x7FC0, rb).to(tl.int16)
    tl.store((data + 448).to(tl.pointer_type(tl.int16)) + (cols - 448), rb, mask=cols >= 448)
    j = tl.arange(0, 8)
    sb = tl.where(bad, 255, tl.minimum(tl.maximum(e + 127, 0), 255))
    tl.store(page + cache_bs * 576 + off * 8 + j, tl.where(j < 7, sb, 0).to(tl.uint8))


@triton.jit
def _store_v41_fp8(page, off, cache_bs, x, FNUZ: tl.constexpr, FMT: tl.constexpr):
    """V41_528 record of fp32 x [512]: UE8M0 fp8 in blocks of 32 (eps 1e-4), 16 scale bytes."""
    NB: tl.constexpr = 512 // FMT.quant_block
    q, e, bad = _ue8m0_fp8(tl.reshape(x, (NB, FMT.quant_block)), FNUZ)
    data, scales = _record_ptrs(page, off, cache_bs, FMT)
    tl.store(data + tl.arange(0, 512), tl.reshape(q, (512,)))
    tl.store(scales + tl.arange(0, NB), tl.where(bad, 255, tl.minimum(tl.maximum(e + 127, 0), 255)).to(tl.uint8))


@triton.jit
def _store_v41_fp4(page, off, cache_bs, x, FNUZ: tl.constexpr, FMT: tl.constexpr):
    """V41_FP4_288 record of fp32 x [512]: per 16 dims sc = e4m3(clamp(amax * fp32(1/6), 2^-9, 448)), codes
    e2m1(x / sc) (IEEE division), two a byte (low nibble = even dim); a block holding NaN or +-inf gets
    scale 0x7F (e4m3 NaN) and nibbles 0."""
    NB: tl.constexpr = 512 // FMT.quant_block
    z = tl.reshape(x, (NB, FMT.quant_block))
    bad = tl.max(((z != z) | (tl.abs(z) == float("inf"))).to(tl.int32), axis=1) > 0
    amax = tl.where(bad, 1.0, tl.max(tl.abs(z), axis=1))
    sc_in = tl.minimum(tl.maximum(amax * (1.0 / 6.0), 0.001953125), 448.0)
    sb = _e4m3(sc_in, FNUZ).to(tl.uint8)
    if FNUZ:                   # the fnuz value of the OCP byte is half its OCP value (sb <= 0x7E)
        sc = decode(sb, True) * 2.0
    else:
        sc = decode(sb, False)
    code = tl.where(bad[:, None], 0, _e2m1_codes(tl.math.div_rn(z, sc[:, None])))
    lo, hi = tl.split(tl.reshape(code, (256, 2)))
    data, scales = _record_ptrs(page, off, cache_bs, FMT)
    tl.store(data + tl.arange(0, 256), (lo | (hi << 4)).to(tl.uint8))
    tl.store(scales + tl.arange(0, NB), tl.where(bad, 0x7F, sb).to(tl.uint8))


@triton.jit
def _store_indexer_fp8(page, off, cache_bs, roped, D: tl.constexpr, FNUZ: tl.constexpr):
    """Indexer K: one UE8M0 fp8 block of bf(roped) and its fp32 scale 2^e (NaN when poisoned)."""
    q, e, bad = _ue8m0_fp8(tl.reshape(roped.to(tl.bfloat16).to(tl.float32), (1, D)), FNUZ)
    tl.store(page + off * D + tl.arange(0, D), tl.reshape(q, (D,)))
    sbits = tl.where(bad, 0x7FC00000, (tl.where(bad, 0, e) + 127) << 23)
    tl.store((page + cache_bs * D + off * 4).to(tl.pointer_type(tl.int32)) + tl.arange(0, 1), sbits)


@triton.jit
def _store_indexer_mxfp4(page, off, cache_bs, roped, D: tl.constexpr):
    """Indexer K, MXFP4: blocks of 32 E2M1 values of bf(roped) (RNE, ties to the even code, saturating at 6),
    scale 2^ceil(log2(max(amax, 6 * 2^-126) / 6)); a poisoned block gets scale 0xFF and nibbles 0x7."""
    z = tl.reshape(roped.to(tl.bfloat16).to(tl.float32), (D // 32, 32))
    bad = tl.max(((z != z) | (tl.abs(z) == float("inf"))).to(tl.int32), axis=1) > 0
    amax = tl.maximum(tl.where(bad, 1.0, tl.max(tl.abs(z), axis=1)), 6.0 * 2.0 ** -126)
    e = _ceil_log2(tl.math.div_rn(amax, 6.0))
    code = tl.where(bad[:, None], 7, _e2m1_codes(z * _pow2(-e)[:, None]))
    lo, hi = tl.split(tl.reshape(code, (D // 2, 2)))
    tl.store(page + off * (D // 2) + tl.arange(0, D // 2), (lo | (hi << 4)).to(tl.uint8))
    tl.store(page + cache_bs * (D // 2) + off * (D // 32) + tl.arange(0, D // 32),
             tl.where(bad, 255, e + 127).to(tl.uint8))


@device_cache()
def fnuz(device) -> bool:
    """Whether ``device`` encodes fp8 through the fnuz convert (gfx942, or CPU tensors emulating it), cached
    so that a launch pays no query."""
    return device_facts(device)[1]
