"""Programmatic dependent launch (PDL) between the kernels of a step, on NVIDIA Hopper and Blackwell.

A kernel launched with PDL may start while the kernel before it on the stream is still running: its
launch, its CTAs' placement and whatever it does before ``griddepcontrol.wait`` overlap the previous
kernel's tail. ``pdl_start(PDL)`` is the first statement of every kernel that takes a ``PDL`` constexpr:
it waits until the previous kernel has finished and its writes are visible (``gdc_wait``), so nothing of
the kernel reads an input early, then lets the next kernel of the stream start launching
(``gdc_launch_dependents``). A kernel that waits first is correct behind any kernel, with or without PDL:
the wait is on the previous grid's completion, and that grid, if it was launched with PDL, waited for its
own predecessor before it could finish, so the order of the whole chain holds.

Launches (``_launch.Kernel``) pass ``PDL=True`` and the launch option ``launch_pdl=True`` to such kernels on
CUDA devices of compute capability 9 or newer, where the launch attribute and the instruction exist;
CUDA graphs keep the programmatic edges when a step is captured. AMD has no counterpart the Triton HIP
backend exposes: there ``PDL`` stays False and the kernels compile without the two instructions.
"""
import contextlib

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """Wait for the previous kernel of the stream (its writes visible), then release the next one."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


_ENABLED = True
_SUPPORTED = None          # whether this process's GPU takes PDL launches, found on first use


def supported() -> bool:
    """CUDA (not HIP) device 0 of compute capability >= 9; PDL launches not switched off by ``disabled``."""
    global _SUPPORTED
    if _SUPPORTED is None:
        import torch
        _SUPPORTED = bool(torch.cuda.is_available() and torch.version.hip is None
                          and torch.cuda.get_device_capability()[0] >= 9)
    return _SUPPORTED and _ENABLED


@contextlib.contextmanager
def disabled():
    """Launch without PDL inside the block (benchmarks time a step both ways; the kernels are the same
    sources compiled with ``PDL=False``)."""
    global _ENABLED
    prev, _ENABLED = _ENABLED, False
    try:
        yield
    finally:
        _ENABLED = prev
