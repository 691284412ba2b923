"""Top-k per row in vLLM's call forms (top_k_per_row_prefill / top_k_per_row_decode / persistent_topk):
the oracle, the argument checks, the Triton kernels under the interpreter (CPU, subprocess) and on a GPU.

vLLM's own test semantics are ported here (its tests/kernels/test_top_k_per_row.py): rows [0, row_end)
with row_end = seq_len - next_n + r % next_n + 1 for 1-D seq_lens, each row's own length for 2-D ones,
``clean_logits`` (-inf past the row end) or garbage there, "random" and "10LSBits" data (only the 10 low
mantissa bits random: a flood of ties), persistent_topk lengths beyond the width or negative, NaN past
the lengths, graph replay with new lengths. Selections are compared as multisets of order keys (ties are
implementation-defined, docs/conventions.md), indices must be distinct and in range, short rows exact.
The kernels also promise the lowest columns among ties; ``check_topk(lowest_ties=True)`` checks that.
"""
import pytest
import torch

from helpers import patch_interpreter_scalars, run_file_interpreted

from dsv4_rocm import ops
from dsv4_rocm.reference import indexer as I

POISON = -777           # never a valid index nor the -1 padding (0xAB bytes would read as index 171)


def check_topk(logits, out, starts, n, k, lowest_ties=False, label=""):
    """out [R, k] against rows r < R of logits covering [starts[r], starts[r] + n[r]): n <= k rows are
    exactly [0..n-1, -1...]; other rows hold k distinct columns in [0, n) whose order keys are, as a
    multiset, the k largest; with lowest_ties the set is exactly {key > T} plus the lowest ties of T."""
    R, dev = out.shape[0], out.device
    starts, n = starts.to(dev).long(), n.to(dev).long()
    i = torch.arange(k, device=dev)
    trivial = n <= k
    want = torch.where(i[None] < n[:, None], i[None], -1)
    bad_trivial = int((out[trivial] != want[trivial]).any(1).sum())
    rows = (~trivial).nonzero().flatten()
    bad_range = bad_dup = bad_values = bad_ties = 0
    if rows.numel():
        o = out[rows].long()
        nr, s = n[rows][:, None], starts[rows][:, None]
        bad_range = int(((o < 0) | (o >= nr)).any(1).sum())
        so = o.sort(1).values
        bad_dup = int((so[:, 1:] == so[:, :-1]).any(1).sum())
        col = torch.arange(logits.shape[1], device=dev)[None] - s
        keys = torch.where((col >= 0) & (col < nr), I.order_key(logits[rows.to(logits.device)].to(dev)), -1)
        if bad_range == 0:
            sel = keys.gather(1, o + s).sort(1).values
            # on the CPU: torch.topk's multi-block radix select on CUDA reads scratch words it has not written
            # (compute-sanitizer initcheck flags them), which the sanitizer pass would report as this test's
            ref = keys.cpu().topk(k, 1).values.sort(1).values.to(dev)
            bad_values = int((sel != ref).any(1).sum())
            if lowest_ties and bad_values == 0:
                gt, eq = keys > ref[:, :1], keys == ref[:, :1]
                take = gt | (eq & (eq.cumsum(1) <= k - gt.sum(1, keepdim=True)))
                got = torch.zeros_like(take).scatter_(1, o + s, True)
                bad_ties = int((got != take).any(1).sum())
    print(f"{label}: {R} rows ({rows.numel()} selected), bad rows: trivial {bad_trivial}, range {bad_range}, "
          f"duplicates {bad_dup}, values {bad_values}, tie rule {bad_ties}")
    assert bad_trivial == bad_range == bad_dup == bad_values == bad_ties == 0


def vllm_logits(rows, width, row_ends, data="random", clean=True, gen=None, device="cpu"):
    """vLLM's create_random_logits: randn or 10LSBits (0x3F900000 | 10 random bits), -inf past the ends."""
    if data == "random":
        x = torch.randn(rows, width, generator=gen)
    else:
        bits = torch.randint(0, 1 << 10, (rows, width), generator=gen, dtype=torch.int32) | 0x3F900000
        x = bits.view(torch.float32)
    if clean:
        x = x.masked_fill(torch.arange(width)[None] >= row_ends.long().cpu()[:, None], float("-inf"))
    return x.to(device)


