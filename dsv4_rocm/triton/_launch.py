"""What the kernel launchers keep between calls, so a launch costs no device query and no allocation
beyond its outputs (a serving engine calls the attention launchers once per layer per step), and the
direct launch of compiled kernels.

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
  **constexprs)`` (Triton's ``fn[grid](...)`` form). The first
  launch of a variant goes through Triton's own launcher (binder, cache key, compilation); later
  launches call the compiled kernel Triton picked, directly (below).
* ``kernel_cache()``: where dsv4_rocm's compiled kernels persist between processes, and the context in which
  its compiles run (below).

Kernel cache. Triton keeps compiled kernels in its own directory (``TRITON_CACHE_DIR``, default
``~/.triton/cache``), which serving deployments often point at a per-process or temporary directory, so
every new process compiles again. dsv4_rocm's compiles (``flash_mla.warmup`` and the first launch of each
variant through ``launch``) run with Triton's cache directory set to ``DSV4_KERNEL_CACHE`` when set, else
``$XDG_CACHE_HOME/dsv4_rocm/triton`` (``~/.cache/dsv4_rocm/triton``), so a second process on the machine
loads them instead of compiling; Triton's own setting is restored afterwards and applies to every other
kernel. ``DSV4_KERNEL_CACHE=triton`` keeps Triton's directory for ours too. The kernels are Triton's own
cache entries (keyed by source, options and target), so a changed kernel or Triton misses and recompiles.

CPU tensors (the Triton interpreter, ``TRITON_INTERPRET=1``) get arch "cpu", no fnuz and one "SM", except
inside ``emulate_target(arch)``: there they get the facts of that target (gfx942, gfx950, sm_90, sm_100), so
every launcher picks the constexprs, tiles and launch options that target's GPU would get, and the
interpreter runs that target's branches (the AMD execution tier, docs/platforms.md#amd-tier; the fp8
instructions those branches use run as the bit-exact models of ``_fp8.py``). Launchers that cache per
device use ``device_cache``, which ``emulate_target`` empties on entry and exit. ``record_launches()`` lists
the constexprs and launch options of each interpreted launch, for tests that say which branches they ran.

Direct launch. Triton's ``JITFunction.run`` spends tens of microseconds of Python per launch: it
specializes every argument, builds a cache key from the specialization and the options, checks the
kernel's globals, builds launch metadata and calls the launch hooks. ``Kernel`` keeps, per variant (the
constexprs and launch options of the call) and per key, the compiled kernel of the first launch and then
calls ``CompiledKernel.run`` itself. The key holds everything Triton 3.6 specializes on (``jit.py``
``create_function_from_signature`` and the backends' ``get_*_specialization``), so it picks exactly the
kernel Triton's path would pick (``tests/tooling/test_fast_launch.py`` checks that against Triton's binder):

    the current device; the type of every argument; for a tensor its dtype, whether its address is a
    multiple of 16 (unless do_not_specialize_on_alignment) and on AMD, where buffer ops are on, whether
    its storage fits in 2 GB; for an int its width class (i32 / i64 / u64) and, unless
    do_not_specialize, whether it equals 1 and whether it is a multiple of 16. Floats, bools and None
    specialize on their type only.

Anything else goes through Triton's path every time: a Triton other than 3.6, launch hooks installed,
``TRITON_DEBUG`` or instrumentation on, pre-run hooks, argument types the key does not cover (tuples,
numpy scalars), tensors passed as keywords, an asynchronous compile still running, or the switch off
(``set_fast_launch(False)`` or ``DSV4_FAST_LAUNCH=0``). What is not checked per launch: that the
kernel's module globals keep the values the kernel was compiled with (Triton checks it; ours are
module constants).
"""
import contextlib
import functools
import os
import weakref

import torch
import triton

from typing import NamedTuple

from ..platform import detect, target
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
    """Collect (kernel name, constexprs and launch options) of every launch that goes through Triton's own
    launcher (all of them under the interpreter) inside the block."""
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
    knobs = _knobs if _TRITON_SUPPORTED else None
    if path is None or knobs is None or not hasattr(knobs, "cache"):
        yield None
        return
    prev = knobs.cache.dir
    knobs.cache.dir = path
    try:
        yield path
    finally:
        knobs.cache.dir = prev


# ---- direct launch -------------------------------------------------------------------------------------
_fast = os.environ.get("DSV4_FAST_LAUNCH", "1") != "0"


@contextlib.contextmanager
def _restore_fast(prev):
    global _fast
    try:
        yield
    finally:
        _fast = prev


def set_fast_launch(enabled: bool):
    """Turn the direct launch on or off (Triton's launcher for every launch). Usable as a plain call or as
    a context manager."""
    global _fast
    prev, _fast = _fast, bool(enabled)
    return _restore_fast(prev)


