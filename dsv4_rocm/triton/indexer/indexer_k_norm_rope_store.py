"""DeepSeek-V4.1 indexer-K store (vLLM's ``indexer_k_norm_rope_store``): k_norm, RoPE and FP8 or MXFP4
quantization of the index key of every group-closing token, into the paged indexer-K cache.

Math (dsv4_rocm/reference/indexer_v41.py): token t (t < len(kv_slot_mapping)) at position p with
(p + 1) % r == 0, a slot inside the cache and p inside the cos/sin table: k = bf16(RMSNorm(k_pre[t])),
z = bf16(RoPE(k, (p // r) * r)) on dims 64..127; FP8: one UE8M0 block of 128 (eps 1e-4), 128 e4m3 bytes
at page + o * 128 and the fp32 scale at page + bs * 128 + o * 4; MXFP4: 4 blocks of 32 E2M1 values at
page + o * 64 and their UE8M0 bytes at page + bs * 64 + o * 4 (page = slot // bs at ``k_cache.stride(0)``,
o = slot % bs). The norm and the stores are those of the compressor kernels (dsv4_rocm/triton/_records.py),
so the bytes equal the reference's on every device.

Grid: one program per ROWS tokens, one warp.
"""
import torch
import triton
import triton.language as tl

from .._launch import cdiv, launch
from .._records import _rms_normalize, _rope_last64, _store_indexer_fp8, _store_indexer_mxfp4, fnuz, record_token

ROWS = 4


@triton.jit(do_not_specialize=["n"])
def _indexer_k_norm_rope_store_kernel(k_ptr, k_stride, pos_ptr, w_ptr, eps, cs_ptr, cs_stride, cs_rows, cache_ptr,
                                      page_stride, capacity, slot_ptr, n, RATIO: tl.constexpr, BS: tl.constexpr,
                                      FP4: tl.constexpr, R: tl.constexpr, FNUZ: tl.constexpr):
    d = tl.arange(0, 128)
    for i in range(R):
        t = tl.program_id(0) * R + i
        if t < n:
            s, p, writes = record_token(slot_ptr, pos_ptr, t, capacity, cs_rows, RATIO)
            if writes:
                k = _rms_normalize(tl.load(k_ptr + t.to(tl.int64) * k_stride + d).to(tl.float32), w_ptr, eps, 128)
                k = k.to(tl.bfloat16).to(tl.float32)
                roped = _rope_last64(k, cs_ptr + ((p // RATIO) * RATIO) * cs_stride, 128)
                page = cache_ptr + (s // BS) * page_stride
                if FP4:
                    _store_indexer_mxfp4(page, s % BS, BS, roped, 128)
                else:
                    _store_indexer_fp8(page, s % BS, BS, roped, 128, FNUZ)


def indexer_k_norm_rope_store(k_pre, positions, cos_sin_cache, rms_norm_weight, rms_norm_eps, k_cache,
                              kv_slot_mapping, compress_ratio, use_fp4_cache, mxfp4_n_per_tile=0) -> None:
    """vLLM's call form; arguments checked by ``dsv4_rocm.ops.indexer_k_norm_rope_store``."""
    n = kv_slot_mapping.shape[0]
    if n == 0:
        return
    bs = k_cache.shape[1]
    cache = k_cache if k_cache.dtype == torch.uint8 else k_cache.view(torch.uint8)
    launch(_indexer_k_norm_rope_store_kernel)[(cdiv(n, ROWS),)](
        k_pre, k_pre.stride(0), positions, rms_norm_weight, rms_norm_eps, cos_sin_cache, cos_sin_cache.stride(0),
        cos_sin_cache.shape[0], cache, k_cache.stride(0), k_cache.shape[0] * bs, kv_slot_mapping, n,
        RATIO=compress_ratio, BS=bs, FP4=bool(use_fp4_cache), R=ROWS, FNUZ=fnuz(k_pre.device), num_warps=1,
        num_stages=1, enable_fp_fusion=False)


COMPILE_SPECS = [   # the ratio only changes a constant of the position test; the record format changes the code
    dict(name=f"indexer_k_norm_rope_store[{'mxfp4' if fp4 else 'fp8'}]", fn=_indexer_k_norm_rope_store_kernel,
         pointers=dict(k_ptr="*bf16", pos_ptr="*i64", w_ptr="*bf16", cs_ptr="*fp32", cache_ptr="*u8",
                       slot_ptr="*i64"),
         floats=("eps",), constexprs=lambda arch, fp4=fp4: dict(RATIO=1, BS=64, FP4=fp4, R=ROWS, FNUZ=arch == "gfx942"),
         options=lambda arch: dict(num_warps=1, num_stages=1, enable_fp_fusion=False), matrix=False,
         fp8_encode=not fp4, exact_fp32=True)
    for fp4 in (False, True)]
