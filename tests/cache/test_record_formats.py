"""Record formats as values (dsv4_rocm/layout.py RecordFormat): the three KV records' numbers, both page
layouts' byte addresses, the pairs FlashMLA accepts; the V4.1 quantizers of dsv4_rocm/reference against the
rules written out independently here (UE8M0 fp8 per 32, e2m1 + e4m3 per 16: scales, codes, ties, saturation,
-0, NaN), their exact decode; and, where a FlashMLA V4.1 test folder is present (.peers/FlashMLA-v41 or
FLASHMLA_V41_DIR), FlashMLA's own quantizer: the same fp4 bytes, the same fp8 bytes but where the documented
scale rule and -0 policy differ, and the same dequantized values of its bytes."""
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from dsv4_rocm import cache_views as V
from dsv4_rocm import layout as L
from dsv4_rocm.reference import cache as rc
from dsv4_rocm.reference.quant import (E2M1_GRID, flashmla_ue8m0_exponent, nvfp4_dequantize, nvfp4_quantize,
                                       quantize_blocks, ue8m0_exponent)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KV = {f.name: f for f in L.KV_FORMATS}


def spread(n, d=512, seed=0, block=32, lo=-24, hi=8):
    """bf16 [n, d] whose blocks of ``block`` dims have magnitudes 2^lo .. 2^hi (many scale exponents)."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.randint(lo, hi, (n, d // block), generator=g).float()).repeat_interleave(block, 1)
    return (torch.randn(n, d, generator=g) * mag).bfloat16()


# ---- the formats ---------------------------------------------------------------------------------------
def test_the_three_records():
    assert L.V40_584 == (("V40_584", 584, 576, 8, 448, 8, 64, "ue8m0", 576, False, "e4m3fn"))
    assert (L.V40_584.token_bytes, L.V40_584.data_bytes, L.V40_584.num_scales) == (L.TOKEN_BYTES, L.DATA_BYTES, 7)
    assert (L.V41_528.quant_bytes, L.V41_528.num_scales, L.V41_528.scale_bytes) == (512, 16, 16)
    assert (L.V41_FP4_288.quant_bytes, L.V41_FP4_288.num_scales, L.V41_FP4_288.scale_bytes) == (256, 32, 32)
    for f in L.KV_FORMATS:
        assert f.data_bytes + f.scale_bytes == f.token_bytes
        assert f.quant_bytes + 2 * (L.HEAD_DIM - f.quant_dims) == f.data_bytes
        assert L.format_for_token_bytes(f.token_bytes) is f
    # vLLM's page sizes: 576-B pages for V4.0, 512-B pages for V4.1; interleaved pages are unpadded
    assert [L.page_bytes(64, f) for f in L.KV_FORMATS] == [37440, 33792, 18432]
    assert [L.page_bytes(2, f) for f in L.KV_FORMATS] == [1728, 1536, 1024]
    assert [L.page_bytes(5, L.interleaved(f)) for f in L.KV_FORMATS[1:]] == [5 * 528, 5 * 288]
    with pytest.raises(ValueError, match="no KV record format is 583 bytes"):
        L.format_for_token_bytes(583)
    with pytest.raises(ValueError, match="V40_584 records .* page-split only"):
        L.with_layout(L.V40_584, "interleaved")
    with pytest.raises(ValueError, match="kv_layout"):
        L.with_layout(L.V41_528, "blocked")
    assert hash(L.interleaved(L.V41_528)) != hash(L.V41_528) and L.interleaved(L.V41_528).name == "V41_528"


def test_the_fnuz_flavour_is_a_field_of_the_format():
    """``with_fnuz``: the same record with e4m3fnuz bytes (vLLM's gfx942 sliding-window cache), a value that
    differs from the OCP one only in its ``fp8`` field; only e4m3 formats with UE8M0 scales have it."""
    for f in (L.V40_584, L.V41_528, L.interleaved(L.V41_528)):
        z = L.with_fnuz(f)
        assert z != f and z._replace(fp8="e4m3fn") == f and z.name == f.name
        assert (z.fnuz, z.fp8_max, f.fnuz, f.fp8_max) == (True, 224.0, False, 448.0)
        assert L.with_fnuz(z, False) == f and L.valid_pair(z, f)       # vLLM on gfx942: FNUZ window, OCP extra
    for f in (L.V41_FP4_288, L.INDEXER_K_132):
        with pytest.raises(ValueError, match="no FNUZ flavour"):
            L.with_fnuz(f)
    with pytest.raises(ValueError, match="use_fnuz must be a bool"):
        L.with_fnuz(L.V40_584, 1)


# every format in every layout it has (V40_584's 584-byte records are page-split only)
LAYOUTS = [(n, lay) for n in sorted(KV) for lay in ("page_split", "interleaved") if KV[n].token_bytes % 16 == 0
           or lay == "page_split"]


@pytest.mark.parametrize("name,layout", LAYOUTS)
def test_record_addresses(name, layout):
    """Every record's data and scale bytes, by the layout's formula written out here, are where
    layout.token_byte_offsets and cache_views.record_byte_index put them; no two records overlap."""
    f = L.with_layout(KV[name], layout)
    bs = 7
    pb = L.page_bytes(bs, f)
    owner = torch.full((3 * pb,), -1)
    slots = torch.arange(3 * bs)
    data, scale = V.record_byte_index(slots, bs, pb, f)
    for s in slots.tolist():
        blk, o = divmod(s, bs)
        if layout == "interleaved":
            d, sc = blk * pb + o * f.token_bytes, blk * pb + o * f.token_bytes + f.data_bytes
        else:
            d, sc = blk * pb + o * f.data_bytes, blk * pb + bs * f.data_bytes + o * f.scale_bytes
        assert L.token_byte_offsets(s, bs, f) == (d, sc)
        assert int(data[s, 0]) == d and int(scale[s, 0]) == sc
        for a, n in ((d, f.data_bytes), (sc, f.scale_bytes)):
            assert bool((owner[a:a + n] == -1).all())
            owner[a:a + n] = s
    assert int((owner >= 0).sum()) == 3 * bs * f.token_bytes


def test_valid_pairs_are_flashmlas():
    pairs = {(a.name, b.name) for a in L.KV_FORMATS for b in L.KV_FORMATS if L.valid_pair(a, b)}
    assert pairs == {("V40_584", "V40_584"), ("V41_528", "V41_528"), ("V41_528", "V41_FP4_288")}
    assert L.valid_pair(L.interleaved(L.V41_528), L.interleaved(L.V41_FP4_288))


# ---- V41_528: UE8M0 fp8 per 32 -------------------------------------------------------------------------
def exact_exponent(amax):
    """ceil(log2(max(amax, 1e-4) / 448)) in float64 from the fp32 quotient (the writers' rule, as in vLLM)."""
    q = float(torch.tensor(max(amax, float(torch.tensor(1e-4))), dtype=torch.float32) / torch.tensor(448.0))
    m, e = math.frexp(q)
    return e - 1 if m == 0.5 else e


def test_v41_fp8_records_follow_the_rule():
    k = spread(40, seed=1)
    k[0, :32] = 0                                 # an all-zero block: amax floored at 1e-4
    k[1, 32:64] = -0.0
    rec = rc.encode_k_records(k, L.V41_528)
    assert rec.shape == (40, 528)
    x = k.float().reshape(40, 16, 32)
    for r in range(40):
        for b in range(16):
            e = exact_exponent(float(x[r, b].abs().max()))
            assert int(rec[r, 512 + b]) == e + 127
            want = (x[r, b] * 2.0 ** -e).to(torch.float8_e4m3fn).view(torch.uint8)
            want = torch.where(want == 0x80, torch.zeros_like(want), want)     # -0 is written 0x00
            assert torch.equal(rec[r, b * 32:(b + 1) * 32], want), (r, b)
    assert not bool((rec[:, :512] == 0x80).any())
    # the decode is exact: the dequantized values are bf16 values (fp8 value times a power of two)
    dec = rc.decode_k_records(rec, L.V41_528)
    assert torch.equal(dec, dec.bfloat16().float())
    want = rec[:, :512].view(torch.float8_e4m3fn).float().reshape(40, 16, 32) * torch.exp2(
        rec[:, 512:].float() - 127).unsqueeze(-1)
    assert torch.equal(dec, want.reshape(40, 512))
    rel = ((dec - k.float()).norm(dim=1) / k.float().norm(dim=1)).max()
    assert float(rel) < 0.05


def test_v41_scale_rule_differs_from_flashmlas_only_below_0_0448():
    """vLLM's writers (and ours) floor amax at 1e-4; FlashMLA's reference floors amax / 448 at 1e-4: the
    exponents agree from amax = 0.0448 up, and below it FlashMLA's scale stays at 2^-13."""
    amax = torch.cat([torch.logspace(-12, 3, 4000), torch.tensor([0.0, 1e-4, 0.0448, 0.04479, 448.0, 449.0])])
    amax = amax.bfloat16().float()
    ours, theirs = ue8m0_exponent(amax, 1e-4), flashmla_ue8m0_exponent(amax)
    big = amax >= 0.0448
    assert torch.equal(ours[big], theirs[big])
    assert bool((theirs[~big] == -13).all()) and bool((ours[~big] <= -13).all()) and bool((ours[~big] < -13).any())
    assert int(ours[amax == 0].item()) == -22


def test_v41_fp8_poisoned_blocks():
    k = spread(2, seed=2).float()
    k[0, 33], k[1, 511] = float("nan"), float("-inf")
    rec = rc.encode_k_records(k.bfloat16(), L.V41_528)
    assert int(rec[0, 513]) == 0xFF and bool((rec[0, 32:64] == 0x7F).all()) and int(rec[0, 512]) != 0xFF
    assert int(rec[1, 527]) == 0xFF and bool((rec[1, 480:512] == 0x7F).all())
    dec = rc.decode_k_records(rec, L.V41_528)
    assert bool(torch.isnan(dec[0, 32:64]).all()) and not bool(torch.isnan(dec[0, :32]).any())


# ---- V41_FP4_288: e2m1 + e4m3 per 16 -------------------------------------------------------------------
def e2m1_nearest_even(v):
    """The e2m1 code of one value by search: the nearest magnitude, a tie to the even code, |v| > 6 -> 6;
    the sign bit kept (-0 too)."""
    a = min(abs(v), 6.0)
    best = min(range(8), key=lambda c: (abs(a - E2M1_GRID[c]), c % 2))
    return best | (8 if math.copysign(1.0, v) < 0 else 0)


def test_fp4_codes_ties_saturation_and_sign():
    # block 0: amax = 6 sc, so the scale is sc and x / sc are the values: every midpoint (ties go to the even
    # code), values just off them, and signed zeros; block 1: amax / 6 = 1.0625 rounds (a tie) to the scale
    # 1.0, so its largest value is 6.375 scales and saturates at 6; block 2: the scale clamps at 448
    sc = 2.0 ** -3
    vals = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.2499, 0.2501, -0.25, -0.0, -0.1, -5.0, 0.5, 0.0]
    x = torch.zeros(3, 16)
    x[0] = torch.tensor(vals) * sc
    x[1, 0], x[1, 1] = 6.375, -6.375
    x[2, 0], x[2, 1] = 448.0 * 6 * 4, 448.0 * 2.75
    packed, sb = nvfp4_quantize(x.reshape(1, 48), 16)
    scales = sb[0].view(torch.float8_e4m3fn).float()
    assert scales.tolist() == [sc, 1.0, 448.0]
    codes = torch.stack([packed[0] & 0xF, packed[0] >> 4], -1).reshape(3, 16)
    for b in range(3):
        for i in range(16):
            assert int(codes[b, i]) == e2m1_nearest_even(float(x[b, i]) / float(scales[b])), (b, i)
    assert codes[0, 1:8].tolist() == [0, 2, 2, 4, 4, 6, 6]             # the midpoints: the even neighbour
    assert int(codes[0, 10]) == 0x8 and int(codes[0, 11]) == 0x8        # -0.25 (tie to 0) and -0 keep the sign
    assert codes[1, :2].tolist() == [0x7, 0xF] and codes[2, :2].tolist() == [0x7, 0x5]


def test_fp4_scales_follow_vllms_rule():
    g = torch.Generator().manual_seed(3)
    x = spread(64, seed=3, block=16, lo=-14, hi=10).float()
    x[0, :16] = 0                                                  # amax 0: scale clamped to 2^-9
    x[1, :16] = 448.0 * 6 * 4                                     # scale clamped to 448
    packed, sb = nvfp4_quantize(x, 16)
    amax = x.reshape(64, 32, 16).abs().amax(-1)
    want = (amax * torch.tensor(1.0 / 6.0)).clamp(2.0 ** -9, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(sb, want)
    assert int(sb[0, 0]) == 0x01 and int(sb[1, 0]) == 0x7E
    # for bf16 inputs the product with fp32(1/6) and FlashMLA's division amax / 6 pick the same e4m3 scale:
    # here, and for every positive finite bf16 amax
    assert torch.equal(want, (amax / 6.0).clamp(2.0 ** -9, 448.0).to(torch.float8_e4m3fn).view(torch.uint8))
    every = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    by_mul = (every * torch.tensor(1.0 / 6.0)).clamp(2.0 ** -9, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(by_mul, (every / 6.0).clamp(2.0 ** -9, 448.0).to(torch.float8_e4m3fn).view(torch.uint8))
    # codes: x / scale (IEEE division), nearest e2m1 with ties to even; decode exact
    s = sb.view(torch.float8_e4m3fn).float()
    y = (x.reshape(64, 32, 16) / s.unsqueeze(-1)).reshape(64, 512)
    codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(64, 512)
    for r in range(0, 64, 9):
        for c in range(0, 512, 7):
            assert int(codes[r, c]) == e2m1_nearest_even(float(y[r, c])), (r, c)
    dec = nvfp4_dequantize(packed, sb, 16)
    assert torch.equal(dec, dec.bfloat16().float())
    assert torch.equal(dec, torch.tensor(E2M1_GRID)[(codes & 7).long()] * torch.where(codes >= 8, -1.0, 1.0)
                       * s.repeat_interleave(16, 1))


def test_fp4_poisoned_blocks():
    x = spread(2, seed=4, block=16).float()
    x[0, 17], x[1, 0] = float("nan"), float("inf")
    packed, sb = nvfp4_quantize(x, 16)
    assert int(sb[0, 1]) == 0x7F and bool((packed[0, 8:16] == 0).all()) and int(sb[0, 0]) != 0x7F
    assert int(sb[1, 0]) == 0x7F and bool((packed[1, :8] == 0).all())
    dec = nvfp4_dequantize(packed, sb, 16)
    assert bool(torch.isnan(dec[0, 16:32]).all()) and not bool(torch.isnan(dec[0, :16]).any())


# ---- records in pages ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,layout", LAYOUTS)
def test_insert_gather_round_trip_in_both_layouts(name, layout):
    f = L.with_layout(KV[name], layout)
    bs, nb = 5, 4
    g = torch.Generator().manual_seed(5)
    pages = torch.randint(0, 256, (nb, L.page_bytes(bs, f)), generator=g, dtype=torch.uint8)
    before = pages.clone()
    k = spread(9, seed=6)
    slots = torch.tensor([0, 4, 5, 13, -1, 19, 7, 11, 2])
    rc.quantize_and_insert_k_cache(k, pages, slots, bs, f)
    rec = rc.encode_k_records(k, f)
    flat = pages.view(-1)
    written = torch.zeros_like(flat, dtype=torch.bool)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        d, sc = L.token_byte_offsets(s, bs, f)
        assert torch.equal(flat[d:d + f.data_bytes], rec[t, :f.data_bytes])
        assert torch.equal(flat[sc:sc + f.scale_bytes], rec[t, f.data_bytes:])
        written[d:d + f.data_bytes] = True
        written[sc:sc + f.scale_bytes] = True
    assert torch.equal(flat[~written], before.view(-1)[~written])
    got = rc.gather_k_records(pages, torch.tensor([13, 0, -1, 20]), bs, f)
    assert torch.equal(got[0], rec[3]) and torch.equal(got[1], rec[0]) and bool((got[2:] == 0).all())
    if layout == "interleaved":       # a dense interleaved cache is the page-split cache of one-record pages
        same = f._replace(interleaved=False, page_align=1)
        flat_pages = pages.view(nb * bs, f.token_bytes)
        assert torch.equal(rc.gather_k_records(flat_pages, torch.tensor([13, 0]), 1, same), got[:2])


# ---- FlashMLA's own quantizer -----------------------------------------------------------------------------
def _v41_checkout():
    path = os.environ.get("FLASHMLA_V41_DIR") or os.path.join(ROOT, ".peers", "FlashMLA-v41")
    return path if os.path.isfile(os.path.join(path, "tests", "quant.py")) else None


_AGAINST_FLASHMLA = textwrap.dedent("""
    import sys
    sys.path.insert(0, "gpu")
    import flashmla_cases_v41 as h
    lib, ref, quant, kk = h.load_flashmla(sys.argv[1])
    import torch
    from dsv4_rocm import layout as L
    from dsv4_rocm.reference import cache as rc
    from dsv4_rocm.reference.quant import ue8m0_exponent
    g = torch.Generator().manual_seed(0)
    nb, bs = 9, 7
    x = torch.randn(nb, bs, 1, 512, generator=g)
    x = (x * torch.exp2(torch.randint(-22, 8, (nb, bs, 1, 32), generator=g).float()).repeat_interleave(16, -1))
    x = x.bfloat16()
    x[0, 0, 0, :40] = 0.0
    x[0, 1, 0, 100] = float("nan")
    x[0, 2, 0, 300] = float("-inf")
    for lay, fmt in ((quant.KVCacheLayout.V41_FP8Sparse, L.V41_528), (quant.KVCacheLayout.V41_FP4Sparse, L.V41_FP4_288)):
        q = quant.quantize_k_cache(x, lay)
        theirs = q.view(torch.uint8).reshape(nb * bs, -1)
        ours = rc.encode_k_records(x.reshape(-1, 512), fmt)
        diff = theirs != ours
        if fmt is L.V41_528:
            # where they differ: a -0 (FlashMLA 0x80, ours 0x00), or a block whose amax is below 0.0448 (the
            # scale rule), or a poisoned block (FlashMLA: NaN bytes of x / NaN; ours 0x7F throughout)
            xb = x.reshape(-1, 16, 32).float()
            amax = xb.abs().amax(-1)
            bad = ~torch.isfinite(xb).all(-1)
            small = (amax < 0.0448) & ~bad
            for r, c in diff.nonzero().tolist():
                b = c - 512 if c >= 512 else c // 32
                ok = bool(small[r, b]) or bool(bad[r, b]) or (c < 512 and int(theirs[r, c]) == 0x80 and int(ours[r, c]) == 0)
                assert ok, (r, c, int(theirs[r, c]), int(ours[r, c]))
            print("fp8 differing bytes", int(diff.sum()), "of", diff.numel(), "small-amax blocks", int(small.sum()))
        else:
            # identical but in blocks holding NaN or inf, which we poison (scale NaN, nibbles 0); FlashMLA writes
            # a NaN block's scale NaN and its codes 0 with the sign of x / NaN, and reads inf as the largest
            # finite float (its nan_to_num): scale 448, inf -> +-6
            xb = x.reshape(-1, 32, 16).float()
            bad = ~torch.isfinite(xb).all(-1)
            for r, c in diff.nonzero().tolist():
                b = c - 256 if c >= 256 else c // 8
                assert bool(bad[r, b]), (r, c, int(theirs[r, c]), int(ours[r, c]))
            print("fp4 differing bytes", int(diff.sum()), "(poisoned blocks) of", theirs.numel())
        # FlashMLA's bytes through our decoder: FlashMLA's dequantized values, bit for bit (NaN as NaN)
        deq = quant.dequantize_k_cache(q, lay).reshape(-1, 512).float()
        mine = rc.decode_k_records(theirs, fmt).bfloat16().float()
        assert torch.equal(torch.nan_to_num(deq, 7.0), torch.nan_to_num(mine, 7.0))
    print("ok")
""")


def test_against_flashmlas_quantizer():
    path = _v41_checkout()
    if path is None:
        pytest.skip("no FlashMLA V4.1 test folder (FLASHMLA_V41_DIR or .peers/FlashMLA-v41): the cross-check is "
                    "optional")
    r = subprocess.run([sys.executable, "-c", _AGAINST_FLASHMLA, path], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=ROOT), timeout=600)
    print(r.stdout[-2000:], r.stderr[-3000:])
    assert r.returncode == 0 and r.stdout.strip().endswith("ok")
