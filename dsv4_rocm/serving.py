"""A small synthetic serving loop over a set of attention layers: page allocation, vLLM-shaped step metadata,
outputs per request and layer.

``SyntheticServer`` serves one DeepSeek-V4.0 layer of ``layer_type`` (or the V4.0 layers ``layers``, each
with its own caches), or a stack of DeepSeek-V4.1 layers (``layers``, each layer's kv source and index
source among them; default ``FLASH_LAYERS``) sharing caches as the model does: kv sources own the
compressed, indexer-K and ring caches, the other compressed layers read theirs, and every layer reads the
top-k of the last index source before it through the server's ``SharedBuffers``. The layers of a step run
in layer order, each on the same hidden states (an attention-only stack: what reaches the next layer in
the model passes through its MLP, which is not ours). ``record_format`` picks the records of the SWA and
compressed caches (``kv_cache.V41_RECORDS``; a V4.0 model keeps "V40_584").

Used by the trace run (``python -m dsv4_rocm run``), the layer tests, the parity report and the layer
benchmark. Each request owns a fixed range of pages (no sharing), enough for ``max_model_len`` tokens;
the pages of different requests are interleaved so that a wrong block-table read shows up. A step is
ordered as vLLM's scheduler orders it: decode requests (query length == ``decode_query_len``) first,
then prefill and chunked-prefill requests. The state table holds each request's compressor state blocks
(V4.0, position-paged) or, in its first column, its ring block (V4.1).
"""
import math
from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import torch

from . import layout as L
from .attention import DeepseekV4Attention, SharedBuffers
from .config import AttentionConfig, LayerType
from .kv_cache import allocate_caches
from .layer_plan import plan_of
from .step import StepMetadata
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
        p = plan_of(cfg, x)
        for what, src in (("kv source", p.kv_source), ("index source", p.index_source)):
            if src is not None and src not in layers:
                raise ValueError(f"layers: layer {x} reads its {what} {src}, which is not in the stack {layers}")
    return layers


@dataclass
class SyntheticServer:
    cfg: AttentionConfig
    layer_type: Optional[LayerType]         # a V4.0 server of one layer of this type (None: ``layers``)
    num_requests: int
    max_model_len: int
    device: str = "cpu"
    seed: int = 0
    decode_query_len: int = 1
    weights: Optional[LayerWeights] = None  # the one V4.0 layer's weights (default random)
    layers: Optional[Sequence[int]] = None  # layer ids (V4.1 default FLASH_LAYERS)
    max_step_tokens: int = 4096             # rows of the V4.1 shared buffers
    layer_weights: Optional[Dict[int, LayerWeights]] = None
    record_format: str = "V40_584"

    def __post_init__(self):
        cfg, dev, R = self.cfg, self.device, self.num_requests
        if self.layers is None:
            self.layers = FLASH_LAYERS if cfg.is_v41 else (cfg.first_layer_of(self.layer_type),)
        self.layers = check_stack(cfg, self.layers)
        self.plans = {x: plan_of(cfg, x) for x in self.layers}
        if self.layer_type is None and not cfg.is_v41 and len(self.layers) == 1:
            self.layer_type = cfg.layer_type(self.layers[0])
        plans = self.plans.values()
        self.swa_pages = math.ceil(self.max_model_len / L.SWA_BLOCK_SIZE)
        self.comp_pages = math.ceil(self.max_model_len / min(p.comp_page_positions for p in plans))
        # state blocks a request: V4.0 the position-paged state of the smallest block; V4.1 one ring block
        sp = min(p.state_positions for p in plans)
        self.state_pages = math.ceil(self.max_model_len / sp) if sp else 1
        nb = R * max(self.swa_pages, self.comp_pages)
        ns = R * self.state_pages
        self.caches = allocate_caches(cfg, self.layers, nb, ns, device=dev, record_format=self.record_format)
        self.cache = self.caches[self.layers[0]]
        if self.layer_weights is None:
            given = {self.layers[0]: self.weights} if self.weights is not None else {}
            self.layer_weights = {x: given.get(x) or _random_weights(cfg, x, self.seed, dev) for x in self.layers}
        self.weights = self.layer_weights[self.layers[0]]
        g = torch.Generator().manual_seed(self.seed + 7)
        perm = torch.randperm(nb, generator=g)
        self.swa_bt = perm[:R * self.swa_pages].view(R, self.swa_pages)
        self.comp_bt = perm[:R * self.comp_pages].view(R, self.comp_pages)
        self.state_bt = torch.randperm(ns, generator=torch.Generator().manual_seed(self.seed + 11)).view(
            R, self.state_pages)
        # host rows of the tables (what a scheduler holds): a step's metadata is built on the host and sent in
        # two copies, without reading anything back
        self._rows = [t.to(torch.int32).tolist() for t in (self.swa_bt, self.comp_bt, self.state_bt)]
        self.swa_bt, self.comp_bt, self.state_bt = (t.to(torch.int32).to(dev)
                                                    for t in (self.swa_bt, self.comp_bt, self.state_bt))
        self.shared = SharedBuffers.allocate(cfg, self.max_step_tokens, dev) if cfg.is_v41 else None
        self.modules = {x: DeepseekV4Attention(cfg, x, self.layer_weights[x], self.caches[x], self.max_model_len,
                                               device=dev, shared=self.shared) for x in self.layers}
        self.cos_sin = self.layer.cos_sin_cache
        self.done = [0] * R

    @property
    def layer(self):
        """The module of the first layer (of a one-layer server: its layer). Assigning replaces the module the
        steps run (a wrapper such as ``tp.TensorParallel``)."""
        return self.modules[self.layers[0]]

    @layer.setter
    def layer(self, module):
        self.modules[self.layers[0]] = module

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

    def ratios(self) -> tuple:
        """The ratios the step's index sets are built for (those of the layers with compressed entries)."""
        return tuple(sorted({p.ratio for p in self.plans.values() if p.keys != "window"}))

    def step_all(self, tokens: Dict[int, torch.Tensor]) -> Dict[int, Dict[int, torch.Tensor]]:
        """Run one step through every layer: ``tokens[req]`` = the next bf16 hidden rows [n, hidden] of that
        request. Returns {layer: {request: output rows}}."""
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
        """One step; the output rows per request (of several layers: concatenated along the hidden dim)."""
        out = self.step_all(tokens)
        if len(self.layers) == 1 or not out:
            return out.get(self.layers[0], {})
        return {b: torch.cat([out[x][b] for x in self.layers], dim=-1) for b in tokens}


def _random_weights(cfg: AttentionConfig, layer: int, seed: int, device) -> LayerWeights:
    """Random weights of a layer (V4.0: of its type, from ``seed``; V4.1: of the layer, from seed + layer)."""
    if cfg.is_v41:
        return LayerWeights.random_v41(cfg, layer, seed + layer, device)
    return LayerWeights.random(cfg, cfg.layer_type(layer), seed, device)
