"""quantize_and_insert_k_cache (vLLM's call form) and the records it writes: V40_584, and V41_528 with
vLLM's ``bytes_per_token=528``, in vLLM's page-split pages or (``kv_layout="interleaved"``) FlashMLA's.

CPU: the record layout and round trip, every cache view vLLM holds (the same bytes through each),
vLLM's positional and keyword forms, padding slots, bad input rejected before any write, and a property
test over random slot mappings with padding and garbage. The expected bytes are placed by hand from
``layout.token_byte_offsets`` (independent of the writer's indexing). GPU: the HIP kernel writes the
reference's bytes exactly, on poisoned caches, for both records and both layouts.
"""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from dsv4_rocm import layout as L
from dsv4_rocm import ops
from dsv4_rocm.reference import cache as rc
from dsv4_rocm.reference.quant import ue8m0_qdq
from helpers import every_cache_view, page_records, random_k

VIEWS = sorted(every_cache_view(1, 2))


def expected_pages(before: torch.Tensor, k, slots, bs):
    """``before`` ([nb, bs*584] record bytes) with the records of k written at the valid slots, placed one by
    one from layout.token_byte_offsets; also the mask of bytes written."""
    after, written = before.clone(), torch.zeros_like(before, dtype=torch.bool)
    flat, wflat = after.view(-1), written.view(-1)
    rec = rc.encode_k_records(k[:len(slots)])
    used = bs * L.TOKEN_BYTES
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        d, sc = L.token_byte_offsets(s, bs)
        blk = s // bs                                # offsets of layout are for padded pages: rebase on `used`
        d, sc = d - blk * L.page_bytes(bs) + blk * used, sc - blk * L.page_bytes(bs) + blk * used
        flat[d:d + 576], flat[sc:sc + 8] = rec[t, :576], rec[t, 576:]
        wflat[d:d + 576], wflat[sc:sc + 8] = True, True
    return after, written


def test_record_layout_bytes_and_round_trip():
    k = random_k(5)
    rec = rc.encode_k_records(k)
    assert rec.shape == (5, 584) and (rec[:, 583] == 0).all()
    assert torch.equal(rec[:, 448:576].contiguous().view(torch.bfloat16), k[:, 448:])
    dec = rc.decode_k_records(rec)
    torch.testing.assert_close(dec[:, :448], ue8m0_qdq(k[:, :448].float(), 64, 1e-4), rtol=0, atol=0)
    assert torch.equal(dec[:, 448:], k[:, 448:].float())
    assert not bool((rec[:, :448] == 0x80).any())


def test_non_finite_block_is_poisoned():
    k = random_k(2).float()
    k[0, 70], k[1, 447] = float("nan"), float("inf")
    rec = rc.encode_k_records(k.bfloat16())
    assert int(rec[0, 577]) == 0xFF and (rec[0, 64:128] == 0x7F).all() and int(rec[0, 576]) != 0xFF
    assert int(rec[1, 582]) == 0xFF and (rec[1, 384:448] == 0x7F).all()


@pytest.mark.parametrize("view", VIEWS)
@pytest.mark.parametrize("bs", [2, 64])
def test_every_view_gets_the_same_bytes(view, bs):
    nb = 5
    v, backing = every_cache_view(nb, bs, seed=bs)[view]
    before = backing.clone()
    k = random_k(9)
    slots = torch.tensor([3, -1, nb * bs - 1, 0, bs + 2, -7, 2 * bs + 1, 1, bs])     # distinct slots
    ops.quantize_and_insert_k_cache(k, v, slots, bs)                  # vLLM's positional form
    want, _ = expected_pages(page_records(before, bs), k, slots, bs)
    assert torch.equal(page_records(backing, bs), want)
    assert torch.equal(backing[:, bs * 584:], before[:, bs * 584:])   # page padding never touched


def test_vllm_call_forms():
    k = random_k(4)
    slots = torch.tensor([0, 65, -1, 7])
    ref = rc.new_cache(2, 64)
    expected, _ = expected_pages(page_records(ref, 64), k, slots, 64)
    calls = [lambda c: ops.quantize_and_insert_k_cache(k, c, slots),
             lambda c: ops.quantize_and_insert_k_cache(k, c, slots, 64, True),
             lambda c: ops.quantize_and_insert_k_cache(k, c, slots, block_size=64, is_ue8m0=True, use_fnuz=False),
             lambda c: torch.ops.dsv4_rocm.quantize_and_insert_k_cache(k, c, slots, 64)]
    for call in calls:
        c = torch.zeros(2, 64, 584, dtype=torch.uint8)
        assert call(c.view(2, -1)) is None
        assert torch.equal(c.view(2, -1), expected)


