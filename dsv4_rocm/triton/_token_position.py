"""Shared device function of the metadata kernels: where a token of a batch sits."""
import triton
import triton.language as tl


@triton.jit
def token_position(qsl_ptr, seq_lens_ptr, req, tok, ok, base):
    """(position, ok) of token ``tok`` of request ``req``: seq_lens[req] - query_len + (tok - query_start),
    with query_start_loc taken relative to ``base``. ok stays True only where it was, ``tok`` lies in
    [query_start, query_end) and the position is >= 0; every load is masked by the incoming ``ok``."""
    r = tl.where(ok, req, 0)
    qs = tl.load(qsl_ptr + r, mask=ok, other=0).to(tl.int64) - base
    qe = tl.load(qsl_ptr + r + 1, mask=ok, other=0).to(tl.int64) - base
    sl = tl.load(seq_lens_ptr + r, mask=ok, other=0).to(tl.int64)
    pos = sl - (qe - qs) + (tok - qs)
    return pos, ok & (qs <= tok) & (tok < qe) & (pos >= 0)
