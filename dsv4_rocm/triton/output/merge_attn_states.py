"""vLLM's ``merge_attn_states``: merge two partial attentions over disjoint key sets, in place.

Math (``dsv4_rocm.reference.output.merge_attn_states``, docs/math.md#merge-attn-states): for token t and
head h, with p / s the prefix / suffix lse (natural log) and +inf read as -inf (an empty part),
m = max(p, s), a = exp(p - m), b = exp(s - m):

    output[t, h] = prefix_output[t, h] * (a / (a + b)) + suffix_output[t, h] * (b / (a + b))
    output_lse[h, t] = m + ln(a + b)

in fp32, rounded once to output's dtype. Both parts empty: 0 and -inf. Tokens t >= n_ctx
(``prefill_tokens_with_context``) take the suffix's row and lse. With an fp8 output the value is
multiplied by 1 / scale (scale read on the device) and written as an e4m3 byte, round to nearest even:
for a float8_e4m3fn output the OCP byte, saturating at +-448, -0 as 0x00, NaN 0x7F (gfx942 encodes x / 2
with its fnuz convert: the same byte); for a float8_e4m3fnuz output (vLLM's fp8 dtype on gfx942) the fnuz byte of
the value clamped to vLLM's +-224, every zero 0x00, NaN 0x80 (gfx942 converts it with its fnuz unit, the
OCP targets encode 2x as OCP: the same byte but for -0 and NaN, mapped).

Layout: output / prefix / suffix [T, H, D] with any token and head strides and unit last stride; the
lse tensors [H, T] with any strides (vLLM's backends hand over transposed [T, H] views). One program per
(token, block of BLOCK_H heads): a [BLOCK_H, BLOCK_D] tile of each input, D padded to a power of two.
``n_ctx`` is a run-time argument, not specialized on: a new batch compiles nothing.
"""
import torch
import triton
import triton.language as tl

from .._fp8 import encode
from .._launch import cdiv, device_facts, launch, next_power_of_2
from .._records import _e4m3

FNUZ_MAX = tl.constexpr(224.0)       # vLLM's largest fnuz e4m3 value for quantized outputs (not 240)


@triton.jit
def _e4m3fnuz(v, FNUZ: tl.constexpr):
    """e4m3fnuz bytes (int32) of fp32 v clamped to +-224, round to nearest even; zeros 0x00, NaN 0x80. FNUZ:
    the target's fp8 unit is fnuz (gfx942); else 2v is encoded as OCP e4m3fn (a fnuz byte's value is half
    the OCP value of that byte), its -0 (0x80) written 0x00 and a NaN v written 0x80. The byte fix-ups run
    on int32, not on the 8-bit converts: Triton 3.6 lowers selects over a masked 8-bit tensor in packed
    16-bit lanes, and on sm_90 with a strided output that wrote wrong bytes."""
    v = tl.where(v > FNUZ_MAX, FNUZ_MAX, tl.where(v < -FNUZ_MAX, -FNUZ_MAX, v))
    if FNUZ:
        b = encode(v, True).to(tl.int32)
    else:
        b = encode(v * 2.0, False).to(tl.int32)
        b = tl.where(v != v, 0x80, tl.where(b == 0x80, 0, b))
    return b


