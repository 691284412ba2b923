"""Load dsv4_rocm._C, building it on first use from a source checkout when it was not built at install
time (same sources and flags as setup.py: build_tools/extension.py)."""
import functools
import importlib
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sources_present() -> bool:
    return os.path.isdir(os.path.join(ROOT, "hip_kernels")) and os.path.isdir(os.path.join(ROOT, "build_tools"))


@functools.lru_cache(maxsize=None)
def load():
    """Import (or JIT-build and import) the extension; returns torch.ops.dsv4_rocm_hip (the kernel launchers)."""
    import torch
    try:
        importlib.import_module("dsv4_rocm._C")
    except ImportError:
        if not sources_present():
            raise RuntimeError("dsv4_rocm._C is not built and no kernel sources are present to build it")
        if ROOT not in sys.path:
            sys.path.insert(0, ROOT)
        from build_tools import extension as ext
        from torch.utils.cpp_extension import load as jit_load
        if torch.version.cuda is not None and "TORCH_CUDA_ARCH_LIST" not in os.environ:
            os.environ["TORCH_CUDA_ARCH_LIST"] = ext.cuda_arch(*torch.cuda.get_device_capability())  # this GPU only
        build = os.path.join(ROOT, "build", "jit")
        os.makedirs(build, exist_ok=True)
        jit_load(name="dsv4_rocm_C", sources=ext.sources(build), extra_include_paths=[ext.INCLUDE],
                 extra_cflags=ext.CXX_FLAGS, extra_cuda_cflags=ext.extra_cuda_cflags(), build_directory=build,
                 verbose=False)
    _register_fakes()
    return torch.ops.dsv4_rocm_hip


LAUNCHERS = ("quantize_and_insert_k_cache", "fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert",
             "qnorm_rope_and_insert_full_k_cache", "dequantize_and_gather_k_cache", "dequantize_global_slots_k_cache",
             "fused_q_kv_rmsnorm")


def _register_fakes():
    """Fake (meta) implementations of the launchers, so FakeTensor tracing and torch.compile go through
    them: each writes only into tensors its caller passed (outputs included) and returns nothing."""
    import torch

    def nothing(*args):
        return None

    for name in LAUNCHERS:
        torch.library.register_fake(f"dsv4_rocm_hip::{name}", nothing)
