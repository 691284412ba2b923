"""FlashMLA's Python API over dsv4_rocm's kernels, on every vendor: an engine swaps the import.

Same names, positional order, defaults and returns as ``flash_mla.flash_mla_interface`` for the sparse
DeepSeek-V4 and V4.1 (d_qk 512) paths, plus the ``out=`` buffer vLLM's FlashMLA backend passes:

* ``get_mla_metadata(*args, **kwargs) -> (FlashMLASchedMeta, None)``
* ``flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
  num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=True, indices=None, attn_sink=None,
  extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None, extra_topk_length=None,
  enable_batch_invariant=False, *, out=None, kv_layout=None) -> (out bf16 [b, s_q, h, 512], lse fp32
  [b, h, s_q])``: sparse decode over paged KV records. As FlashMLA does, the record format is detected
  from the caches' last dimension: 584 (V40_584, FlashMLA's V4.0 releases), 528 (V41_528) or 288
  (V41_FP4_288, only as ``extra_k_cache`` beside a 528 ``k_cache``); other pairs are refused by name.
  ``kv_layout``: "page_split" (FlashMLA 2026-09-10, vLLM before 0.33) or "interleaved" (FlashMLA 2026-09-30,
  vLLM 0.33: each record whole); None (the default) is the format's ``layout.default_layout``, interleaved
  for 528 / 288. ``enable_batch_invariant`` (FlashMLA 2026-09-30): no split of a query's keys, so
  the result does not depend on the batch.
* ``flash_mla_sparse_fwd(q, kv, indices, sm_scale=None, d_v=512, attn_sink=None, topk_length=None, *,
  out=None) -> (out bf16 [s_q, h, 512], max_logits fp32 [s_q, h], lse fp32 [s_q, h])``: sparse prefill.
* ``warmup(device=None, configs=None, model=None)``: compile ahead of time the kernels a model's calls select,
  persisted for later processes (dsv4_rocm's kernel cache), its cost printed.

What is accepted beyond FlashMLA (a superset: every call FlashMLA accepts runs here): caches as uint8,
int8 or float8_e4m3fn views, also 3-D ``[nb, bs, R]`` (R = 584, 528 or 288); q / indices / lengths / out
with any strides except the last dimension (read in place, no copies); lengths ``[b]`` or ``[b, s_q]`` of any stride;
empty batches, topk 0 and an empty kv (every query lonely: out 0, lse +inf, max_logits -inf);
``sm_scale=None`` in prefill (d_qk^-0.5, as decode's default). Indices that are negative or past the
cache / kv are absent, as in FlashMLA. Arguments are checked structurally on every call (no device sync)
and a failure is a ValueError naming the argument (docs/conventions.md). V4.1 caches are read in the
interleaved page layout vLLM 0.33 writes and deepseek-ai/FlashMLA's 2026-09-30 release reads; caches laid out
as that release's predecessor (2026-09-10, vllm-project/FlashMLA's fork) and vLLM before 0.33 write them need
``kv_layout="page_split"``: nothing in the bytes tells the two apart (docs/cache_format.md#page-layouts).

``block_table`` and ``cache_seqlens`` are not read in the sparse mode (FlashMLA ignores them too): they
may be None or integer tensors of any shape; anything else is rejected. The scheduling object keeps
FlashMLA's contract (a later call with the same object must have the same shapes), but carries no device
state: the split plan is cached per device and shape inside the launcher.
"""
import dataclasses
import itertools
import os
import sys
import time
from typing import NamedTuple, Optional, Tuple

import torch

from . import layout as L
from . import ops
from . import _checks as C

__all__ = ["FlashMLASchedMeta", "get_mla_metadata", "flash_mla_with_kvcache", "flash_mla_sparse_fwd", "warmup",
           "WarmupConfig", "model_warmup_configs", "model_heads"]


class SchedConfig(NamedTuple):
    """The call shape a scheduling object is tied to (the fields of FlashMLA's ``FlashMLASchedMeta.Config``)."""
    b: int
    s_q: int
    h_q: int
    page_block_size: int
    h_k: int
    causal: bool
    is_fp8_kvcache: bool
    topk: Optional[int]
    extra_page_block_size: Optional[int]
    extra_topk: Optional[int]
    enable_batch_invariant: bool = False


