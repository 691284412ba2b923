"""fp8_ds_mla records and paged caches (DSV4_SPEC §4): encode, insert, gather, dequantize.

A record is 584 bytes: [448 e4m3 NoPE][64 bf16 RoPE as 128 bytes][7 UE8M0 scales][1 pad byte = 0].
In a page the first 576 bytes of every record sit at ``off*576`` and the last 8 at
``bs*576 + off*8`` (see ``dsv4_rocm.layout``). The indexer-K cache (C4 layers) stores 128 e4m3 bytes at
``off*128`` and the fp32 scale 2^e at ``bs*128 + off*4``.
"""
import torch

from .. import layout as L
from .quant import (dequantize_blocks, exponent_to_ue8m0, quantize_blocks, ue8m0_to_exponent)

KV_EPS = 1e-4


# ---- page views ---------------------------------------------------------------------------------
def as_pages(cache: torch.Tensor, block_size: int, name: str = "k_cache", indexer: bool = False) -> torch.Tensor:
    """A [num_blocks, page_stride] uint8 view of a cache given as [nb, page_bytes] or as FlashMLA's
    [nb, bs, 1, 584] (page stride = stride(0))."""
    need = L.indexer_page_bytes(block_size) if indexer else L.page_bytes(block_size)
    rec = L.INDEXER_TOKEN_BYTES if indexer else L.TOKEN_BYTES
    if not isinstance(cache, torch.Tensor) or cache.dtype != torch.uint8:
        raise ValueError(f"{name} must be a uint8 tensor")
    if cache.dim() == 2:
        if cache.shape[1] != need or cache.stride(1) != 1:
            raise ValueError(f"{name}: expected pages of {need} bytes for block_size {block_size}, "
                             f"got shape {tuple(cache.shape)} stride {cache.stride()}")
        return cache
    if cache.dim() == 4:
        if cache.shape[1] != block_size or cache.shape[2] != 1 or cache.shape[3] != rec:
            raise ValueError(f"{name}: expected shape [nb, {block_size}, 1, {rec}], got {tuple(cache.shape)}")
        if cache.stride(0) < block_size * rec:
            raise ValueError(f"{name}: page stride {cache.stride(0)} smaller than {block_size * rec}")
        if not indexer and cache.stride(0) % L.PAGE_ALIGN:
            raise ValueError(f"{name}: page stride {cache.stride(0)} is not a multiple of {L.PAGE_ALIGN} B")
        return torch.as_strided(cache, (cache.shape[0], cache.stride(0)), (cache.stride(0), 1),
                                cache.storage_offset())
    raise ValueError(f"{name} must be 2-D [nb, page_bytes] or 4-D [nb, bs, 1, {rec}], got {cache.dim()}-D")


def new_cache(num_blocks: int, block_size: int, device=None, indexer: bool = False) -> torch.Tensor:
    """An empty (zeroed) cache of [num_blocks, page_bytes] uint8."""
    pb = L.indexer_page_bytes(block_size) if indexer else L.page_bytes(block_size)
    return torch.zeros(num_blocks, pb, dtype=torch.uint8, device=device)


def flash_mla_view(pages: torch.Tensor, block_size: int) -> torch.Tensor:
    """FlashMLA's [nb, bs, 1, 584] view over [nb, page_bytes] pages (shape carrier, page stride kept)."""
    nb, stride = pages.shape
    return torch.as_strided(pages, (nb, block_size, 1, L.TOKEN_BYTES), (stride, L.TOKEN_BYTES, L.TOKEN_BYTES, 1),
                            pages.storage_offset())


def _check_slots(slots: torch.Tensor, pages: torch.Tensor, block_size: int, name: str) -> torch.Tensor:
    if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be a 1-D int32/int64 tensor, got {slots.dtype} {tuple(slots.shape)}")
    cap = pages.shape[0] * block_size
    valid = slots >= 0
    if bool((slots[valid] >= cap).any()):
        raise ValueError(f"{name}: a slot is >= the cache capacity {cap} ({pages.shape[0]} blocks x {block_size})")
    return valid


# ---- 584-byte records -----------------------------------------------------------------------------
def encode_k_records(k: torch.Tensor) -> torch.Tensor:
    """bf16 [T, 512] (RoPE already applied) -> uint8 [T, 584] records."""
    if k.dim() != 2 or k.shape[1] != L.HEAD_DIM or k.dtype != torch.bfloat16:
        raise ValueError(f"k must be bf16 [T, 512], got {k.dtype} {tuple(k.shape)}")
    q, e = quantize_blocks(k[:, :L.NOPE_DIM].float(), L.QUANT_BLOCK, KV_EPS)
    rope = k[:, L.NOPE_DIM:].contiguous().view(torch.uint8)
    scales = torch.cat([exponent_to_ue8m0(e), torch.zeros_like(e[:, :1], dtype=torch.uint8)], dim=1)
    return torch.cat([q, rope, scales], dim=1)


def decode_k_records(rec: torch.Tensor) -> torch.Tensor:
    """uint8 [N, 584] -> fp32 [N, 512]: the K (= V) values every attention kernel sees."""
    nope = dequantize_blocks(rec[:, :L.NOPE_DIM], ue8m0_to_exponent(rec[:, L.DATA_BYTES:L.DATA_BYTES + 7]),
                             L.QUANT_BLOCK)
    rope = rec[:, L.NOPE_DIM:L.DATA_BYTES].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope, rope], dim=1)


