"""KV cache records and paged caches (docs/cache_format.md): encode, insert, gather, dequantize.

A record format (``dsv4_rocm.layout.RecordFormat``) stores a token's 512 values as ``quant_dims``
quantized values (e4m3 bytes or e2m1 nibbles, one scale per ``quant_block`` dims), then the remaining dims
as bf16, then the scales and pad bytes. V40_584: [448 e4m3 NoPE][64 bf16 RoPE as 128 bytes][7 UE8M0][1 pad
byte = 0]. In a page-split page the data bytes of every record come first and the scale bytes after;
in an interleaved page each record is whole (``dsv4_rocm.layout``). The e4m3 bytes are OCP e4m3fn, or,
in a format of ``layout.with_fnuz``, the FNUZ flavour vLLM writes into its sliding-window cache on gfx942
(``quant.quantize_blocks``, docs/cache_format.md#fnuz-flavour). The indexer-K cache (C4 layers) stores 128
e4m3 bytes at ``off*128`` and the fp32 scale 2^e at ``bs*128 + off*4``. Caches come in any view
of ``dsv4_rocm.cache_views``; the page stride is ``stride(0)``.

Invalid indices (negative, or past the cache / block table / output) are padding here: a writer skips
them, a reader yields zero rows (docs/conventions.md). The public ops reject them before calling these
where value checks run.
"""
import torch

from .. import cache_views as V
from .. import layout as L
from .quant import (dequantize_blocks, exponent_to_ue8m0, nvfp4_dequantize, nvfp4_quantize, quantize_blocks,
                    ue8m0_to_exponent)

KV_EPS = 1e-4


# ---- page views ---------------------------------------------------------------------------------
def as_pages(cache: torch.Tensor, block_size: int, name: str = "k_cache", indexer: bool = False,
             fmt: L.RecordFormat = L.V40_584) -> torch.Tensor:
    """The ``cache_views.pages`` view. FlashMLA's 4-D view of a V40_584 cache must also have a page stride
    that is a multiple of 576 B (FlashMLA reads those pages at that alignment)."""
    fmt = L.INDEXER_K_132 if indexer else fmt
    p = V.pages(cache, block_size, name, fmt)
    if cache.dim() == 4 and fmt.name == L.V40_584.name and cache.shape[0] > 1 and cache.stride(0) % L.PAGE_ALIGN:
        raise ValueError(f"{name}: page stride {cache.stride(0)} is not a multiple of {L.PAGE_ALIGN} B")
    return p


def new_cache(num_blocks: int, block_size: int, device=None, indexer: bool = False,
              fmt: L.RecordFormat = L.V40_584) -> torch.Tensor:
    """An empty (zeroed) cache of [num_blocks, page_bytes] uint8 (pages padded as ``layout.page_bytes``)."""
    return V.new_pages(num_blocks, block_size, L.INDEXER_K_132 if indexer else fmt, device)


def flash_mla_view(pages: torch.Tensor, block_size: int, fmt: L.RecordFormat = L.V40_584) -> torch.Tensor:
    """FlashMLA's [nb, bs, 1, token_bytes] view over [nb, page_bytes] pages (shape carrier, page stride kept)."""
    nb, stride, r = pages.shape[0], pages.stride(0), fmt.token_bytes
    return torch.as_strided(pages, (nb, block_size, 1, r), (stride, r, r, 1), pages.storage_offset())


def _valid(slots: torch.Tensor, cap: int) -> torch.Tensor:
    return (slots >= 0) & (slots < cap)


# ---- records --------------------------------------------------------------------------------------
def quantize_dims(x: torch.Tensor, fmt: L.RecordFormat):
    """fp32 x [T, quant_dims] -> (data bytes uint8 [T, quant_bytes], scale bytes uint8 [T, num_scales])."""
    if fmt.elem_bits == 8 and fmt.scale == "ue8m0":
        q, e = quantize_blocks(x, fmt.quant_block, KV_EPS, fmt.fnuz)
        return q, exponent_to_ue8m0(e)
    if fmt.elem_bits == 4 and fmt.scale == "e4m3":
        return nvfp4_quantize(x, fmt.quant_block)
    raise ValueError(f"{fmt.name}: no quantizer for {fmt.elem_bits}-bit values with {fmt.scale} scales")


def dequantize_dims(data: torch.Tensor, scales: torch.Tensor, fmt: L.RecordFormat) -> torch.Tensor:
    """Inverse of ``quantize_dims``: fp32 [N, quant_dims] (exact: every product is a bf16 value)."""
    if fmt.elem_bits == 8 and fmt.scale == "ue8m0":
        return dequantize_blocks(data, ue8m0_to_exponent(scales), fmt.quant_block, fmt.fnuz)
    if fmt.elem_bits == 4 and fmt.scale == "e4m3":
        return nvfp4_dequantize(data, scales, fmt.quant_block)
    raise ValueError(f"{fmt.name}: no dequantizer for {fmt.elem_bits}-bit values with {fmt.scale} scales")


