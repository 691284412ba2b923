"""fp8_einsum (DeepGEMM's call form): "bhr,hdr->bhd" over fp8 operands with per-128 activation scales and
128x128 (or per-row) weight scales, fp32 or packed UE8M0; out written in place.

CPU: the oracle against the block-by-block formula; every scale form DeepGEMM and vLLM pass (fp32 and packed
int32, MN-major and K-major, per-128-rows and per-row weight scales, the [T, G, D] view of [G, T, D]
storage) gives the same output; the NaN policy; bad input; the Triton kernel under the interpreter (its
fp8 operands are decoded exactly there). GPU: the kernel against the oracle within the stated bound, on a
NaN-poisoned output buffer, every sweep tile, fp8_linear, and a graph-captured output path.

Bound of the kernel against the oracle (both rounded to bf16): the oracle sums exactly and rounds once; the
kernel sums each 128-deep block on the matrix units (Hopper's fp8 MMA adds with about 14 significant
bits) and the blocks in fp32. With S = sum_r |a_r w_r|, |z - z_ref| <= 2^-8 |z_ref| (the two bf16
roundings) + 2^-9 S (block sums: below 2^-10 S even if every add of every block rounded the same way).
"""
import textwrap

import pytest
import torch

from dsv4_rocm import ops
from dsv4_rocm.reference import output as O
from dsv4_rocm.reference.quant import e4m3_decode
from dsv4_rocm.reference.rope import build_cos_sin_cache
from helpers import run_interpreted


