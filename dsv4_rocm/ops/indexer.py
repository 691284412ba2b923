"""Lightning indexer of C4 layers: q quant, logits (DeepGEMM's forms), top-k."""
import torch

from .. import _checks as C
from ..reference import cache as _rc, indexer as _ri
from ._dispatch import register, run as _run

__all__ = ["fused_indexer_q_rope_quant", "fp8_mqa_logits", "fp8_paged_mqa_logits", "top_k_per_row"]

register("fused_indexer_q_rope_quant", _ri.indexer_q_rope_quant)
register("fp8_mqa_logits", _ri.fp8_mqa_logits)
register("fp8_paged_mqa_logits", _ri.fp8_paged_mqa_logits)
register("top_k_per_row", _ri.top_k_per_row)


def fused_indexer_q_rope_quant(qi, positions, cos_sin_cache, weights, softmax_scale: float = 128 ** -0.5):
    """qi bf16 [T, H, 128], weights [T, H] -> (q8 uint8 [T, H, 128], folded weights fp32 [T, H])."""
    C.tensor("qi", qi, dtype=torch.bfloat16, shape=(None, None, 128))
    C.tensor("weights", weights, shape=(qi.shape[0], qi.shape[1]))
    C.cos_sin(cos_sin_cache, positions)
    return _run("fused_indexer_q_rope_quant", qi.device, qi, positions, cos_sin_cache, weights, softmax_scale)


def fp8_mqa_logits(q8, k8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke):
    q8, k8 = C.fp8_bytes("q", q8), C.fp8_bytes("kv", k8)
    C.tensor("q", q8, shape=(None, None, 128))
    C.tensor("kv", k8, shape=(None, 128))
    C.tensor("kv_scale", k_scale, dtype=torch.float32, shape=(k8.shape[0],))
    C.tensor("weights", weights, shape=q8.shape[:2])
    C.tensor("cu_seqlen_ks", cu_seqlen_ks, dtype=C.INDEX, shape=(q8.shape[0],))
    C.tensor("cu_seqlen_ke", cu_seqlen_ke, dtype=C.INDEX, shape=(q8.shape[0],))
    return _run("fp8_mqa_logits", q8.device, q8, k8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke)


def fp8_paged_mqa_logits(q8, kv_cache, weights, context_lens, block_table, block_size: int, max_context_len: int):
    q8 = C.fp8_bytes("q", q8)
    C.tensor("q", q8, shape=(None, None, None, 128))
    B, nn = q8.shape[:2]
    C.tensor("weights", weights, shape=(B * nn, q8.shape[2]))
    C.tensor("context_lens", context_lens, dtype=C.INDEX)
    C.tensor("block_table", block_table, dtype=C.INDEX, shape=(B, None))
    C.positive_int("max_context_len", max_context_len)
    pages = _rc.as_pages(kv_cache, block_size, "kv_cache", indexer=True)
    if context_lens.numel() and int(context_lens.max()) > block_table.shape[1] * block_size:
        raise ValueError("context_lens exceed what block_table covers")
    if block_table.numel() and int(block_table.max()) >= pages.shape[0]:
        raise ValueError(f"block_table names a page >= {pages.shape[0]}")
    return _run("fp8_paged_mqa_logits", q8.device, q8, kv_cache, weights, context_lens, block_table, block_size,
                max_context_len)


def top_k_per_row(logits, row_starts, row_ends, k: int):
    C.tensor("logits", logits, dtype=torch.float32, dim=2)
    C.tensor("row_starts", row_starts, dtype=C.INDEX, shape=(logits.shape[0],))
    C.tensor("row_ends", row_ends, dtype=C.INDEX, shape=(logits.shape[0],))
    C.positive_int("k", k)
    if logits.shape[0] and (int(row_starts.min()) < 0 or int(row_ends.max()) > logits.shape[1]):
        raise ValueError(f"row_starts/row_ends must lie in [0, {logits.shape[1]}]")
    return _run("top_k_per_row", logits.device, logits, row_starts, row_ends, k)
