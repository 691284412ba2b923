"""DeepSeek-V4.1 compressor, second half (vLLM's ``rope_quant_insert``): the compressed-cache record of
every group-closing token's latent.

Math (dsv4_rocm/reference/compressor_v41.py): token t (t < len(slot_mapping)) at position p with
(p + 1) % r == 0, a slot inside the cache and p inside the cos/sin table: x = fp32(latent[t]) and RoPE(x)
at (p // r) * r; the record of the cache's format FMT (a constexpr), made by the record stores of
dsv4_rocm/triton/_records.py, so the bytes are those of every other writer of the record:
    V40_584      UE8M0 fp8 of x[:448] in blocks of 64, bf16 of the rotated dims 448..511, 7 scales and a 0
                 pad byte; page p = slot // bs at ``kv_cache.stride(0)``, record o = slot % bs: data at
                 p + o * 576, scales at p + bs * 576 + o * 8
    V41_528      UE8M0 fp8 of all 512 rotated dims in blocks of 32, 16 scales
    V41_FP4_288  e2m1 of all 512 rotated dims, an e4m3 scale per 16
the V4.1 records where ``layout.data_offset`` / ``record_scale_offset`` put them (page-split or interleaved).
MODE (a constexpr) 1 and 2 write vLLM's plain [448 NoPE | 64 RoPE] rows instead, row slot % bs of page
slot // bs at the tensor's row and page strides: 1 the bf16 row bf(RoPE(x)), 2 its e4m3 bytes of
fp32(bf(RoPE(x))) * fp32(1 / fp8_scale) by _records._e4m3 (OCP bytes on every target,
saturating, -0 as 0x00), a non-finite value 0x7F.

Grid: one program per ROWS tokens, each token's record made in turn (a decode step writes a record for
half the tokens or fewer, a prefill chunk one per r tokens).
"""
import torch
import triton
import triton.language as tl

from ... import layout as L
from ...cache_views import is_plain_row_cache
from .._launch import cdiv, launch
from .._records import _e4m3, _rope_last64, _store_main, _store_v41_fp4, _store_v41_fp8, fnuz, record_token

D = 512
ROWS = 4


@triton.jit(do_not_specialize=["n"])
def _rope_quant_insert_kernel(latent_ptr, pos_ptr, cs_ptr, cs_stride, cs_rows, cache_ptr, page_stride, row_stride,
                              capacity, slot_ptr, n, scale_ptr, RATIO: tl.constexpr, BS: tl.constexpr,
                              R: tl.constexpr, MODE: tl.constexpr, FNUZ: tl.constexpr, FMT: tl.constexpr):
    d = tl.arange(0, 512)
    for i in range(R):
        t = tl.program_id(0) * R + i
        if t < n:
            s, p, writes = record_token(slot_ptr, pos_ptr, t, capacity, cs_rows, RATIO)
            if writes:
                x = tl.load(latent_ptr + t.to(tl.int64) * 512 + d).to(tl.float32)
                roped = _rope_last64(x, cs_ptr + ((p // RATIO) * RATIO) * cs_stride, 512)
                page = cache_ptr + (s // BS) * page_stride
                if MODE == 0:
                    if FMT.quant_dims < 512:
                        _store_main(page, s % BS, BS, x, roped, FNUZ)
                    elif FMT.elem_bits == 4:
                        _store_v41_fp4(page, s % BS, BS, roped, FNUZ, FMT)
                    else:
                        _store_v41_fp8(page, s % BS, BS, roped, FNUZ, FMT)
                else:
                    row = page + (s % BS) * row_stride + d
                    yb = roped.to(tl.bfloat16)                  # NoPE dims: the latent's own bf16 values
                    if MODE == 1:
                        tl.store(row, yb)
                    else:
                        y = yb.to(tl.float32)
                        inv = tl.math.div_rn(1.0, tl.load(scale_ptr).to(tl.float32))
                        b = _e4m3(y * inv, FNUZ)
                        finite = (y == y) & (tl.abs(y) != float("inf"))
                        tl.store(row, tl.where(finite, b, 0x7F).to(tl.uint8))


def rope_quant_insert(latent, positions, cos_sin_cache, kv_cache, slot_mapping, compress_ratio, fp8_scale=None,
                      fmt: L.RecordFormat = L.V40_584) -> None:
    """vLLM's call form; arguments checked by ``dsv4_rocm.ops.rope_quant_insert``; ``fmt`` the record format of a
    record cache; a plain-row cache (``is_plain_row_cache``: bf16, or e4m3 with ``fp8_scale``) is the
    [nb, bs, 512] view."""
    n = slot_mapping.shape[0]
    if n == 0:
        return
    bs = kv_cache.shape[1]
    mode = (1 if kv_cache.dtype == torch.bfloat16 else 2) if is_plain_row_cache(kv_cache) else 0
    cache = kv_cache if kv_cache.dtype in (torch.uint8, torch.bfloat16) else kv_cache.view(torch.uint8)
    row_stride = kv_cache.stride(1) if mode else 0
    launch(_rope_quant_insert_kernel)[(cdiv(n, ROWS),)](
        latent, positions, cos_sin_cache, cos_sin_cache.stride(0), cos_sin_cache.shape[0], cache, kv_cache.stride(0),
        row_stride, kv_cache.shape[0] * bs, slot_mapping, n, fp8_scale if mode == 2 else slot_mapping,
        RATIO=compress_ratio, BS=bs, R=ROWS, MODE=mode, FNUZ=fnuz(latent.device), FMT=fmt if mode == 0 else L.V40_584,
        num_warps=4, num_stages=1, enable_fp_fusion=False)


def _spec(name, fmt, mode=0, cache_ptr="*u8"):
    return dict(name=name, fn=_rope_quant_insert_kernel,
                pointers=dict(latent_ptr="*bf16", pos_ptr="*i64", cs_ptr="*fp32", cache_ptr=cache_ptr, slot_ptr="*i64",
                              scale_ptr="*fp32"),
                floats=(), constexprs=lambda arch: dict(RATIO=2, BS=64, R=ROWS, MODE=mode, FNUZ=arch == "gfx942",
                                                        FMT=fmt),
                options=lambda arch: dict(num_warps=4, num_stages=1, enable_fp_fusion=False), matrix=False,
                fp8_encode=mode != 1, exact_fp32=True)


COMPILE_SPECS = [   # the ratio only changes a constant of the position test; one entry per record format / row form
    _spec("rope_quant_insert", L.V40_584),
    _spec("rope_quant_insert[V41_528]", L.with_layout(L.V41_528)),
    _spec("rope_quant_insert[V41_FP4_288]", L.with_layout(L.V41_FP4_288)),
    _spec("rope_quant_insert[bf16 rows]", L.V40_584, 1, "*bf16"),
    _spec("rope_quant_insert[fp8 rows]", L.V40_584, 2),
]
