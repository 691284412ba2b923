"""Random inputs for tests: fresh every call, never zeros; poison values for outputs."""
import os
import subprocess
import sys

import torch
import triton
import triton.language as tl

from dsv4_rocm import layout as L
from dsv4_rocm.reference import cache as rc


def random_k(n, device="cpu", gen=None, scale=1.0):
    """bf16 [n, 512] with a spread of magnitudes per 64-block (exercises many scale exponents)."""
    g = gen or torch.Generator().manual_seed(torch.seed() % (2 ** 31))
    blk = torch.exp2(torch.randint(-6, 6, (n, 8), generator=g).float())
    x = torch.randn(n, 512, generator=g) * blk.repeat_interleave(64, 1) * scale
    return x.to(torch.bfloat16).to(device)


def random_paged_cache(num_blocks, block_size, device="cpu", seed=0, fmt=L.V40_584):
    """A cache of records ``fmt`` whose every slot holds a valid record of random K, and whose page padding
    holds random garbage (a reader that touches it shows up). Returns (pages [nb, page_bytes] uint8, K fp32
    [nb*bs, 512])."""
    g = torch.Generator().manual_seed(seed)
    pages = torch.randint(0, 256, (num_blocks, L.page_bytes(block_size, fmt)), generator=g, dtype=torch.uint8)
    n = num_blocks * block_size
    k = random_k(n, gen=g)
    slots = torch.arange(n)
    rc.quantize_and_insert_k_cache(k, pages, slots, block_size, fmt)
    return pages.to(device), rc.decode_k_records(rc.encode_k_records(k, fmt), fmt).to(device)


def random_indices(b, s_q, topk, capacity, lengths_max, device="cpu", seed=0, invalid_frac=0.1):
    """int32 [b, s_q, topk] slot ids in [0, capacity) with a fraction of -1 and out-of-range ids,
    plus int32 lengths [b] in [0, lengths_max]."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, capacity, (b, s_q, topk), generator=g)
    r = torch.rand(b, s_q, topk, generator=g)
    idx = torch.where(r < invalid_frac / 2, torch.full_like(idx, -1), idx)
    idx = torch.where((r >= invalid_frac / 2) & (r < invalid_frac), idx + capacity, idx)   # beyond the cache
    lens = torch.randint(0, lengths_max + 1, (b,), generator=g)
    return idx.to(torch.int32).to(device), lens.to(torch.int32).to(device)


def poison_like(t):
    """A tensor of t's shape filled with NaN (floats) or 0xAB bytes: unwritten outputs show up."""
    if t.dtype.is_floating_point:
        return torch.full_like(t, float("nan"))
    return torch.full_like(t, 0xAB)


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def float_mismatch(a, b):
    """Elementwise: where the floats a and b differ in anything a test may rely on. A NaN matches any NaN,
    whatever its sign and payload: which NaN an operation produces is the platform's choice (the CPU's
    vector path or scalar loop, the GPU's instruction), so no test compares NaN bits. Every other value
    matches only its own bits: -0.0 is not +0.0, +inf is not -inf, a finite value is exact."""
    assert a.shape == b.shape and a.dtype == b.dtype and a.dtype.is_floating_point, (a.shape, a.dtype, b.shape, b.dtype)
    ints = _SAME_SIZE_INT[a.element_size()]
    nan_a = torch.isnan(a if a.element_size() > 1 else a.float())
    nan_b = torch.isnan(b if b.element_size() > 1 else b.float())
    bits = a.contiguous().view(ints) != b.contiguous().view(ints)
    return (nan_a != nan_b) | (bits & ~nan_a)


def same_floats(a, b):
    """a and b hold the same floats: NaN in the same places (any NaN), every other value bit for bit."""
    return a.shape == b.shape and a.dtype == b.dtype and not bool(float_mismatch(a, b).any())


