"""Empty steps and empty batches (docs/conventions.md, "Padding and invalid entries"): the layer on a step of
0 tokens returns an empty [0, hidden] result and writes no cache byte; every public op on an empty batch
returns empty results without launching a kernel, on the reference and on the Triton kernels (run by the
interpreter in a subprocess, with every launch counted)."""
import pytest
import torch

from helpers import run_file_interpreted

from dsv4_rocm import ops
from dsv4_rocm.config import LayerType, tiny_config, tiny_v41_config
from dsv4_rocm.serving import SyntheticServer
from dsv4_rocm.step import StepMetadata

CFG = tiny_config()
I32, I64, BF = torch.int32, torch.int64, torch.bfloat16


def empty_step(num_requests=0, ratios=(4, 128), device="cpu"):
    """A built step of 0 tokens over ``num_requests`` requests (each of query length 0)."""
    R, d = num_requests, dict(device=device)
    return StepMetadata(torch.zeros(R + 1, dtype=I32, **d), torch.full((R,), 5, dtype=I32, **d),
                        torch.zeros(0, dtype=I64, **d), torch.zeros(0, dtype=I64, **d),
                        *(torch.zeros(R, 2, dtype=I32, **d),) * 3, num_decodes=0, num_decode_tokens=0,
                        max_model_len=512).build(ratios)


def caches(server):
    c = server.cache
    return [t.clone() for t in (c.swa, c.comp, c.idx, c.comp_state, c.idx_state) if t is not None]


def check_layers(device="cpu"):
    """Every layer type on empty steps (no request, and requests with nothing to compute): an empty
    [0, hidden] bf16 result, no cache byte changed."""
    for lt in (LayerType.SWA, LayerType.C4, LayerType.C128):
        s = SyntheticServer(CFG, lt, num_requests=2, max_model_len=512, device=str(device))
        before = caches(s)
        for R in (0, 2):
            y = s.layer(torch.zeros(0, dtype=I64, device=device),
                        torch.zeros(0, CFG.hidden_size, dtype=BF, device=device), empty_step(R, s.ratios(), device))
            assert y.shape == (0, CFG.hidden_size) and y.dtype == BF, lt
        assert all(torch.equal(a, b) for a, b in zip(before, caches(s))), lt


def check_v41_layers(device="cpu"):
    """Every DeepSeek-V4.1 layer kind (tiny-v4.1: sliding window, ratio-2 and ratio-1 kv sources, readers of
    their caches, the candidate source, an index source scoring inside the candidates) on empty steps: an
    empty [0, hidden] bf16 result; no byte of any cache (SWA, compressed, indexer-K, ring) or of the shared
    top-k and candidate buffers changed."""
    cfg = tiny_v41_config()
    s = SyntheticServer(cfg, None, 2, 512, device=str(device), layers=tuple(range(8)))
    tensors = [t for c in s.caches.values() for t in (c.swa, c.comp, c.idx, c.ring) if t is not None]
    tensors += [s.shared.topk, s.shared.candidates]
    for t in tensors:                                    # not zeros: a write of zeros would show
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8))
    before = [t.clone() for t in tensors]
    for R in (0, 2):
        step = empty_step(R, s.ratios(), device)
        for layer, m in s.modules.items():
            y = m(torch.zeros(0, dtype=I64, device=device), torch.zeros(0, cfg.hidden_size, dtype=BF, device=device),
                  step)
            assert y.shape == (0, cfg.hidden_size) and y.dtype == BF, layer
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, tensors))


@pytest.mark.parametrize("backend", ["reference"])
def test_layer_on_an_empty_step_returns_an_empty_result(backend):
    """It used to raise `cannot reshape tensor of 0 elements into shape [0, -1]` in _o_proj."""
    with ops.use_backend(backend):
        check_layers()


@pytest.mark.parametrize("backend", ["reference"])
def test_v41_layer_on_an_empty_step_returns_an_empty_result(backend):
    with ops.use_backend(backend):
        check_v41_layers()


@pytest.mark.gpu
def test_layer_on_an_empty_step_on_the_gpu(gpu):
    """The GPU default path (HIP and Triton kernels): the same empty result, nothing launched or written."""
    check_layers(gpu)
    check_v41_layers(gpu)
    torch.cuda.synchronize()


