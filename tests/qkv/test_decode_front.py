"""decode_front: the decode step's front in one launch (the kv half of fused_q_kv_rmsnorm, the fused q norm +
RoPE + kv insert, the indexer query's RoPE + quant) against the ops it replaces.

The unfused norms are HIP kernels with a fixed order of their sums (the kernel file's docstring);
``hip_order_norms`` below is that order in torch, the model the fused kernel is held to on the CPU, where
the unfused ops run their references (torch's mean: an order the platform picks). CPU: the Triton kernel
under the interpreter, every output poisoned first, on fresh random inputs: q_out bit for bit and the cache
bytes byte for byte against the fused insert's reference fed the model's norms; the indexer's bytes, scales
and weights bit for bit against fused_indexer_q_rope_quant; the model within one bf16 step of the
reference norms (so the ops agree up to the sum order). The op (reference backend) against the three ops;
bad input named before any write. GPU: the kernel against the three public ops run unfused (HIP norms and
insert where dsv4_rocm._C is built: bit for bit; else against the model), V40_584 and V41_528, with and
without the indexer.
"""
import textwrap

import pytest
import torch

from dsv4_rocm import layout as L
from dsv4_rocm import ops
from dsv4_rocm.reference import qkv as rq
from dsv4_rocm.reference.rope import build_cos_sin_cache, rope_fwd_fma
from helpers import random_k, run_interpreted

CS = build_cos_sin_cache(10000.0, 4096)
POISON = 0xA5
EPS = 1e-6


def _serial_then_butterfly(v):
    """v [..., 32, C]: each lane's C values summed in turn, then the 32 lane sums as an xor butterfly."""
    s = v[..., 0]
    for j in range(1, v.shape[-1]):
        s = s + v[..., j]
    for w in (16, 8, 4, 2, 1):
        s = s[..., :w] + s[..., w:2 * w]
    return s[..., 0]


def _rrms(ss, eps):
    return 1.0 / torch.sqrt(ss * (1.0 / 512.0) + torch.tensor(eps, dtype=torch.float32))


def hip_order_norms(q, kv, kv_weight, eps):
    """(fp32 per-head weightless RMSNorm of q [T, H, 512], bf16 RMSNorm of kv [T, 512] with kv_weight) with the
    sums of squares in the HIP kernels' order (dsv4_rmsnorm512; fused_q_kv_rmsnorm.hip)."""
    x = q.float()
    ssq = _serial_then_butterfly((x * x).reshape(*x.shape[:-1], 32, 16))
    qn = x * _rrms(ssq, eps).unsqueeze(-1)
    k = kv.float()
    pairs = k.reshape(-1, 2, 32, 4, 2)
    p = pairs[..., 0] * pairs[..., 0] + pairs[..., 1] * pairs[..., 1]            # [T, chunk, lane, pair]
    ssk = _serial_then_butterfly(p.permute(0, 2, 1, 3).reshape(-1, 32, 8))
    kn = ((k * _rrms(ssk, eps).unsqueeze(-1)) * kv_weight.float()).to(torch.bfloat16)
    return qn, kn


def model_front(q, kv, kv_weight, cache, slots, pos, cs, Hp, bs, norm, fmt):
    """The fused insert's reference fed the HIP-order norms: q_out, and the cache written."""
    qn, kn = hip_order_norms(q, kv, kv_weight, EPS)
    q_out = torch.zeros(q.shape[0], Hp, 512, dtype=torch.bfloat16)
    q_out[:, :q.shape[1]] = rope_fwd_fma(qn if norm else q.float(), pos, cs).to(torch.bfloat16)
    rq.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(torch.zeros_like(q[:, :1]), kn, cache, slots, pos, cs, 1,
                                                         EPS, bs, None, True, True, False, fmt)
    return q_out


