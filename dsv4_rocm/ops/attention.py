"""Sparse MLA attention (FlashMLA semantics); dsv4_rocm.flash_mla wraps these in FlashMLA's API."""
import torch

from .. import _checks as C
from .. import layout as L
from ..reference import attention as _ra, cache as _rc
from ._dispatch import register, run as _run

__all__ = ["sparse_mla_decode", "sparse_mla_prefill"]

register("sparse_mla_decode", _ra.flash_mla_with_kvcache_sparse,
         triton="dsv4_rocm.triton.sparse_mla_decode:sparse_mla_decode")
register("sparse_mla_prefill", _ra.flash_mla_sparse_fwd,
         triton="dsv4_rocm.triton.sparse_mla_prefill:sparse_mla_prefill")


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
