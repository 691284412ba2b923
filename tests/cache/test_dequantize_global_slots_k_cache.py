"""dequantize_global_slots_k_cache(out, k_cache, slot_ids, block_size) -> None, as vLLM's FlashMLA backend
calls it (out a column slice of a [N, topk + window, 512] workspace, slot ids int32 with -1 padding).

CPU: rows against a per-slot decode, strided out, every cache view, padding and bad input; the V4.1
records in both page layouts. GPU: the HIP kernel writes the reference's rows exactly, every format.
"""
import pytest
import torch

from dsv4_rocm import layout as L
from dsv4_rocm import ops
from dsv4_rocm.reference import cache as rc
from helpers import every_cache_view, random_k

VIEWS = sorted(every_cache_view(1, 2))
FORMATS = [(L.V40_584, "page_split"), (L.V41_528, "page_split"), (L.V41_528, "interleaved"),
           (L.V41_FP4_288, "page_split"), (L.V41_FP4_288, "interleaved")]


def filled(nb, bs, seed, device="cpu", view="vllm_3d", fmt=L.V40_584):
    align = fmt.page_align if not fmt.interleaved else fmt.token_bytes
    v, _ = every_cache_view(nb, bs, fmt.token_bytes, seed=seed, device=device, align=align)[view]
    k = random_k(nb * bs, gen=torch.Generator().manual_seed(seed))
    rc.quantize_and_insert_k_cache(k.to(device), v, torch.arange(nb * bs, device=device), bs, fmt)
    return v, rc.decode_k_records(rc.encode_k_records(k, fmt), fmt).bfloat16().to(device)


def expected(K, slot_ids):
    """bf16 rows of K at the slot ids, zeros for padding (one slot at a time)."""
    out = torch.empty(*slot_ids.shape, 512, dtype=torch.bfloat16)
    for idx in torch.cartesian_prod(*[torch.arange(n) for n in slot_ids.shape]).reshape(-1, slot_ids.dim()):
        s = int(slot_ids[tuple(idx)])
        out[tuple(idx)] = K[s] if s >= 0 else 0
    return out


@pytest.mark.parametrize("view", VIEWS)
def test_rows_and_padding_in_a_workspace_slice(view):
    v, K = filled(3, 64, seed=1, view=view)
    ids = torch.tensor([[0, 191, -1, 65], [-1, -1, 3, 100], [64, 128, 5, 190]], dtype=torch.int32)
    work = torch.full((3, 4 + 6, 512), float("nan"), dtype=torch.bfloat16)   # [N, topk + window, 512]
    ops.dequantize_global_slots_k_cache(work[:, :4], v, ids, 64)              # vLLM's combined_kv[:, :topk]
    assert torch.equal(work[:, :4], expected(K, ids))
    assert work[:, 4:].isnan().all()


@pytest.mark.parametrize("fmt, layout", FORMATS[1:], ids=[f"{f.name}-{lay}" for f, lay in FORMATS[1:]])
def test_v41_records(fmt, layout):
    v, K = filled(3, 5, seed=4, fmt=L.with_layout(fmt, layout))
    ids = torch.tensor([[0, 14, -1, 6], [-1, 2, 3, 9]], dtype=torch.int32)
    out = torch.full((2, 4, 512), float("nan"), dtype=torch.bfloat16)
    ops.dequantize_global_slots_k_cache(out, v.unsqueeze(-2), ids, 5, kv_layout=layout)
    assert torch.equal(out, expected(K, ids))


def test_one_dimensional_slots_and_the_torch_op():
    v, K = filled(2, 2, seed=2, view="unpadded_2d")
    ids = torch.tensor([3, -1, 0, 2])
    out = torch.full((4, 512), float("nan"), dtype=torch.bfloat16)
    ops.dequantize_global_slots_k_cache(out, v, ids, 2)
    assert torch.equal(out, expected(K, ids))
    out3 = torch.full((1, 4, 512), float("nan"), dtype=torch.bfloat16)
    torch.ops.dsv4_rocm.dequantize_global_slots_k_cache(out3, v, ids.view(1, 4), 2)
    assert torch.equal(out3[0], out)


