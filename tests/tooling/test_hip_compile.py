"""Every hip_kernels/*.hip compiles for gfx942 and gfx950 (clang-22, HIP headers from the triton wheel)
and, through hip2cuda, for sm_90a and sm_100a (nvcc): no errors, no s_trap, no spills, hardware fp8
converts in the kernels that write fp8.

The compilers are not Python packages: a target whose compiler is absent skips with the command that
installs it (``bash ci/test.sh`` installs them where it can), never fails."""
import shutil

import pytest

from build_tools import compile_matrix as cm

CLANG_PKGS = "apt-get install clang-22 lld-22 llvm-22"
NVCC_PKGS = ("pip install nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-crt==13.0.88 "
             "nvidia-cuda-cccl==13.0.85 nvidia-nvvm==13.0.88")


def missing_tool(target):
    """Why this target cannot be compiled here (one line with the install command), or None."""
    if cm.TARGETS[target][0] == "hip":
        if shutil.which("clang++-22") is None:
            return f"clang++-22 not found, needed for {target}: {CLANG_PKGS} (bash ci/test.sh does, as root)"
        if shutil.which("llvm-as-22") is None and shutil.which("llvm-as") is None:
            return f"llvm-as-22 not found, needed for {target}: {CLANG_PKGS} (bash ci/test.sh does, as root)"
        return None
    if cm.find_nvcc() is None:
        return f"nvcc not found, needed for {target}: {NVCC_PKGS} (bash ci/test.sh does)"
    if shutil.which("g++") is None:
        return f"g++ (nvcc's host compiler) not found, needed for {target}: apt-get install g++"
    return None


@pytest.mark.parametrize("target", sorted(cm.TARGETS))
@pytest.mark.parametrize("source", cm.hip_sources())
def test_hip_kernel_compiles_clean(source, target, compile_matrix):
    why = missing_tool(target)
    if why:
        pytest.skip(why)
    row = compile_matrix.row(source, target)
    print(row)
    assert row["problems"] == []


def test_missing_compiler_skips_with_install_command(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(cm, "pip_nvcc", lambda: None)
    for target in cm.TARGETS:
        why = missing_tool(target)
        assert why and "\n" not in why and "install" in why and target in why
    assert "clang++-22" in missing_tool("gfx942") and "nvcc" in missing_tool("sm_90a")
