"""The front of a decode step in one launch: what ``fused_q_kv_rmsnorm``'s kv half,
``fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert`` and ``fused_indexer_q_rope_quant`` write, bit for bit.

The programs of the one grid are split by program id into three kinds of job, in this order:

    q jobs        T * QB programs, QB = cdiv(padded_heads, QH): token t, heads hb * QH .. hb * QH + QH - 1
    kv jobs       cdiv(n_slots, R) programs: tokens j * R .. j * R + R - 1 below n_slots (= len(slot_mapping))
    indexer jobs  T * cdiv(index_heads, HB) programs (only with INDEXER): token t, one block of HB index heads

Math, per job (fp32 inside, fp fusion off; every rounding is the unfused kernels'):

    q        x = fp32(q[t, h]) for h < H; with APPLY_Q_NORM x * (1 / sqrt(ss * 2^-9 + eps)) with ss the sum of
             squares in the HIP kernel's order (``_sum_sq_q``); GPT-J RoPE of dims 448..511 as vLLM rounds the q
             (e' = fma(e, c, -(o s)), o' = fma(e, s, o c)); one rounding to bf16 at q_out[t, h]. Heads
             H .. padded_heads - 1, and every head of a token whose position lies outside the cos/sin table,
             are written 0.
    kv       x = fp32(kv[t]) (the projection's raw latent), y = bf((x * (1 / sqrt(ss / 512 + eps))) * w) with
             w = bf16 kv_norm weight, ss in the HIP norm's order (``_sum_sq_kv``); then the record of y as
             the kv insert writes it (``store_kv_record``: RoPE, V40_584 or V41_528) at slot_mapping[t];
             a slot < 0 or past the cache, or a position outside the table, writes nothing.
    indexer  the program of ``fused_indexer_q_rope_quant`` (``indexer_q_heads``): RoPE of index_q[t, heads]
             and UE8M0 fp8 (the scale folded into the weights) or MXFP4.

Why these sum orders: the unfused norms are HIP kernels in which a 32-lane group holds a 512-value row.
The per-head q norm (hip_kernels/include/dsv4/record.h, ``dsv4_rmsnorm512``) gives lane l the values
16 l .. 16 l + 15 and sums their squares one after the other; the kv norm (hip_kernels/fused_q_kv_rmsnorm.hip)
gives lane l the 8 values at 8 l and the 8 at 256 + 8 l and adds (a^2 + b^2) of their 8 pairs one after the
other. Both then reduce the 32 lane sums by an xor butterfly (lane l + lane l ^ 16, then ^ 8, ^ 4, ^ 2, ^ 1),
which is the tree that adds lane i to lane i + 16, then i to i + 8, and so on. Here a lane's serial sum adds the
columns of a [.., 32, C] tile in turn (the columns taken out by splits) and each butterfly level is a sum
over an axis of size two (one addition). Division and square root
are correctly rounded on both sides (the HIP build's flags: fp contraction off, correctly rounded divide
and sqrt), so the floats are the same.

Memory layout: q [T, H, 512] bf16 and q_out [T, padded_heads, 512] bf16 with token and head strides (unit
last stride); kv [T, 512] bf16 with a row stride (a column slice of the fused projection is fine);
kv_weight bf16 [512]; the SWA cache as the page view of ``cache_views.pages`` (``page_stride`` bytes a
page, records of FMT); index_q [T, nh, 128], index_weights [T, nh] and the indexer's outputs as
``fused_indexer_q_rope_quant`` has them. fp8 bytes are OCP e4m3fn on every target; FNUZ (gfx942) only
picks the encoder, as in the kernels this one fuses.
"""
import torch
import triton
import triton.language as tl

from ... import layout as L
from .._launch import cdiv, device_cache, device_facts, launch
from .._pdl import pdl_start
from .._records import record_token
from ..indexer.fused_indexer_q_rope_quant import HEAD_BLOCK, indexer_q_heads
from .fused_deepseek_v4_kv_rope_insert import store_kv_record

Q_HEADS = 4          # q heads a q job normalizes and rotates
KV_ROWS = 4          # kv tokens a kv job inserts


