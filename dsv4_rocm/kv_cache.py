"""The paged caches of one attention layer, allocated as vLLM's KV-cache spec lays them out.

Every layer has an SWA cache (fp8_ds_mla records, 64 tokens a block). A compressed layer adds its
compressed cache (64 entries a block for C4, 2 for C128) and the compressor's fp32 state cache (4 or 8
token positions a block); a C4 layer adds the indexer-K cache (64 entries of 128 fp8 bytes + an fp32
scale) and the indexer compressor's state. Pages are padded to a multiple of 576 bytes and the layer keeps
them as ``[num_blocks, page_bytes]``; ``*_view`` give the ``[nb, bs, record]`` views vLLM holds.

DeepSeek-V4.1 (``V41LayerCache``, ``allocate_v41``): every layer has its SWA cache; only kv-source layers
own a compressed cache (64 entries a page), an indexer-K cache (64 entries of 132 B) and, for ratio 2,
the compressor's ring (fp32 [blocks, 8, 1024], one block a request); every other compressed layer holds
references to its kv source's tensors, as vLLM's layers read them through the forward context. The
records of the SWA and compressed caches are a configuration (``V41_RECORDS``), as vLLM 0.33 picks them:
``--kv-cache-dtype fp8_ds_mla`` keeps the 584-byte V4.0 record on ROCm and Hopper ("V40_584") and writes
V4.1's 528-byte record on Blackwell ("V41_528"); ``nvfp4_ds_mla`` keeps the 528-byte window and stores the
compressed entries as 288-byte e2m1 records ("V41_528+V41_FP4_288"). V4.1's records are laid out
interleaved, as vLLM 0.33 writes them (``layout.default_layout``).
"""
from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import torch

from . import cache_views as V
from . import layout as L
from .config import AttentionConfig, LayerType
from .reference.compressor import kv_cache_view, new_state_cache
from .reference.compressor_v41 import RING_CAPACITY
from .step import V41_COMPRESSED_BLOCK, CacheBounds


@dataclass
class LayerCache:
    swa: torch.Tensor                              # uint8 [nb, 37440]
    comp: Optional[torch.Tensor] = None            # uint8 [nb, page_bytes(bs_c)]
    idx: Optional[torch.Tensor] = None             # uint8 [nb, 8640]
    comp_state: Optional[torch.Tensor] = None      # fp32 [ns, 4 or 8, 2 * coff * 512]
    idx_state: Optional[torch.Tensor] = None       # fp32 [ns, 4, 2 * 2 * 128]
    ratio: int = 1

    @classmethod
    def allocate(cls, layer_type: LayerType, num_blocks: int, num_state_blocks: int, device=None,
                 num_swa_blocks: Optional[int] = None) -> "LayerCache":
        """Zeroed caches; ``num_blocks`` pages for the compressed and indexer caches, ``num_swa_blocks``
        (default ``num_blocks``) for the SWA cache, ``num_state_blocks`` for each state cache."""
        ratio = {LayerType.SWA: 1, LayerType.C4: 4, LayerType.C128: 128}[layer_type]
        c = cls(swa=V.new_pages(num_swa_blocks or num_blocks, L.SWA_BLOCK_SIZE, device=device), ratio=ratio)
        if ratio > 1:
            c.comp = V.new_pages(num_blocks, L.compressed_block_size(ratio), device=device)
            c.comp_state = new_state_cache(num_state_blocks, ratio, 512, device)
        if ratio == 4:
            c.idx = V.new_pages(num_blocks, 64, V.INDEXER_K, device=device)
            c.idx_state = new_state_cache(num_state_blocks, 4, 128, device)
        return c

    @property
    def compressed_block_size(self) -> int:
        return L.compressed_block_size(self.ratio)

    def swa_view(self) -> torch.Tensor:
        """[nb, 64, 584] (FlashMLA's [nb, 64, 1, 584] is ``.unsqueeze(-2)`` of it)."""
        return kv_cache_view(self.swa, L.SWA_BLOCK_SIZE, L.TOKEN_BYTES)

    def comp_view(self) -> torch.Tensor:
        return kv_cache_view(self.comp, self.compressed_block_size, L.TOKEN_BYTES)

    def bounds(self) -> CacheBounds:
        """What a step may index in these caches (``StepMetadata.validate``): ratio 1 is the sliding window
        alone; C4 and C128 add the compressed cache (C4: and the indexer-K cache, 64 entries a page, which its
        indexer reads through the compressed table) and the compressor state (C4: and the indexer's)."""
        if self.ratio == 1:
            return CacheBounds(self.swa.shape[0])
        comp = ((self.comp.shape[0], self.compressed_block_size, "compressed cache"),)
        state = ((self.comp_state.shape[0], self.comp_state.shape[1], "compressor state cache"),)
        if self.ratio != 4:
            return CacheBounds(self.swa.shape[0], self.ratio, comp, state)
        comp += ((self.idx.shape[0], 64, "indexer-K cache"),)
        state += ((self.idx_state.shape[0], self.idx_state.shape[1], "indexer compressor state cache"),)
        return CacheBounds(self.swa.shape[0], 4, comp, state, index_ratio=4, index_lens="indexer_lens")

    def idx_view(self) -> torch.Tensor:
        return kv_cache_view(self.idx, 64, L.INDEXER_TOKEN_BYTES)


