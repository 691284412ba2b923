"""dsv4_rocm's vLLM plugin against the installed vLLM (ci/engine_tier.sh installs vllm==0.33.0): the plugin
loaded by vLLM's own loader, the backends checked against vLLM's abstract interfaces and KV-cache specs,
the metadata built from real CommonAttentionMetadata objects (decode, prefill, mixed, speculative decode
with a draft length per request), and the layer hooks run on tiny shapes under vLLM's forward context,
against dsv4_rocm's own layer over the same caches."""
import dataclasses
import importlib.metadata
import inspect
import logging
from types import SimpleNamespace

import pytest
import torch

import vllm
from vllm.config import AttentionConfig, CacheConfig, SchedulerConfig, VllmConfig
from vllm.forward_context import set_forward_context
from vllm.models.deepseek_v4.sparse_mla import DeepseekV4FlashMLABackend
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import AttentionBackend, AttentionMetadataBuilder, CommonAttentionMetadata
from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWABackend
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec

import dsv4_rocm.integrations.vllm as plugin
from dsv4_rocm import layout as L
from dsv4_rocm import ops
from dsv4_rocm.integrations.vllm import guards
from dsv4_rocm.integrations.vllm.backend import SparseMLABackend, SWABackend
from dsv4_rocm.integrations.vllm.layer import _Hooks, attention_class, is_hooked
from dsv4_rocm.integrations.vllm.metadata import MLAMetadataBuilder, SWAMetadataBuilder
from dsv4_rocm.reference.cache import new_cache
from dsv4_rocm.reference.compressor import kv_cache_view
from dsv4_rocm.reference.rope import build_cos_sin_cache
from dsv4_rocm.step import StepMetadata, c128_max_entries

WINDOW, TOPK, MAX_LEN, MAX_TOKENS = 128, 16, 1024, 256


@pytest.fixture(scope="module", autouse=True)
def reference_backend():
    with ops.use_backend("reference"):
        yield


def test_plugin_is_loaded_by_vllms_loader():
    names = [ep.name for ep in importlib.metadata.entry_points(group="vllm.general_plugins")]
    assert "dsv4_rocm" in names
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    assert plugin._state["registered"] is True
    assert AttentionBackendEnum["DSV4_ROCM"].get_class() is SparseMLABackend
    assert AttentionConfig(backend="DSV4_ROCM").backend is AttentionBackendEnum["DSV4_ROCM"]   # the CLI's parse
    # the CPU platform's DeepSeek-V4 layer class, wherever vLLM's modules name it, is the hooked subclass
    import vllm.models.deepseek_v4.cpu.cpu_sparse as cpu_sparse
    import vllm.models.deepseek_v4.cpu.model as cpu_model
    hooked = cpu_sparse.DeepseekV4CPUAttention
    assert is_hooked(hooked) and cpu_model.DeepseekV4CPUAttention is hooked
    base = hooked.__mro__[2]
    assert base.__name__ == "DeepseekV4CPUAttention" and not is_hooked(base) and attention_class(base) is hooked
    assert plugin.register() is True          # a second load changes nothing
    assert cpu_model.DeepseekV4CPUAttention is hooked


def test_plugin_defines_the_torch_ops_forms_this_vllm_build_lacks():
    """vLLM 0.33 calls torch.ops._C.fused_deepseek_v4_kv_rope_insert (V4.1's DSpark / PCP writer) and
    torch.ops._C_cache_ops.indexer_k_quant_and_cache; its CUDA wheel on a CPU machine has neither (its compiled
    part does not load here). After vLLM's loader ran the plugin both exist, defined over dsv4_rocm's ops, and
    write the bytes of those ops."""
    from vllm.plugins import load_general_plugins
    from dsv4_rocm.integrations.vllm import torch_ops
    load_general_plugins()
    for ns, name in (("_C", "fused_deepseek_v4_kv_rope_insert"), ("_C_cache_ops", "indexer_k_quant_and_cache"),
                     ("_C", "fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert")):
        assert hasattr(getattr(torch.ops, ns), name) and f"{ns}::{name}" in torch_ops._state["defined"]
    g = torch.Generator().manual_seed(4)
    kv = (torch.randn(6, 512, generator=g)).bfloat16()
    pos, slots = torch.randint(0, 100, (6,), generator=g), torch.tensor([3, -1, 17, 0, 9, 30])
    cs = build_cos_sin_cache(10000.0, 100)
    a = torch.full((2, 16 * 584), 0xA5, dtype=torch.uint8)
    b = a.clone()
    torch.ops._C.fused_deepseek_v4_kv_rope_insert(kv, a, slots, pos, cs, 16, None, False)
    ops.fused_deepseek_v4_kv_rope_insert(kv, b, slots, pos, cs, 16)
    assert torch.equal(a, b) and not torch.equal(a, torch.full_like(a, 0xA5))
    assert torch_ops.register_missing() == []          # a second load defines nothing


