"""rocm_sparse_attn_decode / rocm_sparse_attn_prefill in the call forms of vLLM's ROCm DeepSeek-V4 layer
(vllm/models/deepseek_v4/amd/rocm.py calls them by keyword; the signatures are those of vLLM 0.33's
vllm/v1/attention/ops/rocm_aiter_mla_sparse.py).

The oracle here works from per-token Python lists of the keys each call form names (dense rows cut at
their lengths, ragged rows, -1 and slots past the cache dropped, as vLLM's kernels read them), gathers
the keys' dequantized values and attends with the sink in fp32. CPU (reference backend): dense, ragged and
mixed forms (the C4 layer's ragged top-k without dense rows, the C128 layer's both), the ragged form taking
precedence over the dense one, head counts the kernels do not take (padded and copied back), the folded
inverse RoPE and the return value, strided outputs written in place and nothing else, the scheduling hints,
bad input rejected before any write, vLLM's gfx942 FNUZ sliding-window cache read with ``use_fnuz``. GPU: the
same forms (and the FNUZ window) on the Triton kernels against the oracle within the sparse-attention
tolerances (tests/attention/sparse_mla_inputs.py), and the decode replayed in a CUDA graph.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dsv4_rocm import ops
from dsv4_rocm.reference import attention as ra
from dsv4_rocm.reference import cache as rc
from dsv4_rocm.reference import rope as R
from helpers import random_paged_cache
from sparse_mla_inputs import check_out

SM = 512 ** -0.5
CS = R.build_cos_sin_cache(10000.0, 8192)


# ---- inputs in vLLM's forms ----------------------------------------------------------------------------
def dense_rows(T, W, cap, seed, lens_max=None):
    """int32 [T, W] slot ids (some -1, some past the cache) and lengths [T] (0..lens_max)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cap, (T, W), generator=g)
    r = torch.rand(T, W, generator=g)
    idx[r < 0.05] = -1
    idx[(r >= 0.05) & (r < 0.08)] += cap
    lens = torch.randint(0, (W if lens_max is None else lens_max) + 1, (T,), generator=g)
    lens[:1] = W
    return idx.int(), lens.int()


def key_lists(idx, lens, cap):
    """The keys a dense form names, per token: entries before the length, 0 <= slot < cap."""
    out = []
    for t in range(idx.shape[0]):
        n = idx.shape[-1] if lens is None else int(lens[t])
        out.append([int(s) for s in idx.reshape(idx.shape[0], -1)[t, :n] if 0 <= int(s) < cap])
    return out


def ragged(lists, capacity_width, T):
    """vLLM's ragged form of per-token lists: (flat int32 [T * capacity_width], indptr int32 [T + 1])."""
    flat = torch.full((T * capacity_width,), -1, dtype=torch.int32)
    ptr = [0]
    for row in lists:
        flat[ptr[-1]:ptr[-1] + len(row)] = torch.tensor(row, dtype=torch.int32)
        ptr.append(ptr[-1] + len(row))
    return flat, torch.tensor(ptr, dtype=torch.int32)


def oracle(q, sets, sink, scale=SM):
    """fp32 [T, H, 512]: for each token one softmax with the sink over the keys of every (pages, bs, lists)
    set."""
    T, H, _ = q.shape
    outs = []
    for t in range(T):
        K = [rc.decode_k_records(rc.gather_k_records(p, torch.tensor(lists[t], dtype=torch.long), bs))
             for p, bs, lists in sets if lists[t]]
        K = torch.cat(K) if K else torch.zeros(0, 512)
        o, _, _ = ra.attend(q[t:t + 1].float(), K.unsqueeze(0), torch.ones(1, K.shape[0], dtype=torch.bool), scale,
                            None if sink is None else sink[:H])
        outs.append(o[0])
    return torch.stack(outs)


def vllm_view(pages, bs):
    """vLLM's [nb, bs, 584] view of padded pages (page stride kept)."""
    return torch.as_strided(pages, (pages.shape[0], bs, 584), (pages.stride(0), 584, 1))


