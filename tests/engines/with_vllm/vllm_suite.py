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
- vLLM's top-k (``torch.ops._C``) and indexer-cache (``torch.ops._C_cache_ops``) ops this vLLM build lacks are
  defined over dsv4_rocm's ops by the plugin itself (dsv4_rocm.integrations.vllm.torch_ops, as in a served
  process): on a GPU machine, where vLLM's compiled files are not carried (gpu/vllm_tests.sh), every such
  op vLLM's tests call is ours;
- vLLM's plugin loader loads dsv4_rocm's vLLM plugin, as in a served process.

Without vLLM's compiled files, its CUDA platform module still imports two of them unguarded; empty stand-ins
(``COMPILED_STAND_INS``) let it import, and its CUTLASS capability queries answer False, so vLLM never
chooses a CUTLASS kernel it does not have.

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
import glob
import importlib
import importlib.util
import inspect
import os
import sys
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
    # V4.1 (vllm/models/deepseek_v41/common/ops): the 528 B FP8 / 288 B FP4 record writers and gathers, the
    # compressor's RoPE + quant + insert, the indexer-K store, and the metadata ops V4.1 keeps its own copies of
    "vllm.models.deepseek_v41.common.ops.cache_utils.quantize_and_insert_k_cache": "quantize_and_insert_k_cache",
    "vllm.models.deepseek_v41.common.ops.cache_utils.dequantize_and_gather_k_cache": "dequantize_and_gather_k_cache",
    "vllm.models.deepseek_v41.common.ops.cache_utils.compute_global_topk_indices_and_lens":
        "compute_global_topk_indices_and_lens",
    "vllm.models.deepseek_v41.common.ops.cache_utils.combine_topk_swa_indices": "combine_topk_swa_indices",
    "vllm.models.deepseek_v41.common.ops.fused_compress_quant_cache.rope_quant_insert": "rope_quant_insert",
    "vllm.models.deepseek_v41.common.ops.fused_compress_quant_cache.fused_save_compress_norm":
        "fused_save_compress_norm",
    "vllm.models.deepseek_v41.common.ops.indexer_k_store.indexer_k_norm_rope_store": "indexer_k_norm_rope_store",
}
# the GPU-form torch.ops._C ops dsv4_rocm registers under its own namespace with vLLM's schemas
C_OPS = ("fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert", "fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert_out",
         "fused_deepseek_v4_qnorm_rope_kv_rope_full_cache_fp8_insert",
         "fused_deepseek_v4_qnorm_rope_kv_rope_full_cache_bf16_insert")

# vLLM's CUTLASS capability queries (vllm/_custom_ops.py calls them unguarded): without vLLM's kernels, no
CAPABILITY_QUERIES = ("cutlass_scaled_mm_supports_fp8", "cutlass_scaled_mm_supports_block_fp8",
                      "cutlass_scaled_mm_supports_fp4", "cutlass_group_gemm_supported")
# vLLM's compiled modules its CUDA platform imports without a guard (vllm/platforms/cuda.py; FlashAttention 2
# through vllm.vllm_flash_attn), as files of the vllm package: an empty module stands in where the file is absent
COMPILED_STAND_INS = {"vllm._C_stable_libtorch": "_C_stable_libtorch*.so",
                      "vllm.vllm_flash_attn._vllm_fa2_C": "vllm_flash_attn/_vllm_fa2_C*.so"}

_MHC = "mHC (hyper-connection) kernel: not attention, dsv4_rocm has none"
_HUB = "builds a ModelConfig of Qwen/Qwen3-0.6B from the Hugging Face Hub; the tier runs offline"
_DISPATCH = ("checks that vLLM's fused_indexer_q_rope_quant routes CPU tensors to vLLM's CPU op; the tier swaps "
             "that function for dsv4_rocm's, so vLLM's routing is not on the path (its CPU op's own tests run)")
_ROTARY = ("its reference is vLLM's compiled rotary_embedding op (torch.ops._C.rotary_embedding): vLLM's own, "
           "not in dsv4_rocm and not carried")
_FLASHMLA = "vLLM's FlashMLA extension (vllm._flashmla_C): vLLM's own compiled kernel, not carried"
_FLASHINFER = ("FlashInfer's sparse MLA path (vllm.models.deepseek_v4.nvidia.flashinfer_sparse and its index "
               "layout kernel): vLLM's own, no dsv4_rocm op on its path")
