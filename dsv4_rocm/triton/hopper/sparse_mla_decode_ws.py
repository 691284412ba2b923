"""Sparse MLA decode straight from fp8_ds_mla pages, warp-specialized for Hopper (sm_90a), in Gluon.

Same math, arguments and outputs as ``_sparse_mla_paged_kernel`` (``sparse_mla_decode.py``): per query
token t and head h, over the valid keys of the main and the extra index sets (K = V),

    l_i = sm * <q_h, K_i>      lse = ln sum_i exp(l_i)      out = softmax(l) @ K * sigmoid(lse - sink_h)

with an online softmax in base 2, P rounded to bf16 for the P.V product, out 0 and lse +inf for a query
with no valid key, and split partials (normalized o, base-2 lse) that ``_combine_kernel`` merges.

Records read (``FMT``, a ``layout.RecordFormat`` constexpr; both caches of a call in the same one, FORMATS):
key slot s is record o = s % bs of page s // bs (page stride from the cache), its data and scale bytes where
``layout.data_offset`` / ``record_scale_offset`` put them: page-split pages hold every record's data, then
every record's scales; interleaved pages each record's data then its scales.
* V40_584 (page-split): 448 e4m3 NoPE bytes, 64 bf16 RoPE values, 8 scale bytes (7 UE8M0, one per 64 dims,
  and a pad byte) at page + bs * 576 + o * 8.
* V41_528 (page-split or interleaved): 512 e4m3 bytes (RoPE dims 448..511 included), 16 UE8M0 scale bytes,
  one per 32 dims, at page + bs * 512 + o * 16 (page-split) or right after the record's data (interleaved).
A dim's value is e4m3(byte) * 2^(scale - 127), exact in bf16.

Work. A unit is one query token x 64 heads (128 heads: two units per token, one per head block). A unit
has M = cdiv(main topk, BLOCK_N) + cdiv(extra topk, BLOCK_N) key tiles: tile t < Mm = cdiv(main topk,
BLOCK_N) holds main keys [t BLOCK_N, +BLOCK_N), the others extra keys [(t - Mm) BLOCK_N, +BLOCK_N); a key
past its set's length, negative or >= the cache's capacity is absent (never read), and a tile with no
key below its set's length is dead (gathers nothing, computes nothing). The grid is persistent, (CTAs
per head block, head blocks): CTA (p, hb) takes the tiles [p W, p W + W) of head block hb's units laid
end to end in token order (W = ``tiles_per_cta``, chosen by the launcher so every SM gets the same number
of tiles), i.e. the ends of one or more units; with 128 heads CTAs (p, 0) and (p, 1) gather the same
records at the same time, the second mostly from L2. A unit whose tiles all lie in one CTA is written
straight to out and lse; one cut by CTA boundaries is split: the CTA holding its part j (j = p - first
CTA of the unit) writes partial j, and ``_combine_kernel`` merges the parts. The next unit's keys stream
into the K ring while the last tiles of the current one are multiplied.

Three partitions, 12 warps:

* loader (the default partition, 4 warps): walks the CTA's tiles, each as two chunks of RAW_KEYS = 32 keys.
  Two tiles ahead it copies the tile's BLOCK_N indices into a ring of three index rows (cp.async) and
  loads its unit's lengths (registers; first used a tile later, so nothing waits for the load); one tile
  ahead it turns the indices into record offsets (two int64 address rows per tile, two tiles' worth: data
  offset or -16 for an absent key, and V40_584's scale-word offset) and, with L2_AHEAD, asks L2 for every
  valid record (``prefetch.global.L2``: the lines of its data (five or six) and, V40_584, its scale word);
  V41_528's 16 scale bytes a key are copied then (cp.async) into the tile's scale slot (int32 [4, BLOCK_N],
  two tiles' worth), not held in registers. It gathers a chunk's e4m3 bytes (and V40_584's scale words)
  straight into registers as 32-bit words (16-byte loads: a thread takes one key and one 16-byte piece of
  each 64-byte column block: seven blocks and one scale word for V40_584, eight blocks for V41_528, whose
  piece g = 0..3 of block b takes scale 2b + (g >= 2), read from the scale slot at dequant time), the
  second chunk of tile i at the top of iteration i and the first of tile i + 1 before the second of tile i
  is dequantized; an absent key's loads are masked off. It dequantizes a chunk with integer ops (e4m3 -> bf16
  times 2^-120 by byte shuffles, then two exact packed-bf16 multiplies by powers of two, as
  ``_decode_tiles.e4m3_to_scaled_bf16_ptx``) into its rows of the tile's K slot: bf16 [BLOCK_N, 512] in
  the 128-byte-swizzled wgmma layout, in the natural order, written as bf16x2 words; V40_584's RoPE
  columns are copied by cp.async straight into the slot; plus the slot's bias row (0, or -inf for an
  absent key) and its liveness flag. A dead tile's slot is handed over without being written.
  KV_BF16 (prefill over bf16 rows, ``sparse_mla_prefill``): rows of 512 bf16 are one-key pages, copied by
  cp.async straight into the K slot, two tiles in flight (``_loader_rows``).
* consumer 0 (worker, one warpgroup): per live tile S = Q K^T (64 x BLOCK_N, K-dim 512, both operands in
  shared memory), the online softmax, P (bf16) and the row rescale alpha into shared memory for consumer
  1, then O[:, 0:256] = alpha O + P V with P in registers as the A operand and V = the K slot viewed
  [BLOCK_N, 256] (MN-major B operand). The unit's Q (all 512 columns) is in the shared Q tile: with
  Q_ASYNC (q's rows 16-byte aligned) copied by cp.async once the previous unit's last S has completed,
  its latency hidden behind that tile's softmax, P.V and epilogue; otherwise loaded through registers at
  the unit's first tile. At the part's last tile it hands the output row factor to consumer 1 and writes
  its columns and the lse (or the partial lse), and with HAS_MAXL the max logits.
* consumer 1 (worker, one warpgroup): per live tile O[:, 256:512] = alpha O + P V with P read from shared
  memory (both operands in shared memory); at the part's last tile it takes the row factor and writes
  its columns. S is computed once per tile (no duplicated Q K^T). Neither consumer loads anything from
  global memory per tile: the liveness of a tile is the loader's flag.

Registers: the kernel cap is 65536 / 384 threads = 168; consumer 0 takes C0_REGS (a 64 x 256 fp32
accumulator is 128 of them, S and P 48 more), consumer 1 C1_REGS, the loader what is left,
3 * 168 - C0_REGS - C1_REGS (144 by default: spill-free, compile matrix; two chunks in flight are 60
registers a thread for V40_584 (seven pieces and a scale word each) and 64 for V41_528 (eight pieces; its
scale bytes wait in shared memory, which is what keeps it within the 144).
Shared memory (BLOCK_N 64): Q 64 KB + K ring 2 x 64 KB + P 8 KB + index and address rows 3 KB + biases,
liveness flags, alpha, row factors and barriers 1.2 KB = 204 KB of the 227 KB; V41_528 2 KB more, the two
scale slots.

Barriers. An mbarrier arrive is made by one thread of its partition, after a partition barrier
(``thread_barrier`` of ``_compat``: Gluon's CTA barrier, a named barrier of the partition's warps) that orders every thread's
shared-memory work before it; waits are by every thread of the waiting partition. Phases count fills: the
n-th fill is waited for with parity n & 1, and a wait for parity (n & 1) ^ 1 before the n-th fill passes a
fresh barrier at once.
* ``k_ready[s]`` (count 1): the loader arrives when slot s holds the tile (liveness flag, K rows and bias
  row, K made visible to the async proxy by each writer's fence after its RoPE copies landed; nothing
  but the flag written for a dead tile); both consumers wait, parity (fill of s) & 1, for every tile,
  live or dead, then read the flag.
* ``k_free[s]`` (count 2): each consumer arrives when done with slot s (after the wait on its last wgmma
  reading it); the loader waits, parity ((fill of s) & 1) ^ 1, before its first write into s.
* ``p_ready`` (count 1): consumer 0 arrives when P and alpha of its n-th live tile are stored (P fenced
  for the async proxy); consumer 1 waits, parity n & 1.
* ``p_free`` (count 1): consumer 1 arrives when its P.V of its n-th live tile has completed; consumer 0
  waits, parity (n & 1) ^ 1, before storing P of its n-th live tile.
* ``o_ready`` / ``o_free`` (count 1): the same hand-over of the row factors at the end of the k-th unit
  part (consumer 0 stores them after waiting on o_free, parity (k & 1) ^ 1; consumer 1 waits on o_ready,
  parity k & 1, reads them and arrives on o_free).
compute-sanitizer racecheck does not follow an mbarrier hand-off whose sides reach their arrive through a
named barrier (consumers 0 and 1, bar.sync 2 and 3): it reports the alpha and row-factor hand-offs, and
Triton's warp-specialize start-up state (written and read around `barrier.sync 1`), as hazards; the comment
at consumer 0's alpha store gives the ordering, and test_ws_hand_offs_hold_under_random_stalls checks it.
The index and address rows and the scale slots need no mbarrier: only the loader touches them. cp.async
completion is per thread (wait_group), so the partition barrier after it makes an index row visible to
every loader thread, and tells the loader that every thread is done reading the rows it refills next; a
second partition barrier a tile publishes the address rows it wrote. Tile i + 1's scale bytes are copied
with its address rows (in iteration i, after the barrier that follows every read of its slot by tile
i - 1) and waited for by iteration i's last wait_group, before the barrier ahead of its k_ready arrive:
they are visible to every loader thread when tile i + 1 is dequantized. Q is written and read by consumer
0 alone (its S of the previous unit has completed, and every thread has passed a partition barrier, before
the next Q is copied; the copy is waited for, fenced and barriered before the next S).
"""
import functools

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ... import layout as L
from .._compat import GLUON_WS, thread_barrier
from .._decode_tiles import DECODE_POINTERS, e4m3_to_scaled_bf16_ptx

MAX_PARTS = 16        # parts of one split unit: the combine kernel's MAX_SPLITS


