"""Sparse MLA prefill over a bf16 key/value array (FlashMLA ``flash_mla_sparse_fwd`` semantics).

    q [s_q, h, 512] bf16, kv [s_kv, 1, 512] bf16 (K = V), indices [s_q, 1, topk] int32
    key i of query t is kv[indices[t, 0, i]] when 0 <= index < s_kv and i < topk_length[t]
    l = sm * q.K,  lse = ln sum exp(l),  max_logits = max l,  out = softmax(l) @ K * sigmoid(lse - sink)

Each program owns one query token and BLOCK_H heads and walks the token's indices in tiles of
BLOCK_N keys: gather [BLOCK_N, 512] bf16 rows, one MMA for the scores, one for P.V, online softmax
in base 2. No valid key: out 0, lse +inf, max_logits -inf.

For the fp8 pages themselves (no bf16 workspace), use ``sparse_mla_decode`` with one query per token:
it reads the 584-byte records directly and is the workspace-free prefill path.
"""
import torch
import triton
import triton.language as tl

from ..platform import detect

LOG2E = 1.4426950408889634


@triton.jit
def _sparse_mla_prefill_kernel(q_ptr, stride_qt, stride_qh, kv_ptr, stride_kv, s_kv, idx_ptr, stride_it, topk,
                               len_ptr, sink_ptr, out_ptr, stride_ot, stride_oh, maxl_ptr, lse_ptr, stride_lt,
                               sm_log2, HAS_LEN: tl.constexpr, HAS_SINK: tl.constexpr, BLOCK_H: tl.constexpr,
                               BLOCK_N: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, 512)
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(q_ptr + t * stride_qt + heads[:, None].to(tl.int64) * stride_qh + cols[None, :])
    n_valid = topk
    if HAS_LEN:
        n_valid = tl.maximum(tl.minimum(tl.load(len_ptr + t), topk), 0)
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
        sink = tl.load(sink_ptr + heads)
        factor = factor / (1.0 + tl.exp2(sink * 1.4426950408889634 - lse2))
    tl.store(out_ptr + t * stride_ot + heads[:, None].to(tl.int64) * stride_oh + cols[None, :],
             (acc * factor[:, None]).to(tl.bfloat16))
    tl.store(lse_ptr + t * stride_lt + heads, tl.where(empty, float("inf"), lse2 * 0.6931471805599453))
    tl.store(maxl_ptr + t * stride_lt + heads, m_i * 0.6931471805599453)


def default_config(arch: str) -> dict:
    if arch in ("gfx942", "gfx90a", "gfx950"):
        # all 64 heads per program, 16-key tiles, 8 waves: 206-256 VGPRs, no spills (two waves per SIMD),
        # the whole 64 KB of LDS of a gfx942 workgroup
        return dict(BLOCK_H=64, BLOCK_N=16, num_warps=8, num_stages=1)
    if arch == "sm_100":       # 64-key tiles need 257 KB of shared memory there (compile matrix)
        return dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=2)
    return dict(BLOCK_H=64, BLOCK_N=64, num_warps=8, num_stages=3)   # 2 stages spill 16 B on sm_90a


def sparse_mla_prefill(q, kv, indices, sm_scale: float, d_v: int = 512, attn_sink=None, topk_length=None,
                       config: dict = None):
    """Arguments as ``dsv4_rocm.ops.sparse_mla_prefill`` (checked there) -> (out, max_logits, lse)."""
    s_q, h, _ = q.shape
    cfg = dict(default_config(detect(q.device).arch), **(config or {}))
    BH = min(cfg["BLOCK_H"], h)
    q = q if q.stride(2) == 1 else q.contiguous()
    kv2 = kv[:, 0]
    kv2 = kv2 if kv2.stride(1) == 1 else kv2.contiguous()
    idx = indices[:, 0]
    idx = idx if idx.stride(1) == 1 else idx.contiguous()
    out = torch.empty(s_q, h, 512, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(s_q, h, dtype=torch.float32, device=q.device)
    maxl = torch.empty_like(lse)
    if s_q == 0:
        return out, maxl, lse
    _sparse_mla_prefill_kernel[(s_q, h // BH)](
        q, q.stride(0), q.stride(1), kv2, kv2.stride(0), kv2.shape[0], idx, idx.stride(0), idx.shape[1],
        topk_length if topk_length is not None else idx, attn_sink if attn_sink is not None else lse,
        out, out.stride(0), out.stride(1), maxl, lse, lse.stride(0), sm_scale * LOG2E,
        HAS_LEN=topk_length is not None, HAS_SINK=attn_sink is not None, BLOCK_H=BH, BLOCK_N=cfg["BLOCK_N"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
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
         options=_matrix_options, matrix=True),
]
