"""Lightning indexer of C4 layers: vLLM's q quant and indexer-K cache ops, DeepGEMM's logits ops, top-k.

Call forms are vLLM's (``fused_indexer_q_rope_quant``, ``indexer_k_quant_and_cache``,
``cp_gather_indexer_k_quant_cache``) and DeepGEMM's as vLLM's ``utils/deep_gemm`` calls them
(``fp8_mqa_logits``, ``fp8_paged_mqa_logits``, ``get_paged_mqa_logits_metadata``). The math is in
``dsv4_rocm.reference.indexer``. The indexer-K cache is accepted as ``[num_blocks, block_size, 132]`` (vLLM's
allocation) or ``[num_blocks, block_size, 1, 132]`` (DeepGEMM's view), uint8 or float8_e4m3fn; its page
stride is ``stride(0)``. The FP8 query is float8_e4m3fn by default; ``use_fnuz=True`` gives vLLM's gfx942 query
(float8_e4m3fnuz, maximum 224, the scale folded into the weights doubled), and the logits ops read a
float8_e4m3fnuz query (and the prefill op a float8_e4m3fnuz k) as fnuz (docs/numerics.md#fnuz-query).
Bad input is a ValueError naming the argument before anything is written; checks
that read tensor values follow ``value_checks`` (docs/conventions.md).
"""
import torch

from .. import _checks as C
from .. import cache_views as V
from .. import layout as L
from ..reference import indexer as _ri
from ._dispatch import HAVE_TRITON, register, run as _run, value_checks
from .library import _define, _none

__all__ = ["fused_indexer_q_rope_quant", "fp8_mqa_logits", "fp8_paged_mqa_logits", "get_paged_mqa_logits_metadata",
           "fp8_fp4_mqa_logits", "fp8_fp4_paged_mqa_logits", "indexer_k_quant_and_cache",
           "cp_gather_indexer_k_quant_cache"]

if HAVE_TRITON:     # importing a kernel imports Triton, which is optional: without it the ops run their oracles
    from ..triton.indexer.cp_gather_indexer_k_quant_cache import cp_gather_indexer_k_quant_cache as _triton_gather
    from ..triton.indexer.fp8_mqa_logits import fp8_mqa_logits as _triton_logits
    from ..triton.indexer.fp8_paged_mqa_logits import fp8_paged_mqa_logits as _triton_paged_logits, has_fp8_mma
    from ..triton.indexer.fused_indexer_q_rope_quant import fused_indexer_q_rope_quant as _triton_q_quant
    from ..triton.indexer.indexer_k_quant_and_cache import indexer_k_quant_and_cache as _triton_k_insert
    from ..triton.indexer.top_k_per_row import (persistent_topk as _triton_persistent_topk,
                                                top_k_global_decode_op as _triton_topk_global,
                                                top_k_per_row_decode as _triton_topk_decode,
                                                top_k_per_row_prefill as _triton_topk_prefill)
    # the logits kernels need fp8 matrix instructions: on gfx90a or sm_80 the ops run their oracles
    _LOGITS_RUN_ON = {"triton": has_fp8_mma}
else:
    _triton_gather = _triton_logits = _triton_paged_logits = _triton_q_quant = _triton_k_insert = None
    _triton_persistent_topk = _triton_topk_decode = _triton_topk_prefill = _LOGITS_RUN_ON = None
    _triton_topk_global = None
register("fused_indexer_q_rope_quant", _ri.fused_indexer_q_rope_quant, triton=_triton_q_quant)
register("fp8_mqa_logits", _ri.fp8_mqa_logits, triton=_triton_logits, runs_on=_LOGITS_RUN_ON)
register("fp8_paged_mqa_logits", _ri.fp8_paged_mqa_logits, triton=_triton_paged_logits, runs_on=_LOGITS_RUN_ON)
register("get_paged_mqa_logits_metadata", _ri.get_paged_mqa_logits_metadata)
register("indexer_k_quant_and_cache", _ri.indexer_k_quant_and_cache, triton=_triton_k_insert)
register("cp_gather_indexer_k_quant_cache", _ri.cp_gather_indexer_k_quant_cache, triton=_triton_gather)