def fast_launch_enabled() -> bool:
    return _fast


try:
    from triton import knobs as _knobs
    from triton.knobs import HookChain as _HookChain
    from triton.runtime.driver import driver as _driver
    from triton.runtime.jit import JITFunction as _JITFunction
    _TRITON_SUPPORTED = triton.__version__.split(".")[:2] == ["3", "6"]
except ImportError:            # another Triton: its own launcher only
    _TRITON_SUPPORTED = False

_PARAM_ATTRS = ("name", "is_constexpr", "do_not_specialize", "do_not_specialize_on_alignment", "annotation_type",
                "default", "has_default")
_I32_MIN, _I32_MAX, _I64_MAX = -2 ** 31, 2 ** 31 - 1, 2 ** 63 - 1


def _supported(fn) -> bool:
    """Whether ``fn`` is a Triton 3.6 JITFunction (or a subclass launched by JITFunction's own ``run``, as
    Gluon's is: only its front end differs) with what the direct launch reads."""
    if not _TRITON_SUPPORTED or not isinstance(fn, _JITFunction) or type(fn).run is not _JITFunction.run:
        return False
    if not all(hasattr(fn, a) for a in ("params", "pre_run_hooks", "run", "warmup")):
        return False
    return all(hasattr(p, a) for p in fn.params for a in _PARAM_ATTRS)


def _hooks_clear() -> bool:
    """No launch hooks, no debug mode, no instrumentation: a launch is the kernel and nothing else."""
    rt = _knobs.runtime
    for h in (rt.launch_enter_hook, rt.launch_exit_hook):
        if h is not None and (type(h) is not _HookChain or h.calls):
            return False
    return not rt.debug and not _knobs.compilation.instrumentation_mode


def _wide(v: int):
    """Width class of an int outside int32 (Triton passes it as i64 or u64)."""
    return "i64" if v <= _I64_MAX else "u64"


def _within_2gb(t: torch.Tensor) -> bool:
    """AMD's buffer-op specialization: the tensor's storage spans at most 2**31 - 1 bytes."""
    return t.untyped_storage().size() <= _I32_MAX


def _key_function(params, types, hip: bool):
    """A function (dev, *args) -> key for arguments of these ``types``, or None if one is not covered."""
    parts = ["dev"]
    for i, (p, tp) in enumerate(zip(params, types)):
        a = f"a{i}"
        if p.is_constexpr:
            parts.append(a)
        elif p.annotation_type:
            return None
        elif issubclass(tp, torch.Tensor):
            parts.append(f"{a}.dtype")
            if not p.do_not_specialize:
                if not p.do_not_specialize_on_alignment:
                    parts.append(f"not {a}.data_ptr() & 15")
                if hip:
                    parts.append(f"_within_2gb({a})")
        elif tp is int:
            if p.do_not_specialize:
                parts.append(f"({_I32_MIN} <= {a} <= {_I32_MAX} or _wide({a}))")
            else:
                div = f"(not {a} & 15)" if not p.do_not_specialize_on_alignment else "0"
                parts.append(f"({div} + 2 * ({a} == 1) if {_I32_MIN} <= {a} <= {_I32_MAX} else "
                             f"(_wide({a}), {div}))")
        elif tp not in (float, bool, type(None)):
            return None
    args = ", ".join(f"a{i}" for i in range(len(types)))
    src = f"def key(dev, {args}):\n    return ({', '.join(parts)},)\n"
    scope = {"_wide": _wide, "_within_2gb": _within_2gb}
    exec(src, scope)
    return scope["key"]


class _Variant:
    """One set of constexprs / launch options and positional-argument count of a kernel: the constexpr
    values Triton passes after the positional arguments, the key functions by argument types, and the
    compiled kernels by key."""
    __slots__ = ("tail", "params", "key_fns", "kernels")

    def __init__(self, fn, nargs, consts):
        self.params = fn.params[:nargs]
        tail = []
        for p in fn.params[nargs:]:
            if p.name in consts:
                tail.append(consts[p.name])
            elif p.has_default:
                tail.append(p.default)
            else:
                raise TypeError(f"{fn.__name__}: missing argument {p.name!r}")
        self.tail = tuple(tail)
        self.key_fns = {}
        self.kernels = {}


