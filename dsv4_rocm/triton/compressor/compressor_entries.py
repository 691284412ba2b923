"""The tokens of a step that produce a compressed entry, listed so that the compress kernel launches one
program per entry instead of one per token (a C128 prefill chunk of 8192 tokens has 64 entries).

A token t < num_actual produces an entry when its state slot >= 0, 0 <= pos < cos_sin rows,
(pos + 1) % r == 0, 0 <= request < num_reqs and 0 <= cache slot < capacity: the conditions the compress
kernel checks again. Programs of BLOCK tokens count their entries, reserve room with one atomic add on
``count`` and write the token indices at ``list[base + rank]``. The order of the list depends on the
order the programs run in; nothing computed from it does (every entry is independent). Indices past
``cap`` (only possible for a batch whose requests do not have consecutive positions) are dropped.
"""
import torch
import triton
import triton.language as tl

from .._launch import cdiv, launch

BLOCK = 1024


@triton.jit
def _compressor_entries_kernel(pos_ptr, sslot_ptr, kslot_ptr, t2r_ptr, num_actual, cs_rows, num_reqs, num_cache_slots,
                               list_ptr, count_ptr, cap, RATIO: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inb = t < num_actual
    pos = tl.load(pos_ptr + t, mask=inb, other=-1).to(tl.int64)
    ok = inb & (tl.load(sslot_ptr + t, mask=inb, other=-1) >= 0) & (pos >= 0) & (pos < cs_rows)
    ok = ok & ((pos + 1) % RATIO == 0)
    req = tl.load(t2r_ptr + t, mask=ok, other=-1).to(tl.int64)
    kslot = tl.load(kslot_ptr + t, mask=ok, other=-1).to(tl.int64)
    ok = ok & (req >= 0) & (req < num_reqs) & (kslot >= 0) & (kslot < num_cache_slots)
    k = ok.to(tl.int32)
    base = tl.atomic_add(count_ptr, tl.sum(k, axis=0))
    idx = base + tl.cumsum(k, axis=0) - k
    tl.store(list_ptr + idx, t.to(tl.int32), mask=ok & (idx < cap))


def compressor_entries(positions, slot_mapping, kv_slot_mapping, token_to_req_indices, num_actual: int, ratio: int,
                       cos_sin_rows: int, num_reqs: int, num_cache_slots: int, cap: int):
    """(token indices int32 [cap], their count int32 [1]) of the entries of the first num_actual tokens."""
    dev = positions.device
    entries = torch.empty(cap, dtype=torch.int32, device=dev)
    count = torch.zeros(1, dtype=torch.int32, device=dev)
    launch(_compressor_entries_kernel)[(cdiv(num_actual, BLOCK),)](
        positions, slot_mapping, kv_slot_mapping, token_to_req_indices, num_actual, cos_sin_rows, num_reqs,
        num_cache_slots, entries, count, cap, RATIO=ratio, BLOCK=BLOCK, num_warps=4)
    return entries, count


COMPILE_SPECS = [
    dict(name=f"compressor_entries[C{r}]", fn=_compressor_entries_kernel,
         pointers=dict(pos_ptr="*i64", sslot_ptr="*i64", kslot_ptr="*i64", t2r_ptr="*i32", list_ptr="*i32",
                       count_ptr="*i32"),
         floats=(), constexprs=lambda arch, r=r: dict(RATIO=r, BLOCK=BLOCK),
         options=lambda arch: dict(num_warps=4, num_stages=1), matrix=False)
    for r in (4, 128)
]
