"""vLLM 0.33's ``fused_deepseek_v4_kv_rope_insert``: the kv half of the fused inserts, one kernel for the three
caches vLLM passes it.

Math (dsv4_rocm/reference/qkv.py): token t < len(slot_mapping) with a slot inside the cache and a position p
inside the cos/sin table: x = fp32(kv[t]), y = GPT-J RoPE of x's last 64 dims at p (e c - o s and e s + o c,
three roundings each, fp fusion off), stored by MODE (a constexpr):
    0  a record of the cache's format FMT at page slot // bs (``page_stride`` bytes apart), record slot % bs,
       by the record stores of _records.py: V40_584 (UE8M0 fp8 of x[:448], bf16 of y[448:]) or
       V41_528 (UE8M0 fp8 of all 512 dims of bf(y): the bf16 step of the fused insert's kv)
    1  bf16 row bf(y) at k_cache[slot // bs, slot % bs]
    2  e4m3 row of y * fp32(1 / fp8_scale), saturating at +-448, -0 as 0x00, a non-finite y as 0x7F
The bytes are OCP e4m3 on every target; FNUZ (gfx942) only picks the encoder: its fnuz convert of x / 2
gives the same byte (_records._e4m3).
Grid: one program per ROWS tokens.
"""
import torch
import triton
import triton.language as tl

from ... import layout as L
from .._launch import cdiv, launch
from .._pdl import pdl_start
from .._records import _e4m3, _rope_last64, _store_main, _store_v41_fp8, fnuz, record_token

ROWS = 4
MODES = {torch.uint8: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2}


@triton.jit
def store_kv_record(x, cs_row_ptr, page, off, BS: tl.constexpr, FNUZ: tl.constexpr, FMT: tl.constexpr):
    """The record of one kv row x (fp32 [512] of bf16 values) at record ``off`` of ``page``: RoPE of the last
    64 dims at the cos/sin row (three roundings each), then V40_584 (UE8M0 fp8 of x[:448], bf16 RoPE dims) or
    V41_528 (UE8M0 fp8 of all 512 dims of bf(RoPE(x))). The kv insert of every fused front writes through this."""
    y = _rope_last64(x, cs_row_ptr, 512)
    if FMT.quant_dims < 512:
        _store_main(page, off, BS, x, y, FNUZ)
    else:
        _store_v41_fp8(page, off, BS, y.to(tl.bfloat16).to(tl.float32), FNUZ, FMT)


@triton.jit(do_not_specialize=["n"])
def _kv_rope_insert_kernel(kv_ptr, kv_stride, pos_ptr, cs_ptr, cs_stride, cs_rows, cache_ptr, page_stride, row_stride,
                           capacity, slot_ptr, n, scale_ptr, BS: tl.constexpr, R: tl.constexpr, MODE: tl.constexpr,
                           FNUZ: tl.constexpr, FMT: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    d = tl.arange(0, 512)
    for i in range(R):
        t = tl.program_id(0) * R + i
        if t < n:
            s, p, writes = record_token(slot_ptr, pos_ptr, t, capacity, cs_rows, 1)
            if writes:
                x = tl.load(kv_ptr + t.to(tl.int64) * kv_stride + d).to(tl.float32)
                if MODE == 0:
                    store_kv_record(x, cs_ptr + p * cs_stride, cache_ptr + (s // BS) * page_stride, s % BS, BS,
                                    FNUZ, FMT)
                else:
                    y = _rope_last64(x, cs_ptr + p * cs_stride, 512)
                    row = cache_ptr + (s // BS) * page_stride + (s % BS) * row_stride + d
                    if MODE == 1:
                        tl.store(row, y.to(tl.bfloat16))
                    else:
                        inv = tl.math.div_rn(1.0, tl.load(scale_ptr).to(tl.float32))
                        b = _e4m3(y * inv, FNUZ)
                        finite = (y == y) & (tl.abs(y) != float("inf"))
                        tl.store(row, tl.where(finite, b, 0x7F).to(tl.uint8))


def fused_deepseek_v4_kv_rope_insert(kv, k_cache, slot_mapping, positions, cos_sin_cache, cache_block_size: int,
                                     fp8_scale=None, kv_mxfp8: bool = False, fmt: L.RecordFormat = None) -> None:
    """vLLM's call form; arguments checked by ``dsv4_rocm.ops.fused_deepseek_v4_kv_rope_insert``; ``fmt`` the
    record format of a uint8 cache, whose page view (``cache_views.pages``) the op passes."""
    n = slot_mapping.shape[0]
    if n == 0:
        return
    mode = MODES[k_cache.dtype]
    bs = cache_block_size
    if mode == 0:
        fmt = fmt or (L.V41_528 if kv_mxfp8 else L.V40_584)
        cache, page_stride, row_stride = k_cache, k_cache.stride(0), 0
    else:
        fmt = L.V40_584
        cache = k_cache.view(torch.uint8) if mode == 2 else k_cache
        page_stride, row_stride = k_cache.stride(0), k_cache.stride(1)
    launch(_kv_rope_insert_kernel)[(cdiv(n, ROWS),)](
        kv, kv.stride(0), positions, cos_sin_cache, cos_sin_cache.stride(0), cos_sin_cache.shape[0], cache,
        page_stride, row_stride, k_cache.shape[0] * bs, slot_mapping, n, fp8_scale if mode == 2 else slot_mapping,
        BS=bs, R=ROWS, MODE=mode, FNUZ=fnuz(kv.device), FMT=fmt, num_warps=4, num_stages=1, enable_fp_fusion=False)


def _spec(name, mode, fmt, cache_ptr):
    return dict(name=name, fn=_kv_rope_insert_kernel,
                pointers=dict(kv_ptr="*bf16", pos_ptr="*i64", cs_ptr="*fp32", cache_ptr=cache_ptr, slot_ptr="*i64",
                              scale_ptr="*fp32"),
                floats=(), constexprs=lambda arch: dict(BS=64, R=ROWS, MODE=mode, FNUZ=arch == "gfx942", FMT=fmt),
                options=lambda arch: dict(num_warps=4, num_stages=1, enable_fp_fusion=False), matrix=False,
                fp8_encode=mode != 1, exact_fp32=True)


COMPILE_SPECS = [
    _spec("fused_deepseek_v4_kv_rope_insert[V40_584]", 0, L.V40_584, "*u8"),
    _spec("fused_deepseek_v4_kv_rope_insert[V41_528]", 0, L.with_layout(L.V41_528), "*u8"),
    _spec("fused_deepseek_v4_kv_rope_insert[bf16 rows]", 1, L.V40_584, "*bf16"),
    _spec("fused_deepseek_v4_kv_rope_insert[fp8 rows]", 2, L.V40_584, "*u8"),
]
