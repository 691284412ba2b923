"""DeepSeek-V4.1 compressor in vLLM's call forms (vllm/models/deepseek_v41/common/ops/fused_compress_quant_cache.py):
``fused_save_compress_norm`` (ring save, pooling of ratio-1 / ratio-2 groups, RMSNorm -> bf16 latent) and
``rope_quant_insert`` (latent -> RoPE -> compressed-cache record). The math is in
``dsv4_rocm.reference.compressor_v41``; bad input is a ValueError naming the argument before anything is
written, value checks follow ``value_checks`` (docs/conventions.md).
"""
import torch

from .. import _checks as C
from .. import layout as L
from ..reference import compressor_v41 as _rv
from ._dispatch import HAVE_TRITON, register, run as _run, value_checks

__all__ = ["fused_save_compress_norm", "rope_quant_insert"]

if HAVE_TRITON:     # importing a kernel imports Triton, which is optional: without it the ops run their oracles
    from ..triton.compressor.fused_save_compress_norm import fused_save_compress_norm as _triton_save_compress
    from ..triton.compressor.rope_quant_insert import rope_quant_insert as _triton_rope_quant_insert
else:
    _triton_save_compress = _triton_rope_quant_insert = None
register("fused_save_compress_norm", _rv.fused_save_compress_norm, triton=_triton_save_compress)
register("rope_quant_insert", _rv.rope_quant_insert, triton=_triton_rope_quant_insert)

D = _rv.LATENT_DIM


def _ratio(compress_ratio):
    if compress_ratio not in (1, 2) or isinstance(compress_ratio, bool):
        raise ValueError(f"compress_ratio must be 1 or 2 (DeepSeek-V4.1), got {compress_ratio!r}")


def _token_vector(name, t, n):
    C.tensor(name, t, dtype=C.INDEX, dim=1)
    if t.shape[0] < n:
        raise ValueError(f"{name} has {t.shape[0]} entries for the {n} tokens of slot_mapping")
    if t.shape[0] > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous")


