"""fused_deepseek_v4_kv_rope_insert, vLLM 0.33's form ``(kv, k_cache, slot_mapping, position_ids, cos_sin_cache,
cache_block_size, fp8_scale=None, kv_mxfp8=False)``: the kv half of the fused inserts alone (V4.1's DSpark
context KV and PCP SWA writer), the cache's dtype choosing the form.

CPU: on every cache form (uint8 V40_584 records in every view, V41_528 in both page layouts, float8_e4m3fn and
bf16 rows) the op writes the bytes the fused insert it stands for writes (vLLM's own check: the KV-only insert
must equal the q + kv insert byte for byte, padding and untouched slots included), kv is not modified; the
Triton kernel under the interpreter equals the reference byte for byte; ``torch.ops.dsv4_rocm`` with vLLM's
schema and its fake; bad input named before any write. GPU: the kernel against the reference on every form,
and a CUDA/HIP graph replay with new values.
"""
import textwrap

import pytest
import torch

from dsv4_rocm import layout as L
from dsv4_rocm import ops
from dsv4_rocm.reference import qkv as rq
from dsv4_rocm.reference.rope import build_cos_sin_cache
from helpers import every_cache_view, random_k, run_interpreted

OP = ops.fused_deepseek_v4_kv_rope_insert
CS = build_cos_sin_cache(10000.0, 4096)
POISON = 0xA5


def inputs(T, n, nb, bs, seed):
    """kv [T, 512], positions, n slots (every fifth -1) of a cache of nb x bs, and a positive fp8 scale."""
    g = torch.Generator().manual_seed(seed)
    kv = random_k(T, gen=g)
    pos = torch.randint(0, CS.shape[0], (T,), generator=g)
    slots = torch.randperm(nb * bs, generator=g)[:n]
    slots[::5] = -1
    return kv, pos, slots, torch.tensor([0.7])


def row_cache(nb, bs, dtype, device="cpu"):
    """[nb, bs, 512] rows of ``dtype`` inside a poisoned allocation with padded pages (vLLM's as_strided)."""
    row = 512 * torch.tensor([], dtype=dtype).element_size()
    stride = (bs * row + 576) // row * row                      # bytes of a page, a row multiple past bs rows
    backing = torch.full((nb, stride), POISON, dtype=torch.uint8, device=device)
    v = backing.view(dtype) if dtype != torch.uint8 else backing
    per = stride // row * 512
    return torch.as_strided(v, (nb, bs, 512), (per, 512, 1)), backing


def legacy(form, kv, cache, slots, pos, cs, bs, scale):
    """The fused insert vLLM's test compares against: the same kv through the q + kv op of the cache's form."""
    T = kv.shape[0]
    q = torch.zeros(T, 8, 512, dtype=torch.bfloat16)
    if form in ("V40_584", "V41_528", "V41_528 page_split"):
        ops.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(q, kv, cache, slots, pos, cs, 8, 1e-20, bs, True,
                                                              form != "V40_584",
                                                              kv_layout="page_split" if "split" in form else None)
    elif form == "bf16":
        ops.qnorm_rope_and_insert_full_bf16_k_cache(q, kv, cache, slots, pos, cs, 1e-20, bs)
    else:
        ops.qnorm_rope_and_insert_full_k_cache(q, kv, cache, slots, pos, cs, 1e-20, bs, scale,
                                               torch.empty(T, 8, 512, dtype=torch.float8_e4m3fn), scale)


def record_fmt(form):
    return L.with_layout(L.V41_528 if "528" in form else L.V40_584, "page_split" if "split" in form else None)


def caches(form, nb, bs):
    """Two identical (cache, backing) pairs of ``form``."""
    if form in ("bf16", "fp8"):
        dtype = torch.bfloat16 if form == "bf16" else torch.float8_e4m3fn
        return row_cache(nb, bs, dtype), row_cache(nb, bs, dtype)
    fmt = record_fmt(form)
    out = []
    for _ in range(2):
        backing = torch.full((nb, L.page_bytes(bs, fmt)), POISON, dtype=torch.uint8)
        out.append((backing, backing))
    return out


