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


def e2m1_to_scaled_bf16_ptx(out0: str, out1: str, src: str) -> str:
    """PTX turning four e2m1 codes, one a byte (the 32-bit operand ``src``, each byte 0-15: sign bit 3, then
    two exponent bits and one mantissa bit), into four bf16 values times 2^-112, two a register (``out0``:
    bytes 0 and 1, ``out1``: bytes 2 and 3), with integer ops only; needs ``.reg .b32 t0, t1``.

    A code's magnitude (0, 0.5, 1, 1.5, 2, 3, 4, 6) has an f16 whose low byte is zero and whose high byte
    comes from an 8-entry table (0x00, 0x38, 0x3C, 0x3E, 0x40, 0x42, 0x44, 0x46): one ``prmt`` with two
    codes' three magnitude bits as the selectors of bytes 1 and 3 (selector 0 reads the table's 0x00 into
    bytes 0 and 2) builds two f16. An f16 bit pattern shifted right by 3 is the bf16 of the same value
    times 2^-112 (exponent bias 15 vs 127, mantissa width 10 vs 7, the 3 bits lost are zero); the shift
    moves no set bit across the halves because the high half's low byte is zero. Each code's sign goes to
    bit 15 / 31; -0 stays -0. 10 integer ops for two values."""
    # per register: how its two codes' magnitudes reach selector bits 4-6 / 12-14 (codes 0, 1 at bits 0-2 /
    # 8-10; codes 2, 3 at 16-18 / 24-26), and their signs (bits 3, 11 / 19, 27) bits 15 and 31
    halves = ((out0, "shl.b32 t0, {x}, 4", "shl.b32 t1, {x}, 12", "shl.b32 t1, {x}, 20"),
              (out1, "shr.b32 t0, {x}, 12", "shr.b32 t1, {x}, 4", "shl.b32 t1, {x}, 4"))
    ptx = ""
    for out, sel, sign0, sign1 in halves:
        ptx += (f"{sel};\nand.b32 t0, t0, 0x7070;\nprmt.b32 t0, 0x3E3C3800, 0x46444240, t0;\nshr.b32 t0, t0, 3;\n"
                f"{sign0};\nand.b32 t1, t1, 0x8000;\nor.b32 t0, t0, t1;\n"
                f"{sign1};\nand.b32 t1, t1, 0x80000000;\nor.b32 {out}, t0, t1;\n").replace("{x}", src)
    return ptx


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
