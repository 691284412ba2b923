"""Top-k per row of fp32 logits: vLLM's ``top_k_per_row_prefill`` / ``top_k_per_row_decode`` /
``persistent_topk``, the last step of the C4 lightning indexer.

Semantics (docs/conventions.md, "Selection"). Row r holds n valid columns [s, s + n) (prefill:
[row_starts[r], row_ends[r]) clamped into [0, ncols]; decode: s = 0 and n from seq_lens, see
``_row_range``). Its k outputs are column indices relative to s: with n <= k, [0, 1, ..., n-1, -1, ...];
otherwise k distinct columns whose logits are the k largest, in no particular order. Order of values: the
float order (-0 = +0, -inf an ordinary value) with every NaN above +inf, NaNs tied. Of the values tied
at the k-th place, the lowest columns are taken (every tie reaches the candidate list, kept in column
order), so the output set is a function of the row alone.

Keys. ``_order_key`` maps a float to a uint32 whose unsigned order is that order (flip the sign bit of
non-negatives, all bits of negatives, -0 -> +0, NaN -> 0xFFFFFFFF); 0 is below every real key and pads.

Algorithm: a filter that keeps at least k and usually ~1.1 k elements, then an exact radix select.
  K1 ``_group_max_kernel`` (rows longer than RAW_MAX only), grid (rows, CTAs per row): the maximum key of
     every group of G0 columns (groups aligned to multiples of G0 in absolute columns, so loads are
     16-byte vectors) -> fmax [rows, groups]. One pass over the logits, one max per element; 1/G0 of the
     bytes written back.
  K2 ``_select_kernel``, one CTA per row at a time (a grid of at most k2_ctas x SMs CTAs walks the rows,
  so its scratch scales with the SMs, not with the rows of a prefill chunk):
     1. coarse maxima C[GB]: C[j] = max of the level-1 values with index = j mod GB, where the level-1
        values are the group maxima (long rows) or the row's keys themselves (rows up to RAW_MAX).
        Each C[j] is the key of a distinct element of the row (or 0).
     2. t = a lower bound of the k-th largest C: its top T_ROUNDS x DT bits, by radix select
        (``tl.histogram`` of DT-bit digits). At least k entries of C, hence k elements, are >= t; for
        continuous data with GB = 4k about 1.15 k elements are (sampled: 1.07 k at GB = 8k).
     3. candidates: every element with key >= t, compacted in column order into a per-row scratch
        list (keys and columns). Long rows read only the groups whose maximum is >= t (~k groups of
        G0 columns), short rows rescan themselves.
     4. exact radix select over the candidates held in registers (ceil(32 / D) rounds): the k-th
        largest key T and how many of its ties to take; write the columns with key > T, then the first
        ties. With more than CAP candidates (long runs of equal values), the same radix select streams
        over the whole row instead: exact, but ceil(32 / D) + 1 passes of one CTA (the slow path).
  Rows with n <= k take the trivial path in K2 (K1 skips them). Every size is a ``default_config`` entry.

Passes and predicted time on an H100 (copy bandwidth ~3.0 TB/s, ~2-3 us per kernel in a CUDA graph):
  k = 512 over 256K candidates (1 MB), batch 1: K1 reads 1 MB with 64 CTAs (~0.5 us of traffic, ~1.5 us
  with its latency), K2 (one CTA) reads 64 KB of group maxima and ~540 x 16 columns, runs 4 + 7
  histogram rounds on 2048 + 1024 register keys (~0.3 us each) and ~10 block scans: ~6 us. Total with
  two launches: 10-13 us (target 15).
  Batch 64 x 128K (33.5 MB): K1 streams 33.5 MB + 2 MB of maxima (~12 us at 3 TB/s), then K2 runs 64
  CTAs of ~6 us side by side: ~20 us (target 30). In the common case nothing reads the logits twice but
  the ~k qualifying groups.

Memory layout: logits element (r, c) at ``logits + r * stride0 + c * stride1`` (any strides, 64-bit
offsets; loads are masked at the row's storage end ncols, columns past a row's end are read and
ignored); out_idx (r, i) at ``out + r * out.stride(0) + i * out.stride(1)``; scratch: int32 fmax
[rows, ceil(ncols / G0)] (only when some row can exceed RAW_MAX: 1/G0 of the logits' bytes) and
[K2 CTAs, 3 * CAP] (candidate keys, candidate columns, qualifying group ids). Within a CTA, the scratch
written before ``tl.debug_barrier`` is read after it by other threads: bar.sync orders global memory for
the CTA on NVIDIA; on AMD all waves of a workgroup share one CU and its L1, where LLVM's memory model
needs no wait at workgroup scope either.
"""
import functools

