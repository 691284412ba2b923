"""dequantize_and_gather_k_cache in vLLM's call form: (out, k_cache, seq_lens, gather_lens, block_table,
block_size, offset, use_fnuz=False, max_gather_len=None) -> None.

CPU: the rows written against a hand loop over requests and positions (out poisoned with NaN, so rows the
op must not write show up), every cache view, vLLM's forms (gather_lens None, keyword offset, V4.1's
max_gather_len, which changes no written row), vLLM's round-trip check, bad input rejected before any
write, and a property test over random lengths and block tables; the V4.1 records (V41_528, V41_FP4_288,
named by the cache's last dimension, page-split or interleaved) against the same loop. GPU: the HIP kernel writes exactly the reference's rows, garbage
lengths and tables included, for every record format and layout.
"""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from dsv4_rocm import cache_views as V
from dsv4_rocm import layout as L
from dsv4_rocm import ops
from dsv4_rocm.reference import cache as rc
from helpers import every_cache_view, random_k

VIEWS = sorted(every_cache_view(1, 2))
FORMATS = [(L.V40_584, "page_split"), (L.V41_528, "page_split"), (L.V41_528, "interleaved"),
           (L.V41_FP4_288, "page_split"), (L.V41_FP4_288, "interleaved")]


def filled_cache(nb, bs, seed=0, device="cpu", view="vllm_3d", fmt=L.V40_584):
    """A cache view whose every slot holds a record of random K; returns (view, bf16 K [nb*bs, 512])."""
    align = fmt.page_align if not fmt.interleaved else fmt.token_bytes
    v, _ = every_cache_view(nb, bs, fmt.token_bytes, seed=seed, device=device, align=align)[view]
    k = random_k(nb * bs, gen=torch.Generator().manual_seed(seed)).to(device)
    rc.quantize_and_insert_k_cache(k, v, torch.arange(nb * bs, device=device), bs, fmt)
    return v, rc.decode_k_records(rc.encode_k_records(k.cpu(), fmt), fmt).bfloat16().to(device)


