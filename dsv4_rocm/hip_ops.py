"""Python side of the HIP kernels (dsv4_rocm._C): layout adaptation (page views, int64 slots, 16-byte
aligned rows) around the torch.ops.dsv4_rocm launchers. Arguments are validated in dsv4_rocm.ops."""
import torch

from ._build import load
from .reference.cache import as_pages


def _rows(t: torch.Tensor) -> torch.Tensor:
    """Rows the kernels read 16 bytes at a time: unit inner stride, every row 16-byte aligned."""
    outer = any((t.stride(d) * t.element_size()) % 16 for d in range(t.dim() - 1))
    if t.stride(-1) != 1 or outer or t.data_ptr() % 16:
        return t.contiguous()
    return t


def _slots(s: torch.Tensor) -> torch.Tensor:
    return s.to(torch.int64).contiguous()


def quantize_and_insert_k_cache(k, k_cache, slot_mapping, block_size: int):
    load().quantize_and_insert_k_cache(_rows(k), as_pages(k_cache, block_size), _slots(slot_mapping), block_size)


def fused_qnorm_rope_kv_rope_quant_insert(q, kv, swa_kv_cache_2d, slot_mapping, positions, cos_sin_cache,
                                          padded_heads: int, eps: float, block_size: int):
    return load().fused_qnorm_rope_kv_rope_quant_insert(
        _rows(q), _rows(kv), as_pages(swa_kv_cache_2d, block_size), _slots(slot_mapping), _slots(positions),
        cos_sin_cache.contiguous(), padded_heads, eps, block_size)


def fused_q_kv_rmsnorm(qr, kv, q_weight, kv_weight, eps: float):
    return load().fused_q_kv_rmsnorm(_rows(qr), _rows(kv), q_weight.to(torch.bfloat16).contiguous(),
                                     kv_weight.to(torch.bfloat16).contiguous(), eps)


def dequantize_and_gather_k_cache(k_cache, slots, block_size: int):
    return load().dequantize_and_gather_k_cache(as_pages(k_cache, block_size), _slots(slots), block_size)
