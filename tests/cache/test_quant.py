"""UE8M0 FP8 and MXFP4 quantization (docs/math.md#ue8m0-fp8, docs/math.md#mxfp4): hand-computed cases,
brute-force encoders."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from dsv4_rocm.reference import quant as Q

ALL_E4M3 = Q.e4m3_decode(torch.arange(256, dtype=torch.uint8))


def brute_e4m3(v: float) -> int:
    """Nearest finite e4m3fn byte to v (after the +-448 clamp), ties to the even code; -0 -> 0x00."""
    v = max(-448.0, min(448.0, v))
    best, best_d = None, None
    for b in range(256):
        x = float(ALL_E4M3[b])
        if math.isnan(x):
            continue
        d = abs(x - v)
        if best is None or d < best_d or (d == best_d and b % 2 == 0 and best % 2 == 1):
            best, best_d = b, d
    return 0 if best == 0x80 else best


def test_e4m3_encoder_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    vals = torch.cat([torch.randn(3000, generator=g) * torch.exp2(torch.randint(-12, 10, (3000,), generator=g).float()),
                      ALL_E4M3[~torch.isnan(ALL_E4M3)],                                  # exact codes
                      (ALL_E4M3[1:0x7E] + ALL_E4M3[2:0x7F]) / 2,                         # exact ties
                      torch.tensor([500.0, -1e6, 0.0, -0.0, 1e-30, -1e-30, 448.0, -448.0])])
    got = Q.e4m3_encode(vals)
    exp = torch.tensor([brute_e4m3(float(v)) for v in vals], dtype=torch.uint8)
    assert torch.equal(got, exp)
    assert not bool((got == 0x80).any())


def test_ceil_log2_exact_at_powers_of_two():
    for k in range(-30, 30):
        x = torch.tensor([2.0 ** k], dtype=torch.float32)
        assert int(Q.ceil_log2(x)) == k
        assert int(Q.ceil_log2(torch.nextafter(x, torch.tensor([math.inf])))) == k + 1
        assert int(Q.ceil_log2(torch.nextafter(x, torch.tensor([0.0])))) == k


@pytest.mark.parametrize("amax, e", [
    (448.0, 0), (448.0 * 4, 2), (448.0 / 8, -3), (450.0, 1), (446.0, 0), (224.0, -1), (225.0, 0),
    (1e-4, -22), (0.0, -22), (3.3e38, 120),
])
def test_ue8m0_exponent_hand_cases(amax, e):
    assert int(Q.ue8m0_exponent(torch.tensor([amax]), 1e-4)) == e


def test_block_quant_hand_computed():
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1], x[0, 2], x[0, 3] = 448.0 * 2, -3.0, -0.0, 1.0
    q, e = Q.quantize_blocks(x, 64, 1e-4)
    assert int(e) == 1                               # 896 / 448 = 2 -> scale 2
    assert int(q[0, 0]) == 0x7E                      # 448 = 1.75 * 2^8: exp 15, mantissa 6
    assert int(q[0, 1]) == 0x80 | 0x3C               # -1.5 = -(1.5 * 2^0): exp 7, mantissa 4
    assert int(q[0, 2]) == 0 and int(q[0, 4]) == 0   # -0 and 0 are both 0x00
    assert int(q[0, 3]) == 0x30                      # 0.5: exp 6, mantissa 0
    assert int(Q.exponent_to_ue8m0(e)) == 128
    zero_q, zero_e = Q.quantize_blocks(torch.zeros(2, 128), 64, 1e-4)
    assert torch.equal(zero_q, torch.zeros_like(zero_q)) and (zero_e == -22).all()
    assert (Q.exponent_to_ue8m0(zero_e) == 105).all()


def test_non_finite_blocks_are_poisoned():
    x = torch.randn(3, 128)
    x[0, 5] = float("nan")
    x[1, 70] = float("inf")
    x[2, 1] = float("-inf")
    q, e = Q.quantize_blocks(x, 64, 1e-4)
    b = Q.exponent_to_ue8m0(e)
    assert int(b[0, 0]) == 255 and int(b[0, 1]) != 255
    assert int(b[1, 1]) == 255 and int(b[1, 0]) != 255
    assert (q[0, :64] == 0x7F).all() and (q[1, 64:] == 0x7F).all() and (q[2, :64] == 0x7F).all()
    d = Q.dequantize_blocks(q, e, 64)
    assert torch.isnan(d[0, :64]).all() and torch.isfinite(d[0, 64:]).all()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e4, 1e4, allow_nan=False, width=32), min_size=64, max_size=64),
       st.integers(-20, 20))
def test_qdq_error_bound(vals, shift):
    x = torch.tensor(vals, dtype=torch.float32).unsqueeze(0) * 2.0 ** shift
    q, e = Q.quantize_blocks(x, 64, 1e-4)
    d = Q.dequantize_blocks(q, e, 64)
    s = 2.0 ** int(e)
    # e4m3: 3 mantissa bits (half-ulp relative 2^-4), subnormal spacing 2^-9 in scaled units
    bound = torch.maximum(x.abs() * 2 ** -4, torch.full_like(x, s * 2 ** -10)) * (1 + 1e-6)
    assert bool(((d - x).abs() <= bound).all())
    assert float(x.abs().max()) <= 448 * s or float(x.abs().max()) < 1e-4


def test_mxfp4_grid_ties_and_packing():
    vals = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -6.0, 7.0, 0.25, 0.75, 1.75, 2.5, 3.5, 5.0])
    nib = Q.e2m1_encode(vals)
    assert nib.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 15, 7, 0, 2, 4, 4, 6, 6]
    x = torch.randn(4, 128) * 3
    packed, sc = Q.mxfp4_quantize(x)
    assert packed.shape == (4, 64) and sc.shape == (4, 4)
    d = Q.mxfp4_dequantize(packed, sc)
    s = torch.exp2(Q.ue8m0_to_exponent(sc).float()).repeat_interleave(32, 1)
    assert bool(((d - x).abs() <= torch.maximum(x.abs() * 0.25, s * 0.25) + 1e-6).all())
    # low nibble holds the even element
    one = torch.zeros(1, 32)
    one[0, 0], one[0, 1] = 6.0, 1.0
    p, _ = Q.mxfp4_quantize(one)
    assert int(p[0, 0]) == 7 | (2 << 4)
