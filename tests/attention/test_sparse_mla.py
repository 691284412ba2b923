"""Sparse MLA attention: the reference against the formulas on CPU; the Triton kernels (decode straight
from the fp8 pages, prefill over a bf16 kv) against the reference, under the Triton interpreter on CPU
(every call form: strides, out buffers, lengths shapes, invalid indices, lonely queries, splits; the V4.1
record formats and both page layouts) and on a GPU. Tolerances: tests/attention/sparse_mla_inputs.py."""
import math
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from dsv4_rocm import layout as L
from dsv4_rocm import ops
from dsv4_rocm.reference import attention as ra
from dsv4_rocm.reference import cache as rc
from sparse_mla_inputs import (SM, check_lonely, check_lse, check_out, decode_args, decode_case, decode_key_amax,
                               padded_out, prefill_case, prefill_key_amax, strided)


def direct_attend(q, Ks, sink):
    """The attention formula with a sink, float64, one head."""
    l = SM * (Ks.double() @ q.double())
    m = max(float(l.max()), sink)
    e = torch.exp(l - m)
    return (e @ Ks.double()) / (e.sum() + math.exp(sink - m))


@pytest.mark.parametrize("sink", [None, float("-inf"), float("inf"), "random"])
def test_attend_matches_the_formula(sink):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 4, 512, generator=g)
    K = torch.randn(3, 20, 512, generator=g)
    valid = torch.rand(3, 20, generator=g) > 0.3
    s = None if sink is None else (torch.randn(4, generator=g) if sink == "random" else torch.full((4,), sink))
    out, lse, _ = ra.attend(q, K, valid, SM, s)
    for n in range(3):
        for h in range(4):
            sk = float("-inf") if s is None else float(s[h])
            exp = direct_attend(q[n, h], K[n][valid[n]], sk) if sk != float("inf") else torch.zeros(512)
            torch.testing.assert_close(out[n, h].double(), exp.double(), rtol=1e-5, atol=1e-6)
            l_exp = torch.logsumexp(SM * (K[n][valid[n]].double() @ q[n, h].double()), 0)
            assert abs(float(lse[n, h]) - float(l_exp)) < 1e-5


@pytest.mark.parametrize("sink", ["-inf", "+inf", "random", "none"])
def test_reference_lonely_prefill_queries(sink):
    """A query with no valid key (length 0, or every index invalid) gets out 0, lse +inf, max_logits -inf,
    whatever the sink; the others are finite."""
    q, kv, idx, lens, s = prefill_case(6, 64, 32, 40, "cpu", 3, sink)
    out, mx, lse = ra.flash_mla_sparse_fwd(q, kv, idx, SM, 512, s, lens)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any() and not torch.isnan(mx).any()
    check_lonely(out, lse, [0, 1], mx)
    assert torch.isfinite(lse[2:]).all()
    out0, _, lse0 = ra.flash_mla_sparse_fwd(q, kv, idx, SM, 512, s, torch.zeros_like(lens))
    check_lonely(out0, lse0, slice(None))


def test_reference_topk_zero_and_empty_batches():
    a = decode_case(2, 1, 64, 64, 0, 2, 0, "cpu", 1)
    out, lse = ra.flash_mla_with_kvcache_sparse(*decode_args(a))
    check_lonely(out, lse, slice(None))
    a = decode_case(0, 1, 64, 64, 16, 0, 0, "cpu", 1)
    out, lse = ra.flash_mla_with_kvcache_sparse(*decode_args(a))
    assert out.shape == (0, 1, 64, 512) and lse.shape == (0, 64, 1)


def test_k_cache_fnuz_reads_a_fnuz_flavour_window():
    """``k_cache_fnuz``: k_cache holds FNUZ-flavour records (vLLM's gfx942 window), extra_k_cache OCP ones; the
    op reads them as the reference does with those formats, which differs from reading the window as OCP.
    The flag is checked before anything is written."""
    fz = L.with_fnuz(L.V40_584)
    a = decode_case(2, 1, 64, 64, 40, 3, 24, "cpu", 21, num_blocks=6, formats=(fz, L.V40_584))
    out = torch.full((2, 1, 64, 512), float("nan"), dtype=torch.bfloat16)
    got, lse = ops.sparse_mla_decode(*decode_args(a), out=out, k_cache_fnuz=True)
    ref, ref_lse = ra.flash_mla_with_kvcache_sparse(*decode_args(a), formats=(fz, L.V40_584))
    assert got is out and torch.equal(got, ref) and torch.equal(lse, ref_lse)
    assert not torch.equal(ops.sparse_mla_decode(*decode_args(a))[0], ref)
    for bad, match in ((1, "k_cache_fnuz must be a bool"), ("yes", "k_cache_fnuz must be a bool")):
        o = torch.full_like(out, float("nan"))
        with pytest.raises(ValueError, match=match):
            ops.sparse_mla_decode(*decode_args(a), out=o, k_cache_fnuz=bad)
        assert o.isnan().all()
    v41 = decode_case(2, 1, 64, 5, 32, 3, 16, "cpu", 4, num_blocks=9,
                      formats=(L.with_layout(L.V41_528), L.with_layout(L.V41_FP4_288)))
    fp4_main = dict(v41, k_cache=v41["extra_k_cache"], indices=v41["extra_indices_in_kvcache"],
                    topk_length=v41["extra_topk_length"])
    with pytest.raises(ValueError, match="V41_FP4_288 records have no FNUZ flavour"):
        ops.sparse_mla_decode(*decode_args(fp4_main), k_cache_fnuz=True)


def test_paged_decode_equals_bf16_prefill_semantics():
    """The two reference paths agree: paged fp8 decode == prefill over the dequantized rows."""
    a = decode_case(4, 1, 64, 64, 96, 0, 0, "cpu", 9)
    out, lse = ra.flash_mla_with_kvcache_sparse(*decode_args(a))
    pages = rc.as_pages(a["k_cache"], 64)
    kv = rc.decode_k_records(rc.gather_k_records(pages, torch.arange(pages.shape[0] * 64), 64)).bfloat16()
    o2, _, l2 = ra.flash_mla_sparse_fwd(a["q"][:, 0], kv.unsqueeze(1), a["indices"], SM, 512, a["attn_sink"],
                                        a["topk_length"])
    torch.testing.assert_close(out[:, 0].float(), o2.float(), rtol=0, atol=0)
    torch.testing.assert_close(lse[:, :, 0], l2, rtol=0, atol=0)


