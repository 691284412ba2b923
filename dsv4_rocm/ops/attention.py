"""Sparse MLA attention (FlashMLA semantics); dsv4_rocm.flash_mla wraps these in FlashMLA's API.

The checks here are structural only (types, dtypes, ranks, shapes, the unit last stride every kernel
needs, devices) plus the lengths' range where ``value_checks`` allows reading values; they cost no device
sync, so they run on every call (docs/conventions.md, "Argument checks"). Index values need no check:
an index that is negative or past its cache / kv is absent, in the kernels as in the reference.

What an implementation registered here receives (the reference, the Triton launchers, any later kernel):
decode ``(q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices_in_kvcache,
extra_topk_length, softmax_scale: float, out=None, formats=(main, extra), num_splits=None) -> (out, lse
[b, h, s_q])`` (``num_splits`` 1: no query's keys split over programs) and
prefill ``(q, kv, indices, sm_scale: float, d_v, attn_sink, topk_length, out=None) -> (out, max_logits,
lse)``, every tensor checked as below, on one device, caches as uint8 or float8_e4m3fn (int8 arrives as
uint8), any strides but a unit last one; ``formats`` are the caches' record formats
(``dsv4_rocm.layout.RecordFormat``; extra None without an extra cache), named by the caches' last
dimension, the ``kv_layout`` of the call and, for k_cache, ``k_cache_fnuz`` (the format's ``fp8`` field);
it writes ``out`` when given and copies nothing.

Record formats (as FlashMLA detects them, from the last dimension): 584 (V40_584), 528 (V41_528), 288
(V41_FP4_288). The pairs (k_cache, extra_k_cache) that exist: the same format twice, or V41_528 with a
V41_FP4_288 extra cache; an fp4 main cache, or any other pair, is a ValueError naming the argument.
"""
import numbers

import torch

from .. import _checks as C
from .. import cache_views as V
from .. import layout as L
from ..reference import attention as _ra
from ._dispatch import HAVE_TRITON, register, run as _run, value_checks

__all__ = ["sparse_mla_decode", "sparse_mla_prefill"]

if HAVE_TRITON:     # importing a kernel imports Triton, which is optional: without it the ops run their oracles
    from ..triton.attention.sparse_mla_decode import sparse_mla_decode as _triton_decode
    from ..triton.attention.sparse_mla_prefill import sparse_mla_prefill as _triton_prefill
else:
    _triton_decode = _triton_prefill = None
register("sparse_mla_decode", _ra.flash_mla_with_kvcache_sparse, triton=_triton_decode)
register("sparse_mla_prefill", _ra.flash_mla_sparse_fwd, triton=_triton_prefill)

_CACHE_DTYPES = (torch.uint8, torch.int8, torch.float8_e4m3fn)


def _tensor(name, t, dtype, ndim, dev):
    """A tensor of ``dtype`` and rank ``ndim`` on ``dev``: its shape. Written for the common case, which
    costs a few attribute reads; a failure goes through ``_checks.tensor`` for its message."""
    if not isinstance(t, torch.Tensor) or t.dtype is not dtype or t.dim() != ndim or t.device != dev:
        C.tensor(name, t, dtype=dtype, dim=ndim, device=dev)
    return t.shape


def _shape_error(name, want, t):
    return ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")


def _unit_last_stride(name, t):
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")


def _check_q(q, ndim, what):
    if not isinstance(q, torch.Tensor):
        raise ValueError(f"q must be a torch.Tensor, got {type(q).__name__}")
    shape = _tensor("q", q, torch.bfloat16, ndim, q.device)
    if shape[-1] != L.HEAD_DIM:
        raise ValueError(f"q must have shape {what} with d_qk = {L.HEAD_DIM} (DeepSeek-V4; the 576 layout of "
                         f"DeepSeek-V3.2 is not supported), got {tuple(shape)}")
    if shape[-2] != 64 and shape[-2] != 128:
        raise ValueError(f"q must have 64 or 128 heads (pad them), got {shape[-2]}")
    _unit_last_stride("q", q)
    return shape


def _check_scale(name, v):
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or v != v or abs(v) == float("inf"):
        raise ValueError(f"{name} must be a finite float, got {v!r}")


_FORMATS = {(f.token_bytes, "page_split"): f for f in L.KV_FORMATS}
_FORMATS.update({(f.token_bytes, "interleaved"): L.interleaved(f) for f in L.KV_FORMATS if f.token_bytes % 16 == 0})
_FORMATS.update({(f.token_bytes, None): L.with_layout(f) for f in L.KV_FORMATS})
_SIZES = " / ".join(str(f.token_bytes) for f in L.KV_FORMATS)


