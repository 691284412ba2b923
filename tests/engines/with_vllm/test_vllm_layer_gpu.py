"""vLLM 0.33.0's own DeepSeek-V4 attention layer over dsv4_rocm's plugin on a GPU, against dsv4_rocm's
reference layer with the same weights: the trace of test_vllm_layer.py (prefill, decode, mixed,
speculative decode, a sliding-window cache that hands freed pages out again) for the SWA, C4 and C128
layers, then decode steps captured into a CUDA graph and replayed with new inputs and metadata.

The layer is the class vLLM's model picks on the platform, as the plugin leaves it with ``--attention-backend
DSV4_ROCM``: on CUDA ``vllm.models.deepseek_v4.nvidia.flashmla.DeepseekV4FlashMLAAttention``, on ROCm
``vllm.models.deepseek_v4.amd.rocm.DeepseekV4ROCMAiterMLAAttention`` (dsv4_rocm's hooked subclasses). Everything
of vLLM's runs as on CPU (test_vllm_layer.py's docstring), here with vLLM's GPU code: its Triton RMSNorm and
compressor kernels, its indexer (C4; index_topk 512 as DeepSeek-V4 has it, so outside a graph capture
its short-context path selects every entry, and inside one its scored path runs: logits and top-k), its
output projection. The device machine carries vLLM's Python files
only (gpu/vllm_carry.sh, gpu/vllm_tests.sh): where vLLM's compiled modules are absent, the engine tier's
plugin module (``vllm_suite``) stands in for the two its CUDA platform imports unguarded, answers its CUTLASS
capability queries with False and defines the ``torch.ops`` kernels vLLM calls and lacks (its top-k and
indexer-cache ops) over dsv4_rocm's. vLLM's Python-level ops are not swapped: its own Triton kernels run.

Checks per step as on CPU, except where GPU kernels now run instead of the reference: the SWA cache bytes
dsv4_rocm's insert writes still bit for bit; the padded q within 2^-7 relative; the attention output within the
tolerance the sparse MLA kernels are tested to; the compressed and indexer-K records vLLM's own Triton
compressor writes with at most 1 % of their bytes different (its fp32 pooling order against the reference's),
its fp32 state within torch's default fp32 tolerance. Graph replay: each replayed decode step (new positions,
hidden states and metadata in the captured buffers, pages handed out as the trace goes on) is held to the same
checks.

Run on the GPU machine after gpu/vllm_tests.sh has unpacked the carry (VLLM_CARRY_DIR, default
/tmp/dsv4_vllm), from the repository root:

    PYTHONPATH=/tmp/dsv4_vllm/vllm_py/site:/tmp/dsv4_vllm/entry_point:$PWD:$PWD/tests/engines/with_vllm \\
      HF_HUB_OFFLINE=1 python3 -m pytest -q -p no:cacheprovider -m gpu -s tests/engines/with_vllm/test_vllm_layer_gpu.py
"""
import dataclasses

import pytest
import torch

import vllm_layer_harness as H
import vllm_layer_trace as TR
from dsv4_rocm.config import LayerType, tiny_config

pytestmark = pytest.mark.gpu

GRAPH_STEPS = 3      # decode steps replayed from one capture


@pytest.fixture(scope="module")
def vllm_gpu_env():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    import vllm_suite
    stand_in = getattr(vllm_suite, "_stand_in_for_compiled_modules", None)
    if stand_in is not None:
        stand_in()
    from vllm.config import set_current_vllm_config
    from vllm.plugins import load_general_plugins
    import dsv4_rocm.integrations.vllm as plugin
    load_general_plugins()
    assert plugin._state["registered"] is True
    keep = vllm_suite._define_c_ops()          # library fragments must stay alive
    cfg = tiny_config(index_topk=TR.CPU_INDEX_TOPK)      # DeepSeek-V4's; the indexer selects every entry
    model_dir = H.tiny_checkpoint_dir(cfg, TR.MAX_LEN)
    with set_current_vllm_config(H.vllm_config(model_dir, TR.MAX_LEN, TR.MAX_TOKENS, num_spec=2)):
        H.init_parallel_state("nccl")
    yield cfg, model_dir, keep


