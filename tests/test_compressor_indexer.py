"""Compressor (DSV4_SPEC §5) and lightning indexer (§6) against direct formulas; state across steps."""
import pytest
import torch

from dsv4_rocm import ops
from dsv4_rocm.reference import cache as rc
from dsv4_rocm.reference import compressor as C
from dsv4_rocm.reference import indexer as I
from dsv4_rocm.reference.norm import rmsnorm
from dsv4_rocm.reference.quant import e4m3_decode, quantize_blocks
from dsv4_rocm.reference.rope import build_cos_sin_cache, rope_fwd


def _inputs(ratio, D, n, seed):
    g = torch.Generator().manual_seed(seed)
    c = C.coff(ratio)
    x = torch.randn(n, 64, generator=g).bfloat16()
    w = (torch.randn(2 * c * D, 64, generator=g) * 0.3).bfloat16()
    ape = torch.randn(ratio, c * D, generator=g)
    norm_w = (1 + 0.1 * torch.randn(D, generator=g)).bfloat16()
    return x, w, ape, norm_w


def direct_entry(x, w, ape, norm_w, j, ratio, D, cs, target):
    """Entry j from the spec's formula, written out with no reference helper but the primitives."""
    c = C.coff(ratio)
    ks = x.float() @ w.float().t()
    kv, sc = ks[:, :c * D], ks[:, c * D:] + ape[torch.arange(x.shape[0]) % ratio]
    rows_kv, rows_sc = [], []
    us = range(4 * j - 4, 4 * j + 4) if ratio == 4 else range(128 * j, 128 * j + 128)
    for u in us:
        if u < 0:
            continue
        h = 1 if (ratio == 4 and u >= 4 * j) else 0
        rows_kv.append(kv[u, h * D:(h + 1) * D])
        rows_sc.append(sc[u, h * D:(h + 1) * D])
    wgt = torch.softmax(torch.stack(rows_sc), 0)
    y = (wgt * torch.stack(rows_kv)).sum(0)
    yh = rmsnorm(y, norm_w, 1e-6)
    roped = rope_fwd(yh.unsqueeze(0), torch.tensor([j * ratio]), cs)[0]
    if target == "main":
        return rc.encode_k_records(torch.cat([yh[:448], roped[448:]]).bfloat16().unsqueeze(0))[0]
    q, e = quantize_blocks(roped.bfloat16().float().unsqueeze(0), 128, 1e-4)
    return q[0], 2.0 ** int(e)


def _run(x, w, ape, norm_w, ratio, D, cs, target, chunks, bs):
    n = x.shape[0]
    out = rc.new_cache(4, bs, indexer=target == "indexer")
    state = C.new_state(1, ratio, D)
    bt = torch.tensor([[2, 0, 3, 1]], dtype=torch.int32)
    a = 0
    for e in chunks + [n]:
        if e <= a:
            continue
        pos = torch.arange(a, e)
        kv, sc = ops.compressor_kv_score(x[a:e], w, ape, pos, ratio)
        slots = ops.get_compressed_slot_mapping(pos, torch.zeros_like(pos), bt, ratio, bs)
        ops.fused_compress_norm_rope_insert(kv, sc, pos, torch.tensor([0, e - a]), state, torch.tensor([0]), norm_w,
                                            cs, slots, out, bs, ratio, target)
        a = e
    return out, bt


