"""vLLM 0.33.0's own DeepSeek-V4 tests, run against dsv4_rocm's ops: a pytest plugin (``-p vllm_suite``).

ci/engine_tier.sh unpacks the test files named in ``vllm_sdist.FILES`` (and the helpers they import) from
vLLM's sdist into .vllm-tests/ and runs them with this plugin; no vLLM file is edited or copied into the
repository.
Before collection the plugin points vLLM's kernels at ours, through the extension points vLLM has:

- ``torch.ops._C``: the DeepSeek-V4 ops vLLM calls there and this vLLM build lacks (a CUDA wheel on a CPU
  machine has none) are defined in the ``_C`` namespace over dsv4_rocm: the GPU forms over
  ``torch.ops.dsv4_rocm`` (same schemas, dsv4_rocm/ops/library.py), the CPU forms through
  ``vllm_cpu_call_forms``;
- vLLM's Python-level DeepSeek-V4 ops are replaced with ``vllm.triton_utils.dispatcher.register_kernels``
  (which also rebinds the copies other modules imported) by the dsv4_rocm op of the same name, where its
  parameters start with vLLM's, in order; the others are listed in the summary as call-form differences;
- vLLM's plugin loader loads dsv4_rocm's vLLM plugin, as in a served process.

vLLM's ROCm platform module reads the GPU architecture when imported (amdsmi, else
``torch.cuda.get_device_properties``); to import vLLM's ROCm DeepSeek-V4 module on a CPU machine the plugin
answers that one query with gfx942 while it imports the module, and nowhere else.

Each case's outcome is classified: GPU-only cases (vLLM puts their tensors on a CUDA device; their skip
marks or, where vLLM has none, torch's "not compiled with CUDA" error) are reported as skipped; cases that
need a resource the tier does not have, or a kernel outside this library, are skipped by name with the
reason in ``SKIPS``; differences of ours that docs/numerics.md states are strict xfails (``XFAILS``). The
terminal summary prints a table per file.
"""
import contextlib
import importlib
import inspect
import types
from collections import Counter, defaultdict

import pytest
import torch

import vllm_cpu_call_forms

# vLLM's Python-level op -> dsv4_rocm's op of that name
PYTHON_OPS = {
    "vllm.models.deepseek_v4.common.ops.cache_utils.quantize_and_insert_k_cache": "quantize_and_insert_k_cache",
    "vllm.models.deepseek_v4.common.ops.cache_utils.dequantize_and_gather_k_cache": "dequantize_and_gather_k_cache",
    "vllm.models.deepseek_v4.common.ops.cache_utils.compute_global_topk_indices_and_lens":
        "compute_global_topk_indices_and_lens",
    "vllm.models.deepseek_v4.common.ops.cache_utils.combine_topk_swa_indices": "combine_topk_swa_indices",
    "vllm.models.deepseek_v4.common.ops.fused_indexer_q.fused_indexer_q_rope_quant": "fused_indexer_q_rope_quant",
    "vllm.models.deepseek_v4.common.ops.fused_inv_rope_fp8_quant.fused_inv_rope_fp8_quant": "fused_inv_rope_fp8_quant",
    "vllm.models.deepseek_v4.common.ops.fused_compress_quant_cache.compress_norm_rope_store_triton":
        "compress_norm_rope_store",
    "vllm.v1.attention.backends.mla.compressor_utils.get_compressed_slot_mapping": "get_compressed_slot_mapping",
}
# the GPU-form torch.ops._C ops dsv4_rocm registers under its own namespace with vLLM's schemas
C_OPS = ("fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert", "fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert_out",
         "fused_deepseek_v4_qnorm_rope_kv_rope_full_cache_fp8_insert",
         "fused_deepseek_v4_qnorm_rope_kv_rope_full_cache_bf16_insert")

_MHC = "mHC (hyper-connection) kernel: not attention, dsv4_rocm has none"
_HUB = "builds a ModelConfig of Qwen/Qwen3-0.6B from the Hugging Face Hub; the tier runs offline"
_DISPATCH = ("checks that vLLM's fused_indexer_q_rope_quant routes CPU tensors to vLLM's CPU op; the tier swaps "
             "that function for dsv4_rocm's, so vLLM's routing is not on the path (its CPU op's own tests run)")