_DEEPGEMM = "DeepGEMM's FP8 einsum / o_proj (vllm.utils.deep_gemm): vLLM's own, no dsv4_rocm op on its path"
_CUTEDSL = "a CUTLASS-DSL (cute) kernel of vLLM's: vLLM's own, no dsv4_rocm op on its path"
_DEEPSELECT = "vLLM's DeepSelect top-k extension (vllm._deepselect_C): vLLM's own compiled kernel, not carried"
# test function name (per file) -> why it is not run: the one list of cases that exercise no dsv4_rocm op
SKIPS = {
    "test_deepseek_v4_cpu_kernels.py": {"test_mhc_pre_cpu": _MHC, "test_mhc_post_cpu": _MHC, "test_hc_head_cpu": _MHC,
                                        "test_fused_indexer_q_rope_quant_dispatches_to_cpu_kernel": _DISPATCH},
    "test_indexer_deepseek_v4_slot_mapping.py": {
        "test_indexer_prefill_budget_matches_compressed_workspace": _HUB,
        # its case of get_compressed_slot_mapping (slots other than -1 are not padding) runs as our own test:
        # tests/metadata/test_metadata.py::test_compressed_slot_mapping_only_minus_one_is_padding
        "test_indexer_builder_deepseek_v4_compressed_slot_mapping_uses_num_states": _HUB},
    "test_deepseek_v4_swa_visible.py": {
        **{t: _HUB for t in ("test_builder_in_image_visibility", "test_builder_no_image_spans_fast_path",
                             "test_builder_text_model_unchanged", "test_v41_image_prefill_uses_causal_swa",
                             "test_builder_replay_start_bounds_prefill_window_and_gather",
                             "test_builder_replaying_group_builds_without_replay_start",
                             "test_dspark_noncausal_draft_decode_update_matches_build")},
        "test_flashinfer_mixed_sparse_indices_with_image_spans": _FLASHINFER,
        "test_v41_flashinfer_mixed_sparse_indices_respect_replay_start": _FLASHINFER},
    "test_fused_inv_rope_fp8_quant.py": {"test_einsum_end_to_end": _ROTARY, "test_with_real_deepseek_v4_rope": _ROTARY,
                                         "test_dsv41_fused_wo_a_matches_deepgemm": _DEEPGEMM},
    "test_fused_indexer_q_rope_quant.py": {"test_fused_indexer_q_rope_quant_matches_unfused": _ROTARY,
                                           "test_fused_indexer_q_rope_quant_writes_bf16_weights": _ROTARY,
                                           "test_cutedsl_indexer_q_writes_stay_within_num_tokens": _CUTEDSL},
    "test_flashmla_sparse.py": {
        "test_sparse_flashmla_metadata_smoke": _FLASHMLA, "test_sparse_flashmla_decode_matches_cache_writer_scales":
        _FLASHMLA, "test_sparse_flashmla_prefill_smoke": _FLASHMLA,
        **{t: _FLASHINFER for t in ("test_flashinfer_sparse_indices_cache",
                                    "test_flashinfer_sparse_index_preserves_logical_window",
                                    "test_flashinfer_mixed_sparse_indices_separates_window_and_padded_width",
                                    "test_flashinfer_mixed_sparse_indices_noncausal_rows_have_no_active_gaps",
                                    "test_flashinfer_mixed_sparse_indices_noncausal_pad_rows_keep_min_length",
                                    "test_flashinfer_sparse_forward_reads_packed_kv_rows",
                                    "test_flashinfer_rope_quant_matches_unfused_o_proj",
                                    "test_flashinfer_dspark_noncausal_block_sees_future_tokens")}},
    "test_compressor_kv_cache.py": {"test_v41_cache_writers_match_flashmla_decode": _FLASHMLA,
                                    "test_c128_skip_is_not_baked_into_cuda_graph": _CUTEDSL,
                                    "test_cutedsl_full_cache_store": _CUTEDSL},
    "test_top_k_per_row.py": {"test_deep_select_topk": _DEEPSELECT,
                              "test_deep_select_topk_preallocated_output": _DEEPSELECT},
}
# node id (relative to the sdist) -> the deliberate difference of ours it shows (docs/numerics.md)
_SUBNORMALS = ("vLLM's AVX-512 CPU kernel flushes fp8 subnormals to 0; dsv4_rocm stores them, as vLLM's GPU "
               "kernels and torch's cast do (docs/numerics.md#differences)")