def fused_save_compress_norm(kv_score, positions, state_cache, slot_mapping, query_start_loc, token_to_req_indices,
                             rms_norm_weight, rms_norm_eps, compress_ratio, latent_out, prev_rows=None,
                             prev_row_indices=None) -> None:
    """kv_score fp32 [T, 512 * r] (rows 16-byte aligned), positions int [>= n], slot_mapping int [n] (r = 2:
    ring slots of ``state_cache`` fp32 [blocks, capacity, 1024]; r = 1: any slots, negative = padding, and
    state_cache / query_start_loc / token_to_req_indices / prev_rows / prev_row_indices are unused and may be
    None), query_start_loc int32 [R + 1], token_to_req_indices int [m] (m < n in vLLM's padded steps: a token
    past it must be padding, slot < 0), rms_norm_weight [512], latent_out bf16 [T, 512] contiguous: writes the
    latents of the group-closing tokens and saves the ring (reference.compressor_v41). With ``prev_rows``
    fp32 [rows, 1024] (rows 16-byte aligned) and ``prev_row_indices`` int [>= R] (r = 2, vLLM's prefill
    context parallelism), request b's first token pairs with ``prev_rows[prev_row_indices[b]]`` where that
    index is >= 0 (the ring row where it is negative) and no ring row is saved."""
    _ratio(compress_ratio)
    C.tensor("kv_score", kv_score, dtype=torch.float32, shape=(None, D * compress_ratio))
    if kv_score.shape[0] and (kv_score.stride(1) != 1 or (kv_score.shape[0] > 1 and kv_score.stride(0) % 4)):
        raise ValueError(f"kv_score rows must be contiguous and 16-byte aligned, got strides {kv_score.stride()}")
    T = kv_score.shape[0]
    C.tensor("latent_out", latent_out, dtype=torch.bfloat16, shape=(T, D), contiguous=True)
    n = C.tensor("slot_mapping", slot_mapping, dtype=C.INDEX, dim=1).shape[0]
    if n > T:
        raise ValueError(f"slot_mapping has {n} entries for the {T} rows of kv_score")
    if n > 1 and slot_mapping.stride(0) != 1:
        raise ValueError("slot_mapping must be contiguous")
    _token_vector("positions", positions, n)
    C.tensor("rms_norm_weight", rms_norm_weight, dtype=(torch.bfloat16, torch.float32), shape=(D,))
    C.finite_float("rms_norm_eps", rms_norm_eps, minimum=0.0)
    if compress_ratio == 2:
        C.tensor("state_cache", state_cache, dtype=torch.float32, dim=3)
        if state_cache.shape[2] != 2 * D or state_cache.stride(2) != 1 or state_cache.shape[1] < 1 or (
                state_cache.shape[1] > 1 and state_cache.stride(1) % 4):
            raise ValueError(f"state_cache must be fp32 [blocks, capacity, {2 * D}] with contiguous 16-byte aligned "
                             f"rows, got shape {tuple(state_cache.shape)} stride {state_cache.stride()}")
        C.tensor("query_start_loc", query_start_loc, dtype=torch.int32, dim=1)
        if query_start_loc.shape[0] < 1 or (query_start_loc.shape[0] > 1 and query_start_loc.stride(0) != 1):
            raise ValueError("query_start_loc must be a contiguous int32 [num_reqs + 1] tensor")
        C.tensor("token_to_req_indices", token_to_req_indices, dtype=C.INDEX, dim=1)   # may stop before n:
        if token_to_req_indices.shape[0] > 1 and token_to_req_indices.stride(0) != 1:  # padding past its end
            raise ValueError("token_to_req_indices must be contiguous")
        _prev_rows(prev_rows, prev_row_indices, query_start_loc.shape[0] - 1)
    else:
        prev_rows = prev_row_indices = None
    C.same_device(kv_score=kv_score, positions=positions, state_cache=state_cache if compress_ratio == 2 else None,
                  slot_mapping=slot_mapping, query_start_loc=query_start_loc if compress_ratio == 2 else None,
                  token_to_req_indices=token_to_req_indices if compress_ratio == 2 else None,
                  rms_norm_weight=rms_norm_weight, latent_out=latent_out, prev_rows=prev_rows,
                  prev_row_indices=prev_row_indices)
    if compress_ratio == 2 and value_checks(slot_mapping) and n:
        _check_ring(state_cache, slot_mapping, positions, query_start_loc, token_to_req_indices, n)
        if prev_rows is not None:
            R = query_start_loc.shape[0] - 1
            if R and int(prev_row_indices[:R].max()) >= prev_rows.shape[0]:
                raise ValueError(f"prev_row_indices: row {int(prev_row_indices[:R].max())} is outside prev_rows "
                                 f"({prev_rows.shape[0]} rows)")
    if n == 0:
        return
    _run("fused_save_compress_norm", kv_score.device, kv_score, positions, state_cache, slot_mapping,
         query_start_loc, token_to_req_indices, rms_norm_weight, float(rms_norm_eps), compress_ratio, latent_out,
         prev_rows, prev_row_indices)


def _prev_rows(prev_rows, prev_row_indices, R):
    """Structure checks of the rows from other chunks (ratio 2): both or neither, fp32 [rows, 1024] with
    contiguous 16-byte aligned rows, one index per request."""
    if prev_rows is None:
        if prev_row_indices is not None:
            raise ValueError("prev_row_indices is given without prev_rows")
        return
    if prev_row_indices is None:
        raise ValueError("prev_rows needs prev_row_indices (the row of each request's predecessor, or -1)")
    C.tensor("prev_rows", prev_rows, dtype=torch.float32, shape=(None, 2 * D))
    if prev_rows.shape[0] and (prev_rows.stride(1) != 1 or (prev_rows.shape[0] > 1 and prev_rows.stride(0) % 4)):
        raise ValueError(f"prev_rows rows must be contiguous and 16-byte aligned, got strides {prev_rows.stride()}")
    C.tensor("prev_row_indices", prev_row_indices, dtype=C.INDEX, dim=1)
    if prev_row_indices.shape[0] < R:
        raise ValueError(f"prev_row_indices has {prev_row_indices.shape[0]} entries for the {R} requests of "
                         "query_start_loc")
    if prev_row_indices.shape[0] > 1 and prev_row_indices.stride(0) != 1:
        raise ValueError("prev_row_indices must be contiguous")


