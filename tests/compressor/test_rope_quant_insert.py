"""DeepSeek-V4.1 compressor, second half (rope_quant_insert): the oracle against the record written out by
hand and against the V4.0 record writer, padding and rejected calls; the V4.1 records (the cache's last
dim 528 or 288 names them, as vLLM's op dispatches) against vLLM's rule written out here, in both page
layouts; vLLM's plain-row caches (bf16 and per-tensor e4m3 [nb, bs, 512] rows, the FlashInfer form) against
vLLM's rule written out; the Triton kernel under the interpreter on values every conversion represents
exactly (bytes equal), every format, the plain rows on random latents (bf16 rounding to nearest), and on
a GPU on random latents (bytes equal), through the cache views an engine holds."""
import pytest
import torch

from dsv4_rocm import layout as L
from dsv4_rocm import ops
from dsv4_rocm.reference import cache as rcache
from dsv4_rocm.reference.qkv import kv_rope
from dsv4_rocm.reference.quant import exponent_to_ue8m0, nvfp4_quantize, quantize_blocks, ue8m0_qdq
from dsv4_rocm.reference.rope import build_cos_sin_cache, rope_fwd
from helpers import patch_interpreter_bf16, patch_interpreter_scalars, run_file_interpreted
from inputs_v41 import e4m3_grid, quarter_turn_table

BS = 64


def _cache(nb, seed, device="cpu", fmt=L.V40_584):
    """[nb, 64, R] over random page bytes (padding included), R the bytes of a ``fmt`` record."""
    g = torch.Generator().manual_seed(seed)
    page = rcache.new_cache(nb, BS, fmt=fmt).shape[1]
    buf = torch.randint(0, 256, (nb, page), generator=g, dtype=torch.uint8).to(device)
    r = fmt.token_bytes
    return torch.as_strided(buf, (nb, BS, r), (page, r, 1)), buf


def _case(ratio, seed, T=40, nb=3):
    g = torch.Generator().manual_seed(seed)
    latent = (torch.randn(T, 512, generator=g) * torch.exp2(torch.randint(-4, 4, (T, 1), generator=g).float())
              ).bfloat16()
    pos = torch.randint(0, 500, (T,), generator=g)
    slots = torch.randperm(nb * BS, generator=g)[:T].long()
    slots[3] = -1
    return latent, pos, slots