def _check_cache(name, cache, dev, layout):
    """A KV cache in FlashMLA's [nb, bs, 1, R] view or the [nb, bs, R] one (uint8, int8 or float8_e4m3fn), R
    the bytes of a record of one of the formats: the block size is shape[1], the page stride stride(0), a
    multiple of 16 bytes (what FlashMLA's kernels need too; vLLM pads pages to a multiple of 576 or 512).
    Returns the cache's record format in ``layout``."""
    if not isinstance(cache, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(cache).__name__}")
    if cache.dtype not in _CACHE_DTYPES:
        raise ValueError(f"{name} must have dtype torch.uint8, torch.int8 or torch.float8_e4m3fn, got {cache.dtype}")
    shape = cache.shape
    fmt = _FORMATS.get((shape[-1], layout)) if len(shape) in (3, 4) else None
    if fmt is None or (len(shape) == 4 and shape[2] != 1):
        if layout not in ("page_split", "interleaved", None):
            raise ValueError(f"kv_layout must be 'page_split', 'interleaved' or None (the format's default), got "
                             f"{layout!r}")
        if len(shape) in (3, 4) and (shape[-1], "page_split") in _FORMATS:
            L.with_layout(_FORMATS[shape[-1], "page_split"], layout)       # says which format is page-split only
        raise _shape_error(name, f"[num_blocks, block_size, 1, bytes_per_token] (or [num_blocks, block_size, "
                                 f"bytes_per_token]) with bytes_per_token {_SIZES}", cache)
    if cache.device != dev:
        raise ValueError(f"{name} is on {cache.device}, q on {dev}")
    nb, bs, rec = shape[0], shape[1], fmt.token_bytes
    stride = cache.stride()
    # the common case costs a few comparisons; anything else goes through the full view check, which
    # accepts what it can and names what is wrong otherwise
    if not (stride[-1] == 1 and (bs <= 1 or stride[1] == rec)
            and (nb <= 1 or (stride[0] >= bs * rec and stride[0] % V.ALIGN == 0))
            and (cache.storage_offset() * cache.element_size()) % V.ALIGN == 0):
        V.pages(cache if cache.dtype != torch.int8 else cache.view(torch.uint8), bs, name, fmt)
    return fmt


def _check_pair(fmt, efmt):
    """The (k_cache, extra_k_cache) format pairs FlashMLA has (``layout.valid_pair``)."""
    if fmt.elem_bits == 4:
        raise ValueError(f"k_cache: a {fmt.name} cache ({fmt.token_bytes} B a token) is only supported as "
                         "extra_k_cache, beside a V41_528 k_cache")
    if efmt is not None and not L.valid_pair(fmt, efmt):
        raise ValueError(f"extra_k_cache: invalid kv format pair, {fmt.name} (k_cache) and {efmt.name} "
                         "(extra_k_cache); the pairs are the same format twice, or V41_528 with V41_FP4_288")


def _check_set(name, iname, lname, cache, idx, lengths, b, s_q, dev, layout):
    if cache is None:
        if idx is not None or lengths is not None:
            raise ValueError(f"{iname} / {lname} are given but {name} is None")
        return None
    fmt = _check_cache(name, cache, dev, layout)
    if idx is None:
        raise ValueError(f"{iname} must be given with {name}")
    shape = _tensor(iname, idx, torch.int32, 3, dev)
    if shape[0] != b or shape[1] != s_q:
        raise _shape_error(iname, f"[{b}, {s_q}, topk]", idx)
    _unit_last_stride(iname, idx)
    _check_lengths(lname, lengths, b, s_q, shape[2], dev)
    return fmt


def _check_lengths(name, lengths, n, s_q, topk, dev):
    """int32 lengths [n] (or [n, s_q] when s_q is not None); their values within [0, topk] where values
    may be read (``value_checks``)."""
    if lengths is None:
        return
    if not isinstance(lengths, torch.Tensor) or lengths.dtype is not torch.int32 or lengths.device != dev:
        C.tensor(name, lengths, dtype=torch.int32, device=dev)
    shape = lengths.shape
    if not (shape == (n,) or (s_q is not None and shape == (n, s_q))):
        raise _shape_error(name, f"[{n}]" + (f" or [{n}, {s_q}]" if s_q is not None else ""), lengths)
    if value_checks(lengths) and lengths.numel():
        lo, hi = int(lengths.min()), int(lengths.max())
        if lo < 0 or hi > topk:
            raise ValueError(f"{name} must lie in [0, {topk}] (the indices' last dimension), got [{lo}, {hi}]")


def _check_sink(attn_sink, h, dev):
    if attn_sink is not None:
        if _tensor("attn_sink", attn_sink, torch.float32, 1, dev)[0] != h:
            raise _shape_error("attn_sink", f"[{h}]", attn_sink)
        if attn_sink.stride(0) != 1 and h > 1:
            raise ValueError("attn_sink must be contiguous")


def _check_out(out, shape, dev):
    if out is not None:
        if _tensor("out", out, torch.bfloat16, len(shape), dev) != shape:
            raise _shape_error("out", list(shape), out)
        _unit_last_stride("out", out)
        C.no_overlap("out", out)


def _bytes(cache):
    """int8 caches are read as their bytes (the reference and the kernels take uint8 or fp8)."""
    return cache.view(torch.uint8) if cache is not None and cache.dtype == torch.int8 else cache


