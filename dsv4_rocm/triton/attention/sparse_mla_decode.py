"""Sparse MLA attention straight from paged KV records (decode, and prefill without a workspace).

Math, per query token t and head h, over the valid keys of two index sets (the
sliding window in ``k_cache`` and the compressed entries in ``extra_k_cache``), K = V:

    l_i = sm * <q_h, K_i>      lse = ln sum_i exp(l_i)      out = softmax(l) @ K * sigmoid(lse - sink_h)

Memory layout read: each set's record format (``dsv4_rocm.layout.RecordFormat``) is a constexpr of the
kernel (MAIN_FMT, EXTRA_FMT); key slot s lives in page s // bs at offset o = s % bs, its data and scale
bytes where ``layout.data_offset`` / ``record_scale_offset`` put them (page-split or interleaved). For
V40_584: 448 NoPE bytes (e4m3, OCP) at ``page*stride + o*576``, 64 bf16 RoPE values right after them, 7
UE8M0 scale bytes at ``page*stride + bs*576 + o*8``. The kernel loads a tile of BLOCK_N keys as
[BLOCK_N, 512 / quant_block, quant_block] (one scale per chunk: [BN, 8, 64] for V40_584, whose 8th chunk
is the bf16 RoPE dims; [BN, 16, 32] for V41_528; [BN, 32, 8] bytes of e2m1 pairs for V41_FP4_288),
dequantizes it exactly into bf16 (a power-of-two scale, or an e2m1 value times an e4m3 scale), which
gives the key rows in their natural 512-wide order: one MMA for the scores, one for P.V. Online softmax
in base 2; P is rounded to bf16 for the P.V MMA (as FlashMLA does). When the two sets hold different
formats (V41_528 + V41_FP4_288) each set has its own loop.

On gfx942 the same bytes are read as fnuz e4m3, whose value is half the OCP value for every byte the
cache can hold (-0 is never written), so the scale exponent is raised by one (an e4m3 scale is doubled).

Grid: (tokens x head blocks, splits); token t = b * s_q + s is query s of batch row b, and q, indices,
lengths and out are addressed through their (b, s, head) strides, so strided views are read and written
in place. With splits (SPLIT, count at run time) each program handles a contiguous range of key tiles
and writes a normalized partial output and its lse into a cached scratch buffer. ``_combine_kernel``
merges them in a second launch (the default), or (``config=dict(split_combine="kernel")``, COMBINE) the
split programs of a (token, head block) count their arrivals in a cached int32 buffer
(``_launch.counters``) and the last to arrive merges the partials, applies the sink and resets the count to
0, so a call is one launch and a graph replays it as is; both merge with ``_merge_splits``. A query with no
valid key gets out = 0 and lse = +inf.

On Hopper the launcher can run the warp-specialized Gluon kernel of ``sparse_mla_decode_ws.py`` instead
(the same arguments but the counters, with its tiles per CTA where this kernel takes the split count;
same outputs, its split partials merged by ``_combine_kernel``); ``DEFAULT_SM90_KERNEL`` /
``config=dict(kernel=...)`` pick the kernel. That kernel reads V40_584 caches and V41_528 caches (either page
layout, both caches of one format and layout: ``sparse_mla_decode_ws.reads``); calls over other formats (a
V41_FP4_288 extra cache, FNUZ-flavour records) run this file's kernel on Hopper too.
"""
import contextlib
import functools
import warnings
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ... import layout as L
from .._compat import GLUON_WS, by_triton
from .._decode_tiles import DECODE_POINTERS, e2m1_to_scaled_bf16_ptx, e4m3_to_scaled_bf16_ptx, program_tiles
from .._fp8 import INTERPRETED, decode, e2m1_to_scaled_bf16_model, e4m3_to_scaled_bf16_model
from .._launch import cdiv, counters, device_cache, device_facts, launch, scratch
from .._pdl import pdl_start

_ws = None
if GLUON_WS:                              # the Hopper kernel is written in Gluon (Triton 3.6 to 3.8: _compat)
    try:
        from ..hopper import sparse_mla_decode_ws as _ws
    except Exception:  # noqa: BLE001  (no Gluon, or a Gluon of another API: the Triton kernel runs everywhere)
        _ws = None

LOG2E = 1.4426950408889634


_E4M3_TO_SCALED_BF16 = tl.constexpr("{\n.reg .b32 t0, t1;\n" + e4m3_to_scaled_bf16_ptx("$0", "$1") + "}")
_E2M1_TO_SCALED_BF16 = tl.constexpr("{\n.reg .b32 t0, t1;\n" + e2m1_to_scaled_bf16_ptx("$0", "$1", "$2") + "}")


@triton.jit
def _e4m3_to_scaled_bf16(kb):
    """OCP e4m3 bytes -> bf16 holding value * 2^-120, with integer ops only (NVIDIA;
    ``_decode_tiles.e4m3_to_scaled_bf16_ptx`` says how)."""
    if INTERPRETED:         # the interpreter runs no PTX: the same integer operations (_fp8.py)
        k = e4m3_to_scaled_bf16_model(kb)
    else:
        k = tl.inline_asm_elementwise(asm=_E4M3_TO_SCALED_BF16, constraints="=r,=r,r", args=[kb],
                                      dtype=tl.bfloat16, is_pure=True, pack=4)
    return k


@triton.jit
def _tile_idx(idx_ptr, n, n_valid, capacity):
    """The key ids of one tile (positions ``n`` of an index row, ``n_valid`` of them valid) and which are
    valid; invalid ids become 0 and read nothing."""
    inb = n < n_valid
    idx = tl.load(idx_ptr + n, mask=inb, other=-1)
    valid = inb & (idx >= 0) & (idx < capacity)
    return tl.where(valid, idx, 0), valid


