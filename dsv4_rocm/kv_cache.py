"""The paged caches of one attention layer, allocated as vLLM's KV-cache spec lays them out: one
``LayerCache`` type for DeepSeek-V4.0 and V4.1 layers, whose record formats are values
(``layout.RecordFormat``) and whose parts follow the layer's plan (``dsv4_rocm.layer_plan``).

Every layer has an SWA cache (64 tokens a block). DeepSeek-V4.0: a compressed layer adds its compressed
cache (64 entries a block for C4, 2 for C128) and the compressor's fp32 state cache (4 or 8 token positions
a block); a C4 layer adds the indexer-K cache (64 entries of 128 fp8 bytes + an fp32 scale) and the indexer
compressor's state. DeepSeek-V4.1: only kv-source layers own a compressed cache (64 entries a page), an
indexer-K cache (64 entries of 132 B) and, for ratio 2, the compressor's ring (fp32 [blocks, 8, 1024], one
block a request); every other compressed layer holds references to its kv source's tensors, as vLLM's
layers read them through the forward context. Pages are padded as the record format says and the layer
keeps them as ``[num_blocks, page_bytes]``; ``*_view`` give the ``[nb, bs, record]`` views vLLM holds.

The records of the SWA and compressed caches are a configuration (``V41_RECORDS``), as vLLM 0.33 picks them:
``--kv-cache-dtype fp8_ds_mla`` keeps the 584-byte V4.0 record on ROCm and Hopper ("V40_584", the only one
of a V4.0 model) and writes V4.1's 528-byte record on Blackwell ("V41_528"); ``nvfp4_ds_mla`` keeps the
528-byte window and stores the compressed entries as 288-byte e2m1 records ("V41_528+V41_FP4_288"). V4.1's
records are laid out interleaved, as vLLM 0.33 writes them (``layout.default_layout``).
"""
from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import torch

from . import cache_views as V
from . import layout as L
from .config import AttentionConfig, LayerType
from .layer_plan import LayerPlan, plan_of, v40_plan
from .reference.compressor import kv_cache_view, new_state_cache
from .reference.compressor_v41 import RING_CAPACITY
from .step import V41_COMPRESSED_BLOCK, CacheBounds

# record configuration -> (SWA record, compressed record) (module docstring)
V41_RECORDS = {
    "V40_584": (L.V40_584, L.V40_584),
    "V41_528": (L.with_layout(L.V41_528), L.with_layout(L.V41_528)),
    "V41_528+V41_FP4_288": (L.with_layout(L.V41_528), L.with_layout(L.V41_FP4_288)),
}
RECORD_FORMATS = tuple(V41_RECORDS)
INDEX_BLOCK = 64                  # indexer-K entries a page (both versions)
# compressed entries a page by the layer's ratio (V4.0 C4 / C128; V4.1 ratios 1, 2)
_COMP_BLOCK = {4: L.compressed_block_size(4), 128: L.compressed_block_size(128), 1: V41_COMPRESSED_BLOCK,
               2: V41_COMPRESSED_BLOCK}


def v41_records(record_format: str) -> tuple:
    """(SWA record, compressed record) of a record configuration, or a ValueError naming ``record_format``."""
    if record_format not in V41_RECORDS:
        raise ValueError(f"record_format must be one of {RECORD_FORMATS}, got {record_format!r}")
    return V41_RECORDS[record_format]


@dataclass
class LayerCache:
    """The caches one layer reads and writes. ``ratio``: the layer's (``LayerPlan.ratio``); ``kv_source``: the
    V4.1 layer whose compressed, indexer-K and ring tensors these are (shared, not copied)."""
    swa: torch.Tensor                              # uint8 [nb, page_bytes(64)]
    comp: Optional[torch.Tensor] = None            # uint8 [nb, page_bytes(bs_c)]
    idx: Optional[torch.Tensor] = None             # uint8 [nb, 8640] (V4.1: its [nb, 64, 132] view)
    comp_state: Optional[torch.Tensor] = None      # V4.0: fp32 [ns, 4 or 8, 2 * coff * 512]
    idx_state: Optional[torch.Tensor] = None       # V4.0: fp32 [ns, 4, 2 * 2 * 128]
    ratio: int = 1
    ring: Optional[torch.Tensor] = None            # V4.1 ratio 2: fp32 [blocks, RING_CAPACITY, 1024]
    kv_source: Optional[int] = None
    swa_format: L.RecordFormat = L.V40_584
    comp_format: L.RecordFormat = L.V40_584

    @classmethod
    def allocate(cls, layer_type: LayerType, num_blocks: int, num_state_blocks: int, device=None,
                 num_swa_blocks: Optional[int] = None) -> "LayerCache":
        """Zeroed caches of one DeepSeek-V4.0 layer of ``layer_type``; ``num_blocks`` pages for the
        compressed and indexer caches, ``num_swa_blocks`` (default ``num_blocks``) for the SWA cache,
        ``num_state_blocks`` for each state cache."""
        return _own_caches(v40_plan(0, layer_type, 0.0), num_blocks, num_state_blocks, num_swa_blocks, device,
                           "V40_584")

    @property
    def record_format(self) -> str:
        """The name of the record configuration (a key of ``V41_RECORDS``)."""
        return next(k for k, v in V41_RECORDS.items() if v == (self.swa_format, self.comp_format))

    @property
    def compressed_block_size(self) -> int:
        return _COMP_BLOCK[self.ratio]

    def swa_view(self) -> torch.Tensor:
        """[nb, 64, R] (R the SWA record's bytes; FlashMLA's [nb, 64, 1, R] is ``.unsqueeze(-2)`` of it)."""
        return kv_cache_view(self.swa, L.SWA_BLOCK_SIZE, self.swa_format.token_bytes)

    def comp_view(self) -> torch.Tensor:
        """[nb, bs_c, R] (R the compressed record's bytes)."""
        return kv_cache_view(self.comp, self.compressed_block_size, self.comp_format.token_bytes)

    def idx_view(self) -> torch.Tensor:
        """[nb, 64, 132]."""
        return self.idx if self.idx.dim() == 3 else kv_cache_view(self.idx, INDEX_BLOCK, L.INDEXER_TOKEN_BYTES)

    def bounds(self) -> CacheBounds:
        """What a step may index in these caches (``StepMetadata.validate``). A sliding-window layer indexes
        the window alone. A compressed layer adds its compressed cache (and the indexer-K cache, 64 entries a
        page, where an indexer reads it through the compressed table: V4.0 C4, every compressed V4.1 layer)
        and the compressor's state: V4.0 state caches paged by position (C4: and the indexer's), or the V4.1
        ratio-2 ring, one block a request (state_block_table[b, 0]) of ``RING_CAPACITY`` rows, which
        state_slots[2] index. The indexer reads entries 0 .. seq_len // ratio - 1 of each request, bounded
        by the step's built length field (``indexer_lens``, ``v41_lens[ratio]``)."""
        if self.comp is None:
            return CacheBounds(self.swa.shape[0])
        comp = ((self.comp.shape[0], self.compressed_block_size, "compressed cache"),)
        if self.idx is not None:
            comp += ((self.idx.shape[0], INDEX_BLOCK, "indexer-K cache"),)
        state = tuple((t.shape[0], t.shape[1], what) for t, what in (
            (self.comp_state, "compressor state cache"), (self.idx_state, "indexer compressor state cache"),
            (self.ring, "compressor ring")) if t is not None)
        index_lens = {4: "indexer_lens", 1: "v41_lens[1]", 2: "v41_lens[2]"}.get(self.ratio, "")
        return CacheBounds(self.swa.shape[0], self.ratio, comp, state, ring=self.ring is not None,
                           index_ratio=self.ratio if index_lens else 0, index_lens=index_lens)


