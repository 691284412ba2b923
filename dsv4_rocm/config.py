"""Attention configuration of a DeepSeek-V4 model (docs/math.md#config).

``AttentionConfig`` holds what the attention layer needs; ``V4_FLASH`` and ``V4_PRO`` are the released
checkpoints; ``AttentionConfig.from_hf_config`` reads a Hugging Face ``config.json`` dict.
Layer types follow vLLM: ratio = max(1, compress_ratios[layer]); layers past num_hidden_layers (MTP) are
SWA-only.

DeepSeek-V4.1 (``model_version="v4.1"``, preset ``V41_FLASH``) reads ``compress_ratios`` as vLLM's V4.1
layer does: 0 = sliding window only, 1 = every token's own latent is a compressed entry, 2 = one entry per
token pair; layers past the list (MTP) are 0. Compressed caches and compressors live on
``kv_source_layer_ids``, indexers on ``index_source_layer_ids``; every other compressed layer reads the
nearest source at or below it (``V41Layer``, docs/math.md#v41).
"""
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Optional, Sequence, Tuple


class LayerType(str, Enum):
    SWA = "swa"     # sliding window only (ratio 1)
    C4 = "c4a"      # overlapping 4x compression + lightning indexer top-k
    C128 = "c128a"  # 128x compression, all visible entries


