"""Tensor parallelism of an attention layer by heads, over torch.distributed (docs/integration.md#tensor-parallelism).

DeepSeek-V4 attention splits over ``tp_size`` ranks the way vLLM splits it: rank r holds heads
``[r * H_l, (r + 1) * H_l)`` (``H_l = num_heads / tp_size``) and output groups ``[r * G_l, (r + 1) * G_l)``:

    per rank (sharded)   wq_b rows, attn_sink entries, wo_a groups, wo_b columns  (LayerWeights.from_checkpoint
                         with tp_rank), hence q, the attention output o and the partial y_r = wo_b_r . z_r
    on every rank        wq_a + wkv, the q / kv norms, the compressor, the indexer (its heads are not split),
    (replicated)         and so every cache: the KV caches hold one shared latent per token (MQA), not a
                         slice per head, and the compressor's state and the indexer's K come from
                         replicated weights

The layer output is the sum of the ranks' partials, y = sum_r y_r: ``TensorParallel`` wraps any layer
module whose forward returns its rank's partial (``DeepseekV4Attention`` does, and so does any layer built
on its output path) and all-reduces it in place, in the output's dtype, as vLLM's row-parallel wo_b does.
One all-reduce a step, no host sync: a decode step under it stays graph-capturable (NCCL / RCCL capture
their collectives). Each rank allocates its own caches (``LayerCache.allocate``); they hold the same
bytes on every rank, byte for byte the caches of the unsharded layer on the same steps.

Backends: NCCL on NVIDIA, RCCL on AMD (both ``"nccl"`` in torch), gloo on a CPU. ``init_from_env`` starts
the process group from the variables torchrun sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...).
"""
import os
from typing import Mapping, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .config import AttentionConfig
from .weights import LayerWeights


def rank_and_size(group=None) -> Tuple[int, int]:
    """(rank, world size) in ``group``; (0, 1) when torch.distributed is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def init_from_env(device: Optional[str] = None, backend: Optional[str] = None) -> Tuple[int, int, torch.device]:
    """Join the process group torchrun (or Slurm through torchrun) describes in the environment, if any.
    Returns (rank, world size, this rank's device): ``cuda:LOCAL_RANK`` on a GPU machine, or for
    ``device="cuda"`` (ranks past the GPU count share them round robin); ``device`` with an index is taken
    as given; else cpu. ``backend``: NCCL (RCCL on ROCm) when the rank has a GPU, else gloo; gloo also
    serves GPU ranks that only exchange Python objects (the benchmark's reports), and lets them share a GPU.
    Without torchrun's variables it starts nothing and returns (0, 1, device)."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", local % max(1, torch.cuda.device_count()))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if "WORLD_SIZE" not in os.environ or dist.is_initialized():
        return (*rank_and_size(), dev)
    backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
    dist.init_process_group(backend, device_id=dev if backend == "nccl" else None)
    return dist.get_rank(), dist.get_world_size(), dev


def rank_weights(source: Union[Mapping[str, torch.Tensor], LayerWeights], cfg: AttentionConfig, layer: int,
                 group=None, device=None) -> Tuple[AttentionConfig, LayerWeights]:
    """This rank's config (``tp_size`` = the group's size) and its shard of layer ``layer``'s weights, from
    the checkpoint's tensors (``LayerWeights.from_checkpoint``) or from the unsharded ``LayerWeights``."""
    rank, size = rank_and_size(group)
    cfg = cfg.with_tp(size)
    if isinstance(source, LayerWeights):
        w = source.shard(cfg, rank) if size > 1 else source
        return cfg, w.to(device) if device is not None else w
    return cfg, LayerWeights.from_checkpoint(source, cfg, layer, tp_rank=rank, device=device)


class TensorParallel(torch.nn.Module):
    """``layer`` (any module whose forward returns this rank's partial output, the wo_b of its groups) with
    the partials summed over ``group``: forward returns the full layer output on every rank. The sum is an
    in-place all-reduce of the partial in its own dtype (bf16), so the result differs from the unsharded
    layer by the rounding of each partial to bf16 and of their sum (docs/numerics.md#tensor-parallelism).
    Attributes not found on the wrapper are the layer's."""

    def __init__(self, layer: torch.nn.Module, group=None):
        super().__init__()
        self.layer, self.group = layer, group
        self.tp_rank, self.tp_size = rank_and_size(group)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        y = self.layer(*args, **kwargs)
        if self.tp_size > 1:
            dist.all_reduce(y, group=self.group)
        return y

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("layer"), name)
