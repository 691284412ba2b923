"""merge_attn_states in vLLM's in-place form: (output, prefix_output, prefix_lse, suffix_output, suffix_lse,
output_lse=None, prefill_tokens_with_context=None, output_scale=None) -> None, lse [H, T].

CPU: the reference equals attention over the union of the two key sets (empty parts as +inf and -inf,
both empty -> 0 and -inf), tokens past the context copy the suffix, output aliasing an input, fp8 output
bytes (OCP, and the fnuz bytes vLLM writes on gfx942), vLLM's call forms, bad input rejected before any
write; the Triton kernel against the reference under the interpreter (dtypes, head sizes that are not
powers of two, strided views, partial contexts, fp8 outputs of both flavours; the gfx942 / gfx950 branches
in tests/tooling/amd_tier.py). GPU: the kernel against the reference at serving sizes and vLLM's test shapes, and
replayed in a CUDA graph. Tolerances: docs/numerics.md#merge-attn-states.
"""
import pytest
import torch

from dsv4_rocm import ops
from dsv4_rocm.reference import attention as ra
from dsv4_rocm.reference import output as O
from dsv4_rocm.reference.quant import e4m3_encode
from helpers import run_file_interpreted

# output dtype -> relative tolerance against the reference: one rounding of the output dtype (the fp32 values
# differ by a few ulps of exp / log), fp32 a few ulps
RTOL = {torch.float32: 1e-5, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def states(T, H, D, dtype=torch.bfloat16, seed=0, device="cpu", empty_frac=0.1):
    """Random partial states: outputs [T, H, D], lse [H, T] with some +inf / -inf (empty) entries, both sides
    empty at a few places."""
    g = torch.Generator().manual_seed(seed)
    po, so = (torch.randn(T, H, D, generator=g).to(dtype) for _ in range(2))
    pl, sl = (torch.randn(H, T, generator=g) * 4 for _ in range(2))
    r = torch.rand(H, T, generator=g)
    pl[r < empty_frac / 2] = float("inf")
    sl[(r >= empty_frac / 2) & (r < empty_frac)] = float("inf")
    pl[(r >= empty_frac) & (r < 1.2 * empty_frac)] = float("-inf")
    both = (r >= 1.2 * empty_frac) & (r < 1.3 * empty_frac)
    pl[both], sl[both] = float("inf"), float("-inf")
    return [t.to(device) for t in (po, pl, so, sl)]


def close(got, want, dtype):
    """Output / lse of the kernel against the reference: same NaN / inf positions, values within RTOL."""
    got, want = got.float(), want.float()
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and torch.equal(got.isnan(), want.isnan())
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], rtol=RTOL[dtype], atol=1e-6)


# ---- reference semantics (CPU) -------------------------------------------------------------------------
def test_merge_equals_attention_over_the_union():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(4, 3, 512, generator=g)
    K = torch.randn(4, 30, 512, generator=g)
    va = torch.zeros(4, 30, dtype=torch.bool)
    va[:, :12] = True
    va[2, :] = False                                   # prefix empty for token 2
    vb = ~va
    vb[3, :] = False                                   # suffix empty for token 3
    sm = 512 ** -0.5
    oa, la, _ = ra.attend(q, K, va, sm)               # lse [T, H], +inf where empty (FlashMLA's convention)
    ob, lb, _ = ra.attend(q, K, vb, sm)
    ou, lu, _ = ra.attend(q, K, va | vb, sm)
    out = torch.full_like(oa, float("nan"))
    lse = torch.full((3, 4), float("nan"))
    assert ops.merge_attn_states(out, oa, la.t(), ob, lb.t(), lse) is None     # lse as [H, T] views
    torch.testing.assert_close(out, ou, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, lu.t(), rtol=1e-6, atol=1e-6)
    lb[:, :] = float("-inf")                           # -inf marks an empty part too
    ops.merge_attn_states(out, oa, la.t(), ob, lb.t(), lse)
    torch.testing.assert_close(out[[0, 1, 3]], oa[[0, 1, 3]], rtol=1e-6, atol=1e-6)
    assert torch.equal(out[2], torch.zeros_like(out[2])) and torch.isneginf(lse[:, 2]).all()


