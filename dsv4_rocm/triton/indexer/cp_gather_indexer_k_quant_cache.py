"""Indexer-K cache gather (vLLM's ``cp_gather_indexer_k_quant_cache``): the entries of each request, in
order, into contiguous rows of dst_k (128 fp8 bytes) and dst_scale (the 4 bytes of the fp32 scale).

Row t of dst belongs to request b with cu_seq_lens[b] <= t < cu_seq_lens[b + 1] (found by a binary search
over cu_seq_lens, which holds B + 1 non-decreasing offsets); it takes entry j = t - cu_seq_lens[b] of b:
page p = block_table[b, j // bs], offset o = j % bs, bytes p * page_stride + o * 128 .. + 128 and the scale at
p * page_stride + bs * 128 + o * 4. A row no request covers is not written; an entry whose block-table
column is missing or whose page is negative or past the cache is written as zero bytes. Integer work
only: the bytes are the oracle's.
"""
import torch
import triton
import triton.language as tl

from ... import cache_views as V
from .._launch import cdiv, launch

ROWS = 32


@triton.jit
def _cp_gather_indexer_k_quant_cache_kernel(cache_ptr, page_stride, num_pages, dst_k_ptr, stride_dk, dst_s_ptr,
                                            num_rows, bt_ptr, stride_bt, bt_cols, cu_ptr, num_reqs,
                                            BS: tl.constexpr, R: tl.constexpr, SEARCH_STEPS: tl.constexpr):
    t = tl.program_id(0) * R + tl.arange(0, R)
    # b = the last request whose start is <= t, by binary lifting over cu_seq_lens[0 .. num_reqs - 1]
    b = tl.zeros([R], dtype=tl.int32)
    for i in tl.static_range(SEARCH_STEPS):
        cand = b + (1 << (SEARCH_STEPS - 1 - i))
        start = tl.load(cu_ptr + cand, mask=cand < num_reqs, other=0)
        b = tl.where((cand < num_reqs) & (start <= t), cand, b)
    start = tl.load(cu_ptr + b).to(tl.int64)
    end = tl.load(cu_ptr + b + 1).to(tl.int64)
    covered = (t < num_rows) & (t >= start) & (t < end)
    j = t - start
    col = j // BS
    page = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + col, mask=covered & (col < bt_cols), other=-1).to(tl.int64)
    ok = covered & (page >= 0) & (page < num_pages)
    base = cache_ptr + tl.where(ok, page, 0) * page_stride
    off = j % BS
    d = tl.arange(0, 128)
    kb = tl.load(base[:, None] + off[:, None] * 128 + d[None, :], mask=ok[:, None], other=0)
    sc = tl.load((base + BS * 128 + off * 4).to(tl.pointer_type(tl.int32)), mask=ok, other=0)
    tl.store(dst_k_ptr + t.to(tl.int64)[:, None] * stride_dk + d[None, :], kb, mask=covered[:, None])
    tl.store(dst_s_ptr + t, sc, mask=covered)


def cp_gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens) -> None:
    """vLLM's call form; arguments checked by ``dsv4_rocm.ops.cp_gather_indexer_k_quant_cache``."""
    T, B = dst_k.shape[0], block_table.shape[0]
    if T == 0 or B == 0:
        return
    bs = kv_cache.shape[1]
    pages = V.pages(kv_cache, bs, "kv_cache", V.INDEXER_K)
    dk = dst_k.view(torch.uint8)
    launch(_cp_gather_indexer_k_quant_cache_kernel)[(cdiv(T, ROWS),)](
        pages, pages.stride(0), pages.shape[0], dk, dk.stride(0), dst_scale.view(-1).view(torch.int32),
        T, block_table, block_table.stride(0), block_table.shape[1], cu_seq_lens, B,
        BS=bs, R=ROWS, SEARCH_STEPS=max(1, (B - 1).bit_length()), num_warps=4, num_stages=1)


COMPILE_SPECS = [
    dict(name="cp_gather_indexer_k_quant_cache", fn=_cp_gather_indexer_k_quant_cache_kernel,
         pointers=dict(cache_ptr="*u8", dst_k_ptr="*u8", dst_s_ptr="*i32", bt_ptr="*i32", cu_ptr="*i32"), floats=(),
         constexprs=lambda arch: dict(BS=64, R=ROWS, SEARCH_STEPS=7),
         options=lambda arch: dict(num_warps=4, num_stages=1), matrix=False),
]
