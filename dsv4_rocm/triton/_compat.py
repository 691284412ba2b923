"""What differs between the Tritons this package supports, in one place.

Supported: Triton 3.6 (torch 2.11, and CI's CPU torch 2.13; the GPU machines' compiler, whose code generation
every measured number in BENCHMARKS.md comes from), 3.7 (torch 2.12 and 2.13), 3.8 (torch 2.14, vLLM
0.33.0's) and 3.9 (torch 2.15).
Kernels keep one source; the differences are:

* Gluon names: the CTA barrier is ``gl.thread_barrier()`` up to 3.7 and ``gl.barrier()`` from 3.8 (with
  ``cluster=False``, its default, both emit the same ``debug_barrier``). Kernels call ``thread_barrier``
  from here.
* The Hopper warp-specialized kernel (``sparse_mla_decode_ws.py``) compiles under 3.6 to 3.8 (168
  registers a thread, no spills, for sm_90a) but not under 3.9, whose ``gl.warp_specialize`` rejects its
  partitions at compile time: ``GLUON_WS`` is False there and Hopper runs the Triton kernel (decode and
  prefill), as it does on every Triton without Gluon.
* Tile and warp choices: a newer compiler allocates registers differently, and a configuration that is
  spill-free under 3.6 can spill under 3.8 or 3.9. ``by_triton(table)`` picks a kernel's entry for the
  running Triton from a table keyed by the oldest version it applies to; 3.6's entry is the one measured
  on the GPUs and stays as it is.
"""
import triton

TRITON_VERSION = tuple(int(p) for p in triton.__version__.split("+")[0].split(".")[:2])


GLUON_WS = TRITON_VERSION < (3, 9)


def by_triton(table: dict, version: tuple = None):
    """The entry of ``table`` ({(major, minor): value}) for ``version`` (default: the running Triton): the one
    with the newest key not newer than it (the oldest key when the version predates every key)."""
    version = version or TRITON_VERSION
    keys = sorted(table)
    chosen = keys[0]
    for k in keys:
        if k <= version:
            chosen = k
    return table[chosen]


try:
    from triton.experimental.gluon import language as _gl
except ImportError:        # a Triton without Gluon: the Gluon kernels are not offered (their modules say so)
    _gl = None

if _gl is not None:
    thread_barrier = getattr(_gl, "thread_barrier", None) or _gl.barrier
