"""The direct launch (dsv4_rocm/triton/_launch.py ``Kernel``) picks exactly the compiled kernel Triton's own
launcher picks, for random arguments of every kind, on an NVIDIA and an AMD target; it steps aside where
Triton's launcher must run (hooks, debug, keyword tensors, switch off), and on every Triton but 3.6, whose
launcher internals its key copies: there each launch is Triton's own (the test of that runs on every Triton).

No GPU is needed: ``bench.host.simulated_gpu`` gives Triton a stand-in driver and compiles nothing, so
Triton's binder and cache key run as on a GPU and each distinct key gets its own stand-in kernel."""
import random

import pytest
import torch
import triton
import triton.language as tl

from dsv4_rocm.bench.host import _NullKernel, simulated_gpu
from dsv4_rocm.triton import _launch
from dsv4_rocm.triton._compat import TRITON_VERSION
from dsv4_rocm.triton._launch import Kernel, launch

needs_36 = pytest.mark.skipif(not _launch._TRITON_SUPPORTED,
                              reason=f"the direct launch is written for Triton 3.6; Triton {triton.__version__} "
                                     "launches through its own launcher (test_other_tritons_launch_through_triton)")


@triton.jit(do_not_specialize=["n_dns"], do_not_specialize_on_alignment=["p_dnsa", "n_dnsa"])
def _probe_kernel(p, p_dnsa, n, n_dns, n_dnsa, x, flag, opt, C: tl.constexpr, D: tl.constexpr = 3):
    pass


try:                 # Gluon (Triton >= 3.6): its kernels launch through JITFunction.run too
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    @gluon.jit(do_not_specialize=["n_dns"], do_not_specialize_on_alignment=["p_dnsa", "n_dnsa"])
    def _probe_gluon(p, p_dnsa, n, n_dns, n_dnsa, x, flag, opt, C: gl.constexpr, D: gl.constexpr = 3,
                     num_warps: gl.constexpr = 4):
        pass
except ImportError:
    _probe_gluon = None


INTS = [0, 1, 2, 15, 16, 17, 32, 48, -1, -16, -17, 2 ** 31 - 16, 2 ** 31 - 1, 2 ** 31, 2 ** 31 + 16, -2 ** 31,
        -2 ** 31 - 1, -2 ** 31 - 16, 2 ** 63 - 1, 2 ** 63, 2 ** 63 + 16, 2 ** 64 - 16, 2 ** 64 - 1, -2 ** 63]
DTYPES = [torch.bfloat16, torch.float32, torch.uint8, torch.int32, torch.float8_e4m3fn]


def _tensor(rng, big):
    """A 64-byte tensor of a random dtype at a random byte offset (16-byte aligned or not) of its storage."""
    dt = rng.choice(DTYPES)
    base = big if big is not None and rng.random() < 0.2 else torch.empty(512, dtype=torch.uint8)
    off = rng.choice([0, 4, 8, 16, 32, 48]) if dt.itemsize > 1 else rng.choice([0, 1, 2, 16, 17, 32])
    return base[off:off + 64].view(dt)


def _value(rng, kind, big):
    if kind == "tensor":
        return _tensor(rng, big)
    if kind == "int":
        return rng.choice(INTS)
    return rng.choice({"float": [0.5, 1.0, -3.0], "bool": [True, False], "none": [None]}[kind])


def _args(rng, layout, big):
    return tuple(_value(rng, kind, big) for kind in layout)


# kinds of the 8 runtime arguments: the values vary within a layout, so keys collide unless they capture
# every specialization
LAYOUTS = [("tensor", "tensor", "int", "int", "int", "float", "bool", "none"),
           ("tensor", "tensor", "int", "int", "int", "tensor", "int", "tensor"),
           ("int", "int", "tensor", "tensor", "tensor", "int", "float", "int")]


def _launched(fn):
    """The stand-in kernels of fn on the simulated device, with their launch counts."""
    return {id(k): (k, k.launches) for k in fn.device_caches[0][0].values()}


def _which(before, after):
    moved = [k for i, (k, n) in after.items() if n != before.get(i, (None, 0))[1]]
    assert len(moved) == 1, f"{len(moved)} kernels launched"
    return moved[0]


