"""Backend selection and argument-check policy shared by every public op.

Each op has up to three implementations: ``reference`` (dsv4_rocm.reference, any device), ``triton``
and ``hip`` (dsv4_rocm._C). A stage module registers its ops with ``register``, naming the functions
themselves: it imports its kernels (dsv4_rocm/triton/<stage>/, dsv4_rocm/hip_ops.py), so a reader or a tool
follows an ordinary import from the op to its kernel. Triton is optional: a stage imports its Triton
kernels only where ``HAVE_TRITON`` (importing them imports Triton), and without it registers none.
``implementation`` returns the fastest implementation present for a device: hip > triton > reference. A
kernel that runs only on some devices of its backend says so with ``runs_on`` (the fp8 logits kernels
need fp8 matrix instructions); on the others the op runs its next implementation. This is the one place
where the backend is chosen: the kernels only launch.

``use_backend(name)`` or ``DSV4_BACKEND=reference|triton|hip`` forces a backend; asking for one the
machine lacks (Triton or a GPU missing, _C not built) is an error, never a silent fallback. An op with no
kernel in the forced backend runs its best other implementation. ``DSV4_BACKEND`` is read once, when
dsv4_rocm is imported (an op call reads a module variable, not the environment); ``use_backend`` changes
the backend at run time and takes precedence over it.

Value checks (index ranges, monotone offsets: anything that reads tensor contents) need the values on
the host. ``value_checks(t)`` says whether to run them for a tensor: always for CPU tensors; for GPU
tensors only under ``validation("full")`` (a host sync per call, for debugging) and never while a
graph is being captured. The kernels never read or write outside their tensors whatever the values.
"""
import contextlib
import functools
import importlib.util
import os
import shutil
from typing import Callable, Dict, Optional

import torch

BACKENDS = ("reference", "triton", "hip")
VALIDATION_LEVELS = ("auto", "full")

_REFERENCE: Dict[str, Callable] = {}                  # op name -> oracle function
_KERNELS: Dict[str, Dict[str, Callable]] = {}         # op name -> {backend: kernel function}
_RUNS_ON: Dict[str, Dict[str, Callable]] = {}         # op name -> {backend: predicate of a torch.device}

# whether Triton can be imported here: the stage modules import their Triton kernels only then
HAVE_TRITON = importlib.util.find_spec("triton") is not None

_override: Optional[str] = None
_validation = "auto"


# DSV4_BACKEND as set when dsv4_rocm is imported; its value is checked when an op is resolved, so a bad one is
# an error of the op call, not of the import
_ENV_BACKEND: Optional[str] = os.environ.get("DSV4_BACKEND") or None


def register(op: str, reference: Callable, triton: Optional[Callable] = None, hip: Optional[Callable] = None,
             runs_on: Optional[Dict[str, Callable]] = None) -> None:
    """Declare an op: its reference function and its kernel function per backend (None: no kernel there).
    ``runs_on``: {backend: predicate(torch.device) -> bool} for a kernel that runs on some devices of its
    backend only; on the others the op runs its next implementation."""
    kernels = {b: fn for b, fn in (("triton", triton), ("hip", hip)) if fn is not None}
    for b in runs_on or {}:
        if b not in kernels:
            raise ValueError(f"runs_on names backend {b!r}, which has no kernel for op {op!r}")
    _REFERENCE[op] = reference
    _KERNELS[op] = kernels
    _RUNS_ON[op] = dict(runs_on or {})


def registered_ops() -> tuple:
    return tuple(_REFERENCE)


def _check_backend_name(name):
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose from {BACKENDS}")


@contextlib.contextmanager
def _restore_backend(prev):
    global _override
    try:
        yield
    finally:
        _override = prev


def use_backend(name: Optional[str]):
    """Force a backend (None = automatic). Usable as a plain call or as a context manager."""
    global _override
    if name is not None:
        _check_backend_name(name)
    prev, _override = _override, name
    return _restore_backend(prev)


@contextlib.contextmanager
def _restore_validation(prev):
    global _validation
    try:
        yield
    finally:
        _validation = prev


def validation(level: str):
    """``"auto"`` (default): value checks for CPU tensors only; ``"full"``: for GPU tensors too (each
    check syncs the host). Usable as a plain call or as a context manager."""
    global _validation
    if level not in VALIDATION_LEVELS:
        raise ValueError(f"validation level must be one of {VALIDATION_LEVELS}, got {level!r}")
    prev, _validation = _validation, level
    return _restore_validation(prev)


def value_checks(t: torch.Tensor) -> bool:
    """Whether checks that read the values of ``t`` run now (see the module docstring)."""
    if t.device.type == "cpu":
        return True
    if _validation != "full":
        return False
    return not (t.device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _hip_buildable() -> bool:
    """dsv4_rocm._C is built, or can be built on first use (kernel sources + hipcc/nvcc present)."""
    if importlib.util.find_spec("dsv4_rocm._C") is not None:
        return True
    from .._build import sources_present
    compiler = "hipcc" if torch.version.hip is not None else "nvcc"
    return sources_present() and (torch.version.hip is not None or torch.version.cuda is not None) \
        and shutil.which(compiler) is not None


def machine_backends(device) -> tuple:
    """Backends this machine can run for tensors on ``device`` (cached: ops call this per launch)."""
    return _machine_backends(torch.device(device).type)


@functools.lru_cache(maxsize=None)
def _machine_backends(device_type: str) -> tuple:
    have = ["reference"]
    if device_type == "cuda":
        if HAVE_TRITON:
            have.append("triton")
        if _hip_buildable():
            have.append("hip")
    return tuple(have)


def _runs(op: str, backend: str, device) -> bool:
    """Whether ``op`` has a kernel in ``backend`` that runs on ``device``."""
    if backend not in _KERNELS[op]:
        return False
    runs_on = _RUNS_ON[op].get(backend)
    return runs_on is None or runs_on(torch.device(device))


def backend_for(op: str, device) -> str:
    if op not in _REFERENCE:
        raise ValueError(f"unknown op {op!r}")
    have = machine_backends(device)
    forced = _override or _ENV_BACKEND
    if forced:
        _check_backend_name(forced)
        if forced not in have:
            raise ValueError(f"backend {forced!r} is not available for {torch.device(device)} on this machine "
                             f"(available: {have})")
        if forced == "reference" or _runs(op, forced, device):
            return forced
    for b in ("hip", "triton"):
        if b in have and _runs(op, b, device):
            return b
    return "reference"


_IMPLEMENTATIONS: Dict[tuple, object] = {}   # (op, device, forced backend) -> function


def implementation(op: str, device):
    """The function that runs ``op`` for tensors on ``device``, resolved once per (op, device, forced
    backend): a public op pays a dict lookup. Keyed by the device itself, not its type: whether a kernel
    runs (``runs_on``) can differ between two GPUs of one machine."""
    key = (op, device, _override or _ENV_BACKEND)
    fn = _IMPLEMENTATIONS.get(key)
    if fn is None:
        fn = _IMPLEMENTATIONS[key] = _resolve(op, device)
    return fn


def _resolve(op: str, device):
    b = backend_for(op, device)
    return _REFERENCE[op] if b == "reference" else _KERNELS[op][b]


def forget_implementations() -> None:
    """Resolve every op again on its next call (after the machine's backends changed)."""
    _IMPLEMENTATIONS.clear()


def run(op, device, *args, **kwargs):
    return implementation(op, device)(*args, **kwargs)