def decode_inputs(T=6, H=16, W=24, K=40, seed=0, device="cpu"):
    """q, caches (vLLM's [nb, bs, 584] views), dense rows and lengths of both sets, sink, the key lists."""
    swa, _ = random_paged_cache(6, 16, "cpu", seed)
    comp, _ = random_paged_cache(8, 4, "cpu", seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    q = torch.randn(T, H, 512, generator=g).bfloat16()
    sink = torch.randn(max(H, 1), generator=g) * 2
    si, sl = dense_rows(T, W, 96, seed + 3)
    ti, tl_ = dense_rows(T, K, 32, seed + 4)
    d = dict(q=q, swa=vllm_view(swa, 16), comp=vllm_view(comp, 4), swa_idx=si, swa_lens=sl, topk_idx=ti,
             topk_lens=tl_, sink=sink)
    d = {k: v.to(device) for k, v in d.items()}
    d.update(swa_lists=key_lists(si, sl, 96), topk_lists=key_lists(ti, tl_, 32), swa_pages=swa, comp_pages=comp)
    return d


def decode_call(d, output, swa_only=False, form="dense", **kw):
    """rocm_sparse_attn_decode by keyword, as vLLM's ROCm layer calls it."""
    dev = d["q"].device
    T = d["q"].shape[0]
    args = dict(topk_indices=None, topk_lens=None, swa_ragged_indices=None, swa_ragged_indptr=None,
                topk_ragged_indices=None, topk_ragged_indptr=None)
    if form in ("dense", "c128"):
        args.update(topk_indices=d["topk_idx"], topk_lens=d["topk_lens"])
    if form in ("ragged", "c4", "c128"):
        sr, sp = ragged(d["swa_lists"], d["swa_idx"].shape[1], T)
        args.update(swa_ragged_indices=sr.to(dev), swa_ragged_indptr=sp.to(dev))
    if form in ("ragged", "c4", "c128"):
        tr, tp = ragged(d["topk_lists"], d["topk_idx"].shape[1], T)
        args.update(topk_ragged_indices=tr.to(dev), topk_ragged_indptr=tp.to(dev))
        if form == "c4":
            args.update(topk_lens=d["topk_lens"])
    args.update(kw)
    return ops.rocm_sparse_attn_decode(
        q=d["q"], kv_cache=None if swa_only else d["comp"], swa_k_cache=d["swa"], swa_only=swa_only,
        swa_indices=d["swa_idx"], swa_lens=d["swa_lens"], attn_sink=d["sink"], scale=SM, head_dim=512,
        nope_head_dim=448, rope_head_dim=64, output=output, **args)


def decode_oracle(d, swa_only=False):
    sets = [(d["swa_pages"], 16, d["swa_lists"])]
    if not swa_only:
        sets.append((d["comp_pages"], 4, d["topk_lists"]))
    return oracle(d["q"].cpu(), sets, d["sink"].cpu())


def assert_near(out, want):
    """CPU (reference backend, fp32 math): one bf16 rounding of each output, and the oracle's other order
    of summation: per (token, head) row, max |error| <= 2^-8 max |row|."""
    err = (out.float() - want).abs().amax(-1)
    assert bool((err <= 2 ** -8 * want.abs().amax(-1) + 1e-6).all()), float((err / want.abs().amax(-1)).max())


# ---- decode ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("H", [16, 64, 128, 1])
@pytest.mark.parametrize("swa_only", [True, False])
def test_decode_dense_forms_match_the_oracle(H, swa_only):
    d = decode_inputs(H=H)
    out = torch.full_like(d["q"], float("nan"))
    assert decode_call(d, out, swa_only) == 0
    assert_near(out, decode_oracle(d, swa_only))


@pytest.mark.parametrize("form", ["ragged", "c4", "c128"])
def test_decode_ragged_forms_match_the_oracle(form):
    d = decode_inputs(seed=3)
    out = torch.full_like(d["q"], float("nan"))
    decode_call(d, out, form=form)
    assert_near(out, decode_oracle(d))


def test_decode_ragged_form_is_used_over_the_dense_one():
    """vLLM reads the ragged rows when both are given: dense rows that name other keys are ignored."""
    d = decode_inputs(seed=4)
    want = torch.empty_like(d["q"])
    decode_call(d, want, form="c128")
    other = dict(d, swa_idx=torch.flip(d["swa_idx"], [1]), topk_idx=torch.flip(d["topk_idx"], [1]),
                 topk_lens=torch.zeros_like(d["topk_lens"]))
    other.update(swa_lists=d["swa_lists"], topk_lists=d["topk_lists"])
    got = torch.empty_like(d["q"])
    decode_call(other, got, form="c128")
    assert torch.equal(got, want)


def test_decode_folds_the_inverse_rope():
    d = decode_inputs(seed=5)
    g = torch.Generator().manual_seed(0)
    pos = torch.randint(0, CS.shape[0], (d["q"].shape[0],), generator=g)
    plain, rotated = torch.empty_like(d["q"]), torch.empty_like(d["q"])
    assert decode_call(d, plain, form="c4") == 0
    assert decode_call(d, rotated, form="c4", inv_rope_positions=pos, inv_rope_cos_sin_cache=CS) == 6
    R.rocm_inverse_rope_rows_(plain, pos, CS, 64)
    assert torch.equal(rotated, plain)


def test_decode_writes_a_strided_output_in_place():
    """output as vLLM passes it: the decode rows of a larger buffer."""
    d = decode_inputs(H=16, seed=6)
    back = torch.full((9, 16, 520), float("nan"), dtype=torch.bfloat16)
    view = back[1:7, :, 4:516]
    decode_call(d, view)
    want = torch.empty_like(d["q"])
    decode_call(d, want)
    assert torch.equal(view, want)
    assert back[0].isnan().all() and back[7:].isnan().all() and back[..., :4].isnan().all() \
        and back[..., 516:].isnan().all()


def test_decode_hints_change_nothing_and_indices_may_be_int64_or_3d():
    d = decode_inputs(seed=7)
    base = torch.empty_like(d["q"])
    decode_call(d, base)
    hinted = torch.empty_like(d["q"])
    decode_call(d, hinted, extra_cache_nan_free=True, adaptive_splits=True)
    assert torch.equal(hinted, base)
    d3 = dict(d, swa_idx=d["swa_idx"].long().unsqueeze(1), swa_lens=d["swa_lens"].long())
    other = torch.empty_like(d["q"])
    decode_call(d3, other)
    assert torch.equal(other, base)


def fnuz_window(d):
    """``d`` with its sliding-window cache rewritten as vLLM's gfx942 writer writes it: the same keys (the
    OCP records' values, bf16), FNUZ-flavour records (quantize_and_insert_k_cache(use_fnuz=True))."""
    pages = d["swa_pages"]
    nb, bs = pages.shape[0], 16
    k = rc.decode_k_records(rc.gather_k_records(pages, torch.arange(nb * bs), bs)).bfloat16()
    fz = torch.full_like(pages, 0x5A)
    ops.quantize_and_insert_k_cache(k, vllm_view(fz, bs), torch.arange(nb * bs), bs, use_fnuz=True)
    assert not torch.equal(fz, pages)
    return dict(d, swa=vllm_view(fz, bs).to(d["q"].device))


@pytest.mark.parametrize("form", ["dense", "c4"])
def test_decode_reads_vllms_fnuz_window_with_use_fnuz(form):
    """vLLM's gfx942 sliding-window cache holds FNUZ-flavour records (its compressed cache OCP ones): with
    ``use_fnuz=True`` the decode reads the same keys from it as from the OCP cache, so the outputs are the
    OCP decode's bit for bit; read as OCP, the window's keys are twice their value (the outputs differ)."""
    d = decode_inputs(seed=9)
    want = torch.empty_like(d["q"])
    decode_call(d, want, form=form)
    fz = fnuz_window(d)
    got = torch.full_like(d["q"], float("nan"))
    decode_call(fz, got, form=form, use_fnuz=True)
    assert torch.equal(got, want)
    wrong = torch.empty_like(d["q"])
    decode_call(fz, wrong, form=form)
    assert not torch.equal(wrong, want)


def test_decode_empty_batch():
    d = decode_inputs(T=0)
    out = torch.empty(0, 16, 512, dtype=torch.bfloat16)
    assert decode_call(d, out, form="c4", inv_rope_positions=torch.zeros(0, dtype=torch.long),
                       inv_rope_cos_sin_cache=CS) == 0


D0 = decode_inputs(seed=8)
BAD_DECODE = [
    (dict(output_mxfp8=(torch.zeros(1), torch.zeros(1))), "output_mxfp8"),
    (dict(head_dim=576), "head_dim"),
    (dict(swa_only=False, kv_cache=None), "kv_cache is required"),
    (dict(swa_ragged_indices=torch.zeros(4, dtype=torch.int32)), "must be given together"),
    (dict(topk_indices=None, topk_lens=None), "topk_indices is required"),
    (dict(swa_ragged_indices=torch.arange(6 * 24, dtype=torch.int32),
          swa_ragged_indptr=torch.tensor([0, 30, 30, 30, 30, 30, 30], dtype=torch.int32)), "more than the 24"),
    (dict(swa_indices=D0["swa_idx"][:, :3].t()), "swa_indices must have shape"),
    (dict(swa_k_cache=D0["swa"].view(6, -1)), "swa_k_cache must be an fp8_ds_mla cache"),
    (dict(attn_sink=D0["sink"][:4]), "attn_sink has 4 entries"),
    (dict(inv_rope_positions=torch.zeros(6, dtype=torch.long)), "inv_rope_cos_sin_cache is required"),
    (dict(inv_rope_positions=torch.zeros(6, dtype=torch.long), inv_rope_cos_sin_cache=CS[:, :32]),
     "inv_rope_cos_sin_cache must have shape"),
    (dict(inv_rope_positions=torch.full((6,), 10 ** 6), inv_rope_cos_sin_cache=CS), "inv_rope_positions must lie"),
    (dict(output=None), "output is required"),
    (dict(swa_only=1), "swa_only must be a bool"),
    (dict(use_fnuz=1), "use_fnuz must be a bool"),
]


@pytest.mark.parametrize("kw, match", BAD_DECODE)
def test_decode_bad_input_is_rejected_before_any_write(kw, match):
    out = torch.full_like(D0["q"], float("nan"))
    args = dict(q=D0["q"], kv_cache=D0["comp"], swa_k_cache=D0["swa"], swa_only=False, topk_indices=D0["topk_idx"],
                topk_lens=D0["topk_lens"], swa_indices=D0["swa_idx"], swa_lens=D0["swa_lens"],
                swa_ragged_indices=None, swa_ragged_indptr=None, topk_ragged_indices=None, topk_ragged_indptr=None,
                attn_sink=D0["sink"], scale=SM, head_dim=512, nope_head_dim=448, rope_head_dim=64, output=out)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        ops.rocm_sparse_attn_decode(**args)
    assert out.isnan().all()


# ---- prefill ---------------------------------------------------------------------------------------------
def prefill_inputs(T=5, H=16, S=50, K=36, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, 512, generator=g).bfloat16()
    kv = torch.randn(S, 1, 512, generator=g).bfloat16()
    idx, lens = dense_rows(T, K, S, seed + 1)
    sink = torch.randn(H, generator=g)
    d = dict(q=q, kv=kv, idx=idx, lens=lens, sink=sink)
    d = {k: v.to(device) for k, v in d.items()}
    d["lists"] = key_lists(idx, lens, S)
    return d


def prefill_oracle(d):
    T, H, _ = d["q"].shape
    kv = d["kv"].cpu()[:, 0].float()
    outs = []
    for t in range(T):
        K = kv[torch.tensor(d["lists"][t], dtype=torch.long)]
        o, _, _ = ra.attend(d["q"].cpu()[t:t + 1].float(), K.unsqueeze(0), torch.ones(1, K.shape[0], dtype=torch.bool),
                            SM, d["sink"].cpu())
        outs.append(o[0])
    return torch.stack(outs)


@pytest.mark.parametrize("H", [16, 64])
@pytest.mark.parametrize("form", ["dense", "dense3d", "ragged", "ragged_only", "no_lengths"])
def test_prefill_forms_match_the_oracle(H, form):
    d = prefill_inputs(H=H, seed=H)
    T = d["q"].shape[0]
    idx, lens, r, p = d["idx"], d["lens"], None, None
    if form == "dense3d":
        idx = idx.unsqueeze(1)
    if form in ("ragged", "ragged_only"):
        r, p = ragged(d["lists"], idx.shape[1], T)
        idx = None if form == "ragged_only" else idx.flip(1)
    if form == "no_lengths":
        lens = None
        d["lists"] = key_lists(d["idx"], None, d["kv"].shape[0])
    out = torch.full_like(d["q"], float("nan"))
    res = ops.rocm_sparse_attn_prefill(q=d["q"], kv=d["kv"], indices=idx, topk_length=lens, scale=SM, head_dim=512,
                                       nope_head_dim=448, rope_head_dim=64, attn_sink=d["sink"], output=out,
                                       ragged_indices=r, ragged_indptr=p)
    assert res is None
    assert_near(out, prefill_oracle(d))


def test_prefill_bad_input_is_rejected_before_any_write():
    d = prefill_inputs()
    out = torch.full_like(d["q"], float("nan"))
    base = dict(q=d["q"], kv=d["kv"], indices=d["idx"], topk_length=d["lens"], scale=SM, head_dim=512,
                nope_head_dim=448, rope_head_dim=64, attn_sink=d["sink"], output=out)
    for kw, match in [(dict(kv=d["kv"][:, 0]), "kv must be"), (dict(indices=None), "indices is required"),
                      (dict(rope_head_dim=32), "rope_head_dim"), (dict(topk_length=d["lens"][:2]), "topk_length"),
                      (dict(ragged_indptr=torch.zeros(6, dtype=torch.int32)), "must be given together")]:
        with pytest.raises(ValueError, match=match):
            ops.rocm_sparse_attn_prefill(**dict(base, **kw))
    assert out.isnan().all()


# ---- no allocation inside a call once its shapes have run (workspaces) --------------------------------
class Allocations(TorchDispatchMode):
    """Counts the aten calls that return a tensor on storage none of their arguments has (an allocation),
    except inside ``kernel`` (the attention and the index conversion implementations, whose own buffers
    are the kernels' business)."""

    def __init__(self):
        super().__init__()
        self.allocations, self.depth = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.depth == 0:
            have = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                    if isinstance(t, torch.Tensor)}
            self.allocations += [str(func) for t in tree_flatten(out)[0]
                                 if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in have]
        return out

    def kernel(self, fn):
        def run(*args, **kwargs):
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
        return run


