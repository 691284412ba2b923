"""fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert and its _out variant, in vLLM's call form
``(q, kv, k_cache_2d, slot_mapping, positions, cos_sin_cache, padded_heads, eps, block_size, apply_q_norm=True,
kv_mxfp8=False, apply_q_rope=True, is_q_interleaved=False)`` (the 13-argument schema of vLLM's V4.1 code).

vLLM's own checks, ported: the q path against a float64 RMSNorm + GPT-J RoPE (within one bf16 step: the
op rounds once from fp32, the oracle here never); the kv path writes the bytes of
quantize_and_insert_k_cache applied to RoPE'd kv, exactly; DP padding (fewer slots than rows); one call
doing both. Also: the _out variant, bf16 cos/sin and int32 positions, every cache view, bad input
rejected before any write, a property test, and DeepSeek-V4.1's call without the q norm. The grown schema:
q norm and q RoPE switched off separately (q copied when both are), the chunk-interleaved q layout,
padded_heads 0 (KV only), kv_mxfp8 (V41_528 records, page-split or interleaved). GPU: the HIP kernel
against the reference (cache bytes exact, q within one bf16 step, with and without the q norm), poisoned
outputs, and a decode step captured in a CUDA/HIP graph.
"""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from dsv4_rocm import layout as L
from dsv4_rocm import ops
from dsv4_rocm.reference import cache as rc
from dsv4_rocm.reference import qkv as rq
from dsv4_rocm.reference.rope import build_cos_sin_cache
from helpers import every_cache_view, random_k

VIEWS = sorted(every_cache_view(1, 2))
CS = build_cos_sin_cache(10000.0, 4096)
OP = ops.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert


def rope64(x, positions, cs):
    """GPT-J RoPE on the last 64 dims in float64: pairs (448 + 2i, 449 + 2i), angle row of the position."""
    x = x.double().clone()
    c, s = cs[positions.long(), :32].double(), cs[positions.long(), 32:].double()
    while c.dim() < x.dim():
        c, s = c.unsqueeze(-2), s.unsqueeze(-2)
    e, o = x[..., 448::2].clone(), x[..., 449::2].clone()
    x[..., 448::2], x[..., 449::2] = e * c - o * s, e * s + o * c
    return x


def q_oracle(q, positions, cs, eps):
    x = q.double()
    return rope64(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps), positions, cs)


def within_one_bf16_step(a, b):
    """|a - b| within one bf16 step of b (2^-7 relative: 8 significant bits), plus 2^-16 of the row's largest
    value for entries that RoPE's e*c - o*s cancels to near zero (fp32 rounding there is relative to the
    terms, not to the small result)."""
    a, b = a.double(), b.double()
    tol = b.abs() * 2 ** -7 + b.abs().amax(-1, keepdim=True) * 2 ** -16
    bad = (a - b).abs() > tol
    print(f"max |diff| {float((a - b).abs().max()):.3g}, beyond one bf16 step: {int(bad.sum())}")
    assert int(bad.sum()) == 0


def kv_cache_bytes(kv, positions, slots, nb, bs, cs):
    """vLLM's KV oracle: RoPE kv (fp32, separate roundings, as the float64 oracle rounded to fp32 is not),
    then quantize_and_insert_k_cache."""
    c = rc.new_cache(nb, bs)
    n = slots.shape[0]
    ops.quantize_and_insert_k_cache(rq.kv_rope(kv[:n], positions[:n], cs), c, slots, bs)
    return c


@pytest.mark.parametrize("T, H", [(1, 8), (4, 64), (17, 8), (64, 64)])
def test_q_path_matches_the_oracle(T, H):
    q = torch.randn(T, H, 512).bfloat16()
    pos = torch.arange(T)
    c = torch.zeros(2, 16, 584, dtype=torch.uint8)
    out = OP(q, torch.zeros(T, 512).bfloat16(), c.view(2, -1), torch.full((T,), -1), pos, CS, H, 1e-6, 16)
    assert out.shape == (T, H, 512) and out.dtype == torch.bfloat16
    within_one_bf16_step(out, q_oracle(q, pos, CS, 1e-6))
    assert not bool(c.any())                                       # every slot was padding


