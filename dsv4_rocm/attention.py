"""DeepseekV4Attention: one DeepSeek-V4 attention layer (V4.0 and V4.1 alike) as a torch module, in the shape
of vLLM's layer.

vLLM's platform subclasses provide ``get_padded_num_q_heads``, ``forward_mqa(q, kv, positions, output)``
and ``_o_proj(o, positions)``; this module has the same three, and a ``forward(positions, hidden_states,
step)`` running vLLM's step order over the public ops (``dsv4_rocm.ops``, so each stage runs on the fastest
implementation the platform has):

    fused wq_a + wkv projection -> q / kv RMSNorm -> wq_b -> q (V4.0: per-head norm) + RoPE, kv RoPE + quant
    insert into the SWA cache -> compressor -> indexer -> sparse attention over the sliding window and the
    compressed entries, with the sink -> inverse RoPE + FP8 quant -> grouped FP8 einsum with wo_a -> wo_b.

What a layer runs is its plan (``dsv4_rocm.layer_plan``), built from the config: which compressor and
indexer it owns (``dsv4_rocm.layer_parts``), which compressed entries it attends (none, the top-k, all
visible), whose caches it reads. V4.0: swa / c4a / c128a. V4.1 (docs/math.md#v41): a kv source writes the
compressed and indexer-K caches later layers read, an index source writes the top-k the layers up to the
next index source attend with, through the stack's ``SharedBuffers``; as in vLLM, the layers of a step run
in layer order. A layer reads only tensors it was built with (its caches, its kv source's, the shared
buffers).

The step's batch comes as a ``StepMetadata`` (``dsv4_rocm.step``) passed to ``forward``; without one,
``forward`` is vLLM's memory-profiling run. Every token, decode and prefill alike, attends straight from the
fp8 pages (``dsv4_rocm.attention_step``): a decode step is a fixed sequence of kernels with no host sync,
which ``dsv4_rocm.graph`` captures into a CUDA/HIP graph.
"""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from . import layout as L
from . import ops
from .attention_step import attend_step
from .config import AttentionConfig, LayerType
from .kv_cache import RECORD_FORMATS, LayerCache, v41_records
from .layer_parts import COMPRESSORS, INDEX_SOFTMAX_SCALE, INDEXERS
from .layer_plan import LayerPlan, plan_of
from .ops.indexer import MAX_NEXT_N
from .platform import detect
from .reference.rope import build_cos_sin_cache
from .step import StepMetadata
from .weights import LayerWeights

MAX_DECODE_QUERY_LEN = MAX_NEXT_N   # decode rows per request the paged indexer logits take (DeepGEMM's next_n)


def padded_q(q: torch.Tensor, padded_heads: int) -> torch.Tensor:
    """q [T, H, 512] as the sparse kernels take it, [T, padded_heads, 512] with the heads past H zero,
    without normalizing, rotating or writing any cache: the q of a profile run (vLLM's memory-profiling
    forward, which has no metadata), here and in the vLLM plugin's layer hooks."""
    return F.pad(q, (0, 0, 0, padded_heads - q.shape[1]))


@dataclass
class SharedBuffers:
    """What the layers of one V4.1 step hand to each other (vLLM's model-level buffers): the last index
    source's top-k (local entry ids, int32 [max_tokens, index_topk], -1 padded) and the candidate source's
    blocks (int32 [max_tokens, candidate_topk_blocks])."""
    topk: torch.Tensor
    candidates: Optional[torch.Tensor] = None

    @classmethod
    def allocate(cls, cfg: AttentionConfig, max_tokens: int, device=None) -> "SharedBuffers":
        cand = None
        if cfg.candidate_source_layer_id >= 0:
            cand = torch.full((max_tokens, cfg.candidate_topk_blocks), -1, dtype=torch.int32, device=device)
        return cls(torch.full((max_tokens, cfg.index_topk), -1, dtype=torch.int32, device=device), cand)


