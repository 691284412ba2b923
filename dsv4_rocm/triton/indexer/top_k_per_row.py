"""Top-k per row of fp32 logits: vLLM's ``top_k_per_row_prefill`` / ``top_k_per_row_decode`` /
``persistent_topk``, the last step of the C4 lightning indexer.

Semantics (docs/conventions.md, "Selection"). Row r holds n valid columns [s, s + n) (prefill:
[row_starts[r], row_ends[r]) clamped into [0, ncols]; decode: s = 0 and n from seq_lens, see
``_row_range``). Its k outputs are column indices relative to s: with n <= k, [0, 1, ..., n-1, -1, ...];
otherwise k distinct columns whose logits are the k largest, in no particular order. Order of values: the
float order (-0 = +0, -inf an ordinary value) with every NaN above +inf, NaNs tied. Of the values tied
at the k-th place, the lowest columns are taken, so the output set is a function of the row alone.

Keys. ``_order_key`` maps a float to a uint32 whose unsigned order is that order (flip the sign bit of
non-negatives, all bits of negatives, -0 -> +0, NaN -> 0xFFFFFFFF); 0 is below every real key and pads.

Exact selection in registers (``_kth_largest``): a radix select over a register block of keys, D-bit
digits (one ``tl.histogram`` of 2^D bins a round). It starts below the bits all candidates share (the
highest bit where the largest and smallest differ) and stops as soon as the bin holding the k-th
largest is taken whole, so a block of distinct values needs 2-3 rounds of 8 bits, not 32 / D. Its
result (T, above): the k largest are the keys > T plus k - above of the keys == T; when those ties are
not all taken, a second select over their negated columns finds the largest column C to take
(``_select_regs``), so candidates may come in any order.

Rows by length (ncols decides on the host which kernels run; each row's own length decides inside them):
  * n <= k: [0..n-1, -1...].
  * short rows (the row's 16-aligned span fits RM columns): the keys in registers, the select, the
    output; one CTA, one pass, no scratch. The C4 decode step (2048 candidates a row) is all short rows
    and runs the fused kernel without its long-row path, RM sized to the width.
  * long rows, in two passes:
    1. coarse maxima C[j] = max key of the columns c with c % GB == j (GB ~ 2-4 k of them; strided, so
       a run of high values lands in distinct C[j]), and group maxima fmax[g] of every aligned group of
       G0 columns (stored: 1/G0 of the logits' bytes). t: at least k of the C, hence k elements, are
       >= t, and at most k/8 more C than needed (the select over C stops there); for i.i.d. values about
       1.15 k (GB = 4 k) or 1.4 k (GB = 2 k) elements are >= t. t depends on ranks only: values in a
       narrow range or a few exponents filter as well as spread ones, and so do sorted rows.
    2. candidates: the group maxima are scanned FS at a time, the groups whose maximum is >= t listed
       (a CTA-private scratch list, so that they load densely) and loaded (1/G0 of the row plus those
       groups is read again); their keys >= t go to the row's candidate list with their columns (<= CAP
       of them), then the exact select over the list in registers, and the output. With more than CAP
       candidates (thousands of ties at t) the select streams over the whole row in column order instead:
       exact, up to ceil(32 / D) + 1 passes of one CTA (the slow path).
    Three ways to run them, chosen from rows x SMs and the row width on the host (``_plan``):
    - split in one launch (fewer rows than CTAs to fill the GPU, rows of at most ``one_launch`` groups; off
      by default, ``default_config`` says why):
      ``_split1_kernel``, S CTAs a row run pass 1 as ``_coarse_kernel`` below; the CTA that arrives last
      computes t and runs pass 2 over the whole row alone, as the fused kernel does (its first scan step's
      group maxima loaded beside the coarse maxima, before t is known), then the output. At b = 1 the
      work is a few memory round trips a pass, so what counts is the chain: this drops the second
      launch, its loads of the row range and t, the shared list's atomics and the second arrival. In
      the decode forms (every row from column 0) the CTAs share the storage width, so each issues its
      first tile's loads before the row's length arrives (CTAs past a short row's end load and discard).
    - split in two launches (wider rows): ``_coarse_kernel``, S CTAs a row, each over a share
      of the row's tiles, merges its coarse maxima into the row's C with ``tl.atomic_max``;
      ``_collect_kernel``, S2 CTAs a row, each over a share of the groups, reserves room in the row's
      candidate list with one ``tl.atomic_add`` a load step. In both, the CTA that arrives last at the row's
      counter (an acq_rel atomic after a CTA barrier, so every CTA's writes are visible to it) finishes
      the row: t from C, or the select from the list. It returns the row's counters and C to zero, so
      the next call and every graph replay start from zeros; nothing spins, so the order the CTAs run
      in does not matter (the interpreter runs them one after the other).
    - fused (rows enough to fill the GPU, e.g. prefill chunks): ``_fused_kernel``, one CTA a row at a
      time (a grid of at most fused_ctas x SMs walks the rows), both passes, no atomics, one launch.

Expected work on an H100 (~2-3 us per kernel in a CUDA graph). Batch 1 x 256K, one launch: 33 CTAs of
one 8K tile and 2048 atomic maxima each, then the last one's 2-round select over C, one scan of the 16384
group maxima, two loads of the ~590 groups that qualify (~590 candidates), a 2-3-round select. (Two
launches: pass 2 is 5 CTAs of one scan of 4096 group maxima and one load of ~150 groups each.) Batch
64 x 128K: pass 1 streams the 33.5 MB with 2 CTAs a row (~11 us at 3 TB/s), pass 2 (the last CTA of a
row) reads 32 KB of group maxima and ~600 groups of 16 columns a row. Each pass is a chain of 4-6
dependent memory round trips a CTA, not a loop over the row.

Global slots (``top_k_global_decode``, the C4 decode step): with GLOBAL > 0 every path that writes a row
of out also writes that token's row of ``compute_global_topk_indices_and_lens`` (int32): the slots of its
local indices in the order they were written, packed, -1 after, and its lens (the count, or k). The
short-row and n <= k paths map the block they store from; the long-row paths (candidate list or slow
path) read their written row back after a barrier, when the select's blocks no longer hold registers
(in registers the fused kernel spills on sm_100a).

Memory layout: logits element (r, c) at ``logits + r * stride0 + c * stride1`` (any strides, 64-bit
offsets; loads are masked at the row's storage end ncols, columns past a row's end are read and
ignored); out_idx (r, i) at ``out + r * out.stride(0) + i * out.stride(1)``. Scratch (int32, in
``_launch.scratch``): fmax [slots, ceil(ncols / G0) rounded up to 16], list [slots, 2 CAP] (keys, then
row-relative columns), the listed groups [CTAs, FS] (one launch: [rows, scan1]) and, two launches only,
t [rows]; slots are rows (split) or programs (fused, whose list row also holds its listed groups). Split
also keeps [rows, GB + 4] of state (C, then the pass-1 arrivals, the pass-2 arrivals and the candidate count) in
``_launch.counters``. Within a CTA, scratch written before ``tl.debug_barrier`` is read after it by
other threads: bar.sync orders global memory for the CTA on NVIDIA; on AMD Triton's barrier carries
workgroup release / acquire fences.
"""
import functools

import torch
import triton
import triton.language as tl

from ...layout import global_topk_outputs
from ...platform import detect
from .._compat import by_triton
from .._launch import cdiv, counters, emulated_target, launch, next_power_of_2, scratch
from .._pdl import pdl_start

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
def _keys_at(row, x_s1, col, ncols, start, end, take, OFF64: tl.constexpr):
    """(keys, inside) of the absolute columns col of a row where take holds: key 0 outside [start, end) or
    where take fails. Loads are masked only at the row's storage end ncols and by take (columns past end
    are read and ignored), so that aligned runs of columns load as vectors. Column offsets are 64-bit
    only where a row spans 2^31 elements (OFF64)."""
    if OFF64:
        x = tl.load(row + col.to(tl.int64) * x_s1, mask=take & (col < ncols), other=0.0)
    else:
        x = tl.load(row + col * x_s1, mask=take & (col < ncols), other=0.0)
    inside = take & (col >= start) & (col < end)
    return tl.where(inside, _order_key(x), 0), inside


