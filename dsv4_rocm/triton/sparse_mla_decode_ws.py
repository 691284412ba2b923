"""Sparse MLA decode straight from fp8_ds_mla pages, warp-specialized for Hopper (sm_90a), in Gluon.

Same math, arguments and outputs as ``_sparse_mla_paged_kernel`` (``sparse_mla_decode.py``): per query
token t and head h, over the valid keys of the main and the extra index sets (K = V),

    l_i = sm * <q_h, K_i>      lse = ln sum_i exp(l_i)      out = softmax(l) @ K * sigmoid(lse - sink_h)

with an online softmax in base 2, P rounded to bf16 for the P.V product, out 0 and lse +inf for a query
with no valid key, and split partials (normalized o, base-2 lse) that ``_combine_kernel`` merges.

One CTA = one query token x 64 heads (128 heads: two CTAs per token, each its own 64 heads, the second
one's gathers mostly hitting L2). Grid and splits as the Triton kernel's. Three partitions, 12 warps:

* loader (the default partition, 4 warps): walks the key tiles of the query (main set then extra set,
  BLOCK_N keys each, a set's last tile padded) in chunks of RAW_KEYS keys. For a chunk it reads the
  indices (a key past its set's length, negative or >= capacity is absent: never read) and gathers the
  records with cp.async into a ring of RAW_STAGES raw slots: NoPE bytes block-major [8, RAW_KEYS, 64] u8
  (block 7 unused) so that the dequantizing reads are conflict-free, RoPE [RAW_KEYS, 64] bf16, the 8 UE8M0
  scale bytes of a record as one int64 (16-, 16- and 8-byte copies), and a bias per key (0, or -inf when
  absent). An absent key's copies are zero fills, so its K row is 0 and its score -inf. RAW_STAGES - 1
  chunks stay in flight while the loader dequantizes the oldest one with integer ops (e4m3 -> bf16 times
  2^-120 by byte shuffles, then two exact packed-bf16 multiplies by powers of two, as
  ``sparse_mla_decode._e4m3_to_scaled_bf16``) into its rows of the tile's K slot: bf16 [BLOCK_N, 512] in
  the 128-byte-swizzled wgmma layout, in the natural order (NoPE 448, RoPE 64), plus the slot's bias row.
* two consumers (worker partitions of one warpgroup each, CID 0 and 1): consumer CID owns output columns
  [256 CID, 256 CID + 256). Each computes the whole S = Q K^T (64 x BLOCK_N, K-dim 512, both operands in
  shared memory) itself, so both hold bit-identical S, row max and row sum and exchange nothing; then
  O += P V with P (bf16) in registers as the A operand and V = the same K slot viewed [BLOCK_N, 256] at
  the columns of its half (MN-major B operand). Duplicating Q K^T costs tensor time (about 48 instead of
  34 cycles per key at 64 heads) and saves every data exchange between the two. With PINGPONG their S
  products alternate (an mbarrier pair), so one's softmax and P.V overlap the other's S. Consumer CID
  copies Q's columns of its half into the shared Q tile once.

Registers: the kernel cap is 65536 / 384 threads = 168; each consumer takes CONSUMER_REGS (default 200:
a 64 x 256 fp32 accumulator is 128 of them) and the loader what is left, 3 * 168 - 2 * CONSUMER_REGS (104).
Shared memory (BLOCK_N 64, K_STAGES 2, RAW_KEYS 16, RAW_STAGES 3): Q 64 KB + K ring 128 KB + raw ring
30.4 KB + biases and barriers = 223.3 KB of the 227 KB.

Barriers. An mbarrier arrive is made by one thread of its partition, after a partition barrier
(``gl.thread_barrier``, a named barrier of the partition's warps) that orders every thread's
shared-memory work before it; waits are by every thread.
* ``k_ready[s]`` (count 1): the loader arrives when slot s holds a whole tile (K rows and bias row, K made
  visible to the async proxy by each writer's fence); each consumer waits with parity (fill of s) & 1.
* ``k_free[s]`` (count 2): each consumer arrives once its last wgmma reading slot s has completed (the
  wait after its P.V); the loader waits before refilling s, with parity ((fill of s) & 1) ^ 1, which a
  fresh barrier passes at the first fill.
* ``q_ready`` (count 2): each consumer arrives after storing (and fencing) its half of Q; both wait for
  phase 0 before their first wgmma.
* ``turn[c]`` (count 1, PINGPONG only): consumer 1 - c arrives when its S of a tile is done; consumer 0
  waits on turn[0] for phase i - 1 before the S of tile i (i > 0), consumer 1 on turn[1] for phase i.
The raw ring needs no mbarrier: only the loader touches it. cp.async completion is per thread
(wait_group), so the partition barrier after it makes a chunk's bytes visible to every loader thread, and
tells the loader that every thread is done reading the slot it refills next.
"""
import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ._decode_tiles import DECODE_POINTERS, program_tiles


