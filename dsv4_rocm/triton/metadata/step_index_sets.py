"""The index sets every layer of a scheduler step shares (``dsv4_rocm.step.StepMetadata``), in one launch.

Math: what StepMetadata.build_from_ops composes from the public metadata ops (dsv4_rocm/step.py), per
token t of the step:
  * request b: the request whose query range [query_start_loc[b], query_start_loc[b+1]) holds t
    (request_index, the count get_compressed_slot_mapping takes); token_to_req = b, -1 for none;
  * is_valid_token = slot_mapping[t] >= 0;
  * from the position p = seq_lens[b] - query_len[b] + (t - query_start_loc[b]) (token_place), for a
    valid token inside its request with p >= 0 (else lens 0 and rows of -1): the SWA window (slots of
    positions max(p - W + 1, 0)..p in the SWA table, compute_swa_indices_and_lens) and, per ratio r, the
    compressed slot entry p // r is written to when (p + 1) % r == 0 (get_compressed_slot_mapping);
  * from positions[t] = q, for a valid token inside a request with q >= 0: per ratio, the compressor
    state slot (state table entry q // sbs, offset q % sbs); C4: the indexer length (q + 1) // 4 (0 for
    the other tokens); C128: the n = min((q + 1) // 128, Kmax) compressed slots of entries 0..n-1 of the
    compressed table, -1 after, and n (build_c128a_topk_metadata with every token a decode token).
A block-table column past the table, a negative page, or a slot past 2**31 - 1 in an int32 output
(swa_indices, c128_indices) gives -1 in place (the length stays), as in the ops; no index is read outside
its tensor.

Layout: a 2-D grid. Program (i, j) owns the BLOCK_T tokens i*BLOCK_T.. and the C128 columns
[j*BLOCK_K, (j+1)*BLOCK_K) of their rows; the j = 0 programs also write every per-token value and the
SWA rows. Every program finds its tokens' requests itself (a few loads of query_start_loc), so one launch
covers a decode step, a prefill step and a mixed one. Outputs are contiguous rows (W and Kmax columns).
"""
import triton
import triton.language as tl

from ... import layout as L
from .._pdl import pdl_start
from ._token_position import paged_slot, request_index, token_place

BLOCK_R = 128


@triton.jit
def _compressed_slot(bt_ptr, row_offset, cols, pos, ok, RATIO: tl.constexpr, BS: tl.constexpr):
    """int64 slot of compressed entry pos // RATIO where the token closes it ((pos + 1) % RATIO == 0)."""
    p = tl.where(ok, pos, 0)
    ok = ok & ((p + 1) % RATIO == 0)
    j = p // RATIO
    col = j // BS
    return paged_slot(bt_ptr, row_offset, col, j % BS, ok & (col < cols), BS, False)


@triton.jit
def _state_slot(bt_ptr, row_offset, cols, pos, ok, SBS: tl.constexpr):
    """int64 compressor-state slot of position pos (-1 for a negative one)."""
    ok = ok & (pos >= 0)
    p = tl.where(ok, pos, 0)
    col = p // SBS
    return paged_slot(bt_ptr, row_offset, col, p % SBS, ok & (col < cols), SBS, False)


