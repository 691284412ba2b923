"""Bad input to the public ops: a ValueError naming the argument, before any work is done."""
import pytest
import torch

from dsv4_rocm import ops
from dsv4_rocm.reference import cache as rc
from dsv4_rocm.reference.rope import build_cos_sin_cache

CS = build_cos_sin_cache(10000.0, 64)


def test_qnorm_insert_checks():
    q = torch.randn(4, 8, 512).bfloat16()
    kv = torch.randn(4, 512).bfloat16()
    cache = rc.new_cache(1, 64)
    pos = torch.arange(4)
    s = torch.arange(4)
    with pytest.raises(ValueError, match="padded_heads"):
        ops.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(q, kv, cache, s, pos, CS, 4, 1e-6, 64)
    with pytest.raises(ValueError, match="kv must have shape"):
        ops.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(q, kv[:3], cache, s, pos, CS, 64, 1e-6, 64)
    with pytest.raises(ValueError, match="positions must lie"):
        ops.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(q, kv, cache, s, pos + 61, CS, 64, 1e-6, 64)
    with pytest.raises(ValueError, match="cos_sin_cache must have dtype"):
        ops.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(q, kv, cache, s, pos, CS.double(), 64, 1e-6, 64)
    before = cache.clone()
    with pytest.raises(ValueError, match="outside the cache"):
        ops.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(q, kv, cache, s + 61, pos, CS, 64, 1e-6, 64)
    assert torch.equal(cache, before)                      # nothing written before the error


def test_output_and_indexer_checks():
    a8, z = torch.zeros(2, 1, 512, dtype=torch.uint8), torch.empty(2, 1, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="a_scale"):
        ops.fp8_einsum("bhr,hdr->bhd", (a8, torch.ones(2, 1, 3)), (torch.zeros(1, 128, 512, dtype=torch.uint8),
                                                                    torch.ones(1, 1, 4)), z)
    with pytest.raises(ValueError, match="w must have shape"):
        ops.fp8_einsum("bhr,hdr->bhd", (a8, torch.ones(2, 1, 4)), (torch.zeros(2, 128, 512, dtype=torch.uint8),
                                                                    torch.ones(2, 1, 4)), z)
    with pytest.raises(ValueError, match="q must have dtype"):
        ops.fp8_mqa_logits(torch.zeros(2, 4, 128), (torch.zeros(3, 128, dtype=torch.uint8), torch.ones(3)),
                           torch.ones(2, 4), torch.zeros(2, dtype=torch.int32), torch.ones(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="block_tables names a page"):
        ops.fp8_paged_mqa_logits(torch.zeros(1, 1, 4, 128, dtype=torch.uint8),
                                 torch.zeros(1, 64, 132, dtype=torch.uint8), torch.ones(1, 4),
                                 torch.tensor([3], dtype=torch.int32), torch.tensor([[5]], dtype=torch.int32),
                                 torch.zeros(2, 2, dtype=torch.int32), 3)
    with pytest.raises(ValueError, match="qr and kv rows"):
        ops.fused_q_kv_rmsnorm(torch.zeros(2, 12).bfloat16(), torch.zeros(2, 512).bfloat16(),
                               torch.ones(12), torch.ones(512), 1e-6)


def test_prefill_checks():
    q = torch.randn(3, 64, 512).bfloat16()
    kv = torch.randn(10, 1, 512).bfloat16()
    idx = torch.zeros(3, 1, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="d_v"):
        ops.sparse_mla_prefill(q, kv, idx, 0.04, 576)
    with pytest.raises(ValueError, match="indices must have shape"):
        ops.sparse_mla_prefill(q, kv, idx[:2], 0.04)
    with pytest.raises(ValueError, match="topk_length"):
        ops.sparse_mla_prefill(q, kv, idx, 0.04, topk_length=torch.ones(3))
    with pytest.raises(ValueError, match="kv must have dtype"):
        ops.sparse_mla_prefill(q, kv.float(), idx, 0.04)