# ---- the kernels under the Triton interpreter (CPU) --------------------------------------------------
# The interpreter of Triton 3.6 under numpy 2 cannot turn a loaded scalar into a loop bound, multiplies bf16
# operands of tl.dot as their raw 16-bit integers and rounds fp32 -> bf16 by truncation. The scripts patch
# the three (a loop bound from the scalar, exact fp32 products of the bf16 values as the MMA units compute
# them, round-to-nearest-even as the hardware converts); everything else runs as Triton interprets it.
_INTERPRETER = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as _I

    _patch = _I._patch_lang_tensor
    def _patch_index(tensor, scope):
        _patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    _I._patch_lang_tensor = _patch_index

    _dot = _I.InterpreterBuilder.create_dot
    def _bf16_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype == tl.bfloat16 and b.dtype == tl.bfloat16:
            f = lambda x: (x.data.astype(np.uint32) << 16).view(np.float32)
            return _I.TensorHandle(np.matmul(f(a), f(b), dtype=np.float32) + d.data, d.dtype.scalar)
        return _dot(self, a, b, d, input_precision, max_num_imprecise_acc)
    _I.InterpreterBuilder.create_dot = _bf16_dot

    _cast = _I.InterpreterBuilder.cast_impl
    def _rne_cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = src.data.astype(np.float32).view(np.uint32).astype(np.uint64)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            rounded = np.where(np.isnan(src.data), np.uint16(0x7FC0), rounded)
            return _I.TensorHandle(rounded, dst_type.scalar)
        return _cast(self, src, dst_type)
    _I.InterpreterBuilder.cast_impl = _rne_cast

    import torch
    sys.path[:0] = ["tests", "tests/attention"]
    from sparse_mla_inputs import *
    from dsv4_rocm.reference import attention as ra
""")

_DECODE_FORMS = textwrap.dedent("""
    from dsv4_rocm.triton.attention.sparse_mla_decode import sparse_mla_decode
    CFG = dict(BLOCK_N=16, num_warps=4, num_stages=1, DEQ_INT=False)
    a = decode_case(3, 2, 64, 64, 32, 3, 24, "cpu", 5, num_blocks=6)
    a["indices"][2, 1] = -1                      # query (2, 1): no valid key in either set
    a["extra_topk_length"][2] = 0
    a["indices"][0, 0, :4] = torch.tensor([INT_MIN, INT_MAX, 6 * 64, -7], dtype=torch.int32)
    lonely = (2, 1)
    ref, ref_lse = ra.flash_mla_with_kvcache_sparse(*decode_args(a))
    base = {}
    for ns in (1, 3):
        out, lse = sparse_mla_decode(*decode_args(a), config=CFG, num_splits=ns)
        check_out(out, ref, f"interpreted decode splits={ns}", decode_key_amax(a))
        check_lse(lse, ref_lse)
        check_lonely(out, lse.transpose(1, 2), lonely)
        base[ns] = (out, lse)
    # every accepted form gives the same bits: strided q / indices, [b, s_q] lengths of stride 0, the fp8
    # view of the caches, an out buffer inside a larger one (whose other bytes stay untouched)
    s = dict(a, q=strided(a["q"]), indices=strided(a["indices"]), k_cache=a["k_cache"].view(torch.float8_e4m3fn),
             topk_length=a["topk_length"].unsqueeze(1).expand(3, 2),
             extra_indices_in_kvcache=strided(a["extra_indices_in_kvcache"]),
             extra_topk_length=strided(a["extra_topk_length"].unsqueeze(1).expand(3, 2).contiguous()))
    for ns in (1, 3):
        out, back = padded_out((3, 2, 64, 512), "cpu")
        before = back.clone()
        res, lse = sparse_mla_decode(*decode_args(s), out, config=CFG, num_splits=ns)
        assert res is out
        assert torch.equal(out, base[ns][0]) and torch.equal(lse, base[ns][1]), ns
        written = torch.zeros_like(back, dtype=torch.bool)
        written[:3, :, :64] = True
        assert torch.equal(back[~written].view(torch.int16), before[~written].view(torch.int16))
    # the split combine: in the kernel (the last split program merges) and in a second launch give the same
    # bits; repeated calls find their arrival counts back at 0; queries with no valid key in any split
    from dsv4_rocm.triton import _launch
    two = dict(CFG, split_combine="launch")
    for ns in (2, 3, 5):
        fused = [sparse_mla_decode(*decode_args(a), config=dict(CFG, split_combine="kernel"), num_splits=ns)
                 for _ in range(3)]
        out2, lse2 = sparse_mla_decode(*decode_args(a), config=two, num_splits=ns)
        for o, l in fused:
            assert torch.equal(o, out2) and torch.equal(l, lse2), ns
        check_out(out2, ref, f"interpreted decode, combine in a second launch, splits={ns}", decode_key_amax(a))
        counts = [v for k, v in _launch._SCRATCH.items() if k[0] == "counters"]
        assert counts and all(int(c.abs().max()) == 0 for c in counts), ns
    dead = dict(a, indices=torch.full_like(a["indices"], -1), extra_topk_length=torch.zeros_like(a["extra_topk_length"]))
    for cfg in (CFG, two):
        out, lse = sparse_mla_decode(*decode_args(dead), config=cfg, num_splits=3)
        assert torch.equal(out, torch.zeros_like(out)) and torch.isposinf(lse).all()
    out, lse = sparse_mla_decode(*decode_args(dict(a, extra_k_cache=None, extra_indices_in_kvcache=None,
                                                   extra_topk_length=None, topk_length=None)), config=CFG)
    ref, ref_lse = ra.flash_mla_with_kvcache_sparse(*decode_args(dict(a, extra_k_cache=None,
                      extra_indices_in_kvcache=None, extra_topk_length=None, topk_length=None)))
    check_out(out, ref, "interpreted decode, main set only, no lengths", decode_key_amax(dict(
        a, extra_k_cache=None, topk_length=None)))
    # AMD's program order (a token's two head blocks 8 programs apart, on one XCD; 18 programs: one group of 16,
    # two past it in the plain order): the same bits as the plain order
    h = decode_case(9, 1, 128, 64, 32, 3, 24, "cpu", 6, num_blocks=6)
    for ns in (1, 2):
        plain = sparse_mla_decode(*decode_args(h), config=CFG, num_splits=ns)
        xcd = sparse_mla_decode(*decode_args(h), config=dict(CFG, XCDS=8), num_splits=ns)
        assert torch.equal(xcd[0], plain[0]) and torch.equal(xcd[1], plain[1]), ns
    # ids two tiles ahead (IDX_AHEAD=2): the same keys in the same order, so the same bits, invalid ids,
    # lonely queries, strided forms, empty splits (9 tiles in 5 splits) and a main set alone included
    alone = dict(a, extra_k_cache=None, extra_indices_in_kvcache=None, extra_topk_length=None)
    for name, c in (("a", a), ("strided", s), ("dead", dead), ("h128", h), ("alone", alone)):
        for ns in (1, 3, 5):
            one = sparse_mla_decode(*decode_args(c), config=CFG, num_splits=ns)
            ahead = sparse_mla_decode(*decode_args(c), config=dict(CFG, IDX_AHEAD=2), num_splits=ns)
            assert torch.equal(one[0], ahead[0]) and torch.equal(one[1], ahead[1]), (name, ns)
    print("ok")