def _check_ring(state_cache, slot_mapping, positions, query_start_loc, token_to_req, n):
    """Value checks of a ratio-2 call: ring slots inside the cache, each live token's request and position."""
    s = slot_mapping.long()
    cap = state_cache.shape[0] * state_cache.shape[1]
    if int(s.max()) >= cap:
        raise ValueError(f"slot_mapping: slot {int(s.max())} is outside the ring state cache ({cap} rows)")
    m = min(n, token_to_req.shape[0])
    if m < n and bool((s[m:] >= 0).any()):
        raise ValueError(f"token_to_req_indices has {m} entries for the {n} tokens of slot_mapping, and a token "
                         "past them has a slot (only padding, slot < 0, may lie past them)")
    live = s[:m] >= 0
    if not bool(live.any()):
        return
    req = token_to_req[:m].long()[live]
    R = query_start_loc.shape[0] - 1
    if int(req.min()) < 0 or int(req.max()) >= R:
        raise ValueError(f"token_to_req_indices must name a request in [0, {R}) for every token with a slot")
    if int(positions[:m].long()[live].min()) < 0:
        raise ValueError("positions: a token with a slot has a negative position")
    qsl = query_start_loc.long()
    if bool((qsl[1:] < qsl[:-1]).any()):
        raise ValueError("query_start_loc must be non-decreasing")


def _kv_cache_records(kv_cache, kv_layout=None):
    """(block size, record format) of a paged compressed cache [nb, bs, R] or [nb, bs, 1, R]: R names the
    format as vLLM's op reads it (584 V40_584, 528 V41_528, 288 V41_FP4_288), in ``kv_layout``."""
    C.tensor("kv_cache", kv_cache, dtype=(torch.uint8, torch.float8_e4m3fn))
    if kv_cache.dim() not in (3, 4) or (kv_cache.dim() == 4 and kv_cache.shape[2] != 1):
        raise ValueError(f"kv_cache must be the paged compressed cache [num_blocks, block_size, record bytes] (or "
                         f"[nb, bs, 1, record bytes]), got shape {tuple(kv_cache.shape)}")
    rec = kv_cache.shape[-1]
    fmt = L.with_layout(L.format_for_token_bytes(rec, "kv_cache"), kv_layout)
    bs = kv_cache.shape[1]
    if bs < 1 or kv_cache.stride(-1) != 1 or (bs > 1 and kv_cache.stride(1) != rec):
        raise ValueError(f"kv_cache records must be dense, got shape {tuple(kv_cache.shape)} stride "
                         f"{kv_cache.stride()}")
    if kv_cache.shape[0] > 1 and (kv_cache.stride(0) < bs * rec or kv_cache.stride(0) % 16):
        raise ValueError(f"kv_cache page stride {kv_cache.stride(0)} must hold the page's {bs * rec} record bytes "
                         "and be a multiple of 16")
    return bs, fmt


def _plain_rows(kv_cache):
    """The plain-row view [nb, bs, 512] of a plain-row cache [nb, bs, 512] (or [nb, bs, 1, 512]): unit last
    stride, rows that do not overlap, strides and start 16-byte aligned."""
    if kv_cache.dim() not in (3, 4) or (kv_cache.dim() == 4 and kv_cache.shape[2] != 1):
        raise ValueError(f"kv_cache must be the plain-row cache [num_blocks, block_size, {D}] (or "
                         f"[nb, bs, 1, {D}]), got shape {tuple(kv_cache.shape)}")
    if kv_cache.shape[-1] != D:
        raise ValueError(f"kv_cache: a plain-row cache has {D}-value rows, got shape {tuple(kv_cache.shape)}")
    rows = kv_cache[:, :, 0] if kv_cache.dim() == 4 else kv_cache
    nb, bs = rows.shape[0], rows.shape[1]
    if bs < 1 or rows.stride(2) != 1 or (bs > 1 and rows.stride(1) < D) or (
            nb > 1 and rows.stride(0) < bs * rows.stride(1)):
        raise ValueError(f"kv_cache rows must be dense {D}-value rows that do not overlap, got shape "
                         f"{tuple(kv_cache.shape)} stride {kv_cache.stride()}")
    size = rows.element_size()
    if (rows.stride(0) * size) % 16 or (rows.stride(1) * size) % 16 or (rows.storage_offset() * size) % 16:
        raise ValueError(f"kv_cache strides and start must be multiples of 16 bytes, got stride {kv_cache.stride()}")
    return rows


def _fp8_scale(fp8_scale):
    """The per-tensor scale of a plain fp8 row cache: one fp32 value, finite and positive (value checks)."""
    if fp8_scale is None:
        raise ValueError("fp8_scale is required with a float8_e4m3fn plain-row kv_cache (its per-tensor scale)")
    C.tensor("fp8_scale", fp8_scale, dtype=torch.float32)
    if fp8_scale.numel() != 1:
        raise ValueError(f"fp8_scale must hold one fp32 value, got shape {tuple(fp8_scale.shape)}")
    if value_checks(fp8_scale) and not (bool(torch.isfinite(fp8_scale).all()) and float(fp8_scale.reshape(())) > 0):
        raise ValueError(f"fp8_scale must be a finite positive scale, got {float(fp8_scale.reshape(()))}")


