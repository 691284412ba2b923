"""LayerWeights.from_checkpoint: DeepSeek-V4 checkpoint names, FP8 with UE8M0 block scales or bf16, fused as
vLLM fuses them, sharded for a tensor-parallel rank."""
import pytest
import torch

from dsv4_rocm.config import LayerType, tiny_config
from dsv4_rocm.reference.output import quantize_weight
from dsv4_rocm.weights import LayerWeights

CFG = tiny_config()


def _fp8(shape, g):
    """(e4m3 weight, UE8M0 scale bytes) of a random weight, as a checkpoint stores them."""
    w8, s = quantize_weight(torch.randn(*shape, generator=g) * shape[-1] ** -0.5)
    b = ((s.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    return w8.view(torch.float8_e4m3fn), b.view(torch.float8_e8m0fnu) if hasattr(torch, "float8_e8m0fnu") else b


def checkpoint(cfg, layer, prefix="layers.{}.attn.", seed=0, bf16=()):
    """Tensors of one attention layer under checkpoint names (``bf16``: linears stored unquantized)."""
    g = torch.Generator().manual_seed(seed)
    hid, ql, H, G, o = cfg.hidden_size, cfg.q_lora_rank, cfg.num_heads, cfg.o_groups, cfg.o_lora_rank
    t = {}
    for name, shape in (("wq_a", (ql, hid)), ("wkv", (512, hid)), ("wq_b", (H * 512, ql)),
                        ("wo_a", (G * o, cfg.heads_per_group * 512)), ("wo_b", (hid, G * o))):
        if name in bf16:
            t[f"{name}.weight"] = (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).bfloat16()
        else:
            t[f"{name}.weight"], t[f"{name}.scale"] = _fp8(shape, g)
    t["q_norm.weight"] = (1 + 0.1 * torch.randn(ql, generator=g)).bfloat16()
    t["kv_norm.weight"] = (1 + 0.1 * torch.randn(512, generator=g)).bfloat16()
    t["attn_sink"] = torch.randn(H, generator=g)
    lt = cfg.layer_type(layer)
    if lt != LayerType.SWA:
        r = 4 if lt == LayerType.C4 else 128
        for p, dim, rr in (("compressor", 512, r),) + ((("indexer.compressor", 128, 4),) if r == 4 else ()):
            cc = 2 if rr == 4 else 1
            t[f"{p}.wkv.weight"] = torch.randn(cc * dim, hid, generator=g).bfloat16()
            t[f"{p}.wgate.weight"] = torch.randn(cc * dim, hid, generator=g).bfloat16()
            t[f"{p}.ape"] = torch.randn(rr, cc * dim, generator=g)
            t[f"{p}.norm.weight"] = torch.randn(dim, generator=g).bfloat16()
    if lt == LayerType.C4:
        t["indexer.wq_b.weight"], t["indexer.wq_b.scale"] = _fp8((cfg.index_n_heads * 128, ql), g)
        t["indexer.weights_proj.weight"] = torch.randn(cfg.index_n_heads, hid, generator=g).bfloat16()
    return {prefix.format(layer) + k: v for k, v in t.items()}


def _pow2(b):
    return torch.ldexp(torch.ones(b.shape), (b.view(torch.uint8).long() - 127).float())


@pytest.mark.parametrize("prefix", ["layers.{}.attn.", "model.layers.{}.self_attn.", ""])
def test_fused_and_scaled_as_vllm(prefix):
    layer = 1                                   # tiny config: C4
    ck = checkpoint(CFG, layer, prefix)
    ck.update(checkpoint(CFG, 2, "layers.{}.attn.", seed=9) if prefix else {})   # another layer is ignored
    w = LayerWeights.from_checkpoint(ck, CFG, layer)
    p = prefix.format(layer)
    assert torch.equal(w.wqkv8, torch.cat([ck[p + "wq_a.weight"], ck[p + "wkv.weight"]]).view(torch.uint8))
    assert torch.equal(w.wqkv_s, torch.cat([_pow2(ck[p + "wq_a.scale"]), _pow2(ck[p + "wkv.scale"])]))
    G, o = CFG.local_groups, CFG.o_lora_rank
    assert torch.equal(w.wo_a8, ck[p + "wo_a.weight"].view(torch.uint8).view(G, o, -1))
    assert torch.equal(w.comp_w, torch.cat([ck[p + "compressor.wkv.weight"], ck[p + "compressor.wgate.weight"]]))
    assert torch.equal(w.idx_comp_ape, ck[p + "indexer.compressor.ape"])
    assert w.attn_sink.shape == (CFG.padded_heads,) and torch.isneginf(w.attn_sink[CFG.local_heads:]).all()
    assert torch.equal(w.attn_sink[:CFG.local_heads], ck[p + "attn_sink"])


def test_tensor_parallel_rank_keeps_its_heads_and_groups():
    cfg = tiny_config(num_heads=16)                # two output groups of 8 heads
    cfg2 = cfg.with_tp(2)
    ck = checkpoint(cfg, 1)
    full = LayerWeights.from_checkpoint(ck, cfg, 1)
    for rank in (0, 1):
        w = LayerWeights.from_checkpoint(ck, cfg2, 1, tp_rank=rank)
        H, G = cfg2.local_heads, cfg2.local_groups
        assert torch.equal(w.wq_b8, full.wq_b8[rank * H * 512:(rank + 1) * H * 512])
        assert torch.equal(w.wo_a8, full.wo_a8[rank * G:(rank + 1) * G])
        assert torch.equal(w.wo_b8, full.wo_b8[:, rank * G * cfg.o_lora_rank:(rank + 1) * G * cfg.o_lora_rank])
        assert torch.equal(w.attn_sink[:H], full.attn_sink[rank * H:(rank + 1) * H])
        assert torch.equal(w.wqkv8, full.wqkv8) and torch.equal(w.idx_wq_b8, full.idx_wq_b8)   # replicated
    with pytest.raises(ValueError, match="tp_rank"):
        LayerWeights.from_checkpoint(ck, cfg2, 1, tp_rank=2)


def test_bf16_linears_are_quantized_to_the_same_form():
    ck = checkpoint(CFG, 0, bf16=("wq_b", "wo_b"))
    w = LayerWeights.from_checkpoint(ck, CFG, 0)
    q, s = quantize_weight(ck["layers.0.attn.wq_b.weight"].float())
    assert torch.equal(w.wq_b8, q) and torch.equal(w.wq_b_s, s)


def test_missing_or_misshapen_tensors_are_named():
    ck = checkpoint(CFG, 3)
    del ck["layers.3.attn.wkv.scale"]
    with pytest.raises(ValueError, match="wkv.scale"):
        LayerWeights.from_checkpoint(ck, CFG, 3)
    ck = checkpoint(CFG, 3)
    ck["layers.3.attn.q_norm.weight"] = ck["layers.3.attn.q_norm.weight"][:5]
    with pytest.raises(ValueError, match="q_norm.weight.*shape"):
        LayerWeights.from_checkpoint(ck, CFG, 3)


def test_module_runs_on_checkpoint_weights():
    from dsv4_rocm.serving import SyntheticServer
    lt = CFG.layer_type(1)
    w = LayerWeights.from_checkpoint(checkpoint(CFG, 1), CFG, 1)
    s = SyntheticServer(CFG, lt, 1, 128, weights=w)
    y = s.step({0: torch.randn(9, CFG.hidden_size).bfloat16()})[0]
    assert y.shape == (9, CFG.hidden_size) and torch.isfinite(y.float()).all()
