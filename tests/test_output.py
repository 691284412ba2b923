"""The FP8 linear of the layer's dense projections and the merging of attention states (the inverse RoPE
quantizer and the grouped FP8 einsum have their own test files)."""
import pytest
import torch

from dsv4_rocm import ops
from dsv4_rocm.reference import attention as ra
from dsv4_rocm.reference import output as O
from dsv4_rocm.reference.quant import e4m3_decode


def test_fp8_linear_equals_dequantized_math():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 256, generator=g).bfloat16()
    w8, sw = O.quantize_weight(torch.randn(384, 256, generator=g))
    y = ops.fp8_linear(x, w8, sw)
    assert torch.equal(ops.fp8_linear(x, w8.view(torch.float8_e4m3fn), sw), y)
    ref = x.float() @ (e4m3_decode(w8) * sw.repeat_interleave(128, 0).repeat_interleave(128, 1)).t()
    assert (y.float() - ref).norm() / ref.norm() < 0.05          # activation fp8 rounding (2^-4 relative)
    with pytest.raises(ValueError, match="weight_scale"):
        ops.fp8_linear(x, w8, sw[:1])
    with pytest.raises(ValueError, match="multiples of 128"):
        ops.fp8_linear(x[:, :200], w8[:, :200], sw)


def test_merge_attn_states_equals_attention_over_the_union():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(3, 4, 512, generator=g)
    K = torch.randn(3, 30, 512, generator=g)
    va = torch.zeros(3, 30, dtype=torch.bool)
    va[:, :12] = True
    va[2, :] = False                                   # part A empty for query 2
    vb = torch.zeros_like(va)
    vb[:, 12:] = True
    sm = 512 ** -0.5
    oa, la, _ = ra.attend(q, K, va, sm)
    ob, lb, _ = ra.attend(q, K, vb, sm)
    ou, lu, _ = ra.attend(q, K, va | vb, sm)
    om, lm = ops.merge_attn_states(oa, la, ob, lb)
    torch.testing.assert_close(om, ou, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lm, lu, rtol=1e-6, atol=1e-6)
    e, le = ops.merge_attn_states(oa[2:] * 0, la[2:], ob[2:] * 0, torch.full_like(lb[2:], float("inf")))
    assert torch.isposinf(le).all() and torch.equal(e, torch.zeros_like(e))


def test_merge_attn_states_rejects_integer_outputs():
    o, lse = torch.ones(2, 3, 8, dtype=torch.int64), torch.zeros(2, 3)
    with pytest.raises(ValueError, match="out_a must have dtype"):
        ops.merge_attn_states(o, lse, o, lse)
    with pytest.raises(ValueError, match="out_b must have dtype"):
        ops.merge_attn_states(o.float(), lse, o, lse)
