"""Grouped FP8 GEMM with block scales: DeepGEMM's ``fp8_einsum("bhr,hdr->bhd", (a, sa), (w, sw), out)``.

Math: out[t, g, n] = sum_kb sa[t, g, kb] * sw[g, n, kb] * sum_{r in block kb} a[t, g, r] * w[g, n, r], over the
128-deep blocks kb of r. Each block's product of fp8 tiles runs on the matrix units (Hopper wgmma,
Blackwell tcgen05, AMD fp8 MFMA) into a fresh fp32 tile, which is scaled by sa x sw and added to the fp32
accumulator (DeepGEMM's promotion every 128 values of r); the accumulator is rounded once to out's dtype.

Operands: a [T, G, r] and w [G, d, r] e4m3fn bytes with unit stride along r (any other strides: vLLM's
[T, G, D] view of [G, T, D] storage included); out [T, G, d] with unit stride along d. Scales, any strides
(``dsv4_rocm.reference.output`` lists the forms): fp32 values, or int32 words of 4 UE8M0 bytes (block kb
in byte kb % 4 of word kb // 4; 0xFF is NaN); weight scales per 128 rows (W_GRAN_N = 128) or per row (1).

gfx942 has only fnuz fp8 MFMA. An OCP byte read as fnuz is worth half its OCP value (bias 8 instead of 7)
for every byte but 0x80 (OCP -0, fnuz NaN) and the OCP NaNs 0x7F / 0xFF (fnuz +-240): the kernel runs the
fnuz MFMA on the bytes as they are and multiplies each block's scale product by 4 (2 x 2), which is exact.
Weight tiles may hold -0 as 0x80 (checkpoints quantized elsewhere do): the kernel turns it into 0x00
as it loads them. Activation bytes are taken as they are: every dsv4_rocm quantizer writes -0 as 0x00
and poisons a non-finite block through its scale (docs/conventions.md), which makes its output NaN here
too; an activation holding 0x80 itself would read as NaN on gfx942.

Tiles: one program computes a BLOCK_M x BLOCK_N tile of one group; programs are ordered GROUP_M m-tiles
at a time so that neighbours share w tiles in L2. Rows t >= T and columns n >= d are masked. The k loop
keeps per block only what the promotion needs: the two operand tiles are loaded through fp8 pointers
(num_stages-deep pipelined copies into shared memory, which Hopper's wgmma reads in place; no register
pass of their bytes but gfx942's weight tiles, for the -0 fix); the block's scales were loaded one block
earlier; the promotion is one multiply-add of the fresh tile.

Split K (SPLIT_K > 1, for grids too small to keep the memory system busy: decode-sized T reads every w
byte once but has few tiles): the k-blocks of a tile are divided among SPLIT_K programs. Each writes its
fp32 partial tile to a workspace slot of its own, then counts itself in at the tile's arrival counter; the
program that arrives last adds the SPLIT_K partials in split order (so the result does not depend on
which program finishes when), stores the output and sets the counter back to 0, which leaves the
counters ready for the next call and for graph replays. Counters and workspace are the launchers'
cached buffers (``_launch.scratch`` / ``counters``).
"""
import torch
import triton
import triton.language as tl

from .._fp8 import INTERPRETED, mma_operand
from .._launch import cdiv, counters, device_cache, device_facts, launch, scratch
from .._pdl import pdl_start
from .._records import _pow2, _ue8m0_fp8

UE8M0_NAN_BITS = tl.constexpr(0x7FC00000)
UE8M0_MIN_BITS = tl.constexpr(0x00400000)     # 2^-127, the fp32 subnormal of UE8M0 byte 0