@triton.jit
def _c128_entries(pos, ok, kmax):
    """Compressed C128 entries a token at position pos sees: min((pos + 1) // 128, kmax), 0 where not ok."""
    return tl.where(ok & (pos >= 0), tl.minimum((pos + 1) // 128, kmax), 0)


@triton.jit
def _step_index_sets_kernel(
        qsl_ptr, seq_lens_ptr, num_reqs, pos_ptr, slot_ptr, num_tokens, window, kmax,
        swa_bt_ptr, swa_bt_row, swa_bt_cols, comp_bt_ptr, comp_bt_row, comp_bt_cols,
        state_bt_ptr, state_bt_row, state_bt_cols,
        t2r_ptr, valid_ptr, swa_idx_ptr, swa_lens_ptr,
        c4_slot_ptr, c4_state_ptr, idx_lens_ptr, c128_slot_ptr, c128_state_ptr, c128_idx_ptr, c128_lens_ptr,
        SWA_BS: tl.constexpr, C4: tl.constexpr, C4_BS: tl.constexpr, C4_SBS: tl.constexpr,
        C128: tl.constexpr, C128_BS: tl.constexpr, C128_SBS: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr,
        PDL: tl.constexpr = False):
    pdl_start(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = t < num_tokens
    t64 = t.to(tl.int64)
    req = request_index(qsl_ptr, num_reqs, t, BLOCK_R)
    has = live & (req < num_reqs)
    r = tl.where(has, req, 0).to(tl.int64)
    pos_q, inside = token_place(qsl_ptr, seq_lens_ptr, r, t64, has, 0)     # position from seq_lens
    valid = tl.load(slot_ptr + t, mask=live, other=-1) >= 0
    pos = tl.load(pos_ptr + t, mask=live, other=-1).to(tl.int64)          # the positions tensor
    mine = valid & inside                                                 # a real token of a real request
    comp_row = r * comp_bt_row
    if C128:
        n128 = _c128_entries(pos, mine, kmax)
        c = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        c_col = c // C128_BS
        c_ok = (c[None, :] < n128[:, None]) & (c_col[None, :] < comp_bt_cols)
        c_slot = paged_slot(comp_bt_ptr, comp_row[:, None], c_col[None, :], (c % C128_BS)[None, :], c_ok, C128_BS,
                            True)
        tl.store(c128_idx_ptr + t64[:, None] * kmax + c[None, :], c_slot.to(tl.int32),
                 mask=live[:, None] & (c[None, :] < kmax))
    if tl.program_id(1) == 0:
        tl.store(t2r_ptr + t, tl.where(inside, req, -1).to(tl.int32), mask=live)
        tl.store(valid_ptr + t, valid, mask=live)
        ok = mine & (pos_q >= 0)
        start = tl.maximum(pos_q - window + 1, 0)
        n = tl.where(ok, pos_q - start + 1, 0)
        tl.store(swa_lens_ptr + t, n.to(tl.int32), mask=live)
        swa_row = r * swa_bt_row
        for k0 in range(0, window, BLOCK_W):
            k = k0 + tl.arange(0, BLOCK_W)
            q = start[:, None] + k[None, :]
            col = q // SWA_BS
            m = (k[None, :] < n[:, None]) & (col < swa_bt_cols)
            s = paged_slot(swa_bt_ptr, swa_row[:, None], col, q % SWA_BS, m, SWA_BS, True)
            tl.store(swa_idx_ptr + t64[:, None] * window + k[None, :], s.to(tl.int32),
                     mask=live[:, None] & (k[None, :] < window))
        state_row = r * state_bt_row
        if C4:
            tl.store(c4_slot_ptr + t, _compressed_slot(comp_bt_ptr, comp_row, comp_bt_cols, pos_q, ok, 4, C4_BS),
                     mask=live)
            tl.store(c4_state_ptr + t, _state_slot(state_bt_ptr, state_row, state_bt_cols, pos, mine, C4_SBS),
                     mask=live)
            tl.store(idx_lens_ptr + t, tl.where(valid & (pos >= 0), (pos + 1) // 4, 0).to(tl.int32),
                     mask=live)
        if C128:
            tl.store(c128_slot_ptr + t,
                     _compressed_slot(comp_bt_ptr, comp_row, comp_bt_cols, pos_q, ok, 128, C128_BS), mask=live)
            tl.store(c128_state_ptr + t, _state_slot(state_bt_ptr, state_row, state_bt_cols, pos, mine, C128_SBS),
                     mask=live)
            tl.store(c128_lens_ptr + t, _c128_entries(pos, mine, kmax).to(tl.int32), mask=live)


def default_config(num_tokens: int) -> dict:
    """Tokens per program and warps: small blocks so that a decode batch spreads over many programs."""
    return dict(BLOCK_T=8, num_warps=4)


def step_index_sets(query_start_loc, seq_lens, positions, slot_mapping, swa_block_table, compressed_block_table,
                    state_block_table, token_to_req, is_valid_token, swa_indices, swa_lens, c4=None, c128=None,
                    config=None):
    """Launcher (arguments checked by dsv4_rocm.step.StepMetadata.build). Writes token_to_req (int32 [T]),
    is_valid_token (bool [T]), swa_indices (int32 [T, W], contiguous) and swa_lens (int32 [T]); with ``c4`` =
    (compressed slots, state slots, indexer lens) and ``c128`` = (compressed slots, state slots, indices
    int32 [T, Kmax] contiguous, lens) those too."""
    T, W = positions.shape[0], swa_indices.shape[1]
    if T == 0:
        return
    cfg = dict(default_config(T), **(config or {}))
    c4_out = c4 if c4 is not None else (slot_mapping, slot_mapping, swa_lens)        # unused pointers
    c128_out = c128 if c128 is not None else (slot_mapping, slot_mapping, swa_indices, swa_lens)
    kmax = c128_out[2].shape[1] if c128 is not None else 0
    block_k = min(triton.next_power_of_2(max(kmax, 1)), 256)
    grid = (triton.cdiv(T, cfg["BLOCK_T"]), triton.cdiv(kmax, block_k) if c128 is not None and kmax else 1)
    _step_index_sets_kernel[grid](
        query_start_loc, seq_lens, seq_lens.shape[0], positions, slot_mapping, T, W, kmax,
        swa_block_table, swa_block_table.stride(0), swa_block_table.shape[1],
        compressed_block_table, compressed_block_table.stride(0), compressed_block_table.shape[1],
        state_block_table, state_block_table.stride(0), state_block_table.shape[1],
        token_to_req, is_valid_token, swa_indices, swa_lens, *c4_out, *c128_out,
        SWA_BS=L.SWA_BLOCK_SIZE, C4=c4 is not None, C4_BS=L.compressed_block_size(4), C4_SBS=L.state_block_size(4),
        C128=c128 is not None, C128_BS=L.compressed_block_size(128), C128_SBS=L.state_block_size(128),
        BLOCK_T=cfg["BLOCK_T"], BLOCK_R=BLOCK_R, BLOCK_W=min(triton.next_power_of_2(W), 128), BLOCK_K=block_k,
        num_warps=cfg["num_warps"])


COMPILE_SPECS = [
    dict(name="step_index_sets", fn=_step_index_sets_kernel,
         pointers=dict(qsl_ptr="*i32", seq_lens_ptr="*i32", pos_ptr="*i64", slot_ptr="*i64", swa_bt_ptr="*i32",
                       comp_bt_ptr="*i32", state_bt_ptr="*i32", t2r_ptr="*i32", valid_ptr="*i1",
                       swa_idx_ptr="*i32", swa_lens_ptr="*i32", c4_slot_ptr="*i64", c4_state_ptr="*i64",
                       idx_lens_ptr="*i32", c128_slot_ptr="*i64", c128_state_ptr="*i64", c128_idx_ptr="*i32",
                       c128_lens_ptr="*i32"), floats=(),
         constexprs=lambda arch: dict(SWA_BS=L.SWA_BLOCK_SIZE, C4=True, C4_BS=L.compressed_block_size(4),
                                      C4_SBS=L.state_block_size(4), C128=True, C128_BS=L.compressed_block_size(128),
                                      C128_SBS=L.state_block_size(128), BLOCK_T=default_config(128)["BLOCK_T"],
                                      BLOCK_R=BLOCK_R, BLOCK_W=128, BLOCK_K=128),
         options=lambda arch: dict(num_warps=default_config(128)["num_warps"], num_stages=1), matrix=False),
]
