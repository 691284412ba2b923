"""The indexer-K cache ops in vLLM's call forms: indexer_k_quant_and_cache(k, kv_cache, slot_mapping,
quant_block_size, scale_fmt) and cp_gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale, block_table,
cu_seq_lens).

CPU: the writer against brute force (value by value) on every cache view in both scale forms ("ue8m0":
fp32 2^e; "mxfp8": four UE8M0 bytes), padding slots and DP padding, the NaN policy, vLLM's torch.ops
schemas, bad input rejected before any byte changes; the gather against a hand loop, rows no request covers
left alone, both dst_scale forms; the writer (both scale forms) and the gather kernel under the Triton
interpreter. GPU: both Triton kernels write exactly the oracle's bytes, garbage slots and block tables
included.
"""
import math
import textwrap

import pytest
import torch

from dsv4_rocm import ops
from dsv4_rocm.reference import indexer as ri
from helpers import every_cache_view, page_records
from indexer_inputs import filled_cache, interpret

VIEWS = ["vllm_3d", "flashmla_4d", "unpadded_3d", "fp8_3d"]   # the 3-D / 4-D views; bs comes from shape[1]


def f32(v):
    return torch.tensor(v, dtype=torch.float32)


def brute_record(row, scale_fmt="ue8m0"):
    """132 bytes of one k row: e4m3 of row * 2^-e, then the fp32 2^e ("ue8m0") or the byte e + 127 four times
    ("mxfp8"); bytes 0x7F and scale NaN (0xFF bytes) for a non-finite row."""
    x = row.float()
    if not bool(torch.isfinite(x).all()):
        scale = torch.full((4,), 0xFF, dtype=torch.uint8) if scale_fmt == "mxfp8" else \
            torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.uint8)
        return torch.cat([torch.full((128,), 0x7F, dtype=torch.uint8), scale])
    m, e = math.frexp(float(f32(max(float(x.abs().max()), 1e-4)) / f32(448.0)))
    e = e - 1 if m == 0.5 else e
    q = torch.stack([(v * f32(2.0 ** -e)).to(torch.float8_e4m3fn).view(torch.uint8) for v in x])
    q[q == 0x80] = 0
    if scale_fmt == "mxfp8":
        return torch.cat([q, torch.full((4,), e + 127, dtype=torch.uint8)])
    return torch.cat([q, f32(2.0 ** e).reshape(1).view(torch.uint8)])


def _k(n, g, dtype=torch.bfloat16):
    return (torch.randn(n, 128, generator=g) * torch.exp2(torch.randint(-12, 12, (n, 1), generator=g))).to(dtype)


# ---- writer ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scale_fmt", ["ue8m0", "mxfp8"])
@pytest.mark.parametrize("view", VIEWS)
def test_writer_matches_brute_force_on_every_view(view, scale_fmt):
    g = torch.Generator().manual_seed(1)
    v, backing = every_cache_view(3, 32, record=132, seed=2)[view]
    before = backing.clone()
    k = _k(6, g)
    k[4, 17] = float("nan")
    k[5, 0] = float("-inf")
    slots = torch.tensor([33, -1, 0, 95, 40, 7])
    ops.indexer_k_quant_and_cache(k, v, slots, 128, scale_fmt)
    rec, old = page_records(backing, 32, 132), page_records(before, 32, 132)
    changed = torch.zeros_like(rec, dtype=torch.bool)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        p, o = divmod(s, 32)
        want = brute_record(k[t], scale_fmt)
        assert torch.equal(rec[p, o * 128:o * 128 + 128], want[:128]), t
        assert torch.equal(rec[p, 32 * 128 + o * 4:32 * 128 + o * 4 + 4], want[128:]), t
        changed[p, o * 128:o * 128 + 128] = True
        changed[p, 32 * 128 + o * 4:32 * 128 + o * 4 + 4] = True
    assert torch.equal(rec[~changed], old[~changed])                 # padding slot -1 and the rest: untouched
    assert torch.equal(backing[:, 32 * 132:], before[:, 32 * 132:])   # page padding never written


