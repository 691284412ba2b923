"""dsv4_rocm.flash_mla: FlashMLA's API (names, positional order, defaults, returns) plus vLLM's out=
buffer. On CPU the API logic runs the reference backend: every form FlashMLA accepts gives the same
result as its plain form, bad input is a ValueError naming the argument and changes nothing. On a GPU the
same forms run the kernels against the reference. The record format comes from the caches' last dimension
(584 / 528 / 288), as FlashMLA detects it; pairs FlashMLA has not are refused by name. The FlashMLA test
suite itself runs through this API in gpu/flashmla_cases.py (checked here up to the point where it needs a
GPU), and its V4.1 release's cases in gpu/flashmla_cases_v41.py (a small CPU subset here)."""
import inspect
import os
import subprocess
import sys

import pytest
import torch

from dsv4_rocm import flash_mla
from dsv4_rocm import layout as L
from dsv4_rocm.reference import attention as ra
from sparse_mla_inputs import (SM, check_lonely, check_out, decode_args, decode_case, decode_key_amax, padded_out,
                               prefill_case, prefill_key_amax, strided)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def call_decode(a, meta=None, **kw):
    """flash_mla_with_kvcache called positionally, as FlashMLA's tests (lib.run_flash_mla_decode) do."""
    meta = meta if meta is not None else flash_mla.get_mla_metadata()[0]
    args = dict(block_table=None, cache_seqlens=None, head_dim_v=512, num_splits=None, softmax_scale=SM,
                causal=False, is_fp8_kvcache=True)
    extra = {k: kw.pop(k) for k in list(kw) if k not in args and k != "out"}    # keywords past FlashMLA's
    args.update(kw)
    out = args.pop("out", None)
    return flash_mla.flash_mla_with_kvcache(
        a["q"], a["k_cache"], args["block_table"], args["cache_seqlens"], args["head_dim_v"], meta,
        args["num_splits"], args["softmax_scale"], args["causal"], args["is_fp8_kvcache"], a["indices"],
        a["attn_sink"], a["extra_k_cache"], a["extra_indices_in_kvcache"], a["topk_length"], a["extra_topk_length"],
        **({"out": out} if out is not None else {}), **extra)


def test_signatures_are_flashmlas():
    p = inspect.signature(flash_mla.flash_mla_with_kvcache).parameters
    assert list(p)[:16] == ["q", "k_cache", "block_table", "cache_seqlens", "head_dim_v", "tile_scheduler_metadata",
                            "num_splits", "softmax_scale", "causal", "is_fp8_kvcache", "indices", "attn_sink",
                            "extra_k_cache", "extra_indices_in_kvcache", "topk_length", "extra_topk_length"]
    assert p["out"].kind == inspect.Parameter.KEYWORD_ONLY and p["softmax_scale"].default is None
    p = inspect.signature(flash_mla.flash_mla_sparse_fwd).parameters
    assert list(p)[:7] == ["q", "kv", "indices", "sm_scale", "d_v", "attn_sink", "topk_length"]
    assert p["d_v"].default == 512 and p["out"].kind == inspect.Parameter.KEYWORD_ONLY
    meta, none = flash_mla.get_mla_metadata(torch.zeros(3), 64, 1, anything=True)
    assert none is None and not meta.have_initialized


def test_decode_returns_flashmla_layout_and_matches_reference():
    a = decode_case(3, 2, 64, 64, 64, 2, 32, "cpu", 5)
    out, lse = call_decode(a)
    assert out.shape == (3, 2, 64, 512) and out.dtype == torch.bfloat16
    assert lse.shape == (3, 64, 2) and lse.dtype == torch.float32 and lse.stride() == (128, 1, 64)
    ref, ref_lse = ra.flash_mla_with_kvcache_sparse(*decode_args(a))
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)