def _operands(T, G, n, r, seed, device="cpu"):
    """a8 [T, G, r] uint8 with fp32 scales [T, G, r/128], w8 [G, n, r] with fp32 scales [G, ceil(n/128), r/128]."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.exp2(torch.randint(-6, 6, (T * G, r // 128), generator=g).float()).repeat_interleave(128, -1)
    a8, sa = O.quantize_activation(torch.randn(T * G, r, generator=g) * spread)
    n128 = -(-n // 128) * 128
    w8, ws = O.quantize_weight(torch.randn(G, n128, r, generator=g) * r ** -0.5)
    return tuple(t.to(device) for t in (a8.view(T, G, r), sa.view(T, G, r // 128), w8[:, :n].contiguous(), ws))


def _formula(a8, sa, w8, ws):
    """sum over k-blocks of sa * sw * (a_blk . w_blk), float64, weight scales per 128 rows."""
    T, G, r = a8.shape
    n = w8.shape[1]
    a, w = e4m3_decode(a8.contiguous()).double(), e4m3_decode(w8.contiguous()).double()
    out = torch.zeros(T, G, n, dtype=torch.float64)
    for kb in range(r // 128):
        blk = slice(kb * 128, kb * 128 + 128)
        part = torch.einsum("tgr,gnr->tgn", a[..., blk], w[..., blk])
        sw = ws[:, :, kb].double().repeat_interleave(128, 1)[:, :n]
        out += part * sa[:, :, kb].double().unsqueeze(-1) * sw.unsqueeze(0)
    return out


def _abs_sum(a8, sa, w8, ws):
    a = (e4m3_decode(a8.contiguous()) * sa.float().repeat_interleave(128, -1)).abs().double()
    w = (e4m3_decode(w8.contiguous()) * ws.float().repeat_interleave(128, 1)[:, :w8.shape[1]].repeat_interleave(
        128, -1)).abs().double()
    return torch.einsum("tgr,gnr->tgn", a, w)


def _packed(scales_fp32):
    """fp32 powers of two [..., nb] -> UE8M0 words [..., ceil(nb/4)] (block 4i + j in byte j)."""
    b = ((scales_fp32.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    pad = (-b.shape[-1]) % 4
    b = torch.cat([b, torch.full((*b.shape[:-1], pad), 127, dtype=torch.uint8, device=b.device)], -1) if pad else b
    return b.contiguous().view(torch.int32)


def _mn_major(s):
    T, G, K = s.shape
    T4 = (T + 3) // 4 * 4
    store = torch.zeros(G, K, T4, dtype=s.dtype, device=s.device)
    store[:, :, :T] = s.permute(1, 2, 0)
    return store.as_strided((G, T, K), (K * T4, 1, T4)).transpose(0, 1)


def _g_t_d(a8):
    """a8 as vLLM passes it: a [T, G, D] view of [G, T, D] storage, float8_e4m3fn."""
    return a8.transpose(0, 1).contiguous().view(torch.float8_e4m3fn).transpose(0, 1)


@pytest.mark.parametrize("T, G, n, r", [(3, 2, 128, 256), (5, 1, 192, 384), (2, 4, 256, 128)])
def test_oracle_equals_the_blockwise_formula(T, G, n, r):
    a8, sa, w8, ws = _operands(T, G, n, r, T + n)
    want = _formula(a8, sa, w8, ws)
    d32 = torch.full((T, G, n), float("nan"))
    O.fp8_einsum("bhr,hdr->bhd", (a8, sa), (w8, ws), d32)
    torch.testing.assert_close(d32.double(), want, rtol=2 ** -22, atol=0)
    d16 = torch.full((T, G, n), float("nan"), dtype=torch.bfloat16)
    ops.fp8_einsum("bhr,hdr->bhd", (a8, sa), (w8, ws), d16)
    assert torch.equal(d16, d32.bfloat16())


def test_every_scale_form_gives_the_same_output():
    T, G, n, r = 6, 2, 256, 640                     # r/128 = 5 blocks: the last packed word is partial
    a8, sa, w8, ws = _operands(T, G, n, r, 7)
    base = torch.empty(T, G, n, dtype=torch.bfloat16)
    ops.fp8_einsum("bhr,hdr->bhd", (a8, sa), (w8, ws), base)
    per_row = ws.repeat_interleave(128, 1)[:, :n].contiguous()
    a_forms = {"fp32": (a8, sa), "fp32 MN-major": (_g_t_d(a8), _mn_major(sa)),
               "packed": (a8, _packed(sa)), "packed MN-major": (_g_t_d(a8), _mn_major(_packed(sa)))}
    w_forms = {"fp32 128x128": ((w8, ws), (1, 128, 128)),
               "fp8 dtype, K-major scales transposed view": ((w8.view(torch.float8_e4m3fn),
                                                             ws.transpose(1, 2).contiguous().transpose(1, 2)),
                                                            (1, 128, 128)),
               "fp32 per row": ((w8, per_row), (1, 1, 128)), "packed per row": ((w8, _packed(per_row)), (1, 1, 128))}
    for an, a in a_forms.items():
        for wn, (b, recipe) in w_forms.items():
            d = torch.full_like(base, float("nan"))
            assert ops.fp8_einsum("bhr,hdr->bhd", a, b, d, recipe=recipe) is None
            assert torch.equal(d, base), (an, wn)


def test_poisoned_blocks_give_nan_rows_and_columns():
    T, G, n, r = 4, 2, 128, 256
    a8, sa, w8, ws = _operands(T, G, n, r, 8)
    sa[1, 0, 1] = float("nan")                       # an activation block poisoned by the quantizer
    pa = _packed(sa)
    pa[2, 1, 0] |= 0xFF                              # UE8M0 0xFF in block 0 of token 2, group 1
    ws_bad = ws.clone()
    ws_bad[1, 0, 0] = float("nan")
    for scales, w_scales in ((sa, ws), (pa, ws), (sa, ws_bad)):
        d = torch.empty(T, G, n, dtype=torch.bfloat16)
        ops.fp8_einsum("bhr,hdr->bhd", (a8, scales), (w8, w_scales), d)
        nan = torch.isnan(d)
        want = torch.zeros_like(nan)
        want[1, 0] = True
        if scales.dtype == torch.int32:
            want[2, 1] = True
        if w_scales is ws_bad:
            want[:, 1, :] = True
        assert torch.equal(nan, want)


def test_decode_step_output_path_through_the_ops():
    """inverse RoPE + quant -> einsum as vLLM's o_proj chains them, against the float formula."""
    T, H, G, n = 3, 16, 2, 128
    g = torch.Generator().manual_seed(9)
    o = torch.randn(T, H, 512, generator=g).bfloat16()
    cs = build_cos_sin_cache(10000.0, 64)
    w8, ws = O.quantize_weight(torch.randn(G, n, H // G * 512, generator=g) * 0.05)
    a8, sa = ops.fused_inv_rope_fp8_quant(o, torch.tensor([1, 5, 63]), cs, G, H // G)
    z = torch.empty(T, G, n, dtype=torch.bfloat16)
    ops.fp8_einsum("bhr,hdr->bhd", (a8, sa), (w8, ws), z)
    assert torch.equal(z, _formula(a8.view(torch.uint8), sa, w8, ws).float().bfloat16())


def test_empty_batch_is_a_no_op():
    d = torch.empty(0, 2, 128, dtype=torch.bfloat16)
    ops.fp8_einsum("bhr,hdr->bhd", (torch.empty(0, 2, 256, dtype=torch.uint8), torch.empty(0, 2, 2)),
                   (torch.zeros(2, 128, 256, dtype=torch.uint8), torch.ones(2, 1, 2)), d)


def _bad_calls():
    a8, sa, w8, ws = _operands(2, 2, 128, 256, 10)
    d = torch.empty(2, 2, 128, dtype=torch.bfloat16)
    r100 = torch.zeros(2, 2, 100, dtype=torch.uint8)
    yield "r = 100", lambda: ops.fp8_einsum("bhr,hdr->bhd", (r100, torch.ones(2, 2, 1)),
                                            (torch.zeros(2, 128, 100, dtype=torch.uint8), torch.ones(2, 1, 1)), d)
    yield "expr", lambda: ops.fp8_einsum("bhd,hdr->bhr", (a8, sa), (w8, ws), d)
    yield "c", lambda: ops.fp8_einsum("bhr,hdr->bhd", (a8, sa), (w8, ws), d, c=d)
    yield "recipe", lambda: ops.fp8_einsum("bhr,hdr->bhd", (a8, sa), (w8, ws), d, recipe=(1, 128, 64))
    yield "recipe", lambda: ops.fp8_einsum("bhr,hdr->bhd", (a8, sa), (w8, ws), d, recipe=(128, 128, 128))
    yield "fp8 .d, sfd. output", lambda: ops.fp8_einsum("bhr,hdr->bhd", (a8, sa), (w8, ws), (d, sa))
    yield "a must be a", lambda: ops.fp8_einsum("bhr,hdr->bhd", a8, (w8, ws), d)
    yield "a must have dtype", lambda: ops.fp8_einsum("bhr,hdr->bhd", (a8.float(), sa), (w8, ws), d)
    yield "w must have shape", lambda: ops.fp8_einsum("bhr,hdr->bhd", (a8, sa), (w8[:1], ws[:1]), d)
    yield "a_scale must have shape", lambda: ops.fp8_einsum("bhr,hdr->bhd", (a8, sa[..., :1]), (w8, ws), d)
    yield "a_scale must have dtype", lambda: ops.fp8_einsum("bhr,hdr->bhd", (a8, sa.double()), (w8, ws), d)
    yield "w_scale must have shape", lambda: ops.fp8_einsum("bhr,hdr->bhd", (a8, sa), (w8, ws), d,
                                                            recipe=(1, 1, 128))
    yield "per row", lambda: ops.fp8_einsum("bhr,hdr->bhd", (a8, sa), (w8, _packed(ws)), d)
    yield "d must have shape", lambda: ops.fp8_einsum("bhr,hdr->bhd", (a8, sa), (w8, ws), d[:1])
    yield "d must have dtype", lambda: ops.fp8_einsum("bhr,hdr->bhd", (a8, sa), (w8, ws), d.half())
    yield "unit stride", lambda: ops.fp8_einsum("bhr,hdr->bhd", (a8, sa), (w8, ws), d.transpose(1, 2)
                                                .contiguous().transpose(1, 2))


@pytest.mark.parametrize("match, call", list(_bad_calls()), ids=[m for m, _ in _bad_calls()])
def test_bad_input_is_rejected_before_any_write(match, call):
    with pytest.raises(ValueError, match=match):
        call()


def test_rejected_call_writes_nothing():
    a8, sa, w8, ws = _operands(2, 2, 128, 256, 11)
    d = torch.full((2, 2, 128), 7.0, dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        ops.fp8_einsum("bhr,hdr->bhd", (a8, sa[..., :1]), (w8, ws), d)
    assert bool((d == 7.0).all())


def test_bench_sweep_checks_times_and_names_the_fastest_tile(capsys):
    """``bench.output._sweep`` (what ``python -m dsv4_rocm bench --only fp8_einsum --sweep`` runs per shape):
    each tile's output is checked against the default's before it is timed, a tile that fails to build or
    to match is reported and left out, and the fastest timed tile is named with its ratio to the peer."""
    from dsv4_rocm.bench.context import BenchContext
    from dsv4_rocm.bench.output import _sweep
    T, G, n, r = 4, 2, 128, 256
    a8, sa, w8, ws = _operands(T, G, n, r, 12)
    calls = []

    def einsum(expr, a, b, z, recipe, config=None):
        calls.append(config)
        if config is not None and config.get("fails"):
            raise RuntimeError("out of resources: shared memory")
        O.fp8_einsum(expr, a, b, z, recipe=recipe)
        if config is not None and config.get("wrong"):
            z[0, 0, 0] += 1.0
    times = iter([3e-3, 1e-3, 2e-3])
    sweep = {"slow": dict(BLOCK_M=64), "broken": dict(fails=True), "fast": dict(BLOCK_M=128),
             "mismatch": dict(wrong=True), "middle": dict(BLOCK_N=32)}
    ctx = BenchContext(device="cpu", bw=1e12, mm=1e15)
    z = torch.empty(T, G, n, dtype=torch.bfloat16)
    _sweep(ctx, "flash T=4", ((a8, sa), (w8, ws), (1, 128, 128)), z, lambda fn: (fn(), next(times))[1],
           2 * T * G * n * r, 1e6, 4e-3, 2e15, sweep, einsum, "/row")
    out = capsys.readouterr().out
    assert [row["config"] for row in ctx.rows] == ["slow/row", "fast/row", "middle/row"]
    assert [round(row["ratio"], 6) for row in ctx.rows] == [round(4 / 3, 6), 4.0, 2.0]
    assert "broken/row: skipped, RuntimeError: out of resources" in out
    assert "mismatch/row: skipped, max |z - default|" in out
    assert "flash T=4/row: fastest tile fast 1.0 us = 4.00x torch bf16 (4.0 us)" in out
    assert calls[0] is None                         # the default tile first


def test_sweep_tiles_are_well_formed():
    """Every sweep tile names a tile the kernel takes (powers of two, the split no wider than the k-blocks of
    the models' r = 4096) and is named after its tile."""
    from dsv4_rocm.triton.output.fp8_einsum import SWEEP
    allowed = {"BLOCK_M", "BLOCK_N", "GROUP_M", "SPLIT_K", "num_warps", "num_stages"}
    for name, cfg in SWEEP.items():
        assert set(cfg) <= allowed, name
        assert all(cfg[k] & (cfg[k] - 1) == 0 for k in ("BLOCK_M", "BLOCK_N", "num_warps")), name
        assert 1 <= cfg.get("SPLIT_K", 1) <= 32 and cfg["num_stages"] >= 2, name
        assert name.startswith(f"m{cfg['BLOCK_M']}n{cfg['BLOCK_N']}w{cfg['num_warps']}s{cfg['num_stages']}"), name


# ---- the Triton kernel ---------------------------------------------------------------------------------
_INTERPRETED = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    sys.path[:0] = ["tests", "tests/output"]
    from test_fp8_einsum import _operands, _packed, _mn_major, _g_t_d, _abs_sum
    from helpers import patch_interpreter_scalars
    from dsv4_rocm.reference import output as O
    from dsv4_rocm.triton.output import fp8_einsum as E

    patch_interpreter_scalars()                 # the split-K loop bounds are run-time values
    T, G, n, r = 70, 2, 192, 512
    a8, sa, w8, ws = _operands(T, G, n, r, 3)
    sa[5, 1, 2] = float("nan")
    per_row = ws.repeat_interleave(128, 1)[:, :n].contiguous()
    ref = torch.empty(T, G, n)
    O.fp8_einsum("bhr,hdr->bhd", (a8, sa), (w8, ws), ref)
    S = _abs_sum(a8, sa.nan_to_num(), w8, ws).float()
    forms = [((a8, sa), (w8, ws), 128), ((_g_t_d(a8), _mn_major(_packed(sa))), (w8, _packed(per_row)), 1),
             ((a8, _mn_major(sa)), (w8, per_row), 1)]
    # the third splits the 4 k-blocks 3 ways (2 + 2 + an empty split), twice: the counters reset themselves
    for cfg in (dict(BLOCK_M=32, BLOCK_N=64, GROUP_M=2), dict(BLOCK_M=16, BLOCK_N=128, GROUP_M=1),
                dict(BLOCK_M=32, BLOCK_N=64, GROUP_M=2, SPLIT_K=3), dict(BLOCK_M=32, BLOCK_N=64, GROUP_M=2, SPLIT_K=3)):
        for a, b, gran in forms:
            out = torch.full((T, G, n), float("nan"))
            E.fp8_einsum("bhr,hdr->bhd", a, b, out, recipe=(1, gran, 128), config=dict(cfg, num_warps=4))
            nan_ok = torch.equal(torch.isnan(out), torch.isnan(ref))
            fin = ~torch.isnan(ref)
            print(int(nan_ok), float(((out - ref).abs()[fin] / S[fin]).max()))

    # fp8_linear's activation quantizer: the oracle's bytes and scales exactly, on a strided x whose blocks
    # span 2^-10 .. 2^40, with zero, tiny, NaN and inf blocks (K = 640: a partial program of blocks). The
    # values are normal e4m3 values times a power of two per block, above the eps, so every fp8 cast is exact
    # (the interpreter does not round those casts like the hardware)
    g = torch.Generator().manual_seed(5)
    spread = torch.exp2(torch.randint(-10, 40, (9, 5), generator=g).float()).repeat_interleave(128, -1)
    b = torch.randint(0, 256, (9, 640), generator=g, dtype=torch.uint8)
    b = torch.where((b & 0x78) == 0, b | 0x08, b)
    b = torch.where((b & 0x7F) == 0x7F, b & 0xF7, b)
    x = (b.view(torch.float8_e4m3fn).float() * spread).bfloat16()
    x[1, :128] = 0
    x[2, 128:256] = 1e-30
    x[3, 300] = float("nan")
    x[4, 600] = float("-inf")
    big = torch.zeros(9, 1000, dtype=torch.bfloat16)
    big[:, 7:647] = x
    xs = big[:, 7:647]
    q, sc = O.quantize_activation(xs)
    w8, ws = O.quantize_weight(torch.randn(128, 640, generator=g))
    got = {}
    E._quantize_activation_kernel[(9, 2)](xs, xs.stride(0), xs.stride(1), got.setdefault("q", torch.empty(9, 640, dtype=torch.uint8)),
                                          got.setdefault("s", torch.full((9, 5), 7.0)), 5, NB=E.QUANT_BLOCKS, FNUZ=False)
    poisoned = sc.masked_fill(torch.isinf(sc), float("nan"))      # the kernel writes a poisoned scale as NaN
    print(int(torch.equal(got["q"], q)), int(torch.allclose(got["s"], poisoned, rtol=0, atol=0, equal_nan=True)))
    y = E.fp8_linear(xs, w8, ws)
    y2 = E.fp8_linear(x.contiguous(), w8, ws)
    print(int(torch.equal(y.view(torch.int16), y2.view(torch.int16))), int(bool(torch.isnan(y[3]).all())))
""")


def test_kernel_equals_the_oracle_under_the_interpreter(tmp_path):
    """Indexing, masking of partial tiles, the tile order, scale decoding (packed, per row, MN-major), the
    NaN row and the split-K reduction, with the fp8 operands decoded exactly: fp32 sums of exact products,
    so the error is fp32 rounding of the block sums only (far below 2^-16 of S). fp8_linear's activation
    quantizer gives the oracle's bytes and scales."""
    r = run_interpreted(_INTERPRETED, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line.split() for line in r.stdout.strip().splitlines()]
    print("\n".join(" ".join(x) for x in rows))
    assert len(rows) == 14 and all(x[0] == "1" and float(x[1]) < 2 ** -16 for x in rows[:12])
    assert rows[12] == ["1", "1"], "activation quantizer bytes / scales differ from the oracle's"
    assert rows[13] == ["1", "1"], "fp8_linear on a strided x, or its NaN row"


def _check_bound(z, ref, S, what):
    fin = torch.isfinite(ref)
    err = (z.double() - ref.double()).abs()
    ratio = float((err[fin] - 2 ** -8 * ref.double().abs()[fin]).clamp(min=0).div(S[fin].clamp(min=1e-30)).max())
    print(f"{what}: max |z - ref| {float(err[fin].max()):.3g}, excess over 2^-8|ref| / S {ratio:.3g} "
          f"(bound 2^-9 = {2 ** -9:.3g})")
    assert torch.equal(torch.isfinite(z), fin)
    assert ratio <= 2 ** -9


@pytest.mark.gpu
@pytest.mark.parametrize("T, G, n", [(1, 8, 1024), (77, 8, 1024), (128, 16, 1024), (1000, 8, 1024), (300, 2, 192)])
@pytest.mark.parametrize("form", ["fp32", "packed per row"])
def test_gpu_kernel_within_the_bound_of_the_oracle(T, G, n, form, gpu):
    r = 4096 if n == 1024 else 640
    a8, sa, w8, ws = _operands(T, G, n, r, T + G, gpu)
    sa[0, 0, 3] = float("nan")
    w8[G - 1, n - 1, :: 7] = 0x80               # -0 weight bytes, read as they are through fp8 pointers
    if form == "fp32":
        a, b, recipe = (_g_t_d(a8), _mn_major(sa)), (w8.view(torch.float8_e4m3fn), ws), (1, 128, 128)
    else:
        per_row = ws.repeat_interleave(128, 1)[:, :n].contiguous()
        a, b, recipe = (_g_t_d(a8), _mn_major(_packed(sa))), (w8, _packed(per_row)), (1, 1, 128)
    z = torch.full((T, G, n), float("nan"), dtype=torch.bfloat16, device=gpu)
    with ops.use_backend("triton"):
        ops.fp8_einsum("bhr,hdr->bhd", a, b, z, recipe=recipe)
    ref = torch.empty_like(z)
    O.fp8_einsum("bhr,hdr->bhd", (a8, sa), (w8, ws), ref)
    _check_bound(z.cpu(), ref.cpu(), _abs_sum(a8.cpu(), sa.cpu().nan_to_num(), w8.cpu(), ws.cpu()),
                 f"T={T} G={G} n={n} {form}")


@pytest.mark.gpu
def test_gpu_every_sweep_tile_is_correct(gpu):
    from dsv4_rocm.triton.output.fp8_einsum import SWEEP, fp8_einsum
    T, G, n, r = 200, 4, 1024, 1024
    a8, sa, w8, ws = _operands(T, G, n, r, 5, gpu)
    ref = torch.empty(T, G, n, dtype=torch.bfloat16, device=gpu)
    O.fp8_einsum("bhr,hdr->bhd", (a8, sa), (w8, ws), ref)
    S = _abs_sum(a8.cpu(), sa.cpu(), w8.cpu(), ws.cpu())
    for name, cfg in SWEEP.items():
        z = torch.full_like(ref, float("nan"))
        fp8_einsum("bhr,hdr->bhd", (a8, sa), (w8, ws), z, config=cfg)
        _check_bound(z.cpu(), ref.cpu(), S, name)


@pytest.mark.gpu
def test_gpu_fp8_linear(gpu):
    g = torch.Generator().manual_seed(6)
    x = torch.randn(33, 1024, generator=g).bfloat16().to(gpu)
    w8, ws = O.quantize_weight(torch.randn(384, 1024, generator=g) * 1024 ** -0.5)
    w8, ws = w8.to(gpu), ws.to(gpu)
    with ops.use_backend("triton"):
        y = ops.fp8_linear(x, w8, ws)
    q, s = O.quantize_activation(x)
    S = _abs_sum(q.view(33, 1, 1024).cpu(), s.view(33, 1, 8).cpu(), w8.unsqueeze(0).cpu(), ws.unsqueeze(0).cpu())
    _check_bound(y.view(33, 1, 384).cpu(), O.fp8_linear(x, w8, ws).view(33, 1, 384).cpu(), S, "fp8_linear")


@pytest.mark.gpu
def test_gpu_output_path_replays_from_a_cuda_graph(gpu):
    """A decode step's output path (inverse RoPE + quant, then the einsum into a fixed buffer) captured once,
    replayed with new attention outputs and positions, against the oracle."""
    T, H, G, n = 128, 64, 8, 1024
    g = torch.Generator().manual_seed(8)
    cs = build_cos_sin_cache(10000.0, 4096, device=gpu)
    w8, ws = O.quantize_weight(torch.randn(G, n, 4096, generator=g) * 4096 ** -0.5)
    w8, ws = w8.view(torch.float8_e4m3fn).to(gpu), ws.to(gpu)
    o = torch.randn(T, H, 512, generator=g).bfloat16().to(gpu)
    pos = torch.arange(T, device=gpu)
    z = torch.full((T, G, n), float("nan"), dtype=torch.bfloat16, device=gpu)

    def step():
        a8, sa = ops.fused_inv_rope_fp8_quant(o, pos, cs, G, H // G)
        ops.fp8_einsum("bhr,hdr->bhd", (a8, sa), (w8, ws), z)

    with ops.use_backend("triton"):
        step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    for seed in (1, 2):
        gg = torch.Generator().manual_seed(seed)
        o.copy_(torch.randn(T, H, 512, generator=gg).bfloat16())
        pos.copy_(torch.randint(0, 4096, (T,), generator=gg))
        z.fill_(float("nan"))
        graph.replay()
        a8, sa = O.fused_inv_rope_fp8_quant(o, pos, cs, G, H // G)
        ref = torch.empty_like(z)
        O.fp8_einsum("bhr,hdr->bhd", (a8, sa), (w8, ws), ref)
        _check_bound(z.cpu(), ref.cpu(), _abs_sum(a8.view(torch.uint8).cpu(), sa.cpu(), w8.view(torch.uint8).cpu(),
                                                  ws.cpu()), f"graph replay {seed}")


@pytest.mark.gpu
def test_gpu_split_k_is_deterministic_and_replays(gpu):
    """The split-K reduction: the same bits on every call (partials added in split order, whichever program
    finishes last), eagerly and replayed from a graph (the counters reset themselves)."""
    from dsv4_rocm.triton.output.fp8_einsum import fp8_einsum
    T, G, n, r = 128, 8, 1024, 4096
    a8, sa, w8, ws = _operands(T, G, n, r, 9, gpu)
    ref = torch.empty(T, G, n, dtype=torch.bfloat16, device=gpu)
    O.fp8_einsum("bhr,hdr->bhd", (a8, sa), (w8, ws), ref)
    S = _abs_sum(a8.cpu(), sa.cpu(), w8.cpu(), ws.cpu())
    cfg = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, SPLIT_K=4)
    z = torch.full_like(ref, float("nan"))
    fp8_einsum("bhr,hdr->bhd", (a8, sa), (w8, ws), z, config=cfg)
    _check_bound(z.cpu(), ref.cpu(), S, "split 4")
    first = z.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp8_einsum("bhr,hdr->bhd", (a8, sa), (w8, ws), z, config=cfg)
    for _ in range(3):
        z.fill_(float("nan"))
        fp8_einsum("bhr,hdr->bhd", (a8, sa), (w8, ws), z, config=cfg)
        assert torch.equal(z, first)
        z.fill_(float("nan"))
        graph.replay()
        assert torch.equal(z, first)
