"""Launches through dsv4_rocm/triton/_launch.py (``launch(fn)[grid](...)``, ``launch(fn).bind(...)[grid](...)``)
are Triton's own: on every Triton, each one goes through ``JITFunction.run`` and runs the compiled kernel
Triton's launcher picks for its arguments; the first launch of a variant compiles with Triton's cache
directory set to dsv4_rocm's kernel cache, and Triton's setting is back afterwards; ``record_launches`` sees
every launch. (dsv4_rocm once kept a launcher of its own; _launch.py's docstring says why it has none.)

No GPU is needed for most: ``bench.host.simulated_gpu`` gives Triton a stand-in driver and compiles nothing,
so Triton's binder and cache key run as on a GPU and each distinct key gets its own stand-in kernel. The
test marked gpu compiles and runs a kernel on the device."""
import random

import pytest
import torch
import triton
import triton.language as tl

from dsv4_rocm.bench.host import simulated_gpu
from dsv4_rocm.triton import _launch
from dsv4_rocm.triton._launch import Kernel, launch


@triton.jit(do_not_specialize=["n_dns"], do_not_specialize_on_alignment=["p_dnsa", "n_dnsa"])
def _probe_kernel(p, p_dnsa, n, n_dns, n_dnsa, x, flag, opt, C: tl.constexpr, D: tl.constexpr = 3):
    pass


INTS = [0, 1, 2, 15, 16, 17, 32, -1, -16, 2 ** 31 - 16, 2 ** 31, -2 ** 31 - 1, 2 ** 63, 2 ** 64 - 16]
DTYPES = [torch.bfloat16, torch.float32, torch.uint8, torch.int32, torch.float8_e4m3fn]
LAYOUTS = [("tensor", "tensor", "int", "int", "int", "float", "bool", "none"),
           ("tensor", "tensor", "int", "int", "int", "tensor", "int", "tensor"),
           ("int", "int", "tensor", "tensor", "tensor", "int", "float", "int")]


def _value(rng, kind):
    if kind == "tensor":            # 64 bytes of a random dtype at a 16-byte aligned or unaligned offset
        dt = rng.choice(DTYPES)
        off = rng.choice([0, 4, 16, 48]) if dt.itemsize > 1 else rng.choice([0, 1, 16, 17])
        return torch.empty(512, dtype=torch.uint8)[off:off + 64].view(dt)
    if kind == "int":
        return rng.choice(INTS)
    return rng.choice({"float": [0.5, -3.0], "bool": [True, False], "none": [None]}[kind])


def _args(rng):
    return tuple(_value(rng, kind) for kind in rng.choice(LAYOUTS))


def _launched(fn):
    """The stand-in kernels of fn on the simulated device, with their launch counts."""
    return {id(k): (k, k.launches) for k in fn.device_caches[0][0].values()}


def _which(before, after):
    moved = [k for i, (k, n) in after.items() if n != before.get(i, (None, 0))[1]]
    assert len(moved) == 1, f"{len(moved)} kernels launched"
    return moved[0]


@pytest.fixture
def counted_runs():
    """Every JITFunction.run call: (warmup flag, Triton's cache directory at the time)."""
    from triton import knobs
    from triton.runtime.jit import JITFunction
    run, calls = JITFunction.run, []

    def counting(self, *a, **kw):
        calls.append((kw.get("warmup"), knobs.cache.dir))
        return run(self, *a, **kw)
    JITFunction.run = counting
    try:
        yield calls
    finally:
        JITFunction.run = run


@pytest.mark.parametrize("backend", ["cuda", "hip"])
def test_every_launch_is_tritons_and_runs_tritons_kernel(backend, counted_runs):
    rng = random.Random(1)
    with simulated_gpu(backend):
        k = Kernel(_probe_kernel)
        bound = k.bind(C=1)
        n = 60
        for _ in range(n):
            args = _args(rng)
            tritons = _probe_kernel.run(*args, grid=(1,), warmup=True, C=1)      # Triton's pick for these arguments
            before = _launched(_probe_kernel)
            k[(2, 1)](*args, C=1)
            assert _which(before, _launched(_probe_kernel)) is tritons, args
            before = _launched(_probe_kernel)
            bound[(3,)](*args)
            assert _which(before, _launched(_probe_kernel)) is tritons, args
        assert len({id(v) for v in _probe_kernel.device_caches[0][0].values()}) > 5     # the picks differ
    warm = [w for w, _ in counted_runs]
    assert warm.count(False) == 2 * n and warm.count(True) == n          # each launch through Triton's run