# ---------------------------------------------------------------- global slots (the optional epilogue)
@triton.jit
def _global_ctx(r, gout_ptr, gout_s0, lens_ptr, t2r_ptr, valid_ptr, bt_ptr, bt_row, bt_rows, bt_cols, block_size):
    """What the epilogue needs of token r (row r of the top-k output): (its global-indices row, its lens
    entry, its request's block-table row, whether the token is valid, the block table's columns, block
    size). A padding token (is_valid_token 0) or a request id outside the block table maps nothing."""
    t = r.to(tl.int64)
    req = tl.load(t2r_ptr + t).to(tl.int64)
    ok = (tl.load(valid_ptr + t) != 0) & (req >= 0) & (req < bt_rows)
    bt = bt_ptr + tl.where(ok, req, 0) * bt_row
    # (an int argument equal to 1 arrives as a constexpr: the sum makes it an int64 tensor either way)
    return gout_ptr + t * gout_s0, lens_ptr + t, bt, ok, bt_cols, tl.zeros([], tl.int64) + block_size


@triton.jit
def _write_globals(loc, take, done, G):
    """Slots of the local indices loc where take holds (a block in output order), packed from column done
    of the token's global row: block_table[req, l // bs] * bs + l % bs for l >= 0 whose column and page
    exist and whose slot fits int32; the others map nothing. Returns done plus the slots written."""
    gout, _, bt, tok_ok, bt_cols, bs = G
    loc = loc.to(tl.int64)
    col = loc // bs
    ok = take & tok_ok & (loc >= 0) & (col < bt_cols)
    page = tl.load(bt + col, mask=ok, other=-1).to(tl.int64)
    slot = page * bs + loc % bs
    ok = ok & (page >= 0) & (slot <= 2147483647)
    oki = ok.to(tl.int32)
    tl.store(gout + done + tl.cumsum(oki, 0) - oki, slot.to(tl.int32), mask=ok)
    return done + tl.sum(oki, 0)


@triton.jit
def _finish_globals(done, k, G, KB: tl.constexpr, GLOBAL: tl.constexpr):
    """-1 at the global row's columns [done, k) (each column is stored once) and the token's lens: done, or k
    (GLOBAL 2, vLLM's needs_constant_topk)."""
    gout, lens, _, _, _, _ = G
    for base in range(0, k, KB):
        i = base + tl.arange(0, KB)
        tl.store(gout + i, tl.full([KB], -1, tl.int32), mask=(i >= done) & (i < k))
    if GLOBAL == 2:
        tl.store(lens, k)
    else:
        tl.store(lens, done)


@triton.jit
def _globals_of_row(out_row, out_s1, k, G, KB: tl.constexpr, GLOBAL: tl.constexpr):
    """The epilogue from a written output row (read back: this CTA's own stores, after a barrier)."""
    done = tl.zeros([], tl.int32)
    for base in range(0, k, KB):
        i = base + tl.arange(0, KB)
        loc = tl.load(out_row + i.to(tl.int64) * out_s1, mask=i < k, other=-1, cache_modifier=".cg")
        done = _write_globals(loc, i < k, done, G)
    _finish_globals(done, k, G, KB, GLOBAL)


# ---------------------------------------------------------------- exact selection
@triton.jit
def _high_mask(shift):
    """uint32 with the bits at and above shift (0..32) set."""
    return ((1 << 32) - (1 << shift.to(tl.int64))).to(tl.uint32)