@pytest.mark.parametrize("T", [1, 4, 17, 64])
@pytest.mark.parametrize("bs", [16, 64])
def test_kv_path_writes_quantize_and_insert_bytes(T, bs):
    kv = torch.randn(T, 512).bfloat16()
    pos = torch.arange(T)
    nb = (T + bs - 1) // bs + 1
    slots = torch.arange(T)
    c = torch.zeros(nb, bs * 584, dtype=torch.uint8)                # vLLM's test buffer: unpadded pages
    OP(torch.zeros(T, 1, 512).bfloat16(), kv, c, slots, pos, CS, 1, 1e-6, bs)
    assert torch.equal(c, kv_cache_bytes(kv, pos, slots, nb, bs, CS)[:, :bs * 584])
    # the bf16 RoPE part of each record is RoPE(kv) to one bf16 rounding of the float64 rotation
    rec = rc.gather_k_records(c, slots, bs)
    within_one_bf16_step(rec[:, 448:576].contiguous().view(torch.bfloat16), rope64(kv, pos, CS)[:, 448:])


@pytest.mark.parametrize("T, pad", [(4, 1), (17, 5)])
def test_dp_padding_inserts_only_the_slotted_rows(T, pad):
    q, kv = torch.randn(T + pad, 8, 512).bfloat16(), torch.randn(T + pad, 512).bfloat16()
    pos, slots = torch.arange(T + pad), torch.arange(T)
    c = torch.zeros(2, 64, 584, dtype=torch.uint8)
    out = OP(q, kv, c.view(2, -1), slots, pos, CS, 64, 1e-6, 64)
    assert torch.equal(c.view(2, -1), kv_cache_bytes(kv, pos, slots, 2, 64, CS)[:, :64 * 584])
    within_one_bf16_step(out[:, :8], q_oracle(q, pos, CS, 1e-6))   # q rows of padded tokens still computed
    assert not bool(out[:, 8:].any())


@pytest.mark.parametrize("view", VIEWS)
def test_one_call_does_both_on_every_view(view):
    T, H = 9, 16
    q, kv = torch.randn(T, H, 512).bfloat16(), random_k(T)
    pos = torch.randint(0, 4096, (T,))
    slots = torch.tensor([5, -1, 0, 130, 64, 191, -4, 2, 70])
    v, backing = every_cache_view(3, 64, seed=4)[view]
    ref_v, ref_backing = every_cache_view(3, 64, seed=4)["padded_2d"]
    before = backing.clone()
    out = OP(q, kv, v, slots, pos, CS, 64, 1e-6, 64)
    ops.quantize_and_insert_k_cache(rq.kv_rope(kv, pos, CS), ref_v, slots, 64)
    assert torch.equal(backing[:, :64 * 584], ref_backing[:, :64 * 584])
    assert torch.equal(backing[:, 64 * 584:], before[:, 64 * 584:])        # padding untouched
    within_one_bf16_step(out[:, :H], q_oracle(q, pos, CS, 1e-6))


def test_out_variant_bf16_cos_sin_int32_positions_and_the_torch_ops():
    T, H = 6, 8
    q, kv = torch.randn(T, H, 512).bfloat16(), random_k(T)
    pos, slots = torch.tensor([0, 9, 4000, 3, 77, 1]), torch.tensor([1, 2, 3, -1, 63, 64])
    a = torch.zeros(2, 64, 584, dtype=torch.uint8)
    want = OP(q, kv, a.view(2, -1), slots, pos, CS, 64, 1e-6, 64)
    q_out = torch.full((T, 64, 512), float("nan"), dtype=torch.bfloat16)
    b = torch.zeros_like(a)
    r = ops.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert_out(q, kv, q_out, b.view(2, -1), slots.int(), pos.int(),
                                                                  CS, 64, 1e-6, 64)
    assert r is q_out and torch.equal(q_out, want) and torch.equal(a, b)
    for call in (lambda c, o: torch.ops.dsv4_rocm.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(
                     q, kv, c.view(2, -1), slots, pos, CS, 64, 1e-6, 64),
                 lambda c, o: torch.ops.dsv4_rocm.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert_out(
                     q, kv, o, c.view(2, -1), slots, pos, CS, 64, 1e-6, 64) or o):
        c, o = torch.zeros_like(a), torch.full_like(q_out, float("nan"))
        assert torch.equal(call(c, o), want) and torch.equal(c, a)
    # a bf16 table: the op reads the bf16 values (exactly what the fp32 op does with the table rounded)
    c16, c32 = torch.zeros_like(a), torch.zeros_like(a)
    out16 = OP(q, kv, c16.view(2, -1), slots, pos, CS.bfloat16(), 64, 1e-6, 64)
    out32 = OP(q, kv, c32.view(2, -1), slots, pos, CS.bfloat16().float(), 64, 1e-6, 64)
    assert torch.equal(out16, out32) and torch.equal(c16, c32)