@gluon.jit
def _dequant_e4m3(kb, m1, m2):
    """OCP e4m3 bytes times 2^(byte - 127) of their UE8M0 scale byte -> bf16, four values per asm block.

    The e4m3 -> bf16 step is ``sparse_mla_decode._e4m3_to_scaled_bf16`` (value * 2^-120, integer ops
    only); ``m1`` and ``m2`` hold bf16x2 pairs of the two exact power-of-two factors of the scale (one
    per key, the same for the four values), applied with packed bf16 multiplies."""
    return gl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t0, t1;
        prmt.b32 t0, $2, 0, 0x9180;
        prmt.b32 t1, $2, 0, 0xB3A2;
        shl.b32 t0, t0, 4;
        shl.b32 t1, t1, 4;
        and.b32 t0, t0, 0x87F087F0;
        and.b32 t1, t1, 0x87F087F0;
        mul.rn.bf16x2 t0, t0, $3;
        mul.rn.bf16x2 t1, t1, $3;
        mul.rn.bf16x2 $0, t0, $7;
        mul.rn.bf16x2 $1, t1, $7;
        }""",
        constraints="=r,=r,r,r,r,r,r,r,r,r,r", args=[kb, m1, m2], dtype=gl.bfloat16, is_pure=True, pack=4)


@gluon.jit
def _opaque_zero(x):
    """0, computed where it is called: an asm with side effects, so no loop-invariant code motion moves
    what depends on it (the wgmma descriptors of Q) out of the loop into long-lived, spilled registers."""
    return gl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _query(qa, HEADS: gl.constexpr, BLOCK_N: gl.constexpr, HAS_EXTRA: gl.constexpr, HAS_MAIN_LEN: gl.constexpr,
           HAS_EXTRA_LEN: gl.constexpr, SPLIT: gl.constexpr):
    """``program_tiles`` of the arguments every partition gets: (t64, bi, si, head block, split, n_main,
    n_extra, tiles_main, lo, hi)."""
    (main_len_ptr, main_len_sb, main_len_ss, main_topk, extra_len_ptr, extra_len_sb, extra_len_ss, extra_topk,
     s_q, num_splits) = qa
    return program_tiles(main_len_ptr, main_len_sb, main_len_ss, main_topk, extra_len_ptr, extra_len_sb,
                         extra_len_ss, extra_topk, s_q, num_splits, HEADS, 64, BLOCK_N, HAS_EXTRA, HAS_MAIN_LEN,
                         HAS_EXTRA_LEN, SPLIT)


@gluon.jit
def _chunk_keys(ka, bi, si, n_main, n_extra, tiles_main, tile, key0, live, layout: gl.constexpr,
                RAW_KEYS: gl.constexpr, BLOCK_N: gl.constexpr, MAIN_BS: gl.constexpr, EXTRA_BS: gl.constexpr):
    """The keys key0 .. key0 + RAW_KEYS of key tile ``tile`` of the query (in ``layout``): (cache base
    pointer, byte offset of each record's data, element offset of its scale word, valid). A chunk lies in
    one set; nothing is valid when ``live`` is false (a chunk past the end of the query's tiles)."""
    (main_ptr, main_stride, main_cap, main_idx_ptr, stride_mib, stride_mis,
     extra_ptr, extra_stride, extra_cap, extra_idx_ptr, stride_eib, stride_eis) = ka
    in_main = tile < tiles_main
    n = gl.where(in_main, tile, tile - tiles_main) * BLOCK_N + key0 + gl.arange(0, RAW_KEYS, layout=layout)
    n_set = gl.where(live, gl.where(in_main, n_main, n_extra), 0)
    row = gl.where(in_main, main_idx_ptr + bi * stride_mib + si * stride_mis,
                   extra_idx_ptr + bi * stride_eib + si * stride_eis)
    inb = n < n_set
    idx = gl.load(row + n, mask=inb, other=-1)
    valid = inb & (idx >= 0) & (idx < gl.where(in_main, main_cap, extra_cap))
    idx = gl.where(valid, idx, 0)
    # a division by each constant block size, then a select: cheaper than one division by a run-time value
    page = gl.where(in_main, (idx // MAIN_BS).to(gl.int64) * main_stride, (idx // EXTRA_BS).to(gl.int64) * extra_stride)
    off = gl.where(in_main, idx % MAIN_BS, idx % EXTRA_BS).to(gl.int64)
    data = gl.multiple_of(page + off * 576, 16)
    # the 8 scale bytes of a record: one aligned int64 at page + bs * 576 + off * 8 (bytes)
    scal = (page + gl.where(in_main, MAIN_BS * 576, EXTRA_BS * 576) + off * 8) // 8
    base = gl.where(in_main, main_ptr, extra_ptr)
    return base, data, scal, valid


@gluon.jit
def _issue_chunk(ka, qry, g, slot, live, raw_nope, raw_rope, raw_scale, raw_bias,
                 RAW_KEYS: gl.constexpr, BLOCK_N: gl.constexpr, MAIN_BS: gl.constexpr, EXTRA_BS: gl.constexpr,
                 LOAD_WARPS: gl.constexpr):
    """Start the gather of chunk g of this program's tiles into raw slot ``slot`` (cp.async, one group)."""
    bi, si, n_main, n_extra, tiles_main, lo = qry
    CPT: gl.constexpr = BLOCK_N // RAW_KEYS
    tile = lo + g // CPT
    key0 = (g % CPT) * RAW_KEYS
    KW: gl.constexpr = RAW_KEYS // 4           # warps along the keys, the others along the column blocks
    BW: gl.constexpr = LOAD_WARPS // KW
    # NoPE bytes as [8 column blocks, keys, 64]: 16 bytes per copy; block 7 (past the 448 NoPE bytes) is
    # never copied
    LN: gl.constexpr = gl.BlockedLayout([1, 1, 16], [2, 4, 4], [BW, KW, 1], [2, 1, 0])
    LN_K: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, LN))
    base, data, scal, valid = _chunk_keys(ka, bi, si, n_main, n_extra, tiles_main, tile, key0, live, LN_K,
                                          RAW_KEYS, BLOCK_N, MAIN_BS, EXTRA_BS)
    c8 = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, LN)))
    d64 = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, LN)))
    ptr = base + data[None, :, None] + (c8 * 64)[:, None, None] + d64[None, None, :]
    msk = valid[None, :, None] & (c8 < 7)[:, None, None]
    async_copy.async_copy_global_to_shared(raw_nope.index(slot).reshape([8, RAW_KEYS, 64]), ptr, mask=msk)
    # RoPE: 64 bf16 right after the NoPE bytes
    LR: gl.constexpr = gl.BlockedLayout([1, 8 // BW], [4, 8], [KW, BW], [1, 0])
    base, data, scal, valid = _chunk_keys(ka, bi, si, n_main, n_extra, tiles_main, tile, key0, live,
                                          gl.SliceLayout(1, LR), RAW_KEYS, BLOCK_N, MAIN_BS, EXTRA_BS)
    d = gl.arange(0, 64, layout=gl.SliceLayout(0, LR))
    rope = base.to(gl.pointer_type(gl.bfloat16)) + gl.multiple_of((data + 448) // 2, 8)
    async_copy.async_copy_global_to_shared(raw_rope.index(slot), rope[:, None] + d[None, :], mask=valid[:, None])
    # scale words and the per-key bias (0 valid, -inf absent)
    LS: gl.constexpr = gl.BlockedLayout([1], [32], [LOAD_WARPS], [0])
    base, data, scal, valid = _chunk_keys(ka, bi, si, n_main, n_extra, tiles_main, tile, key0, live, LS,
                                          RAW_KEYS, BLOCK_N, MAIN_BS, EXTRA_BS)
    async_copy.async_copy_global_to_shared(raw_scale.index(slot), base.to(gl.pointer_type(gl.int64)) + scal,
                                           mask=valid)
    raw_bias.index(slot).store(gl.where(valid, 0.0, float("-inf")))


@gluon.jit
def _dequant_chunk(raw_nope, raw_rope, raw_scale, raw_bias, rs, k_slot, bias_slot, SUB: gl.constexpr,
                   RAW_KEYS: gl.constexpr, LOAD_WARPS: gl.constexpr):
    """Raw slot rs -> rows [SUB * RAW_KEYS, +RAW_KEYS) of a K slot (bf16 in the natural 448 + 64 order) and
    of its bias row, each with one shared-memory store (few partition barriers)."""
    # [keys, 8 column blocks of 64, 64]: 8 values (one 8-byte read, one 16-byte write) per thread and block;
    # a warp reads 4 keys x 64 contiguous bytes of one block and writes 4 full 128-byte rows: no conflicts
    KW: gl.constexpr = RAW_KEYS // 4
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [4, 1, 8], [KW, LOAD_WARPS // KW, 1], [2, 1, 0])
    kb = raw_nope.index(rs).reshape([8, RAW_KEYS, 64]).permute((1, 0, 2)).load(L3)
    word = raw_scale.index(rs).load(gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    c8 = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    sb = ((word[:, None] >> (8 * c8).to(gl.int64)[None, :]) & 0xFF).to(gl.int32)
    # value * 2^-120 times 2^(byte - 7), as two exact bf16 multiplies: 2^(min(byte, 134) - 7) and
    # 2^(max(byte, 134) - 134) are both representable; a scale byte of 0xFF (a poisoned block) multiplies
    # by NaN. Packed as bf16x2 pairs, one per key and block.
    m1 = (gl.minimum(sb, 134) + 120) << 7
    m2 = gl.where(sb == 255, 0x7FC0, (gl.maximum(sb, 134) - 7) << 7)
    kq = _dequant_e4m3(kb, (m1 | (m1 << 16))[:, :, None], (m2 | (m2 << 16))[:, :, None])
    # block 7 holds the RoPE values (the NoPE bytes it decoded are not the record's)
    rope = raw_rope.index(rs).load(gl.SliceLayout(1, L3))
    k3 = gl.where((c8 < 7)[None, :, None], kq, rope[:, None, :])
    k_slot.slice(SUB * RAW_KEYS, RAW_KEYS, dim=0).store(gl.reshape(k3, [RAW_KEYS, 512]))
    LS: gl.constexpr = gl.BlockedLayout([1], [32], [LOAD_WARPS], [0])
    bias_slot.slice(SUB * RAW_KEYS, RAW_KEYS).store(raw_bias.index(rs).load(LS))


@gluon.jit
def _loader(qa, ka, bufs, bars, HEADS: gl.constexpr, BLOCK_N: gl.constexpr, RAW_KEYS: gl.constexpr,
            RAW_STAGES: gl.constexpr, K_STAGES: gl.constexpr, MAIN_BS: gl.constexpr, EXTRA_BS: gl.constexpr,
            HAS_EXTRA: gl.constexpr, HAS_MAIN_LEN: gl.constexpr, HAS_EXTRA_LEN: gl.constexpr,
            SPLIT: gl.constexpr, LOAD_WARPS: gl.constexpr):
    q_smem, k_ring, k_bias, raw_nope, raw_rope, raw_scale, raw_bias = bufs
    k_ready, k_free, q_ready, turn = bars
    t64, bi, si, hb, sp, n_main, n_extra, tiles_main, lo, hi = _query(qa, HEADS, BLOCK_N, HAS_EXTRA, HAS_MAIN_LEN,
                                                                      HAS_EXTRA_LEN, SPLIT)
    qry = (bi, si, n_main, n_extra, tiles_main, lo)
    CPT: gl.constexpr = BLOCK_N // RAW_KEYS
    n_tiles = gl.maximum(hi - lo, 0)
    n_chunks = n_tiles * CPT
    # chunk g goes to raw slot g % RAW_STAGES; RAW_STAGES - 1 chunks are in flight before the first wait.
    # Every step commits one cp.async group (empty past the last chunk), so "chunk g is done" is always
    # "at most RAW_STAGES - 2 groups pending" at step g.
    for g0 in gl.static_range(RAW_STAGES - 1):
        _issue_chunk(ka, qry, g0, g0, g0 < n_chunks, raw_nope, raw_rope, raw_scale, raw_bias, RAW_KEYS, BLOCK_N,
                     MAIN_BS, EXTRA_BS, LOAD_WARPS)
        async_copy.commit_group()
    for i in range(n_tiles):
        ks = i % K_STAGES
        # slot ks is free once both consumers released its previous tile (fill i // K_STAGES - 1)
        mbarrier.wait(k_free.index(ks), ((i // K_STAGES) & 1) ^ 1)
        k_slot = k_ring.index(ks)
        bias_slot = k_bias.index(ks)
        for sub in gl.static_range(CPT):
            g = i * CPT + sub
            rs = g % RAW_STAGES
            async_copy.wait_group(RAW_STAGES - 2)
            # every loader thread's copies of chunk g have landed, and every thread is done reading
            # chunk g - 1, whose slot the next issue refills
            gl.thread_barrier()
            nx = g + RAW_STAGES - 1
            _issue_chunk(ka, qry, nx, nx % RAW_STAGES, nx < n_chunks, raw_nope, raw_rope, raw_scale, raw_bias,
                         RAW_KEYS, BLOCK_N, MAIN_BS, EXTRA_BS, LOAD_WARPS)
            async_copy.commit_group()
            _dequant_chunk(raw_nope, raw_rope, raw_scale, raw_bias, rs, k_slot, bias_slot, sub, RAW_KEYS,
                           LOAD_WARPS)
        # K rows written by the generic proxy are read by wgmma (async proxy): fence, then one arrive
        # once every loader thread has fenced its stores
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(k_ready.index(ks), count=1)
    async_copy.wait_group(0)


@gluon.jit
def _consumer(qa, oa, bufs, bars, CID: gl.constexpr, HEADS: gl.constexpr, BLOCK_N: gl.constexpr,
              K_STAGES: gl.constexpr, HAS_EXTRA: gl.constexpr, HAS_MAIN_LEN: gl.constexpr,
              HAS_EXTRA_LEN: gl.constexpr, HAS_SINK: gl.constexpr, SPLIT: gl.constexpr, PINGPONG: gl.constexpr):
    q_smem, k_ring, k_bias, raw_nope, raw_rope, raw_scale, raw_bias = bufs
    k_ready, k_free, q_ready, turn = bars
    (q_ptr, stride_qb, stride_qs, stride_qh, sink_ptr, out_ptr, stride_ob, stride_os, stride_oh, lse_ptr,
     part_o_ptr, part_lse_ptr, num_tokens, sm_log2) = oa
    t64, bi, si, hb, sp, n_main, n_extra, tiles_main, lo, hi = _query(qa, HEADS, BLOCK_N, HAS_EXTRA, HAS_MAIN_LEN,
                                                                      HAS_EXTRA_LEN, SPLIT)
    n_tiles = gl.maximum(hi - lo, 0)
    HALF: gl.constexpr = 256
    c0: gl.constexpr = CID * HALF

    # Q columns [c0, c0 + 256) of the 64 heads -> the shared Q tile, 16 bytes per load, 64 columns at a
    # time (few registers)
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    qh = hb * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, QL))
    qc = gl.arange(0, 64, layout=gl.SliceLayout(0, QL))
    q_row = q_ptr + bi * stride_qb + si * stride_qs + qh.to(gl.int64) * stride_qh
    for j in gl.static_range(HALF // 64):
        q_smem.index(0).slice(c0 + 64 * j, 64, dim=1).store(gl.load(q_row[:, None] + (c0 + 64 * j + qc)[None, :]))
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(q_ready, count=1)

    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    acc = gl.zeros([64, HALF], gl.float32, O_L)
    m_i = gl.full([64], float("-inf"), gl.float32, gl.SliceLayout(1, S_L))
    l_i = gl.zeros([64], gl.float32, gl.SliceLayout(1, S_L))
    mbarrier.wait(q_ready, 0)
    for i in range(n_tiles):
        ks = i % K_STAGES
        k_slot = k_ring.index(ks)
        mbarrier.wait(k_ready.index(ks), (i // K_STAGES) & 1)
        if PINGPONG:
            # the S of consumer 0 and consumer 1 alternate (0 on tile i, 1 on tile i, 0 on tile i + 1, ...),
            # so one's softmax and P.V overlap the other's S instead of both idling the tensor cores at once
            if CID == 0:
                mbarrier.wait(turn.index(0), (i + 1) & 1, pred=i > 0)
            else:
                mbarrier.wait(turn.index(1), i & 1)
        s = warpgroup_mma(q_smem.index(_opaque_zero(i)), k_slot.permute((1, 0)),
                          gl.zeros([64, BLOCK_N], gl.float32, S_L), use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s, ))
        if PINGPONG:
            # only an order of tensor-core use: no shared memory is handed over, no partition barrier
            mbarrier.arrive(turn.index(1 - CID), count=1)
        bias = k_bias.index(ks).load(gl.SliceLayout(0, S_L))
        s = s * sm_log2 + bias[None, :]
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        # the accumulator layout of S is the A-operand layout of P.V (16-bit operands): no data movement
        p16 = gl.convert_layout(p.to(gl.bfloat16), P_L, assert_trivial=True)
        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, O_L), assert_trivial=True)
        acc = warpgroup_mma(p16, k_slot.slice(c0, HALF, dim=1), acc * alpha_o[:, None], is_async=True)
        # P.V completes inside the iteration: a wgmma left in flight across the loop's back edge makes ptxas
        # serialize every wgmma of the kernel (its pipeline check counts the kernel-wide register cap). The
        # other consumer keeps the tensor cores busy meanwhile.
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        gl.thread_barrier()
        mbarrier.arrive(k_free.index(ks), count=1)

    empty = l_i == 0.0
    inv_l = gl.where(empty, 0.0, 1.0 / gl.where(empty, 1.0, l_i))
    lse2 = gl.where(empty, float("-inf"), m_i + gl.log2(gl.where(empty, 1.0, l_i)))
    heads = hb * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, S_L))
    oh = hb * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, O_L))
    cols = c0 + gl.arange(0, HALF, layout=gl.SliceLayout(0, O_L))
    if SPLIT:
        base = (sp * num_tokens + t64) * HEADS
        po = part_o_ptr + (base + oh)[:, None] * 512 + cols[None, :]
        gl.store(po, acc * gl.convert_layout(inv_l, gl.SliceLayout(1, O_L), assert_trivial=True)[:, None])
        if CID == 0:
            gl.store(part_lse_ptr + base + heads, lse2)
    else:
        factor = inv_l
        if HAS_SINK:
            sink = gl.load(sink_ptr + heads)
            # exp(lse) / (exp(lse) + exp(sink)) = 1 / (1 + 2^(sink*log2e - lse2))
            factor = gl.where(empty, 0.0, inv_l / (1.0 + gl.exp2(sink * 1.4426950408889634 - lse2)))
        f_o = gl.convert_layout(factor, gl.SliceLayout(1, O_L), assert_trivial=True)
        o_row = out_ptr + bi * stride_ob + si * stride_os + oh.to(gl.int64) * stride_oh
        gl.store(o_row[:, None] + cols[None, :], (acc * f_o[:, None]).to(gl.bfloat16))
        if CID == 0:
            gl.store(lse_ptr + t64 * HEADS + heads, gl.where(empty, float("inf"), lse2 * 0.6931471805599453))


# arguments as _sparse_mla_paged_kernel's; the same ones are left unspecialized
@gluon.jit(do_not_specialize=["main_cap", "extra_cap", "num_tokens", "s_q", "num_splits", "main_len_sb",
                              "main_len_ss", "extra_len_sb", "extra_len_ss"],
           do_not_specialize_on_alignment=["main_len_ptr", "extra_len_ptr"])
def _sparse_mla_ws_kernel(
        q_ptr, stride_qb, stride_qs, stride_qh,
        main_ptr, main_stride, main_cap, main_idx_ptr, stride_mib, stride_mis, main_len_ptr, main_len_sb,
        main_len_ss, main_topk,
        extra_ptr, extra_stride, extra_cap, extra_idx_ptr, stride_eib, stride_eis, extra_len_ptr, extra_len_sb,
        extra_len_ss, extra_topk,
        sink_ptr, out_ptr, stride_ob, stride_os, stride_oh, lse_ptr,
        part_o_ptr, part_lse_ptr, num_tokens, s_q, num_splits, sm_log2,
        MAIN_BS: gl.constexpr, EXTRA_BS: gl.constexpr, HAS_EXTRA: gl.constexpr, HAS_MAIN_LEN: gl.constexpr,
        HAS_EXTRA_LEN: gl.constexpr, HAS_SINK: gl.constexpr, BLOCK_N: gl.constexpr, SPLIT: gl.constexpr,
        HEADS: gl.constexpr, RAW_KEYS: gl.constexpr, RAW_STAGES: gl.constexpr, K_STAGES: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PINGPONG: gl.constexpr, num_warps: gl.constexpr):
    LOAD_WARPS: gl.constexpr = num_warps      # the loader is the default partition
    gl.static_assert(BLOCK_N % RAW_KEYS == 0)
    gl.static_assert(RAW_KEYS % 4 == 0 and LOAD_WARPS % (RAW_KEYS // 4) == 0 and LOAD_WARPS // (RAW_KEYS // 4) <= 4)
    gl.static_assert(RAW_STAGES >= 2)
    KL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    PLAIN1: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    PLAIN2: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [1, 64, 512], KL)
    k_ring = gl.allocate_shared_memory(gl.bfloat16, [K_STAGES, BLOCK_N, 512], KL)
    k_bias = gl.allocate_shared_memory(gl.float32, [K_STAGES, BLOCK_N], PLAIN1)
    raw_nope = gl.allocate_shared_memory(gl.uint8, [RAW_STAGES, 8 * RAW_KEYS, 64], PLAIN2)
    raw_rope = gl.allocate_shared_memory(gl.bfloat16, [RAW_STAGES, RAW_KEYS, 64], PLAIN2)
    raw_scale = gl.allocate_shared_memory(gl.int64, [RAW_STAGES, RAW_KEYS], PLAIN1)
    raw_bias = gl.allocate_shared_memory(gl.float32, [RAW_STAGES, RAW_KEYS], PLAIN1)
    k_ready = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    k_free = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(K_STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(k_free.index(s), count=2)
    mbarrier.init(q_ready, count=2)
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)

    bufs = (q_smem, k_ring, k_bias, raw_nope, raw_rope, raw_scale, raw_bias)
    bars = (k_ready, k_free, q_ready, turn)
    qa = (main_len_ptr, main_len_sb, main_len_ss, main_topk, extra_len_ptr, extra_len_sb, extra_len_ss, extra_topk,
          s_q, num_splits)
    ka = (main_ptr, main_stride, main_cap, main_idx_ptr, stride_mib, stride_mis,
          extra_ptr, extra_stride, extra_cap, extra_idx_ptr, stride_eib, stride_eis)
    oa = (q_ptr, stride_qb, stride_qs, stride_qh, sink_ptr, out_ptr, stride_ob, stride_os, stride_oh, lse_ptr,
          part_o_ptr, part_lse_ptr, num_tokens, sm_log2)
    # the loader gets what the consumers leave of the kernel's register cap (65536 / 384 threads -> 168):
    # 3 * 168 - 2 * CONSUMER_REGS per thread
    gl.warp_specialize([
        (_loader, (qa, ka, bufs, bars, HEADS, BLOCK_N, RAW_KEYS, RAW_STAGES, K_STAGES, MAIN_BS, EXTRA_BS, HAS_EXTRA,
                   HAS_MAIN_LEN, HAS_EXTRA_LEN, SPLIT, LOAD_WARPS)),
        (_consumer, (qa, oa, bufs, bars, 0, HEADS, BLOCK_N, K_STAGES, HAS_EXTRA, HAS_MAIN_LEN, HAS_EXTRA_LEN,
                     HAS_SINK, SPLIT, PINGPONG)),
        (_consumer, (qa, oa, bufs, bars, 1, HEADS, BLOCK_N, K_STAGES, HAS_EXTRA, HAS_MAIN_LEN, HAS_EXTRA_LEN,
                     HAS_SINK, SPLIT, PINGPONG)),
    ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


# ---- launch ----------------------------------------------------------------------------------------------
def default_config() -> dict:
    """The H100 defaults: 64-key tiles, two K slots, gathers in 16-key chunks three deep, the consumers at
    200 registers (the loader gets 104), no spills (compile matrix)."""
    return dict(BLOCK_N=64, RAW_KEYS=16, RAW_STAGES=3, K_STAGES=2, CONSUMER_REGS=200, PINGPONG=False, num_warps=4)


CONFIG_KEYS = tuple(default_config())


@functools.lru_cache(maxsize=1024)
def constexprs(cfg_items: tuple, h: int, main_bs: int, extra_bs: int, has_extra: bool, has_len: bool,
               has_extra_len: bool, has_sink: bool, split: bool) -> dict:
    """The kernel's constexprs and launch options for a config (items of a ``sparse_mla_decode`` plan)."""
    cfg = dict(cfg_items)
    return dict(MAIN_BS=main_bs, EXTRA_BS=extra_bs, HAS_EXTRA=has_extra, HAS_MAIN_LEN=has_len,
                HAS_EXTRA_LEN=has_extra_len, HAS_SINK=has_sink, SPLIT=split, HEADS=h,
                **{k: cfg[k] for k in CONFIG_KEYS})


def _matrix_constexprs(arch, split=False):
    return dict(MAIN_BS=64 if split else 256, EXTRA_BS=2 if split else 64, HAS_EXTRA=True, HAS_MAIN_LEN=True,
                HAS_EXTRA_LEN=True, HAS_SINK=True, SPLIT=split, HEADS=64,
                **{k: v for k, v in default_config().items() if k != "num_warps"})


# entries of the CPU compile matrix (build_tools/compile_matrix.py): sm_90a only (wgmma, setmaxnreg)
COMPILE_SPECS = [
    dict(name="sparse_mla_decode_ws", fn=_sparse_mla_ws_kernel, pointers=DECODE_POINTERS, floats=("sm_log2",),
         constexprs=_matrix_constexprs, options=lambda arch: dict(num_warps=default_config()["num_warps"]),
         matrix=True, fp8_convert=True, targets=("sm_90a",), wgmma_pipelined=True),
    dict(name="sparse_mla_decode_ws[split]", fn=_sparse_mla_ws_kernel, pointers=DECODE_POINTERS, floats=("sm_log2",),
         constexprs=lambda arch: _matrix_constexprs(arch, split=True),
         options=lambda arch: dict(num_warps=default_config()["num_warps"]), matrix=True, fp8_convert=True,
         targets=("sm_90a",), wgmma_pipelined=True),
]
