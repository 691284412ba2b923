"""The candidate blocks a DeepSeek-V4.1 candidate source publishes (select_candidate_blocks): the oracle
against the rule written out by hand (block maxima, the newest block pinned, ties to lower blocks, NaN
ranked above +inf, rows with few blocks), rejected calls; the Triton kernel equals the oracle exactly
under the interpreter and on a GPU (rows of every length, ties, -inf and NaN logits)."""
import pytest
import torch

from dsv4_rocm import ops
from dsv4_rocm.reference import indexer_v41 as ri
from helpers import patch_interpreter_scalars, run_file_interpreted


def _by_hand(row, n, C, bs):
    nb = -(-n // bs)
    if nb <= C:
        return list(range(nb)) + [-1] * (C - nb)
    score = []
    for b in range(nb - 1):
        v = row[b * bs:(b + 1) * bs]
        score.append(float("inf") if torch.isnan(v).any() else float(v.max()))   # NaN ranks first
    nan = [b for b in range(nb - 1) if torch.isnan(row[b * bs:(b + 1) * bs]).any()]
    order = sorted(range(nb - 1), key=lambda b: (-(b in nan), -score[b], b))
    return sorted(order[:C - 1]) + [nb - 1]


def _logits(rows, cols, seed, ties=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    if ties:
        x[:, ::5] = torch.randint(-2, 3, (rows, (cols + 4) // 5), generator=g).float()   # many equal values
        x[0, 3] = float("nan")
        x[1, :40] = float("-inf")
    return x


def test_oracle_is_the_rule_by_hand():
    x = _logits(6, 200, 0)
    lens = torch.tensor([200, 150, 0, 9, 37, 1000], dtype=torch.int32)      # 1000: clamped to the row
    for C, bs in ((5, 4), (12, 8), (3, 1)):
        out = torch.full((6, C), 77, dtype=torch.int32)
        ops.select_candidate_blocks(x, lens, out, bs)
        for r in range(6):
            n = min(int(lens[r]), 200)
            assert out[r].tolist() == _by_hand(x[r], n, C, bs), (C, bs, r)


def test_candidates_cover_every_visible_entry_while_they_fit():
    x = _logits(3, 64, 1)
    out = torch.empty(3, 8, dtype=torch.int32)
    ops.select_candidate_blocks(x, torch.tensor([64, 30, 5], dtype=torch.int32), out, 8)
    assert out.tolist() == [list(range(8)), [0, 1, 2, 3] + [-1] * 4, [0] + [-1] * 7]


def test_rejected_calls():
    x = _logits(2, 50, 2)
    out = torch.zeros(2, 4, dtype=torch.int32)
    for kwargs, match in ((dict(candidate_blocks=out.long()), "candidate_blocks"), (dict(block_size=0), "block_size"),
                          (dict(logits=x.double()), "logits"), (dict(lens=torch.ones(1, dtype=torch.int32)), "lens"),
                          (dict(logits=x[:1]), "rows")):
        args = dict(logits=x, lens=torch.tensor([50, 3], dtype=torch.int32), candidate_blocks=out, block_size=4)
        args.update(kwargs)
        with pytest.raises(ValueError, match=match):
            ops.select_candidate_blocks(**args)
        assert not out.any()


def _cases():
    """(logits, lens, C, block size): short and long rows, ties, -inf, NaN, clamped lengths."""
    out = []
    for seed, (rows, cols, C, bs) in enumerate(((7, 300, 5, 4), (4, 1000, 16, 8), (3, 129, 128, 1), (5, 40, 3, 8))):
        g = torch.Generator().manual_seed(seed)
        lens = torch.randint(0, cols + 20, (rows,), generator=g).int()
        lens[0] = cols
        out.append((_logits(rows, cols, 10 + seed), lens, C, bs))
    return out


def interpreter_main():
    from dsv4_rocm.triton.indexer.select_candidate_blocks import select_candidate_blocks as kernel
    patch_interpreter_scalars()
    bad = 0
    for x, lens, C, bs in _cases():
        a = torch.full((x.shape[0], C), 9, dtype=torch.int32)
        b = a.clone()
        ri.select_candidate_blocks(x, lens, a, bs)
        kernel(x, lens, b, bs)
        bad += int((a != b).sum())
    print("entries differing", bad)


def test_kernel_under_the_interpreter():
    r = run_file_interpreted(__file__)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "entries differing 0"


@pytest.mark.gpu
@pytest.mark.parametrize("rows, cols, C, bs", [(128, 8192, 2048, 8), (64, 65536, 2048, 8), (4, 300000, 2048, 8),
                                                (33, 5000, 100, 4)])
def test_kernel_equals_oracle_on_gpu(rows, cols, C, bs, gpu):
    x = _logits(rows, cols, rows)
    g = torch.Generator().manual_seed(cols)
    lens = torch.randint(0, cols + 1, (rows,), generator=g).int()
    lens[0] = cols
    a = torch.full((rows, C), 9, dtype=torch.int32)
    b = a.clone().to(gpu)
    ops.select_candidate_blocks(x, lens, a, bs)
    ops.select_candidate_blocks(x.to(gpu), lens.to(gpu), b, bs)
    assert torch.equal(b.cpu(), a)


if __name__ == "__main__":
    interpreter_main()
