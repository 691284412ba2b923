"""A decode step of each DeepSeek-V4.1 layer kind at V4.1-Flash dims, op by op beside each op's floor, and
the whole step replayed from one graph.

Case: 64 local heads (TP 1), 32 index heads, b = 128 decode requests, context 8192, caches filled with
valid records. Kinds (V4.1-Flash layers): sliding window (0), ratio-2 kv source (2), a layer reading its
caches and top-k (3), the ratio-1 kv source and candidate source (20), a layer reading its caches (21), an
index source scoring inside the candidates (24). As for the V4.0 step (dsv4_rocm/bench/layer.py) the
region timed is the attention work between the dense projections' outputs and the wo_a output, in the
layer's order (dsv4_rocm/attention.py, dsv4_rocm/layer_parts.py): q / kv RMSNorm, q RoPE and the kv insert, the step's index
sets (V4.0 and V4.1 sets: every layer of a step reads them), then by kind the compressor (ring save and
pooling into latents, their records), the index keys, the indexer's q quant, paged logits, candidate
blocks (select or mask), top-k, the global slots of the top-k, sparse attention, inverse RoPE + FP8
quant, the wo_a einsum. The dense projections (wq_a / wkv, wq_b, the compressor's kv_score, wk, the
indexer's wq_b and weights_proj, wo_b) are matmuls and stay out; their outputs are inputs here.

Each op's floor is max(bytes / copy bandwidth, FLOP / matrix rate), bytes counted once; a step's row
gives the ratio of its graph time to the sum of its ops' floors (target <= 1.5). At context 8192 a ratio-1
row sees 8192 entries, 1024 candidate blocks of 8: fewer than the 2048 a candidate source keeps, so its
blocks are all the visible ones (the select writes them; the mask keeps every entry).
"""
import torch

from .. import ops
from ..attention import SharedBuffers
from ..config import get_config
from ..kv_cache import allocate_caches
from ..reference.rope import build_cos_sin_cache
from ..step import V41_COMPRESSED_BLOCK, StepMetadata
from ..weights import LayerWeights
from . import timing

B, CTX = 128, 8192
KINDS = (0, 2, 3, 20, 21, 24)


def _fill(caches, device, g):
    """Every SWA, compressed and indexer-K slot a valid record; the rings random."""
    chunk = 1 << 16
    done = set()
    for c in caches.values():
        views = [(c.swa_view(), 64)]
        if c.comp is not None and id(c.comp) not in done:
            done.add(id(c.comp))
            views.append((c.comp_view(), V41_COMPRESSED_BLOCK))
            n = c.idx.shape[0] * c.idx.shape[1]
            for a in range(0, n, chunk):
                k = torch.randn(min(chunk, n - a), 128, device=device, generator=g).bfloat16()
                ops.indexer_k_quant_and_cache(k, c.idx, torch.arange(a, a + k.shape[0], device=device), 128, "ue8m0")
            if c.ring is not None:
                c.ring.copy_(torch.randn(c.ring.shape, device=device, generator=g))
        for view, bs in views:
            n = view.shape[0] * bs
            for a in range(0, n, chunk):
                k = torch.randn(min(chunk, n - a), 512, device=device, generator=g).bfloat16()
                ops.quantize_and_insert_k_cache(k, view, torch.arange(a, a + k.shape[0], device=device), bs)


