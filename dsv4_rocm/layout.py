"""Paged-cache geometry (docs/cache_format.md#page): record formats as values, page and slot arithmetic; and
the geometry of the ops' other buffers (index widths, state-cache blocks, scale rows, the slices the
metadata ops write), which the oracles (dsv4_rocm/reference) and the kernels (dsv4_rocm/triton) both take
from here. Numbers and shapes only: no tensor's values are read or written here.

A record format (``RecordFormat``) says how one token's 512-dim latent is stored: how many bytes, which
leading dims are quantized (e4m3 or e2m1) in blocks of how many dims, the scale encoding, what follows as
bf16, and how a page arranges its records:

    page-split (V4.0 everywhere; the V4.1 records of FlashMLA's 2026-09-10 release and of vLLM before 0.33)
        page base + [0, bs*D)              record o's data bytes at o*D   (D = data_bytes)
        page base + [bs*D, bs*(D + S))     record o's scale bytes at bs*D + o*S   (S = scale_bytes)
        padding up to a multiple of page_align
    interleaved (the V4.1 records of vLLM 0.33 and FlashMLA's 2026-09-30 release)
        page base + o*R                    record o's data bytes, then its scale bytes (R = token_bytes)

The KV formats (the constants are page-split; ``interleaved(fmt)`` is the same record in the per-token
layout; ``with_layout(fmt, None)`` the layout vLLM 0.33 writes the format in, ``default_layout``):

    V40_584      DeepSeek-V4.0's fp8_ds_mla: 448 e4m3 + 64 bf16 RoPE, 7 UE8M0 per 64 + a pad byte; pages
                 padded to 576 B. Its numbers are also the module constants below.
    V41_528      DeepSeek-V4.1: all 512 dims e4m3 (RoPE dims 448..511 included, RoPE applied before the
                 quantization), 16 UE8M0 per 32; pages padded to 512 B
    V41_FP4_288  DeepSeek-V4.1's compressed cache option: 512 e2m1 (two a byte), 32 e4m3 scales per 16;
                 pages padded to 512 B; only as the extra (compressed) cache beside a V41_528 main cache

``with_fnuz(fmt)``: the same record with e4m3fnuz bytes, as vLLM writes its sliding-window cache on gfx942
(maximum 224, each UE8M0 scale byte one higher than the e4m3fn record's, poisoned blocks 0x80).

The indexer K cache (C4 layers) is INDEXER_K_132 (128 e4m3 + one fp32 scale). A slot id is
``block * block_size + offset``; -1 means "no slot".
"""
from typing import NamedTuple

import torch

HEAD_DIM = 512
NOPE_DIM = 448
ROPE_DIM = 64
QUANT_BLOCK = 64                      # NoPE values per UE8M0 scale
NUM_SCALES = NOPE_DIM // QUANT_BLOCK  # 7

DATA_BYTES = NOPE_DIM + 2 * ROPE_DIM  # 576: fp8 NoPE then bf16 RoPE
SCALE_BYTES = NUM_SCALES + 1          # 8: seven UE8M0 bytes and one pad byte
TOKEN_BYTES = DATA_BYTES + SCALE_BYTES  # 584
PAGE_ALIGN = 576

INDEXER_DIM = 128
INDEXER_TOKEN_BYTES = INDEXER_DIM + 4  # fp8 values + one fp32 scale

SWA_BLOCK_SIZE = 64                   # vLLM's DeepseekV4SWACache block
LOGICAL_BLOCK_TOKENS = 256            # compressed layers: 256 token positions per logical block


