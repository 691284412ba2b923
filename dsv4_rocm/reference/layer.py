"""One DeepSeek-V4 attention layer over a paged serving batch (DSV4_SPEC §3-8), vLLM's step order.

``layer_forward`` is written against a table of ops (``impl``). With the default table it is the
float reference of the whole layer; ``dsv4_rocm.attention.DeepseekV4Attention`` runs the same steps with
``dsv4_rocm.ops`` so the fast kernels are exercised exactly where the reference uses its own.

Decode requests (query_len <= decode_threshold) attend straight from the fp8 pages (FlashMLA
decode); prefill requests gather a bf16 workspace per chunk of 4 requests and run the sparse prefill
(FlashMLA ``flash_mla_sparse_fwd``), as vLLM does. With ``paged_prefill=True`` prefill tokens attend
straight from the pages too (the same per-token index sets, no workspace copy).
"""
import math
from dataclasses import dataclass, fields
from types import SimpleNamespace
from typing import Optional

import torch

from .. import layout as L
from ..config import AttentionConfig, LayerType
from . import attention, cache, compressor, indexer, metadata, norm, output, qkv

PREFILL_CHUNK_REQUESTS = 4

REFERENCE_IMPL = SimpleNamespace(
    fp8_linear=output.fp8_linear,
    fused_q_kv_rmsnorm=norm.fused_q_kv_rmsnorm,
    fused_qnorm_rope_kv_rope_quant_insert=qkv.fused_qnorm_rope_kv_rope_quant_insert,
    compressor_kv_score=compressor.compressor_kv_score,
    fused_compress_norm_rope_insert=compressor.compress_norm_rope_insert,
    fused_indexer_q_rope_quant=indexer.indexer_q_rope_quant,
    fp8_mqa_logits=indexer.fp8_mqa_logits,
    fp8_paged_mqa_logits=indexer.fp8_paged_mqa_logits,
    top_k_per_row_prefill=indexer.top_k_per_row_prefill,
    top_k_per_row_decode=indexer.top_k_per_row_decode,
    indexer_k_gather=cache.indexer_k_gather,
    dequantize_and_gather_k_cache=cache.dequantize_and_gather_k_cache,
    get_compressed_slot_mapping=metadata.get_compressed_slot_mapping,
    compute_swa_indices_and_lens=metadata.compute_swa_indices_and_lens,
    compute_global_topk_indices_and_lens=metadata.compute_global_topk_indices_and_lens,
    build_c128a_topk_metadata=metadata.build_c128a_topk_metadata,
    combine_topk_swa_indices=metadata.combine_topk_swa_indices,
    sparse_mla_decode=attention.flash_mla_with_kvcache_sparse,
    sparse_mla_prefill=attention.flash_mla_sparse_fwd,
    fused_inv_rope_fp8_quant=output.fused_inv_rope_fp8_quant,
    fp8_einsum=output.fp8_einsum,
)