def test_tokens_past_the_context_copy_the_suffix():
    po, pl, so, sl = states(6, 5, 64, seed=3)
    sl[1, 4] = float("inf")
    out, lse = torch.full_like(po, float("nan")), torch.full_like(pl, float("nan"))
    ops.merge_attn_states(out, po, pl, so, sl, lse, 4)
    assert torch.equal(out[4:], so[4:])
    want_lse = torch.where(torch.isposinf(sl), torch.full_like(sl, float("-inf")), sl)
    assert torch.equal(lse[:, 4:], want_lse[:, 4:])
    full, full_lse = torch.empty_like(po), torch.empty_like(pl)
    ops.merge_attn_states(full, po, pl, so, sl, full_lse)
    assert torch.equal(out[:4], full[:4]) and torch.equal(lse[:, :4], full_lse[:, :4])
    ops.merge_attn_states(out, po, pl, so, sl, lse, 0)          # no context: all copied
    assert torch.equal(out, so)


def test_output_may_be_an_input_and_output_lse_is_optional():
    po, pl, so, sl = states(5, 4, 32, dtype=torch.float32, seed=4)
    want = torch.empty_like(po)
    ops.merge_attn_states(want, po, pl, so, sl)
    before = (pl.clone(), sl.clone(), so.clone())
    ops.merge_attn_states(po, po, pl, so, sl)                   # in place over the prefix
    assert torch.equal(po, want)
    assert all(torch.equal(a, b) for a, b in zip(before, (pl, sl, so)))


def fp8_merge(odt, seed, specials):
    """(fp8 output of dtype odt, the fp32 merged values * (1 / scale)) of one merge with scale 0.05, context 5;
    token 0 head 0 (prefix alone: suffix empty) starts with the values ``specials``."""
    po, pl, so, sl = states(7, 4, 128, seed=seed)
    po[0, 0, :len(specials)] = torch.tensor(specials)
    pl[0, 0], sl[0, 0] = 0.0, float("-inf")
    scale = torch.tensor([0.05])
    out = torch.empty(7, 4, 128, dtype=odt)
    ops.merge_attn_states(out, po, pl, so, sl, None, 5, scale)
    merged = torch.empty(7, 4, 128)
    ops.merge_attn_states(merged, po, pl, so, sl, None, 5)
    return out.view(torch.uint8), merged * (1 / torch.tensor(0.05))


def test_fp8_output_bytes():
    out, x = fp8_merge(torch.float8_e4m3fn, 5, [1e-9, -1e-9, 1e4, -1e4])          # -0 and saturation
    assert torch.equal(out, e4m3_encode(x))
    assert int(out[0, 0, 1]) == 0 and int(out[0, 0, 2]) == 0x7E


def test_fp8_fnuz_output_bytes():
    """vLLM's fp8 output on gfx942 (output float8_e4m3fnuz): its kernel writes the fnuz byte of
    clamp(value * (1 / scale), +-224), rounded to nearest even, one zero byte. Stated here on its own:
    torch's e4m3fnuz cast of the clamped value. NaN is the fnuz NaN 0x80 (vLLM's fminf / fmaxf clamp would
    make it 224: docs/numerics.md#differences)."""
    out, x = fp8_merge(torch.float8_e4m3fnuz, 15, [1e-9, -1e-9, 1e4, -1e4, float("nan")])   # -0, saturation, NaN
    want = x.clamp(-224, 224).to(torch.float8_e4m3fnuz).view(torch.uint8)
    want[x.isnan()] = 0x80
    assert torch.equal(out, want)
    assert out[0, 0, :5].tolist() == [0, 0, 0x7E, 0xFE, 0x80]
    assert not bool((out[1:] == 0x80).any())
    fin = x.isfinite() & (x.abs() <= 224)
    got = out.view(torch.float8_e4m3fnuz).float()
    torch.testing.assert_close(got[fin], x[fin], rtol=2 ** -4, atol=2 ** -10)      # one fnuz step


def test_vllm_call_forms():
    po, pl, so, sl = states(3, 2, 16, seed=6)
    outs = [torch.empty_like(po) for _ in range(3)]
    ops.merge_attn_states(outs[0], po, pl, so, sl)
    ops.merge_attn_states(outs[1], po, pl, so, sl, None, None, None)
    ops.merge_attn_states(output=outs[2], prefix_output=po, prefix_lse=pl, suffix_output=so, suffix_lse=sl,
                          output_lse=None, prefill_tokens_with_context=3)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


