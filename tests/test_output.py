"""Output path (DSV4_SPEC §8), FP8 linear, and merging of attention states."""
import pytest
import torch

from dsv4_rocm import ops
from dsv4_rocm.reference import attention as ra
from dsv4_rocm.reference import output as O
from dsv4_rocm.reference.quant import e4m3_decode
from dsv4_rocm.reference.rope import build_cos_sin_cache, rope_inv


def test_inv_rope_quant_blocks_and_groups():
    g = torch.Generator().manual_seed(0)
    T, H, G = 3, 16, 2
    o = torch.randn(T, H, 512, generator=g).bfloat16()
    pos = torch.tensor([0, 7, 900])
    cs = build_cos_sin_cache(10000.0, 1024)
    a8, sa = ops.fused_inv_rope_fp8_quant(o, pos, cs, G)
    assert a8.shape == (T, G, 8 * 512) and sa.shape == (T, G, 32)
    x = rope_inv(o, pos, cs).reshape(T, G, 8 * 512)             # fp32, not re-rounded
    # one power-of-two scale per 128 values, 448 * scale >= block amax > 224 * scale
    am = x.reshape(T, G, 32, 128).abs().amax(-1)
    assert torch.equal(torch.frexp(sa)[0], torch.full_like(sa, 0.5))
    assert bool((am <= 448 * sa).all() and (am > 224 * sa).all())
    dq = e4m3_decode(a8).reshape(T, G, 32, 128) * sa.unsqueeze(-1)
    assert bool(((dq.reshape(x.shape) - x).abs() <= x.abs() * 2 ** -4 + sa.repeat_interleave(128, -1) * 2 ** -10).all())
    with pytest.raises(ValueError, match="n_groups"):
        ops.fused_inv_rope_fp8_quant(o, pos, cs, 3)


def test_fp8_einsum_and_linear_equal_dequantized_math():
    g = torch.Generator().manual_seed(1)
    T, G, r, d = 4, 2, 256, 128
    a8, sa = O.quantize_activation(torch.randn(T * G, r, generator=g))
    a8, sa = a8.reshape(T, G, r), sa.reshape(T, G, r // 128)
    w8, sw = O.quantize_weight(torch.randn(G, d, r, generator=g) * 0.1)
    z = ops.fp8_einsum(a8.view(torch.float8_e4m3fn), sa, w8, sw)
    a = e4m3_decode(a8) * sa.repeat_interleave(128, -1)
    w = e4m3_decode(w8) * sw.repeat_interleave(128, -1).repeat_interleave(128, -2)
    torch.testing.assert_close(z, torch.einsum("bhr,hdr->bhd", a, w).bfloat16(), rtol=0, atol=0)
    x = torch.randn(5, 256, generator=g).bfloat16()
    w8, sw = O.quantize_weight(torch.randn(384, 256, generator=g))
    y = ops.fp8_linear(x, w8, sw)
    ref = x.float() @ (e4m3_decode(w8) * sw.repeat_interleave(128, 0).repeat_interleave(128, 1)).t()
    assert (y.float() - ref).norm() / ref.norm() < 0.05          # activation fp8 rounding (2^-4 relative)
    with pytest.raises(ValueError, match="weight_scale"):
        ops.fp8_linear(x, w8, sw[:1])


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
