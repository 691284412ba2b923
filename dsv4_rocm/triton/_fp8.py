"""The fp8 conversions of the Triton kernels in one place: the hardware instruction when compiled, a
bit-exact model of the instruction under the Triton interpreter.

The kernels keep OCP e4m3fn bytes on every target (docs/platforms.md#fp8). gfx942 has only the fnuz fp8
unit: it encodes x / 2 as fnuz, which is the OCP byte of x, and reads the bytes as fnuz, whose values are
half the OCP ones; the kernels make up the factor 2 in their own arithmetic (the scale exponent + 1, each
block's scale product x 4). The helpers are the instructions themselves, nothing more:

    encode(x, False)     fp32 -> OCP e4m3fn byte: round to nearest even (subnormals included); beyond +-448
                         and +-inf saturate to +-448 (0x7E / 0xFE); NaN -> 0x7F; -0 -> 0x80. NVIDIA's
                         ``cvt.rn.satfinite.e4m3x2.f32``, which Triton's fp8e4nv cast lowers to there.
    encode(x, True)      fp32 -> fnuz e4m3 byte (bias 8, largest 240): round to nearest even; a result
                         beyond 240, +-inf and NaN -> 0x80 (the only NaN: gfx942's v_cvt_pk_fp8_f32 does
                         not saturate without its clamp bit, which Triton does not set); every zero -> 0x00.
    decode(b, FNUZ)      byte -> fp32, exact. OCP: 0x7F and 0xFF are NaN, 0x80 is -0. fnuz: 0x80 is NaN,
                         every other value half the OCP value of the byte.
    mma_operand(b, FNUZ) bytes as the fp8 operand of ``tl.dot`` (the matrix unit reads them as OCP or fnuz).
    e4m3_to_scaled_bf16_model, e2m1_to_scaled_bf16_model
                         the NVIDIA decode kernel's integer (PTX) decodes of e4m3 bytes and e2m1 codes.

No kernel feeds an encoder a value beyond +-448 (OCP) or +-224 (fnuz, x / 2 after the clamp): the clamps
are the kernels' own code, before the helpers.

Compiled (``INTERPRETED`` False), each helper is the plain Triton cast: the backends lower it to the
hardware convert and to fp8 matrix instructions (``build_tools/compile_matrix.py`` checks that they do).
Under the Triton interpreter (``TRITON_INTERPRET=1``) Triton's own fp8 casts are not the hardware's: they
flush subnormals, lose the rounding carry, know no fnuz and no fp8 NaN. There each helper runs an integer
model of the instruction instead, in Triton operations on the same tensors, so the kernel body around it
(the clamp, x * 0.5, the scale byte + 1, the x 4 scale products, its tiles and masks) runs as written,
for every target ``_launch.emulate_target`` picks. ``mma_operand`` gives the exact fp32 values there: a
product of two e4m3 values is exact in fp32 and ``tl.dot`` of fp32 tiles accumulates in fp32, which is what
the fp8 matrix instructions compute up to the order (and, on NVIDIA, the width) of their accumulation.
``tests/tooling/test_amd_tier.py`` checks the models against torch's casts over every byte and many fp32 values,
and, on a GPU, against the hardware convert.
"""
import triton
import triton.language as tl
from triton import knobs

# Whether Triton interprets the kernels: decided when this module is imported, as ``triton.jit`` decides
# for every kernel it decorates
INTERPRETED = tl.constexpr(bool(knobs.runtime.interpret))


@triton.jit
def _pow2(e):
    """2^e as fp32 for integer e in the normal range."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _encode_model(x, BIAS: tl.constexpr, FNUZ: tl.constexpr):
    """The e4m3 byte of fp32 x with exponent bias BIAS (7 OCP, 8 fnuz), round to nearest even, from its bits.

    Results of at least the smallest normal 2^(1 - BIAS): the fp32 bits rounded to 3 mantissa bits in place
    (a carry out of the mantissa raises the exponent, which is the right result) and rebiased. Below it:
    the count of subnormal steps 2^(-2 - BIAS) in |x|, rounded to nearest even; a count of 8 is code 0x08,
    the smallest normal, which is the right result again."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    finite = a < 0x7F800000
    af = tl.where(finite, a, 0)
    e = af >> 23                                           # biased fp32 exponent
    normal = ((af + 0x7FFFF + ((af >> 20) & 1)) >> 20) - ((127 - BIAS) << 3)
    m = (af & 0x7FFFFF) | 0x800000                         # |x| = m * 2^(e - 150)
    sh = tl.minimum(tl.maximum(148 - BIAS - e, 21), 30)    # below 2^(1 - BIAS): |x| / 2^(-2 - BIAS) = m >> sh
    q = m >> sh
    rem = m & ((1 << sh) - 1)
    half = 1 << (sh - 1)
    sub = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    mag = tl.where(e >= 128 - BIAS, normal, sub)
    if FNUZ:
        nan = (~finite) | (mag > 0x7F)
        b = tl.where(nan, 0x80, tl.where(mag == 0, 0, mag | sign))
    else:
        nan = a > 0x7F800000
        b = tl.where(nan, 0x7F, tl.minimum(tl.where(finite, mag, 0x7E), 0x7E) | sign)
    return b.to(tl.uint8)


