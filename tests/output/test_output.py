"""The FP8 linear of the layer's dense projections (the inverse RoPE quantizer, the grouped FP8 einsum and
merge_attn_states have their own test files)."""
import pytest
import torch

from dsv4_rocm import ops
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
