"""Weights of one DeepSeek-V4 attention layer, and loading them from checkpoint tensor names.

A DeepSeek-V4 checkpoint stores an attention layer under ``layers.{i}.attn.`` (Hugging Face copies under
``model.layers.{i}.self_attn.``) as:

    wq_a, wkv, wq_b, wo_a, wo_b   .weight e4m3 [N, K] + .scale UE8M0 [N/128, K/128] (or bf16 .weight)
    q_norm.weight, kv_norm.weight  bf16;  attn_sink fp32 [H]
    compressor.{wkv, wgate}.weight bf16 [coff*512, hidden], compressor.ape fp32 [r, coff*512],
    compressor.norm.weight [512]                                         (C4 and C128 layers)
    indexer.wq_b (FP8 + scale), indexer.weights_proj.weight bf16 [64, hidden],
    indexer.compressor.{wkv, wgate, ape, norm}                           (C4 layers)

DeepSeek-V4.1 (``cfg.is_v41``) changes the compressed layers: a kv-source layer's
``compressor.wkv.weight`` [512, hidden] (and, for ratio 2, ``compressor.wgate.weight`` [512, hidden]) has no
``ape``; an index source has ``indexer.wq_b``, ``indexer.weights_proj.weight`` [index heads, hidden] and, if
it is also a kv source, ``indexer.wk.weight`` bf16 [128, 512] and ``indexer.k_norm.weight`` [128] (the
index keys come from the compressor's latent: no indexer compressor). Other layers hold no compressor or
indexer tensors (vLLM's module names of vllm/models/deepseek_v41/attention.py and compressor.py).

``LayerWeights.from_checkpoint`` fuses them as vLLM does (wq_a + wkv -> one projection, compressor wkv +
wgate -> one projection), keeps this tensor-parallel rank's heads (wq_b rows, wo_a groups, wo_b columns,
attn_sink entries) and turns every FP8 weight into (e4m3 bytes, fp32 power-of-two scales per 128 x 128
block). A bf16 weight where the checkpoint could hold FP8 is quantized to that form, so a layer computes
the same function whichever way its weights were stored.
"""
import re
from dataclasses import dataclass, fields, replace
from typing import Mapping, Optional

import torch

from .config import AttentionConfig, LayerType
from .reference import output as _ro
from .reference.compressor import coff

_PREFIXES = (r"^model\.layers\.(\d+)\.self_attn\.", r"^layers\.(\d+)\.attn\.", r"^layers\.(\d+)\.self_attn\.")


