"""DeepseekV4Attention: one DeepSeek-V4 attention layer as a torch module, in the shape of vLLM's layer.

vLLM's platform subclasses provide ``get_padded_num_q_heads``, ``forward_mqa(q, kv, positions, output)``
and ``_o_proj(o, positions)``; this module has the same three, and a ``forward(positions, hidden_states)``
running vLLM's step order over the public ops (``dsv4_rocm.ops``, so each stage runs on the fastest
implementation the platform has):

    fused wq_a + wkv projection -> q / kv RMSNorm -> wq_b -> per-head q norm + RoPE, kv RoPE + fp8 insert
    into the SWA cache -> compressor (state save, then pooled entries into the compressed cache) ->
    indexer (C4: its own compressor into the indexer-K cache, q quant, logits, top-k) -> sparse attention
    over the sliding window and the compressed entries, with the sink -> inverse RoPE + FP8 quant ->
    grouped FP8 einsum with wo_a -> wo_b.

The step's batch comes as a ``StepMetadata`` (``dsv4_rocm.step``), passed to ``forward`` or set for a
region with ``step_context``. Every token, decode and prefill alike, attends straight from the fp8 pages
(no bf16 workspace): a decode step is a fixed sequence of kernels with no host sync, which
``dsv4_rocm.graph`` captures into a CUDA/HIP graph. The indexer's prefill rows gather their request's
indexer-K entries and run the contiguous logits op in chunks of rows, as vLLM does.
"""
import contextlib
from typing import Optional

import torch
import torch.nn.functional as F

from . import layout as L
from . import ops
from .config import AttentionConfig, LayerType
from .kv_cache import LayerCache
from .ops.indexer import MAX_NEXT_N
from .platform import detect
from .reference.compressor import coff, state_block_size
from .reference.rope import build_cos_sin_cache
from .step import StepMetadata
from .weights import LayerWeights

_CURRENT_STEP: Optional[StepMetadata] = None
INDEXER_PREFILL_ROWS = 2048     # query rows per prefill logits launch: bounds the [rows, entries] fp32 buffer
MAX_DECODE_QUERY_LEN = MAX_NEXT_N   # decode rows per request the paged indexer logits take (DeepGEMM's next_n)


def padded_q(q: torch.Tensor, padded_heads: int) -> torch.Tensor:
    """q [T, H, 512] as the sparse kernels take it, [T, padded_heads, 512] with the heads past H zero,
    without normalizing, rotating or writing any cache: the q of a profile run (vLLM's memory-profiling
    forward, which has no metadata), here and in the vLLM plugin's layer hooks."""
    return F.pad(q, (0, 0, 0, padded_heads - q.shape[1]))


@contextlib.contextmanager
def step_context(step: StepMetadata):
    """The step every DeepseekV4Attention.forward inside the block runs (vLLM's forward context)."""
    global _CURRENT_STEP
    prev, _CURRENT_STEP = _CURRENT_STEP, step
    try:
        yield step
    finally:
        _CURRENT_STEP = prev


def _current_step(step: Optional[StepMetadata]) -> StepMetadata:
    """The step a forward runs: the one passed, else the one of the enclosing ``step_context``."""
    step = step or _CURRENT_STEP
    if step is None:
        raise ValueError("no StepMetadata: pass step= or run inside dsv4_rocm.attention.step_context(step)")
    return step


