"""vLLM 0.33.0's own DeepSeek-V4 attention layer, built and driven as vLLM's model runner does, for the
layer tests (test_vllm_layer.py on CPU, test_vllm_layer_gpu.py on a GPU).

What is vLLM's and runs for real: the ``ModelConfig`` read from a tiny local checkpoint directory
(``config.json`` of ``transformers.DeepseekV4Config``), ``VllmConfig`` with ``--attention-backend DSV4_ROCM``
parsed by vLLM's ``AttentionConfig``, vLLM's parallel state (world size 1, gloo), the platform's layer class
as vLLM's plugin loader leaves it (dsv4_rocm's hooked subclass), its constructor (linear layers, norms,
rotary embedding, compressors, indexer, SWA cache layer, state caches), the parameters' own
``weight_loader``s and ``process_weights_after_loading``, each cache layer's ``get_kv_cache_spec``,
``get_attn_backend`` and ``bind_kv_cache``, each backend's metadata builder on a ``CommonAttentionMetadata``
per KV-cache group, ``set_forward_context``, and the layer's ``forward``.

What is not vLLM's, and why: the caches are allocated here from vLLM's specs (page bytes, block sizes) rather
than by vLLM's KV-cache manager and runner (which need the whole model); the block tables and slot mappings
are made here as vLLM's scheduler would (decode requests first, one table per group). The oracle is
dsv4_rocm's own ``DeepseekV4Attention`` with the same weights over its own caches.
"""
import os
import socket
import tempfile
from dataclasses import dataclass, field
from typing import Dict, List

import torch

from dsv4_rocm import layout as L
from dsv4_rocm.config import AttentionConfig, LayerType, tiny_config
from dsv4_rocm.reference.output import dequantize_weight
from dsv4_rocm.weights import LayerWeights

LAYER_TYPES = {LayerType.SWA: "sliding_attention", LayerType.C4: "compressed_sparse_attention",
               LayerType.C128: "heavily_compressed_attention"}


def tiny_checkpoint_dir(cfg: AttentionConfig, max_model_len: int) -> str:
    """A directory holding the ``config.json`` of a DeepSeek-V4 model with ``cfg``'s attention geometry (no
    weight files: the layer tests load weights through the parameters' loaders)."""
    from transformers import DeepseekV4Config
    d = tempfile.mkdtemp(prefix="dsv4_tiny_")
    DeepseekV4Config(
        vocab_size=256, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_heads, q_lora_rank=cfg.q_lora_rank, o_lora_rank=cfg.o_lora_rank,
        o_groups=cfg.o_groups, sliding_window=cfg.sliding_window, index_topk=cfg.index_topk,
        index_n_heads=cfg.index_n_heads, max_position_embeddings=max_model_len,
        layer_types=[LAYER_TYPES[cfg.layer_type(i)] for i in range(cfg.num_hidden_layers)],
        moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2,
        architectures=["DeepseekV4ForCausalLM"], rms_norm_eps=cfg.rms_norm_eps).save_pretrained(d)
    return d


def vllm_config(model_dir: str, max_model_len: int, max_tokens: int, num_spec: int = 0):
    """vLLM's config of the tiny model with ``--attention-backend DSV4_ROCM`` and ``--kv-cache-dtype
    fp8_ds_mla``; ``num_spec`` > 0 adds DeepSeek's MTP speculative decoding with that many draft tokens
    (the decode builders then take decode requests of up to 1 + num_spec tokens)."""
    from vllm.config import AttentionConfig as VAttentionConfig
    from vllm.config import (CacheConfig, CompilationConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                             SpeculativeConfig, VllmConfig)
    import dsv4_rocm.integrations.vllm as plugin
    plugin.register()           # the backend name must be registered for AttentionConfig to parse it
    mc = ModelConfig(model=model_dir, tokenizer=model_dir, skip_tokenizer_init=True, dtype="bfloat16",
                     max_model_len=max_model_len)
    parallel = ParallelConfig()
    spec = SpeculativeConfig(method="mtp", num_speculative_tokens=num_spec, target_model_config=mc,
                             target_parallel_config=parallel) if num_spec else None
    return VllmConfig(model_config=mc, parallel_config=parallel, speculative_config=spec,
                      scheduler_config=SchedulerConfig(max_num_batched_tokens=max_tokens, max_num_seqs=16,
                                                       max_model_len=max_model_len, is_encoder_decoder=False),
                      cache_config=CacheConfig(block_size=256, cache_dtype="fp8_ds_mla"),
                      attention_config=VAttentionConfig(backend="DSV4_ROCM"),
                      compilation_config=CompilationConfig(custom_ops=["none"]))


def init_parallel_state(backend: str = "gloo") -> None:
    from vllm.distributed import parallel_state as ps
    if ps.model_parallel_is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ps.init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                    local_rank=0, backend=backend)
    ps.initialize_model_parallel(1, 1)


