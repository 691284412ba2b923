"""The Q/KV ops in vLLM's call forms: the q_lora / kv norms, and the fused q norm + RoPE with kv RoPE +
quant + cache insert (V40_584 or V41_528 pages, or the full-width caches of vLLM's FlashInfer sparse MLA:
per-tensor fp8 or plain bf16 rows).

cos_sin_cache is fp32 or bf16 [max_pos, 64]; positions and slots are int32 or int64; caches come in
every view vLLM holds (``dsv4_rocm.cache_views``). Bad input is a ValueError naming the argument before
anything is written (docs/conventions.md).
"""
import torch

from .. import _checks as C
from .. import cache_views as V
from .. import layout as L
from .. import hip_ops as _hip    # builds dsv4_rocm._C on a kernel's first call, not on import
from . import indexer as _idx
from ..reference import norm as _rn, qkv as _rq
from ._dispatch import HAVE_TRITON, register, run as _run, value_checks

__all__ = ["fused_q_kv_rmsnorm", "fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert",
           "fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert_out", "qnorm_rope_and_insert_full_k_cache",
           "qnorm_rope_and_insert_full_bf16_k_cache", "fused_deepseek_v4_kv_rope_insert", "decode_front"]

if HAVE_TRITON:     # importing a kernel imports Triton, which is optional: without it the ops run their oracles
    from ..triton.qkv.decode_front import decode_front as _triton_decode_front
    from ..triton.qkv.fused_deepseek_v4_kv_rope_insert import fused_deepseek_v4_kv_rope_insert as _triton_kv_insert
    from ..triton.qkv.qnorm_rope_and_insert_full_bf16_k_cache import \
        qnorm_rope_and_insert_full_bf16_k_cache as _triton_bf16_insert
else:
    _triton_kv_insert = _triton_bf16_insert = _triton_decode_front = None
register("fused_q_kv_rmsnorm", _rn.fused_q_kv_rmsnorm, hip=_hip.fused_q_kv_rmsnorm)
register("fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert", _rq.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert,
         hip=_hip.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert)
register("qnorm_rope_and_insert_full_k_cache", _rq.qnorm_rope_and_insert_full_k_cache,
         hip=_hip.qnorm_rope_and_insert_full_k_cache)
register("qnorm_rope_and_insert_full_bf16_k_cache", _rq.qnorm_rope_and_insert_full_bf16_k_cache,
         triton=_triton_bf16_insert)
register("fused_deepseek_v4_kv_rope_insert", _rq.fused_deepseek_v4_kv_rope_insert, triton=_triton_kv_insert)
register("decode_front", _rq.decode_front, triton=_triton_decode_front)

COS_SIN_DTYPES = (torch.float32, torch.bfloat16)


def fused_q_kv_rmsnorm(qr, kv, q_weight, kv_weight, eps: float):
    """(bf(RMSNorm(qr; q_weight)), bf(RMSNorm(kv; kv_weight))) as new tensors; qr [T, Dq], kv [T, Dkv]
    bf16 (column slices of one buffer are fine)."""
    C.tensor("qr", qr, dtype=torch.bfloat16, dim=2)
    C.tensor("kv", kv, dtype=torch.bfloat16, shape=(qr.shape[0], None))
    if qr.shape[1] % 8 or kv.shape[1] % 8:
        raise ValueError(f"qr and kv rows must be multiples of 8 values, got {qr.shape[1]} and {kv.shape[1]}")
    C.tensor("q_weight", q_weight, shape=(qr.shape[1],))
    C.tensor("kv_weight", kv_weight, shape=(kv.shape[1],))
    C.finite_float("eps", eps, minimum=0.0)
    C.same_device(qr=qr, kv=kv, q_weight=q_weight, kv_weight=kv_weight)
    return _run("fused_q_kv_rmsnorm", qr.device, qr, kv, q_weight, kv_weight, eps)


def _check_q_kv(q, kv, slot_mapping, positions, cos_sin_cache, eps):
    C.tensor("q", q, dtype=torch.bfloat16, shape=(None, None, L.HEAD_DIM))
    C.tensor("kv", kv, dtype=torch.bfloat16, shape=(q.shape[0], L.HEAD_DIM))
    C.cos_sin(cos_sin_cache, positions, COS_SIN_DTYPES, n_tokens=q.shape[0])
    C.tensor("slot_mapping", slot_mapping, dtype=C.INDEX, dim=1)
    if slot_mapping.shape[0] > q.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {q.shape[0]} tokens")
    C.finite_float("eps", eps, minimum=0.0)