@triton.jit
def _block_scale(ptr, kb, stride_k, mask, PACKED: tl.constexpr):
    """fp32 scales of k-block kb at ptr (a vector of row addresses); masked rows read 0."""
    if PACKED:
        word = tl.load(ptr + (kb // 4) * stride_k, mask=mask, other=0)
        b = (word >> ((kb % 4) * 8)) & 0xFF
        bits = tl.where(b == 255, UE8M0_NAN_BITS, tl.where(b == 0, UE8M0_MIN_BITS, b << 23))
        s = tl.where(mask, bits.to(tl.float32, bitcast=True), 0.0)
    else:
        s = tl.load(ptr + kb * stride_k, mask=mask, other=0.0)
    return s


@triton.jit
def _fp8_tile(ptrs, mask, FNUZ: tl.constexpr, FIX_NEG_ZERO: tl.constexpr):
    """A tile of e4m3 bytes at ptrs (uint8 addresses) as a ``tl.dot`` operand. Bytes taken as they are are
    loaded through an fp8 pointer: the load then feeds the matrix unit from shared memory as it landed
    (Hopper's pipelined copies go straight to wgmma's operand buffers; a uint8 load bitcast in registers
    made each k-block's weight tile a round trip shared -> registers -> shared)."""
    if FNUZ and FIX_NEG_ZERO:
        x = tl.load(ptrs, mask=mask, other=0)
        # 0x80 -> 0x00: b & (((b & 0x7F) + 0x7F) | 0x7F) clears bit 7 only where the low seven bits are 0
        # (no carry leaves the byte: 0x7F + 0x7F < 0x100)
        x = x & (((x & 0x7F) + 0x7F) | 0x7F).to(tl.uint8)
        v = mma_operand(x, FNUZ)
    elif INTERPRETED:
        v = mma_operand(tl.load(ptrs, mask=mask, other=0), FNUZ)
    elif FNUZ:
        v = tl.load(ptrs.to(tl.pointer_type(tl.float8e4b8)), mask=mask, other=0.0)
    else:
        v = tl.load(ptrs.to(tl.pointer_type(tl.float8e4nv)), mask=mask, other=0.0)
    return v


@triton.jit
def _fp8_einsum_kernel(a_ptr, a_stride_t, a_stride_g, sa_ptr, sa_stride_t, sa_stride_g, sa_stride_k,
                       w_ptr, w_stride_g, w_stride_n, sw_ptr, sw_stride_g, sw_stride_n, sw_stride_k,
                       out_ptr, out_stride_t, out_stride_g, num_tokens, n_cols, ws_ptr, count_ptr,
                       K_BLOCKS: tl.constexpr, A_PACKED: tl.constexpr, W_PACKED: tl.constexpr, W_GRAN_N: tl.constexpr,
                       FNUZ: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
                       SPLIT_K: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    pid = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    KB_SPLIT: tl.constexpr = (K_BLOCKS + SPLIT_K - 1) // SPLIT_K        # k-blocks a split
    num_m = tl.cdiv(num_tokens, BLOCK_M)
    num_n = tl.cdiv(n_cols, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % rows
    pid_n = (pid % width) // rows
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, 128)
    m_ok = rm < num_tokens
    n_ok = rn < n_cols
    if SPLIT_K == 1:
        kb0 = 0
        kb_end = K_BLOCKS
    else:
        kb0 = split * KB_SPLIT
        kb_end = tl.minimum(kb0 + KB_SPLIT, K_BLOCKS)
    a_ptrs = a_ptr + g * a_stride_g + rm.to(tl.int64)[:, None] * a_stride_t + (kb0 * 128 + rk)[None, :]
    w_ptrs = w_ptr + g * w_stride_g + rn.to(tl.int64)[:, None] * w_stride_n + (kb0 * 128 + rk)[None, :]
    sa_rows = sa_ptr + g * sa_stride_g + rm.to(tl.int64) * sa_stride_t
    # a w tile inside one 128-row scale block (BLOCK_N divides 128) has a single weight scale per k-block
    W_UNIFORM: tl.constexpr = W_GRAN_N == 128 and 128 % BLOCK_N == 0
    if W_UNIFORM:
        sw_rows = sw_ptr + g * sw_stride_g + ((pid_n * BLOCK_N) // 128) * sw_stride_n + tl.arange(0, 1)
        sw_mask = tl.arange(0, 1) == 0
    else:
        sw_rows = sw_ptr + g * sw_stride_g + (rn // W_GRAN_N).to(tl.int64) * sw_stride_n
        sw_mask = n_ok
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # the scales of each k-block are loaded one block ahead (the first before the loop): their load latency
    # then hides behind the block's tile loads and MMA, and the promotion waits only on the MMA. Weight
    # scales per column are loaded at the top of their own block instead: a second BLOCK_N vector in the
    # MMA's column layout would make the wide tiles spill
    has = kb0 < kb_end                          # an empty split (SPLIT_K not dividing K_BLOCKS) reads nothing
    sa_next = _block_scale(sa_rows, kb0, sa_stride_k, m_ok & has, A_PACKED)
    if W_UNIFORM:
        sw_next = _block_scale(sw_rows, kb0, sw_stride_k, sw_mask & has, W_PACKED)
    for kb in range(kb0, kb_end):
        sa = sa_next
        more = kb + 1 < kb_end
        sa_next = _block_scale(sa_rows, kb + 1, sa_stride_k, m_ok & more, A_PACKED)
        if W_UNIFORM:
            sw = sw_next
            sw_next = _block_scale(sw_rows, kb + 1, sw_stride_k, sw_mask & more, W_PACKED)
        else:
            sw = _block_scale(sw_rows, kb, sw_stride_k, sw_mask, W_PACKED)
        a = _fp8_tile(a_ptrs, m_ok[:, None], FNUZ, False)
        w = _fp8_tile(w_ptrs, n_ok[:, None], FNUZ, True)
        part = tl.dot(a, tl.trans(w))
        if FNUZ:
            sa = sa * 4.0
        if W_UNIFORM:
            acc += part * (sa * tl.sum(sw, axis=0))[:, None]
        else:
            acc += part * (sa[:, None] * sw[None, :])
        a_ptrs += 128
        w_ptrs += 128
    if SPLIT_K > 1:
        tile = (g * num_m + pid_m) * num_n + pid_n
        n_tiles = tl.num_programs(1) * num_m * num_n
        cell = (tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]).to(tl.int64)
        tl.store(ws_ptr + (split * n_tiles + tile) * (BLOCK_M * BLOCK_N) + cell, acc)
        tl.debug_barrier()                      # every thread's partial is stored before the count is released
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:              # the last split of this tile: add the partials in split order
            tl.debug_barrier()
            acc = tl.load(ws_ptr + tile * (BLOCK_M * BLOCK_N) + cell, cache_modifier=".cg")
            for s2 in tl.static_range(1, SPLIT_K):
                acc += tl.load(ws_ptr + (s2 * n_tiles + tile) * (BLOCK_M * BLOCK_N) + cell, cache_modifier=".cg")
            out = out_ptr + g * out_stride_g + rm.to(tl.int64)[:, None] * out_stride_t + rn[None, :]
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
            tl.atomic_xchg(count_ptr + tile, 0)
    else:
        out = out_ptr + g * out_stride_g + rm.to(tl.int64)[:, None] * out_stride_t + rn[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])



QUANT_BLOCKS = 4          # 128-column blocks a program of the activation quantizer takes


@triton.jit
def _quantize_activation_kernel(x_ptr, x_stride_t, x_stride_k, q_ptr, s_ptr, k_blocks, NB: tl.constexpr,
                                FNUZ: tl.constexpr, PDL: tl.constexpr = False):
    """fp8_linear's activation quantizer, ``reference.output.quantize_activation``'s bytes and scales: program
    (t, j) turns blocks j*NB .. j*NB + NB - 1 of row t of x (bf16) into UE8M0 fp8 bytes q [T, K] and scales
    s [T, K / 128] = 2^e. A block holding NaN or inf gets bytes 0x7F and a NaN scale (docs/conventions.md;
    the oracle's 2^128 = inf gives the same NaN product where 0x7F decodes as NaN, and the NaN scale keeps
    it NaN on gfx942, where the byte reads as a finite fnuz value)."""
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1) * NB + tl.arange(0, NB)
    ok = blk < k_blocks
    cols = blk[:, None] * 128 + tl.arange(0, 128)[None, :]
    x = tl.load(x_ptr + t * x_stride_t + cols * x_stride_k, mask=ok[:, None], other=0.0).to(tl.float32)
    q, e, bad = _ue8m0_fp8(x, FNUZ)
    tl.store(q_ptr + t * k_blocks * 128 + cols, q, mask=ok[:, None])
    tl.store(s_ptr + t * k_blocks + blk, tl.where(bad, float("nan"), _pow2(e)), mask=ok)

def default_config(arch: str, num_tokens: int, per_row_w_scales: bool = False) -> dict:
    """Tile per target and token count. AMD: decode-sized batches 64 x 64 tiles, many programs for a weight
    read that bounds the time; more tokens 128-row tiles, which the matrix units need to approach their rate,
    8 warps; two stages in its 64 KB (gfx942) of LDS; weight scales per row keep a vector of BLOCK_N scales
    live beside two fp32 tiles: 64 columns. NVIDIA, from the H200 sweep of 2026-11-29 (BENCHMARKS.md section
    P): up to 256 tokens every token of a 128-token tile with 64 columns, 4 warps, 4 stages (V4-Flash T 128:
    16.7 us, 1.38x torch's bf16 einsum), and with per-row weight scales 64 x 128 (21.8 us); past 256 tokens
    128 x 128 with 8 warps and 4 stages (1.00x at 4096 tokens), per-row 64 x 128 with 4 warps and 3 stages
    (the 128 x 128 tiles spill with per-row scales). The tiles change only past 64 and 256 tokens
    (``TOKEN_CLASSES``: launches cache a plan per class)."""
    amd = arch.startswith("gfx")
    if not amd:
        if num_tokens <= 256:
            if per_row_w_scales:
                return dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8, num_warps=4, num_stages=4)
            return dict(BLOCK_M=128, BLOCK_N=64, GROUP_M=8, num_warps=4, num_stages=4)
        if per_row_w_scales:
            return dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8, num_warps=4, num_stages=3)
        return dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=4)
    if num_tokens <= 64:
        cfg = dict(BLOCK_M=64, BLOCK_N=64, GROUP_M=8, num_warps=4)
    elif num_tokens <= 256 or per_row_w_scales:
        cfg = dict(BLOCK_M=128, BLOCK_N=64, GROUP_M=8, num_warps=8)
    else:
        cfg = dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8)
    return dict(cfg, num_stages=2, matrix_instr_nonkdim=16, kpack=1)


