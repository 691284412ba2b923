"""Every view of a paged cache that an engine holds, reduced to one form (docs/conventions.md, "Call forms").

A page holds ``block_size`` records of a record format (``dsv4_rocm.layout.RecordFormat``), page-split
(the data bytes of record ``o`` at ``o * data_bytes``, its scale bytes at ``block_size * data_bytes +
o * scale_bytes``) or interleaved (record ``o`` whole at ``o * token_bytes``). For example:

    V40_584        584 B a record: 576 data (448 e4m3 NoPE, 64 bf16 RoPE), 8 scale (7 UE8M0 + 1 pad)
    INDEXER_K_132  132 B a record: 128 data (e4m3), 4 scale (one fp32)

A cache is accepted as any of these (uint8 bytes, or a float8_e4m3fn view of them):

    [nb, bs, R]               vLLM's allocation (R = record bytes); stride(0) is the page stride
    [nb, bs * R]              its ``.view(nb, -1)``, or an unpadded buffer as vLLM's tests allocate
    [nb, page_bytes]          a padded page (``layout.page_bytes``), as ``reference.cache.new_cache`` allocates
    [nb, bs, 1, R]            FlashMLA's ``unsqueeze(-2)`` of the 3-D view

The page stride is always ``stride(0)``, whatever the shape says; the first ``bs * R`` bytes of a page are
the records, and bytes past them (page padding) are never read or written. ``pages`` returns a uint8
``[nb, bs * R]`` view with strides ``(page stride, 1)`` over the same memory: the only form the ops and
kernels see. Page strides and the cache's start are multiples of 16 bytes (every allocation an engine
makes is): the GPU kernels move records 16 bytes at a time.
"""
import torch

from . import layout as L

ALIGN = 16

FP8_DS_MLA = L.V40_584
INDEXER_K = L.INDEXER_K_132


def _fail(name, cache, what):
    raise ValueError(f"{name}: {what} (got shape {tuple(cache.shape)}, stride {cache.stride()}, "
                     f"dtype {cache.dtype})")


def pages(cache, block_size: int, name: str = "k_cache", fmt: L.RecordFormat = FP8_DS_MLA) -> torch.Tensor:
    """The uint8 ``[nb, block_size * R]`` view (page stride = ``cache.stride(0)``) of any accepted view."""
    if not isinstance(cache, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(cache).__name__}")
    if cache.dtype not in (torch.uint8, torch.float8_e4m3fn):
        raise ValueError(f"{name} must have dtype torch.uint8 or torch.float8_e4m3fn, got {cache.dtype}")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    rec = fmt.token_bytes
    used = block_size * rec
    padded = L.page_bytes(block_size, fmt)
    shape, st = cache.shape, cache.stride()
    nd = len(shape)
    nb = shape[0] if nd else 0
    if nd == 2:
        if shape[1] not in (used, padded) or st[1] != 1:
            _fail(name, cache, f"a 2-D {fmt.name} cache must be [nb, {used}] or [nb, {padded}] bytes with unit "
                               f"inner stride for block_size {block_size}")
    elif nd == 3 or nd == 4:
        if shape[1] != block_size or shape[-1] != rec or (nd == 4 and shape[2] != 1):
            want = (block_size, rec) if nd == 3 else (block_size, 1, rec)
            _fail(name, cache, f"a {nd}-D {fmt.name} cache must be [nb, "
                               f"{', '.join(map(str, want))}] for block_size {block_size}")
        if st[-1] != 1 or (block_size > 1 and st[1] != rec):
            _fail(name, cache, f"the records of a {nd}-D {fmt.name} cache must be dense ({rec} B apart)")
    else:
        _fail(name, cache, f"a {fmt.name} cache must be 2-D, 3-D or 4-D")
    stride = st[0]
    if nb > 1 and stride < used:
        _fail(name, cache, f"page stride {stride} is smaller than the {used} bytes of a page's records")
    if nb > 1 and stride % ALIGN:
        _fail(name, cache, f"page stride {stride} is not a multiple of {ALIGN} bytes")
    offset = cache.storage_offset()
    if offset % ALIGN:                   # uint8 and fp8 elements are bytes
        _fail(name, cache, f"the cache must start at a multiple of {ALIGN} bytes of its storage")
    raw = cache.view(torch.uint8) if cache.dtype != torch.uint8 else cache
    return torch.as_strided(raw, (nb, used), (max(stride, used) if nb <= 1 else stride, 1), offset)