@pytest.mark.parametrize("ratio", [1, 2])
def test_oracle_is_the_record_by_hand(ratio):
    latent, pos, slots = _case(ratio, 0)
    cs = build_cos_sin_cache(160000.0, 600)
    cache, buf = _cache(3, 1)
    before = buf.clone()
    ops.rope_quant_insert(latent, pos, cs, cache, slots, ratio)
    written = 0
    for t in range(latent.shape[0]):
        s, p = int(slots[t]), int(pos[t])
        if s < 0 or (p + 1) % ratio:
            continue
        rec = rcache.gather_k_records(buf, torch.tensor([s]), BS)
        k = rcache.decode_k_records(rec)[0]
        x = latent[t].float()
        assert torch.equal(k[:448], ue8m0_qdq(x[:448].unsqueeze(0), 64, 1e-4)[0])
        rope = rope_fwd(x.unsqueeze(0), torch.tensor([(p // ratio) * ratio]), cs)[0, 448:].bfloat16().float()
        assert torch.equal(k[448:], rope)
        assert rec[0, 583] == 0
        written += 1
    untouched = before.clone()
    keep = torch.ones_like(buf, dtype=torch.bool)
    for t in range(latent.shape[0]):
        s, p = int(slots[t]), int(pos[t])
        if s >= 0 and (p + 1) % ratio == 0:
            blk, o = divmod(s, BS)
            keep[blk, o * 576:(o + 1) * 576] = False
            keep[blk, BS * 576 + o * 8:BS * 576 + o * 8 + 8] = False
    assert written > 10 and torch.equal(buf[keep], untouched[keep])


def test_bytes_equal_the_v40_record_writer():
    """The record of a latent is the fp8_ds_mla record every other writer makes of RoPE(latent)."""
    latent, pos, slots = _case(2, 2)
    cs = build_cos_sin_cache(160000.0, 600)
    a, abuf = _cache(3, 3)
    b, bbuf = _cache(3, 3)
    ops.rope_quant_insert(latent, pos, cs, a, slots, 2)
    closes = (pos + 1) % 2 == 0
    rcache.quantize_and_insert_k_cache(kv_rope(latent, (pos // 2) * 2, cs), b, torch.where(closes, slots, -1), BS)
    assert torch.equal(abuf, bbuf)


def test_rejected_calls_write_nothing():
    latent, pos, slots = _case(1, 4)
    cs = build_cos_sin_cache(160000.0, 600)
    cache, buf = _cache(3, 5)
    before = buf.clone()
    odd = torch.zeros(3, BS, 576, dtype=torch.uint8)
    for kwargs, match in ((dict(compress_ratio=4), "compress_ratio"),
                          (dict(kv_cache=odd), "kv_cache: no KV record format is 576 bytes"),
                          (dict(slot_mapping=slots + 10 ** 5), "slot_mapping"),
                          (dict(positions=pos + 10 ** 4), "positions"), (dict(fp8_scale=torch.ones(1)), "fp8_scale"),
                          (dict(latent=latent.float()), "latent")):
        args = dict(latent=latent, positions=pos, cos_sin_cache=cs, kv_cache=cache, slot_mapping=slots,
                    compress_ratio=1)
        args.update(kwargs)
        with pytest.raises(ValueError, match=match):
            ops.rope_quant_insert(**args)
        assert torch.equal(buf, before)


def _plain_rows(dtype, nb=3, bs=4, seed=0, device="cpu"):
    """A plain-row cache [nb, bs, 512] of ``dtype`` whose pages are one row longer than their rows (so a writer
    must follow the strides), over random finite values; (cache view, backing)."""
    g = torch.Generator().manual_seed(seed)
    backing = (torch.randn(nb, (bs + 1) * 512, generator=g) * 4).to(dtype).to(device)
    return backing.as_strided((nb, bs, 512), ((bs + 1) * 512, 512, 1)), backing


def _plain_row_rule(latent, p, ratio, cs, dtype, scale):
    """vLLM's plain row of one latent, written out: the 448 NoPE values as they are, the 64 RoPE dims rotated
    in fp32 at (p // r) * r and rounded to bf16; the fp8 form scales that bf16 row by fp32(1 / scale) and
    rounds to e4m3 (saturating at 448; a -0 is stored 0x00, as every fp8 store of dsv4_rocm). Returns the row's
    bytes."""
    c, s_ = cs[(p // ratio) * ratio].float().chunk(2)
    x = latent.float()
    e, o = x[448::2], x[449::2]
    rope = torch.stack([e * c - o * s_, e * s_ + o * c], -1).flatten().bfloat16()
    row = torch.cat([latent[:448], rope])
    if dtype == torch.bfloat16:
        return row.view(torch.uint8)
    inv = 1.0 / scale.reshape(()).float()
    b = (row.float() * inv).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(b == 0x80, 0, b).to(torch.uint8)      # -0 is written +0 (dsv4_rocm's fp8 stores)


PLAIN = [torch.bfloat16, torch.float8_e4m3fn]


def _plain_case(ratio, seed, T=20, slots_in=24):
    """_case's latents and positions, T slots drawn from the first ``slots_in`` (3 pages of 8), one -1."""
    latent, pos, _ = _case(ratio, seed, T=T, nb=1)
    slots = torch.randperm(slots_in, generator=torch.Generator().manual_seed(seed))[:T].long()
    slots[3] = -1
    return latent, pos, slots


@pytest.mark.parametrize("dtype", PLAIN, ids=["bf16", "fp8"])
@pytest.mark.parametrize("ratio", [1, 2])
def test_plain_rows_are_vllms(ratio, dtype):
    """vLLM's FlashInfer caches: bf16 or per-tensor e4m3 [nb, bs, 512] rows (the cache's dtype and width name
    them); the rows of group-closing tokens with a slot are vLLM's rule written out, byte for byte, at the
    strides of a padded page; nothing else written."""
    latent, pos, slots = _plain_case(ratio, 40 + ratio)
    cs = build_cos_sin_cache(160000.0, 600)
    cache, backing = _plain_rows(dtype, nb=3, bs=8, seed=41)
    before = backing.clone()
    scale = torch.tensor([0.37]) if dtype == torch.float8_e4m3fn else None
    ops.rope_quant_insert(latent, pos, cs, cache, slots, ratio, fp8_scale=scale)
    raw, old = backing.view(torch.uint8), before.view(torch.uint8)
    keep = torch.ones_like(raw, dtype=torch.bool)
    written = 0
    size = backing.element_size()
    for t in range(latent.shape[0]):
        s, p = int(slots[t]), int(pos[t])
        if s < 0 or (p + 1) % ratio:
            continue
        blk, o = divmod(s, 8)
        a = o * 512 * size
        assert torch.equal(raw[blk, a:a + 512 * size], _plain_row_rule(latent[t], p, ratio, cs, dtype, scale)), t
        keep[blk, a:a + 512 * size] = False
        written += 1
    assert written >= 5 and torch.equal(raw[keep], old[keep])


def test_plain_rows_4d_view_and_saturation():
    """The [nb, bs, 1, 512] view writes the 3-D view's bytes; a small scale saturates e4m3 at +-448."""
    latent, pos, slots = _plain_case(1, 44)
    cs = build_cos_sin_cache(160000.0, 600)
    a, abuf = _plain_rows(torch.float8_e4m3fn, bs=8, seed=45)
    b, bbuf = _plain_rows(torch.float8_e4m3fn, bs=8, seed=45)
    scale = torch.tensor([2.0 ** -8])
    ops.rope_quant_insert(latent, pos, cs, a, slots, 1, fp8_scale=scale)
    ops.rope_quant_insert(latent, pos, cs, b.unsqueeze(2), slots, 1, fp8_scale=scale)
    assert torch.equal(abuf.view(torch.uint8), bbuf.view(torch.uint8))
    assert int((abuf.float().abs() == 448).sum()) > 100


def test_plain_rows_rejected_calls_write_nothing():
    latent, pos, slots = _plain_case(1, 46, T=10, slots_in=12)
    cs = build_cos_sin_cache(160000.0, 600)
    bf, bbuf = _plain_rows(torch.bfloat16)
    f8, fbuf = _plain_rows(torch.float8_e4m3fn)
    records, rbuf = _cache(1, 47)
    befores = [x.clone() for x in (bbuf, fbuf, rbuf)]
    one = torch.tensor([0.5])
    for kwargs, match in ((dict(kv_cache=f8), "fp8_scale is required"),
                          (dict(kv_cache=f8, fp8_scale=one.double()), "fp8_scale"),
                          (dict(kv_cache=f8, fp8_scale=torch.ones(2)), "fp8_scale"),
                          (dict(kv_cache=f8, fp8_scale=torch.tensor([0.0])), "fp8_scale"),
                          (dict(kv_cache=f8, fp8_scale=torch.tensor([float("inf")])), "fp8_scale"),
                          (dict(kv_cache=bf, fp8_scale=one), "fp8_scale"),
                          (dict(kv_cache=records, fp8_scale=one), "fp8_scale"),
                          (dict(kv_cache=bf, kv_layout="page_split"), "kv_layout"),
                          (dict(kv_cache=bf.transpose(0, 1)), "kv_cache"),
                          (dict(kv_cache=bbuf.view(3, 5, 512)[:, :, :256]), "kv_cache"),
                          (dict(kv_cache=bf, slot_mapping=slots + 100), "slot_mapping"),
                          (dict(kv_cache=bbuf.float().view(3, 5, 512)), "kv_cache")):
        args = dict(latent=latent, positions=pos, cos_sin_cache=cs, slot_mapping=slots, compress_ratio=1)
        args.update(kwargs)
        with pytest.raises(ValueError, match=match):
            ops.rope_quant_insert(**args)
        for x, y in zip((bbuf, fbuf, rbuf), befores):
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), match


V41 = [(L.V41_528, "interleaved"), (L.V41_528, "page_split"), (L.V41_FP4_288, "interleaved"),
       (L.V41_FP4_288, "page_split")]


def _v41_rule(x, fmt):
    """vLLM's V4.1 record of fp32 rotated values x [512], written out: (data bytes, scale bytes)."""
    if fmt.elem_bits == 4:
        q, s = nvfp4_quantize(x.unsqueeze(0), 16)
        return q[0], s[0]
    q, e = quantize_blocks(x.unsqueeze(0), 32, 1e-4)
    return q[0], exponent_to_ue8m0(e)[0]


@pytest.mark.parametrize("fmt, layout", V41, ids=[f"{f.name}-{lay}" for f, lay in V41])
@pytest.mark.parametrize("ratio", [1, 2])
def test_v41_records_are_vllms(ratio, fmt, layout):
    """The cache's last dim names the record (vLLM's dispatch): all 512 dims of RoPE(latent) in fp32 (no bf16
    rounding) quantized, data and scales where the layout puts them (interleaved: vLLM 0.33's, the default);
    nothing else written."""
    f = L.with_layout(fmt, layout)
    latent, pos, slots = _case(ratio, 30 + ratio)
    cs = build_cos_sin_cache(160000.0, 600)
    cache, buf = _cache(3, 31, fmt=f)
    before = buf.clone()
    ops.rope_quant_insert(latent, pos, cs, cache, slots, ratio, **({} if layout == "interleaved" else
                                                                  dict(kv_layout=layout)))
    keep = torch.ones_like(buf, dtype=torch.bool)
    written = 0
    for t in range(latent.shape[0]):
        s, p = int(slots[t]), int(pos[t])
        if s < 0 or (p + 1) % ratio:
            continue
        x = rope_fwd(latent[t].float().unsqueeze(0), torch.tensor([(p // ratio) * ratio]), cs)[0]
        data, scales = _v41_rule(x, f)
        blk, o = divmod(s, BS)
        d0, s0 = L.data_offset(f, o), L.record_scale_offset(f, BS, o)
        assert torch.equal(buf[blk, d0:d0 + f.quant_bytes], data), t
        assert torch.equal(buf[blk, s0:s0 + f.num_scales], scales), t
        keep[blk, d0:d0 + f.data_bytes] = False
        keep[blk, s0:s0 + f.scale_bytes] = False
        written += 1
    assert written > 10 and torch.equal(buf[keep], before[keep])


def _exact_case(ratio, seed):
    """Latents on the e4m3 grid (UE8M0 quantization exact) and a quarter-turn RoPE table: the kernel's bf16
    and fp8 conversions are exact, so even the interpreter writes the oracle's bytes."""
    g = torch.Generator().manual_seed(seed)
    latent = e4m3_grid((48, 512), g).bfloat16()
    pos = torch.randint(0, 300, (48,), generator=g)
    slots = torch.randperm(4 * BS, generator=g)[:48].long()
    slots[5] = -1
    return latent, pos, slots, quarter_turn_table(300, seed)


def interpreter_main():
    from dsv4_rocm.reference.compressor_v41 import rope_quant_insert as oracle
    from dsv4_rocm.triton.compressor.rope_quant_insert import rope_quant_insert as kernel
    patch_interpreter_scalars()
    for fmt in (L.V40_584, L.with_layout(L.V41_528), L.with_layout(L.V41_FP4_288),
                L.with_layout(L.V41_FP4_288, "page_split")):
        for ratio in (1, 2):
            latent, pos, slots, cs = _exact_case(ratio, 10 + ratio)
            a, abuf = _cache(4, 6, fmt=fmt)
            b, bbuf = _cache(4, 6, fmt=fmt)
            oracle(latent, pos, cs, a, slots, ratio, fmt=fmt)
            kernel(latent, pos, cs, b.unsqueeze(-2), slots, ratio, fmt=fmt)          # FlashMLA's 4-D view
            written = int((abuf != _cache(4, 6, fmt=fmt)[1]).sum())
            print(f"{fmt.name} {fmt.layout} ratio {ratio}: bytes differing {int((abuf != bbuf).sum())}, written "
                  f"{written}")
    patch_interpreter_bf16()                      # round fp32 -> bf16 to nearest even, as the GPUs do
    for dtype in PLAIN:
        for ratio in (1, 2):
            latent, pos, slots = _plain_case(ratio, 50 + ratio)
            cs = build_cos_sin_cache(160000.0, 600)
            scale = torch.tensor([0.37])
            a, abuf = _plain_rows(dtype, bs=8, seed=51)
            b, bbuf = _plain_rows(dtype, bs=8, seed=51)
            oracle(latent, pos, cs, a, slots, ratio, scale)
            kernel(latent, pos, cs, b, slots, ratio, scale)
            raw = abuf.view(torch.uint8)
            written = int((raw != _plain_rows(dtype, bs=8, seed=51)[1].view(torch.uint8)).sum())
            print(f"{dtype} rows ratio {ratio}: bytes differing {int((raw != bbuf.view(torch.uint8)).sum())}, "
                  f"written {written}")


def test_kernel_under_the_interpreter():
    r = run_file_interpreted(__file__)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 12 and all("bytes differing 0," in l and int(l.split()[-1]) > 1000 for l in lines), lines


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [L.V40_584, L.V41_528, L.V41_FP4_288], ids=lambda f: f.name)
@pytest.mark.parametrize("ratio", [1, 2])
@pytest.mark.parametrize("view", ["3d", "4d", "fp8"])
def test_kernel_equals_oracle_bytes_on_gpu(ratio, view, fmt, gpu):
    latent, pos, slots = _case(ratio, 20 + ratio, T=3000, nb=80)
    cs = build_cos_sin_cache(160000.0, 600)
    fmt = L.with_layout(fmt)
    a, abuf = _cache(80, 7, fmt=fmt)
    b, bbuf = _cache(80, 7, gpu, fmt=fmt)
    ops.rope_quant_insert(latent, pos, cs, a, slots, ratio)
    cache = {"3d": b, "4d": b.unsqueeze(-2), "fp8": b.view(torch.float8_e4m3fn)}[view]
    ops.rope_quant_insert(latent.to(gpu), pos.to(gpu), cs.to(gpu), cache, slots.to(gpu), ratio)
    assert torch.equal(bbuf.cpu(), abuf)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", PLAIN, ids=["bf16", "fp8"])
@pytest.mark.parametrize("ratio", [1, 2])
def test_plain_rows_equal_oracle_bytes_on_gpu(ratio, dtype, gpu):
    latent, pos, slots = _case(ratio, 60 + ratio, T=3000, nb=80)
    cs = build_cos_sin_cache(160000.0, 600)
    scale = torch.tensor([0.37])
    a, abuf = _plain_rows(dtype, nb=80, bs=64, seed=61)
    b, bbuf = _plain_rows(dtype, nb=80, bs=64, seed=61, device=gpu)
    ops.rope_quant_insert(latent, pos, cs, a, slots, ratio, fp8_scale=scale if dtype != torch.bfloat16 else None)
    ops.rope_quant_insert(latent.to(gpu), pos.to(gpu), cs.to(gpu), b, slots.to(gpu), ratio,
                          fp8_scale=scale.to(gpu) if dtype != torch.bfloat16 else None)
    assert torch.equal(bbuf.cpu().view(torch.uint8), abuf.view(torch.uint8))


if __name__ == "__main__":
    interpreter_main()
