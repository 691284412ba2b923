"""Index metadata of a serving step in vLLM's call forms: compressed slot mapping, SWA windows, prefill
gather lengths, C4 global top-k slots, C128A index sets, combined prefill indices.

Semantics: ``dsv4_rocm/reference/metadata.py`` (the oracle). Structure is checked always; the values that
describe the batch (a monotone ``query_start_loc``, sequences at least as long as their queries, the
tokens and workspace rows given) where ``value_checks`` says so; a rejected call writes nothing
(docs/conventions.md). A lookup that fails is padding, never an error, on every path (reference, Triton,
CPU, GPU, ``validation("full")``): a negative or out-of-range request id, position, block-table column,
page or local index, and a slot an int32 output cannot hold, give -1 entries that never count in a
length, never another request's rows (vLLM's bounds semantics).
"""
import inspect

import torch

from .. import _checks as C
from ..reference import metadata as _rm
from ._dispatch import HAVE_TRITON, register, run as _run, value_checks

__all__ = [
    "get_compressed_slot_mapping", "compute_swa_indices_and_lens", "compute_prefill_gather_lens",
    "compute_global_topk_indices_and_lens", "build_c128a_topk_metadata", "combine_topk_swa_indices"]

if HAVE_TRITON:     # importing a kernel imports Triton, which is optional: without it the ops run their oracles
    from ..triton.metadata.build_c128a_topk_metadata import build_c128a_topk_metadata as _triton_c128a
    from ..triton.metadata.combine_topk_swa_indices import combine_topk_swa_indices as _triton_combine
    from ..triton.metadata.compute_global_topk_indices_and_lens import \
        compute_global_topk_indices_and_lens as _triton_global_topk
    from ..triton.metadata.compute_prefill_gather_lens import compute_prefill_gather_lens as _triton_gather_lens
    from ..triton.metadata.compute_swa_indices_and_lens import compute_swa_indices_and_lens as _triton_swa
    from ..triton.metadata.get_compressed_slot_mapping import get_compressed_slot_mapping as _triton_slots
else:
    _triton_c128a = _triton_combine = _triton_global_topk = _triton_gather_lens = _triton_swa = _triton_slots = None
register("get_compressed_slot_mapping", _rm.get_compressed_slot_mapping, triton=_triton_slots)
register("compute_swa_indices_and_lens", _rm.compute_swa_indices_and_lens, triton=_triton_swa)
register("compute_prefill_gather_lens", _rm.compute_prefill_gather_lens, triton=_triton_gather_lens)
register("compute_global_topk_indices_and_lens", _rm.compute_global_topk_indices_and_lens, triton=_triton_global_topk)
register("build_c128a_topk_metadata", _rm.build_c128a_topk_metadata, triton=_triton_c128a)
register("combine_topk_swa_indices", _rm.combine_topk_swa_indices, triton=_triton_combine)

INT32_MAX = 2 ** 31 - 1


def _nonneg_int(name, v):
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    return v


def _vector(name, t, min_len, dtype=C.INDEX, written=False):
    """A 1-D tensor of at least ``min_len`` entries (``written``: an output, whose entries must not overlap)."""
    C.tensor(name, t, dtype=dtype, dim=1)
    if t.shape[0] < min_len:
        raise ValueError(f"{name} has {t.shape[0]} entries, needs at least {min_len}")
    if written:
        C.no_overlap(name, t)
    return _rows(name, t)


def _rows(name, t):
    """The kernels walk a row with unit steps: its last dim must be contiguous (any row stride)."""
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have contiguous rows (stride(-1) == 1), got strides {t.stride()}")
    return t


def _block_table(block_table):
    C.tensor("block_table", block_table, dtype=C.INDEX, dim=2)
    _rows("block_table", block_table)


