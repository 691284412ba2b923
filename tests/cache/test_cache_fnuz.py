"""The FNUZ flavour of the fp8_ds_mla record (``use_fnuz=True`` of quantize_and_insert_k_cache and
dequantize_and_gather_k_cache): vLLM's gfx942 sliding-window cache, byte for byte.

The expected bytes come from vLLM's rule written out here on its own (e = ceil(log2(amax / 224)) in
float64, e4m3fnuz of clamp(x * 2^-e, +-224), scale byte e + 127), not from the reference's code path; the
identity the kernels use (the OCP record with each scale byte one higher) is checked as a second, separate
statement. CPU: the reference and the public ops (every cache view, vLLM's call forms, padding slots),
reading arbitrary bytes, poisoned blocks, flag checks; the V41_528 record's FNUZ flavour (vLLM's V4.1 writer
takes use_fnuz too). GPU: the HIP writer and reader (V40_584, V41_528 in both layouts) against the
reference on poisoned caches and random bytes.
"""
import pytest
import torch

from dsv4_rocm import layout as L
from dsv4_rocm import ops
from dsv4_rocm.reference import cache as rc
from helpers import every_cache_view, page_records, random_k
from test_quantize_and_insert_k_cache import _k as wide_range_k

VIEWS = sorted(every_cache_view(1, 2))
FNUZ = L.with_fnuz(L.V40_584)


def vllm_fnuz_records(k):
    """uint8 [T, 584] records as vLLM's gfx942 FNUZ writer defines them (finite k)."""
    x = k[:, :448].float().reshape(-1, 7, 64)
    amax = x.abs().amax(-1).clamp(min=1e-4)
    e = torch.ceil(torch.log2(amax.double() / 224.0)).float()
    q = (x * torch.exp2(-e).unsqueeze(-1)).clamp(-224, 224).to(torch.float8_e4m3fnuz).view(torch.uint8)
    scales = torch.cat([(e + 127).to(torch.uint8), torch.zeros(k.shape[0], 1, dtype=torch.uint8)], 1)
    return torch.cat([q.reshape(-1, 448), k[:, 448:].contiguous().view(torch.uint8), scales], 1)


def hand_decode_fnuz(rec):
    """fp32 [N, 512] of arbitrary FNUZ-flavour record bytes: fnuz(byte) * 2^(scale byte - 127), a scale
    byte of 0xFF poisoning its block with NaN (the UE8M0 NaN, as in the OCP flavour)."""
    v = rec[:, :448].contiguous().view(torch.float8_e4m3fnuz).double().reshape(-1, 7, 64)
    sb = rec[:, 576:583].double()
    scale = torch.where(sb == 255, torch.full_like(sb, float("nan")), torch.exp2(sb - 127))
    nope = (v * scale.unsqueeze(-1)).reshape(-1, 448)
    return torch.cat([nope, rec[:, 448:576].contiguous().view(torch.bfloat16).double()], 1).float()


def place(before, rec, slots, bs):
    """``before`` page records ([nb, bs*584]) with rows of ``rec`` written at the valid slots."""
    after = before.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            p, o = divmod(s, bs)
            after[p, o * 576:(o + 1) * 576] = rec[t, :576]
            after[p, bs * 576 + o * 8:bs * 576 + (o + 1) * 8] = rec[t, 576:]
    return after


def test_reference_writes_vllms_fnuz_bytes():
    k = random_k(300)
    rec = rc.encode_k_records(k, FNUZ)
    assert torch.equal(rec, vllm_fnuz_records(k))
    assert not bool((rec[:, :448] == 0x80).any())          # fnuz NaN is never written for finite input


def test_fnuz_record_is_the_ocp_record_with_scale_bytes_one_higher():
    k = random_k(300, scale=2.0 ** 20)
    ocp, fnuz = rc.encode_k_records(k), rc.encode_k_records(k, FNUZ)
    assert torch.equal(fnuz[:, :576], ocp[:, :576])
    assert torch.equal(fnuz[:, 576:583].int(), ocp[:, 576:583].int() + 1)
    assert (fnuz[:, 583] == 0).all()


