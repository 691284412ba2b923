"""The per-step index sets of DeepSeek-V4.1's compressed layers, in one launch: for each token and each
ratio the model has (1, 2), the compressed-cache slot it writes, the entries it sees and (ratio 2) its
compressor ring slot.

Math (dsv4_rocm/reference/metadata_v41.py): token t of request b = token_to_req[t] at p = positions[t] is
valid when is_valid_token[t], 0 <= b < num_reqs and p >= 0. Then lens = (p + 1) // r; if (p + 1) % r == 0
the slot of entry j = p // r is block_table[b, j // BS] * BS + j % BS (-1 past the table's columns or
for a negative page); ring = state_block_table[b, 0] * CAP + p % CAP (-1 for a negative page). An
invalid token gets lens 0 and slots -1. Block-table reads are masked to valid (request, column) pairs.

Layout: one program per BLOCK_T tokens; outputs are int64 slots and int32 lens, [T] each.
"""
import triton
import triton.language as tl

from .._launch import cdiv, launch

BLOCK_T = 128


@triton.jit
def _closing_slot(bt_ptr, bt_row, bt_cols, r, p, valid, RATIO: tl.constexpr, BS: tl.constexpr):
    j = p // RATIO
    col = j // BS
    ok = valid & ((p + 1) % RATIO == 0) & (col < bt_cols)
    page = tl.load(bt_ptr + r * bt_row + tl.where(ok, col, 0), mask=ok, other=-1).to(tl.int64)
    return tl.where(ok & (page >= 0), page * BS + j % BS, -1)


@triton.jit(do_not_specialize=["num_tokens", "num_reqs"])
def _step_index_sets_v41_kernel(pos_ptr, t2r_ptr, valid_ptr, cbt_ptr, cbt_row, cbt_cols, sbt_ptr, sbt_row, sbt_cols,
                                num_reqs, num_tokens, s1_ptr, l1_ptr, s2_ptr, l2_ptr, ring_ptr, BS: tl.constexpr,
                                CAP: tl.constexpr, R1: tl.constexpr, R2: tl.constexpr, BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    inb = t < num_tokens
    p = tl.load(pos_ptr + t, mask=inb, other=-1).to(tl.int64)
    req = tl.load(t2r_ptr + t, mask=inb, other=-1)
    v = tl.load(valid_ptr + t, mask=inb, other=0).to(tl.int32)
    valid = inb & (v != 0) & (req >= 0) & (req < num_reqs) & (p >= 0)
    r = tl.where(valid, req, 0).to(tl.int64)
    p = tl.where(valid, p, 0)
    if R1:
        tl.store(s1_ptr + t, _closing_slot(cbt_ptr, cbt_row, cbt_cols, r, p, valid, 1, BS), mask=inb)
        tl.store(l1_ptr + t, tl.where(valid, p + 1, 0).to(tl.int32), mask=inb)
    if R2:
        tl.store(s2_ptr + t, _closing_slot(cbt_ptr, cbt_row, cbt_cols, r, p, valid, 2, BS), mask=inb)
        tl.store(l2_ptr + t, tl.where(valid, (p + 1) // 2, 0).to(tl.int32), mask=inb)
        okr = valid & (sbt_cols > 0)
        page = tl.load(sbt_ptr + r * sbt_row, mask=okr, other=-1).to(tl.int64)
        tl.store(ring_ptr + t, tl.where(okr & (page >= 0), page * CAP + p % CAP, -1), mask=inb)


def step_index_sets_v41(positions, token_to_req, is_valid_token, compressed_block_table, state_block_table,
                        block_size: int, ring_capacity: int, r1=None, r2=None) -> None:
    """Launcher (arguments checked by dsv4_rocm.ops.step_index_sets_v41)."""
    T = positions.shape[0]
    if T == 0 or (r1 is None and r2 is None):
        return
    s1, l1 = r1 if r1 is not None else (positions, token_to_req)
    s2, l2, ring = r2 if r2 is not None else (positions, token_to_req, positions)
    cbt, sbt = compressed_block_table, state_block_table
    launch(_step_index_sets_v41_kernel)[(cdiv(T, BLOCK_T),)](
        positions, token_to_req, is_valid_token, cbt, cbt.stride(0), cbt.shape[1], sbt, sbt.stride(0), sbt.shape[1],
        cbt.shape[0], T, s1, l1, s2, l2, ring, BS=block_size, CAP=ring_capacity, R1=r1 is not None,
        R2=r2 is not None, BLOCK_T=BLOCK_T, num_warps=4)


COMPILE_SPECS = [
    dict(name="step_index_sets_v41", fn=_step_index_sets_v41_kernel,
         pointers=dict(pos_ptr="*i64", t2r_ptr="*i32", valid_ptr="*i1", cbt_ptr="*i32", sbt_ptr="*i32",
                       s1_ptr="*i64", l1_ptr="*i32", s2_ptr="*i64", l2_ptr="*i32", ring_ptr="*i64"),
         floats=(), constexprs=lambda arch: dict(BS=64, CAP=8, R1=True, R2=True, BLOCK_T=BLOCK_T),
         options=lambda arch: dict(num_warps=4, num_stages=1), matrix=False),
]