def test_guards_accept_this_vllm_and_refuse_drift(monkeypatch, caplog):
    assert vllm.__version__ == "0.33.0" and guards.check() == []
    assert "not a version" in guards.check("0.34.0")[0]
    path = "vllm.models.deepseek_v4.attention:DeepseekV4Attention.forward_mqa"
    monkeypatch.setitem(guards.SIGNATURES, path, ("self", "q", "kv", "positions", "output", "extra"))
    assert [p for p in guards.check() if path in p]
    monkeypatch.setattr(plugin, "_state", {"registered": None})
    with caplog.at_level(logging.WARNING, logger="dsv4_rocm.integrations.vllm"):
        assert plugin.register() is False
    assert "stays inactive" in caplog.text and "forward_mqa" in caplog.text


def test_backends_against_vllms_interfaces():
    for cls, vllm_cls in ((SparseMLABackend, DeepseekV4FlashMLABackend), (SWABackend, DeepseekSparseSWABackend)):
        assert issubclass(cls, AttentionBackend) and not inspect.isabstract(cls)
        assert issubclass(cls.get_builder_cls(), AttentionMetadataBuilder)
        assert not inspect.isabstract(cls.get_builder_cls())
        assert cls.get_supported_head_sizes() == [512]
    assert SparseMLABackend.get_name() == "DSV4_ROCM" and SWABackend.get_name() == "DSV4_ROCM_SWA"
    assert SparseMLABackend.supported_kv_cache_dtypes == DeepseekV4FlashMLABackend.supported_kv_cache_dtypes
    assert SparseMLABackend.supported_dtypes == DeepseekV4FlashMLABackend.supported_dtypes == [torch.bfloat16]
    assert SparseMLABackend.is_mla() and SparseMLABackend.is_sparse() and SparseMLABackend.supports_sink()
    assert SparseMLABackend.get_supported_kernel_block_sizes() == DeepseekV4FlashMLABackend.get_supported_kernel_block_sizes()
    for cap, ok in (((9, 4), True), ((9, 5), True), ((9, 0), True), ((10, 0), True), ((8, 0), False), ((12, 0), False)):
        assert SparseMLABackend.supports_compute_capability(DeviceCapability(*cap)) is ok
    reasons = SparseMLABackend.validate_configuration(
        head_size=512, dtype=torch.bfloat16, kv_cache_dtype="fp8_ds_mla", block_size=256, use_mla=True,
        has_sink=True, use_sparse=True, use_mm_prefix=False, use_per_head_quant_scales=False,
        device_capability=DeviceCapability(9, 4), attn_type="decoder")
    assert reasons == []
    assert SparseMLABackend.validate_configuration(
        head_size=576, dtype=torch.float16, kv_cache_dtype="fp8_e5m2", block_size=256, use_mla=True, has_sink=True,
        use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
        device_capability=DeviceCapability(8, 0), attn_type="decoder")
    # vLLM's own KV-cache specs for the two caches give the pages our kernels read
    comp = MLAAttentionSpec(block_size=256, num_kv_heads=1, head_size=512, dtype=torch.uint8, tokens_per_state=4,
                            cache_dtype_str="fp8_ds_mla", alignment=576, model_version="deepseek_v4",
                            state_content_bytes=584)
    swa = SlidingWindowMLASpec(block_size=64, num_kv_heads=1, head_size=512, dtype=torch.uint8, sliding_window=WINDOW,
                               cache_dtype_str="fp8_ds_mla", alignment=576, model_version="deepseek_v4",
                               state_content_bytes=584)
    assert comp.page_size_bytes == SparseMLABackend.page_bytes(64) == L.page_bytes(64) == 37440
    assert swa.page_size_bytes == SWABackend.page_bytes(64) == 37440
    assert SparseMLABackend.get_kv_cache_shape(10, 64) == (10, 64, 584) and 37440 % 576 == 0
    with pytest.raises(ValueError, match="head"):
        SparseMLABackend.get_kv_cache_shape(10, 64, 1, 576)