def test_first_launch_of_a_variant_compiles_in_the_kernel_cache(counted_runs, monkeypatch, tmp_path):
    from triton import knobs
    monkeypatch.setenv("DSV4_KERNEL_CACHE", str(tmp_path))
    theirs = knobs.cache.dir
    t = torch.empty(64, dtype=torch.float32)
    args = (t, t, 16, 3, 5, 1.0, True, None)
    with simulated_gpu("cuda"):
        k = Kernel(_probe_kernel)
        k[(1,)](*args, C=1)
        k[(1,)](*args, C=1)
        k.bind(C=1)[(1,)](*args)              # the same variant, bound
        k[(1,)](*args, C=2)                   # another variant
        k[(1,)](*args, C=2, num_warps=8)      # another again (launch options count)
        with _launch.kernel_cache(str(tmp_path / "warm")):
            k.warmup(*args, grid=(1,), C=5)   # a warm-up compiles where its caller's kernel_cache says
    dirs = [d for _, d in counted_runs]
    assert dirs == [str(tmp_path), theirs, theirs, str(tmp_path), str(tmp_path), str(tmp_path / "warm")], dirs
    assert knobs.cache.dir == theirs


def test_record_launches_sees_every_launch():
    t = torch.empty(64, dtype=torch.float32)
    args = (t, t, 16, 3, 5, 1.0, True, None)
    with simulated_gpu("hip"), _launch.record_launches() as rec:
        launch(_probe_kernel)[(1,)](*args, C=1)
        launch(_probe_kernel).bind(C=2, num_warps=4)[(1,)](*args)
        launch(_probe_kernel)[(1,)](*args, C=1)
    assert rec == [("_probe_kernel", {"C": 1}), ("_probe_kernel", {"C": 2, "num_warps": 4}),
                   ("_probe_kernel", {"C": 1})]
    assert launch(_probe_kernel) is launch(_probe_kernel)


def test_no_launcher_internals_left():
    """The launch module restates none of Triton's specialization rules and builds no code."""
    import inspect
    src = inspect.getsource(_launch)
    for word in ("exec(", "packed_metadata", "do_not_specialize", "data_ptr", "get_current_stream"):
        assert word not in src, word


@triton.jit
def _axpy_kernel(x, y, out, a, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out + offs, a * tl.load(x + offs, mask=m) + tl.load(y + offs, mask=m), mask=m)


@pytest.mark.gpu
def test_gpu_launch_matches_tritons_and_persists_in_the_kernel_cache(gpu, monkeypatch, tmp_path):
    """On the device: ``launch``, ``bind`` and Triton's own ``fn[grid]`` write the same bytes (torch's axpy
    within fp32 contraction), for aligned and unaligned views and a length of 1, and the first launch's
    compile lands in dsv4_rocm's kernel cache."""
    monkeypatch.setenv("DSV4_KERNEL_CACHE", str(tmp_path))
    g = torch.Generator().manual_seed(0)
    base_x, base_y = (torch.randn(5000, generator=g).to(gpu) for _ in range(2))
    k = Kernel(_axpy_kernel)
    for off, n in ((0, 4096), (3, 4000), (1, 1), (16, 777)):
        x, y = base_x[off:off + n], base_y[off:off + n]
        outs = [torch.full_like(x, float("nan")) for _ in range(3)]
        grid = (triton.cdiv(n, 256),)
        k[grid](x, y, outs[1], 1.5, n, BLOCK=256)            # first: the first launch compiles
        k.bind(BLOCK=256)[grid](x, y, outs[2], 1.5, n)
        _axpy_kernel[grid](x, y, outs[0], 1.5, n, BLOCK=256)
        torch.cuda.synchronize()
        assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0]), (off, n)
        torch.testing.assert_close(outs[0], 1.5 * x + y, rtol=1e-6, atol=1e-6)
    assert any(tmp_path.rglob("*.json")), "nothing compiled into the kernel cache"