def _decode_forms(a):
    """The same call in every form FlashMLA (or vLLM) passes it, with the plain form's expected result."""
    b, s_q = a["q"].shape[:2]
    yield "fp8 caches", dict(a, k_cache=a["k_cache"].view(torch.float8_e4m3fn),
                             extra_k_cache=a["extra_k_cache"].view(torch.float8_e4m3fn))
    yield "int8 caches", dict(a, k_cache=a["k_cache"].view(torch.int8), extra_k_cache=a["extra_k_cache"].view(torch.int8))
    yield "3-D caches", dict(a, k_cache=a["k_cache"][:, :, 0], extra_k_cache=a["extra_k_cache"][:, :, 0])
    yield "unpadded pages", dict(a, k_cache=a["k_cache"].contiguous())       # 64 x 584 B: still 16-B aligned
    yield "strided q and indices", dict(a, q=strided(a["q"]), indices=strided(a["indices"]),
                                        extra_indices_in_kvcache=strided(a["extra_indices_in_kvcache"]))
    yield "[b, s_q] lengths", dict(a, topk_length=a["topk_length"].unsqueeze(1).expand(b, s_q),
                                   extra_topk_length=strided(a["extra_topk_length"].unsqueeze(1).repeat(1, s_q)))
    invalid = a["indices"].clone()
    bad = invalid < 0
    cap = a["k_cache"].shape[0] * a["k_cache"].shape[1]
    invalid[bad] = torch.tensor([-2 ** 31, 2 ** 31 - 1, cap, -5], dtype=torch.int32,
                                device=invalid.device).repeat(bad.numel())[:int(bad.sum())]
    yield "invalid indices of every kind", dict(a, indices=invalid)


def test_every_accepted_form_gives_the_plain_result():
    a = decode_case(4, 2, 64, 64, 48, 3, 40, "cpu", 8)
    a["indices"][1, 0, ::3] = -1
    ref, ref_lse = call_decode(a)
    for name, form in _decode_forms(a):
        out, lse = call_decode(form)
        assert torch.equal(out, ref) and torch.equal(lse, ref_lse), name


def test_out_buffer_is_written_in_place_and_returned():
    a = decode_case(3, 1, 128, 64, 64, 2, 32, "cpu", 6)
    ref, ref_lse = call_decode(a)
    out, back = padded_out((3, 1, 128, 512), "cpu")
    before = back.clone()
    res, lse = call_decode(a, out=out)
    assert res is out and torch.equal(out, ref) and torch.equal(lse, ref_lse)
    written = torch.zeros_like(back, dtype=torch.bool)
    written[:3, :, :128] = True
    assert torch.equal(back[~written].view(torch.int16), before[~written].view(torch.int16))
    # vLLM's form: out=output.unsqueeze(1), keywords only
    o2 = torch.empty(3, 128, 512, dtype=torch.bfloat16)
    flash_mla.flash_mla_with_kvcache(q=a["q"], k_cache=a["k_cache"], block_table=None, head_dim_v=512,
                                     tile_scheduler_metadata=flash_mla.get_mla_metadata()[0], cache_seqlens=None,
                                     is_fp8_kvcache=True, indices=a["indices"], topk_length=a["topk_length"],
                                     softmax_scale=SM, attn_sink=a["attn_sink"], extra_k_cache=a["extra_k_cache"],
                                     extra_indices_in_kvcache=a["extra_indices_in_kvcache"],
                                     extra_topk_length=a["extra_topk_length"], out=o2.unsqueeze(1))
    assert torch.equal(o2, ref[:, 0])


@pytest.mark.parametrize("sink", ["none", "-inf", "+inf"])
def test_sinks_and_defaults(sink):
    a = decode_case(2, 1, 64, 64, 32, 0, 0, "cpu", 4, sink)
    out, lse = call_decode(a, softmax_scale=None)                          # FlashMLA's default: d_qk^-0.5
    ref, ref_lse = ra.flash_mla_with_kvcache_sparse(*decode_args(a))
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    if sink == "+inf":
        assert torch.equal(out, torch.zeros_like(out)) and torch.isfinite(lse[a["topk_length"] > 0]).all()
    if sink == "-inf":
        nosink, _ = call_decode(dict(a, attn_sink=None))
        assert torch.equal(out, nosink)


