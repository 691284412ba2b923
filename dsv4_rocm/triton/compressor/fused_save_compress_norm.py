"""DeepSeek-V4.1 compressor, first half (vLLM's ``fused_save_compress_norm``): the bf16 latent of every
group-closing token, and the ratio-2 ring save, in one launch.

Math (dsv4_rocm/reference/compressor_v41.py): ratio 1, latent = bf16(RMSNorm(kv_t)); ratio 2, at an odd
position p the pair (p - 1, p) is pooled with a per-dim softmax of its scores, then normed. The row of
p - 1 is the previous row of ``kv_score`` unless t is the first token of its request's chunk
(t == query_start_loc[token_to_req[t]]); then it is the ring row p - 1 an earlier step saved. A token past the
end of ``token_to_req_indices`` (vLLM's padded steps: it holds the actual tokens, slot_mapping the padded
count) has no request and writes nothing.

Grid. Ratio 1: one program per token. Ratio 2: num_reqs request programs, then one program per token.
Request program b owns its request's ring: it makes the latent of the chunk's first token (reading the
ring), waits for the CTA (the ring row it read may be among those it writes), then saves the rows of
the chunk's last min(len, capacity) tokens that have a slot >= 0 (state_cache row = slot // capacity,
slot % capacity; page and row strides from the tensor). Token programs make the latents of the other
group-closing tokens from two rows of ``kv_score`` and never touch the ring, so no program reads a ring
row another one writes.

With ``prev_rows`` (HAS_PREV, vLLM's prefill context parallelism) request program b takes the first
token's partner row from ``prev_rows[prev_row_indices[b]]`` where that index is >= 0 (an index past the
last row skips the token; a negative one reads the ring as above) and saves no ring row.

Arithmetic: that of the reference, operation for operation (fp fusion off, IEEE division and square
root, the polynomial exponential of compressor/compress_norm_rope_store.py and the pairwise sums of _records.py), so
the latent bits are the reference's on every device. NaN is written 0x7FC0.
"""
import torch
import triton
import triton.language as tl

from .._launch import launch
from .compress_norm_rope_store import _exp_neg, _rms_normalize

D = 512


@triton.jit
def _store_latent(y, w_ptr, eps, out_ptr, D: tl.constexpr):
    yh = _rms_normalize(y, w_ptr, eps, D)
    bits = yh.to(tl.bfloat16).to(tl.int16, bitcast=True)
    tl.store(out_ptr + tl.arange(0, D), tl.where(yh != yh, 0x7FC0, bits).to(tl.int16))


@triton.jit
def _pool_pair(kv0, s0, kv1, s1):
    """Softmax over the two rows, per dim: (e0 kv0 + e1 kv1) / (e0 + e1), e_u = exp(s_u - max) (a NaN
    score makes the max NaN, as torch's amax)."""
    m = tl.where((s0 > s1) | (s0 != s0), s0, s1)
    e0 = _exp_neg(s0 - m)
    e1 = _exp_neg(s1 - m)
    return tl.math.div_rn(e0 * kv0 + e1 * kv1, e0 + e1)