def test_only_the_first_len_slot_mapping_tokens_are_written():
    """vLLM under DP padding passes more k rows than slots."""
    c = rc.new_cache(2, 64)
    k = random_k(10)
    ops.quantize_and_insert_k_cache(k, c, torch.tensor([5, 6]), 64)
    want, _ = expected_pages(page_records(rc.new_cache(2, 64), 64), k, torch.tensor([5, 6]), 64)
    assert torch.equal(page_records(c, 64), want)


def test_int32_and_int64_slots_write_the_same_bytes():
    k = random_k(6)
    s = torch.tensor([9, 0, -1, 100, 64, 3])
    a, b = rc.new_cache(2, 64), rc.new_cache(2, 64)
    ops.quantize_and_insert_k_cache(k, a, s, 64)
    ops.quantize_and_insert_k_cache(k, b, s.int(), 64)
    assert torch.equal(a, b) and bool((a != 0).any())


def test_empty_batch_writes_nothing():
    c = torch.randint(0, 256, (2, L.page_bytes(64)), dtype=torch.uint8)
    before = c.clone()
    ops.quantize_and_insert_k_cache(random_k(0), c, torch.zeros(0, dtype=torch.long), 64)
    assert torch.equal(c, before)


def _placed(before, k, slots, bs, fmt):
    """``before`` (a whole cache, page stride L.page_bytes) with the records of k at the valid slots placed
    one by one from layout.token_byte_offsets; and the mask of bytes written."""
    after, written = before.clone(), torch.zeros_like(before, dtype=torch.bool)
    flat, wflat = after.view(-1), written.view(-1)
    rec = rc.encode_k_records(k[:len(slots)], fmt)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            d, sc = L.token_byte_offsets(s, bs, fmt)
            flat[d:d + fmt.data_bytes], flat[sc:sc + fmt.scale_bytes] = rec[t, :fmt.data_bytes], rec[t, fmt.data_bytes:]
            wflat[d:d + fmt.data_bytes], wflat[sc:sc + fmt.scale_bytes] = True, True
    return after, written


@pytest.mark.parametrize("layout", ["page_split", "interleaved"])
@pytest.mark.parametrize("bs", [3, 64])
def test_v41_records_in_vllms_call_forms(bs, layout):
    fmt = L.with_layout(L.V41_528, layout)
    nb = 3
    k = random_k(7)
    slots = torch.tensor([0, 2 * bs + 1, -1, bs, 1, -4, nb * bs - 1])
    base = torch.randint(0, 256, (nb, L.page_bytes(bs, fmt)), generator=torch.Generator().manual_seed(bs),
                         dtype=torch.uint8)
    want, written = _placed(base, k, slots, bs, fmt)
    kw = {} if layout == "interleaved" else dict(kv_layout=layout)        # interleaved: V4.1's default
    view3 = lambda c: torch.as_strided(c, (nb, bs, 528), (c.stride(0), 528, 1))     # noqa: E731  (vLLM's view)
    calls = [lambda c: ops.quantize_and_insert_k_cache(k, view3(c), slots, bs, True, False, 528, **kw),
             lambda c: ops.quantize_and_insert_k_cache(k, c, slots, block_size=bs, bytes_per_token=528, **kw)]
    if layout == "interleaved":         # vLLM's custom-op form writes the default layout
        calls.append(lambda c: torch.ops.dsv4_rocm.quantize_and_insert_k_cache(k, c, slots, bs, True, False, 528))
    for call in calls:
        c = base.clone()
        call(c)
        assert torch.equal(c, want)
    assert int(written.sum()) == 5 * 528