def test_writer_takes_the_first_len_slot_mapping_rows_and_any_float_dtype():
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        k = _k(5, g, dtype)
        a = torch.zeros(2, 64, 132, dtype=torch.uint8)
        ops.indexer_k_quant_and_cache(k, a, torch.tensor([3, 64]), 128, "ue8m0")      # rows 2..4: DP padding
        b = torch.zeros(2, 64, 132, dtype=torch.uint8)
        torch.ops.dsv4_rocm.indexer_k_quant_and_cache(k[:2], b, torch.tensor([3, 64]), 128, "ue8m0")
        assert torch.equal(a, b) and int((a != 0).sum()) > 0
        flat = a.view(2, -1)
        assert torch.equal(flat[0, 3 * 128:4 * 128], brute_record(k[0])[:128])


def test_mxfp8_scales_are_the_ue8m0_scales_exponent_bytes_through_the_gather():
    """vLLM's "mxfp8" scale form: the same fp8 bytes as "ue8m0", and four equal scale bytes b whose UE8M0 value
    2^(b - 127) is the fp32 scale "ue8m0" writes; the gather returns them as written."""
    g = torch.Generator().manual_seed(11)
    k = _k(40, g)
    slots = torch.randperm(3 * 16, generator=g)[:40]
    caches = {}
    for fmt in ("ue8m0", "mxfp8"):
        caches[fmt] = torch.randint(0, 256, (3, 16, 132), generator=g, dtype=torch.uint8)
        ops.indexer_k_quant_and_cache(k, caches[fmt], slots, 128, fmt)
    bt = torch.arange(3, dtype=torch.int32).unsqueeze(0)
    cu = torch.tensor([0, 48], dtype=torch.int32)
    got = {}
    for fmt, cache in caches.items():
        dk, ds = torch.zeros(48, 128, dtype=torch.float8_e4m3fn), torch.zeros(48, 4, dtype=torch.uint8)
        ops.cp_gather_indexer_k_quant_cache(cache, dk, ds, bt, cu)
        got[fmt] = dk.view(torch.uint8)[slots], ds[slots]
    assert torch.equal(got["mxfp8"][0], got["ue8m0"][0])
    mx = got["mxfp8"][1]
    assert torch.equal(mx, mx[:, :1].expand(-1, 4))
    assert torch.equal((mx[:, 0].int() << 23).view(torch.float32), got["ue8m0"][1].view(torch.float32).view(-1))
    assert len(set(mx[:, 0].tolist())) > 5                           # a spread of exponents


def _writer_bad_calls(k, cache, slots):
    return [
        ("quant_block_size", lambda: ops.indexer_k_quant_and_cache(k, cache, slots, 64, "ue8m0")),
        ("scale_fmt", lambda: ops.indexer_k_quant_and_cache(k, cache, slots, 128, None)),
        ("scale_fmt", lambda: ops.indexer_k_quant_and_cache(k, cache, slots, 128, "fp32")),
        ("scale_fmt", lambda: ops.indexer_k_quant_and_cache(k, cache, slots, 128, "MXFP8")),
        ("quant_block_size", lambda: ops.indexer_k_quant_and_cache(k, cache, slots, 32, "mxfp8")),
        ("k must have shape", lambda: ops.indexer_k_quant_and_cache(k[:, :64], cache, slots, 128, "ue8m0")),
        ("k must have dtype", lambda: ops.indexer_k_quant_and_cache(k.int(), cache, slots, 128, "ue8m0")),
        ("outside the cache", lambda: ops.indexer_k_quant_and_cache(k, cache, slots + 120, 128, "ue8m0")),
        ("slot_mapping has 5 entries", lambda: ops.indexer_k_quant_and_cache(k[:3], cache, slots, 128, "ue8m0")),
        ("slot_mapping must have dtype", lambda: ops.indexer_k_quant_and_cache(k, cache, slots.float(), 128, "ue8m0")),
        ("kv_cache must be the indexer-K cache", lambda: ops.indexer_k_quant_and_cache(k, cache.view(2, -1), slots,
                                                                                       128, "ue8m0")),
        ("kv_cache", lambda: ops.indexer_k_quant_and_cache(k, cache[..., :130], slots, 128, "ue8m0")),
    ]


