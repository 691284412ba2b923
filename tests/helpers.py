"""Random inputs for tests: fresh every call, never zeros; poison values for outputs."""
import os
import subprocess
import sys

import torch

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


def patch_interpreter_scalars():
    """Triton 3.6's interpreter turns a scalar used as a loop bound into int(array of shape (1,)), which
    NumPy >= 2.3 rejects; take the element instead (the compiled kernels are unaffected)."""
    import triton.runtime.interpreter as ti
    patch = ti._patch_lang_tensor

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))
    ti._patch_lang_tensor = patched


def patch_interpreter_bf16():
    """Triton 3.6's interpreter holds bf16 as raw uint16 and computes with those integers: it multiplies bf16
    ``tl.dot`` operands as integers, adds / multiplies / compares bf16 tensors as integers, rounds fp32 ->
    bf16 by truncation. Make each what the GPUs do: exact fp32 products of the bf16 values accumulated in
    fp32 (the MMA units), elementwise operations in fp32 rounded once to bf16, round-to-nearest-even
    conversions (NaN -> 0x7FC0). The compiled kernels are unaffected."""
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as ti

    def f32(h):
        return (np.asarray(h).astype(np.uint32) << 16).view(np.float32)

    def bf16(f):
        f = np.asarray(f, dtype=np.float32)
        bits = f.view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return np.where(np.isnan(f), np.uint16(0x7FC0), rounded)

    B = ti.InterpreterBuilder
    dot, cast, binary = B.create_dot, B.cast_impl, B.binary_op

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype == tl.bfloat16 and b.dtype == tl.bfloat16:
            return ti.TensorHandle(np.matmul(f32(a.data), f32(b.data), dtype=np.float32) + d.data, d.dtype.scalar)
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        s, t = src.dtype.scalar, dst_type.scalar
        if s == tl.float32 and t == tl.bfloat16:
            return ti.TensorHandle(bf16(src.data), t)
        if s == tl.bfloat16 and t == tl.float32:
            return ti.TensorHandle(f32(src.data), t)
        return cast(self, src, dst_type)

    def binary_op(self, lhs, rhs, op):
        if lhs.dtype.scalar == tl.bfloat16 and rhs.dtype.scalar == tl.bfloat16:
            out = op(f32(lhs.data), f32(rhs.data))
            if out.dtype == np.float32:
                return ti.TensorHandle(bf16(out), tl.bfloat16)
            return ti.TensorHandle(out, tl.int1)
        return binary(self, lhs, rhs, op)

    B.create_dot, B.cast_impl, B.binary_op = create_dot, cast_impl, binary_op
