"""A decode step of one C4 layer at V4-Flash dims, op by op beside each op's floor, and the whole step
replayed from one graph.

Case: 64 local heads (TP 1), b = 128 decode requests, context 8192 (2048 compressed entries each),
caches filled with valid records. The region timed is all the attention work between the q / kv
projections' outputs and the wo_a output, in the module's order (``dsv4_rocm.attention``): q / kv
RMSNorm, q norm + RoPE and the kv insert, the main compressor (state save, pooled entries), the indexer
(its compressor, q quant, paged logits, top-k), the step's index sets, sparse attention, inverse RoPE +
FP8 quant and the wo_a einsum. The dense projections (wq_a / wkv, wq_b, the compressors' and indexer's
projections, wo_b) are torch matmuls and stay out.

Each op's floor is max(bytes / copy bandwidth, FLOP / matrix rate) with bytes counted once (inputs read,
outputs written) and the fp8 rate for fp8 matrix work; the step's target is 1.3x the sum of the floors.

The decode front (``ops.decode_front``: the kv half of the q / kv RMSNorm, q norm + RoPE with the kv insert, and
the indexer's q quant in one launch) is timed beside the three ops it replaces, and the whole step twice: with
the unfused ops, and with the fused front in place of the insert and the q quant (the q / kv RMSNorm stays for
its qr half, which wq_b reads).

The step's index sets (``StepMetadata.build``: one kernel, dsv4_rocm/triton/metadata/step_index_sets.py) are timed
beside their peer, the composition of the public metadata ops they replace (``build_from_ops``), for the
C4 sets this layer reads and for both ratios (what a V4 model's step builds for its C4 and C128 layers).
``--sweep`` also times the kernel's launch configurations, each checked against the default first.
"""
import contextlib
import dataclasses
import math

import torch

from .. import layout as L
from .. import ops
from ..config import get_config
from ..kv_cache import LayerCache
from ..reference.compressor import coff, state_block_size
from ..reference.rope import build_cos_sin_cache
from ..step import StepMetadata
from ..triton import _pdl
from ..triton.metadata.step_index_sets import step_index_sets
from ..weights import LayerWeights
from . import timing

B, CTX = 128, 8192
SWEEP_INDEX_SETS = [dict(BLOCK_T=bt, num_warps=w) for bt in (1, 2, 4, 8, 16, 32) for w in (1, 2, 4)]


def _filled_caches(cfg, device, g):
    """Caches of B requests of CTX tokens: every SWA / compressed / indexer slot a valid record; the
    compressor states as rings of a few blocks (a decode step reads only its window)."""
    swa_pages, comp_pages = B * CTX // 64, B * CTX // 256
    ring = 4
    cache = LayerCache.allocate(cfg.layer_type(2), comp_pages, B * ring, device, num_swa_blocks=swa_pages)
    chunk = 1 << 16
    for view, bs, n in ((cache.swa_view(), 64, swa_pages * 64), (cache.comp_view(), 64, comp_pages * 64)):
        for a in range(0, n, chunk):
            k = torch.randn(min(chunk, n - a), 512, device=device, generator=g).bfloat16()
            ops.quantize_and_insert_k_cache(k, view, torch.arange(a, a + k.shape[0], device=device), bs)
    n = comp_pages * 64
    for a in range(0, n, chunk):
        k = torch.randn(min(chunk, n - a), 128, device=device, generator=g).bfloat16()
        ops.indexer_k_quant_and_cache(k, cache.idx_view(), torch.arange(a, a + k.shape[0], device=device), 128,
                                      "ue8m0")
    for st in (cache.comp_state, cache.idx_state):
        st.copy_(torch.randn(st.shape, device=device, generator=g))
    return cache


