"""The per-step index sets of DeepSeek-V4.1's compressed layers (docs/math.md#v41-step), the oracle of
``dsv4_rocm/triton/metadata/step_index_sets_v41.py``.

For each token t of request b = token_to_req[t] at position p = positions[t], valid when
is_valid_token[t] (its slot is >= 0), b is a request of the step and p >= 0, and for each V4.1 ratio r:

    lens[r][t]   (p + 1) // r compressed entries the token sees; 0 for an invalid token
    slots[r][t]  the compressed-cache slot of entry p // r when (p + 1) % r == 0 (the token closes it):
                 block_table[b, (p // r) // bs] * bs + (p // r) % bs, bs entries a page; -1 otherwise,
                 or where the column or page is missing. The indexer-K cache shares the slots.
    ring[t]      (r = 2) the token's row in its request's compressor ring: state_block_table[b, 0] *
                 capacity + p % capacity; -1 for an invalid token or a negative ring block.
"""
import torch

from .metadata import _page, _slots


def step_index_sets_v41(positions, token_to_req, is_valid_token, compressed_block_table, state_block_table,
                        block_size: int, ring_capacity: int, r1=None, r2=None) -> None:
    """Fill r1 = (slots int64 [T], lens int32 [T]) and r2 = (slots, lens, ring int64 [T]) where given."""
    req = token_to_req.long()
    p = positions.long()
    valid = is_valid_token & (req >= 0) & (req < compressed_block_table.shape[0]) & (p >= 0)
    for ratio, out in ((1, r1), (2, r2)):
        if out is None:
            continue
        closes = valid & ((p + 1) % ratio == 0)
        j = torch.where(closes, p // ratio, torch.full_like(p, -1))
        out[0].copy_(_slots(compressed_block_table, req, j, block_size))
        out[1].copy_(torch.where(valid, (p + 1) // ratio, torch.zeros_like(p)).to(out[1].dtype))
        if ratio == 2:
            page, ok = _page(state_block_table, req, torch.zeros_like(req))
            ring = torch.where(valid & ok, page * ring_capacity + p.clamp(min=0) % ring_capacity,
                               torch.full_like(p, -1))
            out[2].copy_(ring)


v41_step_index_sets = step_index_sets_v41     # the op's former name (dsv4_rocm.ops.metadata_v41)