def _assemble(x: torch.Tensor, bf16_tail: torch.Tensor, fmt: L.RecordFormat) -> torch.Tensor:
    """Records from fp32 x [T, 512] (its first quant_dims dims quantized) and the bf16 dims after them."""
    q, sc = quantize_dims(x[:, :fmt.quant_dims], fmt)
    pad = torch.zeros(x.shape[0], fmt.scale_bytes - sc.shape[1], dtype=torch.uint8, device=x.device)
    return torch.cat([q, bf16_tail.contiguous().view(torch.uint8), sc, pad], dim=1)


def encode_values(x: torch.Tensor, fmt: L.RecordFormat = L.V40_584) -> torch.Tensor:
    """fp32 [T, 512] -> uint8 [T, token_bytes] records (data bytes, then scale bytes): dims < quant_dims
    quantized from x as given (no bf16 rounding first), the others stored as bf16 (RNE; NaN as 0x7FC0)."""
    x = x.float()
    tail = x[:, fmt.quant_dims:]
    bf = tail.to(torch.bfloat16).view(torch.int16)
    return _assemble(x, torch.where(torch.isnan(tail), torch.full_like(bf, 0x7FC0), bf), fmt)


def encode_k_records(k: torch.Tensor, fmt: L.RecordFormat = L.V40_584) -> torch.Tensor:
    """bf16 [T, 512] (RoPE already applied) -> uint8 [T, token_bytes] records; bf16 dims keep their bits."""
    if k.dim() != 2 or k.shape[1] != L.HEAD_DIM or k.dtype != torch.bfloat16:
        raise ValueError(f"k must be bf16 [T, 512], got {k.dtype} {tuple(k.shape)}")
    return _assemble(k.float(), k[:, fmt.quant_dims:], fmt)


def decode_k_records(rec: torch.Tensor, fmt: L.RecordFormat = L.V40_584) -> torch.Tensor:
    """uint8 [N, token_bytes] -> fp32 [N, 512]: the K (= V) values every attention kernel sees."""
    d = fmt.data_bytes
    vals = dequantize_dims(rec[:, :fmt.quant_bytes], rec[:, d:d + fmt.num_scales], fmt)
    if fmt.quant_dims < L.HEAD_DIM:
        vals = torch.cat([vals, rec[:, fmt.quant_bytes:d].contiguous().view(torch.bfloat16).float()], dim=1)
    return vals


def _write_records(rec, cache, slots, block_size, fmt):
    """Write rows of ``rec`` ([n, record bytes]) at ``slots``; invalid slots are skipped."""
    pages = V.pages(cache, block_size, "k_cache", fmt)
    ok = _valid(slots, V.capacity(pages, block_size))
    data, scale = V.record_byte_index(slots[ok], block_size, pages.stride(0), fmt)
    flat = V.flat_bytes(pages)
    rec = rec[ok]
    flat[data.reshape(-1)] = rec[:, :fmt.data_bytes].reshape(-1)
    flat[scale.reshape(-1)] = rec[:, fmt.data_bytes:].reshape(-1)


def _read_records(cache, slots, block_size, fmt):
    """uint8 [*slots.shape, record bytes] records at slots; zero rows for invalid slots."""
    pages = V.pages(cache, block_size, "k_cache", fmt)
    s = slots.reshape(-1)
    ok = _valid(s, V.capacity(pages, block_size))
    data, scale = V.record_byte_index(torch.where(ok, s, torch.zeros_like(s)), block_size, pages.stride(0), fmt)
    flat = V.flat_bytes(pages)
    if flat.numel() == 0:
        rec = torch.zeros(s.shape[0], fmt.token_bytes, dtype=torch.uint8, device=s.device)
    else:
        rec = torch.cat([flat[data], flat[scale]], dim=1)
    rec = torch.where(ok.unsqueeze(1), rec, torch.zeros_like(rec))
    return rec.reshape(*slots.shape, fmt.token_bytes)


def insert_k_records(rec: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor, block_size: int,
                     fmt: L.RecordFormat = L.V40_584) -> None:
    """Write records at slots (invalid slots skipped); only the first len(slot_mapping) records are used."""
    n = slot_mapping.shape[0]
    _write_records(rec[:n], k_cache, slot_mapping, block_size, fmt)


def gather_k_records(k_cache: torch.Tensor, slots: torch.Tensor, block_size: int,
                     fmt: L.RecordFormat = L.V40_584) -> torch.Tensor:
    """uint8 [*slots.shape, token_bytes] records at slots; rows of invalid slots are zero."""
    return _read_records(k_cache, slots, block_size, fmt)


