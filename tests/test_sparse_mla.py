"""Sparse MLA attention (DSV4_SPEC §7): reference semantics on CPU, Triton kernels vs reference on GPU.

Tolerances (FlashMLA's): the kernels round P to bf16 for the P.V product and accumulate in fp32 in
another order, so out is checked to abs 1e-3 or rel 2/128 per element plus a cosine difference
< 5e-6 over the tensor; lse (fp32, order of summation only) to abs 1e-6 + rel 8/65536.
"""
import math

import pytest
import torch

from dsv4_rocm import flash_mla, ops
from dsv4_rocm.reference import attention as ra
from dsv4_rocm.reference import cache as rc
from helpers import cos_diff, poison_like, random_indices, random_paged_cache

SM = 512 ** -0.5


def direct_attend(q, Ks, sink):
    """DSV4_SPEC §11 pseudo-code, float64, one head."""
    l = SM * (Ks.double() @ q.double())
    m = max(float(l.max()), sink)
    e = torch.exp(l - m)
    return (e @ Ks.double()) / (e.sum() + math.exp(sink - m))


@pytest.mark.parametrize("sink", [None, float("-inf"), float("inf"), "random"])
def test_attend_matches_spec_formula(sink):
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


def test_lonely_query_is_zero_with_inf_lse():
    q = torch.randn(2, 3, 512)
    out, lse, mx = ra.attend(q, torch.randn(2, 5, 512), torch.zeros(2, 5, dtype=torch.bool), SM, torch.zeros(3))
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isposinf(lse).all() and torch.isneginf(mx).all()