@needs_36
@pytest.mark.parametrize("backend,kernel", [("cuda", "triton"), ("hip", "triton"), ("cuda", "gluon")])
def test_direct_launch_picks_tritons_kernel(backend, kernel):
    if kernel == "gluon" and _probe_gluon is None:
        pytest.skip("this Triton has no Gluon")
    probe = _probe_kernel if kernel == "triton" else _probe_gluon
    rng = random.Random(0)
    big = None
    if backend == "hip":        # a storage past 2 GB: AMD's buffer-op specialization differs (virtual memory only)
        big = torch.empty(2 ** 31 + 4096, dtype=torch.uint8)
    from triton.runtime.jit import JITFunction
    run = JITFunction.run
    launches = []

    def counting(self, *a, **kw):
        launches.append(kw.get("warmup"))
        return run(self, *a, **kw)
    with simulated_gpu(backend):
        JITFunction.run = counting
        try:
            k = Kernel(probe)
            pool = [_args(rng, rng.choice(LAYOUTS), big) for _ in range(60)]
            consts = [dict(C=1), dict(C=2, num_warps=8), dict(C=1, D=4, num_stages=2)]
            n = 3000
            for i in range(n):
                args = rng.choice(pool) if rng.random() < 0.5 else _args(rng, rng.choice(LAYOUTS), big)
                kw = rng.choice(consts)
                tritons = probe.run(*args, grid=(1,), warmup=True, **kw)      # Triton's pick
                before = _launched(probe)
                k[(2, 1)](*args, **kw)
                assert _which(before, _launched(probe)) is tritons, (args, kw)
        finally:
            JITFunction.run = run
        assert isinstance(tritons, _NullKernel)
        through_triton = launches.count(False)
        assert n - through_triton > n // 4        # a good part of the launches were direct
        assert len({id(v) for v in probe.device_caches[0][0].values()}) > 20   # many distinct kernels


@needs_36
def test_direct_launch_steps_aside():
    """Hooks, TRITON_DEBUG, a tensor passed as a keyword or the switch off: Triton's launcher every time."""
    from triton import knobs
    from triton.runtime.jit import JITFunction
    calls = []
    run = JITFunction.run

    def counting(self, *a, **kw):
        calls.append(kw.get("warmup"))
        return run(self, *a, **kw)
    t = torch.empty(64, dtype=torch.float32)
    args = (t, t, 16, 3, 5, 1.0, True, None)
    with simulated_gpu("cuda"):
        JITFunction.run = counting
        try:
            k = launch(_probe_kernel)
            k[(1,)](*args, C=1)
            k[(1,)](*args, C=1)
            assert len(calls) == 1                      # the second launch is direct
            hook = lambda *a: None  # noqa: E731
            knobs.runtime.launch_enter_hook.add(hook)
            try:
                k[(1,)](*args, C=1)
            finally:
                knobs.runtime.launch_enter_hook.remove(hook)
            assert len(calls) == 2
            knobs.runtime.debug = True
            try:
                k[(1,)](*args, C=1)
            finally:
                knobs.runtime.debug = False
            assert len(calls) == 3
            with _launch.set_fast_launch(False):
                k[(1,)](*args, C=1)
            assert len(calls) == 4
            k[(1,)](*args[:-1], C=1, opt=None)              # a runtime argument as a keyword
            assert len(calls) == 5
            k[(1,)](*args, C=1)
            assert len(calls) == 5                           # direct again
        finally:
            JITFunction.run = run


@needs_36
def test_forget_kernels():
    t = torch.empty(64, dtype=torch.float32)
    with simulated_gpu("cuda"):
        k = launch(_probe_kernel)
        k[(1,)](t, t, 16, 3, 5, 1.0, True, None, C=1)
        assert any(v.kernels for v in k._variants.values())
    assert not k._variants                                   # leaving the simulation forgets its kernels


def test_direct_launch_is_on_for_triton_36_only():
    assert _launch._TRITON_SUPPORTED == (TRITON_VERSION == (3, 6))
    assert Kernel(_probe_kernel).supported == (TRITON_VERSION == (3, 6))


@pytest.mark.parametrize("backend", ["cuda", "hip"])
def test_other_tritons_launch_through_triton(backend, monkeypatch):
    """On a Triton other than 3.6 (this one, or 3.6 told it is another) every launch is Triton's own and runs
    the kernel Triton's launcher picks."""
    if _launch._TRITON_SUPPORTED:
        monkeypatch.setattr(_launch, "_TRITON_SUPPORTED", False)
    from triton.runtime.jit import JITFunction
    run = JITFunction.run
    calls = []

    def counting(self, *a, **kw):
        calls.append(kw.get("warmup"))
        return run(self, *a, **kw)
    rng = random.Random(1)
    with simulated_gpu(backend):
        JITFunction.run = counting
        try:
            k = Kernel(_probe_kernel)          # not launch(): that keeps the Kernel made before the patch
            assert not k.supported
            for i in range(40):
                args = _args(rng, rng.choice(LAYOUTS), None)
                tritons = _probe_kernel.run(*args, grid=(1,), warmup=True, C=1)
                before = _launched(_probe_kernel)
                k[(1,)](*args, C=1)
                assert _which(before, _launched(_probe_kernel)) is tritons
                k.bind(C=1)[(1,)](*args)
                assert _which(before, _launched(_probe_kernel)) is tritons
        finally:
            JITFunction.run = run
    assert calls.count(False) == 80 and calls.count(True) == 40       # every launch through Triton's run