PO, PL, SO, SL = states(4, 3, 16, seed=7)
PO_GAPS = torch.randn(4, 3, 32).bfloat16()[:, :, ::2]
BAD = [
    (lambda o, l: ops.merge_attn_states(o, PO, PL.t(), SO, SL, l), "prefix_lse must have shape"),
    (lambda o, l: ops.merge_attn_states(o, PO, PL, SO.float(), SL, l), "suffix_output must have dtype"),
    (lambda o, l: ops.merge_attn_states(o[:2], PO, PL, SO, SL, l), "output must have shape"),
    (lambda o, l: ops.merge_attn_states(o, PO.long(), PL, SO, SL, l), "prefix_output must have dtype"),
    (lambda o, l: ops.merge_attn_states(o, PO, PL.double(), SO, SL, l), "prefix_lse must have dtype"),
    (lambda o, l: ops.merge_attn_states(o, PO, PL, SO, SL, l[:, :2]), "output_lse must have shape"),
    (lambda o, l: ops.merge_attn_states(o, PO, PL, SO, SL, l, 5), "prefill_tokens_with_context"),
    (lambda o, l: ops.merge_attn_states(o, PO, PL, SO, SL, l, -1), "prefill_tokens_with_context"),
    (lambda o, l: ops.merge_attn_states(o, PO, PL, SO, SL, l, None, torch.ones(1)), "output must have dtype"),
    (lambda o, l: ops.merge_attn_states(o, PO_GAPS, PL, SO, SL, l), "prefix_output must have a contiguous last"),
    (lambda o, l: ops.merge_attn_states(o, PO, PL, SO, SL, l.double()), "output_lse must have dtype"),
]


@pytest.mark.parametrize("call, match", BAD)
def test_bad_input_is_rejected_before_any_write(call, match):
    out = torch.full((4, 3, 16), float("nan"), dtype=torch.bfloat16)
    lse = torch.full((3, 4), float("nan"))
    with pytest.raises(ValueError, match=match):
        call(out, lse)
    assert out.isnan().all() and lse.isnan().all()


def test_fp8_output_needs_a_one_value_scale():
    out = torch.empty(4, 3, 16, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="output_scale is required"):
        ops.merge_attn_states(out, PO, PL, SO, SL)
    with pytest.raises(ValueError, match="output_scale must hold one value"):
        ops.merge_attn_states(out, PO, PL, SO, SL, None, None, torch.ones(2))
    with pytest.raises(ValueError, match="output_scale is required when output is torch.float8_e4m3fnuz"):
        ops.merge_attn_states(out.view(torch.float8_e4m3fnuz), PO, PL, SO, SL)


# ---- the Triton kernel under the interpreter -------------------------------------------------------------
def interpreter_cases():
    """(name, T, H, D, input dtype, output dtype, n_ctx, strided, alias, with output_lse)."""
    return [
        ("bf16 512", 5, 16, 512, torch.bfloat16, torch.bfloat16, None, False, False, True),
        ("fp16 96 partial", 6, 3, 96, torch.float16, torch.float16, 4, False, False, True),
        ("fp32 48 strided", 4, 5, 48, torch.float32, torch.float32, 2, True, False, True),
        ("bf16 in fp32 out, no lse", 3, 4, 64, torch.bfloat16, torch.float32, None, True, False, False),
        ("in place over the prefix", 4, 6, 128, torch.bfloat16, torch.bfloat16, 3, False, True, True),
        ("no context", 3, 2, 32, torch.float32, torch.float32, 0, False, False, True),
        ("fp8 out", 4, 5, 128, torch.bfloat16, torch.float8_e4m3fn, 3, True, False, True),
        ("fp8 fnuz out", 4, 5, 128, torch.bfloat16, torch.float8_e4m3fnuz, 3, True, False, True),
    ]


def ordinal(b):
    """e4m3 bytes as integers in value order (0x00 and -0 at 0, 0x81 at -1): adjacent values differ by 1."""
    b = b.long()
    return torch.where(b >= 128, 128 - b, b)


def _strided(t, strided):
    """t [T, H, D] as a view with a padded head stride and a token stride of its own (vLLM's padded heads)."""
    if not strided:
        return t
    T, H, D = t.shape
    big = torch.full((T, H + 2, D + 8), float("nan"), dtype=t.dtype, device=t.device) if t.dtype.is_floating_point \
        and t.dtype.itemsize > 1 else torch.zeros((T, H + 2, D + 8), dtype=t.dtype, device=t.device)
    v = big[:, 1:H + 1, 4:D + 4]
    v.copy_(t)
    return v


