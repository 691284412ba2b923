"""torch.ops.dsv4_rocm.*: the cache and Q/KV ops registered with vLLM's schemas, fakes and a real
implementation for CPU and CUDA, checked by torch.library.opcheck (schema mutations, fake tensors,
AOT dispatch with dynamic shapes). On the GPU the same, plus the HIP launchers (torch.ops.dsv4_rocm_hip).

fp8 tensors go in as uint8 bytes here: opcheck compares arguments with allclose, which CPU torch lacks for
float8 (the op accepts either dtype).
"""
import pytest
import torch

from dsv4_rocm import layout as L
from dsv4_rocm import ops  # noqa: F401  (registers torch.ops.dsv4_rocm)
from dsv4_rocm.reference import cache as rc
from dsv4_rocm.reference.rope import build_cos_sin_cache
from helpers import random_k

LIB = torch.ops.dsv4_rocm

GROWN = ("bool apply_q_norm=True, bool kv_mxfp8=False, bool apply_q_rope=True, bool is_q_interleaved=False")
VLLM_SCHEMAS = {   # torch.ops._C schemas of vLLM (csrc torch_bindings), argument names and order
    # the 13-argument schema of vLLM's V4.1 code (its tenth argument apply_q_norm: DeepSeek-V4.1 passes False)
    "fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert":
        "(Tensor q_in, Tensor kv, Tensor(a!) k_cache, Tensor slot_mapping, Tensor position_ids, "
        f"Tensor cos_sin_cache, int q_head_padded, float eps, int cache_block_size, {GROWN}) -> Tensor",
    "fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert_out":   # its _out form, with the same trailing flags
        "(Tensor q_in, Tensor kv, Tensor(a!) q_out, Tensor(b!) k_cache, Tensor slot_mapping, Tensor position_ids, "
        f"Tensor cos_sin_cache, int q_head_padded, float eps, int cache_block_size, {GROWN}) -> ()",
    # vLLM 0.33.0's csrc/torch_bindings.cpp (its Tensor! written as this library's alias annotations)
    "fused_deepseek_v4_qnorm_rope_kv_rope_full_cache_fp8_insert":
        "(Tensor q, Tensor kv, Tensor(a!) q_fp8, Tensor(b!) k_cache, Tensor slot_mapping, Tensor position_ids, "
        "Tensor cos_sin_cache, Tensor fp8_scale, Tensor q_fp8_scale_inv, float eps, int cache_block_size, "
        "bool apply_q_norm=True) -> ()",
    "fused_deepseek_v4_qnorm_rope_kv_rope_full_cache_bf16_insert":
        "(Tensor(a!) q, Tensor kv, Tensor(b!) k_cache, Tensor slot_mapping, Tensor position_ids, "
        "Tensor cos_sin_cache, float eps, int cache_block_size, bool apply_q_norm=True) -> ()",
    "fused_deepseek_v4_kv_rope_insert":    # vLLM 0.33's kv-only insert
        "(Tensor kv, Tensor(a!) k_cache, Tensor slot_mapping, Tensor position_ids, Tensor cos_sin_cache, "
        "int cache_block_size, Tensor? fp8_scale=None, bool kv_mxfp8=False) -> ()",
}



def _filled(*shape, dtype, device):
    """An output argument for opcheck, poisoned: opcheck copies its arguments before the op runs, and a copy of
    memory nothing wrote is a read initcheck reports (the op itself writes these whole)."""
    return torch.full(shape, 0xAB if dtype == torch.uint8 else -7.0, dtype=dtype, device=device)

