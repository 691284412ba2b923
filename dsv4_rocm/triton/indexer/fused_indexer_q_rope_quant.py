"""Indexer query: GPT-J RoPE of the last 64 dims, then UE8M0 FP8 per (token, head) with the q scale folded
into the weights, or MXFP4 (vLLM's ``fused_indexer_q_rope_quant``; the math is dsv4_rocm.reference.indexer's).

Program (t, head block) reads index_q[t, heads, 0:128] (bf16 / fp16 / fp32, unit inner stride), the
cos/sin row positions[t] of the table ([cos 32 | sin 32], fp32 or bf16) and index_weights[t, heads], and
writes
    FP8:    128 e4m3 bytes at out[t, h, :] and w' = ((w * 2^e) * softmax_scale) * head_scale at wout[t, h]
    MXFP4:  64 bytes of E2M1 pairs (low nibble = even dim) at out[t, h, :], 4 UE8M0 bytes at scale[t, h, :],
            w' = (w * softmax_scale) * head_scale
The arithmetic is the oracle's, operation for operation: the kernel is compiled with fp fusion off (RoPE is
e*c - o*s with separate roundings), the exponent comes from the bits of a correctly rounded division and
every multiply by a power of two is exact, so q bytes and w' equal the oracle's bit for bit. fp8 bytes are
OCP e4m3fn on every vendor (-0 written 0x00); gfx942 encodes x / 2 with its fnuz convert. With Q_FNUZ the
query is vLLM's gfx942 flavour (maximum 224, docs/numerics.md#fnuz-query): its exponent is e + 1 and its
e4m3fnuz bytes of x * 2^-(e + 1) are the OCP bytes of x * 2^-e, so the kernel writes the same bytes, folds
2^(e + 1) into w' and writes a poisoned head's bytes as 0x80 (fnuz NaN). A head (FP8) or
a block of 32 (MXFP4) holding NaN or +-inf is poisoned as docs/conventions.md says; so is every head of a
token whose position lies outside the table (reachable only with value checks off).
"""
import torch
import triton
import triton.language as tl

from .._launch import cdiv, device_cache, device_facts, launch
from .._pdl import pdl_start
from .._records import _ceil_log2, _pow2, _ue8m0_fp8

HEAD_BLOCK = 16


@triton.jit
def _e2m1(v):
    """E2M1 code of fp32 v (sign in bit 3), RNE with ties to the even code, saturating at 6. |v| is rounded to
    a multiple of the grid step around it (0.5 below 2, 1 below 4, 2 from 4 on) by adding and subtracting
    2^23 (exact: fp fusion is off and the scaled value is below 2^22); the rounded count r of steps gives the
    code r, r + 2 or r + 4 for the three ranges (1 -> 2, 2 -> 4, 4 -> 6, 6 -> 7)."""
    a = tl.minimum(tl.abs(v), 6.0)
    inv_step = tl.where(a < 2.0, 2.0, tl.where(a < 4.0, 1.0, 0.5))
    r = (a * inv_step + 8388608.0) - 8388608.0
    code = r.to(tl.int32) + tl.where(a < 2.0, 0, tl.where(a < 4.0, 2, 4))
    return code | (((v.to(tl.int32, bitcast=True) >> 31) & 1) << 3)


@triton.jit
def indexer_q_heads(
        t, head_block, pos_ptr, q_ptr, stride_qt, stride_qh, cs_ptr, stride_cs, cs_rows, w_ptr, stride_wt, stride_wh,
        out_ptr, stride_ot, stride_oh, scale_ptr, stride_st, stride_sh, wout_ptr, stride_wot,
        softmax_scale, head_scale, num_heads,
        HB: tl.constexpr, FP4: tl.constexpr, FNUZ: tl.constexpr, Q_FNUZ: tl.constexpr):
    """The work of one program: token t (int64), heads head_block * HB .. + HB - 1 (the module docstring). The
    fused decode front (dsv4_rocm/triton/qkv/decode_front.py) runs its indexer jobs through this too."""
    heads = head_block * HB + tl.arange(0, HB)
    live = heads < num_heads
    d = tl.arange(0, 128)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    pos_ok = (pos >= 0) & (pos < cs_rows)
    x = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=live[:, None],
                other=0.0).to(tl.float32)
    even, odd = tl.split(tl.reshape(x, (HB, 64, 2)))
    ri = tl.arange(0, 64) - 32                           # pair i of the RoPE dims 64 + 2i, 64 + 2i + 1
    is_rope = ri >= 0
    cs_row = cs_ptr + tl.where(pos_ok, pos, 0) * stride_cs + tl.where(is_rope, ri, 0)
    cos = tl.load(cs_row, mask=is_rope, other=1.0).to(tl.float32)[None, :]
    sin = tl.load(cs_row + 32, mask=is_rope, other=0.0).to(tl.float32)[None, :]
    re = tl.where(is_rope[None, :], (even * cos - odd * sin).to(tl.bfloat16).to(tl.float32), even)
    ro = tl.where(is_rope[None, :], (even * sin + odd * cos).to(tl.bfloat16).to(tl.float32), odd)
    xr = tl.where(pos_ok, tl.interleave(re, ro), float("nan"))
    w = tl.load(w_ptr + t * stride_wt + heads * stride_wh, mask=live, other=0.0).to(tl.float32)
    if FP4:
        z = tl.reshape(xr, (HB * 4, 32))
        bad = tl.max(((z != z) | (tl.abs(z) == float("inf"))).to(tl.int32), axis=1) > 0
        amax = tl.maximum(tl.where(bad, 1.0, tl.max(tl.abs(z), axis=1)), 6.0 * 2.0 ** -126)
        e = _ceil_log2(tl.math.div_rn(amax, 6.0))
        code = tl.where(bad[:, None], 7, _e2m1(z * _pow2(-e)[:, None]))
        lo, hi = tl.split(tl.reshape(code, (HB * 64, 2)))
        packed = tl.reshape((lo | (hi << 4)).to(tl.uint8), (HB, 64))
        c64 = tl.arange(0, 64)
        tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + c64[None, :], packed, mask=live[:, None])
        sb = tl.reshape(tl.where(bad, 255, e + 127).to(tl.uint8), (HB, 4))
        c4 = tl.arange(0, 4)
        tl.store(scale_ptr + t * stride_st + heads[:, None] * stride_sh + c4[None, :], sb, mask=live[:, None])
        w = (w * softmax_scale) * head_scale
    else:
        q, e, bad = _ue8m0_fp8(xr, FNUZ)
        if Q_FNUZ:
            q = tl.where(bad[:, None], 0x80, q).to(tl.uint8)
            e = e + 1
        tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + d[None, :], q, mask=live[:, None])
        w = tl.where(bad, float("nan"), ((w * _pow2(e)) * softmax_scale) * head_scale)
    tl.store(wout_ptr + t * stride_wot + heads, w, mask=live)