def test_empty_batches_topk_zero_and_lonely_queries():
    for b, s_q in ((0, 1), (2, 0)):
        a = decode_case(b, s_q, 64, 64, 32, 2, 16, "cpu", 1)
        out, lse = call_decode(a)
        assert out.shape == (b, s_q, 64, 512) and lse.shape == (b, 64, s_q)
    a = decode_case(2, 2, 64, 64, 0, 2, 0, "cpu", 1)
    out, lse = call_decode(a)
    check_lonely(out, lse, slice(None))
    q, kv, idx, lens, s = prefill_case(4, 64, 32, 40, "cpu", 2)
    out, mx, lse = flash_mla.flash_mla_sparse_fwd(q, kv, idx, None, 512, s, lens)
    check_lonely(out, lse, [0, 1], mx)
    out, mx, lse = flash_mla.flash_mla_sparse_fwd(q[:0], kv, idx[:0], None, 512, s, lens[:0])
    assert out.shape == (0, 64, 512) and mx.shape == lse.shape == (0, 64)
    out, mx, lse = flash_mla.flash_mla_sparse_fwd(q, kv[:0], idx, None)
    check_lonely(out, lse, slice(None), mx)
    out, mx, lse = flash_mla.flash_mla_sparse_fwd(q, kv, idx[:, :, :0], None)
    check_lonely(out, lse, slice(None), mx)


def test_prefill_forms():
    q, kv, idx, lens, s = prefill_case(5, 128, 48, 60, "cpu", 4)
    ref = ra.flash_mla_sparse_fwd(q, kv, idx, SM, 512, s, lens)
    out, mx, lse = flash_mla.flash_mla_sparse_fwd(q, kv, idx, None, 512, s, lens)      # sm_scale None: 512^-0.5
    assert torch.equal(out, ref[0]) and torch.equal(mx, ref[1]) and torch.equal(lse, ref[2])
    o, back = padded_out((5, 128, 512), "cpu")
    res = flash_mla.flash_mla_sparse_fwd(strided(q), strided(kv), strided(idx), SM, attn_sink=s,
                                         topk_length=strided(lens), out=o)
    assert res[0] is o and torch.equal(o, ref[0]) and torch.equal(res[2], ref[2])
    assert torch.isnan(back[5:]).all() and torch.isnan(back[:, 128:]).all()


def test_block_table_and_cache_seqlens_are_accepted_and_ignored():
    a = decode_case(2, 1, 64, 64, 32, 0, 0, "cpu", 3)
    ref, _ = call_decode(a)
    for bt, sl in ((torch.zeros(2, 5, dtype=torch.int32), torch.full((2,), 7, dtype=torch.int32)),
                   (torch.zeros(9, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int32))):
        out, _ = call_decode(a, block_table=bt, cache_seqlens=sl)
        assert torch.equal(out, ref)


def test_scheduling_object_keeps_flashmlas_contract():
    a = decode_case(2, 1, 64, 64, 32, 2, 16, "cpu", 3)
    meta, _ = flash_mla.get_mla_metadata()
    with pytest.raises(ValueError, match="indices"):
        call_decode(dict(a, indices=a["indices"].long()), meta)
    assert not meta.have_initialized                       # a rejected call does not tie it to a shape
    call_decode(a, meta)
    assert meta.have_initialized and meta.config.b == 2 and meta.config.extra_topk == 16
    call_decode(dict(a, q=a["q"] * 2), meta)               # same shape, other values: fine
    b = decode_case(3, 1, 64, 64, 32, 2, 16, "cpu", 3)
    with pytest.raises(ValueError, match="tile_scheduler_metadata was initialized"):
        call_decode(b, meta)