K4 = random_k(4)
BAD = [
    (lambda c: ops.quantize_and_insert_k_cache(K4, c, torch.arange(2), 64, bytes_per_token=288), "bytes_per_token"),
    (lambda c: ops.quantize_and_insert_k_cache(K4, c, torch.arange(2), 64, bytes_per_token=600), "bytes_per_token"),
    (lambda c: ops.quantize_and_insert_k_cache(K4, c.view(2, -1)[:, :64 * 584].view(2, 64, 584), torch.arange(2),
                                               64, bytes_per_token=528), "records of 584 B, but bytes_per_token"),
    (lambda c: ops.quantize_and_insert_k_cache(K4, c, torch.arange(2), 64, bytes_per_token=528), "V41_528 cache"),
    (lambda c: ops.quantize_and_insert_k_cache(K4, c, torch.arange(2), 64, kv_layout="interleaved"),
     "page-split only"),
    (lambda c: ops.quantize_and_insert_k_cache(K4, c, torch.tensor([0, 128])), "slot_mapping: slot 128 is outside"),
    (lambda c: ops.quantize_and_insert_k_cache(K4, c, torch.arange(5)), "slot_mapping has 5 entries"),
    (lambda c: ops.quantize_and_insert_k_cache(K4.float(), c, torch.arange(2)), "k must have dtype"),
    (lambda c: ops.quantize_and_insert_k_cache(K4[:, :448], c, torch.arange(2)), "k must have shape"),
    (lambda c: ops.quantize_and_insert_k_cache(K4, c, torch.arange(2), 0), "block_size"),
    (lambda c: ops.quantize_and_insert_k_cache(K4, c, torch.arange(2), 32), "k_cache"),
    (lambda c: ops.quantize_and_insert_k_cache(K4, c[:, :-8], torch.arange(2)), "k_cache"),
    (lambda c: ops.quantize_and_insert_k_cache(K4, c, torch.arange(2).float()), "slot_mapping must have dtype"),
    (lambda c: ops.quantize_and_insert_k_cache(K4, c, torch.arange(2).view(1, 2)), "slot_mapping must be 1-D"),
    (lambda c: ops.quantize_and_insert_k_cache(K4, c, torch.arange(2), 64, False), "is_ue8m0"),
]


@pytest.mark.parametrize("call, match", BAD)
def test_bad_input_is_rejected_before_any_write(call, match):
    c = torch.randint(0, 256, (2, L.page_bytes(64)), dtype=torch.uint8)
    before = c.clone()
    with pytest.raises(ValueError, match=match):
        call(c)
    assert torch.equal(c, before)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_property_random_slot_mappings(data):
    """Random batches with padding (-1 and other negatives) and, sometimes, a garbage slot past the cache:
    a valid call changes exactly the bytes of its slots' records; a rejected call changes no byte."""
    bs = data.draw(st.sampled_from([2, 3, 64]))
    nb = data.draw(st.integers(1, 4))
    view = data.draw(st.sampled_from(VIEWS))
    n = data.draw(st.integers(0, min(12, nb * bs)))
    valid = data.draw(st.lists(st.integers(0, nb * bs - 1), min_size=n, max_size=n, unique=True))
    slots = [s if data.draw(st.booleans()) or s % 3 else -data.draw(st.integers(1, 1000)) for s in valid]
    garbage = data.draw(st.booleans()) and n > 0
    if garbage:
        slots[data.draw(st.integers(0, n - 1))] = nb * bs + data.draw(st.integers(0, 10 ** 6))
    extra_rows = data.draw(st.integers(0, 3))
    v, backing = every_cache_view(nb, bs, seed=n)[view]
    if view.startswith("unpadded") and (bs * 584) % 16:
        v, backing = every_cache_view(nb, bs, seed=n)["padded_2d"]
    before = backing.clone()
    k = random_k(n + extra_rows)
    s = torch.tensor(slots, dtype=torch.long)
    if garbage:
        with pytest.raises(ValueError, match="slot_mapping"):
            ops.quantize_and_insert_k_cache(k, v, s, bs)
        assert torch.equal(backing, before)
        return
    ops.quantize_and_insert_k_cache(k, v, s, bs)
    want, written = expected_pages(page_records(before, bs), k, s, bs)
    assert torch.equal(page_records(backing, bs), want)
    assert torch.equal(page_records(backing, bs)[~written], page_records(before, bs)[~written])
    assert torch.equal(backing[:, bs * 584:], before[:, bs * 584:])


# ---- GPU ------------------------------------------------------------------------------------------------
def _k(n, seed, device):
    """bf16 [n, 512] over a wide exponent range, with all-zero, -0 and below-eps blocks."""
    g = torch.Generator().manual_seed(seed)
    blk = torch.exp2(torch.randint(-20, 12, (n, 8), generator=g).float()).repeat_interleave(64, 1)
    k = torch.randn(n, 512, generator=g) * blk
    k[::7, :64] = 0.0
    k[1::11, 64:128] = -0.0
    k[2::13, 128:192] *= 1e-6
    return k.bfloat16().to(device)


