"""The KV compressor (save_partial_states + compress_norm_rope_store) on vLLM's paged state cache:
the oracle against the formula written out by hand, chunk invariance, padding, rejected calls, NaN
poisoning, vLLM's call forms; on a GPU the Triton kernels against the oracle, byte for byte."""
import inspect
import textwrap

import pytest
import torch

from dsv4_rocm import layout as L
from dsv4_rocm import ops
from dsv4_rocm.reference import cache as rcache
from dsv4_rocm.reference import compressor as rc
from dsv4_rocm.reference.norm import rmsnorm
from dsv4_rocm.reference.quant import exponent_to_ue8m0, mxfp4_quantize, nvfp4_quantize, quantize_blocks
from dsv4_rocm.reference.rope import rope_fwd
from compressor_batches import (compress_kwargs, make_setup, read_entry, run_schedule, run_step, step_inputs,
                                written_mask)
from helpers import run_interpreted

TARGETS = [(4, "main"), (128, "main"), (4, "fp8"), (4, "mxfp4"), (4, "v41"), (128, "v41"), (4, "fp4"), (128, "fp4")]
V41_FORMATS = {"v41": L.V41_528, "fp4": L.V41_FP4_288}


# ---- the exact fp32 primitives ----------------------------------------------------------------------
def test_exp_neg_is_accurate_and_flushes_below_minus_80():
    x = -torch.cat([torch.rand(1 << 16) * 80, torch.tensor([0.0, 1e-30, 79.999, 80.0])])
    got = rc.exp_neg(x).double()
    ref = torch.exp(x.double())
    rel = ((got - ref) / ref).abs().max().item()
    print(f"exp_neg max relative error {rel:.2e}")
    assert rel < 2.5e-7                                     # two fp32 ulps
    assert rc.exp_neg(torch.tensor([0.0])).item() == 1.0
    assert torch.equal(rc.exp_neg(torch.tensor([-80.001, -1e4, float("-inf")])), torch.zeros(3))
    assert torch.isnan(rc.exp_neg(torch.tensor([float("nan")]))).all()


def test_pairwise_sum_is_the_tree_of_adjacent_pairs():
    v = torch.randn(3, 8)
    tree = ((v[:, 0] + v[:, 1]) + (v[:, 2] + v[:, 3])) + ((v[:, 4] + v[:, 5]) + (v[:, 6] + v[:, 7]))
    assert torch.equal(rc.pairwise_sum(v), tree)


def test_pool_and_norm_match_the_float64_formula():
    g = torch.Generator().manual_seed(1)
    sc = torch.randn(5, 128, 512, generator=g) * 3
    kv = torch.randn(5, 128, 512, generator=g)
    sc[0, :7] = float("-inf")                                  # absent rows
    kv[0, :7] = 0
    w = (1 + 0.1 * torch.randn(512, generator=g)).bfloat16()
    y64 = (torch.softmax(sc.double(), 1) * kv.double()).sum(1)
    yh64 = rmsnorm(y64, w.double(), 1e-6)
    y = rc.pool(sc, kv)
    yh = rc.rms_normalize(y, w, 1e-6)
    # error relative to sum_u w_u |kv_u| (the sum's condition): fp32 rounding of 128 terms and the exp
    e1 = ((y.double() - y64).abs() / (torch.softmax(sc.double(), 1) * kv.double().abs()).sum(1)).max().item()
    e2 = ((yh.double() - yh64).abs().max() / yh64.abs().max()).item()
    print(f"pool err {e1:.2e} (of sum w|kv|), rmsnorm rel err {e2:.2e}")
    assert e1 < 2e-6 and e2 < 1e-6


# ---- the oracle against the formula written out by hand ----------------------------------------------
def _hand_entry(S, b, j):
    """Entry j of request b from the raw projection rows (no state cache): the window by hand, the
    reference's exact fp32 pooling and norm, the record by the reference's independent encoders."""
    r, D, c = S.ratio, S.D, rc.coff(S.ratio)
    ks = S.kv_score[b].cpu()
    n = ks.shape[0]
    kv, sc = ks[:, :c * D], ks[:, c * D:] + S.ape.cpu()[torch.arange(n) % r]
    us = range(4 * j - 4, 4 * j + 4) if r == 4 else range(128 * j, 128 * j + 128)
    rows_sc, rows_kv = [], []
    for u in us:
        h = 1 if (r == 4 and u >= 4 * j) else 0
        if u < 0:
            rows_sc.append(torch.full((D,), float("-inf")))
            rows_kv.append(torch.zeros(D))
        else:
            rows_sc.append(sc[u, h * D:(h + 1) * D])
            rows_kv.append(kv[u, h * D:(h + 1) * D])
    sc_w, kv_w = torch.stack(rows_sc), torch.stack(rows_kv)
    yh = rc.rms_normalize(rc.pool(sc_w, kv_w), S.norm_w.cpu(), 1e-6)
    yh64 = rmsnorm((torch.softmax(sc_w.double(), 0) * kv_w.double()).sum(0), S.norm_w.double().cpu(), 1e-6)
    if S.target in V41_FORMATS:          # all 512 dims of the bf16 latent rotated in fp32, no second rounding
        x = rope_fwd(yh.bfloat16().float().unsqueeze(0), torch.tensor([j * r]), S.cos_sin.cpu())
        if S.target == "fp4":
            q, s = nvfp4_quantize(x, 16)
            return (q[0], s[0]), yh, yh64
        q, e = quantize_blocks(x, 32, 1e-4)
        return (q[0], exponent_to_ue8m0(e)[0]), yh, yh64
    roped = rope_fwd(yh.unsqueeze(0), torch.tensor([j * r]), S.cos_sin.cpu())[0]
    if S.target == "main":
        rec = rcache.encode_k_records(torch.cat([yh[:448], roped[448:]]).bfloat16().unsqueeze(0))[0]
        return (rec[:576], rec[576:]), yh, yh64
    z = roped.bfloat16().float().unsqueeze(0)
    if S.target == "mxfp4":
        q, s = mxfp4_quantize(z)
        return (q[0], s[0]), yh, yh64
    q, e = quantize_blocks(z, 128, 1e-4)
    return (q[0], torch.tensor([2.0 ** int(e)]).view(torch.uint8)), yh, yh64


