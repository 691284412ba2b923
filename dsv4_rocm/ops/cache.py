"""The KV cache ops in vLLM's call forms: write K records, read them back as bf16.

Record formats (``dsv4_rocm.layout``): the writer takes vLLM's ``bytes_per_token`` (584: V40_584, 528:
V41_528); the readers name the format by the cache's last dimension, as vLLM's do (584, 528, or 288:
V41_FP4_288), or for a 2-D page view by the one format its rows fit. Every op takes ``kv_layout``
("page_split" or "interleaved"; default None, ``layout.default_layout``: the V4.1 records interleaved as vLLM 0.33
and FlashMLA DS-0930 lay them out, V40_584 page-split) as a keyword.

Caches are accepted in every view vLLM holds (``dsv4_rocm.cache_views``); index tensors are int32 or
int64. Bad input is a ValueError naming the argument before anything is written (docs/conventions.md).

``use_fnuz=True`` writes / reads the FNUZ flavour of the record (``layout.with_fnuz`` of the format), byte
for byte as vLLM's gfx942 path does for its sliding-window cache (docs/cache_format.md#fnuz-flavour): a
flavour of the e4m3 formats (V40_584, V41_528), refused for a V41_FP4_288 cache; it is accepted on every device,
so a cache written by vLLM on an MI300 can be read anywhere. The default (``False``) is dsv4_rocm's own
OCP flavour on every vendor. ``is_ue8m0=False`` is rejected: no other scale encoding exists (in vLLM
either).
"""
import torch

from .. import _checks as C
from .. import cache_views as V
from .. import layout as L
from .. import hip_ops as _hip    # builds dsv4_rocm._C on a kernel's first call, not on import
from ..reference import cache as _rc
from ._dispatch import register, run as _run, value_checks

__all__ = ["quantize_and_insert_k_cache", "dequantize_and_gather_k_cache", "dequantize_global_slots_k_cache"]

register("quantize_and_insert_k_cache", _rc.quantize_and_insert_k_cache, hip=_hip.quantize_and_insert_k_cache)
register("dequantize_and_gather_k_cache", _rc.dequantize_and_gather_k_cache, hip=_hip.dequantize_and_gather_k_cache)
register("dequantize_global_slots_k_cache", _rc.dequantize_global_slots_k_cache,
         hip=_hip.dequantize_global_slots_k_cache)


def encoding_flags(is_ue8m0=True, use_fnuz=False):
    if is_ue8m0 is not True:
        raise ValueError(f"is_ue8m0={is_ue8m0!r}: the fp8_ds_mla cache stores UE8M0 (power-of-two) scales "
                         "only; no other scale encoding is implemented")
    L.with_fnuz(L.V40_584, use_fnuz)          # the flag's check


WRITER_FORMATS = {f.token_bytes: f for f in (L.V40_584, L.V41_528)}


def _writer_format(bytes_per_token, k_cache, kv_layout, use_fnuz=False):
    """The record format vLLM's ``bytes_per_token`` names (584 or 528) in the flavour ``use_fnuz`` names,
    checked against the cache's view."""
    if isinstance(bytes_per_token, bool) or bytes_per_token not in WRITER_FORMATS:
        raise ValueError(f"bytes_per_token must be 584 (V40_584) or 528 (V41_528), got {bytes_per_token!r} (the "
                         "288 B V41_FP4_288 records are written by compress_norm_rope_store)")
    fmt = L.with_fnuz(L.with_layout(WRITER_FORMATS[bytes_per_token], kv_layout), use_fnuz)
    if isinstance(k_cache, torch.Tensor) and k_cache.dim() in (3, 4) and k_cache.shape[-1] != bytes_per_token:
        raise ValueError(f"k_cache: records of {k_cache.shape[-1]} B, but bytes_per_token is {bytes_per_token}")
    return fmt


def cache_format(k_cache, block_size, kv_layout=None, use_fnuz=False):
    """The record format of a cache the readers are given (``cache_views.detect_format``), in the flavour
    ``use_fnuz`` names."""
    return L.with_fnuz(V.detect_format(k_cache, block_size, "k_cache", kv_layout), use_fnuz)


def quantize_and_insert_k_cache(k, k_cache, slot_mapping, block_size: int = 64, is_ue8m0: bool = True,
                                use_fnuz: bool = False, bytes_per_token: int = 584, *,
                                kv_layout: str = None) -> None:
    """k bf16 [T, 512] (RoPE applied) -> UE8M0 records of ``bytes_per_token`` (584: V40_584, 528: V41_528) at
    slot_mapping[:n] (n = len(slot_mapping) <= T; vLLM passes fewer slots than rows under DP padding). A
    slot < 0 is padding. ``use_fnuz``: records of the FNUZ flavour (``layout.with_fnuz``)."""
    C.tensor("k", k, dtype=torch.bfloat16, shape=(None, L.HEAD_DIM))
    encoding_flags(is_ue8m0, use_fnuz)
    C.positive_int("block_size", block_size)
    fmt = _writer_format(bytes_per_token, k_cache, kv_layout, use_fnuz)
    pages = V.pages(k_cache, block_size, "k_cache", fmt)
    C.tensor("slot_mapping", slot_mapping, dtype=C.INDEX, dim=1)
    if slot_mapping.shape[0] > k.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {k.shape[0]} tokens")
    C.same_device(k=k, k_cache=k_cache, slot_mapping=slot_mapping)
    C.slots_inside("slot_mapping", slot_mapping, V.capacity(pages, block_size),
                   f"({pages.shape[0]} pages x {block_size})")
    _run("quantize_and_insert_k_cache", k.device, k, k_cache, slot_mapping, block_size, fmt=fmt)


