"""HIP kernels (hip_kernels/*.hip through dsv4_rocm._C) against the reference on the GPU.

Cache bytes and gathered rows must match exactly. q outputs and RMSNorm outputs are bf16 after a
sum of squares whose order differs from torch's: within one bf16 ulp (relative 2^-7) of the reference.
Caches are poisoned (0xAB) before every run, so unwritten or wrongly placed bytes show up.
"""
import pytest
import torch

from dsv4_rocm import layout as L
from dsv4_rocm import ops
from dsv4_rocm.reference import cache as rc
from dsv4_rocm.reference import norm as rn
from dsv4_rocm.reference import qkv as rq
from dsv4_rocm.reference.rope import build_cos_sin_cache

pytestmark = pytest.mark.gpu


def _k(n, seed, device):
    g = torch.Generator().manual_seed(seed)
    blk = torch.exp2(torch.randint(-20, 12, (n, 8), generator=g).float()).repeat_interleave(64, 1)
    k = torch.randn(n, 512, generator=g) * blk
    k[::7, :64] = 0.0                        # all-zero blocks
    k[1::11, 64:128] = -0.0                  # negative zeros
    k[2::13, 128:192] *= 1e-6                # blocks below eps
    return k.bfloat16().to(device)


def _slots(n, bs, nb, seed, device):
    g = torch.Generator().manual_seed(seed)
    s = torch.randperm(nb * bs, generator=g)[:n]
    s[torch.rand(n, generator=g) < 0.1] = -1
    return s.to(device)


def _hip(name):
    assert ops.backend_for(name, "cuda") == "hip"
    return ops.implementation(name, "cuda")


def _bf16_close(a, b):
    a, b = a.float(), b.float()
    bad = (a - b).abs() > b.abs() * 2 ** -7 + 1e-30
    assert int(bad.sum()) == 0, f"{int(bad.sum())} elements beyond one bf16 ulp, max {float((a - b).abs().max())}"


@pytest.mark.parametrize("bs, n", [(64, 1), (64, 4097), (2, 300), (3, 100), (256, 20000)])
def test_quantize_and_insert_bytes_exact(bs, n, gpu):
    nb = (n + bs - 1) // bs + 3
    k = _k(n, bs + n, gpu)
    slots = _slots(n, bs, nb, n, gpu)
    cache = torch.full((nb, L.page_bytes(bs)), 0xAB, dtype=torch.uint8, device=gpu)
    ref = cache.clone()
    _hip("quantize_and_insert_k_cache")(k, cache, slots, bs)
    rc.quantize_and_insert_k_cache(k, ref, slots, bs)
    assert torch.equal(cache, ref)


def test_non_finite_blocks_poisoned_like_reference(gpu):
    k = _k(64, 3, gpu).float()
    k[0, 5], k[1, 100], k[2, 448] = float("nan"), float("inf"), float("-inf")
    k = k.bfloat16()
    cache = torch.full((1, L.page_bytes(64)), 0xAB, dtype=torch.uint8, device=gpu)
    ref = cache.clone()
    slots = torch.arange(64, device=gpu)
    _hip("quantize_and_insert_k_cache")(k, cache, slots, 64)
    rc.quantize_and_insert_k_cache(k, ref, slots, 64)
    assert torch.equal(cache, ref)


@pytest.mark.parametrize("T, H, Hp, n_slots", [(1, 8, 64, 1), (333, 64, 64, 300), (50, 128, 128, 50),
                                                (17, 16, 64, 0)])
