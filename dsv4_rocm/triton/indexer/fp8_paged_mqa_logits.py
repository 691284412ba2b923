"""Decode logits of the lightning indexer over the paged indexer-K cache (DeepGEMM's
``fp8_paged_mqa_logits``; the math is dsv4_rocm.reference.indexer's).

For request b and its draft rows i < NEXT_N (row r = b * NEXT_N + i), key j < n_i (n_i = the keys row i sees,
clamped into [0, min(max_model_len, max_blocks * bs)]):

    logit[r, j] = s_k[j] * sum_h w[r, h] * ReLU(q[b, i, h] . k[j])

with k[j] the 128 e4m3 bytes of entry j at page block_tables[b, j // bs] (offset o = j % bs: bytes at
page * stride + o * 128, fp32 scale s_k at page * stride + bs * 128 + o * 4). s_k is a power of two (or NaN for
a poisoned entry), so applying it after the head sum equals ReLU((q . k) * s_k) summed: the results differ
from the oracle's only in the order of the fp32 sums. Keys past n_i, and keys whose block-table entry is
negative or past the cache (never read), are -inf.

The fp8 products run on the matrix units: wgmma / tcgen05 e4m3 on NVIDIA, MFMA on AMD. gfx942's MFMA reads
fnuz e4m3, whose value is half the OCP one for every byte the cache holds (0x80, OCP -0, is mapped to 0x00
first): its products are a quarter of the OCP ones and s_k is multiplied by 4 (exact). The OCP NaN bytes
read as +-240 there; a poisoned key or query still gives NaN, through its NaN scale or weight.

A float8_e4m3fnuz query (Q_FNUZ; vLLM's gfx942 query, docs/numerics.md#fnuz-query) holds the bytes the OCP
query would and weights folded with twice its scale: the kernel reads its bytes as it reads OCP ones and
halves s_k (exact, s_k being a power of two), which is reading them as fnuz. Its writers never emit 0x7F or
0xFF (their maximum is 224) and emit 0x80 (fnuz NaN) only for a poisoned head, whose weight is NaN: read as 0
here, that head still makes the logits NaN.

Grid: (B, SPLITS). Program (b, s) reads the NEXT_N query tiles [H, 128] and weights of request b once, then
streams its share of b's key tiles (BN keys a tile, a contiguous range of the tiles covering max_i n_i): every
key tile is read once for all draft rows. SPLITS is picked from B, the SM count and max_model_len (host
values), so the grid needs no host sync and a graph replays it for any context lengths. With CLEAN the columns past the last key tile,
up to max_model_len, are filled with -inf (split over the programs of the request); without it they are
left unwritten. DeepGEMM's schedule_metadata is not needed: the key tiles of a request are split evenly.
"""
import functools

import torch
import triton
import triton.language as tl

from .._fp8 import mma_operand
from .._launch import cdiv, device_facts, launch, next_power_of_2
from .._pdl import pdl_start

TAIL = 1024          # columns a program fills with -inf per step
MIN_TILES = 4        # key tiles a split should have at least (a split reloads q and the weights)


@triton.jit
def _as_fp8(b, FNUZ: tl.constexpr):
    """OCP e4m3 bytes as the fp8 operand of the matrix unit (module docstring for gfx942's fnuz reading)."""
    if FNUZ:
        f = mma_operand(tl.where(b == 0x80, 0, b).to(tl.uint8), True)
    else:
        f = mma_operand(b, False)
    return f


@triton.jit
def _key_scale(sk, FNUZ: tl.constexpr, Q_FNUZ: tl.constexpr, K_FNUZ: tl.constexpr):
    """s_k times the factor that makes up how the bytes are read: x 4 when the matrix unit reads OCP bytes
    of both operands as fnuz (gfx942), x 1/2 for each operand whose bytes are fnuz (module docstring). All
    exact: s_k is a power of two or NaN."""
    if FNUZ:
        sk = sk * 4.0
    if Q_FNUZ:
        sk = sk * 0.5
    if K_FNUZ:
        sk = sk * 0.5
    return sk


@triton.jit
def _head_sum(k, qt, w):
    """[BN] sum_h w[h] * ReLU(k[n] . q_h) for a key tile k [BN, 128] and one query's heads qt [128, H] (fp8);
    ReLU keeps NaN (a poisoned q row carries NaN weights, a poisoned key a NaN scale, either way NaN)."""
    acc = tl.dot(k, qt)
    return tl.sum(tl.maximum(acc, 0.0, propagate_nan=tl.PropagateNan.ALL) * w[None, :], axis=1)