@dataclasses.dataclass
class FlashMLASchedMeta:
    """FlashMLA's scheduling object: the first call records its shape, later calls must match it."""
    have_initialized: bool = False
    config: Optional[SchedConfig] = None


def get_mla_metadata(*args, **kwargs) -> Tuple[FlashMLASchedMeta, None]:
    """A fresh scheduling object; arguments are accepted and ignored, as FlashMLA does."""
    return FlashMLASchedMeta(), None


def _unused_table(name, t):
    if t is not None and not (isinstance(t, torch.Tensor) and t.dtype in C.INDEX):
        raise ValueError(f"{name} must be None or an int32/int64 tensor (the sparse mode does not read it), got "
                         f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")


def _sched_config(q, k_cache, indices, extra_k_cache, extra_indices, causal, is_fp8_kvcache, batch_invariant):
    """The call's SchedConfig, or None when the arguments are not even tensors of the right ranks (the
    op's checks then name the bad one)."""
    try:
        cs = k_cache.shape
        return SchedConfig(*q.shape[:3], cs[1], cs[2] if len(cs) == 4 else 1, causal, is_fp8_kvcache,
                           indices.shape[-1], extra_k_cache.shape[1] if extra_k_cache is not None else None,
                           extra_indices.shape[-1] if extra_indices is not None else None, bool(batch_invariant))
    except (AttributeError, IndexError, TypeError):
        return None


def flash_mla_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, block_table: Optional[torch.Tensor],
                           cache_seqlens: Optional[torch.Tensor], head_dim_v: int,
                           tile_scheduler_metadata: FlashMLASchedMeta, num_splits: None = None,
                           softmax_scale: Optional[float] = None, causal: bool = False, is_fp8_kvcache: bool = True,
                           indices: Optional[torch.Tensor] = None, attn_sink: Optional[torch.Tensor] = None,
                           extra_k_cache: Optional[torch.Tensor] = None,
                           extra_indices_in_kvcache: Optional[torch.Tensor] = None,
                           topk_length: Optional[torch.Tensor] = None,
                           extra_topk_length: Optional[torch.Tensor] = None, enable_batch_invariant: bool = False, *,
                           out: Optional[torch.Tensor] = None,
                           kv_layout: str = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sparse decode (see the module docstring); ``out`` [b, s_q, h, 512] bf16 is written in place."""
    meta = tile_scheduler_metadata
    if not (hasattr(meta, "have_initialized") and hasattr(meta, "config")):
        raise ValueError("tile_scheduler_metadata must come from get_mla_metadata()")
    if num_splits is not None:
        raise ValueError("num_splits must be None")
    if indices is None:
        raise ValueError("indices is required: dsv4_rocm implements FlashMLA's sparse mode only (DeepSeek-V4)")
    if causal:
        raise ValueError("causal must be False when sparse attention is enabled")
    if not is_fp8_kvcache:
        raise ValueError("is_fp8_kvcache must be True when sparse attention is enabled (quantized KV records)")
    if not isinstance(enable_batch_invariant, bool):
        raise ValueError(f"enable_batch_invariant must be a bool, got {enable_batch_invariant!r}")
    if head_dim_v != 512:
        raise ValueError(f"head_dim_v must be 512, got {head_dim_v!r}")
    _unused_table("block_table", block_table)
    _unused_table("cache_seqlens", cache_seqlens)
    cfg = _sched_config(q, k_cache, indices, extra_k_cache, extra_indices_in_kvcache, causal, is_fp8_kvcache,
                        enable_batch_invariant)
    if meta.have_initialized and cfg is not None and meta.config != cfg:
        raise ValueError(f"tile_scheduler_metadata was initialized for {meta.config}, this call is {cfg}: use a "
                         f"new get_mla_metadata() object for another shape")
    if softmax_scale is None:                # FlashMLA's default, d_qk^-0.5
        softmax_scale = (q.shape[-1] if isinstance(q, torch.Tensor) and q.dim() else 512) ** -0.5
    res = ops.sparse_mla_decode(q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices_in_kvcache,
                                extra_topk_length, softmax_scale, out, kv_layout=kv_layout,
                                batch_invariant=enable_batch_invariant)
    if not meta.have_initialized:           # only a call that passed every check ties the object to its shape
        meta.have_initialized, meta.config = True, cfg
    return res


def flash_mla_sparse_fwd(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: Optional[float] = None,
                         d_v: int = 512, attn_sink: Optional[torch.Tensor] = None,
                         topk_length: Optional[torch.Tensor] = None, *,
                         out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse prefill (see the module docstring); ``out`` [s_q, h, 512] bf16 is written in place."""
    if sm_scale is None:                     # as decode's default, d_qk^-0.5
        sm_scale = (q.shape[-1] if isinstance(q, torch.Tensor) and q.dim() else 512) ** -0.5
    return ops.sparse_mla_prefill(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out)


# ---- warm-up ---------------------------------------------------------------------------------------
class WarmupConfig(NamedTuple):
    """One kind of attention call of a model. What selects a compiled kernel: the head count, the block
    sizes, which of lengths / sink are given, and whether the keys are split (both variants are built).
    The batch, s_q and topk do not (topk only through being a multiple of 16, as every engine's is)."""
    heads: int                           # 64 or 128
    block_size: int                      # main (sliding window) cache
    extra_block_size: Optional[int]      # compressed cache; None: no extra set
    lengths: bool                        # topk_length given
    sink: bool = True
    extra_lengths: Optional[bool] = None  # extra_topk_length given; None: as ``lengths``
    formats: tuple = (L.V40_584, L.V40_584)  # record formats (layout.RecordFormat) of the main and extra caches
    kv_layout: Optional[str] = None       # their page layout, as flash_mla_with_kvcache's (None: the default)


def model_heads(model) -> tuple:
    """The head counts the attention kernels see for a model (a ``dsv4_rocm.config`` preset name such as
    "v4-flash" / "v4-pro", or an ``AttentionConfig``) at any tensor-parallel size: its local heads, padded
    to 64 below 64 (``ops.sparse_mla_decode`` takes 64 or 128)."""
    from .config import get_config
    cfg = get_config(model) if isinstance(model, str) else model
    n = cfg.num_heads
    return tuple(sorted({128 if n // tp > 64 else 64 for tp in (1, 2, 4, 8, 16) if n % tp == 0}))


def model_warmup_configs(heads=(64, 128), block_sizes=(64, 256), extra_block_sizes=(None, 64, 2),
                         lengths=(True, False), sinks=(True,), model=None, formats=((L.V40_584, L.V40_584),)):
    """Every combination of the given values: by default the shapes DeepSeek-V4's layers call with
    (window pages of 64 in vLLM, 256 in FlashMLA's tests; compressed pages of 64 (C4) and 2 (C128)).
    ``model`` (a preset name or an ``AttentionConfig``) replaces ``heads`` by that model's
    (``model_heads``): one model's configurations. ``formats``: (main, extra) record formats, e.g.
    ((L.V41_528, L.V41_528), (L.V41_528, L.V41_FP4_288)) for DeepSeek-V4.1's caches."""
    if model is not None:
        heads = model_heads(model)
    return [WarmupConfig(h, bs, ebs, ln, sk, None, f) for h, bs, ebs, ln, sk, f in
            itertools.product(heads, block_sizes, extra_block_sizes, lengths, sinks, formats)]


def _warmup_formats(cfg: WarmupConfig) -> tuple:
    """The (main, extra) formats a call of ``cfg`` reads, in its page layout (extra None without an extra set)."""
    main, extra = (L.with_layout(f, cfg.kv_layout) for f in cfg.formats)
    return main, extra if cfg.extra_block_size is not None else None


def _warmup_inputs(cfg: WarmupConfig, device):
    from .reference import cache as rc

    def cache(bs, fmt):
        return rc.flash_mla_view(torch.zeros(2, L.page_bytes(bs, fmt), dtype=torch.uint8, device=device), bs, fmt)

    q = torch.zeros(1, 1, cfg.heads, 512, dtype=torch.bfloat16, device=device)
    idx = torch.zeros(1, 1, 128, dtype=torch.int32, device=device)
    lens = torch.zeros(1, dtype=torch.int32, device=device)
    sink = torch.zeros(cfg.heads, dtype=torch.float32, device=device) if cfg.sink else None
    extra = cfg.extra_block_size is not None
    extra_lengths = cfg.lengths if cfg.extra_lengths is None else cfg.extra_lengths
    fmts = _warmup_formats(cfg)
    return (q, cache(cfg.block_size, fmts[0]), idx, lens if cfg.lengths else None, sink,
            cache(cfg.extra_block_size, fmts[1]) if extra else None, idx if extra else None,
            lens if extra and extra_lengths else None, 512 ** -0.5)


def warmup(device=None, configs=None, prefill: bool = True, threads: Optional[int] = None, model=None,
           cache_dir: Optional[str] = None, verbose: bool = True) -> dict:
    """Compile the Triton kernels that calls of ``configs`` (default ``model_warmup_configs(model=model)``:
    one model's configurations when ``model`` is given, every DeepSeek-V4 one otherwise) select on
    ``device``, split and unsplit, and the prefill kernel with and without lengths, so that no compilation
    happens inside a serving step. Compiles run in ``threads`` worker threads (default: one per CPU) and
    persist in ``cache_dir`` (default: dsv4_rocm's kernel cache, ``triton._launch.kernel_cache_dir``), where a
    later process finds them and compiles nothing. Returns {"kernels": variants requested, "compiled": kernels
    compiled here (the rest were loaded), "seconds": wall time, "cache_dir": the directory}, and prints that
    line to stderr unless ``verbose`` is False; a device whose backend has no Triton kernel (CPU, reference)
    compiles nothing."""
    from .triton._launch import kernel_cache
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    jobs = []
    if ops.backend_for("sparse_mla_decode", device) == "triton":
        from .triton.attention.sparse_mla_decode import sparse_mla_decode
        for cfg in (configs if configs is not None else model_warmup_configs(model=model)):
            args = _warmup_inputs(cfg, device)
            jobs += [(sparse_mla_decode, args, dict(num_splits=ns, formats=_warmup_formats(cfg))) for ns in (1, 2)]
    if prefill and ops.backend_for("sparse_mla_prefill", device) == "triton":
        from .triton.attention.sparse_mla_prefill import sparse_mla_prefill
        q = torch.zeros(1, 64, 512, dtype=torch.bfloat16, device=device)
        kv = torch.zeros(2, 1, 512, dtype=torch.bfloat16, device=device)
        idx = torch.zeros(1, 1, 128, dtype=torch.int32, device=device)
        lens = torch.zeros(1, dtype=torch.int32, device=device)
        sink = torch.zeros(64, dtype=torch.float32, device=device)
        for ln, sk in itertools.product((lens, None), (sink, None)):
            jobs.append((sparse_mla_prefill, (q, kv, idx, 512 ** -0.5, 512, sk, ln), {}))
    if not jobs:
        return dict(kernels=0, compiled=0, seconds=0.0, cache_dir=None)
    t0 = time.perf_counter()
    with kernel_cache(cache_dir) as path:
        before = _entries(path)
        _compile_all(jobs, threads)
        compiled = len(_entries(path) - before) if path is not None else None
    rep = dict(kernels=len(jobs), compiled=compiled, seconds=time.perf_counter() - t0, cache_dir=path)
    if verbose:
        done = f"{compiled} compiled, the rest loaded" if compiled is not None else "Triton's cache"
        print(f"dsv4_rocm.flash_mla.warmup: {rep['kernels']} kernel variants on {device} in {rep['seconds']:.1f} s "
              f"({done}; kernel cache {path or 'of Triton'})", file=sys.stderr, flush=True)
    return rep


def _entries(path) -> set:
    """The kernels (entry directories) of a Triton cache directory."""
    try:
        return set(os.listdir(path)) if path else set()
    except FileNotFoundError:
        return set()


def _compile_all(jobs, threads):
    try:
        from concurrent.futures import ThreadPoolExecutor
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:              # a Triton without asynchronous compiles: one after the other
        AsyncCompileMode = None
    if AsyncCompileMode is None or threads == 1:
        for fn, args, kw in jobs:
            fn(*args, compile_only=True, **kw)
        return
    with ThreadPoolExecutor(max_workers=threads or os.cpu_count() or 1) as pool, AsyncCompileMode(pool):
        for fn, args, kw in jobs:
            fn(*args, compile_only=True, **kw)
