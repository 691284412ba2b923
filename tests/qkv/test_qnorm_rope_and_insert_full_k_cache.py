"""qnorm_rope_and_insert_full_k_cache: vLLM's full-cache form for FlashInfer's sparse MLA,
``(q, kv, k_cache, slot_mapping, positions, cos_sin_cache, eps, cache_block_size, fp8_scale, q_fp8=None,
q_fp8_scale_inv=None, apply_q_norm=True) -> None``
(torch.ops._C.fused_deepseek_v4_qnorm_rope_kv_rope_full_cache_fp8_insert).

KV rows: RoPE (fp32) times fp32(1 / fp8_scale), e4m3 RNE saturating at 448: checked byte for byte against
torch's own fp8 cast. q_fp8: RMSNorm + RoPE times q_fp8_scale_inv, within one e4m3 step of a float64
oracle (the RMSNorm sum order is free); with apply_q_norm=False (vLLM 0.33's V4.1 call), RoPE times
q_fp8_scale_inv byte for byte, in every call form and through the HIP wrapper's route (its kernel stood in
for). Non-finite values are stored as 0x7F. GPU: the HIP kernel writes the reference's cache bytes exactly
and q bytes within one e4m3 step; with apply_q_norm=False every byte exactly.
"""
import pytest
import torch

from dsv4_rocm import ops
from dsv4_rocm.reference import qkv as rq
from dsv4_rocm.reference.rope import build_cos_sin_cache, rope_fwd
from helpers import random_k

CS = build_cos_sin_cache(10000.0, 2048)
OP = ops.qnorm_rope_and_insert_full_k_cache


def torch_fp8(x):
    """fp32 -> e4m3fn bytes by torch's own cast after the +-448 clamp (-0 written as 0x00, our convention)."""
    b = x.float().clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(b == 0x80, torch.zeros_like(b), b)


def setup(T=6, H=4, nb=3, bs=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, 512, generator=g).bfloat16()
    kv = random_k(T, gen=g)
    pos = torch.randint(0, 2048, (T,), generator=g)
    cache = torch.full((nb, bs, 512), 0x11, dtype=torch.uint8).view(torch.float8_e4m3fn)
    q8 = torch.full((T, H, 512), 0x22, dtype=torch.uint8).view(torch.float8_e4m3fn)
    return q, kv, pos, cache, q8


def within_one_e4m3_step(a8, b):
    """e4m3 values a8 against float b: one step of a 3-bit mantissa is 2^-3 relative (2^-9 absolute below
    the normal range)."""
    a = a8.float().double()
    bad = (a - b.double()).abs() > b.double().abs() * 2 ** -3 + 2 ** -9
    print(f"q_fp8 beyond one e4m3 step: {int(bad.sum())} of {bad.numel()}")
    assert int(bad.sum()) == 0


