"""FP8 and MXFP4 block quantization with power-of-two scales (docs/math.md#ue8m0-fp8,
docs/math.md#mxfp4; the bytes: docs/cache_format.md#fp8-bytes).

UE8M0 block quantization of fp32 values b (one block = 64 values for the KV cache, 128 for the indexer
and output paths):

    amax = max(max|b|, eps)
    e    = ceil(log2(amax / 448))      amax / 448 rounded to fp32 first (IEEE division), then the
                                       exact ceil-log2 of that float from its bits, so every vendor
                                       and the reference agree on the exponent
    q    = e4m3fn(clamp(b * 2^-e, -448, 448))   RNE, saturating; the byte 0x80 (-0) is written 0x00
    scale byte (UE8M0) = e + 127, value = q * 2^e exactly

Non-finite input (a block holding NaN or +-inf) is poisoned: scale byte 0xFF (UE8M0 NaN), every fp8
byte 0x7F (e4m3fn NaN), so dequantization yields NaN for the whole block instead of wrong finite values.
An MXFP4 block is poisoned the same way: scale byte 0xFF, every nibble 0x7.

The FNUZ flavour (``fnuz=True``; records of a ``layout.with_fnuz`` format: vLLM's gfx942 sliding-window
cache, docs/cache_format.md#fnuz-flavour) is the same rule with e4m3fnuz bytes and vLLM's FNUZ maximum
224 in place of 448:

    e = ceil(log2(amax / 224)),   q = e4m3fnuz(clamp(b * 2^-e, -224, 224)),   scale byte = e + 127

(fnuz has no -0; a poisoned block's bytes are 0x80, fnuz NaN). Since fnuz(byte) = e4m3fn(byte) / 2 for
every byte but 0x7F, 0x80, 0xFF, and amax / 224 = 2 * (amax / 448) exactly, a block's FNUZ bytes equal
its OCP bytes and its FNUZ scale byte is the OCP one plus 1; the kernels write and read the flavour that
way, and the tests hold them to this definition.

NVFP4-style blocks (V41_FP4_288: e2m1 values with one e4m3 scale per 16, docs/math.md#nvfp4):

    sc   = e4m3fn(clamp(amax * fp32(1/6), 2^-9, 448))     RNE (vLLM's writers; FlashMLA's reference divides
                                                         amax / 6: the same byte for every bf16 amax)
    code = e2m1(x / sc)        IEEE division, nearest, ties to the even code, saturating at +-6; -0 keeps
                               its sign (code 0x8), as the hardware converts write it
    value = e2m1(code) * sc    exact in bf16 (2 + 4 significant bits)

A block holding NaN or +-inf is poisoned: scale byte 0x7F (e4m3fn NaN), every nibble 0.
"""
import torch

FP8_MAX = 448.0
FP8_NAN = 0x7F
FNUZ_FP8_MAX = 224.0    # vLLM's FNUZ maximum (not the dtype's 240)
FNUZ_NAN = 0x80
UE8M0_NAN = 0xFF
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """Exact ceil(log2(x)) of positive finite fp32 values, as int32."""
    m, e = torch.frexp(x.float())          # x = m * 2^e, m in [0.5, 1)
    return torch.where(m == 0.5, e - 1, e).to(torch.int32)


def ue8m0_exponent(amax: torch.Tensor, eps: float, fp8_max: float = FP8_MAX) -> torch.Tensor:
    """Scale exponent e (int32) of blocks with the given absolute maxima; non-finite amax -> 128."""
    a = torch.clamp(amax.float(), min=eps)
    finite = torch.isfinite(a)
    e = ceil_log2(torch.where(finite, a, torch.ones_like(a)) / fp8_max)
    return torch.where(finite, e, torch.full_like(e, UE8M0_NAN - 127))