@dataclass(frozen=True)
class AttentionConfig:
    hidden_size: int
    num_hidden_layers: int
    num_heads: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    index_topk: int
    compress_ratios: Tuple[int, ...]
    head_dim: int = 512
    rope_dim: int = 64
    sliding_window: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn_factor: float = 16.0
    yarn_original_max_position: int = 65536
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1048576
    tp_size: int = 1
    name: str = "custom"
    # DeepSeek-V4.1 (model_version "v4.1"): cross-layer sharing and the two-level indexer
    model_version: str = "v4"
    kv_source_layer_ids: Tuple[int, ...] = ()
    index_source_layer_ids: Tuple[int, ...] = ()
    candidate_source_layer_id: int = -1
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0

    def __post_init__(self):
        positive = ("hidden_size", "num_hidden_layers", "num_heads", "q_lora_rank", "o_lora_rank",
                    "o_groups", "index_topk", "sliding_window", "index_n_heads", "tp_size")
        for k in positive:
            v = getattr(self, k)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"AttentionConfig.{k} must be a positive int, got {v!r}")
        if self.head_dim != 512 or self.rope_dim != 64:
            raise ValueError("AttentionConfig: head_dim must be 512 and rope_dim 64 (the fp8_ds_mla format)")
        if self.index_head_dim != 128:
            raise ValueError("AttentionConfig.index_head_dim must be 128")
        if self.num_heads % self.tp_size:
            raise ValueError(f"AttentionConfig: num_heads {self.num_heads} not divisible by tp_size {self.tp_size}")
        if self.num_heads % self.o_groups or self.o_groups % self.tp_size:
            raise ValueError(f"AttentionConfig: o_groups {self.o_groups} must divide num_heads and be divisible by tp_size")
        if self.local_heads > 128:
            raise ValueError(f"AttentionConfig: {self.local_heads} local heads; at most 128 are supported")
        if len(self.compress_ratios) < self.num_hidden_layers:
            raise ValueError("AttentionConfig.compress_ratios must have an entry per layer")
        if self.model_version not in ("v4", "v4.1"):
            raise ValueError(f"AttentionConfig.model_version must be 'v4' or 'v4.1', got {self.model_version!r}")
        if self.is_v41:
            _check_v41_schedule(self)
            return
        for r in self.compress_ratios:
            if r not in (0, 1, 4, 128):
                raise ValueError(f"AttentionConfig.compress_ratios: unsupported ratio {r}")
        if self.kv_source_layer_ids or self.index_source_layer_ids or self.candidate_source_layer_id >= 0:
            raise ValueError("AttentionConfig: kv / index / candidate source layers are DeepSeek-V4.1 fields "
                             "(model_version='v4.1')")

    # ---- derived -------------------------------------------------------------------------------
    @property
    def is_v41(self) -> bool:
        return self.model_version == "v4.1"

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.tp_size

    @property
    def padded_heads(self) -> int:
        """Heads seen by the attention kernels: 64 if H_l <= 64 else 128 (zero q, -inf sink in the pad)."""
        return 64 if self.local_heads <= 64 else 128

    @property
    def local_groups(self) -> int:
        return self.o_groups // self.tp_size

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.o_groups

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5

    def compress_ratio(self, layer: int) -> int:
        """vLLM's ratio: max(1, compress_ratios[layer]); MTP layers (>= num_hidden_layers) use 1."""
        if self.is_v41:
            raise ValueError(f"{self.name} is a DeepSeek-V4.1 config: its layers are described by v41_layer()")
        if layer < 0:
            raise ValueError(f"layer must be >= 0, got {layer}")
        if layer >= self.num_hidden_layers or layer >= len(self.compress_ratios):
            return 1
        return max(1, self.compress_ratios[layer])

    def layer_type(self, layer: int) -> LayerType:
        return {1: LayerType.SWA, 4: LayerType.C4, 128: LayerType.C128}[self.compress_ratio(layer)]

    def rope_base(self, layer_type: LayerType) -> float:
        return self.rope_theta if layer_type == LayerType.SWA else self.compress_rope_theta

    def first_layer_of(self, layer_type: LayerType) -> int:
        for i in range(self.num_hidden_layers):
            if self.layer_type(i) == layer_type:
                return i
        raise ValueError(f"{self.name} has no layer of type {layer_type.value}")

    def with_tp(self, tp_size: int) -> "AttentionConfig":
        return replace(self, tp_size=tp_size)

    def v41_layer(self, layer: int) -> "V41Layer":
        """What DeepSeek-V4.1 layer ``layer`` is and whose caches it reads (vLLM's DeepseekV4Attention of
        vllm/models/deepseek_v41: ratio compress_ratios[layer], 0 past the list; the kv and index source of a
        compressed layer are the nearest sources at or below it; MTP layers are never sources)."""
        if not self.is_v41:
            raise ValueError(f"{self.name} is not a DeepSeek-V4.1 config (model_version {self.model_version!r})")
        if not isinstance(layer, int) or layer < 0:
            raise ValueError(f"layer must be a non-negative int, got {layer!r}")
        ratio = self.compress_ratios[layer] if layer < len(self.compress_ratios) else 0
        backbone = layer < self.num_hidden_layers
        if ratio == 0:
            return V41Layer(layer, 0)
        kv_src = max(s for s in self.kv_source_layer_ids if s <= layer)
        idx_src = max(s for s in self.index_source_layer_ids if s <= layer)
        cand = self.candidate_source_layer_id
        return V41Layer(layer, ratio, kv_source=kv_src, index_source=idx_src,
                        owns_kv=backbone and layer in self.kv_source_layer_ids,
                        owns_index=backbone and layer in self.index_source_layer_ids,
                        candidate_source=backbone and layer == cand and layer in self.index_source_layer_ids,
                        uses_candidates=backbone and layer in self.index_source_layer_ids and 0 <= cand < layer)

    def v41_rope(self, layer: int) -> dict:
        """``build_cos_sin_cache`` arguments of a V4.1 layer (vLLM's build_deepseek_v4_rope): compressed layers
        (ratio > 0) use compress_rope_theta with YaRN; sliding-window layers use rope_theta with plain RoPE,
        which vLLM builds as deepseek_yarn with factor 1 and original_max_position_embeddings =
        max_position_embeddings."""
        if self.v41_layer(layer).ratio > 0:
            return dict(base=self.compress_rope_theta, factor=self.yarn_factor,
                        original_max=self.yarn_original_max_position, beta_fast=self.yarn_beta_fast,
                        beta_slow=self.yarn_beta_slow)
        return dict(base=self.rope_theta, factor=1.0, original_max=self.max_position_embeddings,
                    beta_fast=self.yarn_beta_fast, beta_slow=self.yarn_beta_slow)

    @classmethod
    def from_hf_config(cls, cfg: dict, tp_size: int = 1, name: Optional[str] = None) -> "AttentionConfig":
        """Build from a DeepSeek-V4 or V4.1 ``config.json`` dict. A V4.1 config (``model_type``
        deepseek_v41, or kv_source_layer_ids present) may nest its text fields under ``text_config``; its
        RoPE dict is ``rope_parameters`` (flat, or per layer kind as {"main", "compress"}) or ``rope_scaling``,
        as vLLM's build_deepseek_v4_rope reads it."""
        if not isinstance(cfg, dict):
            raise ValueError("from_hf_config: cfg must be a dict (a parsed config.json)")
        if isinstance(cfg.get("text_config"), dict):
            cfg = {**{k: v for k, v in cfg.items() if k != "text_config"}, **cfg["text_config"]}
        if cfg.get("model_type") in ("deepseek_v41", "deepseek_v41_text") or "kv_source_layer_ids" in cfg:
            return _from_hf_v41(cls, cfg, tp_size, name)
        required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
                    "o_lora_rank", "o_groups", "index_topk", "compress_ratios")
        missing = [k for k in required if k not in cfg]
        if missing:
            raise ValueError(f"from_hf_config: config.json lacks {missing}")
        rs = cfg.get("rope_scaling") or {}
        return cls(
            hidden_size=int(cfg["hidden_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_heads=int(cfg["num_attention_heads"]),
            q_lora_rank=int(cfg["q_lora_rank"]),
            o_lora_rank=int(cfg["o_lora_rank"]),
            o_groups=int(cfg["o_groups"]),
            index_topk=int(cfg["index_topk"]),
            compress_ratios=tuple(int(r) for r in cfg["compress_ratios"]),
            head_dim=int(cfg.get("head_dim", 512)),
            rope_dim=int(cfg.get("qk_rope_head_dim", 64)),
            sliding_window=int(cfg.get("sliding_window", 128)),
            index_n_heads=int(cfg.get("index_n_heads", 64)),
            index_head_dim=int(cfg.get("index_head_dim", 128)),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            compress_rope_theta=float(cfg.get("compress_rope_theta", 160000.0)),
            yarn_factor=float(rs.get("factor", 16.0)),
            yarn_original_max_position=int(rs.get("original_max_position_embeddings", 65536)),
            yarn_beta_fast=float(rs.get("beta_fast", 32.0)),
            yarn_beta_slow=float(rs.get("beta_slow", 1.0)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 1048576)),
            tp_size=tp_size,
            name=name or cfg.get("_name_or_path", "custom"),
        )


@dataclass(frozen=True)
class V41Layer:
    """One DeepSeek-V4.1 attention layer: its compress ratio (0, 1, 2), the layers whose compressed and
    indexer-K caches it reads (kv_source) and whose top-k it attends with (index_source), and what it owns:
    a kv source runs the compressor and writes the compressed and indexer-K caches, an index source runs
    an indexer (its own q, weights and top-k), the candidate source publishes its candidate blocks and
    later index sources (uses_candidates) score only inside them."""
    layer: int
    ratio: int
    kv_source: Optional[int] = None
    index_source: Optional[int] = None
    owns_kv: bool = False
    owns_index: bool = False
    candidate_source: bool = False
    uses_candidates: bool = False

    @property
    def kind(self) -> str:
        """swa | kv-source | index-source | shared (reads both caches and the top-k of other layers)."""
        if self.ratio == 0:
            return "swa"
        return "kv-source" if self.owns_kv else "index-source" if self.owns_index else "shared"

    @property
    def label(self) -> str:
        """A short name: e.g. r2-kv-source, r1-index-source+candidates, swa."""
        if self.ratio == 0:
            return "swa"
        extra = "+candidate-source" if self.candidate_source else "+candidates" if self.uses_candidates else ""
        return f"r{self.ratio}-{self.kind}{extra}"


def _check_v41_schedule(c: "AttentionConfig") -> None:
    """The layer schedule rules vLLM's V4.1 layer relies on (a ValueError naming the field otherwise)."""
    n = c.num_hidden_layers
    for r in c.compress_ratios:
        if r not in (0, 1, 2):
            raise ValueError(f"AttentionConfig.compress_ratios: DeepSeek-V4.1 ratios are 0, 1 and 2, got {r!r}")
    for fname in ("kv_source_layer_ids", "index_source_layer_ids"):
        ids = tuple(getattr(c, fname))
        if any(not isinstance(i, int) or not 0 <= i < n for i in ids) or list(ids) != sorted(set(ids)):
            raise ValueError(f"AttentionConfig.{fname} must be increasing layer ids below {n}, got {ids!r}")
        if any(c.compress_ratios[i] == 0 for i in ids):
            raise ValueError(f"AttentionConfig.{fname}: a sliding-window layer (ratio 0) cannot be a source")
    if not set(c.kv_source_layer_ids) <= set(c.index_source_layer_ids):
        raise ValueError("AttentionConfig.kv_source_layer_ids must all be index sources too (a kv source's "
                         "indexer writes the indexer-K cache)")
    for layer in range(n):
        r = c.compress_ratios[layer]
        if r == 0:
            continue
        kv = [s for s in c.kv_source_layer_ids if s <= layer]
        idx = [s for s in c.index_source_layer_ids if s <= layer]
        if not kv or c.compress_ratios[kv[-1]] != r:
            raise ValueError(f"AttentionConfig.kv_source_layer_ids: compressed layer {layer} (ratio {r}) needs a "
                             "kv source at or below it with the same ratio")
        if not idx or [s for s in c.kv_source_layer_ids if s <= idx[-1]][-1:] != kv[-1:]:
            raise ValueError(f"AttentionConfig.index_source_layer_ids: layer {layer}'s index source must read the "
                             f"same kv source ({kv[-1]}) as the layer")
    cand = c.candidate_source_layer_id
    if not isinstance(cand, int) or cand < -1:
        raise ValueError(f"AttentionConfig.candidate_source_layer_id must be -1 or a layer id, got {cand!r}")
    if cand >= 0:
        if cand not in c.kv_source_layer_ids:
            raise ValueError("AttentionConfig.candidate_source_layer_id must be a kv source layer")
        for fname in ("candidate_topk_blocks", "candidate_block_size"):
            v = getattr(c, fname)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"AttentionConfig.{fname} must be a positive int with a candidate source, got {v!r}")
        if c.candidate_topk_blocks * c.candidate_block_size < c.index_topk:
            raise ValueError("AttentionConfig: candidate_topk_blocks * candidate_block_size must be at least "
                             "index_topk (the top-k of a candidate consumer is taken inside the candidates)")
        later = [s for s in c.index_source_layer_ids if s > cand]
        if any(c.compress_ratios[s] != c.compress_ratios[cand] for s in later):
            raise ValueError("AttentionConfig: index sources after the candidate source must share its ratio")


