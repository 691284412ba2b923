"""vLLM's ``rocm_inverse_rope_rows_``: inverse GPT-J RoPE of attention output rows, in place.

Math (dsv4_rocm/reference/rope.py ``rocm_inverse_rope_rows_``, the same operations in the same order, fp
fusion off, so the bf16 results are the reference's bits): for token t, head h and pair i <
rope_dim / 2 of the last rope_dim dims of o[t, h] (e = dim D - rope_dim + 2i, o = the next),
c = cs[pos_t, i], s = cs[pos_t, rope_dim / 2 + i]: e' = e c + o s, o' = o c - e s in fp32, rounded to
bf16. A token whose position is outside the table is left as it is. Only the rope dims are read and
written.

Layout: o [T, H, D] bf16 with any token and head strides and unit last stride; cos_sin_cache [P, rope_dim]
fp32 or bf16, rows at ``cs_stride``. One program per (token, block of BH heads): a [BH, rope_dim / 2] tile
of pairs.
"""
import triton
import triton.language as tl

from .._launch import cdiv, launch, next_power_of_2


@triton.jit(do_not_specialize=["num_heads", "cs_rows"])
def _inverse_rope_rows_kernel(o_ptr, o_st, o_sh, pos_ptr, cs_ptr, cs_stride, cs_rows, num_heads,
                              ROPE_START: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                              BH: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    i = tl.arange(0, BLOCK_HALF)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    ok = (pos >= 0) & (pos < cs_rows)
    m = (h < num_heads)[:, None] & (i < HALF)[None, :] & ok
    cs_row = cs_ptr + tl.where(ok, pos, 0) * cs_stride
    c = tl.load(cs_row + i, mask=(i < HALF) & ok, other=1.0).to(tl.float32)[None, :]
    s = tl.load(cs_row + HALF + i, mask=(i < HALF) & ok, other=0.0).to(tl.float32)[None, :]
    pair = o_ptr + t * o_st + h.to(tl.int64)[:, None] * o_sh + ROPE_START + 2 * i[None, :]
    e = tl.load(pair, mask=m, other=0.0).to(tl.float32)
    od = tl.load(pair + 1, mask=m, other=0.0).to(tl.float32)
    tl.store(pair, (e * c + od * s).to(tl.bfloat16), mask=m)
    tl.store(pair + 1, (od * c - e * s).to(tl.bfloat16), mask=m)


def rocm_inverse_rope_rows_(o, positions, cos_sin_cache, rope_head_dim: int) -> None:
    """Launcher (arguments checked by dsv4_rocm.ops.rocm_inverse_rope_rows_)."""
    T, H, D = o.shape
    if T == 0 or H == 0:
        return
    half = rope_head_dim // 2
    bh = min(next_power_of_2(H), 16)
    launch(_inverse_rope_rows_kernel)[(T, cdiv(H, bh))](
        o, o.stride(0), o.stride(1), positions, cos_sin_cache, cos_sin_cache.stride(0), cos_sin_cache.shape[0], H,
        ROPE_START=D - rope_head_dim, HALF=half, BLOCK_HALF=next_power_of_2(half), BH=bh, num_warps=4,
        enable_fp_fusion=False)


COMPILE_SPECS = [
    dict(name="rocm_inverse_rope_rows", fn=_inverse_rope_rows_kernel,
         pointers=dict(o_ptr="*bf16", pos_ptr="*i64", cs_ptr="*fp32"), floats=(),
         constexprs=lambda arch: dict(ROPE_START=448, HALF=32, BLOCK_HALF=32, BH=16),
         options=lambda arch: dict(num_warps=4, num_stages=1, enable_fp_fusion=False), matrix=False,
         exact_fp32=True),
]
