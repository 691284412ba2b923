"""vLLM's ``get_compressed_slot_mapping``: the compressed-cache slot each token of the step writes.

Math (dsv4_rocm/reference/metadata.py): token t of request b sits at position
p = seq_lens[b] - query_len[b] + (t - query_start_loc[b]); it writes compressed entry j = p // r iff
(p + 1) % r == 0 (and, with vLLM 0.33's slot_mapping, iff slot_mapping[t] is not its padding mark -1), at slot
``block_table[b, j // (bs*W)] * bs + local offset`` (W context-parallel ranks over entries, entries of
other ranks -> -1), or, with CP over positions (vLLM 0.33's dcp), of the rank-local position's entry;
every other token -> -1.

Layout: one program per BLOCK_T consecutive entries of ``out`` (int64 [out_len]); entries past
num_tokens are -1, so the whole buffer is reset in this one launch as vLLM's ``fill_(-1)`` does. A
token's request is the count of request ends <= t (query_start_loc[1..R], read BLOCK_R at a time),
then checked against its own [start, end): every program writes only its own entries, so a
non-monotone query_start_loc cannot make two programs race. Reads of block_table are masked to
valid (request, column) pairs; a negative page is -1.
"""
import torch
import triton
import triton.language as tl

from .._launch import cdiv, launch
from ._token_position import paged_slot, request_index, token_position

BLOCK_T = 128
BLOCK_R = 32


@triton.jit
def _compressed_slot_mapping_kernel(out_ptr, out_len, num_tokens, slot_ptr, n_slots, qsl_ptr, seq_lens_ptr, bt_ptr,
                                    bt_row, bt_cols, num_reqs, block_size, ratio, cp_world, cp_rank, cp_interleave,
                                    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, HAS_SLOTS: tl.constexpr,
                                    CP_OVER_POSITIONS: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    req = request_index(qsl_ptr, num_reqs, t, BLOCK_R)
    ok = (t < num_tokens) & (req < num_reqs)
    r = tl.where(ok, req, 0)
    pos, ok = token_position(qsl_ptr, seq_lens_ptr, r, t, ok, 0)
    if HAS_SLOTS:                                   # vLLM 0.33: a token without a slot of its own writes nothing
        own = tl.load(slot_ptr + t, mask=ok & (t < n_slots), other=-1).to(tl.int64)
        ok = ok & (own != -1)
    pos = tl.where(ok, pos, 0)
    ok = ok & ((pos + 1) % ratio == 0)
    if CP_OVER_POSITIONS:
        j = ((pos // (cp_interleave * cp_world)) * cp_interleave + pos % cp_interleave) // ratio
        col = j // block_size
        off = j - col * block_size
    else:
        j = pos // ratio
        vbs = block_size * cp_world
        col = j // vbs
        voff = j - col * vbs
        ok = ok & ((voff // cp_interleave) % cp_world == cp_rank)
        off = (voff // (cp_world * cp_interleave)) * cp_interleave + voff % cp_interleave
    ok = ok & (col < bt_cols)
    slot = paged_slot(bt_ptr, r.to(tl.int64) * bt_row, col, off, ok, block_size, False)
    tl.store(out_ptr + t, slot, mask=t < out_len)


def get_compressed_slot_mapping(num_tokens: int, query_start_loc, seq_lens, block_table, block_size: int,
                                compress_ratio: int, out=None, cp_world_size: int = 1, cp_rank: int = 0,
                                cp_kv_cache_interleave_size: int = 1, *, slot_mapping=None,
                                cp_over_positions: bool = False) -> torch.Tensor:
    """Launcher (arguments checked by dsv4_rocm.ops.get_compressed_slot_mapping)."""
    if out is None:
        out = torch.empty(num_tokens, dtype=torch.int64, device=query_start_loc.device)
    n = out.shape[0]
    has_slots = slot_mapping is not None
    if n:
        launch(_compressed_slot_mapping_kernel)[(cdiv(n, BLOCK_T),)](
            out, n, num_tokens, slot_mapping if has_slots else out, slot_mapping.shape[0] if has_slots else 0,
            query_start_loc, seq_lens, block_table, block_table.stride(0), block_table.shape[1], block_table.shape[0],
            block_size, compress_ratio, cp_world_size, cp_rank, cp_kv_cache_interleave_size,
            BLOCK_T=BLOCK_T, BLOCK_R=BLOCK_R, HAS_SLOTS=has_slots, CP_OVER_POSITIONS=bool(cp_over_positions),
            num_warps=4)
    return out[:num_tokens]


COMPILE_SPECS = [
    dict(name=f"get_compressed_slot_mapping[{'slot_mapping, dcp over positions' if new else 'cp over entries'}]",
         fn=_compressed_slot_mapping_kernel,
         pointers=dict(out_ptr="*i64", slot_ptr="*i64", qsl_ptr="*i32", seq_lens_ptr="*i32", bt_ptr="*i32"),
         floats=(), constexprs=lambda arch, new=new: dict(BLOCK_T=BLOCK_T, BLOCK_R=BLOCK_R, HAS_SLOTS=new,
                                                            CP_OVER_POSITIONS=new),
         options=lambda arch: dict(num_warps=4, num_stages=1), matrix=False)
    for new in (False, True)
]
