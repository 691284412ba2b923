"""Norms, the fused Q/KV insert and the fp8_ds_mla cache ops (vLLM's names)."""
import torch

from .. import _checks as C
from .. import layout as L  # noqa: F401
from ..reference import cache as _rc, norm as _rn, qkv as _rq
from ._dispatch import register, run as _run

__all__ = [
    "fused_q_kv_rmsnorm", "fused_qnorm_rope_kv_rope_quant_insert", "quantize_and_insert_k_cache",
    "dequantize_and_gather_k_cache", "indexer_k_gather"]

register("fused_q_kv_rmsnorm", _rn.fused_q_kv_rmsnorm,
         hip="dsv4_rocm.hip_ops:fused_q_kv_rmsnorm")
register("fused_qnorm_rope_kv_rope_quant_insert", _rq.fused_qnorm_rope_kv_rope_quant_insert,
         hip="dsv4_rocm.hip_ops:fused_qnorm_rope_kv_rope_quant_insert")
register("quantize_and_insert_k_cache", _rc.quantize_and_insert_k_cache,
         hip="dsv4_rocm.hip_ops:quantize_and_insert_k_cache")
register("dequantize_and_gather_k_cache", _rc.dequantize_and_gather_k_cache,
         hip="dsv4_rocm.hip_ops:dequantize_and_gather_k_cache")
register("indexer_k_gather", _rc.indexer_k_gather)


def fused_q_kv_rmsnorm(qr, kv, q_weight, kv_weight, eps: float):
    C.tensor("qr", qr, dtype=torch.bfloat16, dim=2)
    C.tensor("kv", kv, dtype=torch.bfloat16, shape=(qr.shape[0], None))
    if qr.shape[1] % 8 or kv.shape[1] % 8:
        raise ValueError(f"qr and kv rows must be multiples of 8 values, got {qr.shape[1]} and {kv.shape[1]}")
    C.tensor("q_weight", q_weight, shape=(qr.shape[1],))
    C.tensor("kv_weight", kv_weight, shape=(kv.shape[1],))
    C.same_device(qr=qr, kv=kv, q_weight=q_weight, kv_weight=kv_weight)
    return _run("fused_q_kv_rmsnorm", qr.device, qr, kv, q_weight, kv_weight, eps)


def fused_qnorm_rope_kv_rope_quant_insert(q, kv, swa_kv_cache_2d, slot_mapping, positions, cos_sin_cache,
                                          padded_heads: int, eps: float, block_size: int):
    """q bf16 [T, H, 512] -> q_padded bf16 [T, padded_heads, 512]; kv bf16 [T, 512] RoPE'd, quantized and
    written at slot_mapping (first len(slot_mapping) tokens; negative slots skipped)."""
    C.tensor("q", q, dtype=torch.bfloat16, shape=(None, None, 512))
    C.tensor("kv", kv, dtype=torch.bfloat16, shape=(q.shape[0], 512))
    C.positive_int("block_size", block_size)
    if padded_heads not in (64, 128) or padded_heads < q.shape[1]:
        raise ValueError(f"padded_heads must be 64 or 128 and >= the {q.shape[1]} heads of q, got {padded_heads}")
    C.cos_sin(cos_sin_cache, positions)
    if positions.shape[0] != q.shape[0]:
        raise ValueError(f"positions has {positions.shape[0]} entries for {q.shape[0]} tokens")
    if slot_mapping.shape[0] > q.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {q.shape[0]} tokens")
    C.slots("slot_mapping", slot_mapping, swa_kv_cache_2d, block_size)
    C.same_device(q=q, kv=kv, swa_kv_cache_2d=swa_kv_cache_2d, slot_mapping=slot_mapping, positions=positions,
                  cos_sin_cache=cos_sin_cache)
    return _run("fused_qnorm_rope_kv_rope_quant_insert", q.device, q, kv, swa_kv_cache_2d, slot_mapping, positions,
                cos_sin_cache, padded_heads, eps, block_size)


def quantize_and_insert_k_cache(k, k_cache, slot_mapping, block_size: int):
    """k bf16 [T, 512] (RoPE applied) -> fp8_ds_mla records at slot_mapping (vLLM's op)."""
    C.tensor("k", k, dtype=torch.bfloat16, shape=(None, 512))
    C.positive_int("block_size", block_size)
    if slot_mapping.shape[0] > k.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {k.shape[0]} tokens")
    C.slots("slot_mapping", slot_mapping, k_cache, block_size)
    C.same_device(k=k, k_cache=k_cache, slot_mapping=slot_mapping)
    return _run("quantize_and_insert_k_cache", k.device, k, k_cache, slot_mapping, block_size)


def dequantize_and_gather_k_cache(k_cache, slots, block_size: int):
    """bf16 [N, 512] rows at slots (zero rows for negative slots)."""
    C.positive_int("block_size", block_size)
    C.slots("slots", slots, k_cache, block_size)
    return _run("dequantize_and_gather_k_cache", k_cache.device, k_cache, slots, block_size)


def indexer_k_gather(kv_cache, slots, block_size: int):
    C.positive_int("block_size", block_size)
    C.slots("slots", slots, kv_cache, block_size, indexer=True)
    return _run("indexer_k_gather", kv_cache.device, kv_cache, slots, block_size)