FLOATS = (torch.bfloat16, torch.float16, torch.float32)
FP8 = (torch.float8_e4m3fn, torch.uint8)
FP8_OR_FNUZ = FP8 + (torch.float8_e4m3fnuz,)      # query and gathered k of the logits: bytes read as the dtype says
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
                               use_fp4: bool = False, weights_out_dtype: torch.dtype = torch.float32, *,
                               use_fnuz: bool = False):
    """index_q [T, H, 128] (bf16, fp16 or fp32), positions int [T], cos/sin table fp32 or bf16 [P, 64],
    index_weights [T, H] -> (q float8_e4m3fn [T, H, 128], w' fp32 [T, H]) with the q scale folded into w',
    or with use_fp4 ((packed uint8 [T, H, 64], UE8M0 scales int32 [T, H]), w') (reference.indexer).
    ``weights_out_dtype`` (vLLM 0.33): w''s dtype, float32, or with use_fp4 bfloat16 (the fp32 w' rounded
    to nearest even, what DeepGEMM's MXFP4 logits take); vLLM's FP8 path takes float32 only.
    ``use_fnuz`` (a keyword of dsv4_rocm's; vLLM 0.33 picks the flavour from its platform, e4m3fnuz on gfx942,
    and passes its kernel ``use_fnuz``): q is vLLM's gfx942 query, float8_e4m3fnuz with maximum 224, the same
    bytes as the default query and w' exactly twice its w' (docs/numerics.md#fnuz-query). FP8 query only."""
    C.tensor("index_q", index_q, dtype=FLOATS, shape=(None, None, L.INDEXER_DIM))
    _unit_inner("index_q", index_q)
    T, H = index_q.shape[:2]
    C.cos_sin(index_q_cos_sin_cache, positions, dtype=(torch.float32, torch.bfloat16), n_tokens=T)
    C.tensor("index_weights", index_weights, dtype=FLOATS, shape=(T, H))
    C.finite_float("index_weights_softmax_scale", index_weights_softmax_scale)
    C.finite_float("index_weights_head_scale", index_weights_head_scale)
    _flag("use_fp4", use_fp4)
    _flag("use_fnuz", use_fnuz)
    if use_fnuz and use_fp4:
        raise ValueError("use_fnuz=True names the FP8 query's e4m3fnuz flavour; the MXFP4 query (use_fp4=True) "
                         "has none")
    if weights_out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"weights_out_dtype must be torch.float32 or torch.bfloat16, got {weights_out_dtype!r}")
    if weights_out_dtype == torch.bfloat16 and not use_fp4:
        raise ValueError("weights_out_dtype=torch.bfloat16 is for the MXFP4 query (use_fp4=True); the FP8 "
                         "query's folded weights are float32 (as in vLLM)")
    C.same_device(positions=positions, index_q=index_q, index_q_cos_sin_cache=index_q_cos_sin_cache,
                  index_weights=index_weights)
    q, w = _run("fused_indexer_q_rope_quant", index_q.device, positions, index_q, index_q_cos_sin_cache,
                index_weights, float(index_weights_softmax_scale), float(index_weights_head_scale), use_fp4, use_fnuz)
    return q, w if weights_out_dtype == torch.float32 else w.to(weights_out_dtype)


