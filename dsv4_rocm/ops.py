"""Public ops of dsv4_rocm. Each op checks its arguments, then runs the implementation picked for the
device: ``hip`` (dsv4_rocm._C) > ``triton`` > ``reference`` among those the op has.

``use_backend(name)`` or ``DSV4_BACKEND=reference|triton|hip`` forces a backend; asking for one the
machine lacks (Triton or a GPU missing, _C not built) is an error, never a silent fallback. An op with
no kernel in the forced backend runs its best other implementation.

Names and argument orders follow vLLM (FlashMLA / DeepGEMM where the op is theirs). The module can be
passed as ``impl`` to ``reference.layer.layer_forward``.
"""
import contextlib
import importlib
import importlib.util
import os
from typing import Optional

import torch

from . import _checks as C
from . import layout as L
from .reference import attention as _ra, cache as _rc, compressor as _rcomp, indexer as _ri
from .reference import metadata as _rm, norm as _rn, output as _ro, qkv as _rq

BACKENDS = ("reference", "triton", "hip")

# op name -> {backend: "module:function"}; reference entries are the oracle functions themselves
_KERNELS = {
    "sparse_mla_decode": {"triton": "dsv4_rocm.triton.sparse_mla_decode:sparse_mla_decode"},
    "sparse_mla_prefill": {"triton": "dsv4_rocm.triton.sparse_mla_prefill:sparse_mla_prefill"},
    "quantize_and_insert_k_cache": {"hip": "dsv4_rocm.hip_ops:quantize_and_insert_k_cache"},
    "fused_qnorm_rope_kv_rope_quant_insert": {"hip": "dsv4_rocm.hip_ops:fused_qnorm_rope_kv_rope_quant_insert"},
    "fused_q_kv_rmsnorm": {"hip": "dsv4_rocm.hip_ops:fused_q_kv_rmsnorm"},
    "dequantize_and_gather_k_cache": {"hip": "dsv4_rocm.hip_ops:dequantize_and_gather_k_cache"},
}
_REFERENCE = {
    "fused_q_kv_rmsnorm": _rn.fused_q_kv_rmsnorm,
    "fused_qnorm_rope_kv_rope_quant_insert": _rq.fused_qnorm_rope_kv_rope_quant_insert,
    "quantize_and_insert_k_cache": _rc.quantize_and_insert_k_cache,
    "dequantize_and_gather_k_cache": _rc.dequantize_and_gather_k_cache,
    "indexer_k_gather": _rc.indexer_k_gather,
    "compressor_kv_score": _rcomp.compressor_kv_score,
    "fused_compress_norm_rope_insert": _rcomp.compress_norm_rope_insert,
    "fused_indexer_q_rope_quant": _ri.indexer_q_rope_quant,
    "fp8_mqa_logits": _ri.fp8_mqa_logits,
    "fp8_paged_mqa_logits": _ri.fp8_paged_mqa_logits,
    "top_k_per_row": _ri.top_k_per_row,
    "get_compressed_slot_mapping": _rm.get_compressed_slot_mapping,
    "compute_swa_indices_and_lens": _rm.compute_swa_indices_and_lens,
    "compute_global_topk_indices_and_lens": _rm.compute_global_topk_indices_and_lens,
    "build_c128a_topk_metadata": _rm.build_c128a_topk_metadata,
    "combine_topk_swa_indices": _rm.combine_topk_swa_indices,
    "sparse_mla_decode": _ra.flash_mla_with_kvcache_sparse,
    "sparse_mla_prefill": _ra.flash_mla_sparse_fwd,
    "fused_inv_rope_fp8_quant": _ro.fused_inv_rope_fp8_quant,
    "fp8_einsum": _ro.fp8_einsum,
    "fp8_linear": _ro.fp8_linear,
    "merge_attn_states": _ro.merge_attn_states,
}

_override: Optional[str] = None


def _check_backend_name(name):
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose from {BACKENDS}")