def gpu_layer_class():
    import importlib
    import dsv4_rocm.integrations.vllm as plugin
    from dsv4_rocm.integrations.vllm.layer import is_hooked
    module, name = plugin.PLATFORM_LAYERS[plugin._state["platform"]]
    cls = getattr(importlib.import_module(module), name)
    assert is_hooked(cls), f"the plugin did not bind {module}.{name}"
    return cls


LAYERS = [LayerType.SWA, LayerType.C4, LayerType.C128]


@pytest.mark.parametrize("layer_type", LAYERS, ids=["swa", "c4", "c128"])
def test_vllm_layer_matches_reference_layer_and_replays_in_a_graph(vllm_gpu_env, layer_type):
    cfg, model_dir, _ = vllm_gpu_env
    dev = "cuda"
    if layer_type == LayerType.C4 and torch.version.hip is None:
        from vllm.utils.deep_gemm import has_deep_gemm
        if not has_deep_gemm():
            pytest.skip("vLLM's CUDA indexer (SparseAttnIndexer) refuses to be built without DeepGEMM, which this "
                        "machine lacks; the C4 layer over the plugin runs in the CPU test")
    if layer_type != LayerType.SWA and torch.version.hip is None:
        import importlib.util
        if importlib.util.find_spec("cutlass") is None:
            pytest.skip("vLLM's CUDA compressor (head 512) is its CUTLASS-DSL kernel (the `cutlass` package of "
                        "nvidia-cutlass-dsl), which this machine lacks; the compressed layers over the plugin run "
                        "in the CPU test")
    built = TR.build_layer(gpu_layer_class(), cfg, model_dir, layer_type, dev)
    trace = TR.Trace(built, cfg, dev, exact_attention=False)
    for name, T, rel in trace.run():
        print(f"{layer_type.value} {name}: T={T} caches equal, attention within tolerance, end-to-end rel {rel:.4f}")
    graph_replay(trace)


def _persistent(cm, store: dict, key: str):
    """``cm`` with its tensors copied into buffers kept per group (the addresses a captured graph reads)."""
    fields = {}
    for f in dataclasses.fields(cm):
        v = getattr(cm, f.name)
        if isinstance(v, torch.Tensor) and v.device.type != "cpu":
            buf = store.get((key, f.name))
            if buf is None or buf.shape != v.shape:
                assert buf is None, f"{key}.{f.name} changed shape between graph steps"
                buf = store[(key, f.name)] = v.clone()
            else:
                buf.copy_(v)
            fields[f.name] = buf
    return dataclasses.replace(cm, **fields)


def graph_replay(trace):
    """Decode steps of all requests: the first captured into a CUDA graph, each (the first too) replayed
    with that step's inputs and metadata copied into the captured buffers and held to the reference by the
    trace's checks. The recorded stage inputs and outputs are copies made inside the graph, so each replay
    refreshes them."""
    from vllm.forward_context import set_forward_context
    b, layer, vc = trace.b, trace.b.layer, trace.b.vllm_config
    store, graph = {}, None
    pos_s = torch.zeros(TR.R, dtype=torch.int64, device=trace.device)
    x_s = torch.zeros(TR.R, trace.cfg.hidden_size, dtype=torch.bfloat16, device=trace.device)
    for k in range(GRAPH_STEPS):
        batch = trace.schedule([1] * TR.R)
        md = {gr.name: gr.group.build_metadata(_persistent(
            TR.common_metadata(batch, trace.tables[TR.kind(gr.name)], trace.device), store, gr.name))
            for gr in b.groups}
        pos_s.copy_(batch.positions)
        x_s.copy_(trace.hidden(TR.R))
        before = TR.snapshot(trace.live)
        if graph is None:
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            trace.rec.clear()
            with set_forward_context(md, vc), torch.cuda.graph(graph):
                y_s = layer(pos_s, x_s)
            for f in ("swa", "comp", "comp_state", "idx", "idx_state"):
                if getattr(trace.live, f) is not None:
                    assert torch.equal(getattr(trace.live, f), getattr(before, f)), f"capture wrote {f}"
        graph.replay()
        torch.cuda.synchronize()
        rel = trace.check(f"graph-{k}", batch, TR.R, pos_s, x_s, y_s.clone(), before)
        print(f"ratio {b.ratio} graph replay {k}: caches equal, attention within tolerance, end-to-end rel {rel:.4f}")
        for r in range(TR.R):
            trace.done[r] += 1
