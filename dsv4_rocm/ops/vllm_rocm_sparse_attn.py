"""Sparse MLA attention in the call forms of vLLM's ROCm DeepSeek-V4 layer (``rocm_sparse_attn_decode``,
``rocm_sparse_attn_prefill``, ``rocm_inverse_rope_rows_`` of vLLM's ``rocm_aiter_mla_sparse``): an engine
swaps the import, not the call site.

The attention itself is ``sparse_mla_decode`` / ``sparse_mla_prefill`` (FlashMLA's semantics and kernels);
these adapters only translate the call form:

* index sets come dense (``[T, W]`` or ``[T, 1, W]`` slot ids, with or without lengths) or ragged
  (``*_ragged_indices`` flat, ``*_ragged_indptr`` [T + 1]: row t is ``indices[indptr[t]:indptr[t + 1]]``).
  Where vLLM's call gives both, the ragged form is used, as vLLM does. A ragged stream becomes dense rows
  (``ragged_indices_to_dense``) of width W: the dense form's width when the call gives one, else
  ``ceil(len(ragged_indices) / T)`` (vLLM allocates its ragged streams as T times the widest row).
* q has any head count up to 128 (vLLM's ROCm layer does not pad heads); the kernels take 64 or 128, so
  other counts run on a zero-padded copy of q and the first heads of the result are copied to ``output``.
* nothing is allocated inside a call once its shapes have run (a decode step of a served model): the
  padded q, the kernels' output, the padded sink, dense rows of a ragged stream and int32 copies of int64
  or strided indices live in workspaces kept per device and stream (``dsv4_rocm/workspace.py``, kept
  alive for captured graphs); int32 indices with a unit last stride and 64 or 128 heads are read in place.
* the decode can fold the inverse RoPE of its output rows (``inv_rope_positions``): it then rotates
  ``output`` in place with ``rocm_inverse_rope_rows_`` and returns T, as vLLM's fused epilogue does;
  otherwise it returns 0 and vLLM rotates the rows itself.

The caches are fp8_ds_mla pages, of dsv4_rocm's OCP flavour by default (docs/cache_format.md#fnuz-flavour).
vLLM's own ROCm decode reads its sliding-window cache as FNUZ on gfx942 (its gfx942 writer produces FNUZ
bytes) and its compressed cache as OCP; its call passes no flag for that. ``use_fnuz=True`` (a keyword of
dsv4_rocm's) says the sliding-window cache holds FNUZ-flavour records, so an engine can keep vLLM's
gfx942 sliding-window writer and switch only the decode; with the default an engine switches the writer
with the decode. ``extra_cache_nan_free`` and ``adaptive_splits``
(scheduling hints of vLLM's kernels) are accepted and change nothing; ``output_mxfp8`` (gfx950's MXFP8
epilogue) is rejected with a ValueError.
"""
import torch

from .. import _checks as C
from .. import layout as L
from ..workspace import workspace
from ..reference import metadata as _rm
from ..reference import rope as _rr
from ._dispatch import HAVE_TRITON, register, run as _run, value_checks
from .attention import sparse_mla_decode, sparse_mla_prefill

__all__ = ["rocm_sparse_attn_decode", "rocm_sparse_attn_prefill", "rocm_inverse_rope_rows_",
           "ragged_indices_to_dense"]

if HAVE_TRITON:     # importing a kernel imports Triton, which is optional: without it the ops run their oracles
    from ..triton.attention.ragged_indices_to_dense import ragged_indices_to_dense as _triton_ragged
    from ..triton.attention.rocm_inverse_rope_rows import rocm_inverse_rope_rows_ as _triton_inv_rope
else:
    _triton_ragged = _triton_inv_rope = None
register("ragged_indices_to_dense", _rm.ragged_indices_to_dense, triton=_triton_ragged)
register("rocm_inverse_rope_rows_", _rr.rocm_inverse_rope_rows_, triton=_triton_inv_rope)

_KERNEL_HEADS = (64, 128)