# ---- the grown schema (vLLM's V4.1 code) ---------------------------------------------------------------
def chunk_interleaved(q):
    """[T, H, 512] head-major -> the attention kernel's layout: value (h, d) at (d // 16) * H * 16 + h * 16 + d % 16
    of the token's row, written out by index."""
    T, H, D = q.shape
    out = torch.empty(T, H * D, dtype=q.dtype)
    h, d = torch.meshgrid(torch.arange(H), torch.arange(D), indexing="ij")
    out[:, ((d // 16) * H * 16 + h * 16 + d % 16).reshape(-1)] = q.reshape(T, H * D)
    return out.view(T, H, D)


@pytest.mark.parametrize("norm, rope", [(False, True), (True, False), (False, False)])
def test_q_norm_and_rope_switch_off(norm, rope):
    T, H = 7, 8
    q = torch.randn(T, H, 512).bfloat16()
    pos = torch.randint(0, 4096, (T,))
    c = torch.zeros(1, 64, 584, dtype=torch.uint8)
    out = OP(q, torch.zeros(T, 512).bfloat16(), c.view(1, -1), torch.full((T,), -1), pos, CS, 16, 1e-6, 64, norm,
             False, rope, False)
    x = q.double()
    if norm:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    want = rope64(x, pos, CS) if rope else x
    if norm or rope:
        within_one_bf16_step(out[:, :H], want)
    else:
        assert torch.equal(out[:, :H], q)                      # neither: the live heads are copied
    assert not bool(out[:, H:].any())


@pytest.mark.parametrize("norm, rope", [(False, False), (True, True)])
def test_interleaved_q_layout(norm, rope):
    """vLLM's FlashMLA mega-attention path: q in and q out in the 16-dim chunk-interleaved layout, padded from
    H to Hp heads; the same values as the head-major call, moved."""
    T, H, Hp = 5, 8, 64
    q = torch.randn(T, H, 512).bfloat16()
    pos, slots = torch.arange(T), torch.tensor([0, 3, -1, 9, 2])
    a, b = torch.zeros(1, 64, 528, dtype=torch.uint8), torch.zeros(1, 64, 528, dtype=torch.uint8)
    kv = random_k(T)
    head_major = OP(q, kv, a.view(1, -1), slots, pos, CS, Hp, 1e-6, 64, norm, True, rope, False)
    inter = OP(chunk_interleaved(q), kv, b.view(1, -1), slots, pos, CS, Hp, 1e-6, 64, norm, True, rope, True)
    assert torch.equal(inter, chunk_interleaved(head_major)) and torch.equal(a, b) and bool(a.any())


def test_padded_heads_zero_is_kv_only():
    T = 6
    q, kv = torch.randn(T, 64, 512).bfloat16(), random_k(T)
    pos, slots = torch.arange(T), torch.tensor([1, 0, 5, -1, 7, 2])
    c = torch.zeros(1, 16, 528, dtype=torch.uint8)
    out = OP(q, kv, c.view(1, -1), slots, pos, CS, 0, 1e-6, 16, False, True, False, True)
    assert out.shape == (T, 0, 512)
    want = torch.zeros_like(c)
    ops.quantize_and_insert_k_cache(rq.kv_rope(kv, pos, CS), want.view(1, -1), slots, 16, bytes_per_token=528)
    assert torch.equal(c, want) and bool(c.any())


@pytest.mark.parametrize("layout", ["page_split", "interleaved"])
def test_kv_mxfp8_writes_v41_records(layout):
    """kv_mxfp8: RoPE (fp32), one bf16 rounding, then a V41_528 record: quantize_and_insert_k_cache's bytes
    with bytes_per_token=528; the record's RoPE dims dequantize to the rotated kv within an fp8 step."""
    T, bs = 11, 8
    fmt = L.with_layout(L.V41_528, layout)
    q, kv = torch.randn(T, 4, 512).bfloat16(), random_k(T)
    pos = torch.randint(0, 4096, (T,))
    slots = torch.tensor([3, 9, -1, 0, 20, 21, 5, 6, 7, -1, 1])
    c = torch.randint(0, 256, (3, L.page_bytes(bs, fmt)), dtype=torch.uint8)
    want = c.clone()
    out = OP(q, kv, c, slots, pos, CS, 64, 1e-6, bs, False, True, True, False, kv_layout=layout)
    ops.quantize_and_insert_k_cache(rq.kv_rope(kv, pos, CS), want, slots, bs, bytes_per_token=528, kv_layout=layout)
    assert torch.equal(c, want)
    dec = rc.decode_k_records(rc.gather_k_records(c, slots.clamp_min(0), bs, fmt), fmt)
    rot = rope64(kv, pos, CS)
    err = (dec[:, 448:] - rot[:, 448:]).abs() / rot[:, 448:].abs().reshape(T, 2, 32).amax(-1).repeat_interleave(32, 1)
    assert float(err[slots >= 0].max()) <= 2 ** -4
    x = q.double()
    within_one_bf16_step(out[:, :4], rope64(x, pos, CS))         # apply_q_norm False


def test_grown_schema_bad_input():
    q, kv = torch.randn(3, 8, 512).bfloat16(), random_k(3)
    c = torch.zeros(1, 64, 584, dtype=torch.uint8)
    args = (q, kv, c.view(1, -1), torch.arange(3), torch.arange(3), CS)
    for kw, match in ((dict(kv_mxfp8=True), "V41_528 cache"), (dict(apply_q_norm=1), "apply_q_norm must be a bool"),
                      (dict(is_q_interleaved=True, padded_heads=4), "padded_heads"),):
        ph = kw.pop("padded_heads", 16)
        with pytest.raises(ValueError, match=match):
            OP(*args, ph, 1e-6, 64, **kw)
    with pytest.raises(ValueError, match="chunk-interleaved layout"):
        OP(q.transpose(0, 1).contiguous().transpose(0, 1), *args[1:], 16, 1e-6, 64, is_q_interleaved=True)
    assert not bool(c.any())


def test_empty_batch():
    c = torch.zeros(1, 64, 584, dtype=torch.uint8)
    out = OP(torch.zeros(0, 8, 512).bfloat16(), torch.zeros(0, 512).bfloat16(), c.view(1, -1),
             torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), CS, 64, 1e-6, 64)
    assert out.shape == (0, 64, 512) and not bool(c.any())


Q, KV, POS, SL = torch.randn(4, 8, 512).bfloat16(), torch.randn(4, 512).bfloat16(), torch.arange(4), torch.arange(4)
BAD = [
    (lambda c: OP(Q, KV, c, SL, POS, CS, 4, 1e-6, 64), "padded_heads"),
    (lambda c: OP(Q, KV[:3], c, SL, POS, CS, 64, 1e-6, 64), "kv must have shape"),
    (lambda c: OP(Q.float(), KV, c, SL, POS, CS, 64, 1e-6, 64), "q must have dtype"),
    (lambda c: OP(Q, KV, c, SL, POS + 4093, CS, 64, 1e-6, 64), "positions must lie"),
    (lambda c: OP(Q, KV, c, SL, POS - 1, CS, 64, 1e-6, 64), "positions must lie"),
    (lambda c: OP(Q, KV, c, SL, POS[:3], CS, 64, 1e-6, 64), "positions has 3 entries"),
    (lambda c: OP(Q, KV, c, SL, POS, CS.double(), 64, 1e-6, 64), "cos_sin_cache must have dtype"),
    (lambda c: OP(Q, KV, c, SL, POS, CS[:, :32], 64, 1e-6, 64), "cos_sin_cache must have shape"),
    (lambda c: OP(Q, KV, c, SL + 61, POS, CS, 64, 1e-6, 64), "slot_mapping: slot 64 is outside"),
    (lambda c: OP(Q, KV, c, torch.arange(5), POS, CS, 64, 1e-6, 64), "slot_mapping has 5 entries"),
    (lambda c: OP(Q, KV, c, SL, POS, CS, 64, -1.0, 64), "eps"),
    (lambda c: OP(Q, KV, c, SL, POS, CS, 64, float("nan"), 64), "eps"),
    (lambda c: OP(Q, KV, c, SL, POS, CS, 64, 1e-6, 16), "k_cache"),
    (lambda c: ops.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert_out(
        Q, KV, torch.empty(4, 32, 512).bfloat16(), c, SL, POS, CS, 64, 1e-6, 64), "q_out must have shape"),
]


@pytest.mark.parametrize("call, match", BAD)
def test_bad_input_is_rejected_before_any_write(call, match):
    c = torch.randint(0, 256, (1, 64, 584), dtype=torch.uint8)
    before = c.clone()
    with pytest.raises(ValueError, match=match):
        call(c.view(1, -1))
    assert torch.equal(c, before)


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_property_only_the_slotted_records_change(data):
    bs = data.draw(st.sampled_from([2, 16, 64]))
    nb = data.draw(st.integers(1, 3))
    T = data.draw(st.integers(0, 8))
    n = data.draw(st.integers(0, min(T, nb * bs)))
    valid = data.draw(st.lists(st.integers(0, nb * bs - 1), min_size=n, max_size=n, unique=True))
    slots = torch.tensor([s if data.draw(st.booleans()) else -data.draw(st.integers(1, 99)) for s in valid],
                         dtype=torch.long)
    view = data.draw(st.sampled_from(VIEWS))
    q, kv = torch.randn(T, 2, 512).bfloat16(), random_k(T)
    pos = torch.randint(0, 4096, (T,))
    v, backing = every_cache_view(nb, bs, seed=T)[view]
    OP(q, kv, v, slots, pos, CS, 2, 1e-6, bs)
    want = every_cache_view(nb, bs, seed=T)[view]
    ops.quantize_and_insert_k_cache(rq.kv_rope(kv[:n], pos[:n], CS), want[0], slots, bs)
    assert torch.equal(backing, want[1])


def test_without_the_q_norm_q_is_only_roped():
    """DeepSeek-V4.1 passes apply_q_norm=False (q was normed before wq_b): q_out is bf(RoPE(q)) per head,
    within one bf16 step of the float64 rotation; the cache bytes do not change with the flag; the custom
    op takes the flag as vLLM's tenth argument."""
    g = torch.Generator().manual_seed(11)
    T, H, nb = 30, 8, 2
    q, kv = (torch.randn(T, H, 512, generator=g) * 3).bfloat16(), random_k(T, gen=g)
    pos = torch.randint(0, 4096, (T,), generator=g)
    slots = torch.randperm(nb * 64, generator=g)[:T]
    caches = [rc.new_cache(nb, 64) for _ in range(3)]
    plain = OP(q, kv, caches[0], slots, pos, CS, 64, 1e-6, 64, False)
    normed = OP(q, kv, caches[1], slots, pos, CS, 64, 1e-6, 64)
    lib = torch.ops.dsv4_rocm.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(q, kv, caches[2], slots, pos, CS, 64,
                                                                                 1e-6, 64, False)
    within_one_bf16_step(plain[:, :H], rope64(q.double(), pos, CS))
    assert torch.equal(plain, lib) and not torch.equal(plain, normed)
    assert torch.equal(caches[0], caches[1]) and torch.equal(caches[0], caches[2])
    with pytest.raises(ValueError, match="apply_q_norm"):
        OP(q, kv, caches[0], slots, pos, CS, 64, 1e-6, 64, 0)


def plain_cos_sin(rows):
    """A plain RoPE table (base 10000, no YaRN), fp32 [rows, 64]: cos | sin, as vLLM's q-path test builds it."""
    inv = 1.0 / 10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)
    f = torch.outer(torch.arange(rows, dtype=torch.float32), inv)
    return torch.cat([f.cos(), f.sin()], -1)


def fma_rope_bf16(q, pos, cs):
    """bf16 of vLLM's q rotation, written out in float64: e' = fp32(e c - fp32(o s)), o' = fp32(e s + fp32(o c))
    (one fused multiply-add each; the float64 products are exact)."""
    x = q.double().clone()
    c, s = cs[pos, :32].double()[:, None], cs[pos, 32:].double()[:, None]
    e, o = x[..., 448::2].clone(), x[..., 449::2].clone()
    x[..., 448::2] = (e * c - (o * s).float().double()).float().double()
    x[..., 449::2] = (e * s + (o * c).float().double()).float().double()
    return x.float().bfloat16()


def test_q_rope_without_the_norm_rounds_as_vllms_reference():
    """vLLM's q-path check at 2048 tokens (8 heads, positions 0..2047, a plain fp32 table), exactly: its
    reference rotates with one fused multiply-add per value (fma(e, c, -(o s))), which rounds once where
    e c - o s as three operations rounds three times; on this input the two differ by a bf16 step in some
    elements, and the op's q must be the fused form's bits."""
    g = torch.Generator().manual_seed(7)
    T, H = 2048, 8
    q = torch.randn(T, H, 512, generator=g).bfloat16()
    pos, cs = torch.arange(T), plain_cos_sin(4096)
    c = torch.zeros(2, 16, 584, dtype=torch.uint8)
    out = OP(q, torch.zeros(T, 512).bfloat16(), c.view(2, -1), torch.full((T,), -1), pos, cs, 16, 1e-6, 16,
             apply_q_norm=False)
    want = fma_rope_bf16(q, pos, cs)
    three = rq.kv_rope(q, pos, cs)                         # e c - o s with three roundings
    assert torch.equal(out[:, :H, :448], q[..., :448]) and not bool(out[:, H:].any())
    assert torch.equal(out[:, :H].view(torch.int16), want.view(torch.int16))
    differ = int((three.view(torch.int16) != want.view(torch.int16)).sum())
    print(f"elements where three roundings differ from the fused form: {differ} of {want.numel()}")
    assert differ > 0


@pytest.mark.gpu
def test_gpu_q_rope_without_the_norm_is_vllms_bits(gpu):
    """The HIP kernel's q without the norm: the reference's bits exactly (no reduction in the path)."""
    g = torch.Generator().manual_seed(7)
    T, H = 2048, 8
    q = torch.randn(T, H, 512, generator=g).bfloat16()
    pos, cs = torch.arange(T), plain_cos_sin(4096)
    c = torch.zeros(2, 16 * 584, dtype=torch.uint8, device=gpu)
    out = OP(q.to(gpu), torch.zeros(T, 512, device=gpu).bfloat16(), c, torch.full((T,), -1, device=gpu),
             pos.to(gpu), cs.to(gpu), 16, 1e-6, 16, apply_q_norm=False)
    assert torch.equal(out[:, :H].cpu().view(torch.int16), fma_rope_bf16(q, pos, cs).view(torch.int16))
    assert not bool(out[:, H:].any())


# ---- GPU ------------------------------------------------------------------------------------------------
def _hip():
    assert ops.backend_for("fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert", "cuda") == "hip"
    return ops.implementation("fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert", "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("T, H, Hp, n_slots", [(1, 8, 64, 1), (333, 64, 64, 300), (50, 128, 128, 50),
                                                (17, 16, 64, 0), (2000, 64, 64, 2000)])
