"""The sparse attention of one step, written once: metadata in, output out, no state kept between calls.

Every token, decode and prefill alike, attends straight from the fp8 pages over two key sets, with the
sink: its sliding window (the step's ``swa_indices``) and its compressed entries (C4 and V4.1: the
indexer's top-k, local entry ids made global slots through the compressed block table; C128: every visible
entry, global slots the step's metadata lists). ``attend_step`` takes everything it reads as arguments; the
layer (``DeepseekV4Attention.forward_mqa``) and the vLLM plugin's ``forward_mqa`` hook call it with their
own tensors, and the SGLang adapter's FlashMLA entrypoint calls ``sparse_attention`` with the key sets
SGLang's metadata already holds. Nothing here allocates beyond what the ops do, reads a tensor on the host
or loops per token, so a decode step stays capturable into a graph.
"""
from typing import NamedTuple, Optional

import torch

from . import ops


class KeySet(NamedTuple):
    """One set of keys in FlashMLA's forms: paged records [nb, bs, 1, R], int32 slot indices [b, s_q, K]
    (negative = absent) and the int32 lengths [b] or [b, s_q] (only the first ones of a row count)."""
    cache: torch.Tensor
    indices: torch.Tensor
    lens: Optional[torch.Tensor]


def sparse_attention(q: torch.Tensor, window: KeySet, compressed: Optional[KeySet], attn_sink, scale: float,
                     out: Optional[torch.Tensor] = None, kv_layout: Optional[str] = None):
    """FlashMLA's sparse decode of q bf16 [b, s_q, h, 512] over ``window`` and (when given) ``compressed``,
    with the sink -> (out bf16 [b, s_q, h, 512], written into ``out`` when given; lse fp32 [b, h, s_q])."""
    extra = compressed if compressed is not None else (None, None, None)
    return ops.sparse_mla_decode(q, window.cache, window.indices, window.lens, attn_sink, *extra, scale, out=out,
                                 kv_layout=kv_layout)


def attend_step(q: torch.Tensor, output: torch.Tensor, step, window_cache: torch.Tensor, attn_sink, scale: float,
                compressed_cache: Optional[torch.Tensor] = None, *, topk: Optional[torch.Tensor] = None,
                block_table: Optional[torch.Tensor] = None, block_size: int = 0,
                indices: Optional[torch.Tensor] = None, lens: Optional[torch.Tensor] = None,
                kv_layout: Optional[str] = None) -> None:
    """Attention of the step's T tokens (q bf16 [T, padded_heads, 512]) into ``output`` [T, padded_heads,
    512]. ``step``: the built ``StepMetadata`` (token_to_req, is_valid_token, swa_indices, swa_lens);
    ``window_cache`` / ``compressed_cache``: the SWA and compressed pages [nb, bs, 1, R]. The compressed
    entries are ``topk`` (int32 [T, K] local entry ids, made global through ``block_table`` of
    ``block_size`` entries a page), or ``indices`` / ``lens`` (global slots [T, K] and their lengths [T]),
    or none (a sliding-window layer). ``kv_layout``: the SWA records' page layout (None: the format's
    default)."""
    compressed = None
    if topk is not None:
        gidx, glens = ops.compute_global_topk_indices_and_lens(topk, step.token_to_req, block_table, block_size,
                                                               step.is_valid_token)
        compressed = KeySet(compressed_cache, gidx.unsqueeze(1), glens)
    elif indices is not None:
        compressed = KeySet(compressed_cache, indices.unsqueeze(1), lens)
    window = KeySet(window_cache, step.swa_indices.unsqueeze(1), step.swa_lens)
    sparse_attention(q.unsqueeze(1), window, compressed, attn_sink, scale, out=output.unsqueeze(1),
                     kv_layout=kv_layout)