@triton.jit(do_not_specialize=["n", "num_reqs", "num_prev_rows", "num_t2r"])
def _fused_save_compress_norm_kernel(raw_ptr, raw_stride, pos_ptr, state_ptr, state_s0, state_s1, num_state_rows,
                                     slot_ptr, qsl_ptr, t2r_ptr, num_t2r, w_ptr, eps, latent_ptr, n, num_reqs,
                                     prev_ptr, prev_stride, prev_idx_ptr, num_prev_rows,
                                     CAP: tl.constexpr, RATIO: tl.constexpr, D: tl.constexpr,
                                     HAS_PREV: tl.constexpr):
    pid = tl.program_id(0)
    d = tl.arange(0, D)
    if RATIO == 1:
        if tl.load(slot_ptr + pid) >= 0:
            y = tl.load(raw_ptr + pid.to(tl.int64) * raw_stride + d)
            _store_latent(y, w_ptr, eps, latent_ptr + pid.to(tl.int64) * D, D)
    elif pid < num_reqs:
        start = tl.load(qsl_ptr + pid)
        end = tl.minimum(tl.load(qsl_ptr + pid + 1), n)
        if (start >= 0) & (start < n):
            s = tl.load(slot_ptr + start).to(tl.int64)
            p = tl.load(pos_ptr + start).to(tl.int64)
            own = tl.load(t2r_ptr + start, mask=start < num_t2r, other=-1) == pid
            other = False                                   # the partner row is prev_rows[k]
            k = tl.zeros((), tl.int64)
            if HAS_PREV:
                k = tl.load(prev_idx_ptr + pid).to(tl.int64)
                other = k >= 0
                own = own & (k < num_prev_rows)
            if own & (s >= 0) & (s < num_state_rows) & (p >= 1) & ((p + 1) % 2 == 0):
                ring = state_ptr + (s // CAP) * state_s0 + ((p - 1) % CAP) * state_s1
                if other:
                    ring = prev_ptr + k * prev_stride
                cur = raw_ptr + start.to(tl.int64) * raw_stride
                y = _pool_pair(tl.load(ring + d), tl.load(ring + D + d), tl.load(cur + d), tl.load(cur + D + d))
                _store_latent(y, w_ptr, eps, latent_ptr + start.to(tl.int64) * D, D)
        tl.debug_barrier()                                  # every lane has read the ring row
        if not HAS_PREV:                                    # with prev_rows the caller saves the ring
            for t in range(tl.maximum(tl.maximum(start, 0), end - CAP), end):
                s = tl.load(slot_ptr + t).to(tl.int64)
                if (s >= 0) & (s < num_state_rows):
                    row = state_ptr + (s // CAP) * state_s0 + (s % CAP) * state_s1
                    src = raw_ptr + (start.to(tl.int64) * 0 + t) * raw_stride
                    tl.store(row + d, tl.load(src + d))
                    tl.store(row + D + d, tl.load(src + D + d))
    else:
        t = pid - num_reqs
        s = tl.load(slot_ptr + t).to(tl.int64)
        p = tl.load(pos_ptr + t).to(tl.int64)
        req = tl.load(t2r_ptr + t, mask=t < num_t2r, other=-1)     # past token_to_req_indices: padding
        ok = (s >= 0) & (s < num_state_rows) & (p >= 1) & ((p + 1) % 2 == 0) & (req >= 0) & (req < num_reqs)
        if ok:
            if tl.load(qsl_ptr + req) != t:
                prev = raw_ptr + tl.maximum(t - 1, 0).to(tl.int64) * raw_stride
                cur = raw_ptr + t.to(tl.int64) * raw_stride
                y = _pool_pair(tl.load(prev + d), tl.load(prev + D + d), tl.load(cur + d), tl.load(cur + D + d))
                _store_latent(y, w_ptr, eps, latent_ptr + t.to(tl.int64) * D, D)


def fused_save_compress_norm(kv_score, positions, state_cache, slot_mapping, query_start_loc, token_to_req_indices,
                             rms_norm_weight, rms_norm_eps, compress_ratio, latent_out, prev_rows=None,
                             prev_row_indices=None) -> None:
    """vLLM's call form; arguments checked by ``dsv4_rocm.ops.fused_save_compress_norm``."""
    n = slot_mapping.shape[0]
    if n == 0:
        return
    latent = latent_out.view(torch.int16)
    if compress_ratio == 1:
        launch(_fused_save_compress_norm_kernel)[(n,)](
            kv_score, kv_score.stride(0), positions, kv_score, 0, 0, 0, slot_mapping, slot_mapping, slot_mapping, 0,
            rms_norm_weight, rms_norm_eps, latent, n, 0, kv_score, 0, slot_mapping, 0, CAP=1, RATIO=1, D=D,
            HAS_PREV=False, num_warps=4, num_stages=1, enable_fp_fusion=False)
        return
    R = query_start_loc.shape[0] - 1
    st = state_cache.stride()
    has_prev = prev_rows is not None
    launch(_fused_save_compress_norm_kernel)[(R + n,)](
        kv_score, kv_score.stride(0), positions, state_cache, st[0], st[1], state_cache.shape[0] * state_cache.shape[1],
        slot_mapping, query_start_loc, token_to_req_indices, token_to_req_indices.shape[0], rms_norm_weight,
        rms_norm_eps, latent, n, R,
        prev_rows if has_prev else kv_score, prev_rows.stride(0) if has_prev else 0,
        prev_row_indices if has_prev else slot_mapping, prev_rows.shape[0] if has_prev else 0,
        CAP=state_cache.shape[1], RATIO=2, D=D, HAS_PREV=has_prev, num_warps=4, num_stages=1,
        enable_fp_fusion=False)


def _spec(ratio, has_prev=False):
    return dict(name=f"fused_save_compress_norm[ratio {ratio}{', prev_rows' if has_prev else ''}]",
                fn=_fused_save_compress_norm_kernel,
                pointers=dict(raw_ptr="*fp32", pos_ptr="*i64", state_ptr="*fp32", slot_ptr="*i64", qsl_ptr="*i32",
                              t2r_ptr="*i32", w_ptr="*bf16", latent_ptr="*i16", prev_ptr="*fp32",
                              prev_idx_ptr="*i64"),
                floats=("eps",),
                constexprs=lambda arch: dict(CAP=8 if ratio == 2 else 1, RATIO=ratio, D=D, HAS_PREV=has_prev),
                options=lambda arch: dict(num_warps=4, num_stages=1, enable_fp_fusion=False), matrix=False,
                exact_fp32=True)


COMPILE_SPECS = [_spec(1), _spec(2), _spec(2, has_prev=True)]
