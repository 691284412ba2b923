"""fused_inv_rope_fp8_quant (vLLM's call form): inverse RoPE in fp32, UE8M0 fp8 per 128 values (or 32, 64), the [T, G, D]
view of [G, T, D] storage and MN-major scales (fp32, or UE8M0 packed 4 an int32).

CPU: the oracle against the formula written out pair by pair and block by block; vLLM's call forms (keywords,
strided o, int32 positions, bf16 cos/sin, vLLM 0.33's quantize=False bf16 rows); the layouts and their zero
padding; the NaN policy; bad input;
the Triton kernel under the interpreter (scales, padding and poisoning exact; its fp8 casts are not
modelled exactly there, so bytes are checked on the GPU). GPU: kernel bytes and scales equal the oracle's,
padding tokens, graph capture.
"""
import math
import textwrap

import pytest
import torch

from dsv4_rocm import ops
from dsv4_rocm.reference import output as O
from dsv4_rocm.reference.quant import e4m3_decode
from dsv4_rocm.reference.rope import build_cos_sin_cache
from helpers import run_interpreted

CS = build_cos_sin_cache(10000.0, 2048)


def _o(T, H, seed, device="cpu"):
    """bf16 [T, H, 512], a spread of magnitudes per 128-block (many scale exponents)."""
    g = torch.Generator().manual_seed(seed)
    blk = torch.exp2(torch.randint(-20, 12, (T, H, 4), generator=g).float()).repeat_interleave(128, -1)
    return (torch.randn(T, H, 512, generator=g) * blk).bfloat16().to(device)


def _storage(scales):
    """The [G, K, T4] storage behind an MN-major [T, G, K] scale view."""
    T, G, K = scales.shape
    T4 = scales.stride(2)
    return torch.as_strided(scales, (G, K, T4), (K * T4, T4, 1))


def _rotated(o, pos, cs):
    """The inverse rotation pair by pair: fp32 [T, H, 512]."""
    x = o.float().clone()
    for i in range(32):
        c, s = cs[pos, i].float()[:, None], cs[pos, 32 + i].float()[:, None]
        e, od = x[..., 448 + 2 * i].clone(), x[..., 449 + 2 * i].clone()
        x[..., 448 + 2 * i] = e * c + od * s                        # fp32 products and sum, no fma
        x[..., 449 + 2 * i] = od * c - e * s
    return x


def _formula(o, pos, cs, G, qg=128):
    """Per token, head and block of qg values, in float64 where exact: the rotated fp32 values, the exponent,
    the bytes."""
    T, H, _ = o.shape
    x = _rotated(o, pos, cs)
    nb = 512 // qg
    blocks = x.reshape(T, H, nb, qg)
    amax = blocks.abs().amax(-1).clamp(min=1e-10)
    q = torch.zeros(T, H, nb, qg, dtype=torch.uint8)
    ex = torch.zeros(T, H, nb, dtype=torch.int32)
    for idx in range(T * H * nb):
        t, h, b = idx // (H * nb), idx // nb % H, idx % nb
        ratio = float(amax[t, h, b] / 448.0)                        # fp32 quotient, correctly rounded
        m, e2 = math.frexp(ratio)
        ex[t, h, b] = e2 - 1 if m == 0.5 else e2                    # exact ceil(log2)
        v = (blocks[t, h, b].double() * 2.0 ** -int(ex[t, h, b])).clamp(-448, 448)
        q[t, h, b] = v.float().to(torch.float8_e4m3fn).view(torch.uint8)
    q = torch.where(q == 0x80, torch.zeros_like(q), q)
    return q.reshape(T, G, -1), ex.reshape(T, G, -1)