def _bad_decode_calls(a):
    """(match, keyword changes) of calls FlashMLA rejects or that are garbage."""
    q = a["q"]
    yield "tile_scheduler_metadata", dict(meta="x")
    yield "num_splits", dict(num_splits=torch.zeros(1))
    yield "causal", dict(causal=True)
    yield "is_fp8_kvcache", dict(is_fp8_kvcache=False)
    yield "head_dim_v", dict(head_dim_v=576)
    yield "indices is required", dict(indices=None)
    yield "block_table", dict(block_table=[0, 1])
    yield "cache_seqlens", dict(cache_seqlens=torch.ones(2))
    yield "softmax_scale", dict(softmax_scale=float("nan"))
    yield "q must have dtype", dict(q=q.float())
    yield "q must be 4-D", dict(q=q[0])
    yield "d_qk = 512", dict(q=torch.zeros(*q.shape[:3], 576, dtype=torch.bfloat16))
    yield "64 or 128 heads", dict(q=q[:, :, :32])
    yield "q must have a contiguous last dimension", dict(q=torch.zeros(2, 1, 64, 1024, dtype=torch.bfloat16)[..., ::2])
    yield "k_cache must have dtype", dict(k_cache=torch.zeros(2, 64, 1, 584, dtype=torch.float16))
    yield "k_cache must have shape", dict(k_cache=a["k_cache"][..., :583])
    yield "k_cache: page stride", dict(k_cache=torch.as_strided(torch.zeros(4 * 37380, dtype=torch.uint8),
                                                                (4, 64, 1, 584), (37380, 584, 584, 1)))
    yield "indices must have dtype", dict(indices=a["indices"].long())
    yield "indices must have shape", dict(indices=a["indices"][:1])
    yield "indices must have a contiguous last dimension", dict(indices=a["indices"].repeat(1, 1, 2)[..., ::2])
    yield "topk_length must have shape", dict(topk_length=a["topk_length"][:1])
    yield "topk_length must have dtype", dict(topk_length=a["topk_length"].long())
    yield "topk_length must lie in", dict(topk_length=a["topk_length"] + 100)
    yield "extra_topk_length must lie in", dict(extra_topk_length=a["extra_topk_length"] - 100)
    yield "extra_k_cache is None", dict(extra_k_cache=None)
    yield "extra_indices_in_kvcache must be given", dict(extra_indices_in_kvcache=None, extra_topk_length=None)
    yield "attn_sink must have dtype", dict(attn_sink=a["attn_sink"].double())
    yield "attn_sink must have shape", dict(attn_sink=a["attn_sink"][:32])
    yield "out must have shape", dict(out=torch.empty(2, 1, 64, 256, dtype=torch.bfloat16))
    yield "out must have dtype", dict(out=torch.empty(2, 1, 64, 512))


def test_bad_decode_input_is_rejected_naming_the_argument_and_writes_nothing():
    a = decode_case(2, 1, 64, 64, 32, 2, 16, "cpu", 3)
    out = torch.full((2, 1, 64, 512), 7.0, dtype=torch.bfloat16)
    for match, change in _bad_decode_calls(a):
        kw = dict(change)
        meta = kw.pop("meta", None)
        tensors = {k: v for k, v in kw.items() if k in a}
        rest = {k: v for k, v in kw.items() if k not in a}
        rest.setdefault("out", out)
        with pytest.raises(ValueError, match=match):
            if meta is not None:
                flash_mla.flash_mla_with_kvcache(a["q"], a["k_cache"], None, None, 512, meta, indices=a["indices"],
                                                 is_fp8_kvcache=True, out=out)
            else:
                call_decode(dict(a, **tensors), **rest)
        assert torch.equal(out, torch.full_like(out, 7.0)), match


# ---- DeepSeek-V4.1 records ------------------------------------------------------------------------------
V41 = [((L.V41_528, L.V41_528), "page_split"), ((L.V41_528, L.V41_FP4_288), "page_split"),
       ((L.interleaved(L.V41_528), L.interleaved(L.V41_FP4_288)), "interleaved")]