def _decode_case(b, s_q, h, bs_main, topk, bs_extra, extra_topk, device, seed, sink="random", lens_shape="b"):
    pages, K = random_paged_cache(max(2, 4096 // bs_main), bs_main, device, seed)
    cap = pages.shape[0] * bs_main
    idx, lens = random_indices(b, s_q, topk, cap, topk, device, seed + 1)
    if lens_shape == "bsq":
        lens = torch.randint(0, topk + 1, (b, s_q), generator=torch.Generator().manual_seed(seed)).int().to(device)
    extra = {}
    if bs_extra:
        epages, _ = random_paged_cache(max(2, 4096 // bs_extra), bs_extra, device, seed + 2)
        eidx, elens = random_indices(b, s_q, extra_topk, epages.shape[0] * bs_extra, extra_topk, device, seed + 3)
        extra = dict(extra_k_cache=rc.flash_mla_view(epages, bs_extra), extra_indices_in_kvcache=eidx,
                     extra_topk_length=elens)
    g = torch.Generator().manual_seed(seed + 4)
    q = torch.randn(b, s_q, h, 512, generator=g).to(torch.bfloat16).to(device)
    s = {"random": torch.randn(h, generator=g) * 2, "none": None, "-inf": torch.full((h,), float("-inf")),
         "+inf": torch.full((h,), float("inf"))}[sink]
    if s is not None:
        s = s.to(device)
    return dict(q=q, k_cache=rc.flash_mla_view(pages, bs_main), indices=idx, topk_length=lens, attn_sink=s, **extra)


def test_flash_mla_interface_runs_reference_on_cpu():
    a = _decode_case(3, 2, 64, 64, 64, 2, 32, "cpu", 5)
    meta, _ = flash_mla.get_mla_metadata()
    out, lse = flash_mla.flash_mla_with_kvcache(a["q"], a["k_cache"], None, None, 512, meta, is_fp8_kvcache=True,
                                                indices=a["indices"], attn_sink=a["attn_sink"],
                                                extra_k_cache=a["extra_k_cache"],
                                                extra_indices_in_kvcache=a["extra_indices_in_kvcache"],
                                                topk_length=a["topk_length"], extra_topk_length=a["extra_topk_length"])
    assert out.shape == (3, 2, 64, 512) and lse.shape == (3, 64, 2)
    with pytest.raises(ValueError, match="tile_scheduler_metadata"):
        flash_mla.flash_mla_with_kvcache(a["q"][:1], a["k_cache"], None, None, 512, meta, is_fp8_kvcache=True,
                                         indices=a["indices"][:1])


def test_paged_decode_equals_bf16_prefill_semantics():
    """The two reference paths agree: paged fp8 decode == prefill over the dequantized rows."""
    a = _decode_case(4, 1, 64, 64, 96, 0, 0, "cpu", 9)
    out, lse = ra.flash_mla_with_kvcache_sparse(a["q"], a["k_cache"], a["indices"], a["topk_length"],
                                                a["attn_sink"], None, None, None, SM)
    pages = rc.as_pages(a["k_cache"], 64)
    kv = rc.decode_k_records(rc.gather_k_records(pages, torch.arange(pages.shape[0] * 64), 64)).bfloat16()
    o2, _, l2 = ra.flash_mla_sparse_fwd(a["q"][:, 0], kv.unsqueeze(1), a["indices"], SM, 512, a["attn_sink"],
                                        a["topk_length"])
    torch.testing.assert_close(out[:, 0].float(), o2.float(), rtol=0, atol=0)
    torch.testing.assert_close(lse[:, :, 0], l2, rtol=0, atol=0)


def test_decode_rejects_bad_inputs():
    a = _decode_case(2, 1, 64, 64, 64, 0, 0, "cpu", 3)
    with pytest.raises(ValueError, match="q must have 64 or 128 heads"):
        ops.sparse_mla_decode(a["q"][:, :, :32], a["k_cache"], a["indices"], a["topk_length"], None, None, None,
                              None, SM)
    with pytest.raises(ValueError, match="indices"):
        ops.sparse_mla_decode(a["q"], a["k_cache"], a["indices"].long(), a["topk_length"], None, None, None, None, SM)
    with pytest.raises(ValueError, match="attn_sink"):
        ops.sparse_mla_decode(a["q"], a["k_cache"], a["indices"], a["topk_length"], torch.zeros(32), None, None,
                              None, SM)
    bad = torch.zeros(4, 64, 1, 584, dtype=torch.uint8)          # contiguous: page stride 64*584, not 576-aligned
    with pytest.raises(ValueError, match="page stride"):
        ops.sparse_mla_decode(a["q"], bad, a["indices"], a["topk_length"], None, None, None, None, SM)
    with pytest.raises(ValueError, match="extra_k_cache is None"):
        ops.sparse_mla_decode(a["q"], a["k_cache"], a["indices"], a["topk_length"], None, None, a["indices"], None, SM)


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
]


def _check_out(out, ref, name, key_amax):
    """Per element |o - r| <= 2/128 |r| + 2^-8 * max_i |K_i| (max over the query's valid keys, per
    dim): P is rounded to bf16 (relative error 2^-9 per weight) before P.V, so the absolute error of
    an output element is bounded by the largest key value it averages, not by its own size. Plus the
    tensor-wide cosine difference < 5e-6 that FlashMLA's tests use."""
    o, r = out.float(), ref.float()
    assert not torch.isnan(o).any(), f"{name}: NaN"
    tol = r.abs() * (2 / 128) + key_amax.float() * 2 ** -8
    bad = (o - r).abs() > tol
    cd = cos_diff(o, r)
    print(f"{name}: max abs {float((o - r).abs().max()):.3e}  cos-diff {cd:.2e}  mismatches {int(bad.sum())}")
    assert int(bad.sum()) == 0
    assert cd < 5e-6


def _decode_key_amax(a, b, s_q):
    """max |K| over each query's valid keys of both sets, per dim: [b, s_q, 1, 512]."""
    K, valid = ra._paged_set(a["k_cache"], a["indices"], a["topk_length"], b, s_q)
    amax = (K.abs() * valid.unsqueeze(-1)).amax(1)
    if a.get("extra_k_cache") is not None:
        K2, v2 = ra._paged_set(a["extra_k_cache"], a["extra_indices_in_kvcache"], a["extra_topk_length"], b, s_q)
        amax = torch.maximum(amax, (K2.abs() * v2.unsqueeze(-1)).amax(1))
    return amax.reshape(b, s_q, 1, 512)


def _prefill_key_amax(kv, idx, lens):
    i = idx[:, 0].long()
    valid = (i >= 0) & (i < kv.shape[0])
    if lens is not None:
        valid &= torch.arange(i.shape[1], device=i.device) < lens.long().unsqueeze(1)
    K = kv[:, 0].float()[torch.where(valid, i, 0)]
    return (K.abs() * valid.unsqueeze(-1)).amax(1).unsqueeze(1)


def _check_lse(lse, ref):
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isposinf(lse), torch.isposinf(ref))
    torch.testing.assert_close(lse[fin], ref[fin], atol=1e-6, rtol=8 / 65536)


@pytest.mark.gpu
@pytest.mark.parametrize("case", DECODE_CASES, ids=[str(c) for c in DECODE_CASES])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_triton_decode_matches_reference(case, splits, gpu):
    from dsv4_rocm.triton.sparse_mla_decode import sparse_mla_decode
    b, s_q, h, bs, topk, ebs, etopk, sink, lshape = case
    a = _decode_case(b, s_q, h, bs, topk, ebs, etopk, gpu, 11 + b, sink, lshape)
    args = (a["q"], a["k_cache"], a["indices"], a["topk_length"], a["attn_sink"], a.get("extra_k_cache"),
            a.get("extra_indices_in_kvcache"), a.get("extra_topk_length"), SM)
    ref_out, ref_lse = ra.flash_mla_with_kvcache_sparse(*args)
    out, lse = sparse_mla_decode(*args, num_splits=splits)
    _check_out(out, ref_out, f"decode {case} splits={splits}", _decode_key_amax(a, b, s_q))
    if sink != "+inf":
        _check_lse(lse, ref_lse)


@pytest.mark.gpu
def test_triton_decode_all_invalid_and_zero_lengths(gpu):
    from dsv4_rocm.triton.sparse_mla_decode import sparse_mla_decode
    a = _decode_case(6, 1, 64, 64, 128, 64, 512, gpu, 2)
    a["indices"].fill_(-1)
    a["extra_topk_length"].zero_()
    for ns in (1, 4):
        out, lse = sparse_mla_decode(a["q"], a["k_cache"], a["indices"], a["topk_length"], a["attn_sink"],
                                     a["extra_k_cache"], a["extra_indices_in_kvcache"], a["extra_topk_length"], SM,
                                     num_splits=ns)
        assert torch.equal(out, torch.zeros_like(out)) and torch.isposinf(lse).all()


@pytest.mark.gpu
def test_ops_pick_triton_on_gpu_and_reference_when_forced(gpu):
    a = _decode_case(4, 1, 64, 64, 128, 64, 256, gpu, 4)
    assert ops.backend_for("sparse_mla_decode", gpu) == "triton"
    args = (a["q"], a["k_cache"], a["indices"], a["topk_length"], a["attn_sink"], a["extra_k_cache"],
            a["extra_indices_in_kvcache"], a["extra_topk_length"], SM)
    out, _ = ops.sparse_mla_decode(*args)
    with ops.use_backend("reference"):
        ref, _ = ops.sparse_mla_decode(*args)
    _check_out(out, ref, "ops dispatch", _decode_key_amax(a, 4, 1))


PREFILL_CASES = [(1, 64, 64, 300), (37, 64, 640, 5000), (128, 128, 1152, 70000), (64, 64, 2048, 4096),
                 (5, 128, 100, 7)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", PREFILL_CASES, ids=[str(c) for c in PREFILL_CASES])
@pytest.mark.parametrize("sink", ["random", "none", "+inf"])
def test_triton_prefill_matches_reference(case, sink, gpu):
    from dsv4_rocm.triton.sparse_mla_prefill import sparse_mla_prefill
    s_q, h, topk, s_kv = case
    g = torch.Generator().manual_seed(s_q * 7 + topk)
    q = torch.randn(s_q, h, 512, generator=g).bfloat16().to(gpu)
    kv = torch.randn(s_kv, 1, 512, generator=g).bfloat16().to(gpu)
    idx = torch.randint(-s_kv // 10, s_kv + s_kv // 10, (s_q, 1, topk), generator=g).int().to(gpu)
    lens = torch.randint(0, topk + 1, (s_q,), generator=g).int().to(gpu)
    s = {"random": torch.randn(h, generator=g).to(gpu), "none": None, "+inf": torch.full((h,), float("inf"),
                                                                                         device=gpu)}[sink]
    ref = ra.flash_mla_sparse_fwd(q, kv, idx, SM, 512, s, lens)
    out = sparse_mla_prefill(q, kv, idx, SM, 512, s, lens)
    _check_out(out[0], ref[0], f"prefill {case} {sink}", _prefill_key_amax(kv, idx, lens))
    _check_lse(out[2], ref[2])
    fin = torch.isfinite(ref[1])
    assert torch.equal(torch.isneginf(out[1]), torch.isneginf(ref[1]))
    torch.testing.assert_close(out[1][fin], ref[1][fin], atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_smoke_small_decode_and_prefill(gpu):
    """Small cases that exercise every code path (splits, odd block sizes, invalid ids); the suite runs
    this one under compute-sanitizer memcheck."""
    from dsv4_rocm.triton.sparse_mla_decode import sparse_mla_decode
    from dsv4_rocm.triton.sparse_mla_prefill import sparse_mla_prefill
    a = _decode_case(3, 2, 64, 100, 96, 3, 40, gpu, 21)
    args = (a["q"], a["k_cache"], a["indices"], a["topk_length"], a["attn_sink"], a["extra_k_cache"],
            a["extra_indices_in_kvcache"], a["extra_topk_length"], SM)
    ref, _ = ra.flash_mla_with_kvcache_sparse(*args)
    for ns in (1, 3):
        _check_out(sparse_mla_decode(*args, num_splits=ns)[0], ref, f"smoke decode splits={ns}", _decode_key_amax(a, 3, 2))
    q = a["q"][:, 0]
    kv = torch.randn(50, 1, 512, device=gpu).bfloat16()
    idx = torch.randint(-5, 60, (3, 1, 70), device=gpu).int()
    _check_out(sparse_mla_prefill(q, kv, idx, SM)[0], ra.flash_mla_sparse_fwd(q, kv, idx, SM)[0], "smoke prefill",
               _prefill_key_amax(kv, idx, None))
