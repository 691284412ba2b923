"""ragged_indices_to_dense: a ragged index stream (vLLM's ROCm ``*_ragged_indices`` / ``*_ragged_indptr``) as
dense rows with lengths.

CPU: the reference against a hand loop (rows of every length, empty rows, offsets past the stream,
int32 / int64), value checks rejecting bad offsets and rows wider than the output before any write; the
Triton kernel equal to the reference byte for byte under the interpreter. GPU: the kernel against the
reference on large random streams and garbage offsets.
"""
import pytest
import torch

from dsv4_rocm import ops
from dsv4_rocm.reference import metadata as M
from helpers import patch_interpreter_scalars, run_file_interpreted

POISON = -7


def hand(ragged, indptr, W):
    """The dense rows, one entry at a time."""
    T, N = indptr.shape[0] - 1, ragged.shape[0]
    out, lens = torch.full((T, W), -1, dtype=torch.int32), torch.zeros(T, dtype=torch.int32)
    for t in range(T):
        a = min(max(int(indptr[t]), 0), N)
        b = min(max(int(indptr[t + 1]), a), N)
        n = min(b - a, W)
        out[t, :n] = ragged[a:a + n].int()
        lens[t] = n
    return out, lens


def stream(T, W, seed, dtype=torch.int32, slack=0):
    """A ragged stream of T rows of 0..W entries (slot ids, some -1), allocated T * W + slack long."""
    g = torch.Generator().manual_seed(seed)
    n = torch.randint(0, W + 1, (T,), generator=g)
    n[::5] = 0
    indptr = torch.cat([torch.zeros(1, dtype=torch.long), n.cumsum(0)]).to(dtype)
    ragged = torch.randint(-1, 10 ** 6, (T * W + slack,), generator=g).to(dtype)
    return ragged, indptr


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("T, W", [(1, 1), (7, 5), (33, 128), (0, 4)])
def test_matches_the_hand_loop(T, W, dtype):
    ragged, indptr = stream(T, W, T + W, dtype)
    out = torch.full((T, W), POISON, dtype=torch.int32)
    lens = torch.full((T,), POISON, dtype=torch.int32)
    got = ops.ragged_indices_to_dense(ragged, indptr, out, lens)
    want = hand(ragged, indptr, W)
    assert got[0] is out and got[1] is lens
    assert torch.equal(out, want[0]) and torch.equal(lens, want[1])


def test_strided_output_rows():
    ragged, indptr = stream(6, 8, 1)
    back = torch.full((6, 20), POISON, dtype=torch.int32)
    ops.ragged_indices_to_dense(ragged, indptr, back[:, 2:10], torch.empty(6, dtype=torch.int32))
    assert torch.equal(back[:, 2:10], hand(ragged, indptr, 8)[0])
    assert (back[:, :2] == POISON).all() and (back[:, 10:] == POISON).all()


def test_reference_clamps_offsets_outside_the_stream():
    """Without value checks (a GPU step) the offsets are clamped: nothing past the stream is read."""
    ragged = torch.arange(10, dtype=torch.int32)
    indptr = torch.tensor([-3, 2, 1, 8, 40], dtype=torch.int32)          # negative, decreasing, past the end
    out, lens = torch.empty(4, 6, dtype=torch.int32), torch.empty(4, dtype=torch.int32)
    M.ragged_indices_to_dense(ragged, indptr, out, lens)
    want = hand(ragged, indptr, 6)
    assert torch.equal(out, want[0]) and torch.equal(lens, want[1])
    assert lens.tolist() == [2, 0, 6, 2]


BAD = [
    (lambda o, l: ops.ragged_indices_to_dense(torch.arange(10), torch.tensor([0, 4, 3]), o, l), "non-decreasing"),
    (lambda o, l: ops.ragged_indices_to_dense(torch.arange(10), torch.tensor([0, 4, 11]), o, l), "at most 10"),
    (lambda o, l: ops.ragged_indices_to_dense(torch.arange(10), torch.tensor([-1, 4, 8]), o, l), "non-decreasing"),
    (lambda o, l: ops.ragged_indices_to_dense(torch.arange(10), torch.tensor([0, 6, 8]), o, l), "more than the 5"),
    (lambda o, l: ops.ragged_indices_to_dense(torch.arange(10).float(), torch.tensor([0, 4, 8]), o, l),
     "ragged_indices must have dtype"),
    (lambda o, l: ops.ragged_indices_to_dense(torch.arange(10), torch.tensor([0, 4]), o, l), "out_indices must have"),
    (lambda o, l: ops.ragged_indices_to_dense(torch.arange(10), torch.tensor([0, 4, 8]), o.long(), l),
     "out_indices must have dtype"),
    (lambda o, l: ops.ragged_indices_to_dense(torch.arange(10), torch.tensor([0, 4, 8]), o, l[:1]),
     "out_lens must have shape"),
]


@pytest.mark.parametrize("call, match", BAD)
def test_bad_input_is_rejected_before_any_write(call, match):
    out, lens = torch.full((2, 5), POISON, dtype=torch.int32), torch.full((2,), POISON, dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        call(out, lens)
    assert (out == POISON).all() and (lens == POISON).all()


# ---- the Triton kernel ---------------------------------------------------------------------------------
def kernel_cases():
    cases = []
    for seed, (T, W, dt, slack) in enumerate([(1, 1, torch.int32, 0), (9, 5, torch.int64, 3), (40, 130, torch.int32, 0),
                                             (3, 2048, torch.int32, 0), (5, 0, torch.int32, 0)]):
        ragged, indptr = stream(T, max(W, 1), seed, dt, slack)
        cases.append((ragged, indptr, W))
    garbage = torch.tensor([-5, 3, 2, 9, 10 ** 9, 11], dtype=torch.int64)      # offsets outside the stream
    cases.append((torch.arange(12, dtype=torch.int64), garbage, 4))
    return cases


def check_kernel(kernel, device):
    n = 0
    for ragged, indptr, W in kernel_cases():
        T = indptr.shape[0] - 1
        out = torch.full((T, W), POISON, dtype=torch.int32, device=device)
        lens = torch.full((T,), POISON, dtype=torch.int32, device=device)
        kernel(ragged.to(device), indptr.to(device), out, lens)
        want = hand(ragged, indptr, W)
        assert torch.equal(out.cpu(), want[0]) and torch.equal(lens.cpu(), want[1]), (T, W)
        n += 1
    return n


def test_triton_kernel_under_interpreter():
    r = run_file_interpreted(__file__)
    assert r.returncode == 0 and "interpreter cases passed: 6" in r.stdout


@pytest.mark.gpu
def test_gpu_kernel_equals_the_hand_loop(gpu):
    assert ops.backend_for("ragged_indices_to_dense", gpu) == "triton"
    check_kernel(ops.implementation("ragged_indices_to_dense", gpu), gpu)
    ragged, indptr = stream(4096, 512, 9)                      # a decode step of C4 top-k rows
    out = torch.empty(4096, 512, dtype=torch.int32, device=gpu)
    lens = torch.empty(4096, dtype=torch.int32, device=gpu)
    ops.ragged_indices_to_dense(ragged.to(gpu), indptr.to(gpu), out, lens)
    want = hand(ragged, indptr, 512)
    assert torch.equal(out.cpu(), want[0]) and torch.equal(lens.cpu(), want[1])


if __name__ == "__main__":
    patch_interpreter_scalars()
    from dsv4_rocm.triton.attention.ragged_indices_to_dense import ragged_indices_to_dense
    print("interpreter cases passed:", check_kernel(ragged_indices_to_dense, "cpu"))
