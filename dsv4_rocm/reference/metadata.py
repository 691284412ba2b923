"""Index metadata of one serving step, in vLLM's call forms: the oracle of ``dsv4_rocm.ops.metadata``.

Each function takes vLLM's arguments, writes the caller's buffers where vLLM passes them and returns what
vLLM returns. Conventions: ``query_start_loc[b]..query_start_loc[b+1]`` are request b's tokens, token t
of request b sits at absolute position ``seq_lens[b] - query_len[b] + (t - query_start_loc[b])``, and
``block_table[b, i]`` is the page holding request b's logical block i, so slot = page * bs + offset.

Padding and garbage never reach another request (docs/conventions.md): a request id, position,
block-table column or page that is negative or out of range makes the entry it would produce -1 (and,
where a token has no usable request at all, its length 0). Slots are computed in int64; one that the
output's dtype cannot hold (page * bs + offset >= 2**31 in an int32 output: a block id >= 2**25 at
block size 64) is an invalid entry too, never a wrapped one. The functions are vectorized torch so the
whole layer can run on them; the per-token semantics are spelled out in each docstring.
"""
import math

import torch

from ..layout import (TOPK_ALIGNMENT, c128a_effective_width, c128a_slices, combine_outputs,  # noqa: F401
                      combined_width, global_topk_outputs)



def token_to_req_indices(query_start_loc: torch.Tensor) -> torch.Tensor:
    """int64 [T]: repeat_interleave(arange(B), query_lens)."""
    lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    if bool((lens < 0).any()):
        raise ValueError("query_start_loc must be non-decreasing")
    return torch.repeat_interleave(torch.arange(lens.shape[0], device=lens.device), lens)


def _page(block_table: torch.Tensor, req: torch.Tensor, col: torch.Tensor):
    """(page int64, ok): ``block_table[req, col]`` where req, col and the entry are all valid."""
    rows, cols = block_table.shape
    req, col = req.long(), col.long()
    ok = (req >= 0) & (req < rows) & (col >= 0) & (col < cols)
    if block_table.numel() == 0:
        return torch.full_like(col, -1), torch.zeros_like(ok)
    page = block_table[req.clamp(0, rows - 1), col.clamp(0, cols - 1)].long()
    ok = ok & (page >= 0)
    return torch.where(ok, page, torch.full_like(page, -1)), ok


