"""setup.py's extension build (build_tools/extension.py) without a GPU or a compiler: the arguments it hands
to setuptools on each branch (ROCm torch: hipcc on the .hip files; CUDA torch: hip2cuda, then nvcc), with the
GPU detection stubbed and nothing compiled, and the GPU install command said alike everywhere it is given."""
import os
import re
import runpy
import sys

import pytest

from build_tools import extension as ext

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_setup(monkeypatch, rocm: bool):
    """Execute setup.py as pip's build would, on a GPU torch of the given kind: returns the recorded
    CUDAExtension call (name, args, kwargs) and setup()'s keyword arguments."""
    import setuptools
    import torch.utils.cpp_extension as cpp
    calls = {}

    def extension(name, *args, **kwargs):
        calls["extension"] = (name, args, kwargs)
        return calls["extension"]
    monkeypatch.setattr(ext, "skip_reason", lambda: None)
    monkeypatch.setattr(ext, "is_rocm_torch", lambda: rocm)
    monkeypatch.setattr(cpp, "CUDAExtension", extension)
    monkeypatch.setattr(cpp, "BuildExtension", object)
    monkeypatch.setattr(setuptools, "setup", lambda **kw: calls.setdefault("setup", kw))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", ["setup.py", "build_ext"])
    monkeypatch.setenv("PYTORCH_ROCM_ARCH", "gfx942")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.chdir(ROOT)                         # pip runs the build in the directory of setup.py
    runpy.run_path(os.path.join(ROOT, "setup.py"), run_name="__main__")
    return calls["extension"], calls["setup"]


@pytest.mark.parametrize("rocm", [True, False], ids=["rocm-hipcc", "cuda-hip2cuda-nvcc"])
def test_every_path_setup_hands_setuptools_is_relative_and_exists(monkeypatch, rocm):
    """setuptools stops an install at any absolute path ("setup script specifies an absolute path"): the
    README's GPU install failed so on an H100 after compiling. Every source is relative to setup.py's
    directory, /-separated, inside it, and exists; setuptools' own check passes."""
    from setuptools.command.build_py import assert_relative
    (name, args, kwargs), setup_kwargs = run_setup(monkeypatch, rocm)
    assert name == "dsv4_rocm._C"
    assert setup_kwargs["ext_modules"] == [(name, args, kwargs)] and "build_ext" in setup_kwargs["cmdclass"]
    kwargs = dict(kwargs, sources=args[0] if args else kwargs["sources"])     # positional or keyword
    for p in kwargs["sources"]:
        assert_relative(p)
        assert not os.path.isabs(p) and "\\" not in p and ".." not in p.split("/"), p
        assert os.path.exists(os.path.join(ROOT, p)), p
    hips = sorted(f[:-4] for f in os.listdir(os.path.join(ROOT, "hip_kernels")) if f.endswith(".hip"))
    assert hips and kwargs["sources"][0] == "hip_kernels/bindings/dsv4_ops.cpp"
    if rocm:
        assert kwargs["sources"][1:] == [f"hip_kernels/{h}.hip" for h in hips]
        assert kwargs["extra_compile_args"]["nvcc"] == ext.HIPCC_FLAGS
    else:                                            # the translated sources, under build/ (git-ignored)
        assert kwargs["sources"][1:] == [f"build/cuda/{h}.cu" for h in hips]
        assert "-gencode=arch=compute_90a,code=sm_90a" in kwargs["extra_compile_args"]["nvcc"]
    # the compiler runs in the build's temporary directory (torch's ninja build): the include directory is
    # absolute (setuptools checks sources, never include directories)
    assert kwargs["include_dirs"] == [os.path.join(ROOT, "hip_kernels", "include")]


def test_cuda_arch_entries():
    assert ext.cuda_arch(9, 0) == "9.0a" and ext.cuda_arch(10, 0) == "10.0a" and ext.cuda_arch(8, 9) == "8.9"


def test_gpu_install_command_is_the_same_everywhere():
    """README.md, docs/platforms.md, the extension's messages and gpu/suite.sh (which installs through it)
    give one GPU install command."""
    from dsv4_rocm.__main__ import BUILD_AT_INSTALL
    cmd = ext.INSTALL_COMMAND
    assert cmd == "pip install --no-deps --no-build-isolation -e ."
    for path in ("README.md", "docs/platforms.md", "gpu/suite.sh", "setup.py"):
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            text = f.read()
        assert cmd in text, path
        for line in text.splitlines():          # no other spelling of the GPU install (an extra may follow -e)
            if "pip install" in line and "--no-build-isolation" in line:
                assert cmd in line or cmd[:-1] + "'.[" in line, (path, line)
    assert cmd in BUILD_AT_INSTALL
    with open(os.path.join(ROOT, "gpu/suite.sh"), encoding="utf-8") as f:
        suite = f.read()
    build = suite[suite.index("if want build"):suite.index("if want tests")]
    assert "python3 -m " + cmd in build and "import dsv4_rocm._C" in build and "--arch-env" in build
