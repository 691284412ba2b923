"""The lightning indexer's query and logits ops in vLLM's / DeepGEMM's call forms:
fused_indexer_q_rope_quant, fp8_mqa_logits, fp8_paged_mqa_logits, get_paged_mqa_logits_metadata.

CPU: the oracle against brute force (one value at a time, in fp32 0-dim tensors) and against DeepGEMM's own
test semantics (its tests/test_attention.py checks, rewritten), each op called exactly as vLLM calls it, the
NaN policy, bad input rejected before any work, the q kernel's integer and exact-fp32 paths under the Triton
interpreter, vLLM's gfx942 query (``use_fnuz``: e4m3fnuz, maximum 224) against its rule and through the
logits. GPU: the Triton kernels against the oracle (q bytes and weights bit for bit, logits within
LOGIT_TOL: indexer_inputs.py says why), outputs allocated over poisoned memory, next_n 1 to 4, 1-D and 2-D
context lengths, -1 block-table entries, varlen prefill ranges, and a decode step captured in a CUDA graph.
"""
import math
import textwrap

import pytest
import torch

from dsv4_rocm import ops
from dsv4_rocm.reference import indexer as ri
from dsv4_rocm.reference.compressor import kv_cache_view
from dsv4_rocm.reference.quant import E2M1_GRID, e4m3_decode, quantize_blocks
from dsv4_rocm.reference.rope import build_cos_sin_cache
from helpers import same_floats
from indexer_inputs import (abs_bytes, assert_logits_close, calc_diff, cp_ranges, deepgemm_paged_reference,
                            filled_cache, interpret, paged_cache_cast_to_fp8, paged_magnitude, per_row_cast_to_fp8,
                            query)

CS = build_cos_sin_cache(160000.0, 4096)
SM, HS = 128 ** -0.5, 64 ** -0.5


def f32(v):
    return torch.tensor(v, dtype=torch.float32)


def ceil_log2_of(x: torch.Tensor) -> int:
    m, e = math.frexp(float(x))
    return e - 1 if m == 0.5 else e


def brute_rope_head(qh, pos, cs):
    """One head: nope dims as they are, rope pairs e*c - o*s, e*s + o*c in fp32 then bf16 (value by value)."""
    x = [f32(float(v)) for v in qh.float()]
    for i in range(32):
        e, o = x[64 + 2 * i], x[65 + 2 * i]
        c, s = f32(float(cs[pos, i])), f32(float(cs[pos, 32 + i]))
        x[64 + 2 * i] = (e * c - o * s).bfloat16().float()
        x[65 + 2 * i] = (e * s + o * c).bfloat16().float()
    return torch.stack(x)


# ---- the oracle against brute force -------------------------------------------------------------------
def test_fp8_query_matches_brute_force():
    g = torch.Generator().manual_seed(1)
    pos, qi, w = query(3, 4, g)
    q8, wq = ops.fused_indexer_q_rope_quant(pos, qi, CS, w, SM, HS)
    assert q8.dtype == torch.float8_e4m3fn and q8.shape == (3, 4, 128) and wq.dtype == torch.float32
    for t in range(3):
        for h in range(4):
            x = brute_rope_head(qi[t, h], int(pos[t]), CS)
            e = ceil_log2_of(f32(max(float(x.abs().max()), 1e-4)) / f32(448.0))
            want = torch.stack([(v * f32(2.0 ** -e)).to(torch.float8_e4m3fn).view(torch.uint8) for v in x])
            want[want == 0x80] = 0
            assert torch.equal(q8[t, h].view(torch.uint8), want), (t, h)
            ww = ((f32(float(w[t, h])) * f32(2.0 ** e)) * f32(SM)) * f32(HS)
            assert wq[t, h].view(torch.int32) == ww.view(torch.int32), (t, h)