@pytest.mark.parametrize("qg", [128, 64, 32])
@pytest.mark.parametrize("T, H, G", [(3, 16, 2), (6, 8, 1), (1, 64, 8)])
def test_oracle_equals_the_formula(T, H, G, qg):
    """Blocks of 128 (DeepSeek-V4's) and of 64 and 32 (vLLM's op sweeps 32: the 64 rotary dims then span two
    blocks, each scaled by its own amax)."""
    o, pos = _o(T, H, T + H), torch.tensor([0, 9, 700, 2047, 64, 5])[:T]
    nb = 512 // qg
    data, sa = O.fused_inv_rope_fp8_quant(o, pos, CS, G, H // G, quant_group_size=qg)
    q, ex = _formula(o, pos, CS, G, qg)
    assert data.dtype == torch.float8_e4m3fn and data.shape == (T, G, H // G * 512)
    assert data.stride() == (H // G * 512, T * H // G * 512, 1)              # [T, G, D] over [G, T, D]
    assert torch.equal(data.view(torch.uint8), q)
    T4 = (T + 3) // 4 * 4
    K = H // G * nb
    assert sa.dtype == torch.float32 and sa.shape == (T, G, K) and sa.stride() == (1, K * T4, T4)
    assert torch.equal(sa, torch.ldexp(torch.ones(()), ex.float()))
    assert bool((_storage(sa)[:, :, T:] == 0).all())
    _, packed = O.fused_inv_rope_fp8_quant(o, pos, CS, G, H // G, quant_group_size=qg, tma_aligned_scales=True)
    assert packed.dtype == torch.int32 and packed.shape == (T, G, K // 4) and packed.stride() == (1, K // 4 * T4, T4)
    b = (ex + 127).reshape(T, G, K // 4, 4).long()
    want = b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16 | b[..., 3] << 24
    assert torch.equal(packed.long() & 0xFFFFFFFF, want)
    assert bool((_storage(packed)[:, :, T:] == 0).all())


def test_vllm_call_forms_give_the_same_result():
    T, H, G = 5, 16, 2
    o = _o(T, H, 1)
    pos = torch.tensor([3, 0, 1999, 17, 256])
    ref = O.fused_inv_rope_fp8_quant(o, pos, CS, G, H // G)
    padded = torch.zeros(T, 24, 512, dtype=torch.bfloat16)
    padded[:, :H] = o                                           # the attention output of padded heads
    permuted = o.transpose(0, 1).contiguous().transpose(0, 1)   # [T, H, D] over [H, T, D] storage
    calls = [
        lambda: ops.fused_inv_rope_fp8_quant(o, pos, CS, n_groups=G, heads_per_group=H // G, nope_dim=448,
                                             rope_dim=64, tma_aligned_scales=False),
        lambda: ops.fused_inv_rope_fp8_quant(o, pos, CS, G, H // G, 448, 64, 128, False),
        lambda: ops.fused_inv_rope_fp8_quant(padded[:, :H], pos, CS, G, H // G),
        lambda: ops.fused_inv_rope_fp8_quant(permuted, pos.int(), CS, G, H // G),
    ]
    for call in calls:
        d, s = call()
        assert torch.equal(d.view(torch.uint8), ref[0].view(torch.uint8)) and torch.equal(s, ref[1])
    d, s = ops.fused_inv_rope_fp8_quant(o, pos, CS.bfloat16(), G, H // G)        # bf16 table (vLLM's tests)
    r = O.fused_inv_rope_fp8_quant(o, pos, CS.bfloat16().float(), G, H // G)
    assert torch.equal(d.view(torch.uint8), r[0].view(torch.uint8)) and torch.equal(s, r[1])


def test_quantize_false_gives_the_rotated_bf16_rows():
    """vLLM 0.33's ``quantize=False`` (a bf16 output projection): the rotated values rounded once to bf16,
    in the same [T, G, D] view of [G, T, D] storage, and an empty scale tensor of the form's dtype."""
    T, H, G = 5, 16, 4
    o, pos = _o(T, H, 3), torch.tensor([3, 0, 1999, 17, 256])
    want = _rotated(o, pos, CS).bfloat16().reshape(T, G, H // G * 512)
    for tma in (False, True):
        for rows, scales in (ops.fused_inv_rope_fp8_quant(o, pos, CS, G, H // G, 448, 64, 128, tma, False),
                             ops.fused_inv_rope_fp8_quant(o, pos, CS, G, H // G, tma_aligned_scales=tma,
                                                          quantize=False)):
            assert rows.dtype == torch.bfloat16 and rows.shape == (T, G, H // G * 512)
            assert rows.stride() == (H // G * 512, T * H // G * 512, 1)
            assert torch.equal(rows.view(torch.int16), want.view(torch.int16))
            assert scales.numel() == 0 and scales.dtype == (torch.int32 if tma else torch.float32)
    q8, _ = ops.fused_inv_rope_fp8_quant(o, pos, CS, G, H // G)          # the same rows, quantized
    assert torch.equal(q8.view(torch.uint8), O.fused_inv_rope_fp8_quant(o, pos, CS, G, H // G)[0].view(torch.uint8))


def test_output_feeds_fp8_einsum_as_vllm_passes_it():
    T, H, G, n = 4, 16, 2, 128
    o, pos = _o(T, H, 2), torch.tensor([1, 2, 3, 4])
    g = torch.Generator().manual_seed(3)
    w8, ws = O.quantize_weight(torch.randn(G, n, H // G * 512, generator=g) * 0.05)
    for tma in (False, True):
        a8, sa = ops.fused_inv_rope_fp8_quant(o, pos, CS, G, H // G, tma_aligned_scales=tma)
        z = torch.empty(T, G, n, dtype=torch.bfloat16)
        ops.fp8_einsum("bhr,hdr->bhd", (a8, sa), (w8.view(torch.float8_e4m3fn), ws), z,
                       recipe=(1, 128, 128))
        x = e4m3_decode(a8.view(torch.uint8).contiguous()).reshape(T, G, -1, 128) * \
            O.scale_values(sa, H // G * 4).unsqueeze(-1)
        w = e4m3_decode(w8) * ws.repeat_interleave(128, 1).repeat_interleave(128, 2)
        want = torch.einsum("bhr,hdr->bhd", x.reshape(T, G, -1).double(), w.double()).float().bfloat16()
        assert torch.equal(z, want)


def test_non_finite_blocks_are_poisoned_and_negative_zero_is_0x00():
    T, H, G = 2, 8, 1
    o = _o(T, H, 4)
    o[0, 1, 5] = float("nan")                   # block 0 of head 1
    o[1, 3, 500] = float("inf")                 # rope block of head 3
    o[1, 0, :128] = -0.0
    o[1, 0, 128:256] = -1e-30                   # tiny negatives round to -0
    d, s = ops.fused_inv_rope_fp8_quant(o, torch.tensor([5, 6]), CS, G, H)
    _, p = ops.fused_inv_rope_fp8_quant(o, torch.tensor([5, 6]), CS, G, H, tma_aligned_scales=True)
    b = d.view(torch.uint8).reshape(T, H, 4, 128)
    bad = torch.zeros(T, H, 4, dtype=torch.bool)
    bad[0, 1, 0] = bad[1, 3, 3] = True
    assert bool((b[bad] == 0x7F).all()) and not bool((b[~bad] == 0x7F).all(-1).any())
    sv = s.reshape(T, H, 4)
    assert bool(torch.isnan(sv[bad]).all()) and bool(torch.isfinite(sv[~bad]).all())
    pb = torch.stack([(p >> (8 * j)) & 0xFF for j in range(4)], -1).reshape(T, H, 4)
    assert bool((pb[bad] == 0xFF).all()) and bool((pb[~bad] < 0xFF).all())
    assert not bool((d.view(torch.uint8) == 0x80).any())


def test_empty_batch():
    d, s = ops.fused_inv_rope_fp8_quant(torch.zeros(0, 16, 512, dtype=torch.bfloat16), torch.zeros(0, dtype=torch.long),
                                        CS, 2, 8)
    assert d.shape == (0, 2, 4096) and s.shape == (0, 2, 32)


def _bad_calls():
    o, pos = _o(3, 16, 5), torch.tensor([0, 1, 2])
    yield "n_groups", lambda: ops.fused_inv_rope_fp8_quant(o, pos, CS, 3, 8)
    yield "heads_per_group", lambda: ops.fused_inv_rope_fp8_quant(o, pos, CS, 2, 0)
    yield "nope_dim", lambda: ops.fused_inv_rope_fp8_quant(o, pos, CS, 2, 8, nope_dim=512)
    yield "quant_group_size", lambda: ops.fused_inv_rope_fp8_quant(o, pos, CS, 2, 8, quant_group_size=48)
    yield "quant_group_size", lambda: ops.fused_inv_rope_fp8_quant(o, pos, CS, 2, 8, quant_group_size=256,
                                                                   tma_aligned_scales=True)
    yield "tma_aligned_scales", lambda: ops.fused_inv_rope_fp8_quant(o, pos, CS, 2, 8, tma_aligned_scales=1)
    yield "quantize must be a bool", lambda: ops.fused_inv_rope_fp8_quant(o, pos, CS, 2, 8, quantize=None)
    yield "o must have dtype", lambda: ops.fused_inv_rope_fp8_quant(o.float(), pos, CS, 2, 8)
    yield "o must be", lambda: ops.fused_inv_rope_fp8_quant(o[..., :448], pos, CS, 2, 8)
    yield "unit stride", lambda: ops.fused_inv_rope_fp8_quant(o.transpose(1, 2).contiguous().transpose(1, 2), pos,
                                                              CS, 2, 8)
    yield "positions has 2 entries", lambda: ops.fused_inv_rope_fp8_quant(o, pos[:2], CS, 2, 8)
    yield "positions must lie", lambda: ops.fused_inv_rope_fp8_quant(o, pos + 2046, CS, 2, 8)
    yield "positions must lie", lambda: ops.fused_inv_rope_fp8_quant(o, pos - 1, CS, 2, 8)
    yield "cos_sin_cache must have dtype", lambda: ops.fused_inv_rope_fp8_quant(o, pos, CS.double(), 2, 8)
    yield "cos_sin_cache must have shape", lambda: ops.fused_inv_rope_fp8_quant(o, pos, CS[:, :32], 2, 8)


@pytest.mark.parametrize("match, call", list(_bad_calls()), ids=[m for m, _ in _bad_calls()])
def test_bad_input_is_rejected(match, call):
    with pytest.raises(ValueError, match=match):
        call()


# ---- the Triton kernel ---------------------------------------------------------------------------------
_INTERPRETED = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, "tests")
    from helpers import patch_interpreter_scalars
    patch_interpreter_scalars()                   # the interpreter's scalar bugs, where the Triton has them
    import torch
    from dsv4_rocm.reference import output as O
    from dsv4_rocm.reference.rope import build_cos_sin_cache
    from dsv4_rocm.triton.output import fused_inv_rope_fp8_quant as K

    g = torch.Generator().manual_seed(0)
    T, G, HPG = 5, 2, 4
    blk = torch.exp2(torch.randint(-20, 12, (T, G * HPG, 4), generator=g).float()).repeat_interleave(128, -1)
    o = (torch.randn(T, G * HPG, 512, generator=g) * blk).bfloat16()
    o[2, 3, 7] = float("nan")
    o[4, 6, 460] = float("-inf")
    pos = torch.tensor([0, 3, 777, 2047, 1024])
    cs = build_cos_sin_cache(10000.0, 2048)
    for packed, qg in ((False, 128), (True, 128), (False, 32), (True, 32), (True, 64), (False, 256)):
        d, s = K.fused_inv_rope_fp8_quant(o, pos, cs, G, HPG, quant_group_size=qg, tma_aligned_scales=packed)
        rd, rs = O.fused_inv_rope_fp8_quant(o, pos, cs, G, HPG, quant_group_size=qg, tma_aligned_scales=packed)
        T4 = s.stride(2)
        store = torch.as_strided(s, (G, s.shape[2], T4), (s.shape[2] * T4, T4, 1)).view(torch.int32)
        ref_store = torch.as_strided(rs, (G, s.shape[2], T4), (s.shape[2] * T4, T4, 1)).view(torch.int32)
        poisoned = int((d.view(torch.uint8).reshape(T, G * HPG, 512 // qg, qg) == 0x7F).all(-1).sum())
        print(int(packed), tuple(d.stride()) == tuple(rd.stride()), tuple(s.stride()) == tuple(rs.stride()),
              int((store != ref_store).sum()), poisoned)
    bad = torch.tensor([5, -1, 2048, 7, 9])             # positions outside the table: padding tokens, written 0
    d, s = K.fused_inv_rope_fp8_quant(o, bad, cs, G, HPG)
    print(int(d.view(torch.uint8)[1:3].ne(0).sum()), int(s[1:3].ne(0).sum()), int(d.view(torch.uint8)[0].ne(0).sum()))
    import sys
    sys.path.insert(0, "tests")
    from helpers import patch_interpreter_bf16
    patch_interpreter_bf16()                            # fp32 -> bf16 rounded as the GPUs round it
    rows, sc = K.fused_inv_rope_fp8_quant(o, pos, cs, G, HPG, quantize=False)           # vLLM 0.33's bf16 rows
    want, _ = O.fused_inv_rope_fp8_quant(o, pos, cs, G, HPG, quantize=False)
    nan = want.isnan()
    same = torch.equal(rows.isnan(), nan) and torch.equal(rows.view(torch.int16)[~nan], want.view(torch.int16)[~nan]) \
        and rows.stride() == want.stride()
    rows, _ = K.fused_inv_rope_fp8_quant(o, bad, cs, G, HPG, quantize=False)
    print(int(same), int(sc.numel()), int(rows[1:3].view(torch.int16).ne(0).sum()), int(rows[0].ne(0).sum()) > 0)
""")


def test_kernel_scales_padding_and_poison_under_the_interpreter(tmp_path):
    r = run_interpreted(_INTERPRETED, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line.split() for line in r.stdout.strip().splitlines()]
    print("\n".join(" ".join(x) for x in rows))
    assert rows[0] == ["0", "True", "True", "0", "2"] and rows[1] == ["1", "True", "True", "0", "2"]
    assert rows[2:6] == [["0", "True", "True", "0", "2"], ["1", "True", "True", "0", "2"],       # blocks of 32,
                         ["1", "True", "True", "0", "2"], ["0", "True", "True", "0", "2"]]       # 64 and 256
    zeros_bytes, zeros_scales, valid_bytes = map(int, rows[6])
    assert zeros_bytes == 0 and zeros_scales == 0 and valid_bytes > 0
    assert rows[7] == ["1", "0", "0", "True"]            # quantize=False: the oracle's bf16 bits, padding 0


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 7, 130, 4099])
@pytest.mark.parametrize("H, G", [(64, 8), (128, 16)])
@pytest.mark.parametrize("cs_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qg", [128, 32])
def test_gpu_kernel_equals_the_oracle(T, H, G, cs_dtype, qg, gpu):
    o = _o(T, H, T + H, gpu)
    g = torch.Generator().manual_seed(T)
    pos = torch.randint(0, CS.shape[0], (T,), generator=g).to(gpu)
    cs = CS.to(cs_dtype).to(gpu)
    o[0, 1, 3] = float("nan")
    for tma in (False, True):
        with ops.use_backend("triton"):
            d, s = ops.fused_inv_rope_fp8_quant(o, pos, cs, G, H // G, quant_group_size=qg, tma_aligned_scales=tma)
        rd, rs = O.fused_inv_rope_fp8_quant(o, pos, cs, G, H // G, quant_group_size=qg, tma_aligned_scales=tma)
        nb = int((d.view(torch.uint8) != rd.view(torch.uint8)).sum())
        ns = int((_storage(s).view(torch.int32) != _storage(rs).view(torch.int32)).sum())
        print(f"T={T} H={H} cos/sin {cs_dtype} group {qg} packed={tma}: {nb} bytes, {ns} scale words differ")
        assert d.stride() == rd.stride() and s.stride() == rs.stride() and nb == 0 and ns == 0


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 130, 4099])
def test_gpu_quantize_false_equals_the_oracle(T, gpu):
    H, G = 128, 16
    o = _o(T, H, T, gpu)
    pos = torch.randint(0, CS.shape[0], (T,), generator=torch.Generator().manual_seed(T)).to(gpu)
    with ops.use_backend("triton"):
        rows, scales = ops.fused_inv_rope_fp8_quant(o, pos, CS.to(gpu), G, H // G, quantize=False)
    want, _ = O.fused_inv_rope_fp8_quant(o, pos, CS.to(gpu), G, H // G, quantize=False)
    assert rows.stride() == want.stride() and scales.numel() == 0
    assert torch.equal(rows.view(torch.int16), want.view(torch.int16))


@pytest.mark.gpu
def test_gpu_padding_positions_write_zeros(gpu):
    o = _o(6, 16, 9, gpu)
    pos = torch.tensor([4, -1, 2048, 10 ** 9, 0, 7], device=gpu)
    with ops.use_backend("triton"):
        d, s = ops.fused_inv_rope_fp8_quant(o, pos, CS.to(gpu), 2, 8)
    rd, rs = O.fused_inv_rope_fp8_quant(o[[0, 4, 5]], pos[[0, 4, 5]], CS.to(gpu), 2, 8)
    assert not bool(d.view(torch.uint8)[1:4].ne(0).any()) and not bool(s[1:4].ne(0).any())
    assert torch.equal(d.view(torch.uint8)[[0, 4, 5]], rd.view(torch.uint8)) and torch.equal(s[[0, 4, 5]], rs)


@pytest.mark.gpu
def test_gpu_graph_capture_and_replay(gpu):
    T, H, G = 128, 64, 8
    o, pos, cs = _o(T, H, 11, gpu), torch.arange(T, device=gpu), CS.to(gpu)
    with ops.use_backend("triton"):
        ops.fused_inv_rope_fp8_quant(o, pos, cs, G, 8)                 # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            d, s = ops.fused_inv_rope_fp8_quant(o, pos, cs, G, 8)
    for seed in (12, 13):
        o.copy_(_o(T, H, seed, gpu))
        pos.copy_(torch.randint(0, 2048, (T,), generator=torch.Generator().manual_seed(seed)).to(gpu))
        graph.replay()
        rd, rs = O.fused_inv_rope_fp8_quant(o, pos, cs, G, 8)
        assert torch.equal(d.view(torch.uint8), rd.view(torch.uint8)) and torch.equal(s, rs)
