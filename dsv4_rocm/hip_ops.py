"""Python side of the HIP kernels (dsv4_rocm._C): layout adaptation around the torch.ops.dsv4_rocm_hip
launchers. Arguments are validated in dsv4_rocm.ops before these run.

What is adapted, and what is not: caches go in as their ``cache_views.pages`` view (the page stride is
passed, pages are never copied); index tensors go in as they are (int32 or int64, no conversion); rows
the kernels read or write 16 bytes at a time must be 16-byte aligned with unit inner stride: inputs that
are not are copied, outputs that are not are written through an aligned buffer and copied back.
"""
import torch

from . import cache_views as V
from ._build import load


def _aligned(t: torch.Tensor) -> bool:
    """Unit inner stride, every row (all dims but the last) starting at a multiple of 16 bytes."""
    shape, st = t.shape, t.stride()
    n = len(shape)
    if n and st[-1] != 1 and shape[-1] > 1:
        return False
    es = t.element_size()
    for d in range(n - 1):
        if shape[d] > 1 and (st[d] * es) % 16:
            return False
    return t.data_ptr() % 16 == 0


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if _aligned(t) else t.contiguous()


def _index(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _into(out: torch.Tensor, launch) -> torch.Tensor:
    """Run ``launch(buffer)`` on ``out`` itself when the kernels can write it, else on an aligned copy."""
    if _aligned(out):
        launch(out)
    else:
        tmp = torch.empty(out.shape, dtype=out.dtype, device=out.device)
        launch(tmp)
        out.copy_(tmp)
    return out


def _cos_sin(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride() == (64, 1) else t.contiguous()


def quantize_and_insert_k_cache(k, k_cache, slot_mapping, block_size: int, use_fnuz: bool = False):
    load().quantize_and_insert_k_cache(_rows(k), V.pages(k_cache, block_size), _index(slot_mapping), block_size,
                                       use_fnuz)


def fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(q, kv, k_cache, slot_mapping, positions, cos_sin_cache,
                                                      padded_heads: int, eps: float, block_size: int, q_out=None,
                                                      apply_q_norm: bool = True):
    if q_out is None:
        q_out = torch.empty(q.shape[0], padded_heads, q.shape[2], dtype=q.dtype, device=q.device)
    pages = V.pages(k_cache, block_size)
    q, kv, slot_mapping, positions, cos_sin_cache = (_rows(q), _rows(kv), _index(slot_mapping), _index(positions),
                                                     _cos_sin(cos_sin_cache))
    return _into(q_out, lambda o: load().fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(
        q, kv, o, pages, slot_mapping, positions, cos_sin_cache, eps, block_size, apply_q_norm))


def qnorm_rope_and_insert_full_k_cache(q, kv, k_cache, slot_mapping, positions, cos_sin_cache, eps: float,
                                       cache_block_size: int, fp8_scale, q_fp8, q_fp8_scale_inv):
    cache = k_cache.view(torch.uint8)
    q, kv, slot_mapping, positions, cos_sin_cache = (_rows(q), _rows(kv), _index(slot_mapping), _index(positions),
                                                     _cos_sin(cos_sin_cache))
    fp8_scale, q_fp8_scale_inv = fp8_scale.float().reshape(1), q_fp8_scale_inv.float().reshape(1)
    _into(q_fp8.view(torch.uint8), lambda o: load().qnorm_rope_and_insert_full_k_cache(
        q, kv, o, cache, slot_mapping, positions, cos_sin_cache, fp8_scale, q_fp8_scale_inv, eps, cache_block_size))


def fused_q_kv_rmsnorm(qr, kv, q_weight, kv_weight, eps: float):
    qr_out = torch.empty(qr.shape, dtype=qr.dtype, device=qr.device)
    kv_out = torch.empty(kv.shape, dtype=kv.dtype, device=kv.device)
    load().fused_q_kv_rmsnorm(_rows(qr), _rows(kv), q_weight.to(torch.bfloat16).contiguous(),
                              kv_weight.to(torch.bfloat16).contiguous(), qr_out, kv_out, eps)
    return qr_out, kv_out


def dequantize_and_gather_k_cache(out, k_cache, seq_lens, gather_lens, block_table, block_size: int, offset: int,
                                  use_fnuz: bool = False):
    pages = V.pages(k_cache, block_size)
    seq_lens, block_table = _index(seq_lens), block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    gather_lens = None if gather_lens is None else _index(gather_lens)
    _into(out, lambda o: load().dequantize_and_gather_k_cache(o, pages, seq_lens, gather_lens, block_table,
                                                             block_size, offset, use_fnuz))


def dequantize_global_slots_k_cache(out, k_cache, slot_ids, block_size: int):
    pages = V.pages(k_cache, block_size)
    if slot_ids.dim() == 1:                      # [N] slots into out [N, 512]: one row of N
        out, slot_ids = out.unsqueeze(0), slot_ids.unsqueeze(0)
    _into(out, lambda o: load().dequantize_global_slots_k_cache(o, pages, slot_ids, block_size))