def inputs(T, H, n, nb, bs, nh, seed):
    """q [T, H, 512], the raw kv latent as a column slice of a [T, 1536] projection, its norm weight, positions,
    n slots (every fifth -1), index_q [T, nh, 128], index weights [T, nh]."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(T, H, 512, generator=g) * 3).bfloat16()
    proj = torch.randn(T, 1024 + 512, generator=g).bfloat16()
    proj[:, 1024:] = random_k(T, gen=g, scale=4.0)
    kv = proj[:, 1024:]
    w = (1 + 0.1 * torch.randn(512, generator=g)).bfloat16()
    pos = torch.randint(0, CS.shape[0], (T,), generator=g)
    slots = torch.randperm(nb * bs, generator=g)[:n]
    slots[::5] = -1
    iq = torch.randn(T, nh, 128, generator=g).bfloat16()
    iw = torch.randn(T, nh, generator=g).bfloat16()
    return q, kv, w, pos, slots, iq, iw


FORMS = [("V40_584", False, None), ("V41_528", True, None), ("V41_528 page_split", True, "page_split")]


def _fmt(mxfp8, layout):
    return L.with_layout(L.V41_528 if mxfp8 else L.V40_584, layout)


def unfused(q, kv, w, cache, slots, pos, cs, Hp, bs, norm, mxfp8, layout, iq, iw, fp4):
    """The three ops decode_front replaces, in the step's order."""
    qr = torch.randn(q.shape[0], 1024).bfloat16().to(q.device)
    _, kv_n = ops.fused_q_kv_rmsnorm(qr, kv, torch.ones(1024, dtype=torch.bfloat16, device=q.device), w, EPS)
    q_out = ops.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(q, kv_n, cache, slots, pos, cs, Hp, EPS, bs, norm,
                                                                  mxfp8, kv_layout=layout)
    idx = None
    if iq is not None:
        idx = ops.fused_indexer_q_rope_quant(pos, iq, cs, iw, 128 ** -0.5, iq.shape[1] ** -0.5, fp4)
    return q_out, idx


def fused(q, kv, w, cache, slots, pos, cs, Hp, bs, norm, mxfp8, layout, iq, iw, fp4, q_out=None):
    return ops.decode_front(q, kv, w, cache, slots, pos, cs, Hp, EPS, bs, norm, mxfp8, kv_layout=layout,
                            q_out=q_out, index_q=iq, index_weights=iw,
                            index_weights_softmax_scale=128 ** -0.5 if iq is not None else None,
                            index_weights_head_scale=iq.shape[1] ** -0.5 if iq is not None else None,
                            index_use_fp4=fp4)


def same_index(a, b, fp4):
    """The indexer outputs: q bytes (and MXFP4 scales) equal, weights the same floats (NaN anywhere NaN)."""
    from helpers import same_floats
    if fp4:
        (pa, sa), wa = a
        (pb, sb), wb = b
        return torch.equal(pa, pb) and torch.equal(sa, sb) and same_floats(wa, wb)
    return torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and same_floats(a[1], b[1])


# ---- CPU: the reference backend and the model --------------------------------------------------------------
def test_model_norms_are_the_reference_norms_within_a_rounding():
    """The HIP-order sums change the norms only by the rounding of the sum: q within 2^-20 relative of the
    reference's fp32, kv within one bf16 step."""
    q, kv, w, *_ = inputs(33, 8, 33, 2, 64, 4, seed=7)
    qn, kn = hip_order_norms(q, kv, w, EPS)
    from dsv4_rocm.reference.norm import rmsnorm
    ref_q, ref_k = rmsnorm(q, None, EPS), rmsnorm(kv, w, EPS)
    assert float(((qn - ref_q).abs() / ref_q.abs().clamp_min(1e-30)).max()) < 2 ** -20
    assert bool(((kn.float() - ref_k).abs() <= ref_k.abs() * 2 ** -8 + 1e-30).all())