@dataclass
class LayerWeights:
    """Weights of one attention layer, FP8 ones as (e4m3 bytes, fp32 128x128 block scales)."""
    wqkv8: torch.Tensor; wqkv_s: torch.Tensor          # fused wq_a + wkv: [q_lora + 512, hidden]
    q_norm: torch.Tensor; kv_norm: torch.Tensor        # bf16 [q_lora], [512]
    wq_b8: torch.Tensor; wq_b_s: torch.Tensor          # [H_l * 512, q_lora]
    wo_a8: torch.Tensor; wo_a_s: torch.Tensor          # [G_l, o_lora, (H/G) * 512]
    wo_b8: torch.Tensor; wo_b_s: torch.Tensor          # [hidden, G_l * o_lora]
    attn_sink: torch.Tensor                            # fp32 [padded_heads], -inf past H_l
    comp_w: Optional[torch.Tensor] = None              # bf16 [2 * coff * 512, hidden] (kv | gate)
    comp_ape: Optional[torch.Tensor] = None            # fp32 [r, coff * 512]
    comp_norm: Optional[torch.Tensor] = None           # bf16 [512]
    idx_wq_b8: Optional[torch.Tensor] = None; idx_wq_b_s: Optional[torch.Tensor] = None  # [nh * 128, q_lora]
    idx_wproj: Optional[torch.Tensor] = None           # bf16 [nh, hidden]
    idx_comp_w: Optional[torch.Tensor] = None          # bf16 [2 * 2 * 128, hidden]
    idx_comp_ape: Optional[torch.Tensor] = None        # fp32 [4, 256]
    idx_comp_norm: Optional[torch.Tensor] = None       # bf16 [128]

    @classmethod
    def random(cls, cfg: AttentionConfig, layer_type: LayerType, seed: int = 0, device=None) -> "LayerWeights":
        g = torch.Generator().manual_seed(seed)

        def rn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale).to(device)

        def fp8(n, k, lead=()):
            return output.quantize_weight(rn(*lead, n, k, scale=k ** -0.5))

        H, G = cfg.local_heads, cfg.local_groups
        hid, ql = cfg.hidden_size, cfg.q_lora_rank
        wqkv8, wqkv_s = fp8(ql + 512, hid)
        wq_b8, wq_b_s = fp8(H * 512, ql)
        wo_a8, wo_a_s = fp8(cfg.o_lora_rank, cfg.heads_per_group * 512, lead=(G,))
        wo_b8, wo_b_s = fp8(hid, G * cfg.o_lora_rank)
        sink = torch.full((cfg.padded_heads,), float("-inf"))
        sink[:H] = torch.randn(H, generator=g)
        w = cls(wqkv8, wqkv_s, (1 + 0.1 * rn(ql)).bfloat16(), (1 + 0.1 * rn(512)).bfloat16(), wq_b8, wq_b_s,
                wo_a8, wo_a_s, wo_b8, wo_b_s, sink.to(device))
        if layer_type != LayerType.SWA:
            r = 4 if layer_type == LayerType.C4 else 128
            c = compressor.coff(r)
            w.comp_w = rn(2 * c * 512, hid, scale=2 * hid ** -0.5).bfloat16()
            w.comp_ape = rn(r, c * 512, scale=0.5)
            w.comp_norm = (1 + 0.1 * rn(512)).bfloat16()
        if layer_type == LayerType.C4:
            nh = cfg.index_n_heads
            w.idx_wq_b8, w.idx_wq_b_s = fp8(nh * 128, ql)
            w.idx_wproj = rn(nh, hid, scale=hid ** -0.5).bfloat16()
            w.idx_comp_w = rn(2 * 2 * 128, hid, scale=2 * hid ** -0.5).bfloat16()
            w.idx_comp_ape = rn(4, 256, scale=0.5)
            w.idx_comp_norm = (1 + 0.1 * rn(128)).bfloat16()
        return w

    def to(self, device) -> "LayerWeights":
        return LayerWeights(**{f.name: (None if getattr(self, f.name) is None else getattr(self, f.name).to(device))
                               for f in fields(self)})


@dataclass
class LayerCache:
    """Paged caches of one layer: SWA (block 64), compressed (64 for C4, 2 for C128), indexer K (64),
    and the compressor state rings (one per request slot)."""
    swa: torch.Tensor
    comp: Optional[torch.Tensor] = None
    idx: Optional[torch.Tensor] = None
    comp_state: Optional[torch.Tensor] = None
    idx_state: Optional[torch.Tensor] = None

    @classmethod
    def allocate(cls, layer_type: LayerType, num_blocks: int, num_state_slots: int, device=None) -> "LayerCache":
        c = cls(swa=cache.new_cache(num_blocks, L.SWA_BLOCK_SIZE, device))
        if layer_type != LayerType.SWA:
            r = 4 if layer_type == LayerType.C4 else 128
            c.comp = cache.new_cache(num_blocks, L.compressed_block_size(r), device)
            c.comp_state = compressor.new_state(num_state_slots, r, 512, device)
        if layer_type == LayerType.C4:
            c.idx = cache.new_cache(num_blocks, 64, device, indexer=True)
            c.idx_state = compressor.new_state(num_state_slots, 4, 128, device)
        return c