# ---- the two helper ops ----------------------------------------------------------------------------------
def ragged_indices_to_dense(ragged_indices, ragged_indptr, out_indices, out_lens):
    """Row t of a ragged index stream (``ragged_indices[indptr[t]:indptr[t + 1]]``) as row t of ``out_indices``
    int32 [T, W] (-1 after its entries) with its length in ``out_lens`` int32 [T]; T = len(ragged_indptr) - 1.
    Offsets outside the stream are clamped to it. A row longer than W is a ValueError where values are
    checked (``ops.validation``), else cut to W. Returns (out_indices, out_lens).
    Math: dsv4_rocm.reference.metadata.ragged_indices_to_dense."""
    C.tensor("ragged_indices", ragged_indices, dtype=C.INDEX, dim=1)
    C.tensor("ragged_indptr", ragged_indptr, dtype=C.INDEX, dim=1)
    if ragged_indptr.shape[0] < 1:
        raise ValueError("ragged_indptr must have T + 1 >= 1 entries")
    T = ragged_indptr.shape[0] - 1
    C.tensor("out_indices", out_indices, dtype=torch.int32, shape=(T, None))
    C.tensor("out_lens", out_lens, dtype=torch.int32, shape=(T,))
    for name, t in (("ragged_indices", ragged_indices), ("ragged_indptr", ragged_indptr),
                    ("out_indices", out_indices), ("out_lens", out_lens)):
        if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")
    C.same_device(ragged_indices=ragged_indices, ragged_indptr=ragged_indptr, out_indices=out_indices,
                  out_lens=out_lens)
    if T and value_checks(ragged_indptr):
        ptr = ragged_indptr.long()
        n = ptr[1:] - ptr[:-1]
        if int(ptr[0]) < 0 or bool((n < 0).any()) or int(ptr[-1]) > ragged_indices.shape[0]:
            raise ValueError(f"ragged_indptr must be non-decreasing from >= 0 up to at most "
                             f"{ragged_indices.shape[0]} (the entries of ragged_indices)")
        if int(n.max()) > out_indices.shape[1]:
            raise ValueError(f"a row of the ragged indices has {int(n.max())} entries, more than the "
                             f"{out_indices.shape[1]} columns of out_indices")
    return _run("ragged_indices_to_dense", out_indices.device, ragged_indices, ragged_indptr, out_indices, out_lens)


def rocm_inverse_rope_rows_(o, positions, cos_sin_cache, rope_head_dim: int) -> None:
    """vLLM's in-place inverse GPT-J RoPE of attention output rows: o bf16 [T, H, D] (any token / head
    strides, unit last stride), positions int [T], cos_sin_cache fp32 or bf16 [P, rope_head_dim] (cos |
    sin); the last ``rope_head_dim`` dims of each (token, head) are rotated back, the others untouched.
    Math: dsv4_rocm.reference.rope.rocm_inverse_rope_rows_."""
    _check_rotation(o, positions, cos_sin_cache, rope_head_dim)
    _run("rocm_inverse_rope_rows_", o.device, o, positions, cos_sin_cache, rope_head_dim)


def _check_rotation(o, positions, cos_sin_cache, rope_head_dim, names=("o", "positions", "cos_sin_cache")):
    o_name, p_name, cs_name = names
    C.tensor(o_name, o, dtype=torch.bfloat16, dim=3)
    D = o.shape[2]
    if not isinstance(rope_head_dim, int) or isinstance(rope_head_dim, bool) or rope_head_dim <= 0 \
            or rope_head_dim % 2 or rope_head_dim > D:
        raise ValueError(f"rope_head_dim must be a positive even int <= {D} ({o_name}'s last dim), got "
                         f"{rope_head_dim!r}")
    if D > 1 and o.stride(2) != 1:
        raise ValueError(f"{o_name} must have a contiguous last dimension, got strides {o.stride()}")
    C.tensor(cs_name, cos_sin_cache, dtype=(torch.float32, torch.bfloat16), shape=(None, rope_head_dim))
    if cos_sin_cache.stride(1) != 1:
        raise ValueError(f"{cs_name} must have contiguous rows")
    C.tensor(p_name, positions, dtype=C.INDEX, shape=(o.shape[0],))
    C.same_device(**{o_name: o, p_name: positions, cs_name: cos_sin_cache})
    if positions.numel() and value_checks(positions) and (
            int(positions.min()) < 0 or int(positions.max()) >= cos_sin_cache.shape[0]):
        raise ValueError(f"{p_name} must lie in [0, {cos_sin_cache.shape[0]}) (rows of {cs_name})")