@pytest.mark.parametrize("form, mxfp8, layout", FORMS)
@pytest.mark.parametrize("indexer", [None, "fp8", "mxfp4"])
def test_op_equals_the_unfused_ops_on_the_reference_backend(form, mxfp8, layout, indexer):
    """CPU tensors run the references: the op is their composition, bit for bit, poisoned outputs."""
    T, H, Hp, nb, bs, nh = 19, 8, 16, 3, 64, 32
    q, kv, w, pos, slots, iq, iw = inputs(T, H, T - 2, nb, bs, nh, seed=FORMS.index((form, mxfp8, layout)) * 7
                                          + len(indexer or ""))
    fmt = _fmt(mxfp8, layout)
    c1 = torch.full((nb, L.page_bytes(bs, fmt)), POISON, dtype=torch.uint8)
    c2 = c1.clone()
    iq_, fp4 = (iq if indexer else None), indexer == "mxfp4"
    q_out = torch.full((T, Hp, 512), float("nan"), dtype=torch.bfloat16)
    a, ia = fused(q, kv, w, c1, slots, pos, CS, Hp, bs, True, mxfp8, layout, iq_, iw if indexer else None, fp4,
                  q_out=q_out)
    b, ib = unfused(q, kv, w, c2, slots, pos, CS, Hp, bs, True, mxfp8, layout, iq_, iw, fp4)
    assert a is q_out and torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert torch.equal(c1, c2)
    assert bool((slots < 0).all()) or not torch.equal(c1, torch.full_like(c1, POISON))    # T = 1: a padding slot
    assert (ia is None) == (indexer is None) and (ia is None or same_index(ia, ib, fp4))


BAD = [   # (the error names, the arguments that differ from a good call)
    ("kv must have dtype", lambda a: dict(kv=a["kv"].float())),
    ("kv_weight must have dtype", lambda a: dict(kv_weight=a["kv_weight"].float())),
    ("kv_weight must have shape", lambda a: dict(kv_weight=torch.ones(448, dtype=torch.bfloat16))),
    ("padded_heads must be", lambda a: dict(padded_heads=2)),
    ("slot_mapping has 7 entries", lambda a: dict(slot_mapping=torch.arange(7))),
    ("slot_mapping: slot", lambda a: dict(slot_mapping=a["slot_mapping"].clamp(min=0) + 128)),
    ("positions must lie", lambda a: dict(positions=a["positions"] + 4096)),
    ("block_size", lambda a: dict(block_size=0)),
    ("apply_q_norm must be a bool", lambda a: dict(apply_q_norm=1)),
    ("q_out must have shape", lambda a: dict(q_out=torch.zeros(6, 4, 512, dtype=torch.bfloat16))),
    ("index_q must have shape", lambda a: dict(index_q=a["index_q"][:, :, :64])),
    ("index_weights must have shape", lambda a: dict(index_weights=a["index_weights"][:, :3])),
    ("index_weights_softmax_scale", lambda a: dict(index_weights_softmax_scale=None)),
    ("index_use_fnuz=True", lambda a: dict(index_use_fp4=True, index_use_fnuz=True)),
    ("index_weights is given without index_q", lambda a: dict(index_q=None)),
]


@pytest.mark.parametrize("match, change", BAD, ids=[m for m, _ in BAD])
def test_bad_input_is_rejected_before_any_write(match, change):
    T, H, nb, bs = 6, 4, 2, 64
    q, kv, w, pos, slots, iq, iw = inputs(T, H, T, nb, bs, 8, seed=1)
    cache = torch.full((nb, L.page_bytes(bs, L.V40_584)), POISON, dtype=torch.uint8)
    q_out = torch.zeros(T, 8, 512, dtype=torch.bfloat16)
    args = dict(q=q, kv=kv, kv_weight=w, k_cache=cache, slot_mapping=slots, positions=pos, cos_sin_cache=CS,
                padded_heads=8, eps=EPS, block_size=bs, q_out=q_out, index_q=iq, index_weights=iw,
                index_weights_softmax_scale=1.0, index_weights_head_scale=1.0)
    args.update(change(args))
    with pytest.raises(ValueError, match=match):
        ops.decode_front(**args)
    assert torch.equal(cache, torch.full_like(cache, POISON)) and torch.equal(q_out, torch.zeros_like(q_out))


