"""KV compressor of C4 / C128 layers: vLLM's ``save_partial_states`` and ``compress_norm_rope_store_triton``
(also importable as ``compress_norm_rope_store_cutedsl``, the name vLLM's CUDA head-512 path imports)."""
from types import SimpleNamespace

import torch

from .. import _checks as C
from .. import layout as L
from ..reference import compressor as _rc
from ._dispatch import HAVE_TRITON, register, run as _run, value_checks

__all__ = ["compressor_kv_score", "save_partial_states", "compress_norm_rope_store",
           "compress_norm_rope_store_triton", "compress_norm_rope_store_cutedsl"]

if HAVE_TRITON:     # importing a kernel imports Triton, which is optional: without it the ops run their oracles
    from ..triton.compressor.compress_norm_rope_store import compress_norm_rope_store as _triton_compress
    from ..triton.compressor.save_partial_states import save_partial_states as _triton_save
else:
    _triton_compress = _triton_save = None
register("compressor_kv_score", _rc.compressor_kv_score)
register("save_partial_states", _rc.save_partial_states, triton=_triton_save)
register("compress_norm_rope_store", _rc.compress_norm_rope_store, triton=_triton_compress)

# (head_dim, use_fp4_cache) -> (quant_block, token_stride, scale_dim) of the indexer records the op writes; a
# head-512 cache's record format is named by its last dimension (584, 528 or 288): (quant_block, data_bytes,
# scale_bytes) of that format
_RECORDS = {(128, False): (128, 128, 4), (128, True): (32, 64, 4)}
MAIN_FORMATS = {f.token_bytes: f for f in L.KV_FORMATS}


def compressor_kv_score(x, fused_wkv_wgate):
    """The compressor projection: bf16 x [T, hidden] @ fused_wkv_wgate^T -> fp32 [T, 2 * coff * D]."""
    C.tensor("x", x, dtype=torch.bfloat16, dim=2)
    C.tensor("fused_wkv_wgate", fused_wkv_wgate, shape=(None, x.shape[1]))
    C.same_device(x=x, fused_wkv_wgate=fused_wkv_wgate)
    return _run("compressor_kv_score", x.device, x, fused_wkv_wgate)


def _ratio(compress_ratio):
    if compress_ratio not in (4, 128) or isinstance(compress_ratio, bool):
        raise ValueError(f"compress_ratio must be 4 or 128, got {compress_ratio!r}")


def _state_cache(state_cache, block_size, state_width):
    C.tensor("state_cache", state_cache, dtype=torch.float32, dim=3)
    C.positive_int("block_size", block_size)
    if state_cache.shape[1] != block_size:
        raise ValueError(f"state_cache has {state_cache.shape[1]} tokens a block, block_size is {block_size}")
    if state_cache.shape[2] != 2 * state_width or state_cache.stride(2) != 1:
        raise ValueError(f"state_cache rows must be 2 * state_width = {2 * state_width} contiguous floats, got shape "
                         f"{tuple(state_cache.shape)} stride {state_cache.stride()}")
    C.no_overlap("state_cache", state_cache)


def _rows(name, t, n):
    C.tensor(name, t, dtype=C.INDEX, dim=1)
    if t.shape[0] < n:
        raise ValueError(f"{name} has {t.shape[0]} entries for {n} tokens (num_actual / len(slot_mapping))")


def save_partial_states(kv, score, ape, positions, state_cache, slot_mapping, block_size: int, state_width: int,
                        compress_ratio: int, pdl_kwargs=None) -> None:
    """state_cache[slot] = [kv | score + ape[pos % r]] (fp32) for the first len(slot_mapping) tokens; a
    negative slot is padding (skipped)."""
    _ratio(compress_ratio)
    C.positive_int("state_width", state_width)
    C.tensor("kv", kv, dtype=torch.float32, dim=2)
    C.tensor("score", score, dtype=torch.float32, shape=tuple(kv.shape))
    h = kv.shape[1]
    if h > state_width or kv.stride(1) != 1 or score.stride(1) != 1:
        raise ValueError(f"kv and score rows must be at most state_width = {state_width} contiguous floats, got "
                         f"{h} (strides {kv.stride()}, {score.stride()})")
    C.tensor("ape", ape, dtype=torch.float32, shape=(compress_ratio, h))
    if ape.stride(1) != 1:
        raise ValueError("ape rows must be contiguous")
    _state_cache(state_cache, block_size, state_width)
    n = C.tensor("slot_mapping", slot_mapping, dtype=C.INDEX, dim=1).shape[0]
    if n > kv.shape[0]:
        raise ValueError(f"slot_mapping has {n} entries for {kv.shape[0]} tokens")
    _rows("positions", positions, n)
    C.same_device(kv=kv, score=score, ape=ape, positions=positions, state_cache=state_cache, slot_mapping=slot_mapping)
    if value_checks(slot_mapping) and n:
        s, p = slot_mapping.long(), positions[:n].long()
        if int(s.max()) >= state_cache.shape[0] * block_size:
            raise ValueError(f"slot_mapping: slot {int(s.max())} is outside the state cache "
                             f"({state_cache.shape[0]} blocks x {block_size})")
        if bool(((s >= 0) & (p < 0)).any()):
            raise ValueError("positions: a token with a state slot has a negative position")
    _run("save_partial_states", kv.device, kv, score, ape, positions, state_cache, slot_mapping, block_size,
         state_width, compress_ratio, pdl_kwargs)


