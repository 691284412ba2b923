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


# ---- output buffers whose elements overlap ---------------------------------------------------------------
I32 = torch.int32


def _bf(*shape):
    return torch.full(shape, float("nan"), dtype=torch.bfloat16)


def _i32(*shape):
    return torch.full(shape, -777, dtype=I32)


def _filled_cache(nb=2, bs=64):
    cache = rc.new_cache(nb, bs)
    rc.quantize_and_insert_k_cache(torch.randn(nb * bs, 512).bfloat16(), cache, torch.arange(nb * bs), bs)
    return cache


def overlap_cases():
    """{op/argument: (call(buffers), {argument: good buffer}, argument)}: one valid call per op that writes a
    caller's buffer, the buffers it writes given by name."""
    from dsv4_rocm import flash_mla
    g = torch.Generator().manual_seed(0)
    cache = _filled_cache()
    bt = torch.tensor([[1, 0], [0, 1]], dtype=I32)
    q, kv, pos, slots = torch.randn(3, 8, 512).bfloat16(), torch.randn(3, 512).bfloat16(), torch.arange(3), \
        torch.tensor([5, 70, -1])
    qd = torch.randn(2, 1, 64, 512).bfloat16()
    idx = torch.randint(-1, 128, (2, 1, 16), generator=g, dtype=I32)
    t2r, valid = torch.tensor([0, 1, 1], dtype=I32), torch.ones(3, dtype=torch.bool)
    qsl, seq = torch.tensor([0, 1, 3], dtype=I32), torch.tensor([10, 40], dtype=I32)
    logits = torch.randn(3, 50)
    a8 = torch.randint(0, 120, (3, 2, 256), generator=g, dtype=torch.uint8)
    w8 = torch.randint(0, 120, (2, 128, 256), generator=g, dtype=torch.uint8)
    icache = torch.zeros(2, 64, 132, dtype=torch.uint8)
    state = torch.zeros(2, 8, 2 * 512)
    cases = {
        "dequantize_and_gather_k_cache/out": (
            lambda b: ops.dequantize_and_gather_k_cache(b["out"], cache, torch.tensor([40, 30]), None, bt, 64, 0),
            dict(out=_bf(2, 40, 512))),
        "dequantize_global_slots_k_cache/out": (
            lambda b: ops.dequantize_global_slots_k_cache(b["out"], cache, torch.tensor([[0, 7], [3, -1]]), 64),
            dict(out=_bf(2, 2, 512))),
        "fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert_out/q_out": (
            lambda b: ops.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert_out(q, kv, b["q_out"], cache, slots, pos,
                                                                                CS, 64, 1e-6, 64),
            dict(q_out=_bf(3, 64, 512))),
        "qnorm_rope_and_insert_full_k_cache/q_fp8": (
            lambda b: ops.qnorm_rope_and_insert_full_k_cache(q, kv, torch.zeros(2, 64, 512, dtype=torch.uint8), slots,
                                                             pos, CS, 1e-6, 64, torch.ones(1), b["q_fp8"],
                                                             torch.ones(1)),
            dict(q_fp8=torch.zeros(3, 8, 512, dtype=torch.uint8))),
        "flash_mla_with_kvcache/out": (
            lambda b: flash_mla.flash_mla_with_kvcache(qd, rc.flash_mla_view(cache, 64), None, None, 512,
                                                       flash_mla.get_mla_metadata()[0], is_fp8_kvcache=True,
                                                       indices=idx, out=b["out"]),
            dict(out=_bf(2, 1, 64, 512))),
        "flash_mla_sparse_fwd/out": (
            lambda b: flash_mla.flash_mla_sparse_fwd(q[:2].repeat(1, 8, 1), torch.randn(9, 1, 512).bfloat16(),
                                                     idx[:, :, :8] % 9, 0.04, out=b["out"]),
            dict(out=_bf(2, 64, 512))),
        "get_compressed_slot_mapping/out": (
            lambda b: ops.get_compressed_slot_mapping(3, qsl, seq, bt, 64, 4, out=b["out"]),
            dict(out=torch.full((4,), -777, dtype=torch.int64))),
        "compute_swa_indices_and_lens/swa_indices+swa_lens": (
            lambda b: ops.compute_swa_indices_and_lens(b["swa_indices"], b["swa_lens"], 8, qsl, seq, t2r, valid, bt,
                                                       64),
            dict(swa_indices=_i32(3, 8), swa_lens=_i32(3))),
        "compute_prefill_gather_lens/prefill_gather_lens": (
            lambda b: ops.compute_prefill_gather_lens(b["prefill_gather_lens"], seq, qsl, 2, 0, 8),
            dict(prefill_gather_lens=_i32(2))),
        "compute_global_topk_indices_and_lens/output_buffers": (
            lambda b: ops.compute_global_topk_indices_and_lens(idx[:, 0], t2r[:2], bt, 64, valid[:2],
                                                               (b["output_buffers[0]"], b["output_buffers[1]"])),
            {"output_buffers[0]": _i32(2, 16), "output_buffers[1]": _i32(2)}),
        "build_c128a_topk_metadata/buffers": (
            lambda b: ops.build_c128a_topk_metadata(torch.tensor([300, 500, 5, 9]), 128, 2, t2r[:2], bt, 2,
                                                    torch.tensor([1, 2]), b["global_decode_buffer"],
                                                    b["decode_lens_buffer"], b["prefill_buffer"], 8),
            dict(global_decode_buffer=_i32(2, 8), decode_lens_buffer=_i32(2), prefill_buffer=_i32(2, 8))),
        "combine_topk_swa_indices/combined": (
            lambda b: ops.combine_topk_swa_indices(idx[:, 0, :4].repeat(2, 1)[:3] % 8, qsl, seq, torch.tensor(
                [8, 9], dtype=I32), 4, 4, 4, 30, 12, combined_indices=b["combined_indices"],
                combined_lens=b["combined_lens"]),
            dict(combined_indices=_i32(3, 128), combined_lens=_i32(3))),
        "cp_gather_indexer_k_quant_cache/dst_k": (
            lambda b: ops.cp_gather_indexer_k_quant_cache(icache, b["dst_k"], torch.zeros(4, 4, dtype=torch.uint8),
                                                          bt, torch.tensor([0, 2, 4])),
            dict(dst_k=torch.zeros(4, 128, dtype=torch.uint8))),
        "top_k_per_row_prefill/out_idx": (
            lambda b: ops.top_k_per_row_prefill(logits, torch.zeros(3, dtype=I32), torch.full((3,), 50, dtype=I32),
                                                b["out_idx"], 3, 50, 1, 4),
            dict(out_idx=_i32(3, 4))),
        "top_k_per_row_decode/out_idx": (
            lambda b: ops.top_k_per_row_decode(logits, 1, torch.tensor([20, 30, 50], dtype=I32), b["out_idx"], 3, 50,
                                               1, 4),
            dict(out_idx=_i32(3, 4))),
        "persistent_topk/output": (
            lambda b: ops.persistent_topk(logits, torch.tensor([20, 30, 50], dtype=I32), b["output"],
                                          torch.empty(0, dtype=torch.uint8), 4, 50),
            dict(output=_i32(3, 4))),
        "fp8_einsum/d": (
            lambda b: ops.fp8_einsum("bhr,hdr->bhd", (a8, torch.ones(3, 2, 2)), (w8, torch.ones(2, 1, 2)), b["d"]),
            dict(d=_bf(3, 2, 128))),
        "save_partial_states/state_cache": (
            lambda b: ops.save_partial_states(torch.randn(3, 512), torch.randn(3, 512), torch.randn(128, 512), pos,
                                              b["state_cache"], torch.tensor([5, 10, -1]), 8, 512, 128),
            dict(state_cache=state)),
    }
    return cases