@pytest.mark.parametrize("fmts, layout", V41, ids=["v41+v41", "v41+fp4", "v41+fp4 interleaved"])
def test_v41_records_are_detected_from_the_last_dim(fmts, layout):
    a = decode_case(3, 2, 64, 5, 40, 3, 24, "cpu", 9, num_blocks=9, formats=fmts)
    assert a["k_cache"].shape[-1] == 528 and a["extra_k_cache"].shape[-1] == fmts[1].token_bytes
    kw = {} if layout == "interleaved" else dict(kv_layout=layout)        # interleaved: V4.1's default
    out, lse = call_decode(a, **kw)
    ref, ref_lse = ra.flash_mla_with_kvcache_sparse(*decode_args(a), formats=fmts)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    if layout == "page_split":       # the same bytes read in the other layout are other keys: the layout matters
        other = call_decode(a, kv_layout="interleaved")[0]
        assert not torch.equal(other, out)


def test_format_pairs_flashmla_lacks_are_refused_by_name():
    v40 = decode_case(2, 1, 64, 64, 32, 2, 16, "cpu", 3)
    v41 = decode_case(2, 1, 64, 5, 32, 3, 16, "cpu", 4, num_blocks=9, formats=(L.V41_528, L.V41_FP4_288))
    out = torch.full((2, 1, 64, 512), 7.0, dtype=torch.bfloat16)
    bad = [("k_cache: a V41_FP4_288 cache .* only supported as extra_k_cache",
            dict(v41, k_cache=v41["extra_k_cache"], indices=v41["extra_indices_in_kvcache"],
                 topk_length=v41["extra_topk_length"])),
           ("extra_k_cache: invalid kv format pair, V40_584 .* and V41_FP4_288", dict(v40, **{
               k: v41[k] for k in ("extra_k_cache", "extra_indices_in_kvcache", "extra_topk_length")})),
           ("extra_k_cache: invalid kv format pair, V41_528 .* and V40_584", dict(v41, **{
               k: v40[k] for k in ("extra_k_cache", "extra_indices_in_kvcache", "extra_topk_length")})),
           ("k_cache must have shape .* 584 / 528 / 288", dict(v41, k_cache=v41["k_cache"][..., :300]))]
    for match, a in bad:
        with pytest.raises(ValueError, match=match):
            call_decode(a, out=out)
        assert torch.equal(out, torch.full_like(out, 7.0)), match
    with pytest.raises(ValueError, match="V40_584 records .* page-split only"):
        call_decode(v40, kv_layout="interleaved")
    with pytest.raises(ValueError, match="kv_layout must be"):
        call_decode(v41, kv_layout="paged")


def test_enable_batch_invariant():
    """FlashMLA's later argument, positional after extra_topk_length: accepted, part of the scheduling
    object's shape, and the result of each query is that of the query alone."""
    a = decode_case(3, 2, 64, 64, 32, 2, 16, "cpu", 5)
    meta = flash_mla.get_mla_metadata()[0]
    args = (a["q"], a["k_cache"], None, None, 512, meta, None, SM, False, True, a["indices"], a["attn_sink"],
            a["extra_k_cache"], a["extra_indices_in_kvcache"], a["topk_length"], a["extra_topk_length"])
    out, lse = flash_mla.flash_mla_with_kvcache(*args, True)
    assert meta.config.enable_batch_invariant is True
    with pytest.raises(ValueError, match="tile_scheduler_metadata was initialized"):
        flash_mla.flash_mla_with_kvcache(*args, False)
    with pytest.raises(ValueError, match="enable_batch_invariant must be a bool"):
        flash_mla.flash_mla_with_kvcache(*args[:5], flash_mla.get_mla_metadata()[0], *args[6:], 1)
    one = {k: (v[1:2] if isinstance(v, torch.Tensor) and k not in ("k_cache", "extra_k_cache", "attn_sink") else v)
           for k, v in a.items()}
    o1, l1 = call_decode(one, enable_batch_invariant=True)
    assert torch.equal(o1[0], out[1]) and torch.equal(l1[0], lse[1])


