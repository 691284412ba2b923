"""vLLM 0.33.0's call forms of dsv4_rocm's ops against vLLM's own kernels, run on CPU tensors: vLLM's Triton
kernels under the Triton interpreter (ci/engine_tier.sh sets TRITON_INTERPRET=1), ours through the public op
(the reference backend, on CPU tensors) and dsv4_rocm's Triton kernel under the interpreter. Each case calls
them with the same arguments and compares every output element:

* ``combine_topk_swa_indices`` with ``out=(indices, lens)`` and in-image visibility (``left_visible``,
  ``right_visible``, ``max_image_tokens``), on chunks whose image spans follow vLLM's own visibility rule;
* ``combine_topk_swa_indices`` under bounded SWA replay (gather_lens stopping at the replay start) against
  V4.1's copy of it;
* ``get_compressed_slot_mapping`` with ``slot_mapping`` second (replayed tokens' slots -1, other negative
  slots not padding) and under
  decode context parallelism (``dcp_world_size``, ``cp_interleave``), on random batches;
* ``fused_inv_rope_fp8_quant(..., quantize=False)``: the bf16 rows and the empty scale tensor.

bf16 conversions run as the GPUs round them (``helpers.patch_interpreter_bf16``: Triton 3.6's interpreter
truncates). Not run here: the bf16 weights of ``fused_indexer_q_rope_quant(..., weights_out_dtype=
torch.bfloat16)`` (vLLM's MXFP4 kernel uses inline assembly, which the interpreter cannot run;
tests/indexer/test_indexer.py holds ours to the float32 weights rounded to nearest even, what vLLM's store does),
and the bf16 full-cache insert (a CUDA C++ kernel in vLLM; its schema is compared with vLLM's in
tests/layer/test_cache_qkv_library.py).
"""
import pytest
import torch

from dsv4_rocm import ops
from dsv4_rocm.reference.rope import build_cos_sin_cache
from dsv4_rocm.triton.metadata.combine_topk_swa_indices import combine_topk_swa_indices as K_COMBINE
from dsv4_rocm.triton.output.fused_inv_rope_fp8_quant import fused_inv_rope_fp8_quant as K_INV
from dsv4_rocm.triton.metadata.get_compressed_slot_mapping import get_compressed_slot_mapping as K_SLOTS
from helpers import patch_interpreter_bf16, patch_interpreter_scalars

I32 = torch.int32


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    patch_interpreter_scalars()
    patch_interpreter_bf16()


def _image_chunk(g, R=3, W=8, IW=12):
    """A prefill chunk of R requests, each with one image span of <= IW tokens inside its query, and vLLM's
    visibility of it (sparse_swa.py's rule: left = min(p - start, IW - 1), right = min(end - p, IW))."""
    qlens = torch.randint(1, 30, (R,), generator=g)
    seq = (qlens + torch.randint(0, 20, (R,), generator=g)).to(I32)
    qsl = (torch.cat([torch.zeros(1, dtype=torch.long), qlens.cumsum(0)]) + 3).to(I32)     # a chunk not at 0
    T = int(qsl[-1] - qsl[0])
    left, right = torch.zeros(T, dtype=I32), torch.zeros(T, dtype=I32)
    for b in range(R):
        lo, hi = int(seq[b] - qlens[b]), int(seq[b])
        s0 = int(torch.randint(lo, hi, (), generator=g))
        s1 = min(s0 + int(torch.randint(0, IW, (), generator=g)), hi - 1)
        for i in range(int(qlens[b])):
            p, t = lo + i, int(qsl[b] - qsl[0]) + i
            if s0 <= p <= s1:
                left[t], right[t] = min(p - s0, IW - 1), min(s1 - p, IW)
    return qsl, seq, left, right, T