def _from_hf_v41(cls, cfg: dict, tp_size: int, name: Optional[str]) -> "AttentionConfig":
    """The V4.1 fields vLLM's DeepseekV4Attention (vllm/models/deepseek_v41) reads from the HF config."""
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank", "o_lora_rank",
                "o_groups", "index_topk", "compress_ratios", "kv_source_layer_ids", "index_source_layer_ids")
    missing = [k for k in required if k not in cfg]
    if missing:
        raise ValueError(f"from_hf_config: DeepSeek-V4.1 config.json lacks {missing}")
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if isinstance(rp.get("compress"), dict):         # per layer kind: compressed layers carry the YaRN dict
        rp = rp["compress"]
    return cls(
        hidden_size=int(cfg["hidden_size"]), num_hidden_layers=int(cfg["num_hidden_layers"]),
        num_heads=int(cfg["num_attention_heads"]), q_lora_rank=int(cfg["q_lora_rank"]),
        o_lora_rank=int(cfg["o_lora_rank"]), o_groups=int(cfg["o_groups"]), index_topk=int(cfg["index_topk"]),
        compress_ratios=tuple(int(r) for r in cfg["compress_ratios"]),
        head_dim=int(cfg.get("head_dim", 512)), rope_dim=int(cfg.get("qk_rope_head_dim", 64)),
        sliding_window=int(cfg.get("sliding_window", 128)), index_n_heads=int(cfg.get("index_n_heads", 32)),
        index_head_dim=int(cfg.get("index_head_dim", 128)), rope_theta=float(cfg.get("rope_theta", 10000.0)),
        compress_rope_theta=float(cfg.get("compress_rope_theta", 160000.0)),
        yarn_factor=float(rp.get("factor", 16.0)),
        yarn_original_max_position=int(rp.get("original_max_position_embeddings", 65536)),
        yarn_beta_fast=float(rp.get("beta_fast", 32.0)), yarn_beta_slow=float(rp.get("beta_slow", 1.0)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 1048576)), tp_size=tp_size,
        name=name or cfg.get("_name_or_path", "custom"), model_version="v4.1",
        kv_source_layer_ids=tuple(int(i) for i in cfg["kv_source_layer_ids"]),
        index_source_layer_ids=tuple(int(i) for i in cfg["index_source_layer_ids"]),
        candidate_source_layer_id=int(cfg.get("candidate_source_layer_id", -1)),
        candidate_topk_blocks=int(cfg.get("candidate_topk_blocks", 0)),
        candidate_block_size=int(cfg.get("candidate_block_size", 0)))


