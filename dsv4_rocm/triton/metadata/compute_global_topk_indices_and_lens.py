"""vLLM's ``compute_global_topk_indices_and_lens`` (C4 decode): local top-k indices -> slots of the
compressed cache, valid ones packed first.

Math (dsv4_rocm/reference/metadata.py): token t of request b = token_to_req[t]; local index l >= 0
maps to ``block_table[b, l // bs] * bs + l % bs`` when that column exists and its page is >= 0. Row t
of the output holds the valid slots in their order, then -1; lens[t] = their count (0, and a row of
-1, for a padding token or a request id outside block_table; the row width with CONSTANT_LEN). Slots are
int64; with INT32 (an int32 output) one past 2**31 - 1 is invalid like a missing page.

Layout: one program per token; rows at ``t * row stride``, columns contiguous. Two passes over the
row: the first counts the valid entries (C), the second stores each valid slot at its packed column
(< C) and -1 at the columns >= C of its own block, so every column is stored exactly once (no two
lanes ever store to the same address).
"""
import torch
import triton
import triton.language as tl

from ...layout import global_topk_outputs
from .._launch import launch, next_power_of_2
from .._pdl import pdl_start
from ._token_position import INT32_MAX


@triton.jit
def _row_slots(topk_ptr, t, topk_row, k, c, r, tok_ok, bt_ptr, bt_row, bt_cols, block_size, INT32: tl.constexpr):
    m = (c < k) & tok_ok
    loc = tl.load(topk_ptr + t * topk_row + c, mask=m, other=-1).to(tl.int64)
    col = loc // block_size
    ok = m & (loc >= 0) & (col < bt_cols)
    page = tl.load(bt_ptr + r * bt_row + col, mask=ok, other=-1).to(tl.int64)
    slot = page * block_size + loc % block_size
    ok = ok & (page >= 0)
    if INT32:                      # an int32 output cannot name the slot: invalid, not wrapped
        ok = ok & (slot <= INT32_MAX)
    return tl.where(ok, slot, -1), ok


@triton.jit
def _global_topk_kernel(out_ptr, out_row, lens_ptr, topk_ptr, topk_row, k, t2r_ptr, bt_ptr, bt_row, bt_rows, bt_cols,
                        block_size, valid_ptr, CONSTANT_LEN: tl.constexpr, INT32: tl.constexpr, BLOCK: tl.constexpr,
                        PDL: tl.constexpr = False):
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    req = tl.load(t2r_ptr + t).to(tl.int64)
    tok_ok = (tl.load(valid_ptr + t) != 0) & (req >= 0) & (req < bt_rows)
    r = tl.where(tok_ok, req, 0)
    count = 0
    for c0 in range(0, k, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        _, ok = _row_slots(topk_ptr, t, topk_row, k, c, r, tok_ok, bt_ptr, bt_row, bt_cols, block_size, INT32)
        count += tl.sum(ok.to(tl.int32), axis=0)
    done = 0
    for c0 in range(0, k, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        slot, ok = _row_slots(topk_ptr, t, topk_row, k, c, r, tok_ok, bt_ptr, bt_row, bt_cols, block_size, INT32)
        oki = ok.to(tl.int32)
        packed = done + tl.cumsum(oki, axis=0) - oki
        tl.store(out_ptr + t * out_row + packed, slot.to(out_ptr.dtype.element_ty), mask=ok)
        tl.store(out_ptr + t * out_row + c, tl.full([BLOCK], -1, out_ptr.dtype.element_ty), mask=(c < k) & (c >= count))
        done += tl.sum(oki, axis=0)
    if CONSTANT_LEN:
        tl.store(lens_ptr + t, k)
    else:
        tl.store(lens_ptr + t, count)


def compute_global_topk_indices_and_lens(topk_indices, token_to_req_indices, block_table, block_size: int,
                                         is_valid_token, output_buffers=None, *, needs_constant_topk: bool = False):
    """Launcher (arguments checked by dsv4_rocm.ops.compute_global_topk_indices_and_lens)."""
    T, K = topk_indices.shape
    out, lens = global_topk_outputs(topk_indices, output_buffers)
    if T:
        launch(_global_topk_kernel)[(T,)](
            out, out.stride(0), lens, topk_indices, topk_indices.stride(0), K, token_to_req_indices, block_table,
            block_table.stride(0), block_table.shape[0], block_table.shape[1], block_size, is_valid_token,
            CONSTANT_LEN=bool(needs_constant_topk), INT32=out.dtype == torch.int32,
            BLOCK=min(next_power_of_2(max(K, 1)), 1024), num_warps=4)
    return out, lens


COMPILE_SPECS = [
    dict(name="compute_global_topk_indices_and_lens", fn=_global_topk_kernel,
         pointers=dict(out_ptr="*i32", lens_ptr="*i32", topk_ptr="*i32", t2r_ptr="*i32", bt_ptr="*i32",
                       valid_ptr="*i1"), floats=(),
         constexprs=lambda arch: dict(CONSTANT_LEN=False, INT32=True, BLOCK=512),
         options=lambda arch: dict(num_warps=4, num_stages=1), matrix=False),
]