def sparse_mla_decode(q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices_in_kvcache,
                      extra_topk_length, softmax_scale: float, out=None, *, kv_layout: str = None,
                      batch_invariant: bool = False, k_cache_fnuz: bool = False):
    """FlashMLA sparse decode over paged KV records -> (out bf16 [b, s_q, h, 512], lse fp32 [b, h, s_q]).

    q [b, s_q, h, 512] bf16 (h 64 or 128); k_cache / extra_k_cache [nb, bs, 1, R] (any view of
    docs/conventions.md with its block size in shape[1]; R names the record format, see the module
    docstring; ``kv_layout`` "page_split" or "interleaved" (default None: ``layout.default_layout``, interleaved
    for the V4.1 records as vLLM 0.33 and FlashMLA DS-0930 lay them out, page-split for V40_584) says how a
    page arranges its records); indices [b, s_q, topk] int32 slot ids, negative or past the cache =
    absent; topk_length / extra_topk_length [b] or [b, s_q] int32 (only the first ones of a row count);
    attn_sink [h] fp32 or None. One softmax over both sets; a query with no valid key gets out 0 and lse
    +inf. ``out`` (bf16 [b, s_q, h, 512], any strides with a unit last one) is written in place and
    returned. Strided q, indices and lengths are read in place. ``batch_invariant``: no query's keys are
    split over programs (the result of a query does not depend on the rest of the batch). ``k_cache_fnuz``:
    k_cache holds records of the FNUZ flavour (``layout.with_fnuz``; vLLM's gfx942 sliding-window cache,
    docs/cache_format.md#fnuz-flavour), read natively by gfx942's fnuz unit and with the scale exponent
    lowered by one elsewhere; extra_k_cache is OCP (vLLM's compressed caches are on every platform).
    """
    b, s_q, h, _ = _check_q(q, 4, "[b, s_q, h, 512]")
    dev = q.device
    if k_cache is None:
        raise ValueError("k_cache is required")
    fmt = _check_set("k_cache", "indices", "topk_length", k_cache, indices, topk_length, b, s_q, dev, kv_layout)
    if k_cache_fnuz is not False:
        if k_cache_fnuz is not True:
            raise ValueError(f"k_cache_fnuz must be a bool, got {k_cache_fnuz!r}")
        if fmt.elem_bits != 8:
            raise ValueError(f"k_cache_fnuz: {fmt.name} records have no FNUZ flavour")
        fmt = L.with_fnuz(fmt)
    efmt = _check_set("extra_k_cache", "extra_indices_in_kvcache", "extra_topk_length", extra_k_cache,
                      extra_indices_in_kvcache, extra_topk_length, b, s_q, dev, kv_layout)
    _check_pair(fmt, efmt)
    _check_sink(attn_sink, h, dev)
    _check_scale("softmax_scale", softmax_scale)
    _check_out(out, (b, s_q, h, L.HEAD_DIM), dev)
    return _run("sparse_mla_decode", dev, q, _bytes(k_cache), indices, topk_length, attn_sink, _bytes(extra_k_cache),
                extra_indices_in_kvcache, extra_topk_length, float(softmax_scale), out, formats=(fmt, efmt),
                **({"num_splits": 1} if batch_invariant else {}))


def sparse_mla_prefill(q, kv, indices, sm_scale: float, d_v: int = 512, attn_sink=None, topk_length=None, out=None):
    """FlashMLA sparse prefill over a bf16 kv -> (out bf16 [s_q, h, 512], max_logits fp32 [s_q, h],
    lse fp32 [s_q, h]).

    q [s_q, h, 512] bf16, kv [s_kv, 1, 512] bf16 (K = V), indices [s_q, 1, topk] int32 (negative or
    >= s_kv = absent), topk_length [s_q] int32 or None, attn_sink [h] fp32 or None. A query with no valid
    key gets out 0, lse +inf, max_logits -inf. ``out`` [s_q, h, 512] is written in place and returned.
    """
    s_q, h, _ = _check_q(q, 3, "[s_q, h, 512]")
    dev = q.device
    shape = _tensor("kv", kv, torch.bfloat16, 3, dev)
    if shape[1] != 1 or shape[2] != L.HEAD_DIM:
        raise _shape_error("kv", f"[s_kv, 1, {L.HEAD_DIM}]", kv)
    _unit_last_stride("kv", kv)
    shape = _tensor("indices", indices, torch.int32, 3, dev)
    if shape[0] != s_q or shape[1] != 1:
        raise _shape_error("indices", f"[{s_q}, 1, topk]", indices)
    _unit_last_stride("indices", indices)
    if d_v != L.HEAD_DIM:
        raise ValueError(f"d_v must be {L.HEAD_DIM}, got {d_v}")
    _check_scale("sm_scale", sm_scale)
    _check_sink(attn_sink, h, dev)
    _check_lengths("topk_length", topk_length, s_q, None, shape[2], dev)
    _check_out(out, (s_q, h, L.HEAD_DIM), dev)
    return _run("sparse_mla_prefill", dev, q, kv, indices, float(sm_scale), d_v, attn_sink, topk_length, out)