@gluon.jit
def _prefetch_l2(addr, pred):
    """Ask L2 for the 128-byte line holding each address (int64) where ``pred``; returns 0s. Not pure:
    nothing uses the result, and the request must stay where it is issued."""
    return gl.inline_asm_elementwise(
        asm="{ .reg .pred p; setp.ne.b32 p, $1, 0; @p prefetch.global.L2 [$2]; mov.b32 $0, 0; }",
        constraints="=r,r,l", args=[pred.to(gl.int32), addr], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _opaque_zero(x):
    """0, computed where it is called: an asm with side effects, so no loop-invariant code motion moves
    what depends on it (the wgmma descriptors of Q) out of the loop into long-lived, spilled registers."""
    return gl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


STALL = gl.constexpr(4)   # PROBE bit: pseudo-random pauses at every hand-off (the stress test); outputs exact


@gluon.jit
def _stall(i, SITE: gl.constexpr, PROBE: gl.constexpr):
    """With PROBE & STALL: pause this thread for 0 to about 4 us (nanosleep), the length drawn from the
    SM's cycle counter mixed with the tile, the CTA and the call site, so each partition reaches each
    hand-off at a different moment on every tile and launch. The mbarrier protocol must make the result
    independent of these pauses: a missing wait (or an arrive too early) then lets one partition read a
    shared buffer before it is written, or overwrite it before it is read, and the output changes."""
    if (PROBE & STALL) != 0:
        h = i * 37 + SITE * 101 + gl.program_id(0) * 7 + gl.program_id(1) * 13
        gl.inline_asm_elementwise(
            "{ .reg .u32 t; mov.u32 t, %clock; xor.b32 t, t, $1; shr.u32 t, t, 3; and.b32 t, t, 4095; "
            "nanosleep.u32 t; mov.b32 $0, 0; }", "=r,r", [h], dtype=gl.int32, is_pure=False, pack=1)


# ---- the schedule: which unit and tile a CTA's i-th tile is ------------------------------------------------
@gluon.jit
def _tiles_per_unit(main_topk, extra_topk, BLOCK_N: gl.constexpr, HAS_EXTRA: gl.constexpr):
    """(Mm, M): main tiles and all tiles of a unit (at least one). Made in each partition (an opaque 0 keeps
    the compiler from computing them once before the partitions split, which passes them through local
    memory)."""
    z = _opaque_zero(main_topk)
    mm = gl.cdiv(main_topk + z, BLOCK_N)
    m = mm
    if HAS_EXTRA:
        m = mm + gl.cdiv(extra_topk + z, BLOCK_N)
    return mm, gl.maximum(m, 1)


@gluon.jit
def _cta_tiles(num_tokens, W, M):
    """(p, head block hb, first tile A of this CTA in its head block's tile sequence, number of tiles)."""
    p = gl.program_id(0)
    a = p * W
    return p, gl.program_id(1), a, gl.minimum(W, num_tokens * M - a)


@gluon.jit
def _unit_tile(gt, sa, M):
    """Tile gt of a head block's sequence -> (token u, tile t of its unit, batch row bi, query si)."""
    num_tokens, s_q, W = sa
    u = gt // M
    bi = u.to(gl.int64) // s_q
    return u, gt - u * M, bi, u - bi * s_q


@gluon.jit
def _load_lengths(la, bi, si, ok, HAS_EXTRA: gl.constexpr, HAS_MAIN_LEN: gl.constexpr, HAS_EXTRA_LEN: gl.constexpr):
    """The lengths of query (bi, si) as loaded (0 where not ``ok``, nothing read then); ``_clamp_lengths``
    makes them usable. Apart so that a load's latency is not waited for where it is issued."""
    main_len_ptr, main_len_sb, main_len_ss, main_topk, extra_len_ptr, extra_len_sb, extra_len_ss, extra_topk = la
    n_main = gl.where(ok, main_topk, 0)
    if HAS_MAIN_LEN:
        n_main = gl.load(main_len_ptr + bi * main_len_sb + si * main_len_ss, mask=ok, other=0)
    n_extra = n_main * 0
    if HAS_EXTRA:
        n_extra = gl.where(ok, extra_topk, 0)
        if HAS_EXTRA_LEN:
            n_extra = gl.load(extra_len_ptr + bi * extra_len_sb + si * extra_len_ss, mask=ok, other=0)
    return n_main, n_extra


@gluon.jit
def _clamp_lengths(la, n_main, n_extra):
    """(n_main, n_extra): the valid prefix of each index set, its loaded length clamped to [0, topk]."""
    return gl.maximum(gl.minimum(n_main, la[3]), 0), gl.maximum(gl.minimum(n_extra, la[7]), 0)


@gluon.jit
def _tile_live(t, n_main, n_extra, Mm, BLOCK_N: gl.constexpr):
    """A tile holds a key below its set's length (lengths as loaded: clamped here)."""
    in_main = t < Mm
    return gl.where(in_main, t, t - Mm) * BLOCK_N < gl.where(in_main, n_main, n_extra)


# ---- loader ------------------------------------------------------------------------------------------------
@gluon.jit
def _copy_indices(ka, dst, t, bi, si, ok, Mm, BLOCK_N: gl.constexpr, LOAD_WARPS: gl.constexpr):
    """cp.async of tile t's BLOCK_N indices (main or extra row of query (bi, si)) into the index row
    ``dst``; entries past the set's topk (or all, where not ``ok``) are zero-filled, never read."""
    (main_ptr, main_stride, main_cap, main_idx_ptr, stride_mib, stride_mis, main_topk,
     extra_ptr, extra_stride, extra_cap, extra_idx_ptr, stride_eib, stride_eis, extra_topk) = ka
    LI: gl.constexpr = gl.BlockedLayout([1], [32], [LOAD_WARPS], [0])
    in_main = t < Mm
    row = gl.where(in_main, main_idx_ptr + bi * stride_mib + si * stride_mis,
                   extra_idx_ptr + bi * stride_eib + si * stride_eis)
    n = gl.where(in_main, t, t - Mm) * BLOCK_N + gl.arange(0, BLOCK_N, layout=LI)
    async_copy.async_copy_global_to_shared(dst, row + n, mask=(n < gl.where(in_main, main_topk, extra_topk)) & ok)


@gluon.jit
def _copy_scales(base, scal, valid, dst):
    """V41_528: cp.async of each valid key's 16 scale bytes (byte offset ``scal`` from ``base``) into the
    scale slot ``dst`` (int32 [4 BLOCK_N]: word j of key n at j BLOCK_N + n, so that a dequant reads one
    word of consecutive keys), one commit group; an absent key's are zero-filled, never read. The keys lie
    on the threads as in ``_tile_addresses`` (no data movement), each thread two of a key's four words."""
    BLOCK_N: gl.constexpr = dst.shape[0] // 4
    LC: gl.constexpr = gl.BlockedLayout([2, 1], [1, 32], [2, 2], [0, 1])
    dst = dst._reinterpret(gl.int32, [4, BLOCK_N], gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1,
                                                                            order=[1, 0]))
    keys = gl.convert_layout(scal // 4, gl.SliceLayout(0, LC), assert_trivial=True)
    ok = gl.convert_layout(valid, gl.SliceLayout(0, LC), assert_trivial=True)
    j = gl.arange(0, 4, layout=gl.SliceLayout(1, LC))
    async_copy.async_copy_global_to_shared(dst, base.to(gl.pointer_type(gl.int32)) + keys[None, :] + j[:, None],
                                           mask=ok[None, :] & (j < 4)[:, None])
    async_copy.commit_group()


@gluon.jit
def _tile_addresses(ka, idx_row, data_row, scal_row, t, n_main, n_extra, Mm, L2_AHEAD: gl.constexpr,
                    BLOCK_N: gl.constexpr, MAIN_BS: gl.constexpr, EXTRA_BS: gl.constexpr, KV_BF16: gl.constexpr,
                    FMT: gl.constexpr, PROBE: gl.constexpr):
    """Tile t's records, once per tile: from its shared index row to two int64 rows [BLOCK_N] (``data_row``:
    byte offset of each record's data from its cache's base, -16 when the key is absent (negative, and a
    multiple of 16 like every offset, so the masked-off 16-byte copies keep aligned addresses);
    ``scal_row``: element offset of its first scale word (8 scale bytes) as an int64), so the chunk gathers
    do no index arithmetic; V41_528: ``scal_row`` is the tile's scale slot, and the scale bytes themselves
    are copied into it (``_copy_scales``, one commit group). Offsets as ``layout.data_offset`` /
    ``record_scale_offset`` for the record format FMT. With L2_AHEAD also asks L2 for every valid record:
    bytes 0, 128, ..., 512 (at most its last byte) and the last byte of its data (the 128-byte lines it
    spans: five or six for V40_584's 576 bytes) and, for V40_584, its scale word (apart from the data on a
    page-split page), one request per element of [BLOCK_N keys, 8]. PROBE & 1 masks the scale copies off
    (measurement only, as the gathers). KV_BF16 (rows of 512 bf16, MAIN_BS 1): the data offset is the
    row's, and the requests are its eight 128-byte lines."""
    (main_ptr, main_stride, main_cap, main_idx_ptr, stride_mib, stride_mis, main_topk,
     extra_ptr, extra_stride, extra_cap, extra_idx_ptr, stride_eib, stride_eis, extra_topk) = ka
    # 2 warps along the keys, 2 along the 8 requests of a key (4 each)
    LP: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [2, 2], [1, 0])
    in_main = t < Mm
    n = gl.where(in_main, t, t - Mm) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LP))
    idx = idx_row.load(gl.SliceLayout(1, LP))
    valid = (n < gl.where(in_main, n_main, n_extra)) & (idx >= 0) & (idx < gl.where(in_main, main_cap, extra_cap))
    idx = gl.where(valid, idx, 0)
    # a division by each constant block size, then a select: cheaper than one division by a run-time value
    page = gl.where(in_main, (idx // MAIN_BS).to(gl.int64) * main_stride, (idx // EXTRA_BS).to(gl.int64) * extra_stride)
    off = gl.where(in_main, idx % MAIN_BS, idx % EXTRA_BS).to(gl.int64)
    data = page + off * _record_pitch(FMT)
    if FMT.interleaved:
        # a record's scale bytes right after its data bytes
        scal = data + FMT.data_bytes
    else:
        # the scale bytes of a record: aligned int64 words at page + bs * data_bytes + off * scale_bytes
        scal = page + gl.where(in_main, MAIN_BS * FMT.data_bytes, EXTRA_BS * FMT.data_bytes) + off * FMT.scale_bytes
    data_row.store(gl.where(valid, data, -16))
    if not _scale32(FMT):
        scal_row.store(scal // 8)
    else:
        _copy_scales(gl.where(in_main, main_ptr, extra_ptr), scal, valid & ((PROBE & 1) == 0), scal_row)
    if L2_AHEAD:
        c = gl.arange(0, 8, layout=gl.SliceLayout(0, LP))
        base = gl.where(in_main, main_ptr, extra_ptr)
        if KV_BF16:
            _prefetch_l2(base.to(gl.int64) + data[:, None] + (c * 128).to(gl.int64)[None, :],
                         valid[:, None] & (c < 8)[None, :])
        else:
            # the bytes a record's lines are asked by: 0, 128, ..., 512 and its last (SPAN - 1), then the
            # scale word where it lies apart from the data (V40_584; V41_528's are being copied already)
            SPAN: gl.constexpr = FMT.token_bytes if FMT.interleaved else FMT.data_bytes
            lines = (c * 128).to(gl.int64)
            if SPAN <= 513:
                lines = gl.minimum(lines, SPAN - 1)
            off8 = gl.where(c[None, :] < 5, lines[None, :],
                            gl.where(c[None, :] == 5, data[:, None] * 0 + (SPAN - 1), (scal - data)[:, None]))
            REQS: gl.constexpr = 6 if FMT.interleaved or _scale32(FMT) else 7
            _prefetch_l2(base.to(gl.int64) + data[:, None] + off8, valid[:, None] & (c < REQS)[None, :])


_DEQUANT_WORD = gl.constexpr("{\n.reg .b32 t0, t1;\n" + e4m3_to_scaled_bf16_ptx("t0", "t1")
                              + "mul.rn.bf16x2 t0, t0, $3;\nmul.rn.bf16x2 t1, t1, $3;\n"
                              + "mul.rn.bf16x2 $0, t0, $4;\nmul.rn.bf16x2 $1, t1, $4;\n}")


@gluon.jit
def _dequant_words(w, m1, m2):
    """Words of four OCP e4m3 bytes -> (bf16x2 of bytes 0 and 1, bf16x2 of bytes 2 and 3) times 2^(byte - 127)
    of their UE8M0 scale byte (m1, m2: the bf16x2 pairs of the scale's two factors, ``_scale_pairs``): the
    integer decode of ``_decode_tiles.e4m3_to_scaled_bf16_ptx`` (value * 2^-120), then two exact packed-bf16
    multiplies by powers of two."""
    return gl.inline_asm_elementwise(asm=_DEQUANT_WORD, constraints="=r,=r,r,r,r", args=[w, m1, m2],
                                     dtype=(gl.int32, gl.int32), is_pure=True, pack=1)


@gluon.constexpr_function
def _record_pitch(FMT):
    """Bytes from one record's data to the next one's in a page: the record (interleaved) or its data bytes
    (page-split)."""
    return FMT.token_bytes if FMT.interleaved else FMT.data_bytes


@gluon.constexpr_function
def _scale32(FMT):
    """The format's 64-dim column blocks take two UE8M0 scales each (V41_528: all 512 dims e4m3, one scale
    per 32) instead of one (V40_584: 448 e4m3 dims, one scale per 64, then 64 bf16 RoPE dims)."""
    if not (FMT.elem_bits == 8 and FMT.scale == "ue8m0" and FMT.fp8 == "e4m3fn"
            and (FMT.quant_dims, FMT.quant_block, FMT.data_bytes, FMT.scale_bytes) in ((448, 64, 576, 8),
                                                                                       (512, 32, 512, 16))):
        raise ValueError(f"the Hopper decode kernel reads V40_584 and V41_528 records, not {FMT.name}")
    return FMT.quant_block == 32


@gluon.constexpr_function
def _pair_layout(LOAD_WARPS, SCALE32=False):
    """[keys, 2 column blocks, 16 words] of a 32-key chunk: a thread holds one key and one 16-byte piece
    (four words) of each of two 64-wide column blocks. SCALE32: the same threads and words as [keys, 2
    column blocks, 2 halves, 8 words], so that a piece's scale (one per half block) is one element per
    thread and block."""
    if SCALE32:
        return gl.BlockedLayout([1, 2, 1, 4], [8, 1, 2, 2], [LOAD_WARPS, 1, 1, 1], [3, 2, 1, 0])
    return gl.BlockedLayout([1, 2, 4], [8, 1, 4], [LOAD_WARPS, 1, 1], [2, 1, 0])


@gluon.jit
def _gather_chunk(ka, addr_rows, a, t, key0, Mm, RAW_KEYS: gl.constexpr, PROBE: gl.constexpr,
                  LOAD_WARPS: gl.constexpr, FMT: gl.constexpr):
    """Register loads of keys key0 .. key0 + RAW_KEYS of tile t (record offsets from address rows 2a and
    2a + 1), as 32-bit words (bytes kept four to a register): V40_584: NoPE column blocks 0-1, 2-3, 4-5 as
    [RAW_KEYS, 2, 16] and block 6 as [RAW_KEYS, 16] words of four e4m3 bytes, and the scale words
    [RAW_KEYS] i64 (an absent key's loads, data offset negative, are masked off). A thread takes one key
    and one 16-byte piece of each of its NoPE blocks (seven 16-byte loads) and the scale word; nothing
    waits for them until they are used. RoPE needs no dequantization: ``_copy_rope`` copies it. V41_528
    (``_scale32``): column blocks 0-1, 2-3, 4-5, 6-7 as [RAW_KEYS, 2, 2, 8] words (eight 16-byte loads a
    thread) and a constant 0 for the scale words: the scale bytes are in the tile's scale slot
    (``_copy_scales``), read at dequant time."""
    base = gl.where(t < Mm, ka[0], ka[7])
    if _scale32(FMT):
        k01, k23, k45, k6, word = _gather_chunk32(base, addr_rows, a, key0, RAW_KEYS, PROBE, LOAD_WARPS)
    else:
        k01, k23, k45, k6, word = _gather_chunk64(base, addr_rows, a, key0, RAW_KEYS, PROBE, LOAD_WARPS)
    return k01, k23, k45, k6, word


@gluon.jit
def _gather_chunk64(base, addr_rows, a, key0, RAW_KEYS: gl.constexpr, PROBE: gl.constexpr,
                    LOAD_WARPS: gl.constexpr):
    """``_gather_chunk`` of V40_584 records."""
    wbase = base.to(gl.pointer_type(gl.int32))
    LP: gl.constexpr = _pair_layout(LOAD_WARPS)
    L1: gl.constexpr = gl.SliceLayout(1, LP)
    row = addr_rows.index(2 * a).slice(key0, RAW_KEYS)
    data = row.load(gl.SliceLayout(1, gl.SliceLayout(2, LP)))
    ok = (data >= 0) & ((PROBE & 1) == 0)
    wp = gl.multiple_of(data // 4, 4)
    c2 = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, LP)))
    w16 = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, LP)))
    ptr = wbase + wp[:, None, None] + (c2 * 16)[None, :, None] + w16[None, None, :]
    m = ok[:, None, None] & (c2 < 2)[None, :, None] & (w16 < 16)[None, None, :]
    k01 = gl.load(ptr, mask=m, other=0)
    k23 = gl.load(ptr + 32, mask=m, other=0)
    k45 = gl.load(ptr + 64, mask=m, other=0)
    d1 = row.load(gl.SliceLayout(1, L1))
    w1 = gl.arange(0, 16, layout=gl.SliceLayout(0, L1))
    k6 = gl.load(wbase + gl.multiple_of(d1 // 4, 4)[:, None] + 96 + w1[None, :],
                 mask=((d1 >= 0) & ((PROBE & 1) == 0))[:, None], other=0)
    scal = addr_rows.index(2 * a + 1).slice(key0, RAW_KEYS).load(gl.SliceLayout(1, gl.SliceLayout(2, LP)))
    word = gl.load(base.to(gl.pointer_type(gl.int64)) + scal, mask=ok, other=0)
    return k01, k23, k45, k6, word


@gluon.jit
def _gather_chunk32(base, addr_rows, a, key0, RAW_KEYS: gl.constexpr, PROBE: gl.constexpr,
                    LOAD_WARPS: gl.constexpr):
    """``_gather_chunk`` of V41_528 records: four pairs of column blocks [RAW_KEYS, 2, 2, 8] (a thread's
    16-byte piece of a block is the four words of one half of it) and the 16 scale bytes [RAW_KEYS, 2]."""
    wbase = base.to(gl.pointer_type(gl.int32))
    LP: gl.constexpr = _pair_layout(LOAD_WARPS, True)
    S2: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, LP))        # [keys, 2]: both in one thread
    row = addr_rows.index(2 * a).slice(key0, RAW_KEYS)
    data = row.load(gl.SliceLayout(1, S2))
    ok = (data >= 0) & ((PROBE & 1) == 0)
    wp = gl.multiple_of(data // 4, 4)
    c2 = gl.arange(0, 2, layout=gl.SliceLayout(0, S2))
    h2 = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, LP))))
    w8 = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, LP))))
    ptr = (wbase + wp[:, None, None, None] + (c2 * 16)[None, :, None, None] + (h2 * 8)[None, None, :, None]
           + w8[None, None, None, :])
    m = (ok[:, None, None, None] & (c2 < 2)[None, :, None, None] & (h2 < 2)[None, None, :, None]
         & (w8 < 8)[None, None, None, :])
    k01 = gl.load(ptr, mask=m, other=0)
    k23 = gl.load(ptr + 32, mask=m, other=0)
    k45 = gl.load(ptr + 64, mask=m, other=0)
    k67 = gl.load(ptr + 96, mask=m, other=0)
    # the scale bytes are not held across the chunk: _copy_scales put them in the tile's scale slot
    return k01, k23, k45, k67, gl.to_tensor(0)


