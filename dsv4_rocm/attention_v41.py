"""DeepseekV41Attention: one DeepSeek-V4.1 attention layer, in the shape of vLLM's V4.1 layer
(vllm/models/deepseek_v41/attention.py), on the step machinery of ``DeepseekV4Attention``.

What a layer runs depends on what it is (``AttentionConfig.v41_layer``, docs/math.md#v41):

    every layer   fused wq_a + wkv -> q / kv RMSNorm -> wq_b -> RoPE of q (no per-head norm) and kv RoPE +
                  fp8 insert into its own SWA cache
    kv source     compressor: kv_score = x @ fused_wkv_wgate^T -> fused_save_compress_norm (ring, pooling,
                  RMSNorm -> bf16 latent) -> rope_quant_insert into its compressed cache
    index source  (kv source: k_pre = latent @ wk^T -> indexer_k_norm_rope_store into its indexer-K cache)
                  its own q (wq_b, weights_proj, fused_indexer_q_rope_quant), logits over the kv source's
                  indexer-K cache, then (the candidate source) select_candidate_blocks, or (a later index
                  source) mask_candidate_logits, then top-k into the stack's shared top-k buffer
    ratio > 0     sparse attention over the sliding window and the top-k entries of the kv source's
                  compressed cache (the last index source's top-k, in layer order)
    then          inverse RoPE + FP8 quant -> grouped FP8 einsum with wo_a -> wo_b

A layer reads only tensors it was built with (its own caches, its kv source's, the stack's
``V41SharedBuffers``); as in vLLM, the layers of a step run in layer order, so a layer's kv source and
index source have written this step's entries and top-k before it attends. A decode step is a fixed
sequence of kernels with no host sync (``dsv4_rocm.graph`` captures it).
"""
from dataclasses import dataclass
from typing import Optional

import torch

from . import layout as L
from . import ops
from .attention import DeepseekV4Attention, _current_step
from .config import AttentionConfig
from .kv_cache import RECORD_FORMATS, V41LayerCache
from .platform import detect
from .reference.rope import build_cos_sin_cache
from .step import V41_COMPRESSED_BLOCK, StepMetadata
from .weights import LayerWeights


def _bf16_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """vLLM's unquantized ReplicatedLinear (wk, weights_proj): bf16 x @ weight^T with fp32 accumulation, one
    rounding to bf16. Computed as an fp32 GEMM of the bf16 values, so every device and the oracle round the
    same sums (a bf16 GEMM's blocking changes which sums round where)."""
    return torch.matmul(x.float(), weight.float().t()).bfloat16()


@dataclass
class V41SharedBuffers:
    """What the layers of one step hand to each other (vLLM's model-level buffers): the last index source's
    top-k (local entry ids, int32 [max_tokens, index_topk], -1 padded) and the candidate source's blocks
    (int32 [max_tokens, candidate_topk_blocks])."""
    topk: torch.Tensor
    candidates: Optional[torch.Tensor] = None

    @classmethod
    def allocate(cls, cfg: AttentionConfig, max_tokens: int, device=None) -> "V41SharedBuffers":
        cand = None
        if cfg.candidate_source_layer_id >= 0:
            cand = torch.full((max_tokens, cfg.candidate_topk_blocks), -1, dtype=torch.int32, device=device)
        return cls(torch.full((max_tokens, cfg.index_topk), -1, dtype=torch.int32, device=device), cand)


