"""Sparse MLA prefill over a bf16 key/value array (FlashMLA ``flash_mla_sparse_fwd`` semantics).

    q [s_q, h, 512] bf16, kv [s_kv, 1, 512] bf16 (K = V), indices [s_q, 1, topk] int32
    key i of query t is kv[indices[t, 0, i]] when 0 <= index < s_kv and i < topk_length[t]
    l = sm * q.K,  lse = ln sum exp(l),  max_logits = max l,  out = softmax(l) @ K * sigmoid(lse - sink)

Each program owns one query token and BLOCK_H heads and walks the token's indices in tiles of
BLOCK_N keys: gather [BLOCK_N, 512] bf16 rows, one MMA for the scores, one for P.V, online softmax
in base 2. Every operand is addressed through its strides (q, kv and indices rows, lengths, out), so
strided views are read in place. A query with no valid key ("lonely") gets out 0, lse +inf and
max_logits -inf whatever its sink (-inf, finite or +inf).

For the fp8 pages themselves (no bf16 workspace), use ``sparse_mla_decode`` with one query per token:
it reads the 584-byte records directly and is the workspace-free prefill path.

On Hopper the launcher can run the warp-specialized Gluon kernel of ``sparse_mla_decode_ws.py`` over the
bf16 rows instead (``KV_BF16``: each row a one-key page, copied by cp.async straight into the wgmma K slot;
whole query tokens per CTA of a persistent grid, no partials; the same outputs);
``DEFAULT_SM90_KERNEL`` / ``config=dict(kernel=...)`` pick the kernel. It needs 16-byte aligned rows
(kv's address and row stride); other kv views run this file's kernel.
"""
import functools

import torch
import triton
import triton.language as tl

from .._compat import GLUON_WS, by_triton
from .._launch import cdiv, device_cache, device_facts, launch

_ws = None
if GLUON_WS:                              # the Hopper kernel is written in Gluon (Triton 3.6 to 3.8: _compat)
    try:
        from ..hopper import sparse_mla_decode_ws as _ws
    except Exception:  # noqa: BLE001  (no Gluon, or a Gluon of another API: the Triton kernel runs everywhere)
        _ws = None

LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["s_kv", "len_st"], do_not_specialize_on_alignment=["len_ptr"])
def _sparse_mla_prefill_kernel(q_ptr, stride_qt, stride_qh, kv_ptr, stride_kv, s_kv, idx_ptr, stride_it, topk,
                               len_ptr, len_st, sink_ptr, out_ptr, stride_ot, stride_oh, maxl_ptr, lse_ptr, stride_lt,
                               sm_log2, HAS_LEN: tl.constexpr, HAS_SINK: tl.constexpr, BLOCK_H: tl.constexpr,
                               BLOCK_N: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, 512)
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(q_ptr + t * stride_qt + heads[:, None].to(tl.int64) * stride_qh + cols[None, :])
    n_valid = topk
    if HAS_LEN:
        n_valid = tl.maximum(tl.minimum(tl.load(len_ptr + t * len_st), topk), 0)
    acc = tl.zeros([BLOCK_H, 512], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    for tile in range(0, tl.cdiv(n_valid, BLOCK_N)):
        n = tile * BLOCK_N + offs_n
        inb = n < n_valid
        idx = tl.load(idx_ptr + t * stride_it + n, mask=inb, other=-1)
        valid = inb & (idx >= 0) & (idx < s_kv)
        rows = tl.where(valid, idx, 0).to(tl.int64) * stride_kv
        k = tl.load(kv_ptr + rows[:, None] + cols[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k))
        s = tl.where(valid[None, :], s * sm_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), k)
        m_i = m_new
    empty = l_i == 0.0
    lse2 = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    factor = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))
    if HAS_SINK:
        # exp(lse) / (exp(lse) + exp(sink)) = 1 / (1 + 2^(sink*log2e - lse2)); a lonely query (lse2 = -inf)
        # is 0 without evaluating it: sink = -inf would give 2^(-inf + inf) = NaN there
        sink = tl.load(sink_ptr + heads)
        factor = tl.where(empty, 0.0, factor / (1.0 + tl.exp2(sink * 1.4426950408889634 - lse2)))
    tl.store(out_ptr + t * stride_ot + heads[:, None].to(tl.int64) * stride_oh + cols[None, :],
             (acc * factor[:, None]).to(tl.bfloat16))
    tl.store(lse_ptr + t * stride_lt + heads, tl.where(empty, float("inf"), lse2 * 0.6931471805599453))
    tl.store(maxl_ptr + t * stride_lt + heads, m_i * 0.6931471805599453)


