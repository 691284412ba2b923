"""A small synthetic serving loop over one attention layer: page allocation, vLLM-shaped step metadata,
outputs per request.

Used by the main job (``python -m dsv4_rocm run``), the layer tests, the parity report and the layer
benchmark. Each request owns a fixed range of pages (no sharing), enough for ``max_model_len`` tokens;
the pages of different requests are interleaved so that a wrong block-table read shows up. A step is
ordered as vLLM's scheduler orders it: decode requests (query length == ``decode_query_len``) first,
then prefill and chunked-prefill requests.
"""
import math
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from . import layout as L
from .attention import DeepseekV4Attention
from .config import AttentionConfig, LayerType
from .kv_cache import LayerCache
from .reference.compressor import state_block_size
from .reference.rope import build_cos_sin_cache
from .step import StepMetadata
from .weights import LayerWeights


@dataclass
class SyntheticServer:
    cfg: AttentionConfig
    layer_type: LayerType
    num_requests: int
    max_model_len: int
    device: str = "cpu"
    seed: int = 0
    decode_query_len: int = 1
    weights: Optional[LayerWeights] = None

    def __post_init__(self):
        dev = self.device
        self.swa_pages = math.ceil(self.max_model_len / L.SWA_BLOCK_SIZE)
        self.comp_pages = math.ceil(self.max_model_len / L.LOGICAL_BLOCK_TOKENS)
        ratio = {LayerType.C4: 4, LayerType.C128: 128}.get(self.layer_type, 128)
        self.state_pages = math.ceil(self.max_model_len / state_block_size(ratio))
        nb = self.num_requests * max(self.swa_pages, self.comp_pages)
        ns = self.num_requests * self.state_pages
        self.weights = self.weights if self.weights is not None else \
            LayerWeights.random(self.cfg, self.layer_type, self.seed, dev)
        self.cache = LayerCache.allocate(self.layer_type, nb, ns, dev)
        g = torch.Generator().manual_seed(self.seed + 7)
        perm = torch.randperm(nb, generator=g)
        self.swa_bt = perm[:self.num_requests * self.swa_pages].view(self.num_requests, self.swa_pages)
        self.comp_bt = perm[:self.num_requests * self.comp_pages].view(self.num_requests, self.comp_pages)
        self.state_bt = torch.randperm(ns, generator=torch.Generator().manual_seed(self.seed + 11)).view(
            self.num_requests, self.state_pages)
        # host rows of the tables (what a scheduler holds): a step's metadata is built on the host and sent in
        # two copies, without reading anything back
        self._rows = [t.to(torch.int32).tolist() for t in (self.swa_bt, self.comp_bt, self.state_bt)]
        self.swa_bt, self.comp_bt, self.state_bt = (t.to(torch.int32).to(dev)
                                                    for t in (self.swa_bt, self.comp_bt, self.state_bt))
        self.cos_sin = build_cos_sin_cache(self.cfg.rope_base(self.layer_type), self.max_model_len + 1, device=dev)
        self.layer = DeepseekV4Attention(self.cfg, self.cfg.first_layer_of(self.layer_type), self.weights,
                                         self.cache, self.max_model_len, self.cos_sin, device=dev)
        self.done = [0] * self.num_requests

    def make_step(self, lens: Dict[int, int]) -> StepMetadata:
        """The step metadata of ``lens[req]`` new tokens per request, decode requests first (unbuilt)."""
        for b, n in lens.items():
            if not 0 <= b < self.num_requests:
                raise ValueError(f"request {b} is not one of the server's {self.num_requests}")
            if n <= 0:
                raise ValueError(f"request {b}: a step must add at least one token, got {n}")
            if self.done[b] + n > self.max_model_len:
                raise ValueError(f"request {b} would exceed max_model_len {self.max_model_len}")
        reqs = self.order(lens)
        n = [lens[b] for b in reqs]
        R, T = len(reqs), sum(n)
        qsl, seq, pos, slots = [0], [], [], []
        swa_rows = self._rows[0]
        for b, k in zip(reqs, n):
            start, row = self.done[b], swa_rows[b]
            qsl.append(qsl[-1] + k)
            seq.append(start + k)
            pos.extend(range(start, start + k))
            slots.extend(row[p // L.SWA_BLOCK_SIZE] * L.SWA_BLOCK_SIZE + p % L.SWA_BLOCK_SIZE
                         for p in range(start, start + k))
        # one int64 and one int32 host buffer (pinned on a GPU), each segment 16-byte aligned, copied once each
        tables = [[t[b] for b in reqs] for t in self._rows]
        i32, spans = [], []
        for part in [qsl, seq] + [sum(rows, []) for rows in tables]:
            spans.append((len(i32), len(part)))
            i32 += part + [0] * (-len(part) % 4)
        dev = torch.device(self.device)
        pin = dev.type == "cuda"
        h64 = torch.tensor(pos + slots, dtype=torch.int64, pin_memory=pin)
        h32 = torch.tensor(i32, dtype=torch.int32, pin_memory=pin)
        d64, d32 = (h.to(dev, non_blocking=True) for h in (h64, h32))
        (a, _), (c, _) = spans[0], spans[1]
        bts = [d32[o:o + m].view(R, -1) for o, m in spans[2:]]
        nd = sum(1 for b in reqs if lens[b] == self.decode_query_len)
        step = StepMetadata(d32[a:a + R + 1], d32[c:c + R], d64[:T], d64[T:], *bts, num_decodes=nd,
                            num_decode_tokens=nd * self.decode_query_len, max_model_len=self.max_model_len,
                            window=self.cfg.sliding_window, query_start_loc_cpu=h32[a:a + R + 1],
                            seq_lens_cpu=h32[c:c + R])
        step.order = reqs
        step.token_ranges = list(zip(qsl, qsl[1:]))
        return step

    def order(self, lens: Dict[int, int]) -> list:
        """vLLM's batch order: decode requests first, then the others, each by request id."""
        dec = sorted(b for b, n in lens.items() if n == self.decode_query_len)
        return dec + sorted(b for b in lens if b not in dec)

    def step(self, tokens: Dict[int, torch.Tensor]) -> Dict[int, torch.Tensor]:
        """Run one step: ``tokens[req]`` = the next bf16 hidden rows [n, hidden] of that request.
        Returns the layer output rows per request."""
        if not tokens:
            return {}
        step = self.make_step({b: t.shape[0] for b, t in tokens.items()})
        step.build(self.ratios())
        x = torch.cat([tokens[b] for b in step.order]).to(self.device)
        y = self.layer(step.positions, x, step)
        for b in step.order:
            self.done[b] += tokens[b].shape[0]
        return {b: y[a:e] for b, (a, e) in zip(step.order, step.token_ranges)}

    def ratios(self) -> tuple:
        return {LayerType.SWA: (), LayerType.C4: (4,), LayerType.C128: (128,)}[self.layer_type]
