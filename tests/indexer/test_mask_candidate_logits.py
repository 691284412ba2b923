"""A later DeepSeek-V4.1 index source scores inside the candidate blocks (mask_candidate_logits): the oracle
against the rule by hand (entries outside the candidates -inf, entries past the row's length untouched),
rejected calls (unsorted lists); the Triton kernel equals the oracle bit for bit under the interpreter and
on a GPU."""
import pytest
import torch

from dsv4_rocm import ops
from dsv4_rocm.reference import indexer_v41 as ri
from helpers import patch_interpreter_scalars, run_file_interpreted


def _case(rows, cols, C, bs, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    lens = torch.randint(0, cols + 10, (rows,), generator=g).int()
    lens[0] = cols
    cand = torch.full((rows, C), 5, dtype=torch.int32)
    ri.select_candidate_blocks(x * torch.rand(rows, cols, generator=g), lens, cand, bs)   # another layer's scores
    return x, lens, cand


def test_oracle_is_the_rule_by_hand():
    x, lens, cand = _case(6, 300, 5, 4, 0)
    y = x.clone()
    ops.mask_candidate_logits(y, lens, cand, 4)
    for r in range(6):
        n = min(int(lens[r]), 300)
        keep = {int(b) for b in cand[r] if b >= 0}
        for c in range(300):
            if c >= n or c // 4 in keep:
                assert y[r, c] == x[r, c]
            else:
                assert y[r, c] == float("-inf")
    assert int((y == float("-inf")).sum()) > 100


def test_rejects_lists_that_are_not_ascending():
    x, lens, cand = _case(2, 100, 4, 4, 1)
    y = x.clone()
    bad = cand.clone()
    bad[0] = torch.tensor([3, 1, 7, -1])
    with pytest.raises(ValueError, match="ascending"):
        ops.mask_candidate_logits(y, lens, bad, 4)
    bad[0] = torch.tensor([1, -1, 7, -1])
    with pytest.raises(ValueError, match="ascending"):
        ops.mask_candidate_logits(y, lens, bad, 4)
    assert torch.equal(y, x)


def _cases():
    return [_case(*shape, seed) for seed, shape in enumerate(((7, 300, 5, 4), (3, 2000, 40, 8), (4, 129, 200, 1),
                                                                (2, 64, 8, 8)))]


def interpreter_main():
    from dsv4_rocm.triton.indexer.mask_candidate_logits import mask_candidate_logits as kernel
    patch_interpreter_scalars()
    bad = 0
    for (x, lens, cand), bs in zip(_cases(), (4, 8, 1, 8)):
        a, b = x.clone(), x.clone()
        ri.mask_candidate_logits(a, lens, cand, bs)
        kernel(b, lens, cand, bs)
        bad += int((a.view(torch.int32) != b.view(torch.int32)).sum())
    print("logits differing", bad)


def test_kernel_under_the_interpreter():
    r = run_file_interpreted(__file__)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "logits differing 0"


@pytest.mark.gpu
@pytest.mark.parametrize("rows, cols, C, bs", [(128, 8192, 2048, 8), (64, 65536, 2048, 8), (3, 300000, 2048, 8)])
def test_kernel_equals_oracle_on_gpu(rows, cols, C, bs, gpu):
    x, lens, cand = _case(rows, cols, C, bs, rows)
    a = x.clone()
    b = x.to(gpu)
    ops.mask_candidate_logits(a, lens, cand, bs)
    ops.mask_candidate_logits(b, lens.to(gpu), cand.to(gpu), bs)
    assert torch.equal(b.cpu().view(torch.int32), a.view(torch.int32))


if __name__ == "__main__":
    interpreter_main()