FORMS = ["V40_584", "V41_528", "V41_528 page_split", "bf16", "fp8"]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("T, n", [(1, 1), (17, 17), (40, 33)])
def test_kv_only_insert_writes_the_fused_inserts_bytes(form, T, n):
    nb, bs = 3, 16
    kv, pos, slots, scale = inputs(T, n, nb, bs, seed=T + n)
    (c1, b1), (c2, b2) = caches(form, nb, bs)
    before = kv.clone()
    OP(kv, c1, slots, pos, CS, bs, scale if form == "fp8" else None, "528" in form,
       kv_layout="page_split" if "split" in form else None)
    legacy(form, kv, c2, slots, pos, CS, bs, scale)
    assert torch.equal(b1, b2) and torch.equal(kv, before)
    assert not torch.equal(b1, torch.full_like(b1, POISON)) or int((slots >= 0).sum()) == 0


@pytest.mark.parametrize("view", sorted(every_cache_view(1, 2)))
def test_every_record_cache_view(view):
    nb, bs = 2, 16
    kv, pos, slots, _ = inputs(20, 20, nb, bs, seed=3)
    cache, backing = every_cache_view(nb, bs, seed=9)[view]
    want, want_backing = every_cache_view(nb, bs, seed=9)[view]
    OP(kv, cache, slots, pos, CS, bs)
    rq.fused_deepseek_v4_kv_rope_insert(kv, want_backing if want_backing.dim() == 2 else want, slots, pos, CS, bs)
    assert torch.equal(backing, want_backing)


def test_torch_ops_form_and_fake():
    nb, bs = 2, 16
    kv, pos, slots, _ = inputs(9, 9, nb, bs, seed=5)
    a = torch.full((nb, bs * 584), POISON, dtype=torch.uint8)
    b = a.clone()
    torch.ops.dsv4_rocm.fused_deepseek_v4_kv_rope_insert(kv, a, slots, pos, CS, bs, None, False)
    OP(kv, b, slots, pos, CS, bs)
    assert torch.equal(a, b) and not torch.equal(a, torch.full_like(a, POISON))
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        f = [mode.from_tensor(t) for t in (kv, a, slots, pos, CS)]
        assert torch.ops.dsv4_rocm.fused_deepseek_v4_kv_rope_insert(*f, bs) is None


def _bad_calls():
    nb, bs = 2, 16
    kv, pos, slots, scale = inputs(6, 6, nb, bs, seed=1)
    rec = torch.full((nb, bs * 584), POISON, dtype=torch.uint8)
    bf, _ = row_cache(nb, bs, torch.bfloat16)
    f8, _ = row_cache(nb, bs, torch.float8_e4m3fn)
    yield "kv must have dtype", rec, lambda c: OP(kv.float(), c, slots, pos, CS, bs)
    yield "kv must be", rec, lambda c: OP(kv[:, :448], c, slots, pos, CS, bs)
    yield "slot_mapping has 7 entries", rec, lambda c: OP(kv, c, torch.arange(7), pos, CS, bs)
    yield "slot_mapping", rec, lambda c: OP(kv, c, slots.clamp(min=0) + nb * bs, pos, CS, bs)
    yield "positions must lie", rec, lambda c: OP(kv, c, slots, pos + 4096, CS, bs)
    yield "cache_block_size", rec, lambda c: OP(kv, c, slots, pos, CS, 0)
    yield "kv_mxfp8 must be a bool", rec, lambda c: OP(kv, c, slots, pos, CS, bs, None, 1)
    yield "kv_mxfp8 needs the uint8 record cache", bf, lambda c: OP(kv, c, slots, pos, CS, bs, None, True)
    yield "fp8_scale is required", f8, lambda c: OP(kv, c, slots, pos, CS, bs)
    yield "fp8_scale must be a finite positive", f8, lambda c: OP(kv, c, slots, pos, CS, bs, -scale)
    yield "k_cache must have dtype", rec.view(torch.int8), lambda c: OP(kv, c, slots, pos, CS, bs)
    yield "k_cache", bf, lambda c: OP(kv, c, slots, pos, CS, 8)                          # 16 rows a page, not 8


@pytest.mark.parametrize("match, cache, call", list(_bad_calls()), ids=[m for m, _, _ in _bad_calls()])
def test_bad_input_is_rejected_before_any_write(match, cache, call):
    before = cache.clone()
    with pytest.raises(ValueError, match=match):
        call(cache)
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))