def adapter_calls(d, T, out):
    """The adapters' allocating forms as calls with their inputs built: 16 heads (padded to 64), ragged rows,
    int64 and strided dense rows, int64 lengths, the folded inverse RoPE; decode (C4 and C128 forms) and
    prefill."""
    dev = d["q"].device
    sr, sp, tr, tp = (t.to(dev) for t in (*ragged(d["swa_lists"][:T], d["swa_idx"].shape[1], T),
                                          *ragged(d["topk_lists"][:T], d["topk_idx"].shape[1], T)))
    wide = torch.full((T, 2 * d["topk_idx"].shape[1]), -1, dtype=torch.long, device=dev)
    wide[:, ::2] = d["topk_idx"][:T]
    swa64, swa_lens64, topk_lens64, pos, cs = (d["swa_idx"][:T].long(), d["swa_lens"][:T].long(),
                                               d["topk_lens"][:T].long(), torch.arange(T, device=dev), CS.to(dev))
    common = dict(q=d["q"][:T], kv_cache=d["comp"], swa_k_cache=d["swa"], swa_only=False, attn_sink=d["sink"],
                  scale=SM, head_dim=512, nope_head_dim=448, rope_head_dim=64, output=out[:T])
    return [
        lambda: ops.rocm_sparse_attn_decode(
            **common, topk_indices=None, topk_lens=topk_lens64, swa_indices=None, swa_lens=None,
            swa_ragged_indices=sr, swa_ragged_indptr=sp, topk_ragged_indices=tr, topk_ragged_indptr=tp,
            inv_rope_positions=pos, inv_rope_cos_sin_cache=cs),
        lambda: ops.rocm_sparse_attn_decode(
            **common, topk_indices=wide[:, ::2], topk_lens=d["topk_lens"][:T], swa_indices=swa64,
            swa_lens=swa_lens64, swa_ragged_indices=None, swa_ragged_indptr=None, topk_ragged_indices=None,
            topk_ragged_indptr=None),
        lambda: ops.rocm_sparse_attn_prefill(d["q"][:T], d["kv"], None, None, SM, 512, 448, 64, d["sink"],
                                             out[:T], sr, sp)]