def _kv_cache(kv_cache, record_bytes):
    C.tensor("kv_cache", kv_cache, dtype=(torch.uint8, torch.float8_e4m3fn))
    if kv_cache.dim() == 4 and kv_cache.shape[2] == 1:
        shape = (kv_cache.shape[0], kv_cache.shape[1], kv_cache.shape[3])
    elif kv_cache.dim() == 3:
        shape = tuple(kv_cache.shape)
    else:
        raise ValueError(f"kv_cache must be [num_blocks, block_size, {record_bytes}] (or [nb, bs, 1, {record_bytes}]), "
                         f"got shape {tuple(kv_cache.shape)}")
    if shape[2] != record_bytes or shape[1] == 0 or kv_cache.stride(-1) != 1:
        raise ValueError(f"kv_cache records must be {record_bytes} bytes (token_stride + scale_dim), got shape "
                         f"{tuple(kv_cache.shape)} stride {kv_cache.stride()}")
    if shape[0] > 1 and kv_cache.stride(0) < shape[1] * record_bytes:
        raise ValueError(f"kv_cache page stride {kv_cache.stride(0)} is below the {shape[1] * record_bytes} bytes "
                         "of a page's records")
    C.no_overlap("kv_cache", kv_cache)
    return shape[1]


def compress_norm_rope_store(state_cache, num_actual, token_to_req_indices, positions, slot_mapping, block_table,
                             block_size, state_width, cos_sin_cache, kv_cache, k_cache_metadata, pdl_kwargs, head_dim,
                             rope_head_dim, compress_ratio, overlap, use_fp4_cache, rms_norm_weight, rms_norm_eps,
                             quant_block, token_stride, scale_dim, *, store_full_kv=False, store_full_fp8=False,
                             fp8_scale=None, kv_layout: str = None) -> None:
    """vLLM's fused compress -> RMSNorm -> RoPE -> quant -> cache insert, for the boundary tokens among the
    first num_actual: for head_dim 512 a record of the format kv_cache's last dimension names (584:
    V40_584, 528: V41_528, 288: V41_FP4_288; ``kv_layout`` "page_split", "interleaved" or None, the format's
    ``layout.default_layout``), for 128 indexer K FP8 or MXFP4. ``slot_mapping`` is the state cache's,
    ``k_cache_metadata.slot_mapping`` the output cache's."""
    if store_full_kv or store_full_fp8 or fp8_scale is not None:
        raise ValueError("store_full_kv / store_full_fp8 / fp8_scale: only the fp8_ds_mla paged layout is supported")
    _ratio(compress_ratio)
    if overlap != (compress_ratio == 4):
        raise ValueError(f"overlap must be {compress_ratio == 4} for compress_ratio {compress_ratio}")
    if rope_head_dim != 64:
        raise ValueError(f"rope_head_dim must be 64, got {rope_head_dim!r}")
    fmt = L.V40_584
    if head_dim == 512 and not use_fp4_cache:
        width = kv_cache.shape[-1] if isinstance(kv_cache, torch.Tensor) and kv_cache.dim() in (3, 4) else None
        if width not in MAIN_FORMATS:
            raise ValueError(f"kv_cache records must be 584, 528 or 288 bytes for head_dim 512 (a [num_blocks, "
                             f"block_size, R] view; R names the record format), got "
                             f"{tuple(kv_cache.shape) if isinstance(kv_cache, torch.Tensor) else type(kv_cache)}")
        fmt = L.with_layout(MAIN_FORMATS[width], kv_layout)
        rec = (fmt.quant_block, fmt.data_bytes, fmt.scale_bytes)
    else:
        rec = _RECORDS.get((head_dim, bool(use_fp4_cache)))
    if rec is None:
        raise ValueError(f"head_dim / use_fp4_cache: {head_dim!r} / {use_fp4_cache!r} is not one of 512 (main, no "
                         "fp4) or 128 (indexer)")
    if (quant_block, token_stride, scale_dim) != rec:
        raise ValueError(f"quant_block, token_stride, scale_dim must be {rec} for head_dim {head_dim}"
                         f"{f' ({fmt.name} records)' if head_dim == 512 else ''}, got "
                         f"{(quant_block, token_stride, scale_dim)}")
    if state_width != _rc.coff(compress_ratio) * head_dim:
        raise ValueError(f"state_width must be coff * head_dim = {_rc.coff(compress_ratio) * head_dim}, got "
                         f"{state_width!r}")
    if not isinstance(rms_norm_eps, (int, float)) or isinstance(rms_norm_eps, bool) or not 0 <= rms_norm_eps < 1:
        raise ValueError(f"rms_norm_eps must be a float in [0, 1), got {rms_norm_eps!r}")
    _state_cache(state_cache, block_size, state_width)
    if not isinstance(num_actual, int) or isinstance(num_actual, bool) or num_actual < 0:
        raise ValueError(f"num_actual must be a non-negative int, got {num_actual!r}")
    kslots = getattr(k_cache_metadata, "slot_mapping", k_cache_metadata)     # the metadata object, or its slots
    for name, t in (("token_to_req_indices", token_to_req_indices), ("positions", positions),
                    ("slot_mapping", slot_mapping), ("k_cache_metadata.slot_mapping", kslots)):
        _rows(name, t, num_actual)
    C.tensor("block_table", block_table, dtype=C.INDEX, dim=2)
    C.tensor("cos_sin_cache", cos_sin_cache, dtype=torch.float32, shape=(None, 64))
    if cos_sin_cache.stride(1) != 1:
        raise ValueError("cos_sin_cache rows must be contiguous")
    C.tensor("rms_norm_weight", rms_norm_weight, dtype=(torch.bfloat16, torch.float32), shape=(head_dim,))
    kbs = _kv_cache(kv_cache, token_stride + scale_dim)
    C.same_device(state_cache=state_cache, token_to_req_indices=token_to_req_indices, positions=positions,
                  slot_mapping=slot_mapping, block_table=block_table, cos_sin_cache=cos_sin_cache, kv_cache=kv_cache,
                  kslots=kslots, rms_norm_weight=rms_norm_weight)
    if value_checks(slot_mapping) and num_actual:
        _check_values(state_cache, num_actual, token_to_req_indices, positions, slot_mapping, block_table, block_size,
                      cos_sin_cache, kv_cache.shape[0] * kbs, kslots, compress_ratio)
    if num_actual == 0:
        return
    _run("compress_norm_rope_store", state_cache.device, state_cache, num_actual, token_to_req_indices, positions,
         slot_mapping, block_table, block_size, state_width, cos_sin_cache, kv_cache,
         SimpleNamespace(slot_mapping=kslots), pdl_kwargs, head_dim,
         rope_head_dim, compress_ratio, overlap, bool(use_fp4_cache), rms_norm_weight, float(rms_norm_eps), quant_block,
         token_stride, scale_dim, fmt=fmt)