class RecordFormat(NamedTuple):
    """One paged-cache record format. A value: hashable, comparable, and passed to the Triton kernels as a
    single constexpr (their address and dequantization arithmetic is written in these fields)."""
    name: str
    token_bytes: int        # bytes of one record (data + scales)
    data_bytes: int         # its data bytes: quantized dims, then bf16 dims
    scale_bytes: int        # its scale bytes (scales, then pad bytes written 0)
    quant_dims: int         # leading dims stored quantized; dims quant_dims .. 511 are bf16
    elem_bits: int          # 8: e4m3fn bytes; 4: e2m1 nibbles, dim 2i in the low nibble of byte i
    quant_block: int        # consecutive quantized dims sharing one scale
    scale: str              # "ue8m0": byte b scales by 2^(b - 127); "e4m3": an e4m3fn value; "fp32"
    page_align: int         # page-split pages are padded to a multiple of this many bytes
    interleaved: bool       # False: page-split; True: each record's data then its scales (FlashMLA DS-0930)
    fp8: str = "e4m3fn"     # what the e4m3 bytes mean: "e4m3fn" (OCP) or "e4m3fnuz" (vLLM's gfx942 flavour)

    @property
    def num_scales(self) -> int:
        return self.quant_dims // self.quant_block

    @property
    def quant_bytes(self) -> int:
        return self.quant_dims * self.elem_bits // 8

    @property
    def layout(self) -> str:
        return "interleaved" if self.interleaved else "page_split"

    @property
    def fnuz(self) -> bool:
        return self.fp8 == "e4m3fnuz"

    @property
    def fp8_max(self) -> float:
        """The largest magnitude the writers store: 448 (e4m3fn), 224 (vLLM's FNUZ maximum, not the dtype's 240)."""
        return 224.0 if self.fnuz else 448.0


V40_584 = RecordFormat("V40_584", TOKEN_BYTES, DATA_BYTES, SCALE_BYTES, NOPE_DIM, 8, QUANT_BLOCK, "ue8m0",
                       PAGE_ALIGN, False)
INDEXER_K_132 = RecordFormat("INDEXER_K_132", INDEXER_TOKEN_BYTES, INDEXER_DIM, 4, INDEXER_DIM, 8, INDEXER_DIM,
                             "fp32", PAGE_ALIGN, False)
V41_528 = RecordFormat("V41_528", 528, 512, 16, HEAD_DIM, 8, 32, "ue8m0", 512, False)
V41_FP4_288 = RecordFormat("V41_FP4_288", 288, 256, 32, HEAD_DIM, 4, 16, "e4m3", 512, False)
KV_FORMATS = (V40_584, V41_528, V41_FP4_288)      # the formats of the attention caches (main and extra)


def interleaved(fmt: RecordFormat) -> RecordFormat:
    """``fmt`` in the per-token interleaved page layout (pages are ``bs * token_bytes``, no padding)."""
    return fmt._replace(interleaved=True, page_align=fmt.token_bytes)


def with_fnuz(fmt: RecordFormat, fnuz: bool = True) -> RecordFormat:
    """``fmt`` with e4m3fnuz bytes (``fnuz``; False: e4m3fn), vLLM's gfx942 sliding-window flavour
    (docs/cache_format.md#fnuz-flavour): the same layout and block rule with a maximum of 224, so each
    block's bytes are its e4m3fn bytes and its UE8M0 scale byte is one higher; a poisoned block's bytes are
    0x80 (fnuz NaN). Only formats of e4m3 values with UE8M0 scales have the flavour (V40_584, V41_528)."""
    if not isinstance(fnuz, bool):
        raise ValueError(f"use_fnuz must be a bool (True: the FNUZ flavour of the record, vLLM's gfx942 sliding-"
                         f"window cache), got {fnuz!r}")
    if fnuz and not (fmt.elem_bits == 8 and fmt.scale == "ue8m0"):
        raise ValueError(f"use_fnuz: {fmt.name} records have no FNUZ flavour (only e4m3 values with UE8M0 scales)")
    return fmt._replace(fp8="e4m3fnuz" if fnuz else "e4m3fn")


def default_layout(fmt: RecordFormat) -> str:
    """The page layout vLLM 0.33 writes ``fmt`` in, which FlashMLA's current release reads: "interleaved" for
    the V4.1 records (vLLM's V4.1 writers put each token's scales right after its own data), "page_split"
    for V40_584 (its only layout)."""
    return "interleaved" if fmt.name in (V41_528.name, V41_FP4_288.name) else "page_split"


