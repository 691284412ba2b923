"""Inputs and checks shared by the indexer tests: queries, indexer-K caches with block tables, the logits
tolerance, and DeepGEMM's own test helpers rewritten (its tests/test_attention.py semantics)."""
import os
import subprocess
import sys

import torch

from dsv4_rocm import layout as L
from dsv4_rocm import ops
from dsv4_rocm.reference import indexer as ri
from dsv4_rocm.reference.compressor import kv_cache_view

# Logits tolerance, relative to mag = |s_k| * sum_h |w_h| * sum_d |q_hd * k_d| (the same sums on absolute
# values). Two fp32 summation orders of 128 exact fp8 products and 64 weighted heads differ by at most
# about 192 * 2^-24 * mag, but Hopper's fp8 MMA accumulates its products with about 13 mantissa bits, not
# 23, so a 128-term dot may be off by up to 128 * 2^-13 = 2^-6 of the sum of its absolute terms
# (docs/numerics.md#indexer-logits). The tests print the measured ratio.
LOGIT_TOL = 2.0 ** -6


def query(T, H, g, dtype=torch.bfloat16, pos_max=4096):
    """(positions int64 [T], index_q [T, H, 128] with magnitudes spread per head, weights bf16 [T, H])."""
    mag = torch.exp2(torch.randint(-10, 10, (T, H, 1), generator=g).float())
    qi = (torch.randn(T, H, 128, generator=g) * mag).to(dtype)
    return torch.randint(0, pos_max, (T,), generator=g), qi, torch.randn(T, H, generator=g).bfloat16()


def new_pages(nb, bs, device="cpu", fill=0):
    """[nb, round_up(bs * 132, 576)] uint8 pages (vLLM pads the indexer page to 8640 B for bs = 64)."""
    return torch.full((nb, L.indexer_page_bytes(bs)), fill, dtype=torch.uint8, device=device)