# the prefill kernel Hopper runs by default: "ws" (sparse_mla_decode_ws.py over bf16 rows) or "triton" (this
# file's), as the H100 timing of gpu/decode_ws.py decides (BENCHMARKS.md): the Hopper kernel over bf16 rows
# was faster on all four timed rows (s_q 4096, h 64 / 128, s_kv 8K / 64K)
DEFAULT_SM90_KERNEL = "ws"


def default_kernel(arch: str) -> str:
    """Which prefill kernel a target runs by default: on Hopper DEFAULT_SM90_KERNEL (the warp-specialized
    kernel only where Triton has Gluon), this file's kernel everywhere else."""
    return "ws" if arch == "sm_90" and DEFAULT_SM90_KERNEL == "ws" and _ws is not None else "triton"


def default_config(arch: str) -> dict:
    if arch in ("gfx942", "gfx90a", "gfx950"):
        # all 64 heads per program, 16-key tiles, 8 waves: 206-256 VGPRs, no spills (two waves per SIMD),
        # the whole 64 KB of LDS of a gfx942 workgroup
        return dict(BLOCK_H=64, BLOCK_N=16, num_warps=8, num_stages=1)
    if arch == "sm_100":       # 64-key tiles need 257 KB of shared memory there (compile matrix)
        return dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=2)
    return dict(BLOCK_H=64, num_warps=8, **by_triton(_SM90_TILES))


# Hopper's tile by Triton: under 3.6 to 3.8, 64 keys and 3 stages (2 stages spill 16 B). Triton 3.9 spills
# every tile tried at its 255 registers (64 keys: 632-772 B; 32 keys: 304 B with 2 stages, 312 B with 3;
# 16 warps: 980-1068 B at 128 registers), so it takes the least; there the Gluon kernel is not offered either.
_SM90_TILES = {(3, 6): dict(BLOCK_N=64, num_stages=3), (3, 9): dict(BLOCK_N=32, num_stages=2)}
_SM90_SPILLS = {(3, 6): "", (3, 9): {"sm_90a": "Triton >= 3.9: no tile tried compiles without spills "
                                               "(docs/platforms.md#triton-versions)"}}


@device_cache()
def _config(device: torch.device) -> dict:
    arch = device_facts(device)[0]
    return dict(default_config(arch), kernel=default_kernel(arch))


@functools.lru_cache(maxsize=256)
def _ws_kernel(cfg_items: tuple, h: int, has_len: bool, has_sink: bool, q_async: bool):
    """The Hopper kernel over bf16 rows with the constexprs of a call's variant bound (``cfg_items``: the
    call's config overrides; those of the Hopper kernel's keys replace its defaults)."""
    cfg = dict(_ws.prefill_config(), **{k: v for k, v in cfg_items if k in _ws.CONFIG_KEYS})
    return launch(_ws._sparse_mla_ws_kernel).bind(**_ws.prefill_constexprs(tuple(cfg.items()), h, has_len, has_sink,
                                                                            q_async))