@triton.jit(do_not_specialize=["n_ctx", "num_heads"])
def _merge_attn_states_kernel(out_ptr, out_st, out_sh, olse_ptr, olse_sh, olse_st,
                              p_ptr, p_st, p_sh, plse_ptr, plse_sh, plse_st,
                              s_ptr, s_st, s_sh, slse_ptr, slse_sh, slse_st,
                              scale_ptr, n_ctx, num_heads, HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
                              BLOCK_H: tl.constexpr, OUTPUT_LSE: tl.constexpr, FP8_OUT: tl.constexpr,
                              OUT_FNUZ: tl.constexpr, FNUZ: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = h < num_heads
    h64 = h.to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    m2 = hm[:, None] & (d < HEAD_SIZE)[None, :]
    s_lse = tl.load(slse_ptr + h64 * slse_sh + t * slse_st, mask=hm, other=0.0)
    s_lse = tl.where(s_lse == float("inf"), float("-inf"), s_lse)
    s_out = tl.load(s_ptr + t * s_st + h64[:, None] * s_sh + d[None, :], mask=m2, other=0.0).to(tl.float32)
    if t < n_ctx:
        p_lse = tl.load(plse_ptr + h64 * plse_sh + t * plse_st, mask=hm, other=0.0)
        p_lse = tl.where(p_lse == float("inf"), float("-inf"), p_lse)
        p_out = tl.load(p_ptr + t * p_st + h64[:, None] * p_sh + d[None, :], mask=m2, other=0.0).to(tl.float32)
        m = tl.maximum(p_lse, s_lse)
        empty = m == float("-inf")
        ms = tl.where(empty, 0.0, m)
        a = tl.exp(p_lse - ms)
        b = tl.exp(s_lse - ms)
        tot = tl.where(empty, 1.0, a + b)
        val = p_out * (a / tot)[:, None] + s_out * (b / tot)[:, None]
        val = tl.where(empty[:, None], 0.0, val)
        lse = tl.where(empty, float("-inf"), tl.log(tot) + ms)
    else:
        val = s_out
        lse = s_lse
    if OUTPUT_LSE:
        tl.store(olse_ptr + h64 * olse_sh + t * olse_st, lse, mask=hm)
    dst = out_ptr + t * out_st + h64[:, None] * out_sh + d[None, :]
    if FP8_OUT:                                                           # out_ptr: the output's bytes
        x = val * (1.0 / tl.load(scale_ptr))
        if OUT_FNUZ:
            b = _e4m3fnuz(x, FNUZ)
        else:
            b = tl.where(x != x, 0x7F, _e4m3(x, FNUZ))       # gfx942's route maps its NaN 0x80 to 0x00
        tl.store(dst, b.to(tl.uint8), mask=m2)
    else:
        tl.store(dst, val.to(out_ptr.dtype.element_ty), mask=m2)


def _block_h(head_size: int, num_heads: int) -> int:
    """Heads a program: tiles of about 2048 values (16 a lane at 4 warps), never more heads than exist."""
    return max(1, min(next_power_of_2(num_heads), 2048 // next_power_of_2(head_size)))


def merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse=None,
                      prefill_tokens_with_context=None, output_scale=None) -> None:
    """Launcher (arguments checked by dsv4_rocm.ops.merge_attn_states)."""
    T, H, D = output.shape
    if T == 0 or H == 0:
        return
    n_ctx = T if prefill_tokens_with_context is None else prefill_tokens_with_context
    bh = _block_h(D, H)
    fp8 = output_scale is not None
    olse = output_lse if output_lse is not None else prefix_lse       # a pointer that is never written
    fnuz = fp8 and device_facts(output.device)[1]
    out = output.view(torch.uint8) if fp8 else output
    launch(_merge_attn_states_kernel)[(T, cdiv(H, bh))](
        out, output.stride(0), output.stride(1), olse, olse.stride(0), olse.stride(1),
        prefix_output, prefix_output.stride(0), prefix_output.stride(1), prefix_lse, prefix_lse.stride(0),
        prefix_lse.stride(1), suffix_output, suffix_output.stride(0), suffix_output.stride(1), suffix_lse,
        suffix_lse.stride(0), suffix_lse.stride(1), output_scale if fp8 else prefix_lse, n_ctx, H,
        HEAD_SIZE=D, BLOCK_D=next_power_of_2(D), BLOCK_H=bh, OUTPUT_LSE=output_lse is not None, FP8_OUT=fp8,
        OUT_FNUZ=output.dtype == torch.float8_e4m3fnuz, FNUZ=fnuz, num_warps=4)


def _specs():
    def spec(name, out, fp8, out_fnuz=False):
        return dict(name=name, fn=_merge_attn_states_kernel,
                    pointers=dict(out_ptr=out, olse_ptr="*fp32", p_ptr="*bf16", plse_ptr="*fp32", s_ptr="*bf16",
                                  slse_ptr="*fp32", scale_ptr="*fp32"), floats=(),
                    constexprs=lambda arch: dict(HEAD_SIZE=512, BLOCK_D=512, BLOCK_H=4, OUTPUT_LSE=True,
                                                 FP8_OUT=fp8, OUT_FNUZ=out_fnuz, FNUZ=fp8 and arch == "gfx942"),
                    options=lambda arch: dict(num_warps=4, num_stages=1), matrix=False, fp8_encode=fp8)
    return [spec("merge_attn_states", "*bf16", False), spec("merge_attn_states_fp8_out", "*u8", True),
            spec("merge_attn_states_fp8_fnuz_out", "*u8", True, True)]


COMPILE_SPECS = _specs()