import torch
import triton
import triton.language as tl

from ..platform import detect
from ._launch import cdiv, launch, next_power_of_2

RANGES, REQUEST_LENS, ROW_LENS = 0, 1, 2   # how a row's valid columns are given (``_row_range``)


@triton.jit
def _order_key(x):
    """uint32 whose unsigned order is the float order: -0 -> key of +0, every NaN -> 0xFFFFFFFF (the top)."""
    x = x.to(tl.float32)
    sign = (x.to(tl.int32, bitcast=True) >> 31).to(tl.uint32, bitcast=True)     # 0 or all ones
    key = x.to(tl.uint32, bitcast=True) ^ (sign | 0x80000000)
    key = tl.where(key == 0x7FFFFFFF, 0x80000000, key)
    return tl.where(x != x, 0xFFFFFFFF, key)


@triton.jit
def _row_range(r, ncols, a_ptr, b_ptr, a_s0, a_s1, next_n, MODE: tl.constexpr):
    """(first column, valid columns) of row r, both in [0, ncols].
    RANGES:       [a[r], b[r]) (row_starts / row_ends, strides a_s0 / a_s1), clamped; end < start is empty.
    REQUEST_LENS: request r // next_n of length L = a[(r // next_n) * a_s0]; draft row r % next_n sees
                  L - next_n + r % next_n + 1 columns (vLLM's 1-D seq_lens).
    ROW_LENS:     a[(r // next_n) * a_s0 + (r % next_n) * a_s1] columns (2-D seq_lens [B, next_n], or
                  persistent_topk's per-row lengths)."""
    if MODE == 0:
        s = tl.load(a_ptr + r.to(tl.int64) * a_s0).to(tl.int64)
        e = tl.load(b_ptr + r.to(tl.int64) * a_s1).to(tl.int64)
        s = tl.minimum(tl.maximum(s, 0), ncols)
        n = tl.minimum(tl.maximum(e, s), ncols) - s
    elif MODE == 1:
        v = tl.load(a_ptr + (r // next_n).to(tl.int64) * a_s0).to(tl.int64)
        s = (v * 0).to(tl.int64)
        n = tl.minimum(tl.maximum(v - next_n + (r % next_n) + 1, 0), ncols)
    else:
        v = tl.load(a_ptr + (r // next_n).to(tl.int64) * a_s0 + (r % next_n).to(tl.int64) * a_s1).to(tl.int64)
        s = (v * 0).to(tl.int64)
        n = tl.minimum(tl.maximum(v, 0), ncols)
    return s.to(tl.int32), n.to(tl.int32)


@triton.jit
def _keys_at(row, x_s1, col, ncols, start, end, OFF64: tl.constexpr):
    """(keys, inside) of the absolute columns col of a row: key 0 outside [start, end). Loads are masked only
    at the row's storage end ncols (columns past end are read and ignored), so that aligned runs of
    columns load as vectors. Column offsets are 64-bit only where a row spans 2^31 elements (OFF64)."""
    if OFF64:
        x = tl.load(row + col.to(tl.int64) * x_s1, mask=col < ncols, other=0.0)
    else:
        x = tl.load(row + col * x_s1, mask=col < ncols, other=0.0)
    inside = (col >= start) & (col < end)
    return tl.where(inside, _order_key(x), 0), inside


@triton.jit
def _group_max_kernel(x_ptr, x_s0, x_s1, ncols, a_ptr, b_ptr, a_s0, a_s1, next_n, fmax_ptr, fmax_s0, raw_max,
                      splits, MODE: tl.constexpr, G0: tl.constexpr, TILE_G: tl.constexpr, OFF64: tl.constexpr):
    """K1: for rows longer than raw_max, fmax[r, j] = max key of the row's columns in the aligned group
    [(start // G0 + j) * G0, + G0) of absolute columns. CTA (r, sp) covers a contiguous share of the
    row's groups, TILE_G groups per step."""
    r = tl.program_id(0)
    sp = tl.program_id(1)
    start, n = _row_range(r, ncols, a_ptr, b_ptr, a_s0, a_s1, next_n, MODE)
    if n > raw_max:
        end = start + n
        first = start // G0
        groups = tl.cdiv(end, G0) - first
        per = tl.cdiv(tl.cdiv(groups, splits), TILE_G) * TILE_G
        lo = sp * per
        hi = tl.minimum(lo + per, groups)
        row = x_ptr + r.to(tl.int64) * x_s0
        out = fmax_ptr + r.to(tl.int64) * fmax_s0
        gl = tl.arange(0, TILE_G)
        el = tl.arange(0, G0)
        for g0 in range(lo, hi, TILE_G):
            gi = g0 + gl
            key, _ = _keys_at(row, x_s1, (first + gi)[:, None] * G0 + el[None, :], ncols, start, end, OFF64)
            tl.store(out + gi, tl.max(key, axis=1).to(tl.int32, bitcast=True), mask=gi < hi)


@triton.jit
def _descend(hist, need, prefix, RND: tl.constexpr, D: tl.constexpr):
    """One radix step: the largest digit d with #(digit >= d) >= need goes into prefix at digit RND; need
    drops by #(digit > d)."""
    bins = tl.arange(0, 1 << D)
    ge = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist
    d = tl.max(tl.where(ge >= need, bins, 0), 0)
    above = tl.sum(tl.where(bins == d, ge - hist, 0), 0)
    hi = 32 - RND * D
    return prefix | (d.to(tl.uint32) << (hi - D if hi > D else 0)), need - above


@triton.jit
def _digit(keys, RND: tl.constexpr, D: tl.constexpr):
    """Digit RND (from the top) of D bits; the last digit takes what is left of the 32 bits."""
    hi = 32 - RND * D
    lo = hi - D if hi > D else 0
    return ((keys >> lo) & ((1 << (hi - lo)) - 1)).to(tl.int32)


@triton.jit
def _same_prefix(keys, prefix, RND: tl.constexpr, D: tl.constexpr):
    """keys whose digits above digit RND equal prefix's."""
    if RND == 0:
        same = keys == keys
    else:
        same = (keys >> (32 - RND * D)) == (prefix >> (32 - RND * D))
    return same


@triton.jit
def _select_block(keys, valid, need, ROUNDS: tl.constexpr, D: tl.constexpr):
    """Radix select over a register block: the top ROUNDS digits P of the need-th largest valid key (as a
    key with the lower bits 0) and how many keys with those top digits the need largest contain."""
    prefix = tl.zeros([], tl.uint32)
    for rnd in tl.static_range(ROUNDS):
        m = valid & _same_prefix(keys, prefix, rnd, D)
        prefix, need = _descend(tl.histogram(_digit(keys, rnd, D), 1 << D, mask=m), need, prefix, rnd, D)
    return prefix, need


@triton.jit
def _select_stream(row, x_s1, ncols, start, end, t, need, CHUNK: tl.constexpr, ROUNDS: tl.constexpr,
                   D: tl.constexpr, OFF64: tl.constexpr):
    """_select_block over the keys >= t of a whole row, streamed in chunks (the slow path)."""
    prefix = tl.zeros([], tl.uint32)
    offs = tl.arange(0, CHUNK)
    for rnd in tl.static_range(ROUNDS):
        hist = tl.zeros([1 << D], tl.int32)
        for base in range((start // 16) * 16, end, CHUNK):
            key, inside = _keys_at(row, x_s1, base + offs, ncols, start, end, OFF64)
            m = inside & (key >= t) & _same_prefix(key, prefix, rnd, D)
            hist += tl.histogram(_digit(key, rnd, D), 1 << D, mask=m)
        prefix, need = _descend(hist, need, prefix, rnd, D)
    return prefix, need


@triton.jit
def _emit(out_row, out_s1, cols, keys, ok, T, n_gt, k, done_gt, done_eq):
    """Write the columns with key > T at done_gt.., the ties at n_gt + done_eq.. (while < k); returns the
    updated counts."""
    gt = ok & (keys > T)
    eq = ok & (keys == T)
    pg = done_gt + tl.cumsum(gt.to(tl.int32), 0) - 1
    tl.store(out_row + pg.to(tl.int64) * out_s1, cols, mask=gt)
    pe = n_gt + done_eq + tl.cumsum(eq.to(tl.int32), 0) - 1
    tl.store(out_row + pe.to(tl.int64) * out_s1, cols, mask=eq & (pe < k))
    return done_gt + tl.sum(gt.to(tl.int32), 0), done_eq + tl.sum(eq.to(tl.int32), 0)


@triton.jit
def _select_kernel(x_ptr, x_s0, x_s1, ncols, a_ptr, b_ptr, a_s0, a_s1, next_n, out_ptr, out_s0, out_s1, k,
                   num_rows, fmax_ptr, fmax_s0, ws_ptr, ws_s0, raw_max,
                   MODE: tl.constexpr, G0: tl.constexpr, GB: tl.constexpr, LF: tl.constexpr, CAP: tl.constexpr,
                   D: tl.constexpr, DT: tl.constexpr, T_ROUNDS: tl.constexpr, CHUNK: tl.constexpr,
                   GATHER: tl.constexpr, KB: tl.constexpr, OFF64: tl.constexpr):
    """K2: CTA p selects rows p, p + grid, ... one after the other, reusing its scratch row ws[p]."""
    ws_row = ws_ptr + tl.program_id(0).to(tl.int64) * ws_s0      # [CAP keys | CAP columns | CAP group ids]
    for r in range(tl.program_id(0), num_rows, tl.num_programs(0)):
        _select_row(r, x_ptr, x_s0, x_s1, ncols, a_ptr, b_ptr, a_s0, a_s1, next_n, out_ptr, out_s0, out_s1, k,
                    fmax_ptr, fmax_s0, ws_row, raw_max, MODE, G0, GB, LF, CAP, D, DT, T_ROUNDS, CHUNK, GATHER, KB,
                    OFF64)
        tl.debug_barrier()                                # the next row overwrites the scratch


@triton.jit
def _select_row(r, x_ptr, x_s0, x_s1, ncols, a_ptr, b_ptr, a_s0, a_s1, next_n, out_ptr, out_s0, out_s1, k,
                fmax_ptr, fmax_s0, ws_row, raw_max, MODE: tl.constexpr, G0: tl.constexpr, GB: tl.constexpr,
                LF: tl.constexpr, CAP: tl.constexpr, D: tl.constexpr, DT: tl.constexpr, T_ROUNDS: tl.constexpr,
                CHUNK: tl.constexpr, GATHER: tl.constexpr, KB: tl.constexpr, OFF64: tl.constexpr):
    """Steps 1-4 of the module docstring for row r."""
    ROUNDS: tl.constexpr = (32 + D - 1) // D
    r = r + tl.zeros([], tl.int32)                    # a tensor also where the loop yields Python ints
    start, n = _row_range(r, ncols, a_ptr, b_ptr, a_s0, a_s1, next_n, MODE)
    out_row = out_ptr + r.to(tl.int64) * out_s0
    if n <= k:
        for base in range(0, k, KB):
            i = base + tl.arange(0, KB)
            tl.store(out_row + i.to(tl.int64) * out_s1, tl.where(i < n, i, -1), mask=i < k)
    else:
        row = x_ptr + r.to(tl.int64) * x_s0          # columns are absolute; outputs relative to start
        fmax_row = fmax_ptr + r.to(tl.int64) * fmax_s0
        end = start + n
        a0 = (start // 16) * 16                       # chunks start aligned: vector loads
        grouped = n > raw_max
        first = start // G0
        n_groups = tl.cdiv(end, G0) - first
        # 1. coarse maxima: coarse[j] = max of the level-1 values at j mod GB, LF * GB of them per step
        gofs = tl.arange(0, GB)
        lofs = tl.arange(0, LF)[:, None] * GB + gofs[None, :]
        coarse = tl.zeros([GB], tl.uint32)
        if grouped:
            for base in range(0, n_groups, LF * GB):
                j = base + lofs
                f = tl.load(fmax_row + j, mask=j < n_groups, other=0).to(tl.uint32, bitcast=True)
                coarse = tl.maximum(coarse, tl.max(f, axis=0))
        else:
            for base in range(a0, end, LF * GB):
                key, _ = _keys_at(row, x_s1, base + lofs, ncols, start, end, OFF64)
                coarse = tl.maximum(coarse, tl.max(key, axis=0))
        # 2. t: at least k coarse maxima, so at least k elements, are >= t
        t, _ = _select_block(coarse, gofs < GB, k, T_ROUNDS, DT)
        # 3. candidates (key >= t) into the scratch list, in column order
        cofs = tl.arange(0, CHUNK)
        cnt = tl.zeros([], tl.int32)
        if grouped:
            ng = tl.zeros([], tl.int32)
            for base in range(0, n_groups, CHUNK):
                j = base + cofs
                f = tl.load(fmax_row + j, mask=j < n_groups, other=0).to(tl.uint32, bitcast=True)
                q = (j < n_groups) & (f >= t)
                pos = ng + tl.cumsum(q.to(tl.int32), 0) - 1
                tl.store(ws_row + 2 * CAP + pos, j, mask=q & (pos < CAP))
                ng += tl.sum(q.to(tl.int32), 0)
            tl.debug_barrier()
            if ng <= CAP:
                gl = tl.arange(0, GATHER)
                el = tl.arange(0, G0)
                for base in range(0, ng, GATHER):
                    gi = base + gl
                    g = tl.load(ws_row + 2 * CAP + gi, mask=gi < ng, other=0)
                    col = (first + g)[:, None] * G0 + el[None, :]
                    key, inside = _keys_at(row, x_s1, col, ncols, start, end, OFF64)
                    q = tl.reshape(inside & (gi < ng)[:, None] & (key >= t), [GATHER * G0])
                    pos = cnt + tl.cumsum(q.to(tl.int32), 0) - 1
                    keep = q & (pos < CAP)
                    tl.store(ws_row + pos, tl.reshape(key, [GATHER * G0]).to(tl.int32, bitcast=True), mask=keep)
                    tl.store(ws_row + CAP + pos, tl.reshape(col - start, [GATHER * G0]), mask=keep)
                    cnt += tl.sum(q.to(tl.int32), 0)
            else:
                cnt = ng        # > CAP: at least that many candidates
        else:
            for base in range(a0, end, CHUNK):
                c = base + cofs
                key, inside = _keys_at(row, x_s1, c, ncols, start, end, OFF64)
                q = inside & (key >= t)
                pos = cnt + tl.cumsum(q.to(tl.int32), 0) - 1
                keep = q & (pos < CAP)
                tl.store(ws_row + pos, key.to(tl.int32, bitcast=True), mask=keep)
                tl.store(ws_row + CAP + pos, c - start, mask=keep)
                cnt += tl.sum(q.to(tl.int32), 0)
        tl.debug_barrier()
        # 4. exact select (candidate keys in registers, or the streamed slow path), then output in chunks
        if cnt <= CAP:
            ofs = tl.arange(0, CAP)
            keys = tl.load(ws_row + ofs, mask=ofs < cnt, other=0).to(tl.uint32, bitcast=True)
            T, ties = _select_block(keys, ofs < cnt, k, ROUNDS, D)
        else:
            T, ties = _select_stream(row, x_s1, ncols, start, end, t, k, CHUNK, ROUNDS, D, OFF64)
        done_gt = tl.zeros([], tl.int32)
        done_eq = tl.zeros([], tl.int32)
        if cnt <= CAP:
            for base in range(0, cnt, CHUNK):
                c = base + cofs
                ok = c < cnt
                key = tl.load(ws_row + c, mask=ok, other=0).to(tl.uint32, bitcast=True)
                col = tl.load(ws_row + CAP + c, mask=ok, other=0)
                done_gt, done_eq = _emit(out_row, out_s1, col, key, ok, T, k - ties, k, done_gt, done_eq)
        else:
            for base in range(a0, end, CHUNK):
                c = base + cofs
                key, inside = _keys_at(row, x_s1, c, ncols, start, end, OFF64)
                done_gt, done_eq = _emit(out_row, out_s1, c - start, key, inside, T, k - ties, k, done_gt,
                                         done_eq)


def _pow2(v: int) -> int:
    return next_power_of_2(max(int(v), 1))


def default_config(arch: str, k: int) -> dict:
    """Tile sizes for k on a target; every entry can be overridden through ``config=`` (sweeps):
    group      G0, columns per group maximum (K1); rows longer than raw_max go through K1
    raw_max    rows up to this length are filtered from their own keys (no K1)
    coarse     GB, coarse maxima (4 k: ~1.15 k candidates on continuous data; 2 k: ~1.4 k)
    load       level-1 values read per coarsening step (a multiple of GB, at least GB)
    cap        CAP, candidate keys held in registers (more: the streamed slow path)
    digit      D, bits per digit of the exact select: the warp width's log2 (one histogram bin per lane)
    t_digit, t_rounds: digits of the filter threshold t (more bits: fewer candidates when values cluster)
    tile       columns per K1 step; ctas: K1 CTAs per SM to aim at (the split of long rows)
    k2_ctas    K2 CTAs per SM at most; each takes every grid-th row, so scratch scales with SMs, not rows
    chunk      columns per K2 streaming step; gather: columns gathered per K2 step (a multiple of G0)
    warps_k1, warps_k2: num_warps of the two kernels."""
    kp = _pow2(k)
    g0 = max(1, min(16, 32768 // (4 * kp)))
    amd = arch.startswith("gfx")
    d = 6 if amd else 5
    # K2: 16 warps from k = 512 on, 8 on AMD (wave64: 512 threads; 1024 would leave 128 VGPRs each);
    # streaming steps of 4 columns per thread (2 beyond k = 2048)
    warps = 8 if amd or kp < 512 else 16
    step = 4 * warps * (64 if amd else 32) // (2 if kp > 2048 else 1)
    coarse = max(256, 4 * kp if kp <= 1024 else 2 * kp)      # 2 k beyond 1024: ~1.4 k candidates, in registers
    return dict(group=g0, raw_max=max(4 * kp * g0, 1024), coarse=coarse, load=step,
                cap=min(8192, max(256, 2 * kp)), digit=d, t_digit=d, t_rounds=4, tile=4096, ctas=4, k2_ctas=2,
                chunk=step, gather=step, warps_k1=8, warps_k2=warps)


@functools.lru_cache(maxsize=None)
def _device_facts(index: int):
    """(arch, SM count) of a GPU, cached: launches must not pay for a properties query."""
    dev = torch.device("cuda", index)
    return detect(dev).arch, torch.cuda.get_device_properties(dev).multi_processor_count


def _facts(device):
    if device.type != "cuda":            # the Triton interpreter (CPU tensors): an H100-like setup
        return "sm_90", 132
    return _device_facts(device.index if device.index is not None else torch.cuda.current_device())


def _launch(logits, mode, a, b, a_s0, a_s1, next_n, out, num_rows, k, config):
    if num_rows == 0:
        return
    arch, sms = _facts(logits.device)
    cfg, select = _plan(arch, k, mode, tuple(sorted(config.items())) if config else ())
    g0, cap = cfg["group"], cfg["cap"]
    ncols = logits.shape[1]
    x_s0, x_s1 = logits.stride()
    grouped = ncols > cfg["raw_max"]
    fmax_w = cdiv(ncols, g0) if grouped else 1
    fmax = torch.empty(num_rows if grouped else 1, fmax_w, dtype=torch.int32, device=logits.device)
    programs = max(1, min(num_rows, int(cfg["k2_ctas"] * sms)))
    ws = torch.empty(programs, 3 * cap, dtype=torch.int32, device=logits.device)
    row_args = (logits, x_s0, x_s1, ncols, a, b, a_s0, a_s1, next_n)
    off64 = (ncols + 16) * abs(x_s1) >= 2 ** 31        # column offsets past int32 (aligned chunks overrun by < 16)
    if grouped:
        tile_g = max(1, cfg["tile"] // g0)
        steps = cdiv(cdiv(ncols, g0), tile_g)
        splits = max(1, min(steps, cdiv(cfg["ctas"] * sms, num_rows), 65535))
        launch(_group_max_kernel)[(num_rows, splits)](*row_args, fmax, fmax_w, cfg["raw_max"], splits, MODE=mode, G0=g0,
                                                      TILE_G=tile_g, OFF64=off64, num_warps=cfg["warps_k1"])
    select[off64][(programs,)](*row_args, out, out.stride(0), out.stride(1), k, num_rows, fmax, fmax_w, ws,
                               ws.stride(0), cfg["raw_max"])


@functools.lru_cache(maxsize=256)
def _plan(arch: str, k: int, mode: int, config_items: tuple):
    """(config, the select kernel bound for OFF64 False / True) of a target, k and call form, built once."""
    cfg = default_config(arch, k)
    unknown = set(dict(config_items)) - set(cfg)
    if unknown:
        raise ValueError(f"unknown top-k config keys {sorted(unknown)}; known: {sorted(cfg)}")
    cfg.update(dict(config_items))
    consts = dict(_select_constexprs(cfg, mode), **_select_options(arch, cfg["warps_k2"]))
    select = tuple(launch(_select_kernel).bind(OFF64=off64, **consts) for off64 in (False, True))
    return cfg, select


def _select_options(arch, warps):
    """num_warps, and on NVIDIA with 8 warps or fewer .maxnreg 255: K2 runs one CTA per SM, and without the
    bound ptxas spills to stay at 128 registers for an occupancy it cannot use (at 16 warps, 128 is the
    limit anyway, and an explicit bound measured worse)."""
    if arch.startswith("gfx") or warps > 8:
        return dict(num_warps=warps)
    return dict(num_warps=warps, maxnreg=255)


def _select_constexprs(cfg, mode):
    t_digit = cfg["t_digit"]
    return dict(MODE=mode, G0=cfg["group"], GB=cfg["coarse"], LF=max(1, cfg["load"] // cfg["coarse"]),
                CAP=cfg["cap"], D=cfg["digit"],
                DT=t_digit, T_ROUNDS=min(cfg["t_rounds"], cdiv(32, t_digit)), CHUNK=cfg["chunk"],
                GATHER=max(1, cfg["gather"] // cfg["group"]), KB=1024)


def top_k_per_row_prefill(logits, row_starts, row_ends, out_idx, num_rows: int, stride0: int, stride1: int, k: int,
                          config: dict = None) -> None:
    """vLLM's ``top_k_per_row_prefill``; arguments checked by ``dsv4_rocm.ops.top_k_per_row_prefill``."""
    _launch(logits, RANGES, row_starts, row_ends, row_starts.stride(0), row_ends.stride(0), 1, out_idx, num_rows, k,
            config)


def top_k_per_row_decode(logits, next_n: int, seq_lens, out_idx, num_rows: int, stride0: int, stride1: int, k: int,
                         config: dict = None) -> None:
    """vLLM's ``top_k_per_row_decode``: 1-D seq_lens [B] (or [B, 1]) per request, 2-D [B, next_n] per row."""
    per_row = seq_lens.dim() == 2 and seq_lens.shape[1] == next_n and next_n > 1
    s1 = seq_lens.stride(1) if seq_lens.dim() == 2 else 0
    _launch(logits, ROW_LENS if per_row else REQUEST_LENS, seq_lens, seq_lens, seq_lens.stride(0), s1, next_n,
            out_idx, num_rows, k, config)


def persistent_topk(logits, lengths, output, workspace, k: int, max_seq_len: int, config: dict = None) -> None:
    """vLLM's ``persistent_topk``: per-row lengths (numel = rows, any 1-D or 2-D contiguous shape)."""
    flat = lengths.reshape(-1)
    _launch(logits, ROW_LENS, flat, flat, flat.stride(0), 0, 1, output, logits.shape[0], k, config)


_PTRS = dict(x_ptr="*fp32", a_ptr="*i32", b_ptr="*i32", fmax_ptr="*i32", out_ptr="*i32", ws_ptr="*i32")
_SELECT_SPECS = [  # (k, mode, logits type): each call form once, k from 512 to 2048
    (512, REQUEST_LENS, "*fp32"), (2048, RANGES, "*fp32"), (1024, ROW_LENS, "*bf16")]

# entries of the CPU compile matrix (build_tools/compile_matrix.py)
COMPILE_SPECS = [
    dict(name=f"top_k_per_row_select[k={k},mode={mode}]", fn=_select_kernel, pointers=dict(_PTRS, x_ptr=xt),
         floats=(), constexprs=lambda arch, k=k, mode=mode: _select_constexprs(default_config(arch, k), mode),
         options=lambda arch, k=k: _select_options(arch, default_config(arch, k)["warps_k2"]), matrix=False,
         # the select loop keeps ~40 scalars (bounds, digit state, pointers) live across its rounds: past the
         # 106 SGPRs of a wave on AMD, some sit in VGPR lanes (v_writelane / v_readlane), never in memory
         sgpr_spills="scalar loop state of the radix rounds")
    for k, mode, xt in _SELECT_SPECS
] + [
    dict(name="top_k_per_row_group_max", fn=_group_max_kernel, pointers=_PTRS, floats=(),
         constexprs=lambda arch: dict(MODE=REQUEST_LENS, G0=16, TILE_G=256, OFF64=False),
         options=lambda arch: dict(num_warps=8), matrix=False),
]