def _step(device, g):
    """A decode step of B requests, request i at position CTX - 1 - (i % 4): half the tokens close a ratio-2
    group; the ring block of request i is i."""
    pos = CTX - 1 - (torch.arange(B, device=device) % 4)
    i32 = dict(dtype=torch.int32, device=device)
    swa_bt = torch.randperm(B * CTX // 64, device=device, generator=g).view(B, -1).to(torch.int32)
    comp_bt = torch.randperm(B * CTX // V41_COMPRESSED_BLOCK, device=device, generator=g).view(B, -1).to(torch.int32)
    slot = swa_bt[torch.arange(B, device=device), pos // 64].long() * 64 + pos % 64
    return StepMetadata(torch.arange(B + 1, **i32), (pos + 1).to(torch.int32), pos, slot, swa_bt, comp_bt,
                        torch.arange(B, **i32).view(B, 1), num_decodes=B, num_decode_tokens=B,
                        max_model_len=CTX + 1)


def _ops(layer, cfg, W, cache, shared, step, cs, inputs, bw_terms):
    """[(name, fn, FLOP, bytes, fp8 matrix work)] of one layer kind's decode step (module docstring)."""
    spec = cfg.v41_layer(layer)
    r, T, H, G, K, nh = spec.ratio, B, cfg.local_heads, cfg.local_groups, cfg.index_topk, cfg.index_n_heads
    x, st = inputs, {}
    n_seen = CTX // r if r else 0
    n_cols = -(-(CTX + 1) // r) if r else 0
    closing = B // 2 if r == 2 else B
    out = [
        ("q/kv rmsnorm", lambda: st.update(zip(("qr", "kv"), ops.fused_q_kv_rmsnorm(
            x["qr_kv"][:, :cfg.q_lora_rank], x["qr_kv"][:, cfg.q_lora_rank:], W.q_norm, W.kv_norm, cfg.rms_norm_eps))),
         0, T * (cfg.q_lora_rank + 512) * 2 * 2, False),
        ("q rope, kv insert", lambda: st.update(qp=ops.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(
            x["q"], st["kv"], cache.swa, step.slot_mapping, step.positions, cs, 64, cfg.rms_norm_eps, 64, False)),
         0, T * (H * 512 * 2 * 2 + 512 * 2 + 584 + 256 + 16), False),
        ("step index sets", lambda: step.build((1, 2)), 0, bw_terms["index_bytes"], False),
    ]
    if spec.owns_kv:
        def compress():
            st["latent"] = lat = torch.empty(T, 512, dtype=torch.bfloat16, device=x["q"].device)
            slots = step.compressed_slots[r]
            if r == 2:
                ops.fused_save_compress_norm(x["kv_score2"], step.positions, cache.ring, step.state_slots[2],
                                             step.query_start_loc, step.token_to_req, W.comp_norm, cfg.rms_norm_eps, 2,
                                             lat)
            else:
                ops.fused_save_compress_norm(x["kv_score1"], step.positions, None, slots, None, None, W.comp_norm,
                                             cfg.rms_norm_eps, 1, lat)
        ring = T * 4096 * 2 if r == 2 else 0            # each token's row saved, the ring row of p - 1 read
        out += [("compressor: save + pool + norm", compress, 0, T * 512 * r * 4 + ring + closing * 1024, False),
                ("compressor: rope + record", lambda: ops.rope_quant_insert(
                    st["latent"], step.positions, cs, cache.comp_view(), step.compressed_slots[r], r),
                 0, closing * (1024 + 584), False),
                ("index keys: k_norm + rope + fp8", lambda: ops.indexer_k_norm_rope_store(
                    x["k_pre"], step.positions, cs, W.idx_k_norm, cfg.rms_norm_eps, cache.idx,
                    step.compressed_slots[r], r, False), 0, closing * (256 + 132), False)]
    if spec.owns_index:
        def logits():
            lens = step.v41_lens[r].view(B, 1)
            st["lg"] = ops.fp8_paged_mqa_logits(st["q8"].view(B, 1, nh, 128), cache.idx.unsqueeze(-2), st["wq"], lens,
                                                step.compressed_block_table,
                                                ops.get_paged_mqa_logits_metadata(lens, 64, 1), n_cols)

        def topk():
            lg = st["lg"]
            ops.top_k_per_row_decode(lg, 1, step.v41_lens[r].view(B, 1), shared.topk[:T], T, lg.stride(0),
                                     lg.stride(1), K)
        C = cfg.candidate_topk_blocks
        out += [("indexer q quant", lambda: st.update(zip(("q8", "wq"), ops.fused_indexer_q_rope_quant(
                    step.positions, x["qi"], cs, x["wi"], 128 ** -0.5, nh ** -0.5))), 0,
                 T * nh * (128 * 2 + 2 + 128 + 4), False),
                ("paged logits", logits, 2 * T * n_seen * nh * 128,
                 T * (n_seen * 132 + nh * 132 + n_cols * 4), True)]
        if spec.candidate_source:
            out.append(("candidate blocks: select", lambda: ops.select_candidate_blocks(
                st["lg"], step.v41_lens[r], shared.candidates[:T], cfg.candidate_block_size), 0, T * C * 4, False))
        if spec.uses_candidates:
            out.append(("candidate blocks: mask", lambda: ops.mask_candidate_logits(
                st["lg"], step.v41_lens[r], shared.candidates[:T], cfg.candidate_block_size), 0, T * C * 4, False))
        out.append(("top-k (k=512)", topk, 0, T * (n_cols * 4 + K * 4), False))
    extra = (None, None, None)
    if r:
        out.append(("global top-k slots", lambda: st.update(zip(("gi", "gl"), ops.compute_global_topk_indices_and_lens(
            shared.topk[:T], step.token_to_req, step.compressed_block_table, V41_COMPRESSED_BLOCK,
            step.is_valid_token))), 0, T * K * 4 * 2, False))
    keys = 128 + (K if r else 0)

    def attention():
        e = (cache.comp_view().unsqueeze(-2), st["gi"].unsqueeze(1), st["gl"]) if r else extra
        ops.sparse_mla_decode(st["qp"].unsqueeze(1), cache.swa_view().unsqueeze(-2), step.swa_indices.unsqueeze(1),
                              step.swa_lens, W.attn_sink, *e, cfg.softmax_scale, out=x["attn"].view(T, 1, 64, 512))
    hd = cfg.heads_per_group * 512
    out += [("sparse attention", attention, 2 * T * 64 * keys * 1024, T * (keys * 584 + 64 * 512 * 4), False),
            ("inverse rope + fp8 quant", lambda: st.update(zip(("a8", "sa"), ops.fused_inv_rope_fp8_quant(
                x["attn"][:, :H], step.positions, cs, G, H // G))), 0, T * (H * 512 * 2 + H * 512 + H * 4 * 4), False),
            ("wo_a fp8 einsum", lambda: ops.fp8_einsum("bhr,hdr->bhd", (st["a8"], st["sa"]), (
                W.wo_a8.view(torch.float8_e4m3fn), W.wo_a_s), x["z"]), 2 * T * G * cfg.o_lora_rank * hd,
             G * cfg.o_lora_rank * hd + T * G * (hd + cfg.o_lora_rank * 2), True)]
    return out


def suite(ctx):
    base = f"V4.1 decode step V4.1-Flash h64 b={B} ctx={CTX}"
    if not ctx.wants(base) and not ctx.wants("layer"):
        return
    dev = ctx.device
    cfg = get_config("v4.1-flash")
    g = torch.Generator(device=dev).manual_seed(0)
    caches = allocate_caches(cfg, KINDS, B * CTX // V41_COMPRESSED_BLOCK, B, num_swa_blocks=B * CTX // 64, device=dev)
    _fill(caches, dev, g)
    shared = SharedBuffers.allocate(cfg, B, dev)
    shared.topk.copy_(torch.stack([torch.randperm(CTX // 2, device=dev, generator=g)[:cfg.index_topk]
                                   for _ in range(B)]).to(torch.int32))            # valid entries of either ratio
    step = _step(dev, g)
    step.build((1, 2))
    H, nh = cfg.local_heads, cfg.index_n_heads
    x = dict(qr_kv=torch.randn(B, cfg.q_lora_rank + 512, device=dev, generator=g).bfloat16(),
             q=torch.randn(B, H, 512, device=dev, generator=g).bfloat16(),
             kv_score1=torch.randn(B, 512, device=dev, generator=g),
             kv_score2=torch.randn(B, 1024, device=dev, generator=g),
             k_pre=torch.randn(B, 128, device=dev, generator=g).bfloat16(),
             qi=torch.randn(B, nh, 128, device=dev, generator=g).bfloat16(),
             wi=torch.randn(B, nh, device=dev, generator=g).bfloat16(),
             attn=torch.empty(B, 64, 512, dtype=torch.bfloat16, device=dev),
             z=torch.empty(B, cfg.local_groups, cfg.o_lora_rank, dtype=torch.bfloat16, device=dev))
    terms = dict(index_bytes=B * (128 * 4 + 4 + 8 * 2 + 2 * (8 + 4) + 8))
    f8 = timing.fp8_matmul_rate(str(dev))
    for layer in KINDS:
        spec = cfg.v41_layer(layer)
        name = f"{base} {spec.label}"
        if not ctx.wants(name) and not ctx.wants("layer"):
            continue
        W = LayerWeights.random_v41(cfg, layer, layer, dev)
        cs = build_cos_sin_cache(max_positions=CTX + 2, device=dev, **cfg.v41_rope(layer))
        ops_list = _ops(layer, cfg, W, caches[layer], shared, step, cs, x, terms)

        def eager(ops_list=ops_list):
            for _, fn, _, _, _ in ops_list:
                fn()
            torch.cuda.synchronize()
        eager()
        floor_sum = 0.0
        for op_name, fn, flop, nbytes, fp8 in ops_list:
            ms = timing.time_graph_ms(fn)
            eager()                                   # a graph's outputs die with it: refresh the tensors
            rate = f8 if fp8 else ctx.mm
            floor_sum += max(nbytes / ctx.bw, flop / rate if flop else 0.0) * 1e3
            ctx.add(f"{name}: {op_name}", "graph", ms, flop, nbytes, rate=rate)

        def whole(ops_list=ops_list):
            for _, fn, _, _, _ in ops_list:
                fn()
        ms = timing.time_graph_ms(whole)
        row = ctx.add(f"{name}: whole step", "graph", ms, sum(o[2] for o in ops_list), sum(o[3] for o in ops_list),
                      sum_of_floors_us=floor_sum * 1e3, over_sum_of_floors=ms / floor_sum)
        row["frac_floor"] = floor_sum / ms
        print(f"{name}: whole step {ms * 1e3:.1f} us, sum of the ops' floors {floor_sum * 1e3:.1f} us, "
              f"ratio {ms / floor_sum:.2f} (target <= 1.5)")