@contextlib.contextmanager
def _restore(prev):
    global _override
    try:
        yield
    finally:
        _override = prev


def use_backend(name: Optional[str]):
    """Force a backend (None = automatic). Usable as a plain call or as a context manager."""
    global _override
    if name is not None:
        _check_backend_name(name)
    prev, _override = _override, name
    return _restore(prev)


def _hip_buildable() -> bool:
    """dsv4_rocm._C is built, or can be built on first use (kernel sources + hipcc/nvcc present)."""
    if importlib.util.find_spec("dsv4_rocm._C") is not None:
        return True
    import shutil
    from ._build import sources_present
    compiler = "hipcc" if torch.version.hip is not None else "nvcc"
    return sources_present() and (torch.version.hip is not None or torch.version.cuda is not None) \
        and shutil.which(compiler) is not None


def machine_backends(device) -> tuple:
    """Backends this machine can run for tensors on ``device``."""
    device = torch.device(device)
    have = ["reference"]
    if device.type == "cuda":
        if importlib.util.find_spec("triton") is not None:
            have.append("triton")
        if _hip_buildable():
            have.append("hip")
    return tuple(have)


def backend_for(op: str, device) -> str:
    if op not in _REFERENCE:
        raise ValueError(f"unknown op {op!r}")
    have = machine_backends(device)
    forced = _override or os.environ.get("DSV4_BACKEND") or None
    if forced:
        _check_backend_name(forced)
        if forced not in have:
            raise ValueError(f"backend {forced!r} is not available for {torch.device(device)} on this machine "
                             f"(available: {have})")
        if forced == "reference" or forced in _KERNELS.get(op, {}):
            return forced
    for b in ("hip", "triton"):
        if b in have and b in _KERNELS.get(op, {}):
            return b
    return "reference"


def implementation(op: str, device):
    b = backend_for(op, device)
    if b == "reference":
        return _REFERENCE[op]
    mod, fn = _KERNELS[op][b].split(":")
    return getattr(importlib.import_module(mod), fn)


def _run(op, device, *args, **kwargs):
    return implementation(op, device)(*args, **kwargs)


# ---- norms, Q/KV path, cache ------------------------------------------------------------------------
def fused_q_kv_rmsnorm(qr, kv, q_weight, kv_weight, eps: float):
    C.tensor("qr", qr, dtype=torch.bfloat16, dim=2)
    C.tensor("kv", kv, dtype=torch.bfloat16, shape=(qr.shape[0], None))
    if qr.shape[1] % 8 or kv.shape[1] % 8:
        raise ValueError(f"qr and kv rows must be multiples of 8 values, got {qr.shape[1]} and {kv.shape[1]}")
    C.tensor("q_weight", q_weight, shape=(qr.shape[1],))
    C.tensor("kv_weight", kv_weight, shape=(kv.shape[1],))
    C.same_device(qr=qr, kv=kv, q_weight=q_weight, kv_weight=kv_weight)
    return _run("fused_q_kv_rmsnorm", qr.device, qr, kv, q_weight, kv_weight, eps)


def _check_cos_sin(cos_sin_cache, positions):
    C.tensor("cos_sin_cache", cos_sin_cache, dtype=torch.float32, shape=(None, 64))
    C.tensor("positions", positions, dtype=C.INDEX, dim=1)
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= cos_sin_cache.shape[0]):
        raise ValueError(f"positions must lie in [0, {cos_sin_cache.shape[0]}) (rows of cos_sin_cache)")


def _check_slots(name, slots, cache, block_size, indexer=False):
    C.tensor(name, slots, dtype=C.INDEX, dim=1)
    pages = _rc.as_pages(cache, block_size, indexer=indexer)
    if slots.numel() and int(slots.max()) >= pages.shape[0] * block_size:
        raise ValueError(f"{name}: slot {int(slots.max())} is outside the cache "
                         f"({pages.shape[0]} pages x {block_size})")


