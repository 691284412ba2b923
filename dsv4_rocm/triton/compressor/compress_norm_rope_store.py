"""Fused compressor step: softmax pooling of a window read from the paged state cache, RMSNorm, RoPE,
UE8M0 quantization and insertion into the compressed cache (vLLM's ``compress_norm_rope_store_triton``).

Only a token at a window boundary ((p + 1) % r == 0, state slot >= 0, cache slot >= 0) makes an entry.
Its window is the W = coff * r positions p - W + 1 .. p: row u lives in state block
``block_table[req, pos_u // bs]`` at offset ``pos_u % bs`` (``[kv | score]``, fp32, ``2 * state_width``
floats; C4 rows u >= 4 use the second D floats of each half), read in 16-byte vectors along a row. A
row whose position is negative or whose block-table entry is out of range is absent.

Grid. A decode-sized step (at most two tokens a request) runs one program per token. A prefill-sized
step runs one program per CHUNK consecutive tokens, which makes the entries among its tokens (a prefill
chunk has one boundary every r tokens, so the programs are few and nearly all busy, and no listing pass
or allocation precedes the launch). ``grid="list"`` lists the boundary tokens first
(``compressor_entries``) and launches one program per listed entry.

Pooling. STAGE 0 (one launch): the program pools all D columns of its entry, then norms, ropes,
quantizes and stores. STAGE 1 + 2 (two launches, for GPUs with many more SMs than entries): stage 1
pools a slice of D / NSPLIT columns per program ([programs, NSPLIT] grid) into an fp32 scratch row,
stage 2 finishes each entry from its row. A window is pooled either as [W, COLS] tiles (_pool_slice:
the whole window at once, rows spread over lanes and warps) or streamed in blocks of rows held in each
thread's registers (_pool_stream: no barrier in its loops; the C128 default on NVIDIA).
``default_config`` picks per target; the benchmark suite (``dsv4_rocm.bench.compressor``, ``--sweep``)
times the alternatives.

The arithmetic is exactly that of ``dsv4_rocm.reference.compressor`` (the module docstring there), in the
same order and with plain IEEE operations: the kernel is compiled with fp fusion off (no contraction into
fused multiply-adds), divisions and the square root are correctly rounded (``div_rn``, ``sqrt_rn``), the
exponential is a fixed polynomial, and every sum is an explicit tree, so the cache bytes are the same on
every device and for every configuration, and equal to the reference's (columns are independent until
the norm: slicing them changes no operation). Output records (page p = slot // bs, offset o = slot % bs,
page stride = ``kv_cache.stride(0)``):
    TARGET 0, main K (D 512):    data at p + o * 576: 448 e4m3 bytes (bf(yh), blocks of 64) + 64 bf16 RoPE;
                                 scales at p + bs * 576 + o * 8: 7 UE8M0 bytes and a 0 pad byte
    TARGET 1, indexer K FP8:     128 e4m3 bytes at p + o * 128; fp32 scale 2^e at p + bs * 128 + o * 4
    TARGET 2, indexer K MXFP4:   64 bytes of E2M1 pairs (low nibble even) at p + o * 64; 4 UE8M0 bytes at
                                 p + bs * 64 + o * 4
The main target's record format is the constexpr FMT (the cache's last dimension names it): V40_584 as
above; V41_528 / V41_FP4_288 quantize all 512 dims of RoPE(bf(yh)) (the bf16 latent rotated in fp32, as
vLLM's V4.1 writers do): 512 e4m3 bytes + 16 UE8M0 bytes, or 256 bytes of e2m1 pairs + 32 e4m3 scales,
where ``layout.data_offset`` / ``record_scale_offset`` put them.
fp8 bytes are OCP e4m3fn on every vendor (-0 written 0x00); gfx942 encodes x / 2 with its fnuz convert,
which gives the same byte for every value the cache can hold.
"""
import torch
import triton
import triton.language as tl

from ... import layout as L
from .._launch import cdiv, device_cache, device_facts, launch
from .._pdl import pdl_start
from .._records import (_rms_normalize, _rope_last64, _store_indexer_fp8, _store_indexer_mxfp4, _store_main,
                        _store_v41_fp4, _store_v41_fp8)
from .compressor_entries import compressor_entries

MAIN, INDEXER_FP8, INDEXER_MXFP4 = 0, 1, 2


