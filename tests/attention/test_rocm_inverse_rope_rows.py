"""rocm_inverse_rope_rows_ (vLLM's in-place inverse GPT-J RoPE of attention output rows).

CPU: the reference against the pair formula written out in float64 (and rope_inv on the last 64 dims),
inverse after forward gives the input back, only the rope dims of the given rows change (strided views of
a larger buffer), bad input rejected before any write; the Triton kernel equal to the reference bit for
bit under the interpreter (fp32 math with fp fusion off, one rounding to bf16). GPU: the kernel equal to
the reference bit for bit.
"""
import pytest
import torch

from dsv4_rocm import ops
from dsv4_rocm.reference import rope as R
from helpers import run_file_interpreted

CS = R.build_cos_sin_cache(10000.0, 4096)


def rows(T, H, D=512, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    o = (torch.randn(T, H, D, generator=g) * 3).bfloat16().to(device)
    pos = torch.randint(0, CS.shape[0], (T,), generator=g).to(device)
    return o, pos


def test_reference_is_the_pair_formula():
    o, pos = rows(5, 3)
    x = o.clone()
    R.rocm_inverse_rope_rows_(x, pos, CS, 64)
    c, s = CS[pos].double()[:, None, :32], CS[pos].double()[:, None, 32:]
    e, od = o[..., 448::2].double(), o[..., 449::2].double()
    want = torch.stack([e * c + od * s, od * c - e * s], -1).reshape(5, 3, 64)
    torch.testing.assert_close(x[..., 448:].double(), want, rtol=2 ** -8, atol=1e-6)
    assert torch.equal(x[..., :448], o[..., :448])
    assert torch.equal(x, R.rope_inv(o, pos, CS).bfloat16())         # the output path's inverse RoPE


def test_inverse_undoes_the_forward_rotation():
    o, pos = rows(4, 2)
    fwd = R.rope_fwd(o, pos, CS).bfloat16()
    R.rocm_inverse_rope_rows_(fwd, pos, CS, 64)
    torch.testing.assert_close(fwd.float(), o.float(), rtol=2 ** -6, atol=2 ** -6)


@pytest.mark.parametrize("cs_dtype", [torch.float32, torch.bfloat16])
def test_only_the_rope_dims_of_the_rows_change(cs_dtype):
    back = torch.randn(6, 5, 520).bfloat16()
    before = back.clone()
    view = back[1:5, 1:4, 4:516]                                # [4, 3, 512], strided
    pos = torch.tensor([0, 7, 4095, 100])
    want = view.clone()
    R.rocm_inverse_rope_rows_(want, pos, CS.to(cs_dtype), 64)
    ops.rocm_inverse_rope_rows_(view, pos, CS.to(cs_dtype), 64)
    assert torch.equal(view, want)
    mask = torch.ones_like(back, dtype=torch.bool)
    mask[1:5, 1:4, 452:516] = False
    assert torch.equal(back[mask], before[mask])
    assert not torch.equal(view[1:, :, 448:], before[2:5, 1:4, 452:516])     # position 0 is the identity


O4, P4 = rows(4, 2)
BAD = [
    (lambda o: ops.rocm_inverse_rope_rows_(o, P4, CS, 63), "rope_head_dim"),
    (lambda o: ops.rocm_inverse_rope_rows_(o, P4, CS, 1024), "rope_head_dim"),
    (lambda o: ops.rocm_inverse_rope_rows_(o, P4, CS[:, :32], 64), "cos_sin_cache must have shape"),
    (lambda o: ops.rocm_inverse_rope_rows_(o, P4[:3], CS, 64), "positions must have shape"),
    (lambda o: ops.rocm_inverse_rope_rows_(o, P4 + 5000, CS, 64), "positions must lie"),
    (lambda o: ops.rocm_inverse_rope_rows_(o, P4.float(), CS, 64), "positions must have dtype"),
    (lambda o: ops.rocm_inverse_rope_rows_(o.float(), P4, CS, 64), "o must have dtype"),
    (lambda o: ops.rocm_inverse_rope_rows_(torch.zeros(4, 2, 1024, dtype=torch.bfloat16)[..., ::2], P4, CS, 64),
     "contiguous last"),
]


@pytest.mark.parametrize("call, match", BAD)
def test_bad_input_is_rejected_before_any_write(call, match):
    o = O4.clone()
    with pytest.raises(ValueError, match=match):
        call(o)
    assert torch.equal(o, O4)


# ---- the Triton kernel ---------------------------------------------------------------------------------
def check_kernel(kernel, device):
    n = 0
    for seed, (T, H, D, rope, cs_dtype) in enumerate([(3, 16, 512, 64, torch.float32), (5, 3, 512, 64, torch.bfloat16),
                                                      (2, 20, 128, 32, torch.float32), (1, 1, 64, 64, torch.float32)]):
        o, pos = rows(T, H, D, seed, device)
        cs = R.build_cos_sin_cache(10000.0, 4096, dim=rope).to(cs_dtype).to(device) if rope != 64 else \
            CS.to(cs_dtype).to(device)
        pos[0] = cs.shape[0] + 3                                 # outside the table: left as it is
        want = o.clone()
        R.rocm_inverse_rope_rows_(want, pos, cs, rope)
        got = o.clone()
        kernel(got, pos, cs, rope)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (T, H, D, rope)
        assert torch.equal(got[0], o[0])
        n += 1
    return n


def test_triton_kernel_under_interpreter():
    r = run_file_interpreted(__file__)
    assert r.returncode == 0 and "interpreter cases passed: 4" in r.stdout


@pytest.mark.gpu
def test_gpu_kernel_equals_the_reference_bit_for_bit(gpu):
    assert ops.backend_for("rocm_inverse_rope_rows_", gpu) == "triton"
    check_kernel(ops.implementation("rocm_inverse_rope_rows_", gpu), gpu)
    o, pos = rows(2048, 128, seed=5, device=gpu)
    want = o.cpu().clone()
    R.rocm_inverse_rope_rows_(want, pos.cpu(), CS, 64)
    ops.rocm_inverse_rope_rows_(o, pos, CS.to(gpu), 64)
    assert torch.equal(o.cpu().view(torch.int16), want.view(torch.int16))


if __name__ == "__main__":
    from helpers import patch_interpreter_bf16, patch_interpreter_scalars
    patch_interpreter_scalars()
    patch_interpreter_bf16()                # fp32 -> bf16 rounded to nearest even, as the GPUs round it
    from dsv4_rocm.triton.attention.rocm_inverse_rope_rows import rocm_inverse_rope_rows_
    print("interpreter cases passed:", check_kernel(rocm_inverse_rope_rows_, "cpu"))