TILE_KEYS = ("BLOCK_M", "BLOCK_N", "GROUP_M", "SPLIT_K")
SWEEP = {    # candidate tiles for ``python -m dsv4_rocm bench --only fp8_einsum --sweep`` (merged over
    # default_config); each compiles without spills for sm_90a with 128-row weight scales (with per-row ones
    # the 128 x 128 tiles spill 200-240 B: no default for that form). Names: m<BLOCK_M> n<BLOCK_N> w<warps> s<stages>,
    # g<GROUP_M> where not 8, k<SPLIT_K> where split.
    # decode-sized T (the weight read bounds the time): few tokens a tile, deep pipelines, or every token in
    # one tile (the weights then cross from L2 once) with narrow columns or a split for enough programs
    "m64n64w4s4": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=4),
    "m64n64w4s6": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=6),
    "m64n128w4s4": dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=4),
    "m64n128w4s5": dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=5),
    "m128n32w4s6": dict(BLOCK_M=128, BLOCK_N=32, num_warps=4, num_stages=6),
    "m128n64w4s5": dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=5),
    "m128n64w8s4": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=4),
    "m128n64w8s6": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=6),
    "m64n64w4s4k2": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=4, SPLIT_K=2),
    "m128n32w4s6k2": dict(BLOCK_M=128, BLOCK_N=32, num_warps=4, num_stages=6, SPLIT_K=2),
    "m128n64w4s5k2": dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=5, SPLIT_K=2),
    "m128n64w8s4k2": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=4, SPLIT_K=2),
    "m128n128w8s4k2": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4, SPLIT_K=2),
    "m128n128w8s4k4": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4, SPLIT_K=4),
    "m64n128w4s4k4": dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=4, SPLIT_K=4),
    # deeper pipelines (more weight bytes in flight a program: one program a Hopper SM streams ~ stages x
    # the k-block's tile bytes per memory latency)
    "m64n64w4s8": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=8),
    "m128n64w8s8": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=8),
    "m128n64w8s6k2": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=6, SPLIT_K=2),
    "m128n128w8s6k2": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=6, SPLIT_K=2),
    # prefill-sized T (the matrix units bound the time): wide tiles, 2-4 stages, the L2 swizzle width
    "m128n128w8s3": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
    "m128n128w8s4": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4),
    "m128n128w8s3g4": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, GROUP_M=4),
    "m128n128w8s3g16": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, GROUP_M=16),
    "m64n256w8s3": dict(BLOCK_M=64, BLOCK_N=256, num_warps=8, num_stages=3),
    "m256n64w8s3": dict(BLOCK_M=256, BLOCK_N=64, num_warps=8, num_stages=3),
    "m128n64w8s3g16": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, GROUP_M=16),
    # two programs a Hopper SM (<= 113 KB of shared memory, <= 255 registers x 128 threads each): one
    # program's MMA runs while the other promotes its block
    "m64n128w4s3": dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3),
    "m128n64w4s4": dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=4),
}