XFAILS = {f"tests/kernels/test_deepseek_v4_cpu_kernels.py::test_qnorm_rope_kv_insert_cpu_kernel_matches_eager[{p}]":
          _SUBNORMALS for p in ("1-8-64", "8-8-64", "8-16-64")}

GPU_ONLY = "GPU-only: vLLM puts this test's tensors on a CUDA device"
# cases each file must run (passed or xfailed): fewer means a swap stopped working and vLLM's tests went back
# to skipping. vLLM's CPU-kernel tests run on a CPU platform only (their module-level mark), so a GPU machine
# expects none of them.
MIN_RAN = {"tests/kernels/test_deepseek_v4_cpu_kernels.py": 0 if torch.cuda.is_available() else 45,
           "tests/v1/attention/test_deepseek_v4_rocm_adaptive.py": 8,
           "tests/v1/attention/test_indexer_deepseek_v4_slot_mapping.py": 7}

_state = {"swapped": [], "differs": [], "c_ops": [], "stand_ins": [], "libs": []}


def _stand_in_for_compiled_modules():
    """Empty modules for vLLM's compiled files that are not there (a carry without them), and the CUTLASS
    capability queries those files would answer: vLLM asks them while its DeepSeek-V4 modules import, so
    they must be defined before the plugin loader imports those modules."""
    spec = importlib.util.find_spec("vllm")
    root = spec.submodule_search_locations[0]
    for name, pattern in COMPILED_STAND_INS.items():
        if name not in sys.modules and not glob.glob(os.path.join(root, pattern)):
            sys.modules[name] = types.ModuleType(name)
            _state["stand_ins"].append(name)
    _state["libs"] += _answer_capability_queries()
    if _state["stand_ins"]:
        _inspect_models_with_the_stand_ins()


def _inspect_models_with_the_stand_ins():
    """vLLM's model registry inspects a model class in a fresh interpreter (``ModelConfig`` asks it which
    architectures the checkpoint names); that interpreter imports the model's modules too, so it needs the
    same stand-ins. The registry keeps its command in ``_SUBPROCESS_COMMAND`` for callers to change: run the
    stand-ins there first, then vLLM's own entry point."""
    from vllm.model_executor.models import registry
    registry._SUBPROCESS_COMMAND = [
        sys.executable, "-c",
        "import vllm_suite; vllm_suite._stand_in_for_compiled_modules(); "
        "from vllm.model_executor.models.registry import _run; _run()"]


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
    return [lib]


def _has_op(namespace: str, name: str) -> bool:
    try:
        getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return False
    return True


def _answer_capability_queries():
    """vLLM's CUTLASS capability queries, answering False where vLLM's build lacks them (the namespace ops
    vLLM calls are the plugin's: ``torch_ops.register_missing``, run by vLLM's plugin loader)."""
    libs = {}
    for name in CAPABILITY_QUERIES:
        if _has_op("_C", name):
            continue
        lib = libs.setdefault("_C", torch.library.Library("_C", "FRAGMENT"))
        lib.define(f"{name}(int cuda_device_capability) -> bool")
        lib.impl(name, lambda capability: False, "CompositeExplicitAutograd")
        _state["c_ops"].append(f"_C.{name} (False)")
    return list(libs.values())


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
    _stand_in_for_compiled_modules()
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
        name = path.rsplit("/", 1)[-1]
        reason = SKIPS.get(name, {}).get(item.originalname)
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
_skip_reasons = Counter()       # (who skipped it, reason) -> cases
_fail_causes = Counter()        # where a failure came from -> cases
_failed = []                    # (node id, cause)


def _named(reason: str) -> bool:
    """A skip of this plugin's list (``SKIPS``): a case that exercises no dsv4_rocm op."""
    return reason in {r for reasons in SKIPS.values() for r in reasons.values()}


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, (tuple, list)) and len(longrepr) == 3 else str(longrepr or "")
    return reason.removeprefix("Skipped: ")


def _failure_cause(report) -> str:
    """Where a failure came from: raised inside dsv4_rocm's files; a check of vLLM's test that failed (an
    assertion: our op's output differs from vLLM's expectation); or an error raised outside our files (a vLLM
    op or module this machine lacks, vLLM's own code). With the exception's first line."""
    text = report.longreprtext or ""
    crash = getattr(report.longrepr, "reprcrash", None)
    message = (crash.message if crash is not None else text.strip().splitlines()[-1] if text.strip() else "?")
    message = " ".join(message.split())[:160]
    if "/dsv4_rocm/" in text:
        return "raised in dsv4_rocm: " + message
    if message.startswith("AssertionError") or message.startswith("assert ") or "Mismatched elements" in message:
        return "vLLM's check failed: " + message
    return "error outside dsv4_rocm: " + message