def test_writer_rejects_bad_input_without_writing():
    g = torch.Generator().manual_seed(4)
    k = _k(5, g)
    cache = torch.randint(0, 256, (2, 64, 132), generator=g, dtype=torch.uint8)
    before = cache.clone()
    for match, call in _writer_bad_calls(k, cache, torch.tensor([0, 5, -1, 127, 64])):
        with pytest.raises(ValueError, match=match):
            call()
        assert torch.equal(cache, before), match


# ---- gather ------------------------------------------------------------------------------------------------
def hand_gather(kv, bt, cu, T):
    """(dst bytes [T, 128], scale bytes [T, 4], written [T]) by a loop over requests and their entries."""
    bs = kv.shape[1]
    pages = torch.as_strided(kv.view(torch.uint8), (kv.shape[0], bs * 132), (kv.stride(0), 1))
    dk, ds = torch.zeros(T, 128, dtype=torch.uint8), torch.zeros(T, 4, dtype=torch.uint8)
    written = torch.zeros(T, dtype=torch.bool)
    for b in range(bt.shape[0]):
        for j in range(int(cu[b + 1]) - int(cu[b])):
            t = int(cu[b]) + j
            p, o = int(bt[b, j // bs]), j % bs
            dk[t] = pages[p, o * 128:o * 128 + 128]
            ds[t] = pages[p, bs * 128 + o * 4:bs * 128 + o * 4 + 4]
            written[t] = True
    return dk, ds, written


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("fp32_scale", [False, True])
def test_gather_matches_a_hand_loop(index_dtype, fp32_scale):
    g = torch.Generator().manual_seed(5)
    lens = [70, 0, 33, 128, 1]
    _, kv, bt, _ = filled_cache(lens, 32, g)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=index_dtype)
    T = sum(lens) + 9                                      # rows past cu[-1]: a workspace larger than the chunk
    dst_k = torch.full((T, 128), 0xAB, dtype=torch.uint8).view(torch.float8_e4m3fn)
    dst_s = torch.full((T, 4), 0xAB, dtype=torch.uint8)
    dst_s = dst_s.view(torch.float32).view(T) if fp32_scale else dst_s
    ops.cp_gather_indexer_k_quant_cache(kv, dst_k, dst_s, bt.to(index_dtype), cu)
    dk, ds, written = hand_gather(kv, bt, cu, T)
    sbytes = dst_s.view(torch.uint8).view(T, 4)
    assert torch.equal(dst_k.view(torch.uint8)[written], dk[written]) and torch.equal(sbytes[written], ds[written])
    assert (dst_k.view(torch.uint8)[~written] == 0xAB).all() and int((~written).sum()) == 9
    assert (sbytes[~written] == 0xAB).all()


def test_gather_in_vllms_form_and_schema():
    g = torch.Generator().manual_seed(6)
    _, kv, bt, keys = filled_cache([40, 90], 64, g)
    k_quant = torch.empty(130, 128, dtype=torch.float8_e4m3fn)
    k_scale = torch.empty(130, 4, dtype=torch.uint8)
    cu = torch.tensor([0, 40, 130], dtype=torch.int32)
    torch.ops.dsv4_rocm.cp_gather_indexer_k_quant_cache(kv, k_quant, k_scale, bt, cu)
    ref = torch.stack([brute_record(r) for r in keys])             # the keys the cache was written with
    assert torch.equal(k_quant.view(torch.uint8), ref[:, :128]) and torch.equal(k_scale, ref[:, 128:])


def test_gather_rejects_bad_input_without_writing():
    g = torch.Generator().manual_seed(7)
    _, kv, bt, _ = filled_cache([40, 90], 64, g)
    dst_k = torch.zeros(130, 128, dtype=torch.float8_e4m3fn)
    dst_s = torch.zeros(130, 4, dtype=torch.uint8)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)                 # noqa: E731
    neg = bt.clone()
    neg[1, 1] = -1
    calls = [
        ("cu_seq_lens must be non-decreasing", lambda: ops.cp_gather_indexer_k_quant_cache(kv, dst_k, dst_s, bt,
                                                                                           i32(0, 50, 40))),
        ("cu_seq_lens must be non-decreasing", lambda: ops.cp_gather_indexer_k_quant_cache(kv, dst_k, dst_s, bt,
                                                                                           i32(0, 40, 131))),
        ("cu_seq_lens must be non-decreasing", lambda: ops.cp_gather_indexer_k_quant_cache(kv, dst_k, dst_s, bt,
                                                                                           i32(-1, 40, 130))),
        ("cu_seq_lens must have shape", lambda: ops.cp_gather_indexer_k_quant_cache(kv, dst_k, dst_s, bt, i32(0, 40))),
        ("negative entry", lambda: ops.cp_gather_indexer_k_quant_cache(kv, dst_k, dst_s, neg, i32(0, 40, 130))),
        ("names a page", lambda: ops.cp_gather_indexer_k_quant_cache(kv, dst_k, dst_s, bt + 100, i32(0, 40, 130))),
        ("block_table has 2 columns", lambda: ops.cp_gather_indexer_k_quant_cache(kv, dst_k, dst_s, bt,
                                                                                  i32(0, 0, 130))),
        ("dst_scale", lambda: ops.cp_gather_indexer_k_quant_cache(kv, dst_k, dst_s[:, :2], bt, i32(0, 40, 130))),
        ("dst_k must have shape", lambda: ops.cp_gather_indexer_k_quant_cache(kv, dst_k[:, :64], dst_s, bt,
                                                                              i32(0, 40, 130))),
        ("dst_k must have dtype", lambda: ops.cp_gather_indexer_k_quant_cache(kv, dst_k.float(), dst_s, bt,
                                                                              i32(0, 40, 130))),
    ]
    for match, call in calls:
        with pytest.raises(ValueError, match=match):
            call()
        assert not dst_k.view(torch.uint8).any() and not dst_s.any(), match