def _check_batch(query_start_loc, seq_lens, num_reqs, num_tokens=None, base=False):
    """Value checks of a batch description: monotone query_start_loc (from its first entry when ``base``,
    else from 0), seq_lens >= query lens (no negative position), the tokens within ``num_tokens``."""
    if not value_checks(query_start_loc) or num_reqs == 0:
        return
    qsl = query_start_loc[:num_reqs + 1].long().cpu()
    sl = seq_lens[:num_reqs].long().cpu()
    if not base and int(qsl[0]) < 0:
        raise ValueError(f"query_start_loc[0] = {int(qsl[0])} is negative")
    ql = qsl[1:] - qsl[:-1]
    if bool((ql < 0).any()):
        raise ValueError("query_start_loc must be non-decreasing")
    if bool((sl < ql).any()):
        b = int(torch.nonzero(sl < ql)[0])
        raise ValueError(f"seq_lens[{b}] = {int(sl[b])} is below its query length {int(ql[b])} "
                         "(tokens at negative positions)")
    if num_tokens is not None and int(qsl[-1] - (qsl[0] if base else 0)) > num_tokens:
        raise ValueError(f"query_start_loc covers {int(qsl[-1] - (qsl[0] if base else 0))} tokens, "
                         f"more than the {num_tokens} given")


def _form_033(num_tokens, slot_mapping, query_start_loc, seq_lens, block_table, block_size, compress_ratio, out=None,
              dcp_world_size=1, cp_interleave=1):
    """vLLM 0.33's call form of get_compressed_slot_mapping (its parameters, for binding a call)."""


def _form_earlier(num_tokens, query_start_loc, seq_lens, block_table, block_size, compress_ratio, out=None,
                  cp_world_size=1, cp_rank=0, cp_kv_cache_interleave_size=1):
    """The earlier call form of get_compressed_slot_mapping (its parameters, for binding a call)."""


_FORMS = (("vLLM 0.33", inspect.signature(_form_033)), ("earlier vLLM", inspect.signature(_form_earlier)))


def _fits(a) -> str:
    """Why bound arguments are not a call of their form ('' when they are): block_table a tensor, the sizes
    ints."""
    if not isinstance(a.get("block_table"), torch.Tensor):
        return f"block_table is {type(a.get('block_table')).__name__}, not a tensor"
    for name in ("block_size", "compress_ratio"):
        if not isinstance(a.get(name), int) or isinstance(a.get(name), bool):
            return f"{name} is {a.get(name)!r}, not an int"
    return ""


_PARAMS = tuple((name, tuple(sig.parameters), {n: p.default for n, p in sig.parameters.items()
                                                if p.default is not inspect.Parameter.empty})
                for name, sig in _FORMS)


def _bind_positional(args, kwargs):
    """The binding of ``_bind_slot_mapping_call`` for the calls engines make, without inspect's cost (tens of
    microseconds): all positional but ``out``, at least up to compress_ratio. The fifth argument after
    num_tokens is block_table (a tensor) in 0.33's form, block_size (an int) in the earlier one."""
    if len(args) < 6 or (kwargs and (len(kwargs) > 1 or "out" not in kwargs)):
        return None
    (name, names, defaults) = _PARAMS[0] if isinstance(args[4], torch.Tensor) else _PARAMS[1]
    if len(args) > len(names) or (kwargs and "out" in names[:len(args)]):
        return None
    a = dict(defaults, **dict(zip(names, args)), **kwargs)
    return (name, a) if len(a) == len(names) and not _fits(a) else None


