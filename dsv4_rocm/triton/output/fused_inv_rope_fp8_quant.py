"""Inverse RoPE + UE8M0 fp8 quantization of the attention output (vLLM's ``fused_inv_rope_fp8_quant``).

Math (``dsv4_rocm.reference.output``, the same operations in the same order, fp fusion off): for token t
and head h of o [T, H, 512] bf16, x = o[t, h] in fp32; the pairs (448 + 2i, 449 + 2i), i < 32, rotate
backwards with c = cs[pos_t, i], s = cs[pos_t, 32 + i]: e' = e c + o s, o' = o c - e s (fp32, not rounded
to bf16). Each QG = quant_group_size values of the head (128 by default; vLLM also runs 32 and 64: the
rotary pairs then span two or four blocks) form a block: amax = max|x| (at least 1e-10), e = ceil(log2(amax /
448)) from the bits of the correctly rounded quotient, bytes = e4m3fn(clamp(x 2^-e, +-448)) with -0 written
0x00 (gfx942 encodes x/2 with its fnuz convert: the same OCP byte). A block holding NaN or +-inf is
poisoned: bytes 0x7F, scale NaN / UE8M0 0xFF (docs/conventions.md).

Layout (G = n_groups groups of HPG heads, D = HPG * 512, T4 = T rounded up to 4):
    data   [G, T, D] e4m3 bytes: head h = g * HPG + j at columns j * 512 .. j * 512 + 511 of row (g, t)
    scales [G, K, T4] int32 words: fp32 bits of 2^e (K = HPG * CH, CH = 512 / QG blocks a head, block k of
           the group's row), or with PACKED one word per 4 blocks (K = HPG * CH / 4), block 4w + j of the
           group's row in byte j of word w.
           Rows t >= T are written 0 (vLLM's TMA padding).
One program per (token row of T4, BH consecutive heads): a [BH * CH, QG] tile, one block a row. A
token whose position is outside the cos/sin table is padding: its bytes and scales are written 0.

Without QUANTIZE (vLLM's ``quantize=False``): data [G, T, D] bf16, x' rounded to nearest even (0 for a
padding token), no scales; one program per (token of T, BH heads).
"""
import torch
import triton
import triton.language as tl

from ...layout import tma_aligned_tokens
from .._launch import device_cache, device_facts, launch
from .._pdl import pdl_start
from .._records import _ceil_log2, _e4m3, _pow2

O_EPS = tl.constexpr(1e-10)


