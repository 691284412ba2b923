"""qnorm_rope_and_insert_full_bf16_k_cache: vLLM 0.33.0's bf16 full-cache insert,
``torch.ops._C.fused_deepseek_v4_qnorm_rope_kv_rope_full_cache_bf16_insert(q, kv, k_cache, slot_mapping,
position_ids, cos_sin_cache, eps, cache_block_size, apply_q_norm=True) -> ()`` (also
``torch.ops.dsv4_rocm.<same name>``): q rewritten in place, kv rows into a plain [nb, bs, 512] bf16 cache.

CPU: the oracle against the formula written out here (q: float64 RMSNorm and RoPE, within one bf16 step
because the norm's sum order and the rsqrt are free (docs/numerics.md); kv rows: fp32 RoPE rounded once to
bf16, exact), vLLM's call forms,
DP padding (k rows past slot_mapping, slot -1), apply_q_norm=False, bad input rejected before any write; the
Triton kernel under the interpreter against the oracle (kv rows and unnormed q exact, normed q within one bf16
step). GPU: the kernel against the oracle at serving sizes, and a replay in a CUDA graph.
"""
import pytest
import torch

from dsv4_rocm import ops
from dsv4_rocm.reference import qkv as rq
from dsv4_rocm.reference.rope import build_cos_sin_cache
from helpers import random_k, run_file_interpreted

CS = build_cos_sin_cache(10000.0, 2048)
OP = ops.qnorm_rope_and_insert_full_bf16_k_cache
LIB = torch.ops.dsv4_rocm.fused_deepseek_v4_qnorm_rope_kv_rope_full_cache_bf16_insert


def setup(T=7, H=4, nb=3, bs=16, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(T, H, 512, generator=g) * torch.exp2(torch.randint(-6, 6, (T, H, 1), generator=g).float()))
    kv = random_k(T, gen=g)
    pos = torch.randint(0, 2048, (T,), generator=g)
    cache = torch.full((nb, bs, 512), 1234.5, dtype=torch.bfloat16)
    slots = torch.randperm(nb * bs, generator=g)[:T]
    return [t.to(device) for t in (q.bfloat16(), kv, pos, cache, slots)]


def formula(x, pos, norm, eps=1e-6, dtype=torch.float64):
    """RMSNorm without weight (if ``norm``) then GPT-J RoPE of dims 448..511 at ``pos``, per row, in ``dtype``
    (float32: the kernels' products and sums, each rounded once)."""
    x = x.to(dtype)
    if norm:
        x = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    c, s = CS[pos].to(dtype)[..., :32], CS[pos].to(dtype)[..., 32:]
    while c.dim() < x.dim():
        c, s = c.unsqueeze(-2), s.unsqueeze(-2)
    e, o = x[..., 448::2].clone(), x[..., 449::2].clone()
    x[..., 448::2], x[..., 449::2] = e * c - o * s, e * s + o * c
    return x


def within_one_bf16_step(got, want):
    """bf16 against a finer value: one bf16 step (2^-7 relative), plus 2^-16 of the row's largest value where
    RoPE's e c - o s cancels (docs/numerics.md: the fp32 rounding there is relative to the terms)."""
    got, want = got.double(), want.double()
    tol = want.abs() * 2 ** -7 + want.abs().amax(-1, keepdim=True) * 2 ** -16
    assert bool(((got - want).abs() <= tol).all()), float(((got - want).abs() / tol).max())