# ---- logits ---------------------------------------------------------------------------------------
def _q_and_weights(q, weights, dims):
    """q fp8 [..., H, 128] of ``dims`` dimensions (OCP, or float8_e4m3fnuz: vLLM's gfx942 query); weights fp32
    [rows, H] with a unit inner stride."""
    C.tensor("q", q, dtype=FP8_OR_FNUZ)
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
    elsewhere (with clean_logits=False the entries outside are unspecified). q and k are float8_e4m3fn (or
    uint8 bytes), read as OCP, or float8_e4m3fnuz, read as fnuz: vLLM's gfx942 query and gathered keys, whose
    scales (w', k_scale) are those of maximum 224."""
    if not isinstance(kv, (tuple, list)) or len(kv) != 2:
        raise ValueError(f"kv must be the pair (k_fp8, k_scale), got {type(kv).__name__}")
    k8, k_scale = kv
    _q_and_weights(q, weights, 3)
    M = q.shape[0]
    C.tensor("kv[0]", k8, dtype=FP8_OR_FNUZ, shape=(None, L.INDEXER_DIM))
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
    """DeepGEMM's decode logits over the paged indexer-K cache: q fp8 [B, next_n, H, 128] (next_n <= 4;
    float8_e4m3fnuz is read as fnuz, vLLM's gfx942 query; the cache holds OCP bytes),
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
    """vLLM's op: k [T, 128] -> UE8M0 FP8 records (128 bytes + 4 scale bytes) at slot_mapping[:n] of the
    indexer-K cache (n = len(slot_mapping) <= T); a negative slot is padding. One UE8M0 scale a 128-value
    entry (quant_block_size 128), stored as scale_fmt says: "ue8m0", the fp32 2^e; "mxfp8", its UE8M0 byte
    four times (vLLM's form for MX-scaled logits kernels; dsv4_rocm's logits kernels read the fp32 form)."""
    C.tensor("k", k, dtype=FLOATS, shape=(None, L.INDEXER_DIM))
    _unit_inner("k", k)
    pages, bs = _indexer_cache(kv_cache)
    if quant_block_size != L.INDEXER_DIM or isinstance(quant_block_size, bool):
        raise ValueError(f"quant_block_size must be {L.INDEXER_DIM} (one scale an entry), got {quant_block_size!r}")
    if scale_fmt not in ("ue8m0", "mxfp8"):
        raise ValueError(f"scale_fmt must be 'ue8m0' (fp32 power-of-two scales) or 'mxfp8' (UE8M0 scale bytes), "
                         f"got {scale_fmt!r}")
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
    C.no_overlap("dst_k", C.tensor("dst_k", dst_k, dtype=FP8, shape=(None, L.INDEXER_DIM)))
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


# ---- top-k per row: vLLM's top_k_per_row_prefill / top_k_per_row_decode / persistent_topk ----------------
__all__ += ["top_k_per_row_prefill", "top_k_per_row_decode", "persistent_topk", "cooperative_topk",
            "top_k_global_decode"]

register("top_k_per_row_prefill", _ri.top_k_per_row_prefill, triton=_triton_topk_prefill)
register("top_k_per_row_decode", _ri.top_k_per_row_decode, triton=_triton_topk_decode)
register("persistent_topk", _ri.persistent_topk, triton=_triton_persistent_topk)
register("cooperative_topk", _ri.persistent_topk, triton=_triton_persistent_topk)
register("top_k_global_decode", _ri.top_k_global_decode, triton=_triton_topk_global)

TOP_K_MAX = 4096


def _check_top_k(logits, out, out_name, num_rows, k, logits_dtypes=(torch.float32,)):
    C.tensor("logits", logits, dtype=logits_dtypes, dim=2)
    C.no_overlap(out_name, C.tensor(out_name, out, dtype=torch.int32, dim=2))
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= TOP_K_MAX:
        raise ValueError(f"k must be an int in [1, {TOP_K_MAX}], got {k!r}")
    if not isinstance(num_rows, int) or isinstance(num_rows, bool) or num_rows < 0:
        raise ValueError(f"num_rows must be a non-negative int, got {num_rows!r}")
    if num_rows > logits.shape[0] or num_rows > out.shape[0]:
        raise ValueError(f"num_rows {num_rows} exceeds the rows of logits ({logits.shape[0]}) or {out_name} "
                         f"({out.shape[0]})")
    if out.shape[1] != k:
        raise ValueError(f"{out_name} must have k = {k} columns, got {tuple(out.shape)}")


def _check_strides(logits, stride0, stride1):
    for d, (name, v) in enumerate((("stride0", stride0), ("stride1", stride1))):
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError(f"{name} must be an int, got {v!r}")
        if logits.shape[d] > 1 and v != logits.stride(d):
            raise ValueError(f"{name} must be logits.stride({d}) = {logits.stride(d)}, got {v}")


def top_k_per_row_prefill(logits, row_starts, row_ends, out_idx, num_rows: int, stride0: int, stride1: int,
                          k: int) -> None:
    """Rows r < num_rows of logits fp32 [rows, ncols]: out_idx[r] (int32 [>= num_rows, k]) gets the columns of
    the k largest logits in [row_starts[r], row_ends[r]), relative to row_starts[r], unsorted; a row with
    n <= k columns gets [0, 1, ..., n-1, -1, ...]. Order, ties and NaN: docs/conventions.md."""
    _check_top_k(logits, out_idx, "out_idx", num_rows, k)
    _check_strides(logits, stride0, stride1)
    C.tensor("row_starts", row_starts, dtype=C.INDEX, dim=1)
    C.tensor("row_ends", row_ends, dtype=C.INDEX, dim=1)
    for name, t in (("row_starts", row_starts), ("row_ends", row_ends)):
        if t.shape[0] < num_rows:
            raise ValueError(f"{name} must have at least num_rows = {num_rows} entries, got {t.shape[0]}")
    C.same_device(logits=logits, row_starts=row_starts, row_ends=row_ends, out_idx=out_idx)
    from ._dispatch import value_checks
    if num_rows and value_checks(row_starts):
        s, e = row_starts[:num_rows].long(), row_ends[:num_rows].long()
        if int(s.min()) < 0 or int(e.max()) > logits.shape[1] or bool((e < s).any()):
            raise ValueError(f"row_starts/row_ends must satisfy 0 <= start <= end <= {logits.shape[1]}")
    _run("top_k_per_row_prefill", logits.device, logits, row_starts, row_ends, out_idx, num_rows, stride0, stride1,
         k)


def top_k_per_row_decode(logits, next_n: int, seq_lens, out_idx, num_rows: int, stride0: int, stride1: int,
                         k: int) -> None:
    """Row r < num_rows of logits is draft r % next_n of request r // next_n. seq_lens [B] (or [B, 1]) holds
    request lengths L and row r sees columns [0, L - next_n + r % next_n + 1); seq_lens [B, next_n] holds
    each row's own count. Counts are clamped into [0, ncols] (a negative one is an empty row). out_idx as
    for ``top_k_per_row_prefill``."""
    _check_decode(logits, next_n, seq_lens, out_idx, num_rows, stride0, stride1, k)
    _run("top_k_per_row_decode", logits.device, logits, next_n, seq_lens, out_idx, num_rows, stride0, stride1, k)


def top_k_global_decode(logits, next_n: int, seq_lens, out_idx, num_rows: int, stride0: int, stride1: int, k: int,
                        token_to_req_indices, block_table, block_size: int, is_valid_token, output_buffers=None, *,
                        needs_constant_topk: bool = False):
    """The C4 decode step's top-k and its global slots in one launch: equals
    ``top_k_per_row_decode(logits, next_n, seq_lens, out_idx, num_rows, stride0, stride1, k)`` followed by
    ``compute_global_topk_indices_and_lens(out_idx[:num_rows], token_to_req_indices, block_table, block_size,
    is_valid_token, output_buffers, needs_constant_topk=needs_constant_topk)``, whose (global indices int32
    [num_rows, k], lens int32 [num_rows]) it returns. Row t of out_idx is token t. The global rows follow
    the order the top-k rows were written in (the top-k order is unspecified, docs/conventions.md), so the
    pair equals the second op applied to this call's own out_idx; arguments are checked as both ops check
    them, before anything is written."""
    _check_decode(logits, next_n, seq_lens, out_idx, num_rows, stride0, stride1, k)
    from .metadata import check_global_topk_args
    check_global_topk_args(out_idx[:num_rows], token_to_req_indices, block_table, block_size, is_valid_token,
                           output_buffers, name="out_idx")
    C.same_device(logits=logits, token_to_req_indices=token_to_req_indices)
    return _run("top_k_global_decode", logits.device, logits, next_n, seq_lens, out_idx, num_rows, stride0, stride1,
                k, token_to_req_indices, block_table, block_size, is_valid_token, output_buffers,
                needs_constant_topk=needs_constant_topk)


def _check_decode(logits, next_n, seq_lens, out_idx, num_rows, stride0, stride1, k):
    _check_top_k(logits, out_idx, "out_idx", num_rows, k)
    _check_strides(logits, stride0, stride1)
    C.positive_int("next_n", next_n)
    C.tensor("seq_lens", seq_lens, dtype=C.INDEX)
    if seq_lens.dim() not in (1, 2) or (seq_lens.dim() == 2 and seq_lens.shape[1] not in (1, next_n)):
        raise ValueError(f"seq_lens must be [B], [B, 1] or [B, next_n = {next_n}], got {tuple(seq_lens.shape)}")
    if seq_lens.shape[0] * next_n < num_rows:
        raise ValueError(f"seq_lens covers {seq_lens.shape[0]} requests x next_n {next_n} < num_rows {num_rows}")
    C.same_device(logits=logits, seq_lens=seq_lens, out_idx=out_idx)


def persistent_topk(logits, lengths, output, workspace, k: int, max_seq_len: int) -> None:
    """Every row r of logits (fp32 or bf16 [rows, ncols]): output[r] (int32 [rows, k]) gets the top-k columns of
    logits[r, :lengths[r]] (lengths int32, one per row, 1-D or 2-D; clamped into [0, ncols]). workspace (a
    uint8 tensor) and max_seq_len are accepted as vLLM passes them; scratch comes from torch's allocator."""
    _workspace_form("persistent_topk", logits, lengths, output, workspace, k, max_seq_len)


def cooperative_topk(logits, lengths, output, workspace, k: int, max_seq_len: int) -> None:
    """vLLM's cooperative_topk (its few-row variant of persistent_topk): the same call form and result."""
    _workspace_form("cooperative_topk", logits, lengths, output, workspace, k, max_seq_len)


def _workspace_form(op, logits, lengths, output, workspace, k, max_seq_len):
    C.tensor("logits", logits, dtype=(torch.float32, torch.bfloat16), dim=2)
    C.tensor("output", output, dtype=torch.int32, dim=2)
    if output.shape[0] != logits.shape[0]:
        raise ValueError(f"output must have {logits.shape[0]} rows, got {output.shape[0]}")
    _check_top_k(logits, output, "output", logits.shape[0], k, logits_dtypes=(torch.float32, torch.bfloat16))
    C.tensor("lengths", lengths, dtype=torch.int32)
    if lengths.dim() not in (1, 2) or lengths.numel() != logits.shape[0]:
        raise ValueError(f"lengths must be 1-D or 2-D with {logits.shape[0]} entries, got {tuple(lengths.shape)}")
    C.tensor("workspace", workspace, dtype=torch.uint8)
    if not isinstance(max_seq_len, int) or isinstance(max_seq_len, bool) or max_seq_len < 0:
        raise ValueError(f"max_seq_len must be a non-negative int, got {max_seq_len!r}")
    C.same_device(logits=logits, lengths=lengths, output=output)
    _run(op, logits.device, logits, lengths, output, workspace, k, max_seq_len)