def rope_quant_insert(latent, positions, cos_sin_cache, kv_cache, slot_mapping, compress_ratio,
                      fp8_scale=None, *, kv_layout: str = None) -> None:
    """latent bf16 [T, 512] contiguous, positions int [>= n], cos_sin_cache fp32 or bf16 [P, 64], kv_cache the
    compressed cache, slot_mapping int [n] (negative = padding): the entry of each group-closing token
    (reference.compressor_v41). The cache picks the form, as vLLM's op does:

    - the paged record cache, uint8 [nb, bs, R] (or its float8_e4m3fn view), R = 584, 528 or 288 naming the
      record format as vLLM's op reads it (``kv_layout`` the V4.1 records' page layout, default
      ``layout.default_layout``: interleaved, as vLLM 0.33 writes them); ``fp8_scale`` must be None;
    - plain [448 NoPE | 64 RoPE] rows [nb, bs, 512] (vLLM's FlashInfer caches): bfloat16, ``fp8_scale`` None;
      or float8_e4m3fn with the per-tensor ``fp8_scale`` fp32 [1] (required)."""
    _ratio(compress_ratio)
    C.tensor("latent", latent, dtype=torch.bfloat16, shape=(None, D), contiguous=True)
    n = C.tensor("slot_mapping", slot_mapping, dtype=C.INDEX, dim=1).shape[0]
    if n > latent.shape[0]:
        raise ValueError(f"slot_mapping has {n} entries for the {latent.shape[0]} rows of latent")
    if n > 1 and slot_mapping.stride(0) != 1:
        raise ValueError("slot_mapping must be contiguous")
    _token_vector("positions", positions, n)
    C.tensor("cos_sin_cache", cos_sin_cache, dtype=(torch.float32, torch.bfloat16), shape=(None, 64))
    if cos_sin_cache.stride(1) != 1:
        raise ValueError("cos_sin_cache rows must be contiguous")
    C.tensor("kv_cache", kv_cache, dtype=(torch.uint8, torch.float8_e4m3fn, torch.bfloat16))
    plain = kv_cache.dtype == torch.bfloat16 or (kv_cache.dtype == torch.float8_e4m3fn and kv_cache.shape[-1] == D)
    if plain:
        if kv_layout is not None:
            raise ValueError("kv_layout: a plain-row kv_cache has no record layout")
        if kv_cache.dtype == torch.float8_e4m3fn:
            _fp8_scale(fp8_scale)
        elif fp8_scale is not None:
            raise ValueError("fp8_scale: only a float8_e4m3fn plain-row kv_cache takes a per-tensor scale")
        cache, fmt = _plain_rows(kv_cache), None
        bs = cache.shape[1]
    else:
        if fp8_scale is not None:
            raise ValueError("fp8_scale: the paged record cache carries its own block scales (only a "
                             "float8_e4m3fn plain-row kv_cache takes a per-tensor scale)")
        bs, fmt = _kv_cache_records(kv_cache, kv_layout)
        cache = kv_cache
    C.same_device(latent=latent, positions=positions, cos_sin_cache=cos_sin_cache, kv_cache=kv_cache,
                  slot_mapping=slot_mapping, fp8_scale=fp8_scale)
    if value_checks(slot_mapping) and n:
        check_record_slots(slot_mapping, positions, n, kv_cache.shape[0] * bs, cos_sin_cache.shape[0])
    if n == 0:
        return
    _run("rope_quant_insert", latent.device, latent, positions, cos_sin_cache, cache, slot_mapping, compress_ratio,
         fp8_scale, fmt=fmt)


def check_record_slots(slot_mapping, positions, n, capacity, cs_rows):
    """Value checks of a record writer: slots inside the cache, positions of live tokens in the RoPE table."""
    s = slot_mapping[:n].long()
    if int(s.max()) >= capacity:
        raise ValueError(f"slot_mapping: slot {int(s.max())} is outside the cache ({capacity} slots)")
    p = positions[:n].long()[s >= 0]
    if p.numel() and (int(p.min()) < 0 or int(p.max()) >= cs_rows):
        raise ValueError(f"positions must lie in [0, {cs_rows}) (rows of cos_sin_cache) for tokens with a slot")
