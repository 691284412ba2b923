"""The candidate blocks a DeepSeek-V4.1 candidate source publishes: per row of indexer logits, the C blocks
of BS entries that later index sources score inside.

Math (dsv4_rocm/reference/indexer_v41.py): row r sees n = clamp(lens[r], 0, ncols) entries, nb =
ceil(n / BS) blocks. With nb <= C the row is [0, 1, ..., nb - 1, -1, ...]. Otherwise it is the newest
block nb - 1 and the C - 1 blocks of [0, nb - 1) with the largest block keys (the maximum of the order
keys of dsv4_rocm/triton/indexer/top_k_per_row.py over the block's entries: NaN above +inf), ties to the lower
block id, written in ascending block order, the newest last.

One program a row. A row with more than C blocks takes a radix select over its block keys, streamed in
tiles of TB blocks (each tile loads [TB, BS] logits and takes the maximum key of each block): 8-bit
digits, one ``tl.histogram`` a tile and round, starting at the top bit and stopping once the bin holding
the (C - 1)-th largest key is taken whole; at most 4 rounds, each a pass over the row. The result
(T, above): the keys > T are taken, and the first C - 1 - above keys == T in block order. A last pass
writes the taken blocks in block order (a running count per tile), then the newest block.
"""
import torch
import triton
import triton.language as tl

from .._compat import by_triton
from .._launch import launch

# NVIDIA, from Triton 3.8 on: without a register bound ptxas held this kernel at 48 registers and spilled 8 B on
# sm_90a; .maxnreg 128 compiles it without spills (64 registers). 3.6 needs none and keeps its code (_compat).
_NVIDIA_OPTIONS = by_triton({(3, 6): {}, (3, 8): dict(maxnreg=128)})
from .top_k_per_row import _high_mask, _order_key

TB = 128        # blocks a tile
CB = 1024       # output entries a store step of the trivial rows


@triton.jit
def _block_keys(row, ncols, n, b0, nblk, BS: tl.constexpr, TB: tl.constexpr):
    """(uint32 maximum key of blocks b0 .. b0 + TB - 1 over the row's first n entries, block < nblk)."""
    blk = b0 + tl.arange(0, TB)
    col = blk[:, None] * BS + tl.arange(0, BS)[None, :]
    inside = (col < n) & (blk < nblk)[:, None]
    x = tl.load(row + col, mask=inside & (col < ncols), other=0.0)
    return tl.max(tl.where(inside, _order_key(x), 0), axis=1), blk < nblk


@triton.jit
def _select_blocks(row, ncols, n, nblk, k, BS: tl.constexpr, TB: tl.constexpr):
    """(T, above): the k largest block keys of blocks [0, nblk) are the keys > T (above of them) and
    k - above of the keys == T."""
    bins = tl.arange(0, 256)
    prefix = tl.zeros([], tl.uint32)
    need = k + tl.zeros([], tl.int32)
    shift = 32 + tl.zeros([], tl.int32)
    cnt = nblk + tl.zeros([], tl.int32)
    while (shift > 0) & (cnt > need):
        low = shift - 8
        hist = tl.zeros([256], tl.int32)
        for b0 in range(0, nblk, TB):
            key, ok = _block_keys(row, ncols, n, b0, nblk, BS, TB)
            m = ok & ((key & _high_mask(shift)) == prefix)
            digit = ((key >> low.to(tl.uint32)) & 0xFF).to(tl.int32)
            hist += tl.histogram(255 - digit, 256, mask=m)            # bin 0 = the highest digit
        ge = tl.cumsum(hist, 0)
        best = tl.min(tl.where(ge >= need, (bins.to(tl.int64) << 32) | ge.to(tl.int64), 1 << 62), 0)
        j = (best >> 32).to(tl.int32)
        cnt = tl.sum(tl.where(bins == j, hist, 0), 0)
        need = need - ((best & 0xFFFFFFFF).to(tl.int32) - cnt)
        prefix = prefix | ((255 - j).to(tl.uint32) << low.to(tl.uint32))
        shift = low
    whole = cnt == need
    return tl.where(whole, tl.maximum(prefix, 1) - 1, prefix), tl.where(whole, k, k - need)


@triton.jit(do_not_specialize=["rows", "ncols"])
def _select_candidate_blocks_kernel(x_ptr, x_s0, ncols, lens_ptr, out_ptr, out_s0, rows, C: tl.constexpr,
                                    BS: tl.constexpr, TB: tl.constexpr, CB: tl.constexpr):
    r = tl.program_id(0)
    n = tl.minimum(tl.maximum(tl.load(lens_ptr + r).to(tl.int32), 0), ncols)
    nb = (n + BS - 1) // BS
    out_row = out_ptr + r.to(tl.int64) * out_s0
    if nb <= C:
        for i0 in range(0, C, CB):
            i = i0 + tl.arange(0, CB)
            tl.store(out_row + i, tl.where(i < nb, i, -1), mask=i < C)
    else:
        row = x_ptr + r.to(tl.int64) * x_s0
        T, above = _select_blocks(row, ncols, n, nb - 1, C - 1, BS, TB)
        done_gt = tl.zeros([], tl.int32)
        done_eq = tl.zeros([], tl.int32)
        for b0 in range(0, nb - 1, TB):
            key, ok = _block_keys(row, ncols, n, b0, nb - 1, BS, TB)
            gt = ok & (key > T)
            eq = ok & (key == T)
            eq_rank = done_eq + tl.cumsum(eq.to(tl.int32), 0) - 1
            take = gt | (eq & (eq_rank < C - 1 - above))
            pos = done_gt + done_eq + tl.cumsum(take.to(tl.int32), 0) - 1
            pos = tl.where(take, pos, 0)
            tl.store(out_row + pos, b0 + tl.arange(0, TB), mask=take)
            done_gt += tl.sum(gt.to(tl.int32), 0)
            done_eq += tl.sum((eq & (eq_rank < C - 1 - above)).to(tl.int32), 0)
        tl.store(out_row + C - 1, nb - 1)


def select_candidate_blocks(logits, lens, candidate_blocks, block_size: int) -> None:
    """Launcher (arguments checked by dsv4_rocm.ops.select_candidate_blocks)."""
    rows, C = candidate_blocks.shape
    launch(_select_candidate_blocks_kernel)[(rows,)](
        logits, logits.stride(0), logits.shape[1], lens, candidate_blocks, candidate_blocks.stride(0), rows,
        C=C, BS=block_size, TB=TB, CB=CB, num_warps=4, num_stages=1,
        **(_NVIDIA_OPTIONS if logits.is_cuda and torch.version.hip is None else {}))


COMPILE_SPECS = [
    dict(name="select_candidate_blocks", fn=_select_candidate_blocks_kernel,
         pointers=dict(x_ptr="*fp32", lens_ptr="*i32", out_ptr="*i32"), floats=(),
         constexprs=lambda arch: dict(C=2048, BS=8, TB=TB, CB=CB),
         options=lambda arch: dict(num_warps=4, num_stages=1, **({} if arch.startswith("gfx") else _NVIDIA_OPTIONS)),
         matrix=False),
]