def e4m3_encode(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> OCP e4m3fn bytes (uint8), RNE, saturating at +-448, -0 written as 0x00, NaN as 0x7F."""
    v = v.float()
    b = v.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    b = torch.where(b == 0x80, torch.zeros_like(b), b)
    return torch.where(torch.isnan(v), torch.full_like(b, FP8_NAN), b)


def e4m3_decode(b: torch.Tensor) -> torch.Tensor:
    """OCP e4m3fn bytes (uint8) -> fp32."""
    if b.dtype != torch.uint8:
        raise ValueError(f"e4m3_decode expects uint8 bytes, got {b.dtype}")
    return b.contiguous().view(torch.float8_e4m3fn).float()


def e4m3fnuz_encode(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> e4m3fnuz bytes (uint8), RNE, saturating at vLLM's +-224, NaN as 0x80 (fnuz has no -0)."""
    v = v.float()
    b = v.clamp(-FNUZ_FP8_MAX, FNUZ_FP8_MAX).to(torch.float8_e4m3fnuz).view(torch.uint8)
    return torch.where(torch.isnan(v), torch.full_like(b, FNUZ_NAN), b)


def e4m3fnuz_decode(b: torch.Tensor) -> torch.Tensor:
    """e4m3fnuz bytes (uint8) -> fp32 (0x80 is NaN, 0x7F / 0xFF are +-240)."""
    if b.dtype != torch.uint8:
        raise ValueError(f"e4m3fnuz_decode expects uint8 bytes, got {b.dtype}")
    return b.contiguous().view(torch.float8_e4m3fnuz).float()


def quantize_blocks(x: torch.Tensor, block: int, eps: float, fnuz: bool = False):
    """x [..., n] -> (fp8 bytes uint8 [..., n], exponents int32 [..., n // block]); e4m3fnuz bytes with
    maximum 224 when ``fnuz``."""
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"last dim {n} is not a multiple of the quant block {block}")
    xb = x.float().reshape(*x.shape[:-1], n // block, block)
    amax = xb.abs().amax(-1)
    bad = ~torch.isfinite(xb).all(-1)
    e = ue8m0_exponent(torch.where(bad, torch.zeros_like(amax), amax), eps, FNUZ_FP8_MAX if fnuz else FP8_MAX)
    e = torch.where(bad, torch.full_like(e, UE8M0_NAN - 127), e)
    q = (e4m3fnuz_encode if fnuz else e4m3_encode)(torch.ldexp(xb, -e.unsqueeze(-1).to(torch.float32)))
    q = torch.where(bad.unsqueeze(-1), torch.full_like(q, FNUZ_NAN if fnuz else FP8_NAN), q)
    return q.reshape(x.shape), e


def dequantize_blocks(q: torch.Tensor, e: torch.Tensor, block: int, fnuz: bool = False) -> torch.Tensor:
    """Inverse of quantize_blocks: fp32 [..., n]; an exponent of 128 (UE8M0 NaN) gives NaN. ``fnuz``: the
    bytes are e4m3fnuz."""
    v = (e4m3fnuz_decode if fnuz else e4m3_decode)(q).reshape(*q.shape[:-1], q.shape[-1] // block, block)
    scale = torch.ldexp(torch.ones_like(e, dtype=torch.float32), e.to(torch.float32))
    scale = torch.where(e >= UE8M0_NAN - 127, torch.full_like(scale, float("nan")), scale)
    return (v * scale.unsqueeze(-1)).reshape(q.shape)


def exponent_to_ue8m0(e: torch.Tensor) -> torch.Tensor:
    return (e + 127).clamp(0, 255).to(torch.uint8)


def ue8m0_to_exponent(b: torch.Tensor) -> torch.Tensor:
    return b.to(torch.int32) - 127


def ue8m0_qdq(x: torch.Tensor, block: int, eps: float) -> torch.Tensor:
    """Quantize-dequantize round trip (what a kernel reading the cache sees), fp32."""
    q, e = quantize_blocks(x, block, eps)
    return dequantize_blocks(q, e, block)


# ---- MXFP4 (indexer cache option, docs/math.md#mxfp4) -------------------------------------------
def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> E2M1 nibble (sign bit 3), RNE with ties to the even code, saturating at 6."""
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32, device=v.device)
    a = v.float().abs().clamp(max=6.0).unsqueeze(-1)
    d = (a - grid).abs()
    best = d.min(-1, keepdim=True).values
    codes = torch.arange(8, device=v.device)
    # among equally near codes pick the even one (RNE): penalise odd codes at ties
    score = torch.where(d == best, (codes % 2).float(), torch.full_like(d, 9.0))
    mag = score.argmin(-1).to(torch.uint8)
    return mag | (torch.signbit(v.float()).to(torch.uint8) << 3)


def e2m1_decode(nib: torch.Tensor) -> torch.Tensor:
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32, device=nib.device)
    mag = grid[(nib & 7).long()]
    return torch.where((nib & 8) != 0, -mag, mag)


def mxfp4_quantize(x: torch.Tensor):
    """x [..., n] (n % 32 == 0) -> (packed uint8 [..., n/2] low nibble = even index, ue8m0 [..., n/32])."""
    n = x.shape[-1]
    if n % 32:
        raise ValueError(f"MXFP4 needs a multiple of 32 values, got {n}")
    xb = x.float().reshape(*x.shape[:-1], n // 32, 32)
    bad = ~torch.isfinite(xb).all(-1)           # poisoned block: scale 0xFF, every nibble 0x7 (+6)
    amax = torch.where(bad, torch.ones_like(xb[..., 0]), xb.abs().amax(-1)).clamp(min=6.0 * 2.0 ** -126)
    e = ceil_log2(amax / 6.0).clamp(-127, 127)
    nib = e2m1_encode(torch.ldexp(xb, -e.unsqueeze(-1).float()))
    nib = torch.where(bad.unsqueeze(-1), torch.full_like(nib, 7), nib).reshape(*x.shape[:-1], n)
    packed = nib[..., 0::2] | (nib[..., 1::2] << 4)
    return packed, torch.where(bad, torch.full_like(e, UE8M0_NAN - 127), e).add(127).to(torch.uint8)


def mxfp4_dequantize(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    lo, hi = packed & 0xF, packed >> 4
    vals = torch.stack([e2m1_decode(lo), e2m1_decode(hi)], -1).reshape(*packed.shape[:-1], -1)
    vb = vals.reshape(*vals.shape[:-1], -1, 32)
    return (vb * torch.ldexp(torch.ones_like(vb[..., :1]), ue8m0_to_exponent(scales).float().unsqueeze(-1))
            ).reshape(vals.shape)


# ---- NVFP4-style blocks (V41_FP4_288, docs/math.md#nvfp4) ------------------------------------------
FP4_SCALE_MIN = 2.0 ** -9          # the smallest e4m3 magnitude (subnormal)
INV6 = torch.tensor(1.0 / 6.0, dtype=torch.float32)   # fp32(1/6): vLLM multiplies amax by it


def nvfp4_quantize(x: torch.Tensor, block: int = 16):
    """x [..., n] (n % block == 0) -> (packed uint8 [..., n/2] (low nibble = even index), e4m3fn scale bytes
    [..., n/block]); see the module docstring for the rule and the poisoned blocks."""
    n = x.shape[-1]
    if n % block or block % 2:
        raise ValueError(f"NVFP4 needs a multiple of {block} values, got {n}")
    xb = x.float().reshape(*x.shape[:-1], n // block, block)
    bad = ~torch.isfinite(xb).all(-1)
    amax = torch.where(bad, torch.ones_like(xb[..., 0]), xb.abs().amax(-1))
    sc = (amax * INV6.to(x.device)).clamp(FP4_SCALE_MIN, FP8_MAX).to(torch.float8_e4m3fn)
    nib = e2m1_encode(xb / sc.float().unsqueeze(-1))
    nib = torch.where(bad.unsqueeze(-1), torch.zeros_like(nib), nib).reshape(*x.shape[:-1], n)
    sb = sc.view(torch.uint8)
    sb = torch.where(bad, torch.full_like(sb, FP8_NAN), sb)
    return nib[..., 0::2] | (nib[..., 1::2] << 4), sb


def nvfp4_dequantize(packed: torch.Tensor, scales: torch.Tensor, block: int = 16) -> torch.Tensor:
    """Inverse of nvfp4_quantize: fp32 [..., 2 * packed.shape[-1]]; a NaN scale byte gives NaN."""
    lo, hi = packed & 0xF, packed >> 4
    vals = torch.stack([e2m1_decode(lo), e2m1_decode(hi)], -1).reshape(*packed.shape[:-1], -1)
    vb = vals.reshape(*vals.shape[:-1], -1, block)
    return (vb * e4m3_decode(scales).unsqueeze(-1)).reshape(vals.shape)


def flashmla_ue8m0_exponent(amax: torch.Tensor) -> torch.Tensor:
    """FlashMLA's reference scale rule for V4.1 fp8 records (its tests/quant.py): e = ceil(log2(max(amax /
    448, 1e-4))), which floors the scale at 2^-13, where the writers of vLLM (and this library) floor amax at
    1e-4 (``ue8m0_exponent(amax, 1e-4)``, scale >= 2^-22). The two agree whenever amax >= 0.0448; kept to
    state and test the difference (docs/numerics.md#v41-scales)."""
    a = amax.float() / FP8_MAX
    return ceil_log2(torch.clamp(a, min=1e-4))
