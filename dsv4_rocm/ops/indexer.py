"""Lightning indexer of C4 layers: q quant, logits (DeepGEMM's forms), top-k."""
import torch

from .. import _checks as C
from ..reference import cache as _rc, indexer as _ri
from ._dispatch import register, run as _run

__all__ = ["fused_indexer_q_rope_quant", "fp8_mqa_logits", "fp8_paged_mqa_logits"]

register("fused_indexer_q_rope_quant", _ri.indexer_q_rope_quant)
register("fp8_mqa_logits", _ri.fp8_mqa_logits)
register("fp8_paged_mqa_logits", _ri.fp8_paged_mqa_logits)


def fused_indexer_q_rope_quant(qi, positions, cos_sin_cache, weights, softmax_scale: float = 128 ** -0.5):
    """qi bf16 [T, H, 128], weights [T, H] -> (q8 uint8 [T, H, 128], folded weights fp32 [T, H])."""
    C.tensor("qi", qi, dtype=torch.bfloat16, shape=(None, None, 128))
    C.tensor("weights", weights, shape=(qi.shape[0], qi.shape[1]))
    C.cos_sin(cos_sin_cache, positions)
    return _run("fused_indexer_q_rope_quant", qi.device, qi, positions, cos_sin_cache, weights, softmax_scale)


def fp8_mqa_logits(q8, k8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke):
    q8, k8 = C.fp8_bytes("q", q8), C.fp8_bytes("kv", k8)
    C.tensor("q", q8, shape=(None, None, 128))
    C.tensor("kv", k8, shape=(None, 128))
    C.tensor("kv_scale", k_scale, dtype=torch.float32, shape=(k8.shape[0],))
    C.tensor("weights", weights, shape=q8.shape[:2])
    C.tensor("cu_seqlen_ks", cu_seqlen_ks, dtype=C.INDEX, shape=(q8.shape[0],))
    C.tensor("cu_seqlen_ke", cu_seqlen_ke, dtype=C.INDEX, shape=(q8.shape[0],))
    return _run("fp8_mqa_logits", q8.device, q8, k8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke)


def fp8_paged_mqa_logits(q8, kv_cache, weights, context_lens, block_table, block_size: int, max_context_len: int):
    q8 = C.fp8_bytes("q", q8)
    C.tensor("q", q8, shape=(None, None, None, 128))
    B, nn = q8.shape[:2]
    C.tensor("weights", weights, shape=(B * nn, q8.shape[2]))
    C.tensor("context_lens", context_lens, dtype=C.INDEX)
    C.tensor("block_table", block_table, dtype=C.INDEX, shape=(B, None))
    C.positive_int("max_context_len", max_context_len)
    pages = _rc.as_pages(kv_cache, block_size, "kv_cache", indexer=True)
    if context_lens.numel() and int(context_lens.max()) > block_table.shape[1] * block_size:
        raise ValueError("context_lens exceed what block_table covers")
    if block_table.numel() and int(block_table.max()) >= pages.shape[0]:
        raise ValueError(f"block_table names a page >= {pages.shape[0]}")
    return _run("fp8_paged_mqa_logits", q8.device, q8, kv_cache, weights, context_lens, block_table, block_size,
                max_context_len)


# ---- top-k per row: vLLM's top_k_per_row_prefill / top_k_per_row_decode / persistent_topk ----------------
__all__ += ["top_k_per_row_prefill", "top_k_per_row_decode", "persistent_topk", "cooperative_topk"]

register("top_k_per_row_prefill", _ri.top_k_per_row_prefill,
         triton="dsv4_rocm.triton.top_k_per_row:top_k_per_row_prefill")
register("top_k_per_row_decode", _ri.top_k_per_row_decode,
         triton="dsv4_rocm.triton.top_k_per_row:top_k_per_row_decode")
register("persistent_topk", _ri.persistent_topk, triton="dsv4_rocm.triton.top_k_per_row:persistent_topk")
register("cooperative_topk", _ri.persistent_topk, triton="dsv4_rocm.triton.top_k_per_row:persistent_topk")

TOP_K_MAX = 4096


def _check_top_k(logits, out, out_name, num_rows, k, logits_dtypes=(torch.float32,)):
    C.tensor("logits", logits, dtype=logits_dtypes, dim=2)
    C.tensor(out_name, out, dtype=torch.int32, dim=2)
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
    _check_top_k(logits, out_idx, "out_idx", num_rows, k)
    _check_strides(logits, stride0, stride1)
    C.positive_int("next_n", next_n)
    C.tensor("seq_lens", seq_lens, dtype=C.INDEX)
    if seq_lens.dim() not in (1, 2) or (seq_lens.dim() == 2 and seq_lens.shape[1] not in (1, next_n)):
        raise ValueError(f"seq_lens must be [B], [B, 1] or [B, next_n = {next_n}], got {tuple(seq_lens.shape)}")
    if seq_lens.shape[0] * next_n < num_rows:
        raise ValueError(f"seq_lens covers {seq_lens.shape[0]} requests x next_n {next_n} < num_rows {num_rows}")
    C.same_device(logits=logits, seq_lens=seq_lens, out_idx=out_idx)
    _run("top_k_per_row_decode", logits.device, logits, next_n, seq_lens, out_idx, num_rows, stride0, stride1, k)


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
