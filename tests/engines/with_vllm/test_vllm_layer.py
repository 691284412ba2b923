"""vLLM 0.33.0's own DeepSeek-V4 attention layer over dsv4_rocm's plugin, on vLLM's CPU platform, against
dsv4_rocm's reference layer with the same weights, through a multi-step trace.

The layer is the class vLLM's CPU model builds
(``vllm.models.deepseek_v4.cpu.cpu_sparse.DeepseekV4CPUAttention``) as vLLM's plugin loader leaves it: with
``--attention-backend DSV4_ROCM`` in vLLM's ``AttentionConfig`` it is dsv4_rocm's hooked subclass, whose
q-norm/KV insert and sparse attention are dsv4_rocm's and whose metadata builders are the plugin's. The trace: a
prefill of three requests, a decode step, a mixed step (two decodes and a prefill chunk), a speculative-decode
step (decode query lengths 3 and 2 beside a prefill chunk), a long chunk during which the sliding-window cache
hands freed pages out again (the cache wraps its pages), and a last decode; each with fresh random hidden
states.

Ran for real (vLLM 0.33.0's code): ``ModelConfig`` from a tiny local checkpoint directory, ``VllmConfig`` with a
``SpeculativeConfig`` (MTP, 2 draft tokens: the decode threshold of the builders), the parallel state (world
size 1, gloo), the layer's constructor and every submodule vLLM builds
(``MergedColumnParallelLinear``/``ColumnParallelLinear``/``RowParallelLinear`` through vLLM's CPU GEMM dispatch,
``RMSNorm``, the DeepSeek-V4 rotary embedding, ``DeepseekV4CPUCompressor`` with its ``CompressorStateCache``,
the ``DeepseekV4SWACache`` layer, for C4 the ``DeepseekV4CPUIndexer`` with its compressor,
``DeepseekV4CPUIndexerCache`` and ``SparseAttnIndexer``), the parameters' ``weight_loader``s and
``process_weights_after_loading``, each cache layer's KV-cache spec and ``bind_kv_cache``, ``AttentionGroup``
making each backend's metadata builder (the plugin's SWA and compressed builders, vLLM's
``CompressorMetadataBuilder``, ``DeepseekV4CPUIndexerMetadataBuilder``), ``set_forward_context``, the layer's
``forward`` (vLLM's CPU custom op ``deepseek_v4_cpu_prepare_and_attn``, its projections, compressor,
``_o_proj``), vLLM's CPU worker's ``torch.cuda`` placeholders (``vllm.v1.worker.cpu.shm``, which vLLM's CPU
worker imports first).

Not vLLM's (its CUDA wheel on this CPU machine has no compiled CPU kernels): the ``torch.ops._C`` CPU kernels
the layer calls outside dsv4_rocm's hooks are defined as the engine tier defines them for vLLM's own tests
(``vllm_suite._define_c_ops``: ``save_partial_states_cpu`` and ``compress_norm_rope_store_cpu`` over
dsv4_rocm's compressor ops, ``inverse_gptj_rope_o_proj_cpu`` over dsv4_rocm's inverse RoPE), and vLLM's two
CPU GEMM kernels of the output path (``convert_weight_packed``, ``bmm_cpu``) are torch's own GEMM
(``vllm_layer_harness.GEMM_SCHEMAS``). The caches are allocated here from vLLM's specs (vLLM's KV-cache
manager needs the whole model), the block tables made here as vLLM's scheduler would.

The C4 layer's indexer is vLLM's CPU indexer: vLLM's indexer metadata builder (its Triton kernels under
the interpreter, with the project's ``helpers.patch_interpreter_scalars``: Triton 3.6's interpreter turns a
loop bound loaded from memory into ``int()`` of a one-element array, which NumPy 2.4 refuses), its CPU
indexer query, and its selection. vLLM's CPU indexer takes DeepSeek-V4's index_topk of 512 only (its
compiled top-k is ``topk_transform_512_cpu``), so the tiny model has index_topk 512, and with at most 512
compressed entries a token the indexer selects them all (vLLM's short-context path); the scored top-k
(logits, selection among more entries than index_topk) runs in the GPU variant. DeepSeek-V4.1: vLLM
0.33.0 has no CPU layer for it (``vllm.models.deepseek_v41`` picks ``amd`` or ``nvidia``), and the plugin
binds the V4.0 layer classes only.

vLLM's whole engine (``LLM.generate`` on a tiny checkpoint) does not run here: its CPU worker needs vLLM's
CPU build of its compiled kernels (``vllm._C`` for the CPU: RMSNorm, the fused MoE, the mHC hyper-connection
ops of the decoder layer, the sampler's), which the CUDA wheel the tier installs does not have, and its
CUDA modules need CUDA torch 2.14.

Checks, per step:
- exact (bytes, bit for bit): the SWA cache after the step equals the cache before it with dsv4_rocm's
  reference insert applied to the q and kv vLLM's layer produced, and the padded q the layer got back equals
  the reference's; the compressed cache and the compressor's state cache (C4: also the indexer-K cache and
  the indexer compressor's state) equal dsv4_rocm's reference compressor stages applied to the ``kv_score``
  vLLM's layer produced; the attention output vLLM's layer got
  equals dsv4_rocm's ``DeepseekV4Attention.forward_mqa`` on the reference backend over vLLM's caches with
  dsv4_rocm's own step metadata of the same batch (its own builders, not the plugin's; C4: the top-k vLLM's
  indexer left in the layer's ``topk_indices_buffer``);
- end to end: the layer's output against dsv4_rocm's ``DeepseekV4Attention`` with the same weights over
  its own caches. That layer computes DeepSeek's FP8 recipe (activations quantized to e4m3 per 128 columns
  with power-of-two scales before wq_a/wkv, wq_b, wo_a and wo_b); vLLM's CPU layer, given the same weights
  as bf16 (the FP8 weights dequantize exactly), multiplies in bf16. Each e4m3 rounding is up to 2^-4
  relative (about 2^-4 / sqrt(3) in norm on random data), and four projections chain, so the outputs agree
  to about 7 % in norm (measured 5.6-7.4 % over the three layers and six steps); the bound is 12 %. The
  stages dsv4_rocm runs are held exactly by the checks above; this one holds what lies around them
  (weights loaded into the right rows, the RoPE table, the output path).
"""
import pytest
import torch