@gluon.jit
def _scale_pairs(sb):
    """UE8M0 bytes -> the bf16x2 pairs of their two exact power-of-two factors: value * 2^-120 times
    2^(byte - 7) is two exact bf16 multiplies, 2^(min(byte, 134) - 7) and 2^(max(byte, 134) - 134), both
    representable (bf16 stops at 2^127); a scale byte of 0xFF (a poisoned block) multiplies by NaN."""
    m1 = (gl.minimum(sb, 134) + 120) << 7
    m2 = gl.where(sb == 255, 0x7FC0, (gl.maximum(sb, 134) - 7) << 7)
    return m1 | (m1 << 16), m2 | (m2 << 16)


@gluon.jit
def _store_pair(rows, kw, word, J: gl.constexpr, RAW_KEYS: gl.constexpr, LOAD_WARPS: gl.constexpr):
    """Column blocks 2J, 2J + 1 of a chunk, dequantized, -> words [64 J, 64 J + 64) of the rows."""
    LP: gl.constexpr = _pair_layout(LOAD_WARPS)
    c2 = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, LP)))
    m1, m2 = _scale_pairs(((word[:, None] >> (8 * (2 * J + c2)).to(gl.int64)[None, :]) & 0xFF).to(gl.int32))
    lo, hi = _dequant_words(kw, m1[:, :, None], m2[:, :, None])
    rows.slice(64 * J, 64, dim=1).store(gl.reshape(gl.join(lo, hi), [RAW_KEYS, 64]))