def _bind_slot_mapping_call(args, kwargs):
    """(form name, arguments with defaults) of a get_compressed_slot_mapping call. vLLM 0.33 put slot_mapping
    second, so a call is read in whichever of the two forms it fits: in the other one its block_table would be
    an int, a size a tensor, a parameter missing, doubled or unknown. No call fits both."""
    fast = _bind_positional(args, kwargs)
    if fast is not None:
        return fast
    fits, why = [], []
    for name, sig in _FORMS:
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as e:
            why.append(f"{name}: {e}")
            continue
        reason = _fits(bound.arguments)
        if reason:
            why.append(f"{name}: {reason}")
            continue
        bound.apply_defaults()
        fits.append((name, bound.arguments))
    if len(fits) != 1:
        raise ValueError("get_compressed_slot_mapping: the arguments are not a call of either of vLLM's forms "
                         f"(num_tokens, slot_mapping, query_start_loc, ...) or (num_tokens, query_start_loc, ...): "
                         + "; ".join(why))
    return fits[0]


def get_compressed_slot_mapping(*args, **kwargs) -> torch.Tensor:
    """int64 [num_tokens]: slot of compressed entry p // r for each token at position p with (p+1) % r == 0,
    -1 for the others (with ``out`` the whole buffer is reset to -1 and its first num_tokens entries
    returned). Both of vLLM's forms, positionally or by keyword (a call fits exactly one):

    * 0.33: ``(num_tokens, slot_mapping, query_start_loc, seq_lens, block_table, block_size, compress_ratio,
      out=None, dcp_world_size=1, cp_interleave=1)``: a token whose own ``slot_mapping`` entry is padding
      (-1, vLLM's PAD_SLOT_ID; a replayed token, or one another decode-context-parallel rank owns) writes
      nothing (any other value counts as the token's own slot); under DCP the
      rank-local position is compressed (dsv4_rocm.reference.metadata).
    * earlier: ``(num_tokens, query_start_loc, seq_lens, block_table, block_size, compress_ratio, out=None,
      cp_world_size=1, cp_rank=0, cp_kv_cache_interleave_size=1)``: CP distributes compressed entries.
    """
    form, a = _bind_slot_mapping_call(args, kwargs)
    num_tokens, query_start_loc, seq_lens, block_table, block_size, compress_ratio, out = (
        a["num_tokens"], a["query_start_loc"], a["seq_lens"], a["block_table"], a["block_size"], a["compress_ratio"],
        a["out"])
    new = form == "vLLM 0.33"
    slot_mapping = a["slot_mapping"] if new else None
    if new:
        world, rank, inter, names = a["dcp_world_size"], 0, a["cp_interleave"], ("dcp_world_size", "cp_interleave")
    else:
        world, rank, inter = a["cp_world_size"], a["cp_rank"], a["cp_kv_cache_interleave_size"]
        names = ("cp_world_size", "cp_kv_cache_interleave_size")
    _nonneg_int("num_tokens", num_tokens)
    C.positive_int("block_size", block_size)
    C.positive_int("compress_ratio", compress_ratio)
    C.positive_int(names[0], world)
    C.positive_int(names[1], inter)
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world:
        raise ValueError(f"cp_rank must be an int in [0, cp_world_size={world}), got {rank!r}")
    _block_table(block_table)
    R = block_table.shape[0]
    _vector("query_start_loc", query_start_loc, R + 1)
    _vector("seq_lens", seq_lens, R)
    if slot_mapping is not None:
        _vector("slot_mapping", slot_mapping, 0)
    if out is not None:
        _vector("out", out, num_tokens, dtype=torch.int64, written=True)
    C.same_device(query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table, out=out,
                  slot_mapping=slot_mapping)
    _check_batch(query_start_loc, seq_lens, R, num_tokens)
    return _run("get_compressed_slot_mapping", query_start_loc.device, num_tokens, query_start_loc, seq_lens,
                block_table, block_size, compress_ratio, out, world, rank, inter, slot_mapping=slot_mapping,
                cp_over_positions=new)


# what introspection shows (an engine comparing parameters, as vLLM's plugin guards and the engine tier do):
# vLLM 0.33's form, with the earlier form's context-parallel names after it
get_compressed_slot_mapping.__signature__ = inspect.Signature(
    list(inspect.signature(_form_033).parameters.values()) +
    [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d)
     for n, d in (("cp_world_size", 1), ("cp_rank", 0), ("cp_kv_cache_interleave_size", 1))])


