"""vLLM's SWA decode metadata (``_compute_swa_indices_and_lens_kernel``): each token's sliding window as
slot ids of the SWA cache.

Math (dsv4_rocm/reference/metadata.py): row i is token t = token_offset + i of request
b = token_to_req[t] at position p = seq_lens[b] - query_len[b] + (t - query_start_loc[b]); its window is
positions q = start + k, start = max(p - W + 1, 0), k < len = p - start + 1, with slots
``block_table[b, q // bs] * bs + q % bs``. A padding token (is_valid False), a request id outside the
batch, a token outside its request's range or a negative position: len 0 and a row of -1.

Layout: one program per row; ``swa_indices`` row i at ``i * idx_row`` ([n, W] or vLLM's [n, 1, W]),
columns contiguous, all W columns written (-1 past len, and where the page is invalid). Reads of
block_table are masked to valid (request, column) pairs.
"""
import triton
import triton.language as tl

from .._launch import launch, next_power_of_2
from ._token_position import paged_slot, token_position


@triton.jit
def _swa_indices_kernel(idx_ptr, idx_row, lens_ptr, window, qsl_ptr, seq_lens_ptr, num_reqs, t2r_ptr, valid_ptr,
                        bt_ptr, bt_row, bt_rows, bt_cols, block_size, token_offset,
                        CONSTANT_LEN: tl.constexpr, BLOCK_W: tl.constexpr):
    i = tl.program_id(0)
    tok = i + token_offset
    req = tl.load(t2r_ptr + tok).to(tl.int64)
    ok = (tl.load(valid_ptr + tok) != 0) & (req >= 0) & (req < num_reqs) & (req < bt_rows)
    r = tl.where(ok, req, 0)
    pos, ok = token_position(qsl_ptr, seq_lens_ptr, r, tok, ok, 0)
    start = tl.maximum(pos - window + 1, 0)
    n = tl.where(ok, pos - start + 1, 0)
    if CONSTANT_LEN:
        tl.store(lens_ptr + i, window)
    else:
        tl.store(lens_ptr + i, n.to(tl.int32))
    row = idx_ptr + i.to(tl.int64) * idx_row
    for k0 in range(0, window, BLOCK_W):
        k = k0 + tl.arange(0, BLOCK_W)
        q = start + k
        col = q // block_size
        m = (k < n) & (col < bt_cols)
        slot = paged_slot(bt_ptr, r * bt_row, col, q % block_size, m, block_size, True)
        tl.store(row + k, slot.to(tl.int32), mask=k < window)


def compute_swa_indices_and_lens(swa_indices, swa_lens, window_size: int, query_start_loc, seq_lens,
                                 token_to_req_indices, is_valid_token, block_table, block_size: int,
                                 token_offset: int = 0, num_tokens=None, *, needs_constant_topk: bool = False):
    """Launcher (arguments checked by dsv4_rocm.ops.compute_swa_indices_and_lens)."""
    n = swa_indices.shape[0] if num_tokens is None else num_tokens
    if n:
        launch(_swa_indices_kernel)[(n,)](
            swa_indices, swa_indices.stride(0), swa_lens, window_size, query_start_loc, seq_lens, seq_lens.shape[0],
            token_to_req_indices, is_valid_token, block_table, block_table.stride(0), block_table.shape[0],
            block_table.shape[1], block_size, token_offset, CONSTANT_LEN=bool(needs_constant_topk),
            BLOCK_W=min(next_power_of_2(window_size), 1024), num_warps=4)
    return swa_indices[:n], swa_lens[:n]


COMPILE_SPECS = [
    dict(name="compute_swa_indices_and_lens", fn=_swa_indices_kernel,
         pointers=dict(idx_ptr="*i32", lens_ptr="*i32", qsl_ptr="*i32", seq_lens_ptr="*i32", t2r_ptr="*i32",
                       valid_ptr="*i1", bt_ptr="*i32"), floats=(),
         constexprs=lambda arch: dict(CONSTANT_LEN=False, BLOCK_W=128),
         options=lambda arch: dict(num_warps=4, num_stages=1), matrix=False),
]