def empty_op_calls():
    """(op, call, check): every public op with a kernel, on an empty batch, and what its result must be."""
    from dsv4_rocm.reference import cache as rc
    from dsv4_rocm.reference.rope import build_cos_sin_cache
    cs = build_cos_sin_cache(10000.0, 64)
    e32, e64 = torch.empty(0, dtype=I32), torch.empty(0, dtype=I64)
    bt = torch.zeros(2, 3, dtype=I32)
    k8, icache = torch.empty(0, 128, dtype=torch.uint8), torch.zeros(2, 64, 132, dtype=torch.uint8)
    pages = rc.new_cache(2, 64)
    state = torch.zeros(2, 8, 2 * 512)

    def shapes(*want):
        return lambda res: [tuple(t.shape) for t in (res if isinstance(res, tuple) else (res,))] == list(want)
    none = (lambda res: res is None)
    return [
        ("get_compressed_slot_mapping", lambda: ops.get_compressed_slot_mapping(0, torch.zeros(3, dtype=I32),
                                                                                e32.new_zeros(2), bt, 64, 4),
         shapes((0,))),
        ("compute_swa_indices_and_lens", lambda: ops.compute_swa_indices_and_lens(
            torch.empty(0, 1, 8, dtype=I32), e32, 8, torch.zeros(1, dtype=I32), e32, e32,
            torch.empty(0, dtype=torch.bool), torch.empty(0, 2, dtype=I32), 64), shapes((0, 1, 8), (0,))),
        ("compute_prefill_gather_lens", lambda: ops.compute_prefill_gather_lens(e32, e32, torch.zeros(1, dtype=I32),
                                                                                0, 0, 8), shapes((0,))),
        ("compute_global_topk_indices_and_lens", lambda: ops.compute_global_topk_indices_and_lens(
            torch.empty(0, 8, dtype=I32), e32, bt, 64, torch.empty(0, dtype=torch.bool)), shapes((0, 8), (0,))),
        ("build_c128a_topk_metadata", lambda: ops.build_c128a_topk_metadata(
            e64, 128, 0, e32, bt, 2, e64, torch.empty(2, 128, dtype=I32), torch.empty(2, dtype=I32),
            torch.empty(2, 128, dtype=I32), 128), shapes((0, 128), (0,), (0, 128))),
        ("combine_topk_swa_indices", lambda: ops.combine_topk_swa_indices(torch.empty(0, 8, dtype=I32),
                                                                          torch.zeros(1, dtype=I32), e32, e32, 128,
                                                                          4, 8, 300, 100), shapes((0, 256), (0,))),
        ("save_partial_states", lambda: ops.save_partial_states(torch.empty(0, 512), torch.empty(0, 512),
                                                                torch.zeros(128, 512), e64, state, e64, 8, 512, 128),
         none),
        ("fused_indexer_q_rope_quant", lambda: ops.fused_indexer_q_rope_quant(e64, torch.empty(0, 4, 128, dtype=BF),
                                                                              cs, torch.empty(0, 4, dtype=BF), 0.1,
                                                                              0.5), shapes((0, 4, 128), (0, 4))),
        ("fp8_mqa_logits", lambda: ops.fp8_mqa_logits(torch.empty(0, 4, 128, dtype=torch.uint8),
                                                      (k8, torch.empty(0)), torch.empty(0, 4), e32, e32),
         shapes((0, 0))),
        ("fp8_paged_mqa_logits", lambda: ops.fp8_paged_mqa_logits(
            torch.empty(0, 1, 4, 128, dtype=torch.uint8), icache, torch.empty(0, 4), e32, torch.empty(0, 3, dtype=I32),
            torch.zeros(2, 2, dtype=I32), 256), shapes((0, 256))),
        ("indexer_k_quant_and_cache", lambda: ops.indexer_k_quant_and_cache(torch.empty(0, 128, dtype=BF), icache, e64,
                                                                            128, "ue8m0"), none),
        ("cp_gather_indexer_k_quant_cache", lambda: ops.cp_gather_indexer_k_quant_cache(
            icache, k8, torch.empty(0, 4, dtype=torch.uint8), torch.empty(0, 3, dtype=I32), torch.zeros(1, dtype=I32)),
         none),
        ("top_k_per_row_prefill", lambda: ops.top_k_per_row_prefill(torch.empty(0, 50), e32, e32,
                                                                    torch.empty(0, 4, dtype=I32), 0, 50, 1, 4), none),
        ("top_k_per_row_decode", lambda: ops.top_k_per_row_decode(torch.empty(0, 50), 1, e32,
                                                                  torch.empty(0, 4, dtype=I32), 0, 50, 1, 4), none),
        ("top_k_global_decode", lambda: ops.top_k_global_decode(torch.empty(0, 50), 1, e32, torch.empty(0, 4, dtype=I32),
                                                                0, 50, 1, 4, e32, bt, 64, torch.empty(0, dtype=torch.bool)),
         shapes((0, 4), (0,))),
        ("persistent_topk", lambda: ops.persistent_topk(torch.empty(0, 50), e32, torch.empty(0, 4, dtype=I32),
                                                        torch.empty(0, dtype=torch.uint8), 4, 50), none),
        ("sparse_mla_decode", lambda: ops.sparse_mla_decode(
            torch.empty(0, 1, 64, 512, dtype=BF), rc.flash_mla_view(pages, 64), torch.empty(0, 1, 128, dtype=I32),
            e32, torch.zeros(64), rc.flash_mla_view(pages, 64), torch.empty(0, 1, 512, dtype=I32), e32, 0.04),
         shapes((0, 1, 64, 512), (0, 64, 1))),
        ("sparse_mla_prefill", lambda: ops.sparse_mla_prefill(torch.empty(0, 64, 512, dtype=BF),
                                                              torch.empty(0, 1, 512, dtype=BF),
                                                              torch.empty(0, 1, 8, dtype=I32), 0.04),
         shapes((0, 64, 512), (0, 64), (0, 64))),
        ("fused_inv_rope_fp8_quant", lambda: ops.fused_inv_rope_fp8_quant(torch.empty(0, 2, 512, dtype=BF), e64, cs, 1,
                                                                          2), shapes((0, 1, 1024), (0, 1, 8))),
        ("fp8_einsum", lambda: ops.fp8_einsum("bhr,hdr->bhd", (torch.empty(0, 2, 256, dtype=torch.uint8),
                                                               torch.empty(0, 2, 2)),
                                              (torch.zeros(2, 128, 256, dtype=torch.uint8), torch.ones(2, 1, 2)),
                                              torch.empty(0, 2, 128, dtype=BF)), none),
        ("fp8_linear", lambda: ops.fp8_linear(torch.empty(0, 256, dtype=BF), torch.zeros(128, 256, dtype=torch.uint8),
                                              torch.ones(1, 2)), shapes((0, 128))),
    ]