def checkpoint_tensors(w: LayerWeights, cfg: AttentionConfig, prefix: str) -> Dict[str, torch.Tensor]:
    """The checkpoint tensors of one attention layer under vLLM's names, bf16: each FP8 weight of ``w``
    dequantized (e4m3 times a power-of-two scale is exact in bf16), so vLLM's layer and dsv4_rocm's hold the
    same values."""
    def deq(w8, s):
        return dequantize_weight(w8.view(torch.uint8), s).bfloat16()
    ql, H = cfg.q_lora_rank, cfg.local_heads
    wqkv = deq(w.wqkv8, w.wqkv_s)
    t = {"wq_a.weight": wqkv[:ql], "wkv.weight": wqkv[ql:], "q_norm.weight": w.q_norm, "kv_norm.weight": w.kv_norm,
         "wq_b.weight": deq(w.wq_b8, w.wq_b_s),
         "wo_a.weight": torch.cat([deq(w.wo_a8[g], w.wo_a_s[g]) for g in range(w.wo_a8.shape[0])]),
         "wo_b.weight": deq(w.wo_b8, w.wo_b_s), "attn_sink": w.attn_sink[:H].clone()}
    if w.comp_w is not None:
        half = w.comp_w.shape[0] // 2
        t.update({"compressor.wkv.weight": w.comp_w[:half], "compressor.wgate.weight": w.comp_w[half:],
                  "compressor.ape": w.comp_ape, "compressor.norm.weight": w.comp_norm})
    if w.idx_wq_b8 is not None:
        half = w.idx_comp_w.shape[0] // 2
        t.update({"indexer.wq_b.weight": deq(w.idx_wq_b8, w.idx_wq_b_s), "indexer.weights_proj.weight": w.idx_wproj,
                  "indexer.compressor.wkv.weight": w.idx_comp_w[:half],
                  "indexer.compressor.wgate.weight": w.idx_comp_w[half:],
                  "indexer.compressor.ape": w.idx_comp_ape, "indexer.compressor.norm.weight": w.idx_comp_norm})
    return {f"{prefix}.{k}": v for k, v in t.items()}


STACKED = (("fused_wqa_wkv", "wq_a", 0), ("fused_wqa_wkv", "wkv", 1),
           ("fused_wkv_wgate", "wkv", 0), ("fused_wkv_wgate", "wgate", 1))


def load_weights(layer, tensors: Dict[str, torch.Tensor], prefix: str, vllm_cfg, device) -> None:
    """Each tensor through its parameter's own ``weight_loader`` (the stacked names as vLLM's DeepSeek-V4
    ``load_weights`` maps them), then vLLM's ``process_weights_after_loading``."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader
    params = dict(layer.named_parameters())
    loaded = set()
    for name, t in tensors.items():
        local = name[len(prefix) + 1:]
        for fused, part, shard in STACKED:
            head, _, tail = local.rpartition(".")
            stem = head.rpartition(".")[2] if head else ""
            owner_ok = ("." not in head) if fused == "fused_wqa_wkv" else ("compressor" in head)
            if stem == part and tail == "weight" and owner_ok:
                pname = head[:-len(part)] + fused + ".weight"
                params[pname].weight_loader(params[pname], t.to(device), shard)
                loaded.add(pname)
                break
        else:
            p = params[local]
            getattr(p, "weight_loader", default_weight_loader)(p, t.to(device))
            loaded.add(local)
    missing = set(params) - loaded
    if missing:
        raise AssertionError(f"parameters the checkpoint did not fill: {sorted(missing)}")
    model = torch.nn.Module()           # the layer sits inside a model, as in vLLM (the root is treated apart)
    model.attn = layer
    process_weights_after_loading(model, vllm_cfg.model_config, torch.device(device))


@dataclass
class Group:
    """One KV-cache group of the layer (one cache layer), as vLLM's runner holds it."""
    name: str
    module: object
    spec: object
    group: object                   # vLLM's AttentionGroup: the backend's metadata builder
    cache: torch.Tensor
    block_size: int                 # token positions a block of this group covers