def tied_logits(rows, width, gen, device="cpu"):
    """Logits on a grid of 1/4: many exact ties, some -inf and +inf inside the rows."""
    x = (torch.randn(rows, width, generator=gen) * 4).round() / 4
    x[torch.rand(rows, width, generator=gen) < 0.01] = float("-inf")
    x[torch.rand(rows, width, generator=gen) < 0.001] = float("inf")
    return x.to(device)


# ---------------------------------------------------------------- the oracle (CPU)
def test_order_key_is_the_selection_order():
    v = torch.tensor([float("-inf"), -3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, float("inf"), float("nan"),
                      -float("nan")])
    key = I.order_key(v)
    print("keys", [hex(int(x)) for x in key])
    assert (key[1:] >= key[:-1]).all() and (key[:3] < key[1:4]).all()
    assert key[3] == key[4] and key[8] == key[9] == 0xFFFFFFFF and key[7] < key[8]
    assert int(key.min()) > 0                                   # 0 stays below every value (padding)


def test_reference_prefill_rows_are_relative_and_padded():
    g = torch.Generator().manual_seed(6)
    lg = torch.randn(5, 50, generator=g)
    starts, ends = torch.tensor([0, 10, 0, 45, 20]), torch.tensor([50, 13, 0, 50, 40])
    out = torch.full((5, 8), POISON, dtype=torch.int32)
    I.top_k_per_row_prefill(lg, starts, ends, out, 5, 50, 1, 8)
    assert set(out[0].tolist()) == set(torch.topk(lg[0], 8).indices.tolist())
    assert out[1].tolist() == [0, 1, 2] + [-1] * 5          # n <= k: trivial path, relative indices
    assert (out[2] == -1).all()
    assert out[3].tolist() == [0, 1, 2, 3, 4, -1, -1, -1]
    assert set(out[4].tolist()) == set((torch.topk(lg[4, 20:40], 8).indices).tolist())
    s, n = I.prefill_rows(starts, ends, 5, 50)
    check_topk(lg, out, s, n, 8, label="oracle prefill")


def test_reference_decode_row_lengths():
    sl = torch.tensor([5, 1, 0])
    assert I.decode_rows(sl, 2, 6, 100).tolist() == [4, 5, 0, 1, 0, 0]       # L - next_n + r % next_n + 1
    assert I.decode_rows(sl.view(3, 1), 2, 6, 100).tolist() == [4, 5, 0, 1, 0, 0]
    per_row = torch.tensor([[3, 7], [-2, 200]])
    assert I.decode_rows(per_row, 2, 4, 100).tolist() == [3, 7, 0, 100]        # 2-D: each row's own, clamped
    assert I.decode_rows(torch.tensor([10]), 1, 1, 4).tolist() == [4]


def test_reference_nan_ranks_first_and_inf_is_ordinary():
    lg = torch.tensor([[1.0, float("nan"), float("-inf"), 3.0, float("-inf"), -float("nan")]])
    out = torch.empty(1, 3, dtype=torch.int32)
    I.top_k_per_row_decode(lg, 1, torch.tensor([6]), out, 1, 6, 1, 3)
    assert sorted(out[0].tolist()) == [1, 3, 5]
    lg = torch.full((1, 6), float("-inf"))
    lg[0, 4] = 0.0
    I.top_k_per_row_decode(lg, 1, torch.tensor([6]), out, 1, 6, 1, 3)
    assert 4 in out[0].tolist() and len(set(out[0].tolist())) == 3 and min(out[0].tolist()) >= 0


