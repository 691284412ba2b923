"""``top_k_global_decode``: the C4 decode step's top-k with the global slot mapping as the epilogue of the same
kernels, against the two public ops it replaces (``top_k_per_row_decode``, then
``compute_global_topk_indices_and_lens`` on its output).

The contract: out_idx is what ``top_k_per_row_decode`` writes (checked against the oracle's order keys, and equal
to the unfused kernel's rows wherever the top-k order is deterministic: under the interpreter always, on a GPU
for the short-rows and fused layouts), and (global indices, lens) are exactly what
``compute_global_topk_indices_and_lens`` gives for that out_idx. Inputs are fresh random logits (ties, NaN,
short rows, rows past the block table), tokens that are padding, request ids outside the block table,
block-table holes (-1) and pages whose slots do not fit int32; every output is poisoned first.
"""
import pytest
import torch

from helpers import patch_interpreter_scalars, run_file_interpreted
from test_top_k_per_row import POISON, check_topk, hard_rows, tied_logits

from dsv4_rocm import ops
from dsv4_rocm.reference import indexer as I
from dsv4_rocm.reference import metadata as M

I32 = torch.int32
BS = 64                 # the compressed cache's block size


def step_inputs(B, next_n, width, k, gen, device="cpu"):
    """(logits [B * next_n, width], seq_lens [B], token_to_req [T], block_table, is_valid [T]) of a decode step:
    lengths from below k to the width, a padding token, request ids -1 and past the table, a table short of
    some requests' columns, holes and one page whose slots overflow int32."""
    T = B * next_n
    lg = torch.randn(T, width, generator=gen)
    lg[::3] = tied_logits(len(range(0, T, 3)), width, gen)
    lg[min(1, T - 1), 5:40] = float("nan")
    seq = torch.randint(next_n, width + 1, (B,), generator=gen, dtype=I32)
    seq[0] = width
    if B > 1:
        seq[1] = max(next_n, k // 2)                                  # every draft row of request 1 is short
    cols = (width + BS - 1) // BS
    bt = torch.randperm(4 * cols * B, generator=gen)[:B * cols].view(B, cols).to(I32)
    bt[torch.rand(B, cols, generator=gen) < 0.1] = -1
    bt[0, 1] = 2 ** 25 + 3                                            # 64 * page > 2^31 - 1: no int32 slot
    bt = bt[:, :max(1, cols - 2)]                                     # the last columns are missing for all
    t2r = (torch.arange(T) // next_n).to(I32)
    valid = torch.rand(T, generator=gen) > 0.15
    valid[0] = True
    if T >= 4:
        t2r[T - 1] = -1
        t2r[T - 2] = B + 3
    return lg.to(device), seq.to(device), t2r.to(device), bt.to(device), valid.to(device)


def compare(label, got_idx, got_g, got_l, lg, seq, next_n, k, t2r, bt, valid, ref_idx=None, constant=False,
            exact_idx=True, lowest_ties=True):
    """got_* (the fused op's) against the unfused pair: out_idx (oracle keys, the kernels' tie rule with
    lowest_ties; equal to ref_idx where given and exact_idx, else equal as sets of columns), then the global
    pair exactly as compute_global_topk_indices_and_lens (the reference) gives it for got_idx."""
    T = got_idx.shape[0]
    n = I.decode_rows(seq.cpu(), next_n, T, lg.shape[1])
    check_topk(lg.cpu(), got_idx.cpu(), torch.zeros_like(n), n, k, lowest_ties=lowest_ties, label=label)
    if ref_idx is not None:
        if exact_idx:
            assert torch.equal(got_idx, ref_idx), f"{label}: out_idx differs from the unfused top-k"
        else:
            assert torch.equal(got_idx.sort(1).values, ref_idx.sort(1).values), f"{label}: out_idx sets differ"
    want_g, want_l = M.compute_global_topk_indices_and_lens(got_idx.cpu(), t2r.cpu(), bt.cpu(), BS, valid.cpu(),
                                                            needs_constant_topk=constant)
    bad = (got_g.cpu() != want_g).any(1)
    print(f"{label}: {T} tokens, {int((want_l > 0).sum())} with slots, bad global rows {int(bad.sum())}, "
          f"bad lens {int((got_l.cpu() != want_l).sum())}")
    assert not bad.any() and torch.equal(got_l.cpu(), want_l)
    assert int(want_l.sum()) > 0 and bool((want_g == -1).any())      # the data reached both outcomes


def poisoned(T, k, device="cpu"):
    return [torch.full(s, POISON, dtype=I32, device=device) for s in ((T, k), (T, k), (T,))]


# ---------------------------------------------------------------- the oracle and the checks (CPU)
def test_reference_is_the_composition_of_the_two_ops():
    g = torch.Generator().manual_seed(1)
    k, next_n = 16, 2
    lg, seq, t2r, bt, valid = step_inputs(5, next_n, 300, k, g)
    T = lg.shape[0]
    for constant in (False, True):
        out, gbuf, lbuf = poisoned(T + 2, k)
        gi, gl = I.top_k_global_decode(lg, next_n, seq, out, T, lg.stride(0), 1, k, t2r, bt, BS, valid,
                                       (gbuf[:T], lbuf[:T]), needs_constant_topk=constant)
        assert gi.data_ptr() == gbuf.data_ptr() and (gbuf[T:] == POISON).all() and (out[T:] == POISON).all()
        ref = torch.full((T, k), POISON, dtype=I32)
        I.top_k_per_row_decode(lg, next_n, seq, ref, T, lg.stride(0), 1, k)
        compare(f"oracle, constant lens {constant}", out[:T], gi, gl, lg, seq, next_n, k, t2r, bt, valid, ref,
                constant, lowest_ties=False)


def test_ops_check_both_ops_arguments_before_writing():
    g = torch.Generator().manual_seed(2)
    k = 8
    lg, seq, t2r, bt, valid = step_inputs(3, 1, 200, k, g)
    out, gbuf, lbuf = poisoned(3, k)
    base = dict(logits=lg, next_n=1, seq_lens=seq, out_idx=out, num_rows=3, stride0=200, stride1=1, k=k,
                token_to_req_indices=t2r, block_table=bt, block_size=BS, is_valid_token=valid,
                output_buffers=(gbuf, lbuf))
    bad = [(dict(k=9), "out_idx must have k = 9"), (dict(stride0=199), "stride0"), (dict(next_n=0), "next_n"),
           (dict(token_to_req_indices=t2r[:2]), "token_to_req_indices has 2 entries"),
           (dict(is_valid_token=valid.float()), "is_valid_token must have dtype"),
           (dict(block_size=0), "block_size"), (dict(block_table=bt.t()), "block_table"),
           (dict(out_idx=torch.full((3, 2 * k), POISON, dtype=I32)[:, ::2]), "out_idx must have contiguous rows"),
           (dict(output_buffers=(gbuf[:2], lbuf)), r"output_buffers\[0\]"),
           (dict(output_buffers=(gbuf, lbuf.long())), r"output_buffers\[1\]")]
    for change, msg in bad:
        with pytest.raises(ValueError, match=msg):
            ops.top_k_global_decode(**dict(base, **change))
    assert (out == POISON).all() and (gbuf == POISON).all() and (lbuf == POISON).all()
    gi, gl = ops.top_k_global_decode(**base)                          # the reference backend on the CPU
    compare("ops on the CPU", out, gi, gl, lg, seq, 1, k, t2r, bt, valid, lowest_ties=False)


# ---------------------------------------------------------------- the Triton kernels under the interpreter (CPU)
def test_triton_kernels_under_interpreter():
    """Every layout the fused op can take (short rows, split in one and in two launches, fused, the slow
    path), both lens forms, through the kernel module and through ops routed to Triton."""
    r = run_file_interpreted(__file__)
    assert r.returncode == 0 and "interpreter cases passed" in r.stdout


def interpreter_cases():
    from dsv4_rocm.ops import _dispatch
    from dsv4_rocm.triton.indexer import top_k_per_row as T
    from dsv4_rocm.triton.metadata.compute_global_topk_indices_and_lens import \
        compute_global_topk_indices_and_lens as global_kernel
    patch_interpreter_scalars()
    g = torch.Generator().manual_seed(0)

    def unfused(lg, seq, next_n, k, t2r, bt, valid, cfg, constant):
        ref = torch.full((lg.shape[0], k), POISON, dtype=I32)
        T.top_k_per_row_decode(lg, next_n, seq, ref, lg.shape[0], lg.stride(0), lg.stride(1), k, config=cfg)
        gb, lb = torch.full_like(ref, POISON), torch.full((ref.shape[0],), POISON, dtype=I32)
        global_kernel(ref, t2r, bt, BS, valid, (gb, lb), needs_constant_topk=constant)
        return ref, gb, lb

    def run(label, lg, seq, next_n, k, t2r, bt, valid, cfg=None, constant=False):
        out, gi, gl = poisoned(lg.shape[0], k)
        T.top_k_global_decode(lg, next_n, seq, out, lg.shape[0], k, t2r, bt, BS, valid, gi, gl, constant, cfg)
        ref, gb, lb = unfused(lg, seq, next_n, k, t2r, bt, valid, cfg, constant)
        compare(label, out, gi, gl, lg, seq, next_n, k, t2r, bt, valid, ref, constant)
        assert torch.equal(gi, gb) and torch.equal(gl, lb), f"{label}: differs from the two unfused kernels"

    # the C4 decode step's form: rows of 2048 candidates, k = 512, the short-rows kernel; next_n 2
    lg, seq, t2r, bt, valid = step_inputs(5, 2, 2048, 512, g)
    lg[2] = hard_rows(2048, g)[2]                                      # one value everywhere: ties at the k-th
    run("short rows, next_n 2", lg, seq, 2, 512, t2r, bt, valid)
    run("short rows, constant lens", lg, seq, 2, 512, t2r, bt, valid, constant=True)
    # long rows with small sizes, so that a few thousand columns span many tiles, groups and CTAs
    k, width = 64, 3000
    lg, seq, t2r, bt, valid = step_inputs(6, 1, width, k, g)
    lg[4] = hard_rows(width, g)[4]                                     # descending: the top k in one place
    small = dict(raw_max=512, coarse=256, load=512, group=8, scan=128, chunk=256, cap=256, scan1=256, chunk1=256,
                 one_launch=1 << 30,
                 fused=dict(raw_max=512, load=512, scan=128))
    for name, cfg in {"split in one launch": small, "split in one launch, lengths first": dict(small, ahead=False),
                      "split in two launches": dict(small, one_launch=0),
                      "fused": dict(small, mode="fused"),
                      "fused, slow path (cap 64)": dict(small, mode="fused", cap=64)}.items():
        plan = T._plan(T._resolve("sm_90", k, cfg), lg.shape[0], width, 132)[0]
        run(f"{name} ({plan})", lg, seq, 1, k, t2r, bt, valid, cfg)
    # the public op routed to the Triton kernels (the interpreter runs them on CPU tensors)
    _dispatch._machine_backends = lambda device_type: ("reference", "triton")
    _dispatch.forget_implementations()
    with ops.use_backend("triton"):
        assert ops.backend_for("top_k_global_decode", "cpu") == "triton"
        lg, seq, t2r, bt, valid = step_inputs(4, 1, 1024, 128, g)
        out, gbuf, lbuf = poisoned(4, 128)
        gi, gl = ops.top_k_global_decode(lg, 1, seq, out, 4, lg.stride(0), 1, 128, t2r, bt, BS, valid, (gbuf, lbuf))
        compare("ops routed to Triton", out, gi, gl, lg, seq, 1, 128, t2r, bt, valid)
    print("interpreter cases passed")


# ---------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("B, next_n, width, k, mode", [
    (128, 1, 2049, 512, "auto"),           # the C4 decode step at ctx 8192: short rows
    (1, 1, 262144, 512, "auto"),           # 1M context: split in one launch
    (2, 2, 300000, 512, "auto"),           # split in two launches (more groups than one launch takes)
    (64, 1, 40000, 512, "fused"),
    (16, 1, 70000, 2048, "auto")])