@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.03125, 24.0), (4.0, 0.5)])
def test_kv_rows_and_q_bytes(scales):
    kv_scale, q_inv = scales
    q, kv, pos, cache, q8 = setup()
    slots = torch.tensor([17, -1, 0, 47, 5])                        # 5 slots for 6 rows: DP padding
    before = cache.view(torch.uint8).clone()
    OP(q, kv, cache, slots, pos, CS, 1e-6, 16, torch.tensor([kv_scale]), q8, torch.tensor([q_inv]))
    c = cache.view(torch.uint8)
    inv = torch.tensor(1.0) / torch.tensor(kv_scale)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want = torch_fp8(rope_fwd(kv[t:t + 1], pos[t:t + 1], CS)[0] * inv)
            assert torch.equal(c[s // 16, s % 16], want)
    written = torch.zeros(3, 16, dtype=torch.bool)
    written.view(-1)[slots[slots >= 0]] = True
    assert torch.equal(c[~written], before[~written])
    x = q.double()
    oracle = rope_fwd((x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).float(), pos, CS).double() * q_inv
    within_one_e4m3_step(q8, oracle.clamp(-448, 448))


def test_vllm_torch_op_and_int32_bf16_inputs():
    q, kv, pos, cache, q8 = setup(seed=1)
    slots = torch.tensor([3, 4, 5, -1, 9, 2])
    a, qa = cache.clone(), q8.clone()
    OP(q, kv, a, slots, pos, CS, 1e-6, 16, torch.tensor([0.5]), qa, torch.tensor([2.0]))
    b, qb = cache.clone(), q8.clone()
    assert torch.ops.dsv4_rocm.fused_deepseek_v4_qnorm_rope_kv_rope_full_cache_fp8_insert(
        q, kv, qb, b, slots.int(), pos.int(), CS, torch.tensor([0.5]), torch.tensor([2.0]), 1e-6, 16) is None
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) and torch.equal(qa.view(torch.uint8),
                                                                                  qb.view(torch.uint8))
    c16, c32 = cache.clone(), cache.clone()
    OP(q, kv, c16, slots, pos, CS.bfloat16(), 1e-6, 16, torch.tensor([0.5]), q8.clone(), torch.tensor([2.0]))
    OP(q, kv, c32, slots, pos, CS.bfloat16().float(), 1e-6, 16, torch.tensor([0.5]), q8.clone(), torch.tensor([2.0]))
    assert torch.equal(c16.view(torch.uint8), c32.view(torch.uint8))


def test_non_finite_values_are_nan_bytes_and_large_ones_saturate():
    q, kv, pos, cache, q8 = setup(T=2, H=2)
    kv = kv.float()
    kv[0, 10], kv[0, 20], kv[1, :448] = float("nan"), float("inf"), 1e4
    q = q.float()
    q[1, 1, 7] = float("nan")
    OP(q.bfloat16(), kv.bfloat16(), cache, torch.tensor([0, 1]), pos, CS, 1e-6, 16, torch.tensor([1.0]), q8,
       torch.tensor([1.0]))
    c, b = cache.view(torch.uint8), q8.view(torch.uint8)
    assert int(c[0, 0, 10]) == 0x7F and int(c[0, 0, 20]) == 0x7F and not bool((c[0, 0, :10] == 0x7F).any())
    assert bool((c[0, 1, :448] == 0x7E).all())                        # 1e4 saturates at 448
    assert bool((b[1, 1] == 0x7F).all()) and not bool((b[1, 0] == 0x7F).any())


@pytest.mark.parametrize("q_inv", [1.0, 24.0])
def test_apply_q_norm_false_leaves_q_unnormed(q_inv):
    """vLLM 0.33's DeepSeek-V4.1 call passes apply_q_norm=False: q_fp8 = e4m3(RoPE(q) * q_fp8_scale_inv), byte
    for byte against torch's cast (no norm, so nothing is free); a position outside the table gives zero
    bytes; the kv rows are those of apply_q_norm=True; every call form (the flag positional, keyword, the
    torch op's twelfth argument) writes the same bytes."""
    q, kv, pos, cache, q8 = setup(T=7, H=3, seed=4)
    q = (q.float() * torch.exp2(torch.randint(-4, 5, (7, 3, 1), generator=torch.Generator().manual_seed(4)))).bfloat16()
    slots = torch.tensor([9, -1, 30, 2, 44, 7])
    scale, inv = torch.tensor([0.25]), torch.tensor([q_inv])
    normed_c, normed_q = cache.clone(), q8.clone()
    OP(q, kv, normed_c, slots, pos, CS, 1e-6, 16, scale, normed_q, inv)
    want = torch_fp8(rope_fwd(q.float(), pos, CS) * q_inv)
    runs = [lambda c, b: OP(q, kv, c, slots, pos, CS, 1e-6, 16, scale, b, inv, False),
            lambda c, b: OP(q, kv, c, slots, pos, CS, 1e-6, 16, scale, q_fp8=b, q_fp8_scale_inv=inv,
                            apply_q_norm=False),
            lambda c, b: torch.ops.dsv4_rocm.fused_deepseek_v4_qnorm_rope_kv_rope_full_cache_fp8_insert(
                q, kv, b, c, slots.int(), pos.int(), CS, scale, inv, 1e-6, 16, False),
            lambda c, b: rq.qnorm_rope_and_insert_full_k_cache(q, kv, c, slots, pos, CS, 1e-6, 16, scale, b, inv,
                                                                False)]
    for run in runs:
        c, b = cache.clone(), q8.clone()
        assert run(c, b) is None
        assert torch.equal(b.view(torch.uint8), want)
        assert torch.equal(c.view(torch.uint8), normed_c.view(torch.uint8))
    assert not torch.equal(normed_q.view(torch.uint8), want)             # the flag did switch the norm off


def test_hip_route_hands_apply_q_norm_to_the_kernel(monkeypatch):
    """The HIP wrapper passes apply_q_norm to its kernel (which skips the norm without it): the kernel is stood
    in for by the reference of what it computes, and the route's bytes must be the reference's for both
    values of the flag."""
    from dsv4_rocm import hip_ops

    class Kernel:
        @staticmethod
        def qnorm_rope_and_insert_full_k_cache(q, kv, o, cache, slots, pos, cs, scale, inv, eps, bs, apply_q_norm):
            rq.qnorm_rope_and_insert_full_k_cache(q, kv, cache, slots, pos, cs, eps, bs, scale, o, inv, apply_q_norm)

    monkeypatch.setattr(hip_ops, "load", lambda: Kernel)
    q, kv, pos, cache, q8 = setup(T=5, H=2, seed=8)
    pos[1] = 2048 + 9                           # outside the table: zero q bytes, no row (the kernels' rule)
    slots, scale, inv = torch.tensor([3, 17, -1, 40]), torch.tensor([2.0]), torch.tensor([4.0])
    for norm in (True, False):
        c, b, wc, wb = cache.clone(), q8.clone(), cache.clone(), q8.clone()
        hip_ops.qnorm_rope_and_insert_full_k_cache(q, kv, c, slots, pos, CS, 1e-6, 16, scale, b, inv, norm)
        rq.qnorm_rope_and_insert_full_k_cache(q, kv, wc, slots, pos, CS, 1e-6, 16, scale, wb, inv, norm)
        assert torch.equal(c.view(torch.uint8), wc.view(torch.uint8))
        assert torch.equal(b.view(torch.uint8), wb.view(torch.uint8))


def test_bad_input_is_rejected_before_any_write():
    q, kv, pos, cache, q8 = setup()
    s = torch.arange(6)
    one = torch.tensor([1.0])
    bad = [(lambda: OP(q, kv, cache, s, pos, CS, 1e-6, 16, one, None, one), "q_fp8 and q_fp8_scale_inv"),
           (lambda: OP(q, kv, cache, s, pos, CS, 1e-6, 16, torch.ones(2), q8, one), "fp8_scale must hold one"),
           (lambda: OP(q, kv, cache, s, pos, CS, 1e-6, 16, torch.zeros(1), q8, one), "fp8_scale must be a finite"),
           (lambda: OP(q, kv, cache, s, pos, CS, 1e-6, 16, one, q8, torch.tensor([float("inf")])), "q_fp8_scale_inv"),
           (lambda: OP(q, kv, cache, s, pos, CS, 1e-6, 8, one, q8, one), "k_cache must have shape"),
           (lambda: OP(q, kv, cache.view(torch.uint8).bfloat16(), s, pos, CS, 1e-6, 16, one, q8, one),
            "k_cache must have dtype"),
           (lambda: OP(q, kv, cache, s + 43, pos, CS, 1e-6, 16, one, q8, one), "slot_mapping: slot 48 is outside"),
           (lambda: OP(q, kv, cache, s, pos + 2048, CS, 1e-6, 16, one, q8, one), "positions must lie"),
           (lambda: OP(q, kv, cache, s, pos, CS, 1e-6, 16, one, q8[:, :2], one), "q_fp8 must have shape"),
           (lambda: OP(q, kv, cache, torch.arange(7), pos, CS, 1e-6, 16, one, q8, one), "slot_mapping has 7"),
           (lambda: OP(q, kv, cache, s, pos, CS, 1e-6, 16, one, q8, one, 0), "apply_q_norm must be a bool"),
           (lambda: torch.ops.dsv4_rocm.fused_deepseek_v4_qnorm_rope_kv_rope_full_cache_fp8_insert(
               q, kv, q8, cache, s, pos + 2048, CS, one, one, 1e-6, 16, False), "positions must lie")]
    before, qbefore = cache.view(torch.uint8).clone(), q8.view(torch.uint8).clone()
    for call, match in bad:
        with pytest.raises(ValueError, match=match):
            call()
        assert torch.equal(cache.view(torch.uint8), before) and torch.equal(q8.view(torch.uint8), qbefore)


@pytest.mark.gpu
@pytest.mark.parametrize("T, H, bs", [(1, 64, 64), (300, 16, 64), (2048, 8, 16)])
@pytest.mark.parametrize("table, index_dtype", [(torch.float32, torch.int64), (torch.bfloat16, torch.int32)])
def test_gpu_kernel_against_the_reference(T, H, bs, table, index_dtype, gpu):
    g = torch.Generator().manual_seed(T + H)
    q = (torch.randn(T, H, 512, generator=g) * 2).bfloat16().to(gpu)
    kv = random_k(T, gen=g).to(gpu)
    cs = build_cos_sin_cache(10000.0, 70000, device=gpu).to(table)
    pos = torch.randint(0, 70000, (T,), generator=g).to(index_dtype).to(gpu)
    nb = (T + bs - 1) // bs + 2
    slots = torch.randperm(nb * bs, generator=g)[:T]
    slots[torch.rand(T, generator=g) < 0.1] = -1
    slots = slots.to(index_dtype).to(gpu)
    kv_scale, q_inv = torch.tensor([0.125], device=gpu), torch.tensor([8.0], device=gpu)
    cache = torch.full((nb, bs, 512), 0xAB, dtype=torch.uint8, device=gpu).view(torch.float8_e4m3fn)
    ref = cache.clone()
    q8 = torch.full((T, H, 512), 0xAB, dtype=torch.uint8, device=gpu).view(torch.float8_e4m3fn)
    ref_q8 = q8.clone()
    ops.implementation("qnorm_rope_and_insert_full_k_cache", "cuda")(q, kv, cache, slots, pos, cs, 1e-6, bs,
                                                                     kv_scale, q8, q_inv)
    rq.qnorm_rope_and_insert_full_k_cache(q, kv, ref, slots, pos, cs, 1e-6, bs, kv_scale, ref_q8, q_inv)
    assert torch.equal(cache.view(torch.uint8), ref.view(torch.uint8))
    within_one_e4m3_step(q8, ref_q8.float())
    # apply_q_norm=False (vLLM's V4.1 call): the kernel skips the norm; the same bounds as with it
    ops.implementation("qnorm_rope_and_insert_full_k_cache", "cuda")(q, kv, cache, slots, pos, cs, 1e-6, bs,
                                                                     kv_scale, q8, q_inv, False)
    rq.qnorm_rope_and_insert_full_k_cache(q, kv, ref, slots, pos, cs, 1e-6, bs, kv_scale, ref_q8, q_inv, False)
    assert torch.equal(cache.view(torch.uint8), ref.view(torch.uint8))
    within_one_e4m3_step(q8, ref_q8.float())