@dataclass
class StepBatch:
    """One scheduler step. Tokens are grouped by request; positions are absolute.
    swa_block_table: logical 64-token blocks; compressed_block_table: logical 256-position blocks
    (entry j of a compressed cache lives at page bt[j // (256/r)]); state_indices: ring per request."""
    query_start_loc: torch.Tensor      # int32 [B + 1]
    seq_lens: torch.Tensor             # int32 [B], tokens of each request after this step
    positions: torch.Tensor            # int64 [T]
    swa_block_table: torch.Tensor      # int32 [B, nb]
    compressed_block_table: torch.Tensor
    state_indices: torch.Tensor        # int32 [B]
    slot_mapping: Optional[torch.Tensor] = None  # int64 [T]; derived from swa_block_table if None

    @property
    def query_lens(self):
        return self.query_start_loc[1:] - self.query_start_loc[:-1]


def _layer_ratio(layer_type: LayerType) -> int:
    return {LayerType.SWA: 1, LayerType.C4: 4, LayerType.C128: 128}[layer_type]


def _indexer_topk(cfg, impl, W, cache_, batch, x, qr, positions, t2r, slot_mapping, is_dec_tok, cos_sin):
    """Lightning indexer of a C4 layer: writes the indexer K cache, returns local top-k [T, K]."""
    T = x.shape[0]
    nh = cfg.index_n_heads
    kvi, sci = impl.compressor_kv_score(x, W.idx_comp_w, W.idx_comp_ape, positions, 4)
    islots = impl.get_compressed_slot_mapping(positions, t2r, batch.compressed_block_table, 4, 64, slot_mapping)
    impl.fused_compress_norm_rope_insert(kvi, sci, positions, batch.query_start_loc, cache_.idx_state,
                                         batch.state_indices, W.idx_comp_norm, cos_sin, islots, cache_.idx, 64, 4,
                                         "indexer", cfg.rms_norm_eps)
    qi = impl.fp8_linear(qr, W.idx_wq_b8, W.idx_wq_b_s).view(T, nh, 128)
    wi = (x.float() @ W.idx_wproj.float().t()).to(torch.bfloat16)
    q8, wq = impl.fused_indexer_q_rope_quant(qi, positions, cos_sin, wi)
    K = cfg.index_topk
    topk = torch.full((T, K), -1, dtype=torch.int32, device=x.device)
    n_vis = (positions.long() + 1) // 4
    dec = torch.nonzero(is_dec_tok).flatten()
    if dec.numel():
        cl = n_vis[dec]
        mcl = max(int(cl.max()), 1)
        lg = impl.fp8_paged_mqa_logits(q8[dec].unsqueeze(1), cache_.idx, wq[dec], cl.to(torch.int32),
                                       batch.compressed_block_table[t2r[dec]], 64, mcl)
        top = torch.empty(dec.numel(), K, dtype=torch.int32, device=x.device)
        impl.top_k_per_row_decode(lg, 1, cl.to(torch.int32), top, dec.numel(), lg.stride(0), lg.stride(1), K)
        topk[dec] = top
    qsl = batch.query_start_loc
    for b in range(qsl.shape[0] - 1):
        a, e = int(qsl[b]), int(qsl[b + 1])
        if e == a or bool(is_dec_tok[a]):
            continue
        n = int(batch.seq_lens[b]) // 4
        j = torch.arange(n, device=x.device)
        slots = batch.compressed_block_table[b, j // 64].long() * 64 + j % 64
        k8, ks = impl.indexer_k_gather(cache_.idx, slots, 64)
        starts = torch.zeros(e - a, dtype=torch.int64, device=x.device)
        lg = impl.fp8_mqa_logits(q8[a:e], k8, ks, wq[a:e], starts, n_vis[a:e])
        impl.top_k_per_row_prefill(lg, starts, n_vis[a:e], topk[a:e], e - a, lg.stride(0), lg.stride(1), K)
    return topk


def layer_forward(cfg: AttentionConfig, layer_type: LayerType, W: LayerWeights, cache_: LayerCache,
                  batch: StepBatch, x: torch.Tensor, cos_sin_cache: torch.Tensor, max_model_len: int,
                  decode_threshold: int = 1, impl=REFERENCE_IMPL, return_attn: bool = False,
                  paged_prefill: bool = False):
    """x bf16 [T, hidden] -> bf16 [T, hidden]; writes the layer's caches. ``cos_sin_cache`` must be
    the table of this layer type's RoPE base."""
    T = x.shape[0]
    if x.dim() != 2 or x.shape[1] != cfg.hidden_size or x.dtype != torch.bfloat16:
        raise ValueError(f"x must be bf16 [T, {cfg.hidden_size}], got {x.dtype} {tuple(x.shape)}")
    if batch.positions.shape != (T,):
        raise ValueError(f"batch.positions must be [{T}], got {tuple(batch.positions.shape)}")
    H, Hp, eps, Wn = cfg.local_heads, cfg.padded_heads, cfg.rms_norm_eps, cfg.sliding_window
    r = _layer_ratio(layer_type)
    positions = batch.positions.long()
    t2r = metadata.token_to_req_indices(batch.query_start_loc)
    qlens = batch.query_lens
    is_dec_tok = (qlens <= decode_threshold)[t2r]
    slot_mapping = batch.slot_mapping if batch.slot_mapping is not None else \
        metadata.slot_mapping_from_block_table(positions, t2r, batch.swa_block_table, L.SWA_BLOCK_SIZE)
    valid_tok = slot_mapping >= 0

    # Q / KV path
    qr_kv = impl.fp8_linear(x, W.wqkv8, W.wqkv_s)
    qr, kv = impl.fused_q_kv_rmsnorm(qr_kv[:, :cfg.q_lora_rank], qr_kv[:, cfg.q_lora_rank:], W.q_norm, W.kv_norm, eps)
    q = impl.fp8_linear(qr, W.wq_b8, W.wq_b_s).view(T, H, 512)
    q_pad = impl.fused_qnorm_rope_kv_rope_quant_insert(q, kv, cache_.swa, slot_mapping, positions, cos_sin_cache,
                                                       Hp, eps, L.SWA_BLOCK_SIZE)
    # compressor and indexer
    bs_c = L.compressed_block_size(r) if r > 1 else 0
    if r > 1:
        cslots = impl.get_compressed_slot_mapping(positions, t2r, batch.compressed_block_table, r, bs_c, slot_mapping)
        kvc, scc = impl.compressor_kv_score(x, W.comp_w, W.comp_ape, positions, r)
        impl.fused_compress_norm_rope_insert(kvc, scc, positions, batch.query_start_loc, cache_.comp_state,
                                             batch.state_indices, W.comp_norm, cos_sin_cache, cslots, cache_.comp,
                                             bs_c, r, "main", eps)
    topk_local = None
    if layer_type == LayerType.C4:
        topk_local = _indexer_topk(cfg, impl, W, cache_, batch, x, qr, positions, t2r, slot_mapping, is_dec_tok,
                                   cos_sin_cache)

    # sparse attention
    sm = cfg.softmax_scale
    attn = torch.zeros(T, Hp, 512, dtype=torch.bfloat16, device=x.device)
    from_pages = torch.ones_like(is_dec_tok) if paged_prefill else is_dec_tok
    dec = torch.nonzero(from_pages).flatten()
    if dec.numel():
        swa_idx, swa_len = impl.compute_swa_indices_and_lens(positions[dec], t2r[dec], batch.swa_block_table,
                                                             slot_mapping[dec], Wn, L.SWA_BLOCK_SIZE)
        extra_cache = extra_idx = extra_len = None
        if layer_type == LayerType.C4:
            extra_idx, extra_len = impl.compute_global_topk_indices_and_lens(
                topk_local[dec], t2r[dec], batch.compressed_block_table, bs_c, valid_tok[dec])
        elif layer_type == LayerType.C128:
            extra_idx, extra_len = impl.build_c128a_topk_metadata(
                positions[dec], t2r[dec], batch.compressed_block_table, slot_mapping[dec],
                torch.ones_like(dec, dtype=torch.bool), max_model_len, bs_c, r)
        if extra_idx is not None:
            extra_cache = cache.flash_mla_view(cache_.comp, bs_c)
            extra_idx = extra_idx.unsqueeze(1)
        o, _ = impl.sparse_mla_decode(q_pad[dec].unsqueeze(1), cache.flash_mla_view(cache_.swa, L.SWA_BLOCK_SIZE),
                                      swa_idx.unsqueeze(1), swa_len, W.attn_sink, extra_cache, extra_idx, extra_len, sm)
        attn[dec] = o[:, 0]
    if not paged_prefill:
        _prefill_attention(cfg, layer_type, impl, W, cache_, batch, q_pad, positions, t2r, is_dec_tok, slot_mapping,
                           topk_local, max_model_len, attn)

    # output path
    a8, sa = impl.fused_inv_rope_fp8_quant(attn[:, :H].contiguous(), positions, cos_sin_cache, cfg.local_groups)
    z = impl.fp8_einsum(a8, sa, W.wo_a8, W.wo_a_s)
    y = impl.fp8_linear(z.reshape(T, -1), W.wo_b8, W.wo_b_s)
    return (y, attn) if return_attn else y


def _prefill_attention(cfg, layer_type, impl, W, cache_, batch, q_pad, positions, t2r, is_dec_tok, slot_mapping,
                       topk_local, max_model_len, attn):
    qsl, Wn = batch.query_start_loc, cfg.sliding_window
    r = _layer_ratio(layer_type)
    bs_c = L.compressed_block_size(r) if r > 1 else 0
    N = math.ceil(max_model_len / r) if r > 1 else 0
    reqs = [b for b in range(qsl.shape[0] - 1) if int(qsl[b + 1]) > int(qsl[b]) and not bool(is_dec_tok[int(qsl[b])])]
    dev = q_pad.device
    for c0 in range(0, len(reqs), PREFILL_CHUNK_REQUESTS):
        chunk = reqs[c0:c0 + PREFILL_CHUNK_REQUESTS]
        qlens = torch.stack([qsl[b + 1] - qsl[b] for b in chunk]).long()
        slens = torch.stack([batch.seq_lens[b] for b in chunk]).long()
        glens = metadata.prefill_gather_lens(qlens, slens, Wn)
        M = N + Wn + int(qlens.max())
        ws = torch.zeros(len(chunk) * M, 512, dtype=torch.bfloat16, device=dev)
        toks, req_in_chunk = [], []
        for i, b in enumerate(chunk):
            if r > 1:
                j = torch.arange(int(slens[i]) // r, device=dev)
                slots = batch.compressed_block_table[b, j // bs_c].long() * bs_c + j % bs_c
                ws[i * M:i * M + j.numel()] = impl.dequantize_and_gather_k_cache(cache_.comp, slots, bs_c)
            p = torch.arange(int(slens[i] - glens[i]), int(slens[i]), device=dev)
            slots = batch.swa_block_table[b, p // 64].long() * 64 + p % 64
            ws[i * M + N:i * M + N + p.numel()] = impl.dequantize_and_gather_k_cache(cache_.swa, slots, 64)
            t = torch.arange(int(qsl[b]), int(qsl[b + 1]), device=dev)
            toks.append(t)
            req_in_chunk.append(torch.full_like(t, i))
        toks, req_in_chunk = torch.cat(toks), torch.cat(req_in_chunk)
        p = positions[toks]
        if layer_type == LayerType.C4:
            loc = topk_local[toks]
            tlen = torch.clamp((p + 1) // 4, max=cfg.index_topk)
        elif layer_type == LayerType.C128:
            loc, tlen = impl.build_c128a_topk_metadata(p, t2r[toks], batch.compressed_block_table, slot_mapping[toks],
                                                       torch.zeros_like(toks, dtype=torch.bool), max_model_len, bs_c, r)
            tlen = tlen.long()
        else:
            loc = torch.zeros(toks.numel(), 0, dtype=torch.int32, device=dev)
            tlen = torch.zeros(toks.numel(), dtype=torch.long, device=dev)
        idx, lens = impl.combine_topk_swa_indices(loc, tlen, p, req_in_chunk, slens - glens, N, M, Wn)
        lens = torch.where(slot_mapping[toks] >= 0, lens, torch.zeros_like(lens))
        o, _, _ = impl.sparse_mla_prefill(q_pad[toks], ws.unsqueeze(1), idx.unsqueeze(1), cfg.softmax_scale, 512,
                                          W.attn_sink, lens)
        attn[toks] = o
