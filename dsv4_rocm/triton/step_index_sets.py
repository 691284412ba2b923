"""The per-token index sets every layer of a step shares (``dsv4_rocm.step.StepMetadata.build``), in one
launch: a GPU step builds them without the twenty-odd small torch ops of ``step.index_sets_torch`` (the
oracle, and the CPU path).

Per token t of T (request r = the number of query_start_loc[1:] entries <= t, positions p, SWA slots s):

    token_to_req[t]       r
    is_valid_token[t]     s[t] >= 0
    state_slots[R][t]     state_block_table[r, p // sbs] * sbs + p % sbs, or -1 for an invalid token
                          (sbs = 4 for ratio 4, 8 for ratio 128)
    compressed_slots[R]   written in place: -1 for an invalid token (get_compressed_slot_mapping's slots)
    indexer_lens[t]       (p + 1) // 4 (floor), 0 for an invalid token

A valid token whose state block lies outside the table (malformed input, which the torch path does not
accept either) gets -1, never another request's row.
"""
import torch
import triton
import triton.language as tl

from ._launch import cdiv, launch

BLOCK_T = 128
BLOCK_R = 32
INT32_MAX = tl.constexpr(2 ** 31 - 1)


@triton.jit
def _floordiv(a, b):
    """Python's a // b for int64 a and a positive constant b (Triton's // truncates)."""
    q = a // b
    return q - ((q * b != a) & (a < 0)).to(q.dtype)


@triton.jit
def _state_slot(sbt_ptr, sbt_row, sbt_cols, req, pos, valid, ss_ptr, t, inb, SBS: tl.constexpr):
    col = _floordiv(pos, SBS)
    ok = valid & (col >= 0) & (col < sbt_cols)
    blk = tl.load(sbt_ptr + req.to(tl.int64) * sbt_row + col, mask=ok & inb, other=0).to(tl.int64)
    tl.store(ss_ptr + t, tl.where(ok, blk * SBS + (pos - col * SBS), -1), mask=inb)


@triton.jit
def _step_index_sets_kernel(qsl_ptr, num_reqs, num_tokens, pos_ptr, slot_ptr, t2r_ptr, valid_ptr, sbt_ptr, sbt_row,
                            sbt_cols, cs4_ptr, ss4_ptr, cs128_ptr, ss128_ptr, ilen_ptr,
                            C4: tl.constexpr, C128: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    inb = t < num_tokens
    req = tl.zeros([BLOCK_T], dtype=tl.int32)
    for r0 in range(0, num_reqs, BLOCK_R):
        r = r0 + 1 + tl.arange(0, BLOCK_R)
        ends = tl.load(qsl_ptr + r, mask=r <= num_reqs, other=INT32_MAX).to(tl.int64)
        req += tl.sum((ends[None, :] <= t[:, None]).to(tl.int32), axis=1)
    valid = tl.load(slot_ptr + t, mask=inb, other=-1) >= 0
    pos = tl.load(pos_ptr + t, mask=inb, other=0).to(tl.int64)
    tl.store(t2r_ptr + t, req, mask=inb)
    tl.store(valid_ptr + t, valid, mask=inb)
    if C4:
        _state_slot(sbt_ptr, sbt_row, sbt_cols, req, pos, valid, ss4_ptr, t, inb, 4)
        cs = tl.load(cs4_ptr + t, mask=inb, other=-1)
        tl.store(cs4_ptr + t, tl.where(valid, cs, -1), mask=inb)
        tl.store(ilen_ptr + t, tl.where(valid, _floordiv(pos + 1, 4), 0).to(tl.int32), mask=inb)
    if C128:
        _state_slot(sbt_ptr, sbt_row, sbt_cols, req, pos, valid, ss128_ptr, t, inb, 8)
        cs = tl.load(cs128_ptr + t, mask=inb, other=-1)
        tl.store(cs128_ptr + t, tl.where(valid, cs, -1), mask=inb)


def step_index_sets(query_start_loc, positions, slot_mapping, state_block_table, compressed_slots: dict):
    """(token_to_req int32 [T], is_valid_token bool [T], state_slots {ratio: int64 [T]}, indexer_lens int32 [T]
    or None) of a step, masking ``compressed_slots`` (ratio -> int64 [T], from get_compressed_slot_mapping) in
    place. Ratios: those of ``compressed_slots`` (4 and / or 128)."""
    T = positions.shape[0]
    dev = positions.device
    t2r = torch.empty(T, dtype=torch.int32, device=dev)
    valid = torch.empty(T, dtype=torch.bool, device=dev)
    c4, c128 = 4 in compressed_slots, 128 in compressed_slots
    ss = {r: torch.empty(T, dtype=torch.int64, device=dev) for r in compressed_slots}
    ilen = torch.empty(T, dtype=torch.int32, device=dev) if c4 else None
    if T:
        any_slots = slot_mapping           # an int64 placeholder for absent ratios (never touched)
        launch(_step_index_sets_kernel)[(cdiv(T, BLOCK_T),)](
            query_start_loc, query_start_loc.shape[0] - 1, T, positions, slot_mapping, t2r, valid, state_block_table,
            state_block_table.stride(0), state_block_table.shape[1], compressed_slots.get(4, any_slots),
            ss.get(4, any_slots), compressed_slots.get(128, any_slots), ss.get(128, any_slots),
            ilen if c4 else t2r, C4=c4, C128=c128, BLOCK_T=BLOCK_T, BLOCK_R=BLOCK_R, num_warps=4)
    return t2r, valid, ss, ilen


COMPILE_SPECS = [
    dict(name="step_index_sets", fn=_step_index_sets_kernel,
         pointers=dict(qsl_ptr="*i32", pos_ptr="*i64", slot_ptr="*i64", t2r_ptr="*i32", valid_ptr="*i1",
                       sbt_ptr="*i32", cs4_ptr="*i64", ss4_ptr="*i64", cs128_ptr="*i64", ss128_ptr="*i64",
                       ilen_ptr="*i32"),
         floats=(), constexprs=lambda arch: dict(C4=True, C128=True, BLOCK_T=BLOCK_T, BLOCK_R=BLOCK_R),
         options=lambda arch: dict(num_warps=4, num_stages=1), matrix=False),
]
