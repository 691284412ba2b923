"""Build entry. Pure-Python install everywhere; the HIP extension (dsv4_rocm._C) is added by
build_tools when a GPU torch and kernel sources are present (see DESIGN.md §5)."""
from setuptools import setup

setup()
