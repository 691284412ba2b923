"""DeepSeek-V4.1 indexer-K store (indexer_k_norm_rope_store): the oracle against the key written out by
hand (FP8 and MXFP4 records), against the V4.0 writer of the FP8 record, padding and rejected calls; the
Triton kernel under the interpreter on values every conversion represents exactly (bytes equal) and on
a GPU on random keys (bytes equal)."""
import pytest
import torch

from dsv4_rocm import ops
from dsv4_rocm.reference import cache as rcache
from dsv4_rocm.reference import indexer_v41 as ri
from dsv4_rocm.reference.norm import rmsnorm
from dsv4_rocm.reference.quant import mxfp4_dequantize, mxfp4_quantize, ue8m0_qdq
from dsv4_rocm.reference.rope import build_cos_sin_cache, rope_fwd
from helpers import patch_interpreter_scalars, run_file_interpreted
from inputs_v41 import e2m1_grid, e4m3_grid, quarter_turn_table

BS = 64


def _cache(nb, fp4, seed, device="cpu"):
    """[nb, 64, 132 or 68] over random page bytes."""
    g = torch.Generator().manual_seed(seed)
    c = ri.pages_bytes(nb, BS, fp4)
    buf = torch.randint(0, 256, (nb, c.stride(0)), generator=g, dtype=torch.uint8).to(device)
    return torch.as_strided(buf, c.shape, c.stride()), buf


def _read(buf, slot, fp4):
    data, scale = ri.record_layout(fp4)
    blk, o = divmod(slot, BS)
    return buf[blk, o * data:(o + 1) * data], buf[blk, BS * data + o * scale:BS * data + (o + 1) * scale]


def _case(seed, T=40, nb=3):
    g = torch.Generator().manual_seed(seed)
    k_pre = (torch.randn(T, 128, generator=g) * 3).bfloat16()
    pos = torch.randint(0, 500, (T,), generator=g)
    slots = torch.randperm(nb * BS, generator=g)[:T].long()
    slots[2] = -1
    w = (1 + 0.1 * torch.randn(128, generator=g)).bfloat16()
    return k_pre, pos, slots, w


