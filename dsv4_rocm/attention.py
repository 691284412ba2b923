"""DeepseekV4Attention: one attention layer of DeepSeek-V4 as a torch module.

It owns the layer's weights and paged caches and runs the step order of ``reference.layer`` with the
public ops (``dsv4_rocm.ops``), so each stage runs on the fastest implementation this platform has
(``ops.backend_for``; ``DSV4_BACKEND`` / ``ops.use_backend`` override it). The serving engine supplies
the step's batch (positions, block tables, compressor state block table) as a ``StepBatch``.
"""
from typing import Optional

import torch

from . import ops
from .config import AttentionConfig, LayerType
from .platform import detect
from .reference.layer import LayerCache, LayerWeights, StepBatch, layer_forward
from .reference.rope import build_cos_sin_cache


class DeepseekV4Attention(torch.nn.Module):
    def __init__(self, cfg: AttentionConfig, layer: int, weights: LayerWeights, num_blocks: int,
                 num_state_blocks: int, max_model_len: int, cos_sin_cache: Optional[torch.Tensor] = None,
                 device=None):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.layer_type: LayerType = cfg.layer_type(layer)
        self.max_model_len = max_model_len
        device = torch.device(device) if device is not None else weights.wqkv8.device
        self.platform = detect(device)
        self.weights = weights.to(device)
        self.cache = LayerCache.allocate(self.layer_type, num_blocks, num_state_blocks, device)
        if cos_sin_cache is None:
            cos_sin_cache = build_cos_sin_cache(cfg.rope_base(self.layer_type), max_model_len + 1, device=device)
        self.register_buffer("cos_sin_cache", cos_sin_cache.to(device), persistent=False)

    @property
    def backends(self) -> dict:
        """The implementation each op of this layer runs on this platform."""
        dev = self.cos_sin_cache.device
        return {name: ops.backend_for(name, dev) for name in ops.registered_ops()}

    def forward(self, x: torch.Tensor, batch: StepBatch, decode_threshold: int = 1,
                paged_prefill: bool = True) -> torch.Tensor:
        """x bf16 [T, hidden] -> bf16 [T, hidden]; appends this step's tokens to the caches. Prefill tokens
        attend straight from the fp8 pages unless ``paged_prefill=False`` (vLLM's bf16 workspace path)."""
        return layer_forward(self.cfg, self.layer_type, self.weights, self.cache, batch, x, self.cos_sin_cache,
                             self.max_model_len, decode_threshold, impl=ops, paged_prefill=paged_prefill)