def with_layout(fmt: RecordFormat, layout: str = None) -> RecordFormat:
    """``fmt`` (page-split) in the page layout named "page_split" or "interleaved", or for None in its
    ``default_layout``. Interleaved records must be whole multiples of 16 bytes (the kernels move records 16
    bytes at a time): V40_584 is page-split only."""
    if layout is None:
        layout = default_layout(fmt)
    if layout not in ("page_split", "interleaved"):
        raise ValueError(f"kv_layout must be 'page_split', 'interleaved' or None (the format's default), got "
                         f"{layout!r}")
    if layout == "page_split":
        return fmt
    if fmt.token_bytes % 16:
        raise ValueError(f"kv_layout 'interleaved': {fmt.name} records ({fmt.token_bytes} B) are page-split only")
    return interleaved(fmt)


def valid_pair(main: RecordFormat, extra: RecordFormat) -> bool:
    """The (k_cache, extra_k_cache) formats FlashMLA pairs: one format twice, or V41_528 with V41_FP4_288
    (an e2m1 cache is never the main one)."""
    if main.elem_bits == 4:
        return False
    return extra.name == main.name or (main.name == V41_528.name and extra.name == V41_FP4_288.name)


def format_for_token_bytes(n: int, name: str = "k_cache") -> RecordFormat:
    """The attention-cache format whose records are ``n`` bytes (page-split), or a ValueError naming ``name``."""
    for f in KV_FORMATS:
        if f.token_bytes == n:
            return f
    raise ValueError(f"{name}: no KV record format is {n} bytes a token (known: "
                     f"{', '.join(f'{f.token_bytes} ({f.name})' for f in KV_FORMATS)})")


def data_offset(fmt: RecordFormat, off: int) -> int:
    """Byte offset inside a page of the data bytes of record ``off``."""
    return off * (fmt.token_bytes if fmt.interleaved else fmt.data_bytes)


def record_scale_offset(fmt: RecordFormat, block_size: int, off: int) -> int:
    """Byte offset inside a page of the scale bytes of record ``off``."""
    if fmt.interleaved:
        return off * fmt.token_bytes + fmt.data_bytes
    return block_size * fmt.data_bytes + off * fmt.scale_bytes


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")


def page_bytes(block_size: int, fmt: RecordFormat = V40_584) -> int:
    """Bytes of one page holding ``block_size`` records as vLLM allocates it (V40_584: 37440 for 64, 1728
    for 2); an interleaved page is exactly ``block_size * token_bytes``."""
    _check_block_size(block_size)
    return round_up(block_size * fmt.token_bytes, fmt.page_align)


def scale_offset(block_size: int, fmt: RecordFormat = V40_584) -> int:
    """Byte offset of the scale region inside a page-split page."""
    _check_block_size(block_size)
    return block_size * fmt.data_bytes


def indexer_page_bytes(block_size: int) -> int:
    """Bytes of one indexer-K page: ``[bs x 128 fp8][bs x fp32 scale]``, padded to 576 (8640 for 64)."""
    return page_bytes(block_size, INDEXER_K_132)


def compressed_block_size(ratio: int) -> int:
    """Entries per page of a compressed cache: 256 positions / ratio (64 for C4, 2 for C128)."""
    if ratio not in (4, 128):
        raise ValueError(f"compress ratio must be 4 or 128, got {ratio!r}")
    return LOGICAL_BLOCK_TOKENS // ratio


def slot_id(block: int, offset: int, block_size: int) -> int:
    _check_block_size(block_size)
    if not 0 <= offset < block_size:
        raise ValueError(f"offset {offset} outside block of {block_size}")
    return block * block_size + offset


def split_slot(slot: int, block_size: int) -> tuple:
    """(block, offset) of a slot id."""
    _check_block_size(block_size)
    if slot < 0:
        raise ValueError(f"slot {slot} is invalid (negative)")
    return divmod(slot, block_size)


def token_byte_offsets(slot: int, block_size: int, fmt: RecordFormat = V40_584) -> tuple:
    """(data offset, scale offset) of a slot's bytes from the start of a cache of ``page_bytes`` pages."""
    blk, off = split_slot(slot, block_size)
    base = blk * page_bytes(block_size, fmt)
    return base + data_offset(fmt, off), base + record_scale_offset(fmt, block_size, off)