def _byte_index(slots: torch.Tensor, block_size: int, page_stride: int):
    s = slots.long()
    blk, off = s // block_size, s % block_size
    data = (blk * page_stride + off * L.DATA_BYTES).unsqueeze(1) + torch.arange(L.DATA_BYTES, device=s.device)
    scal = (blk * page_stride + block_size * L.DATA_BYTES + off * L.SCALE_BYTES).unsqueeze(1) \
        + torch.arange(L.SCALE_BYTES, device=s.device)
    return data, scal


def _flat(pages: torch.Tensor) -> torch.Tensor:
    return torch.as_strided(pages, (pages.shape[0] * pages.shape[1],), (1,), pages.storage_offset())


def insert_k_records(rec: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor, block_size: int) -> None:
    """Write records at slots (slot < 0 skipped); only the first len(slot_mapping) records are used."""
    pages = as_pages(k_cache, block_size)
    if pages.stride(0) != pages.shape[1]:
        raise ValueError("k_cache pages must be contiguous for the reference writer")
    valid = _check_slots(slot_mapping, pages, block_size, "slot_mapping")
    if slot_mapping.shape[0] > rec.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {rec.shape[0]} tokens")
    rec = rec[:slot_mapping.shape[0]][valid]
    data, scal = _byte_index(slot_mapping[valid], block_size, pages.stride(0))
    flat = _flat(pages)
    flat[data.reshape(-1)] = rec[:, :L.DATA_BYTES].reshape(-1)
    flat[scal.reshape(-1)] = rec[:, L.DATA_BYTES:].reshape(-1)


def gather_k_records(k_cache: torch.Tensor, slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """uint8 [N, 584] records at slots; rows of invalid (negative) slots are zero."""
    pages = as_pages(k_cache, block_size)
    valid = _check_slots(slots, pages, block_size, "slots")
    data, scal = _byte_index(torch.where(valid, slots, torch.zeros_like(slots)), block_size, pages.stride(0))
    flat = _flat(pages)
    rec = torch.cat([flat[data], flat[scal]], dim=1)
    return torch.where(valid.unsqueeze(1), rec, torch.zeros_like(rec))


def quantize_and_insert_k_cache(k: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor,
                                block_size: int) -> None:
    """vLLM's op: UE8M0-quantize bf16 k [T, 512] (RoPE applied) and write it at slot_mapping."""
    insert_k_records(encode_k_records(k), k_cache, slot_mapping, block_size)


def dequantize_and_gather_k_cache(k_cache: torch.Tensor, slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """bf16 [N, 512] rows for slots (zeros for negative slots). Exact: dequant values are bf16."""
    valid = slots >= 0
    out = decode_k_records(gather_k_records(k_cache, slots, block_size))
    return torch.where(valid.unsqueeze(1), out, torch.zeros_like(out)).to(torch.bfloat16)


# ---- indexer K cache ------------------------------------------------------------------------------
def indexer_k_insert(q_bytes: torch.Tensor, scale: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                     block_size: int) -> None:
    """Write 128 fp8 bytes + fp32 scale per entry at slot_mapping (negative skipped)."""
    pages = as_pages(cache, block_size, "indexer_k_cache", indexer=True)
    valid = _check_slots(slot_mapping, pages, block_size, "slot_mapping")
    s = slot_mapping[valid].long()
    blk, off = s // block_size, s % block_size
    base = blk * pages.stride(0)
    flat = _flat(pages)
    ar = torch.arange(L.INDEXER_DIM, device=s.device)
    flat[((base + off * L.INDEXER_DIM).unsqueeze(1) + ar).reshape(-1)] = q_bytes[:slot_mapping.shape[0]][valid].reshape(-1)
    sb = scale[:slot_mapping.shape[0]][valid].float().contiguous().view(torch.uint8).reshape(-1, 4)
    flat[((base + block_size * L.INDEXER_DIM + off * 4).unsqueeze(1) + torch.arange(4, device=s.device)).reshape(-1)] = sb.reshape(-1)


def indexer_k_gather(cache: torch.Tensor, slots: torch.Tensor, block_size: int):
    """(fp8 bytes uint8 [N, 128], fp32 scale [N]) at slots; zeros for negative slots."""
    pages = as_pages(cache, block_size, "indexer_k_cache", indexer=True)
    valid = _check_slots(slots, pages, block_size, "slots")
    s = torch.where(valid, slots, torch.zeros_like(slots)).long()
    blk, off = s // block_size, s % block_size
    base = blk * pages.stride(0)
    flat = _flat(pages)
    q = flat[(base + off * L.INDEXER_DIM).unsqueeze(1) + torch.arange(L.INDEXER_DIM, device=s.device)]
    sc = flat[(base + block_size * L.INDEXER_DIM + off * 4).unsqueeze(1) + torch.arange(4, device=s.device)]
    sc = sc.contiguous().view(torch.float32).reshape(-1)
    return torch.where(valid.unsqueeze(1), q, torch.zeros_like(q)), torch.where(valid, sc, torch.zeros_like(sc))