class Kernel:
    """``kernel[grid](*args, **constexprs)`` for a ``@triton.jit`` function, with the direct launch described
    in the module docstring. Runtime arguments are positional, constexprs and launch options keywords."""

    def __init__(self, fn):
        self.fn = fn
        self.supported = _supported(fn)
        self._variants = {}
        self._runtime = frozenset(p.name for p in fn.params if not p.is_constexpr) if self.supported else ()
        _ALL.add(self)

    def __getitem__(self, grid):
        return functools.partial(self.launch, grid)

    def warmup(self, *args, grid, **kwargs):
        return self.fn.warmup(*args, grid=grid, **kwargs)

    def launch(self, grid, *args, **consts):
        if not (_fast and self.supported):
            return self._triton_launch(grid, args, consts)
        vkey = (len(args), *consts.items())
        try:
            var = self._variants.get(vkey)
        except TypeError:                         # an unhashable keyword value
            return self.fn[grid](*args, **consts)
        if var is None:
            var = self._new_variant(vkey, args, consts)
        return self._run(var, grid, args, consts)

    def _triton_launch(self, grid, args, consts):
        """Triton's own launcher (the interpreter's, for CPU tensors), recorded inside ``record_launches``."""
        if _RECORD is not None:
            _RECORD.append((self.fn.__name__, dict(consts)))
        return self.fn[grid](*args, **consts)

    def bind(self, **consts) -> "BoundKernel":
        """This kernel with its constexprs and launch options fixed: ``bound[grid](*args)`` skips looking the
        variant up by its keywords (for launchers that cache their constexprs)."""
        return BoundKernel(self, consts)

    def _run(self, var, grid, args, consts):
        if var is None or type(grid) is not tuple or self.fn.pre_run_hooks or not _hooks_clear():
            return self.fn[grid](*args, **consts)
        drv = _driver.active
        dev = drv.get_current_device()
        types = tuple(map(type, args))
        hip = _is_hip(drv)
        tkey = (types, bool(_knobs.amd.use_buffer_ops)) if hip else types   # AMD: a switch read per launch
        kf = var.key_fns.get(tkey, _MISSING)
        if kf is _MISSING:
            kf = var.key_fns[tkey] = _key_function(var.params, types, hip and tkey[1])
        if kf is None:
            return self.fn[grid](*args, **consts)
        key = kf(dev, *args)
        k = var.kernels.get(key)
        if k is None:
            with kernel_cache():           # compiled once per process; persisted for the next one
                kernel = self.fn.run(*args, grid=grid, warmup=False, **consts)
            if kernel is not None and all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata")) \
                    and kernel.function is not None:
                var.kernels[key] = (kernel.run, kernel.function, kernel.packed_metadata)
            return kernel
        run, function, meta = k
        n = len(grid)
        run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, drv.get_current_stream(dev), function, meta,
            None, None, None, *args, *var.tail)

    def _new_variant(self, vkey, args, consts):
        if any(name in self._runtime for name in consts) or len(args) > len(self.fn.params):
            return None                       # a runtime argument passed as a keyword: Triton's path
        var = self._variants[vkey] = _Variant(self.fn, len(args), consts)
        return var

    def clear(self):
        """Forget the kept kernels (the next launch of each variant goes through Triton's path again)."""
        for var in self._variants.values():
            var.kernels.clear()
            var.key_fns.clear()
        self._variants.clear()


class BoundKernel:
    """``Kernel.bind(**consts)``: ``bound[grid](*args)`` launches with those constexprs and options."""
    __slots__ = ("kernel", "consts", "_vars")

    def __init__(self, kernel: Kernel, consts: dict):
        self.kernel, self.consts, self._vars = kernel, consts, {}

    def __getitem__(self, grid):
        return functools.partial(self.launch, grid)

    def launch(self, grid, *args):
        k = self.kernel
        if not (_fast and k.supported):
            return k._triton_launch(grid, args, self.consts)
        var = self._vars.get(len(args))
        if var is None:           # a variant outlives Kernel.clear (its kernels are emptied): kept for good
            try:
                vkey = (len(args), *self.consts.items())
                var = k._variants.get(vkey) or k._new_variant(vkey, args, self.consts)
            except TypeError:     # an unhashable keyword value
                var = None
            if var is not None:
                self._vars[len(args)] = var
        return k._run(var, grid, args, self.consts)

    def warmup(self, *args, grid):
        return self.kernel.fn.warmup(*args, grid=grid, **self.consts)


_MISSING = object()
_ALL = weakref.WeakSet()     # every Kernel, for forget_kernels
_BY_FN = {}                  # id of a JITFunction -> its Kernel


def launch(fn) -> Kernel:
    """The ``Kernel`` of a ``@triton.jit`` function (one per function): ``launch(fn)[grid](*args, **consts)``."""
    k = _BY_FN.get(id(fn))
    if k is None or k.fn is not fn:
        k = _BY_FN[id(fn)] = Kernel(fn)
    return k


def forget_kernels() -> None:
    """Every ``Kernel`` forgets its kept kernels (after Triton's driver or caches changed)."""
    for k in list(_ALL):
        k.clear()
    _HIP.clear()


_HIP = {}           # driver -> whether its target is AMD's


def _is_hip(drv) -> bool:
    hip = _HIP.get(drv)
    if hip is None:
        hip = _HIP[drv] = drv.get_current_target().backend == "hip"
    return hip