@device_cache()
def _device_facts(device: torch.device):
    """(arch, gfx942's fnuz fp8), cached: a launch must not pay for a properties query."""
    arch, fnuz, _, _ = device_facts(device)
    return arch, fnuz


TOKEN_CLASSES = (64, 256)  # default_config's tiles change past these token counts: a plan per class


@device_cache(maxsize=1024)
def _gemm_plan(device: torch.device, tokens: int, per_row: bool, k_blocks: int, a_packed: bool, w_packed: bool,
               w_gran_n: int, config_items: tuple):
    """(bound kernel, BLOCK_M, BLOCK_N, SPLIT_K) of a GEMM variant, built once (``tokens``: a representative count of
    the call's token class), so a launch pays no config dict."""
    arch, fnuz = _device_facts(device)
    cfg = dict(default_config(arch, tokens, per_row), **dict(config_items))
    meta = {k: v for k, v in cfg.items() if k not in TILE_KEYS}
    split = max(1, min(cfg.get("SPLIT_K", 1), k_blocks))
    kernel = launch(_fp8_einsum_kernel).bind(
        K_BLOCKS=k_blocks, A_PACKED=a_packed, W_PACKED=w_packed, W_GRAN_N=w_gran_n, FNUZ=fnuz,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], GROUP_M=cfg["GROUP_M"], SPLIT_K=split, **meta)
    return kernel, cfg["BLOCK_M"], cfg["BLOCK_N"], split