def _check_gather_lengths(out, pages, seq_lens, gather_lens, block_table, block_size, offset):
    """Value checks of dequantize_and_gather_k_cache: every row it would gather exists."""
    if not value_checks(seq_lens) or seq_lens.numel() == 0:
        return
    seq = seq_lens.long()
    if int(seq.min()) < 0:
        raise ValueError(f"seq_lens must be >= 0, got {int(seq.min())}")
    gl = seq if gather_lens is None else gather_lens.long()
    if gather_lens is not None and bool(((gl < 0) | (gl > seq)).any()):
        raise ValueError("gather_lens must lie in [0, seq_lens]")
    if offset + int(gl.max()) > out.shape[1]:
        raise ValueError(f"offset {offset} + gather_lens {int(gl.max())} exceeds the {out.shape[1]} rows of out")
    written, slot = _rc.gather_rows_and_slots(seq_lens, gather_lens, block_table, block_size, offset, out.shape[1])
    if bool((written & (slot < 0)).any()):
        raise ValueError(f"block_table does not cover the gathered positions (a column past its {block_table.shape[1]} "
                         "columns, or a negative entry)")
    if bool((slot >= V.capacity(pages, block_size)).any()):
        raise ValueError(f"block_table names a page >= {pages.shape[0]} (the pages of k_cache)")


def dequantize_and_gather_k_cache(out, k_cache, seq_lens, gather_lens, block_table, block_size: int, offset: int,
                                  use_fnuz: bool = False, max_gather_len: int = None, *,
                                  kv_layout: str = None) -> None:
    """vLLM's op: for request b and i < gather_lens[b] (seq_lens[b] when gather_lens is None),
    ``out[b, offset + i]`` = bf16 K of request b's token at position ``seq_lens[b] - gather_lens[b] + i``,
    read through ``block_table[b]`` (exact: the dequantized values are bf16). Other rows of out are not
    written. out bf16 [R, M, 512]; seq_lens, gather_lens [R]; block_table [R, max_blocks]. ``use_fnuz``
    must say which flavour the cache holds (as in vLLM: its sliding-window cache is FNUZ on gfx942, its
    compressed cache OCP). ``max_gather_len`` (None or an int >= 0; vLLM 0.33's DeepSeek-V4.1 form) is
    vLLM's host-side estimate of the longest gather, which sizes its kernel's grid and nothing else: what is
    written does not depend on it, here as there (the grids here follow the tensors' shapes)."""
    encoding_flags(True, use_fnuz)
    if max_gather_len is not None and (not isinstance(max_gather_len, int) or isinstance(max_gather_len, bool)
                                       or max_gather_len < 0):
        raise ValueError(f"max_gather_len must be None or an int >= 0, got {max_gather_len!r}")
    C.tensor("seq_lens", seq_lens, dtype=C.INDEX, dim=1)
    R = seq_lens.shape[0]
    C.no_overlap("out", C.tensor("out", out, dtype=torch.bfloat16, shape=(R, None, L.HEAD_DIM)))
    if gather_lens is not None:
        C.tensor("gather_lens", gather_lens, dtype=C.INDEX, shape=(R,))
    C.tensor("block_table", block_table, dtype=C.INDEX, shape=(R, None))
    C.positive_int("block_size", block_size)
    if not isinstance(offset, int) or isinstance(offset, bool) or not 0 <= offset <= out.shape[1]:
        raise ValueError(f"offset must be an int in [0, {out.shape[1]}] (rows of out), got {offset!r}")
    fmt = cache_format(k_cache, block_size, kv_layout, use_fnuz)
    pages = V.pages(k_cache, block_size, "k_cache", fmt)
    C.same_device(out=out, k_cache=k_cache, seq_lens=seq_lens, gather_lens=gather_lens, block_table=block_table)
    _check_gather_lengths(out, pages, seq_lens, gather_lens, block_table, block_size, offset)
    _run("dequantize_and_gather_k_cache", out.device, out, k_cache, seq_lens, gather_lens, block_table, block_size,
         offset, fmt=fmt)


def dequantize_global_slots_k_cache(out, k_cache, slot_ids, block_size: int, *,
                                    kv_layout: str = None) -> None:
    """``out[n, k]`` = bf16 K at cache slot ``slot_ids[n, k]`` (exact); a slot < 0 gives a zero row.
    out bf16 [N, K, 512] (any strides with a unit last one, as vLLM's column slices of a workspace),
    slot_ids int32/int64 [N, K], or [N, 1, K] (the FlashMLA index form vLLM's MTP decode passes); also
    [N, 512] with [N]."""
    C.tensor("slot_ids", slot_ids, dtype=C.INDEX)
    if slot_ids.dim() == 3 and slot_ids.shape[1] == 1:
        slot_ids = slot_ids[:, 0]
    if slot_ids.dim() not in (1, 2):
        raise ValueError(f"slot_ids must be [N], [N, K] or [N, 1, K], got shape {tuple(slot_ids.shape)}")
    C.no_overlap("out", C.tensor("out", out, dtype=torch.bfloat16, shape=(*slot_ids.shape, L.HEAD_DIM)))
    C.positive_int("block_size", block_size)
    fmt = cache_format(k_cache, block_size, kv_layout)
    pages = V.pages(k_cache, block_size, "k_cache", fmt)
    C.same_device(out=out, k_cache=k_cache, slot_ids=slot_ids)
    C.slots_inside("slot_ids", slot_ids, V.capacity(pages, block_size), f"({pages.shape[0]} pages x {block_size})")
    _run("dequantize_global_slots_k_cache", out.device, out, k_cache, slot_ids, block_size, fmt=fmt)

