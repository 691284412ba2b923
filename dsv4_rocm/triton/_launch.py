"""What the kernel launchers keep between calls, so a launch costs no device query and no allocation
beyond its outputs (a serving engine calls the attention launchers once per layer per step), and how
``@triton.jit`` kernels are launched.

* ``cdiv``, ``next_power_of_2``: host-side ``triton.cdiv`` / ``triton.next_power_of_2`` without their
  per-call overhead.
* ``device_facts(device)``: (arch, reads the cache as fnuz, SM / CU count, has fp8 matrix instructions)
  per device, queried once.
* ``scratch(device, numel)``: an fp32 buffer of at least ``numel`` elements for split partials, one per
  (device, stream) (``dsv4_rocm.workspace.buffer``). It only grows; a buffer it replaces is kept alive,
  because a captured CUDA/HIP graph may still hold its address (a graph does not own the memory its
  kernels touch). Calls on one stream run in order, so one buffer per stream is never used by two calls
  at once.
* ``counters(device, n)``: an int32 buffer of at least ``n`` zeros, kept the same way: kernels that count
  arrivals in it leave every entry at 0 when they finish.
* ``launch(fn)``: the ``Kernel`` of a ``@triton.jit`` function, launched as ``launch(fn)[grid](*args,
  **constexprs)`` or, with the constexprs fixed, ``launch(fn).bind(**constexprs)[grid](*args)``: Triton's own
  launch (``fn[grid](...)``), recorded inside ``record_launches``, its first compile in ``kernel_cache``;
  a kernel that takes a ``PDL`` constexpr gets ``PDL=True`` and ``launch_pdl=True`` on GPUs with programmatic
  dependent launch (``_pdl.py``).
* ``kernel_cache()``: where dsv4_rocm's compiled kernels persist between processes, and the context in which
  its compiles run (below).

Kernel cache. Triton keeps compiled kernels in its own directory (``TRITON_CACHE_DIR``, default
``~/.triton/cache``), which serving deployments often point at a per-process or temporary directory, so
every new process compiles again. dsv4_rocm's compiles (``flash_mla.warmup`` and the first launch of each
variant through ``launch``: its constexprs, launch options and number of arguments) run with Triton's cache
directory set to ``DSV4_KERNEL_CACHE`` when set, else ``$XDG_CACHE_HOME/dsv4_rocm/triton``
(``~/.cache/dsv4_rocm/triton``), so a second process on the machine loads them instead of compiling;
Triton's own setting is restored afterwards and applies to every other kernel (and to a later compile of a
variant for arguments Triton specializes differently). ``DSV4_KERNEL_CACHE=triton`` keeps Triton's directory
for ours too. The kernels are Triton's own cache entries (keyed by source, options and target), so a changed
kernel or Triton misses and recompiles.

CPU tensors (the Triton interpreter, ``TRITON_INTERPRET=1``) get arch "cpu", no fnuz and one "SM", except
inside ``emulate_target(arch)``: there they get the facts of that target (gfx942, gfx950, sm_90, sm_100), so
every launcher picks the constexprs, tiles and launch options that target's GPU would get, and the
interpreter runs that target's branches (the AMD execution tier, docs/platforms.md#amd-tier; the fp8
instructions those branches use run as the bit-exact models of ``_fp8.py``). Launchers that cache per
device use ``device_cache``, which ``emulate_target`` empties on entry and exit. ``record_launches()`` lists
the constexprs and launch options of each interpreted launch, for tests that say which branches they ran.

Launches go through Triton's own launcher, which picks the compiled kernel for the arguments' specialization
(alignment, int sizes, AMD's buffer-op range) on every call. A launcher of our own that skipped it would have
to restate those rules, which are Triton's internals and no public interface (docs/platforms.md#launches);
the host time of a launch is met instead by capturing steps into CUDA/HIP graphs and by fusing launches.
"""
import contextlib
import functools
import os

import torch

from typing import NamedTuple

from ..platform import detect, target
from . import _pdl
from ..workspace import _BUFFERS as _SCRATCH, buffer  # noqa: F401  (_SCRATCH: tests read the counters)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host ints (``triton.cdiv`` costs a microsecond a call on the host)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), for host ints."""
    return 1 << (n - 1).bit_length()