def test_mxfp4_query_matches_brute_force():
    g = torch.Generator().manual_seed(2)
    pos, qi, w = query(2, 3, g)
    (packed, scales), wq = ops.fused_indexer_q_rope_quant(pos, qi, CS, w, SM, HS, use_fp4=True)
    assert packed.shape == (2, 3, 64) and packed.dtype == torch.uint8
    assert scales.shape == (2, 3) and scales.dtype == torch.int32
    sb = scales.contiguous().view(torch.uint8).view(2, 3, 4)
    for t in range(2):
        for h in range(3):
            x = brute_rope_head(qi[t, h], int(pos[t]), CS)
            for blk in range(4):
                xb = x[32 * blk:32 * blk + 32]
                e = ceil_log2_of(f32(max(float(xb.abs().max()), 6 * 2.0 ** -126)) / f32(6.0))
                assert int(sb[t, h, blk]) == e + 127
                for i in range(32):
                    v = float(xb[i]) * 2.0 ** -e
                    dist = [abs(abs(v) - gv) for gv in E2M1_GRID]
                    best = [c for c in range(8) if dist[c] == min(dist)]
                    code = [c for c in best if c % 2 == 0][0] if len(best) > 1 else best[0]
                    byte = int(packed[t, h, 16 * blk + i // 2])
                    nib = (byte >> 4) if i % 2 else (byte & 0xF)
                    assert nib == code | (8 if math.copysign(1, v) < 0 else 0), (t, h, blk, i)
            assert wq[t, h] == (f32(float(w[t, h])) * f32(SM)) * f32(HS)


def test_mqa_logits_oracle_matches_brute_force():
    g = torch.Generator().manual_seed(3)
    T, H, N = 4, 3, 20
    q8 = torch.randint(0, 0x7E, (T, H, 128), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    k8 = torch.randint(0, 0x7E, (N, 128), generator=g, dtype=torch.uint8) | (torch.rand(N, 128, generator=g) < 0.5
                                                                               ).to(torch.uint8) << 7
    ks = torch.exp2(torch.randint(-12, -4, (N,), generator=g).float())
    w = torch.randn(T, H, generator=g)
    starts, ends = torch.tensor([0, 2, 5, 19], dtype=torch.int32), torch.tensor([3, 2, 20, 20], dtype=torch.int32)
    lg = ops.fp8_mqa_logits(q8, (k8.view(torch.float8_e4m3fn), ks), w, starts, ends)
    qf, kf = e4m3_decode(q8.view(torch.uint8)).double(), e4m3_decode(k8).double()
    for t in range(T):
        for j in range(N):
            if starts[t] <= j < ends[t]:
                ref = sum(float(w[t, h]) * max(0.0, float((qf[t, h] * kf[j]).sum()) * float(ks[j])) for h in range(H))
                mag = sum(abs(float(w[t, h])) * float((qf[t, h] * kf[j]).abs().sum()) * float(ks[j]) for h in range(H))
                assert abs(float(lg[t, j]) - ref) <= 2 ** -16 * mag + 1e-30
            else:
                assert lg[t, j] == float("-inf")


@pytest.mark.parametrize("next_n, lens_2d", [(1, False), (2, False), (2, True), (3, True)])
def test_paged_oracle_equals_contiguous_oracle(next_n, lens_2d):
    """Each draft row of the paged logits equals the prefill logits over its own causal prefix of the keys;
    a -1 block-table entry inside the context gives -inf for its keys."""
    g = torch.Generator().manual_seed(4 + next_n)
    lens = [150, 3, 64, 0]
    bs = 32
    pages, kv, bt, _ = filled_cache(lens, bs, g)
    bt[0, 2] = -1                                          # keys 64..95 of request 0 have no page
    B, H = len(lens), 8
    q8 = torch.randint(0, 0x7E, (B, next_n, H, 128), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    w = torch.randn(B * next_n, H, generator=g)
    if lens_2d:
        cl = torch.tensor([[max(n - next_n + 1 + i - (i % 2) * 5, 0) for i in range(next_n)] for n in lens],
                          dtype=torch.int32)
    else:
        cl = torch.tensor(lens, dtype=torch.int32)
    meta = ops.get_paged_mqa_logits_metadata(cl, bs, 8)
    lg = ops.fp8_paged_mqa_logits(q8, kv.unsqueeze(-2), w, cl, bt, meta, 160)
    assert lg.shape == (B * next_n, 160)
    vis = ri.visible_keys(cl, next_n)
    for b, n in enumerate(lens):
        k8 = torch.empty(max(n, 0), 128, dtype=torch.float8_e4m3fn)
        ksc = torch.empty(max(n, 0), 4, dtype=torch.uint8)
        bt_ok = bt[b:b + 1].clone()
        bt_ok[bt_ok < 0] = 0                              # any page: the keys there must come out -inf
        ops.cp_gather_indexer_k_quant_cache(kv, k8, ksc, bt_ok, torch.tensor([0, n], dtype=torch.int32))
        for i in range(next_n):
            r = b * next_n + i
            v = max(int(vis[b, i]), 0)
            sc = ksc.view(torch.float32).reshape(-1)
            rng = (torch.tensor([0]), torch.tensor([v]))
            ref = ri.fp8_mqa_logits(q8[b, i:i + 1], (k8, sc), w[r:r + 1], *rng)[0]
            mag = ri.fp8_mqa_logits(abs_bytes(q8[b, i:i + 1]), (abs_bytes(k8), sc.abs()), w[r:r + 1].abs(), *rng)[0]
            if b == 0:
                ref[64:96] = float("-inf")
            assert_logits_close(lg[r, :n], ref, mag, tol=2 ** -16)     # the order of the fp32 sums only
            assert (lg[r, n:] == float("-inf")).all()


# ---- DeepGEMM's test semantics (tests/test_attention.py), rewritten ------------------------------------
def _deepgemm_mqa_case(seq_len, seq_len_kv, disable_cp, device, g):
    q = torch.randn(seq_len, 64, 128, generator=g).bfloat16()
    kv = torch.randn(seq_len_kv, 128, generator=g).bfloat16()
    w = torch.randn(seq_len, 64, generator=g)
    if disable_cp:
        ks = torch.zeros(seq_len, dtype=torch.int32)
        ke = (torch.arange(seq_len) + (seq_len_kv - seq_len)).to(torch.int32)
    else:
        ks, ke = cp_ranges(seq_len, seq_len_kv)
    q8 = q.to(torch.float8_e4m3fn)
    k8, sf = per_row_cast_to_fp8(kv)
    j = torch.arange(seq_len_kv)
    mask = (j[None, :] >= ks[:, None]) & (j[None, :] < ke[:, None])
    ref = (torch.einsum("mhd,nd->hmn", q.float(), kv.float()).relu() * w.t()[..., None]).sum(0)
    ref = ref.masked_fill(~mask, float("-inf"))
    d = lambda t: t.to(device)                                          # noqa: E731
    return (d(q8), (d(k8), d(sf)), d(w), d(ks), d(ke)), ref


def _check_deepgemm_mqa(args, ref):
    logits = ops.fp8_mqa_logits(*args).cpu()
    neg = ref == float("-inf")
    assert torch.equal(logits == float("-inf"), neg)
    diff = calc_diff(logits.masked_fill(neg, 0), ref.masked_fill(neg, 0))
    print(f"DeepGEMM mqa logits check: calc_diff {diff:.2e}")
    assert diff < 1e-3


@pytest.mark.parametrize("disable_cp", [False, True])
def test_deepgemm_mqa_logits_semantics(disable_cp):
    _check_deepgemm_mqa(*_deepgemm_mqa_case(32, 128, disable_cp, "cpu", torch.Generator().manual_seed(5)))


def _deepgemm_paged_case(batch, next_n, avg_kv, bs, lens_2d, device, g, max_model_len):
    q = torch.randn(batch, next_n, 64, 128, generator=g).bfloat16()
    w = torch.randn(batch * next_n, 64, generator=g)
    cl = torch.randint(int(0.7 * avg_kv), int(1.3 * avg_kv), (batch,), generator=g).to(torch.int32)
    need = [-(-int(n) // bs) for n in cl]
    nb = sum(need) + 4
    kv = torch.randn(nb, bs, 1, 128, generator=g).bfloat16()
    cache = paged_cache_cast_to_fp8(kv)
    bt = torch.zeros(batch, max(need), dtype=torch.int32)
    pool = torch.randperm(nb, generator=g).to(torch.int32)
    o = 0
    for i, k in enumerate(need):
        bt[i, :k] = pool[o:o + k]
        o += k
    ref = deepgemm_paged_reference(q, kv, w, cl, bt, max_model_len, lens_2d)
    pos = torch.arange(max_model_len).unsqueeze(0)
    if lens_2d:
        cl_arg = ((cl.unsqueeze(1) + 1) * torch.rand(batch, next_n, generator=g)).int()
        cl_arg[:, next_n - 1] = cl
        neg = ~(pos < cl_arg.view(-1).unsqueeze(1))
    else:
        cl_arg = cl
        r = torch.arange(batch * next_n)
        neg = ~(pos <= (cl[r // next_n] - next_n + r % next_n).unsqueeze(1))
    d = lambda t: t.to(device)                                          # noqa: E731
    meta = ops.get_paged_mqa_logits_metadata(d(cl_arg), bs, 132)
    args = (d(q.to(torch.float8_e4m3fn)), d(cache), d(w), d(cl_arg), d(bt), meta, max_model_len)
    return args, ref, neg, lens_2d


def _check_deepgemm_paged(args, ref, neg, lens_2d):
    logits = ops.fp8_paged_mqa_logits(*args, clean_logits=not lens_2d).cpu()
    if not lens_2d:                                        # DeepGEMM checks the -inf mask when it cleans
        assert torch.equal(logits == float("-inf"), neg)
    diff = calc_diff(logits.masked_fill(neg, 0), ref.masked_fill(neg, 0))
    print(f"DeepGEMM paged logits check: calc_diff {diff:.2e}")
    assert diff < 1e-3


@pytest.mark.parametrize("next_n, bs, lens_2d", [(1, 64, False), (2, 32, False), (2, 64, True)])
def test_deepgemm_paged_mqa_logits_semantics(next_n, bs, lens_2d):
    g = torch.Generator().manual_seed(6 + next_n)
    _check_deepgemm_paged(*_deepgemm_paged_case(3, next_n, 96, bs, lens_2d, "cpu", g, 160))


def test_weights_out_dtype_of_vllm_033():
    """vLLM 0.33's eighth argument: bfloat16 weights for the MXFP4 query are the float32 ones rounded to
    nearest even (vLLM's kernel stores its fp32 product into a bf16 buffer); the FP8 query takes float32
    only, as vLLM asserts; anything else is a ValueError."""
    g = torch.Generator().manual_seed(8)
    pos, qi, w = query(5, 16, g)
    w = w * torch.exp2(torch.randint(-20, 20, w.shape, generator=g).float())      # many bf16 roundings
    (p32, s32), w32 = ops.fused_indexer_q_rope_quant(pos, qi, CS, w, SM, HS, True)
    (p16, s16), w16 = ops.fused_indexer_q_rope_quant(pos, qi, CS, w, SM, HS, True, torch.bfloat16)
    assert torch.equal(p16, p32) and torch.equal(s16, s32) and w16.dtype == torch.bfloat16
    bits = w32.view(torch.int32).long()                                      # RNE of the fp32 bits, by hand
    rne = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(torch.int16)
    assert torch.equal(w16.view(torch.int16), rne)
    _, w8 = ops.fused_indexer_q_rope_quant(pos, qi, CS, w, SM, HS, weights_out_dtype=torch.float32)
    _, w8d = ops.fused_indexer_q_rope_quant(pos, qi, CS, w, SM, HS)
    assert w8.dtype == torch.float32 and torch.equal(w8, w8d)
    with pytest.raises(ValueError, match="weights_out_dtype=torch.bfloat16 is for the MXFP4 query"):
        ops.fused_indexer_q_rope_quant(pos, qi, CS, w, SM, HS, False, torch.bfloat16)
    with pytest.raises(ValueError, match="weights_out_dtype must be"):
        ops.fused_indexer_q_rope_quant(pos, qi, CS, w, SM, HS, True, torch.float16)


def test_fnuz_query_is_vllms_gfx942_query():
    """use_fnuz: vLLM 0.33's gfx942 FP8 query, checked against its rule written out per head with torch's own
    e4m3fnuz cast (scale 2^ceil(log2(max(amax, 1e-4) / 224)), bytes of x / scale, w' = w * scale * softmax
    scale * head scale in fp32); a poisoned head gets 0x80 (fnuz NaN) and a NaN weight. Its bytes are the OCP
    query's and its weights exactly twice the OCP ones."""
    g = torch.Generator().manual_seed(31)
    pos, qi, w = query(6, 8, g)
    qi[1, 2] *= 2.0 ** -30                                # below the 1e-4 floor of amax
    qi[4, 6, 77] = float("nan")
    q8, wq = ops.fused_indexer_q_rope_quant(pos, qi, CS, w, SM, HS)
    z8, wz = ops.fused_indexer_q_rope_quant(pos, qi, CS, w, SM, HS, use_fnuz=True)
    assert z8.dtype == torch.float8_e4m3fnuz and z8.shape == q8.shape and wz.dtype == torch.float32
    for t in range(6):
        for h in range(8):
            x = brute_rope_head(qi[t, h], int(pos[t]), CS)
            if t == 4 and h == 6:
                assert (z8[t, h].view(torch.uint8) == 0x80).all() and torch.isnan(wz[t, h])
                continue
            scale = f32(2.0 ** ceil_log2_of(f32(max(float(x.abs().max()), 1e-4)) / f32(224.0)))
            want = (x / scale).to(torch.float8_e4m3fnuz).view(torch.uint8)
            assert torch.equal(z8[t, h].view(torch.uint8), want), (t, h)
            assert wz[t, h] == w[t, h].float() * scale * f32(SM) * f32(HS), (t, h)
    poisoned = torch.isnan(wq)
    assert torch.equal(z8.view(torch.uint8)[~poisoned], q8.view(torch.uint8)[~poisoned])
    assert torch.equal(wz[~poisoned], 2 * wq[~poisoned]) and torch.equal(torch.isnan(wz), poisoned)


def test_logits_read_the_fnuz_query_as_fnuz():
    """A float8_e4m3fnuz query (and, in prefill, float8_e4m3fnuz keys with their doubled scales) gives the
    logits of the OCP query of the same inputs bit for bit: its bytes read as fnuz are half the OCP values and
    its weights twice the OCP ones, both exact. The poisoned row is NaN on both paths, any NaN (its payload is
    the CPU's choice and differs between the two paths on some machines)."""
    g = torch.Generator().manual_seed(32)
    pos, qi, w = query(6, 16, g)
    qi[5, 1, 3] = float("inf")
    q8, wq = ops.fused_indexer_q_rope_quant(pos, qi, CS, w, SM, HS)
    z8, wz = ops.fused_indexer_q_rope_quant(pos, qi, CS, w, SM, HS, use_fnuz=True)
    keys = torch.randn(90, 128, generator=g) * torch.exp2(torch.randint(-6, 6, (90, 1), generator=g).float())
    kq, e = quantize_blocks(keys, 128, 1e-4)
    kz, ez = quantize_blocks(keys, 128, 1e-4, fnuz=True)
    ocp_kv = (kq.view(torch.float8_e4m3fn), ri.pow2_or_nan(e[:, 0]))
    fnuz_kv = (kz.view(torch.float8_e4m3fnuz), ri.pow2_or_nan(ez[:, 0]))
    ks, ke = torch.tensor([0, 5, 60, 0, 89, 0], dtype=torch.int32), torch.tensor([90, 40, 61, 0, 90, 90],
                                                                                 dtype=torch.int32)
    ocp = ops.fp8_mqa_logits(q8, ocp_kv, wq, ks, ke)
    assert torch.isnan(ocp[5]).all() and torch.isfinite(ocp[0]).all()
    assert same_floats(ops.fp8_mqa_logits(z8, ocp_kv, wz, ks, ke), ocp)
    assert same_floats(ops.fp8_mqa_logits(z8, fnuz_kv, wz, ks, ke), ocp)
    assert same_floats(ops.fp8_fp4_mqa_logits((z8, None), fnuz_kv, wz, ks, ke, True), ocp)
    _, kv, bt, _ = filled_cache([70, 20, 50], 32, g)
    cl, meta = torch.tensor([[69, 70], [19, 20], [49, 50]], dtype=torch.int32), torch.zeros(3, 2, dtype=torch.int32)
    paged = ops.fp8_paged_mqa_logits(q8.view(3, 2, 16, 128), kv, wq, cl, bt, meta, 80)
    assert same_floats(ops.fp8_paged_mqa_logits(z8.view(3, 2, 16, 128), kv, wz, cl, bt, meta, 80), paged)
    assert same_floats(ops.fp8_fp4_paged_mqa_logits((z8.view(3, 2, 16, 128), None), kv.unsqueeze(-2), wz, cl, bt, meta, 80,
                                             True), paged)


# ---- call forms -----------------------------------------------------------------------------------------
def test_call_forms_are_vllms_and_deepgemms():
    g = torch.Generator().manual_seed(7)
    pos, qi, w = query(4, 64, g)
    cs16 = CS.bfloat16()
    q8, wq = ops.fused_indexer_q_rope_quant(pos, qi, cs16, w, SM, HS)            # bf16 cos/sin, as vLLM may pass
    q8b, wqb = ops.fused_indexer_q_rope_quant(positions=pos, index_q=qi, index_q_cos_sin_cache=cs16,
                                              index_weights=w, index_weights_softmax_scale=SM,
                                              index_weights_head_scale=HS, use_fp4=False)
    assert torch.equal(q8.view(torch.uint8), q8b.view(torch.uint8)) and torch.equal(wq, wqb)
    pages, kv, bt, _ = filled_cache([70, 20], 64, g)
    # prefill: vLLM gathers the request's keys into a workspace, then DeepGEMM's logits on (k, scale)
    k_quant = torch.empty(90, 128, dtype=torch.float8_e4m3fn)
    k_scale = torch.empty(90, 4, dtype=torch.uint8)
    ops.cp_gather_indexer_k_quant_cache(kv, k_quant, k_scale, bt, torch.tensor([0, 70, 90], dtype=torch.int32))
    torch.ops.dsv4_rocm.cp_gather_indexer_k_quant_cache(kv, k_quant, k_scale, bt,
                                                        torch.tensor([0, 70, 90], dtype=torch.int32))
    ks, ke = torch.tensor([0, 70, 0, 70], dtype=torch.int32), torch.tensor([70, 90, 10, 71], dtype=torch.int32)
    lg = ops.fp8_mqa_logits(q8, (k_quant, k_scale.view(torch.float32).squeeze(-1)), wq, ks, ke, clean_logits=False)
    lg2 = ops.fp8_fp4_mqa_logits((q8, None), (k_quant, k_scale.view(torch.float32).squeeze(-1)), wq, ks, ke,
                                 clean_logits=False)
    assert lg.shape == (4, 90) and torch.equal(lg, lg2)
    # decode: DeepGEMM's [nb, bs, 1, 132] view of vLLM's cache, 2-D seq_lens, its schedule metadata
    seq_lens = torch.tensor([[70], [20]], dtype=torch.int32)
    meta = ops.get_paged_mqa_logits_metadata(seq_lens, 64, 132)
    assert meta.shape == (133, 2) and meta.dtype == torch.int32
    plg = ops.fp8_fp4_paged_mqa_logits((q8[:2].unsqueeze(1), None), kv.unsqueeze(-2), wq[:2], seq_lens, bt, meta,
                                       max_model_len=128, clean_logits=False)
    plg2 = ops.fp8_paged_mqa_logits(q8[:2].unsqueeze(1), kv, wq[:2], seq_lens.view(-1), bt, meta, 128)
    assert plg.shape == (2, 128) and torch.equal(plg[:, :70], plg2[:, :70])
    for row, keys in ((0, slice(0, 70)), (1, slice(70, 90))):            # the same keys, paged or gathered
        ref = lg[row, keys]
        torch.testing.assert_close(plg[row, :ref.shape[0]], ref, rtol=0, atol=1e-5 * float(ref.abs().max()))


def test_empty_batches_return_empty_results():
    e = torch.zeros(0, 64, 128).bfloat16()
    q8, wq = ops.fused_indexer_q_rope_quant(torch.zeros(0, dtype=torch.long), e, CS, torch.zeros(0, 64), SM, HS)
    assert q8.shape == (0, 64, 128) and wq.shape == (0, 64)
    lg = ops.fp8_mqa_logits(q8, (torch.zeros(5, 128, dtype=torch.uint8), torch.ones(5)), wq,
                            torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int32))
    assert lg.shape == (0, 5)
    lg = ops.fp8_paged_mqa_logits(q8.view(0, 1, 64, 128), torch.zeros(1, 64, 132, dtype=torch.uint8), wq,
                                  torch.zeros(0, dtype=torch.int32), torch.zeros(0, 1, dtype=torch.int32),
                                  torch.zeros(3, 2, dtype=torch.int32), 16)
    assert lg.shape == (0, 16)


# ---- NaN policy (docs/conventions.md) -------------------------------------------------------------------
def test_non_finite_heads_and_blocks_are_poisoned():
    g = torch.Generator().manual_seed(8)
    pos, qi, w = query(3, 4, g)
    bad = qi.clone()
    bad[0, 1, 5] = float("nan")                           # a nope dim
    bad[2, 3, 100] = float("inf")                         # a rope dim
    q8, wq = ops.fused_indexer_q_rope_quant(pos, qi, CS, w, SM, HS)
    b8, bw = ops.fused_indexer_q_rope_quant(pos, bad, CS, w, SM, HS)
    poisoned = torch.zeros(3, 4, dtype=torch.bool)
    poisoned[0, 1] = poisoned[2, 3] = True
    assert (b8.view(torch.uint8)[poisoned] == 0x7F).all() and torch.isnan(bw[poisoned]).all()
    assert torch.equal(b8.view(torch.uint8)[~poisoned], q8.view(torch.uint8)[~poisoned])
    assert torch.equal(bw[~poisoned], wq[~poisoned])
    (p4, s4), w4 = ops.fused_indexer_q_rope_quant(pos, qi, CS, w, SM, HS, use_fp4=True)
    (bp, bs4), bw4 = ops.fused_indexer_q_rope_quant(pos, bad, CS, w, SM, HS, use_fp4=True)
    sb, gb = bs4.contiguous().view(torch.uint8).view(3, 4, 4), s4.contiguous().view(torch.uint8).view(3, 4, 4)
    assert int(sb[0, 1, 0]) == 0xFF and (bp[0, 1, :16] == 0x77).all()            # block 0 of head (0, 1)
    assert int(sb[2, 3, 3]) == 0xFF and (bp[2, 3, 48:] == 0x77).all()            # block 3 of head (2, 3)
    keep = torch.ones(3, 4, 4, dtype=torch.bool)
    keep[0, 1, 0] = keep[2, 3, 3] = False
    assert torch.equal(sb[keep], gb[keep]) and torch.equal(bw4, w4)              # weights carry no q scale
    nanw = w.clone()
    nanw[1, 2] = float("nan")
    n8, nw = ops.fused_indexer_q_rope_quant(pos, qi, CS, nanw, SM, HS)
    assert torch.equal(n8.view(torch.uint8), q8.view(torch.uint8)) and torch.isnan(nw[1, 2])


def test_poisoned_queries_and_keys_give_nan_logits():
    g = torch.Generator().manual_seed(9)
    pos, qi, w = query(2, 16, g)
    qi[1, 3, 0] = float("nan")
    q8, wq = ops.fused_indexer_q_rope_quant(pos, qi, CS, w, SM, HS)
    keys = torch.randn(40, 128, generator=g).bfloat16()
    keys[7, 9] = float("inf")
    pages = torch.zeros(1, 8640, dtype=torch.uint8)
    kv = pages[:, :64 * 132].view(1, 64, 132)
    ops.indexer_k_quant_and_cache(keys, kv, torch.arange(40), 128, "ue8m0")
    bt = torch.zeros(2, 1, dtype=torch.int32)
    lg = ops.fp8_paged_mqa_logits(q8.unsqueeze(1), kv, wq, torch.tensor([40, 40], dtype=torch.int32), bt,
                                  torch.zeros(2, 2, dtype=torch.int32), 40)
    assert torch.isnan(lg[1]).all() and torch.isnan(lg[0, 7]) and torch.isfinite(lg[0, :7]).all()


# ---- bad input --------------------------------------------------------------------------------------------
def _bad_calls(pos, qi, w, q8, wq, kv, bt):
    cl = torch.tensor([30, 30], dtype=torch.int32)
    meta = torch.zeros(3, 2, dtype=torch.int32)
    q4 = q8[:2].unsqueeze(1)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)                   # noqa: E731
    k8, ksc = torch.zeros(30, 128, dtype=torch.uint8), torch.ones(30)
    return [
        ("positions has 3 entries", lambda: ops.fused_indexer_q_rope_quant(pos[:3], qi, CS, w, SM, HS)),
        ("positions must lie", lambda: ops.fused_indexer_q_rope_quant(pos + 4096, qi, CS, w, SM, HS)),
        ("index_q must have shape", lambda: ops.fused_indexer_q_rope_quant(pos, qi[..., :64], CS, w, SM, HS)),
        ("index_weights must have shape", lambda: ops.fused_indexer_q_rope_quant(pos, qi, CS, w[:, :3], SM, HS)),
        ("cos_sin_cache must have dtype", lambda: ops.fused_indexer_q_rope_quant(pos, qi, CS.double(), w, SM, HS)),
        ("index_weights_head_scale", lambda: ops.fused_indexer_q_rope_quant(pos, qi, CS, w, SM, float("nan"))),
        ("use_fp4", lambda: ops.fused_indexer_q_rope_quant(pos, qi, CS, w, SM, HS, use_fp4=1)),
        ("use_fnuz must be a bool", lambda: ops.fused_indexer_q_rope_quant(pos, qi, CS, w, SM, HS, use_fnuz=1)),
        ("use_fnuz=True names the FP8 query", lambda: ops.fused_indexer_q_rope_quant(pos, qi, CS, w, SM, HS, True,
                                                                                     use_fnuz=True)),
        ("weights_out_dtype=torch.bfloat16 is for the MXFP4", lambda: ops.fused_indexer_q_rope_quant(
            pos, qi, CS, w, SM, HS, False, torch.bfloat16, use_fnuz=True)),
        ("q must have dtype", lambda: ops.fp8_mqa_logits(q8.view(torch.float8_e5m2), (k8, ksc), wq, i32(0, 0, 0, 0),
                                                         i32(1, 1, 1, 1))),
        ("kv\\[0\\] must have dtype", lambda: ops.fp8_mqa_logits(q8, (k8.view(torch.float8_e5m2), ksc), wq,
                                                                 i32(0, 0, 0, 0), i32(1, 1, 1, 1))),
        ("q must have dtype", lambda: ops.fp8_paged_mqa_logits(q4.view(torch.float8_e5m2fnuz), kv, wq[:2], cl, bt,
                                                               meta, 64)),
        ("q must have dtype", lambda: ops.fp8_mqa_logits(qi, (k8, ksc), wq, i32(0, 0, 0, 0), i32(1, 1, 1, 1))),
        ("kv must be the pair", lambda: ops.fp8_mqa_logits(q8, k8, wq, i32(0, 0, 0, 0), i32(1, 1, 1, 1))),
        ("kv\\[1\\] must have shape", lambda: ops.fp8_mqa_logits(q8, (k8, ksc[:5]), wq, i32(0, 0, 0, 0),
                                                                 i32(1, 1, 1, 1))),
        ("cu_seqlen_ke must have dtype", lambda: ops.fp8_mqa_logits(q8, (k8, ksc), wq, i32(0, 0, 0, 0),
                                                                    torch.ones(4, dtype=torch.long))),
        ("cu_seqlen_ks / cu_seqlen_ke", lambda: ops.fp8_mqa_logits(q8, (k8, ksc), wq, i32(0, 0, 0, 0),
                                                                   i32(1, 31, 1, 1))),
        ("cu_seqlen_ks / cu_seqlen_ke", lambda: ops.fp8_mqa_logits(q8, (k8, ksc), wq, i32(0, 5, 0, 0),
                                                                   i32(1, 4, 1, 1))),
        ("weights must have dtype", lambda: ops.fp8_mqa_logits(q8, (k8, ksc), w, i32(0, 0, 0, 0), i32(1, 1, 1, 1))),
        ("heads", lambda: ops.fp8_mqa_logits(q8.repeat(1, 9, 1), (k8, ksc), wq.repeat(1, 9), i32(0, 0, 0, 0),
                                             i32(1, 1, 1, 1))),
        ("MXFP4", lambda: ops.fp8_fp4_mqa_logits((q8, wq), (k8, ksc), wq, i32(0, 0, 0, 0), i32(1, 1, 1, 1), True)),
        # context_lens of shape [1] for two requests: DeepGEMM takes [B] or [B, next_n] only
        ("context_lens must have shape", lambda: ops.fp8_paged_mqa_logits(q4, kv, wq[:2], i32(30), bt, meta, 64)),
        ("context_lens must have shape", lambda: ops.fp8_paged_mqa_logits(q4, kv, wq[:2], cl.view(2, 1, 1), bt,
                                                                          meta, 64)),
        ("context_lens must have dtype", lambda: ops.fp8_paged_mqa_logits(q4, kv, wq[:2], cl.long(), bt, meta, 64)),
        ("context_lens must lie", lambda: ops.fp8_paged_mqa_logits(q4, kv, wq[:2], i32(30, 65), bt, meta, 64)),
        ("context_lens must lie", lambda: ops.fp8_paged_mqa_logits(q4, kv, wq[:2], i32(30, -1), bt, meta, 64)),
        ("block_tables has 1 columns", lambda: ops.fp8_paged_mqa_logits(q4, kv, wq[:2], i32(30, 70), bt, meta, 128)),
        ("block_tables names a page", lambda: ops.fp8_paged_mqa_logits(q4, kv, wq[:2], cl, bt + 2, meta, 64)),
        ("next_n", lambda: ops.fp8_paged_mqa_logits(q8[:1].expand(5, -1, -1).unsqueeze(0), kv, wq[:1].expand(5, -1),
                                                    i32(30), bt[:1], meta, 64)),
        ("weights must have shape", lambda: ops.fp8_paged_mqa_logits(q4, kv, wq[:3], cl, bt, meta, 64)),
        ("schedule_metadata", lambda: ops.fp8_paged_mqa_logits(q4, kv, wq[:2], cl, bt, meta.view(-1), 64)),
        ("max_model_len", lambda: ops.fp8_paged_mqa_logits(q4, kv, wq[:2], cl, bt, meta, 0)),
        ("kv_cache must be the indexer-K cache", lambda: ops.fp8_paged_mqa_logits(q4, kv.reshape(1, -1), wq[:2], cl,
                                                                                  bt, meta, 64)),
        ("kv_cache", lambda: ops.fp8_paged_mqa_logits(q4, kv[..., :128], wq[:2], cl, bt, meta, 64)),
        ("block_size", lambda: ops.get_paged_mqa_logits_metadata(cl, 0, 132)),
        ("num_sms", lambda: ops.get_paged_mqa_logits_metadata(cl, 64, -1)),
        ("context_lens must have dtype", lambda: ops.get_paged_mqa_logits_metadata(cl.float(), 64, 132)),
    ]


def test_bad_input_is_rejected_naming_the_argument():
    g = torch.Generator().manual_seed(10)
    pos, qi, w = query(4, 16, g)
    q8, wq = ops.fused_indexer_q_rope_quant(pos, qi, CS, w, SM, HS)
    _, kv, bt, _ = filled_cache([30, 30], 64, g, spare=0)
    bt[1] = bt[0]
    for match, call in _bad_calls(pos, qi, w, q8, wq, kv, bt):
        with pytest.raises(ValueError, match=match):
            call()


def test_negative_block_table_entry_inside_the_context_is_minus_inf():
    """vLLM-style padding inside a request's pages: those keys are -inf, never read (not 0.0)."""
    g = torch.Generator().manual_seed(11)
    pos, qi, w = query(2, 16, g)
    q8, wq = ops.fused_indexer_q_rope_quant(pos, qi, CS, w, SM, HS)
    _, kv, bt, _ = filled_cache([100, 100], 32, g)
    bt[1, 1] = -1
    lg = ops.fp8_paged_mqa_logits(q8.unsqueeze(1), kv, wq, torch.tensor([100, 100], dtype=torch.int32), bt,
                                  torch.zeros(2, 2, dtype=torch.int32), 100)
    assert (lg[1, 32:64] == float("-inf")).all() and torch.isfinite(lg[1, :32]).all()
    assert torch.isfinite(lg[1, 64:]).all() and torch.isfinite(lg[0]).all()


# ---- the q kernel under the Triton interpreter -----------------------------------------------------------
_INTERPRETED_Q = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, "tests")
    from helpers import patch_interpreter_scalars
    patch_interpreter_scalars()                   # the interpreter's scalar bugs, where the Triton has them
    import torch, triton, triton.language as tl
    from dsv4_rocm.reference import indexer as ri
    from dsv4_rocm.reference.quant import e2m1_encode
    from dsv4_rocm.reference.rope import build_cos_sin_cache
    from dsv4_rocm.triton.indexer import fused_indexer_q_rope_quant as K

    @triton.jit
    def codes(v_ptr, out_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(out_ptr + i, K._e2m1(tl.load(v_ptr + i)))

    # every E2M1 code: grid points, midpoints (ties), values beside them, both signs, saturation
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    mids = (grid[1:] + grid[:-1]) / 2
    v = torch.cat([grid, mids, mids + 2 ** -20, mids - 2 ** -20, torch.tensor([6.5, 100.0, 2 ** -30])])
    v = torch.cat([v, -v, torch.zeros(256 - 2 * v.numel())])
    out = torch.zeros(256, dtype=torch.int32)
    codes[(1,)](v, out, N=256)
    print("codes", int((out != e2m1_encode(v).int()).sum()))

    # the whole kernel at position 0 (cos 1, sin 0: no bf16 rounding to do, no fp8 cast in the MXFP4 path)
    g = torch.Generator().manual_seed(0)
    T, H = 3, 20
    qi = (torch.randn(T, H, 128, generator=g) * torch.exp2(torch.randint(-9, 9, (T, H, 1), generator=g))).bfloat16()
    qi[1, 4, 70] = float("nan")
    qi[2, 19, 3] = float("-inf")
    w = torch.randn(T, H, generator=g).bfloat16()
    pos = torch.zeros(T, dtype=torch.long)
    cs = build_cos_sin_cache(160000.0, 8)
    (rp, rs), rw = ri.fused_indexer_q_rope_quant(pos, qi, cs, w, 0.125, 0.1, use_fp4=True)
    (kp, ks), kw = K.fused_indexer_q_rope_quant(pos, qi, cs, w, 0.125, 0.1, use_fp4=True)
    bits = lambda t: t.view(torch.int32)
    print("mxfp4", int((kp != rp).sum()), int((ks != rs).sum()), int((bits(kw) != bits(rw)).sum()))
    _, rw8 = ri.fused_indexer_q_rope_quant(pos, qi, cs, w, 0.125, 0.1)
    _, kw8 = K.fused_indexer_q_rope_quant(pos, qi, cs, w, 0.125, 0.1)
    print("fp8 weights", int((kw8.view(torch.int32) != rw8.view(torch.int32)).sum()), int(torch.isnan(kw8).sum()))
""")


def test_q_kernel_exact_paths_under_the_interpreter(tmp_path):
    """The E2M1 rounding, the MXFP4 path and the FP8 weight fold of the kernel equal the oracle bit for bit
    (the fp8 and bf16 casts, which the interpreter does not round like the hardware, are left out)."""
    r = interpret(_INTERPRETED_Q, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    out = dict((line.split()[0], line.split()[1:]) for line in r.stdout.strip().splitlines())
    print(r.stdout)
    assert out["codes"] == ["0"] and out["mxfp4"] == ["0", "0", "0"] and out["fp8"] == ["weights", "0", "2"]


_INTERPRETED_LOGITS = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, "tests")
    from helpers import patch_interpreter_scalars
    patch_interpreter_scalars()                   # the interpreter's scalar bugs, where the Triton has them
    import torch, triton
    sys.path.insert(0, "tests/indexer")
    from dsv4_rocm import cache_views as V
    from dsv4_rocm.reference import indexer as ri
    from dsv4_rocm.triton.indexer import fp8_mqa_logits as Q, fp8_paged_mqa_logits as P
    from indexer_inputs import abs_bytes, assert_logits_close, filled_cache, paged_magnitude

    def normal_bytes(shape, g):          # e4m3 bytes of normal numbers: the interpreter decodes those exactly
        b = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
        b = torch.where((b & 0x78) == 0, b | 0x08, b)
        return torch.where((b & 0x7F) == 0x7F, b & 0xF7, b)

    g = torch.Generator().manual_seed(0)
    for nn, lens_2d, bs, clean in ((1, False, 64, True), (2, True, 32, False), (3, False, 16, True)):
        lens = [300, 1, 0, 77, 64, 150]
        B, H, max_len = len(lens), 16, 333
        pages, kv, bt, _ = filled_cache(lens, bs, g)
        bt[3, 1] = -1
        q8 = normal_bytes((B, nn, H, 128), g)
        w = torch.randn(B * nn, H, generator=g)
        cl = torch.tensor(lens, dtype=torch.int32)
        if lens_2d:
            cl = torch.stack([(cl - 3 * i).clamp(min=0) for i in range(nn)], 1).to(torch.int32)
        out = torch.full((B * nn, max_len), float("nan"))
        pg = V.pages(kv, bs, "kv", V.INDEXER_K)
        P._fp8_paged_mqa_logits_kernel[(B, 3)](
            q8, q8.stride(0), q8.stride(1), q8.stride(2), pg, pg.stride(0), pg.shape[0], w, w.stride(0),
            cl, cl.stride(0), bt, bt.stride(0), bt.shape[1], out, out.stride(0), max_len,
            NEXT_N=nn, H=H, BS=bs, BN=32, SPLITS=3, CTX_2D=lens_2d, CLEAN=clean, FNUZ=False, TAIL_N=64, Q_FNUZ=False)
        q = q8.view(torch.float8_e4m3fn)
        ref = ri.fp8_paged_mqa_logits(q, kv, w, cl, bt, torch.zeros(2, 2, dtype=torch.int32), max_len)
        vis = ri.visible_keys(cl, nn).reshape(-1).clamp(0, max_len)
        seen = None if clean else torch.arange(max_len)[None, :] < vis[:, None]
        assert_logits_close(out, ref, paged_magnitude(q, pages, bs, w, cl, bt, max_len), f"paged next_n={nn}",
                            tol=2 ** -16, where=seen)
    M, N, H = 37, 300, 16
    q8, k8 = normal_bytes((M, H, 128), g), normal_bytes((N, 128), g)
    ks = torch.exp2(torch.randint(-8, 0, (N,), generator=g).float())
    w = torch.randn(M, H, generator=g)
    starts = torch.randint(0, 200, (M,), generator=g).to(torch.int32)
    ends = (starts + torch.randint(0, 120, (M,), generator=g)).clamp(max=N).to(torch.int32)
    for clean in (True, False):
        out = torch.full((M, N), float("nan"))
        Q._fp8_mqa_logits_kernel[(triton.cdiv(M, 2), triton.cdiv(N, 128))](
            q8, q8.stride(0), q8.stride(1), k8, k8.stride(0), ks, w, w.stride(0), starts, ends, out, out.stride(0),
            M, N, H=H, BQ=2, BN=32, SPAN=128, CLEAN=clean, FNUZ=False, Q_FNUZ=False, K_FNUZ=False)
        ref = ri.fp8_mqa_logits(q8.view(torch.float8_e4m3fn), (k8.view(torch.float8_e4m3fn), ks), w, starts, ends)
        mag = ri.fp8_mqa_logits(abs_bytes(q8), (abs_bytes(k8), ks), w.abs(), starts, ends)
        j = torch.arange(N)
        inside = (j[None, :] >= starts[:, None].long()) & (j[None, :] < ends[:, None].long())
        assert_logits_close(out, ref, mag, f"prefill clean={clean}", tol=2 ** -16, where=None if clean else inside)
    print("ok")
""")


def test_logits_kernels_under_the_interpreter(tmp_path):
    """The logits kernels' indexing (splits, key tiles, next_n rows, 1-D / 2-D lengths, -1 pages, varlen
    ranges, the -inf fill) against the oracle: the interpreter runs the products in fp32 on exactly decoded
    normal e4m3 values, so only the order of the sums differs (bound 2^-16 mag)."""
    r = interpret(_INTERPRETED_LOGITS, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    print(r.stdout)
    assert r.stdout.strip().endswith("ok")


# ---- GPU: the Triton kernels against the oracle ------------------------------------------------------------
def _poison_allocator(nbytes):
    """Fill a block of torch's caching allocator with 0xFF bytes (fp32 NaN) and free it: the next outputs
    of that size come from it, so entries a kernel does not write show up."""
    torch.full((nbytes,), 0xFF, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()


def _both(op, *args, **kw):
    """(Triton result on the GPU, oracle result on the CPU copies of the same inputs)."""
    with ops.use_backend("triton"):
        got = getattr(ops, op)(*args, **kw)
    def cpu(x):
        return x.cpu() if isinstance(x, torch.Tensor) else tuple(map(cpu, x)) if isinstance(x, tuple) else x
    with ops.use_backend("reference"):
        ref = getattr(ops, op)(*cpu(args), **kw)
    return got, ref


@pytest.mark.gpu
@pytest.mark.parametrize("H, q_dtype, cs_dtype", [(64, torch.bfloat16, torch.float32),
                                                  (64, torch.float32, torch.bfloat16),
                                                  (4, torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("fp4, fnuz", [(False, False), (True, False), (False, True)])
def test_triton_query_is_bit_exact(H, q_dtype, cs_dtype, fp4, fnuz):
    g = torch.Generator().manual_seed(20)
    pos, qi, w = query(300, H, g, dtype=q_dtype)
    qi[5, 0, 3] = float("nan")
    qi[7, H - 1, 90] = float("inf")
    w[9, 1 % H] = float("nan")
    _poison_allocator(300 * H * 128 * 4)
    got, ref = _both("fused_indexer_q_rope_quant", pos.cuda(), qi.cuda(), CS.to(cs_dtype).cuda(), w.cuda(), SM, HS,
                     use_fp4=fp4, use_fnuz=fnuz)
    (gq, gw), (rq, rw) = got, ref
    if fp4:
        assert torch.equal(gq[0].cpu(), rq[0]) and torch.equal(gq[1].cpu(), rq[1])
    else:
        assert gq.dtype == rq.dtype == (torch.float8_e4m3fnuz if fnuz else torch.float8_e4m3fn)
        assert torch.equal(gq.view(torch.uint8).cpu(), rq.view(torch.uint8))
    gw = gw.cpu()
    nan = torch.isnan(rw)                                 # NaN payloads differ by vendor: compare NaN positions
    assert torch.equal(torch.isnan(gw), nan) and torch.equal(gw[~nan].view(torch.int32), rw[~nan].view(torch.int32))


@pytest.mark.gpu
def test_triton_query_poisons_positions_outside_the_table():
    g = torch.Generator().manual_seed(21)
    pos, qi, w = query(4, 64, g)
    pos[2] = CS.shape[0]                                  # reaches the kernel when value checks are off
    with ops.use_backend("triton"):
        q8, wq = ops.fused_indexer_q_rope_quant(pos.cuda(), qi.cuda(), CS.cuda(), w.cuda(), SM, HS)
    assert (q8.view(torch.uint8)[2] == 0x7F).all() and torch.isnan(wq[2]).all() and torch.isfinite(wq[:2]).all()


def _mqa_case(M, N, H, g):
    q8 = torch.randint(0, 256, (M, H, 128), generator=g, dtype=torch.uint8)
    q8[(q8 & 0x7F) == 0x7F] = 0x11                        # no NaN bytes
    k = (torch.randn(N, 128, generator=g) * torch.exp2(torch.randint(-5, 5, (N, 1), generator=g))).bfloat16()
    k8, e = quantize_blocks(k.float(), 128, 1e-4)
    ks = ri.pow2_or_nan(e[:, 0])
    w = torch.randn(M, H, generator=g)
    return q8.view(torch.float8_e4m3fn), k8.view(torch.float8_e4m3fn), ks, w


@pytest.mark.gpu
@pytest.mark.parametrize("H", [64, 32, 4])
@pytest.mark.parametrize("clean", [True, False])
def test_triton_mqa_logits_match_the_oracle(H, clean):
    g = torch.Generator().manual_seed(22)
    M, N = 300, 5000
    q8, k8, ks, w = _mqa_case(M, N, H, g)
    # varlen prefill: three requests with their own key ranges, causal ends, a padding row and an empty row
    starts = torch.tensor([0] * 100 + [1200] * 150 + [4000] * 48 + [0, 7], dtype=torch.int32)
    ends = torch.cat([torch.arange(1, 101) * 12, 1200 + torch.arange(1, 151) * 20, 4000 + torch.arange(953, 1001),
                      torch.tensor([0, 7])]).to(torch.int32)
    _poison_allocator(M * N * 4)
    d = lambda t: t.cuda()                                              # noqa: E731
    got, ref = _both("fp8_mqa_logits", d(q8), (d(k8), d(ks)), d(w), d(starts), d(ends), clean_logits=clean)
    mag = ri.fp8_mqa_logits(abs_bytes(q8), (abs_bytes(k8), ks.abs()), w.abs(), starts, ends)
    j = torch.arange(N)
    inside = (j[None, :] >= starts[:, None].long()) & (j[None, :] < ends[:, None].long())
    assert_logits_close(got, ref, mag, f"mqa H={H} clean={clean}", where=None if clean else inside)


@pytest.mark.gpu
@pytest.mark.parametrize("next_n, lens_2d, bs", [(1, False, 64), (2, False, 64), (2, True, 32), (4, True, 64),
                                                 (3, False, 16)])
@pytest.mark.parametrize("clean", [True, False])
def test_triton_paged_logits_match_the_oracle(next_n, lens_2d, bs, clean):
    g = torch.Generator().manual_seed(23 + next_n)
    lens = [2000, 1, 0, 777, 64, 1500, 3, 4096]
    B, H = len(lens), 64
    pages, kv, bt, _ = filled_cache(lens, bs, g)
    bt[3, 2] = -1                                          # a page missing inside request 3's context
    bt[5, -1] = -1                                         # padding past request 5's pages
    q8 = torch.randint(0, 0x7E, (B, next_n, H, 128), generator=g, dtype=torch.uint8)
    q8 |= (torch.rand(q8.shape, generator=g) < 0.5).to(torch.uint8) << 7
    q8[q8 == 0x80] = 0
    w = torch.randn(B * next_n, H, generator=g)
    if lens_2d:
        cl = torch.stack([(torch.tensor(lens) - 3 * i).clamp(min=0) for i in range(next_n)], 1).to(torch.int32)
    else:
        cl = torch.tensor(lens, dtype=torch.int32)
    max_len = 4500
    d = lambda t: t.cuda()                                              # noqa: E731
    meta = ops.get_paged_mqa_logits_metadata(d(cl), bs, 132)
    _poison_allocator(B * next_n * max_len * 4)
    got, ref = _both("fp8_paged_mqa_logits", d(q8.view(torch.float8_e4m3fn)), kv_cache_view(d(pages), bs, 132),
                     d(w), d(cl), d(bt), meta, max_len, clean_logits=clean)
    mag = paged_magnitude(q8.view(torch.float8_e4m3fn), pages, bs, w, cl, bt, max_len)
    vis = ri.visible_keys(cl, next_n).reshape(-1).clamp(0, max_len)
    tiles_end = torch.arange(max_len)[None, :] < vis[:, None]
    assert_logits_close(got, ref, mag, f"paged next_n={next_n} 2d={lens_2d} bs={bs} clean={clean}",
                        where=None if clean else tiles_end)


@pytest.mark.gpu
def test_triton_logits_read_the_fnuz_query():
    """vLLM's gfx942 query (float8_e4m3fnuz) and gathered fnuz keys through the Triton logits kernels: the
    logits of the OCP query and keys of the same inputs from the same kernels, bit for bit, and the oracle's
    within LOGIT_TOL."""
    g = torch.Generator().manual_seed(27)
    pos, qi, w = query(64, 64, g)
    keys = torch.randn(3000, 128, generator=g) * torch.exp2(torch.randint(-6, 6, (3000, 1), generator=g).float())
    starts = torch.randint(0, 1500, (64,), generator=g).to(torch.int32)
    ends = (starts + torch.randint(0, 1500, (64,), generator=g)).to(torch.int32)
    lens = [2000, 77, 1500, 64] * 8
    pages, kv, bt, _ = filled_cache(lens, 64, g)           # on the CPU, before the GPU ops are forced to Triton
    with ops.use_backend("triton"):
        d = lambda t: t.cuda()                                              # noqa: E731
        q8, wq = ops.fused_indexer_q_rope_quant(d(pos), d(qi), d(CS), d(w), SM, HS)
        z8, wz = ops.fused_indexer_q_rope_quant(d(pos), d(qi), d(CS), d(w), SM, HS, use_fnuz=True)
        kq, e = quantize_blocks(keys, 128, 1e-4)
        kz, ez = quantize_blocks(keys, 128, 1e-4, fnuz=True)
        ocp_kv = (d(kq).view(torch.float8_e4m3fn), d(ri.pow2_or_nan(e[:, 0])))
        fnuz_kv = (d(kz).view(torch.float8_e4m3fnuz), d(ri.pow2_or_nan(ez[:, 0])))
        ocp = ops.fp8_mqa_logits(q8, ocp_kv, wq, d(starts), d(ends))
        for kv in (ocp_kv, fnuz_kv):
            _poison_allocator(64 * 3000 * 4)
            got = ops.fp8_mqa_logits(z8, kv, wz, d(starts), d(ends))
            assert torch.equal(got.view(torch.int32), ocp.view(torch.int32))
        ref = ri.fp8_mqa_logits(z8.cpu(), tuple(t.cpu() for t in fnuz_kv), wz.cpu(), starts, ends)
        mag = ri.fp8_mqa_logits(abs_bytes(z8.cpu()).view(torch.float8_e4m3fnuz),
                                (abs_bytes(kz).view(torch.float8_e4m3fnuz), fnuz_kv[1].cpu()), wz.cpu().abs(),
                                starts, ends)
        assert_logits_close(got, ref, mag, "fnuz q and k")
        cl = torch.tensor(lens, dtype=torch.int32)
        meta = ops.get_paged_mqa_logits_metadata(d(cl), 64, 132)
        gkv = kv_cache_view(d(pages), 64, 132)
        ocp = ops.fp8_paged_mqa_logits(q8.view(32, 2, 64, 128), gkv, wq, d(cl), d(bt), meta, 2100)
        _poison_allocator(64 * 2100 * 4)
        got = ops.fp8_paged_mqa_logits(z8.view(32, 2, 64, 128), gkv, wz, d(cl), d(bt), meta, 2100)
        assert torch.equal(got.view(torch.int32), ocp.view(torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("disable_cp", [False, True])
def test_triton_deepgemm_mqa_logits_semantics(disable_cp):
    with ops.use_backend("triton"):
        _check_deepgemm_mqa(*_deepgemm_mqa_case(512, 2048, disable_cp, "cuda", torch.Generator().manual_seed(24)))


@pytest.mark.gpu
@pytest.mark.parametrize("batch, next_n, lens_2d", [(64, 1, False), (64, 2, False), (32, 2, True), (16, 4, True)])
def test_triton_deepgemm_paged_mqa_logits_semantics(batch, next_n, lens_2d):
    g = torch.Generator().manual_seed(25 + next_n)
    with ops.use_backend("triton"):
        _check_deepgemm_paged(*_deepgemm_paged_case(batch, next_n, 2048, 64, lens_2d, "cuda", g, 3000))


@pytest.mark.gpu
def test_triton_decode_step_replays_from_a_cuda_graph():
    """The decode-path ops of a C4 layer (q quant, indexer-K insert, schedule metadata, paged logits) captured
    once and replayed with new inputs copied into their buffers, against the oracle each time."""
    g = torch.Generator().manual_seed(26)
    B, H, bs, max_len = 8, 64, 64, 1024
    lens = [int(x) for x in torch.randint(100, 900, (B,), generator=g)]
    pages, kv, bt, _ = filled_cache([max_len] * B, bs, g)
    gp, gbt = pages.cuda(), bt.cuda()
    gkv = kv_cache_view(gp, bs, 132)
    pos, qi, w = query(B, H, g)
    keys = torch.randn(B, 128, generator=g).bfloat16()
    bufs = dict(pos=pos.cuda(), qi=qi.cuda(), w=w.cuda(), keys=keys.cuda(),
                slots=torch.full((B,), -1, device="cuda"),         # the warm-up call writes nothing
                cl=torch.zeros(B, dtype=torch.int32, device="cuda"))
    cs = CS.cuda()

    def step():
        q8, wq = ops.fused_indexer_q_rope_quant(bufs["pos"], bufs["qi"], cs, bufs["w"], SM, HS)
        ops.indexer_k_quant_and_cache(bufs["keys"], gkv, bufs["slots"], 128, "ue8m0")
        meta = ops.get_paged_mqa_logits_metadata(bufs["cl"], bs, 132)
        return ops.fp8_paged_mqa_logits(q8.unsqueeze(1), gkv, wq, bufs["cl"], gbt, meta, max_len, clean_logits=False)

    with ops.use_backend("triton"):
        step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        for k in range(2):
            n = torch.tensor(lens) + k
            slots = bt[torch.arange(B), (n - 1) // bs].long() * bs + (n - 1) % bs
            new = dict(pos=torch.randint(0, 4096, (B,), generator=g), qi=torch.randn(B, H, 128, generator=g).bfloat16(),
                       w=torch.randn(B, H, generator=g).bfloat16(), keys=torch.randn(B, 128, generator=g).bfloat16(),
                       slots=slots, cl=n.to(torch.int32))
            for name, t in new.items():
                bufs[name].copy_(t)
            graph.replay()
            torch.cuda.synchronize()
            with ops.use_backend("reference"):
                q8, wq = ops.fused_indexer_q_rope_quant(new["pos"], new["qi"], CS, new["w"], SM, HS)
                ops.indexer_k_quant_and_cache(new["keys"], kv, slots, 128, "ue8m0")
                ref = ops.fp8_paged_mqa_logits(q8.unsqueeze(1), kv, wq, new["cl"], bt,
                                               torch.zeros(2, 2, dtype=torch.int32), max_len)
            assert torch.equal(gp.cpu(), pages), "indexer-K cache bytes differ"
            mag = paged_magnitude(q8.unsqueeze(1), pages, bs, wq, new["cl"], bt, max_len)
            seen = torch.arange(max_len)[None, :] < n[:, None]
            assert_logits_close(out, ref, mag, f"graph replay {k}", where=seen)