@pytest.mark.parametrize("next_n", [1, 4])
@pytest.mark.parametrize("data", ["random", "10LSBits"])
def test_reference_vllm_decode_semantics(next_n, data):
    g = torch.Generator().manual_seed(next_n)
    B, width, k = 5, 300, 64
    seq = torch.randint(next_n, width, (B,), generator=g, dtype=torch.int32)
    r = torch.arange(B * next_n)
    ends = seq[r // next_n] - next_n + r % next_n + 1
    lg = vllm_logits(B * next_n, width, ends, data, clean=bool(next_n % 2), gen=g)
    out = torch.full((B * next_n, k), POISON, dtype=torch.int32)
    I.top_k_per_row_decode(lg, next_n, seq, out, B * next_n, width, 1, k)
    check_topk(lg, out, torch.zeros_like(ends), ends, k, label=f"oracle decode next_n={next_n} {data}")


def test_reference_persistent_lengths_clamp():
    g = torch.Generator().manual_seed(3)
    lg = torch.randn(8, 40, generator=g)
    lengths = torch.tensor([-1, 0, 1, 7, 8, 39, 40, 57], dtype=torch.int32)
    out = torch.full((8, 8), POISON, dtype=torch.int32)
    I.persistent_topk(lg, lengths.view(-1, 4), out, torch.empty(16, dtype=torch.uint8), 8, 40)
    check_topk(lg, out, torch.zeros(8), lengths.clamp(0, 40), 8, label="oracle persistent")


# ---------------------------------------------------------------- argument checks (CPU)
def test_checks_reject_before_writing():
    lg = torch.randn(4, 50)
    out = torch.full((4, 8), POISON, dtype=torch.int32)
    s, e = torch.zeros(4, dtype=torch.int32), torch.full((4,), 50, dtype=torch.int32)
    bad = [
        (dict(logits=lg.double()), "logits must have dtype"),
        (dict(out_idx=out.long()), "out_idx must have dtype"),
        (dict(out_idx=out[:, :7]), "k = 8 columns"),
        (dict(k=0), "k must be"),
        (dict(k=5000), "k must be"),
        (dict(num_rows=5), "num_rows 5 exceeds"),
        (dict(stride0=49), "stride0 must be"),
        (dict(stride1=2), "stride1 must be"),
        (dict(row_ends=e + 1), "row_starts/row_ends"),
        (dict(row_starts=s - 1), "row_starts/row_ends"),
        (dict(row_starts=torch.full((4,), 9), row_ends=torch.full((4,), 3)), "row_starts/row_ends"),
        (dict(row_starts=s[:3]), "row_starts must have at least"),
    ]
    base = dict(logits=lg, row_starts=s, row_ends=e, out_idx=out, num_rows=4, stride0=50, stride1=1, k=8)
    for change, msg in bad:
        with pytest.raises(ValueError, match=msg):
            ops.top_k_per_row_prefill(**dict(base, **change))
    assert (out == POISON).all()                               # nothing written before an error
    dec = dict(logits=lg, next_n=2, seq_lens=torch.tensor([50, 50]), out_idx=out, num_rows=4, stride0=50, stride1=1,
               k=8)
    for change, msg in [(dict(next_n=0), "next_n"), (dict(seq_lens=torch.tensor([50])), "seq_lens covers"),
                        (dict(seq_lens=torch.ones(2, 3, dtype=torch.int32)), "seq_lens must be"),
                        (dict(seq_lens=torch.ones(2)), "seq_lens must have dtype")]:
        with pytest.raises(ValueError, match=msg):
            ops.top_k_per_row_decode(**dict(dec, **change))
    ws = torch.empty(8, dtype=torch.uint8)
    for args, msg in [((lg, torch.ones(3, dtype=torch.int32), out, ws, 8, 50), "lengths must be"),
                      ((lg, torch.ones(4), out, ws, 8, 50), "lengths must have dtype"),
                      ((lg, torch.ones(4, dtype=torch.int32), out, ws.float(), 8, 50), "workspace"),
                      ((lg, torch.ones(4, dtype=torch.int32), out[:3], ws, 8, 50), "output must have 4 rows"),
                      ((lg, torch.ones(4, dtype=torch.int32), out, ws, 8, -1), "max_seq_len")]:
        with pytest.raises(ValueError, match=msg):
            ops.persistent_topk(*args)
    assert (out == POISON).all()


def test_ops_forms_on_cpu_and_empty_batch():
    g = torch.Generator().manual_seed(4)
    lg = torch.randn(6, 90, generator=g)
    out = torch.full((6, 16), POISON, dtype=torch.int32)
    ops.top_k_per_row_decode(lg, 2, torch.tensor([90, 20, 5], dtype=torch.int32), out, 6, 90, 1, 16)
    check_topk(lg, out, torch.zeros(6), I.decode_rows(torch.tensor([90, 20, 5]), 2, 6, 90), 16, label="ops decode")
    lengths = torch.tensor([[90, 3], [17, 16], [0, -4]], dtype=torch.int32)
    for op in (ops.persistent_topk, ops.cooperative_topk):
        out.fill_(POISON)
        op(lg, lengths, out, torch.empty(8, dtype=torch.uint8), 16, 90)
        check_topk(lg, out, torch.zeros(6), lengths.reshape(-1).clamp(0, 90), 16, label=op.__name__)
    out.fill_(POISON)
    ops.top_k_per_row_prefill(lg, torch.zeros(6, dtype=torch.int64), torch.zeros(6, dtype=torch.int64), out, 0, 90, 1,
                              16)
    assert (out == POISON).all()                               # num_rows 0: nothing to do


def test_sweep_variants_are_valid_configs_and_plans():
    """gpu/topk.py times every variant of the bench's SWEEP on the benchmark shapes: each must resolve on every
    target, and the split variants must take the layout they are named for at b = 1 x 256K."""
    pytest.importorskip("triton")
    from dsv4_rocm.bench.top_k import CASES, SWEEP
    from dsv4_rocm.triton.indexer import top_k_per_row as T
    for arch, sms in (("sm_90", 132), ("sm_100", 148), ("gfx942", 304), ("gfx950", 256)):
        for _, rows, n, k in CASES:
            for name, fn in SWEEP.items():
                cfg = T._resolve(arch, k, fn(T.default_config(arch, k)))
                T._plan(cfg, rows, n, sms)
    plan = {v: T._plan(T._resolve("sm_90", 512, SWEEP[v](T.default_config("sm_90", 512))), 1, 262144, 132)[0]
            for v in ("default", "2launch", "1launch", "fused")}
    assert plan == dict(default="split", **{"2launch": "split", "1launch": "split1"}, fused="fused")


# ---------------------------------------------------------------- the Triton kernels under the interpreter (CPU)
def clustered_logits(rows, width, gen, device="cpu"):
    """Values drawn from [1, 1 + 1e-3): one exponent, the top mantissa bits shared by the whole row."""
    return (1 + torch.rand(rows, width, generator=gen) * 1e-3).to(device)


def hard_rows(width, gen):
    """[10, width] rows of the data that stresses a selection: random, a grid of ties with -inf / +inf, a
    run of one value longer than any candidate list (the slow path), a narrow range, ascending and
    descending runs (the top k in one place), NaNs, vLLM's 10LSBits (1024 distinct values), every third
    value -inf, and random again."""
    x = torch.randn(10, width, generator=gen)
    x[1] = tied_logits(1, width, gen)[0]
    x[2, :] = 2.5
    x[3] = clustered_logits(1, width, gen)[0]
    x[4] = -torch.arange(width, dtype=torch.float32)
    x[5] = torch.arange(width, dtype=torch.float32)
    x[6, 100:150] = float("nan")
    x[7] = vllm_logits(1, width, torch.tensor([width]), "10LSBits", gen=gen)[0]
    x[8, ::3] = float("-inf")
    return x


def test_triton_kernel_under_interpreter():
    """The kernels' integer logic runs exactly under TRITON_INTERPRET=1 (set before triton is imported,
    hence a subprocess): every path (trivial, short, long through split and fused, the slow path), every
    call form, multi-CTA rows; see ``interpreter_cases``."""
    r = run_file_interpreted(__file__)
    assert r.returncode == 0 and "interpreter cases passed" in r.stdout


def _state_is_zero():
    """Split mode leaves its cached state (coarse maxima, counters) as it found it: zeros."""
    from dsv4_rocm.triton import _launch
    return all(int(b.abs().sum()) == 0 for key, b in _launch._SCRATCH.items() if key[0] == "state")


def interpreter_cases():
    from dsv4_rocm.triton.indexer import top_k_per_row as T
    patch_interpreter_scalars()
    g = torch.Generator().manual_seed(0)
    # k = 512 with the default sizes: rows past 4096 columns are long (split: 2 + 2 CTAs a row, or fused)
    k, width = 512, 5000
    store = torch.randn(10, 2 * width + 64, generator=g)
    lg = store[:, 32:32 + 2 * width:2]                                 # stride0 > row, stride1 = 2, offset base
    lg.copy_(hard_rows(width, g))
    starts = torch.tensor([0, 100, 7, 0, 300, 1000, 0, 901, 2, 4090], dtype=torch.int32)
    ends = torch.tensor([5000, 4800, 2000, 4999, 5000, 4300, 4096, 5000, 5000, 4600], dtype=torch.int32)
    s, n = I.prefill_rows(starts, ends, 10, width)
    for name, cfg in {"split": None, "split, one launch": dict(one_launch=1 << 30), "fused": dict(mode="fused"),
                      "split, cap 1024": dict(cap=1024), "fused, 6-bit digits": dict(mode="fused", digit=6)}.items():
        for rep in range(2 if cfg is None else 1):                     # a second call on the same state
            out = torch.full((10, k), POISON, dtype=torch.int32)
            T.top_k_per_row_prefill(lg, starts, ends, out, 10, lg.stride(0), lg.stride(1), k, config=cfg)
            check_topk(lg, out, s, n, k, lowest_ties=True, label=f"interpreter prefill k={k}, {name}, call {rep}")
            assert _state_is_zero()
    # small sizes, so that rows of a few thousand columns span many tiles, groups and CTAs
    k, width = 64, 6000
    lg = hard_rows(width, g)
    small = dict(raw_max=512, coarse=256, load=512, group=8, scan=128, chunk=256, cap=256, one_launch=1 << 30,
                 fused=dict(raw_max=512, load=512, scan=128))
    seq = torch.tensor([6000, 5999, 3001, 6000, 4097, 6000, 800, 6000, 513, 65], dtype=torch.int32)
    n = seq.clamp(max=width)
    for name, cfg in {"split, 13 CTAs a row, one launch": dict(small, ctas=1.0),
                      "split, 13 + 6 CTAs a row, two launches": dict(small, ctas=1.0, ctas2=1.0, one_launch=0),
                      "split, 1 CTA a row": dict(small, mode="split", ctas=0.01, ctas2=0.01),
                      "split, 1 CTA a row, two launches": dict(small, mode="split", ctas=0.01, one_launch=0),
                      "split, one launch, 4-bit threshold digits, scan 128": dict(small, coarse_digit=4, scan1=128,
                                                                                  chunk1=64),
                      "split, coarse 128, groups of 32, 5-bit digits": dict(small, coarse=128, group=32, digit=5),
                      "fused, 2 programs": dict(small, mode="fused", fused_ctas=2 / 132),
                      "fused, slow path (cap 64)": dict(small, mode="fused", cap=64)}.items():
        out = torch.full((10, k), POISON, dtype=torch.int32)
        T.persistent_topk(lg, seq, out, torch.empty(1, dtype=torch.uint8), k, width, config=cfg)
        check_topk(lg, out, torch.zeros(10), n, k, lowest_ties=True, label=f"interpreter k={k}, {name}")
        assert _state_is_zero()
    # the short-rows kernel (width <= raw_max): the C4 decode step's shape, vLLM's decode forms
    k, width = 512, 2048
    dec = torch.cat([hard_rows(width, g)[:8], clustered_logits(2, width, g)])
    seq1 = torch.tensor([2048, 900, 600, 2048, 513], dtype=torch.int32)
    seq2 = torch.tensor([[2048, 513], [1700, 0], [-3, 9999], [2047, 2048], [1024, 512]], dtype=torch.int32)
    for seq, nn in ((seq1, 2), (seq2, 2), (torch.full((10,), 2048, dtype=torch.int32), 1)):
        out = torch.full((10, k), POISON, dtype=torch.int32)
        T.top_k_per_row_decode(dec, nn, seq, out, 10, dec.stride(0), 1, k)
        check_topk(dec, out, torch.zeros(10), I.decode_rows(seq, nn, 10, width), k, lowest_ties=True,
                   label=f"interpreter short rows, seq_lens {tuple(seq.shape)}, next_n {nn}")
    lengths = torch.tensor([[2048, 511], [3000, -1], [1200, 640], [512, 513], [2000, 1999]], dtype=torch.int32)
    out = torch.full((10, k), POISON, dtype=torch.int32)
    T.persistent_topk(dec, lengths, out, torch.empty(1, dtype=torch.uint8), k, width)
    check_topk(dec, out, torch.zeros(10), lengths.reshape(-1).clamp(0, width), k, lowest_ties=True,
               label="interpreter short rows, persistent_topk")
    print("interpreter cases passed")


# ---------------------------------------------------------------- GPU
def _run_form(form, lg, k, rows, starts=None, ends=None, seq=None, next_n=1, out=None, config=None):
    from dsv4_rocm.triton.indexer import top_k_per_row as T
    out = out if out is not None else torch.full((rows, k), POISON, dtype=torch.int32, device=lg.device)
    if form == "prefill":
        T.top_k_per_row_prefill(lg, starts, ends, out, rows, lg.stride(0), lg.stride(1), k, config=config)
    else:
        T.top_k_per_row_decode(lg, next_n, seq, out, rows, lg.stride(0), lg.stride(1), k, config=config)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("k", [512, 1024, 2048])
@pytest.mark.parametrize("form", ["prefill", "decode1", "decode2"])
def test_gpu_ties_inf_short_rows_strided(k, form, gpu):
    g = torch.Generator().manual_seed(k)
    rows, width = 12, 40000
    store = torch.randn(rows, width + 96, generator=g)
    store[:6, 16:16 + width] = tied_logits(6, width, g)
    store[0, 16 + 10000:16 + 10000 + k // 4] = float("nan")          # selected first, never hidden
    lg = store.to(gpu)[:, 16:16 + width]                               # stride0 = width + 96
    if form == "prefill":
        starts = torch.randint(0, 3000, (rows,), generator=g, dtype=torch.int32)
        ends = (starts + torch.tensor([37000, 200, k, k + 1, 5000, 33000] * 2, dtype=torch.int32)).clamp(max=width)
        lg.masked_fill_(torch.arange(width, device=gpu)[None] >= ends.to(gpu).long()[:, None], float("-inf"))
        out = _run_form("prefill", lg, k, rows, starts=starts.to(gpu), ends=ends.to(gpu))
        s, n = I.prefill_rows(starts, ends, rows, width)
    else:
        nn = int(form[-1])
        seq = torch.tensor(([40000, 300, k + nn, 20000, 33000, 39000] * 2)[:rows // nn], dtype=torch.int32)
        out = _run_form("decode", lg, k, rows, seq=seq.to(gpu), next_n=nn)
        n = I.decode_rows(seq, nn, rows, width)
        s = torch.zeros_like(n)
    check_topk(lg, out, s, n, k, lowest_ties=True, label=f"gpu {form} k={k}")
    # the reference on a CPU copy: on CUDA its torch.topk (multi-block radix select) reads scratch words it
    # has not written, which initcheck reports; the values are the same wherever it runs
    lgc = lg.cpu()
    ref = torch.full(out.shape, POISON, dtype=out.dtype)
    if form == "prefill":
        I.top_k_per_row_prefill(lgc, starts, ends, ref, rows, lgc.stride(0), 1, k)
    else:
        I.top_k_per_row_decode(lgc, nn, seq, ref, rows, lgc.stride(0), 1, k)
    check_topk(lgc, ref, s, n, k, label="reference on the same inputs")


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", [1, 32, 2050])
@pytest.mark.parametrize("k", [2048, 3000])
@pytest.mark.parametrize("clean", [True, False])
def test_gpu_vllm_prefill(num_rows, k, clean, gpu):
    g = torch.Generator().manual_seed(num_rows)
    starts = torch.zeros(num_rows, dtype=torch.int32)
    ends = torch.arange(1, num_rows + 1, dtype=torch.int32)
    lg = vllm_logits(num_rows, num_rows, ends, "random", clean, g, gpu)
    out = _run_form("prefill", lg, k, num_rows, starts=starts.to(gpu), ends=ends.to(gpu))
    check_topk(lg, out, starts, ends, k, lowest_ties=True, label=f"vllm prefill rows={num_rows} k={k}")


@pytest.mark.gpu
@pytest.mark.parametrize("k", [512, 2048, 3000])
@pytest.mark.parametrize("batch", [1, 2, 64])
@pytest.mark.parametrize("next_n", [1, 8])
@pytest.mark.parametrize("data", ["random", "10LSBits"])
@pytest.mark.parametrize("clean", [True, False])
def test_gpu_vllm_decode(k, batch, next_n, data, clean, gpu):
    g = torch.Generator().manual_seed(batch * 10 + next_n)
    rows, width = batch * next_n, 20000
    seq = torch.randint(next_n, width, (batch,), generator=g, dtype=torch.int32)
    r = torch.arange(rows)
    ends = seq[r // next_n] - next_n + r % next_n + 1
    lg = vllm_logits(rows, width, ends, data, clean, g, gpu)
    out = _run_form("decode", lg, k, rows, seq=seq.to(gpu), next_n=next_n)
    check_topk(lg, out, torch.zeros(rows), ends, k, lowest_ties=True, label=f"vllm decode b={batch} nn={next_n}")


@pytest.mark.gpu
@pytest.mark.parametrize("rows, width, k, next_n", [(1, 262144, 512, 1), (64, 131072, 512, 1),
                                                    (4, 300000, 2048, 2), (64, 32768, 1024, 1)])
@pytest.mark.parametrize("data", ["normal", "clustered"])
@pytest.mark.parametrize("mode", ["auto", "fused"])
def test_gpu_long_rows(rows, width, k, next_n, data, mode, gpu):
    """The benchmark shapes (1M context at C4 is 256K candidates) and vLLM's large-vocabulary case, through
    the layout the launcher picks (split for these row counts) and through the fused kernel."""
    g = torch.Generator(device=gpu).manual_seed(rows)
    lg = torch.randn(rows, width, device=gpu, generator=g)
    if data == "clustered":
        lg = 1 + torch.rand(rows, width, device=gpu, generator=g) * 1e-3
    seq = torch.full((rows // next_n,), width, dtype=torch.int32, device=gpu)
    seq[0] = width - 5
    out = _run_form("decode", lg, k, rows, seq=seq, next_n=next_n, config=dict(mode=mode))
    n = I.decode_rows(seq, next_n, rows, width)
    check_topk(lg, out, torch.zeros_like(n), n, k, lowest_ties=True, label=f"long rows {rows}x{width} {data} {mode}")


@pytest.mark.gpu
def test_gpu_split_graph_replay_batch_one(gpu):
    """Batch 1 x 256K runs split with many CTAs a row: the graph replays on other data and lengths, so
    the row's counters and coarse maxima must be back to zero after every run."""
    width, k = 262144, 512
    g = torch.Generator(device=gpu).manual_seed(5)
    lg = torch.randn(1, width, device=gpu, generator=g)
    seq = torch.full((1,), width, dtype=torch.int32, device=gpu)
    out = torch.full((1, k), POISON, dtype=torch.int32, device=gpu)
    _run_form("decode", lg, k, 1, seq=seq, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _run_form("decode", lg, k, 1, seq=seq, out=out)
    for step, length in enumerate([width, 200000, 4097, 100, width]):
        lg.copy_(clustered_logits(1, width, torch.Generator().manual_seed(step), gpu) if step % 2 else
                 torch.randn(1, width, device=gpu, generator=g))
        seq.fill_(length)
        out.fill_(POISON)
        graph.replay()
        check_topk(lg, out, torch.zeros(1), seq.cpu(), k, lowest_ties=True, label=f"split replay {step}")
    assert _state_is_zero()


@pytest.mark.gpu
def test_gpu_vllm_strided_short_rows(gpu):
    """vLLM's gfx950 k512 case: logits = storage[:, 1:width+1] (1e20 around), ascending values, lengths around
    k, next_n 6 with 1-D seq_lens."""
    next_n, width, k = 6, 16384, 512
    lengths = torch.tensor([0, 1, 511, 512, 513, 1023, 1024, 16000], dtype=torch.int32, device=gpu)
    rows = lengths.numel() * next_n
    storage = torch.full((rows, width + 8), 1e20, device=gpu)
    lg = storage[:, 1:width + 1]
    lg[:, :16000] = torch.arange(16000, dtype=torch.float32, device=gpu)
    out = _run_form("decode", lg, k, rows, seq=lengths, next_n=next_n)
    n = I.decode_rows(lengths, next_n, rows, width)
    check_topk(lg, out, torch.zeros_like(n), n, k, lowest_ties=True, label="strided short rows")


@pytest.mark.gpu
@pytest.mark.parametrize("rows, k", [(65, 512), (128, 2048)])
def test_gpu_persistent_topk_graph_replay(rows, k, gpu):
    """vLLM's persistent_topk graph test: lengths (viewed [rows/4, 4] or [rows, 1]) change between replays,
    among them -1, 0, k - 1, k, and beyond the width; NaN past each length; logits flipped on one step."""
    from dsv4_rocm.triton.indexer import top_k_per_row as T
    width = 98304 + 3
    lengths = torch.full((rows,), width, dtype=torch.int32, device=gpu)
    g = torch.Generator(device=gpu).manual_seed(rows)
    original = torch.randn(rows, width, device=gpu, generator=g)
    logits = original.clone()
    out = torch.full((rows, k), POISON, dtype=torch.int32, device=gpu)
    ws = torch.empty(1 << 20, dtype=torch.uint8, device=gpu)
    view = lengths.view(-1, 4 if rows % 4 == 0 else 1)

    def run():
        T.persistent_topk(logits, view, out, ws, k, width)
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    pos = torch.arange(width, device=gpu)
    bounds = torch.tensor([-1, 0, 1, k - 1, k, 32769, width - 1, width, width + 17], dtype=torch.int32, device=gpu)
    for step in range(3):
        lengths.copy_(bounds[(torch.arange(rows, device=gpu) + step) % bounds.numel()])
        logits.copy_(original if step != 1 else original.flip(1))
        logits.masked_fill_(pos[None] >= lengths[:, None], float("nan"))
        out.fill_(POISON)
        graph.replay()
        n = lengths.long().clamp(0, width)
        check_topk(logits, out, torch.zeros_like(n), n, k, lowest_ties=True, label=f"persistent replay {step}")


@pytest.mark.gpu
def test_gpu_decode_graph_capture_and_bf16_persistent(gpu):
    from dsv4_rocm.triton.indexer import top_k_per_row as T
    g = torch.Generator(device=gpu).manual_seed(9)
    rows, width, k = 16, 70000, 512
    lg = torch.randn(rows, width, device=gpu, generator=g)
    seq = torch.full((rows // 2,), width, dtype=torch.int32, device=gpu)
    out = torch.full((rows, k), POISON, dtype=torch.int32, device=gpu)
    _run_form("decode", lg, k, rows, seq=seq, next_n=2, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _run_form("decode", lg, k, rows, seq=seq, next_n=2, out=out)
    lg.copy_(tied_logits(rows, width, torch.Generator().manual_seed(1), gpu))
    seq.copy_(torch.tensor([70000, 513, 600, 1, 40000, 33000, 32768, 69999], dtype=torch.int32))
    out.fill_(POISON)
    graph.replay()
    n = I.decode_rows(seq, 2, rows, width)
    check_topk(lg, out, torch.zeros_like(n), n, k, lowest_ties=True, label="decode graph replay")
    lb = lg.bfloat16()
    lengths = torch.full((rows,), width - 7, dtype=torch.int32, device=gpu)
    out.fill_(POISON)
    T.persistent_topk(lb, lengths, out, torch.empty(16, dtype=torch.uint8, device=gpu), k, width)
    check_topk(lb, out, torch.zeros(rows), lengths, k, lowest_ties=True, label="bf16 persistent_topk")


@pytest.mark.gpu
def test_gpu_ops_dispatch_and_rows_past_num_rows_untouched(gpu):
    g = torch.Generator(device=gpu).manual_seed(2)
    lg = torch.randn(8, 50000, device=gpu, generator=g)
    out = torch.full((10, 1024), POISON, dtype=torch.int32, device=gpu)
    assert ops.backend_for("top_k_per_row_prefill", gpu) == "triton"
    s = torch.zeros(8, dtype=torch.int32, device=gpu)
    e = torch.full((8,), 50000, dtype=torch.int32, device=gpu)
    ops.top_k_per_row_prefill(lg, s, e, out, 6, lg.stride(0), lg.stride(1), 1024)
    check_topk(lg, out[:6], s[:6], e[:6], 1024, lowest_ties=True, label="ops prefill")
    assert (out[6:] == POISON).all()
    # the reference backend on CPU copies: on CUDA its torch.topk (multi-block radix select) reads scratch words
    # it has not written, which initcheck reports as ours
    lgc, sc, ec = lg.cpu(), s.cpu(), e.cpu()
    with ops.use_backend("reference"):
        ref = torch.full(out.shape, POISON, dtype=torch.int32)
        ops.top_k_per_row_prefill(lgc, sc, ec, ref, 6, lgc.stride(0), lgc.stride(1), 1024)
    check_topk(lgc, ref[:6], sc[:6], ec[:6], 1024, label="ops prefill, reference backend")
    lengths = torch.tensor([50000, 3, 1025, 49999, 0, 2048, 7, 40000], dtype=torch.int32, device=gpu)
    for op in (ops.persistent_topk, ops.cooperative_topk):
        got = torch.full((8, 1024), POISON, dtype=torch.int32, device=gpu)
        op(lg, lengths, got, torch.empty(1 << 20, dtype=torch.uint8, device=gpu), 1024, 50000)
        check_topk(lg, got, torch.zeros(8), lengths, 1024, lowest_ties=True, label=f"ops {op.__name__}")


if __name__ == "__main__":
    interpreter_cases()
