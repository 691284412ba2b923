"""The cache and Q/KV ops as torch custom ops, ``torch.ops.dsv4_rocm.<name>``, with vLLM's schemas.

vLLM calls some of these as ``torch.ops._C.<name>`` (the fused q norm + insert, its ``_out`` variant, the
full-cache fp8 and bf16 inserts, vLLM 0.33's kv-only insert): the same schema under the ``dsv4_rocm`` namespace makes the swap a changed
namespace. The others are Python functions in vLLM; as custom ops they go through torch.compile and
FakeTensor tracing unchanged. Each op has a fake (shape-only) implementation and one real implementation
for CPU and CUDA (ROCm included): the public op in ``dsv4_rocm.ops`` (checks, then the reference on
CPU, the HIP kernels on a GPU). Mutated arguments are marked ``(a!)``, so functionalization sees the
cache writes.
"""
import torch

from . import cache as _cache, qkv as _qkv

LIB = torch.library.Library("dsv4_rocm", "DEF")


def _define(schema: str, impl, fake):
    name = schema.split("(", 1)[0]
    LIB.define(schema)
    for key in ("CPU", "CUDA"):
        LIB.impl(name, impl, key)
    torch.library.register_fake(f"dsv4_rocm::{name}", fake, lib=LIB)


def _none(*args, **kwargs):
    return None


def _quantize_and_insert(k, k_cache, slot_mapping, block_size=64, is_ue8m0=True, use_fnuz=False, bytes_per_token=584):
    _cache.quantize_and_insert_k_cache(k, k_cache, slot_mapping, block_size, is_ue8m0, use_fnuz, bytes_per_token)


def _gather(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset, use_fnuz=False,
            max_gather_len=None):
    _cache.dequantize_and_gather_k_cache(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset,
                                         use_fnuz, max_gather_len)


def _global_slots(out, k_cache, slot_ids, block_size):
    _cache.dequantize_global_slots_k_cache(out, k_cache, slot_ids, block_size)


def _rmsnorm(qr, kv, q_weight, kv_weight, eps):
    return _qkv.fused_q_kv_rmsnorm(qr, kv, q_weight, kv_weight, eps)


def _rmsnorm_fake(qr, kv, q_weight, kv_weight, eps):
    return qr.new_empty(qr.shape), kv.new_empty(kv.shape)


def _qnorm_insert(q_in, kv, k_cache, slot_mapping, position_ids, cos_sin_cache, q_head_padded, eps,
                  cache_block_size, apply_q_norm=True, kv_mxfp8=False, apply_q_rope=True, is_q_interleaved=False):
    return _qkv.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(q_in, kv, k_cache, slot_mapping, position_ids,
                                                                  cos_sin_cache, q_head_padded, eps, cache_block_size,
                                                                  apply_q_norm, kv_mxfp8, apply_q_rope,
                                                                  is_q_interleaved)


def _qnorm_insert_fake(q_in, kv, k_cache, slot_mapping, position_ids, cos_sin_cache, q_head_padded, eps,
                       cache_block_size, apply_q_norm=True, kv_mxfp8=False, apply_q_rope=True, is_q_interleaved=False):
    return q_in.new_empty((q_in.shape[0], q_head_padded, q_in.shape[2]))


def _qnorm_insert_out(q_in, kv, q_out, k_cache, slot_mapping, position_ids, cos_sin_cache, q_head_padded, eps,
                      cache_block_size, apply_q_norm=True, kv_mxfp8=False, apply_q_rope=True, is_q_interleaved=False):
    _qkv.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert_out(q_in, kv, q_out, k_cache, slot_mapping, position_ids,
                                                               cos_sin_cache, q_head_padded, eps, cache_block_size,
                                                               apply_q_norm, kv_mxfp8, apply_q_rope, is_q_interleaved)


def _full_cache(q, kv, q_fp8, k_cache, slot_mapping, position_ids, cos_sin_cache, fp8_scale, q_fp8_scale_inv, eps,
                cache_block_size, apply_q_norm=True):
    _qkv.qnorm_rope_and_insert_full_k_cache(q, kv, k_cache, slot_mapping, position_ids, cos_sin_cache, eps,
                                            cache_block_size, fp8_scale, q_fp8, q_fp8_scale_inv, apply_q_norm)


