"""A ragged index stream as dense index rows (vLLM's ROCm ``*_ragged_indices`` / ``*_ragged_indptr`` form ->
FlashMLA's ``[T, 1, W]`` indices with lengths).

Math (dsv4_rocm/reference/metadata.py ``ragged_indices_to_dense``): with N = len(ragged_indices) and
start = clamp(indptr[t], 0, N), end = clamp(indptr[t + 1], start, N), row t gets n = min(end - start, W)
entries ``ragged_indices[start:start + n]``, then -1 up to W, and ``lens[t] = n``. Nothing past the
stream is read, whatever the offsets.

Layout: one program per row, BLOCK_W columns a step; ``out`` row t at ``t * out_row`` with contiguous
columns, all W columns written. Offsets and entries are int32 or int64, written as int32.
"""
import triton
import triton.language as tl

from .._launch import launch, next_power_of_2


@triton.jit(do_not_specialize=["num_entries", "width"])
def _ragged_to_dense_kernel(idx_ptr, ptr_ptr, num_entries, out_ptr, out_row, lens_ptr, width,
                            BLOCK_W: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    start = tl.minimum(tl.maximum(tl.load(ptr_ptr + t).to(tl.int64), 0), num_entries)
    end = tl.minimum(tl.maximum(tl.load(ptr_ptr + t + 1).to(tl.int64), start), num_entries)
    n = tl.minimum(end - start, width)
    tl.store(lens_ptr + t, n.to(tl.int32))
    row = out_ptr + t * out_row
    for k0 in range(0, width, BLOCK_W):
        k = k0 + tl.arange(0, BLOCK_W)
        v = tl.load(idx_ptr + start + k, mask=k < n, other=-1)
        tl.store(row + k, v.to(tl.int32), mask=k < width)


def ragged_indices_to_dense(ragged_indices, ragged_indptr, out_indices, out_lens):
    """Launcher (arguments checked by dsv4_rocm.ops.ragged_indices_to_dense)."""
    T, W = out_indices.shape
    if T and W:
        launch(_ragged_to_dense_kernel)[(T,)](
            ragged_indices, ragged_indptr, ragged_indices.shape[0], out_indices, out_indices.stride(0), out_lens, W,
            BLOCK_W=min(next_power_of_2(W), 1024), num_warps=4)
    elif T:
        out_lens.zero_()
    return out_indices, out_lens


COMPILE_SPECS = [
    dict(name="ragged_indices_to_dense", fn=_ragged_to_dense_kernel,
         pointers=dict(idx_ptr="*i32", ptr_ptr="*i32", out_ptr="*i32", lens_ptr="*i32"), floats=(),
         constexprs=lambda arch: dict(BLOCK_W=512), options=lambda arch: dict(num_warps=4, num_stages=1),
         matrix=False),
]
