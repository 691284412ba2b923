"""vLLM's bf16 full-cache insert (``torch.ops._C.fused_deepseek_v4_qnorm_rope_kv_rope_full_cache_bf16_insert``,
the plain-row cache of vLLM's FlashInfer sparse MLA and of its ROCm DSpark draft layer).

Math (dsv4_rocm/reference/qkv.py): token t at position p (inside the cos/sin table, else the token is
padding), x = fp32 of a 512-value row:

    q head h      x / sqrt(mean(x^2) + eps) (with apply_q_norm; correctly rounded division and square root,
                  a pairwise sum of squares), GPT-J RoPE of dims 448..511, one rounding to bf16, written
                  back over q[t, h]; a padding token's q rows are written 0
    kv (t < n)    GPT-J RoPE of dims 448..511, one rounding to bf16, stored at k_cache[s // bs, s % bs] for
                  s = slot_mapping[t] when 0 <= s < num_blocks * bs; nothing otherwise

RoPE: e' = e c - o s, o' = e s + o c in fp32 (fp fusion off), as every RoPE of the library.

Layout: q [T, H, 512] bf16 with token and head strides and a unit last stride (read and written in
place), kv [T, 512] with a row stride, k_cache [nb, bs, 512] bf16 with block and token strides. Grid
(T, H + 1): program (t, h < H) one q head, program (t, H) the kv row.
"""
import triton
import triton.language as tl

from .._launch import launch
from .._records import _pairwise_sum, _rope_last64

D = 512


@triton.jit
def _full_bf16_kernel(q_ptr, q_st, q_sh, kv_ptr, kv_st, cache_ptr, cache_sb, cache_st, slot_ptr, n_slots, pos_ptr,
                      cs_ptr, cs_stride, cs_rows, eps, num_heads, capacity, BS: tl.constexpr,
                      APPLY_Q_NORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, 512)
    p = tl.load(pos_ptr + t).to(tl.int64)
    valid = (p >= 0) & (p < cs_rows)
    cs_row = cs_ptr + tl.where(valid, p, 0) * cs_stride
    if h < num_heads:
        row = q_ptr + t * q_st + h.to(tl.int64) * q_sh + d
        x = tl.load(row).to(tl.float32)
        if APPLY_Q_NORM:
            var = tl.math.div_rn(_pairwise_sum(x * x), 512.0)
            x = x * tl.math.div_rn(1.0, tl.math.sqrt_rn(var + eps))
        y = _rope_last64(x, cs_row, 512)
        tl.store(row, tl.where(valid, y, 0.0).to(tl.bfloat16))
    elif t < n_slots:
        s = tl.load(slot_ptr + t).to(tl.int64)
        if valid & (s >= 0) & (s < capacity):
            x = tl.load(kv_ptr + t * kv_st + d).to(tl.float32)
            y = _rope_last64(x, cs_row, 512)
            tl.store(cache_ptr + (s // BS) * cache_sb + (s % BS) * cache_st + d, y.to(tl.bfloat16))


def qnorm_rope_and_insert_full_bf16_k_cache(q, kv, k_cache, slot_mapping, positions, cos_sin_cache, eps: float,
                                            cache_block_size: int, apply_q_norm: bool = True) -> None:
    """Launcher (arguments checked by dsv4_rocm.ops.qnorm_rope_and_insert_full_bf16_k_cache)."""
    T, H, _ = q.shape
    if T:
        launch(_full_bf16_kernel)[(T, H + 1)](
            q, q.stride(0), q.stride(1), kv, kv.stride(0), k_cache, k_cache.stride(0), k_cache.stride(1),
            slot_mapping, slot_mapping.shape[0], positions, cos_sin_cache, cos_sin_cache.stride(0),
            cos_sin_cache.shape[0], float(eps), H, k_cache.shape[0] * cache_block_size, BS=cache_block_size,
            APPLY_Q_NORM=bool(apply_q_norm), num_warps=4, enable_fp_fusion=False)


COMPILE_SPECS = [
    dict(name=f"qnorm_rope_and_insert_full_bf16_k_cache[apply_q_norm={norm}]", fn=_full_bf16_kernel,
         pointers=dict(q_ptr="*bf16", kv_ptr="*bf16", cache_ptr="*bf16", slot_ptr="*i64", pos_ptr="*i64",
                       cs_ptr="*fp32"), floats=("eps",),
         constexprs=lambda arch, norm=norm: dict(BS=64, APPLY_Q_NORM=norm),
         options=lambda arch: dict(num_warps=4, num_stages=1, enable_fp_fusion=False), matrix=False,
         exact_fp32=True)
    for norm in (True, False)
]