def _flag(name, v):
    if not isinstance(v, bool):
        raise ValueError(f"{name} must be a bool, got {v!r}")


def _qnorm_insert(q, kv, k_cache, slot_mapping, positions, cos_sin_cache, padded_heads, eps, block_size, q_out,
                  apply_q_norm, kv_mxfp8, apply_q_rope, is_q_interleaved, kv_layout):
    _check_q_kv(q, kv, slot_mapping, positions, cos_sin_cache, eps)
    for name, v in (("apply_q_norm", apply_q_norm), ("kv_mxfp8", kv_mxfp8), ("apply_q_rope", apply_q_rope),
                    ("is_q_interleaved", is_q_interleaved)):
        _flag(name, v)
    if not isinstance(padded_heads, int) or isinstance(padded_heads, bool) or not (
            padded_heads == 0 or padded_heads >= max(q.shape[1], 1)):
        raise ValueError(f"padded_heads must be 0 (no q output) or an int >= the {q.shape[1]} heads of q, got "
                         f"{padded_heads!r}")
    if is_q_interleaved and (q.stride(2) != 1 or (q.shape[1] > 1 and q.stride(1) != L.HEAD_DIM)):
        raise ValueError(f"q: the chunk-interleaved layout needs each token's heads as one contiguous row "
                         f"(strides (*, 512, 1)), got strides {q.stride()}")
    C.positive_int("block_size", block_size)
    fmt = L.with_layout(L.V41_528 if kv_mxfp8 else L.V40_584, kv_layout)
    pages = V.pages(k_cache, block_size, "k_cache", fmt)
    if q_out is not None:
        C.no_overlap("q_out", C.tensor("q_out", q_out, dtype=torch.bfloat16,
                                       shape=(q.shape[0], padded_heads, L.HEAD_DIM)))
        if is_q_interleaved and (q_out.stride(2) != 1 or (padded_heads > 1 and q_out.stride(1) != L.HEAD_DIM)):
            raise ValueError(f"q_out: the chunk-interleaved layout needs each token's heads as one contiguous row, "
                             f"got strides {q_out.stride()}")
    C.same_device(q=q, kv=kv, k_cache=k_cache, slot_mapping=slot_mapping, positions=positions,
                  cos_sin_cache=cos_sin_cache, q_out=q_out)
    C.slots_inside("slot_mapping", slot_mapping, V.capacity(pages, block_size),
                   f"({pages.shape[0]} pages x {block_size})")
    return _run("fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert", q.device, q, kv, k_cache, slot_mapping,
                positions, cos_sin_cache, padded_heads, eps, block_size, q_out, apply_q_norm=apply_q_norm,
                apply_q_rope=apply_q_rope, is_q_interleaved=is_q_interleaved, fmt=fmt)


def fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(q, kv, k_cache, slot_mapping, positions, cos_sin_cache,
                                                      padded_heads: int, eps: float, block_size: int,
                                                      apply_q_norm: bool = True, kv_mxfp8: bool = False,
                                                      apply_q_rope: bool = True, is_q_interleaved: bool = False, *,
                                                      kv_layout: str = None):
    """vLLM's torch.ops._C op (its 13-argument schema): returns q_padded bf16 [T, padded_heads, 512]
    (per-head weightless RMSNorm unless ``apply_q_norm`` is False, RoPE on dims 448..511 unless
    ``apply_q_rope`` is False, one bf16 rounding; heads past H are zero; ``is_q_interleaved``: q and the
    result in the 16-dim chunk-interleaved layout of reference.qkv; ``padded_heads`` 0: no q work, an
    empty result) and writes the first len(slot_mapping) tokens' kv (RoPE, bf16, then a UE8M0 record:
    V40_584, or V41_528 with ``kv_mxfp8``) at slot_mapping into k_cache (vLLM passes ``cache.view(nb, -1)``).
    A slot < 0 is padding. vLLM's DeepSeek-V4.1 call passes ``apply_q_norm`` False (q was normed before
    wq_b: only RoPE here)."""
    return _qnorm_insert(q, kv, k_cache, slot_mapping, positions, cos_sin_cache, padded_heads, eps, block_size,
                         None, apply_q_norm, kv_mxfp8, apply_q_rope, is_q_interleaved, kv_layout)


def fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert_out(q, kv, q_out, k_cache, slot_mapping, positions,
                                                          cos_sin_cache, padded_heads: int, eps: float,
                                                          block_size: int, apply_q_norm: bool = True,
                                                          kv_mxfp8: bool = False, apply_q_rope: bool = True,
                                                          is_q_interleaved: bool = False, *,
                                                          kv_layout: str = None):
    """The same with a caller-provided q_out [T, padded_heads, 512] (written in place and returned), so a
    captured graph keeps its address."""
    return _qnorm_insert(q, kv, k_cache, slot_mapping, positions, cos_sin_cache, padded_heads, eps, block_size,
                         q_out, apply_q_norm, kv_mxfp8, apply_q_rope, is_q_interleaved, kv_layout)


def _scalar(name, t):
    C.tensor(name, t, dtype=torch.float32)
    if t.numel() != 1:
        raise ValueError(f"{name} must hold one fp32 value, got shape {tuple(t.shape)}")
    if value_checks(t) and not (bool(torch.isfinite(t).all()) and float(t.reshape(())) > 0):
        raise ValueError(f"{name} must be a finite positive scale, got {float(t.reshape(()))}")


def _full_cache_rows(k_cache, cache_block_size, dtype):
    """k_cache [nb, cache_block_size, 512] of ``dtype``: dense rows that do not overlap, 16-byte aligned."""
    C.positive_int("cache_block_size", cache_block_size)
    C.tensor("k_cache", k_cache, dtype=dtype, shape=(None, cache_block_size, L.HEAD_DIM))
    row = L.HEAD_DIM * k_cache.element_size()
    if k_cache.stride(2) != 1 or (cache_block_size > 1 and k_cache.stride(1) < L.HEAD_DIM) or (
            k_cache.shape[0] > 1 and k_cache.stride(0) < cache_block_size * k_cache.stride(1)):
        raise ValueError(f"k_cache rows must be dense {row}-byte rows that do not overlap, got stride "
                         f"{k_cache.stride()}")
    size = k_cache.element_size()
    if (k_cache.stride(0) * size) % 16 or (k_cache.stride(1) * size) % 16 or (k_cache.storage_offset() * size) % 16:
        raise ValueError(f"k_cache strides and start must be multiples of 16 bytes, got stride {k_cache.stride()}")


def qnorm_rope_and_insert_full_bf16_k_cache(q, kv, k_cache, slot_mapping, position_ids, cos_sin_cache, eps: float,
                                            cache_block_size: int, apply_q_norm: bool = True) -> None:
    """vLLM's bf16 full-cache form (torch.ops._C's fused_deepseek_v4_qnorm_rope_kv_rope_full_cache_bf16_insert,
    the plain-row cache of its FlashInfer sparse MLA and of its ROCm DSpark draft layer): q bf16 [T, H, 512]
    is rewritten in place as bf(RoPE(RMSNorm(q))) per head (bf(RoPE(q)) without ``apply_q_norm``); the first
    len(slot_mapping) tokens' bf(RoPE(kv)) rows go to k_cache bf16 [nb, bs, 512] at slot_mapping[t] (a slot
    < 0 is padding). No quantization and no fp8_ds_mla record: none of dsv4_rocm's attention kernels reads
    this cache."""
    _check_q_kv(q, kv, slot_mapping, position_ids, cos_sin_cache, eps)
    C.no_overlap("q", q)
    if q.shape[-1] > 1 and q.stride(-1) != 1:
        raise ValueError(f"q must have a contiguous last dimension, got strides {q.stride()}")
    if kv.stride(-1) != 1:
        raise ValueError(f"kv must have a contiguous last dimension, got strides {kv.stride()}")
    if not isinstance(apply_q_norm, bool):
        raise ValueError(f"apply_q_norm must be a bool, got {apply_q_norm!r}")
    _full_cache_rows(k_cache, cache_block_size, torch.bfloat16)
    C.same_device(q=q, kv=kv, k_cache=k_cache, slot_mapping=slot_mapping, position_ids=position_ids,
                  cos_sin_cache=cos_sin_cache)
    C.slots_inside("slot_mapping", slot_mapping, k_cache.shape[0] * cache_block_size,
                   f"({k_cache.shape[0]} pages x {cache_block_size})")
    _run("qnorm_rope_and_insert_full_bf16_k_cache", q.device, q, kv, k_cache, slot_mapping, position_ids,
         cos_sin_cache, eps, cache_block_size, apply_q_norm)