@dataclass
class LayerWeights:
    """FP8 weights as (e4m3 bytes uint8, fp32 128 x 128 block scales); shapes for the local heads."""
    wqkv8: torch.Tensor; wqkv_s: torch.Tensor          # fused wq_a + wkv: [q_lora + 512, hidden]
    q_norm: torch.Tensor; kv_norm: torch.Tensor        # bf16 [q_lora], [512]
    wq_b8: torch.Tensor; wq_b_s: torch.Tensor          # [H_l * 512, q_lora]
    wo_a8: torch.Tensor; wo_a_s: torch.Tensor          # [G_l, o_lora, (H/G) * 512]
    wo_b8: torch.Tensor; wo_b_s: torch.Tensor          # [hidden, G_l * o_lora]
    attn_sink: torch.Tensor                            # fp32 [padded_heads], -inf past H_l
    comp_w: Optional[torch.Tensor] = None              # bf16 [2 * coff * 512, hidden] (kv | gate)
    comp_ape: Optional[torch.Tensor] = None            # fp32 [r, coff * 512]
    comp_norm: Optional[torch.Tensor] = None           # bf16 [512]
    idx_wq_b8: Optional[torch.Tensor] = None; idx_wq_b_s: Optional[torch.Tensor] = None  # [nh * 128, q_lora]
    idx_wproj: Optional[torch.Tensor] = None           # bf16 [nh, hidden]
    idx_comp_w: Optional[torch.Tensor] = None          # bf16 [2 * 2 * 128, hidden]
    idx_comp_ape: Optional[torch.Tensor] = None        # fp32 [4, 256]
    idx_comp_norm: Optional[torch.Tensor] = None       # bf16 [128]
    idx_wk: Optional[torch.Tensor] = None              # V4.1 kv source: bf16 [128, 512] (latent -> index key)
    idx_k_norm: Optional[torch.Tensor] = None          # V4.1 kv source: bf16 [128]

    def to(self, device) -> "LayerWeights":
        return LayerWeights(**{f.name: (None if getattr(self, f.name) is None else getattr(self, f.name).to(device))
                               for f in fields(self)})

    @classmethod
    def random(cls, cfg: AttentionConfig, layer_type: LayerType, seed: int = 0, device=None) -> "LayerWeights":
        """Random weights of the right shapes and scales (weights ~ N(0, 1/K), norms near 1)."""
        g = torch.Generator().manual_seed(seed)

        def rn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale).to(device)

        def fp8(n, k, lead=()):
            return _ro.quantize_weight(rn(*lead, n, k, scale=k ** -0.5))

        H, G = cfg.local_heads, cfg.local_groups
        hid, ql = cfg.hidden_size, cfg.q_lora_rank
        wqkv8, wqkv_s = fp8(ql + 512, hid)
        wq_b8, wq_b_s = fp8(H * 512, ql)
        wo_a8, wo_a_s = fp8(cfg.o_lora_rank, cfg.heads_per_group * 512, lead=(G,))
        wo_b8, wo_b_s = fp8(hid, G * cfg.o_lora_rank)
        sink = torch.full((cfg.padded_heads,), float("-inf"))
        sink[:H] = torch.randn(H, generator=g)
        w = cls(wqkv8, wqkv_s, (1 + 0.1 * rn(ql)).bfloat16(), (1 + 0.1 * rn(512)).bfloat16(), wq_b8, wq_b_s,
                wo_a8, wo_a_s, wo_b8, wo_b_s, sink.to(device))
        if layer_type != LayerType.SWA:
            r = 4 if layer_type == LayerType.C4 else 128
            c = coff(r)
            w.comp_w = rn(2 * c * 512, hid, scale=2 * hid ** -0.5).bfloat16()
            w.comp_ape = rn(r, c * 512, scale=0.5)
            w.comp_norm = (1 + 0.1 * rn(512)).bfloat16()
        if layer_type == LayerType.C4:
            nh = cfg.index_n_heads
            w.idx_wq_b8, w.idx_wq_b_s = fp8(nh * 128, ql)
            w.idx_wproj = rn(nh, hid, scale=hid ** -0.5).bfloat16()
            w.idx_comp_w = rn(2 * 2 * 128, hid, scale=2 * hid ** -0.5).bfloat16()
            w.idx_comp_ape = rn(4, 256, scale=0.5)
            w.idx_comp_norm = (1 + 0.1 * rn(128)).bfloat16()
        return w

    @classmethod
    def random_v41(cls, cfg: AttentionConfig, layer: int, seed: int = 0, device=None) -> "LayerWeights":
        """Random weights of DeepSeek-V4.1 layer ``layer`` (``cfg.v41_layer``): the shared projections,
        and the compressor / indexer tensors of what the layer owns."""
        spec = cfg.v41_layer(layer)
        w = cls.random(cfg, LayerType.SWA, seed, device)
        g = torch.Generator().manual_seed(seed + 1000)

        def rn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale).to(device)
        hid = cfg.hidden_size
        if spec.owns_kv:
            w.comp_w = rn(512 * spec.ratio, hid, scale=2 * hid ** -0.5).bfloat16()
            w.comp_norm = (1 + 0.1 * rn(512)).bfloat16()
            w.idx_wk = rn(128, 512, scale=512 ** -0.5).bfloat16()
            w.idx_k_norm = (1 + 0.1 * rn(128)).bfloat16()
        if spec.owns_index:
            nh = cfg.index_n_heads
            wq_b = rn(nh * 128, cfg.q_lora_rank, scale=cfg.q_lora_rank ** -0.5)
            w.idx_wq_b8, w.idx_wq_b_s = _ro.quantize_weight(wq_b)
            w.idx_wproj = rn(nh, hid, scale=hid ** -0.5).bfloat16()
        return w

    @classmethod
    def from_checkpoint(cls, tensors: Mapping[str, torch.Tensor], cfg: AttentionConfig, layer: int,
                        tp_rank: int = 0, device=None) -> "LayerWeights":
        """The weights of attention layer ``layer`` for tensor-parallel rank ``tp_rank`` of ``cfg.tp_size``.

        ``tensors`` maps checkpoint names to tensors; names may carry the layer prefix (``layers.{i}.attn.``
        or ``model.layers.{i}.self_attn.``) or be relative to the attention module. Missing or misshapen
        tensors raise a ValueError naming them.
        """
        if not 0 <= tp_rank < cfg.tp_size:
            raise ValueError(f"tp_rank must lie in [0, {cfg.tp_size}), got {tp_rank}")
        t = _layer_tensors(tensors, layer)
        layer_type = LayerType.SWA if cfg.is_v41 else cfg.layer_type(layer)
        hid, ql = cfg.hidden_size, cfg.q_lora_rank

        def get(name, shape=None):
            if name not in t:
                raise ValueError(f"checkpoint has no tensor {name!r} for layer {layer} "
                                 f"(have: {', '.join(sorted(t)[:8])}{', ...' if len(t) > 8 else ''})")
            v = t[name]
            if shape is not None and tuple(v.shape) != tuple(shape):
                raise ValueError(f"checkpoint tensor {name!r} of layer {layer} has shape {tuple(v.shape)}, "
                                 f"expected {tuple(shape)}")
            return v

        def linear(name, n, k):
            """Full (unsharded) FP8 or bf16 linear [n, k] -> (e4m3 bytes, fp32 block scales)."""
            w = get(f"{name}.weight", (n, k))
            if w.dtype in (torch.float8_e4m3fn, torch.uint8):
                s = get(f"{name}.scale", (n // 128, k // 128))
                return w.view(torch.uint8), _scale_to_fp32(s, f"{name}.scale")
            if w.dtype in (torch.bfloat16, torch.float16, torch.float32):
                return _ro.quantize_weight(w.float())
            raise ValueError(f"checkpoint tensor {name}.weight has dtype {w.dtype}; expected e4m3 or bf16")

        wq_a8, wq_a_s = linear("wq_a", ql, hid)
        wkv8, wkv_s = linear("wkv", 512, hid)
        wq_b8, wq_b_s = linear("wq_b", cfg.num_heads * 512, ql)
        gr = cfg.o_lora_rank
        wo_a8, wo_a_s = linear("wo_a", cfg.o_groups * gr, cfg.heads_per_group * 512)
        wo_b8, wo_b_s = linear("wo_b", hid, cfg.o_groups * gr)
        full = cfg.with_tp(1)
        sink = torch.full((full.padded_heads,), float("-inf"))
        sink[:cfg.num_heads] = get("attn_sink", (cfg.num_heads,)).float()
        w = cls(torch.cat([wq_a8, wkv8]), torch.cat([wq_a_s, wkv_s]),
                get("q_norm.weight", (ql,)).to(torch.bfloat16), get("kv_norm.weight", (512,)).to(torch.bfloat16),
                wq_b8, wq_b_s, wo_a8.reshape(cfg.o_groups, gr, -1), wo_a_s.reshape(cfg.o_groups, gr // 128, -1),
                wo_b8, wo_b_s, sink)
        if layer_type != LayerType.SWA:
            r = 4 if layer_type == LayerType.C4 else 128
            w.comp_w, w.comp_ape, w.comp_norm = _compressor(get, "compressor", r, 512, hid)
        if layer_type == LayerType.C4:
            nh = cfg.index_n_heads
            w.idx_wq_b8, w.idx_wq_b_s = linear("indexer.wq_b", nh * 128, ql)
            w.idx_wproj = get("indexer.weights_proj.weight", (nh, hid)).to(torch.bfloat16)
            w.idx_comp_w, w.idx_comp_ape, w.idx_comp_norm = _compressor(get, "indexer.compressor", 4, 128, hid)
        if cfg.is_v41:
            spec = cfg.v41_layer(layer)
            if spec.owns_kv:
                parts = [get("compressor.wkv.weight", (512, hid))] + (
                    [get("compressor.wgate.weight", (512, hid))] if spec.ratio == 2 else [])
                w.comp_w = torch.cat([p.to(torch.bfloat16) for p in parts])
                w.comp_norm = get("compressor.norm.weight", (512,)).to(torch.bfloat16)
                w.idx_wk = get("indexer.wk.weight", (128, 512)).to(torch.bfloat16)
                w.idx_k_norm = get("indexer.k_norm.weight", (128,)).to(torch.bfloat16)
            if spec.owns_index:
                nh = cfg.index_n_heads
                w.idx_wq_b8, w.idx_wq_b_s = linear("indexer.wq_b", nh * 128, ql)
                w.idx_wproj = get("indexer.weights_proj.weight", (nh, hid)).to(torch.bfloat16)
        w = w.shard(cfg, tp_rank) if cfg.tp_size > 1 else w
        return w.to(device) if device is not None else w

    def shard(self, cfg: AttentionConfig, tp_rank: int) -> "LayerWeights":
        """Tensor-parallel rank ``tp_rank``'s weights (of ``cfg.tp_size``) from the unsharded ones (``self``,
        shaped for ``cfg.with_tp(1)``): its heads' rows of wq_b and attn_sink entries, its groups of wo_a and
        their columns of wo_b; everything else (the latent projections, norms, compressor, indexer) is
        replicated. Views of ``self``'s storage where slicing allows."""
        if not 0 <= tp_rank < cfg.tp_size:
            raise ValueError(f"tp_rank must lie in [0, {cfg.tp_size}), got {tp_rank}")
        full = cfg.with_tp(1)
        if self.wq_b8.shape[0] != full.num_heads * 512 or self.wo_a8.shape[0] != full.o_groups:
            raise ValueError(f"shard: these weights hold {self.wq_b8.shape[0] // 512} heads and {self.wo_a8.shape[0]} "
                             f"output groups; the unsharded {cfg.name} layer has {full.num_heads} and {full.o_groups}")
        H, G, gr = cfg.local_heads, cfg.local_groups, cfg.o_lora_rank
        rows = slice(tp_rank * H * 512, (tp_rank + 1) * H * 512)
        g0, g1 = tp_rank * G, (tp_rank + 1) * G
        sink = torch.full((cfg.padded_heads,), float("-inf"), device=self.attn_sink.device)
        sink[:H] = self.attn_sink[tp_rank * H:(tp_rank + 1) * H]
        return replace(self, wq_b8=self.wq_b8[rows], wq_b_s=self.wq_b_s[rows.start // 128:rows.stop // 128],
                       wo_a8=self.wo_a8[g0:g1], wo_a_s=self.wo_a_s[g0:g1],
                       wo_b8=self.wo_b8[:, g0 * gr:g1 * gr], wo_b_s=self.wo_b_s[:, g0 * gr // 128:g1 * gr // 128],
                       attn_sink=sink)


def _layer_tensors(tensors: Mapping[str, torch.Tensor], layer: int) -> dict:
    """The tensors of one layer, keyed by their name relative to the attention module."""
    out = {}
    for name, v in tensors.items():
        for p in _PREFIXES:
            m = re.match(p, name)
            if m:
                if int(m.group(1)) == layer:
                    out[name[m.end():]] = v
                break
        else:
            out[name] = v
    return out


def _scale_to_fp32(s: torch.Tensor, name: str) -> torch.Tensor:
    """UE8M0 block scales (float8_e8m0fnu or raw bytes) or fp32 powers of two -> fp32."""
    if s.dtype == torch.float32:
        return s
    if s.dtype == torch.uint8 or str(s.dtype) == "torch.float8_e8m0fnu":
        b = s.view(torch.uint8).to(torch.int32)
        pow2 = torch.ldexp(torch.ones_like(b, dtype=torch.float32), (b - 127).float())
        return torch.where(b == 255, torch.full_like(pow2, float("nan")), pow2)
    raise ValueError(f"checkpoint tensor {name} has dtype {s.dtype}; expected UE8M0 (float8_e8m0fnu) or fp32")


def _compressor(get, prefix: str, ratio: int, dim: int, hidden: int):
    c = coff(ratio)
    wkv = get(f"{prefix}.wkv.weight", (c * dim, hidden)).to(torch.bfloat16)
    wgate = get(f"{prefix}.wgate.weight", (c * dim, hidden)).to(torch.bfloat16)
    return (torch.cat([wkv, wgate]), get(f"{prefix}.ape", (ratio, c * dim)).float(),
            get(f"{prefix}.norm.weight", (dim,)).to(torch.bfloat16))