""")

_PREFILL_FORMS = textwrap.dedent("""
    from dsv4_rocm.triton.attention.sparse_mla_prefill import sparse_mla_prefill
    CFG = dict(BLOCK_N=16, num_warps=4, num_stages=1)
    for sink in ("-inf", "random", "+inf", "none"):
        q, kv, idx, lens, s = prefill_case(6, 64, 32, 40, "cpu", 3, sink)
        ref = ra.flash_mla_sparse_fwd(q, kv, idx, SM, 512, s, lens)
        out, mx, lse = sparse_mla_prefill(q, kv, idx, SM, 512, s, lens, config=CFG)
        assert not torch.isnan(out).any() and not torch.isnan(lse).any() and not torch.isnan(mx).any(), sink
        check_lonely(out, lse, [0, 1], mx)
        check_out(out, ref[0], f"interpreted prefill sink={sink}", prefill_key_amax(kv, idx, lens))
        check_lse(lse, ref[2])
        fin = torch.isfinite(ref[1])
        assert torch.equal(torch.isneginf(mx), torch.isneginf(ref[1]))
        torch.testing.assert_close(mx[fin], ref[1][fin], atol=1e-5, rtol=1e-5)
        o2, back = padded_out((6, 64, 512), "cpu")
        before = back.clone()
        res, mx2, lse2 = sparse_mla_prefill(strided(q), strided(kv), strided(idx), SM, 512, s, strided(lens), o2,
                                            config=CFG)
        assert res is o2 and torch.equal(o2, out) and torch.equal(mx2, mx) and torch.equal(lse2, lse), sink
        written = torch.zeros_like(back, dtype=torch.bool)
        written[:6, :64] = True
        assert torch.equal(back[~written].view(torch.int16), before[~written].view(torch.int16))
    out, mx, lse = sparse_mla_prefill(q, kv[:0], idx, SM, 512, s, None, config=CFG)        # empty kv
    check_lonely(out, lse, slice(None), mx)
    print("ok")
""")


_DECODE_V41 = textwrap.dedent("""
    from dsv4_rocm import layout as L
    from dsv4_rocm.triton.attention.sparse_mla_decode import sparse_mla_decode
    CFG = dict(BLOCK_N=16, num_warps=4, num_stages=1, DEQ_INT=False)
    IL = L.interleaved
    for fmts in ((L.V41_528, L.V41_528), (L.V41_528, L.V41_FP4_288), (IL(L.V41_528), IL(L.V41_FP4_288)),
                 (IL(L.V41_528), IL(L.V41_528))):
        a = decode_case(2, 2, 64, 5, 40, 3, 24, "cpu", 6, num_blocks=7, formats=fmts)
        a["indices"][1, 1] = -1                       # query (1, 1): no valid key in either set
        a["extra_topk_length"][1] = 0
        ref, ref_lse = ra.flash_mla_with_kvcache_sparse(*decode_args(a), formats=fmts)
        amax = decode_key_amax(a, fmts)
        outs = []
        for ns in (1, 3):
            out, lse = sparse_mla_decode(*decode_args(a), formats=fmts, config=CFG, num_splits=ns)
            check_out(out, ref, f"interpreted decode {fmts[0].name}+{fmts[1].name} {fmts[0].layout} splits={ns}", amax)
            check_lse(lse, ref_lse)
            check_lonely(out, lse.transpose(1, 2), (1, 1))
            outs.append(out)
        # the main set alone (one format, one loop)
        m = dict(a, extra_k_cache=None, extra_indices_in_kvcache=None, extra_topk_length=None)
        ref, _ = ra.flash_mla_with_kvcache_sparse(*decode_args(m), formats=(fmts[0], None))
        out, _ = sparse_mla_decode(*decode_args(m), formats=(fmts[0], None), config=CFG)
        check_out(out, ref, f"interpreted decode {fmts[0].name} alone", decode_key_amax(m, fmts))
        # ids two tiles ahead: the same bits (the two-loop path of mixed formats does not take it)
        ahead, _ = sparse_mla_decode(*decode_args(m), formats=(fmts[0], None), config=dict(CFG, IDX_AHEAD=2))
        assert torch.equal(ahead, out)
        ahead, _ = sparse_mla_decode(*decode_args(a), formats=fmts, config=dict(CFG, IDX_AHEAD=2), num_splits=3)
        assert torch.equal(ahead, outs[1])
    print("ok")
""")


def _interpret(script, tmp_path):
    """Run a script under the Triton interpreter in a fresh process (Triton reads kernel sources from files)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    f = tmp_path / "interpreted.py"
    f.write_text(_INTERPRETER + script)
    r = subprocess.run([sys.executable, str(f)], cwd=root, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=root), timeout=900)
    print(r.stdout[-3000:])
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-4000:]


def test_decode_kernel_call_forms_under_the_interpreter(tmp_path):
    _interpret(_DECODE_FORMS, tmp_path)


def test_decode_kernel_v41_formats_under_the_interpreter(tmp_path):
    """V41_528 main caches with V41_528 or V41_FP4_288 extra caches, page-split and interleaved: the
    format-parameterized tiles (16 x 32 fp8 chunks, 32 scale blocks of 8 e2m1 bytes) and the two-loop path of mixed
    formats against the reference, splits included."""
    _interpret(_DECODE_V41, tmp_path)


def test_prefill_kernel_lonely_queries_and_call_forms_under_the_interpreter(tmp_path):
    _interpret(_PREFILL_FORMS, tmp_path)


def test_decode_kernel_choice(monkeypatch):
    """Hopper runs DEFAULT_SM90_KERNEL by default (the warp-specialized kernel only where Triton has Gluon),
    every other target this file's kernel; either is forced with config=dict(kernel=...), and the Hopper
    kernel is refused elsewhere by name."""
    from dsv4_rocm.triton.attention import sparse_mla_decode as D
    assert D.DEFAULT_SM90_KERNEL in ("ws", "triton")
    if D._ws is not None:
        assert D.default_config("sm_90", 64, "ws")["kernel"] == "ws"
    assert D.default_config("sm_90", 64)["kernel"] == ("ws" if D._ws is not None and D.DEFAULT_SM90_KERNEL == "ws"
                                                       else "triton")
    for arch in ("gfx942", "gfx950", "sm_100", "sm_89", "cpu"):
        assert D.default_config(arch, 64)["kernel"] == "triton"
    assert D.default_config("sm_90", 128, "triton")["num_warps"] == 8
    with pytest.raises(ValueError, match="kernel"):
        D.default_config("sm_90", 64, "cuda")
    with pytest.raises(ValueError, match="sm_90"):
        D._plan(torch.device("cpu"), 64, 4, 128, 512, (("kernel", "ws"),))
    # formats the Hopper kernel does not read take the Triton kernel, and forcing it is refused (an H100's
    # device facts, without one)
    from dsv4_rocm.triton import _launch
    monkeypatch.setattr(_launch, "_facts", lambda t, i: ("sm_90", False, 132, True))
    hopper = torch.device("cuda", 0)
    if D._ws is not None and D.DEFAULT_SM90_KERNEL == "ws":
        assert dict(D._plan.__wrapped__(hopper, 64, 4, 128, 512)[0])["kernel"] == "ws"
    assert dict(D._plan.__wrapped__(hopper, 64, 4, 128, 512, ws_reads=False)[0])["kernel"] == "triton"
    with pytest.raises(ValueError, match="V40_584 or V41_528 records only"):
        D._plan.__wrapped__(hopper, 64, 4, 128, 512, (("kernel", "ws"),), ws_reads=False)


