"""A DeepSeek-V4.1 index source after the candidate source scores only inside its candidate blocks: the
logits of every other visible entry become -inf, in place.

Math (dsv4_rocm/reference/indexer_v41.py): row r sees n = clamp(lens[r], 0, ncols) entries; entry c < n
is kept when its block c // BS is among candidate_blocks[r] (ascending block ids, then -1), else it is
set to -inf; entries at or past n are not touched.

Grid (rows, column tiles of TB blocks x BS entries). A program finds each of its blocks in the row's list
by a binary search (ceil(log2 C) steps over the ascending list, -1 read as past every block), then
stores -inf over the entries of the blocks it did not find; the logits themselves are never read. A tile
past the row's entries returns at once.
"""
import triton
import triton.language as tl

from .._launch import cdiv, launch, next_power_of_2

TB = 128


@triton.jit(do_not_specialize=["ncols"])
def _mask_candidate_logits_kernel(x_ptr, x_s0, ncols, lens_ptr, cand_ptr, cand_s0, C: tl.constexpr,
                                  CP: tl.constexpr, LOG: tl.constexpr, BS: tl.constexpr, TB: tl.constexpr):
    r = tl.program_id(0)
    b0 = tl.program_id(1) * TB
    n = tl.minimum(tl.maximum(tl.load(lens_ptr + r).to(tl.int32), 0), ncols)
    if b0 * BS < n:
        blk = b0 + tl.arange(0, TB)
        cand = cand_ptr + r.to(tl.int64) * cand_s0
        lo = tl.zeros([TB], tl.int32)                      # #(list entries < blk), over the list padded to CP
        for i in tl.static_range(LOG):
            probe = lo + (CP >> (i + 1))
            v = tl.load(cand + probe - 1, mask=probe - 1 < C, other=-1)
            v = tl.where(v < 0, 2147483647, v)
            lo = tl.where(v < blk, probe, lo)
        hit = tl.load(cand + lo, mask=lo < C, other=-1) == blk
        col = blk[:, None] * BS + tl.arange(0, BS)[None, :]
        drop = (col < n) & ~hit[:, None]
        tl.store(x_ptr + r.to(tl.int64) * x_s0 + col, tl.full([TB, BS], float("-inf"), tl.float32), mask=drop)


def mask_candidate_logits(logits, lens, candidate_blocks, block_size: int) -> None:
    """Launcher (arguments checked by dsv4_rocm.ops.mask_candidate_logits)."""
    rows, C = candidate_blocks.shape
    tiles = cdiv(cdiv(logits.shape[1], block_size), TB)
    if tiles == 0:
        return
    cp = next_power_of_2(C)
    launch(_mask_candidate_logits_kernel)[(rows, tiles)](
        logits, logits.stride(0), logits.shape[1], lens, candidate_blocks, candidate_blocks.stride(0), C=C, CP=cp,
        LOG=cp.bit_length() - 1, BS=block_size, TB=TB, num_warps=4, num_stages=1)


COMPILE_SPECS = [
    dict(name="mask_candidate_logits", fn=_mask_candidate_logits_kernel,
         pointers=dict(x_ptr="*fp32", lens_ptr="*i32", cand_ptr="*i32"), floats=(),
         constexprs=lambda arch: dict(C=2048, CP=2048, LOG=11, BS=8, TB=TB),
         options=lambda arch: dict(num_warps=4, num_stages=1), matrix=False),
]
