"""What one attention layer runs, as data read from the config: its ``LayerPlan``.

DeepSeek-V4.0 and V4.1 layers run the same step (projections, q / kv insert, compressor, indexer, sparse
attention, output path); they differ in which parts a layer owns and how each part works:

    V4.0 swa / c4a / c128a    ratio 1 / 4 / 128; a compressed layer owns its "pooled" compressor (state cache,
                              overlapping windows for C4); a C4 layer owns a "pooled" indexer (its own
                              compressor into the indexer-K cache, a top-k of its own); C128 attends all
                              visible entries
    V4.1 ratio 0 / 1 / 2      a kv source owns the "latent" compressor (its bf16 latent, a ring for ratio 2)
                              and writes the compressed and indexer-K caches the later layers read; an index
                              source owns a "latent" indexer (keys from the kv source's latents) writing the
                              top-k every layer up to the next index source attends with, through the
                              stack's shared buffer; the candidate source publishes candidate blocks that
                              later index sources score inside

``plan_of(cfg, layer)`` is the only place that tells the two versions apart; the layer
(``dsv4_rocm.attention``), its caches (``dsv4_rocm.kv_cache``) and the synthetic server
(``dsv4_rocm.serving``) read the plan's fields.
"""
from dataclasses import dataclass
from typing import Optional

from . import layout as L
from .config import AttentionConfig, LayerType
from .step import V41_COMPRESSED_BLOCK

_V40_RATIO = {LayerType.SWA: 1, LayerType.C4: 4, LayerType.C128: 128}


@dataclass(frozen=True)
class LayerPlan:
    """One layer's kind and parts (module docstring). ``ratio`` is the key of the layer's cache and of the
    step's index sets it reads (V4.0: 1 for a sliding-window layer, 4, 128; V4.1: 0, 1, 2)."""
    layer: int
    label: str                      # swa | c4a | c128a | r2-kv-source | r1-index-source+candidates ...
    ratio: int
    keys: str                       # compressed entries attention reads: "window" (none), "topk", "all"
    compressor: Optional[str]       # None | "pooled" (V4.0) | "latent" (V4.1): owns and writes compressed caches
    indexer: Optional[str]          # None | "pooled" | "latent": computes the top-k
    candidates: Optional[str]       # None | "select" (publishes candidate blocks) | "mask" (scores inside them)
    kv_source: Optional[int]        # the layer whose compressed caches this one reads (itself if it owns them)
    index_source: Optional[int]     # the layer whose top-k this one attends with
    q_norm: bool                    # per-head q RMSNorm before RoPE (V4.0 yes, V4.1 no)
    rope: tuple                     # build_cos_sin_cache keyword items
    comp_block: int                 # compressed entries a page (0: no compressed cache)
    comp_page_positions: int        # token positions a compressed page covers at most (page counts)
    state_positions: int            # token positions a compressor state block holds; 0: one ring block a request
    shared_topk: bool               # the top-k passes through the stack's shared buffer (SharedBuffers)
    index_lens: str                 # the step's built field bounding the indexer's entries ("" without one)

    @property
    def owns_kv(self) -> bool:
        return self.compressor is not None

    @property
    def owns_index(self) -> bool:
        return self.indexer is not None


def plan_of(cfg: AttentionConfig, layer: int) -> LayerPlan:
    """The plan of layer ``layer`` of ``cfg`` (V4.0: by its layer type; V4.1: by ``cfg.v41_layer``)."""
    if cfg.is_v41:
        s = cfg.v41_layer(layer)
        r = s.ratio
        return LayerPlan(
            layer, s.label, r, keys="topk" if r else "window", compressor="latent" if r and s.owns_kv else None,
            indexer="latent" if r and s.owns_index else None,
            candidates="select" if s.candidate_source else "mask" if s.uses_candidates else None,
            kv_source=s.kv_source, index_source=s.index_source, q_norm=False,
            rope=tuple(cfg.v41_rope(layer).items()), comp_block=V41_COMPRESSED_BLOCK if r else 0,
            comp_page_positions=V41_COMPRESSED_BLOCK, state_positions=0, shared_topk=True,
            index_lens=f"v41_lens[{r}]" if r else "")
    lt = cfg.layer_type(layer)
    return v40_plan(layer, lt, cfg.rope_base(lt))


def v40_plan(layer: int, layer_type: LayerType, rope_base: float) -> LayerPlan:
    """The plan of a DeepSeek-V4.0 layer of ``layer_type`` (RoPE base ``rope_base``)."""
    r = _V40_RATIO[layer_type]
    return LayerPlan(
        layer, layer_type.value, r, keys={1: "window", 4: "topk", 128: "all"}[r],
        compressor="pooled" if r > 1 else None, indexer="pooled" if r == 4 else None, candidates=None,
        kv_source=layer if r > 1 else None, index_source=layer if r == 4 else None, q_norm=True,
        rope=(("base", rope_base),), comp_block=L.compressed_block_size(r) if r > 1 else 0,
        comp_page_positions=L.LOGICAL_BLOCK_TOKENS, state_positions=L.state_block_size(r if r > 1 else 128),
        shared_topk=False, index_lens="indexer_lens" if r == 4 else "")