@triton.jit
def _exp_neg(x):
    """exp(x), x <= 0: the polynomial of reference.compressor.exp_neg, operation for operation (its NaN test
    on k is implied here: x >= -80 already excludes a NaN x, the only source of a NaN k)."""
    k = tl.where(x >= -80.0, tl.floor(x * 1.4426950408889634 + 0.5), 0.0)
    r = (x - k * 0.693145751953125) - k * 1.4286067653302226e-06
    p = r * (1.0 / 5040) + (1.0 / 720)
    p = p * r + (1.0 / 120)
    p = p * r + (1.0 / 24)
    p = p * r + (1.0 / 6)
    p = p * r + 0.5
    p = p * r + 1.0
    p = p * r + 1.0
    scale = ((k.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(x < -80.0, 0.0, p * scale)


@triton.jit
def _bit_reverse(i, W: tl.constexpr):
    """i with its log2(W) bits in reverse order (W a power of two)."""
    r = tl.zeros_like(i)
    for b in tl.static_range(16):
        if (1 << b) < W:
            r = r | tl.where((i & (1 << b)) != 0, W >> (b + 1), 0)
    return r


@triton.jit
def _tree_sum_rows(x):
    """Column sums of x [R, C] (R a power of two) whose row i holds window row bit_reverse(i): adding the
    top half to the bottom half until one row is left is then exactly the tree of adjacent window rows
    ((u0 + u1) + (u2 + u3)) + ... (reference.pairwise_sum). The first halvings act on the highest row bits,
    which Triton's blocked layouts keep in each thread's registers, so the large early levels are plain
    adds and only the last few rows cross lanes or warps."""
    R: tl.constexpr = x.shape[0]
    C: tl.constexpr = x.shape[1]
    for i in tl.static_range(16):
        if (R >> i) > 1:
            x = tl.sum(tl.reshape(x, (2, R >> (i + 1), C)), axis=0)
    return tl.reshape(x, (C,))


@triton.jit
def _rows(stride0, stride1, num_blocks, bt_row, bt_cols, pos, u, D: tl.constexpr, RATIO: tl.constexpr,
          OVERLAP: tl.constexpr, SBS: tl.constexpr):
    """(float offset in the state cache of the kv columns of window rows u, int64; row present) for the
    window ending at pos (< 2^31)."""
    W: tl.constexpr = (1 + OVERLAP) * RATIO
    wp = pos.to(tl.int32) + 1 - W + u                    # positions of the window rows
    ok = wp >= 0
    blk = tl.where(ok, wp // SBS, 0)
    ok = ok & (blk < bt_cols)
    bn = tl.load(bt_row + blk, mask=ok, other=-1)
    ok = ok & (bn >= 0) & (bn < num_blocks)
    row = tl.where(ok, bn, 0).to(tl.int64) * stride0 + (tl.where(ok, wp % SBS, 0) * stride1 + (u >= RATIO).to(
        tl.int32) * (OVERLAP * D)).to(tl.int64)          # C4: rows 4..7 read the second D floats of each half
    return row, ok


@triton.jit
def _window(stride0, stride1, num_blocks, bt_row, bt_cols, pos, D: tl.constexpr, RATIO: tl.constexpr,
            OVERLAP: tl.constexpr, SBS: tl.constexpr):
    """_rows of the whole window as one tile: tile row i holds window row bit_reverse(i) (_tree_sum_rows)."""
    W: tl.constexpr = (1 + OVERLAP) * RATIO
    return _rows(stride0, stride1, num_blocks, bt_row, bt_cols, pos, _bit_reverse(tl.arange(0, W), W), D, RATIO,
                 OVERLAP, SBS)


@triton.jit
def _load_tile(state_ptr, row, ok, cols, live, D: tl.constexpr, OVERLAP: tl.constexpr):
    """(score, kv) [rows, len(cols)] of window rows (absent rows: -inf, 0); nothing is read unless live.
    kv is loaded first: the compiler then issues all the loads before the exponentials need the scores."""
    ptr = state_ptr + row[:, None] + cols[None, :]
    mask = (ok & live)[:, None] & (cols >= 0)[None, :]
    kv = tl.load(ptr, mask=mask, other=0.0)
    return tl.load(ptr + (1 + OVERLAP) * D, mask=mask, other=float("-inf")), kv


@triton.jit
def _pool_tile(sc, kv):
    """Softmax pooling over the rows of a tile: the max, e_u = exp(s_u - max), the sums of e_u and
    e_u * kv_u as pairwise trees over the window rows, then num / den (IEEE division)."""
    e = _exp_neg(sc - tl.max(sc, axis=0)[None, :])
    return tl.math.div_rn(_tree_sum_rows(e * kv), _tree_sum_rows(e))


@triton.jit
def _pool_slice(state_ptr, row, ok, c0, SLICE: tl.constexpr, COLS: tl.constexpr, D: tl.constexpr,
                OVERLAP: tl.constexpr, PREFETCH: tl.constexpr):
    """Pooled y (fp32) of the SLICE columns from c0, COLS columns a tile. With PREFETCH the loads of the
    next tile are issued before the current one is reduced (two tiles live in registers)."""
    NC: tl.constexpr = SLICE // COLS
    cols = c0 + tl.arange(0, COLS)
    if NC == 1:
        sc, kv = _load_tile(state_ptr, row, ok, cols, True, D, OVERLAP)
        y = _pool_tile(sc, kv)
    else:
        which = tl.arange(0, NC)
        acc = tl.zeros((NC, COLS), dtype=tl.float32)
        if PREFETCH:
            sc, kv = _load_tile(state_ptr, row, ok, cols, True, D, OVERLAP)
            for c in range(NC):
                sc_next, kv_next = _load_tile(state_ptr, row, ok, cols + (c + 1) * COLS, c + 1 < NC, D, OVERLAP)
                acc = tl.where(which[:, None] == c, _pool_tile(sc, kv)[None, :], acc)
                sc, kv = sc_next, kv_next
        else:
            for c in range(NC):
                sc, kv = _load_tile(state_ptr, row, ok, cols + c * COLS, True, D, OVERLAP)
                acc = tl.where(which[:, None] == c, _pool_tile(sc, kv)[None, :], acc)
        y = tl.reshape(acc, (SLICE,))
    return y


@triton.jit
def _pairwise_sum_rows(x):
    """Sums over axis -2 of x [R, C] or [G, R, C] (R a power of two, rows in natural order): the tree of
    adjacent rows ((r0 + r1) + (r2 + r3)) + ... (reference.pairwise_sum)."""
    if len(x.shape) == 3:
        G: tl.constexpr = x.shape[0]
        R: tl.constexpr = x.shape[1]
        C: tl.constexpr = x.shape[2]
        for i in tl.static_range(16):
            if (R >> i) > 1:
                x = tl.sum(tl.reshape(x, (G, R >> (i + 1), 2, C)), axis=2)
        y = tl.reshape(x, (G, C))
    else:
        R2: tl.constexpr = x.shape[0]
        C2: tl.constexpr = x.shape[1]
        for i in tl.static_range(16):
            if (R2 >> i) > 1:
                x = tl.sum(tl.reshape(x, (R2 >> (i + 1), 2, C2)), axis=1)
        y = tl.reshape(x, (C2,))
    return y


@triton.jit
def _push(b, carry, s0, s1, s2, s3):
    """Adds the tree of row block b to a stack of finished left subtrees (s_l: 2^l blocks, present when
    bit l of b is set): b's sum is added to its left siblings level by level while b's bits are 1 (left +
    right, as the tree of adjacent pairs does), then parked at the first 0 bit. Every sum is computed and
    selected: no divergent control flow. Returns (the carry, the stack); the carry is the tree of blocks
    0..b when b = 2^k - 1."""
    go = (b & 1) != 0
    t = tl.where(go, s0 + carry, carry)
    s0 = tl.where(go, s0, carry)
    carry = t
    nxt = go & ((b & 2) != 0)
    t = tl.where(nxt, s1 + carry, carry)
    s1 = tl.where(go & ~nxt, carry, s1)
    carry = t
    go = nxt
    nxt = go & ((b & 4) != 0)
    t = tl.where(nxt, s2 + carry, carry)
    s2 = tl.where(go & ~nxt, carry, s2)
    carry = t
    go = nxt
    nxt = go & ((b & 8) != 0)
    t = tl.where(nxt, s3 + carry, carry)
    s3 = tl.where(go & ~nxt, carry, s3)
    return t, s0, s1, s2, s3


@triton.jit
def _block_rows(stride0, stride1, num_blocks, bt_row, bt_cols, pos, blocks, RB: tl.constexpr, D: tl.constexpr,
                RATIO: tl.constexpr, OVERLAP: tl.constexpr, SBS: tl.constexpr):
    """_rows [G, RB] of window row blocks ``blocks`` [G] (rows blocks * RB + 0 .. RB - 1). When a row block
    is exactly one state block (RB = block size; windows start at multiples of r, so of the block size),
    one table entry serves its rows and the per-row work is a multiply-add."""
    W: tl.constexpr = (1 + OVERLAP) * RATIO
    j = tl.arange(0, RB)[None, :]
    u = blocks[:, None] * RB + j
    if (RB == SBS) and (RATIO % SBS == 0):
        p0 = pos.to(tl.int32) + 1 - W + blocks * RB
        q = p0 // SBS
        live = (p0 >= 0) & (q < bt_cols)
        bn = tl.load(bt_row + tl.where(live, q, 0), mask=live, other=-1)
        live = live & (bn >= 0) & (bn < num_blocks)
        row = tl.where(live, bn, 0).to(tl.int64)[:, None] * stride0 + (
            j * stride1 + (u >= RATIO).to(tl.int32) * (OVERLAP * D)).to(tl.int64)
        ok = live[:, None] & (j >= 0)
    else:
        row, ok = _rows(stride0, stride1, num_blocks, bt_row, bt_cols, pos, u, D, RATIO, OVERLAP, SBS)
    return row, ok


@triton.jit
def _load_blocks(state_ptr, row, ok, cols, live, D: tl.constexpr, OVERLAP: tl.constexpr, KV: tl.constexpr = True):
    """(score, kv) [G, RB, len(cols)] of row blocks (absent rows: -inf, 0); nothing is read unless live
    (nor kv unless KV)."""
    ptr = state_ptr + row[:, :, None] + cols[None, None, :]
    mask = (ok & live)[:, :, None] & (cols >= 0)[None, None, :]
    if KV:
        kv = tl.load(ptr, mask=mask, other=0.0)
    sc = tl.load(ptr + (1 + OVERLAP) * D, mask=mask, other=float("-inf"))
    if not KV:
        kv = sc
    return sc, kv


@triton.jit
def _pool_stream(state_ptr, stride0, stride1, num_blocks, bt_row, bt_cols, pos, c0, SLICE: tl.constexpr,
                 RB: tl.constexpr, G: tl.constexpr, D: tl.constexpr, RATIO: tl.constexpr, OVERLAP: tl.constexpr,
                 SBS: tl.constexpr, PREFETCH: tl.constexpr):
    """Pooled y of the SLICE columns from c0, streaming the window in blocks of RB rows. G groups of
    warps each own W / G consecutive rows (a subtree of the oracle's tree) and walk their blocks in step:
    [G, RB, SLICE] tiles with each block's rows in a thread's registers (4 columns a thread), so nothing
    crosses lanes or warps inside the loops. A first pass takes the max of the scores (the groups' maxima
    meet once); the second computes each block's e_u, sums its rows as adjacent pairs and joins the block
    sums of a group with _push (at most 16 blocks a group); the G subtrees are summed as adjacent pairs at
    the end: the same tree over the W rows as the oracle's. The scores are read twice (the second time
    mostly from L2). With PREFETCH each pass issues the next block's loads before reducing the current one."""
    W: tl.constexpr = (1 + OVERLAP) * RATIO
    NB: tl.constexpr = W // (RB * G)                  # blocks a group
    tl.static_assert(NB <= 16)
    cols = c0 + tl.arange(0, SLICE)
    first = tl.arange(0, G) * NB
    row, ok = _block_rows(stride0, stride1, num_blocks, bt_row, bt_cols, pos, first, RB, D, RATIO, OVERLAP, SBS)
    sc, _ = _load_blocks(state_ptr, row, ok, cols, PREFETCH, D, OVERLAP, False)
    m = tl.full((G, SLICE), float("-inf"), tl.float32)
    for b in range(NB):
        nb = b + PREFETCH                                # the block loaded now (this one, or the next)
        row, ok = _block_rows(stride0, stride1, num_blocks, bt_row, bt_cols, pos, first + nb, RB, D, RATIO, OVERLAP,
                              SBS)
        sc_new, _ = _load_blocks(state_ptr, row, ok, cols, nb < NB, D, OVERLAP, False)
        if PREFETCH:
            m = tl.maximum(m, tl.max(sc, axis=1))
            sc = sc_new
        else:
            m = tl.maximum(m, tl.max(sc_new, axis=1))
    mx = tl.max(m, axis=0)[None, None, :]
    zero = tl.zeros((G, SLICE), dtype=tl.float32)
    n0, n1, n2, n3, d0, d1, d2, d3 = zero, zero, zero, zero, zero, zero, zero, zero
    num, den = zero, zero
    row, ok = _block_rows(stride0, stride1, num_blocks, bt_row, bt_cols, pos, first, RB, D, RATIO, OVERLAP, SBS)
    sc, kv = _load_blocks(state_ptr, row, ok, cols, PREFETCH, D, OVERLAP)
    for b in range(NB):
        nb = b + PREFETCH
        row, ok = _block_rows(stride0, stride1, num_blocks, bt_row, bt_cols, pos, first + nb, RB, D, RATIO, OVERLAP,
                              SBS)
        sc_new, kv_new = _load_blocks(state_ptr, row, ok, cols, nb < NB, D, OVERLAP)
        if not PREFETCH:
            sc, kv = sc_new, kv_new
        e = _exp_neg(sc - mx)
        num, n0, n1, n2, n3 = _push(b, _pairwise_sum_rows(e * kv), n0, n1, n2, n3)
        den, d0, d1, d2, d3 = _push(b, _pairwise_sum_rows(e), d0, d1, d2, d3)
        if PREFETCH:
            sc, kv = sc_new, kv_new
    return tl.math.div_rn(_pairwise_sum_rows(num), _pairwise_sum_rows(den))


@triton.jit
def _norm_rope(y, w_ptr, eps, cs_row_ptr, D: tl.constexpr, ROUND: tl.constexpr = False):
    """(yh, RoPE(yh)) fp32 [D]: RMSNorm of the pooled y, then GPT-J RoPE of the last 64 dims on the fp32
    yh, or with ROUND on bf16(yh) (the V4.1 records: the bf16 latent, rotated in fp32) (cs_row_ptr: the
    cos/sin row of the entry)."""
    yh = _rms_normalize(y, w_ptr, eps, D)
    if ROUND:
        yh = yh.to(tl.bfloat16).to(tl.float32)
    return yh, _rope_last64(yh, cs_row_ptr, D)


@triton.jit
def _finish(y, pos, kslot, w_ptr, eps, cs_ptr, cs_stride, cache_ptr, cache_bs, page_stride, D: tl.constexpr,
            RATIO: tl.constexpr, TARGET: tl.constexpr, FNUZ: tl.constexpr, FMT: tl.constexpr):
    """Norm, RoPE (at the entry's first position), quantization and store of one entry's pooled y (the main
    target's record format: FMT)."""
    V41: tl.constexpr = TARGET == 0 and FMT.quant_dims == D
    yh, roped = _norm_rope(y, w_ptr, eps, cs_ptr + ((pos // RATIO) * RATIO) * cs_stride, D, V41)
    page = cache_ptr + (kslot // cache_bs) * page_stride
    off = kslot % cache_bs
    if V41:
        if FMT.elem_bits == 4:
            _store_v41_fp4(page, off, cache_bs, roped, FNUZ, FMT)
        else:
            _store_v41_fp8(page, off, cache_bs, roped, FNUZ, FMT)
    elif TARGET == 0:
        _store_main(page, off, cache_bs, yh, roped, FNUZ)
    elif TARGET == 1:
        _store_indexer_fp8(page, off, cache_bs, roped, D, FNUZ)
    else:
        _store_indexer_mxfp4(page, off, cache_bs, roped, D)


@triton.jit(do_not_specialize=["num_tokens"])
def _compress_norm_rope_store_kernel(
        state_ptr, state_stride0, state_stride1, num_state_blocks, t2r_ptr, pos_ptr, sslot_ptr, bt_ptr, bt_stride,
        bt_cols, num_reqs, w_ptr, eps, cs_ptr, cs_stride, cs_rows, cache_ptr, kslot_ptr, cache_bs,
        page_stride, num_cache_slots, num_tokens, scratch_ptr, list_ptr, count_ptr,
        D: tl.constexpr, RATIO: tl.constexpr, OVERLAP: tl.constexpr, TARGET: tl.constexpr, FNUZ: tl.constexpr,
        SBS: tl.constexpr, STAGE: tl.constexpr, NSPLIT: tl.constexpr, STREAM: tl.constexpr, ROWS: tl.constexpr,
        GROUPS: tl.constexpr, COLS: tl.constexpr, PREFETCH: tl.constexpr, CHUNK: tl.constexpr, USE_LIST: tl.constexpr,
        FMT: tl.constexpr, PDL: tl.constexpr = False):
    """Program i takes tokens i * CHUNK .. i * CHUNK + CHUNK - 1 (USE_LIST: the i-th listed token, CHUNK 1),
    loads their metadata at once and makes their entries one after the other. STAGE 0: whole entries.
    STAGE 1 (grid [programs, NSPLIT]): the pooled y of a slice of D / NSPLIT columns into scratch (row: the
    list index, or the token). STAGE 2: y from scratch, then the finish."""
    pdl_start(PDL)
    pid = tl.program_id(0)
    if USE_LIST:
        # the mask broadcast to the block by hand (what the compiler does with a scalar mask): Triton 3.9's
        # interpreter rejects a scalar mask on a block load
        tok = tl.load(list_ptr + pid + tl.arange(0, 1), mask=tl.broadcast_to(pid < tl.load(count_ptr), (1,)),
                      other=-1)
    else:
        tok = pid * CHUNK + tl.arange(0, CHUNK)          # < num_tokens < 2^31
    inb = (tok >= 0) & (tok < num_tokens)
    vs = tl.load(sslot_ptr + tok, mask=inb, other=-1)
    vp = tl.load(pos_ptr + tok, mask=inb, other=-1).to(tl.int64)
    vr = tl.load(t2r_ptr + tok, mask=inb, other=-1).to(tl.int64)
    vk = tl.load(kslot_ptr + tok, mask=inb, other=-1).to(tl.int64)
    emit = inb & (vs >= 0) & (vp >= 0) & (vp < cs_rows) & ((vp + 1) % RATIO == 0) & (vr >= 0) & (vr < num_reqs) & (
        vk >= 0) & (vk < num_cache_slots)
    flag = emit.to(tl.int32)
    rank = tl.cumsum(flag, 0) - flag
    n = tl.sum(flag, 0)
    for k in range(CHUNK):
        if k < n:
            sel = emit & (rank == k)
            t = tl.sum(tl.where(sel, tok, 0), 0)
            pos = tl.sum(tl.where(sel, vp, 0), 0)
            req = tl.sum(tl.where(sel, vr, 0), 0)
            kslot = tl.sum(tl.where(sel, vk, 0), 0)
            srow = pid.to(tl.int64) if USE_LIST else t.to(tl.int64)
            if STAGE == 2:
                y = tl.load(scratch_ptr + srow * D + tl.arange(0, D))
                _finish(y, pos, kslot, w_ptr, eps, cs_ptr, cs_stride, cache_ptr, cache_bs, page_stride, D,
                        RATIO, TARGET, FNUZ, FMT)
            else:
                SLICE: tl.constexpr = D // NSPLIT
                c0 = tl.program_id(1) * SLICE if STAGE == 1 else 0
                bt_row = bt_ptr + req * bt_stride
                if STREAM:
                    y = _pool_stream(state_ptr, state_stride0, state_stride1, num_state_blocks, bt_row, bt_cols,
                                     pos, c0, SLICE, ROWS, GROUPS, D, RATIO, OVERLAP, SBS, PREFETCH)
                else:
                    row, ok = _window(state_stride0, state_stride1, num_state_blocks, bt_row, bt_cols, pos, D,
                                      RATIO, OVERLAP, SBS)
                    y = _pool_slice(state_ptr, row, ok, c0, SLICE, COLS, D, OVERLAP, PREFETCH)
                if STAGE == 1:
                    tl.store(scratch_ptr + srow * D + c0 + tl.arange(0, SLICE), y)
                else:
                    _finish(y, pos, kslot, w_ptr, eps, cs_ptr, cs_stride, cache_ptr, cache_bs, page_stride,
                            D, RATIO, TARGET, FNUZ, FMT)


@device_cache()
def _device_facts(device) -> tuple:
    """(arch, encodes fp8 through the fnuz convert) of a GPU, cached so that a launch pays no query."""
    arch, fnuz, _, _ = device_facts(device)
    return arch, fnuz


def default_config(arch: str, head_dim: int, ratio: int) -> dict:
    """Launch configuration per target and compressor; ``python -m dsv4_rocm bench --only compressor
    --sweep`` times the alternatives.

    ``grid``/``chunk``: a prefill-sized step runs a program per ``chunk`` tokens (C4: the 4 tokens of one
    boundary; C128: 8 tokens, most programs find none and leave at once), or per listed entry ("list").
    A chunk holding several boundaries (decode tokens of requests closing windows together, batched with
    a prefill) makes them one after the other; "list" spreads them at the price of a listing pass.
    ``nsplit``: 1 pools a whole entry in one program, more splits its columns over programs and finishes
    in a second launch. ``pool``: "tile" reduces [W, cols] tiles (rows across lanes and warps, tree levels
    through shared memory); "stream" walks blocks of ``rows`` rows kept in each thread's registers, in
    ``groups`` warp groups that meet once (see _pool_stream). ``prefetch``: the next tile's loads in
    flight while one is reduced.
    C4: one [8, D] tile, D / 128 warps: on NVIDIA the 8 rows sit in each thread (4 columns a lane), so the
    max and the row trees stay in registers; AMD's waves of 64 split the rows over two waves (with D / 256
    waves the chunk loop spills scalar registers). C128 on NVIDIA: one program per entry streams its 128 x
    512 window in [2, 8, 512] blocks, 8 warps, no barrier inside its loops (an entry per SM: the prefill
    chunk has 64 entries, the decode step 128). C128 on AMD (304 / 256 CUs, far more than entries): 16
    column slices per entry, then a finishing launch.
    """
    if ratio == 4:
        return dict(grid="chunk", chunk=4, nsplit=1, pool="tile", cols=head_dim, rows=8, groups=1, prefetch=False,
                    num_warps=head_dim // 128, finish_warps=1)
    if arch.startswith("gfx"):
        return dict(grid="chunk", chunk=8, nsplit=16, pool="tile", cols=32, rows=8, groups=1, prefetch=False,
                    num_warps=4, finish_warps=4)
    return dict(grid="chunk", chunk=8, nsplit=1, pool="stream", cols=32, rows=8, groups=2, prefetch=True,
                num_warps=8, finish_warps=4)


def compress_norm_rope_store(state_cache, num_actual, token_to_req_indices, positions, slot_mapping, block_table,
                             block_size, state_width, cos_sin_cache, kv_cache, k_cache_metadata, pdl_kwargs, head_dim,
                             rope_head_dim, compress_ratio, overlap, use_fp4_cache, rms_norm_weight, rms_norm_eps,
                             quant_block, token_stride, scale_dim, *, fmt: L.RecordFormat = L.V40_584,
                             config: dict = None) -> None:
    """vLLM's call form; arguments checked by ``dsv4_rocm.ops.compress_norm_rope_store``. ``fmt``: the record
    format of a head-512 cache (V40_584, V41_528 or V41_FP4_288). ``config`` overrides keys of
    ``default_config`` (benchmark sweeps)."""
    if num_actual == 0:
        return
    target = MAIN if head_dim == 512 else (INDEXER_MXFP4 if use_fp4_cache else INDEXER_FP8)
    fmt = fmt if target == MAIN else L.V40_584
    kbs = kv_cache.shape[1]
    num_reqs = block_table.shape[0]
    kslots = k_cache_metadata.slot_mapping
    prefill = num_actual > 2 * num_reqs             # else decode-sized: one program per token
    use_list, chunk, nsplit, stages = _plan(state_cache.device, head_dim, compress_ratio, target, block_size,
                                            int(overlap), prefill, tuple(sorted(config.items())) if config else (),
                                            fmt)
    entries = count = slot_mapping
    if use_list:                                    # at most N // r + (one per request) entries
        programs = min(num_actual, num_actual // compress_ratio + num_reqs)
        entries, count = compressor_entries(positions, slot_mapping, kslots, token_to_req_indices, num_actual,
                                            compress_ratio, cos_sin_cache.shape[0], num_reqs, kv_cache.shape[0] * kbs,
                                            programs)
    else:
        programs = cdiv(num_actual, chunk)
    scratch = state_cache
    if nsplit > 1:
        scratch = torch.empty(programs if use_list else num_actual, head_dim, dtype=torch.float32,
                              device=state_cache.device)
    cache = kv_cache if kv_cache.dtype == torch.uint8 else kv_cache.view(torch.uint8)
    sst, cst = state_cache.stride(), cos_sin_cache.stride()
    args = (state_cache, sst[0], sst[1], state_cache.shape[0], token_to_req_indices,
            positions, slot_mapping, block_table, block_table.stride(0), block_table.shape[1], num_reqs,
            rms_norm_weight, rms_norm_eps, cos_sin_cache, cst[0], cos_sin_cache.shape[0], cache,
            kslots, kbs, kv_cache.stride(0), kv_cache.shape[0] * kbs, num_actual, scratch, entries, count)
    if nsplit == 1:
        stages[0][(programs,)](*args)
        return
    stages[0][(programs, nsplit)](*args)
    stages[1][(programs,)](*args)


@device_cache(maxsize=256)
def _plan(device, head_dim: int, ratio: int, target: int, block_size: int, overlap: int, prefill: bool,
          config_items: tuple, fmt: L.RecordFormat = L.V40_584):
    """(list entries first, tokens per program, column splits, bound kernel of each launch) of a call shape,
    built once: a launch pays no config dict."""
    arch, fnuz = _device_facts(device)
    cfg = dict(default_config(arch, head_dim, ratio), **dict(config_items))
    nsplit = cfg["nsplit"]
    use_list = prefill and cfg["grid"] == "list"
    chunk = cfg["chunk"] if prefill and not use_list else 1
    meta = dict(D=head_dim, RATIO=ratio, OVERLAP=overlap, TARGET=target, FNUZ=fnuz, SBS=block_size,
                NSPLIT=nsplit, STREAM=cfg["pool"] == "stream", ROWS=cfg["rows"],
                GROUPS=cfg["groups"], COLS=min(cfg["cols"], head_dim // nsplit),
                PREFETCH=bool(cfg["prefetch"]), CHUNK=chunk,
                USE_LIST=use_list, FMT=fmt, num_stages=1, enable_fp_fusion=False)
    k = launch(_compress_norm_rope_store_kernel)
    if nsplit == 1:
        stages = (k.bind(STAGE=0, num_warps=cfg["num_warps"], **meta),)
    else:
        stages = (k.bind(STAGE=1, num_warps=cfg["num_warps"], **meta),
                  k.bind(STAGE=2, num_warps=cfg["finish_warps"], **meta))
    return use_list, chunk, nsplit, stages


def _spec(name, d, ratio, target, chunk, stage=None, config=None, fmt=L.V40_584):
    """A compile-matrix entry: a launch of ``default_config`` (updated by ``config``) on each target;
    stage None = the first launch (0 fused, 1 split pooling); ``fmt`` the main target's record format."""
    def cfg(arch):
        return dict(default_config(arch, d, ratio), **(config or {}))

    def constexprs(arch):
        c = cfg(arch)
        return dict(D=d, RATIO=ratio, OVERLAP=int(ratio == 4), TARGET=target, FNUZ=arch == "gfx942",
                    SBS=4 if ratio == 4 else 8, STAGE=stage if stage is not None else int(c["nsplit"] > 1),
                    NSPLIT=c["nsplit"], STREAM=c["pool"] == "stream", ROWS=c["rows"],
                    GROUPS=c["groups"], COLS=min(c["cols"], d // c["nsplit"]),
                    PREFETCH=c["prefetch"], CHUNK=chunk,
                    USE_LIST=c["grid"] == "list", FMT=fmt)

    def options(arch):
        return dict(num_warps=cfg(arch)["finish_warps" if stage == 2 else "num_warps"], num_stages=1,
                    enable_fp_fusion=False)

    return dict(
        name=name, fn=_compress_norm_rope_store_kernel,
        pointers=dict(state_ptr="*fp32", t2r_ptr="*i32", pos_ptr="*i64", sslot_ptr="*i64", bt_ptr="*i32",
                      w_ptr="*bf16", cs_ptr="*fp32", cache_ptr="*u8", kslot_ptr="*i64", scratch_ptr="*fp32",
                      list_ptr="*i32", count_ptr="*i32"),
        floats=("eps",), constexprs=constexprs, options=options, matrix=False,
        fp8_encode=target != INDEXER_MXFP4 and stage != 1, exact_fp32=True)


FUSED = dict(nsplit=1, pool="stream", rows=8, groups=2, prefetch=True, num_warps=8)       # C128, one launch
SPLIT = dict(nsplit=16, pool="tile", cols=32, prefetch=False, num_warps=4, finish_warps=4)  # C128, two launches
COMPILE_SPECS = [
    _spec("compress_norm_rope_store[c4 main, decode]", 512, 4, MAIN, 1),
    _spec("compress_norm_rope_store[c4 main, prefill]", 512, 4, MAIN, 4),
    _spec("compress_norm_rope_store[c4 main, listed]", 512, 4, MAIN, 1, config=dict(grid="list")),
    _spec("compress_norm_rope_store[c4 indexer fp8, prefill]", 128, 4, INDEXER_FP8, 4),
    _spec("compress_norm_rope_store[c4 indexer mxfp4, prefill]", 128, 4, INDEXER_MXFP4, 4),
    _spec("compress_norm_rope_store[c128 main, fused decode]", 512, 128, MAIN, 1, 0, FUSED),
    _spec("compress_norm_rope_store[c128 main, fused prefill]", 512, 128, MAIN, 8, 0, FUSED),
    _spec("compress_norm_rope_store[c128 main, split pool]", 512, 128, MAIN, 8, 1, SPLIT),
    _spec("compress_norm_rope_store[c128 main, split finish]", 512, 128, MAIN, 8, 2, SPLIT),
    _spec("compress_norm_rope_store[c4 main V41_528, prefill]", 512, 4, MAIN, 4, fmt=L.V41_528),
    _spec("compress_norm_rope_store[c4 main V41_FP4_288, prefill]", 512, 4, MAIN, 4, fmt=L.V41_FP4_288),
]