def _ws_prefill(q, kv, indices, sm_scale, attn_sink, topk_length, out, lse, maxl, over, compile_only):
    """The warp-specialized kernel's launch (module docstring): q as [s_q, 1, h, 512], kv's rows as the
    pages of one key, whole tokens per CTA."""
    s_q, h, _ = q.shape
    topk = indices.shape[2]
    m = _ws.tiles_per_unit(topk, 0, 64)
    w = _ws.schedule(s_q, m, max(device_facts(q.device)[2] // (h // 64), 1), whole=True)
    kvb = kv.view(torch.uint8)
    lens = topk_length if topk_length is not None else indices
    lst = topk_length.stride(0) if topk_length is not None else 0
    sink = attn_sink if attn_sink is not None else lse
    ist = indices.stride(0)
    args = (q, q.stride(0), 0, q.stride(1),
            kvb, kv.stride(0) * 2, kv.shape[0], indices, ist, 0, lens, lst, 0, topk,
            kvb, 0, 0, indices, 0, 0, lens, 0, 0, 0,
            sink, out, out.stride(0), 0, out.stride(1), lse, lse, lse, s_q, 1, w, sm_scale * LOG2E, maxl)
    kern = _ws_kernel(tuple(sorted(over.items())), h, topk_length is not None, attn_sink is not None,
                      _ws.q_rows_aligned(q))
    grid = (cdiv(s_q * m, w), h // 64)
    if compile_only:
        kern.warmup(*args, grid=grid)
    else:
        kern[grid](*args)


def _rows_aligned(kv) -> bool:
    """kv's rows start at 16-byte boundaries (what the Hopper kernel's 16-byte row copies need)."""
    return kv.data_ptr() % 16 == 0 and (kv.stride(0) * 2) % 16 == 0


def sparse_mla_prefill(q, kv, indices, sm_scale: float, d_v: int = 512, attn_sink=None, topk_length=None,
                       out=None, *, config: dict = None, compile_only: bool = False):
    """-> (out bf16 [s_q, h, 512], max_logits fp32 [s_q, h], lse fp32 [s_q, h]).

    Arguments as ``dsv4_rocm.ops.sparse_mla_prefill``, which checks them: q and out (written in place when
    given) [s_q, h, 512], kv [s_kv, 1, 512] and indices [s_q, 1, topk] with a unit last stride and any
    other strides, topk_length [s_q] of any stride. ``compile_only`` compiles and runs nothing."""
    s_q, h, _ = q.shape
    dev = q.device
    cfg = _config(dev) if not config else dict(_config(dev), **config)
    if out is None:
        out = torch.empty((s_q, h, 512), dtype=torch.bfloat16, device=dev)
    lse = torch.empty((s_q, h), dtype=torch.float32, device=dev)
    maxl = torch.empty((s_q, h), dtype=torch.float32, device=dev)
    if s_q == 0:
        return out, maxl, lse
    kernel = cfg.get("kernel", "triton")
    if kernel == "ws":
        if _ws is None or device_facts(dev)[0] != "sm_90":
            raise ValueError("config kernel='ws' runs on Hopper (sm_90) with Triton's Gluon only")
        if kv.shape[0] == 0 or _rows_aligned(kv):
            _ws_prefill(q, kv, indices, sm_scale, attn_sink, topk_length, out, lse, maxl, config or {}, compile_only)
            return out, maxl, lse
    elif kernel != "triton":
        raise ValueError(f"config kernel must be 'triton' or 'ws', got {kernel!r}")
    BH = min(cfg["BLOCK_H"], h)
    grid = (s_q, h // BH)
    args = (q, q.stride(0), q.stride(1), kv, kv.stride(0), kv.shape[0], indices, indices.stride(0), indices.shape[2],
            topk_length if topk_length is not None else indices, topk_length.stride(0) if topk_length is not None else 0,
            attn_sink if attn_sink is not None else lse, out, out.stride(0), out.stride(1), maxl, lse, lse.stride(0),
            sm_scale * LOG2E)
    consts = dict(HAS_LEN=topk_length is not None, HAS_SINK=attn_sink is not None, BLOCK_H=BH, BLOCK_N=cfg["BLOCK_N"],
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if compile_only:
        _sparse_mla_prefill_kernel.warmup(*args, grid=grid, **consts)
    else:
        launch(_sparse_mla_prefill_kernel)[grid](*args, **consts)
    return out, maxl, lse


def _matrix_options(arch):
    c = default_config(arch)
    return dict(num_warps=c["num_warps"], num_stages=c["num_stages"])


# entries of the CPU compile matrix (build_tools/compile_matrix.py)
COMPILE_SPECS = [
    dict(name="sparse_mla_prefill", fn=_sparse_mla_prefill_kernel,
         pointers=dict(q_ptr="*bf16", kv_ptr="*bf16", idx_ptr="*i32", len_ptr="*i32", sink_ptr="*fp32",
                       out_ptr="*bf16", maxl_ptr="*fp32", lse_ptr="*fp32"),
         floats=("sm_log2",),
         constexprs=lambda arch: dict(HAS_LEN=True, HAS_SINK=True, BLOCK_H=default_config(arch)["BLOCK_H"],
                                      BLOCK_N=default_config(arch)["BLOCK_N"]),
         options=_matrix_options, matrix=True, ptxas_spills=by_triton(_SM90_SPILLS)),
]