def qnorm_rope_and_insert_full_k_cache(q, kv, k_cache, slot_mapping, positions, cos_sin_cache, eps: float,
                                       cache_block_size: int, fp8_scale, q_fp8=None, q_fp8_scale_inv=None,
                                       apply_q_norm: bool = True) -> None:
    """vLLM's full-cache form (FlashInfer's sparse MLA, torch.ops._C's
    fused_deepseek_v4_qnorm_rope_kv_rope_full_cache_fp8_insert): q_fp8 e4m3 [T, H, 512] = RoPE(RMSNorm(q)) *
    q_fp8_scale_inv (RoPE(q) * q_fp8_scale_inv without ``apply_q_norm``: vLLM's DeepSeek-V4.1 layer passes
    False, its q was normed before wq_b); k_cache e4m3 [nb, bs, 512] row at slot_mapping[t] = RoPE(kv_t) /
    fp8_scale (as kv * fp32(1 / fp8_scale)), for the first len(slot_mapping) tokens. Per-tensor scales,
    saturating at +-448; a non-finite value is stored as NaN (0x7F)."""
    _check_q_kv(q, kv, slot_mapping, positions, cos_sin_cache, eps)
    _flag("apply_q_norm", apply_q_norm)
    _full_cache_rows(k_cache, cache_block_size, (torch.float8_e4m3fn, torch.uint8))
    if q_fp8 is None or q_fp8_scale_inv is None:
        raise ValueError("q_fp8 and q_fp8_scale_inv are required (the fp8 q output and its inverse scale)")
    C.no_overlap("q_fp8", C.tensor("q_fp8", q_fp8, dtype=(torch.float8_e4m3fn, torch.uint8), shape=tuple(q.shape)))
    _scalar("fp8_scale", fp8_scale)
    _scalar("q_fp8_scale_inv", q_fp8_scale_inv)
    C.same_device(q=q, kv=kv, k_cache=k_cache, slot_mapping=slot_mapping, positions=positions,
                  cos_sin_cache=cos_sin_cache, fp8_scale=fp8_scale, q_fp8=q_fp8, q_fp8_scale_inv=q_fp8_scale_inv)
    C.slots_inside("slot_mapping", slot_mapping, k_cache.shape[0] * cache_block_size,
                   f"({k_cache.shape[0]} pages x {cache_block_size})")
    _run("qnorm_rope_and_insert_full_k_cache", q.device, q, kv, k_cache, slot_mapping, positions, cos_sin_cache, eps,
         cache_block_size, fp8_scale, q_fp8, q_fp8_scale_inv, apply_q_norm)