class DeepseekV41Attention(DeepseekV4Attention):
    """A DeepSeek-V4.1 layer of any kind. ``record_format`` names the records of the SWA and compressed
    caches (``kv_cache.V41_RECORDS``): "V40_584" (default; the 584-byte fp8_ds_mla record vLLM's ROCm and
    Hopper paths keep for V4.1), "V41_528" (V4.1's record, vLLM on Blackwell) or "V41_528+V41_FP4_288"
    (vLLM's nvfp4_ds_mla: e2m1 compressed entries); it must be the cache's."""

    def __init__(self, cfg: AttentionConfig, layer: int, weights: LayerWeights, cache: V41LayerCache,
                 shared: V41SharedBuffers, max_model_len: int, cos_sin_cache: Optional[torch.Tensor] = None,
                 device=None, record_format: str = "V40_584"):
        torch.nn.Module.__init__(self)
        if record_format not in RECORD_FORMATS or cache.record_format != record_format:
            raise ValueError(f"record_format must be one of {RECORD_FORMATS} and match the cache's, got "
                             f"{record_format!r} (cache: {cache.record_format!r})")
        self._swa_fmt, self._comp_fmt = cache.swa_format, cache.comp_format
        self.cfg, self.layer, self.spec = cfg, layer, cfg.v41_layer(layer)
        self.ratio = self.spec.ratio
        if cache.ratio != self.ratio or (self.ratio and cache.comp is None):
            raise ValueError(f"cache holds ratio {cache.ratio} caches, layer {layer} has ratio {self.ratio}")
        if self.ratio == 2 and cache.ring is None:
            raise ValueError(f"layer {layer}: a ratio-2 layer needs its kv source's compressor ring")
        if shared.topk.shape[1] != cfg.index_topk or (cfg.candidate_source_layer_id >= 0 and shared.candidates is None):
            raise ValueError("shared buffers do not fit the config (index_topk / candidate blocks)")
        device = torch.device(device) if device is not None else weights.wqkv8.device
        self.platform = detect(device)
        self.n_local_heads, self.n_local_groups = cfg.local_heads, cfg.local_groups
        self.padded_heads = self.get_padded_num_q_heads(cfg.local_heads)
        self.max_model_len = max_model_len
        self.scale, self.eps = cfg.softmax_scale, cfg.rms_norm_eps
        self.w = weights.to(device)
        self._check_weights()
        self.cache, self.shared = cache, shared
        self._bounds = cache.bounds()           # what a step may index in the caches (StepMetadata.validate)
        self._swa_pages = cache.swa_view().unsqueeze(-2)
        self._comp = cache.comp_view() if self.ratio else None
        self._comp_pages = self._comp.unsqueeze(-2) if self.ratio else None
        if cos_sin_cache is None:
            cos_sin_cache = build_cos_sin_cache(max_positions=max_model_len + 1, device=device, **cfg.v41_rope(layer))
        self.register_buffer("cos_sin_cache", cos_sin_cache.to(device), persistent=False)

    def _check_weights(self):
        s, w = self.spec, self.w
        need = (["comp_w", "comp_norm", "idx_wk", "idx_k_norm"] if s.owns_kv else []) + \
            (["idx_wq_b8", "idx_wq_b_s", "idx_wproj"] if s.owns_index else [])
        missing = [n for n in need if getattr(w, n) is None]
        if missing:
            raise ValueError(f"weights of layer {self.layer} ({s.label}) lack {missing}")
        if s.owns_kv and w.comp_w.shape[0] != 512 * s.ratio:
            raise ValueError(f"layer {self.layer}: compressor weight has {w.comp_w.shape[0]} rows, ratio {s.ratio} "
                             f"needs {512 * s.ratio}")

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                step: Optional[StepMetadata] = None) -> torch.Tensor:
        """hidden_states bf16 [T, hidden] -> bf16 [T, hidden]; writes this step's tokens into the caches the
        layer owns and its top-k (index sources) into the shared buffer."""
        step = _current_step(step)
        x = hidden_states
        T = self._check_inputs(positions, x, step)
        uses = ([self.shared.topk] if self.ratio else []) + \
            ([self.shared.candidates] if self.spec.candidate_source or self.spec.uses_candidates else [])
        rows = min((b.shape[0] for b in uses), default=T)
        if T > rows:
            raise ValueError(f"the step has {T} tokens; the shared top-k / candidate buffers hold {rows} rows")
        if self.ratio and self.ratio not in step.v41_lens:
            raise ValueError(f"the step was not built for ratio {self.ratio} (StepMetadata.build(ratios=...))")
        # the whole step against the caches this layer writes or reads (its own SWA cache, its kv source's
        # compressed, indexer-K and ring caches) before the first write: a rejected step writes nothing
        self._check_step(step, indexer=self.spec.owns_index)
        self._mark("start")
        qr, kv, q = self._projections(x)
        self._mark("projections")
        q = ops.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(
            q, kv, self.cache.swa, step.slot_mapping, positions, self.cos_sin_cache, self.padded_heads, self.eps,
            L.SWA_BLOCK_SIZE, False, kv_mxfp8=self._swa_fmt.name == L.V41_528.name, kv_layout=self._swa_fmt.layout)
        self._mark("q norm + kv insert")
        latent = self._compress(x, positions, step) if self.spec.owns_kv else None
        self._mark("compressor")
        if self.spec.owns_index:
            self._index(x, qr, latent, positions, step)
        self._mark("indexer")
        return self._attend_and_project(q, kv, positions, step)

    def fill_caches(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                    step: Optional[StepMetadata] = None) -> None:
        """Write this step's tokens into every cache ``forward`` writes (its SWA records; a kv source's
        compressor ring, entries and index keys), by the same kernels in the same order, without the
        indexer's scores, attention or the output path (dsv4_rocm.long_context's prefix of a long context)."""
        step = _current_step(step)
        x = hidden_states
        self._check_inputs(positions, x, step)
        if self.ratio and self.ratio not in step.v41_lens:
            raise ValueError(f"the step was not built for ratio {self.ratio} (StepMetadata.build(ratios=...))")
        self._check_step(step, indexer=False)
        _, kv, q = self._projections(x)
        ops.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(
            q, kv, self.cache.swa, step.slot_mapping, positions, self.cos_sin_cache, self.padded_heads, self.eps,
            L.SWA_BLOCK_SIZE, False, kv_mxfp8=self._swa_fmt.name == L.V41_528.name, kv_layout=self._swa_fmt.layout)
        if self.spec.owns_kv:
            latent = self._compress(x, positions, step)
            if self.spec.owns_index:
                self._index_keys(latent, positions, step)

    def _index_keys(self, latent, positions, step: StepMetadata) -> None:
        """A kv source's index keys: k_norm(wk(latent)), RoPE'd and quantized into its indexer-K cache."""
        k_pre = _bf16_linear(latent, self.w.idx_wk)
        ops.indexer_k_norm_rope_store(k_pre, positions, self.cos_sin_cache, self.w.idx_k_norm, self.eps,
                                      self.cache.idx, step.compressed_slots[self.ratio], self.ratio, False)

    def _compress(self, x, positions, step: StepMetadata) -> torch.Tensor:
        """The kv source's compressor: the bf16 latent of every group-closing token (other rows unspecified),
        its record in the compressed cache."""
        r, w = self.ratio, self.w
        kv_score = ops.compressor_kv_score(x, w.comp_w)
        latent = torch.empty(x.shape[0], 512, dtype=torch.bfloat16, device=x.device)
        slots = step.compressed_slots[r]
        if r == 2:
            ops.fused_save_compress_norm(kv_score, positions, self.cache.ring, step.state_slots[2],
                                         step.query_start_loc, step.token_to_req, w.comp_norm, self.eps, 2, latent)
        else:
            ops.fused_save_compress_norm(kv_score, positions, None, slots, None, None, w.comp_norm, self.eps, 1, latent)
        ops.rope_quant_insert(latent, positions, self.cos_sin_cache, self._comp, slots, r,
                              kv_layout=self._comp_fmt.layout)
        return latent

    def _index(self, x, qr, latent, positions, step: StepMetadata) -> None:
        """An index source: (kv source) the index keys of its latents; its q; logits over the kv source's
        indexer-K cache; candidate blocks; top-k into the shared buffer."""
        cfg, w, r = self.cfg, self.w, self.ratio
        T, nh, K = x.shape[0], cfg.index_n_heads, cfg.index_topk
        idx, lens = self.cache.idx, step.v41_lens[r]
        if self.spec.owns_kv:
            self._index_keys(latent, positions, step)
        qi = ops.fp8_linear(qr, w.idx_wq_b8, w.idx_wq_b_s).view(T, nh, 128)
        wi = _bf16_linear(x, w.idx_wproj)
        q8, wq = ops.fused_indexer_q_rope_quant(positions, qi, self.cos_sin_cache, wi, 128 ** -0.5, nh ** -0.5)
        topk = self.shared.topk[:T]
        nd, ndr, nn = step.num_decode_tokens, step.num_decodes, step.decode_query_len
        if not nn:
            nd = ndr = 0    # decode requests of different query lengths are scored as prefill rows are
        if nd:
            dl = lens[:nd].view(ndr, nn)
            logits = ops.fp8_paged_mqa_logits(q8[:nd].view(ndr, nn, nh, 128), idx.unsqueeze(-2), wq[:nd], dl,
                                              step.compressed_block_table[:ndr],
                                              ops.get_paged_mqa_logits_metadata(dl, V41_COMPRESSED_BLOCK, 1),
                                              -(-self.max_model_len // r))
            self._candidates(logits, lens[:nd], 0)
            ops.top_k_per_row_decode(logits, nn, dl, topk[:nd], nd, logits.stride(0), logits.stride(1), K)
        if nd < T:
            self._indexer_prefill(q8, wq, idx, step, topk, K, ndr, ratio=r, lens=lens, logits_hook=self._candidates)

    def _candidates(self, logits, lens, row0: int) -> None:
        """The candidate source publishes its candidate blocks of rows row0..; a later index source keeps
        only the entries inside them."""
        s = self.spec
        if not (s.candidate_source or s.uses_candidates):
            return
        cand = self.shared.candidates[row0:row0 + logits.shape[0]]
        op = ops.select_candidate_blocks if s.candidate_source else ops.mask_candidate_logits
        op(logits, lens, cand, self.cfg.candidate_block_size)

    def forward_mqa(self, q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, output: torch.Tensor,
                    step: Optional[StepMetadata] = None) -> None:
        """Sparse attention of every token over its sliding window and (ratio > 0) the entries of the shared
        top-k in its kv source's compressed cache, with the sink, into ``output`` [T, padded_heads, 512]."""
        del kv
        step = _current_step(step)
        T = q.shape[0]
        extra = (None, None, None)
        if self.ratio:
            gidx, glens = ops.compute_global_topk_indices_and_lens(
                self.shared.topk[:T], step.token_to_req, step.compressed_block_table, V41_COMPRESSED_BLOCK,
                step.is_valid_token)
            extra = (self._comp_pages, gidx.unsqueeze(1), glens)
        ops.sparse_mla_decode(q.unsqueeze(1), self._swa_pages, step.swa_indices.unsqueeze(1), step.swa_lens,
                              self.w.attn_sink, *extra, self.scale, out=output.view(T, 1, self.padded_heads, 512),
                              kv_layout=self._swa_fmt.layout)