def rel_err(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def cos_diff(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    denom = (a * a + b * b).sum()
    return float(1 - 2 * (a * b).sum() / denom) if denom > 0 else 0.0


def every_cache_view(num_blocks, block_size, record=584, seed=0, device="cpu", align=L.PAGE_ALIGN):
    """{name: (view, backing)}: the same random page bytes held as each view of a paged cache an engine
    holds (dsv4_rocm/cache_views.py). ``backing`` is the allocation (page padding included, random too,
    so a write past a page's records shows up). Views:
      vllm_3d        [nb, bs, R] with pages padded to a multiple of ``align`` B (vLLM's allocation)
      vllm_2d        its .view(nb, -1): [nb, bs*R], stride(0) = the padded page
      flashmla_4d    its .unsqueeze(-2): [nb, bs, 1, R]
      padded_2d      [nb, round_up(bs*R, align)] (reference.cache.new_cache's allocation)
      unpadded_2d    [nb, bs*R] contiguous (vLLM's tests)
      unpadded_3d    [nb, bs, R] contiguous
      fp8_3d         the float8_e4m3fn view of vllm_3d"""
    g = torch.Generator().manual_seed(seed)
    used = block_size * record
    padded = L.round_up(used, align)
    page = torch.randint(0, 256, (num_blocks, padded), generator=g, dtype=torch.uint8).to(device)
    views = {}
    b = page.clone()
    views["vllm_3d"] = (torch.as_strided(b, (num_blocks, block_size, record), (padded, record, 1)), b)
    b = page.clone()
    views["vllm_2d"] = (torch.as_strided(b, (num_blocks, block_size, record), (padded, record, 1)).view(num_blocks, -1), b)
    b = page.clone()
    views["flashmla_4d"] = (torch.as_strided(b, (num_blocks, block_size, record), (padded, record, 1)).unsqueeze(-2), b)
    b = page.clone()
    views["padded_2d"] = (b, b)
    b = page[:, :used].contiguous()
    views["unpadded_2d"] = (b, b)
    b = page[:, :used].contiguous()
    views["unpadded_3d"] = (b.view(num_blocks, block_size, record), b)
    b = page.clone()
    views["fp8_3d"] = (torch.as_strided(b, (num_blocks, block_size, record), (padded, record, 1)).view(
        torch.float8_e4m3fn), b)
    return views


def page_records(backing, block_size, record=584):
    """The [nb, bs*R] record bytes of a backing allocation (its padding excluded)."""
    return backing[:, :block_size * record]


def run_interpreted(script: str, tmp_path):
    """Run a script under the Triton interpreter in a fresh process (Triton reads kernel sources from files;
    the script sets TRITON_INTERPRET=1 before importing triton). Returns the CompletedProcess."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    f = tmp_path / "interpreted.py"
    f.write_text(script)
    return subprocess.run([sys.executable, str(f)], cwd=root, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=root), timeout=600)


def run_file_interpreted(test_file: str, timeout: int = 600):
    """Run a test file as a script (its ``__main__`` block) under TRITON_INTERPRET=1 in a fresh process (the
    variable must be set before triton is imported), with the repository and tests/ on PYTHONPATH. Prints
    the ends of its output and returns the CompletedProcess."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([root, os.path.join(root, "tests")]))
    r = subprocess.run([sys.executable, os.path.abspath(test_file)], env=env, capture_output=True, text=True,
                       timeout=timeout)
    print(r.stdout[-4000:], r.stderr[-4000:])
    return r


# ---- the Triton interpreter's known bugs: each fix is applied only where a probe shows the bug --------------
# The fixes replace methods of triton.runtime.interpreter (the only way to change what the interpreter computes);
# before each, a tiny kernel runs under the interpreter in use and the fix goes in only if the kernel shows the
# bug, and only if the kernel is right afterwards. An interpreter that is fixed upstream runs unpatched. Probed
# 2026-11-29 (NumPy 2.4): the loop bound under Triton 3.6 only; the scalar mask under 3.9 only; every bf16 fix
# under 3.6, 3.8 and 3.9.
@triton.jit
def _probe_loop_bound(n_ptr, out_ptr):
    n = tl.load(n_ptr)
    count = 0
    for _ in range(n):
        count += 1
    tl.store(out_ptr, count)


@triton.jit
def _probe_bf16(x_ptr, y_ptr, f_ptr, sum_ptr, prod_ptr, less_ptr, widen_ptr, round_ptr, dot_ptr, N: tl.constexpr):
    r = tl.arange(0, N)
    x = tl.load(x_ptr + r)
    y = tl.load(y_ptr + r)
    tl.store(sum_ptr + r, x + y)
    tl.store(prod_ptr + r, x * y)
    tl.store(less_ptr + r, (x < y).to(tl.int8))
    tl.store(widen_ptr + r, x.to(tl.float32))
    tl.store(round_ptr + r, tl.load(f_ptr + r).to(tl.bfloat16))
    a = tl.load(x_ptr + r[:, None] * 0 + r[None, :])          # [N, N], every row x
    b = tl.load(y_ptr + r[:, None] + r[None, :] * 0)          # [N, N], every column y
    tl.store(dot_ptr + r[:, None] * N + r[None, :], tl.dot(a, b))


@triton.jit
def _probe_scalar_mask(x_ptr, out_ptr, n, c, N: tl.constexpr):
    r = tl.arange(0, N)
    inb = r < n
    tl.store(out_ptr + r, tl.load(x_ptr + r, mask=inb & (c > 0), other=-1), mask=inb)


def _interpreting() -> bool:
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(_probe_loop_bound, InterpretedFunction)


def _loop_bound_broken() -> bool:
    """A scalar loaded from a tensor, used as a loop bound, counts the loop right."""
    n, out = torch.tensor([5], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    try:
        _probe_loop_bound[(1,)](n, out)
    except Exception:          # Triton 3.6 under NumPy >= 2.3: "only 0-dimensional arrays can be converted"
        return True
    return out.item() != 5


def _bf16_broken() -> set:
    """Which of the interpreter's bf16 paths differ from the GPUs' (exact fp32 math rounded once, to nearest
    even, as torch computes bf16 on the CPU): "arithmetic" (+, *, <), "widen" (bf16 -> fp32, denormals
    included), "round" (fp32 -> bf16: ties and round-ups), "dot" (bf16 tl.dot, small integers: exact sums)."""
    n = 16
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g).bfloat16()
    y = torch.randn(n, generator=g).bfloat16()
    x.view(torch.int16)[:3] = torch.tensor([0x0001, -0x7FFF, 0x007F], dtype=torch.int16)   # denormals
    f = torch.randn(n, generator=g)
    f.view(torch.int32)[:2] = torch.tensor([0x3F80C000, 0x3F818000], dtype=torch.int32)   # round up; a tie to even
    xi = torch.randint(-4, 5, (n,), generator=g).bfloat16()
    yi = torch.randint(-4, 5, (n,), generator=g).bfloat16()
    bf = torch.bfloat16
    outs = [torch.empty(n, dtype=bf), torch.empty(n, dtype=bf), torch.empty(n, dtype=torch.int8), torch.empty(n),
            torch.empty(n, dtype=bf), torch.empty(n, n)]
    dot_outs = [torch.empty_like(o) for o in outs]
    _probe_bf16[(1,)](x, y, f, *outs, N=n)
    _probe_bf16[(1,)](xi, yi, f, *dot_outs, N=n)
    s, p, less, widen, rounded, _ = outs
    bits = lambda t: t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)  # noqa: E731
    broken = set()
    if not (torch.equal(bits(s), bits(x + y)) and torch.equal(bits(p), bits(x * y)) and
            torch.equal(less, (x < y).to(torch.int8))):
        broken.add("arithmetic")
    if not torch.equal(bits(widen), bits(x.float())):
        broken.add("widen")
    if not torch.equal(bits(rounded), bits(f.bfloat16())):
        broken.add("round")
    if not torch.equal(dot_outs[5], torch.full((n, n), float(xi.float() @ yi.float()))):   # every entry x . y
        broken.add("dot")
    return broken


def _scalar_mask_broken() -> bool:
    """A mask made of a block comparison and a comparison of a scalar argument loads what it masks."""
    x, out = torch.arange(8, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)
    try:
        _probe_scalar_mask[(1,)](x, out, 5, 3, N=8)
    except Exception:          # Triton 3.9: "mask has unsupported dtype"
        return True
    return not torch.equal(out[:5], x[:5])


def patch_interpreter_scalars():
    """Two scalar bugs of the interpreter (the compiled kernels are unaffected), each fixed only where its probe
    shows it. "loop bound": Triton 3.6 turns a scalar used as a loop bound into int(array of shape (1,)), which
    NumPy >= 2.3 rejects; take the element instead (3.8 and 3.9 take it themselves). "scalar mask": Triton
    3.9 types ``block_mask & (scalar_arg > 0)`` as int32 under the interpreter (the compiler keeps it i1) and
    its loads and stores then refuse the mask; hand them the mask as booleans. Returns the fixes applied."""
    if not _interpreting():
        return ()
    import triton.runtime.interpreter as ti
    fixed = []
    if _loop_bound_broken():
        patch = ti._patch_lang_tensor

        def patched(tensor, scope):
            patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))
        ti._patch_lang_tensor = patched
        if _loop_bound_broken():
            ti._patch_lang_tensor = patch
            raise RuntimeError("the interpreter's loop-bound fix does not fix it under Triton " + triton.__version__)
        fixed.append("loop bound")
    if _scalar_mask_broken():
        B = ti.InterpreterBuilder
        load, store = B.create_masked_load, B.create_masked_store

        def as_bool(mask):
            return mask if mask.data.dtype == bool else ti.TensorHandle(mask.data != 0, mask.dtype)

        B.create_masked_load = lambda self, ptrs, mask, *a: load(self, ptrs, as_bool(mask), *a)
        B.create_masked_store = lambda self, ptrs, value, mask, *a: store(self, ptrs, value, as_bool(mask), *a)
        if _scalar_mask_broken():
            B.create_masked_load, B.create_masked_store = load, store
            raise RuntimeError("the interpreter's scalar-mask fix does not fix it under Triton " + triton.__version__)
        fixed.append("scalar mask")
    return tuple(fixed)


