"""Lightning indexer of C4 layers: vLLM's q quant and indexer-K cache ops, DeepGEMM's logits ops, top-k.

Call forms are vLLM's (``fused_indexer_q_rope_quant``, ``indexer_k_quant_and_cache``,
``cp_gather_indexer_k_quant_cache``) and DeepGEMM's as vLLM's ``utils/deep_gemm`` calls them
(``fp8_mqa_logits``, ``fp8_paged_mqa_logits``, ``get_paged_mqa_logits_metadata``). The math is in
``dsv4_rocm.reference.indexer``. The indexer-K cache is accepted as ``[num_blocks, block_size, 132]`` (vLLM's
allocation) or ``[num_blocks, block_size, 1, 132]`` (DeepGEMM's view), uint8 or float8_e4m3fn; its page
stride is ``stride(0)``. Bad input is a ValueError naming the argument before anything is written; checks
that read tensor values follow ``value_checks`` (docs/conventions.md).
"""
import torch

from .. import _checks as C
from .. import cache_views as V
from .. import layout as L
from ..reference import indexer as _ri
from ._dispatch import register, run as _run, value_checks
from .library import _define, _none

__all__ = ["fused_indexer_q_rope_quant", "fp8_mqa_logits", "fp8_paged_mqa_logits", "get_paged_mqa_logits_metadata",
           "fp8_fp4_mqa_logits", "fp8_fp4_paged_mqa_logits", "indexer_k_quant_and_cache",
           "cp_gather_indexer_k_quant_cache", "top_k_per_row"]

_T = "dsv4_rocm.triton."
register("fused_indexer_q_rope_quant", _ri.fused_indexer_q_rope_quant,
         triton=_T + "fused_indexer_q_rope_quant:fused_indexer_q_rope_quant")
register("fp8_mqa_logits", _ri.fp8_mqa_logits, triton=_T + "fp8_mqa_logits:fp8_mqa_logits")
register("fp8_paged_mqa_logits", _ri.fp8_paged_mqa_logits, triton=_T + "fp8_paged_mqa_logits:fp8_paged_mqa_logits")
register("get_paged_mqa_logits_metadata", _ri.get_paged_mqa_logits_metadata)
register("indexer_k_quant_and_cache", _ri.indexer_k_quant_and_cache,
         triton=_T + "indexer_k_quant_and_cache:indexer_k_quant_and_cache")
register("cp_gather_indexer_k_quant_cache", _ri.cp_gather_indexer_k_quant_cache,
         triton=_T + "cp_gather_indexer_k_quant_cache:cp_gather_indexer_k_quant_cache")
register("top_k_per_row", _ri.top_k_per_row)

FLOATS = (torch.bfloat16, torch.float16, torch.float32)
FP8 = (torch.float8_e4m3fn, torch.uint8)
MAX_NEXT_N = 4
MAX_HEADS = 128


def _flag(name, v):
    if not isinstance(v, bool):
        raise ValueError(f"{name} must be a bool, got {v!r}")


def _unit_inner(name, t):
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit stride in its last dimension, got strides {t.stride()}")


def _indexer_cache(kv_cache):
    """(pages view, block size) of an indexer-K cache given as [nb, bs, 132] or [nb, bs, 1, 132]."""
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() not in (3, 4):
        raise ValueError("kv_cache must be the indexer-K cache as [num_blocks, block_size, 132] or [num_blocks, "
                         f"block_size, 1, 132], got {getattr(kv_cache, 'shape', type(kv_cache).__name__)}")
    bs = kv_cache.shape[1]
    return V.pages(kv_cache, bs, "kv_cache", V.INDEXER_K), bs


def _needed_pages_valid(name, block_table, lengths, bs, num_pages, allow_padding):
    """Value check: for each row b, the block-table entries covering its first lengths[b] keys exist and
    name pages of the cache (a negative entry is allowed only with allow_padding)."""
    need = (lengths.long().clamp(min=0) + bs - 1) // bs
    if int(need.max()) > block_table.shape[1]:
        raise ValueError(f"{name} has {block_table.shape[1]} columns; the lengths need {int(need.max())} "
                         f"(block size {bs})")
    used = torch.arange(block_table.shape[1], device=need.device).unsqueeze(0) < need.unsqueeze(1)
    bt = block_table.long()
    if bool((used & (bt >= num_pages)).any()):
        raise ValueError(f"{name} names a page >= {num_pages} (the pages of kv_cache)")
    if not allow_padding and bool((used & (bt < 0)).any()):
        raise ValueError(f"{name} has a negative entry inside a request's length")


