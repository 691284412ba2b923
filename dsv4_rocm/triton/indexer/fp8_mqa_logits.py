"""Prefill logits of the lightning indexer over a contiguous K (DeepGEMM's ``fp8_mqa_logits``; the math is
dsv4_rocm.reference.indexer's).

For query row m (q [M, H, 128] e4m3, weights w [M, H]) and key n (k [N, 128] e4m3, fp32 scale s_k [N]):

    logit[m, n] = s_k[n] * sum_h w[m, h] * ReLU(q[m, h] . k[n])      for ks[m] <= n < ke[m], else -inf

(s_k is a power of two or NaN: applied after the head sum it equals ReLU((q . k) * s_k) summed; only the order
of the fp32 sums differs from the oracle). The products run on the fp8 matrix units, as in
``fp8_paged_mqa_logits`` (gfx942's fnuz reading included). A float8_e4m3fnuz q (Q_FNUZ) or k (K_FNUZ), vLLM's
gfx942 flavour, halves s_k once for each, as there.

Grid: (query blocks of BQ rows, key spans of SPAN keys). A program holds the BQ query tiles [H, 128] and
streams the BN-key tiles of its span that meet the union of its rows' ranges [min ks, max ke): each key
tile is read once for the BQ rows. The span's other tiles get -inf with clean_logits and are left
unwritten without it.
"""
import torch
import triton
import triton.language as tl

from .._launch import cdiv, launch
from .fp8_paged_mqa_logits import _as_fp8, _head_sum, _key_scale, facts_of, pad_heads