@pytest.mark.parametrize("seed", range(4))
def test_combine_topk_swa_indices_033_form_equals_vllms_kernel(seed):
    from vllm.models.deepseek_v4.common.ops.cache_utils import combine_topk_swa_indices as vllm_combine
    g = torch.Generator().manual_seed(seed)
    W, k, ratio, IW = 8, 4, 4, 12
    qsl, seq, left, right, T = _image_chunk(g, W=W, IW=IW)
    gl = seq.clone()                                  # whole sequences gathered: every window row exists
    N = 12
    M = N + int(seq.max())
    loc = torch.randint(0, N, (T, k), generator=g, dtype=I32)          # in range: vLLM's kernel checks none
    width = -(-(k + W + IW) // 128) * 128
    for vis in ((left, right), (None, None)):
        bufs = [(torch.full((T + 2, width), 77, dtype=I32), torch.full((T + 2,), 77, dtype=I32)) for _ in range(2)]
        theirs = vllm_combine(loc, qsl, seq, gl, W, ratio, k, M, N, bufs[0], vis[0], vis[1], IW)
        ours = ops.combine_topk_swa_indices(loc, qsl, seq, gl, W, ratio, k, M, N, bufs[1], vis[0], vis[1], IW)
        assert ours[0] is bufs[1][0] and ours[1] is bufs[1][1]
        assert torch.equal(ours[0], theirs[0])                           # every row, the reset tail included
        assert torch.equal(ours[1][:T], theirs[1][:T])                   # lens past T: neither writes them
        kernel = K_COMBINE(loc, qsl, seq, gl, W, ratio, k, M, N, combined_indices=torch.full_like(bufs[0][0], 77),
                           combined_lens=torch.full_like(bufs[0][1], 77), left_visible=vis[0], right_visible=vis[1],
                           max_image_tokens=IW)
        assert torch.equal(kernel[0], theirs[0][:T]) and torch.equal(kernel[1], theirs[1][:T])


@pytest.mark.parametrize("seed", range(4))
def test_combine_topk_swa_indices_with_replay_equals_vllms_v41_kernel(seed):
    """vLLM's bounded SWA replay (V4.1's combine): gather_lens stop at each request's replay start, below
    query_len + min(prefix_len, W - 1) where the replay start lies inside the window; the window stops at the
    first gathered position."""
    from vllm.models.deepseek_v41.common.ops.cache_utils import combine_topk_swa_indices as vllm_combine
    g = torch.Generator().manual_seed(seed)
    W, k, ratio, R = 8, 4, 4, 3
    qlens = torch.randint(1, 30, (R,), generator=g)
    seq = qlens + torch.randint(0, 20, (R,), generator=g)
    replay = (torch.rand(R, generator=g) * (seq - qlens + 1).float()).long()     # in [0, prefix_len]
    gl = (qlens + torch.clamp(seq - qlens - replay, min=0, max=W - 1)).to(I32)
    qsl = (torch.cat([torch.zeros(1, dtype=torch.long), qlens.cumsum(0)]) + 5).to(I32)
    seq = seq.to(I32)
    T = int(qsl[-1] - qsl[0])
    N = 12
    M = N + int(gl.max()) + 3
    loc = torch.randint(0, N, (T, k), generator=g, dtype=I32)          # in range: V4.1's kernel drops the others
    width = -(-(k + W) // 128) * 128
    bufs = [(torch.full((T + 2, width), 77, dtype=I32), torch.full((T + 2,), 77, dtype=I32)) for _ in range(2)]
    theirs = vllm_combine(loc, qsl, seq, gl, W, ratio, k, M, N, bufs[0])
    ours = ops.combine_topk_swa_indices(loc, qsl, seq, gl, W, ratio, k, M, N, bufs[1])
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1][:T], theirs[1][:T])
    kernel = K_COMBINE(loc, qsl, seq, gl, W, ratio, k, M, N, combined_indices=torch.full_like(bufs[0][0], 77),
                       combined_lens=torch.full_like(bufs[0][1], 77))
    assert torch.equal(kernel[0], theirs[0][:T]) and torch.equal(kernel[1], theirs[1][:T])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dcp, inter", [(1, 1), (2, 4), (2, 8)])
def test_get_compressed_slot_mapping_033_form_equals_vllms_kernel(seed, dcp, inter):
    """Random batches (a decode-sized and a prefill-sized request per batch) with replayed tokens (slot -1)
    and, under DCP, the tokens of the other rank marked -1 as vLLM's SWA slot mapping marks them."""
    from vllm.v1.attention.backends.mla.compressor_utils import get_compressed_slot_mapping as vllm_slots
    g = torch.Generator().manual_seed(seed)
    ratio, bs = 4, 16
    qlens = torch.tensor([1, int(torch.randint(20, 60, (), generator=g))])
    seq = (qlens + torch.randint(0, 200, (2,), generator=g)).to(I32)
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), qlens.cumsum(0)]).to(I32)
    T = int(qsl[-1])
    pos = torch.cat([torch.arange(int(s) - int(q), int(s)) for s, q in zip(seq, qlens)])
    slots = torch.randint(0, 10 ** 6, (T,), generator=g)
    slots[torch.rand(T, generator=g) < 0.1] = -123                       # not padding: only -1 is
    slots[torch.rand(T, generator=g) < 0.2] = -1                         # replayed tokens
    slots[(pos // inter) % dcp != 0] = -1                                # rank 0 of dcp ranks
    bt = torch.randint(0, 500, (2, 64), generator=g, dtype=I32)
    outs = [torch.full((T + 3,), 55, dtype=torch.int64) for _ in range(2)]
    theirs = vllm_slots(T, slots, qsl, seq, bt, bs, ratio, outs[0], dcp, inter)
    ours = ops.get_compressed_slot_mapping(T, slots, qsl, seq, bt, bs, ratio, outs[1], dcp, inter)
    assert torch.equal(ours, theirs) and torch.equal(outs[0], outs[1])
    kernel = K_SLOTS(T, qsl, seq, bt, bs, ratio, torch.full((T + 3,), 55, dtype=torch.int64), dcp, 0, inter,
                     slot_mapping=slots, cp_over_positions=True)
    assert torch.equal(kernel, theirs)
    assert int((theirs >= 0).sum()) > 0


def test_fused_inv_rope_fp8_quant_unquantized_rows_equal_vllms_kernel():
    from vllm.models.deepseek_v4.common.ops.fused_inv_rope_fp8_quant import fused_inv_rope_fp8_quant as vllm_inv
    g = torch.Generator().manual_seed(1)
    T, H, G = 5, 8, 2
    o = torch.randn(T, H, 512, generator=g).bfloat16()
    pos = torch.randint(0, 256, (T,), generator=g)
    cs = build_cos_sin_cache(10000.0, 256)
    for tma in (False, True):
        rows, scales = vllm_inv(o, pos, cs, G, H // G, tma_aligned_scales=tma, quantize=False)
        ours, our_scales = ops.fused_inv_rope_fp8_quant(o, pos, cs, G, H // G, tma_aligned_scales=tma, quantize=False)
        assert ours.dtype == rows.dtype == torch.bfloat16 and ours.stride() == rows.stride()
        assert torch.equal(ours.view(torch.int16), rows.view(torch.int16))
        assert our_scales.numel() == scales.numel() == 0 and our_scales.dtype == scales.dtype
        kernel, _ = K_INV(o, pos, cs, G, H // G, tma_aligned_scales=tma, quantize=False)
        assert torch.equal(kernel.view(torch.int16), rows.view(torch.int16))