# ---- query ----------------------------------------------------------------------------------------
def fused_indexer_q_rope_quant(positions, index_q, index_q_cos_sin_cache, index_weights,
                               index_weights_softmax_scale: float, index_weights_head_scale: float,
                               use_fp4: bool = False):
    """index_q [T, H, 128] (bf16, fp16 or fp32), positions int [T], cos/sin table fp32 or bf16 [P, 64],
    index_weights [T, H] -> (q float8_e4m3fn [T, H, 128], w' fp32 [T, H]) with the q scale folded into w',
    or with use_fp4 ((packed uint8 [T, H, 64], UE8M0 scales int32 [T, H]), w') (reference.indexer)."""
    C.tensor("index_q", index_q, dtype=FLOATS, shape=(None, None, L.INDEXER_DIM))
    _unit_inner("index_q", index_q)
    T, H = index_q.shape[:2]
    C.cos_sin(index_q_cos_sin_cache, positions, dtype=(torch.float32, torch.bfloat16), n_tokens=T)
    C.tensor("index_weights", index_weights, dtype=FLOATS, shape=(T, H))
    C.finite_float("index_weights_softmax_scale", index_weights_softmax_scale)
    C.finite_float("index_weights_head_scale", index_weights_head_scale)
    _flag("use_fp4", use_fp4)
    C.same_device(positions=positions, index_q=index_q, index_q_cos_sin_cache=index_q_cos_sin_cache,
                  index_weights=index_weights)
    return _run("fused_indexer_q_rope_quant", index_q.device, positions, index_q, index_q_cos_sin_cache,
                index_weights, float(index_weights_softmax_scale), float(index_weights_head_scale), use_fp4)


# ---- logits ---------------------------------------------------------------------------------------
def _q_and_weights(q, weights, dims):
    """q fp8 [..., H, 128] of ``dims`` dimensions; weights fp32 [rows, H] with a unit inner stride."""
    C.tensor("q", q, dtype=FP8)
    if q.dim() != dims or q.shape[-1] != L.INDEXER_DIM:
        want = ", ".join(["*"] * (dims - 1) + [str(L.INDEXER_DIM)])
        raise ValueError(f"q must have shape [{want}], got {tuple(q.shape)}")
    _unit_inner("q", q)
    if not 1 <= q.shape[-2] <= MAX_HEADS:
        raise ValueError(f"q has {q.shape[-2]} heads; 1 to {MAX_HEADS} are supported (as DeepGEMM's)")
    rows = q.shape[0] * (q.shape[1] if dims == 4 else 1)
    C.tensor("weights", weights, dtype=torch.float32, shape=(rows, q.shape[-2]))
    _unit_inner("weights", weights)


def fp8_mqa_logits(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits: bool = True):
    """DeepGEMM's prefill logits: q fp8 [M, H, 128], kv = (k fp8 [N, 128], k_scale fp32 [N]), weights fp32
    [M, H], cu_seqlen_ks / cu_seqlen_ke int32 [M] -> fp32 [M, N]; row m sees keys [ks[m], ke[m]) and is -inf
    elsewhere (with clean_logits=False the entries outside are unspecified)."""
    if not isinstance(kv, (tuple, list)) or len(kv) != 2:
        raise ValueError(f"kv must be the pair (k_fp8, k_scale), got {type(kv).__name__}")
    k8, k_scale = kv
    _q_and_weights(q, weights, 3)
    M = q.shape[0]
    C.tensor("kv[0]", k8, dtype=FP8, shape=(None, L.INDEXER_DIM))
    _unit_inner("kv[0]", k8)
    N = k8.shape[0]
    C.tensor("kv[1]", k_scale, dtype=torch.float32, shape=(N,), contiguous=True)
    C.tensor("cu_seqlen_ks", cu_seqlen_ks, dtype=torch.int32, shape=(M,), contiguous=True)
    C.tensor("cu_seqlen_ke", cu_seqlen_ke, dtype=torch.int32, shape=(M,), contiguous=True)
    _flag("clean_logits", clean_logits)
    C.same_device(q=q, k=k8, k_scale=k_scale, weights=weights, cu_seqlen_ks=cu_seqlen_ks, cu_seqlen_ke=cu_seqlen_ke)
    if M and value_checks(cu_seqlen_ks):
        ks, ke = cu_seqlen_ks.long(), cu_seqlen_ke.long()
        if int(ks.min()) < 0 or int(ke.max()) > N or bool((ke < ks).any()):
            raise ValueError(f"cu_seqlen_ks / cu_seqlen_ke must satisfy 0 <= ks <= ke <= {N} (the keys of kv)")
    return _run("fp8_mqa_logits", q.device, q, (k8, k_scale), weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits)


def fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_tables, schedule_metadata, max_model_len: int,
                         clean_logits: bool = True):
    """DeepGEMM's decode logits over the paged indexer-K cache: q fp8 [B, next_n, H, 128] (next_n <= 4),
    weights fp32 [B * next_n, H], context_lens int32 [B] or [B, next_n], block_tables int32 [B, max_blocks],
    schedule_metadata from ``get_paged_mqa_logits_metadata`` -> fp32 [B * next_n, max_model_len]. Draft row i
    of request b sees keys [0, L - next_n + i + 1) with 1-D lens L = context_lens[b], or [0, context_lens[b, i])
    with 2-D ones; a negative block-table entry inside the context gives -inf for its keys. With
    clean_logits=False the columns past a request's context may be left unwritten."""
    _q_and_weights(q, weights, 4)
    B, nn = q.shape[:2]
    if not 1 <= nn <= MAX_NEXT_N:
        raise ValueError(f"q: next_n = {nn}; 1 to {MAX_NEXT_N} draft rows a request are supported")
    pages, bs = _indexer_cache(kv_cache)
    C.tensor("context_lens", context_lens, dtype=torch.int32, contiguous=True)
    if context_lens.shape not in ((B,), (B, nn)):
        raise ValueError(f"context_lens must have shape [{B}] or [{B}, {nn}] (batch, next_n of q), got "
                         f"{tuple(context_lens.shape)}")
    C.tensor("block_tables", block_tables, dtype=torch.int32, shape=(B, None))
    _unit_inner("block_tables", block_tables)
    C.tensor("schedule_metadata", schedule_metadata, dtype=torch.int32, shape=(None, 2))
    C.positive_int("max_model_len", max_model_len)
    _flag("clean_logits", clean_logits)
    C.same_device(q=q, kv_cache=kv_cache, weights=weights, context_lens=context_lens, block_tables=block_tables)
    if B and value_checks(context_lens):
        cl = context_lens.long()
        if int(cl.min()) < 0 or int(cl.max()) > max_model_len:
            raise ValueError(f"context_lens must lie in [0, max_model_len = {max_model_len}]")
        _needed_pages_valid("block_tables", block_tables, _ri.visible_keys(context_lens, nn).amax(1), bs,
                            pages.shape[0], allow_padding=True)
    return _run("fp8_paged_mqa_logits", q.device, q, kv_cache, weights, context_lens, block_tables,
                schedule_metadata, max_model_len, clean_logits)


def get_paged_mqa_logits_metadata(context_lens, block_size: int, num_sms: int):
    """DeepGEMM's schedule tensor for ``fp8_paged_mqa_logits``: int32 [num_sms + 1, 2] on context_lens'
    device, graph-safe. dsv4_rocm's kernel schedules itself from context_lens and does not read it."""
    C.tensor("context_lens", context_lens, dtype=torch.int32, contiguous=True)
    if context_lens.dim() not in (1, 2):
        raise ValueError(f"context_lens must be [B] or [B, next_n], got shape {tuple(context_lens.shape)}")
    C.positive_int("block_size", block_size)
    C.positive_int("num_sms", num_sms)
    return _run("get_paged_mqa_logits_metadata", context_lens.device, context_lens, block_size, num_sms)


def _fp8_q(q):
    if not isinstance(q, (tuple, list)) or len(q) != 2:
        raise ValueError(f"q must be the pair (q_values, q_scale), got {type(q).__name__}")
    if q[1] is not None:
        raise ValueError("q: MXFP4 queries (a q_scale tensor) are not supported by these logits kernels; pass "
                         "(q_fp8, None) with the q scale folded into the weights")
    return q[0]


def fp8_fp4_mqa_logits(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits: bool):
    """vLLM's unified name: ``fp8_mqa_logits`` with q as (q_fp8, None)."""
    return fp8_mqa_logits(_fp8_q(q), kv, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits)


def fp8_fp4_paged_mqa_logits(q, kv_cache, weights, context_lens, block_tables, schedule_metadata, max_model_len: int,
                             clean_logits: bool):
    """vLLM's unified name: ``fp8_paged_mqa_logits`` with q as (q_fp8, None)."""
    return fp8_paged_mqa_logits(_fp8_q(q), kv_cache, weights, context_lens, block_tables, schedule_metadata,
                                max_model_len, clean_logits)