def run_kernel_case(kernel, case, seed, device="cpu"):
    name, T, H, D, dt, odt, n_ctx, strided, alias, with_lse = case
    po, pl, so, sl = states(T, H, D, dtype=dt, seed=seed, device=device)
    po, so = _strided(po, strided), _strided(so, strided)
    pl, sl = pl.t().contiguous().t(), sl.t().contiguous().t()           # [H, T] views of [T, H] storage
    fp8 = odt in (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
    scale = torch.tensor([0.03], device=device) if fp8 else None
    if alias:
        out, ref_out = po, po.clone()
    else:
        out = _strided(torch.zeros(T, H, D, dtype=odt, device=device), strided)
        ref_out = torch.zeros(T, H, D, dtype=odt, device=device)
    lse = torch.full((H, T), float("nan"), device=device) if with_lse else None
    ref_lse = torch.full((H, T), float("nan"), device=device) if with_lse else None
    O.merge_attn_states(ref_out, po.clone() if alias else po, pl, so, sl, ref_lse, n_ctx, scale)
    kernel(out, po, pl, so, sl, lse, n_ctx, scale)
    if fp8:
        a, b = (ordinal(t.view(torch.uint8)) for t in (out, ref_out))
        ok = (a - b).abs() <= 1                        # one e4m3 step (the fp32 values differ by ulps of exp)
        if device == "cpu":
            # Triton 3.6's interpreter drops the carry of a mantissa that rounds up into the next binade
            # (31.97 -> 16 instead of 32); the GPU test holds those values to one step too
            ok |= (b.abs() % 8 == 0) & (b.abs() - a.abs() == 8) & (a * b > 0)
        assert bool(ok.all()), name
    else:
        close(out, ref_out, odt)
    if with_lse:
        close(lse, ref_lse, torch.float32)


def interpreter_main():
    from dsv4_rocm.triton.output.merge_attn_states import merge_attn_states as kernel
    n = 0
    for seed in range(2):
        for case in interpreter_cases():
            run_kernel_case(kernel, case, seed)
            n += 1
    print("interpreter cases passed:", n)


def test_triton_kernel_under_interpreter():
    """TRITON_INTERPRET=1 must be set before triton is imported: a subprocess runs this file's __main__."""
    r = run_file_interpreted(__file__)
    assert r.returncode == 0 and "interpreter cases passed: 16" in r.stdout


# ---- GPU ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("T, H, D, dt, odt, n_ctx", [
    (613, 48, 96, torch.float16, torch.float16, 128),             # vLLM's test shapes (first: the case the
    (4096, 128, 512, torch.bfloat16, torch.bfloat16, None),       # sanitizer pass runs); a DeepSeek-V4 prefill chunk
    (256, 4, 32, torch.float32, torch.float32, None),
    (1024, 64, 256, torch.bfloat16, torch.float8_e4m3fn, 128),
    (1024, 64, 256, torch.bfloat16, torch.float8_e4m3fnuz, 128),       # vLLM's gfx942 dtype, any GPU
    (3, 16, 512, torch.bfloat16, torch.bfloat16, 0),
])
def test_gpu_kernel_matches_the_reference(T, H, D, dt, odt, n_ctx, gpu):
    assert ops.backend_for("merge_attn_states", gpu) == "triton"
    for strided in (False, True):
        run_kernel_case(ops.merge_attn_states, ("gpu", T, H, D, dt, odt, n_ctx, strided, False, True), T, gpu)


@pytest.mark.gpu
def test_gpu_merge_replays_in_a_cuda_graph(gpu):
    """Captured once on fixed buffers, replayed on new values: each replay equals the reference."""
    T, H, D = 64, 128, 512
    po, pl, so, sl = states(T, H, D, seed=0, device=gpu)
    out, lse = torch.empty_like(po), torch.empty_like(pl)
    ops.merge_attn_states(out, po, pl, so, sl, lse, 40)            # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.merge_attn_states(out, po, pl, so, sl, lse, 40)
    for seed in (1, 2):
        for dst, src in zip((po, pl, so, sl), states(T, H, D, seed=seed, device=gpu)):
            dst.copy_(src)
        graph.replay()
        ref, ref_lse = torch.empty_like(out), torch.empty_like(lse)
        O.merge_attn_states(ref, po, pl, so, sl, ref_lse, 40)
        close(out, ref, torch.bfloat16)
        close(lse, ref_lse, torch.float32)


if __name__ == "__main__":
    interpreter_main()