def _overlapping(t):
    """A view of t's shape whose rows all share the memory of one row (stride 0 along dim 0), over a
    poisoned backing row; returns (view, backing)."""
    backing = t[:1].clone()
    return backing.expand(t.shape), backing


CASES = overlap_cases()


@pytest.mark.parametrize("case", sorted(CASES))
def test_overlapping_output_buffers_are_rejected_by_name_before_any_write(case):
    """An output whose elements alias each other (buf[:1].expand(...)) is a ValueError naming it, before
    anything is written: neither the buffers nor the caches change. Every op that takes caller buffers."""
    call, good = CASES[case]
    ref = {k: v.clone() for k, v in good.items()}
    call(ref)                                          # the call is valid with distinct buffers
    for name in good:
        bufs = {k: v.clone() for k, v in good.items()}
        bufs[name], backing = _overlapping(good[name])
        keep = backing.clone()
        others = {k: v.clone() for k, v in bufs.items() if k != name}
        with pytest.raises(ValueError, match=rf"{name.replace('[', '.').replace(']', '.')}.*overlap"):
            call(bufs)
        assert torch.equal(backing.view(torch.uint8), keep.view(torch.uint8)), name
        assert all(torch.equal(bufs[k].view(torch.uint8), v.view(torch.uint8)) for k, v in others.items()), name


def test_overlap_check_accepts_strided_slices_and_finds_partial_overlap():
    from dsv4_rocm import _checks as C
    work = torch.empty(4, 10, 512)
    for t in (work, work[:, 2:6], work[1:3], work.permute(1, 0, 2), work[:, :, :8].transpose(0, 1),
              torch.empty(0, 3).expand(0, 3), torch.empty(5, 1).expand(5, 1),
              torch.empty(16).as_strided((3, 3), (2, 3))):                   # interleaved, yet distinct
        C.no_overlap("out", t)
    for t in (work[:1].expand(2, 10, 512), torch.empty(8).as_strided((3, 3), (1, 2)),
              torch.empty(64).as_strided((4, 4), (2, 3))):
        with pytest.raises(ValueError, match="out: elements overlap"):
            C.no_overlap("out", t)