@triton.jit
def _halves(v, N: tl.constexpr, K: tl.constexpr):
    """(v[..., 0::2], v[..., 1::2]) of v [N, 32, K]."""
    return tl.split(tl.reshape(v, (N, 32, K // 2, 2)))


@triton.jit
def _columns4(v, N: tl.constexpr):
    """The 4 columns of v [N, 32, 4], each [N, 32]."""
    a, b = _halves(v, N, 4)
    a0, a1 = _halves(a, N, 2)
    b0, b1 = _halves(b, N, 2)
    return (tl.reshape(a0, (N, 32)), tl.reshape(b0, (N, 32)), tl.reshape(a1, (N, 32)), tl.reshape(b1, (N, 32)))


@triton.jit
def _serial16(v, N: tl.constexpr):
    """Sum of the 16 columns of v [N, 32, 16] one after another ((c0 + c1) + c2) + ...: a lane's serial
    accumulation in the HIP q norm. The columns are taken out by splits (no arithmetic)."""
    e, o = _halves(v, N, 16)
    ee, eo = _halves(e, N, 8)
    oe, oo = _halves(o, N, 8)
    c0, c4, c8, c12 = _columns4(ee, N)
    c2, c6, c10, c14 = _columns4(eo, N)
    c1, c5, c9, c13 = _columns4(oe, N)
    c3, c7, c11, c15 = _columns4(oo, N)
    s = c0 + c1
    s = (((((s + c2) + c3) + c4) + c5) + c6) + c7
    return (((((((s + c8) + c9) + c10) + c11) + c12) + c13) + c14) + c15


@triton.jit
def _serial8(v, N: tl.constexpr):
    """Sum of the 8 columns of v [N, 32, 8] one after another: a lane's serial accumulation in the HIP kv norm."""
    e, o = _halves(v, N, 8)
    c0, c2, c4, c6 = _columns4(e, N)
    c1, c3, c5, c7 = _columns4(o, N)
    return ((((((c0 + c1) + c2) + c3) + c4) + c5) + c6) + c7


@triton.jit
def _butterfly(s, N: tl.constexpr):
    """The 32 lane sums s [N, 32] reduced as a 32-lane xor butterfly reduces them: [N]."""
    s = tl.sum(tl.reshape(s, (N, 2, 16)), axis=1)
    s = tl.sum(tl.reshape(s, (N, 2, 8)), axis=1)
    s = tl.sum(tl.reshape(s, (N, 2, 4)), axis=1)
    s = tl.sum(tl.reshape(s, (N, 2, 2)), axis=1)
    return tl.sum(tl.reshape(s, (N, 2, 1)), axis=1).reshape((N,))


@triton.jit
def _sum_sq_q(x, N: tl.constexpr):
    """Sum of squares of each row of x [N, 512] in dsv4_rmsnorm512's order: lane l the squares of values
    16 l .. 16 l + 15 in turn, then the butterfly."""
    return _butterfly(_serial16(tl.reshape(x * x, (N, 32, 16)), N), N)


@triton.jit
def _sum_sq_kv(x):
    """Sum of squares of x [512] in fused_q_kv_rmsnorm.hip's order: lane l adds a^2 + b^2 of its pairs at
    8 l .. 8 l + 7, then at 256 + 8 l .., in turn; then the butterfly."""
    a, b = tl.split(tl.reshape(x, (2, 32, 4, 2)))                      # [chunk, lane, pair]
    p = tl.reshape(tl.permute(a * a + b * b, (1, 0, 2)), (1, 32, 8))    # lane, then chunk-major pairs
    return tl.sum(_butterfly(_serial8(p, 1), 1), axis=0)


@triton.jit
def _rope_last64_fma(x, cs_row_ptr, N: tl.constexpr):
    """GPT-J RoPE of dims 448..511 of the rows of x [N, 512] with vLLM's q rounding (reference.rope.rope_fwd_fma):
    e' = fma(e, c, -(o s)), o' = fma(e, s, o c)."""
    even, odd = tl.split(tl.reshape(x, (N, 256, 2)))
    ri = tl.arange(0, 256) - 224
    is_rope = ri >= 0
    cos = tl.load(cs_row_ptr + tl.where(is_rope, ri, 0), mask=is_rope, other=1.0).to(tl.float32)[None, :]
    sin = tl.load(cs_row_ptr + 32 + tl.where(is_rope, ri, 0), mask=is_rope, other=0.0).to(tl.float32)[None, :]
    e2 = tl.fma(even, cos, -(odd * sin))
    o2 = tl.fma(even, sin, odd * cos)
    return tl.reshape(tl.interleave(tl.where(is_rope[None, :], e2, even), tl.where(is_rope[None, :], o2, odd)),
                      (N, 512))


@triton.jit(do_not_specialize=["n_q_jobs", "n_kv_jobs", "n_slots"])
def _decode_front_kernel(
        # q jobs
        q_ptr, q_st, q_sh, qo_ptr, qo_st, qo_sh, num_heads, padded_heads, q_blocks, n_q_jobs,
        # kv jobs
        kv_ptr, kv_st, kvw_ptr, cache_ptr, page_stride, capacity, slot_ptr, n_slots, n_kv_jobs,
        # the step's positions and RoPE table, the norms' eps
        pos_ptr, cs_ptr, cs_stride, cs_rows, eps,
        # indexer jobs (fused_indexer_q_rope_quant's arguments)
        iq_ptr, iq_st, iq_sh, ics_ptr, ics_stride, ics_rows, iw_ptr, iw_st, iw_sh, io_ptr, io_st, io_sh, is_ptr,
        is_st, is_sh, iwo_ptr, iwo_st, softmax_scale, head_scale, index_heads, index_blocks,
        QH: tl.constexpr, R: tl.constexpr, BS: tl.constexpr, FMT: tl.constexpr, FNUZ: tl.constexpr,
        APPLY_Q_NORM: tl.constexpr, INDEXER: tl.constexpr, HB: tl.constexpr, FP4: tl.constexpr,
        Q_FNUZ: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    pid = tl.program_id(0)
    d = tl.arange(0, 512)
    if pid < n_q_jobs:
        t = (pid // q_blocks).to(tl.int64)
        h = (pid % q_blocks) * QH + tl.arange(0, QH)
        p = tl.load(pos_ptr + t).to(tl.int64)
        valid = (p >= 0) & (p < cs_rows)
        live = (h < num_heads) & valid
        x = tl.load(q_ptr + t * q_st + h[:, None].to(tl.int64) * q_sh + d[None, :], mask=live[:, None],
                    other=0.0).to(tl.float32)
        if APPLY_Q_NORM:
            ss = _sum_sq_q(x, QH)
            x = x * tl.math.div_rn(1.0, tl.math.sqrt_rn(ss * (1.0 / 512.0) + eps))[:, None]
        y = _rope_last64_fma(x, cs_ptr + tl.where(valid, p, 0) * cs_stride, QH)
        y = tl.where(live[:, None], y, 0.0)
        tl.store(qo_ptr + t * qo_st + h[:, None].to(tl.int64) * qo_sh + d[None, :], y.to(tl.bfloat16),
                 mask=(h < padded_heads)[:, None])
    elif pid < n_q_jobs + n_kv_jobs:
        w = tl.load(kvw_ptr + d).to(tl.float32)
        for i in range(R):
            t = (pid - n_q_jobs) * R + i
            if t < n_slots:
                s, p, writes = record_token(slot_ptr, pos_ptr, t, capacity, cs_rows, 1)
                if writes:
                    x = tl.load(kv_ptr + t.to(tl.int64) * kv_st + d).to(tl.float32)
                    r = tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(_sum_sq_kv(x), 512.0) + eps))
                    y = ((x * r) * w).to(tl.bfloat16).to(tl.float32)
                    store_kv_record(y, cs_ptr + p * cs_stride, cache_ptr + (s // BS) * page_stride, s % BS, BS,
                                    FNUZ, FMT)
    elif INDEXER:
        j = pid - n_q_jobs - n_kv_jobs
        indexer_q_heads((j // index_blocks).to(tl.int64), j % index_blocks, pos_ptr, iq_ptr, iq_st, iq_sh, ics_ptr,
                        ics_stride, ics_rows, iw_ptr, iw_st, iw_sh, io_ptr, io_st, io_sh, is_ptr, is_st, is_sh,
                        iwo_ptr, iwo_st, softmax_scale, head_scale, index_heads,
                        HB=HB, FP4=FP4, FNUZ=FNUZ, Q_FNUZ=Q_FNUZ)


@device_cache()
def _fnuz(device) -> bool:
    return device_facts(device)[1]


def decode_front(q, kv, kv_weight, q_out, k_cache, slot_mapping, positions, cos_sin_cache, eps: float,
                 block_size: int, apply_q_norm: bool, fmt: L.RecordFormat, index=None) -> None:
    """Launcher; arguments checked by ``dsv4_rocm.ops.decode_front``. ``k_cache``: the page view;
    ``index``: None (no indexer jobs) or (index_q, index_cos_sin_cache, index_weights, softmax_scale,
    head_scale, use_fp4, use_fnuz, out, scales, w_out) with the outputs allocated as
    ``fused_indexer_q_rope_quant`` allocates them."""
    T, H, _ = q.shape
    Hp = q_out.shape[1]
    n = slot_mapping.shape[0]
    qb = cdiv(Hp, Q_HEADS) if Hp else 0
    n_q, n_kv = T * qb, cdiv(n, KV_ROWS)
    dev = q.device
    if index is not None:
        iq, ics, iw, sm_scale, h_scale, fp4, q_fnuz, out, scales, w_out = index
        nh = iq.shape[1]
        ib = cdiv(nh, HEAD_BLOCK)
        o, sc = out.view(torch.uint8), scales.view(torch.uint8)
        idx_args = (iq, iq.stride(0), iq.stride(1), ics, ics.stride(0), ics.shape[0], iw, iw.stride(0), iw.stride(1),
                    o, o.stride(0), o.stride(1), sc, sc.stride(0), sc.stride(1), w_out, w_out.stride(0),
                    float(sm_scale), float(h_scale), nh, ib)
        n_idx = T * ib
    else:
        fp4 = q_fnuz = False
        idx_args = (q, 0, 0, cos_sin_cache, 0, 0, q, 0, 0, q, 0, 0, q, 0, 0, q, 0, 1.0, 1.0, 0, 1)
        n_idx = 0
    grid = n_q + n_kv + n_idx
    if grid == 0:
        return
    launch(_decode_front_kernel)[(grid,)](
        q, q.stride(0), q.stride(1), q_out, q_out.stride(0), q_out.stride(1), H, Hp, max(qb, 1), n_q,
        kv, kv.stride(0), kv_weight, k_cache, k_cache.stride(0), k_cache.shape[0] * block_size, slot_mapping, n, n_kv,
        positions, cos_sin_cache, cos_sin_cache.stride(0), cos_sin_cache.shape[0], float(eps), *idx_args,
        QH=Q_HEADS, R=KV_ROWS, BS=block_size, FMT=fmt, FNUZ=_fnuz(dev), APPLY_Q_NORM=bool(apply_q_norm),
        INDEXER=index is not None, HB=HEAD_BLOCK, FP4=bool(fp4), Q_FNUZ=bool(q_fnuz), num_warps=4, num_stages=1,
        enable_fp_fusion=False)


def _spec(name, fmt, indexer, fp4=False, q_norm=True):
    return dict(
        name=name, fn=_decode_front_kernel,
        pointers=dict(q_ptr="*bf16", qo_ptr="*bf16", kv_ptr="*bf16", kvw_ptr="*bf16", cache_ptr="*u8",
                      slot_ptr="*i64", pos_ptr="*i64", cs_ptr="*fp32", iq_ptr="*bf16", ics_ptr="*fp32",
                      iw_ptr="*bf16", io_ptr="*u8", is_ptr="*u8", iwo_ptr="*fp32"),
        floats=("eps", "softmax_scale", "head_scale"),
        constexprs=lambda arch: dict(QH=Q_HEADS, R=KV_ROWS, BS=64, FMT=fmt, FNUZ=arch == "gfx942",
                                     APPLY_Q_NORM=q_norm, INDEXER=indexer, HB=HEAD_BLOCK, FP4=fp4, Q_FNUZ=False),
        options=lambda arch: dict(num_warps=4, num_stages=1, enable_fp_fusion=False),
        matrix=False, fp8_encode=True, exact_fp32=True,
        own_fma="the q RoPE is vLLM's fused multiply-add rounding (tl.fma); fp fusion stays off elsewhere")


COMPILE_SPECS = [
    _spec("decode_front[V40_584, indexer fp8]", L.V40_584, True),
    _spec("decode_front[V40_584, no indexer]", L.V40_584, False),
    _spec("decode_front[V41_528, indexer mxfp4, no q norm]", L.with_layout(L.V41_528), True, fp4=True,
          q_norm=False),
]
