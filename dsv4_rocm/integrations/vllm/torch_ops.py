"""The ``torch.ops`` forms vLLM 0.33 calls DeepSeek-V4 kernels by, where vLLM's build lacks them.

vLLM calls some kernels as compiled custom ops: ``torch.ops._C.<name>`` (the fused q/kv inserts, the
kv-only insert, the top-k ops) and ``torch.ops._C_cache_ops.<name>`` (the indexer-K cache ops). A vLLM
build without them (a ROCm or CPU build that compiles other kernels, or a wheel whose compiled part does
not load) fails at the call. ``register_missing`` defines each one that is absent, with vLLM's schema, over
the dsv4_rocm op of the same name and call form (CPU and CUDA dispatch keys; ROCm's GPUs are "CUDA" to
torch), plus a fake implementation for tracing. An op vLLM's build has is never replaced: vLLM's compiled
extensions are loaded first (``current_platform.import_kernels``, what vLLM itself calls), then only the
names still absent are defined.
"""
import logging

import torch

logger = logging.getLogger("dsv4_rocm.integrations.vllm")


def _none(*args, **kwargs):
    return None


def _ops():
    from ... import ops
    return ops


def _qkv(name):
    from ...ops import library
    return library.SCHEMAS[name]


def _indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size, kv_cache_dtype):
    _ops().indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size, kv_cache_dtype)


def _cp_gather(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens):
    _ops().cp_gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens)


def _top_k_prefill(logits, row_starts, row_ends, indices, num_rows, stride0, stride1, top_k):
    _ops().top_k_per_row_prefill(logits, row_starts, row_ends, indices, num_rows, stride0, stride1, top_k)


def _top_k_decode(logits, next_n, seq_lens, indices, num_rows, stride0, stride1, top_k):
    _ops().top_k_per_row_decode(logits, next_n, seq_lens, indices, num_rows, stride0, stride1, top_k)


def _persistent_topk(logits, lengths, output, workspace, k, max_seq_len):
    _ops().persistent_topk(logits, lengths, output, workspace, k, max_seq_len)


def _cooperative_topk(logits, lengths, output, workspace, k, max_seq_len):
    _ops().cooperative_topk(logits, lengths, output, workspace, k, max_seq_len)


# namespace -> name -> (vLLM 0.33's schema, implementation, fake); the q/kv inserts share
# dsv4_rocm/ops/library.py's schemas (the same ones, registered there under torch.ops.dsv4_rocm)
_OTHER = {
    "_C": {
        "top_k_per_row_prefill": ("top_k_per_row_prefill(Tensor logits, Tensor rowStarts, Tensor rowEnds, "
                                  "Tensor(a!) indices, int numRows, int stride0, int stride1, int topK) -> ()",
                                  _top_k_prefill, _none),
        "top_k_per_row_decode": ("top_k_per_row_decode(Tensor logits, int next_n, Tensor seq_lens, "
                                 "Tensor(a!) indices, int numRows, int stride0, int stride1, int topK) -> ()",
                                 _top_k_decode, _none),
        "persistent_topk": ("persistent_topk(Tensor logits, Tensor lengths, Tensor(a!) output, Tensor workspace, "
                            "int k, int max_seq_len) -> ()", _persistent_topk, _none),
        "cooperative_topk": ("cooperative_topk(Tensor logits, Tensor lengths, Tensor(a!) output, Tensor workspace, "
                             "int k, int max_seq_len) -> ()", _cooperative_topk, _none),
    },
    "_C_cache_ops": {
        "indexer_k_quant_and_cache": ("indexer_k_quant_and_cache(Tensor k, Tensor(a!) kv_cache, Tensor slot_mapping, "
                                      "int quant_block_size, str kv_cache_dtype) -> ()",
                                      _indexer_k_quant_and_cache, _none),
        "cp_gather_indexer_k_quant_cache": ("cp_gather_indexer_k_quant_cache(Tensor kv_cache, Tensor(a!) dst_k, "
                                            "Tensor(b!) dst_scale, Tensor block_table, Tensor cu_seq_lens) -> ()",
                                            _cp_gather, _none),
    },
}
QKV_C_OPS = ("fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert", "fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert_out",
             "fused_deepseek_v4_qnorm_rope_kv_rope_full_cache_fp8_insert",
             "fused_deepseek_v4_qnorm_rope_kv_rope_full_cache_bf16_insert", "fused_deepseek_v4_kv_rope_insert")


def namespace_ops() -> dict:
    """{namespace: {name: (schema, implementation, fake)}} of every form this module can provide."""
    table = {ns: dict(v) for ns, v in _OTHER.items()}
    for name in QKV_C_OPS:
        table["_C"][name] = _qkv(name)
    return table


_state = {"libs": [], "defined": []}


def _load_vllm_kernels() -> None:
    try:
        from vllm.platforms import current_platform
        current_platform.import_kernels()
    except Exception as e:          # a build whose compiled part does not load: its ops are absent
        logger.info("dsv4_rocm: vLLM's compiled kernels did not load (%r)", e)


def present(namespace: str, name: str) -> bool:
    return hasattr(getattr(torch.ops, namespace), name)


def register_missing(load_vllm_kernels: bool = True) -> list:
    """Defines each op of ``namespace_ops`` that is absent from torch.ops; returns the "namespace::name" list
    defined by this call (none on a second call)."""
    if load_vllm_kernels:
        _load_vllm_kernels()
    done = []
    for ns, table in namespace_ops().items():
        missing = {n: v for n, v in table.items() if not present(ns, n)}
        if not missing:
            continue
        lib = torch.library.Library(ns, "FRAGMENT")
        for name, (schema, impl, fake) in missing.items():
            lib.define(schema)
            for key in ("CPU", "CUDA"):
                lib.impl(name, impl, key)
            torch.library.register_fake(f"{ns}::{name}", fake, lib=lib)
            done.append(f"{ns}::{name}")
        _state["libs"].append(lib)           # a Library's registrations live as long as the object
    _state["defined"] += done
    if done:
        logger.info("dsv4_rocm: torch.ops forms vLLM calls and this build lacks, now over dsv4_rocm: %s",
                    ", ".join(done))
    return done