def test_bad_prefill_input_is_rejected_naming_the_argument():
    q, kv, idx, lens, s = prefill_case(3, 64, 16, 20, "cpu", 1)
    bad = [("kv must have shape", dict(kv=kv.repeat(1, 2, 1))), ("d_v", dict(d_v=576)),
           ("sm_scale", dict(sm_scale="0.1")), ("indices must have shape", dict(indices=idx[:2])),
           ("topk_length must have shape", dict(topk_length=lens[:2])), ("attn_sink", dict(attn_sink=s[:3])),
           ("topk_length must lie in", dict(topk_length=-lens - 1)), ("kv must have dtype", dict(kv=kv.float())),
           ("d_qk = 512", dict(q=torch.zeros(3, 64, 576, dtype=torch.bfloat16))),
           ("out must have shape", dict(out=torch.empty(3, 128, 512, dtype=torch.bfloat16)))]
    for match, change in bad:
        kw = dict(q=q, kv=kv, indices=idx, sm_scale=SM, d_v=512, attn_sink=s, topk_length=lens)
        kw.update(change)
        out = kw.pop("out", None)
        with pytest.raises(ValueError, match=match):
            flash_mla.flash_mla_sparse_fwd(**kw, out=out)


def test_warmup_configs():
    cfgs = flash_mla.model_warmup_configs()
    assert len(cfgs) == 24 and len(set(cfgs)) == 24
    assert {c.heads for c in cfgs} == {64, 128} and {c.block_size for c in cfgs} == {64, 256}
    assert {c.extra_block_size for c in cfgs} == {None, 64, 2} and {c.lengths for c in cfgs} == {True, False}
    assert flash_mla.warmup("cpu") == dict(kernels=0, compiled=0, seconds=0.0, cache_dir=None)   # nothing to compile
    # one model's configurations: V4-Flash's 64 heads at every TP size; V4-Pro's 128 (TP 1) and 64 (TP >= 2)
    assert flash_mla.model_heads("v4-flash") == (64,) and flash_mla.model_heads("v4-pro") == (64, 128)
    flash = flash_mla.model_warmup_configs(model="v4-flash")
    assert len(flash) == 12 and {c.heads for c in flash} == {64}
    assert set(flash_mla.model_warmup_configs(model="v4-pro")) == set(cfgs)