def check_ops():
    for op, call, check in empty_op_calls():
        assert check(call()), op


def test_every_op_on_an_empty_batch_returns_empty_results():
    with ops.use_backend("reference"):
        check_ops()


def interpreter_main():
    """Route the ops with a Triton kernel to it for CPU tensors (the interpreter runs them), count every
    kernel launch, and run the empty layers and ops: no launch, the same empty results."""
    from helpers import patch_interpreter_scalars
    import triton.runtime.interpreter as ti
    from dsv4_rocm.ops import _dispatch
    patch_interpreter_scalars()
    launches = []
    run = ti.InterpretedFunction.run

    def counted(self, *args, **kwargs):
        launches.append(getattr(self.fn, "__name__", "?"))
        return run(self, *args, **kwargs)
    ti.InterpretedFunction.run = counted
    _dispatch._machine_backends = lambda device_type: ("reference", "triton")
    _dispatch.forget_implementations()
    with ops.use_backend("triton"):
        triton_ops = [op for op, _, _ in empty_op_calls() if "triton" in _dispatch._KERNELS[op]]
        assert all(_dispatch.backend_for(op, "cpu") == "triton" for op in triton_ops)
        check_ops()
        check_layers()
        # the routing works: a non-empty call does launch
        ops.compute_prefill_gather_lens(torch.empty(1, dtype=I32), torch.tensor([5], dtype=I32),
                                        torch.tensor([0, 2], dtype=I32), 1, 0, 8)
    assert len(launches) == 1, launches                         # only that one
    print("empty batches: no launch;", len(triton_ops), "ops on their Triton kernels")


def test_triton_launchers_on_empty_batches_launch_nothing():
    r = run_file_interpreted(__file__)
    assert r.returncode == 0 and "empty batches: no launch" in r.stdout


if __name__ == "__main__":
    interpreter_main()