@triton.jit
def _tile_pages(bt_row, c, hi, n_max, j0, BN: tl.constexpr, BS: tl.constexpr):
    """Block-table entries of the keys of tile c (-1 past n_max, or when tile c is not this program's)."""
    j = c * BN + j0
    return tl.load(bt_row + j // BS, mask=(j < n_max) & (c < hi), other=-1)


@triton.jit
def _fp8_paged_mqa_logits_kernel(
        q_ptr, stride_qb, stride_qn, stride_qh, cache_ptr, page_stride, num_pages, w_ptr, stride_wr,
        cl_ptr, stride_clb, bt_ptr, stride_bt, bt_cols, out_ptr, stride_or, max_len,
        NEXT_N: tl.constexpr, H: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, SPLITS: tl.constexpr,
        CTX_2D: tl.constexpr, CLEAN: tl.constexpr, FNUZ: tl.constexpr, TAIL_N: tl.constexpr,
        Q_FNUZ: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    d = tl.arange(0, 128)
    h = tl.arange(0, H)
    limit = tl.minimum(max_len, bt_cols * BS)
    qts = ()
    ws = ()
    seen = ()
    n_max = 0
    for i in tl.static_range(NEXT_N):
        if CTX_2D:
            n = tl.load(cl_ptr + b * stride_clb + i)
        else:
            n = tl.load(cl_ptr + b * stride_clb) - (NEXT_N - 1 - i)
        n = tl.minimum(tl.maximum(n, 0), limit)
        seen = seen + (n,)
        n_max = tl.maximum(n_max, n)
        q = tl.load(q_ptr + b * stride_qb + i * stride_qn + h[:, None] * stride_qh + d[None, :])
        qts = qts + (tl.trans(_as_fp8(q, FNUZ)),)
        ws = ws + (tl.load(w_ptr + (b * NEXT_N + i) * stride_wr + h),)
    tiles = tl.cdiv(n_max, BN)
    lo = s * tiles // SPLITS
    hi = (s + 1) * tiles // SPLITS
    bt_row = bt_ptr + b * stride_bt
    j0 = tl.arange(0, BN)
    # the pages of tile c + 1 are loaded during tile c: the key and scale loads of a tile then depend only
    # on values carried into its iteration, and the pipeliner issues them stages ahead (cp.async)
    p_nxt = _tile_pages(bt_row, lo, hi, n_max, j0, BN, BS)
    for c in range(lo, hi):
        j = c * BN + j0
        page = p_nxt.to(tl.int64)
        p_nxt = _tile_pages(bt_row, c + 1, hi, n_max, j0, BN, BS)
        ok = (j < n_max) & (page >= 0) & (page < num_pages)
        base = cache_ptr + tl.where(ok, page, 0) * page_stride
        kb = tl.load(base[:, None] + (j % BS)[:, None] * 128 + d[None, :], mask=ok[:, None], other=0)
        sk = tl.load((base + BS * 128 + (j % BS) * 4).to(tl.pointer_type(tl.float32)), mask=ok, other=0.0)
        sk = _key_scale(sk, FNUZ, Q_FNUZ, False)
        k = _as_fp8(kb, FNUZ)
        for i in tl.static_range(NEXT_N):
            v = tl.where(ok & (j < seen[i]), _head_sum(k, qts[i], ws[i]) * sk, float("-inf"))
            tl.store(out_ptr + (b * NEXT_N + i) * stride_or + j, v, mask=j < max_len)
    if CLEAN:
        first = tiles * BN
        per = tl.cdiv(tl.cdiv(tl.maximum(max_len - first, 0), SPLITS), TAIL_N) * TAIL_N
        t_lo = first + s * per
        t_hi = tl.minimum(t_lo + per, max_len)
        jt = tl.arange(0, TAIL_N)
        ninf = tl.full([TAIL_N], float("-inf"), tl.float32)
        for c0 in range(t_lo, t_hi, TAIL_N):
            for i in tl.static_range(NEXT_N):
                tl.store(out_ptr + (b * NEXT_N + i) * stride_or + c0 + jt, ninf, mask=c0 + jt < t_hi)


def default_config(arch: str) -> dict:
    """Key tile and launch shape per target. NVIDIA: 128-key tiles over two warpgroups (one wgmma M = 64 each),
    three cp.async stages; AMD: 64-key tiles, four waves, two stages (64 KB of LDS on gfx942). ``waves``:
    programs per SM the splits aim at (the grid is B x SPLITS)."""
    if arch.startswith("gfx"):
        return dict(BN=64, num_warps=4, num_stages=2, waves=8)
    return dict(BN=128, num_warps=8, num_stages=3, waves=8)


def facts_of(t: torch.Tensor):
    """(arch, reads fnuz, has fp8 matrix instructions, SM count) of t's device, cached per device."""
    arch, fnuz, sms, fp8_mma = device_facts(t.device)
    return arch, fnuz, fp8_mma, sms


def has_fp8_mma(device: torch.device) -> bool:
    """Whether the logits kernels (this file's and fp8_mqa_logits.py's) run on ``device``: they need fp8 matrix
    instructions, which gfx90a and sm_80 lack (there dsv4_rocm.ops runs the oracle); CPU tensors, under the
    Triton interpreter, run them."""
    return device_facts(device)[3]


def pad_heads(q: torch.Tensor, w: torch.Tensor):
    """The matrix units need 16 to 128 heads, a power of two: other counts get zero heads with zero weights
    (which add ReLU(0) * 0 = 0). q [..., H, 128] bytes, w [rows, H] fp32."""
    H = q.shape[-2]
    Hp = max(16, next_power_of_2(H))
    if Hp == H:
        return q, w
    qp = q.new_zeros(*q.shape[:-2], Hp, q.shape[-1])
    qp[..., :H, :] = q
    wp = w.new_zeros(w.shape[0], Hp)
    wp[:, :H] = w
    return qp, wp


def fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_tables, schedule_metadata, max_model_len: int,
                         clean_logits: bool = True, config: dict = None):
    """DeepGEMM's call form; arguments checked by ``dsv4_rocm.ops.fp8_paged_mqa_logits``, which runs this kernel
    only where ``has_fp8_mma``."""
    arch, fnuz, _, sms = facts_of(q)
    B, nn = q.shape[:2]
    out = torch.empty(B * nn, max_model_len, dtype=torch.float32, device=q.device)
    if B == 0:
        return out
    cfg = _config(arch, tuple(sorted(config.items())) if config else ())
    qb, w = pad_heads(q if q.dtype == torch.uint8 else q.view(torch.uint8), weights)
    bs = kv_cache.shape[1]
    # the cache as the op checked it (cache_views.pages): its first page and page stride are all the kernel
    # takes, so no pages view is made again
    cache = kv_cache if kv_cache.dtype == torch.uint8 else kv_cache.view(torch.uint8)
    # about `waves` programs per SM, but no more splits than keep MIN_TILES key tiles each when a context
    # fills max_model_len (a host int: no sync)
    splits = cfg.get("splits") or max(1, min(cdiv(cfg["waves"] * sms, B),
                                             cdiv(max_model_len, cfg["BN"] * MIN_TILES)))
    qst, bst = qb.stride(), block_tables.stride()
    launch(_fp8_paged_mqa_logits_kernel)[(B, splits)](
        qb, qst[0], qst[1], qst[2], cache, kv_cache.stride(0), kv_cache.shape[0], w, w.stride(0),
        context_lens, context_lens.stride(0), block_tables, bst[0], block_tables.shape[1], out,
        out.stride(0), max_model_len,
        NEXT_N=nn, H=qb.shape[2], BS=bs, BN=cfg["BN"], SPLITS=splits, CTX_2D=context_lens.dim() == 2,
        CLEAN=clean_logits, FNUZ=fnuz, TAIL_N=TAIL, Q_FNUZ=q.dtype == torch.float8_e4m3fnuz,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


@functools.lru_cache(maxsize=64)
def _config(arch: str, config_items: tuple) -> dict:
    return dict(default_config(arch), **dict(config_items))


def _spec(name, arch_next_n, ctx_2d, q_fnuz=False):
    def constexprs(arch):
        c = default_config(arch)
        return dict(NEXT_N=arch_next_n, H=64, BS=64, BN=c["BN"], SPLITS=8, CTX_2D=ctx_2d, CLEAN=True,
                    FNUZ=arch == "gfx942", TAIL_N=TAIL, Q_FNUZ=q_fnuz)

    def options(arch):
        c = default_config(arch)
        return dict(num_warps=c["num_warps"], num_stages=c["num_stages"])
    return dict(name=name, fn=_fp8_paged_mqa_logits_kernel,
                pointers=dict(q_ptr="*u8", cache_ptr="*u8", w_ptr="*fp32", cl_ptr="*i32", bt_ptr="*i32",
                              out_ptr="*fp32"),
                floats=(), constexprs=constexprs, options=options, matrix=True)


COMPILE_SPECS = [
    _spec("fp8_paged_mqa_logits[next_n 1]", 1, False),
    _spec("fp8_paged_mqa_logits[next_n 2, 2-D lens]", 2, True),
    _spec("fp8_paged_mqa_logits[next_n 1, fnuz query]", 1, False, q_fnuz=True),
]