def cases(device):
    """(op, args) for every registered op, in vLLM's call forms, with padding slots and cache views."""
    d = torch.device(device)
    k = random_k(8).to(d)
    cache = torch.zeros(3, 64, 584, dtype=torch.uint8, device=d)
    rc.quantize_and_insert_k_cache(random_k(192).to(d), cache, torch.arange(192, device=d), 64)
    slots = torch.tensor([0, 5, -1, 70, 130, 1, 2, 3], device=d)
    cs = build_cos_sin_cache(10000.0, 128, device=d)
    q = torch.randn(8, 4, 512, device=d).bfloat16()
    pos = torch.arange(8, device=d)
    bt = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32, device=d)
    full = torch.zeros(4, 16, 512, dtype=torch.uint8, device=d)
    one = torch.tensor([0.5], device=d)
    v41 = torch.zeros(3, 64, 528, dtype=torch.uint8, device=d)
    return {
        "quantize_and_insert_k_cache[528]": (k, v41.view(3, -1), slots, 64, True, False, 528),
        "fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert[528, interleaved q]":
            (q, k, v41.view(3, -1), slots, pos, cs, 8, 1e-6, 64, False, True, False, True),
        "quantize_and_insert_k_cache": (k, cache.view(3, -1), slots),
        "dequantize_and_gather_k_cache": (torch.zeros(2, 80, 512, device=d).bfloat16(), cache,
                                          torch.tensor([70, 6], device=d), torch.tensor([66, 6], device=d), bt, 64, 3),
        "dequantize_global_slots_k_cache": (torch.zeros(3, 5, 512, device=d).bfloat16(), cache.unsqueeze(-2),
                                            torch.randint(-1, 192, (3, 5), device=d), 64),
        "fused_q_kv_rmsnorm": (q.view(8, -1)[:, :1024], k, torch.ones(1024, device=d).bfloat16(),
                               torch.ones(512, device=d).bfloat16(), 1e-6),
        "fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert": (q, k, cache.view(3, -1), slots, pos, cs, 8, 1e-6, 64),
        "fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert_out":
            (q, k, _filled(8, 8, 512, dtype=torch.bfloat16, device=d), cache.view(3, -1), slots, pos, cs.bfloat16(),
             8, 1e-6, 64),
        "fused_deepseek_v4_qnorm_rope_kv_rope_full_cache_fp8_insert":
            (q, k, _filled(8, 4, 512, dtype=torch.uint8, device=d), full, torch.tensor([0, 17, -1, 63], device=d),
             pos.int(), cs, one, one * 4, 1e-6, 16),
        "fused_deepseek_v4_qnorm_rope_kv_rope_full_cache_bf16_insert":
            (q.clone(), k, torch.zeros(4, 16, 512, device=d).bfloat16(), torch.tensor([0, 17, -1, 63], device=d), pos,
             cs, 1e-6, 16, False),
        "fused_deepseek_v4_kv_rope_insert": (k, cache.view(3, -1), slots, pos, cs, 64),
        "fused_deepseek_v4_kv_rope_insert[528]": (k, v41, slots, pos, cs, 64, None, True),
        "fused_deepseek_v4_kv_rope_insert[bf16 rows]": (k, torch.zeros(4, 16, 512, device=d).bfloat16(),
                                                        torch.tensor([0, 17, -1, 63], device=d), pos, cs, 16),
    }


def test_vllm_schemas():
    for name, schema in VLLM_SCHEMAS.items():
        assert str(getattr(LIB, name).default._schema) == f"dsv4_rocm::{name}{schema}"


@pytest.mark.parametrize("name", sorted(cases("cpu")))
def test_opcheck_cpu(name):
    res = torch.library.opcheck(getattr(LIB, name.split("[")[0]).default, cases("cpu")[name])
    print(name, res)
    assert set(res.values()) == {"SUCCESS"}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(cases("cpu")))
def test_opcheck_gpu(name, gpu):
    res = torch.library.opcheck(getattr(LIB, name.split("[")[0]).default, cases(gpu)[name])
    print(name, res)
    assert set(res.values()) == {"SUCCESS"}


@pytest.mark.gpu
def test_opcheck_hip_launchers(gpu):
    """The launchers under their own namespace: schema mutations and fakes agree with the kernels."""
    from dsv4_rocm import cache_views as V
    from dsv4_rocm._build import load
    hip = load()
    c = cases(gpu)
    k, cache, slots = c["quantize_and_insert_k_cache"]
    pages = V.pages(cache, 64)
    q, _, _, _, pos, cs, _, _, _ = c["fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert"]
    _, v41, *_ = c["quantize_and_insert_k_cache[528]"]
    v41_pages = V.pages(v41, 64, "k_cache", L.V41_528)
    checks = [
        (hip.quantize_and_insert_k_cache, (k, pages, slots, 64, 0, False, False)),
        (hip.quantize_and_insert_k_cache, (k, pages, slots, 64, 0, True, False)),          # the FNUZ flavour
        (hip.quantize_and_insert_k_cache, (k, v41_pages, slots, 64, 1, False, False)),
        (hip.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert,
         (q, k, _filled(8, 8, 512, dtype=torch.bfloat16, device=gpu), pages, slots.int(), pos, cs, 1e-6, 64, 0,
          False,
          False, True, True, False)),
        (hip.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert,
         (q, k, _filled(8, 8, 512, dtype=torch.bfloat16, device=gpu), v41_pages, slots.int(), pos, cs, 1e-6, 64, 1,
          False,
          False, False, False, True)),
        (hip.dequantize_and_gather_k_cache, (c["dequantize_and_gather_k_cache"][0], pages,
                                             *c["dequantize_and_gather_k_cache"][2:], 0, True, False)),
        (hip.dequantize_global_slots_k_cache, (c["dequantize_global_slots_k_cache"][0], pages,
                                               *c["dequantize_global_slots_k_cache"][2:], 0, False, False)),
        (hip.fused_q_kv_rmsnorm, (*c["fused_q_kv_rmsnorm"][:4], _filled(8, 1024, dtype=torch.bfloat16, device=gpu),
                                  _filled(8, 512, dtype=torch.bfloat16, device=gpu), 1e-6)),
    ]
    full = c["fused_deepseek_v4_qnorm_rope_kv_rope_full_cache_fp8_insert"]
    checks += [(hip.qnorm_rope_and_insert_full_k_cache, (*full, apply)) for apply in (True, False)]
    for op, args in checks:
        res = torch.library.opcheck(op.default, args)
        print(op, res)
        assert set(res.values()) == {"SUCCESS"}
