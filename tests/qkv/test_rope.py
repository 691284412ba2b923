"""RoPE (docs/math.md#rope): the YaRN table and the forward / inverse rotations."""
import pytest
import torch

from dsv4_rocm.reference import rope


@pytest.mark.parametrize("base, low, high", [(10000.0, 20, 33), (160000.0, 15, 25)])
def test_yarn_frequencies(base, low, high):
    inv = rope.yarn_inv_freq(base).double()
    i = torch.arange(32, dtype=torch.float64)
    plain = base ** (-2 * i / 64)
    # below the ramp: original frequencies; above it: divided by the factor 16
    torch.testing.assert_close(inv[:low + 1], plain[:low + 1].to(inv.dtype), rtol=1e-6, atol=0)
    if high < 32:
        torch.testing.assert_close(inv[high:], (plain[high:] / 16).to(inv.dtype), rtol=1e-6, atol=0)
    assert bool((inv[low + 1:min(high, 32)] < plain[low + 1:min(high, 32)]).all())


def test_cos_sin_cache_values():
    cs = rope.build_cos_sin_cache(160000.0, 5000)
    inv = rope.yarn_inv_freq(160000.0).double()
    p = torch.tensor([0, 1, 77, 4999])
    ang = p.double().unsqueeze(1) * inv
    torch.testing.assert_close(cs[p, :32].double(), ang.cos(), atol=5e-4, rtol=0)
    torch.testing.assert_close(cs[p, 32:].double(), ang.sin(), atol=5e-4, rtol=0)


def test_rope_pairs_inverse_and_positions():
    cs = rope.build_cos_sin_cache(10000.0, 2048)
    x = torch.randn(6, 3, 512)
    p = torch.tensor([0, 1, 5, 100, 1000, 2047])
    y = rope.rope_fwd(x, p, cs)
    assert torch.equal(y[..., :448], x[..., :448])
    torch.testing.assert_close(rope.rope_inv(y, p, cs), x, atol=1e-5, rtol=1e-5)
    # GPT-J pairs: (448+2i, 449+2i) rotated by angle p * f_i
    c, s = cs[p[3], 2], cs[p[3], 34]
    e, o = x[3, 0, 452], x[3, 0, 453]
    torch.testing.assert_close(y[3, 0, 452], e * c - o * s)
    torch.testing.assert_close(y[3, 0, 453], e * s + o * c)
    # position 0 is the identity
    torch.testing.assert_close(y[0], x[0])
    # a 128-d indexer head rotates its last 64 dims
    z = torch.randn(2, 128)
    assert torch.equal(rope.rope_fwd(z, p[:2], cs)[:, :64], z[:, :64])
    with pytest.raises(ValueError, match="positions"):
        rope.rope_fwd(x[:1], torch.tensor([2048]), cs)