@gluon.jit
def _store_pair32(rows, kw, scales, J: gl.constexpr, RAW_KEYS: gl.constexpr, LOAD_WARPS: gl.constexpr):
    """V41_528: column blocks 2J, 2J + 1 of a chunk ([keys, 2, 2, 8] words), dequantized, -> words
    [64 J, 64 J + 64) of the rows. Half h of block 2J + c takes scale byte 2 (2J + c) + h: byte
    2c + h of the key's scale word J, read here from the chunk's keys' words J in the scale slot (``scales``,
    [RAW_KEYS] int32; eight keys a warp, one word each, no bank conflict)."""
    LP: gl.constexpr = _pair_layout(LOAD_WARPS, True)
    S3: gl.constexpr = gl.SliceLayout(3, LP)
    w = scales.load(gl.SliceLayout(1, gl.SliceLayout(2, S3)))
    c2 = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(0, S3)))
    h2 = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(0, S3)))
    sh = 8 * (2 * c2[:, None] + h2[None, :])
    m1, m2 = _scale_pairs((w[:, None, None] >> sh[None, :, :]) & 0xFF)
    lo, hi = _dequant_words(kw, m1[:, :, :, None], m2[:, :, :, None])
    rows.slice(64 * J, 64, dim=1).store(gl.reshape(gl.join(lo, hi), [RAW_KEYS, 64]))


@gluon.jit
def _store_chunk(k01, k23, k45, k6, word, addr_rows, a, scal_slot, k_slot, bias_slot, SUB: gl.constexpr,
                 RAW_KEYS: gl.constexpr, BLOCK_N: gl.constexpr, LOAD_WARPS: gl.constexpr, FMT: gl.constexpr):
    """A chunk gathered by ``_gather_chunk`` -> rows [SUB * RAW_KEYS, +RAW_KEYS) of a K slot (bf16 in the
    natural 512-dim order, written as bf16x2 words through a 32-bit view of the same 128-byte-swizzled
    bytes; V40_584's RoPE columns are ``_copy_rope``'s) and of its bias row, a few column blocks at a time
    (few registers live). A warp writes eight keys x 128 bytes per two 16-byte stores: eight rows of the
    swizzle, no bank conflicts. V41_528: k6 holds column blocks 6-7, and the scale bytes are read from the
    tile's scale slot ``scal_slot`` (``_copy_scales``; word unused)."""
    LP: gl.constexpr = _pair_layout(LOAD_WARPS)
    L1: gl.constexpr = gl.SliceLayout(1, LP)
    WL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    rows = k_slot._reinterpret(gl.int32, [BLOCK_N, 256], WL).slice(SUB * RAW_KEYS, RAW_KEYS, dim=0)
    if _scale32(FMT):
        _store_pair32(rows, k01, scal_slot.slice(SUB * RAW_KEYS, RAW_KEYS), 0, RAW_KEYS, LOAD_WARPS)
        _store_pair32(rows, k23, scal_slot.slice(BLOCK_N + SUB * RAW_KEYS, RAW_KEYS), 1, RAW_KEYS, LOAD_WARPS)
        _store_pair32(rows, k45, scal_slot.slice(2 * BLOCK_N + SUB * RAW_KEYS, RAW_KEYS), 2, RAW_KEYS, LOAD_WARPS)
        _store_pair32(rows, k6, scal_slot.slice(3 * BLOCK_N + SUB * RAW_KEYS, RAW_KEYS), 3, RAW_KEYS, LOAD_WARPS)
    else:
        _store_pair(rows, k01, word, 0, RAW_KEYS, LOAD_WARPS)
        _store_pair(rows, k23, word, 1, RAW_KEYS, LOAD_WARPS)
        _store_pair(rows, k45, word, 2, RAW_KEYS, LOAD_WARPS)
        w6 = gl.convert_layout(word, gl.SliceLayout(1, L1))
        m1, m2 = _scale_pairs(((w6 >> 48) & 0xFF).to(gl.int32))
        lo, hi = _dequant_words(k6, m1[:, None], m2[:, None])
        rows.slice(192, 32, dim=1).store(gl.reshape(gl.join(lo, hi), [RAW_KEYS, 32]))
    # the bias from the tile's address rows (still in place: they are rewritten a tile later)
    LS: gl.constexpr = gl.BlockedLayout([1], [32], [LOAD_WARPS], [0])
    data = addr_rows.index(2 * a).slice(SUB * RAW_KEYS, RAW_KEYS).load(LS)
    bias_slot.slice(SUB * RAW_KEYS, RAW_KEYS).store(gl.where(data >= 0, 0.0, float("-inf")))


@gluon.jit
def _publish(k_live, ks, live, LOAD_WARPS: gl.constexpr):
    """Tile liveness for the consumers: slot ks's flag (a row of 32 int32, all equal), written before the
    slot's k_ready arrive (the consumers read it after their wait, with no global load)."""
    LS: gl.constexpr = gl.BlockedLayout([1], [32], [LOAD_WARPS], [0])
    k_live.index(ks).store(gl.full([32], 0, gl.int32, LS) + live.to(gl.int32))