def filled_cache(lens, bs, g, device="cpu", spare=3):
    """An indexer-K cache holding len entries of random keys for each request, on pages of a random
    permutation (``spare`` pages belong to no request and hold garbage). Returns (pages [nb, page bytes],
    the vLLM view [nb, bs, 132] of them, block_table int32 [B, cols], keys bf16 [sum(lens), 128])."""
    need = [-(-n // bs) for n in lens]
    nb = sum(need) + spare
    pages = torch.randint(0, 256, (nb, L.indexer_page_bytes(bs)), generator=g, dtype=torch.uint8)
    cols = max(need + [1])
    bt = torch.full((len(lens), cols), -1, dtype=torch.int32)
    perm = torch.randperm(nb, generator=g).to(torch.int32)
    o = 0
    for b, k in enumerate(need):
        bt[b, :k] = perm[o:o + k]
        o += k
    keys = (torch.randn(sum(lens), 128, generator=g) * torch.exp2(torch.randint(-6, 6, (sum(lens), 1), generator=g))
            ).bfloat16()
    slots = torch.cat([bt[b, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs for b, n in enumerate(lens)]
                      + [torch.zeros(0, dtype=torch.long)])
    view = kv_cache_view(pages, bs, L.INDEXER_TOKEN_BYTES)
    ops.indexer_k_quant_and_cache(keys, view, slots, 128, "ue8m0")
    pages, bt, keys = pages.to(device), bt.to(device), keys.to(device)
    return pages, kv_cache_view(pages, bs, L.INDEXER_TOKEN_BYTES), bt, keys


def abs_bytes(b: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes of the absolute values (sign bit cleared)."""
    return b.view(torch.uint8) & 0x7F


def abs_cache(pages, bs):
    """The same cache with every key and scale made non-negative (for the logits bound)."""
    p = pages.clone()
    p[:, :bs * 128] &= 0x7F
    p[:, bs * 128 + 3:bs * 132:4] &= 0x7F            # the sign byte of each little-endian fp32 scale
    return kv_cache_view(p, bs, L.INDEXER_TOKEN_BYTES)


def assert_logits_close(got, ref, mag, name="", tol=LOGIT_TOL, where=None):
    """-inf and NaN at the same places; elsewhere |got - ref| <= tol * mag. ``where`` limits the comparison
    (entries a kernel may leave unwritten are outside it)."""
    got, ref, mag = got.cpu().float(), ref.cpu().float(), mag.cpu().float()
    sel = torch.ones_like(ref, dtype=torch.bool) if where is None else where.cpu()
    assert torch.equal(torch.isneginf(got) & sel, torch.isneginf(ref) & sel), f"{name}: -inf entries differ"
    assert torch.equal(torch.isnan(got) & sel, torch.isnan(ref) & sel), f"{name}: NaN entries differ"
    fin = torch.isfinite(ref) & sel
    d = (got - ref).abs()[fin]
    m = mag[fin]
    rel = float((d / m.clamp_min(1e-30)).max()) if d.numel() else 0.0
    print(f"{name}: {int(fin.sum())} finite logits, max |diff| / mag = {rel:.3e} (bound {tol:.3e})")
    assert bool((d <= tol * m + 1e-30).all())


def calc_diff(x, y):
    """DeepGEMM's test metric: 1 - 2<x, y> / (|x|^2 + |y|^2), over the whole tensor."""
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum()
    return float(1 - 2 * (x * y).sum() / denom)


def per_row_cast_to_fp8(x):
    """DeepGEMM's per-row cast of K: scale amax / 448 (not a power of two), fp8 values, fp32 scales."""
    amax = x.abs().float().amax(dim=1, keepdim=True).clamp(1e-4)
    sf = amax / 448.0
    return (x.float() / sf).to(torch.float8_e4m3fn), sf.squeeze(1)


def paged_cache_cast_to_fp8(kv):
    """DeepGEMM's kv_cache_cast_to_fp8: bf16 [nb, bs, 1, 128] -> uint8 [nb, bs, 1, 132], the bs fp8 rows first
    and their fp32 scales (amax / 448) after them in each block."""
    nb, bs, _, d = kv.shape
    amax = kv.abs().float().amax(dim=3, keepdim=True).clamp(1e-4)
    sf = amax / 448.0
    vals = (kv.float() / sf).to(torch.float8_e4m3fn)
    out = torch.empty(nb, bs * (d + 4), dtype=torch.uint8, device=kv.device)
    out[:, :bs * d] = vals.view(nb, bs * d).view(torch.uint8)
    out[:, bs * d:] = sf.view(nb, bs).view(torch.uint8)
    return out.view(nb, bs, 1, d + 4)


def cp_ranges(seq_len, seq_len_kv):
    """DeepGEMM's context-parallel ks / ke: two chunks of queries with ranges of keys of another rank."""
    half, cp = seq_len // 2, seq_len_kv // seq_len
    rank = cp // 3
    ks = torch.zeros(seq_len, dtype=torch.int32)
    ke = torch.zeros(seq_len, dtype=torch.int32)
    for i in range(half):
        ke[i] = rank * half + i
        ke[i + half] = (cp * 2 - 1 - rank) * half + i
    return ks, ke


def deepgemm_paged_reference(q, kv, weights, context_lens, block_tables, max_model_len, lens_2d):
    """DeepGEMM's ref_fp8_paged_mqa_logits, rewritten: bf16 q [B, n, H, D] against bf16 kv [nb, bs, 1, D]."""
    B, nn, H, D = q.shape
    bs = kv.shape[1]
    out = torch.full((B * nn, max_model_len), float("-inf"), device=q.device)
    for i in range(B):
        cl = int(context_lens[i])
        q_off = torch.full((nn,), cl, device=q.device) if lens_2d else torch.arange(cl - nn, cl, device=q.device)
        nblk = -(-cl // bs)
        k = kv[block_tables[i, :nblk].long()].reshape(-1, D).float()
        s = torch.einsum("nhd,kd->hnk", q[i].float(), k)
        ko = torch.arange(nblk * bs, device=q.device)
        mask = (ko[None, :] < cl) & (ko[None, :] <= q_off[:, None])
        s = torch.where(mask[None], s, float("-inf")).relu() * weights[i * nn:(i + 1) * nn].t()[..., None]
        out[i * nn:(i + 1) * nn, :nblk * bs] = torch.where(ko[None, :] <= q_off[:, None], s.sum(0), float("-inf"))
    return out


def paged_magnitude(q8, pages, bs, weights, context_lens, bt, max_model_len):
    """mag of LOGIT_TOL for the paged logits (the oracle on absolute values)."""
    meta = torch.zeros(2, 2, dtype=torch.int32, device=q8.device)
    return ri.fp8_paged_mqa_logits(abs_bytes(q8), abs_cache(pages, bs), weights.abs(), context_lens, bt, meta,
                                   max_model_len)


def interpret(script, tmp_path):
    """Run a script under the Triton interpreter in a fresh process (the script sets TRITON_INTERPRET before
    importing triton; Triton reads kernel sources from files); returns the CompletedProcess."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    f = tmp_path / "interpreted.py"
    f.write_text(script)
    return subprocess.run([sys.executable, str(f)], cwd=root, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=root), timeout=600)