@pytest.mark.parametrize("ratio, n, chunks, target", [
    (4, 37, [5, 6, 21], "main"), (4, 16, [1, 2, 3, 4, 9], "main"), (128, 300, [100, 129], "main"),
    (4, 37, [5, 6, 21], "indexer"), (4, 16, [1, 2, 3, 4, 9], "indexer"),   # the indexer exists on C4 only
])
def test_compressor_matches_formula_and_is_chunk_invariant(ratio, n, chunks, target):
    D = 512 if target == "main" else 128
    x, w, ape, norm_w = _inputs(ratio, D, n, 3)
    cs = build_cos_sin_cache(160000.0, 1024)
    bs = 64 if ratio == 4 else 2
    one, bt = _run(x, w, ape, norm_w, ratio, D, cs, target, [], bs)
    chunked, _ = _run(x, w, ape, norm_w, ratio, D, cs, target, chunks, bs)
    assert torch.equal(one, chunked)
    for j in range(n // ratio):
        slot = torch.tensor([int(bt[0, j // bs]) * bs + j % bs])
        if target == "main":
            assert torch.equal(rc.gather_k_records(one, slot, bs)[0],
                               direct_entry(x, w, ape, norm_w, j, ratio, D, cs, target))
        else:
            q, s = rc.indexer_k_gather(one, slot, bs)
            eq, es = direct_entry(x, w, ape, norm_w, j, ratio, D, cs, target)
            assert torch.equal(q[0], eq) and float(s[0]) == es


def test_indexer_q_quant_fold_and_logits():
    g = torch.Generator().manual_seed(4)
    T, H = 5, 4
    cs = build_cos_sin_cache(160000.0, 512)
    qi = torch.randn(T, H, 128, generator=g).bfloat16()
    wts = torch.randn(T, H, generator=g).bfloat16()
    pos = torch.tensor([3, 10, 50, 100, 400])
    q8, wq = ops.fused_indexer_q_rope_quant(qi, pos, cs, wts)
    # per (token, head): one power-of-two scale; w' carries it with 128^-0.5 * H^-0.5
    x = torch.cat([qi[..., :64].float(), rope_fwd(qi, pos, cs)[..., 64:].bfloat16().float()], -1)
    s = torch.exp2(torch.ceil(torch.log2(x.abs().amax(-1).clamp(min=1e-4) / 448)))
    torch.testing.assert_close(wq, wts.float() * s * 128 ** -0.5 * H ** -0.5, rtol=1e-6, atol=0)
    torch.testing.assert_close(e4m3_decode(q8) * s.unsqueeze(-1), x, rtol=2 ** -4, atol=0)
    N = 30
    k8 = torch.randint(0, 0x7E, (N, 128), generator=g, dtype=torch.uint8)
    ks = torch.exp2(torch.randint(-8, 0, (N,), generator=g).float())
    starts, ends = torch.tensor([0, 2, 5, 0, 29]), torch.tensor([3, 2, 30, 1, 30])
    lg = ops.fp8_mqa_logits(q8, k8, ks, wq, starts, ends)
    for t in range(T):
        for j in range(N):
            if starts[t] <= j < ends[t]:
                ref = sum(float(wq[t, h]) * max(0.0, float((e4m3_decode(q8[t, h]) * e4m3_decode(k8[j])).sum())
                                                * float(ks[j])) for h in range(H))
                assert abs(float(lg[t, j]) - ref) <= 1e-4 * max(1.0, abs(ref))
            else:
                assert lg[t, j] == float("-inf")


def test_paged_logits_equal_contiguous_logits():
    g = torch.Generator().manual_seed(5)
    B, H, N = 3, 4, 150
    cache = rc.new_cache(9, 64, indexer=True)
    bt = torch.tensor([[5, 1, 3], [0, 8, 6], [4, 7, 2]], dtype=torch.int32)   # disjoint pages per request
    k8 = torch.randint(0, 0x7E, (B, N, 128), generator=g, dtype=torch.uint8)
    ks = torch.exp2(torch.randint(-8, 0, (B, N), generator=g).float())
    for b in range(B):
        j = torch.arange(N)
        rc.indexer_k_insert(k8[b], ks[b], cache, bt[b, j // 64].long() * 64 + j % 64, 64)
    q8 = torch.randint(0, 0x7E, (B, 1, H, 128), generator=g, dtype=torch.uint8)
    w = torch.randn(B, H, generator=g)
    cl = torch.tensor([150, 3, 64], dtype=torch.int32)
    lg = ops.fp8_paged_mqa_logits(q8, cache, w, cl, bt, 64, 150)
    for b in range(B):
        ref = I.fp8_mqa_logits(q8[b], k8[b], ks[b], w[b:b + 1], torch.tensor([0]), cl[b:b + 1])
        torch.testing.assert_close(lg[b:b + 1], ref, rtol=1e-6, atol=1e-6)   # fp32 sum order only