# ---- metadata from real CommonAttentionMetadata ----------------------------------------------------------
def vllm_config(num_spec=0):
    plugin.register()           # the backend name must be registered for AttentionConfig to parse it
    cfg = VllmConfig(scheduler_config=SchedulerConfig(max_num_batched_tokens=MAX_TOKENS, max_num_seqs=16,
                                                      max_model_len=MAX_LEN, is_encoder_decoder=False),
                     cache_config=CacheConfig(block_size=256, cache_dtype="fp8_ds_mla"),
                     attention_config=AttentionConfig(backend="DSV4_ROCM"))
    # a ModelConfig needs a model directory and a tokenizer: the builders read only these fields of it
    hf = SimpleNamespace(sliding_window=WINDOW, index_topk=TOPK, compress_rates={}, model_type="deepseek_v4")
    object.__setattr__(cfg, "model_config", SimpleNamespace(hf_config=hf, max_model_len=MAX_LEN))
    object.__setattr__(cfg, "speculative_config",
                       SimpleNamespace(num_speculative_tokens=num_spec, parallel_drafting=False) if num_spec else None)
    return cfg


def common_metadata(done, new, swa_bt, comp_bt):
    """vLLM's CommonAttentionMetadata of requests adding new[b] tokens after done[b] (decode first)."""
    qsl = torch.tensor([0] + new).cumsum(0).to(torch.int32)
    seq = torch.tensor([d + n for d, n in zip(done, new)], dtype=torch.int32)
    pos = torch.cat([torch.arange(d, d + n) for d, n in zip(done, new)])
    req = torch.repeat_interleave(torch.arange(len(new)), torch.tensor(new))
    swa_slots = swa_bt[req, pos // 64].long() * 64 + pos % 64
    comp_slots = comp_bt[req, pos // 256].long() * 256 + pos % 256
    base = dict(query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq, num_reqs=len(new),
                num_actual_tokens=int(qsl[-1]), max_query_len=max(new), max_seq_len=int(seq.max()), positions=pos,
                seq_lens_cpu_upper_bound=seq.clone())
    return (CommonAttentionMetadata(block_table_tensor=swa_bt, slot_mapping=swa_slots, **base),
            CommonAttentionMetadata(block_table_tensor=comp_bt, slot_mapping=comp_slots, **base))


def tables(R, seed):
    g = torch.Generator().manual_seed(seed)
    swa = torch.randperm(R * 16, generator=g).view(R, 16).to(torch.int32)
    comp = torch.randperm(R * 4, generator=g).view(R, 4).to(torch.int32)
    return swa, comp


BATCHES = {   # name -> (done, new, num_spec): decode first, as vLLM's scheduler orders them
    "decode": ([300, 40, 700], [1, 1, 1], 0),
    "prefill": ([0, 0], [37, 150], 0),
    "mixed": ([300, 129], [1, 70], 0),
    "spec-decode": ([300, 40, 600, 12], [3, 1, 2, 40], 2),
}


@pytest.mark.parametrize("name", list(BATCHES))
def test_metadata_from_common_attn_metadata(name):
    done, new, num_spec = BATCHES[name]
    R, T = len(new), sum(new)
    swa_bt, comp_bt = tables(R, len(name))
    swa_cm, comp_cm = common_metadata(done, new, swa_bt, comp_bt)
    cfg = vllm_config(num_spec)
    swa_spec = SlidingWindowMLASpec(block_size=64, num_kv_heads=1, head_size=512, dtype=torch.uint8,
                                    sliding_window=WINDOW, cache_dtype_str="fp8_ds_mla", alignment=576,
                                    model_version="deepseek_v4", state_content_bytes=584)
    md = SWAMetadataBuilder(swa_spec, ["l.swa_cache"], cfg, torch.device("cpu")).build(0, swa_cm)
    step = md.step
    n_dec = sum(1 for n in new if n <= 1 + num_spec)
    assert (md.num_decodes, md.num_decode_tokens) == (n_dec, sum(new[:n_dec]))
    assert md.num_prefills == R - n_dec and md.num_prefill_tokens == T - md.num_decode_tokens
    assert step.uniform_decode == (len(set(new[:n_dec])) <= 1)
    # the same sets as a StepMetadata built from dsv4_rocm's own inputs (the oracle composition)
    want = StepMetadata(swa_cm.query_start_loc, swa_cm.seq_lens, swa_cm.positions, swa_cm.slot_mapping, swa_bt,
                        comp_bt, comp_bt, num_decodes=0, num_decode_tokens=0, max_model_len=MAX_LEN,
                        window=WINDOW).build_from_ops(ratios=())
    for f in ("token_to_req", "is_valid_token", "swa_indices", "swa_lens"):
        assert torch.equal(getattr(step, f), getattr(want, f)), f
    assert step.swa_lens.tolist() == [min(p + 1, WINDOW) for p in swa_cm.positions.tolist()]
    # the compressed groups: vLLM's fields kept, the C128 set global for every token
    for ratio in (4, 128):
        spec = MLAAttentionSpec(block_size=256, num_kv_heads=1, head_size=512, dtype=torch.uint8,
                                tokens_per_state=ratio, cache_dtype_str="fp8_ds_mla", alignment=576,
                                model_version="deepseek_v4", state_content_bytes=584)
        builder = MLAMetadataBuilder(spec, ["l"], cfg, torch.device("cpu"))
        cm = dataclasses.replace(comp_cm, block_table_tensor=comp_bt.clone())
        lm = builder.build(0, cm)
        assert torch.equal(lm.block_table, comp_bt) and lm.req_id_per_token.tolist() == step.token_to_req.tolist()
        epb = 256 // ratio
        for t, (p, b) in enumerate(zip(swa_cm.positions.tolist(), step.token_to_req.tolist())):
            j = p // ratio          # the entry a token closing a window of `ratio` positions writes
            want_slot = int(comp_bt[b, j // epb]) * epb + j % epb if (p + 1) % ratio == 0 else -1
            assert lm.slot_mapping[t] == want_slot, (ratio, t)
        if ratio == 4:
            assert lm.c128_indices is None
            continue
        assert lm.c128_indices.shape == (T, c128_max_entries(MAX_LEN))
        for t, (p, b) in enumerate(zip(swa_cm.positions.tolist(), step.token_to_req.tolist())):
            n = (p + 1) // 128
            assert lm.c128_lens[t] == n
            want_row = [int(comp_bt[b, j // 2]) * 2 + j % 2 for j in range(n)]
            assert lm.c128_indices[t, :n].tolist() == want_row and (lm.c128_indices[t, n:] == -1).all()


def test_builders_write_into_buffers_allocated_once():
    cfg = vllm_config()
    spec = SlidingWindowMLASpec(block_size=64, num_kv_heads=1, head_size=512, dtype=torch.uint8, sliding_window=WINDOW,
                                cache_dtype_str="fp8_ds_mla", alignment=576, model_version="deepseek_v4",
                                state_content_bytes=584)
    builder = SWAMetadataBuilder(spec, ["l.swa_cache"], cfg, torch.device("cpu"))
    swa_bt, comp_bt = tables(2, 5)
    for done in ([100, 7], [101, 8]):
        cm, _ = common_metadata(done, [1, 1], swa_bt, comp_bt)
        md = builder.build(0, cm)
        if ops.backend_for("compute_swa_indices_and_lens", torch.device("cpu")) == "triton":
            assert md.step.swa_indices.data_ptr() == builder.swa_indices.data_ptr()
        assert md.step.swa_lens.tolist() == [min(d + 1, WINDOW) for d in done]
    with pytest.raises(ValueError, match="block_size"):
        SWAMetadataBuilder(dataclasses.replace(spec, block_size=128), ["l"], cfg, torch.device("cpu"))


# ---- the layer hooks under vLLM's forward context ----------------------------------------------------------
def hooked_layer(ratio, prefix, swa_cache, comp_cache, topk_buf, heads=8):
    """The attributes of vLLM's DeepseekV4Attention the hooks read, on an object of the hooks' class (the
    real layer needs vLLM's linear layers and a model directory)."""
    layer = object.__new__(_Hooks)
    torch.manual_seed(ratio)
    layer.__dict__.update(
        _dsv4_rocm=True, prefix=prefix, compress_ratio=ratio, padded_heads=64, n_local_heads=heads, eps=1e-6,
        scale=512 ** -0.5, attn_sink=torch.cat([torch.randn(heads), torch.full((64 - heads,), -float("inf"))]),
        swa_cache_layer=SimpleNamespace(prefix=prefix + ".swa_cache", kv_cache=swa_cache), kv_cache=comp_cache,
        topk_indices_buffer=topk_buf,
        rotary_emb=SimpleNamespace(cos_sin_cache=build_cos_sin_cache(10000.0, MAX_LEN + 1)))
    return layer


@pytest.mark.parametrize("ratio", [1, 4, 128])
def test_layer_hooks_attend_what_dsv4_rocms_layer_attends(ratio):
    done, new = [300, 40, 600, 12], [3, 1, 2, 40]          # speculative decode (lengths 3, 1, 2) + a prefill
    R, T = len(new), sum(new)
    swa_bt, comp_bt = tables(R, 3)
    swa_cm, comp_cm = common_metadata(done, new, swa_bt, comp_bt)
    cfg = vllm_config(num_spec=2)
    swa_spec = SlidingWindowMLASpec(block_size=64, num_kv_heads=1, head_size=512, dtype=torch.uint8,
                                    sliding_window=WINDOW, cache_dtype_str="fp8_ds_mla", alignment=576,
                                    model_version="deepseek_v4", state_content_bytes=584)
    comp_spec = MLAAttentionSpec(block_size=256, num_kv_heads=1, head_size=512, dtype=torch.uint8,
                                 tokens_per_state=max(ratio, 4), cache_dtype_str="fp8_ds_mla", alignment=576,
                                 model_version="deepseek_v4", state_content_bytes=584)
    metadata = {"l.swa_cache": SWAMetadataBuilder(swa_spec, ["l.swa_cache"], cfg, torch.device("cpu")).build(0, swa_cm)}
    if ratio > 1:
        metadata["l"] = MLAMetadataBuilder(comp_spec, ["l"], cfg, torch.device("cpu")).build(0, comp_cm)
    # caches filled with random records before the step, as earlier steps would have left them
    swa_cache = kv_cache_view(new_cache(R * 16, 64), 64, 584)
    ops.quantize_and_insert_k_cache(torch.randn(R * 16 * 64, 512).bfloat16(), swa_cache, torch.arange(R * 16 * 64), 64)
    bs = L.compressed_block_size(max(ratio, 4))
    comp_cache = kv_cache_view(new_cache(R * 4, bs), bs, 584)
    ops.quantize_and_insert_k_cache(torch.randn(R * 4 * bs, 512).bfloat16(), comp_cache, torch.arange(R * 4 * bs), bs)
    n_entries = [(p + 1) // 4 for p in swa_cm.positions.tolist()]
    topk_buf = torch.full((MAX_TOKENS, TOPK), -1, dtype=torch.int32)
    for t, n in enumerate(n_entries):
        pick = torch.randperm(n)[:TOPK].to(torch.int32)
        topk_buf[t, :pick.numel()] = pick
    layer = hooked_layer(ratio, "l", swa_cache, comp_cache if ratio > 1 else None, topk_buf)
    q = torch.randn(T, 8, 512).bfloat16()
    kv = torch.randn(T, 512).bfloat16()
    before = swa_cache.clone()
    with set_forward_context(None, cfg):          # vLLM's profile run: no metadata
        qp = _Hooks._fused_qnorm_rope_kv_insert(layer, q, kv, swa_cm.positions, None)
        out = torch.full((T + 3, 64, 512), 7.0, dtype=torch.bfloat16)
        _Hooks.forward_mqa(layer, torch.zeros(T + 3, 64, 512, dtype=torch.bfloat16), kv, swa_cm.positions, out)
    assert qp.shape == (T, 64, 512) and torch.equal(qp[:, :8], q) and (qp[:, 8:] == 0).all()
    assert (out == 0).all() and torch.equal(swa_cache, before)
    with set_forward_context(metadata, cfg):
        qp = _Hooks._fused_qnorm_rope_kv_insert(layer, q, kv, swa_cm.positions, metadata)
        out = torch.full((T + 3, 64, 512), 7.0, dtype=torch.bfloat16)    # 3 rows of graph padding
        _Hooks.forward_mqa(layer, torch.cat([qp, torch.randn(3, 64, 512).bfloat16()]), kv, swa_cm.positions, out)
    assert (out[T:] == 0).all()
    # dsv4_rocm's own layer path over the same caches and step: the insert, then attention
    want_cache = before.clone()
    want_q = ops.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(
        q, kv, want_cache.view(want_cache.shape[0], -1), swa_cm.slot_mapping, swa_cm.positions,
        layer.rotary_emb.cos_sin_cache, 64, 1e-6, 64)
    assert torch.equal(swa_cache, want_cache) and torch.equal(qp, want_q)
    step = StepMetadata(swa_cm.query_start_loc, swa_cm.seq_lens, swa_cm.positions, swa_cm.slot_mapping, swa_bt,
                        comp_bt, comp_bt, num_decodes=3, num_decode_tokens=6, max_model_len=MAX_LEN, window=WINDOW,
                        uniform_decode=False).build_from_ops(ratios=(ratio,) if ratio > 1 else ())
    extra = (None, None, None)
    if ratio == 4:
        idx, lens = ops.compute_global_topk_indices_and_lens(topk_buf[:T], step.token_to_req, comp_bt, 64,
                                                             step.is_valid_token)
        extra = (comp_cache.unsqueeze(-2), idx.unsqueeze(1), lens)
    elif ratio == 128:
        extra = (comp_cache.unsqueeze(-2), step.c128_indices.unsqueeze(1), step.c128_lens)
    want, _ = ops.sparse_mla_decode(want_q.unsqueeze(1), want_cache.unsqueeze(-2), step.swa_indices.unsqueeze(1),
                                    step.swa_lens, layer.attn_sink, *extra, 512 ** -0.5)
    assert torch.equal(out[:T], want[:, 0])
    assert out[:T, :8].abs().sum() > 0 and torch.isfinite(out.float()).all()


def test_hooked_class_is_the_base_class_when_not_selected():
    import vllm.models.deepseek_v4.cpu.cpu_sparse as cpu_sparse
    base = cpu_sparse.DeepseekV4CPUAttention
    base = base.__mro__[2] if is_hooked(base) else base
    hooked = attention_class(base)
    assert issubclass(hooked, base) and hooked.__name__ == base.__name__
    layer = object.__new__(hooked)
    layer.__dict__["_dsv4_rocm"] = False
    assert layer.backend_cls is base.backend_cls and layer.swa_backend_cls is base.swa_backend_cls
    assert layer.get_padded_num_q_heads(8) == base.get_padded_num_q_heads(8)
    layer.__dict__["_dsv4_rocm"] = True
    assert layer.backend_cls is SparseMLABackend and layer.swa_backend_cls is SWABackend
    assert layer.get_padded_num_q_heads(8) == 64 and layer.get_padded_num_q_heads(65) == 128
    from dsv4_rocm.integrations.vllm.layer import selected
    assert selected(vllm_config()) and not selected(VllmConfig())


def test_bfloat16_kv_cache_is_refused_by_name():
    """vLLM 0.33.0 accepts --kv-cache-dtype bfloat16 for DeepSeek-V4 only on FLASHINFER_MLA_SPARSE_DSV4, as
    plain bf16 rows instead of fp8_ds_mla records; a layer built with DSV4_ROCM refuses it before vLLM's
    constructor allocates anything."""
    from vllm.models.deepseek_v4.attention import _resolve_dsv4_kv_cache_dtype
    from vllm.models.deepseek_v4.nvidia.flashinfer_sparse import DeepseekV4FlashInferMLASparseBackend
    assert "bfloat16" in DeepseekV4FlashInferMLASparseBackend.supported_kv_cache_dtypes
    assert "bfloat16" not in DeepseekV4FlashMLABackend.supported_kv_cache_dtypes
    assert _resolve_dsv4_kv_cache_dtype(False, "bfloat16", None) == ("bfloat16", torch.bfloat16)
    with pytest.raises(ValueError, match="fp8_ds_mla layout only supports fp8"):
        _resolve_dsv4_kv_cache_dtype(True, "bfloat16", None)
    for ok in ("auto", "fp8", "fp8_ds_mla"):
        SparseMLABackend.check_kv_cache_dtype(ok)
    for bad in ("bfloat16", "fp8_e4m3", "fp8_e5m2"):
        with pytest.raises(ValueError, match=f"--kv-cache-dtype {bad}.*--attention-backend DSV4_ROCM"):
            SparseMLABackend.check_kv_cache_dtype(bad)
    import vllm.models.deepseek_v4.cpu.cpu_sparse as cpu_sparse
    base = cpu_sparse.DeepseekV4CPUAttention
    hooked = attention_class(base.__mro__[2] if is_hooked(base) else base)
    cfg = vllm_config()
    cfg.cache_config.cache_dtype = "bfloat16"
    with pytest.raises(ValueError, match="plain-row layout of FLASHINFER_MLA_SPARSE_DSV4"):
        hooked(cfg, "model.layers.0.attn", None, None)
    object.__setattr__(cfg, "attention_config", AttentionConfig())      # not selected: vLLM's constructor runs
    with pytest.raises(Exception) as e:
        hooked(cfg, "model.layers.0.attn", None, None)
    assert "DSV4_ROCM" not in str(e.value)