@pytest.mark.parametrize("ratio, target", TARGETS)
def test_oracle_matches_the_formula_by_hand(ratio, target):
    lens = [3 * ratio + 3, 2 * ratio]
    S = make_setup(ratio, target, lens, seed=2)
    run_schedule(S, [{0: (0, lens[0]), 1: (0, lens[1])}])
    worst = 0.0
    for b, n in enumerate(lens):
        for j in range(n // ratio):
            (data, scale), yh, yh64 = _hand_entry(S, b, j)
            got_d, got_s = read_entry(S, b, j)
            assert torch.equal(got_d, data) and torch.equal(got_s, scale), (b, j)
            worst = max(worst, ((yh.double() - yh64).abs().max() / yh64.abs().max()).item())
    print(f"{target} C{ratio}: exact fp32 pooling vs float64 softmax, max rel err {worst:.2e}")
    assert worst < 1e-6


def test_compressor_kv_score_is_the_fp32_projection():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 64, generator=g).bfloat16()
    w = torch.randn(2048, 64, generator=g).bfloat16()
    assert torch.equal(ops.compressor_kv_score(x, w), x.float() @ w.float().t())


# ---- invariances -------------------------------------------------------------------------------------
SCHEDULES = {
    4: ([{0: (0, 37), 1: (0, 16)}],
        [{0: (0, 5), 1: (0, 1)}, {0: (5, 6), 1: (1, 2)}, {0: (6, 21), 1: (2, 3)}, {0: (21, 37), 1: (3, 16)}]),
    128: ([{0: (0, 300), 1: (0, 129)}],
          [{0: (0, 100), 1: (0, 127)}, {0: (100, 129), 1: (127, 128)}, {0: (129, 255), 1: (128, 129)},
           {0: (255, 256)}, {0: (256, 300)}]),
}


@pytest.mark.parametrize("ratio, target", TARGETS)
def test_one_shot_equals_chunked_equals_token_by_token(ratio, target):
    one, chunked = SCHEDULES[ratio]
    lens = [e for _, (_, e) in sorted(one[0].items())]
    tok = [{b: (p, p + 1) for b in range(len(lens)) if p < lens[b]} for p in range(max(lens))]
    base = make_setup(ratio, target, lens, seed=4)
    runs = {name: run_schedule(base.clone(), sched) for name, sched in
            (("one-shot", one), ("chunked", chunked), ("token-by-token", tok))}
    ref = runs["one-shot"]
    assert not torch.equal(ref.pages, base.pages)
    for name, S in runs.items():
        assert torch.equal(S.pages, ref.pages), f"{name}: cache bytes differ"
        assert torch.equal(S.state, ref.state), f"{name}: state cache differs"


def test_mixed_batch_with_padding_equals_separate_requests():
    lens = [40, 9, 23]
    base = make_setup(4, "main", lens, seed=5)
    mixed = run_schedule(base.clone(), [{0: (0, 39), 1: (0, 4)}, {0: (39, 40), 1: (4, 9), 2: (0, 23)}], pad=5)
    alone = run_schedule(base.clone(), [{0: (0, 39)}, {1: (0, 4)}, {0: (39, 40)}, {1: (4, 9)}, {2: (0, 23)}])
    assert torch.equal(mixed.pages, alone.pages) and torch.equal(mixed.state, alone.state)
    untouched = ~written_mask(base, lens)
    assert torch.equal(mixed.pages[untouched], base.pages[untouched])    # no byte outside the entries


def test_padding_writes_nothing():
    S = make_setup(4, "main", [16], seed=6)
    before_pages, before_state = S.pages.clone(), S.state.clone()
    kv_score, pos, req, sslots, kslots = step_inputs(S, {0: (0, 16)})
    kv, score = kv_score.split([1024, 1024], -1)
    none = torch.full_like(sslots, -1)
    ops.save_partial_states(kv, score, S.ape, pos, S.state, none, 4, 1024, 4)
    ops.compress_norm_rope_store(**compress_kwargs(S, 16, req, pos, none, kslots))
    assert torch.equal(S.state, before_state) and torch.equal(S.pages, before_pages)
    ops.save_partial_states(kv, score, S.ape, pos, S.state, sslots, 4, 1024, 4)     # cache slot -1: state only
    ops.compress_norm_rope_store(**compress_kwargs(S, 16, req, pos, sslots, torch.full_like(kslots, -1)))
    assert torch.equal(S.pages, before_pages) and not torch.equal(S.state, before_state)
    ops.compress_norm_rope_store(**compress_kwargs(S, 0, req, pos, sslots, kslots))   # empty batch
    assert torch.equal(S.pages, before_pages)


