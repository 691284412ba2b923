"""DeepSeek-V4.1 indexer ops: vLLM's ``indexer_k_norm_rope_store`` (k_norm -> RoPE -> FP8 / MXFP4 ->
paged indexer-K cache), and the two-level selection: ``select_candidate_blocks`` (the candidate source's
blocks) and ``mask_candidate_logits`` (a later index source's logits restricted to them). The math is
in ``dsv4_rocm.reference.indexer_v41``; bad input is a ValueError naming the argument before anything is
written, value checks follow ``value_checks`` (docs/conventions.md).
"""
import torch

from .. import _checks as C
from ..reference import indexer_v41 as _ri
from ._dispatch import HAVE_TRITON, register, run as _run, value_checks
from .compressor_v41 import check_record_slots

__all__ = ["indexer_k_norm_rope_store", "select_candidate_blocks", "mask_candidate_logits"]

if HAVE_TRITON:     # importing a kernel imports Triton, which is optional: without it the ops run their oracles
    from ..triton.indexer.indexer_k_norm_rope_store import indexer_k_norm_rope_store as _triton_k_store
    from ..triton.indexer.mask_candidate_logits import mask_candidate_logits as _triton_mask
    from ..triton.indexer.select_candidate_blocks import select_candidate_blocks as _triton_select
else:
    _triton_k_store = _triton_mask = _triton_select = None
register("indexer_k_norm_rope_store", _ri.indexer_k_norm_rope_store, triton=_triton_k_store)
register("select_candidate_blocks", _ri.select_candidate_blocks, triton=_triton_select)
register("mask_candidate_logits", _ri.mask_candidate_logits, triton=_triton_mask)

MAX_CANDIDATE_BLOCKS = 4096     # the kernels hold a row's candidate list in registers


def _indexer_cache(k_cache, use_fp4_cache):
    data, scale = _ri.record_layout(use_fp4_cache)
    rec = data + scale
    C.tensor("k_cache", k_cache, dtype=(torch.uint8, torch.float8_e4m3fn))
    if k_cache.dim() not in (3, 4) or (k_cache.dim() == 4 and k_cache.shape[2] != 1) or k_cache.shape[-1] != rec:
        raise ValueError(f"k_cache must be the paged indexer-K cache [num_blocks, block_size, {rec}] (or [nb, bs, 1, "
                         f"{rec}]) for use_fp4_cache={use_fp4_cache}, got shape {tuple(k_cache.shape)}")
    bs = k_cache.shape[1]
    if bs < 1 or k_cache.stride(-1) != 1 or (bs > 1 and k_cache.stride(1) != rec):
        raise ValueError(f"k_cache records must be dense, got stride {k_cache.stride()}")
    if k_cache.shape[0] > 1 and (k_cache.stride(0) < bs * rec or k_cache.stride(0) % 16):
        raise ValueError(f"k_cache page stride {k_cache.stride(0)} must hold the page's {bs * rec} record bytes and "
                         "be a multiple of 16")
    return bs