@pytest.mark.parametrize("fp4", [False, True])
@pytest.mark.parametrize("ratio", [1, 2])
def test_oracle_is_the_key_by_hand(ratio, fp4):
    k_pre, pos, slots, w = _case(ratio + 2 * fp4)
    cs = build_cos_sin_cache(160000.0, 600)
    cache, buf = _cache(3, fp4, 1)
    ops.indexer_k_norm_rope_store(k_pre, pos, cs, w, 1e-6, cache, slots, ratio, fp4)
    n = 0
    for t in range(k_pre.shape[0]):
        s, p = int(slots[t]), int(pos[t])
        if s < 0 or (p + 1) % ratio:
            continue
        k = rmsnorm(k_pre[t].double(), w.double(), 1e-6).bfloat16()
        z = rope_fwd(k.unsqueeze(0), torch.tensor([(p // ratio) * ratio]), cs)[0].bfloat16().float()
        data, scale = _read(buf, s, fp4)
        if fp4:
            packed, scales = mxfp4_quantize(z.unsqueeze(0))
            assert torch.equal(data, packed[0]) and torch.equal(scale, scales[0])
            got = mxfp4_dequantize(data.unsqueeze(0), scale.unsqueeze(0))[0]
            step = torch.exp2(scale.float() - 127).repeat_interleave(32)      # 2^e: the E2M1 grid's unit
            assert ((got - z).abs() <= step).all()
        else:
            got = rcache.indexer_k_gather(buf, torch.tensor([s]), BS)
            v = got[0].view(torch.float8_e4m3fn).float()[0] * got[1][0]
            assert torch.equal(v, ue8m0_qdq(z.unsqueeze(0), 128, 1e-4)[0])
        n += 1
    assert n > 10


def test_fp8_record_equals_the_v40_indexer_writer():
    """The FP8 record of a key is the record vLLM's indexer_k_quant_and_cache makes of z = RoPE(k_norm(k))."""
    k_pre, pos, slots, w = _case(5)
    cs = build_cos_sin_cache(160000.0, 600)
    a, abuf = _cache(3, False, 2)
    b, bbuf = _cache(3, False, 2)
    ops.indexer_k_norm_rope_store(k_pre, pos, cs, w, 1e-6, a, slots, 1, False)
    k = rmsnorm(k_pre.float(), w, 1e-6).bfloat16()
    z = rope_fwd(k, pos, cs).bfloat16()
    ops.indexer_k_quant_and_cache(z, b, slots, 128, "ue8m0")
    assert torch.equal(abuf, bbuf)


def test_rejected_calls_write_nothing():
    k_pre, pos, slots, w = _case(6)
    cs = build_cos_sin_cache(160000.0, 600)
    cache, buf = _cache(3, False, 3)
    before = buf.clone()
    fp4_cache, _ = _cache(3, True, 3)
    for kwargs, match in ((dict(compress_ratio=4), "compress_ratio"), (dict(k_cache=fp4_cache), "k_cache"),
                          (dict(kv_slot_mapping=slots + 10 ** 5), "slot"), (dict(mxfp4_n_per_tile=16), "mxfp4"),
                          (dict(k_pre=k_pre[:, :64]), "k_pre"), (dict(rms_norm_weight=w[:64]), "rms_norm_weight")):
        args = dict(k_pre=k_pre, positions=pos, cos_sin_cache=cs, rms_norm_weight=w, rms_norm_eps=1e-6,
                    k_cache=cache, kv_slot_mapping=slots, compress_ratio=1, use_fp4_cache=False)
        args.update(kwargs)
        with pytest.raises(ValueError, match=match):
            ops.indexer_k_norm_rope_store(**args)
        assert torch.equal(buf, before)


def _exact_case(fp4, seed):
    """Rows of +-2^a (RMSNorm with eps 0 gives +-1 exactly, times the weight) and weights on the e4m3 / E2M1
    grid, a quarter-turn RoPE table: every conversion in the kernel is exact."""
    g = torch.Generator().manual_seed(seed)
    T = 48
    sign = torch.where(torch.rand(T, 128, generator=g) < 0.5, -1.0, 1.0)
    k_pre = (sign * torch.exp2(torch.randint(-6, 6, (T, 1), generator=g).float())).bfloat16()
    w = (e2m1_grid((1, 128), g)[0] if fp4 else e4m3_grid((1, 128), g, 128)[0]).bfloat16()
    pos = torch.randint(0, 300, (T,), generator=g)
    slots = torch.randperm(4 * BS, generator=g)[:T].long()
    slots[7] = -1
    return k_pre, pos, slots, w, quarter_turn_table(300, seed)


def interpreter_main():
    from dsv4_rocm.triton.indexer.indexer_k_norm_rope_store import indexer_k_norm_rope_store as kernel
    patch_interpreter_scalars()
    for ratio in (1, 2):
        for fp4 in (False, True):
            k_pre, pos, slots, w, cs = _exact_case(fp4, 3 * ratio + fp4)
            a, abuf = _cache(4, fp4, 9)
            b, bbuf = _cache(4, fp4, 9)
            ri.indexer_k_norm_rope_store(k_pre, pos, cs, w, 0.0, a, slots, ratio, fp4)
            kernel(k_pre, pos, cs, w, 0.0, b, slots, ratio, fp4)
            print(f"ratio {ratio} fp4 {fp4}: bytes differing {int((abuf != bbuf).sum())}, written "
                  f"{int((abuf != _cache(4, fp4, 9)[1]).sum())}")


def test_kernel_under_the_interpreter():
    r = run_file_interpreted(__file__)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 4 and all("bytes differing 0," in l and int(l.split()[-1]) > 500 for l in lines)


@pytest.mark.gpu
@pytest.mark.parametrize("fp4", [False, True])
@pytest.mark.parametrize("ratio", [1, 2])
def test_kernel_equals_oracle_bytes_on_gpu(ratio, fp4, gpu):
    k_pre, pos, slots, w = _case(30 + ratio + 2 * fp4, T=3000, nb=80)
    k_pre[5, 7] = float("nan")                                   # a poisoned key
    cs = build_cos_sin_cache(160000.0, 600)
    a, abuf = _cache(80, fp4, 4)
    b, bbuf = _cache(80, fp4, 4, gpu)
    ops.indexer_k_norm_rope_store(k_pre, pos, cs, w, 1e-6, a, slots, ratio, fp4)
    ops.indexer_k_norm_rope_store(k_pre.to(gpu), pos.to(gpu), cs.to(gpu), w.to(gpu), 1e-6, b, slots.to(gpu), ratio,
                                  fp4)
    assert torch.equal(bbuf.cpu(), abuf)


if __name__ == "__main__":
    interpreter_main()