def fused_deepseek_v4_kv_rope_insert(kv, k_cache, slot_mapping, position_ids, cos_sin_cache, cache_block_size: int,
                                     fp8_scale=None, kv_mxfp8: bool = False, *, kv_layout: str = None) -> None:
    """vLLM 0.33's torch.ops._C op (V4.1's DSpark context KV and PCP SWA writer): the kv half of the fused
    inserts alone, the same cache bytes, no q. The cache picks the form, as in vLLM: uint8 records (V40_584,
    or V41_528 with ``kv_mxfp8``; any view of ``cache_views``, their float8_e4m3fn views included),
    float8_e4m3fn [nb, bs, 512] rows (per-tensor ``fp8_scale`` required), bfloat16 [nb, bs, 512] rows. kv bf16 [T, 512]; the first
    len(slot_mapping) tokens are inserted, a slot < 0 is padding (dsv4_rocm.reference.qkv has the math)."""
    C.tensor("kv", kv, dtype=torch.bfloat16, dim=2)
    if kv.shape[1] != L.HEAD_DIM or kv.stride(1) != 1:
        raise ValueError(f"kv must be [T, {L.HEAD_DIM}] with a unit last stride, got shape {tuple(kv.shape)} "
                         f"strides {kv.stride()}")
    C.cos_sin(cos_sin_cache, position_ids, COS_SIN_DTYPES, n_tokens=kv.shape[0])
    C.tensor("slot_mapping", slot_mapping, dtype=C.INDEX, dim=1)
    if slot_mapping.shape[0] > kv.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {kv.shape[0]} kv rows")
    C.positive_int("cache_block_size", cache_block_size)
    _flag("kv_mxfp8", kv_mxfp8)
    if not isinstance(k_cache, torch.Tensor):
        raise ValueError(f"k_cache must be a torch.Tensor, got {type(k_cache).__name__}")
    fmt = None
    rows = k_cache.dtype == torch.bfloat16 or (k_cache.dtype == torch.float8_e4m3fn and k_cache.dim() == 3
                                               and k_cache.shape[-1] == L.HEAD_DIM)
    if k_cache.dtype in (torch.uint8, torch.float8_e4m3fn) and not rows:     # records (or their fp8 view)
        fmt = L.with_layout(L.V41_528 if kv_mxfp8 else L.V40_584, kv_layout)
        cache = V.pages(k_cache, cache_block_size, "k_cache", fmt)
        cap = V.capacity(cache, cache_block_size)
    elif rows:
        if kv_mxfp8:
            raise ValueError(f"kv_mxfp8 needs the uint8 record cache, got a {k_cache.dtype} k_cache")
        _full_cache_rows(k_cache, cache_block_size, k_cache.dtype)
        cache, cap = k_cache, k_cache.shape[0] * cache_block_size
        if k_cache.dtype == torch.float8_e4m3fn:
            if fp8_scale is None:
                raise ValueError("fp8_scale is required with a float8_e4m3fn k_cache (its per-tensor scale)")
            _scalar("fp8_scale", fp8_scale)
    else:
        raise ValueError(f"k_cache must have dtype torch.uint8 (records), torch.float8_e4m3fn or torch.bfloat16 "
                         f"(rows), got {k_cache.dtype}")
    C.same_device(kv=kv, k_cache=k_cache, slot_mapping=slot_mapping, position_ids=position_ids,
                  cos_sin_cache=cos_sin_cache, fp8_scale=fp8_scale if k_cache.dtype == torch.float8_e4m3fn else None)
    C.slots_inside("slot_mapping", slot_mapping, cap, f"({k_cache.shape[0]} pages x {cache_block_size})")
    _run("fused_deepseek_v4_kv_rope_insert", kv.device, kv, cache, slot_mapping, position_ids, cos_sin_cache,
         cache_block_size, fp8_scale, kv_mxfp8, fmt=fmt)


