"""The comparison the tests share for floats that may hold NaN (helpers.same_floats): any NaN matches any
NaN, every other value matches only its own bits."""
import torch

from helpers import float_mismatch, same_floats


def test_nan_payloads_and_signs_do_not_matter_other_bits_do():
    x = torch.tensor([1.5, float("nan"), float("-inf"), 0.0, float("nan")])
    y = x.clone()
    y.view(torch.int32)[1] = 0x7F800001                       # a signalling NaN, another payload
    y.view(torch.int32)[4] = -0x400000                         # 0xFFC00000: the negative default NaN
    assert torch.isnan(y[1]) and torch.isnan(y[4]) and not torch.equal(x.view(torch.int32), y.view(torch.int32))
    assert same_floats(x, y) and same_floats(x.bfloat16(), y.bfloat16())
    for i, v in ((0, 1.5000001), (2, float("inf")), (3, -0.0), (1, 1.0)):
        z = y.clone()
        z[i] = v
        assert not same_floats(x, z) and float_mismatch(x, z).nonzero().flatten().tolist() == [i], (i, v)
    assert not same_floats(x, x[:4]) and not same_floats(x, x.double())
    f8 = torch.tensor([0x7F, 0xFF, 0x01], dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert same_floats(f8, torch.tensor([0xFF, 0x7F, 0x01], dtype=torch.uint8).view(torch.float8_e4m3fn))