def hand_gather(out, K, seq_lens, gather_lens, block_table, bs, offset):
    """The rows vLLM's op writes, one by one (K: the bf16 value of every slot)."""
    out = out.clone()
    for b in range(seq_lens.shape[0]):
        seq = int(seq_lens[b])
        gl = seq if gather_lens is None else int(gather_lens[b])
        for i in range(gl):
            pos = seq - gl + i
            out[b, offset + i] = K[int(block_table[b, pos // bs]) * bs + pos % bs]
    return out


def nan_out(R, M, device="cpu"):
    return torch.full((R, M, 512), float("nan"), dtype=torch.bfloat16, device=device)


CASES = [  # seq_lens, gather_lens, block_table, block_size, offset, rows of out
    ([70, 5], [66, 5], [[3, 1], [0, -1]], 64, 2, 70),
    ([70, 5], None, [[3, 1], [0, -1]], 64, 0, 72),
    ([7, 0, 4], [3, 0, 4], [[4, 0, 2, 3], [-1, -1, -1, -1], [1, 5, -1, -1]], 2, 1, 6),
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_rows_match_a_hand_loop(case, index_dtype):
    seq, gl, bt, bs, offset, M = CASES[case]
    v, K = filled_cache(6, bs, seed=case)
    seq_lens = torch.tensor(seq, dtype=index_dtype)
    gather_lens = None if gl is None else torch.tensor(gl, dtype=index_dtype)
    block_table = torch.tensor(bt, dtype=index_dtype)
    out = nan_out(len(seq), M)
    ops.dequantize_and_gather_k_cache(out, v, seq_lens, gather_lens, block_table, bs, offset)
    want = hand_gather(nan_out(len(seq), M), K, seq_lens, gather_lens, block_table, bs, offset)
    assert torch.equal(out.isnan(), want.isnan())                 # exactly the rows vLLM writes
    assert torch.equal(out.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("fmt, layout", FORMATS[1:], ids=[f"{f.name}-{lay}" for f, lay in FORMATS[1:]])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_v41_records_match_the_hand_loop(case, fmt, layout):
    """The format is the cache's last dimension (as vLLM's op reads it): a [nb, bs, R] view."""
    seq, gl, bt, bs, offset, M = CASES[case]
    f = L.with_layout(fmt, layout)
    v, K = filled_cache(6, bs, seed=case + 7, fmt=f)
    args = (torch.tensor(seq), None if gl is None else torch.tensor(gl), torch.tensor(bt), bs, offset)
    out = nan_out(len(seq), M)
    ops.dequantize_and_gather_k_cache(out, v, *args, kv_layout=layout)
    want = hand_gather(nan_out(len(seq), M), K, *args)
    assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out.nan_to_num(), want.nan_to_num())
    if layout == "interleaved" and case == 0:        # the torch op (V4.1's default layout) and a 2-D page view
        out2 = nan_out(len(seq), M)
        torch.ops.dsv4_rocm.dequantize_and_gather_k_cache(out2, V.pages(v, bs, "k_cache", f), *args)
        assert torch.equal(out2.view(torch.int16), out.view(torch.int16))


@pytest.mark.parametrize("view", VIEWS)
def test_every_view_reads_the_same_rows(view):
    seq, gl, bt, bs, offset, M = CASES[0]
    args = (torch.tensor(seq), torch.tensor(gl), torch.tensor(bt, dtype=torch.int32), bs, offset)
    v, _ = filled_cache(4, bs, seed=11, view=view)
    ref, _ = filled_cache(4, bs, seed=11, view="padded_2d")
    out, want = nan_out(2, M), nan_out(2, M)
    ops.dequantize_and_gather_k_cache(out, v, *args)
    ops.dequantize_and_gather_k_cache(want, ref, *args)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))


def test_vllm_call_forms():
    v, K = filled_cache(3, 16, seed=2, view="unpadded_3d")
    seq_lens = torch.tensor([40], dtype=torch.int32)
    bt = torch.arange(3, dtype=torch.int32).unsqueeze(0)
    want = hand_gather(nan_out(1, 40), K, seq_lens, None, bt, 16, 0)
    for call in (lambda o: ops.dequantize_and_gather_k_cache(o, v, seq_lens, None, bt, 16, offset=0),
                 lambda o: ops.dequantize_and_gather_k_cache(o, v, seq_lens, None, bt, 16, 0, use_fnuz=False),
                 lambda o: torch.ops.dsv4_rocm.dequantize_and_gather_k_cache(o, v, seq_lens, None, bt, 16, 0)):
        out = nan_out(1, 40)
        assert call(out) is None
        assert torch.equal(out, want)


@pytest.mark.parametrize("fmt, layout", FORMATS[:3], ids=[f"{f.name}-{lay}" for f, lay in FORMATS[:3]])
def test_max_gather_len_changes_nothing_written(fmt, layout):
    """vLLM 0.33's DeepSeek-V4.1 form passes ``max_gather_len`` (the host's longest gather, its kernel's grid
    width): the rows written are the hand loop's whatever its value (exact, short, long, 0, None), through
    the Python op (positional and keyword) and the torch op; random lengths, a padded block table."""
    g = torch.Generator().manual_seed(21)
    bs, R = 16, 3
    f = L.with_layout(fmt, layout)
    v, K = filled_cache(9, bs, seed=21, fmt=f)
    seq = torch.randint(1, 3 * bs + 1, (R,), generator=g)
    gl = torch.minimum(seq, torch.randint(0, 2 * bs, (R,), generator=g))
    bt = torch.randperm(9, generator=g)[:R * 3].view(R, 3)
    bt[seq <= 2 * bs, 2] = -1                                   # padding past each request's pages
    offset = 2
    M = offset + int(gl.max()) + 3
    args = (seq, gl, bt, bs, offset)
    want = hand_gather(nan_out(R, M), K, *args)
    longest = int(gl.max())
    calls = [lambda o, n: ops.dequantize_and_gather_k_cache(o, v, *args, False, n, kv_layout=layout),
             lambda o, n: ops.dequantize_and_gather_k_cache(o, v, *args, max_gather_len=n, kv_layout=layout)]
    if layout == L.default_layout(fmt):                         # the torch op reads vLLM's default layout
        calls.append(lambda o, n: torch.ops.dsv4_rocm.dequantize_and_gather_k_cache(o, v, *args, False, n))
    for call in calls:
        for n in (longest, 1, longest * 50 + 7, 0, None):
            out = nan_out(R, M)
            assert call(out, n) is None
            assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out.nan_to_num(), want.nan_to_num())


def test_vllm_round_trip_through_a_block_table():
    """vLLM's native-vs-fallback check: insert through a block table, gather the window back with offset 1;
    the bf16 RoPE part comes back exactly, the NoPE part as its UE8M0 dequantization."""
    bs, seq, gls = 64, [65, 17], [33, 9]
    bt = torch.tensor([[0, 2], [5, -1]], dtype=torch.int32)
    cache = torch.zeros(8, bs * 584, dtype=torch.uint8)
    k = random_k(sum(seq))
    slots = torch.cat([bt[r, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs for r, n in enumerate(seq)])
    ops.quantize_and_insert_k_cache(k, cache, slots, bs)
    out = nan_out(2, max(gls) + 2)
    ops.dequantize_and_gather_k_cache(out, cache.view(8, bs, 584), torch.tensor(seq, dtype=torch.int32),
                                      torch.tensor(gls, dtype=torch.int32), bt, bs, 1)
    starts = [0, seq[0]]
    for r, (n, g) in enumerate(zip(seq, gls)):
        src = k[starts[r] + n - g:starts[r] + n]
        assert torch.equal(out[r, 1:1 + g, 448:], src[:, 448:])
        assert torch.equal(out[r, 1:1 + g].float(), rc.decode_k_records(rc.encode_k_records(src)).bfloat16().float())
        assert out[r, 0].isnan().all() and out[r, 1 + g:].isnan().all()


def test_empty_batches_write_nothing():
    v, _ = filled_cache(2, 64)
    out = nan_out(0, 4)
    ops.dequantize_and_gather_k_cache(out, v, torch.zeros(0, dtype=torch.int32), None,
                                      torch.zeros(0, 2, dtype=torch.int32), 64, 0)
    out = nan_out(2, 4)
    ops.dequantize_and_gather_k_cache(out, v, torch.tensor([5, 0]), torch.tensor([0, 0]),
                                      torch.zeros(2, 2, dtype=torch.int32), 64, 0)
    assert out.isnan().all()


V0, _ = filled_cache(4, 64)
S, G, BT = torch.tensor([70, 5]), torch.tensor([66, 5]), torch.tensor([[3, 1], [0, -1]], dtype=torch.int32)
BAD = [
    (lambda o: ops.dequantize_and_gather_k_cache(o, V0, S, torch.tensor([71, 5]), BT, 64, 0), "gather_lens must lie"),
    (lambda o: ops.dequantize_and_gather_k_cache(o, V0, torch.tensor([70, -1]), None, BT, 64, 0), "seq_lens must be"),
    (lambda o: ops.dequantize_and_gather_k_cache(o, V0, S, G, BT, 64, 5), "exceeds the 70 rows of out"),
    (lambda o: ops.dequantize_and_gather_k_cache(o, V0, S, G, BT[:, :1], 64, 0), "block_table does not cover"),
    (lambda o: ops.dequantize_and_gather_k_cache(o, V0, S, G, torch.tensor([[3, -1], [0, -1]]), 64, 0),
     "block_table does not cover"),
    (lambda o: ops.dequantize_and_gather_k_cache(o, V0, S, G, torch.tensor([[3, 4], [0, -1]]), 64, 0),
     "names a page >= 4"),
    (lambda o: ops.dequantize_and_gather_k_cache(o, V0, S, G[:1], BT, 64, 0), "gather_lens must have shape"),
    (lambda o: ops.dequantize_and_gather_k_cache(o, V0, S, G, BT[:1], 64, 0), "block_table must have shape"),
    (lambda o: ops.dequantize_and_gather_k_cache(o[:1], V0, S, G, BT, 64, 0), "out must have shape"),
    (lambda o: ops.dequantize_and_gather_k_cache(o.float(), V0, S, G, BT, 64, 0), "out must have dtype"),
    (lambda o: ops.dequantize_and_gather_k_cache(o, V0, S.float(), G, BT, 64, 0), "seq_lens must have dtype"),
    (lambda o: ops.dequantize_and_gather_k_cache(o, V0, S, G, BT, 64, -1), "offset"),
    (lambda o: ops.dequantize_and_gather_k_cache(o, V0, S, G, BT, 0, 0), "block_size"),
    (lambda o: ops.dequantize_and_gather_k_cache(o, V0, S, G, BT, 32, 0), "k_cache"),
    (lambda o: ops.dequantize_and_gather_k_cache(o, V0, S, G, BT, 64, 0, False, -1), "max_gather_len"),
    (lambda o: ops.dequantize_and_gather_k_cache(o, V0, S, G, BT, 64, 0, max_gather_len=66.0), "max_gather_len"),
    (lambda o: ops.dequantize_and_gather_k_cache(o, V0, S, G, BT, 64, 0, max_gather_len=True), "max_gather_len"),
    (lambda o: ops.dequantize_and_gather_k_cache(o, V0, S, G, BT, 64, 0, max_gather_len=torch.tensor(66)),
     "max_gather_len"),
    (lambda o: torch.ops.dsv4_rocm.dequantize_and_gather_k_cache(o, V0, S, G, BT, 64, 0, False, -3),
     "max_gather_len"),
]


@pytest.mark.parametrize("call, match", BAD)
def test_bad_input_is_rejected_before_any_write(call, match):
    out = nan_out(2, 70)
    with pytest.raises(ValueError, match=match):
        call(out)
    assert out.isnan().all()


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_property_random_lengths_and_tables(data):
    """Random requests (empty ones too), windows, offsets and block tables whose unused entries are -1 or
    garbage: exactly the rows of vLLM's op are written, with the hand loop's values."""
    bs = data.draw(st.sampled_from([2, 3, 16]))
    nb = 6
    R = data.draw(st.integers(0, 4))
    cols = data.draw(st.integers(1, 4))
    seq = [data.draw(st.integers(0, cols * bs)) for _ in range(R)]
    gl = [data.draw(st.integers(0, s)) for s in seq]
    use_gl = data.draw(st.booleans())
    offset = data.draw(st.integers(0, 3))
    M = offset + max([g if use_gl else s for g, s in zip(gl, seq)] + [0]) + data.draw(st.integers(0, 2))
    need = [range((s - (g if use_gl else s)) // bs, (s + bs - 1) // bs) for s, g in zip(seq, gl)]  # columns read
    bt = torch.tensor([[data.draw(st.integers(0, nb - 1)) if c in cs else data.draw(st.sampled_from([-1, 10 ** 6]))
                        for c in range(cols)] for cs in need], dtype=torch.int32).reshape(R, cols)
    v, K = filled_cache(nb, bs, seed=bs)
    seq_lens, gather_lens = torch.tensor(seq, dtype=torch.long), torch.tensor(gl, dtype=torch.int32) if use_gl else None
    out = nan_out(R, M)
    ops.dequantize_and_gather_k_cache(out, v, seq_lens, gather_lens, bt, bs, offset)
    want = hand_gather(nan_out(R, M), K, seq_lens, gather_lens, bt, bs, offset)
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.equal(out.nan_to_num(), want.nan_to_num())


# ---- GPU ------------------------------------------------------------------------------------------------
def _hip():
    assert ops.backend_for("dequantize_and_gather_k_cache", "cuda") == "hip"
    return ops.implementation("dequantize_and_gather_k_cache", "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("bs, R, max_seq, use_gl, offset", [(64, 1, 8192, True, 0), (64, 4, 3000, True, 513),
                                                            (2, 5, 400, False, 0), (64, 33, 200, True, 7)])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gpu_kernel_writes_the_reference_rows(bs, R, max_seq, use_gl, offset, index_dtype, gpu):
    g = torch.Generator().manual_seed(R * bs + offset)
    nb = R * ((max_seq + bs - 1) // bs) + 2
    v, _ = filled_cache(nb, bs, seed=R, device=gpu)
    seq = torch.randint(0, max_seq + 1, (R,), generator=g)
    gl = torch.minimum(seq, torch.randint(0, 700, (R,), generator=g)) if use_gl else seq
    cols = (max_seq + bs - 1) // bs
    bt = torch.randperm(nb, generator=g)[:R * cols].view(R, cols).to(index_dtype)
    M = offset + int(gl.max()) + 3
    args = (v, seq.to(index_dtype).to(gpu), gl.to(index_dtype).to(gpu) if use_gl else None, bt.to(gpu), bs, offset)
    out, want = nan_out(R, M, gpu), nan_out(R, M, gpu)
    _hip()(out, *args)
    rc.dequantize_and_gather_k_cache(want, *args)
    print(f"bs={bs} R={R} rows={int((~want.isnan()).any(-1).sum())}")
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, layout", FORMATS, ids=[f"{f.name}-{lay}" for f, lay in FORMATS])
@pytest.mark.parametrize("bs, R, max_seq", [(64, 4, 3000), (5, 7, 400), (256, 2, 9000)])
def test_gpu_kernel_reads_every_record_format(bs, R, max_seq, fmt, layout, gpu):
    f = L.with_layout(fmt, layout)
    g = torch.Generator().manual_seed(R * bs)
    nb = R * ((max_seq + bs - 1) // bs) + 2
    v, _ = filled_cache(nb, bs, seed=R + bs, device=gpu, fmt=f)
    seq = torch.randint(0, max_seq + 1, (R,), generator=g)
    gl = torch.minimum(seq, torch.randint(0, 700, (R,), generator=g))
    cols = (max_seq + bs - 1) // bs
    bt = torch.randperm(nb, generator=g)[:R * cols].view(R, cols).int()
    M = int(gl.max()) + 5
    args = (v, seq.to(gpu), gl.to(gpu), bt.to(gpu), bs, 2)
    out, want = nan_out(R, M, gpu), nan_out(R, M, gpu)
    _hip()(out, *args, fmt=f)
    rc.dequantize_and_gather_k_cache(want, *args, fmt=f)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    out2 = nan_out(R, M, gpu)
    ops.dequantize_and_gather_k_cache(out2, *args, kv_layout=layout)     # the op names the format itself
    assert torch.equal(out2.view(torch.int16), want.view(torch.int16))


@pytest.mark.gpu
def test_gpu_garbage_lengths_and_tables_stay_inside_out(gpu):
    """Without value checks (the GPU default) garbage gives zero rows, never a read or write outside."""
    v, _ = filled_cache(4, 64, device=gpu)
    seq = torch.tensor([70, 3, 10 ** 6, 50], device=gpu)
    gl = torch.tensor([80, 3, 5, -4], device=gpu)                   # gather > seq; negative
    bt = torch.tensor([[1, -1], [9, 0], [2, 3], [0, 0]], dtype=torch.int32, device=gpu)   # -1; 9 >= nb
    out, want = nan_out(4, 40, gpu), nan_out(4, 40, gpu)
    ops.dequantize_and_gather_k_cache(out, v, seq, gl, bt, 64, 2)
    rc.dequantize_and_gather_k_cache(want, v, seq, gl, bt, 64, 2)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
