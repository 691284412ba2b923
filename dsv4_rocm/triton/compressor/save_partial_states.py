"""Compressor state save: ``state_cache[slot] = [kv | score + ape[pos % r]]`` for every token.

Math and layout (``dsv4_rocm.reference.compressor``): token t with state slot s >= 0 writes its H fp32
kv values at ``state + (s // bs) * stride0 + (s % bs) * stride1`` and its H scores, each plus the
position's ape row, ``state_width`` floats further. A program moves TOKENS tokens as a [TOKENS, H] tile
(rows of H = 1024 / 512 / 256 floats in 16-byte vectors); the kv and score loads do not wait for the
slots (a padding row is read and not written). A negative or out-of-range slot, or a negative position,
skips the token (padding), so replaying a captured graph with padded slots is safe.
"""
import triton
import triton.language as tl

from .._launch import cdiv, launch, next_power_of_2
from .._pdl import pdl_start


@triton.jit(do_not_specialize=["num_tokens"])
def _save_partial_states_kernel(kv_ptr, kv_stride, score_ptr, score_stride, ape_ptr, ape_stride, pos_ptr,
                                state_ptr, state_stride0, state_stride1, slot_ptr, num_slots, num_tokens,
                                H: tl.constexpr, BLOCK: tl.constexpr, STATE_WIDTH: tl.constexpr,
                                RATIO: tl.constexpr, BS: tl.constexpr, TOKENS: tl.constexpr,
                                PDL: tl.constexpr = False):
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)
    inb = t < num_tokens
    slot = tl.load(slot_ptr + t, mask=inb, other=-1).to(tl.int64)
    pos = tl.load(pos_ptr + t, mask=inb, other=-1).to(tl.int64)
    c = tl.arange(0, BLOCK)
    m = inb[:, None] & (c < H)[None, :]
    kv = tl.load(kv_ptr + t[:, None] * kv_stride + c[None, :], mask=m)
    sc = tl.load(score_ptr + t[:, None] * score_stride + c[None, :], mask=m)
    live = (slot >= 0) & (slot < num_slots) & (pos >= 0)
    m = live[:, None] & (c < H)[None, :]
    ape = tl.load(ape_ptr + (tl.where(live, pos, 0) % RATIO)[:, None] * ape_stride + c[None, :], mask=m)
    s = tl.where(live, slot, 0)
    row = state_ptr + (s // BS) * state_stride0 + (s % BS) * state_stride1
    tl.store(row[:, None] + c[None, :], kv, mask=m)
    tl.store(row[:, None] + STATE_WIDTH + c[None, :], sc + ape, mask=m)


def default_config(h: int) -> dict:
    """Tokens a program and warps: one 16-byte vector of each row per thread, two rows a program
    (``python -m dsv4_rocm bench --only compressor --sweep`` times the alternatives)."""
    return dict(tokens=2, num_warps=max(1, min(8, h // 128)))


def save_partial_states(kv, score, ape, positions, state_cache, slot_mapping, block_size: int, state_width: int,
                        compress_ratio: int, pdl_kwargs=None, *, config: dict = None) -> None:
    """vLLM's call form; arguments checked by ``dsv4_rocm.ops.save_partial_states``. ``config`` overrides
    keys of ``default_config`` (benchmark sweeps)."""
    n = slot_mapping.shape[0]
    if n == 0:
        return
    h = kv.shape[-1]
    cfg = default_config(h)
    if config:
        cfg = dict(cfg, **config)
    tokens = cfg["tokens"]
    launch(_save_partial_states_kernel)[(cdiv(n, tokens),)](
        kv, kv.stride(0), score, score.stride(0), ape, ape.stride(0), positions, state_cache, state_cache.stride(0),
        state_cache.stride(1), slot_mapping, state_cache.shape[0] * block_size, n,
        H=h, BLOCK=next_power_of_2(h), STATE_WIDTH=state_width, RATIO=compress_ratio, BS=block_size,
        TOKENS=tokens, num_warps=cfg["num_warps"])


COMPILE_SPECS = [
    dict(name=f"save_partial_states[H={h}]", fn=_save_partial_states_kernel,
         pointers=dict(kv_ptr="*fp32", score_ptr="*fp32", ape_ptr="*fp32", pos_ptr="*i64", state_ptr="*fp32",
                       slot_ptr="*i64"),
         floats=(), constexprs=lambda arch, h=h, r=r: dict(H=h, BLOCK=h, STATE_WIDTH=h, RATIO=r, BS=4 if r == 4 else 8,
                                                           TOKENS=default_config(h)["tokens"]),
         options=lambda arch, h=h: dict(num_warps=default_config(h)["num_warps"], num_stages=1), matrix=False)
    for h, r in ((1024, 4), (512, 128), (256, 4))
]