# (main format, extra format or None) -> does the Hopper kernel take the call
_WS_ROUTES = [
    ((L.V40_584, None), True), ((L.V40_584, L.V40_584), True),
    ((L.V41_528, None), True), ((L.V41_528, L.V41_528), True),
    ((L.interleaved(L.V41_528), None), True), ((L.interleaved(L.V41_528), L.interleaved(L.V41_528)), True),
    ((L.V41_528, L.V41_FP4_288), False), ((L.interleaved(L.V41_528), L.interleaved(L.V41_FP4_288)), False),
    ((L.V41_528, L.interleaved(L.V41_528)), False),                       # two page layouts
    ((L.with_fnuz(L.V40_584), L.V40_584), False), ((L.with_fnuz(L.V41_528), None), False),
]


class _NoLaunch:
    """A bound kernel that compiles and launches nothing."""
    def warmup(self, *a, **k):
        pass


@pytest.mark.parametrize("fmts,ws", _WS_ROUTES, ids=[f"{m.name}-{m.layout}+{e.name + '-' + e.layout if e else '-'}"
                                                      for (m, e), _ in _WS_ROUTES])
def test_decode_plan_routes_record_formats(fmts, ws, monkeypatch):
    """On Hopper the warp-specialized kernel takes V40_584 and V41_528 caches (either page layout, no extra
    cache or one of the same format and layout), bound with that format; a V41_FP4_288 extra cache, mixed
    layouts and FNUZ-flavour records take the Triton kernel, and forcing the Hopper kernel on them is refused.
    The route is the one ``sparse_mla_decode`` binds (compile_only) on an H100's device facts."""
    from dsv4_rocm.triton import _launch
    from dsv4_rocm.triton.attention import sparse_mla_decode as D
    if D._ws is None:
        pytest.skip("no Gluon in this Triton: the Hopper kernel is not built")
    assert D._ws.reads(*fmts) == ws
    bound, real = [], D._variant

    def variant(cfg_items, *a):
        var = real(cfg_items, *a)
        bound.append((dict(cfg_items)["kernel"], var))
        return D._Variant(None if var.main is None else _NoLaunch(), None, var.head_blocks, var.threads,
                          None if var.ws is None else _NoLaunch())
    monkeypatch.setattr(D, "_variant", variant)
    main, extra = fmts
    a = decode_case(2, 1, 64, 4, 16, 3 if extra else 0, 8 if extra else 0, "cpu", 3, formats=(main, extra or main))
    with _launch.emulate_target("sm_90"):
        if not ws:
            with pytest.raises(ValueError, match="V40_584 or V41_528 records only"):
                D.sparse_mla_decode(*decode_args(a), formats=(main, extra), config=dict(kernel="ws"), compile_only=True)
        D.sparse_mla_decode(*decode_args(a), formats=(main, extra), compile_only=True)
    kernel, var = bound[-1]
    assert kernel == ("ws" if ws else "triton")
    if ws:
        assert var.ws.consts["FMT"] == main
    else:
        assert var.main.consts["MAIN_FMT"] == main


def test_ws_constexprs_refuse_other_formats():
    ws = pytest.importorskip("dsv4_rocm.triton.hopper.sparse_mla_decode_ws")
    cfg = tuple(ws.default_config(64).items())
    assert ws.constexprs(cfg, 64, 64, 2, True, True, True, True, True, L.interleaved(L.V41_528))["FMT"].interleaved
    for f in (L.V41_FP4_288, L.with_fnuz(L.V41_528), L.interleaved(L.V41_FP4_288)):
        with pytest.raises(ValueError, match="Hopper decode kernel reads"):
            ws.constexprs(cfg, 64, 64, 2, True, True, True, True, True, f)


def _run_ptx(ptx, regs):
    """Execute the straight-line integer PTX of the decode kernels' inline asm (prmt in its default mode, with
    the sign-replicate selector bit; shl / shr / and / or on .b32) over the registers ``regs`` (name -> int)."""
    def val(x):
        x = x.strip()
        return regs[x] if x in regs else int(x, 0)
    for line in ptx.strip().splitlines():
        op, rest = line.strip().rstrip(";").split(None, 1)
        d, *a = [x.strip() for x in rest.split(",")]
        a = [val(x) for x in a]
        if op == "prmt.b32":
            pool = (a[0] | a[1] << 32).to_bytes(8, "little")
            r = 0
            for k in range(4):
                sel = (a[2] >> (4 * k)) & 0xF
                byte = pool[sel & 7]
                if sel & 8:
                    byte = 0xFF if byte & 0x80 else 0
                r |= byte << (8 * k)
        elif op == "shl.b32":
            r = a[0] << a[1]
        elif op == "shr.b32":
            r = a[0] >> a[1]
        elif op == "and.b32":
            r = a[0] & a[1]
        elif op == "or.b32":
            r = a[0] | a[1]
        else:
            raise AssertionError(f"unmodelled instruction {op}")
        regs[d] = r & 0xFFFFFFFF
    return regs


def _bf16s(words):
    """The bf16 values of 32-bit registers, two each (low half first), as float32."""
    halves = torch.tensor([(w >> (16 * i)) & 0xFFFF for w in words for i in (0, 1)], dtype=torch.int32)
    return (halves << 16).view(torch.float32)


def test_integer_decode_ptx_follows_the_formats():
    """The inline PTX of the NVIDIA decode (executed by a model of its five instructions): every e4m3 byte
    gives its value * 2^-120 (0x7F / 0xFF read as +-480, made NaN by their block's scale), every e2m1 code in
    every byte position its value * 2^-112 with its sign, -0 included."""
    from dsv4_rocm.reference import quant
    from dsv4_rocm.triton._decode_tiles import e2m1_to_scaled_bf16_ptx, e4m3_to_scaled_bf16_ptx
    e4 = torch.arange(256, dtype=torch.int32)
    want = e4.to(torch.uint8).view(torch.float8_e4m3fn).float()
    want = torch.where((e4 & 0x7F) == 0x7F, torch.where(e4 < 128, 480.0, -480.0), want)
    got = []
    for w in range(64):
        x = int.from_bytes(bytes(range(4 * w, 4 * w + 4)), "little")
        r = _run_ptx(e4m3_to_scaled_bf16_ptx("o0", "o1"), {"$2": x})
        got.append(_bf16s([r["o0"], r["o1"]]))
    assert torch.equal(torch.cat(got) * 2.0 ** 120, want)
    codes = torch.arange(16, dtype=torch.int32)
    want = quant.e2m1_decode(codes)
    assert torch.equal(want[8:], -want[:8]) and torch.signbit(want[8])
    for shift in range(4):             # each code in each byte position, the other bytes random
        g = torch.Generator().manual_seed(shift)
        other = torch.randint(0, 16, (16, 4), generator=g)
        other[:, shift] = codes
        for row in other.tolist():
            x = int.from_bytes(bytes(row), "little")
            r = _run_ptx(e2m1_to_scaled_bf16_ptx("o0", "o1", "x"), {"x": x})
            got = _bf16s([r["o0"], r["o1"]]) * 2.0 ** 112
            ref = want[torch.tensor(row)]
            assert torch.equal(got, ref) and torch.equal(torch.signbit(got), torch.signbit(ref)), (row, got, ref)


