"""The paged caches of one attention layer, allocated as vLLM's KV-cache spec lays them out.

Every layer has an SWA cache (fp8_ds_mla records, 64 tokens a block). A compressed layer adds its
compressed cache (64 entries a block for C4, 2 for C128) and the compressor's fp32 state cache (4 or 8
token positions a block); a C4 layer adds the indexer-K cache (64 entries of 128 fp8 bytes + an fp32
scale) and the indexer compressor's state. Pages are padded to a multiple of 576 bytes and the layer keeps
them as ``[num_blocks, page_bytes]``; ``*_view`` give the ``[nb, bs, record]`` views vLLM holds.
"""
from dataclasses import dataclass
from typing import Optional

import torch

from . import cache_views as V
from . import layout as L
from .config import LayerType
from .reference.compressor import kv_cache_view, new_state_cache


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

    def idx_view(self) -> torch.Tensor:
        return kv_cache_view(self.idx, 64, L.INDEXER_TOKEN_BYTES)