class Emulated(NamedTuple):
    """What ``device_facts`` gives CPU tensors inside ``emulate_target``."""
    arch: str
    fnuz: bool
    sm_count: int
    fp8_mma: bool


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _facts(device_type: str, index: int):
    if device_type == "cpu":
        return "cpu", False, 1, True
    dev = torch.device(device_type, index)
    plat = detect(dev)
    return plat.arch, plat.fp8_decode == "fnuz_scale_plus_one", \
        torch.cuda.get_device_properties(dev).multi_processor_count, plat.has_fp8_mma


def device_facts(device: torch.device):
    """(arch, fnuz, sm_count, has fp8 matrix instructions) of ``device``, cached; CPU tensors get the target of
    ``emulate_target`` when one is set."""
    if device.type == "cpu":
        return _EMULATED or _facts("cpu", 0)
    return _facts(device.type, device_index(device))


# ---- the emulated target of CPU tensors (the AMD execution tier) ---------------------------------------
# compute units of the parts each target is sold as (MI300X, MI355X, H100 SXM, B200): split counts follow them
EMULATED_SM_COUNT = {"gfx942": 304, "gfx950": 256, "sm_90": 132, "sm_100": 148}
_EMULATED = None            # device_facts of CPU tensors inside emulate_target, else None
_DEVICE_CACHES = []         # the caches of device_cache, emptied when the emulated target changes
_RECORD = None              # the list record_launches appends to, else None


def device_cache(maxsize=None):
    """``functools.lru_cache`` for a function of a device (its facts, a launch plan): ``emulate_target``
    empties it, since what a CPU device launches as changes with the emulated target."""
    def wrap(fn):
        cached = functools.lru_cache(maxsize=maxsize)(fn)
        _DEVICE_CACHES.append(cached)
        return cached
    return wrap


def _set_emulated(facts):
    global _EMULATED
    _EMULATED = facts
    for c in _DEVICE_CACHES:
        c.cache_clear()


@contextlib.contextmanager
def emulate_target(arch: str, sm_count: int = None):
    """Launch kernels on CPU tensors (the Triton interpreter) as ``arch`` would launch them on its GPU: its
    fp8 reading (gfx942: fnuz), tile configuration, launch options and SM / CU count (``sm_count``
    overrides ``EMULATED_SM_COUNT``). A test-facing switch of the launch plumbing, not of the math: the
    kernels run their own code for that target. The interpreter ignores the launch options (num_warps,
    num_stages, kpack, matrix_instr_nonkdim, waves_per_eu, maxnreg): the compile matrix checks those."""
    plat = target(arch)
    prev = _EMULATED
    _set_emulated(Emulated(plat.arch, plat.fp8_decode == "fnuz_scale_plus_one",
                           EMULATED_SM_COUNT[arch] if sm_count is None else int(sm_count), plat.has_fp8_mma))
    try:
        yield plat
    finally:
        _set_emulated(prev)


def emulated_target():
    """The ``Emulated`` facts of ``emulate_target`` in force, or None."""
    return _EMULATED


@contextlib.contextmanager
def record_launches():
    """Collect (kernel name, constexprs and launch options) of every launch through ``launch`` inside the
    block."""
    global _RECORD
    prev, _RECORD = _RECORD, []
    try:
        yield _RECORD
    finally:
        _RECORD = prev


def scratch(device: torch.device, numel: int) -> torch.Tensor:
    """A 1-D fp32 buffer of at least ``numel`` elements, reused by every call on this device and stream."""
    return buffer("scratch", device, numel, torch.float32)


def counters(device: torch.device, numel: int) -> torch.Tensor:
    """A 1-D int32 buffer of at least ``numel`` entries, zeroed when allocated; its users leave it zeroed."""
    return buffer("counters", device, numel, torch.int32, zero=True)


# ---- kernel cache ----------------------------------------------------------------------------------------
def kernel_cache_dir():
    """The directory dsv4_rocm's compiled kernels persist in (module docstring), or None for Triton's own."""
    d = os.environ.get("DSV4_KERNEL_CACHE")
    if d == "triton":
        return None
    if d:
        return d
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dsv4_rocm", "triton")


