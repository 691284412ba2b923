"""vLLM's ``build_c128a_topk_metadata``: the C128A index sets of every token of the step.

Math (dsv4_rocm/reference/metadata.py): token t at position p sees compressed entries i < n =
min((p + 1) // r, cap) (0 for p < 0). Decode tokens (t < num_decode_tokens), request
b = token_to_req[t]: global row = ``block_table[b, i // bs] * bs + i % bs`` for i < n (-1 where that
page is invalid), then -1; lens = n, or 0 with a row of -1 for a padding token (slot_mapping < 0) or a
request id outside block_table (the row width with CONSTANT_LEN). Prefill tokens: local row
[0, 1, .., n-1, -1, ...] at row t - num_decode_tokens of the prefill buffer.

Layout: one program per token; int32 rows of ``width_d`` / ``width_p`` columns (the returned slices),
row strides given, every column of the slice stored. Reads of block_table are masked to valid
(request, column) pairs.
"""
import triton
import triton.language as tl

from ...layout import c128a_slices
from .._launch import launch
from ._token_position import paged_slot


@triton.jit
def _c128a_kernel(gd_ptr, gd_row, lens_ptr, pf_ptr, pf_row, pos_ptr, ratio, cap, width_d, width_p, num_decode,
                  t2r_ptr, bt_ptr, bt_row, bt_rows, bt_cols, block_size, slot_ptr,
                  CONSTANT_LEN: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    p = tl.load(pos_ptr + t).to(tl.int64)
    n = tl.minimum(tl.where(p >= 0, (p + 1) // ratio, 0), cap)
    if t < num_decode:
        req = tl.load(t2r_ptr + t).to(tl.int64)
        ok = (tl.load(slot_ptr + t) >= 0) & (req >= 0) & (req < bt_rows)
        r = tl.where(ok, req, 0)
        n = tl.where(ok, n, 0)
        row = gd_ptr + t.to(tl.int64) * gd_row
        for c0 in range(0, width_d, BLOCK):
            c = c0 + tl.arange(0, BLOCK)
            col = c // block_size
            m = (c < n) & (col < bt_cols)
            slot = paged_slot(bt_ptr, r * bt_row, col, c % block_size, m, block_size, True)
            tl.store(row + c, slot.to(tl.int32), mask=c < width_d)
        if CONSTANT_LEN:
            tl.store(lens_ptr + t, width_d)
        else:
            tl.store(lens_ptr + t, n.to(tl.int32))
    else:
        row = pf_ptr + (t - num_decode).to(tl.int64) * pf_row
        for c0 in range(0, width_p, BLOCK):
            c = c0 + tl.arange(0, BLOCK)
            tl.store(row + c, tl.where(c < n, c, -1).to(tl.int32), mask=c < width_p)


def build_c128a_topk_metadata(positions, compress_ratio: int, num_decode_tokens: int, token_to_req_indices,
                              block_table, block_size: int, slot_mapping, global_decode_buffer, decode_lens_buffer,
                              prefill_buffer, max_compressed_tokens: int = 8192, *, max_seq_len=None,
                              needs_constant_topk: bool = False):
    """Launcher (arguments checked by dsv4_rocm.ops.build_c128a_topk_metadata)."""
    T = positions.shape[0]
    (gd, dl, pf), cap = c128a_slices(T, num_decode_tokens, compress_ratio, global_decode_buffer, decode_lens_buffer,
                                     prefill_buffer, max_compressed_tokens, max_seq_len)
    if T:
        launch(_c128a_kernel)[(T,)](
            gd, global_decode_buffer.stride(0), dl, pf, prefill_buffer.stride(0), positions, compress_ratio, cap,
            gd.shape[1], pf.shape[1], num_decode_tokens, token_to_req_indices, block_table, block_table.stride(0),
            block_table.shape[0], block_table.shape[1], block_size, slot_mapping,
            CONSTANT_LEN=bool(needs_constant_topk), BLOCK=1024, num_warps=4)
    return gd, dl, pf


COMPILE_SPECS = [
    dict(name="build_c128a_topk_metadata", fn=_c128a_kernel,
         pointers=dict(gd_ptr="*i32", lens_ptr="*i32", pf_ptr="*i32", pos_ptr="*i64", t2r_ptr="*i32", bt_ptr="*i32",
                       slot_ptr="*i64"), floats=(),
         constexprs=lambda arch: dict(CONSTANT_LEN=False, BLOCK=1024),
         options=lambda arch: dict(num_warps=4, num_stages=1), matrix=False),
]