def decode_front(q, kv, kv_weight, k_cache, slot_mapping, positions, cos_sin_cache, padded_heads: int, eps: float,
                 block_size: int, apply_q_norm: bool = True, kv_mxfp8: bool = False, *, kv_layout: str = None,
                 q_out=None, index_q=None, index_weights=None, index_q_cos_sin_cache=None,
                 index_weights_softmax_scale: float = None, index_weights_head_scale: float = None,
                 index_use_fp4: bool = False, index_use_fnuz: bool = False):
    """The front of a decode step in one launch. Equals, in writes and results,

        _, kv_n = fused_q_kv_rmsnorm(<any qr>, kv, <any q_weight>, kv_weight, eps)
        q_out = fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(q, kv_n, k_cache, slot_mapping, positions,
                    cos_sin_cache, padded_heads, eps, block_size, apply_q_norm, kv_mxfp8, kv_layout=kv_layout)
        index = fused_indexer_q_rope_quant(positions, index_q, index_q_cos_sin_cache, index_weights,
                    index_weights_softmax_scale, index_weights_head_scale, index_use_fp4,
                    use_fnuz=index_use_fnuz)                    # only when index_q is given

    and returns (q_out, index) (index None without index_q). kv is the raw latent of the kv projection
    (bf16 [T, 512], a column slice of the fused projection is fine), kv_weight the kv_norm weight (bf16
    [512]); the q_lora norm stays before wq_b and is not part of this op. The cache gets the records of
    the first len(slot_mapping) tokens (a slot < 0 is padding); ``q_out`` (optional, [T, padded_heads, 512]
    bf16) is written in place. ``index_q_cos_sin_cache`` defaults to ``cos_sin_cache``. On the GPU the
    floats and bytes are those of the unfused kernels (HIP norms and insert, Triton indexer query) bit for bit
    (dsv4_rocm/triton/qkv/decode_front.py says why). vLLM's chunk-interleaved q layout and ``apply_q_rope``
    False are not taken here (the fused insert alone takes them)."""
    _check_q_kv(q, kv, slot_mapping, positions, cos_sin_cache, eps)
    _flag("apply_q_norm", apply_q_norm)
    _flag("kv_mxfp8", kv_mxfp8)
    if kv.stride(1) != 1:
        raise ValueError(f"kv must have a unit last stride, got strides {kv.stride()}")
    if q.shape[1] and q.stride(2) != 1:
        raise ValueError(f"q must have a unit last stride, got strides {q.stride()}")
    C.tensor("kv_weight", kv_weight, dtype=torch.bfloat16, shape=(L.HEAD_DIM,))
    if kv_weight.stride(0) != 1:
        raise ValueError(f"kv_weight must be contiguous, got stride {kv_weight.stride()}")
    if not isinstance(padded_heads, int) or isinstance(padded_heads, bool) or padded_heads < max(q.shape[1], 1):
        raise ValueError(f"padded_heads must be an int >= the {q.shape[1]} heads of q, got {padded_heads!r}")
    C.positive_int("block_size", block_size)
    fmt = L.with_layout(L.V41_528 if kv_mxfp8 else L.V40_584, kv_layout)
    pages = V.pages(k_cache, block_size, "k_cache", fmt)
    T = q.shape[0]
    if q_out is None:
        q_out = torch.empty(T, padded_heads, L.HEAD_DIM, dtype=torch.bfloat16, device=q.device)
    else:
        C.no_overlap("q_out", C.tensor("q_out", q_out, dtype=torch.bfloat16, shape=(T, padded_heads, L.HEAD_DIM)))
        if q_out.stride(2) != 1:
            raise ValueError(f"q_out must have a unit last stride, got strides {q_out.stride()}")
    index = None
    if index_q is not None:
        ics = cos_sin_cache if index_q_cos_sin_cache is None else index_q_cos_sin_cache
        C.tensor("index_q", index_q, dtype=_idx.FLOATS, shape=(T, None, L.INDEXER_DIM))
        _idx._unit_inner("index_q", index_q)
        C.cos_sin(ics, positions, COS_SIN_DTYPES, n_tokens=T)
        C.tensor("index_weights", index_weights, dtype=_idx.FLOATS, shape=(T, index_q.shape[1]))
        C.finite_float("index_weights_softmax_scale", index_weights_softmax_scale)
        C.finite_float("index_weights_head_scale", index_weights_head_scale)
        _flag("index_use_fp4", index_use_fp4)
        _flag("index_use_fnuz", index_use_fnuz)
        if index_use_fnuz and index_use_fp4:
            raise ValueError("index_use_fnuz=True names the FP8 query's e4m3fnuz flavour; the MXFP4 query "
                             "(index_use_fp4=True) has none")
        C.same_device(q=q, index_q=index_q, index_weights=index_weights, index_q_cos_sin_cache=ics)
        nh, dev = index_q.shape[1], q.device
        w_out = torch.empty(T, nh, dtype=torch.float32, device=dev)
        if index_use_fp4:
            out = torch.empty(T, nh, L.INDEXER_DIM // 2, dtype=torch.uint8, device=dev)
            scales = torch.empty(T, nh, L.INDEXER_DIM // 32, dtype=torch.uint8, device=dev)
        else:
            out = torch.empty(T, nh, L.INDEXER_DIM, device=dev,
                              dtype=torch.float8_e4m3fnuz if index_use_fnuz else torch.float8_e4m3fn)
            scales = out
        index = (index_q, ics, index_weights, float(index_weights_softmax_scale),
                 float(index_weights_head_scale), index_use_fp4, index_use_fnuz, out, scales, w_out)
    elif index_weights is not None:
        raise ValueError("index_weights is given without index_q")
    C.same_device(q=q, kv=kv, kv_weight=kv_weight, k_cache=k_cache, slot_mapping=slot_mapping, positions=positions,
                  cos_sin_cache=cos_sin_cache, q_out=q_out)
    C.slots_inside("slot_mapping", slot_mapping, V.capacity(pages, block_size),
                   f"({pages.shape[0]} pages x {block_size})")
    _run("decode_front", q.device, q, kv, kv_weight, q_out, pages, slot_mapping, positions, cos_sin_cache, eps,
         block_size, apply_q_norm, fmt, index)
    if index is None:
        return q_out, None
    out, scales, w_out = index[7:]
    if index_use_fp4:
        return q_out, ((out, scales.view(torch.int32).squeeze(-1)), w_out)
    return q_out, (out, w_out)