def compute_swa_indices_and_lens(swa_indices, swa_lens, window_size: int, query_start_loc, seq_lens,
                                 token_to_req_indices, is_valid_token, block_table, block_size: int,
                                 token_offset: int = 0, num_tokens=None, *, needs_constant_topk: bool = False):
    """Slots of each token's sliding window (positions max(0, p-W+1)..p) into ``swa_indices`` ([n, W] or
    vLLM's [n, 1, W], int32) and their count into ``swa_lens``, for tokens token_offset + i, i < num_tokens
    (default: every row). Padding tokens (is_valid_token False) get lens 0 and a row of -1."""
    C.positive_int("window_size", window_size)
    C.positive_int("block_size", block_size)
    _nonneg_int("token_offset", token_offset)
    C.tensor("swa_indices", swa_indices, dtype=torch.int32)
    if swa_indices.dim() not in (2, 3) or (swa_indices.dim() == 3 and swa_indices.shape[1] != 1):
        raise ValueError(f"swa_indices must be [n, W] or [n, 1, W], got {tuple(swa_indices.shape)}")
    _rows("swa_indices", C.no_overlap("swa_indices", swa_indices))
    if swa_indices.shape[-1] != window_size:
        raise ValueError(f"swa_indices has {swa_indices.shape[-1]} columns for window_size {window_size}")
    n = swa_indices.shape[0] if num_tokens is None else _nonneg_int("num_tokens", num_tokens)
    if n > swa_indices.shape[0]:
        raise ValueError(f"num_tokens {n} exceeds the {swa_indices.shape[0]} rows of swa_indices")
    _vector("swa_lens", swa_lens, n, dtype=torch.int32, written=True)
    _block_table(block_table)
    R = _vector("seq_lens", seq_lens, 0).shape[0]
    _rows("query_start_loc", C.tensor("query_start_loc", query_start_loc, dtype=C.INDEX, shape=(R + 1,)))
    _vector("token_to_req_indices", token_to_req_indices, token_offset + n)
    _vector("is_valid_token", is_valid_token, token_offset + n, dtype=(torch.bool, *C.INDEX))
    C.same_device(swa_indices=swa_indices, swa_lens=swa_lens, query_start_loc=query_start_loc, seq_lens=seq_lens,
                  token_to_req_indices=token_to_req_indices, is_valid_token=is_valid_token, block_table=block_table)
    _check_batch(query_start_loc, seq_lens, R)
    return _run("compute_swa_indices_and_lens", swa_indices.device, swa_indices, swa_lens, window_size,
                query_start_loc, seq_lens, token_to_req_indices, is_valid_token, block_table, block_size, token_offset,
                n, needs_constant_topk=needs_constant_topk)


def compute_prefill_gather_lens(prefill_gather_lens, seq_lens, query_start_loc, num_prefills: int,
                                num_decodes: int, window_size: int) -> torch.Tensor:
    """gather_len = query_len + min(prefix_len, W - 1) of requests num_decodes .. num_decodes + num_prefills - 1
    into ``prefill_gather_lens[:num_prefills]`` (int32), returned."""
    _nonneg_int("num_prefills", num_prefills)
    _nonneg_int("num_decodes", num_decodes)
    C.positive_int("window_size", window_size)
    _vector("prefill_gather_lens", prefill_gather_lens, num_prefills, dtype=torch.int32, written=True)
    _vector("seq_lens", seq_lens, num_decodes + num_prefills)
    _vector("query_start_loc", query_start_loc, num_decodes + num_prefills + 1)
    C.same_device(prefill_gather_lens=prefill_gather_lens, seq_lens=seq_lens, query_start_loc=query_start_loc)
    _check_batch(query_start_loc, seq_lens, num_decodes + num_prefills)
    return _run("compute_prefill_gather_lens", seq_lens.device, prefill_gather_lens, seq_lens, query_start_loc,
                num_prefills, num_decodes, window_size)


