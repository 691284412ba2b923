"""A synthetic serving loop over a stack of DeepSeek-V4.1 attention layers that share caches as the model
does: page allocation, vLLM-shaped step metadata, outputs per request and layer.

``V41Stack`` takes the config's layers ``layers`` (each layer's kv source and index source among them):
kv sources own the compressed, indexer-K and ring caches, the other compressed layers read theirs, and
every layer reads the top-k of the last index source before it through the stack's shared buffers. The
layers of a step run in layer order, each on the same hidden states (an attention-only stack: what
reaches the next layer in the model passes through its MLP, which is not ours). The batch handling is
``SyntheticServer``'s (decode requests first, interleaved pages); the compressed block table maps
64-entry blocks of every ratio, the state table's first column is each request's ring block.
``record_format`` picks the records of the SWA and compressed caches (``kv_cache.V41_RECORDS``: "V40_584",
"V41_528", "V41_528+V41_FP4_288").
"""
import math
from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import torch

from . import layout as L
from .attention_v41 import DeepseekV41Attention, V41SharedBuffers
from .config import AttentionConfig
from .kv_cache import allocate_v41
from .serving import SyntheticServer
from .step import V41_COMPRESSED_BLOCK
from .weights import LayerWeights

# one layer of each kind of DeepSeek-V4.1-Flash, with the sources they read: 0 sliding window; 2 ratio-2 kv
# source; 3 reads 2's caches and top-k; 20 ratio-1 kv source and candidate source; 21 reads 20's; 24 an index
# source scoring inside 20's candidates; 25 reads 20's caches and 24's top-k
FLASH_LAYERS = (0, 2, 3, 20, 21, 24, 25)


def check_stack(cfg: AttentionConfig, layers: Sequence[int]) -> tuple:
    """The layers sorted, each one's kv and index source among them (a ValueError naming the layer else)."""
    layers = tuple(sorted(set(int(x) for x in layers)))
    if not layers:
        raise ValueError("layers: a stack needs at least one layer")
    for x in layers:
        s = cfg.v41_layer(x)
        for what, src in (("kv source", s.kv_source), ("index source", s.index_source)):
            if src is not None and src not in layers:
                raise ValueError(f"layers: layer {x} reads its {what} {src}, which is not in the stack {layers}")
    return layers


@dataclass
class V41Stack(SyntheticServer):
    layers: Sequence[int] = FLASH_LAYERS
    max_step_tokens: int = 4096
    layer_weights: Optional[Dict[int, LayerWeights]] = None
    record_format: str = "V40_584"

    def __post_init__(self):
        cfg, dev = self.cfg, self.device
        self.layers = check_stack(cfg, self.layers)
        self.specs = {x: cfg.v41_layer(x) for x in self.layers}
        self.swa_pages = math.ceil(self.max_model_len / L.SWA_BLOCK_SIZE)
        self.comp_pages = math.ceil(self.max_model_len / V41_COMPRESSED_BLOCK)      # ratio 1 needs the most
        self.state_pages = 1                                                        # the ring block
        nb = self.num_requests * max(self.swa_pages, self.comp_pages)
        ns = self.num_requests
        self.caches = allocate_v41(cfg, self.layers, nb, ns, device=dev, record_format=self.record_format)
        self.cache = self.caches[self.layers[0]]
        if self.layer_weights is None:
            self.layer_weights = {x: LayerWeights.random_v41(cfg, x, self.seed + x, dev) for x in self.layers}
        g = torch.Generator().manual_seed(self.seed + 7)
        perm = torch.randperm(nb, generator=g)
        self.swa_bt = perm[:self.num_requests * self.swa_pages].view(self.num_requests, self.swa_pages)
        self.comp_bt = perm[:self.num_requests * self.comp_pages].view(self.num_requests, self.comp_pages)
        self.state_bt = torch.randperm(ns, generator=torch.Generator().manual_seed(self.seed + 11)).view(ns, 1)
        self._rows = [t.to(torch.int32).tolist() for t in (self.swa_bt, self.comp_bt, self.state_bt)]
        self.swa_bt, self.comp_bt, self.state_bt = (t.to(torch.int32).to(dev)
                                                    for t in (self.swa_bt, self.comp_bt, self.state_bt))
        self.shared = V41SharedBuffers.allocate(cfg, self.max_step_tokens, dev)
        self.modules = {x: DeepseekV41Attention(cfg, x, self.layer_weights[x], self.caches[x], self.shared,
                                                self.max_model_len, device=dev, record_format=self.record_format)
                        for x in self.layers}
        self.layer = self.modules[self.layers[0]]
        self.cos_sin = self.layer.cos_sin_cache
        self.done = [0] * self.num_requests

    def ratios(self) -> tuple:
        return tuple(sorted({s.ratio for s in self.specs.values() if s.ratio}))

    def step_all(self, tokens: Dict[int, torch.Tensor]) -> Dict[int, Dict[int, torch.Tensor]]:
        """Run one step through every layer: ``tokens[req]`` = the next bf16 hidden rows of that request.
        Returns {layer: {request: output rows}}."""
        if not tokens:
            return {}
        step = self.make_step({b: t.shape[0] for b, t in tokens.items()})
        step.build(self.ratios())
        x = torch.cat([tokens[b] for b in step.order]).to(self.device)
        out = {}
        for layer in self.layers:
            y = self.modules[layer](step.positions, x, step)
            out[layer] = {b: y[a:e] for b, (a, e) in zip(step.order, step.token_ranges)}
        for b in step.order:
            self.done[b] += tokens[b].shape[0]
        return out

    def step(self, tokens: Dict[int, torch.Tensor]) -> Dict[int, torch.Tensor]:
        """One step; the outputs of every layer, concatenated along the hidden dim per request."""
        out = self.step_all(tokens)
        return {b: torch.cat([out[x][b] for x in self.layers], dim=-1) for b in tokens}
