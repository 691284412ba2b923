"""The functions the SGLang plugin puts in place of SGLang's, and their registration with its HookRegistry.

* ``resolve_backend`` replaces ``hip_flash_mla.resolve_hip_flashmla_backend``: the HIP decode kernel name
  is ``"dsv4_rocm"`` whatever ``SGLANG_HACK_FLASHMLA_BACKEND`` says. SGLang then pads the per-rank query
  heads to 64 (zero q, zero sink: ``hip_attention_needs_head_pad``), takes none of its aiter-only paths
  (the swap-AB kernel, index folding, the V4.1 layouts, the fused inverse RoPE) and passes the name to
  the entrypoint below.
* ``attention`` wraps ``hip_flash_mla.flash_mla_with_kvcache_entrypoint``: for that name and 584-byte
  caches it runs the one sparse attention step (``dsv4_rocm.attention_step.sparse_attention``, the layer's
  and the vLLM plugin's too) on FlashMLA's keywords, exactly as the HIP backend builds them (``q [b, s_q, h,
  512]``, the sliding-window and compressed caches as ``[pages, page_size, 1, 584]`` views of SGLang's page
  buffers, int32 slot indices and lengths, the sink); with ``inv_rope``
  (``(freqs_real, positions)``, SGLang's interleaved cos / sin table) it rotates the rows back with
  ``rocm_inverse_rope_rows_``. Anything else goes to SGLang's entrypoint.
* ``store`` wraps ``attn.fused_store_cache``: a V4-layout FlashMLA store (``type="flashmla"``, no in-kernel
  RoPE) is ``dsv4_rocm.ops.quantize_and_insert_k_cache`` into the page buffer; indexer stores and the V4.1
  layouts stay SGLang's.

No host sync, no value-dependent allocation: the calls are the ops' GPU paths, graph-capturable as
SGLang captures its decode steps. Tensors SGLang hands over in another integer width (lengths as int64)
are converted; that is the only copy.
"""
import torch

from ... import ops
from ...attention_step import KeySet, sparse_attention
from . import guards

BACKEND = "dsv4_rocm"
_RECORD_BYTES = 584

# FlashMLA's keywords the HIP backend passes to the entrypoint (kwargs outside this set are refused)
_FLASHMLA_KEYS = frozenset({"q", "k_cache", "head_dim_v", "block_table", "cache_seqlens", "tile_scheduler_metadata",
                            "softmax_scale", "is_fp8_kvcache", "indices", "topk_length", "attn_sink",
                            "extra_k_cache", "extra_indices_in_kvcache", "extra_topk_length", "inv_rope",
                            "num_splits", "causal"})


def resolve_backend(backend=None) -> str:
    return BACKEND


def _int32(t):
    return t if t is None or t.dtype == torch.int32 else t.to(torch.int32)


_COS_SIN = {}     # (data_ptr, shape, dtype, device) of an interleaved table -> its cos | sin form


def cos_sin_of(freqs_real: torch.Tensor) -> torch.Tensor:
    """SGLang's ``view_as_real(freqs_cis).flatten(-2)`` table [P, 64] (cos_i, sin_i interleaved) as the
    [P, 64] cos | sin table dsv4_rocm's ops read; built once per table (SGLang's tables live as long as
    the model)."""
    key = (freqs_real.data_ptr(), tuple(freqs_real.shape), freqs_real.dtype, freqs_real.device)
    t = _COS_SIN.get(key)
    if t is None:
        f = freqs_real.reshape(freqs_real.shape[0], -1)
        t = _COS_SIN[key] = torch.cat([f[:, 0::2], f[:, 1::2]], dim=1).float().contiguous()
    return t


def flash_mla_call(q, k_cache, head_dim_v=512, block_table=None, cache_seqlens=None, tile_scheduler_metadata=None,
                   softmax_scale=None, is_fp8_kvcache=True, indices=None, topk_length=None, attn_sink=None,
                   extra_k_cache=None, extra_indices_in_kvcache=None, extra_topk_length=None, inv_rope=None,
                   num_splits=None, causal=False):
    """FlashMLA's sparse decode on FlashMLA's keywords (what SGLang's entrypoint receives) over dsv4_rocm's
    kernels -> (out bf16 [b, s_q, h, 512], lse fp32 [b, h, s_q]). ``block_table``, ``cache_seqlens`` and the
    scheduling object are not read in the sparse mode (as in FlashMLA)."""
    if not is_fp8_kvcache or causal or num_splits is not None or head_dim_v != 512 or indices is None:
        raise ValueError("dsv4_rocm runs FlashMLA's sparse fp8 mode only (is_fp8_kvcache=True, causal=False, "
                         "num_splits=None, head_dim_v=512, indices given)")
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    out, lse = sparse_attention(q, KeySet(k_cache, indices, _int32(topk_length)),
                                KeySet(extra_k_cache, extra_indices_in_kvcache, _int32(extra_topk_length)),
                                attn_sink, softmax_scale)
    if inv_rope is not None:
        freqs_real, positions = inv_rope
        b, s_q, h, d = out.shape
        n = b * s_q
        ops.rocm_inverse_rope_rows_(out.view(n, h, d), positions.reshape(-1)[:n], cos_sin_of(freqs_real),
                                    freqs_real.shape[-1])
    return out, lse


def _record_bytes(cache):
    return cache.shape[-1] if isinstance(cache, torch.Tensor) and cache.dim() else None


def attention(original, backend=None, **kwargs):
    """AROUND hook of ``flash_mla_with_kvcache_entrypoint(backend, **kwargs)``."""
    mine = backend == BACKEND and _record_bytes(kwargs.get("k_cache")) == _RECORD_BYTES and (
        kwargs.get("extra_k_cache") is None or _record_bytes(kwargs["extra_k_cache"]) == _RECORD_BYTES)
    if not mine:
        return original(backend=backend, **kwargs)
    unknown = set(kwargs) - _FLASHMLA_KEYS
    if unknown:
        raise ValueError(f"dsv4_rocm's SGLang attention does not take {sorted(unknown)}")
    return flash_mla_call(**kwargs)


def _is_v4(layout) -> bool:
    return str(getattr(layout, "value", layout)).lower() == "v4"


def store(original, input, cache, indices, *, page_size, type, layout="v4", freqs_cis=None):
    """AROUND hook of ``fused_store_cache``: V4 FlashMLA records by dsv4_rocm's writer."""
    if type != "flashmla" or freqs_cis is not None or not _is_v4(layout):
        return original(input, cache, indices, page_size=page_size, type=type, layout=layout, freqs_cis=freqs_cis)
    ops.quantize_and_insert_k_cache(input, cache, indices, page_size)


def unified_kv_off() -> bool:
    """Replaces ``is_unified_kv_triton``: the unified-KV path stores bf16 rows and reads them with its own
    kernels, around everything above, so it stays off while the plugin is on."""
    return False


def register_all() -> None:
    """Register every hook with SGLang's HookRegistry (applied by ``load_plugins`` / ``apply_hooks``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from .backend import dsv4_backend_class
    HookRegistry.register(guards.BACKEND_CLASS, dsv4_backend_class(), HookType.REPLACE)
    HookRegistry.register(guards.RESOLVE, resolve_backend, HookType.REPLACE)
    HookRegistry.register(guards.ENTRYPOINT, attention, HookType.AROUND)
    HookRegistry.register(guards.STORE, store, HookType.AROUND)
    HookRegistry.register(guards.UNIFIED_KV_GATE, unified_kv_off, HookType.REPLACE)
