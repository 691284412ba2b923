"""Inputs and checks shared by the sparse MLA tests (tests/attention/test_sparse_mla.py,
tests/attention/test_flash_mla_api.py, and the scripts they run under the Triton interpreter).

Tolerances (FlashMLA's own): the kernels round P to bf16 for the P.V product and accumulate in fp32 in
another order than the reference. Per element |o - r| <= 2/128 |r| + 2^-8 max_i |K_i| (max over the
query's valid keys, per dim): P's rounding (relative 2^-9 per weight) bounds the absolute error of an
output element by the largest key value it averages, not by its own size. Plus the tensor-wide cosine
difference < 5e-6 of FlashMLA's tests. lse (fp32, order of summation only): abs 1e-6 + rel 8/65536.
"""
import torch

from dsv4_rocm import layout as L
from dsv4_rocm.reference import attention as ra
from dsv4_rocm.reference import cache as rc
from helpers import cos_diff, random_indices, random_paged_cache

SM = 512 ** -0.5
INT_MIN, INT_MAX = -2 ** 31, 2 ** 31 - 1


def decode_case(b, s_q, h, bs_main, topk, bs_extra, extra_topk, device, seed, sink="random", lens_shape="b",
                num_blocks=None, formats=(L.V40_584, L.V40_584)):
    """Keyword arguments of a sparse decode call: random caches of the record ``formats`` (main, extra;
    every slot a valid record, page padding random), indices with -1 and out-of-range entries, random
    lengths, a sink with finite and +-inf entries ("random"), or none / all -inf / all +inf."""
    fmt, efmt = formats
    pages, _ = random_paged_cache(num_blocks or max(2, 4096 // bs_main), bs_main, "cpu", seed, fmt)
    cap = pages.shape[0] * bs_main
    idx, lens = random_indices(b, s_q, topk, cap, topk, "cpu", seed + 1)
    if lens_shape == "bsq":
        lens = torch.randint(0, topk + 1, (b, s_q), generator=torch.Generator().manual_seed(seed)).int()
    out = dict(q=None, k_cache=rc.flash_mla_view(pages, bs_main, fmt), indices=idx, topk_length=lens,
               extra_k_cache=None, extra_indices_in_kvcache=None, extra_topk_length=None)
    if bs_extra:
        epages, _ = random_paged_cache(num_blocks or max(2, 4096 // bs_extra), bs_extra, "cpu", seed + 2, efmt)
        eidx, elens = random_indices(b, s_q, extra_topk, epages.shape[0] * bs_extra, extra_topk, "cpu", seed + 3)
        out.update(extra_k_cache=rc.flash_mla_view(epages, bs_extra, efmt), extra_indices_in_kvcache=eidx,
                   extra_topk_length=elens)
    g = torch.Generator().manual_seed(seed + 4)
    out["q"] = torch.randn(b, s_q, h, 512, generator=g).to(torch.bfloat16)
    if sink == "random":
        s = torch.randn(h, generator=g) * 2
        s[::7] = float("-inf")
        s[3::11] = float("inf")
    else:
        s = {"none": None, "-inf": torch.full((h,), float("-inf")), "+inf": torch.full((h,), float("inf"))}[sink]
    out["attn_sink"] = s
    return {k: (_to(v, device) if isinstance(v, torch.Tensor) else v) for k, v in out.items()}


def _to(t, device):
    """Move to ``device`` keeping the strides: a cache view keeps its padded page stride (a plain .to()
    of a strided view would hand the kernels a contiguous, unpadded copy)."""
    if t.is_contiguous():
        return t.to(device)
    base = t.as_strided((t.untyped_storage().nbytes() // t.element_size(),), (1,), 0).to(device)
    return base.as_strided(t.shape, t.stride(), t.storage_offset())


DECODE_ARGS = ("q", "k_cache", "indices", "topk_length", "attn_sink", "extra_k_cache", "extra_indices_in_kvcache",
               "extra_topk_length")


def decode_args(a, scale=SM):
    """The positional arguments of ops.sparse_mla_decode / the launcher for a decode_case dict."""
    return tuple(a[k] for k in DECODE_ARGS) + (scale,)


def prefill_case(s_q, h, topk, s_kv, device, seed, sink="random", lonely_rows=(0, 1)):
    """(q, kv, indices, topk_length, attn_sink) with invalid indices of every kind (-1, INT_MIN, s_kv, INT_MAX)
    and, in ``lonely_rows``, queries with no valid key: length 0 (first), all indices invalid (second)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s_q, h, 512, generator=g).bfloat16()
    kv = torch.randn(s_kv, 1, 512, generator=g).bfloat16()
    idx = torch.randint(-max(1, s_kv // 10), s_kv + s_kv // 10 + 1, (s_q, 1, topk), generator=g).int()
    r = torch.rand(s_q, 1, topk, generator=g)
    idx = torch.where(r < 0.03, torch.full_like(idx, INT_MIN), torch.where(r > 0.97, torch.full_like(idx, INT_MAX), idx))
    lens = torch.randint(0, topk + 1, (s_q,), generator=g).int()
    if len(lonely_rows) > 0 and s_q > lonely_rows[0]:
        lens[lonely_rows[0]] = 0
    if len(lonely_rows) > 1 and s_q > lonely_rows[1]:
        idx[lonely_rows[1]] = torch.tensor([-1, INT_MIN, s_kv, INT_MAX], dtype=torch.int32).repeat(topk)[:topk]
    if sink == "random":
        s = torch.randn(h, generator=g)
        s[::5] = float("-inf")
        s[2::7] = float("inf")
    else:
        s = {"none": None, "-inf": torch.full((h,), float("-inf")), "+inf": torch.full((h,), float("inf"))}[sink]
    return tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in (q, kv, idx, lens, s))


def strided(t, fill=None):
    """The values of t in a view whose every dimension is padded in its allocation (last one by 64), so
    every stride differs from the contiguous one; the padding holds ``fill`` (NaN / 0x5A5A... by default)
    so a kernel that reads or writes it shows up."""
    if fill is None:
        fill = float("nan") if t.dtype.is_floating_point else 0x5A5A
    if t.dtype in (torch.uint8, torch.float8_e4m3fn):
        fill = 0x5A if t.dtype == torch.uint8 else float("nan")
    big = torch.full([s + 1 for s in t.shape[:-1]] + [t.shape[-1] + 64], fill, dtype=t.dtype, device=t.device)
    view = big[tuple(slice(0, s) for s in t.shape)]
    view.copy_(t)
    return view


def padded_out(shape, device):
    """An out buffer as an engine passes it: rows of a larger NaN-filled buffer (more heads than the call,
    rows beyond the call). Returns (out view, backing buffer)."""
    back = torch.full(list(shape[:-2]) + [shape[-2] + 64, 512], float("nan"), dtype=torch.bfloat16, device=device)
    back = torch.cat([back, back[:1]], 0)
    return back[:shape[0], ..., :shape[-2], :], back


def decode_key_amax(a, formats=(None, None)):
    """max |K| over each query's valid keys of both sets, per dim: [b, s_q, 1, 512]."""
    b, s_q = a["q"].shape[:2]
    K, valid = ra._paged_set(a["k_cache"], a["indices"], a["topk_length"], b, s_q, formats[0])
    amax = (K.abs() * valid.unsqueeze(-1)).amax(1) if K.shape[1] else torch.zeros(b * s_q, 512, device=K.device)
    if a.get("extra_k_cache") is not None:
        K2, v2 = ra._paged_set(a["extra_k_cache"], a["extra_indices_in_kvcache"], a["extra_topk_length"], b, s_q,
                               formats[1])
        amax = torch.maximum(amax, (K2.abs() * v2.unsqueeze(-1)).amax(1))
    return amax.reshape(b, s_q, 1, 512)


def prefill_key_amax(kv, idx, lens):
    i = idx[:, 0].long()
    valid = (i >= 0) & (i < kv.shape[0])
    if lens is not None:
        valid &= torch.arange(i.shape[1], device=i.device) < lens.long().unsqueeze(1)
    K = kv[:, 0].float()[torch.where(valid, i, 0)]
    return (K.abs() * valid.unsqueeze(-1)).amax(1).unsqueeze(1)


def check_out(out, ref, name, key_amax):
    """Kernel output against the reference output within the tolerances of the module docstring."""
    o, r = out.float(), ref.float()
    assert not torch.isnan(o).any(), f"{name}: NaN"
    tol = r.abs() * (2 / 128) + key_amax.float() * 2 ** -8
    bad = (o - r).abs() > tol
    cd = cos_diff(o, r)
    print(f"{name}: max abs {float((o - r).abs().max()) if o.numel() else 0:.3e}  cos-diff {cd:.2e}  "
          f"mismatches {int(bad.sum())}")
    assert int(bad.sum()) == 0, name
    assert cd < 5e-6, name


def check_lse(lse, ref):
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isposinf(lse), torch.isposinf(ref))
    torch.testing.assert_close(lse[fin], ref[fin], atol=1e-6, rtol=8 / 65536)


def check_lonely(out, lse, lonely, max_logits=None):
    """Queries without a valid key: out exactly 0, lse +inf (max_logits -inf); ``lonely`` indexes them."""
    assert torch.equal(out[lonely].float(), torch.zeros_like(out[lonely].float()))
    assert torch.isposinf(lse[lonely]).all()
    if max_logits is not None:
        assert torch.isneginf(max_logits[lonely]).all()