def _own_caches(plan: LayerPlan, num_blocks: int, num_state_blocks: int, num_swa_blocks: Optional[int], device,
                record_format: str) -> LayerCache:
    """Zeroed caches a layer owns by its plan: the SWA cache; a compressor's compressed cache and state
    (V4.0 "pooled": a state cache of ``num_state_blocks`` blocks; V4.1 "latent" ratio 2: a ring of
    ``num_state_blocks`` blocks); an indexer's keys (V4.0: and its compressor state; V4.1: a kv source's)."""
    swa_fmt, comp_fmt = v41_records(record_format)
    r = plan.ratio
    c = LayerCache(swa=V.new_pages(num_swa_blocks or num_blocks, L.SWA_BLOCK_SIZE, swa_fmt, device=device),
                   ratio=r, swa_format=swa_fmt, comp_format=comp_fmt)
    if plan.compressor is None:
        return c
    c.comp = V.new_pages(num_blocks, plan.comp_block, comp_fmt, device=device)
    if plan.compressor == "pooled":
        c.comp_state = new_state_cache(num_state_blocks, r, 512, device)
        if plan.indexer:
            c.idx = V.new_pages(num_blocks, INDEX_BLOCK, V.INDEXER_K, device=device)
            c.idx_state = new_state_cache(num_state_blocks, 4, 128, device)
        return c
    c.idx = kv_cache_view(V.new_pages(num_blocks, INDEX_BLOCK, V.INDEXER_K, device=device), INDEX_BLOCK,
                          L.INDEXER_TOKEN_BYTES)
    if r == 2:
        c.ring = torch.zeros(num_state_blocks, RING_CAPACITY, 1024, dtype=torch.float32, device=device)
    return c


def allocate_caches(cfg: AttentionConfig, layers: Sequence[int], num_blocks: int, num_state_blocks: int,
                    num_swa_blocks: Optional[int] = None, device=None,
                    record_format: str = "V40_584") -> Dict[int, LayerCache]:
    """Zeroed caches of the layers ``layers`` of ``cfg`` (every V4.1 layer's kv source among them):
    ``num_blocks`` pages for each compressed and indexer-K cache, ``num_swa_blocks`` (default ``num_blocks``)
    SWA pages a layer, ``num_state_blocks`` blocks for each compressor state (V4.0) or ring (V4.1 ratio-2
    sources), the records of ``record_format`` (a key of ``V41_RECORDS``; V4.0 models: "V40_584"). A layer
    that reads another's compressed caches holds that layer's tensors."""
    v41_records(record_format)
    if not cfg.is_v41 and record_format != "V40_584":
        raise ValueError(f"record_format: a DeepSeek-V4.0 model keeps V40_584 records, got {record_format!r}")
    out: Dict[int, LayerCache] = {}
    for layer in sorted(layers):
        plan = plan_of(cfg, layer)
        c = _own_caches(plan, num_blocks, num_state_blocks, num_swa_blocks, device, record_format)
        c.kv_source = plan.kv_source if cfg.is_v41 else None
        if plan.ratio and plan.keys != "window" and plan.compressor is None:
            if plan.kv_source not in out:
                raise ValueError(f"layers: layer {layer} reads the caches of layer {plan.kv_source}, which is not "
                                 "among them")
            src = out[plan.kv_source]
            c.comp, c.idx, c.ring = src.comp, src.idx, src.ring
        out[layer] = c
    return out
