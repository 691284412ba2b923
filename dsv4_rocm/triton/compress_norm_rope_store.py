"""Fused compressor step: softmax pooling of a window read from the paged state cache, RMSNorm, RoPE,
UE8M0 quantization and insertion into the compressed cache (vLLM's ``compress_norm_rope_store_triton``).

Only a token at a window boundary ((p + 1) % r == 0, state slot >= 0, cache slot >= 0) does work; the
others' programs return at once. Its window is the W = coff * r positions p - W + 1 .. p: row u lives in
state block ``block_table[req, pos_u // bs]`` at offset ``pos_u % bs`` (``[kv | score]``, fp32,
``2 * state_width`` floats; C4 rows u >= 4 use the second D floats of each half), loaded as vectors of
columns, eight rows at a time. A row whose position is negative or whose block-table entry is out of
range is absent. C4 (8 rows) runs as one program per token. C128 (128 rows, 512 KB a window) runs in
two launches of the same kernel so that a step with few boundary tokens still fills the GPU: STAGE 1
pools 16-column slices of y in [programs, D / 16] programs into a scratch row per program, STAGE 2
finishes each entry (norm, RoPE, quant, store) from it. A prefill-sized step (more than two tokens a
request) first lists its boundary tokens (``compressor_entries``) and launches a program per listed
entry instead of one per token.

The arithmetic is exactly that of ``dsv4_rocm.reference.compressor`` (the module docstring there), in the
same order and with plain IEEE operations: the kernel is compiled with fp fusion off (no contraction into
fused multiply-adds), divisions and the square root are correctly rounded (``div_rn``, ``sqrt_rn``), the
exponential is a fixed polynomial, and every sum is an explicit tree, so the cache bytes are the same on
every device and equal to the reference's. Output records (page p = slot // bs, offset o = slot % bs,
page stride = ``kv_cache.stride(0)``):
    TARGET 0, main K (D 512):    data at p + o * 576: 448 e4m3 bytes (bf(yh), blocks of 64) + 64 bf16 RoPE;
                                 scales at p + bs * 576 + o * 8: 7 UE8M0 bytes and a 0 pad byte
    TARGET 1, indexer K FP8:     128 e4m3 bytes at p + o * 128; fp32 scale 2^e at p + bs * 128 + o * 4
    TARGET 2, indexer K MXFP4:   64 bytes of E2M1 pairs (low nibble even) at p + o * 64; 4 UE8M0 bytes at
                                 p + bs * 64 + o * 4
fp8 bytes are OCP e4m3fn on every vendor (-0 written 0x00); gfx942 encodes x / 2 with its fnuz convert,
which gives the same byte for every value the cache can hold.
"""
import functools

import torch
import triton
import triton.language as tl

from ..platform import detect
from .compressor_entries import compressor_entries

MAIN, INDEXER_FP8, INDEXER_MXFP4 = 0, 1, 2