def indexer_k_norm_rope_store(k_pre, positions, cos_sin_cache, rms_norm_weight, rms_norm_eps, k_cache,
                              kv_slot_mapping, compress_ratio, use_fp4_cache, mxfp4_n_per_tile=0) -> None:
    """k_pre bf16 [T, 128] (unit inner stride), positions int [>= n], cos_sin_cache fp32 or bf16 [P, 64],
    rms_norm_weight [128], k_cache uint8 [nb, bs, 132] (FP8) or [nb, bs, 68] (MXFP4), kv_slot_mapping int
    [n] (negative = padding): the index keys of the group-closing tokens (reference.indexer_v41).
    ``mxfp4_n_per_tile`` selects vLLM's ROCm-tiled MXFP4 layout; dsv4_rocm's cache is row-major on every
    vendor, so it must be 0."""
    if compress_ratio not in (1, 2) or isinstance(compress_ratio, bool):
        raise ValueError(f"compress_ratio must be 1 or 2 (DeepSeek-V4.1), got {compress_ratio!r}")
    if not isinstance(use_fp4_cache, bool):
        raise ValueError(f"use_fp4_cache must be a bool, got {use_fp4_cache!r}")
    if mxfp4_n_per_tile != 0:
        raise ValueError("mxfp4_n_per_tile: the tiled ROCm MXFP4 layout is not used (the indexer-K cache is "
                         "row-major on every vendor); pass 0")
    C.tensor("k_pre", k_pre, dtype=torch.bfloat16, shape=(None, _ri.INDEX_DIM))
    if k_pre.shape[0] > 1 and k_pre.stride(1) != 1:
        raise ValueError("k_pre rows must be contiguous")
    n = C.tensor("kv_slot_mapping", kv_slot_mapping, dtype=C.INDEX, dim=1).shape[0]
    if n > k_pre.shape[0]:
        raise ValueError(f"kv_slot_mapping has {n} entries for the {k_pre.shape[0]} rows of k_pre")
    if n > 1 and kv_slot_mapping.stride(0) != 1:
        raise ValueError("kv_slot_mapping must be contiguous")
    C.tensor("positions", positions, dtype=C.INDEX, dim=1)
    if positions.shape[0] < n or (positions.shape[0] > 1 and positions.stride(0) != 1):
        raise ValueError(f"positions must be a contiguous tensor of at least {n} entries")
    C.tensor("cos_sin_cache", cos_sin_cache, dtype=(torch.float32, torch.bfloat16), shape=(None, 64))
    if cos_sin_cache.stride(1) != 1:
        raise ValueError("cos_sin_cache rows must be contiguous")
    C.tensor("rms_norm_weight", rms_norm_weight, dtype=(torch.bfloat16, torch.float32), shape=(_ri.INDEX_DIM,))
    C.finite_float("rms_norm_eps", rms_norm_eps, minimum=0.0)
    bs = _indexer_cache(k_cache, use_fp4_cache)
    C.same_device(k_pre=k_pre, positions=positions, cos_sin_cache=cos_sin_cache, rms_norm_weight=rms_norm_weight,
                  k_cache=k_cache, kv_slot_mapping=kv_slot_mapping)
    if value_checks(kv_slot_mapping) and n:
        check_record_slots(kv_slot_mapping, positions, n, k_cache.shape[0] * bs, cos_sin_cache.shape[0])
    if n == 0:
        return
    _run("indexer_k_norm_rope_store", k_pre.device, k_pre, positions, cos_sin_cache, rms_norm_weight,
         float(rms_norm_eps), k_cache, kv_slot_mapping, compress_ratio, use_fp4_cache)


def _candidates(logits, lens, candidate_blocks, block_size):
    C.tensor("logits", logits, dtype=torch.float32, dim=2)
    if logits.shape[1] > 1 and logits.stride(1) != 1:
        raise ValueError(f"logits rows must be contiguous, got strides {logits.stride()}")
    C.tensor("candidate_blocks", candidate_blocks, dtype=torch.int32, dim=2)
    rows, nc = candidate_blocks.shape
    if not 1 <= nc <= MAX_CANDIDATE_BLOCKS or (rows > 1 and candidate_blocks.stride(1) != 1):
        raise ValueError(f"candidate_blocks must hold 1 to {MAX_CANDIDATE_BLOCKS} contiguous blocks a row, got shape "
                         f"{tuple(candidate_blocks.shape)} stride {candidate_blocks.stride()}")
    if rows > logits.shape[0]:
        raise ValueError(f"candidate_blocks has {rows} rows, logits only {logits.shape[0]}")
    C.tensor("lens", lens, dtype=C.INDEX, dim=1)
    if lens.shape[0] < rows or (lens.shape[0] > 1 and lens.stride(0) != 1):
        raise ValueError(f"lens must be a contiguous tensor of at least {rows} entries")
    C.positive_int("block_size", block_size)
    C.same_device(logits=logits, lens=lens, candidate_blocks=candidate_blocks)
    return rows


def select_candidate_blocks(logits, lens, candidate_blocks, block_size: int) -> None:
    """logits fp32 [rows', cols] (row r sees entries [0, lens[r]), clamped into [0, cols]), lens int [>= rows],
    candidate_blocks int32 [rows, C] written: the candidate blocks of each row (reference.indexer_v41)."""
    rows = _candidates(logits, lens, candidate_blocks, block_size)
    if rows:
        _run("select_candidate_blocks", logits.device, logits, lens, candidate_blocks, block_size)


def mask_candidate_logits(logits, lens, candidate_blocks, block_size: int) -> None:
    """In place on logits fp32 [rows', cols]: entries [0, lens[r]) of row r < rows outside the blocks of
    candidate_blocks[r] become -inf. candidate_blocks rows must hold ascending block ids, then -1 (as
    select_candidate_blocks writes them)."""
    rows = _candidates(logits, lens, candidate_blocks, block_size)
    if value_checks(candidate_blocks) and rows:
        b = candidate_blocks.long()
        valid = b >= 0
        if bool((valid[:, 1:] & ~valid[:, :-1]).any()) or bool(((b[:, 1:] <= b[:, :-1]) & valid[:, 1:]).any()):
            raise ValueError("candidate_blocks rows must be strictly ascending block ids followed by -1")
    if rows:
        _run("mask_candidate_logits", logits.device, logits, lens, candidate_blocks, block_size)