def _slots(n, bs, nb, seed, device, garbage=False):
    """n distinct slots, 10% padding (-1 or another negative), and with garbage some past the cache."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randperm(nb * bs, generator=g)[:n]
    r = torch.rand(n, generator=g)
    s[r < 0.05] = -1
    s[(r >= 0.05) & (r < 0.1)] = -3
    if garbage:
        s[(r >= 0.1) & (r < 0.15)] += nb * bs
    return s.to(device)


def _hip(name):
    assert ops.backend_for(name, "cuda") == "hip"
    return ops.implementation(name, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("bs, n", [(64, 1), (64, 4097), (2, 300), (3, 100), (256, 20000)])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_gpu_kernel_writes_the_reference_bytes(bs, n, slot_dtype, gpu):
    nb = (n + bs - 1) // bs + 3
    k = _k(n, bs + n, gpu)
    slots = _slots(n, bs, nb, n, gpu, garbage=True).to(slot_dtype)     # garbage: the kernel must skip it
    cache = torch.full((nb, L.page_bytes(bs)), 0xAB, dtype=torch.uint8, device=gpu)
    ref = cache.clone()
    _hip("quantize_and_insert_k_cache")(k, cache, slots, bs)
    rc.quantize_and_insert_k_cache(k, ref, slots, bs)
    print(f"bs={bs} n={n}: differing bytes {int((cache != ref).sum())}")
    assert torch.equal(cache, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("view", VIEWS)
def test_gpu_every_view(view, gpu):
    v, backing = every_cache_view(6, 64, seed=3, device=gpu)[view]
    ref_v, ref_backing = every_cache_view(6, 64, seed=3, device=gpu)[view]
    k, s = _k(300, 1, gpu), _slots(300, 64, 6, 2, gpu)
    ops.quantize_and_insert_k_cache(k, v, s)
    rc.quantize_and_insert_k_cache(k, ref_v, s, 64)
    assert torch.equal(backing, ref_backing)


@pytest.mark.gpu
def test_gpu_non_finite_blocks_poisoned_like_reference(gpu):
    k = _k(64, 3, gpu).float()
    k[0, 5], k[1, 100], k[2, 448] = float("nan"), float("inf"), float("-inf")
    k = k.bfloat16()
    cache = torch.full((1, L.page_bytes(64)), 0xAB, dtype=torch.uint8, device=gpu)
    ref = cache.clone()
    slots = torch.arange(64, device=gpu)
    _hip("quantize_and_insert_k_cache")(k, cache, slots, 64)
    rc.quantize_and_insert_k_cache(k, ref, slots, 64)
    assert torch.equal(cache, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["page_split", "interleaved"])
@pytest.mark.parametrize("bs, n", [(64, 1), (64, 4097), (3, 100), (256, 9000)])
def test_gpu_v41_kernel_writes_the_reference_bytes(bs, n, layout, gpu):
    fmt = L.with_layout(L.V41_528, layout)
    nb = (n + bs - 1) // bs + 3
    g = torch.Generator().manual_seed(n)
    k = (torch.randn(n, 512, generator=g) * torch.exp2(torch.randint(-24, 10, (n, 16), generator=g).float())
         .repeat_interleave(32, 1)).bfloat16()
    k[::9, :32] = 0.0
    k[1::11, 32:64] = -0.0
    k[2::13, 64] = float("nan")
    k[3::17, 100] = float("-inf")
    k = k.to(gpu)
    slots = _slots(n, bs, nb, n, gpu, garbage=True)
    cache = torch.full((nb, L.page_bytes(bs, fmt)), 0xAB, dtype=torch.uint8, device=gpu)
    ref = cache.clone()
    _hip("quantize_and_insert_k_cache")(k, cache, slots, bs, fmt)
    rc.quantize_and_insert_k_cache(k, ref, slots, bs, fmt)
    print(f"{fmt.name} {layout} bs={bs} n={n}: differing bytes {int((cache != ref).sum())}")
    assert torch.equal(cache, ref)


@pytest.mark.gpu
def test_gpu_values_are_checked_only_under_full_validation(gpu):
    k = _k(4, 1, gpu)
    cache = torch.zeros(1, L.page_bytes(64), dtype=torch.uint8, device=gpu)
    with ops.validation("full"), pytest.raises(ValueError, match="outside the cache"):
        ops.quantize_and_insert_k_cache(k, cache, torch.tensor([64], device=gpu), 64)
    assert not bool(cache.any())
    ops.quantize_and_insert_k_cache(k, cache, torch.tensor([0, 64, -1, 3], device=gpu), 64)   # 64: skipped
    ref = torch.zeros_like(cache)
    rc.quantize_and_insert_k_cache(k, ref, torch.tensor([0, -1, -1, 3], device=gpu), 64)
    assert torch.equal(cache, ref)