# ---- the Triton kernel under the interpreter ---------------------------------------------------------------
_INTERPRETED = textwrap.dedent("""
    import os
    os.environ["TRITON_INTERPRET"] = "1"
    import sys
    sys.path[:0] = ["tests", "tests/qkv"]
    import torch
    from helpers import patch_interpreter_bf16, patch_interpreter_fma, patch_interpreter_scalars
    patch_interpreter_bf16()
    patch_interpreter_fma()
    patch_interpreter_scalars()
    import test_decode_front as t
    from dsv4_rocm import layout as L
    from dsv4_rocm.reference import indexer as ri
    from dsv4_rocm.triton.qkv.decode_front import decode_front as K

    nb, bs, nh = 3, 16, 32
    cases = [("V40_584", False, None, True, None), ("V40_584", False, None, True, "fp8"),
             ("V41_528", True, None, False, "mxfp4"), ("V41_528 page_split", True, "page_split", True, "fp8")]
    for form, mxfp8, layout, norm, indexer in cases:
        T, H, Hp, n = 9, 6, 8, 7
        q, kv, w, pos, slots, iq, iw = t.inputs(T, H, n, nb, bs, nh, seed=len(form) + n)
        pos[3] = t.CS.shape[0] + 5                 # a position outside the table: zero q rows, no record
        fmt = t._fmt(mxfp8, layout)
        c1 = torch.full((nb, L.page_bytes(bs, fmt)), t.POISON, dtype=torch.uint8)
        c2 = c1.clone()
        q_out = torch.full((T, Hp, 512), float("nan"), dtype=torch.bfloat16)
        index = None
        fp4 = indexer == "mxfp4"
        if indexer:
            w_out = torch.full((T, nh), float("nan"))
            if fp4:
                out = torch.full((T, nh, 64), 0xAB, dtype=torch.uint8)
                scales = torch.full((T, nh, 4), 0xAB, dtype=torch.uint8)
            else:
                out = torch.full((T, nh, 128), 0xAB, dtype=torch.uint8).view(torch.float8_e4m3fn)
                scales = out
            index = (iq, t.CS, iw, 128 ** -0.5, nh ** -0.5, fp4, False, out, scales, w_out)
        K(q, kv, w, q_out, c1, slots, pos, t.CS, t.EPS, bs, norm, fmt, index)
        ok = (pos >= 0) & (pos < t.CS.shape[0])
        pos_ok = torch.where(ok, pos, 0)
        want_q = t.model_front(q, kv, w, c2, torch.where(ok[:n], slots, -1), pos_ok, t.CS, Hp, bs, norm, fmt)
        want_q[~ok] = 0
        q_same = torch.equal(q_out.view(torch.int16), want_q.view(torch.int16))
        cache_same = torch.equal(c1, c2) and not torch.equal(c1, torch.full_like(c1, t.POISON))
        idx_same = True
        if indexer:
            keep = ok.nonzero().squeeze(1)          # the indexer poisons an invalid position's heads
            ref = ri.fused_indexer_q_rope_quant(pos_ok[keep], iq[keep], t.CS, iw[keep], 128 ** -0.5, nh ** -0.5,
                                                fp4)
            got = (((out[keep], scales[keep].view(torch.int32).squeeze(-1)), w_out[keep]) if fp4
                   else (out[keep], w_out[keep]))
            idx_same = t.same_index(got, ref, fp4)
        print(form, indexer, int(q_same), int(cache_same), int(idx_same))
""")