@pytest.mark.parametrize("table, index_dtype", [(torch.float32, torch.int64), (torch.bfloat16, torch.int32)])
def test_gpu_kernel_against_the_reference(T, H, Hp, n_slots, table, index_dtype, gpu):
    g = torch.Generator().manual_seed(T * H)
    q = (torch.randn(T, H, 512, generator=g) * 3).bfloat16().to(gpu)
    kv = random_k(T, gen=g).to(gpu)
    cs = build_cos_sin_cache(10000.0, 70000, device=gpu).to(table)
    pos = torch.randint(0, 70000, (T,), generator=g).to(index_dtype).to(gpu)
    nb = (T + 63) // 64 + 2
    slots = torch.randperm(nb * 64, generator=g)[:n_slots]
    slots[torch.rand(n_slots, generator=g) < 0.1] = -1
    slots = slots.to(index_dtype).to(gpu)
    cache = torch.full((nb, 64, 584), 0xAB, dtype=torch.uint8, device=gpu)     # poisoned
    ref_cache = cache.clone()
    q_out = torch.full((T, Hp, 512), float("nan"), dtype=torch.bfloat16, device=gpu)  # poisoned
    _hip()(q, kv, cache.view(nb, -1), slots, pos, cs, Hp, 1e-6, 64, q_out)
    ref = rq.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(q, kv, ref_cache.view(nb, -1), slots, pos, cs, Hp,
                                                               1e-6, 64)
    assert torch.equal(cache, ref_cache)
    assert torch.equal(q_out[:, H:], torch.zeros_like(q_out[:, H:]))
    within_one_bf16_step(q_out[:, :H], ref[:, :H])