class DeepseekV4Attention(torch.nn.Module):
    """A DeepSeek-V4 attention layer of any kind, V4.0 or V4.1 (module docstring). ``cache``: the layer's
    ``LayerCache`` (its record formats are the layer's); ``shared``: the stack's ``SharedBuffers`` (V4.1
    layers that attend a top-k or publish candidates); ``record_format``, if given, must name the cache's
    records (``kv_cache.V41_RECORDS``). ``DeepseekV41Attention`` is this same class (the name kept for code
    written against it; a V4.1 layer takes its stack's buffers by keyword, ``shared=``)."""
    timer = None        # an object with mark(stage): the trace run's per-stage timing

    def __init__(self, cfg: AttentionConfig, layer: int, weights: LayerWeights, cache: LayerCache,
                 max_model_len: int, cos_sin_cache: Optional[torch.Tensor] = None, device=None, *,
                 shared: Optional[SharedBuffers] = None, record_format: Optional[str] = None):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.plan: LayerPlan = plan_of(cfg, layer)
        self.ratio = self.plan.ratio
        self.layer_type: Optional[LayerType] = None if cfg.is_v41 else cfg.layer_type(layer)
        self.compressor, self.indexer = COMPRESSORS.get(self.plan.compressor), INDEXERS.get(self.plan.indexer)
        if record_format is not None and v41_records(record_format) != (cache.swa_format, cache.comp_format):
            raise ValueError(f"record_format must be one of {RECORD_FORMATS} and match the cache's, got "
                             f"{record_format!r} (cache: {cache.record_format!r})")
        self._check_cache(cache)
        if self.plan.shared_topk and self.plan.keys == "topk":
            if shared is None or shared.topk.shape[1] != cfg.index_topk or \
                    (self.plan.candidates and shared.candidates is None):
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
        # the views the public ops take, made once (a view costs a dispatch on every call)
        self._swa_pages = cache.swa_view().unsqueeze(-2)
        self._comp = cache.comp_view() if cache.comp is not None else None
        self._comp_pages = self._comp.unsqueeze(-2) if self._comp is not None else None
        self._idx = cache.idx_view() if cache.idx is not None else None
        if cos_sin_cache is None:
            cos_sin_cache = build_cos_sin_cache(max_positions=max_model_len + 1, device=device, **dict(self.plan.rope))
        self.register_buffer("cos_sin_cache", cos_sin_cache.to(device), persistent=False)

    def _check_cache(self, cache: LayerCache) -> None:
        """The cache holds what the plan reads: the ratio, a compressed cache for a compressed layer, the
        compressor's caches for the layer that owns it."""
        p = self.plan
        if cache.ratio != p.ratio or (p.keys != "window" and cache.comp is None):
            raise ValueError(f"cache holds ratio {cache.ratio} caches, layer {self.layer} has ratio {p.ratio}")
        missing = [n for n in (self.compressor.caches if self.compressor else ()) if getattr(cache, n) is None]
        missing += ["ring"] if p.compressor == "latent" and p.ratio == 2 and cache.ring is None else []
        if missing:
            raise ValueError(f"layer {self.layer} ({p.label}) writes the caches {missing} its cache lacks")

    def _check_weights(self) -> None:
        need = (self.compressor.needs if self.compressor else ()) + (self.indexer.needs if self.indexer else ())
        missing = [n for n in need if getattr(self.w, n, None) is None]
        if missing:
            raise ValueError(f"weights of layer {self.layer} ({self.plan.label}) lack {missing}")
        if self.plan.compressor == "latent" and self.w.comp_w.shape[0] != 512 * self.ratio:
            raise ValueError(f"layer {self.layer}: compressor weight has {self.w.comp_w.shape[0]} rows, ratio "
                             f"{self.ratio} needs {512 * self.ratio}")

    # ---- vLLM's platform hooks ---------------------------------------------------------------------------
    @classmethod
    def get_padded_num_q_heads(cls, num_heads: int) -> int:
        """The sparse kernels run 64 or 128 heads (as FlashMLA does); q and the output are padded to that."""
        if not isinstance(num_heads, int) or not 0 < num_heads <= 128:
            raise ValueError(f"DeepSeek-V4 attention supports 1..128 local heads, got {num_heads!r}")
        return 64 if num_heads <= 64 else 128

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                step: Optional[StepMetadata] = None) -> torch.Tensor:
        """hidden_states bf16 [T, hidden] -> bf16 [T, hidden]; writes this step's tokens into the caches the
        layer owns and (an index source of V4.1) its top-k into the shared buffer. Without a step it is
        vLLM's memory-profiling run: ``profile_run``."""
        if step is None:
            return self.profile_run(positions, hidden_states)
        x = hidden_states
        self._check(positions, x, step, attends=True)
        self._mark("start")
        front = step.num_decode_tokens == x.shape[0] > 0        # a decode-only step: the fused front
        qr, kv, q = self._projections(x, raw_kv=front)
        self._mark("projections")
        if front:
            q, index_query = self._decode_front(q, kv, x, qr, positions, step)
        else:
            q, index_query = self._insert(q, kv, positions, step), None
        self._mark("q norm + kv insert")
        latent = self.compressor.write(self, x, positions, step) if self.compressor else None
        self._mark("compressor")
        topk = self.indexer.topk(self, x, qr, latent, positions, step, index_query) if self.indexer else None
        self._mark("indexer")
        if topk is None and self.plan.shared_topk and self.plan.keys == "topk":
            topk = self.shared.topk[:x.shape[0]]        # the top-k of the last index source before this layer
        o_padded = torch.empty(x.shape[0], self.padded_heads, 512, dtype=torch.bfloat16, device=x.device)
        self.forward_mqa(q, kv, positions, o_padded, step, topk)
        self._mark("attention")
        y = self._o_proj(o_padded[:, :self.n_local_heads], positions)
        self._mark("output")
        return y

    def fill_caches(self, positions: torch.Tensor, hidden_states: torch.Tensor, step: StepMetadata) -> None:
        """Write this step's tokens into every cache ``forward`` writes (SWA records; the compressor's state
        or ring and entries; the index keys), by the same kernels in the same order, without the indexer's
        scores, attention or the output path: a prefix of a long context whose outputs nobody reads
        (dsv4_rocm.long_context). The caches end exactly as after ``forward`` of the same step."""
        x = hidden_states
        self._check(positions, x, step, attends=False)
        _, kv, q = self._projections(x)
        self._insert(q, kv, positions, step)
        latent = self.compressor.write(self, x, positions, step) if self.compressor else None
        if self.indexer:
            self.indexer.write_keys(self, x, latent, positions, step)

    def profile_run(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """vLLM's memory-profiling forward (no metadata; vLLM passes dummy positions): every projection of a
        step runs (q and kv, the compressors', the indexer's query and its quantization, the output path) so
        their memory is counted, nothing is written to any cache, and attention contributes zeros, as in
        vLLM's layer; the result is therefore zeros, bf16 [T, hidden]."""
        x = hidden_states
        T = self._check_inputs(positions, x, None)
        qr, _, q = self._projections(x)
        padded_q(q, self.padded_heads)          # allocated as in a step; attention does not read it
        if self.compressor:
            self.compressor.profile(self, x)
        if self.indexer:
            self.indexer.profile(self, x, qr, positions)
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

    def _check(self, positions, x, step: StepMetadata, attends: bool) -> None:
        """The inputs, the step's built ratio and, for a forward (``attends``), the shared buffers' rows and
        the decode rows an indexer's paged logits take; then the whole step against this layer's caches
        (``StepMetadata.validate``: its own SWA cache, its kv source's compressed, indexer-K and state
        caches), before the first write: a rejected step writes nothing."""
        T = self._check_inputs(positions, x, step)
        p = self.plan
        uses = ([self.shared.topk] if attends and p.shared_topk and p.keys == "topk" else []) + \
            ([self.shared.candidates] if attends and p.candidates else [])
        rows = min((b.shape[0] for b in uses), default=T)
        if T > rows:
            raise ValueError(f"the step has {T} tokens; the shared top-k / candidate buffers hold {rows} rows")
        if p.keys != "window" and p.ratio not in step.compressed_slots:
            raise ValueError(f"the step was not built for ratio {p.ratio} (StepMetadata.build(ratios=...))")
        if attends and self.indexer and step.num_decodes and step.decode_query_len > MAX_DECODE_QUERY_LEN:
            raise ValueError(f"the step's decode requests have {step.decode_query_len} tokens each; the indexer "
                             f"takes at most {MAX_DECODE_QUERY_LEN} (1 + speculative tokens)")
        step.validate(self._bounds, built=True)

    def _projections(self, x, raw_kv: bool = False):
        """(qr, kv, q [T, H, 512]): the fused wq_a + wkv projection, the q / kv RMSNorms, wq_b. ``raw_kv``: kv
        is the projection's latent before its norm (the fused decode front norms it)."""
        cfg, w = self.cfg, self.w
        qr_kv = ops.fp8_linear(x, w.wqkv8, w.wqkv_s)
        qr, kv = ops.fused_q_kv_rmsnorm(qr_kv[:, :cfg.q_lora_rank], qr_kv[:, cfg.q_lora_rank:], w.q_norm,
                                        w.kv_norm, self.eps)
        kv = qr_kv[:, cfg.q_lora_rank:] if raw_kv else kv
        return qr, kv, ops.fp8_linear(qr, w.wq_b8, w.wq_b_s).view(x.shape[0], self.n_local_heads, 512)

    def _decode_front(self, q, kv, x, qr, positions, step: StepMetadata):
        """What ``_insert`` and the indexer's query quantization write, from the raw kv latent, in one launch
        (``ops.decode_front``; the same floats and bytes as the unfused ops): (q padded, the indexer's
        quantized query or None)."""
        fmt = self.cache.swa_format
        kw = {}
        if self.indexer:
            qi, head_weights = self.indexer.query_inputs(self, x, qr)
            kw = dict(index_q=qi, index_weights=head_weights, index_weights_softmax_scale=INDEX_SOFTMAX_SCALE,
                      index_weights_head_scale=self.cfg.index_n_heads ** -0.5)
        return ops.decode_front(q, kv, self.w.kv_norm, self.cache.swa, step.slot_mapping, positions,
                                self.cos_sin_cache, self.padded_heads, self.eps, L.SWA_BLOCK_SIZE, self.plan.q_norm,
                                kv_mxfp8=fmt.name == L.V41_528.name, kv_layout=fmt.layout, **kw)

    def _insert(self, q, kv, positions, step: StepMetadata) -> torch.Tensor:
        """q (normed by the plan) and RoPE'd, padded; kv RoPE'd and quantized into the SWA cache's records."""
        fmt = self.cache.swa_format
        return ops.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(
            q, kv, self.cache.swa, step.slot_mapping, positions, self.cos_sin_cache, self.padded_heads, self.eps,
            L.SWA_BLOCK_SIZE, self.plan.q_norm, kv_mxfp8=fmt.name == L.V41_528.name, kv_layout=fmt.layout)

    def _mark(self, stage: str):
        """End of a stage, for a timer the trace run attaches (``timer.mark(stage)``); nothing otherwise."""
        if self.timer is not None:
            self.timer.mark(stage)

    def forward_mqa(self, q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, output: torch.Tensor,
                    step: StepMetadata, topk: Optional[torch.Tensor] = None) -> None:
        """Sparse attention of every token over its sliding window and its compressed entries (``topk``, the
        local top-k int32 [T, K] the layer's indexer or its index source wrote; C128: all visible entries),
        with the sink, into ``output`` [T, padded_heads, 512] (``attention_step.attend_step``). ``kv`` is
        unused: the keys are read from the caches the fused insert has written."""
        del kv, positions
        p = self.plan
        if p.keys == "topk" and topk is None:
            raise ValueError(f"layer {self.layer} ({p.label}) attends a top-k: pass topk=")
        attend_step(q, output, step, self._swa_pages, self.w.attn_sink, self.scale,
                    self._comp_pages if p.keys != "window" else None,
                    topk=topk if p.keys == "topk" else None, block_table=step.compressed_block_table,
                    block_size=p.comp_block, indices=step.c128_indices if p.keys == "all" else None,
                    lens=step.c128_lens if p.keys == "all" else None, kv_layout=self.cache.swa_format.layout)

    def _o_proj(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Inverse RoPE + FP8 quant per 128, grouped FP8 einsum with wo_a, then wo_b."""
        w, G = self.w, self.n_local_groups
        a8, sa = ops.fused_inv_rope_fp8_quant(o, positions, self.cos_sin_cache, G, self.n_local_heads // G)
        z = torch.empty(o.shape[0], G, self.cfg.o_lora_rank, dtype=torch.bfloat16, device=o.device)
        ops.fp8_einsum("bhr,hdr->bhd", (a8, sa), (w.wo_a8.view(torch.float8_e4m3fn), w.wo_a_s), z)
        return ops.fp8_linear(z.view(o.shape[0], G * self.cfg.o_lora_rank), w.wo_b8, w.wo_b_s)  # 0 rows too


DeepseekV41Attention = DeepseekV4Attention      # the same class (its docstring)