def _slots(block_table, req, logical, block_size: int, dtype=torch.int64) -> torch.Tensor:
    """int64: slot of logical entry ``logical`` of request ``req``, -1 where any part of it is invalid or
    the slot does not fit ``dtype`` (the output's)."""
    logical = logical.long()
    page, ok = _page(block_table, req, torch.where(logical >= 0, logical // block_size, -1))
    slot = page * block_size + logical % block_size
    ok = ok & (slot <= torch.iinfo(dtype).max)
    return torch.where(ok, slot, torch.full_like(page, -1))


def slot_mapping_from_block_table(positions, token_to_req, block_table, block_size: int) -> torch.Tensor:
    """int64 [T]: where each token's record goes (uncompressed cache); -1 where it has no valid page."""
    return _slots(block_table, token_to_req, positions, block_size)


def request_of_tokens(tokens: torch.Tensor, query_start_loc: torch.Tensor, num_reqs: int):
    """(request, inside): request = #{i in [1, num_reqs] : query_start_loc[i] <= token}, and whether the
    token lies in [query_start_loc[request], query_start_loc[request + 1]). For a monotone
    query_start_loc that is the request owning the token; for any other it is still one fixed request
    (the kernels count the same way), never an index outside the batch."""
    tokens = tokens.long()
    ends = query_start_loc[1:num_reqs + 1].long()
    req = (ends.unsqueeze(0) <= tokens.unsqueeze(1)).sum(1) if num_reqs else torch.zeros_like(tokens)
    has = req < num_reqs
    r = req.clamp(max=max(num_reqs - 1, 0))
    qsl = query_start_loc.long()
    qs = qsl[r] if num_reqs else torch.zeros_like(tokens)
    qe = qsl[r + 1] if num_reqs else torch.zeros_like(tokens)
    return req, has & (qs <= tokens) & (tokens < qe)


def token_positions(tokens, req, inside, query_start_loc, seq_lens):
    """Absolute position of each token (garbage where not ``inside``)."""
    r = torch.where(inside, req, torch.zeros_like(req))
    if seq_lens.numel() == 0:
        return torch.full_like(tokens, -1)
    qsl = query_start_loc.long()
    qs, qe, sl = qsl[r], qsl[r + 1], seq_lens.long()[r]
    return sl - (qe - qs) + (tokens.long() - qs)


def get_compressed_slot_mapping(num_tokens: int, query_start_loc, seq_lens, block_table, block_size: int,
                                compress_ratio: int, out=None, cp_world_size: int = 1, cp_rank: int = 0,
                                cp_kv_cache_interleave_size: int = 1, *, slot_mapping=None,
                                cp_over_positions: bool = False) -> torch.Tensor:
    """int64 [num_tokens]: the compressed-cache slot each token writes, -1 for the others.

    Requests are the rows of ``block_table``. Token t of request b at position p writes compressed entry
    j = p // r iff (p + 1) % r == 0, and, with ``slot_mapping`` (vLLM 0.33), iff its own slot
    ``slot_mapping[t]`` is not padding (-1, vLLM's PAD_SLOT_ID, or t past its entries; any other value,
    even negative, is a slot of its own: only the padding mark is read): a token vLLM replays, or one another
    context-parallel rank owns, writes nothing. Context parallelism (W = cp_world_size ranks, interleave I):

    * over entries (earlier vLLM): the logical block of j is ``j // (bs * W)``; j lives on rank
      ``((j mod bs*W) // I) % W`` at local offset ``((j mod bs*W) // (W*I)) * I + (j mod bs*W) % I``; entries
      of other ranks get -1.
    * over positions (``cp_over_positions``, vLLM 0.33's dcp_world_size / cp_interleave): the rank-local
      position ``(p // (I*W)) * I + p % I`` is compressed (j = local // r) and paged as usual; which tokens
      are this rank's is slot_mapping's to say.

    With ``out`` all of ``out`` is set to -1 first and ``out[:num_tokens]`` is returned (vLLM fills the whole
    buffer)."""
    dev = query_start_loc.device
    if out is not None:
        out.fill_(-1)
        res = out[:num_tokens]
    else:
        res = torch.full((num_tokens,), -1, dtype=torch.int64, device=dev)
    R = block_table.shape[0]
    t = torch.arange(num_tokens, device=dev)
    req, inside = request_of_tokens(t, query_start_loc, R)
    pos = token_positions(t, req, inside, query_start_loc, seq_lens)
    ok = inside & (pos >= 0)
    if slot_mapping is not None:
        own = torch.full((num_tokens,), -1, dtype=torch.int64, device=dev)
        n = min(num_tokens, slot_mapping.shape[0])
        own[:n] = slot_mapping[:n].long()
        ok = ok & (own != -1)
    pos = torch.where(ok, pos, torch.zeros_like(pos))
    ok = ok & ((pos + 1) % compress_ratio == 0)
    W, I = cp_world_size, cp_kv_cache_interleave_size
    if cp_over_positions:
        j = ((pos // (I * W)) * I + pos % I) // compress_ratio
        col, off = j // block_size, j % block_size
    else:
        j = pos // compress_ratio
        vbs = block_size * W
        col, voff = j // vbs, j % vbs
        ok = ok & ((voff // I) % W == cp_rank)
        off = (voff // (W * I)) * I + voff % I
    page, pok = _page(block_table, torch.where(ok, req, torch.full_like(req, -1)), col)
    slot = page * block_size + off
    res.copy_(torch.where(ok & pok, slot, torch.full_like(slot, -1)))
    return res


def _rows_2d(swa_indices: torch.Tensor) -> torch.Tensor:
    """[n, W] view of vLLM's [n, 1, W] (or [n, W]) SWA index buffer."""
    return swa_indices[:, 0] if swa_indices.dim() == 3 else swa_indices


def compute_swa_indices_and_lens(swa_indices, swa_lens, window_size: int, query_start_loc, seq_lens,
                                 token_to_req_indices, is_valid_token, block_table, block_size: int,
                                 token_offset: int = 0, num_tokens=None, *, needs_constant_topk: bool = False):
    """The sliding window of each token, as slot ids (vLLM's ``_compute_swa_indices_and_lens_kernel``).

    Row i describes token ``t = token_offset + i`` (i < num_tokens, default all rows of ``swa_indices``):
    its request b = token_to_req_indices[t] and position p; the window is positions max(0, p-W+1)..p,
    ``swa_indices[i, k]`` is the slot of the k-th of them (-1 where its page is invalid) and -1 past
    them; ``swa_lens[i]`` = the window's length. A token with is_valid_token False, a request id outside
    the batch, a place outside its request's query range or a negative position gets lens 0 and a row
    of -1. ``needs_constant_topk`` (later vLLM): every lens is W. Returns the written rows of both."""
    idx = _rows_2d(swa_indices)
    n = idx.shape[0] if num_tokens is None else num_tokens
    W, dev = window_size, idx.device
    t = torch.arange(n, device=dev) + token_offset
    R = min(seq_lens.shape[0], query_start_loc.shape[0] - 1, block_table.shape[0])
    req = token_to_req_indices[t].long()
    ok = (is_valid_token[t] != 0) & (req >= 0) & (req < R)
    r = torch.where(ok, req, torch.zeros_like(req))
    if R > 0:
        qsl = query_start_loc.long()
        qs, qe = qsl[r], qsl[r + 1]
        ok = ok & (qs <= t) & (t < qe)
        pos = seq_lens.long()[r] - (qe - qs) + (t - qs)
    else:
        pos = torch.full_like(t, -1)
    ok = ok & (pos >= 0)
    start = (pos - W + 1).clamp(min=0)
    lens = torch.where(ok, pos - start + 1, torch.zeros_like(pos))
    k = torch.arange(W, device=dev)
    q = start.unsqueeze(1) + k
    inwin = k.unsqueeze(0) < lens.unsqueeze(1)
    slots = _slots(block_table, torch.where(inwin, r.unsqueeze(1), torch.full_like(q, -1)), q, block_size, idx.dtype)
    idx[:n].copy_(torch.where(inwin, slots, torch.full_like(slots, -1)))
    swa_lens[:n].copy_(torch.full_like(lens, W) if needs_constant_topk else lens)
    return swa_indices[:n], swa_lens[:n]


def compute_prefill_gather_lens(prefill_gather_lens, seq_lens, query_start_loc, num_prefills: int,
                                num_decodes: int, window_size: int) -> torch.Tensor:
    """Raw tokens each prefill request gathers into the workspace (vLLM's ``_compute_prefill_metadata_kernel``):
    for request b = num_decodes + i, ``query_len + min(prefix_len, W - 1)``, clamped to [0, seq_len]
    (equal for every consistent batch). Writes and returns ``prefill_gather_lens[:num_prefills]``."""
    b = torch.arange(num_decodes, num_decodes + num_prefills, device=seq_lens.device)
    qsl = query_start_loc.long()
    ql = qsl[b + 1] - qsl[b]
    sl = seq_lens.long()[b]
    g = ql + torch.clamp(sl - ql, max=window_size - 1)
    g = torch.minimum(g.clamp(min=0), sl.clamp(min=0))
    prefill_gather_lens[:num_prefills].copy_(g)
    return prefill_gather_lens[:num_prefills]


def compute_global_topk_indices_and_lens(topk_indices, token_to_req_indices, block_table, block_size: int,
                                         is_valid_token, output_buffers=None, *, needs_constant_topk: bool = False):
    """C4 decode: local compressed indices -> slots of the compressed cache, valid ones first.

    For token t (a row of ``topk_indices``) of request b = token_to_req_indices[t], each local index
    l >= 0 maps to ``block_table[b, l // bs] * bs + l % bs``; -1, and any index whose column or page is
    invalid, maps to nothing. The valid slots are packed to the front of the row in their order, the
    rest is -1, and lens[t] = their count (later vLLM's bounds semantics: invalid entries never count).
    A token with is_valid_token False or a request id outside block_table gets a row of -1 and lens 0.
    ``needs_constant_topk``: every lens is the row width. Returns (indices like topk_indices, int32 lens),
    written into ``output_buffers`` when given."""
    T, K = topk_indices.shape
    out, lens = global_topk_outputs(topk_indices, output_buffers)
    req = token_to_req_indices[:T].long()
    tok_ok = (is_valid_token[:T] != 0) & (req >= 0) & (req < block_table.shape[0])
    req = torch.where(tok_ok, req, torch.full_like(req, -1)).unsqueeze(1).expand(T, K)
    slots = _slots(block_table, req, topk_indices.long(), block_size, out.dtype)
    ok = slots >= 0
    count = ok.sum(1)
    packed = torch.full((T, K + 1), -1, dtype=torch.int64, device=slots.device)    # column K: discard
    dest = torch.where(ok, ok.long().cumsum(1) - 1, torch.full_like(slots, K))
    packed.scatter_(1, dest, slots)
    out.copy_(packed[:, :K])
    lens.copy_(torch.full_like(count, K) if needs_constant_topk else count)
    return out, lens


def c128_max_entries(max_model_len: int, ratio: int = 128) -> int:
    """The C128A row width vLLM allocates: round_up(ceil(max_model_len / 128), 128)."""
    return int(math.ceil(math.ceil(max_model_len / ratio) / TOPK_ALIGNMENT) * TOPK_ALIGNMENT)


def build_c128a_topk_metadata(positions, compress_ratio: int, num_decode_tokens: int, token_to_req_indices,
                              block_table, block_size: int, slot_mapping, global_decode_buffer, decode_lens_buffer,
                              prefill_buffer, max_compressed_tokens: int = 8192, *, max_seq_len=None,
                              needs_constant_topk: bool = False):
    """C128A index sets of every token of the step (vLLM's ``build_c128a_topk_metadata``).

    Token t (the first ``num_decode_tokens`` are decode tokens) at position p sees the compressed
    entries i < n = min((p + 1) // r, cap) (n = 0 for p < 0; cap = max_compressed_tokens, or the
    effective width with ``max_seq_len``). Decode token t, request b = token_to_req_indices[t]: row t of
    the global slice holds ``block_table[b, i // bs] * bs + i % bs`` for i < n (-1 where that page is
    invalid) and -1 after; decode lens = n, or 0 for a padding token (slot_mapping[t] < 0) or a request
    id outside block_table, whose row is all -1. Prefill token t: row t - num_decode_tokens of the
    prefill slice holds the local indices [0, 1, .., n-1, -1, ...]. Every column of the returned slices
    is written. ``needs_constant_topk``: decode lens = the slice width. Returns the three slices."""
    T = positions.shape[0]
    nd = num_decode_tokens
    (gd, dl, pf), cap = c128a_slices(T, nd, compress_ratio, global_decode_buffer, decode_lens_buffer,
                                     prefill_buffer, max_compressed_tokens, max_seq_len)
    p = positions.long()
    n = torch.where(p >= 0, torch.div(p + 1, compress_ratio, rounding_mode="floor"), torch.zeros_like(p))
    n = n.clamp(max=cap)
    if nd:
        req = token_to_req_indices[:nd].long()
        ok = (slot_mapping[:nd] >= 0) & (req >= 0) & (req < block_table.shape[0])
        nn = torch.where(ok, n[:nd], torch.zeros_like(n[:nd]))
        i = torch.arange(gd.shape[1], device=p.device)
        vis = i.unsqueeze(0) < nn.unsqueeze(1)
        slots = _slots(block_table, torch.where(vis, req.unsqueeze(1), torch.full_like(vis, -1, dtype=torch.long)),
                       i.unsqueeze(0).expand_as(vis), block_size, gd.dtype)
        gd.copy_(torch.where(vis, slots, torch.full_like(slots, -1)))
        dl.copy_(torch.full_like(nn, gd.shape[1]) if needs_constant_topk else nn)
    if T - nd:
        i = torch.arange(pf.shape[1], device=p.device)
        loc = i.unsqueeze(0).expand(T - nd, -1)
        pf.copy_(torch.where(loc < n[nd:].unsqueeze(1), loc, torch.full_like(loc, -1)))
    return gd, dl, pf


def combine_topk_swa_indices(topk_indices, query_start_loc, seq_lens, gather_lens, window_size: int,
                             compress_ratio: int, topk: int, M: int, N: int, *, combined_indices=None,
                             combined_lens=None, left_visible=None, right_visible=None, max_image_tokens: int = 0):
    """Prefill indices into one chunk's bf16 workspace (vLLM's ``combine_topk_swa_indices``).

    The chunk holds requests b < len(seq_lens); ``query_start_loc`` (len + 1 entries) is taken relative to
    its first entry, so row t of ``topk_indices`` is the chunk's t-th token. Request b owns workspace rows
    [b*M, (b+1)*M): rows [0, N) its compressed entries, rows N + g for g < gather_lens[b] its raw tokens
    at positions gather_start + g, gather_start = seq_len - gather_len. Token t of request b at position p
    sees the window [p - max(l, W - 1), p + r] cut at position 0 and at gather_start (no window key exists
    below the gathered rows: vLLM's bounded SWA replay gathers only from the request's replay start on),
    l = left_visible[t] and r = right_visible[t] (the positions of its image span it sees before and after
    it, vLLM's in-image bidirectional visibility; 0 and 0 without them: the causal window min(p + 1, W)).
    With topk_len = min((p+1) // r, topk), swa_start the window's first position and swa_len its length
    (>= 0), the row is
        [ b*M + topk_indices[t, i] for i < topk_len | b*M + N + (swa_start + i - gather_start)
          for i < swa_len | -1 ... ]
    of ``combined_width(topk, W, max_image_tokens)`` columns, and lens = topk_len + swa_len (a window
    longer than the row holds is cut to it; negative l, r count as 0). A local index >= 0 is written as
    b*M + index whatever its size (vLLM's form: its indexers emit only valid entries within topk_len, and
    vLLM's tests pass indices past N through); a negative one (padding) and a window row outside the
    gathered rows (or past M) become -1 in place (the length stays: the attention skips -1 and rows past
    its workspace). Rows of tokens outside every request, or at a negative position, are all -1 with lens 0.
    Returns (indices, lens) = the first len(topk_indices) rows of ``combined_indices`` / ``combined_lens``
    when given, else new tensors."""
    T, K = topk_indices.shape
    dev = topk_indices.device
    ci, cl = combine_outputs(topk_indices, topk, window_size, combined_indices, combined_lens, max_image_tokens)
    R = seq_lens.shape[0]
    qsl = query_start_loc[:R + 1].long() - query_start_loc[0].long()
    t = torch.arange(T, device=dev)
    req, ok = request_of_tokens(t, qsl, R)
    pos = token_positions(t, req, ok, qsl, seq_lens)
    ok = ok & (pos >= 0)
    zero = torch.zeros_like(pos)
    left = zero if left_visible is None else left_visible[:T].long().clamp(min=0)
    right = zero if right_visible is None else right_visible[:T].long().clamp(min=0)
    tlen = torch.where(ok, torch.clamp(torch.div(pos + 1, compress_ratio, rounding_mode="floor"), max=topk), zero)
    r = torch.where(ok, req, zero)
    gl = gather_lens.long()[r] if R else zero
    gather_start = seq_lens.long()[r] - gl if R else zero
    # the window stops at the first gathered position (under vLLM's bounded SWA replay nothing below the
    # request's replay start is gathered, and gather_lens says so)
    start = torch.maximum(torch.clamp(pos - torch.clamp(left, min=window_size - 1), min=0), gather_start)
    slen = torch.where(ok, torch.clamp(torch.minimum(pos + right + 1 - start, ci.shape[1] - tlen), min=0), zero)
    first = start - gather_start
    base = (r * M).unsqueeze(1)
    c = torch.arange(ci.shape[1], device=dev).unsqueeze(0)
    loc = torch.full((T, ci.shape[1]), -1, dtype=torch.int64, device=dev)
    kk = min(K, ci.shape[1])
    loc[:, :kk] = topk_indices[:, :kk].long()
    in_top = c < tlen.unsqueeze(1)
    vt = in_top & (loc >= 0) & (base + loc <= 2 ** 31 - 1)
    q = first.unsqueeze(1) + (c - tlen.unsqueeze(1))
    vs = (~in_top) & (c < (tlen + slen).unsqueeze(1)) & (q >= 0) & (q < gl.unsqueeze(1)) & (N + q < M)
    val = torch.where(vt, base + loc, torch.where(vs, base + N + q, torch.full_like(q, -1)))
    ci.copy_(val)
    cl.copy_(tlen + slen)
    return ci, cl


def ragged_indices_to_dense(ragged_indices: torch.Tensor, ragged_indptr: torch.Tensor, out_indices: torch.Tensor,
                            out_lens: torch.Tensor):
    """A ragged index stream (vLLM's ROCm form: row t is ``ragged_indices[indptr[t]:indptr[t + 1]]``) as the
    dense rows FlashMLA's kernels read: ``out_indices[t, :n_t]`` = row t's entries, ``out_indices[t, n_t:]``
    = -1, ``out_lens[t] = n_t``, with n_t = the row's length clamped to [0, W] (W = out_indices.shape[1]).
    Offsets are clamped to [0, len(ragged_indices)]: a stream shorter than its offsets say gives shorter
    rows, never a read past it. Entries are copied as they are (-1 or past the cache stays absent for the
    attention). out_indices int32 [T, W], out_lens int32 [T], T = len(ragged_indptr) - 1."""
    T, W = out_indices.shape
    N = ragged_indices.shape[0]
    dev = out_indices.device
    ptr = ragged_indptr.long().clamp(0, N)
    start, end = ptr[:-1], torch.maximum(ptr[1:], ptr[:-1])
    n = torch.clamp(end - start, max=W)
    col = torch.arange(W, device=dev).unsqueeze(0)
    take = col < n.unsqueeze(1)
    src = torch.where(take, start.unsqueeze(1) + col, torch.zeros_like(col))
    vals = ragged_indices.long()[src] if N else torch.zeros_like(src)
    out_indices.copy_(torch.where(take, vals, torch.full_like(vals, -1)))
    out_lens.copy_(n)
    return out_indices, out_lens