# ---- indexer-K cache ------------------------------------------------------------------------------
def indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size: int, scale_fmt: str) -> None:
    """vLLM's op: k [T, 128] -> UE8M0 FP8 records (128 bytes + fp32 scale 2^e) at slot_mapping[:n] of the
    indexer-K cache (n = len(slot_mapping) <= T); a negative slot is padding. dsv4_rocm's cache holds one
    UE8M0 scale a 128-value entry: quant_block_size must be 128 and scale_fmt "ue8m0"."""
    C.tensor("k", k, dtype=FLOATS, shape=(None, L.INDEXER_DIM))
    _unit_inner("k", k)
    pages, bs = _indexer_cache(kv_cache)
    if quant_block_size != L.INDEXER_DIM or isinstance(quant_block_size, bool):
        raise ValueError(f"quant_block_size must be {L.INDEXER_DIM} (one scale an entry), got {quant_block_size!r}")
    if scale_fmt != "ue8m0":
        raise ValueError(f"scale_fmt must be 'ue8m0' (the indexer-K cache stores power-of-two scales), got "
                         f"{scale_fmt!r}")
    C.tensor("slot_mapping", slot_mapping, dtype=C.INDEX, dim=1)
    if slot_mapping.shape[0] > k.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {k.shape[0]} rows of k")
    C.same_device(k=k, kv_cache=kv_cache, slot_mapping=slot_mapping)
    C.slots_inside("slot_mapping", slot_mapping, V.capacity(pages, bs), f"({pages.shape[0]} pages x {bs})")
    _run("indexer_k_quant_and_cache", k.device, k, kv_cache, slot_mapping, quant_block_size, scale_fmt)


def cp_gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens) -> None:
    """vLLM's op: rows cu_seq_lens[b] <= t < cu_seq_lens[b + 1] of dst_k (fp8 [T, 128]) and dst_scale (uint8
    [T, 4], or the fp32 scales [T] / [T, 1]) get entries 0, 1, ... of request b through block_table[b]; other
    rows are not written."""
    pages, bs = _indexer_cache(kv_cache)
    C.tensor("dst_k", dst_k, dtype=FP8, shape=(None, L.INDEXER_DIM))
    _unit_inner("dst_k", dst_k)
    T = dst_k.shape[0]
    if not (isinstance(dst_scale, torch.Tensor) and dst_scale.is_contiguous() and (
            (dst_scale.dtype == torch.uint8 and dst_scale.shape == (T, 4)) or
            (dst_scale.dtype == torch.float32 and dst_scale.shape in ((T,), (T, 1))))):
        raise ValueError(f"dst_scale must be a contiguous uint8 [{T}, 4] or float32 [{T}] tensor, got "
                         f"{getattr(dst_scale, 'dtype', None)} {tuple(getattr(dst_scale, 'shape', ()))}")
    C.tensor("block_table", block_table, dtype=C.INDEX, dim=2)
    B = block_table.shape[0]
    C.tensor("cu_seq_lens", cu_seq_lens, dtype=C.INDEX, shape=(B + 1,))
    C.same_device(kv_cache=kv_cache, dst_k=dst_k, dst_scale=dst_scale, block_table=block_table,
                  cu_seq_lens=cu_seq_lens)
    if B and value_checks(cu_seq_lens):
        cu = cu_seq_lens.long()
        lens = cu[1:] - cu[:-1]
        if int(cu[0]) < 0 or bool((lens < 0).any()) or int(cu[-1]) > T:
            raise ValueError(f"cu_seq_lens must be non-decreasing from >= 0 up to at most {T} (the rows of dst_k)")
        _needed_pages_valid("block_table", block_table, lens, bs, pages.shape[0], allow_padding=False)
    _run("cp_gather_indexer_k_quant_cache", kv_cache.device, kv_cache, dst_k, dst_scale, block_table, cu_seq_lens)


# torch.ops.dsv4_rocm.* with vLLM's torch.ops._C schemas
_define("indexer_k_quant_and_cache(Tensor k, Tensor(a!) kv_cache, Tensor slot_mapping, int quant_block_size, "
        "str scale_fmt) -> ()", indexer_k_quant_and_cache, _none)
_define("cp_gather_indexer_k_quant_cache(Tensor kv_cache, Tensor(a!) dst_k, Tensor(b!) dst_scale, "
        "Tensor block_table, Tensor cu_seq_lens) -> ()", cp_gather_indexer_k_quant_cache, _none)


def top_k_per_row(logits, row_starts, row_ends, k: int):
    C.tensor("logits", logits, dtype=torch.float32, dim=2)
    C.tensor("row_starts", row_starts, dtype=C.INDEX, shape=(logits.shape[0],))
    C.tensor("row_ends", row_ends, dtype=C.INDEX, shape=(logits.shape[0],))
    C.positive_int("k", k)
    if logits.shape[0] and (int(row_starts.min()) < 0 or int(row_ends.max()) > logits.shape[1]):
        raise ValueError(f"row_starts/row_ends must lie in [0, {logits.shape[1]}]")
    return _run("top_k_per_row", logits.device, logits, row_starts, row_ends, k)