def test_kv_cache_views_write_the_same_bytes():
    S = run_schedule(make_setup(4, "main", [24], seed=7), [{0: (0, 24)}])
    T = make_setup(4, "main", [24], seed=7)
    kv_score, pos, req, sslots, kslots = step_inputs(T, {0: (0, 24)})
    kv, score = kv_score.split([1024, 1024], -1)
    ops.save_partial_states(kv, score, T.ape, pos, T.state, sslots, 4, 1024, 4)
    view4 = rcache.flash_mla_view(T.pages, T.bs).view(torch.float8_e4m3fn)           # [nb, bs, 1, 584] fp8
    ops.compress_norm_rope_store(**dict(compress_kwargs(T, 24, req, pos, sslots, kslots), kv_cache=view4,
                                        k_cache_metadata=kslots))
    assert torch.equal(S.pages, T.pages)


# ---- NaN / inf ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("ratio, target", TARGETS)
def test_non_finite_window_poisons_the_entry(ratio, target):
    S = make_setup(ratio, target, [2 * ratio], seed=8)
    D = S.D
    S.kv_score[0][ratio + 1, D + 3 if ratio == 4 else 3] = float("nan")   # a kv value only entry 1 reads
    run_schedule(S, [{0: (0, 2 * ratio)}])
    data, scale = read_entry(S, 0, 1)
    if target == "main":
        assert (data[:448] == 0x7F).all() and (scale[:7] == 0xFF).all() and scale[7] == 0
        assert (data[448:].view(torch.int16) == rc.BF16_NAN).all()
    elif target == "v41":                               # the norm's NaN poisons every block of the entry
        assert (data == 0x7F).all() and (scale == 0xFF).all()
    elif target == "fp4":
        assert (data == 0).all() and (scale == 0x7F).all()
    elif target == "fp8":
        assert (data == 0x7F).all() and scale.view(torch.int32).item() == rc.F32_NAN
    else:
        assert (data == 0x77).all() and (scale == 0xFF).all()
    d0, s0 = read_entry(S, 0, 0)                        # entry 0's window does not hold the NaN
    assert not (s0 == 0xFF).all()


# ---- call forms and checks ---------------------------------------------------------------------------
VLLM_SAVE = ["kv", "score", "ape", "positions", "state_cache", "slot_mapping", "block_size", "state_width",
             "compress_ratio", "pdl_kwargs"]
VLLM_COMPRESS = ["state_cache", "num_actual", "token_to_req_indices", "positions", "slot_mapping", "block_table",
                 "block_size", "state_width", "cos_sin_cache", "kv_cache", "k_cache_metadata", "pdl_kwargs",
                 "head_dim", "rope_head_dim", "compress_ratio", "overlap", "use_fp4_cache", "rms_norm_weight",
                 "rms_norm_eps", "quant_block", "token_stride", "scale_dim"]


