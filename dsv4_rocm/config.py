"""Attention configuration of a DeepSeek-V4 model (docs/math.md#config).

``AttentionConfig`` holds what the attention layer needs; ``V4_FLASH`` and ``V4_PRO`` are the released
checkpoints; ``AttentionConfig.from_hf_config`` reads a Hugging Face ``config.json`` dict.
Layer types follow vLLM: ratio = max(1, compress_ratios[layer]); layers past num_hidden_layers (MTP) are
SWA-only.
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
        for r in self.compress_ratios:
            if r not in (0, 1, 4, 128):
                raise ValueError(f"AttentionConfig.compress_ratios: unsupported ratio {r}")

    # ---- derived -------------------------------------------------------------------------------
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

    @classmethod
    def from_hf_config(cls, cfg: dict, tp_size: int = 1, name: Optional[str] = None) -> "AttentionConfig":
        """Build from a DeepSeek-V4 ``config.json`` dict."""
        if not isinstance(cfg, dict):
            raise ValueError("from_hf_config: cfg must be a dict (a parsed config.json)")
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
PRESETS = {"v4-flash": V4_FLASH, "v4-pro": V4_PRO}


def tiny_config(num_heads: int = 8, hidden_size: int = 256, index_topk: int = 8,
                sliding_window: int = 16, index_n_heads: int = 4) -> AttentionConfig:
    """A small config with the real per-head geometry (512-d latent, 64-d rope) for CPU tests."""
    return AttentionConfig(hidden_size=hidden_size, num_hidden_layers=3, num_heads=num_heads,
                           q_lora_rank=128, o_lora_rank=128, o_groups=max(1, num_heads // 8),
                           index_topk=index_topk, compress_ratios=(0, 4, 128, 0),
                           sliding_window=sliding_window, index_n_heads=index_n_heads, name="tiny")


def get_config(name: str) -> AttentionConfig:
    if name == "tiny":
        return tiny_config()
    if name not in PRESETS:
        raise ValueError(f"unknown config {name!r}; choose from {sorted(PRESETS) + ['tiny']}")
    return PRESETS[name]