def compute_global_topk_indices_and_lens(topk_indices, token_to_req_indices, block_table, block_size: int,
                                         is_valid_token, output_buffers=None, *, needs_constant_topk: bool = False):
    """C4 decode: local top-k indices [T, k] -> compressed-cache slots (valid ones first, -1 after) and
    their counts (int32 [T], 0 for padding tokens)."""
    check_global_topk_args(topk_indices, token_to_req_indices, block_table, block_size, is_valid_token,
                           output_buffers)
    return _run("compute_global_topk_indices_and_lens", topk_indices.device, topk_indices, token_to_req_indices,
                block_table, block_size, is_valid_token, output_buffers, needs_constant_topk=needs_constant_topk)


def check_global_topk_args(topk_indices, token_to_req_indices, block_table, block_size, is_valid_token,
                           output_buffers, name="topk_indices"):
    """The argument checks of ``compute_global_topk_indices_and_lens`` (also those of the fused
    ``top_k_global_decode``, whose topk_indices are its out_idx rows: ``name``)."""
    C.tensor(name, topk_indices, dtype=C.INDEX, dim=2)
    _rows(name, topk_indices)
    T, K = topk_indices.shape
    C.positive_int("block_size", block_size)
    _vector("token_to_req_indices", token_to_req_indices, T)
    _vector("is_valid_token", is_valid_token, T, dtype=(torch.bool, *C.INDEX))
    _block_table(block_table)
    out = lens = None
    if output_buffers is not None:
        if not isinstance(output_buffers, (tuple, list)) or len(output_buffers) != 2:
            raise ValueError("output_buffers must be a pair (global_topk_indices, topk_lens)")
        out, lens = output_buffers
        C.no_overlap("output_buffers[0]", _rows("output_buffers[0]", C.tensor(
            "output_buffers[0]", out, dtype=topk_indices.dtype, shape=(T, K))))
        C.no_overlap("output_buffers[1]", C.tensor("output_buffers[1]", lens, dtype=torch.int32, shape=(T,)))
    C.same_device(topk_indices=topk_indices, token_to_req_indices=token_to_req_indices, block_table=block_table,
                  is_valid_token=is_valid_token, output_buffers=out, topk_lens=lens)


def build_c128a_topk_metadata(positions, compress_ratio: int, num_decode_tokens: int, token_to_req_indices,
                              block_table, block_size: int, slot_mapping, global_decode_buffer, decode_lens_buffer,
                              prefill_buffer, max_compressed_tokens: int = 8192, *, max_seq_len=None,
                              needs_constant_topk: bool = False):
    """C128A index sets of the step (the first num_decode_tokens tokens decode, the rest prefill) into the
    caller's buffers; returns their slices (global decode slots, decode lens, prefill local indices)."""
    C.tensor("positions", positions, dtype=C.INDEX, dim=1)
    T = positions.shape[0]
    C.positive_int("compress_ratio", compress_ratio)
    _nonneg_int("num_decode_tokens", num_decode_tokens)
    if num_decode_tokens > T:
        raise ValueError(f"num_decode_tokens {num_decode_tokens} exceeds the {T} positions")
    nd, npf = num_decode_tokens, T - num_decode_tokens
    C.positive_int("block_size", block_size)
    C.positive_int("max_compressed_tokens", max_compressed_tokens)
    if max_seq_len is not None:
        _nonneg_int("max_seq_len", max_seq_len)
    _vector("token_to_req_indices", token_to_req_indices, nd)
    _vector("slot_mapping", slot_mapping, nd)
    _block_table(block_table)
    C.tensor("decode_lens_buffer", decode_lens_buffer, dtype=torch.int32, dim=1)
    for name, buf, rows in (("global_decode_buffer", global_decode_buffer, nd), ("prefill_buffer", prefill_buffer, npf),
                            ("decode_lens_buffer", decode_lens_buffer, nd)):
        C.no_overlap(name, C.tensor(name, buf, dtype=torch.int32))
        if buf.shape[0] < rows:
            raise ValueError(f"{name} has {buf.shape[0]} rows for {rows} tokens")
    for name, buf, rows in (("global_decode_buffer", global_decode_buffer, nd),
                            ("prefill_buffer", prefill_buffer, npf)):
        if buf.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(buf.shape)}")
        _rows(name, buf)
        if rows and buf.shape[1] < max_compressed_tokens:
            raise ValueError(f"max_compressed_tokens {max_compressed_tokens} exceeds the {buf.shape[1]} columns of "
                             f"{name} (rows would spill into the next row)")
    C.same_device(positions=positions, token_to_req_indices=token_to_req_indices, block_table=block_table,
                  slot_mapping=slot_mapping, global_decode_buffer=global_decode_buffer,
                  decode_lens_buffer=decode_lens_buffer, prefill_buffer=prefill_buffer)
    return _run("build_c128a_topk_metadata", positions.device, positions, compress_ratio, num_decode_tokens,
                token_to_req_indices, block_table, block_size, slot_mapping, global_decode_buffer, decode_lens_buffer,
                prefill_buffer, max_compressed_tokens, max_seq_len=max_seq_len, needs_constant_topk=needs_constant_topk)


