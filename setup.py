"""Build entry (DESIGN.md §5): ROCm torch -> hipcc on hip_kernels/*.hip; CUDA torch -> hip2cuda then nvcc;
no GPU torch -> pure-Python install (the extension can still be built on first use on a GPU machine)."""
import os

from setuptools import setup

ext_modules, cmdclass = [], {}
if os.environ.get("DSV4_NO_EXTENSION") != "1":
    try:
        import torch  # noqa: F401
        from build_tools import extension as ext
        if ext.gpu_torch():
            from torch.utils.cpp_extension import BuildExtension, CUDAExtension
            ext_modules = [CUDAExtension("dsv4_rocm._C", ext.sources(os.path.join("build")),
                                         include_dirs=[ext.INCLUDE],
                                         extra_compile_args={"cxx": ext.CXX_FLAGS,
                                                             "nvcc": ext.extra_cuda_cflags()})]
            cmdclass = {"build_ext": BuildExtension}
    except ImportError:
        pass

setup(ext_modules=ext_modules, cmdclass=cmdclass)