def test_call_forms_are_vllms():
    assert list(inspect.signature(ops.save_partial_states).parameters) == VLLM_SAVE
    for fn in (ops.compress_norm_rope_store_triton, ops.compress_norm_rope_store_cutedsl):
        params = inspect.signature(fn).parameters
        positional = [n for n, p in params.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
        assert positional == VLLM_COMPRESS
        assert [n for n, p in params.items() if p.kind == p.KEYWORD_ONLY] == ["store_full_kv", "store_full_fp8",
                                                                              "fp8_scale", "kv_layout"]


def _bad_calls(S, kv, score, pos, req, sslots, kslots):
    ck = compress_kwargs(S, sslots.shape[0], req, pos, sslots, kslots)
    big = sslots.clone()
    big[2] = 10 ** 6
    yield "compress_ratio", lambda: ops.save_partial_states(kv, score, S.ape, pos, S.state, sslots, 4, 1024, 8)
    yield "block_size", lambda: ops.save_partial_states(kv, score, S.ape, pos, S.state, sslots, 8, 1024, 4)
    yield "outside the state cache", lambda: ops.save_partial_states(kv, score, S.ape, pos, S.state, big, 4, 1024, 4)
    yield "ape", lambda: ops.save_partial_states(kv, score, S.ape[:2], pos, S.state, sslots, 4, 1024, 4)
    yield "positions", lambda: ops.save_partial_states(kv, score, S.ape, pos[:3], S.state, sslots, 4, 1024, 4)
    yield "outside the state cache", lambda: ops.compress_norm_rope_store(**dict(ck, slot_mapping=big))
    yield "overlap", lambda: ops.compress_norm_rope_store(**dict(ck, overlap=False))
    yield "quant_block", lambda: ops.compress_norm_rope_store(**dict(ck, quant_block=128))
    yield "state_width", lambda: ops.compress_norm_rope_store(**dict(ck, state_width=512))
    yield "head_dim", lambda: ops.compress_norm_rope_store(**dict(ck, head_dim=256))
    yield "kv_cache records", lambda: ops.compress_norm_rope_store(
        **dict(ck, kv_cache=rcache.flash_mla_view(S.pages, S.bs)[:, :, 0, :576]))
    yield "token_to_req_indices must lie", lambda: ops.compress_norm_rope_store(
        **dict(ck, token_to_req_indices=req + 5))
    yield "positions must lie", lambda: ops.compress_norm_rope_store(**dict(ck, positions=pos + 10 ** 6))
    yield "k_cache_metadata.slot_mapping", lambda: ops.compress_norm_rope_store(
        **dict(ck, k_cache_metadata=torch.where(kslots >= 0, kslots + 10 ** 6, kslots)))
    yield "block_table", lambda: ops.compress_norm_rope_store(**dict(ck, block_table=S.state_bt[:, :2]))
    yield "rms_norm_eps", lambda: ops.compress_norm_rope_store(**dict(ck, rms_norm_eps=-1.0))
    yield "store_full_kv", lambda: ops.compress_norm_rope_store(**dict(ck, store_full_kv=True))
    yield "entries for 1000 tokens", lambda: ops.compress_norm_rope_store(**dict(ck, num_actual=10 ** 3))
    # fewer positions than tokens: once wrote the first entries, then failed on an index
    yield "positions has 5 entries for 24 tokens", lambda: ops.compress_norm_rope_store(**dict(ck, positions=pos[:5]))


def test_rejected_calls_change_no_byte():
    S = make_setup(4, "main", [24], seed=9)
    kv_score, pos, req, sslots, kslots = step_inputs(S, {0: (0, 24)})
    kv, score = kv_score.split([1024, 1024], -1)
    ops.save_partial_states(kv, score, S.ape, pos, S.state, sslots, 4, 1024, 4)
    before_pages, before_state = S.pages.clone(), S.state.clone()
    for match, call in _bad_calls(S, kv, score, pos, req, sslots, kslots):
        with pytest.raises(ValueError, match=match):
            call()
        assert torch.equal(S.pages, before_pages) and torch.equal(S.state, before_state), match


# ---- the Triton kernels ------------------------------------------------------------------------------
_INTERPRETED_ENTRY = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, "tests")
    from helpers import patch_interpreter_scalars
    patch_interpreter_scalars()                   # the interpreter's scalar bugs, where the Triton has them
    import torch, triton, triton.language as tl
    from dsv4_rocm.reference import compressor as rc
    from dsv4_rocm.reference.rope import rope_fwd, build_cos_sin_cache
    from dsv4_rocm.triton.compressor import compress_norm_rope_store as K

    @triton.jit
    def entry(state, s0, s1, nb, bt, ncols, pos, w, eps, cs, y_buf, yh_out, ro_out, D: tl.constexpr,
              RATIO: tl.constexpr, OVERLAP: tl.constexpr, SBS: tl.constexpr, NSPLIT: tl.constexpr,
              STREAM: tl.constexpr, GROUPS: tl.constexpr, COLS: tl.constexpr, PREFETCH: tl.constexpr):
        row, ok = K._window(s0, s1, nb, bt, ncols, pos, D, RATIO, OVERLAP, SBS)
        for s in tl.static_range(NSPLIT):                    # column slices, as the split launches pool them
            if STREAM:                                       # COLS: rows a block
                y = K._pool_stream(state, s0, s1, nb, bt, ncols, pos, s * (D // NSPLIT), D // NSPLIT, COLS, GROUPS,
                                   D, RATIO, OVERLAP, SBS, PREFETCH)
            else:
                y = K._pool_slice(state, row, ok, s * (D // NSPLIT), D // NSPLIT, COLS, D, OVERLAP, PREFETCH)
            tl.store(y_buf + s * (D // NSPLIT) + tl.arange(0, D // NSPLIT), y)
        y = tl.load(y_buf + tl.arange(0, D))
        yh, ro = K._norm_rope(y, w, eps, cs + ((pos // RATIO) * RATIO) * 64, D)
        tl.store(yh_out + tl.arange(0, D), yh)
        tl.store(ro_out + tl.arange(0, D), ro)

    g = torch.Generator().manual_seed(0)
    # (ratio, D, pos, column slices, stream, row groups, columns a tile / rows a block, prefetch, state block
    # size): every way the launches pool a window
    for ratio, D, pos, nsplit, st, grp, cols, pf, sbs in (
            (4, 128, 3, 1, 0, 1, 128, 0, 4), (4, 128, 19, 1, 0, 1, 128, 0, 4), (4, 512, 27, 1, 0, 1, 512, 0, 4),
            (4, 512, 27, 2, 0, 1, 64, 1, 4), (4, 128, 19, 1, 1, 2, 2, 1, 4), (4, 128, 19, 2, 1, 1, 4, 0, 2),
            (128, 512, 255, 1, 0, 1, 32, 1, 8), (128, 512, 255, 4, 0, 1, 64, 0, 8),
            (128, 512, 127, 16, 0, 1, 32, 0, 8), (128, 512, 255, 1, 1, 2, 8, 1, 8), (128, 512, 255, 4, 1, 4, 8, 0, 8),
            (128, 512, 135 * 128 - 1, 2, 1, 1, 16, 1, 8), (128, 512, 255, 1, 1, 1, 8, 0, 4)):
        ns = 40
        state = rc.new_state_cache(ns, ratio, D, block_size=sbs)
        state.copy_(torch.randn(state.shape, generator=g) * 2)
        state[..., state.shape[-1] // 2:] -= 40 * torch.rand(state.shape[:-1] + (1,), generator=g)  # spread scores
        bt = torch.randperm(ns, generator=g).to(torch.int32)
        bt[4] = -1                                            # an absent block inside the C4 window at 19
        bt = torch.cat([bt, torch.randint(0, ns, (pos // sbs + 1 - ns,), generator=g).to(torch.int32)]) if \
            pos // sbs >= ns else bt
        w = (1 + 0.1 * torch.randn(D, generator=g)).bfloat16()
        cs = build_cos_sin_cache(160000.0, 20000)
        yh, ro = torch.zeros(D), torch.zeros(D)
        entry[(1,)](state, state.stride(0), state.stride(1), ns, bt, bt.shape[0], pos, w, 1e-6, cs, torch.zeros(D), yh,
                    ro, D=D, RATIO=ratio, OVERLAP=int(ratio == 4), SBS=sbs, NSPLIT=nsplit, STREAM=st, GROUPS=grp,
                    COLS=cols, PREFETCH=pf)
        sc, kv = rc._window_rows(state, bt.view(1, -1), torch.tensor([0]), torch.tensor([pos]), ratio, sbs,
                                 rc.coff(ratio) * D, D)
        ryh = rc.rms_normalize(rc.pool(sc, kv), w, 1e-6)
        rro = rope_fwd(ryh, torch.tensor([(pos // ratio) * ratio]), cs)
        bits = lambda t: t.reshape(-1).view(torch.int32)
        print(ratio, D, pos, nsplit, st, grp, cols, pf, sbs, int((bits(yh) != bits(ryh)).sum()),
              int((bits(ro) != bits(rro)).sum()))
""")


def test_kernel_fp32_arithmetic_equals_the_oracle_under_the_interpreter(tmp_path):
    """The kernel's pooling, norm and RoPE (everything before the bf16 / fp8 conversions, which the
    interpreter does not round like the hardware) give the oracle's fp32 bits exactly."""
    r = run_interpreted(_INTERPRETED_ENTRY, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line.split() for line in r.stdout.strip().splitlines()]
    print("\n".join(" ".join(x) for x in rows))
    assert len(rows) == 13 and all(x[9] == "0" and x[10] == "0" for x in rows)


_INTERPRETED_EXP = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, "tests")
    from helpers import patch_interpreter_scalars
    patch_interpreter_scalars()                   # the interpreter's scalar bugs, where the Triton has them
    import torch, triton, triton.language as tl
    from dsv4_rocm.reference import compressor as rc
    from dsv4_rocm.triton.compressor import compress_norm_rope_store as K

    @triton.jit
    def exp_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, K._exp_neg(tl.load(x_ptr + offs)))

    g = torch.Generator().manual_seed(0)
    edge = torch.tensor([0.0, -0.0, -80.0, float("-inf"), float("nan"), -1e-30, -1e-45, -87.3, -103.0])
    near = torch.nextafter(torch.tensor([-80.0, -80.0, -0.5, -0.5]), torch.tensor([0.0, -100.0, 0.0, -1.0]))
    x = torch.cat([edge, near, -torch.rand(1 << 16, generator=g) * 100, -torch.rand(1 << 12, generator=g)])
    x = torch.cat([x, torch.zeros((-x.numel()) % 1024)])
    out = torch.empty_like(x)
    exp_kernel[(x.numel() // 1024,)](x, out, BLOCK=1024)
    want = rc.exp_neg(x)
    same = (out.view(torch.int32) == want.view(torch.int32)) | (torch.isnan(out) & torch.isnan(want))
    print(x.numel(), int((~same).sum()))
""")


def test_kernel_exp_equals_the_oracle_bit_for_bit(tmp_path):
    """The kernel's exponential (its own NaN handling) gives the oracle's bits on random, boundary and
    special inputs (x <= 0: scores minus their max)."""
    r = run_interpreted(_INTERPRETED_EXP, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    n, bad = r.stdout.split()
    print(f"{n} values, {bad} differ")
    assert int(n) > 60000 and bad == "0"


_INTERPRETED_SAVE = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, "tests")
    from helpers import patch_interpreter_scalars
    patch_interpreter_scalars()                   # the interpreter's scalar bugs, where the Triton has them
    import torch
    from dsv4_rocm.reference import compressor as rc
    from dsv4_rocm.triton.compressor.save_partial_states import save_partial_states
    g = torch.Generator().manual_seed(0)
    for ratio, D in ((4, 512), (128, 512), (4, 128)):
        c, sbs = rc.coff(ratio), rc.state_block_size(ratio)
        T, ns = 21, 9
        ks = torch.randn(T, 2 * c * D, generator=g)
        kv, sc = ks.split([c * D, c * D], -1)
        ape = torch.randn(ratio, c * D, generator=g)
        pos = torch.randint(0, 1000, (T,), generator=g)
        slots = torch.randperm(ns * sbs, generator=g)[:T]
        slots[[2, 7]] = -1
        slots[5] = ns * sbs + 3                                # out of range: skipped by the kernel
        a = rc.new_state_cache(ns, ratio, D)
        a.copy_(torch.randn(a.shape, generator=g))
        b = [a.clone() for _ in range(3)]
        rc.save_partial_states(kv, sc, ape, pos, a, slots, sbs, c * D, ratio)
        for tokens, bi in zip((1, 2, 4), b):                    # 21 tokens: the last program is partial
            save_partial_states(kv, sc, ape, pos, bi, slots, sbs, c * D, ratio, config=dict(tokens=tokens))
        print(ratio, D, sum(int((a.view(torch.int32) != bi.view(torch.int32)).sum()) for bi in b))
""")


def test_save_partial_states_kernel_equals_the_oracle_under_the_interpreter(tmp_path):
    r = run_interpreted(_INTERPRETED_SAVE, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line.split() for line in r.stdout.strip().splitlines()]
    assert len(rows) == 3 and all(x[2] == "0" for x in rows), rows


_INTERPRETED_ENTRIES = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, "tests")
    from helpers import patch_interpreter_scalars
    patch_interpreter_scalars()                   # the interpreter's scalar bugs, where the Triton has them
    import torch
    from dsv4_rocm.triton.compressor.compressor_entries import compressor_entries
    g = torch.Generator().manual_seed(0)
    for ratio in (4, 128):
        n = 3000
        pos = torch.randint(-2, 5000, (n,), generator=g)
        pos[::7] = (pos[::7] // ratio) * ratio + ratio - 1              # plenty of boundary tokens
        sslots = torch.randint(-1, 100, (n,), generator=g)
        kslots = torch.randint(-1, 60, (n,), generator=g)
        t2r = torch.randint(-1, 9, (n,), generator=g).to(torch.int32)
        want = ((sslots >= 0) & (pos >= 0) & (pos < 4096) & ((pos + 1) % ratio == 0) & (t2r >= 0) & (t2r < 8)
                & (kslots >= 0) & (kslots < 50))
        want[n - 5:] = False                                            # num_actual stops before them
        for cap in (n, int(want.sum()) - 3):
            lst, cnt = compressor_entries(pos, sslots, kslots, t2r, n - 5, ratio, 4096, 8, 50, cap)
            got = sorted(lst[:min(int(cnt), cap)].tolist())
            expect = torch.nonzero(want).flatten().tolist()
            ok = int(cnt) == len(expect) and set(got) <= set(expect) and len(set(got)) == min(cap, len(expect))
            print(ratio, cap, int(cnt), len(expect), ok)
""")


def test_entry_list_kernel_under_the_interpreter(tmp_path):
    """The boundary-token list (integer work, exact under the interpreter): every entry listed once, the
    count exact, nothing written past the capacity."""
    r = run_interpreted(_INTERPRETED_ENTRIES, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line.split() for line in r.stdout.strip().splitlines()]
    print(rows)
    assert len(rows) == 4 and all(x[4] == "True" for x in rows)


_INTERPRETED_CONFIGS = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, "tests")
    from helpers import patch_interpreter_scalars
    patch_interpreter_scalars()                   # the interpreter's scalar bugs, where the Triton has them
    sys.path.insert(0, "tests/compressor")
    import torch
    from dsv4_rocm import ops
    from dsv4_rocm.reference import compressor as rc
    from dsv4_rocm.triton.compressor.compress_norm_rope_store import compress_norm_rope_store as kernel
    from compressor_batches import RECORD, compress_kwargs, make_setup, step_inputs

    def records(S, pos, sslots, kslots):
        # bytes of the records of the step's entries (the only bytes a step may write)
        ts, sd = RECORD[S.target]
        m = torch.zeros_like(S.pages, dtype=torch.bool)
        for p, s, k in zip(pos.tolist(), sslots.tolist(), kslots.tolist()):
            if s >= 0 and k >= 0 and (p + 1) % S.ratio == 0:
                page, off = k // S.bs, k % S.bs
                m[page, off * ts:(off + 1) * ts] = True
                m[page, S.bs * ts + off * sd:S.bs * ts + (off + 1) * sd] = True
        return m

    # prefill-sized steps (mixed with decode tokens and padding), then a decode-sized step
    CASES = ((4, [44, 9, 32],
              [{0: (0, 12), 1: (0, 9), 2: (0, 30)}, {0: (12, 43), 2: (30, 31)}, {0: (43, 44), 2: (31, 32)}],
              [dict(), dict(chunk=8), dict(grid="list"), dict(nsplit=2, cols=64, prefetch=True, finish_warps=2)]),
             (128, [300, 256, 260],
              [{0: (0, 100), 1: (0, 127), 2: (0, 120)}, {0: (100, 300), 1: (127, 255), 2: (120, 260)}, {1: (255, 256)}],
              [dict(), dict(pool="tile", nsplit=16, cols=32, num_warps=4, finish_warps=4),
               dict(grid="list", nsplit=4, groups=2, num_warps=2),
               dict(chunk=32, pool="tile", cols=64, prefetch=False)]))
    for ratio, lens, steps, configs in CASES:
        S0 = make_setup(ratio, "main", lens, "cpu", seed=5)
        c, sbs = rc.coff(ratio), rc.state_block_size(ratio)
        outs, entries, stray = [], 0, 0
        for cfg in configs:
            S = S0.clone()
            for ranges in steps:
                kv_score, pos, req, sslots, kslots = step_inputs(S, ranges, pad=3)
                kv, score = kv_score.split([c * S.D, c * S.D], dim=-1)
                ops.save_partial_states(kv, score, S.ape, pos, S.state, sslots, sbs, c * S.D, ratio)
                before = S.pages.clone()
                kernel(**compress_kwargs(S, sslots.shape[0], req, pos, sslots, kslots), config=cfg)
                region = records(S, pos, sslots, kslots)
                entries += int(region.sum())
                stray += int(((S.pages != before) & ~region).sum())
            outs.append(S.pages)
        print(ratio, len(configs), entries, stray, sum(int((o != outs[0]).sum()) for o in outs))
""")


def test_kernel_grids_and_poolings_write_the_same_records_under_the_interpreter(tmp_path):
    """The whole compress kernel under the interpreter, on mixed steps with padding: every grid (per token,
    chunks of tokens, listed entries) and pooling (one program an entry, column slices then a finishing
    launch, tiles with and without prefetch) writes the same bytes, and only inside the step's records.
    (Value exactness against the oracle is the GPU tests' job: the interpreter rounds fp8 / bf16 its own
    way; the fp32 part is checked above.)"""
    r = run_interpreted(_INTERPRETED_CONFIGS, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line.split() for line in r.stdout.strip().splitlines()]
    print(rows)
    assert len(rows) == 2 and all(int(x[2]) > 0 and x[3] == "0" and x[4] == "0" for x in rows)


# ---- GPU: Triton vs the oracle, byte for byte --------------------------------------------------------
def _both(setup_fn, schedule, pad=0):
    """Run a schedule with the oracle on the CPU and with Triton on the GPU, from the same start."""
    base = setup_fn()
    ref = run_schedule(base.to("cpu"), schedule, pad)
    with ops.use_backend("triton"):
        tri = run_schedule(base.clone(), schedule, pad)
    return base.to("cpu"), ref, tri.to("cpu")


def _diff(a, b):
    return int((a.cpu().view(torch.uint8) != b.cpu().view(torch.uint8)).sum())


def _random_schedule(g, lens, steps):
    """Steps that mix prefill chunks of some requests with single decode tokens of others."""
    done = [0] * len(lens)
    sched = []
    for _ in range(steps):
        ranges = {}
        for b, n in enumerate(lens):
            if done[b] >= n or torch.rand(1, generator=g).item() < 0.2:
                continue
            k = 1 if torch.rand(1, generator=g).item() < 0.5 else int(torch.randint(1, 300, (1,), generator=g))
            ranges[b] = (done[b], min(n, done[b] + k))
            done[b] = ranges[b][1]
        if ranges:
            sched.append(ranges)
    sched.append({b: (done[b], n) for b, n in enumerate(lens) if done[b] < n})
    return [s for s in sched if s]


@pytest.mark.gpu
@pytest.mark.parametrize("ratio, target", TARGETS)
@pytest.mark.parametrize("seed", [0, 1])
def test_triton_equals_oracle_bytes_on_mixed_batches(ratio, target, seed):
    g = torch.Generator().manual_seed(100 + seed)
    lens = [int(x) for x in torch.randint(1, 700 if ratio == 128 else 200, (6,), generator=g)]
    lens[0] = 2 * ratio + ratio // 2
    sched = _random_schedule(g, lens, 6)
    base, ref, tri = _both(lambda: make_setup(ratio, target, lens, "cuda", seed, scale=2.0), sched, pad=3)
    n_pages, n_state = _diff(ref.pages, tri.pages), _diff(ref.state, tri.state)
    changed = _diff(ref.pages, base.pages)
    print(f"{target} C{ratio} lens {lens}: {changed} cache bytes written, {n_pages} differ; "
          f"state bytes differ {n_state}")
    assert changed > 0 and n_pages == 0 and n_state == 0


def _sweep_configs():
    from dsv4_rocm.bench.compressor import SWEEP
    return [(r, t, v, s, c) for (r, t), vs in SWEEP.items() for v, (s, c, _) in vs.items() if v != "default"]


@pytest.mark.gpu
@pytest.mark.parametrize("ratio, target, variant, save_cfg, comp_cfg", _sweep_configs(),
                         ids=[f"C{r}-{t}-{v}" for r, t, v, _, _ in _sweep_configs()])
def test_triton_sweep_configs_equal_oracle_bytes(ratio, target, variant, save_cfg, comp_cfg):
    """Every launch configuration the benchmark sweep times writes the oracle's bytes on mixed steps."""
    from dsv4_rocm.triton.compressor.compress_norm_rope_store import compress_norm_rope_store
    from dsv4_rocm.triton.compressor.save_partial_states import save_partial_states
    g = torch.Generator().manual_seed(7)
    lens = [int(x) for x in torch.randint(1, 700 if ratio == 128 else 200, (6,), generator=g)]
    lens[0] = 2 * ratio + ratio // 2
    sched = _random_schedule(g, lens, 6)
    base = make_setup(ratio, target, lens, "cuda", 7, scale=2.0)
    ref = run_schedule(base.to("cpu"), sched, 3)
    S, c = base.clone(), rc.coff(ratio)
    for ranges in sched:
        kv_score, pos, req, sslots, kslots = step_inputs(S, ranges, 3)
        kv, score = kv_score.split([c * S.D, c * S.D], dim=-1)
        save_partial_states(kv, score, S.ape, pos, S.state, sslots, rc.state_block_size(ratio), c * S.D, ratio,
                            config=save_cfg)
        compress_norm_rope_store(**compress_kwargs(S, sslots.shape[0], req, pos, sslots, kslots), config=comp_cfg)
    assert _diff(ref.pages, S.pages) == 0 and _diff(ref.state, S.state) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("ratio, target", TARGETS)
def test_triton_poisons_like_the_oracle(ratio, target):
    def setup():
        S = make_setup(ratio, target, [3 * ratio, 2 * ratio], "cuda", 3)
        S.kv_score[0][ratio + 2, 5] = float("nan")
        S.kv_score[1][1, ratio * 2 - 1] = float("inf")
        S.kv_score[1][ratio, :] *= 1e30                     # a finite window whose sum of squares overflows
        return S
    _, ref, tri = _both(setup, [{0: (0, 3 * ratio), 1: (0, 2 * ratio)}])
    assert _diff(ref.pages, tri.pages) == 0 and _diff(ref.state, tri.state) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("ratio, target", [(4, "main"), (128, "main"), (4, "fp8")])
def test_triton_decode_step_replays_from_a_cuda_graph(ratio, target):
    """A decode step (state save + compress for b requests, padded to the graph's size) captured once and
    replayed with new positions and inputs copied into its buffers, against the oracle."""
    b, pad = 16, 4
    lens = [3 * ratio - 1 + i for i in range(b)]            # request 0's first decode token closes a window
    S = make_setup(ratio, target, [n + 2 for n in lens], "cuda", 11)
    R = S.to("cpu")
    with ops.use_backend("triton"):
        run_schedule(S, [{i: (0, n) for i, n in enumerate(lens)}])
    run_schedule(R, [{i: (0, n) for i, n in enumerate(lens)}])
    kv_score, pos, req, sslots, kslots = step_inputs(S, {i: (n, n + 1) for i, n in enumerate(lens)}, pad)
    c = rc.coff(ratio)
    bufs = [t.clone() for t in (kv_score, pos, req, sslots, kslots)]

    def step():
        kv, score = bufs[0].split([c * S.D, c * S.D], -1)
        ops.save_partial_states(kv, score, S.ape, bufs[1], S.state, bufs[3], rc.state_block_size(ratio), c * S.D,
                                ratio)
        ops.compress_norm_rope_store(**compress_kwargs(S, bufs[3].shape[0], bufs[2], bufs[1], bufs[3], bufs[4]))

    with ops.use_backend("triton"):
        step()                                              # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for k in (0, 1):                                    # replay two decode steps with fresh inputs
            new = step_inputs(S, {i: (n + k, n + k + 1) for i, n in enumerate(lens)}, pad)
            for buf, t in zip(bufs, new):
                buf.copy_(t)
            graph.replay()
            with ops.use_backend(None):                         # the oracle runs on the CPU copy
                run_step(R, {i: (n + k, n + k + 1) for i, n in enumerate(lens)}, pad)
    torch.cuda.synchronize()
    assert _diff(R.pages, S.pages) == 0 and _diff(R.state, S.state) == 0


@pytest.mark.gpu
def test_triton_is_chunk_invariant_and_skips_garbage_indices():
    lens = [300, 129]
    one, chunked = SCHEDULES[128]
    tok = [{b: (p, p + 1) for b in range(2) if p < lens[b]} for p in range(max(lens))]
    base = make_setup(128, "main", lens, "cuda", 12)
    with ops.use_backend("triton"):
        runs = [run_schedule(base.clone(), s) for s in (one, chunked, tok)]
    assert all(torch.equal(r.pages, runs[0].pages) and torch.equal(r.state, runs[0].state) for r in runs)
    S = base.clone()                                        # out-of-range indices reach the kernel unchecked
    kv_score, pos, req, sslots, kslots = step_inputs(S, {0: (0, 256)})
    before = S.pages.clone()
    bad_req = torch.full_like(req, 10 ** 6)
    with ops.use_backend("triton"):
        ops.save_partial_states(*kv_score.split([512, 512], -1), S.ape, pos, S.state, sslots, 8, 512, 128)
        ops.compress_norm_rope_store(**compress_kwargs(S, 256, bad_req, pos, sslots, kslots))
        ops.compress_norm_rope_store(**compress_kwargs(S, 256, req, pos, sslots, kslots + 10 ** 9))
    torch.cuda.synchronize()
    assert torch.equal(S.pages, before)