def test_kernel_cache_dir(monkeypatch, tmp_path):
    """dsv4_rocm's compiles run with Triton's cache directory set to its own kernel cache, restored after."""
    from dsv4_rocm.triton import _launch
    if _launch._knobs is None:
        pytest.skip("the kernel cache context needs triton.knobs (Triton >= 3.4)")
    from triton import knobs
    monkeypatch.setenv("DSV4_KERNEL_CACHE", str(tmp_path))
    assert _launch.kernel_cache_dir() == str(tmp_path)
    prev = knobs.cache.dir
    with _launch.kernel_cache() as d:
        assert d == str(tmp_path) and knobs.cache.dir == str(tmp_path)
    assert knobs.cache.dir == prev
    monkeypatch.setenv("DSV4_KERNEL_CACHE", "triton")
    with _launch.kernel_cache() as d:
        assert d is None and knobs.cache.dir == prev
    monkeypatch.delenv("DSV4_KERNEL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _launch.kernel_cache_dir() == str(tmp_path / "dsv4_rocm" / "triton")


# ---- the FlashMLA case harness, up to where it needs a GPU --------------------------------------------
def _flashmla_checkout():
    path = os.environ.get("FLASHMLA_DIR") or os.path.join(ROOT, ".peers", "FlashMLA")
    return path if os.path.isfile(os.path.join(path, "tests", "lib.py")) else None


def test_flashmla_case_harness_loads_the_cases():
    path = _flashmla_checkout()
    if path is None:
        pytest.skip("no FlashMLA checkout (FLASHMLA_DIR or .peers/FlashMLA): the harness is optional")
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "gpu/flashmla_cases.py", "--flashmla", path, "--list"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    print(r.stdout, r.stderr[-2000:])
    assert r.returncode == 0
    lines = {line.split(":")[0]: line for line in r.stdout.splitlines() if ":" in line}
    for suite in ("decode", "prefill"):
        n = int(lines[suite].split("cases in FlashMLA's file, ")[1].split(" with d_qk 512")[0])
        assert n > 100, lines[suite]
    if not torch.cuda.is_available():
        r = subprocess.run([sys.executable, "gpu/flashmla_cases.py", "--flashmla", path, "--suite", "prefill"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "needs CUDA" in r.stderr
    # small prefill cases (lonely queries with sinks among them) through our reference backend, judged by
    # FlashMLA's reference and tolerances: the harness's own path, end to end
    r = subprocess.run([sys.executable, "gpu/flashmla_cases.py", "--flashmla", path, "--cpu", "--max-size", "140000",
                        "--every", "3"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    print(r.stdout[-1500:], r.stderr[-1500:])
    assert r.returncode == 0 and "prefill  dsv4_rocm     9 passed    0 failed (of 9)" in r.stdout


def _flashmla_v41_checkout():
    path = os.environ.get("FLASHMLA_V41_DIR") or os.path.join(ROOT, ".peers", "FlashMLA-v41")
    return path if os.path.isfile(os.path.join(path, "tests", "test-sparse-decode.py")) else None


def test_flashmla_cases_v41_through_our_api_on_the_cpu():
    """FlashMLA's V4.1 decode cases (its quantizer writes interleaved 528 / 288 B records, its reference
    judges with its tolerances) through dsv4_rocm.flash_mla on the CPU: a spread of the small ones, fp4
    extra caches, lonely queries and sinks among them; and every case listed."""
    path = _flashmla_v41_checkout()
    if path is None:
        pytest.skip("no FlashMLA V4.1 test folder (FLASHMLA_V41_DIR or .peers/FlashMLA-v41): the harness is optional")
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "gpu/flashmla_cases_v41.py", "--flashmla", path, "--list"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
    print(r.stdout[-1500:], r.stderr[-1500:])
    assert r.returncode == 0 and "decode: 1534 cases in FlashMLA's file" in r.stdout
    r = subprocess.run([sys.executable, "gpu/flashmla_cases_v41.py", "--flashmla", path, "--device", "cpu",
                        "--suite", "decode", "--max-work", "3e5", "--every", "9"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    print(r.stdout[-2500:], r.stderr[-2500:])
    line = [x for x in r.stdout.splitlines() if x.startswith("decode   dsv4_rocm")]
    assert r.returncode == 0 and line and " 0 failed" in line[0] and "(of 0)" not in line[0]


# ---- GPU: the API's forms on the kernels --------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("splits", ["auto", "large batch"])
def test_api_forms_on_the_kernels(splits, gpu):
    b = 2 if splits == "auto" else 200
    a = decode_case(b, 2, 64, 64, 64, 3, 48, gpu, 8)
    ref, _ = ra.flash_mla_with_kvcache_sparse(*decode_args(a))
    plain, plain_lse = call_decode(a)
    check_out(plain, ref, f"API b={b}", decode_key_amax(a))
    for name, form in _decode_forms(a):
        out, lse = call_decode(form)
        assert torch.equal(out, plain) and torch.equal(lse, plain_lse), name
    out, back = padded_out((b, 2, 64, 512), gpu)
    res, _ = call_decode(a, out=out)
    assert res is out and torch.equal(out, plain)
    q, kv, idx, lens, s = prefill_case(33, 64, 200, 500, gpu, 3)
    o = flash_mla.flash_mla_sparse_fwd(strided(q), strided(kv), strided(idx), None, 512, s, lens)
    check_out(o[0], ra.flash_mla_sparse_fwd(q, kv, idx, SM, 512, s, lens)[0], "API prefill",
              prefill_key_amax(kv, idx, lens))
    check_lonely(o[0], o[2], [0, 1], o[1])
