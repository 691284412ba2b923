"""Build entry. The HIP extension dsv4_rocm._C is compiled only where the torch that pip's build sees is a
GPU build: ROCm torch -> hipcc on hip_kernels/*.hip; CUDA torch -> hip2cuda then nvcc
(build_tools/extension.py). That needs ``pip install --no-deps --no-build-isolation -e .`` with the GPU torch
already installed (an isolated build environment has no torch). Anything else (a CPU torch, no torch) is a
pure-Python install, and the build prints one line saying why the extension was skipped (pip shows a
build's output with -v); on a GPU machine the extension is then built on first use from the source
checkout, and ``python -m dsv4_rocm info`` says which of these holds."""
import os
import sys

from setuptools import setup

# build_tools/ sits beside this file; the PEP 517 backend does not put this directory on sys.path
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from build_tools import extension as ext  # noqa: E402

ext_modules, cmdclass = [], {}
skipped = ext.skip_reason()
if skipped is None:
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension
    # paths relative to this directory: setuptools refuses absolute ones
    ext_modules = [CUDAExtension("dsv4_rocm._C", **ext.setup_extension_kwargs())]
    cmdclass = {"build_ext": BuildExtension}
elif not {"egg_info", "dist_info"} & set(sys.argv[1:]):      # once per install, not in the metadata step
    print(f"dsv4_rocm: HIP extension dsv4_rocm._C skipped: {skipped}; the reference and Triton backends need "
          "none (python -m dsv4_rocm info)", file=sys.stderr)

setup(ext_modules=ext_modules, cmdclass=cmdclass)
