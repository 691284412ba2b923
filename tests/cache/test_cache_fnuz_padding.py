"""use_fnuz=True with vLLM's DP padding: vLLM's data-parallel padding hands quantize_and_insert_k_cache more k
rows than slot_mapping covers (and slot -1 rows), and the prefill gather padding requests (sequence length
0, block-table rows of -1). The FNUZ flavour must skip them exactly where the OCP flavour does.

The expected bytes are vLLM's FNUZ rule written out on its own (``test_cache_fnuz.vllm_fnuz_records``), not
the reference's code path. CPU: the public op and torch.ops.dsv4_rocm's (the reference) against that rule,
the OCP path's records at the same slots, the gather of a padded batch in both flavours. GPU: the HIP
writer against the reference with padding rows holding NaN (which would poison any record they reached).
"""
import pytest
import torch

from dsv4_rocm import layout as L
from dsv4_rocm import ops
from dsv4_rocm.reference import cache as rc
from helpers import page_records, random_k
from test_cache_fnuz import _wide_k, hand_decode_fnuz, insert_and_gather_both_flavours, place, vllm_fnuz_records


@pytest.mark.parametrize("call", ["op", "library"])
def test_dp_padding_rows_are_skipped_as_on_the_ocp_path(call):
    """vLLM's DP padding: k has more rows than slot_mapping covers, and slot -1 rows. Only the first
    len(slot_mapping) rows with a slot >= 0 are written, each at its own slot (FNUZ bytes of that row), the
    rest of the cache keeps its bytes; the OCP path writes the same records but for the scale bytes."""
    bs, nb = 16, 3
    k = random_k(13)
    k[9:] = float("nan")                            # padding rows past slot_mapping: never read
    slots = torch.tensor([5, -1, 40, 0, -1, 17, 33, 2, -1])
    write = {"op": ops.quantize_and_insert_k_cache, "library": torch.ops.dsv4_rocm.quantize_and_insert_k_cache}[call]
    caches = {}
    for flavour in (True, False):
        cache = torch.randint(0, 256, (nb, L.page_bytes(bs)), dtype=torch.uint8,
                              generator=torch.Generator().manual_seed(3))
        before = cache.clone()
        write(k, cache, slots, bs, True, use_fnuz=flavour)
        caches[flavour] = (before, cache)
    before, fnuz = caches[True]
    want = place(page_records(before, bs), vllm_fnuz_records(k[:9]), slots, bs)
    assert torch.equal(page_records(fnuz, bs), want)
    assert torch.equal(fnuz[:, bs * 584:], before[:, bs * 584:])
    _, ocp = caches[False]
    assert torch.equal(page_records(ocp, bs), place(page_records(before, bs), rc.encode_k_records(k[:9]), slots, bs))
    differ = (ocp != fnuz).nonzero()[:, 1] % L.page_bytes(bs)
    assert differ.numel() and bool((differ >= bs * 576).all())      # the flavours differ in scale bytes only


def test_gather_of_a_padded_batch_reads_fnuz_like_ocp():
    """The prefill gather of a batch with DP padding requests (sequence length 0, block-table rows of -1)
    and rows past the gathered ones: use_fnuz=True reads the FNUZ cache into the same bf16 rows as the OCP
    path reads the OCP cache of the same K, and writes nothing else."""
    bs, seq, gls = 16, [35, 0, 9, 0], [20, 0, 9, 0]
    bt = torch.tensor([[4, 0, 2], [-1, -1, -1], [5, -1, -1], [-1, -1, -1]], dtype=torch.int32)
    k = random_k(44)
    slots = torch.cat([bt[r, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
                       for r, n in enumerate(seq) if n])
    slots = torch.cat([slots, torch.full((4,), -1)])          # padding tokens of the step
    k = torch.cat([k, random_k(6)])                            # and rows past slot_mapping
    rows = insert_and_gather_both_flavours(k, slots, seq, gls, bt, bs, 1)
    assert torch.equal(rows[True].view(torch.int16), rows[False].view(torch.int16))
    got = rows[True]
    assert got[1].isnan().all() and got[3].isnan().all() and got[:, 0].isnan().all()
    assert not got[0, 1:21].isnan().any() and got[0, 21:].isnan().all() and not got[2, 1:10].isnan().any()
    want = hand_decode_fnuz(vllm_fnuz_records(k[15:35])).bfloat16()
    assert torch.equal(got[0, 1:21].view(torch.int16), want.view(torch.int16))


@pytest.mark.gpu
def test_gpu_kernel_skips_dp_padding_rows_as_the_reference(gpu):
    """k with more rows than slot_mapping (DP padding) and slot -1 rows, FNUZ flavour: the HIP writer's
    bytes are the reference's (the padding rows hold NaN, which would poison any record they reached)."""
    bs, nb, n = 64, 40, 2000
    g = torch.Generator().manual_seed(7)
    slots = torch.randperm(nb * bs, generator=g)[:n]
    slots[torch.rand(n, generator=g) < 0.2] = -1
    k = _wide_k(n + 300, 11, "cpu")
    k[n:] = float("nan")
    cache = torch.full((nb, L.page_bytes(bs)), 0xAB, dtype=torch.uint8)
    ref = cache.clone()
    ops.quantize_and_insert_k_cache(k, ref, slots, bs, use_fnuz=True)            # CPU: the reference
    cache = cache.to(gpu)
    ops.quantize_and_insert_k_cache(k.to(gpu), cache, slots.to(gpu), bs, use_fnuz=True)
    assert torch.equal(cache.cpu(), ref)
