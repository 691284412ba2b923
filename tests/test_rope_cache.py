"""RoPE (DSV4_SPEC §2.2) and the fp8_ds_mla cache records, insert and gather (§4)."""
import math

import pytest
import torch

from dsv4_rocm import layout as L
from dsv4_rocm import ops
from dsv4_rocm.reference import cache as rc
from dsv4_rocm.reference import rope
from dsv4_rocm.reference.quant import ue8m0_qdq
from helpers import random_k


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


def test_record_layout_bytes_and_round_trip():
    k = random_k(5)
    rec = rc.encode_k_records(k)
    assert rec.shape == (5, 584) and (rec[:, 583] == 0).all()
    assert torch.equal(rec[:, 448:576].contiguous().view(torch.bfloat16), k[:, 448:])
    dec = rc.decode_k_records(rec)
    torch.testing.assert_close(dec[:, :448], ue8m0_qdq(k[:, :448].float(), 64, 1e-4), rtol=0, atol=0)
    assert torch.equal(dec[:, 448:], k[:, 448:].float())
    assert not bool((rec[:, :448] == 0x80).any())


@pytest.mark.parametrize("bs", [2, 3, 64, 256])
def test_insert_gather_paging(bs):
    nb = 5
    pages = torch.randint(0, 256, (nb, L.page_bytes(bs)), dtype=torch.uint8)   # garbage everywhere
    before = pages.clone()
    k = random_k(7)
    slots = torch.tensor([3, -1, nb * bs - 1, 0, bs + 2, -5, 2 * bs + 1])   # distinct slots
    ops.quantize_and_insert_k_cache(k, pages, slots, bs)
    rec = rc.encode_k_records(k)
    written = torch.zeros_like(pages, dtype=torch.bool)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        blk, off = divmod(s, bs)
        assert torch.equal(pages[blk, off * 576:(off + 1) * 576], rec[t, :576])
        assert torch.equal(pages[blk, bs * 576 + off * 8: bs * 576 + off * 8 + 8], rec[t, 576:])
        written[blk, off * 576:(off + 1) * 576] = True
        written[blk, bs * 576 + off * 8: bs * 576 + off * 8 + 8] = True
    assert torch.equal(pages[~written], before[~written])          # nothing else touched (padding included)
    g = ops.dequantize_and_gather_k_cache(pages, slots, bs)
    valid = slots >= 0
    assert torch.equal(g[valid].float(), rc.decode_k_records(rec)[valid])
    assert torch.equal(g[~valid], torch.zeros_like(g[~valid]))


def test_only_len_slot_mapping_tokens_are_written_and_bad_slots_rejected():
    pages = rc.new_cache(2, 64)
    k = random_k(10)
    ops.quantize_and_insert_k_cache(k, pages, torch.tensor([5, 6]), 64)
    assert (pages.view(2, -1)[:, 7 * 576:64 * 576] == 0).all()
    with pytest.raises(ValueError, match="outside the cache"):
        ops.quantize_and_insert_k_cache(k, pages, torch.tensor([128]), 64)
    with pytest.raises(ValueError, match="slot_mapping has 11 entries"):
        ops.quantize_and_insert_k_cache(k, pages, torch.arange(11), 64)
    with pytest.raises(ValueError, match="k must have dtype"):
        ops.quantize_and_insert_k_cache(k.float(), pages, torch.tensor([1]), 64)
    with pytest.raises(ValueError, match="pages of 37440"):
        ops.quantize_and_insert_k_cache(k, pages[:, :-1], torch.tensor([1]), 64)
    with pytest.raises(ValueError, match="block_size"):
        ops.quantize_and_insert_k_cache(k, pages, torch.tensor([1]), 0)


def test_flash_mla_view_shares_pages():
    pages = rc.new_cache(3, 64)
    v = rc.flash_mla_view(pages, 64)
    assert v.shape == (3, 64, 1, 584) and v.stride(0) == 37440
    assert rc.as_pages(v, 64).data_ptr() == pages.data_ptr()
    with pytest.raises(ValueError, match="576"):
        rc.as_pages(torch.zeros(3, 64, 1, 584, dtype=torch.uint8), 64)


def test_indexer_cache_round_trip():
    cache = rc.new_cache(2, 64, indexer=True)
    assert cache.shape == (2, 8640)
    q = torch.randint(0, 0x7E, (3, 128), dtype=torch.uint8)
    s = torch.tensor([0.5, 2.0 ** -10, 8.0])
    rc.indexer_k_insert(q, s, cache, torch.tensor([70, -1, 1]), 64)
    gq, gs = rc.indexer_k_gather(cache, torch.tensor([70, 1, 5, -1]), 64)
    assert torch.equal(gq[0], q[0]) and torch.equal(gq[1], q[2]) and float(gs[0]) == 0.5 and float(gs[1]) == 8.0
    assert (gq[3] == 0).all() and float(gs[3]) == 0
    assert torch.equal(cache[1, 6 * 128:7 * 128], q[0]) and torch.equal(cache[1, 64 * 128 + 24:64 * 128 + 28],
                                                                         s[:1].view(torch.uint8))