def grouped_fp8_gemm(a8, sa, w8, sw, out, w_gran_n: int, config: dict = None) -> None:
    """out[t, g, :] = dequant(a8[t, g]) @ dequant(w8[g]).T (operands and scales as the module docstring)."""
    T, G, K = a8.shape
    _gemm(a8, a8.stride()[:2], sa, sa.stride(), w8, w8.stride()[:2], sw, sw.stride(), out, out.stride()[:2], T, G,
          w8.shape[1], K, w_gran_n, config)


def _gemm(a8, a_st, sa, sa_st, w8, w_st, sw, sw_st, out, out_st, T, G, N, K, w_gran_n, config):
    """The launch, with every operand's (token / group, row) strides given: fp8_linear passes its 2-D weight
    as one group without making views."""
    if T == 0 or G == 0 or N == 0:
        return
    tokens = next((c for c in TOKEN_CLASSES if T <= c), TOKEN_CLASSES[-1] + 1)
    kernel, bm, bn, split = _gemm_plan(a8.device, tokens, w_gran_n == 1, K // 128, sa.dtype == torch.int32,
                                       sw.dtype == torch.int32, w_gran_n,
                                       tuple(sorted(config.items())) if config else ())
    a = a8 if a8.dtype == torch.uint8 else a8.view(torch.uint8)
    w = w8 if w8.dtype == torch.uint8 else w8.view(torch.uint8)
    tiles = cdiv(T, bm) * cdiv(N, bn)
    if split > 1:      # the split partials and the tiles' arrival counters (left at zero by their last arrivers)
        ws, cnt = scratch(a8.device, split * tiles * G * bm * bn), counters(a8.device, tiles * G)
    else:
        ws, cnt = out, out      # not read
    kernel[(tiles, G, split)](
        a, a_st[0], a_st[1], sa, sa_st[0], sa_st[1], sa_st[2], w, w_st[0], w_st[1], sw, sw_st[0], sw_st[1], sw_st[2],
        out, out_st[0], out_st[1], T, N, ws, cnt)