def _full_bf16(q, kv, k_cache, slot_mapping, position_ids, cos_sin_cache, eps, cache_block_size, apply_q_norm=True):
    _qkv.qnorm_rope_and_insert_full_bf16_k_cache(q, kv, k_cache, slot_mapping, position_ids, cos_sin_cache, eps,
                                                 cache_block_size, apply_q_norm)


def _kv_rope_insert(kv, k_cache, slot_mapping, position_ids, cos_sin_cache, cache_block_size, fp8_scale=None,
                    kv_mxfp8=False):
    _qkv.fused_deepseek_v4_kv_rope_insert(kv, k_cache, slot_mapping, position_ids, cos_sin_cache, cache_block_size,
                                          fp8_scale, kv_mxfp8)


SCHEMAS = {
    "quantize_and_insert_k_cache":
        ("quantize_and_insert_k_cache(Tensor k, Tensor(a!) k_cache, Tensor slot_mapping, int block_size=64, "
         "bool is_ue8m0=True, bool use_fnuz=False, int bytes_per_token=584) -> ()", _quantize_and_insert, _none),
    "dequantize_and_gather_k_cache":
        ("dequantize_and_gather_k_cache(Tensor(a!) out, Tensor k_cache, Tensor seq_lens, Tensor? gather_lens, "
         "Tensor block_table, int block_size, int offset, bool use_fnuz=False, int? max_gather_len=None) -> ()",
         _gather, _none),
    "dequantize_global_slots_k_cache":
        ("dequantize_global_slots_k_cache(Tensor(a!) out, Tensor k_cache, Tensor slot_ids, int block_size) -> ()",
         _global_slots, _none),
    "fused_q_kv_rmsnorm":
        ("fused_q_kv_rmsnorm(Tensor qr, Tensor kv, Tensor q_weight, Tensor kv_weight, float eps) -> (Tensor, Tensor)",
         _rmsnorm, _rmsnorm_fake),
    "fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert":
        ("fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(Tensor q_in, Tensor kv, Tensor(a!) k_cache, "
         "Tensor slot_mapping, Tensor position_ids, Tensor cos_sin_cache, int q_head_padded, float eps, "
         "int cache_block_size, bool apply_q_norm=True, bool kv_mxfp8=False, bool apply_q_rope=True, "
         "bool is_q_interleaved=False) -> Tensor", _qnorm_insert, _qnorm_insert_fake),
    "fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert_out":
        ("fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert_out(Tensor q_in, Tensor kv, Tensor(a!) q_out, "
         "Tensor(b!) k_cache, Tensor slot_mapping, Tensor position_ids, Tensor cos_sin_cache, int q_head_padded, "
         "float eps, int cache_block_size, bool apply_q_norm=True, bool kv_mxfp8=False, bool apply_q_rope=True, "
         "bool is_q_interleaved=False) -> ()", _qnorm_insert_out, _none),
    "fused_deepseek_v4_qnorm_rope_kv_rope_full_cache_fp8_insert":
        ("fused_deepseek_v4_qnorm_rope_kv_rope_full_cache_fp8_insert(Tensor q, Tensor kv, Tensor(a!) q_fp8, "
         "Tensor(b!) k_cache, Tensor slot_mapping, Tensor position_ids, Tensor cos_sin_cache, Tensor fp8_scale, "
         "Tensor q_fp8_scale_inv, float eps, int cache_block_size, bool apply_q_norm=True) -> ()", _full_cache, _none),
    "fused_deepseek_v4_qnorm_rope_kv_rope_full_cache_bf16_insert":
        ("fused_deepseek_v4_qnorm_rope_kv_rope_full_cache_bf16_insert(Tensor(a!) q, Tensor kv, Tensor(b!) k_cache, "
         "Tensor slot_mapping, Tensor position_ids, Tensor cos_sin_cache, float eps, int cache_block_size, "
         "bool apply_q_norm=True) -> ()", _full_bf16, _none),
    "fused_deepseek_v4_kv_rope_insert":
        ("fused_deepseek_v4_kv_rope_insert(Tensor kv, Tensor(a!) k_cache, Tensor slot_mapping, Tensor position_ids, "
         "Tensor cos_sin_cache, int cache_block_size, Tensor? fp8_scale=None, bool kv_mxfp8=False) -> ()",
         _kv_rope_insert, _none),
}

for _schema, _impl, _fake in SCHEMAS.values():
    _define(_schema, _impl, _fake)
