"""Python side of the HIP kernels (dsv4_rocm._C): layout adaptation around the torch.ops.dsv4_rocm_hip
launchers. Arguments are validated in dsv4_rocm.ops before these run.

What is adapted, and what is not: caches go in as their ``cache_views.pages`` view (the page stride is
passed, pages are never copied); index tensors go in as they are (int32 or int64, no conversion); rows
the kernels read or write 16 bytes at a time must be 16-byte aligned with unit inner stride: inputs that
are not are copied, outputs that are not are written through an aligned buffer and copied back.
"""
import torch

from . import cache_views as V
from . import layout as L
from ._build import load

# the record formats' codes in the launch arguments (hip_kernels/include/dsv4/record.h DSV4_FMT_*)
FORMAT_CODES = {L.V40_584.name: 0, L.V41_528.name: 1, L.V41_FP4_288.name: 2}


def _format(fmt: L.RecordFormat) -> tuple:
    """The launch arguments naming a record format: (code, FNUZ flavour, interleaved page layout)."""
    return FORMAT_CODES[fmt.name], fmt.fnuz, fmt.interleaved


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


def quantize_and_insert_k_cache(k, k_cache, slot_mapping, block_size: int, fmt: L.RecordFormat = L.V40_584):
    load().quantize_and_insert_k_cache(_rows(k), V.pages(k_cache, block_size, "k_cache", fmt), _index(slot_mapping),
                                       block_size, *_format(fmt))


def fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(q, kv, k_cache, slot_mapping, positions, cos_sin_cache,
                                                      padded_heads: int, eps: float, block_size: int, q_out=None,
                                                      apply_q_norm: bool = True, apply_q_rope: bool = True,
                                                      is_q_interleaved: bool = False,
                                                      fmt: L.RecordFormat = L.V40_584):
    if q_out is None:
        q_out = torch.empty(q.shape[0], padded_heads, q.shape[2], dtype=q.dtype, device=q.device)
    pages = V.pages(k_cache, block_size, "k_cache", fmt)
    if is_q_interleaved:        # a token's heads are one row: copies keep it one row
        q = q if q.stride(2) == 1 and (q.shape[1] <= 1 or q.stride(1) == q.shape[2]) and _aligned(q) else q.contiguous()
    q, kv, slot_mapping, positions, cos_sin_cache = (_rows(q), _rows(kv), _index(slot_mapping), _index(positions),
                                                     _cos_sin(cos_sin_cache))
    return _into(q_out, lambda o: load().fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(
        q, kv, o, pages, slot_mapping, positions, cos_sin_cache, eps, block_size, *_format(fmt), apply_q_norm,
        apply_q_rope, is_q_interleaved))


def qnorm_rope_and_insert_full_k_cache(q, kv, k_cache, slot_mapping, positions, cos_sin_cache, eps: float,
                                       cache_block_size: int, fp8_scale, q_fp8, q_fp8_scale_inv,
                                       apply_q_norm: bool = True):
    cache = k_cache.view(torch.uint8)
    q, kv, slot_mapping, positions, cos_sin_cache = (_rows(q), _rows(kv), _index(slot_mapping), _index(positions),
                                                     _cos_sin(cos_sin_cache))
    fp8_scale, q_fp8_scale_inv = fp8_scale.float().reshape(1), q_fp8_scale_inv.float().reshape(1)
    _into(q_fp8.view(torch.uint8), lambda o: load().qnorm_rope_and_insert_full_k_cache(
        q, kv, o, cache, slot_mapping, positions, cos_sin_cache, fp8_scale, q_fp8_scale_inv, eps, cache_block_size,
        apply_q_norm))


def fused_q_kv_rmsnorm(qr, kv, q_weight, kv_weight, eps: float):
    qr_out = torch.empty(qr.shape, dtype=qr.dtype, device=qr.device)
    kv_out = torch.empty(kv.shape, dtype=kv.dtype, device=kv.device)
    load().fused_q_kv_rmsnorm(_rows(qr), _rows(kv), q_weight.to(torch.bfloat16).contiguous(),
                              kv_weight.to(torch.bfloat16).contiguous(), qr_out, kv_out, eps)
    return qr_out, kv_out


def dequantize_and_gather_k_cache(out, k_cache, seq_lens, gather_lens, block_table, block_size: int, offset: int,
                                  fmt: L.RecordFormat = L.V40_584):
    pages = V.pages(k_cache, block_size, "k_cache", fmt)
    seq_lens, block_table = _index(seq_lens), block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    gather_lens = None if gather_lens is None else _index(gather_lens)
    _into(out, lambda o: load().dequantize_and_gather_k_cache(o, pages, seq_lens, gather_lens, block_table,
                                                             block_size, offset, *_format(fmt)))


def dequantize_global_slots_k_cache(out, k_cache, slot_ids, block_size: int, fmt: L.RecordFormat = L.V40_584):
    pages = V.pages(k_cache, block_size, "k_cache", fmt)
    if slot_ids.dim() == 1:                      # [N] slots into out [N, 512]: one row of N
        out, slot_ids = out.unsqueeze(0), slot_ids.unsqueeze(0)
    _into(out, lambda o: load().dequantize_global_slots_k_cache(o, pages, slot_ids, block_size,
                                                               *_format(fmt)))