@gluon.jit
def _copy_rope(ka, addr_rows, a, t, Mm, k_slot, LOAD_WARPS: gl.constexpr):
    """cp.async of tile t's V40_584 RoPE values (64 bf16 after the 448 NoPE bytes of each record; offsets
    from address row 2a) straight into the K slot's last 64 columns, one commit group; an absent key's are
    zero-filled."""
    base = gl.where(t < Mm, ka[0], ka[7]).to(gl.pointer_type(gl.bfloat16))
    LC: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [LOAD_WARPS, 1], [1, 0])
    data = addr_rows.index(2 * a).load(gl.SliceLayout(1, LC))
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, LC))
    ptr = base + gl.multiple_of((data + 448) // 2, 8)[:, None] + cols[None, :]
    async_copy.async_copy_global_to_shared(k_slot.slice(448, 64, dim=1), ptr,
                                           mask=(data >= 0)[:, None] & (cols < 64)[None, :])
    async_copy.commit_group()


@gluon.jit
def _scale_dst(addr_rows, k_scal, j, KV_BF16: gl.constexpr, FMT: gl.constexpr):
    """Where ``_tile_addresses`` puts tile j's scales: its scale-word address row (V40_584, KV_BF16) or,
    V41_528, its scale slot (the bytes themselves, copied)."""
    if KV_BF16 or not _scale32(FMT):
        dst = addr_rows.index(2 * (j % 2) + 1)
    else:
        dst = k_scal.index(j % 2)
    return dst


@gluon.jit
def _loader_start(sa, la, ka, idx_rows, addr_rows, k_scal, BLOCK_N: gl.constexpr, MAIN_BS: gl.constexpr,
                  EXTRA_BS: gl.constexpr, HAS_EXTRA: gl.constexpr, HAS_MAIN_LEN: gl.constexpr,
                  HAS_EXTRA_LEN: gl.constexpr, L2_AHEAD: gl.constexpr, KV_BF16: gl.constexpr,
                  LOAD_WARPS: gl.constexpr, FMT: gl.constexpr, PROBE: gl.constexpr):
    """Both loaders' start: the CTA's tiles, tiles 0 and 1 (tile of its unit, lengths as loaded), their
    index rows (tile j in row j % 3) and tile 0's address rows (tile j in rows 2 (j % 2), 2 (j % 2) + 1),
    published by a partition barrier; V41_528: tile 0's scale bytes copied into scale slot 0 (landed and
    published by the barrier at the top of the loop's first iteration).
    -> (Mm, M, A, n_tiles, t0, nm0, ne0, t1, nm1, ne1)."""
    num_tokens, s_q, W = sa
    Mm, M = _tiles_per_unit(la[3], la[7], BLOCK_N, HAS_EXTRA)
    p, hb, A, n_tiles = _cta_tiles(num_tokens, W, M)
    u0, t0, b0, s0 = _unit_tile(A, sa, M)
    nm0, ne0 = _load_lengths(la, b0, s0, n_tiles > 0, HAS_EXTRA, HAS_MAIN_LEN, HAS_EXTRA_LEN)
    u1, t1, b1, s1 = _unit_tile(A + 1, sa, M)
    nm1, ne1 = _load_lengths(la, b1, s1, n_tiles > 1, HAS_EXTRA, HAS_MAIN_LEN, HAS_EXTRA_LEN)
    _copy_indices(ka, idx_rows.index(0), t0, b0, s0, n_tiles > 0, Mm, BLOCK_N, LOAD_WARPS)
    _copy_indices(ka, idx_rows.index(1), t1, b1, s1, n_tiles > 1, Mm, BLOCK_N, LOAD_WARPS)
    async_copy.commit_group()
    async_copy.wait_group(0)
    thread_barrier()
    cm0, ce0 = _clamp_lengths(la, nm0, ne0)
    _tile_addresses(ka, idx_rows.index(0), addr_rows.index(0), _scale_dst(addr_rows, k_scal, 0, KV_BF16, FMT), t0,
                    cm0, ce0, Mm, L2_AHEAD, BLOCK_N, MAIN_BS, EXTRA_BS, KV_BF16, FMT, PROBE)
    thread_barrier()
    return Mm, M, A, n_tiles, t0, nm0, ne0, t1, nm1, ne1


@gluon.jit
def _loader(sa, la, ka, bufs, bars, BLOCK_N: gl.constexpr, K_STAGES: gl.constexpr, MAIN_BS: gl.constexpr,
            EXTRA_BS: gl.constexpr, HAS_EXTRA: gl.constexpr, HAS_MAIN_LEN: gl.constexpr, HAS_EXTRA_LEN: gl.constexpr,
            L2_AHEAD: gl.constexpr, PROBE: gl.constexpr, LOAD_WARPS: gl.constexpr, FMT: gl.constexpr):
    """Tile i is two chunks of RAW_KEYS = 32 keys gathered into registers. Its second chunk is loaded at the
    top of iteration i, while its first (loaded during tile i - 1) is dequantized into the K slot; the
    first chunk of tile i + 1 is loaded before the second of tile i is dequantized. Tile i + 1's record
    offsets are made (and asked of L2) during tile i, from its index row, copied during tile i - 1; tile
    i + 2's lengths are loaded during tile i and first used during tile i + 1. FMT: the caches' record
    format (both sets), V40_584 (RoPE copied by cp.async) or V41_528 (every column dequantized, the scale
    bytes of tile i + 1 copied into its scale slot with its record offsets)."""
    q_smem, k_ring, k_bias, k_live, p_smem, alpha_smem, o_scale, idx_rows, addr_rows, k_scal = bufs
    k_ready, k_free, p_ready, p_free, o_ready, o_free = bars
    num_tokens, s_q, W = sa
    RAW_KEYS: gl.constexpr = BLOCK_N // 2
    gl.static_assert(RAW_KEYS == 8 * LOAD_WARPS)
    Mm, M, A, n_tiles, t0, nm0, ne0, t1, nm1, ne1 = _loader_start(
        sa, la, ka, idx_rows, addr_rows, k_scal, BLOCK_N, MAIN_BS, EXTRA_BS, HAS_EXTRA, HAS_MAIN_LEN, HAS_EXTRA_LEN,
        L2_AHEAD, False, LOAD_WARPS, FMT, PROBE)
    HAS_ROPE: gl.constexpr = not _scale32(FMT)      # V40_584's bf16 RoPE columns, copied as they are
    c0a, c0b, c0c, c0d, word0 = _gather_chunk(ka, addr_rows, 0, t0, 0, Mm, RAW_KEYS, PROBE, LOAD_WARPS, FMT)
    for i in range(n_tiles):
        ks = i % K_STAGES
        k_slot = k_ring.index(ks)
        bias_slot = k_bias.index(ks)
        scal_slot = _scale_dst(addr_rows, k_scal, i, False, FMT)
        live = _tile_live(t0, nm0, ne0, Mm, BLOCK_N)
        c1a, c1b, c1c, c1d, word1 = _gather_chunk(ka, addr_rows, i % 2, t0, RAW_KEYS, Mm, RAW_KEYS, PROBE, LOAD_WARPS,
                                                  FMT)
        u2, t2, b2, s2 = _unit_tile(A + i + 2, sa, M)
        ok2 = i + 2 < n_tiles
        nm2, ne2 = _load_lengths(la, b2, s2, ok2, HAS_EXTRA, HAS_MAIN_LEN, HAS_EXTRA_LEN)
        # tile i + 1's index row (copied during tile i - 1, or before the loop) has landed in every thread's
        # view; every thread is done reading the rows the next writes replace (tile i - 1's)
        async_copy.wait_group(0)
        thread_barrier()
        _copy_indices(ka, idx_rows.index((i + 2) % 3), t2, b2, s2, ok2, Mm, BLOCK_N, LOAD_WARPS)
        async_copy.commit_group()
        cm1, ce1 = _clamp_lengths(la, nm1, ne1)
        _tile_addresses(ka, idx_rows.index((i + 1) % 3), addr_rows.index(2 * ((i + 1) % 2)),
                        _scale_dst(addr_rows, k_scal, i + 1, False, FMT), t1, cm1, ce1, Mm, L2_AHEAD, BLOCK_N, MAIN_BS,
                        EXTRA_BS, False, FMT, PROBE)
        # slot ks is free once both consumers released its previous tile (fill i // K_STAGES - 1)
        mbarrier.wait(k_free.index(ks), ((i // K_STAGES) & 1) ^ 1)
        _stall(i, 1, PROBE)
        _publish(k_live, ks, live, LOAD_WARPS)
        if live:
            if HAS_ROPE:
                _copy_rope(ka, addr_rows, i % 2, t0, Mm, k_slot, LOAD_WARPS)
            _store_chunk(c0a, c0b, c0c, c0d, word0, addr_rows, i % 2, scal_slot, k_slot, bias_slot, 0, RAW_KEYS,
                         BLOCK_N, LOAD_WARPS, FMT)
        # tile i + 1's address rows are written by every thread
        thread_barrier()
        c0a, c0b, c0c, c0d, word0 = _gather_chunk(ka, addr_rows, (i + 1) % 2, t1, 0, Mm, RAW_KEYS, PROBE,
                                                  LOAD_WARPS, FMT)
        if live:
            _store_chunk(c1a, c1b, c1c, c1d, word1, addr_rows, i % 2, scal_slot, k_slot, bias_slot, 1, RAW_KEYS,
                         BLOCK_N, LOAD_WARPS, FMT)
        # the RoPE copies have landed; K rows written by the generic proxy are read by wgmma (async
        # proxy): fence, then one arrive once every loader thread has fenced its stores
        async_copy.wait_group(0)
        fence_async_shared()
        thread_barrier()
        mbarrier.arrive(k_ready.index(ks), count=1)
        t0, nm0, ne0 = t1, nm1, ne1
        t1, nm1, ne1 = t2, nm2, ne2
    async_copy.wait_group(0)


@gluon.jit
def _copy_rows(ka, addr_rows, a, t, Mm, k_slot, bias_slot, BLOCK_N: gl.constexpr, PROBE: gl.constexpr,
               LOAD_WARPS: gl.constexpr):
    """KV_BF16: cp.async of tile t's BLOCK_N rows of 512 bf16 (offsets from address row 2a) straight into the
    K slot (16 bytes a copy, the slot's swizzle applied by the copy; an absent key's row is zero-filled),
    and its bias row."""
    base = gl.where(t < Mm, ka[0], ka[7]).to(gl.pointer_type(gl.bfloat16))
    LC: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [LOAD_WARPS, 1], [1, 0])
    data = addr_rows.index(2 * a).load(gl.SliceLayout(1, LC))
    cols = gl.arange(0, 512, layout=gl.SliceLayout(0, LC))
    ok = (data >= 0) & ((PROBE & 1) == 0)
    ptr = base + gl.multiple_of(data // 2, 8)[:, None] + cols[None, :]
    async_copy.async_copy_global_to_shared(k_slot, ptr, mask=ok[:, None] & (cols < 512)[None, :])
    LS: gl.constexpr = gl.BlockedLayout([1], [32], [LOAD_WARPS], [0])
    bias_slot.store(gl.where(addr_rows.index(2 * a).load(LS) >= 0, 0.0, float("-inf")))


@gluon.jit
def _loader_rows(sa, la, ka, bufs, bars, BLOCK_N: gl.constexpr, K_STAGES: gl.constexpr, HAS_MAIN_LEN: gl.constexpr,
                 L2_AHEAD: gl.constexpr, PROBE: gl.constexpr, LOAD_WARPS: gl.constexpr, FMT: gl.constexpr):
    """The loader for KV_BF16 (prefill over a bf16 kv, no extra set): tile i's rows are copied (cp.async)
    into its K slot as soon as the slot is free, and handed over once they have landed, which is after
    tile i + 1's copies are issued (two tiles in flight). Indices two tiles ahead, record offsets (and L2
    requests) one tile ahead, lengths loaded two tiles ahead, as ``_loader``."""
    q_smem, k_ring, k_bias, k_live, p_smem, alpha_smem, o_scale, idx_rows, addr_rows, k_scal = bufs
    k_ready, k_free, p_ready, p_free, o_ready, o_free = bars
    num_tokens, s_q, W = sa
    Mm, M, A, n_tiles, t0, nm0, ne0, t1, nm1, ne1 = _loader_start(
        sa, la, ka, idx_rows, addr_rows, k_scal, BLOCK_N, 1, 1, False, HAS_MAIN_LEN, False, L2_AHEAD, True, LOAD_WARPS,
        FMT, PROBE)
    for i in range(n_tiles):
        ks = i % K_STAGES
        live = _tile_live(t0, nm0, ne0, Mm, BLOCK_N)
        u2, t2, b2, s2 = _unit_tile(A + i + 2, sa, M)
        ok2 = i + 2 < n_tiles
        nm2, ne2 = _load_lengths(la, b2, s2, ok2, False, HAS_MAIN_LEN, False)
        # slot ks is free once both consumers released its previous tile (fill i // K_STAGES - 1)
        mbarrier.wait(k_free.index(ks), ((i // K_STAGES) & 1) ^ 1)
        _stall(i, 1, PROBE)
        _publish(k_live, ks, live, LOAD_WARPS)
        if live:
            _copy_rows(ka, addr_rows, i % 2, t0, Mm, k_ring.index(ks), k_bias.index(ks), BLOCK_N, PROBE, LOAD_WARPS)
        _copy_indices(ka, idx_rows.index((i + 2) % 3), t2, b2, s2, ok2, Mm, BLOCK_N, LOAD_WARPS)
        async_copy.commit_group()
        # tile i - 1's rows (and tile i + 1's index row, in the same group) have landed in every thread's view
        async_copy.wait_group(1)
        fence_async_shared()
        thread_barrier()
        if i > 0:
            mbarrier.arrive(k_ready.index((i - 1) % K_STAGES), count=1)
        cm1, ce1 = _clamp_lengths(la, nm1, ne1)
        _tile_addresses(ka, idx_rows.index((i + 1) % 3), addr_rows.index(2 * ((i + 1) % 2)),
                        addr_rows.index(2 * ((i + 1) % 2) + 1), t1, cm1, ce1, Mm, L2_AHEAD, BLOCK_N, 1, 1, True,
                        FMT, PROBE)
        # tile i + 1's address rows, read by its copies at the next iteration, are written by every thread
        thread_barrier()
        t0, nm0, ne0 = t1, nm1, ne1
        t1, nm1, ne1 = t2, nm2, ne2
    async_copy.wait_group(0)
    fence_async_shared()
    thread_barrier()
    if n_tiles > 0:
        mbarrier.arrive(k_ready.index((n_tiles - 1) % K_STAGES), count=1)


# ---- consumers ---------------------------------------------------------------------------------------------
@gluon.jit
def _copy_q(oa, q_smem, gt, sa, M, hb, num_tokens):
    """cp.async of the Q rows (64 heads x 512, 16 bytes a copy) of the unit of tile gt into the Q tile, one
    commit group (Q_ASYNC: q's rows are 16-byte aligned)."""
    (q_ptr, stride_qb, stride_qs, stride_qh, sink_ptr, out_ptr, stride_ob, stride_os, stride_oh, lse_ptr,
     part_o_ptr, part_lse_ptr, sm_log2, maxl_ptr) = oa
    u, t, bi, si = _unit_tile(gt, sa, M)
    # a thread copies half a head row (32 copies off one row address: few registers beside the accumulator)
    LC: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [4, 1], [1, 0])
    rows = hb * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, LC))
    cols = gl.arange(0, 512, layout=gl.SliceLayout(0, LC))
    off = gl.multiple_of(bi * stride_qb + si * stride_qs + rows.to(gl.int64) * stride_qh, 8)
    async_copy.async_copy_global_to_shared(q_smem.index(0), q_ptr + off[:, None] + cols[None, :],
                                           mask=(u < num_tokens) & (cols < 512)[None, :])
    async_copy.commit_group()


@gluon.jit
def _next_q(oa, q_smem, A, i, t, n_tiles, sa, M, hb, num_tokens):
    """At a unit's last tile, once its S has completed (or when it has none): copy the next unit's Q,
    whose latency then hides behind this tile's softmax, P.V and epilogue."""
    if (t == M - 1) & (i + 1 < n_tiles):
        thread_barrier()
        _copy_q(oa, q_smem, A + i + 1, sa, M, hb, num_tokens)


@gluon.jit
def _slot_live(k_live, ks):
    """The liveness flag the loader published for K slot ks (read after the slot's k_ready wait)."""
    LS: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    return gl.max(k_live.index(ks).load(LS), axis=0) != 0


@gluon.jit
def _epilogue_rows(oa, num_tokens, p, u, bi, si, hb, M, W, factor, acc, O_L: gl.constexpr, c0: gl.constexpr,
                   HEADS: gl.constexpr, split):
    """Write columns [c0, c0 + 256) of a unit part: acc * factor to out (bf16) when the unit is whole, to
    its partial row j = p - first CTA of the unit (fp32) when split."""
    (q_ptr, stride_qb, stride_qs, stride_qh, sink_ptr, out_ptr, stride_ob, stride_os, stride_oh, lse_ptr,
     part_o_ptr, part_lse_ptr, sm_log2, maxl_ptr) = oa
    # the rows made here (an opaque 0 keeps loop-invariant code motion from holding their offsets in
    # registers across the tile loop); the columns stay constants, folded into the stores' offsets
    oh = hb * 64 + _opaque_zero(u) + gl.arange(0, 64, layout=gl.SliceLayout(1, O_L))
    cols = c0 + gl.arange(0, 256, layout=gl.SliceLayout(0, O_L))
    res = acc * factor[:, None]
    if split:
        j = p - (u * M) // W
        base = (j * num_tokens + u).to(gl.int64) * HEADS
        gl.store(part_o_ptr + (base + oh)[:, None] * 512 + cols[None, :], res)
    else:
        o_row = out_ptr + bi * stride_ob + si * stride_os + oh.to(gl.int64) * stride_oh
        gl.store(o_row[:, None] + cols[None, :], res.to(gl.bfloat16))


@gluon.jit
def _consumer0(sa, la, oa, bufs, bars, HEADS: gl.constexpr, BLOCK_N: gl.constexpr, K_STAGES: gl.constexpr,
               HAS_EXTRA: gl.constexpr, HAS_MAIN_LEN: gl.constexpr, HAS_EXTRA_LEN: gl.constexpr,
               HAS_SINK: gl.constexpr, HAS_MAXL: gl.constexpr, Q_ASYNC: gl.constexpr, PROBE: gl.constexpr):
    q_smem, k_ring, k_bias, k_live, p_smem, alpha_smem, o_scale, idx_rows, addr_rows, k_scal = bufs
    k_ready, k_free, p_ready, p_free, o_ready, o_free = bars
    (q_ptr, stride_qb, stride_qs, stride_qh, sink_ptr, out_ptr, stride_ob, stride_os, stride_oh, lse_ptr,
     part_o_ptr, part_lse_ptr, sm_log2, maxl_ptr) = oa
    num_tokens, s_q, W = sa
    Mm, M = _tiles_per_unit(la[3], la[7], BLOCK_N, HAS_EXTRA)
    p, hb, A, n_tiles = _cta_tiles(num_tokens, W, M)

    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    PQ: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [4, 1], [1, 0])

    acc = gl.zeros([64, 256], gl.float32, O_L)
    m_i = gl.full([64], float("-inf"), gl.float32, gl.SliceLayout(1, S_L))
    l_i = gl.zeros([64], gl.float32, gl.SliceLayout(1, S_L))
    n_live = 0
    n_parts = 0
    if Q_ASYNC:
        _copy_q(oa, q_smem, A, sa, M, hb, num_tokens)
    for i in range(n_tiles):
        ks = i % K_STAGES
        u, t, bi, si = _unit_tile(A + i, sa, M)
        k_slot = k_ring.index(ks)
        if (i == 0) | (t == 0):
            if Q_ASYNC:
                # the unit's Q, copied after the previous unit's last S (or before the loop), has landed
                async_copy.wait_group(0)
                fence_async_shared()
                thread_barrier()
            else:
                # offsets made here (an opaque 0 keeps loop-invariant code motion from holding them, and their
                # products with the strides, in registers across the loop)
                z = _opaque_zero(i)
                qr = z + gl.arange(0, 64, layout=gl.SliceLayout(1, QL))
                qc = z + gl.arange(0, 64, layout=gl.SliceLayout(0, QL))
                # the unit's Q -> the shared Q tile (consumer 0's own wgmma of the previous unit have completed)
                q_row = q_ptr + bi * stride_qb + si * stride_qs + (hb * 64 + qr).to(gl.int64) * stride_qh
                for j in gl.static_range(8):
                    q_smem.index(0).slice(64 * j, 64, dim=1).store(gl.load(q_row[:, None] + (64 * j + qc)[None, :]))
                fence_async_shared()
                thread_barrier()
                # ask L2 for the next unit's Q (eight 128-byte lines per head row)
                pr = z + gl.arange(0, 64, layout=gl.SliceLayout(1, PQ))
                pc = z + gl.arange(0, 8, layout=gl.SliceLayout(0, PQ))
                un, tn, bn, sn = _unit_tile((u + 1) * M, sa, M)
                nq = q_ptr + bn * stride_qb + sn * stride_qs + (hb * 64 + pr).to(gl.int64) * stride_qh
                _prefetch_l2(nq.to(gl.int64)[:, None] + (pc * 128).to(gl.int64)[None, :],
                             (pr[:, None] * 0 + pc[None, :] * 0 + un) < num_tokens)
        mbarrier.wait(k_ready.index(ks), (i // K_STAGES) & 1)
        _stall(i, 2, PROBE)
        live = _slot_live(k_live, ks)
        if live:
            if (PROBE & 2) == 0:
                s = warpgroup_mma(q_smem.index(_opaque_zero(i)), k_slot.permute((1, 0)),
                                  gl.zeros([64, BLOCK_N], gl.float32, S_L), use_acc=False, is_async=True)
                s = warpgroup_mma_wait(0, deps=(s, ))
            else:
                s = gl.zeros([64, BLOCK_N], gl.float32, S_L) + _opaque_zero(i).to(gl.float32)
            if Q_ASYNC:
                _next_q(oa, q_smem, A, i, t, n_tiles, sa, M, hb, num_tokens)
            bias = k_bias.index(ks).load(gl.SliceLayout(0, S_L))
            s = s * sm_log2 + bias[None, :]
            m_new = gl.maximum(m_i, gl.max(s, 1))
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_use)
            pm = gl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + gl.sum(pm, 1)
            m_i = m_new
            p16 = pm.to(gl.bfloat16)
            # P and alpha for consumer 1, once it is done with the previous ones. compute-sanitizer racecheck
            # reports this alpha store against consumer 1's alpha load (and o_scale below likewise): the two are
            # ordered by p_free / p_ready, but each side's accesses reach its single-thread arrive through its
            # partition barrier, a named barrier (bar.sync 2 or 3, 128), and racecheck orders nothing through
            # named barriers: it reports Triton's own warp-specialize start-up state too, written and read around
            # `barrier.sync 1` with no mbarrier at all, while the same hand-off with the default partition's
            # barrier 0 is clean (gpu/racecheck_control.py). Ordering: consumer 1 loads alpha of live tile n - 1
            # before its partition barrier and its p_free arrive; this wait (parity (n & 1) ^ 1) is for that
            # arrive; every store here precedes the partition barrier ahead of p_ready, which consumer 1 waits
            # for (parity n & 1) before its load. test_ws_hand_offs_hold_under_random_stalls pauses both sides.
            mbarrier.wait(p_free, (n_live & 1) ^ 1)
            _stall(i, 3, PROBE)
            p_smem.index(_opaque_zero(i)).store(p16)
            alpha_smem.store(alpha)
            fence_async_shared()
            thread_barrier()
            mbarrier.arrive(p_ready, count=1)
            # the accumulator layout of S is the A-operand layout of P.V (16-bit operands): no data movement
            pa = gl.convert_layout(p16, P_L, assert_trivial=True)
            alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, O_L), assert_trivial=True)
            if (PROBE & 2) == 0:
                acc = warpgroup_mma(pa, k_slot.slice(0, 256, dim=1), acc * alpha_o[:, None], is_async=True)
                # P.V completes inside the iteration: a wgmma left in flight across the loop's back edge makes
                # ptxas serialize every wgmma of the kernel
                acc = warpgroup_mma_wait(0, deps=(acc, ))
            n_live += 1
        else:
            if Q_ASYNC:
                _next_q(oa, q_smem, A, i, t, n_tiles, sa, M, hb, num_tokens)
        thread_barrier()
        mbarrier.arrive(k_free.index(ks), count=1)
        if (i == n_tiles - 1) | (t == M - 1):
            empty = l_i == 0.0
            inv_l = gl.where(empty, 0.0, 1.0 / gl.where(empty, 1.0, l_i))
            lse2 = gl.where(empty, float("-inf"), m_i + gl.log2(gl.where(empty, 1.0, l_i)))
            split = (u * M) // W != (u * M + M - 1) // W
            heads = hb * 64 + _opaque_zero(i) + gl.arange(0, 64, layout=gl.SliceLayout(1, S_L))
            factor = inv_l
            if split:
                j = p - (u * M) // W
                gl.store(part_lse_ptr + (j * num_tokens + u).to(gl.int64) * HEADS + heads, lse2)
            else:
                if HAS_SINK:
                    sink = gl.load(sink_ptr + heads)
                    # exp(lse) / (exp(lse) + exp(sink)) = 1 / (1 + 2^(sink*log2e - lse2))
                    factor = gl.where(empty, 0.0, inv_l / (1.0 + gl.exp2(sink * 1.4426950408889634 - lse2)))
                gl.store(lse_ptr + u.to(gl.int64) * HEADS + heads,
                         gl.where(empty, float("inf"), lse2 * 0.6931471805599453))
                if HAS_MAXL:
                    gl.store(maxl_ptr + u.to(gl.int64) * HEADS + heads, m_i * 0.6931471805599453)
            # the row factors for consumer 1, once it has taken the previous ones (racecheck's report of this
            # store against consumer 1's load: as for alpha above, ordered by o_free / o_ready)
            mbarrier.wait(o_free, (n_parts & 1) ^ 1)
            _stall(i, 4, PROBE)
            o_scale.store(factor)
            thread_barrier()
            mbarrier.arrive(o_ready, count=1)
            f_o = gl.convert_layout(factor, gl.SliceLayout(1, O_L), assert_trivial=True)
            _epilogue_rows(oa, num_tokens, p, u, bi, si, hb, M, W, f_o, acc, O_L, 0, HEADS, split)
            # the next tile starts a unit part: reset here, where acc dies (a reset at the part's first
            # tile would keep acc alive across this epilogue, beside the scaled copy being stored)
            acc = gl.zeros([64, 256], gl.float32, O_L)
            m_i = gl.full([64], float("-inf"), gl.float32, gl.SliceLayout(1, S_L))
            l_i = gl.zeros([64], gl.float32, gl.SliceLayout(1, S_L))
            n_parts += 1


@gluon.jit
def _consumer1(sa, la, oa, bufs, bars, HEADS: gl.constexpr, BLOCK_N: gl.constexpr, K_STAGES: gl.constexpr,
               HAS_EXTRA: gl.constexpr, HAS_MAIN_LEN: gl.constexpr, HAS_EXTRA_LEN: gl.constexpr,
               PROBE: gl.constexpr):
    q_smem, k_ring, k_bias, k_live, p_smem, alpha_smem, o_scale, idx_rows, addr_rows, k_scal = bufs
    k_ready, k_free, p_ready, p_free, o_ready, o_free = bars
    num_tokens, s_q, W = sa
    Mm, M = _tiles_per_unit(la[3], la[7], BLOCK_N, HAS_EXTRA)
    p, hb, A, n_tiles = _cta_tiles(num_tokens, W, M)
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    n_live = 0
    n_parts = 0
    acc = gl.zeros([64, 256], gl.float32, O_L)
    for i in range(n_tiles):
        ks = i % K_STAGES
        u, t, bi, si = _unit_tile(A + i, sa, M)
        k_slot = k_ring.index(ks)
        mbarrier.wait(k_ready.index(ks), (i // K_STAGES) & 1)
        _stall(i, 5, PROBE)
        if _slot_live(k_live, ks):
            mbarrier.wait(p_ready, n_live & 1)
            _stall(i, 6, PROBE)
            alpha = alpha_smem.load(gl.SliceLayout(1, O_L))
            if (PROBE & 2) == 0:
                acc = warpgroup_mma(p_smem.index(0), k_slot.slice(256, 256, dim=1), acc * alpha[:, None],
                                    is_async=True)
                acc = warpgroup_mma_wait(0, deps=(acc, ))
            thread_barrier()
            mbarrier.arrive(p_free, count=1)
            n_live += 1
        thread_barrier()
        mbarrier.arrive(k_free.index(ks), count=1)
        if (i == n_tiles - 1) | (t == M - 1):
            mbarrier.wait(o_ready, n_parts & 1)
            _stall(i, 7, PROBE)
            factor = o_scale.load(gl.SliceLayout(1, O_L))
            thread_barrier()
            mbarrier.arrive(o_free, count=1)
            split = (u * M) // W != (u * M + M - 1) // W
            _epilogue_rows(oa, num_tokens, p, u, bi, si, hb, M, W, factor, acc, O_L, 256, HEADS, split)
            acc = gl.zeros([64, 256], gl.float32, O_L)
            n_parts += 1


# arguments as _sparse_mla_paged_kernel's, with tiles_per_cta (W) where that kernel takes num_splits; the
# same ones are left unspecialized, and the topks (a topk of 1 would turn the tile counts into constants)
@gluon.jit(do_not_specialize=["main_cap", "extra_cap", "num_tokens", "s_q", "tiles_per_cta", "main_len_sb",
                              "main_len_ss", "extra_len_sb", "extra_len_ss", "main_topk", "extra_topk"],
           do_not_specialize_on_alignment=["main_len_ptr", "extra_len_ptr"])
def _sparse_mla_ws_kernel(
        q_ptr, stride_qb, stride_qs, stride_qh,
        main_ptr, main_stride, main_cap, main_idx_ptr, stride_mib, stride_mis, main_len_ptr, main_len_sb,
        main_len_ss, main_topk,
        extra_ptr, extra_stride, extra_cap, extra_idx_ptr, stride_eib, stride_eis, extra_len_ptr, extra_len_sb,
        extra_len_ss, extra_topk,
        sink_ptr, out_ptr, stride_ob, stride_os, stride_oh, lse_ptr,
        part_o_ptr, part_lse_ptr, num_tokens, s_q, tiles_per_cta, sm_log2, maxl_ptr,
        MAIN_BS: gl.constexpr, EXTRA_BS: gl.constexpr, HAS_EXTRA: gl.constexpr, HAS_MAIN_LEN: gl.constexpr,
        HAS_EXTRA_LEN: gl.constexpr, HAS_SINK: gl.constexpr, BLOCK_N: gl.constexpr, HEADS: gl.constexpr,
        K_STAGES: gl.constexpr, L2_AHEAD: gl.constexpr, C0_REGS: gl.constexpr, C1_REGS: gl.constexpr,
        KV_BF16: gl.constexpr, HAS_MAXL: gl.constexpr, Q_ASYNC: gl.constexpr, PROBE: gl.constexpr,
        FMT: gl.constexpr, num_warps: gl.constexpr):
    LOAD_WARPS: gl.constexpr = num_warps      # the loader is the default partition
    gl.static_assert(BLOCK_N == 64 and LOAD_WARPS == 4)
    KL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    PLAIN1: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [1, 64, 512], KL)
    k_ring = gl.allocate_shared_memory(gl.bfloat16, [K_STAGES, BLOCK_N, 512], KL)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [1, 64, BLOCK_N], KL)
    k_bias = gl.allocate_shared_memory(gl.float32, [K_STAGES, BLOCK_N], PLAIN1)
    alpha_smem = gl.allocate_shared_memory(gl.float32, [64], PLAIN1)
    o_scale = gl.allocate_shared_memory(gl.float32, [64], PLAIN1)
    k_live = gl.allocate_shared_memory(gl.int32, [K_STAGES, 32], PLAIN1)
    idx_rows = gl.allocate_shared_memory(gl.int32, [3, BLOCK_N], PLAIN1)
    addr_rows = gl.allocate_shared_memory(gl.int64, [4, BLOCK_N], PLAIN1)
    k_ready = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    k_free = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    p_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    o_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    o_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for s in gl.static_range(K_STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(k_free.index(s), count=2)
    mbarrier.init(p_ready, count=1)
    mbarrier.init(p_free, count=1)
    mbarrier.init(o_ready, count=1)
    mbarrier.init(o_free, count=1)

    if KV_BF16 or not _scale32(FMT):
        k_scal = addr_rows          # unused: V40_584's scale words are gathered into registers
    else:
        # V41_528's scale bytes of the tiles whose address rows are made (tile j in slot j % 2), _copy_scales
        k_scal = gl.allocate_shared_memory(gl.int32, [2, 4 * BLOCK_N], PLAIN1)
    bufs = (q_smem, k_ring, k_bias, k_live, p_smem, alpha_smem, o_scale, idx_rows, addr_rows, k_scal)
    bars = (k_ready, k_free, p_ready, p_free, o_ready, o_free)
    sa = (num_tokens, s_q, tiles_per_cta)
    la = (main_len_ptr, main_len_sb, main_len_ss, main_topk, extra_len_ptr, extra_len_sb, extra_len_ss, extra_topk)
    ka = (main_ptr, main_stride, main_cap, main_idx_ptr, stride_mib, stride_mis, main_topk,
          extra_ptr, extra_stride, extra_cap, extra_idx_ptr, stride_eib, stride_eis, extra_topk)
    oa = (q_ptr, stride_qb, stride_qs, stride_qh, sink_ptr, out_ptr, stride_ob, stride_os, stride_oh, lse_ptr,
          part_o_ptr, part_lse_ptr, sm_log2, maxl_ptr)
    # the loader gets what the consumers leave of the kernel's register cap (65536 / 384 threads -> 168):
    # 3 * 168 - C0_REGS - C1_REGS per thread
    if KV_BF16:
        gl.static_assert(not HAS_EXTRA and MAIN_BS == 1 and FMT.name == "V40_584")  # FMT unused: rows
        gl.warp_specialize([
            (_loader_rows, (sa, la, ka, bufs, bars, BLOCK_N, K_STAGES, HAS_MAIN_LEN, L2_AHEAD, PROBE, LOAD_WARPS,
                            FMT)),
            (_consumer0, (sa, la, oa, bufs, bars, HEADS, BLOCK_N, K_STAGES, HAS_EXTRA, HAS_MAIN_LEN, HAS_EXTRA_LEN,
                          HAS_SINK, HAS_MAXL, Q_ASYNC, PROBE)),
            (_consumer1, (sa, la, oa, bufs, bars, HEADS, BLOCK_N, K_STAGES, HAS_EXTRA, HAS_MAIN_LEN, HAS_EXTRA_LEN,
                          PROBE)),
        ], [4, 4], [C0_REGS, C1_REGS])
    else:
        gl.warp_specialize([
            (_loader, (sa, la, ka, bufs, bars, BLOCK_N, K_STAGES, MAIN_BS, EXTRA_BS, HAS_EXTRA, HAS_MAIN_LEN,
                       HAS_EXTRA_LEN, L2_AHEAD, PROBE, LOAD_WARPS, FMT)),
            (_consumer0, (sa, la, oa, bufs, bars, HEADS, BLOCK_N, K_STAGES, HAS_EXTRA, HAS_MAIN_LEN, HAS_EXTRA_LEN,
                          HAS_SINK, HAS_MAXL, Q_ASYNC, PROBE)),
            (_consumer1, (sa, la, oa, bufs, bars, HEADS, BLOCK_N, K_STAGES, HAS_EXTRA, HAS_MAIN_LEN, HAS_EXTRA_LEN,
                          PROBE)),
        ], [4, 4], [C0_REGS, C1_REGS])


# ---- launch ----------------------------------------------------------------------------------------------
def default_config(num_heads: int = 64) -> dict:
    """The H100 defaults: 64-key tiles, two K slots, consumer 0 at 200 registers, consumer 1 at 160 (the
    loader gets 144), no spills (compile matrix); L2 requests a tile ahead with 64 heads only (with 128 the
    second head block's gathers hit L2 anyway: 1-3% faster without, 0-2% slower with 64 heads; H100,
    gpu/decode_ws.py). The register gathers measured 10-18% faster on every timed row than the earlier
    raw ring in shared memory fed by cp.async (BENCHMARKS.md). ``PROBE`` is for measurement only
    (gpu/decode_ws.py): 1 masks off every record load, 2 skips the matrix products, 3 both; the outputs
    are then wrong. ``PROBE`` 4 (STALL) is for the stress test of the hand-offs only: pseudo-random pauses
    at each of them (``_stall``), the outputs unchanged."""
    return dict(BLOCK_N=64, K_STAGES=2, L2_AHEAD=num_heads <= 64, C0_REGS=200, C1_REGS=160, PROBE=0, num_warps=4)


def prefill_config() -> dict:
    """The kernel over a bf16 kv (``KV_BF16``, ``sparse_mla_prefill``): the decode defaults."""
    return default_config()


CONFIG_KEYS = tuple(default_config())


def tiles_per_unit(main_topk: int, extra_topk: int, block_n: int) -> int:
    """M: key tiles of one unit (a token's 64 heads), at least one (as the kernel counts them)."""
    return max(triton.cdiv(main_topk, block_n) + triton.cdiv(extra_topk, block_n), 1)


def schedule(units: int, m: int, sm_count: int, num_splits: int = None, whole: bool = False) -> int:
    """W, the tiles per CTA of the persistent grid of one head block (``units`` tokens of m tiles each on
    ``sm_count`` SMs: cdiv(units * m, W) CTAs).

    By default every SM gets the same number of tiles (cdiv(units * m, sm_count)); when whole units per CTA
    come within 10% of that, whole units (no partials, no combine). A unit is cut into at most MAX_PARTS
    parts. ``num_splits`` = s asks for each unit cut into about s parts (1: one unit per CTA); ``whole``:
    whole units per CTA always (prefill: no partials)."""
    if whole:
        return triton.cdiv(units, sm_count) * m
    if num_splits is not None:
        w = triton.cdiv(m, max(1, min(int(num_splits), MAX_PARTS)))
    else:
        w = triton.cdiv(units * m, sm_count)
        if w >= m:
            whole = triton.cdiv(w, m) * m
            if whole * 10 <= w * 11:
                w = whole
    # the parts of a unit: at most cdiv(m - 1, w) + 1 <= MAX_PARTS
    return max(w, triton.cdiv(m - 1, MAX_PARTS - 1), 1)


def max_parts(m: int, w: int) -> int:
    """The most CTAs one unit's tiles can fall into; 1 when no unit is ever split."""
    return 1 if w % m == 0 else min(triton.cdiv(m - 1, w) + 1, MAX_PARTS)


@functools.lru_cache(maxsize=1024)
def q_rows_aligned(q) -> bool:
    """q's rows start at 16-byte boundaries (its address and every stride but the last a multiple of 8
    elements): Q_ASYNC, the Q tile copied by cp.async; otherwise loaded through registers."""
    return q.data_ptr() % 16 == 0 and all(st % 8 == 0 for st in q.stride()[:-1])


# the record formats the kernel reads (both caches of a call in one of them): V4.0's, and V4.1's fp8 record in
# either page layout
FORMATS = (L.V40_584, L.V41_528, L.interleaved(L.V41_528))


def reads(fmt: L.RecordFormat, extra_fmt: L.RecordFormat = None) -> bool:
    """The kernel reads a call over caches of these formats: ``fmt`` one of FORMATS, and the extra cache (if
    any) of the same format and page layout. Everything else (a V41_FP4_288 extra cache, FNUZ-flavour
    records) is ``sparse_mla_decode.py``'s kernel's."""
    return fmt in FORMATS and (extra_fmt is None or extra_fmt == fmt)


@functools.lru_cache(maxsize=1024)
def constexprs(cfg_items: tuple, h: int, main_bs: int, extra_bs: int, has_extra: bool, has_len: bool,
               has_extra_len: bool, has_sink: bool, q_async: bool = True, fmt: L.RecordFormat = L.V40_584) -> dict:
    """The kernel's constexprs and launch options for a config (items of a ``sparse_mla_decode`` plan) over
    caches of the record format ``fmt`` (one of FORMATS)."""
    if fmt not in FORMATS:
        raise ValueError(f"the Hopper decode kernel reads {', '.join(f.name + ' ' + f.layout for f in FORMATS)} "
                         f"records, not {fmt.name} {fmt.layout}")
    cfg = dict(cfg_items)
    return dict(MAIN_BS=main_bs, EXTRA_BS=extra_bs, HAS_EXTRA=has_extra, HAS_MAIN_LEN=has_len,
                HAS_EXTRA_LEN=has_extra_len, HAS_SINK=has_sink, HEADS=h, KV_BF16=False, HAS_MAXL=False,
                Q_ASYNC=q_async, FMT=fmt, **{k: cfg[k] for k in CONFIG_KEYS})


def prefill_constexprs(cfg_items: tuple, h: int, has_len: bool, has_sink: bool, q_async: bool = True) -> dict:
    """The constexprs and launch options of the kernel over a bf16 kv (prefill: one index set, rows as
    one-key pages, max logits written)."""
    cfg = dict(cfg_items)
    return dict(MAIN_BS=1, EXTRA_BS=1, HAS_EXTRA=False, HAS_MAIN_LEN=has_len, HAS_EXTRA_LEN=False,
                HAS_SINK=has_sink, HEADS=h, KV_BF16=True, HAS_MAXL=True, Q_ASYNC=q_async, FMT=L.V40_584,
                **{k: cfg[k] for k in CONFIG_KEYS})


def _matrix_constexprs(arch, small_pages=False, fmt=L.V40_584):
    return dict(MAIN_BS=64 if small_pages else 256, EXTRA_BS=2 if small_pages else 64, HAS_EXTRA=True,
                HAS_MAIN_LEN=True, HAS_EXTRA_LEN=True, HAS_SINK=True, HEADS=128 if small_pages else 64,
                KV_BF16=False, HAS_MAXL=False, Q_ASYNC=True, FMT=fmt,
                **{k: v for k, v in default_config(128 if small_pages else 64).items() if k != "num_warps"})


_POINTERS = dict(DECODE_POINTERS, maxl_ptr="*fp32")


# entries of the CPU compile matrix (build_tools/compile_matrix.py): sm_90a only (wgmma, setmaxnreg)
COMPILE_SPECS = [
    dict(name="sparse_mla_decode_ws", fn=_sparse_mla_ws_kernel, pointers=_POINTERS, floats=("sm_log2",),
         constexprs=_matrix_constexprs, options=lambda arch: dict(num_warps=default_config()["num_warps"]),
         matrix=True, fp8_convert=True, targets=("sm_90a",), wgmma_pipelined=True),
    dict(name="sparse_mla_decode_ws[h128,bs2]", fn=_sparse_mla_ws_kernel, pointers=_POINTERS,
         floats=("sm_log2",), constexprs=lambda arch: _matrix_constexprs(arch, small_pages=True),
         options=lambda arch: dict(num_warps=default_config()["num_warps"]), matrix=True, fp8_convert=True,
         targets=("sm_90a",), wgmma_pipelined=True),
    # V4.1's fp8 records: interleaved (vLLM 0.33's layout) with 64 heads and L2 requests, page-split with 128
    dict(name="sparse_mla_decode_ws[V41_528]", fn=_sparse_mla_ws_kernel, pointers=_POINTERS, floats=("sm_log2",),
         constexprs=lambda arch: _matrix_constexprs(arch, fmt=L.interleaved(L.V41_528)),
         options=lambda arch: dict(num_warps=default_config()["num_warps"]), matrix=True, fp8_convert=True,
         targets=("sm_90a",), wgmma_pipelined=True),
    dict(name="sparse_mla_decode_ws[V41_528 page-split,h128,bs2]", fn=_sparse_mla_ws_kernel, pointers=_POINTERS,
         floats=("sm_log2",), constexprs=lambda arch: _matrix_constexprs(arch, small_pages=True, fmt=L.V41_528),
         options=lambda arch: dict(num_warps=default_config()["num_warps"]), matrix=True, fp8_convert=True,
         targets=("sm_90a",), wgmma_pipelined=True),
    dict(name="sparse_mla_prefill_ws", fn=_sparse_mla_ws_kernel, pointers=_POINTERS, floats=("sm_log2",),
         constexprs=lambda arch: dict(
             MAIN_BS=1, EXTRA_BS=1, HAS_EXTRA=False, HAS_MAIN_LEN=True, HAS_EXTRA_LEN=False, HAS_SINK=True, HEADS=64,
             KV_BF16=True, HAS_MAXL=True, Q_ASYNC=True, FMT=L.V40_584,
             **{k: v for k, v in prefill_config().items() if k != "num_warps"}),
         options=lambda arch: dict(num_warps=prefill_config()["num_warps"]), matrix=True, targets=("sm_90a",),
         wgmma_pipelined=True),
]
if not GLUON_WS:        # Triton 3.9's warp_specialize rejects these partitions (_compat): not offered there
    COMPILE_SPECS = []