@triton.jit
def _inv_rope_fp8_quant_kernel(o_ptr, o_stride_t, o_stride_h, pos_ptr, cs_ptr, cs_stride, cs_rows,
                               data_ptr, data_stride_g, data_stride_t, scale_ptr, scale_stride_g, scale_stride_k,
                               num_tokens, HPG: tl.constexpr, BH: tl.constexpr, PACKED: tl.constexpr,
                               FNUZ: tl.constexpr, QUANTIZE: tl.constexpr, QG: tl.constexpr = 128,
                               PDL: tl.constexpr = False):
    pdl_start(PDL)
    CH: tl.constexpr = 512 // QG                        # blocks a head
    R: tl.constexpr = BH * CH
    HALF: tl.constexpr = QG // 2
    t = tl.program_id(0).to(tl.int64)
    h0 = tl.program_id(1).to(tl.int64) * BH                          # first head of this program (BH divides HPG)
    g = h0 // HPG
    j0 = h0 % HPG                                       # its index inside the group
    row = tl.arange(0, R)
    col = tl.arange(0, QG)
    if PACKED:
        sk = j0 * (CH // 4) + tl.arange(0, R // 4)      # one word per 4 blocks
    else:
        sk = j0 * CH + row
    scale_addr = scale_ptr + g * scale_stride_g + sk * scale_stride_k + t
    if QUANTIZE and t >= num_tokens:                    # TMA padding row of the scale storage
        tl.store(scale_addr, tl.zeros_like(sk))
        return
    pos = tl.load(pos_ptr + t).to(tl.int64)
    valid = (pos >= 0) & (pos < cs_rows)
    head = h0 + row // CH
    chunk = row % CH
    x = tl.load(o_ptr + t * o_stride_t + head[:, None] * o_stride_h + (chunk * QG)[:, None]
                + col[None, :]).to(tl.float32)
    even, odd = tl.split(tl.reshape(x, (R, HALF, 2)))
    i = (chunk * HALF)[:, None] + tl.arange(0, HALF)[None, :] - 224   # rotary pair of columns (448 + 2i, 449 + 2i)
    ci = tl.where(i >= 0, i, 0)
    rot = i >= 0
    cmask = rot & valid
    cs_row = cs_ptr + tl.where(valid, pos, 0) * cs_stride
    c = tl.load(cs_row + ci, mask=cmask, other=1.0).to(tl.float32)
    s = tl.load(cs_row + 32 + ci, mask=cmask, other=0.0).to(tl.float32)
    x = tl.interleave(tl.where(rot, even * c + odd * s, even), tl.where(rot, odd * c - even * s, odd))
    dst = data_ptr + g * data_stride_g + t * data_stride_t + j0 * 512 + row[:, None] * QG + col[None, :]
    if not QUANTIZE:
        tl.store(dst, tl.where(valid, x, 0.0).to(tl.bfloat16))
        return
    bad = tl.max(((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32), axis=1) > 0
    amax = tl.where(bad, 0.0, tl.max(tl.abs(x), axis=1))
    e = _ceil_log2(tl.math.div_rn(tl.maximum(amax, O_EPS), 448.0))
    q = _e4m3(x * _pow2(-e)[:, None], FNUZ)
    q = tl.where(bad[:, None] & valid, 0x7F, tl.where(valid, q, 0))
    tl.store(dst, q.to(tl.uint8))
    if PACKED:
        byte = tl.where(bad, 255, e + 127)
        word = tl.sum(tl.reshape(byte << ((chunk % 4) * 8), (R // 4, 4)), axis=1)
    else:
        word = tl.where(bad, 0x7FC00000, (e + 127) << 23)
    tl.store(scale_addr, tl.where(valid, word, 0))


def default_config(arch: str) -> dict:
    """Two heads (8 blocks of 128) a program: 1 KB of fp8 out and 2 KB of bf16 in, 16 values a lane."""
    if arch.startswith("gfx"):
        return dict(BH=2, num_warps=1)
    return dict(BH=2, num_warps=2)


@device_cache()
def _device_facts(device: torch.device):
    """(arch, gfx942's fnuz fp8), cached: a launch must not pay for a properties query."""
    arch, fnuz, _, _ = device_facts(device)
    return arch, fnuz


def fused_inv_rope_fp8_quant(o, positions, cos_sin_cache, n_groups: int, heads_per_group: int, nope_dim: int = 448,
                             rope_dim: int = 64, quant_group_size: int = 128, tma_aligned_scales: bool = False,
                             quantize: bool = True, config: dict = None):
    """vLLM's call form; arguments checked by ``dsv4_rocm.ops.fused_inv_rope_fp8_quant``."""
    T, H, D = o.shape
    G, HPG = n_groups, heads_per_group
    if not quantize:
        return _rotated_rows(o, positions, cos_sin_cache, G, HPG, tma_aligned_scales, config)
    T4 = tma_aligned_tokens(T)
    CH = D // quant_group_size
    K = HPG * CH // 4 if tma_aligned_scales else HPG * CH
    data = torch.empty(G, T, HPG * D, dtype=torch.float8_e4m3fn, device=o.device)
    store = torch.empty(G * K * T4, dtype=torch.int32, device=o.device)
    scales = store.as_strided((G, T, K), (K * T4, 1, T4))
    if T4:
        arch, fnuz = _device_facts(o.device)
        cfg = dict(default_config(arch), **(config or {}))
        bh = cfg["BH"]
        if HPG % bh:
            bh = 1
        launch(_inv_rope_fp8_quant_kernel)[(T4, H // bh)](
            o, o.stride(0), o.stride(1), positions, cos_sin_cache, cos_sin_cache.stride(0), cos_sin_cache.shape[0],
            data.view(torch.uint8), data.stride(0), data.stride(1), store, K * T4, T4, T,
            HPG=HPG, BH=bh, PACKED=bool(tma_aligned_scales), FNUZ=fnuz, QUANTIZE=True, QG=quant_group_size,
            num_warps=cfg["num_warps"], num_stages=1, enable_fp_fusion=False)
    if not tma_aligned_scales:
        scales = scales.view(torch.float32)
    return data.transpose(0, 1), scales.transpose(0, 1)


def _rotated_rows(o, positions, cos_sin_cache, G, HPG, tma_aligned_scales, config):
    """``quantize=False``: the rotated rows as bf16 [T, G, D] over [G, T, D] storage and an empty scale tensor."""
    T, H, D = o.shape
    data = torch.empty(G, T, HPG * D, dtype=torch.bfloat16, device=o.device)
    scales = torch.empty(0, dtype=torch.int32 if tma_aligned_scales else torch.float32, device=o.device)
    if T:
        arch, _ = _device_facts(o.device)
        cfg = dict(default_config(arch), **(config or {}))
        bh = cfg["BH"] if HPG % cfg["BH"] == 0 else 1
        launch(_inv_rope_fp8_quant_kernel)[(T, H // bh)](
            o, o.stride(0), o.stride(1), positions, cos_sin_cache, cos_sin_cache.stride(0), cos_sin_cache.shape[0],
            data, data.stride(0), data.stride(1), scales, 0, 0, T,
            HPG=HPG, BH=bh, PACKED=False, FNUZ=False, QUANTIZE=False, QG=128, num_warps=cfg["num_warps"], num_stages=1,
            enable_fp_fusion=False)
    return data.transpose(0, 1), scales


def _spec(packed: bool, cs_dtype: str):
    return dict(
        name=f"fused_inv_rope_fp8_quant[{'packed ue8m0' if packed else 'fp32'} scales, cos_sin {cs_dtype}]",
        fn=_inv_rope_fp8_quant_kernel,
        pointers=dict(o_ptr="*bf16", pos_ptr="*i64", cs_ptr=f"*{cs_dtype}", data_ptr="*u8", scale_ptr="*i32"),
        floats=(),
        constexprs=lambda arch: dict(HPG=8, BH=default_config(arch)["BH"], PACKED=packed, FNUZ=arch == "gfx942",
                                     QUANTIZE=True, QG=128),
        options=lambda arch: dict(num_warps=default_config(arch)["num_warps"], num_stages=1, enable_fp_fusion=False),
        matrix=False, fp8_encode=True, exact_fp32=True)


def _bf16_spec():
    spec = dict(_spec(False, "fp32"), name="fused_inv_rope_fp8_quant[quantize=False: bf16 rows]", fp8_encode=False)
    spec["pointers"] = dict(spec["pointers"], data_ptr="*bf16")
    spec["constexprs"] = lambda arch: dict(HPG=8, BH=default_config(arch)["BH"], PACKED=False, FNUZ=False,
                                           QUANTIZE=False, QG=128)
    return spec


def _group32_spec():
    """vLLM's 32-value blocks (16 a head, 4 packed words a head)."""
    spec = dict(_spec(True, "fp32"), name="fused_inv_rope_fp8_quant[packed ue8m0 scales, blocks of 32]")
    spec["constexprs"] = lambda arch: dict(HPG=8, BH=default_config(arch)["BH"], PACKED=True, FNUZ=arch == "gfx942",
                                           QUANTIZE=True, QG=32)
    return spec


COMPILE_SPECS = [_spec(False, "fp32"), _spec(True, "bf16"), _bf16_spec(), _group32_spec()]