def _flash_ratios() -> Tuple[int, ...]:
    mid = [4 if i % 2 == 0 else 128 for i in range(2, 43)]
    return tuple([0, 0] + mid + [0])            # 44 entries: 43 layers + MTP


def _pro_ratios() -> Tuple[int, ...]:
    mid = [4 if i % 2 == 0 else 128 for i in range(2, 61)]
    return tuple([128, 128] + mid + [0])        # 62 entries: 61 layers + MTP


V4_FLASH = AttentionConfig(hidden_size=4096, num_hidden_layers=43, num_heads=64, q_lora_rank=1024,
                           o_lora_rank=1024, o_groups=8, index_topk=512,
                           compress_ratios=_flash_ratios(), name="v4-flash")
V4_PRO = AttentionConfig(hidden_size=7168, num_hidden_layers=61, num_heads=128, q_lora_rank=1536,
                         o_lora_rank=1024, o_groups=16, index_topk=1024,
                         compress_ratios=_pro_ratios(), name="v4-pro")
# DeepSeek-V4.1-Flash (docs/math.md#v41 lists the source of every value): 40 layers + 3 sliding-window MTP
# (DSpark) layers; rms_norm_eps 1e-20 is the secondary source's released value
V41_FLASH = AttentionConfig(hidden_size=5120, num_hidden_layers=40, num_heads=64, q_lora_rank=1280,
                            o_lora_rank=1024, o_groups=8, index_topk=512,
                            compress_ratios=tuple([0, 0] + [2] * 18 + [1] * 20 + [0] * 3), index_n_heads=32,
                            rms_norm_eps=1e-20, name="v4.1-flash", model_version="v4.1",
                            kv_source_layer_ids=(2, 8, 14, 20), index_source_layer_ids=(2, 8, 14, 20, 24, 28, 32, 36),
                            candidate_source_layer_id=20, candidate_topk_blocks=2048, candidate_block_size=8)
