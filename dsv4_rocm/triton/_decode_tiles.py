"""What the sparse MLA decode kernels (sparse_mla_decode.py, sparse_mla_decode_ws.py) share: the device
function saying which query, heads and key tiles a program handles, their pointer arguments' types, and
the PTX of the integer e4m3 -> bf16 decode."""
import triton
import triton.language as tl


def e4m3_to_scaled_bf16_ptx(out0: str, out1: str) -> str:
    """PTX turning four OCP e4m3 bytes (the 32-bit operand $2) into four bf16 values times 2^-120, two a
    register (``out0``: bytes 0 and 1, ``out1``: bytes 2 and 3), with integer ops only; needs the scratch
    registers ``.reg .b32 t0, t1``.

    bf16 and e4m3 differ only in exponent bias (127 vs 7) and field widths: sign-extend each byte to 16
    bits (``prmt`` with the sign-replicate selector), shift left by 4 and keep the sign and the 7 low
    bits, and the bf16 with those bits is exactly the e4m3 value times 2^-120, subnormals included (the
    byte 0x7F, e4m3 NaN, reads as 480: the cache never holds it except in a block whose scale byte is
    0xFF, which turns the scaled product NaN). 2 prmt, 2 shifts, 2 ands for four values, against
    e4m3 -> f16 -> f32 -> bf16 conversions on the slower conversion pipe."""
    return ("prmt.b32 t0, $2, 0, 0x9180;\n"
            "prmt.b32 t1, $2, 0, 0xB3A2;\n"
            "shl.b32 t0, t0, 4;\n"
            "shl.b32 t1, t1, 4;\n"
            f"and.b32 {out0}, t0, 0x87F087F0;\n"
            f"and.b32 {out1}, t1, 0x87F087F0;\n")

# the pointer arguments of both decode kernels, as the CPU compile matrix types them
DECODE_POINTERS = dict(q_ptr="*bf16", main_ptr="*u8", main_idx_ptr="*i32", main_len_ptr="*i32", extra_ptr="*u8",
                       extra_idx_ptr="*i32", extra_len_ptr="*i32", sink_ptr="*fp32", out_ptr="*bf16",
                       lse_ptr="*fp32", part_o_ptr="*fp32", part_lse_ptr="*fp32")


@triton.jit
def program_tiles(main_len_ptr, main_len_sb, main_len_ss, main_topk, extra_len_ptr, extra_len_sb, extra_len_ss,
                  extra_topk, s_q, num_splits, HEADS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                  HAS_EXTRA: tl.constexpr, HAS_MAIN_LEN: tl.constexpr, HAS_EXTRA_LEN: tl.constexpr,
                  SPLIT: tl.constexpr, XCDS: tl.constexpr = 0):
    """(t64, bi, si, hb, sp, n_main, n_extra, tiles_main, lo, hi) of this program. Axis 0 = token * head
    blocks + head block (the head blocks of one token run side by side and share its keys through L2),
    axis 1 = split; token t is query si of batch row bi. n_main / n_extra: the valid prefix of each index
    set (its length clamped to [0, topk]); key tiles [0, tiles_main) are the main set's, the extra set's
    follow (each set's last tile padded); this split handles tiles [lo, hi).

    XCDS > 0 (AMD: the GPU dispatches consecutive workgroups round-robin to that many XCDs, each with its
    own L2) with two head blocks: programs p and p + XCDS of each group of 2 XCDS are the two head blocks
    of one token, so both run on one XCD and the second's gathers hit the L2 the first filled; programs
    past the last whole group keep the plain order."""
    HB: tl.constexpr = HEADS // BLOCK_H
    pid = tl.program_id(0)
    t = pid // HB
    hb = pid % HB
    if XCDS > 0 and HB == 2:
        full = (tl.num_programs(0) // (2 * XCDS)) * (2 * XCDS)
        r = pid % (2 * XCDS)
        t = tl.where(pid < full, (pid // (2 * XCDS)) * XCDS + r % XCDS, t)
        hb = tl.where(pid < full, r // XCDS, hb)
    sp = tl.program_id(1)
    t64 = t.to(tl.int64)
    bi = t64 // s_q
    si = t64 - bi * s_q
    n_main = main_topk
    if HAS_MAIN_LEN:
        n_main = tl.minimum(tl.load(main_len_ptr + bi * main_len_sb + si * main_len_ss), main_topk)
    n_main = tl.maximum(n_main, 0)
    n_extra = 0
    if HAS_EXTRA:
        n_extra = extra_topk
        if HAS_EXTRA_LEN:
            n_extra = tl.minimum(tl.load(extra_len_ptr + bi * extra_len_sb + si * extra_len_ss), extra_topk)
        n_extra = tl.maximum(n_extra, 0)
    tiles_main = tl.cdiv(n_main, BLOCK_N)
    tiles_all = tiles_main + tl.cdiv(n_extra, BLOCK_N)
    if SPLIT:
        per = tl.cdiv(tiles_all, num_splits)
        lo = sp * per
        hi = tl.minimum(lo + per, tiles_all)
    else:
        lo = 0
        hi = tiles_all
    return t64, bi, si, hb, sp, n_main, n_extra, tiles_main, lo, hi
