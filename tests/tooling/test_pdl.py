"""Programmatic dependent launch (dsv4_rocm/triton/_pdl.py): which launches get it, and that a decode
step launched with it gives the bytes it gives without.

On CPU, ``bench.host.simulated_gpu`` stands in for the driver, so each launch's keyword arguments reach
Triton's ``JITFunction.run`` as on a GPU: a kernel declaring a ``PDL`` constexpr gets ``PDL=True`` and the
launch option ``launch_pdl=True`` where the process's GPU takes them, nothing elsewhere or inside
``_pdl.disabled()``; kernels without the constexpr never get them. The compile matrix (sm_90a, sm_100a)
compiles every PDL kernel with the option on and checks ``griddepcontrol.wait`` in its PTX. The gpu test
replays a captured C4 decode step with and without PDL on the device."""
import pytest
import torch
import triton
import triton.language as tl

from dsv4_rocm.bench.host import simulated_gpu
from dsv4_rocm.triton import _pdl
from dsv4_rocm.triton._launch import Kernel
from dsv4_rocm.triton._pdl import pdl_start


@triton.jit
def _with_pdl(p, n, C: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)


@triton.jit
def _without_pdl(p, n, C: tl.constexpr):
    pass


@pytest.fixture
def run_kwargs():
    """The keyword arguments of every JITFunction.run call."""
    from triton.runtime.jit import JITFunction
    run, calls = JITFunction.run, []

    def recording(self, *a, **kw):
        calls.append((self.fn.__name__, kw))
        return run(self, *a, **kw)
    JITFunction.run = recording
    try:
        yield calls
    finally:
        JITFunction.run = run


def _launch_both(bound_too=True):
    t = torch.empty(64, dtype=torch.float32)
    for fn in (_with_pdl, _without_pdl):
        Kernel(fn)[(1,)](t, 3, C=1)
        if bound_too:
            Kernel(fn).bind(C=1)[(2,)](t, 3)


@pytest.mark.parametrize("gpu_takes_pdl", [True, False])
def test_pdl_kernels_get_the_launch_option_where_the_gpu_takes_it(run_kwargs, monkeypatch, gpu_takes_pdl):
    monkeypatch.setattr(_pdl, "_SUPPORTED", gpu_takes_pdl)
    with simulated_gpu("cuda"):
        _launch_both()
        with _pdl.disabled():
            _launch_both()
    on = [(name, kw.get("PDL"), kw.get("launch_pdl")) for name, kw in run_kwargs]
    want = "_with_pdl" if gpu_takes_pdl else None
    assert [x for x in on[:4] if x[1]] == [(n, True, True) for n in ("_with_pdl", "_with_pdl") if n == want]
    assert all(not pdl and not opt for _, pdl, opt in on[4:]), on        # disabled: none
    assert all(not pdl and not opt for name, pdl, opt in on if name == "_without_pdl")


def test_no_pdl_without_a_cuda_gpu_of_compute_capability_9(monkeypatch):
    monkeypatch.setattr(_pdl, "_SUPPORTED", None)
    expected = (torch.cuda.is_available() and torch.version.hip is None
                and torch.cuda.get_device_capability()[0] >= 9)
    assert _pdl.supported() is bool(expected)


def test_decode_step_kernels_declare_pdl():
    """The kernels a decode step launches after one another take the PDL constexpr (and so start with
    pdl_start)."""
    import inspect
    from dsv4_rocm.triton.attention import sparse_mla_decode as D
    from dsv4_rocm.triton.compressor import compress_norm_rope_store as C, save_partial_states as S
    from dsv4_rocm.triton.indexer import fp8_paged_mqa_logits as P
    from dsv4_rocm.triton.metadata import step_index_sets as M
    from dsv4_rocm.triton.output import fp8_einsum as E, fused_inv_rope_fp8_quant as R
    from dsv4_rocm.triton.qkv import decode_front as F, fused_deepseek_v4_kv_rope_insert as K
    from dsv4_rocm.triton.indexer import fused_indexer_q_rope_quant as Q, top_k_per_row as TK
    from dsv4_rocm.triton.metadata import compute_global_topk_indices_and_lens as GT
    for fn in (D._sparse_mla_paged_kernel, D._combine_kernel, C._compress_norm_rope_store_kernel,
               S._save_partial_states_kernel, P._fp8_paged_mqa_logits_kernel, M._step_index_sets_kernel,
               R._inv_rope_fp8_quant_kernel, E._fp8_einsum_kernel, E._quantize_activation_kernel,
               F._decode_front_kernel, K._kv_rope_insert_kernel, Q._fused_indexer_q_rope_quant_kernel,
               TK._fused_kernel, TK._coarse_kernel, TK._collect_kernel, TK._split1_kernel, GT._global_topk_kernel):
        assert "PDL" in fn.arg_names, fn.__name__
        assert "pdl_start(PDL)" in inspect.getsource(fn.fn), fn.__name__


@pytest.mark.gpu
def test_captured_decode_step_is_the_same_with_and_without_pdl(gpu):
    """The C4 decode step's public-op calls (bench.host.c4_decode_calls), replayed from CUDA graphs captured
    with PDL launches and without: every output identical."""
    from dsv4_rocm.bench.host import c4_decode_calls
    if not _pdl.supported():
        pytest.skip("PDL needs an NVIDIA GPU of compute capability 9 or newer")
    results = []
    for off in (False, True):
        calls, outputs = c4_decode_calls("cuda", b=16, ctx=1024, seed=3)
        ctx = _pdl.disabled() if off else torch.no_grad()
        with ctx:
            for _, fn in calls:                          # eager first: compiles, and the warm-up a graph needs
                fn()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _, fn in calls:
                    fn()
            for _ in range(3):
                g.replay()
            torch.cuda.synchronize()
        results.append({name: [t.clone() for t in _tensors(v)] for name, v in outputs().items()})
    assert results[0].keys() == results[1].keys()
    for name in results[0]:
        for a, b in zip(results[0][name], results[1][name]):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


def _tensors(v):
    """The tensors of an output: itself, or those of a tuple / list."""
    if isinstance(v, torch.Tensor):
        return [v.contiguous()]
    return [t for x in v for t in _tensors(x)] if isinstance(v, (tuple, list)) else []