# test function name (per file) -> why it is not run
SKIPS = {
    "test_deepseek_v4_cpu_kernels.py": {"test_mhc_pre_cpu": _MHC, "test_mhc_post_cpu": _MHC, "test_hc_head_cpu": _MHC,
                                        "test_fused_indexer_q_rope_quant_dispatches_to_cpu_kernel": _DISPATCH},
    "test_indexer_deepseek_v4_slot_mapping.py": {"test_indexer_prefill_budget_matches_compressed_workspace": _HUB},
}
# node id (relative to the sdist) -> the deliberate difference of ours it shows (docs/numerics.md)
_SUBNORMALS = ("vLLM's AVX-512 CPU kernel flushes fp8 subnormals to 0; dsv4_rocm stores them, as vLLM's GPU "
               "kernels and torch's cast do (docs/numerics.md#differences)")
XFAILS = {f"tests/kernels/test_deepseek_v4_cpu_kernels.py::test_qnorm_rope_kv_insert_cpu_kernel_matches_eager[{p}]":
          _SUBNORMALS for p in ("1-8-64", "8-8-64", "8-16-64")}

GPU_ONLY = "GPU-only: vLLM puts this test's tensors on a CUDA device"
# cases each file must run on a CPU machine (passed or xfailed): fewer means a swap stopped working and
# vLLM's tests went back to skipping
MIN_RAN = {"tests/kernels/test_deepseek_v4_cpu_kernels.py": 45,
           "tests/v1/attention/test_deepseek_v4_rocm_adaptive.py": 8,
           "tests/v1/attention/test_indexer_deepseek_v4_slot_mapping.py": 7}

_state = {"swapped": [], "differs": [], "c_ops": []}


@contextlib.contextmanager
def _gfx942_for_the_rocm_platform_import():
    """vllm/platforms/rocm.py asks amdsmi, then torch.cuda.get_device_properties, for the GPU architecture
    when imported; a CPU-only torch raises. Answer gfx942 while that module imports, then restore."""
    query = torch.cuda.get_device_properties
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(gcnArchName="gfx942")
    try:
        yield
    finally:
        torch.cuda.get_device_properties = query


def _define_c_ops():
    """The DeepSeek-V4 ``torch.ops._C`` ops this vLLM build lacks, defined over dsv4_rocm's."""
    from dsv4_rocm.ops import library
    lib = torch.library.Library("_C", "FRAGMENT")
    for name in C_OPS:
        if hasattr(torch.ops._C, name):
            continue
        schema = library.SCHEMAS[name][0]
        op = getattr(torch.ops.dsv4_rocm, name)
        lib.define(schema)
        for key in ("CPU", "CUDA"):
            lib.impl(name, op, key)
        _state["c_ops"].append(name)
    missing = {n: s for n, s in vllm_cpu_call_forms.SCHEMAS.items() if not hasattr(torch.ops._C, n)}
    for name, schema in missing.items():
        lib.define(schema)
        lib.impl(name, getattr(vllm_cpu_call_forms, name), "CPU")
    _state["c_ops"] += list(missing)
    return lib


def _same_leading_parameters(theirs, ours) -> bool:
    a = tuple(inspect.signature(theirs).parameters)
    b = tuple(inspect.signature(ours).parameters)
    return b[:len(a)] == a


def _swap_python_ops():
    from dsv4_rocm import ops
    from vllm.triton_utils.dispatcher import register_kernels
    swaps = {}
    for path, name in PYTHON_OPS.items():
        module, attr = path.rsplit(".", 1)
        theirs = getattr(importlib.import_module(module), attr)
        ours = getattr(ops, name)
        if _same_leading_parameters(theirs, ours):
            swaps[path] = ours
            _state["swapped"].append(path)
        else:
            _state["differs"].append(f"{path}{inspect.signature(theirs)}\n      ours: ops.{name}"
                                     f"{inspect.signature(ours)}")
    register_kernels(swaps)
    _show_signatures(swaps)


def _show_signatures(swaps):
    """vLLM's dispatcher puts a ``KernelOverride`` object where the function was; ``inspect.signature`` of it
    is ``(*args, **kwargs)``. vLLM's tests read the signature of the function they call (the SWA-visibility
    test passes ``left_visible`` only when the combine's signature names it), so each override shows the
    signature of the dsv4_rocm op it calls."""
    for path, ours in swaps.items():
        module, attr = path.rsplit(".", 1)
        override = getattr(importlib.import_module(module), attr)
        if override is not ours:
            override.__signature__ = inspect.signature(ours)