@triton.jit
def _bit_length(x):
    """Significant bits of the uint32 scalar x, or one more (the float conversion may round up); 0 for 0."""
    e = (x.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 126
    return tl.where(x == 0, 0, tl.minimum(e, 32))


@triton.jit
def _span_combine(hi1, lo1, n1, hi2, lo2, n2):
    return tl.maximum(hi1, hi2), tl.minimum(lo1, lo2), n1 + n2


@triton.jit
def _kth_largest(v, valid, k, slack, D: tl.constexpr):
    """Radix select over the valid uint32 values of a register block (at least k of them, fewer than 2^20).
    slack = 0: (T, above) with above = #(valid v > T) <= k and #(valid v >= T) >= k; the k largest are
    those > T plus k - above of those == T. Rounds start below the bits every valid value shares and stop
    once the bin holding the k-th largest is taken whole (then T is one below that bin and above = k).
    slack > 0 (a threshold, not a selection): they stop once that bin holds at most slack values more
    than needed; then only #(valid v >= T) >= k is promised.
    Also returns #(valid v == T) when not all of those are taken (above < k, slack = 0)."""
    BINS: tl.constexpr = 1 << D
    bins = tl.arange(0, BINS)
    hi, lo, cnt = tl.reduce((tl.where(valid, v, 0), tl.where(valid, v, 0xFFFFFFFF), valid.to(tl.int32)), 0,
                            _span_combine)
    shift = _bit_length(hi ^ lo)
    prefix = hi & _high_mask(shift)
    need = k + tl.zeros([], tl.int32)
    while (shift > 0) & (cnt > need + slack):
        low = tl.maximum(shift - D, 0)
        m = valid & ((v & _high_mask(shift)) == prefix)
        digit = ((v >> low.to(tl.uint32)) & ((1 << (shift - low)) - 1).to(tl.uint32)).to(tl.int32)
        h = tl.histogram(BINS - 1 - digit, BINS, mask=m)       # bin 0 = the highest digit
        ge = tl.cumsum(h, 0)                                    # values with digit >= that bin's
        # the first bin reaching need, its cumulative count and its own count, in one reduction
        pk = tl.where(ge >= need, (bins.to(tl.int64) << 40) | (ge.to(tl.int64) << 20) | h.to(tl.int64),
                      1 << 62)
        best = tl.min(pk, 0)
        j = (best >> 40).to(tl.int32)
        cnt = (best & 0xFFFFF).to(tl.int32)
        need = need - (((best >> 20) & 0xFFFFF).to(tl.int32) - cnt)
        prefix = prefix | ((BINS - 1 - j).to(tl.uint32) << low.to(tl.uint32))
        shift = low
    whole = (cnt == need) | (shift > 0)                         # the bin taken whole
    return tl.where(whole, tl.maximum(prefix, 1) - 1, prefix), tl.where(whole, k + cnt - need, k - need), cnt


@triton.jit
def _select_regs(keys, cols, ok, k, D: tl.constexpr):
    """(T, C) such that the k largest keys of the block (ties to the lowest columns) are the keys > T and
    the keys == T with column <= C."""
    T, above, n_eq = _kth_largest(keys, ok, k, 0, D)
    need = k - above
    C = tl.full([], 2147483647, tl.int32)
    if need == 0:
        C = tl.full([], -1, tl.int32)
    elif n_eq > need:
        # the need lowest columns = the need largest negated columns: distinct, so the select ends with
        # its bin taken whole, and the columns taken are those with ~col > Tn, i.e. col < ~Tn
        neg = (~cols).to(tl.uint32, bitcast=True)
        Tn, _, _ = _kth_largest(neg, ok & (keys == T), need, 0, D)
        C = ((Tn ^ 0xFFFFFFFF).to(tl.int64) - 1).to(tl.int32)
    return T, C


@triton.jit
def _emit_selected(out_row, out_s1, cols, keys, ok, T, C, k, G, KB: tl.constexpr, GLOBAL: tl.constexpr):
    take = ok & ((keys > T) | ((keys == T) & (cols <= C)))
    pos = tl.cumsum(take.to(tl.int32), 0) - 1
    tl.store(out_row + pos.to(tl.int64) * out_s1, cols, mask=take)
    if GLOBAL:                  # the block is in output order (pos rises with it): the slots follow it
        _finish_globals(_write_globals(cols, take, tl.zeros([], tl.int32), G), k, G, KB, GLOBAL)


@triton.jit
def _select_stream(row, x_s1, ncols, start, end, t, k, CHUNK: tl.constexpr, D: tl.constexpr,
                   OFF64: tl.constexpr):
    """``_kth_largest`` over the keys >= t of a whole row, streamed in chunks (the slow path; counts may
    exceed 2^20 here, so the bin's own count is a second reduction)."""
    BINS: tl.constexpr = 1 << D
    bins = tl.arange(0, BINS)
    offs = tl.arange(0, CHUNK)
    prefix = tl.zeros([], tl.uint32)
    need = k + tl.zeros([], tl.int32)
    shift = 32 + tl.zeros([], tl.int32)
    cnt = end - start
    while (shift > 0) & (cnt > need):
        low = tl.maximum(shift - D, 0)
        hist = tl.zeros([BINS], tl.int32)
        for base in range((start // 16) * 16, end, CHUNK):
            key, inside = _keys_at(row, x_s1, base + offs, ncols, start, end, True, OFF64)
            m = inside & (key >= t) & ((key & _high_mask(shift)) == prefix)
            digit = ((key >> low.to(tl.uint32)) & ((1 << (shift - low)) - 1).to(tl.uint32)).to(tl.int32)
            hist += tl.histogram(BINS - 1 - digit, BINS, mask=m)
        ge = tl.cumsum(hist, 0)
        best = tl.min(tl.where(ge >= need, (bins.to(tl.int64) << 32) | ge.to(tl.int64), 1 << 62), 0)
        j = (best >> 32).to(tl.int32)
        cnt = tl.sum(tl.where(bins == j, hist, 0), 0)
        need = need - ((best & 0xFFFFFFFF).to(tl.int32) - cnt)
        prefix = prefix | ((BINS - 1 - j).to(tl.uint32) << low.to(tl.uint32))
        shift = low
    whole = cnt == need
    return tl.where(whole, tl.maximum(prefix, 1) - 1, prefix), tl.where(whole, k, k - need)


@triton.jit
def _emit_stream(row, x_s1, ncols, start, end, out_row, out_s1, T, above, k, CHUNK: tl.constexpr,
                 OFF64: tl.constexpr):
    """Streamed output in column order: keys > T at 0.., the first k - above ties at above.."""
    offs = tl.arange(0, CHUNK)
    done_gt = tl.zeros([], tl.int32)
    done_eq = tl.zeros([], tl.int32)
    for base in range((start // 16) * 16, end, CHUNK):
        c = base + offs
        key, inside = _keys_at(row, x_s1, c, ncols, start, end, True, OFF64)
        gt = inside & (key > T)
        eq = inside & (key == T)
        pg = done_gt + tl.cumsum(gt.to(tl.int32), 0) - 1
        tl.store(out_row + pg.to(tl.int64) * out_s1, c - start, mask=gt)
        pe = above + done_eq + tl.cumsum(eq.to(tl.int32), 0) - 1
        tl.store(out_row + pe.to(tl.int64) * out_s1, c - start, mask=eq & (pe < k))
        done_gt += tl.sum(gt.to(tl.int32), 0)
        done_eq += tl.sum(eq.to(tl.int32), 0)


# ---------------------------------------------------------------- row paths
@triton.jit
def _trivial_row(out_row, out_s1, n, k, G, KB: tl.constexpr, GLOBAL: tl.constexpr):
    done = tl.zeros([], tl.int32)
    for base in range(0, k, KB):
        i = base + tl.arange(0, KB)
        loc = tl.where(i < n, i, -1)
        tl.store(out_row + i.to(tl.int64) * out_s1, loc, mask=i < k)
        if GLOBAL:
            done = _write_globals(loc, i < k, done, G)
    if GLOBAL:
        _finish_globals(done, k, G, KB, GLOBAL)


@triton.jit
def _short_row(row, x_s1, ncols, start, end, out_row, out_s1, k, G, RM: tl.constexpr, D: tl.constexpr,
               KB: tl.constexpr, OFF64: tl.constexpr, GLOBAL: tl.constexpr):
    """A row whose aligned span fits RM columns: its keys in registers, the select, the output."""
    c = (start // 16) * 16 + tl.arange(0, RM)
    key, inside = _keys_at(row, x_s1, c, ncols, start, end, True, OFF64)
    T, C = _select_regs(key, c - start, inside, k, D)
    _emit_selected(out_row, out_s1, c - start, key, inside, T, C, k, G, KB, GLOBAL)


@triton.jit
def _load_cols(row, x_s1, col, take, OFF64: tl.constexpr):
    """The logits of the absolute columns col where take holds (0 elsewhere); 64-bit offsets with OFF64."""
    if OFF64:
        return tl.load(row + col.to(tl.int64) * x_s1, mask=take, other=0.0)
    else:
        return tl.load(row + col * x_s1, mask=take, other=0.0)


@triton.jit
def _coarse_tile(x, base, offs, gofs, c1, start, end, fmax_row, G0: tl.constexpr):
    """One pass-1 tile of logits x at columns base + offs: stores its group maxima, returns its keys."""
    col = base + offs
    inside = (col < c1) & (col >= start) & (col < end)
    cur = tl.where(inside, _order_key(x), 0)
    first = start // G0
    g = base // G0 - first + gofs
    tl.store(fmax_row + g, tl.max(cur, 1).to(tl.int32, bitcast=True),
             mask=(g >= 0) & (g < tl.cdiv(end, G0) - first))
    return cur


@triton.jit
def _coarse_pass(row, x_s1, ncols, start, end, c0, c1, fmax_row, x0, G0: tl.constexpr, GB: tl.constexpr,
                 LF: tl.constexpr, PRE: tl.constexpr, OFF64: tl.constexpr):
    """Pass 1 over the absolute columns [c0, c1) (c0 a multiple of LF * GB, c1 <= ncols or the row's storage
    end): returns the coarse maxima C[j] of the columns c % GB == j, stores the group maxima of their
    groups into fmax_row (indexed from the row's first group). PRE: x0 holds the logits of the first tile,
    loaded by the caller (``_tile_offsets``), before the row's range was known."""
    TILE: tl.constexpr = LF * GB
    offs, gofs = _tile_offsets(G0, GB, LF)
    c1 = tl.minimum(c1, ncols)
    acc = tl.zeros([TILE // G0, G0], tl.uint32)
    first_base = c0
    if PRE:
        acc = tl.maximum(acc, _coarse_tile(x0, c0, offs, gofs, c1, start, end, fmax_row, G0))
        first_base = c0 + TILE
    for base in range(first_base, c1, TILE):
        x = _load_cols(row, x_s1, base + offs, base + offs < c1, OFF64)
        acc = tl.maximum(acc, _coarse_tile(x, base, offs, gofs, c1, start, end, fmax_row, G0))
    return tl.max(tl.reshape(acc, [LF, GB]), 0)                     # column c of a tile: c % GB


@triton.jit
def _tile_offsets(G0: tl.constexpr, GB: tl.constexpr, LF: tl.constexpr):
    """A pass-1 tile as its groups, row-major: (column offsets [TILE / G0, G0], group offsets)."""
    TILE: tl.constexpr = LF * GB
    gofs = tl.arange(0, TILE // G0)
    return gofs[:, None] * G0 + tl.arange(0, G0)[None, :], gofs


@triton.jit
def _collect_step(row, x_s1, ncols, start, end, t, base, g1, fm, ids, lst, cnt_ptr, count, G0: tl.constexpr,
                  FS: tl.constexpr, FC: tl.constexpr, CAP: tl.constexpr, SHARED: tl.constexpr,
                  OFF64: tl.constexpr):
    """One pass-2 step over the groups base + [0, FS) (< g1) with group maxima fm: the groups whose maximum
    is >= t are listed in ids (this CTA's scratch, FS entries), then loaded FC at a time; their keys >= t go
    to lst[pos] with their row-relative columns at lst[CAP + pos] (pos < CAP). SHARED: other CTAs fill the
    same list, room is reserved with an atomic add on cnt_ptr; else count is the list's running length.
    Returns count plus the candidates seen."""
    first = start // G0
    gl = tl.arange(0, FC)
    el = tl.arange(0, G0)
    g = base + tl.arange(0, FS)
    q = (g < g1) & (fm.to(tl.uint32, bitcast=True) >= t)
    nq = tl.sum(q.to(tl.int32), 0)
    tl.store(ids + tl.cumsum(q.to(tl.int32), 0) - 1, g, mask=q)
    tl.debug_barrier()                                    # the list of groups, dense, for every thread
    for b2 in range(0, nq, FC):
        i = b2 + gl
        gi = tl.load(ids + i, mask=i < nq, other=0)
        col = (first + gi)[:, None] * G0 + el[None, :]
        key, inside = _keys_at(row, x_s1, col, ncols, start, end, (i < nq)[:, None], OFF64)
        c = tl.reshape(inside & (key >= t), [FC * G0])
        n = tl.sum(c.to(tl.int32), 0)
        if SHARED:
            at = tl.atomic_add(cnt_ptr, n, sem="relaxed", scope="gpu")
        else:
            at = count
        pos = at + tl.cumsum(c.to(tl.int32), 0) - 1
        keep = c & (pos < CAP)
        tl.store(lst + pos, tl.reshape(key, [FC * G0]).to(tl.int32, bitcast=True), mask=keep)
        tl.store(lst + CAP + pos, tl.reshape(col - start, [FC * G0]), mask=keep)
        count += n
    tl.debug_barrier()                                    # ids is rewritten by the next step
    return count


@triton.jit
def _collect(row, x_s1, ncols, start, end, t, fmax_row, g0, g1, ids, lst, cnt_ptr, count, G0: tl.constexpr,
             FS: tl.constexpr, FC: tl.constexpr, CAP: tl.constexpr, SHARED: tl.constexpr, OFF64: tl.constexpr):
    """Pass 2 over the groups [g0, g1) of a row (from its first group), FS group maxima a step
    (``_collect_step``). Group maxima are read past L1 (.cg): in the one-launch layout other CTAs of the
    same launch wrote them."""
    fl = tl.arange(0, FS)
    for base in range(g0, g1, FS):
        g = base + fl
        fm = tl.load(fmax_row + g, mask=g < g1, other=0, cache_modifier=".cg")
        count = _collect_step(row, x_s1, ncols, start, end, t, base, g1, fm, ids, lst, cnt_ptr, count, G0, FS, FC,
                              CAP, SHARED, OFF64)
    return count


@triton.jit
def _finish_list(lst, count, row, x_s1, ncols, start, end, t, out_row, out_s1, k, G, CAP: tl.constexpr,
                 D: tl.constexpr, CHUNK: tl.constexpr, KB: tl.constexpr, OFF64: tl.constexpr, GLOBAL: tl.constexpr):
    """The select over a row's candidate list (count of them, in any order), or over the whole row when
    the list overflowed; then the row's output."""
    if count <= CAP:
        i = tl.arange(0, CAP)
        ok = i < count
        keys = tl.load(lst + i, mask=ok, other=0, cache_modifier=".cg").to(tl.uint32, bitcast=True)
        cols = tl.load(lst + CAP + i, mask=ok, other=0, cache_modifier=".cg")
        T, C = _select_regs(keys, cols, ok, k, D)
        _emit_selected(out_row, out_s1, cols, keys, ok, T, C, k, G, KB, 0)
    else:
        T, above = _select_stream(row, x_s1, ncols, start, end, t, k, CHUNK, D, OFF64)
        _emit_stream(row, x_s1, ncols, start, end, out_row, out_s1, T, above, k, CHUNK, OFF64)
    if GLOBAL:                  # from the written row: the select's blocks are dead by then (registers)
        tl.debug_barrier()
        _globals_of_row(out_row, out_s1, k, G, KB, GLOBAL)


@triton.jit
def _long_row(r, x_ptr, x_s0, ncols, a_ptr, b_ptr, a_s0, a_s1, next_n, MODE: tl.constexpr, RM: tl.constexpr):
    """(row pointer, start, end, long?) of row r; n <= k rows are handled before."""
    start, n = _row_range(r, ncols, a_ptr, b_ptr, a_s0, a_s1, next_n, MODE)
    end = start + n
    return x_ptr + r.to(tl.int64) * x_s0, start, end, end - (start // 16) * 16 > RM


# ---------------------------------------------------------------- kernels
# Every kernel that writes the output takes the epilogue's arguments after its own (gout_ptr ... block_size,
# ``_global_ctx``); GLOBAL 0 compiles the epilogue out (the public top-k ops), 1 writes the global slots and
# their counts, 2 the slots and lens = k.
@triton.jit
def _fused_kernel(x_ptr, x_s0, x_s1, ncols, a_ptr, b_ptr, a_s0, a_s1, next_n, out_ptr, out_s0, out_s1, k,
                  num_rows, fmax_ptr, fmax_s0, lst_ptr, lst_s0, gout_ptr, gout_s0, lens_ptr, t2r_ptr, valid_ptr,
                  bt_ptr, bt_row, bt_rows, bt_cols, block_size, MODE: tl.constexpr, LONG: tl.constexpr,
                  G0: tl.constexpr, GB: tl.constexpr, LF: tl.constexpr, FS: tl.constexpr, FC: tl.constexpr,
                  CAP: tl.constexpr, RM: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr, KB: tl.constexpr,
                  OFF64: tl.constexpr, GLOBAL: tl.constexpr, PDL: tl.constexpr = False):
    """One CTA a row: program p takes rows p, p + grid, ... with its scratch rows fmax[p] and lst[p] (the
    candidate list [2 CAP], then the qualifying groups [FS]). LONG: some row may exceed RM (else only
    the trivial and short paths are compiled)."""
    pdl_start(PDL)
    fmax_row = fmax_ptr + tl.program_id(0).to(tl.int64) * fmax_s0
    lst = lst_ptr + tl.program_id(0).to(tl.int64) * lst_s0
    ids = lst + 2 * CAP
    for r in range(tl.program_id(0), num_rows, tl.num_programs(0)):
        r = r + tl.zeros([], tl.int32)                    # a tensor also where the loop yields Python ints
        G = _global_ctx(r, gout_ptr, gout_s0, lens_ptr, t2r_ptr, valid_ptr, bt_ptr, bt_row, bt_rows, bt_cols,
                        block_size) if GLOBAL else 0
        row, start, end, is_long = _long_row(r, x_ptr, x_s0, ncols, a_ptr, b_ptr, a_s0, a_s1, next_n, MODE, RM)
        out_row = out_ptr + r.to(tl.int64) * out_s0
        if end - start <= k:
            _trivial_row(out_row, out_s1, end - start, k, G, KB, GLOBAL)
        elif is_long:
            if LONG:
                TILE: tl.constexpr = LF * GB
                coarse = _coarse_pass(row, x_s1, ncols, start, end, (start // TILE) * TILE, end, fmax_row, 0, G0,
                                      GB, LF, False, OFF64)
                t, _, _ = _kth_largest(coarse, coarse > 0, k, k // 8, D)
                tl.debug_barrier()                        # fmax stores before other threads' loads
                count = _collect(row, x_s1, ncols, start, end, t, fmax_row, 0, tl.cdiv(end, G0) - start // G0,
                                 ids, lst, lst, tl.zeros([], tl.int32), G0, FS, FC, CAP, False, OFF64)
                tl.debug_barrier()
                _finish_list(lst, count, row, x_s1, ncols, start, end, t, out_row, out_s1, k, G, CAP, D, CHUNK, KB,
                             OFF64, GLOBAL)
                tl.debug_barrier()                        # the next row overwrites the scratch
        else:
            _short_row(row, x_s1, ncols, start, end, out_row, out_s1, k, G, RM, D, KB, OFF64, GLOBAL)


@triton.jit
def _coarse_kernel(x_ptr, x_s0, x_s1, ncols, a_ptr, b_ptr, a_s0, a_s1, next_n, k, fmax_ptr, fmax_s0, state_ptr,
                   state_s0, thr_ptr, MODE: tl.constexpr, G0: tl.constexpr, GB: tl.constexpr, LF: tl.constexpr,
                   RM: tl.constexpr, D: tl.constexpr, OFF64: tl.constexpr, PDL: tl.constexpr = False):
    """Split pass 1, grid (rows, S): CTA (r, s) covers the s-th share of row r's tiles; the last CTA of
    the row to arrive computes t = thr[r] and returns the row's state to zero. State row: C [GB], then
    the pass-1 arrivals, the pass-2 arrivals and the candidate count."""
    pdl_start(PDL)
    r = tl.program_id(0)
    s = tl.program_id(1)
    S = tl.num_programs(1)
    row, start, end, is_long = _long_row(r, x_ptr, x_s0, ncols, a_ptr, b_ptr, a_s0, a_s1, next_n, MODE, RM)
    if is_long & (end - start > k):
        TILE: tl.constexpr = LF * GB
        tiles = tl.cdiv(end, TILE) - start // TILE
        per = tl.cdiv(tiles, S)
        c0 = (start // TILE + s * per) * TILE
        c1 = tl.minimum(c0 + per * TILE, end)
        state = state_ptr + r.to(tl.int64) * state_s0
        cmax = state.to(tl.pointer_type(tl.uint32)) + tl.arange(0, GB)
        if c0 < c1:
            coarse = _coarse_pass(row, x_s1, ncols, start, end, c0, c1, fmax_ptr + r.to(tl.int64) * fmax_s0, 0, G0,
                                  GB, LF, False, OFF64)
            tl.atomic_max(cmax, coarse, mask=coarse > 0, sem="relaxed", scope="gpu")
        tl.debug_barrier()                                # every thread's writes before the arrival
        if tl.atomic_add(state + GB, 1, sem="acq_rel", scope="gpu") == S - 1:
            coarse = tl.load(cmax, cache_modifier=".cg")
            tl.store(cmax, tl.zeros([GB], tl.uint32))
            tl.store(state + GB, 0)
            t, _, _ = _kth_largest(coarse, coarse > 0, k, k // 8, D)
            tl.store(thr_ptr + r, t.to(tl.int32, bitcast=True))


@triton.jit
def _collect_kernel(x_ptr, x_s0, x_s1, ncols, a_ptr, b_ptr, a_s0, a_s1, next_n, out_ptr, out_s0, out_s1, k,
                    fmax_ptr, fmax_s0, state_ptr, state_s0, thr_ptr, lst_ptr, lst_s0, ids_ptr, gout_ptr, gout_s0,
                    lens_ptr, t2r_ptr, valid_ptr, bt_ptr, bt_row, bt_rows, bt_cols, block_size, MODE: tl.constexpr,
                    G0: tl.constexpr, GB: tl.constexpr, FS: tl.constexpr, FC: tl.constexpr, CAP: tl.constexpr,
                    RM: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr, KB: tl.constexpr, OFF64: tl.constexpr,
                    GLOBAL: tl.constexpr, PDL: tl.constexpr = False):
    """Split pass 2, grid (rows, S2): trivial and short rows by CTA (r, 0); for long rows CTA (r, s)
    lists the candidates of the s-th share of the groups (its qualifying groups in ids[r, s], FS of
    them), the last to arrive selects and writes."""
    pdl_start(PDL)
    r = tl.program_id(0)
    s = tl.program_id(1)
    S2 = tl.num_programs(1)
    G = _global_ctx(r, gout_ptr, gout_s0, lens_ptr, t2r_ptr, valid_ptr, bt_ptr, bt_row, bt_rows, bt_cols,
                    block_size) if GLOBAL else 0
    row, start, end, is_long = _long_row(r, x_ptr, x_s0, ncols, a_ptr, b_ptr, a_s0, a_s1, next_n, MODE, RM)
    out_row = out_ptr + r.to(tl.int64) * out_s0
    if end - start <= k:
        if s == 0:
            _trivial_row(out_row, out_s1, end - start, k, G, KB, GLOBAL)
    elif is_long:
        state = state_ptr + r.to(tl.int64) * state_s0
        lst = lst_ptr + r.to(tl.int64) * lst_s0
        t = tl.load(thr_ptr + r).to(tl.uint32, bitcast=True)
        n_groups = tl.cdiv(end, G0) - start // G0
        per = tl.cdiv(tl.cdiv(n_groups, S2), FS) * FS
        g0 = s * per
        _collect(row, x_s1, ncols, start, end, t, fmax_ptr + r.to(tl.int64) * fmax_s0, g0,
                 tl.minimum(g0 + per, n_groups), ids_ptr + (r * S2 + s).to(tl.int64) * FS, lst, state + GB + 2,
                 tl.zeros([], tl.int32), G0, FS, FC, CAP, True, OFF64)
        tl.debug_barrier()                                # every thread's writes before the arrival
        if tl.atomic_add(state + GB + 1, 1, sem="acq_rel", scope="gpu") == S2 - 1:
            tl.store(state + GB + 1, 0)
            count = tl.atomic_xchg(state + GB + 2, 0, sem="relaxed", scope="gpu")
            _finish_list(lst, count, row, x_s1, ncols, start, end, t, out_row, out_s1, k, G, CAP, D, CHUNK, KB,
                         OFF64, GLOBAL)
    elif s == 0:
        _short_row(row, x_s1, ncols, start, end, out_row, out_s1, k, G, RM, D, KB, OFF64, GLOBAL)


@triton.jit
def _split1_kernel(x_ptr, x_s0, x_s1, ncols, a_ptr, b_ptr, a_s0, a_s1, next_n, out_ptr, out_s0, out_s1, k,
                   fmax_ptr, fmax_s0, state_ptr, state_s0, lst_ptr, lst_s0, ids_ptr, gout_ptr, gout_s0, lens_ptr,
                   t2r_ptr, valid_ptr, bt_ptr, bt_row, bt_rows, bt_cols, block_size, MODE: tl.constexpr,
                   G0: tl.constexpr, GB: tl.constexpr, LF: tl.constexpr, FS: tl.constexpr, FC: tl.constexpr,
                   CAP: tl.constexpr, RM: tl.constexpr, D: tl.constexpr, DT: tl.constexpr, CHUNK: tl.constexpr,
                   KB: tl.constexpr, AHEAD: tl.constexpr, OFF64: tl.constexpr, GLOBAL: tl.constexpr,
                   PDL: tl.constexpr = False):
    """Split in one launch, grid (rows, S): pass 1 as ``_coarse_kernel``; the CTA of a long row that
    arrives last computes t (DT-bit digits) and runs pass 2 over the whole row alone, as the fused kernel
    does, then the output: no second launch, no shared candidate list. Trivial and short rows by CTA (r, 0).
    AHEAD (rows from column 0, the decode forms): the row's storage width is what the CTAs share, so each
    CTA loads its first tile before the row's length arrives (one memory round trip less; CTAs past a
    short row's end load and discard)."""
    pdl_start(PDL)
    r = tl.program_id(0)
    s = tl.program_id(1)
    S = tl.num_programs(1)
    TILE: tl.constexpr = LF * GB
    x0 = 0
    c0 = 0
    c1 = 0
    if AHEAD:
        per = tl.cdiv(tl.cdiv(ncols, TILE), S)
        c0 = s * per * TILE
        c1 = tl.minimum(c0 + per * TILE, ncols)
        offs, gofs = _tile_offsets(G0, GB, LF)
        x0 = _load_cols(x_ptr + r.to(tl.int64) * x_s0, x_s1, c0 + offs, c0 + offs < c1, OFF64)
    G = _global_ctx(r, gout_ptr, gout_s0, lens_ptr, t2r_ptr, valid_ptr, bt_ptr, bt_row, bt_rows, bt_cols,
                    block_size) if GLOBAL else 0
    row, start, end, is_long = _long_row(r, x_ptr, x_s0, ncols, a_ptr, b_ptr, a_s0, a_s1, next_n, MODE, RM)
    out_row = out_ptr + r.to(tl.int64) * out_s0
    if end - start <= k:
        if s == 0:
            _trivial_row(out_row, out_s1, end - start, k, G, KB, GLOBAL)
    elif is_long:
        if AHEAD:
            lo = c0
            hi = c1
        else:
            per_row = tl.cdiv(tl.cdiv(end, TILE) - start // TILE, S)
            lo = (start // TILE + s * per_row) * TILE
            hi = tl.minimum(lo + per_row * TILE, end)
        state = state_ptr + r.to(tl.int64) * state_s0
        cmax = state.to(tl.pointer_type(tl.uint32)) + tl.arange(0, GB)
        fmax_row = fmax_ptr + r.to(tl.int64) * fmax_s0
        if lo < hi:
            coarse = _coarse_pass(row, x_s1, ncols, start, end, lo, hi, fmax_row, x0, G0, GB, LF, AHEAD, OFF64)
            tl.atomic_max(cmax, coarse, mask=coarse > 0, sem="relaxed", scope="gpu")
        tl.debug_barrier()                                # every thread's writes before the arrival
        if tl.atomic_add(state + GB, 1, sem="acq_rel", scope="gpu") == S - 1:
            n_groups = tl.cdiv(end, G0) - start // G0
            fl = tl.arange(0, FS)
            # the first scan step's group maxima load beside the coarse maxima, before t is known
            fm = tl.load(fmax_row + fl, mask=fl < n_groups, other=0, cache_modifier=".cg")
            coarse = tl.load(cmax, cache_modifier=".cg")
            tl.store(cmax, tl.zeros([GB], tl.uint32))
            tl.store(state + GB, 0)
            t, _, _ = _kth_largest(coarse, coarse > 0, k, k // 8, DT)
            lst = lst_ptr + r.to(tl.int64) * lst_s0
            ids = ids_ptr + r.to(tl.int64) * FS
            count = _collect_step(row, x_s1, ncols, start, end, t, 0, n_groups, fm, ids, lst, lst,
                                  tl.zeros([], tl.int32), G0, FS, FC, CAP, False, OFF64)
            count = _collect(row, x_s1, ncols, start, end, t, fmax_row, FS, n_groups, ids, lst, lst, count, G0, FS,
                             FC, CAP, False, OFF64)
            tl.debug_barrier()                            # the list, for every thread
            _finish_list(lst, count, row, x_s1, ncols, start, end, t, out_row, out_s1, k, G, CAP, D, CHUNK, KB,
                         OFF64, GLOBAL)
    elif s == 0:
        _short_row(row, x_s1, ncols, start, end, out_row, out_s1, k, G, RM, D, KB, OFF64, GLOBAL)


# ---------------------------------------------------------------- host side
def _pow2(v: int) -> int:
    return next_power_of_2(max(int(v), 1))


def default_config(arch: str, k: int) -> dict:
    """Sizes for k on a target; every entry can be overridden through ``config=`` (sweeps):
    raw_max    RM, rows whose 16-aligned span fits RM columns are selected from registers in one pass
    coarse     GB, coarse maxima (4 k: ~1.15 k candidates on i.i.d. data; 2 k: ~1.4 k), at least k
    load       columns per pass-1 step (a multiple of GB)
    group      G0, columns per group maximum (pass 2 rereads ~1/G0 of a row)
    scan       FS, group maxima per pass-2 step (those >= t are listed, then loaded)
    chunk      columns of listed groups loaded per pass-2 step (a multiple of G0), and per slow-path step
    cap        CAP, candidates held in registers, at least k (more candidates: the slow path)
    digit      D, bits per radix round
    mode       "auto" (split while ctas x SMs // rows > 1, else fused), "split" or "fused"
    one_launch split in one launch (``_split1_kernel``: the last pass-1 CTA of a row does pass 2 alone)
               when a row has at most this many groups (ceil(ncols / group)) and there are at most
               one_launch_rows rows, else in two; 0: always two
    scan1, chunk1: FS and the columns of listed groups a step (a multiple of group) of that last CTA's pass 2
    coarse_digit: DT, bits per radix round of the one-launch kernel's threshold select
    ahead      the one-launch kernel's decode forms load their first pass-1 tile before the row's length
    ctas, ctas2: CTAs per SM in split pass 1 / pass 2: S = ctas x SMs // rows a row (one wave; at most
               the row's steps)
    fused_ctas: programs per SM of the fused kernel (each walks every grid-th row)
    warps      num_warps of split pass 2 and of the short-rows kernel; coarse_warps: of split pass 1
    fused      the entries the fused kernel takes instead (it holds every path's blocks at once): raw_max,
               load, scan, warps.
    On NVIDIA, 8 warps or fewer run with up to 255 registers a thread (``_options``)."""
    kp = _pow2(k)
    amd = arch.startswith("gfx")
    coarse = max(1024, 4 * kp if kp <= 512 else 2 * kp)
    cap = max(2048, 4 * kp if kp <= 512 else 2 * kp)       # ~1.5 x the expected candidates from k = 1024 on
    # split pass 1 in tiles of 8192 columns, pass 2 in scans of 4096 group maxima (one each a CTA at batch
    # 1 and 64), with 16 warps on NVIDIA up to k = 2048 (8 with 255 registers beyond: 8192 candidates);
    # the fused kernel in 8 warps with smaller blocks (no spill at 255 registers). Measured on the H100
    # (gpu/topk.py, BENCHMARKS.md): 6-bit digits beat 8-bit ones on every shape (a 64-bin histogram a
    # round costs less than the rounds it saves: 21.6 against 24.3 us at b = 1 x 256K, 7.7 against 9.5 us
    # for the C4 step's 128 x 2048); from k = 1024 on, a quarter of the split CTAs, which makes b = 64 rows
    # of 32K fused (39.3 against 47.0 us at k = 1024, 47.8 against 63.1 at k = 2048). Blackwell (untimed)
    # keeps 8-bit digits: the short-rows kernel spills 80 B there with 6.
    # The split runs in two launches (one_launch=0). The one-launch layout (the last pass-1 CTA of a row runs
    # pass 2 alone) measured slower on the H200 (gpu/topk.py, 2026-11-29, BENCHMARKS.md section P): 35.9
    # against 20.2 us at b = 1 x 256K, 52.7 against 39.6 us at b = 64 x 128K; a single CTA's pass 2 costs
    # more than the launch it saves. It stays a configuration (one_launch=<groups>) for targets where a launch
    # costs more; its AMD sizes: the last CTA scans 4096 group maxima a step, as split pass 2 does (at 16384,
    # and chunk1 8192, 8 waves of 64 lanes spill 193 VGPRs).
    digit = 8 if arch == "sm_100" else 6
    return dict(raw_max=max(4096, 2 * kp), coarse=coarse, load=max(8192, coarse), group=16, scan=4096, chunk=4096,
                cap=cap, digit=digit, mode="auto", ctas=1.0 if kp <= 512 else 0.25, ctas2=1.0, fused_ctas=1,
                coarse_warps=8 if amd else 16, warps=8 if amd or kp > 2048 else 16,
                one_launch=0, one_launch_rows=1 << 30, scan1=4096 if amd else 16384, chunk1=4096 if amd else 8192,
                coarse_digit=digit,
                ahead=True,
                fused=dict(raw_max=2048, load=max(4096, coarse), scan=2048, warps=8))


@functools.lru_cache(maxsize=None)
def _device_facts(index: int):
    """(arch, SM count) of a GPU, cached: launches must not pay for a properties query."""
    dev = torch.device("cuda", index)
    return detect(dev).arch, torch.cuda.get_device_properties(dev).multi_processor_count


def _facts(device):
    if device.type != "cuda":            # the Triton interpreter (CPU tensors): the emulated target, else an H100
        emu = emulated_target()
        return (emu.arch, emu.sm_count) if emu else ("sm_90", 132)
    return _device_facts(device.index if device.index is not None else torch.cuda.current_device())


def _resolve(arch: str, k: int, config) -> dict:
    cfg = default_config(arch, k)
    config = dict(config or {})
    unknown = set(config) - set(cfg) | set(config.get("fused", {})) - set(cfg["fused"])
    if unknown:
        raise ValueError(f"unknown top-k config keys {sorted(unknown)}; known: {sorted(cfg)}, fused: "
                         f"{sorted(cfg['fused'])}")
    cfg["fused"].update(config.pop("fused", {}))
    cfg.update(config)
    gb, g0 = cfg["coarse"], cfg["group"]
    # a long row has more than k columns, so min(n, coarse) >= k coarse maxima; raw_max is free
    if gb < k or cfg["cap"] < k or cfg["load"] % gb or cfg["fused"]["load"] % gb or cfg["chunk"] % g0 or \
            cfg["chunk1"] % g0:
        raise ValueError(f"top-k config needs coarse >= k, cap >= k, load and fused load multiples of coarse, "
                         f"chunk and chunk1 multiples of group: {cfg}")
    if cfg["mode"] not in ("auto", "split", "fused"):
        raise ValueError(f"top-k config mode must be 'auto', 'split' or 'fused', got {cfg['mode']!r}")
    return cfg


_PASS1 = ("MODE", "G0", "GB", "LF", "RM", "D", "OFF64")                   # the constexprs of each kernel
_PASS2 = ("MODE", "G0", "GB", "FS", "FC", "CAP", "RM", "D", "CHUNK", "KB", "OFF64", "GLOBAL")
_FUSED = ("MODE", "LONG", "G0", "GB", "LF", "FS", "FC", "CAP", "RM", "D", "CHUNK", "KB", "OFF64", "GLOBAL")
_SPLIT1 = ("MODE", "G0", "GB", "LF", "FS", "FC", "CAP", "RM", "D", "DT", "CHUNK", "KB", "AHEAD", "OFF64", "GLOBAL")


def _constexprs(cfg, mode, names, **extra):
    every = dict(MODE=mode, G0=cfg["group"], GB=cfg["coarse"], LF=cfg["load"] // cfg["coarse"], FS=cfg["scan"],
                 FC=cfg["chunk"] // cfg["group"], CAP=cfg["cap"], RM=cfg["raw_max"], D=cfg["digit"],
                 DT=cfg["coarse_digit"], CHUNK=cfg["chunk"], KB=1024, AHEAD=bool(cfg["ahead"]) and mode != RANGES,
                 GLOBAL=0)
    every.update(extra)
    return {n: every[n] for n in names}



def _split1_constexprs(cfg, mode, **extra):
    """The one-launch kernel's: its own pass-2 scan and load sizes (scan1, chunk1)."""
    return _constexprs(cfg, mode, _SPLIT1, FS=cfg["scan1"], FC=cfg["chunk1"] // cfg["group"], **extra)


def _fused_sizes(cfg):
    """The configuration with the fused kernel's own entries."""
    return dict(cfg, **cfg["fused"])


def _short_constexprs(width, digit, mode, off64, glob=0):
    """The fused kernel without its long-row path: the sizes of that path are fixed (they would only
    multiply its compiled variants)."""
    return dict(MODE=mode, LONG=False, G0=1, GB=1, LF=1, FS=1, FC=1, CAP=1, RM=width, D=digit, CHUNK=1, KB=1024,
                OFF64=off64, GLOBAL=glob)


def _options(arch, warps, bound=False):
    """num_warps, and on NVIDIA with 8 warps or fewer .maxnreg 255: these kernels run one CTA per SM, and
    without the bound ptxas spills to stay at 128 registers for an occupancy they cannot use. With more
    warps, from Triton 3.8 on, the bound the register file allows (128 at 16 warps): without it ptxas keeps
    the split pass-2 kernel at 64 registers and spills (64 B at k = 512); 3.6 needs none (``_compat``),
    except for the global-slots epilogue (``bound``: the short-rows kernel spills 28 B at 64 registers
    without it, none at 101 with it)."""
    if arch.startswith("gfx"):
        return dict(num_warps=warps)
    if warps > 8:
        cap = 65536 // (32 * warps) if bound else by_triton({(3, 6): None, (3, 8): 65536 // (32 * warps)})
        return dict(num_warps=warps) if cap is None else dict(num_warps=warps, maxnreg=cap)
    return dict(num_warps=warps, maxnreg=255)


def _plan(cfg, num_rows, ncols, sms):
    """(kernel layout, S, S2): "short" (no row can exceed raw_max), "fused", "split1" (split in one launch)
    or "split" (two launches)."""
    if ncols <= cfg["raw_max"]:
        return "short", 1, 1
    steps1 = cdiv(ncols, cfg["load"]) + 1
    steps2 = cdiv(cdiv(ncols, cfg["group"]) + 1, cfg["scan"])
    S = max(1, min(steps1, int(cfg["ctas"] * sms) // num_rows, 65535))      # one wave of CTAs
    S2 = max(1, min(steps2, int(cfg["ctas2"] * sms) // num_rows, 65535))
    mode = cfg["mode"] if cfg["mode"] != "auto" else ("split" if S > 1 else "fused")
    if mode == "split" and cdiv(ncols, cfg["group"]) <= cfg["one_launch"] and num_rows <= cfg["one_launch_rows"]:
        return "split1", S, 1
    return mode, S, S2


def _global_args(out, glob):
    """The epilogue's kernel arguments (gout_ptr ... block_size) and its GLOBAL constexpr: glob = (global
    indices [T, k] int32, lens [T] int32, token_to_req_indices, is_valid_token, block_table, block_size,
    needs_constant_topk), or None (no epilogue: placeholders the kernel never reads)."""
    if glob is None:
        return (out, 0, out, out, out, out, 0, 0, 0, 1), 0
    gout, lens, t2r, valid, bt, block_size, constant = glob
    return (gout, gout.stride(0), lens, t2r, valid, bt, bt.stride(0), bt.shape[0], bt.shape[1], block_size), \
        2 if constant else 1


def _launch(logits, mode, a, b, a_s0, a_s1, next_n, out, num_rows, k, config, glob=None):
    if num_rows == 0:
        return
    arch, sms = _facts(logits.device)
    cfg = _resolve(arch, k, config)
    ncols = logits.shape[1]
    x_s0, x_s1 = logits.stride()
    layout, S, S2 = _plan(cfg, num_rows, ncols, sms)
    overrun = max(cfg["load"], cfg["fused"]["load"], cfg["chunk"], cfg["chunk1"], cfg["raw_max"])  # tiles past an end
    off64 = (ncols + overrun) * abs(x_s1) >= 2 ** 31                               # column offsets past int32
    row_args = (logits, x_s0, x_s1, ncols, a, b, a_s0, a_s1, next_n)
    out_args = (out, out.stride(0), out.stride(1), k)
    g_args, g = _global_args(out, glob)
    dev = logits.device
    groups = cdiv(cdiv(ncols, cfg["group"]), 16) * 16   # fmax row stride: every scratch slice 64-B aligned
    cap = cfg["cap"]
    if layout == "short":       # every row's span fits ncols <= raw_max: registers sized to the width
        programs = max(1, min(num_rows, int(cfg["fused_ctas"] * sms)))
        launch(_fused_kernel)[(programs,)](*row_args, *out_args, num_rows, out, 0, out, 0, *g_args,
                                           **_short_constexprs(max(_pow2(ncols), 16), cfg["digit"], mode, off64, g),
                                           **_options(arch, cfg["warps"], g > 0))
    elif layout == "fused":
        programs = max(1, min(num_rows, int(cfg["fused_ctas"] * sms)))
        fcfg = _fused_sizes(cfg)
        slot = 2 * cap + fcfg["scan"]
        ws = scratch(dev, programs * (groups + slot)).view(torch.int32)
        launch(_fused_kernel)[(programs,)](*row_args, *out_args, num_rows, ws, groups, ws[programs * groups:],
                                           slot, *g_args, **_constexprs(fcfg, mode, _FUSED, LONG=True, OFF64=off64,
                                                                         GLOBAL=g),
                                           **_options(arch, fcfg["warps"], g > 0))
    elif layout == "split1":
        ws = scratch(dev, num_rows * (groups + 2 * cap + cfg["scan1"])).view(torch.int32)
        fmax, lst = ws, ws[num_rows * groups:]
        ids = lst[num_rows * 2 * cap:]
        state = counters(dev, num_rows * (cfg["coarse"] + 4))
        launch(_split1_kernel)[(num_rows, S)](*row_args, *out_args, fmax, groups, state, cfg["coarse"] + 4, lst,
                                              2 * cap, ids, *g_args,
                                              **_split1_constexprs(cfg, mode, OFF64=off64, GLOBAL=g),
                                              **_options(arch, cfg["warps"], g > 0))
    else:
        gb = cfg["coarse"]
        ws = scratch(dev, num_rows * (groups + 2 * cap + 16 + S2 * cfg["scan"])).view(torch.int32)
        fmax, lst = ws, ws[num_rows * groups:]
        thr, ids = lst[num_rows * 2 * cap:], lst[num_rows * (2 * cap + 16):]
        state = counters(dev, num_rows * (gb + 4))
        launch(_coarse_kernel)[(num_rows, S)](*row_args, k, fmax, groups, state, gb + 4, thr,
                                              **_constexprs(cfg, mode, _PASS1, OFF64=off64),
                                              **_options(arch, cfg["coarse_warps"]))
        launch(_collect_kernel)[(num_rows, S2)](*row_args, *out_args, fmax, groups, state, gb + 4, thr, lst,
                                                2 * cap, ids, *g_args,
                                                **_constexprs(cfg, mode, _PASS2, OFF64=off64, GLOBAL=g),
                                                **_options(arch, cfg["warps"], g > 0))


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


def top_k_global_decode(logits, next_n: int, seq_lens, out_idx, num_rows: int, k: int, token_to_req_indices,
                        block_table, block_size: int, is_valid_token, global_indices, topk_lens,
                        needs_constant_topk: bool = False, config: dict = None) -> None:
    """``top_k_per_row_decode`` with the epilogue of ``compute_global_topk_indices_and_lens`` (int32 slots,
    global_indices [num_rows, k] with contiguous rows, topk_lens [num_rows]) in the same kernels."""
    per_row = seq_lens.dim() == 2 and seq_lens.shape[1] == next_n and next_n > 1
    s1 = seq_lens.stride(1) if seq_lens.dim() == 2 else 0
    _launch(logits, ROW_LENS if per_row else REQUEST_LENS, seq_lens, seq_lens, seq_lens.stride(0), s1, next_n,
            out_idx, num_rows, k, config, glob=(global_indices, topk_lens, token_to_req_indices, is_valid_token,
                                               block_table, block_size, needs_constant_topk))


def top_k_global_decode_op(logits, next_n: int, seq_lens, out_idx, num_rows: int, stride0: int, stride1: int, k: int,
                           token_to_req_indices, block_table, block_size: int, is_valid_token, output_buffers=None,
                           *, needs_constant_topk: bool = False):
    """``dsv4_rocm.ops.top_k_global_decode``'s kernel (arguments checked there): the outputs are the caller's
    pair or new tensors (``layout.global_topk_outputs``), returned."""
    gout, lens = global_topk_outputs(out_idx[:num_rows], output_buffers)
    top_k_global_decode(logits, next_n, seq_lens, out_idx, num_rows, k, token_to_req_indices, block_table,
                        block_size, is_valid_token, gout, lens, needs_constant_topk)
    return gout, lens


_PTRS = dict(x_ptr="*fp32", a_ptr="*i32", b_ptr="*i32", fmax_ptr="*i32", out_ptr="*i32", lst_ptr="*i32",
             state_ptr="*i32", thr_ptr="*i32", ids_ptr="*i32", gout_ptr="*i32", lens_ptr="*i32", t2r_ptr="*i32",
             valid_ptr="*i1", bt_ptr="*i32")
_SPECS = [  # (k, mode, logits type): each call form once, k from 512 to 2048
    (512, REQUEST_LENS, "*fp32"), (2048, RANGES, "*fp32"), (1024, ROW_LENS, "*bf16")]
# on AMD, tl.histogram's ballots (one 64-bit mask per digit bit and element, wave64) and the radix loops'
# scalar state exceed the 106 SGPRs of a wave: some sit in VGPR lanes (v_writelane / v_readlane), never
# in memory
_SGPR = "histogram ballot masks and the radix loops' scalar state"


def _spec(name, fn, k, mode, xt, names, warps, fused=False, **extra):
    def cfg(arch):
        c = default_config(arch, k)
        return _fused_sizes(c) if fused else c
    return dict(name=name, fn=fn, pointers=dict(_PTRS, x_ptr=xt), floats=(), matrix=False, sgpr_spills=_SGPR,
                constexprs=lambda arch: _constexprs(cfg(arch), mode, names, OFF64=False, **extra),
                options=lambda arch: _options(arch, cfg(arch)[warps], extra.get("GLOBAL", 0) > 0))


# the one-launch split (a configuration, not the default): at 16 warps a thread has 128 registers, which Triton
# 3.6 fits and 3.8's allocation overflows by 24-112 B on sm_90a / sm_100a (compile matrix, 2026-11-29)
_SPLIT1_WHY = "Triton >= 3.8: the one-launch split (not the default) at 128 registers a thread"
_SPLIT1_SPILLS = {(3, 6): "", (3, 8): {"sm_90a": _SPLIT1_WHY, "sm_100a": _SPLIT1_WHY}}


def _split1_spec(name, k, mode, xt, glob=0):
    return dict(_spec(name, _split1_kernel, k, mode, xt, _SPLIT1, "warps", GLOBAL=glob),
                constexprs=lambda arch: _split1_constexprs(default_config(arch, k), mode, OFF64=False, GLOBAL=glob),
                ptxas_spills=by_triton(_SPLIT1_SPILLS))


# entries of the CPU compile matrix (build_tools/compile_matrix.py)
COMPILE_SPECS = [
    spec for k, mode, xt in _SPECS for spec in (
        _spec(f"top_k_per_row_fused[k={k},mode={mode}]", _fused_kernel, k, mode, xt, _FUSED, "warps",
              fused=True, LONG=True),
        _spec(f"top_k_per_row_coarse[k={k},mode={mode}]", _coarse_kernel, k, mode, xt, _PASS1, "coarse_warps"),
        _spec(f"top_k_per_row_collect[k={k},mode={mode}]", _collect_kernel, k, mode, xt, _PASS2, "warps"),
        _split1_spec(f"top_k_per_row_split1[k={k},mode={mode}]", k, mode, xt))
] + [  # the short-rows kernel at the C4 decode step's width (2048 candidates)
    dict(_spec("top_k_per_row_short[k=512,width=2048]", _fused_kernel, 512, REQUEST_LENS, "*fp32", _FUSED, "warps"),
         constexprs=lambda arch: _short_constexprs(2048, default_config(arch, 512)["digit"], REQUEST_LENS, False))
] + [  # top_k_global_decode (the global-slots epilogue) on each layout it can take, at the decode step's k
    dict(_spec("top_k_global_short[k=512,width=2048]", _fused_kernel, 512, REQUEST_LENS, "*fp32", _FUSED, "warps",
               GLOBAL=1),
         constexprs=lambda arch: _short_constexprs(2048, default_config(arch, 512)["digit"], REQUEST_LENS, False, 1)),
    _split1_spec("top_k_global_split1[k=512]", 512, REQUEST_LENS, "*fp32", glob=1),
    _spec("top_k_global_fused[k=512]", _fused_kernel, 512, REQUEST_LENS, "*fp32", _FUSED, "warps", fused=True,
          LONG=True, GLOBAL=1),
    _spec("top_k_global_collect[k=512]", _collect_kernel, 512, REQUEST_LENS, "*fp32", _PASS2, "warps", GLOBAL=1)]