@triton.jit
def _fp8_mqa_logits_kernel(q_ptr, stride_qm, stride_qh, k_ptr, stride_kn, sk_ptr, w_ptr, stride_wm, ks_ptr, ke_ptr,
                           out_ptr, stride_om, num_rows, num_keys,
                           H: tl.constexpr, BQ: tl.constexpr, BN: tl.constexpr, SPAN: tl.constexpr,
                           CLEAN: tl.constexpr, FNUZ: tl.constexpr, Q_FNUZ: tl.constexpr, K_FNUZ: tl.constexpr):
    m0 = tl.program_id(0) * BQ
    n_lo = tl.program_id(1) * SPAN
    d = tl.arange(0, 128)
    h = tl.arange(0, H)
    qts = ()
    ws = ()
    starts = ()
    ends = ()
    lo_k = num_keys
    hi_k = 0
    for i in tl.static_range(BQ):
        m = m0 + i
        live = m < num_rows
        ks = tl.where(live, tl.minimum(tl.maximum(tl.load(ks_ptr + m, mask=live, other=0), 0), num_keys), 0)
        ke = tl.where(live, tl.minimum(tl.maximum(tl.load(ke_ptr + m, mask=live, other=0), ks), num_keys), 0)
        starts = starts + (ks,)
        ends = ends + (ke,)
        lo_k = tl.where(ke > ks, tl.minimum(lo_k, ks), lo_k)
        hi_k = tl.maximum(hi_k, ke)
        q = tl.load(q_ptr + m.to(tl.int64) * stride_qm + h[:, None] * stride_qh + d[None, :], mask=live, other=0)
        qts = qts + (tl.trans(_as_fp8(q, FNUZ)),)
        ws = ws + (tl.load(w_ptr + m.to(tl.int64) * stride_wm + h, mask=live, other=0.0),)
    n_hi = tl.minimum(n_lo + SPAN, num_keys)
    c_first = tl.minimum(tl.maximum(lo_k - n_lo, 0), SPAN) // BN
    c_last = tl.maximum(tl.cdiv(tl.minimum(tl.maximum(hi_k - n_lo, 0), SPAN), BN), c_first)
    j0 = tl.arange(0, BN)
    for c in range(c_first, c_last):
        n = n_lo + c * BN + j0
        inb = n < n_hi
        kb = tl.load(k_ptr + n.to(tl.int64)[:, None] * stride_kn + d[None, :], mask=inb[:, None], other=0)
        sk = tl.load(sk_ptr + n, mask=inb, other=0.0)
        sk = _key_scale(sk, FNUZ, Q_FNUZ, K_FNUZ)
        k = _as_fp8(kb, FNUZ)
        for i in tl.static_range(BQ):
            v = tl.where((n >= starts[i]) & (n < ends[i]), _head_sum(k, qts[i], ws[i]) * sk, float("-inf"))
            m = m0 + i
            tl.store(out_ptr + m.to(tl.int64) * stride_om + n, v, mask=inb & (m < num_rows))
    if CLEAN:
        ninf = tl.full([BN], float("-inf"), tl.float32)
        for c in range(0, SPAN // BN):
            n = n_lo + c * BN + j0
            if (c < c_first) | (c >= c_last):
                for i in tl.static_range(BQ):
                    m = m0 + i
                    tl.store(out_ptr + m.to(tl.int64) * stride_om + n, ninf, mask=(n < n_hi) & (m < num_rows))


def default_config(arch: str) -> dict:
    """Tile per target: two query rows (128 MMA columns at 64 heads) against 128-key tiles on NVIDIA (two
    warpgroups), 64-key tiles and four waves on AMD; spans of 2048 keys."""
    if arch.startswith("gfx"):
        return dict(BQ=2, BN=64, SPAN=2048, num_warps=4, num_stages=2)
    return dict(BQ=2, BN=128, SPAN=2048, num_warps=8, num_stages=3)


def fp8_mqa_logits(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits: bool = True, config: dict = None):
    """DeepGEMM's call form; arguments checked by ``dsv4_rocm.ops.fp8_mqa_logits``, which runs this kernel only
    where ``fp8_paged_mqa_logits.has_fp8_mma``."""
    arch, fnuz, _, _ = facts_of(q)
    k8, k_scale = kv
    M, N = q.shape[0], k8.shape[0]
    out = torch.empty(M, N, dtype=torch.float32, device=q.device)
    if M == 0 or N == 0:
        return out
    cfg = dict(default_config(arch), **(config or {}))
    qb, w = pad_heads(q.view(torch.uint8), weights)
    kb = k8.view(torch.uint8)
    launch(_fp8_mqa_logits_kernel)[(cdiv(M, cfg["BQ"]), cdiv(N, cfg["SPAN"]))](
        qb, qb.stride(0), qb.stride(1), kb, kb.stride(0), k_scale, w, w.stride(0), cu_seqlen_ks, cu_seqlen_ke,
        out, out.stride(0), M, N,
        H=qb.shape[1], BQ=cfg["BQ"], BN=cfg["BN"], SPAN=cfg["SPAN"], CLEAN=clean_logits, FNUZ=fnuz,
        Q_FNUZ=q.dtype == torch.float8_e4m3fnuz, K_FNUZ=k8.dtype == torch.float8_e4m3fnuz,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


def _spec(name, fnuz_operands):
    def constexprs(arch):
        c = default_config(arch)
        return dict(H=64, BQ=c["BQ"], BN=c["BN"], SPAN=c["SPAN"], CLEAN=True, FNUZ=arch == "gfx942",
                    Q_FNUZ=fnuz_operands, K_FNUZ=fnuz_operands)
    return dict(name=name, fn=_fp8_mqa_logits_kernel,
                pointers=dict(q_ptr="*u8", k_ptr="*u8", sk_ptr="*fp32", w_ptr="*fp32", ks_ptr="*i32", ke_ptr="*i32",
                              out_ptr="*fp32"),
                floats=(), constexprs=constexprs,
                options=lambda arch: {k: v for k, v in default_config(arch).items() if k.startswith("num_")},
                matrix=True)


COMPILE_SPECS = [
    _spec("fp8_mqa_logits", False),
    _spec("fp8_mqa_logits[fnuz q and k]", True),
]
