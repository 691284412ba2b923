"""Shared device functions of the metadata kernels: which request a token belongs to, where it sits, and
the cache slot a block-table entry names."""
import triton
import triton.language as tl

INT32_MAX = tl.constexpr(2 ** 31 - 1)


@triton.jit
def request_index(qsl_ptr, num_reqs, tok, BLOCK_R: tl.constexpr):
    """Per token of the 1-D block ``tok``: the count of request ends query_start_loc[1..num_reqs] that are
    <= tok, read BLOCK_R at a time. For a monotone query_start_loc that is the request holding the token
    (num_reqs past the last request); for any other it is still one fixed request, which the caller checks
    with token_place, so two programs never claim one token differently."""
    req = tl.zeros_like(tok).to(tl.int32)
    for r0 in range(0, num_reqs, BLOCK_R):
        r = r0 + 1 + tl.arange(0, BLOCK_R)
        ends = tl.load(qsl_ptr + r, mask=r <= num_reqs, other=INT32_MAX).to(tl.int64)
        req += tl.sum((ends[None, :] <= tok[:, None]).to(tl.int32), axis=1)
    return req


@triton.jit
def token_place(qsl_ptr, seq_lens_ptr, req, tok, ok, base):
    """(position, inside) of token ``tok`` of request ``req``: position = seq_lens[req] - query_len +
    (tok - query_start), with query_start_loc taken relative to ``base``; inside stays True only where
    ``ok`` was and ``tok`` lies in [query_start, query_end). Every load is masked by ``ok``."""
    r = tl.where(ok, req, 0)
    qs = tl.load(qsl_ptr + r, mask=ok, other=0).to(tl.int64) - base
    qe = tl.load(qsl_ptr + r + 1, mask=ok, other=0).to(tl.int64) - base
    sl = tl.load(seq_lens_ptr + r, mask=ok, other=0).to(tl.int64)
    pos = sl - (qe - qs) + (tok - qs)
    return pos, ok & (qs <= tok) & (tok < qe)


@triton.jit
def token_position(qsl_ptr, seq_lens_ptr, req, tok, ok, base):
    """(position, ok) of token ``tok`` of request ``req`` (token_place): ok stays True only where the token
    is inside its request and the position is >= 0."""
    pos, inside = token_place(qsl_ptr, seq_lens_ptr, req, tok, ok, base)
    return pos, inside & (pos >= 0)


@triton.jit
def paged_slot(bt_ptr, row_offset, col, offset, ok, block_size, INT32: tl.constexpr):
    """int64 slot ``page * block_size + offset`` of page = bt_ptr[row_offset + col], -1 where ``ok`` is False
    or the page is negative, and with INT32 (an int32 output) where the slot exceeds 2**31 - 1 (a block id
    >= 2**25 at block size 64: an invalid entry, never a wrapped one). The load is masked by ``ok``: the
    caller puts the bounds of the row and the column (and the token's validity) into it."""
    page = tl.load(bt_ptr + row_offset + col, mask=ok, other=-1).to(tl.int64)
    slot = page * block_size + offset
    ok = ok & (page >= 0)
    if INT32:
        ok = ok & (slot <= INT32_MAX)
    return tl.where(ok, slot, -1)
