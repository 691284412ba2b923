"""The per-step index sets of DeepSeek-V4.1's compressed layers (v41_step_index_sets): the oracle against
the sets written out by hand and against vLLM's get_compressed_slot_mapping, garbage requests, positions
and pages; the Triton kernel equals the oracle exactly under the interpreter and on a GPU."""
import pytest
import torch

from dsv4_rocm import ops
from dsv4_rocm.reference import metadata_v41 as rm
from helpers import patch_interpreter_scalars, run_file_interpreted
from inputs_v41 import batch


def _outs(T, device="cpu"):
    i64 = dict(dtype=torch.int64, device=device)
    return ((torch.full((T,), 99, **i64), torch.full((T,), 99, dtype=torch.int32, device=device)),
            (torch.full((T,), 99, **i64), torch.full((T,), 99, dtype=torch.int32, device=device),
             torch.full((T,), 99, **i64)))


def test_oracle_by_hand_and_against_get_compressed_slot_mapping():
    starts, lens = [0, 130, 7], [5, 3, 200]
    qsl, pos, t2r, _ = batch(starts, lens)
    seq = torch.tensor([s + n for s, n in zip(starts, lens)], dtype=torch.int32)
    cbt = torch.tensor([[4, 0, 6, 8], [2, 9, 3, 10], [7, 1, 5, 11]], dtype=torch.int32)
    sbt = torch.tensor([[3], [5], [-1]], dtype=torch.int32)
    valid = torch.ones(pos.shape[0], dtype=torch.bool)
    valid[2] = False
    r1, r2 = _outs(pos.shape[0])
    ops.v41_step_index_sets(pos, t2r, valid, cbt, sbt, 64, 8, r1, r2)
    for t in range(pos.shape[0]):
        p, b = int(pos[t]), int(t2r[t])
        if not valid[t]:
            assert [int(v[t]) for v in (*r1, *r2)] == [-1, 0, -1, 0, -1]
            continue
        assert int(r1[1][t]) == p + 1 and int(r2[1][t]) == (p + 1) // 2
        assert int(r1[0][t]) == int(cbt[b, p // 64]) * 64 + p % 64
        j = p // 2
        assert int(r2[0][t]) == (int(cbt[b, j // 64]) * 64 + j % 64 if p % 2 else -1)
        assert int(r2[2][t]) == (int(sbt[b, 0]) * 8 + p % 8 if sbt[b, 0] >= 0 else -1)
    for r, out in ((1, r1[0]), (2, r2[0])):        # vLLM's builder gives the same slots
        want = ops.get_compressed_slot_mapping(pos.shape[0], qsl, seq, cbt, 64, r)
        assert torch.equal(torch.where(valid, want, -1), out)


def garbage_case(seed, T=300, R=7):
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(-3, 5000, (T,), generator=g)
    t2r = torch.randint(-2, R + 2, (T,), generator=g).int()
    valid = torch.rand(T, generator=g) < 0.8
    cbt = torch.randint(-2, 50, (R, 40), generator=g).int()
    sbt = torch.randint(-2, 50, (R, 3), generator=g).int()
    return pos, t2r, valid, cbt, sbt


def interpreter_main():
    from dsv4_rocm.triton.metadata.step_index_sets_v41 import step_index_sets_v41 as kernel
    patch_interpreter_scalars()
    bad = 0
    for seed in range(6):
        case = garbage_case(seed)
        a, b = _outs(case[0].shape[0]), _outs(case[0].shape[0])
        rm.v41_step_index_sets(*case, 64, 8, *a)
        kernel(*case, 64, 8, *b)
        bad += sum(int((x != y).sum()) for x, y in zip((*a[0], *a[1]), (*b[0], *b[1])))
        c1, c2 = _outs(case[0].shape[0]), _outs(case[0].shape[0])      # one ratio at a time
        kernel(*case, 16, 4, c1[0], None)
        kernel(*case, 16, 4, None, c2[1])
        rm.v41_step_index_sets(*case, 16, 4, a[0], a[1])
        bad += int((c1[0][0] != a[0][0]).sum()) + int((c2[1][2] != a[1][2]).sum()) + int((c1[1][0] != 99).sum())
    print("entries differing", bad)


def test_kernel_under_the_interpreter():
    r = run_file_interpreted(__file__)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "entries differing 0"


def test_rejected_calls():
    pos, t2r, valid, cbt, sbt = garbage_case(0, T=10)
    r1, r2 = _outs(10)
    with pytest.raises(ValueError, match="token_to_req"):
        ops.v41_step_index_sets(pos, t2r.long(), valid, cbt, sbt, 64, 8, r1, r2)
    with pytest.raises(ValueError, match="r2"):
        ops.v41_step_index_sets(pos, t2r, valid, cbt, sbt, 64, 8, r1, r2[:2])
    with pytest.raises(ValueError, match="state_block_table"):
        ops.v41_step_index_sets(pos, t2r, valid, cbt, sbt[:2], 64, 8, r1, r2)
    assert (r1[0] == 99).all() and (r2[2] == 99).all()


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(4))
def test_kernel_equals_oracle_on_gpu(seed, gpu):
    case = garbage_case(seed, T=5000, R=100)
    a, b = _outs(5000), _outs(5000, gpu)
    ops.v41_step_index_sets(*case, 64, 8, *a)
    ops.v41_step_index_sets(*[t.to(gpu) for t in case], 64, 8, *b)
    for x, y in zip((*a[0], *a[1]), (*b[0], *b[1])):
        assert torch.equal(x, y.cpu())


if __name__ == "__main__":
    interpreter_main()
