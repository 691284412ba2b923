"""Compressor state save: ``state_cache[slot] = [kv | score + ape[pos % r]]`` for every token.

Math and layout (``dsv4_rocm.reference.compressor``): token t with state slot s >= 0 writes its H fp32
kv values at ``state + (s // bs) * stride0 + (s % bs) * stride1`` and its H scores, each plus the
position's ape row, ``state_width`` floats further. One program per token; rows move as whole
vectors (H = 1024 / 512 / 256 floats). A negative or out-of-range slot, or a negative position, skips
the token (padding), so replaying a captured graph with padded slots is safe.
"""
import triton
import triton.language as tl


@triton.jit
def _save_partial_states_kernel(kv_ptr, kv_stride, score_ptr, score_stride, ape_ptr, ape_stride, pos_ptr,
                                state_ptr, state_stride0, state_stride1, slot_ptr, block_size, num_slots,
                                H: tl.constexpr, BLOCK: tl.constexpr, STATE_WIDTH: tl.constexpr,
                                RATIO: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    if (slot < 0) | (slot >= num_slots) | (pos < 0):
        return
    c = tl.arange(0, BLOCK)
    m = c < H
    kv = tl.load(kv_ptr + t * kv_stride + c, mask=m)
    sc = tl.load(score_ptr + t * score_stride + c, mask=m)
    ape = tl.load(ape_ptr + (pos % RATIO) * ape_stride + c, mask=m)
    row = state_ptr + (slot // block_size) * state_stride0 + (slot % block_size) * state_stride1
    tl.store(row + c, kv, mask=m)
    tl.store(row + STATE_WIDTH + c, sc + ape, mask=m)


def save_partial_states(kv, score, ape, positions, state_cache, slot_mapping, block_size: int, state_width: int,
                        compress_ratio: int, pdl_kwargs=None) -> None:
    """vLLM's call form; arguments checked by ``dsv4_rocm.ops.save_partial_states``."""
    n = slot_mapping.shape[0]
    if n == 0:
        return
    h = kv.shape[-1]
    _save_partial_states_kernel[(n,)](
        kv, kv.stride(0), score, score.stride(0), ape, ape.stride(0), positions, state_cache, state_cache.stride(0),
        state_cache.stride(1), slot_mapping, block_size, state_cache.shape[0] * block_size,
        H=h, BLOCK=triton.next_power_of_2(h), STATE_WIDTH=state_width, RATIO=compress_ratio,
        num_warps=_num_warps(h))


def _num_warps(h: int) -> int:
    return 4 if h >= 512 else 2


COMPILE_SPECS = [
    dict(name=f"save_partial_states[H={h}]", fn=_save_partial_states_kernel,
         pointers=dict(kv_ptr="*fp32", score_ptr="*fp32", ape_ptr="*fp32", pos_ptr="*i64", state_ptr="*fp32",
                       slot_ptr="*i64"),
         floats=(), constexprs=lambda arch, h=h, r=r: dict(H=h, BLOCK=h, STATE_WIDTH=h, RATIO=r),
         options=lambda arch, h=h: dict(num_warps=_num_warps(h), num_stages=1), matrix=False)
    for h, r in ((1024, 4), (512, 128), (256, 4))
]
