"""A small synthetic serving loop over one attention layer: page allocation, step batches, outputs.

Used by the main job (``python -m dsv4_rocm run``), the layer invariance tests and the parity report.
Each request owns a fixed range of pages (no sharing), enough for ``max_model_len`` tokens.
"""
import math
from dataclasses import dataclass
from typing import Dict

import torch

from . import layout as L
from .config import AttentionConfig, LayerType
from .reference.compressor import state_block_size
from .reference.layer import LayerCache, LayerWeights, StepBatch, layer_forward, REFERENCE_IMPL
from .reference.rope import build_cos_sin_cache


@dataclass
class SyntheticServer:
    cfg: AttentionConfig
    layer_type: LayerType
    num_requests: int
    max_model_len: int
    device: str = "cpu"
    seed: int = 0
    impl: object = None
    decode_threshold: int = 1

    def __post_init__(self):
        self.impl = self.impl or REFERENCE_IMPL
        self.swa_pages = math.ceil(self.max_model_len / L.SWA_BLOCK_SIZE)
        self.comp_pages = math.ceil(self.max_model_len / L.LOGICAL_BLOCK_TOKENS)
        nb = self.num_requests * max(self.swa_pages, self.comp_pages)
        ratio = {LayerType.C4: 4, LayerType.C128: 128}.get(self.layer_type, 128)
        self.state_pages = math.ceil(self.max_model_len / state_block_size(ratio))
        ns = self.num_requests * self.state_pages
        self.weights = LayerWeights.random(self.cfg, self.layer_type, self.seed, self.device)
        self.cache = LayerCache.allocate(self.layer_type, nb, ns, self.device)
        # interleave pages of different requests so that a wrong block-table read shows up
        perm = torch.randperm(nb, generator=torch.Generator().manual_seed(self.seed + 7))
        self.swa_bt = perm[:self.num_requests * self.swa_pages].view(self.num_requests, self.swa_pages)
        self.comp_bt = perm[:self.num_requests * self.comp_pages].view(self.num_requests, self.comp_pages)
        sperm = torch.randperm(ns, generator=torch.Generator().manual_seed(self.seed + 11))
        self.state_bt = sperm.view(self.num_requests, self.state_pages)
        self.swa_bt, self.comp_bt, self.state_bt = (t.to(torch.int32).to(self.device)
                                                    for t in (self.swa_bt, self.comp_bt, self.state_bt))
        self.cos_sin = build_cos_sin_cache(self.cfg.rope_base(self.layer_type), self.max_model_len + 1,
                                           device=self.device)
        self.done = [0] * self.num_requests

    def step(self, tokens: Dict[int, torch.Tensor]) -> Dict[int, torch.Tensor]:
        """Run one step: ``tokens[req]`` = the next bf16 hidden rows [n, hidden] of that request.
        Returns the layer output rows per request."""
        reqs = sorted(tokens)
        if not reqs:
            return {}
        for b in reqs:
            if self.done[b] + tokens[b].shape[0] > self.max_model_len:
                raise ValueError(f"request {b} would exceed max_model_len {self.max_model_len}")
        lens = [tokens[b].shape[0] for b in reqs]
        qsl = torch.tensor([0] + list(torch.cumsum(torch.tensor(lens), 0)), dtype=torch.int32, device=self.device)
        pos = torch.cat([torch.arange(self.done[b], self.done[b] + n) for b, n in zip(reqs, lens)]).to(self.device)
        idx = torch.tensor(reqs, device=self.device)
        batch = StepBatch(qsl, torch.tensor([self.done[b] + n for b, n in zip(reqs, lens)], dtype=torch.int32,
                                            device=self.device),
                          pos, self.swa_bt[idx], self.comp_bt[idx], self.state_bt[idx])
        x = torch.cat([tokens[b] for b in reqs]).to(self.device)
        y = layer_forward(self.cfg, self.layer_type, self.weights, self.cache, batch, x, self.cos_sin,
                          self.max_model_len, self.decode_threshold, self.impl)
        for b, n in zip(reqs, lens):
            self.done[b] += n
        return {b: y[int(qsl[i]):int(qsl[i + 1])] for i, b in enumerate(reqs)}