def fused_qnorm_rope_kv_rope_quant_insert(q, kv, swa_kv_cache_2d, slot_mapping, positions, cos_sin_cache,
                                          padded_heads: int, eps: float, block_size: int):
    """q bf16 [T, H, 512] -> q_padded bf16 [T, padded_heads, 512]; kv bf16 [T, 512] RoPE'd, quantized and
    written at slot_mapping (first len(slot_mapping) tokens; negative slots skipped)."""
    C.tensor("q", q, dtype=torch.bfloat16, shape=(None, None, 512))
    C.tensor("kv", kv, dtype=torch.bfloat16, shape=(q.shape[0], 512))
    C.positive_int("block_size", block_size)
    if padded_heads not in (64, 128) or padded_heads < q.shape[1]:
        raise ValueError(f"padded_heads must be 64 or 128 and >= the {q.shape[1]} heads of q, got {padded_heads}")
    _check_cos_sin(cos_sin_cache, positions)
    if positions.shape[0] != q.shape[0]:
        raise ValueError(f"positions has {positions.shape[0]} entries for {q.shape[0]} tokens")
    if slot_mapping.shape[0] > q.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {q.shape[0]} tokens")
    _check_slots("slot_mapping", slot_mapping, swa_kv_cache_2d, block_size)
    C.same_device(q=q, kv=kv, swa_kv_cache_2d=swa_kv_cache_2d, slot_mapping=slot_mapping, positions=positions,
                  cos_sin_cache=cos_sin_cache)
    return _run("fused_qnorm_rope_kv_rope_quant_insert", q.device, q, kv, swa_kv_cache_2d, slot_mapping, positions,
                cos_sin_cache, padded_heads, eps, block_size)


def quantize_and_insert_k_cache(k, k_cache, slot_mapping, block_size: int):
    """k bf16 [T, 512] (RoPE applied) -> fp8_ds_mla records at slot_mapping (vLLM's op)."""
    C.tensor("k", k, dtype=torch.bfloat16, shape=(None, 512))
    C.positive_int("block_size", block_size)
    if slot_mapping.shape[0] > k.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {k.shape[0]} tokens")
    _check_slots("slot_mapping", slot_mapping, k_cache, block_size)
    C.same_device(k=k, k_cache=k_cache, slot_mapping=slot_mapping)
    return _run("quantize_and_insert_k_cache", k.device, k, k_cache, slot_mapping, block_size)


def dequantize_and_gather_k_cache(k_cache, slots, block_size: int):
    """bf16 [N, 512] rows at slots (zero rows for negative slots)."""
    C.positive_int("block_size", block_size)
    _check_slots("slots", slots, k_cache, block_size)
    return _run("dequantize_and_gather_k_cache", k_cache.device, k_cache, slots, block_size)


def indexer_k_gather(kv_cache, slots, block_size: int):
    C.positive_int("block_size", block_size)
    _check_slots("slots", slots, kv_cache, block_size, indexer=True)
    return _run("indexer_k_gather", kv_cache.device, kv_cache, slots, block_size)