_INTERPRETED_GATHER = textwrap.dedent("""
    import os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from dsv4_rocm.reference import indexer as ri
    from dsv4_rocm.reference.compressor import kv_cache_view
    from dsv4_rocm.triton.indexer.cp_gather_indexer_k_quant_cache import cp_gather_indexer_k_quant_cache

    g = torch.Generator().manual_seed(0)
    for bs, lens in ((32, [70, 0, 33, 5]), (64, [1]), (16, [20, 3, 0, 0, 40, 17, 2])):
        need = [-(-n // bs) for n in lens]
        nb = sum(need) + 2
        pages = torch.randint(0, 256, (nb, bs * 132 + 16), generator=g, dtype=torch.uint8)
        kv = kv_cache_view(pages, bs, 132)
        bt = torch.randint(0, nb, (len(lens), max(need) + 1), generator=g, dtype=torch.int32)
        bt[0, 1] = -1                                 # an invalid page inside request 0: zero bytes
        bt[-1, 0] = nb + 3                            # a page past the cache: zero bytes
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
        T = sum(lens) + 5
        outs = []
        for fn in (ri.cp_gather_indexer_k_quant_cache, cp_gather_indexer_k_quant_cache):
            dk = torch.full((T, 128), 0xAB, dtype=torch.uint8)
            ds = torch.full((T, 4), 0xCD, dtype=torch.uint8)
            fn(kv, dk, ds, bt, cu)
            outs.append((dk, ds))
        print(bs, int((outs[0][0] != outs[1][0]).sum()), int((outs[0][1] != outs[1][1]).sum()),
              int((outs[1][0] == 0xAB).all(1).sum()))
""")