def test_fused_qnorm_rope_kv_insert(T, H, Hp, n_slots, gpu):
    g = torch.Generator().manual_seed(T * H)
    q = (torch.randn(T, H, 512, generator=g) * 3).bfloat16().to(gpu)
    kv = _k(T, T + 1, gpu)
    cs = build_cos_sin_cache(10000.0, 70000, device=gpu)
    pos = torch.randint(0, 70000, (T,), generator=g).to(gpu)
    slots = _slots(n_slots, 64, (T + 63) // 64 + 2, T, gpu)
    cache = torch.full(((T + 63) // 64 + 2, L.page_bytes(64)), 0xAB, dtype=torch.uint8, device=gpu)
    ref_cache = cache.clone()
    out = _hip("fused_qnorm_rope_kv_rope_quant_insert")(q, kv, cache, slots, pos, cs, Hp, 1e-6, 64)
    ref = rq.fused_qnorm_rope_kv_rope_quant_insert(q, kv, ref_cache, slots, pos, cs, Hp, 1e-6, 64)
    assert torch.equal(cache, ref_cache)
    assert torch.equal(out[:, H:], torch.zeros_like(out[:, H:]))
    _bf16_close(out[:, :H], ref[:, :H])


@pytest.mark.parametrize("T, Dq", [(1, 1024), (1000, 1536), (4099, 1024)])
def test_fused_q_kv_rmsnorm(T, Dq, gpu):
    g = torch.Generator().manual_seed(T)
    qr = (torch.randn(T, Dq + 512, generator=g) * 4).bfloat16().to(gpu)     # views into one buffer, as vLLM
    qw = (1 + 0.1 * torch.randn(Dq, generator=g)).bfloat16().to(gpu)
    kw = (1 + 0.1 * torch.randn(512, generator=g)).bfloat16().to(gpu)
    a, b = _hip("fused_q_kv_rmsnorm")(qr[:, :Dq], qr[:, Dq:], qw, kw, 1e-6)
    ra, rb = rn.fused_q_kv_rmsnorm(qr[:, :Dq], qr[:, Dq:], qw, kw, 1e-6)
    _bf16_close(a, ra)
    _bf16_close(b, rb)


@pytest.mark.parametrize("bs", [2, 64, 256])
def test_dequantize_and_gather_exact(bs, gpu):
    nb = 40
    k = _k(nb * bs, bs, gpu)
    cache = torch.full((nb, L.page_bytes(bs)), 0xAB, dtype=torch.uint8, device=gpu)
    rc.quantize_and_insert_k_cache(k, cache, torch.arange(nb * bs, device=gpu), bs)
    slots = _slots(5000, bs, nb, 9, gpu) if nb * bs >= 5000 else torch.randint(-1, nb * bs, (5000,), device=gpu)
    out = _hip("dequantize_and_gather_k_cache")(cache, slots, bs)
    assert torch.equal(out, rc.dequantize_and_gather_k_cache(cache, slots, bs))


def test_ops_route_to_hip_and_still_validate(gpu):
    k = _k(4, 1, gpu)
    cache = torch.zeros(1, L.page_bytes(64), dtype=torch.uint8, device=gpu)
    with pytest.raises(ValueError, match="outside the cache"):
        ops.quantize_and_insert_k_cache(k, cache, torch.tensor([64], device=gpu), 64)
    ops.quantize_and_insert_k_cache(k, cache, torch.tensor([0, 1, -1, 3], device=gpu), 64)
    ref = torch.zeros_like(cache)
    rc.quantize_and_insert_k_cache(k, ref, torch.tensor([0, 1, -1, 3], device=gpu), 64)
    assert torch.equal(cache, ref)


def test_registered_ops_pass_opcheck(gpu):
    """Schema, fake (meta) shapes and real kernels agree (torch.library.opcheck)."""
    from dsv4_rocm._build import load
    lib = load()
    g = torch.Generator().manual_seed(5)
    k = _k(8, 5, gpu)
    cache = torch.zeros(2, L.page_bytes(64), dtype=torch.uint8, device=gpu)
    slots = torch.tensor([3, -1, 70, 0, 5, 6, 7, 8], device=gpu)
    torch.library.opcheck(lib.quantize_and_insert_k_cache.default, (k, cache, slots, 64))
    torch.library.opcheck(lib.dequantize_and_gather_k_cache.default, (cache, slots, 64))
    qr = torch.randn(8, 1024, generator=g).bfloat16().to(gpu)
    w = torch.ones(1024, device=gpu).bfloat16()
    torch.library.opcheck(lib.fused_q_kv_rmsnorm.default, (qr, k, w, w[:512], 1e-6))
    q = torch.randn(8, 8, 512, generator=g).bfloat16().to(gpu)
    cs = build_cos_sin_cache(10000.0, 128, device=gpu)
    pos = torch.arange(8, device=gpu)
    torch.library.opcheck(lib.fused_qnorm_rope_kv_rope_quant_insert.default,
                          (q, k, cache, slots, pos, cs, 64, 1e-6, 64))