def _visibility(left_visible, right_visible, T, window_size, max_image_tokens, topk_indices):
    """Checks of vLLM's in-image visibility arguments: both or neither, 1-D index tensors of >= T entries;
    where values are read, 0 <= left, 0 <= right and the window max(left, W - 1) + right + 1 within the
    W + max_image_tokens columns the row reserves for it."""
    if (left_visible is None) != (right_visible is None):
        raise ValueError("left_visible and right_visible must be given together")
    if left_visible is None:
        return
    for name, t in (("left_visible", left_visible), ("right_visible", right_visible)):
        _vector(name, t, T)
    C.same_device(topk_indices=topk_indices, left_visible=left_visible, right_visible=right_visible)
    if T and value_checks(left_visible):
        left, right = left_visible[:T].long(), right_visible[:T].long()
        if int(left.min()) < 0 or int(right.min()) < 0:
            raise ValueError("left_visible and right_visible must be >= 0")
        span = int((torch.clamp(left, min=window_size - 1) + right + 1).max())
        if span > window_size + max_image_tokens:
            raise ValueError(f"left_visible / right_visible give a window of {span} positions, more than "
                             f"window_size + max_image_tokens = {window_size + max_image_tokens}")


def combine_topk_swa_indices(topk_indices, query_start_loc, seq_lens, gather_lens, window_size: int,
                             compress_ratio: int, topk: int, M: int, N: int, out=None, left_visible=None,
                             right_visible=None, max_image_tokens: int = 0, *, combined_indices=None,
                             combined_lens=None):
    """Prefill indices of one chunk into its workspace: per token [compressed rows | window rows | -1],
    width round_up(topk + W + max_image_tokens, 128), and their lengths. Returns (indices int32 [T, width],
    lens int32 [T]). Output buffers in either of vLLM's forms: ``out=(indices, lens)`` (vLLM 0.33: every
    row of ``indices`` is reset, rows past T to -1, and the whole buffers are returned) or
    ``combined_indices=`` / ``combined_lens=`` (earlier vLLM: their first T rows are written and returned).
    ``left_visible`` / ``right_visible`` (int [T], vLLM 0.33's in-image bidirectional visibility) widen a
    token's window to the image positions it sees before and after it. No window reaches below the gathered
    rows (position seq_len - gather_len): vLLM's bounded SWA replay passes gather_lens that stop at the
    request's replay start (dsv4_rocm.reference.metadata)."""
    C.tensor("topk_indices", topk_indices, dtype=C.INDEX, dim=2)
    _rows("topk_indices", topk_indices)
    T, K = topk_indices.shape
    C.positive_int("window_size", window_size)
    C.positive_int("compress_ratio", compress_ratio)
    _nonneg_int("topk", topk)
    _nonneg_int("N", N)
    C.positive_int("M", M)
    _nonneg_int("max_image_tokens", max_image_tokens)
    if topk > K:
        raise ValueError(f"topk {topk} exceeds the {K} columns of topk_indices")
    if N >= M:
        raise ValueError(f"N ({N} compressed rows) must be below M ({M} workspace rows per request)")
    if out is not None:
        if combined_indices is not None or combined_lens is not None:
            raise ValueError("give the output buffers as out=(indices, lens) or as combined_indices= / "
                             "combined_lens=, not both")
        if not (isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(o, torch.Tensor) for o in out)):
            raise ValueError("out must be the pair (combined_indices, combined_lens) of tensors")
        combined_indices, combined_lens = out
        if combined_indices.data_ptr() == combined_lens.data_ptr():
            raise ValueError("out: combined_indices and combined_lens must be two buffers")
    _rows("seq_lens", C.tensor("seq_lens", seq_lens, dtype=C.INDEX, dim=1))
    R = seq_lens.shape[0]
    _rows("query_start_loc", C.tensor("query_start_loc", query_start_loc, dtype=C.INDEX, shape=(R + 1,)))
    _rows("gather_lens", C.tensor("gather_lens", gather_lens, dtype=C.INDEX, shape=(R,)))
    if R * M > INT32_MAX:
        raise ValueError(f"{R} requests x M = {M} workspace rows do not fit int32 indices")
    width = _rm.combined_width(topk, window_size, max_image_tokens)
    if combined_indices is not None:
        C.no_overlap("combined_indices", C.tensor("combined_indices", combined_indices, dtype=torch.int32, dim=2))
        _rows("combined_indices", combined_indices)
        if combined_indices.shape[0] < T or combined_indices.shape[1] < width:
            raise ValueError(f"combined_indices must have >= {T} rows of >= {width} columns, got "
                             f"{tuple(combined_indices.shape)}")
    if combined_lens is not None:
        _vector("combined_lens", combined_lens, T, dtype=torch.int32, written=True)
    C.same_device(topk_indices=topk_indices, query_start_loc=query_start_loc, seq_lens=seq_lens,
                  gather_lens=gather_lens, combined_indices=combined_indices, combined_lens=combined_lens)
    _visibility(left_visible, right_visible, T, window_size, max_image_tokens, topk_indices)
    _check_batch(query_start_loc, seq_lens, R, T, base=True)
    if value_checks(gather_lens) and R:
        ql = (query_start_loc[1:] - query_start_loc[:-1]).long().cpu()
        sl, gl = seq_lens.long().cpu(), gather_lens.long().cpu()
        # below query_len + min(prefix_len, W - 1) is vLLM's bounded SWA replay (nothing gathered below the
        # replay start): the windows stop at the first gathered position
        if bool(((gl < ql) | (gl > sl)).any()):
            raise ValueError("gather_lens must lie in [query_len, seq_lens]: every token of the chunk must be "
                             "among the gathered rows")
        if N + int(gl.max()) > M:
            raise ValueError(f"N + gather_lens = {N + int(gl.max())} exceeds M = {M} workspace rows")
    res = _run("combine_topk_swa_indices", topk_indices.device, topk_indices, query_start_loc, seq_lens, gather_lens,
               window_size, compress_ratio, topk, M, N, combined_indices=combined_indices,
               combined_lens=combined_lens, left_visible=left_visible, right_visible=right_visible,
               max_image_tokens=max_image_tokens)
    if out is None:
        return res
    if combined_indices.shape[0] > T:
        combined_indices[T:].fill_(-1)
    return combined_indices, combined_lens