# record configuration -> (SWA record, compressed record) of a DeepSeek-V4.1 stack (module docstring)
V41_RECORDS = {
    "V40_584": (L.V40_584, L.V40_584),
    "V41_528": (L.with_layout(L.V41_528), L.with_layout(L.V41_528)),
    "V41_528+V41_FP4_288": (L.with_layout(L.V41_528), L.with_layout(L.V41_FP4_288)),
}
RECORD_FORMATS = tuple(V41_RECORDS)


def v41_records(record_format: str) -> tuple:
    """(SWA record, compressed record) of a record configuration, or a ValueError naming ``record_format``."""
    if record_format not in V41_RECORDS:
        raise ValueError(f"record_format must be one of {RECORD_FORMATS}, got {record_format!r}")
    return V41_RECORDS[record_format]


@dataclass
class V41LayerCache:
    """The caches a DeepSeek-V4.1 layer reads and writes: its own SWA pages, and (ratio > 0) its kv
    source's compressed pages [nb, page], indexer-K cache [nb, 64, 132] and ring (ratio 2)."""
    swa: torch.Tensor
    ratio: int = 0
    kv_source: Optional[int] = None
    comp: Optional[torch.Tensor] = None
    idx: Optional[torch.Tensor] = None
    ring: Optional[torch.Tensor] = None
    record_format: str = "V40_584"            # a key of V41_RECORDS

    @property
    def swa_format(self) -> L.RecordFormat:
        return v41_records(self.record_format)[0]

    @property
    def comp_format(self) -> L.RecordFormat:
        return v41_records(self.record_format)[1]

    def swa_view(self) -> torch.Tensor:
        """[nb, 64, R] (R the SWA record's bytes; FlashMLA's [nb, 64, 1, R] is ``.unsqueeze(-2)`` of it)."""
        return kv_cache_view(self.swa, L.SWA_BLOCK_SIZE, self.swa_format.token_bytes)

    def comp_view(self) -> torch.Tensor:
        """[nb, 64, R] (R the compressed record's bytes)."""
        return kv_cache_view(self.comp, V41_COMPRESSED_BLOCK, self.comp_format.token_bytes)

    def bounds(self) -> CacheBounds:
        """What a step may index in these caches (``StepMetadata.validate``). Ratio 0 is the sliding window
        alone. A compressed layer (ratio 1 or 2; its kv source's tensors) indexes the compressed and indexer-K
        caches through compressed_block_table and compressed_slots[ratio] (64 entries a page, whatever the
        indexer record's size), and its index source reads entries 0 .. seq_len // ratio - 1 of each request
        through that table, bounded by v41_lens[ratio]; ratio 2 adds the compressor ring, one block a request
        (state_block_table[b, 0]) of ``RING_CAPACITY`` rows, which state_slots[2] index."""
        if not self.ratio:
            return CacheBounds(self.swa.shape[0])
        comp = ((self.comp.shape[0], V41_COMPRESSED_BLOCK, "compressed cache"),
                (self.idx.shape[0], self.idx.shape[1], "indexer-K cache"))
        ring = ((self.ring.shape[0], self.ring.shape[1], "compressor ring"),) if self.ratio == 2 else ()
        return CacheBounds(self.swa.shape[0], self.ratio, comp, ring, ring=bool(ring), index_ratio=self.ratio,
                           index_block=self.idx.shape[1], index_lens=f"v41_lens[{self.ratio}]")


def allocate_v41(cfg: AttentionConfig, layers: Sequence[int], num_blocks: int, num_ring_blocks: int,
                 num_swa_blocks: Optional[int] = None, device=None,
                 record_format: str = "V40_584") -> Dict[int, V41LayerCache]:
    """Zeroed caches of the V4.1 layers ``layers`` (every layer's kv source among them): ``num_blocks`` pages
    for each compressed and indexer-K cache, ``num_swa_blocks`` (default ``num_blocks``) SWA pages a layer,
    ``num_ring_blocks`` ring blocks for each ratio-2 source, the records of ``record_format`` (a key of
    ``V41_RECORDS``). Layers sharing a kv source share its tensors."""
    swa_fmt, comp_fmt = v41_records(record_format)
    out: Dict[int, V41LayerCache] = {}
    for layer in sorted(layers):
        spec = cfg.v41_layer(layer)
        c = V41LayerCache(swa=V.new_pages(num_swa_blocks or num_blocks, L.SWA_BLOCK_SIZE, swa_fmt, device=device),
                          ratio=spec.ratio, kv_source=spec.kv_source, record_format=record_format)
        if spec.ratio and spec.owns_kv:
            c.comp = V.new_pages(num_blocks, V41_COMPRESSED_BLOCK, comp_fmt, device=device)
            c.idx = kv_cache_view(V.new_pages(num_blocks, V41_COMPRESSED_BLOCK, V.INDEXER_K, device=device),
                                  V41_COMPRESSED_BLOCK, L.INDEXER_TOKEN_BYTES)
            if spec.ratio == 2:
                c.ring = torch.zeros(num_ring_blocks, RING_CAPACITY, 1024, dtype=torch.float32, device=device)
        elif spec.ratio:
            if spec.kv_source not in out:
                raise ValueError(f"layers: layer {layer} reads the caches of layer {spec.kv_source}, which is not "
                                 "among them")
            src = out[spec.kv_source]
            c.comp, c.idx, c.ring = src.comp, src.idx, src.ring
        out[layer] = c
    return out