def test_both_flavours_hold_the_same_values():
    k = random_k(64)
    ocp = rc.decode_k_records(rc.encode_k_records(k))
    fnuz = rc.decode_k_records(rc.encode_k_records(k, FNUZ), FNUZ)
    assert torch.equal(fnuz, ocp)
    assert torch.equal(fnuz, hand_decode_fnuz(rc.encode_k_records(k, FNUZ)))
    wrong = rc.decode_k_records(rc.encode_k_records(k, FNUZ))     # read with the wrong flavour
    assert torch.equal(wrong[:, :448], 2 * ocp[:, :448]) and torch.equal(wrong[:, 448:], ocp[:, 448:])


def test_reading_arbitrary_bytes():
    """Every byte value, every scale byte: 0x80 is NaN, 0x7F / 0xFF are +-240, 0xFF scales NaN."""
    g = torch.Generator().manual_seed(5)
    rec = torch.randint(0, 256, (512, 584), generator=g, dtype=torch.uint8)
    rec[0, :256] = torch.arange(256, dtype=torch.uint8)
    rec[:256, 576] = torch.arange(256, dtype=torch.uint8)
    rec[:, 448:576] = torch.randn(512, 64, generator=g).bfloat16().view(torch.uint8)
    got, want = rc.decode_k_records(rec, FNUZ), hand_decode_fnuz(rec)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_non_finite_block_is_poisoned_with_fnuz_nan():
    k = random_k(2).float()
    k[0, 70], k[1, 447] = float("nan"), float("-inf")
    rec = rc.encode_k_records(k.bfloat16(), FNUZ)
    assert int(rec[0, 577]) == 0xFF and (rec[0, 64:128] == 0x80).all() and int(rec[0, 576]) != 0xFF
    assert int(rec[1, 582]) == 0xFF and (rec[1, 384:448] == 0x80).all()
    dec = rc.decode_k_records(rec, FNUZ)
    assert dec[0, 64:128].isnan().all() and dec[1, 384:448].isnan().all() and not dec[0, :64].isnan().any()


@pytest.mark.parametrize("view", VIEWS)
def test_insert_writes_fnuz_records_in_every_view(view):
    nb, bs = 4, 16
    v, backing = every_cache_view(nb, bs, seed=7)[view]
    before = backing.clone()
    k = random_k(9)
    slots = torch.tensor([3, -1, nb * bs - 1, 0, bs + 2, -7, 2 * bs + 1, 1, bs])
    ops.quantize_and_insert_k_cache(k, v, slots, bs, True, True)           # vLLM's positional form
    want = place(page_records(before, bs), vllm_fnuz_records(k), slots, bs)
    assert torch.equal(page_records(backing, bs), want)
    assert torch.equal(backing[:, bs * 584:], before[:, bs * 584:])


def test_vllm_call_forms_write_the_same_bytes():
    k, slots = random_k(5), torch.tensor([0, 70, -1, 3, 64])
    caches = [torch.zeros(2, 64 * 584, dtype=torch.uint8) for _ in range(3)]
    ops.quantize_and_insert_k_cache(k, caches[0], slots, 64, True, True)
    ops.quantize_and_insert_k_cache(k, caches[1], slots, block_size=64, use_fnuz=True)
    torch.ops.dsv4_rocm.quantize_and_insert_k_cache(k, caches[2], slots, 64, True, True)
    want = place(torch.zeros(2, 64 * 584, dtype=torch.uint8), vllm_fnuz_records(k), slots, 64)
    for c in caches:
        assert torch.equal(c, want)


