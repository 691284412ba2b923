"""vLLM's prefill metadata (``_compute_prefill_metadata_kernel``): raw tokens each prefill request gathers
into its workspace.

Math (dsv4_rocm/reference/metadata.py): for i < num_prefills and request b = num_decodes + i,
``gather_lens[i] = query_len + min(prefix_len, W - 1)`` with prefix_len = seq_lens[b] - query_len,
clamped to [0, seq_lens[b]] (a no-op for every consistent batch; garbage never yields a negative
length or one past the sequence).

Layout: int32 [num_prefills] out; one program per BLOCK entries; reads are masked to i < num_prefills.
"""
import triton
import triton.language as tl

from .._launch import cdiv, launch

BLOCK = 128


@triton.jit
def _prefill_gather_lens_kernel(out_ptr, seq_lens_ptr, qsl_ptr, num_prefills, num_decodes, window,
                                BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < num_prefills
    b = num_decodes + i
    sl = tl.load(seq_lens_ptr + b, mask=m, other=0).to(tl.int64)
    ql = tl.load(qsl_ptr + b + 1, mask=m, other=0).to(tl.int64) - tl.load(qsl_ptr + b, mask=m, other=0).to(tl.int64)
    g = ql + tl.minimum(sl - ql, window - 1)
    g = tl.minimum(tl.maximum(g, 0), tl.maximum(sl, 0))
    tl.store(out_ptr + i, g.to(tl.int32), mask=m)


def compute_prefill_gather_lens(prefill_gather_lens, seq_lens, query_start_loc, num_prefills: int,
                                num_decodes: int, window_size: int):
    """Launcher (arguments checked by dsv4_rocm.ops.compute_prefill_gather_lens)."""
    if num_prefills:
        launch(_prefill_gather_lens_kernel)[(cdiv(num_prefills, BLOCK),)](
            prefill_gather_lens, seq_lens, query_start_loc, num_prefills, num_decodes, window_size, BLOCK=BLOCK,
            num_warps=4)
    return prefill_gather_lens[:num_prefills]


COMPILE_SPECS = [
    dict(name="compute_prefill_gather_lens", fn=_prefill_gather_lens_kernel,
         pointers=dict(out_ptr="*i32", seq_lens_ptr="*i32", qsl_ptr="*i32"), floats=(),
         constexprs=lambda arch: dict(BLOCK=BLOCK), options=lambda arch: dict(num_warps=4, num_stages=1),
         matrix=False),
]