def test_gather_kernel_under_the_interpreter(tmp_path):
    """The gather kernel's bytes (integer work only) equal the oracle's, invalid pages and uncovered rows
    included."""
    r = interpret(_INTERPRETED_GATHER, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    print(r.stdout)
    rows = [line.split() for line in r.stdout.strip().splitlines()]
    assert len(rows) == 3 and all(x[1] == "0" and x[2] == "0" and x[3] == "5" for x in rows)


_INTERPRETED_WRITER = textwrap.dedent("""
    import os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from dsv4_rocm.reference import indexer as ri
    from dsv4_rocm.reference.compressor import kv_cache_view
    from dsv4_rocm.triton.indexer.indexer_k_quant_and_cache import indexer_k_quant_and_cache

    g = torch.Generator().manual_seed(0)
    # rows of normal e4m3 values times a power of two: every fp8 cast is exact, even in the interpreter
    b = torch.randint(0, 256, (50, 128), generator=g, dtype=torch.uint8)
    b = torch.where((b & 0x78) == 0, b | 0x08, b)
    b = torch.where((b & 0x7F) == 0x7F, b & 0xF7, b)
    k = (b.view(torch.float8_e4m3fn).float() * torch.exp2(torch.randint(-20, 10, (50, 1), generator=g).float()))
    k = k.bfloat16()
    k[3, 5] = float("nan")
    for bs, fmt in ((64, "ue8m0"), (16, "ue8m0"), (64, "mxfp8"), (16, "mxfp8")):
        pages = torch.randint(0, 256, (60, bs * 132 + 32), generator=g, dtype=torch.uint8)
        ref = pages.clone()
        slots = torch.randperm(60 * bs, generator=g)[:50]
        slots[::5] = -1
        slots[7] = 60 * bs + 3                            # past the cache: skipped
        indexer_k_quant_and_cache(k, kv_cache_view(pages, bs, 132), slots, 128, fmt)
        ri.indexer_k_quant_and_cache(k, kv_cache_view(ref, bs, 132), torch.where(slots < 60 * bs, slots, -1), 128,
                                     fmt)
        print(bs, fmt, int((pages != ref).sum()))
""")


def test_writer_kernel_under_the_interpreter(tmp_path):
    """The writer kernel's addressing, exponents, scales, poisoning and skipped slots equal the oracle's, on
    rows whose fp8 casts are exact (the interpreter does not round like the hardware otherwise)."""
    r = interpret(_INTERPRETED_WRITER, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    print(r.stdout)
    assert [line.split() for line in r.stdout.strip().splitlines()] == [
        ["64", "ue8m0", "0"], ["16", "ue8m0", "0"], ["64", "mxfp8", "0"], ["16", "mxfp8", "0"]]


# ---- GPU: the Triton kernels against the oracle ------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("scale_fmt", ["ue8m0", "mxfp8"])
@pytest.mark.parametrize("view", VIEWS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_writer_bytes_equal_the_oracle(view, dtype, scale_fmt):
    g = torch.Generator().manual_seed(8)
    v, backing = every_cache_view(40, 64, record=132, seed=9)[view]
    k = _k(3000, g, dtype)
    k[11, 3] = float("nan")
    k[12, 100] = float("inf")
    slots = torch.randperm(40 * 64, generator=g)[:3000]
    slots[::7] = -1                                         # padding
    slots[5::97] = 40 * 64 + 11                             # past the cache: skipped (value checks are off)
    gv, gb = every_cache_view(40, 64, record=132, seed=9, device="cuda")[view]
    with ops.use_backend("triton"):
        ops.indexer_k_quant_and_cache(k.cuda(), gv, slots.cuda(), 128, scale_fmt)
    ri.indexer_k_quant_and_cache(k, v, torch.where(slots < 40 * 64, slots, -1), 128, scale_fmt)
    torch.cuda.synchronize()
    assert torch.equal(gb.cpu(), backing)


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [64, 32, 16])
def test_triton_gather_bytes_equal_the_oracle(bs):
    g = torch.Generator().manual_seed(10)
    lens = [int(x) for x in torch.randint(0, 3000, (37,), generator=g)]
    lens[3] = 0
    pages, kv, bt, _ = filled_cache(lens, bs, g)
    bt[1, 0] = -1                                           # garbage inside request 1 (value checks are off)
    bt[2, 0] = pages.shape[0] + 5
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    T = sum(lens) + 100
    dk, ds = torch.full((T, 128), 0xAB, dtype=torch.uint8), torch.full((T, 4), 0xCD, dtype=torch.uint8)
    ri.cp_gather_indexer_k_quant_cache(kv, dk, ds, bt, cu)
    gdk, gds = dk.clone().fill_(0xAB).cuda(), ds.clone().fill_(0xCD).cuda()
    gkv = torch.as_strided(pages.cuda(), kv.shape, kv.stride())
    with ops.use_backend("triton"):
        ops.cp_gather_indexer_k_quant_cache(gkv, gdk.view(torch.float8_e4m3fn), gds, bt.cuda(), cu.cuda())
    torch.cuda.synchronize()
    assert torch.equal(gdk.cpu(), dk) and torch.equal(gds.cpu(), ds)