def patch_interpreter_bf16():
    """The interpreter holds bf16 as raw uint16, and (Triton 3.6, 3.8 and 3.9 alike) computes with those
    integers: it multiplies bf16 ``tl.dot`` operands as integers, adds / multiplies / compares bf16 tensors as
    integers, rounds fp32 -> bf16 by truncation and widens bf16 denormals wrongly. Make each what the GPUs
    do: exact fp32 products of the bf16 values accumulated in fp32 (the MMA units), elementwise operations in
    fp32 rounded once to bf16, round-to-nearest-even conversions (NaN -> 0x7FC0), widening by a shift. Each
    of the four fixes is applied only where ``_probe_bf16`` shows its bug. The compiled kernels are
    unaffected. Returns the names of the fixes applied."""
    if not _interpreting():
        return ()
    broken = _bf16_broken()
    if not broken:
        return ()
    import numpy as np
    import triton.runtime.interpreter as ti

    def f32(h):
        return (np.asarray(h).astype(np.uint32) << 16).view(np.float32)

    def bf16(f):
        f = np.asarray(f, dtype=np.float32)
        bits = f.view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return np.where(np.isnan(f), np.uint16(0x7FC0), rounded)

    B = ti.InterpreterBuilder
    saved = dot, cast, binary = B.create_dot, B.cast_impl, B.binary_op

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype == tl.bfloat16 and b.dtype == tl.bfloat16:
            return ti.TensorHandle(np.matmul(f32(a.data), f32(b.data), dtype=np.float32) + d.data, d.dtype.scalar)
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        s, t = src.dtype.scalar, dst_type.scalar
        if s == tl.float32 and t == tl.bfloat16 and "round" in broken:
            return ti.TensorHandle(bf16(src.data), t)
        if s == tl.bfloat16 and t == tl.float32 and "widen" in broken:
            return ti.TensorHandle(f32(src.data), t)
        return cast(self, src, dst_type)

    def binary_op(self, lhs, rhs, op):
        if lhs.dtype.scalar == tl.bfloat16 and rhs.dtype.scalar == tl.bfloat16:
            out = op(f32(lhs.data), f32(rhs.data))
            if out.dtype == np.float32:
                return ti.TensorHandle(bf16(out), tl.bfloat16)
            return ti.TensorHandle(out, tl.int1)
        return binary(self, lhs, rhs, op)

    if "dot" in broken:
        B.create_dot = create_dot
    if broken & {"round", "widen"}:
        B.cast_impl = cast_impl
    if "arithmetic" in broken:
        B.binary_op = binary_op
    left = _bf16_broken()
    if left:
        B.create_dot, B.cast_impl, B.binary_op = saved
        raise RuntimeError(f"the interpreter's bf16 fixes leave {sorted(left)} wrong under Triton {triton.__version__}")
    return tuple(sorted(broken))