def pytest_configure(config):
    with _gfx942_for_the_rocm_platform_import():
        importlib.import_module("vllm.platforms.rocm")
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    import dsv4_rocm.integrations.vllm as plugin
    if not plugin._state["registered"]:
        raise pytest.UsageError("dsv4_rocm's vLLM plugin did not activate")
    config._dsv4_c_lib = _define_c_ops()        # the fragment must outlive the run
    _swap_python_ops()


def _file(nodeid: str) -> str:
    return nodeid.split("::")[0]


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = _file(item.nodeid)
        reason = SKIPS.get(path.rsplit("/", 1)[-1], {}).get(item.originalname)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
        if item.nodeid in XFAILS:
            item.add_marker(pytest.mark.xfail(reason=XFAILS[item.nodeid], strict=True))


def _needs_cuda(excinfo) -> bool:
    return excinfo is not None and excinfo.errisinstance(AssertionError) and \
        "Torch not compiled with CUDA enabled" in str(excinfo.value)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and _needs_cuda(call.excinfo):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {GPU_ONLY}")


@pytest.fixture
def default_vllm_config():
    """vLLM's tests/conftest.py fixture (that conftest imports the whole engine, so the tier leaves it out):
    a default VllmConfig set as the current one."""
    from vllm.config import VllmConfig, set_current_vllm_config
    config = VllmConfig()
    with set_current_vllm_config(config):
        yield config


@pytest.fixture
def workspace_init():
    """vLLM's tests/conftest.py fixture: the workspace manager on the accelerator, when there is one."""
    from vllm.v1.worker.workspace import init_workspace_manager, reset_workspace_manager
    if torch.accelerator.is_available():
        init_workspace_manager(torch.device(0))
    yield
    reset_workspace_manager()


_counts = defaultdict(Counter)
_OURS = set(r for reasons in SKIPS.values() for r in reasons.values())


def pytest_runtest_logreport(report):
    """Count each case once: its call, or the setup that failed or skipped it. A skip by vLLM's own marks
    names a device, an architecture or a GPU library; one of ``SKIPS`` is a case outside this tier."""
    key = _file(report.nodeid)
    if report.when == "call" or (report.when == "setup" and not report.passed):
        if hasattr(report, "wasxfail"):
            kind = "xfailed" if report.skipped else "xpassed"
        elif report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
            kind = "skipped: not ours" if reason.removeprefix("Skipped: ") in _OURS else "skipped: GPU-only"
        else:
            kind = report.outcome
        _counts[key][kind] += 1


def _ran(path: str) -> int:
    c = _counts[path]
    return c["passed"] + c["failed"] + c["xfailed"] + c["xpassed"]


def pytest_sessionfinish(session, exitstatus):
    short = [f"{p} ran {_ran(p)} cases, expected {n}" for p, n in MIN_RAN.items() if p in _counts and _ran(p) < n]
    if short and exitstatus == 0:
        session.config._dsv4_short = short
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    tr = terminalreporter
    tr.section("vLLM 0.33.0's DeepSeek-V4 tests against dsv4_rocm")
    cols = ("passed", "failed", "xfailed", "xpassed", "skipped: GPU-only", "skipped: not ours")
    tr.write_line(f"{'file':62} {'cases':>5} {'ran':>4} " + " ".join(f"{c:>8}" for c in ("passed", "failed",
                  "xfailed", "xpassed", "GPU-only", "not ours")))
    for path in sorted(_counts):
        c = _counts[path]
        tr.write_line(f"{path:62} {sum(c.values()):>5} {_ran(path):>4} " + " ".join(f"{c[k]:>8}" for k in cols))
    tr.write_line(f"torch.ops._C ops defined over dsv4_rocm: {', '.join(_state['c_ops'])}")
    from dsv4_rocm.integrations.vllm import torch_ops      # the forms the plugin itself defined
    tr.write_line(f"torch.ops forms the plugin defined (absent from this vLLM build): "
                  f"{', '.join(torch_ops._state['defined']) or 'none'}")
    tr.write_line("vLLM Python ops swapped for dsv4_rocm's (register_kernels): "
                  + ", ".join(p.rsplit(".", 1)[-1] for p in _state["swapped"]))
    for line in _state["differs"]:
        tr.write_line(f"call-form difference, not swapped: {line}")
    for line in getattr(tr.config, "_dsv4_short", []):
        tr.write_line(f"FAILED: {line}", red=True)
