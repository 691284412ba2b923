"""Index metadata ops (DSV4_SPEC §9) on hand-built block tables: exact integer outputs."""
import torch

from dsv4_rocm import ops
from dsv4_rocm.reference import metadata as M

BT = torch.tensor([[7, 2, 9], [4, 0, 5]], dtype=torch.int32)   # request -> physical pages


def test_token_to_req_and_slot_mapping():
    t2r = M.token_to_req_indices(torch.tensor([0, 3, 3, 5]))
    assert t2r.tolist() == [0, 0, 0, 2, 2]
    s = M.slot_mapping_from_block_table(torch.tensor([0, 63, 64]), torch.tensor([1, 1, 1]), BT, 64)
    assert s.tolist() == [4 * 64, 4 * 64 + 63, 0 * 64 + 0]


def test_compressed_slot_mapping():
    pos = torch.tensor([3, 4, 7, 255, 259, 127, 255])
    t2r = torch.tensor([0, 0, 0, 0, 0, 1, 1])
    s = ops.get_compressed_slot_mapping(pos, t2r, BT, 4, 64)
    # C4: entry j = p // 4 at page bt[j // 64], offset j % 64; only (p+1) % 4 == 0 tokens
    assert s.tolist() == [7 * 64 + 0, -1, 7 * 64 + 1, 7 * 64 + 63, 2 * 64 + 0, 4 * 64 + 31, 4 * 64 + 63]
    s = ops.get_compressed_slot_mapping(pos, t2r, BT, 128, 2)
    assert s.tolist() == [-1, -1, -1, 7 * 2 + 1, -1, 4 * 2 + 0, 4 * 2 + 1]
    s = ops.get_compressed_slot_mapping(pos, t2r, BT, 4, 64, slot_mapping=torch.tensor([1, 1, -1, 1, 1, 1, 1]))
    assert s[2] == -1


def test_swa_indices_and_lens():
    pos = torch.tensor([0, 5, 70])
    t2r = torch.tensor([0, 1, 1])
    idx, lens = ops.compute_swa_indices_and_lens(pos, t2r, BT, torch.tensor([1, 1, 1]), 4, 64)
    assert lens.tolist() == [1, 4, 4]
    assert idx.tolist() == [[7 * 64, -1, -1, -1],
                            [4 * 64 + 2, 4 * 64 + 3, 4 * 64 + 4, 4 * 64 + 5],
                            [0 * 64 + 3, 0 * 64 + 4, 0 * 64 + 5, 0 * 64 + 6]]      # positions 67..70, page 0
    idx, lens = ops.compute_swa_indices_and_lens(pos, t2r, BT, torch.tensor([1, -1, 1]), 128, 64)
    assert lens.tolist() == [1, 0, 71] and (idx[1] == -1).all()
    assert idx[2, :71].tolist() == [4 * 64 + q for q in range(64)] + [q for q in range(7)]


def test_global_topk_indices():
    loc = torch.tensor([[0, 65, -1, 3], [130, -1, -1, -1]], dtype=torch.int32)
    g, lens = ops.compute_global_topk_indices_and_lens(loc, torch.tensor([0, 1]), BT, 64,
                                                       torch.tensor([True, False]))
    assert g.tolist() == [[7 * 64, 2 * 64 + 1, -1, 7 * 64 + 3], [5 * 64 + 2, -1, -1, -1]]
    assert lens.tolist() == [3, 0]


def test_c128_metadata():
    pos = torch.tensor([126, 127, 300, 300])
    t2r = torch.tensor([0, 0, 1, 1])
    idx, lens = ops.build_c128a_topk_metadata(pos, t2r, BT, torch.tensor([1, 1, 1, -1]),
                                              torch.tensor([True, True, True, False]), 1000, 2, 128)
    assert idx.shape == (4, 128)        # Kmax = round_up(ceil(1000 / 128), 128)
    assert lens.tolist() == [0, 1, 2, 0]
    assert idx[1, :2].tolist() == [7 * 2, -1]
    assert idx[2, :3].tolist() == [4 * 2, 4 * 2 + 1, -1]
    assert idx[3, :3].tolist() == [0, 1, -1]      # prefill token: local indices
    assert M.c128_max_entries(1048576) == 8192


def test_combine_topk_swa_indices():
    # request 0 (chunk index 0): seq_len 10, gather_len 6 -> gathered positions 4..9 at rows N..N+5
    # request 1 (chunk index 1): seq_len 3, prefix 0 -> positions 0..2
    N, Mrows, W = 8, 20, 4
    loc = torch.tensor([[1, 0, -1], [5, 2, 7], [0, -1, -1]], dtype=torch.int32)
    tl = torch.tensor([2, 3, 0])
    pos = torch.tensor([8, 9, 2])
    rq = torch.tensor([0, 0, 1])
    gs = torch.tensor([4, 0])
    idx, lens = ops.combine_topk_swa_indices(loc, tl, pos, rq, gs, N, Mrows, W)
    assert idx.shape == (3, 128) and lens.tolist() == [6, 7, 3]
    assert idx[0, :6].tolist() == [1, 0, N + 1, N + 2, N + 3, N + 4]       # positions 5..8
    assert idx[1, :7].tolist() == [5, 2, 7, N + 2, N + 3, N + 4, N + 5]    # positions 6..9
    assert idx[2, :3].tolist() == [Mrows + N + 0, Mrows + N + 1, Mrows + N + 2]
    assert (idx[0, 6:] == -1).all() and (idx[2, 3:] == -1).all()
    assert M.prefill_gather_lens(torch.tensor([6, 3]), torch.tensor([10, 3]), 128).tolist() == [10, 3]


def test_metadata_ops_reject_mixed_devices():
    import pytest
    meta = torch.empty(7, device="meta")
    with pytest.raises(ValueError, match="different devices"):
        ops.build_c128a_topk_metadata(torch.tensor([1]), torch.tensor([0]), BT, torch.tensor([1]),
                                      meta.bool()[:1], 100)