# ---- the call-form adapters ------------------------------------------------------------------------------
def _check_dims(head_dim, nope_head_dim, rope_head_dim):
    if (head_dim, nope_head_dim, rope_head_dim) != (L.HEAD_DIM, L.NOPE_DIM, L.ROPE_DIM):
        raise ValueError(f"head_dim / nope_head_dim / rope_head_dim must be {L.HEAD_DIM} / {L.NOPE_DIM} / "
                         f"{L.ROPE_DIM} (DeepSeek-V4), got {head_dim} / {nope_head_dim} / {rope_head_dim}")


def _check_q_out(q, output):
    C.tensor("q", q, dtype=torch.bfloat16, dim=3)
    T, H, D = q.shape
    if D != L.HEAD_DIM:
        raise ValueError(f"q must have shape [T, H, {L.HEAD_DIM}], got {tuple(q.shape)}")
    if not 0 < H <= 128:
        raise ValueError(f"q must have 1 to 128 heads, got {H}")
    if output is None:
        raise ValueError("output is required (dsv4_rocm writes the attention output in place)")
    C.tensor("output", output, dtype=torch.bfloat16, shape=(T, H, D), device=q.device)
    return T, H


def _padded(q, output, attn_sink):
    """(q, out, sink) with the head count the kernels take, and the copy back to ``output`` (or None). Other
    head counts run on workspaces (the q copy, its zero heads, the sink and the kernel's output): nothing is
    allocated once a shape has run."""
    T, H, D = q.shape
    if attn_sink is not None:
        C.tensor("attn_sink", attn_sink, dtype=torch.float32, dim=1, device=q.device)
        if attn_sink.shape[0] < H:
            raise ValueError(f"attn_sink has {attn_sink.shape[0]} entries for {H} heads")
        attn_sink = attn_sink[:H]
    if H in _KERNEL_HEADS:
        return q, output, attn_sink, None
    Hp = 64 if H < 64 else 128
    dev = q.device
    qp = workspace("vllm_rocm_sparse_attn.q", dev, (T, Hp, D), torch.bfloat16)
    qp[:, :H].copy_(q)
    qp[:, H:].zero_()
    sink = None
    if attn_sink is not None:
        sink = workspace("vllm_rocm_sparse_attn.sink", dev, (Hp,), torch.float32)
        sink[:H].copy_(attn_sink)
        sink[H:].zero_()
    out = workspace("vllm_rocm_sparse_attn.out", dev, (T, Hp, D), torch.bfloat16)
    return qp, out, sink, lambda o: output.copy_(o[:, :H])


def _dense_width(name, t, T):
    C.tensor(name, t, dtype=C.INDEX)
    if t.dim() not in (2, 3) or t.shape[0] != T or (t.dim() == 3 and t.shape[1] != 1):
        raise ValueError(f"{name} must have shape [{T}, W] or [{T}, 1, W], got {tuple(t.shape)}")
    return t.shape[-1]


def _as_int32(kind, t, shape):
    """``t`` itself where it is int32 with a unit last stride, else its values in an int32 workspace."""
    if t.dtype == torch.int32 and (t.shape[-1] <= 1 or t.stride(-1) == 1):
        return t
    ws = workspace(kind, t.device, shape, torch.int32)
    ws.copy_(t)
    return ws


