"""Index metadata ops in vLLM's call forms (dsv4_rocm/ops/metadata.py).

* hand-built expectations and the checks of vLLM's own tests of these ops, ported;
* padding and garbage: padding tokens get -1 / 0, and a lookup that fails (request id, position, column,
  page, local index, a slot an int32 output cannot hold) is padding with the same answer on every path
  (the oracle, the public op with its value checks, the kernels): never another request's rows, never an
  error; a batch that contradicts itself is rejected before a byte is written (value checks on CPU);
* property tests on random batches with padding against per-token loops written here from the math;
* the Triton kernels under TRITON_INTERPRET=1 (a subprocess, CPU) and on the GPU, equal to the oracle
  on random garbage too, and captured into a CUDA graph for the decode step.
"""
import pytest
import torch

from helpers import patch_interpreter_scalars, run_file_interpreted
from hypothesis import HealthCheck, given, settings, strategies as st

from dsv4_rocm import ops
from dsv4_rocm.reference import metadata as M

I32 = torch.int32
POISON = -777


def i32(x):
    return torch.tensor(x, dtype=I32)


# ------------------------------------------------------------------------------------------------ per-token loops
# Independent oracles: vLLM's semantics written as plain loops over valid batches (the reference module is
# vectorized); padding rows are -1 / 0.
def loop_compressed_slots(num_tokens, qsl, seq, bt, bs, r, world=1, rank=0, inter=1):
    out = [-1] * num_tokens
    for b in range(bt.shape[0]):
        qs, qe = int(qsl[b]), int(qsl[b + 1])
        for i in range(qe - qs):
            p = int(seq[b]) - (qe - qs) + i
            if (p + 1) % r:
                continue
            blk, voff = divmod(p // r, bs * world)
            if (voff // inter) % world == rank:
                out[qs + i] = int(bt[b, blk]) * bs + (voff // (world * inter)) * inter + voff % inter
    return out


def loop_compressed_slots_033(num_tokens, slots, qsl, seq, bt, bs, r, dcp=1, inter=1):
    """vLLM 0.33's rule: only tokens with a slot of their own (not the padding mark -1); under DCP the rank-local
    position compressed."""
    out = [-1] * num_tokens
    for b in range(bt.shape[0]):
        qs, qe = int(qsl[b]), int(qsl[b + 1])
        for i in range(qe - qs):
            p = int(seq[b]) - (qe - qs) + i
            if (p + 1) % r or int(slots[qs + i]) == -1:
                continue
            j = ((p // (inter * dcp)) * inter + p % inter) // r
            out[qs + i] = int(bt[b, j // bs]) * bs + j % bs
    return out


def loop_swa(W, qsl, seq, t2r, valid, bt, bs, tokens):
    rows, lens = [], []
    for t in tokens:
        row = []
        if valid[t]:
            b = int(t2r[t])
            qs, qe = int(qsl[b]), int(qsl[b + 1])
            p = int(seq[b]) - (qe - qs) + t - qs
            row = [int(bt[b, q // bs]) * bs + q % bs for q in range(max(0, p - W + 1), p + 1)]
        rows.append(row + [-1] * (W - len(row)))
        lens.append(len(row))
    return rows, lens


def loop_global_topk(topk, t2r, bt, bs, valid):
    rows, lens = [], []
    for t in range(topk.shape[0]):
        row = [int(bt[int(t2r[t]), l // bs]) * bs + l % bs for l in topk[t].tolist() if l >= 0] if valid[t] else []
        rows.append(row + [-1] * (topk.shape[1] - len(row)))
        lens.append(len(row))
    return rows, lens


def loop_c128a(pos, r, nd, t2r, bt, bs, sm, width, cap):
    gd, dl, pf = [], [], []
    for t, p in enumerate(pos.tolist()):
        n = min(max((p + 1) // r, 0), cap)
        if t < nd:
            n = n if sm[t] >= 0 else 0
            b = int(t2r[t])
            gd.append([int(bt[b, i // bs]) * bs + i % bs for i in range(n)] + [-1] * (width - n))
            dl.append(n)
        else:
            pf.append(list(range(n)) + [-1] * (width - n))
    return gd, dl, pf


def loop_combine(topk, qsl, seq, gl, W, r, k, Mrows, N, width, left=None, right=None):
    """combine_topk_swa_indices token by token: the window of a token at p is [p - max(l, W - 1), p + r] cut at
    position 0 and at the first gathered position (l, r: its in-image visibility, 0 without), its rows past
    the gathered ones -1."""
    rows, lens = [[-1] * width for _ in range(topk.shape[0])], [0] * topk.shape[0]
    base = int(qsl[0])
    for b in range(seq.shape[0]):
        qs, qe = int(qsl[b]) - base, int(qsl[b + 1]) - base
        gstart = int(seq[b]) - int(gl[b])
        for t in range(qs, qe):
            p = int(seq[b]) - (qe - qs) + t - qs
            lv = 0 if left is None else max(int(left[t]), 0)
            rv = 0 if right is None else max(int(right[t]), 0)
            start = max(p - max(lv, W - 1), 0, gstart)
            tl_ = min((p + 1) // r, k)
            sw = max(min(p + rv + 1 - start, width - tl_), 0)
            loc = [int(x) for x in topk[t, :tl_]]
            rows[t][:tl_] = [b * Mrows + x if x >= 0 else -1 for x in loc]
            rows[t][tl_:tl_ + sw] = [b * Mrows + N + q - gstart if 0 <= q - gstart < int(gl[b])
                                     and N + q - gstart < Mrows else -1 for q in range(start, start + sw)]
            lens[t] = tl_ + sw
    return rows, lens


# ------------------------------------------------------------------------------------------------ random batches
def random_batch(seed, max_reqs=5, max_q=6, max_prefix=400, pad_tokens=3, pad_reqs=1, bs=64):
    """A consistent step with padding as engines make it: padded requests (query 0, seq 0), tokens past
    the last request (token_to_req -1, slot -1), some real tokens invalid (slot -1). Block-table columns
    that no token needs are -1 (garbage a kernel must not read)."""
    g = torch.Generator().manual_seed(seed)
    R = int(torch.randint(0, max_reqs + 1, (), generator=g))
    qlens = torch.randint(0, max_q + 1, (R,), generator=g)
    seq = torch.randint(0, max_prefix + 1, (R,), generator=g) + qlens
    qlens = torch.cat([qlens, torch.zeros(pad_reqs, dtype=torch.long)])
    seq = torch.cat([seq, torch.zeros(pad_reqs, dtype=torch.long)])
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), qlens.cumsum(0)])
    Treal = int(qsl[-1])
    T = Treal + pad_tokens
    t2r = torch.full((T,), -1, dtype=torch.long)
    t2r[:Treal] = torch.repeat_interleave(torch.arange(R + pad_reqs), qlens)
    valid = torch.zeros(T, dtype=torch.bool)
    valid[:Treal] = torch.rand(Treal, generator=g) < 0.85
    pos = torch.randint(-3, 3, (T,), generator=g)                     # padding tokens: garbage positions
    if Treal:
        r = t2r[:Treal]
        pos[:Treal] = seq[r] - qlens[r] + torch.arange(Treal) - qsl[r]
    cols = max(1, (int(seq.max()) + bs - 1) // bs + 1) if seq.numel() else 1
    nreq = R + pad_reqs
    bt = torch.randperm(nreq * cols + 7, generator=g)[:nreq * cols].view(nreq, cols)
    need = torch.zeros(nreq, cols, dtype=torch.bool)
    for b in range(nreq):
        need[b, :(int(seq[b]) + bs - 1) // bs] = True
    bt = torch.where(need, bt, torch.full_like(bt, -1))
    return dict(R=nreq, qsl=qsl.to(I32), seq=seq.to(I32), T=T, Treal=Treal, t2r=t2r.to(I32), valid=valid,
                pos=pos, slot=torch.where(valid, torch.arange(T), torch.full((T,), -1)), bt=bt.to(I32), g=g)


def snapshot(*ts):
    return [t.clone() for t in ts]


def unchanged(before, *ts):
    return all(torch.equal(a, b) for a, b in zip(before, ts))


# ------------------------------------------------------------------------------------------------ hand-built
BT = i32([[7, 2, 9], [4, 0, 5]])   # request -> physical pages


def test_token_to_req_and_slot_mapping():
    assert M.token_to_req_indices(torch.tensor([0, 3, 3, 5])).tolist() == [0, 0, 0, 2, 2]
    s = M.slot_mapping_from_block_table(torch.tensor([0, 63, 64, -1, 200]), torch.tensor([1, 1, 1, 1, 1]), BT, 64)
    assert s.tolist() == [4 * 64, 4 * 64 + 63, 0, -1, -1]     # -1 / past the table: no slot, never wrapped


def test_compressed_slot_mapping_by_hand():
    # request 0: positions 0..7 (seq 8); request 1: positions 252..259 (seq 260)
    qsl, seq = i32([0, 8, 16]), i32([8, 260])
    s = ops.get_compressed_slot_mapping(16, qsl, seq, BT, 64, 4)
    assert s.dtype == torch.int64
    assert s.tolist() == [-1, -1, -1, 7 * 64, -1, -1, -1, 7 * 64 + 1] + [-1, -1, -1, 4 * 64 + 63, -1, -1, -1, 0 * 64]
    s = ops.get_compressed_slot_mapping(16, qsl, seq, BT, 2, 128)
    assert s.tolist() == [-1] * 11 + [4 * 2 + 1] + [-1] * 4      # position 255 -> entry 1 of request 1
    # context parallelism: 2 ranks, interleave 1: entry j on rank j % 2 at local offset j // 2
    s0 = ops.get_compressed_slot_mapping(16, qsl, seq, BT, 32, 4, cp_world_size=2, cp_rank=0)
    s1 = ops.get_compressed_slot_mapping(16, qsl, seq, BT, 32, 4, cp_world_size=2, cp_rank=1)
    assert s0.tolist() == [-1, -1, -1, 7 * 32, -1, -1, -1, -1] + [-1, -1, -1, -1, -1, -1, -1, 0 * 32]
    assert s1.tolist() == [-1] * 7 + [7 * 32] + [-1, -1, -1, 4 * 32 + 31, -1, -1, -1, -1]
    assert s0.tolist() == loop_compressed_slots(16, qsl, seq, BT, 32, 4, 2, 0)
    assert s1.tolist() == loop_compressed_slots(16, qsl, seq, BT, 32, 4, 2, 1)


def test_compressed_slot_mapping_vllm_033_form():
    """vLLM 0.33 passes the tokens' own slot_mapping second: a replayed token (slot -1) writes no compressed
    entry. Both forms are taken, positionally and by keyword; where every token has a slot they agree."""
    qsl, seq = i32([0, 8, 16]), i32([8, 260])
    old = ops.get_compressed_slot_mapping(16, qsl, seq, BT, 64, 4)
    slots = torch.arange(16) + 1000
    assert ops.get_compressed_slot_mapping(16, slots, qsl, seq, BT, 64, 4).tolist() == old.tolist()
    slots[[3, 11]] = -1                                       # tokens at positions 3 and 255: replayed
    want = old.clone()
    want[[3, 11]] = -1
    out = torch.full((18,), POISON, dtype=torch.int64)
    calls = [lambda: ops.get_compressed_slot_mapping(16, slots, qsl, seq, BT, 64, 4),
             lambda: ops.get_compressed_slot_mapping(16, slots, qsl, seq, BT, 64, 4, out, 1, 1),
             lambda: ops.get_compressed_slot_mapping(num_tokens=16, slot_mapping=slots, query_start_loc=qsl,
                                                     seq_lens=seq, block_table=BT, block_size=64, compress_ratio=4,
                                                     out=out, dcp_world_size=1, cp_interleave=1),
             lambda: M.get_compressed_slot_mapping(16, qsl, seq, BT, 64, 4, slot_mapping=slots)]
    for call in calls:
        assert call().tolist() == want.tolist()
    assert (out[16:] == -1).all()
    assert want.tolist() == loop_compressed_slots_033(16, slots, qsl, seq, BT, 64, 4)
    # the earlier form by keyword and with out= by keyword, positionally with CP
    assert ops.get_compressed_slot_mapping(16, query_start_loc=qsl, seq_lens=seq, block_table=BT, block_size=64,
                                           compress_ratio=4).tolist() == old.tolist()
    assert ops.get_compressed_slot_mapping(16, qsl, seq, BT, 64, 4, out=out).data_ptr() == out.data_ptr()
    assert ops.get_compressed_slot_mapping(16, qsl, seq, BT, 32, 4, None, 2, 1).tolist() == \
        loop_compressed_slots(16, qsl, seq, BT, 32, 4, 2, 1)


def test_compressed_slot_mapping_dcp_over_positions():
    """vLLM 0.33's DCP: 2 ranks, interleave 4 (a multiple of the ratio): rank 0 owns positions p with
    (p // 4) % 2 == 0 (the others have slot -1 in its slot_mapping) and compresses its local positions
    (p // 8) * 4 + p % 4, so its entries are consecutive: 0, 1, 2, 3 for positions 3, 11, 19, 27."""
    qsl, seq, bt = i32([0, 32]), i32([32]), i32([[6, 9]])
    p = torch.arange(32)
    own = torch.where((p // 4) % 2 == 0, p + 100, -1)
    s = ops.get_compressed_slot_mapping(32, own, qsl, seq, bt, 2, 4, None, 2, 4)
    want = [-1] * 32
    want[3], want[11], want[19], want[27] = 6 * 2 + 0, 6 * 2 + 1, 9 * 2 + 0, 9 * 2 + 1
    assert s.tolist() == want == loop_compressed_slots_033(32, own, qsl, seq, bt, 2, 4, 2, 4)


NEITHER = "not a call of either of vLLM's forms"


@pytest.mark.parametrize("call, match", [
    (lambda: ops.get_compressed_slot_mapping(4, i32([0, 4]), i32([4]), BT[:1], 64, 4, dcp_world_size=2), NEITHER),
    (lambda: ops.get_compressed_slot_mapping(4, torch.zeros(4, dtype=torch.long), i32([0, 4]), i32([4]), BT[:1], 64,
                                             4, cp_rank=0), NEITHER),
    (lambda: ops.get_compressed_slot_mapping(4, i32([0, 4]), i32([4]), BT[:1], 64, 4, None, 2, cp_world_size=2),
     NEITHER),
    (lambda: ops.get_compressed_slot_mapping(4, query_start_loc=i32([0, 4]), seq_lens=i32([4]), block_size=64,
                                             compress_ratio=4), NEITHER + ".*missing a required argument"),
    (lambda: ops.get_compressed_slot_mapping(4, i32([0, 4]), i32([4]), BT[:1], 64.0, 4), NEITHER),
    (lambda: ops.get_compressed_slot_mapping(4, torch.zeros(4, dtype=torch.long), i32([0, 4]), i32([4]), BT[:1], 64,
                                             4, None, 0), "dcp_world_size must be a positive int"),
    (lambda: ops.get_compressed_slot_mapping(4, torch.zeros(4, 1, dtype=torch.long), i32([0, 4]), i32([4]), BT[:1],
                                             64, 4), "slot_mapping"),
])
def test_compressed_slot_mapping_forms_are_not_mixed(call, match):
    """A call that mixes the two forms, or fits neither, is a ValueError saying why for each form."""
    with pytest.raises(ValueError, match=match):
        call()


def test_compressed_slot_mapping_shows_vllm_033_parameters():
    import inspect
    names = tuple(inspect.signature(ops.get_compressed_slot_mapping).parameters)
    assert names[:10] == ("num_tokens", "slot_mapping", "query_start_loc", "seq_lens", "block_table", "block_size",
                          "compress_ratio", "out", "dcp_world_size", "cp_interleave")


def num_states_case():
    """vLLM's test_indexer_builder_deepseek_v4_compressed_slot_mapping_uses_num_states, at the op: C4 with 256-
    token pages (64 states each), 240 tokens cached, a 40-token chunk: states 60..69 cross from page 5 into
    page 7. The builder passes a dummy slot_mapping of -123s: only -1 (vLLM's PAD_SLOT_ID) is padding, so
    every token keeps its state."""
    args = (40, torch.full((40,), -123, dtype=torch.int64), i32([0, 40]), i32([280]), i32([[5, 7]]), 64, 4)
    want = [-1] * 40
    for i in range(40):
        p = 240 + i
        if (p + 1) % 4 == 0:
            want[i] = (5 if p // 4 < 64 else 7) * 64 + (p // 4) % 64
    return args, want


def test_compressed_slot_mapping_only_minus_one_is_padding():
    """A slot other than -1, even negative, is the token's own (vLLM's kernel compares with PAD_SLOT_ID);
    it used to count as padding (< 0), leaving vLLM's indexer builder with no compressed slot at all."""
    args, want = num_states_case()
    assert [w for w in want if w >= 0] == [5 * 64 + j for j in range(60, 64)] + [7 * 64 + j for j in range(6)]
    out = torch.full((44,), POISON, dtype=torch.int64)
    assert ops.get_compressed_slot_mapping(*args, out=out).tolist() == want and (out[40:] == -1).all()
    assert M.get_compressed_slot_mapping(*args[:1], *args[2:], slot_mapping=args[1],
                                         cp_over_positions=True).tolist() == want
    slots = args[1].clone()
    slots[[3, 19]] = -1                                       # padding: positions 243 and 259 write nothing
    want[3] = want[19] = -1
    assert ops.get_compressed_slot_mapping(args[0], slots, *args[2:]).tolist() == want


@pytest.mark.gpu
def test_compressed_slot_mapping_only_minus_one_is_padding_on_gpu():
    args, want = num_states_case()
    ka = _to(args, "cuda")
    got = kernel_of("get_compressed_slot_mapping")(ka[0], *ka[2:], slot_mapping=ka[1], cp_over_positions=True)
    assert got.cpu().tolist() == want


def test_compressed_slot_mapping_vllm_storage_block_boundary():
    """vLLM's test: C4 with the storage block size 256 / 4, positions 252..259 cross into page 7."""
    s = ops.get_compressed_slot_mapping(8, i32([0, 8]), i32([260]), i32([[5, 7]]), 64, 4)
    assert s.tolist() == [-1, -1, -1, 5 * 64 + 63, -1, -1, -1, 7 * 64]


@pytest.mark.parametrize("ratio", [4, 128])
@pytest.mark.parametrize("context, decode_len, batch", [(8192, 1, 1), (8192, 8, 4), (32768, 1, 4)])
def test_compressed_slot_mapping_vllm_model_contract(ratio, context, decode_len, batch):
    """vLLM's contract test: out longer than num_tokens, poisoned; returned view aliases out; the tail -1."""
    bs = 256 // ratio
    nblk = ((context + decode_len + ratio - 1) // ratio + bs - 1) // bs
    qsl = torch.arange(batch + 1, dtype=I32) * decode_len
    seq = torch.full((batch,), context + decode_len, dtype=I32)
    bt = (torch.arange(batch * nblk, dtype=I32).view(batch, nblk) + 1000 + torch.arange(batch, dtype=I32)[:, None] *
          (nblk + 11))
    n = batch * decode_len
    out = torch.full((n + 13,), POISON, dtype=torch.int64)
    got = ops.get_compressed_slot_mapping(n, qsl, seq, bt, bs, ratio, out=out)
    assert got.data_ptr() == out.data_ptr() and got.shape == (n,)
    assert got.tolist() == loop_compressed_slots(n, qsl, seq, bt, bs, ratio)
    assert (out[n:] == -1).all()


def test_swa_indices_by_hand():
    # request 0: one token at position 0; request 1: tokens at positions 64, 65 (seq 66), across pages 4 -> 0
    qsl, seq, t2r = i32([0, 1, 3]), i32([1, 66]), i32([0, 1, 1])
    idx = torch.full((3, 1, 4), POISON, dtype=I32)
    lens = torch.full((3,), POISON, dtype=I32)
    got_i, got_l = ops.compute_swa_indices_and_lens(idx, lens, 4, qsl, seq, t2r, torch.tensor([True, True, True]), BT,
                                                    64)
    assert got_i.data_ptr() == idx.data_ptr() and got_l.data_ptr() == lens.data_ptr()
    assert lens.tolist() == [1, 4, 4]
    assert idx[:, 0].tolist() == [[7 * 64, -1, -1, -1], [4 * 64 + 61, 4 * 64 + 62, 4 * 64 + 63, 0],
                                  [4 * 64 + 62, 4 * 64 + 63, 0, 1]]
    ops.compute_swa_indices_and_lens(idx, lens, 4, qsl, seq, t2r, torch.tensor([True, False, True]), BT, 64)
    assert lens.tolist() == [1, 0, 4] and idx[1, 0].tolist() == [-1] * 4      # padding token: -1 / 0
    # vLLM's prefill use: token_offset into the batch, rows from 0
    idx2, lens2 = torch.full((2, 128), POISON, dtype=I32), torch.full((2,), POISON, dtype=I32)
    ops.compute_swa_indices_and_lens(idx2, lens2, 128, qsl, seq, t2r, torch.tensor([1, 1, 1]), BT, 64, token_offset=1)
    assert lens2.tolist() == [65, 66]
    assert idx2[1, :66].tolist() == [4 * 64 + q for q in range(64)] + [0, 1]
    assert (idx2[0, 65:] == -1).all()


def test_swa_vllm_constant_lens_and_invalid_rows():
    """vLLM's full-cudagraph test: constant lens = W, a padding token's row all -1."""
    args = (4, i32([0, 1, 2, 3]), i32([1, 2, 10]), i32([0, 1, 2]), torch.tensor([True, True, False]),
            i32([[10, 11], [20, 21], [30, 31]]), 8)
    for constant, want in ((False, [1, 2, 0]), (True, [4, 4, 4])):
        idx, lens = torch.full((3, 1, 4), 123, dtype=I32), torch.empty(3, dtype=I32)
        ops.compute_swa_indices_and_lens(idx, lens, *args, needs_constant_topk=constant)
        assert lens.tolist() == want
        assert idx[:, 0].tolist() == [[80, -1, -1, -1], [160, 161, -1, -1], [-1] * 4]


def test_swa_respects_output_row_stride():
    """vLLM's test: rows of a strided view are written, the storage between them is not."""
    storage = torch.full((3, 2, 4), POISON, dtype=I32)
    lens = torch.empty(3, dtype=I32)
    ops.compute_swa_indices_and_lens(storage[:, 1, :], lens, 4, i32([0, 1, 3]), i32([1, 66]), i32([0, 1, 1]),
                                     torch.ones(3, dtype=torch.bool), BT, 64)
    assert (storage[:, 0] == POISON).all() and storage[0, 1].tolist() == [7 * 64, -1, -1, -1]


def test_prefill_gather_lens():
    # 2 decodes, then prefills: query 3 of seq 10 (prefix 7), query 5 of seq 5, a padding request (0, 0)
    qsl, seq = i32([0, 1, 2, 5, 10, 10]), i32([50, 60, 10, 5, 0])
    out = torch.full((4,), POISON, dtype=I32)
    got = ops.compute_prefill_gather_lens(out, seq, qsl, 3, 2, 4)
    assert got.data_ptr() == out.data_ptr() and got.tolist() == [3 + 3, 5 + 0, 0] and out[3] == POISON
    assert ops.compute_prefill_gather_lens(out, seq, qsl, 3, 2, 128).tolist() == [10, 5, 0]


def test_global_topk_by_hand():
    loc = i32([[0, 65, -1, 3], [130, -1, -1, -1]])
    g, lens = ops.compute_global_topk_indices_and_lens(loc, i32([0, 1]), BT, 64, torch.tensor([True, False]))
    assert g.dtype == I32 and g.tolist() == [[7 * 64, 2 * 64 + 1, 7 * 64 + 3, -1], [-1] * 4]
    assert lens.tolist() == [3, 0]
    out, ln = torch.full((2, 4), POISON, dtype=I32), torch.full((2,), POISON, dtype=I32)
    res = ops.compute_global_topk_indices_and_lens(loc, i32([0, 1]), BT, 64, torch.tensor([True, True]), (out, ln))
    assert res[0].data_ptr() == out.data_ptr() and ln.tolist() == [3, 1] and out[1].tolist() == [5 * 64 + 2, -1, -1, -1]


def test_global_topk_vllm_constant_lens():
    """vLLM's full-cudagraph test (block size 8, one page)."""
    loc = i32([[0, 2, -1, -1], [0, -1, -1, -1], [0, 1, 2, 3]])
    args = (loc, torch.zeros(3, dtype=I32), i32([[10]]), 8, torch.tensor([True, False, True]))
    assert ops.compute_global_topk_indices_and_lens(*args)[1].tolist() == [2, 0, 4]
    assert ops.compute_global_topk_indices_and_lens(*args, needs_constant_topk=True)[1].tolist() == [4, 4, 4]


# vLLM's bounds regression for compute_global_topk_indices_and_lens (block size 64): each case is
# (topk rows, token_to_req, block_table, expected rows, expected lens); an invalid request or column
# becomes -1, never counts, never reads another request's row; valid entries are packed to the front.
GLOBAL_BOUNDS = {
    "valid": ([[0, 64, -1, -1]], [0], [[10, 11, 12, 13]], [[640, 704, -1, -1]], [2]),
    "req == rows": ([[0, -1, -1, -1]], [1], [[10, 11, 12, 13]], [[-1] * 4], [0]),
    "req > rows": ([[0, -1, -1, -1]], [5], [[10, 11]], [[-1] * 4], [0]),
    "req < 0": ([[0, -1, -1, -1]], [-1], [[10, 11, 12, 13]], [[-1] * 4], [0]),
    "column == cols": ([[128, -1, -1, -1]], [0], [[10, 11]], [[-1] * 4], [0]),
    "column > cols": ([[256, -1, -1, -1]], [0], [[10, 11]], [[-1] * 4], [0]),
    "negative local": ([[-5, -1, -1, -1]], [0], [[10, 11, 12, 13]], [[-1] * 4], [0]),
    "second row past the table": ([[0, -1, -1, -1], [0, -1, -1, -1]], [0, 1], [[10, 11, 12, 13]],
                                  [[640, -1, -1, -1], [-1] * 4], [1, 0]),
    "column oob beside a valid one": ([[0, 128, -1, -1]], [0], [[10, 11]], [[640, -1, -1, -1]], [1]),
    "invalid before valid packs left": ([[128, 64, -1, -1]], [0], [[10, 11]], [[704, -1, -1, -1]], [1]),
    "padded block-table rows": ([[0, -1, -1, -1], [64, -1, -1, -1]], [0, 1], [[10, 11, 12, 13], [90, 91, 92, 93]],
                                [[640, -1, -1, -1], [91 * 64, -1, -1, -1]], [1, 1]),
    "prefill multi-request": ([[0, -1, -1, -1], [0, -1, -1, -1], [64, -1, -1, -1]], [0, 1, 1], [[10, 11], [20, 21]],
                              [[640, -1, -1, -1], [1280, -1, -1, -1], [21 * 64, -1, -1, -1]], [1, 1, 1]),
    "negative page": ([[0, 64, -1, -1]], [0], [[-1, 11]], [[704, -1, -1, -1]], [1]),
}


@pytest.mark.parametrize("case", list(GLOBAL_BOUNDS))
def test_global_topk_vllm_bounds_regression(case):
    """vLLM's answer (-1, length 0) on every path: the oracle, and the public op with its value checks on
    (CPU tensors; validation("full") too), which used to raise for a request or column past the table."""
    loc, t2r, bt, rows, lens = GLOBAL_BOUNDS[case]
    args = (i32(loc), i32(t2r), i32(bt), 64, torch.ones(len(loc), dtype=torch.bool))
    g, ln = M.compute_global_topk_indices_and_lens(*args)
    assert g.tolist() == rows and ln.tolist() == lens
    for level in ("auto", "full"):
        with ops.validation(level):
            g, ln = ops.compute_global_topk_indices_and_lens(*args)
        assert g.tolist() == rows and ln.tolist() == lens, level


def test_global_topk_logical_columns_not_row_stride():
    """vLLM's test: the column bound is shape[1], not the row stride of a sliced table."""
    bt = i32([[10, 11, 12]])[:, :2]
    g, ln = M.compute_global_topk_indices_and_lens(i32([[128, -1, -1, -1]]), i32([0]), bt, 64, torch.tensor([True]))
    assert g.tolist() == [[-1] * 4] and ln.tolist() == [0]


def test_c128a_vllm_example():
    """vLLM's full-cudagraph test: 3 decode tokens (one padding), one prefill token, width 8."""
    pos, bt, sm = torch.tensor([0, 127, 511, 255]), i32([[5, 7, 11, 13]]), torch.tensor([0, -1, 2, 3])
    for constant, want in ((False, [0, 0, 4]), (True, [8, 8, 8])):
        gd, dl, pf = (torch.full((3, 8), POISON, dtype=I32), torch.full((3,), POISON, dtype=I32),
                      torch.full((1, 8), POISON, dtype=I32))
        g, l, p = ops.build_c128a_topk_metadata(pos, 128, 3, torch.zeros(4, dtype=I32), bt, 2, sm, gd, dl, pf,
                                                max_compressed_tokens=8, needs_constant_topk=constant)
        assert g.data_ptr() == gd.data_ptr() and l.data_ptr() == dl.data_ptr() and p.data_ptr() == pf.data_ptr()
        assert l.tolist() == want
        assert g.tolist() == [[-1] * 8, [-1] * 8, [10, 11, 14, 15, -1, -1, -1, -1]]
        assert p.tolist() == [[0, 1, -1, -1, -1, -1, -1, -1]]


def test_c128a_by_hand_and_max_seq_len():
    pos = torch.tensor([126, 127, 300, 300, 1000])
    t2r, sm = i32([0, 0, 1, 1, 1]), torch.tensor([1, 1, 1, -1, 5])
    gd, dl, pf = torch.full((8, 256), POISON, dtype=I32), torch.full((8,), POISON, dtype=I32), \
        torch.full((8, 256), POISON, dtype=I32)
    g, l, p = ops.build_c128a_topk_metadata(pos, 128, 4, t2r, BT, 2, sm, gd, dl, pf, 256)
    assert g.shape == (4, 256) and p.shape == (1, 256) and l.tolist() == [0, 1, 2, 0]
    assert g[1, :2].tolist() == [7 * 2, -1] and g[2, :3].tolist() == [4 * 2, 4 * 2 + 1, -1] and (g[3] == -1).all()
    assert p[0, :8].tolist() == [0, 1, 2, 3, 4, 5, 6, -1]
    assert (gd[4:] == POISON).all() and (dl[4:] == POISON).all() and (pf[1:] == POISON).all()
    # later vLLM: max_seq_len narrows the slices to the 128-aligned width the longest sequence needs
    g, l, p = ops.build_c128a_topk_metadata(pos, 128, 4, t2r, BT, 2, sm, gd, dl, pf, 256, max_seq_len=1001)
    assert g.shape == (4, 128) and p.shape == (1, 128)
    assert M.c128a_effective_width(1001, 128, 256) == 128 and M.c128a_effective_width(0, 128, 256) == 0
    assert M.c128a_effective_width(100, 128, 256) == 128 and M.c128a_effective_width(10 ** 6, 128, 256) == 256
    assert M.c128_max_entries(1048576) == 8192


def test_c128a_vllm_adaptive_width_has_capture_stable_stride():
    """vLLM's test of its adaptive width: buffers 512 wide, max_compressed_tokens 256 then 128: the slices are
    [:, :max_compressed_tokens] with the buffers' stride (a graph captured on them stays valid), and the
    columns past max_compressed_tokens are never written."""
    gd, pf = torch.empty(2, 512, dtype=I32), torch.empty(2, 512, dtype=I32)
    kwargs = dict(positions=torch.tensor([255, 511, 383, 639]), compress_ratio=128, num_decode_tokens=2,
                  token_to_req_indices=i32([0, 1, 0, 1]), block_table=i32([[3], [5]]), block_size=512,
                  slot_mapping=torch.arange(4), global_decode_buffer=gd, decode_lens_buffer=torch.empty(2, dtype=I32),
                  prefill_buffer=pf)
    for impl in (M, ops):
        d, _, p = impl.build_c128a_topk_metadata(max_compressed_tokens=256, **kwargs)
        assert d.shape == p.shape == (2, 256) and d.stride(0) == p.stride(0) == 512
        assert d.data_ptr() == gd.data_ptr() and p.data_ptr() == pf.data_ptr()
        gd.fill_(-99)
        pf.fill_(-99)
        impl.build_c128a_topk_metadata(max_compressed_tokens=128, **kwargs)
        assert torch.cat([d[:, :4], p[:, :4]]).tolist() == [[1536, 1537, -1, -1], [2560, 2561, 2562, 2563],
                                                             [0, 1, 2, -1], [0, 1, 2, 3]]
        assert (gd[:, 128:] == -99).all() and (pf[:, 128:] == -99).all()


# Slots past int32 (block ids >= 2**25 at block size 64): computed in int64; an int32 output cannot name them,
# so they are invalid entries (-1, never counted), never wrapped into another page or a negative id
BIG = 2 ** 25


def int32_cases():
    """[(op, args, kwargs, expected)] with tables naming blocks around 2**25 (block size 64)."""
    top, lim = i32([[0, 64, 1, -1], [63, 64, 0, 65]]), 2 ** 31
    bt = i32([[BIG, 5], [BIG - 1, 2 * BIG]])
    t2r, ok = i32([0, 1]), torch.ones(2, dtype=torch.bool)
    pos = torch.tensor([128 * 130 - 1])
    return [
        ("compute_global_topk_indices_and_lens", (top, t2r, bt, 64, ok), {},
         ([[320, -1, -1, -1], [lim - 1, lim - 64, -1, -1]], [1, 2])),
        ("compute_global_topk_indices_and_lens", (top.long(), t2r, bt, 64, ok), {},      # int64 rows hold them
         ([[lim, 320, lim + 1, -1], [lim - 1, 2 * lim, lim - 64, 2 * lim + 1]], [3, 4])),
        ("compute_swa_indices_and_lens", (torch.full((1, 4), POISON, dtype=I32), torch.full((1,), POISON, dtype=I32),
                                          4, i32([0, 1]), i32([66]), i32([0]), torch.ones(1, dtype=torch.bool),
                                          i32([[BIG - 1, BIG]]), 64), {},
         ([[lim - 2, lim - 1, -1, -1]], [4])),
        ("build_c128a_topk_metadata", (pos, 128, 1, i32([0]), i32([[BIG - 1, BIG, 3]]), 64, torch.tensor([0]),
                                       torch.full((1, 256), POISON, dtype=I32), torch.full((1,), POISON, dtype=I32),
                                       torch.full((0, 256), POISON, dtype=I32), 256), {},
         ([[(BIG - 1) * 64 + i for i in range(64)] + [-1] * 64 + [192, 193] + [-1] * 126], [130])),
    ]


@pytest.mark.parametrize("n", range(4))
def test_slots_past_int32_are_invalid_not_wrapped(n):
    """The oracle and the public op: block * 64 + offset >= 2**31 in an int32 row is -1 and does not count
    (it used to wrap to -2**31 and count, or land in another page); an int64 row holds it."""
    op, args, kwargs, (rows, lens) = int32_cases()[n]
    for impl in (M, ops):
        res = getattr(impl, op)(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args], **kwargs)
        assert res[0].tolist() == rows and res[1].tolist() == lens, impl.__name__


def test_combine_by_hand():
    # chunk of requests 1, 2 of a batch (query_start_loc taken from 5): request 0 of the chunk has seq 10,
    # query 2 (positions 8, 9), gathers 2 + min(8, 3) = 5 rows (positions 5..9); request 1 seq 3, query 1
    N, Mrows, W = 8, 20, 4
    loc = i32([[1, 0, -1], [5, 2, 7], [0, -1, -1]])
    qsl, seq, gl = i32([5, 7, 8]), i32([10, 3]), i32([5, 3])
    idx, lens = ops.combine_topk_swa_indices(loc, qsl, seq, gl, W, 4, 3, Mrows, N)
    assert idx.shape == (3, 128) and idx.dtype == I32 and lens.tolist() == [6, 6, 3]
    assert idx[0, :6].tolist() == [1, 0, N + 0, N + 1, N + 2, N + 3]          # positions 5..8
    assert idx[1, :6].tolist() == [5, 2, N + 1, N + 2, N + 3, N + 4]          # positions 6..9
    assert idx[2, :3].tolist() == [Mrows + N + 0, Mrows + N + 1, Mrows + N + 2]
    assert (idx[0, 6:] == -1).all() and (idx[2, 3:] == -1).all()
    assert idx.tolist() == loop_combine(loc, qsl, seq, gl, W, 4, 3, Mrows, N, 128)[0]
    # vLLM's caller passes its workspace buffers by keyword: rows [:T] written and returned
    ci, cl = torch.full((5, 256), POISON, dtype=I32), torch.full((5,), POISON, dtype=I32)
    i2, l2 = ops.combine_topk_swa_indices(loc, qsl, seq, gl, W, 4, 3, Mrows, N, combined_indices=ci, combined_lens=cl)
    assert i2.data_ptr() == ci.data_ptr() and i2.shape == (3, 256) and torch.equal(i2[:, :128], idx)
    assert (i2[:, 128:] == -1).all() and (ci[3:] == POISON).all()
    assert l2.tolist() == [6, 6, 3] and (cl[3:] == POISON).all()


def image_chunk():
    """One request prefilling positions 0..11 (window 4, top-k 2 at ratio 4) with an image at positions 3..8:
    vLLM's visibility of it (left = p - 3, right = 8 - p inside, 0 outside; max_image_tokens 6)."""
    p = torch.arange(12)
    inside = (p >= 3) & (p <= 8)
    left, right = torch.where(inside, p - 3, 0).int(), torch.where(inside, 8 - p, 0).int()
    loc = (torch.arange(12 * 2).view(12, 2) % 3).int()
    return loc, i32([0, 12]), i32([12]), i32([12]), left, right


def test_combine_image_visibility_by_hand():
    """vLLM 0.33's in-image bidirectional visibility: a token of the image sees every image position (before
    it beyond the window, and after it), the others their causal window; rows reserve W + max_image_tokens
    window columns."""
    N, Mrows, W = 3, 40, 4
    loc, qsl, seq, gl, left, right = image_chunk()
    idx, lens = ops.combine_topk_swa_indices(loc, qsl, seq, gl, W, 4, 2, Mrows, N, None, left, right, 6)
    assert idx.shape == (12, 128) and lens[[3, 5, 8, 10]].tolist() == [1 + 9, 1 + 7, 2 + 6, 2 + 4]
    assert idx[3, :10].tolist() == [loc[3, 0]] + [N + q for q in range(0, 9)]        # positions 0..8
    assert idx[5, :8].tolist() == [loc[5, 0]] + [N + q for q in range(2, 9)]         # 2..8 (left 2 < W - 1)
    assert idx[8, :8].tolist() == loc[8].tolist() + [N + q for q in range(3, 9)]     # 3..8 (left 5 > W - 1)
    assert idx[10, :6].tolist() == loc[10].tolist() + [N + q for q in range(7, 11)]  # 7..10: the causal window
    assert (idx.tolist(), lens.tolist()) == loop_combine(loc, qsl, seq, gl, W, 4, 2, Mrows, N, 128, left, right)
    plain, plain_lens = ops.combine_topk_swa_indices(loc, qsl, seq, gl, W, 4, 2, Mrows, N)
    assert torch.equal(idx[:3, :plain.shape[1]], plain[:3]) and torch.equal(lens[9:], plain_lens[9:])


def test_combine_vllm_033_out_form():
    """vLLM 0.33 passes its workspace as out=(indices, lens): every row of indices is reset (rows past the
    chunk's tokens to -1) and the whole buffers come back; the first rows are the keyword form's."""
    loc, qsl, seq, gl, left, right = image_chunk()
    want, want_lens = ops.combine_topk_swa_indices(loc, qsl, seq, gl, 4, 4, 2, 40, 3, left_visible=left,
                                                   right_visible=right, max_image_tokens=6)
    ci, cl = torch.full((14, 256), POISON, dtype=I32), torch.full((14,), POISON, dtype=I32)
    got = ops.combine_topk_swa_indices(loc, qsl, seq, gl, 4, 4, 2, 40, 3, (ci, cl), left, right, 6)
    assert got[0] is ci and got[1] is cl
    assert torch.equal(ci[:12, :128], want) and (ci[:12, 128:] == -1).all() and (ci[12:] == -1).all()
    assert torch.equal(cl[:12], want_lens) and (cl[12:] == POISON).all()


@pytest.mark.parametrize("kw, match", [
    (dict(out=(torch.empty(12, 128, dtype=I32), torch.empty(12, dtype=I32)),
          combined_indices=torch.empty(12, 128, dtype=I32)), "not both"),
    (dict(out=torch.empty(12, 128, dtype=I32)), "out must be the pair"),
    (dict(left_visible=i32([0] * 12)), "must be given together"),
    (dict(left_visible=i32([0] * 12), right_visible=i32([0] * 11)), "right_visible has 11 entries"),
    (dict(left_visible=i32([-1] + [0] * 11), right_visible=i32([0] * 12), max_image_tokens=6), ">= 0"),
    (dict(left_visible=i32([0] * 12), right_visible=i32([7] + [0] * 11), max_image_tokens=6),
     "window of 11 positions, more than window_size \\+ max_image_tokens = 10"),
    (dict(max_image_tokens=-1), "max_image_tokens"),
])
def test_combine_rejects_bad_033_arguments_before_any_write(kw, match):
    loc, qsl, seq, gl, _, _ = image_chunk()
    if "out" in kw:
        bufs = list(kw["out"]) if isinstance(kw["out"], tuple) else [kw["out"]]
    else:
        bufs = [torch.full((12, 128), POISON, dtype=I32), torch.full((12,), POISON, dtype=I32)]
        if "combined_indices" not in kw:
            kw = dict(kw, combined_indices=bufs[0], combined_lens=bufs[1])
    for b in bufs:
        b.fill_(POISON)
    with pytest.raises(ValueError, match=match):
        ops.combine_topk_swa_indices(loc, qsl, seq, gl, 4, 4, 2, 40, 3, **kw)
    assert all((b == POISON).all() for b in bufs)


@pytest.mark.parametrize("seed", range(6))
def test_combine_random_image_spans(seed):
    """Random chunks with image spans (vLLM's visibility rule per span), against the token loop."""
    g = torch.Generator().manual_seed(seed)
    R, W, k, ratio, IW = 3, 8, 4, 4, 12
    qlens = torch.randint(1, 30, (R,), generator=g)
    seq = (qlens + torch.randint(0, 20, (R,), generator=g)).int()
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), qlens.cumsum(0)]).int() + 5
    T = int(qsl[-1] - qsl[0])
    left, right = torch.zeros(T, dtype=I32), torch.zeros(T, dtype=I32)
    for b in range(R):
        lo, hi = int(seq[b] - qlens[b]), int(seq[b])
        s0 = int(torch.randint(lo, hi, (), generator=g))
        s1 = min(s0 + int(torch.randint(0, IW, (), generator=g)), hi - 1)          # span [s0, s1], <= IW tokens
        for t in range(int(qsl[b] - qsl[0]), int(qsl[b + 1] - qsl[0])):
            p = int(seq[b]) - int(qlens[b]) + t - int(qsl[b] - qsl[0])
            if s0 <= p <= s1:
                left[t], right[t] = min(p - s0, IW - 1), min(s1 - p, IW)
    gl = seq.clone()                                          # the whole sequences gathered
    loc = torch.randint(-2, 12, (T, k), generator=g, dtype=I32)
    N, Mrows = 12, 12 + int(seq.max()) + 1
    idx, lens = ops.combine_topk_swa_indices(loc, qsl, seq, gl, W, ratio, k, Mrows, N, None, left, right, IW)
    rows, want = loop_combine(loc, qsl, seq, gl, W, ratio, k, Mrows, N, M.combined_width(k, W, IW), left, right)
    assert idx.tolist() == rows and lens.tolist() == want


# vLLM 0.33's in-image visibility cases (its test_deepseek_v4_swa_visible.py): W 8, 6 image tokens, a chunk of
# two whole prompts, one with image spans [4, 12] and [20, 24]; local top-k indices drawn from [0, 4096), far
# past N (vLLM's combine writes them through). The rows are built here position by position.
SPAN_W, SPAN_IMG = 8, 6


def span_case(ratio, topk, with_image, seed=0):
    seq_lens, spans = [30, 12], [[(4, 12), (20, 24)], []]
    T = sum(seq_lens)
    left, right = [0] * T, [0] * T
    t = 0
    for b, n in enumerate(seq_lens):
        for p in range(n):
            for s0, s1 in spans[b]:
                if s0 <= p <= s1:
                    left[t], right[t] = min(p - s0, SPAN_IMG - 1), min(s1 - p, SPAN_IMG)
            t += 1
    gl = seq_lens[:]                                             # whole prompts: everything gathered
    N = (max(seq_lens) + ratio - 1) // ratio
    Mrows = N + max(gl) + 8
    loc = torch.randint(0, 4096, (T, max(topk, 1)), generator=torch.Generator().manual_seed(seed), dtype=I32)
    width = (topk + SPAN_W + SPAN_IMG + 127) // 128 * 128
    rows, lens, t = [], [], 0
    for b, n in enumerate(seq_lens):
        for p in range(n):
            lv, rv = (left[t], right[t]) if with_image else (0, 0)
            start = max(p - (SPAN_W - 1) - max(lv - (SPAN_W - 1), 0), 0)
            tl_ = min((p + 1) // ratio, topk)
            row = [b * Mrows + int(x) for x in loc[t, :tl_]] + [b * Mrows + N + q for q in range(start, p + rv + 1)]
            lens.append(len(row))
            rows.append(row + [-1] * (width - len(row)))
            t += 1
    args = (loc, i32([0, 30, 42]), i32(seq_lens), i32(gl), SPAN_W, ratio, topk, Mrows, N)
    kw = dict(left_visible=i32(left) if with_image else None, right_visible=i32(right) if with_image else None,
              max_image_tokens=SPAN_IMG)
    return args, kw, rows, lens


SPAN_CASES = [(r, k, img) for r, k in ((1, 0), (4, 16)) for img in (True, False)]


@pytest.mark.parametrize("ratio,topk,with_image", SPAN_CASES)
def test_combine_vllm_image_span_cases(ratio, topk, with_image):
    """Inside an image span a token also sees up to 5 earlier and 6 later span positions (token 4 of span
    [4, 12]: 11 rows, positions 0..10); top-k indices past N are written as b*M + index. The oracle and the
    public op (the kernel on a GPU) both give the rows built above."""
    args, kw, rows, lens = span_case(ratio, topk, with_image)
    for fn in (M.combine_topk_swa_indices, ops.combine_topk_swa_indices):
        idx, got_lens = fn(*args, **kw)
        assert got_lens.tolist() == lens and idx.tolist() == rows, fn


@pytest.mark.gpu
@pytest.mark.parametrize("ratio,topk,with_image", SPAN_CASES)
def test_combine_vllm_image_span_cases_on_gpu(ratio, topk, with_image):
    args, kw, rows, lens = span_case(ratio, topk, with_image)
    idx, got_lens = kernel_of("combine_topk_swa_indices")(*_to(args, "cuda"), **_to(kw, "cuda"))
    assert got_lens.cpu().tolist() == lens and idx.cpu().tolist() == rows


REPLAY_W = 8
REPLAY_CASES = [(r, k, q) for r, k in ((1, 0), (4, 16)) for q in (24, 20)]


def replay_case(ratio, topk, query_len):
    """vLLM's bounded SWA replay case (V4.1): request 0 (seq 40) replays from position 16, so its gather
    holds only positions >= 16: a 24-token chunk gathers exactly its own tokens (16..39), a 20-token chunk
    its own and 4 context positions (16..39 again, fewer than W - 1 = 7); request 1 (seq 12, no replay)
    gathers all 12. Window W = 8; top-k indices below N. Rows written here position by position: the window
    of a token at p is [max(p - 7, 16), p] for request 0, [max(p - 7, 0), p] for request 1."""
    seq_lens, query_lens, replay = [40, 12], [query_len, 12], [16, 0]
    gl = [q + min(max(s - q - r, 0), REPLAY_W - 1) for s, q, r in zip(seq_lens, query_lens, replay)]
    N = (max(seq_lens) + ratio - 1) // ratio
    Mrows = N + max(gl) + 8
    T = sum(query_lens)
    loc = torch.randint(0, N, (T, max(topk, 1)), generator=torch.Generator().manual_seed(0), dtype=I32)
    width = M.combined_width(topk, REPLAY_W)
    rows, lens, t = [], [], 0
    for b, (s, q) in enumerate(zip(seq_lens, query_lens)):
        gstart = s - gl[b]
        for p in range(s - q, s):
            first = max(p - (REPLAY_W - 1), 0, replay[b])
            k = min((p + 1) // ratio, topk)
            row = [b * Mrows + int(x) for x in loc[t, :k]] + [b * Mrows + N + x - gstart for x in range(first, p + 1)]
            lens.append(len(row))
            rows.append(row + [-1] * (width - len(row)))
            t += 1
    args = (loc, i32([0, query_len, query_len + 12]), i32(seq_lens), i32(gl), REPLAY_W, ratio, topk, Mrows, N)
    return args, rows, lens


@pytest.mark.parametrize("ratio,topk,query_len", REPLAY_CASES)
def test_combine_window_stops_at_the_replay_start(ratio, topk, query_len):
    """vLLM 0.33's bounded SWA replay: gather_lens below query_len + min(prefix_len, W - 1) (nothing gathered
    below the replay start) is accepted, and the window stops at the first gathered position: no row below
    it, the length shortened (it used to be rejected by the op's gather_lens check, and the oracle wrote -1
    in place keeping the length). vLLM's test_v41_combine_topk_swa_stops_at_replay_start, both forms."""
    args, rows, lens = replay_case(ratio, topk, query_len)
    for fn in (M.combine_topk_swa_indices, ops.combine_topk_swa_indices):
        idx, got_lens = fn(*args)
        assert got_lens.tolist() == lens and idx.tolist() == rows, fn
    T, width = len(rows), len(rows[0])
    out = (torch.full((T + 2, width), POISON, dtype=I32), torch.full((T + 2,), POISON, dtype=I32))
    idx, got_lens = ops.combine_topk_swa_indices(*args, out)
    assert idx[:T].tolist() == rows and got_lens[:T].tolist() == lens and (idx[T:] == -1).all()
    p0 = 40 - query_len                                       # request 0's first token; its window starts at 16
    assert lens[0] == min((p0 + 1) // ratio, topk) + p0 - 16 + 1


def test_combine_gather_below_query_len_rejected():
    """The chunk's own tokens must be gathered: gather_lens below query_len is a ValueError naming it."""
    args, _, _ = replay_case(4, 16, 24)
    bad = list(args)
    bad[3] = i32([23, 12])
    with pytest.raises(ValueError, match="gather_lens must lie in \\[query_len, seq_lens\\]"):
        ops.combine_topk_swa_indices(*bad)


@pytest.mark.gpu
@pytest.mark.parametrize("ratio,topk,query_len", REPLAY_CASES)
def test_combine_window_stops_at_the_replay_start_on_gpu(ratio, topk, query_len):
    args, rows, lens = replay_case(ratio, topk, query_len)
    idx, got_lens = kernel_of("combine_topk_swa_indices")(*_to(args, "cuda"))
    assert got_lens.cpu().tolist() == lens and idx.cpu().tolist() == rows


def test_combine_swa_only_layer():
    """SWA-only layers: topk 0, compress_ratio 1, N 0, a zero-width topk buffer."""
    idx, lens = ops.combine_topk_swa_indices(torch.empty(3, 0, dtype=I32), i32([0, 3]), i32([3]), i32([3]), 128, 1, 0,
                                             131, 0)
    assert lens.tolist() == [1, 2, 3] and idx[2, :4].tolist() == [0, 1, 2, -1]


# ------------------------------------------------------------------------------------------------ padding never wraps
# Each bad value an engine's padding or a bug can produce: the oracle (and the kernels, below) skip it;
# the public op names it (value checks run on CPU) before writing anything.
def test_compressed_slot_mapping_negative_position_is_not_wrapped():
    """A token at position -1 (seq_len below its query length) used to get slot 127 (entry -1 wrapped to
    the last page of the row); a negative page used to be read as a page."""
    bt = i32([[0, 1], [2, 3]])
    args = (2, i32([0, 1, 2]), i32([0, 4]), bt, 64, 4)
    assert M.get_compressed_slot_mapping(*args).tolist() == [-1, 2 * 64]
    with pytest.raises(ValueError, match="seq_lens"):
        ops.get_compressed_slot_mapping(*args)
    bt_neg = i32([[0, 1], [-1, 3]])                    # a negative page: padding, on every path
    assert M.get_compressed_slot_mapping(2, i32([0, 1, 2]), i32([1, 4]), bt_neg, 64, 4).tolist() == [-1, -1]
    assert ops.get_compressed_slot_mapping(2, i32([0, 1, 2]), i32([1, 4]), bt_neg, 64, 4).tolist() == [-1, -1]


def test_compressed_slot_mapping_padding_tokens_and_rows_past_the_table():
    """Padding tokens past the last request (vLLM's token_to_req -1) get -1, never request 1's page; a
    position past the block table gets -1 (the oracle and the op alike)."""
    bt = i32([[0, 1], [2, 3]])
    s = ops.get_compressed_slot_mapping(4, i32([0, 1, 1]), i32([4, 0]), bt, 64, 4)
    assert s.tolist() == [0, -1, -1, -1]
    args = (1, i32([0, 1]), i32([600]), i32([[0, 1]]), 64, 4)          # entry 149: column 2 of a 2-column table
    assert M.get_compressed_slot_mapping(*args).tolist() == [-1]
    assert ops.get_compressed_slot_mapping(*args).tolist() == [-1]


def test_combine_minus_one_inside_topk_len_is_skipped():
    """A -1 among the first topk_len local indices of request 1's token used to become M*1 - 1, the last
    workspace row of request 0 (199 with M = 200); it is -1 now (in place: the length stays, the attention
    skips it). An index >= N passes as b*M + index, as vLLM's combine writes it (its test draws indices
    past N and expects them there)."""
    N, Mrows = 16, 200
    loc = i32([[0, 1, -1, -1], [2, -1, 3, -1]])
    qsl, seq, gl = i32([0, 1, 2]), i32([8, 12]), i32([1, 1])
    idx, lens = ops.combine_topk_swa_indices(loc, qsl, seq, gl, 1, 4, 4, Mrows, N)
    assert idx[1, :4].tolist() == [Mrows + 2, -1, Mrows + 3, Mrows + N]      # topk_len 3: [2, -1, 3], window 1
    assert 199 not in idx.tolist()[1] and lens.tolist() == [3, 4]
    bad = i32([[0, 1, -1, -1], [2, 16, 3, -1]])
    want = M.combine_topk_swa_indices(bad, qsl, seq, gl, 1, 4, 4, Mrows, N)
    got = ops.combine_topk_swa_indices(bad, qsl, seq, gl, 1, 4, 4, Mrows, N)
    assert want[0][1, 1] == Mrows + 16 and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_negative_positions_give_zero_lengths_not_negative():
    """Positions -2 / -3 used to give lengths -2 / -3 (SWA) and 0 with garbage rows (C128A)."""
    # SWA: request 0's seq_len 1 below its query length 4 -> positions -3..0
    args = (4, i32([0, 4]), i32([1]), i32([0, 0, 0, 0]), torch.ones(4, dtype=torch.bool), i32([[3]]), 64)
    idx, lens = torch.empty(4, 4, dtype=I32), torch.empty(4, dtype=I32)
    M.compute_swa_indices_and_lens(idx, lens, *args)
    assert lens.tolist() == [0, 0, 0, 1] and idx[:3].eq(-1).all() and idx[3].tolist() == [192, -1, -1, -1]
    with pytest.raises(ValueError, match="negative positions"):
        ops.compute_swa_indices_and_lens(idx, lens, *args)
    # C128A: a decode token and a prefill token at negative positions
    pos = torch.tensor([-3, 300, -2])
    bufs = (torch.empty(2, 128, dtype=I32), torch.empty(2, dtype=I32), torch.empty(1, 128, dtype=I32))
    for impl in (M, ops):                                 # a per-token value: padding on every path
        g, l, p = impl.build_c128a_topk_metadata(pos, 128, 2, i32([0, 0]), i32([[1, 2]]), 2, torch.tensor([5, 6]),
                                                 *bufs, 128)
        assert l.tolist() == [0, 2] and g[0].eq(-1).all() and p[0].eq(-1).all()


@pytest.mark.parametrize("name, call", [
    ("window_size", lambda: ops.combine_topk_swa_indices(i32([[0]]), i32([0, 1]), i32([4]), i32([1]), 0, 4, 1, 20, 4)),
    ("window_size", lambda: ops.compute_swa_indices_and_lens(torch.empty(1, 0, dtype=I32), torch.empty(1, dtype=I32),
                                                             0, i32([0, 1]), i32([1]), i32([0]), i32([1]), BT, 64)),
    ("window_size", lambda: ops.compute_prefill_gather_lens(torch.empty(1, dtype=I32), i32([1]), i32([0, 1]), 1, 0, 0)),
    ("block_size", lambda: ops.get_compressed_slot_mapping(1, i32([0, 1]), i32([4]), BT[:1], 0, 4)),
    ("block_size", lambda: ops.compute_swa_indices_and_lens(torch.empty(1, 4, dtype=I32), torch.empty(1, dtype=I32),
                                                            4, i32([0, 1]), i32([1]), i32([0]), i32([1]), BT, 0)),
    ("block_size", lambda: ops.compute_global_topk_indices_and_lens(i32([[0]]), i32([0]), BT, 0, i32([1]))),
    ("block_size", lambda: ops.build_c128a_topk_metadata(torch.tensor([1]), 128, 1, i32([0]), BT, 0, torch.tensor([1]),
                                                         torch.empty(1, 8, dtype=I32), torch.empty(1, dtype=I32),
                                                         torch.empty(0, 8, dtype=I32), 8)),
    ("compress_ratio", lambda: ops.get_compressed_slot_mapping(1, i32([0, 1]), i32([4]), BT[:1], 64, 0)),
    ("cp_rank", lambda: ops.get_compressed_slot_mapping(1, i32([0, 1]), i32([4]), BT[:1], 64, 4, None, 2, 2)),
    ("max_compressed_tokens", lambda: ops.build_c128a_topk_metadata(
        torch.tensor([1]), 128, 1, i32([0]), BT, 2, torch.tensor([1]), torch.empty(1, 8, dtype=I32),
        torch.empty(1, dtype=I32), torch.empty(0, 8, dtype=I32))),             # default 8192 > the 8 columns
    ("topk", lambda: ops.combine_topk_swa_indices(i32([[0]]), i32([0, 1]), i32([4]), i32([1]), 4, 4, 2, 20, 4)),
    ("N", lambda: ops.combine_topk_swa_indices(i32([[0]]), i32([0, 1]), i32([4]), i32([1]), 4, 4, 1, 20, 20)),
    ("query_start_loc", lambda: ops.combine_topk_swa_indices(i32([[0]]), i32([0, 1, 2]), i32([4]), i32([1]), 4, 4, 1,
                                                             20, 4)),
    ("gather_lens", lambda: ops.combine_topk_swa_indices(i32([[0]]), i32([0, 1]), i32([4]), i32([1, 1]), 4, 4, 1, 20,
                                                         4)),
    ("swa_indices", lambda: ops.compute_swa_indices_and_lens(torch.empty(1, 2, 4, dtype=I32), torch.empty(1, dtype=I32),
                                                             4, i32([0, 1]), i32([1]), i32([0]), i32([1]), BT, 64)),
    ("out", lambda: ops.get_compressed_slot_mapping(3, i32([0, 1]), i32([4]), BT[:1], 64, 4,
                                                    out=torch.empty(2, dtype=torch.int64))),
    ("num_decode_tokens", lambda: ops.build_c128a_topk_metadata(
        torch.tensor([1]), 128, 2, i32([0]), BT, 2, torch.tensor([1]), torch.empty(1, 8, dtype=I32),
        torch.empty(1, dtype=I32), torch.empty(0, 8, dtype=I32), 8)),
    ("block_table", lambda: ops.compute_global_topk_indices_and_lens(i32([[0]]), i32([0]), BT.t(), 64, i32([1]))),
])
def test_structural_errors_name_the_argument(name, call):
    with pytest.raises(ValueError, match=name):
        call()


# ------------------------------------------------------------------------------------------------ random batches
PROPERTY = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                          HealthCheck.filter_too_much])


def _garbage_t2r(b, g):
    """token_to_req with garbage (negative or past the batch) on every padding token."""
    t2r = b["t2r"].clone()
    bad = ~b["valid"]
    t2r[bad] = torch.randint(-5, b["R"] + 5, (int(bad.sum()),), generator=g, dtype=I32)
    return t2r


def _local_topk(b, k, ratio, g, real=None):
    """Local top-k rows like the indexer's: the ``real`` tokens (default: the valid ones) hold distinct
    visible entries first (sometimes with a -1 among them), then -1; the others hold garbage."""
    rows = torch.randint(-50, 5000, (b["T"], k), generator=g, dtype=I32)
    real = b["valid"] if real is None else real
    for t in range(b["T"]):
        if real[t]:
            n = max(int(b["pos"][t]) + 1, 0) // ratio
            m = min(n, k)
            row = torch.full((k,), -1, dtype=I32)
            row[:m] = torch.randperm(n, generator=g)[:m].to(I32)
            if m > 1 and torch.rand((), generator=g) < 0.3:
                row[int(torch.randint(0, m, (), generator=g))] = -1
            rows[t] = row
    return rows


@PROPERTY
@given(seed=st.integers(0, 2 ** 31 - 1), ratio=st.sampled_from([4, 128]))
def test_compressed_slot_mapping_random_batches(seed, ratio):
    b = random_batch(seed)
    bs = 256 // ratio
    out = torch.full((b["T"] + 2,), POISON, dtype=torch.int64)
    got = ops.get_compressed_slot_mapping(b["T"], b["qsl"], b["seq"], b["bt"], bs, ratio, out=out)
    assert got.tolist() == loop_compressed_slots(b["T"], b["qsl"], b["seq"], b["bt"], bs, ratio)
    assert (out[b["Treal"]:] == -1).all()                      # padding tokens and the buffer's tail
    got = ops.get_compressed_slot_mapping(b["T"], b["slot"], b["qsl"], b["seq"], b["bt"], bs, ratio, out)
    assert got.tolist() == loop_compressed_slots_033(b["T"], b["slot"], b["qsl"], b["seq"], b["bt"], bs, ratio)


@PROPERTY
@given(seed=st.integers(0, 2 ** 31 - 1), W=st.sampled_from([1, 4, 128]), offset=st.integers(0, 2))
def test_swa_random_batches(seed, W, offset):
    b = random_batch(seed)
    n = b["T"] - min(offset, b["T"])
    t2r = _garbage_t2r(b, b["g"])
    idx = torch.full((n + 1, 1, W), POISON, dtype=I32)
    lens = torch.full((n + 1,), POISON, dtype=I32)
    ops.compute_swa_indices_and_lens(idx, lens, W, b["qsl"], b["seq"], t2r, b["valid"], b["bt"], 64, b["T"] - n, n)
    rows, want = loop_swa(W, b["qsl"], b["seq"], t2r, b["valid"], b["bt"], 64, range(b["T"] - n, b["T"]))
    assert idx[:n, 0].tolist() == rows and lens[:n].tolist() == want
    assert (idx[n:] == POISON).all() and lens[n] == POISON


@PROPERTY
@given(seed=st.integers(0, 2 ** 31 - 1), W=st.sampled_from([1, 4, 128]))
def test_prefill_gather_lens_random_batches(seed, W):
    b = random_batch(seed)
    g = b["g"]
    nd = int(torch.randint(0, b["R"] + 1, (), generator=g))
    npf = b["R"] - nd
    out = torch.full((npf + 1,), POISON, dtype=I32)
    ops.compute_prefill_gather_lens(out, b["seq"], b["qsl"], npf, nd, W)
    ql = [int(b["qsl"][r + 1] - b["qsl"][r]) for r in range(nd, b["R"])]
    assert out[:npf].tolist() == [q + min(int(b["seq"][r]) - q, W - 1) for q, r in zip(ql, range(nd, b["R"]))]
    assert out[npf] == POISON


@PROPERTY
@given(seed=st.integers(0, 2 ** 31 - 1), k=st.sampled_from([1, 4, 8]))
def test_global_topk_random_batches(seed, k):
    b = random_batch(seed)
    t2r = _garbage_t2r(b, b["g"])
    loc = _local_topk(b, k, 4, b["g"])
    got, lens = ops.compute_global_topk_indices_and_lens(loc, t2r, b["bt"], 64, b["valid"])
    rows, want = loop_global_topk(loc, t2r, b["bt"], 64, b["valid"])
    assert got.tolist() == rows and lens.tolist() == want


@PROPERTY
@given(seed=st.integers(0, 2 ** 31 - 1), cap=st.sampled_from([1, 2, 128]), narrow=st.booleans())
def test_c128a_random_batches(seed, cap, narrow):
    b = random_batch(seed)
    g = b["g"]
    T = b["T"]
    nd = int(torch.randint(0, T + 1, (), generator=g))
    pos = b["pos"].clone()
    pos[nd:] = pos[nd:].clamp(min=0)               # prefill rows have no padding flag: no negative positions
    t2r = _garbage_t2r(b, g)
    width = cap + 3
    bufs = [torch.full((T + 1, width), POISON, dtype=I32), torch.full((T + 1,), POISON, dtype=I32),
            torch.full((T + 1, width), POISON, dtype=I32)]
    msl = int(pos.max()) + 1 + int(torch.randint(0, 300, (), generator=g)) if narrow and T else None
    gd, dl, pf = ops.build_c128a_topk_metadata(pos, 128, nd, t2r, b["bt"], 2, b["slot"], *bufs, cap, max_seq_len=msl)
    w = cap if msl is None else M.c128a_effective_width(msl, 128, cap)
    assert gd.shape == (nd, w) and pf.shape == (T - nd, w)
    egd, edl, epf = loop_c128a(pos, 128, nd, t2r, b["bt"], 2, b["slot"], w, min(cap, w))
    assert gd.tolist() == egd and dl.tolist() == edl and pf.tolist() == epf
    assert (bufs[0][nd:] == POISON).all() and (bufs[1][nd:] == POISON).all() and (bufs[2][T - nd:] == POISON).all()
    assert (bufs[0][:nd, w:] == POISON).all() and (bufs[2][:T - nd, w:] == POISON).all()


@PROPERTY
@given(seed=st.integers(0, 2 ** 31 - 1), W=st.sampled_from([1, 4, 128]), ratio=st.sampled_from([1, 4, 128]),
       k=st.sampled_from([0, 3, 8]))
def test_combine_random_chunks(seed, W, ratio, k):
    b = random_batch(seed, pad_reqs=0)
    g = b["g"]
    c0 = int(torch.randint(0, b["R"] + 1, (), generator=g))
    c1 = int(torch.randint(c0, b["R"] + 1, (), generator=g))
    qsl, seq = b["qsl"][c0:c1 + 1], b["seq"][c0:c1]
    ql = (qsl[1:] - qsl[:-1]).long()
    # vLLM's bounded SWA replay: nothing gathered below a request's replay start (0: the whole window)
    replay = torch.where(torch.rand(ql.shape, generator=g) < 0.5, 0,
                         torch.randint(0, int(seq.max()) + 1 if seq.numel() else 1, ql.shape, generator=g))
    gl = (ql + torch.clamp(seq.long() - ql - replay, min=0, max=W - 1)).to(I32)
    toks = slice(int(qsl[0]), int(qsl[-1]))
    pad = int(torch.randint(0, 3, (), generator=g))
    real = torch.arange(b["T"]) < b["Treal"]                 # combine has no padding flag: every token is real
    loc = torch.cat([_local_topk(b, k, ratio, g, real)[toks], torch.randint(-9, 99, (pad, k), generator=g, dtype=I32)])
    N = int(b["seq"].max()) // ratio + 3 if b["R"] else 3
    Mrows = N + W + int(ql.max() if ql.numel() else 0) + 1
    width = M.combined_width(k, W)
    ci = torch.full((loc.shape[0] + 1, width), POISON, dtype=I32)
    cl = torch.full((loc.shape[0] + 1,), POISON, dtype=I32)
    idx, lens = ops.combine_topk_swa_indices(loc, qsl, seq, gl, W, ratio, k, Mrows, N, combined_indices=ci,
                                             combined_lens=cl)
    rows, want = loop_combine(loc, qsl, seq, gl, W, ratio, k, Mrows, N, width)
    assert idx.tolist() == rows and lens.tolist() == want           # padding rows: -1 / 0
    assert (ci[-1] == POISON).all() and cl[-1] == POISON


# ------------------------------------------------------------------------------------------------ rejected calls
def _bad_calls(b, kind, g):
    """(op name, args, output buffers) of a call with a bad value of ``kind``, or None when this batch cannot
    show it."""
    T, R, qsl, seq, bt = b["T"], b["R"], b["qsl"].clone(), b["seq"].clone(), b["bt"].clone()
    ql = qsl[1:] - qsl[:-1]
    busy = torch.nonzero(ql > 0).flatten()
    if not busy.numel():
        return None
    r = int(busy[int(torch.randint(0, busy.numel(), (), generator=g))])
    valid = b["valid"].clone()
    valid[int(qsl[r]):int(qsl[r + 1])] = True                          # request r's tokens are real
    t2r = b["t2r"].clone()
    out = torch.full((T,), POISON, dtype=torch.int64)
    idx, lens = torch.full((T, 8), POISON, dtype=I32), torch.full((T,), POISON, dtype=I32)
    if kind == "non-monotone query_start_loc":
        qsl[r], qsl[r + 1] = qsl[r + 1].clone(), qsl[r].clone()
    elif kind == "seq_lens below query length":
        seq[r] = ql[r] - 1
    elif kind == "missing page":
        bt[r] = -1
    elif kind == "page past 2**31 slots":
        bt[r] = 2 ** 25 + bt[r].clamp(min=0)
    elif kind == "request id past the batch":
        t2r[int(qsl[r])] = R + 3
        return "compute_swa_indices_and_lens", (idx, lens, 8, qsl, seq, t2r, valid, bt, 64), [idx, lens]
    calls = [("get_compressed_slot_mapping", (T, qsl, seq, bt, 2, 1, out), [out]),
             ("compute_swa_indices_and_lens", (idx, lens, 8, qsl, seq, t2r, valid, bt, 64), [idx, lens])]
    return calls[int(torch.randint(0, 2, (), generator=g))]


@PROPERTY
@given(seed=st.integers(0, 2 ** 31 - 1), kind=st.sampled_from(["non-monotone query_start_loc",
                                                             "seq_lens below query length"]))
def test_rejected_call_changes_no_byte(seed, kind):
    """A batch that contradicts itself is a ValueError (value checks on CPU) before any write."""
    from hypothesis import assume
    b = random_batch(seed, pad_reqs=0)
    case = _bad_calls(b, kind, b["g"])
    assume(case is not None)
    op, args, bufs = case
    before = snapshot(*bufs)
    with pytest.raises(ValueError):
        getattr(ops, op)(*args)
    assert unchanged(before, *bufs)


@PROPERTY
@given(seed=st.integers(0, 2 ** 31 - 1), kind=st.sampled_from(["missing page", "request id past the batch",
                                                             "page past 2**31 slots"]))
def test_failed_lookups_are_padding_not_errors(seed, kind):
    """A lookup that fails (a missing page, a request id past the batch, a slot an int32 output cannot hold)
    is padding: the public op, value checks on, gives the oracle's answer instead of raising."""
    from hypothesis import assume
    b = random_batch(seed, pad_reqs=0)
    case = _bad_calls(b, kind, b["g"])
    assume(case is not None)
    op, args, _ = case
    want = getattr(M, op)(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    got = getattr(ops, op)(*args)
    for w, x in zip(_flat([want]), _flat([got])):
        assert torch.equal(w, x), op


def test_rejected_calls_of_the_other_ops_change_no_byte():
    g = torch.Generator().manual_seed(3)
    loc = torch.randint(0, 64, (4, 8), generator=g, dtype=I32)
    ci, cl = torch.full((4, 256), POISON, dtype=I32), torch.full((4,), POISON, dtype=I32)
    gl = torch.full((2,), POISON, dtype=I32)
    calls = [
        lambda: ops.combine_topk_swa_indices(loc, i32([0, 2, 4]), i32([300, 10]), i32([2, 11]), 8, 4, 8, 300, 100,
                                             combined_indices=ci, combined_lens=cl),  # gather_lens past seq_lens
        lambda: ops.combine_topk_swa_indices(loc, i32([0, 3, 2]), i32([300, 10]), i32([9, 9]), 8, 4, 8, 300, 100,
                                             combined_indices=ci, combined_lens=cl),  # non-monotone
        lambda: ops.compute_prefill_gather_lens(gl, i32([3, 1]), i32([0, 2, 5]), 2, 0, 8),  # seq below query
    ]
    for call in calls:
        before = snapshot(ci, cl, gl)
        with pytest.raises(ValueError):
            call()
        assert unchanged(before, ci, cl, gl)


def test_per_token_lookups_of_the_other_ops_are_padding():
    """What the public ops used to reject (a column or request past the table, a negative position, an entry
    past the table's columns, a local index >= N): the oracle's padding answer, on CPU with value checks."""
    g = torch.Generator().manual_seed(3)
    loc = torch.randint(0, 64, (4, 8), generator=g, dtype=I32)

    def bufs():
        return [torch.full((4, 16), POISON, dtype=I32), torch.full((4,), POISON, dtype=I32),
                torch.full((4, 16), POISON, dtype=I32)]
    calls = [
        ("compute_global_topk_indices_and_lens", (loc + 200, i32([0, 0, 1, 1]), BT, 64, torch.ones(4, dtype=bool))),
        ("compute_global_topk_indices_and_lens", (loc, i32([0, 0, 2, 1]), BT, 64, torch.ones(4, dtype=bool))),
        ("build_c128a_topk_metadata", (torch.tensor([5, -1, 9, 700]), 128, 2, i32([0, 1]), BT, 2,
                                       torch.tensor([1, 2]), *bufs(), 16)),
        ("build_c128a_topk_metadata", (torch.tensor([5, 1, 9, 1600]), 128, 4, i32([0, 1, 1, 1]), BT, 2,
                                       torch.tensor([1, 2, 3, 4]), *bufs(), 16)),
        ("combine_topk_swa_indices", (loc, i32([0, 2, 4]), i32([300, 10]), i32([10, 10]), 8, 4, 8, 300, 30)),
    ]
    for op, args in calls:
        want = getattr(M, op)(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
        got = getattr(ops, op)(*args)
        assert all(torch.equal(w, x) for w, x in zip(_flat([want]), _flat([got]))), op


# ------------------------------------------------------------------------------------------------ empty batches
def test_empty_batches_return_empty_results():
    e = torch.empty(0, dtype=I32)
    assert ops.get_compressed_slot_mapping(0, i32([0]), e, torch.empty(0, 4, dtype=I32), 64, 4).shape == (0,)
    out = torch.full((3,), POISON, dtype=torch.int64)
    assert ops.get_compressed_slot_mapping(0, i32([0]), e, torch.empty(0, 4, dtype=I32), 64, 4, out=out).shape == (0,)
    assert out.tolist() == [-1] * 3                           # vLLM resets the whole buffer
    idx, lens = ops.compute_swa_indices_and_lens(torch.empty(0, 1, 8, dtype=I32), e, 8, i32([0]), e, e,
                                                 torch.empty(0, dtype=torch.bool), torch.empty(0, 1, dtype=I32), 64)
    assert idx.shape == (0, 1, 8) and lens.shape == (0,)
    assert ops.compute_prefill_gather_lens(torch.empty(0, dtype=I32), e, i32([0]), 0, 0, 8).shape == (0,)
    g, l = ops.compute_global_topk_indices_and_lens(torch.empty(0, 8, dtype=I32), e, BT, 64,
                                                    torch.empty(0, dtype=torch.bool))
    assert g.shape == (0, 8) and l.shape == (0,)
    bufs = (torch.empty(4, 128, dtype=I32), torch.empty(4, dtype=I32), torch.empty(4, 128, dtype=I32))
    gd, dl, pf = ops.build_c128a_topk_metadata(torch.empty(0, dtype=torch.int64), 128, 0, e, BT, 2,
                                               torch.empty(0, dtype=torch.int64), *bufs, 128)
    assert gd.shape == (0, 128) and dl.shape == (0,) and pf.shape == (0, 128)
    gd, _, pf = ops.build_c128a_topk_metadata(torch.empty(0, dtype=torch.int64), 128, 0, e, BT, 2,
                                              torch.empty(0, dtype=torch.int64), *bufs, 128, max_seq_len=0)
    assert gd.shape == (0, 0) and pf.shape == (0, 0)
    ci, cl = ops.combine_topk_swa_indices(torch.empty(0, 8, dtype=I32), i32([0]), e, e, 128, 4, 8, 300, 100)
    assert ci.shape == (0, 256) and cl.shape == (0,)


# ------------------------------------------------------------------------------------------------ vLLM's call sites
def vllm_step(dev):
    """One mixed step (2 decode requests, 2 prefill requests, decode first; padding in the persistent
    buffers), every op called with the argument expressions of vLLM's metadata builders and of
    DeepseekV4FlashMLAAttention's decode / prefill paths; results against the per-token loops."""
    g = torch.Generator().manual_seed(11)
    W, topk_tokens, max_model_len, max_tokens = 128, 8, 4096, 32
    query_lens, seq_lens_l = [1, 1, 5, 3], [700, 301, 130, 3]
    num_decodes, num_prefills, num_decode_tokens = 2, 2, 2
    num_actual_tokens = sum(query_lens)
    query_start_loc = torch.tensor([0, 1, 2, 7, 10], dtype=I32, device=dev)
    seq_lens = torch.tensor(seq_lens_l, dtype=I32, device=dev)
    block_table_tensor = torch.randperm(4 * 12, generator=g).view(4, 12).to(I32).to(dev)    # kernel block 256
    slot_mapping = torch.arange(num_actual_tokens, dtype=torch.int64)
    slot_mapping[8] = -1                                                                    # a padding token
    slot_mapping = slot_mapping.to(dev)
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens_l)]).to(dev)
    # SWA builder buffers (max_tokens rows; the step uses the first ones)
    token_to_req_indices = torch.zeros(max_tokens, dtype=I32)
    token_to_req_indices[:num_actual_tokens] = torch.repeat_interleave(torch.arange(4), torch.tensor(query_lens))
    token_to_req_indices = token_to_req_indices.to(dev)
    is_valid_token = torch.zeros(max_tokens, dtype=torch.bool, device=dev)
    is_valid_token[:num_actual_tokens] = slot_mapping >= 0
    decode_swa_indices = torch.full((max_tokens, 1, W), POISON, dtype=I32, device=dev)
    decode_swa_lens = torch.full((max_tokens,), POISON, dtype=I32, device=dev)
    swa_bt = torch.randperm(4 * 12 * 4, generator=g)[:4 * 12].view(4, 12).to(I32).to(dev)  # SWA block 64
    c = {k: v.cpu() for k, v in dict(qsl=query_start_loc, seq=seq_lens, bt=block_table_tensor, sm=slot_mapping,
                                     pos=positions, t2r=token_to_req_indices, valid=is_valid_token,
                                     swa_bt=swa_bt).items()}
    ops.compute_swa_indices_and_lens(decode_swa_indices, decode_swa_lens, W, query_start_loc, seq_lens,
                                     token_to_req_indices, is_valid_token, swa_bt, 64, 0, num_decode_tokens)
    rows, lens = loop_swa(W, c["qsl"], c["seq"], c["t2r"], c["valid"], c["swa_bt"], 64, range(2))
    assert decode_swa_indices[:2, 0].tolist() == rows and decode_swa_lens[:2].tolist() == lens
    assert (decode_swa_lens[2:] == POISON).all()
    pfx_gather_lens = torch.empty(num_prefills, dtype=I32, device=dev)
    ops.compute_prefill_gather_lens(pfx_gather_lens, seq_lens, query_start_loc, num_prefills, num_decodes, W)
    assert pfx_gather_lens.tolist() == [5 + 125, 3]
    # FlashMLA builder: compressed slot mapping (C4) into its persistent int64 buffer
    compressed_slot_mapping_buffer = torch.full((max_tokens,), POISON, dtype=torch.int64, device=dev)
    slots = ops.get_compressed_slot_mapping(num_actual_tokens, query_start_loc, seq_lens,
                                            block_table_tensor.clamp(min=0), 256 // 4, 4,
                                            out=compressed_slot_mapping_buffer)
    assert slots.tolist() == loop_compressed_slots(num_actual_tokens, c["qsl"], c["seq"], c["bt"], 64, 4)
    assert (compressed_slot_mapping_buffer[num_actual_tokens:] == -1).all()
    # C128A builder (compress_ratio 128, block_size 256 // 128)
    c128a_max = -(-(-(-max_model_len // 128)) // 128) * 128
    gbuf, lbuf, pbuf = (torch.full((max_tokens, c128a_max), POISON, dtype=I32, device=dev),
                        torch.full((max_tokens,), POISON, dtype=I32, device=dev),
                        torch.full((max_tokens, c128a_max), POISON, dtype=I32, device=dev))
    global_decode, decode_lens, prefill_local = ops.build_c128a_topk_metadata(
        positions[:num_actual_tokens], 128, num_decode_tokens, token_to_req_indices,
        block_table_tensor[:num_decodes], 256 // 128, slot_mapping, gbuf, lbuf, pbuf,
        max_compressed_tokens=c128a_max)
    e_gd, e_dl, e_pf = loop_c128a(c["pos"], 128, 2, c["t2r"], c["bt"], 2, c["sm"], c128a_max, c128a_max)
    assert global_decode.view(num_decode_tokens, 1, -1)[:, 0].tolist() == e_gd and decode_lens.tolist() == e_dl
    assert prefill_local.tolist() == e_pf
    # C4A decode: local top-k from the indexer's buffer -> global slots
    topk_indices_buffer = torch.full((max_tokens, topk_tokens), -1, dtype=I32)
    topk_indices_buffer[:num_actual_tokens] = _local_topk(dict(T=num_actual_tokens, pos=c["pos"],
                                                               valid=torch.ones(num_actual_tokens, dtype=bool)),
                                                          topk_tokens, 4, g)
    topk_indices_buffer = topk_indices_buffer.to(dev)
    global_indices, topk_lens = ops.compute_global_topk_indices_and_lens(
        topk_indices_buffer[:num_decode_tokens], token_to_req_indices, block_table_tensor[:num_decodes], 64,
        is_valid_token[:num_decode_tokens])
    rows, lens = loop_global_topk(topk_indices_buffer[:2].cpu(), c["t2r"], c["bt"], 64, c["valid"])
    assert global_indices.view(num_decode_tokens, 1, -1)[:, 0].tolist() == rows and topk_lens.tolist() == lens
    # C4A prefill: one chunk of both prefill requests into the workspace
    seq_lens_pf, gather_lens = seq_lens[num_decodes:], pfx_gather_lens
    N = int((seq_lens_pf // 4).max())
    Mrows = N + int(gather_lens.max())
    combined_indices_buffer = torch.full((8, 256), POISON, dtype=I32, device=dev)
    combined_lens_buffer = torch.full((8,), POISON, dtype=I32, device=dev)
    topk_indices = topk_indices_buffer[num_decode_tokens:][:num_actual_tokens - num_decode_tokens]
    combined_indices, combined_lens = ops.combine_topk_swa_indices(
        topk_indices[0:8], query_start_loc[num_decodes + 0:num_decodes + 2 + 1], seq_lens_pf[0:2], gather_lens[0:2],
        W, 4, topk_tokens, Mrows, N, combined_indices=combined_indices_buffer, combined_lens=combined_lens_buffer)
    rows, lens = loop_combine(topk_indices[0:8].cpu(), c["qsl"][2:5], c["seq"][2:], gather_lens.cpu(), W, 4,
                              topk_tokens, Mrows, N, 256)
    assert combined_indices.tolist() == rows and combined_lens.tolist() == lens


def test_a_vllm_step_in_vllms_positional_forms():
    vllm_step("cpu")


# ------------------------------------------------------------------------------------------------ the kernels
# Garbage of every kind the structure allows (non-monotone query_start_loc, negative or huge ids, pages,
# positions, lengths): the Triton kernels must produce exactly the oracle's bytes in every buffer.
def garbage_cases(seed, scale=1):
    """[(op, args, kwargs)] with CPU tensors; ``scale`` grows the batch (GPU runs)."""
    g = torch.Generator().manual_seed(seed)

    def ri(lo, hi, *shape, dtype=I32):
        if not shape:
            return int(torch.randint(lo, hi, (), generator=g))
        return torch.randint(lo, hi, shape, generator=g, dtype=dtype)

    def pick(*xs):
        return xs[ri(0, len(xs))]

    def qsl_of(R, span):
        q = torch.sort(ri(0, span + 1, R + 1)).values if ri(0, 4) else ri(-2, span + 3, R + 1)
        return q + ri(0, 3)                                     # a chunk's slice does not start at 0

    def table(R):
        return ri(-2, 40 * scale, R, ri(0, 6))

    cases = []
    R, T = ri(0, 5 * scale), ri(0, 12 * scale)
    out = pick(None, torch.full((T + ri(0, 4),), POISON, dtype=torch.int64))
    world = pick(1, 2, 3)
    cases.append(("get_compressed_slot_mapping", (T, qsl_of(R, T), ri(-3, 300, R), table(R), pick(2, 16, 64),
                                                  pick(1, 4, 8), out, world, ri(0, world), pick(1, 2, 4)), {}))
    out = pick(None, torch.full((T + ri(0, 4),), POISON, dtype=torch.int64))     # vLLM 0.33: own slots, DCP
    cases.append(("get_compressed_slot_mapping", (T, qsl_of(R, T), ri(-3, 300, R), table(R), pick(2, 16, 64),
                                                  pick(1, 4, 8), out, world, 0, pick(1, 4, 8)),
                  dict(slot_mapping=ri(-2, 50, T + ri(-2, 3) if T > 1 else T, dtype=torch.int64),
                       cp_over_positions=bool(ri(0, 2)))))
    R, W, n = ri(0, 5 * scale), pick(1, 3, 8, 128), ri(0, 10 * scale)
    off = ri(0, 3)
    store = torch.full((n + ri(0, 2), 1 + ri(0, 2), W), POISON, dtype=I32)
    idx = store if store.shape[1] == 1 else store[:, 1, :]
    cases.append(("compute_swa_indices_and_lens",
                  (idx, torch.full((idx.shape[0],), POISON, dtype=I32), W, qsl_of(R, n), ri(-3, 200, R),
                   ri(-2, R + 3, off + idx.shape[0] + ri(0, 2)), ri(0, 2, off + idx.shape[0] + 2).bool(), table(R),
                   pick(1, 4, 64), off,
                   pick(None, n)), dict(needs_constant_topk=bool(ri(0, 2)))))
    R = ri(0, 6 * scale)
    nd = ri(0, R + 1)
    npf = ri(0, R - nd + 1)
    cases.append(("compute_prefill_gather_lens", (torch.full((npf + 1,), POISON, dtype=I32), ri(-3, 500, R),
                                                  qsl_of(R, 20), npf, nd, pick(1, 4, 128)), {}))
    T, K = ri(0, 8 * scale), ri(0, 10)
    loc = ri(-3, 400, T, K + ri(0, 3))[:, :K]
    R = ri(0, 5)
    bufs = pick(None, (torch.full((T, K), POISON, dtype=I32), torch.full((T,), POISON, dtype=I32)))
    cases.append(("compute_global_topk_indices_and_lens",
                  (loc, ri(-2, R + 3, T + ri(0, 3)), table(R), pick(1, 8, 64), pick(ri(0, 2, T + 1).bool(),
                                                                                  ri(0, 2, T + 1)), bufs),
                  dict(needs_constant_topk=bool(ri(0, 2)))))
    T = ri(0, 8 * scale)
    nd = ri(0, T + 1)
    cap = ri(1, 40)
    width = cap + ri(0, 4)
    cases.append(("build_c128a_topk_metadata",
                  (ri(-5, 6000, T, dtype=torch.int64), 128, nd, ri(-2, 7, nd + ri(0, 2)), table(ri(0, 5)), pick(1, 2),
                   ri(-2, 5, nd + ri(0, 2), dtype=torch.int64), torch.full((nd + ri(0, 2), width), POISON, dtype=I32),
                   torch.full((nd + ri(0, 2),), POISON, dtype=I32), torch.full((T - nd + ri(0, 2), width), POISON,
                                                                                dtype=I32), cap),
                  dict(max_seq_len=pick(None, ri(0, 7000)), needs_constant_topk=bool(ri(0, 2)))))
    R, T, K = ri(0, 5 * scale), ri(0, 10 * scale), ri(0, 10)
    topk, W, N, IW = ri(0, K + 1), pick(1, 4, 128), ri(0, 60), pick(0, ri(0, 200))
    width = M.combined_width(topk, W, IW)
    ci = pick(None, torch.full((T + ri(0, 2), width + pick(0, 128)), POISON, dtype=I32))
    cl = pick(None, torch.full((T + ri(0, 2),), POISON, dtype=I32))
    vis = pick(False, True)                    # in-image visibility, garbage values (negative, past the row)
    left, right = (ri(-3, 300, T + ri(0, 2)) if vis else None for _ in range(2))
    cases.append(("combine_topk_swa_indices",
                  (ri(-3, 80, T, K), qsl_of(R, T), ri(-3, 400, R), ri(-3, 400, R), W, pick(1, 4, 128), topk,
                   N + ri(1, 300), N), dict(combined_indices=ci, combined_lens=cl, left_visible=left,
                                            right_visible=right, max_image_tokens=IW)))
    return cases


def batch_cases(seed, **kw):
    """[(op, args, kwargs)]: every op on one consistent random step with padding (random_batch)."""
    b = random_batch(seed, **kw)
    g, T, R = b["g"], b["T"], b["R"]
    t2r = _garbage_t2r(b, g)
    cases = [("get_compressed_slot_mapping", (T, b["qsl"], b["seq"], b["bt"], 64, 4,
                                              torch.full((T + 3,), POISON, dtype=torch.int64)), {}),
             ("get_compressed_slot_mapping", (T, b["qsl"], b["seq"], b["bt"], 2, 128), {}),
             ("compute_swa_indices_and_lens", (torch.full((T, 1, 128), POISON, dtype=I32),
                                               torch.full((T,), POISON, dtype=I32), 128, b["qsl"], b["seq"], t2r,
                                               b["valid"], b["bt"], 64), {}),
             ("compute_prefill_gather_lens", (torch.full((R,), POISON, dtype=I32), b["seq"], b["qsl"], R, 0, 128), {}),
             ("compute_global_topk_indices_and_lens", (_local_topk(b, 16, 4, g), t2r, b["bt"], 64, b["valid"]), {})]
    nd = int(torch.randint(0, T + 1, (), generator=g))
    cases.append(("build_c128a_topk_metadata", (b["pos"], 128, nd, t2r, b["bt"], 2, b["slot"],
                                                torch.full((T, 128), POISON, dtype=I32),
                                                torch.full((T,), POISON, dtype=I32),
                                                torch.full((T, 128), POISON, dtype=I32), 128), {}))
    ql = (b["qsl"][1:] - b["qsl"][:-1]).long()
    gl = (ql + torch.clamp(b["seq"].long() - ql, max=127)).to(I32)
    real = torch.arange(T) < b["Treal"]
    N = int(b["seq"].max()) // 4 + 1 if R else 1
    cases.append(("combine_topk_swa_indices", (_local_topk(b, 16, 4, g, real), b["qsl"], b["seq"], gl, 128, 4, 16,
                                               N + 128 + int(ql.max() if R else 0), N), {}))
    return cases


def _to(x, device):
    if isinstance(x, torch.Tensor):
        return x.clone().to(device)
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_to(y, device) for y in x)
    return x


def _flat(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for y in x for t in _flat(y)]
    return [x] if x is None else []


def check_kernel_case(op, args, kwargs, kernel, device):
    """Run the oracle (CPU) and ``kernel`` (device) on copies; every buffer and result must be equal."""
    ra, rk = _to(args, "cpu"), _to(kwargs, "cpu")
    ka, kk = _to(args, device), _to(kwargs, device)
    want = getattr(M, op)(*ra, **rk)
    got = kernel(*ka, **kk)
    for a, b in zip(_flat([want, ra, list(rk.values())]), _flat([got, ka, list(kk.values())])):
        if a is None:
            assert b is None, op
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, (op, a.shape, b.shape)
        assert torch.equal(a, b.cpu()), (op, a, b.cpu())


def kernel_of(op):
    import importlib
    return getattr(importlib.import_module(f"dsv4_rocm.triton.metadata.{op}"), op)


def interpreter_main(seeds=range(40)):
    patch_interpreter_scalars()
    counts = {}
    for seed in seeds:
        for op, args, kwargs in garbage_cases(seed) + batch_cases(seed, max_prefix=300):
            check_kernel_case(op, args, kwargs, kernel_of(op), "cpu")
            counts[op] = counts.get(op, 0) + 1
    # the hand-built and vLLM cases of this file, through the kernels
    loc, qsl, seq, gl = i32([[1, 0, -1], [5, 2, 7], [0, -1, -1]]), i32([5, 7, 8]), i32([10, 3]), i32([5, 3])
    check_kernel_case("combine_topk_swa_indices", (loc, qsl, seq, gl, 4, 4, 3, 20, 8), {},
                      kernel_of("combine_topk_swa_indices"), "cpu")
    for ratio, topk, with_image in SPAN_CASES:          # vLLM's image-span cases, through the kernel
        args, kw, rows, lens = span_case(ratio, topk, with_image)
        idx, got_lens = kernel_of("combine_topk_swa_indices")(*args, **kw)
        assert got_lens.tolist() == lens and idx.tolist() == rows, (ratio, topk, with_image)
        counts["image spans"] = counts.get("image spans", 0) + 1
    for ratio, topk, query_len in REPLAY_CASES:         # vLLM's bounded SWA replay cases, through the kernel
        args, rows, lens = replay_case(ratio, topk, query_len)
        idx, got_lens = kernel_of("combine_topk_swa_indices")(*args)
        assert got_lens.tolist() == lens and idx.tolist() == rows, (ratio, topk, query_len)
        counts["replay start"] = counts.get("replay start", 0) + 1
    args, want = num_states_case()                      # vLLM's num_states case: only -1 is padding
    got = kernel_of("get_compressed_slot_mapping")(args[0], *args[2:], slot_mapping=args[1], cp_over_positions=True)
    assert got.tolist() == want
    counts["slot -123 is not padding"] = 1
    for case in GLOBAL_BOUNDS.values():
        check_kernel_case("compute_global_topk_indices_and_lens", (i32(case[0]), i32(case[1]), i32(case[2]), 64,
                                                                   torch.ones(len(case[0]), dtype=torch.bool)), {},
                          kernel_of("compute_global_topk_indices_and_lens"), "cpu")
    for op, args, kwargs, _ in int32_cases():
        check_kernel_case(op, args, kwargs, kernel_of(op), "cpu")
        counts[op] = counts.get(op, 0) + 1
    from types import SimpleNamespace
    decode_step("cpu", SimpleNamespace(**{op: kernel_of(op) for op in ops.metadata.__all__}), capture=False, B=16)
    print("interpreter cases passed:", counts)


def test_triton_kernels_under_interpreter():
    """Every kernel's integer logic, run by TRITON_INTERPRET=1 (set before triton is imported, hence a
    subprocess), equals the oracle byte for byte on random garbage batches, vLLM's bounds cases and tables
    naming blocks past 2**25 (slots past int32)."""
    r = run_file_interpreted(__file__)
    assert r.returncode == 0 and "interpreter cases passed" in r.stdout


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("scale", [1, 40])
def test_triton_kernels_equal_the_oracle_on_gpu(scale):
    counts = {}
    for seed in range(60 if scale == 1 else 10):
        cases = garbage_cases(seed, scale) + batch_cases(seed, max_reqs=5 * scale, max_prefix=3000 * scale)
        for op, args, kwargs in cases:
            check_kernel_case(op, args, kwargs, kernel_of(op), "cuda")
            counts[op] = counts.get(op, 0) + 1
    print("GPU cases equal to the oracle:", counts)


@pytest.mark.gpu
@pytest.mark.parametrize("level", ["auto", "full"])
def test_padding_answers_on_the_gpu(level, gpu):
    """vLLM's bounds cases and the slots past int32 through the public ops on GPU tensors (Triton), on the
    default path and under validation("full"): the same answer as on CPU, no error."""
    with ops.validation(level):
        for loc, t2r, bt, rows, lens in GLOBAL_BOUNDS.values():
            g, ln = ops.compute_global_topk_indices_and_lens(i32(loc).to(gpu), i32(t2r).to(gpu), i32(bt).to(gpu), 64,
                                                             torch.ones(len(loc), dtype=torch.bool, device=gpu))
            assert g.tolist() == rows and ln.tolist() == lens
        for op, args, kwargs, (rows, lens) in int32_cases():
            res = getattr(ops, op)(*_to(args, gpu), **kwargs)
            assert res[0].tolist() == rows and res[1].tolist() == lens, op


@pytest.mark.gpu
def test_ops_on_gpu_run_triton_and_accept_vllm_step():
    for op in ops.metadata.__all__:
        assert ops.backend_for(op, "cuda") == "triton", op
    vllm_step("cuda")
    b = random_batch(5, max_reqs=64, max_q=3, max_prefix=20000)
    dev = torch.device("cuda")
    out = torch.full((b["T"] + 5,), POISON, dtype=torch.int64, device=dev)
    got = ops.get_compressed_slot_mapping(b["T"], b["qsl"].to(dev), b["seq"].to(dev), b["bt"].to(dev), 64, 4, out=out)
    assert got.cpu().tolist() == loop_compressed_slots(b["T"], b["qsl"], b["seq"], b["bt"], 64, 4)


def decode_step(dev, impl, capture, B=128):
    """The decode-step metadata ops of a b=B step (compressed slots, SWA windows, C4 global top-k, C128A)
    on fixed buffers, run (or captured once, with ``capture``, and replayed) on three new steps (new
    sequence lengths, padding, top-k): each equals the oracle."""
    W, K, cap = 128, 512, 1024
    g = torch.Generator().manual_seed(0)
    qsl = torch.arange(B + 1, dtype=I32, device=dev)
    seq = torch.empty(B, dtype=I32, device=dev)
    t2r = torch.arange(B, dtype=I32, device=dev)
    valid = torch.empty(B, dtype=torch.bool, device=dev)
    slot = torch.empty(B, dtype=torch.int64, device=dev)
    pos = torch.empty(B, dtype=torch.int64, device=dev)
    bt = torch.randperm(B * 1600, generator=g).view(B, 1600).to(I32).to(dev)     # 100K tokens of 64-token pages
    loc = torch.empty(B, K, dtype=I32, device=dev)
    comp_out = torch.empty(B + 8, dtype=torch.int64, device=dev)
    swa_idx, swa_len = torch.empty(B, 1, W, dtype=I32, device=dev), torch.empty(B, dtype=I32, device=dev)
    g_idx, g_len = torch.empty(B, K, dtype=I32, device=dev), torch.empty(B, dtype=I32, device=dev)
    c_buf = (torch.empty(B, cap, dtype=I32, device=dev), torch.empty(B, dtype=I32, device=dev),
             torch.empty(0, cap, dtype=I32, device=dev))

    def step():
        impl.get_compressed_slot_mapping(B, qsl, seq, bt, 64, 4, out=comp_out)
        impl.compute_swa_indices_and_lens(swa_idx, swa_len, W, qsl, seq, t2r, valid, bt, 64)
        impl.compute_global_topk_indices_and_lens(loc, t2r, bt, 64, valid, (g_idx, g_len))
        impl.build_c128a_topk_metadata(pos, 128, B, t2r, bt, 2, slot, *c_buf, cap)

    def new_step(s):
        gg = torch.Generator().manual_seed(s)
        sl = torch.randint(1, 100000, (B,), generator=gg)
        v = torch.rand(B, generator=gg) < 0.9
        seq.copy_(sl)
        valid.copy_(v)
        slot.copy_(torch.where(v, torch.arange(B), torch.full((B,), -1)))
        pos.copy_(sl - 1)
        n = (sl // 4).clamp(min=1)
        loc.copy_(torch.where(torch.arange(K) < n[:, None], (torch.rand(B, K, generator=gg) * n[:, None]).long(),
                              torch.full((B, K), -1)))

    def oracle():
        c = [t.cpu() for t in (qsl, seq, t2r, valid, slot, pos, bt, loc)]
        q, sl, tr, v, sm, p, table, lc = c
        e = [M.get_compressed_slot_mapping(B, q, sl, table, 64, 4, out=comp_out.cpu())]
        e += list(M.compute_swa_indices_and_lens(swa_idx.cpu(), swa_len.cpu(), W, q, sl, tr, v, table, 64))
        e += list(M.compute_global_topk_indices_and_lens(lc, tr, table, 64, v))
        e += list(M.build_c128a_topk_metadata(p, 128, B, tr, table, 2, sm, *[x.cpu() for x in c_buf], cap)[:2])
        return e

    new_step(1)
    step()
    replay = step
    if capture:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        replay = graph.replay
    for s in (2, 3, 4):
        new_step(s)
        replay()
        got = [comp_out[:B], swa_idx, swa_len, g_idx, g_len, c_buf[0], c_buf[1]]
        for w, x in zip(oracle(), got):
            assert torch.equal(w, x.cpu())


@pytest.mark.gpu
def test_decode_step_metadata_in_a_cuda_graph():
    decode_step(torch.device("cuda"), ops, capture=True)


if __name__ == "__main__":
    interpreter_main()
