"""Top-k of the lightning indexer (§6.3); the indexer's query, logits and cache ops are tested in
test_indexer.py and test_indexer_k_cache.py."""
import pytest
import torch

from dsv4_rocm import ops


def test_top_k_per_row():
    g = torch.Generator().manual_seed(6)
    lg = torch.randn(4, 50, generator=g)
    starts, ends = torch.tensor([0, 10, 0, 45]), torch.tensor([50, 13, 0, 50])
    out = ops.top_k_per_row(lg, starts, ends, 8)
    assert set(out[0].tolist()) == set(torch.topk(lg[0], 8).indices.tolist())
    assert out[1].tolist() == [0, 1, 2] + [-1] * 5          # n <= k: trivial path, relative indices
    assert (out[2] == -1).all()
    assert out[3].tolist() == [0, 1, 2, 3, 4, -1, -1, -1]
    with pytest.raises(ValueError, match="row_starts"):
        ops.top_k_per_row(lg, starts, torch.tensor([50, 13, 0, 51]), 8)
