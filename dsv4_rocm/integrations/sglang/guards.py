"""What the SGLang plugin relies on, checked before it registers anything.

SGLang's internals change between releases; the plugin replaces a backend class and three functions by
their dotted paths and calls them with the keywords SGLang 0.5.23 uses. It registers its hooks only on a
release it was written for, and only when every hooked callable still has the parameters listed here.
Nothing here imports SGLang at module import: ``mismatches`` does.
"""
import importlib
import importlib.metadata
import inspect
from typing import Dict, List, Tuple

SUPPORTED_SGLANG = ("0.5.23",)

_ATTN = "sglang.srt.layers.attention"
BACKEND_CLASS = f"{_ATTN}.deepseek_v4_backend_hip_radix.DeepseekV4HipRadixBackend"
RESOLVE = f"{_ATTN}.hip_flash_mla.resolve_hip_flashmla_backend"
ENTRYPOINT = f"{_ATTN}.hip_flash_mla.flash_mla_with_kvcache_entrypoint"
STORE = "sglang.kernels.ops.attention.dsv4.attn.fused_store_cache"
UNIFIED_KV_GATE = f"{_ATTN}.dsv4.unified_kv_gate.is_unified_kv_triton"

# dotted path -> parameter names, in order
SIGNATURES: Dict[str, Tuple[str, ...]] = {
    RESOLVE: ("backend",),
    ENTRYPOINT: ("backend", "kwargs"),
    STORE: ("input", "cache", "indices", "page_size", "type", "layout", "freqs_cis"),
    BACKEND_CLASS + ".__init__": ("self", "model_runner", "skip_prefill", "speculative_step_id", "topk",
                                  "speculative_num_steps"),
    BACKEND_CLASS + "._opus_prefill_applies": ("self", "q", "forward_batch", "compress_ratio"),
    BACKEND_CLASS + "._forward_attention": ("self", "q", "k", "v", "layer", "forward_batch", "compress_ratio",
                                            "save_kv_cache", "attn_sink", "q_rope", "k_rope", "inv_rope",
                                            "wo_a_quant_freqs", "_"),
    UNIFIED_KV_GATE: (),
}


def resolve(path: str):
    """The object at a dotted path: the longest prefix that is a module, then attributes. A module that
    exists but fails to import raises its own error (what is missing in the environment)."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is not None and not name.startswith(e.name) and e.name != name:
                raise
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"no importable module in {path}")


def _params(fn) -> Tuple[str, ...]:
    fn = inspect.unwrap(getattr(fn, "__wrapped__", fn))
    return tuple(inspect.signature(fn).parameters)


def mismatches() -> List[str]:
    """One line per difference from what the plugin was written for (empty when all match)."""
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return ["sglang is not installed"]
    problems = [] if version in SUPPORTED_SGLANG else [f"sglang {version} (written for {SUPPORTED_SGLANG})"]
    for path, want in SIGNATURES.items():
        try:
            got = _params(resolve(path))
        except Exception as e:  # noqa: BLE001  (a missing module or attribute is a difference to report)
            problems.append(f"{path}: {type(e).__name__}: {e}")
            continue
        if got != want:
            problems.append(f"{path}{got} (expected {want})")
    return problems