# ---- the Triton kernel under the interpreter --------------------------------------------------------
_INTERPRETED = textwrap.dedent("""
    import os
    os.environ["TRITON_INTERPRET"] = "1"
    import sys
    sys.path[:0] = ["tests", "tests/qkv"]
    import torch
    from helpers import patch_interpreter_bf16
    patch_interpreter_bf16()
    import test_fused_deepseek_v4_kv_rope_insert as t
    from dsv4_rocm.reference import qkv as rq
    from dsv4_rocm.triton.qkv.fused_deepseek_v4_kv_rope_insert import fused_deepseek_v4_kv_rope_insert as K

    nb, bs = 3, 16
    for form in t.FORMS:
        for T, n in ((5, 5), (23, 19)):
            kv, pos, slots, scale = t.inputs(T, n, nb, bs, seed=T)
            kv[1, 3] = float("inf") if form == "fp8" else kv[1, 3]       # a non-finite row value: 0x7F
            (c1, b1), (c2, b2) = t.caches(form, nb, bs)
            fmt = t.record_fmt(form) if form not in ("bf16", "fp8") else None
            sc = scale if form == "fp8" else None
            K(kv, c1, slots, pos, t.CS, bs, sc, "528" in form, fmt=fmt)
            rq.fused_deepseek_v4_kv_rope_insert(kv, c2, slots, pos, t.CS, bs, sc, "528" in form, fmt=fmt)
            print(form, T, n, int((b1 != b2).sum()), int((b1 != t.POISON).sum()) > 0)
""")


def test_kernel_equals_the_reference_under_the_interpreter(tmp_path):
    r = run_interpreted(_INTERPRETED, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line.split() for line in r.stdout.strip().splitlines()]
    print(r.stdout)
    assert len(rows) == 2 * len(FORMS)
    for row in rows:
        assert row[-2:] == ["0", "True"], row                        # no byte differs, something was written


# ---- GPU -------------------------------------------------------------------------------------------------
def _gpu_caches(form, nb, bs, gpu):
    (c1, b1), (c2, b2) = caches(form, nb, bs)
    if form in ("bf16", "fp8"):
        dtype = c1.dtype
        (g1, gb1), (g2, gb2) = row_cache(nb, bs, dtype, gpu), row_cache(nb, bs, dtype, gpu)
        return (g1, gb1), (g2, gb2)
    return (b1.to(gpu),) * 2, (b2.to(gpu),) * 2


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("T", [1, 17, 1023, 1024])
def test_gpu_kernel_equals_the_reference(form, T, gpu):
    nb, bs = (T + 7) // 256 + 1, 256
    kv, pos, slots, scale = (x.to(gpu) for x in inputs(T + 3, T, nb, bs, seed=T))
    (c1, b1), (c2, b2) = _gpu_caches(form, nb, bs, gpu)
    sc = scale if form == "fp8" else None
    lay = "page_split" if "split" in form else None
    with ops.use_backend("triton"):
        OP(kv, c1, slots, pos, CS.to(gpu), bs, sc, "528" in form, kv_layout=lay)
    rq.fused_deepseek_v4_kv_rope_insert(kv, c2, slots, pos, CS.to(gpu), bs, sc, "528" in form,
                                        fmt=record_fmt(form) if form not in ("bf16", "fp8") else None)
    assert torch.equal(b1, b2)


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
def test_gpu_graph_replay(form, gpu):
    """Captured once, replayed with new kv, positions and slots (the last replay all padding): the cache each
    time equals the reference's on the same inputs."""
    T, nb, bs = 64, 2, 64
    kv, pos, slots, scale = (x.to(gpu) for x in inputs(T, T, nb, bs, seed=1))
    (c1, b1), (c2, b2) = _gpu_caches(form, nb, bs, gpu)
    sc = scale if form == "fp8" else None
    lay = "page_split" if "split" in form else None
    fmt = record_fmt(form) if form not in ("bf16", "fp8") else None
    cs = CS.to(gpu)

    def run():
        OP(kv, c1, slots, pos, cs, bs, sc, "528" in form, kv_layout=lay)

    run()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for it in range(3):
        nkv, npos, nslots, _ = inputs(T, T, nb, bs, seed=10 + it)
        kv.copy_(nkv)
        pos.copy_(npos)
        slots.copy_(nslots if it < 2 else torch.full_like(nslots, -1))
        b1.fill_(POISON)
        b2.fill_(POISON)
        graph.replay()
        rq.fused_deepseek_v4_kv_rope_insert(kv, c2, slots, pos, cs, bs, sc, "528" in form, fmt=fmt)
        torch.cuda.synchronize()
        assert torch.equal(b1, b2), (form, it)