def test_split_plan():
    from dsv4_rocm.triton.attention.sparse_mla_decode import MAX_SPLITS, _num_splits
    assert _num_splits(200, 20, 132) == 1                 # the grid fills the GPU
    assert _num_splits(4, 10, 132) == 10                  # at most one split per tile
    assert _num_splits(2, 100, 132) == MAX_SPLITS
    assert _num_splits(40, 100, 132) == 3                 # one wave of programs
    assert _num_splits(4, 1, 132) == 1


def test_ws_schedule():
    """The Hopper kernel's persistent schedule of one head block's units: every unit (a token's 64 heads, m key
    tiles) falls into at most max_parts(m, w) <= 16 CTAs of w tiles each, the grid covers every tile, whole
    units where that costs at most 10% more tiles per CTA, one unit per CTA when asked for one split."""
    ws = pytest.importorskip("dsv4_rocm.triton.hopper.sparse_mla_decode_ws")
    rng = random.Random(0)
    for _ in range(3000):
        units, m, sms = rng.randint(1, 700), rng.randint(1, 60), rng.choice([132, 114, 7, 1])
        ns = rng.choice([None, None, 1, 2, 3, 16, 40])
        w = ws.schedule(units, m, sms, ns)
        grid = -(-units * m // w)
        parts = [(u * m + m - 1) // w - (u * m) // w + 1 for u in range(units)]
        assert max(parts) <= ws.max_parts(m, w) <= ws.MAX_PARTS
        assert (grid - 1) * w < units * m <= grid * w
        if w % m == 0:
            assert max(parts) == 1
        if ns == 1:
            assert max(parts) == 1
        if ns is None and sms > 1:
            assert w <= 1.1 * -(-units * m // sms) or w == -(-(m - 1) // (ws.MAX_PARTS - 1))
    assert ws.schedule(296, 10, 132) == 23                 # V4-Flash b148 s_q 2: 23 tiles per SM, not 3 waves
    assert ws.schedule(128, 18, 66) == 36                  # V4-Pro b64 (66 SMs a head block): two whole units
    assert ws.schedule(128, 10, 132) == 10                 # one unit per SM


# ---- GPU: Triton kernels against the reference ---------------------------------------------------
DECODE_CASES = [
    # b, s_q, h, main bs, topk, extra bs, extra topk, sink, lens shape
    (1, 1, 64, 256, 128, 64, 512, "random", "b"),
    (4, 2, 64, 64, 128, 64, 512, "none", "b"),
    (74, 1, 64, 256, 128, 2, 512, "-inf", "b"),
    (321, 1, 64, 64, 128, 64, 512, "random", "b"),
    (8, 2, 128, 256, 128, 64, 1024, "random", "bsq"),
    (5, 3, 128, 64, 64, 64, 2048, "+inf", "b"),
    (3, 1, 64, 2, 64, 0, 0, "random", "b"),
    (17, 1, 128, 64, 1024, 0, 0, "none", "b"),
    (2, 1, 64, 100, 96, 3, 40, "random", "b"),       # block sizes that are not powers of two
    (4, 3, 128, 576, 2048, 61, 576, "random", "bsq"),  # FlashMLA's largest pages
]


# the decode kernels: this file's Triton kernel (every GPU; "triton ahead2": its ids two tiles ahead) and the
# warp-specialized Gluon kernel (Hopper)
DECODE_KERNELS = ["triton", "triton ahead2", "ws"]


def decode_kernel_config(kernel, device):
    """``config`` forcing a decode kernel; skips the test where that kernel does not run."""
    from dsv4_rocm.triton._launch import device_facts
    from dsv4_rocm.triton.attention.sparse_mla_decode import _ws
    if kernel == "ws":
        arch = device_facts(device)[0]
        if arch != "sm_90" or _ws is None:
            pytest.skip(f"the warp-specialized decode kernel is written for Hopper (sm_90) in Gluon; this is "
                        f"{arch}{'' if _ws is not None else ' without Gluon'}")
    if kernel == "triton ahead2":
        return dict(kernel="triton", IDX_AHEAD=2)
    return dict(kernel=kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", DECODE_KERNELS)
@pytest.mark.parametrize("case", DECODE_CASES, ids=[str(c) for c in DECODE_CASES])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_triton_decode_matches_reference(case, splits, kernel, gpu):
    from dsv4_rocm.triton.attention.sparse_mla_decode import sparse_mla_decode
    cfg = decode_kernel_config(kernel, gpu)
    b, s_q, h, bs, topk, ebs, etopk, sink, lshape = case
    a = decode_case(b, s_q, h, bs, topk, ebs, etopk, gpu, 11 + b, sink, lshape)
    ref_out, ref_lse = ra.flash_mla_with_kvcache_sparse(*decode_args(a))
    out, lse = sparse_mla_decode(*decode_args(a), num_splits=splits, config=cfg)
    check_out(out, ref_out, f"decode {kernel} {case} splits={splits}", decode_key_amax(a))
    if sink != "+inf":
        check_lse(lse, ref_lse)


# V4.0's shapes, each page size and lengths shape, and a main set alone with 5-record pages
V41_CASES = [DECODE_CASES[i] for i in (1, 2, 4, 8, 9)] + [(3, 1, 64, 5, 64, 0, 0, "none", "b")]
V41_FORMATS = [(L.V41_528, L.V41_528), (L.V41_528, L.V41_FP4_288),
               (L.interleaved(L.V41_528), L.interleaved(L.V41_FP4_288))]


@pytest.mark.gpu
@pytest.mark.parametrize("fmts", V41_FORMATS, ids=["v41+v41", "v41+fp4", "v41+fp4 interleaved"])
@pytest.mark.parametrize("case", V41_CASES, ids=[str(c) for c in V41_CASES])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_triton_decode_v41_formats_match_reference(case, splits, fmts, gpu):
    """The Triton kernel (the V4.1 formats' kernel on every GPU, Hopper included) over V4.1 records."""
    from dsv4_rocm.triton.attention.sparse_mla_decode import sparse_mla_decode
    b, s_q, h, bs, topk, ebs, etopk, sink, lshape = case
    a = decode_case(b, s_q, h, bs, topk, ebs, etopk, gpu, 31 + b, sink, lshape, formats=fmts)
    f = (fmts[0], fmts[1] if ebs else None)
    ref_out, ref_lse = ra.flash_mla_with_kvcache_sparse(*decode_args(a), formats=f)
    out, lse = sparse_mla_decode(*decode_args(a), num_splits=splits, formats=f)
    check_out(out, ref_out, f"decode {f[0].name}+{f[1].name if f[1] else '-'} {case} splits={splits}",
              decode_key_amax(a, f))
    if sink != "+inf":
        check_lse(lse, ref_lse)


# V41_528 on the Hopper kernel: s_q 1 to 3, 64 and 128 heads, page sizes 256 / 64 / 2 / 100 / 5, with and
# without a V41_528 extra cache, [b] and [b, s_q] lengths
WS_V41_CASES = [DECODE_CASES[i] for i in (0, 1, 2, 4, 5, 6, 7, 8)] + [(3, 1, 64, 5, 64, 0, 0, "none", "b"),
                                                                       (9, 2, 128, 64, 256, 64, 128, "random", "bsq")]
WS_V41_FORMATS = [L.V41_528, L.interleaved(L.V41_528)]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", WS_V41_FORMATS, ids=["page_split", "interleaved"])
@pytest.mark.parametrize("case", WS_V41_CASES, ids=[str(c) for c in WS_V41_CASES])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_ws_decode_v41_528_matches_reference(case, splits, fmt, gpu):
    """The Hopper kernel over V41_528 caches (its default route for them), out poisoned first, with padding
    (-1) and out-of-range indices in both sets: out and lse as the reference's, within the decode tolerances."""
    from dsv4_rocm.triton.attention.sparse_mla_decode import sparse_mla_decode
    cfg = decode_kernel_config("ws", gpu)
    b, s_q, h, bs, topk, ebs, etopk, sink, lshape = case
    a = decode_case(b, s_q, h, bs, topk, ebs, etopk, gpu, 51 + b, sink, lshape, formats=(fmt, fmt))
    cap = a["k_cache"].shape[0] * bs
    a["indices"][..., ::7] = -1
    a["indices"][..., 3::11] = cap + 5
    if ebs:
        a["extra_indices_in_kvcache"][..., 1::5] = -1
    f = (fmt, fmt if ebs else None)
    ref_out, ref_lse = ra.flash_mla_with_kvcache_sparse(*decode_args(a), formats=f)
    out = torch.full((b, s_q, h, 512), float("nan"), dtype=torch.bfloat16, device=gpu)
    got, lse = sparse_mla_decode(*decode_args(a), out, num_splits=splits, formats=f, config=cfg)
    assert got is out
    check_out(out, ref_out, f"ws decode {fmt.name} {fmt.layout} {case} splits={splits}", decode_key_amax(a, f))
    if sink != "+inf":
        check_lse(lse, ref_lse)
    # the same bits as the default route (the Hopper kernel)
    out2 = torch.full_like(out, float("nan"))
    sparse_mla_decode(*decode_args(a), out2, num_splits=splits, formats=f)
    assert torch.equal(out2, out)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", WS_V41_FORMATS, ids=["page_split", "interleaved"])
def test_ws_decode_v41_528_lonely_queries_and_strided_q(fmt, gpu):
    """V41_528 on the Hopper kernel: queries with no valid key get out 0 and lse +inf; a q whose rows are not
    16-byte aligned (Q through registers) gives the same bits as a contiguous one."""
    from dsv4_rocm.triton.attention.sparse_mla_decode import sparse_mla_decode
    cfg = decode_kernel_config("ws", gpu)
    a = decode_case(6, 1, 64, 64, 128, 64, 512, gpu, 2, "random", formats=(fmt, fmt))
    a["indices"][:3] = -1
    a["extra_topk_length"][:3] = 0
    f = (fmt, fmt)
    for ns in (1, 4):
        out, lse = sparse_mla_decode(*decode_args(a), torch.full((6, 1, 64, 512), float("nan"), dtype=torch.bfloat16,
                                                                 device=gpu), num_splits=ns, formats=f, config=cfg)
        check_lonely(out, lse, [0, 1, 2])
        ref_out, _ = ra.flash_mla_with_kvcache_sparse(*decode_args(a), formats=f)
        check_out(out, ref_out, f"ws lonely {fmt.layout} splits={ns}", decode_key_amax(a, f))
    base, base_lse = sparse_mla_decode(*decode_args(a), num_splits=4, formats=f, config=cfg)
    q = torch.empty(6, 1, 64, 513, dtype=torch.bfloat16, device=gpu)[..., 1:]
    q.copy_(a["q"])
    out, lse = sparse_mla_decode(*decode_args(dict(a, q=q)), num_splits=4, formats=f, config=cfg)
    assert torch.equal(out, base) and torch.equal(lse, base_lse)


# the stress of the Hopper kernel's hand-offs: V4.0 records with 64 heads (L2 requests on), V4.1's interleaved
# records with 128 heads, each split (partials and the row-factor hand-off per part) and whole
WS_STRESS_CASES = [((24, 2, 64, 64, 512, 64, 128, "random", "b"), L.V40_584),
                   ((16, 2, 128, 256, 640, 2, 128, "random", "bsq"), L.interleaved(L.V41_528))]


@pytest.mark.gpu
@pytest.mark.parametrize("case,fmt", WS_STRESS_CASES, ids=["v40_h64", "v41_interleaved_h128"])
def test_ws_hand_offs_hold_under_random_stalls(case, fmt, gpu):
    """The Hopper kernel's mbarrier hand-offs (K slots loader -> consumers and back, P and alpha consumer 0
    -> consumer 1 and back, the row factors likewise) under pseudo-random pauses on both sides of each
    (config PROBE=STALL: a nanosleep drawn from the SM clock, the tile and the call site): many launches
    on fresh random inputs, out poisoned before each, every one bit-equal to the launch without pauses and
    within the reference's tolerance. A wait missing from the protocol would let a paused producer's
    buffer be read stale, or a paused reader's buffer be overwritten, and change the output."""
    from dsv4_rocm.triton.attention.sparse_mla_decode import sparse_mla_decode
    cfg = decode_kernel_config("ws", gpu)
    from dsv4_rocm.triton.hopper import sparse_mla_decode_ws as ws
    stall = dict(cfg, PROBE=int(ws.STALL))
    b, s_q, h, bs, topk, ebs, etopk, sink, lshape = case
    f = (fmt, fmt)
    for rep in range(4):
        a = decode_case(b, s_q, h, bs, topk, ebs, etopk, gpu, 900 + 17 * rep, sink, lshape, formats=f)
        ref_out, ref_lse = ra.flash_mla_with_kvcache_sparse(*decode_args(a), formats=f)
        for splits in (None, 3):
            base, base_lse = sparse_mla_decode(*decode_args(a), num_splits=splits, formats=f, config=cfg)
            check_out(base, ref_out, f"ws stress base {fmt.name} rep {rep} splits={splits}", decode_key_amax(a, f))
            for launch in range(6):
                out = torch.full_like(base, float("nan"))
                got, lse = sparse_mla_decode(*decode_args(a), out, num_splits=splits, formats=f, config=stall)
                assert torch.equal(out, base), f"rep {rep} splits={splits} launch {launch}: output changed"
                assert torch.equal(lse, base_lse), f"rep {rep} splits={splits} launch {launch}: lse changed"
        check_lse(base_lse, ref_lse)


@pytest.mark.gpu
def test_ws_prefill_hand_offs_hold_under_random_stalls(gpu):
    """The same for the kernel over bf16 rows (its row loader, sparse_mla_prefill): paused launches on
    fresh random inputs give the bits of the launch without pauses."""
    from dsv4_rocm.triton.attention.sparse_mla_decode import _ws
    from dsv4_rocm.triton.attention.sparse_mla_prefill import sparse_mla_prefill
    decode_kernel_config("ws", gpu)
    for rep in range(3):
        q, kv, idx, lens, s = prefill_case(40, 128, 512, 3000, gpu, 77 + rep)
        base = sparse_mla_prefill(q, kv, idx, SM, 512, s, lens, config=dict(kernel="ws"))
        for launch in range(6):
            got = sparse_mla_prefill(q, kv, idx, SM, 512, s, lens, config=dict(kernel="ws", PROBE=int(_ws.STALL)))
            for x, y in zip(got, base):
                assert torch.equal(x, y), f"rep {rep} launch {launch}: output changed"


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", DECODE_KERNELS)
@pytest.mark.parametrize("splits", [1, 4])
def test_triton_decode_call_forms(splits, kernel, gpu):
    """Strided q / indices, [b, s_q] lengths of stride 0, fp8 and int8 cache views, an out buffer inside a
    larger one: the same bits as the contiguous call, nothing outside the buffer's rows written."""
    from dsv4_rocm.triton.attention.sparse_mla_decode import sparse_mla_decode
    cfg = decode_kernel_config(kernel, gpu)
    a = decode_case(6, 2, 64, 64, 128, 2, 256, gpu, 7)
    base, base_lse = sparse_mla_decode(*decode_args(a), num_splits=splits, config=cfg)
    s = dict(a, q=strided(a["q"]), indices=strided(a["indices"]), k_cache=a["k_cache"].view(torch.float8_e4m3fn),
             extra_k_cache=a["extra_k_cache"].view(torch.int8).view(torch.uint8),
             topk_length=a["topk_length"].unsqueeze(1).expand(6, 2),
             extra_indices_in_kvcache=strided(a["extra_indices_in_kvcache"]))
    out, back = padded_out((6, 2, 64, 512), gpu)
    before = back.clone()
    res, lse = sparse_mla_decode(*decode_args(s), out, num_splits=splits, config=cfg)
    torch.cuda.synchronize()
    assert res is out and torch.equal(out, base) and torch.equal(lse, base_lse)
    written = torch.zeros_like(back, dtype=torch.bool)
    written[:6, :, :64] = True
    assert torch.equal(back[~written].view(torch.int16), before[~written].view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", DECODE_KERNELS)
def test_triton_decode_all_invalid_and_zero_lengths(kernel, gpu):
    from dsv4_rocm.triton.attention.sparse_mla_decode import sparse_mla_decode
    cfg = decode_kernel_config(kernel, gpu)
    for sink in ("random", "-inf", "+inf", "none"):
        a = decode_case(6, 1, 64, 64, 128, 64, 512, gpu, 2, sink)
        a["indices"][:3] = -1
        a["indices"][3:] = torch.tensor([-2 ** 31, 2 ** 31 - 1, 10 ** 9, -5], dtype=torch.int32, device=gpu).repeat(32)
        a["extra_topk_length"].zero_()
        for ns in (1, 4):
            out, lse = sparse_mla_decode(*decode_args(a), num_splits=ns, config=cfg)
            assert torch.equal(out, torch.zeros_like(out)) and torch.isposinf(lse).all(), (sink, ns)


@pytest.mark.gpu
def test_triton_decode_split_combine_in_kernel(gpu):
    """Splits merged by the last split program to arrive: the same bits as the two-launch combine (both run
    _merge_splits), call after call and replay after replay (the arrival counts return to 0), out 0 / lse
    +inf where no split saw a key."""
    from dsv4_rocm.triton import _launch
    from dsv4_rocm.triton.attention.sparse_mla_decode import sparse_mla_decode
    # the Triton kernel's two merges (the Hopper kernel, the default on sm_90, always merges in a launch)
    one, two = dict(kernel="triton", split_combine="kernel"), dict(kernel="triton", split_combine="launch")
    for case in ((2, 2, 64, 256, 128, 64, 512), (4, 1, 128, 64, 128, 64, 1024), (1, 1, 64, 256, 128, 2, 512)):
        a = decode_case(*case, gpu, sum(case))
        a["indices"][0, 0] = -1                          # one query with no valid key in the main set
        ref, _ = ra.flash_mla_with_kvcache_sparse(*decode_args(a))
        for ns in (2, 3, 7, 16):
            base, base_lse = sparse_mla_decode(*decode_args(a), config=two, num_splits=ns)
            check_out(base, ref, f"two-launch combine {case} splits={ns}", decode_key_amax(a))
            for _ in range(4):
                out, lse = sparse_mla_decode(*decode_args(a), config=one, num_splits=ns)
                assert torch.equal(out, base) and torch.equal(lse, base_lse), (case, ns)
    torch.cuda.synchronize()
    counts = [v for k, v in _launch._SCRATCH.items() if k[0] == "counters"]
    assert counts and all(int(c.abs().max()) == 0 for c in counts)
    dead = decode_case(3, 2, 64, 64, 128, 64, 512, gpu, 5)
    dead["indices"].fill_(-1)
    dead["extra_topk_length"].zero_()
    for cfg in (one, two):
        out, lse = sparse_mla_decode(*decode_args(dead), config=cfg, num_splits=4)
        assert torch.equal(out, torch.zeros_like(out)) and torch.isposinf(lse).all()
    # captured with splits merged in the kernel, replayed on new inputs: every replay equals an eager call
    a = decode_case(2, 2, 64, 256, 128, 64, 512, gpu, 31)
    out = torch.empty(2, 2, 64, 512, dtype=torch.bfloat16, device=gpu)
    sparse_mla_decode(*decode_args(a), out, config=one, num_splits=5)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        sparse_mla_decode(*decode_args(a), out, config=one, num_splits=5)
    for seed in range(3):
        b2 = decode_case(2, 2, 64, 256, 128, 64, 512, gpu, 40 + seed)
        for k in ("q", "indices", "topk_length", "extra_indices_in_kvcache", "extra_topk_length"):
            a[k].copy_(b2[k])
        g.replay()
        eager, _ = sparse_mla_decode(*decode_args(a), config=two, num_splits=5)
        torch.cuda.synchronize()
        assert torch.equal(out, eager), seed


@pytest.mark.gpu
def test_ops_pick_triton_on_gpu_and_reference_when_forced(gpu):
    a = decode_case(4, 1, 64, 64, 128, 64, 256, gpu, 4)
    assert ops.backend_for("sparse_mla_decode", gpu) == "triton"
    out, _ = ops.sparse_mla_decode(*decode_args(a))
    with ops.use_backend("reference"):
        ref, _ = ops.sparse_mla_decode(*decode_args(a))
    check_out(out, ref, "ops dispatch", decode_key_amax(a))


@pytest.mark.gpu
def test_triton_decode_graph_replay_with_out_buffer(gpu):
    """Captured with an out buffer and replayed on new values written into the same tensors: the graph's
    output equals an eager call's (addresses fixed, the split scratch cached outside the capture)."""
    from dsv4_rocm import flash_mla
    a = decode_case(3, 2, 64, 64, 128, 2, 256, gpu, 12)
    out = torch.empty(3, 2, 64, 512, dtype=torch.bfloat16, device=gpu)
    meta, _ = flash_mla.get_mla_metadata()

    def step():
        return flash_mla.flash_mla_with_kvcache(a["q"], a["k_cache"], None, None, 512, meta, None, SM, False, True,
                                                a["indices"], a["attn_sink"], a["extra_k_cache"],
                                                a["extra_indices_in_kvcache"], a["topk_length"],
                                                a["extra_topk_length"], out=out)
    step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    b2 = decode_case(3, 2, 64, 64, 128, 2, 256, gpu, 13)
    for k in ("q", "indices", "topk_length", "extra_indices_in_kvcache", "extra_topk_length"):
        a[k].copy_(b2[k])
    g.replay()
    torch.cuda.synchronize()
    ref, _ = ra.flash_mla_with_kvcache_sparse(*decode_args(a))
    check_out(out, ref, "graph replay", decode_key_amax(a))


PREFILL_CASES = [(1, 64, 64, 300), (37, 64, 640, 5000), (128, 128, 1152, 70000), (64, 64, 2048, 4096),
                 (5, 128, 100, 7), (40, 64, 2048, 32)]


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", DECODE_KERNELS)
@pytest.mark.parametrize("case", PREFILL_CASES, ids=[str(c) for c in PREFILL_CASES])
@pytest.mark.parametrize("sink", ["random", "none", "+inf", "-inf"])
def test_triton_prefill_matches_reference(case, sink, kernel, gpu):
    """Both prefill kernels (this file's Triton kernel, the Hopper kernel over bf16 rows) against the
    reference: out, lse, max logits, lonely queries."""
    from dsv4_rocm.triton.attention.sparse_mla_prefill import sparse_mla_prefill
    cfg = decode_kernel_config(kernel, gpu)
    s_q, h, topk, s_kv = case
    q, kv, idx, lens, s = prefill_case(s_q, h, topk, s_kv, gpu, s_q * 7 + topk, sink)
    ref = ra.flash_mla_sparse_fwd(q, kv, idx, SM, 512, s, lens)
    out = sparse_mla_prefill(q, kv, idx, SM, 512, s, lens, config=cfg)
    check_out(out[0], ref[0], f"prefill {case} {sink}", prefill_key_amax(kv, idx, lens))
    check_lse(out[2], ref[2])
    check_lonely(out[0], out[2], [0, 1] if s_q > 1 else [0], out[1])
    fin = torch.isfinite(ref[1])
    assert torch.equal(torch.isneginf(out[1]), torch.isneginf(ref[1]))
    torch.testing.assert_close(out[1][fin], ref[1][fin], atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", DECODE_KERNELS)
def test_triton_prefill_call_forms(kernel, gpu):
    from dsv4_rocm.triton.attention.sparse_mla_prefill import sparse_mla_prefill
    cfg = decode_kernel_config(kernel, gpu)
    q, kv, idx, lens, s = prefill_case(50, 128, 256, 1000, gpu, 5)
    base = sparse_mla_prefill(q, kv, idx, SM, 512, s, lens, config=cfg)
    out, back = padded_out((50, 128, 512), gpu)
    before = back.clone()
    res = sparse_mla_prefill(strided(q), strided(kv), strided(idx), SM, 512, s, strided(lens), out, config=cfg)
    torch.cuda.synchronize()
    assert res[0] is out and all(torch.equal(x, y) for x, y in zip(res, base))
    written = torch.zeros_like(back, dtype=torch.bool)
    written[:50, :128] = True
    assert torch.equal(back[~written].view(torch.int16), before[~written].view(torch.int16))


@pytest.mark.gpu
def test_warmup_leaves_nothing_to_compile(gpu):
    """After flash_mla.warmup with a model's configurations, calls of those configurations (any batch,
    s_q 1 or 2, [b] lengths, topk a multiple of 16) compile nothing."""
    from dsv4_rocm import flash_mla
    from dsv4_rocm.triton.attention import sparse_mla_decode as D, sparse_mla_prefill as P
    cfgs = [flash_mla.WarmupConfig(64, 64, 2, True), flash_mla.WarmupConfig(128, 256, None, False)]
    rep = flash_mla.warmup(gpu, cfgs)
    print(rep)
    index = torch.cuda.current_device()

    kernels = [D._sparse_mla_paged_kernel, D._combine_kernel, P._sparse_mla_prefill_kernel]
    if D._ws is not None:
        kernels.append(D._ws._sparse_mla_ws_kernel)

    def compiled():
        return sum(len(k.device_caches[index][0]) for k in kernels)
    n = compiled()
    for b, s_q in ((1, 1), (7, 2), (300, 1)):
        a = decode_case(b, s_q, 64, 64, 128, 2, 256, gpu, b)
        ops.sparse_mla_decode(*decode_args(a))
        a = decode_case(b, s_q, 128, 256, 384, 0, 0, gpu, b, lens_shape="b")
        ops.sparse_mla_decode(*decode_args(dict(a, topk_length=None)))
        q, kv, idx, lens, s = prefill_case(b, 64, 256, 500, gpu, b)
        ops.sparse_mla_prefill(q, kv, idx, SM, 512, s, lens)
    torch.cuda.synchronize()
    assert compiled() == n


@pytest.mark.gpu
def test_smoke_small_decode_and_prefill(gpu):
    """Small cases that exercise every code path (splits, odd block sizes, invalid ids, strided inputs);
    the suite runs this one under compute-sanitizer memcheck."""
    from dsv4_rocm.triton.attention.sparse_mla_decode import sparse_mla_decode
    from dsv4_rocm.triton.attention.sparse_mla_prefill import sparse_mla_prefill
    a = decode_case(3, 2, 64, 100, 96, 3, 40, gpu, 21)
    ref, _ = ra.flash_mla_with_kvcache_sparse(*decode_args(a))
    s = dict(a, q=strided(a["q"]), indices=strided(a["indices"]))
    for ns in (1, 3):       # the default kernel of this GPU
        check_out(sparse_mla_decode(*decode_args(s), num_splits=ns)[0], ref, f"smoke decode splits={ns}",
                  decode_key_amax(a))
    q, kv, idx, lens, sk = prefill_case(3, 64, 70, 50, gpu, 8)
    check_out(sparse_mla_prefill(strided(q), strided(kv), strided(idx), SM, 512, sk, lens)[0],
              ra.flash_mla_sparse_fwd(q, kv, idx, SM, 512, sk, lens)[0], "smoke prefill",
              prefill_key_amax(kv, idx, lens))
