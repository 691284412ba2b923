"""Indexer-K cache writer (vLLM's ``indexer_k_quant_and_cache``): UE8M0 FP8 of each 128-value row of k into
its slot of the paged indexer-K cache.

Row t (t < len(slot_mapping)), slot s = slot_mapping[t] >= 0 and inside the cache, page p = s // bs, offset
o = s % bs (page stride = the cache's stride(0)):
    e = ceil(log2(max(max|k_t|, 1e-4) / 448))      from the bits of the correctly rounded quotient
    p + o * 128:          e4m3(k_t * 2^-e), 128 bytes, OCP e4m3fn on every vendor (-0 written 0x00)
    p + bs * 128 + o * 4: fp32 2^e (scale_fmt "ue8m0"), or the UE8M0 byte e + 127 four times ("mxfp8")
A row holding NaN or +-inf writes bytes 0x7F and scale NaN (UE8M0 0xFF) (docs/conventions.md). Negative or
out-of-cache slots write nothing. Bytes equal dsv4_rocm.reference.indexer's.
"""
import triton
import triton.language as tl

from ... import cache_views as V
from .._launch import cdiv, device_cache, device_facts, launch
from .._records import _ue8m0_fp8

ROWS = 8


@triton.jit
def _indexer_k_quant_and_cache_kernel(k_ptr, stride_k, slot_ptr, n, cache_ptr, page_stride, capacity,
                                      BS: tl.constexpr, R: tl.constexpr, FNUZ: tl.constexpr, MX: tl.constexpr):
    rows = tl.program_id(0) * R + tl.arange(0, R)
    slot = tl.load(slot_ptr + rows, mask=rows < n, other=-1).to(tl.int64)
    ok = (slot >= 0) & (slot < capacity)
    slot = tl.where(ok, slot, 0)
    d = tl.arange(0, 128)
    x = tl.load(k_ptr + rows.to(tl.int64)[:, None] * stride_k + d[None, :], mask=ok[:, None], other=0.0)
    q, e, bad = _ue8m0_fp8(x.to(tl.float32), FNUZ)
    page = cache_ptr + (slot // BS) * page_stride
    off = slot % BS
    tl.store(page[:, None] + off[:, None] * 128 + d[None, :], q, mask=ok[:, None])
    if MX:
        sbyte = tl.where(bad, 255, e + 127).to(tl.uint8)
        j = tl.arange(0, 4)
        tl.store((page + BS * 128 + off * 4)[:, None] + j[None, :], tl.broadcast_to(sbyte[:, None], (R, 4)),
                 mask=ok[:, None])
    else:
        sbits = tl.where(bad, 0x7FC00000, (e + 127) << 23)
        tl.store((page + BS * 128 + off * 4).to(tl.pointer_type(tl.int32)), sbits, mask=ok)


@device_cache()
def _fnuz(device) -> bool:
    return device_facts(device)[1]


def indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size: int, scale_fmt: str) -> None:
    """vLLM's call form; arguments checked by ``dsv4_rocm.ops.indexer_k_quant_and_cache``."""
    n = slot_mapping.shape[0]
    if n == 0:
        return
    bs = kv_cache.shape[1]
    pages = V.pages(kv_cache, bs, "kv_cache", V.INDEXER_K)
    launch(_indexer_k_quant_and_cache_kernel)[(cdiv(n, ROWS),)](
        k, k.stride(0), slot_mapping, n, pages, pages.stride(0), pages.shape[0] * bs,
        BS=bs, R=ROWS, FNUZ=_fnuz(k.device), MX=scale_fmt == "mxfp8", num_warps=4, num_stages=1,
        enable_fp_fusion=False)


def _spec(mx):
    return dict(name="indexer_k_quant_and_cache" + ("[mxfp8]" if mx else ""), fn=_indexer_k_quant_and_cache_kernel,
                pointers=dict(k_ptr="*bf16", slot_ptr="*i64", cache_ptr="*u8"), floats=(),
                constexprs=lambda arch: dict(BS=64, R=ROWS, FNUZ=arch == "gfx942", MX=mx),
                options=lambda arch: dict(num_warps=4, num_stages=1, enable_fp_fusion=False),
                matrix=False, fp8_encode=True, exact_fp32=True)


COMPILE_SPECS = [_spec(False), _spec(True)]