@triton.jit
def _fused_indexer_q_rope_quant_kernel(
        pos_ptr, q_ptr, stride_qt, stride_qh, cs_ptr, stride_cs, cs_rows, w_ptr, stride_wt, stride_wh,
        out_ptr, stride_ot, stride_oh, scale_ptr, stride_st, stride_sh, wout_ptr, stride_wot,
        softmax_scale, head_scale, num_heads,
        HB: tl.constexpr, FP4: tl.constexpr, FNUZ: tl.constexpr, Q_FNUZ: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    indexer_q_heads(tl.program_id(0).to(tl.int64), tl.program_id(1), pos_ptr, q_ptr, stride_qt, stride_qh, cs_ptr,
                    stride_cs, cs_rows, w_ptr, stride_wt, stride_wh, out_ptr, stride_ot, stride_oh, scale_ptr,
                    stride_st, stride_sh, wout_ptr, stride_wot, softmax_scale, head_scale, num_heads,
                    HB=HB, FP4=FP4, FNUZ=FNUZ, Q_FNUZ=Q_FNUZ)


@device_cache()
def _fnuz(device) -> bool:
    return device_facts(device)[1]


def fused_indexer_q_rope_quant(positions, index_q, index_q_cos_sin_cache, index_weights,
                               index_weights_softmax_scale: float, index_weights_head_scale: float,
                               use_fp4: bool = False, use_fnuz: bool = False):
    """vLLM's call form; arguments checked by ``dsv4_rocm.ops.fused_indexer_q_rope_quant``."""
    T, H, D = index_q.shape
    dev = index_q.device
    w_out = torch.empty(T, H, dtype=torch.float32, device=dev)
    if use_fp4:
        out = torch.empty(T, H, D // 2, dtype=torch.uint8, device=dev)
        scales = torch.empty(T, H, D // 32, dtype=torch.uint8, device=dev)
    else:
        out = torch.empty(T, H, D, dtype=torch.float8_e4m3fnuz if use_fnuz else torch.float8_e4m3fn, device=dev)
        scales = out
    if T:
        o = out.view(torch.uint8)
        launch(_fused_indexer_q_rope_quant_kernel)[(T, cdiv(H, HEAD_BLOCK))](
            positions, index_q, index_q.stride(0), index_q.stride(1), index_q_cos_sin_cache,
            index_q_cos_sin_cache.stride(0), index_q_cos_sin_cache.shape[0], index_weights, index_weights.stride(0),
            index_weights.stride(1), o, o.stride(0), o.stride(1), scales.view(torch.uint8), scales.stride(0),
            scales.stride(1), w_out, w_out.stride(0), index_weights_softmax_scale, index_weights_head_scale, H,
            HB=HEAD_BLOCK, FP4=use_fp4, FNUZ=_fnuz(dev), Q_FNUZ=use_fnuz, num_warps=4, num_stages=1,
            enable_fp_fusion=False)
    if use_fp4:
        return (out, scales.view(torch.int32).squeeze(-1)), w_out
    return out, w_out


def _spec(name, fp4, q_dtype, q_fnuz=False):
    return dict(
        name=name, fn=_fused_indexer_q_rope_quant_kernel,
        pointers=dict(pos_ptr="*i64", q_ptr=q_dtype, cs_ptr="*fp32", w_ptr="*bf16", out_ptr="*u8", scale_ptr="*u8",
                      wout_ptr="*fp32"),
        floats=("softmax_scale", "head_scale"),
        constexprs=lambda arch: dict(HB=HEAD_BLOCK, FP4=fp4, FNUZ=arch == "gfx942", Q_FNUZ=q_fnuz),
        options=lambda arch: dict(num_warps=4, num_stages=1, enable_fp_fusion=False),
        matrix=False, fp8_encode=not fp4, exact_fp32=True)


COMPILE_SPECS = [
    _spec("fused_indexer_q_rope_quant[fp8]", False, "*bf16"),
    _spec("fused_indexer_q_rope_quant[mxfp4]", True, "*bf16"),
    _spec("fused_indexer_q_rope_quant[fp8, fnuz query]", False, "*bf16", q_fnuz=True),
]