# ---- compressor --------------------------------------------------------------------------------------
def compressor_kv_score(x, w_kv_gate, ape, positions, ratio: int):
    if ratio not in (4, 128):
        raise ValueError(f"ratio must be 4 or 128, got {ratio}")
    C.tensor("x", x, dtype=torch.bfloat16, dim=2)
    C.tensor("w_kv_gate", w_kv_gate, shape=(None, x.shape[1]))
    C.tensor("ape", ape, shape=(ratio, w_kv_gate.shape[0] // 2))
    C.tensor("positions", positions, dtype=C.INDEX, shape=(x.shape[0],))
    return _run("compressor_kv_score", x.device, x, w_kv_gate, ape, positions, ratio)


def fused_compress_norm_rope_insert(kv, score, positions, query_start_loc, state, state_indices, norm_weight,
                                    cos_sin_cache, compressed_slot_mapping, out_cache, block_size: int, ratio: int,
                                    target: str = "main", eps: float = 1e-6):
    if ratio not in (4, 128):
        raise ValueError(f"ratio must be 4 or 128, got {ratio}")
    if target not in ("main", "indexer"):
        raise ValueError(f"target must be 'main' or 'indexer', got {target!r}")
    D = 512 if target == "main" else 128
    c = _rcomp.coff(ratio)
    C.tensor("kv", kv, dtype=torch.float32, shape=(None, c * D))
    C.tensor("score", score, dtype=torch.float32, shape=kv.shape)
    C.tensor("state", state, dtype=torch.float32, shape=(None, _rcomp.ring_size(ratio), 2 * c * D))
    C.tensor("query_start_loc", query_start_loc, dtype=C.INDEX, dim=1)
    C.tensor("state_indices", state_indices, dtype=C.INDEX, shape=(query_start_loc.shape[0] - 1,))
    C.tensor("norm_weight", norm_weight, shape=(D,))
    _check_cos_sin(cos_sin_cache, positions)
    _check_slots("compressed_slot_mapping", compressed_slot_mapping, out_cache, block_size, indexer=target == "indexer")
    if int(query_start_loc[-1]) != kv.shape[0]:
        raise ValueError(f"query_start_loc ends at {int(query_start_loc[-1])}, kv has {kv.shape[0]} tokens")
    if state_indices.numel() and int(state_indices.max()) >= state.shape[0]:
        raise ValueError(f"state_indices: {int(state_indices.max())} >= {state.shape[0]} state slots")
    return _run("fused_compress_norm_rope_insert", kv.device, kv, score, positions, query_start_loc, state,
                state_indices, norm_weight, cos_sin_cache, compressed_slot_mapping, out_cache, block_size, ratio,
                target, eps)


# ---- indexer -----------------------------------------------------------------------------------------
def fused_indexer_q_rope_quant(qi, positions, cos_sin_cache, weights, softmax_scale: float = 128 ** -0.5):
    """qi bf16 [T, H, 128], weights [T, H] -> (q8 uint8 [T, H, 128], folded weights fp32 [T, H])."""
    C.tensor("qi", qi, dtype=torch.bfloat16, shape=(None, None, 128))
    C.tensor("weights", weights, shape=(qi.shape[0], qi.shape[1]))
    _check_cos_sin(cos_sin_cache, positions)
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


def top_k_per_row(logits, row_starts, row_ends, k: int):
    C.tensor("logits", logits, dtype=torch.float32, dim=2)
    C.tensor("row_starts", row_starts, dtype=C.INDEX, shape=(logits.shape[0],))
    C.tensor("row_ends", row_ends, dtype=C.INDEX, shape=(logits.shape[0],))
    C.positive_int("k", k)
    if logits.shape[0] and (int(row_starts.min()) < 0 or int(row_ends.max()) > logits.shape[1]):
        raise ValueError(f"row_starts/row_ends must lie in [0, {logits.shape[1]}]")
    return _run("top_k_per_row", logits.device, logits, row_starts, row_ends, k)


# ---- metadata ----------------------------------------------------------------------------------------
def _check_bt(block_table, token_to_req, **others):
    C.tensor("block_table", block_table, dtype=C.INDEX, dim=2)
    C.tensor("token_to_req", token_to_req, dtype=C.INDEX, dim=1)
    C.same_device(block_table=block_table, token_to_req=token_to_req, **others)
    if token_to_req.numel() and int(token_to_req.max()) >= block_table.shape[0]:
        raise ValueError("token_to_req names a request beyond block_table's rows")


def get_compressed_slot_mapping(positions, token_to_req, block_table, ratio: int, block_size: int, slot_mapping=None):
    _check_bt(block_table, token_to_req, positions=positions, slot_mapping=slot_mapping)
    C.tensor("positions", positions, dtype=C.INDEX, shape=token_to_req.shape)
    C.positive_int("block_size", block_size)
    C.positive_int("ratio", ratio)
    return _run("get_compressed_slot_mapping", positions.device, positions, token_to_req, block_table, ratio,
                block_size, slot_mapping)


def compute_swa_indices_and_lens(positions, token_to_req, block_table, slot_mapping, window: int, block_size: int = 64):
    _check_bt(block_table, token_to_req, positions=positions, slot_mapping=slot_mapping)
    C.tensor("positions", positions, dtype=C.INDEX, shape=token_to_req.shape)
    C.positive_int("window", window)
    return _run("compute_swa_indices_and_lens", positions.device, positions, token_to_req, block_table, slot_mapping,
                window, block_size)


def compute_global_topk_indices_and_lens(topk_local, token_to_req, block_table, block_size: int, is_valid_token):
    _check_bt(block_table, token_to_req, topk_local=topk_local, is_valid_token=is_valid_token)
    C.tensor("topk_local", topk_local, dtype=C.INDEX, shape=(token_to_req.shape[0], None))
    return _run("compute_global_topk_indices_and_lens", topk_local.device, topk_local, token_to_req, block_table,
                block_size, is_valid_token)


def build_c128a_topk_metadata(positions, token_to_req, block_table, slot_mapping, is_decode_token,
                              max_model_len: int, block_size: int = 2, ratio: int = 128):
    _check_bt(block_table, token_to_req, positions=positions, slot_mapping=slot_mapping,
              is_decode_token=is_decode_token)
    C.positive_int("max_model_len", max_model_len)
    return _run("build_c128a_topk_metadata", positions.device, positions, token_to_req, block_table, slot_mapping,
                is_decode_token, max_model_len, block_size, ratio)


def combine_topk_swa_indices(topk_local, topk_lens, positions, req_in_chunk, gather_start, num_compressed_rows: int,
                             rows_per_req: int, window: int):
    C.tensor("topk_local", topk_local, dtype=C.INDEX, dim=2)
    C.tensor("topk_lens", topk_lens, dtype=C.INDEX, shape=(topk_local.shape[0],))
    C.same_device(topk_local=topk_local, topk_lens=topk_lens, positions=positions, req_in_chunk=req_in_chunk,
                  gather_start=gather_start)
    return _run("combine_topk_swa_indices", topk_local.device, topk_local, topk_lens, positions, req_in_chunk,
                gather_start, num_compressed_rows, rows_per_req, window)


# ---- sparse attention --------------------------------------------------------------------------------
def _check_sink(attn_sink, h):
    if attn_sink is not None:
        C.tensor("attn_sink", attn_sink, dtype=torch.float32, shape=(h,))


def _check_lengths(name, lengths, b, s_q):
    if lengths is not None:
        C.tensor(name, lengths, dtype=torch.int32)
        if tuple(lengths.shape) not in ((b,), (b, s_q)):
            raise ValueError(f"{name} must have shape [{b}] or [{b}, {s_q}], got {tuple(lengths.shape)}")


def sparse_mla_decode(q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices_in_kvcache,
                      extra_topk_length, softmax_scale: float):
    """FlashMLA sparse decode over fp8_ds_mla pages: (out bf16 [b, s_q, h, 512], lse fp32 [b, h, s_q])."""
    C.tensor("q", q, dtype=torch.bfloat16, shape=(None, None, None, 512))
    b, s_q, h, _ = q.shape
    if h not in (64, 128):
        raise ValueError(f"q must have 64 or 128 heads (pad them), got {h}")
    for name, cache, idx, ln in (("k_cache", k_cache, indices, topk_length),
                                 ("extra_k_cache", extra_k_cache, extra_indices_in_kvcache, extra_topk_length)):
        if cache is None:
            if idx is not None or (ln is not None and name != "k_cache"):
                raise ValueError(f"{name} is None but its indices/lengths are given")
            if name == "k_cache":
                raise ValueError("k_cache is required")
            continue
        C.tensor(name, cache, dtype=torch.uint8, shape=(None, None, 1, L.TOKEN_BYTES))
        _rc.as_pages(cache, cache.shape[1], name)
        iname = "indices" if name == "k_cache" else "extra_indices_in_kvcache"
        C.tensor(iname, idx, dtype=torch.int32, shape=(b, s_q, None))
        _check_lengths("topk_length" if name == "k_cache" else "extra_topk_length", ln, b, s_q)
        C.same_device(q=q, **{name: cache, iname: idx})
    _check_sink(attn_sink, h)
    return _run("sparse_mla_decode", q.device, q, k_cache, indices, topk_length, attn_sink, extra_k_cache,
                extra_indices_in_kvcache, extra_topk_length, softmax_scale)


def sparse_mla_prefill(q, kv, indices, sm_scale: float, d_v: int = 512, attn_sink=None, topk_length=None):
    """FlashMLA sparse prefill over a bf16 kv: (out bf16 [s_q, h, 512], max_logits, lse [s_q, h])."""
    C.tensor("q", q, dtype=torch.bfloat16, shape=(None, None, 512))
    C.tensor("kv", kv, dtype=torch.bfloat16, shape=(None, 1, 512))
    C.tensor("indices", indices, dtype=torch.int32, shape=(q.shape[0], 1, None))
    if d_v != 512:
        raise ValueError(f"d_v must be 512, got {d_v}")
    if q.shape[1] not in (64, 128):
        raise ValueError(f"q must have 64 or 128 heads (pad them), got {q.shape[1]}")
    _check_sink(attn_sink, q.shape[1])
    if topk_length is not None:
        C.tensor("topk_length", topk_length, dtype=torch.int32, shape=(q.shape[0],))
    C.same_device(q=q, kv=kv, indices=indices)
    return _run("sparse_mla_prefill", q.device, q, kv, indices, sm_scale, d_v, attn_sink, topk_length)


# ---- output path -------------------------------------------------------------------------------------
def fused_inv_rope_fp8_quant(o, positions, cos_sin_cache, n_groups: int):
    C.tensor("o", o, dtype=torch.bfloat16, shape=(None, None, 512))
    C.positive_int("n_groups", n_groups)
    if o.shape[1] % n_groups:
        raise ValueError(f"n_groups {n_groups} must divide the {o.shape[1]} heads of o")
    _check_cos_sin(cos_sin_cache, positions)
    return _run("fused_inv_rope_fp8_quant", o.device, o, positions, cos_sin_cache, n_groups)


def fp8_einsum(a8, a_scale, w8, w_scale):
    a8, w8 = C.fp8_bytes("a", a8), C.fp8_bytes("w", w8)
    C.tensor("a", a8, dim=3)
    T, G, r = a8.shape
    C.tensor("w", w8, shape=(G, None, r))
    C.tensor("a_scale", a_scale, dtype=torch.float32, shape=(T, G, r // 128))
    C.tensor("w_scale", w_scale, dtype=torch.float32, shape=(G, w8.shape[1] // 128, r // 128))
    return _run("fp8_einsum", a8.device, a8, a_scale, w8, w_scale)


def fp8_linear(x, w8, w_scale):
    w8 = C.fp8_bytes("weight", w8)
    C.tensor("x", x, dtype=torch.bfloat16, dim=2)
    C.tensor("weight", w8, shape=(None, x.shape[1]))
    C.tensor("weight_scale", w_scale, dtype=torch.float32, shape=(w8.shape[0] // 128, x.shape[1] // 128))
    return _run("fp8_linear", x.device, x, w8, w_scale)


def merge_attn_states(out_a, lse_a, out_b, lse_b):
    C.tensor("out_a", out_a, dim=3)
    C.tensor("out_b", out_b, shape=tuple(out_a.shape))
    C.tensor("lse_a", lse_a, dtype=torch.float32, shape=tuple(out_a.shape[:2]))
    C.tensor("lse_b", lse_b, dtype=torch.float32, shape=tuple(out_a.shape[:2]))
    return _run("merge_attn_states", out_a.device, out_a, lse_a, out_b, lse_b)
