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
    fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert=qkv.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert,
    compressor_kv_score=compressor.compressor_kv_score,
    save_partial_states=compressor.save_partial_states,
    compress_norm_rope_store=compressor.compress_norm_rope_store,
    fused_indexer_q_rope_quant=indexer.fused_indexer_q_rope_quant,
    fp8_mqa_logits=indexer.fp8_mqa_logits,
    fp8_paged_mqa_logits=indexer.fp8_paged_mqa_logits,
    get_paged_mqa_logits_metadata=indexer.get_paged_mqa_logits_metadata,
    top_k_per_row=indexer.top_k_per_row,
    cp_gather_indexer_k_quant_cache=indexer.cp_gather_indexer_k_quant_cache,
    dequantize_and_gather_k_cache=cache.dequantize_and_gather_k_cache,
    get_compressed_slot_mapping=metadata.get_compressed_slot_mapping,
    compute_swa_indices_and_lens=metadata.compute_swa_indices_and_lens,
    compute_prefill_gather_lens=metadata.compute_prefill_gather_lens,
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
    and the compressor state caches (fp32, 4 tokens a block for C4, 8 for C128)."""
    swa: torch.Tensor
    comp: Optional[torch.Tensor] = None
    idx: Optional[torch.Tensor] = None
    comp_state: Optional[torch.Tensor] = None
    idx_state: Optional[torch.Tensor] = None

    @classmethod
    def allocate(cls, layer_type: LayerType, num_blocks: int, num_state_blocks: int, device=None) -> "LayerCache":
        c = cls(swa=cache.new_cache(num_blocks, L.SWA_BLOCK_SIZE, device))
        if layer_type != LayerType.SWA:
            r = 4 if layer_type == LayerType.C4 else 128
            c.comp = cache.new_cache(num_blocks, L.compressed_block_size(r), device)
            c.comp_state = compressor.new_state_cache(num_state_blocks, r, 512, device)
        if layer_type == LayerType.C4:
            c.idx = cache.new_cache(num_blocks, 64, device, indexer=True)
            c.idx_state = compressor.new_state_cache(num_state_blocks, 4, 128, device)
        return c


@dataclass
class StepBatch:
    """One scheduler step. Tokens are grouped by request; positions are absolute.
    swa_block_table: logical 64-token blocks; compressed_block_table: logical 256-position blocks
    (entry j of a compressed cache lives at page bt[j // (256/r)]); state_block_table: the compressor
    state's blocks (4 positions a block for C4, 8 for C128), read back for windows begun in earlier steps."""
    query_start_loc: torch.Tensor      # int32 [B + 1]
    seq_lens: torch.Tensor             # int32 [B], tokens of each request after this step
    positions: torch.Tensor            # int64 [T]
    swa_block_table: torch.Tensor      # int32 [B, nb]
    compressed_block_table: torch.Tensor
    state_block_table: torch.Tensor    # int32 [B, ns]
    slot_mapping: Optional[torch.Tensor] = None  # int64 [T]; derived from swa_block_table if None
    state_slot_mapping: Optional[torch.Tensor] = None  # int64 [T]; derived from state_block_table if None

    @property
    def query_lens(self):
        return self.query_start_loc[1:] - self.query_start_loc[:-1]


def _layer_ratio(layer_type: LayerType) -> int:
    return {LayerType.SWA: 1, LayerType.C4: 4, LayerType.C128: 128}[layer_type]


def _compress(cfg, impl, x, w, ape, norm_w, positions, t2r, state, batch, sslots, cos_sin, pages, kslots, ratio, dim):
    """vLLM's DeepseekCompressor.forward: projection (ape added by the state save), state save, then the
    fused compress + RMSNorm + RoPE + quant + insert of the boundary tokens."""
    c, sbs, main = compressor.coff(ratio), compressor.state_block_size(ratio), dim == 512
    rec = L.TOKEN_BYTES if main else L.INDEXER_TOKEN_BYTES
    kv, score = impl.compressor_kv_score(x, w).split([c * dim, c * dim], dim=-1)
    impl.save_partial_states(kv, score, ape, positions, state, sslots, sbs, c * dim, ratio)
    bs = L.compressed_block_size(ratio) if main else 64
    impl.compress_norm_rope_store(
        state_cache=state, num_actual=sslots.shape[0], token_to_req_indices=t2r, positions=positions,
        slot_mapping=sslots, block_table=batch.state_block_table, block_size=sbs, state_width=c * dim,
        cos_sin_cache=cos_sin, kv_cache=compressor.kv_cache_view(pages, bs, rec),
        k_cache_metadata=SimpleNamespace(slot_mapping=kslots), pdl_kwargs={}, head_dim=dim, rope_head_dim=64,
        compress_ratio=ratio, overlap=ratio == 4, use_fp4_cache=False, rms_norm_weight=norm_w,
        rms_norm_eps=cfg.rms_norm_eps, quant_block=64 if main else 128, token_stride=576 if main else 128,
        scale_dim=8 if main else 4)


def _indexer_topk(cfg, impl, W, cache_, batch, x, qr, positions, t2r, slot_mapping, sslots, is_dec_tok, cos_sin):
    """Lightning indexer of a C4 layer: writes the indexer K cache, returns local top-k [T, K]."""
    T = x.shape[0]
    nh = cfg.index_n_heads
    islots = impl.get_compressed_slot_mapping(T, batch.query_start_loc, batch.seq_lens, batch.compressed_block_table,
                                              64, 4).masked_fill(slot_mapping < 0, -1)
    _compress(cfg, impl, x, W.idx_comp_w, W.idx_comp_ape, W.idx_comp_norm, positions, t2r, cache_.idx_state, batch,
              sslots, cos_sin, cache_.idx, islots, 4, 128)
    qi = impl.fp8_linear(qr, W.idx_wq_b8, W.idx_wq_b_s).view(T, nh, 128)
    wi = (x.float() @ W.idx_wproj.float().t()).to(torch.bfloat16)
    q8, wq = impl.fused_indexer_q_rope_quant(positions, qi, cos_sin, wi, 128 ** -0.5, nh ** -0.5)
    K = cfg.index_topk
    topk = torch.full((T, K), -1, dtype=torch.int32, device=x.device)
    n_vis = (positions.long() + 1) // 4
    kv = compressor.kv_cache_view(cache_.idx, 64, L.INDEXER_TOKEN_BYTES)
    dec = torch.nonzero(is_dec_tok).flatten()
    if dec.numel():
        cl = n_vis[dec]
        mcl = max(int(cl.max()), 1)
        cl32 = cl.to(torch.int32)
        lg = impl.fp8_paged_mqa_logits(q8[dec].unsqueeze(1), kv, wq[dec], cl32, batch.compressed_block_table[t2r[dec]],
                                       impl.get_paged_mqa_logits_metadata(cl32, 64, 1), mcl)
        topk[dec] = impl.top_k_per_row(lg, torch.zeros_like(cl), cl, K)
    qsl = batch.query_start_loc
    for b in range(qsl.shape[0] - 1):
        a, e = int(qsl[b]), int(qsl[b + 1])
        if e == a or bool(is_dec_tok[a]):
            continue
        n = int(batch.seq_lens[b]) // 4
        k8 = torch.empty(n, 128, dtype=torch.float8_e4m3fn, device=x.device)
        ks = torch.empty(n, 4, dtype=torch.uint8, device=x.device)
        impl.cp_gather_indexer_k_quant_cache(kv, k8, ks, batch.compressed_block_table[b:b + 1],
                                             torch.tensor([0, n], dtype=torch.int32, device=x.device))
        starts = torch.zeros(e - a, dtype=torch.int32, device=x.device)
        lg = impl.fp8_mqa_logits(q8[a:e], (k8, ks.view(torch.float32).squeeze(-1)), wq[a:e], starts,
                                 n_vis[a:e].to(torch.int32))
        topk[a:e] = impl.top_k_per_row(lg, starts, n_vis[a:e], K)
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
    q_pad = impl.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(q, kv, cache_.swa, slot_mapping, positions,
                                                                   cos_sin_cache, Hp, eps, L.SWA_BLOCK_SIZE)
    # compressor and indexer
    bs_c = L.compressed_block_size(r) if r > 1 else 0
    sslots = None
    if r > 1:
        cslots = impl.get_compressed_slot_mapping(T, batch.query_start_loc, batch.seq_lens,
                                                  batch.compressed_block_table, bs_c, r).masked_fill(slot_mapping < 0, -1)
        sslots = batch.state_slot_mapping if batch.state_slot_mapping is not None else torch.where(
            valid_tok, metadata.slot_mapping_from_block_table(positions, t2r, batch.state_block_table,
                                                              compressor.state_block_size(r)), -1)
        _compress(cfg, impl, x, W.comp_w, W.comp_ape, W.comp_norm, positions, t2r, cache_.comp_state, batch, sslots,
                  cos_sin_cache, cache_.comp, cslots, r, 512)
    topk_local = None
    if layer_type == LayerType.C4:
        topk_local = _indexer_topk(cfg, impl, W, cache_, batch, x, qr, positions, t2r, slot_mapping, sslots,
                                   is_dec_tok, cos_sin_cache)

    # sparse attention
    sm = cfg.softmax_scale
    attn = torch.zeros(T, Hp, 512, dtype=torch.bfloat16, device=x.device)
    from_pages = torch.ones_like(is_dec_tok) if paged_prefill else is_dec_tok
    dec = torch.nonzero(from_pages).flatten()
    if dec.numel():
        swa_idx, swa_len = impl.compute_swa_indices_and_lens(
            torch.empty(T, Wn, dtype=torch.int32, device=x.device), torch.empty(T, dtype=torch.int32, device=x.device),
            Wn, batch.query_start_loc, batch.seq_lens, t2r, valid_tok, batch.swa_block_table, L.SWA_BLOCK_SIZE)
        swa_idx, swa_len = swa_idx[dec], swa_len[dec]
        extra_cache = extra_idx = extra_len = None
        if layer_type == LayerType.C4:
            extra_idx, extra_len = impl.compute_global_topk_indices_and_lens(
                topk_local[dec], t2r[dec], batch.compressed_block_table, bs_c, valid_tok[dec])
        elif layer_type == LayerType.C128:
            kmax, nd = metadata.c128_max_entries(max_model_len, r), dec.numel()
            extra_idx, extra_len, _ = impl.build_c128a_topk_metadata(
                positions[dec], r, nd, t2r[dec], batch.compressed_block_table, bs_c, slot_mapping[dec],
                torch.empty(nd, kmax, dtype=torch.int32, device=x.device),
                torch.empty(nd, dtype=torch.int32, device=x.device),
                torch.empty(0, kmax, dtype=torch.int32, device=x.device), kmax)
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
    a8, sa = impl.fused_inv_rope_fp8_quant(attn[:, :H], positions, cos_sin_cache, cfg.local_groups, cfg.heads_per_group)
    z = torch.empty(T, cfg.local_groups, cfg.o_lora_rank, dtype=torch.bfloat16, device=attn.device)
    impl.fp8_einsum("bhr,hdr->bhd", (a8, sa), (W.wo_a8, W.wo_a_s), z)
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
        qsl_c = torch.cat([qlens.new_zeros(1), qlens.cumsum(0)])
        glens = impl.compute_prefill_gather_lens(torch.empty(len(chunk), dtype=torch.int32, device=dev), slens, qsl_c,
                                                 len(chunk), 0, Wn).long()
        M = N + Wn + int(qlens.max())
        ws = torch.zeros(len(chunk) * M, 512, dtype=torch.bfloat16, device=dev)
        ws3, rows = ws.view(len(chunk), M, 512), torch.tensor(chunk, device=dev)
        if r > 1:
            impl.dequantize_and_gather_k_cache(ws3, cache_.comp, slens // r, None,
                                               batch.compressed_block_table[rows], bs_c, 0)
        impl.dequantize_and_gather_k_cache(ws3, cache_.swa, slens, glens, batch.swa_block_table[rows], 64, N)
        toks = torch.cat([torch.arange(int(qsl[b]), int(qsl[b + 1]), device=dev) for b in chunk])
        p = positions[toks]
        if layer_type == LayerType.C4:
            loc = topk_local[toks]
        elif layer_type == LayerType.C128:
            kmax = metadata.c128_max_entries(max_model_len, r)
            _, _, loc = impl.build_c128a_topk_metadata(
                p, r, 0, t2r[toks], batch.compressed_block_table, bs_c, slot_mapping[toks],
                torch.empty(0, kmax, dtype=torch.int32, device=dev), torch.empty(0, dtype=torch.int32, device=dev),
                torch.empty(toks.numel(), kmax, dtype=torch.int32, device=dev), kmax)
        else:
            loc = torch.zeros(toks.numel(), 0, dtype=torch.int32, device=dev)
        idx, lens = impl.combine_topk_swa_indices(loc, qsl_c, slens, glens, Wn, r, loc.shape[1], M, N)
        lens = torch.where(slot_mapping[toks] >= 0, lens, torch.zeros_like(lens))
        o, _, _ = impl.sparse_mla_prefill(q_pad[toks], ws.unsqueeze(1), idx.unsqueeze(1), cfg.softmax_scale, 512,
                                          W.attn_sink, lens)
        attn[toks] = o