def cache_groups(vllm_cfg, num_blocks: Dict[str, int], device) -> List[Group]:
    """Every cache layer vLLM's layer registered in the compilation config's static forward context: its spec,
    its backend's metadata builder (made by vLLM's ``AttentionGroup``, as the runner makes it), and a cache
    of ``num_blocks`` pages laid out as the spec says, bound to
    the layer with its ``bind_kv_cache``."""
    from vllm.v1.worker.utils import AttentionGroup
    groups = []
    for name, module in vllm_cfg.compilation_config.static_forward_context.items():
        spec = module.get_kv_cache_spec(vllm_cfg)
        if spec is None:
            continue
        backend = module.get_attn_backend()
        nb = num_blocks[name]
        page = spec.page_size_bytes
        raw = torch.zeros(nb * page, dtype=torch.uint8, device=device)
        record = spec.state_content_bytes if getattr(spec, "state_content_bytes", None) else \
            spec.head_size * spec.dtype.itemsize
        entries = spec.block_size // getattr(spec, "tokens_per_state", 1) \
            if getattr(spec, "tokens_per_state", 1) > 1 else spec.block_size
        elem = spec.dtype.itemsize
        view = torch.as_strided(raw.view(spec.dtype), (nb, entries, record // elem), (page // elem, record // elem, 1))
        module.bind_kv_cache(view.unsqueeze(1))
        group = AttentionGroup(backend, [name], spec, len(groups))
        group.create_metadata_builders(vllm_cfg, torch.device(device))
        groups.append(Group(name, module, spec, group, raw.view(nb, page), spec.block_size))
    return groups


# vLLM's compiled CPU GEMM kernels the CPU layer's output path calls (csrc/cpu/sgl-kernels in vLLM's CPU
# build; its CUDA wheel has none): the VNNI weight packing and the batched GEMM. They hold no DeepSeek-V4
# math, so the smallest stand-in is torch's own: packing keeps the weight as it is, the batched GEMM is
# torch.bmm with fp32 accumulation rounded once to the output's dtype.
GEMM_SCHEMAS = {
    "convert_weight_packed": "convert_weight_packed(Tensor weight) -> Tensor",
    "bmm_cpu": "bmm_cpu(Tensor(a!) out, Tensor mat1, Tensor mat2, bool is_vnni, Tensor? scale) -> ()",
}


def convert_weight_packed(weight):
    return weight.clone()


def bmm_cpu(out, mat1, mat2, is_vnni, scale):
    if scale is not None:
        raise NotImplementedError("bmm_cpu with a scale (an FP8 weight) is not needed by a bf16 layer")
    out.copy_(torch.bmm(mat1.float(), mat2.float().transpose(1, 2)).to(out.dtype))


def define_cpu_gemm_ops():
    """``GEMM_SCHEMAS`` in the ``_C`` namespace where vLLM's build lacks them; the library fragment (keep it
    alive) and the names defined."""
    lib = torch.library.Library("_C", "FRAGMENT")
    defined = []
    for name, schema in GEMM_SCHEMAS.items():
        if hasattr(torch.ops._C, name):
            continue
        lib.define(schema)
        lib.impl(name, globals()[name], "CPU")
        defined.append(name)
    return lib, defined


class Recorder:
    """What vLLM's layer hands to the stages dsv4_rocm's plugin runs, and what they return: wraps the layer's
    ``_fused_qnorm_rope_kv_insert`` and ``forward_mqa`` on the instance (each wrapper calls the method it
    replaces and keeps copies of its arguments and results) and records the ``kv_score`` each compressor
    module is called with (a forward pre-hook). Nothing the layer computes is changed."""

    def __init__(self, layer):
        self.seen = {}
        insert, mqa = layer._fused_qnorm_rope_kv_insert, layer.forward_mqa

        def recorded_insert(q, kv, positions, attn_metadata):
            out = insert(q, kv, positions, attn_metadata)
            self.seen["insert"] = (q.clone(), kv.clone(), out.clone())
            return out

        def recorded_mqa(q, kv, positions, output):
            mqa(q, kv, positions, output)
            self.seen["mqa"] = (q.clone(), output.clone())

        layer._fused_qnorm_rope_kv_insert = recorded_insert
        layer.forward_mqa = recorded_mqa
        for name in ("compressor", "indexer.compressor"):
            module = layer.get_submodule(name) if _has(layer, name) else None
            if module is not None:
                module.register_forward_pre_hook(
                    lambda m, args, name=name: self.seen.__setitem__(name, args[0].clone()))

    def clear(self):
        self.seen.clear()


def _has(layer, name):
    try:
        return layer.get_submodule(name) is not None
    except AttributeError:
        return False


def reference_compress(kv_score, ape, norm_w, positions, step, state, kv_cache, kslots, dim, ratio, eps, cos_sin):
    """dsv4_rocm's compressor stages after the projection (``DeepseekV4Attention._compress`` from the
    ``kv_score`` on): state save, then the pooled entries normed, roped, quantized into ``kv_cache``."""
    from dsv4_rocm import ops
    from dsv4_rocm.reference.compressor import coff, state_block_size
    c, sbs, main = coff(ratio), state_block_size(ratio), dim == 512
    kv, score = kv_score.float().split([c * dim, c * dim], dim=-1)
    sslots = step.state_slots[ratio]
    ops.save_partial_states(kv, score, ape, positions, state, sslots, sbs, c * dim, ratio)
    ops.compress_norm_rope_store(
        state_cache=state, num_actual=kv_score.shape[0], token_to_req_indices=step.token_to_req, positions=positions,
        slot_mapping=sslots, block_table=step.state_block_table, block_size=sbs, state_width=c * dim,
        cos_sin_cache=cos_sin, kv_cache=kv_cache, k_cache_metadata=kslots, pdl_kwargs={}, head_dim=dim,
        rope_head_dim=64, compress_ratio=ratio, overlap=ratio == 4, use_fp4_cache=False, rms_norm_weight=norm_w,
        rms_norm_eps=eps, quant_block=64 if main else 128, token_stride=576 if main else 128,
        scale_dim=8 if main else 4)
