"""fp8_ds_mla paged-cache geometry (docs/cache_format.md#page). Numbers only; no tensors are touched here.

Per token, 584 bytes split over two regions of a page:

    page base + [0, bs*576)              token i data at i*576: 448 e4m3 bytes (NoPE) + 64 bf16 (RoPE)
    page base + [bs*576, bs*576 + bs*8)  token i scales at bs*576 + i*8: 7 UE8M0 bytes + 1 pad byte (0)
    padding up to a multiple of 576 B     (FlashMLA reads pages at 576-B alignment)

The indexer K cache (C4 layers) uses the same idea with 128 fp8 bytes + one fp32 scale per entry.
A slot id is ``block * block_size + offset``; -1 means "no slot".
"""

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


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")


def page_bytes(block_size: int) -> int:
    """Bytes of one fp8_ds_mla page holding ``block_size`` tokens (37440 for 64, 1728 for 2)."""
    _check_block_size(block_size)
    return round_up(block_size * TOKEN_BYTES, PAGE_ALIGN)


def scale_offset(block_size: int) -> int:
    """Byte offset of the scale region inside a page."""
    _check_block_size(block_size)
    return block_size * DATA_BYTES


def indexer_page_bytes(block_size: int) -> int:
    """Bytes of one indexer-K page: ``[bs x 128 fp8][bs x fp32 scale]``, padded to 576 (8640 for 64)."""
    _check_block_size(block_size)
    return round_up(block_size * INDEXER_TOKEN_BYTES, PAGE_ALIGN)


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


def token_byte_offsets(slot: int, block_size: int) -> tuple:
    """(data offset, scale offset) of a slot's bytes from the start of the cache."""
    blk, off = split_slot(slot, block_size)
    base = blk * page_bytes(block_size)
    return base + off * DATA_BYTES, base + scale_offset(block_size) + off * SCALE_BYTES