@triton.jit
def _exp_neg(x):
    """exp(x), x <= 0: the polynomial of reference.compressor.exp_neg, operation for operation."""
    k = tl.floor(x * 1.4426950408889634 + 0.5)
    k = tl.where((k == k) & (x >= -80.0), k, 0.0)
    r = (x - k * 0.693145751953125) - k * 1.4286067653302226e-06
    p = r * (1.0 / 5040) + (1.0 / 720)
    p = p * r + (1.0 / 120)
    p = p * r + (1.0 / 24)
    p = p * r + (1.0 / 6)
    p = p * r + 0.5
    p = p * r + 1.0
    p = p * r + 1.0
    scale = ((k.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(x < -80.0, 0.0, p * scale)


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
def _pairwise_sum_rows(x):
    """Column sums of x [R, C] (R a power of two) as the tree of adjacent rows, ((r0+r1)+(r2+r3))+..."""
    R: tl.constexpr = x.shape[0]
    C: tl.constexpr = x.shape[1]
    for i in tl.static_range(16):
        if (R >> i) > 1:
            x = tl.sum(tl.reshape(x, (R >> (i + 1), 2, C)), axis=1)
    return tl.reshape(x, (C,))


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
        b = (v * 0.5).to(tl.float8e4b8).to(tl.uint8, bitcast=True)
    else:
        b = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
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
    v = z * _pow2(-e)[:, None]
    a = tl.abs(v)
    # E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6: the code is the count of midpoints below |v| (a tie counts
    # toward the even code, hence > or >= by the parity of the code above the midpoint)
    code = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
            + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
            + (a > 5.0).to(tl.int32))
    code = code | (((v.to(tl.int32, bitcast=True) >> 31) & 1) << 3)
    code = tl.where(bad[:, None], 7, code)
    lo, hi = tl.split(tl.reshape(code, (D // 2, 2)))
    tl.store(page + off * (D // 2) + tl.arange(0, D // 2), (lo | (hi << 4)).to(tl.uint8))
    tl.store(page + cache_bs * (D // 2) + off * (D // 32) + tl.arange(0, D // 32),
             tl.where(bad, 255, e + 127).to(tl.uint8))


@triton.jit
def _pool(state_ptr, stride0, stride1, num_blocks, bt_row, bt_cols, sbs, pos, cols, D: tl.constexpr,
          RATIO: tl.constexpr, OVERLAP: tl.constexpr):
    """Softmax pooling y[cols] (fp32) of the window ending at pos, loaded as one [W, len(cols)] tile: the
    max over the rows, e_u = exp(s_u - max), the sums of e_u and e_u * kv_u as pairwise trees over the rows,
    then num / den. Columns are independent, so a program may take any subset of them."""
    W: tl.constexpr = (1 + OVERLAP) * RATIO
    u = tl.arange(0, W)
    wp = pos + 1 - W + u                                 # positions of the window rows
    ok = wp >= 0
    blk = tl.where(ok, wp // sbs, 0)
    ok = ok & (blk < bt_cols)
    bn = tl.load(bt_row + blk, mask=ok, other=-1).to(tl.int64)
    ok = ok & (bn >= 0) & (bn < num_blocks)
    row = tl.where(ok, bn, 0) * stride0 + tl.where(ok, wp % sbs, 0) * stride1 + (u >= RATIO).to(tl.int64) * (
        OVERLAP * D)                                     # C4: rows 4..7 read the second D floats of each half
    ptr = state_ptr + row[:, None] + cols[None, :]
    mask = ok[:, None] & (cols >= 0)[None, :]
    sc = tl.load(ptr + (1 + OVERLAP) * D, mask=mask, other=float("-inf"))
    kv = tl.load(ptr, mask=mask, other=0.0)
    e = _exp_neg(sc - tl.max(sc, axis=0)[None, :])
    return tl.math.div_rn(_pairwise_sum_rows(e * kv), _pairwise_sum_rows(e))


@triton.jit
def _norm_rope(y, w_ptr, eps, cs_row_ptr, D: tl.constexpr):
    """(yh, RoPE(yh)) fp32 [D]: RMSNorm of the pooled y (a non-finite sum of squares poisons every value),
    then GPT-J RoPE of the last 64 dims on the fp32 yh (cs_row_ptr: the cos/sin row of the entry)."""
    var = tl.math.div_rn(_pairwise_sum(y * y), D * 1.0)
    rrms = tl.math.div_rn(1.0, tl.math.sqrt_rn(var + eps))
    rrms = tl.where(var < float("inf"), rrms, float("nan"))
    yh = (y * rrms) * tl.load(w_ptr + tl.arange(0, D)).to(tl.float32)
    even, odd = tl.split(tl.reshape(yh, (D // 2, 2)))
    ri = tl.arange(0, D // 2) - (D // 2 - 32)
    is_rope = ri >= 0
    cos = tl.load(cs_row_ptr + tl.where(is_rope, ri, 0), mask=is_rope, other=1.0)
    sin = tl.load(cs_row_ptr + 32 + tl.where(is_rope, ri, 0), mask=is_rope, other=0.0)
    roped = tl.interleave(tl.where(is_rope, even * cos - odd * sin, even),
                          tl.where(is_rope, even * sin + odd * cos, odd))
    return yh, roped


@triton.jit
def _compress_norm_rope_store_kernel(
        state_ptr, state_stride0, state_stride1, num_state_blocks, t2r_ptr, pos_ptr, sslot_ptr, bt_ptr, bt_stride,
        bt_cols, num_reqs, state_bs, w_ptr, eps, cs_ptr, cs_stride, cs_rows, cache_ptr, kslot_ptr, cache_bs,
        page_stride, num_cache_slots, scratch_ptr, list_ptr, count_ptr,
        D: tl.constexpr, RATIO: tl.constexpr, OVERLAP: tl.constexpr, TARGET: tl.constexpr,
        FNUZ: tl.constexpr, STAGE: tl.constexpr, NSPLIT: tl.constexpr, USE_LIST: tl.constexpr):
    """STAGE 0: the whole entry in one program. STAGE 1 (grid [tokens, NSPLIT]): the pooled y of a slice of
    D / NSPLIT columns into scratch[t]. STAGE 2: y from scratch[t], then norm, RoPE, quant and store.
    With USE_LIST, program i takes the i-th token of the entry list (compressor_entries) instead of token i."""
    row = tl.program_id(0).to(tl.int64)                 # also this program's scratch row
    if USE_LIST:
        if row >= tl.load(count_ptr):
            return
        t = tl.load(list_ptr + row).to(tl.int64)
    else:
        t = row
    sslot = tl.load(sslot_ptr + t)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    if (sslot < 0) | (pos < 0) | (pos >= cs_rows) | ((pos + 1) % RATIO != 0):
        return
    req = tl.load(t2r_ptr + t).to(tl.int64)
    kslot = tl.load(kslot_ptr + t).to(tl.int64)
    if (req < 0) | (req >= num_reqs) | (kslot < 0) | (kslot >= num_cache_slots):
        return
    bt_row = bt_ptr + req * bt_stride
    if STAGE == 1:
        cols = tl.program_id(1) * (D // NSPLIT) + tl.arange(0, D // NSPLIT)
        y = _pool(state_ptr, state_stride0, state_stride1, num_state_blocks, bt_row, bt_cols, state_bs, pos, cols, D,
                  RATIO, OVERLAP)
        tl.store(scratch_ptr + row * D + cols, y)
    else:
        cols = tl.arange(0, D)
        if STAGE == 2:
            y = tl.load(scratch_ptr + row * D + cols)
        else:
            y = _pool(state_ptr, state_stride0, state_stride1, num_state_blocks, bt_row, bt_cols, state_bs, pos,
                      cols, D, RATIO, OVERLAP)
        yh, roped = _norm_rope(y, w_ptr, eps, cs_ptr + ((pos // RATIO) * RATIO) * cs_stride, D)
        page = cache_ptr + (kslot // cache_bs) * page_stride
        off = kslot % cache_bs
        if TARGET == 0:
            _store_main(page, off, cache_bs, yh, roped, FNUZ)
        elif TARGET == 1:
            _store_indexer_fp8(page, off, cache_bs, roped, D, FNUZ)
        else:
            _store_indexer_mxfp4(page, off, cache_bs, roped, D)


@functools.lru_cache(maxsize=None)
def _fnuz(device) -> bool:
    """gfx942 writes the OCP fp8 bytes through its fnuz convert (see the module docstring)."""
    return detect(device).arch == "gfx942"


def _splits(head_dim: int, ratio: int) -> int:
    """Column slices of the pooling stage: a C128 window (128 rows) is split over programs of 16 columns
    (a [128, 16] tile of scores and of kv each, 64 B of every row); a C4 window (8 rows) is pooled by the
    program that stores the entry."""
    return head_dim // 16 if ratio == 128 else 1


def _num_warps(head_dim: int, stage: int) -> int:
    return 8 if stage == 1 or head_dim == 512 else 2


def compress_norm_rope_store(state_cache, num_actual, token_to_req_indices, positions, slot_mapping, block_table,
                             block_size, state_width, cos_sin_cache, kv_cache, k_cache_metadata, pdl_kwargs, head_dim,
                             rope_head_dim, compress_ratio, overlap, use_fp4_cache, rms_norm_weight, rms_norm_eps,
                             quant_block, token_stride, scale_dim) -> None:
    """vLLM's call form; arguments checked by ``dsv4_rocm.ops.compress_norm_rope_store``."""
    if num_actual == 0:
        return
    target = MAIN if head_dim == 512 else (INDEXER_MXFP4 if use_fp4_cache else INDEXER_FP8)
    kbs = kv_cache.shape[1]
    nsplit = _splits(head_dim, compress_ratio)
    programs, use_list = num_actual, num_actual > 2 * block_table.shape[0]
    entries = count = slot_mapping
    if use_list:                       # prefill-sized step: at most N // r + (one per request) entries
        programs = min(num_actual, num_actual // compress_ratio + block_table.shape[0])
        entries, count = compressor_entries(positions, slot_mapping, k_cache_metadata.slot_mapping,
                                            token_to_req_indices, num_actual, compress_ratio, cos_sin_cache.shape[0],
                                            block_table.shape[0], kv_cache.shape[0] * kbs, programs)
    scratch = torch.empty(programs, head_dim, dtype=torch.float32, device=state_cache.device) if nsplit > 1 \
        else state_cache
    args = (state_cache, state_cache.stride(0), state_cache.stride(1), state_cache.shape[0], token_to_req_indices,
            positions, slot_mapping, block_table, block_table.stride(0), block_table.shape[1], block_table.shape[0],
            block_size, rms_norm_weight, rms_norm_eps, cos_sin_cache, cos_sin_cache.stride(0), cos_sin_cache.shape[0],
            kv_cache.view(torch.uint8), k_cache_metadata.slot_mapping, kbs, kv_cache.stride(0),
            kv_cache.shape[0] * kbs, scratch, entries, count)
    meta = dict(D=head_dim, RATIO=compress_ratio, OVERLAP=int(overlap), TARGET=target, FNUZ=_fnuz(state_cache.device),
                NSPLIT=nsplit, USE_LIST=use_list, num_stages=1, enable_fp_fusion=False)
    for stage, grid in (((1, (programs, nsplit)), (2, (programs,))) if nsplit > 1 else ((0, (programs,)),)):
        _compress_norm_rope_store_kernel[grid](*args, STAGE=stage, num_warps=_num_warps(head_dim, stage), **meta)


def _spec(name, d, ratio, target, stage, use_list):
    nsplit = _splits(d, ratio)
    return dict(
        name=name, fn=_compress_norm_rope_store_kernel,
        pointers=dict(state_ptr="*fp32", t2r_ptr="*i32", pos_ptr="*i64", sslot_ptr="*i64", bt_ptr="*i32",
                      w_ptr="*bf16", cs_ptr="*fp32", cache_ptr="*u8", kslot_ptr="*i64", scratch_ptr="*fp32",
                      list_ptr="*i32", count_ptr="*i32"),
        floats=("eps",),
        constexprs=lambda arch: dict(D=d, RATIO=ratio, OVERLAP=int(ratio == 4), TARGET=target, FNUZ=arch == "gfx942",
                                     STAGE=stage, NSPLIT=nsplit, USE_LIST=use_list),
        options=lambda arch: dict(num_warps=_num_warps(d, stage), num_stages=1, enable_fp_fusion=False),
        matrix=False, fp8_encode=target != INDEXER_MXFP4 and stage != 1, exact_fp32=True)


COMPILE_SPECS = [
    _spec("compress_norm_rope_store[c4 main]", 512, 4, MAIN, 0, False),
    _spec("compress_norm_rope_store[c4 main, listed]", 512, 4, MAIN, 0, True),
    _spec("compress_norm_rope_store[c128 main, pool]", 512, 128, MAIN, 1, True),
    _spec("compress_norm_rope_store[c128 main, finish]", 512, 128, MAIN, 2, True),
    _spec("compress_norm_rope_store[c4 indexer fp8]", 128, 4, INDEXER_FP8, 0, False),
    _spec("compress_norm_rope_store[c4 indexer mxfp4]", 128, 4, INDEXER_MXFP4, 0, False),
]