@triton.jit
def _probe_fma(a_ptr, b_ptr, c_ptr, out_ptr, N: tl.constexpr):
    r = tl.arange(0, N)
    tl.store(out_ptr + r, tl.fma(tl.load(a_ptr + r), tl.load(b_ptr + r), tl.load(c_ptr + r)))


def _fma_broken() -> bool:
    """fp32 tl.fma rounds once: (1 + 2^-12)^2 - 1 is 2^-11 + 2^-24, not the 2^-11 of a rounded product."""
    a = torch.full((4,), 1 + 2 ** -12)
    c = torch.full((4,), -1.0)
    out = torch.zeros(4)
    _probe_fma[(1,)](a, a, c, out, N=4)
    return not torch.equal(out, torch.full((4,), 2 ** -11 + 2 ** -24))


def patch_interpreter_fma():
    """The interpreter's fp32 ``tl.fma`` (Triton 3.6) rounds the product before the sum (a * b + c in NumPy
    fp32), where the GPUs' fma rounds once. Make it the single rounding (``reference.rope.fma32``), only where
    ``_probe_fma`` shows the bug. Returns the fixes applied."""
    if not _interpreting() or not _fma_broken():
        return ()
    import numpy as np
    import triton.runtime.interpreter as ti
    from dsv4_rocm.reference.rope import fma32

    B = ti.InterpreterBuilder
    saved = B.create_fma

    def create_fma(self, x, y, z):
        if z.data.dtype != np.float32:
            return saved(self, x, y, z)
        a, b, c = np.broadcast_arrays(x.data, y.data, z.data)
        r = fma32(torch.from_numpy(np.ascontiguousarray(a)), torch.from_numpy(np.ascontiguousarray(b)),
                  torch.from_numpy(np.ascontiguousarray(c)))
        return ti.TensorHandle(r.numpy().astype(np.float32), z.dtype.scalar)

    B.create_fma = create_fma
    if _fma_broken():
        B.create_fma = saved
        raise RuntimeError("the interpreter's fma fix does not fix it under Triton " + triton.__version__)
    return ("fma",)