def check(q0, q, kv, pos, before, cache, slots, bs, norm=True):
    """q rows and cache rows against the formula; cache rows without a valid slot keep their bytes."""
    within_one_bf16_step(q, formula(q0, pos, norm))
    n = slots.shape[0]
    want = before.clone()
    for t in range(n):
        s = int(slots[t])
        if s >= 0:
            want[s // bs, s % bs] = formula(kv[t], pos[t], False, dtype=torch.float32).bfloat16()
    for t in range(n):
        s = int(slots[t])
        if s >= 0:
            within_one_bf16_step(cache[s // bs, s % bs], formula(kv[t], pos[t], False))
    assert torch.equal(cache.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("norm", [True, False])
def test_oracle_and_op_against_the_formula(norm):
    q, kv, pos, cache, slots = setup()
    slots[[1, 4]] = -1
    for run in (lambda *a: rq.qnorm_rope_and_insert_full_bf16_k_cache(*a, norm),
                lambda *a: OP(*a, apply_q_norm=norm), lambda *a: LIB(*a, norm)):
        qq, c = q.clone(), cache.clone()
        assert run(qq, kv, c, slots, pos, CS, 1e-6, 16) is None
        check(q, qq, kv, pos, cache, c, slots, 16, norm)


def test_dp_padding_rows_past_slot_mapping_are_not_inserted():
    """vLLM's DP padding: q, kv, positions have more rows than slot_mapping; every q row is rewritten, only
    the first len(slot_mapping) kv rows are inserted (and no -1 slot)."""
    q, kv, pos, cache, slots = setup(T=9)
    kv[5:] = float("nan")                                  # rows past slot_mapping: never read
    slots = slots[:5].clone()
    slots[2] = -1
    qq, c = q.clone(), cache.clone()
    OP(qq, kv, c, slots, pos, CS, 1e-6, 16)
    check(q, qq, kv, pos, cache, c, slots, 16)
    assert not c.isnan().any()


def test_vllm_call_forms_and_cache_views():
    """Keywords as vLLM's layer passes them, int32 indices, a bf16 cos/sin table, a cache of padded blocks."""
    q, kv, pos, cache, slots = setup(seed=3)
    want_q, want_c = q.clone(), cache.clone()
    rq.qnorm_rope_and_insert_full_bf16_k_cache(want_q, kv, want_c, slots, pos, CS, 1e-6, 16)
    qq, c = q.clone(), cache.clone()
    OP(q=qq, kv=kv, k_cache=c, slot_mapping=slots.int(), position_ids=pos.int(), cos_sin_cache=CS, eps=1e-6,
       cache_block_size=16, apply_q_norm=True)
    assert torch.equal(qq, want_q) and torch.equal(c, want_c)
    big = torch.full((3, 20, 512), 7.0, dtype=torch.bfloat16)             # blocks padded to 20 rows
    OP(q.clone(), kv, big[:, :16], slots, pos, CS, 1e-6, 16)
    assert torch.equal(big[:, :16], want_c.where(want_c != 1234.5, torch.tensor(7.0).bfloat16()))
    assert (big[:, 16:] == 7.0).all()
    qb, cb = q.clone(), cache.clone()
    OP(qb, kv, cb, slots, pos, CS.bfloat16(), 1e-6, 16)
    want_b, want_cb = q.clone(), cache.clone()
    rq.qnorm_rope_and_insert_full_bf16_k_cache(want_b, kv, want_cb, slots, pos, CS.bfloat16().float(), 1e-6, 16)
    assert torch.equal(qb, want_b) and torch.equal(cb, want_cb)


def _bad():
    q, kv, pos, cache, slots = setup(seed=5)
    yield "k_cache must have dtype", (q, kv, cache.float(), slots, pos, CS, 1e-6, 16)
    yield "k_cache must have shape", (q, kv, cache, slots, pos, CS, 1e-6, 8)
    yield "k_cache rows must be dense", (q, kv, torch.zeros(16, 3, 512).bfloat16().transpose(0, 1), slots, pos, CS,
                                         1e-6, 16)
    yield "slot_mapping has 8 entries", (q, kv, cache, torch.arange(8), pos, CS, 1e-6, 16)
    yield "slot_mapping", (q, kv, cache, slots + 100, pos, CS, 1e-6, 16)
    yield "positions must lie", (q, kv, cache, slots, pos + 2048, CS, 1e-6, 16)
    yield "q must have dtype", (q.float(), kv, cache, slots, pos, CS, 1e-6, 16)
    yield "q must have a contiguous last", (q.transpose(1, 2).contiguous().transpose(1, 2), kv, cache, slots, pos, CS,
                                            1e-6, 16)
    yield "q: elements overlap", (q[:1].expand(7, 4, 512), kv, cache, slots, pos, CS, 1e-6, 16)
    yield "eps", (q, kv, cache, slots, pos, CS, -1.0, 16)
    yield "apply_q_norm must be a bool", (q, kv, cache, slots, pos, CS, 1e-6, 16, 1)


@pytest.mark.parametrize("match, args", list(_bad()), ids=[m for m, _ in _bad()])
def test_bad_input_is_rejected_before_any_write(match, args):
    q, cache = args[0], args[2]
    before_q, before_c = q.clone(), cache.clone()
    with pytest.raises(ValueError, match=match):
        OP(*args)
    assert torch.equal(q, before_q) and torch.equal(cache, before_c)


# ---- the Triton kernel ---------------------------------------------------------------------------------
def kernel_case(kernel, T, H, seed, device, norm=True, pad_positions=False):
    """The kernel against the oracle on poisoned-free inputs: kv rows exact, q exact without the norm and
    within one bf16 step with it; padding positions give zero q rows and no insert."""
    q, kv, pos, cache, slots = setup(T=T, H=H, nb=(T + 15) // 16 + 1, seed=seed, device=device)
    slots[::5] = -1
    if pad_positions:
        pos[1::7] = 2048 + 3
    n = T - T // 6
    qk, ck, qr, cr = q.clone(), cache.clone(), q.clone(), cache.clone()
    kernel(qk, kv, ck, slots[:n], pos, CS.to(device), 1e-6, 16, norm)
    rq.qnorm_rope_and_insert_full_bf16_k_cache(qr, kv, cr, slots[:n], pos, CS.to(device), 1e-6, 16, norm)
    assert torch.equal(ck.view(torch.int16), cr.view(torch.int16))
    if norm:
        within_one_bf16_step(qk, qr)
    else:
        assert torch.equal(qk.view(torch.int16), qr.view(torch.int16))
    if pad_positions:
        assert not qk[1::7].any()


def interpreter_main():
    from helpers import patch_interpreter_bf16, patch_interpreter_scalars
    patch_interpreter_scalars()
    patch_interpreter_bf16()
    from dsv4_rocm.triton.qkv.qnorm_rope_and_insert_full_bf16_k_cache import qnorm_rope_and_insert_full_bf16_k_cache as K
    n = 0
    for norm in (True, False):
        for pad in (False, True):
            kernel_case(K, 13, 3, n, "cpu", norm, pad)
            n += 1
    print("interpreter cases passed:", n)


def test_triton_kernel_under_interpreter():
    r = run_file_interpreted(__file__)
    assert r.returncode == 0 and "interpreter cases passed: 4" in r.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("T, H", [(1, 64), (37, 16), (2048, 128)])
def test_gpu_kernel_matches_the_oracle(T, H, gpu):
    assert ops.backend_for("qnorm_rope_and_insert_full_bf16_k_cache", gpu) == "triton"
    for norm in (True, False):
        kernel_case(OP, T, H, T, gpu, norm)


@pytest.mark.gpu
def test_gpu_graph_replay(gpu):
    q, kv, pos, cache, slots = setup(T=64, H=64, nb=5, seed=1, device=gpu)
    qs, cs = q.clone(), CS.to(gpu)
    OP(qs.clone(), kv, cache.clone(), slots, pos, cs, 1e-6, 16)           # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        OP(qs, kv, cache, slots, pos, cs, 1e-6, 16)
    for seed in (2, 3):
        nq, nkv, npos, _, nslots = setup(T=64, H=64, nb=5, seed=seed, device=gpu)
        for dst, src in ((qs, nq), (kv, nkv), (pos, npos), (slots, nslots)):
            dst.copy_(src)
        want_q, want_c = nq.clone(), cache.clone()
        graph.replay()
        rq.qnorm_rope_and_insert_full_bf16_k_cache(want_q, nkv, want_c, nslots, npos, cs, 1e-6, 16)
        assert torch.equal(cache, want_c)
        within_one_bf16_step(qs, want_q)


if __name__ == "__main__":
    interpreter_main()