@triton.jit
def _decode_model(b, FNUZ: tl.constexpr):
    """fp32 value of e4m3 bytes b (OCP bias 7, fnuz bias 8): (8 + m) 2^(e - bias - 3), or m 2^(-2 - bias) for
    e = 0, as an exact product of a small integer and a power of two."""
    v = b.to(tl.int32) & 0xFF
    e = (v >> 3) & 0xF
    m = v & 7
    BIAS: tl.constexpr = 8 if FNUZ else 7
    mag = tl.where(e == 0, m, m + 8).to(tl.float32) * _pow2(tl.maximum(e, 1) - BIAS - 3)
    val = (mag.to(tl.int32, bitcast=True) | ((v & 0x80) << 24)).to(tl.float32, bitcast=True)     # -0 kept
    if FNUZ:
        nan = v == 0x80
    else:
        nan = (v & 0x7F) == 0x7F
    return tl.where(nan, float("nan"), val)


@triton.jit
def encode(x, FNUZ: tl.constexpr):
    """e4m3 bytes (uint8) of fp32 x: OCP e4m3fn, or with FNUZ fnuz (module docstring)."""
    if INTERPRETED:
        b = _encode_model(x, 8 if FNUZ else 7, FNUZ)
    elif FNUZ:
        b = x.to(tl.float8e4b8).to(tl.uint8, bitcast=True)
    else:
        b = x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return b


@triton.jit
def decode(b, FNUZ: tl.constexpr):
    """fp32 values of e4m3 bytes b (uint8), read as OCP or, with FNUZ, as fnuz."""
    if INTERPRETED:
        v = _decode_model(b, FNUZ)
    elif FNUZ:
        v = b.to(tl.float8e4b8, bitcast=True).to(tl.float32)
    else:
        v = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return v


@triton.jit
def mma_operand(b, FNUZ: tl.constexpr):
    """e4m3 bytes b (uint8) as a ``tl.dot`` operand: the fp8 tensor the matrix unit reads as OCP or fnuz;
    under the interpreter their exact fp32 values."""
    if INTERPRETED:
        v = _decode_model(b, FNUZ)
    elif FNUZ:
        v = b.to(tl.float8e4b8, bitcast=True)
    else:
        v = b.to(tl.float8e4nv, bitcast=True)
    return v


@triton.jit
def e4m3_to_scaled_bf16_model(b):
    """The integer decode of ``_decode_tiles.e4m3_to_scaled_bf16_ptx`` (which the interpreter cannot run),
    one byte at a time: the bf16 with the byte's sign and its 7 low bits at bits 4..10, the e4m3 value
    times 2^-120."""
    v = b.to(tl.int32) & 0xFF
    bits = ((v & 0x80) << 8) | ((v & 0x7F) << 4)
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def e2m1_to_scaled_bf16_model(code):
    """The integer decode of ``_decode_tiles.e2m1_to_scaled_bf16_ptx`` (which the interpreter cannot run),
    one code at a time: the f16 high byte of the code's magnitude from the 8-entry table (0x00, 0x38, 0x3C,
    0x3E, 0x40, 0x42, 0x44, 0x46) shifted into place and right by 3, the sign in bit 15: the bf16 of the
    e2m1 value times 2^-112."""
    v = code.to(tl.int32) & 0xF
    m = v & 7
    hi = tl.where(m == 0, 0, tl.where(m == 1, 0x38, tl.where(m == 2, 0x3C, tl.where(m == 3, 0x3E, 0x38 + 2 * m))))
    bits = (hi << 5) | ((v & 8) << 12)
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