def _index_rows(kind, name, t, T):
    """A dense index set as FlashMLA's [T, 1, W] int32 (a view where it already is one)."""
    t = t.reshape(T, 1, _dense_width(name, t, T))
    return _as_int32(kind + ".indices", t, t.shape)


def _lengths(kind, name, t, T):
    if t is None:
        return None
    C.tensor(name, t, dtype=C.INDEX, shape=(T,))
    return _as_int32(kind + ".lengths", t, (T,))


def _index_set(names, dense, lengths, ragged, indptr, T, dev):
    """(indices [T, 1, W] int32, lengths [T] int32 or None) of one index set given in any of vLLM's forms;
    ``names``: the call's names of (dense indices, lengths, ragged indices, ragged offsets), which also name
    the set's workspaces (distinct for the two sets of a decode call)."""
    n_dense, n_len, n_ragged, n_ptr = names
    kind = "vllm_rocm_sparse_attn." + n_dense
    if (ragged is None) != (indptr is None):
        raise ValueError(f"{n_ragged} and {n_ptr} must be given together")
    if ragged is None:
        if dense is None:
            raise ValueError(f"{n_dense} is required when {n_ragged} / {n_ptr} are not given")
        return _index_rows(kind, n_dense, dense, T), _lengths(kind, n_len, lengths, T)
    C.tensor(n_ragged, ragged, dtype=C.INDEX)
    C.tensor(n_ptr, indptr, dtype=C.INDEX, shape=(T + 1,))
    if dense is not None:
        width = _dense_width(n_dense, dense, T)
    else:
        width = -(-ragged.numel() // T) if T else 0
    idx = workspace(kind + ".indices", dev, (T, width), torch.int32)
    lens = workspace(kind + ".lengths", dev, (T,), torch.int32)
    ragged_indices_to_dense(ragged.reshape(-1), indptr, idx, lens)
    return idx.unsqueeze(1), lens


def _cache(name, cache):
    C.tensor(name, cache, dtype=(torch.uint8, torch.int8, torch.float8_e4m3fn))
    if cache.dim() not in (3, 4) or cache.shape[-1] != L.TOKEN_BYTES:
        raise ValueError(f"{name} must be an fp8_ds_mla cache [num_blocks, block_size, {L.TOKEN_BYTES}] (or "
                         f"FlashMLA's [num_blocks, block_size, 1, {L.TOKEN_BYTES}]), got {tuple(cache.shape)}")
    return cache


def rocm_sparse_attn_decode(q, kv_cache, swa_k_cache, swa_only: bool, topk_indices, topk_lens, swa_indices,
                            swa_lens, swa_ragged_indices, swa_ragged_indptr, topk_ragged_indices, topk_ragged_indptr,
                            attn_sink, scale: float, head_dim: int, nope_head_dim: int, rope_head_dim: int, output,
                            extra_cache_nan_free: bool = False, adaptive_splits: bool = False,
                            inv_rope_positions=None, inv_rope_cos_sin_cache=None, output_mxfp8=None, *,
                            use_fnuz: bool = False) -> int:
    """vLLM's ROCm sparse decode: for each of the T query rows of q [T, H, 512] bf16, one softmax with the
    attention sink ``attn_sink`` (fp32, at least H entries; H first used) over its sliding-window keys
    (slots of ``swa_k_cache``) and, unless ``swa_only``, its compressed keys (slots of ``kv_cache``);
    output [T, H, 512] bf16 is written in place. Index sets: ``swa_indices`` [T, W] / [T, 1, W] with
    ``swa_lens`` [T] (or the ragged ``swa_ragged_indices`` / ``swa_ragged_indptr``), ``topk_indices`` with
    ``topk_lens`` (or ``topk_ragged_*``); a slot that is negative or past its cache is absent, entries past
    a length are not read. Returns T with ``inv_rope_positions`` (the rows come back inverse-RoPE'd with
    ``inv_rope_cos_sin_cache``), else 0. ``use_fnuz``: ``swa_k_cache`` holds FNUZ-flavour records (vLLM's
    gfx942 writer); ``kv_cache`` is OCP. See the module docstring for the forms and hints."""
    if output_mxfp8 is not None:
        raise ValueError("output_mxfp8 (gfx950's MXFP8 epilogue) is not implemented: pass output (bf16)")
    _check_dims(head_dim, nope_head_dim, rope_head_dim)
    T, H = _check_q_out(q, output)
    dev = q.device
    if not isinstance(swa_only, bool):
        raise ValueError(f"swa_only must be a bool, got {swa_only!r}")
    if not isinstance(use_fnuz, bool):
        raise ValueError(f"use_fnuz must be a bool (True: swa_k_cache holds the FNUZ flavour of the record), got "
                         f"{use_fnuz!r}")
    _cache("swa_k_cache", swa_k_cache)
    main_idx, main_len = _index_set(("swa_indices", "swa_lens", "swa_ragged_indices", "swa_ragged_indptr"),
                                    swa_indices, swa_lens, swa_ragged_indices, swa_ragged_indptr, T, dev)
    extra_cache = extra_idx = extra_len = None
    if not swa_only:
        if kv_cache is None:
            raise ValueError("kv_cache is required unless swa_only")
        extra_cache = _cache("kv_cache", kv_cache)
        extra_idx, extra_len = _index_set(("topk_indices", "topk_lens", "topk_ragged_indices", "topk_ragged_indptr"),
                                          topk_indices, topk_lens, topk_ragged_indices, topk_ragged_indptr, T, dev)
    rotate = inv_rope_positions is not None
    if rotate:                       # checked before the attention writes anything
        if inv_rope_cos_sin_cache is None:
            raise ValueError("inv_rope_cos_sin_cache is required with inv_rope_positions")
        _check_rotation(output, inv_rope_positions, inv_rope_cos_sin_cache, rope_head_dim,
                        ("output", "inv_rope_positions", "inv_rope_cos_sin_cache"))
    qk, out, sink, copy_back = _padded(q, output, attn_sink)
    sparse_mla_decode(qk.unsqueeze(1), swa_k_cache, main_idx, main_len, sink, extra_cache, extra_idx, extra_len,
                      scale, out.unsqueeze(1), k_cache_fnuz=use_fnuz)
    if copy_back is not None:
        copy_back(out)
    if not rotate:
        return 0
    _run("rocm_inverse_rope_rows_", dev, output, inv_rope_positions, inv_rope_cos_sin_cache, rope_head_dim)
    return T


def rocm_sparse_attn_prefill(q, kv, indices, topk_length, scale: float, head_dim: int, nope_head_dim: int,
                             rope_head_dim: int, attn_sink, output, ragged_indices=None, ragged_indptr=None) -> None:
    """vLLM's ROCm sparse prefill over a bf16 workspace: for each query row of q [T, H, 512] bf16, one
    softmax with the attention sink over the rows of kv [S, 1, 512] bf16 named by ``indices`` [T, K] /
    [T, 1, K] (first ``topk_length[t]`` of them when given) or by the ragged ``ragged_indices`` /
    ``ragged_indptr`` (used when given); an index that is negative or >= S is absent. output [T, H, 512]
    bf16 is written in place."""
    _check_dims(head_dim, nope_head_dim, rope_head_dim)
    T, H = _check_q_out(q, output)
    if not (isinstance(kv, torch.Tensor) and kv.dim() == 3 and kv.shape[1] == 1):
        raise ValueError(f"kv must be [S, 1, {L.HEAD_DIM}] bf16, got "
                         f"{tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__}")
    idx, lens = _index_set(("indices", "topk_length", "ragged_indices", "ragged_indptr"), indices, topk_length,
                           ragged_indices, ragged_indptr, T, q.device)
    qk, out, sink, copy_back = _padded(q, output, attn_sink)
    sparse_mla_prefill(qk, kv, idx, scale, L.HEAD_DIM, sink, lens, out)
    if copy_back is not None:
        copy_back(out)
