"""FlashMLA-compatible entry points over dsv4_rocm's kernels, on every vendor.

Same keyword API as ``flash_mla.flash_mla_interface`` for the DeepSeek-V4 ("MODEL1") sparse fp8 path,
so an integration swaps the import, not its call sites:

* ``get_mla_metadata(*args, **kwargs) -> (FlashMLASchedMeta, None)``
* ``flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, ...)``
  sparse decode over fp8_ds_mla pages: k_cache [num_blocks, page_block_size, 1, 584] uint8 (page stride
  = stride(0), a multiple of 576 B), indices [b, s_q, topk] int32 slot ids (-1 invalid),
  topk_length [b] int32; the optional extra set (compressed cache) has the same format. One softmax
  over both sets; attn_sink [h] fp32 scales the output by exp(lse)/(exp(lse)+exp(sink)).
  Returns (out bf16 [b, s_q, h, 512], lse fp32 [b, h, s_q]), lse in natural log, sink excluded.
* ``flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None)``
  sparse prefill over a bf16 kv [s_kv, 1, 512]: returns (out, max_logits, lse).

Only the sparse fp8 mode exists here (dense MLA is not part of DeepSeek-V4).
"""
import dataclasses
from typing import Optional, Tuple

import torch

from . import ops


@dataclasses.dataclass
class FlashMLASchedMeta:
    """Scheduling state, kept for API compatibility: the config of the first call is recorded and
    later calls with the same object must match it (as in FlashMLA)."""
    have_initialized: bool = False
    config: Optional[tuple] = None


def get_mla_metadata(*args, **kwargs) -> Tuple[FlashMLASchedMeta, None]:
    return FlashMLASchedMeta(), None


def flash_mla_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, block_table: Optional[torch.Tensor],
                           cache_seqlens: Optional[torch.Tensor], head_dim_v: int,
                           tile_scheduler_metadata: FlashMLASchedMeta, num_splits: None = None,
                           softmax_scale: Optional[float] = None, causal: bool = False, is_fp8_kvcache: bool = False,
                           indices: Optional[torch.Tensor] = None, attn_sink: Optional[torch.Tensor] = None,
                           extra_k_cache: Optional[torch.Tensor] = None,
                           extra_indices_in_kvcache: Optional[torch.Tensor] = None,
                           topk_length: Optional[torch.Tensor] = None,
                           extra_topk_length: Optional[torch.Tensor] = None):
    if not isinstance(tile_scheduler_metadata, FlashMLASchedMeta):
        raise ValueError("tile_scheduler_metadata must come from get_mla_metadata()")
    if num_splits is not None:
        raise ValueError("num_splits must be None")
    if indices is None:
        raise ValueError("indices is required: dsv4_rocm implements the sparse fp8 mode only")
    if causal:
        raise ValueError("causal must be False for sparse attention")
    if not is_fp8_kvcache:
        raise ValueError("is_fp8_kvcache must be True (fp8_ds_mla pages)")
    if head_dim_v != 512:
        raise ValueError(f"head_dim_v must be 512, got {head_dim_v}")
    cfg = (tuple(q.shape), k_cache.shape[1], indices.shape[-1],
           None if extra_k_cache is None else extra_k_cache.shape[1],
           None if extra_indices_in_kvcache is None else extra_indices_in_kvcache.shape[-1])
    meta = tile_scheduler_metadata
    if meta.have_initialized and meta.config != cfg:
        raise ValueError(f"tile_scheduler_metadata was made for {meta.config}, this call is {cfg}")
    meta.have_initialized, meta.config = True, cfg
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    return ops.sparse_mla_decode(q, k_cache, indices, topk_length, attn_sink, extra_k_cache,
                                 extra_indices_in_kvcache, extra_topk_length, softmax_scale)


def flash_mla_sparse_fwd(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int = 512,
                         attn_sink: Optional[torch.Tensor] = None, topk_length: Optional[torch.Tensor] = None):
    return ops.sparse_mla_prefill(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)