def fp8_einsum(expr, a, b, d, c=None, recipe=(1, 128, 128), config: dict = None) -> None:
    """DeepGEMM's call form; arguments checked by ``dsv4_rocm.ops.fp8_einsum``."""
    (a8, sa), (w8, sw) = a, b
    grouped_fp8_gemm(a8, sa, w8, sw, d, recipe[1], config)


def fp8_linear(x, w8, w_scale, config: dict = None):
    """bf16 [T, K] x block-fp8 weight [N, K] (fp32 scales [N/128, K/128]) -> bf16 [T, N]: the activation is
    quantized per token per 128 columns (``_quantize_activation_kernel``, the oracle's quantizer, eps 1e-4),
    then one group of the GEMM."""
    T, K = x.shape
    N = w8.shape[0]
    dev = x.device
    kb = K // 128
    q = torch.empty(T, K, dtype=torch.uint8, device=dev)
    s = torch.empty(T, kb, dtype=torch.float32, device=dev)
    out = torch.empty(T, N, dtype=torch.bfloat16, device=dev)
    if T:
        _quantizer(dev)[(T, cdiv(kb, QUANT_BLOCKS))](x, x.stride(0), x.stride(1), q, s, kb)
    # one group: the group strides are never used (program axis 1 has one program)
    ws = w_scale.stride()
    _gemm(q, (K, 0), s, (kb, 0, 1), w8, (0, w8.stride(0)), w_scale, (0, ws[0], ws[1]), out, (N, 0), T, 1, N, K,
          128, config)
    return out


@device_cache()
def _quantizer(device: torch.device):
    return launch(_quantize_activation_kernel).bind(NB=QUANT_BLOCKS, FNUZ=_device_facts(device)[1], num_warps=4)


def _spec(name, a_packed, w_packed, gran, tokens, split=None):
    def cfg(arch):
        return dict(default_config(arch, tokens, gran == 1), **(split or {}))
    return dict(
        name=f"fp8_einsum[{name}]", fn=_fp8_einsum_kernel,
        pointers=dict(a_ptr="*u8", sa_ptr="*i32" if a_packed else "*fp32", w_ptr="*u8",
                      sw_ptr="*i32" if w_packed else "*fp32", out_ptr="*bf16", ws_ptr="*fp32", count_ptr="*i32"),
        floats=(),
        constexprs=lambda arch: dict(K_BLOCKS=32, A_PACKED=a_packed, W_PACKED=w_packed, W_GRAN_N=gran,
                                     FNUZ=arch == "gfx942", **dict({"SPLIT_K": 1}, **{
                                         k: v for k, v in cfg(arch).items() if k in TILE_KEYS})),
        options=lambda arch: {k: v for k, v in cfg(arch).items() if k not in TILE_KEYS},
        matrix=True, fp8_mma=True)


COMPILE_SPECS = [
    dict(name="fp8_linear activation quant", fn=_quantize_activation_kernel,
         pointers=dict(x_ptr="*bf16", q_ptr="*u8", s_ptr="*fp32"), floats=(),
         constexprs=lambda arch: dict(NB=QUANT_BLOCKS, FNUZ=arch == "gfx942"), options=lambda arch: dict(num_warps=4),
         matrix=False, fp8_encode=True),
    _spec("fp32 scales, 64-token tile", False, False, 128, 64),
    _spec("fp32 scales, 128-token tile", False, False, 128, 128),
    _spec("fp32 scales, prefill tile", False, False, 128, 4096),
    _spec("packed ue8m0 scales per row, prefill tile", True, True, 1, 4096),
    _spec("fp32 scales, 128 x 128 tile split 4 ways along k", False, False, 128, 128,
          dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, SPLIT_K=4)),
]