def _check_values(state_cache, n, t2r, positions, slot_mapping, block_table, block_size, cos_sin_cache, capacity,
                  kslots, ratio):
    """Index ranges of the tokens that produce an entry (the others are never read past their slot)."""
    s = slot_mapping[:n].long()
    p = positions[:n].long()
    if int(s.max()) >= state_cache.shape[0] * block_size:
        raise ValueError(f"slot_mapping: slot {int(s.max())} is outside the state cache "
                         f"({state_cache.shape[0]} blocks x {block_size})")
    live = s >= 0
    if bool((live & ((p < 0) | (p >= cos_sin_cache.shape[0]))).any()):
        raise ValueError(f"positions must lie in [0, {cos_sin_cache.shape[0]}) (rows of cos_sin_cache)")
    ks = kslots[:n].long()
    if int(ks.max()) >= capacity:
        raise ValueError(f"k_cache_metadata.slot_mapping: slot {int(ks.max())} is outside kv_cache ({capacity} slots)")
    emit = live & ((p + 1) % ratio == 0) & (ks >= 0)
    if not bool(emit.any()):
        return
    r = t2r[:n].long()[emit]
    if int(r.min()) < 0 or int(r.max()) >= block_table.shape[0]:
        raise ValueError(f"token_to_req_indices must lie in [0, {block_table.shape[0]}) (rows of block_table)")
    last = p[emit] // block_size
    if int(last.max()) >= block_table.shape[1]:
        raise ValueError(f"block_table has {block_table.shape[1]} columns; position {int(p[emit].max())} needs "
                         f"{int(last.max()) + 1}")
    if int(block_table.max()) >= state_cache.shape[0]:
        raise ValueError(f"block_table names block {int(block_table.max())} of a {state_cache.shape[0]}-block "
                         "state cache")


compress_norm_rope_store_triton = compress_norm_rope_store
compress_norm_rope_store_cutedsl = compress_norm_rope_store