@pytest.mark.gpu
@pytest.mark.parametrize("norm, rope, inter, layout", [(False, True, False, "page_split"),
                                                       (False, False, True, "page_split"),
                                                       (True, True, True, "interleaved"),
                                                       (False, False, False, "interleaved")])
@pytest.mark.parametrize("T, H, Hp", [(1, 8, 64), (333, 64, 64), (50, 16, 128), (40, 64, 0)])
def test_gpu_grown_schema_against_the_reference(T, H, Hp, norm, rope, inter, layout, gpu):
    g = torch.Generator().manual_seed(T * H + Hp)
    fmt = L.with_layout(L.V41_528, layout)
    q = (torch.randn(T, H, 512, generator=g) * 3).bfloat16().to(gpu)
    kv = random_k(T, gen=g).to(gpu)
    cs = build_cos_sin_cache(10000.0, 70000, device=gpu)
    pos = torch.randint(0, 70000, (T,), generator=g).to(gpu)
    nb = (T + 31) // 32 + 2
    slots = torch.randperm(nb * 32, generator=g)[:T]
    slots[torch.rand(T, generator=g) < 0.1] = -1
    slots = slots.to(gpu)
    cache = torch.full((nb, L.page_bytes(32, fmt)), 0xAB, dtype=torch.uint8, device=gpu)
    ref_cache = cache.clone()
    q_out = torch.full((T, Hp, 512), float("nan"), dtype=torch.bfloat16, device=gpu)
    _hip()(q, kv, cache, slots, pos, cs, Hp, 1e-6, 32, q_out, apply_q_norm=norm, apply_q_rope=rope,
           is_q_interleaved=inter, fmt=fmt)
    ref = rq.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(q, kv, ref_cache, slots, pos, cs, Hp, 1e-6, 32,
                                                               apply_q_norm=norm, apply_q_rope=rope,
                                                               is_q_interleaved=inter, fmt=fmt)
    assert torch.equal(cache, ref_cache)
    if Hp:
        if norm or rope:
            within_one_bf16_step(q_out, ref)
        else:
            assert torch.equal(q_out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("apply_q_norm", [True, False])
def test_gpu_kernel_with_and_without_the_q_norm(apply_q_norm, gpu):
    """The HIP kernel's q rows and cache bytes against the reference, with vLLM's V4.0 (normed) and V4.1
    (roped only) call."""
    g = torch.Generator().manual_seed(5)
    T, H, nb = 257, 64, 6
    q = (torch.randn(T, H, 512, generator=g) * 3).bfloat16().to(gpu)
    kv = random_k(T, gen=g).to(gpu)
    cs = build_cos_sin_cache(160000.0, 9000, device=gpu)
    pos = torch.randint(0, 9000, (T,), generator=g).to(gpu)
    slots = torch.randperm(nb * 64, generator=g)[:T].to(gpu)
    cache = torch.full((nb, 64, 584), 0xAB, dtype=torch.uint8, device=gpu)
    ref_cache = cache.clone()
    got = OP(q, kv, cache.view(nb, -1), slots, pos, cs, 64, 1e-6, 64, apply_q_norm)
    ref = rq.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(q, kv, ref_cache.view(nb, -1), slots, pos, cs, 64,
                                                               1e-6, 64, apply_q_norm=apply_q_norm)
    assert torch.equal(cache, ref_cache)
    within_one_bf16_step(got, ref)


@pytest.mark.gpu
def test_gpu_strided_q_out_and_garbage_indices(gpu):
    """q_out as a slice of a bigger buffer; garbage positions and slots (no value checks on the GPU by
    default): zero q rows, no record, nothing written outside."""
    T = 40
    q, kv = torch.randn(T, 8, 512, device=gpu).bfloat16(), random_k(T).to(gpu)
    cs = build_cos_sin_cache(10000.0, 100, device=gpu)
    pos = torch.randint(0, 100, (T,), device=gpu)
    pos[::7] = 100 + torch.arange(6, device=gpu)
    pos[3] = -2
    slots = torch.randperm(128, device=gpu)[:T]
    slots[::5] += 1000
    big = torch.full((T, 70, 512), float("nan"), dtype=torch.bfloat16, device=gpu)
    want = big.clone()
    c = torch.full((2, 64, 584), 0x5A, dtype=torch.uint8, device=gpu)
    rcache = c.clone()
    ops.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert_out(q, kv, big[:, 3:67], c.view(2, -1), slots, pos, cs, 64,
                                                              1e-6, 64)
    rq.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(q, kv, rcache.view(2, -1), slots, pos, cs, 64, 1e-6, 64,
                                                         q_out=want[:, 3:67])
    assert torch.equal(c, rcache)
    assert big[:, :3].isnan().all() and big[:, 67:].isnan().all()
    assert torch.equal(big[:, 3:67].isnan(), want[:, 3:67].isnan())
    within_one_bf16_step(big[:, 3:67].nan_to_num(), want[:, 3:67].nan_to_num())


@pytest.mark.gpu
def test_gpu_decode_step_replays_from_a_graph(gpu):
    """A decode step of the cache and Q/KV ops (norms, fused q norm + insert into caller buffers, SWA rows
    read back through global slots) captured once, replayed on new inputs: same results as eager."""
    B, H, nb = 16, 64, 8
    g = torch.Generator().manual_seed(0)
    cs = build_cos_sin_cache(10000.0, 4096, device=gpu)
    qr_kv = torch.empty(B, 1024 + 512, dtype=torch.bfloat16, device=gpu)
    qw = (1 + 0.1 * torch.randn(1024, generator=g)).bfloat16().to(gpu)
    kw = (1 + 0.1 * torch.randn(512, generator=g)).bfloat16().to(gpu)
    wq = (torch.randn(1024, H * 512, generator=g) * 0.03).bfloat16().to(gpu)
    pos = torch.empty(B, dtype=torch.int64, device=gpu)
    slots = torch.empty(B, dtype=torch.int64, device=gpu)
    window = torch.empty(B, 128, dtype=torch.int32, device=gpu)
    cache = torch.zeros(nb, 64, 584, dtype=torch.uint8, device=gpu)
    q_out = torch.empty(B, H, 512, dtype=torch.bfloat16, device=gpu)
    kv_rows = torch.empty(B, 128, 512, dtype=torch.bfloat16, device=gpu)

    def step():
        qr, kv = ops.fused_q_kv_rmsnorm(qr_kv[:, :1024], qr_kv[:, 1024:], qw, kw, 1e-6)
        q = (qr @ wq).view(B, H, 512)
        ops.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert_out(q, kv, q_out, cache.view(nb, -1), slots, pos, cs,
                                                                  H, 1e-6, 64)
        ops.dequantize_global_slots_k_cache(kv_rows, cache, window, 64)

    def new_inputs(seed):
        gg = torch.Generator().manual_seed(seed)
        qr_kv.copy_(torch.randn(B, 1536, generator=gg).bfloat16())
        pos.copy_(torch.randint(0, 4096, (B,), generator=gg))
        slots.copy_(torch.randperm(nb * 64, generator=gg)[:B])
        window.copy_(torch.randint(-1, nb * 64, (B, 128), generator=gg).int())

    new_inputs(1)
    step()                                                           # warm up: build, caches, allocator
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in (2, 3):
        new_inputs(seed)
        cache_before = cache.clone()
        graph.replay()
        got = (q_out.clone(), cache.clone(), kv_rows.clone())
        cache.copy_(cache_before)
        step()
        assert torch.equal(got[0], q_out) and torch.equal(got[1], cache) and torch.equal(got[2], kv_rows)
        assert bool(got[1].ne(cache_before).any())