def test_vllm_mtp_decode_form_with_flashmla_indices():
    """vLLM's MTP decode path: out = combined_kv[:, :topk] ([n, W, 512], a column slice of the workspace),
    the slot ids in FlashMLA's [n, 1, W] index form; the same rows as the [n, W] form, through the torch
    op too, and the workspace's other columns untouched."""
    v, K = filled(3, 64, seed=4)
    ids = torch.tensor([[0, 191, -1, 65, 7], [-1, 2, 3, 100, 64]], dtype=torch.int32).unsqueeze(1)   # [2, 1, 5]
    for op in (ops.dequantize_global_slots_k_cache, torch.ops.dsv4_rocm.dequantize_global_slots_k_cache):
        work = torch.full((2, 5 + 4, 512), float("nan"), dtype=torch.bfloat16)
        op(work[:, :5], v, ids, 64)
        assert torch.equal(work[:, :5], expected(K, ids[:, 0])) and work[:, 5:].isnan().all()
        work = torch.full((2, 4 + 5, 512), float("nan"), dtype=torch.bfloat16)
        op(work[:, 4:], v, ids.long(), 64)                            # the window part, int64 ids
        assert torch.equal(work[:, 4:], expected(K, ids[:, 0])) and work[:, :4].isnan().all()


def test_empty_and_bad_input():
    v, _ = filled(2, 64, seed=3)
    ops.dequantize_global_slots_k_cache(torch.empty(0, 5, 512, dtype=torch.bfloat16), v,
                                        torch.empty(0, 5, dtype=torch.int32), 64)
    out = torch.full((2, 3, 512), float("nan"), dtype=torch.bfloat16)
    bad = [(lambda: ops.dequantize_global_slots_k_cache(out, v, torch.tensor([[0, 1, 128], [0, 1, 2]]), 64),
            "slot_ids: slot 128 is outside"),
           (lambda: ops.dequantize_global_slots_k_cache(out, v, torch.zeros(2, 4, dtype=torch.int32), 64),
            "out must have shape"),
           (lambda: ops.dequantize_global_slots_k_cache(out.float(), v, torch.zeros(2, 3, dtype=torch.int32), 64),
            "out must have dtype"),
           (lambda: ops.dequantize_global_slots_k_cache(out, v, torch.zeros(2, 3), 64), "slot_ids must have dtype"),
           (lambda: ops.dequantize_global_slots_k_cache(out, v, torch.zeros(2, 2, 3, dtype=torch.int32), 64),
            r"slot_ids must be \[N\], \[N, K\] or \[N, 1, K\]"),
           (lambda: ops.dequantize_global_slots_k_cache(out, v, torch.zeros(2, 1, 4, dtype=torch.int32), 64),
            "out must have shape"),
           (lambda: ops.dequantize_global_slots_k_cache(out, v, torch.zeros(2, 3, dtype=torch.int32), 2), "k_cache")]
    for call, match in bad:
        with pytest.raises(ValueError, match=match):
            call()
        assert out.isnan().all()


@pytest.mark.gpu
@pytest.mark.parametrize("bs, N, K", [(64, 1, 512), (64, 128, 640), (2, 37, 2048), (64, 3, 1)])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gpu_kernel_writes_the_reference_rows(bs, N, K, index_dtype, gpu):
    nb = 50
    v, _ = filled(nb, bs, seed=bs + K, device=gpu)
    g = torch.Generator().manual_seed(N * K)
    ids = torch.randint(-1, nb * bs, (N, K), generator=g)
    ids[torch.rand(N, K, generator=g) < 0.05] += nb * bs           # garbage past the cache: zero rows, no read
    ids = ids.to(index_dtype).to(gpu)
    work = torch.full((N, K + 3, 512), float("nan"), dtype=torch.bfloat16, device=gpu)
    want = work.clone()
    ops.implementation("dequantize_global_slots_k_cache", "cuda")(work[:, 3:], v, ids, bs)
    rc.dequantize_global_slots_k_cache(want[:, 3:], v, ids, bs)
    assert torch.equal(work.view(torch.int16), want.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, layout", FORMATS, ids=[f"{f.name}-{lay}" for f, lay in FORMATS])
def test_gpu_kernel_reads_every_record_format(fmt, layout, gpu):
    f = L.with_layout(fmt, layout)
    nb, bs, N, K = 40, 7, 33, 600
    v, _ = filled(nb, bs, seed=9, device=gpu, fmt=f)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(-1, nb * bs, (N, K), generator=g)
    ids[torch.rand(N, K, generator=g) < 0.05] += nb * bs
    ids = ids.int().to(gpu)
    work = torch.full((N, K + 3, 512), float("nan"), dtype=torch.bfloat16, device=gpu)
    want = work.clone()
    ops.implementation("dequantize_global_slots_k_cache", "cuda")(work[:, 3:], v, ids, bs, fmt=f)
    rc.dequantize_global_slots_k_cache(want[:, 3:], v, ids, bs, fmt=f)
    assert torch.equal(work.view(torch.int16), want.view(torch.int16))
