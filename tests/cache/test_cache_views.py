"""cache_views: every view of a paged cache an engine holds is accepted and reduced to the same page bytes
(page stride = stride(0)); views that are not a cache are rejected with the argument named."""
import pytest
import torch

from dsv4_rocm import cache_views as V
from dsv4_rocm import layout as L
from dsv4_rocm.reference import cache as rc
from helpers import every_cache_view, page_records

VIEWS = sorted(every_cache_view(1, 2))
FORMATS = {"fp8_ds_mla": V.FP8_DS_MLA, "indexer_k": V.INDEXER_K}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("view", VIEWS)
@pytest.mark.parametrize("bs", [2, 3, 64])
def test_every_view_gives_the_page_records_in_place(view, bs, fmt):
    f = FORMATS[fmt]
    nb = 4
    v, backing = every_cache_view(nb, bs, f.token_bytes, seed=bs)[view]
    if view.startswith("unpadded") and (bs * f.token_bytes) % V.ALIGN:
        with pytest.raises(ValueError, match="multiple of 16"):     # no engine allocates such pages
            V.pages(v, bs, "k_cache", f)
        return
    p = V.pages(v, bs, "k_cache", f)
    assert p.dtype == torch.uint8 and p.shape == (nb, bs * f.token_bytes)
    assert p.stride(0) == backing.stride(0) and p.data_ptr() == backing.data_ptr()      # the same memory
    assert torch.equal(p, page_records(backing, bs, f.token_bytes))
    flat = V.flat_bytes(p)
    assert flat.numel() == (nb - 1) * backing.stride(0) + bs * f.token_bytes


def test_record_byte_index_matches_layout():
    bs, stride = 64, L.page_bytes(64)
    data, scale = V.record_byte_index(torch.tensor([0, 70, 191]), bs, stride)
    for row, slot in enumerate([0, 70, 191]):
        d, s = L.token_byte_offsets(slot, bs)
        assert int(data[row, 0]) == d and int(scale[row, 0]) == s
        assert data.shape[1] == 576 and scale.shape[1] == 8


@pytest.mark.parametrize("bad, match", [
    (lambda: torch.zeros(2, 64 * 584 - 8, dtype=torch.uint8), "2-D V40_584 cache must be"),
    (lambda: torch.zeros(2, 64, 583, dtype=torch.uint8), "3-D V40_584 cache must be"),
    (lambda: torch.zeros(2, 32, 1, 584, dtype=torch.uint8), r"4-D V40_584 cache must be \[nb, 64, 1, 584\]"),
    (lambda: torch.zeros(2, 64, 584, dtype=torch.int8), "dtype"),
    (lambda: torch.zeros(2, 64, 584).bfloat16(), "dtype"),
    (lambda: torch.zeros(584, dtype=torch.uint8), "2-D, 3-D or 4-D"),
    (lambda: torch.zeros(2, 584, 64, dtype=torch.uint8).transpose(1, 2), "dense"),
    (lambda: torch.zeros(3, 64 * 584, dtype=torch.uint8)[::2, :].as_strided((2, 64 * 584), (100, 1)),
     "smaller than"),
    (lambda: torch.zeros(2 * 37448, dtype=torch.uint8).as_strided((2, 64 * 584), (37448, 1)), "multiple of 16"),
    (lambda: torch.zeros(2 * 37440 + 8, dtype=torch.uint8).as_strided((2, 64 * 584), (37440, 1), 8), "start"),
    (lambda: [0], "torch.Tensor"),
])
def test_non_cache_views_are_rejected(bad, match):
    with pytest.raises(ValueError, match=match):
        V.pages(bad(), 64)


def test_block_size_is_checked():
    for b in (0, -64, 64.0, True):
        with pytest.raises(ValueError, match="block_size"):
            V.pages(rc.new_cache(1, 64), b)


def test_flash_mla_alignment_stays_with_as_pages():
    """FlashMLA's 4-D view also needs 576-B pages (the attention ops' rule), the cache ops do not."""
    v = torch.zeros(3, 64, 1, 584, dtype=torch.uint8)
    assert V.pages(v, 64).stride(0) == 64 * 584
    with pytest.raises(ValueError, match="576"):
        rc.as_pages(v, 64)
    assert rc.as_pages(rc.flash_mla_view(rc.new_cache(3, 64), 64), 64).stride(0) == 37440


@pytest.mark.parametrize("view", VIEWS)
def test_indexer_cache_round_trip_on_every_view(view):
    v, backing = every_cache_view(2, 64, record=132, seed=5)[view]
    before = backing.clone()
    q = torch.randint(0, 0x7E, (3, 128), dtype=torch.uint8)
    s = torch.tensor([0.5, 2.0 ** -10, 8.0])
    rc.indexer_k_insert(q, s, v, torch.tensor([70, -1, 1]), 64)
    gq, gs = rc.indexer_k_gather(v, torch.tensor([70, 1, -1, 500]), 64)
    assert torch.equal(gq[0], q[0]) and torch.equal(gq[1], q[2]) and float(gs[0]) == 0.5 and float(gs[1]) == 8.0
    assert (gq[2:] == 0).all() and (gs[2:] == 0).all()                # padding and past-the-cache: zeros
    rec = page_records(backing, 64, 132)
    assert torch.equal(rec[1, 6 * 128:7 * 128], q[0]) and torch.equal(rec[1, 64 * 128 + 24:64 * 128 + 28],
                                                                       s[:1].view(torch.uint8))
    changed = (rec != page_records(before, 64, 132)).nonzero()[:, 1]
    assert bool(((changed // 128 == 6) | (changed // 128 == 1) | (changed >= 64 * 128)).all())
    assert torch.equal(backing[:, 64 * 132:], before[:, 64 * 132:])