@pytest.mark.parametrize("constant", [False, True])
def test_gpu_fused_equals_the_two_ops(B, next_n, width, k, mode, constant, gpu):
    from dsv4_rocm.triton.indexer import top_k_per_row as T
    g = torch.Generator().manual_seed(B * 7 + width)
    lg, seq, t2r, bt, valid = step_inputs(B, next_n, width, k, g, gpu)
    rows = B * next_n
    cfg = dict(mode=mode)
    out, gi, gl = poisoned(rows, k, gpu)
    T.top_k_global_decode(lg, next_n, seq, out, rows, k, t2r, bt, BS, valid, gi, gl, constant, cfg)
    ref = torch.full_like(out, POISON)
    T.top_k_per_row_decode(lg, next_n, seq, ref, rows, lg.stride(0), 1, k, config=cfg)
    layout = T._plan(T._resolve(T._facts(lg.device)[0], k, cfg), rows, width, T._facts(lg.device)[1])[0]
    deterministic = layout in ("short", "fused")          # the split layouts list candidates in arrival order
    compare(f"gpu {rows}x{width} k={k} {layout}", out, gi, gl, lg, seq, next_n, k, t2r, bt, valid, ref, constant,
            exact_idx=deterministic)
    gb, lb = ops.compute_global_topk_indices_and_lens(out, t2r, bt, BS, valid, needs_constant_topk=constant)
    assert torch.equal(gi, gb) and torch.equal(gl, lb)                # the unfused Triton op on the same rows
    if deterministic:
        g2, l2 = ops.compute_global_topk_indices_and_lens(ref, t2r, bt, BS, valid, needs_constant_topk=constant)
        assert torch.equal(gi, g2) and torch.equal(gl, l2)


@pytest.mark.gpu
def test_gpu_ops_graph_replay(gpu):
    """The public op in a CUDA graph (the decode step's use), replayed on new logits, lengths and tokens."""
    g = torch.Generator().manual_seed(3)
    B, width, k = 32, 2049, 512
    lg, seq, t2r, bt, valid = step_inputs(B, 1, width, k, g, gpu)
    out, gbuf, lbuf = poisoned(B, k, gpu)

    def call():
        ops.top_k_global_decode(lg, 1, seq, out, B, lg.stride(0), 1, k, t2r, bt, BS, valid, (gbuf, lbuf))
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for step in range(2):
        lg2, seq2, t2r2, bt2, valid2 = step_inputs(B, 1, width, k, torch.Generator().manual_seed(10 + step), gpu)
        for dst, src in ((lg, lg2), (seq, seq2), (t2r, t2r2), (bt, bt2), (valid, valid2)):
            dst.copy_(src)
        for t in (out, gbuf, lbuf):
            t.fill_(POISON)
        graph.replay()
        compare(f"graph replay {step}", out, gbuf, lbuf, lg, seq, 1, k, t2r, bt, valid)


if __name__ == "__main__":
    interpreter_cases()
