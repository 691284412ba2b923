"""fused_q_kv_rmsnorm(qr, kv, q_weight, kv_weight, eps) -> (qr, kv), vLLM's form: new tensors, fp32 inside,
one rounding at the store, qr and kv given as column slices of the fused q/kv projection output.

Outputs are bf16 after a sum of squares whose order is the implementation's: within one bf16 step
(2^-7 relative) of a float64 oracle on the CPU, and of the reference on the GPU.
"""
import pytest
import torch

from dsv4_rocm import ops
from dsv4_rocm.reference import norm as rn


def oracle(x, w, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def within_one_bf16_step(a, b):
    a, b = a.double(), b.double()
    bad = (a - b).abs() > b.abs() * 2 ** -7 + 1e-30
    print(f"max |diff| {float((a - b).abs().max()) if a.numel() else 0:.3g}, beyond one bf16 step: {int(bad.sum())}")
    assert int(bad.sum()) == 0


@pytest.mark.parametrize("T, Dq", [(1, 1024), (33, 1536), (0, 1024)])
def test_norms_of_column_slices(T, Dq):
    qr_kv = (torch.randn(T, Dq + 512) * 4).bfloat16()
    qw, kw = (1 + 0.1 * torch.randn(Dq)).bfloat16(), (1 + 0.1 * torch.randn(512)).bfloat16()
    before = qr_kv.clone()
    a, b = ops.fused_q_kv_rmsnorm(qr_kv[:, :Dq], qr_kv[:, Dq:], qw, kw, 1e-6)
    assert a.shape == (T, Dq) and b.shape == (T, 512) and a.dtype == b.dtype == torch.bfloat16
    assert torch.equal(qr_kv, before)                                # inputs are not written
    within_one_bf16_step(a, oracle(qr_kv[:, :Dq], qw, 1e-6))
    within_one_bf16_step(b, oracle(qr_kv[:, Dq:], kw, 1e-6))
    c, d = torch.ops.dsv4_rocm.fused_q_kv_rmsnorm(qr_kv[:, :Dq], qr_kv[:, Dq:], qw, kw, 1e-6)
    assert torch.equal(a, c) and torch.equal(b, d)


def test_bad_input():
    qr, kv, w = torch.zeros(2, 1024).bfloat16(), torch.zeros(2, 512).bfloat16(), torch.ones(1024).bfloat16()
    for call, match in [(lambda: ops.fused_q_kv_rmsnorm(qr[:, :12], kv, w[:12], w[:512], 1e-6), "qr and kv rows"),
                        (lambda: ops.fused_q_kv_rmsnorm(qr, kv[:1], w, w[:512], 1e-6), "kv must have shape"),
                        (lambda: ops.fused_q_kv_rmsnorm(qr.float(), kv, w, w[:512], 1e-6), "qr must have dtype"),
                        (lambda: ops.fused_q_kv_rmsnorm(qr, kv, w[:512], w[:512], 1e-6), "q_weight"),
                        (lambda: ops.fused_q_kv_rmsnorm(qr, kv, w, w[:512], -1.0), "eps")]:
        with pytest.raises(ValueError, match=match):
            call()


@pytest.mark.gpu
@pytest.mark.parametrize("T, Dq", [(1, 1024), (1000, 1536), (4099, 1024)])
def test_gpu_kernel_against_the_reference(T, Dq, gpu):
    g = torch.Generator().manual_seed(T)
    qr = (torch.randn(T, Dq + 512, generator=g) * 4).bfloat16().to(gpu)     # views into one buffer, as vLLM
    qw = (1 + 0.1 * torch.randn(Dq, generator=g)).bfloat16().to(gpu)
    kw = (1 + 0.1 * torch.randn(512, generator=g)).bfloat16().to(gpu)
    assert ops.backend_for("fused_q_kv_rmsnorm", "cuda") == "hip"
    a, b = ops.implementation("fused_q_kv_rmsnorm", "cuda")(qr[:, :Dq], qr[:, Dq:], qw, kw, 1e-6)
    ra, rb = rn.fused_q_kv_rmsnorm(qr[:, :Dq], qr[:, Dq:], qw, kw, 1e-6)
    within_one_bf16_step(a, ra)
    within_one_bf16_step(b, rb)
