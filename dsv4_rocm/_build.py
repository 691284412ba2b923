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
    """Import (or JIT-build and import) the extension; returns torch.ops.dsv4_rocm."""
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
            major, minor = torch.cuda.get_device_capability()      # build for this GPU only
            os.environ["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}" + ("a" if major in (9, 10) else "")
        build = os.path.join(ROOT, "build", "jit")
        os.makedirs(build, exist_ok=True)
        jit_load(name="dsv4_rocm_C", sources=ext.sources(build), extra_include_paths=[ext.INCLUDE],
                 extra_cflags=ext.CXX_FLAGS, extra_cuda_cflags=ext.extra_cuda_cflags(), build_directory=build,
                 verbose=False)
    _register_fakes()
    return torch.ops.dsv4_rocm


def _register_fakes():
    """Shape functions of the ops, so torch.compile / FakeTensor tracing can go through them."""
    import torch

    @torch.library.register_fake("dsv4_rocm::quantize_and_insert_k_cache")
    def _(k, k_cache, slot_mapping, block_size):
        return None

    @torch.library.register_fake("dsv4_rocm::fused_qnorm_rope_kv_rope_quant_insert")
    def _(q, kv, k_cache, slot_mapping, positions, cos_sin_cache, padded_heads, eps, block_size):
        return q.new_empty(q.shape[0], padded_heads, 512)

    @torch.library.register_fake("dsv4_rocm::fused_q_kv_rmsnorm")
    def _(qr, kv, q_weight, kv_weight, eps):
        return qr.new_empty(qr.shape), kv.new_empty(kv.shape)

    @torch.library.register_fake("dsv4_rocm::dequantize_and_gather_k_cache")
    def _(k_cache, slots, block_size):
        return k_cache.new_empty(slots.shape[0], 512, dtype=torch.bfloat16)