# ---- geometry of the ops' other buffers (the oracles and the kernels take it from here) ------------------
# FlashMLA's sparse prefill wants the index width to be a multiple of 128 (its B_TOPK); vLLM pads the
# combined prefill indices and the C128A width to it, the padding stays -1
TOPK_ALIGNMENT = 128


def state_block_size(ratio: int) -> int:
    """Tokens per state-cache block, as vLLM's CompressorStateCache allocates them."""
    return 4 if ratio == 4 else 8


def tma_aligned_tokens(num_tokens: int) -> int:
    """Rows of the MN-major scale storage: T rounded up to a multiple of 4 (16 bytes of 4-byte scales)."""
    return (num_tokens + 3) // 4 * 4


def c128a_effective_width(max_seq_len: int, compress_ratio: int, max_compressed_tokens: int) -> int:
    """Width of the C128A index rows when the caller passes ``max_seq_len`` (later vLLM): the entries the
    longest sequence can see, rounded up to 128, capped at max_compressed_tokens (0 for an empty batch)."""
    max_pos = int(max_seq_len) - 1
    if max_pos < 0:
        return 0
    n = min(max((max_pos + 1) // compress_ratio, 0), max_compressed_tokens)
    if n == 0:
        return min(max_compressed_tokens, TOPK_ALIGNMENT)
    return min(max_compressed_tokens, -(-n // TOPK_ALIGNMENT) * TOPK_ALIGNMENT)


def combined_width(topk: int, window_size: int, max_image_tokens: int = 0) -> int:
    """Columns of combine_topk_swa_indices' output: topk + window + max_image_tokens rounded up to 128."""
    return -(-(topk + window_size + max_image_tokens) // TOPK_ALIGNMENT) * TOPK_ALIGNMENT


# The buffers three metadata ops write, as slices of the caller's buffers or new tensors: shapes only, no
# value is read or written here.
def c128a_slices(num_tokens: int, num_decode_tokens: int, compress_ratio: int, global_decode_buffer,
                 decode_lens_buffer, prefill_buffer, max_compressed_tokens: int, max_seq_len=None):
    """(the three buffer slices build_c128a_topk_metadata returns, the cap on entries per token): the first
    ``max_compressed_tokens`` columns of each row (vLLM's form: a buffer allocated wider keeps its stride,
    and its columns past the slice are not touched), the first ``c128a_effective_width`` columns when
    ``max_seq_len`` is given."""
    nd, npf = num_decode_tokens, num_tokens - num_decode_tokens
    if max_seq_len is None:
        w = max_compressed_tokens
        return (global_decode_buffer[:nd, :w], decode_lens_buffer[:nd], prefill_buffer[:npf, :w]), w
    w = c128a_effective_width(max_seq_len, compress_ratio, max_compressed_tokens) if num_tokens else 0
    return (global_decode_buffer[:nd, :w], decode_lens_buffer[:nd], prefill_buffer[:npf, :w]), w


def combine_outputs(topk_indices, topk: int, window_size: int, combined_indices=None, combined_lens=None,
                    max_image_tokens: int = 0):
    """(indices, lens) combine_topk_swa_indices writes: the first len(topk_indices) rows of the caller's
    buffers, or new int32 tensors of ``combined_width`` columns."""
    T, dev = topk_indices.shape[0], topk_indices.device
    ci = combined_indices[:T] if combined_indices is not None else \
        torch.empty(T, combined_width(topk, window_size, max_image_tokens), dtype=torch.int32, device=dev)
    cl = combined_lens[:T] if combined_lens is not None else torch.empty(T, dtype=torch.int32, device=dev)
    return ci, cl


def global_topk_outputs(topk_indices, output_buffers=None):
    """(indices, lens) compute_global_topk_indices_and_lens writes: the caller's pair, or new tensors."""
    if output_buffers is not None:
        return tuple(output_buffers)
    T, K = topk_indices.shape
    return (torch.empty(T, K, dtype=topk_indices.dtype, device=topk_indices.device),
            torch.empty(T, dtype=torch.int32, device=topk_indices.device))