def test_adapters_allocate_nothing_once_a_shape_has_run(monkeypatch):
    """A serving step calls the adapters at shapes that have run before: they then allocate nothing (the
    attention's own buffers aside). Value checks are off, as they are for GPU tensors by default."""
    from dsv4_rocm.ops import vllm_rocm_sparse_attn as RA
    d = decode_inputs(T=6, H=16, seed=11)
    d["kv"] = torch.randn(300, 1, 512).bfloat16()
    mode = Allocations()
    monkeypatch.setattr(RA, "value_checks", lambda t: False)
    for name in ("_run", "sparse_mla_decode", "sparse_mla_prefill"):
        monkeypatch.setattr(RA, name, mode.kernel(getattr(RA, name)))
    out = torch.empty_like(d["q"])
    steps = adapter_calls(d, 6, out) + adapter_calls(d, 3, out)          # a smaller step after a larger one
    for call in steps[:3]:                              # the first calls at these shapes size the workspaces
        call()
    with mode:
        for call in steps:
            call()
    assert mode.allocations == []


def test_adapters_reuse_their_workspaces_and_stay_exact(monkeypatch):
    """Two decode steps at one shape hand the attention the same buffers (addresses), and each result is
    the oracle's: the workspaces carry nothing from one call into the next."""
    from dsv4_rocm.ops import vllm_rocm_sparse_attn as RA
    seen = []

    def spy(*args, **kwargs):     # (q, k_cache, idx, lens, sink, extra_cache, extra_idx, extra_lens, scale, out)
        seen.append([args[i].data_ptr() for i in (0, 2, 3, 4, 6, 7, 9)])
        return RA.sparse_mla_decode.__wrapped__(*args, **kwargs)
    spy.__wrapped__ = RA.sparse_mla_decode
    monkeypatch.setattr(RA, "sparse_mla_decode", spy)
    for seed in (12, 13):
        d = decode_inputs(H=16, seed=seed)
        d["topk_lens"] = d["topk_lens"].long()
        out = torch.full_like(d["q"], float("nan"))
        decode_call(d, out, form="c4")
        assert_near(out, decode_oracle(d))
    assert len(seen) == 2 and seen[0] == seen[1]