import vllm_layer_harness as H
import vllm_layer_trace as TR
import vllm_suite
from dsv4_rocm.config import LayerType, tiny_config
from helpers import patch_interpreter_scalars


@pytest.fixture(scope="module")
def vllm_env():
    """vLLM's plugin loader, the CPU kernels the CUDA wheel lacks, the parallel state, a checkpoint dir."""
    import vllm.v1.worker.cpu.shm  # noqa: F401  vLLM's CPU worker's torch.cuda placeholders (imported first there)
    from vllm.config import set_current_vllm_config
    from vllm.plugins import load_general_plugins
    import dsv4_rocm.integrations.vllm as plugin
    load_general_plugins()
    assert plugin._state["registered"] is True
    keep = (vllm_suite._define_c_ops(), H.define_cpu_gemm_ops())     # library fragments must stay alive
    patch_interpreter_scalars()
    cfg = tiny_config(index_topk=TR.CPU_INDEX_TOPK)
    model_dir = H.tiny_checkpoint_dir(cfg, TR.MAX_LEN)
    with set_current_vllm_config(H.vllm_config(model_dir, TR.MAX_LEN, TR.MAX_TOKENS, num_spec=2)):
        H.init_parallel_state("gloo")
    yield cfg, model_dir, keep


def cpu_layer_class():
    import vllm.models.deepseek_v4.cpu.cpu_sparse as cpu_sparse
    from dsv4_rocm.integrations.vllm.layer import is_hooked
    cls = cpu_sparse.DeepseekV4CPUAttention
    assert is_hooked(cls), "the plugin did not bind its layer class"
    return cls


@pytest.mark.parametrize("layer_type", [LayerType.SWA, LayerType.C4, LayerType.C128], ids=["swa", "c4", "c128"])
def test_vllm_layer_matches_reference_layer(vllm_env, layer_type):
    cfg, model_dir, _ = vllm_env
    built = TR.build_layer(cpu_layer_class(), cfg, model_dir, layer_type, "cpu")
    for name, T, rel in TR.Trace(built, cfg, "cpu", exact_attention=True).run():
        print(f"{layer_type.value} {name}: T={T} caches and attention equal, end-to-end rel {rel:.4f}")