PRESETS = {"v4-flash": V4_FLASH, "v4-pro": V4_PRO, "v4.1-flash": V41_FLASH}


def tiny_config(num_heads: int = 8, hidden_size: int = 256, index_topk: int = 8,
                sliding_window: int = 16, index_n_heads: int = 4) -> AttentionConfig:
    """A small config with the real per-head geometry (512-d latent, 64-d rope) for CPU tests."""
    return AttentionConfig(hidden_size=hidden_size, num_hidden_layers=3, num_heads=num_heads,
                           q_lora_rank=128, o_lora_rank=128, o_groups=max(1, num_heads // 8),
                           index_topk=index_topk, compress_ratios=(0, 4, 128, 0),
                           sliding_window=sliding_window, index_n_heads=index_n_heads, name="tiny")


def tiny_v41_config(num_heads: int = 8, hidden_size: int = 256, index_topk: int = 8, sliding_window: int = 16,
                    index_n_heads: int = 16) -> AttentionConfig:
    """A small V4.1 config with every layer kind, for CPU tests: 0 sliding window; 1 ratio-2 kv source; 2 reads
    layer 1's caches and top-k; 3 ratio-1 kv source and candidate source; 4 reads 3's; 5 an index source that
    scores inside 3's candidates (4 blocks of 4 entries) with its own indexer over 3's indexer-K cache; 6 reads
    3's caches and 5's top-k; 7 sliding window. 16 index heads: with fewer, many logits are exactly 0 (every
    head's ReLU zero) and the top-k's ties, which are implementation-defined, decide the output."""
    return AttentionConfig(hidden_size=hidden_size, num_hidden_layers=8, num_heads=num_heads, q_lora_rank=128,
                           o_lora_rank=128, o_groups=max(1, num_heads // 8), index_topk=index_topk,
                           compress_ratios=(0, 2, 2, 1, 1, 1, 1, 0), sliding_window=sliding_window,
                           index_n_heads=index_n_heads, name="tiny-v4.1", model_version="v4.1",
                           kv_source_layer_ids=(1, 3), index_source_layer_ids=(1, 3, 5), candidate_source_layer_id=3,
                           candidate_topk_blocks=4, candidate_block_size=4)


def get_config(name: str) -> AttentionConfig:
    if name == "tiny":
        return tiny_config()
    if name == "tiny-v4.1":
        return tiny_v41_config()
    if name not in PRESETS:
        raise ValueError(f"unknown config {name!r}; choose from {sorted(PRESETS) + ['tiny', 'tiny-v4.1']}")
    return PRESETS[name]
