"""How dsv4_rocm._C is built, shared by setup.py (install time) and dsv4_rocm/_build.py (first use).

ROCm torch: the .hip files compile with hipcc for PYTORCH_ROCM_ARCH (default gfx942;gfx950).
CUDA torch: hip2cuda translates each .hip into build/cuda/*.cu, compiled by nvcc for TORCH_CUDA_ARCH_LIST
(default 9.0a;10.0a). Contraction is off and division/sqrt are IEEE on both, so cache bytes match the
reference bit for bit.
"""
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HIP_DIR = os.path.join(ROOT, "hip_kernels")
INCLUDE = os.path.join(HIP_DIR, "include")
BINDINGS = os.path.join(HIP_DIR, "bindings", "dsv4_ops.cpp")
CXX_FLAGS = ["-O3", "-std=c++17"]
HIPCC_FLAGS = ["-O3", "-std=c++17", "-ffp-contract=off", "-fhip-fp32-correctly-rounded-divide-sqrt"]
NVCC_FLAGS = ["-O3", "-std=c++17", "--fmad=false", "-prec-div=true", "-prec-sqrt=true"]


def is_rocm_torch() -> bool:
    import torch
    return torch.version.hip is not None


def gpu_torch() -> bool:
    import torch
    return torch.version.hip is not None or torch.version.cuda is not None


def skip_reason():
    """Why the build at install compiles no extension here (None when it compiles one): one line."""
    try:
        import torch
    except ImportError:
        return ("no torch in the build environment (an isolated pip build has none): install the ROCm or CUDA "
                "torch first, then pip install --no-build-isolation -e .")
    if gpu_torch():
        return None
    return f"torch {torch.__version__} is a CPU build"


def cuda_gencode() -> list:
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0a;10.0a").replace(" ", ";").split(";")
    flags = []
    for a in filter(None, archs):
        num = a.replace(".", "").replace("+PTX", "")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
    return flags


def sources(build_dir: str) -> list:
    hips = sorted(glob.glob(os.path.join(HIP_DIR, "*.hip")))
    if is_rocm_torch():
        return [BINDINGS] + hips
    from .hip2cuda import translate_file
    return [BINDINGS] + [translate_file(h, os.path.join(build_dir, "cuda")) for h in hips]


def extra_cuda_cflags() -> list:
    if is_rocm_torch():
        os.environ.setdefault("PYTORCH_ROCM_ARCH", "gfx942;gfx950")
        return HIPCC_FLAGS
    return NVCC_FLAGS + cuda_gencode()