@contextlib.contextmanager
def kernel_cache(path=None):
    """Compiles inside the block read and write ``path`` (default ``kernel_cache_dir()``) as Triton's cache
    directory; Triton's setting is restored on exit. Yields the directory (None: Triton's own)."""
    path = path if path is not None else kernel_cache_dir()
    knobs = _knobs
    if path is None or knobs is None or not hasattr(knobs, "cache"):
        yield None
        return
    prev = knobs.cache.dir
    knobs.cache.dir = path
    try:
        yield path
    finally:
        knobs.cache.dir = prev


# ---- launches ------------------------------------------------------------------------------------------
class Kernel:
    """``kernel[grid](*args, **constexprs)`` for a ``@triton.jit`` function: Triton's launch, recorded inside
    ``record_launches``; the first launch of each variant compiles inside ``kernel_cache``."""
    __slots__ = ("fn", "_compiles", "_seen", "_pdl")

    def __init__(self, fn):
        self.fn = fn
        self._compiles = _JITFunction is not None and isinstance(fn, _JITFunction)   # not the interpreter's
        self._seen = set()             # variants launched: (number of arguments, constexprs and options)
        # kernels with a PDL constexpr start with _pdl.pdl_start: launched with PDL where the GPU has it
        self._pdl = self._compiles and "PDL" in getattr(fn, "arg_names", ())

    def __getitem__(self, grid):
        return functools.partial(self.launch, grid)

    def launch(self, grid, *args, **consts):
        return self._launch(grid, args, consts, (len(args), *consts.items()))

    def bind(self, **consts) -> "BoundKernel":
        """This kernel with its constexprs and launch options fixed: ``bound[grid](*args)``."""
        return BoundKernel(self, consts)

    def warmup(self, *args, grid, **kwargs):
        """Compile without launching (``flash_mla.warmup`` runs these inside its own ``kernel_cache``)."""
        if self._pdl and _pdl.supported():
            kwargs = dict(kwargs, PDL=True, launch_pdl=True)
        return self.fn.warmup(*args, grid=grid, **kwargs)

    def _launch(self, grid, args, consts, variant):
        if _RECORD is not None:
            _RECORD.append((self.fn.__name__, dict(consts)))
        if self._pdl and _pdl.supported():
            consts = dict(consts, PDL=True, launch_pdl=True)
            variant = variant + (("PDL", True),)
        if self._compiles:
            try:
                first = variant not in self._seen
            except TypeError:          # an unhashable keyword value: not kept
                first = False
            if first:
                with kernel_cache():
                    kernel = self.fn[grid](*args, **consts)
                self._seen.add(variant)
                return kernel
        return self.fn[grid](*args, **consts)


class BoundKernel:
    """``Kernel.bind(**consts)``: ``bound[grid](*args)`` launches with those constexprs and options."""
    __slots__ = ("kernel", "consts", "_items")

    def __init__(self, kernel: Kernel, consts: dict):
        self.kernel, self.consts, self._items = kernel, consts, tuple(consts.items())

    def __getitem__(self, grid):
        return functools.partial(self.launch, grid)

    def launch(self, grid, *args):
        return self.kernel._launch(grid, args, self.consts, (len(args), *self._items))

    def warmup(self, *args, grid):
        return self.kernel.warmup(*args, grid=grid, **self.consts)


_BY_FN = {}                  # id of a JITFunction -> its Kernel


def launch(fn) -> Kernel:
    """The ``Kernel`` of a ``@triton.jit`` function (one per function): ``launch(fn)[grid](*args, **consts)``."""
    k = _BY_FN.get(id(fn))
    if k is None or k.fn is not fn:
        k = _BY_FN[id(fn)] = Kernel(fn)
    return k


try:
    from triton import knobs as _knobs
except ImportError:            # a Triton without knobs: Triton's cache directory for every compile
    _knobs = None
try:
    from triton.runtime.jit import JITFunction as _JITFunction
except ImportError:
    _JITFunction = None