def insert_and_gather_both_flavours(k, slots, seq, gls, bt, bs, offset):
    """{use_fnuz: bf16 rows [R, 24, 512]}: k inserted at slots into pages of random bytes (6 pages of bs), then
    gathered back through bt at ``offset`` into NaN-poisoned rows, in each flavour."""
    rows = {}
    for flavour in (False, True):
        cache = torch.randint(0, 256, (6, bs * 584), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
        ops.quantize_and_insert_k_cache(k, cache, slots, bs, use_fnuz=flavour)
        out = torch.full((len(seq), 24, 512), float("nan"), dtype=torch.bfloat16)
        ops.dequantize_and_gather_k_cache(out, cache.view(6, bs, 584), torch.tensor(seq), torch.tensor(gls), bt, bs,
                                          offset, use_fnuz=flavour)
        rows[flavour] = out
    return rows


def test_gather_reads_fnuz_caches_through_a_block_table():
    """vLLM's prefill: insert the window with use_fnuz, gather it back with use_fnuz (offset, gather_lens):
    the same bf16 rows as the OCP flavour gives for the same K."""
    bs, seq, gls = 16, [35, 9], [20, 9]
    bt = torch.tensor([[4, 0, 2], [5, -1, -1]], dtype=torch.int32)
    k = random_k(sum(seq))
    slots = torch.cat([bt[r, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs for r, n in enumerate(seq)])
    rows = insert_and_gather_both_flavours(k, slots, seq, gls, bt, bs, 2)
    assert torch.equal(rows[True].view(torch.int16), rows[False].view(torch.int16))
    assert rows[True][:, :2].isnan().all() and not rows[True][0, 2:22].isnan().any()


def test_gather_of_arbitrary_bytes_matches_the_hand_decode():
    bs = 4
    cache = torch.randint(0, 256, (3, L.page_bytes(bs)), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    recs_rope = torch.randn(3 * bs, 64).bfloat16().view(torch.uint8)      # RoPE bytes: finite bf16
    for s in range(3 * bs):
        p, o = divmod(s, bs)
        cache[p, o * 576 + 448:o * 576 + 576] = recs_rope[s]
    out = torch.full((1, 3 * bs, 512), float("nan"), dtype=torch.bfloat16)
    bt = torch.tensor([[2, 0, 1]], dtype=torch.int32)
    ops.dequantize_and_gather_k_cache(out, cache, torch.tensor([3 * bs]), None, bt, bs, 0, True)
    slots = (bt[0].long().repeat_interleave(bs) * bs + torch.arange(bs).repeat(3))
    want = hand_decode_fnuz(rc.gather_k_records(cache, slots, bs)).bfloat16()
    assert torch.equal(out[0].isnan(), want.isnan())
    assert torch.equal(out[0].nan_to_num(), want.nan_to_num())


def vllm_fnuz_v41_records(k):
    """uint8 [T, 528] V41_528 records as vLLM's V4.1 writer defines them with use_fnuz (finite k): all 512 dims
    in blocks of 32, e = ceil(log2(amax / 224)), e4m3fnuz of clamp(x * 2^-e, +-224), 16 scale bytes e + 127."""
    x = k.float().reshape(-1, 16, 32)
    amax = x.abs().amax(-1).clamp(min=1e-4)
    e = torch.ceil(torch.log2(amax.double() / 224.0)).float()
    q = (x * torch.exp2(-e).unsqueeze(-1)).clamp(-224, 224).to(torch.float8_e4m3fnuz).view(torch.uint8)
    return torch.cat([q.reshape(-1, 512), (e + 127).to(torch.uint8)], 1)


@pytest.mark.parametrize("layout", ["interleaved", "page_split"])
def test_v41_528_records_have_the_fnuz_flavour_too(layout):
    """vLLM's V4.1 writer takes use_fnuz for its 528-byte record as well: the same rule over all 512 dims
    (the OCP V41 record with each scale byte one higher), written and gathered back through the ops."""
    fmt = L.with_layout(L.V41_528, layout)
    k = random_k(70)
    assert torch.equal(rc.encode_k_records(k, L.with_fnuz(fmt)), vllm_fnuz_v41_records(k))
    ocp = rc.encode_k_records(k, fmt)
    fz = rc.encode_k_records(k, L.with_fnuz(fmt))
    assert torch.equal(fz[:, :512], ocp[:, :512]) and torch.equal(fz[:, 512:].int(), ocp[:, 512:].int() + 1)
    bs, nb = 16, 6
    c = torch.randint(0, 256, (nb, L.page_bytes(bs, fmt)), dtype=torch.uint8)
    kw = {} if layout == "interleaved" else dict(kv_layout=layout)
    ops.quantize_and_insert_k_cache(k, c, torch.arange(70), bs, use_fnuz=True, bytes_per_token=528, **kw)
    assert torch.equal(rc.gather_k_records(c, torch.arange(70), bs, fmt), vllm_fnuz_v41_records(k))
    out = torch.full((1, 70, 512), float("nan"), dtype=torch.bfloat16)
    view = torch.as_strided(c, (nb, bs, 528), (c.stride(0), 528, 1))
    ops.dequantize_and_gather_k_cache(out, view, torch.tensor([70]), None, torch.arange(nb)[None], bs, 0, True, **kw)
    assert torch.equal(out[0], rc.decode_k_records(ocp, fmt).bfloat16())          # the same values as OCP
    fp4 = torch.zeros(nb, bs, 288, dtype=torch.uint8)
    with pytest.raises(ValueError, match="V41_FP4_288 records have no FNUZ flavour"):
        ops.dequantize_and_gather_k_cache(out, fp4, torch.tensor([4]), None, torch.tensor([[0]]), bs, 0, True)


@pytest.mark.parametrize("flag", [1, "yes", None])
def test_use_fnuz_must_be_a_bool(flag):
    c = torch.randint(0, 256, (2, L.page_bytes(64)), dtype=torch.uint8)
    before = c.clone()
    with pytest.raises(ValueError, match="use_fnuz must be a bool"):
        ops.quantize_and_insert_k_cache(random_k(2), c, torch.arange(2), 64, use_fnuz=flag)
    out = torch.full((1, 4, 512), float("nan"), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="use_fnuz must be a bool"):
        ops.dequantize_and_gather_k_cache(out, c, torch.tensor([4]), None, torch.tensor([[0]]), 64, 0, flag)
    assert torch.equal(c, before) and out.isnan().all()


# ---- GPU ------------------------------------------------------------------------------------------------
def _hip(name):
    assert ops.backend_for(name, "cuda") == "hip"
    return ops.implementation(name, "cuda")


def _wide_k(n, seed, device):
    """The OCP writer tests' K (wide exponent range, zero, -0 and tiny blocks) with non-finite blocks too."""
    k = wide_range_k(n, seed, "cpu").float()
    k[3::17, 200] = float("nan")
    k[4::19, 300] = float("inf")
    return k.bfloat16().to(device)


# the FNUZ formats the HIP writers and readers take: V40_584 and V41_528 (both page layouts)
GPU_FNUZ = [FNUZ, L.with_fnuz(L.with_layout(L.V41_528)), L.with_fnuz(L.V41_528)]
GPU_IDS = ["V40_584", "V41_528-interleaved", "V41_528-page_split"]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", GPU_FNUZ, ids=GPU_IDS)
@pytest.mark.parametrize("bs, n", [(64, 1), (64, 4097), (3, 100), (256, 5000)])
def test_gpu_kernel_writes_the_reference_fnuz_bytes(bs, n, fmt, gpu):
    nb = (n + bs - 1) // bs + 3
    g = torch.Generator().manual_seed(n)
    slots = torch.randperm(nb * bs, generator=g)[:n]
    slots[torch.rand(n, generator=g) < 0.1] = -1
    slots = slots.to(gpu)
    k = _wide_k(n, bs, gpu)
    cache = torch.full((nb, L.page_bytes(bs, fmt)), 0xAB, dtype=torch.uint8, device=gpu)
    ref = cache.clone()
    _hip("quantize_and_insert_k_cache")(k, cache, slots, bs, fmt)
    rc.quantize_and_insert_k_cache(k, ref, slots, bs, fmt)
    print(f"{fmt.name} bs={bs} n={n}: differing bytes {int((cache != ref).sum())}")
    assert torch.equal(cache, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", GPU_FNUZ, ids=GPU_IDS)
@pytest.mark.parametrize("bs, R", [(64, 3), (2, 9)])
def test_gpu_kernel_reads_fnuz_bytes_like_the_reference(bs, R, fmt, gpu):
    """Pages of random bytes (every fp8 and scale byte value, 0x80 and 0xFF included; finite RoPE bf16)."""
    g = torch.Generator().manual_seed(bs)
    cols = 4
    nb = R * cols + 1
    cache = torch.randint(0, 256, (nb, L.page_bytes(bs, fmt)), generator=g, dtype=torch.uint8)
    if fmt.quant_dims < 512:
        for s in range(nb * bs):
            p, o = divmod(s, bs)
            cache[p, o * 576 + 448:o * 576 + 576] = torch.randn(64, generator=g).bfloat16().view(torch.uint8)
    cache = cache.to(gpu)
    seq = torch.randint(1, cols * bs + 1, (R,), generator=g)
    gl = torch.minimum(seq, torch.randint(0, cols * bs, (R,), generator=g))
    bt = torch.randperm(nb, generator=g)[:R * cols].view(R, cols).int()
    args = (cache, seq.to(gpu), gl.to(gpu), bt.to(gpu), bs, 1)
    out = torch.full((R, cols * bs + 1, 512), float("nan"), dtype=torch.bfloat16, device=gpu)
    want = out.clone()
    _hip("dequantize_and_gather_k_cache")(out, *args, fmt)
    rc.dequantize_and_gather_k_cache(want, *args, fmt)
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.equal(out.nan_to_num().view(torch.int16), want.nan_to_num().view(torch.int16))