# ---- GPU -------------------------------------------------------------------------------------------------
def _key_amax(d, sets, device):
    """max |K| per (token, dim) over the token's keys of every set: [T, 1, 512] (the P-rounding tolerance)."""
    rows = []
    for t in range(d["q"].shape[0]):
        K = [rc.decode_k_records(rc.gather_k_records(p, torch.tensor(lists[t], dtype=torch.long), bs)).abs()
             for p, bs, lists in sets if lists[t]]
        rows.append(torch.cat(K).amax(0) if K else torch.zeros(512))
    return torch.stack(rows).unsqueeze(1).to(device)


@pytest.mark.gpu
@pytest.mark.parametrize("H", [16, 64, 128])
@pytest.mark.parametrize("form", ["dense", "c4", "c128"])
def test_gpu_decode_forms_match_the_oracle(H, form, gpu):
    d = decode_inputs(T=40, H=H, W=128, K=512, seed=H, device=gpu)
    out = torch.full_like(d["q"], float("nan"))
    decode_call(d, out, form=form)
    sets = [(d["swa_pages"], 16, d["swa_lists"]), (d["comp_pages"], 4, d["topk_lists"])]
    check_out(out.cpu(), decode_oracle(d), f"decode {form} H={H}", _key_amax(d, sets, "cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("H", [16, 128])
def test_gpu_decode_reads_vllms_fnuz_window(H, gpu):
    """The Triton decode over a FNUZ-flavour sliding-window cache and an OCP compressed one (one loop, the
    tile's flavour a run-time flag: on this OCP hardware the window's scale exponent - 1) against the oracle
    of the same keys."""
    d = decode_inputs(T=40, H=H, W=128, K=512, seed=H + 1, device=gpu)
    fz = fnuz_window(d)
    out = torch.full_like(d["q"], float("nan"))
    decode_call(fz, out, form="c4", use_fnuz=True)
    sets = [(d["swa_pages"], 16, d["swa_lists"]), (d["comp_pages"], 4, d["topk_lists"])]
    check_out(out.cpu(), decode_oracle(d), f"decode FNUZ window H={H}", _key_amax(d, sets, "cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("H", [16, 128])
def test_gpu_prefill_forms_match_the_oracle(H, gpu):
    d = prefill_inputs(T=64, H=H, S=3000, K=640, seed=H, device=gpu)
    r, p = ragged(d["lists"], 640, 64)
    for idx, rr, pp in ((d["idx"], None, None), (None, r.to(gpu), p.to(gpu))):
        out = torch.full_like(d["q"], float("nan"))
        ops.rocm_sparse_attn_prefill(d["q"], d["kv"], idx, d["lens"], SM, 512, 448, 64, d["sink"], out, rr, pp)
        kv = d["kv"].cpu()[:, 0].float()
        amax = torch.stack([kv[torch.tensor(lst, dtype=torch.long)].abs().amax(0) if lst else torch.zeros(512)
                            for lst in d["lists"]]).unsqueeze(1)
        check_out(out.cpu(), prefill_oracle(d), f"prefill H={H}", amax)


@pytest.mark.gpu
def test_gpu_decode_replays_in_a_cuda_graph(gpu):
    """The C4 form (ragged sliding window and top-k, folded inverse RoPE) captured once and replayed on new
    queries and index rows written into the same buffers: each replay equals the eager call."""
    d = decode_inputs(T=32, H=64, W=128, K=512, seed=1, device=gpu)
    T = 32
    sr, sp = ragged(d["swa_lists"], 128, T)
    tr, tp = ragged(d["topk_lists"], 512, T)
    bufs = dict(sr=sr.to(gpu), sp=sp.to(gpu), tr=tr.to(gpu), tp=tp.to(gpu),
                pos=torch.arange(T, device=gpu) * 7, cs=CS.to(gpu))
    out = torch.empty_like(d["q"])

    def step(o):
        return ops.rocm_sparse_attn_decode(
            q=d["q"], kv_cache=d["comp"], swa_k_cache=d["swa"], swa_only=False, topk_indices=None,
            topk_lens=d["topk_lens"], swa_indices=d["swa_idx"], swa_lens=d["swa_lens"],
            swa_ragged_indices=bufs["sr"], swa_ragged_indptr=bufs["sp"], topk_ragged_indices=bufs["tr"],
            topk_ragged_indptr=bufs["tp"], attn_sink=d["sink"], scale=SM, head_dim=512, nope_head_dim=448,
            rope_head_dim=64, output=o, inv_rope_positions=bufs["pos"], inv_rope_cos_sin_cache=bufs["cs"])
    step(out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(out)
    for seed in (2, 3):
        new = decode_inputs(T=T, H=64, W=128, K=512, seed=seed, device=gpu)
        d["q"].copy_(new["q"])
        for key, lists, w in (("s", new["swa_lists"], 128), ("t", new["topk_lists"], 512)):
            flat, ptr = ragged(lists, w, T)
            bufs[key + "r"].copy_(flat)
            bufs[key + "p"].copy_(ptr)
        graph.replay()
        eager = torch.empty_like(out)
        step(eager)
        assert torch.equal(out, eager)


def _allocations(fn):
    """Allocations torch's CUDA allocator counts during fn() (after a synchronize on each side)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    fn()
    torch.cuda.synchronize()
    return torch.cuda.memory_stats()["allocation.all.allocated"] - before


@pytest.mark.gpu
def test_gpu_adapters_allocate_no_more_than_the_attention(gpu):
    """A decode step and a prefill through the adapters (16 heads, ragged rows, int64 and strided index rows,
    int64 lengths, the folded inverse RoPE), once their shapes have run, make exactly as many allocations
    as the attention ops called on inputs already in their form (the attention's own lse / max-logits
    outputs): the adapters add none."""
    T = 24
    d = decode_inputs(T=T, H=16, W=128, K=512, seed=21, device=gpu)
    d["kv"] = torch.randn(3000, 1, 512, device=gpu).bfloat16()
    out = torch.empty_like(d["q"])
    calls = adapter_calls(d, T, out)
    q64 = torch.zeros(T, 1, 64, 512, dtype=torch.bfloat16, device=gpu)
    sink64 = torch.zeros(64, device=gpu)
    o64 = torch.empty_like(q64)
    swa_idx, topk_idx = d["swa_idx"].unsqueeze(1).contiguous(), d["topk_idx"].unsqueeze(1).contiguous()
    direct = [lambda: ops.sparse_mla_decode(q64, d["swa"], swa_idx, d["swa_lens"], sink64, d["comp"], topk_idx,
                                            d["topk_lens"], SM, o64),
              lambda: ops.sparse_mla_prefill(q64[:, 0], d["kv"], swa_idx, SM, 512, sink64, d["swa_lens"],
                                             o64[:, 0])]
    for c in calls + direct:                              # compile and size the workspaces
        c()
    counts = [_allocations(c) for c in calls]
    want = [_allocations(direct[0])] * 2 + [_allocations(direct[1])]
    print("allocations per call: adapters", counts, "attention alone", want)
    assert counts == want
