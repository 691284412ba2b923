"""Lightning indexer (§6) against direct formulas (the compressor is tested in test_compressor.py)."""
import pytest
import torch

from dsv4_rocm import ops
from dsv4_rocm.reference import cache as rc
from dsv4_rocm.reference import indexer as I
from dsv4_rocm.reference.quant import e4m3_decode
from dsv4_rocm.reference.rope import build_cos_sin_cache, rope_fwd


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


def test_top_k_per_row():
    g = torch.Generator().manual_seed(6)
    lg = torch.randn(4, 50, generator=g)
    starts, ends = torch.tensor([0, 10, 0, 45]), torch.tensor([50, 13, 0, 50])
    out = ops.top_k_per_row(lg, starts, ends, 8)
    assert set(out[0].tolist()) == set(torch.topk(lg[0], 8).indices.tolist())
    assert out[1].tolist() == [0, 1, 2] + [-1] * 5          # n <= k: trivial path, relative indices
    assert (out[2] == -1).all()
    assert out[3].tolist() == [0, 1, 2, 3, 4, -1, -1, -1]
    with pytest.raises(ValueError, match="row_starts"):
        ops.top_k_per_row(lg, starts, torch.tensor([50, 13, 0, 51]), 8)