def test_kernel_equals_the_unfused_math_under_the_interpreter(tmp_path):
    r = run_interpreted(_INTERPRETED, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    print(r.stdout)
    rows = [line.split() for line in r.stdout.strip().splitlines()]
    assert len(rows) == 4
    for row in rows:
        assert row[-3:] == ["1", "1", "1"], row          # q_out, cache bytes, indexer outputs


# ---- GPU -----------------------------------------------------------------------------------------------------
def _hip_built(dev):
    return "hip" in ops.machine_backends(dev)


@pytest.mark.gpu
@pytest.mark.parametrize("form, mxfp8, layout", FORMS)
@pytest.mark.parametrize("indexer", [None, "fp8", "mxfp4"])
@pytest.mark.parametrize("T", [1, 128, 257])
def test_gpu_fused_equals_the_unfused_ops(form, mxfp8, layout, indexer, T, gpu):
    """The Triton front against the three public ops run unfused on the same inputs, outputs poisoned: cache
    bytes, q_out bits, indexer bytes / scales / weights. q_out and the cache are compared where the unfused
    norms are the HIP kernels (dsv4_rocm._C built), whose sum order the fused kernel follows; their torch
    references sum in an order of the platform's, and the CPU model of the HIP order does not give the GPU's
    bits either (its sqrt and division round on the CPU)."""
    H, Hp, bs, nh = 64, 64, 64, 64
    nb = T // 32 + 2
    q, kv, w, pos, slots, iq, iw = inputs(T, H, T, nb, bs, nh, seed=T)
    fmt = _fmt(mxfp8, layout)
    c1 = torch.full((nb, L.page_bytes(bs, fmt)), POISON, dtype=torch.uint8, device=gpu)
    c2 = c1.clone()
    fp4 = indexer == "mxfp4"
    iq_, iw_ = (iq.to(gpu), iw.to(gpu)) if indexer else (None, None)
    args = [t.to(gpu) for t in (q, kv, w)]
    cs = CS.to(gpu)
    q_out = torch.full((T, Hp, 512), float("nan"), dtype=torch.bfloat16, device=gpu)
    with ops.use_backend("triton"):
        a, ia = fused(*args, c1, slots.to(gpu), pos.to(gpu), cs, Hp, bs, True, mxfp8, layout, iq_, iw_, fp4,
                      q_out=q_out)
    b, ib = unfused(*args, c2, slots.to(gpu), pos.to(gpu), cs, Hp, bs, True, mxfp8, layout, iq_, iw_, fp4)
    torch.cuda.synchronize()
    if indexer:
        assert same_index(ia, ib, fp4)
    if not _hip_built(gpu):
        pytest.skip("q_out and the cache need the HIP norms (dsv4_rocm._C) as the unfused reference")
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert torch.equal(c1, c2)
    assert bool((slots < 0).all()) or not torch.equal(c1, torch.full_like(c1, POISON))    # T = 1: a padding slot


@pytest.mark.gpu
def test_gpu_graph_replay(gpu):
    """Captured once, replayed with new q, kv, positions and slots: each replay equals the model."""
    T, H, Hp, nb, bs, nh = 64, 64, 64, 4, 64, 64
    q, kv, w, pos, slots, iq, iw = (t.to(gpu) for t in inputs(T, H, T, nb, bs, nh, seed=3))
    cache = torch.full((nb, L.page_bytes(bs, L.V40_584)), POISON, dtype=torch.uint8, device=gpu)
    q_out = torch.empty(T, Hp, 512, dtype=torch.bfloat16, device=gpu)
    cs = CS.to(gpu)

    def run():
        ops.decode_front(q, kv, w, cache, slots, pos, cs, Hp, EPS, bs, q_out=q_out)

    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for it in range(3):
        nq, nkv, _, npos, nslots, _, _ = inputs(T, H, T, nb, bs, nh, seed=10 + it)
        q.copy_(nq)
        kv.copy_(nkv)
        pos.copy_(npos)
        slots.copy_(nslots if it < 2 else torch.full_like(nslots, -1))
        cache.fill_(POISON)
        q_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        c = torch.full((nb, L.page_bytes(bs, L.V40_584)), POISON, dtype=torch.uint8)
        want = model_front(nq, nkv, w.cpu(), c, slots.cpu(), npos, CS, Hp, bs, True, L.V40_584)
        assert torch.equal(q_out.cpu().view(torch.int16), want.view(torch.int16)), it
        assert torch.equal(cache.cpu(), c), it


if __name__ == "__main__":
    import sys
    sys.exit(pytest.main([__file__, "-q"]))
