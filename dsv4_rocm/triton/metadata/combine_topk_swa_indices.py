"""vLLM's ``combine_topk_swa_indices``: the prefill index row of every token of one chunk, pointing into
the chunk's bf16 workspace.

Math (dsv4_rocm/reference/metadata.py): request b < R owns workspace rows [b*M, (b+1)*M): [0, N) its
compressed entries, N + g (g < gather_lens[b]) its raw tokens from position seq_len - gather_len on.
Token t (query_start_loc is taken relative to its first entry) of request b at position p sees the window
[start, p + right], start = max(p - max(left, W - 1), 0, seq_len - gather_len) (nothing below the gathered
rows: vLLM's bounded SWA replay gathers from the replay start on), with left / right = left_visible[t] /
right_visible[t] clamped at 0 (vLLM's in-image visibility; 0 without them: the causal window). With
topk_len = min((p+1) // r, topk) and swa_len = max(min(p + right + 1 - start, width - topk_len), 0), it gets

    [ b*M + l_i  (i < topk_len, l_i = topk_indices[t, i], -1 when l_i < 0; l_i >= N passes, as in vLLM)
    | b*M + N + g_i  (i < swa_len, g_i = start + i - (seq_len - gather_len), -1 unless
      0 <= g_i < gather_len and N + g_i < M)
    | -1 ... ]                                   lens = topk_len + swa_len

and a row of -1 with lens 0 when t is in no request or p < 0.

Layout: one program per token row; int32 output rows of ``width`` columns (row stride given, every
column stored). The request of a row is the count of request ends <= t, read BLOCK_R at a time, then
checked against its own [start, end).
"""
import triton
import triton.language as tl

from ...layout import combine_outputs
from .._launch import launch
from ._token_position import token_position

BLOCK = 512
BLOCK_R = 64
INT32_MAX = tl.constexpr(2 ** 31 - 1)


@triton.jit
def _combine_kernel(ci_ptr, ci_row, cl_ptr, topk_ptr, topk_row, topk_width, qsl_ptr, seq_lens_ptr, gather_lens_ptr,
                    left_ptr, right_ptr, num_reqs, ws_rows, n_comp, topk, ratio, window, width, BLOCK: tl.constexpr,
                    BLOCK_R: tl.constexpr, VISIBLE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    base = tl.load(qsl_ptr).to(tl.int64)
    req = 0
    for r0 in range(0, num_reqs, BLOCK_R):
        r = r0 + 1 + tl.arange(0, BLOCK_R)
        m = r <= num_reqs
        ends = tl.load(qsl_ptr + r, mask=m, other=0).to(tl.int64) - base
        req += tl.sum((m & (ends <= t)).to(tl.int32), axis=0)
    ok = req < num_reqs
    b = tl.where(ok, req, 0).to(tl.int64)
    sl = tl.load(seq_lens_ptr + b, mask=ok, other=0).to(tl.int64)
    gl = tl.load(gather_lens_ptr + b, mask=ok, other=0).to(tl.int64)
    pos, ok = token_position(qsl_ptr, seq_lens_ptr, b, t, ok, base)
    tlen = tl.where(ok, tl.minimum((pos + 1) // ratio, topk), 0)
    if VISIBLE:
        left = tl.maximum(tl.load(left_ptr + t).to(tl.int64), 0)
        right = tl.maximum(tl.load(right_ptr + t).to(tl.int64), 0)
    else:
        left = 0
        right = 0
    gather_start = sl - gl
    start = tl.maximum(tl.maximum(pos - tl.maximum(left, window - 1), 0), gather_start)
    slen = tl.where(ok, tl.maximum(tl.minimum(pos + right + 1 - start, width - tlen), 0), 0)
    first = start - gather_start
    rows = b * ws_rows
    for c0 in range(0, width, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        in_top = c < tlen
        loc = tl.load(topk_ptr + t * topk_row + c, mask=in_top & (c < topk_width), other=-1).to(tl.int64)
        vt = in_top & (loc >= 0) & (rows + loc <= INT32_MAX)
        g = first + (c - tlen)
        vs = (c >= tlen) & (c < tlen + slen) & (g >= 0) & (g < gl) & (n_comp + g < ws_rows)
        val = tl.where(vt, rows + loc, tl.where(vs, rows + n_comp + g, -1))
        tl.store(ci_ptr + t * ci_row + c, val.to(tl.int32), mask=c < width)
    tl.store(cl_ptr + t, (tlen + slen).to(tl.int32))


def combine_topk_swa_indices(topk_indices, query_start_loc, seq_lens, gather_lens, window_size: int,
                             compress_ratio: int, topk: int, M: int, N: int, *, combined_indices=None,
                             combined_lens=None, left_visible=None, right_visible=None, max_image_tokens: int = 0):
    """Launcher (arguments checked by dsv4_rocm.ops.combine_topk_swa_indices)."""
    T, K = topk_indices.shape
    ci, cl = combine_outputs(topk_indices, topk, window_size, combined_indices, combined_lens, max_image_tokens)
    visible = left_visible is not None
    if T:
        launch(_combine_kernel)[(T,)](
            ci, ci.stride(0), cl, topk_indices, topk_indices.stride(0), K, query_start_loc, seq_lens, gather_lens,
            left_visible if visible else seq_lens, right_visible if visible else seq_lens, seq_lens.shape[0], M, N,
            topk, compress_ratio, window_size, ci.shape[1], BLOCK=BLOCK, BLOCK_R=BLOCK_R, VISIBLE=visible,
            num_warps=4)
    return ci, cl


COMPILE_SPECS = [
    dict(name=f"combine_topk_swa_indices{'[image visibility]' if visible else ''}", fn=_combine_kernel,
         pointers=dict(ci_ptr="*i32", cl_ptr="*i32", topk_ptr="*i32", qsl_ptr="*i32", seq_lens_ptr="*i32",
                       gather_lens_ptr="*i32", left_ptr="*i32", right_ptr="*i32"), floats=(),
         constexprs=lambda arch, visible=visible: dict(BLOCK=BLOCK, BLOCK_R=BLOCK_R, VISIBLE=visible),
         options=lambda arch: dict(num_warps=4, num_stages=1), matrix=False)
    for visible in (False, True)
]