def _decoded_bf16(k_cache, slots, block_size, fmt):
    """bf16 [*slots.shape, 512] values at slots, zero rows for invalid slots. Exact: an fp8 value times a
    power of two (or an e2m1 value times an e4m3 scale) is a bf16 value (the one fp32 -> bf16 rounding only
    touches results below 2^-126)."""
    rec = gather_k_records(k_cache, slots, block_size, fmt)
    out = decode_k_records(rec.reshape(-1, fmt.token_bytes), fmt).to(torch.bfloat16)
    ok = _valid(slots.reshape(-1), V.capacity(V.pages(k_cache, block_size, "k_cache", fmt), block_size))
    out = torch.where(ok.unsqueeze(1), out, torch.zeros_like(out))
    return out.reshape(*slots.shape, L.HEAD_DIM)


def quantize_and_insert_k_cache(k: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor,
                                block_size: int = L.SWA_BLOCK_SIZE, fmt: L.RecordFormat = L.V40_584) -> None:
    """vLLM's op: quantize bf16 k [T, 512] (RoPE applied) into ``fmt`` records written at slot_mapping."""
    n = slot_mapping.shape[0]
    insert_k_records(encode_k_records(k[:n], fmt), k_cache, slot_mapping, block_size, fmt)


def gather_rows_and_slots(seq_lens, gather_lens, block_table, block_size: int, offset: int, rows: int):
    """Where ``dequantize_and_gather_k_cache`` writes: for request b and output row j, it writes row j when
    ``offset <= j < offset + gather_len_b`` (and j < rows), taking the token at position
    ``p = seq_len_b - gather_len_b + (j - offset)`` from page ``block_table[b, p // bs]``.
    Returns (written bool [R, rows], slot int64 [R, rows], -1 where p or its page is invalid)."""
    R = seq_lens.shape[0]
    dev = seq_lens.device
    seq = seq_lens.long().unsqueeze(1)
    gl = seq if gather_lens is None else gather_lens.long().unsqueeze(1)
    i = torch.arange(rows, device=dev).unsqueeze(0) - offset
    written = (i >= 0) & (i < gl)
    pos = seq - gl + i
    col = torch.div(pos, block_size, rounding_mode="floor")
    ok = written & (pos >= 0) & (col < block_table.shape[1])
    bt = block_table.long() if block_table.shape[1] else torch.full((R, 1), -1, device=dev)
    page = torch.gather(bt, 1, torch.where(ok, col, torch.zeros_like(col)))
    slot = torch.where(ok & (page >= 0), page * block_size + pos % block_size, torch.full_like(pos, -1))
    return written, slot


def dequantize_and_gather_k_cache(out: torch.Tensor, k_cache: torch.Tensor, seq_lens: torch.Tensor, gather_lens,
                                  block_table: torch.Tensor, block_size: int, offset: int,
                                  fmt: L.RecordFormat = L.V40_584) -> None:
    """vLLM's op: ``out[b, offset + i]`` = the bf16 K of request b's token at position
    ``seq_lens[b] - gather_lens[b] + i`` for ``i < gather_lens[b]`` (all ``seq_lens[b]`` tokens when
    gather_lens is None), through ``block_table``. Other rows of ``out`` are not written; a row whose
    position or page is invalid is written as zeros. ``fmt``: the records the cache holds (FNUZ-flavour ones
    in a format of ``layout.with_fnuz``)."""
    written, slot = gather_rows_and_slots(seq_lens, gather_lens, block_table, block_size, offset, out.shape[1])
    vals = _decoded_bf16(k_cache, slot, block_size, fmt)
    R = seq_lens.shape[0]
    out[:R][written] = vals[written]


def dequantize_global_slots_k_cache(out: torch.Tensor, k_cache: torch.Tensor, slot_ids: torch.Tensor,
                                    block_size: int, fmt: L.RecordFormat = L.V40_584) -> None:
    """``out[..., :] = `` the bf16 K at each slot of ``slot_ids`` (``out.shape = (*slot_ids.shape, 512)``);
    zero rows for invalid slots."""
    out.copy_(_decoded_bf16(k_cache, slot_ids, block_size, fmt))


# ---- indexer K cache ------------------------------------------------------------------------------
def indexer_k_insert(q_bytes: torch.Tensor, scale: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                     block_size: int) -> None:
    """Write 128 fp8 bytes + fp32 scale per entry at slot_mapping (invalid slots skipped)."""
    n = slot_mapping.shape[0]
    sb = scale[:n].float().contiguous().view(torch.uint8).reshape(-1, 4)
    _write_records(torch.cat([q_bytes[:n], sb], dim=1), cache, slot_mapping, block_size, L.INDEXER_K_132)


def indexer_k_gather(cache: torch.Tensor, slots: torch.Tensor, block_size: int):
    """(fp8 bytes uint8 [N, 128], fp32 scale [N]) at slots; zeros for invalid slots."""
    rec = _read_records(cache, slots, block_size, L.INDEXER_K_132)
    return rec[:, :L.INDEXER_DIM], rec[:, L.INDEXER_DIM:].contiguous().view(torch.float32).reshape(-1)