class DeepseekV4Attention(torch.nn.Module):
    timer = None        # an object with mark(stage): the main job's per-stage timing

    def __init__(self, cfg: AttentionConfig, layer: int, weights: LayerWeights, cache: LayerCache,
                 max_model_len: int, cos_sin_cache: Optional[torch.Tensor] = None, device=None):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.layer_type: LayerType = cfg.layer_type(layer)
        self.ratio = {LayerType.SWA: 1, LayerType.C4: 4, LayerType.C128: 128}[self.layer_type]
        if cache.ratio != self.ratio:
            raise ValueError(f"cache was allocated for ratio {cache.ratio}, layer {layer} has ratio {self.ratio}")
        device = torch.device(device) if device is not None else weights.wqkv8.device
        self.platform = detect(device)
        self.n_local_heads, self.n_local_groups = cfg.local_heads, cfg.local_groups
        self.padded_heads = self.get_padded_num_q_heads(cfg.local_heads)
        self.max_model_len = max_model_len
        self.scale = cfg.softmax_scale
        self.eps = cfg.rms_norm_eps
        self.w = weights.to(device)
        self.cache = cache
        self._bounds = cache.bounds()           # what a step may index in the caches (StepMetadata.validate)
        # the views the public ops take, made once (a view costs a dispatch on every call)
        self._swa_pages = cache.swa_view().unsqueeze(-2)
        self._comp = cache.comp_view() if cache.comp is not None else None
        self._comp_pages = self._comp.unsqueeze(-2) if self._comp is not None else None
        self._idx = cache.idx_view() if cache.idx is not None else None
        if cos_sin_cache is None:
            cos_sin_cache = build_cos_sin_cache(cfg.rope_base(self.layer_type), max_model_len + 1, device=device)
        self.register_buffer("cos_sin_cache", cos_sin_cache.to(device), persistent=False)

    # ---- vLLM's platform hooks ---------------------------------------------------------------------------
    @classmethod
    def get_padded_num_q_heads(cls, num_heads: int) -> int:
        """The sparse kernels run 64 or 128 heads (as FlashMLA does); q and the output are padded to that."""
        if not isinstance(num_heads, int) or not 0 < num_heads <= 128:
            raise ValueError(f"DeepSeek-V4 attention supports 1..128 local heads, got {num_heads!r}")
        return 64 if num_heads <= 64 else 128

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                step: Optional[StepMetadata] = None) -> torch.Tensor:
        """hidden_states bf16 [T, hidden] -> bf16 [T, hidden]; writes this step's tokens into the caches.
        Without a step (none passed, none set by ``step_context``) it is vLLM's memory-profiling run:
        ``profile_run``."""
        if step is None and _CURRENT_STEP is None:
            return self.profile_run(positions, hidden_states)
        step = _current_step(step)
        x, w = hidden_states, self.w
        self._check_inputs(positions, x, step)
        self._check_step(step, indexer=self.ratio == 4)
        self._mark("start")
        qr, kv, q = self._projections(x)
        self._mark("projections")
        q = ops.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(
            q, kv, self.cache.swa, step.slot_mapping, positions, self.cos_sin_cache, self.padded_heads, self.eps,
            L.SWA_BLOCK_SIZE)
        self._mark("q norm + kv insert")
        if self.ratio > 1:
            self._compress(x, w.comp_w, w.comp_ape, w.comp_norm, positions, step, self.cache.comp_state,
                           self._comp, step.compressed_slots[self.ratio], 512)
            self._mark("compressor")
        self._topk = self._indexer(x, qr, positions, step) if self.ratio == 4 else None
        self._mark("indexer")
        return self._attend_and_project(q, kv, positions, step)

    def fill_caches(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                    step: Optional[StepMetadata] = None) -> None:
        """Write this step's tokens into every cache ``forward`` writes (SWA records, compressor state and
        entries, the indexer's keys), by the same kernels in the same order, without the indexer's scores,
        attention or the output path: a prefix of a long context whose outputs nobody reads
        (dsv4_rocm.long_context). The caches end exactly as after ``forward`` of the same step."""
        step = _current_step(step)
        x = hidden_states
        self._check_inputs(positions, x, step)
        self._check_step(step, indexer=False)
        _, kv, q = self._projections(x)
        ops.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(
            q, kv, self.cache.swa, step.slot_mapping, positions, self.cos_sin_cache, self.padded_heads, self.eps,
            L.SWA_BLOCK_SIZE)
        if self.ratio > 1:
            self._compress(x, self.w.comp_w, self.w.comp_ape, self.w.comp_norm, positions, step, self.cache.comp_state,
                           self._comp, step.compressed_slots[self.ratio], 512)
        if self.ratio == 4:
            self._index_keys(x, positions, step)

    def _attend_and_project(self, q, kv, positions, step: StepMetadata) -> torch.Tensor:
        """Sparse attention (``forward_mqa``) into the padded output, then the output path."""
        o_padded = torch.empty(q.shape[0], self.padded_heads, 512, dtype=torch.bfloat16, device=q.device)
        self.forward_mqa(q, kv, positions, o_padded, step)
        self._mark("attention")
        y = self._o_proj(o_padded[:, :self.n_local_heads], positions)
        self._mark("output")
        return y

    def profile_run(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """vLLM's memory-profiling forward (no metadata; vLLM passes dummy positions): every projection of a
        step runs (q and kv, the compressors', the indexer's query and its quantization, the output path) so
        their memory is counted, nothing is written to any cache, and attention contributes zeros, as in
        vLLM's layer; the result is therefore zeros, bf16 [T, hidden]."""
        x = hidden_states
        T = self._check_inputs(positions, x, None)
        qr, _, q = self._projections(x)
        padded_q(q, self.padded_heads)          # allocated as in a step; attention does not read it
        if self.ratio > 1:
            ops.compressor_kv_score(x, self.w.comp_w)
        if self.ratio == 4:
            ops.compressor_kv_score(x, self.w.idx_comp_w)
            self._indexer_query(x, qr, positions)
        o = torch.zeros(T, self.padded_heads, 512, dtype=torch.bfloat16, device=x.device)
        return self._o_proj(o[:, :self.n_local_heads], positions)

    def _check_inputs(self, positions, x, step: Optional[StepMetadata]) -> int:
        """hidden_states bf16 [T, hidden], positions [T] and the step's T tokens, if there is a step
        (ValueError otherwise); T."""
        T = x.shape[0]
        if x.dim() != 2 or x.shape[1] != self.cfg.hidden_size or x.dtype != torch.bfloat16:
            raise ValueError(f"hidden_states must be bf16 [T, {self.cfg.hidden_size}], got {x.dtype} {tuple(x.shape)}")
        if step is None and positions.shape != (T,):
            raise ValueError(f"positions ({tuple(positions.shape)}) must cover the {T} tokens of hidden_states")
        if step is not None and (positions.shape != (T,) or step.num_tokens != T):
            raise ValueError(f"positions ({tuple(positions.shape)}) and the step ({step.num_tokens} tokens) must "
                             f"cover the {T} tokens of hidden_states")
        return T

    def _check_step(self, step: StepMetadata, indexer: bool) -> None:
        """The whole step against this layer's caches (``StepMetadata.validate``) and, for a layer that runs an
        indexer, the decode rows its paged logits take, before the first write: a rejected step writes
        nothing."""
        if indexer and step.num_decodes and step.decode_query_len > MAX_DECODE_QUERY_LEN:
            raise ValueError(f"the step's decode requests have {step.decode_query_len} tokens each; the indexer "
                             f"takes at most {MAX_DECODE_QUERY_LEN} (1 + speculative tokens)")
        step.validate(self._bounds, built=True)

    def _projections(self, x):
        """(qr, kv, q [T, H, 512]): the fused wq_a + wkv projection, the q / kv RMSNorms, wq_b."""
        cfg, w = self.cfg, self.w
        qr_kv = ops.fp8_linear(x, w.wqkv8, w.wqkv_s)
        qr, kv = ops.fused_q_kv_rmsnorm(qr_kv[:, :cfg.q_lora_rank], qr_kv[:, cfg.q_lora_rank:], w.q_norm,
                                        w.kv_norm, self.eps)
        return qr, kv, ops.fp8_linear(qr, w.wq_b8, w.wq_b_s).view(x.shape[0], self.n_local_heads, 512)

    def _mark(self, stage: str):
        """End of a stage, for a timer the main job attaches (``timer.mark(stage)``); nothing otherwise."""
        if self.timer is not None:
            self.timer.mark(stage)

    def forward_mqa(self, q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, output: torch.Tensor,
                    step: Optional[StepMetadata] = None) -> None:
        """Sparse attention of every token over its sliding window and its compressed entries (the indexer's
        top-k for C4, all visible entries for C128), with the sink, into ``output`` [T, padded_heads, 512].
        ``kv`` is unused: the keys are read from the caches the fused insert has written."""
        del kv
        step = step or _CURRENT_STEP
        T = q.shape[0]
        extra = dict(extra_k_cache=None, extra_indices_in_kvcache=None, extra_topk_length=None)
        if self.ratio == 4:
            idx, lens = ops.compute_global_topk_indices_and_lens(
                self._topk, step.token_to_req, step.compressed_block_table, self.cache.compressed_block_size,
                step.is_valid_token)
            extra = dict(extra_k_cache=self._comp_pages, extra_indices_in_kvcache=idx.unsqueeze(1),
                         extra_topk_length=lens)
        elif self.ratio == 128:
            extra = dict(extra_k_cache=self._comp_pages,
                         extra_indices_in_kvcache=step.c128_indices.unsqueeze(1), extra_topk_length=step.c128_lens)
        ops.sparse_mla_decode(q.unsqueeze(1), self._swa_pages, step.swa_indices.unsqueeze(1),
                              step.swa_lens, self.w.attn_sink, extra["extra_k_cache"], extra["extra_indices_in_kvcache"],
                              extra["extra_topk_length"], self.scale, out=output.view(T, 1, self.padded_heads, 512))

    def _o_proj(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Inverse RoPE + FP8 quant per 128, grouped FP8 einsum with wo_a, then wo_b."""
        w, G = self.w, self.n_local_groups
        a8, sa = ops.fused_inv_rope_fp8_quant(o, positions, self.cos_sin_cache, G, self.n_local_heads // G)
        z = torch.empty(o.shape[0], G, self.cfg.o_lora_rank, dtype=torch.bfloat16, device=o.device)
        ops.fp8_einsum("bhr,hdr->bhd", (a8, sa), (w.wo_a8.view(torch.float8_e4m3fn), w.wo_a_s), z)
        return ops.fp8_linear(z.view(o.shape[0], G * self.cfg.o_lora_rank), w.wo_b8, w.wo_b_s)  # 0 rows too

    # ---- compressor and indexer --------------------------------------------------------------------------
    def _compress(self, x, w_kv_gate, ape, norm_w, positions, step, state, kv_cache, kslots, dim: int,
                  ratio: Optional[int] = None):
        """vLLM's DeepseekCompressor.forward: projection, state save, then the pooled entries of the tokens
        that close a window, normed, roped, quantized into ``kv_cache`` at ``kslots``."""
        r = ratio or self.ratio
        c, sbs, main = coff(r), state_block_size(r), dim == 512
        kv, score = ops.compressor_kv_score(x, w_kv_gate).split([c * dim, c * dim], dim=-1)
        sslots = step.state_slots[r]
        ops.save_partial_states(kv, score, ape, positions, state, sslots, sbs, c * dim, r)
        ops.compress_norm_rope_store(
            state_cache=state, num_actual=x.shape[0], token_to_req_indices=step.token_to_req, positions=positions,
            slot_mapping=sslots, block_table=step.state_block_table, block_size=sbs, state_width=c * dim,
            cos_sin_cache=self.cos_sin_cache, kv_cache=kv_cache, k_cache_metadata=kslots, pdl_kwargs={},
            head_dim=dim, rope_head_dim=64, compress_ratio=r, overlap=r == 4, use_fp4_cache=False,
            rms_norm_weight=norm_w, rms_norm_eps=self.eps, quant_block=64 if main else 128,
            token_stride=576 if main else 128, scale_dim=8 if main else 4)

    def _indexer(self, x, qr, positions, step: StepMetadata) -> torch.Tensor:
        """The lightning indexer of a C4 layer: writes the indexer-K cache, returns each token's top-k local
        compressed indices int32 [T, index_topk] (valid first, -1 after)."""
        cfg, w = self.cfg, self.w
        T, nh, K = x.shape[0], cfg.index_n_heads, cfg.index_topk
        idx_kv = self._idx
        self._index_keys(x, positions, step)
        q8, wq = self._indexer_query(x, qr, positions)
        topk = torch.empty(T, K, dtype=torch.int32, device=x.device)
        n_entries = -(-self.max_model_len // 4)
        nd, ndr, nn = step.num_decode_tokens, step.num_decodes, step.decode_query_len
        if not nn:
            nd = ndr = 0    # decode requests of different query lengths are scored as prefill rows are
        if nd:
            lens = step.indexer_lens[:nd].view(ndr, nn)
            logits = ops.fp8_paged_mqa_logits(q8[:nd].view(ndr, nn, nh, 128), idx_kv.unsqueeze(-2), wq[:nd], lens,
                                              step.compressed_block_table[:ndr],
                                              ops.get_paged_mqa_logits_metadata(lens, 64, 1), n_entries)
            ops.top_k_per_row_decode(logits, nn, lens, topk[:nd], nd, logits.stride(0), logits.stride(1), K)
        if nd < T:
            self._indexer_prefill(q8, wq, idx_kv, step, topk, K, first_request=ndr)
        return topk

    def _index_keys(self, x, positions, step: StepMetadata) -> None:
        """The indexer's compressor: its state, and the index keys of the tokens that close a window."""
        w = self.w
        self._compress(x, w.idx_comp_w, w.idx_comp_ape, w.idx_comp_norm, positions, step, self.cache.idx_state,
                       self._idx, step.compressed_slots[4], 128, ratio=4)

    def _indexer_query(self, x, qr, positions):
        """The indexer's query heads and weights, RoPE'd and quantized: (q fp8 [T, nh, 128], w fp32 [T, nh])."""
        w, nh = self.w, self.cfg.index_n_heads
        qi = ops.fp8_linear(qr, w.idx_wq_b8, w.idx_wq_b_s).view(x.shape[0], nh, 128)
        wi = torch.matmul(x, w.idx_wproj.t())
        return ops.fused_indexer_q_rope_quant(positions, qi, self.cos_sin_cache, wi, 128 ** -0.5, nh ** -0.5)

    def _indexer_prefill(self, q8, wq, idx_kv, step: StepMetadata, topk, K: int, first_request: int,
                         ratio: int = 4, lens=None, logits_hook=None):
        """Rows of the requests from ``first_request`` on: each request's indexer-K entries gathered once,
        logits over them in row chunks. ``lens``: the entries each token sees (default the step's C4
        indexer_lens), ``ratio`` the positions an entry stands for; ``logits_hook(logits, ends, first_row)``
        runs on each chunk's logits before its top-k (DeepSeek-V4.1's candidate blocks)."""
        lens = step.indexer_lens if lens is None else lens
        dev = q8.device
        qsl = step.query_start_loc_cpu if getattr(step, "query_start_loc_cpu", None) is not None \
            else step.query_start_loc.cpu()
        seq = step.seq_lens_cpu if getattr(step, "seq_lens_cpu", None) is not None else step.seq_lens.cpu()
        for b in range(first_request, step.num_requests):
            a, e = int(qsl[b]), int(qsl[b + 1])
            n = int(seq[b]) // ratio
            if e == a:
                continue
            k8 = torch.empty(max(n, 1), 128, dtype=torch.float8_e4m3fn, device=dev)
            ks = torch.empty(max(n, 1), dtype=torch.float32, device=dev)
            ops.cp_gather_indexer_k_quant_cache(idx_kv, k8[:n], ks[:n], step.compressed_block_table[b:b + 1],
                                                torch.tensor([0, n], dtype=torch.int32, device=dev))
            for r0 in range(a, e, INDEXER_PREFILL_ROWS):
                r1 = min(e, r0 + INDEXER_PREFILL_ROWS)
                ends = lens[r0:r1]
                starts = torch.zeros_like(ends)
                logits = ops.fp8_mqa_logits(q8[r0:r1], (k8, ks), wq[r0:r1], starts, ends)
                if logits_hook is not None:
                    logits_hook(logits, ends, r0)
                ops.top_k_per_row_prefill(logits, starts, ends, topk[r0:r1], r1 - r0, logits.stride(0),
                                          logits.stride(1), K)
