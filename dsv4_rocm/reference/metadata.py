"""Index metadata of one serving step (DSV4_SPEC §9). All outputs int32 unless noted; -1 = invalid.

Conventions: ``token_to_req[t]`` is the request of token t, ``positions[t]`` its absolute position,
``block_table[b, i]`` the physical page of logical block i of request b, slot = page * bs + offset.
"""
import math

import torch


def token_to_req_indices(query_start_loc: torch.Tensor) -> torch.Tensor:
    """int64 [T]: repeat_interleave(arange(B), query_lens)."""
    lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    if bool((lens < 0).any()):
        raise ValueError("query_start_loc must be non-decreasing")
    return torch.repeat_interleave(torch.arange(lens.shape[0], device=lens.device), lens)


def _slots(block_table, req, logical, block_size):
    logical = logical.long()
    blk = block_table[req.long(), logical // block_size].long()
    return blk * block_size + logical % block_size


def slot_mapping_from_block_table(positions, token_to_req, block_table, block_size: int) -> torch.Tensor:
    """int64 [T]: where each token's record goes (uncompressed cache)."""
    return _slots(block_table, token_to_req, positions, block_size)


def get_compressed_slot_mapping(positions, token_to_req, block_table, ratio: int, block_size: int,
                                slot_mapping=None) -> torch.Tensor:
    """int64 [T]: the slot of compressed entry j = p // r for tokens with (p + 1) % r == 0, else -1.
    Tokens whose slot_mapping is negative (padding) get -1."""
    p = positions.long()
    boundary = (p + 1) % ratio == 0
    if slot_mapping is not None:
        boundary &= slot_mapping[:p.shape[0]] >= 0
    j = p // ratio
    s = _slots(block_table, token_to_req, torch.where(boundary, j, torch.zeros_like(j)), block_size)
    return torch.where(boundary, s, torch.full_like(s, -1))


def compute_swa_indices_and_lens(positions, token_to_req, block_table, slot_mapping, window: int,
                                 block_size: int = 64):
    """Decode SWA set: slots of positions max(0, p-W+1)..p ascending, padded with -1 to width W;
    lens = count (0 for padding tokens with slot_mapping < 0)."""
    p = positions.long()
    start = (p - window + 1).clamp(min=0)
    lens = p - start + 1
    lens = torch.where(slot_mapping[:p.shape[0]] >= 0, lens, torch.zeros_like(lens))
    ar = torch.arange(window, device=p.device)
    q = start.unsqueeze(1) + ar
    ok = ar.unsqueeze(0) < lens.unsqueeze(1)
    s = _slots(block_table, token_to_req.unsqueeze(1).expand_as(q), torch.where(ok, q, torch.zeros_like(q)),
               block_size)
    return torch.where(ok, s, torch.full_like(s, -1)).to(torch.int32), lens.to(torch.int32)


def compute_global_topk_indices_and_lens(topk_local, token_to_req, block_table, block_size: int,
                                         is_valid_token):
    """C4 decode: local compressed indices -> global slot ids of the compressed cache."""
    l = topk_local.long()
    ok = l >= 0
    s = _slots(block_table, token_to_req.unsqueeze(1).expand_as(l), torch.where(ok, l, torch.zeros_like(l)),
               block_size)
    g = torch.where(ok, s, torch.full_like(s, -1)).to(torch.int32)
    lens = torch.where(is_valid_token, ok.sum(1), torch.zeros_like(ok.sum(1))).to(torch.int32)
    return g, lens


def c128_max_entries(max_model_len: int, ratio: int = 128) -> int:
    """Kmax = round_up(ceil(max_model_len / 128), 128)."""
    return int(math.ceil(math.ceil(max_model_len / ratio) / 128) * 128)


def build_c128a_topk_metadata(positions, token_to_req, block_table, slot_mapping, is_decode_token,
                              max_model_len: int, block_size: int = 2, ratio: int = 128):
    """C128: every visible entry j < (p+1)//128 (capped at Kmax). Decode tokens get global slot ids,
    prefill tokens local indices; lens = n (0 for padding tokens)."""
    kmax = c128_max_entries(max_model_len, ratio)
    p = positions.long()
    n = ((p + 1) // ratio).clamp(max=kmax)
    ar = torch.arange(kmax, device=p.device)
    ok = ar.unsqueeze(0) < n.unsqueeze(1)
    loc = ar.unsqueeze(0).expand(p.shape[0], kmax)
    g = _slots(block_table, token_to_req.unsqueeze(1).expand_as(loc), torch.where(ok, loc, torch.zeros_like(loc)),
               block_size)
    idx = torch.where(is_decode_token.unsqueeze(1), g, loc)
    idx = torch.where(ok, idx, torch.full_like(idx, -1)).to(torch.int32)
    lens = torch.where(slot_mapping[:p.shape[0]] >= 0, n, torch.zeros_like(n)).to(torch.int32)
    return idx, lens


def prefill_gather_lens(query_lens: torch.Tensor, seq_lens: torch.Tensor, window: int) -> torch.Tensor:
    """Raw tokens each prefill request gathers: query_len + min(prefix_len, W - 1)."""
    prefix = seq_lens - query_lens
    return query_lens + torch.clamp(prefix, max=window - 1)


def combine_topk_swa_indices(topk_local, topk_lens, positions, req_in_chunk, gather_start, num_compressed_rows: int,
                             rows_per_req: int, window: int):
    """Prefill indices into the per-chunk bf16 workspace (request b owns rows [b*M, (b+1)*M)):
    [topk_local + M*b (first topk_len) | N + (pos - swa_len + 1 - gather_start) + i + M*b (swa_len)],
    padded with -1 to a multiple of 128. Returns (indices int32 [T, width], lens = topk_len + swa_len)."""
    T, k = topk_local.shape
    p = positions.long()
    b = req_in_chunk.long()
    base = b * rows_per_req
    tl_ = topk_lens.long()
    ar_k = torch.arange(k, device=p.device)
    comp = torch.where(ar_k.unsqueeze(0) < tl_.unsqueeze(1), topk_local.long() + base.unsqueeze(1),
                       torch.full_like(topk_local, -1, dtype=torch.long))
    swa_len = torch.clamp(p + 1, max=window)
    first = p - swa_len + 1 - gather_start.long()[b]
    ar_w = torch.arange(window, device=p.device)
    swa = torch.where(ar_w.unsqueeze(0) < swa_len.unsqueeze(1),
                      base.unsqueeze(1) + num_compressed_rows + first.unsqueeze(1) + ar_w, torch.full((T, window), -1,
                                                                                            device=p.device))
    width = int(math.ceil((k + window) / 128) * 128)
    # valid compressed entries first, the window right after them, then -1: a kernel stops at lens
    out = torch.full((T, width + 1), -1, dtype=torch.long, device=p.device)   # last column: discard
    col = torch.where(ar_w.unsqueeze(0) < swa_len.unsqueeze(1), tl_.unsqueeze(1) + ar_w, torch.full_like(swa, width))
    out[:, :k] = comp
    out.scatter_(1, col, swa)
    return out[:, :width].to(torch.int32), (tl_ + swa_len).to(torch.int32)