def detect_format(cache, block_size: int, name: str = "k_cache", layout: str = None) -> L.RecordFormat:
    """The KV record format (``layout.KV_FORMATS``, in ``layout``) of a cache view: named by the last
    dimension of a 3-D / 4-D view (vLLM's and FlashMLA's), or the one format whose pages (unpadded or
    padded) a 2-D view's rows are; a ValueError naming ``name`` otherwise."""
    if not isinstance(cache, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(cache).__name__}")
    if cache.dim() in (3, 4):
        return L.with_layout(L.format_for_token_bytes(cache.shape[-1], name), layout)
    if cache.dim() == 2 and isinstance(block_size, int) and block_size > 0:
        fits = [f for f in (L.with_layout(f, layout) for f in L.KV_FORMATS)
                if cache.shape[1] in (block_size * f.token_bytes, L.page_bytes(block_size, f))]
        if len(fits) == 1:
            return fits[0]
        if len(fits) > 1:
            raise ValueError(f"{name}: rows of {cache.shape[1]} B fit the {', '.join(f.name for f in fits)} pages "
                             f"of {block_size} records; pass the [num_blocks, block_size, bytes_per_token] view")
    if cache.dim() == 2:
        raise ValueError(f"{name}: rows of {cache.shape[1]} B are no page of {block_size!r} records of a KV record "
                         f"format ({', '.join(f.name for f in L.KV_FORMATS)})")
    raise ValueError(f"{name}: a KV cache must be 2-D, 3-D or 4-D, got shape {tuple(cache.shape)}")


def capacity(p: torch.Tensor, block_size: int) -> int:
    """Slots of a ``pages`` view: ``num_blocks * block_size``."""
    return p.shape[0] * block_size


def flat_bytes(p: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view from the first byte of page 0 to the last record byte of the last page."""
    nb, used = p.shape
    n = (nb - 1) * p.stride(0) + used if nb else 0
    return torch.as_strided(p, (n,), (1,), p.storage_offset())


def record_byte_index(slots: torch.Tensor, block_size: int, page_stride: int, fmt: L.RecordFormat = FP8_DS_MLA):
    """Byte offsets (into ``flat_bytes``) of the data and scale bytes of the records at valid ``slots``:
    (int64 [n, data_bytes], int64 [n, scale_bytes]), by ``layout.data_offset`` / ``record_scale_offset``."""
    s = slots.long()
    base = (s // block_size) * page_stride
    off = s % block_size
    data = (base + L.data_offset(fmt, off)).unsqueeze(1) + torch.arange(fmt.data_bytes, device=s.device)
    scale = (base + L.record_scale_offset(fmt, block_size, off)).unsqueeze(1) \
        + torch.arange(fmt.scale_bytes, device=s.device)
    return data, scale


def new_pages(num_blocks: int, block_size: int, fmt: L.RecordFormat = FP8_DS_MLA, device=None, fill: int = 0):
    """A ``[num_blocks, layout.page_bytes(bs, fmt)]`` uint8 cache filled with ``fill``."""
    return torch.full((num_blocks, L.page_bytes(block_size, fmt)), fill, dtype=torch.uint8, device=device)


def is_plain_row_cache(kv_cache) -> bool:
    """Whether ``kv_cache`` holds plain [448 NoPE | 64 RoPE] rows (bfloat16, or float8_e4m3fn 512 wide) rather
    than paged records (uint8, or their float8_e4m3fn view, 584 / 528 / 288 wide): vLLM's dispatch."""
    return kv_cache.dtype == torch.bfloat16 or (kv_cache.dtype == torch.float8_e4m3fn
                                                and kv_cache.shape[-1] == L.HEAD_DIM)
