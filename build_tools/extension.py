"""How dsv4_rocm._C is built, shared by setup.py (install time) and dsv4_rocm/_build.py (first use).

ROCm torch: the .hip files compile with hipcc for PYTORCH_ROCM_ARCH (default gfx942;gfx950).
CUDA torch: hip2cuda translates each .hip into build/cuda/*.cu, compiled by nvcc for TORCH_CUDA_ARCH_LIST
(default 9.0a;10.0a). Contraction is off and division/sqrt are IEEE on both, so cache bytes match the
reference bit for bit.

setup.py takes its arguments from ``setup_extension_kwargs``: setuptools refuses absolute paths (every
path it is given must be relative to the directory of setup.py), so sources and include directories are
given relative to ROOT there; the first-use build (torch's JIT loader) takes the absolute ones of
``sources``. ``python -m build_tools.extension --arch-env`` prints the arch-list setting for the GPU torch
sees (what gpu/suite.sh installs with).
"""
import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HIP_DIR = os.path.join(ROOT, "hip_kernels")
INCLUDE = os.path.join(HIP_DIR, "include")
BINDINGS = os.path.join(HIP_DIR, "bindings", "dsv4_ops.cpp")
BUILD_DIR = "build"              # relative to ROOT; hip2cuda writes its .cu files under BUILD_DIR/cuda
CXX_FLAGS = ["-O3", "-std=c++17"]
HIPCC_FLAGS = ["-O3", "-std=c++17", "-ffp-contract=off", "-fhip-fp32-correctly-rounded-divide-sqrt"]
NVCC_FLAGS = ["-O3", "-std=c++17", "--fmad=false", "-prec-div=true", "-prec-sqrt=true"]
# the GPU install, as README.md gives it (with the GPU torch, triton, numpy and tqdm already installed:
# --no-deps keeps pip from replacing that torch, --no-build-isolation lets the build see it)
INSTALL_COMMAND = "pip install --no-deps --no-build-isolation -e ."


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
                f"torch first, then {INSTALL_COMMAND}")
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


def cuda_arch(major: int, minor: int) -> str:
    """TORCH_CUDA_ARCH_LIST entry of a compute capability: Hopper and Blackwell take the 'a' targets."""
    return f"{major}.{minor}" + ("a" if major in (9, 10) else "")


def gpu_arch_env() -> str:
    """``PYTORCH_ROCM_ARCH=gfx942`` or ``TORCH_CUDA_ARCH_LIST=9.0a``: the arch list of the GPU torch sees."""
    import torch
    if not torch.cuda.is_available():
        raise RuntimeError("torch sees no GPU")
    if torch.version.hip is not None:
        return "PYTORCH_ROCM_ARCH=" + torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
    return "TORCH_CUDA_ARCH_LIST=" + cuda_arch(*torch.cuda.get_device_capability())


def sources(build_dir: str) -> list:
    """Absolute paths of the sources to compile; on a CUDA torch the .hip files are translated into
    ``build_dir``/cuda first."""
    hips = sorted(glob.glob(os.path.join(HIP_DIR, "*.hip")))
    if is_rocm_torch():
        return [BINDINGS] + hips
    from .hip2cuda import translate_file
    out = os.path.join(build_dir, "cuda")
    return [BINDINGS] + [os.path.abspath(translate_file(h, out)) for h in hips]


def relative(path: str) -> str:
    """``path`` relative to ROOT (the directory of setup.py), /-separated, as setuptools wants it."""
    return os.path.relpath(os.path.abspath(path), ROOT).replace(os.sep, "/")


def extra_cuda_cflags() -> list:
    if is_rocm_torch():
        os.environ.setdefault("PYTORCH_ROCM_ARCH", "gfx942;gfx950")
        return HIPCC_FLAGS
    return NVCC_FLAGS + cuda_gencode()


def setup_extension_kwargs() -> dict:
    """setup.py's ``CUDAExtension("dsv4_rocm._C", **...)`` arguments: sources relative to ROOT (the hip2cuda
    output under BUILD_DIR included; setuptools refuses absolute ones), the include directory absolute (the
    compiler runs in the build's temporary directory, where a relative one names nothing), and the compile
    flags of this torch."""
    return dict(sources=[relative(s) for s in sources(os.path.join(ROOT, BUILD_DIR))],
                include_dirs=[os.path.abspath(INCLUDE)],
                extra_compile_args={"cxx": CXX_FLAGS, "nvcc": extra_cuda_cflags()})


if __name__ == "__main__":
    if sys.argv[1:] != ["--arch-env"]:
        sys.exit("usage: python -m build_tools.extension --arch-env")
    print(gpu_arch_env())