def pytest_runtest_logreport(report):
    """Count each case once: its call, or the setup that failed or skipped it. A skip of ``SKIPS``
    is a case outside dsv4_rocm ("not ours"); a skip by vLLM's own marks names a device, an architecture or a
    GPU library ("GPU-only" on a CPU machine, vLLM's reason on a GPU one)."""
    key = _file(report.nodeid)
    if report.when == "call" or (report.when == "setup" and not report.passed):
        if hasattr(report, "wasxfail"):
            kind = "xfailed" if report.skipped else "xpassed"
        elif report.skipped:
            reason = _skip_reason(report)
            kind = "skipped: not ours" if _named(reason) else "skipped: GPU-only"
            _skip_reasons[("dsv4_rocm's list" if _named(reason) else "vLLM's mark", reason)] += 1
        else:
            kind = report.outcome
            if report.failed:
                cause = _failure_cause(report)
                _fail_causes[cause] += 1
                _failed.append((report.nodeid, cause))
        _counts[key][kind] += 1


def _ran(path: str) -> int:
    c = _counts[path]
    return c["passed"] + c["failed"] + c["xfailed"] + c["xpassed"]


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput"):       # an xdist worker: the controller counts every case
        return
    short = [f"{p} ran {_ran(p)} cases, expected {n}" for p, n in MIN_RAN.items() if p in _counts and _ran(p) < n]
    if short and exitstatus == 0:
        session.config._dsv4_short = short
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    tr = terminalreporter
    tr.section("vLLM 0.33.0's DeepSeek-V4 tests against dsv4_rocm")
    cols = ("passed", "failed", "xfailed", "xpassed", "skipped: GPU-only", "skipped: not ours")
    skipped_vllm = "GPU-only" if not torch.cuda.is_available() else "vLLM mark"
    tr.write_line(f"{'file':62} {'cases':>5} {'ran':>4} " + " ".join(f"{c:>9}" for c in ("passed", "failed",
                  "xfailed", "xpassed", skipped_vllm, "not ours")))
    total = Counter()
    for path in sorted(_counts):
        c = _counts[path]
        total.update(c)
        tr.write_line(f"{path:62} {sum(c.values()):>5} {_ran(path):>4} " + " ".join(f"{c[k]:>9}" for k in cols))
    ran = total["passed"] + total["failed"] + total["xfailed"] + total["xpassed"]
    tr.write_line(f"{'total':62} {sum(total.values()):>5} {ran:>4} " + " ".join(f"{total[k]:>9}" for k in cols))
    tr.write_line("")
    tr.write_line("skipped, by reason (cases, who skipped them, reason):")
    for (who, reason), n in sorted(_skip_reasons.items(), key=lambda kv: (-kv[1], kv[0])):
        tr.write_line(f"  {n:>5}  {who:16} {reason}")
    if _fail_causes:
        tr.write_line("failed, by cause (cases, cause):")
        for cause, n in _fail_causes.most_common():
            tr.write_line(f"  {n:>5}  {cause}")
        for nodeid, cause in sorted(_failed):
            tr.write_line(f"  FAILED {nodeid}  [{cause[:60]}]")
    tr.write_line("")
    tr.write_line(f"ops defined over dsv4_rocm: {', '.join(_state['c_ops'])}")
    from dsv4_rocm.integrations.vllm import torch_ops      # the forms the plugin itself defined
    tr.write_line(f"torch.ops forms the plugin defined (absent from this vLLM build): "
                  f"{', '.join(torch_ops._state['defined']) or 'none'}")
    if _state["stand_ins"]:
        tr.write_line(f"empty stand-ins for vLLM's compiled modules: {', '.join(_state['stand_ins'])}")
    tr.write_line("vLLM Python ops swapped for dsv4_rocm's (register_kernels): "
                  + ", ".join(p.removeprefix("vllm.models.").removeprefix("vllm.") for p in _state["swapped"]))
    for line in _state["differs"]:
        tr.write_line(f"call-form difference, not swapped: {line}")
    for line in getattr(tr.config, "_dsv4_short", []):
        tr.write_line(f"FAILED: {line}", red=True)
