"""What the vLLM plugin relies on, checked before it activates.

vLLM's internals change between releases (a method gains a parameter, a builder its keyword). The plugin
subclasses vLLM's DeepSeek-V4 attention layer and metadata builders and calls into them, so it activates
only on a vLLM version it was written for and only when every callable it extends or calls still has the
parameters listed here; otherwise it logs one line naming the difference and leaves vLLM as it is.
Nothing here imports vLLM at module import: ``check`` does, when the plugin loads.
"""
import importlib
import inspect
from typing import Dict, List, Optional, Tuple

SUPPORTED_VLLM = ("0.33.0",)

# "module:qualname" -> parameter names, in order, of what the plugin overrides or calls
SIGNATURES: Dict[str, Tuple[str, ...]] = {
    "vllm.models.deepseek_v4.attention:DeepseekV4Attention.__init__":
        ("self", "vllm_config", "prefix", "topk_indices_buffer", "aux_stream_list"),
    "vllm.models.deepseek_v4.attention:DeepseekV4Attention.forward_mqa":
        ("self", "q", "kv", "positions", "output"),
    "vllm.models.deepseek_v4.attention:DeepseekV4Attention._fused_qnorm_rope_kv_insert":
        ("self", "q", "kv", "positions", "attn_metadata"),
    "vllm.models.deepseek_v4.attention:DeepseekV4Attention.get_padded_num_q_heads":
        ("num_heads",),
    "vllm.models.deepseek_v4.attention:DeepseekV4Attention.get_attn_backend": ("self",),
    "vllm.models.deepseek_v4.sparse_mla:DeepseekV4SparseMLAMetadataBuilder.__init__":
        ("self", "kv_cache_spec", "layer_names", "vllm_config", "device"),
    "vllm.models.deepseek_v4.sparse_mla:DeepseekV4SparseMLAMetadataBuilder.build":
        ("self", "common_prefix_len", "common_attn_metadata", "fast_build"),
    "vllm.models.deepseek_v4.sparse_mla:DeepseekV4FlashMLAMetadata.__init__":
        ("self", "num_reqs", "max_query_len", "max_seq_len", "num_actual_tokens", "query_start_loc", "slot_mapping",
         "block_table", "req_id_per_token", "block_size", "topk_tokens", "c128a_global_decode_topk_indices",
         "c128a_decode_topk_lens", "c128a_prefill_topk_indices"),
    "vllm.v1.attention.backend:CommonAttentionMetadata.token_to_req_indices": ("self", "buffer"),
    "vllm.v1.attention.backend:AttentionMetadataBuilder.__init__":
        ("self", "kv_cache_spec", "layer_names", "vllm_config", "device"),
    "vllm.v1.attention.backends.mla.sparse_swa:DeepseekV4SWACache.__init__":
        ("self", "head_dim", "window_size", "dtype", "prefix", "cache_config", "backend_cls", "block_size",
         "packed_bytes_per_token", "packed_page_alignment", "packed_block_stride_alignment", "bounded_replay"),
    "vllm.v1.attention.backends.utils:split_decodes_and_prefills":
        ("common_attn_metadata", "decode_threshold", "require_uniform", "treat_short_extends_as_decodes"),
    "vllm.v1.attention.backends.registry:register_backend": ("backend", "class_path", "is_mamba"),
}

# CommonAttentionMetadata fields the builders read
COMMON_METADATA_FIELDS = ("query_start_loc", "query_start_loc_cpu", "seq_lens", "num_reqs", "num_actual_tokens",
                          "max_query_len", "max_seq_len", "block_table_tensor", "slot_mapping", "positions",
                          "seq_lens_cpu_upper_bound")


def _resolve(path: str):
    module, qualname = path.split(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def signature_mismatches() -> List[str]:
    """One line per listed callable whose parameters differ from those recorded (empty when all match)."""
    problems = []
    for path, want in SIGNATURES.items():
        try:
            got = tuple(inspect.signature(_resolve(path)).parameters)
        except (ImportError, AttributeError) as e:
            problems.append(f"{path} is missing ({type(e).__name__}: {e})")
            continue
        if got != want:
            problems.append(f"{path}{got} differs from {want}")
    try:
        import dataclasses
        from vllm.v1.attention.backend import CommonAttentionMetadata
        names = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
        missing = [n for n in COMMON_METADATA_FIELDS if n not in names]
        if missing:
            problems.append(f"CommonAttentionMetadata lacks {missing}")
    except ImportError as e:
        problems.append(f"vllm.v1.attention.backend.CommonAttentionMetadata is missing ({e})")
    return problems


def check(version: Optional[str] = None) -> List[str]:
    """Reasons not to activate (empty: activate): an unsupported vLLM version, or signature differences."""
    if version is None:
        try:
            import vllm
        except ImportError as e:
            return [f"vllm is not importable ({e})"]
        version = getattr(vllm, "__version__", "unknown")
    if version not in SUPPORTED_VLLM:
        return [f"vllm {version} is not a version this plugin was written for ({', '.join(SUPPORTED_VLLM)})"]
    return signature_mismatches()