def _step(device, g, b=B, ctx=CTX):
    """A decode step of b requests: request i at position ctx - 1 - (i % 4), so a quarter of the tokens close a
    C4 window."""
    pos = ctx - 1 - (torch.arange(b, device=device) % 4)
    i32 = dict(dtype=torch.int32, device=device)
    swa_bt = torch.randperm(b * ctx // 64, device=device, generator=g).view(b, -1).to(torch.int32)
    comp_bt = torch.randperm(b * ctx // 256, device=device, generator=g).view(b, -1).to(torch.int32)
    ring = torch.arange(b, device=device).unsqueeze(1) * 4 + torch.arange(ctx // 4, device=device) % 4
    slot = swa_bt[torch.arange(b, device=device), pos // 64].long() * 64 + pos % 64
    return StepMetadata(torch.arange(b + 1, **i32), (pos + 1).to(torch.int32), pos, slot, swa_bt, comp_bt,
                        ring.to(torch.int32), num_decodes=b, num_decode_tokens=b, max_model_len=ctx + 1)


def _unbuilt(step):
    """A step with the same inputs and no index sets of its own (the peer builds into it)."""
    return dataclasses.replace(step, token_to_req=None, is_valid_token=None, swa_indices=None, swa_lens=None,
                               compressed_slots={}, state_slots={}, c128_indices=None, c128_lens=None,
                               indexer_lens=None)


def _index_set_fields(step, ratios):
    out = [step.token_to_req, step.is_valid_token, step.swa_indices, step.swa_lens]
    out += [d[r] for r in ratios for d in (step.compressed_slots, step.state_slots)]
    out += [step.indexer_lens] if 4 in ratios else []
    out += [step.c128_indices, step.c128_lens] if 128 in ratios else []
    return out


def _index_sets(ctx, name, step, nbytes):
    """The index sets of both ratios beside the composition; with --sweep every launch configuration.
    Every variant must give the composition's bytes before it is timed."""
    both = (4, 128)
    peer = _unbuilt(step)
    want = [t.clone() for t in _index_set_fields(peer.build_from_ops(both), both)]
    fused = _unbuilt(step).build(both)
    if not all(torch.equal(a, b) for a, b in zip(_index_set_fields(fused, both), want)):
        raise RuntimeError("step index sets (ratios 4 and 128) differ from the composition of the ops")
    c128_bytes = B * (128 * 4 + 4 + 8 * 2)
    ctx.add(f"{name}: step index sets, ratios 4 + 128", "graph", timing.time_graph_ms(lambda: fused.build(both)), 0,
            nbytes + c128_bytes, peer="composition of the ops", peer_ms=timing.time_graph_ms(
                lambda: peer.build_from_ops(both)))
    for cfg in (SWEEP_INDEX_SETS if ctx.sweep else ()):
        v = _unbuilt(step).build(both)
        c4 = (v.compressed_slots[4], v.state_slots[4], v.indexer_lens)
        c128 = (v.compressed_slots[128], v.state_slots[128], v.c128_indices, v.c128_lens)

        def launch(v=v, c4=c4, c128=c128, cfg=cfg):
            step_index_sets(v.query_start_loc, v.seq_lens, v.positions, v.slot_mapping, v.swa_block_table,
                            v.compressed_block_table, v.state_block_table, v.token_to_req, v.is_valid_token,
                            v.swa_indices, v.swa_lens, c4, c128, config=cfg)
        for t in _index_set_fields(v, both):
            t.fill_(0 if t.dtype == torch.bool else -3)
        launch()
        if not all(torch.equal(a, b) for a, b in zip(_index_set_fields(v, both), want)):
            raise RuntimeError(f"step index sets with {cfg} differ from the composition of the ops")
        ctx.add(f"{name}: step index sets, ratios 4 + 128", f"T{cfg['BLOCK_T']} w{cfg['num_warps']}",
                timing.time_graph_ms(launch), 0, nbytes + c128_bytes)


def _check_front(st, op_front, op_front_ops, dev):
    """The fused front's q and indexer outputs against the three ops' (run second, on the same inputs; the
    cache records they write are the same bytes by the same argument and tests/qkv/test_decode_front.py checks
    them). The q is compared where the unfused norms are the HIP kernels (dsv4_rocm._C built), whose sum order
    the fused kernel follows; their torch references sum in an order of the platform's."""
    op_front()
    got = [st[k].clone() for k in ("qp", "q8", "wq")]
    op_front_ops()
    torch.cuda.synchronize()
    want = [st[k] for k in ("qp", "q8", "wq")]
    same = torch.equal(got[1].view(torch.uint8), want[1].view(torch.uint8)) and torch.equal(
        got[2].view(torch.int32), want[2].view(torch.int32))
    if "hip" in ops.machine_backends(dev):
        same = same and torch.equal(got[0].view(torch.int16), want[0].view(torch.int16))
    if not same:
        raise RuntimeError("the fused decode front differs from the three ops it replaces")


def suite(ctx):
    name = f"C4 decode step V4-Flash h64 b={B} ctx={CTX}"
    if not ctx.wants(name, "layer"):
        return
    dev = ctx.device
    cfg = get_config("v4-flash")
    g = torch.Generator(device=dev).manual_seed(0)
    W = LayerWeights.random(cfg, cfg.layer_type(2), 0, dev)
    cache = _filled_caches(cfg, dev, g)
    step = _step(dev, g)
    cs = build_cos_sin_cache(cfg.compress_rope_theta, CTX + 2, device=dev)
    H, G, K, nh = cfg.local_heads, cfg.local_groups, cfg.index_topk, cfg.index_n_heads
    T = B
    qr_kv = torch.randn(T, cfg.q_lora_rank + 512, device=dev, generator=g).bfloat16()
    q = torch.randn(T, H, 512, device=dev, generator=g).bfloat16()
    kv_score = torch.randn(T, 4 * 512, device=dev, generator=g)
    idx_kv_score = torch.randn(T, 4 * 128, device=dev, generator=g)
    qi = torch.randn(T, nh, 128, device=dev, generator=g).bfloat16()
    wi = torch.randn(T, nh, device=dev, generator=g).bfloat16()
    attn = torch.empty(T, 64, 512, dtype=torch.bfloat16, device=dev)
    z = torch.empty(T, G, cfg.o_lora_rank, dtype=torch.bfloat16, device=dev)
    topk = torch.empty(T, K, dtype=torch.int32, device=dev)
    n_entries = -(-(CTX + 1) // 4)
    bw, mm = ctx.bw, ctx.mm
    f8 = timing.fp8_matmul_rate(str(dev))
    st = {}

    def compress(kvs, state, kvc, r_dim, w_norm, ape, kslots):
        c, dim = coff(4), r_dim
        kv, score = kvs.split([c * dim, c * dim], dim=-1)
        ops.save_partial_states(kv, score, ape, step.positions, state, step.state_slots[4], 4, c * dim, 4)
        ops.compress_norm_rope_store(
            state_cache=state, num_actual=T, token_to_req_indices=step.token_to_req, positions=step.positions,
            slot_mapping=step.state_slots[4], block_table=step.state_block_table, block_size=4, state_width=c * dim,
            cos_sin_cache=cs, kv_cache=kvc, k_cache_metadata=kslots, pdl_kwargs={}, head_dim=dim, rope_head_dim=64,
            compress_ratio=4, overlap=True, use_fp4_cache=False, rms_norm_weight=w_norm, rms_norm_eps=1e-6,
            quant_block=64 if dim == 512 else 128, token_stride=576 if dim == 512 else 128,
            scale_dim=8 if dim == 512 else 4)

    def op_norm():
        st["qr"], st["kv"] = ops.fused_q_kv_rmsnorm(qr_kv[:, :cfg.q_lora_rank], qr_kv[:, cfg.q_lora_rank:], W.q_norm,
                                                    W.kv_norm, 1e-6)

    def op_insert():
        st["qp"] = ops.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(q, st["kv"], cache.swa, step.slot_mapping,
                                                                          step.positions, cs, 64, 1e-6, 64)

    def op_metadata():
        step.build((4,))

    peer_step = _unbuilt(step)

    def op_metadata_ops():                            # the peer: the same sets from the public ops
        peer_step.build_from_ops((4,))

    def op_compressor():
        compress(kv_score, cache.comp_state, cache.comp_view(), 512, W.comp_norm, W.comp_ape, step.compressed_slots[4])

    def op_idx_compressor():
        compress(idx_kv_score, cache.idx_state, cache.idx_view(), 128, W.idx_comp_norm, W.idx_comp_ape,
                 step.compressed_slots[4])

    def op_q_quant():
        st["q8"], st["wq"] = ops.fused_indexer_q_rope_quant(step.positions, qi, cs, wi, 128 ** -0.5, nh ** -0.5)

    def op_front():                                   # the kv half of op_norm, op_insert and op_q_quant in one launch
        st["qp"], (st["q8"], st["wq"]) = ops.decode_front(
            q, qr_kv[:, cfg.q_lora_rank:], W.kv_norm, cache.swa, step.slot_mapping, step.positions, cs, 64, 1e-6, 64,
            index_q=qi, index_weights=wi, index_weights_softmax_scale=128 ** -0.5, index_weights_head_scale=nh ** -0.5)

    def op_front_ops():                               # its peer: the three ops it replaces
        op_norm()
        op_insert()
        op_q_quant()

    def op_logits():
        lens = step.indexer_lens.view(B, 1)
        st["lg"] = ops.fp8_paged_mqa_logits(st["q8"].view(B, 1, nh, 128), cache.idx_view().unsqueeze(-2), st["wq"],
                                            lens, step.compressed_block_table,
                                            ops.get_paged_mqa_logits_metadata(lens, 64, 1), n_entries)

    def op_topk():
        lg = st["lg"]
        ops.top_k_per_row_decode(lg, 1, step.indexer_lens.view(B, 1), topk, T, lg.stride(0), lg.stride(1), K)

    def op_global():
        st["gi"], st["gl"] = ops.compute_global_topk_indices_and_lens(topk, step.token_to_req, step.compressed_block_table,
                                                                     64, step.is_valid_token)

    def op_topk_global():                             # the two ops above in one launch (its epilogue)
        lg = st["lg"]
        st["gi"], st["gl"] = ops.top_k_global_decode(lg, 1, step.indexer_lens.view(B, 1), topk, T, lg.stride(0),
                                                     lg.stride(1), K, step.token_to_req, step.compressed_block_table,
                                                     64, step.is_valid_token)

    def op_attention():
        ops.sparse_mla_decode(st["qp"].unsqueeze(1), cache.swa_view().unsqueeze(-2), step.swa_indices.unsqueeze(1),
                              step.swa_lens, W.attn_sink, cache.comp_view().unsqueeze(-2), st["gi"].unsqueeze(1),
                              st["gl"], cfg.softmax_scale, out=attn.view(T, 1, 64, 512))

    def op_inv_rope():
        st["a8"], st["sa"] = ops.fused_inv_rope_fp8_quant(attn[:, :H], step.positions, cs, G, H // G)

    def op_einsum():
        ops.fp8_einsum("bhr,hdr->bhd", (st["a8"], st["sa"]), (W.wo_a8.view(torch.float8_e4m3fn), W.wo_a_s), z)

    n_entries_seen = CTX / 4                         # compressed entries each token's logits read
    boundary = B / 4                                  # tokens that close a C4 window this step
    hd = cfg.heads_per_group * 512
    index_bytes = T * (128 * 4 + 4 + 8 * 4)
    ops_list = [   # name, fn, FLOP, bytes, matrix rate
        ("q/kv rmsnorm", op_norm, 0, T * (cfg.q_lora_rank + 512) * 2 * 2, mm),
        ("q norm + rope, kv insert", op_insert, 0, T * (H * 512 * 2 * 2 + 512 * 2 + 584 + 256 + 16), mm),
        ("step index sets", op_metadata, 0, index_bytes, mm),
        ("compressor (main)", op_compressor, 0, T * 2 * 2048 * 4 * 2 + boundary * (8 * 1024 * 4 * 2 + 584), mm),
        ("compressor (indexer)", op_idx_compressor, 0, T * 2 * 512 * 4 * 2 + boundary * (8 * 256 * 4 * 2 + 132), mm),
        ("indexer q quant", op_q_quant, 0, T * nh * (128 * 2 + 2 + 128 + 4), mm),
        ("paged logits", op_logits, 2 * T * n_entries_seen * nh * 128, T * (n_entries_seen * 132 + nh * 132 + n_entries * 4), f8),
        ("top-k (k=512)", op_topk, 0, T * (n_entries * 4 + K * 4), mm),
        ("global top-k slots", op_global, 0, T * K * 4 * 2, mm),
        ("sparse attention", op_attention, 2 * T * 64 * (128 + K) * 1024, T * ((128 + K) * 584 + 64 * 512 * 4), mm),
        ("inverse rope + fp8 quant", op_inv_rope, 0, T * (H * 512 * 2 + H * 512 + H * 4 * 4), mm),
        ("wo_a fp8 einsum", op_einsum, 2 * T * G * cfg.o_lora_rank * hd,
         G * cfg.o_lora_rank * hd + T * G * (hd + cfg.o_lora_rank * 2), f8),
    ]
    def eager():                                      # in order: compiles, and fills st with eager tensors
        for _, fn, _, _, _ in ops_list:
            fn()
        torch.cuda.synchronize()
    peers = {"step index sets": ("composition of the ops", op_metadata_ops)}
    eager()
    op_metadata_ops()
    if not all(torch.equal(a, b) for a, b in zip(_index_set_fields(step, (4,)), _index_set_fields(peer_step, (4,)))):
        raise RuntimeError("step index sets differ from the composition of the ops")
    floor_sum = 0.0
    for op_name, fn, flop, nbytes, rate in ops_list:
        ms = timing.time_graph_ms(fn)
        peer, peer_fn = peers.get(op_name, (None, None))
        peer_ms = timing.time_graph_ms(peer_fn) if peer_fn else None
        eager()                                       # a graph's outputs die with it: refresh st
        floor = max(nbytes / bw, flop / rate if flop else 0.0) * 1e3
        floor_sum += floor
        ctx.add(f"{name}: {op_name}", "graph", ms, flop, nbytes, rate=rate, peer=peer, peer_ms=peer_ms)

    # top-k + global slots fused, beside the two ops it replaces (the whole step below runs the ops); the short
    # rows' output order is deterministic, so its rows equal the ops' exactly
    op_topk(), op_global()
    want = [topk.clone(), st["gi"].clone(), st["gl"].clone()]
    op_topk_global()
    if not all(torch.equal(a, b) for a, b in zip((topk, st["gi"], st["gl"]), want)):
        raise RuntimeError("top-k + global slots (fused) differs from top-k then global top-k slots")
    ctx.add(f"{name}: top-k + global slots (fused)", "graph", timing.time_graph_ms(op_topk_global), 0,
            T * (n_entries * 4 + K * 4 * 3), rate=mm, peer="top-k, then global top-k slots",
            peer_ms=timing.time_graph_ms(lambda: (op_topk(), op_global())))
    eager()

    # the fused front beside the three ops it replaces, checked against them first
    front_bytes = T * (H * 512 * 2 + 64 * 512 * 2 + 512 * 2 + 584 + 256 + 16 + nh * (128 * 2 + 2 + 128 + 4))
    _check_front(st, op_front, op_front_ops, dev)
    front_ms = timing.time_graph_ms(op_front)
    eager()
    ctx.add(f"{name}: decode front (fused)", "graph", front_ms, 0, front_bytes, rate=mm, peer="the three ops",
            peer_ms=timing.time_graph_ms(op_front_ops))
    eager()
    front_floor = front_bytes / bw * 1e3
    # the fused step: the q/kv norm stays (its qr half feeds wq_b; its kv half is unused there), the front
    # replaces the insert and the indexer's q quant (in the place of the insert), top-k + global slots the two
    # ops; timed with programmatic dependent launch (on GPUs that have it) and without
    replaced = {"q norm + rope, kv insert", "indexer q quant", "top-k (k=512)", "global top-k slots"}
    fused_list = []
    for item in ops_list:
        if item[0] == "q norm + rope, kv insert":
            fused_list.append(("decode front (fused)", op_front, 0, front_bytes, mm))
        elif item[0] == "top-k (k=512)":
            fused_list.append(("top-k + global slots (fused)", op_topk_global, 0, T * (n_entries * 4 + K * 4 * 3), mm))
        if item[0] not in replaced:
            fused_list.append(item)
    fused_floor_sum = sum(max(b / bw, fl / r if fl else 0.0) * 1e3 for _, _, fl, b, r in fused_list)
    steps = (("whole step", ops_list, floor_sum, contextlib.nullcontext),
             ("whole step, fused front and top-k", fused_list, fused_floor_sum, contextlib.nullcontext),
             ("whole step, fused front and top-k, no PDL", fused_list, fused_floor_sum, _pdl.disabled))
    for label, lst, fsum, launches in steps:
        def whole(lst=lst):
            for _, fn, _, _, _ in lst:
                fn()
        with launches():
            ms = timing.time_graph_ms(whole)
            eager()
        total_flop = sum(f for _, _, f, _, _ in lst)
        total_bytes = sum(b for _, _, _, b, _ in lst)
        row = ctx.add(f"{name}: {label}", "graph", ms, total_flop, total_bytes, sum_of_floors_us=fsum * 1e3,
                      over_sum_of_floors=ms / fsum)
        row["frac_floor"] = fsum / ms
        print(f"{name}: {label} {ms * 1e3:.1f} us, sum of the ops' floors {fsum * 1e3:.1f} us, "
              f"ratio {ms / fsum:.2f} (target <= 1.3)")
    _index_sets(ctx, name, step, index_bytes)