@triton.jit
def _tile_rec(cache_ptr, page_stride, idx, valid, BS, FMT: tl.constexpr):
    """Where the records of a tile's ids are: (byte offsets of their data [BN], their scale bytes as int64
    words). The scale bytes of a record are aligned 8-byte words (8 B for V40_584: one word [BN]; 16 / 32 B
    for the V4.1 formats: [BN, 2] / [BN, 4]), loaded here, a tile ahead of the data. Record addresses follow
    ``dsv4_rocm.layout.data_offset`` / ``record_scale_offset``."""
    page = (idx // BS).to(tl.int64) * page_stride
    off = (idx % BS).to(tl.int64)
    if FMT.interleaved:
        data = page + off * FMT.token_bytes
        soff = data + FMT.data_bytes
    else:
        data = page + off * FMT.data_bytes
        soff = page + BS * FMT.data_bytes + off * FMT.scale_bytes
    words = (cache_ptr + soff).to(tl.pointer_type(tl.int64))
    if FMT.scale_bytes == 8:
        scales = tl.load(words, mask=valid, other=0)
    else:
        w = tl.arange(0, FMT.scale_bytes // 8)
        scales = tl.load(words[:, None] + w[None, :], mask=valid[:, None], other=0)
    return data, scales


@triton.jit
def _tile_addr(cache_ptr, page_stride, capacity, idx_ptr, n, n_valid, BS, FMT: tl.constexpr):
    """(data offsets, scale words, valid) of one tile: its ids, then where their records are."""
    idx, valid = _tile_idx(idx_ptr, n, n_valid, capacity)
    data, scales = _tile_rec(cache_ptr, page_stride, idx, valid, BS, FMT)
    return data, scales, valid


@triton.jit
def _set_of(tile, hi, tiles_main, n_main, n_extra, main_ptr, extra_ptr, main_stride, extra_stride, main_cap,
            extra_cap, main_idx_row, extra_idx_row, MAIN_BS: tl.constexpr, EXTRA_BS: tl.constexpr,
            BLOCK_N: tl.constexpr):
    """Which set key tile ``tile`` of the combined sequence reads: (cache, page stride, capacity, index row,
    first position in the row, valid count (0 at or past ``hi``: nothing is read), block size)."""
    m = tile < tiles_main
    return (tl.where(m, main_ptr, extra_ptr), tl.where(m, main_stride, extra_stride), tl.where(m, main_cap, extra_cap),
            tl.where(m, main_idx_row, extra_idx_row), tl.where(m, tile, tile - tiles_main) * BLOCK_N,
            tl.where(tile < hi, tl.where(m, n_main, n_extra), 0), tl.where(m, MAIN_BS, EXTRA_BS))


@triton.jit
def _scale_bytes(scal, NS: tl.constexpr):
    """The NS scale bytes of each record (int32 [BN, NS]) from its scale words (int64 [BN] or [BN, NS // 8])."""
    c = tl.arange(0, 8)
    if len(scal.shape) == 1:
        sb = (scal[:, None] >> (c[None, :] * 8).to(tl.int64)) & 0xFF
    else:
        sb = tl.reshape((scal[:, :, None] >> (c[None, None, :] * 8).to(tl.int64)) & 0xFF, (scal.shape[0], NS))
    return sb.to(tl.int32)


@triton.jit
def _tile_keys(cache_ptr, data, scal, valid, FNUZ: tl.constexpr, DEQ_INT: tl.constexpr, FMT: tl.constexpr,
               rec_fnuz=0, MIX: tl.constexpr = False):
    """Gather and dequantize the keys of one tile: K bf16 [BN, 512] in the natural dim order (e2m1 records:
    ``_fp4_keys``, e4m3 ones: ``_fp8_keys``). MIX: the tile's records are FNUZ-flavoured when ``rec_fnuz``
    (a run-time flag: one loop over two sets of one format in different flavours); else FMT says."""
    if FMT.elem_bits == 4:
        k = _fp4_keys(cache_ptr, data, scal, valid, FNUZ, DEQ_INT, FMT)
    else:
        k = _fp8_keys(cache_ptr, data, scal, valid, FNUZ, DEQ_INT, FMT, rec_fnuz, MIX)
    return k


@triton.jit
def _fp8_keys(cache_ptr, data, scal, valid, FNUZ: tl.constexpr, DEQ_INT: tl.constexpr, FMT: tl.constexpr, rec_fnuz,
              MIX: tl.constexpr):
    """Keys of a tile of e4m3 records. The row is read as NC chunks of quant_block dims: the first QC
    quantized (e4m3, one UE8M0 scale each), the rest (V40_584: one chunk of 64) bf16."""
    QB: tl.constexpr = FMT.quant_block
    NC: tl.constexpr = 512 // QB
    QC: tl.constexpr = FMT.quant_dims // QB
    tl.static_assert(512 - FMT.quant_dims == (NC - QC) * QB and NC - QC <= 1)
    c8 = tl.arange(0, NC)
    d64 = tl.arange(0, QB)
    is_nope = (c8 < QC)[None, :, None]
    kb = tl.load(cache_ptr + data[:, None, None] + c8[None, :, None] * QB + d64[None, None, :],
                 mask=valid[:, None, None] & is_nope, other=0)
    sb = _scale_bytes(scal, NC)
    if QC < NC:
        rope_ptr = (cache_ptr + data + FMT.quant_dims).to(tl.pointer_type(tl.bfloat16))
        kr = tl.load(rope_ptr[:, None] + d64[None, :], mask=valid[:, None], other=0.0)
    # the scale's exponent field se for the bytes as this target reads them: FNUZ (gfx942 reads the bytes
    # as fnuz, half their OCP value) raises the scale byte by one, a FNUZ-flavour record (its scale byte is
    # one higher than the OCP record's) lowers it by one; a poisoned block (scale byte 0xFF) stays NaN
    SHIFT: tl.constexpr = FNUZ - (FMT.fp8 == "e4m3fnuz")
    MOVED: tl.constexpr = MIX | (SHIFT != 0)
    if MIX:
        se = tl.maximum(sb + (FNUZ - rec_fnuz), 0)
    elif SHIFT != 0:
        se = tl.maximum(sb + SHIFT, 0)
    else:
        se = sb
    if DEQ_INT:
        # value * 2^-120 times 2^(se - 7), as two exact bf16 multiplies: 2^(min(se, 134) - 7) and
        # 2^(max(se, 134) - 134) are both representable (bf16 stops at 2^127); a scale byte of 0xFF
        # (a poisoned block) multiplies by NaN. A branch on the rare large scales costs more registers
        # than the second multiply.
        sbi = se
        m1 = ((tl.minimum(sbi, 134) + 120) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
        m2 = tl.where(sb == 255, 0x7FC0, (tl.maximum(sbi, 134) - 7) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
        kq = _e4m3_to_scaled_bf16(kb) * m1[:, :, None] * m2[:, :, None]
        if QC < NC:
            kq = tl.where(is_nope, kq, kr[:, None, :])
        return tl.reshape(kq, (kb.shape[0], 512))
    scale = (se << 23).to(tl.float32, bitcast=True)         # unmoved 0xFF: +inf, times the block's NaN bytes
    if MOVED:
        scale = tl.where(sb == 255, float("nan"), scale)
    kf = decode(kb, FNUZ)
    k3 = kf * scale[:, :, None]
    if QC < NC:
        k3 = tl.where(is_nope, k3, kr.to(tl.float32)[:, None, :])
    # every value is a bf16 value (an e4m3 value times a power of two, or a bf16 RoPE value): truncating
    # is exact and cheaper than rounding on AMD
    return tl.reshape(k3.to(tl.bfloat16, fp_downcast_rounding="rtz"), (kb.shape[0], 512))


@triton.jit
def _e4m3_value(b, FNUZ: tl.constexpr):
    """fp32 value of OCP e4m3fn bytes b (int32), through the same hardware converts as the key bytes: on
    gfx942 the byte read as fnuz is half the OCP value, and 0x7F / 0xFF (NaN in OCP, finite in fnuz) are
    made NaN explicitly."""
    b8 = b.to(tl.uint8)
    if FNUZ:
        v = decode(b8, True) * 2.0
        return tl.where((b & 0x7F) == 0x7F, float("nan"), v)
    return decode(b8, False)


@triton.jit
def _fp4_keys(cache_ptr, data, scal, valid, FNUZ: tl.constexpr, DEQ_INT: tl.constexpr, FMT: tl.constexpr):
    """Keys of a tile of e2m1 records (V41_FP4_288): byte i of the data holds dims 2i (low nibble) and 2i + 1;
    one e4m3 scale per 16 dims (8 bytes). The tile is read as [BN, 32 scale blocks, 8 bytes], its nibbles
    interleaved into codes in the natural dim order, K = value * scale: one exact multiply (2 + 4
    significant bits fit bf16), no division. On NVIDIA (DEQ_INT) a code's value comes from a byte-permute
    table (``_e2m1_to_scaled_bf16``); elsewhere every e2m1 value is an e4m3 value, so each code becomes its
    e4m3 byte and goes through the hardware convert the fp8 records use (``_e2m1_value``).

    On sm_90a / sm_100a the nibble interleave (a register join Triton cannot fold into the shared-memory
    store of the tile) pushes the 64 x 64 tile's loop past 255 registers: ptxas spills loop-invariant wgmma
    descriptors (the compile matrix reports the bytes; docs/platforms.md)."""
    NS: tl.constexpr = FMT.quant_dims // FMT.quant_block
    PB: tl.constexpr = FMT.quant_block // 2
    c = tl.arange(0, NS)
    j = tl.arange(0, PB)
    pb = tl.load(cache_ptr + data[:, None, None] + c[None, :, None] * PB + j[None, None, :],
                 mask=valid[:, None, None], other=0)
    s = _e4m3_value(_scale_bytes(scal, NS), FNUZ)            # NaN for a poisoned block (0x7F)
    if DEQ_INT:
        s16 = (s * 2.0 ** 112).to(tl.bfloat16)[:, :, None]    # scale <= 448: below 2^121
        k = _e2m1_to_scaled_bf16(tl.interleave(pb & 0xF, pb >> 4)) * s16   # codes as bytes; value * 2^-112
    else:
        k = tl.interleave(_e2m1_value(pb & 0xF, FNUZ) * s[:, :, None], _e2m1_value(pb >> 4, FNUZ) * s[:, :, None])
    return tl.reshape(k.to(tl.bfloat16), (pb.shape[0], 512))


@triton.jit
def _e2m1_to_scaled_bf16(code):
    """e2m1 codes (uint8, one a byte) -> bf16 holding value * 2^-112, with integer ops only (NVIDIA;
    ``_decode_tiles.e2m1_to_scaled_bf16_ptx`` says how)."""
    if INTERPRETED:         # the interpreter runs no PTX: the same integer operations (_fp8.py)
        k = e2m1_to_scaled_bf16_model(code)
    else:
        k = tl.inline_asm_elementwise(asm=_E2M1_TO_SCALED_BF16, constraints="=r,=r,r", args=[code],
                                      dtype=tl.bfloat16, is_pure=True, pack=4)
    return k


@triton.jit
def _e2m1_value(code, FNUZ: tl.constexpr):
    """fp32 value of e2m1 codes (4 bits: sign, 2 exponent bits, 1 mantissa bit) through the hardware e4m3
    convert: magnitude m >= 2 is 2^((m >> 1) - 1) * (1 + (m & 1) / 2), the e4m3 byte with exponent field
    (m >> 1) + 6 and the low code bit as the mantissa's high bit; m = 1 (0.5) is 0x30. Zero (either sign)
    becomes the byte 0 (0x80 is NaN to gfx942's fnuz convert, which reads every byte as half its OCP value)."""
    m = code & 7
    e4 = tl.where(m >= 2, (((m >> 1) + 6) << 3) | ((m & 1) << 2), 0x30)
    e4 = tl.where(m == 0, 0, e4 | ((code & 8) << 4)).to(tl.uint8)
    if FNUZ:
        return decode(e4, True) * 2.0
    return decode(e4, False)


@triton.jit
def _attend_tile(q, k, valid, acc, m_i, l_i, sm_log2):
    """One key tile into the online softmax (base 2): scores, row max, rescale, P (bf16) . V."""
    s = tl.dot(q, tl.trans(k))
    s = tl.where(valid[None, :], s * sm_log2, float("-inf"))
    m_blk = tl.max(s, 1)
    m_new = tl.maximum(m_i, m_blk)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), k)
    return acc, m_new, l_i


@triton.jit
def _set_tiles(q, acc, m_i, l_i, sm_log2, cache_ptr, page_stride, capacity, idx_row, count, lo, hi, BS,
               BLOCK_N: tl.constexpr, FNUZ: tl.constexpr, DEQ_INT: tl.constexpr, FMT: tl.constexpr):
    """Key tiles [lo, hi) of one index set (``count`` valid indices) whose records are ``FMT`` (the loop when
    the two sets' formats differ); the next tile's addresses are loaded while one is attended."""
    offs_n = tl.arange(0, BLOCK_N)
    c_data, c_scal, c_valid = _tile_addr(cache_ptr, page_stride, capacity, idx_row, lo * BLOCK_N + offs_n,
                                         tl.where(lo < hi, count, 0), BS, FMT)
    for tile in range(lo, hi):
        n_data, n_scal, n_valid = _tile_addr(cache_ptr, page_stride, capacity, idx_row,
                                             (tile + 1) * BLOCK_N + offs_n, tl.where(tile + 1 < hi, count, 0),
                                             BS, FMT)
        k = _tile_keys(cache_ptr, c_data, c_scal, c_valid, FNUZ, DEQ_INT, FMT)
        acc, m_i, l_i = _attend_tile(q, k, c_valid, acc, m_i, l_i, sm_log2)
        c_data, c_scal, c_valid = n_data, n_scal, n_valid
    return acc, m_i, l_i


# arguments that vary with the batch or the lengths' layout are not specialized on (a new value would
# compile a new kernel inside a serving step): capacities, token and split counts, lengths strides
@triton.jit(do_not_specialize=["main_cap", "extra_cap", "num_tokens", "s_q", "num_splits", "main_len_sb",
                               "main_len_ss", "extra_len_sb", "extra_len_ss"],
            do_not_specialize_on_alignment=["main_len_ptr", "extra_len_ptr", "count_ptr"])
def _sparse_mla_paged_kernel(
        q_ptr, stride_qb, stride_qs, stride_qh,
        main_ptr, main_stride, main_cap, main_idx_ptr, stride_mib, stride_mis, main_len_ptr, main_len_sb,
        main_len_ss, main_topk,
        extra_ptr, extra_stride, extra_cap, extra_idx_ptr, stride_eib, stride_eis, extra_len_ptr, extra_len_sb,
        extra_len_ss, extra_topk,
        sink_ptr, out_ptr, stride_ob, stride_os, stride_oh, lse_ptr,
        part_o_ptr, part_lse_ptr, count_ptr, num_tokens, s_q, num_splits, sm_log2,
        MAIN_BS: tl.constexpr, EXTRA_BS: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_MAIN_LEN: tl.constexpr,
        HAS_EXTRA_LEN: tl.constexpr, HAS_SINK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
        SPLIT: tl.constexpr, COMBINE: tl.constexpr, FNUZ: tl.constexpr, DEQ_INT: tl.constexpr,
        HEADS: tl.constexpr, MERGE_H: tl.constexpr, THREADS: tl.constexpr, MAIN_FMT: tl.constexpr,
        EXTRA_FMT: tl.constexpr, XCDS: tl.constexpr = 0, IDX_AHEAD: tl.constexpr = 1,
        PDL: tl.constexpr = False):
    pdl_start(PDL)
    t64, bi, si, hb, sp, n_main, n_extra, tiles_main, lo, hi = program_tiles(
        main_len_ptr, main_len_sb, main_len_ss, main_topk, extra_len_ptr, extra_len_sb, extra_len_ss, extra_topk,
        s_q, num_splits, HEADS, BLOCK_H, BLOCK_N, HAS_EXTRA, HAS_MAIN_LEN, HAS_EXTRA_LEN, SPLIT, XCDS)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, 512)
    q_row = q_ptr + bi * stride_qb + si * stride_qs + heads[:, None].to(tl.int64) * stride_qh
    q = tl.load(q_row + cols[None, :])
    main_idx_row = main_idx_ptr + bi * stride_mib + si * stride_mis
    extra_idx_row = extra_idx_ptr + bi * stride_eib + si * stride_eis

    acc = tl.zeros([BLOCK_H, 512], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    if EXTRA_FMT.name == MAIN_FMT.name:
        # one loop over the tiles of both sets (two loops would hold two register allocations); the indices
        # of tile + 1 are loaded at the top of tile's iteration, so their latency hides behind its MMAs and
        # the record loads of a tile depend only on loop-carried values (the pipeliner can issue them early).
        # Sets of one format in different fp8 flavours (vLLM's gfx942 FNUZ window, OCP compressed entries)
        # share the loop: the tile's flavour is a run-time flag (MIX)
        MIX: tl.constexpr = EXTRA_FMT.fp8 != MAIN_FMT.fp8
        MAIN_FZ: tl.constexpr = MAIN_FMT.fp8 == "e4m3fnuz"
        EXTRA_FZ: tl.constexpr = EXTRA_FMT.fp8 == "e4m3fnuz"
        if IDX_AHEAD == 2:
            # ids two tiles ahead: a tile's ids are in registers a whole iteration before its scale words
            # are loaded, so an iteration issues the ids of tile + 2, the scale words of tile + 1 and the
            # data of tile at once and waits for one memory round trip, not for the ids and then the
            # words they address
            b0, ps0, cap0, row0, n0, cnt0, bs0 = _set_of(lo, hi, tiles_main, n_main, n_extra, main_ptr, extra_ptr,
                                                         main_stride, extra_stride, main_cap, extra_cap, main_idx_row,
                                                         extra_idx_row, MAIN_BS, EXTRA_BS, BLOCK_N)
            i0, c_valid = _tile_idx(row0, n0 + offs_n, cnt0, cap0)
            c_data, c_scal = _tile_rec(b0, ps0, i0, c_valid, bs0, MAIN_FMT)
            c_base = b0
            _, _, cap1, row1, n1, cnt1, _ = _set_of(lo + 1, hi, tiles_main, n_main, n_extra, main_ptr, extra_ptr,
                                                    main_stride, extra_stride, main_cap, extra_cap, main_idx_row,
                                                    extra_idx_row, MAIN_BS, EXTRA_BS, BLOCK_N)
            i1, v1 = _tile_idx(row1, n1 + offs_n, cnt1, cap1)
            for tile in range(lo, hi):
                _, _, cap2, row2, n2, cnt2, _ = _set_of(tile + 2, hi, tiles_main, n_main, n_extra, main_ptr,
                                                        extra_ptr, main_stride, extra_stride, main_cap, extra_cap,
                                                        main_idx_row, extra_idx_row, MAIN_BS, EXTRA_BS, BLOCK_N)
                i2, v2 = _tile_idx(row2, n2 + offs_n, cnt2, cap2)
                b1, ps1, _, _, _, _, bs1 = _set_of(tile + 1, hi, tiles_main, n_main, n_extra, main_ptr, extra_ptr,
                                                   main_stride, extra_stride, main_cap, extra_cap, main_idx_row,
                                                   extra_idx_row, MAIN_BS, EXTRA_BS, BLOCK_N)
                n_data, n_scal = _tile_rec(b1, ps1, i1, v1, bs1, MAIN_FMT)
                k = _tile_keys(c_base, c_data, c_scal, c_valid, FNUZ, DEQ_INT, MAIN_FMT,
                               tl.where(tile < tiles_main, MAIN_FZ, EXTRA_FZ).to(tl.int32), MIX)
                acc, m_i, l_i = _attend_tile(q, k, c_valid, acc, m_i, l_i, sm_log2)
                c_base, c_data, c_scal, c_valid = b1, n_data, n_scal, v1
                i1, v1 = i2, v2
        else:
            in_main = lo < tiles_main
            c_base = tl.where(in_main, main_ptr, extra_ptr)
            c_data, c_scal, c_valid = _tile_addr(c_base, tl.where(in_main, main_stride, extra_stride),
                                                 tl.where(in_main, main_cap, extra_cap),
                                                 tl.where(in_main, main_idx_row, extra_idx_row),
                                                 tl.where(in_main, lo, lo - tiles_main) * BLOCK_N + offs_n,
                                                 tl.where(in_main, n_main, n_extra), tl.where(in_main, MAIN_BS, EXTRA_BS),
                                                 MAIN_FMT)
            for tile in range(lo, hi):
                nx = tile + 1
                nx_main = nx < tiles_main
                n_base = tl.where(nx_main, main_ptr, extra_ptr)
                n_data, n_scal, n_valid = _tile_addr(n_base, tl.where(nx_main, main_stride, extra_stride),
                                                     tl.where(nx_main, main_cap, extra_cap),
                                                     tl.where(nx_main, main_idx_row, extra_idx_row),
                                                     tl.where(nx_main, nx, nx - tiles_main) * BLOCK_N + offs_n,
                                                     tl.where(nx < hi, tl.where(nx_main, n_main, n_extra), 0),
                                                     tl.where(nx_main, MAIN_BS, EXTRA_BS), MAIN_FMT)
                k = _tile_keys(c_base, c_data, c_scal, c_valid, FNUZ, DEQ_INT, MAIN_FMT,
                               tl.where(tile < tiles_main, MAIN_FZ, EXTRA_FZ).to(tl.int32), MIX)
                acc, m_i, l_i = _attend_tile(q, k, c_valid, acc, m_i, l_i, sm_log2)
                c_base, c_data, c_scal, c_valid = n_base, n_data, n_scal, n_valid
    else:
        # the sets hold different record formats (a V41_FP4_288 extra cache): a loop over each
        acc, m_i, l_i = _set_tiles(q, acc, m_i, l_i, sm_log2, main_ptr, main_stride, main_cap, main_idx_row, n_main,
                                   lo, tl.minimum(hi, tiles_main), MAIN_BS, BLOCK_N, FNUZ, DEQ_INT, MAIN_FMT)
        acc, m_i, l_i = _set_tiles(q, acc, m_i, l_i, sm_log2, extra_ptr, extra_stride, extra_cap, extra_idx_row,
                                   n_extra, tl.maximum(lo, tiles_main) - tiles_main, hi - tiles_main, EXTRA_BS,
                                   BLOCK_N, FNUZ, DEQ_INT, EXTRA_FMT)

    empty = l_i == 0.0
    inv_l = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))
    lse2 = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    o_row = out_ptr + bi * stride_ob + si * stride_os + heads[:, None].to(tl.int64) * stride_oh
    if SPLIT:
        base = (sp * num_tokens + t64) * HEADS + heads
        po = part_o_ptr + base[:, None] * 512
        tl.store(po + cols[None, :], acc * inv_l[:, None])
        tl.store(part_lse_ptr + base, lse2)
        if COMBINE:
            # the split programs of a (token, head block) count their arrivals; the last one merges. Each
            # thread first publishes its own stores with a release atomic on a slot of its own (on AMD this
            # makes every wave wait for its stores and write them back: Triton's barrier alone does not),
            # then after the barrier one thread counts the arrival with an acq_rel atomic at gpu scope,
            # which for the last program acquires the other programs' partials. The last program leaves
            # the count at 0 for the next call and for graph replays.
            slots = count_ptr + num_tokens * (HEADS // BLOCK_H) + tl.arange(0, THREADS)
            tl.atomic_add(slots, tl.zeros([THREADS], dtype=tl.int32), sem="release", scope="gpu")
            tl.debug_barrier()
            count = count_ptr + t64 * (HEADS // BLOCK_H) + hb
            arrived = tl.atomic_add(count, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:
                # MERGE_H heads at a time: the accumulator of a whole head block and a partial beside it
                # would not fit in registers
                for hs in tl.static_range(BLOCK_H // MERGE_H):
                    mh = hb * BLOCK_H + hs * MERGE_H + tl.arange(0, MERGE_H)
                    m_row = out_ptr + bi * stride_ob + si * stride_os + mh[:, None].to(tl.int64) * stride_oh
                    _merge_splits(part_o_ptr, part_lse_ptr, sink_ptr, m_row, lse_ptr + t64 * HEADS + mh, mh, t64,
                                  num_tokens, num_splits, HEADS, HAS_SINK)
                tl.store(count, 0)
    else:
        factor = inv_l
        if HAS_SINK:
            sink = tl.load(sink_ptr + heads)
            # exp(lse) / (exp(lse) + exp(sink)) = 1 / (1 + 2^(sink*log2e - lse2))
            factor = tl.where(empty, 0.0, inv_l / (1.0 + tl.exp2(sink * 1.4426950408889634 - lse2)))
        tl.store(o_row + cols[None, :], (acc * factor[:, None]).to(tl.bfloat16))
        tl.store(lse_ptr + t64 * HEADS + heads, tl.where(empty, float("inf"), lse2 * 0.6931471805599453))


@triton.jit
def _merge_splits(part_o_ptr, part_lse_ptr, sink_ptr, o_row, lse_out, heads, t64, num_tokens, num_splits,
                  HEADS: tl.constexpr, HAS_SINK: tl.constexpr):
    """Merge the split partials of token t64 for ``heads`` [BH]: out = sum_s 2^(lse_s - lse) o_s in split
    order, then the sink; out 0 and lse +inf when no split saw a key. The in-kernel combine and
    ``_combine_kernel`` both run this, so the two give the same bits. Partials are read past L1 (.cg):
    other programs wrote them."""
    cols = tl.arange(0, 512)
    m = tl.full(heads.shape, float("-inf"), dtype=tl.float32)
    for s in range(num_splits):
        m = tl.maximum(m, tl.load(part_lse_ptr + (s * num_tokens + t64) * HEADS + heads, cache_modifier=".cg"))
    empty = m == float("-inf")
    m_use = tl.where(empty, 0.0, m)
    tot = tl.zeros(heads.shape, dtype=tl.float32)
    o = tl.zeros([heads.shape[0], 512], dtype=tl.float32)
    for s in range(num_splits):
        base = (s * num_tokens + t64) * HEADS + heads
        w = tl.exp2(tl.load(part_lse_ptr + base, cache_modifier=".cg") - m_use)
        tot += w
        o += tl.load(part_o_ptr + base[:, None] * 512 + cols[None, :], cache_modifier=".cg") * w[:, None]
    lse2 = m_use + tl.log2(tl.where(empty, 1.0, tot))
    factor = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, tot))
    if HAS_SINK:
        sink = tl.load(sink_ptr + heads)
        factor = factor / (1.0 + tl.exp2(sink * 1.4426950408889634 - lse2))
    tl.store(o_row + cols[None, :], (o * factor[:, None]).to(tl.bfloat16))
    tl.store(lse_out, tl.where(empty, float("inf"), lse2 * 0.6931471805599453))


MAX_SPLITS = 16
MERGE_H = 16              # heads merged at a time (in the kernel, and per program of the two-launch combine)


@triton.jit(do_not_specialize=["num_tokens", "s_q", "num_splits", "tiles_per_unit"])
def _combine_kernel(part_o_ptr, part_lse_ptr, sink_ptr, out_ptr, stride_ob, stride_os, stride_oh, lse_ptr,
                    num_tokens, s_q, num_splits, tiles_per_unit, HEADS: tl.constexpr, HAS_SINK: tl.constexpr,
                    BLOCK_H: tl.constexpr, PARTS: tl.constexpr, PDL: tl.constexpr = False):
    """The split combine as a second launch (``config=dict(split_combine="launch")``): program (t, hb) merges
    the partials of token t for BLOCK_H heads.

    Without PARTS every token has ``num_splits`` partials. With PARTS (the persistent schedule of
    ``sparse_mla_decode_ws.py``) ``num_splits`` is the tiles per CTA W and ``tiles_per_unit`` the tiles M of a
    unit (64 heads of a token): the unit of token t spans CTAs (t M) // W .. (t M + M - 1) // W of its head
    block, one partial each; a unit within one CTA was written by the kernel itself, and nothing is
    written here."""
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    bi = t // s_q
    si = t - bi * s_q
    o_row = out_ptr + bi * stride_ob + si * stride_os + heads[:, None].to(tl.int64) * stride_oh
    if PARTS:
        first = (t * tiles_per_unit) // num_splits
        parts = (t * tiles_per_unit + tiles_per_unit - 1) // num_splits - first + 1
        if parts > 1:
            _merge_splits(part_o_ptr, part_lse_ptr, sink_ptr, o_row, lse_ptr + t * HEADS + heads, heads, t,
                          num_tokens, parts, HEADS, HAS_SINK)
    else:
        _merge_splits(part_o_ptr, part_lse_ptr, sink_ptr, o_row, lse_ptr + t * HEADS + heads, heads, t, num_tokens,
                      num_splits, HEADS, HAS_SINK)


# the decode kernel Hopper runs by default: "ws" (sparse_mla_decode_ws.py) or "triton" (this file's), as the
# H100 timing of gpu/decode_ws.py decides (its VERDICT line; BENCHMARKS.md): the Hopper kernel took
# 0.80-0.97 of this file's kernel's time on all eight timed rows
DEFAULT_SM90_KERNEL = "ws"


_PORTABLE_ONLY = False      # inside ``portable_kernel()``: this file's kernel on every target


def default_kernel(arch: str) -> str:
    """Which decode kernel a target runs by default: on Hopper DEFAULT_SM90_KERNEL (the warp-specialized
    kernel of ``sparse_mla_decode_ws.py`` only where Triton has Gluon), this file's kernel everywhere else
    (and inside ``portable_kernel()``); ``config=dict(kernel=...)`` forces either."""
    if _PORTABLE_ONLY:
        return "triton"
    return "ws" if arch == "sm_90" and DEFAULT_SM90_KERNEL == "ws" and _ws is not None else "triton"


@contextlib.contextmanager
def portable_kernel():
    """Inside the block every call of the public op runs this file's kernel, the one AMD runs, on Hopper
    too: a check of both kernels on one Hopper GPU (dsv4_rocm/long_context.py). The cached launch plans
    are dropped on entry and exit, so no plan of the other kernel is reused."""
    global _PORTABLE_ONLY
    prev, _PORTABLE_ONLY = _PORTABLE_ONLY, True
    _plan.cache_clear()
    try:
        yield
    finally:
        _PORTABLE_ONLY = prev
        _plan.cache_clear()


def default_config(arch: str, num_heads: int, kernel: str = None) -> dict:
    """Kernel and tile shape per target (BENCHMARKS.md has the sweeps and the compile-matrix reports);
    ``kernel`` ("triton" or "ws") picks the kernel, default ``default_kernel(arch)``.

    AMD (gfx942 / gfx950): all 64 heads of a token share each dequantized 16-key tile, 8 waves: 220-236
    VGPRs with no spills, so two waves fit per SIMD, and the 64 KB of LDS of a workgroup; with 128 heads the
    two head blocks of a token go to one XCD (``XCDS``, ``_decode_tiles.program_tiles``) so that the second
    block's gathers hit the L2 the first filled; each tile's ids are loaded two tiles ahead (``IDX_AHEAD=2``), so
    an iteration waits for one memory round trip, not for the ids and then the scale words they address
    (docs/perf_notes.md#amd-isa). NVIDIA: 64 heads
    x 64 keys, 8 warps, one CTA per SM; the integer dequantization (inline PTX) on Hopper and Blackwell;
    two cp.async stages measured best on the H100. Split partials are merged in a second launch
    (``split_combine="launch"``, as the Hopper kernel always does): replayed from a graph, as decode steps
    are, it beats the merge by the last split program (``"kernel"``: 21.5 against 39.3 us at b = 2 on the
    H100, BENCHMARKS.md), which one program per (token, head block) runs serially; eagerly the second
    launch waits for the host, so the in-kernel merge's GPU span is shorter there (38.9 against 50.7 us).
    The Hopper kernel's own defaults are in its module.
    """
    kernel = kernel or default_kernel(arch)
    if kernel == "ws":
        if _ws is None:
            raise ValueError("config kernel='ws' needs Triton's Gluon at 3.6 to 3.8 (triton/_compat.py GLUON_WS), "
                             "which this Triton is not")
        return dict(kernel="ws", BLOCK_H=64, split_combine="launch", **_ws.default_config(num_heads))
    if kernel != "triton":
        raise ValueError(f"config kernel must be 'triton' or 'ws', got {kernel!r}")
    if arch in ("gfx942", "gfx90a"):
        cfg = dict(BLOCK_H=64, BLOCK_N=16, num_warps=8, num_stages=1, DEQ_INT=False, XCDS=8 if arch == "gfx942" else 0,
                   IDX_AHEAD=2)
    elif arch == "gfx950":
        cfg = dict(BLOCK_H=64, BLOCK_N=16, num_warps=8, num_stages=2, DEQ_INT=False, XCDS=8, IDX_AHEAD=2)
    elif arch == "sm_100":       # spill-free there (compile matrix); untimed: no Blackwell machine here
        cfg = dict(BLOCK_H=64, BLOCK_N=64, num_warps=8, num_stages=1, DEQ_INT=True)
    else:
        cfg = dict(BLOCK_H=64, BLOCK_N=64, num_warps=8, num_stages=2, DEQ_INT=True)
    cfg.update(by_triton(_NEWER_TRITON_TILES).get(arch, {}))
    return dict(cfg, kernel="triton", split_combine="launch")


# What a newer Triton changes in the tiles above (``_compat.by_triton``: the entry of the newest version not
# newer than the running one). From 3.8 on, ptxas spills the 64-key sm_90 tile at its 255 registers (352 B for
# the 64-head kernel under 3.8, 1176 B under 3.9, more with 128 heads split; one stage spills more), and the
# 32-key tile does not (compile matrix). sm_100: _SM100_SPILLS. 3.6's tiles are the ones measured on the H100
# and stay as they are.
_NEWER_TRITON_TILES = {(3, 6): {}, (3, 8): {"sm_90": dict(BLOCK_N=32)}}


def _num_splits(programs: int, max_tiles: int, sm_count: int, waves: int = 1) -> int:
    """Split the key tiles of each query only when the grid would leave SMs idle: aim at ``waves``
    programs per SM (one CTA fits per SM), at most one split per tile and 16 in all. Measured on the H100
    (BENCHMARKS.md): one wave is best for small grids, and splitting a grid that already fills the GPU
    (to trim its last partial wave) loses to the extra fp32 partial traffic."""
    if programs >= sm_count or max_tiles <= 1 or programs <= 0:      # an empty batch launches nothing
        return 1
    return int(min(max_tiles, max(1, (waves * sm_count) // programs), MAX_SPLITS))




class _Variant(NamedTuple):
    """What a launch of one kernel variant needs, built once: the bound kernels and the grid's head blocks."""
    main: object              # BoundKernel of _sparse_mla_paged_kernel, or None for the Hopper kernel
    combine: object           # BoundKernel of _combine_kernel (two-launch combine), or None
    head_blocks: int
    threads: int              # of a program: the release slots the in-kernel combine needs
    ws: object = None         # BoundKernel of the Hopper kernel (``config kernel="ws"``), or None


@device_cache(maxsize=4096)
def _plan(device: torch.device, h: int, T: int, main_topk: int, extra_topk: int, config_items: tuple = (),
          num_splits: int = None, ws_reads: bool = True):
    """Launch plan of a call shape: (config items, splits, partials per query, grid, tiles per unit), cached
    per device and shape so a launch pays no device query, no config dict and no split arithmetic.
    ``config_items`` override the default config (sweeps), ``num_splits`` the split count.

    Triton kernel: ``splits`` programs per (token, head block), as many partials. Hopper kernel: a
    persistent grid of CTAs (the SMs shared evenly by the head blocks) taking ``splits`` = W key tiles each
    (``sparse_mla_decode_ws.schedule``), up to ``partials`` of them per unit (1: no unit is split, no
    combine). ``ws_reads``: the Hopper kernel reads the call's record formats (``sparse_mla_decode_ws.reads``);
    otherwise this file's kernel runs by default, and forcing the Hopper kernel is refused."""
    arch, fnuz, sms, _ = device_facts(device)
    over = dict(config_items)
    kernel = over.get("kernel") or (default_kernel(arch) if ws_reads else "triton")
    if kernel == "ws" and arch != "sm_90":
        raise ValueError(f"config kernel='ws' runs on Hopper (sm_90) only, this device is {arch}")
    if kernel == "ws" and not ws_reads:
        raise ValueError("config kernel='ws': the Hopper kernel reads V40_584 or V41_528 records only, one format "
                         "and page layout in both caches")
    cfg = dict(default_config(arch, h, kernel), FNUZ=fnuz, warp_size=64 if arch.startswith("gfx") else 32, **over)
    if cfg["split_combine"] not in ("kernel", "launch") or (kernel == "ws" and cfg["split_combine"] != "launch"):
        raise ValueError(f"config split_combine must be 'kernel' or 'launch' ('launch' for kernel 'ws'), got "
                         f"{cfg['split_combine']!r}")
    BN = cfg["BLOCK_N"]
    if kernel == "ws":
        m = _ws.tiles_per_unit(main_topk, extra_topk, BN)
        w = _ws.schedule(T, m, max(sms // (h // 64), 1), num_splits)
        return tuple(cfg.items()), w, _ws.max_parts(m, w), (cdiv(T * m, w), h // 64), m
    max_tiles = cdiv(main_topk, BN) + cdiv(extra_topk, BN)
    ns = _num_splits(T * (h // cfg["BLOCK_H"]), max_tiles, sms, cfg.get("split_waves", 1))
    if num_splits is not None:
        ns = max(1, min(int(num_splits), MAX_SPLITS))
    return tuple(cfg.items()), ns, ns, (T * (h // cfg["BLOCK_H"]), ns), 0


@functools.lru_cache(maxsize=4096)
def _variant(cfg_items: tuple, h: int, main_bs: int, extra_bs: int, has_extra: bool, has_len: bool,
             has_extra_len: bool, has_sink: bool, split: bool, q_async: bool = True, main_fmt=L.V40_584,
             extra_fmt=L.V40_584) -> _Variant:
    """The kernels (constexprs and launch options bound) of one variant, built once."""
    cfg = dict(cfg_items)
    if cfg["kernel"] == "ws":
        comb = launch(_combine_kernel).bind(HEADS=h, HAS_SINK=has_sink, BLOCK_H=min(MERGE_H, h), PARTS=True,
                                            num_warps=4) if split else None
        ws = launch(_ws._sparse_mla_ws_kernel).bind(**_ws.constexprs(cfg_items, h, main_bs, extra_bs, has_extra,
                                                                        has_len, has_extra_len, has_sink, q_async,
                                                                        main_fmt))
        return _Variant(None, comb, h // 64, 0, ws)
    in_kernel = split and cfg["split_combine"] == "kernel"
    main = launch(_sparse_mla_paged_kernel).bind(
        MAIN_BS=main_bs, EXTRA_BS=extra_bs, HAS_EXTRA=has_extra, HAS_MAIN_LEN=has_len, HAS_EXTRA_LEN=has_extra_len,
        HAS_SINK=has_sink, BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], SPLIT=split, COMBINE=in_kernel,
        FNUZ=cfg["FNUZ"], DEQ_INT=cfg.get("DEQ_INT", False), HEADS=h, MERGE_H=min(MERGE_H, cfg["BLOCK_H"]),
        THREADS=cfg["num_warps"] * cfg["warp_size"], MAIN_FMT=main_fmt, EXTRA_FMT=extra_fmt, XCDS=cfg.get("XCDS", 0),
        IDX_AHEAD=cfg.get("IDX_AHEAD", 1),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    comb = None
    if split and not in_kernel:
        comb = launch(_combine_kernel).bind(HEADS=h, HAS_SINK=has_sink, BLOCK_H=min(MERGE_H, h), PARTS=False,
                                            num_warps=4)
    return _Variant(main, comb, h // cfg["BLOCK_H"], cfg["num_warps"] * cfg["warp_size"])


def _lengths_strides(lengths):
    """(batch stride, query stride) of [b] or [b, s_q] lengths: [b] lengths hold for every query of a row."""
    st = lengths.stride()
    return (st[0], 0) if len(st) == 1 else st


def sparse_mla_decode(q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices_in_kvcache,
                      extra_topk_length, softmax_scale: float, out=None, *, formats=None, config: dict = None,
                      num_splits: int = None, compile_only: bool = False):
    """FlashMLA sparse decode over paged KV records -> (out bf16 [b, s_q, h, 512], lse fp32 [b, h, s_q]).

    Arguments as ``dsv4_rocm.ops.sparse_mla_decode``, which checks them: q [b, s_q, h, 512] and out (when
    given, written in place) with a unit last stride and any other strides; caches [nb, bs, (1,) R] of
    uint8 / int8 / float8_e4m3fn with stride(1) = R and page stride stride(0); indices [b, s_q, topk]
    int32 with a unit last stride; lengths [b] or [b, s_q] int32, any strides; attn_sink [h] contiguous.
    ``formats``: the caches' record formats (main, extra or None); default: named by their last dimension,
    in the format's default page layout (``layout.default_layout``). Nothing is copied: the kernel takes
    every stride. ``config`` / ``num_splits`` override the kernel (``kernel="triton"`` or ``"ws"``), the
    tiles, the split combine and the split count (sweeps, tests); ``compile_only`` compiles the kernels this
    call needs and runs nothing.
    """
    b, s_q, h, _ = q.shape
    T = b * s_q
    dev = q.device
    has_extra = extra_k_cache is not None
    topk = indices.shape[2]
    etopk = extra_indices_in_kvcache.shape[2] if has_extra else 0
    fmt, efmt = formats if formats is not None else (None, None)
    if fmt is None:
        fmt = L.with_layout(L.format_for_token_bytes(k_cache.shape[-1]))
    if efmt is None:
        efmt = (L.with_layout(L.format_for_token_bytes(extra_k_cache.shape[-1], "extra_k_cache")) if has_extra
                else fmt)
    cfg, ns, parts, grid, m = _plan(dev, h, T, topk, etopk, tuple(sorted(config.items())) if config else (),
                                    num_splits, _ws is not None and _ws.reads(fmt, efmt))
    if out is None:
        out = torch.empty((b, s_q, h, 512), dtype=torch.bfloat16, device=dev)
    lse = torch.empty((b, s_q, h), dtype=torch.float32, device=dev)
    if T == 0:
        return out, lse.transpose(1, 2)
    kshape = k_cache.shape
    has_len, has_elen = topk_length is not None, has_extra and extra_topk_length is not None
    ebs = extra_k_cache.shape[1] if has_extra else 1
    split = parts > 1
    var = _variant(cfg, h, kshape[1], ebs, has_extra, has_len, has_elen, attn_sink is not None, split, True, fmt, efmt)
    if var.ws is not None and not _ws.q_rows_aligned(q):      # the Hopper kernel loads such a Q by registers
        var = _variant(cfg, h, kshape[1], ebs, has_extra, has_len, has_elen, attn_sink is not None, split, False,
                       fmt, efmt)
    count = indices                     # an int32 placeholder (never read) when nothing is counted
    if split:
        ws = scratch(dev, parts * T * h * 513)
        part_o, part_lse = ws, ws[parts * T * h * 512:]
        if var.combine is None:
            count = counters(dev, T * var.head_blocks + var.threads)
    else:
        part_o = part_lse = lse
    main = k_cache if k_cache.dtype == torch.uint8 else k_cache.view(torch.uint8)
    ist = indices.stride()
    mlen, mls = (topk_length, _lengths_strides(topk_length)) if has_len else (indices, (0, 0))
    if has_extra:
        extra = extra_k_cache if extra_k_cache.dtype == torch.uint8 else extra_k_cache.view(torch.uint8)
        eidx = extra_indices_in_kvcache
        elen, els = (extra_topk_length, _lengths_strides(extra_topk_length)) if has_elen else (eidx, (0, 0))
        ecap, estride = extra_k_cache.shape[0] * ebs, extra_k_cache.stride(0)
    else:
        extra, eidx, elen, els, ecap, estride = main, indices, mlen, (0, 0), 0, 0
    est = eidx.stride()
    sink = attn_sink if attn_sink is not None else lse
    qst, ost = q.stride(), out.stride()
    # ns: the Triton kernel's split count, or the Hopper kernel's tiles per CTA
    args = (q, qst[0], qst[1], qst[2],
            main, k_cache.stride(0), kshape[0] * kshape[1], indices, ist[0], ist[1], mlen, mls[0], mls[1], topk,
            extra, estride, ecap, eidx, est[0], est[1], elen, els[0], els[1], etopk,
            sink, out, ost[0], ost[1], ost[2], lse, part_o, part_lse, count, T, s_q, ns, softmax_scale * LOG2E)
    comb_grid = (T, h // min(MERGE_H, h))
    comb = (part_o, part_lse, sink, out, ost[0], ost[1], ost[2], lse, T, s_q, ns, m)
    if var.ws is not None:                 # the Hopper kernel: the same arguments but the counters
        ws_args = args[:32] + args[33:] + (lse,)     # lse: the max-logits pointer, not written
        if compile_only:
            var.ws.warmup(*ws_args, grid=grid)
        else:
            var.ws[grid](*ws_args)
    elif compile_only:
        var.main.warmup(*args, grid=grid)
    else:
        var.main[grid](*args)
    if var.combine is not None:
        if compile_only:
            var.combine.warmup(*comb, grid=comb_grid)
        else:
            var.combine[comb_grid](*comb)
    return out, lse.transpose(1, 2)


def _matrix_constexprs(arch, split=False, formats=(L.V40_584, L.V40_584)):
    c = default_config(arch, 64, "triton")
    return dict(MAIN_BS=64 if split else 256, EXTRA_BS=2 if split else 64, HAS_EXTRA=True, HAS_MAIN_LEN=True,
                HAS_EXTRA_LEN=True, HAS_SINK=True, BLOCK_H=c["BLOCK_H"], BLOCK_N=c["BLOCK_N"],
                SPLIT=split, COMBINE=split, FNUZ=arch == "gfx942",
                DEQ_INT=c.get("DEQ_INT", False), HEADS=128 if split else 64, MERGE_H=MERGE_H,
                THREADS=c["num_warps"] * (64 if arch.startswith("gfx") else 32), MAIN_FMT=formats[0],
                EXTRA_FMT=formats[1], XCDS=c.get("XCDS", 0), IDX_AHEAD=c.get("IDX_AHEAD", 1))


def _matrix_options(arch):
    c = default_config(arch, 64, "triton")
    return dict(num_warps=c["num_warps"], num_stages=c["num_stages"])


_POINTERS = dict(DECODE_POINTERS, count_ptr="*i32")

# the e2m1 tile's nibble interleave is a register join that Triton does not fold into the tile's shared-memory
# store; at 255 registers ptxas then spills loop-invariant wgmma descriptors (reloaded from L1 each tile)
_FP4_SPILLS = "fp4 nibble interleave: ptxas spills loop-invariant wgmma descriptors (docs/platforms.md)"

# What a newer Triton's compile of these kernels keeps spilling (by target; none under 3.6). From 3.8 on:
# * gfx942, the 128-head split kernel that merges in kernel (not the default: split_combine="launch"): 6
#   scalar registers beyond the 106 of a wave sit in VGPR lanes (v_writelane / v_readlane), never in memory;
#   4 warps or 32-key tiles spill more (12 SGPRs; 99 VGPRs to scratch);
# * sm_100a, every variant: ptxas spills 420-504 B at 255 registers with the 64 x 64 tile, and every other
#   tile tried spills too (32 keys, 1 or 2 stages: 420-644 B; no integer dequantization: 560 B; 16 warps or
#   32-head blocks: no tcgen05). Untimed: no Blackwell machine here.
# From 3.9 on, sm_90a as well: its 32-key tile spills 560 B there (16 keys: 608 B; one stage: 844 B; the
# 64-key tile: 1176 B). Hopper's default decode is the Gluon kernel, which compiles without spills.
# AMD reads a tile's ids two tiles ahead (IDX_AHEAD=2): the two tiles' set selections (cache, stride, index row,
# count of main or extra set) are scalar state, and 4-13 of its SGPRs sit in VGPR lanes (v_writelane /
# v_readlane), never in memory; the loop then waits for one memory round trip a tile instead of two
# (build_tools/amd_isa_report.py: 4 round trips per 64 keys, not 8; 26 KB in flight per CU, not 14)
_AHEAD_WHY = "ids two tiles ahead: set-selection scalars in VGPR lanes, not memory (docs/perf_notes.md#amd-isa)"
_AHEAD_SGPR_SPILLS = {"gfx942": _AHEAD_WHY, "gfx950": _AHEAD_WHY}
_SPLIT_SGPR_SPILLS = {(3, 6): "", (3, 8): {"gfx942": "Triton >= 3.8: the in-kernel merge's scalar state "
                                                     "(docs/platforms.md#triton-versions)"}}
_NVIDIA_WHY = "Triton >= %s: no tile tried compiles without spills (docs/platforms.md#triton-versions)"
_SM100_SPILLS = {(3, 6): "", (3, 8): {"sm_100a": _NVIDIA_WHY % "3.8"},
                 (3, 9): {"sm_100a": _NVIDIA_WHY % "3.8", "sm_90a": _NVIDIA_WHY % "3.9"}}

# entries of the CPU compile matrix (build_tools/compile_matrix.py)
COMPILE_SPECS = [
    dict(name="sparse_mla_decode", fn=_sparse_mla_paged_kernel, pointers=_POINTERS, floats=("sm_log2",),
         constexprs=_matrix_constexprs, options=_matrix_options, matrix=True, fp8_convert=True,
         sgpr_spills=_AHEAD_SGPR_SPILLS, ptxas_spills=by_triton(_SM100_SPILLS)),
    dict(name="sparse_mla_decode[split, combine in kernel]", fn=_sparse_mla_paged_kernel, pointers=_POINTERS, floats=("sm_log2",),
         constexprs=lambda arch: _matrix_constexprs(arch, split=True), options=_matrix_options, matrix=True,
         # AMD's ids-ahead scalars, and from Triton 3.8 the in-kernel merge's on gfx942 (either reason accepts)
         fp8_convert=True, sgpr_spills=dict(_AHEAD_SGPR_SPILLS, **(by_triton(_SPLIT_SGPR_SPILLS) or {})),
         ptxas_spills=by_triton(_SM100_SPILLS)),
    # the V4.1 records: one format in both sets (one loop), and the fp4 extra cache (a loop per set)
    dict(name="sparse_mla_decode[V41_528]", fn=_sparse_mla_paged_kernel, pointers=_POINTERS, floats=("sm_log2",),
         constexprs=lambda arch: _matrix_constexprs(arch, formats=(L.V41_528, L.V41_528)), options=_matrix_options,
         matrix=True, fp8_convert=True, sgpr_spills=_AHEAD_SGPR_SPILLS, ptxas_spills=by_triton(_SM100_SPILLS)),
    dict(name="sparse_mla_decode[V41_528 + V41_FP4_288, split]", fn=_sparse_mla_paged_kernel, pointers=_POINTERS,
         floats=("sm_log2",), constexprs=lambda arch: _matrix_constexprs(arch, True, (L.V41_528, L.V41_FP4_288)),
         options=_matrix_options, matrix=True, fp8_convert=True, ptxas_spills=_FP4_SPILLS),
    # vLLM's gfx942 sliding-window cache: FNUZ-flavour records in the main set, OCP ones in the extra set
    dict(name="sparse_mla_decode[V40_584 FNUZ window]", fn=_sparse_mla_paged_kernel, pointers=_POINTERS,
         floats=("sm_log2",), constexprs=lambda arch: _matrix_constexprs(arch, formats=(L.with_fnuz(L.V40_584),
                                                                                        L.V40_584)),
         options=_matrix_options, matrix=True, fp8_convert=True, sgpr_spills=_AHEAD_SGPR_SPILLS,
         ptxas_spills=by_triton(_SM100_SPILLS)),
    dict(name="sparse_mla_combine", fn=_combine_kernel,
         pointers=dict(part_o_ptr="*fp32", part_lse_ptr="*fp32", sink_ptr="*fp32", out_ptr="*bf16", lse_ptr="*fp32"),
         floats=(), constexprs=lambda arch: dict(HEADS=64, HAS_SINK=True, BLOCK_H=MERGE_H, PARTS=True),
         options=lambda arch: dict(num_warps=4, num_stages=1), matrix=False),
]
